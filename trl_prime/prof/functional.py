# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""Pure tensor functions of PROF (arXiv 2509.03403): step scores, process consistency and the selection of
Algorithm 1.

Re-exported by :mod:`trl_prime.functional` (conventions there).

:func:`prof_select` in detail:

- Per group of ``n`` scorable rows (``n+`` correct: outcome >= ``correct_threshold``; ``n-`` incorrect; NaN outcomes
  are never kept), choose ``k+ + k- = m`` with ``k+ <= n+``, ``k- <= n-`` maximising ``k+ * k-``. As in the released
  code the number of correct rows removed is ``clip(round((n+ - n- + r)/2), 0, min(r, n+))`` with
  ``r = min(num_remove, n)``, and the remaining ``r -`` that many incorrect rows are removed (at most ``n-``); for odd
  ``m`` the tie between the two balanced splits is broken by ``rounding``: ``"half_even"`` (default, Python's banker's
  rounding as released), ``"half_up"`` (keeps one fewer correct row) or ``"half_down"`` (one more correct row).
- Critic: ``s = +1`` for correct and ``-1`` for incorrect rows, ``pen = H < min_steps or H > max_steps``,
  ``critic = s*c - penalty*pen``. Within each class the lowest-critic rows are removed (stable: among ties the earlier
  row goes first), i.e. the most consistent correct and the least consistent incorrect rows are kept, and a penalised
  row (too few or too many steps) is removed before every unpenalised one of its class, correct or incorrect. This is
  PROF Eq. (1) with Algorithm 1's ranking (arXiv 2509.03403v2: ``r_pro = (1/H) sum_h r_h - lambda * r_o * pen`` with
  ``r_o`` in {-1, 1}; the top ``k+`` of the correct and the bottom ``k-`` of the incorrect rows by ``r_pro`` are
  kept, and ``critic = s * r_pro``) and the released ``filter_trajectories``, so ``penalty_position`` ``"paper"`` and
  ``"reference"`` select the same rows. (The v1 preprint put the penalty inside the sign, ``s*(c - penalty*pen)``,
  which ranks a penalised incorrect row as the most consistent incorrect one and keeps it first; that form is not
  offered.) ``mode="correct"`` removes incorrect rows uniformly at random (drawn with ``generator``) instead.
- A NaN ``consistency`` (the PRM could not score the row) is treated as the worst critic of its class: such a row is
  removed before every scored row of its class (correct or incorrect alike), and kept only when the class keeps more
  rows than it has scored ones. (With ``mode="correct"`` incorrect rows are drawn at random, whatever their
  consistency.)
"""

from __future__ import annotations

from typing import Any

import torch

from trl_prime.ops import (
    GroupIds,
    _as_bool_mask,
    _as_int,
    _check_2d,
    _check_rows,
    _check_same_shape,
    _check_tensor,
    _group_index,
    _group_sum,
    _out_dtype,
    _work_dtype,
)
from trl_prime.options import PROF_CENTERS, PROF_PENALTY_POSITIONS, PROF_ROUNDINGS, PROF_SELECT_MODES, check_choice


__all__ = ["prof_step_scores_from_logits", "prof_step_scores_from_implicit", "prof_consistency_scores", "prof_select"]


def prof_step_scores_from_logits(
    logits: torch.Tensor,
    separator_mask: torch.Tensor,
    max_steps: int | None = None,
    *,
    positive_label: int = 1,
    padding_value: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step scores of a token-classification step PRM (Qwen2.5-Math-PRM style).

    ``p = softmax(logits, -1)[..., positive_label]`` at every separator token (e.g. ``<extra_0>``); the k-th
    separator of a row (left to right) gives step k. Steps beyond ``max_steps`` are dropped.

    Args:
        logits: ``(B, T, C)`` token-classification logits.
        separator_mask: ``(B, T)`` bool/0-1, true at the step-separator tokens (from the input ids).
        max_steps: Width of the output; ``None`` = the largest number of separators in the batch.
        positive_label: Class index of "step is correct".
        padding_value: Value of padded steps (the released code uses -99).

    Returns:
        ``(step_scores (B, S), step_mask (B, S) bool)`` in the logits' dtype (probabilities in [0, 1]).

    Raises:
        ValueError: on shape mismatches or a bad ``positive_label``/``max_steps``.

    Source: PROF released code (``prof_dp_rm.make_step_rewards``); PROF §3 (PRM step scores).
    """
    _check_tensor("logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"`logits` must have shape (B, T, C), got {tuple(logits.shape)}.")
    _check_2d("separator_mask", separator_mask)
    if separator_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"`separator_mask` must have shape {tuple(logits.shape[:2])}, got {tuple(separator_mask.shape)}."
        )
    if not (0 <= positive_label < logits.shape[-1]):
        raise ValueError(f"positive_label={positive_label} is out of range for {logits.shape[-1]} classes.")
    sep = _as_bool_mask("separator_mask", separator_mask)
    B, T = sep.shape
    counts = sep.sum(-1)
    if max_steps is None:
        S = int(counts.max().item()) if B and T else 0
    else:
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"max_steps={max_steps!r} must be a non-negative int or None.")
        S = max_steps
    p = torch.softmax(logits.to(_work_dtype(logits)), dim=-1)[..., positive_label]
    rank = sep.long().cumsum(-1) - 1
    sel = sep & (rank < S)
    rows = torch.arange(B, device=p.device)[:, None].expand(B, T)
    flat = (rows * max(S, 1) + rank.clamp(min=0))[sel]
    out = torch.full((B * max(S, 1),), float(padding_value), dtype=p.dtype, device=p.device)
    out = out.index_put((flat,), p[sel]).reshape(B, max(S, 1))[:, :S]
    step_mask = torch.arange(S, device=p.device)[None, :] < counts.clamp(max=S)[:, None]
    return out.to(logits.dtype), step_mask


