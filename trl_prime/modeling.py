"""Generic model utilities shared by every trainer: position ids, unwrapping, fused LM heads, completion log-probs,
PEFT adapters, and frozen models next to TRL's policy (loading a copy, freezing and placing it, reading its log-probs).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable

import torch
from accelerate.utils import is_peft_model
from torch import nn


# Attribute set on a model whose forward carries TRL's fused LM head at temperature 1 (see `add_fused_head`)
_FUSED_ATTR = "_trl_prime_fused_t1"


# ----------------------------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------------------------
def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``(B, L)`` long from a 0/1 attention mask: 0 at the first real token, +1 per real token.

    Left padding gets position 0 (its value is irrelevant: padded keys are masked out). With these ids a left-padded
    row is scored exactly like the same row without padding.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / DeepSpeed engines (``.module``), else ``model`` itself."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _fused_base(model: nn.Module) -> nn.Module:
    base = unwrap(model)
    if hasattr(base, "get_base_model"):  # PeftModel: TRL patches the base model
        base = base.get_base_model()
    return base


def has_fused_head(model: nn.Module) -> bool:
    """Whether ``model`` (possibly wrapped) carries TRL's fused LM head at temperature 1 (see :func:`add_fused_head`)."""
    return bool(getattr(_fused_base(model), _FUSED_ATTR, False))


def add_fused_head(model: nn.Module, *, mark_only: bool = False) -> nn.Module:
    """Give a causal LM TRL's fused LM head at temperature 1 and mark it, so :func:`completion_logps` uses it.

    ``model(..., labels=..., fused_lm_head=True)`` then returns per-token log-probs without materialising the
    ``(B, T, V)`` logits; the ordinary forward (and ``generate``) is unchanged. ``mark_only=True`` only marks a model
    TRL already patched at temperature 1. Patch a model *before* copying it (a deep copy of a patched model keeps a
    forward bound to the original).
    """
    base = _fused_base(model)
    if getattr(base, _FUSED_ATTR, False):
        return model
    if not mark_only:
        try:
            from trl.trainer.utils import add_fused_lm_head
        except ImportError:  # pragma: no cover - older TRL: fall back to the logits path
            return model
        add_fused_lm_head(base, temperature=1.0)
    setattr(base, _FUSED_ATTR, True)
    return model


def _cum(counts) -> list[int]:
    """``[0, c0, c0 + c1, ...]``: the start of each row's items (and the end of the last)."""
    cum = [0]
    for c in counts:
        cum.append(cum[-1] + int(c))
    return cum


def _spans(counts, rows: list[int]) -> list[int]:
    """Indices of the items of ``rows``, row ``i`` owning ``counts[i]`` consecutive items."""
    cum = _cum(counts)
    return [j for i in rows for j in range(cum[i], cum[i + 1])]


def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    return x[torch.tensor(idx, dtype=torch.long, device=x.device)]


def _select_pixel_values(mm: dict, rows: list[int], images: list[int] | None) -> dict:
    """``pixel_values`` of ``rows`` and the inputs indexed like them (per image or per tile), as TRL 1.16 slices them
    (``images``: the indices of the rows' images)."""
    pv, num_images, num_tiles = mm["pixel_values"], mm.get("num_images"), mm.get("num_tiles")
    tiles = _spans(num_tiles, rows) if num_tiles is not None else None
    if mm.get("image_grid_thw") is not None:  # Qwen-VL: prod(thw) patches per image
        per_image, cum = mm["image_grid_thw"].prod(dim=-1).tolist(), _cum(num_images)
        per_row = [sum(per_image[a:b]) for a, b in zip(cum[:-1], cum[1:])]
        return {
            "pixel_values": _take(pv, _spans(per_row, rows)),
            "image_grid_thw": _take(mm["image_grid_thw"], images),
        }
    if mm.get("image_position_ids") is not None:
        return {"pixel_values": _take(pv, images), "image_position_ids": _take(mm["image_position_ids"], images)}
    if mm.get("spatial_shapes") is not None:  # LFM2-VL: per tile
        keys = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
        return {k: _take(mm[k], tiles) for k in keys}
    if num_tiles is not None:  # InternVL: per tile
        return {"pixel_values": _take(pv, tiles)}
    if num_images is not None and pv.size(0) == sum(num_images):  # per image
        return {"pixel_values": _take(pv, images)}
    return {"pixel_values": _take(pv, rows)}


