"""Compatibility suite: every trl-prime trainer with the TRL 1.16 features a user carries over from TRL.

Each case trains a tiny offline model for one or two optimizer steps (single process, CPU) with one TRL feature
switched on, in :class:`~trl_prime.PrimeRLOOTrainer`, :class:`~trl_prime.PrimeGRPOTrainer`,
:class:`~trl_prime.PRLGRPOTrainer` and :class:`~trl_prime.ProfGRPOTrainer`, and checks through one helper
(:func:`_train_and_check`) that

- it trains: ``global_step`` reached ``max_steps``;
- TRL's metrics (``reward``, ``completions/mean_length``, ``loss``, ``entropy``, ...) and the method's own (``prm/*``,
  ``prl/*``, ``prof/*``) are logged, and no logged number is NaN or infinite;
- PRIME's own numbers stay right: the token rewards of step 1 are exactly 0 (the PRM starts equal to its reference,
  PRIME Eq. 3) and the implicit PRM's trainable weights moved.

A feature a trl-prime config refuses on purpose is checked for the refusal instead: the ``ValueError`` names the
reason. Strict ``xfail`` cases record known gaps (the reason says which). TRL 1.16's ``RLOOConfig`` has no
``loss_type``, ``importance_sampling_level`` or ``tools``: those cases
run on the three GRPO-based trainers only.

Models: the tiny Qwen2 of ``tests/tiny.py``; a tiny LLaVA (vision-language), a tiny Qwen2-MoE (router auxiliary
loss), the tiny Qwen2 with TRL's Qwen3 chat template (tool calling), and a tiny sequence-classification reward
model, all built from configs here (no Hub).
"""

from __future__ import annotations

import asyncio
import math
import re

import pytest
import torch
from helpers import tiny_kwargs, trainer_kinds
from tiny import (
    build_tokenizer,
    contains_reward,
    save_tiny_model,
    tiny_config_kwargs,
    tiny_prompt_dataset,
    tiny_qwen2_config,
)
from tiny_prm import build_tiny_step_prm

from trl_prime import PRLConfig, PRLGRPOTrainer
from trl_prime.callbacks import PrimeCallback


K = 4  # completions per prompt; 8 rows per generation batch = 2 prompt groups

#: the trainer and config classes by kind ("prime-rloo", "prime-grpo", "prl", "prof")
KINDS = {kind.replace("_", "-"): classes for kind, classes in trainer_kinds().items()}
ALL = list(KINDS)
PRIME = ["prime-rloo", "prime-grpo"]
GRPO_BASED = ["prime-grpo", "prl", "prof"]  # on TRL's GRPOTrainer (loss_type, importance_sampling_level, tools)

