"""Callbacks for the PRIME trainers.

:class:`PrimeCallback` is a ``transformers.TrainerCallback`` with four extra events that the PRIME trainers
(:class:`~trl_prime.PrimeRLOOTrainer`, :class:`~trl_prime.PrimeGRPOTrainer`) dispatch to *every* callback that
defines a method of that name (subclassing :class:`PrimeCallback` is only a convenience):

- ``on_prompts_filtered(args, state, control, **kw)`` after the online prompt filter, each generation round;
- ``on_prm_step(args, state, control, **kw)`` after each PRM optimizer step;
- ``on_value_step(args, state, control, **kw)`` after each value-model optimizer step (``prime_estimator="ppo"``);
- ``on_rollouts_scored(args, state, control, **kw)`` once the token rewards and advantages of a generation round
  are known (before the policy update).

The keyword payloads are documented on each method. Tensors are the trainer's own (do not modify them in place).
:class:`TokenRewardLogger` writes the per-token rewards of a few completions every N steps as JSONL.
"""

from __future__ import annotations

import json
import os

import torch
from transformers import TrainerCallback


class PrimeCallback(TrainerCallback):
    """A ``TrainerCallback`` with PRIME's events (all no-ops here; override the ones you need)."""

    def on_prompts_filtered(self, args, state, control, **kwargs):
        """After the online prompt filter (PRIME section 3.3).

        Keyword arguments:
            outcome_rewards: ``(B_global,)`` float outcome rewards of the whole generation batch (NaN = unscorable).
            kept_mask: ``(B_global,)`` bool, True on rows of kept groups.
            group_kept: ``(B_global / K,)`` bool, one entry per group.
            kept_fraction: float, fraction of groups kept (logged as ``filter/kept_fraction``).
            num_generations: int, K.
            mode: ``"train"`` or ``"eval"`` (nothing is filtered in eval).
        """

    def on_prm_step(self, args, state, control, **kwargs):
        """After an implicit-PRM update is judged (only when at least one row was kept and the loss and gradient norm
        are finite).

        With ``prm_update="single"`` (no DeepSpeed) the optimizer step itself is held until the policy's optimizer
        step: ``prm_model`` then still holds the weights of before it, and the step is dropped if the policy's step
        is skipped (``guard/held_steps_dropped``). With ``"double"`` or DeepSpeed it has been applied.

        Keyword arguments:
            loss: float, the global PRM loss (``prm/loss``).
            grad_norm: float, the PRM gradient norm before clipping.
            learning_rate: float, the PRM learning rate this step uses (under DeepSpeed: after its scheduler step).
            num_updates: int, PRM updates so far, this one included.
            labels: ``(B_local,)`` outcome labels the loss used on this process (NaN = weight 0: filtered,
                unscorable or empty).
            row_weights: ``(B_local,)`` each row's weight in the global mean loss (0 for filtered rows; exact for
                the ``"ce"`` loss, the rows taking part for the others; with ``prm_replay_rounds`` the replayed rows
                hold the rest of the weight).
            prm_model: the PRM module.
            prm_update: ``"single"`` or ``"double"``.
            loss_group_ids, loss_labels: ``(B_global,)`` the prompt-group id and label of every row of the global
                batch the ``"dpo"``/``"nca"``/``"kto"`` loss was computed on (pairs only form inside a group id);
                ``None`` with ``"ce"``.
        """

    def on_value_step(self, args, state, control, **kwargs):
        """After a value-model optimizer step (``prime_estimator="ppo"``, ``prime_value="critic"``; one per value
        epoch, dispatched once after the round's last one).

        Keyword arguments:
            loss: float, the global clipped value loss (``value/loss``, before ``vf_coef``; mean over the epochs).
            grad_norm: float, the value model's gradient norm before clipping (last epoch).
            learning_rate: float, its learning rate after the scheduler step.
            num_updates: int, value-model updates so far.
            value_model: the :class:`~trl_prime.prime.value.ValueModel` (unwrapped).
        """

    def on_rollouts_scored(self, args, state, control, **kwargs):
        """Once token rewards and advantages are computed, before the policy update. Local rows unless noted.

        Keyword arguments:
            mode: ``"train"`` / ``"eval"``; step: int, the optimizer step these rollouts train (global_step + 1).
            prompt_ids, prompt_mask: ``(B, P)``; completion_ids, completion_mask: ``(B, T)``.
            token_rewards: ``(B, T)`` implicit PRM rewards ``beta * (log pi_phi - log pi_ref)``.
            sequence_rewards: ``(B,)`` their sums; outcome_rewards: ``(B,)``; kept_mask: ``(B,)`` bool.
            advantages: ``(B, T)`` the advantages fed to the policy loss; loss_mask: ``(B, T)`` its token weights.
            prm_logps, ref_logps: ``(B, T)`` log-probs under the PRM and its reference. (``token_rewards``,
                ``sequence_rewards``, ``prm_logps`` and ``ref_logps`` are NaN on the rows of filtered prompts when
                ``prm_score_filtered_rows=False``: those rows are not scored.)
            advantage_inputs: dict, the exact keyword arguments given to
                :func:`trl_prime.functional.prime_advantages` (global, gathered and padded tensors).
            global_advantages: ``(B_global, T_max)`` its result; process_slice: this process's rows in it.
            prompts, completions: lists of the local prompts and decoded completions.
            tokenizer: the tokenizer; is_main_process: bool.
        """


