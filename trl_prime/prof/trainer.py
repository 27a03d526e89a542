"""PROF on plain GRPO (PROF arXiv 2509.03403): :class:`ProfGRPOTrainer`, TRL's ``GRPOTrainer`` with a
:class:`~trl_prime.prof.filter.ProfFilter` composed in.

The filter (:mod:`trl_prime.prof.filter`) keeps ``m`` of each prompt's ``n`` completions, ranked by the process
consistency a step PRM gives them (:mod:`trl_prime.prof.step_prm`); this trainer computes outcome-only GRPO
advantages on the kept rows and gives the dropped ones loss weight 0. Its options are
:class:`~trl_prime.prof.config.ProfGRPOConfig` (the ``prof_*`` fields of :class:`~trl_prime.prof.config.ProfOptions`,
which the PRIME configs mix in as well: the PRIME trainers compose the same filter, through
:func:`~trl_prime.prof.filter.prime_prof_rows`, when ``prof_mode != "off"``).
"""

from __future__ import annotations

import torch
from accelerate.utils import is_peft_model
from torch import nn

from trl_prime import functional as F
from trl_prime.adapters import GRPOAdapter
from trl_prime.implicit_prm.model import ImplicitPRM
from trl_prime.modeling import sync_trl_ref_adapter
from trl_prime.prof.config import ProfGRPOConfig
from trl_prime.prof.filter import ProfFilter
from trl_prime.prof.step_prm import StepPRM
from trl_prime.rollout import (
    Rollout,
    gather_padded,
    hand_advantages,
    resolve_trainer_args,
)


# ----------------------------------------------------------------------------------------------------------------
# PROF on plain GRPO
# ----------------------------------------------------------------------------------------------------------------
class ProfGRPOTrainer(GRPOAdapter):
    """PROF on TRL's ``GRPOTrainer`` (PROF-BOTH / PROF-POS): a step PRM filters each prompt's completions to ``m``.

    Args: as ``trl.GRPOTrainer`` (``args`` a :class:`ProfGRPOConfig`), plus, by keyword, ``prof_prm``: a
    :class:`StepPRM`, a frozen :class:`~trl_prime.ImplicitPRM` or a path, overriding ``args.prof_prm``.

    In training, after the outcome rewards: the step PRM scores every completion, :class:`ProfFilter` keeps ``m`` per
    prompt, the GRPO advantages (:func:`trl_prime.functional.grpo_advantages`: group mean, unbiased std, eps 1e-6,
    ``scale_rewards``) are computed over the kept rows of each prompt only, and the dropped rows get loss weight 0
    (TRL's ``tool_mask``); ``num_items_in_batch`` counts the kept tokens of the global batch, so the token-mean loss is
    over the kept tokens. Evaluation is not filtered. Metrics: ``prof/*`` (see :meth:`ProfFilter.metrics`) besides
    TRL's; the completions log shows the advantages that reached the loss (0 on dropped rows). With tool calling the
    step PRM scores the completion's text as a whole, tool responses included (the steps are read from the text, as
    a step PRM reads a solution); the policy's loss still masks the tool responses (TRL's ``tool_mask``).

    Example::

        from trl_prime import ProfGRPOConfig, ProfGRPOTrainer
        from trl_prime.rewards import math_reward

        args = ProfGRPOConfig("out", num_generations=8, prof_num_keep=4, prof_prm="Qwen/Qwen2.5-Math-PRM-7B",
                              trust_remote_code=True, beta=0.001, entropy_coef=0.001)
        ProfGRPOTrainer(model="Qwen/Qwen2.5-Math-7B", reward_funcs=math_reward, args=args, train_dataset=ds).train()
    """

    _tag_names = ["trl", "grpo", "prof", "trl-prime"]
    _name = "PROF-GRPO"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: ProfGRPOConfig | None = None,
        *trainer_args,
        prof_prm: StepPRM | ImplicitPRM | str | None = None,
        **trainer_kwargs,
    ):
        args, _ = resolve_trainer_args(
            self, model, args, trainer_args, trainer_kwargs, config_class=ProfGRPOConfig, method="PROF"
        )
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        # TRL's KL reference adapter "ref" (beta > 0) misses IA3's weights (it copies names holding ".default." only)
        sync_trl_ref_adapter(self.model, pretrained_adapter=isinstance(model, nn.Module) and is_peft_model(model))
        self.prof_filter = ProfFilter.from_trainer(self, prm=prof_prm)

    # ----------------------------------------------------------------------------------------------------------
    # One PROF step (TRL's generation step calls it through the adapter, trl_prime/adapters.py)
    # ----------------------------------------------------------------------------------------------------------
    def _rollout_logps(self, output: dict, input_ids, attention_mask, mode: str) -> dict:
        """TRL's rollout log-probs, judged with the rewards by the guard (``None`` when TRL skipped them)."""
        return {"old_logps": output.get("old_per_token_logps")}

    def _algorithm_step(self, output: dict, rollout: Rollout) -> dict:
        """PROF's step (PROF Algorithm 1) in training: keep ``m`` of each prompt's ``n`` completions, GRPO advantages
        over the kept rows, loss weight 0 for the others. Evaluation is not filtered (TRL's output unchanged)."""
        if rollout.mode != "train":
            return output
        acc = self.accelerator
        K = rollout.num_generations
        outcome = rollout.outcome
        mask_g = gather_padded(acc, output["completion_mask"])
        if self.prof_filter is None:
            self.guards.inspect("train", local_rows={"advantages": output["advantages"]})
            self.guards.degenerate_metrics(
                "train", outcome=outcome, completion_mask_g=mask_g, num_generations=K, truncated=rollout.truncated
            )
            return output
        kept, metrics = self.prof_filter(
            acc,
            step=self.state.global_step,
            outcome=outcome,
            eligible=rollout.scorable,
            output=output,
            capture=rollout.capture,
            num_generations=K,
        )
        for name, value in metrics.items():
            self.record_metric("train", name, value)
        group_ids = torch.arange(outcome.numel(), device=outcome.device) // K
        kept_outcome = torch.where(kept, outcome, torch.full_like(outcome, torch.nan))
        advantages_g = F.grpo_advantages(kept_outcome, group_ids, scale_rewards=self.args.scale_rewards)
        self.guards.single_row_groups("train", rewards=kept_outcome, group_ids=group_ids)
        self.guards.inspect("train", global_rows={"advantages": advantages_g})
        self.guards.degenerate_metrics(
            "train",
            outcome=outcome,
            completion_mask_g=mask_g,
            num_generations=K,
            kept=kept,
            truncated=rollout.truncated,
        )
        hand_advantages(self, output, rollout, advantages_g, keep=kept)
        return output
