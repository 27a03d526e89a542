"""PRIME with PPO (``prime_estimator="ppo"``; PRIME section 5.4, Table 4): the value model, its update inside PRIME's
step, GAE advantages, the implicit PRM as value (``prime_value="implicit_prm"``), checkpoints and resume, forward
counts, LoRA, and (slow) 2-process DDP and ZeRO-3 on CPU."""

from __future__ import annotations

import collections
import math
import os

import pytest
import torch
from helpers import SCRIPTS, launch_argv, read_summary, run_launched, tiny_config
from tiny import contains_reward, tiny_prompt_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from trl_prime import PrimeGRPOConfig, PrimeGRPOTrainer, PrimeRLOOConfig, PrimeRLOOTrainer
from trl_prime.callbacks import PrimeCallback
from trl_prime.modeling import unwrap
from trl_prime.prime.value import VALUE_HEAD_NAME, ValueModel


K = 4
B = 8


def _config(tmp_path, cfg_cls=PrimeRLOOConfig, **overrides):
    ppo = dict(per_device_train_batch_size=B, max_steps=2, prm_learning_rate=1e-2, value_learning_rate=1e-3)
    ppo.update(filter_lower=0.0, filter_upper=1.0, prime_estimator="ppo")
    return tiny_config(cfg_cls, tmp_path, **{**ppo, **overrides})


class Recorder(PrimeCallback):
    def __init__(self):
        self.scored, self.value_steps = [], []

    def on_rollouts_scored(self, args, state, control, **kw):
        keep = ("token_rewards", "outcome_rewards", "completion_mask", "kept_mask", "advantages", "loss_mask")
        self.scored.append({k: kw[k].detach().clone() for k in keep} | {"advantage_inputs": kw["advantage_inputs"]})

    def on_value_step(self, args, state, control, **kw):
        self.value_steps.append(kw)


def _trainer(
    path, tmp_path, *, cls=PrimeRLOOTrainer, cfg_cls=PrimeRLOOConfig, reward=None, callbacks=None, n=16, **kw
):
    return cls(
        model=path,
        reward_funcs=reward or contains_reward("e"),
        args=_config(tmp_path, cfg_cls, **kw),
        train_dataset=tiny_prompt_dataset(n),
        callbacks=callbacks,
    )


def _state(module):
    return {k: v.detach().clone() for k, v in unwrap(module).state_dict().items()}


def _gae_by_hand(rewards, values, mask, gamma=1.0, lam=1.0):
    """GAE over one row's masked positions, written out: delta_t = r_t + gamma V_{t+1} - V_t (V after the last = 0),
    A_t = delta_t + gamma lam A_{t+1}."""
    out = torch.zeros_like(rewards)
    for i in range(rewards.size(0)):
        pos = mask[i].nonzero().flatten().tolist()
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(pos):
            delta = float(rewards[i, t]) + gamma * nxt_v - float(values[i, t])
            nxt_a = delta + gamma * lam * nxt_a
            out[i, t], nxt_v = nxt_a, float(values[i, t])
    return out