#: TRL metrics every run logs (TRL's RLOO and GRPO generation step and loss)
TRL_METRICS = ("loss", "reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "entropy")
#: each method's own metrics
METHOD_METRICS = {
    "prime-rloo": ("prm/loss", "prm/token_reward_mean", "prm/pair_accuracy", "filter/kept_fraction"),
    "prime-grpo": ("prm/loss", "prm/token_reward_mean", "prm/pair_accuracy", "filter/kept_fraction"),
    "prl": ("prl/kl_to_go_mean", "prl/sign_flip_fraction", "prl/steps_per_completion"),
    "prof": ("prof/kept_fraction", "prof/consistency_kept_mean", "prof/num_steps_mean"),
}
#: metrics that are NaN by definition in some batches, not by a fault: PROF's fraction of correct rows dropped (no
#: correct row in the batch), TRL's min/max clip ratios and terminated lengths (no row clipped / none terminated)
NAN_BY_DEFINITION = (
    "prof/dropped_correct_fraction",
    "prof/consistency_dropped_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


# ----------------------------------------------------------------------------------------------------------------
# Fixtures and the shared helper
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def step_prm_path(tmp_path_factory):
    """PROF's external step PRM (a tiny token-classification model, see ``tests/tiny_prm.py``)."""
    return build_tiny_step_prm(tmp_path_factory.mktemp("compat_step_prm"))


class ScoredRounds(PrimeCallback):
    """Keeps every ``on_rollouts_scored`` payload (PRIME trainers)."""

    def __init__(self):
        self.rounds = []

    def on_rollouts_scored(self, args, state, control, **kw):
        self.rounds.append(kw)


def _config(kind, tmp_path, step_prm_path=None, **overrides):
    """The config of ``kind``: tiny, 1 step, CPU, every group kept by PRIME's filter (so the PRM trains)."""
    kw = tiny_kwargs(tmp_path, max_completion_length=10)
    if kind in PRIME:
        kw.update(prm_learning_rate=1e-2, filter_lower=0.0, filter_upper=1.0)
    elif kind == "prl":
        kw.update(prl_step_len=3, prl_eta=5.0)
    elif kind == "prof":
        kw.update(prof_prm=step_prm_path, prof_num_keep=2)
    kw.update(overrides)
    return KINDS[kind][1](**kw)


def _build(kind, model, tmp_path, step_prm_path=None, *, reward_funcs=None, train_dataset=None, callbacks=(), **kw):
    """A trainer of ``kind``; ``kw`` splits into trainer keyword arguments (TRL's) and config overrides."""
    trainer_keys = ("eval_dataset", "peft_config", "tools", "reward_processing_classes", "processing_class")
    trainer_kw = {k: kw.pop(k) for k in trainer_keys if k in kw}
    args = _config(kind, tmp_path, step_prm_path, **kw)
    return KINDS[kind][0](
        model=model,
        reward_funcs=reward_funcs if reward_funcs is not None else contains_reward("e"),
        args=args,
        train_dataset=train_dataset if train_dataset is not None else tiny_prompt_dataset(8),
        callbacks=[*callbacks],
        **trainer_kw,
    )


def _prm_weights(trainer) -> list[torch.Tensor]:
    """Copies of the implicit PRM's trainable weights (the ``"prm"`` adapter under PEFT)."""
    return [p.detach().clone() for p in trainer.implicit_prm.trainable_parameters()]


def _logged(trainer) -> dict[str, list]:
    """Every logged value by name, over the log entries of training (the final summary left out)."""
    out: dict[str, list] = {}
    for entry in trainer.state.log_history:
        if "train_runtime" in entry:
            continue
        for k, v in entry.items():
            out.setdefault(k, []).append(v)
    return out


def _check(kind, trainer, rounds: ScoredRounds | None, prm_before, *, max_steps, metrics=()):
    """The invariants of every compatibility case (see the module docstring)."""
    assert trainer.state.global_step == max_steps
    logs = _logged(trainer)
    missing = [m for m in (*TRL_METRICS, *METHOD_METRICS[kind], *metrics) if m not in logs]
    assert not missing, f"not logged: {missing} (logged: {sorted(logs)})"
    bad = {
        k: v
        for k, values in logs.items()
        if k.removeprefix("eval_") not in NAN_BY_DEFINITION
        for v in values
        if isinstance(v, float) and not math.isfinite(v)
    }
    assert not bad, f"non-finite logged values: {bad}"
    if kind in PRIME:
        train_rounds = [r for r in rounds.rounds if r["mode"] == "train"]
        first = train_rounds[0]
        assert first["step"] == 1
        mask = first["completion_mask"].bool()
        assert mask.any()
        rewards = first["token_rewards"][mask]
        assert torch.equal(rewards, torch.zeros_like(rewards)), "step-1 token rewards must be exactly 0 (Eq. 3)"
        after = trainer.implicit_prm.trainable_parameters()
        assert len(after) == len(prm_before) > 0
        assert any(not torch.equal(b, a.detach()) for b, a in zip(prm_before, after)), "the PRM did not train"
        assert all(torch.isfinite(a).all() for a in after)
    return logs


def _train_and_check(kind, model, tmp_path, step_prm_path=None, *, metrics=(), before_train=None, **kw):
    """Build, train and check a trainer of ``kind``; returns ``(trainer, logs)``."""
    rounds = ScoredRounds() if kind in PRIME else None
    callbacks = [*([rounds] if rounds else []), *kw.pop("callbacks", ())]
    trainer = _build(kind, model, tmp_path, step_prm_path, callbacks=callbacks, **kw)
    if before_train is not None:
        before_train(trainer)
    prm_before = _prm_weights(trainer) if kind in PRIME else None
    trainer.train()
    logs = _check(kind, trainer, rounds, prm_before, max_steps=trainer.args.max_steps, metrics=metrics)
    return trainer, logs


def _on_tiny_model(fn, tiny_model_path, step_prm_path, tmp_path):
    """``call(kind, **kw)``: ``fn(kind, model, tmp_path, step_prm_path, **kw)`` on the tiny Qwen2 model (``model=``
    overrides it)."""

    def call(kind, **kw):
        model = kw.pop("model", tiny_model_path)
        return fn(kind, model, tmp_path, step_prm_path, **kw)

    return call


@pytest.fixture
def run(tiny_model_path, step_prm_path, tmp_path):
    """``run(kind, **kw)``: :func:`_train_and_check` on the tiny Qwen2 model (``model=`` overrides it)."""
    return _on_tiny_model(_train_and_check, tiny_model_path, step_prm_path, tmp_path)


@pytest.fixture
def build(tiny_model_path, step_prm_path, tmp_path):
    """``build(kind, **kw)``: the trainer only (for refusals raised at construction or in training)."""
    return _on_tiny_model(_build, tiny_model_path, step_prm_path, tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    """A tiny ``Qwen2ForSequenceClassification`` reward model (1 label) whose scores lie far outside [0, 1]."""
    from transformers import AutoModelForSequenceClassification

    path = tmp_path_factory.mktemp("compat_reward_model")
    tok = build_tokenizer()
    cfg = tiny_qwen2_config(tok, small=True, num_labels=1)
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():
        model.score.weight.mul_(200.0)  # scores of order 10-100: a reward model's logits, not a [0, 1] label
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["prl", "prof"])
def test_reward_model_as_reward_function(run, reward_model_path, kind):
    """A sequence-classification reward model (a path in ``reward_funcs``, TRL loads it) next to a verifier."""
    tr, logs = run(kind, reward_funcs=[reward_model_path, contains_reward("e")], reward_weights=[0.1, 1.0])
    assert any(k.startswith("rewards/") and "contains_e" not in k for k in logs)
    assert len(tr.reward_funcs) == 2 and isinstance(tr.reward_funcs[0], torch.nn.Module)


@pytest.mark.parametrize("kind", PRIME)
def test_reward_model_refused_as_prime_label(build, reward_model_path, kind):
    """PRIME's PRM is trained on the outcome as a label in [0, 1] (PRIME Algorithm 1 line 8): with the default
    ``prm_label="identity"`` a reward model's unbounded scores are refused, naming the range."""
    tr = build(kind, reward_funcs=reward_model_path)
    with pytest.raises(ValueError, match=r"labels in \[0, 1\]"):
        tr.train()


@pytest.mark.parametrize("kind", PRIME)
def test_reward_model_with_sigmoid_prm_label(run, reward_model_path, kind):
    """``prm_label="sigmoid"`` maps a reward model's score to a label in (0, 1): PRIME trains on it."""
    run(kind, reward_funcs=reward_model_path, prm_label="sigmoid", prm_label_temperature=10.0)


@pytest.mark.parametrize("label", ["threshold", "group_rank"])
def test_reward_model_with_other_prm_labels(run, reward_model_path, label):
    run("prime-grpo", reward_funcs=reward_model_path, prm_label=label, prm_label_threshold=0.0)


@pytest.mark.parametrize("kind", ALL)
def test_several_weighted_reward_functions(run, kind):
    tr, logs = run(kind, reward_funcs=[contains_reward("e"), contains_reward("a")], reward_weights=[0.25, 0.75])
    assert "rewards/contains_e/mean" in logs and "rewards/contains_a/mean" in logs
    assert tr.reward_weights.tolist() == [0.25, 0.75]


async def async_contains_e(completions, **kwargs):
    """An async reward function (TRL runs it on its event-loop thread)."""
    await asyncio.sleep(0)
    return contains_reward("e")(completions)


@pytest.mark.parametrize("kind", ALL)
def test_async_reward_function(run, kind):
    tr, logs = run(kind, reward_funcs=[async_contains_e, contains_reward("a")], reward_weights=[0.5, 0.5])
    assert "rewards/async_contains_e/mean" in logs


def none_for_second_completion(completions, **kwargs):
    """Unscorable (``None``) for the second completion of every group, else contains "e"."""
    scores = contains_reward("e")(completions)
    return [None if i % K == 1 else s for i, s in enumerate(scores)]


@pytest.mark.parametrize("kind", ALL)
def test_none_rewards(run, kind):
    """Rows every reward function left unscored (``None``): excluded, the rest trains, nothing turns NaN."""
    tr, _ = run(kind, reward_funcs=none_for_second_completion)
    if kind in PRIME:  # unscorable rows: outcome NaN, loss weight 0
        (scored,) = [cb for cb in tr.callback_handler.callbacks if isinstance(cb, ScoredRounds)]
        first = scored.rounds[0]
        unscorable = torch.arange(8) % K == 1
        assert torch.equal(torch.isnan(first["outcome_rewards"]).cpu(), unscorable)
        assert first["loss_mask"][unscorable].sum() == 0 and first["loss_mask"][~unscorable].sum() > 0


@pytest.mark.parametrize("kind", ALL)
def test_extra_dataset_columns_reach_the_reward(run, kind):
    """Dataset columns besides ``prompt`` (``solution``, and a custom ``difficulty``) reach the reward function, row
    by row with their prompt."""
    seen = []

    def gold_reward(completions, prompts, solution, difficulty, **kwargs):
        seen.extend(zip(prompts, solution, difficulty))
        return [float(s in (c[-1]["content"] if isinstance(c, list) else c)) for c, s in zip(completions, solution)]

    ds = tiny_prompt_dataset(8)
    ds = ds.add_column("difficulty", [i % 3 for i in range(len(ds))])
    run(kind, reward_funcs=[gold_reward, contains_reward("e")], train_dataset=ds)
    assert len(seen) == 8
    for prompt, solution, difficulty in seen:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", prompt).groups())
        assert solution == str(a + b) and difficulty == a % 3


# ----------------------------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------------------------
#: evaluation after every training step, 8 rows per eval batch
EVAL_EVERY_STEP = dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)


@pytest.mark.parametrize("kind", ALL)
def test_eval_dataset(run, kind):
    """Evaluation during training (eval_strategy="steps"): TRL's eval metrics, and PRIME's eval token rewards."""
    tr, logs = run(kind, eval_dataset=tiny_prompt_dataset(2), **EVAL_EVERY_STEP)
    assert "eval_reward" in logs and "eval_loss" in logs
    finite = ["eval_reward", "eval_loss"] + (["eval_prm/token_reward_mean"] if kind in PRIME else [])
    for k in finite:
        assert k in logs and all(math.isfinite(v) for v in logs[k]), k


@pytest.mark.parametrize("kind", ALL)
def test_num_generations_eval(run, kind):
    """``num_generations_eval`` (passed to TRL): 4 eval prompts with 2 completions each, 4 per training prompt."""
    tr, logs = run(kind, eval_dataset=tiny_prompt_dataset(4), num_generations_eval=2, **EVAL_EVERY_STEP)
    assert tr.num_generations_eval == 2
    assert "eval_reward" in logs and all(math.isfinite(v) for v in logs["eval_reward"])


@pytest.mark.parametrize("kind", ALL)
def test_iterable_dataset(run, kind):
    run(kind, train_dataset=tiny_prompt_dataset(8).to_iterable_dataset(), max_steps=2)


# ----------------------------------------------------------------------------------------------------------------
# KL, reference sync, multi-step
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ALL)
def test_beta_kl_penalty(run, kind):
    tr, logs = run(kind, beta=0.04, metrics=("kl",))
    assert tr.ref_model is not None


