"""TRL setups with outcome rewards outside [0, 1] (a reward model, a weighted sum of verifiers), TRL's
``scale_rewards="batch"``, and task-less PEFT configs, on the PRIME and PRL trainers (tiny offline models, CPU).

PRIME trains its implicit PRM with cross-entropy on a label in [0, 1] (PRIME arXiv 2502.01456 Eq. 4): ``prm_label``
derives that label from the outcome reward, which the advantages keep as it is (docs/guides/trl_options.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_kwargs
from tiny import build_tokenizer, tiny_prompt_dataset, tiny_qwen2_config

from trl_prime import PrimeGRPOConfig, PrimeGRPOTrainer, PrimeRLOOConfig, PrimeRLOOTrainer, PRLConfig, PRLGRPOTrainer
from trl_prime import functional as F
from trl_prime.callbacks import PrimeCallback
from trl_prime.modeling import unwrap


K = 4


def _kwargs(tmp_path, **overrides):
    return tiny_kwargs(tmp_path, **{"max_steps": 2, **overrides})


@pytest.fixture(scope="module")
def tiny_reward_model_path(tmp_path_factory) -> str:
    """A tiny Qwen2 sequence-classification reward model (one logit; TRL's reward-model reward function) whose head is
    scaled up so its scores spread well outside [0, 1]."""
    from transformers import AutoModelForSequenceClassification

    path = tmp_path_factory.mktemp("tiny_rm")
    tokenizer = build_tokenizer()
    config = tiny_qwen2_config(tokenizer, num_labels=1)
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.mul_(200.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class Recorder(PrimeCallback):
    def __init__(self):
        self.prm_steps, self.rounds = [], []

    def on_prm_step(self, args, state, control, **kw):
        self.prm_steps.append(kw)

    def on_rollouts_scored(self, args, state, control, **kw):
        self.rounds.append(kw)


def _prime(cls, path, tmp_path, reward, *, rec=None, trainer_kwargs=None, **overrides):
    cfg_cls = PrimeRLOOConfig if cls is PrimeRLOOTrainer else PrimeGRPOConfig
    return cls(
        model=path,
        reward_funcs=reward,
        args=cfg_cls(**_kwargs(tmp_path, prm_learning_rate=1e-2, **overrides)),
        train_dataset=tiny_prompt_dataset(8),
        callbacks=[rec] if rec is not None else None,
        **(trainer_kwargs or {}),
    )


def _check_labels_and_raw_advantage_outcome(tr, rec):
    """The PRM trained on labels in [0, 1] equal to functional.prm_labels of the outcome rewards (kept rows), while
    the advantages received the raw outcome rewards."""
    a = tr.args
    assert rec.prm_steps, "no PRM step"
    for step, ev in zip(rec.prm_steps, rec.rounds):
        outcome = ev["outcome_rewards"]
        want = F.prm_labels(
            outcome,
            a.prm_label,
            num_generations=K,
            threshold=a.prm_label_threshold,
            temperature=a.prm_label_temperature,
            min_spread=a.prm_label_min_spread,
        )
        labels = step["labels"]
        kept = ev["kept_mask"] & (ev["completion_mask"].sum(-1) > 0)
        torch.testing.assert_close(labels[kept], want[kept], equal_nan=True)
        assert bool(torch.isnan(labels[~kept]).all())
        finite = labels[~torch.isnan(labels)]
        assert finite.numel() and bool(((finite >= 0) & (finite <= 1)).all())
        raw = ev["advantage_inputs"]["outcome_rewards"]  # global == local here (one process)
        torch.testing.assert_close(raw[kept], outcome[kept])


# ----------------------------------------------------------------------------------------------------------------
# A reward model as the reward function
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [PrimeRLOOTrainer, PrimeGRPOTrainer])
@pytest.mark.parametrize(
    "label_options",
    [
        dict(prm_label="sigmoid", prm_label_temperature=2.0),
        dict(prm_label="group_rank"),
        dict(prm_label="threshold", prm_label_threshold=0.0),
    ],
    ids=lambda o: o["prm_label"],
)
def test_reward_model_trains_with_prm_label(tiny_model_path, tiny_reward_model_path, tmp_path, cls, label_options):
    rec = Recorder()
    tr = _prime(
        cls, tiny_model_path, tmp_path, tiny_reward_model_path, rec=rec, filter_lower=0.0, filter_upper=1.0,
        **label_options,
    )  # fmt: skip
    before = {k: v.clone() for k, v in unwrap(tr.prm_model).state_dict().items()}
    tr.train()
    outcome = torch.cat([ev["outcome_rewards"] for ev in rec.rounds])
    assert bool(((outcome < 0) | (outcome > 1)).any())  # the reward model's scores leave [0, 1]
    _check_labels_and_raw_advantage_outcome(tr, rec)
    after = unwrap(tr.prm_model).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the PRM trained
    logs = [h for h in tr.state.log_history if "prm/pair_accuracy" in h]
    assert logs and all(math.isfinite(h["prm/loss"]) for h in logs)


@pytest.mark.parametrize("cls", [PrimeRLOOTrainer, PrimeGRPOTrainer])
def test_reward_model_with_identity_label_is_refused(tiny_model_path, tiny_reward_model_path, tmp_path, cls):
    tr = _prime(cls, tiny_model_path, tmp_path, tiny_reward_model_path, max_steps=1)
    with pytest.raises(ValueError, match=r"outcome labels in \[0, 1\].*reward model.*`prm_label`='threshold'"):
        tr.train()


# ----------------------------------------------------------------------------------------------------------------
# A weighted sum of two verifiers whose weights add to more than 1
# ----------------------------------------------------------------------------------------------------------------
def verifier_a(completions, **kwargs):
    return [float(i % 2 == 0) for i in range(len(completions))]


def verifier_b(completions, **kwargs):
    return [float(i % 4 < 2) for i in range(len(completions))]


# weights 0.7 and 0.6: each group of 4 gets rewards [1.3, 0.6, 0.7, 0.0]
WEIGHTED = dict(reward_weights=[0.7, 0.6], filter_lower=0.0, filter_upper=1.0)


def test_weighted_verifiers_identity_refused_other_labels_train(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match=r"outcome labels in \[0, 1\].*\[0, 1.3\].*prm_label"):
        _prime(PrimeRLOOTrainer, tiny_model_path, tmp_path, [verifier_a, verifier_b], max_steps=1, **WEIGHTED).train()
    for cls, label, want in (
        (PrimeRLOOTrainer, dict(prm_label="threshold", prm_label_threshold=0.65), [1.0, 0.0, 1.0, 0.0]),
        (PrimeGRPOTrainer, dict(prm_label="group_rank"), [1.0, 0.0, 1.0, 0.0]),  # group mean 0.65
        (
            PrimeRLOOTrainer,
            dict(prm_label="sigmoid", prm_label_temperature=0.5),
            torch.sigmoid(torch.tensor([1.3, 0.6, 0.7, 0.0]) / 0.5).tolist(),
        ),
    ):
        rec = Recorder()
        tr = _prime(cls, tiny_model_path, tmp_path, [verifier_a, verifier_b], rec=rec, **WEIGHTED, **label)
        tr.train()
        _check_labels_and_raw_advantage_outcome(tr, rec)
        ev = rec.rounds[0]
        torch.testing.assert_close(ev["outcome_rewards"], torch.tensor([1.3, 0.6, 0.7, 0.0] * 2))
        torch.testing.assert_close(rec.prm_steps[0]["labels"], torch.tensor(want * 2))


def _even_passes(completions, **kwargs):
    return [float(i % 2 == 0) for i in range(len(completions))]


def test_weights_summing_to_one_train_with_identity(tiny_model_path, tmp_path):
    """Four verifiers weighted [0.3, 0.4, 0.1, 0.2]: TRL's float32 weighted sum is 1.0000001 when all pass. The
    identity label accepts it (within 1e-6 of [0, 1]) and clamps it: the PRM's labels are exactly [1, 0, 1, 0]."""
    rec = Recorder()
    tr = _prime(
        PrimeRLOOTrainer, tiny_model_path, tmp_path, [_even_passes] * 4, rec=rec, max_steps=1,
        reward_weights=[0.3, 0.4, 0.1, 0.2], filter_lower=0.0, filter_upper=1.0,
    )  # fmt: skip
    tr.train()
    outcome = rec.rounds[0]["outcome_rewards"]
    assert outcome[0].item() > 1.0  # 1.0000001: the float32 rounding the check tolerates
    assert rec.prm_steps[0]["labels"].tolist() == [1.0, 0.0] * 4


def test_prompt_filter_reads_the_labels(tiny_model_path, tmp_path):
    """The online prompt filter's accuracy is the group's mean label: threshold 1.0 labels each group [1, 0, 0, 0]
    (accuracy 0.25), dropped by filter_lower=0.3 though the mean reward (0.65) lies in [0.3, 0.8]."""
    rec = Recorder()
    tr = _prime(
        PrimeRLOOTrainer, tiny_model_path, tmp_path, [verifier_a, verifier_b], rec=rec, max_steps=1,
        reward_weights=[0.7, 0.6], prm_label="threshold", prm_label_threshold=1.0, filter_lower=0.3,
    )  # fmt: skip
    tr.train()
    assert not bool(rec.rounds[0]["kept_mask"].any())
    assert not rec.prm_steps  # nothing kept: no PRM step


def test_rows_without_policy_tokens_get_no_label(tiny_model_path, tmp_path):
    """A row whose action mask is empty (e.g. TRL's mask_truncated_completions) gets label NaN among the PRM labels, the
    one tensor the PRM loss, the prompt filter's accuracy and the PRM metrics read: with labels [1, 0, 1, 0] and the
    third row empty, the group's accuracy is mean(1, 0, 0) = 1/3, not 1/2."""
    from types import SimpleNamespace

    tr = _prime(PrimeRLOOTrainer, tiny_model_path, tmp_path, verifier_a, max_steps=1)
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0])
    actions = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1]])
    r = SimpleNamespace(outcome=outcome, scorable=~outcome.isnan(), actions=actions, num_generations=K)
    labels = tr._prm_labels(r)
    torch.testing.assert_close(labels, torch.tensor([1.0, 0.0, float("nan"), 0.0]), equal_nan=True)
    kept = F.prompt_accuracy_mask(outcome_rewards=labels, num_generations=K, lower=0.4, upper=1.0)
    assert not bool(kept.any())  # accuracy 1/3 < 0.4 (the unblanked labels' 1/2 would pass)


