"""PrimeRLOOTrainer / PrimeGRPOTrainer on a tiny offline model (single process, CPU)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers import tiny_kwargs
from tiny import contains_reward, tiny_prompt_dataset
from transformers import TrainerCallback

from trl_prime import PrimeGRPOConfig, PrimeGRPOTrainer, PrimeRLOOConfig, PrimeRLOOTrainer
from trl_prime import functional as F
from trl_prime.callbacks import PrimeCallback, TokenRewardLogger
from trl_prime.modeling import unwrap


K = 4


def _base_kwargs(tmp_path, **overrides):
    return tiny_kwargs(tmp_path, **{"max_completion_length": 10, "max_steps": 2, **overrides})


def _config(cls, tmp_path, **overrides):
    return cls(**_base_kwargs(tmp_path, **{"prm_learning_rate": 1e-2, **overrides}))


def alternating_reward(completions, prompts, **kwargs):
    """Deterministic verifier by position in the batch: the first group of each batch (and every other one) gets
    1.0 on all completions (accuracy 1 > 0.8: the filter drops it), the next gets 1, 0, 1, 0 (accuracy 0.5: kept)."""
    return [1.0 if (i // K) % 2 == 0 else float(i % 2 == 0) for i in range(len(prompts))]


def unscorable_reward(completions, prompts, **kwargs):
    """As `alternating_reward` with one unscorable completion (None -> NaN) in every kept group."""
    return [None if i % (2 * K) == K + 1 else r for i, r in enumerate(alternating_reward(completions, prompts))]


def zero_for_even_reward(completions, prompts, **kwargs):
    """As `alternating_reward`, but the filtered groups get 0.0 everywhere (accuracy 0: still filtered)."""
    return [0.0 if (i // K) % 2 == 0 else float(i % 2 == 0) for i in range(len(prompts))]


class Recorder(PrimeCallback):
    """Records every PRIME event payload and the PRM weights before each generation round's update."""

    def __init__(self, trainer_ref=None):
        self.events = {"on_prompts_filtered": [], "on_prm_step": [], "on_rollouts_scored": []}
        self.trainer = trainer_ref
        self.prm_before = []

    def on_prompts_filtered(self, args, state, control, **kw):
        self.events["on_prompts_filtered"].append(kw)
        if self.trainer is not None:
            self.prm_before.append({k: v.detach().clone() for k, v in self.trainer.prm_model.state_dict().items()})

    def on_prm_step(self, args, state, control, **kw):
        self.events["on_prm_step"].append(kw)

    def on_rollouts_scored(self, args, state, control, **kw):
        self.events["on_rollouts_scored"].append(kw)


def _snapshot(module):
    return {k: v.detach().clone() for k, v in unwrap(module).state_dict().items()}


def _changed(before, module):
    after = unwrap(module).state_dict()
    return [k for k in before if not torch.equal(before[k], after[k])]


def _trainer(cls, cfg_cls, path, tmp_path, reward=None, callbacks=None, n_prompts=8, **overrides):
    return cls(
        model=path,
        reward_funcs=reward or contains_reward("e"),
        args=_config(cfg_cls, tmp_path, **overrides),
        train_dataset=tiny_prompt_dataset(n_prompts),
        callbacks=callbacks,
    )


# ----------------------------------------------------------------------------------------------------------------
def test_config_defaults_and_validation(tmp_path):
    cfg = _config(PrimeRLOOConfig, tmp_path)
    defaults = PrimeRLOOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    assert (defaults.prm_beta, defaults.prm_learning_rate, defaults.prm_loss, defaults.prm_update) == (
        0.05,
        1e-6,
        "ce",
        "single",
    )
    assert (defaults.prm_reference, defaults.prime_estimator, defaults.beta, defaults.num_generations) == (
        "sft",
        "rloo",
        0.0,
        4,
    )
    assert (defaults.filter_lower, defaults.filter_upper, defaults.epsilon, defaults.process_coef) == (
        0.2,
        0.8,
        0.2,
        1.0,
    )
    assert PrimeGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True).prime_estimator == "grpo"
    assert cfg.generation_batch_size == 8
    bad = [
        (dict(num_generations=1), "num_generations"),
        (dict(filter_lower=0.9, filter_upper=0.5), "filter_lower"),
        (dict(filter_upper=1.5), "filter_upper"),
        (dict(prm_update="triple"), "prm_update"),
        (dict(prm_loss="mse"), "prm_loss"),
        (dict(prm_reference="ema"), "prm_reference"),
        (dict(prime_estimator="a2c"), "prime_estimator"),  # "ppo" is an estimator (tests/prime/test_ppo.py)
        (dict(prime_baseline="mine"), "prime_baseline"),
        (dict(process_reward_norm="max"), "process_reward_norm"),
        (dict(prm_beta=0.0), "prm_beta"),
        (dict(prime_gamma=1.5), "prime_gamma"),
        (dict(prm_micro_batch_size=0), "prm_micro_batch_size"),
        (dict(normalize_advantages=True), "whiten_advantages"),
        (dict(prm_reference="policy", prm_ref_model="x"), "prm_ref_model"),
    ]
    for kw, field_name in bad:
        with pytest.raises(ValueError, match=field_name):
            _config(PrimeRLOOConfig, tmp_path, **kw)
    with pytest.raises(ValueError, match="scale_rewards"):  # "batch" is supported (tests/core/test_prm_label.py)
        _config(PrimeGRPOConfig, tmp_path, scale_rewards="global")
    with pytest.raises(ValueError, match="loss_type"):
        _config(PrimeGRPOConfig, tmp_path, loss_type="luspo", importance_sampling_level="sequence")


