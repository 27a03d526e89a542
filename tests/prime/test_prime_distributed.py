"""Two-process PRIME runs on CPU (DDP over gloo, and DeepSpeed ZeRO-3), launched with `accelerate launch`.

Each launch costs ~15-30 s, so every launch checks as much as it can (see tests/scripts/prime_distributed.py: the
script itself asserts 2 processes, that PRM and policy trained, that the reference did not, and that PRM and policy
are identical on both ranks). Here: the per-step metrics, the checkpoint files, and the baselines: the advantages
each rank fed its loss equal `functional.prime_advantages` computed in this single process on the concatenated
batch, although the batch splits a group across the two ranks.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import SCRIPTS, launch_argv, read_summary, run_launched

from trl_prime import functional as F


SCRIPT = os.path.join(SCRIPTS, "prime_distributed.py")


def _launch(mode: str, model: str, out: str, *extra: str, timeout: int = 420) -> dict:
    cmd = launch_argv(SCRIPT, "--mode", mode, "--model", model, "--out", out, *extra)
    proc = run_launched(cmd, timeout=timeout)
    assert proc.returncode == 0, f"{mode} launch failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return read_summary(out)


def _pad(t: torch.Tensor, T: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, T - t.size(1)))


def _check_baselines_single_process(out: str, num_generations: int = 2) -> None:
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    options = ranks[0]["options"]
    assert options == ranks[1]["options"]
    n_steps = len(ranks[0]["steps"])
    assert n_steps == len(ranks[1]["steps"]) == 2
    for step in range(n_steps):
        parts = [r["steps"][step] for r in ranks]
        T = max(p["completion_mask"].size(1) for p in parts)
        rewards, mask, outcome, kept, adv = (
            torch.cat([_pad(p[k], T) if p[k].dim() == 2 else p[k] for p in parts])
            for k in ("token_rewards", "completion_mask", "outcome_rewards", "kept_mask", "advantages")
        )
        B = outcome.numel()
        assert B == 6 and B % num_generations == 0
        # group 1 = global rows 2 and 3: one row on each rank, with different outcomes
        assert outcome[2] != outcome[3]
        expected = F.prime_advantages(
            process_rewards=rewards,
            outcome_rewards=torch.where(kept, outcome, torch.nan),
            mask=mask,
            group_ids=torch.arange(B) // num_generations,
            **options,
        )
        torch.testing.assert_close(adv, expected * mask, atol=1e-6, rtol=1e-5)
        if step == 0:
            assert torch.equal(rewards, torch.zeros_like(rewards))
        else:
            assert rewards.abs().max() > 0
            # the split group's advantages depend on both ranks' rows only: recomputed from that group alone
            local_only = F.prime_advantages(
                process_rewards=rewards[2:4],
                outcome_rewards=outcome[2:4],
                mask=mask[2:4],
                group_ids=torch.zeros(2, dtype=torch.long),
                **options,
            )
            torch.testing.assert_close(adv[2:4], local_only * mask[2:4], atol=1e-6, rtol=1e-5)


def _check_logs(summary: dict) -> None:
    assert summary["num_processes"] == 2
    logs = summary["logs"]
    assert len(logs) == 2 and summary["num_updates"] == 2
    assert logs[0]["prm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert logs[0]["prm/token_reward_std"] == 0.0 and logs[1]["prm/token_reward_std"] > 0
    for h in logs:
        for k in ("prm/loss", "prm/pair_accuracy", "prm/abs_accuracy", "filter/kept_fraction", "loss"):
            assert h[k] is not None and math.isfinite(h[k])
    assert {"implicit_prm_config.json", "prime_state.json"} <= set(summary["prm_checkpoint_files"])


@pytest.mark.slow
def test_ddp_two_processes_prm_in_sync_and_global_baselines(tiny_model_path, tmp_path):
    out = str(tmp_path / "ddp")
    summary = _launch("ddp", tiny_model_path, out)
    _check_logs(summary)
    assert {"model.safetensors", "reference", "optimizer.pt", "scheduler.pt"} <= set(summary["prm_checkpoint_files"])
    _check_baselines_single_process(out)


@pytest.mark.slow
def test_ddp_two_processes_lora_shared_base(tiny_model_path, tmp_path):
    """LoRA: PRM = adapter "prm" on the policy's base; its gradients are all-reduced by hand (DDP only knows the
    policy adapter). The script asserts both adapters trained, identically on both ranks, and the base did not."""
    out = str(tmp_path / "ddp_lora")
    summary = _launch("ddp_lora", tiny_model_path, out)
    _check_logs(summary)
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= set(summary["prm_checkpoint_files"])
    _check_baselines_single_process(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero3", "zero2"])
def test_deepspeed_two_processes_trains_prm_and_policy(tiny_model_path, tmp_path, mode):
    """The PRM is its own DeepSpeed engine (ZeRO-3: partitioned, `stage3_param_persistence_threshold: 0`), the PRM
    reference goes through TRL's `prepare_deepspeed`; the script checks (gathering partitioned weights) that PRM and
    policy trained, identically on both ranks, and that the reference did not."""
    pytest.importorskip("deepspeed")
    out = str(tmp_path / mode)
    summary = _launch(mode, tiny_model_path, out)
    _check_logs(summary)
    assert {"model.safetensors", "reference"} <= set(summary["prm_checkpoint_files"])
    assert "prm_deepspeed" in summary["checkpoint_files"]
    _check_baselines_single_process(out)


@pytest.mark.slow
def test_ddp_two_processes_pairwise_prm_loss_pairs_within_prompts(tiny_model_path, tmp_path):
    """prm_loss="dpo" with 3 rows per rank and K=2 (group 1 = global rows 2 and 3, one on each rank): the loss is
    formed over the global batch (other ranks' sequence rewards gathered, detached), so every pair lies inside one
    prompt's group, the split group's pair is formed too, and the summed gradient is the one-process gradient of the
    global DPO loss. The script asserts the group ids against the gathered prompts; here the pre-clip PRM gradient
    norm of the 2-process step is checked against a one-process recomputation on the concatenated batch."""
    from transformers import AutoModelForCausalLM

    from trl_prime.modeling import completion_logps

    out = str(tmp_path / "ddp_dpo")
    summary = _launch("ddp", tiny_model_path, out, "--prm_loss", "dpo", "--max_steps", "1")
    assert summary["num_processes"] == 2 and summary["num_updates"] == 1
    assert summary["logs"][0]["prm/loss"] == pytest.approx(math.log(2), abs=1e-6)  # r = 0 for every row at step 1
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    steps = [r["steps"][0] for r in ranks]
    prm_steps = [r["prm_steps"][0] for r in ranks]
    outcome = torch.cat([s["outcome_rewards"] for s in steps])
    assert outcome.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    for p in prm_steps:
        assert p["loss_group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
        assert torch.equal(p["loss_labels"], outcome)
    assert prm_steps[0]["grad_norm"] == prm_steps[1]["grad_norm"]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    seqs = []
    for s in steps:
        T = s["completion_ids"].size(1)
        ids = torch.cat([s["prompt_ids"], s["completion_ids"]], dim=1)
        am = torch.cat([s["prompt_mask"], s["completion_mask"]], dim=1)
        lp = completion_logps(model, ids, am, T)
        seqs.append((lp * s["completion_mask"]).sum(-1, keepdim=True))
    seq = torch.cat(seqs)
    loss = F.implicit_prm_loss(
        prm_logps=seq,
        ref_logps=seq.detach(),
        mask=torch.ones_like(seq, dtype=torch.bool),
        labels=outcome,
        beta=0.05,
        loss_type="dpo",
        group_ids=torch.arange(6) // 2,
    )
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    loss.backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert prm_steps[0]["grad_norm"] == pytest.approx(expected.item(), rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_two_processes_oversampling_regroups_rows_across_ranks(tiny_model_path, tmp_path, mode):
    """oversample_factor=2 with 3 rows per rank and K=2: each round generates 6 groups (6 rows per rank), every group
    passes (filter open), the first 3 train (all on rank 0 as generated); compacted back to 3 rows per rank, the
    selected rows dealt out in turn: rank 0 trains generated rows 0, 2, 4 and rank 1 rows 1, 3, 5, all weighted."""
    if mode == "zero3":
        pytest.importorskip("deepspeed")
    out = str(tmp_path / f"{mode}_oversample")
    summary = _launch(mode, tiny_model_path, out, "--oversample_factor", "2")
    _check_logs(summary)
    assert [h["filter/kept_groups"] for h in summary["logs"]] == [3.0, 3.0]
    assert [h["filter/kept_fraction"] for h in summary["logs"]] == [1.0, 1.0]
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for step in range(2):
        generated = ranks[0]["steps"][step]["prompts"] + ranks[1]["steps"][step]["prompts"]
        assert len(generated) == 12
        seen = [ranks[r]["compacted"][step] for r in range(2)]
        assert [len(s["texts"]) for s in seen] == [3, 3]
        # TRL shuffles each rank's rows after the step: compare each rank's rows as a multiset
        # the first 6 generated rows dealt out in turn: rank 0 rows 0, 2, 4; rank 1 rows 1, 3, 5
        for r, part in enumerate((generated[0:6:2], generated[1:6:2])):
            assert sorted(t.strip() for t in seen[r]["texts"]) == sorted(str(p).strip() for p in part)
        assert all(bool(s["weighted"].all()) for s in seen)
        assert seen[0]["num_items"] == seen[1]["num_items"] > 0
