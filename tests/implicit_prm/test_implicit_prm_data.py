"""Implicit PRM data and best-of-N evaluation: the sampler, build_outcome_dataset, score_candidates, majority vote,
the metrics of trl-prime best-of-n (trl_prime/scripts/best_of_n.py) and the two scripts end to end on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from trl_prime import ImplicitPRM, ImplicitPRMConfig, ImplicitPRMTrainer
from trl_prime.implicit_prm.best_of_n import argmax_first, score_candidates
from trl_prime.implicit_prm.data import (
    build_outcome_dataset,
    last_turn_prompt,
    pairable_rows,
    question_prompt,
    sample_completions,
)


@pytest.fixture(scope="module")
def lm(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval(), AutoTokenizer.from_pretrained(tiny_model_path)


def test_sampler_near_greedy_matches_generate_and_is_seeded(lm):
    model, tok = lm
    prompts = ["What is 2 + 3?", [{"role": "user", "content": "Compute 7 * 6."}]]
    texts, trunc = sample_completions(model, tok, prompts, 2, max_new_tokens=6, temperature=1e-5, seed=0)
    # near-greedy: every sample equals HF greedy decoding of the same prompt (cache compaction, positions, EOS)
    for p, row, tr in zip(prompts, texts, trunc):
        ids = (
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            if not isinstance(p, str)
            else tok(p, add_special_tokens=False)["input_ids"]
        )
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        greedy = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
        assert row == [greedy, greedy]
        hit_eos = tok.eos_token_id in out[0, len(ids) :].tolist()
        assert tr == [not hit_eos] * 2
    a = sample_completions(model, tok, prompts, 3, max_new_tokens=8, temperature=1.0, seed=5, batch_size=4)
    b = sample_completions(model, tok, prompts, 3, max_new_tokens=8, temperature=1.0, seed=5, batch_size=4)
    c = sample_completions(model, tok, prompts, 3, max_new_tokens=8, temperature=1.0, seed=6, batch_size=4)
    assert a == b and a != c
    assert [len(x) for x in a[0]] == [3, 3]
    with pytest.raises(ValueError, match="temperature"):
        sample_completions(model, tok, prompts, 2, temperature=0.0)


def test_build_outcome_dataset_labels_drops_unscorable_and_counts(lm):
    from datasets import Dataset

    model, tok = lm
    problems = Dataset.from_dict(
        {
            "prompt": ["What is 2 + 3?", "Compute 7 * 6.", "Let x be 4."],
            "solution": ["5", "42", "8"],
            "id": ["p0", "p1", "p2"],
        }
    )
    seen = {}

    def reward(prompts, completions, solution, id, **kw):
        seen.update(n=len(completions), solution=list(solution))
        # prompt p1 is unscorable; otherwise 1.0 when the completion has an even length, else 0.0
        return [None if i == "p1" else float(len(c) % 2 == 0) for c, i in zip(completions, id)]

    data, stats = build_outcome_dataset(
        model,
        problems,
        reward_func=reward,
        num_generations=4,
        max_new_tokens=5,
        temperature=1.0,
        seed=0,
        tokenizer=tok,
        return_stats=True,
    )
    assert seen["n"] == 12 and seen["solution"] == ["5"] * 4 + ["42"] * 4 + ["8"] * 4
    assert set(data.column_names) == {"prompt", "completion", "label", "prompt_id", "reason", "truncated", "source_id"}
    assert len(data) == 8 and stats["n_unscored"] == 4 and stats["n_rows"] == 8 and stats["n_completions"] == 12
    assert data["prompt_id"] == [0] * 4 + [2] * 4 and data["source_id"] == ["p0"] * 4 + ["p2"] * 4
    assert data["label"] == [float(len(c) % 2 == 0) for c in data["completion"]]
    assert data["reason"] == ["correct" if y == 1.0 else "wrong" for y in data["label"]]
    assert stats["reasons"]["unscored"] == 4
    assert stats["mean_label"] == pytest.approx(sum(data["label"]) / 8)
    mixed = sum(1 for p in (0, 2) if len({y for y, i in zip(data["label"], data["prompt_id"]) if i == p}) == 2)
    assert stats["n_mixed_prompts"] == mixed
    # the same seed gives the same data; a conversational prompt gets a conversational completion
    again = build_outcome_dataset(
        model,
        problems,
        reward_func=reward,
        num_generations=4,
        max_new_tokens=5,
        temperature=1.0,
        seed=0,
        tokenizer=tok,
    )
    assert again["completion"] == data["completion"]
    conv = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 2 + 3?"}]], "solution": ["5"]})
    d2 = build_outcome_dataset(
        model,
        conv,
        reward_func=lambda completions, **kw: [0.5] * len(completions),
        num_generations=2,
        max_new_tokens=3,
        tokenizer=tok,
    )
    assert d2[0]["completion"][0]["role"] == "assistant" and d2["label"] == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        build_outcome_dataset(
            model,
            conv,
            reward_func=lambda completions, **kw: [2.0] * len(completions),
            num_generations=1,
            max_new_tokens=2,
            tokenizer=tok,
        )
    with pytest.raises(ValueError, match="no column 'question'"):
        build_outcome_dataset(model, conv, prompt_column="question", tokenizer=tok)


def test_two_calls_train_a_prm_on_built_data(lm, tiny_model_path, tmp_path):
    from datasets import Dataset

    model, tok = lm
    problems = Dataset.from_dict({"prompt": ["What is 2 + 3?", "Compute 7 * 6."], "solution": ["5", "42"]})
    data = build_outcome_dataset(
        model,
        problems,
        num_generations=4,
        max_new_tokens=6,
        tokenizer=tok,
        seed=1,
        reward_func=lambda completions, **kw: [float("a" in c) for c in completions],
    )
    trainer = ImplicitPRMTrainer(
        model=tiny_model_path,
        train_dataset=data,
        args=ImplicitPRMConfig(
            output_dir=str(tmp_path),
            max_steps=2,
            per_device_train_batch_size=8,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            learning_rate=1e-2,
        ),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "prm"))
    prm = ImplicitPRM.from_pretrained(str(tmp_path / "prm"))
    s = prm.score(list(data["prompt"][:2]), list(data["completion"][:2]))
    assert s == pytest.approx(trainer.prm.score(list(data["prompt"][:2]), list(data["completion"][:2])), abs=1e-6)


@pytest.fixture(scope="module")
def two_model_prm(tiny_model_path, tiny_llama_path):
    """PRM = tiny Qwen2, reference = tiny Llama (same tokenizer): every token reward differs from 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return ImplicitPRM(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        AutoModelForCausalLM.from_pretrained(tiny_llama_path),
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
        beta=0.05,
    )


