"""Smoke tests: each benchmark script of benchmarks/ runs end to end on the tiny model (not timed, nothing asserted
about speed) and prints its summary line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT


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
    """Two rounds of two timed steps: the ratio's 95% interval over the 4 paired steps, the floor from the same run and
    PRIME / floor (the geometric mean of the per-step ratios over the per-step floors: the ratio of the two means),
    CPU flags and load in the JSON."""
    import json
    import math
    import re

    out = _run(
        "step_overhead.py",
        "--model",
        "tiny",
        "--configs",
        "rloo,prime_rloo",
        "--warmup",
        "0",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--max-completion-length",
        "8",
        "--json",
        str(tmp_path / "r.json"),
    )
    last = out.strip().splitlines()[-1]
    num = r"(\d+\.\d+)"
    m = re.fullmatch(
        rf"overhead: PRIME/RLOO = {num} \[95% {num}, {num}\]; floor {num}; PRIME/floor = {num} \[95% {num}, {num}\]",
        last,
    )
    assert m, out
    ratio, low, high, floor, over, over_low, over_high = (float(x) for x in m.groups())
    assert 0 < low <= ratio <= high and 0 < over_low <= over <= over_high
    assert floor > 1.0 and over == pytest.approx(ratio / floor, abs=2e-3)
    for phase in ("generation", "verification", "old_logps", "reference", "prm_update", "policy_update"):
        assert phase in out
    assert "CPU s/step" in out and "page faults/step" in out
    summary = json.loads((tmp_path / "r.json").read_text())
    r = summary["ratios"]["prime_rloo/rloo"]
    assert r["n"] == 4 and len(r["per_step"]) == 4 and len(r["per_round"]) == 2
    assert (r["mean"], r["low"], r["high"]) == pytest.approx((ratio, low, high), abs=1e-3)
    steps = [s for rnd in summary["raw"]["rloo"] for s in rnd]
    floors = [1 + s["policy_update"] / s["step"] for s in steps]
    assert summary["floor"]["floor"]["mean"] == pytest.approx(math.exp(sum(math.log(f) for f in floors) / 4))
    assert all(s["cpu"]["step"] > 0 and s["minflt"]["step"] >= 0 for s in steps)
    feats = summary["machine"]["cpu_features"]
    assert isinstance(feats["native_bf16"], bool) and "avx512_bf16" in feats["torch"]
    assert len(summary["load"]["per_process"]) == 4


def test_ratio_interval_and_t_quantiles():
    """Hand-computed: ratios 1.1 and 1.1 * e^0.02 (log mean log(1.1) + 0.01, log sd 0.02 / sqrt(2)), t(1) = 12.706."""
    import math
    import statistics

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _common

    mean, low, high = _common.ratio_interval([1.1, 1.1 * math.exp(0.02)])
    half = 12.706 * (0.02 / math.sqrt(2)) / math.sqrt(2)
    assert mean == pytest.approx(1.1 * math.exp(0.01))
    assert (low, high) == pytest.approx((mean * math.exp(-half), mean * math.exp(half)))
    assert _common.ratio_interval([1.3])[0] == pytest.approx(1.3) and math.isnan(_common.ratio_interval([1.3])[1])
    assert _common.t975(2) == 4.303 and _common.t975(35) == 2.042 and _common.t975(500) == 1.96
    assert math.isnan(_common.t975(0))
    ratios = [1.40, 1.45, 1.42, 1.47, 1.44, 1.43, 1.46, 1.41, 1.45, 1.44]  # n = 10: t(9) = 2.262
    logs = [math.log(x) for x in ratios]
    half = 2.262 * statistics.stdev(logs) / math.sqrt(10)
    assert _common.ratio_interval(ratios)[2] == pytest.approx(math.exp(statistics.fmean(logs) + half))


CPUINFO = "processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse2 avx2 {extra}\n"


def test_cpu_features_reads_the_flags(monkeypatch):
    """/proc/cpuinfo's flags line; torch's own checks decide native bf16 where they exist, else the flags."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _common

    feats = _common.cpu_features(CPUINFO.format(extra="avx512f avx512_bf16 amx_tile amx_bf16"))
    assert feats["cpuinfo"] == {
        "avx2": True,
        "avx512f": True,
        "avx512_bf16": True,
        "amx_tile": True,
        "amx_bf16": True,
        "avx512_fp16": False,
    }
    assert set(feats["torch"]) == {"capability", "avx512_bf16", "amx_tile", "mkldnn"}
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert _common.cpu_features(CPUINFO.format(extra="avx512_bf16"))["native_bf16"] is False  # torch says no
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert _common.cpu_features(CPUINFO.format(extra="amx_tile amx_bf16"))["native_bf16"] is True
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # an older torch: the flags decide
    assert _common.cpu_features(CPUINFO.format(extra="avx512_bf16"))["native_bf16"] is True
    assert _common.cpu_features(CPUINFO.format(extra="avx512f"))["native_bf16"] is False
    assert _common.cpu_features("")["cpuinfo"] is None


