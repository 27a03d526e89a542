"""Reliability guards shared by the PRIME, PRL and PROF trainers (start-up checks, non-finite steps, verifier
failures, degenerate batches).

- :class:`GuardOptions`: the config fields ``max_nonfinite_skips`` and ``max_verifier_failure_rate``, mixed into
  :class:`~trl_prime.PrimeRLOOConfig`, :class:`~trl_prime.PrimeGRPOConfig`, :class:`~trl_prime.PRLConfig` and
  :class:`~trl_prime.ProfGRPOConfig`; the config checks those configs share (:func:`check_scheduler_warmup`,
  :func:`check_grpo_outcome_options`: TRL's ``scale_rewards``, ``multi_objective_aggregation`` and ``loss_type``) and
  their constant learning-rate schedule (:func:`constant_lr_schedule`).
- Start-up checks (:func:`check_peft_config`, :func:`check_causal_lm_source`, :func:`check_train_dataset`): a
  missing prompt or gold-answer column, empty prompts, a prompt-learning ``peft_config`` (prefix / prompt tuning:
  no adapter weights in the layers; a tuner-layer config without ``task_type`` trains, as in TRL), a PRM that is
  not a causal LM fail before training with a message naming the field and the fix.
- :func:`keep_4bit_layers_differentiable`: a 4-bit (bitsandbytes NF4/FP4) base keeps the layout that backpropagates
  on a CPU with AVX512-BF16 (below), so LoRA adapters on it train.
- :class:`Guards` (a plain object each trainer's adapter, :mod:`trl_prime.adapters`, owns as ``trainer.guards``):

  * **non-finite values** never reach an optimizer step. Each trainer hands the tensors of a generation batch (outcome
    rewards, log-probs, token rewards, advantages) to :meth:`Guards.inspect`; a row holding ``inf`` /
    ``NaN`` (a ``NaN`` outcome is *unscorable*, excluded by design, not an error) poisons the generation batch: its
    policy optimizer steps (and the PRIME PRM step) are skipped, the offending rows are logged (global row index and
    sample id), and ``guard/skipped_steps`` counts them (in evaluation, where PRIME, PRL and PROF run the same checks,
    the offending rows are only logged: there is no optimizer step). The policy optimizer is wrapped so that a step
    whose gradients are non-finite is skipped too (gradients zeroed, scheduler not advanced: accelerate's
    ``step_was_skipped``; under fp16 AMP the GradScaler does this for overflows itself, uncounted). The gradient norm
    is the one the Trainer's clipping returns (computed before clipping): a norm that overflows to ``inf`` makes
    ``clip_grad_norm_`` scale every gradient to 0 (finite zeros, which would otherwise step the optimizer and move
    Adam's moments), so an infinite norm skips the step too ("gradient overflow (no single row)"). PRIME checks its PRM
    the same way (norm from clipping, and rows whose token rewards are non-finite or beyond
    ``prm_max_abs_token_reward``) before the PRM's optimizer step. A poisoned generation batch keeps the optimizer step
    it feeds skipped even when more generation batches feed the same step (``gradient_accumulation_steps >
    steps_per_generation``). After ``max_nonfinite_skips`` consecutive skipped steps the run stops with a
    ``RuntimeError``. (Under DeepSpeed the policy step happens inside ``backward``: it is not guarded; only a poisoned
    batch's PRM step is skipped.)
  * **a step with nothing to learn moves nothing.** The loss weight of every micro-batch the policy's loss receives
    is counted (:meth:`Guards.count_micro_batch`, from TRL's ``_prepare_inputs``); an optimizer step whose
    micro-batches hold no weighted token on any process (every group filtered, every row unscorable or dropped by
    PROF) does not step: gradients zeroed, AdamW's moments and step count and the scheduler unchanged (a zero gradient
    would still move the weights through Adam's momentum), counted in ``guard/empty_steps`` (not a non-finite skip: it never stops the run). The PRM and
    the value model already skip a round without trained rows.
  * **verifier infrastructure failures** (``math/error``: the math worker pool died; ``code/sandbox_error``: the
    sandbox could not run), reported by the verifiers through TRL's ``log_metric``, are counted over the global
    batch; their fraction is logged as ``verifier/failure_rate`` and above ``max_verifier_failure_rate`` the step
    raises instead of training on bad rewards.
  * **degenerate batches** (every group filtered out, every completion truncated, every reward equal, no group with
    reward spread among its scorable kept rows, completions of length 0 or 1) log a warning and the metrics
    ``guard/all_filtered``, ``guard/all_truncated``, ``guard/all_rewards_equal``, ``guard/all_groups_zero_spread``
    (:func:`group_reward_spread`), ``guard/short_completion_fraction``; the trainers keep them finite (no NaN).
  * **groups left with one scorable row** (the others unscorable or dropped by PROF) have no group baseline: with a
    group-baseline estimator their row gets advantage 0 (PRIME's ``"ppo"`` subtracts a value instead and trains on
    it); ``guard/single_row_groups`` counts them per step (:meth:`Guards.single_row_groups`).

Checkpointing (atomic checkpoints, the buffered generation batch for exact resume) is
:mod:`trl_prime.checkpointing`.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trl_prime.functional import (
    GROUP_SCALE_REWARDS,
    SCALE_REWARDS,
    SEQUENCE_LEVEL_LOSS_TYPES,
    check_choice,
    single_row_group_mask,
)
from trl_prime.modeling import prompt_learning_error
from trl_prime.rewards.registry import failure_metrics


logger = logging.getLogger(__name__)


def __getattr__(name):
    # ``INFRASTRUCTURE_FAILURE_METRICS``: the ``log_metric`` names of verifier *infrastructure* failures (reward None,
    # never a 0), one per verifier of trl_prime.rewards.registry (math: ``math/error``, code: ``code/sandbox_error``)
    if name == "INFRASTRUCTURE_FAILURE_METRICS":
        return failure_metrics()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class GuardOptions:
    """Reliability options shared by every trl-prime trainer config."""

    max_nonfinite_skips: int = field(
        default=3,
        metadata={
            "help": "A generation batch holding NaN/inf log-probs, rewards, advantages or PRM loss (or a non-finite "
            "policy gradient) skips its optimizer steps (policy and PRM weights unchanged, offending sample ids "
            "logged). After this many consecutive skipped steps the run stops with an error. >= 1."
        },
    )
    max_verifier_failure_rate: float = field(
        default=0.25,
        metadata={
            "help": "Largest tolerated fraction of a batch's completions whose verifier failed for infrastructure "
            "reasons (math/error: math worker pool died; code/sandbox_error: sandbox could not run). Those rows get "
            "reward None (excluded); above this fraction the step raises instead of training on bad rewards. In "
            "[0, 1]; 1 never raises."
        },
    )

    def _validate_guards(self) -> None:
        v = self.max_nonfinite_skips
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"`max_nonfinite_skips`={v!r} must be an int >= 1 (default 3).")
        r = self.max_verifier_failure_rate
        if not (isinstance(r, (int, float)) and 0.0 <= r <= 1.0):
            raise ValueError(f"`max_verifier_failure_rate`={r!r} must lie in [0, 1] (default 0.25; 1 never raises).")
        b = getattr(self, "prm_max_abs_token_reward", None)  # PRIME's token-reward bound (PrimeOptions)
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0):
            raise ValueError(f"`prm_max_abs_token_reward`={b!r} must be a number > 0 or None (default 100.0).")
        check_scheduler_warmup(self)


#: the learning-rate schedule of every trl-prime config (policy and PRM): one constant rate, as the papers give it
#: (PRIME section 4.1: AdamW, policy 5e-7 and PRM 1e-6, no schedule; PRL Table 6: 1e-6, released config without
#: warmup; PROF Appendix A.1: no schedule). The Implicit PRM paper states none: ImplicitPRMConfig follows PRIME's PRM
DEFAULT_LR_SCHEDULER = "constant"


def constant_lr_schedule(source: str):
    """The ``lr_scheduler_type`` field of a trl-prime trainer config: :data:`DEFAULT_LR_SCHEDULER` (one constant
    policy learning rate, as the papers give it), ``source`` saying where (e.g. ``"PRIME: 'constant', section 4.1"``).
    TRL's default ``"linear"`` would decay the rate to 0 over ``max_steps``."""
    return field(
        default=DEFAULT_LR_SCHEDULER,
        metadata={
            "help": f"Policy learning-rate schedule ({source}; TRL's default 'linear' decays to 0). With "
            "warmup_steps > 0 use 'constant_with_warmup'."
        },
    )