@pytest.mark.parametrize("conversational", [False, True])
def test_score_candidates_equals_prm_score_for_every_variant(two_model_prm, conversational):
    prompt = "Compute 7 * 6." if not conversational else [{"role": "user", "content": "Compute 7 * 6."}]
    comps = ["7 * 6 = 42.\n\nSo the answer is \\boxed{42}.", "x", "First, add.\n\nThen 40.\n\nDone \\boxed{40}."]
    out, lp, ref = score_candidates(
        two_model_prm, prompt, comps, with_reference=(True, False), batch_size=2, return_logps=True
    )
    for how in ("min", "mean", "sum", "last"):
        want = two_model_prm.score([prompt] * 3, comps, aggregation=how)
        assert out[how] == pytest.approx(want, abs=1e-5), how
        want = two_model_prm.score([prompt] * 3, comps, aggregation=how, with_reference=False)
        assert out[f"{how}/noref"] == pytest.approx(want, abs=1e-5), how
    # reference log-probs reused from elsewhere give the same scores, without a reference forward
    again = score_candidates(two_model_prm, prompt, comps, ref_logps=torch.nn.functional.pad(ref, (0, 3)))
    assert again["min"] == pytest.approx(out["min"], abs=1e-6)
    assert len(set(out["min"])) == 3
    same = score_candidates(two_model_prm, prompt, comps, same_weights=True)
    assert same["min"] == [0.0, 0.0, 0.0]


def test_last_turn_prompt_and_argmax_first():
    conv = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    assert last_turn_prompt(conv) == [conv[0], conv[3]]
    assert last_turn_prompt("plain") == "plain"
    assert question_prompt(conv) == "q2" and question_prompt("plain") == "plain"
    assert argmax_first([0.1, 0.3, 0.3, -1.0]) == 1
    assert argmax_first([float("nan"), -5.0]) == 1
    assert argmax_first([0.0, 0.0]) == 0


def test_majority_vote_normalises_answers_and_breaks_ties_by_first_seen():
    from trl_prime.scripts.best_of_n import majority_index, normalize_answer

    assert normalize_answer("-2.0") == normalize_answer("-2") == normalize_answer("$-2$") == "-2"
    assert normalize_answer("\\frac{1}{2}") == normalize_answer("0.5") == "1/2"
    assert normalize_answer("1,000") == "1000" and normalize_answer(None) is None
    assert majority_index(["3", "4", "4.0", None, "3"]) == 0  # "3" and "4" tie (2 each): "3" is seen first
    assert majority_index(["3", "4", "4.0", None]) == 1
    assert majority_index([None, None]) == 0
    assert majority_index([None, "7", "5", "5"]) == 2


