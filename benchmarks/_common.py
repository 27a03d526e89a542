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