def check_scheduler_warmup(args) -> None:
    """Refuse a warmup that a ``"constant"`` schedule would silently ignore (``transformers.get_scheduler("constant")``
    takes no warmup): ``warmup_steps`` with ``lr_scheduler_type``, and ``prm_warmup_steps`` with ``prm_lr_scheduler``
    (PRIME configs). Fields a config lacks are skipped.

    Raises:
        ValueError: a warmup > 0 with a ``"constant"`` schedule; the message names both fields and the fix.
    """
    pairs = (("lr_scheduler_type", "warmup_steps"), ("prm_lr_scheduler", "prm_warmup_steps"))
    for schedule_field, warmup_field in pairs:
        schedule, warmup = getattr(args, schedule_field, None), getattr(args, warmup_field, None)
        if schedule is None or warmup is None:
            continue
        schedule = getattr(schedule, "value", schedule)  # transformers' SchedulerType after __post_init__
        if schedule == "constant" and isinstance(warmup, (int, float)) and warmup > 0:
            raise ValueError(
                f"`{warmup_field}`={warmup} is ignored by `{schedule_field}`='constant' (the trl-prime default: the "
                f"papers' constant rate). Set {schedule_field}='constant_with_warmup' to warm up then stay constant, "
                f"or {warmup_field}=0."
            )


def check_sum_then_normalize(args, why: str) -> None:
    """TRL's ``multi_objective_aggregation`` must be ``"sum_then_normalize"`` for the trl-prime GRPO configs: their
    outcome is the weighted sum of the reward functions (:func:`trl_prime.rollout.outcome_rewards`), so TRL's
    ``"normalize_then_sum"`` would be ignored. ``why`` says what the method does with that sum. Configs without the
    field (RLOO) pass.

    Raises:
        ValueError: any other value; the message names the field and the fix.
    """
    value = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    if value != "sum_then_normalize":
        raise ValueError(f"`multi_objective_aggregation`={value!r}: {why}; use 'sum_then_normalize'.")


