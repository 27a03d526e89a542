"""ImplicitPRMTrainer / ImplicitPRMConfig / best_of_n: losses, prompt grouping, save/reload, best-of-N, validation."""

from __future__ import annotations

import pytest
import torch

from trl_prime import ImplicitPRM, ImplicitPRMConfig, ImplicitPRMTrainer, best_of_n
from trl_prime import functional as F
from trl_prime.implicit_prm.trainer import PromptGroupBatchSampler
from trl_prime.modeling import completion_logps


PROMPTS = ["What is 2 + 3?", "Compute 7 * 6.", "Let x be 4."]
GOOD = ["The answer is 5.", "7 * 6 = 42.\n\nSo the answer is 42.", "x + 4 = 8"]
BAD = ["The answer is 7.", "7 * 6 = 40.\n\nSo the answer is 40.", "x + 4 = 9"]


def _dataset(conversational: bool = False, with_label: bool = True):
    """3 prompts x (2 correct + 2 incorrect), rows interleaved across prompts (grouping must be done by the trainer)."""
    from datasets import Dataset

    rows = []
    for k in range(2):
        for i, p in enumerate(PROMPTS):
            prompt = [{"role": "user", "content": p}] if conversational else p
            rows.append({"prompt": prompt, "completion": GOOD[i] + " " * k, "label": 1.0})
            rows.append({"prompt": prompt, "completion": BAD[i] + " " * k, "label": 0.0})
    cols = {k: [r[k] for r in rows] for k in ("prompt", "completion", "label")}
    if not with_label:
        cols.pop("label")
    return Dataset.from_dict(cols)


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        max_steps=8,
        beta=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_length=64,
        max_prompt_length=32,
    )
    base.update(kw)
    return ImplicitPRMConfig(**base)


def _batch_loss(trainer, batch, loss_type):
    """The loss of `batch` recomputed with the functional API (the trainer's model vs its frozen reference)."""
    model = trainer.model
    T = batch["completion_mask"].size(1)
    with torch.no_grad():
        prm = completion_logps(model, batch["input_ids"], batch["attention_mask"], T)
        ref = completion_logps(trainer.ref_model, batch["input_ids"], batch["attention_mask"], T)
    return F.implicit_prm_loss(
        prm,
        ref,
        batch["completion_mask"],
        batch["labels"],
        beta=trainer.beta,
        loss_type=loss_type,
        group_ids=batch["group_ids"],
    )


@pytest.mark.parametrize("loss_type", ["ce", "dpo", "kto", "nca"])
def test_each_loss_matches_functional_and_decreases(tiny_model_path, tmp_path, loss_type):
    torch.manual_seed(0)
    trainer = ImplicitPRMTrainer(
        model=tiny_model_path, args=_args(tmp_path, loss_type=loss_type), train_dataset=_dataset(loss_type == "kto")
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.eval()
    with torch.no_grad():
        loss0 = trainer.compute_loss(trainer.model, batch)
    expected = _batch_loss(trainer, batch, loss_type)
    torch.testing.assert_close(loss0, expected)
    start = {"ce": torch.log(torch.tensor(2.0)), "dpo": torch.log(torch.tensor(2.0)), "kto": torch.tensor(0.5)}
    if loss_type in start:  # PRM == reference at step 0: every reward is 0
        torch.testing.assert_close(loss0, start[loss_type])
    out = trainer.train()
    assert out.global_step == 8
    trainer.model.eval()
    with torch.no_grad():
        loss1 = trainer.compute_loss(trainer.model, batch)
    assert loss1.item() < loss0.item(), (loss_type, loss0.item(), loss1.item())
    logged = [h for h in trainer.state.log_history if "pair_accuracy" in h]
    assert logged and {"loss", "rewards/correct", "rewards/incorrect", "rewards/margin"} <= set(logged[-1])


def test_batches_hold_whole_prompt_groups_and_pairs_stay_within_prompts(tiny_model_path, tmp_path):
    trainer = ImplicitPRMTrainer(
        model=tiny_model_path,
        args=_args(tmp_path, loss_type="dpo", per_device_train_batch_size=8),
        train_dataset=_dataset(),
    )
    batches = list(trainer.get_train_dataloader())
    seen = []
    for b in batches:
        gids = b["group_ids"].tolist()
        assert len(b["labels"]) <= 8
        for g in set(gids):  # a prompt's 4 rows (2 correct, 2 incorrect) are all in this batch
            assert gids.count(g) == 4
            assert sorted(b["labels"][b["group_ids"] == g].tolist()) == [0.0, 0.0, 1.0, 1.0]
        seen += gids
    assert sorted(seen) == sorted([0, 1, 2] * 4)
    # pairs: only (correct, incorrect) inside one prompt -> hand-computed mean over 2 * 2 pairs per prompt
    batch = batches[0]
    assert len(set(batch["group_ids"].tolist())) == 2  # two prompts share this batch
    T = batch["completion_mask"].size(1)
    torch.manual_seed(1)
    prm_lp = torch.randn(len(batch["labels"]), T)
    ref_lp = torch.zeros_like(prm_lp)
    m = batch["completion_mask"].bool()
    r = 0.5 * (prm_lp * m).sum(-1)
    y, g = batch["labels"], batch["group_ids"]
    for lt in ("dpo", "nca"):
        terms = []
        for a in range(len(y)):
            for b in range(len(y)):
                if g[a] == g[b] and y[a] > y[b]:
                    if lt == "dpo":
                        terms.append(-torch.nn.functional.logsigmoid(r[a] - r[b]))
                    else:
                        terms.append(
                            -torch.nn.functional.logsigmoid(r[a])
                            - 0.5 * torch.nn.functional.logsigmoid(-r[a])
                            - 0.5 * torch.nn.functional.logsigmoid(-r[b])
                        )
        assert len(terms) == 2 * 4
        got = F.implicit_prm_loss(prm_lp, ref_lp, m, y, beta=0.5, loss_type=lt, group_ids=g)
        torch.testing.assert_close(got, torch.stack(terms).mean())
    # the trainer's loss on that batch uses the prompt groups
    trainer.model.eval()
    with torch.no_grad():
        _perturb_(trainer.model)
        got = trainer.compute_loss(trainer.model, batch)
    torch.testing.assert_close(got, _batch_loss(trainer, batch, "dpo"))


def _perturb_(model, scale=0.05):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_sampler_packs_groups_and_reshuffles_batch_order():
    gids = [0, 1, 2, 0, 1, 2, 3, 3, 3, 3, 3]  # group 3 is larger than the batch size
    s = PromptGroupBatchSampler(gids, 4, seed=0)
    batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(len(gids)))
    for b in batches:
        assert len(b) <= 4 or len({gids[i] for i in b}) == 1  # only a single oversized group exceeds the size
        for g in {gids[i] for i in b}:
            assert all(i in b for i, x in enumerate(gids) if x == g)
    assert len(s) == len(batches)
    orders = set()
    for e in range(6):
        s.set_epoch(e)
        orders.add(tuple(tuple(b) for b in s))
    assert len(orders) > 1 and all(sorted(map(sorted, o)) == sorted(map(sorted, batches)) for o in orders)


