"""The online implicit PRM learns to rank, and a PRM trained the wrong way is caught.

A toy signal the PRM can learn: the verifier pays 1 for a completion containing "e" (a token the tiny model samples
in about half its completions). The policy's learning rate is 0, so the rollout distribution stays fixed and only
the PRM moves. Trained on the outcome labels, its pair accuracy (prm/pair_accuracy: correct completions ranked above
wrong ones within a prompt's group) must rise well above chance (0.5) within 20 steps; trained on flipped labels it
must fall below chance, and with its loss cut off from its weights it must stay at exactly 0.5 (every reward 0).
"""

from __future__ import annotations

import pytest
from helpers import tiny_config
from tiny import contains_reward, tiny_prompt_dataset

from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer


def _pair_accuracy(tiny_model_path, tmp_path, monkeypatch, sabotage: str | None, **overrides) -> list[float]:
    import trl_prime.prime.trainer as prime_trainer

    real = prime_trainer.F.implicit_prm_loss
    if sabotage == "flipped_labels":

        def flipped(*args, labels, **kw):
            return real(*args, labels=1.0 - labels, **kw)

        monkeypatch.setattr(prime_trainer.F, "implicit_prm_loss", flipped)
    elif sabotage == "no_gradient":

        def detached(*args, prm_logps, **kw):
            return real(*args, prm_logps=prm_logps.detach().requires_grad_(), **kw)

        monkeypatch.setattr(prime_trainer.F, "implicit_prm_loss", detached)
    args = tiny_config(
        PrimeRLOOConfig,
        tmp_path,
        per_device_train_batch_size=32,
        max_steps=20,
        learning_rate=0.0,  # the policy stays put: only the PRM learns
        prm_learning_rate=1e-2,
        filter_lower=0.0,
        filter_upper=1.0,
        **overrides,
    )
    trainer = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        args=args,
        train_dataset=tiny_prompt_dataset(160),
    )
    trainer.train()
    return [h["prm/pair_accuracy"] for h in trainer.state.log_history if "prm/pair_accuracy" in h]


@pytest.mark.parametrize("sabotage", [None, "flipped_labels", "no_gradient"])
def test_online_prm_pair_accuracy_rises_only_when_it_learns_the_right_way(
    tiny_model_path, tmp_path, monkeypatch, sabotage
):
    acc = _pair_accuracy(tiny_model_path, tmp_path, monkeypatch, sabotage)
    assert len(acc) == 20
    assert acc[0] == 0.5  # the untrained PRM (= its reference) ties every pair
    late = sum(acc[10:]) / 10
    if sabotage is None:
        assert late > 0.6, acc
    elif sabotage == "flipped_labels":
        assert late < 0.4, acc
    else:
        assert all(a == 0.5 for a in acc), acc