def check_grpo_outcome_options(
    args, *, grouped: str | None, summed: str, token_level: str | None = None, no_group_std: str | None = None
) -> None:
    """The TRL ``GRPOConfig`` options a trl-prime GRPO config constrains: its outcome advantage is centred within
    each prompt's group (GRPO, DeepSeekMath arXiv 2402.03300 Sec. 4.1; PRIME Appendix B.3, PRL Sec. 3.3, PROF Sec. 3)
    over the weighted sum of the reward functions, and PRIME and PRL feed token-level ``(B, T)`` advantages.

    Args:
        args: the config, after TRL's ``__post_init__``.
        grouped: why ``scale_rewards`` must be one of :data:`~trl_prime.functional.GROUP_SCALE_REWARDS`; ``None``
            accepts every TRL value (:data:`~trl_prime.functional.SCALE_REWARDS`, ``"batch"`` included: PRIME-GRPO
            and PRL divide the group-centred outcome by the batch std, as TRL does).
        summed: why ``multi_objective_aggregation`` must be ``"sum_then_normalize"``
            (:func:`check_sum_then_normalize`).
        token_level: why a sequence-level ``loss_type`` (:data:`~trl_prime.functional.SEQUENCE_LEVEL_LOSS_TYPES`) is
            refused; ``None`` skips that check.
        no_group_std: with ``grouped=None``, why the chosen advantage has no group std for ``scale_rewards="batch"``
            to replace (PRIME's ``"rloo"`` / ``"reinforce"`` estimators, PRL's ``"process_first"`` order), so
            ``"batch"`` would be ignored and is refused; ``"group"`` (TRL's default) and ``"none"`` ask for no batch
            statistic and pass. ``None`` skips that check.

    Raises:
        ValueError: an invalid option; the message names the field and the fix.
    """
    if grouped is None:
        check_choice(args.scale_rewards, SCALE_REWARDS, "scale_rewards")
        if no_group_std is not None and args.scale_rewards == "batch":
            raise ValueError(
                f"`scale_rewards`='batch' would be ignored: {no_group_std}, so there is no group std for the batch "
                "std to replace. Keep `scale_rewards`='group' (TRL's default) or 'none', or choose the GRPO outcome "
                "advantage that 'batch' scales (PrimeGRPOConfig `prime_estimator`='grpo', PRLConfig "
                "`prl_order`='advantage_first')."
            )
    elif args.scale_rewards not in GROUP_SCALE_REWARDS:
        raise ValueError(
            f"`scale_rewards`={args.scale_rewards!r}: {grouped}; use 'group' (divide by the group std) or 'none' "
            "(subtract the group mean only)."
        )
    check_sum_then_normalize(args, summed)
    if token_level is not None and args.loss_type in SEQUENCE_LEVEL_LOSS_TYPES:
        raise ValueError(
            f"`loss_type`={args.loss_type!r} is sequence-level ({SEQUENCE_LOSS_REASONS[args.loss_type]}); "
            f"{token_level}. Use 'dapo' (default: the token mean over the kept tokens of the batch), 'grpo', 'bnpo', "
            "'dr_grpo', 'cispo' or 'sapo'."
        )


#: why each TRL sequence-level loss (:data:`~trl_prime.functional.SEQUENCE_LEVEL_LOSS_TYPES`) does not fit token-level
#: ``(B, T)`` advantages (TRL 1.16 ``GRPOTrainer._compute_loss``); also in docs/guides/trl_options.md
SEQUENCE_LOSS_REASONS = {
    "luspo": "LUSPO sums each completion's token losses, a length-unbiased objective built for one advantage per "
    "completion repeated on its tokens: on PRIME / PRL's per-token reward-to-go (each token already carries the "
    "reward still to come) the per-completion sum weights a completion by its length once more; in PRIME its mean "
    "over all rows also lets the rows the prompt filter drops scale each update",
    "vespo": "VESPO weights each completion by a Gamma function of its sequence-level importance ratio whose shape "
    "(vespo_k_pos/vespo_lambda_pos or vespo_k_neg/vespo_lambda_neg) is chosen by the sign of the completion's one "
    "advantage; PRIME / PRL advantages change sign from token to token inside a completion, so the sign, and the "
    "weight, would be chosen per token",
}


# ----------------------------------------------------------------------------------------------------------------
# Start-up checks
# ----------------------------------------------------------------------------------------------------------------
def check_peft_config(peft_config, model=None) -> None:
    """A PEFT config (or a ready ``PeftModel``'s adapters) must be a tuner-layer method (LoRA, IA3, LoHa, ...).

    ``task_type`` is not required, as in TRL: a task-less config (``LoraConfig()``, as TRL's own PEFT tests write it)
    builds a plain ``PeftModel``, which forwards ``generate`` and the causal LM's forward to the wrapped model, so
    the policy, the PRM's second adapter ``"prm"`` and the frozen reference (adapters disabled) train as with
    ``task_type="CAUSAL_LM"``. Refused is what truly fails: a prompt-learning method (prefix / prompt tuning,
    P-tuning), which puts no adapter weights in the layers the trainers copy, freeze and train.

    Raises:
        ValueError: a prompt-learning config; the message names the field, the reason and the supported methods
            (:func:`trl_prime.modeling.prompt_learning_error`).
    """
    configs = []
    if peft_config is not None:
        configs.append(("peft_config", peft_config))
    if model is not None and isinstance(model, nn.Module) and hasattr(model, "peft_config"):
        pc = model.peft_config
        if isinstance(pc, dict):
            configs += [(f"model.peft_config[{k!r}]", c) for k, c in pc.items()]
    for name, cfg in configs:
        if getattr(cfg, "is_prompt_learning", False):
            raise prompt_learning_error(cfg, name)


