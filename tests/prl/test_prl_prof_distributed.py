"""Two-process PRL and PROF runs on CPU (DDP over gloo), in one `accelerate launch` (see
tests/scripts/prl_prof_distributed.py: PRLGRPOTrainer and ProfGRPOTrainer for 10 steps, PrimeGRPOTrainer and
PrimeRLOOTrainer with PROF for 2). The script asserts 2 processes, that each policy trained identically on both ranks
and that the global PROF selection is the same on both ranks. Here, in one process, from the two ranks' local tensors
(each generation batch splits a group across the ranks): the weights each rank fed its loss equal the functional API on
the concatenated batch, PROF keeps 4 of 8 per prompt, dropped rows have loss weight 0 and `num_items_in_batch` counts
the kept tokens of the global batch."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import SCRIPTS, launch_argv, read_summary, run_launched

from trl_prime import functional as F


SCRIPT = os.path.join(SCRIPTS, "prl_prof_distributed.py")


def _launch(model: str, prm: str, out: str, timeout: int = 600) -> dict:
    proc = run_launched(launch_argv(SCRIPT, "--model", model, "--prm", prm, "--out", out, "--steps", "10"), timeout)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return read_summary(out)


def _load(out, name):
    return [torch.load(os.path.join(out, f"{name}_rank{r}.pt"), weights_only=False) for r in range(2)]


def _cat(parts, key):
    xs = [p[key] for p in parts]
    if xs[0].dim() == 2:
        T = max(x.size(1) for x in xs)
        xs = [torch.nn.functional.pad(x, (0, T - x.size(1))) for x in xs]
    return torch.cat(xs)


@pytest.fixture(scope="module")
def launched(tiny_model_path, tmp_path_factory):
    from tiny_prm import build_tiny_step_prm

    prm = build_tiny_step_prm(tmp_path_factory.mktemp("dist_step_prm"))
    out = str(tmp_path_factory.mktemp("prl_prof_ddp"))
    return out, _launch(tiny_model_path, prm, out)


@pytest.mark.slow
def test_prl_two_processes(launched):
    out, summary = launched
    assert summary["num_processes"] == 2
    logs = summary["logs"]["prl"]
    assert [h["step"] for h in logs] == list(range(1, 11))
    for h in logs:
        for k in ("loss", "prl/kl_to_go_mean", "prl/sign_flip_fraction", "prl/steps_per_completion"):
            assert math.isfinite(h[k]), k
    assert logs[0]["prl/kl_to_go_max"] == 0.0 and logs[-1]["prl/kl_to_go_max"] > 0.0
    ranks = _load(out, "prl")
    for step in range(10):
        parts = [r[step] for r in ranks]
        B = parts[0]["mask"].size(0)
        assert B == 6
        old, ref, mask = (_cat(parts, k) for k in ("old", "ref", "mask"))
        ends = _cat(parts, "step_ends").bool()
        outcome = parts[0]["outcome"]
        assert torch.equal(outcome, parts[1]["outcome"]) and outcome.numel() == 12
        expected = F.prl_advantages(outcome, old, ref, mask, torch.arange(12) // 4, eta=2.0, step_ends=ends)
        adv = _cat(parts, "advantages")
        torch.testing.assert_close(adv, expected, atol=1e-6, rtol=1e-6)
        # the split group (global rows 4..7, two on each rank) depends on both ranks' rows only
        alone = F.prl_advantages(
            outcome[4:8], old[4:8], ref[4:8], mask[4:8], torch.zeros(4, dtype=torch.long), eta=2.0, step_ends=ends[4:8]
        )
        torch.testing.assert_close(adv[4:8], alone, atol=1e-6, rtol=1e-6)
        assert parts[0]["num_items"].item() == mask.sum().item()


def _check_prof_rounds(parts_per_round, *, prime: bool):
    for parts in parts_per_round:
        kept = parts[0]["kept"]
        assert torch.equal(kept, parts[1]["kept"]) and kept.numel() == 24
        assert kept.view(3, 8).sum(1).tolist() == [4, 4, 4]  # group 1 (rows 8..15) is split across the ranks
        outcome = _cat(parts, "outcome") if prime else parts[0]["outcome"]
        mask = _cat(parts, "mask")
        gid = torch.arange(24) // 8
        if prime:
            loss_mask = _cat(parts, "loss_mask")
            assert torch.equal(loss_mask, mask * kept[:, None])
            expected = F.prime_advantages(
                process_rewards=_cat(parts, "token_rewards"),
                outcome_rewards=torch.where(kept, outcome, torch.nan),
                mask=mask,
                group_ids=gid,
                **parts[0]["options"],
            )
            torch.testing.assert_close(_cat(parts, "advantages"), expected, atol=1e-6, rtol=1e-5)
        else:
            expected = F.grpo_advantages(torch.where(kept, outcome, torch.nan), gid)
            torch.testing.assert_close(_cat(parts, "advantages"), expected, atol=1e-6, rtol=1e-6)
            assert torch.equal(_cat(parts, "tool_mask"), kept[:, None].long().expand_as(mask))
            n_kept_tokens = (mask * kept[:, None]).sum().item()
            assert parts[0]["num_items"].item() == parts[1]["num_items"].item() == n_kept_tokens
            idx = F.prof_select(gid, parts[0]["consistency"], parts[0]["num_steps"], outcome, num_keep=4)
            assert kept.nonzero().flatten().tolist() == idx.tolist()


@pytest.mark.slow
def test_prof_two_processes(launched):
    out, summary = launched
    logs = summary["logs"]["prof"]
    assert [h["step"] for h in logs] == list(range(1, 11))
    assert all(
        h["prof/kept_fraction"] == 0.5 and h["prof/kept_correct"] + h["prof/kept_incorrect"] == 12 for h in logs
    )
    ranks = _load(out, "prof")
    _check_prof_rounds([[r[i] for r in ranks] for i in range(10)], prime=False)
    for name in ("prime_grpo", "prime_rloo"):
        ranks = _load(out, name)
        _check_prof_rounds([[r[i] for r in ranks] for i in range(2)], prime=True)
        plogs = summary["logs"][name]
        assert len(plogs) == 2 and all(h["prof/kept_fraction"] == 0.5 and math.isfinite(h["prm/loss"]) for h in plogs)