def test_collated_rows_match_implicit_prm_encode(tiny_model_path, tmp_path):
    trainer = ImplicitPRMTrainer(model=tiny_model_path, args=_args(tmp_path), train_dataset=_dataset(True))
    ds = _dataset(True)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    enc = trainer.prm.encode([ds[0]["prompt"]], [ds[0]["completion"]])
    torch.testing.assert_close(batch["input_ids"], enc["input_ids"])
    torch.testing.assert_close(batch["completion_mask"], enc["completion_mask"])


def test_saved_prm_reloads_and_scores_identically(tiny_model_path, tmp_path):
    trainer = ImplicitPRMTrainer(model=tiny_model_path, args=_args(tmp_path, max_steps=3), train_dataset=_dataset())
    trainer.train()
    out = tmp_path / "prm"
    trainer.save_model(str(out))
    loaded = ImplicitPRM.from_pretrained(str(out))
    assert loaded.reference == "model" and loaded.beta == 0.5
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    comps = [GOOD[1], BAD[1], GOOD[0]]
    before = trainer.prm.score(prompts, comps)
    after = loaded.score(prompts, comps)
    assert before == pytest.approx(after, abs=1e-6)
    assert any(abs(x) > 0 for x in after)  # trained: rewards moved away from 0
    assert best_of_n(loaded, [PROMPTS[1]], [[GOOD[1], BAD[1]]]) == best_of_n(
        trainer.prm, [PROMPTS[1]], [[GOOD[1], BAD[1]]]
    )


def test_peft_prm_saves_adapter_and_reloads(tiny_model_path, tmp_path):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = ImplicitPRMTrainer(
        model=tiny_model_path,
        args=_args(tmp_path, max_steps=2, learning_rate=1e-2),
        train_dataset=_dataset(),
        peft_config=cfg,
    )
    assert trainer.ref_model is None and trainer.prm.reference == "adapters_disabled"
    trainer.train()
    out = tmp_path / "prm_lora"
    trainer.save_model(str(out))
    loaded = ImplicitPRM.from_pretrained(str(out))
    prompts, comps = [PROMPTS[0], PROMPTS[2]], [GOOD[0], BAD[2]]
    assert trainer.prm.score(prompts, comps) == pytest.approx(loaded.score(prompts, comps), abs=1e-6)


class _FixedScores:
    def __init__(self, scores):
        self.scores, self.calls = scores, []

    def score(self, prompts, completions, **kw):
        self.calls.append((list(prompts), list(completions), kw))
        return list(self.scores)


