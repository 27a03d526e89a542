"""Levers on the online implicit PRM: class-balanced cross-entropy (``prm_class_balance``) and several PRM updates per
generation round (``prm_epochs``). Hand-computed weights and losses, the update count, and the guard's promise that
a skipped policy step drops every PRM update of its round."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_same_state, poison_advantages_on_round, snapshot_config, train_with_snapshots, trainer_state
from tiny import tiny_prompt_dataset

import trl_prime.functional as F
from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer


# ----------------------------------------------------------------------------------------------------------------
# class_balanced_weights and the weighted CE
# ----------------------------------------------------------------------------------------------------------------
def test_class_balanced_weights_by_hand():
    # 1 right of 4 (and an unscorable row): P = 1, N = 3 -> 1/1 for the right one, 1/3 for each wrong one
    w = F.class_balanced_weights(torch.tensor([1.0, 0.0, 0.0, 0.0, float("nan")]))
    assert torch.allclose(w, torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3, 0.0]))
    assert w[0].item() == pytest.approx(w[1:4].sum().item())  # each side weighs 1
    # a fractional label splits its weight: labels 0.5, 1, 0 -> P = 1.5, N = 1.5
    w = F.class_balanced_weights(torch.tensor([0.5, 1.0, 0.0]))
    assert torch.allclose(w, torch.tensor([0.5 / 1.5 + 0.5 / 1.5, 1 / 1.5, 1 / 1.5]))
    # global masses given (another process holds more rows): P = 4, N = 12
    w = F.class_balanced_weights(torch.tensor([1.0, 0.0]), pos_mass=4.0, neg_mass=12.0)
    assert torch.allclose(w, torch.tensor([0.25, 1 / 12]))
    # one side empty: the plain mean (1 on every labelled row)
    assert torch.equal(F.class_balanced_weights(torch.tensor([1.0, 1.0, float("nan")])), torch.tensor([1.0, 1.0, 0.0]))


def test_weighted_ce_by_hand():
    # sequence rewards r = beta * sum(prm - ref): 0.05 * 20 = 1.0 and 0.05 * -20 = -1.0 and 0
    prm = torch.tensor([[10.0, 10.0], [-10.0, -10.0], [0.0, 0.0]])
    ref = torch.zeros(3, 2)
    mask = torch.ones(3, 2, dtype=torch.bool)
    labels = torch.tensor([1.0, 0.0, 0.0])
    bce = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(-1.0)), math.log(2.0)]  # -log s(1), -log(1-s(-1)), ln 2
    plain = F.implicit_prm_loss(prm, ref, mask, labels, beta=0.05)
    assert plain.item() == pytest.approx(sum(bce) / 3, rel=1e-6)
    w = F.class_balanced_weights(labels)  # 1, 1/2, 1/2
    balanced = F.implicit_prm_loss(prm, ref, mask, labels, beta=0.05, row_weights=w)
    assert balanced.item() == pytest.approx((bce[0] + 0.5 * bce[1] + 0.5 * bce[2]) / 2, rel=1e-6)
    # all-ones weights are the plain mean
    ones = F.implicit_prm_loss(prm, ref, mask, labels, beta=0.05, row_weights=torch.ones(3))
    assert ones.item() == pytest.approx(plain.item(), rel=1e-6)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"row_weights": torch.tensor([1.0, -1.0])}, "finite and >= 0"),
        ({"row_weights": torch.tensor([1.0, float("inf")])}, "finite and >= 0"),
        ({"row_weights": torch.ones(3)}, "row_weights"),
        ({"row_weights": torch.ones(2), "loss_type": "dpo"}, "'ce' loss only"),
    ],
)
def test_row_weights_errors_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        F.implicit_prm_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.ones(2, 1), torch.tensor([1.0, 0.0]), **kw)


@pytest.mark.parametrize(
    "kw,match",
    [({"prm_epochs": 0}, "prm_epochs"), ({"prm_class_balance": True, "prm_loss": "dpo"}, "prm_class_balance")],
)
def test_config_errors_name_the_field(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        snapshot_config(PrimeRLOOConfig, tmp_path, **kw)


# ----------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------
def one_right_of_four(completions, prompts, **kwargs):
    return [float(j % 4 == 0) for j in range(len(prompts))]  # accuracy 0.25 per group: kept by the default filter


def test_class_balanced_prm_loss_weights_each_side_equally(tiny_model_path, tmp_path, monkeypatch):
    """8 rows per round, 2 groups of 1 right in 4: P = 2, N = 6, so each right row weighs 1/2 and each wrong one 1/6;
    the trainer's micro-batch losses use exactly these weights, and its shares of the global weight sum to 1."""
    import trl_prime.prime.trainer as prime_trainer

    real, seen = prime_trainer.F.implicit_prm_loss, []

    def spy(*args, **kw):
        seen.append((kw["labels"].clone(), None if kw.get("row_weights") is None else kw["row_weights"].clone()))
        return real(*args, **kw)

    monkeypatch.setattr(prime_trainer.F, "implicit_prm_loss", spy)
    trainer = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=one_right_of_four,
        args=snapshot_config(PrimeRLOOConfig, tmp_path, max_steps=1, prm_class_balance=True, prm_micro_batch_size=3),
        train_dataset=tiny_prompt_dataset(16),
    )
    trainer.train()
    labels = torch.cat([lab for lab, _ in seen])
    weights = torch.cat([w for _, w in seen])
    assert labels.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert torch.allclose(weights, torch.where(labels == 1, 0.5, 1 / 6))
    assert weights.sum().item() == pytest.approx(2.0)  # each side 1
    assert trainer.prm_optim.num_updates == 1


