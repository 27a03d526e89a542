"""The learning benchmark's statistics and report (benchmarks/learning.py) on synthetic per-seed curves: the claims
verdicts and PRIME Table 4 rows follow the numbers they are given."""

from __future__ import annotations

import math
import os
import sys

import pytest
from helpers import ROOT


sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
learning = pytest.importorskip("learning")


def _runs(final_by_method: dict[str, list[float]]) -> dict[str, list[dict]]:
    """Per method, one run per seed: accuracy linear from 0.3 at step 0 to the seed's final value at step 60;
    training seconds = steps for the baselines, 2 x steps for the PRIME rows (PRIME costs more per step)."""
    steps = [0, 20, 40, 60]
    return {
        m: [
            {
                "steps": steps,
                "sampled": [0.3 + (f - 0.3) * s / 60 for s in steps],
                "seed": i,
                "train_seconds": [s * (2.0 if m.startswith("prime") else 1.0) for s in steps],
            }
            for i, f in enumerate(fs)
        ]
        for m, fs in final_by_method.items()
    }


def test_paired_diff_ci_hand_values():
    """Differences per seed 1, 2, 3: mean 2, sd 1, half-width t(2) / sqrt(3) = 4.303 / 1.732 = 2.4843."""
    d, lo, hi, n = learning.paired_diff_ci({0: 1.0, 1: 2.0, 2: 3.0}, {0: 2.0, 1: 4.0, 2: 6.0})
    assert (d, n) == (pytest.approx(2.0), 3)
    assert (lo, hi) == pytest.approx((2.0 - 2.48434, 2.0 + 2.48434), abs=1e-4)
    # pairing by seed: seed 9 of b has no partner and is left out; the common seeds differ by 0.1 and 0.3
    d, lo, hi, n = learning.paired_diff_ci({0: 0.5, 1: 0.4}, {1: 0.7, 0: 0.6, 9: 0.0})
    assert (d, n) == (pytest.approx(0.2), 2)
    assert hi - d == pytest.approx(12.706 * 0.141421 / 2**0.5, abs=1e-4)  # sd of (0.1, 0.3) = 0.1414
    # the same shift on every seed: a zero-width interval, which Welch's unpaired test would not give
    assert learning.paired_diff_ci({0: 0.3, 1: 0.5, 2: 0.9}, {0: 0.35, 1: 0.55, 2: 0.95})[1:3] == pytest.approx(
        (0.05, 0.05)
    )
    assert learning.paired_diff_ci({0: 0.3}, {0: 0.4})[1] != learning.paired_diff_ci({0: 0.3}, {0: 0.4})[1]  # NaN


def test_effect_verdict_wording():
    """Across 0 reads "not replicated" only when the interval also excludes the paper's effect."""
    v = learning.effect_verdict
    assert v(0.05, 0.01, 0.09, 0.041) == "replicated"
    assert v(0.02, 0.01, 0.03, 0.041) == "replicated (smaller than the paper's +0.041)"
    assert v(-0.05, -0.09, -0.01, 0.041) == "not replicated (reversed)"
    assert v(0.0, -0.02, 0.03, 0.041) == "not replicated (the interval excludes the paper's +0.041)"
    assert v(0.01, -0.04, 0.06, 0.041) == (
        "not detected (inconclusive: the interval cannot exclude the paper's +0.041)"
    )
    assert v(0.01, -0.04, 0.06) == "not detected (inconclusive: the interval cannot exclude a gain)"
    assert v(0.01, float("nan"), float("nan"), 0.041) == "inconclusive (one seed)"


def test_best_of_n_hand_values():
    """Two problems of 4 samples. Problem 0: labels 1 0 0 1, answers 3 4 4 3, PRM scores 0.1 0 0.2 0.9; problem 1:
    every sample wrong. N=2 (groups {0,1}, {2,3}): first 1, 0; majority (ties to the first seen) 3 -> 1, 4 -> 0;
    oracle 1, 1; PRM picks 0 and 3 -> 1, 1. Per problem: first 0.5 / 0, PRM 1 / 0: PRM - majority per problem 0.5, 0
    -> mean 0.25, sd 0.3536, half-width 12.706 * 0.25 = 3.1765."""
    labels = [1, 0, 0, 1, 0, 0, 0, 0]
    answers = ["3", "4", "4", "3", None, "5", "6", "6"]
    out = learning.best_of_n(labels, answers, {"p": [0.1, 0.0, 0.2, 0.9, 0, 0, 0, 0]}, 2, 4, ns=(2, 4, 8))
    assert set(out["best_of_n"]) == {2, 4}  # N=8 > 4 samples: skipped
    assert out["best_of_n"][2] == pytest.approx({"first": 0.25, "majority": 0.25, "oracle": 0.5, "p": 0.5})
    assert out["best_of_n"][4] == pytest.approx({"first": 0.5, "majority": 0.5, "oracle": 0.5, "p": 0.5})
    assert out["best_of_n_ci"][2]["first"] == pytest.approx([0.25, 12.706 * 0.25])  # per problem 0.5, 0
    assert out["best_of_n_vs_majority"][2]["p"] == pytest.approx([0.25, 0.25 - 3.1765, 0.25 + 3.1765], abs=1e-4)
    assert out["best_of_n_vs_majority"][4]["p"] == pytest.approx([0.0, 0.0, 0.0])  # same choice on both problems


