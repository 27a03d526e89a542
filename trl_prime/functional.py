# Copyright 2025 The trl-prime developers. Licensed under the Apache License, Version 2.0.
"""Pure tensor functions of PRIME, the Implicit PRM, PRL and PROF.

Everything here is a side-effect-free function of tensors: no trainer, no model, no global state (the
only randomness, PROF's ``mode="correct"``, goes through an explicit ``torch.Generator``). Functions work
on any device and floating dtype (half precision inputs are reduced in float32 internally and cast back),
keep the autograd graph of their inputs, and are vectorised over tokens.

Conventions:

* ``B`` completions, ``T`` padded completion length, completions right-padded. ``mask`` is ``(B, T)``
  bool or 0/1 and is 1 on real completion tokens (EOS included). Masks are never inferred from token
  values.
* Groups (completions of one prompt) are given either by ``group_ids`` ``(B,)`` (integer tensor, or any
  sequence of hashables; any order, any group size) or, for contiguous equal groups, by
  ``num_generations``.
* Outcome rewards ``(B,)`` may be ``NaN`` = unscorable: such rows are excluded from every mean, std and
  baseline, get advantage 0 and loss weight 0.
* Values at padded positions are unspecified by the papers; the advantage functions here return 0 there.

Sources: PRIME (arXiv 2502.01456), Implicit PRM (arXiv 2412.01981), PRL (arXiv 2601.10201), PROF
(arXiv 2509.03403). Where the authors' released code differs from the paper, the paper is the default
and the released behaviour is a named option.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


__all__ = [
    # implicit PRM
    "implicit_token_rewards",
    "token_logps",
    "sequence_logps",
    "implicit_prm_loss",
    "step_rewards",
    "aggregate_step_rewards",
    "split_steps",
    "join_steps",
    "step_end_mask",
    # generic helpers
    "masked_mean",
    "masked_whiten",
    "last_token_mask",
    "discounted_cumsum",
    "process_reward_batch_norm",
    "left_fill_by_next_nonzero",
    "fill_from_step_end",
    # advantages
    "rloo_advantages",
    "grpo_advantages",
    "prime_advantages",
    "single_row_group_mask",
    # PPO: GAE, value loss, the implicit PRM as value
    "ppo_token_rewards",
    "implicit_prm_values",
    "gae_advantages",
    "clipped_value_loss",
    "explained_variance",
    # policy loss
    "token_ppo_clip_loss",
    # PRIME metrics and filter
    "prompt_accuracy_mask",
    "prm_pair_accuracy",
    "prm_abs_accuracy",
    "prm_labels",
    "prm_label_warnings",
    # PRL
    "prl_advantages",
    # PROF
    "prof_step_scores_from_logits",
    "prof_step_scores_from_implicit",
    "prof_consistency_scores",
    "prof_select",
    # options: the allowed values of every string option, and their check
    "check_choice",
    "PRM_LOSSES",
    "PAIRWISE_PRM_LOSSES",
    "PRM_UPDATES",
    "PRM_REFERENCES",
    "PRM_SCHEDULERS",
    "ESTIMATORS",
    "PRIME_VALUES",
    "BASELINES",
    "PROCESS_REWARD_NORMS",
    "GRPO_PROCESS_FORMS",
    "GRPO_PROCESS_SCALES",
    "GROUP_SCALE_REWARDS",
    "SCALE_REWARDS",
    "PRM_LABELS",
    "SEQUENCE_LEVEL_LOSS_TYPES",
    "STEP_AGGREGATIONS",
    "PRL_STEP_SPLITS",
    "PRL_ORDERS",
    "PROF_SELECT_MODES",
    "PROF_MODES",
    "PROF_PENALTY_POSITIONS",
    "PROF_ROUNDINGS",
    "PROF_CENTERS",
    "PROF_LOSS_TYPES",
    "PAIR_ACCURACY_TIES",
]

GroupIds = torch.Tensor | Sequence[Any]

# ----------------------------------------------------------------------------------------------------
# option tuples: the one source of the choices every config field and every function here accepts
# ----------------------------------------------------------------------------------------------------

#: implicit PRM losses (Implicit PRM arXiv 2412.01981 Sec. 3; PRIME arXiv 2502.01456 Eq. 4 is "ce"):
#: ``PrimeOptions.prm_loss``, ``ImplicitPRMConfig.loss_type``, :func:`implicit_prm_loss`
PRM_LOSSES = ("ce", "dpo", "kto", "nca")
#: the implicit PRM losses that pair the completions of one prompt (Implicit PRM Sec. 3: DPO, NCA)
PAIRWISE_PRM_LOSSES = ("dpo", "nca")
#: PRIME's PRM update order (PRIME Algorithm 1 vs the released code): ``PrimeOptions.prm_update``
PRM_UPDATES = ("single", "double")
#: reference of the implicit PRM (PRIME Appendix B.1): ``PrimeOptions.prm_reference``
PRM_REFERENCES = ("sft", "policy")
#: ``transformers.get_scheduler`` names offered for the PRM optimizer: ``PrimeOptions.prm_lr_scheduler``
PRM_SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)
#: PRIME advantage estimators (PRIME Eq. 5, Appendix B.3 and Table 4): ``PrimeOptions.prime_estimator``,
#: :func:`prime_advantages` ``estimator``
ESTIMATORS = ("rloo", "grpo", "reinforce", "ppo")
#: what PPO's values come from (PRIME Table 4: a learned value model, or the implicit PRM as value, section 5.4):
#: ``PrimeOptions.prime_value``
PRIME_VALUES = ("critic", "implicit_prm")
#: process-reward baselines (PRIME Eq. 5 vs the released code): ``PrimeOptions.prime_baseline``, ``baseline``
BASELINES = ("paper", "reference")
#: process-reward normalisations (released PRIME code): ``process_reward_norm``
PROCESS_REWARD_NORMS = ("none", "batch_norm")
#: process term of the "grpo" estimator (PRIME Appendix B.3, Eq. 8): ``grpo_process_form``
GRPO_PROCESS_FORMS = ("response", "token")
#: divisor of the "grpo" estimator's process term: ``grpo_process_scale``
GRPO_PROCESS_SCALES = ("process_std", "outcome_std")
#: TRL's ``scale_rewards`` values a group-normalised outcome accepts (GRPO, DeepSeekMath arXiv 2402.03300 Sec. 4.1)
GROUP_SCALE_REWARDS = ("group", "none")
#: every TRL ``scale_rewards`` value (TRL 1.16 ``GRPOConfig``): the divisor of the group-centred outcome is the group
#: std, the std over the batch's scorable rows, or none: :func:`grpo_advantages`, :func:`prime_advantages` ("grpo"),
#: :func:`prl_advantages`, ``PrimeGRPOConfig`` / ``PRLConfig`` ``scale_rewards``
SCALE_REWARDS = ("group", "batch", "none")
#: how the implicit PRM's training label is derived from the outcome reward (PRIME arXiv 2502.01456 Eq. 4 trains
#: on labels in [0, 1]): ``PrimeOptions.prm_label``, :func:`prm_labels` ``mode``
PRM_LABELS = ("identity", "threshold", "sigmoid", "group_rank")
#: scales of the implicit PRM's prefix value as PPO's baseline (PRIME section 5.4): the prefix sum of token rewards
#: (a logit of the PRM's CE) or its sigmoid (a probability of the label): ``PrimeOptions.prime_value_scale``,
#: :func:`implicit_prm_values` ``scale``
IMPLICIT_VALUE_SCALES = ("logit", "prob")
#: TRL ``loss_type`` values that take one advantage per sequence: none of the token-level (B, T) advantages of PRIME
#: (Eq. 5) or PRL (Algorithm 1) fits them
SEQUENCE_LEVEL_LOSS_TYPES = ("luspo", "vespo")
#: aggregations of step rewards into one value (Implicit PRM arXiv 2412.01981 Sec. 4): :func:`aggregate_step_rewards`
STEP_AGGREGATIONS = ("min", "mean", "sum", "last")
#: step segmentations (PRL arXiv 2601.10201 Sec. 4: "length", every 256 tokens): ``PRLConfig.prl_step_split``,
#: :func:`step_end_mask` ``split``
PRL_STEP_SPLITS = ("length", "newline", "double_newline", "token")
#: PRL orders (PRL Algorithm 1 vs the released code's ``prm_adv='prm'``): ``PRLConfig.prl_order``,
#: :func:`prl_advantages` ``order``
PRL_ORDERS = ("advantage_first", "process_first")
#: PROF selection modes (PROF arXiv 2509.03403 Sec. 3: PROF-BOTH, PROF-POS): :func:`prof_select` ``mode``
PROF_SELECT_MODES = ("both", "correct")
#: ``prof_mode`` of the configs: a selection mode, or "off" (no filter)
PROF_MODES = (*PROF_SELECT_MODES, "off")
#: where PROF's step-count penalty enters the critic (PROF Eq. 1): ``prof_penalty_position``, ``penalty_position``
PROF_PENALTY_POSITIONS = ("reference", "paper")
#: rounding of the correct rows removed per prompt (PROF Alg. 1): ``prof_rounding``, ``rounding``
PROF_ROUNDINGS = ("half_even", "half_up", "half_down")
#: PROF consistency centring (paper: "none"; released code: "batch"): ``prof_center``, ``center``
PROF_CENTERS = ("none", "batch")
#: TRL ``loss_type`` values normalised by the kept tokens of the whole generation batch (``num_items_in_batch``), the
#: only ones under which the rows PROF drops do not scale the update: TRL's "grpo", "sapo" and "dr_grpo" count the
#: dropped rows, "bnpo" normalises each micro-batch by its own kept tokens
PROF_LOSS_TYPES = ("dapo", "cispo")
#: tie handling of :func:`prm_pair_accuracy`
PAIR_ACCURACY_TIES = ("reference", "half")

#: grpo_process_scale="outcome_std": a group whose outcome std is at most this times max(1, |group mean|) counts as
#: having equal outcomes (float32 rounding of a weighted reward sum leaves a std around 1e-7, which as a divisor
#: would blow the process term up by 10^7)
_OUTCOME_SPREAD_RTOL = 1e-4


def check_choice(value: Any, choices: Sequence[str], name: str) -> None:
    """Check that option ``name`` holds one of ``choices`` (one of the option tuples above).

    Args:
        value: the option's value.
        choices: the allowed values.
        name: the option's name (a config field or a function argument), named in the message.

    Raises:
        ValueError: ``value`` is not in ``choices``; the message names the field, the value and the allowed choices,
            e.g. ``prime_baseline='loo' is not supported; choose one of 'paper', 'reference'.``
    """
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}.")


# ----------------------------------------------------------------------------------------------------
# validation and dtype helpers (private)
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# generic masked helpers
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# implicit PRM
# ----------------------------------------------------------------------------------------------------


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
    B, L = input_ids.shape
    V = logits.shape[-1]
    single = _as_int(prompt_lengths)
    if single is not None:
        pl = torch.full((B,), single, dtype=torch.long, device=input_ids.device)
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
        pl = prompt_lengths.to(input_ids.device).long()
    if B and bool((pl < 0).any()):
        raise ValueError(f"`prompt_lengths` must be >= 0, got {pl.tolist()}.")
    wd = _work_dtype(logits)
    t = torch.arange(1, L, device=input_ids.device).expand(B, L - 1)
    m = am[:, 1:] & (t >= pl[:, None])
    targets = input_ids[:, 1:]
    out_of_vocab = m & ((targets < 0) | (targets >= V))
    if bool(out_of_vocab.any()):
        row, col = (int(i) for i in torch.nonzero(out_of_vocab)[0].tolist())
        raise ValueError(
            f"`input_ids` holds token id {int(targets[row, col])} at input_ids[{row}, {col + 1}] (a scored completion "
            f"position), outside the vocabulary of the logits (V={V}); the logits and input_ids must come from the "
            f"same model/tokenizer (check for added tokens without resize_token_embeddings, or pad ids such as -100 "
            f"left inside attention_mask)."
        )
    # ids at unscored positions (prompt, padding) may be anything (e.g. -100): never gathered
    targets = torch.where(m, targets, torch.zeros_like(targets))
    lp = token_logps(logits[:, :-1], targets, dtype=wd)  # (B, L-1), position t-1 -> token t
    lp = torch.where(m, lp, torch.zeros_like(lp))
    s = lp.sum(-1)
    n = m.sum(-1).to(wd)
    return s.to(logits.dtype), (s / n.clamp(min=1)).to(logits.dtype)


def implicit_prm_loss(
    prm_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    *,
    beta: float = 0.05,
    loss_type: str = "ce",
    group_ids: GroupIds | None = None,
) -> torch.Tensor:
    """Implicit PRM loss on outcome labels only, with ``r(y) = beta * sum_t (prm - ref)_t * mask_t``.

    * ``"ce"`` (default): ``mean_b BCE(sigmoid(r_b), label_b)``; labels in [0, 1] (fractional allowed), each
      log term clamped at -100 as ``torch.nn.functional.binary_cross_entropy`` does (computed with
      ``logsigmoid`` for accuracy).
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

    Returns:
        Scalar loss in the dtype of ``prm_logps``.

    Raises:
        ValueError: on an unknown ``loss_type``, mismatched shapes or labels outside [0, 1].

    Source: PRIME §3.1 / Algorithm 1 line 8 (CE); Implicit PRM §3-4 (CE, DPO, KTO, NCA instantiations).
    """
    check_choice(loss_type, PRM_LOSSES, "loss_type")
    _check_2d("prm_logps", prm_logps)
    _check_same_shape("prm_logps", prm_logps, "ref_logps", ref_logps)
    _check_same_shape("prm_logps", prm_logps, "mask", mask)
    B = prm_logps.shape[0]
    _check_rows("labels", labels, B)
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(prm_logps, ref_logps)
    y = labels.to(device=prm_logps.device, dtype=wd)
    valid = ~torch.isnan(y)
    if bool(((y[valid] < 0) | (y[valid] > 1)).any()):
        raise ValueError("`labels` must lie in [0, 1] (or be NaN for unscorable rows).")
    diff = prm_logps.to(wd) - ref_logps.to(wd)
    r = beta * torch.where(m, diff, torch.zeros_like(diff)).sum(-1)  # (B,)
    zero = r.sum() * 0.0

    if loss_type == "ce":
        loss = _prm_ce_loss(r, y, valid, zero)
    elif loss_type == "kto":
        loss = _prm_kto_loss(r, y, valid, zero)
    else:  # dpo / nca: every (better, worse) pair inside a group
        if group_ids is None:
            gid = torch.zeros(B, dtype=torch.long, device=r.device)
        else:
            gid, _, _ = _group_index(group_ids, None, B, r.device, fn="implicit_prm_loss")
        loss = _prm_pair_loss(r, y, valid, gid, zero, loss_type)
    return loss.to(prm_logps.dtype)


def _prm_ce_loss(r: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Implicit PRM cross-entropy (PRIME §3.1): mean over labelled rows of ``BCE(sigmoid(r), y)``, logs >= -100."""
    if not bool(valid.any()):
        return zero
    yv = torch.where(valid, y, torch.zeros_like(y))
    logp = F.logsigmoid(r).clamp(min=-100.0)
    log1mp = F.logsigmoid(-r).clamp(min=-100.0)
    per_row = -(yv * logp + (1.0 - yv) * log1mp)
    return per_row[valid].mean()


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
    B, T = m.shape
    if step_len is not None:
        k = _as_int(step_len)
        if k is None or k < 1:
            raise ValueError(f"step_len={step_len!r} must be a positive int.")
        step_len = k
    ends = last_token_mask(m)
    pos = torch.arange(T, device=m.device).expand(B, T)
    if split == "token":
        return m.clone()
    if split == "length" or step_len is not None:
        if step_len is None:
            raise ValueError('split="length" needs `step_len` (e.g. step_len=256).')
        ends = ends | (((pos + 1) % step_len == 0) & m)
    if split == "length":
        return ends
    if tokenizer is None:
        raise ValueError(f'split="{split}" finds delimiters in decoded text and needs a `tokenizer`.')
    delim = delimiter if delimiter is not None else ("\n\n" if split == "double_newline" else "\n")
    if not delim:
        raise ValueError("`delimiter` must be a non-empty string.")
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


