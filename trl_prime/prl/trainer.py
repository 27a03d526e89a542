"""PRL: process reward learning from KL-regularised reward-to-go, on TRL's ``GRPOTrainer`` (arXiv 2601.10201).

Each step (PRL Algorithm 1):

1. TRL generates ``K`` completions per prompt and scores them (outcome rewards, gathered over processes).
2. Log-probs of the sampled tokens under the rollout policy ``pi_old`` (TRL's own when it computed them, else one
   no-grad forward) and under the frozen reference ``pi_ref`` (see *Reference* below), both through TRL's
   ``_get_per_token_logps_and_entropies`` (same temperature and LM head: a reference equal to the policy gives
   ``k_t = 0`` exactly).
3. Step ends (:func:`trl_prime.functional.step_end_mask`): every ``prl_step_len`` tokens (``"length"``), at ``"\\n"`` /
   ``"\\n\\n"`` found in the decoded text (``"newline"`` / ``"double_newline"``: robust to a BOS token and to newlines
   merged into other tokens), or every token (``"token"``).
4. Per-token weights ``rho_t = A - S_t / eta`` (:func:`trl_prime.functional.prl_advantages`) over the global batch
   (padded, gathered, sliced back per process), fed to TRL's token-level PPO-clip loss as ``(B, T)`` advantages.

All the arithmetic is :func:`trl_prime.functional.prl_advantages`; this module is plumbing.
"""

from __future__ import annotations

import torch
from accelerate.utils import is_peft_model
from torch import nn

from trl_prime import functional as F
from trl_prime.adapters import GRPOAdapter
from trl_prime.modeling import (
    copy_adapter,
    eval_mode,
    load_model_copy,
    prepare_frozen,
    reference_logps,
    sync_trl_ref_adapter,
)
from trl_prime.prl.config import PRLConfig
from trl_prime.rollout import (
    MM_KEYS,
    Rollout,
    action_mask,
    gather_padded,
    hand_advantages,
    resolve_trainer_args,
)


PRL_REF_ADAPTER = "ref"  # TRL's name for the frozen copy of a pre-trained adapter


