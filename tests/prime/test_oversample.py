"""Oversampling for the online prompt filter (`oversample_factor`, trl_prime/prime/oversample.py): hand-computed
selections, and the PRIME trainers training a full batch of groups that pass the filter."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import interrupted_and_full, tiny_config
from tiny import tiny_prompt_dataset

from trl_prime import PrimeGRPOConfig, PrimeGRPOTrainer, PrimeRLOOConfig, PrimeRLOOTrainer
from trl_prime.prime.oversample import compaction_rows, oversampled_groups, select_first_groups


K = 4


# ----------------------------------------------------------------------------------------------------------------
# Pure parts
# ----------------------------------------------------------------------------------------------------------------
def test_oversampled_groups_hand():
    assert oversampled_groups(2, 1.0, K) == 2  # no oversampling
    assert oversampled_groups(2, 4.0, K) == 8  # the released recipe's factor
    assert oversampled_groups(3, 1.5, K) == 5  # ceil(4.5)
    assert oversampled_groups(4, 1.5, K) == 6  # exactly 6, no rounding up from float error
    # rows must split over the processes: 5 groups x 3 = 15 rows over 2 processes -> 6 groups (18 rows)
    assert oversampled_groups(3, 1.5, 3, num_processes=2) == 6
    assert oversampled_groups(3, 1.5, 4, num_processes=2) == 5  # 20 rows split already
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="oversample_factor"):
            oversampled_groups(2, bad, K)


def test_select_first_groups_hand():
    # 5 groups of 2: groups 1, 2 and 4 pass; target 2 -> groups 1 and 2 (the first that pass, in row order)
    passed = torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    got = select_first_groups(passed, 2, 2)
    assert got.tolist() == [False, False, True, True, True, True, False, False, False, False]
    # fewer pass than the target: all of them
    assert torch.equal(select_first_groups(passed, 2, 5), passed)
    assert not select_first_groups(torch.zeros(6, dtype=torch.bool), 2, 2).any()
    with pytest.raises(ValueError, match="whole groups"):
        select_first_groups(torch.tensor([1, 0, 1, 1], dtype=torch.bool), 2, 1)
    with pytest.raises(ValueError, match="groups of"):
        select_first_groups(torch.ones(5, dtype=torch.bool), 2, 1)


def test_compaction_rows_hand():
    selected = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    # the selected rows in order, then the first unselected ones to fill 6 rows
    assert compaction_rows(selected, 6).tolist() == [2, 3, 6, 7, 0, 1]
    assert compaction_rows(selected, 4).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="compact"):
        compaction_rows(selected, 3)  # 4 selected rows do not fit in 3


def test_config_validates_oversample_factor(tmp_path):
    base = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    assert PrimeRLOOConfig(**base).oversample_factor == 1.0
    assert PrimeGRPOConfig(**base, oversample_factor=4).oversample_factor == 4
    for bad in (0.5, float("nan"), True):
        with pytest.raises(ValueError, match="oversample_factor"):
            PrimeRLOOConfig(**base, oversample_factor=bad)


# ----------------------------------------------------------------------------------------------------------------
# The trainers
# ----------------------------------------------------------------------------------------------------------------
def _number(prompt_text: str) -> int:
    return int(re.search(r"What is (\d+) \+", prompt_text).group(1))


def odd_prompts_pass(completions, prompts, **kwargs):
    """An odd-numbered prompt's group gets 1, 0, 1, 0 (accuracy 0.5: the filter keeps it); an even one's all 1
    (accuracy 1 > 0.8: filtered). Rows of one group are contiguous, so the position decides 1 or 0."""
    return [float(j % 2 == 0) if _number(p) % 2 else 1.0 for j, p in enumerate(prompts)]


def _capture_inputs(trainer):
    """Record every micro-batch TRL's ``_prepare_inputs`` returns (what the policy loss sees)."""
    seen = []
    inner = trainer._prepare_inputs

    def wrapped(batch):
        out = inner(batch)
        seen.append(out)
        return out

    trainer._prepare_inputs = wrapped
    return seen


def _kept_prompt_numbers(trainer, inputs) -> list[int]:
    rows = inputs["prime_loss_mask"].sum(-1) > 0
    texts = trainer.processing_class.batch_decode(inputs["prompt_ids"][rows], skip_special_tokens=True)
    return [_number(t) for t in texts]


def _args(cls, tmp_path, **kw):
    # no max_steps: the runs here set it, or train one epoch
    return tiny_config(
        cls, tmp_path, drop=("max_steps",), **{"max_completion_length": 6, "prm_learning_rate": 1e-3, **kw}
    )