# ----------------------------------------------------------------------------------------------------------------
def test_config_defaults_and_validation(tmp_path):
    cfg = PrimeRLOOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, prime_estimator="ppo")
    assert (cfg.prime_value, cfg.value_model, cfg.value_learning_rate, cfg.vf_coef, cfg.cliprange_value) == (
        "critic",
        None,
        1e-5,
        0.1,
        0.2,
    )
    assert (cfg.lam, cfg.prime_gamma, cfg.value_epochs, cfg.value_max_grad_norm) == (1.0, 1.0, 1, 1.0)
    assert PrimeGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, prime_estimator="ppo").lam == 1.0
    base = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    bad = [
        (dict(prime_value="implicit_prm"), r"`prime_value` is set but `prime_estimator`='rloo'"),
        (dict(value_model="x"), r"`value_model` is set but `prime_estimator`='rloo'"),
        (dict(prime_estimator="ppo", prime_value="mc"), "prime_value"),
        (dict(prime_estimator="ppo", prime_value="implicit_prm", value_model="x"), "`value_model` is set"),
        (dict(prime_estimator="ppo", lam=1.5), "`lam`=1.5"),
        (dict(prime_estimator="ppo", vf_coef=0.0), "`vf_coef`=0.0"),
        (dict(prime_estimator="ppo", cliprange_value=-1.0), "`cliprange_value`"),
        (dict(prime_estimator="ppo", value_epochs=0), "`value_epochs`=0"),
        (dict(prime_estimator="ppo", value_learning_rate=-1.0), "`value_learning_rate`"),
        (dict(prime_estimator="ppo", value_max_grad_norm=0.0), "`value_max_grad_norm`"),
        (dict(prime_estimator="ppo", process_reward_norm="batch_norm"), "process_reward_norm"),
        (dict(prime_estimator="ppo", include_last_token=False), "include_last_token"),
        # fields the run would silently ignore
        (dict(prime_estimator="ppo", prime_baseline="reference"), r"`prime_baseline`='reference' is a baseline"),
        (dict(prime_estimator="ppo", prime_value="implicit_prm", process_coef=0.5), r"`process_coef`=0.5 is unused"),
        (dict(prime_estimator="ppo", prime_value="implicit_prm", outcome_coef=0.0), r"`outcome_coef`=0 with"),
    ]
    for name, value in [
        ("lam", 0.9),
        ("vf_coef", 0.5),
        ("cliprange_value", 0.1),
        ("value_epochs", 2),
        ("value_learning_rate", 1e-4),
        ("value_weight_decay", 0.1),
        ("value_max_grad_norm", None),
    ]:
        bad.append(({name: value}, rf"`{name}`={value!r} only acts with prime_estimator='ppo'.*leave {name}="))
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            PrimeRLOOConfig(**base, **kw)
    with pytest.raises(ValueError, match="scale_rewards`='batch' would be ignored.*'ppo'"):
        PrimeGRPOConfig(**base, prime_estimator="ppo", scale_rewards="batch")
    with pytest.raises(ValueError, match=r"`lam`=0.5 only acts with prime_estimator='ppo'.*'grpo' ignores it"):
        PrimeGRPOConfig(**base, lam=0.5)
    with pytest.raises(ValueError, match=r"must be > 0 \(TRL's PPO: vf_coef 0.1, cliprange_value 0.2\)"):
        PrimeRLOOConfig(**base, prime_estimator="ppo", cliprange_value=0.0)
    # the same values accepted where they act, and the defaults everywhere
    PrimeRLOOConfig(**base, prime_baseline="reference", process_coef=0.5, lam=1.0, value_max_grad_norm=1.0)
    PrimeRLOOConfig(**base, prime_estimator="ppo", lam=0.9, value_epochs=2, process_coef=0.5)
    PrimeRLOOConfig(**base, prime_estimator="ppo", prime_value="implicit_prm", outcome_coef=2.0)


def test_value_model_argument_needs_a_critic(tiny_model_path, tmp_path):
    # value_learning_rate: the default, which a non-ppo config requires (the ppo-only fields are refused otherwise)
    for kw in (dict(prime_estimator="rloo", value_learning_rate=1e-5), dict(prime_value="implicit_prm")):
        with pytest.raises(ValueError, match="`value_model` was given but this run has no learned critic"):
            PrimeRLOOTrainer(
                model=tiny_model_path,
                reward_funcs=contains_reward("e"),
                args=_config(tmp_path, **kw),
                train_dataset=tiny_prompt_dataset(8),
                value_model=tiny_model_path,
            )


def test_value_adapter_is_refused_under_deepspeed():
    """As the PRM adapter: a LoRA value adapter would be partitioned inside the policy's DeepSpeed engine."""
    from trl_prime.prime.value import adapter_value_model

    with pytest.raises(ValueError, match="adapter 'value'.*not supported with DeepSpeed.*Pass `value_model`"):
        adapter_value_model(None, pretrained_adapter=False, seed=0, deepspeed=True)