def _is_causal_architecture(name: str) -> bool:
    return name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))


def check_causal_lm_source(
    source, field_name: str, *, trust_remote_code: bool = False, revision: str | None = None
) -> None:
    """``source`` (a path / Hub id or a module) must be a causal LM; raise a ValueError naming ``field_name``.

    ``trust_remote_code`` / ``revision``: as the model itself is loaded (``model_init_kwargs``), so a custom-code
    checkpoint the trainer can load passes the check."""
    if source is None:
        return
    if isinstance(source, str):
        from transformers import AutoConfig

        from trl_prime.models import is_missing_local_path

        if is_missing_local_path(source):
            raise ValueError(
                f"`{field_name}`={source!r}: no such folder (relative paths start at {os.getcwd()}). Give the folder "
                "or Hub id of a causal LM (AutoModelForCausalLM), e.g. the policy's SFT checkpoint."
            )

        try:
            cfg = AutoConfig.from_pretrained(
                source, trust_remote_code=bool(trust_remote_code), **({"revision": revision} if revision else {})
            )
        except Exception as e:  # noqa: BLE001 - transformers' message alone does not say which option failed
            raise ValueError(
                f"`{field_name}`={source!r} could not be loaded ({type(e).__name__}: {e}). Give the folder or Hub id of "
                "a causal LM (AutoModelForCausalLM), e.g. the policy's SFT checkpoint."
            ) from e
        archs = list(getattr(cfg, "architectures", None) or [])
        if archs and not any(_is_causal_architecture(a) for a in archs):
            raise ValueError(
                f"`{field_name}`={source!r} is a {archs[0]} checkpoint, not a causal LM: the implicit PRM needs "
                "log-probs of the completion tokens (a *ForCausalLM model). Give a causal LM checkpoint (e.g. the "
                "policy's SFT checkpoint); step-level PRMs such as Qwen2.5-Math-PRM belong in `prof_prm`."
            )
        return
    if isinstance(source, nn.Module):
        inner = getattr(source, "module", source)
        get_out = getattr(inner, "get_output_embeddings", None)
        if not callable(get_out) or get_out() is None:
            raise ValueError(
                f"`{field_name}` is a {type(inner).__name__}, not a causal LM (it has no LM head): the implicit PRM "
                "needs log-probs of the completion tokens. Pass an AutoModelForCausalLM model or checkpoint path."
            )


def _prompt_is_empty(prompt) -> bool:
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return True
        if all(isinstance(m, dict) for m in prompt):
            return all(not str(m.get("content") or "").strip() for m in prompt)
    return False


def required_columns(reward_funcs) -> dict[str, tuple[str, ...]]:
    """``{reward function name: dataset columns it needs}`` from the ``required_columns`` attribute of the verifiers
    (:func:`trl_prime.rewards.math_reward` needs ``solution``, :func:`~trl_prime.rewards.code_reward` ``tests``)."""
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    out = {}
    for f in funcs:
        cols = getattr(f, "required_columns", None)
        if cols:
            out[getattr(f, "__name__", type(f).__name__)] = tuple(cols)
    return out


def check_train_dataset(dataset, reward_funcs, *, max_scan: int = 1_000_000) -> None:
    """The training dataset has a ``prompt`` column with non-empty prompts and every column a verifier needs.

    Raises:
        ValueError: naming the column and the fix.
    """
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:  # an IterableDataset without known features, or a plain list: nothing to check cheaply
        return
    if isinstance(columns, dict):  # DatasetDict
        return
    if "prompt" not in columns:
        raise ValueError(
            f"The training dataset has no `prompt` column (columns: {sorted(columns)}). TRL's GRPO/RLOO trainers read "
            "the prompts from `prompt`: rename your column, e.g. dataset.rename_column('question', 'prompt')."
        )
    for name, cols in required_columns(reward_funcs).items():
        missing = [c for c in cols if c not in columns]
        if missing:
            raise ValueError(
                f"The reward function {name!r} reads the gold answers from column(s) {missing}, which the training "
                f"dataset lacks (columns: {sorted(columns)}). Rename your gold-answer column, e.g. "
                f"dataset.rename_column('answer', {missing[0]!r}), or build the verifier for your column "
                "(make_math_reward(answer_column=...) / make_code_reward(tests_column=...))."
            )
    if not hasattr(dataset, "__len__"):  # a streaming IterableDataset (known columns, unknown length): no scan
        return
    n = len(dataset)
    if n == 0:
        raise ValueError("The training dataset is empty: give at least one prompt.")
    if n <= max_scan:
        empty = [i for i, p in enumerate(dataset["prompt"]) if _prompt_is_empty(p)]
        if empty:
            raise ValueError(
                f"The training dataset has {len(empty)} empty prompt(s) in column `prompt` (rows {empty[:10]}"
                f"{' ...' if len(empty) > 10 else ''}). Remove them, e.g. "
                "dataset.filter(lambda x: bool(x['prompt'])), before training."
            )