def test_step0_is_rloo_with_outcome_rewards_only(tiny_model_path, tmp_path):
    """Single forward: step 1's token rewards come from the untrained PRM and are exactly 0, so PRIME's advantages
    are RLOO's outcome-only advantages, at every token; the same seed gives TRL's RLOOTrainer the same rollouts."""
    from trl import RLOOConfig, RLOOTrainer

    rec = Recorder()
    tr = _trainer(
        PrimeRLOOTrainer,
        PrimeRLOOConfig,
        tiny_model_path,
        tmp_path,
        callbacks=[rec],
        max_steps=1,
        filter_lower=0.0,
        filter_upper=1.0,
    )
    tr.train()
    ev = rec.events["on_rollouts_scored"][0]
    mask = ev["completion_mask"].bool()
    assert torch.equal(ev["token_rewards"], torch.zeros_like(ev["token_rewards"]))
    assert torch.equal(ev["prm_logps"][mask], ev["ref_logps"][mask])
    o = ev["outcome_rewards"].view(-1, K)
    rloo = (o - (o.sum(1, keepdim=True) - o) / (K - 1)).view(-1)
    expected = rloo[:, None].expand_as(ev["advantages"]) * mask
    torch.testing.assert_close(ev["advantages"], expected, atol=1e-6, rtol=0)

    captured = {}

    class Vanilla(RLOOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured.setdefault("out", out)
            return out

    cfg = RLOOConfig(**_base_kwargs(tmp_path / "vanilla", max_steps=1), beta=0.0)
    Vanilla(
        model=tiny_model_path, reward_funcs=contains_reward("e"), args=cfg, train_dataset=tiny_prompt_dataset(8)
    ).train()
    van = captured["out"]
    assert torch.equal(van["completion_ids"], ev["completion_ids"])
    torch.testing.assert_close(van["advantages"], rloo, atol=1e-6, rtol=0)


def test_prm_trains_optimizers_are_disjoint_and_reference_is_frozen(tiny_model_path, tmp_path):
    tr = _trainer(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, max_steps=3, filter_lower=0.0, filter_upper=1.0
    )
    prm0, ref0, pol0 = _snapshot(tr.prm_model), _snapshot(tr.implicit_prm.ref_model), _snapshot(tr.model)
    assert tr.implicit_prm.reference == "model"
    tr.train()
    assert len(_changed(prm0, tr.prm_model)) == len(prm0)  # every PRM tensor moved
    assert _changed(ref0, tr.implicit_prm.ref_model) == []  # the reference never does
    assert len(_changed(pol0, tr.model)) > 0
    policy_ids = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    prm_ids = {id(p) for g in tr.prm_optimizer.param_groups for p in g["params"]}
    assert prm_ids == {id(p) for p in tr.prm_model.parameters()}
    assert policy_ids and not (policy_ids & prm_ids)
    assert not ({id(p) for p in tr.model.parameters()} & prm_ids)
    assert not ({id(p) for p in tr.implicit_prm.ref_model.parameters()} & (policy_ids | prm_ids))
    assert tr.prm_optim.num_updates == 3
    logs = [h for h in tr.state.log_history if "prm/loss" in h]
    assert len(logs) == 3 and logs[0]["prm/loss"] == pytest.approx(math.log(2), abs=1e-6)


def _key(prompt_ids, completion_ids):
    return tuple(prompt_ids.tolist()) + (-1,) + tuple(completion_ids.tolist())


@pytest.mark.parametrize(
    "cls,cfg_cls,reward,options",
    [
        (PrimeRLOOTrainer, PrimeRLOOConfig, alternating_reward, {}),
        (
            PrimeRLOOTrainer,
            PrimeRLOOConfig,
            alternating_reward,
            dict(
                whiten_advantages=True,
                process_reward_norm="batch_norm",
                prime_baseline="reference",
                include_last_token=False,
                process_coef=5.0,
                outcome_coef=5.0,
                prm_update="double",
            ),
        ),
        (PrimeRLOOTrainer, PrimeRLOOConfig, unscorable_reward, dict(prm_micro_batch_size=3)),
        (PrimeGRPOTrainer, PrimeGRPOConfig, alternating_reward, dict(prime_gamma=0.9)),
    ],
    ids=["rloo-paper", "rloo-released-code-options", "rloo-unscorable-rows", "grpo"],
)
def test_loss_gets_functional_prime_advantages(tiny_model_path, tmp_path, cls, cfg_cls, reward, options):
    """Rebuild every input independently (verifier, filter, PRM and reference log-probs from fresh copies of the
    weights with a full log-softmax) and check that the advantages reaching `_compute_loss` are
    `functional.prime_advantages` of them."""
    from transformers import AutoModelForCausalLM

    seen = []

    class Spy(cls):
        def _compute_loss(self, model, inputs):
            seen.append(dict(inputs))
            return super()._compute_loss(model, inputs)

    rec = Recorder()
    tr = _trainer(Spy, cfg_cls, tiny_model_path, tmp_path, reward=reward, callbacks=[rec], **options)
    rec.trainer = tr
    tr.train()
    a = tr.args
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    for step, ev in enumerate(rec.events["on_rollouts_scored"]):
        ids = torch.cat([ev["prompt_ids"], ev["completion_ids"]], 1)
        am = torch.cat([ev["prompt_mask"], ev["completion_mask"]], 1)
        cm = ev["completion_mask"]
        T = cm.size(1)
        # verifier and filter
        outcome = torch.tensor([torch.nan if r is None else r for r in reward(ev["completions"], ev["prompts"])])
        torch.testing.assert_close(ev["outcome_rewards"], outcome, equal_nan=True)
        scorable = ~torch.isnan(outcome)
        kept = F.prompt_accuracy_mask(outcome, K, lower=a.filter_lower, upper=a.filter_upper)
        assert torch.equal(ev["kept_mask"], kept) and kept.any() and not kept.all()
        # reference and PRM log-probs from fresh copies, naive log-softmax, one unpadded row at a time
        from helpers import naive_logps

        ref_lp = naive_logps(fresh, ids, am, T)
        prm_copy = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
        state = rec.prm_before[step]
        if a.prm_update == "double":  # rewards come from the PRM after this round's update
            state = rec.prm_before[step + 1] if step + 1 < len(rec.prm_before) else _snapshot(tr.prm_model)
        prm_copy.load_state_dict(state)
        prm_lp = naive_logps(prm_copy, ids, am, T)
        rewards = F.implicit_token_rewards(prm_logps=prm_lp, ref_logps=ref_lp, mask=cm, beta=a.prm_beta)
        torch.testing.assert_close(ev["token_rewards"], rewards, atol=5e-6, rtol=1e-4)
        if step > 0 or a.prm_update == "double":
            assert rewards.abs().max() > 1e-5
        opts = dict(
            estimator=a.prime_estimator,
            process_coef=a.process_coef,
            outcome_coef=a.outcome_coef,
            gamma=a.prime_gamma,
            whiten=a.whiten_advantages,
            process_reward_norm=a.process_reward_norm,
            include_last_token=a.include_last_token,
        )
        if a.prime_estimator == "rloo":
            opts["baseline"] = a.prime_baseline
        else:
            opts["scale_rewards"] = True
        expected = F.prime_advantages(
            process_rewards=rewards,
            outcome_rewards=torch.where(kept, outcome, torch.nan),
            mask=cm,
            group_ids=torch.arange(len(outcome)) // K,
            **opts,
        )
        torch.testing.assert_close(ev["advantages"], expected, atol=2e-5, rtol=1e-4)
        assert torch.all(expected[~kept] == 0) and torch.all(expected[~scorable] == 0)
        assert torch.equal(ev["loss_mask"], cm * (kept & scorable)[:, None])
        # the loss saw exactly these rows (TRL shuffles the rows of a generation batch: match them by content)
        loss_inputs = seen[step]
        want = {
            _key(ev["prompt_ids"][i], ev["completion_ids"][i]): (ev["advantages"][i], ev["loss_mask"][i])
            for i in range(len(outcome))
        }
        for i in range(loss_inputs["completion_ids"].size(0)):
            adv, lmask = want[_key(loss_inputs["prompt_ids"][i], loss_inputs["completion_ids"][i])]
            assert torch.equal(loss_inputs["advantages"][i], adv)
            if cls is PrimeGRPOTrainer:
                assert torch.equal(loss_inputs["tool_mask"][i] * loss_inputs["completion_mask"][i], lmask)
            else:
                assert torch.equal(loss_inputs["prime_loss_mask"][i], lmask)
        n_kept_tokens = (cm * (kept & scorable)[:, None]).sum()
        assert loss_inputs["num_items_in_batch"].item() == n_kept_tokens.item()


def test_filtered_groups_train_neither_prm_nor_policy(tiny_model_path, tmp_path):
    """Groups outside [filter_lower, filter_upper] have weight 0 in both updates: flipping their labels from all-1
    to all-0 (both filtered) leaves the PRM and the policy bit-identical after a step, while with the filter off
    the same flip changes the PRM."""

    def run(reward, name, **kw):
        rec = Recorder()
        tr = _trainer(
            PrimeRLOOTrainer,
            PrimeRLOOConfig,
            tiny_model_path,
            tmp_path / name,
            reward=reward,
            callbacks=[rec],
            max_steps=1,
            **kw,
        )
        tr.train()
        return tr, rec

    a, rec_a = run(alternating_reward, "a")
    b, _ = run(zero_for_even_reward, "b")
    assert _changed(_snapshot(a.prm_model), b.prm_model) == []
    assert _changed(_snapshot(a.model), b.model) == []
    ev, prm_ev = rec_a.events["on_rollouts_scored"][0], rec_a.events["on_prm_step"][0]
    kept = ev["kept_mask"]
    assert kept.any() and not kept.all()
    assert torch.all(ev["loss_mask"][~kept] == 0) and torch.all(ev["advantages"][~kept] == 0)
    assert torch.all(prm_ev["row_weights"][~kept] == 0) and torch.all(prm_ev["row_weights"][kept] > 0)
    assert prm_ev["row_weights"].sum().item() == pytest.approx(1.0)
    assert rec_a.events["on_prompts_filtered"][0]["kept_fraction"] == 0.5
    c, _ = run(alternating_reward, "c", filter_lower=0.0, filter_upper=1.0)
    d, _ = run(zero_for_even_reward, "d", filter_lower=0.0, filter_upper=1.0)
    assert _changed(_snapshot(c.prm_model), d.prm_model)  # (the policy can't tell: uniform groups have advantage 0)


def test_lora_shared_base_trains_both_adapters_not_the_base(tiny_model_path, tmp_path):
    from peft import LoraConfig

    rec = Recorder()
    tr = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=alternating_reward,
        args=_config(PrimeRLOOConfig, tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=tiny_prompt_dataset(8),
        callbacks=[rec],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert tr.implicit_prm.adapter_name == "prm" and tr.implicit_prm.reference == "adapters_disabled"
    assert tr.prm_model is unwrap(tr.model)  # one base model for policy, PRM and reference
    before = _snapshot(tr.model)
    flags = {n: p.requires_grad for n, p in tr.model.named_parameters()}
    tr.train()
    changed = set(_changed(before, tr.model))
    default = {k for k in before if ".default." in k and "lora_B" in k}
    prm = {k for k in before if ".prm." in k}
    base = {k for k in before if "lora_" not in k}
    assert default <= changed and prm <= changed
    assert not (base & changed)
    assert {n: p.requires_grad for n, p in tr.model.named_parameters()} == flags
    policy_ids = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    prm_ids = {id(p) for g in tr.prm_optimizer.param_groups for p in g["params"]}
    named = dict(tr.model.named_parameters())
    assert prm_ids == {id(named[k]) for k in named if ".prm." in k}
    assert policy_ids == {id(named[k]) for k in named if ".default." in k}
    ev = rec.events["on_rollouts_scored"][0]
    assert torch.equal(ev["token_rewards"], torch.zeros_like(ev["token_rewards"]))  # base == PRM at step 1
    # the checkpoint's PRM is a standard adapter folder that reloads on its own and scores like the live PRM
    from trl_prime import ImplicitPRM

    prm_dir = os.path.join(tr.args.output_dir, "checkpoint-2", "prm")
    assert {"adapter_model.safetensors", "adapter_config.json", "implicit_prm_config.json", "optimizer.pt"} <= set(
        os.listdir(prm_dir)
    )
    loaded = ImplicitPRM.from_pretrained(prm_dir)
    prompts, completions = ["What is 1 + 1?", "What is 3 + 0?"], ["The answer\n\nis 2.", "3"]
    live = tr.implicit_prm.score(prompts, completions)
    assert loaded.score(prompts, completions) == pytest.approx(live, abs=1e-7) and any(abs(x) > 0 for x in live)


def test_reference_options(tiny_model_path, tmp_path):
    """prm_reference='policy' (rollout log-probs, no reference model), TRL's beta > 0 (the PRM shares TRL's
    reference model and log-probs) and a separate prm_model: all start with exactly zero rewards."""
    from tiny import build_tiny_model

    rec = Recorder()
    tr = _trainer(
        PrimeRLOOTrainer,
        PrimeRLOOConfig,
        tiny_model_path,
        tmp_path / "p",
        callbacks=[rec],
        max_steps=1,
        prm_reference="policy",
    )
    assert tr.implicit_prm.ref_model is None and tr.implicit_prm.reference == "external"
    tr.train()
    ev = rec.events["on_rollouts_scored"][0]
    assert torch.equal(ev["token_rewards"], torch.zeros_like(ev["token_rewards"]))

    rec = Recorder()
    tr = _trainer(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path / "b", callbacks=[rec], max_steps=1, beta=0.1
    )
    assert tr.implicit_prm.ref_model is tr.ref_model and tr._shares_trl_ref
    tr.train()
    ev = rec.events["on_rollouts_scored"][0]
    assert torch.equal(ev["token_rewards"], torch.zeros_like(ev["token_rewards"]))
    assert "kl" in tr.state.log_history[0]

    other = build_tiny_model(tmp_path / "other_prm", seed=7)
    rec = Recorder()
    tr = _trainer(
        PrimeGRPOTrainer,
        PrimeGRPOConfig,
        tiny_model_path,
        tmp_path / "m",
        callbacks=[rec],
        max_steps=1,
        prm_model=other,
    )
    w_policy = unwrap(tr.model).model.embed_tokens.weight
    w_prm = tr.prm_model.model.embed_tokens.weight
    assert not torch.equal(w_policy, w_prm) and torch.equal(w_prm, tr.implicit_prm.ref_model.model.embed_tokens.weight)
    tr.train()
    ev = rec.events["on_rollouts_scored"][0]
    assert torch.equal(ev["token_rewards"], torch.zeros_like(ev["token_rewards"]))


def test_callbacks_fire_with_payloads_and_token_reward_logger(tiny_model_path, tmp_path):
    class PlainCallback(TrainerCallback):  # not a PrimeCallback: still receives the events it defines
        def __init__(self):
            self.prm_steps = []

        def on_prm_step(self, args, state, control, **kw):
            self.prm_steps.append((state.global_step, kw["num_updates"], kw["loss"]))

    from trl_prime.rewards import math_reward

    rec, plain = Recorder(), PlainCallback()
    logger = TokenRewardLogger(every_n_steps=2, num_completions=3)
    tr = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=[alternating_reward, math_reward],  # math_reward (weight 0) only logs its reason counts
        args=_config(PrimeRLOOConfig, tmp_path, max_steps=3, reward_weights=[1.0, 0.0]),
        train_dataset=tiny_prompt_dataset(8),
        callbacks=[rec, plain, logger],
    )
    tr.train()
    assert [len(rec.events[e]) for e in ("on_prompts_filtered", "on_prm_step", "on_rollouts_scored")] == [3, 3, 3]
    assert [s[:2] for s in plain.prm_steps] == [(0, 1), (1, 2), (2, 3)]
    logs = [h for h in tr.state.log_history if "prm/loss" in h]
    assert [s[2] for s in plain.prm_steps] == pytest.approx([h["prm/loss"] for h in logs])
    # the verifier's reason counts reach the logs through TRL's log_metric, next to the PRIME metrics
    assert all(
        sum(h[f"math/{r}"] for r in ("correct", "wrong", "no_answer", "timeout", "error", "gold_unparseable")) == 8
        for h in logs
    )
    f = rec.events["on_prompts_filtered"][0]
    assert f["outcome_rewards"].shape == (8,) and f["kept_mask"].dtype == torch.bool and f["num_generations"] == K
    assert f["group_kept"].tolist() == [False, True] and f["kept_fraction"] == 0.5
    p = rec.events["on_prm_step"][0]
    assert {"loss", "grad_norm", "learning_rate", "labels", "row_weights", "prm_model"} <= set(p)
    assert p["learning_rate"] == pytest.approx(1e-2) and p["grad_norm"] > 0
    s = rec.events["on_rollouts_scored"][1]
    assert s["step"] == 2 and s["token_rewards"].shape == s["completion_ids"].shape == s["advantages"].shape
    torch.testing.assert_close(s["sequence_rewards"], s["token_rewards"].sum(-1))
    # TokenRewardLogger: steps 1 and 3, 3 completions each, token texts and rewards as in the payloads
    lines = [json.loads(x) for x in open(os.path.join(tr.args.output_dir, "token_rewards.jsonl"))]
    assert [r["step"] for r in lines] == [1, 1, 1, 3, 3, 3]
    ev3 = rec.events["on_rollouts_scored"][2]
    for r in lines[3:]:
        i = r["index"]
        n = int(ev3["completion_mask"][i].sum())
        assert len(r["tokens"]) == n
        assert sum(t["reward"] for t in r["tokens"]) == pytest.approx(float(ev3["sequence_rewards"][i]), abs=1e-6)
        ids = ev3["completion_ids"][i, :n].tolist()
        assert [t["id"] for t in r["tokens"]] == ids
        assert [t["token"] for t in r["tokens"]] == [tr.processing_class.decode([t]) for t in ids]
        assert r["outcome_reward"] == float(ev3["outcome_rewards"][i]) and r["kept"] == bool(ev3["kept_mask"][i])


def test_checkpoint_and_resume_reproduce_the_uninterrupted_run(tiny_model_path, tmp_path):
    from trl_prime import ImplicitPRM

    keys = [
        "prm/loss",
        "prm/pair_accuracy",
        "prm/abs_accuracy",
        "prm/token_reward_mean",
        "reward",
        "loss",
        "filter/kept_fraction",
        "prm/grad_norm",
    ]

    def make(out, callbacks=None):
        return _trainer(
            PrimeRLOOTrainer,
            PrimeRLOOConfig,
            tiny_model_path,
            tmp_path,
            reward=contains_reward("e"),
            callbacks=callbacks,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            output_dir=str(out),
            filter_lower=0.0,
            filter_upper=1.0,
            prm_lr_scheduler="linear",
            n_prompts=16,
        )

    full = make(tmp_path / "full")
    full.train()
    full_logs = {h["step"]: h for h in full.state.log_history if "prm/loss" in h}

    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                control.should_training_stop = True

    first = make(tmp_path / "resumed", callbacks=[StopAt2()])
    first.train()
    ckpt = tmp_path / "resumed" / "checkpoint-2"
    prm_dir = ckpt / "prm"
    assert {
        "config.json",
        "model.safetensors",
        "implicit_prm_config.json",
        "optimizer.pt",
        "scheduler.pt",
        "prime_state.json",
        "reference",
    } <= set(os.listdir(prm_dir))
    # the saved PRM reloads on its own and scores like the live one
    prompts, completions = ["What is 1 + 1?", "What is 3 + 0?"], ["The answer\n\nis 2.", "3"]
    loaded = ImplicitPRM.from_pretrained(prm_dir)
    assert loaded.score(prompts, completions) == pytest.approx(
        first.implicit_prm.score(prompts, completions), abs=1e-7
    )
    assert loaded.score(prompts, completions) != pytest.approx([0.0, 0.0], abs=1e-9)  # it did learn

    second = make(tmp_path / "resumed")
    second.train(resume_from_checkpoint=str(ckpt))
    assert second.prm_optim.num_updates == 4
    resumed_logs = {h["step"]: h for h in second.state.log_history if "prm/loss" in h}
    for step in (3, 4):
        for k in keys:
            assert resumed_logs[step][k] == pytest.approx(full_logs[step][k], rel=1e-5, abs=1e-7), (step, k)
    assert _changed(_snapshot(full.prm_model), second.prm_model) == []
    assert _changed(_snapshot(full.model), second.model) == []
    assert second.prm_lr_scheduler.get_last_lr() == full.prm_lr_scheduler.get_last_lr()


def test_twenty_step_run_logs_prm_metrics_every_step(tiny_model_path, tmp_path):
    tr = _trainer(
        PrimeRLOOTrainer,
        PrimeRLOOConfig,
        tiny_model_path,
        tmp_path,
        reward=contains_reward("e"),
        max_steps=20,
        n_prompts=40,
        prm_learning_rate=3e-3,
        filter_lower=0.0,
        filter_upper=1.0,
    )
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
    assert [h["step"] for h in logs] == list(range(1, 21))
    names = [
        "loss",
        "prm/loss",
        "prm/pair_accuracy",
        "prm/abs_accuracy",
        "prm/token_reward_mean",
        "prm/token_reward_std",
        "prm/token_reward_min",
        "prm/token_reward_max",
        "filter/kept_fraction",
        "reward",
        "entropy",
        "clip_ratio/region_mean",
    ]
    for h in logs:
        for n in names:
            assert n in h and h[n] is not None and math.isfinite(h[n]), (h["step"], n)
        assert 0.0 <= h["prm/pair_accuracy"] <= 1.0 and h["filter/kept_fraction"] == 1.0
    assert logs[0]["prm/token_reward_std"] == 0.0 and logs[-1]["prm/token_reward_std"] > 0.0
    # step 1: the untrained PRM ties every pair, which reads exactly 0.5 (PRIME Figure 5's starting point)
    assert logs[0]["prm/pair_accuracy"] == 0.5
    # the PRM learns the verifier on the kept groups: its loss goes down from log(2)
    assert logs[0]["prm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert sum(h["prm/loss"] for h in logs[-5:]) / 5 < math.log(2)


# ----------------------------------------------------------------------------------------------------------------
def test_config_prime_defaults_coefficients_and_loss_type_warning(tmp_path):
    """PRIME's overrides of TRL defaults (policy lr 5e-7, K=4, beta 0, GRPO loss_type "dapo"), listed in the class
    docstrings; non-finite or negative advantage coefficients fail naming the field (0 is allowed); a per-sequence /
    per-micro-batch GRPO loss_type with the prompt filter on warns at config time."""
    import warnings

    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    rloo, grpo = PrimeRLOOConfig(**plain), PrimeGRPOConfig(**plain)
    assert (rloo.learning_rate, rloo.beta, rloo.num_generations, rloo.epsilon) == (5e-7, 0.0, 4, 0.2)
    assert (grpo.learning_rate, grpo.beta, grpo.num_generations, grpo.epsilon, grpo.loss_type) == (
        5e-7,
        0.0,
        4,
        0.2,
        "dapo",
    )
    for cls, overridden in (
        (PrimeRLOOConfig, ("beta", "num_generations", "learning_rate", "epsilon")),
        (PrimeGRPOConfig, ("beta", "num_generations", "learning_rate", "epsilon", "loss_type")),
    ):
        doc = " ".join(cls.__doc__.split())
        for name in overridden:
            assert f"``{name}``" in doc, (cls.__name__, name)
        assert "5e-7" in doc
    for name in ("process_coef", "outcome_coef"):
        for value in (float("nan"), float("inf"), -1.0):
            with pytest.raises(ValueError, match=name):
                PrimeRLOOConfig(**plain, **{name: value})
        assert getattr(PrimeRLOOConfig(**plain, **{name: 0.0}), name) == 0.0

    for loss_type in ("grpo", "sapo", "bnpo", "dr_grpo"):
        with pytest.warns(UserWarning, match=r"`loss_type`=.*dapo"):
            PrimeGRPOConfig(**plain, loss_type=loss_type)
    quiet = [dict(loss_type="dapo"), dict(loss_type="grpo", filter_lower=0.0, filter_upper=1.0)]
    for kw in quiet:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PrimeGRPOConfig(**plain, **kw)
        assert not [w for w in caught if "`loss_type`" in str(w.message)], kw
    with pytest.warns(UserWarning, match="loss_type"):
        PrimeGRPOConfig(**plain, loss_type="grpo", filter_lower=0.0, filter_upper=1.0, filter_truncated=True)


def test_save_model_writes_the_trained_prm(tiny_model_path, tmp_path):
    """`trainer.save_model(dir)` saves the policy and, in dir/prm, the trained PRM: it reloads with
    `ImplicitPRM.from_pretrained` and scores exactly like the trainer's PRM (which moved off its reference)."""
    from trl_prime import ImplicitPRM

    tr = _trainer(PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, reward=alternating_reward)
    tr.train()
    out = tmp_path / "saved"
    tr.save_model(str(out))
    assert "model.safetensors" in os.listdir(out)  # the policy, as Trainer.save_model writes it
    assert {"model.safetensors", "implicit_prm_config.json", "reference"} <= set(os.listdir(out / "prm"))
    loaded = ImplicitPRM.from_pretrained(out / "prm")
    prompts, completions = ["What is 1 + 1?", "What is 3 + 0?"], ["The answer\n\nis 2.", "3"]
    live = tr.implicit_prm.score(prompts, completions)
    assert any(abs(x) > 0 for x in live)
    assert loaded.score(prompts, completions) == pytest.approx(live, abs=1e-7)


def test_lora_policy_reference_records_the_trained_reference(tiny_model_path, tmp_path):
    """LoRA + prm_reference="policy": the PRM trained against the rollout log-probs, though it scores against the
    base with adapters disabled. The saved config says so (`trained_reference`) and `from_pretrained` warns."""
    from peft import LoraConfig

    from trl_prime import ImplicitPRM

    tr = PrimeRLOOTrainer(
        model=tiny_model_path,
        reward_funcs=alternating_reward,
        args=_config(PrimeRLOOConfig, tmp_path, max_steps=1, prm_reference="policy"),
        train_dataset=tiny_prompt_dataset(8),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    assert tr.implicit_prm.reference == "adapters_disabled" and tr.implicit_prm.trained_reference == "policy"
    tr.train()
    out = tmp_path / "saved"
    tr.save_model(str(out))
    with open(out / "prm" / "implicit_prm_config.json") as f:
        cfg = json.load(f)
    assert (cfg["reference"], cfg["trained_reference"]) == ("adapters_disabled", "policy")
    with pytest.warns(UserWarning, match="rollout policy"):
        loaded = ImplicitPRM.from_pretrained(out / "prm")
    assert loaded.trained_reference == "policy"
    prompts, completions = ["What is 1 + 1?"], ["The answer\n\nis 2."]
    assert loaded.score(prompts, completions) == pytest.approx(tr.implicit_prm.score(prompts, completions), abs=1e-7)


@pytest.mark.parametrize("prm_loss", ["dpo", "nca", "kto"])
def test_pairwise_and_kto_prm_losses_match_functional(tiny_model_path, tmp_path, prm_loss):
    """The trainer's DPO/NCA/KTO PRM loss (computed on gathered per-sequence log-ratios) equals
    `functional.implicit_prm_loss` on the (B, T) log-probs of the same step, with pairs grouped by prompt."""
    rec = Recorder()
    tr = _trainer(
        PrimeRLOOTrainer,
        PrimeRLOOConfig,
        tiny_model_path,
        tmp_path,
        reward=alternating_reward,
        callbacks=[rec],
        prm_loss=prm_loss,
    )
    tr.train()
    for prm_ev, ev in zip(rec.events["on_prm_step"], rec.events["on_rollouts_scored"]):
        B = ev["completion_mask"].size(0)
        assert prm_ev["loss_group_ids"].tolist() == [i // K for i in range(B)]
        assert torch.equal(prm_ev["loss_labels"].nan_to_num(-1), prm_ev["labels"].nan_to_num(-1))
        expected = F.implicit_prm_loss(
            prm_logps=ev["prm_logps"],
            ref_logps=ev["ref_logps"],
            mask=ev["completion_mask"],
            labels=prm_ev["labels"],
            beta=tr.args.prm_beta,
            loss_type=prm_loss,
            group_ids=torch.arange(B) // K,
        )
        assert prm_ev["loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert rec.events["on_rollouts_scored"][1]["token_rewards"].abs().max() > 0  # step 2 checks non-zero rewards


def test_text_only_prm_next_to_a_vision_language_policy_gets_no_images(tiny_model_path, tmp_path):
    """A text-only PRM (and PRM reference) scores the text: the multimodal inputs a vision-language policy's batch
    carries (TRL's ``pixel_values`` ...) go to a PRM whose forward takes them, and not to a text-only causal LM
    (which would fail deep in its forward)."""
    from types import SimpleNamespace

    from trl_prime.prime.trainer import _accepts_images

    class VisionForward(torch.nn.Module):
        def forward(self, input_ids=None, pixel_values=None, **kwargs):
            return input_ids

    assert _accepts_images(VisionForward()) and not _accepts_images(None)
    tr = _trainer(PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, prm_model=tiny_model_path)
    assert not tr._prm_takes_images and not tr._prm_ref_takes_images
    seen = []
    assert tr.implicit_prm.ref_model is not None  # a separate PRM: its own frozen copy as reference
    for m in (tr.implicit_prm.model, tr.implicit_prm.ref_model):
        m.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw.get("pixel_values")), with_kwargs=True)
    ids = torch.randint(0, 50, (2, 6))
    actions = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])[:, 2:]
    kept = SimpleNamespace(
        labels=torch.tensor([1.0, 0.0]), kept=torch.tensor([True, True]), unscored=torch.tensor([False, False])
    )
    r = SimpleNamespace(
        mode="eval", actions=actions, filter=kept, local=slice(0, 2), input_ids=ids,
        attention_mask=torch.ones_like(ids), mm={"pixel_values": torch.ones(2, 3)}, capture={},
    )  # fmt: skip
    lp, _ = tr._update_prm(None, r)
    ref, _ = tr._reference_logps({"completion_mask": actions}, r)
    assert lp.shape == ref.shape == (2, 4) and seen and all(v is None for v in seen)
