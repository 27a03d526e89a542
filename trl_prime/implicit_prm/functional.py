# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""Pure tensor functions of the implicit PRM (Implicit PRM arXiv 2412.01981; PRIME arXiv 2502.01456 Eq. 3):
token log-probs, implicit token rewards, the CE / DPO / KTO / NCA losses, step rewards and step segmentation.

Re-exported by :mod:`trl_prime.functional` (conventions there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from trl_prime.ops import (
    GroupIds,
    _as_bool_mask,
    _as_int,
    _check_2d,
    _check_rows,
    _check_same_shape,
    _check_tensor,
    _group_index,
    _work_dtype,
    last_token_mask,
)
from trl_prime.options import PRL_STEP_SPLITS, PRM_LOSSES, STEP_AGGREGATIONS, check_choice


__all__ = [
    "implicit_token_rewards",
    "token_logps",
    "sequence_logps",
    "implicit_prm_loss",
    "class_balanced_weights",
    "step_rewards",
    "aggregate_step_rewards",
    "split_steps",
    "join_steps",
    "step_end_mask",
]


def implicit_token_rewards(
    prm_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    beta: float = 0.05,
    include_last_token: bool = True,
) -> torch.Tensor:
    """Implicit process reward of every token: ``r_t = beta * (log pi_phi(y_t) - log pi_ref(y_t)) * mask_t``.

    Args:
        prm_logps: ``(B, T)`` log-probs (nats) of the sampled tokens under the implicit PRM ``pi_phi``.
        ref_logps: ``(B, T)`` log-probs under the reference ``pi_ref``; ``None`` gives the "without
            reference" score ``beta * log pi_phi`` (Implicit PRM best-of-N ablation).
        mask: ``(B, T)`` bool/0-1 completion mask.
        beta: Scale of the log-ratio (default 0.05).
        include_last_token: If False, the last valid token of each row gets reward 0 (released veRL PRIME
            behaviour; a length-1 completion then gets no process reward).

    Returns:
        ``(B, T)`` rewards in the dtype of ``prm_logps``; 0 outside ``mask``; keeps the autograd graph.
        Exactly 0 everywhere when ``prm_logps == ref_logps``.

    Raises:
        ValueError: on mismatched shapes or a non 0/1 mask.

    Source: PRIME Eq. 3; Implicit PRM §3 (Proposition 3.1: ``q_t = sum_{i<=t} r_i``).
    """
    _check_2d("prm_logps", prm_logps)
    _check_same_shape("prm_logps", prm_logps, "mask", mask)
    if ref_logps is not None:
        _check_same_shape("prm_logps", prm_logps, "ref_logps", ref_logps)
    m = _as_bool_mask("mask", mask)
    if not include_last_token:
        m = m & ~last_token_mask(m)
    diff = prm_logps if ref_logps is None else prm_logps - ref_logps
    r = beta * diff
    return torch.where(m, r, torch.zeros_like(r))


def token_logps(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    chunk_size: int = 1024,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token log-probabilities ``log softmax(logits)[ids]`` without materialising (B, T, V) log-softmax.

    Rows of the flattened ``(B*T, V)`` logits are processed in chunks of ``chunk_size``: gather the chosen
    logit and subtract ``logsumexp`` (computed in float32 for half-precision logits), so peak extra memory
    is ``chunk_size * V`` elements. Differentiable w.r.t. ``logits``. No causal shift is applied.

    Args:
        logits: ``(..., V)`` float logits.
        ids: ``(...)`` integer token ids, shape ``logits.shape[:-1]``.
        chunk_size: Rows per chunk.
        dtype: Output dtype (default: ``logits.dtype``).

    Returns:
        ``(...)`` log-probs (nats).

    Raises:
        ValueError: if ``ids`` does not match ``logits.shape[:-1]`` or ``chunk_size < 1``.

    Source: TRL ``selective_log_softmax`` (memory-saving form).
    """
    _check_tensor("logits", logits)
    _check_tensor("ids", ids)
    if logits.dim() < 1 or ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"`ids` must have shape logits.shape[:-1]={tuple(logits.shape[:-1])}, got {tuple(ids.shape)}."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1.")
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    flat_ids = ids.reshape(-1).long()
    wd = _work_dtype(logits)
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].to(wd)
        sel = chunk.gather(-1, flat_ids[start : start + chunk_size, None]).squeeze(-1)
        out.append(sel - torch.logsumexp(chunk, dim=-1))
    res = torch.cat(out) if out else flat.new_zeros(0, dtype=wd)
    return res.reshape(ids.shape).to(dtype or logits.dtype)


def _check_sequence_inputs(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Validate the shapes and dtypes of :func:`sequence_logps`' tensors; return the bool attention mask."""
    _check_tensor("logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"`logits` must have shape (B, L, V), got {tuple(logits.shape)}.")
    _check_2d("input_ids", input_ids)
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(f"`input_ids` must have shape {tuple(logits.shape[:2])}, got {tuple(input_ids.shape)}.")
    _check_same_shape("input_ids", input_ids, "attention_mask", attention_mask)
    am = _as_bool_mask("attention_mask", attention_mask)
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"`input_ids` must be an integer tensor of token ids, got dtype {input_ids.dtype}.")
    return am


def _prompt_length_tensor(prompt_lengths: torch.Tensor | int, B: int, device: torch.device) -> torch.Tensor:
    """``prompt_lengths`` of :func:`sequence_logps` (one int, ``B`` ints or a ``(B,)`` integer tensor) as a
    ``(B,)`` long tensor on ``device``, checked to be integers >= 0."""
    single = _as_int(prompt_lengths)
    if single is not None:
        pl = torch.full((B,), single, dtype=torch.long, device=device)
    else:
        if not isinstance(prompt_lengths, torch.Tensor):
            if isinstance(prompt_lengths, (str, bytes, dict)) or not hasattr(prompt_lengths, "__iter__"):
                raise ValueError(
                    f"`prompt_lengths` must be one int, a sequence of {B} ints or a ({B},) integer tensor, got "
                    f"{type(prompt_lengths).__name__}."
                )
            values = [_as_int(x) for x in prompt_lengths]
            if any(v is None for v in values):
                raise ValueError(f"`prompt_lengths` must hold integers, got {list(prompt_lengths)!r}.")
            prompt_lengths = torch.tensor(values, dtype=torch.long)
        _check_rows("prompt_lengths", prompt_lengths, B)
        if prompt_lengths.is_floating_point() or prompt_lengths.is_complex() or prompt_lengths.dtype == torch.bool:
            raise ValueError(f"`prompt_lengths` must be integers, got dtype {prompt_lengths.dtype}.")
        pl = prompt_lengths.to(device).long()
    if B and bool((pl < 0).any()):
        raise ValueError(f"`prompt_lengths` must be >= 0, got {pl.tolist()}.")
    return pl


def _check_in_vocabulary(targets: torch.Tensor, m: torch.Tensor, V: int) -> None:
    """Refuse a token id outside ``[0, V)`` at a scored position ``m`` of ``targets`` (``input_ids[:, 1:]``)."""
    out_of_vocab = m & ((targets < 0) | (targets >= V))
    if bool(out_of_vocab.any()):
        row, col = (int(i) for i in torch.nonzero(out_of_vocab)[0].tolist())
        raise ValueError(
            f"`input_ids` holds token id {int(targets[row, col])} at input_ids[{row}, {col + 1}] (a scored completion "
            f"position), outside the vocabulary of the logits (V={V}); the logits and input_ids must come from the "
            f"same model/tokenizer (check for added tokens without resize_token_embeddings, or pad ids such as -100 "
            f"left inside attention_mask)."
        )


def sequence_logps(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor | int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed and mean log-prob of each completion under a causal LM.

    Causal shift: ``logits[:, t-1]`` scores ``input_ids[:, t]``. Only completion tokens count: positions
    ``t >= prompt_lengths[b]`` (the index of the first completion token in ``input_ids``, i.e. the padded
    prompt width for left-padded prompts) with ``attention_mask[b, t] == 1``.

    Args:
        logits: ``(B, L, V)`` logits of the full sequences.
        input_ids: ``(B, L)`` token ids.
        attention_mask: ``(B, L)`` bool/0-1.
        prompt_lengths: ``(B,)`` integer tensor, a sequence of ``B`` ints, or one int (numpy / 0-d tensor
            integers accepted).

    Returns:
        ``(logps_sum (B,), logps_mean (B,))`` in the logits' dtype (log-probs and sums are computed in
        float32 for half-precision logits, then cast back). ``logps_mean`` is 0 for a row with no completion
        token. ``beta * (sum_prm - sum_ref)`` is the Implicit PRM outcome reward ``r(y)``.

    Raises:
        ValueError: on mismatched shapes, negative or non-integer ``prompt_lengths``, or a token id of
            ``input_ids`` outside ``[0, V)`` at a scored (completion) position.

    Source: Implicit PRM §3 (``r(y) = beta log pi_phi(y)/pi_ref(y)``).
    """
    am = _check_sequence_inputs(logits, input_ids, attention_mask)
    B, L = input_ids.shape
    pl = _prompt_length_tensor(prompt_lengths, B, input_ids.device)
    wd = _work_dtype(logits)
    t = torch.arange(1, L, device=input_ids.device).expand(B, L - 1)
    m = am[:, 1:] & (t >= pl[:, None])
    targets = input_ids[:, 1:]
    _check_in_vocabulary(targets, m, logits.shape[-1])
    # ids at unscored positions (prompt, padding) may be anything (e.g. -100): never gathered
    targets = torch.where(m, targets, torch.zeros_like(targets))
    lp = token_logps(logits[:, :-1], targets, dtype=wd)  # (B, L-1), position t-1 -> token t
    lp = torch.where(m, lp, torch.zeros_like(lp))
    s = lp.sum(-1)
    n = m.sum(-1).to(wd)
    return s.to(logits.dtype), (s / n.clamp(min=1)).to(logits.dtype)


def _sequence_rewards_and_labels(
    prm_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`implicit_prm_loss`' inputs checked, in the work dtype: ``(r (B,), labels (B,), rows with a label)``,
    ``r = beta * sum_t (prm - ref)_t * mask_t``."""
    _check_2d("prm_logps", prm_logps)
    _check_same_shape("prm_logps", prm_logps, "ref_logps", ref_logps)
    _check_same_shape("prm_logps", prm_logps, "mask", mask)
    _check_rows("labels", labels, prm_logps.shape[0])
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(prm_logps, ref_logps)
    y = labels.to(device=prm_logps.device, dtype=wd)
    valid = ~torch.isnan(y)
    if bool(((y[valid] < 0) | (y[valid] > 1)).any()):
        raise ValueError("`labels` must lie in [0, 1] (or be NaN for unscorable rows).")
    diff = prm_logps.to(wd) - ref_logps.to(wd)
    r = beta * torch.where(m, diff, torch.zeros_like(diff)).sum(-1)  # (B,)
    return r, y, valid


def implicit_prm_loss(
    prm_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    *,
    beta: float = 0.05,
    loss_type: str = "ce",
    group_ids: GroupIds | None = None,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Implicit PRM loss on outcome labels only, with ``r(y) = beta * sum_t (prm - ref)_t * mask_t``.

    * ``"ce"`` (default): ``mean_b BCE(sigmoid(r_b), label_b)``; labels in [0, 1] (fractional allowed), each
      log term clamped at -100 as ``torch.nn.functional.binary_cross_entropy`` does (computed with
      ``logsigmoid`` for accuracy); with ``row_weights``, ``sum_b w_b BCE_b / sum_b w_b``.
    * ``"dpo"``: mean over every pair (a, b) inside a group with ``label_a > label_b`` of
      ``-logsigmoid(r_a - r_b)``.
    * ``"nca"``: same pairs, ``-logsigmoid(r_a) - 0.5 logsigmoid(-r_a) - 0.5 logsigmoid(-r_b)``.
    * ``"kto"``: unpaired. Desirable rows (label > 0.5) use the reference point ``z_- = max(0, mean r over
      undesirable rows)`` (detached) and the loss ``1 - sigmoid(r - z_-)``; undesirable rows (label < 0.5) use
      ``z_+ = max(0, mean r over desirable rows)`` and ``1 - sigmoid(z_+ - r)``; mean over all those rows.
      Rows with label exactly 0.5 are ignored; an empty side gives a reference point of 0.

    Rows with a NaN label have weight 0 everywhere. With no usable row or pair the loss is 0 (still
    attached to the graph).

    Args:
        prm_logps: ``(B, T)`` per-token log-probs under the PRM (gradients flow into it).
        ref_logps: ``(B, T)`` per-token log-probs under the frozen reference.
        mask: ``(B, T)`` bool/0-1 completion mask. (Summed per-sequence log-probs can be passed as
            ``(B, 1)`` tensors with a mask of ones.)
        labels: ``(B,)`` outcome labels in [0, 1] or NaN.
        beta: Implicit reward scale.
        loss_type: ``"ce"`` | ``"dpo"`` | ``"kto"`` | ``"nca"``.
        group_ids: ``(B,)`` prompt ids for the DPO/NCA pairs; ``None`` = all rows form one group.
        row_weights: ``(B,)`` finite weights >= 0 of the ``"ce"`` rows (:func:`class_balanced_weights`), or None.

    Returns:
        Scalar loss in the dtype of ``prm_logps``.

    Raises:
        ValueError: unknown ``loss_type``, mismatched shapes, labels outside [0, 1], bad ``row_weights``.

    Source: PRIME §3.1 / Algorithm 1 line 8 (CE); Implicit PRM §3-4 (CE, DPO, KTO, NCA instantiations).
    """
    check_choice(loss_type, PRM_LOSSES, "loss_type")
    r, y, valid = _sequence_rewards_and_labels(prm_logps, ref_logps, mask, labels, beta)
    B, zero = r.shape[0], r.sum() * 0.0
    w = _checked_row_weights(row_weights, B, r, loss_type)
    if loss_type == "ce":
        loss = _prm_ce_loss(r, y, valid, zero, w)
    elif loss_type == "kto":
        loss = _prm_kto_loss(r, y, valid, zero)
    else:  # dpo / nca: every (better, worse) pair inside a group
        gid = torch.zeros(B, dtype=torch.long, device=r.device)
        if group_ids is not None:
            gid, _, _ = _group_index(group_ids, None, B, r.device, fn="implicit_prm_loss")
        loss = _prm_pair_loss(r, y, valid, gid, zero, loss_type)
    return loss.to(prm_logps.dtype)


def _checked_row_weights(row_weights, B: int, r: torch.Tensor, loss_type: str) -> torch.Tensor | None:
    if row_weights is None:
        return None
    if loss_type != "ce":
        raise ValueError(f"`row_weights` weight the 'ce' loss only; got loss_type={loss_type!r}.")
    _check_rows("row_weights", row_weights, B)
    w = row_weights.to(device=r.device, dtype=r.dtype)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("`row_weights` must be finite and >= 0.")
    return w


def _prm_ce_loss(
    r: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, zero: torch.Tensor, w: torch.Tensor | None = None
) -> torch.Tensor:
    """Implicit PRM cross-entropy (PRIME §3.1): (weighted) mean over labelled rows of ``BCE(sigmoid(r), y)``, logs
    >= -100."""
    if not bool(valid.any()):
        return zero
    yv = torch.where(valid, y, torch.zeros_like(y))
    logp = F.logsigmoid(r).clamp(min=-100.0)
    log1mp = F.logsigmoid(-r).clamp(min=-100.0)
    per_row = -(yv * logp + (1.0 - yv) * log1mp)
    if w is None:
        return per_row[valid].mean()
    total = w[valid].sum()
    if not bool(total > 0):
        return zero
    return (per_row[valid] * w[valid]).sum() / total


def class_balanced_weights(
    labels: torch.Tensor, *, pos_mass: float | None = None, neg_mass: float | None = None
) -> torch.Tensor:
    """Row weights that give the positive and the negative labels equal total weight in the PRM's cross-entropy.

    ``w_b = l_b / P + (1 - l_b) / N`` with ``P = sum_b l_b`` and ``N = sum_b (1 - l_b)`` over the labelled rows: with
    0/1 labels each positive row weighs ``1/P`` and each negative ``1/N``, so a batch of 1 right in 8 no longer
    teaches the PRM mainly the base rate (most of PRIME's kept groups are 1 right of 8: plain CE first moves every
    sequence reward down). Fractional labels split their weight between the two sides. When either side is empty
    the weights are all 1 (the plain mean). Rows with a NaN label get weight 0.

    Args:
        labels: ``(B,)`` float labels in [0, 1] or NaN.
        pos_mass, neg_mass: ``P`` and ``N`` over the *global* batch (a distributed trainer reduces them over its
            processes); default: those of ``labels``.

    Returns:
        ``(B,)`` float32 weights (for ``implicit_prm_loss(..., row_weights=)``).

    Source: class-balanced cross-entropy (the inverse-frequency weighting of e.g. King & Zeng 2001), applied to the
    implicit PRM's CE objective (PRIME Algorithm 1 line 8); a lever on the online PRM, not part of PRIME itself.
    """
    y = labels.to(torch.float32)
    valid = ~torch.isnan(y)
    yv = torch.where(valid, y, torch.zeros_like(y))
    P = float(yv.sum()) if pos_mass is None else float(pos_mass)
    N = float(torch.where(valid, 1.0 - yv, torch.zeros_like(yv)).sum()) if neg_mass is None else float(neg_mass)
    if P <= 0 or N <= 0:
        return valid.to(torch.float32)
    return torch.where(valid, yv / P + (1.0 - yv) / N, torch.zeros_like(yv))


def _prm_kto_loss(r: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Implicit PRM KTO loss (Implicit PRM §4): unpaired, each side against the other side's detached mean reward."""
    pos = valid & (y > 0.5)
    neg = valid & (y < 0.5)
    rd = r.detach()
    z_neg = (rd[neg].mean() if bool(neg.any()) else rd.new_zeros(())).clamp(min=0)
    z_pos = (rd[pos].mean() if bool(pos.any()) else rd.new_zeros(())).clamp(min=0)
    terms = torch.cat([1.0 - torch.sigmoid(r[pos] - z_neg), 1.0 - torch.sigmoid(z_pos - r[neg])])
    if terms.numel() == 0:
        return zero
    return terms.mean()


def _prm_pair_loss(
    r: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, gid: torch.Tensor, zero: torch.Tensor, loss_type: str
) -> torch.Tensor:
    """Implicit PRM DPO / NCA loss (Implicit PRM §4): mean over every pair (a, b) of a group with ``y_a > y_b``."""
    same = gid[:, None] == gid[None, :]
    yv = torch.where(valid, y, torch.zeros_like(y))
    pairs = same & valid[:, None] & valid[None, :] & (yv[:, None] > yv[None, :])
    if not bool(pairs.any()):
        return zero
    a_idx, b_idx = pairs.nonzero(as_tuple=True)
    ra, rb = r[a_idx], r[b_idx]
    if loss_type == "dpo":
        per_pair = -F.logsigmoid(ra - rb)
    else:  # nca
        per_pair = -F.logsigmoid(ra) - 0.5 * F.logsigmoid(-ra) - 0.5 * F.logsigmoid(-rb)
    return per_pair.mean()


def step_rewards(
    token_rewards: torch.Tensor, step_ends: torch.Tensor, *, cumulative: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step rewards from token rewards: the sum of the token rewards inside each step.

    With ``q_t = sum_{i<=t} r_i`` (the prefix Q-value) and step ends ``e_1 < e_2 < ...`` of a row,
    step k's value is ``q_{e_k} - q_{e_{k-1}}`` (``q_{e_0} := 0``). Tokens after a row's last step end are
    ignored: mark the last valid token as a step end (``step_end_mask`` does).

    Args:
        token_rewards: ``(B, T)`` token rewards (0 outside the completion, as
            :func:`implicit_token_rewards` returns).
        step_ends: ``(B, T)`` bool/0-1 mask of the tokens that end a step.
        cumulative: If True return the prefix Q-values ``q_{e_k}`` instead of their differences.

    Returns:
        ``(step_values (B, S), step_mask (B, S) bool)`` with ``S`` the largest number of steps in the batch;
        padded steps hold 0. Differentiable w.r.t. ``token_rewards``.

    Raises:
        ValueError: on mismatched shapes or a non 0/1 mask.

    Source: Implicit PRM §3 (Proposition 3.1 and ``r^t = q^t - q^{t-1}``).
    """
    _check_2d("token_rewards", token_rewards)
    _check_same_shape("token_rewards", token_rewards, "step_ends", step_ends)
    ends = _as_bool_mask("step_ends", step_ends)
    B, T = token_rewards.shape
    counts = ends.sum(-1)
    S = int(counts.max().item()) if B and T else 0
    q = token_rewards.cumsum(-1) if T else token_rewards
    rank = ends.long().cumsum(-1) - 1
    rows = torch.arange(B, device=q.device)[:, None].expand(B, T)
    flat = (rows * max(S, 1) + rank.clamp(min=0))[ends]
    Q = q.new_zeros(B * max(S, 1)).index_put((flat,), q[ends]).reshape(B, max(S, 1))[:, :S]
    step_mask = torch.arange(S, device=q.device)[None, :] < counts[:, None]
    if cumulative:
        return Q, step_mask
    prev = torch.cat([Q.new_zeros(B, 1), Q[:, :-1]], dim=1) if S else Q
    vals = torch.where(step_mask, Q - prev, torch.zeros_like(Q))
    return vals, step_mask


def aggregate_step_rewards(step_values: torch.Tensor, step_mask: torch.Tensor, *, how: str = "min") -> torch.Tensor:
    """Score a response from its step rewards (best-of-N).

    Args:
        step_values: ``(B, S)`` step rewards.
        step_mask: ``(B, S)`` bool/0-1, true on real steps.
        how: ``"min"`` (default, Implicit PRM best-of-N), ``"mean"``, ``"sum"`` or ``"last"``.

    Returns:
        ``(B,)`` scores in the input dtype; 0 for a row without steps.

    Raises:
        ValueError: on an unknown ``how`` or mismatched shapes.

    Source: Implicit PRM §4 (best-of-N with the minimum step reward).
    """
    check_choice(how, STEP_AGGREGATIONS, "how")
    _check_2d("step_values", step_values)
    _check_same_shape("step_values", step_values, "step_mask", step_mask)
    m = _as_bool_mask("step_mask", step_mask)
    has = m.any(-1)
    zero = torch.zeros_like(step_values)
    if how == "sum":
        return torch.where(m, step_values, zero).sum(-1)
    if how == "mean":
        return torch.where(m, step_values, zero).sum(-1) / m.sum(-1).clamp(min=1).to(step_values.dtype)
    if how == "min":
        big = torch.full_like(step_values, float("inf"))
        if step_values.shape[1] == 0:
            return step_values.new_zeros(m.shape[0])
        out = torch.where(m, step_values, big).min(-1).values
        return torch.where(has, out, torch.zeros_like(out))
    # last
    last = last_token_mask(m)
    return torch.where(last, step_values, zero).sum(-1)


def split_steps(text: str, *, delimiter: str = "\n\n") -> list[str]:
    """Split a response into reasoning steps.

    ``[s.strip() for s in text.strip().split(delimiter) if s.strip()]``, or ``[text.strip()]`` if that is
    empty (exactly what PROF's released step-PRM scoring does before joining steps with ``<extra_0>``).

    Raises:
        ValueError: if ``delimiter`` is empty.

    Source: PROF released code (``prof_dp_rm.compute_prm_step_rewards``); Implicit PRM §3 steps.
    """
    if not delimiter:
        raise ValueError("`delimiter` must be a non-empty string.")
    steps = [s.strip() for s in text.strip().split(delimiter) if s.strip()]
    return steps or [text.strip()]


def join_steps(steps: Sequence[str], *, separator: str = "<extra_0>") -> str:
    """Join steps for a token-classification step PRM: ``separator.join(steps) + separator``.

    Source: PROF released code / Qwen2.5-Math-PRM usage (a separator after every step).
    """
    return separator.join(steps) + separator


def _step_cuts(text: str, delim: str) -> list[int]:
    """Character offsets (the delimiter's last character) where :func:`split_steps`' steps end.

    Delimiter occurrences are non-overlapping, left to right. An occurrence ends a step only when non-whitespace
    text precedes it since the previous step end; occurrences separated by whitespace only extend the pending
    step end to the later one (a run collapses); a pending end followed by whitespace only is dropped (the last
    token ends that step).
    """
    cuts: list[int] = []
    pending = None  # offset of the last delimiter of the current run
    seg_start = 0
    start = text.find(delim)
    while start != -1:
        if text[seg_start:start].strip():  # a non-empty step precedes this delimiter
            if pending is not None:
                cuts.append(pending)
            pending = start + len(delim) - 1
        elif pending is not None:  # only whitespace since the previous delimiter: the run goes on
            pending = start + len(delim) - 1
        seg_start = start + len(delim)
        start = text.find(delim, seg_start)
    if pending is not None and text[seg_start:].strip():
        cuts.append(pending)
    return cuts


def _positive_step_len(step_len: Any) -> int | None:
    """``step_len`` of :func:`step_end_mask` as an int (``None`` stays ``None``); refused unless a positive int."""
    if step_len is None:
        return None
    k = _as_int(step_len)
    if k is None or k < 1:
        raise ValueError(f"step_len={step_len!r} must be a positive int.")
    return k


def _length_step_ends(m: torch.Tensor, step_len: int | None) -> torch.Tensor:
    """Every ``step_len``-th valid token (positions with ``(t+1) % step_len == 0``) of the bool mask ``m``."""
    if step_len is None:
        raise ValueError('split="length" needs `step_len` (e.g. step_len=256).')
    B, T = m.shape
    pos = torch.arange(T, device=m.device).expand(B, T)
    return ((pos + 1) % step_len == 0) & m


def _text_delimiter(split: str, tokenizer: Any, delimiter: str | None) -> str:
    """The delimiter of a text split of :func:`step_end_mask` (``"\\n\\n"`` / ``"\\n"`` unless ``delimiter``); a
    text split needs a ``tokenizer``."""
    if tokenizer is None:
        raise ValueError(f'split="{split}" finds delimiters in decoded text and needs a `tokenizer`.')
    delim = delimiter if delimiter is not None else ("\n\n" if split == "double_newline" else "\n")
    if not delim:
        raise ValueError("`delimiter` must be a non-empty string.")
    return delim


def step_end_mask(
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    tokenizer: Any = None,
    *,
    split: str = "double_newline",
    step_len: int | None = None,
    delimiter: str | None = None,
) -> torch.Tensor:
    """Which completion tokens end a reasoning step; the last valid token always ends one.

    * ``"double_newline"`` / ``"newline"``: a delimiter (``"\\n\\n"`` / ``"\\n"``, or ``delimiter``) is found
      in the decoded text; the token holding the delimiter's last character ends the step. Character
      offsets come from decoding each token id, so this is robust to how the tokenizer merges the
      delimiter (``".\\n\\n"`` as one token, ``"\\n"`` + ``"\\n"`` as two, byte-fallback ``<0x0A>``) and to a
      BOS token. Occurrences are non-overlapping, left to right (like ``str.split``). The steps are those of
      :func:`split_steps`: a step end is placed only after a step holding non-whitespace text, so a run of
      delimiters (``"\\n\\n\\n\\n"``, or delimiters separated by whitespace only) collapses into one step end,
      at the run's last delimiter; delimiters before the first non-whitespace text end no step, and a
      delimiter followed by whitespace only ends no step of its own (the last valid token ends it). Special
      tokens (``tokenizer.all_special_ids``: BOS, EOS, chat markers) count as empty text, so ``"b\\n\\n"`` +
      EOS is one step ending at EOS, not a step ``"b\\n\\n"`` and an EOS-only step. No step is empty or
      whitespace-only (except the single step of a row without any other text). This is the one step
      splitter of trl-prime: best-of-N scoring (:meth:`~trl_prime.ImplicitPRM.score`), PRL and PROF use it.
    * ``"length"``: every ``step_len`` tokens (positions with ``(t+1) % step_len == 0``).
    * ``"token"``: every valid token.

    With a text split, a ``step_len`` also ends a step every ``step_len`` tokens (a length cap).

    Args:
        completion_ids: ``(B, T)`` token ids.
        mask: ``(B, T)`` bool/0-1 completion mask (tokens outside it are never step ends).
        tokenizer: A Hugging Face tokenizer (``decode``/``batch_decode``); needed for text splits only.
        split: ``"double_newline"`` | ``"newline"`` | ``"length"`` | ``"token"``.
        step_len: Tokens per step for ``"length"`` (required there).
        delimiter: Custom delimiter string for text splits.

    Returns:
        ``(B, T)`` bool tensor on ``completion_ids``' device.

    Raises:
        ValueError: on an unknown ``split``, a missing tokenizer/``step_len``, or mismatched shapes.

    Source: PRL §3 segmentation (length / newline), Implicit PRM / PRIME step delimiters (Implicit PRM §3).
    """
    check_choice(split, PRL_STEP_SPLITS, "split")
    _check_2d("completion_ids", completion_ids)
    _check_same_shape("completion_ids", completion_ids, "mask", mask)
    m = _as_bool_mask("mask", mask)
    step_len = _positive_step_len(step_len)
    if split == "token":
        return m.clone()
    ends = last_token_mask(m)
    if split == "length" or step_len is not None:
        ends = ends | _length_step_ends(m, step_len)
    if split == "length":
        return ends
    delim = _text_delimiter(split, tokenizer, delimiter)
    return ends | (_delimiter_step_ends(completion_ids, m, tokenizer, delim).to(m.device) & m)


def _token_texts(tokenizer: Any, ids: list[int]) -> dict[int, str]:
    """The decoded text of each token id in ``ids``; special tokens (``all_special_ids``) decode to ``""``."""
    if not ids:
        return {}
    if hasattr(tokenizer, "batch_decode"):
        pieces = tokenizer.batch_decode([[i] for i in ids])
    else:
        pieces = [tokenizer.decode([i]) for i in ids]
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    # special tokens (BOS, EOS, pad, chat markers) hold no step text: "b\n\n<EOS>" ends "b"'s step at EOS
    return {i: ("" if i in special else p) for i, p in zip(ids, pieces)}


def _delimiter_step_ends(completion_ids: torch.Tensor, m: torch.Tensor, tokenizer: Any, delim: str) -> torch.Tensor:
    """``(B, T)`` bool CPU mask of the tokens holding the last character of a step-ending ``delim``
    (:func:`_step_cuts` on each row's decoded valid tokens)."""
    B, T = m.shape
    ids_cpu = completion_ids.detach().to("cpu").long()
    m_cpu = m.to("cpu")
    piece_of = _token_texts(tokenizer, torch.unique(ids_cpu[m_cpu]).tolist())
    extra = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):  # one decode bookkeeping pass per row (tokenizer work, not tensor math)
        cols = torch.nonzero(m_cpu[b], as_tuple=True)[0].tolist()
        if not cols:
            continue
        texts = [piece_of[i] for i in ids_cpu[b, cols].tolist()]
        text = "".join(texts)
        if delim not in text:
            continue
        cum = torch.tensor([len(s) for s in texts]).cumsum(0)  # exclusive end offset of each token
        hits = _step_cuts(text, delim)
        if not hits:
            continue
        tok = torch.searchsorted(cum, torch.tensor(hits), right=True).clamp(max=len(cols) - 1)
        extra[b, torch.tensor(cols)[tok]] = True
    return extra