class TokenRewardLogger(PrimeCallback):
    """Write per-token implicit rewards of a few completions every ``every_n_steps`` steps, as JSONL.

    One JSON object per completion and line: ``{"step", "index", "outcome_reward", "sequence_reward", "kept",
    "completion", "tokens": [{"id": int, "token": text, "reward": float, "advantage": float}, ...]}``. ``kept`` is the
    online prompt filter's decision (PROF's row selection shows as advantages 0); ``reward`` and ``sequence_reward``
    are ``null`` for rows that were not scored (filtered prompts with ``prm_score_filtered_rows=False``), so every
    line is strict JSON. Only the main process writes (its own rows). Steps 1, 1 + N, 1 + 2N, ... are logged.

    Args:
        every_n_steps: interval in optimizer steps (>= 1).
        num_completions: completions written per logged step (the first ones of the local batch).
        output_dir: folder of ``token_rewards.jsonl``; default: the trainer's ``output_dir``.
        filename: file name inside ``output_dir``.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        num_completions: int = 4,
        output_dir: str | None = None,
        filename: str = "token_rewards.jsonl",
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1.")
        if num_completions < 1:
            raise ValueError(f"num_completions={num_completions} must be >= 1.")
        self.every_n_steps = every_n_steps
        self.num_completions = num_completions
        self.output_dir = output_dir
        self.filename = filename

    def path(self, args) -> str:
        return os.path.join(self.output_dir or args.output_dir, self.filename)

    def on_rollouts_scored(self, args, state, control, **kw):
        step = kw.get("step", state.global_step + 1)
        if kw.get("mode", "train") != "train" or not kw.get("is_main_process", True):
            return
        if (step - 1) % self.every_n_steps != 0:
            return
        tokenizer = kw["tokenizer"]
        ids, mask = kw["completion_ids"].cpu(), kw["completion_mask"].cpu().bool()
        rewards = kw["token_rewards"].detach().float().cpu()
        adv = kw["advantages"].detach().float().cpu()
        outcome = kw["outcome_rewards"].detach().float().cpu()
        seq = kw["sequence_rewards"].detach().float().cpu()
        kept = kw["kept_mask"].cpu()
        completions = kw.get("completions") or [None] * ids.size(0)
        os.makedirs(os.path.dirname(self.path(args)) or ".", exist_ok=True)
        with open(self.path(args), "a") as f:
            for i in range(min(self.num_completions, ids.size(0))):
                n = int(mask[i].sum())
                tokens = [
                    {
                        "id": int(t),
                        "token": tokenizer.decode([int(t)], skip_special_tokens=False),
                        "reward": None if torch.isnan(rewards[i, j]) else float(rewards[i, j]),  # NaN: not scored
                        "advantage": float(adv[i, j]),
                    }
                    for j, t in enumerate(ids[i, :n].tolist())
                ]
                completion = completions[i]
                if isinstance(completion, list):
                    completion = completion[-1].get("content")
                record = {
                    "step": int(step),
                    "index": i,
                    "outcome_reward": None if torch.isnan(outcome[i]) else float(outcome[i]),
                    "sequence_reward": None if torch.isnan(seq[i]) else float(seq[i]),
                    "kept": bool(kept[i]),
                    "completion": completion,
                    "tokens": tokens,
                }
                f.write(json.dumps(record) + "\n")


__all__ = ["PrimeCallback", "TokenRewardLogger"]