@pytest.mark.parametrize("kind", ALL)
def test_sync_ref_model(run, kind):
    """TR-DPO reference sync (TRL's ``SyncRefModelCallback``): TRL's reference moves each step; PRIME's implicit PRM
    keeps a frozen reference of its own (not TRL's moving one)."""
    state = {}

    def snapshot(tr):
        state["trl_ref"] = {k: v.clone() for k, v in tr.ref_model.state_dict().items()}
        if kind in PRIME:
            assert tr.implicit_prm.ref_model is not tr.ref_model
            state["prm_ref"] = {k: v.clone() for k, v in tr.implicit_prm.ref_model.state_dict().items()}

    tr, _ = run(
        kind,
        beta=0.04,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5,
        max_steps=2,
        before_train=snapshot,
    )
    after = tr.ref_model.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in state["trl_ref"].items()), "TRL's reference did not sync"
    if kind in PRIME:
        prm_ref = tr.implicit_prm.ref_model.state_dict()
        assert all(torch.equal(v, prm_ref[k]) for k, v in state["prm_ref"].items())


@pytest.mark.parametrize("kind", ALL)
def test_num_iterations(run, kind):
    """Two PPO epochs per generation round (TRL's ``num_iterations``): the second reuses the buffered round."""
    tr, logs = run(kind, num_iterations=2, max_steps=2, metrics=("clip_ratio/region_mean",))
    if kind in PRIME:
        assert tr.prm_optim.num_updates == 1  # one generation round, one PRM update


