"""Small pieces of plumbing between TRL's generation step and the trl-prime algorithms (no algorithm here).

- :func:`outcome_rewards`: the ``(B_global,)`` outcome rewards as TRL combines its reward functions (weighted sum,
  ``NaN`` when every function returned ``None``, RLOO's clip range if any).
- :func:`gather_padded`: pad a local ``(B, T)`` tensor across processes on dim 1 and gather it (the global batch, in
  process order, as TRL gathers rewards).
- :func:`mask_loss_rows`: give whole rows of a GRPO generation batch loss weight 0 (TRL's loss-only ``tool_mask``)
  and recount ``num_items_in_batch`` over the remaining tokens of the global batch.
- :func:`action_mask`: the completion tokens the policy generated (tool responses excluded, TRL's ``tool_mask``).
- :func:`drop_zero_weight_rows`: the policy's loss forward and backward skip the rows whose loss weight is 0 (prompts
  removed by the online filter or by PROF, unscorable rows).
- :class:`Rollout`, :func:`capture_rewards`, :func:`score_rollout`, :func:`hand_advantages`: what the adapters
  (:mod:`trl_prime.adapters`) run around TRL's generation step for the PRIME, PRL and PROF trainers: capture what TRL
  produced, the common outcome preamble, and the hand-off of a method's advantages to TRL's loss.
- :data:`MM_KEYS` (TRL's multimodal inputs); :func:`resolve_trainer_args`, the start of the trainers' constructors
  (config or a default one, ``peft_config``, both checked).

The adapters hook into TRL's private methods with these pieces: importing this module checks the installed TRL
version (:func:`trl_prime._compat.check_trl_version_once`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather

from trl_prime._compat import check_trl_version_once
from trl_prime.guards import check_peft_config


check_trl_version_once()  # warns if the installed TRL is outside the tested range


#: TRL's multimodal inputs of ``_get_per_token_logps_and_entropies``, passed through from the generation output
MM_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def resolve_trainer_args(
    trainer,
    model,
    args,
    trainer_args: tuple,
    trainer_kwargs: dict,
    *,
    config_class: type,
    method: str,
    accepted: type | None = None,
):
    """The start of a trl-prime trainer's ``__init__``: its config and ``peft_config``, checked.

    Returns ``(args, peft_config)``: ``args``, or ``config_class("<model name>-<method>")`` when ``None``; the
    ``peft_config`` given to TRL's trainer, the 8th positional argument after ``args`` in both ``RLOOTrainer`` and
    ``GRPOTrainer`` (``trainer_args``) or the keyword (``None`` when not given), checked against ``model``
    (:func:`trl_prime.guards.check_peft_config`).

    Raises:
        TypeError: when ``args`` is not an instance of ``accepted`` (default ``config_class``), e.g. a plain TRL config
            without the method's options.
        ValueError: on a ``peft_config`` the trainers cannot train (see :func:`~trl_prime.guards.check_peft_config`).
    """
    if args is None:
        from trl.trainer.utils import get_config_model_id

        name = model if isinstance(model, str) else get_config_model_id(model.config)
        args = config_class(f"{name.split('/')[-1]}-{method}")
    if not isinstance(args, accepted or config_class):
        name = config_class.__name__
        raise TypeError(
            f"{type(trainer).__name__} needs `args` to be a {name} (got {type(args).__name__}); build it with "
            f"{name}(output_dir=..., ...) to get the {method} options."
        )
    peft_config = trainer_args[7] if len(trainer_args) > 7 else trainer_kwargs.get("peft_config")
    check_peft_config(peft_config, model)  # start-up checks (trl_prime/guards.py)
    return args, peft_config


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


def action_mask(output: dict) -> torch.Tensor:
    """``(B, T)``: the completion tokens the policy generated, ``completion_mask * tool_mask`` when TRL appended tool
    responses (``tool_mask`` 0 on them: they are not the policy's actions, and TRL's loss masks them), else
    ``output["completion_mask"]`` itself. Read it before :func:`mask_loss_rows` adds row weights to ``tool_mask``."""
    tool_mask = output.get("tool_mask")
    return output["completion_mask"] if tool_mask is None else output["completion_mask"] * tool_mask


# TRL GRPO loss types whose value does not depend on how many zero-weight rows a micro-batch holds: they sum masked
# token losses and divide by a token count (of the micro-batch or of the whole generation batch). "grpo", "sapo",
# "dr_grpo" and "luspo" divide by the number of rows, so dropping rows would change them: those keep every row.
ROW_COUNT_FREE_LOSS_TYPES = ("dapo", "bnpo", "cispo", "vespo")


# multimodal inputs are not row-aligned (e.g. pixel_values holds patches): batches carrying them keep every row;
# the token type ids are (B, T) like the input ids
_NOT_ROW_ALIGNED = tuple(k for k in MM_KEYS if k not in ("token_type_ids", "mm_token_type_ids"))


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
        isinstance(v, (list, tuple)) for v in inputs.values()
    )
    n = B if keep_all else max(int(live.sum()), 1)
    if accelerator is not None and accelerator.num_processes > 1:  # the same decision and row count on every rank
        n = int(accelerator.reduce(torch.tensor(n, device=weight.device), reduction="max"))
    if n >= B:
        return inputs
    order = torch.argsort((~live).to(torch.int8), stable=True)  # weighted rows first, each part in batch order
    rows = order[:n].sort().values
    return {
        k: v.index_select(0, rows.to(v.device))
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == B
        else v
        for k, v in inputs.items()
    }


@dataclass
class Rollout:
    """One generation round after TRL scored it, as :func:`score_rollout` (the outcome preamble common to PRIME, PRL
    and PROF) leaves it.

    ``B`` local rows (this process), ``B_global`` rows over all processes (``B_global = B * num_processes``, rows of
    process ``p`` at ``local`` for ``p``), ``T`` completion tokens, ``K`` completions per prompt (``num_generations``).

    Attributes:
        mode: ``"train"`` or ``"eval"``.
        num_generations: ``K`` (TRL's ``num_generations``, or ``num_generations_eval`` in evaluation).
        local: this process's rows of the global batch.
        input_ids: ``(B, P + T)`` prompt and completion ids; ``attention_mask`` the same shape, its mask.
        outcome: ``(B_global,)`` float outcome rewards (weighted sum of the reward functions); ``NaN`` where no
            function scored the row and where a reward was infinite.
        scorable: ``(B_global,)`` bool, ``~isnan(outcome)``.
        truncated: ``(B_global,)`` bool, the completions TRL counts as truncated (no EOS at the end; TRL's
            ``completions/clipped_ratio``).
        flagged: ``(B_global,)`` bool, the rows the guard found non-finite (infinite rewards, or non-finite values in
            ``logps``); in training such a row poisons the batch (its optimizer steps are skipped).
        logps: name -> the ``(B, T)`` log-probs the trainer had judged with the rewards (its ``_rollout_logps``).
        capture: what TRL's step produced on the way (local): ``rewards_per_func`` ``(B_global, n_funcs)``,
            ``prompts``, ``completions``, ``completion_lengths`` (list of ints), ``truncated`` (``(B,)`` bool) and, for trainers that record them,
            log-probs (``policy_logps``, ``trl_ref_logps``).
    """

    mode: str
    num_generations: int
    local: slice
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    outcome: torch.Tensor
    scorable: torch.Tensor
    flagged: torch.Tensor
    truncated: torch.Tensor
    logps: dict[str, torch.Tensor | None] = field(default_factory=dict)
    capture: dict[str, Any] = field(default_factory=dict)


def capture_rewards(trainer, capture: dict, rewards_per_func, prompts, completions, completion_ids_list) -> None:
    """Record in ``capture`` what TRL's ``_calculate_rewards`` saw and returned: the reward functions' values, the
    prompts, the completions, their lengths and which are truncated (:func:`truncated_rows`)."""
    capture.update(
        rewards_per_func=rewards_per_func,
        prompts=prompts,
        completions=completions,
        completion_lengths=[len(c) for c in completion_ids_list],
        truncated=truncated_rows(trainer, completion_ids_list),
    )


def truncated_rows(trainer, completion_ids_list) -> torch.Tensor:
    """``(B,)`` bool: the completions TRL counts as truncated (``completions/clipped_ratio``): the last token is
    neither an EOS nor the pad token (tool responses and every turn included, as TRL's generation step does)."""
    eos_and_pad = [*trainer.eos_token_ids, trainer._tokenizer.pad_token_id]
    return torch.tensor(
        [len(ids) > 0 and ids[-1] not in eos_and_pad for ids in completion_ids_list],
        dtype=torch.bool,
        device=trainer.accelerator.device,
    )


def score_rollout(trainer, output: dict, capture: dict) -> Rollout:
    """The outcome preamble common to every method: outcome rewards, guard inspection (of the rewards and of the
    log-probs the trainer's ``_rollout_logps`` names), ``inf -> NaN``, scorable mask; a ``trainer._rollout_class``
    (:class:`Rollout` or a subclass with defaults for its extra fields). Collective."""
    mode = "train" if trainer.model.training else "eval"
    completion_mask = output["completion_mask"]
    B = completion_mask.size(0)
    rank = trainer.accelerator.process_index
    input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], completion_mask], dim=1)
    outcome = outcome_rewards(trainer, capture["rewards_per_func"])  # (B_global,)
    logps = trainer._rollout_logps(output, input_ids, attention_mask, mode)
    # an inf reward poisons the batch (training: no optimizer step; evaluation: logged; trl_prime/guards.py);
    # NaN = unscorable, excluded
    flagged = trainer.guards.inspect(
        mode,
        global_rows={"rewards": outcome.nan_to_num(0.0, posinf=torch.inf, neginf=-torch.inf)},
        local_rows=logps,
        masks=dict.fromkeys(logps, completion_mask),
    )
    outcome = torch.where(torch.isinf(outcome), torch.full_like(outcome, torch.nan), outcome)
    return trainer._rollout_class(
        mode=mode,
        num_generations=trainer.num_generations if mode == "train" else trainer.num_generations_eval,
        local=slice(rank * B, (rank + 1) * B),
        input_ids=input_ids,
        attention_mask=attention_mask,
        outcome=outcome,
        scorable=~torch.isnan(outcome),
        flagged=flagged,
        truncated=gather(capture["truncated"]),
        logps=logps,
        capture=capture,
    )


def hand_advantages(
    trainer, output: dict, rollout: Rollout, advantages_g: torch.Tensor, keep: torch.Tensor | None = None
) -> None:
    """Hand the global advantages to TRL's loss: this process's rows of ``advantages_g`` (``(B_global,)``, or
    ``(B_global, T_max)`` cut to the completion length) become ``output["advantages"]``; rows outside ``keep``
    (``(B_global,)`` bool; ``None``: every row) get loss weight 0 (:func:`mask_loss_rows`, collective); TRL's
    completions log shows the advantages that reach the loss (the first token's for per-token advantages). Pass
    ``keep=rollout.scorable`` (or narrower) when some outcome is ``NaN`` (unscorable): those rows must not train."""
    if advantages_g.dim() == 1:
        output["advantages"] = advantages_g[rollout.local]
    else:
        output["advantages"] = advantages_g[rollout.local, : output["completion_ids"].size(1)]
    if keep is not None:
        mask_loss_rows(trainer.accelerator, output, keep[rollout.local])
    trainer.log_advantages(advantages_g if advantages_g.dim() == 1 else advantages_g[:, 0])