def test_prm_label_config_validation(tmp_path):
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    for cls in (PrimeRLOOConfig, PrimeGRPOConfig):
        d = cls(**plain)
        assert (d.prm_label, d.prm_label_threshold, d.prm_label_temperature) == ("identity", 0.5, 1.0)
        with pytest.raises(ValueError, match=r"prm_label='rank' is not supported; choose one of 'identity'"):
            cls(**plain, prm_label="rank")
        for t in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="prm_label_temperature"):
                cls(**plain, prm_label="sigmoid", prm_label_temperature=t)
        with pytest.raises(ValueError, match="prm_label_threshold"):
            cls(**plain, prm_label_threshold=float("inf"))
        assert d.prm_label_min_spread == 1e-3 and d.prime_value_scale == "logit"
        for v in (-1e-3, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"`prm_label_min_spread`=.* must be a finite number >= 0"):
                cls(**plain, prm_label="group_rank", prm_label_min_spread=v)
        assert cls(**plain, prm_label="group_rank", prm_label_min_spread=0.0).prm_label_min_spread == 0.0


# ----------------------------------------------------------------------------------------------------------------
# TRL's scale_rewards="batch"
# ----------------------------------------------------------------------------------------------------------------
def graded_reward(completions, **kwargs):
    """Per group of 4: [1, 0.5, 0, 0] and [1, 1, 0.25, 0] alternately (non-uniform, in [0, 1])."""
    table = ([1.0, 0.5, 0.0, 0.0], [1.0, 1.0, 0.25, 0.0])
    return [table[(i // K) % 2][i % K] for i in range(len(completions))]


def _batch_scaled_outcome(o, eps):
    """Hand computation of TRL's scale_rewards="batch": (o - group mean) / (unbiased std over the batch + eps)."""
    o = o.double()
    mean_g = o.view(-1, K).mean(1).repeat_interleave(K)
    return (o - mean_g) / (o.std() + eps)


def test_prime_grpo_scale_rewards_batch_outcome_term(tiny_model_path, tmp_path):
    rec = Recorder()
    tr = _prime(
        PrimeGRPOTrainer, tiny_model_path, tmp_path, graded_reward, rec=rec, scale_rewards="batch",
        process_coef=0.0, filter_lower=0.0, filter_upper=1.0,
    )  # fmt: skip
    tr.train()
    for ev in rec.rounds:
        want = _batch_scaled_outcome(ev["outcome_rewards"], 1e-6)
        mask = ev["completion_mask"].bool()
        # gamma 1: the outcome term at the last token reaches every earlier token of the completion
        got = ev["advantages"].double()
        expected = want[:, None].expand_as(got)
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)
    group = _batch_scaled_outcome(torch.tensor(graded_reward([None] * 8)), 1e-6)
    assert not torch.allclose(
        group, F.grpo_advantages(torch.tensor(graded_reward([None] * 8)), num_generations=K).double()
    )


def test_prl_scale_rewards_batch_outcome_term(tiny_model_path, tmp_path):
    tr = PRLGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=graded_reward,
        args=PRLConfig(**_kwargs(tmp_path, scale_rewards="batch", prl_eta=1e12, max_steps=1)),
        train_dataset=tiny_prompt_dataset(8),
    )
    tr.train()
    last = tr._prl_last
    want = _batch_scaled_outcome(last["outcome_rewards"], tr.args.prl_eps)
    mask = last["mask"].bool()
    got = last["advantages"].double()  # rho_t = A - S_t / eta, eta = 1e12: A at every token
    torch.testing.assert_close(got[mask], want[:, None].expand_as(got)[mask], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# PEFT configs without task_type (as TRL's own PEFT tests write them)
# ----------------------------------------------------------------------------------------------------------------
def test_lora_config_without_task_type_trains_policy_and_prm_adapters(tiny_model_path, tmp_path):
    from peft import LoraConfig

    tr = _prime(
        PrimeRLOOTrainer, tiny_model_path, tmp_path, verifier_a, filter_lower=0.0, filter_upper=1.0,
        trainer_kwargs=dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    )  # fmt: skip
    assert tr.implicit_prm.adapter_name == "prm"
    before = {k: v.clone() for k, v in unwrap(tr.model).state_dict().items()}
    tr.train()
    after = unwrap(tr.model).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {k for k in before if ".default." in k and "lora_B" in k} <= changed  # the policy adapter
    assert {k for k in before if ".prm." in k and "lora_B" in k} <= changed  # the PRM's second adapter
    assert not {k for k in changed if "lora_" not in k}  # the base (the PRM's reference) is frozen


def test_lora_config_without_task_type_trains_prl(tiny_model_path, tmp_path):
    from peft import LoraConfig

    tr = PRLGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=verifier_a,
        args=PRLConfig(**_kwargs(tmp_path, max_steps=1, learning_rate=1e-2)),
        train_dataset=tiny_prompt_dataset(8),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    before = {k: v.clone() for k, v in unwrap(tr.model).state_dict().items() if ".default." in k}
    tr.train()
    after = unwrap(tr.model).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_prompt_learning_config_without_task_type_is_refused(tiny_model_path, tmp_path):
    """What truly fails is refused before TRL builds the model: a prompt-learning method has no adapter weights in
    the layers (the PRM adapter and the references are layer-by-layer copies)."""
    from peft import PrefixTuningConfig, PromptTuningConfig

    for cfg in (PromptTuningConfig(num_virtual_tokens=4), PrefixTuningConfig(num_virtual_tokens=4)):
        with pytest.raises(
            ValueError, match=r"`peft_config` is a \w+ adapter .*no adapter weights.*LoRA \(LoraConfig\)"
        ):
            _prime(PrimeRLOOTrainer, tiny_model_path, tmp_path, verifier_a, trainer_kwargs=dict(peft_config=cfg))


# ----------------------------------------------------------------------------------------------------------------
# Kept refusals name the reason and the fix
# ----------------------------------------------------------------------------------------------------------------
def test_kept_refusals_name_the_reason_and_the_fix(tmp_path):
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    for cls in (PrimeGRPOConfig, PRLConfig):
        with pytest.raises(
            ValueError, match=r"'luspo' is sequence-level \(LUSPO sums each completion's token.*Use 'dapo'"
        ):
            cls(**plain, loss_type="luspo", importance_sampling_level="sequence")
        with pytest.raises(ValueError, match=r"'vespo' is sequence-level \(VESPO .*sign.*Use 'dapo'"):
            cls(**plain, loss_type="vespo")
        assert cls(**plain, scale_rewards="batch").scale_rewards == "batch"
    with pytest.raises(ValueError, match=r"normalize_advantages.*per-sequence statistic.*whiten_advantages`=True"):
        PrimeRLOOConfig(**plain, normalize_advantages=True)


def test_scale_rewards_batch_refused_where_no_group_std_exists(tmp_path):
    """'batch' replaces the group std of the GRPO outcome advantage: PRIME's 'rloo' / 'reinforce' estimators and
    PRL's 'process_first' order have none, so 'batch' would be ignored and is refused; 'group' / 'none' pass."""
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    for est in ("rloo", "reinforce"):
        with pytest.raises(ValueError, match=rf"'batch' would be ignored: `prime_estimator`='{est}'.*'group'.*'none'"):
            PrimeGRPOConfig(**plain, prime_estimator=est, scale_rewards="batch")
        for ok in ("group", "none"):
            assert PrimeGRPOConfig(**plain, prime_estimator=est, scale_rewards=ok).scale_rewards == ok
    with pytest.raises(ValueError, match=r"'batch' would be ignored: `prl_order`='process_first'.*advantage_first"):
        PRLConfig(**plain, prl_order="process_first", scale_rewards="batch")
    for ok in ("group", "none"):
        assert PRLConfig(**plain, prl_order="process_first", scale_rewards=ok).scale_rewards == ok
    assert PRLConfig(**plain, prl_order="advantage_first", scale_rewards="batch").scale_rewards == "batch"
    assert PrimeGRPOConfig(**plain, prime_estimator="grpo", scale_rewards="batch").scale_rewards == "batch"


def test_luspo_reason_is_accurate_for_prl(tmp_path):
    """PRL has no prompt filter: the LUSPO refusal gives the length re-weighting as PRL's reason."""
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match=r"LUSPO.*per-completion sum weights a completion by its length once more; in "
                       r"PRIME its mean over all rows"):  # fmt: skip
        PRLConfig(**plain, loss_type="luspo", importance_sampling_level="sequence")


# ----------------------------------------------------------------------------------------------------------------
# Where prm_label silently changes the method (issue 26 item 14): inf in group_rank, the spread floor, the warnings
# ----------------------------------------------------------------------------------------------------------------
NAN = float("nan")
INF = float("inf")


def _same(a, b):
    torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), equal_nan=True, atol=1e-6, rtol=1e-6)


