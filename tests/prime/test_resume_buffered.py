"""Exact resume when one generation batch feeds several optimizer steps (issue 12, item 9), single process on CPU.

TRL's GRPO/RLOO trainers generate once every ``steps_per_generation * num_iterations`` micro-steps and train the steps
in between on a buffered generation batch (``_buffered_inputs``, slice ``_step % steps_per_generation``). A checkpoint
taken inside that window must carry the buffer and the micro-step counter: a run stopped after step ``ckpt + 1`` and
resumed from ``checkpoint-<ckpt>`` must then log the same metrics, generate for the same prompts, and end with the same
policy and PRM weights, bit for bit, as the uninterrupted run (and PRIME must not update its PRM twice on one
generation batch). A run resumed in a later epoch must walk the prompts in the uninterrupted run's order.
"""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch
from helpers import SCRIPTS, launch_argv, run_launched, tiny_kwargs, tiny_trainer
from tiny import contains_reward, tiny_prompt_dataset
from transformers import TrainerCallback

from trl_prime.modeling import unwrap


K = 4
MAX_STEPS = 6


@pytest.fixture(scope="module")
def step_prm_path(tmp_path_factory):
    from tiny_prm import build_tiny_step_prm

    return build_tiny_step_prm(tmp_path_factory.mktemp("resume_step_prm"))


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def recording_reward(seen: list, inf_at_step: int | None = None):
    """contains_reward('e') that records (optimizer step, prompts) of every generation batch it scores; +inf for row 5
    of the generation batch of optimizer step ``inf_at_step``."""
    base = contains_reward("e")

    def reward_e(completions, prompts=None, trainer_state=None, **kw):
        seen.append((trainer_state.global_step + 1, tuple(prompts)))
        out = base(completions)
        if trainer_state.global_step + 1 == inf_at_step:
            out[5] = float("inf")
        return out

    return reward_e


def make(
    which,
    model_path,
    prm_path,
    out,
    seen,
    *,
    spg,
    num_iterations,
    grad_accum,
    save_steps,
    callbacks=None,
    inf_at_step=None,
    num_prompts=16,
    max_steps=MAX_STEPS,
    **extra,
):
    kw = tiny_kwargs(out, output_dir=str(out), max_steps=max_steps, save_strategy="steps", save_steps=save_steps)
    kw.update(steps_per_generation=spg, num_iterations=num_iterations, gradient_accumulation_steps=grad_accum)
    kw.update(extra)
    common = dict(
        model=model_path,
        reward_funcs=recording_reward(seen, inf_at_step),
        train_dataset=tiny_prompt_dataset(num_prompts),
        callbacks=callbacks,
    )
    prime = dict(prm_learning_rate=1e-2, filter_lower=0.0, filter_upper=1.0)
    return tiny_trainer(which, kw, prime, prof_prm=prm_path, **common)


