"""One GPU check in one command: PRIME's step time and memory on a 0.5B Qwen2-shaped model with random weights.

Meant for a GPU machine that has nothing but Python and PyTorch (no Hub, maybe no network): it installs the project's
other dependencies from wheels carried next to it (``--wheels DIR``) when they are missing, builds the model from a
config (Qwen2.5-0.5B's shapes: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied 151,936-token
vocabulary; random weights) with an offline tokenizer of the same vocabulary size (tests/tiny.py's byte-level BPE,
padded with unused tokens), and runs, each configuration in its own process (the machinery of ``step_overhead.py``
and ``memory.py``):

- ``rloo`` / ``prime_rloo``: seconds per step of TRL's RLOO and of PRIME-RLOO (full models, HF ``generate``,
  completions forced to ``--max-completion-length`` tokens, same seeds);
- ``grpo_lora`` / ``prime_lora``: peak GPU memory (``torch.cuda.max_memory_allocated``) of GRPO-LoRA and PRIME-LoRA
  (policy and PRM as two adapters on one base);
- ``prime_lora_4bit``: PRIME-LoRA on a bitsandbytes NF4 base (only where ``bitsandbytes`` is importable).

On CUDA everything runs in bf16 (weights and ``bf16=True``); ``--fp32`` turns that off. It prints one summary table
(and writes every measurement with ``--json``). The defaults (batch 8 = 2 prompts x K=4, 256-token completions,
1 warm-up + 2 timed steps, 2 steps for memory) are sized to finish in a few minutes on one modern GPU.

Preparing the wheel folder (on any machine with network, for the GPU machine's Python version and platform)::

    python benchmarks/gpu_check.py --print-requirements > gpu_requirements.txt   # exact pins, torch excluded
    pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \\
        -r gpu_requirements.txt -d wheels/
    # copy the repository and wheels/ to the GPU machine, then:
    python benchmarks/gpu_check.py --wheels wheels/

Examples::

    python benchmarks/gpu_check.py                                   # CUDA, 0.5B model, dependencies installed
    python benchmarks/gpu_check.py --wheels wheels/ --json gpu.json  # installs what is missing from wheels/
    python benchmarks/gpu_check.py --device cpu --model tiny --steps 1 --max-completion-length 8   # a smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: Qwen2.5-0.5B's shapes (its config.json), with random weights
QWEN2_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
#: the modules a run imports beyond torch (import name -> distribution)
REQUIRED = {
    "trl": "trl",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "peft": "peft",
    "datasets": "datasets",
    "math_verify": "math-verify",
    "tokenizers": "tokenizers",
    "packaging": "packaging",
}
ROWS = ("rloo", "prime_rloo", "grpo_lora", "prime_lora", "prime_lora_4bit")


# --------------------------------------------------------------------------------------------------------------
# Dependencies from carried wheels
# --------------------------------------------------------------------------------------------------------------
def missing_modules() -> list[str]:
    return [m for m in REQUIRED if importlib.util.find_spec(m) is None]


def _closure(root: str) -> dict[str, str]:
    """The installed distributions ``root`` needs (its non-extra requirements, recursively): name -> version."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, str] = {}
    todo = [root]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        seen[name] = dist.version
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def print_requirements() -> None:
    """Exact pins of what a run needs beyond torch (this environment's versions): the wheels to carry."""
    needed = {}
    for dist in [*REQUIRED.values(), "bitsandbytes"]:
        needed.update(_closure(dist))
    torch_side = _closure("torch")  # a PyTorch install already has these
    for name in sorted(needed):
        if name not in torch_side and not name.startswith("nvidia-"):
            print(f"{name}=={needed[name].split('+')[0]}")


