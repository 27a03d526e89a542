"""Guards of issue 12, single process on CPU: zero-spread batches warn (item 3), an overflowing PRM or policy
gradient or absurd token rewards skip the step and name the rows (item 10), IA3 adapters work for the policy and the
PRM (item 11)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import PRIME_OPEN, tiny_kwargs, tiny_trainer
from tiny import contains_reward, tiny_prompt_dataset
from transformers import TrainerCallback

from trl_prime import PrimeGRPOConfig, PrimeRLOOConfig
from trl_prime.modeling import adapter_parameters, unwrap


K = 4


def _trainer(which, path, tmp_path, reward, step_prm=None, callbacks=None, trainer_kwargs=None, **overrides):
    """A tiny trainer of kind ``which`` on 16 prompts; PRIME with :data:`~helpers.PRIME_OPEN` (the filter open:
    zero-spread groups are kept)."""
    common = dict(model=path, reward_funcs=reward, train_dataset=tiny_prompt_dataset(16), callbacks=callbacks)
    kw = tiny_kwargs(tmp_path, **overrides)
    return tiny_trainer(which, kw, PRIME_OPEN, prof_prm=step_prm, **common, **(trainer_kwargs or {}))


def _snap(module):
    return {k: v.detach().clone() for k, v in unwrap(module).state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opt_state(opt):
    inner = getattr(opt, "optimizer", opt)
    states = [inner.state[p] for g in inner.param_groups for p in g["params"] if p in inner.state]
    return {
        i: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()} for i, st in enumerate(states)
    }


def _same_state(a, b):
    def equal(x, y):
        return torch.equal(torch.as_tensor(x), torch.as_tensor(y))

    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(equal(a[i][k], b[i][k]) for k in a[i]) for i in a
    )


def _logs(tr):
    return {h["step"]: h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h}


@pytest.fixture(scope="module")
def step_prm_path(tmp_path_factory):
    from tiny_prm import build_tiny_step_prm

    return build_tiny_step_prm(tmp_path_factory.mktemp("guard_fix_step_prm"))


# ----------------------------------------------------------------------------------------------------------------
# Item 3: every group without reward spread
# ----------------------------------------------------------------------------------------------------------------
def test_group_reward_spread_hand_values():
    from trl_prime.guards import group_reward_spread

    nan = float("nan")
    o = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert group_reward_spread(o, 2).tolist() == [False, False]  # groups [1,1], [0,0]: the batch differs, no group
    assert group_reward_spread(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2).tolist() == [True, False]
    # unscorable rows (NaN) do not count: [1, NaN] has one scorable row, no spread
    assert group_reward_spread(torch.tensor([1.0, nan, 0.5, 0.25]), 2).tolist() == [False, True]
    # only kept rows count (PROF / the prompt filter)
    kept = torch.tensor([True, False, True, True])
    assert group_reward_spread(torch.tensor([1.0, 0.0, 0.5, 0.25]), 2, kept).tolist() == [False, True]


def _by_group(values):
    """Reward by position in the generation batch: completion i gets values[(i // K) % len(values)][i % K]."""

    def reward(completions, **kw):
        return [float(values[(i // K) % len(values)][i % K]) for i in range(len(completions))]

    return reward


@pytest.mark.parametrize("which", ["prime_rloo", "prime_grpo", "prl", "prof"])
def test_zero_spread_batch_warns_one_spread_group_does_not(tiny_model_path, step_prm_path, tmp_path, which, caplog):
    """Groups [1,1,1,1], [0,0,0,0]: the whole batch is not equal (guard/all_rewards_equal 0), but no group has
    spread, so no outcome advantage anywhere: guard/all_groups_zero_spread 1 and a warning. With one group of spread
    ([1,0,1,0], [0,0,0,0]) neither."""

    def step1_log(name, groups):
        tr = _trainer(which, tiny_model_path, tmp_path / name, _by_group(groups), step_prm_path)
        with caplog.at_level(logging.WARNING, logger="trl_prime.guards"):
            tr.train()
        return _logs(tr)[1]

    log = step1_log("a", [[1, 1, 1, 1], [0, 0, 0, 0]])
    assert log["guard/all_rewards_equal"] == 0.0 and log["guard/all_groups_zero_spread"] == 1.0
    assert "Degenerate batch at step 1: " in caplog.text
    assert "every group's rewards equal within the group (zero spread) (no outcome signal" in caplog.text
    caplog.clear()

    log = step1_log("b", [[1, 0, 1, 0], [0, 0, 0, 0]])
    assert log["guard/all_rewards_equal"] == 0.0 and log["guard/all_groups_zero_spread"] == 0.0
    assert "zero spread" not in caplog.text


# ----------------------------------------------------------------------------------------------------------------
# Item 10: gradient overflow and absurd token rewards
# ----------------------------------------------------------------------------------------------------------------
class Snapshots(TrainerCallback):
    """Weights and optimizer states (policy, PRM) at the end of every optimizer step."""

    def __init__(self):
        self.trainer = None
        self.policy, self.prm, self.opt, self.prm_opt = {}, {}, {}, {}

    def on_step_end(self, args, state, control, **kw):
        tr = self.trainer
        self.policy[state.global_step] = _snap(tr.model)
        self.opt[state.global_step] = _opt_state(tr.optimizer)
        if hasattr(tr, "implicit_prm"):
            self.prm[state.global_step] = _snap(tr.prm_model)
            self.prm_opt[state.global_step] = _opt_state(tr.prm_optimizer)


def _snapshotted(model, tmp_path, **overrides):
    """A tiny PRIME-RLOO trainer (reward: contains "e") and the :class:`Snapshots` of its steps."""
    snaps = Snapshots()
    tr = _trainer("prime_rloo", model, tmp_path, contains_reward("e"), callbacks=[snaps], **overrides)
    snaps.trainer = tr
    return tr, snaps


def _overflow_hook(tr, factor=1e35, from_step=2):
    """Gradient hook: from optimizer step `from_step` on, the gradient is multiplied by `factor` (finite values whose
    global L2 norm overflows float32 to inf: clipping then scales every gradient to 0)."""

    def hook(g):
        return g * factor if tr.state.global_step + 1 >= from_step else g

    return hook


def test_policy_gradient_overflow_is_caught_after_clipping(tiny_model_path, tmp_path, caplog):
    """A policy gradient whose norm overflows (inf) from step 2 on: the Trainer's clipping scales the gradients to
    zeros, which look finite; the guard judges the clipping's norm, so steps 2 and 3 are skipped (weights and Adam
    moments of step 1 kept, scheduler not advanced) and the run stops at max_nonfinite_skips=2."""
    tr, snaps = _snapshotted(tiny_model_path, tmp_path, max_steps=5, max_nonfinite_skips=2, lr_scheduler_type="linear")
    unwrap(tr.model).lm_head.weight.register_hook(_overflow_hook(tr))
    with caplog.at_level(logging.WARNING, logger="trl_prime.guards"):
        with pytest.raises(RuntimeError, match=r"2 consecutive optimizer steps were skipped.*`max_nonfinite_skips`=2"):
            tr.train()
    assert list(snaps.policy) == [1, 2]  # stopped during step 3
    assert _same(snaps.policy[1], snaps.policy[2]) and _same(snaps.policy[1], _snap(tr.model))
    assert snaps.opt[1] and _same_state(snaps.opt[1], snaps.opt[2])
    assert _same_state(snaps.opt[1], _opt_state(tr.optimizer))
    assert tr.lr_scheduler.last_epoch == 1  # advanced by step 1 only
    assert tr.guards.total_skips == 2
    text = caplog.text
    assert "Skipped optimizer step 2 (non-finite policy gradient norm: gradient overflow (no single row))" in text
    assert _logs(tr)[2]["guard/skipped_steps"] == 1.0


def test_prm_gradient_overflow_skips_prm_and_policy(tiny_model_path, tmp_path, caplog):
    """The PRM's gradient overflows from step 2 on: its step is skipped (weights and AdamW moments of step 1 kept),
    the policy step of the batch too, the log says no single row is to blame, and the run stops at
    max_nonfinite_skips=2."""
    tr, snaps = _snapshotted(tiny_model_path, tmp_path, max_steps=5, max_nonfinite_skips=2)
    unwrap(tr.prm_model).lm_head.weight.register_hook(_overflow_hook(tr))
    with caplog.at_level(logging.WARNING, logger="trl_prime.guards"):
        with pytest.raises(RuntimeError, match=r"2 consecutive optimizer steps were skipped"):
            tr.train()
    assert _same(snaps.prm[1], snaps.prm[2]) and _same(snaps.prm[1], _snap(tr.prm_model))
    assert snaps.prm_opt[1] and _same_state(snaps.prm_opt[1], _opt_state(tr.prm_optimizer))
    assert _same(snaps.policy[1], snaps.policy[2]) and _same(snaps.policy[1], _snap(tr.model))
    assert tr.prm_optim.num_updates == 1 and tr.guards.total_skips == 2
    text = caplog.text
    assert (
        "Non-finite values at step 2 (non-finite PRM loss/gradient norm): skipping the optimizer step. "
        "Offending rows: none, gradient overflow (no single row)."
    ) in text
    assert "None; sample ids: []" not in text


@pytest.mark.parametrize("prm_update", ["single", "double"])
def test_token_rewards_beyond_the_bound_skip_the_step_and_name_the_rows(
    tiny_model_path, tmp_path, monkeypatch, caplog, prm_update
):
    """Row 5's PRM log-probs blow up at step 2 (token rewards ~1e5, finite, past prm_max_abs_token_reward=100): the
    PRM step (checked before it runs) and the policy step are skipped, row 5 and its sample id are logged, step 3
    trains."""
    import trl_prime.prime.trainer as pt

    tr, snaps = _snapshotted(tiny_model_path, tmp_path, max_steps=3, prm_update=prm_update)
    assert tr.args.prm_max_abs_token_reward == 100.0  # the documented default
    real = pt.completion_logps

    def blown(model, input_ids, attention_mask, T, **kw):
        out = real(model, input_ids, attention_mask, T, **kw)
        if tr.state.global_step + 1 == 2 and input_ids.size(0) == 8:
            out = out.clone()
            out[5] = out[5] * 1e6 - 1e6
        return out

    monkeypatch.setattr(pt, "completion_logps", blown)
    with caplog.at_level(logging.WARNING, logger="trl_prime.guards"):
        tr.train()
    assert _same(snaps.prm[1], snaps.prm[2]) and not _same(snaps.prm[2], snaps.prm[3])
    assert _same(snaps.policy[1], snaps.policy[2]) and not _same(snaps.policy[2], snaps.policy[3])
    assert tr.prm_optim.num_updates == 2 and tr.guards.total_skips == 1 and tr.guards.consecutive_skips == 0
    text = caplog.text
    assert (
        "Non-finite or out-of-bound values at step 2 (token_rewards beyond +-100): skipping the optimizer step. "
        "Offending rows of the global generation batch: [5]; sample ids: ['What is"
    ) in text
    assert text.count("Offending rows of the global generation batch") == 1  # logged once, not per check
    assert "Non-finite or out-of-bound values at step 3" not in text


def test_token_reward_bound_is_validated():
    with pytest.raises(ValueError, match=r"`prm_max_abs_token_reward`=0 must be a number > 0 or None"):
        PrimeRLOOConfig(output_dir="unused", prm_max_abs_token_reward=0, use_cpu=True, report_to=[])
    assert (
        PrimeGRPOConfig(
            output_dir="unused", prm_max_abs_token_reward=None, use_cpu=True, report_to=[]
        ).prm_max_abs_token_reward
        is None
    )


# ----------------------------------------------------------------------------------------------------------------
# Item 11: IA3 (parameter names without ".<adapter>.")
# ----------------------------------------------------------------------------------------------------------------
def test_ia3_policy_and_prm_adapters_train_base_frozen(tiny_model_path, tmp_path):
    from peft import IA3Config

    from trl_prime import ImplicitPRM

    tr = _trainer(
        "prime_rloo",
        tiny_model_path,
        tmp_path,
        contains_reward("e"),
        max_steps=1,
        save_strategy="steps",
        save_steps=1,
        trainer_kwargs=dict(peft_config=IA3Config(task_type="CAUSAL_LM")),
    )
    peft_model = unwrap(tr.model)
    prm = {n for n, _ in adapter_parameters(peft_model, "prm")}
    default = {n for n, _ in adapter_parameters(peft_model, "default")}
    assert prm and default and all(n.endswith(".ia3_l.prm") for n in prm)  # no ".prm." in IA3 names
    assert {n.replace(".ia3_l.prm", ".ia3_l.default") for n in prm} == default
    flags = {n: p.requires_grad for n, p in peft_model.named_parameters()}
    assert {n for n, f in flags.items() if f} == default  # the policy's optimizer sees its own adapter only
    before = _snap(tr.model)
    tr.train()
    named = dict(peft_model.named_parameters())
    assert {id(p) for g in tr.prm_optimizer.param_groups for p in g["params"]} == {id(named[n]) for n in prm}
    assert {id(p) for g in tr.optimizer.param_groups for p in g["params"]} == {id(named[n]) for n in default}
    after = _snap(tr.model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {k for k in before if k.endswith(".ia3_l.prm")} <= changed  # the PRM adapter learned
    assert {k for k in before if k.endswith(".ia3_l.default")} & changed  # the policy adapter learned
    assert not {k for k in changed if "ia3_l" not in k}  # the base did not move
    assert {n: p.requires_grad for n, p in peft_model.named_parameters()} == flags
    # the checkpoint's PRM adapter reloads and scores as the live PRM
    loaded = ImplicitPRM.from_pretrained(os.path.join(tr.args.output_dir, "checkpoint-1", "prm"))
    prompts, completions = ["What is 1 + 1?"], ["The answer is 2."]
    live = tr.implicit_prm.score(prompts, completions)
    assert live[0] != 0.0 and loaded.score(prompts, completions) == pytest.approx(live, abs=1e-5)


def test_pretrained_ia3_policy_copies_into_prm_and_reference(tiny_model_path, tmp_path):
    """A ready IA3 PeftModel as the policy: the PRM and its reference start as exact copies of its adapter."""
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), IA3Config(task_type="CAUSAL_LM"))
    with torch.no_grad():
        for _, p in adapter_parameters(model, "default"):
            p.mul_(1.5)  # a "trained" adapter, away from IA3's all-ones init
    tr = _trainer("prime_rloo", model, tmp_path, contains_reward("e"), max_steps=1)
    peft_model = unwrap(tr.model)
    named = dict(peft_model.named_parameters())
    src = {n: p for n, p in named.items() if n.endswith(".ia3_l.default")}
    assert len(src) == 6  # q_proj, v_proj, down_proj of 2 layers
    for name in ("prm", "prm_ref"):
        dst = {n: named[n[: -len("default")] + name] for n in src}
        assert all(torch.equal(src[n], dst[n]) and torch.allclose(dst[n], torch.full_like(dst[n], 1.5)) for n in src)
        assert not any(p.requires_grad for p in dst.values())
    assert tr.implicit_prm.reference == "adapter"


def test_prompt_learning_peft_config_is_refused(tiny_model_path, tmp_path):
    from peft import PromptTuningConfig

    with pytest.raises(ValueError, match=r"`peft_config` is a PROMPT_TUNING adapter.*LoRA \(LoraConfig\) or IA3"):
        _trainer(
            "prime_rloo",
            tiny_model_path,
            tmp_path,
            contains_reward("e"),
            trainer_kwargs=dict(peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
        )


def test_prl_reference_copy_refuses_a_prompt_learning_adapter(tiny_model_path):
    """PRL's frozen reference adapter is a copy of the policy's: a prompt-learning adapter has no layer weights to
    copy (the copy would be a freshly initialised adapter), so the copy is refused, naming the field."""
    from peft import PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_prime.modeling import copy_adapter

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    )
    with pytest.raises(ValueError, match=r"`peft_config` is a PROMPT_TUNING adapter"):
        copy_adapter(model, "ref")
    assert "ref" not in model.peft_config  # refused before anything was added
