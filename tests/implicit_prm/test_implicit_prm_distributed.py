"""ImplicitPRMTrainer with 2 CPU processes (`accelerate launch`, DDP over gloo) vs 1 process on the same data.

Batches hold whole prompt groups and accelerate deals whole batches to the ranks, so DPO pairs never straddle
processes; 2 processes x accumulation 1 must match 1 process x accumulation 2 (same batches per step): same logged
losses and the same weights after 2 SGD steps, within float tolerance. The launch costs ~20-40 s.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers import SCRIPTS, launch_argv, read_summary, run_launched


SCRIPT = os.path.join(SCRIPTS, "implicit_prm_distributed.py")


def _run(cmd, out):
    proc = run_launched(cmd)
    assert proc.returncode == 0, f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return read_summary(out), torch.load(os.path.join(out, "weights.pt"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_processes_match_one_process_with_accumulation(tiny_model_path, tmp_path, lora):
    extra = ["--lora"] if lora else []
    out2, out1 = str(tmp_path / "ddp"), str(tmp_path / "single")
    two, w2 = _run(launch_argv(SCRIPT, "--model", tiny_model_path, "--out", out2, *extra), out2)
    one, w1 = _run(
        [sys.executable, SCRIPT, "--model", tiny_model_path, "--out", out1, "--grad_accum", "2", *extra], out1
    )
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert two["global_step"] == one["global_step"] == 2
    # every batch on every rank holds whole prompt groups (pairs never straddle ranks)
    sizes = {int(k): v for k, v in two["group_sizes"].items()}
    rank_batches = two["batches"]
    assert len(rank_batches) == 2 and all(len(b) == 2 for b in rank_batches)
    seen_groups = []
    for batches in rank_batches:
        for gids in batches:
            for g in set(gids):
                assert gids.count(g) == sizes[g], (g, gids)
            seen_groups += sorted(set(gids))
    assert len(seen_groups) == len(set(seen_groups)) >= 4  # no prompt in two batches of the same epoch
    # the same batches per optimizer step -> the same losses and weights
    order1 = [sorted(set(g)) for g in one["batches"][0]]
    order2 = [sorted(set(g)) for pair in zip(*rank_batches) for g in pair]
    assert order1 == order2
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-5)
    assert len(two["losses"]) == 2 and two["losses"][0] == pytest.approx(0.6931, abs=1e-3)  # PRM == ref at step 0
    assert w1.keys() == w2.keys()
    changed = 0
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)
    base = torch.load(os.path.join(out1, "weights.pt"))  # sanity: training moved the weights
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    for k, v in base.items():
        name = k.replace("base_model.model.", "").replace(".base_layer", "")
        if "lora_" not in k and name in init and not torch.equal(v, init[name]):
            changed += 1
        if "lora_B" in k and v.abs().sum() > 0:
            changed += 1
    assert changed > 0
    assert two["scores"] == pytest.approx(one["scores"], rel=1e-4, abs=1e-6)
    assert two["scores"][0] != two["scores"][1]
