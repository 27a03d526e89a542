"""PRIME trainers: online implicit-PRM process rewards on top of TRL's RLOO and GRPO (PRIME arXiv 2502.01456).

Each step (PRIME Algorithm 1):

1. TRL generates ``K`` completions per prompt and scores them with the reward functions (outcome rewards, gathered
   over processes; ``NaN`` = unscorable).
2. Online prompt filter (:func:`trl_prime.functional.prompt_accuracy_mask`): groups whose accuracy lies outside
   ``[filter_lower, filter_upper]`` train neither the PRM nor the policy (loss weight 0).
3. Implicit PRM: one forward pass gives the per-token log-probs; the cross-entropy loss on the kept rows' outcome
   labels updates the PRM with its own AdamW and scheduler; with ``prm_update="single"`` the token rewards come
   from that same forward (before the step), with ``"double"`` from a second no-grad forward after it.
4. Advantages (:func:`trl_prime.functional.prime_advantages`, Eq. 5 for the RLOO estimator) from the ``(B, T)``
   token rewards and the outcome rewards, computed over the global batch (padded, gathered, sliced back per
   process, as TRL does for rewards).
5. Policy update: token-level PPO-clip on ``(B, T)`` advantages (TRL's GRPO loss; a token-level loss for RLOO).

All of it lives in :class:`PrimeMixin`, shared by :class:`PrimeRLOOTrainer` and :class:`PrimeGRPOTrainer`; the
algorithms are the pure functions of :mod:`trl_prime.functional`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import gather, is_peft_model
from torch import nn
from transformers import get_scheduler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer, RLOOTrainer
from trl.trainer.utils import get_config_model_id, nanmax, nanmin

from trl_prime import functional as F
from trl_prime._compat import check_trl_version_once
from trl_prime.checkpointing import CheckpointMixin
from trl_prime.guards import GuardsMixin, check_causal_lm_source, check_peft_config
from trl_prime.implicit_prm.model import ImplicitPRM
from trl_prime.modeling import (
    adapter_parameters,
    add_fused_head,
    check_peft_adapter_supported,
    completion_logps,
    copy_adapter_weights,
    eval_mode,
    load_model_copy,
    model_init_kwargs,
    position_ids_from_mask,
    prepare_frozen,
    unwrap,
)
from trl_prime.prime.config import PrimeGRPOConfig, PrimeOptions, PrimeRLOOConfig
from trl_prime.prof.filter import ProfFilter, prime_prof_rows
from trl_prime.rollout import DropZeroWeightRowsMixin, drop_zero_weight_rows, outcome_rewards

check_trl_version_once()  # warns if the installed TRL is outside the tested range


PRM_ADAPTER = "prm"


PRM_REF_ADAPTER = "prm_ref"


PRM_CHECKPOINT_DIR = "prm"


PRM_DEEPSPEED_DIR = "prm_deepspeed"


PRIME_STATE_NAME = "prime_state.json"


_MM_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


#: learning rates of the LoRA recipe (recipes/configs/prime_lora.yaml): a LoRA adapter needs larger steps than the
#: paper's full fine-tuning rates (policy 5e-7, PRM 1e-6; PRIME section 4.1); the PRM keeps twice the policy's
LORA_RECIPE_LEARNING_RATES = {"learning_rate": 5e-6, "prm_learning_rate": 1e-5}


def warn_full_finetuning_rates(args: PrimeOptions, *, prm_is_adapter: bool) -> None:
    """Warn (``UserWarning``) when a PEFT run keeps PRIME's full fine-tuning learning rates.

    The config defaults ``learning_rate`` 5e-7 and ``prm_learning_rate`` 1e-6 are the paper's rates for full models
    (PRIME section 4.1); a LoRA adapter barely moves at them. Checked: the policy's rate, and the PRM's when the PRM
    is an adapter (``prm_is_adapter``; a separate ``prm_model`` is fully fine-tuned). A field counts as kept when it
    equals its config default.
    """
    fields = type(args).__dataclass_fields__
    names = ["learning_rate"] + (["prm_learning_rate"] if prm_is_adapter else [])
    kept = [n for n in names if n in fields and getattr(args, n) == fields[n].default]
    if not kept:
        return
    kept_text = ", ".join(f"`{n}`={getattr(args, n):g}" for n in kept)
    lora = LORA_RECIPE_LEARNING_RATES
    policy_default, prm_default = fields["learning_rate"].default, fields["prm_learning_rate"].default
    warnings.warn(
        f"PEFT run with PRIME's full fine-tuning learning rate(s) {kept_text}: the defaults `learning_rate`="
        f"{policy_default:g} (policy) and `prm_learning_rate`={prm_default:g} (PRM) are the paper's rates for full "
        "models, and a LoRA adapter barely moves at them. Set both for LoRA, e.g. learning_rate="
        f"{lora['learning_rate']:g} and prm_learning_rate={lora['prm_learning_rate']:g} as "
        "recipes/configs/prime_lora.yaml does (the PRM at about twice the policy's rate, as in the paper).",
        UserWarning,
        stacklevel=4,
    )


class _PositionIdsFromMask:
    """Calls a model with ``position_ids`` derived from ``attention_mask`` (see ``position_ids_from_mask``).

    TRL computes log-probs without position ids (``arange``); PRIME compares policy, PRM and reference log-probs on
    the same token ids, attention masks *and* position ids, so the policy's forward gets them too.
    """

    def __init__(self, model):
        self._model = model

    def __call__(self, *args, **kwargs):
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _logps_of_rows(logps_fn, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int, *,
                   skip: torch.Tensor) -> torch.Tensor:
    """``logps_fn(input_ids, attention_mask, T)`` (``(B, T)`` no-grad log-probs) run on the rows not flagged in
    ``skip`` ``(B,)`` bool only; skipped rows get no forward and log-probs 0."""
    if not bool(skip.any()):
        return logps_fn(input_ids, attention_mask, T)
    rows = (~skip).nonzero(as_tuple=True)[0]
    out = torch.zeros((input_ids.size(0), T), dtype=torch.float32, device=input_ids.device)
    if rows.numel():
        sub = logps_fn(input_ids[rows], attention_mask[rows], T)
        out = out.to(sub.dtype)
        out[rows] = sub
    return out


def _drop_auto(cfg: Any) -> Any:
    """A DeepSpeed config without the unresolved ``"auto"`` values (DeepSpeed rejects them)."""
    if isinstance(cfg, dict):
        return {k: _drop_auto(v) for k, v in cfg.items() if v != "auto"}
    return cfg


def _load_weights(model: nn.Module, folder: str) -> None:
    """Load a ``save_pretrained`` folder's weights (single file or sharded) into ``model`` in place."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        from safetensors.torch import load_file

        state = load_file(single, device=str(next(model.parameters()).device))
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        missing = [k for k in missing if k not in tied]
        if unexpected or missing:
            raise RuntimeError(f"PRM checkpoint {folder} does not match the PRM: missing {missing}, unexpected {unexpected}")
    else:
        from transformers.trainer_utils import load_sharded_checkpoint

        load_sharded_checkpoint(model, folder, strict=False)