def test_claims_and_table_4_follow_the_numbers():
    runs = _runs(
        {
            "reinforce": [0.40, 0.41, 0.42, 0.40, 0.41],
            "prime_reinforce": [0.60, 0.61, 0.62, 0.60, 0.61],
            "ppo": [0.50, 0.52, 0.51, 0.50, 0.52],
            "prime_ppo": [0.50, 0.51, 0.52, 0.52, 0.50],
            "prime_as_value": [0.45, 0.46, 0.44, 0.45, 0.46],
        }
    )
    summary = learning.summarize(runs, key="sampled")
    rows = {c: (meas, v) for c, meas, v in learning.claims(summary, None)}
    every = rows["PRIME gains for every estimator (RLOO, GRPO, REINFORCE, PPO)"]
    assert "prime_ppo - ppo" in every[0]
    assert every[1] == "not detected (inconclusive)"  # REINFORCE up, PPO flat, RLOO and GRPO not run
    reward_vs_value = [v for c, (m, v) in rows.items() if c.startswith("the implicit PRM works better as a reward")]
    assert reward_vs_value == ["replicated"]  # prime_reinforce 0.61 > prime_as_value 0.45 on every seed
    lines = learning.table4_lines(summary)
    ppo = next(line for line in lines if line.startswith("| PPO |"))
    assert "35.8 -> 39.4 (+3.6)" in ppo and "0.510" in ppo
    # paired final differences per seed 0, -0.01, +0.01, +0.02, -0.02: mean 0, sd 0.0158, half 2.776 * 0.00707 = 0.0196,
    # so the interval [-0.020, +0.020] lies below the paper's +0.036: excluded
    assert "+0.000 [-0.020, +0.020]" in ppo and "not replicated (the interval excludes the paper's +0.036)" in ppo
    reinforce = next(line for line in lines if line.startswith("| REINFORCE |"))
    assert "+0.200 [+0.200, +0.200]" in reinforce and reinforce.endswith("| replicated |")
    value = next(line for line in lines if line.startswith("| PRIME as value model |"))
    assert "36.6" in value and "0.452" in value


def test_reward_vs_value_not_replicated_when_value_wins():
    runs = _runs({"prime_reinforce": [0.40, 0.41, 0.40], "prime_as_value": [0.60, 0.62, 0.61]})
    rows = learning.claims(learning.summarize(runs, key="sampled"), None)
    assert [v for c, _, v in rows if "as a reward" in c] == ["not replicated (reversed)"]


def test_online_vs_frozen_row_carries_the_collapse():
    """The frozen PRM collapses the policy on 2 of 3 seeds (0.3 -> 0.05): online "beats" it, and the row says why."""
    runs = _runs(
        {"rloo": [0.40, 0.42, 0.41], "prime_rloo": [0.40, 0.41, 0.42], "prime_rloo_frozen": [0.05, 0.05, 0.2]}
    )
    summary = learning.summarize(runs, key="sampled")
    assert [summary[m]["collapsed_seeds"] for m in ("rloo", "prime_rloo_frozen")] == [0, 2]
    row = next(r for r in learning.claims(summary, None) if r[0].startswith("an online PRM beats a frozen"))
    assert "frozen: 2/3 seeds collapse (final 0.100" in row[1] and "online: 0/3 seeds collapse" in row[1]
    assert "online - RLOO +0.000" in row[1]
    assert row[2].endswith("only because the frozen PRM collapses the policy")


