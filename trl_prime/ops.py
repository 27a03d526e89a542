# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""Shared pure tensor helpers of :mod:`trl_prime.functional`: validation, dtypes, groups, masked statistics,
discounted sums, and the GRPO outcome advantage every method uses.

Conventions (``mask``, groups, NaN outcomes, half precision): :mod:`trl_prime.functional`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from trl_prime.options import SCALE_REWARDS, check_choice


__all__ = [
    "masked_mean",
    "masked_whiten",
    "last_token_mask",
    "discounted_cumsum",
    "process_reward_batch_norm",
    "left_fill_by_next_nonzero",
    "fill_from_step_end",
    "grpo_advantages",
    "single_row_group_mask",
]

GroupIds = torch.Tensor | Sequence[Any]


def _check_tensor(name: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.")


def _check_2d(name: str, x: torch.Tensor) -> None:
    _check_tensor(name, x)
    if x.dim() != 2:
        raise ValueError(f"`{name}` must have shape (B, T), got shape {tuple(x.shape)}.")


def _check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    _check_tensor(name_a, a)
    _check_tensor(name_b, b)
    if a.shape != b.shape:
        raise ValueError(
            f"`{name_a}` and `{name_b}` must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}; "
            f"pass per-token tensors aligned on the same (B, T) completion grid."
        )


def _check_rows(name: str, x: torch.Tensor, batch_size: int) -> None:
    _check_tensor(name, x)
    if x.dim() != 1 or x.shape[0] != batch_size:
        raise ValueError(f"`{name}` must have shape ({batch_size},) (one value per completion), got {tuple(x.shape)}.")


def _as_bool_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Validate a 0/1 or bool mask and return it as bool (never inferred from token values)."""
    _check_tensor(name, mask)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"`{name}` must be a bool or 0/1 tensor, got dtype {mask.dtype}.")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"`{name}` must contain only 0/1 (or be bool); it holds other values.")
    return mask != 0


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/integer inputs, float64 if any input is float64."""
    dt = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def _as_int(value: Any) -> int | None:
    """``value`` as a Python int if it is integral (int, numpy integer, 0-d integer tensor), else None."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if type(value).__name__ == "bool_":  # numpy.bool_
        return None
    if isinstance(value, torch.Tensor) and (value.dim() != 0 or value.is_floating_point() or value.is_complex()):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _hashable_id(g: Any) -> Any:
    """A group id as a dict key: 0-d tensors by value (not identity); other values as they are."""
    if isinstance(g, torch.Tensor):
        if g.dim() != 0:
            raise TypeError(f"unhashable group id of shape {tuple(g.shape)}")
        return g.item()
    return g


def _group_index(
    group_ids: GroupIds | None,
    num_generations: int | None,
    batch_size: int,
    device: torch.device,
    *,
    fn: str,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Map groups to ``(gid (B,) long in [0, G), G, counts (G,) long)``."""
    if group_ids is not None and num_generations is not None:
        raise ValueError(f"{fn}: pass either `group_ids` or `num_generations`, not both.")
    if group_ids is None and num_generations is None:
        raise ValueError(f"{fn}: pass `group_ids` (B,) or `num_generations` to say which completions share a prompt.")
    if group_ids is not None:
        if isinstance(group_ids, torch.Tensor):
            if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
                raise ValueError(
                    f"{fn}: `group_ids` must have shape ({batch_size},) (one id per completion), "
                    f"got {tuple(group_ids.shape)}."
                )
            if group_ids.is_floating_point() or group_ids.is_complex():
                raise ValueError(f"{fn}: `group_ids` must be an integer tensor, got dtype {group_ids.dtype}.")
            _, gid = torch.unique(group_ids.to(device), return_inverse=True)
            gid = gid.long()
        else:
            ids = list(group_ids)
            if len(ids) != batch_size:
                raise ValueError(
                    f"{fn}: `group_ids` must have {batch_size} entries (one per completion), got {len(ids)}."
                )
            first: dict[Any, int] = {}
            try:
                codes = [first.setdefault(_hashable_id(g), len(first)) for g in ids]
            except TypeError:
                bad = next(i for i, g in enumerate(ids) if not _is_hashable_id(g))
                raise ValueError(
                    f"{fn}: `group_ids` entries must be hashable scalars (ints or strings, one per completion), but "
                    f"group_ids[{bad}] is {type(ids[bad]).__name__} {ids[bad]!r}; pass a 1-D integer tensor or a flat "
                    f"list of ints/strings (e.g. the prompt index of each completion)."
                ) from None
            gid = torch.tensor(codes, dtype=torch.long, device=device)
        num_groups = int(gid.max().item()) + 1 if batch_size else 0
    else:
        k = _as_int(num_generations)
        if k is None or k < 1:
            raise ValueError(
                f"{fn}: `num_generations` must be a positive integer (int, numpy integer or 0-d integer tensor), "
                f"got {num_generations!r}."
            )
        num_generations = k
        if batch_size % num_generations != 0:
            raise ValueError(
                f"{fn}: num_generations={num_generations} does not divide the batch size B={batch_size}; "
                f"make B a multiple of num_generations or pass `group_ids` for uneven groups."
            )
        gid = torch.arange(batch_size, device=device) // num_generations
        num_groups = batch_size // num_generations
    counts = torch.bincount(gid, minlength=num_groups)
    return gid, num_groups, counts


def _is_hashable_id(g: Any) -> bool:
    try:
        hash(_hashable_id(g))
        return True
    except TypeError:
        return False


def _group_label(group_ids: GroupIds, row: int) -> Any:
    g = group_ids[row]
    return g.item() if isinstance(g, torch.Tensor) else g


def _group_sum(x: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Differentiable per-group sum of a (B,) tensor."""
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, gid, x)


def _safe_std(var: torch.Tensor) -> torch.Tensor:
    """sqrt with a finite gradient at 0."""
    pos = var > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, var, torch.ones_like(var))), torch.zeros_like(var))


def _group_mean_std(
    x: torch.Tensor, valid: torch.Tensor, gid: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean and unbiased std over ``valid`` rows; groups of < 2 valid rows get mean 0, std 1.

    A group whose valid values are all equal gets exactly that value as its mean and std exactly 0 (no
    rounding noise such as ``mean(0.1, 0.1, 0.1) != 0.1``), so its centred values are exactly 0.
    """
    xv = torch.where(valid, x, torch.zeros_like(x))
    w = valid.to(x.dtype)
    cnt = _group_sum(w, gid, num_groups)
    mean = _group_sum(xv, gid, num_groups) / cnt.clamp(min=1)
    xd = x.detach()
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    gmax = torch.full((num_groups,), -inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, gid, torch.where(valid, xd, -inf), reduce="amax", include_self=True
    )
    gmin = torch.full((num_groups,), inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, gid, torch.where(valid, xd, inf), reduce="amin", include_self=True
    )
    constant = (cnt >= 2) & (gmax == gmin)
    mean = torch.where(constant, mean + (torch.where(constant, gmax, mean.detach()) - mean).detach(), mean)
    centred = torch.where(valid, x - mean[gid], torch.zeros_like(x))
    var = _group_sum(centred * centred, gid, num_groups) / (cnt - 1).clamp(min=1)
    std = _safe_std(var)
    std = torch.where(constant, torch.zeros_like(std), std)
    single = cnt < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], cnt[gid]


def _divide_by_std(num: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """``num / (std + eps)``, and 0 where ``std + eps == 0`` (a constant group with ``eps=0``: no signal)."""
    denom = std + eps
    ok = denom > 0
    return torch.where(ok, num / torch.where(ok, denom, torch.ones_like(denom)), torch.zeros_like(num))


def _scale_mode(scale_rewards: bool | str) -> str:
    """TRL's ``scale_rewards`` as one of :data:`SCALE_REWARDS`: ``True`` is ``"group"``, ``False`` is ``"none"``."""
    if isinstance(scale_rewards, bool):
        return "group" if scale_rewards else "none"
    check_choice(scale_rewards, SCALE_REWARDS, "scale_rewards")
    return scale_rewards


def _batch_mean_std(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and unbiased std of ``x`` over all ``valid`` rows of the batch (one group: the conventions of
    :func:`_group_mean_std`, i.e. std 0 when the valid values are all equal, mean 0 / std 1 with < 2 valid rows)."""
    mean, std, _ = _group_mean_std(x, valid, torch.zeros(x.shape[0], dtype=torch.long, device=x.device), 1)
    return mean, std


def _check_eps(eps: Any) -> None:
    try:
        value = float(eps)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(eps, bool) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0 (it is added to the group std).")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is true.

    Args:
        values: Float tensor of any shape.
        mask: Bool or 0/1 tensor of the same shape.
        dim: Reduce over this dimension only; ``None`` reduces over everything.

    Returns:
        The masked mean (0 where the mask is empty), in ``values``' dtype.

    Raises:
        ValueError: if the shapes differ or the mask is not 0/1.
    """
    _check_same_shape("values", values, "mask", mask)
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(values)
    v = torch.where(m, values.to(wd), torch.zeros((), dtype=wd, device=values.device))
    n = m.to(wd).sum() if dim is None else m.to(wd).sum(dim)
    s = v.sum() if dim is None else v.sum(dim)
    return (s / n.clamp(min=1)).to(_out_dtype(values))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``values`` with the mean and unbiased variance of the masked entries.

    ``(values - mean) * rsqrt(var + eps)`` with ``mean = sum(values*mask)/sum(mask)`` and
    ``var = sum((values-mean)^2*mask)/(sum(mask)-1)`` (Bessel-corrected). As in the PRIME released code
    (veRL ``masked_whiten``) the affine map is applied to every entry; entries outside the mask are not
    zeroed. (The released veRL port adds 1e-8 to the denominator of the mean; the difference is below
    1e-7 relative and not offered as an option.)

    Args:
        values: Float tensor of any shape, usually ``(B, T)`` returns.
        mask: Bool or 0/1 tensor of the same shape; the statistics are taken over it (all rows together).
        shift_mean: If False, add the mean back (only rescale).
        eps: Added to the variance inside the square root.

    Returns:
        Tensor of ``values``' shape and dtype. After whitening, the masked entries have mean 0 and unbiased
        variance ``var/(var+eps)`` (i.e. 1 up to ``eps``).

    Raises:
        ValueError: if shapes differ, the mask is not 0/1, or fewer than 2 entries are masked (the unbiased
            variance is undefined).

    Source: PRIME released code (``core_algos.masked_whiten``), used on the returns of PRIME Eq. 5.
    """
    _check_same_shape("values", values, "mask", mask)
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(values)
    v = values.to(wd)
    w = m.to(wd)
    n = w.sum()
    if float(n) < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 masked entries for an unbiased variance, got {int(float(n))}; "
            f"check `mask` (or skip whitening for this batch)."
        )
    mean = (torch.where(m, v, torch.zeros_like(v))).sum() / n
    centred = torch.where(m, v - mean, torch.zeros_like(v))
    var = (centred * centred).sum() / (n - 1)
    out = (v - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out.to(_out_dtype(values))


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, T)`` tensor that is true only at the last valid position of each row.

    Works for any mask (not only right padding): the last position where ``mask`` is true. Rows with no
    valid token are all False.

    Raises:
        ValueError: if ``mask`` is not 2-D or not 0/1.
    """
    _check_2d("mask", mask)
    m = _as_bool_mask("mask", mask)
    T = m.shape[1]
    if T == 0:
        return m.clone()
    pos = torch.arange(T, device=m.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(dim=1, keepdim=True).values
    return (pos == last) & m


def discounted_cumsum(values: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last dim: ``R_t = sum_{s>=t} gamma^(s-t) x_s``.

    Vectorised (no loop over tokens): ``gamma == 1`` uses a flipped cumsum; otherwise a block-triangular
    matrix product (blocks of 256 tokens, memory O(B*T + 256^2 + (T/256)^2)).

    Args:
        values: ``(..., T)`` float tensor (zero it outside the mask first).
        gamma: Discount in ``[0, 1]``.

    Returns:
        Tensor of the same shape and dtype.

    Raises:
        ValueError: if ``gamma`` is outside ``[0, 1]``.

    Source: the discounted sum of PRIME Eq. 5 (``sum_{s>=t} gamma^(s-t) ...``).
    """
    _check_tensor("values", values)
    if not (0.0 <= float(gamma) <= 1.0):
        raise ValueError(f"gamma={gamma!r} must be in [0, 1].")
    wd = _work_dtype(values)
    x = values.to(wd)
    T = x.shape[-1]
    if T == 0:
        return values.clone()
    if gamma == 1.0:
        out = x.flip(-1).cumsum(-1).flip(-1)
        return out.to(_out_dtype(values))
    block = min(T, 256)
    nb = (T + block - 1) // block
    pad = nb * block - T
    xp = F.pad(x, (0, pad))
    lead = xp.shape[:-1]
    xb = xp.reshape(*lead, nb, block)
    idx = torch.arange(block, device=x.device)
    diff = (idx[:, None] - idx[None, :]).to(wd)  # s - t
    g = torch.tensor(float(gamma), dtype=wd, device=x.device)
    W = torch.where(diff >= 0, torch.pow(g, diff.clamp(min=0)), torch.zeros((), dtype=wd, device=x.device))
    local = xb @ W  # local[..., k, t] = sum_{s>=t in block k} gamma^(s-t) x_s
    bidx = torch.arange(nb, device=x.device)
    bdiff = (bidx[:, None] - bidx[None, :]).to(wd)  # j - k
    Wb = torch.where(
        bdiff >= 0, torch.pow(g, (bdiff * block).clamp(min=0)), torch.zeros((), dtype=wd, device=x.device)
    )
    starts = local[..., 0] @ Wb  # R at the first token of each block
    nxt = torch.cat([starts[..., 1:], torch.zeros_like(starts[..., :1])], dim=-1)  # R at the next block start
    carry_w = torch.pow(g, (block - idx).to(wd))  # gamma^(block - t)
    out = local + nxt[..., None] * carry_w
    out = out.reshape(*lead, nb * block)[..., :T]
    return out.to(_out_dtype(values))


def process_reward_batch_norm(
    token_rewards: torch.Tensor, mask: torch.Tensor | None = None, *, eps: float = 1e-6
) -> torch.Tensor:
    """PRIME's ``batch_norm`` of process rewards: divide by the batch's max |reverse cumulative sum|.

    ``x / (max_{b,t} |sum_{s>=t} x_{b,s}| + eps)`` with ``x`` zeroed outside ``mask``.

    Args:
        token_rewards: ``(B, T)`` token process rewards.
        mask: Optional ``(B, T)`` bool/0-1 mask; entries outside it are set to 0 first.
        eps: Added to the maximum.

    Returns:
        ``(B, T)`` in the input dtype (0 outside the mask).

    Source: PRIME released code (``prime_norm == "batch_norm"``, veRL recipe ``prime_dp_rm.py``).
    """
    _check_2d("token_rewards", token_rewards)
    wd = _work_dtype(token_rewards)
    x = token_rewards.to(wd)
    if mask is not None:
        _check_same_shape("token_rewards", token_rewards, "mask", mask)
        m = _as_bool_mask("mask", mask)
        x = torch.where(m, x, torch.zeros_like(x))
    if x.numel() == 0:
        return x.to(_out_dtype(token_rewards))
    denom = discounted_cumsum(x, 1.0).abs().max() + eps
    return (x / denom).to(_out_dtype(token_rewards))


def left_fill_by_next_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Released PRL fill: every position takes the nearest NON-ZERO value at or to its right (0 if none).

    ``y[i, j] = x[i, k]`` with ``k = min{k >= j : x[i, k] != 0}``. Exact zeros are treated as holes, so a
    legitimate step-end value of exactly 0 is overwritten by the next step's value; the library's default
    is :func:`fill_from_step_end` with an explicit step-end mask. Kept for ``zero_fill_compat=True``.

    Args:
        x: ``(N, M)`` tensor.

    Returns:
        ``(N, M)`` tensor, same dtype.

    Source: PRL released code (``core_algos.left_fill_by_next_nonzero``).
    """
    _check_2d("x", x)
    return fill_from_step_end(x, x != 0)


def fill_from_step_end(values: torch.Tensor, step_ends: torch.Tensor) -> torch.Tensor:
    """Give every position the value at the next step end at or after it (explicit step-end mask).

    ``y[i, j] = values[i, k]`` with ``k = min{k >= j : step_ends[i, k]}``; 0 where no step end follows.
    Unlike :func:`left_fill_by_next_nonzero`, a step-end value of exactly 0 is kept. Differentiable w.r.t.
    ``values``.

    Args:
        values: ``(B, T)`` float tensor.
        step_ends: ``(B, T)`` bool/0-1 mask of step-end positions.

    Returns:
        ``(B, T)`` tensor, same dtype as ``values``.

    Source: PRL Algorithm 1 (segment-level weights), with an explicit step-end mask (a value of exactly 0 is kept).
    """
    _check_2d("values", values)
    _check_same_shape("values", values, "step_ends", step_ends)
    ends = _as_bool_mask("step_ends", step_ends)
    B, T = values.shape
    if T == 0:
        return values.clone()
    pos = torch.arange(T, device=values.device).expand(B, T)
    idx = torch.where(ends, pos, torch.full_like(pos, T))
    nxt = idx.flip(-1).cummin(dim=-1).values.flip(-1)
    gathered = values.gather(1, nxt.clamp(max=T - 1))
    return torch.where(nxt < T, gathered, torch.zeros_like(gathered))


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: GroupIds | None = None,
    *,
    scale_rewards: bool | str = True,
    eps: float = 1e-6,
    num_generations: int | None = None,
    single_row_compat: bool = False,
) -> torch.Tensor:
    """Group-normalised outcome advantage: ``(r_i - mean_g) / (std_g + eps)``.

    ``scale_rewards`` is TRL's (:data:`SCALE_REWARDS`; ``True`` = ``"group"``, ``False`` = ``"none"``): ``"group"``
    divides by the group std, ``"batch"`` by the unbiased std of every scorable reward of the batch (TRL's
    ``scale_rewards="batch"``: the centring stays per group), ``"none"`` only subtracts the group mean. Both
    divisors are ``std + eps`` with ``eps`` this function's (default ``1e-6``, PRL's and veRL's); TRL 1.16 divides by
    ``std + 1e-4``, so a TRL-equal outcome term needs ``eps=1e-4``. With ``"batch"`` and fewer than two scorable rows
    in the batch the batch std is taken as 1 (TRL's is 0 there); such a row is also the only scorable row of its
    group, so its advantage is 0 unless ``single_row_compat=True``, where it is ``r / (1 + eps)``.

    ``std`` is the unbiased (n-1) standard deviation over the group's scorable rows. A group with fewer than two
    scorable rows has no baseline: its row gets advantage 0 (no signal, as in the leave-one-out estimator of
    :func:`rloo_advantages`; :func:`single_row_group_mask` finds these rows). ``single_row_compat=True`` reproduces
    the released veRL ``compute_grpo_outcome_advantage`` instead: such a group uses mean 0 and std 1, so its row
    keeps its raw reward divided by ``1 + eps`` (scaled) or unchanged (``scale_rewards=False``). A group whose
    scorable rewards are all equal gets advantage exactly 0 (also with ``eps=0``, where ``0 / 0`` would be NaN).
    ``scale_rewards=False`` only subtracts the mean. NaN rewards are excluded from the statistics and get
    advantage 0.

    Args:
        rewards: ``(B,)`` per-completion rewards.
        group_ids: ``(B,)`` group ids (any order, any size).
        scale_rewards: ``"group"`` / ``True`` (divide by the group std), ``"batch"`` (by the batch std) or
            ``"none"`` / ``False``.
        eps: Added to the std.
        num_generations: Contiguous groups of this size instead of ``group_ids``.
        single_row_compat: A group with a single scorable row keeps its raw reward (released veRL code) instead
            of advantage 0.

    Returns:
        ``(B,)`` advantages in the dtype of ``rewards``.

    Raises:
        ValueError: on shape mismatch, both/neither grouping given, ``num_generations`` not dividing B, a
            negative/non-finite ``eps`` or an unknown ``scale_rewards``.

    Source: GRPO (DeepSeekMath, Shao et al. 2024) as in veRL ``compute_grpo_outcome_advantage``; PRL §3.3;
    PROF computes it on the kept rows.
    """
    _check_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"`rewards` must have shape (B,), got {tuple(rewards.shape)}.")
    _check_eps(eps)
    scale = _scale_mode(scale_rewards)
    B = rewards.shape[0]
    gid, G, _ = _group_index(group_ids, num_generations, B, rewards.device, fn="grpo_advantages")
    wd = _work_dtype(rewards)
    r = rewards.to(wd)
    valid = ~torch.isnan(r)
    mean, std, cnt = _group_mean_std(r, valid, gid, G)
    adv = r - mean
    if scale == "batch":
        _, std = _batch_mean_std(r, valid)
    if scale != "none":
        adv = _divide_by_std(adv, std, eps)
    usable = valid if single_row_compat else valid & (cnt >= 2)
    adv = torch.where(usable, adv, torch.zeros_like(adv))
    return adv.to(_out_dtype(rewards))


def single_row_group_mask(
    rewards: torch.Tensor,
    group_ids: GroupIds | None = None,
    *,
    num_generations: int | None = None,
) -> torch.Tensor:
    """Rows that are the only scorable row of their group: no baseline, so advantage 0.

    A group with fewer than two scorable (non-NaN) rows has no baseline; :func:`grpo_advantages`,
    :func:`rloo_advantages`, :func:`prime_advantages` (``"rloo"`` and ``"grpo"``) and the outcome advantage of
    :func:`prl_advantages` (``order="advantage_first"``) give its row 0. The trainers log the count of these rows as
    ``guard/single_row_groups``.

    Args:
        rewards: ``(B,)`` outcome rewards (NaN = unscorable, or dropped by a filter).
        group_ids: ``(B,)`` group ids (any order, any size).
        num_generations: Contiguous groups of this size instead of ``group_ids``.

    Returns:
        ``(B,)`` bool, True on each scorable row whose group has no other scorable row.

    Raises:
        ValueError: on shape mismatch, both/neither grouping given, or ``num_generations`` not dividing B.
    """
    _check_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"`rewards` must have shape (B,), got {tuple(rewards.shape)}.")
    B = rewards.shape[0]
    gid, G, _ = _group_index(group_ids, num_generations, B, rewards.device, fn="single_row_group_mask")
    valid = ~torch.isnan(rewards.detach())
    cnt = torch.bincount(gid[valid], minlength=G)
    return valid & (cnt[gid] == 1)