def select_mm_rows(mm_inputs: dict, rows) -> dict:
    """The multimodal inputs of the batch rows ``rows``, laid out as TRL lays them out for those rows alone.

    ``mm_inputs`` holds TRL's multimodal inputs of a ``B``-row batch (``trl_prime.rollout.MM_KEYS``, as TRL's
    ``GRPOTrainer._get_per_token_logps_and_entropies`` takes them): ``pixel_values`` of a row are its images'
    patches (``image_grid_thw``: ``prod(thw)`` rows per image), its images (``num_images`` per row), its tiles
    (``num_tiles`` per row) or one entry per row, as TRL 1.16 slices them per micro-batch; ``image_grid_thw``,
    ``image_sizes`` and ``image_position_ids`` have one entry per image, ``spatial_shapes`` and LFM2-VL's
    ``pixel_attention_mask`` one per tile, ``token_type_ids`` / ``mm_token_type_ids`` one per row. ``rows`` is a list
    or a 1-D long tensor of row indices (any order). Returns a new dict (``num_images`` / ``num_tiles`` lists of the
    selected rows included).
    """
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    mm = {k: v for k, v in mm_inputs.items() if v is not None}
    num_images, num_tiles = mm.get("num_images"), mm.get("num_tiles")
    images = _spans(num_images, rows) if num_images is not None else None
    out = _select_pixel_values(mm, rows, images) if "pixel_values" in mm else {}
    if mm.get("pixel_attention_mask") is not None and mm.get("spatial_shapes") is None:
        out["pixel_attention_mask"] = _take(mm["pixel_attention_mask"], rows)
    if mm.get("image_sizes") is not None:
        out["image_sizes"] = _take(mm["image_sizes"], images)
    for k in ("token_type_ids", "mm_token_type_ids"):
        if mm.get(k) is not None:
            out[k] = _take(mm[k], rows)
    if num_images is not None:
        out["num_images"] = [num_images[i] for i in rows]
    if num_tiles is not None:
        out["num_tiles"] = [num_tiles[i] for i in rows]
    return out


def _forward_inputs(attention_mask: torch.Tensor, mm: dict, rows: range) -> dict:
    """The extra forward inputs of a micro-batch: position ids from the mask (text), or, as in TRL's forward of a
    vision-language model, the rows' multimodal inputs and no position ids."""
    if not mm:
        return {"position_ids": position_ids_from_mask(attention_mask)}
    return {k: v for k, v in select_mm_rows(mm, rows).items() if k not in ("num_images", "num_tiles")}


def completion_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    micro_batch_size: int | None = None,
    mm_inputs: dict | None = None,
) -> torch.Tensor:
    """Per-token log-probs of the last ``logits_to_keep`` tokens of each row under ``model``.

    Args:
        model: a causal LM (plain, PEFT, DDP-wrapped or a DeepSpeed engine). Called as is: grad mode, train/eval mode
            and active adapters are the caller's.
        input_ids: ``(B, L)`` long, prompt (left-padded) followed by the completion (right-padded).
        attention_mask: ``(B, L)`` 0/1, 0 on padding.
        logits_to_keep: ``T``, the completion length; the scored tokens are ``input_ids[:, -T:]``.
        micro_batch_size: rows per forward (``None``: all rows at once).
        mm_inputs: a vision-language model's multimodal inputs of the ``B`` rows (TRL's, ``pixel_values`` ...; see
            :func:`select_mm_rows`), sliced per micro-batch as TRL slices them; ``None`` or empty: text only.

    Returns:
        ``(B, T)`` float32 log-probs, natural log. Values at padded completion positions are unspecified.

    The logit at position ``t-1`` scores token ``t`` (causal shift). Position ids come from the attention mask (text
    only; with multimodal inputs the model derives its own, as in TRL's forward).
    """
    if logits_to_keep <= 0:
        return input_ids.new_zeros((input_ids.size(0), 0), dtype=torch.float32)
    if logits_to_keep >= input_ids.size(1):
        raise ValueError(
            f"logits_to_keep ({logits_to_keep}) must be smaller than the sequence length ({input_ids.size(1)}): "
            "the first scored token needs at least one token (the prompt) before it."
        )
    fused = has_fused_head(model)
    bs = micro_batch_size or input_ids.size(0)
    mm = {k: v for k, v in (mm_inputs or {}).items() if v is not None}
    out = []
    for start in range(0, input_ids.size(0), bs):
        ids = input_ids[start : start + bs]
        am = attention_mask[start : start + bs]
        kw = _forward_inputs(am, mm, range(start, start + ids.size(0)))
        if fused:
            labels = ids.masked_fill(am == 0, -100)
            labels[:, :-logits_to_keep] = -100
            res = model(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True, **kw)
            lp = res.log_probs[:, -logits_to_keep:]
        else:
            from trl.trainer.utils import selective_log_softmax

            res = model(input_ids=ids, attention_mask=am, logits_to_keep=logits_to_keep + 1, use_cache=False, **kw)
            logits = res.logits[:, -(logits_to_keep + 1) : -1]
            lp = selective_log_softmax(logits, ids[:, -logits_to_keep:])
        out.append(lp.float())
    return torch.cat(out, dim=0)


