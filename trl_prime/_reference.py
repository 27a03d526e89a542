"""Frozen models next to TRL's policy: loading a copy, freezing and placing it, and reading its log-probs.

Shared by the trainers that own a model TRL does not create: the PRIME trainers (the implicit PRM's reference, and
the PRM itself before it is unfrozen) and :class:`~trl_prime.PRLGRPOTrainer` (PRL's reference ``pi_ref``, needed
even with TRL's ``beta=0``, when TRL loads none).

- :func:`load_model_copy`: a copy of the policy's *initial* checkpoint, made before TRL loads, patches or wraps the
  policy (a path is loaded again with the policy's ``model_init_kwargs``; a module is deep-copied).
- :func:`prepare_frozen`: ``requires_grad=False``, eval mode, and placement: TRL's ``prepare_deepspeed`` under
  DeepSpeed (ZeRO-3 partitions it), TRL's ``prepare_fsdp`` under FSDP, else the accelerator's device.
- :func:`copy_adapter`: under PEFT, frozen copies of a trained adapter (the reference of a policy that starts from
  a pre-trained adapter); a fresh adapter needs none: the base with adapters disabled is the initial policy.
- :func:`reference_logps`: per-token log-probs of the completion tokens under such a reference (a separate model,
  a frozen adapter, or the policy's base with adapters disabled) through the trainer's own
  ``_get_per_token_logps_and_entropies`` (same temperature, fused LM head and batching as TRL's policy log-probs,
  so a reference equal to the policy gives exactly equal log-probs), in eval mode and without gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from accelerate.utils import is_peft_model
from torch import nn

from trl_prime.implicit_prm import (
    adapter_parameters,
    check_peft_adapter_supported,
    copy_adapter_weights,
    eval_mode,
    peft_adapter,
    unwrap,
)

__all__ = ["model_init_kwargs", "load_model_copy", "prepare_frozen", "copy_adapter", "reference_logps"]


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