def test_best_of_n_metrics_hand_computed():
    from trl_prime.scripts.best_of_n import best_of_n_metrics

    records = [
        {"rewards": [0.0, 1.0, 0.0, 1.0], "answers": ["1", "2", "1", "2"]},  # majority tie 1/2 -> "1" (first): wrong
        {"rewards": [1.0, 0.0, 0.0, 0.0], "answers": ["5", "6", "6", None]},  # majority "6": wrong
        {"rewards": [0.0, 0.0, None, 0.0], "answers": [None, "3", "3", "4"]},  # never correct
    ]
    scores = {"prm": {"min": [[0.1, 0.5, 0.2, 0.5], [0.0, 0.3, 0.3, 0.3], [0.0, 0.0, 0.0, 0.0]]}}
    m = best_of_n_metrics(records, [2, 4], scores)
    assert m[2]["first"] == pytest.approx(1 / 3) and m[4]["first"] == pytest.approx(1 / 3)
    assert m[2]["oracle"] == pytest.approx(2 / 3) and m[4]["oracle"] == pytest.approx(2 / 3)
    # N=2: problem 0 answers ["1","2"] tie -> "1" wrong; problem 1 ["5","6"] tie -> "5" right
    assert m[2]["majority"] == pytest.approx(1 / 3)
    assert m[4]["majority"] == pytest.approx(0.0)
    # N=2: argmax picks index 1 (right), index 1 (wrong), index 0 (wrong); N=4: index 1 (first of the ties) etc.
    assert m[2]["bon/prm/min"] == pytest.approx(1 / 3) and m[4]["bon/prm/min"] == pytest.approx(1 / 3)
    assert m[4]["mean_sample"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)


def test_best_of_n_picks_counts_reasons_and_lengths():
    from trl_prime.scripts.best_of_n import best_of_n_picks, score_by_reason

    records = [
        {
            "answers": ["1", "2", "2", None],
            "reasons": ["wrong", "correct", "correct", "no_answer"],
            "completions": ["a = \\boxed{1}", "a = \\boxed{2}", "b = \\boxed{2}", "a ="],
        },
        {
            "answers": [None, "7", "5", "5"],
            "reasons": ["no_answer", "wrong", "correct", "correct"],
            "completions": ["x", "7 = \\boxed{7}", "\\boxed{5}", "5 \\boxed{5}"],
        },
    ]
    # the PRM prefers the short answer-less completion of problem 0 at N=4, the first "5" of problem 1
    scores = {"prm": {"min": [[0.0, 0.1, 0.1, 0.9], [0.2, 0.0, 0.5, 0.5]]}}
    picks = best_of_n_picks(records, [2, 4], scores)
    assert picks[4]["first"] == {"wrong": 1, "no_answer": 1, "mean_chars": (13 + 1) / 2}
    assert picks[4]["majority"] == {"correct": 2, "mean_chars": (13 + 9) / 2}  # "2" (index 1), "5" (index 2)
    assert picks[4]["bon/prm/min"] == {"no_answer": 1, "correct": 1, "mean_chars": (3 + 9) / 2}
    assert picks[2]["bon/prm/min"] == {"correct": 1, "no_answer": 1, "mean_chars": (13 + 1) / 2}  # index 1, index 0
    # N=2: "1" and "2" tie once each in problem 0 -> the answer seen first (index 0, wrong); problem 1: "7" (index 1)
    assert picks[2]["majority"] == {"wrong": 2, "mean_chars": (13 + 13) / 2}
    means = score_by_reason(records, scores)
    assert means == {"prm/min": {"correct": pytest.approx(1.2 / 4), "no_answer": pytest.approx(1.1 / 2), "wrong": 0.0}}