def test_step_overhead_refuses_bf16_on_a_cpu_without_native_bf16(monkeypatch, capsys):
    """--bf16 on a CPU without AVX512-BF16 / AMX-BF16: refused before any worker starts (bf16 would be emulated)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _common
    import step_overhead

    fake = {"cpuinfo": {"avx2": True, "avx512_bf16": False}, "torch": {"avx512_bf16": False}, "native_bf16": False}
    monkeypatch.setattr(_common, "cpu_features", lambda: fake)
    with pytest.raises(SystemExit) as exc:
        step_overhead.main(["--model", "tiny", "--configs", "rloo,prime_rloo", "--bf16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--bf16 on CPU needs native bf16 (AVX512-BF16 or AMX-BF16)" in err and "Run without --bf16" in err


def _native_bf16() -> bool:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import _common

    return _common.cpu_features()["native_bf16"]


@pytest.mark.skipif(
    not _native_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 / AMX-BF16): --bf16 is refused"
)
def test_step_overhead_runs_bf16_on_a_cpu_with_native_bf16(tmp_path):
    import json

    out = _run(
        "step_overhead.py",
        "--model",
        "tiny",
        "--configs",
        "rloo,prime_rloo",
        "--bf16",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--max-completion-length",
        "8",
        "--json",
        str(tmp_path / "b.json"),
    )
    assert "bf16 autocast" in out and out.strip().splitlines()[-1].startswith("overhead: PRIME/RLOO = ")
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["options"]["bf16"] is True and summary["machine"]["cpu_features"]["native_bf16"] is True


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


def test_step_overhead_times_the_value_update_of_the_ppo_rows(tmp_path):
    """PRIME Table 4's PPO rows (issue 16): the value model's update is its own phase, absent (0) for the implicit PRM
    as value and for RLOO."""
    import json

    _run(
        "step_overhead.py",
        "--model",
        "tiny",
        "--configs",
        "rloo,prime_ppo,prime_as_value",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--max-completion-length",
        "8",
        "--json",
        str(tmp_path / "r.json"),
    )
    summary = json.loads((tmp_path / "r.json").read_text())
    value = {c: s["value_update"] for c in ("rloo", "prime_ppo", "prime_as_value") for s in summary["raw"][c][0]}
    assert value["prime_ppo"] > 0.0 and value["prime_as_value"] == 0.0 and value["rloo"] == 0.0
    assert set(summary["ratios"]) == {"prime_ppo/rloo", "prime_as_value/rloo"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_learning_benchmark_oracle_row_end_to_end(tmp_path):
    """benchmarks/learning.py with the rows issue 26 reads (rloo, prime_rloo_oracle), 2 seeds x 2 steps on the cached
    warm start (built once, ~3 min): the JSON keeps its fields and adds the new ones; the oracle's logged pair accuracy
    is its exact ranking (every value 0.5 or above: 1 on mixed groups, 0.5 on uniform ones)."""
    import json

    out = _run(
        "learning.py",
        "--methods",
        "rloo,prime_rloo_oracle",
        "--seeds",
        "2",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--heldout",
        "16",
        "--workers",
        "1",
        "--no-offline-prm",
        "--json",
        str(tmp_path / "l.json"),
        timeout=1200,
    )
    assert "Task: 4x1 (4 operands of 1 digit, 3 dependent steps)" in out
    result = json.loads((tmp_path / "l.json").read_text())
    assert result["task"]["difficulty"] == "4x1" and result["settings"]["eval_every"] == 1
    oracle, rloo = result["methods"]["prime_rloo_oracle"], result["methods"]["rloo"]
    assert oracle["seeds"] == rloo["seeds"] == [0, 1] and oracle["steps"] == [0, 1, 2]
    assert rloo["prm_pair_accuracy"] is None and len(oracle["prm_pair_accuracy"]) == 2
    assert all(len(p) == 2 and all(a >= 0.5 for a in p) for p in oracle["prm_pair_accuracy"])
    for secs in oracle["train_seconds"] + rloo["train_seconds"]:
        assert len(secs) == 3 and secs[0] < secs[1] < secs[2]
    assert any(c[0].startswith("(headroom)") for c in result["claims"])