# ----------------------------------------------------------------------------------------------------------------
# The runtime guards (a plain object; trl_prime/adapters.py calls it)
# ----------------------------------------------------------------------------------------------------------------
def group_reward_spread(outcome: torch.Tensor, num_generations: int, kept: torch.Tensor | None = None) -> torch.Tensor:
    """``(G,)`` bool: whether group ``g`` (rows ``g*K .. g*K+K-1`` of ``outcome``, ``(B_g,)`` float) has at least two
    scorable (finite) rows (kept ones, when ``kept`` ``(B_g,)`` bool is given) whose rewards differ. A group without
    spread gives every row outcome advantage 0 (RLOO / GRPO baselines equal the rewards), one with a single such row
    has no baseline at all."""
    K = max(int(num_generations), 1)
    ok = torch.isfinite(outcome)
    if kept is not None:
        ok = ok & kept.bool()
    vals, ok = outcome.view(-1, K), ok.view(-1, K)
    hi = torch.where(ok, vals, torch.full_like(vals, -torch.inf)).amax(-1)
    lo = torch.where(ok, vals, torch.full_like(vals, torch.inf)).amin(-1)
    return (ok.sum(-1) >= 2) & (hi > lo)


def _nonfinite_rows(
    x: torch.Tensor | None, mask: torch.Tensor | None = None, bound: float | None = None
) -> torch.Tensor | None:
    """``(B,)`` bool: rows of ``x`` (``(B,)`` or ``(B, T)``) holding inf or NaN, or (with ``bound``) a value with
    ``|x| > bound`` (on ``mask`` when given)."""
    if x is None:
        return None
    bad = ~torch.isfinite(x.float())
    if bound is not None:
        bad = bad | (x.float().abs() > bound)
    if x.dim() == 1:
        return bad
    if mask is not None:
        T = min(bad.size(1), mask.size(1))
        bad = bad[:, :T] & mask[:, :T].bool()
    return bad.any(-1)


def keep_4bit_layers_differentiable(model: nn.Module) -> int:
    """Keep every bitsandbytes ``Linear4bit`` of ``model`` in the layout that backpropagates; return how many.

    On a CPU with AVX512-BF16, bitsandbytes (seen with 0.50.2) repacks a ``Linear4bit`` weight, in place and for good, the
    first time the layer runs in eval mode on an input without grad (generation does exactly that): the packed layout
    stores ``absmax`` in bfloat16 (the base's quantisation state changes) and its ``gemv_4bit`` kernel has no
    autograd, so from then on no gradient flows through any 4-bit layer: a LoRA adapter whose output passes through
    one (``q_proj``/``v_proj`` through ``o_proj``) gets zero gradients, silently (``grad_norm`` 0). Turning the
    repacking off keeps the layers on bitsandbytes' differentiable ``MatMul4Bit`` path. GPUs are unaffected (the
    repacking is CPU only). A no-op without bitsandbytes or without 4-bit layers.
    """
    bnb = sys.modules.get("bitsandbytes")  # not imported: no model holds its layers
    if bnb is None:
        return 0
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return len(layers)


