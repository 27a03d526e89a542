"""Reliability (issue 8), single process on CPU: start-up errors, non-finite values, degenerate batches, verifier
infrastructure failures, atomic checkpoints and exact resume for the PRIME, PRL and PROF trainers."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import PRIME_OPEN, ROOT, SCRIPTS, TESTS, tiny_kwargs, tiny_trainer
from tiny import contains_reward, tiny_prompt_dataset
from transformers import TrainerCallback

from trl_prime import PrimeRLOOConfig, PRLConfig, PRLGRPOTrainer
from trl_prime.modeling import unwrap


K = 4


def _kw(tmp_path, **overrides):
    return tiny_kwargs(tmp_path, **{"max_steps": 2, **overrides})


def _trainer(
    which, path, tmp_path, reward=None, dataset=None, callbacks=None, trainer_kwargs=None, prm=None, **overrides
):
    """A tiny trainer of kind ``which`` (2 steps, 16 prompts, reward: contains "e"); PRIME with
    :data:`~helpers.PRIME_OPEN`, PROF scored by the step PRM ``prm``."""
    common = dict(
        model=path,
        reward_funcs=reward or contains_reward("e"),
        train_dataset=dataset if dataset is not None else tiny_prompt_dataset(16),
        callbacks=callbacks,
    )
    kw = _kw(tmp_path, **overrides)
    return tiny_trainer(which, kw, PRIME_OPEN, prof_prm=prm, **common, **(trainer_kwargs or {}))


def _prime(path, tmp_path, which="prime_rloo", **kw):
    return _trainer(which, path, tmp_path, **kw)


def _prl(path, tmp_path, **kw):
    return _trainer("prl", path, tmp_path, **kw)


def _prof(path, prm, tmp_path, **kw):
    return _trainer("prof", path, tmp_path, prm=prm, **kw)


def _snap(module):
    return {k: v.detach().clone() for k, v in unwrap(module).state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def step_prm_path(tmp_path_factory):
    from tiny_prm import build_tiny_step_prm

    return build_tiny_step_prm(tmp_path_factory.mktemp("rel_step_prm"))


class Snapshots(TrainerCallback):
    """Weights of the policy (and PRM) at the end of every optimizer step."""

    def __init__(self):
        self.trainer = None
        self.policy, self.prm = {}, {}

    def on_step_end(self, args, state, control, **kw):
        self.policy[state.global_step] = _snap(self.trainer.model)
        if hasattr(self.trainer, "implicit_prm"):
            self.prm[state.global_step] = _snap(self.trainer.prm_model)


# ----------------------------------------------------------------------------------------------------------------
# 1. Bad input: clear errors at start-up
# ----------------------------------------------------------------------------------------------------------------
def test_bad_input_fails_at_startup_naming_the_field(tiny_model_path, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig, PromptTuningConfig
    from tiny_prm import build_tiny_step_prm

    from trl_prime.rewards import math_reward

    no_prompt = Dataset.from_dict({"question": ["What is 1 + 1?"] * 4, "solution": ["2"] * 4})
    with pytest.raises(ValueError, match=r"no `prompt` column.*rename_column"):
        _prime(tiny_model_path, tmp_path, dataset=no_prompt)
    with pytest.raises(ValueError, match=r"no `prompt` column"):
        _prl(tiny_model_path, tmp_path, dataset=no_prompt)
    no_gold = Dataset.from_dict({"prompt": ["What is 1 + 1?"] * 4, "answer": ["2"] * 4})
    with pytest.raises(ValueError, match=r"math_reward.*\['solution'\].*rename_column\('answer', 'solution'\)"):
        _prime(tiny_model_path, tmp_path, reward=math_reward, dataset=no_gold)
    empty = Dataset.from_dict({"prompt": ["What is 1 + 1?", "  ", "What is 2 + 2?", ""], "solution": ["2"] * 4})
    with pytest.raises(ValueError, match=r"2 empty prompt\(s\) in column `prompt` \(rows \[1, 3\]\)"):
        _prl(tiny_model_path, tmp_path, dataset=empty)
    # a LoraConfig without task_type trains, as in TRL (tests/core/test_prm_label.py); a prompt-learning one is refused
    _prime(tiny_model_path, tmp_path, trainer_kwargs=dict(peft_config=LoraConfig(r=4, target_modules=["q_proj"])))
    with pytest.raises(ValueError, match=r"`peft_config` is a PROMPT_TUNING adapter.*no adapter weights"):
        _prime(tiny_model_path, tmp_path, trainer_kwargs=dict(peft_config=PromptTuningConfig(num_virtual_tokens=4)))
    step_prm = build_tiny_step_prm(tmp_path / "tok_cls")  # a token-classification model is not a causal LM
    with pytest.raises(ValueError, match=r"`prm_model`=.*ForTokenClassification checkpoint, not a causal LM"):
        _prime(tiny_model_path, tmp_path, prm_model=step_prm)
    with pytest.raises(ValueError, match=r"`prm_model`=.*missing_prm': no such folder"):  # the folder, named
        _prime(tiny_model_path, tmp_path, prm_model=str(tmp_path / "missing_prm"))
    # already checked by TRL (kept as regression tests): a batch not divisible into groups, a reward of wrong length
    with pytest.raises(ValueError, match=r"divisible by num_generations"):
        PrimeRLOOConfig(**_kw(tmp_path, per_device_train_batch_size=6))
    with pytest.raises(ValueError, match=r"divisible by num_generations"):
        PRLConfig(**_kw(tmp_path, per_device_train_batch_size=6))
    tr = _prl(tiny_model_path, tmp_path, reward=lambda completions, **kw: [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"returned 3 rewards, but 8 were expected"):
        tr.train()
    for bad in (dict(max_nonfinite_skips=0), dict(max_verifier_failure_rate=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PrimeRLOOConfig(**_kw(tmp_path, **bad))


def test_streaming_dataset_is_not_called_empty():
    """A streaming IterableDataset knows its columns but not its length: the start-up check still finds a missing
    column, and does not reject it as 'empty'."""
    from datasets import Dataset

    from trl_prime.guards import check_train_dataset
    from trl_prime.rewards import math_reward

    stream = Dataset.from_dict({"prompt": ["What is 1 + 1?"] * 4, "solution": ["2"] * 4}).to_iterable_dataset()
    assert stream.column_names == ["prompt", "solution"] and not hasattr(stream, "__len__")
    check_train_dataset(stream, [math_reward])  # no error
    with pytest.raises(ValueError, match=r"no `prompt` column"):
        check_train_dataset(
            Dataset.from_dict({"question": ["1 + 1?"], "solution": ["2"]}).to_iterable_dataset(), [math_reward]
        )


def test_prm_path_check_honours_trust_remote_code(tmp_path):
    """A custom-code causal LM (config via `auto_map`) is loadable with trust_remote_code=True: the start-up check
    must load its config the same way instead of rejecting it as 'could not be loaded'."""
    import json

    from trl_prime.guards import check_causal_lm_source

    d = tmp_path / "remote_prm"
    d.mkdir()
    (d / "configuration_tiny_remote.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass TinyRemoteConfig(Qwen2Config):\n"
        "    model_type = 'tiny_remote_prm'\n"
    )
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "tiny_remote_prm",
                "architectures": ["TinyRemoteForCausalLM"],
                "auto_map": {"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig"},
            }
        )
    )
    with pytest.raises(ValueError, match=r"(?s)`prm_model`=.*could not be loaded.*trust_remote_code"):
        check_causal_lm_source(str(d), "prm_model")
    check_causal_lm_source(str(d), "prm_model", trust_remote_code=True)  # no error


# ----------------------------------------------------------------------------------------------------------------
# 2. Non-finite values never reach an optimizer step
# ----------------------------------------------------------------------------------------------------------------
def inf_at_step(step: int, row: int = 5):
    """contains_reward('e'), with +inf for one row in the generation of optimizer step `step` (1-based)."""
    base = contains_reward("e")

    def reward_inf(completions, trainer_state=None, **kw):
        out = base(completions)
        if trainer_state is not None and trainer_state.global_step + 1 == step:
            out[row] = float("inf")
        return out

    return reward_inf


@pytest.mark.parametrize("which", ["prime_rloo", "prime_grpo", "prl", "prof"])
def test_nonfinite_reward_skips_the_step_weights_unchanged(tiny_model_path, step_prm_path, tmp_path, which, caplog):
    snaps = Snapshots()
    reward = inf_at_step(2)
    tr = _trainer(which, tiny_model_path, tmp_path, reward=reward, callbacks=[snaps], max_steps=3, prm=step_prm_path)
    snaps.trainer = tr
    with caplog.at_level(logging.WARNING, logger="trl_prime.guards"):
        tr.train()
    assert _same(snaps.policy[1], snaps.policy[2])  # the poisoned step 2 left the policy bit-identical
    assert not _same(snaps.policy[2], snaps.policy[3])  # and training went on at step 3
    if snaps.prm:
        assert _same(snaps.prm[1], snaps.prm[2]) and not _same(snaps.prm[2], snaps.prm[3])
    text = caplog.text
    assert (
        "Non-finite values at step 2 (non-finite rewards)" in text
        and "rows of the global generation batch: [5]" in text
    )
    assert "sample ids: ['What is" in text
    logs = {h["step"]: h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h}
    assert logs[2].get("guard/skipped_steps") == 1.0 and "guard/skipped_steps" not in logs[3]
    assert tr.guards.consecutive_skips == 0 and tr.guards.total_skips == 1


def test_consecutive_nonfinite_steps_stop_the_run(tiny_model_path, tmp_path):
    def always_inf(completions, **kw):
        return [float("inf")] + [1.0] * (len(completions) - 1)

    tr = _prime(tiny_model_path, tmp_path, reward=always_inf, max_steps=5, max_nonfinite_skips=2)
    pol0, prm0 = _snap(tr.model), _snap(tr.prm_model)
    with pytest.raises(RuntimeError, match=r"2 consecutive optimizer steps were skipped.*`max_nonfinite_skips`=2"):
        tr.train()
    assert _same(pol0, _snap(tr.model)) and _same(prm0, _snap(tr.prm_model))
    assert tr.state.global_step == 1  # stopped during the second (skipped) step


def test_nonfinite_in_first_of_several_generation_batches_per_step_still_skips(tiny_model_path, tmp_path):
    """gradient_accumulation_steps=2, steps_per_generation=1: two generation batches feed one optimizer step. An inf
    reward in the first one must skip the step (and the PRM step of the second one) even though the second is clean:
    the poison must not be reset by the next generation batch before its optimizer step has run."""
    base = contains_reward("e")
    calls = {"n": 0}

    def inf_in_third_call(completions, **kw):
        calls["n"] += 1
        out = base(completions)
        if calls["n"] == 3:  # optimizer step 2, first of its two generation batches
            out[1] = float("inf")
        return out

    snaps = Snapshots()
    tr = _prime(
        tiny_model_path,
        tmp_path,
        reward=inf_in_third_call,
        callbacks=[snaps],
        max_steps=3,
        per_device_train_batch_size=K,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
    )
    snaps.trainer = tr
    tr.train()
    assert calls["n"] == 6
    assert _same(snaps.policy[1], snaps.policy[2]) and _same(snaps.prm[1], snaps.prm[2])
    assert not _same(snaps.policy[2], snaps.policy[3]) and not _same(snaps.prm[2], snaps.prm[3])
    assert tr.guards.total_skips == 1 and tr.guards.consecutive_skips == 0


def test_guarded_step_under_fp16_grad_scaler():
    """fp16 AMP (accelerate's optimizer holds a GradScaler): an inf gradient is a scaler overflow, which the scaler
    handles (step skipped, scale lowered), not a non-finite skip that counts towards max_nonfinite_skips; and a
    poisoned step skipped after gradient clipping (scaler.unscale_) must not break the next step's unscale_."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl_prime.guards import Guards

    p = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    class AcceleratedOptimizer:  # accelerate's wrapper, as far as the guard and the Trainer use it
        def __init__(self):
            self.optimizer, self.scaler, self._is_overflow, self.param_groups = (
                inner,
                scaler,
                False,
                inner.param_groups,
            )

        def zero_grad(self, set_to_none=True):
            inner.zero_grad(set_to_none=set_to_none)

        def step(self):
            before = p.detach().clone()
            self.scaler.step(inner)
            self.scaler.update()
            self._is_overflow = torch.equal(before, p.detach())

    metrics = defaultdict(list)
    acc = SimpleNamespace(num_processes=1, device=torch.device("cpu"), is_main_process=True)
    guards = Guards(
        SimpleNamespace(max_nonfinite_skips=1), acc, lambda mode, name, v: metrics[name].append(v), lambda: 0
    )
    opt = AcceleratedOptimizer()
    guards.wrap_optimizer(opt, lambda applied, reason=None: None)

    def step(weight):  # backward of the scaled loss, clipping's unscale_, the optimizer step (as Trainer does)
        scaler.scale((p * torch.tensor(weight)).sum()).backward()
        scaler.unscale_(inner)
        opt.step()
        opt.zero_grad()

    step([float("inf"), 1.0])  # overflow: the scaler skips and halves its scale; no guard skip, no stop
    assert torch.equal(p.detach(), torch.ones(2)) and scaler.get_scale() == 2.0 and guards.total_skips == 0
    guards.poison = {"reason": "non-finite rewards", "rows": [0], "sample_ids": []}
    with pytest.raises(RuntimeError, match="max_nonfinite_skips"):  # poisoned: skipped (limit 1 -> stop)
        step([1.0, 1.0])
    assert torch.equal(p.detach(), torch.ones(2)) and guards.total_skips == 1
    assert metrics["guard/skipped_steps"] == [1.0]
    guards.poison, guards.args.max_nonfinite_skips = None, 3
    step([1.0, 1.0])  # a good step: unscale_ works again, the weights move, the counter resets
    assert torch.equal(p.detach(), torch.zeros(2)) and guards.consecutive_skips == 0


def test_nan_logps_and_nan_prm_loss_skip_policy_and_prm(tiny_model_path, tmp_path, monkeypatch):
    """NaN in the PRM's log-probs (so in its loss, gradient and token rewards) at step 2: neither the PRM nor the
    policy moves; NaN in the rollout log-probs of PRL at step 1: no policy step."""
    import trl_prime.prime.trainer as pt

    snaps = Snapshots()
    tr = _prime(tiny_model_path, tmp_path, callbacks=[snaps], max_steps=3)
    snaps.trainer = tr
    real = pt.completion_logps

    def poisoned(model, input_ids, attention_mask, T, **kw):
        out = real(model, input_ids, attention_mask, T, **kw)
        if tr.state.global_step + 1 == 2:
            out = out.clone()
            out[0, 0] = float("nan")
        return out

    monkeypatch.setattr(pt, "completion_logps", poisoned)
    tr.train()
    assert _same(snaps.policy[1], snaps.policy[2]) and _same(snaps.prm[1], snaps.prm[2])
    assert not _same(snaps.prm[2], snaps.prm[3]) and not _same(snaps.policy[2], snaps.policy[3])
    assert tr.prm_optim.num_updates == 2  # steps 1 and 3
    monkeypatch.undo()

    class NaNLogps(PRLGRPOTrainer):
        def _prl_logps(self, *a, **kw):
            old, ref = super()._prl_logps(*a, **kw)
            if self.state.global_step == 0:
                old = old.clone()
                old[3, 0] = float("nan")
            return old, ref

    snaps = Snapshots()
    tr = NaNLogps(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        train_dataset=tiny_prompt_dataset(16),
        args=PRLConfig(**_kw(tmp_path / "prl", prl_eta=2.0)),
        callbacks=[snaps],
    )
    snaps.trainer = tr
    pol0 = _snap(tr.model)
    tr.train()
    assert _same(pol0, snaps.policy[1]) and not _same(snaps.policy[1], snaps.policy[2])


def test_none_rewards_are_excluded_not_zeroed(tiny_model_path, tmp_path):
    """A reward function returning None (PRL): the row's outcome is NaN (not 0), its weights are 0, and the other rows
    of its group get the weights of a group without it (zeroing it would shift their baseline)."""
    from trl_prime import functional as F

    def with_none(completions, **kw):
        return [None if i == 1 else float(i % 2 == 0 or i == 3) for i in range(len(completions))]  # group 0: 1,-,1,1

    tr = _prl(tiny_model_path, tmp_path, reward=with_none, max_steps=1)
    tr.train()
    last = tr._prl_last
    o = last["outcome_rewards"]
    assert torch.isnan(o[1]) and o[[0, 2, 3]].tolist() == [1.0, 1.0, 1.0]
    assert torch.all(last["advantages"][1] == 0)
    inputs = {k: v for k, v in last.items() if k not in ("advantages", "process_slice")}
    # group 0 without row 1 is all-correct: outcome advantage 0, only the KL-to-go remains; with row 1 zeroed, the
    # three correct rows would get a positive outcome advantage
    zeroed = F.prl_advantages(**{**inputs, "outcome_rewards": o.nan_to_num(0.0)})
    no_kl = F.prl_advantages(**{**inputs, "old_logps": inputs["ref_logps"]})
    assert torch.all(no_kl[[0, 2, 3]] == 0) and torch.all(
        zeroed[0][inputs["mask"][0]] > last["advantages"][0][inputs["mask"][0]]
    )


# ----------------------------------------------------------------------------------------------------------------
# 3. Degenerate batches
# ----------------------------------------------------------------------------------------------------------------
def test_degenerate_batches_no_crash_no_nan_warning_metrics(tiny_model_path, tmp_path):
    """Every completion truncated at length 1, every reward equal, every group filtered out (PRIME's default filter
    drops accuracy-1 groups), and in PRL a completion of length 0: finite losses and weights, warning metrics."""

    def ones(completions, **kw):
        return [1.0] * len(completions)

    tr = _prime(tiny_model_path, tmp_path, reward=ones, max_completion_length=1, filter_lower=0.2, filter_upper=0.8)
    pol0 = _snap(tr.model)
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
    for h in logs:
        assert h["guard/all_filtered"] == 1.0 and h["guard/all_truncated"] == 1.0
        assert h["guard/all_rewards_equal"] == 1.0 and h["guard/short_completion_fraction"] == 1.0
        assert math.isfinite(h["loss"]) and h["filter/kept_fraction"] == 0.0
    assert all(torch.isfinite(v).all() for v in _snap(tr.model).values()) and _same(pol0, _snap(tr.model))

    class EmptyRow(PRLGRPOTrainer):
        def _algorithm_step(self, output, cap):
            output["completion_mask"] = output["completion_mask"].clone()
            output["completion_mask"][0] = 0  # a completion of length 0
            return super()._algorithm_step(output, cap)

    tr = EmptyRow(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        train_dataset=tiny_prompt_dataset(16),
        args=PRLConfig(
            **_kw(tmp_path / "prl", prl_eta=2.0, max_completion_length=2, prl_step_split="length", prl_step_len=1)
        ),
    )
    tr.train()
    assert torch.isfinite(tr._prl_last["advantages"]).all()
    logs = [h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
    assert all(math.isfinite(h["loss"]) and h["guard/short_completion_fraction"] > 0 for h in logs)
    assert all(torch.isfinite(v).all() for v in _snap(tr.model).values())


# ----------------------------------------------------------------------------------------------------------------
# 4. Verifier infrastructure failures
# ----------------------------------------------------------------------------------------------------------------
def test_verifier_infrastructure_failures_fail_the_step_above_the_rate(tiny_model_path, tmp_path, monkeypatch):
    """The math worker pool cannot start: every completion gets None with reason `error`, counted; above
    `max_verifier_failure_rate` the step raises instead of training. Below it, the rate is logged."""
    from trl_prime.rewards import math_reward
    from trl_prime.rewards import math_verifier as mv

    mv.shutdown_math_workers()
    monkeypatch.setattr(mv, "_MATH_MODULE", "no_such_math_verify")  # the workers cannot import their judge
    for cache in ("_ANSWER_CACHE", "_GOLD_CACHE", "_GOLD_TIMEOUTS"):  # verdicts cached by earlier tests need no pool
        monkeypatch.setattr(mv, cache, type(getattr(mv, cache))())
    try:
        tr = _prl(tiny_model_path, tmp_path, reward=math_reward, max_steps=1)
        pol0 = _snap(tr.model)
        with pytest.raises(RuntimeError, match=r"8 of 8 completions \(100%\).*`max_verifier_failure_rate`=0.25"):
            tr.train()
        assert _same(pol0, _snap(tr.model))
    finally:
        monkeypatch.undo()
        mv.shutdown_math_workers()

    def half_broken(completions, log_metric=None, **kw):  # a custom verifier reporting sandbox failures
        n = len(completions) // 4
        log_metric("code/sandbox_error", float(n))
        return [None] * n + [1.0, 0.0] * ((len(completions) - n) // 2) + [1.0] * ((len(completions) - n) % 2)

    tr = _prime(tiny_model_path, tmp_path / "ok", reward=half_broken, max_steps=1, max_verifier_failure_rate=0.25)
    tr.train()
    assert tr.state.log_history[0]["verifier/failure_rate"] == 0.25
    tr = _prime(tiny_model_path, tmp_path / "bad", reward=half_broken, max_steps=1, max_verifier_failure_rate=0.2)
    with pytest.raises(RuntimeError, match=r"2 of 8 completions"):
        tr.train()


# ----------------------------------------------------------------------------------------------------------------
# 5. Resume: exact, and atomic checkpoints
# ----------------------------------------------------------------------------------------------------------------
class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("which", ["prime_prof", "prl", "prof"])
def test_stop_and_resume_is_bit_identical(tiny_model_path, step_prm_path, tmp_path, which):
    """Stop at step 2 (checkpoint), resume to step 4: metrics and policy (and PRM) weights equal, bit for bit, those
    of the uninterrupted 4-step run."""

    def make(out, callbacks=None):
        common = dict(max_steps=4, save_strategy="steps", save_steps=2, output_dir=str(out))
        if which == "prime_prof":
            return _prime(
                tiny_model_path,
                tmp_path,
                callbacks=callbacks,
                prof_mode="both",
                prof_prm="implicit",
                prof_num_keep=2,
                which="prime_grpo",
                **common,
            )
        if which == "prl":
            return _prl(tiny_model_path, tmp_path, callbacks=callbacks, **common)
        return _prof(tiny_model_path, step_prm_path, tmp_path, callbacks=callbacks, **common)

    full = make(tmp_path / "full")
    full.train()
    first = make(tmp_path / "resumed", callbacks=[StopAt(2)])
    first.train()
    assert os.path.exists(tmp_path / "resumed" / "checkpoint-2" / "guard_state.json")
    second = make(tmp_path / "resumed")
    second.train(resume_from_checkpoint=True)

    def rows(tr):
        return {
            h["step"]: {k: v for k, v in h.items() if "time" not in k and "per_second" not in k}
            for h in tr.state.log_history
            if "loss" in h and "train_runtime" not in h
        }

    a, b = rows(full), rows(second)
    for step in (3, 4):
        assert set(a[step]) == set(b[step])
        for k in a[step]:
            x, y = a[step][k], b[step][k]
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), (step, k, x, y)
    assert _same(_snap(full.model), _snap(second.model))
    if which == "prime_prof":
        assert _same(_snap(full.prm_model), _snap(second.prm_model))
        assert second.prm_optim.num_updates == full.prm_optim.num_updates == 4


def test_atomic_checkpoint_best_model_path_names_the_published_folder(tmp_path):
    """load_best_model_at_end: Trainer records the best checkpoint while writing it, i.e. inside the staging folder.
    After publishing, the state of *every* rank and the checkpoint's own trainer_state.json (read on resume, which
    drops a best checkpoint that does not exist) must name `checkpoint-N`, not the vanished staging path."""
    import json
    from types import SimpleNamespace

    from transformers import TrainerState

    from trl_prime.adapters import save_checkpoint
    from trl_prime.checkpointing import Checkpoints

    class _Trainer:  # what transformers' Trainer._save_checkpoint does with the best checkpoint and the state
        def _get_output_dir(self, trial):  # as the adapters: the staging folder while a checkpoint is saved
            return self.checkpoints.output_dir(str(tmp_path))

        def _save_checkpoint(self, model, trial):
            out = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
            os.makedirs(out, exist_ok=True)
            self.state.best_model_checkpoint = out
            if self.args.should_save:
                self.state.save_to_json(os.path.join(out, "trainer_state.json"))

        def _save_method_state(self, checkpoint_dir):
            assert os.path.basename(os.path.dirname(checkpoint_dir)).startswith(".staging-")

    for step, should_save in ((3, True), (4, False)):  # the main process; another rank (shared file system)
        tr = _Trainer()
        tr.args = SimpleNamespace(should_save=should_save, save_total_limit=None)
        tr.accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
        tr.state = TrainerState(global_step=step)
        tr.checkpoints = Checkpoints(tr, SimpleNamespace(consecutive_skips=0, total_skips=0))
        save_checkpoint(tr, tr._save_checkpoint, None, None)
        assert tr.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{step}")
    with open(tmp_path / "checkpoint-3" / "trainer_state.json") as f:
        assert json.load(f)["best_model_checkpoint"] == str(tmp_path / "checkpoint-3")


def test_checkpoint_killed_mid_save_never_replaces_the_last_good_one(tiny_model_path, tmp_path):
    """A PRIME run saving every step (save_total_limit=1) is killed while writing checkpoint-2's PRM: checkpoint-1
    stays, complete; no checkpoint-2 appears; resume_from_checkpoint=True continues from checkpoint-1."""
    out = tmp_path / "run"
    script = os.path.join(SCRIPTS, "reliability_kill_save.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, script, "--model", tiny_model_path, "--out", str(out), "--kill_at", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 17, proc.stderr[-4000:]  # os._exit(17) in the middle of the save
    names = sorted(os.listdir(out))
    assert "checkpoint-1" in names and "checkpoint-2" not in names, names
    ck1 = out / "checkpoint-1"
    assert {
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
        "prm",
        "guard_state.json",
    } <= set(os.listdir(ck1))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "prime_state.json"} <= set(os.listdir(ck1 / "prm"))
    proc = subprocess.run(
        [sys.executable, script, "--model", tiny_model_path, "--out", str(out), "--resume"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "RESUMED_FROM checkpoint-1 GLOBAL_STEP 3 PRM_UPDATES 3" in proc.stdout
    names = sorted(os.listdir(out))
    assert "checkpoint-3" in names and not [n for n in names if n.startswith(".staging")], names
