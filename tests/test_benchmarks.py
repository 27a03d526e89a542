"""Smoke tests: each benchmark script of benchmarks/ runs end to end on the tiny model (not timed, nothing asserted
about speed) and prints its summary line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=600):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_step_overhead_runs_on_the_tiny_model(tmp_path):
    out = _run(
        "step_overhead.py",
        "--model",
        "tiny",
        "--configs",
        "rloo,prime_rloo",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--max-completion-length",
        "8",
        "--json",
        str(tmp_path / "r.json"),
    )
    last = out.strip().splitlines()[-1]
    assert last.startswith("overhead: PRIME/RLOO = "), out
    assert float(last.split("=")[1]) > 0
    for phase in ("generation", "verification", "old_logps", "reference", "prm_update", "policy_update"):
        assert phase in out
    assert (tmp_path / "r.json").is_file()


def test_memory_runs_on_the_tiny_model():
    out = _run(
        "memory.py",
        "--model",
        "tiny",
        "--configs",
        "grpo_lora,prime_lora",
        "--steps",
        "1",
        "--max-completion-length",
        "8",
    )
    assert "memory: PRIME-LoRA/GRPO-LoRA = " in out and "adapters_disabled reference" in out


def test_verifiers_runs():
    out = _run("verifiers.py", "--math-answers", "16", "--math-batch", "8", "--code-programs", "2")
    assert "answers/s" in out and "programs/s" in out


def test_gpu_check_runs_on_cpu_with_the_tiny_model(tmp_path):
    """benchmarks/gpu_check.py end to end with ``--device cpu --model tiny``: one table with a row per configuration
    (the 4-bit row where bitsandbytes is importable), positive step times and memory, and the JSON file."""
    import importlib.util
    import json

    out = _run(
        "gpu_check.py",
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--max-completion-length",
        "8",
        "--json",
        str(tmp_path / "g.json"),
        timeout=900,
    )
    with_4bit = importlib.util.find_spec("bitsandbytes") is not None
    expected = ["rloo", "prime_rloo", "grpo_lora", "prime_lora"] + (["prime_lora_4bit"] if with_4bit else [])
    table = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| row ")]
    assert [line.split("|")[1].strip() for line in table] == expected, out
    for line in table:
        step_s, peak = (float(c) for c in line.split("|")[2:4])
        assert step_s > 0 and peak > 0, line
    assert "step time" in table[1] and "x rloo" in table[1]
    assert "peak memory" in table[3] and "x grpo_lora" in table[3]
    assert ("4-bit: bitsandbytes present" if with_4bit else "4-bit: skipped") in out
    assert out.strip().splitlines()[-1].startswith("gpu_check: done in ")
    summary = json.loads((tmp_path / "g.json").read_text())
    assert list(summary["rows"]) == expected


def _wheel(folder, name="gcdemo", value=42):
    """A minimal pure-Python wheel holding module ``name`` with ``VALUE = value``."""
    import zipfile

    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {value}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def test_gpu_check_installs_missing_packages_from_carried_wheels(tmp_path, monkeypatch):
    """--wheels DIR: every wheel of DIR is installed offline into DIR/site, which goes on sys.path and PYTHONPATH (the
    worker processes import from it); a second call reuses the install."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    site = gpu_check.install_wheels(str(wheels))
    assert site == str(wheels / "site") and sys.path[0] == site
    assert os.environ["PYTHONPATH"] == os.pathsep.join([site, "/elsewhere"])
    proc = subprocess.run(
        [sys.executable, "-c", "import gcdemo; print(gcdemo.VALUE)"], capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip() == "42", proc.stderr
    assert (wheels / "site" / ".gpu_check_installed").read_text() == "gcdemo-1.0-py3-none-any.whl"
    with pytest.raises(SystemExit, match="no .whl files"):
        gpu_check.install_wheels(str(tmp_path))
