"""Tests of trl_prime.data: embedded reasoning-gym problems, Eurus-2-RL-Data files, bad input, routing rewards."""

from __future__ import annotations

import json
import re
import warnings

import pytest


pytest.importorskip("reasoning_gym")

from trl_prime import data as D  # noqa: E402
from trl_prime.data import (  # noqa: E402
    COLUMNS,
    load_prompt_dataset,
    load_reasoning_gym,
    make_routed_reward,
    normalize_rows,
    route_of,
)


def _questions(ds):
    return [p[-1]["content"] for p in ds["prompt"]]


# ----------------------------------------------------------------------------------------------- embedded problems


def test_embedded_arithmetic_columns_and_format():
    ds = load_prompt_dataset("embedded:arithmetic", "train", size=40)
    assert ds.column_names == list(COLUMNS)
    assert len(ds) == 40
    assert ds.features == D.FEATURES
    for row in ds:
        assert row["ability"] == "math" and row["data_source"] == "reasoning_gym/basic_arithmetic"
        assert row["tests"] is None
        shot_q, shot_a, msg = row["prompt"]  # the demo preset is one-shot
        assert (shot_q["role"], shot_a["role"], msg["role"]) == ("user", "assistant", "user")
        assert shot_a["content"].endswith("}.") and "\\boxed{" in shot_a["content"]
        assert msg["content"].endswith(D.BOXED_INSTRUCTION)
        # the demo's difficulty: two operands of 1-2 digits (0..100 in reasoning-gym's simple mode), + - *
        m = re.fullmatch(r"Calculate (\d+) ([-+*]) (\d+)\.\n\n.*", msg["content"], re.S)
        assert m, msg["content"]
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert 0 <= a <= 100 and 0 <= b <= 100
        assert int(row["solution"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert len(set(ds["id"])) == 40
    assert len({json.dumps(p[:2]) for p in ds["prompt"]}) == 1  # the same example for every row
    assert ds["prompt"][0][0]["content"] not in _questions(ds)


def test_few_shot_examples():
    zero = load_reasoning_gym("basic_arithmetic", size=5, task_configs={"basic_arithmetic": D.DEMO_ARITHMETIC})
    assert all(len(p) == 1 for p in zero["prompt"])
    two = load_reasoning_gym(
        "basic_arithmetic", size=5, few_shot=2, split="test", task_configs={"basic_arithmetic": D.DEMO_ARITHMETIC}
    )
    assert [m["role"] for m in two["prompt"][0]] == ["user", "assistant", "user", "assistant", "user"]
    assert _questions(zero) != _questions(two)  # different splits
    # the examples come from the train side of the question space: never a test question
    test = load_reasoning_gym(
        "basic_arithmetic", size=400, split="test", task_configs={"basic_arithmetic": D.DEMO_ARITHMETIC}
    )
    assert not {two["prompt"][0][0]["content"], two["prompt"][0][2]["content"]} & set(_questions(test))
    for shot in (two["prompt"][0][1]["content"], two["prompt"][0][3]["content"]):
        m = re.fullmatch(r"(\d+) ([-+*]) (\d+) = (-?\d+)\. The final answer is \\boxed\{(-?\d+)\}\.", shot)
        assert m and m.group(4) == m.group(5), shot
        assert m.group(4) not in (m.group(1), m.group(3))  # no degenerate example such as 0 * 7 = 0
    gsm = load_prompt_dataset("embedded:gsm_symbolic", "test", size=2)
    cot = gsm["prompt"][0][1]["content"]
    assert "####" not in cot and cot.splitlines()[-1].startswith("The final answer is \\boxed{")
    with pytest.raises(ValueError, match="few_shot"):
        load_reasoning_gym("basic_arithmetic", size=2, few_shot=-1)


def test_embedded_is_deterministic_and_seeded():
    a = load_prompt_dataset("embedded:arithmetic", "train", size=30, seed=3)
    b = load_prompt_dataset("embedded:arithmetic", "train", size=30, seed=3)
    c = load_prompt_dataset("embedded:arithmetic", "train", size=30, seed=4)
    assert a.to_list() == b.to_list()
    assert _questions(a) != _questions(c)
    # a smaller load is a prefix of a larger one (the same rows keep the same ids)
    small = load_prompt_dataset("embedded:arithmetic", "train", size=10, seed=3)
    assert small.to_list() == a.select(range(10)).to_list()


def test_heldout_split_never_overlaps_train():
    train = load_reasoning_gym(
        "basic_arithmetic", size=1500, seed=0, split="train", task_configs={"basic_arithmetic": D.DEMO_ARITHMETIC}
    )
    for seed in (0, 1):  # whatever the test seed
        test = load_reasoning_gym(
            "basic_arithmetic", size=150, seed=seed, split="test", task_configs={"basic_arithmetic": D.DEMO_ARITHMETIC}
        )
        assert len(test) == 150
        assert not set(_questions(train)) & set(_questions(test))
        assert len(set(_questions(test))) == 150  # no duplicates within a split
    assert len(set(_questions(train))) == 1500
    assert all("/test/" in i for i in test["id"]) and all("/train/" in i for i in train["id"])


def test_mixed_tasks_interleaved_with_gold_answers():
    ds = load_prompt_dataset("embedded:mixed", "test", size=7)
    assert len(ds) == 7
    assert ds["data_source"][:3] == [
        "reasoning_gym/basic_arithmetic",
        "reasoning_gym/chain_sum",
        "reasoning_gym/gsm_symbolic",
    ]
    assert sorted(set(ds["data_source"])) == [
        "reasoning_gym/basic_arithmetic",
        "reasoning_gym/chain_sum",
        "reasoning_gym/gsm_symbolic",
    ]
    assert all(s.strip() for s in ds["solution"])


def test_gold_answers_are_what_math_reward_accepts():
    from trl_prime.rewards import math_reward

    ds = load_prompt_dataset("embedded:mixed", "train", size=12)
    right = math_reward([f"So the answer is \\boxed{{{s}}}." for s in ds["solution"]], solution=ds["solution"])
    wrong = math_reward([f"\\boxed{{{s}1}}" for s in ds["solution"]], solution=ds["solution"])
    assert right == [1.0] * 12
    assert wrong == [0.0] * 12


def test_difficulty_is_configurable():
    cfg = {
        "basic_arithmetic": {
            "min_terms": 3,
            "max_terms": 3,
            "min_digits": 3,
            "max_digits": 3,
            "operators": ("+",),
            "allow_parentheses": False,
        }
    }
    ds = load_reasoning_gym("basic_arithmetic", size=5, task_configs=cfg)
    for q, s in zip(_questions(ds), ds["solution"]):
        nums = [int(x) for x in re.findall(r"\d+", q.split("\n")[0])]
        assert len(nums) == 3 and sum(nums) == int(s)
    chain = load_prompt_dataset("embedded:chain_sum", "train", size=5)
    assert all("arithmetic problem" in q for q in _questions(chain))


def test_inexact_division_gold_is_rejected():
    assert D._exact_value("( -9 / 9 )") == -1
    assert D._exact_value("-( 3 + 4 ) * 2") == -14
    assert D._exact_value("7 / 2") == D.Fraction(7, 2)
    assert D._exact_value("__import__('os')") is None
    assert D._gold_is_exact({"answer": "3", "metadata": {"expression": "7 / 2"}}) is False
    assert D._gold_is_exact({"answer": "-1", "metadata": {"expression": "( -9 / 9 )"}}) is True
    assert D._gold_is_exact({"answer": "12", "metadata": {}}) is True
    # reasoning-gym's defaults include division: every generated row is exact
    ds = load_reasoning_gym("basic_arithmetic", size=60, seed=5)
    for q, s in zip(_questions(ds), ds["solution"]):
        expr = q.split("\n")[0][len("Calculate ") :].rstrip(".")
        assert D._exact_value(expr) == int(s), q


def test_small_question_space_warns_and_returns_fewer():
    cfg = {
        "basic_arithmetic": {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ("+",),
            "allow_parentheses": False,
        }
    }
    with pytest.warns(UserWarning, match="question space is too small"):
        ds = load_reasoning_gym("basic_arithmetic", size=60, split="test", task_configs=cfg)
    assert 0 < len(ds) < 60
    assert len(set(_questions(ds))) == len(ds)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tasks=("no_such_task",)), "unknown reasoning-gym task"),
        (dict(split="validation"), "split must be"),
        (dict(size=0), "size must be"),
        (dict(tasks=()), "tasks is empty"),
        (dict(task_configs={"chain_sum": {}}), "not in tasks"),
        (dict(task_configs={"basic_arithmetic": {"min_terms": 0}}), "rejected task_configs"),
        (dict(task_configs={"basic_arithmetic": {"no_such_field": 1}}), "rejected task_configs"),
    ],
)
def test_reasoning_gym_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_reasoning_gym(**{"size": 5, **kwargs})


