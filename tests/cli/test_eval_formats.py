"""Local GSM8K and MATH / MATH-500 JSONL files in ``trl_prime.data`` and ``trl-prime eval``: gold extraction, format
detection, the error on a row without its gold, per-level / per-subject metrics.

The rows under tests/data/eval_formats/ were written for these tests in the two public formats (GSM8K: Cobbe et
al. 2021; MATH: Hendrycks et al. 2021; MATH-500: the 500-problem MATH test subset, whose ``level`` is an integer
and whose ``type`` is called ``subject``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import TESTS

from trl_prime.data import COLUMNS, METADATA_COLUMNS, detect_format, gsm8k_gold, load_prompt_dataset, math_gold
from trl_prime.evaluation import format_breakdowns, grouped_metrics


DATA = Path(TESTS, "data", "eval_formats")
GSM8K = str(DATA / "gsm8k.jsonl")
MATH500 = str(DATA / "math500.jsonl")
MATH = str(DATA / "math.jsonl")
GSM8K_BAD = str(DATA / "gsm8k_missing_answer.jsonl")


# ----------------------------------------------------------------------------------------------- gold extraction


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("12 * 6 = <<12*6=72>>72 muffins.\n#### 72", "72"),
        ("2 * 617 = 1,234 dollars.\n#### 1,234", "1234"),  # thousands separator removed
        ("3 - 8 = -5\n#### -5", "-5"),  # negative kept
        ("12.5 / 5 = 2.5\n#### 2.5", "2.5"),  # decimal kept
        ("#### $18", "18"),
        ("a first #### 3 inside the reasoning\n#### 1,000,000", "1000000"),  # the last '####' counts
        ("#### -1,234.50", "-1234.50"),
        ("#### 3/4", "3/4"),  # a fraction is kept whole
        ("72", "72"),  # no '####': a bare number is accepted
        ("1,000", "1000"),
        (72, "72"),
    ],
)
def test_gsm8k_gold_hand_values(answer, gold):
    assert gsm8k_gold(answer) == gold


@pytest.mark.parametrize(
    "answer, match",
    [
        (None, "'answer' is missing"),
        ("   ", "non-empty"),
        (["72"], "non-empty string or number"),
        ("The answer is seventy-two.", r"no '#### <number>' final line"),
        ("reasoning\n#### seventy-two", "no number after its last '####'"),
    ],
)
def test_gsm8k_gold_errors(answer, match):
    with pytest.raises(ValueError, match=match):
        gsm8k_gold(answer)


@pytest.mark.parametrize(
    "answer, solution, gold",
    [
        ("\\frac{1}{2}", "so $\\boxed{0.5}$", "\\frac{1}{2}"),  # the answer field wins over the solution
        (None, "so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # nested braces balanced
        ("", "first $\\boxed{1}$, then $\\boxed{\\sqrt{2}}$", "\\sqrt{2}"),  # the last box
        (None, "the set $\\boxed{\\{1, 2\\}}$", "\\{1, 2\\}"),  # escaped braces are not box braces
        (None, "$\\fbox{\\dfrac{3}{4}}$", "\\dfrac{3}{4}"),
        (7, None, "7"),
    ],
)
def test_math_gold_hand_values(answer, solution, gold):
    assert math_gold(answer, solution) == gold


@pytest.mark.parametrize("solution", [None, "no box here, the answer is 5", "unclosed $\\boxed{\\frac{1}{2}$"])
def test_math_gold_without_answer_or_box_raises(solution):
    with pytest.raises(ValueError, match=r"'answer' is missing or empty and the field 'solution' has no complete"):
        math_gold(None, solution)


@pytest.mark.parametrize(
    "columns, fmt",
    [
        (["question", "answer"], "gsm8k"),
        (["problem", "solution", "answer", "subject", "level", "unique_id"], "math"),  # MATH-500
        (["problem", "level", "type", "solution"], "math"),  # MATH
        (["data_source", "prompt", "ability", "reward_model", "extra_info"], "eurus"),
        (["prompt", "question", "answer"], "eurus"),  # a prompt column decides
        (["question", "solution"], "eurus"),  # not GSM8K's gold field: the Eurus checks then explain
        (["problem"], "eurus"),
    ],
)
def test_detect_format(columns, fmt):
    assert detect_format(columns) == fmt


# ----------------------------------------------------------------------------------------------- loading files


def _user_texts(ds):
    return [p[-1]["content"] for p in ds["prompt"]]


def test_gsm8k_file_by_path():
    rows = [json.loads(line) for line in Path(GSM8K).read_text().splitlines()]
    ds = load_prompt_dataset(GSM8K, "test")
    assert ds.column_names == list(COLUMNS)  # no metadata columns unless asked
    assert ds["solution"] == ["72", "1234", "-5", "2.5"]
    assert _user_texts(ds) == [r["question"] for r in rows]
    assert set(ds["ability"]) == {"math"} and set(ds["data_source"]) == {"gsm8k"}
    meta = load_prompt_dataset(GSM8K, "test", metadata=True)
    assert meta.column_names == [*COLUMNS, *METADATA_COLUMNS]
    assert meta["level"] == [None] * 4 and meta["subject"] == [None] * 4


def test_math500_and_math_files_by_path():
    ds = load_prompt_dataset(MATH500, "test", metadata=True)
    assert ds["solution"] == ["\\frac{1}{2}", "5", "25"]
    assert ds["level"] == ["Level 1", "Level 3", "Level 3"]  # MATH-500's integer levels written as MATH's
    assert ds["subject"] == ["Prealgebra", "Algebra", "Algebra"]
    assert ds["id"] == ["test/prealgebra/1.json", "test/algebra/2.json", "test/algebra/3.json"]
    assert _user_texts(ds)[1] == "Solve $2x + 3 = 13$ for $x$."
    original = load_prompt_dataset(MATH, "test", metadata=True)  # no 'answer': the last box of 'solution'
    assert original["solution"] == ["\\frac{1}{2}", "\\sqrt{2}"]
    assert original["level"] == ["Level 2", "Level 4"]
    assert original["subject"] == ["Prealgebra", "Algebra"]  # MATH's 'type'


def test_explicit_dataset_format(tmp_path):
    path = tmp_path / "both.jsonl"
    path.write_text(
        json.dumps({"prompt": "P?", "question": "Q?", "answer": "work\n#### 3,000", "ability": "math"}) + "\n"
    )
    assert load_prompt_dataset(str(path))["solution"] == ["work\n#### 3,000"]  # a prompt column: Eurus rows
    forced = load_prompt_dataset(str(path), dataset_format="gsm8k")
    assert forced["solution"] == ["3000"] and _user_texts(forced) == ["Q?"]
    with pytest.raises(ValueError, match=r"dataset_format='math' needs a 'problem' column"):
        load_prompt_dataset(GSM8K, dataset_format="math")
    with pytest.raises(ValueError, match="dataset_format must be one of"):
        load_prompt_dataset(GSM8K, dataset_format="csv")


def test_row_without_gold_names_file_line_and_field():
    # line 2 of the file is blank: the bad row is on line 3
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(GSM8K_BAD, "test", on_bad_rows="error")
    message = str(info.value)
    assert f"{GSM8K_BAD} line 3" in message and "'answer' is missing" in message and "missing_gold" in message
    assert not isinstance(info.value, KeyError)
    with pytest.warns(UserWarning, match=r"dropped 1 of 2 malformed rows: missing_gold=1 \(rows 1\)"):
        ds = load_prompt_dataset(GSM8K_BAD, "test")
    assert ds["solution"] == ["4"]


def test_math_row_without_gold_and_gsm8k_row_without_number(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"problem": "P1", "solution": "$\\boxed{2}$"}, {"problem": "P2", "solution": "no box"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ValueError, match=rf"is malformed \(missing_gold\) at {re.escape(str(path))} line 2: .*'solution' has no"
    ):
        load_prompt_dataset(str(path), on_bad_rows="error")
    path.write_text(json.dumps({"question": "Q", "answer": "#### many"}) + "\n" + json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"is malformed \(bad_gold\) at .*m.jsonl line 1:"):
        load_prompt_dataset(str(path), on_bad_rows="error")


def test_golds_are_checked_by_math_reward():
    from trl_prime.rewards import math_reward

    golds = [g for path in (GSM8K, MATH500, MATH) for g in load_prompt_dataset(path, "test")["solution"]]
    assert len(golds) == 9
    right = ["\\boxed{72}", "\\boxed{1234}", "\\boxed{-5}", "\\boxed{2.5}", "\\boxed{0.5}", "\\boxed{5}"]
    right += ["\\boxed{25}", "\\boxed{\\frac{2}{4}}", "\\boxed{\\sqrt{2}}"]
    wrong = ["\\boxed{73}", "\\boxed{234}", "\\boxed{5}", "\\boxed{25}", "\\boxed{2}", "\\boxed{-5}"]
    wrong += ["\\boxed{24}", "\\boxed{1}", "\\boxed{2}"]
    assert math_reward(right + wrong, solution=golds + golds) == [1.0] * 9 + [0.0] * 9


# ----------------------------------------------------------------------------------------------- metrics, eval


def test_grouped_metrics_and_breakdown_table():
    rewards = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    by = grouped_metrics(rewards, ["Level 3", None, "Level 3"], [1, 2])
    assert list(by) == ["(none)", "Level 3"]
    assert by["Level 3"]["n_problems"] == 2 and by["Level 3"]["pass@1"] == pytest.approx(0.25)
    assert by["Level 3"]["pass@2"] == pytest.approx(0.5) and by["(none)"]["pass@1"] == 1.0
    with pytest.raises(ValueError, match="2 groups for 3 problems"):
        grouped_metrics(rewards, ["a", "b"])
    table = format_breakdowns({"m": {"pass@1": 0.5, "by_level": by}, "g": {"pass@1": 1.0}}, ["pass@1"])
    lines = table.splitlines()
    assert lines[0] == "m: by level and subject" and lines[1].split() == ["group", "problems", "pass@1", "unscored"]
    assert lines[3].split() == ["level", "(none)", "1", "100.0", "0"]
    assert lines[4].split() == ["level", "Level", "3", "2", "25.0", "0"]
    assert format_breakdowns({"g": {"pass@1": 1.0}}) == ""


def test_eval_main_per_level_and_subject_numbers(tiny_model_path, tmp_path):
    """A scripted generator right on every problem but '3^2 + 4^2' (real verifier): hand-computed groups."""
    from trl_prime.scripts import evaluate

    answers = {"muffins": "72", "computers": "1234", "temperature": "-5", "juice": "2.5"}
    answers.update({"lowest terms": "\\frac{1}{2}", "2x + 3": "5", "3^2": "24"})

    def generate(texts, n):
        return [[f"\\boxed{{{next(a for k, a in answers.items() if k in t)}}}"] * n for t in texts]

    args = evaluate.EvaluateScriptArguments(
        model_name_or_path=tiny_model_path, datasets=[MATH500, GSM8K], output_file=str(tmp_path / "r.json")
    )
    result = evaluate.main(args, generate_fn=generate)
    m = result["datasets"][MATH500]
    assert m["pass@1"] == pytest.approx(2 / 3) and m["n_problems"] == 3
    assert {k: (v["n_problems"], v["pass@1"]) for k, v in m["by_level"].items()} == {
        "Level 1": (1, 1.0),
        "Level 3": (2, 0.5),
    }
    assert {k: (v["n_problems"], v["pass@1"]) for k, v in m["by_subject"].items()} == {
        "Algebra": (2, 0.5),
        "Prealgebra": (1, 1.0),
    }
    g = result["datasets"][GSM8K]
    assert g["pass@1"] == 1.0 and "by_level" not in g and "by_subject" not in g


def test_on_bad_rows_is_validated():
    from trl_prime.scripts import evaluate

    assert evaluate.EvaluateScriptArguments().on_bad_rows == "error"
    with pytest.raises(ValueError, match="--on_bad_rows must be error or drop, got 'skip'"):
        evaluate.EvaluateScriptArguments(on_bad_rows="skip").validate()


def test_trl_prime_eval_on_jsonl_files_prints_the_breakdown(tiny_model_path, tmp_path, capsys):
    """``trl-prime eval`` end to end (tiny model, HF generate) on a MATH-500 and a GSM8K file, by path."""
    from trl_prime import cli

    out = tmp_path / "res.json"
    argv = ["eval", "--model_name_or_path", tiny_model_path, "--datasets", MATH500, GSM8K]
    argv += ["--max_new_tokens", "4", "--num_threads", "1", "--output_file", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"{MATH500}: by level and subject" in printed and f"{GSM8K}: by level" not in printed
    # columns: group, problems, pass@1, avg@1, unscored
    rows = {" ".join(c[:-4]): c[-4] for c in map(str.split, printed.splitlines()) if len(c) > 4}
    assert rows["level Level 1"] == "1" and rows["level Level 3"] == "2"  # the problems column
    assert rows["subject Algebra"] == "2" and rows["subject Prealgebra"] == "1"
    result = json.loads(out.read_text())
    assert set(result["datasets"][MATH500]["by_level"]) == {"Level 1", "Level 3"}
    assert result["datasets"][GSM8K]["n_problems"] == 4 and result["micro"]["n_problems"] == 7
    # a malformed row is bad input: `trl-prime eval: error: ...` naming file, line and field, status 2, no traceback
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "--model_name_or_path", tiny_model_path, "--datasets", GSM8K_BAD])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "trl-prime eval: error: " in err
    assert re.search(r"gsm8k_missing_answer.jsonl line 3.*'answer' is missing.*--on_bad_rows drop", err), err