@pytest.mark.parametrize("kind", ALL)
def test_steps_per_generation(run, kind):
    """One generation round of 8 rows feeds two optimizer steps of 4 rows (TRL's ``steps_per_generation``)."""
    tr, _ = run(kind, steps_per_generation=2, per_device_train_batch_size=4, max_steps=2)
    if kind in PRIME:
        assert tr.prm_optim.num_updates == 1


@pytest.mark.parametrize("kind", GRPO_BASED)
def test_sequence_importance_sampling(run, kind):
    """GSPO's sequence-level importance ratio (``importance_sampling_level="sequence"``) with two PPO epochs."""
    run(
        kind,
        importance_sampling_level="sequence",
        loss_type="grpo" if kind != "prof" else "dapo",
        num_iterations=2,
        max_steps=2,
    )


@pytest.mark.parametrize("kind", GRPO_BASED)
def test_off_policy_mask_threshold(run, kind):
    """TRL's off-policy sequence mask (``off_policy_mask_threshold``) with two PPO epochs."""
    tr, _ = run(kind, off_policy_mask_threshold=0.5, num_iterations=2, max_steps=2)
    assert tr.off_policy_mask_threshold == 0.5


@pytest.mark.parametrize("kind", ["prime-grpo", "prl"])  # PROF refuses "sapo"
def test_sapo_temperatures(run, kind):
    """SAPO's soft gate with its own temperatures (``sapo_temperature_pos`` / ``sapo_temperature_neg``)."""
    tr, _ = run(kind, loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    assert (tr.args.sapo_temperature_pos, tr.args.sapo_temperature_neg) == (0.5, 2.0)


@pytest.mark.parametrize("kind", GRPO_BASED)
def test_cast_lm_head_to_fp32(run, kind):
    """``cast_lm_head_to_fp32`` (GRPO only): TRL casts the policy's head to float32 (already float32 on CPU)."""
    tr, _ = run(kind, cast_lm_head_to_fp32=True)
    assert tr.model.get_output_embeddings().weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ALL)
def test_pad_to_multiple_of(run, kind):
    """``pad_to_multiple_of``: TRL pads the prompts to a multiple of 16 tokens."""
    loss_inputs = []
    run(kind, pad_to_multiple_of=16, before_train=_spy_loss_inputs(loss_inputs))
    assert loss_inputs[0]["prompt_ids"].shape[1] % 16 == 0


@pytest.mark.parametrize("kind", ALL)
def test_log_completions(run, kind):
    """``log_completions``: TRL's completions table gets every row with a finite advantage."""
    tr, _ = run(kind, log_completions=True, num_completions_to_print=2)
    assert len(tr._logs["prompt"]) == 8 and len(tr._logs["advantages"]) == 8
    assert all(math.isfinite(a) for a in tr._logs["advantages"])


class PrmSteps(PrimeCallback):
    """Keeps every ``on_prm_step`` payload (PRIME trainers)."""

    def __init__(self):
        self.steps = []

    def on_prm_step(self, args, state, control, **kw):
        self.steps.append(kw)


def _spy_loss_inputs(seen: list):
    """A ``before_train`` hook keeping the inputs of every ``_compute_loss`` call."""

    def spy(tr):
        compute_loss = tr._compute_loss

        def wrapped(model, inputs):
            seen.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return compute_loss(model, inputs)

        tr._compute_loss = wrapped

    return spy


@pytest.mark.parametrize("kind", ALL)
def test_mask_truncated_completions(run, kind):
    """Truncated completions out of the loss (DAPO) and, for PRIME, out of the PRM's labels. An EOS bias at
    generation lets some completions end within ``max_completion_length``; the others are truncated."""
    eos = build_tokenizer().eos_token_id
    prm_steps, rounds, loss_inputs = PrmSteps(), ScoredRounds(), []
    tr, logs = run(
        kind,
        mask_truncated_completions=True,
        max_completion_length=12,
        generation_kwargs={"sequence_bias": {(eos,): 3.0}},
        callbacks=[prm_steps, rounds] if kind in PRIME else [],
        before_train=_spy_loss_inputs(loss_inputs),
    )
    assert 0.0 < logs["completions/clipped_ratio"][0] < 1.0
    # the loss: every truncated row (no EOS in its completion) has completion_mask 0, the others keep tokens
    inputs = loss_inputs[0]
    truncated = ~(inputs["completion_ids"] == eos).any(dim=1)
    assert truncated.any() and (~truncated).any()
    assert inputs["completion_mask"][truncated].sum() == 0
    assert (inputs["completion_mask"][~truncated].sum(dim=1) > 0).all()
    if kind in PRIME:  # the PRM: no label (NaN, weight 0) and no policy loss for the truncated rows of the round
        first = rounds.rounds[0]
        cut = ~(first["completion_ids"] == eos).any(dim=1).cpu()
        labels, weights = prm_steps.steps[0]["labels"].cpu(), prm_steps.steps[0]["row_weights"].cpu()
        assert cut.any() and labels[cut].isnan().all() and (weights[cut] == 0).all()
        assert not labels[~cut].isnan().any() and (weights[~cut] > 0).all()
        assert first["loss_mask"][cut].sum() == 0