def test_unknown_embedded_name():
    with pytest.raises(ValueError, match="embedded:arithmetic"):
        load_prompt_dataset("embedded:nope")


# ----------------------------------------------------------------------------------------------- Eurus-2-RL-Data files

MATH_PROMPT = [
    {"role": "system", "content": "When tackling complex reasoning tasks, ..."},
    {"role": "user", "content": "Compute 1/2 + 1/4.\n\nPresent the answer in LaTex format: \\boxed{Your answer}"},
]
CODE_TESTS = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
CODE_PROMPT = [
    {
        "role": "user",
        "content": "Read two integers and print their sum.\n\nWrite Python code to solve "
        "the problem. Present the code in \n```python\nYour code\n```\nat the end.",
    }
]


def _eurus_rows():
    return [
        {
            "data_source": "numina_olympiads",
            "prompt": MATH_PROMPT,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"},
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "data_source": "taco",
            "prompt": CODE_PROMPT,
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(CODE_TESTS)},
            "extra_info": {"split": "train", "index": 1},
        },
        {
            "data_source": "numina_cn_k12",
            "prompt": [{"role": "user", "content": "What is 6 * 7?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"split": "train", "index": 2},
        },
    ]


def _write_jsonl(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def _check_eurus(ds):
    assert ds.column_names == list(COLUMNS)
    assert ds["ability"] == ["math", "code", "math"]
    assert ds["data_source"] == ["numina_olympiads", "taco", "numina_cn_k12"]
    assert ds["solution"] == ["\\frac{3}{4}", None, "42"]
    assert ds["tests"][0] is None and json.loads(ds["tests"][1]) == CODE_TESTS
    assert ds["prompt"][0] == MATH_PROMPT  # the system message is kept
    assert ds["id"] == ["numina_olympiads/0", "taco/1", "numina_cn_k12/2"]


def test_load_eurus_jsonl_json_parquet(tmp_path):
    from datasets import Dataset

    _check_eurus(load_prompt_dataset(_write_jsonl(tmp_path / "eurus.jsonl", _eurus_rows())))
    (tmp_path / "eurus.json").write_text(json.dumps(_eurus_rows()))
    _check_eurus(load_prompt_dataset(str(tmp_path / "eurus.json")))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": _eurus_rows()}))
    _check_eurus(load_prompt_dataset(str(tmp_path / "wrapped.json")))
    Dataset.from_list(_eurus_rows()).to_parquet(str(tmp_path / "eurus.parquet"))
    _check_eurus(load_prompt_dataset(str(tmp_path / "eurus.parquet")))
    assert len(load_prompt_dataset(str(tmp_path / "eurus.parquet"), size=2)) == 2


def test_load_folder_by_split(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", _eurus_rows())
    _write_jsonl(folder / "validation.jsonl", _eurus_rows()[:1])
    assert len(load_prompt_dataset(str(folder), "train")) == 3
    assert len(load_prompt_dataset(str(folder), "test")) == 1  # test falls back to validation
    (folder / "validation.jsonl").unlink()
    with pytest.raises(ValueError, match="no file for split 'test'"):
        load_prompt_dataset(str(folder), "test")


def test_simple_rows_are_accepted(tmp_path):
    rows = [
        {"prompt": "What is 2 + 2?", "answer": 4, "data_source": "gsm8k"},  # ability from the source
        {"prompt": "Print hi.", "ability": "CODE", "tests": {"stdin_stdout": [{"input": "", "output": "hi"}]}},
        {"prompt": "2 * 3?", "solution": "6", "ability": "math", "id": "custom-7"},
    ]
    ds = load_prompt_dataset(_write_jsonl(tmp_path / "simple.jsonl", rows))
    assert ds["prompt"][0] == [{"role": "user", "content": "What is 2 + 2?"}]
    assert ds["ability"] == ["math", "code", "math"]
    assert ds["solution"] == ["4", None, "6"]
    assert json.loads(ds["tests"][1]) == rows[1]["tests"]
    assert ds["id"][0] == "simple/train/0" and ds["id"][2] == "custom-7"
    assert ds["data_source"][1] == "simple"  # the file name when the row has none

    q = [{"question": "What is 3 + 3?", "solution": "6", "ability": "math"}]
    ds = load_prompt_dataset(_write_jsonl(tmp_path / "q.jsonl", q), prompt_column="question")
    assert ds["prompt"][0][0]["content"] == "What is 3 + 3?"


def test_malformed_rows_are_dropped_with_counts(tmp_path):
    rows = _eurus_rows() * 3 + [
        {"data_source": "numina_olympiads", "prompt": [], "ability": "math", "reward_model": {"ground_truth": "1"}},
        {
            "data_source": "numina_olympiads",
            "prompt": [{"role": "user", "content": "  "}],
            "ability": "math",
            "reward_model": {"ground_truth": "1"},
        },
        {"data_source": "numina_olympiads", "prompt": "Q?", "ability": "math", "reward_model": {"ground_truth": ""}},
        {"data_source": "taco", "prompt": "Q?", "ability": "code", "reward_model": {"ground_truth": "not json"}},
        {"data_source": "mystery", "prompt": "Q?", "reward_model": {"ground_truth": "1"}},
        {"data_source": "numina_olympiads", "prompt": 17, "ability": "math", "reward_model": {"ground_truth": "1"}},
    ]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows, extra_lines=['{"truncated": '])
    with pytest.warns(UserWarning, match=r"dropped 7 of 16 malformed rows") as record:
        ds, report = load_prompt_dataset(path, return_report=True)
    assert len(ds) == 9
    assert report.total == 16 and report.kept == 9
    assert report.dropped == {
        "empty_prompt": 2,
        "missing_gold": 1,
        "bad_tests": 1,
        "unknown_ability": 1,
        "bad_prompt": 1,
        "bad_json": 1,
    }
    assert report.examples["empty_prompt"] == [9, 10]
    assert "empty_prompt=2 (rows 9, 10)" in str(record[0].message)

    with pytest.raises(ValueError, match=r"row 9 is malformed \(empty_prompt\).*on_bad_rows='drop'"):
        load_prompt_dataset(path, on_bad_rows="error")
    with pytest.raises(ValueError, match="more than max_bad_fraction"):
        load_prompt_dataset(path, max_bad_fraction=0.25)


def test_dataset_level_errors_name_the_column_and_fix(tmp_path):
    with pytest.raises(ValueError, match=r"no prompt column 'prompt'.*prompt_column='question'"):
        load_prompt_dataset(_write_jsonl(tmp_path / "a.jsonl", [{"question": "Q?", "solution": "1"}]))
    with pytest.raises(ValueError, match=r"no prompt column 'prompt'.*add a 'prompt' column"):
        load_prompt_dataset(_write_jsonl(tmp_path / "b.jsonl", [{"text": "Q?", "solution": "1"}]))
    with pytest.raises(ValueError, match=r"no gold-answer column.*reward_model"):
        load_prompt_dataset(_write_jsonl(tmp_path / "c.jsonl", [{"prompt": "Q?", "ability": "math"}]))
    with pytest.raises(ValueError, match="none of the 2 rows is usable"):
        load_prompt_dataset(
            _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "", "solution": "1", "ability": "math"}] * 2)
        )
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_prompt_dataset(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="no such file"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("prompt,solution\nQ,1\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_prompt_dataset(str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="on_bad_rows"):
        normalize_rows([{"prompt": "Q", "solution": "1"}], source="s", on_bad_rows="ignore")


def test_hub_name_that_cannot_load_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not load 'no-such-org/no-such-dataset'"):
        load_prompt_dataset("no-such-org/no-such-dataset")


# ----------------------------------------------------------------------------------------------- routing


def test_route_of():
    assert route_of("math", "taco") == "math"  # ability wins
    assert route_of("Code") == "code"
    assert route_of(None, "numina_amc_aime") == "math"
    assert route_of("", "reasoning_gym/chain_sum") == "math"
    for src in ("taco", "apps", "codecontests", "codeforces"):
        assert route_of(None, src) == "code"
    assert route_of("chemistry", "mystery") is None
    assert route_of(None, None) is None


def test_routed_reward_dispatches_and_counts():
    calls = {}

    def fake_math(completions, solution, **kw):
        calls["math"] = (list(completions), list(solution), kw)
        return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]

    def fake_code(completions, tests, **kw):
        calls["code"] = (list(completions), list(tests))
        return [0.5 for _ in completions]

    reward = make_routed_reward(fake_math, fake_code, name="my_reward")
    logged = []
    out = reward(
        ["1", "prog", "2", "x"],
        ability=["math", "code", None, "poetry"],
        data_source=["a", "taco", "numina_olympiads", "b"],
        solution=["1", None, "3", None],
        tests=[None, "{}", None, None],
        log_metric=lambda k, v: logged.append((k, v)),
        prompts=["p"] * 4,
    )
    assert reward.__name__ == "my_reward"
    assert out == [1.0, 0.5, 0.0, None]
    assert calls["math"][:2] == (["1", "2"], ["1", "3"])
    assert "log_metric" in calls["math"][2] and "prompts" not in calls["math"][2]
    assert calls["code"] == (["prog"], ["{}"])
    assert reward.last_counts == {"math": 2, "code": 1, "unrouted": 1}
    assert ("route/unrouted", 1.0) in logged and ("route/math", 2.0) in logged

    with pytest.raises(ValueError, match="no 'tests' column"):
        reward(["p"], ability=["code"], solution=["1"])
    with pytest.raises(ValueError, match="has 2 values for 1 completions"):
        reward(["p"], ability=["math", "math"], solution=["1"])


def test_outcome_reward_with_real_verifiers(tmp_path):
    ds = load_prompt_dataset(_write_jsonl(tmp_path / "eurus.jsonl", _eurus_rows()))
    completions = [
        "1/2 + 1/4 = 3/4, so \\boxed{\\frac{3}{4}}",
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
        "\\boxed{41}",
    ]
    cols = {c: ds[c] for c in ("ability", "data_source", "solution", "tests")}
    assert D.outcome_reward(completions, **cols) == [1.0, 1.0, 0.0]
    assert D.outcome_reward.last_counts == {"math": 2, "code": 1, "unrouted": 0}


def test_module_has_no_warnings_on_clean_load():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        load_prompt_dataset("embedded:gsm_symbolic", "test", size=3)