class Guards:
    """The reliability guards of one trl-prime training run (see the module docstring): a plain object the trainer's
    adapter (:mod:`trl_prime.adapters`) owns and calls at TRL's hooks.

    Args:
        args: the trainer's config (:class:`GuardOptions` fields ``max_nonfinite_skips``, ``max_verifier_failure_rate``).
        accelerator: the trainer's ``Accelerator`` (collectives, process index).
        record: ``record(mode, name, value)``, the trainer's one metric call (``mode``: ``"train"`` / ``"eval"``).
        global_step: returns the trainer's optimizer steps so far (for messages).
        max_completion_length: TRL's, for the truncation fallback of :meth:`degenerate_metrics`.

    State, saved with checkpoints (:mod:`trl_prime.checkpointing`): ``consecutive_skips``, ``total_skips``; the
    generation batch's ``poison`` (``None``, or the reason, rows and sample ids) and ``step_pending``.
    """

    def __init__(self, args, accelerator, record, global_step, max_completion_length: int | None = None):
        self.args, self.accelerator, self.record, self.global_step = args, accelerator, record, global_step
        self.max_completion_length = max_completion_length
        self.poison: dict | None = None
        self.consecutive_skips = 0
        self.total_skips = 0
        self.step_pending = False  # a poisoned generation batch awaits its (skipped) policy step
        self.step_tokens = 0.0  # weighted loss tokens of this optimizer step's micro-batches (this process)
        self.step_batches = 0  # and the micro-batches counted
        self.infra_failures = 0.0
        self.inputs = None
        self.clip_norm: float | None = None  # the Trainer's gradient norm of this step (``_get_grad_norm``)
        self.wrapped = False  # the policy's optimizer step is guarded (:meth:`wrap_optimizer`)

    @property
    def poisoned(self) -> bool:
        """Whether the current generation batch's optimizer steps will be skipped."""
        return self.poison is not None

    # --------------------------------------------------------------------------------------------------------
    # Generation batches and micro-batches
    # --------------------------------------------------------------------------------------------------------
    def new_generation_batch(self, inputs, training: bool) -> None:
        """A generation batch starts (TRL's ``_generate_and_score_completions``): it is judged afresh, unless a
        poisoned one still feeds the pending optimizer step (``gradient_accumulation_steps > steps_per_generation``:
        several generation batches per step)."""
        self.inputs = inputs
        if training and not self.step_pending:
            self.poison = None

    def count_micro_batch(self, inputs: dict) -> None:
        """Count the weighted tokens of a micro-batch TRL hands to its loss (:func:`loss_weight`) for the empty-step
        check."""
        self.step_tokens += float(loss_weight(inputs).sum())
        self.step_batches += 1

    def sample_ids(self, rows: list[int]) -> list[Any]:
        """Sample ids (``id``/``idx``/``index`` column, else the prompt's first 60 characters) of global rows.
        Collective."""
        local = []
        for x in self.inputs or []:
            sid = next((x[k] for k in ("id", "idx", "index") if isinstance(x, dict) and k in x), None)
            if sid is None:
                p = x.get("prompt") if isinstance(x, dict) else None
                if isinstance(p, list) and p and isinstance(p[-1], dict):
                    p = p[-1].get("content")
                sid = str(p)[:60]
            local.append(sid)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            everything = gather_object([local])
            local = [s for part in everything for s in part]
        return [local[i] if i < len(local) else None for i in rows]

    # --------------------------------------------------------------------------------------------------------
    # Non-finite rows
    # --------------------------------------------------------------------------------------------------------
    def inspect(
        self,
        mode: str,
        *,
        global_rows: dict[str, torch.Tensor | None] | None = None,
        local_rows: dict[str, torch.Tensor | None] | None = None,
        masks: dict[str, torch.Tensor] | None = None,
        bounds: dict[str, float | None] | None = None,
    ) -> torch.Tensor:
        """Find rows with inf/NaN values (or values beyond a bound); poison the generation batch (training) when there
        is one.

        ``global_rows``: name -> ``(B_g,)`` or ``(B_g, T)`` tensor over the global batch; ``local_rows``: name ->
        ``(B, T)`` local tensor (gathered here as a per-row flag). ``masks``: name -> mask of the same shape (only
        masked positions count). ``bounds``: name -> largest sane ``|value|`` (``None``: no bound); a finite value
        beyond it offends as a non-finite one does. Collective. Returns the ``(B_g,)`` bool mask of offending rows.
        """
        from accelerate.utils import gather

        masks, bounds = masks or {}, bounds or {}
        bad_g, reasons = None, {}
        items = [(n, t, False) for n, t in (global_rows or {}).items()]
        items += [(n, t, True) for n, t in (local_rows or {}).items()]
        for name, t, is_local in items:
            if t is None:
                continue
            rows = _nonfinite_rows(t, masks.get(name))
            bound = bounds.get(name)
            beyond = _nonfinite_rows(t, masks.get(name), bound) & ~rows if bound is not None else None
            if is_local:
                both = gather(torch.stack([rows, rows if beyond is None else beyond], -1).to(torch.long)).bool()
                rows, beyond = both[:, 0], (both[:, 1] if beyond is not None else None)
            bad_g = rows if bad_g is None else bad_g | rows
            reasons[f"non-finite {name}"] = rows
            if beyond is not None:
                bad_g = bad_g | beyond
                reasons[f"{name} beyond +-{bound:g}"] = beyond
        if bad_g is None:
            return torch.zeros(0, dtype=torch.bool)
        if bool(bad_g.any()):
            rows = bad_g.nonzero().flatten().tolist()
            what = [k for k, r in reasons.items() if bool(r.any())]
            nonfinite = sorted(k[len("non-finite ") :] for k in what if k.startswith("non-finite "))
            parts = ([f"non-finite {', '.join(nonfinite)}"] if nonfinite else []) + [
                k for k in what if not k.startswith("non-finite ")
            ]
            self.poison_batch(mode, "; ".join(parts), rows)
        return bad_g

    def poison_batch(self, mode: str, reason: str, rows: list[int] | None = None) -> None:
        """Mark the current generation batch as poisoned: its optimizer steps (policy, PRM) are skipped. In
        evaluation (``mode != "train"``) there is no optimizer step: the offending rows are only logged.

        ``rows``: the offending rows of the global generation batch; ``None`` when no row can be blamed (a gradient
        that overflows while every row's rewards and log-probs are finite and within bounds)."""
        ids = self.sample_ids(rows) if rows else []
        if self.accelerator.is_main_process:
            self._warn(mode, reason, rows, ids)
        if mode != "train":
            return
        # the poison lasts until the guarded policy step it feeds has run (not under DeepSpeed: no guarded step)
        self.step_pending = self.wrapped
        if self.poison is None:
            self.poison = {"reason": reason, "rows": list(rows or []), "sample_ids": ids}
        else:
            self.poison["reason"] += f"; {reason}"
            self.poison["rows"] = sorted(set(self.poison["rows"]) | set(rows or []))

    def _warn(self, mode: str, reason: str, rows: list[int] | None, ids: list[Any]) -> None:
        """Log the offending rows of :meth:`poison_batch`: in training the optimizer step is skipped; in evaluation
        nothing is skipped (no optimizer step) and the evaluation metrics may hold the values."""
        kind = "Non-finite values" if reason.startswith("non-finite") else "Non-finite or out-of-bound values"
        step = self.global_step()
        if mode != "train":
            head = (
                f"{kind} in evaluation after step {step} ({reason}): no optimizer step to skip; "
                "evaluation goes on and its metrics may be non-finite."
            )
            tail = f"Offending rows of the global evaluation batch: {rows or []}; sample ids: {ids}"
        else:
            head = f"{kind} at step {step + 1} ({reason}): skipping the optimizer step."
            tail = (
                f"Offending rows of the global generation batch: {rows}; sample ids: {ids}"
                if rows
                else "Offending rows: none, gradient overflow (no single row)."
            )
        logger.warning("%s %s", head, tail)

    def single_row_groups(self, mode: str, *, rewards: torch.Tensor, group_ids: torch.Tensor) -> int:
        """Log ``guard/single_row_groups``: the groups of the global batch left with one scorable row.

        ``rewards`` are the outcome rewards the advantages see (NaN on unscorable rows and on rows a filter dropped).
        Such a group has no group baseline, so with a group-baseline estimator its row gets advantage 0
        (:func:`trl_prime.functional.single_row_group_mask`); PRIME's ``"reinforce"`` estimator and PRL's
        ``"process_first"`` order use no baseline, and PRIME's ``"ppo"`` a value model's (GAE), so they still train on
        it.
        """
        count = int(single_row_group_mask(rewards, group_ids).sum().item())
        self.record(mode, "guard/single_row_groups", float(count))
        return count

    # --------------------------------------------------------------------------------------------------------
    # Degenerate batches
    # --------------------------------------------------------------------------------------------------------
    def degenerate_metrics(
        self,
        mode: str,
        *,
        outcome: torch.Tensor,
        completion_mask_g: torch.Tensor,
        num_generations: int,
        kept: torch.Tensor | None = None,
        completion_lengths: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
    ) -> None:
        """Warning metrics of a degenerate generation batch (global tensors; every process the same).

        ``truncated`` ``(B_global,)`` bool: the completions TRL counts as truncated (no EOS at the end, the signal of
        TRL's ``completions/clipped_ratio``; :attr:`trl_prime.rollout.Rollout.truncated`); without it, a completion
        is truncated when its length reaches ``max_completion_length``."""
        scorable = torch.isfinite(outcome)
        vals = outcome[scorable]
        all_equal = float(vals.numel() == 0 or bool((vals == vals[0]).all()))
        lengths = completion_mask_g.sum(-1) if completion_lengths is None else completion_lengths
        if truncated is None and self.max_completion_length is not None:
            truncated = lengths >= self.max_completion_length
        all_trunc = float(truncated is not None and truncated.numel() > 0 and bool(truncated.all()))
        short = (lengths <= 1).float().mean().item() if lengths.numel() else 0.0
        all_filtered = float(kept is not None and not bool(kept.any()))
        zero_spread = float(not bool(group_reward_spread(outcome, num_generations, kept).any()))
        for name, value in (
            ("all_rewards_equal", all_equal),
            ("all_groups_zero_spread", zero_spread),
            ("all_truncated", all_trunc),
            ("short_completion_fraction", short),
            ("all_filtered", all_filtered),
        ):
            self.record(mode, f"guard/{name}", value)
        # every group's rewards equal within the group: no outcome advantage anywhere (the batch may still differ)
        zero_spread_only = zero_spread and not (all_equal or all_filtered)
        if self.accelerator.is_main_process and (all_filtered or all_trunc or all_equal or zero_spread_only):
            which = [
                n
                for n, v in (
                    ("every group filtered out", all_filtered),
                    ("every completion truncated", all_trunc),
                    ("every reward equal", all_equal),
                    ("every group's rewards equal within the group (zero spread)", zero_spread_only),
                )
                if v
            ]
            logger.warning(
                "Degenerate batch at step %d: %s (no outcome signal from it).",
                self.global_step() + 1,
                ", ".join(which),
            )

    # --------------------------------------------------------------------------------------------------------
    # Verifier infrastructure failures
    # --------------------------------------------------------------------------------------------------------
    def count_metric(self, name: str, value: float) -> None:
        """A reward function's ``log_metric``: infrastructure failures (:func:`failure_metrics`) are counted."""
        if name in failure_metrics():
            self.infra_failures += float(value)

    def check_failure_rate(self, mode: str, num_completions: int) -> None:
        """After the reward functions of a generation batch: log ``verifier/failure_rate`` over the global batch and
        stop above ``max_verifier_failure_rate``. Collective.

        Raises:
            RuntimeError: more completions than ``max_verifier_failure_rate`` allows could not be scored because the
                verifier infrastructure failed."""
        counts = torch.tensor([self.infra_failures, float(num_completions)], device=self.accelerator.device)
        counts = self.accelerator.reduce(counts, reduction="sum")
        failures, total = counts[0].item(), max(counts[1].item(), 1.0)
        rate = failures / total
        self.record(mode, "verifier/failure_rate", rate)
        limit = getattr(self.args, "max_verifier_failure_rate", 1.0)
        if rate > limit:
            raise RuntimeError(
                f"{int(failures)} of {int(total)} completions ({rate:.0%}) could not be scored because the verifier "
                f"infrastructure failed ({', '.join(failure_metrics())}: e.g. the math worker pool or the code "
                f"sandbox died) at step {self.global_step() + 1}, above `max_verifier_failure_rate`={limit}. "
                "Stopping instead of training on bad rewards: check the verifier's workers / sandbox (memory, "
                "processes, permissions), then resume from the last checkpoint."
            )

    # --------------------------------------------------------------------------------------------------------
    # Guarded policy optimizer step
    # --------------------------------------------------------------------------------------------------------
    def wrap_optimizer(self, opt, after_policy_step) -> None:
        """Guard the policy optimizer's ``step`` (not under DeepSpeed, whose step runs inside ``backward``): a step
        of a poisoned batch, with a non-finite gradient or without any weighted token is skipped (gradients zeroed,
        accelerate's ``step_was_skipped``, scheduler not advanced). ``after_policy_step(applied, reason)`` is called
        before a step runs (``applied``) or when it is skipped (``reason``: ``"empty"`` or the non-finite reason)."""
        if opt is None or getattr(opt, "_guard_wrapped", False):
            return
        original = opt.step

        def guarded_step(*args, **kwargs):
            reason = self.step_problem(opt)
            self.step_pending = False  # the next generation batch is judged afresh
            no_tokens = self.step_is_empty()  # every step: the count restarts after a skipped step too
            empty = reason is None and no_tokens
            if reason is not None or empty:
                opt.zero_grad(set_to_none=True)
                if hasattr(opt, "_is_overflow"):
                    opt._is_overflow = True  # accelerate: the scheduler does not step, Trainer sees a skipped step
                scaler = getattr(opt, "scaler", None)
                if scaler is not None and hasattr(scaler, "_per_optimizer_states"):
                    # fp16 AMP: forget this step's unscale_ (gradient clipping) as scaler.update() would, scale kept;
                    # otherwise the next step's unscale_() raises "already been called ... since the last update()"
                    from torch.amp.grad_scaler import _refresh_per_optimizer_state

                    scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)
                after_policy_step(applied=False, reason="empty" if empty else reason)
                if empty:
                    self.record("train", "guard/empty_steps", 1.0)
                else:
                    self.record_skip(reason)
                return None
            if hasattr(opt, "_is_overflow") and getattr(opt, "scaler", None) is None:
                opt._is_overflow = False
            after_policy_step(applied=True)
            out = original(*args, **kwargs)
            self.consecutive_skips = 0
            return out

        for k, v in getattr(original, "__dict__", {}).items():  # keep torch's `_wrapped_by_lr_sched` marker
            setattr(guarded_step, k, v)
        opt.step = guarded_step
        opt._guard_wrapped = True
        self.wrapped = True

    def step_is_empty(self) -> bool:
        """Whether this optimizer step's micro-batches held no weighted loss token on any process (then resets the
        count for the next step); ``False`` when no micro-batch was counted (an optimizer stepped outside TRL's
        loop). Collective."""
        counts = torch.tensor([self.step_tokens, float(self.step_batches)], device=self.accelerator.device)
        self.step_tokens, self.step_batches = 0.0, 0
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        return bool(counts[1].item() > 0 and counts[0].item() == 0)

    def step_problem(self, opt) -> str | None:
        """Why the policy step must be skipped (``None``: it may run). Collective."""
        poisoned = self.poison is not None
        bad_grad = False
        clip_norm, self.clip_norm = self.clip_norm, None
        # fp16 AMP (a GradScaler): inf gradients are its overflows, which it handles itself (step skipped, scale
        # lowered); counting them here would stop a run while the scale calibrates and never let the scale drop
        if getattr(opt, "scaler", None) is None:
            if clip_norm is not None:
                # the norm of these gradients computed by the Trainer's clipping, before it: finite exactly when every
                # gradient is (an inf or NaN entry makes the L2 norm inf or NaN); no second pass over the gradients
                bad_grad = not math.isfinite(clip_norm)
            else:
                grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
                bad_grad = bool(grads) and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())
        flags = torch.tensor([float(poisoned), float(bad_grad)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        if flags[0] > 0:
            return (self.poison or {}).get("reason", "non-finite values on another process")
        if flags[1] > 0:
            return "non-finite policy gradient norm: gradient overflow (no single row)"
        return None

    def record_skip(self, reason: str) -> None:
        """Count a skipped non-finite step (``guard/skipped_steps``).

        Raises:
            RuntimeError: after ``max_nonfinite_skips`` consecutive skipped steps."""
        self.consecutive_skips += 1
        self.total_skips += 1
        self.record("train", "guard/skipped_steps", 1.0)
        if self.accelerator.is_main_process:
            logger.warning(
                "Skipped optimizer step %d (%s); %d consecutive.",
                self.global_step() + 1,
                reason,
                self.consecutive_skips,
            )
        limit = getattr(self.args, "max_nonfinite_skips", 3)
        if self.consecutive_skips >= limit:
            raise RuntimeError(
                f"Stopping: {self.consecutive_skips} consecutive optimizer steps were skipped because of "
                f"non-finite values (last: {reason}; `max_nonfinite_skips`={limit}). Check the reward functions "
                "(inf rewards), lower the learning rates (policy `learning_rate`, `prm_learning_rate`), or resume "
                "from the last good checkpoint."
            )


def loss_weight(inputs: dict) -> torch.Tensor:
    """The ``(B, T)`` loss weight of a micro-batch TRL's loss receives: PRIME's ``prime_loss_mask`` when present,
    else ``completion_mask`` times TRL's loss-only ``tool_mask`` (rows a trainer removed from the loss), else the
    completion mask."""
    if inputs.get("prime_loss_mask") is not None:
        return inputs["prime_loss_mask"]
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if inputs.get("tool_mask") is not None else mask


def finite_or_nan(x: float) -> float:
    return x if math.isfinite(x) else float("nan")