# ----------------------------------------------------------------------------------------------------------------
# Context managers
# ----------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def eval_mode(*modules: nn.Module | None):
    """Put modules in eval mode (no dropout) for the block and restore each module's previous mode afterwards."""
    saved = []
    for m in modules:
        if m is None:
            continue
        saved.append((m, [(sub, sub.training) for sub in m.modules()]))
        m.eval()
    try:
        yield
    finally:
        for _, flags in saved:
            for sub, flag in flags:
                sub.training = flag


@contextlib.contextmanager
def peft_adapter(peft_model: nn.Module, adapter_name: str | None, *, trainable: bool = False):
    """Run a ``PeftModel`` with one adapter active (``None``: all adapters disabled) and restore everything after.

    PEFT's ``set_adapter`` flips ``requires_grad`` (the active adapter becomes trainable, the others frozen); TRL
    calls it too. This context records every parameter's ``requires_grad`` and the active adapter before, and puts
    both back on exit. Inside, only ``adapter_name``'s parameters require grad when ``trainable``, none otherwise.
    """
    peft_model = unwrap(peft_model)
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]
    if adapter_name is None:
        with peft_model.disable_adapter():
            yield
        return
    previous = peft_model.active_adapter
    peft_model.set_adapter(adapter_name)
    own = {id(p) for _, p in adapter_parameters(peft_model, adapter_name)} if trainable else set()
    for p in peft_model.parameters():
        p.requires_grad_(id(p) in own)
    try:
        yield
    finally:
        peft_model.set_adapter(previous)
        for p, flag in flags:
            p.requires_grad_(flag)