@pytest.mark.parametrize("kind", ALL)
def test_gradient_accumulation(run, kind):
    """A generation round of 8 rows over two accumulated micro-batches of 4 (one optimizer step)."""
    tr, _ = run(kind, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    if kind in PRIME:
        assert tr.prm_optim.num_updates == 1


@pytest.mark.parametrize("kind", GRPO_BASED)
def test_grpo_loss_options(run, kind):
    """TRL GRPO's loss options carried over: DAPO's clip-higher, two-sided clipping (``delta``), the high-entropy
    token selection, an entropy bonus and the KL with its bias correction, over two PPO epochs."""
    run(
        kind,
        epsilon_high=0.28,
        delta=2.0,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
        beta=0.04,
        use_bias_correction_kl=True,
        num_iterations=2,
        max_steps=2,
        metrics=("kl", "entropy_coef"),
    )


def test_rloo_reward_clip_range(run):
    """TRL RLOO's ``reward_clip_range`` bounds the outcome before PRIME uses it as the PRM's label."""
    tr, logs = run(
        "prime-rloo", reward_funcs=[contains_reward("e"), contains_reward("a")], reward_clip_range=(0.0, 1.0)
    )
    assert tr.reward_clip_range == (0.0, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# loss_type
# ----------------------------------------------------------------------------------------------------------------
LOSS_TYPES = ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
#: loss types each GRPO-based config refuses, and why (the refusal message names it)
REFUSED_LOSS_TYPES = {
    "prime-grpo": {"luspo": "sequence-level", "vespo": "sequence-level"},
    "prl": {"luspo": "sequence-level", "vespo": "sequence-level"},
    "prof": {t: "does not normalise by the kept tokens" for t in LOSS_TYPES if t not in ("dapo", "cispo")},
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kind", GRPO_BASED)
def test_loss_type(run, tmp_path, step_prm_path, kind, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    why = REFUSED_LOSS_TYPES[kind].get(loss_type)
    if why is not None:
        with pytest.raises(ValueError, match=rf"`loss_type`='{loss_type}'.*{why}"):
            _config(kind, tmp_path, step_prm_path, loss_type=loss_type, **extra)
        return
    run(kind, loss_type=loss_type, **extra)


@pytest.mark.parametrize("kind", ["prime-grpo", "prl", "prof"])
def test_scale_rewards_batch(run, kind):
    """TRL's scale_rewards="batch": the group-centred outcome divided by the batch std (PROF: of the kept rows)."""
    run(kind, scale_rewards="batch")


@pytest.mark.parametrize("kind", GRPO_BASED)
def test_normalize_then_sum_refused(tmp_path, step_prm_path, kind):
    """TRL's ``multi_objective_aggregation="normalize_then_sum"``: the methods' outcome is the weighted sum."""
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        _config(kind, tmp_path, step_prm_path, multi_objective_aggregation="normalize_then_sum")


def test_rloo_normalize_advantages_refused(tmp_path):
    """TRL RLOO's ``normalize_advantages`` would normalise the outcome-only advantages PRIME replaces."""
    with pytest.raises(ValueError, match="whiten_advantages"):
        _config("prime-rloo", tmp_path, normalize_advantages=True)


# ----------------------------------------------------------------------------------------------------------------
# PEFT
# ----------------------------------------------------------------------------------------------------------------
def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **kw})


@pytest.mark.parametrize("kind", ALL)
def test_peft_config_with_gradient_checkpointing(run, kind):
    tr, _ = run(kind, peft_config=_lora(task_type="CAUSAL_LM"), gradient_checkpointing=True)
    assert tr.args.gradient_checkpointing
    if kind in PRIME:
        assert tr.implicit_prm.adapter_name == "prm"


@pytest.mark.parametrize("kind", ALL)
def test_peft_model_with_gradient_checkpointing(run, tiny_model_path, kind):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), _lora(task_type="CAUSAL_LM"))
    run(kind, model=model, gradient_checkpointing=True)


@pytest.mark.parametrize("kind", ALL)
def test_lora_config_without_task_type(run, kind):
    """``LoraConfig()`` without ``task_type`` is accepted (taken as a causal LM) and its adapter trains: the policy's
    ``"default"`` adapter moves for every trainer (PRIME's ``"prm"`` adapter is checked by :func:`_check`)."""
    before = {}

    def snapshot(tr):
        named = tr.model.named_parameters()
        before.update({n: p.detach().clone() for n, p in named if p.requires_grad and ".default." in n})

    tr, _ = run(kind, peft_config=_lora(), before_train=snapshot)
    after = dict(tr.model.named_parameters())
    assert before and all("lora_" in n for n in before)
    assert any(not torch.equal(b, after[n].detach()) for n, b in before.items()), "the policy adapter did not train"
    if kind in PRIME:
        assert tr.implicit_prm.adapter_name == "prm"
        assert all(".prm." in n for n, _ in tr.model.named_parameters() if "lora_" in n and ".default." not in n)