def prof_step_scores_from_implicit(
    step_values: torch.Tensor, step_mask: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """Map implicit-PRM step rewards to [0, 1] step scores for PROF: ``sigmoid(step_value / temperature)``.

    A step reward of 0 (PRM equal to reference) maps to 0.5; the map is monotone, so rankings are kept.
    Padded steps are 0.

    Args:
        step_values: ``(B, S)`` step rewards from :func:`step_rewards`.
        step_mask: ``(B, S)`` step mask.
        temperature: > 0; smaller spreads the (typically small, beta-scaled) rewards over [0, 1].

    Returns:
        ``(B, S)`` scores in the input dtype.

    Raises:
        ValueError: on ``temperature <= 0`` or mismatched shapes.

    Source: PROF (arXiv 2509.03403), the implicit PRM as its step PRM; Implicit PRM §3 (step rewards).
    """
    if not (temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be > 0.")
    _check_same_shape("step_values", step_values, "step_mask", step_mask)
    m = _as_bool_mask("step_mask", step_mask)
    s = torch.sigmoid(step_values / temperature)
    return torch.where(m, s, torch.zeros_like(s))


def prof_consistency_scores(
    step_scores: torch.Tensor, step_mask: torch.Tensor, *, center: str = "none"
) -> tuple[torch.Tensor, torch.Tensor]:
    """PROF process consistency: the mean step score of each completion (unsigned).

    ``center="none"`` (paper): ``c = mean_h p_h``. ``center="batch"`` (released code):
    ``c = 2 * (mean_h p_h - mu)`` with ``mu`` the mean of all valid step scores of the batch. A row without
    steps gets 0. The sign by correctness and the step-count penalty are applied in :func:`prof_select`.

    Args:
        step_scores: ``(B, S)`` PRM step probabilities in [0, 1] (padded steps may hold anything, e.g. -99).
        step_mask: ``(B, S)`` bool/0-1 valid-step mask.
        center: ``"none"`` | ``"batch"``.

    Returns:
        ``(consistency (B,) in the scores' dtype, num_steps (B,) long)``.

    Raises:
        ValueError: on an unknown ``center``, mismatched shapes, or a valid step score outside [0, 1] (NaN
            included): PROF's step scores are probabilities; map raw rewards first (e.g.
            :func:`prof_step_scores_from_implicit`).

    Source: PROF Eq. (1) (``r_pro = (1/H) sum_h r_h``); released ``compute_verify_step_level_score``.
    """
    check_choice(center, PROF_CENTERS, "center")
    _check_2d("step_scores", step_scores)
    _check_same_shape("step_scores", step_scores, "step_mask", step_mask)
    m = _as_bool_mask("step_mask", step_mask)
    wd = _work_dtype(step_scores)
    raw = step_scores.detach().to(wd)
    bad = m & ~((raw >= 0) & (raw <= 1))  # NaN fails both comparisons
    if bool(bad.any()):
        row, col = (int(i) for i in torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"`step_scores` must be probabilities in [0, 1] at every valid step (step_mask=1), but "
            f"step_scores[{row}, {col}] = {raw[row, col].item()} ({int(bad.sum().item())} valid step(s) out of range); "
            f"map raw step rewards to [0, 1] first (e.g. prof_step_scores_from_implicit) and mark padded steps "
            f"with step_mask=0."
        )
    s = torch.where(m, step_scores.to(wd), torch.zeros((), dtype=wd, device=step_scores.device))
    n = m.sum(-1)
    mean = s.sum(-1) / n.clamp(min=1).to(wd)
    if center == "batch":
        mu = s.sum() / m.sum().clamp(min=1).to(wd)
        mean = 2.0 * (mean - mu)
    c = torch.where(n > 0, mean, torch.zeros_like(mean))
    return c.to(_out_dtype(step_scores)), n.long()


def _round_half(x: torch.Tensor, rounding: str) -> torch.Tensor:
    if rounding == "half_even":
        return torch.round(x)  # round half to even, as Python's round()
    if rounding == "half_up":
        return torch.floor(x + 0.5)
    return torch.ceil(x - 0.5)  # half_down


def _prof_counts(num_remove: Any, num_keep: Any) -> tuple[int | None, int | None]:
    """Validate :func:`prof_select`'s ``num_remove`` / ``num_keep`` (exactly one, a non-negative int)."""
    if (num_remove is None) == (num_keep is None):
        raise ValueError("prof_select: pass exactly one of `num_remove` (rows dropped per group) or `num_keep`.")
    for name, v in (("num_remove", num_remove), ("num_keep", num_keep)):
        if v is not None and (_as_int(v) is None or _as_int(v) < 0):
            raise ValueError(f"{name}={v!r} must be a non-negative int.")
    num_remove = None if num_remove is None else _as_int(num_remove)
    num_keep = None if num_keep is None else _as_int(num_keep)
    return num_remove, num_keep


def _prof_critic(
    consistency: torch.Tensor,
    num_steps: torch.Tensor,
    pos: torch.Tensor,
    *,
    penalty: float,
    min_steps: int,
    max_steps: int,
) -> torch.Tensor:
    """PROF Eq. (1) (v2) critic ``s*c - penalty*pen`` (B,) float64; a NaN consistency gets ``-inf``."""
    dev = consistency.device
    c = consistency.detach().to(torch.float64)
    sign = torch.where(pos, 1.0, -1.0).to(torch.float64)
    H = num_steps.to(dev)
    pen = ((H < min_steps) | (H > max_steps)).to(torch.float64)
    critic = sign * c - penalty * pen  # PROF Eq. (1) (v2) = released code, whichever `penalty_position`
    # NaN consistency: unscored by the PRM, removed first in its class (torch.sort would put NaN last = kept)
    return torch.where(torch.isnan(c), torch.full_like(critic, float("-inf")), critic)


def _prof_removals(
    pos: torch.Tensor,
    neg: torch.Tensor,
    gid: torch.Tensor,
    G: int,
    *,
    num_remove: int | None,
    num_keep: int | None,
    rounding: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group ``(correct rows removed (G,), incorrect rows removed (G,))`` float64, balancing the kept rows
    (PROF Algorithm 1 step 4, released ``filter_trajectories``)."""
    n_pos = _group_sum(pos.to(torch.float64), gid, G)
    n_neg = _group_sum(neg.to(torch.float64), gid, G)
    n_val = n_pos + n_neg
    if num_remove is not None:
        r = torch.minimum(torch.full_like(n_val, float(num_remove)), n_val)
    else:
        r = (n_val - float(num_keep)).clamp(min=0)
    pos_rm = _round_half((n_pos - n_neg + r) / 2.0, rounding)
    pos_rm = torch.minimum(pos_rm.clamp(min=0), torch.minimum(r, n_pos))
    neg_rm = torch.minimum(r - pos_rm, n_neg)
    return pos_rm, neg_rm


def _check_prof_rows(consistency: torch.Tensor, num_steps: torch.Tensor, outcome_rewards: torch.Tensor) -> int:
    """:func:`prof_select`: ``consistency`` ``(B,)`` and ``num_steps`` / ``outcome_rewards`` with ``B`` rows; returns
    ``B``."""
    _check_tensor("consistency", consistency)
    if consistency.dim() != 1:
        raise ValueError(f"`consistency` must have shape (B,), got {tuple(consistency.shape)}.")
    B = consistency.shape[0]
    _check_rows("num_steps", num_steps, B)
    _check_rows("outcome_rewards", outcome_rewards, B)
    return B


def _prof_classes(
    outcome_rewards: torch.Tensor, device: torch.device, correct_threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scorable, correct, incorrect)`` rows (B,) bool: correct at outcome >= ``correct_threshold``."""
    o = outcome_rewards.detach().to(device=device, dtype=torch.float64)
    valid = ~torch.isnan(o)
    pos = valid & (o >= correct_threshold)
    return valid, pos, valid & ~pos


def _random_incorrect_key(critic: torch.Tensor, neg: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``mode="correct"``: the critic on correct rows, a uniform draw (``generator``) on incorrect ones."""
    B, dev = critic.shape[0], critic.device
    if generator is not None:
        rnd = torch.rand(B, generator=generator, device=generator.device, dtype=torch.float64).to(dev)
    else:
        rnd = torch.rand(B, device=dev, dtype=torch.float64)
    return torch.where(neg, rnd, critic.clone())


def _rank_within_class(key: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
    """Each row's 0-based rank (float64) by ascending ``key`` among the rows of its class ``cls`` (stable: ties keep
    row order)."""
    order = torch.sort(key, stable=True).indices
    order = order[torch.sort(cls[order], stable=True).indices]
    sorted_cls = cls[order]
    first = torch.searchsorted(sorted_cls, sorted_cls, right=False)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(key.shape[0], device=key.device) - first
    return rank.to(torch.float64)


def prof_select(
    group_ids: GroupIds,
    consistency: torch.Tensor,
    num_steps: torch.Tensor,
    outcome_rewards: torch.Tensor,
    *,
    num_remove: int | None = None,
    penalty: float = 10.0,
    min_steps: int = 2,
    max_steps: int = 30,
    penalty_position: str = "reference",
    mode: str = "both",
    rounding: str = "half_even",
    generator: torch.Generator | None = None,
    num_keep: int | None = None,
    correct_threshold: float = 1.0,
    num_generations: int | None = None,
) -> torch.Tensor:
    """PROF selection: keep ``m = n - num_remove`` completions per prompt, balanced between correct and incorrect.

    Per group, ``k+`` correct and ``k-`` incorrect scorable rows are kept, ``k+ + k- = m`` maximising ``k+ * k-``; in
    each class the rows of lowest critic ``s*c - penalty*pen`` go first (``s = +-1`` for correct / incorrect; ``pen``:
    a step count outside ``[min_steps, max_steps]``; NaN ``c``: worst). In detail: :mod:`trl_prime.prof.functional`.

    Args:
        group_ids: ``(B,)`` prompt ids (tensor or sequence; any order); ``None`` with ``num_generations``.
        consistency, num_steps, outcome_rewards: ``(B,)`` UNSIGNED consistency (:func:`prof_consistency_scores`;
            NaN: unscored), number of PRM steps ``H``, outcomes (NaN = unscorable).
        num_remove, num_keep: Rows to remove (``n - m``) or to keep (``m``) per group: exactly one of them.
        penalty, min_steps, max_steps: ``lambda`` (default 10) and the allowed step-count range (default 2..30).
        penalty_position: ``"reference"`` (released code) | ``"paper"`` (PROF Eq. (1)): the same critic.
        mode, rounding: ``"both"`` | ``"correct"``; ``"half_even"`` | ``"half_up"`` | ``"half_down"``.
        generator: ``torch.Generator`` for ``mode="correct"``.
        correct_threshold: Outcome at or above which a row counts as correct.
        num_generations: Contiguous groups of this size instead of ``group_ids`` (pass ``group_ids=None``).

    Returns:
        LongTensor of the kept row indices, ascending.

    Raises:
        ValueError: on unknown options, both/neither of ``num_remove``/``num_keep``, negative counts or shape
            mismatches.
    Source: PROF Algorithm 1 (step 4: ``k+ + k- = m``, max ``k+ k-``), Eq. (1) penalty; released
    ``filter_trajectories`` (PROF-Both / PROF-Correct).
    """
    check_choice(penalty_position, PROF_PENALTY_POSITIONS, "penalty_position")
    check_choice(mode, PROF_SELECT_MODES, "mode")
    check_choice(rounding, PROF_ROUNDINGS, "rounding")
    num_remove, num_keep = _prof_counts(num_remove, num_keep)
    B = _check_prof_rows(consistency, num_steps, outcome_rewards)
    gid, G, _ = _group_index(group_ids, num_generations, B, consistency.device, fn="prof_select")
    valid, pos, neg = _prof_classes(outcome_rewards, consistency.device, correct_threshold)
    critic = _prof_critic(consistency, num_steps, pos, penalty=penalty, min_steps=min_steps, max_steps=max_steps)
    pos_rm, neg_rm = _prof_removals(pos, neg, gid, G, num_remove=num_remove, num_keep=num_keep, rounding=rounding)
    key = _random_incorrect_key(critic, neg, generator) if mode == "correct" else critic.clone()
    # class: (group, correct/incorrect); invalid rows get their own class at the end
    cls = torch.where(valid, gid * 2 + neg.long(), torch.full_like(gid, 2 * G))
    rank = _rank_within_class(key, cls)
    removed = (pos & (rank < pos_rm[gid])) | (neg & (rank < neg_rm[gid]))
    return torch.nonzero(valid & ~removed, as_tuple=True)[0]
