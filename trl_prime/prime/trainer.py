"""PRIME trainers: online implicit-PRM process rewards on top of TRL's RLOO and GRPO (PRIME arXiv 2502.01456).

Each generation round is PRIME Algorithm 1 (:meth:`PrimeMixin._algorithm_step`, one named method per line):

1. TRL generates ``K`` completions per prompt and scores them with the reward functions (outcome rewards, gathered
   over processes; ``NaN`` = unscorable): the adapters of :mod:`trl_prime.adapters`.
2. Online prompt filter (:func:`trl_prime.functional.prompt_accuracy_mask`): groups whose accuracy (the mean PRM
   label, :func:`trl_prime.functional.prm_labels` of the outcome rewards, ``prm_label``) lies outside
   ``[filter_lower, filter_upper]`` train neither the PRM nor the policy (loss weight 0).
3. Implicit PRM: one forward pass gives the per-token log-probs; the cross-entropy loss on the kept rows' PRM
   labels updates the PRM with its own AdamW and scheduler (:class:`~trl_prime.prime.prm_optimizer.PRMOptimizer`);
   with ``prm_update="single"`` the token rewards (Eq. 3) come from that same forward (before the step), with
   ``"double"`` from a second no-grad forward after it.
4. Advantages (:func:`trl_prime.functional.prime_advantages`, Eq. 5 for the RLOO estimator) from the ``(B, T)``
   token rewards and the outcome rewards, computed over the global batch (padded, gathered, sliced back per
   process, as TRL does for rewards).
5. Policy update: token-level PPO-clip on ``(B, T)`` advantages (Eq. 6: TRL's GRPO loss;
   :func:`trl_prime.functional.token_ppo_clip_loss` for RLOO).

All of it lives in :class:`PrimeMixin`, shared by :class:`PrimeRLOOTrainer` and :class:`PrimeGRPOTrainer`; the
algorithms are the pure functions of :mod:`trl_prime.functional`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from accelerate.utils import gather, is_peft_model
from torch import nn
from trl import RLOOTrainer

from trl_prime import functional as F
from trl_prime.adapters import GRPOAdapter, RLOOAdapter
from trl_prime.guards import check_causal_lm_source
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
    select_mm_rows,
    sync_trl_ref_adapter,
    unwrap,
)
from trl_prime.prime.config import PrimeGRPOConfig, PrimeOptions, PrimeRLOOConfig
from trl_prime.prime.estimators import estimator_options, get_advantage_estimator
from trl_prime.prime.oversample import (
    compact_generation_batch,
    compaction_rows,
    oversampled_groups,
    select_first_groups,
)
from trl_prime.prime.prm_optimizer import PRM_ADAPTER, PRM_CHECKPOINT_DIR, VALUE_CHECKPOINT_DIR, PRMOptimizer
from trl_prime.prime.replay import ROW_FIELDS, PrmReplay, select_rows, to_device
from trl_prime.prime.value import Critic, build_value_spec, value_metrics
from trl_prime.prof.filter import ProfFilter, prime_prof_rows
from trl_prime.rollout import (
    MM_KEYS,
    Rollout,
    action_mask,
    gather_padded,
    mask_loss_rows,
    resolve_trainer_args,
)


PRM_REF_ADAPTER = "prm_ref"


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


def _logps_of_rows(
    logps_fn, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int, *, skip: torch.Tensor, mm: dict
) -> torch.Tensor:
    """``logps_fn(input_ids, attention_mask, T, mm_inputs=mm)`` (``(B, T)`` no-grad log-probs; ``mm`` the rows'
    multimodal inputs, empty for text) run on the rows not flagged in ``skip`` ``(B,)`` bool only; skipped rows get
    no forward and log-probs 0."""
    if not bool(skip.any()):
        return logps_fn(input_ids, attention_mask, T, mm_inputs=mm)
    rows = (~skip).nonzero(as_tuple=True)[0]
    out = torch.zeros((input_ids.size(0), T), dtype=torch.float32, device=input_ids.device)
    if rows.numel():
        sub = logps_fn(input_ids[rows], attention_mask[rows], T, mm_inputs=select_mm_rows(mm, rows))
        out = out.to(sub.dtype)
        out[rows] = sub
    return out


def _unlabelled_rows_to(batch: dict, rows: int) -> dict:
    """A replayed text ``batch`` laid out as exactly ``rows`` rows (DeepSpeed's equal backward counts): its rows
    repeated, the copies unlabelled (weight 0). Raises ``ValueError`` when it holds more."""
    n = batch["labels"].numel()
    if n == rows:
        return batch
    if n > rows or n == 0 or batch["mm"]:
        raise ValueError(
            f"A replayed round holds {n} rows where this run's rounds hold {rows} per process (a window restored from "
            "a checkpoint of another layout). Resume with the same batch layout, or start with prm_replay_rounds=0."
        )
    idx = torch.arange(rows, device=batch["labels"].device) % max(n, 1)
    out = {k: batch[k][idx] for k in ROW_FIELDS}
    out["labels"] = torch.where(torch.arange(rows, device=idx.device) < n, out["labels"], float("nan"))
    return {**out, "mm": {}}


def _accepts_images(model: nn.Module | None) -> bool:
    """Whether ``model``'s forward (inside DDP / DeepSpeed / PEFT wrappers) takes ``pixel_values``: a vision-language
    model; a text-only causal LM (e.g. a text PRM next to a VLM policy) scores the text alone."""
    if model is None:
        return False
    base = unwrap(model)
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    return "pixel_values" in inspect.signature(base.forward).parameters


@dataclass(frozen=True)
class PromptFilter:
    """Algorithm 1 line 6, the online prompt filter's result (:meth:`PrimeMixin._filter_prompts`)."""

    kept: torch.Tensor  # (B_global,) bool: rows of the groups the prompt filter kept (and oversampling selected)
    labels: torch.Tensor  # (B_global,) the PRM's labels in [0, 1] or NaN (prm_label; the outcome's)
    lengths: torch.Tensor  # (B_global,) completion lengths
    kept_fraction: float  # fraction of the generated groups that pass the filter (filter/kept_fraction)
    kept_groups: int  # groups that train this round (filter/kept_groups; at most the target with oversampling)
    skip_filtered: bool  # filtered rows get no reference / PRM forward (prm_score_filtered_rows=False)
    unscored: torch.Tensor  # (B,) bool: rows without reference / PRM forward (log-probs 0)


class PrmUpdate(NamedTuple):
    """Algorithm 1 line 8's result (:meth:`PrimeMixin._update_prm`)."""

    logps: torch.Tensor  # (B, T) the implicit PRM's log-probs (Eq. 3's pi_phi), detached
    stats: dict  # loss (NaN without trained rows), and after a step grad_norm, learning_rate, replay_rows, ...


@dataclass(frozen=True)
class Advantages:
    """Algorithm 1 line 9's result (:meth:`PrimeMixin._advantages`): Eq. 5 over the global batch and this process's
    share of it."""

    advantages_g: torch.Tensor  # (B_global, T_max) Eq. 5 advantages
    advantages: torch.Tensor  # (B, T) this process's advantages
    loss_mask: torch.Tensor  # (B, T) loss weight: completion tokens of kept, scorable rows
    rewards_g: torch.Tensor  # (B_global, T_max) token rewards, padded and gathered
    mask_g: torch.Tensor  # (B_global, T_max) completion mask, padded and gathered
    inputs: dict  # the keyword arguments of functional.prime_advantages


@dataclass
class PrimeRound(Rollout):
    """A generation round in PRIME's step: the :class:`~trl_prime.rollout.Rollout` and what each line of Algorithm 1
    adds to it, each field set once, by :meth:`PrimeMixin._algorithm_step` from a step's return value. Local tensors
    are ``(B, T)`` / ``(B,)`` (this process), global ones ``(B_global, ...)``."""

    actions: torch.Tensor | None = None  # (B, T) the policy's own completion tokens (tool responses excluded)
    mm: dict = field(default_factory=dict)  # a vision-language policy's multimodal inputs (TRL's, MM_KEYS)
    filter: PromptFilter | None = None  # line 6: the prompt filter's rows, the PRM labels
    ref_logps: torch.Tensor | None = None  # (B, T) reference log-probs (Eq. 3's pi_ref)
    policy_logps: torch.Tensor | None = None  # (B, T) rollout log-probs (None when TRL skipped them)
    prm_logps: torch.Tensor | None = None  # (B, T) implicit PRM log-probs (Eq. 3's pi_phi), detached
    prm_stats: dict | None = None  # PRM update: loss, grad_norm, learning_rate, token_rewards_checked
    token_rewards: torch.Tensor | None = None  # (B, T) Eq. 3 token rewards
    seq_rewards: torch.Tensor | None = None  # (B_global,) sum of each row's token rewards
    policy_kept: torch.Tensor | None = None  # (B_global,) bool: rows the policy trains on (PROF narrows the filter's)
    values: torch.Tensor | None = None  # (B, T) V(y_<t) of PPO's GAE (the critic's, or the implicit PRM's prefix)
    adv: Advantages | None = None  # line 9: the advantages and the loss mask


class PrimeMixin:
    """The PRIME machinery shared by :class:`PrimeRLOOTrainer` and :class:`PrimeGRPOTrainer`.

    It owns the implicit PRM (:class:`~trl_prime.ImplicitPRM` in ``self.implicit_prm``), its optimisation state
    (``self.prm_optim``, a :class:`~trl_prime.prime.prm_optimizer.PRMOptimizer`: optimizer and scheduler, also as
    ``self.prm_optimizer`` and ``self.prm_lr_scheduler``), the online prompt filter, the advantages and the PRIME
    metrics, callbacks and checkpoint files. Each generation round runs :meth:`_algorithm_step` (PRIME Algorithm 1),
    called by the adapter (:mod:`trl_prime.adapters`) once TRL has generated and scored the completions. The
    adapter's other hooks: ``_token_logps`` (to see the rollout and reference log-probs TRL computes),
    ``_prepare_method`` (PRM optimizer, resume), ``_save_method_state`` (checkpoints), ``_method_train_sampler``
    (oversampling) and ``_after_policy_step`` (the held PRM and critic steps); and ``save_model``.

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
    the advantages against the PRM labels (``prm_label``), over the kept groups; tied rewards score 0.5
    (``ties="half"``), so the untrained PRM of step 1 reads exactly 0.5 as in PRIME Figure 5),
    ``prm/token_reward_{mean,std,min,max}`` (over every completion token of the batch), ``filter/kept_fraction``
    (fraction of groups kept), ``prm/grad_norm`` and ``prm/learning_rate``; plus TRL's own metrics and whatever the
    reward functions log through ``log_metric`` (e.g. ``math/<reason>`` counts of
    :func:`trl_prime.rewards.math_reward`).

    PPO (``prime_estimator="ppo"``, PRIME section 5.4, Table 4): a value model
    (:class:`~trl_prime.prime.value.ValueModel`, held by ``self.value_function``, its optimizer ``self.value_optim``,
    a :class:`~trl_prime.prime.prm_optimizer.ValueOptimizer`, both held by the :class:`~trl_prime.prime.value.Critic`
    ``self.critic``, ``None`` without a learned critic) gives ``V(y_<t)``; :meth:`_update_value` trains it once
    per generation round and GAE gives the advantages. With ``prime_value="implicit_prm"`` there is no critic: the
    advantage is the outcome minus the implicit PRM's prefix value, ``A_t = outcome_coef * r_o - sum_{s<t}
    r_phi(y_s)`` (``gamma = lam = 1``). The value model is a copy of the policy's initial checkpoint
    (``value_model``: another one), or under PEFT a third adapter ``"value"`` on the policy's base; metrics
    ``value/loss``, ``value/explained_variance``, ``value/clipfrac``, ``value/mean``; callbacks ``on_value_step``;
    checkpoints ``value/``.

    Distributed: under DDP the PRM's gradients are all-reduced by hand (sum of per-rank losses already scaled by the
    global number of kept rows); under DeepSpeed the PRM is its own engine (a copy of the Trainer's DeepSpeed config
    without optimizer/scheduler) and the reference goes through TRL's ``prepare_deepspeed``. Every rank runs the same
    number of PRM forward/backward/step calls.
    """

    _config_class: type = PrimeRLOOConfig
    _rollout_class: type = PrimeRound
    critic: Critic | None = None  # the learned critic (prime_estimator="ppo", prime_value="critic"), else None

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: PrimeOptions | None = None,
        *trainer_args,
        prm_model: str | nn.Module | None = None,
        prm_ref_model: str | nn.Module | None = None,
        value_model: str | nn.Module | None = None,
        **trainer_kwargs,
    ):
        args, peft_config = resolve_trainer_args(
            self,
            model,
            args,
            trainer_args,
            trainer_kwargs,
            config_class=self._config_class,
            method="PRIME",
            accepted=PrimeOptions,
        )
        self._prm_spec = self._build_prm_models(model, args, prm_model, prm_ref_model, peft_config)
        value_spec = build_value_spec(model, args, value_model, peft_config)
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        # TRL's KL reference adapter "ref" misses IA3's weights (it copies names holding ".default." only)
        sync_trl_ref_adapter(self.model, pretrained_adapter=isinstance(model, nn.Module) and is_peft_model(model))
        self._setup_prm()
        self.critic = Critic.from_spec(
            value_spec,
            self.model,
            self.args,
            self.accelerator,
            deepspeed=self.is_deepspeed_enabled,
            micro_batch_size=self._prm_micro_batch_size(),
        )

    @property
    def value_function(self):
        """The critic's :class:`~trl_prime.prime.value.ValueFunction` (the value model); ``None`` without a critic."""
        return self.critic.value_function if self.critic is not None else None

    @property
    def value_optim(self):
        """The critic's :class:`~trl_prime.prime.prm_optimizer.ValueOptimizer`; ``None`` without a critic."""
        return self.critic.value_optim if self.critic is not None else None

    # ----------------------------------------------------------------------------------------------------------
    # Construction
    # ----------------------------------------------------------------------------------------------------------
    def _build_prm_models(self, model, args, prm_model, prm_ref_model, peft_config) -> dict:
        """Build the PRM and its reference *before* TRL loads, patches or wraps the policy."""
        is_peft_policy = isinstance(model, nn.Module) and is_peft_model(model)
        uses_peft = peft_config is not None or is_peft_policy
        if prm_model is None:
            prm_model = args.prm_model
        if prm_ref_model is None:
            prm_ref_model = args.prm_ref_model
        if uses_peft:
            warn_full_finetuning_rates(args, prm_is_adapter=prm_model is None)
        init_kw = model_init_kwargs(args)  # a custom-code checkpoint is checked as it is loaded
        load_kw = dict(trust_remote_code=init_kw.get("trust_remote_code", False), revision=init_kw.get("revision"))
        check_causal_lm_source(prm_model, "prm_model", **load_kw)
        check_causal_lm_source(prm_ref_model, "prm_ref_model", **load_kw)
        if isinstance(prm_ref_model, nn.Module) and args.prm_reference == "policy":
            raise ValueError("`prm_ref_model` was given but `prm_reference`='policy' uses the rollout log-probs.")

        def load(src):
            return load_model_copy(
                src,
                args,
                peft_message=(
                    "A PeftModel cannot be copied into a separate PRM; pass `prm_model` (a path or a causal LM), or "
                    "let the PRM be the second adapter 'prm' on the policy (the default with PEFT)."
                ),
            )

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

    def _setup_prm(self) -> None:
        """Wrap the PRM built by :meth:`_build_prm_models` into ``self.implicit_prm``, with its optimizer object
        ``self.prm_optim``, the PROF filter and the guards."""
        spec = self._prm_spec
        self._shares_trl_ref = False
        if self.is_fsdp_enabled:
            raise ValueError(
                "PRIME trainers do not support FSDP yet: the implicit PRM needs its own sharded engine. Use DeepSpeed "
                "ZeRO-2/3 (`--deepspeed` / accelerate's DeepSpeed plugin) or DDP."
            )
        if spec["kind"] == "adapter":
            self.implicit_prm = self._adapter_prm(spec)
        else:
            self.implicit_prm = self._model_prm(spec)
        del self._prm_spec
        self.prm_optim = PRMOptimizer(
            self.implicit_prm, self.args, self.accelerator, deepspeed=self.is_deepspeed_enabled
        )
        self.prm_replay = PrmReplay(self.args.prm_replay_rounds)  # recent rounds' PRM rows (off by default)
        # a text-only PRM (or PRM reference) next to a vision-language policy scores the text: no images for it
        prm = self.implicit_prm
        self._prm_takes_images = _accepts_images(prm.model)
        self._prm_ref_takes_images = (
            _accepts_images(prm.ref_model) if prm.ref_model is not None else self._prm_takes_images
        )
        self.prof_filter = ProfFilter.from_trainer(self)  # PROF (trl_prime/prof/); None when prof_mode="off"

    def _prm_micro_batch_size(self) -> int:
        return self.args.prm_micro_batch_size or self.args.per_device_train_batch_size

    def _adapter_prm(self, spec: dict) -> ImplicitPRM:
        """The PEFT PRM: a second adapter ``"prm"`` on the policy's PeftModel (reference: the base with adapters
        disabled, or a frozen copy ``"prm_ref"`` of a pre-trained adapter)."""
        args = self.args
        if self.is_deepspeed_enabled:
            raise ValueError(
                "The shared-base PEFT PRM (adapter 'prm' on the policy) is not supported with DeepSpeed: its "
                "adapter would be partitioned inside the policy's engine. Pass `prm_model` (a separate PRM, "
                "trained as its own DeepSpeed engine) or train without DeepSpeed."
            )
        peft_model = self.model
        check_peft_adapter_supported(peft_model)
        prm_cfg = copy.deepcopy(peft_model.peft_config["default"])
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
        # TRL's KL reference (beta != 0) is the same base with adapters disabled: its log-probs are reused
        self._shares_trl_ref = (
            args.beta != 0.0 and args.prm_reference == "sft" and ref_adapter is None and self.temperature == 1.0
        )
        return ImplicitPRM(
            peft_model,
            None,
            beta=args.prm_beta,
            tokenizer=self._tokenizer,
            adapter_name=PRM_ADAPTER,
            ref_adapter_name=ref_adapter if args.prm_reference == "sft" else None,
            micro_batch_size=self._prm_micro_batch_size(),
            fused_head=False,
            trained_reference="policy" if args.prm_reference == "policy" else None,
        )

    def _model_prm(self, spec: dict) -> ImplicitPRM:
        """The PRM as a separate model (trainable, on the device unless DeepSpeed places it) with its frozen reference,
        or TRL's reference model when they are the same."""
        prm, ref = spec["prm"], spec["ref"]
        prm.requires_grad_(True)
        if spec["share_trl_ref"] and self.ref_model is not None:
            add_fused_head(self.ref_model, mark_only=True)  # TRL patched it at temperature 1
            ref = self.ref_model
            self._shares_trl_ref = True
        elif ref is not None:
            ref = prepare_frozen(ref, self)
        if not self.is_deepspeed_enabled:
            prm = prm.to(self.accelerator.device)
        prm.eval()
        return ImplicitPRM(
            prm,
            ref,
            beta=self.args.prm_beta,
            tokenizer=self._tokenizer,
            micro_batch_size=self._prm_micro_batch_size(),
            fused_head=False,
            trained_reference="policy" if self.args.prm_reference == "policy" else None,
        )

    # ----------------------------------------------------------------------------------------------------------
    # The PRM's optimizer and checkpoints (trl_prime/prime/prm_optimizer.py)
    # ----------------------------------------------------------------------------------------------------------
    @property
    def prm_model(self) -> nn.Module:
        """The PRM module (unwrapped; for a PEFT PRM, the policy's PeftModel holding adapter ``"prm"``)."""
        return unwrap(self.implicit_prm.model)

    @property
    def prm_optimizer(self):
        """The PRM's optimizer (AdamW, or the DeepSpeed engine's optimizer); ``None`` before training starts."""
        return self.prm_optim.optimizer

    @property
    def prm_lr_scheduler(self):
        """The PRM's learning-rate scheduler; ``None`` before training starts."""
        return self.prm_optim.lr_scheduler

    def _prepare_method(self, max_steps, resume_from_checkpoint) -> None:
        # the adapter's hook after Trainer prepared the policy: the PRM's (and critic's) optimizer and scheduler, their
        # state and the replay window on resume
        self.prm_optim.create(max_steps)
        if resume_from_checkpoint is not None:
            self.prm_optim.load_state(resume_from_checkpoint, self.prm_model)
            self.prm_replay.load(resume_from_checkpoint, self.accelerator.process_index)
        if self.critic is not None:
            self.critic.prepare(max_steps, resume_from_checkpoint)

    def _save_method_state(self, checkpoint_dir: str) -> None:
        # the adapter's hook inside the atomic checkpoint (trl_prime/checkpointing.py): Trainer's checkpoint called
        # save_model, which wrote the PRM's weights to checkpoint-N/prm; its optimisation state follows
        self.prm_optim.save_state(checkpoint_dir, is_main_process=self.args.should_save)
        self.prm_replay.save(checkpoint_dir, self.accelerator.process_index)
        if self.critic is not None:
            self.critic.save_state(checkpoint_dir, is_main_process=self.args.should_save)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy as ``Trainer.save_model`` does, the trained implicit PRM in ``<output_dir>/prm`` and the
        value model (``prime_estimator="ppo"``) in ``<output_dir>/value``.

        ``<output_dir>/prm`` is a :meth:`~trl_prime.ImplicitPRM.save_pretrained` folder (PRM weights or adapter,
        tokenizer, reference unless ``prm_save_reference=False``, ``implicit_prm_config.json``) that
        :meth:`~trl_prime.ImplicitPRM.from_pretrained` loads; written by the main process, gathered under ZeRO-3.
        Call it on every process (as ``Trainer.save_model``).
        """
        super().save_model(output_dir, _internal_call=_internal_call)
        self.save_prm(os.path.join(output_dir or self.args.output_dir, PRM_CHECKPOINT_DIR))
        self.save_value_model(os.path.join(output_dir or self.args.output_dir, VALUE_CHECKPOINT_DIR))
        self.accelerator.wait_for_everyone()

    def save_value_model(self, output_dir: str) -> None:
        """Save the value model (``value/`` folder: the backbone or adapter ``"value"``, and
        ``value_head.safetensors``; ``value_model=`` loads it back); call it on every rank. No-op without a critic."""
        if self.critic is not None:
            self.critic.save_pretrained(output_dir, is_main_process=self.args.should_save)

    def save_prm(self, output_dir: str) -> None:
        """Save the implicit PRM (``save_pretrained`` folder, reference, config json); call it on every rank."""
        self.prm_optim.save_pretrained(
            output_dir, save_reference=self.args.prm_save_reference, is_main_process=self.args.should_save
        )

    # ----------------------------------------------------------------------------------------------------------
    # Around TRL's per-token log-probs (the adapter's hook; the rollout capture: trl_prime/adapters.py)
    # ----------------------------------------------------------------------------------------------------------
    def _token_logps(self, trl_fn, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        cap = self._rollout_capture
        trl_ref = cap is not None and not torch.is_grad_enabled() and self._is_trl_ref_call(model)
        if (
            cap is not None
            and not torch.is_grad_enabled()
            and model is self.model
            and not trl_ref
            and "policy_logps" not in cap
            and self._skips_rollout_logps()
        ):
            cap["policy_logps"] = None  # on-policy: no rollout log-prob forward (the loss uses its own, detached)
            return input_ids.new_zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32), None, None
        text_only = all(kwargs.get(k) is None for k in MM_KEYS)
        call_model = _PositionIdsFromMask(model) if text_only else model
        # a reference shared with the implicit PRM is scored as the PRM's: eval mode (no dropout)
        with eval_mode(model) if trl_ref and self._shares_trl_ref else contextlib.nullcontext():
            out = trl_fn(call_model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if cap is not None and not torch.is_grad_enabled():
            if self._is_trl_ref_call(model):
                cap["trl_ref_logps"] = out[0]
            elif model is self.model and "policy_logps" not in cap:
                cap["policy_logps"] = out[0]
        return out

    def _skips_rollout_logps(self) -> bool:
        """Whether TRL's rollout (old) log-prob forward is wasted and skipped: TRL's RLOO runs it every generation
        round, but PRIME's token-level loss falls back to its own detached log-probs (ratio 1), which are equal when
        the policy does not move between generation and optimisation (GRPO's rule: ``gradient_accumulation_steps``
        a multiple of ``steps_per_generation * num_iterations``). Kept for TRL's KL-in-reward (``beta != 0``) and
        ``prm_reference="policy"`` (they need the values)."""
        a = self.args
        if not isinstance(self, RLOOTrainer) or self.beta != 0.0 or a.prm_reference == "policy":
            return False
        return a.gradient_accumulation_steps % (a.steps_per_generation * self.num_iterations) == 0

    def _is_trl_ref_call(self, model) -> bool:
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

    def _dispatch(self, event: str, **payload) -> None:
        """Call ``event(args, state, control, **payload)`` on every callback that defines it."""
        for cb in self.callback_handler.callbacks:
            fn = getattr(cb, event, None)
            if callable(fn):
                fn(self.args, self.state, self.control, **payload)

    # ----------------------------------------------------------------------------------------------------------
    # One PRIME step: Algorithm 1
    # ----------------------------------------------------------------------------------------------------------
    def _algorithm_step(self, output: dict, r: PrimeRound) -> dict:
        """PRIME Algorithm 1 (arXiv 2502.01456) on one generation round; returns TRL's output, ready for its loss.

        Lines 3-5 (a batch of prompts, ``K`` completions each, their outcome rewards ``r_o``) ran in TRL's generation
        step and :func:`~trl_prime.rollout.score_rollout` (``r``: outcome rewards, scorable rows, guard checks).

        - line 6, online prompt filter (section 3.3): groups whose accuracy lies outside the filter bounds;
        - line 7, reference log-probs ``log pi_ref`` of Eq. 3;
        - line 8, PRM update: cross-entropy of ``sigmoid(r_phi(y))`` against the label of ``r_o`` (``prm_label``)
          on the kept rows; its forward gives ``log pi_phi`` (``prm_update="double"``: a forward after the step);
        - line 7, Eq. 3 token rewards ``r_phi(y_t) = beta log pi_phi(y_t) / pi_ref(y_t)``;
        - optional row filter (PROF, arXiv 2509.03403): ``m`` of the ``K`` completions of each kept prompt;
        - ``prime_estimator="ppo"`` (section 5.4): the values ``V(y_<t)`` of GAE, with one update of the critic;
        - line 9, Eq. 5 advantages (or GRPO / REINFORCE, Appendix B; or GAE) over the global batch;
        - line 10, hand-off to TRL's loss: token-level PPO-clip, Eq. 6, with the loss mask of filtered rows;
        - metrics and the ``on_rollouts_scored`` callbacks. Line 11 (``theta_old <- theta``) is TRL's.
        """
        r.actions = action_mask(output)  # tool responses are not the policy's actions: no token reward on them
        r.mm = {k: output[k] for k in MM_KEYS if output.get(k) is not None}  # the PRM and reference see the images
        r.filter = self._filter_prompts(r)  # line 6
        r.ref_logps, r.policy_logps = self._reference_logps(output, r)  # line 7: log pi_ref (and the rollout's)
        r.prm_logps, r.prm_stats = self._update_prm(output, r)  # line 8 (and log pi_phi of line 7)
        r.token_rewards, r.seq_rewards = self._token_rewards(output, r)  # line 7: Eq. 3
        r.policy_kept = self._filter_rows(output, r)  # PROF (optional)
        r.values = self._update_value(output, r)  # PPO (section 5.4): the value baseline, the critic's update
        r.adv = self._advantages(output, r)  # line 9: Eq. 5
        self._hand_to_loss(output, r)  # line 10: Eq. 6 in TRL's loss
        self._log_round(output, r)
        return self._compact_oversampled(output, r)  # oversampling: back to one generation batch of rows

    def _filter_prompts(self, r: PrimeRound) -> PromptFilter:
        """Algorithm 1 line 6, the online prompt filter (PRIME section 3.3): the ``(B_global,)`` bool rows of the
        groups whose accuracy (mean PRM label) lies in ``[filter_lower, filter_upper]`` (every row in evaluation),
        with the labels, the kept fraction and the rows left unscored; calls ``on_prompts_filtered``.

        Raises:
            ValueError: with ``prm_label="identity"``, when a scorable outcome reward lies outside ``[0, 1]``.
        """
        a, K = self.args, r.num_generations
        labels = self._prm_labels(r)
        if r.mode == "train":
            # truncated = TRL's definition (no EOS at the end, TRL's completions/clipped_ratio), handed to the
            # length test of prompt_accuracy_mask as length max_completion_length (truncated) or 0
            max_len = self.max_completion_length
            trunc = dict(completion_lengths=r.truncated.long() * max_len, max_completion_length=max_len)
            kept = F.prompt_accuracy_mask(
                outcome_rewards=labels,
                num_generations=K,
                lower=a.filter_lower,
                upper=a.filter_upper,
                **(trunc if a.filter_truncated else {}),
            )
        else:
            kept = torch.ones_like(r.outcome, dtype=torch.bool)
        kept_fraction = kept.view(-1, K)[:, 0].float().mean().item()
        kept = self._select_oversampled(kept, K, r.mode)
        group_kept = kept.view(-1, K)[:, 0]
        self._dispatch_prompts_filtered(r, kept, group_kept, kept_fraction)
        skip_filtered, unscored = self._unscored_rows(r, kept)
        return PromptFilter(
            kept=kept,
            labels=labels,
            lengths=gather(torch.tensor(r.capture["completion_lengths"], device=self.accelerator.device)),
            kept_fraction=kept_fraction,
            kept_groups=int(group_kept.sum().item()),
            skip_filtered=skip_filtered,
            unscored=unscored,
        )

    def _dispatch_prompts_filtered(self, r: PrimeRound, kept, group_kept, kept_fraction: float) -> None:
        """``on_prompts_filtered`` callbacks: ``kept_mask`` the rows that train (after an oversampled round's
        selection), ``kept_fraction`` the fraction of the generated groups that pass the filter."""
        self._dispatch(
            "on_prompts_filtered",
            outcome_rewards=r.outcome,
            kept_mask=kept,
            group_kept=group_kept,
            kept_fraction=kept_fraction,
            num_generations=r.num_generations,
            mode=r.mode,
        )

    # ----------------------------------------------------------------------------------------------------------
    # Oversampling (oversample_factor > 1; trl_prime/prime/oversample.py)
    # ----------------------------------------------------------------------------------------------------------
    def _oversample_target_groups(self) -> int | None:
        """``G`` = the groups one generation batch trains on, when oversampling (``None`` without)."""
        if self.args.oversample_factor == 1.0:
            return None
        return self.args.generation_batch_size // self.num_generations

    def _select_oversampled(self, kept: torch.Tensor, K: int, mode: str) -> torch.Tensor:
        """With oversampling (training), the rows of the first ``generation_batch_size / K`` groups that pass the
        filter (:func:`~trl_prime.prime.oversample.select_first_groups`); ``kept`` otherwise."""
        target = self._oversample_target_groups()
        return kept if mode != "train" or target is None else select_first_groups(kept, K, target)

    def _oversampled_groups(self) -> int | None:
        """The prompts sampled per generation round when oversampling (``None`` without)."""
        target = self._oversample_target_groups()
        if target is None:
            return None
        K, n = self.num_generations, self.accelerator.num_processes
        return oversampled_groups(target, self.args.oversample_factor, K, n)

    def get_train_dataloader(self):
        # TRL's dataloader yields one generation batch per process (generation_batch_size / processes rows); with
        # oversampling it yields the oversampled one, in the same sampler order
        groups = self._oversampled_groups()
        if groups is None:
            return super().get_train_dataloader()
        from torch.utils.data import IterableDataset

        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                f"`oversample_factor`={self.args.oversample_factor} needs an indexable train_dataset (a "
                "datasets.Dataset); an IterableDataset cannot be oversampled. Set oversample_factor=1 or load the "
                "dataset without streaming."
            )
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=groups * self.num_generations // self.accelerator.num_processes,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _method_train_sampler(self, dataset=None):
        # TRL's RepeatSampler with `groups` prompts per generation batch instead of generation_batch_size / K
        groups = self._oversampled_groups()
        if groups is None:
            return None
        from trl.trainer.utils import RepeatSampler

        return RepeatSampler(
            data_source=self.train_dataset if dataset is None else dataset,
            mini_repeat_count=self.num_generations,
            batch_size=groups,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )

    def _compact_oversampled(self, output: dict, r: PrimeRound) -> dict:
        """With oversampling (training), TRL's generation batch back to ``generation_batch_size`` rows: the selected
        groups first, then loss-weight-0 rows of the others to fill it (:mod:`trl_prime.prime.oversample`); the
        loss's token count recounted over the compacted rows. Collective. ``output`` unchanged otherwise."""
        if r.mode != "train" or self._oversample_target_groups() is None:
            return output
        n_proc = self.accelerator.num_processes
        rows = compaction_rows(r.filter.kept, self.args.generation_batch_size)
        output = compact_generation_batch(
            self.accelerator,
            output,
            rows,
            pad_token_id=self._tokenizer.pad_token_id,
            num_rows_local=self.args.generation_batch_size // n_proc,
        )
        output["num_items_in_batch"] = gather(output["prime_loss_mask"].sum()).sum()
        return output

    def _unscored_rows(self, r: PrimeRound, kept: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """``(skip_filtered, unscored)``: whether filtered rows skip the reference / PRM forwards, and this process's
        ``(B_local,)`` bool rows whose reference / PRM log-probs are not computed: the filtered-out rows when
        ``prm_score_filtered_rows=False`` (CE loss, no DeepSpeed), else none."""
        a = self.args
        skip_filtered = (
            r.mode == "train"
            and not a.prm_score_filtered_rows
            and a.prm_loss == "ce"
            and self.prm_optim.engine is None
            and not self.is_deepspeed_enabled
        )
        kept_l = kept[r.local]
        return skip_filtered, (~kept_l if skip_filtered else torch.zeros_like(kept_l))

    def _prm_labels(self, r: PrimeRound) -> torch.Tensor:
        """The ``(B_global,)`` PRM labels of the outcome rewards (:func:`trl_prime.functional.prm_labels`, option
        ``prm_label``): the cross-entropy targets of the PRM update, read by the prompt filter and the PRM metrics.
        NaN (no label) for a row with an empty action mask (``r.actions``, e.g. a truncated completion masked by
        ``mask_truncated_completions``).

        Warns (``UserWarning``, each kind once per run, :func:`trl_prime.functional.prm_label_warnings`) where the
        label silently changes the method: ``"sigmoid"`` on rewards in ``[0, 1]``, ``"threshold"`` labelling every row
        alike, ``"group_rank"`` groups spread below ``prm_label_min_spread``.

        Raises:
            ValueError: with ``prm_label="identity"``, a scorable outcome reward outside ``[0, 1]``."""
        a = self.args
        if a.prm_label == "identity":
            self._check_outcome_labels(r)
        labels = F.prm_labels(
            r.outcome,
            a.prm_label,
            num_generations=r.num_generations,
            threshold=a.prm_label_threshold,
            temperature=a.prm_label_temperature,
            min_spread=a.prm_label_min_spread,
        )
        label_opts = dict(threshold=a.prm_label_threshold, min_spread=a.prm_label_min_spread)
        warned = self.__dict__.setdefault("_prm_label_warned", set())  # each kind once per run
        for kind, message in F.prm_label_warnings(
            r.outcome, a.prm_label, num_generations=r.num_generations, **label_opts
        ).items():
            if kind not in warned and self.accelerator.is_main_process:
                warned.add(kind)
                warnings.warn(message, UserWarning, stacklevel=2)
        # a row without a policy token (e.g. TRL's mask_truncated_completions) has nothing for the PRM to score: no
        # label, so the PRM loss, the prompt filter's accuracy and the PRM metrics all see the same labels
        no_action = gather((r.actions.sum(-1) == 0).to(torch.long)).bool()
        return torch.where(no_action, torch.full_like(labels, float("nan")), labels)

    def _check_outcome_labels(self, r: PrimeRound) -> None:
        scored = r.outcome[r.scorable]
        atol = F._LABEL_RANGE_ATOL  # float32 rounding of a weighted sum (1.0000001), clamped by F.prm_labels
        if bool(((scored < -atol) | (scored > 1 + atol)).any()):
            raise ValueError(
                f"PRIME trains the implicit PRM on outcome labels in [0, 1], but the weighted reward functions "
                f"{self.reward_func_names} gave values in [{scored.min().item():.3g}, {scored.max().item():.3g}]. Use "
                "a verifier returning 1/0 (or a fraction of tests passed), or set `reward_weights` so the sum stays "
                "in [0, 1]; for a reward model, a length or format reward, or weights summing to more than 1, keep "
                "the reward and derive the PRM's label from it: `prm_label`='threshold' (with "
                "`prm_label_threshold`), 'sigmoid' (with `prm_label_temperature`) or 'group_rank' (the default "
                "'identity' uses the reward itself)."
            )

    def _reference_logps(self, output: dict, r: PrimeRound) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Algorithm 1 line 7, the reference of Eq. 3: ``(B, T)`` no-grad log-probs of the completions under
        ``pi_ref`` (the PRM's frozen reference, TRL's shared reference, or with ``prm_reference="policy"`` the rollout
        policy), and the rollout log-probs (``None`` when TRL skipped them); guards both."""
        completion_mask = output["completion_mask"]
        T = completion_mask.size(1)
        policy_logps = r.capture.get("policy_logps")
        if self.args.prm_reference == "policy":
            if policy_logps is None:  # GRPO skips them when generation and optimisation are aligned
                with torch.no_grad():
                    policy_logps = self._get_per_token_logps_and_entropies(
                        self.model,
                        r.input_ids,
                        r.attention_mask,
                        T,
                        batch_size=self.implicit_prm.micro_batch_size,
                        **r.mm,
                    )[0]
            ref_logps = policy_logps
        elif self._shares_trl_ref and r.capture.get("trl_ref_logps") is not None:
            ref_logps = r.capture["trl_ref_logps"]
        else:
            with self.accelerator.autocast():  # the policy's mixed precision, as TRL scores its own reference
                ref_logps = _logps_of_rows(
                    self.implicit_prm.ref_logps,
                    r.input_ids,
                    r.attention_mask,
                    T,
                    skip=r.filter.unscored,
                    mm=r.mm if self._prm_ref_takes_images else {},
                )
        self.guards.inspect(
            r.mode,
            local_rows={"ref_logps": ref_logps, "policy_logps": policy_logps},
            masks={"ref_logps": completion_mask, "policy_logps": completion_mask},
        )
        return ref_logps, policy_logps

    def _update_prm(self, output: dict, r: PrimeRound) -> PrmUpdate:
        """Algorithm 1 line 8: one PRM update on the PRM labels (``r.filter.labels``) of the kept rows (training;
        :meth:`_train_prm`), or the PRM's forward alone (evaluation).

        Returns the PRM's ``(B, T)`` detached log-probs and the update's stats. The loss reads the policy's own tokens (``r.actions``)."""
        completion_mask, mm = r.actions, (r.mm if self._prm_takes_images else {})
        labels = r.filter.labels[r.local].clone()
        labels[~r.filter.kept[r.local]] = torch.nan  # weight 0 in the PRM loss (empty rows: NaN already)
        if r.mode == "train":
            return PrmUpdate(
                *self._train_prm(
                    r.input_ids,
                    r.attention_mask,
                    completion_mask,
                    labels,
                    r.ref_logps,
                    unscored=r.filter.unscored,
                    mm=mm,
                )
            )
        with self.accelerator.autocast():
            lp = self.implicit_prm.prm_logps(r.input_ids, r.attention_mask, completion_mask.size(1), mm_inputs=mm)
        return PrmUpdate(lp, {"loss": math.nan})

    def _token_rewards(self, output: dict, r: PrimeRound) -> tuple[torch.Tensor, torch.Tensor]:
        """Algorithm 1 line 7, PRIME Eq. 3: the ``(B, T)`` token rewards ``beta * (log pi_phi - log pi_ref)`` on every
        completion token (the last one leaves the advantages when ``include_last_token=False``). Guarded (non-finite
        or beyond ``prm_max_abs_token_reward``: the batch is poisoned, the rewards zeroed / clamped to stay finite).
        Tool responses (TRL's ``tool_mask``) get token reward 0. Returns ``(token_rewards (B, T), sequence rewards
        (B_global,))``, the sequence reward of a row the sum of its token rewards."""
        a, completion_mask = self.args, r.actions
        token_rewards = F.implicit_token_rewards(
            prm_logps=r.prm_logps, ref_logps=r.ref_logps, mask=completion_mask, beta=a.prm_beta
        )
        if r.prm_stats.get("token_rewards_checked"):  # by the PRM update, before its step (same values)
            bad = gather(self._bad_token_reward_rows(token_rewards, completion_mask).to(torch.long)).bool()
        else:
            bad = self._inspect_token_rewards(
                r.prm_logps, r.ref_logps, completion_mask, r.filter.unscored, mode=r.mode
            )
        if bool(bad.any()):  # the step is skipped; keep the rest of the batch's computation finite
            token_rewards = torch.nan_to_num(token_rewards, nan=0.0, posinf=0.0, neginf=0.0)
            if a.prm_max_abs_token_reward is not None:
                token_rewards = token_rewards.clamp(-a.prm_max_abs_token_reward, a.prm_max_abs_token_reward)
        return token_rewards, gather(token_rewards.sum(-1))

    def _filter_rows(self, output: dict, r: PrimeRound) -> torch.Tensor:
        """PROF's row filter (trl_prime/prof/; ``prof_mode != "off"``, training): the ``(B_global,)`` bool rows the
        policy trains on, ``m`` of the ``K`` completions of each kept prompt; ``r.filter.kept`` when PROF is off."""
        rows, metrics = prime_prof_rows(
            self.prof_filter,
            self.accelerator,
            step=self.state.global_step,
            mode=r.mode,
            kept=r.filter.kept,
            scorable=r.scorable,
            outcome=r.outcome,
            output=output,
            capture=r.capture,
            token_rewards=r.token_rewards,
            num_generations=r.num_generations,
        )
        for name, value in metrics.items():
            self.record_metric(r.mode, name, value)
        return rows

    def _update_value(self, output: dict, r: PrimeRound) -> torch.Tensor | None:
        """``prime_estimator="ppo"`` (PRIME section 5.4, Table 4): the ``(B, T)`` detached values ``V(y_<t)`` GAE
        subtracts (``None`` for the other estimators), on the PPO token rewards
        (:func:`trl_prime.functional.ppo_token_rewards`).

        - ``prime_value="critic"``: the token rewards are ``process_coef * r_phi(y_t)`` (Eq. 3) on every token plus
          ``outcome_coef * r_o`` on the last; the value model's forward gives the values, and its clipped value loss
          on their GAE returns trains it (:meth:`~trl_prime.prime.value.Critic.train`; training only).
        - ``prime_value="implicit_prm"``: no critic; the reward is ``outcome_coef * r_o`` on the last token only, and
          the value is the implicit PRM's prefix value ``V(y_<t) = sum_{s<t} r_phi(y_s)``
          (:func:`trl_prime.functional.implicit_prm_values`), so with ``gamma = lam = 1`` GAE gives
          ``A_t = outcome_coef * r_o - sum_{s<t} r_phi(y_s)``: the outcome minus the PRM's value of the prefix.
          That prefix sum is a logit (the PRM's CE scores ``sigmoid(r(y))``); ``prime_value_scale="prob"`` uses
          ``outcome_coef * sigmoid(sum_{s<t} r_phi(y_s))`` instead, on the outcome's scale for a label in [0, 1].

        Rows outside ``r.policy_kept`` (prompt filter, PROF) or unscorable get no reward (NaN), no value loss and no
        advantage. Non-finite values on the trained tokens poison the batch (guards, as a non-finite token reward)."""
        a = self.args
        if not get_advantage_estimator(a.prime_estimator, "prime_estimator").needs_values:
            return None
        outcome = self._outcome_with_kl_penalty(output, r)
        outcome = torch.where(r.policy_kept, outcome, torch.full_like(outcome, torch.nan))[r.local]
        critic = a.prime_value == "critic"
        value_rewards = F.ppo_token_rewards(
            r.token_rewards,
            outcome,
            r.actions,
            process_coef=a.process_coef if critic else 0.0,
            outcome_coef=a.outcome_coef,
        )
        train_mask = r.actions * (r.policy_kept & r.scorable)[r.local].unsqueeze(1).to(r.actions.dtype)
        if critic:
            values, returns, value_stats = self._train_value(r, value_rewards, train_mask)
        else:
            values, returns, value_stats = self._implicit_prm_value(r), None, {}
            returns = F.gae_advantages(value_rewards, values, r.actions, gamma=a.prime_gamma, lam=a.lam)[1]
        self.guards.inspect(r.mode, local_rows={"values": values}, masks={"values": train_mask})
        self._log_value_metrics(r.mode, values, returns, train_mask, value_stats)
        return values

    def _log_value_metrics(self, mode: str, values, returns, train_mask, stats: dict) -> None:
        """Record the round's value metrics (:meth:`record_metric`), in order: the critic's
        (:meth:`~trl_prime.prime.value.Critic.metrics`), or without one :func:`~trl_prime.prime.value.value_metrics`
        (``prime_value="implicit_prm"``). Collective."""
        if self.critic is not None:
            metrics = self.critic.metrics(values, returns, train_mask, stats)
        else:
            metrics = value_metrics(self.accelerator, values, returns, train_mask, stats)
        for name, val in metrics.items():
            self.record_metric(mode, name, val)

    def _train_value(self, r: PrimeRound, rewards: torch.Tensor, train_mask: torch.Tensor):
        """The critic's update of the round (:meth:`~trl_prime.prime.value.Critic.train`, given the trainer's
        ``guard_poisoned`` and :meth:`_defers_model_steps`), then the ``on_value_step`` callbacks when it stepped.
        Returns ``(values, returns, stats)``."""
        out = self.critic.train(r, rewards, train_mask, poisoned=self.guard_poisoned, defer=self._defers_model_steps())
        payload = self.critic.step_payload(out[2])
        if payload is not None:
            self._dispatch("on_value_step", **payload)
        return out

    def _implicit_prm_value(self, r: PrimeRound) -> torch.Tensor:
        """``prime_value="implicit_prm"``: the ``(B, T)`` value ``V(y_<t)``, the PRM's prefix sum (a logit), or with
        ``prime_value_scale="prob"`` ``outcome_coef * sigmoid`` of it, the PRM's probability of label 1 on the
        outcome's scale."""
        a = self.args
        values = F.implicit_prm_values(r.token_rewards, r.actions, scale=a.prime_value_scale)
        return a.outcome_coef * values if a.prime_value_scale == "prob" else values

    def _advantages(self, output: dict, r: PrimeRound) -> Advantages:
        """Algorithm 1 line 9, PRIME Eq. 5 (:func:`trl_prime.functional.prime_advantages`) over the global batch (token
        rewards padded and gathered; rows outside ``r.policy_kept`` get no outcome): ``(B_global, T_max)``; zeros
        when ``K == 1``; with this process's advantages and loss mask ``(B, T)``."""
        completion_mask, K = r.actions, r.num_generations
        rewards_g = gather_padded(self.accelerator, r.token_rewards)
        mask_g = gather_padded(self.accelerator, completion_mask)
        outcome = self._outcome_with_kl_penalty(output, r)
        inputs = dict(
            process_rewards=rewards_g,
            outcome_rewards=torch.where(r.policy_kept, outcome, torch.full_like(outcome, torch.nan)),
            mask=mask_g,
            group_ids=torch.arange(outcome.numel(), device=self.accelerator.device) // K,
            **self._advantage_options(),
        )
        if r.values is not None:  # PPO: GAE against the values (section 5.4)
            inputs["values"] = gather_padded(self.accelerator, r.values)
        advantages_g = F.prime_advantages(**inputs) if K >= 2 else torch.zeros_like(rewards_g)
        self._guard_advantages(r, advantages_g, inputs)
        rows = (r.policy_kept[r.local] & r.scorable[r.local]).unsqueeze(1)
        return Advantages(
            advantages_g=advantages_g,
            advantages=advantages_g[r.local, : completion_mask.size(1)],
            loss_mask=completion_mask * rows.to(completion_mask.dtype),
            rewards_g=rewards_g,
            mask_g=mask_g,
            inputs=inputs,
        )

    def _outcome_with_kl_penalty(self, output: dict, r: PrimeRound) -> torch.Tensor:
        """``(B_global,)`` outcome rewards for the advantages: with TRL's RLOO KL-in-reward (``beta > 0``), minus
        ``beta * sum_t (log pi_old - log pi_ref_TRL)`` as TRL's ``RLOOTrainer`` does; unchanged otherwise."""
        cap = r.capture
        if self.args.beta == 0.0 or not isinstance(self, RLOOTrainer) or cap.get("trl_ref_logps") is None:
            return r.outcome
        kl = ((cap["policy_logps"] - cap["trl_ref_logps"]) * output["completion_mask"]).sum(-1)
        return r.outcome - self.args.beta * gather(kl)

    def _advantage_options(self) -> dict:
        """The estimator options of :func:`trl_prime.functional.prime_advantages` from the config: those its
        :class:`~trl_prime.prime.estimators.AdvantageEstimator` reads
        (:func:`~trl_prime.prime.estimators.estimator_options`)."""
        return estimator_options(self.args)

    def _guard_advantages(self, r: PrimeRound, advantages_g: torch.Tensor, inputs: dict) -> None:
        """The guards of the advantage step (``inputs``: those of ``prime_advantages``): single-row groups,
        non-finite advantages, degenerate-batch metrics."""
        self.guards.single_row_groups(r.mode, rewards=inputs["outcome_rewards"], group_ids=inputs["group_ids"])
        self.guards.inspect(r.mode, global_rows={"advantages": advantages_g}, masks={"advantages": inputs["mask"]})
        self.guards.degenerate_metrics(
            r.mode,
            outcome=r.outcome,
            completion_mask_g=inputs["mask"],
            num_generations=r.num_generations,
            kept=r.filter.kept if r.mode == "train" else None,
            completion_lengths=r.filter.lengths,
            truncated=r.truncated,
        )

    def _hand_to_loss(self, output: dict, r: PrimeRound) -> None:
        """Algorithm 1 line 10: put the ``(B, T)`` advantages, the loss mask, the token rewards and the rollout
        log-probs (``pi_old`` of Eq. 6) into TRL's output, weight the loss rows, and log the advantages that reach
        the loss in TRL's completions table."""
        output["advantages"] = r.adv.advantages
        output["prime_loss_mask"] = r.adv.loss_mask
        output["prime_token_rewards"] = r.token_rewards
        if r.policy_logps is not None:
            output["old_per_token_logps"] = r.policy_logps
        self._apply_loss_mask(output, r)
        self.log_advantages(r.adv.advantages_g[:, 0])

    def _apply_loss_mask(self, output: dict, r: PrimeRound) -> None:
        """Trainer-specific: make TRL's loss use the loss mask (filtered and unscorable rows get weight 0)."""
        output["num_items_in_batch"] = gather(r.adv.loss_mask.sum()).sum()

    def _log_round(self, output: dict, r: PrimeRound) -> None:
        """The round's ``prm/*`` and ``filter/*`` metrics, then the ``on_rollouts_scored`` callbacks."""
        self._log_prm_metrics(r)
        self._dispatch_rollouts_scored(output, r)

    def _log_prm_metrics(self, r: PrimeRound) -> None:
        K = r.num_generations
        kept_idx = r.filter.kept.nonzero(as_tuple=True)[0]
        if kept_idx.numel() > 0:
            seq, labels = r.seq_rewards[kept_idx], r.filter.labels[kept_idx]  # the PRM's own targets (prm_label)
            pair_acc = F.prm_pair_accuracy(
                sequence_rewards=seq, outcome_rewards=labels, num_generations=K, ties="half"
            )
            abs_acc = F.prm_abs_accuracy(sequence_rewards=seq, outcome_rewards=labels)
        else:
            pair_acc = abs_acc = math.nan
        f = r.filter
        scored_g = f.kept if f.skip_filtered else torch.ones_like(f.kept)  # rows with computed token rewards
        tok = r.adv.rewards_g[r.adv.mask_g.bool() & scored_g.unsqueeze(1)]
        self.record_metric(r.mode, "prm/loss", r.prm_stats["loss"])
        self.record_metric(r.mode, "prm/pair_accuracy", pair_acc)
        self.record_metric(r.mode, "prm/abs_accuracy", abs_acc)
        self.record_metric(r.mode, "prm/token_reward_mean", tok.mean().item() if tok.numel() else math.nan)
        self.record_metric(r.mode, "prm/token_reward_std", tok.std().item() if tok.numel() > 1 else math.nan)
        self.record_metric(r.mode, "prm/token_reward_min", tok.min().item() if tok.numel() else math.nan)
        self.record_metric(r.mode, "prm/token_reward_max", tok.max().item() if tok.numel() else math.nan)
        self.record_metric(r.mode, "filter/kept_fraction", r.filter.kept_fraction)
        self.record_metric(r.mode, "filter/kept_groups", float(r.filter.kept_groups))
        if "grad_norm" in r.prm_stats:
            self.record_metric(r.mode, "prm/grad_norm", r.prm_stats["grad_norm"])
            self.record_metric(r.mode, "prm/learning_rate", r.prm_stats["learning_rate"])
            if self.args.prm_replay_rounds:
                self.record_metric(r.mode, "prm/replay_rows", float(r.prm_stats["replay_rows"]))

    def _dispatch_rollouts_scored(self, output: dict, r: PrimeRound) -> None:
        """``on_rollouts_scored`` with the round's tensors (rows without a PRM forward read NaN)."""
        token_rewards, prm_logps, ref_logps, seq_l = r.token_rewards, r.prm_logps, r.ref_logps, r.seq_rewards[r.local]
        unscored = r.filter.unscored
        if bool(unscored.any()):  # callbacks see NaN for rows that were not scored (prm_score_filtered_rows=False)
            nan_rows = lambda x: x.masked_fill(unscored.view(-1, *([1] * (x.dim() - 1))), torch.nan)  # noqa: E731
            token_rewards, prm_logps, ref_logps, seq_l = map(nan_rows, (token_rewards, prm_logps, ref_logps, seq_l))
        self._dispatch(
            "on_rollouts_scored",
            mode=r.mode,
            step=self.state.global_step + 1,
            prompt_ids=output["prompt_ids"],
            prompt_mask=output["prompt_mask"],
            completion_ids=output["completion_ids"],
            completion_mask=output["completion_mask"],
            token_rewards=token_rewards,
            sequence_rewards=seq_l,
            outcome_rewards=r.outcome[r.local],
            kept_mask=r.filter.kept[r.local],
            advantages=r.adv.advantages,
            loss_mask=r.adv.loss_mask,
            prm_logps=prm_logps,
            ref_logps=ref_logps,
            advantage_inputs=r.adv.inputs,
            global_advantages=r.adv.advantages_g,
            process_slice=r.local,
            prompts=r.capture.get("prompts"),
            completions=r.capture.get("completions"),
            tokenizer=self._tokenizer,
            is_main_process=self.accelerator.is_main_process,
        )

    # ----------------------------------------------------------------------------------------------------------
    # PRM update (Algorithm 1 line 8)
    # ----------------------------------------------------------------------------------------------------------
    def _train_prm(self, input_ids, attention_mask, completion_mask, labels, ref_logps, unscored=None, mm=None):
        """One PRM update on the kept rows (``labels`` NaN elsewhere). Returns ``(prm_logps (B,T), stats)``. ``mm``:
        a vision-language PRM's multimodal inputs of the rows (TRL's ``pixel_values`` ...), none for text.

        ``prm_logps`` are detached: from the update's own forward (``single``) or a forward after the step
        (``double``); rows flagged in ``unscored`` ``(B,)`` bool (filtered rows with ``prm_score_filtered_rows=False``)
        get no forward and log-probs 0. Each rank's loss is its share of the global mean (rows scaled by the global
        row count), so summing gradients over ranks gives the gradient of the global mean loss.
        """
        T, mm = completion_mask.size(1), mm or {}
        # a step still held from an earlier round of the same policy step (gradient_accumulation_steps >
        # steps_per_generation): taken now, before this round's gradients join them (dropped if this batch is poisoned)
        self._resolve_held_steps(apply=not self.guard_poisoned)
        valid = ~torch.isnan(labels)
        unscored = torch.zeros_like(valid) if unscored is None else unscored
        n_global = self.accelerator.reduce(valid.sum().to(torch.float32), reduction="sum").item()
        # every group filtered out, or non-finite rewards / log-probs in this batch (global decisions): no PRM step
        if n_global == 0 or self.guard_poisoned:
            return self._prm_scores(input_ids, attention_mask, T, unscored, mm), {"loss": float("nan")}
        current = dict(zip(ROW_FIELDS, (input_ids, attention_mask, completion_mask, labels, ref_logps)), mm=mm)
        batches = [current, *self._replay_batches(current)]  # prm_replay_rounds: earlier rounds' rows join the mean
        weights, norm, n_replayed = self._prm_ce_weights([b["labels"] for b in batches], n_global)

        def backward_pass(score_untrained_rows: bool = True):
            with self.implicit_prm.prm_context(trainable=True), torch.enable_grad():
                if self.args.prm_loss == "ce":
                    lp, loss_sum = self._prm_ce_backward(current, unscored, norm, weights[0], score_untrained_rows)
                    for batch, w in zip(batches[1:], weights[1:]):
                        loss_sum = loss_sum + self._prm_ce_backward(batch, None, norm, w, rest=False)[1]
                    info = {"group_ids": None, "global_labels": None}
                else:
                    lp, loss_sum, info = self._prm_global_loss_backward(
                        input_ids, attention_mask, completion_mask, labels, ref_logps, mm
                    )
            return lp, self.accelerator.reduce(loss_sum, reduction="sum").item(), info

        prm_logps, loss_value, pair_info = backward_pass()
        prm_logps, stats = self._step_prm(
            prm_logps,
            ref_logps,
            completion_mask,
            loss_value,
            unscored,
            lambda: self._prm_scores(input_ids, attention_mask, T, unscored, mm),
            more_updates=lambda: self._more_prm_updates(backward_pass),
        )
        if "grad_norm" in stats:  # the PRM's optimizer stepped
            stats["replay_rows"] = n_replayed
            self._stage_replay(current, valid)
            row_weights = (valid.float() if weights[0] is None else weights[0]) / norm  # as the CE loss weighs them
            self._dispatch_prm_step(loss_value, stats, labels, row_weights, pair_info)
        return prm_logps, stats

    def _prm_ce_weights(self, labels: list[torch.Tensor], n_current: float) -> tuple[list, float, float]:
        """The cross-entropy's row weights of each batch of ``labels`` (the round's, holding ``n_current`` labelled
        rows over all processes, then the replayed ones), over their global label masses: ``(weights, normaliser,
        replayed labelled rows)``. Plain mean: weights ``None`` and the normaliser the global count of labelled rows;
        ``prm_class_balance``: the ``(B_i,)`` :func:`~trl_prime.functional.class_balanced_weights` and their global
        sum (2, or the count when a side is empty). Collective."""
        if len(labels) == 1 and not self.args.prm_class_balance:  # the round alone, the plain mean (the paper's)
            return [None], n_current, 0.0
        y = torch.cat(labels)
        valid = ~torch.isnan(y)
        y0 = torch.where(valid, y, torch.zeros_like(y)).to(torch.float32)
        local = torch.stack([valid.sum().to(torch.float32), y0.sum(), torch.where(valid, 1.0 - y0, 0.0).sum()])
        n_all, pos, neg = self.accelerator.reduce(local, reduction="sum").tolist()
        if not self.args.prm_class_balance:
            return [None] * len(labels), n_all, n_all - n_current
        w = F.class_balanced_weights(y, pos_mass=pos, neg_mass=neg).to(y.device)
        total = self.accelerator.reduce(w.sum().to(torch.float32), reduction="sum").item()
        return list(w.split([len(lab) for lab in labels])), total, n_all - n_current

    def _replay_batches(self, current: dict) -> list[dict]:
        """The earlier rounds the PRM update replays (``prm_replay_rounds``; :class:`~trl_prime.prime.replay.PrmReplay`),
        on the PRM's device. Under DeepSpeed every process runs the same number of backward passes per update (its
        engine's accumulation count): each replayed round is laid out as ``B`` rows (a round stored with fewer, e.g.
        by a run without DeepSpeed, is padded with unlabelled copies, weight 0), and a window not yet full is padded
        with unlabelled copies of this round."""
        device = current["labels"].device
        replay = [to_device(b, device) for b in self.prm_replay.batches()]
        if self.prm_optim.engine is None or not self.prm_replay.rounds:
            return replay
        B = current["labels"].numel()
        replay = [_unlabelled_rows_to(b, B) for b in replay]
        blank = {**current, "labels": torch.full_like(current["labels"], float("nan"))}
        return replay + [blank] * (self.prm_replay.rounds - len(replay))

    def _stage_replay(self, current: dict, valid: torch.Tensor) -> None:
        """After a PRM step: hold this round's labelled rows (every row under DeepSpeed, for equal backward counts)
        for the replay; they join it once the step is taken (now, or with the policy's held step). A DeepSpeed step
        its fp16 loss scaler skipped was not taken: its round stays out."""
        engine = self.prm_optim.engine
        if not self.prm_replay.rounds or (engine is not None and not engine.was_step_applied()):
            return
        rows = valid.nonzero()[:, 0] if engine is None else torch.arange(valid.numel(), device=valid.device)
        self.prm_replay.stage(select_rows(current, rows, select_mm_rows))
        if not self.prm_optim.pending:
            self.prm_replay.commit()

    def _more_prm_updates(self, backward_pass) -> None:
        """PRM updates 2..``prm_epochs`` of a round on its kept rows (after its first update was applied): each a
        backward over the same rows and a guarded, immediate optimizer step; a non-finite loss or gradient norm ends
        them (that step skipped; ``prm/extra_updates_skipped``)."""
        for _ in range(self.args.prm_epochs - 1):
            _, loss_value, _ = backward_pass(score_untrained_rows=False)  # the log-probs of the first pass stand
            if self.prm_optim.step(loss_finite=math.isfinite(loss_value)) is None:
                self.record_metric("train", "prm/extra_updates_skipped", 1.0)
                return

    def _defers_model_steps(self) -> bool:
        """Whether the PRM's (and the critic's) optimizer step waits for the policy's (:meth:`_after_policy_step`):
        with the single PRM forward (its rewards come from before its step) and the policy's guarded optimizer (not
        DeepSpeed, whose engines step inside ``backward``). Then a policy step skipped for a reason found after the
        PRM's backward (non-finite advantages or values, a policy gradient overflow) leaves the PRM and its optimizer
        bit-identical. ``prm_update="double"`` scores the batch with the PRM after its step, which cannot wait."""
        return self.args.prm_update == "single" and self.prm_optim.engine is None and self.guards.wrapped

    def _resolve_held_steps(self, apply: bool) -> None:
        """Take (``apply``) or drop the PRM's and the critic's held optimizer steps, and with them the PRM's later
        updates of that round (``prm_epochs > 1``), which run once its first step is taken."""
        more, self._held_prm_updates = getattr(self, "_held_prm_updates", None), None
        for optim in (self.prm_optim, self.value_optim):
            if optim is not None and optim.pending:
                if apply:
                    optim.apply_pending()
                else:
                    optim.discard_pending()
                    self.record_metric("train", "guard/held_steps_dropped", 1.0)
        if apply and more is not None:
            more()
        if apply:  # the round's PRM rows follow its PRM step into the replay (prm_replay_rounds)
            self.prm_replay.commit()
        else:
            self.prm_replay.drop()

    def _after_policy_step(self, applied: bool, reason: str | None = None) -> None:
        # the policy's guarded step decided: the PRM (and critic) steps held for it follow it, except that an empty
        # policy step (no weighted token in its micro-batches) keeps them: the round's PRM update trained on its kept
        # rows, which other micro-batches of the same generation batch train the policy on
        self._resolve_held_steps(apply=applied or reason == "empty")

    def _prm_scores(self, input_ids, attention_mask, T: int, unscored: torch.Tensor, mm: dict) -> torch.Tensor:
        """``(B, T)`` no-grad PRM log-probs of the rows not flagged in ``unscored`` (0 there), in the policy's mixed
        precision (``accelerator.autocast()``: bf16 / fp16 autocast when the run uses it, as TRL runs its policy and
        reference)."""
        with self.accelerator.autocast():
            return _logps_of_rows(self.implicit_prm.prm_logps, input_ids, attention_mask, T, skip=unscored, mm=mm)

    def _dispatch_prm_step(self, loss_value: float, stats: dict, labels, row_weights, pair_info: dict) -> None:
        """``on_prm_step`` callbacks after a PRM optimizer step (:class:`~trl_prime.callbacks.PrimeCallback`)."""
        self._dispatch(
            "on_prm_step",
            loss=loss_value,
            grad_norm=stats["grad_norm"],
            learning_rate=stats["learning_rate"],
            num_updates=self.prm_optim.num_updates + int(self.prm_optim.pending),
            labels=labels,
            row_weights=row_weights,
            prm_model=self.prm_model,
            prm_update=self.args.prm_update,
            loss_group_ids=pair_info["group_ids"],
            loss_labels=pair_info["global_labels"],
        )

    def _prm_ce_backward(self, batch: dict, unscored, norm: float, weights, rest: bool):
        """The cross-entropy PRM loss on one ``batch`` of rows (:data:`~trl_prime.prime.replay.ROW_FIELDS` and
        ``mm``: the round's, or a replayed one) by micro-batches of the rows that train, one backward each, each
        loss scaled by its rows' share of the global normaliser ``norm``: their count, or with ``weights`` (B,)
        (class-balanced) their weight. Returns ``((B, T) float32 detached log-probs of every scored row, the local
        loss sum)``; with ``rest=False`` (replayed rows, the later updates of ``prm_epochs``) the rows that train
        nothing get no forward (log-probs 0). ``unscored``: ``(B,)`` bool rows to leave unscored, or ``None``."""
        prm, mb = self.implicit_prm, self.implicit_prm.micro_batch_size
        input_ids, attention_mask, completion_mask, labels, ref_logps = (batch[k] for k in ROW_FIELDS)
        mm, (B, T) = batch["mm"], completion_mask.shape
        valid = ~torch.isnan(labels)
        unscored = torch.zeros_like(valid) if unscored is None else unscored
        # Rows that train nothing (filtered groups, unscorable or empty completions) only need their log-probs
        # (token rewards, metrics): one no-grad forward, no activations kept, no backward. Same weights, so the same
        # values. Under DeepSpeed every rank must run the same number of backward passes: all rows.
        if self.prm_optim.engine is None:
            grad_rows = valid.nonzero(as_tuple=True)[0]
            free_rows = (~valid & ~unscored).nonzero(as_tuple=True)[0]
        else:
            grad_rows = torch.arange(B, device=valid.device)
            free_rows = grad_rows[:0]
        all_logps = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device)
        loss_sum = torch.zeros((), device=labels.device)
        for s in range(0, grad_rows.numel(), mb):
            rows = grad_rows[s : s + mb]
            with self.accelerator.autocast():  # the forward only; the loss and the backward run outside it
                lp = completion_logps(
                    prm.model, input_ids[rows], attention_mask[rows], T, mm_inputs=select_mm_rows(mm, rows)
                )
            share = (valid[rows].sum() if weights is None else weights[rows].sum()).item() / norm
            loss = (
                F.implicit_prm_loss(
                    prm_logps=lp,
                    ref_logps=ref_logps[rows],
                    mask=completion_mask[rows],
                    labels=labels[rows],
                    beta=self.args.prm_beta,
                    loss_type="ce",
                    row_weights=None if weights is None else weights[rows],
                )
                * share
            )
            self.prm_optim.backward(loss)
            loss_sum = loss_sum + loss.detach()
            all_logps[rows] = lp.detach().float()
        if free_rows.numel() and rest:
            with torch.no_grad(), self.accelerator.autocast():
                ids, am, free_mm = input_ids[free_rows], attention_mask[free_rows], select_mm_rows(mm, free_rows)
                all_logps[free_rows] = completion_logps(prm.model, ids, am, T, micro_batch_size=mb, mm_inputs=free_mm)
        return all_logps, loss_sum

    def _prm_global_loss_backward(self, input_ids, attention_mask, completion_mask, labels, ref_logps, mm):
        """The pairwise / KTO PRM loss (:meth:`_global_batch_prm_loss`) in one forward and backward. Returns
        ``(detached (B, T) log-probs, the local share of the loss, pair info)``."""
        T = completion_mask.size(1)
        prm = self.implicit_prm
        with self.accelerator.autocast():
            lp = completion_logps(
                prm.model, input_ids, attention_mask, T, micro_batch_size=prm.micro_batch_size, mm_inputs=mm
            )
        loss, pair_info = self._global_batch_prm_loss(lp, ref_logps, completion_mask, labels)
        self.prm_optim.backward(loss)
        # the loss is the global one on every rank: the reduce-sum of the shares must count it once
        return lp.detach(), loss.detach() / self.accelerator.num_processes, pair_info

    def _step_prm(self, prm_logps, ref_logps, completion_mask, loss_value, unscored, rescore, more_updates=None):
        """The PRM's optimizer step after the backward passes, guarded: before it, rows whose PRM log-probs or token
        rewards (the update's own forward) are non-finite or beyond ``prm_max_abs_token_reward`` poison the batch and
        drop the step, named in the log (collective); a non-finite loss or gradient norm skips it (weights unchanged)
        and poisons the batch. ``rescore()`` gives the log-probs after the step (``prm_update="double"``);
        ``more_updates()`` takes the round's further updates (``prm_epochs > 1``): now, or with a held step when it
        is taken (:meth:`_resolve_held_steps`)."""
        a = self.args
        checked = {"loss": loss_value, "token_rewards_checked": True}
        bad = self._inspect_token_rewards(prm_logps, ref_logps, completion_mask, unscored)
        if bool(bad.any()):
            self.prm_optim.discard(loss_finite=math.isfinite(loss_value))
            return prm_logps, checked
        lr = self.prm_optim.learning_rate  # the rate this step uses (before its scheduler advances)
        grad_norm = self.prm_optim.step(loss_finite=math.isfinite(loss_value), defer=self._defers_model_steps())
        if grad_norm is None:  # non-finite PRM loss or gradient norm: step skipped (weights unchanged), batch poisoned
            # every row's log-probs and token rewards passed the check above: no row to blame
            self.guards.poison_batch("train", "non-finite PRM loss/gradient norm")
            return prm_logps, checked
        if self.prm_optim.engine is not None:  # the engine stepped (and scheduled) inside backward
            lr = self.prm_optim.learning_rate
        if a.prm_epochs > 1 and more_updates is not None:
            if self.prm_optim.pending:  # held for the policy's step: the later updates follow it, or drop with it
                self._held_prm_updates = more_updates
            else:
                more_updates()
        if a.prm_update == "double":
            prm_logps = rescore()
        return prm_logps, {
            "loss": loss_value,
            "grad_norm": grad_norm,
            "learning_rate": lr,
            "token_rewards_checked": a.prm_update == "single",
        }

    def _bad_token_reward_rows(self, token_rewards: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool: local rows with a non-finite token reward or one beyond ``prm_max_abs_token_reward``."""
        bound = self.args.prm_max_abs_token_reward
        t, m = token_rewards.float(), completion_mask.bool()
        bad = ~torch.isfinite(t) | ((t.abs() > bound) if bound is not None else torch.zeros_like(m))
        return (bad & m).any(-1)

    def _inspect_token_rewards(self, prm_logps, ref_logps, completion_mask, unscored=None, *, mode="train"):
        """Guard the PRM's ``(B, T)`` log-probs and token rewards (PRIME Eq. 3): rows with a non-finite value or a
        token reward beyond ``prm_max_abs_token_reward`` poison the generation batch (training) and are logged with
        their sample ids. Collective. Returns the ``(B_global,)`` bool mask of offending rows."""
        token_rewards = F.implicit_token_rewards(
            prm_logps=prm_logps, ref_logps=ref_logps, mask=completion_mask, beta=self.args.prm_beta
        )
        mask = completion_mask
        if unscored is not None:  # rows without a PRM forward (log-probs 0) are not judged
            mask = completion_mask * (~unscored).unsqueeze(1).to(completion_mask.dtype)
        return self.guards.inspect(
            mode,
            local_rows={"prm_logps": prm_logps, "token_rewards": token_rewards},
            masks={"prm_logps": mask, "token_rewards": mask},
            bounds={"token_rewards": self.args.prm_max_abs_token_reward},
        )

    def _global_batch_prm_loss(self, prm_logps, ref_logps, completion_mask, labels):
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
            prm_logps=seq_g,
            ref_logps=torch.zeros_like(seq_g),
            mask=torch.ones_like(seq_g, dtype=torch.bool),
            labels=labels_g,
            beta=self.args.prm_beta,
            loss_type=self.args.prm_loss,
            group_ids=group_ids,
        )
        return loss.to(prm_logps.dtype), {"group_ids": group_ids, "global_labels": labels_g}


class PrimeRLOOTrainer(PrimeMixin, RLOOAdapter):
    """PRIME on TRL's ``RLOOTrainer``: implicit-PRM process rewards, Eq. 5 advantages, token-level PPO-clip loss.

    Args: as ``trl.RLOOTrainer`` (``model``, ``reward_funcs``, ``args`` a :class:`~trl_prime.PrimeRLOOConfig`,
    datasets, ``processing_class``, ``callbacks``, ``peft_config``, ...), plus, by keyword:

    - ``prm_model``: the PRM's initial model (a path or a causal LM instance); overrides ``args.prm_model``.
    - ``prm_ref_model``: the PRM reference (a path or a causal LM); overrides ``args.prm_ref_model``.
    - ``value_model``: the value model's initial causal LM (a path or a module; ``prime_estimator="ppo"``); overrides
      ``args.value_model``.

    TRL 1.16's RLOO loss is sequence-level; this trainer replaces it with PRIME's token-level PPO-clip objective
    (Eq. 6, :func:`trl_prime.functional.token_ppo_clip_loss`): ``-min(rho_t A_t, clip(rho_t, 1-eps, 1+eps_high) A_t)``
    with ``rho_t = pi_theta(y_t)/pi_old(y_t)`` (the rollout log-probs are stored per token), averaged over the kept
    tokens of the global batch (as TRL's ``"dapo"`` aggregation). Filtered and unscorable rows get weight 0.

    Example::

        from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer
        from trl_prime.rewards import math_reward

        trainer = PrimeRLOOTrainer(model="Qwen/Qwen2.5-Math-7B", reward_funcs=math_reward,
                                   args=PrimeRLOOConfig("out"), train_dataset=dataset)
        trainer.train()
    """

    _config_class = PrimeRLOOConfig
    _tag_names = ["trl", "rloo", "prime", "trl-prime"]
    _name = "PRIME-RLOO"


class PrimeGRPOTrainer(PrimeMixin, GRPOAdapter):
    """PRIME on TRL's ``GRPOTrainer``: the same PRIME machinery (:class:`PrimeMixin`) with the GRPO estimator.

    Args: as ``trl.GRPOTrainer`` (``args`` a :class:`~trl_prime.PrimeGRPOConfig`), plus, by keyword, ``prm_model``,
    ``prm_ref_model`` and ``value_model`` as in :class:`PrimeRLOOTrainer`.

    TRL's GRPO loss already takes ``(B, T)`` advantages with a token-level ratio; PRIME's loss mask (filtered and
    unscorable rows) reaches it as ``tool_mask`` (a loss-only mask, it does not change attention), and
    ``num_items_in_batch`` counts the kept tokens.
    """

    _config_class = PrimeGRPOConfig
    _tag_names = ["trl", "grpo", "prime", "trl-prime"]
    _name = "PRIME-GRPO"

    def _apply_loss_mask(self, output: dict, r: PrimeRound) -> None:
        mask_loss_rows(self.accelerator, output, r.policy_kept[r.local] & r.scorable[r.local])