def test_evaluate_best_of_n_script_caches_samples_and_scores(two_model_prm, tiny_model_path, tmp_path):
    from trl_prime.scripts import best_of_n as ebn

    calls = []

    def generate(prompts, n):
        calls.append(len(prompts))
        texts = [[f"{k} + 1 = {k + 1}.\n\nThe final answer is \\boxed{{{k % 3}}}." for k in range(n)] for _ in prompts]
        return texts, [[False] * n for _ in prompts]

    args = ebn.BestOfNArguments(
        model_name_or_path=tiny_model_path,
        prm_paths=["initial", "pair"],
        max_problems=2,
        num_samples=4,
        ns=[1, 2, 4],
        aggregations=["min", "last"],
        prm_prompt="last_turn",
        prm_batch_size=3,
        samples_file=str(tmp_path / "s.jsonl"),
        output_file=str(tmp_path / "bon.json"),
        reuse_initial_reference=False,
    )
    res = ebn.main(args, generate_fn=generate, prms={"pair": two_model_prm})
    assert calls == [2]
    assert res["n_problems"] == 2 and set(res["metrics"]) == {"1", "2", "4"}
    saved = json.loads((tmp_path / "bon.json").read_text())
    assert saved["metrics"] == res["metrics"] and set(saved["picks"]) == {"1", "2", "4"}
    for n, methods in saved[
        "picks"
    ].items():  # a method's accuracy is the share of its picks the verifier called right
        for method, picked in methods.items():
            assert picked.get("correct", 0) / 2 == pytest.approx(saved["metrics"][n][method]), (n, method)
    assert set(saved["score_by_reason"]) >= {"initial/min", "pair/min"}
    for n in ("1", "2", "4"):
        m = res["metrics"][n]
        # the untrained PRM with its reference scores every candidate 0: best-of-N = the first sample
        assert m["bon/initial/min"] == m["bon/initial/last"] == m["first"]
        assert 0.0 <= m["bon/pair/min"] <= m["oracle"]
    # reused: no new sampling, and the PRM scores come from the cache
    res2 = ebn.main(args, generate_fn=generate, prms={})
    assert calls == [2] and res2["metrics"] == res["metrics"]
    # the cached scores are the PRM's own scores of the cached completions
    rec = [json.loads(line) for line in open(tmp_path / "s.jsonl")][1:]
    cache = json.loads((tmp_path / "bon.scores.pair.json").read_text())["scores"]
    p0 = last_turn_prompt(rec[0]["prompt"])
    comps = [[{"role": "assistant", "content": c}] for c in rec[0]["completions"]]
    assert cache["min"][0] == pytest.approx(two_model_prm.score([p0] * 4, comps, aggregation="min"), abs=1e-5)
    with pytest.raises(ValueError, match="--ns"):
        ebn.main(ebn.BestOfNArguments(ns=[8], num_samples=4))


