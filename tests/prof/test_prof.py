"""PROF: ProfFilter, the step PRMs, ProfGRPOTrainer, and PROF inside the PRIME trainers (single process, CPU).

PROF arXiv 2509.03403, section 3 and Algorithm 1. Completions of the tiny model rarely hold "\\n\\n"; a generation ``sequence_bias`` on the newline token
makes multi-step completions common without changing the model (its log-probs, hence the losses, are unaffected).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers import DATA, tiny_kwargs
from tiny import build_tokenizer, contains_reward, tiny_prompt_dataset
from tiny_prm import build_tiny_step_prm

from trl_prime import (
    PrimeGRPOConfig,
    PrimeGRPOTrainer,
    PrimeRLOOConfig,
    PrimeRLOOTrainer,
    ProfFilter,
    ProfGRPOConfig,
    ProfGRPOTrainer,
)
from trl_prime import functional as F
from trl_prime.callbacks import PrimeCallback
from trl_prime.prof.config import QWEN_PRM_SYSTEM_PROMPT
from trl_prime.prof.step_prm import StepBatch, TokenClassificationStepPRM, load_step_prm


N = 8
NEWLINE_BIAS = {"sequence_bias": {(build_tokenizer().convert_tokens_to_ids("Ċ"),): 4.0}}


@pytest.fixture(scope="module")
def step_prm_path(tmp_path_factory):
    return build_tiny_step_prm(tmp_path_factory.mktemp("tiny_step_prm"))


def _kwargs(tmp_path, **overrides):
    prof = dict(per_device_train_batch_size=16, num_generations=N, max_completion_length=12, max_steps=2)
    return tiny_kwargs(tmp_path, **{**prof, "learning_rate": 1e-2, "generation_kwargs": NEWLINE_BIAS, **overrides})


class _Record:
    """Mixin: keep each generation round's output and PROF state, and each batch reaching the loss."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.rounds.append(
            {
                "output": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in out.items()},
                "prof": dict(self.prof_filter.last) if self.prof_filter is not None else {},
            }
        )
        return out

    def _compute_loss(self, model, inputs):
        self.loss_inputs.append(dict(inputs))
        return super()._compute_loss(model, inputs)


def _spy(cls):
    class Spy(_Record, cls):
        def __init__(self, *a, **kw):
            self.rounds, self.loss_inputs = [], []
            super().__init__(*a, **kw)

    return Spy


def _scores(step_values, step_mask):
    """Hand-computed consistency (mean step score) and number of steps."""
    n = step_mask.sum(-1)
    return torch.where(step_mask, step_values, 0).sum(-1) / n.clamp(min=1), n


# ----------------------------------------------------------------------------------------------------------------
def test_config_defaults_and_validation(tmp_path):
    prime = PrimeGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    assert (prime.prof_mode, prime.prof_prm, prime.prof_penalty, prime.prof_min_steps, prime.prof_max_steps) == (
        "off",
        "implicit",
        10.0,
        2,
        30,
    )
    assert (prime.prof_penalty_position, prime.prof_rounding, prime.prof_center) == ("reference", "half_even", "none")
    cfg = ProfGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    assert (cfg.prof_mode, cfg.num_generations, cfg.prof_keep_count(), cfg.prof_prm) == (
        "both",
        8,
        4,
        "Qwen/Qwen2.5-Math-PRM-7B",
    )
    c = PrimeGRPOConfig(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, num_generations=8, prof_mode="both", prof_num_remove=4
    )
    assert c.prof_keep_count() == 4 and c.prof_prm == "implicit"
    assert ProfGRPOConfig(**_kwargs(tmp_path, prof_num_keep=3)).prof_keep_count() == 3
    bad = [
        (dict(prof_mode="pos"), "prof_mode"),
        (dict(prof_num_keep=4, prof_num_remove=4), "prof_num_keep"),
        (dict(prof_num_keep=9), "prof_num_keep"),
        (dict(prof_num_keep=0), "prof_num_keep"),
        (dict(prof_num_remove=8), "prof_num_remove"),
        (dict(prof_num_remove=-1), "prof_num_remove"),
        (dict(prof_min_steps=5, prof_max_steps=3), "prof_min_steps"),
        (dict(prof_penalty=-1.0), "prof_penalty"),
        (dict(prof_penalty_position="after"), "prof_penalty_position"),
        (dict(prof_rounding="floor"), "prof_rounding"),
        (dict(prof_center="prompt"), "prof_center"),
        (dict(prof_implicit_temperature=0.0), "prof_implicit_temperature"),
        (dict(loss_type="grpo"), "loss_type"),
        (dict(loss_type="dr_grpo"), "loss_type"),
        (dict(loss_type="bnpo"), "loss_type"),
        (dict(prof_prm="implicit"), "prof_prm"),
        (dict(prof_prm=""), "prof_prm"),
        (dict(scale_rewards="global"), "scale_rewards"),
    ]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            ProfGRPOConfig(**_kwargs(tmp_path, **kw))
    with pytest.raises(ValueError, match="prof_num_remove"):
        PrimeRLOOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, prof_mode="both", prof_num_remove=4)
    # off: no check of the PROF-only constraints (PRIME's own loss types stay allowed)
    PrimeGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, loss_type="grpo")


