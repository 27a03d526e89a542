"""PROF's process-consistency filter, an object any trainer composes (PROF arXiv 2509.03403, Sec. 3).

After outcome verification and before the advantages, each completion's reasoning steps are scored by a step PRM
(probabilities in [0, 1], :mod:`trl_prime.prof.step_prm`); their mean is the completion's process *consistency*
(penalised by ``lambda`` when it has fewer than ``prof_min_steps`` or more than ``prof_max_steps`` steps, and signed by
correctness: the critic of PROF Eq. (1)), and ``m`` of the ``n`` completions of each prompt are kept: ``k+`` correct
and ``k-`` incorrect with ``k+ + k- = m`` maximising ``k+ * k-``, the most consistent correct ones and the least
consistent incorrect ones (``prof_mode="both"``, PROF-BOTH) or random incorrect ones (``"correct"``, PROF-POS).
Advantages are computed on the kept rows only; dropped rows get loss weight 0 (no gradient). The PRM only ranks: it
never enters the advantage.

- :class:`ProfFilter`: step scores -> consistency -> selection over the global batch (identical on every process),
  and the ``prof/*`` metrics. A trainer composes it as it would a PEFT config: :meth:`ProfFilter.from_trainer` builds
  it from the ``prof_*`` fields (:class:`~trl_prime.prof.config.ProfOptions`) of the trainer's ``args`` (``None``
  when ``prof_mode="off"``), and calling it on a generation batch returns the rows kept and the ``prof/*`` metrics
  (the trainer records them). The arithmetic is
  :func:`trl_prime.functional.prof_consistency_scores` and :func:`~trl_prime.functional.prof_select`.
- :func:`prime_prof_rows`: the PRIME trainers' use of the filter (``PrimeMixin._algorithm_step``): the online prompt
  filter's kept rows narrowed by PROF. :class:`~trl_prime.prof.trainer.ProfGRPOTrainer` composes it with plain GRPO.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from trl_prime import functional as F
from trl_prime.implicit_prm.model import ImplicitPRM
from trl_prime.modeling import prepare_frozen, unwrap
from trl_prime.prof.config import check_prof_prm_path
from trl_prime.prof.step_prm import ImplicitStepPRM, StepBatch, StepPRM, TokenClassificationStepPRM, load_step_prm
from trl_prime.rollout import (
    gather_padded,
)


# ----------------------------------------------------------------------------------------------------------------
# The filter
# ----------------------------------------------------------------------------------------------------------------
class ProfFilter:
    """PROF selection over a generation batch: step scores -> consistency -> keep ``m`` of ``n`` per prompt.

    Args:
        prm: the step PRM (:class:`StepPRM`).
        num_keep: ``m``, completions kept per prompt. A prompt with ``m`` or fewer eligible completions keeps them all.
        mode, penalty, min_steps, max_steps, penalty_position, rounding, center, correct_threshold: see
            :class:`ProfOptions` (``prof_*``).
        seed: seed of ``mode="correct"``'s random choice (combined with the step, so every process and a resumed run
            draw the same rows).

    :meth:`select` is the pure selection over global tensors; :meth:`__call__` runs the whole step inside a trainer
    (scores the local rows, gathers them, selects identically on every process, returns the ``prof/*`` metrics).
    ``last`` holds the tensors of the latest call (global; for callbacks, tests and debugging).
    """

    def __init__(
        self,
        prm: StepPRM,
        *,
        num_keep: int,
        mode: str = "both",
        penalty: float = 10.0,
        min_steps: int = 2,
        max_steps: int = 30,
        penalty_position: str = "reference",
        rounding: str = "half_even",
        center: str = "none",
        correct_threshold: float = 1.0,
        seed: int = 0,
    ):
        F.check_choice(mode, F.PROF_SELECT_MODES, "ProfFilter mode")  # no filter (prof_mode="off"): build none
        if isinstance(num_keep, bool) or not isinstance(num_keep, int) or num_keep < 1:
            raise ValueError(f"num_keep={num_keep!r} must be a positive int (m, completions kept per prompt).")
        self.prm = prm
        self.num_keep = num_keep
        self.mode = mode
        self.penalty = penalty
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.penalty_position = penalty_position
        self.rounding = rounding
        self.center = center
        self.correct_threshold = correct_threshold
        self.seed = seed
        self.last: dict[str, Any] = {}
        self._warned_truncation = False

    @classmethod
    def from_trainer(cls, trainer, prm: StepPRM | ImplicitPRM | str | None = None) -> ProfFilter | None:
        """The filter a trainer's ``args`` ask for (``None`` when ``prof_mode="off"``).

        ``prm`` overrides ``args.prof_prm``: a :class:`StepPRM`, an :class:`~trl_prime.ImplicitPRM` (frozen), or a
        path. ``"implicit"`` uses the trainer's online implicit PRM (``trainer.implicit_prm``: PRIME trainers only).
        """
        args = trainer.args
        if args.prof_mode == "off":
            return None
        step_prm = _step_prm_for(trainer, args.prof_prm if prm is None else prm)
        _freeze_step_prm(step_prm, trainer)
        return cls(
            step_prm,
            num_keep=args.prof_keep_count(),
            mode=args.prof_mode,
            penalty=args.prof_penalty,
            min_steps=args.prof_min_steps,
            max_steps=args.prof_max_steps,
            penalty_position=args.prof_penalty_position,
            rounding=args.prof_rounding,
            center=args.prof_center,
            correct_threshold=args.prof_correct_threshold,
            seed=args.seed,
        )

    # --------------------------------------------------------------------------------------------------------
    def select(
        self,
        group_ids: torch.Tensor,
        step_scores: torch.Tensor,
        step_mask: torch.Tensor,
        outcome_rewards: torch.Tensor,
        *,
        step: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Pure selection over a whole (global) batch; rows with a NaN outcome are never kept.

        A NaN step score at a valid step is an unscored step (the external PRM's input was truncated before its
        separator): the step counts in ``num_steps`` (the step-count penalty), and the row's consistency is NaN, which
        ``functional.prof_select`` ranks as the least consistent of its class (removed first among correct rows and
        among incorrect rows alike), as a mean over the leading steps only would be biased.

        Returns a dict: ``kept`` ``(B,)`` bool, ``consistency`` ``(B,)`` (unsigned; NaN on truncated rows),
        ``num_steps`` ``(B,)``, ``correct`` ``(B,)`` bool, ``eligible`` ``(B,)`` bool (non-NaN outcome),
        ``truncated`` ``(B,)`` bool (rows with an unscored step).
        """
        step_mask = step_mask.bool()
        unscored = step_mask & torch.isnan(step_scores)
        truncated = unscored.any(-1)
        c, _ = F.prof_consistency_scores(
            torch.where(unscored, torch.zeros_like(step_scores), step_scores),
            step_mask & ~unscored,
            center=self.center,
        )
        H = step_mask.sum(-1)
        c = torch.where(truncated, torch.full_like(c, float("nan")), c)
        gen = None
        if self.mode == "correct":
            gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(step))
        idx = F.prof_select(
            group_ids,
            c,
            H,
            outcome_rewards,
            num_keep=self.num_keep,
            penalty=self.penalty,
            min_steps=self.min_steps,
            max_steps=self.max_steps,
            penalty_position=self.penalty_position,
            mode=self.mode,
            rounding=self.rounding,
            generator=gen,
            correct_threshold=self.correct_threshold,
        )
        kept = torch.zeros_like(outcome_rewards, dtype=torch.bool)
        kept[idx] = True
        eligible = ~torch.isnan(outcome_rewards)
        correct = eligible & (outcome_rewards >= self.correct_threshold)
        return {
            "kept": kept,
            "consistency": c,
            "num_steps": H,
            "correct": correct,
            "eligible": eligible,
            "truncated": truncated,
        }

    @staticmethod
    def metrics(sel: dict[str, torch.Tensor]) -> dict[str, float]:
        """The ``prof/*`` metrics of a selection (global batch).

        ``kept_fraction``: kept / generated completions; ``kept_correct`` / ``kept_incorrect``: counts of kept correct /
        incorrect completions; ``consistency_kept_mean`` / ``consistency_dropped_mean``: mean unsigned consistency of
        the kept / dropped eligible completions; ``dropped_correct_fraction``: the fraction of the eligible correct
        completions that were dropped; ``num_steps_mean``: mean number of PRM steps of the eligible completions;
        ``prm_truncated_fraction``: the fraction of the generated completions the external PRM could not score in full
        (input truncated at ``prof_prm_max_length``; their consistency is NaN, left out of the consistency means).
        """
        kept, c, H, correct, eligible = (sel[k] for k in ("kept", "consistency", "num_steps", "correct", "eligible"))
        truncated = sel.get("truncated", torch.zeros_like(kept))
        dropped = eligible & ~kept
        nan = float("nan")

        def mean(x, m):
            if x.is_floating_point():
                m = m & ~torch.isnan(x)
            return x[m].float().mean().item() if bool(m.any()) else nan

        n_correct = int(correct.sum().item())
        return {
            "prof/kept_fraction": kept.float().mean().item() if kept.numel() else nan,
            "prof/kept_correct": float((kept & correct).sum().item()),
            "prof/kept_incorrect": float((kept & ~correct).sum().item()),
            "prof/consistency_kept_mean": mean(c, kept),
            "prof/consistency_dropped_mean": mean(c, dropped),
            "prof/dropped_correct_fraction": (dropped & correct).sum().item() / n_correct if n_correct else nan,
            "prof/num_steps_mean": mean(H, eligible),
            "prof/prm_truncated_fraction": truncated.float().mean().item() if kept.numel() else nan,
        }

    def __call__(
        self,
        accelerator,
        *,
        step: int,
        outcome: torch.Tensor,
        eligible: torch.Tensor,
        output: dict,
        capture: dict,
        num_generations: int,
        token_rewards: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Run PROF on a trainer's generation batch; returns the global ``(B_global,)`` bool mask of kept rows and
        the ``prof/*`` metrics of the selection (:meth:`metrics`).

        ``accelerator``: the trainer's (collectives). ``step``: the trainer's optimizer steps so far (the tie-break
        seed). ``outcome`` ``(B_global,)`` and ``eligible`` ``(B_global,)`` (rows that may be kept: scorable, and not
        removed by another filter) are global; ``output`` is TRL's local generation output; ``capture`` holds the
        local ``prompts`` and ``completions``; ``token_rewards`` ``(B, T)`` local implicit-PRM rewards (PRIME).
        Collective.
        """
        acc = accelerator
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        batch = StepBatch(
            prompts=capture["prompts"],
            completions=capture["completions"],
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            input_ids=torch.cat([output["prompt_ids"], completion_ids], dim=1),
            attention_mask=torch.cat([output["prompt_mask"], completion_mask], dim=1),
            token_rewards=token_rewards,
        )
        scores, smask = self.prm.step_scores(batch)
        if scores.size(1) == 0:  # pad_across_processes needs a non-empty dim
            scores, smask = scores.new_zeros(scores.size(0), 1), smask.new_zeros(smask.size(0), 1)
        scores_g = gather_padded(acc, scores.float().contiguous())
        smask_g = gather_padded(acc, smask.long().contiguous()).bool()
        group_ids = torch.arange(outcome.numel(), device=outcome.device) // num_generations
        masked_outcome = torch.where(eligible, outcome, torch.full_like(outcome, torch.nan))
        sel = self.select(group_ids, scores_g, smask_g, masked_outcome, step=step)
        if not self._warned_truncation and bool(sel["truncated"].any()):
            self._warned_truncation = True
            if acc.is_main_process:
                warnings.warn(
                    f"PROF: the step PRM's input was truncated for {int(sel['truncated'].sum())} of "
                    f"{sel['truncated'].numel()} completions (prof_prm_max_length): their trailing steps are unscored, "
                    "so they rank as the least consistent of their class. Raise `prof_prm_max_length` (the fraction "
                    "is logged as prof/prm_truncated_fraction). Warned once.",
                    stacklevel=2,
                )
        self.last = dict(sel, step_scores=scores_g, step_mask=smask_g, outcome=outcome, group_ids=group_ids)
        return sel["kept"], self.metrics(sel)


def _step_prm_for(trainer, source: StepPRM | ImplicitPRM | str) -> StepPRM:
    """The :class:`StepPRM` ``source`` (``prof_prm`` or the trainer's ``prof_prm`` argument) names for ``trainer``.

    Raises:
        ValueError: ``"implicit"`` without an online implicit PRM, or a path that cannot be loaded as a step PRM.
        TypeError: ``source`` of another type.
    """
    args, tokenizer = trainer.args, trainer._tokenizer
    step_kw = dict(delimiter=args.prof_step_delimiter, temperature=args.prof_implicit_temperature)
    if isinstance(source, str) and source == "implicit":
        if getattr(trainer, "implicit_prm", None) is None:
            raise ValueError(
                f"`prof_prm`='implicit' needs the trainer's online implicit PRM ({type(trainer).__name__} has "
                "none): use PrimeGRPOTrainer / PrimeRLOOTrainer, or set prof_prm to a step PRM."
            )
        return ImplicitStepPRM(tokenizer, None, **step_kw)  # token rewards come from the PRIME step
    if isinstance(source, ImplicitPRM):
        return ImplicitStepPRM(tokenizer, source, **step_kw)
    if isinstance(source, str):
        check_prof_prm_path(source)
        try:
            return load_step_prm(source, args, tokenizer=tokenizer)
        except Exception as e:  # the Hub client's / transformers' message alone does not say which option failed
            raise ValueError(
                f"`prof_prm`={source!r} could not be loaded as a step PRM ({type(e).__name__}: {e}). Set "
                "`prof_prm` to an existing local folder (a token-classification step PRM, or one saved by "
                "ImplicitPRM.save_pretrained) or a reachable Hub id such as 'Qwen/Qwen2.5-Math-PRM-7B'."
            ) from e
    if isinstance(source, StepPRM):
        return source
    raise TypeError(f"prof_prm must be 'implicit', a path, an ImplicitPRM or a StepPRM; got {type(source)}.")


def _freeze_step_prm(step_prm: StepPRM, trainer) -> None:
    """The PRM only ranks: frozen (no grad, eval) and placed like the reference model, whether loaded from a path or
    passed in memory (a TokenClassificationStepPRM / ImplicitStepPRM / ImplicitPRM object).

    Raises:
        ValueError: an ImplicitPRM that shares the policy's model.
    """
    if isinstance(step_prm, TokenClassificationStepPRM) and isinstance(step_prm.model, nn.Module):
        step_prm.model = prepare_frozen(step_prm.model, trainer)
    if isinstance(step_prm, ImplicitStepPRM) and step_prm.implicit_prm is not None:
        ip = step_prm.implicit_prm
        if unwrap(ip.model) is unwrap(trainer.model):
            raise ValueError(
                "`prof_prm`: the ImplicitPRM shares the policy's model (e.g. a PEFT adapter on it); PROF here "
                "needs a frozen, separate implicit PRM (or use PrimeGRPOTrainer with prof_prm='implicit')."
            )
        ip.model = prepare_frozen(ip.model, trainer)
        if ip.ref_model is not None:
            ip.ref_model = prepare_frozen(ip.ref_model, trainer)


def prime_prof_rows(
    prof: ProfFilter | None,
    accelerator,
    *,
    step: int,
    mode: str,
    kept: torch.Tensor,
    scorable: torch.Tensor,
    outcome: torch.Tensor,
    output: dict,
    capture: dict,
    token_rewards: torch.Tensor,
    num_generations: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The rows a PRIME trainer trains its policy on: ``kept`` (the online prompt filter) narrowed by PROF.

    Called from ``PrimeMixin._algorithm_step`` after the implicit PRM's token rewards and before the advantages, with the
    trainer's filter ``prof``. Returns ``(rows, metrics)``: ``kept`` unchanged and no metrics when there is no PROF
    filter (``prof_mode="off"``) or in evaluation. The PRM update is not affected (it already ran, on every row of
    the kept groups).
    """
    if prof is None or mode != "train":
        return kept, {}
    return prof(
        accelerator,
        step=step,
        outcome=outcome,
        eligible=kept & scorable,
        output=output,
        capture=capture,
        num_generations=num_generations,
        token_rewards=token_rewards,
    )
