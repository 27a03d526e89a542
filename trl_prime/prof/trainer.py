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
from trl import GRPOTrainer

from trl_prime import functional as F
from trl_prime._compat import check_trl_version_once
from trl_prime.checkpointing import CheckpointMixin
from trl_prime.guards import GuardsMixin, check_peft_config
from trl_prime.implicit_prm.model import ImplicitPRM
from trl_prime.prof.config import ProfGRPOConfig
from trl_prime.prof.filter import ProfFilter
from trl_prime.prof.step_prm import StepPRM
from trl_prime.rollout import (
    DropZeroWeightRowsMixin,
    gather_padded,
    mask_loss_rows,
    outcome_rewards,
    replace_logged_advantages,
)

check_trl_version_once()  # warns if the installed TRL is outside the tested range


# ----------------------------------------------------------------------------------------------------------------
# PROF on plain GRPO
# ----------------------------------------------------------------------------------------------------------------
class ProfGRPOTrainer(CheckpointMixin, GuardsMixin, DropZeroWeightRowsMixin, GRPOTrainer):
    """PROF on TRL's ``GRPOTrainer`` (PROF-BOTH / PROF-POS): a step PRM filters each prompt's completions to ``m``.

    Args: as ``trl.GRPOTrainer`` (``args`` a :class:`ProfGRPOConfig`), plus, by keyword, ``prof_prm``: a
    :class:`StepPRM`, a frozen :class:`~trl_prime.ImplicitPRM` or a path, overriding ``args.prof_prm``.

    In training, after the outcome rewards: the step PRM scores every completion, :class:`ProfFilter` keeps ``m`` per
    prompt, the GRPO advantages (:func:`trl_prime.functional.grpo_advantages`: group mean, unbiased std, eps 1e-6,
    ``scale_rewards``) are computed over the kept rows of each prompt only, and the dropped rows get loss weight 0
    (TRL's ``tool_mask``); ``num_items_in_batch`` counts the kept tokens of the global batch, so the token-mean loss is
    over the kept tokens. Evaluation is not filtered. Metrics: ``prof/*`` (see :meth:`ProfFilter.metrics`) besides
    TRL's; the completions log shows the advantages that reached the loss (0 on dropped rows).

    Example::

        from trl_prime import ProfGRPOConfig, ProfGRPOTrainer
        from trl_prime.rewards import math_reward

        args = ProfGRPOConfig("out", num_generations=8, prof_num_keep=4, prof_prm="Qwen/Qwen2.5-Math-PRM-7B",
                              trust_remote_code=True, beta=0.001, entropy_coef=0.001)
        ProfGRPOTrainer(model="Qwen/Qwen2.5-Math-7B", reward_funcs=math_reward, args=args, train_dataset=ds).train()
    """

    _tag_names = ["trl", "grpo", "prof", "trl-prime"]
    _name = "PROF-GRPO"

    def __init__(self, model, reward_funcs=None, args: ProfGRPOConfig | None = None, *trainer_args,
                 prof_prm: StepPRM | ImplicitPRM | str | None = None, **trainer_kwargs):
        if args is None:
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ProfGRPOConfig(f"{name.split('/')[-1]}-PROF")
        if not isinstance(args, ProfGRPOConfig):
            raise TypeError(
                f"ProfGRPOTrainer needs `args` to be a ProfGRPOConfig (got {type(args).__name__}); build it with "
                "ProfGRPOConfig(output_dir=..., ...) to get the PROF options."
            )
        self._prof_capture: dict | None = None
        check_peft_config(trainer_args[7] if len(trainer_args) > 7 else trainer_kwargs.get("peft_config"), model)
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        self.prof_filter = ProfFilter.from_trainer(self, prm=prof_prm)
        self._guard_setup()  # start-up checks of the dataset; non-finite / verifier guards (trl_prime/_guards.py)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._prof_capture is not None:
            self._prof_capture.update(rewards_per_func=rewards_per_func, prompts=prompts, completions=completions)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._prof_capture = {}
        try:
            output = super()._generate_and_score_completions(inputs)
            capture = self._prof_capture
        finally:
            self._prof_capture = None
        if not self.model.training:
            return output
        acc = self.accelerator
        K = self.num_generations
        outcome = outcome_rewards(self, capture["rewards_per_func"])
        # inf rewards poison the batch (its step is skipped); NaN rewards are unscorable rows (never kept)
        self._guard_inspect("train", global_rows={"rewards": outcome.nan_to_num(0.0, posinf=torch.inf, neginf=-torch.inf)},
                            local_rows={"old_logps": output.get("old_per_token_logps")},
                            masks={"old_logps": output["completion_mask"]})
        outcome = torch.where(torch.isinf(outcome), torch.full_like(outcome, torch.nan), outcome)
        B = output["completion_ids"].size(0)
        mask_g = gather_padded(acc, output["completion_mask"])
        if self.prof_filter is None:
            self._guard_inspect("train", local_rows={"advantages": output["advantages"]})
            self._guard_degenerate_metrics("train", outcome=outcome, completion_mask_g=mask_g, num_generations=K)
            return output
        kept = self.prof_filter(
            self, outcome=outcome, eligible=~torch.isnan(outcome), output=output, capture=capture, num_generations=K
        )
        group_ids = torch.arange(outcome.numel(), device=outcome.device) // K
        kept_outcome = torch.where(kept, outcome, torch.full_like(outcome, torch.nan))
        advantages_g = F.grpo_advantages(kept_outcome, group_ids, scale_rewards=self.args.scale_rewards != "none")
        self._guard_single_row_groups("train", rewards=kept_outcome, group_ids=group_ids)
        self._guard_inspect("train", global_rows={"advantages": advantages_g})
        self._guard_degenerate_metrics("train", outcome=outcome, completion_mask_g=mask_g, num_generations=K,
                                       kept=kept)
        local = slice(acc.process_index * B, (acc.process_index + 1) * B)
        output["advantages"] = advantages_g[local]
        mask_loss_rows(acc, output, kept[local])
        replace_logged_advantages(self, advantages_g)
        return output