# ----------------------------------------------------------------------------------------------------------------
# Other model families: a vision-language model, a mixture of experts
# ----------------------------------------------------------------------------------------------------------------
#: a ChatML template rendering ``{"type": "image"}`` parts as LLaVA's ``<image>`` placeholder
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


#: LLaVA's vision tower: one CLIP layer on 28x28 images (4 patches of 14x14, plus CLS)
TINY_CLIP = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    projection_dim=32,
)
#: Qwen2-MoE's experts: 4 of them, top-2, a shared expert, in every layer
TINY_MOE = dict(
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
)


def _tiny_text(tok, **overrides) -> dict:
    """The language model of the tiny VLM and the tiny MoE: tests/tiny.py's sizes, no BOS, untied embeddings."""
    return tiny_config_kwargs(tok, bos_token_id=None, tie_word_embeddings=False, **overrides)


@pytest.fixture(scope="module")
def tiny_vlm_path(tmp_path_factory):
    """A tiny LLaVA (a CLIP vision tower of one layer, a Qwen2 language model of 2 layers) and its processor.

    LLaVA rather than Qwen2-VL: Qwen2-VL's processor needs a video processor, which needs torchvision (not installed
    here); LLaVA's CLIP image processor falls back to PIL."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    cfg = LlavaConfig(
        vision_config=TINY_CLIP,
        text_config=_tiny_text(tok, model_type="qwen2"),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="full",
        image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's CLS token
        chat_template=VLM_CHAT_TEMPLATE,
    )
    torch.manual_seed(0)
    return save_tiny_model(LlavaForConditionalGeneration(cfg), processor, tmp_path_factory.mktemp("compat_tiny_llava"))


def _image_dataset(n=8):
    from datasets import Dataset
    from PIL import Image

    columns = tiny_prompt_dataset(n, conversational=True).to_dict()
    columns["image"] = [Image.new("RGB", (28, 28), color=(30 * i, 100, 200)) for i in range(n)]
    return Dataset.from_dict(columns)


@pytest.mark.parametrize("kind", ALL)
def test_vision_language_model(run, tiny_vlm_path, kind):
    """A tiny LLaVA with an ``image`` column: TRL feeds ``pixel_values`` to generation and to the loss."""
    seen = {}

    def spy(tr):
        compute_loss = tr._compute_loss

        def wrapped(model, inputs):
            seen["pixel_values"] = inputs.get("pixel_values")
            return compute_loss(model, inputs)

        tr._compute_loss = wrapped

    tr, _ = run(kind, model=tiny_vlm_path, train_dataset=_image_dataset(), before_train=spy)
    assert tr._is_vlm
    assert seen["pixel_values"] is not None and seen["pixel_values"].shape[-2:] == (28, 28)


@pytest.mark.parametrize("kind", PRIME)
def test_vision_language_model_prm_sees_the_image(build, tiny_vlm_path, kind):
    """Every forward of the implicit PRM (and of its reference, the same model under PEFT or a copy) gets TRL's
    ``pixel_values``: the token rewards of PRIME Eq. 3 are those of the prompt with its image. Each row gets its own
    image: the reference log-probs of the round equal those of the row scored alone with its ``pixel_values``."""
    from trl_prime.modeling import select_mm_rows

    rounds, loss_inputs = ScoredRounds(), []
    tr = build(kind, model=tiny_vlm_path, train_dataset=_image_dataset(), callbacks=[rounds])
    prm = tr.implicit_prm
    assert prm.ref_model is not None and prm.ref_model is not prm.model  # a separate reference (no PEFT)
    calls = {"prm": [], "ref": []}
    for name, module in (("prm", prm.model), ("ref", prm.ref_model)):
        module.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: calls[name].append(kwargs.get("pixel_values") is not None),
            with_kwargs=True,
        )
    compute_loss = tr._compute_loss

    def spy(model, inputs):
        loss_inputs.append(dict(inputs))
        return compute_loss(model, inputs)

    tr._compute_loss = spy
    tr.train()
    assert calls["prm"] and all(calls["prm"]) and calls["ref"] and all(calls["ref"])
    # TRL's loss inputs hold each row's own pixel_values; find the row in the round (the loss may shuffle rows)
    first, inputs = rounds.rounds[0], loss_inputs[0]
    mm_keys = ("pixel_values", "image_sizes", "image_grid_thw", "num_images")
    mm = {k: inputs[k] for k in mm_keys if inputs.get(k) is not None}
    T = first["completion_ids"].shape[1]
    moved = []  # does another row's image change the log-probs (so the check above can fail)?
    for j in range(inputs["completion_ids"].shape[0]):
        same = (first["completion_ids"] == inputs["completion_ids"][j]).all(1)
        same &= (first["prompt_ids"] == inputs["prompt_ids"][j]).all(1)
        i = int(same.nonzero()[0])
        ids = torch.cat([first["prompt_ids"][i : i + 1], first["completion_ids"][i : i + 1]], dim=1)
        mask = torch.cat([first["prompt_mask"][i : i + 1], first["completion_mask"][i : i + 1]], dim=1)
        alone = prm.ref_logps(ids, mask, T, mm_inputs=select_mm_rows(mm, [j]))[0]
        keep = first["completion_mask"][i].bool()
        torch.testing.assert_close(alone[keep], first["ref_logps"][i][keep].float(), atol=1e-5, rtol=0)
        other = next(k for k in range(len(same)) if not torch.equal(mm["pixel_values"][k], mm["pixel_values"][j]))
        wrong = prm.ref_logps(ids, mask, T, mm_inputs=select_mm_rows(mm, [other]))[0]
        moved.append((wrong[keep] - alone[keep]).abs().max().item() > 1e-4)
    assert all(moved)


def _mm_batches():
    """Multimodal inputs of 4 rows in TRL's layouts: Qwen2-VL patches (``image_grid_thw``, 0-2 images a row), one
    image per row (LLaVA, with ``image_sizes``), row-aligned ``pixel_values``, InternVL tiles (``num_tiles``)."""
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 1, 2], [1, 2, 2]])
    return [
        dict(
            pixel_values=torch.randn(18, 3, generator=g),
            image_grid_thw=grid,
            num_images=[1, 2, 0, 1],
            mm_token_type_ids=torch.randint(0, 2, (4, 6), generator=g),
        ),
        dict(
            pixel_values=torch.randn(4, 3, 2, 2, generator=g),
            num_images=[1, 1, 1, 1],
            image_sizes=torch.tensor([[2, 2]] * 4),
        ),
        dict(
            pixel_values=torch.randn(4, 3, generator=g),
            num_images=[1, 1, 1, 2],  # not one entry per image: TRL slices pixel_values by rows
            token_type_ids=torch.randint(0, 2, (4, 6), generator=g),
        ),
        dict(pixel_values=torch.randn(7, 3, generator=g), num_tiles=[2, 1, 3, 1], num_images=[1, 1, 1, 1]),
    ]


@pytest.mark.parametrize("layout", range(4))
def test_select_mm_rows_slices_like_trl(layout):
    """:func:`trl_prime.modeling.select_mm_rows` gives each micro-batch the multimodal inputs TRL 1.16's
    ``GRPOTrainer._get_per_token_logps_and_entropies`` gives it, and picks arbitrary rows (PRIME's row subsets)."""
    import contextlib
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from trl_prime.modeling import select_mm_rows

    mm = _mm_batches()[layout]
    ids, mask = torch.zeros((4, 6), dtype=torch.long), torch.ones((4, 6), dtype=torch.long)
    seen = []

    def model(**kw):
        seen.append(
            {k: v for k, v in kw.items() if k not in ("input_ids", "attention_mask", "labels", "fused_lm_head")}
        )
        return SimpleNamespace(log_probs=torch.zeros(kw["input_ids"].shape))

    stub = SimpleNamespace(accelerator=SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True))
    GRPOTrainer._get_per_token_logps_and_entropies(stub, model, ids, mask, 2, batch_size=3, **mm)
    for trl_kw, rows in zip(seen, (range(0, 3), range(3, 4)), strict=True):
        ours = {k: v for k, v in select_mm_rows(mm, rows).items() if k not in ("num_images", "num_tiles")}
        assert ours.keys() == trl_kw.keys()
        assert all(torch.equal(ours[k], trl_kw[k]) for k in ours)
    # rows in any order: each row's own inputs, concatenated in that order
    picked, singles = select_mm_rows(mm, torch.tensor([3, 0])), [select_mm_rows(mm, [i]) for i in (3, 0)]
    for k, v in picked.items():
        expected = sum((s[k] for s in singles), []) if isinstance(v, list) else torch.cat([s[k] for s in singles])
        assert (v == expected) if isinstance(v, list) else torch.equal(v, expected)