def adapter_parameters(peft_model: nn.Module, adapter_name: str) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of one adapter of a ``PeftModel``, found through PEFT's own structure, not by name.

    Every PEFT tuner layer (``peft.tuners.tuners_utils.BaseTunerLayer``: LoRA, IA3, LoHa, OFT, ...) keeps its
    per-adapter weights in the ``ModuleDict`` / ``ParameterDict`` attributes listed in its ``adapter_layer_names``,
    keyed by adapter name; ``modules_to_save`` copies live in ``ModulesToSaveWrapper.modules_to_save[adapter_name]``.
    Parameter names do not always contain ``.<adapter_name>.`` (IA3's are ``...k_proj.ia3_l.<adapter_name>``), so they
    are not matched. The order is the model's module order, the same for every adapter of the same config (two such
    adapters' lists pair up element by element). Prompt-learning methods (prefix / prompt tuning) have no tuner layers:
    the list is empty.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    out, seen = [], set()

    def add(prefix: str, item) -> None:
        named = [(prefix, item)] if isinstance(item, nn.Parameter) else item.named_parameters(prefix=prefix)
        for n, p in named:
            if id(p) not in seen:
                seen.add(id(p))
                out.append((n, p))

    for mod_name, module in unwrap(peft_model).named_modules():
        if isinstance(module, BaseTunerLayer):
            for layer_name in module.adapter_layer_names:
                container = getattr(module, layer_name, None)
                if isinstance(container, (nn.ModuleDict, nn.ParameterDict)) and adapter_name in container:
                    add(f"{mod_name}.{layer_name}.{adapter_name}", container[adapter_name])
        elif isinstance(module, ModulesToSaveWrapper) and adapter_name in module.modules_to_save:
            add(f"{mod_name}.modules_to_save.{adapter_name}", module.modules_to_save[adapter_name])
    return out


def copy_adapter_weights(peft_model: nn.Module, src: str, dst: str) -> None:
    """Copy adapter ``src``'s weights into adapter ``dst`` of the same ``PeftModel`` (same PEFT config), in place.

    Raises:
        ValueError: when the two adapters do not have the same parameters (different configs).
    """
    a, b = adapter_parameters(peft_model, src), adapter_parameters(peft_model, dst)
    if len(a) != len(b) or any(p.shape != q.shape for (_, p), (_, q) in zip(a, b)):
        raise ValueError(f"Adapters {src!r} and {dst!r} have different parameters: cannot copy one into the other.")
    with torch.no_grad():
        for (_, p), (_, q) in zip(a, b):
            q.copy_(p)


#: TRL's name for the frozen copy of a pre-trained adapter that serves as its KL reference (``beta != 0``).
TRL_REF_ADAPTER = "ref"


def sync_trl_ref_adapter(model: nn.Module, *, pretrained_adapter: bool) -> bool:
    """Make TRL's reference adapter ``"ref"`` an exact, frozen copy of the policy's adapter ``"default"``.

    Given a ready-made ``PeftModel`` (a pre-trained adapter ``"default"``), TRL's ``GRPOTrainer`` (``beta != 0``) and
    ``RLOOTrainer`` (always) add an adapter ``"ref"`` with ``"default"``'s config and copy the weights of every
    parameter whose name contains ``".default."``. IA3's parameter names end in ``".default"``
    (``...k_proj.ia3_l.default``), so for IA3 nothing is copied: ``"ref"`` keeps IA3's identity initialisation, i.e.
    TRL's reference is the base model and the KL pulls the policy toward the base instead of the SFT adapter. This
    copies ``"default"`` into ``"ref"`` through PEFT's tuner layers (:func:`adapter_parameters`), which finds IA3's
    weights as well as LoRA's (for LoRA, whose names contain ``".default."``, the copy changes nothing), and
    freezes ``"ref"``. Call it right after TRL's ``__init__``, before any training step.

    Args:
        model: the trainer's model (a ``PeftModel``, possibly wrapped), or any model (then nothing is done).
        pretrained_adapter: whether the model given to the trainer was a ``PeftModel`` (TRL made ``"ref"`` from its
            ``"default"``); ``False`` (``peft_config`` given, or no PEFT) does nothing.

    Returns:
        ``True`` when ``"ref"`` was synchronised, ``False`` when there is no TRL ``"ref"`` adapter to fix.

    Raises:
        ValueError: (from :func:`copy_adapter_weights`) when ``"ref"`` and ``"default"`` hold different parameters.

    Source: TRL 1.16 ``GRPOTrainer.__init__`` / ``RLOOTrainer.__init__`` (the ``"ref"`` adapter of a ``PeftModel``).
    """
    peft_model = unwrap(model)
    cfg = getattr(peft_model, "peft_config", None)
    if not pretrained_adapter or not is_peft_model(peft_model) or TRL_REF_ADAPTER not in cfg or "default" not in cfg:
        return False
    params = [
        p for _, p in adapter_parameters(peft_model, "default") + adapter_parameters(peft_model, TRL_REF_ADAPTER)
    ]
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 partitioned at load time: gather, copy on rank 0
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gathered:
        copy_adapter_weights(peft_model, "default", TRL_REF_ADAPTER)
    for _, p in adapter_parameters(peft_model, TRL_REF_ADAPTER):
        p.requires_grad_(False)
    return True


def check_peft_adapter_supported(
    peft_model: nn.Module, adapter_name: str = "default", field_name: str = "peft_config"
) -> None:
    """Refuse a PEFT method whose adapter weights are not in tuner layers (prompt learning: prefix, prompt tuning).

    Raises:
        ValueError: naming ``field_name`` and the supported types.
    """
    model = unwrap(peft_model)
    cfg = getattr(model, "peft_config", {}).get(adapter_name)
    if cfg is None:
        return
    if getattr(cfg, "is_prompt_learning", False) or not adapter_parameters(model, adapter_name):
        raise prompt_learning_error(cfg, field_name)


def prompt_learning_error(cfg, field_name: str = "peft_config") -> ValueError:
    """The error refusing a PEFT config ``cfg`` whose method puts no adapter weights in the model's layers (prompt
    learning: prefix, prompt, P-tuning), naming ``field_name``, the reason and the supported methods."""
    kind = getattr(getattr(cfg, "peft_type", None), "value", type(cfg).__name__)
    return ValueError(
        f"`{field_name}` is a {kind} adapter ({type(cfg).__name__}), which has no adapter weights in the model's "
        "layers: the trainers copy, freeze and train adapters layer by layer. Use a tuner-layer method: LoRA "
        "(LoraConfig) or IA3 (IA3Config), tested; LoHa, LoKr, OFT and the other tuner-layer types work the same "
        "way (with or without task_type, e.g. 'CAUSAL_LM')."
    )


def model_init_kwargs(args) -> dict:
    """``from_pretrained`` kwargs of a copy of the policy: ``args.model_init_kwargs`` as TRL uses them."""
    kwargs = dict(args.model_init_kwargs or {})
    if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
        kwargs["device_map"] = None  # distributed training needs device_map=None ("auto" fails)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def load_model_copy(source: str | nn.Module, args, *, peft_message: str | None = None) -> nn.Module:
    """A fresh copy of ``source``: loaded from its path with :func:`model_init_kwargs`, or deep-copied.

    Call it *before* TRL loads or wraps the policy (a deep copy of a model TRL already patched keeps a forward bound
    to the original). A ``PeftModel`` cannot be copied into a separate model: ``peft_message`` says what to do instead.

    Raises:
        ValueError: ``source`` is a ``PeftModel``.
    """
    if isinstance(source, str):
        from trl.trainer.utils import create_model_from_path

        return create_model_from_path(source, **model_init_kwargs(args))
    source = unwrap(source)
    if is_peft_model(source):
        raise ValueError(
            peft_message
            or "A PeftModel cannot be copied into a separate frozen model: its reference is its base with adapters "
            "disabled (or a frozen copy of its adapter)."
        )
    return copy.deepcopy(source)


def prepare_frozen(model: nn.Module, trainer) -> nn.Module:
    """Freeze ``model`` (no grad, eval mode) and place it like TRL places its reference model; returns it (or its
    DeepSpeed / FSDP wrapper)."""
    model.requires_grad_(False)
    model.eval()
    if trainer.is_deepspeed_enabled:
        from trl.models import prepare_deepspeed

        return prepare_deepspeed(model, trainer.accelerator)
    if getattr(trainer, "is_fsdp_enabled", False):
        from trl.models import prepare_fsdp

        return prepare_fsdp(model, trainer.accelerator)
    return model.to(trainer.accelerator.device)


def copy_adapter(peft_model: nn.Module, dst: str | Iterable[str], *, src: str = "default", trainable=False) -> None:
    """Add adapter(s) ``dst`` to a ``PeftModel`` as exact copies of adapter ``src`` (same config and weights).

    The copies do not require grad unless ``trainable`` (the policy's optimizer and DDP must not see a frozen copy).

    Raises:
        ValueError: ``src`` is a prompt-learning adapter (no weights in the layers to copy; names ``peft_config``).
    """
    peft_model = unwrap(peft_model)
    check_peft_adapter_supported(peft_model, src)
    names = [dst] if isinstance(dst, str) else list(dst)
    cfg = copy.deepcopy(peft_model.peft_config[src])
    cfg.inference_mode = False
    for name in names:
        peft_model.add_adapter(name, copy.deepcopy(cfg))
    for name in names:  # adapters found through PEFT's tuner layers (IA3 names lack ".<adapter>.")
        copy_adapter_weights(peft_model, src, name)
        for _, p in adapter_parameters(peft_model, name):
            p.requires_grad_(trainable)


@torch.no_grad()
def reference_logps(
    trainer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    ref_model: nn.Module | None = None,
    adapter_name: str | None = None,
    batch_size: int | None = None,
    **forward_kwargs,
) -> torch.Tensor:
    """``(B, T)`` log-probs of the last ``logits_to_keep`` tokens under a frozen reference, via TRL's
    ``trainer._get_per_token_logps_and_entropies`` (eval mode, no grad).

    The reference is ``ref_model`` when given (it must carry TRL's fused LM head at the trainer's temperature, see
    ``trl.trainer.utils.add_fused_lm_head``), else the trainer's PEFT policy with adapter ``adapter_name`` active
    (``None``: every adapter disabled, i.e. the base model). ``forward_kwargs`` are TRL's multimodal inputs.
    """
    if ref_model is not None:
        with eval_mode(ref_model):
            return trainer._get_per_token_logps_and_entropies(
                ref_model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **forward_kwargs
            )[0]
    if not is_peft_model(unwrap(trainer.model)):
        raise ValueError(
            "reference_logps needs `ref_model`, or a PEFT policy whose base (adapters disabled) is the reference."
        )
    with eval_mode(trainer.model), peft_adapter(trainer.model, adapter_name):
        return trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **forward_kwargs
        )[0]
