"""The online PRM's replay of recent rounds (``prm_replay_rounds``): the window's bookkeeping, the update's mean over
the round and the window, the guard's promise (a dropped step keeps its round out), exact resume, and a PRM that
still learns the toy signal of tests/prime/test_prm_learns.py with a replay."""

from __future__ import annotations

import pytest
import torch
from helpers import interrupted_and_full, poison_advantages_on_round, snapshot_config, train_with_snapshots
from test_prm_learns import _pair_accuracy
from test_prm_levers import one_right_of_four
from tiny import tiny_prompt_dataset

from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer
from trl_prime.prime.replay import ROW_FIELDS, PrmReplay, select_rows


def _batch(value: float, rows: int = 2) -> dict:
    return {
        "input_ids": torch.full((rows, 3), int(value)),
        "attention_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_mask": torch.ones(rows, 2),
        "labels": torch.full((rows,), value / 4),
        "ref_logps": torch.full((rows, 2), -value),
        "mm": {},
    }


def test_window_keeps_the_last_rounds_whose_step_was_taken(tmp_path):
    replay = PrmReplay(2)
    for v in (1.0, 2.0, 3.0):
        replay.stage(_batch(v))
        replay.commit()
    assert [b["labels"][0].item() for b in replay.batches()] == [0.5, 0.75]  # oldest dropped, oldest first
    replay.stage(_batch(4.0))
    replay.drop()  # its step was dropped: the round stays out
    replay.commit()  # nothing staged: nothing joins
    assert len(replay) == 2 and [b["labels"][0].item() for b in replay.batches()] == [0.5, 0.75]
    replay.save(str(tmp_path), 0)
    back = PrmReplay(2)
    back.load(str(tmp_path), 0)
    for a, b in zip(replay.batches(), back.batches()):
        assert all(torch.equal(a[k], b[k]) for k in ROW_FIELDS)
    with pytest.warns(UserWarning, match="prm_replay_rounds.*starts empty"):
        PrmReplay(2).load(str(tmp_path), 1)  # no file of process 1
    off = PrmReplay(0)
    off.stage(_batch(1.0))
    off.commit()
    assert off.batches() == [] and len(off) == 0
    with pytest.raises(ValueError, match="prm_replay_rounds"):
        PrmReplay(-1)


def test_select_rows_copies_the_rows_with_their_images(tmp_path):
    """A Qwen-VL-style round: ``pixel_values`` by image patches, ``image_grid_thw`` and the per-row ``num_images``
    list; rows 0 and 2 (1 and 2 images) keep their own patches, and the window saves and loads them."""
    from trl_prime.modeling import select_mm_rows

    batch = _batch(5.0, rows=3)
    batch["labels"] = torch.tensor([1.0, float("nan"), 0.0])
    # 4 images of 2 patches each: row 0 has image 0, row 1 image 1, row 2 images 2 and 3
    batch["mm"] = {
        "pixel_values": torch.arange(8.0).unsqueeze(1),
        "image_grid_thw": torch.tensor([[1, 1, 2]] * 4),
        "num_images": [1, 1, 2],
    }
    out = select_rows(batch, torch.tensor([0, 2]), select_mm_rows)
    assert out["labels"].tolist() == [1.0, 0.0] and out["input_ids"].shape == (2, 3)
    assert out["mm"]["pixel_values"].squeeze(1).tolist() == [0.0, 1.0, 4.0, 5.0, 6.0, 7.0]
    assert out["mm"]["num_images"] == [1, 2] and out["mm"]["image_grid_thw"].shape == (3, 3)
    out["ref_logps"].zero_()
    assert batch["ref_logps"][0, 0].item() == -5.0  # a copy, not a view
    replay = PrmReplay(1)
    replay.stage(out)
    replay.commit()
    replay.save(str(tmp_path), 0)
    back = PrmReplay(1)
    back.load(str(tmp_path), 0)
    assert back.batches()[0]["mm"]["num_images"] == [1, 2]
    assert torch.equal(back.batches()[0]["mm"]["pixel_values"], out["mm"]["pixel_values"])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"prm_replay_rounds": -1}, ">= 0"),
        ({"prm_replay_rounds": 2, "prm_loss": "dpo"}, "prm_loss='ce'"),
        ({"prm_replay_rounds": 2, "prm_reference": "policy"}, "prm_reference='sft'"),
    ],
)
def test_config_errors_name_the_field(tmp_path, kw, match):
    with pytest.raises(ValueError, match=f"prm_replay_rounds.*{match}"):
        snapshot_config(PrimeRLOOConfig, tmp_path, **kw)


