# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""Pure tensor functions of PRIME (arXiv 2502.01456): the advantages of Eq. 5 and Appendix B.3 (RLOO, GRPO,
REINFORCE), PPO with a value model or the implicit PRM as value (Table 4, section 5.4), the policy loss, the online
prompt filter, the PRM's labels and metrics.

Re-exported by :mod:`trl_prime.functional` (conventions there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from trl_prime.ops import (
    GroupIds,
    _as_bool_mask,
    _batch_mean_std,
    _check_2d,
    _check_eps,
    _check_rows,
    _check_same_shape,
    _check_tensor,
    _divide_by_std,
    _group_index,
    _group_label,
    _group_mean_std,
    _group_sum,
    _out_dtype,
    _scale_mode,
    _work_dtype,
    discounted_cumsum,
    last_token_mask,
    masked_whiten,
    process_reward_batch_norm,
)
from trl_prime.options import (
    BASELINES,
    GRPO_PROCESS_FORMS,
    GRPO_PROCESS_SCALES,
    IMPLICIT_VALUE_SCALES,
    PAIR_ACCURACY_TIES,
    PRM_LABELS,
    PROCESS_REWARD_NORMS,
    check_choice,
)


__all__ = [
    "rloo_advantages",
    "ppo_token_rewards",
    "implicit_prm_values",
    "gae_advantages",
    "clipped_value_loss",
    "explained_variance",
    "token_ppo_clip_loss",
    "prompt_accuracy_mask",
    "prm_pair_accuracy",
    "prm_abs_accuracy",
    "prm_labels",
    "prm_label_warnings",
]

#: grpo_process_scale="outcome_std": a group whose outcome std is at most this times max(1, |group mean|) counts as
#: having equal outcomes (float32 rounding of a weighted reward sum leaves a std around 1e-7, which as a divisor
#: would blow the process term up by 10^7)
_OUTCOME_SPREAD_RTOL = 1e-4


def _check_prime_args(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    outcome_gamma: float,
    eps: float,
    fn: str,
) -> torch.Tensor:
    """Validate the tensors, discounts and ``eps`` of :func:`_prime_advantages_impl`; return the bool mask."""
    _check_2d("process_rewards", process_rewards)
    _check_same_shape("process_rewards", process_rewards, "mask", mask)
    _check_rows("outcome_rewards", outcome_rewards, process_rewards.shape[0])
    for name, g in (("gamma", gamma), ("outcome_gamma", outcome_gamma)):
        if not (0.0 <= float(g) <= 1.0):
            raise ValueError(f"{name}={g!r} must be in [0, 1].")
    m = _as_bool_mask("mask", mask)
    _check_eps(eps)
    bad = m & ~torch.isfinite(process_rewards.detach())
    if bool(bad.any()):
        row, col = (int(i) for i in torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"{fn}: `process_rewards` must be finite at every valid (mask=1) position, but "
            f"process_rewards[{row}, {col}] = {process_rewards[row, col].item()} ({int(bad.sum().item())} non-finite "
            f"valid position(s)); NaN is only allowed in `outcome_rewards` (unscorable completion). Check the PRM "
            f"log-probs (e.g. -inf log-probs or a NaN forward pass)."
        )
    return m


def _check_rloo_groups(group_ids: GroupIds | None, gid: torch.Tensor, counts: torch.Tensor, fn: str) -> None:
    """The RLOO leave-one-out baseline (PRIME Eq. 5) needs groups of at least 2 completions."""
    if gid.shape[0] and int(counts.min().item()) < 2:
        row = int(torch.nonzero(counts[gid] < 2)[0].item())
        label = f"group_ids[{row}]={_group_label(group_ids, row)!r}" if group_ids is not None else f"row {row}"
        raise ValueError(
            f"{fn}: the RLOO leave-one-out baseline needs at least 2 completions per group, but the group of "
            f"{label} has {int(counts[gid[row]].item())}; use num_generations >= 2 (or group_ids with groups "
            f"of >= 2)."
        )


def _masked_prime_rewards(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    m: torch.Tensor,
    *,
    include_last_token: bool,
    norm: str,
) -> tuple[torch.Tensor, ...]:
    """Token process rewards ``P`` (0 outside the mask and on unscorable rows) and outcome rewards ``o`` (0 where
    NaN) in the work dtype: ``(P, o, valid rows, last-token mask, mask of scorable rows)``."""
    dev = process_rewards.device
    wd = _work_dtype(process_rewards, outcome_rewards)
    zero = torch.zeros((), dtype=wd, device=dev)
    o_raw = outcome_rewards.to(device=dev, dtype=wd)
    valid = ~torch.isnan(o_raw)
    o = torch.where(valid, o_raw, zero)
    last = last_token_mask(m)
    P = torch.where(m, process_rewards.to(wd), zero)
    if not include_last_token:
        P = torch.where(last, zero, P)
    row_m = m & valid[:, None]
    if norm == "batch_norm":
        P = process_reward_batch_norm(P, row_m)
    P = torch.where(row_m, P, zero)
    return P, o, valid, last, row_m


class _PrimeBatch(NamedTuple):
    """What every estimator's terms read: token process rewards ``P`` and outcome rewards ``o`` (masked, work dtype),
    the mean token process reward ``rbar`` and length ``L`` of each completion, the scorable rows ``valid``, the
    group index ``gid`` of ``G`` groups with their sizes ``counts``, and the caller's ``group_ids`` (for messages)."""

    P: torch.Tensor
    rbar: torch.Tensor
    o: torch.Tensor
    L: torch.Tensor
    valid: torch.Tensor
    gid: torch.Tensor
    G: int
    counts: torch.Tensor
    group_ids: GroupIds | None


def _rloo_terms(
    x: _PrimeBatch, *, baseline: str, fn: str, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RLOO (PRIME Eq. 5): ``(process term (B, T), outcome advantage (B,), usable rows (B,))``; groups of fewer than
    2 completions are refused (:func:`_check_rloo_groups`)."""
    _check_rloo_groups(x.group_ids, x.gid, x.counts, fn)
    P, rbar, o, valid, gid, G = x.P, x.rbar, x.o, x.valid, x.gid, x.G
    zero = torch.zeros((), dtype=P.dtype, device=P.device)
    K = _group_sum(valid.to(P.dtype), gid, G)[gid]
    usable = valid & (K >= 2)
    Km1 = (K - 1).clamp(min=1)
    S_r = _group_sum(torch.where(valid, rbar, zero), gid, G)[gid]
    S_o = _group_sum(o, gid, G)[gid]
    if baseline == "paper":  # PRIME Eq. 5: r_s - mean_{j != i} rbar_j ; r_o - mean_{j != i} r_o^j
        proc_tok = P - ((S_r - rbar) / Km1)[:, None]
        out_adv = o - (S_o - o) / Km1
    else:  # released masked_rloo: x*K/(K-1) - sum_j mean_j/(K-1), per token and per source
        proc_tok = P * (K / Km1)[:, None] - (S_r / Km1)[:, None]
        out_adv = o * K / Km1 - S_o / Km1
    return proc_tok, out_adv, usable


def _grpo_terms(
    x: _PrimeBatch, *, scale: str, eps: float, form: str, divisor: str, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO (PRIME Appendix B.3, Eq. 8): ``(process term (B, T), outcome advantage (B,), usable rows (B,))``."""
    P, rbar, o, L, valid, gid, G = x.P, x.rbar, x.o, x.L, x.valid, x.gid, x.G
    zero = torch.zeros((), dtype=P.dtype, device=P.device)
    mean_r, std_r, cnt, mean_o, scale_mean_o, scale_std_o = _grpo_statistics(rbar, o, valid, gid, G, scale)
    usable = valid & (cnt >= 2)  # fewer than 2 scorable rows: no baseline, advantage 0
    proc_tok = P - mean_r[:, None]
    if form == "response":  # sum over the completion = L_i (rbar_i - mean_g rbar): divide by L_i
        proc_tok = proc_tok / L.clamp(min=1)[:, None]
    if scale != "none":
        if divisor == "process_std":
            proc_tok = _divide_by_std(proc_tok, std_r[:, None], eps)
        else:  # the outcome's std; a group (batch) with equal outcomes has no scale: process term 0
            # outcomes equal up to rounding (a weighted sum of rewards in float32) have no scale either
            spread = scale_std_o > _OUTCOME_SPREAD_RTOL * scale_mean_o.abs().clamp(min=1.0)
            proc_tok = torch.where(spread[:, None], _divide_by_std(proc_tok, scale_std_o[:, None], eps), zero)
    out_adv = _divide_by_std(o - mean_o, scale_std_o, eps) if scale != "none" else o - mean_o
    return proc_tok, out_adv, usable


def _reinforce_terms(x: _PrimeBatch, **_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """REINFORCE (PRIME Appendix B.3, Eq. 7): no baseline, ``(P, o, scorable rows)``."""
    return x.P, x.o, x.valid


def _discounted_returns(
    proc_tok: torch.Tensor,
    out_tok: torch.Tensor,
    process_coef: float,
    outcome_coef: float,
    gamma: float,
    outcome_gamma: float,
) -> torch.Tensor:
    """``process_coef * discounted process return + outcome_coef * discounted outcome return``, ``(B, T)``."""
    returns = torch.zeros(proc_tok.shape, dtype=proc_tok.dtype, device=proc_tok.device)
    if process_coef != 0:
        returns = returns + process_coef * discounted_cumsum(proc_tok, gamma)
    if outcome_coef != 0:
        returns = returns + outcome_coef * discounted_cumsum(out_tok, outcome_gamma)
    return returns


def _whitened(
    returns: torch.Tensor, keep: torch.Tensor, *, whiten: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both 0 outside ``keep``; with ``whiten``, the advantages are the returns whitened
    over ``keep`` (:func:`masked_whiten`, when it holds >= 2 tokens)."""
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    returns = torch.where(keep, returns, zero)
    if whiten:
        if int(keep.sum().item()) >= 2:
            adv = masked_whiten(returns, keep, eps=eps)
        else:
            adv = returns
        adv = torch.where(keep, adv, zero)
    else:
        adv = returns
    return adv, returns


def _prime_advantages_impl(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: GroupIds | None,
    num_generations: int | None,
    *,
    terms: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    process_coef: float = 1.0,
    outcome_coef: float = 1.0,
    gamma: float = 1.0,
    outcome_gamma: float = 1.0,
    baseline: str = "paper",
    whiten: bool = False,
    process_reward_norm: str = "none",
    include_last_token: bool = True,
    scale_rewards: bool | str = True,
    eps: float = 1e-6,
    grpo_process_form: str = "token",
    grpo_process_scale: str = "outcome_std",
    whiten_eps: float = 1e-8,
    fn: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared body of the ``"rloo"``, ``"grpo"`` and ``"reinforce"`` estimators: ``(advantages, returns)``, both
    ``(B, T)`` in the dtype of ``process_rewards``. ``terms`` is the estimator's baselines (:func:`_rloo_terms`,
    :func:`_grpo_terms`, :func:`_reinforce_terms`); ``fn`` names the public caller in error messages."""
    for value, choices, name in (
        (baseline, BASELINES, "baseline"),
        (process_reward_norm, PROCESS_REWARD_NORMS, "process_reward_norm"),
        (grpo_process_form, GRPO_PROCESS_FORMS, "grpo_process_form"),
        (grpo_process_scale, GRPO_PROCESS_SCALES, "grpo_process_scale"),
    ):
        check_choice(value, choices, name)
    scale = _scale_mode(scale_rewards)
    m = _check_prime_args(
        process_rewards, outcome_rewards, mask, gamma=gamma, outcome_gamma=outcome_gamma, eps=eps, fn=fn
    )
    B, T = process_rewards.shape
    gid, G, counts = _group_index(group_ids, num_generations, B, process_rewards.device, fn=fn)
    P, o, valid, last, row_m = _masked_prime_rewards(
        process_rewards, outcome_rewards, m, include_last_token=include_last_token, norm=process_reward_norm
    )
    zero = torch.zeros((), dtype=P.dtype, device=P.device)
    L = m.sum(-1).to(P.dtype)
    rbar = P.sum(-1) / L.clamp(min=1)  # mean token process reward of each completion
    batch = _PrimeBatch(P, rbar, o, L, valid, gid, G, counts, group_ids)
    # the estimator's baselines: process term per token, outcome advantage per row
    proc_tok, out_adv, usable = terms(
        batch, baseline=baseline, scale=scale, eps=eps, form=grpo_process_form, divisor=grpo_process_scale, fn=fn
    )
    proc_tok = torch.where(row_m & usable[:, None], proc_tok, zero)
    out_tok = torch.where(last & usable[:, None], out_adv[:, None].expand(B, T), zero)
    returns = _discounted_returns(proc_tok, out_tok, process_coef, outcome_coef, gamma, outcome_gamma)
    adv, returns = _whitened(returns, m & usable[:, None], whiten=whiten, eps=whiten_eps)
    return adv.to(_out_dtype(process_rewards)), returns.to(_out_dtype(process_rewards))


def _grpo_statistics(
    rbar: torch.Tensor, o: torch.Tensor, valid: torch.Tensor, gid: torch.Tensor, G: int, scale: str
) -> tuple[torch.Tensor, ...]:
    """The "grpo" estimator's per-row statistics: the group means of ``rbar`` and ``o`` (the centring), the group
    count, and the divisors' statistics, the group's or, with ``scale="batch"``, the batch's: ``(mean_r, std_r, cnt,
    mean_o, scale_mean_o, scale_std_o)``."""
    mean_r, std_r, cnt = _group_mean_std(rbar, valid, gid, G)
    mean_o, std_o, _ = _group_mean_std(o, valid, gid, G)
    if scale == "batch":
        _, std_r = _batch_mean_std(rbar, valid)
        return (mean_r, std_r, cnt, mean_o, *_batch_mean_std(o, valid))
    return mean_r, std_r, cnt, mean_o, mean_o, std_o


def rloo_advantages(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    mask: torch.Tensor,
    num_generations: int | None = None,
    *,
    process_coef: float = 1.0,
    outcome_coef: float = 1.0,
    gamma: float = 1.0,
    outcome_gamma: float = 1.0,
    baseline: str = "paper",
    whiten: bool = False,
    process_reward_norm: str = "none",
    include_last_token: bool = True,
    group_ids: GroupIds | None = None,
    whiten_eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME advantages with leave-one-out baselines (PRIME Eq. 5).

    ``baseline="paper"`` (default), for completion i of a group of K and token t::

        returns_t = process_coef * sum_{s>=t} gamma^(s-t) (r_s^i - mean_{j!=i} rbar^j)
                  + outcome_coef * outcome_gamma^(L_i-1-t) (r_o^i - mean_{j!=i} r_o^j)

    with ``rbar^j`` the mean token reward of completion j (over its mask) and the outcome placed at the last
    valid token. At ``t=0`` with ``gamma=1`` the process part is ``sum_t r_t^i - L_i mean_{j!=i} rbar^j``.
    Unscorable rows (NaN outcome) are excluded from every baseline and from the whitening statistics and get
    advantage and return 0; so do rows of a group with fewer than 2 scorable rows.

    Args:
        process_rewards, outcome_rewards, mask: ``(B, T)`` token process rewards (e.g.
            :func:`implicit_token_rewards`), ``(B,)`` verifier scores in [0, 1] or NaN, ``(B, T)`` completion mask.
        num_generations: K, for contiguous groups (or pass ``group_ids``: any order, any size >= 2).
        process_coef, outcome_coef: Weights of the two sources; ``gamma``, ``outcome_gamma``: their discounts.
        baseline: ``"paper"`` or ``"reference"``, the released code's ``masked_rloo``: each source becomes, per token,
            ``x * K/(K-1) - sum_j mean(x_j)/(K-1)`` (process over the completion mask; outcome over a one-token mask
            at the last valid token, the true leave-one-out), then is weighted and discounted. Per-completion sums
            equal the paper's, per-token values do not.
        whiten: (released code) the advantages are :func:`masked_whiten` of the returns over all valid tokens of
            the batch (unbiased variance, eps ``whiten_eps``).
        process_reward_norm: ``"batch_norm"`` (released code) first divides the process rewards by the batch's
            max |reverse cumulative sum| + 1e-6; ``"none"``.
        include_last_token: False zeroes each completion's last-token process reward (released veRL; ``rbar``'s
            mask is unchanged).

    Returns:
        ``(advantages (B, T), returns (B, T))`` in the dtype of ``process_rewards``; 0 outside the mask.

    Raises:
        ValueError: for a group with fewer than 2 completions, ``num_generations`` not dividing B, unknown option
            values, mismatched shapes, or a non-finite process reward at a valid position (NaN marks an unscorable
            completion only in ``outcome_rewards``; padded positions may hold anything).
    Source: PRIME Eq. 5 (§3.2); released PRIME / veRL ``compute_rloo_advantage_return``.
    """
    data = (process_rewards, outcome_rewards, mask, group_ids, num_generations)
    coefs = dict(process_coef=process_coef, outcome_coef=outcome_coef, gamma=gamma, outcome_gamma=outcome_gamma)
    shaping = dict(baseline=baseline, whiten=whiten, whiten_eps=whiten_eps, process_reward_norm=process_reward_norm)
    return _prime_advantages_impl(
        *data, terms=_rloo_terms, include_last_token=include_last_token, fn="rloo_advantages", **coefs, **shaping
    )


def _terms_estimator(terms, doc: str):
    """A ``prime_advantages`` estimator from its return terms (the three group estimators share everything else)."""

    def estimator(process_rewards, outcome_rewards, mask, group_ids, *, num_generations=None, **options):
        return _prime_advantages_impl(
            process_rewards,
            outcome_rewards,
            mask,
            group_ids,
            num_generations,
            terms=terms,
            fn="prime_advantages",
            **options,
        )[0]

    estimator.__doc__ = doc
    return estimator


_rloo_estimator = _terms_estimator(
    _rloo_terms, """``prime_advantages(estimator="rloo")``: PRIME Eq. 5 (:func:`rloo_advantages`)."""
)
_grpo_estimator = _terms_estimator(
    _grpo_terms,
    """``prime_advantages(estimator="grpo")``: PRIME Appendix B.3, Eq. 8 (:mod:`trl_prime.prime.estimators`).""",
)
_reinforce_estimator = _terms_estimator(
    _reinforce_terms, """``prime_advantages(estimator="reinforce")``: PRIME Appendix B.3, Eq. 7, no baseline."""
)


def _ppo_estimator(process_rewards, outcome_rewards, mask, group_ids, *, num_generations=None, **options):
    """``prime_advantages(estimator="ppo")``: PRIME Table 4, GAE against ``values`` (no group baseline: ``group_ids``
    and ``num_generations`` are ignored)."""
    return _ppo_advantages(process_rewards, outcome_rewards, mask, **options)


def ppo_token_rewards(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    process_coef: float = 1.0,
    outcome_coef: float = 1.0,
) -> torch.Tensor:
    """PPO's per-token rewards with implicit process rewards: ``process_coef * r_phi(y_t)`` on every completion token
    plus ``outcome_coef * r_o`` on the last one.

    Args:
        process_rewards: ``(B, T)`` float token process rewards (PRIME Eq. 3, ``beta log pi_phi / pi_ref``).
        outcome_rewards: ``(B,)`` float outcome rewards; ``NaN`` = unscorable.
        mask: ``(B, T)`` bool or 0/1 completion mask (the last true position of a row gets the outcome).
        process_coef: weight of the process rewards (0 = plain PPO on the outcome reward).
        outcome_coef: weight of the outcome reward.

    Returns:
        ``(B, T)`` rewards in the dtype of ``process_rewards``: 0 outside the mask; every position of a row whose
        outcome is ``NaN`` is ``NaN`` (:func:`gae_advantages` then excludes the row).

    Raises:
        ValueError: on shapes that differ from ``(B, T)`` / ``(B,)`` or a mask that is not 0/1.

    Source: PRIME Appendix B.3 and Table 4 ("PPO w/ PRIME"): the implicit process rewards are PPO's dense rewards,
    the verifier's outcome reward its terminal reward.
    """
    _check_2d("process_rewards", process_rewards)
    _check_same_shape("process_rewards", process_rewards, "mask", mask)
    _check_rows("outcome_rewards", outcome_rewards, process_rewards.size(0))
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(process_rewards, outcome_rewards)
    zero = torch.zeros((), dtype=wd, device=process_rewards.device)
    rewards = (
        torch.where(m, process_rewards.to(wd), zero) * process_coef if process_coef != 0 else zero.expand(m.shape)
    )
    outcome = outcome_rewards.to(wd)
    rewards = rewards + torch.where(last_token_mask(m), outcome[:, None] * outcome_coef, zero)
    rewards = torch.where(torch.isnan(outcome)[:, None], torch.full_like(rewards, torch.nan), rewards)
    return rewards.to(_out_dtype(process_rewards))


def implicit_prm_values(process_rewards: torch.Tensor, mask: torch.Tensor, *, scale: str = "logit") -> torch.Tensor:
    """The implicit PRM as a value model: ``V(y_<t) = sum_{s<t} r_phi(y_s)``, the prefix value of the state before
    token ``t`` (``scale="logit"``), or ``sigmoid`` of it (``scale="prob"``).

    The implicit PRM's value of the prefix ending with token ``t`` is ``v_phi(y_<t+1) = sum_{s<=t} r_phi(y_s)``
    (PRIME section 5.4; the Implicit PRM paper's Q-value ``q_t``). PPO's value at position ``t`` is the value of the
    state in which ``y_t`` is chosen, ``y_<t``, so the values are the prefix sums shifted by one: 0 at the first
    token, ``r_0`` at the second, ... Positions outside the mask add nothing and get value 0.

    Scales: the PRM is trained by the cross-entropy of ``sigmoid(r(y))`` against the outcome label (PRIME Eq. 4), so
    the prefix sum is a *logit* and ``sigmoid`` of it the PRM's probability that the label is 1 given the prefix:

    - ``"logit"`` (PRIME section 5.4 as written, the default): ``V_t = q_{t-1}``, in the PRM's logit units; next to an
      outcome in ``[0, 1]`` it is on another scale (0 at the first token of every completion).
    - ``"prob"``: ``V_t = sigmoid(q_{t-1})`` in ``(0, 1)``, on the scale of a 0/1 (or fractional) outcome label:
      0.5 at the first token of every completion (an empty prefix has ``q = 0``), then the PRM's estimate of the
      label. It is on the *outcome's* scale only where the outcome is the label (``prm_label="identity"``, rewards in
      ``[0, 1]``); the trainer multiplies it by ``outcome_coef``.

    Args:
        process_rewards: ``(B, T)`` float token process rewards (PRIME Eq. 3).
        mask: ``(B, T)`` bool or 0/1 completion mask.
        scale: ``"logit"`` or ``"prob"`` (:data:`IMPLICIT_VALUE_SCALES`).

    Returns:
        ``(B, T)`` values in the dtype of ``process_rewards`` (0 outside the mask, for both scales).

    Raises:
        ValueError: on a shape mismatch, a mask that is not 0/1, or an unknown ``scale``.

    Source: PRIME section 5.4 and Table 4 ("PRIME as Value Model"); PRIME Eq. 4 (the CE that makes ``q`` a logit).
    """
    check_choice(scale, IMPLICIT_VALUE_SCALES, "scale")
    _check_2d("process_rewards", process_rewards)
    _check_same_shape("process_rewards", process_rewards, "mask", mask)
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(process_rewards)
    r = torch.where(m, process_rewards.to(wd), torch.zeros((), dtype=wd, device=m.device))
    before = r.cumsum(-1) - r  # sum over the masked positions s < t
    if scale == "prob":
        before = torch.sigmoid(before)
    return torch.where(m, before, torch.zeros_like(before)).to(_out_dtype(process_rewards))


def _check_gae_args(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> torch.Tensor:
    """Validate :func:`gae_advantages`' shapes and ``gamma`` / ``lam``; return the bool mask."""
    _check_2d("rewards", rewards)
    _check_same_shape("rewards", rewards, "values", values)
    _check_same_shape("rewards", rewards, "mask", mask)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"gae_advantages: `{name}`={x!r} must lie in [0, 1].")
    return _as_bool_mask("mask", mask)


def _gae_over_kept(r: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, gamma: float, lam: float) -> torch.Tensor:
    """GAE's ``A_t`` (``(B, T)``, work dtype) over the ``keep`` positions of each row, in order; 0 elsewhere."""
    # the mask positions of each row moved to its front, in order: GAE's recursion runs over consecutive entries
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    kc = torch.gather(keep, 1, order)
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    rc = torch.where(kc, torch.gather(r, 1, order), zero)
    vc = torch.where(kc, torch.gather(v, 1, order), zero)
    v_next = F.pad(vc[:, 1:], (0, 1))  # 0 after a row's last valid token (terminal) and on the padding
    delta = torch.where(kc, rc + gamma * v_next - vc, zero)
    adv_c = discounted_cumsum(delta, float(gamma) * float(lam))
    return torch.zeros_like(adv_c).scatter(1, order, adv_c)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
    whiten_eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the completion tokens: ``(advantages, returns)``.

    With ``t`` running over a row's mask positions in order and ``t+1`` the next one::

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last token = 0: the episode ends)
        A_t     = sum_{k>=0} (gamma * lam)^k delta_{t+k}
        R_t     = A_t + V_t                             (the value model's regression target)

    ``lam = 1`` gives ``A_t = sum_{s>=t} gamma^(s-t) r_s - V_t`` (Monte-Carlo return minus value), ``lam = 0`` the
    one-step TD error ``delta_t``. Positions outside the mask (padding, tool-response tokens) are skipped: they get
    0 and pass the next valid position's value through, undiscounted. The advantages are not whitened unless
    ``whiten`` (masked whitening over the valid rows' tokens, :func:`masked_whiten`, when they hold >= 2 tokens);
    the returns never are.

    Args:
        rewards: ``(B, T)`` float per-token rewards (e.g. :func:`ppo_token_rewards`).
        values: ``(B, T)`` float values ``V(y_<t)`` of the state before each token (the value model's output, or
            :func:`implicit_prm_values`).
        mask: ``(B, T)`` bool or 0/1 completion mask.
        gamma: discount in ``[0, 1]``.
        lam: GAE's ``lambda`` in ``[0, 1]``.
        whiten: whiten the advantages over the valid rows' mask tokens.
        whiten_eps: ``eps`` of :func:`masked_whiten`.

    Returns:
        ``(advantages, returns)``, each ``(B, T)`` in the dtype of ``rewards``, 0 outside the mask. A row with a
        non-finite reward or value on its mask (e.g. a ``NaN`` outcome) is excluded: advantages and returns 0, not
        counted in the whitening statistics.

    Raises:
        ValueError: on a shape mismatch, a mask that is not 0/1, or ``gamma`` / ``lam`` outside ``[0, 1]``.

    Source: Schulman et al. 2016 (arXiv 1506.02438) Eq. 16; the PPO estimator of PRIME Table 4 and Figure 7.
    """
    m = _check_gae_args(rewards, values, mask, gamma=gamma, lam=lam)
    wd = _work_dtype(rewards, values)
    r, v = rewards.to(wd), values.to(wd)
    ok = ~((~torch.isfinite(r) | ~torch.isfinite(v)) & m).any(-1)  # (B,) rows without a non-finite entry
    keep = m & ok[:, None]
    zero = torch.zeros((), dtype=wd, device=r.device)
    adv = _gae_over_kept(r, v, keep, gamma=gamma, lam=lam)
    returns = torch.where(keep, adv + v, zero)
    adv, _ = _whitened(adv, keep, whiten=whiten, eps=whiten_eps)
    out = _out_dtype(rewards)
    return adv.to(out), returns.to(out)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float = 0.2,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: ``sum_t 0.5 max((V_t - R_t)^2, (V_t^clip - R_t)^2) m_t / N``, and its clip fraction.

    ``V_t^clip = V_old,t + clamp(V_t - V_old,t, -c, c)``: the value may move at most ``c = cliprange_value`` from the
    value the advantages were computed with. With ``values`` equal to ``old_values`` (the first update on a batch)
    the loss is the plain ``0.5 (V - R)^2``.

    Args:
        values: ``(B, T)`` float values of the value model being trained (keeps the autograd graph).
        old_values: ``(B, T)`` values the returns were computed with (no graph needed).
        returns: ``(B, T)`` regression targets (:func:`gae_advantages`).
        mask: ``(B, T)`` loss weight of each token (0/1 or bool), cast to the dtype of ``values``.
        cliprange_value: ``c >= 0``.
        normalizer: ``N``; ``None`` = ``mask.sum().clamp(min=1)`` (token mean). Pass the loss tokens of the whole
            update to average over micro-batches and processes.

    Returns:
        ``(loss, clipfrac)``: 0-dim tensors in the dtype of ``values``; ``clipfrac`` is the masked fraction of tokens
        whose clipped term is the larger (no graph).

    Raises:
        ValueError: on a shape mismatch or ``cliprange_value < 0``.

    Source: the value loss of PPO as implemented in TRL's ``PPOTrainer`` (up to TRL 0.x) and veRL
    (``compute_value_loss``), used by PRIME's PPO runs (Table 4).
    """
    _check_2d("values", values)
    for name, x in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        _check_same_shape("values", values, name, x)
    if cliprange_value < 0:
        raise ValueError(f"clipped_value_loss: `cliprange_value`={cliprange_value!r} must be >= 0.")
    w = mask.to(values.dtype)
    old = old_values.to(values.dtype)
    target = returns.to(values.dtype)
    clipped = old + torch.clamp(values - old, -cliprange_value, cliprange_value)
    loss_unclipped = (values - target) ** 2
    loss_clipped = (clipped - target) ** 2
    per_token = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    n = w.sum().clamp(min=1.0)
    clipfrac = ((loss_clipped > loss_unclipped).to(values.dtype) * w).sum().detach() / n
    return (per_token * w).sum() / (n if normalizer is None else normalizer), clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens: how much of the returns' variance the values explain
    (1 = perfect, 0 = no better than a constant, negative = worse).

    Args:
        values: ``(B, T)`` float values.
        returns: ``(B, T)`` float returns.
        mask: ``(B, T)`` bool or 0/1 mask.

    Returns:
        0-dim float tensor (no graph); ``NaN`` when the masked returns have no variance (fewer than two tokens, or
        all equal).

    Raises:
        ValueError: on a shape mismatch or a mask that is not 0/1.

    Source: the ``val/var_explained`` metric of TRL's former ``PPOTrainer`` and CleanRL's PPO.
    """
    _check_2d("values", values)
    _check_same_shape("values", values, "returns", returns)
    _check_same_shape("values", values, "mask", mask)
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(values, returns)
    v, r = values.detach().to(wd)[m], returns.detach().to(wd)[m]
    if r.numel() < 2:
        return torch.tensor(float("nan"), dtype=wd, device=values.device)
    var_r = r.var()
    if var_r == 0:
        return torch.tensor(float("nan"), dtype=wd, device=values.device)
    return 1.0 - (r - v).var() / var_r


def _ppo_advantages(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    process_coef: float = 1.0,
    outcome_coef: float = 1.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
    whiten_eps: float = 1e-8,
) -> torch.Tensor:
    """``prime_advantages(estimator="ppo")``: GAE over :func:`ppo_token_rewards` with the given values."""
    if values is None:
        raise ValueError(
            "prime_advantages(estimator='ppo') needs `values`: the (B, T) values V(y_<t) of a value model, or "
            "implicit_prm_values(process_rewards, mask) for the implicit PRM as value (PRIME section 5.4)."
        )
    rewards = ppo_token_rewards(
        process_rewards, outcome_rewards, mask, process_coef=process_coef, outcome_coef=outcome_coef
    )
    adv, _ = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=whiten, whiten_eps=whiten_eps)
    return adv


def token_ppo_clip_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    normalizer: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Token-level PPO-clip policy loss: ``sum_t -min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t) m_t / N``.

    ``rho_t = exp(logps_t - old_logps_t) = pi_theta(y_t) / pi_old(y_t)`` is the importance ratio of each sampled
    token; every token carries its own advantage ``A_t`` (PRIME's ``(B, T)`` advantages, Eq. 5), so the clip acts per
    token rather than per sequence.

    Args:
        logps: ``(B, T)`` float log-probs (nats) of the sampled tokens under the current policy ``pi_theta``; keeps
            the autograd graph.
        old_logps: ``(B, T)`` log-probs under the rollout policy ``pi_old``; ``None`` uses ``logps.detach()``
            (ratio exactly 1: on-policy, the loss is ``-A_t`` with the policy gradient).
        advantages: ``(B, T)`` per-token advantages, or ``(B,)`` one advantage per sequence (broadcast over tokens).
        mask: ``(B, T)`` loss weight of each token (0/1 or bool; 0 = not in the loss: padding, filtered rows),
            cast to the dtype of ``logps``.
        epsilon_low: lower clip range ``eps_low`` (ratio clipped below at ``1 - epsilon_low``).
        epsilon_high: upper clip range ``eps_high`` (ratio clipped above at ``1 + epsilon_high``; DAPO's clip-higher
            when larger than ``epsilon_low``).
        normalizer: ``N``, what the masked token sum is divided by (a 0-dim tensor or a float; e.g. the number of
            loss tokens of the whole optimisation step); ``None`` uses ``mask.sum().clamp(min=1)`` (the token mean).

    Returns:
        0-dim loss tensor in the dtype of ``logps`` (with the autograd graph of ``logps``).

    Raises:
        ValueError: when ``logps`` is not 2-D, or ``old_logps`` / ``mask`` / a 2-D ``advantages`` do not have its
            shape, or a 1-D ``advantages`` does not have ``B`` rows.

    Source: PRIME Eq. 6 (the PPO clip surrogate with token-level advantages, Algorithm 1 line 10).
    """
    _check_2d("logps", logps)
    _check_same_shape("logps", logps, "mask", mask)
    if old_logps is not None:
        _check_same_shape("logps", logps, "old_logps", old_logps)
    if advantages.dim() == 1:
        _check_rows("advantages", advantages, logps.size(0))
        advantages = advantages.unsqueeze(1)
    else:
        _check_same_shape("logps", logps, "advantages", advantages)
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / normalizer


def prompt_accuracy_mask(
    outcome_rewards: torch.Tensor,
    num_generations: int | None = None,
    *,
    lower: float = 0.2,
    upper: float = 0.8,
    completion_lengths: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    group_ids: GroupIds | None = None,
) -> torch.Tensor:
    """PRIME online prompt filter: keep a group iff ``lower <= mean(r_o) <= upper`` (inclusive).

    The group mean is over its scorable (non-NaN) rows; a group with none is dropped. If
    ``completion_lengths`` and ``max_completion_length`` are given, a group is also dropped when any of its
    completions has length ``>= max_completion_length`` (truncated). (The veRL port's ``< max - 1`` test is
    ``max_completion_length=max_response_length - 1``.)

    Args:
        outcome_rewards: ``(B,)`` verifier scores.
        num_generations: Contiguous group size (or pass ``group_ids``).
        lower, upper: Inclusive accuracy bounds (default 0.2 / 0.8).
        completion_lengths: ``(B,)`` completion lengths in tokens.
        max_completion_length: Generation limit in tokens.
        group_ids: ``(B,)`` group ids instead of ``num_generations``.

    Returns:
        ``(B,)`` bool, the group's decision repeated on each of its rows.

    Raises:
        ValueError: on ``lower > upper``, only one of the two length arguments, or grouping errors.

    Source: PRIME §3.3 (online prompt filter); released ``RayPRIMETrainer.filter``.
    """
    _check_tensor("outcome_rewards", outcome_rewards)
    if outcome_rewards.dim() != 1:
        raise ValueError(f"`outcome_rewards` must have shape (B,), got {tuple(outcome_rewards.shape)}.")
    if lower > upper:
        raise ValueError(f"lower={lower} must be <= upper={upper}.")
    if (completion_lengths is None) != (max_completion_length is None):
        raise ValueError(
            "pass both `completion_lengths` and `max_completion_length` to filter truncated groups, or neither."
        )
    B = outcome_rewards.shape[0]
    dev = outcome_rewards.device
    gid, G, _ = _group_index(group_ids, num_generations, B, dev, fn="prompt_accuracy_mask")
    r = outcome_rewards.to(torch.float64)
    valid = ~torch.isnan(r)
    cnt = _group_sum(valid.to(r.dtype), gid, G)
    mean = _group_sum(torch.where(valid, r, torch.zeros_like(r)), gid, G) / cnt.clamp(min=1)
    keep = (cnt > 0) & (mean >= lower) & (mean <= upper)
    if completion_lengths is not None:
        _check_rows("completion_lengths", completion_lengths, B)
        trunc = (completion_lengths.to(dev) >= max_completion_length).to(r.dtype)
        keep = keep & (_group_sum(trunc, gid, G) == 0)
    return keep[gid]


def prm_pair_accuracy(
    sequence_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    num_generations: int | None = None,
    *,
    group_ids: GroupIds | None = None,
    ties: str = "reference",
) -> float:
    """Weighted pairwise ranking accuracy of the PRM inside each group (``prm/pair_accuracy``).

    For every pair ``a < b`` (row order) in a group: correct iff ``(r_a > r_b) == (o_a > o_b)``, weighted by
    ``|o_a - o_b|``. Group accuracy = weighted mean; a group whose outcomes are all equal (total weight 0)
    scores 0.5. Returns the mean over groups. Pairs with a NaN outcome are ignored.

    ``ties="reference"`` (default, the released code): a pair with ``r_a == r_b`` counts as "not greater", so
    the score of a PRM that ties everything depends on row order. ``ties="half"``: such a pair scores 0.5 of
    its weight, so an untrained PRM (every reward exactly 0, PRIME's step 1) reads exactly 0.5 — the
    starting point of PRIME Figure 5. The trainers log ``ties="half"``.

    Args:
        sequence_rewards: ``(B,)`` implicit rewards ``r(y)`` (e.g. summed token rewards).
        outcome_rewards: ``(B,)`` outcomes.
        num_generations: Contiguous group size (or ``group_ids``).
        ties: ``"reference"`` | ``"half"`` (see above).

    Returns:
        Python float in [0, 1] (``nan`` for an empty batch).

    Raises:
        ValueError: on shape mismatch or grouping errors.

    Source: released PRIME ``compute_dpo_accuracy``; PRIME §5.1 / Figure 5 (PRM accuracy).
    """
    check_choice(ties, PAIR_ACCURACY_TIES, "ties")
    _check_tensor("sequence_rewards", sequence_rewards)
    if sequence_rewards.dim() != 1:
        raise ValueError(f"`sequence_rewards` must have shape (B,), got {tuple(sequence_rewards.shape)}.")
    B = sequence_rewards.shape[0]
    _check_rows("outcome_rewards", outcome_rewards, B)
    dev = sequence_rewards.device
    gid, G, _ = _group_index(group_ids, num_generations, B, dev, fn="prm_pair_accuracy")
    if G == 0:
        return float("nan")
    r = sequence_rewards.detach().to(torch.float64)
    o = outcome_rewards.detach().to(device=dev, dtype=torch.float64)
    valid = ~torch.isnan(o)
    idx = torch.arange(B, device=dev)
    pair = (gid[:, None] == gid[None, :]) & (idx[:, None] < idx[None, :]) & valid[:, None] & valid[None, :]
    ds = r[:, None] - r[None, :]
    da = torch.where(pair, o[:, None] - o[None, :], torch.zeros((), dtype=o.dtype, device=dev))
    w = da.abs()
    correct = ((ds > 0) == (da > 0)).to(o.dtype)
    if ties == "half":
        correct = torch.where(ds == 0, torch.full_like(correct, 0.5), correct)
    correct = correct * w
    row_g = gid[:, None].expand(B, B)[pair]
    num = torch.zeros(G, dtype=o.dtype, device=dev).index_add(0, row_g, correct[pair])
    den = torch.zeros(G, dtype=o.dtype, device=dev).index_add(0, row_g, w[pair])
    acc = torch.where(den > 0, num / den.clamp(min=1e-300), torch.full_like(den, 0.5))
    return float(acc.mean().item())


def prm_abs_accuracy(sequence_rewards: torch.Tensor, outcome_rewards: torch.Tensor) -> float:
    """Absolute PRM accuracy (``prm/abs_accuracy``): ``mean[sign(r) == sign(2*o - 1)]``, with ``sign(0) = 0``.

    So an outcome of exactly 0.5 only matches a reward of exactly 0. Rows with a NaN outcome are excluded.

    Returns:
        Python float (``nan`` if no row is scorable).

    Raises:
        ValueError: on shape mismatch.

    Source: released PRIME ``compute_dpo_abs_accuracy``.
    """
    _check_tensor("sequence_rewards", sequence_rewards)
    if sequence_rewards.dim() != 1:
        raise ValueError(f"`sequence_rewards` must have shape (B,), got {tuple(sequence_rewards.shape)}.")
    _check_rows("outcome_rewards", outcome_rewards, sequence_rewards.shape[0])
    r = sequence_rewards.detach().to(torch.float64)
    o = outcome_rewards.detach().to(device=r.device, dtype=torch.float64)
    valid = ~torch.isnan(o)
    if not bool(valid.any()):
        return float("nan")
    hit = torch.sign(r) == torch.sign(2 * o - 1)
    return float(hit[valid].to(torch.float64).mean().item())


#: group_rank: a reward within this fraction of its group's spread (``rtol * (max - min)``) of the mean ties it
_LABEL_TIE_RTOL = 1e-6


#: identity: a reward this close outside [0, 1] is float32 rounding of a weighted sum (TRL sums the weighted rewards
#: in float32: weights [0.3, 0.4, 0.1, 0.2] give 1.0000001 when every verifier passes); it is clamped into [0, 1]
_LABEL_RANGE_ATOL = 1e-6


def prm_labels(
    outcome_rewards: torch.Tensor,
    mode: str = "identity",
    *,
    num_generations: int | None = None,
    group_ids: GroupIds | None = None,
    threshold: float = 0.5,
    temperature: float = 1.0,
    min_spread: float = 0.0,
) -> torch.Tensor:
    """The implicit PRM's training labels in ``[0, 1]`` derived from the outcome rewards (``PrimeOptions.prm_label``).

    PRIME trains its implicit PRM with the cross-entropy ``-[l log sigmoid(r(y)) + (1 - l) log(1 - sigmoid(r(y)))]``
    against the outcome label ``l`` (PRIME Eq. 4; the Implicit PRM's CE loss, Sec. 3), so ``l`` lies in ``[0, 1]``.
    The outcome reward keeps its scale for the advantages; only the PRM's label (and the online prompt filter's
    accuracy and the PRM metrics, read from it) comes from this function:

    - ``"identity"``: ``l = r`` (a 0/1 verifier, or a fraction of tests passed). A reward within ``1e-6`` outside
      ``[0, 1]`` (float32 rounding of a weighted sum) is clamped into it; one further outside raises.
    - ``"threshold"``: ``l = 1`` if ``r >= threshold`` else ``0`` (e.g. a reward model's score with a cut-off).
    - ``"sigmoid"``: ``l = sigmoid(r / temperature)``: a soft label, 0.5 at ``r = 0`` (a sequence-classification
      reward model's logit is such a score); ``threshold`` is not used. Not for rewards already in ``[0, 1]``: they
      map into ``[0.5, 0.731]`` (:func:`prm_label_warnings`).
    - ``"group_rank"``: ``l = 1`` above the mean of the row's group (its prompt's ``K`` completions), ``0`` below:
      PRIME's pairwise spirit, invariant to the reward's scale and shift. The group's mean and spread
      (``max - min``) are over its scorable rows with a finite reward; an infinite reward (``+-inf``) is treated as
      unscorable: no label (NaN), and it does not enter its group's mean or spread, so the group's finite rows keep
      their labels. Rows get no label (NaN, excluded from the PRM loss, the filter's accuracy and the metrics) when
      they tie the group's mean (within ``1e-6 * spread``), when their group's spread is 0 (all rewards equal) or
      below ``min_spread`` (a rank inside so small a spread is noise, not a confident 0/1 label), and when they are
      the only finite row of their group. For a 0/1 verifier the labels equal ``"identity"``'s, except in groups
      whose rewards are all equal, which get none.

    NaN rewards (unscorable completions) give NaN labels in every mode.

    Args:
        outcome_rewards: ``(B,)`` float outcome rewards (NaN = unscorable).
        mode: one of :data:`PRM_LABELS`.
        num_generations, group_ids: ``"group_rank"``'s groups: contiguous groups of ``K``, or ``(B,)`` group ids.
        threshold, temperature: ``"threshold"``'s cut-off (finite); ``"sigmoid"``'s temperature (finite, > 0).
        min_spread: ``"group_rank"``'s floor on a group's reward spread, in reward units (finite, >= 0; 0: only
            all-equal groups get no label).

    Returns:
        ``(B,)`` labels in ``[0, 1]`` or NaN, float32 (float64 for float64 rewards), on the rewards' device.

    Raises:
        ValueError: an unknown ``mode``; ``"identity"`` with a scorable reward outside ``[0, 1]`` (the message names
            the range and the other modes); a non-finite ``threshold``; a non-positive or non-finite ``temperature``;
            a negative or non-finite ``min_spread``; ``"group_rank"`` without a grouping, or a grouping error.

    Source: PRIME arXiv 2502.01456 Eq. 4 (CE on the outcome label); Implicit PRM arXiv 2412.01981 Sec. 3.
    """
    check_choice(mode, PRM_LABELS, "prm_label")
    _check_label_args(outcome_rewards, min_spread)
    od = torch.float64 if outcome_rewards.dtype == torch.float64 else torch.float32
    r = outcome_rewards.detach().to(torch.float64)
    options = dict(threshold=threshold, temperature=temperature, min_spread=min_spread)
    labels = _LABEL_MODES[mode](r, group_ids=group_ids, num_generations=num_generations, **options)
    return labels.to(od)


def _check_label_args(outcome_rewards: torch.Tensor, min_spread: float) -> None:
    """:func:`prm_labels`: ``outcome_rewards`` a ``(B,)`` tensor, ``min_spread`` finite and >= 0."""
    _check_tensor("outcome_rewards", outcome_rewards)
    if outcome_rewards.dim() != 1:
        raise ValueError(f"`outcome_rewards` must have shape (B,), got {tuple(outcome_rewards.shape)}.")
    if not (math.isfinite(float(min_spread)) and float(min_spread) >= 0):
        raise ValueError(f"min_spread={min_spread!r} must be a finite number >= 0.")


def _identity_labels(r: torch.Tensor, **_: Any) -> torch.Tensor:
    """``prm_label="identity"``: the reward, clamped into ``[0, 1]`` from within ``1e-6`` of it."""
    scored = r[~torch.isnan(r)]
    if bool(((scored < -_LABEL_RANGE_ATOL) | (scored > 1 + _LABEL_RANGE_ATOL)).any()):
        raise ValueError(
            f"prm_label='identity' uses the outcome reward as the implicit PRM's cross-entropy label, which must "
            f"lie in [0, 1], but the rewards span [{scored.min().item():.4g}, {scored.max().item():.4g}]. Set "
            "prm_label='threshold' (label 1 at reward >= prm_label_threshold), 'sigmoid' (sigmoid(reward / "
            "prm_label_temperature)) or 'group_rank' (1 above the group's mean, 0 below)."
        )
    return r.clamp(0.0, 1.0)  # NaN stays NaN


def _threshold_labels(r: torch.Tensor, *, threshold: float, **_: Any) -> torch.Tensor:
    """``prm_label="threshold"``: 1 at ``r >= threshold``, else 0; NaN stays NaN."""
    if not math.isfinite(float(threshold)):
        raise ValueError(f"threshold={threshold!r} must be a finite number.")
    return torch.where(~torch.isnan(r), (r >= float(threshold)).to(r.dtype), torch.full_like(r, float("nan")))


def _sigmoid_labels(r: torch.Tensor, *, temperature: float, **_: Any) -> torch.Tensor:
    """``prm_label="sigmoid"``: ``sigmoid(r / temperature)``."""
    if not (math.isfinite(float(temperature)) and float(temperature) > 0):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0.")
    return torch.sigmoid(r / float(temperature))  # NaN stays NaN


def _group_rank_labels(
    r: torch.Tensor, *, group_ids: GroupIds | None, num_generations: int | None, min_spread: float, **_: Any
) -> torch.Tensor:
    """``prm_label="group_rank"``: 1 above the mean of the row's group (finite rows), 0 below, NaN on ties, on
    groups of too small a spread and on non-finite rewards."""
    if group_ids is None and num_generations is None:
        raise ValueError("prm_labels(mode='group_rank') needs `num_generations` (or `group_ids`).")
    gid, G, _ = _group_index(group_ids, num_generations, r.shape[0], r.device, fn="prm_labels")
    finite = torch.isfinite(r)  # +-inf: unscorable here, kept out of the group's statistics
    cnt, spread = _finite_group_spread(r, finite, gid, G)
    mean = (_group_sum(torch.where(finite, r, torch.zeros_like(r)), gid, G) / cnt.clamp(min=1))[gid]
    spread = spread[gid]
    tie = (spread == 0) | (spread < float(min_spread)) | ((r - mean).abs() <= _LABEL_TIE_RTOL * spread)
    return torch.where(finite & ~tie, (r > mean).to(r.dtype), torch.full_like(r, float("nan")))


#: :func:`prm_labels`' modes (:data:`PRM_LABELS`)
_LABEL_MODES = {
    "identity": _identity_labels,
    "threshold": _threshold_labels,
    "sigmoid": _sigmoid_labels,
    "group_rank": _group_rank_labels,
}


def _finite_group_spread(r: torch.Tensor, finite: torch.Tensor, gid: torch.Tensor, G: int):
    """``(count (G,), spread (G,))``: each group's number of finite rewards and ``max - min`` over them (0 for a group
    with none), float64."""
    cnt = _group_sum(finite.to(r.dtype), gid, G)
    inf = torch.full_like(r, float("inf"))
    gmax = torch.full((G,), -float("inf"), dtype=r.dtype, device=r.device)
    gmax = gmax.scatter_reduce(0, gid, torch.where(finite, r, -inf), reduce="amax", include_self=True)
    gmin = torch.full((G,), float("inf"), dtype=r.dtype, device=r.device)
    gmin = gmin.scatter_reduce(0, gid, torch.where(finite, r, inf), reduce="amin", include_self=True)
    return cnt, torch.where(cnt > 0, gmax - gmin, torch.zeros_like(gmax))


def prm_label_warnings(
    outcome_rewards: torch.Tensor,
    mode: str,
    *,
    num_generations: int | None = None,
    group_ids: GroupIds | None = None,
    threshold: float = 0.5,
    min_spread: float = 0.0,
) -> dict[str, str]:
    """The ways ``prm_label`` silently changes PRIME's method on one batch of outcome rewards: ``{kind: message}``
    (empty when there is none). The trainer warns once per run per kind; the messages name the config fields
    (``prm_label``, ``prm_label_threshold``, ``prm_label_min_spread``) and the fix.

    Kinds (over the batch's scorable rows with a finite reward):

    - ``"sigmoid_unit_rewards"`` (``mode="sigmoid"``, every reward in ``[0, 1]``): the labels are
      ``sigmoid(r / T)``, 0.5 for a reward of 0 at any temperature ``T`` and at most 0.731 at ``T = 1``: at ``T = 1``
      every group's mean label lies in ``[0.5, 0.731]``, inside the default online filter ``[0.2, 0.8]``, so the
      filter keeps every group (it is effectively off; at any ``T`` it keeps the groups whose completions are all
      wrong), and the PRM is taught that a wrong completion is a coin flip.
    - ``"threshold_one_class"`` (``mode="threshold"``, at least two rows whose rewards differ, all on one side of
      ``threshold``): every label is 0 (or every label 1), the filter drops every group, the PRM sees one class.
    - ``"group_rank_low_spread"`` (``mode="group_rank"``, ``min_spread > 0``): groups with at least two finite rewards
      whose spread is above 0 but below ``min_spread``; :func:`prm_labels` gives their rows no label.

    Args:
        outcome_rewards: ``(B,)`` float outcome rewards (NaN = unscorable).
        mode: one of :data:`PRM_LABELS`.
        num_generations: group size ``K`` for contiguous groups (``"group_rank"``; or pass ``group_ids``).
        group_ids: ``(B,)`` group ids instead of ``num_generations`` (``"group_rank"``).
        threshold: ``"threshold"``'s cut-off.
        min_spread: ``"group_rank"``'s floor on a group's spread (as in :func:`prm_labels`).

    Returns:
        ``dict`` from kind to message; no kind when ``mode`` is ``"identity"``.

    Raises:
        ValueError: an unknown ``mode``; ``outcome_rewards`` not ``(B,)``; ``"group_rank"`` without a grouping.
    """
    check_choice(mode, PRM_LABELS, "prm_label")
    _check_tensor("outcome_rewards", outcome_rewards)
    if outcome_rewards.dim() != 1:
        raise ValueError(f"`outcome_rewards` must have shape (B,), got {tuple(outcome_rewards.shape)}.")
    r = outcome_rewards.detach().to(torch.float64)
    finite = torch.isfinite(r)
    scored = r[finite]
    key, message = None, None
    if mode == "sigmoid":
        key, message = "sigmoid_unit_rewards", _sigmoid_unit_warning(scored)
    elif mode == "threshold":
        key, message = "threshold_one_class", _threshold_one_class_warning(scored, threshold)
    elif mode == "group_rank" and float(min_spread) > 0:
        key = "group_rank_low_spread"
        message = _group_rank_low_spread_warning(r, finite, group_ids, num_generations, min_spread)
    return {key: message} if message is not None else {}


def _sigmoid_unit_warning(scored: torch.Tensor) -> str | None:
    """:func:`prm_label_warnings`' ``"sigmoid_unit_rewards"``: ``prm_label="sigmoid"`` on rewards in ``[0, 1]``."""
    if scored.numel() > 0 and bool(((scored >= 0) & (scored <= 1)).all()):
        return (
            "prm_label='sigmoid' on outcome rewards already in [0, 1] (this batch: "
            f"[{scored.min().item():.3g}, {scored.max().item():.3g}]): the PRM's labels sigmoid(r / "
            "prm_label_temperature) are 0.5 for a reward of 0 at any temperature, and 0.5 to 0.731 at temperature "
            "1, where every group's mean label lies inside the default online filter [filter_lower, filter_upper] = "
            "[0.2, 0.8]: the filter keeps every group (it is effectively off; at any temperature it keeps the groups "
            "whose completions are all wrong) and the PRM learns that a wrong completion is a coin flip. Set "
            "prm_label='identity' (a reward in [0, 1] is a label already) or 'threshold'; keep 'sigmoid' only if "
            "the reward is a logit that happened to fall in [0, 1]."
        )
    return None


def _threshold_one_class_warning(scored: torch.Tensor, threshold: float) -> str | None:
    """:func:`prm_label_warnings`' ``"threshold_one_class"``: a threshold outside the differing rewards' range."""
    if scored.numel() >= 2 and scored.max() > scored.min():
        above = scored >= float(threshold)
        if bool(above.all()) or not bool(above.any()):
            side = "1 (every reward >= it)" if bool(above.all()) else "0 (every reward below it)"
            return (
                f"prm_label='threshold' labelled every scorable row of this batch {side}: prm_label_threshold="
                f"{float(threshold):g} lies outside the rewards' range [{scored.min().item():.3g}, "
                f"{scored.max().item():.3g}], so the online filter drops every group and the PRM sees one class "
                "although the rewards differ. Set prm_label_threshold inside the rewards' range (e.g. their median), "
                "or use prm_label='group_rank' (scale-free: 1 above the group's mean, 0 below)."
            )
    return None


def _group_rank_low_spread_warning(
    r: torch.Tensor,
    finite: torch.Tensor,
    group_ids: GroupIds | None,
    num_generations: int | None,
    min_spread: float,
) -> str | None:
    """:func:`prm_label_warnings`' ``"group_rank_low_spread"``: groups whose spread is below ``min_spread``."""
    if group_ids is None and num_generations is None:
        raise ValueError("prm_label_warnings(mode='group_rank') needs `num_generations` (or `group_ids`).")
    gid, G, _ = _group_index(group_ids, num_generations, r.shape[0], r.device, fn="prm_label_warnings")
    cnt, spread = _finite_group_spread(r, finite, gid, G)
    low = (cnt >= 2) & (spread > 0) & (spread < float(min_spread))
    if bool(low.any()):
        worst = spread[low].min().item()
        return (
            f"prm_label='group_rank': {int(low.sum())} of {G} groups of this batch have outcome rewards spanning "
            f"less than prm_label_min_spread={float(min_spread):g} (smallest spread {worst:.3g}); ranking "
            "inside so small a spread would turn noise into confident 0/1 labels, so their rows get no PRM label "
            "(excluded from the PRM loss, the online filter and the PRM metrics). If differences that small are "
            "signal in your reward, lower prm_label_min_spread (0: label every group whose rewards are not all "
            "equal)."
        )
    return None