def test_value_model_shapes_and_head_alignment(tiny_model_path):
    """values[:, t] = head(h at the position predicting token t): it sees the prompt and y_<t, not y_t; left padding
    of the prompt does not change it."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    vm = ValueModel(lm, seed=3).eval()
    assert vm.head.weight.shape == (1, lm.config.hidden_size) and float(vm.head.bias.detach()) == 0.0
    assert not lm.lm_head.weight.requires_grad  # untied LM head: unused, frozen
    prompt = tok("What is 1 + 1?")["input_ids"]
    completion = tok(" The answer is 2")["input_ids"]
    T = len(completion)
    ids = torch.tensor([prompt + completion])
    am = torch.ones_like(ids)
    with torch.no_grad():
        v = vm(ids, am, T)
        h = lm.model(input_ids=ids, attention_mask=am).last_hidden_state[0]
    assert v.shape == (1, T) and v.dtype == torch.float32
    P = len(prompt)
    expected = torch.stack([vm.head(h[P - 1 + t]).squeeze() for t in range(T)])
    torch.testing.assert_close(v[0], expected, rtol=1e-5, atol=1e-6)
    # y_t does not reach V(y_<t) (and V(y_<t') for t' <= t), it reaches V(y_<t+1)
    changed = ids.clone()
    changed[0, P + 2] = (changed[0, P + 2] + 7) % lm.config.vocab_size
    with torch.no_grad():
        v2 = vm(changed, am, T)
    torch.testing.assert_close(v2[0, :3], v[0, :3])
    assert not torch.allclose(v2[0, 3:], v[0, 3:])
    # left-padded prompt: same values (position ids from the mask)
    pad = torch.tensor([[tok.pad_token_id] * 3 + prompt + completion])
    pad_am = torch.cat([torch.zeros(1, 3, dtype=torch.long), am], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(vm(pad, pad_am, T), v, rtol=1e-5, atol=1e-5)
    # the head's init is seeded without touching the global random state
    state = torch.get_rng_state()
    assert torch.equal(ValueModel(lm, seed=3).head.weight, vm.head.weight)
    assert torch.equal(torch.get_rng_state(), state)


def test_one_step_trains_the_value_model_and_logs_metrics(tiny_model_path, tmp_path):
    rec = Recorder()
    tr = _trainer(tiny_model_path, tmp_path, callbacks=[rec], max_steps=1)
    vm0 = _state(tr.value_function.module)
    prm0 = _state(tr.prm_model)
    tr.train()
    vm1 = _state(tr.value_function.module)
    changed = [k for k in vm0 if not torch.equal(vm0[k], vm1[k])]
    assert "head.weight" in changed and any(k.startswith("backbone.model.layers") for k in changed)
    assert torch.equal(vm0["backbone.lm_head.weight"], vm1["backbone.lm_head.weight"])  # unused: frozen
    assert any(not torch.equal(v, _state(tr.prm_model)[k]) for k, v in prm0.items())  # the PRM trains as before
    assert tr.value_optim.num_updates == 1 and len(rec.value_steps) == 1
    assert rec.value_steps[0]["num_updates"] == 1 and rec.value_steps[0]["value_model"] is tr.value_function.module
    log = next(h for h in tr.state.log_history if "value/loss" in h)
    for k in ("value/loss", "value/explained_variance", "value/clipfrac", "value/mean", "value/grad_norm"):
        assert math.isfinite(log[k]), k
    assert log["value/clipfrac"] == 0.0  # one epoch: the values are the clip centre
    assert log["value/loss"] == pytest.approx(rec.value_steps[0]["loss"])
    assert log["value/learning_rate"] == 1e-3
    # the value model's parameters are not the policy's
    policy = {id(p) for p in tr.model.parameters()}
    assert not policy & {id(p) for p in tr.value_function.trainable_parameters()}
    # evaluation: eval_ metrics, no update
    metrics = tr.evaluate(tiny_prompt_dataset(4))
    assert math.isfinite(metrics["eval_value/loss"]) and math.isfinite(metrics["eval_value/mean"])
    assert tr.value_optim.num_updates == 1


def test_nonfinite_value_poisons_the_batch(tiny_model_path, tmp_path, caplog):
    """A NaN in the critic's values (its head's output, row 3, first position) poisons the generation batch as a
    non-finite token reward does: warning naming the values and the row, policy step skipped. Without the guard GAE
    would silently give that row advantage 0 and the policy would step."""
    import logging

    tr = _trainer(tiny_model_path, tmp_path, max_steps=1)
    head = tr.value_function.module.head

    def nan_row_3(module, args, out):
        out = out.clone()
        out[3, 0] = math.nan
        return out

    handle = head.register_forward_hook(nan_row_3)
    policy0 = _state(tr.model)
    with caplog.at_level(logging.WARNING, logger="trl_prime.guards"):
        tr.train()
    handle.remove()
    assert "Non-finite values at step 1 (non-finite values)" in caplog.text
    assert "rows of the global generation batch: [3]" in caplog.text
    policy1 = _state(tr.model)
    assert all(torch.equal(policy0[k], policy1[k]) for k in policy0)  # the poisoned step left the policy unchanged
    log = next(h for h in tr.state.log_history if "value/loss" in h)
    assert log.get("guard/skipped_steps") == 1.0


def test_value_step_equals_the_by_hand_step(tiny_model_path, tmp_path):
    """One process: the value model's first step equals the one :func:`_check_value_step_single_process` redoes
    from the recorded rows (the reference the 2-process tests compare against)."""
    tr = _trainer(tiny_model_path, tmp_path, max_steps=1, value_max_grad_norm=None, adam_epsilon=1.0)
    step, batches, train_value = {}, [], tr._train_value

    def params():
        return {n: p.detach().clone() for n, p in tr.value_function.module.named_parameters()}

    def recording(r, rewards, train_mask):
        step["before"] = params()
        keep = dict(input_ids=r.input_ids, attention_mask=r.attention_mask, actions=r.actions)
        batches.append({k: v.detach().clone() for k, v in keep.items()} | dict(rewards=rewards, train_mask=train_mask))
        return train_value(r, rewards, train_mask)

    tr._train_value = recording
    tr.train()
    step["after"] = params()  # one step, applied with the policy's (held until then)
    assert tr.value_optim.num_updates == 1
    _check_value_step_single_process(step, tiny_model_path, 1e-3, [0.9, 0.999, 1.0], batches)
    # a gradient twice too large (a world-size scaling error) moves the weights visibly differently
    with pytest.raises(AssertionError, match=r"^(backbone|head)\."):
        _check_value_step_single_process(step, tiny_model_path, 1e-3, [0.9, 0.999, 1.0], batches, grad_scale=2.0)


def test_zero_learning_rate_leaves_the_value_model_unchanged(tiny_model_path, tmp_path):
    tr = _trainer(tiny_model_path, tmp_path, max_steps=1, value_learning_rate=0.0)
    vm0 = _state(tr.value_function.module)
    tr.train()
    vm1 = _state(tr.value_function.module)
    assert all(torch.equal(vm0[k], vm1[k]) for k in vm0)
    assert tr.value_optim.num_updates == 1


def test_advantages_are_gae_of_the_token_rewards_and_values(tiny_model_path, tmp_path):
    """process_coef=1: r_t = r_phi(y_t) + r_o on the last token; GAE(lam=0.9) against the critic's values, by hand.
    process_coef=0: plain PPO, the same code with the outcome alone (the logged token rewards do not enter)."""
    for process_coef in (1.0, 0.0):
        rec = Recorder()
        tr = _trainer(tiny_model_path, tmp_path, callbacks=[rec], max_steps=2, lam=0.9, process_coef=process_coef)
        tr.train()
        for s in rec.scored:
            inputs = s["advantage_inputs"]
            m = s["completion_mask"].bool()
            last = m & (m.cumsum(-1) == m.sum(-1, keepdim=True))
            rewards = process_coef * s["token_rewards"] * m + s["outcome_rewards"].unsqueeze(1) * last
            expected = _gae_by_hand(rewards, inputs["values"], m, gamma=1.0, lam=0.9)
            torch.testing.assert_close(s["advantages"], expected, rtol=1e-5, atol=1e-6)
            assert inputs["estimator"] == "ppo" and inputs["process_coef"] == process_coef
        if process_coef == 0.0:  # the token rewards still train the PRM but not the policy
            assert rec.scored[-1]["token_rewards"].abs().sum() > 0


def test_filtered_rows_get_no_advantage_and_no_value_loss(tiny_model_path, tmp_path):
    def half_kept(prompts, completions, **kw):  # even groups 0,1,0,1 (kept), odd groups all 0 (filtered)
        return [float(i % 2) if (i // K) % 2 == 0 else 0.0 for i in range(len(completions))]

    rec = Recorder()
    tr = _trainer(
        tiny_model_path, tmp_path, reward=half_kept, callbacks=[rec], max_steps=1, filter_lower=0.2, filter_upper=0.8
    )
    seen = {}
    original = tr._train_value

    def spy(r, rewards, train_mask):
        seen["train_mask"] = train_mask.clone()
        return original(r, rewards, train_mask)

    tr._train_value = spy
    tr.train()
    s = rec.scored[0]
    assert s["kept_mask"].tolist() == [True] * K + [False] * K
    assert torch.all(s["advantages"][K:] == 0) and s["advantages"][:K].abs().sum() > 0
    assert torch.all(seen["train_mask"][K:] == 0)
    assert torch.equal(seen["train_mask"][:K], s["completion_mask"][:K].to(seen["train_mask"].dtype))


def test_rows_prof_drops_get_no_advantage_and_no_value_loss(tiny_model_path, tmp_path):
    """PROF inside PRIME-PPO (prof_num_remove=4 of 8 per prompt): the dropped rows have loss weight 0, advantage 0
    and no value loss; the kept rows train the critic."""
    rec = Recorder()
    tr = _trainer(
        tiny_model_path,
        tmp_path,
        callbacks=[rec],
        max_steps=1,
        n=4,
        num_generations=8,
        per_device_train_batch_size=16,
        prof_mode="both",
        prof_prm="implicit",
        prof_num_remove=4,
    )
    seen = {}
    original = tr._train_value

    def spy(r, rewards, train_mask):
        seen["train_mask"] = train_mask.clone()
        return original(r, rewards, train_mask)

    tr._train_value = spy
    tr.train()
    s = rec.scored[0]
    dropped = s["loss_mask"].sum(-1) == 0
    assert int(dropped.sum()) == 8
    assert torch.all(s["advantages"][dropped] == 0) and s["advantages"][~dropped].abs().sum() > 0
    torch.testing.assert_close(seen["train_mask"].float(), s["loss_mask"].float())
    assert tr.value_optim.num_updates == 1


def test_implicit_prm_as_value_by_hand(tiny_model_path, tmp_path):
    """prime_value="implicit_prm": no critic; A_t = r_o - sum_{s<t} r_phi(y_s) (gamma = lam = 1) from the logged
    token rewards (PRIME section 5.4)."""
    rec = Recorder()
    tr = _trainer(tiny_model_path, tmp_path, callbacks=[rec], max_steps=2, prime_value="implicit_prm")
    assert tr.value_function is None and tr.value_optim is None
    tr.train()
    for s in rec.scored[1:]:  # step 1's PRM is the reference itself: r_phi = 0
        m = s["completion_mask"].bool()
        r = s["token_rewards"] * m
        prefix = r.cumsum(-1) - r
        expected = (s["outcome_rewards"].unsqueeze(1) - prefix) * m
        torch.testing.assert_close(s["advantages"], expected, rtol=1e-5, atol=1e-6)
        assert prefix.abs().sum() > 0
    log = next(h for h in tr.state.log_history if "value/mean" in h)
    assert "value/loss" not in log and math.isfinite(log["value/explained_variance"])
    assert not os.path.exists(os.path.join(tr.args.output_dir, "value"))


def test_implicit_prm_as_value_prob_scale_by_hand(tiny_model_path, tmp_path):
    """prime_value_scale="prob": the value is outcome_coef * sigmoid(sum_{s<t} r_phi(y_s)), on the outcome's scale;
    A_t = outcome_coef * (r_o - sigmoid(prefix)) (gamma = lam = 1): outcome_coef * (r_o - 0.5) at the first token."""
    rec = Recorder()
    tr = _trainer(
        tiny_model_path, tmp_path, callbacks=[rec], max_steps=2, prime_value="implicit_prm",
        prime_value_scale="prob", outcome_coef=2.0,
    )  # fmt: skip
    tr.train()
    for s in rec.scored:
        m = s["completion_mask"].bool()
        r = s["token_rewards"] * m
        value = 2.0 * torch.sigmoid(r.cumsum(-1) - r)
        expected = (2.0 * s["outcome_rewards"].unsqueeze(1) - value) * m
        torch.testing.assert_close(s["advantages"], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s["advantages"][:, 0], 2.0 * (s["outcome_rewards"] - 0.5))  # empty prefix: 0.5
    assert rec.scored[-1]["token_rewards"].abs().sum() > 0  # step 2's PRM has moved: the values are not all 0.5
    log = next(h for h in tr.state.log_history if "value/mean" in h)
    assert 0.0 < log["value/mean"] < 2.0  # outcome_coef * a probability


def test_grpo_trainer_runs_ppo(tiny_model_path, tmp_path):
    tr = _trainer(tiny_model_path, tmp_path, cls=PrimeGRPOTrainer, cfg_cls=PrimeGRPOConfig, max_steps=1)
    vm0 = _state(tr.value_function.module)
    tr.train()
    assert tr.value_optim.num_updates == 1
    assert not torch.equal(vm0["head.weight"], _state(tr.value_function.module)["head.weight"])


def test_forward_count_one_value_forward_and_backward_per_micro_batch(tiny_model_path, tmp_path):
    """PPO adds the value model's forward + backward per micro-batch and nothing else: the policy, PRM and reference
    forwards are those of every PRIME step (tests/prime/test_forward_count.py)."""
    from test_forward_count import _separate_counter

    calls, backwards, others = collections.Counter(), collections.Counter(), []

    def run(**kw):
        calls.clear()
        backwards.clear()
        tr = _trainer(tiny_model_path, tmp_path, max_steps=2, **kw)
        others[:] = [_separate_counter(tr)]

        def hook(module, args, kwargs, out):
            step = tr.state.global_step + 1
            calls[(step, torch.is_grad_enabled(), kwargs["input_ids"].size(0))] += 1
            if out.requires_grad:
                out.register_hook(lambda g: backwards.update([step]))

        tr.value_function.module.register_forward_hook(hook, with_kwargs=True)
        tr.train()
        return tr

    tr = run(prm_micro_batch_size=4)
    c = others[0]
    for step in (1, 2):
        assert calls == {(1, True, 4): 2, (2, True, 4): 2}  # B = 8 rows in micro-batches of 4, with grad
        assert backwards[step] == 2
        assert c.rows(step, "ref", False) == B and c.calls(step, "ref", True) == 0
        assert c.rows(step, "prm", True) == B and c.rows(step, "prm", False) == 0 and c.prm_backwards[step] == 2
        assert c.rows(step, "policy", True) == B and c.calls(step, "policy", False) == 0
    assert tr.value_optim.num_updates == 2
    tr = run(value_epochs=2)
    assert calls == {(1, True, 8): 2, (2, True, 8): 2} and backwards == {1: 2, 2: 2}
    assert tr.value_optim.num_updates == 4  # one optimizer step per epoch


def test_checkpoint_and_resume_reproduce_the_uninterrupted_run(tiny_model_path, tmp_path):
    keys = ["value/loss", "value/mean", "value/explained_variance", "value/grad_norm", "loss", "prm/loss"]

    def make(out, callbacks=None):
        return _trainer(
            tiny_model_path,
            tmp_path,
            callbacks=callbacks,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            output_dir=str(out),
            value_epochs=2,
            whiten_advantages=True,
        )

    full = make(tmp_path / "full")
    full.train()
    full_logs = {h["step"]: h for h in full.state.log_history if "value/loss" in h}

    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                control.should_training_stop = True

    first = make(tmp_path / "resumed", callbacks=[StopAt2()])
    first.train()
    ckpt = tmp_path / "resumed" / "checkpoint-2"
    value_dir = ckpt / "value"
    assert {"config.json", "model.safetensors", VALUE_HEAD_NAME, "optimizer.pt", "scheduler.pt"} <= set(
        os.listdir(value_dir)
    )
    # a saved value/ folder is a value_model= source: same values as the live model
    reloaded = _trainer(tiny_model_path, tmp_path, value_model=str(value_dir), max_steps=1)
    a, b = _state(first.value_function.module), _state(reloaded.value_function.module)
    assert all(torch.equal(a[k], b[k]) for k in a)

    second = make(tmp_path / "resumed")
    second.train(resume_from_checkpoint=str(ckpt))
    assert second.value_optim.num_updates == 8
    resumed_logs = {h["step"]: h for h in second.state.log_history if "value/loss" in h}
    for step in (3, 4):
        for k in keys:
            assert resumed_logs[step][k] == pytest.approx(full_logs[step][k], rel=1e-5, abs=1e-7), (step, k)
    a, b = _state(full.value_function.module), _state(second.value_function.module)
    assert all(torch.equal(a[k], b[k]) for k in a)
    full_opt, second_opt = full.value_optim.optimizer.state_dict(), second.value_optim.optimizer.state_dict()
    for i, st in full_opt["state"].items():
        assert torch.equal(st["exp_avg"], second_opt["state"][i]["exp_avg"])


def test_resume_inside_a_generation_window_is_bit_identical(tiny_model_path, tmp_path):
    """steps_per_generation=2, num_iterations=2: one generation (and one value update) every 4 optimizer steps; a
    checkpoint at step 2 lies inside the window (tests/prime/test_resume_buffered.py): the resumed run logs the same metrics
    and ends with the same policy and value model as the uninterrupted one, the value model updated once per
    generation batch."""
    from test_resume_buffered import StopAfter, _rows, _same, _snap, make

    opts = dict(spg=2, num_iterations=2, grad_accum=1, save_steps=2, max_steps=6, prime_estimator="ppo")
    opts.update(value_learning_rate=1e-3, whiten_advantages=True)
    full = make("prime_rloo", tiny_model_path, None, tmp_path / "full", [], **opts)
    full.train()
    first = make("prime_rloo", tiny_model_path, None, tmp_path / "resumed", [], callbacks=[StopAfter(3)], **opts)
    first.train()
    second = make("prime_rloo", tiny_model_path, None, tmp_path / "resumed", [], **opts)
    second.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    a, b = _rows(full), _rows(second)
    for step in range(3, 7):
        assert a[step] == b[step], step
    assert "value/loss" in a[5] and "value/loss" not in a[4]  # the round of step 5 trained the critic
    assert _same(_snap(full.model), _snap(second.model))
    assert _same(_snap(full.value_function.module), _snap(second.value_function.module))
    assert second.value_optim.num_updates == full.value_optim.num_updates == 2


def test_lora_value_adapter_on_the_shared_base(tiny_model_path, tmp_path):
    from peft import LoraConfig

    tr = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        args=_config(tmp_path, max_steps=1, learning_rate=5e-6, prm_learning_rate=1e-5, value_learning_rate=1e-2),
        train_dataset=tiny_prompt_dataset(8),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    peft_model = unwrap(tr.model)
    assert set(peft_model.peft_config) == {"default", "prm", "value"}
    vf = tr.value_function
    assert vf.adapter_name == "value" and vf.module.backbone is peft_model
    names = {id(p): n for n, p in peft_model.named_parameters()}
    trainable = vf.trainable_parameters()
    assert all(".value." in names[id(p)] for p in trainable[:-2]) and len(trainable) > 2
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    head0 = vf.module.head.weight.detach().clone()
    tr.train()
    after = dict(peft_model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(".value." in n and "lora_B" in n for n in moved)
    assert not any("lora_" not in n for n in moved)  # the shared base did not move
    assert not torch.equal(head0, vf.module.head.weight)
    assert peft_model.active_adapter == "default"
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if ".value." in n)
    tr.save_model(str(tmp_path / "final"))
    assert {"adapter_model.safetensors", "adapter_config.json", VALUE_HEAD_NAME} <= set(
        os.listdir(tmp_path / "final" / "value")
    )


# ----------------------------------------------------------------------------------------------------------------
# Two processes on CPU (tests/scripts/ppo_distributed.py)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "mode", ["ddp", "ddp_lora", "zero3", "zero2", "ddp_pc0", "ddp_prm_value", "zero3_pc0", "zero3_prm_value"]
)
def test_two_processes_train_the_value_model_in_sync(tiny_model_path, tmp_path, mode):
    """The value model trains identically on both ranks (DDP: gradients all-reduced by hand; ZeRO-2/3: its own
    engine, partitioned under ZeRO-3), its first step equals a single process's on the same global batch, and each
    rank's advantages are the GAE of the global batch (whitened over it). Also plain PPO (``process_coef=0``) and the
    implicit PRM as value (no critic: the gathered values are the PRM's prefix values)."""
    if mode.startswith("zero"):
        pytest.importorskip("deepspeed")
    from trl_prime import functional as F

    out = str(tmp_path / mode)
    summary = _launch(mode, tiny_model_path, out)
    critic = not mode.endswith("_prm_value")
    assert summary["num_processes"] == 2 and summary["value_updates"] == (2 if critic else 0)
    assert len(summary["logs"]) == 2
    for h in summary["logs"]:
        for k in ("value/loss", "value/mean", "value/explained_variance") if critic else ("value/mean",):
            assert math.isfinite(h[k]), k
        assert critic or "value/loss" not in h
    if not critic:
        assert "value" not in summary["checkpoint_files"]
    elif mode.startswith("zero"):
        assert "value_deepspeed" in summary["checkpoint_files"]
    elif mode == "ddp_lora":
        assert {"optimizer.pt", "adapter_model.safetensors"} <= set(summary["value_checkpoint_files"])
    else:
        assert {"optimizer.pt", "scheduler.pt", "model.safetensors"} <= set(summary["value_checkpoint_files"])
    if critic:
        assert {VALUE_HEAD_NAME, "prime_state.json"} <= set(summary["value_checkpoint_files"])
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for step in range(2):
        inputs = ranks[0]["steps"][step]["advantage_inputs"]
        assert inputs["whiten"] is True and inputs["values"].size(0) == 6  # the global batch: 3 rows per rank
        assert inputs["process_coef"] == (0.0 if mode.endswith(("_pc0", "_prm_value")) else 1.0)
        if not critic:  # the values are the implicit PRM's prefix values of the gathered token rewards
            prefix = F.implicit_prm_values(inputs["process_rewards"], inputs["mask"])
            torch.testing.assert_close(inputs["values"] * inputs["mask"], prefix * inputs["mask"])
            assert step == 0 or float(prefix.abs().max()) > 0
        global_adv = F.prime_advantages(**inputs)
        torch.testing.assert_close(global_adv, ranks[0]["steps"][step]["global_advantages"])
        rows = 0
        for r in ranks:
            adv = r["steps"][step]["advantages"]
            torch.testing.assert_close(adv, global_adv[rows : rows + adv.size(0), : adv.size(1)])
            rows += adv.size(0)
    if critic and mode != "ddp_lora":
        step = torch.load(os.path.join(out, "value_step.pt"), weights_only=False)
        batches = [r["value_batch"] for r in ranks]
        _check_value_step_single_process(step, tiny_model_path, summary["value_lr"], summary["adam"], batches)


def _check_value_step_single_process(
    step: dict, model_path: str, lr: float, adam: list, batches: list[dict], *, grad_scale: float = 1.0
) -> None:
    """Redo the value model's first step in one process on the 2 ranks' rows (the global batch; each rank's rows a
    micro-batch): ``vf_coef`` (0.1) times the clipped value loss over the global token count, one AdamW step
    (``value_max_grad_norm=None``, ``adam_epsilon=1``: the step is ~ ``lr * g``, so a world-size scaling error in the
    gradients shows). The distributed run's parameter change must match to 1e-5 (relative to ``lr``).
    ``grad_scale``: a factor on the redone loss (a sabotage: 2 must fail)."""
    from trl_prime import functional as F

    vm = ValueModel(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32))
    params = dict(vm.named_parameters())
    assert set(params) == set(step["before"])
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(step["before"][n])
    vm.eval()
    trainable = [p for p in vm.parameters() if p.requires_grad]
    beta1, beta2, eps = adam
    assert eps == 1.0
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=0.0)
    n_global = sum(float(b["train_mask"].sum()) for b in batches)
    assert n_global > 0
    for b in batches:
        v = vm(b["input_ids"], b["attention_mask"], b["actions"].size(1))
        _, returns = F.gae_advantages(b["rewards"], v.detach(), b["actions"], gamma=1.0, lam=1.0)
        loss, _ = F.clipped_value_loss(
            v, v.detach(), returns, b["train_mask"], cliprange_value=0.2, normalizer=n_global
        )
        (grad_scale * 0.1 * loss).backward()
    opt.step()
    moved = 0
    for n, p in vm.named_parameters():
        expected = (p.detach() - step["before"][n]) / lr
        got = (step["after"][n] - step["before"][n]) / lr
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=n)
        moved += int(expected.abs().max() > 1e-4)
    assert (
        moved > 0 and float(((step["after"]["head.weight"] - step["before"]["head.weight"]) / lr).abs().max()) > 1e-3
    )


def _launch(mode: str, model: str, out: str) -> dict:
    cmd = launch_argv(os.path.join(SCRIPTS, "ppo_distributed.py"), "--mode", mode, "--model", model, "--out", out)
    proc = run_launched(cmd, timeout=420)
    assert proc.returncode == 0, f"{mode} launch failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return read_summary(out)