@pytest.mark.parametrize("prm_update", ["single", "double"])
def test_prm_epochs_take_that_many_updates_per_round(tiny_model_path, tmp_path, prm_update):
    """prm_epochs=3: three PRM optimizer steps per round, held with the policy's step ('single') or at once
    ('double'); the PRM's schedule counts them (linear decay over 3 x the rounds), and the PRM moves further than
    with one update."""
    trainer, snap = train_with_snapshots(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path / "three", one_right_of_four, prm_epochs=3,
        prm_update=prm_update,
    )  # fmt: skip
    assert snap.after_step1["prm_updates"] == 3 and trainer.prm_optim.num_updates == 6
    assert trainer.prm_lr_scheduler.state_dict()["last_epoch"] == 6
    assert trainer.prm_optim.lr_scheduler.lr_lambdas[0](6) == 0.0  # 2 steps x 3 updates: the schedule's end
    one, snap1 = train_with_snapshots(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path / "one", one_right_of_four, prm_update=prm_update
    )
    assert snap1.after_step1["prm_updates"] == 1
    base = [p.detach().clone() for p in PrimeRLOOTrainer(
        model=tiny_model_path, reward_funcs=one_right_of_four, args=snapshot_config(PrimeRLOOConfig, tmp_path / "init"),
        train_dataset=tiny_prompt_dataset(8),
    ).prm_model.parameters()]  # fmt: skip

    def moved(state):
        return sum((a - b).norm().item() for a, b in zip(state["prm"], base))

    assert moved(snap.after_step1) > 1.5 * moved(snap1.after_step1)


def test_skipped_policy_step_drops_every_prm_update_of_its_round(tiny_model_path, tmp_path, monkeypatch):
    """As tests/prime/test_empty_steps.py, with prm_epochs=3: round 2's advantages are poisoned after the PRM's first
    backward, the policy step is skipped, and none of round 2's three PRM updates is taken."""
    poison_advantages_on_round(monkeypatch, 2)
    trainer, snap = train_with_snapshots(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, one_right_of_four, max_steps=2, prm_epochs=3
    )
    assert snap.after_step1["prm_updates"] == 3
    assert_same_state(snap.after_step1, snap.after_step2)
    assert trainer_state(trainer)["prm_updates"] == 3
    assert trainer._held_prm_updates is None