def test_update_is_one_mean_over_the_round_and_the_window(tiny_model_path, tmp_path, monkeypatch):
    """prm_replay_rounds=1, 8 labelled rows a round: round 1 trains on its 8 rows (normaliser 8); round 2 on its own
    8 and round 1's 8, replayed exactly (token ids, labels, reference log-probs), normaliser 16, and the micro-batch
    shares of the two sum to 1."""
    calls = []
    trainer = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=one_right_of_four,
        args=snapshot_config(PrimeRLOOConfig, tmp_path, prm_replay_rounds=1, logging_steps=1),
        train_dataset=tiny_prompt_dataset(32),
    )
    real = trainer._prm_ce_backward

    def spy(batch, unscored, norm, weights, rest):
        calls.append(({k: batch[k].clone() for k in ROW_FIELDS}, norm, rest))
        return real(batch, unscored, norm, weights, rest)

    monkeypatch.setattr(trainer, "_prm_ce_backward", spy)
    trainer.train()
    assert [(c[1], c[2]) for c in calls] == [(8.0, True), (16.0, True), (16.0, False)]
    round1, replayed = calls[0][0], calls[2][0]
    for k in ROW_FIELDS:
        assert torch.equal(round1[k], replayed[k]), k
    assert replayed["labels"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    logged = [h["prm/replay_rows"] for h in trainer.state.log_history if "prm/replay_rows" in h]
    assert logged == [0.0, 8.0]
    assert len(trainer.prm_replay) == 1  # the window holds round 2 now (1 round): round 2's rows, on the CPU
    window = trainer.prm_replay.batches()[0]
    assert all(torch.equal(window[k], calls[1][0][k].cpu()) for k in ROW_FIELDS)


def test_skipped_policy_step_keeps_its_round_out_of_the_window(tiny_model_path, tmp_path, monkeypatch):
    """Round 2's advantages are poisoned after the PRM's backward: its held PRM step is dropped, and so are its rows
    (the window still holds round 1 alone)."""
    poison_advantages_on_round(monkeypatch, 2)
    trainer, snap = train_with_snapshots(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, one_right_of_four, prm_replay_rounds=2
    )
    assert trainer.prm_optim.num_updates == 1
    assert len(trainer.prm_replay) == 1 and trainer.prm_replay._staged is None


def test_resumed_run_restores_the_window(tiny_model_path, tmp_path):
    """A run with prm_replay_rounds=2 stopped at step 2 and resumed from its checkpoint ends with the PRM and policy
    of the uninterrupted run, bit for bit (the window travels in prm_replay_0.pt)."""

    def make(out, callbacks=None):
        args = snapshot_config(
            PrimeRLOOConfig, tmp_path, output_dir=str(out), prm_replay_rounds=2, max_steps=4, save_strategy="steps",
            save_steps=2,
        )  # fmt: skip
        return PrimeRLOOTrainer(
            model=tiny_model_path,
            reward_funcs=one_right_of_four,
            args=args,
            train_dataset=tiny_prompt_dataset(32),
            callbacks=callbacks,
        )

    full, second = interrupted_and_full(make, tmp_path)
    assert (tmp_path / "resumed" / "checkpoint-2" / "prm_replay_0.pt").is_file()
    assert len(second.prm_replay) == 2
    for a, b in zip(full.prm_model.parameters(), second.prm_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def test_prm_with_a_replay_still_learns_the_toy_signal(tiny_model_path, tmp_path, monkeypatch):
    """The toy signal of test_prm_learns.py, with the last 2 rounds replayed: the pair accuracy still rises well
    above chance, and flipped labels still drive it below (a replay of wrong targets is caught too)."""
    right = _pair_accuracy(tiny_model_path, tmp_path / "right", monkeypatch, None, prm_replay_rounds=2)
    assert sum(right[10:]) / 10 > 0.6, right
    flipped = _pair_accuracy(tiny_model_path, tmp_path / "flipped", monkeypatch, "flipped_labels", prm_replay_rounds=2)
    assert sum(flipped[10:]) / 10 < 0.4, flipped


def test_class_balance_weighs_the_round_and_the_window_together(tiny_model_path, tmp_path, monkeypatch):
    """prm_class_balance with prm_replay_rounds=1: round 2's CE weights come from the label masses of its 8 rows and
    round 1's 8 (1 right in 4 each: P = 4, N = 12), so each right row weighs 1/4 and each wrong one 1/12 in both
    batches, and the normaliser is their sum, 2 (each side 1)."""
    calls = []
    trainer = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=one_right_of_four,
        args=snapshot_config(PrimeRLOOConfig, tmp_path, prm_replay_rounds=1, prm_class_balance=True),
        train_dataset=tiny_prompt_dataset(32),
    )
    real = trainer._prm_ce_backward

    def spy(batch, unscored, norm, weights, rest):
        calls.append((batch["labels"].clone(), norm, weights.clone()))
        return real(batch, unscored, norm, weights, rest)

    monkeypatch.setattr(trainer, "_prm_ce_backward", spy)
    trainer.train()
    assert len(calls) == 3
    assert calls[0][1] == pytest.approx(2.0)  # round 1 alone: P = 2, N = 6
    assert torch.allclose(calls[0][2], torch.where(calls[0][0] == 1, 0.5, 1 / 6))
    for labels, norm, weights in calls[1:]:
        assert norm == pytest.approx(2.0)
        assert torch.allclose(weights, torch.where(labels == 1, 0.25, 1 / 12))