class PrimeMixin(CheckpointMixin, GuardsMixin):
    """The PRIME machinery shared by :class:`PrimeRLOOTrainer` and :class:`PrimeGRPOTrainer`.

    It owns the implicit PRM (:class:`~trl_prime.ImplicitPRM` in ``self.implicit_prm``), its optimizer and scheduler
    (``self.prm_optimizer``, ``self.prm_lr_scheduler``), the online prompt filter, the advantages and the PRIME
    metrics, callbacks and checkpoint files. It hooks into TRL through a few methods: ``_calculate_rewards`` and
    ``_get_per_token_logps_and_entropies`` (to see the outcome rewards and the rollout log-probs TRL computes),
    ``_generate_and_score_completions`` (to replace TRL's advantages), ``_prepare_for_training`` (PRM optimizer,
    resume) and ``_save_checkpoint``.

    PRM and reference models:

    - default: the PRM and its frozen reference are copies of the policy's initial checkpoint (or ``prm_model`` /
      ``prm_ref_model``); with TRL's ``beta > 0`` and ``temperature == 1`` the PRM reference *is* TRL's reference
      model and its log-probs are shared, not recomputed;
    - ``prm_reference="policy"``: no reference model, the rollout policy's log-probs serve as reference;
    - PEFT (``peft_config`` or a ``PeftModel``): the PRM is a second adapter ``"prm"`` on the policy's base model,
      the reference is the base with adapters disabled (or, for a pre-trained adapter, a frozen copy ``"prm_ref"``).
      A ``UserWarning`` says so when ``learning_rate`` / ``prm_learning_rate`` keep the paper's full fine-tuning
      rates (5e-7 / 1e-6), at which LoRA barely moves (:func:`warn_full_finetuning_rates`).

    Temperature: the PRM and its reference score the completions at temperature 1, whatever TRL's sampling
    ``temperature``. The token reward ``beta * log(pi_phi / pi_ref)`` (PRIME Eq. 3) is a reward model's likelihood
    ratio, trained as such by the cross-entropy on the outcome labels (PRIME Algorithm 1, line 8); it scores a
    completion, not the distribution it was sampled from, so the same PRM gives the same rewards at any sampling
    temperature (and offline, :class:`~trl_prime.ImplicitPRM`). The policy's PPO ratio uses TRL's log-probs at the
    sampling temperature. ``prm_reference="policy"`` takes the rollout log-probs (sampling temperature) as reference
    and warns when ``temperature != 1``. (PRL, by contrast, computes its KL-to-go at the sampling temperature: see
    :class:`~trl_prime.PRLConfig`.) At ``temperature`` 1 the two conventions agree.

    Metrics, each generation round (``train``; ``eval_`` prefixed in evaluation): ``prm/loss`` (global mean PRM loss
    on the kept rows; NaN when every group was filtered), ``prm/pair_accuracy`` and ``prm/abs_accuracy``
    (:func:`~trl_prime.functional.prm_pair_accuracy` / ``prm_abs_accuracy`` of the sequence rewards ``r(y)`` that fed
    the advantages against the outcome labels, over the kept groups; tied rewards score 0.5 (``ties="half"``), so
    the untrained PRM of step 1 reads exactly 0.5 as in PRIME Figure 5), ``prm/token_reward_{mean,std,min,max}`` (over
    every completion token of the batch), ``filter/kept_fraction`` (fraction of groups kept), ``prm/grad_norm`` and
    ``prm/learning_rate``; plus TRL's own metrics and whatever the reward functions log through ``log_metric``
    (e.g. ``math/<reason>`` counts of :func:`trl_prime.rewards.math_reward`).

    Distributed: under DDP the PRM's gradients are all-reduced by hand (sum of per-rank losses already scaled by the
    global number of kept rows); under DeepSpeed the PRM is its own engine (a copy of the Trainer's DeepSpeed config
    without optimizer/scheduler) and the reference goes through TRL's ``prepare_deepspeed``. Every rank runs the same
    number of PRM forward/backward/step calls.
    """

    _prime_config_class: type = PrimeRLOOConfig

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: PrimeOptions | None = None,
        *trainer_args,
        prm_model: str | nn.Module | None = None,
        prm_ref_model: str | nn.Module | None = None,
        **trainer_kwargs,
    ):
        cfg_cls = self._prime_config_class
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = cfg_cls(f"{name.split('/')[-1]}-PRIME")
        if not isinstance(args, PrimeOptions):
            raise TypeError(
                f"{type(self).__name__} needs `args` to be a {cfg_cls.__name__} (got {type(args).__name__}); build "
                f"it with {cfg_cls.__name__}(output_dir=..., ...) to get the PRIME options."
            )
        # `peft_config` is the 8th argument after `args` in both RLOOTrainer and GRPOTrainer
        peft_config = trainer_args[7] if len(trainer_args) > 7 else trainer_kwargs.get("peft_config")
        self._prime_spec = self._prime_build_models(model, args, prm_model, prm_ref_model, peft_config)
        self._prime_capture: dict | None = None
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        self._prime_finish_init()

    # ----------------------------------------------------------------------------------------------------------
    # Construction
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def _prime_init_kwargs(args) -> dict:
        return model_init_kwargs(args)

    def _prime_build_models(self, model, args, prm_model, prm_ref_model, peft_config) -> dict:
        """Build the PRM and its reference *before* TRL loads, patches or wraps the policy."""
        is_peft_policy = isinstance(model, nn.Module) and is_peft_model(model)
        uses_peft = peft_config is not None or is_peft_policy
        if prm_model is None:
            prm_model = args.prm_model
        if prm_ref_model is None:
            prm_ref_model = args.prm_ref_model
        check_peft_config(peft_config, model)  # start-up checks (trl_prime/_guards.py)
        if uses_peft:
            warn_full_finetuning_rates(args, prm_is_adapter=prm_model is None)
        init_kw = model_init_kwargs(args)  # a custom-code checkpoint is checked as it is loaded
        load_kw = dict(trust_remote_code=init_kw.get("trust_remote_code", False), revision=init_kw.get("revision"))
        check_causal_lm_source(prm_model, "prm_model", **load_kw)
        check_causal_lm_source(prm_ref_model, "prm_ref_model", **load_kw)
        if isinstance(prm_ref_model, nn.Module) and args.prm_reference == "policy":
            raise ValueError("`prm_ref_model` was given but `prm_reference`='policy' uses the rollout log-probs.")

        def load(src):
            return load_model_copy(src, args, peft_message=(
                "A PeftModel cannot be copied into a separate PRM; pass `prm_model` (a path or a causal LM), or "
                "let the PRM be the second adapter 'prm' on the policy (the default with PEFT)."
            ))

        if prm_model is None and uses_peft:
            if prm_ref_model is not None:
                raise ValueError(
                    "With PEFT the PRM is an adapter on the policy's base and its reference is that base (adapters "
                    "disabled): `prm_ref_model` cannot be used. Pass `prm_model` too to train a separate PRM."
                )
            return {"kind": "adapter", "pretrained_adapter": is_peft_policy}

        source = prm_model if prm_model is not None else model
        spec: dict[str, Any] = {"kind": "model", "prm": load(source), "ref": None, "share_trl_ref": False}
        if args.prm_reference == "sft":
            ref_source = prm_ref_model if prm_ref_model is not None else source
            share = (
                args.beta != 0.0
                and not uses_peft
                and ref_source is model
                and args.temperature == 1.0
                and not args.sync_ref_model
            )
            if share:
                spec["share_trl_ref"] = True
            else:
                spec["ref"] = load(ref_source)
        for m in (spec["prm"], spec["ref"]):
            if m is not None:
                add_fused_head(m)  # before any copy or wrapping (see add_fused_head)
        return spec

    def _prime_finish_init(self) -> None:
        args = self.args
        spec = self._prime_spec
        self._prime_num_updates = 0
        self.prm_optimizer = None
        self.prm_lr_scheduler = None
        self._prime_engine = None
        self._prime_shares_trl_ref = False
        mb = args.prm_micro_batch_size or args.per_device_train_batch_size
        if self.is_fsdp_enabled:
            raise ValueError(
                "PRIME trainers do not support FSDP yet: the implicit PRM needs its own sharded engine. Use DeepSpeed "
                "ZeRO-2/3 (`--deepspeed` / accelerate's DeepSpeed plugin) or DDP."
            )
        if spec["kind"] == "adapter":
            if self.is_deepspeed_enabled:
                raise ValueError(
                    "The shared-base PEFT PRM (adapter 'prm' on the policy) is not supported with DeepSpeed: its "
                    "adapter would be partitioned inside the policy's engine. Pass `prm_model` (a separate PRM, "
                    "trained as its own DeepSpeed engine) or train without DeepSpeed."
                )
            peft_model = self.model
            check_peft_adapter_supported(peft_model)
            default_cfg = peft_model.peft_config["default"]
            prm_cfg = copy.deepcopy(default_cfg)
            prm_cfg.inference_mode = False
            peft_model.add_adapter(PRM_ADAPTER, prm_cfg)
            ref_adapter = None
            if spec["pretrained_adapter"]:
                # A trained adapter: the PRM starts from it, and a frozen copy is its reference
                names = [PRM_ADAPTER] + ([PRM_REF_ADAPTER] if args.prm_reference == "sft" else [])
                if args.prm_reference == "sft":
                    peft_model.add_adapter(PRM_REF_ADAPTER, copy.deepcopy(prm_cfg))
                    ref_adapter = PRM_REF_ADAPTER
                for a in names:
                    copy_adapter_weights(peft_model, "default", a)
            for a in (PRM_ADAPTER, PRM_REF_ADAPTER):  # found through PEFT's tuner layers (IA3 names lack ".prm.")
                for _, p in adapter_parameters(peft_model, a):
                    p.requires_grad_(False)  # the policy's optimizer and DDP must not see them
            if self.temperature == 1.0:
                add_fused_head(peft_model, mark_only=True)  # TRL patched the base at temperature 1
            self.implicit_prm = ImplicitPRM(
                peft_model,
                None,
                beta=args.prm_beta,
                tokenizer=self._tokenizer,
                adapter_name=PRM_ADAPTER,
                ref_adapter_name=ref_adapter if args.prm_reference == "sft" else None,
                micro_batch_size=mb,
                fused_head=False,
                trained_reference="policy" if args.prm_reference == "policy" else None,
            )
            # TRL's KL reference (beta != 0) is the same base with adapters disabled: its log-probs are reused
            self._prime_shares_trl_ref = (
                args.beta != 0.0 and args.prm_reference == "sft" and ref_adapter is None and self.temperature == 1.0
            )
        else:
            prm, ref = spec["prm"], spec["ref"]
            prm.requires_grad_(True)
            if spec["share_trl_ref"] and self.ref_model is not None:
                add_fused_head(self.ref_model, mark_only=True)  # TRL patched it at temperature 1
                ref = self.ref_model
                self._prime_shares_trl_ref = True
            elif ref is not None:
                ref = prepare_frozen(ref, self)
            if not self.is_deepspeed_enabled:
                prm = prm.to(self.accelerator.device)
            prm.eval()
            self.implicit_prm = ImplicitPRM(
                prm, ref, beta=args.prm_beta, tokenizer=self._tokenizer, micro_batch_size=mb, fused_head=False,
                trained_reference="policy" if args.prm_reference == "policy" else None,
            )
        del self._prime_spec
        self.prof_filter = ProfFilter.from_trainer(self)  # PROF (trl_prime/prof/); None when prof_mode="off"
        self._guard_setup()  # start-up dataset checks; non-finite / verifier guards (trl_prime/_guards.py)

    # ----------------------------------------------------------------------------------------------------------
    # Optimizer, DeepSpeed engine, checkpoints
    # ----------------------------------------------------------------------------------------------------------
    @property
    def prm_model(self) -> nn.Module:
        """The PRM module (unwrapped; for a PEFT PRM, the policy's PeftModel holding adapter ``"prm"``)."""
        return unwrap(self.implicit_prm.model)

    def _prime_local_batch(self) -> int:
        return self.args.per_device_train_batch_size * self.args.steps_per_generation

    def _prime_num_micro(self) -> int:
        if self.args.prm_loss != "ce":
            return 1  # pairwise / KTO losses need every local row in one backward
        return math.ceil(self._prime_local_batch() / self.implicit_prm.micro_batch_size)

    def _prime_total_updates(self, max_steps: int) -> int:
        a = self.args
        return max(1, math.ceil(max_steps * a.gradient_accumulation_steps / (a.steps_per_generation * a.num_iterations)))

    def _prime_ds_config(self) -> dict:
        base = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        base.pop("optimizer", None)
        base.pop("scheduler", None)
        cfg = _drop_auto(base)
        n_micro = self._prime_num_micro()
        mb = self.implicit_prm.micro_batch_size if self.args.prm_loss == "ce" else self._prime_local_batch()
        cfg["train_micro_batch_size_per_gpu"] = mb
        cfg["gradient_accumulation_steps"] = n_micro
        cfg["train_batch_size"] = mb * n_micro * self.accelerator.num_processes
        cfg["gradient_clipping"] = self.args.prm_max_grad_norm or 0.0
        cfg.setdefault("steps_per_print", 10**9)
        return cfg

    def _prime_create_optimizer(self, max_steps: int) -> None:
        if self.prm_optimizer is not None:
            return
        a = self.args
        params = self.implicit_prm.trainable_parameters()
        # the fused AdamW kernel when the policy's optimizer uses it too (TRL's default "adamw_torch_fused"): about 4x
        # faster than the for-loop AdamW on CPU; not under DeepSpeed (its engine wraps the optimizer)
        fused = (
            "fused" in str(getattr(a.optim, "value", a.optim)) and not self.is_deepspeed_enabled
            and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        )
        optimizer = torch.optim.AdamW(
            params, lr=a.prm_learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
            weight_decay=a.prm_weight_decay, **({"fused": True} if fused else {}),
        )
        total = self._prime_total_updates(max_steps)

        def make_scheduler(opt):
            return get_scheduler(a.prm_lr_scheduler, opt, num_warmup_steps=a.prm_warmup_steps, num_training_steps=total)

        if self.is_deepspeed_enabled and self.implicit_prm.adapter_name is None:
            import deepspeed

            engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
                model=unwrap(self.implicit_prm.model), optimizer=optimizer, lr_scheduler=make_scheduler,
                config=self._prime_ds_config(),
            )
            self._prime_engine = engine
            self.implicit_prm.model = engine
            self.prm_optimizer, self.prm_lr_scheduler = ds_optimizer, ds_scheduler
        else:
            self.prm_optimizer, self.prm_lr_scheduler = optimizer, make_scheduler(optimizer)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self._prime_create_optimizer(max_steps)
        if resume_from_checkpoint is not None:
            self._prime_load_checkpoint(resume_from_checkpoint)
        return model, train_dataloader

    def _prime_gathered_state_dict(self, module: nn.Module | None) -> dict | None:
        """Full state dict of a (possibly ZeRO-3 partitioned) module; every rank must call it."""
        if module is None:
            return None
        inner = unwrap(module)
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}
        return None

    def _save_checkpoint(self, model, trial):
        # atomic: everything below (policy, PRM, optimizers, RNG, states) lands in a staging folder that is renamed to
        # checkpoint-N once complete (trl_prime/_guards.py)
        with self._guard_atomic_checkpoint(trial):
            self._prime_save_checkpoint(model, trial)

    def _prime_save_checkpoint(self, model, trial):
        self._prime_saving_checkpoint = True  # Trainer._save_checkpoint calls save_model: the PRM is saved below
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._prime_saving_checkpoint = False
        output_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.save_prm(os.path.join(output_dir, PRM_CHECKPOINT_DIR), _checkpoint=True)
        if self._prime_engine is not None:
            self._prime_engine.save_checkpoint(os.path.join(output_dir, PRM_DEEPSPEED_DIR))
        if self.args.should_save:
            prm_dir = os.path.join(output_dir, PRM_CHECKPOINT_DIR)
            if self._prime_engine is None and self.prm_optimizer is not None:
                torch.save(self.prm_optimizer.state_dict(), os.path.join(prm_dir, "optimizer.pt"))
                torch.save(self.prm_lr_scheduler.state_dict(), os.path.join(prm_dir, "scheduler.pt"))
            with open(os.path.join(prm_dir, PRIME_STATE_NAME), "w") as f:
                json.dump({"num_updates": self._prime_num_updates}, f)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy as ``Trainer.save_model`` does, and the trained implicit PRM in ``<output_dir>/prm``.

        ``<output_dir>/prm`` is a :meth:`~trl_prime.ImplicitPRM.save_pretrained` folder (PRM weights or adapter,
        tokenizer, reference unless ``prm_save_reference=False``, ``implicit_prm_config.json``) that
        :meth:`~trl_prime.ImplicitPRM.from_pretrained` loads; written by the main process, gathered under ZeRO-3.
        Call it on every process (as ``Trainer.save_model``).
        """
        super().save_model(output_dir, _internal_call=_internal_call)
        if getattr(self, "_prime_saving_checkpoint", False):
            return  # _save_checkpoint writes the PRM with its optimizer state
        self.save_prm(os.path.join(output_dir or self.args.output_dir, PRM_CHECKPOINT_DIR))
        self.accelerator.wait_for_everyone()

    def save_prm(self, output_dir: str, _checkpoint: bool = False) -> None:
        """Save the implicit PRM (``save_pretrained`` folder, reference, config json); call it on every rank."""
        sd = self._prime_gathered_state_dict(self.implicit_prm.model) if self.implicit_prm.adapter_name is None else None
        save_ref = self.args.prm_save_reference and self.implicit_prm.ref_model is not None
        ref_sd = self._prime_gathered_state_dict(self.implicit_prm.ref_model) if save_ref else None
        self.implicit_prm.save_pretrained(
            output_dir, save_reference=save_ref, state_dict=sd, ref_state_dict=ref_sd,
            is_main_process=self.args.should_save,
        )

    def _prime_load_checkpoint(self, checkpoint: str) -> None:
        prm_dir = os.path.join(checkpoint, PRM_CHECKPOINT_DIR)
        if not os.path.isdir(prm_dir):
            raise FileNotFoundError(
                f"{checkpoint} has no `{PRM_CHECKPOINT_DIR}/` folder: it was not written by a PRIME trainer, so the "
                "PRM cannot be restored. Resume from a PRIME checkpoint, or start a new run."
            )
        with open(os.path.join(prm_dir, PRIME_STATE_NAME)) as f:
            self._prime_num_updates = json.load(f)["num_updates"]
        if self._prime_engine is not None:
            self._prime_engine.load_checkpoint(
                os.path.join(checkpoint, PRM_DEEPSPEED_DIR), load_optimizer_states=True, load_lr_scheduler_states=True
            )
            return
        device = self.accelerator.device
        if self.implicit_prm.adapter_name is not None:
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            weights = load_peft_weights(prm_dir, device=str(device))
            set_peft_model_state_dict(self.prm_model, weights, adapter_name=PRM_ADAPTER)
        else:
            _load_weights(self.prm_model, prm_dir)
        # loaded on the CPU (torch.load rejects map_location "cpu:0", the device of a CPU DDP process); the optimizer
        # moves its state to the parameters' device
        self.prm_optimizer.load_state_dict(torch.load(os.path.join(prm_dir, "optimizer.pt"), map_location="cpu"))
        self.prm_lr_scheduler.load_state_dict(torch.load(os.path.join(prm_dir, "scheduler.pt")))

    # ----------------------------------------------------------------------------------------------------------
    # Hooks into TRL
    # ----------------------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        cap = self._prime_capture
        trl_ref = cap is not None and not torch.is_grad_enabled() and self._prime_is_trl_ref_call(model)
        if (cap is not None and not torch.is_grad_enabled() and model is self.model and not trl_ref
                and "policy_logps" not in cap and self._prime_skip_old_logps()):
            cap["policy_logps"] = None  # on-policy: no rollout log-prob forward (the loss uses its own, detached)
            return input_ids.new_zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32), None, None
        text_only = all(kwargs.get(k) is None for k in _MM_KEYS)
        call_model = _PositionIdsFromMask(model) if text_only else model
        # a reference shared with the implicit PRM is scored as the PRM's: eval mode (no dropout)
        with eval_mode(model) if trl_ref and self._prime_shares_trl_ref else contextlib.nullcontext():
            out = super()._get_per_token_logps_and_entropies(call_model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if cap is not None and not torch.is_grad_enabled():
            if self._prime_is_trl_ref_call(model):
                cap["trl_ref_logps"] = out[0]
            elif model is self.model and "policy_logps" not in cap:
                cap["policy_logps"] = out[0]
        return out

    def _prime_skip_old_logps(self) -> bool:
        """Whether TRL's rollout (old) log-prob forward is wasted and skipped: TRL's RLOO runs it every generation
        round, but PRIME's token-level loss falls back to its own detached log-probs (ratio 1), which are equal when
        the policy does not move between generation and optimisation (GRPO's rule: ``gradient_accumulation_steps``
        a multiple of ``steps_per_generation * num_iterations``). Kept for TRL's KL-in-reward (``beta != 0``) and
        ``prm_reference="policy"`` (they need the values)."""
        a = self.args
        if not isinstance(self, RLOOTrainer) or self.beta != 0.0 or a.prm_reference == "policy":
            return False
        return a.gradient_accumulation_steps % (a.steps_per_generation * self.num_iterations) == 0

    def _prime_is_trl_ref_call(self, model) -> bool:
        """Whether TRL is computing its (KL) reference log-probs with this call."""
        if self.ref_model is not None:
            return model is self.ref_model
        if self.beta == 0.0 or model is not self.model or not is_peft_model(model):
            return False
        peft_model = unwrap(model)  # TRL's PEFT reference: its "ref" adapter, or the base with adapters disabled
        if "ref" in peft_model.active_adapters:
            return True
        from peft.tuners.tuners_utils import BaseTunerLayer

        layer = next((m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)), None)
        return layer is not None and layer.disable_adapters

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._prime_capture is not None:
            self._prime_capture.update(
                rewards_per_func=rewards_per_func,
                prompts=prompts,
                completions=completions,
                completion_lengths=[len(c) for c in completion_ids_list],
            )
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._prime_capture = {}
        try:
            output = super()._generate_and_score_completions(inputs)
            capture = self._prime_capture
        finally:
            self._prime_capture = None
        return self._prime_step(output, capture)

    def _prime_dispatch(self, event: str, **payload) -> None:
        """Call ``event(args, state, control, **payload)`` on every callback that defines it."""
        for cb in self.callback_handler.callbacks:
            fn = getattr(cb, event, None)
            if callable(fn):
                fn(self.args, self.state, self.control, **payload)

    # ----------------------------------------------------------------------------------------------------------
    # One PRIME step
    # ----------------------------------------------------------------------------------------------------------
    def _prime_outcome_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """``(B_global,)`` outcome rewards as TRL combines them: weighted sum, NaN when every function gave None."""
        return outcome_rewards(self, rewards_per_func)

    def _prime_step(self, output: dict, cap: dict) -> dict:
        a = self.args
        mode = "train" if self.model.training else "eval"
        device = self.accelerator.device
        K = self.num_generations if mode == "train" else self.num_generations_eval
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        B, T = completion_ids.shape
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        rank = self.accelerator.process_index
        local = slice(rank * B, (rank + 1) * B)

        # 1. outcome rewards (global) and labels
        outcome = self._prime_outcome_rewards(cap["rewards_per_func"])  # (B_g,)
        # an inf reward poisons the batch (no PRM or policy step; trl_prime/_guards.py); NaN = unscorable, excluded
        self._guard_inspect(mode, global_rows={"rewards": outcome.nan_to_num(0.0, posinf=torch.inf, neginf=-torch.inf)})
        outcome = torch.where(torch.isinf(outcome), torch.full_like(outcome, torch.nan), outcome)
        scorable = ~torch.isnan(outcome)
        if bool(((outcome[scorable] < 0) | (outcome[scorable] > 1)).any()):
            lo, hi = outcome[scorable].min().item(), outcome[scorable].max().item()
            raise ValueError(
                f"PRIME trains the implicit PRM on outcome labels in [0, 1], but the weighted reward functions "
                f"{self.reward_func_names} gave values in [{lo:.3g}, {hi:.3g}]. Use a verifier returning 1/0 (or a "
                "fraction of tests passed), or set `reward_weights` so the sum stays in [0, 1]."
            )
        lengths = gather(torch.tensor(cap["completion_lengths"], device=device))

        # 2. online prompt filter
        if mode == "train":
            trunc = dict(completion_lengths=lengths, max_completion_length=self.max_completion_length)
            kept = F.prompt_accuracy_mask(
                outcome_rewards=outcome, num_generations=K, lower=a.filter_lower, upper=a.filter_upper,
                **(trunc if a.filter_truncated else {}),
            )
        else:
            kept = torch.ones_like(outcome, dtype=torch.bool)
        group_kept = kept.view(-1, K)[:, 0]
        kept_fraction = group_kept.float().mean().item()
        self._prime_dispatch(
            "on_prompts_filtered", outcome_rewards=outcome, kept_mask=kept, group_kept=group_kept,
            kept_fraction=kept_fraction, num_generations=K, mode=mode,
        )
        kept_l = kept[local]
        # rows whose reference / PRM log-probs are computed (prm_score_filtered_rows=False: the kept ones only)
        skip_filtered = (mode == "train" and not a.prm_score_filtered_rows and a.prm_loss == "ce"
                         and self._prime_engine is None and not self.is_deepspeed_enabled)
        unscored_l = ~kept_l if skip_filtered else torch.zeros_like(kept_l)

        # 3. reference log-probs (local)
        policy_logps = cap.get("policy_logps")
        if a.prm_reference == "policy":
            if policy_logps is None:  # GRPO skips them when generation and optimisation are aligned
                with torch.no_grad():
                    policy_logps = self._get_per_token_logps_and_entropies(
                        self.model, input_ids, attention_mask, T, batch_size=self.implicit_prm.micro_batch_size
                    )[0]
            ref_logps = policy_logps
        elif self._prime_shares_trl_ref and cap.get("trl_ref_logps") is not None:
            ref_logps = cap["trl_ref_logps"]
        else:
            ref_logps = _logps_of_rows(self.implicit_prm.ref_logps, input_ids, attention_mask, T, skip=unscored_l)

        self._guard_inspect(mode, local_rows={"ref_logps": ref_logps, "policy_logps": policy_logps},
                            masks={"ref_logps": completion_mask, "policy_logps": completion_mask})

        # 4. implicit PRM: forward (+ update in training)
        labels_l = outcome[local].clone()
        labels_l[~kept_l | (completion_mask.sum(-1) == 0)] = torch.nan  # weight 0 in the PRM loss
        if mode == "train":
            prm_logps, prm_stats = self._prime_prm_update(input_ids, attention_mask, completion_mask, labels_l, ref_logps,
                                                          unscored=unscored_l)
        else:
            prm_logps = self.implicit_prm.prm_logps(input_ids, attention_mask, T)
            prm_stats = {"loss": float("nan")}
        token_rewards = F.implicit_token_rewards(
            prm_logps=prm_logps, ref_logps=ref_logps, mask=completion_mask, beta=a.prm_beta
        )  # (B, T), every token (the last one is dropped from the advantages if include_last_token=False)
        if prm_stats.get("token_rewards_checked"):  # by the PRM update, before its step (same values)
            bad = gather(self._prime_bad_token_reward_rows(token_rewards, completion_mask).to(torch.long)).bool()
        else:
            bad = self._prime_inspect_token_rewards(prm_logps, ref_logps, completion_mask, unscored_l, mode=mode)
        if bool(bad.any()):  # the step is skipped; keep the rest of the batch's computation finite
            token_rewards = torch.nan_to_num(token_rewards, nan=0.0, posinf=0.0, neginf=0.0)
            if a.prm_max_abs_token_reward is not None:
                token_rewards = token_rewards.clamp(-a.prm_max_abs_token_reward, a.prm_max_abs_token_reward)
        seq_rewards = gather(token_rewards.sum(-1))
        # PROF (trl_prime/prof/): the policy trains on m of the n completions of each prompt (= kept when it is off)
        policy_kept = prime_prof_rows(
            self, mode=mode, kept=kept, scorable=scorable, outcome=outcome, output=output, capture=cap,
            token_rewards=token_rewards, num_generations=K,
        )

        # 5. advantages over the global batch (pad, gather, compute, slice)
        rewards_g = gather(self.accelerator.pad_across_processes(token_rewards, dim=1, pad_index=0))
        mask_g = gather(self.accelerator.pad_across_processes(completion_mask, dim=1, pad_index=0))
        outcome_adv = outcome
        if a.beta != 0.0 and isinstance(self, RLOOTrainer) and cap.get("trl_ref_logps") is not None:
            kl = ((cap["policy_logps"] - cap["trl_ref_logps"]) * completion_mask).sum(-1)
            outcome_adv = outcome - a.beta * gather(kl)  # TRL's RLOO KL-in-reward, kept for beta > 0
        adv_inputs = dict(
            process_rewards=rewards_g,
            outcome_rewards=torch.where(policy_kept, outcome_adv, torch.full_like(outcome_adv, torch.nan)),
            mask=mask_g,
            group_ids=torch.arange(outcome.numel(), device=device) // K,
            **self._prime_advantage_options(),
        )
        if K >= 2:
            advantages_g = F.prime_advantages(**adv_inputs)
        else:
            advantages_g = torch.zeros_like(rewards_g)
        self._guard_single_row_groups(mode, rewards=adv_inputs["outcome_rewards"], group_ids=adv_inputs["group_ids"])
        self._guard_inspect(mode, global_rows={"advantages": advantages_g}, masks={"advantages": mask_g})
        self._guard_degenerate_metrics(mode, outcome=outcome, completion_mask_g=mask_g, num_generations=K,
                                       kept=kept if mode == "train" else None, completion_lengths=lengths)
        advantages = advantages_g[local, :T]
        loss_mask = completion_mask * (policy_kept[local] & scorable[local]).unsqueeze(1).to(completion_mask.dtype)

        # 6. hand the results to TRL's loss
        output["advantages"] = advantages
        output["prime_loss_mask"] = loss_mask
        output["prime_token_rewards"] = token_rewards
        if policy_logps is not None:
            output["old_per_token_logps"] = policy_logps
        self._prime_adapt_output(output, loss_mask)
        if len(self._logs["advantages"]) >= outcome.numel():  # TRL logged its outcome-only advantages: replace
            for _ in range(outcome.numel()):
                self._logs["advantages"].pop()
            self._logs["advantages"].extend(advantages_g[:, 0].tolist())

        # 7. metrics and callbacks
        m = self._metrics[mode]
        kept_idx = kept.nonzero(as_tuple=True)[0]
        if kept_idx.numel() > 0:
            pair_acc = F.prm_pair_accuracy(sequence_rewards=seq_rewards[kept_idx], outcome_rewards=outcome[kept_idx], num_generations=K, ties="half")
            abs_acc = F.prm_abs_accuracy(sequence_rewards=seq_rewards[kept_idx], outcome_rewards=outcome[kept_idx])
        else:
            pair_acc = abs_acc = float("nan")
        scored_g = kept if skip_filtered else torch.ones_like(kept)  # rows with computed token rewards
        tok = rewards_g[mask_g.bool() & scored_g.unsqueeze(1)]
        m["prm/loss"].append(prm_stats["loss"])
        m["prm/pair_accuracy"].append(pair_acc)
        m["prm/abs_accuracy"].append(abs_acc)
        m["prm/token_reward_mean"].append(tok.mean().item() if tok.numel() else float("nan"))
        m["prm/token_reward_std"].append(tok.std().item() if tok.numel() > 1 else float("nan"))
        m["prm/token_reward_min"].append(tok.min().item() if tok.numel() else float("nan"))
        m["prm/token_reward_max"].append(tok.max().item() if tok.numel() else float("nan"))
        m["filter/kept_fraction"].append(kept_fraction)
        if "grad_norm" in prm_stats:
            m["prm/grad_norm"].append(prm_stats["grad_norm"])
            m["prm/learning_rate"].append(prm_stats["learning_rate"])
        seq_l = seq_rewards[local]
        if bool(unscored_l.any()):  # callbacks see NaN for rows that were not scored (prm_score_filtered_rows=False)
            nan_rows = lambda x: x.masked_fill(unscored_l.view(-1, *([1] * (x.dim() - 1))), torch.nan)  # noqa: E731
            token_rewards, prm_logps, ref_logps, seq_l = (nan_rows(x) for x in (token_rewards, prm_logps, ref_logps,
                                                                                seq_l))
        self._prime_dispatch(
            "on_rollouts_scored",
            mode=mode,
            step=self.state.global_step + 1,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            token_rewards=token_rewards,
            sequence_rewards=seq_l,
            outcome_rewards=outcome[local],
            kept_mask=kept_l,
            advantages=advantages,
            loss_mask=loss_mask,
            prm_logps=prm_logps,
            ref_logps=ref_logps,
            advantage_inputs=adv_inputs,
            global_advantages=advantages_g,
            process_slice=local,
            prompts=cap.get("prompts"),
            completions=cap.get("completions"),
            tokenizer=self._tokenizer,
            is_main_process=self.accelerator.is_main_process,
        )
        return output

    def _prime_advantage_options(self) -> dict:
        a = self.args
        opts = dict(
            estimator=a.prime_estimator,
            process_coef=a.process_coef,
            outcome_coef=a.outcome_coef,
            gamma=a.prime_gamma,
            whiten=a.whiten_advantages,
            process_reward_norm=a.process_reward_norm,
            include_last_token=a.include_last_token,
        )
        if a.prime_estimator == "rloo":
            opts["baseline"] = a.prime_baseline
        if a.prime_estimator == "grpo":
            opts["scale_rewards"] = getattr(a, "scale_rewards", "group") != "none"
            opts["grpo_process_form"] = a.grpo_process_form
            opts["grpo_process_scale"] = a.grpo_process_scale
        return opts

    def _prime_adapt_output(self, output: dict, loss_mask: torch.Tensor) -> None:
        """Trainer-specific: make TRL's loss use ``loss_mask`` (filtered and unscorable rows get weight 0)."""
        output["num_items_in_batch"] = gather(loss_mask.sum()).sum()

    # ----------------------------------------------------------------------------------------------------------
    # PRM update
    # ----------------------------------------------------------------------------------------------------------
    def _prime_backward(self, loss: torch.Tensor) -> None:
        if self._prime_engine is not None:
            # DeepSpeed averages gradients over ranks and divides the loss by its accumulation steps: undo both,
            # our per-rank losses are already shares of the global mean.
            scale = self.accelerator.num_processes * self._prime_engine.gradient_accumulation_steps()
            self._prime_engine.backward(loss * scale)
            self._prime_engine.step()
        else:
            loss.backward()

    def _prime_optimizer_step(self, loss_finite: bool = True) -> float | None:
        """All-reduce (DDP), clip, step, schedule; returns the pre-clip gradient norm (NaN under DeepSpeed), or
        ``None`` when the step was skipped because the (global) loss or gradient norm is not finite (the norm is the
        one clipping returns, computed before it scales the gradients: an overflow reads inf even though clipping
        leaves zeros or NaN behind).

        Under DeepSpeed the engine has already stepped in :meth:`_prime_backward`; its ZeRO optimizer skips a step
        whose gradient norm is not finite (fp32, and bf16 with DeepSpeed's default ``check_grad_overflow``), which is
        reported here as a skip, except an fp16 loss-scale overflow with a finite loss (the loss scaler's own skip,
        returned as NaN like the policy's GradScaler skips). A non-finite norm whose step the engine applied anyway
        raises (the PRM is lost)."""
        if self._prime_engine is not None:
            norm = self._prime_engine.get_global_grad_norm()
            applied = self._prime_engine.was_step_applied()
            if norm is not None and math.isfinite(float(norm)) and loss_finite and applied:
                return float(norm)
            if norm is None and applied and loss_finite:
                return float("nan")  # ZeRO gradient-norm computation disabled: nothing to judge
            if not applied and loss_finite and self._prime_engine.fp16_enabled():
                # fp16 dynamic loss scaling: an overflowing scaled gradient skips the step and lowers the scale
                # (as torch's GradScaler does for the policy): calibration, not a poisoned batch
                return float("nan")
            if applied:
                raise RuntimeError(
                    f"The PRM's DeepSpeed engine applied a step whose gradient norm is {norm} (loss finite: "
                    f"{loss_finite}): its weights are no longer finite. Enable DeepSpeed's overflow check (bf16: "
                    "`check_grad_overflow: true`), lower `prm_learning_rate`, and resume from the last checkpoint."
                )
            return None
        params = self.implicit_prm.trainable_parameters()
        if self.accelerator.num_processes > 1:
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        if self.args.prm_max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.args.prm_max_grad_norm).item()
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in params if p.grad is not None])
            ).item()
        if not (loss_finite and math.isfinite(norm)):  # same on every rank: loss reduced, gradients all-reduced
            self.prm_optimizer.zero_grad(set_to_none=True)  # skipped: weights, moments and schedule unchanged
            return None
        self.prm_optimizer.step()
        self.prm_lr_scheduler.step()
        self.prm_optimizer.zero_grad(set_to_none=True)
        return norm

    def _prime_bad_token_reward_rows(self, token_rewards: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool: local rows with a non-finite token reward or one beyond ``prm_max_abs_token_reward``."""
        bound = self.args.prm_max_abs_token_reward
        t, m = token_rewards.float(), completion_mask.bool()
        bad = ~torch.isfinite(t) | ((t.abs() > bound) if bound is not None else torch.zeros_like(m))
        return (bad & m).any(-1)

    def _prime_inspect_token_rewards(self, prm_logps, ref_logps, completion_mask, unscored=None, *, mode="train"):
        """Guard the PRM's ``(B, T)`` log-probs and token rewards (PRIME Eq. 3): rows with a non-finite value or a
        token reward beyond ``prm_max_abs_token_reward`` poison the generation batch (training) and are logged with
        their sample ids. Collective. Returns the ``(B_global,)`` bool mask of offending rows."""
        token_rewards = F.implicit_token_rewards(
            prm_logps=prm_logps, ref_logps=ref_logps, mask=completion_mask, beta=self.args.prm_beta
        )
        mask = completion_mask
        if unscored is not None:  # rows without a PRM forward (log-probs 0) are not judged
            mask = completion_mask * (~unscored).unsqueeze(1).to(completion_mask.dtype)
        return self._guard_inspect(
            mode, local_rows={"prm_logps": prm_logps, "token_rewards": token_rewards},
            masks={"prm_logps": mask, "token_rewards": mask},
            bounds={"token_rewards": self.args.prm_max_abs_token_reward},
        )

    def _prime_global_batch_loss(self, prm_logps, ref_logps, completion_mask, labels):
        """The pairwise / KTO PRM loss (``prm_loss`` "dpo", "nca", "kto") over the *global* batch.

        Each rank gathers the other ranks' detached sequence log-ratios ``sum_t (log pi_phi - log pi_ref)`` and
        labels, and computes the loss on the whole global batch with its own rows live: every DPO/NCA pair is
        formed inside its prompt group (global row ``i`` belongs to group ``i // K``, also when a group is split
        across ranks) and KTO's reference points are batch-global means. The value is the global loss on every
        rank; its gradient flows through the local rows only, so the sum of the ranks' gradients (the hand
        all-reduce, or DeepSpeed's scaled mean) is the gradient of the global loss.

        Returns ``(loss, {"group_ids": (B_global,), "global_labels": (B_global,)})``.
        """
        B = prm_logps.size(0)
        m = completion_mask.bool()
        wd = torch.promote_types(prm_logps.dtype, torch.float32)
        diff = prm_logps.to(wd) - ref_logps.to(wd)
        seq = torch.where(m, diff, torch.zeros_like(diff)).sum(-1, keepdim=True)  # (B, 1), at least float32
        if self.accelerator.num_processes > 1:
            rank = self.accelerator.process_index
            others = gather(seq.detach())
            seq_g = torch.cat([others[: rank * B], seq, others[(rank + 1) * B :]], dim=0)
            labels_g = gather(labels)
        else:
            seq_g, labels_g = seq, labels
        group_ids = torch.arange(seq_g.size(0), device=seq_g.device) // self.num_generations
        loss = F.implicit_prm_loss(
            prm_logps=seq_g, ref_logps=torch.zeros_like(seq_g), mask=torch.ones_like(seq_g, dtype=torch.bool),
            labels=labels_g, beta=self.args.prm_beta, loss_type=self.args.prm_loss, group_ids=group_ids,
        )
        return loss.to(prm_logps.dtype), {"group_ids": group_ids, "global_labels": labels_g}

    def _prime_prm_update(self, input_ids, attention_mask, completion_mask, labels, ref_logps, unscored=None):
        """One PRM update on the kept rows (``labels`` NaN elsewhere). Returns ``(prm_logps (B,T), stats)``.

        ``prm_logps`` are detached: from the update's own forward (``single``) or a forward after the step
        (``double``); rows flagged in ``unscored`` ``(B,)`` bool (filtered rows with ``prm_score_filtered_rows=False``)
        get no forward and log-probs 0. Each rank's loss is its share of the global mean (rows scaled by the global
        row count), so summing gradients over ranks gives the gradient of the global mean loss.
        """
        a = self.args
        B, T = completion_mask.shape
        prm = self.implicit_prm
        valid = ~torch.isnan(labels)
        unscored = torch.zeros_like(valid) if unscored is None else unscored
        scored_logps = lambda: _logps_of_rows(prm.prm_logps, input_ids, attention_mask, T, skip=unscored)  # noqa: E731

        counts = self.accelerator.reduce(valid.sum().to(torch.float32), reduction="sum")
        n_global = counts.item()
        if n_global == 0:  # every group filtered out: no update anywhere (same decision on every rank)
            return scored_logps(), {"loss": float("nan")}
        if self.guard_poisoned:  # non-finite rewards / log-probs in this batch (global decision): no PRM step
            return scored_logps(), {"loss": float("nan")}
        mb = prm.micro_batch_size
        pair_info: dict[str, Any] = {"group_ids": None, "global_labels": None}
        logps, loss_sum = [], torch.zeros((), device=labels.device)
        with prm.prm_context(trainable=True), torch.enable_grad():
            if a.prm_loss == "ce":
                # Rows that train nothing (filtered groups, unscorable or empty completions) only need their log-probs
                # (token rewards, metrics): one no-grad forward, no activations kept, no backward. Same weights, so
                # the same values. Under DeepSpeed every rank must run the same number of backward passes: all rows.
                if self._prime_engine is None:
                    grad_rows = valid.nonzero(as_tuple=True)[0]
                    free_rows = (~valid & ~unscored).nonzero(as_tuple=True)[0]
                else:
                    grad_rows = torch.arange(B, device=valid.device)
                    free_rows = grad_rows[:0]
                all_logps = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device)
                for s in range(0, grad_rows.numel(), mb):
                    rows = grad_rows[s : s + mb]
                    lp = completion_logps(prm.model, input_ids[rows], attention_mask[rows], T)
                    share = valid[rows].sum().item() / n_global
                    loss = F.implicit_prm_loss(
                        prm_logps=lp, ref_logps=ref_logps[rows], mask=completion_mask[rows], labels=labels[rows],
                        beta=a.prm_beta, loss_type="ce",
                    ) * share
                    self._prime_backward(loss)
                    loss_sum = loss_sum + loss.detach()
                    all_logps[rows] = lp.detach().float()
                if free_rows.numel():
                    with torch.no_grad():
                        all_logps[free_rows] = completion_logps(
                            prm.model, input_ids[free_rows], attention_mask[free_rows], T, micro_batch_size=mb
                        ).float()
                logps.append(all_logps)
            else:
                lp = completion_logps(prm.model, input_ids, attention_mask, T, micro_batch_size=mb)
                loss, pair_info = self._prime_global_batch_loss(lp, ref_logps, completion_mask, labels)
                self._prime_backward(loss)
                # the loss is the global one on every rank: the reduce-sum below must count it once
                loss_sum = loss.detach() / self.accelerator.num_processes
                logps.append(lp.detach())
        loss_value = self.accelerator.reduce(loss_sum, reduction="sum").item()
        prm_logps = torch.cat(logps, dim=0)
        # before the step: rows whose PRM log-probs or token rewards (the update's own forward) are non-finite or
        # beyond `prm_max_abs_token_reward` poison the batch and skip the step, named in the log (collective)
        bad = self._prime_inspect_token_rewards(prm_logps, ref_logps, completion_mask, unscored)
        if bool(bad.any()):
            if self._prime_engine is None:
                self.prm_optimizer.zero_grad(set_to_none=True)  # skipped: weights, moments and schedule unchanged
            elif self._prime_optimizer_step(loss_finite=math.isfinite(loss_value)) is not None:
                self._prime_num_updates += 1  # DeepSpeed stepped inside backward: that step could not be held back
            return prm_logps, {"loss": loss_value, "token_rewards_checked": True}
        grad_norm = self._prime_optimizer_step(loss_finite=math.isfinite(loss_value))
        if grad_norm is None:  # non-finite PRM loss or gradient norm: step skipped (weights unchanged), batch poisoned
            # every row's log-probs and token rewards passed the check above: no row to blame
            self._guard_poison_batch("train", "non-finite PRM loss/gradient norm")
            return prm_logps, {"loss": loss_value, "token_rewards_checked": True}
        self._prime_num_updates += 1
        lr = self.prm_lr_scheduler.get_last_lr()[0] if self.prm_lr_scheduler is not None else a.prm_learning_rate
        if a.prm_update == "double":
            prm_logps = scored_logps()
        stats = {"loss": loss_value, "grad_norm": grad_norm, "learning_rate": lr,
                 "token_rewards_checked": a.prm_update == "single"}
        self._prime_dispatch(
            "on_prm_step", loss=loss_value, grad_norm=grad_norm, learning_rate=lr,
            num_updates=self._prime_num_updates, labels=labels, row_weights=valid.float() / n_global,
            prm_model=self.prm_model, prm_update=a.prm_update, loss_group_ids=pair_info["group_ids"],
            loss_labels=pair_info["global_labels"],
        )
        return prm_logps, stats


class PrimeRLOOTrainer(PrimeMixin, RLOOTrainer):
    """PRIME on TRL's ``RLOOTrainer``: implicit-PRM process rewards, Eq. 5 advantages, token-level PPO-clip loss.

    Args: as ``trl.RLOOTrainer`` (``model``, ``reward_funcs``, ``args`` a :class:`~trl_prime.PrimeRLOOConfig`,
    datasets, ``processing_class``, ``callbacks``, ``peft_config``, ...), plus, by keyword:

    - ``prm_model``: the PRM's initial model (a path or a causal LM instance); overrides ``args.prm_model``.
    - ``prm_ref_model``: the PRM reference (a path or a causal LM); overrides ``args.prm_ref_model``.

    TRL 1.16's RLOO loss is sequence-level; this trainer replaces it with PRIME's token-level PPO-clip objective
    (Eq. 6): ``-min(rho_t A_t, clip(rho_t, 1-eps, 1+eps_high) A_t)`` with ``rho_t = pi_theta(y_t)/pi_old(y_t)``
    (the rollout log-probs are stored per token), averaged over the kept tokens of the global batch (as TRL's
    ``"dapo"`` aggregation). Filtered and unscorable rows get weight 0.

    Example::

        from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer
        from trl_prime.rewards import math_reward

        trainer = PrimeRLOOTrainer(model="Qwen/Qwen2.5-Math-7B", reward_funcs=math_reward,
                                   args=PrimeRLOOConfig("out"), train_dataset=dataset)
        trainer.train()
    """

    _prime_config_class = PrimeRLOOConfig
    _tag_names = ["trl", "rloo", "prime", "trl-prime"]
    _name = "PRIME-RLOO"
    loss_is_scaled_for_ga = True

    def _compute_loss(self, model, inputs):
        # rows with loss weight 0 (filtered prompts, PROF-dropped or unscorable rows) add nothing to this token-sum
        # loss: the policy's forward and backward skip them (trl_prime/rollout.py)
        if not self.aux_loss_enabled:  # a MoE router loss is a statistic of every attended token: keep the rows
            inputs = drop_zero_weight_rows(inputs, inputs["prime_loss_mask"], self.accelerator)
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{k: inputs.get(k) for k in _MM_KEYS},
        )
        mask = inputs["prime_loss_mask"].to(per_token_logps.dtype)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = per_token_logps.detach() if old is None else old
        coef_1 = torch.exp(per_token_logps - old)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            # token mean over the kept tokens of the whole optimisation step, across processes and accumulation
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        else:
            normalizer = mask.sum().clamp(min=1.0)
        loss = (per_token_loss * mask).sum() / normalizer
        if self.aux_loss_enabled:
            acc = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / acc
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())

        def global_masked_mean(x, m):
            totals = self.accelerator.reduce(torch.stack([(x * m).sum(), m.sum().float()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        self._metrics[mode]["entropy"].append(global_masked_mean(entropies, mask))  # over the trained tokens, as GRPO
        is_low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
        is_high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
        self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(is_low, mask))
        self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(is_high, mask))
        self._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(is_low, is_high), mask))
        live = mask.sum(-1) > 0  # per-completion clip ratios of the trained rows only (NaN elsewhere)
        seq = lambda x: torch.where(live, (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0), torch.nan)  # noqa: E731
        self._metrics[mode]["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(seq(is_low))).item())
        self._metrics[mode]["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(seq(is_high))).item())
        return loss


class PrimeGRPOTrainer(PrimeMixin, DropZeroWeightRowsMixin, GRPOTrainer):
    """PRIME on TRL's ``GRPOTrainer``: the same PRIME machinery (:class:`PrimeMixin`) with the GRPO estimator.

    Args: as ``trl.GRPOTrainer`` (``args`` a :class:`~trl_prime.PrimeGRPOConfig`), plus, by keyword, ``prm_model``
    and ``prm_ref_model`` as in :class:`PrimeRLOOTrainer`.

    TRL's GRPO loss already takes ``(B, T)`` advantages with a token-level ratio; PRIME's loss mask (filtered and
    unscorable rows) reaches it as ``tool_mask`` (a loss-only mask, it does not change attention), and
    ``num_items_in_batch`` counts the kept tokens.
    """

    _prime_config_class = PrimeGRPOConfig
    _tag_names = ["trl", "grpo", "prime", "trl-prime"]
    _name = "PRIME-GRPO"

    def _prime_adapt_output(self, output: dict, loss_mask: torch.Tensor) -> None:
        tool_mask = output.get("tool_mask")
        keep = (loss_mask > 0).to(output["completion_mask"].dtype)
        output["tool_mask"] = keep if tool_mask is None else tool_mask * keep
        output["num_items_in_batch"] = gather((output["completion_mask"] * output["tool_mask"]).sum()).sum()
