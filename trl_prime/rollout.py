"""Small pieces of plumbing between TRL's generation step and the trl-prime algorithms (no algorithm here).

- :func:`outcome_rewards`: the ``(B_global,)`` outcome rewards as TRL combines its reward functions (weighted sum,
  ``NaN`` when every function returned ``None``, RLOO's clip range if any).
- :func:`gather_padded`: pad a local ``(B, T)`` tensor across processes on dim 1 and gather it (the global batch, in
  process order, as TRL gathers rewards).
- :func:`mask_loss_rows`: give whole rows of a GRPO generation batch loss weight 0 (TRL's loss-only ``tool_mask``)
  and recount ``num_items_in_batch`` over the remaining tokens of the global batch.
- :func:`replace_logged_advantages`: put the advantages that really reach the loss into TRL's completions log.
- :func:`drop_zero_weight_rows` / :class:`DropZeroWeightRowsMixin`: the policy's loss forward and backward skip the
  rows whose loss weight is 0 (prompts removed by the online filter or by PROF, unscorable rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from accelerate.utils import gather


def outcome_rewards(trainer, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """``(B_global,)`` outcome rewards: the weighted sum of the reward functions (``NaN`` = unscorable)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    weights = trainer.reward_weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[unscorable] = torch.nan
    clip = getattr(trainer, "reward_clip_range", None)
    if clip:
        rewards = rewards.clamp(min=clip[0], max=clip[1])
    return rewards


def gather_padded(accelerator, x: torch.Tensor, pad_index=0) -> torch.Tensor:
    """Pad ``x`` (B, T, ...) to the longest ``T`` over processes and gather: ``(B_global, T_max, ...)``."""
    return gather(accelerator.pad_across_processes(x, dim=1, pad_index=pad_index))


def mask_loss_rows(accelerator, output: dict, keep: torch.Tensor) -> None:
    """Rows with ``keep`` False get loss weight 0 in TRL's GRPO loss; ``num_items_in_batch`` counts the rest.

    ``keep`` is ``(B_local,)`` bool. The weight goes through ``tool_mask`` (a loss-only mask: attention is unchanged),
    multiplied into an existing one. Collective: call it on every process.
    """
    cm = output["completion_mask"]
    keep = keep.to(device=cm.device, dtype=cm.dtype).unsqueeze(1)
    tool_mask = output.get("tool_mask")
    output["tool_mask"] = keep.expand_as(cm).clone() if tool_mask is None else tool_mask * keep
    output["num_items_in_batch"] = gather((cm * output["tool_mask"]).sum()).sum()


def replace_logged_advantages(trainer, values: Sequence[float] | torch.Tensor) -> None:
    """Replace the global advantages TRL just appended to its completions log (one per generated completion)."""
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    logged = trainer._logs["advantages"]  # a deque (maxlen = generation batch size)
    if len(logged) >= len(values):
        for _ in range(len(values)):
            logged.pop()
    logged.extend(values)


# TRL GRPO loss types whose value does not depend on how many zero-weight rows a micro-batch holds: they sum masked
# token losses and divide by a token count (of the micro-batch or of the whole generation batch). "grpo", "sapo",
# "dr_grpo" and "luspo" divide by the number of rows, so dropping rows would change them: those keep every row.
ROW_COUNT_FREE_LOSS_TYPES = ("dapo", "bnpo", "cispo", "vespo")


# multimodal inputs are not row-aligned (e.g. pixel_values holds patches): batches carrying them keep every row
_NOT_ROW_ALIGNED = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "image_position_ids",
)


def drop_zero_weight_rows(inputs: dict[str, Any], weight: torch.Tensor, accelerator=None) -> dict[str, Any]:
    """The micro-batch ``inputs`` without the rows whose loss weight is zero everywhere.

    A row with ``weight[i].sum() == 0`` (a prompt removed by the online filter or by PROF, an unscorable row) adds
    exactly 0 to a masked token-sum loss and its gradient, so the policy's loss forward and backward need not see
    it. At least one row is always kept, so every process still runs one forward and backward per micro-batch
    (DDP's gradient all-reduce and ZeRO-3's parameter gathering stay collective). With several processes every
    process keeps the same number of rows, the largest number of weighted rows of any process (its own weighted
    rows, then zero-weight ones in batch order), because the loss gathers per-row metrics across processes.

    Args:
        inputs: TRL's micro-batch dict: row-aligned tensors of first dimension ``B`` (ids, masks, advantages,
            log-probs, ...), sliced; 0-dim tensors (``num_items_in_batch``) and scalars pass through unchanged.
        weight: ``(B, T)`` the loss weight of each completion token (0 = not in the loss), any dtype.
        accelerator: the trainer's ``Accelerator``; with more than one process this is a collective (one
            all-reduce of a scalar): call it on every process.

    Returns:
        a new dict (``inputs`` is not modified) whose row-aligned tensors hold the kept rows in their original
        order; ``inputs`` itself when every row is kept, or when the batch (on any process) carries multimodal
        inputs or lists, which stay whole.
    """
    B = weight.size(0)
    live = weight.reshape(B, -1).ne(0).any(dim=1)
    # lists are row-aligned in TRL's batches but cannot be sliced like tensors; multimodal inputs are not row-aligned
    keep_all = any(inputs.get(k) is not None for k in _NOT_ROW_ALIGNED) or any(
        isinstance(v, (list, tuple)) for v in inputs.values())
    n = B if keep_all else max(int(live.sum()), 1)
    if accelerator is not None and accelerator.num_processes > 1:  # the same decision and row count on every rank
        n = int(accelerator.reduce(torch.tensor(n, device=weight.device), reduction="max"))
    if n >= B:
        return inputs
    order = torch.argsort((~live).to(torch.int8), stable=True)  # weighted rows first, each part in batch order
    rows = order[:n].sort().values
    return {k: v.index_select(0, rows.to(v.device)) if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == B
            else v for k, v in inputs.items()}


class DropZeroWeightRowsMixin:
    """For trainers on TRL's ``GRPOTrainer`` that give rows loss weight 0 through ``tool_mask`` (PRIME's filter, PROF,
    unscorable rows): the policy's loss forward and backward run on the other rows only (:func:`drop_zero_weight_rows`)
    when ``loss_type`` is one of :data:`ROW_COUNT_FREE_LOSS_TYPES` (TRL's default ``"dapo"`` included) and the model
    has no router auxiliary loss (a MoE load-balancing loss is a statistic of every attended token, so those batches
    stay whole). The loss and its gradient are then those of the whole micro-batch. Token-masked metrics (entropy,
    token-level clip ratios) are unchanged; per-row metrics averaged over rows (e.g. ``vespo/phi_seq_mean``, clip
    ratios with sequence-level importance sampling) are over the rows that reached the loss."""

    def _compute_loss(self, model, inputs):
        if (self.loss_type in ROW_COUNT_FREE_LOSS_TYPES and inputs.get("tool_mask") is not None
                and not self.aux_loss_enabled):
            weight = inputs["completion_mask"] * inputs["tool_mask"]
            inputs = drop_zero_weight_rows(inputs, weight, self.accelerator)
        return super()._compute_loss(model, inputs)