@pytest.mark.parametrize("prm_prompt", ["last_turn", "question"])
def test_implicit_prm_recipe_end_to_end(tiny_model_path, tmp_path, prm_prompt):
    from trl import ModelConfig

    from trl_prime.scripts import implicit_prm as recipe

    script = recipe.ImplicitPRMScriptArguments(
        max_train_samples=2,
        num_generations=2,
        max_new_tokens=4,
        rollouts_path=str(tmp_path / "r.jsonl"),
        prm_prompt=prm_prompt,
        generation_batch_size=4,
    )
    targs = ImplicitPRMConfig(
        output_dir=str(tmp_path / "prm"),
        max_steps=1,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = recipe.main(script, targs, ModelConfig(model_name_or_path=tiny_model_path))
    rows = [json.loads(line) for line in open(tmp_path / "r.jsonl")]
    stats = json.loads((tmp_path / "r.stats.json").read_text())
    assert len(rows) == stats["n_rows"] == 4 - stats["n_unscored"]
    assert {r["reason"] for r in rows} <= {"correct", "wrong", "no_answer", "timeout"}
    assert trainer.state.global_step == 1
    prm = ImplicitPRM.from_pretrained(str(tmp_path / "prm"))
    assert prm.reference == "model"
    first = trainer.train_dataset[0]  # the PRM was trained on the shortened prompt
    want = (question_prompt if prm_prompt == "question" else last_turn_prompt)(rows[0]["prompt"])
    comp = rows[0]["completion"] if not isinstance(want, str) else rows[0]["completion"][-1]["content"]
    from trl_prime.implicit_prm.model import tokenize_prompt_completion

    assert first["prompt_ids"] == tokenize_prompt_completion(want, comp, trainer.processing_class)["prompt_ids"]
    # the rollouts are reused only with the settings they were sampled with
    assert stats["settings"]["num_generations"] == 2 and stats["settings"]["model"] == tiny_model_path
    (tmp_path / "r.jsonl").write_text((tmp_path / "r.jsonl").read_text().splitlines()[0] + "\n")  # mark the cache
    assert len(recipe.rollouts(script, tiny_model_path)) == 1  # same settings: the cached file
    script.num_generations = 3
    assert (
        len(recipe.rollouts(script, tiny_model_path))
        == 6 - json.loads((tmp_path / "r.stats.json").read_text())["n_unscored"]
    )  # other settings: sampled again


def test_trainable_layers_trains_only_the_top_blocks(tiny_model_path, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    data = Dataset.from_dict(
        {"prompt": ["What is 2 + 3?"] * 4, "completion": ["5", "6", "5.", "7"], "label": [1.0, 0.0, 1.0, 0.0]}
    )
    trainer = ImplicitPRMTrainer(
        model=tiny_model_path,
        train_dataset=data,
        args=ImplicitPRMConfig(
            output_dir=str(tmp_path),
            max_steps=2,
            per_device_train_batch_size=4,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            learning_rate=1e-2,
            trainable_layers=1,
            beta=0.5,
        ),
    )
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.1.", "model.norm.")) for n in trainable)
    trainer.train()
    init = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    now = trainer.model.state_dict()
    assert all(torch.equal(now[k], init[k]) for k in init if not k.startswith(("model.layers.1.", "model.norm.")))
    assert any(not torch.equal(now[k], init[k]) for k in init if k.startswith("model.layers.1."))
    with pytest.raises(ValueError, match="trainable_layers"):
        ImplicitPRMConfig(output_dir=str(tmp_path), trainable_layers=0)


def test_pairable_rows_keeps_prompts_with_both_labels():
    from datasets import Dataset

    d = Dataset.from_dict(
        {
            "prompt": ["a", "b", "a", "c", "b", "c", "d", "d"],
            "completion": list("12345678"),
            "label": [1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.75],
        }
    )
    out = pairable_rows(d)
    assert out["completion"] == ["1", "3", "7", "8"]  # "b": all correct; "c": 0.5 is neither side


def test_script_options_are_checked_against_one_tuple_each():
    """``reward``, ``prm_prompt`` and best-of-N's ``aggregations`` are checked with ``check_choice`` against one
    public tuple each (the scripts' :data:`~trl_prime.scripts.utils.REWARDS` / ``PRM_PROMPTS``, and
    :data:`trl_prime.functional.STEP_AGGREGATIONS`); the message names the field and the choices."""
    from trl_prime import functional as F
    from trl_prime.scripts import best_of_n as ebn
    from trl_prime.scripts import implicit_prm as recipe
    from trl_prime.scripts.utils import PRM_PROMPTS, REWARDS, RL_REWARDS, RLScriptArguments

    assert PRM_PROMPTS == ("full", "last_turn", "question") and REWARDS == ("outcome", "math")
    assert RL_REWARDS == ("outcome", "math", "none")  # the RL scripts: or only reward_funcs / a reward model
    assert F.STEP_AGGREGATIONS == ("min", "mean", "sum", "last")
    with pytest.raises(ValueError, match=r"prm_prompt='turn' is not supported; choose one of 'full', 'last_turn', "):
        recipe.ImplicitPRMScriptArguments(prm_prompt="turn")
    with pytest.raises(ValueError, match=r"reward='code' is not supported; choose one of 'outcome', 'math'\."):
        recipe.ImplicitPRMScriptArguments(reward="code")
    with pytest.raises(ValueError, match=r"reward='code' is not supported; choose one of 'outcome', 'math', 'none'\."):
        RLScriptArguments(reward="code")
    ebn.BestOfNArguments(aggregations=list(F.STEP_AGGREGATIONS), prm_prompt="question").validate()
    with pytest.raises(ValueError, match=r"--aggregations='max' is not supported; choose one of 'min', 'mean'"):
        ebn.BestOfNArguments(aggregations=["min", "max"]).validate()
    with pytest.raises(ValueError, match=r"--prm_prompt='turn' is not supported; choose one of 'full'"):
        ebn.BestOfNArguments(prm_prompt="turn").validate()


def test_best_of_n_refuses_a_prm_folder_that_is_not_there(tmp_path, monkeypatch):
    """Evaluating before training: the message names --prm_paths, the folder and the command that writes it."""
    from trl_prime.scripts import best_of_n as ebn

    monkeypatch.chdir(tmp_path)
    args = ebn.BestOfNArguments(prm_paths=["initial", "outputs/implicit_prm/prm_ce"])  # a folder not made here
    with pytest.raises(
        ValueError, match=r"--prm_paths: outputs/implicit_prm/prm_ce does not exist.*trl-prime implicit-prm"
    ):
        args.validate()
    ebn.BestOfNArguments(prm_paths=["initial", "org/hub-prm"]).validate()  # a Hub id is left to transformers
    from trl_prime.cli import CommandLineError

    with pytest.raises(CommandLineError, match="--prm_paths: outputs/implicit_prm/prm_ce does not exist"):
        ebn.run(["--prm_paths", "initial", "outputs/implicit_prm/prm_ce"])  # `trl-prime` prints it, exits 2
