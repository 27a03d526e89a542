# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""Pure tensor functions of PRL (arXiv 2601.10201): advantages from the KL-regularised reward-to-go (Algorithm 1).

Re-exported by :mod:`trl_prime.functional` (conventions there).

:func:`prl_advantages` in detail:

- ``k_t = log pi_old(y_t) - log pi_ref(y_t)`` (detached, 0 outside the mask), ``S_t = sum_{s>=t} k_s`` (suffix sum
  including t). ``order="advantage_first"`` (default): ``A`` is the GRPO outcome advantage (:func:`grpo_advantages`:
  group mean, unbiased std, ``eps``; ``scale_rewards="batch"`` divides by the std over the batch's scorable rows
  instead, ``"none"`` / ``False`` subtracts the mean only); ``"process_first"``: ``A`` is the raw outcome, no
  normalisation.
- A group with fewer than two scorable rows has no baseline: with ``"advantage_first"`` its row's outcome advantage
  ``A`` is 0 (``single_row_compat=True``: the released code's mean 0, std 1, i.e. the raw outcome divided by
  ``1 + eps``), so its weights are the KL-to-go term ``-S_t / eta`` alone, as for a group whose outcomes are all
  equal. ``"process_first"`` uses no baseline for any group and is unchanged (the released code's ``rollout_n == 1``
  path: the raw outcome).
- Segmentation: with ``step_ends`` every token takes the value of the step end at or after it; the last valid token
  always ends a step. The fill uses the explicit step-end mask, so a step-end value of exactly 0 is kept;
  ``zero_fill_compat=True`` reproduces the released code's ``left_fill_by_next_nonzero`` (an exact 0 is overwritten
  by the next step's value). ``step_ends=None``: every token is its own step. (The released code skips segmentation
  when ``prm_adv="prm"``; pass ``step_ends=None`` to match.)
- Unscorable rows (NaN outcome) get 0.
"""

from __future__ import annotations

import torch

from trl_prime.ops import (
    GroupIds,
    _as_bool_mask,
    _check_2d,
    _check_rows,
    _check_same_shape,
    _group_index,
    _out_dtype,
    _work_dtype,
    discounted_cumsum,
    fill_from_step_end,
    grpo_advantages,
    last_token_mask,
    left_fill_by_next_nonzero,
)
from trl_prime.options import PRL_ORDERS, check_choice


__all__ = ["prl_advantages"]


def _check_prl_args(
    order: str,
    eta: float,
    outcome_rewards: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Validate :func:`prl_advantages`' ``order``, ``eta`` and shapes; return the bool mask."""
    check_choice(order, PRL_ORDERS, "order")
    if not (eta > 0):
        raise ValueError(
            f"eta={eta!r} must be > 0 (it is the inverse KL coefficient; use a large eta for a weak KL term)."
        )
    _check_2d("old_logps", old_logps)
    _check_same_shape("old_logps", old_logps, "ref_logps", ref_logps)
    _check_same_shape("old_logps", old_logps, "mask", mask)
    _check_rows("outcome_rewards", outcome_rewards, old_logps.shape[0])
    return _as_bool_mask("mask", mask)


def _kl_to_go_weights(
    A: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor, m: torch.Tensor, *, eta: float
) -> torch.Tensor:
    """``rho_t = A - S_t / eta`` on the mask (0 elsewhere), in ``A``'s dtype: the KL-to-go ``S_t = sum_{s>=t} k_s``
    of ``k_t = log pi_old - log pi_ref`` (PRL Eq. 3.1)."""
    zero = torch.zeros((), dtype=A.dtype, device=A.device)
    k = torch.where(m, (old_logps.detach().to(A.dtype) - ref_logps.detach().to(A.dtype)), zero)
    S = discounted_cumsum(k, 1.0)
    return torch.where(m, A[:, None] - S / eta, zero)


def _prl_outcome_advantage(
    o_raw: torch.Tensor,
    group_ids: GroupIds | None,
    *,
    order: str,
    scale_rewards: bool | str,
    eps: float,
    num_generations: int | None,
    single_row_compat: bool,
) -> torch.Tensor:
    """PRL's ``A`` (B,): the GRPO outcome advantage (``"advantage_first"``, PRL §3.3) or the raw outcome, 0 where
    NaN (``"process_first"``, whose grouping arguments are validated only)."""
    if order == "advantage_first":
        if group_ids is None and num_generations is None:
            raise ValueError('prl_advantages(order="advantage_first") needs `group_ids` (or `num_generations`).')
        return grpo_advantages(
            o_raw,
            group_ids,
            scale_rewards=scale_rewards,
            eps=eps,
            num_generations=num_generations,
            single_row_compat=single_row_compat,
        )
    if group_ids is not None or num_generations is not None:
        _group_index(group_ids, num_generations, o_raw.shape[0], o_raw.device, fn="prl_advantages")  # validate only
    return torch.where(~torch.isnan(o_raw), o_raw, torch.zeros((), dtype=o_raw.dtype, device=o_raw.device))