def test_rloo_trains_a_full_batch_of_groups_that_pass(tiny_model_path, tmp_path):
    """8 rows per step (2 groups), factor 2: 4 prompts are generated per step, the first 2 odd-numbered ones train;
    the batch the loss sees has 8 rows, exactly those groups' rows weighted."""
    args = _args(PrimeRLOOConfig, tmp_path, oversample_factor=2.0, max_steps=4)
    from trl_prime.callbacks import PrimeCallback

    class Generated(PrimeCallback):
        def __init__(self):
            self.prompts = []

        def on_rollouts_scored(self, args, state, control, **kw):
            self.prompts.append(list(kw["prompts"]))

    generated = Generated()
    trainer = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=odd_prompts_pass,
        args=args,
        train_dataset=tiny_prompt_dataset(32),
        callbacks=[generated],
    )
    seen = _capture_inputs(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "filter/kept_groups" in h]
    assert len(logs) == 4 and len(seen) == 4 and len(generated.prompts) == 4
    for h, inputs, prompts in zip(logs, seen, generated.prompts):
        assert len(prompts) == 16  # 4 groups generated
        # the first two odd-numbered groups in the sampler's order are the ones that train
        order = [_number(p) for p in prompts[::K]]
        first_odd = [n for n in order if n % 2][:2]
        assert sorted(set(_kept_prompt_numbers(trainer, inputs))) == sorted(set(first_odd))
        assert inputs["prompt_ids"].size(0) == 8  # compacted to one generation batch
        passed = round(h["filter/kept_fraction"] * 4)  # of the 4 generated groups
        assert h["filter/kept_groups"] == min(2, passed)
        numbers = _kept_prompt_numbers(trainer, inputs)
        assert len(numbers) == K * h["filter/kept_groups"]
        assert all(n % 2 == 1 for n in numbers)  # only groups that pass the filter train
        assert inputs["num_items_in_batch"].item() == inputs["prime_loss_mask"].sum().item()
    # over 4 steps of 4 random prompts from 16 odd / 16 even, some step kept a full batch
    assert max(h["filter/kept_groups"] for h in logs) == 2


def test_grpo_oversampling_with_accumulation_steps_per_generation_and_iterations(tiny_model_path, tmp_path):
    """gradient_accumulation_steps=2 (so steps_per_generation=2: a generation batch of 16 rows, 4 groups),
    num_iterations=2, factor 1.5: 6 groups generated, the first <= 4 that pass train, compacted to 16 rows split in
    two micro-batches of 8, each reused for 2 iterations."""
    args = _args(
        PrimeGRPOConfig,
        tmp_path,
        oversample_factor=1.5,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_steps=2,
    )
    trainer = PrimeGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=odd_prompts_pass,
        args=args,
        train_dataset=tiny_prompt_dataset(32),
    )
    seen = _capture_inputs(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "filter/kept_groups" in h]
    assert len(seen) == 4  # 2 steps x 2 micro-batches
    assert all(inputs["prompt_ids"].size(0) == 8 for inputs in seen)
    kept = logs[0]["filter/kept_groups"]
    assert kept == min(4, round(logs[0]["filter/kept_fraction"] * 6))
    first_generation = seen[:2]  # one generation batch, split in two
    numbers = [n for inputs in first_generation for n in _kept_prompt_numbers(trainer, inputs)]
    assert len(numbers) == K * kept and all(n % 2 == 1 for n in numbers)
    # iterations 2 reuse the same rows (same buffered micro-batches)
    assert torch.equal(seen[2]["prompt_ids"], seen[0]["prompt_ids"]) or torch.equal(
        seen[2]["prompt_ids"], seen[1]["prompt_ids"]
    )


@pytest.mark.parametrize("num_prompts", [32, 8])
def test_oversampled_run_resumes_exactly(tiny_model_path, tmp_path, num_prompts):
    """A run with oversample_factor=2 stopped at step 2 and resumed from its checkpoint ends with the same policy,
    PRM and per-step metrics (kept groups included) as the uninterrupted run; with 8 prompts (4 per oversampled step)
    the checkpoint ends the first epoch, so the resumed run must replay that epoch's draw of the oversampling
    sampler before its second (the adapter records every train sampler, the oversampling one included)."""

    def make(out, callbacks=None):
        args = _args(
            PrimeRLOOConfig,
            tmp_path,
            output_dir=str(out),
            oversample_factor=2.0,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
        )
        return PrimeRLOOTrainer(
            model=tiny_model_path,
            reward_funcs=odd_prompts_pass,
            args=args,
            train_dataset=tiny_prompt_dataset(num_prompts),
            callbacks=callbacks,
        )

    full, second = interrupted_and_full(make, tmp_path)
    logs = {h["step"]: h for h in full.state.log_history if "filter/kept_groups" in h}
    resumed = {h["step"]: h for h in second.state.log_history if "filter/kept_groups" in h}
    for step in (3, 4):
        for k in ("filter/kept_groups", "filter/kept_fraction", "prm/loss", "loss", "reward"):
            assert resumed[step][k] == pytest.approx(logs[step][k], rel=1e-5, abs=1e-7), (step, k)
    for a, b in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full.prm_model.parameters(), second.prm_model.parameters()):
        assert torch.equal(a, b)
