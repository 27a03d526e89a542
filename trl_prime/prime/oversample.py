"""Oversampling for the online prompt filter: generate more prompts than a step trains on, keep a full batch of the
groups that pass the filter (PRIME's released recipe, ``data.oversample_factor=4``; DAPO's "dynamic sampling").

PRIME's filter (section 3.3) drops the groups whose accuracy lies outside ``[filter_lower, filter_upper]``. Without
oversampling a step trains on the groups that happen to pass: a quarter of the batch on a hard task, none at all on
some steps. With ``oversample_factor = f`` each generation round samples ``ceil(f * G)`` prompts (``G`` = the groups
a generation batch holds, ``generation_batch_size / num_generations``), the filter judges all of them, and the first
``G`` that pass (in the sampler's order, a stable choice) train the PRM and the policy; the generation batch handed to
TRL's loss is then compacted back to ``generation_batch_size`` rows, the selected groups' rows first and, when fewer
than ``G`` groups passed, rows of unselected groups with loss weight 0 to fill it (they reach no forward or backward:
:func:`trl_prime.rollout.drop_zero_weight_rows`).

Pure parts: :func:`oversampled_groups` (how many prompts to sample), :func:`select_first_groups` (which groups train)
and :func:`compaction_rows` (which rows make the compacted batch). :func:`compact_generation_batch` applies them to
TRL's generation-batch dict (collective under several processes).
"""

from __future__ import annotations

import math

import torch


#: TRL generation-batch keys padded on the left (prompts); every other ``(B, T, ...)`` tensor is right-padded
LEFT_PADDED_KEYS = ("prompt_ids", "prompt_mask")


def oversampled_groups(target_groups: int, factor: float, num_generations: int, num_processes: int = 1) -> int:
    """The number of prompts (groups) one oversampled generation round samples.

    ``ceil(factor * target_groups)``, raised to the next count whose rows (``groups * num_generations``) split evenly
    over ``num_processes`` (TRL hands each process an equal share of the generation batch).

    Args:
        target_groups: ``G``, the groups a generation batch trains on (``generation_batch_size / num_generations``).
        factor: ``oversample_factor`` (finite, >= 1).
        num_generations: ``K``, completions per prompt.
        num_processes: processes sharing the generation batch.

    Returns:
        ``G_o >= G`` groups to sample (``G`` when ``factor == 1``).

    Raises:
        ValueError: ``factor`` not finite or below 1, or a count below 1.
    """
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"`oversample_factor`={factor!r} must be a finite number >= 1 (1 = no oversampling).")
    if target_groups < 1 or num_generations < 1 or num_processes < 1:
        raise ValueError("target_groups, num_generations and num_processes must be >= 1.")
    groups = max(target_groups, math.ceil(factor * target_groups - 1e-9))
    while (groups * num_generations) % num_processes:
        groups += 1
    return groups


def select_first_groups(passed: torch.Tensor, num_generations: int, target_groups: int) -> torch.Tensor:
    """The rows of the first ``target_groups`` groups that passed the filter, in row (sampler) order.

    Args:
        passed: ``(B,)`` bool, the rows of the groups the online filter keeps (whole groups: contiguous blocks of
            ``num_generations`` rows, as :func:`trl_prime.functional.prompt_accuracy_mask` returns them).
        num_generations: ``K``.
        target_groups: ``G``, the most groups to keep.

    Returns:
        ``(B,)`` bool: ``passed`` restricted to its first ``target_groups`` groups (all of them when fewer passed).

    Raises:
        ValueError: ``B`` not a multiple of ``K``, or a group that is only partly marked.
    """
    B = passed.numel()
    if B % num_generations:
        raise ValueError(f"{B} rows do not split into groups of num_generations={num_generations}.")
    groups = passed.view(-1, num_generations)
    if bool((groups.any(1) != groups.all(1)).any()):
        raise ValueError("`passed` must mark whole groups (every row of a group alike).")
    group_passed = groups[:, 0]
    rank = torch.cumsum(group_passed.to(torch.long), 0)  # 1-based rank among the passing groups
    chosen = group_passed & (rank <= target_groups)
    return chosen.repeat_interleave(num_generations)


def compaction_rows(selected: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The global rows of the compacted generation batch: the ``selected`` rows in order, then, when they are fewer
    than ``num_rows``, the first unselected rows (loss weight 0) to fill it.

    Args:
        selected: ``(B_o,)`` bool over the oversampled batch's rows.
        num_rows: rows of the compacted batch (``generation_batch_size``), ``<= B_o``.

    Returns:
        ``(num_rows,)`` long row indices into the oversampled batch.

    Raises:
        ValueError: more rows selected than ``num_rows``, or ``num_rows`` larger than the batch.
    """
    n_sel = int(selected.sum())
    if n_sel > num_rows or num_rows > selected.numel():
        raise ValueError(f"cannot compact {selected.numel()} rows ({n_sel} selected) to {num_rows}.")
    order = torch.argsort((~selected).to(torch.int8), stable=True)  # selected first, each part in row order
    return order[:num_rows]


def _pad_gather(accelerator, x: torch.Tensor, *, left: bool, pad_index) -> torch.Tensor:
    from accelerate.utils import gather

    if accelerator.num_processes == 1:
        return x
    if x.dim() >= 2:
        x = accelerator.pad_across_processes(x, dim=1, pad_index=pad_index, pad_first=left)
    return gather(x)


def compact_generation_batch(
    accelerator, output: dict, rows: torch.Tensor, *, pad_token_id: int, num_rows_local: int
) -> dict:
    """TRL's generation-batch dict ``output`` (this process's ``B_o_local`` rows) reduced to the global ``rows``
    (:func:`compaction_rows`), this process's share of them: ``rows[process_index::num_processes]``
    (``num_rows_local`` rows), so the selected rows, first in ``rows``, are dealt out to the processes in turn.

    Every row-aligned tensor (first dimension ``B_o_local``) is gathered over processes (padded on dim 1: prompts on
    the left with ``pad_token_id`` / 0, the rest on the right with 0 or ``pad_token_id`` for ``completion_ids``),
    indexed by ``rows`` and sliced to this process's part; 0-dim tensors pass through (the caller recounts
    ``num_items_in_batch``). Collective: call it on every process.

    Raises:
        ValueError: a list or tuple value (TRL keeps none in a text generation batch) or a multimodal input, which
            cannot be regrouped row by row.
    """
    from trl_prime.rollout import MM_KEYS

    B = next(v for v in output.values() if isinstance(v, torch.Tensor) and v.dim() > 0).size(0)
    bad = [k for k, v in output.items() if isinstance(v, (list, tuple)) or (k in MM_KEYS and v is not None)]
    bad = [k for k in bad if k not in ("token_type_ids", "mm_token_type_ids")]
    if bad:
        raise ValueError(
            f"`oversample_factor` > 1 cannot regroup the generation batch's {bad} row by row (multimodal inputs are "
            "not row-aligned). Set `oversample_factor`=1 for this model."
        )
    # every process takes every n-th row of `rows`: the selected rows (first in `rows`) are dealt out in turn, so
    # each process trains its share of them instead of process 0 taking them all
    n = accelerator.num_processes
    mine = rows[accelerator.process_index :: n][:num_rows_local]
    out = {}
    for k, v in output.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == B:
            left = k in LEFT_PADDED_KEYS
            pad = pad_token_id if k in ("prompt_ids", "completion_ids") else 0
            full = _pad_gather(accelerator, v, left=left, pad_index=pad)
            out[k] = full.index_select(0, mine.to(full.device))
        else:
            out[k] = v
    return out
