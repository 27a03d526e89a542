"""Smoke tests: each benchmark script of benchmarks/ runs end to end on the tiny model (not timed, nothing asserted
about speed) and prints its summary line."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=600):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_step_overhead_runs_on_the_tiny_model(tmp_path):
    out = _run("step_overhead.py", "--model", "tiny", "--configs", "rloo,prime_rloo", "--warmup", "0", "--steps", "1",
               "--max-completion-length", "8", "--json", str(tmp_path / "r.json"))
    last = out.strip().splitlines()[-1]
    assert last.startswith("overhead: PRIME/RLOO = "), out
    assert float(last.split("=")[1]) > 0
    for phase in ("generation", "verification", "old_logps", "reference", "prm_update", "policy_update"):
        assert phase in out
    assert (tmp_path / "r.json").is_file()


def test_memory_runs_on_the_tiny_model():
    out = _run("memory.py", "--model", "tiny", "--configs", "grpo_lora,prime_lora", "--steps", "1",
               "--max-completion-length", "8")
    assert "memory: PRIME-LoRA/GRPO-LoRA = " in out and "adapters_disabled reference" in out


def test_verifiers_runs():
    out = _run("verifiers.py", "--math-answers", "16", "--math-batch", "8", "--code-programs", "2")
    assert "answers/s" in out and "programs/s" in out