def _snap(module):
    return {k: v.detach().clone() for k, v in unwrap(module).state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(tr):
    return {
        h["step"]: {k: v for k, v in h.items() if "time" not in k and "per_second" not in k}
        for h in tr.state.log_history
        if "loss" in h and "train_runtime" not in h
    }


# (trainer, steps_per_generation, num_iterations, gradient_accumulation_steps, checkpoint step): every checkpoint lies
# inside a generation window (ckpt * grad_accum is not a multiple of steps_per_generation * num_iterations)
CASES = [
    ("prime_rloo", 2, 2, 1, 2),
    ("prime_grpo", 2, 2, 1, 2),
    ("prl", 2, 2, 1, 2),
    ("prof", 2, 2, 1, 2),
    ("prime_grpo", 1, 2, 1, 3),  # one micro-batch per generation, reused once: checkpoint between the two passes
    ("prime_rloo", 2, 2, 2, 3),  # gradient accumulation over the two slices of a generation batch
    ("prl", 1, 3, 1, 4),
    ("prof", 2, 1, 3, 1),  # more micro-steps per optimizer step than per generation: step 2 spans two generations
]


def check_resume(
    which,
    model_path,
    prm_path,
    tmp_path,
    *,
    spg,
    num_iterations,
    grad_accum,
    ckpt,
    num_prompts=16,
    max_steps=MAX_STEPS,
):
    """Uninterrupted run vs run stopped after step ckpt + 1 and resumed from checkpoint-<ckpt>: bit for bit."""
    opts = dict(
        spg=spg,
        num_iterations=num_iterations,
        grad_accum=grad_accum,
        save_steps=ckpt,
        num_prompts=num_prompts,
        max_steps=max_steps,
    )
    seen_full, seen_first = [], []
    full = make(which, model_path, prm_path, tmp_path / "full", seen_full, **opts)
    full.train()
    assert full.state.global_step == max_steps
    first = make(
        which, model_path, prm_path, tmp_path / "resumed", seen_first, callbacks=[StopAfter(ckpt + 1)], **opts
    )
    first.train()
    assert first.state.global_step == ckpt + 1
    checkpoint = tmp_path / "resumed" / f"checkpoint-{ckpt}"
    assert os.path.isdir(checkpoint)
    seen_second = []
    second = make(which, model_path, prm_path, tmp_path / "resumed", seen_second, **opts)
    second.train(resume_from_checkpoint=str(checkpoint))
    assert second.state.global_step == max_steps

    # the resumed run generates for the prompts the uninterrupted run generated for after the checkpoint, no others
    assert seen_second == [s for s in seen_full if s[0] > ckpt]
    # the same metrics at every step after the checkpoint
    a, b = _rows(full), _rows(second)
    for step in range(ckpt + 1, max_steps + 1):
        assert set(a[step]) == set(b[step]), (step, set(a[step]) ^ set(b[step]))
        for k in a[step]:
            x, y = a[step][k], b[step][k]
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), (step, k, x, y)
    # and the same weights at the end, which the steps after the checkpoint changed
    assert _same(_snap(full.model), _snap(second.model))
    assert not _same(_snap(first.model), _snap(second.model))
    if hasattr(full, "implicit_prm"):
        assert _same(_snap(full.prm_model), _snap(second.prm_model))
        generations = -(-max_steps * grad_accum // (spg * num_iterations))  # one PRM update per generation batch
        assert second.prm_optim.num_updates == full.prm_optim.num_updates == generations
    return torch.load(checkpoint / "generation_state_0.pt", weights_only=True)


@pytest.mark.parametrize(
    "which,spg,num_iterations,grad_accum,ckpt",
    CASES,
    ids=[f"{c[0]}-spg{c[1]}-it{c[2]}-ga{c[3]}-ckpt{c[4]}" for c in CASES],
)
def test_resume_inside_a_generation_window_is_bit_identical(
    tiny_model_path, step_prm_path, tmp_path, which, spg, num_iterations, grad_accum, ckpt
):
    assert (ckpt * grad_accum) % (spg * num_iterations) != 0  # the checkpoint is taken mid-window
    state = check_resume(
        which,
        tiny_model_path,
        step_prm_path,
        tmp_path,
        spg=spg,
        num_iterations=num_iterations,
        grad_accum=grad_accum,
        ckpt=ckpt,
    )
    # the checkpoint holds the buffered generation batch and TRL's micro-step counter
    assert state["step"] == ckpt * grad_accum and len(state["buffered_inputs"]) == spg


@pytest.mark.parametrize(
    "which,spg,num_iterations,ckpt,max_steps",
    [("prl", 1, 1, 3, 6), ("prime_rloo", 2, 2, 5, 10)],
    ids=["prl-spg1-it1-ckpt3", "prime_rloo-spg2-it2-ckpt5"],
)
def test_resume_in_a_later_epoch_is_bit_identical(
    tiny_model_path, tmp_path, which, spg, num_iterations, ckpt, max_steps
):
    """4 prompts: an epoch is 2 steps (spg=1, it=1) or 4 steps (spg=2, it=2); the checkpoint lies in the second
    epoch (at a generation boundary, then inside a generation window), and the run goes on into the third: each
    epoch's prompt order, which TRL's RepeatSampler draws after the previous epochs', is the uninterrupted run's."""
    state = check_resume(
        which,
        tiny_model_path,
        None,
        tmp_path,
        spg=spg,
        num_iterations=num_iterations,
        grad_accum=1,
        ckpt=ckpt,
        num_prompts=4,
        max_steps=max_steps,
    )
    assert (state["buffered_inputs"] is None) == (ckpt % (spg * num_iterations) == 0)


def test_poisoned_generation_batch_stays_skipped_after_resume(tiny_model_path, tmp_path):
    """An inf reward in the generation batch of step 1 skips every step trained on that batch (steps 1-4 with
    steps_per_generation=2, num_iterations=2): after resuming from checkpoint-2, steps 3 and 4 are still skipped."""
    opts = dict(spg=2, num_iterations=2, grad_accum=1, save_steps=2, inf_at_step=1, max_nonfinite_skips=10)
    full = make("prl", tiny_model_path, None, tmp_path / "full", [], **opts)
    full.train()
    make("prl", tiny_model_path, None, tmp_path / "resumed", [], callbacks=[StopAfter(3)], **opts).train()
    second = make("prl", tiny_model_path, None, tmp_path / "resumed", [], **opts)
    second.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    a, b = _rows(full), _rows(second)
    assert [a[s].get("guard/skipped_steps") for s in range(1, 7)] == [1.0] * 4 + [None] * 2
    assert [b[s].get("guard/skipped_steps") for s in range(3, 7)] == [1.0] * 2 + [None] * 2
    assert second.guards.total_skips == full.guards.total_skips == 4
    assert _same(_snap(full.model), _snap(second.model))


def test_checkpoint_without_or_with_another_generation_layout_warns(tiny_model_path, tmp_path, caplog):
    """A checkpoint inside a generation window without generation_state_0.pt (an older trl-prime) or written with
    another batch layout: the resumed run warns that it generates a new batch, and trains on."""
    opts = dict(spg=2, num_iterations=2, grad_accum=1, save_steps=2)
    make("prl", tiny_model_path, None, tmp_path / "out", [], callbacks=[StopAfter(2)], **opts).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    seen = []
    with caplog.at_level(logging.WARNING, logger="trl_prime.checkpointing"):
        tr = make("prl", tiny_model_path, None, tmp_path / "out", seen, **dict(opts, num_iterations=1))
        tr.train(resume_from_checkpoint=str(checkpoint))
    assert "written with another batch layout (checkpoint -> now: {'num_iterations': (2, 1)})" in caplog.text
    assert seen[0][0] == 3 and tr.state.global_step == MAX_STEPS  # a new generation batch at the first step
    os.remove(checkpoint / "generation_state_0.pt")
    caplog.clear()
    seen = []
    with caplog.at_level(logging.WARNING, logger="trl_prime.checkpointing"):
        tr = make("prl", tiny_model_path, None, tmp_path / "out", seen, **opts)
        tr.train(resume_from_checkpoint=str(checkpoint))
    assert "has no generation_state_0.pt (written by an older trl-prime)" in caplog.text
    assert "generates a new batch from the next prompts at step 3" in caplog.text
    assert seen[0][0] == 3 and tr.state.global_step == MAX_STEPS


@pytest.mark.slow
def test_two_processes_resume_inside_a_generation_window(tiny_model_path, tmp_path):
    """DDP over gloo, 2 processes: each process saves and restores its own buffered generation batch
    (generation_state_<rank>.pt); the resumed PRIME-RLOO run equals the uninterrupted one bit for bit (and a CPU
    process's device, "cpu:0", loads the PRM optimizer state)."""
    script = os.path.join(SCRIPTS, "resume_buffered_distributed.py")
    proc = run_launched(launch_argv(script, "--model", tiny_model_path, "--out", str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(tmp_path / "result.json") as f:
        r = json.load(f)
    assert r["losses"]["full"] == r["losses"]["resumed"] and sorted(r["losses"]["full"]) == ["3", "4", "5", "6"]
    assert r["policy"][0] == r["policy"][1] and r["prm"][0] == r["prm"][1]
    assert r["prm_updates"] == [2, 2]
    assert {"generation_state_0.pt", "generation_state_1.pt"} <= set(r["files"])