def _filter(**kw):
    return ProfFilter(prm=None, num_keep=kw.pop("num_keep", 4), **kw)


def test_figure_example_5_correct_3_incorrect_keep_4():
    """n = 8 (5 correct, 3 incorrect), keep 4: k+ = k- = 2; the two most consistent correct and the two least
    consistent incorrect completions (PROF-BOTH); PROF-POS keeps the same correct ones and two seeded-random incorrect
    ones, the same on every call with the same step (every process draws alike)."""
    means = torch.tensor([0.9, 0.2, 0.7, 0.4, 0.6, 0.8, 0.1, 0.5])
    outcome = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    scores = means[:, None].expand(N, 3).clone()  # 3 steps each (inside 2..30: no penalty)
    smask = torch.ones(N, 3, dtype=torch.bool)
    gid = torch.zeros(N, dtype=torch.long)
    sel = _filter().select(gid, scores, smask, outcome)
    assert sel["kept"].nonzero().flatten().tolist() == [0, 2, 6, 7]  # correct: 0.9, 0.7; incorrect: 0.1, 0.5
    torch.testing.assert_close(sel["consistency"], means)
    m = ProfFilter.metrics(sel)
    assert (m["prof/kept_fraction"], m["prof/kept_correct"], m["prof/kept_incorrect"]) == (0.5, 2.0, 2.0)
    assert m["prof/consistency_kept_mean"] == pytest.approx((0.9 + 0.7 + 0.1 + 0.5) / 4)
    assert m["prof/consistency_dropped_mean"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.8) / 4)
    assert m["prof/dropped_correct_fraction"] == pytest.approx(3 / 5) and m["prof/num_steps_mean"] == 3.0
    # advantages on the kept rows only: GRPO over {1, 1, 0, 0}
    adv = F.grpo_advantages(torch.where(sel["kept"], outcome, torch.nan), gid)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([expected, 0, expected, 0, 0, 0, -expected, -expected]))
    # PROF-POS
    pos = [
        _filter(mode="correct", seed=1).select(gid, scores, smask, outcome, step=s)["kept"] for s in (5, 5, 6, 7, 8)
    ]
    assert torch.equal(pos[0], pos[1])
    for k in pos:
        assert k[[0, 2]].all() and not k[[1, 3, 4]].any() and int(k[5:].sum()) == 2
    assert len({tuple(k.tolist()) for k in pos}) > 1  # the incorrect pick changes with the step
    # the step-count penalty: a correct completion with a single step drops to the bottom of its class
    smask1 = smask.clone()
    smask1[0, 1:] = False
    assert _filter().select(gid, scores, smask1, outcome)["kept"].nonzero().flatten().tolist() == [2, 4, 6, 7]


def test_all_correct_groups_and_groups_smaller_than_m():
    """All-correct group: the 4 most consistent correct are kept and their GRPO advantages are 0. A group with fewer
    than m eligible completions (unscorable rows, or a smaller group) keeps every eligible one."""
    gid = torch.tensor([0] * 8 + [1] * 8 + [2] * 3)
    c = torch.rand(19, generator=torch.Generator().manual_seed(0))
    scores, smask = c[:, None].expand(19, 4).clone(), torch.ones(19, 4, dtype=torch.bool)
    outcome = torch.cat([torch.ones(8), torch.tensor([1.0, 0.0] + [float("nan")] * 6), torch.tensor([0.0, 1.0, 0.0])])
    sel = _filter().select(gid, scores, smask, outcome)
    kept = sel["kept"]
    assert kept[:8].nonzero().flatten().tolist() == sorted(c[:8].argsort(descending=True)[:4].tolist())
    assert kept[8:10].all() and not kept[10:16].any() and kept[16:].all()
    adv = F.grpo_advantages(torch.where(kept, outcome, torch.nan), gid)
    assert torch.all(adv[:8] == 0) and adv[8] > 0 > adv[9]
    assert ProfFilter.metrics(sel)["prof/kept_fraction"] == pytest.approx(9 / 19)


