"""The learning benchmark's run plan: ``--seed-offset`` and ``--merge`` (no training here)."""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import learning  # noqa: E402


def test_seed_offset_counts_once_and_merged_runs_are_skipped():
    merged = {("rloo", 1000): {}, ("prime_rloo", 1001): {}, ("rloo", 7): {}}
    todo = learning.runs_to_do(["rloo", "prime_rloo"], 3, 1000, merged)
    assert todo == [("prime_rloo", 1000), ("rloo", 1001), ("rloo", 1002), ("prime_rloo", 1002)]
    assert learning.runs_to_do(["rloo"], 2, 0, {}) == [("rloo", 0), ("rloo", 1)]
