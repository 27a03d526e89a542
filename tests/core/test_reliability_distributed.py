"""Reliability (issue 8), distributed: the same global batch on 1 process and on 2 processes (DDP over gloo) gives the
same advantages, loss masks, losses and weights, with a prompt group split across the ranks, completion lengths that
differ between the ranks, and rows dropped by the prompt filter and PROF (tests/scripts/reliability_equivalence.py)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from helpers import SCRIPTS, launch_argv, run_launched


SCRIPT = os.path.join(SCRIPTS, "reliability_equivalence.py")


@pytest.fixture(scope="module")
def launched(tiny_model_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("equivalence"))
    one = run_launched([sys.executable, SCRIPT, "--model", tiny_model_path, "--out", out])
    assert one.returncode == 0, one.stderr[-6000:]
    two = run_launched(launch_argv(SCRIPT, "--model", tiny_model_path, "--out", out))
    assert two.returncode == 0, two.stderr[-6000:]
    return out


def _pad(t, T):
    return torch.nn.functional.pad(t, (0, T - t.size(1))) if t.dim() == 2 else t


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prime", "prl"])
def test_two_processes_equal_one_process_on_the_same_batch(launched, name):
    load = lambda n, r: torch.load(os.path.join(launched, f"{name}_np{n}_rank{r}.pt"), weights_only=False)  # noqa
    one, r0, r1 = load(1, 0), load(2, 0), load(2, 1)
    assert len(one["records"]) == len(r0["records"]) == len(r1["records"]) == 2
    for a, b0, b1 in zip(one["records"], r0["records"], r1["records"]):
        T = a["completion_ids"].size(1)
        assert b0["completion_ids"].size(1) == 6 and b1["completion_ids"].size(1) == 4  # uneven lengths per rank
        for key in ("completion_ids", "loss_mask", "advantages"):
            two = torch.cat([_pad(b0[key], T), _pad(b1[key], T)])
            single = a[key]
            if key == "advantages" and single.dim() == 2:
                m = a["loss_mask"].bool()
                torch.testing.assert_close(two[m], single[m], atol=1e-6, rtol=1e-5)
            else:
                torch.testing.assert_close(two.to(single.dtype), single, atol=1e-6, rtol=1e-5)
        assert b0["num_items"] == b1["num_items"] == a["num_items"]  # kept tokens of the global batch
        if name == "prime":  # rows dropped by the prompt filter and PROF
            kept_rows = a["loss_mask"].sum(-1) > 0
            assert kept_rows.any() and not kept_rows.all(), "the test needs dropped rows"
    for h1, h2 in zip(one["logs"], r0["logs"]):
        for k in ("loss", "reward", "prm/loss", "prof/kept_fraction", "filter/kept_fraction", "prl/kl_to_go_mean"):
            if k in h1:
                assert math.isclose(h1[k], h2[k], rel_tol=1e-4, abs_tol=1e-6), (k, h1[k], h2[k])
    torch.testing.assert_close(r0["policy"], one["policy"], atol=2e-5, rtol=1e-4)
    if name == "prime":
        torch.testing.assert_close(r0["prm"], one["prm"], atol=2e-5, rtol=1e-4)