def test_best_of_n_argmax_first_wins_ties():
    prm = _FixedScores([0.1, 0.7, 0.7, -1.0, float("nan"), -2.0, 3.0])
    idx = best_of_n(
        prm,
        ["p", "q", "r"],
        [["a", "b", "c"], ["d", "e", "f"], ["g"]],
        aggregation="mean",
        with_reference=False,
        delimiter="\n",
    )
    assert idx == [1, 0, 0]
    prompts, comps, kw = prm.calls[0]
    assert prompts == ["p"] * 3 + ["q"] * 3 + ["r"] and comps == list("abcdefg")
    assert kw["aggregation"] == "mean" and kw["with_reference"] is False and kw["delimiter"] == "\n"
    with pytest.raises(ValueError, match="candidates"):
        best_of_n(prm, ["p"], [[]])
    with pytest.raises(ValueError, match="prompts"):
        best_of_n(prm, ["p", "q"], [["a"]])


def test_best_of_n_with_real_prm_is_argmax_of_score(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m, ref = (
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
    )
    _perturb_(m)
    prm = ImplicitPRM(m, ref, beta=0.05, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path))
    cands = [GOOD[1], BAD[1], GOOD[0], GOOD[1]]
    scores = prm.score([PROMPTS[1]] * 4, cands)
    assert best_of_n(prm, [PROMPTS[1]], [cands]) == [max(range(4), key=lambda i: scores[i])]
    assert scores[0] == scores[3] and best_of_n(prm, [PROMPTS[1]], [cands])[0] != 3  # duplicate: first wins
    # an untrained PRM (== reference) scores every candidate 0: the first one wins
    same = ImplicitPRM(ref, AutoModelForCausalLM.from_pretrained(tiny_model_path), tokenizer=prm.tokenizer)
    assert best_of_n(same, [PROMPTS[1]], [cands]) == [0]


def test_min_aggregation_ignores_padded_steps(tiny_model_path):
    # padded steps hold 0: with positive real steps, a min over the padded row would wrongly return 0
    vals = torch.tensor([[0.3, 0.2, 0.0, 0.0], [0.5, 0.4, 0.6, 0.1]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(F.aggregate_step_rewards(vals, mask, how="min"), torch.tensor([0.2, 0.1]))
    # end to end: scoring a 1-step and a 3-step completion in one batch == scoring each alone
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m, ref = (
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
    )
    _perturb_(m)
    prm = ImplicitPRM(m, ref, beta=0.05, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path))
    comps = ["x + 4 = 9", "First, add.\n\nThen, divide by two.\n\nThe result is 3."]
    together = prm.score([PROMPTS[2]] * 2, comps, aggregation="min", batch_size=2)
    alone = [prm.score([PROMPTS[2]], [c], aggregation="min", batch_size=1)[0] for c in comps]
    assert together == pytest.approx(alone, abs=1e-6)
    enc = prm.encode([PROMPTS[2]], [comps[1]])
    vals, smask = prm.step_rewards(enc["input_ids"], enc["attention_mask"], enc["completion_mask"])
    assert smask.sum().item() == 3 and alone[1] == pytest.approx(vals[smask].min().item(), abs=1e-6)


def test_missing_label_column_raises(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="label"):
        ImplicitPRMTrainer(model=tiny_model_path, args=_args(tmp_path), train_dataset=_dataset(with_label=False))
    from datasets import Dataset

    bad = Dataset.from_dict({"prompt": ["a"], "completion": ["b"], "label": [2.0]})
    with pytest.raises(ValueError, match="'label'"):
        ImplicitPRMTrainer(model=tiny_model_path, args=_args(tmp_path), train_dataset=bad)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"loss_type": "ipo"}, "loss_type"),
        ({"beta": 0.0}, "beta"),
        ({"max_length": 16, "max_prompt_length": 16}, "max_prompt_length"),
        ({"loss_type": "dpo", "group_by_prompt": False}, "group_by_prompt"),
    ],
)
def test_config_validation_names_the_field(tmp_path, kw, field):
    with pytest.raises(ValueError, match=field):
        ImplicitPRMConfig(output_dir=str(tmp_path), report_to="none", **kw)


def test_pair_accuracy_metric_counts_only_prompts_with_a_pair(tiny_model_path, tmp_path):
    """A prompt whose completions are all right (or all wrong) has no ranking pair: it must not pull the logged
    pair accuracy towards 0.5. One perfectly ranked prompt + one all-wrong prompt -> 1.0 (not 0.75)."""
    from trl_prime.implicit_prm.trainer import pairable_group_rows

    labels = torch.tensor([1.0, 0.0, 0.0, 0.0, float("nan"), 1.0])
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    assert pairable_group_rows(labels, gids).tolist() == [True, True, False, False, False, False]
    trainer = ImplicitPRMTrainer(model=tiny_model_path, args=_args(tmp_path, loss_type="ce"), train_dataset=_dataset())
    trainer._metrics["train"].clear()
    trainer._record_metrics(torch.tensor([0.3, -0.2, 0.5, 0.1, 0.0, 0.2]), labels, gids, "train")
    assert trainer._metrics["train"]["pair_accuracy"] == [1.0]
    trainer._record_metrics(torch.tensor([0.3, 0.5]), torch.tensor([0.0, 0.0]), torch.tensor([0, 0]), "train")
    assert trainer._metrics["train"]["pair_accuracy"] == [1.0]  # no pair anywhere: nothing logged