# ----------------------------------------------------------------------------------------------------
# advantages (PRIME Eq. 5 and Appendix B.3; GRPO)
# ----------------------------------------------------------------------------------------------------


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


def _rloo_terms(
    P: torch.Tensor,
    rbar: torch.Tensor,
    o: torch.Tensor,
    valid: torch.Tensor,
    gid: torch.Tensor,
    G: int,
    baseline: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RLOO (PRIME Eq. 5): ``(process term (B, T), outcome advantage (B,), usable rows (B,))``."""
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
    P: torch.Tensor,
    rbar: torch.Tensor,
    o: torch.Tensor,
    L: torch.Tensor,
    valid: torch.Tensor,
    gid: torch.Tensor,
    G: int,
    *,
    scale: str,
    eps: float,
    form: str,
    divisor: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO (PRIME Appendix B.3, Eq. 8): ``(process term (B, T), outcome advantage (B,), usable rows (B,))``."""
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
    estimator: str,
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
    """Shared body of :func:`rloo_advantages` and :func:`prime_advantages`: ``(advantages, returns)``, both
    ``(B, T)`` in the dtype of ``process_rewards``. ``fn`` names the public caller in error messages."""
    check_choice(estimator, ESTIMATORS[:3], "estimator")  # "ppo" is prime_advantages' own path (GAE)
    check_choice(baseline, BASELINES, "baseline")
    check_choice(process_reward_norm, PROCESS_REWARD_NORMS, "process_reward_norm")
    check_choice(grpo_process_form, GRPO_PROCESS_FORMS, "grpo_process_form")
    check_choice(grpo_process_scale, GRPO_PROCESS_SCALES, "grpo_process_scale")
    scale = _scale_mode(scale_rewards)
    m = _check_prime_args(
        process_rewards, outcome_rewards, mask, gamma=gamma, outcome_gamma=outcome_gamma, eps=eps, fn=fn
    )
    B, T = process_rewards.shape
    gid, G, counts = _group_index(group_ids, num_generations, B, process_rewards.device, fn=fn)
    if estimator == "rloo":
        _check_rloo_groups(group_ids, gid, counts, fn)

    P, o, valid, last, row_m = _masked_prime_rewards(
        process_rewards, outcome_rewards, m, include_last_token=include_last_token, norm=process_reward_norm
    )
    zero = torch.zeros((), dtype=P.dtype, device=P.device)
    L = m.sum(-1).to(P.dtype)
    rbar = P.sum(-1) / L.clamp(min=1)  # mean token process reward of each completion

    # per-estimator baselines: process term per token, outcome advantage per row
    if estimator == "rloo":
        proc_tok, out_adv, usable = _rloo_terms(P, rbar, o, valid, gid, G, baseline)
    elif estimator == "grpo":
        proc_tok, out_adv, usable = _grpo_terms(
            P, rbar, o, L, valid, gid, G, scale=scale, eps=eps, form=grpo_process_form, divisor=grpo_process_scale
        )
    else:  # reinforce: no baseline
        proc_tok, out_adv, usable = P, o, valid

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

    ``baseline="reference"`` is the released code's ``masked_rloo``: each source is transformed per token to
    ``x * K/(K-1) - sum_j mean(x_j)/(K-1)`` (process source over the completion mask; outcome source over a
    one-token mask at the last valid token, i.e. the true leave-one-out), then multiplied by its coefficient
    and discounted (``gamma`` for process, ``outcome_gamma`` for outcome). Per-completion sums equal the
    paper's, per-token values do not.

    ``whiten=True`` (released code) replaces the advantages by :func:`masked_whiten` of the returns over all
    valid tokens of the batch (unbiased variance, eps ``whiten_eps``). ``process_reward_norm="batch_norm"``
    first divides the process rewards by the batch's max |reverse cumulative sum| + 1e-6.
    ``include_last_token=False`` zeroes the process reward of each completion's last token (released veRL;
    the mask used for ``rbar`` is unchanged).

    Unscorable rows (NaN outcome) are excluded from every baseline and from the whitening statistics and get
    advantage and return 0; so do rows of a group with fewer than 2 scorable rows.

    Args:
        process_rewards: ``(B, T)`` token process rewards (e.g. :func:`implicit_token_rewards`).
        outcome_rewards: ``(B,)`` verifier scores in [0, 1] or NaN.
        mask: ``(B, T)`` bool/0-1 completion mask.
        num_generations: K, for contiguous groups (or pass ``group_ids``).
        process_coef, outcome_coef: Weights of the two sources.
        gamma: Discount of the process return; ``outcome_gamma``: discount of the outcome return.
        baseline: ``"paper"`` | ``"reference"``.
        whiten: Whiten the returns over the batch's valid tokens.
        process_reward_norm: ``"none"`` | ``"batch_norm"``.
        include_last_token: Keep the process reward of the last valid token.
        group_ids: ``(B,)`` group ids (any order, any size >= 2) instead of ``num_generations``.
        whiten_eps: Variance epsilon of the whitening.

    Returns:
        ``(advantages (B, T), returns (B, T))`` in the dtype of ``process_rewards``; 0 outside the mask.

    Raises:
        ValueError: for a group with fewer than 2 completions, ``num_generations`` not dividing B, unknown
            option values, mismatched shapes, or a non-finite (NaN/inf) process reward at a valid position
            (NaN marks an unscorable completion only in ``outcome_rewards``; padded positions may hold anything).

    Source: PRIME Eq. 5 (§3.2); released PRIME / veRL ``compute_rloo_advantage_return``.
    """
    return _prime_advantages_impl(
        process_rewards,
        outcome_rewards,
        mask,
        group_ids,
        num_generations,
        estimator="rloo",
        process_coef=process_coef,
        outcome_coef=outcome_coef,
        gamma=gamma,
        outcome_gamma=outcome_gamma,
        baseline=baseline,
        whiten=whiten,
        process_reward_norm=process_reward_norm,
        include_last_token=include_last_token,
        whiten_eps=whiten_eps,
        fn="rloo_advantages",
    )


_PRIME_OPTIONS = {
    "rloo": {
        "process_coef",
        "outcome_coef",
        "gamma",
        "outcome_gamma",
        "baseline",
        "whiten",
        "process_reward_norm",
        "include_last_token",
        "whiten_eps",
        "num_generations",
    },
    "grpo": {
        "process_coef",
        "outcome_coef",
        "gamma",
        "outcome_gamma",
        "whiten",
        "process_reward_norm",
        "include_last_token",
        "whiten_eps",
        "scale_rewards",
        "eps",
        "grpo_process_form",
        "grpo_process_scale",
        "num_generations",
    },
    "reinforce": {
        "process_coef",
        "outcome_coef",
        "gamma",
        "outcome_gamma",
        "whiten",
        "process_reward_norm",
        "include_last_token",
        "whiten_eps",
        "num_generations",
    },
    "ppo": {"values", "process_coef", "outcome_coef", "gamma", "lam", "whiten", "whiten_eps", "num_generations"},
}


def prime_advantages(
    process_rewards: torch.Tensor,
    outcome_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: GroupIds | None,
    *,
    estimator: str = "rloo",
    **options: Any,
) -> torch.Tensor:
    """PRIME advantages with a choice of estimator (PRIME Eq. 5 and Appendix B.3).

    * ``"rloo"`` (default): :func:`rloo_advantages` (PRIME Eq. 5); options ``process_coef``,
      ``outcome_coef``, ``gamma``, ``outcome_gamma``, ``baseline``, ``whiten``, ``process_reward_norm``,
      ``include_last_token``, ``whiten_eps``.
    * ``"grpo"`` (PRIME Appendix B.3, Eq. 8): group-normalised process and outcome terms. With ``rbar^j`` the mean
      token reward of completion j over its mask of ``L_j`` tokens, and ``mean_g`` / ``std_g`` the group mean /
      unbiased std over the group's K scorable rows, the outcome term is ``(r_o^i - mean_g r_o) / (std_g r_o +
      eps)`` at the last token and the process term, for token t, is chosen by ``grpo_process_form``:

      - ``"token"`` (default): the printed Eq. 8, ``sum_{s>=t} gamma^(s-t) (r_s^i - mean_g rbar) / D``, each token
        reward centred on the group mean of the completions' mean token rewards, summed as Eq. 5 sums it. With the
        default divisor ``D = std_g r_o + eps`` (below) the process term keeps Eq. 5's size relative to the outcome
        term: both are the RLOO-style sums of Eq. 5, centred on the group and divided by one common scale. Worked
        example (K=8, one right completion, L=24 tokens each, a PRM that ranks correctly: +0.03 per token on the
        right completion, -0.03/7 on the others): on a wrong row the process part of ``A_0`` is 0.82 of the outcome
        part, as with the RLOO estimator (Eq. 5).
      - ``"response"``: ``(1/L_i) sum_{s>=t} gamma^(s-t) (r_s^i - mean_g rbar) / D``, the reward-to-go measured in
        whole responses. At ``t=0`` (``gamma=1``) it is ``(rbar^i - mean_g rbar) / D``: with ``D = std_g rbar + eps``
        exactly the group z-score of the completion's mean token reward, so ``|A_0| <= (K-1)/sqrt(K)`` (Samuelson's
        bound for the unbiased std) whatever the completion length. It is ``1/L_i`` of the ``"token"`` form, so next
        to the outcome term (divided by the same ``D``) the process term of a ``L``-token completion weighs ``1/L`` of
        Eq. 5's: in the worked example above, 0.034 of the outcome part instead of 0.82 -- with the outcome's std as
        divisor it makes PRIME-GRPO nearly plain GRPO. Kept as an option for the ``"process_std"`` divisor.

      ``grpo_process_scale`` chooses the divisor of the process term (with ``scale_rewards=True``):

      - ``"outcome_std"`` (default): ``std_g r_o + eps``, the outcome's group std, so both terms share one scale:
        PRIME's total reward (process + outcome) is normalised by the group statistics of the outcome, and the
        process term keeps its size relative to the outcome (as in Eq. 5). A group whose scorable outcomes are all
        equal gets process term 0 as well (no scale to measure it in); so does one whose outcome std is at most
        ``1e-4 * max(1, |mean_g r_o|)`` (outcomes equal up to rounding, e.g. a float32 weighted sum of rewards). The
        process term at token ``t`` is bounded by ``2 (L_i - t) max|r_s| / (std_g r_o + eps)``: the size of Eq. 5's
        process return, and an untrained PRM (rewards ~0) adds ~0.
      - ``"process_std"``: ``std_g rbar + eps``, the process rewards' own group std (PRIME Appendix B.3 normalises
        them by their own group statistics; Eq. 8 as printed). Invariant to the reward scale (``beta``, the PRM's
        sharpness), but it divides by a statistic of whole responses only, which fails in two cases the default
        avoids:

        1. an untrained PRM (rewards of pure noise, around 1e-5) becomes a unit-size z-score per token, summed over
           ``L`` tokens (up to ``L (K-1)/sqrt(K)`` with the ``"token"`` form: about 1,500 at L=1024, K=4), so the
           policy follows PRM noise; with ``"outcome_std"`` such noise stays near 0;
        2. completions whose mean token rewards nearly agree but whose rewards vary inside them (a PRM rewarding
           early tokens and penalising late ones) have a tiny ``std_g rbar``, and the reward-to-go at ``t > 0``
           divided by it explodes (max |A| about 6,600 at L=512 for a +-0.02 two-half profile with 1e-5 noise, RLOO
           about 6 on the same batch).

        With ``"process_std"`` use ``grpo_process_form="response"``, whose ``t=0`` value is bounded by
        ``(K-1)/sqrt(K)``.

      The learning benchmark (``benchmarks/learning.py``) runs ``prime_grpo`` (the defaults) and
      ``prime_grpo_process_std``; ``benchmarks/RESULTS.md`` reports what it measured.

      ``scale_rewards`` (TRL's, :data:`SCALE_REWARDS`; ``True`` = ``"group"``, ``False`` = ``"none"``): ``"group"``
      (default) divides by the group statistics above; ``"batch"`` keeps the centring on the group means but takes
      every divisor over the batch's scorable rows (TRL's ``scale_rewards="batch"``): the outcome term is
      ``(r_o^i - mean_g r_o) / (std_B r_o + eps)``, the process term is divided by ``std_B r_o + eps``
      (``"outcome_std"``; process term 0 when every scorable outcome of the batch is equal) or ``std_B rbar + eps``
      (``"process_std"``), with ``std_B`` the unbiased std over all scorable rows passed (the trainers pass the rows
      the policy trains on: the kept groups); a group whose outcomes are all equal keeps its process term.
      ``"none"`` only centres (no divisor). Every divisor adds ``eps`` (default ``1e-6``; TRL 1.16 adds ``1e-4``);
      with fewer than two scorable rows in the batch ``std_B`` is taken as 1 (TRL's is 0), and those rows, alone
      in their groups, get advantage 0.

      Extra options: ``scale_rewards``, ``eps``, ``grpo_process_form``, ``grpo_process_scale``.
    * ``"reinforce"``: no baseline, ``sum_{s>=t} gamma^(s-t) r_s^i + r_o^i``.
    * ``"ppo"`` (PRIME Table 4): GAE (:func:`gae_advantages`, options ``gamma``, ``lam``, ``whiten``, ``whiten_eps``)
      over the rewards of :func:`ppo_token_rewards` (``process_coef``, ``outcome_coef``) with the ``(B, T)``
      ``values`` option (required): a value model's, or :func:`implicit_prm_values` for the implicit PRM as value.
      No group baseline (``group_ids`` is ignored and may be ``None``); ``outcome_gamma``, ``baseline``,
      ``process_reward_norm`` and ``include_last_token`` do not apply.

    All estimators share the coefficients, discounts, whitening, process-reward normalisation and the NaN
    rule (unscorable rows: excluded, advantage 0). A group with fewer than two scorable rows has no baseline:
    its row gets advantage 0 with ``"rloo"`` and ``"grpo"`` (:func:`single_row_group_mask`). ``"reinforce"`` has
    no baseline for any group by definition and is unchanged: each row keeps its own returns whatever its
    group's size. ``group_ids`` may be ``None`` when ``num_generations`` is passed as an option.

    Args:
        process_rewards: ``(B, T)`` token process rewards.
        outcome_rewards: ``(B,)`` outcome rewards (NaN = unscorable).
        mask: ``(B, T)`` completion mask.
        group_ids: ``(B,)`` prompt ids.
        estimator: ``"rloo"`` | ``"grpo"`` | ``"reinforce"`` | ``"ppo"``.
        **options: Forwarded estimator options (listed above).

    Returns:
        ``(B, T)`` advantages, 0 outside the mask.

    Raises:
        ValueError: on an unknown estimator, an option the estimator does not take or an unknown option value
            (``grpo_process_form`` not in ``("response", "token")``, ``grpo_process_scale`` not in
            ``("process_std", "outcome_std")``), plus the errors of :func:`rloo_advantages`.

    Source: PRIME Eq. 5; PRIME Appendix B.3 (Eqs. 7-8: REINFORCE and GRPO with implicit process rewards).
    """
    check_choice(estimator, ESTIMATORS, "estimator")
    unknown = set(options) - _PRIME_OPTIONS[estimator]
    if unknown:
        raise ValueError(
            f"prime_advantages(estimator={estimator!r}) got unknown option(s) {sorted(unknown)}; "
            f"valid options: {sorted(_PRIME_OPTIONS[estimator])}."
        )
    num_generations = options.pop("num_generations", None)
    if estimator == "ppo":
        return _ppo_advantages(process_rewards, outcome_rewards, mask, **options)
    adv, _ = _prime_advantages_impl(
        process_rewards,
        outcome_rewards,
        mask,
        group_ids,
        num_generations,
        estimator=estimator,
        fn="prime_advantages",
        **options,
    )
    return adv


# ----------------------------------------------------------------------------------------------------
# PPO with a value model (PRIME Table 4, Appendix B.3) and the implicit PRM as value (PRIME section 5.4)
# ----------------------------------------------------------------------------------------------------


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
    _check_2d("rewards", rewards)
    _check_same_shape("rewards", rewards, "values", values)
    _check_same_shape("rewards", rewards, "mask", mask)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"gae_advantages: `{name}`={x!r} must lie in [0, 1].")
    m = _as_bool_mask("mask", mask)
    wd = _work_dtype(rewards, values)
    r, v = rewards.to(wd), values.to(wd)
    ok = ~((~torch.isfinite(r) | ~torch.isfinite(v)) & m).any(-1)  # (B,) rows without a non-finite entry
    keep = m & ok[:, None]
    # the mask positions of each row moved to its front, in order: GAE's recursion runs over consecutive entries
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    kc = torch.gather(keep, 1, order)
    zero = torch.zeros((), dtype=wd, device=r.device)
    rc = torch.where(kc, torch.gather(r, 1, order), zero)
    vc = torch.where(kc, torch.gather(v, 1, order), zero)
    v_next = F.pad(vc[:, 1:], (0, 1))  # 0 after a row's last valid token (terminal) and on the padding
    delta = torch.where(kc, rc + gamma * v_next - vc, zero)
    adv_c = discounted_cumsum(delta, float(gamma) * float(lam))
    adv = torch.zeros_like(adv_c).scatter(1, order, adv_c)
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


# ----------------------------------------------------------------------------------------------------
# PRIME online filter and PRM metrics
# ----------------------------------------------------------------------------------------------------


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
    against the outcome label ``l`` (PRIME arXiv 2502.01456 Eq. 4; the Implicit PRM's CE loss, arXiv 2412.01981
    Sec. 3), so ``l`` must lie in ``[0, 1]``. The outcome reward itself keeps its scale for the advantages (as TRL
    computes them); only the PRM's label (and what is read from it: the online prompt filter's accuracy and the PRM
    metrics) comes from this function:

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
        num_generations: group size ``K`` for contiguous groups (``"group_rank"``; or pass ``group_ids``).
        group_ids: ``(B,)`` group ids instead of ``num_generations`` (``"group_rank"``).
        threshold: ``"threshold"``'s cut-off (any finite number).
        temperature: ``"sigmoid"``'s temperature (finite, > 0).
        min_spread: ``"group_rank"``'s floor on a group's reward spread, in reward units (finite, >= 0; 0: only
            all-equal groups get no label).

    Returns:
        ``(B,)`` labels in ``[0, 1]`` or NaN, float32 (float64 for float64 rewards), on the rewards' device.

    Raises:
        ValueError: an unknown ``mode``; ``"identity"`` with a scorable reward outside ``[0, 1]`` (the message names
            the range and the other modes); a non-finite ``threshold``; a non-positive or non-finite
            ``temperature``; a negative or non-finite ``min_spread``; ``"group_rank"`` without a grouping, or a
            grouping error.

    Source: PRIME arXiv 2502.01456 Eq. 4 (CE on the outcome label); Implicit PRM arXiv 2412.01981 Sec. 3.
    """
    check_choice(mode, PRM_LABELS, "prm_label")
    _check_tensor("outcome_rewards", outcome_rewards)
    if outcome_rewards.dim() != 1:
        raise ValueError(f"`outcome_rewards` must have shape (B,), got {tuple(outcome_rewards.shape)}.")
    if not (math.isfinite(float(min_spread)) and float(min_spread) >= 0):
        raise ValueError(f"min_spread={min_spread!r} must be a finite number >= 0.")
    od = torch.float64 if outcome_rewards.dtype == torch.float64 else torch.float32
    r = outcome_rewards.detach().to(torch.float64)
    valid = ~torch.isnan(r)
    nan = torch.full_like(r, float("nan"))
    if mode == "identity":
        scored = r[valid]
        if bool(((scored < -_LABEL_RANGE_ATOL) | (scored > 1 + _LABEL_RANGE_ATOL)).any()):
            raise ValueError(
                f"prm_label='identity' uses the outcome reward as the implicit PRM's cross-entropy label, which must "
                f"lie in [0, 1], but the rewards span [{scored.min().item():.4g}, {scored.max().item():.4g}]. Set "
                "prm_label='threshold' (label 1 at reward >= prm_label_threshold), 'sigmoid' (sigmoid(reward / "
                "prm_label_temperature)) or 'group_rank' (1 above the group's mean, 0 below)."
            )
        labels = r.clamp(0.0, 1.0)  # NaN stays NaN
    elif mode == "threshold":
        if not math.isfinite(float(threshold)):
            raise ValueError(f"threshold={threshold!r} must be a finite number.")
        labels = torch.where(valid, (r >= float(threshold)).to(r.dtype), nan)
    elif mode == "sigmoid":
        if not (math.isfinite(float(temperature)) and float(temperature) > 0):
            raise ValueError(f"temperature={temperature!r} must be a finite number > 0.")
        labels = torch.sigmoid(r / float(temperature))  # NaN stays NaN
    else:
        if group_ids is None and num_generations is None:
            raise ValueError("prm_labels(mode='group_rank') needs `num_generations` (or `group_ids`).")
        gid, G, _ = _group_index(group_ids, num_generations, r.shape[0], r.device, fn="prm_labels")
        finite = torch.isfinite(r)  # +-inf: unscorable here, kept out of the group's statistics
        cnt, spread = _finite_group_spread(r, finite, gid, G)
        mean = (_group_sum(torch.where(finite, r, torch.zeros_like(r)), gid, G) / cnt.clamp(min=1))[gid]
        spread = spread[gid]
        tie = (spread == 0) | (spread < float(min_spread)) | ((r - mean).abs() <= _LABEL_TIE_RTOL * spread)
        labels = torch.where(finite & ~tie, (r > mean).to(r.dtype), nan)
    return labels.to(od)


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
    out: dict[str, str] = {}
    if mode == "sigmoid" and scored.numel() > 0 and bool(((scored >= 0) & (scored <= 1)).all()):
        out["sigmoid_unit_rewards"] = (
            "prm_label='sigmoid' on outcome rewards already in [0, 1] (this batch: "
            f"[{scored.min().item():.3g}, {scored.max().item():.3g}]): the PRM's labels sigmoid(r / "
            "prm_label_temperature) are 0.5 for a reward of 0 at any temperature, and 0.5 to 0.731 at temperature "
            "1, where every group's mean label lies inside the default online filter [filter_lower, filter_upper] = "
            "[0.2, 0.8]: the filter keeps every group (it is effectively off; at any temperature it keeps the groups "
            "whose completions are all wrong) and the PRM learns that a wrong completion is a coin flip. Set "
            "prm_label='identity' (a reward in [0, 1] is a label already) or 'threshold'; keep 'sigmoid' only if "
            "the reward is a logit that happened to fall in [0, 1]."
        )
    if mode == "threshold" and scored.numel() >= 2 and scored.max() > scored.min():
        above = scored >= float(threshold)
        if bool(above.all()) or not bool(above.any()):
            side = "1 (every reward >= it)" if bool(above.all()) else "0 (every reward below it)"
            out["threshold_one_class"] = (
                f"prm_label='threshold' labelled every scorable row of this batch {side}: prm_label_threshold="
                f"{float(threshold):g} lies outside the rewards' range [{scored.min().item():.3g}, "
                f"{scored.max().item():.3g}], so the online filter drops every group and the PRM sees one class "
                "although the rewards differ. Set prm_label_threshold inside the rewards' range (e.g. their median), "
                "or use prm_label='group_rank' (scale-free: 1 above the group's mean, 0 below)."
            )
    if mode == "group_rank" and float(min_spread) > 0:
        if group_ids is None and num_generations is None:
            raise ValueError("prm_label_warnings(mode='group_rank') needs `num_generations` (or `group_ids`).")
        gid, G, _ = _group_index(group_ids, num_generations, r.shape[0], r.device, fn="prm_label_warnings")
        cnt, spread = _finite_group_spread(r, finite, gid, G)
        low = (cnt >= 2) & (spread > 0) & (spread < float(min_spread))
        if bool(low.any()):
            worst = spread[low].min().item()
            out["group_rank_low_spread"] = (
                f"prm_label='group_rank': {int(low.sum())} of {G} groups of this batch have outcome rewards spanning "
                f"less than prm_label_min_spread={float(min_spread):g} (smallest spread {worst:.3g}); ranking "
                "inside so small a spread would turn noise into confident 0/1 labels, so their rows get no PRM label "
                "(excluded from the PRM loss, the online filter and the PRM metrics). If differences that small are "
                "signal in your reward, lower prm_label_min_spread (0: label every group whose rewards are not all "
                "equal)."
            )
    return out


# ----------------------------------------------------------------------------------------------------
# PRL
# ----------------------------------------------------------------------------------------------------


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

    ``k_t = log pi_old(y_t) - log pi_ref(y_t)`` (detached, 0 outside the mask), ``S_t = sum_{s>=t} k_s``
    (suffix sum including t). ``order="advantage_first"`` (default): ``A`` is the GRPO outcome advantage
    (:func:`grpo_advantages`: group mean, unbiased std, ``eps``; ``scale_rewards="batch"`` divides by the std over
    the batch's scorable rows instead, ``"none"`` / ``False`` subtracts the mean only); ``"process_first"``: ``A``
    is the raw outcome, no normalisation.

    A group with fewer than two scorable rows has no baseline: with ``"advantage_first"`` its row's outcome
    advantage ``A`` is 0 (``single_row_compat=True``: the released code's mean 0, std 1, i.e. the raw outcome
    divided by ``1 + eps``), so its weights are the KL-to-go term ``-S_t / eta`` alone, as for a group whose
    outcomes are all equal. ``"process_first"`` uses no baseline for any group and is unchanged (the released
    code's ``rollout_n == 1`` path: the raw outcome).

    Segmentation: with ``step_ends`` every token takes the value of the step end at or after it; the last
    valid token always ends a step. The fill uses the explicit step-end mask, so a step-end value of exactly
    0 is kept; ``zero_fill_compat=True`` reproduces the released code's ``left_fill_by_next_nonzero`` (an
    exact 0 is overwritten by the next step's value). ``step_ends=None``: every token is its own step. (The
    released code skips segmentation when ``prm_adv="prm"``; pass ``step_ends=None`` to match.)

    Unscorable rows (NaN outcome) get 0.

    Args:
        outcome_rewards: ``(B,)`` outcome rewards (NaN = unscorable).
        old_logps: ``(B, T)`` log-probs of the sampled tokens under the rollout policy.
        ref_logps: ``(B, T)`` log-probs under the frozen reference.
        mask: ``(B, T)`` completion mask.
        group_ids: ``(B,)`` prompt ids (may be None with ``num_generations``, or for ``"process_first"``).
        eta: Inverse KL coefficient (> 0; default 200, paper range 100-300).
        step_ends: Optional ``(B, T)`` bool step-end mask (see :func:`step_end_mask`).
        order: ``"advantage_first"`` | ``"process_first"``.
        scale_rewards, eps: GRPO normalisation options (``scale_rewards``: :data:`SCALE_REWARDS` or a bool).
        zero_fill_compat: Use the released non-zero fill.
        num_generations: Contiguous groups instead of ``group_ids``.
        return_step_end_values: Also return the values at the step ends (0 elsewhere), i.e. the tensor the
            released code fills.
        single_row_compat: ``"advantage_first"``: a group with a single scorable row keeps its raw outcome as
            ``A`` (released code) instead of 0.

    Returns:
        ``(B, T)`` detached weights in the dtype of ``old_logps`` (0 outside the mask); with
        ``return_step_end_values`` a tuple ``(advantages, step_end_values)``.

    Raises:
        ValueError: on ``eta <= 0``, unknown ``order``, shape mismatches or grouping errors.

    Source: PRL Eq. 3.1 (``rho_t = stopgrad(R - (1/eta) sum_{j>=t} k_j)``), §3.3 (GRPO normalisation) and
    Algorithm 1 (segment-level weights); released ``ray_trainer.py`` PRL block.
    """
    check_choice(order, PRL_ORDERS, "order")
    if not (eta > 0):
        raise ValueError(
            f"eta={eta!r} must be > 0 (it is the inverse KL coefficient; use a large eta for a weak KL term)."
        )
    _check_2d("old_logps", old_logps)
    _check_same_shape("old_logps", old_logps, "ref_logps", ref_logps)
    _check_same_shape("old_logps", old_logps, "mask", mask)
    B, T = old_logps.shape
    _check_rows("outcome_rewards", outcome_rewards, B)
    m = _as_bool_mask("mask", mask)
    dev = old_logps.device
    wd = _work_dtype(old_logps, ref_logps, outcome_rewards)
    zero = torch.zeros((), dtype=wd, device=dev)
    o_raw = outcome_rewards.detach().to(device=dev, dtype=wd)
    valid = ~torch.isnan(o_raw)
    A = _prl_outcome_advantage(
        o_raw,
        group_ids,
        order=order,
        scale_rewards=scale_rewards,
        eps=eps,
        num_generations=num_generations,
        single_row_compat=single_row_compat,
    )
    # KL-to-go: k_t = log pi_old - log pi_ref, S_t = sum_{s>=t} k_s (PRL Eq. 3.1)
    k = torch.where(m, (old_logps.detach().to(wd) - ref_logps.detach().to(wd)), zero)
    S = discounted_cumsum(k, 1.0)
    rho = torch.where(m, A[:, None] - S / eta, zero)
    if step_ends is not None:
        _check_same_shape("old_logps", old_logps, "step_ends", step_ends)
    adv, at_ends = _prl_segment_fill(rho, m, step_ends, zero_fill_compat=zero_fill_compat)
    keep = m & valid[:, None]
    adv = torch.where(keep, adv, zero).to(_out_dtype(old_logps))
    if return_step_end_values:
        return adv, torch.where(keep, at_ends, zero).to(_out_dtype(old_logps))
    return adv


# ----------------------------------------------------------------------------------------------------
# PROF
# ----------------------------------------------------------------------------------------------------


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

    Per group of ``n`` scorable rows (``n+`` correct: outcome >= ``correct_threshold``; ``n-`` incorrect;
    NaN outcomes are never kept), choose ``k+ + k- = m`` with ``k+ <= n+``, ``k- <= n-`` maximising
    ``k+ * k-``. As in the released code the number of correct rows removed is
    ``clip(round((n+ - n- + r)/2), 0, min(r, n+))`` with ``r = min(num_remove, n)``, and the remaining
    ``r -`` that many incorrect rows are removed (at most ``n-``); for odd ``m`` the tie between the two
    balanced splits is broken by ``rounding``: ``"half_even"`` (default, Python's banker's rounding as
    released), ``"half_up"`` (keeps one fewer correct row) or ``"half_down"`` (one more correct row).

    Critic: ``s = +1`` for correct and ``-1`` for incorrect rows, ``pen = H < min_steps or H > max_steps``,
    ``critic = s*c - penalty*pen``. Within each class the lowest-critic rows are removed (stable: among ties the
    earlier row goes first), i.e. the most consistent correct and the least consistent incorrect rows are kept, and
    a penalised row (too few or too many steps) is removed before every unpenalised one of its class, correct or
    incorrect. This is PROF Eq. (1) with Algorithm 1's ranking (arXiv 2509.03403v2: ``r_pro = (1/H) sum_h r_h -
    lambda * r_o * pen`` with ``r_o`` in {-1, 1}; the top ``k+`` of the correct and the bottom ``k-`` of the
    incorrect rows by ``r_pro`` are kept, and ``critic = s * r_pro``) and the released ``filter_trajectories``, so
    ``penalty_position`` ``"paper"`` and ``"reference"`` select the same rows. (The v1 preprint put the penalty
    inside the sign, ``s*(c - penalty*pen)``, which ranks a penalised incorrect row as the most consistent incorrect
    one and keeps it first; that form is not offered.) ``mode="correct"`` removes incorrect rows uniformly at
    random (drawn with ``generator``) instead.

    A NaN ``consistency`` (the PRM could not score the row) is treated as the worst critic of its class: such a
    row is removed before every scored row of its class (correct or incorrect alike), and kept only when the
    class keeps more rows than it has scored ones. (With ``mode="correct"`` incorrect rows are drawn at random,
    whatever their consistency.)

    Args:
        group_ids: ``(B,)`` prompt ids (tensor or sequence; any order); ``None`` with ``num_generations``.
        consistency: ``(B,)`` UNSIGNED consistency from :func:`prof_consistency_scores` (NaN: unscored, see
            above).
        num_steps: ``(B,)`` number of PRM steps ``H``.
        outcome_rewards: ``(B,)`` outcomes (NaN = unscorable).
        num_remove: Rows to remove per group (``n - m``); or pass ``num_keep`` (= m) instead.
        penalty: ``lambda`` (default 10).
        min_steps, max_steps: Allowed step-count range (default 2..30).
        penalty_position: ``"reference"`` (released code) | ``"paper"`` (PROF Eq. (1)): the same critic (above);
            both names are accepted.
        mode: ``"both"`` | ``"correct"``.
        rounding: ``"half_even"`` | ``"half_up"`` | ``"half_down"``.
        generator: ``torch.Generator`` for ``mode="correct"``.
        num_keep: Rows to keep per group (alternative to ``num_remove``).
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
    _check_tensor("consistency", consistency)
    if consistency.dim() != 1:
        raise ValueError(f"`consistency` must have shape (B,), got {tuple(consistency.shape)}.")
    B = consistency.shape[0]
    _check_rows("num_steps", num_steps, B)
    _check_rows("outcome_rewards", outcome_rewards, B)
    dev = consistency.device
    gid, G, _ = _group_index(group_ids, num_generations, B, dev, fn="prof_select")
    o = outcome_rewards.detach().to(device=dev, dtype=torch.float64)
    valid = ~torch.isnan(o)
    pos = valid & (o >= correct_threshold)
    neg = valid & ~pos
    critic = _prof_critic(consistency, num_steps, pos, penalty=penalty, min_steps=min_steps, max_steps=max_steps)
    pos_rm, neg_rm = _prof_removals(pos, neg, gid, G, num_remove=num_remove, num_keep=num_keep, rounding=rounding)

    key = critic.clone()
    if mode == "correct":
        if generator is not None:
            rnd = torch.rand(B, generator=generator, device=generator.device, dtype=torch.float64).to(dev)
        else:
            rnd = torch.rand(B, device=dev, dtype=torch.float64)
        key = torch.where(neg, rnd, key)
    # class: (group, correct/incorrect); invalid rows get their own class at the end
    cls = torch.where(valid, gid * 2 + neg.long(), torch.full_like(gid, 2 * G))
    rank = _rank_within_class(key, cls)
    removed = (pos & (rank < pos_rm[gid])) | (neg & (rank < neg_rm[gid]))
    kept = valid & ~removed
    return torch.nonzero(kept, as_tuple=True)[0]
