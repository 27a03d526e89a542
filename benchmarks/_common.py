"""Shared helpers of the benchmarks: environment, machine description, models (tiny, embedded, smaller PRM)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(k, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

DEFAULT_MODEL = "embedded:smollm2-135m-instruct"


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16")

# two-sided 95% quantiles of Student's t (df 1..30, then 40, 60, 120; a df between two keys uses the smaller key,
# i.e. the wider interval)
T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
    21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
    40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (NaN for ``df < 1``; 1.96 beyond 120)."""
    if df < 1:
        return float("nan")
    if df > 120:
        return 1.96
    return T975[max(k for k in T975 if k <= df)]


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of positive paired ratios and its 95% t-interval ``(mean, low, high)``, computed on their logs
    (a ratio's interval is symmetric in log space: 1.10 and 1/1.10 are equally far from 1). NaN bounds for fewer than
    two ratios."""
    import math
    import statistics

    logs = [math.log(x) for x in ratios if x > 0 and math.isfinite(x)]
    if not logs:
        return float("nan"), float("nan"), float("nan")
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(m), float("nan"), float("nan")
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def cpu_features(cpuinfo: str | None = None) -> dict:
    """The CPU's vector / matrix flags that decide bf16 speed, from ``/proc/cpuinfo`` (``cpuinfo``: its text, for
    tests) and from torch's own checks where this torch has them, plus ``native_bf16``: whether bf16 matmuls run on
    native hardware (AVX512-BF16 or AMX-BF16), else they are emulated (several times slower than fp32)."""
    import torch

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    out = {"cpuinfo": {f: f in flags for f in CPU_FLAGS} if flags else None}
    checks = {
        "capability": lambda: torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": lambda: torch.cpu._is_avx512_bf16_supported(),
        "amx_tile": lambda: torch.cpu._is_amx_tile_supported(),
        "mkldnn": lambda: torch.backends.mkldnn.is_available(),
    }
    torch_checks = {}
    for name, fn in checks.items():
        try:
            torch_checks[name] = fn()
        except (AttributeError, RuntimeError):
            torch_checks[name] = None
    out["torch"] = torch_checks
    from_cpuinfo = bool(flags & {"avx512_bf16", "amx_bf16"})
    from_torch = bool(torch_checks["avx512_bf16"]) or (bool(torch_checks["amx_tile"]) and "amx_bf16" in flags)
    # torch's check reads CPUID itself; /proc/cpuinfo is the fallback where that check is missing
    out["native_bf16"] = from_torch if torch_checks["avx512_bf16"] is not None else from_cpuinfo
    return out


def machine() -> dict:
    """Machine and library versions, for the results table."""
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    info["cpu_features"] = cpu_features()
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformers", "trl", "peft", "accelerate", "math-verify", "trl-prime"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["git"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001
        info["git"] = None
    return info


def resolve_model(name: str, workdir: str | None = None) -> str:
    """``tiny`` (built offline with tests/tiny.py), ``embedded:<key>``, a local folder or a Hub id."""
    if name == "tiny":
        from tiny import build_tiny_model

        folder = Path(workdir or tempfile.mkdtemp(prefix="bench_tiny_")) / "tiny"
        if not (folder / "config.json").is_file():
            build_tiny_model(folder)
        return str(folder)
    from trl_prime.models import resolve_model_path

    return resolve_model_path(name)


def truncated_copy(path: str, num_layers: int, out_dir: str) -> str:
    """A smaller checkpoint sharing ``path``'s tokenizer: its first ``num_layers`` decoder layers (embeddings, final
    norm and LM head kept). Used as the smaller PRM (PRIME Table 5: reward models of different sizes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = model.config.num_hidden_layers
    if not 1 <= num_layers < n:
        raise ValueError(f"num_layers={num_layers} must be in [1, {n - 1}] for a model with {n} layers")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return str(out)


def dump(obj, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2, default=str))