def _prl_segment_fill(
    rho: torch.Tensor, m: torch.Tensor, step_ends: torch.Tensor | None, *, zero_fill_compat: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """PRL Algorithm 1's segment-level weights: every token takes the value of ``rho`` at the step end at or after
    it (the last valid token always ends a step; ``step_ends=None``: every token is a step). Returns
    ``(filled (B, T), values at the step ends (B, T))``."""
    zero = torch.zeros((), dtype=rho.dtype, device=rho.device)
    if step_ends is not None:
        _check_same_shape("old_logps", rho, "step_ends", step_ends)  # rho has old_logps' shape
    if step_ends is None:
        ends = m
    else:
        ends = (_as_bool_mask("step_ends", step_ends) & m) | last_token_mask(m)
    at_ends = torch.where(ends, rho, zero)
    if zero_fill_compat:
        adv = left_fill_by_next_nonzero(at_ends)
    else:
        adv = fill_from_step_end(rho, ends)
    return adv, at_ends


def prl_advantages(
    outcome_rewards: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    group_ids: GroupIds | None,
    *,
    eta: float = 200.0,
    step_ends: torch.Tensor | None = None,
    order: str = "advantage_first",
    scale_rewards: bool | str = True,
    eps: float = 1e-6,
    zero_fill_compat: bool = False,
    num_generations: int | None = None,
    return_step_end_values: bool = False,
    single_row_compat: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PRL per-token weights ``rho_t = A - S_t / eta`` (KL-regularised reward-to-go).

    ``S_t = sum_{s>=t} (log pi_old(y_s) - log pi_ref(y_s))``; ``A`` is the GRPO outcome advantage
    (``order="advantage_first"``, PRL §3.3) or the raw outcome (``"process_first"``); each token takes the value at
    the step end at or after it; unscorable rows get 0. In detail (single-row groups, segmentation, the released
    code's options): :mod:`trl_prime.prl.functional`.

    Args:
        outcome_rewards, old_logps, ref_logps, mask: ``(B,)`` outcome rewards (NaN = unscorable); ``(B, T)``
            log-probs of the sampled tokens under the rollout policy and the frozen reference; completion mask.
        group_ids: ``(B,)`` prompt ids (may be None with ``num_generations``, or for ``"process_first"``).
        eta: Inverse KL coefficient (> 0; default 200, paper range 100-300).
        step_ends: Optional ``(B, T)`` bool step-end mask (see :func:`step_end_mask`).
        order: ``"advantage_first"`` | ``"process_first"``.
        scale_rewards, eps: GRPO normalisation options (``scale_rewards``: :data:`SCALE_REWARDS` or a bool).
        zero_fill_compat: Use the released non-zero fill. ``num_generations``: contiguous groups, not ``group_ids``.
        return_step_end_values: Also return the values at the step ends (0 elsewhere), the tensor the released
            code fills. ``single_row_compat``: a single scorable row keeps its raw outcome as ``A`` (released code).

    Returns:
        ``(B, T)`` detached weights in the dtype of ``old_logps`` (0 outside the mask); with
        ``return_step_end_values`` a tuple ``(advantages, step_end_values)``.

    Raises:
        ValueError: on ``eta <= 0``, unknown ``order``, shape mismatches or grouping errors.
    Source: PRL Eq. 3.1 (``rho_t = stopgrad(R - (1/eta) sum_{j>=t} k_j)``), §3.3 (GRPO normalisation) and
    Algorithm 1 (segment-level weights); released ``ray_trainer.py`` PRL block.
    """
    m = _check_prl_args(order, eta, outcome_rewards, old_logps, ref_logps, mask)
    wd = _work_dtype(old_logps, ref_logps, outcome_rewards)
    zero = torch.zeros((), dtype=wd, device=old_logps.device)
    o_raw = outcome_rewards.detach().to(device=old_logps.device, dtype=wd)
    grouping = dict(order=order, scale_rewards=scale_rewards, eps=eps, num_generations=num_generations)
    A = _prl_outcome_advantage(o_raw, group_ids, single_row_compat=single_row_compat, **grouping)
    rho = _kl_to_go_weights(A, old_logps, ref_logps, m, eta=eta)
    adv, at_ends = _prl_segment_fill(rho, m, step_ends, zero_fill_compat=zero_fill_compat)
    keep = m & ~torch.isnan(o_raw)[:, None]
    adv = torch.where(keep, adv, zero).to(_out_dtype(old_logps))
    if return_step_end_values:
        return adv, torch.where(keep, at_ends, zero).to(_out_dtype(old_logps))
    return adv
