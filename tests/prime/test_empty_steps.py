"""A step with nothing to learn moves nothing: an all-filtered step, and a policy step the guard skips after the PRM's
backward, leave the policy, the PRM, their optimizers and schedulers bit-identical, and are counted."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_state, poison_advantages_on_round, snapshot_config, train_with_snapshots, trainer_state
from tiny import tiny_prompt_dataset
from transformers import TrainerCallback

from trl_prime import PrimeGRPOConfig, PrimeGRPOTrainer, PrimeRLOOConfig, PrimeRLOOTrainer


@pytest.mark.parametrize("cls,cfg_cls", [(PrimeRLOOTrainer, PrimeRLOOConfig), (PrimeGRPOTrainer, PrimeGRPOConfig)])
def test_all_filtered_step_moves_nothing(tiny_model_path, tmp_path, cls, cfg_cls):
    """Step 1 trains (every group 1, 0, 1, 0: accuracy 0.5, kept), step 2 has every group right (accuracy 1:
    filtered). A zero gradient would still move the weights through AdamW's momentum from step 1; the empty step
    leaves everything bit-identical and is counted in guard/empty_steps."""
    calls = []

    def first_kept_then_all_right(completions, prompts, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            return [float(j % 2 == 0) for j in range(len(prompts))]
        return [1.0] * len(prompts)

    trainer, snap = train_with_snapshots(cls, cfg_cls, tiny_model_path, tmp_path, first_kept_then_all_right)
    after = trainer_state(trainer)
    assert snap.after_step1["prm_updates"] == 1  # step 1 did train the PRM ...
    assert trainer.state.global_step == 2
    assert_same_state(snap.after_step1, after)  # ... and step 2 moved nothing
    logs = {h["step"]: h for h in trainer.state.log_history if "filter/kept_fraction" in h}
    assert logs[1]["filter/kept_fraction"] == 1.0 and logs[2]["filter/kept_fraction"] == 0.0
    assert "guard/empty_steps" not in logs[1] and logs[2]["guard/empty_steps"] == 1.0


def test_policy_step_skipped_after_the_prm_backward_leaves_the_prm_unmoved(tiny_model_path, tmp_path, monkeypatch):
    """Non-finite advantages are found after the PRM's backward (its rewards feed them): the policy step is
    skipped, and the PRM's step, held for it, is dropped: PRM weights, AdamW state and schedule stay as after step
    1 (they moved at step 1). Counted in guard/skipped_steps and guard/held_steps_dropped. Step 3 then has every
    group filtered: an empty step right after a skipped one moves nothing either."""
    poison_advantages_on_round(monkeypatch, 2)

    rounds = []

    def alternating_then_all_right(completions, prompts, **kwargs):
        rounds.append(1)
        if len(rounds) == 3:
            return [1.0] * len(prompts)  # accuracy 1: every group filtered
        return [float(j % 2 == 0) for j in range(len(prompts))]

    trainer, snap = train_with_snapshots(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, alternating_then_all_right, max_steps=3
    )
    after = trainer_state(trainer)
    assert snap.after_step1["prm_updates"] == 1
    assert_same_state(snap.after_step1, snap.after_step2)  # the skipped step
    assert_same_state(snap.after_step2, after)  # the empty step after it
    logs = {h["step"]: h for h in trainer.state.log_history if "prm/loss" in h}
    assert logs[2]["guard/skipped_steps"] == 1.0 and logs[2]["guard/held_steps_dropped"] >= 1.0
    assert "guard/held_steps_dropped" not in logs[1]
    assert logs[3]["guard/empty_steps"] == 1.0 and "guard/empty_steps" not in logs[2]


def test_held_peft_prm_gradients_stay_out_of_the_policys_clipping(tiny_model_path, tmp_path):
    """With LoRA the PRM is adapter "prm" on the policy's model. While its step is held for the policy's, its
    gradients are off its parameters: the policy's gradient clipping (and grad_norm) sees the policy's only; the PRM
    still trains."""
    from peft import LoraConfig

    from trl_prime.modeling import adapter_parameters

    seen = []

    class AtPolicyStep(TrainerCallback):
        trainer = None

        def on_pre_optimizer_step(self, args, state, control, **kw):
            prm = [p for _, p in adapter_parameters(self.trainer.model, "prm")]
            seen.append((len(prm), sum(p.grad is not None for p in prm), self.trainer.prm_optim.pending))

    cb = AtPolicyStep()
    trainer = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=lambda completions, prompts, **kw: [float(j % 2 == 0) for j in range(len(prompts))],
        args=snapshot_config(PrimeRLOOConfig, tmp_path, max_steps=1),
        train_dataset=tiny_prompt_dataset(16),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        callbacks=[cb],
    )
    cb.trainer = trainer
    before = [p.detach().clone() for _, p in adapter_parameters(trainer.model, "prm")]
    trainer.train()
    n_prm, with_grad, pending = seen[0]
    assert n_prm > 0 and with_grad == 0 and pending  # held, its gradients stashed
    after = [p.detach() for _, p in adapter_parameters(trainer.model, "prm")]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # and applied with the policy's step
    assert trainer.prm_optim.num_updates == 1 and not trainer.prm_optim.pending