@pytest.fixture(scope="module")
def tiny_moe_path(tmp_path_factory):
    """A tiny Qwen2-MoE (4 experts, top-2, a shared expert, 2 layers) with a router load-balancing loss.

    ``output_router_logits`` is False in the config: TRL 1.16 enables the auxiliary loss whenever the config has the
    field and ``router_aux_loss_coef`` != 0, and asks for the router logits in its loss forward only. With True in
    the config, ``generate`` computes the load-balancing loss at every decoding step and fails on a left-padded
    batch (transformers 5.24: router logits of the new token against the whole attention mask), in TRL's own
    GRPOTrainer as well."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    tok = build_tokenizer()
    cfg = Qwen2MoeConfig(**_tiny_text(tok, **TINY_MOE, output_router_logits=False, router_aux_loss_coef=0.01))
    torch.manual_seed(0)
    return save_tiny_model(AutoModelForCausalLM.from_config(cfg), tok, tmp_path_factory.mktemp("compat_tiny_moe"))


@pytest.mark.parametrize("kind", ALL)
def test_moe_model_with_aux_loss(run, tiny_moe_path, kind):
    """A tiny MoE: TRL's router load-balancing loss joins the policy loss (``aux_loss`` logged, finite)."""
    tr, logs = run(kind, model=tiny_moe_path, metrics=("aux_loss",))
    assert tr.aux_loss_enabled and tr.router_aux_loss_coef == 0.01
    assert all(v > 0 for v in logs["aux_loss"])


# ----------------------------------------------------------------------------------------------------------------
# Tool calling (TRL's GRPOTrainer `tools=`)
# ----------------------------------------------------------------------------------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