def test_oracle_row_and_time_to_threshold_in_seconds():
    """rloo ends at 0.40 (the threshold); the oracle reaches 0.40 at step 60 * 0.1 / 0.3 = 20 of a 0.3 -> 0.6 line,
    i.e. 40 training seconds at 2 s per step; RLOO reaches it at its last step, 60 s."""
    runs = _runs({"rloo": [0.40, 0.40, 0.40], "prime_rloo_oracle": [0.60, 0.62, 0.58]})
    result = {
        "summary": {"sampled": learning.summarize(runs, key="sampled"), "greedy": learning.summarize(runs, "sampled")},
        "task": {"difficulty": "8x1", "operands": 8, "digits": 1, "heldout": 256},
        "offline_prm": None,
    }
    result["claims"] = learning.claims(result["summary"]["sampled"], None)
    text = learning.report(result)
    assert text.startswith("Task: 8x1 (8 operands of 1 digit, 7 dependent steps)")
    oracle_line = next(line for line in text.splitlines() if line.startswith("| prime_rloo_oracle |"))
    assert "| 20 (40 s) |" in oracle_line
    assert "| 60 (60 s) |" in next(line for line in text.splitlines() if line.startswith("| rloo |"))
    # the sample-efficiency claim in steps and seconds: PRIME-RLOO (0.3 -> 0.5) reaches 0.40 at step 30, 60 s
    runs["prime_rloo"] = _runs({"prime_rloo": [0.50, 0.50, 0.50]})["prime_rloo"]
    row = learning.claims(learning.summarize(runs, key="sampled"), None)[0]
    assert "RLOO reaches 0.400 at step 60 (60 s), PRIME-RLOO at 30 (60 s) (step ratio 2.00)" in row[1]
    headroom = next(c for c in result["claims"] if c[0].startswith("(headroom)"))
    assert "final +0.200 [+0.150, +0.250]" in headroom[1] and headroom[2] == "detected"


def test_seed_offset_counts_once_and_merged_runs_are_skipped():
    """``--seed-offset`` shifts the seeds once (it was added twice: 500 trained seeds 1000+), and ``--merge`` skips
    the runs an earlier JSON file holds."""
    merged = {("rloo", 1000): {}, ("prime_rloo", 1001): {}, ("rloo", 7): {}}
    todo = learning.runs_to_do(["rloo", "prime_rloo"], 3, 1000, merged)
    assert todo == [("prime_rloo", 1000), ("rloo", 1001), ("rloo", 1002), ("prime_rloo", 1002)]
    assert learning.runs_to_do(["rloo"], 2, 0, {}) == [("rloo", 0), ("rloo", 1)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_benchmark_workers_exit_with_a_killed_main_process(tmp_path):
    """A killed benchmark left its ProcessPoolExecutor workers training on as orphans; the worker initializer now
    asks Linux to end each worker with its parent. The script's main process exits abruptly while both workers are
    busy; shortly after, neither worker pid is alive."""
    import subprocess
    import textwrap
    import time

    script = tmp_path / "pool.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import multiprocessing as mp, os, sys, time
            from concurrent.futures import ProcessPoolExecutor
            sys.path.insert(0, {os.path.join(ROOT, "benchmarks")!r})
            import learning

            if __name__ == "__main__":
                ctx = mp.get_context("spawn")
                with ProcessPoolExecutor(2, mp_context=ctx, initializer=learning._exit_with_parent) as ex:
                    futures = [ex.submit(time.sleep, 120) for _ in range(2)]
                    time.sleep(2.0)
                    print(" ".join(str(p.pid) for p in ex._processes.values()), flush=True)
                    os._exit(0)
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.time() + 10
    alive = pids
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in _proc_state(p)]
    assert not alive, f"orphaned workers still running: {alive}"


def _proc_state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_merge_refuses_runs_of_other_warm_start_weights():
    """The same recipe (cache key) trained on another CPU gave 0.254 sampled where the merged file's read 0.291: its
    runs are not paired with new ones; a file with the same accuracy, or none recorded, merges."""
    here = {"greedy": 0.449, "sampled": 0.254}
    merged = {"old.json": {"greedy": 0.461, "sampled": 0.291}, "same.json": dict(here), "unknown.json": None}
    assert learning.other_warm_starts(merged, here) == {"old.json": {"greedy": 0.461, "sampled": 0.291}}
    assert learning.other_warm_starts({"same.json": dict(here)}, here) == {}


def test_pair_accuracy_of_steps_that_kept_no_group_is_skipped():
    """With the paper's filter on the sparse task, a step can keep no group and log no pair accuracy (None): the
    windows average the steps that have one (the summary crashed on it before)."""
    run = {"seed": 0, "steps": [0, 60], "sampled": [0.1, 0.2], "greedy": [0.1, 0.2], "train_seconds": None}
    pairs = [None, 0.5, 0.7, None, None, 0.6, 0.4, 0.8, None, 1.0]
    s = learning.summarize({"prime_rloo": [{**run, "pair_accuracy": pairs}]}, "sampled")["prime_rloo"]
    assert s["pair_accuracy"]["window"] == 2
    assert s["pair_accuracy"]["first"][0] == pytest.approx(0.5)  # None, 0.5
    assert s["pair_accuracy"]["last"][0] == pytest.approx(1.0)  # None, 1.0
    assert math.isnan(s["pair_accuracy"]["curve"][0]) and s["pair_accuracy"]["curve"][1] == 0.5