class PRLGRPOTrainer(GRPOAdapter):
    """PRL on TRL's ``GRPOTrainer``: token weights ``rho_t = A - S_t / eta`` in the token-level PPO-clip loss.

    Args: as ``trl.GRPOTrainer`` (``model``, ``reward_funcs``, ``args`` a :class:`~trl_prime.PRLConfig`, datasets,
    ``processing_class``, ``callbacks``, ``peft_config``, ...).

    Reference ``pi_ref`` (PRL section 3.1), needed even with ``beta=0`` (TRL then loads none):

    - TRL's ``beta > 0``: TRL's own reference and its log-probs (no extra model, no extra forward);
    - PEFT with a fresh adapter (``peft_config``): the base model with adapters disabled;
    - a ``PeftModel`` with a pre-trained adapter: a frozen copy of that adapter (``"ref"``, as TRL makes for ``beta>0``);
    - otherwise a frozen copy of the policy's initial checkpoint, owned by the trainer (``self.prl_ref_model``),
      placed like TRL's reference (DeepSpeed / FSDP / device).

    Every reference (and the rollout policy's ``pi_old``) is scored at the sampling ``temperature``, so ``S_t`` is the
    KL-to-go of the tempered distribution the completions were drawn from (PRL section 3.1; PRIME's PRM scores at
    temperature 1 instead: see :class:`PRLConfig`).

    Rows whose outcome is unscorable (every reward function returned ``None``) get weight 0 and loss weight 0. With
    tool calling, ``S_t`` sums over the policy's own tokens only: tool responses (TRL's ``tool_mask``) add nothing.

    Metrics, each generation round: ``prl/kl_to_go_mean``, ``prl/kl_to_go_min``, ``prl/kl_to_go_max`` (``S_t`` in
    nats over the scorable completion tokens of the global batch), ``prl/sign_flip_fraction`` (fraction of those tokens
    whose weight has the opposite sign of the row's outcome advantage ``A``), ``prl/steps_per_completion`` (mean number
    of steps per non-empty completion); plus TRL's.

    Example::

        from trl_prime import PRLConfig, PRLGRPOTrainer
        from trl_prime.rewards import math_reward

        args = PRLConfig("out", num_generations=5, prl_eta=200, prl_step_split="length", prl_step_len=256)
        PRLGRPOTrainer(model="Qwen/Qwen2.5-Math-1.5B", reward_funcs=math_reward, args=args,
                       train_dataset=dataset).train()
    """

    _tag_names = ["trl", "grpo", "prl", "trl-prime"]
    _name = "PRL"

    def __init__(self, model, reward_funcs=None, args: PRLConfig | None = None, *trainer_args, **trainer_kwargs):
        args, peft_config = resolve_trainer_args(
            self, model, args, trainer_args, trainer_kwargs, config_class=PRLConfig, method="PRL"
        )
        self._prl_pretrained_adapter = isinstance(model, nn.Module) and is_peft_model(model)
        owns_copy = args.beta == 0.0 and peft_config is None and not self._prl_pretrained_adapter
        # the copy is made before TRL loads, patches or wraps the policy
        ref = load_model_copy(model, args) if owns_copy else None
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        # TRL's KL reference adapter "ref" (beta > 0) misses IA3's weights (it copies names holding ".default." only)
        sync_trl_ref_adapter(self.model, pretrained_adapter=self._prl_pretrained_adapter)
        self.prl_ref_model = None
        self._prl_ref_adapter = None
        if ref is not None:
            from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

            add_fused_lm_head(ref, temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
            if args.disable_dropout:
                disable_dropout_in_model(ref)
            self.prl_ref_model = prepare_frozen(ref, self)
        elif args.beta == 0.0 and self._prl_pretrained_adapter:
            copy_adapter(self.model, PRL_REF_ADAPTER)
            self._prl_ref_adapter = PRL_REF_ADAPTER

    @property
    def prl_reference(self) -> str:
        """Where ``pi_ref`` comes from: ``"trl"``, ``"model"``, ``"adapter"`` or ``"adapters_disabled"``."""
        if self.beta != 0.0:
            return "trl"
        if self.prl_ref_model is not None:
            return "model"
        return "adapter" if self._prl_ref_adapter is not None else "adapters_disabled"

    # ----------------------------------------------------------------------------------------------------------
    # One PRL step (TRL's generation step calls it through the adapter, trl_prime/adapters.py)
    # ----------------------------------------------------------------------------------------------------------
    def _rollout_logps(self, output: dict, input_ids, attention_mask, mode: str) -> dict:
        """``pi_old`` and ``pi_ref`` log-probs of the round, judged with the rewards by the guard."""
        old, ref = self._prl_logps(output, input_ids, attention_mask, output["completion_ids"].size(1), mode)
        return {"old_logps": old, "ref_logps": ref}

    def _prl_step_ends(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor | None:
        """``(B, T)`` bool step ends of the local completions (``None``: every token is its own step)."""
        a = self.args
        if a.prl_order == "process_first" or a.prl_step_split == "token":
            return None
        return F.step_end_mask(
            completion_ids,
            completion_mask,
            self._tokenizer,
            split=a.prl_step_split,
            step_len=a.prl_step_len if a.prl_step_split == "length" else None,
        )

    def _prl_logps(self, output: dict, input_ids, attention_mask, T: int, mode: str):
        """Rollout-policy and reference log-probs ``(B, T)`` of the local completions."""
        bs = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        mm = {k: output.get(k) for k in MM_KEYS if output.get(k) is not None}
        old = output.get("old_per_token_logps")
        if old is None:  # TRL skips them when generation and optimisation are aligned: pi_old = the current policy
            from trl.models.utils import disable_gradient_checkpointing

            with (
                torch.no_grad(),
                eval_mode(self.model),
                disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            ):
                old = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, T, batch_size=bs, **mm
                )[0]
        ref = output.get("ref_per_token_logps")
        if ref is None:
            ref = reference_logps(
                self,
                input_ids,
                attention_mask,
                T,
                ref_model=self.prl_ref_model,
                adapter_name=self._prl_ref_adapter,
                batch_size=bs,
                **mm,
            )
        return old.detach(), ref.detach()

    def _algorithm_step(self, output: dict, rollout: Rollout) -> dict:
        """PRL's step (PRL Algorithm 1) on a scored round: step ends, token weights over the global batch, loss
        mask."""
        a = self.args
        mode, K, local, acc = rollout.mode, rollout.num_generations, rollout.local, self.accelerator
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        old, ref = rollout.logps["old_logps"], rollout.logps["ref_logps"]
        if bool(rollout.flagged.any()):  # the step is skipped; keep the rest of the batch's computation finite
            old, ref = (torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in (old, ref))
        outcome, scorable = rollout.outcome, rollout.scorable
        ends = self._prl_step_ends(completion_ids, completion_mask)

        # advantages over the global batch (pad, gather, compute, slice)
        old_g, ref_g = gather_padded(acc, old), gather_padded(acc, ref)
        mask_g = gather_padded(acc, completion_mask).bool()
        # the KL-to-go sums over the policy's own tokens: tool responses (TRL's tool_mask) are not its actions
        actions_g = gather_padded(acc, action_mask(output)).bool()
        ends_g = gather_padded(acc, ends.long()).bool() if ends is not None else None
        group_ids = torch.arange(outcome.numel(), device=outcome.device) // K
        adv_inputs = dict(
            outcome_rewards=outcome,
            old_logps=old_g,
            ref_logps=ref_g,
            mask=actions_g,
            group_ids=group_ids,
            eta=a.prl_eta,
            step_ends=ends_g,
            order=a.prl_order,
            scale_rewards=a.scale_rewards,  # "group", "batch" or "none" (TRL's)
            eps=a.prl_eps,
            zero_fill_compat=a.zero_fill_compat,
        )
        advantages_g = F.prl_advantages(**adv_inputs)
        self.guards.single_row_groups(mode, rewards=outcome, group_ids=group_ids)
        self.guards.inspect(mode, global_rows={"advantages": advantages_g}, masks={"advantages": mask_g})
        self.guards.degenerate_metrics(
            mode, outcome=outcome, completion_mask_g=mask_g, num_generations=K, truncated=rollout.truncated
        )
        # convention: an unscorable row has loss weight 0 (TRL keeps it with advantage 0)
        hand_advantages(self, output, rollout, advantages_g, keep=None if bool(scorable.all()) else scorable)
        self._prl_log_metrics(mode, adv_inputs, advantages_g, ends_g)
        self._prl_last = dict(adv_inputs, advantages=advantages_g, process_slice=local)  # for tests and debugging
        return output

    def _prl_log_metrics(self, mode, adv_inputs, advantages_g, ends_g) -> None:
        a = self.args
        outcome, mask = adv_inputs["outcome_rewards"], adv_inputs["mask"]
        scorable = ~torch.isnan(outcome)
        old, ref = adv_inputs["old_logps"], adv_inputs["ref_logps"]
        k = torch.where(mask, old - ref, torch.zeros_like(old))
        kl_to_go = F.discounted_cumsum(k, 1.0)
        if a.prl_order == "advantage_first":
            A = F.grpo_advantages(outcome, adv_inputs["group_ids"], scale_rewards=a.scale_rewards, eps=a.prl_eps)
        else:
            A = torch.where(scorable, outcome, torch.zeros_like(outcome))
        tok = mask & scorable[:, None]
        s = kl_to_go[tok]
        flips = (torch.sign(advantages_g) * torch.sign(A)[:, None] < 0) & tok
        nonempty = mask.any(-1)
        ends = mask if ends_g is None else (ends_g.bool() & mask) | F.last_token_mask(mask)
        steps = ends.sum(-1)[nonempty].float()
        nan = float("nan")
        self.record_metric(mode, "prl/kl_to_go_mean", s.mean().item() if s.numel() else nan)
        self.record_metric(mode, "prl/kl_to_go_min", s.min().item() if s.numel() else nan)
        self.record_metric(mode, "prl/kl_to_go_max", s.max().item() if s.numel() else nan)
        self.record_metric(mode, "prl/sign_flip_fraction", flips.sum().item() / max(int(tok.sum().item()), 1))
        self.record_metric(mode, "prl/steps_per_completion", steps.mean().item() if steps.numel() else nan)