def install_wheels(wheels: str, target: str | None = None) -> str:
    """Install every wheel of ``wheels`` into ``target`` (default ``<wheels>/site``), offline and without dependency
    resolution, put it first on ``sys.path`` and on ``PYTHONPATH`` (for the worker processes); return ``target``.

    Uses ``pip install --no-index --no-deps --find-links``; without pip, unpacks the wheels (a wheel is a zip of its
    installed files).
    """
    folder = Path(wheels).resolve()
    files = sorted(folder.glob("*.whl"))
    if not files:
        raise SystemExit(f"--wheels {wheels}: no .whl files there (see this script's docstring to prepare them)")
    site = Path(target or folder / "site").resolve()
    marker = site / ".gpu_check_installed"
    if not marker.is_file():
        site.mkdir(parents=True, exist_ok=True)
        if importlib.util.find_spec("pip") is not None:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--find-links",
                str(folder),
                "--target",
                str(site),
                *map(str, files),
            ]
            print("installing", len(files), "wheels:", " ".join(cmd[:9]), "...", flush=True)
            subprocess.run(cmd, check=True)
        else:
            print(f"no pip: unpacking {len(files)} wheels into {site}", flush=True)
            for f in files:
                with zipfile.ZipFile(f) as z:
                    z.extractall(site)
        marker.write_text("\n".join(f.name for f in files))
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    return str(site)


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------
def build_qwen2_05b(path: str, dtype_name: str = "float32", seed: int = 0) -> str:
    """Write a Qwen2.5-0.5B-shaped causal LM with random weights and a matching offline tokenizer to ``path``.

    The tokenizer is tests/tiny.py's byte-level BPE with unused tokens appended, so that its vocabulary has exactly
    ``QWEN2_05B["vocab_size"]`` entries: every id the model samples decodes.
    """
    import torch
    from tiny import CHAT_TEMPLATE, build_tokenizer
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

    out = Path(path)
    if (out / "config.json").is_file():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    small = build_tokenizer()
    state = json.loads(small.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    for i in range(len(vocab), QWEN2_05B["vocab_size"] - 1):
        vocab[f"<unused_{i}>"] = i
    # the last id: the unk token AutoTokenizer's Qwen2 tokenizer adds on reload (else it would get id vocab_size)
    vocab["<|endoftext|>"] = QWEN2_05B["vocab_size"] - 1
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        padding_side="left",
        truncation_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(**QWEN2_05B, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    for key in ("pad_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tok, key))
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    reloaded = len(AutoTokenizer.from_pretrained(out))
    if reloaded != QWEN2_05B["vocab_size"]:
        raise RuntimeError(f"the tokenizer reloads with {reloaded} tokens, expected {QWEN2_05B['vocab_size']}")
    return str(out)


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------
def _fmt(x, spec) -> str:
    return "-" if x is None or x != x else format(x, spec)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke test, with --model tiny)")
    p.add_argument("--model", default="qwen2-0.5b", choices=["qwen2-0.5b", "tiny"])
    p.add_argument("--wheels", default=None, help="a folder of wheels to install missing dependencies from")
    p.add_argument("--fp32", action="store_true", help="on CUDA: float32 instead of bf16")
    p.add_argument("--batch", type=int, default=8, help="completions per step")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of rloo / prime_rloo")
    p.add_argument("--steps", type=int, default=2, help="timed steps (rloo, prime_rloo) and memory steps (LoRA rows)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--no-4bit", action="store_true", help="skip the 4-bit row even where bitsandbytes is present")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: 1 on CPU, 4 on CUDA)")
    p.add_argument("--workdir", default=None, help="where the model is built (reused when already there)")
    p.add_argument("--json", default=None, help="write every measurement to this file")
    p.add_argument(
        "--print-requirements",
        action="store_true",
        help="print the exact pins of the wheels to carry (this environment's versions) and exit",
    )
    opts = p.parse_args(argv)
    if opts.print_requirements:
        print_requirements()
        return {}
    started = time.time()
    if opts.wheels and missing_modules():
        install_wheels(opts.wheels)
    missing = missing_modules()
    if missing:
        raise SystemExit(
            f"missing Python packages: {', '.join(REQUIRED[m] for m in missing)}. Carry their wheels and pass "
            f"--wheels DIR; prepare DIR on a machine with network (Python {sys.version_info[0]}.{sys.version_info[1]} "
            "here): see the docstring of benchmarks/gpu_check.py (--print-requirements, then pip download)."
        )
    import torch

    on_gpu = opts.device != "cpu"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False; use --device cpu for a smoke test")
    bf16 = on_gpu and not opts.fp32
    threads = opts.threads or (4 if on_gpu else 1)

    sys.path.insert(0, str(HERE))
    import _common  # noqa: E402  (puts the repository and tests/ on sys.path, offline environment)
    import memory
    import step_overhead

    work = opts.workdir or tempfile.mkdtemp(prefix="gpu_check_")
    t0 = time.time()
    if opts.model == "tiny":
        model_path = _common.resolve_model("tiny", work)
    else:
        model_path = build_qwen2_05b(os.path.join(work, "qwen2_0.5b_random"), "bfloat16" if bf16 else "float32")
    build_s = time.time() - t0
    common = [
        "--model",
        model_path,
        "--dataset",
        "tiny",
        "--device",
        opts.device,
        "--batch",
        str(opts.batch),
        "--num-generations",
        str(opts.num_generations),
        "--max-completion-length",
        str(opts.max_completion_length),
        "--steps",
        str(opts.steps),
        "--threads",
        str(threads),
    ]
    if bf16:
        common.append("--bf16")

    print(f"== step time: rloo vs prime_rloo ({opts.model}, {opts.device})", flush=True)
    step = step_overhead.main([*common, "--configs", "rloo,prime_rloo", "--warmup", str(opts.warmup)])
    with_4bit = not opts.no_4bit and importlib.util.find_spec("bitsandbytes") is not None
    mem_configs = ["grpo_lora", "prime_lora"] + (["prime_lora_4bit"] if with_4bit else [])
    print(f"\n== memory: {', '.join(mem_configs)}", flush=True)
    mem = memory.main([*common, "--configs", ",".join(mem_configs), "--lora-r", str(opts.lora_r)])

    mem_key = "cuda_max_allocated_mib" if on_gpu else "peak_rss_mib"
    rows = {}
    for name in ("rloo", "prime_rloo"):
        meta = step["meta"].get(name, {})
        rows[name] = {"step_s": step["phases"]["step"][name], "peak_mib": meta.get(mem_key, meta.get("peak_rss_mib"))}
    for name in mem_configs:
        r = mem["results"][name]
        rows[name] = {"step_s": r["step_seconds"], "peak_mib": r[mem_key]}
    notes = {
        "prime_rloo": f"step time {step['ratios']['prime_rloo/rloo']['median']:.2f}x rloo",
        "prime_lora": f"peak memory {mem['ratios']['prime_lora/grpo_lora']:.2f}x grpo_lora",
    }
    if with_4bit:
        notes["prime_lora_4bit"] = f"peak memory {mem['ratios']['prime_lora_4bit/prime_lora']:.2f}x prime_lora"
    info = _common.machine()
    n_params = step["meta"].get("rloo", {}).get("policy_params")
    print()
    print("=" * 100)
    print(
        f"gpu_check: model {opts.model} ({n_params:,} parameters, random weights)  device {opts.device}"
        f"{' (' + info['gpu'] + ')' if info.get('gpu') else ''}  dtype {'bf16' if bf16 else 'fp32'}  "
        f"batch {opts.batch} (K={opts.num_generations})  completion {opts.max_completion_length} tokens  "
        f"{opts.steps} step(s)"
    )
    print(
        f"torch {info['torch']}  transformers {info['transformers']}  trl {info['trl']}  peft {info['peft']}"
        + (
            "  4-bit: bitsandbytes present"
            if with_4bit
            else "  4-bit: skipped (bitsandbytes not importable)"
            if not opts.no_4bit
            else "  4-bit: skipped (--no-4bit)"
        )
    )
    memory_label = "peak GPU MiB" if on_gpu else "peak RSS MiB"
    print(f"| {'row':<16} | {'s/step':>8} | {memory_label:>12} | {'note':<36} |")
    print(f"|{'-' * 18}|{'-' * 10}|{'-' * 14}|{'-' * 38}|")
    for name, r in rows.items():
        print(
            f"| {name:<16} | {_fmt(r['step_s'], '8.2f')} | {_fmt(r['peak_mib'], '12.0f')} | "
            f"{notes.get(name, ''):<36} |"
        )
    total = time.time() - started
    print(f"gpu_check: done in {total:.0f} s (model build {build_s:.0f} s)")
    summary = {
        "options": vars(opts),
        "machine": info,
        "rows": rows,
        "notes": notes,
        "step_overhead": step,
        "memory": mem,
        "seconds": total,
    }
    _common.dump(summary, opts.json)
    return summary


if __name__ == "__main__":
    main()
