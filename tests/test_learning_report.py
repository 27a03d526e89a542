"""The learning benchmark's statistics and report (benchmarks/learning.py) on synthetic per-seed curves: the claims
verdicts and PRIME Table 4 rows follow the numbers they are given."""

from __future__ import annotations

import os
import sys

import pytest


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
learning = pytest.importorskip("learning")


def _runs(final_by_method: dict[str, list[float]]) -> dict[str, list[dict]]:
    """Per method, one run per seed: accuracy linear from 0.3 at step 0 to the seed's final value at step 60."""
    steps = [0, 20, 40, 60]
    return {
        m: [
            {"steps": steps, "sampled": [0.3 + (f - 0.3) * s / 60 for s in steps], "seed": i} for i, f in enumerate(fs)
        ]
        for m, fs in final_by_method.items()
    }


def test_diff_ci_hand_values():
    d, lo, hi = learning.diff_ci([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert d == pytest.approx(2.0)  # mean(b) - mean(a)
    assert lo < 2.0 < hi


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
    assert every[1] == "inconclusive"  # REINFORCE up, PPO flat, RLOO and GRPO not run
    reward_vs_value = [v for c, (m, v) in rows.items() if c.startswith("the implicit PRM works better as a reward")]
    assert reward_vs_value == ["replicated"]  # prime_reinforce 0.61 > prime_as_value 0.45 on every seed
    lines = learning.table4_lines(summary)
    ppo = next(line for line in lines if line.startswith("| PPO |"))
    assert "35.8 -> 39.4" in ppo and "0.510" in ppo
    value = next(line for line in lines if line.startswith("| PRIME as value model |"))
    assert "36.6" in value and "0.452" in value


def test_reward_vs_value_not_replicated_when_value_wins():
    runs = _runs({"prime_reinforce": [0.40, 0.41, 0.40], "prime_as_value": [0.60, 0.62, 0.61]})
    rows = learning.claims(learning.summarize(runs, key="sampled"), None)
    assert [v for c, _, v in rows if "as a reward" in c] == ["not replicated"]