def test_external_token_classification_prm(step_prm_path, tmp_path):
    """Steps split on "\\n\\n", joined with <extra_0> after every step, in [system, user, assistant] rendered with the
    PRM's chat template; P(label 1) at each separator. Batched (left padding, attention mask) == one row at a time;
    right truncation drops trailing steps; the separator must be one token."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    args = ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=step_prm_path, prof_prm_micro_batch_size=2))
    prm = load_step_prm(step_prm_path, args)
    assert isinstance(prm, TokenClassificationStepPRM)
    prompts = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 3?"}],
        f"{QWEN_PRM_SYSTEM_PROMPT} Compute 7 * 6.",
        "Short one",
    ]
    completions = [
        [{"role": "assistant", "content": "First, add.\n\n\n\nSo 5.\n\nThe answer is \\boxed{5}."}],
        "  Step one: 7 * 6 = 42.\n\nSo the answer is \\boxed{42}.  ",
        "no steps here",
    ]
    conv = prm.conversations(prompts, completions)
    assert conv[0] == [
        {"role": "system", "content": QWEN_PRM_SYSTEM_PROMPT},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "First, add.<extra_0>So 5.<extra_0>The answer is \\boxed{5}.<extra_0>"},
    ]
    assert conv[1][1]["content"] == "Compute 7 * 6."  # the system prompt string is removed from the user text
    assert conv[2][2]["content"] == "no steps here<extra_0>"
    vectors = os.path.join(DATA, "conformance", "prof_prm_step_split.json")
    cases = json.load(open(vectors))["cases"]  # the released PROF code's text construction
    built = prm.conversations(["q"] * len(cases), [c["inputs"]["response_text"] for c in cases])
    assert [m[-1]["content"] for m in built] == [c["outputs"]["assistant_content"] for c in cases]
    ids = torch.zeros(3, 4, dtype=torch.long)
    batch = StepBatch(
        prompts=prompts, completions=completions, completion_ids=ids, completion_mask=torch.ones_like(ids)
    )
    scores, smask = prm.step_scores(batch)
    assert smask.sum(-1).tolist() == [3, 2, 1] and scores.shape == (3, 3)
    model = AutoModelForTokenClassification.from_pretrained(step_prm_path).eval()
    tok = AutoTokenizer.from_pretrained(step_prm_path)
    sep = tok.convert_tokens_to_ids("<extra_0>")
    for i, messages in enumerate(conv):
        one = tok(tok.apply_chat_template(messages, tokenize=False), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            p = model(**one).logits[0].softmax(-1)[:, 1]
        expected = p[one["input_ids"][0] == sep]
        torch.testing.assert_close(scores[i, smask[i]], expected, atol=1e-5, rtol=1e-5)
    # right truncation: a max_length that ends inside the first completion's last step scores its first 2 steps; the
    # third still counts as a step (true H = 3) but is unscored (NaN)
    full = len(tok(prm.texts(prompts[:1], completions[:1])[0], add_special_tokens=False)["input_ids"])
    short = TokenClassificationStepPRM(model, tok, max_length=full - 8)
    s_short, m_short = short.step_scores(StepBatch(prompts[:1], completions[:1], ids[:1], torch.ones_like(ids[:1])))
    assert m_short.sum().item() == 3 and torch.isnan(s_short[0]).tolist() == [False, False, True]
    torch.testing.assert_close(s_short[0, :2], scores[0, :2], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one token"):
        TokenClassificationStepPRM(model, tok, separator="<no_such_sep>")


def test_prof_grpo_trainer_external_prm_ten_steps(tiny_model_path, step_prm_path, tmp_path):
    """ProfGRPOTrainer with the tiny external PRM: every round keeps exactly 4 of 8 per prompt, chosen as
    `functional.prof_select` chooses on PRM scores recomputed one row at a time; the advantages reaching the loss are
    GRPO's over the kept rows, the dropped rows have loss weight 0, `num_items_in_batch` counts the kept tokens, and
    the prof/* metrics are logged every step (10 steps)."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tr = _spy(ProfGRPOTrainer)(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        args=ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=step_prm_path, max_steps=10)),
        train_dataset=tiny_prompt_dataset(20, conversational=True),
    )
    assert isinstance(tr.prof_filter.prm, TokenClassificationStepPRM) and tr.prof_filter.num_keep == 4
    tr.train()
    model = AutoModelForTokenClassification.from_pretrained(step_prm_path).eval()
    tok = AutoTokenizer.from_pretrained(step_prm_path)
    sep = tok.convert_tokens_to_ids("<extra_0>")
    reward = contains_reward("e")
    assert len(tr.rounds) == 10
    multi_step = 0
    for rnd in tr.rounds[:3]:
        out, last = rnd["output"], rnd["prof"]
        texts = tr.processing_class.batch_decode(out["completion_ids"], skip_special_tokens=True)
        outcome = torch.tensor(reward(texts))
        torch.testing.assert_close(last["outcome"], outcome)
        # PRM scores, one row at a time, from the text alone
        cons, H = torch.zeros(16), torch.zeros(16, dtype=torch.long)
        for i, text in enumerate(texts):
            steps = F.split_steps(text)
            prompt_ids = out["prompt_ids"][i][out["prompt_mask"][i].bool()]
            question = tr.processing_class.decode(prompt_ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            messages = [
                {"role": "system", "content": QWEN_PRM_SYSTEM_PROMPT},
                {"role": "user", "content": question},
                {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"},
            ]
            one = tok(tok.apply_chat_template(messages, tokenize=False), return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                p = model(**one).logits[0].softmax(-1)[:, 1][one["input_ids"][0] == sep]
            cons[i], H[i] = p.mean(), p.numel()
        multi_step += int((H > 1).sum())
        torch.testing.assert_close(last["consistency"], cons, atol=1e-5, rtol=1e-5)
        assert torch.equal(last["num_steps"], H)
        gid = torch.arange(16) // N
        kept_idx = F.prof_select(gid, cons, H, outcome, num_keep=4)
        kept = torch.zeros(16, dtype=torch.bool)
        kept[kept_idx] = True
        assert torch.equal(last["kept"], kept) and kept.view(2, N).sum(1).tolist() == [4, 4]
        adv = F.grpo_advantages(torch.where(kept, outcome, torch.nan), gid)
        torch.testing.assert_close(out["advantages"], adv)
        assert torch.equal(out["tool_mask"], kept[:, None].long().expand_as(out["completion_mask"]))
        assert out["num_items_in_batch"].item() == (out["completion_mask"] * kept[:, None]).sum().item()
    assert multi_step > 0  # some completions had several steps
    last_out = tr.rounds[-1]["output"]
    assert list(tr._logs["advantages"])[-16:] == last_out["advantages"].tolist()  # the completions log shows them
    logs = [h for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
    assert [h["step"] for h in logs] == list(range(1, 11))
    for h in logs:
        assert h["prof/kept_fraction"] == 0.5 and h["prof/kept_correct"] + h["prof/kept_incorrect"] == 8
        for k in ("prof/consistency_kept_mean", "prof/num_steps_mean", "loss", "reward", "entropy"):
            assert math.isfinite(h[k]), k
        assert 0.0 <= h["prof/dropped_correct_fraction"] <= 1.0 or math.isnan(h["prof/dropped_correct_fraction"])
    first = ProfFilter.metrics(tr.rounds[0]["prof"])
    for k, v in first.items():
        assert logs[0][k] == pytest.approx(v, nan_ok=True), k


def test_scale_rewards_batch_divides_by_the_kept_rows_std(tiny_model_path, step_prm_path, tmp_path):
    """scale_rewards="batch" (TRL's option) in ProfGRPOTrainer: each kept reward minus its prompt's kept mean, divided
    by the std of all kept rewards of the batch (unbiased, + eps 1e-6); dropped rows get 0. Hand computation."""
    tr = _spy(ProfGRPOTrainer)(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        args=ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=step_prm_path, max_steps=2, scale_rewards="batch")),
        train_dataset=tiny_prompt_dataset(20, conversational=True),
    )
    tr.train()
    checked = 0
    for rnd in tr.rounds:
        out, last = rnd["output"], rnd["prof"]
        kept, outcome = last["kept"], last["outcome"]
        r = outcome[kept].view(2, 4)  # 4 kept of 8 for each of the 2 prompts, in row order
        centred = r - r.mean(1, keepdim=True)
        std = outcome[kept].std()
        expected = torch.zeros(16)
        expected[kept] = (centred / (std + 1e-6)).flatten()
        torch.testing.assert_close(out["advantages"], expected)
        checked += int(std > 0)
    assert checked > 0  # at least one round had a spread of kept rewards


@pytest.mark.parametrize(
    "cls,cfg_cls",
    [(PrimeGRPOTrainer, PrimeGRPOConfig), (PrimeRLOOTrainer, PrimeRLOOConfig)],
    ids=["prime-grpo", "prime-rloo"],
)
def test_implicit_prof_inside_prime(tiny_model_path, tmp_path, cls, cfg_cls):
    """PrimeGRPOConfig(prof_mode="both", prof_prm="implicit", prof_num_remove=4), n = 8: exactly 4 of 8 per prompt,
    chosen on the sigmoid of the online implicit PRM's step rewards (no extra model); the PRIME advantages are computed
    on the kept rows only and the dropped rows have loss weight 0; the PRM still trains on every row."""
    tr = _spy(cls)(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        train_dataset=tiny_prompt_dataset(8),
        args=cfg_cls(
            **_kwargs(
                tmp_path,
                prof_mode="both",
                prof_prm="implicit",
                prof_num_remove=4,
                max_steps=2,
                filter_lower=0.0,
                filter_upper=1.0,
                prm_learning_rate=1e-2,
            )
        ),
    )
    events = []

    class Rec(PrimeCallback):
        def on_rollouts_scored(self, args, state, control, **kw):
            events.append(kw)

    tr.add_callback(Rec())
    tr.train()
    a = tr.args
    assert len(events) == 2
    for ev, rnd in zip(events, tr.rounds):
        last = rnd["prof"]
        mask = ev["completion_mask"].bool()
        ends = F.step_end_mask(ev["completion_ids"], mask, tr.processing_class, split="double_newline")
        values, smask = F.step_rewards(ev["token_rewards"] * mask, ends)
        cons, H = _scores(torch.sigmoid(values), smask)
        torch.testing.assert_close(last["consistency"], cons, atol=1e-6, rtol=1e-6)
        outcome = ev["outcome_rewards"]
        gid = torch.arange(16) // N
        kept = torch.zeros(16, dtype=torch.bool)
        kept[F.prof_select(gid, cons, H, outcome, num_remove=4)] = True
        assert torch.equal(last["kept"], kept) and kept.view(2, N).sum(1).tolist() == [4, 4]
        opts = tr._advantage_options()
        expected = F.prime_advantages(
            process_rewards=ev["token_rewards"],
            outcome_rewards=torch.where(kept, outcome, torch.nan),
            mask=mask,
            group_ids=gid,
            **opts,
        )
        torch.testing.assert_close(ev["advantages"], expected, atol=1e-6, rtol=1e-5)
        assert torch.equal(ev["loss_mask"], ev["completion_mask"] * kept[:, None])
        assert ev["kept_mask"].all()  # the prompt filter (off here) is reported apart from PROF
        assert rnd["output"]["num_items_in_batch"].item() == ev["loss_mask"].sum().item()
    prm_logs = [h for h in tr.state.log_history if "prm/loss" in h]
    assert len(prm_logs) == 2 and all(h["prof/kept_fraction"] == 0.5 for h in prm_logs)
    assert tr.prm_optim.num_updates == 2 and events[1]["token_rewards"].abs().max() > 0
    assert a.prof_keep_count() == 4


@pytest.mark.parametrize("row_dropping", [True, False], ids=["rows-dropped", "rows-masked"])
@pytest.mark.parametrize("which", ["prof-grpo", "prime-rloo"])
def test_dropped_rows_have_zero_gradient(tiny_model_path, step_prm_path, tmp_path, monkeypatch, which, row_dropping):
    """On a batch that reached the loss, the policy gradient is unchanged when the dropped rows' advantages and tokens
    are replaced by anything, and equals the gradient of the kept rows alone; changing a kept row changes it. Both
    with the loss skipping zero-weight rows (the default) and with that turned off (the loss masks alone)."""
    if not row_dropping:
        import trl_prime.adapters
        import trl_prime.rollout

        for mod in (trl_prime.rollout, trl_prime.adapters):
            monkeypatch.setattr(mod, "drop_zero_weight_rows", lambda inputs, weight, accelerator=None: inputs)
    if which == "prof-grpo":
        tr = _spy(ProfGRPOTrainer)(
            model=tiny_model_path,
            reward_funcs=contains_reward("e"),
            train_dataset=tiny_prompt_dataset(8),
            args=ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=step_prm_path, max_steps=1)),
        )
    else:
        tr = _spy(PrimeRLOOTrainer)(
            model=tiny_model_path,
            reward_funcs=contains_reward("e"),
            train_dataset=tiny_prompt_dataset(8),
            args=PrimeRLOOConfig(
                **_kwargs(tmp_path, prof_mode="both", prof_num_keep=4, max_steps=1, filter_lower=0.0, filter_upper=1.0)
            ),
        )
    tr.train()
    inputs = tr.loss_inputs[0]
    weight = inputs["tool_mask"] * inputs["completion_mask"] if "tool_mask" in inputs else inputs["prime_loss_mask"]
    kept = weight.sum(-1) > 0
    assert kept.sum() == 8 and (~kept).sum() == 8
    params = [p for p in tr.model.parameters() if p.requires_grad]

    def grad(batch):
        tr.model.zero_grad(set_to_none=True)
        tr._compute_loss(tr.model, batch).backward()
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])

    g = grad(inputs)
    assert g.abs().max() > 0
    noisy = dict(inputs)
    adv = inputs["advantages"].clone()
    adv[~kept] = 100.0
    ids = inputs["completion_ids"].clone()
    ids[~kept] = torch.randint(0, 50, ids[~kept].shape)
    noisy.update(advantages=adv, completion_ids=ids)
    torch.testing.assert_close(grad(noisy), g, atol=1e-7, rtol=1e-5)
    B = kept.numel()
    only_kept = {
        k: (v[kept] if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == B else v) for k, v in inputs.items()
    }
    torch.testing.assert_close(grad(only_kept), g, atol=1e-6, rtol=1e-4)
    moved = dict(inputs)
    adv = inputs["advantages"].clone()
    adv[kept.nonzero()[0]] += 1.0
    moved["advantages"] = adv
    assert not torch.allclose(grad(moved), g)


def test_options_reach_the_filter(tmp_path):
    """Every prof_* option of the config reaches ProfFilter and its selection is functional.prof_select's."""
    from types import SimpleNamespace

    class FixedPRM:
        def step_scores(self, batch):
            return batch.token_rewards, batch.completion_mask.bool()

    cfg = ProfGRPOConfig(
        **_kwargs(
            tmp_path,
            prof_prm="unused",
            prof_mode="correct",
            prof_num_keep=3,
            prof_penalty=5.0,
            prof_min_steps=1,
            prof_max_steps=3,
            prof_penalty_position="paper",
            prof_rounding="half_up",
            prof_center="batch",
            prof_correct_threshold=0.5,
            seed=7,
        )
    )
    f = ProfFilter.from_trainer(SimpleNamespace(args=cfg, _tokenizer=None), prm=FixedPRM())
    assert (
        f.mode,
        f.num_keep,
        f.penalty,
        f.min_steps,
        f.max_steps,
        f.penalty_position,
        f.rounding,
        f.center,
        f.correct_threshold,
        f.seed,
    ) == ("correct", 3, 5.0, 1, 3, "paper", "half_up", "batch", 0.5, 7)
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(16, 5, generator=g)
    smask = torch.arange(5)[None, :] < torch.randint(1, 6, (16, 1), generator=g)  # 1..5 steps: some penalised
    outcome = torch.tensor([1.0, 0.6, 0.0, 0.2, 1.0, 0.0, 0.0, 1.0] * 2)
    gid = torch.arange(16) // 8
    sel = f.select(gid, scores, smask, outcome, step=3)
    c, H = F.prof_consistency_scores(scores, smask, center="batch")
    torch.testing.assert_close(sel["consistency"], c)
    idx = F.prof_select(
        gid,
        c,
        H,
        outcome,
        num_keep=3,
        penalty=5.0,
        min_steps=1,
        max_steps=3,
        penalty_position="paper",
        mode="correct",
        rounding="half_up",
        generator=torch.Generator().manual_seed(7 * 1_000_003 + 3),
        correct_threshold=0.5,
    )
    assert sel["kept"].nonzero().flatten().tolist() == idx.tolist() and int(sel["kept"].sum()) == 6
    assert sel["correct"].tolist() == (outcome >= 0.5).tolist()
    # a ProfFilter needs a mode that filters
    with pytest.raises(ValueError, match=r"ProfFilter mode='off' is not supported; choose one of 'both', 'correct'\."):
        ProfFilter(FixedPRM(), num_keep=4, mode="off")
    assert ProfFilter.from_trainer(SimpleNamespace(args=ProfGRPOConfig(**_kwargs(tmp_path, prof_mode="off")))) is None


def test_saved_implicit_prm_folder_and_prof_pos_in_prof_grpo(tiny_model_path, tmp_path):
    """prof_prm = a folder saved by ImplicitPRM.save_pretrained: a frozen implicit PRM scores the steps (sigmoid of its
    step rewards) in ProfGRPOTrainer; with prof_mode="correct" (PROF-POS) the kept correct completions are the most
    consistent ones and 4 of 8 are kept per prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_prime import ImplicitPRM
    from trl_prime.prof.step_prm import ImplicitStepPRM

    prm_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in prm_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    folder = str(tmp_path / "implicit_prm")
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ImplicitPRM(prm_model, ref, beta=0.05, tokenizer=tok).save_pretrained(folder)
    tr = _spy(ProfGRPOTrainer)(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        train_dataset=tiny_prompt_dataset(8),
        args=ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=folder, prof_mode="correct", max_steps=1)),
    )
    assert isinstance(tr.prof_filter.prm, ImplicitStepPRM) and tr.prof_filter.prm.implicit_prm is not None
    assert not any(p.requires_grad for p in tr.prof_filter.prm.implicit_prm.model.parameters())
    tr.train()
    out, last = tr.rounds[0]["output"], tr.rounds[0]["prof"]
    loaded = ImplicitPRM.from_pretrained(folder)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    rewards = loaded.token_rewards(ids, am, out["completion_mask"])
    mask = out["completion_mask"].bool()
    ends = F.step_end_mask(out["completion_ids"], mask, tr.processing_class, split="double_newline")
    values, smask = F.step_rewards(rewards * mask, ends)
    cons, H = _scores(torch.sigmoid(values), smask)
    torch.testing.assert_close(last["consistency"], cons, atol=1e-6, rtol=1e-5)
    assert last["consistency"].std() > 0  # the perturbed PRM really scores
    kept, correct = last["kept"], last["correct"]
    assert kept.view(2, N).sum(1).tolist() == [4, 4]
    critic = torch.where(H < 2, cons - 10.0, cons)  # (H > 30 cannot happen in 12 tokens)
    for g in range(2):
        rows = torch.arange(g * N, (g + 1) * N)
        pos = rows[correct[rows]]
        n_keep_pos = int((kept[pos]).sum())
        top = pos[critic[pos].argsort(descending=True, stable=True)][:n_keep_pos]
        assert set(top.tolist()) == set(pos[kept[pos]].tolist())


# ----------------------------------------------------------------------------------------------------------------
# review fixes
# ----------------------------------------------------------------------------------------------------------------
def test_truncated_prm_input_counts_true_steps_and_ranks_least_consistent(step_prm_path):
    """Right truncation of the external PRM's input: H is the completion's true number of steps (so a long completion
    cannot dodge the > prof_max_steps penalty, and a truncated one is not taken for a 0-step one), the cut-off steps are
    unscored, the row's consistency is NaN (least consistent of its class in prof_select), the fraction is logged as
    prof/prm_truncated_fraction and a warning is given once."""

    from accelerate import Accelerator
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(step_prm_path).eval()
    tok = AutoTokenizer.from_pretrained(step_prm_path)
    long = "\n\n".join(f"Step {i}." for i in range(40))  # 40 steps: penalised (> 30) whatever is truncated
    short = "One.\n\nTwo.\n\nThree."
    completions = [long, short, short, short]
    prompts = ["What is 2 + 2?"] * 4
    ids = torch.zeros(4, 2, dtype=torch.long)
    batch = StepBatch(prompts, completions, ids, torch.ones_like(ids))
    full = TokenClassificationStepPRM(model, tok)
    s_full, m_full = full.step_scores(batch)
    assert m_full.sum(-1).tolist() == [40, 3, 3, 3] and not torch.isnan(s_full[m_full]).any()
    n_short = len(tok(full.texts(prompts[1:2], [short])[0], add_special_tokens=False)["input_ids"])
    prm = TokenClassificationStepPRM(model, tok, max_length=n_short)  # the short rows fit, the long one does not
    scores, smask = prm.step_scores(batch)
    assert smask.sum(-1).tolist() == [40, 3, 3, 3]  # true steps, not the separators that survived truncation
    assert torch.isnan(scores[0][smask[0]]).any() and not torch.isnan(scores[1:][smask[1:]]).any()
    torch.testing.assert_close(scores[1:, :3], s_full[1:, :3], atol=1e-5, rtol=1e-5)

    f = ProfFilter(prm, num_keep=2, max_steps=50)  # no step penalty: the NaN alone ranks the truncated row
    outcome = torch.tensor([1.0, 1.0, 1.0, 0.0])
    sel = f.select(torch.zeros(4, dtype=torch.long), scores, smask, outcome)
    assert sel["num_steps"].tolist() == [40, 3, 3, 3] and sel["truncated"].tolist() == [True, False, False, False]
    assert math.isnan(sel["consistency"][0]) and not torch.isnan(sel["consistency"][1:]).any()
    # 3 correct + 1 incorrect, keep 2 -> 1 + 1: the truncated correct row is the least consistent, never kept
    assert sel["kept"].tolist()[0] is False and int(sel["kept"].sum()) == 2
    m = ProfFilter.metrics(sel)
    assert m["prof/prm_truncated_fraction"] == 0.25 and math.isfinite(m["prof/consistency_dropped_mean"])
    # through __call__: the metric comes back with the kept rows and the warning comes once
    output = {
        "completion_ids": ids,
        "completion_mask": torch.ones_like(ids),
        "prompt_ids": ids,
        "prompt_mask": torch.ones_like(ids),
    }
    call = dict(
        step=0,
        outcome=outcome,
        eligible=torch.ones(4, dtype=torch.bool),
        output=output,
        capture={"prompts": prompts, "completions": completions},
        num_generations=4,
    )
    with pytest.warns(UserWarning, match="prof_prm_max_length"):
        kept, first = f(Accelerator(cpu=True), **call)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, second = f(Accelerator(cpu=True), **call)
    assert kept.tolist() == sel["kept"].tolist()
    assert first["prof/prm_truncated_fraction"] == second["prof/prm_truncated_fraction"] == 0.25


def test_step_delimiter_escapes_and_prof_prm_path_checked_early(tmp_path):
    r"""'\n\n' typed on a command line arrives as backslash-n: decoded in __post_init__ (delimiter and separator); a
    missing local prof_prm fails at config time naming `prof_prm`; a folder that is not a PRM fails naming it too."""
    from types import SimpleNamespace

    cfg = ProfGRPOConfig(
        **_kwargs(tmp_path, prof_prm="org/prm", prof_step_delimiter="\\n\\n", prof_prm_separator="\\u00b6")
    )
    assert cfg.prof_step_delimiter == "\n\n" and cfg.prof_prm_separator == "\u00b6"
    assert (
        PrimeGRPOConfig(
            output_dir=str(tmp_path), bf16=False, use_cpu=True, prof_step_delimiter="\\n"
        ).prof_step_delimiter
        == "\n"
    )
    assert ProfGRPOConfig(**_kwargs(tmp_path, prof_step_delimiter="\n\n")).prof_step_delimiter == "\n\n"
    for missing in (str(tmp_path / "no_prm"), "./no_prm_here", "~/no_prm_here_xyz", "models/step/prm"):
        with pytest.raises(ValueError, match=r"`prof_prm`=.*does not exist"):
            ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=missing))
    ProfGRPOConfig(**_kwargs(tmp_path, prof_prm="Qwen/Qwen2.5-Math-PRM-7B"))  # a Hub id: not checked here
    ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=str(tmp_path / "no_prm"), prof_mode="off"))  # off: unused
    empty = tmp_path / "not_a_prm"
    empty.mkdir()
    cfg = ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=str(empty)))
    with pytest.raises(ValueError, match=r"`prof_prm`=.*could not be loaded"):
        ProfFilter.from_trainer(SimpleNamespace(args=cfg, _tokenizer=None))


def test_prof_rounding_help_matches_prof_select():
    """half_up removes one more correct row on a .5 tie (k+ = floor(m/2)), half_down one fewer (k+ = ceil(m/2)),
    half_even rounds the removed count to even (n=8, m=3: 5/3 -> 1 correct kept, 4/4 -> 2), as the help text says."""
    help_text = ProfGRPOConfig.__dataclass_fields__["prof_rounding"].metadata["help"]
    assert "k+ = floor(m/2)" in help_text and "k+ = ceil(m/2)" in help_text

    def kept_correct(n_pos, rounding):
        outcome = torch.tensor([1.0] * n_pos + [0.0] * (8 - n_pos))
        idx = F.prof_select(
            None, torch.rand(8), torch.full((8,), 3), outcome, num_keep=3, rounding=rounding, num_generations=8
        )
        return int((outcome[idx] == 1).sum())

    assert [kept_correct(5, r) for r in ("half_up", "half_down", "half_even")] == [1, 2, 1]
    assert [kept_correct(4, r) for r in ("half_up", "half_down", "half_even")] == [1, 2, 2]


def test_in_memory_prm_is_frozen_and_placed(tiny_model_path, step_prm_path, tmp_path):
    """prof_prm passed as an object (a TokenClassificationStepPRM) is frozen (no grad, eval) and on the trainer's
    device after construction, like a prof_prm path."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(step_prm_path).train()
    assert all(p.requires_grad for p in model.parameters())
    prm = TokenClassificationStepPRM(model, AutoTokenizer.from_pretrained(step_prm_path))
    tr = ProfGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        train_dataset=tiny_prompt_dataset(8),
        args=ProfGRPOConfig(**_kwargs(tmp_path, prof_prm="Qwen/Qwen2.5-Math-PRM-7B", max_steps=1)),
        prof_prm=prm,
    )
    assert tr.prof_filter.prm is prm
    frozen = tr.prof_filter.prm.model
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert {p.device for p in frozen.parameters()} == {tr.accelerator.device}


def test_evaluation_logs_non_finite_rewards_without_skipping_a_step(tiny_model_path, step_prm_path, tmp_path, caplog):
    """In evaluation ProfGRPOTrainer goes through the outcome check PRIME and PRL share (trl_prime/rollout.py): a row
    with an infinite reward is logged as in evaluation (no optimizer step to skip), the batch is not poisoned and no
    skipped step is counted; the PROF filter does not run (TRL's evaluation is not filtered)."""
    import logging

    def reward_inf_first(completions, **kwargs):
        return [math.inf] + [0.0] * (len(completions) - 1)

    tr = ProfGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=reward_inf_first,
        args=ProfGRPOConfig(**_kwargs(tmp_path, prof_prm=step_prm_path, per_device_eval_batch_size=N)),
        train_dataset=tiny_prompt_dataset(4, conversational=True),
        eval_dataset=tiny_prompt_dataset(1, conversational=True),
    )
    with caplog.at_level(logging.WARNING, logger="trl_prime.guards"):
        tr.evaluate()
    text = caplog.text
    assert (
        "Non-finite values in evaluation after step 0 (non-finite rewards): no optimizer step to skip; evaluation "
        "goes on and its metrics may be non-finite. Offending rows of the global evaluation batch: [0]; sample ids: "
        "['What is 0 + 0?']"
    ) in text
    assert "skipping the optimizer step" not in text
    assert not tr.guard_poisoned and tr.guards.total_skips == 0 and tr.prof_filter.last == {}