def test_group_rank_inf_reward_is_unscorable_and_spares_its_group():
    """An infinite reward gets no label and stays out of its group's mean and spread: the group's finite rows are
    labelled from the finite rewards alone (before: mean inf, every label of the group NaN)."""
    r = torch.tensor([INF, 1.0, 2.0, 3.0, -INF, 5.0, 1.0, 3.0, INF, -INF, 1.0, 2.0, INF, 2.0, NAN, NAN])
    # group 1: finite [1, 2, 3], mean 2 (2 ties it); group 2: finite [5, 1, 3], mean 3 (3 ties it);
    # group 3: finite [1, 2], mean 1.5; group 4: one finite row, no baseline
    want = [NAN, 0.0, NAN, 1.0, NAN, 1.0, 0.0, NAN, NAN, NAN, 0.0, 1.0, NAN, NAN, NAN, NAN]
    _same(F.prm_labels(r, "group_rank", num_generations=4), want)
    _same(F.prm_labels(r.double(), "group_rank", group_ids=torch.arange(16) // 4), want)
    # the other modes keep their definitions: threshold and sigmoid are well defined at +-inf
    _same(F.prm_labels(torch.tensor([INF, -INF]), "threshold"), [1.0, 0.0])
    _same(F.prm_labels(torch.tensor([INF, -INF]), "sigmoid"), [1.0, 0.0])


def test_group_rank_min_spread_floor():
    """A group whose finite rewards span less than min_spread gets no labels; a spread equal to it is labelled."""
    r = torch.tensor([0.3, 0.3005, 0.3, 0.3, 1.0, 2.0, 1.0, 2.0, 0.0, 0.5, 0.5, 0.0], dtype=torch.float64)
    # spreads: 5e-4, 1, 0.5; means: 0.300125, 1.5, 0.25
    _same(F.prm_labels(r, "group_rank", num_generations=4), [0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0, 1, 1, 0])
    _same(
        F.prm_labels(r, "group_rank", num_generations=4, min_spread=1e-3),
        [NAN] * 4 + [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0],
    )
    _same(F.prm_labels(r, "group_rank", num_generations=4, min_spread=0.5), [NAN] * 4 + [0, 1, 0, 1, 0, 1, 1, 0])
    _same(F.prm_labels(r, "group_rank", num_generations=4, min_spread=0.6), [NAN] * 4 + [0, 1, 0, 1] + [NAN] * 4)
    # the floor reads the finite rewards only: an inf does not widen the spread
    _same(
        F.prm_labels(torch.tensor([INF, 0.3, 0.3005, 0.3]), "group_rank", num_generations=4, min_spread=1e-3),
        [NAN] * 4,
    )
    for bad in (-1.0, NAN, INF):
        with pytest.raises(ValueError, match="min_spread=.* must be a finite number >= 0"):
            F.prm_labels(r, "group_rank", num_generations=4, min_spread=bad)


def test_prm_label_warnings_sigmoid_on_unit_rewards():
    """sigmoid of rewards already in [0, 1]: labels 0.5 (r=0) and 0.731 (r=1), so with K=4 every group's mean label
    lies in [0.5, 0.731] and the default filter [0.2, 0.8] keeps every group: the filter is off."""
    r = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    labels = F.prm_labels(r, "sigmoid")
    _same(labels[[0, 4]], [0.5, 1.0 / (1.0 + math.exp(-1.0))])
    assert bool(F.prompt_accuracy_mask(labels, 4).all())  # all three groups kept, the all-wrong one included
    assert F.prompt_accuracy_mask(F.prm_labels(r, "identity"), 4).tolist() == [False] * 8 + [True] * 4
    w = F.prm_label_warnings(r, "sigmoid")
    assert list(w) == ["sigmoid_unit_rewards"]
    assert "prm_label='sigmoid'" in w["sigmoid_unit_rewards"] and "prm_label='identity'" in w["sigmoid_unit_rewards"]
    assert "this batch: [0, 1]" in w["sigmoid_unit_rewards"]
    assert list(F.prm_label_warnings(torch.tensor([0.2, NAN, 0.9]), "sigmoid")) == ["sigmoid_unit_rewards"]
    assert F.prm_label_warnings(torch.tensor([0.2, 1.5]), "sigmoid") == {}  # a logit: nothing to say
    assert F.prm_label_warnings(torch.tensor([-0.1, 0.5]), "sigmoid") == {}
    assert F.prm_label_warnings(torch.tensor([NAN, NAN]), "sigmoid") == {}
    assert F.prm_label_warnings(r, "identity") == {}


def test_prm_label_warnings_threshold_one_class():
    r = torch.tensor([0.1, 0.3, 0.2, 0.4])
    w = F.prm_label_warnings(r, "threshold", threshold=0.5)
    assert list(w) == ["threshold_one_class"]
    msg = w["threshold_one_class"]
    assert "every scorable row of this batch 0 (every reward below it)" in msg and "prm_label_threshold=0.5" in msg
    assert "[0.1, 0.4]" in msg
    assert "1 (every reward >= it)" in F.prm_label_warnings(r, "threshold", threshold=0.1)["threshold_one_class"]
    assert F.prm_label_warnings(r, "threshold", threshold=0.25) == {}  # two classes
    assert F.prm_label_warnings(torch.tensor([0.3] * 4), "threshold", threshold=0.5) == {}  # the rewards agree too
    assert F.prm_label_warnings(torch.tensor([0.3, NAN]), "threshold", threshold=0.5) == {}  # one scorable row
    assert F.prm_label_warnings(r, "threshold", threshold=0.5)  # NaN rows do not count as a class
    assert list(F.prm_label_warnings(torch.tensor([0.1, NAN, 0.3]), "threshold", threshold=0.5)) == [
        "threshold_one_class"
    ]


def test_prm_label_warnings_group_rank_low_spread():
    r = torch.tensor([0.3, 0.3005, 0.3, 0.3, 1.0, 2.0, 1.0, 2.0, 0.5, 0.5, 0.5, 0.5])
    w = F.prm_label_warnings(r, "group_rank", num_generations=4, min_spread=1e-3)
    assert list(w) == ["group_rank_low_spread"]
    msg = w["group_rank_low_spread"]
    assert "1 of 3 groups" in msg and "prm_label_min_spread=0.001" in msg and "smallest spread 0.0005" in msg
    assert F.prm_label_warnings(r, "group_rank", num_generations=4, min_spread=0.0) == {}
    assert F.prm_label_warnings(r, "group_rank", num_generations=4, min_spread=1e-4) == {}
    # an all-equal group (spread 0) and a lone finite row are no-label cases already: not counted
    assert (
        F.prm_label_warnings(
            torch.tensor([0.5] * 4 + [INF, 0.2, NAN, NAN]), "group_rank", num_generations=4, min_spread=1.0
        )
        == {}
    )
    with pytest.raises(ValueError, match="needs `num_generations`"):
        F.prm_label_warnings(r, "group_rank", min_spread=1e-3)


def test_implicit_prm_values_prob_scale():
    """scale='prob': sigmoid of the prefix sum before each token, 0.5 at the first token; 0 outside the mask."""
    pr = torch.tensor([[0.5, -0.2, 1.0, 9.0], [2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    _same(F.implicit_prm_values(pr, mask), [[0.0, 0.5, 0.3, 0.0], [0.0, 2.0, 0.0, 0.0]])
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    _same(F.implicit_prm_values(pr, mask, scale="prob"), [[0.5, sig(0.5), sig(0.3), 0.0], [0.5, sig(2.0), 0.0, 0.0]])
    assert F.IMPLICIT_VALUE_SCALES == ("logit", "prob")
    with pytest.raises(ValueError, match="scale='probability' is not supported"):
        F.implicit_prm_values(pr, mask, scale="probability")


def test_prime_value_scale_config(tmp_path):
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    ok = PrimeRLOOConfig(**plain, prime_estimator="ppo", prime_value="implicit_prm", prime_value_scale="prob")
    assert ok.prime_value_scale == "prob"
    with pytest.raises(ValueError, match=r"`prime_value_scale`='prob' only acts with prime_estimator='ppo'"):
        PrimeRLOOConfig(**plain, prime_value_scale="prob")
    with pytest.raises(ValueError, match=r"`prime_value_scale`='prob' scales the implicit PRM's prefix value"):
        PrimeGRPOConfig(**plain, prime_estimator="ppo", prime_value_scale="prob")
    with pytest.raises(ValueError, match=r"prime_value_scale='odds' is not supported"):
        PrimeRLOOConfig(**plain, prime_estimator="ppo", prime_value="implicit_prm", prime_value_scale="odds")


def _length_reward(scale: float, offset: float = 0.0):
    def reward(completions, **kwargs):
        return [offset + scale * len(str(c)) for c in completions]

    return reward


def _label_warnings(rec_warnings, head: str) -> list[str]:
    return [str(w.message) for w in rec_warnings if issubclass(w.category, UserWarning) and head in str(w.message)]


@pytest.mark.parametrize(
    "options, reward, head",
    [
        (dict(prm_label="sigmoid"), "verifier", "prm_label='sigmoid' on outcome rewards already in [0, 1]"),
        (dict(prm_label="threshold", prm_label_threshold=1e6), "length", "prm_label='threshold' labelled every"),
        (dict(prm_label="group_rank"), "tiny_length", "prm_label='group_rank': "),
    ],
    ids=["sigmoid", "threshold", "group_rank"],
)
def test_trainer_warns_once_per_run(tiny_model_path, tmp_path, options, reward, head):
    """Each silent change of the method warns once over a 2-step run, naming the field; group_rank's low-spread
    groups (rewards 0.3 + 1e-6 * length: spreads far below the default floor 1e-3) train the PRM on no label."""
    import warnings

    rewards = {
        "verifier": verifier_a,
        "length": _length_reward(1.0),
        "tiny_length": _length_reward(1e-6, offset=0.3),
    }
    rec = Recorder()
    tr = _prime(PrimeRLOOTrainer, tiny_model_path, tmp_path, rewards[reward], rec=rec, max_steps=2, **options,
                filter_lower=0.0, filter_upper=1.0)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    assert len(rec.rounds) == 2
    assert len(_label_warnings(caught, head)) == 1
    if reward == "tiny_length":
        labels = [
            F.prm_labels(ev["outcome_rewards"], "group_rank", num_generations=K, min_spread=1e-3) for ev in rec.rounds
        ]
        assert all(bool(torch.isnan(lab).all()) for lab in labels)
        assert not rec.prm_steps  # no label anywhere: no PRM step
        groups = torch.cat([ev["outcome_rewards"].view(-1, K) for ev in rec.rounds])
        spreads = groups.amax(1) - groups.amin(1)
        assert 0 < spreads.max().item() < 1e-3