#: a Qwen3-style tool call (TRL's Qwen3 response template parses it)
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tiny_tool_model_path(tmp_path_factory):
    """The tiny Qwen2 model with TRL's Qwen3 chat template (it renders tools, tool calls and tool responses) and a
    context of 2048 positions: the prompt with the tools rendered is 664 tokens, and TRL drops a tool's response that
    would push the sequence past the model's context (512 in tests/tiny.py), so the responses get appended."""
    from pathlib import Path

    import trl
    from tiny import build_tiny_model
    from transformers import AutoConfig, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("compat_tool_model"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    tok.save_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    cfg.max_position_embeddings = 2048  # rotary positions: no weight depends on it
    cfg.save_pretrained(path)
    return path


def _calling_tools(cls):
    """``cls`` whose first generation turn of each round is a call of the ``add`` tool on every other row (a random
    tiny model never writes one); TRL then runs the tool and generates the rest after the tool's response."""

    class CallingTools(cls):
        def _generate(self, prompts):
            self._first_turn = True
            return super()._generate(prompts)

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            if self._first_turn:
                self._first_turn = False
                call = self.processing_class.encode(TOOL_CALL, add_special_tokens=False)
                completion_ids = [call if i % 2 == 0 else ids for i, ids in enumerate(completion_ids)]
            return completion_ids, logprobs

    CallingTools.__name__ = cls.__name__
    return CallingTools


@pytest.mark.slow  # the slowest cases: multi-turn generation of 40+ tokens
@pytest.mark.parametrize("kind", GRPO_BASED)
def test_tool_calling(tiny_tool_model_path, step_prm_path, tmp_path, monkeypatch, kind):
    """``tools=[add]``: half the completions call the tool, TRL appends its response (loss-masked by TRL's
    ``tool_mask``) and generates on; the method trains on the multi-turn completions."""
    monkeypatch.setitem(KINDS, kind, (_calling_tools(KINDS[kind][0]), KINDS[kind][1]))
    tr, logs = _train_and_check(
        kind,
        tiny_tool_model_path,
        tmp_path,
        step_prm_path,
        tools=[add],
        train_dataset=tiny_prompt_dataset(8, conversational=True),
        max_completion_length=40,
        metrics=("tools/call_frequency", "tools/failure_frequency"),
    )
    assert logs["tools/call_frequency"][0] == 0.5 and logs["tools/failure_frequency"][0] == 0.0


@pytest.mark.slow
def test_tool_calling_truncation_guard_agrees_with_trl(tiny_tool_model_path, tmp_path, monkeypatch):
    """The degenerate-batch guard counts a completion as truncated as TRL does (no EOS at the end, TRL's
    ``completions/clipped_ratio``), not by its length (tool responses included)."""
    monkeypatch.setitem(KINDS, "prl", (_calling_tools(PRLGRPOTrainer), PRLConfig))
    tr, logs = _train_and_check(
        "prl",
        tiny_tool_model_path,
        tmp_path,
        tools=[add],
        train_dataset=tiny_prompt_dataset(8, conversational=True),
        max_completion_length=40,
    )
    assert logs["guard/all_truncated"][0] == float(logs["completions/clipped_ratio"][0] == 1.0)


def _recording_tool_mask(cls):
    """``cls`` (calling tools) that keeps TRL's ``tool_mask`` and ``completion_mask`` of each generation round, as
    TRL produced them (before the method's row weights)."""

    class RecordingToolMask(_calling_tools(cls)):
        def _algorithm_step(self, output, rollout):
            self._tool_rounds = [
                *getattr(self, "_tool_rounds", []),
                (output["tool_mask"].clone(), output["completion_mask"].clone()),
            ]
            return super()._algorithm_step(output, rollout)

    RecordingToolMask.__name__ = cls.__name__
    return RecordingToolMask


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["prime-grpo", "prl"])
def test_tool_calling_tool_responses_get_no_token_reward(tiny_tool_model_path, tmp_path, monkeypatch, kind):
    """Tool responses (TRL's ``tool_mask`` 0) are not the policy's actions: PRIME gives them token reward 0 (Eq. 3)
    in step 2, when the PRM has moved, and keeps them out of the sequence reward; PRL's KL-to-go skips them."""
    monkeypatch.setitem(KINDS, kind, (_recording_tool_mask(KINDS[kind][0]), KINDS[kind][1]))
    tr, _ = _train_and_check(
        kind,
        tiny_tool_model_path,
        tmp_path,
        tools=[add],
        train_dataset=tiny_prompt_dataset(8, conversational=True),
        max_completion_length=160,  # room for the tool's response after the call (70 tokens)
        max_steps=2 if kind in PRIME else 1,
    )
    tool_mask, completion_mask = tr._tool_rounds[-1]
    tool = (completion_mask * (1 - tool_mask)).bool()  # the tool-response tokens
    actions = (completion_mask * tool_mask).bool()
    assert tool.any() and actions.any()
    if kind in PRIME:
        rounds = next(cb for cb in tr.callback_handler.callbacks if isinstance(cb, ScoredRounds)).rounds
        last = [r for r in rounds if r["mode"] == "train"][-1]
        assert last["step"] == 2
        rewards = last["token_rewards"]
        assert torch.equal(rewards[tool], torch.zeros_like(rewards[tool]))
        assert bool((rewards[actions] != 0).any()), "the PRM moved: the policy's tokens get nonzero token rewards"
        torch.testing.assert_close(last["sequence_rewards"], rewards.sum(-1))
    else:
        kl_mask = tr._prl_last["mask"][tr._prl_last["process_slice"], : tool.size(1)]
        assert not bool(kl_mask[tool].any()) and bool(kl_mask[actions].all())
