"""Small pieces of plumbing between TRL's generation step and the trl-prime algorithms (no algorithm here).

- :func:`outcome_rewards`: the ``(B_global,)`` outcome rewards as TRL combines its reward functions (weighted sum,
  ``NaN`` when every function returned ``None``, RLOO's clip range if any).
- :func:`gather_padded`: pad a local ``(B, T)`` tensor across processes on dim 1 and gather it (the global batch, in
  process order, as TRL gathers rewards).
- :func:`mask_loss_rows`: give whole rows of a GRPO generation batch loss weight 0 (TRL's loss-only ``tool_mask``)
  and recount ``num_items_in_batch`` over the remaining tokens of the global batch.
- :func:`replace_logged_advantages`: put the advantages that really reach the loss into TRL's completions log.
"""

from __future__ import annotations

from collections.abc import Sequence

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
