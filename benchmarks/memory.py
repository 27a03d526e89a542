"""Peak memory of GRPO-LoRA vs PRIME-LoRA (policy and PRM as two adapters on one base) vs PRIME with three full
models (issue 7).

Each configuration trains ``--steps`` steps in its own subprocess (same model, prompts, batch, seed and completion
length as ``step_overhead.py``). On CPU the measure is the process's peak resident set size (``ru_maxrss``), also shown
minus the RSS the process had after its imports (interpreter, torch, TRL: the same for every configuration); on a GPU
it is ``torch.cuda.max_memory_allocated``.

On CPU, glibc's malloc raises its mmap threshold after a large block is freed (up to 32 MiB), so the activation
buffers of one forward + backward, once freed, stay resident in the heap and a later pass with other block sizes adds
to them: the peak RSS then counts memory that is no longer live. The workers therefore run with
``MALLOC_MMAP_THRESHOLD_=131072`` and ``MALLOC_TRIM_THRESHOLD_=131072`` (fixed thresholds: large blocks are mapped and
returned on free), so RSS follows live memory as ``max_memory_allocated`` does on a GPU. ``--default-malloc`` keeps
glibc's defaults (what a plain CPU run sees); an allocator setting already in the environment is kept.

- ``grpo_lora``: TRL's ``GRPOTrainer`` with a LoRA ``peft_config`` (beta 0: no reference).
- ``prime_lora``: ``PrimeGRPOTrainer`` with the same ``peft_config``: the PRM is a second adapter ``"prm"`` with its
  own AdamW, the PRM's reference is the base with adapters disabled -- one base model.
- ``prime_full``: ``PrimeGRPOTrainer`` without PEFT: policy, PRM and reference are three full models, policy and PRM
  with full AdamW states.
- ``grpo_full``: TRL's ``GRPOTrainer`` without PEFT, for scale.
- ``prime_lora_4bit``: ``prime_lora`` on a 4-bit base (bitsandbytes NF4 through ``model_init_kwargs``; compute dtype
  bfloat16 with ``--bf16``, else float32). Needs ``bitsandbytes``.

Each worker also reports its median seconds per training step (``step_seconds``).

Examples::

    python benchmarks/memory.py --quick        # embedded SmolLM2-135M, 128 tokens, 1 step each
    python benchmarks/memory.py --model tiny --steps 1
    python benchmarks/memory.py --device cuda --model Qwen/Qwen2.5-1.5B-Instruct --max-completion-length 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


CONFIGS = ("grpo_lora", "prime_lora", "prime_full", "grpo_full", "prime_lora_4bit")
# the default run: every configuration that needs nothing beyond the core dependencies
DEFAULT_CONFIGS = ("grpo_lora", "prime_lora", "prime_full", "grpo_full")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(opts) -> None:
    import resource

    import torch

    torch.set_num_threads(opts.threads)
    import statistics

    import trl
    from peft import LoraConfig
    from transformers import TrainerCallback

    import trl_prime
    from trl_prime.rewards import math_reward

    base_rss = _rss_mib()
    name = opts.worker
    prime = name.startswith("prime")
    cls = trl_prime.PrimeGRPOTrainer if prime else trl.GRPOTrainer
    cfg_cls = trl_prime.PrimeGRPOConfig if prime else trl.GRPOConfig
    on_gpu = opts.device != "cpu"
    T = opts.max_completion_length
    kw = dict(
        output_dir=tempfile.mkdtemp(prefix=f"bench_mem_{name}_"),
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        seed=opts.seed,
        use_cpu=not on_gpu,
        bf16=on_gpu and opts.bf16,
        gradient_checkpointing=False,
        per_device_train_batch_size=opts.batch,
        num_generations=opts.num_generations,
        max_completion_length=T,
        max_steps=opts.steps,
        learning_rate=5e-7,
        beta=0.0,
        generation_kwargs={"min_new_tokens": T},
    )
    if prime:
        kw.update(filter_lower=0.0, filter_upper=1.0)  # the PRM is updated every step
    if name.endswith("_4bit"):
        from transformers import BitsAndBytesConfig

        compute = torch.bfloat16 if on_gpu and opts.bf16 else torch.float32
        kw["model_init_kwargs"] = {
            "dtype": compute,
            "quantization_config": BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
            ),
        }
    extra = {}
    if "lora" in name:
        extra["peft_config"] = LoraConfig(
            r=opts.lora_r, lora_alpha=2 * opts.lora_r, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    if opts.model_path.endswith("/tiny") or opts.dataset == "tiny":
        from tiny import tiny_prompt_dataset

        ds = tiny_prompt_dataset(64)
    else:
        from trl_prime.data import load_prompt_dataset

        ds = load_prompt_dataset(opts.dataset, size=64, seed=opts.seed)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    step_seconds = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - self.t0)

    t0 = time.perf_counter()
    trainer = cls(
        model=opts.model_path,
        reward_funcs=math_reward,
        args=cfg_cls(**kw),
        train_dataset=ds,
        callbacks=[StepTimer()],
        **extra,
    )
    trainer.train()
    out = {
        "config": name,
        "seconds": time.perf_counter() - t0,
        "base_rss_mib": base_rss,
        "step_seconds": statistics.median(step_seconds) if step_seconds else float("nan"),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }
    if prime:
        out["prm_trainable_params"] = sum(p.numel() for p in trainer.implicit_prm.trainable_parameters())
        out["prm_reference"] = trainer.implicit_prm.reference
    if on_gpu:
        out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(opts.out).write_text(json.dumps(out))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_common.DEFAULT_MODEL, help="'tiny', embedded:<key>, a folder or a Hub id")
    p.add_argument("--dataset", default="embedded:arithmetic", help="prompt set (trl_prime.data.load_prompt_dataset)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU: torch.cuda.max_memory_allocated)")
    p.add_argument("--bf16", action="store_true", help="bf16 on GPU")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--batch", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (K)")
    p.add_argument("--max-completion-length", type=int, default=128, help="tokens; completions are forced to it")
    p.add_argument("--steps", type=int, default=2, help="training steps per configuration")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank of the *_lora configurations (all linear layers)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="embedded default model, 128 tokens, batch 8, 1 step (overrides those options)",
    )
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's dynamic mmap/trim thresholds in the workers (peak RSS then includes freed heap)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        _worker(opts)
        return {}
    if opts.quick:
        opts.model, opts.max_completion_length, opts.batch, opts.steps = _common.DEFAULT_MODEL, 128, 8, 1
    configs = [c.strip() for c in opts.configs.split(",") if c.strip()]
    bad = set(configs) - set(CONFIGS)
    if bad or not configs:
        p.error(
            f"unknown configs {sorted(bad)}; known: {list(CONFIGS)}"
            if bad
            else f"--configs is empty; choose from {list(CONFIGS)}"
        )
    for name in ("steps", "batch", "num_generations", "max_completion_length", "lora_r", "threads"):
        if getattr(opts, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if any(c.endswith("_4bit") for c in configs):
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            p.error("the *_4bit configurations need bitsandbytes: pip install -e '.[bitsandbytes]'")
    work = tempfile.mkdtemp(prefix="bench_mem_")
    model_path = _common.resolve_model(opts.model, work)
    results = {}
    for name in configs:
        out = os.path.join(work, f"{name}.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            name,
            "--model-path",
            model_path,
            "--out",
            out,
            "--device",
            opts.device,
            "--dataset",
            opts.dataset,
            "--batch",
            str(opts.batch),
            "--num-generations",
            str(opts.num_generations),
            "--max-completion-length",
            str(opts.max_completion_length),
            "--steps",
            str(opts.steps),
            "--lora-r",
            str(opts.lora_r),
            "--threads",
            str(opts.threads),
            "--seed",
            str(opts.seed),
        ]
        if opts.bf16:
            cmd.append("--bf16")
        env = dict(os.environ)
        if not opts.default_malloc:
            env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
            env.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"worker {name} failed (exit {proc.returncode})")
        r = json.loads(Path(out).read_text())
        results[name] = r
        gpu = f", CUDA max allocated {r['cuda_max_allocated_mib']:.0f} MiB" if "cuda_max_allocated_mib" in r else ""
        print(
            f"{name:<11} peak RSS {r['peak_rss_mib']:7.0f} MiB (after imports {r['base_rss_mib']:5.0f} MiB, "
            f"training {r['peak_rss_mib'] - r['base_rss_mib']:7.0f} MiB){gpu}  trainable {r['trainable_params']:,}"
            + (
                f" + PRM {r['prm_trainable_params']:,} ({r['prm_reference']} reference)"
                if "prm_reference" in r
                else ""
            )
            + f"  [{r['seconds']:.0f} s]",
            flush=True,
        )
    key = "cuda_max_allocated_mib" if opts.device != "cpu" else "peak_rss_mib"
    ratios = {}
    for a, b in (
        ("prime_lora", "grpo_lora"),
        ("prime_full", "grpo_lora"),
        ("prime_full", "grpo_full"),
        ("prime_lora_4bit", "prime_lora"),
    ):
        if a in results and b in results:
            ratios[f"{a}/{b}"] = results[a][key] / results[b][key]
            if key == "peak_rss_mib":
                inc = (results[a][key] - results[a]["base_rss_mib"]) / (results[b][key] - results[b]["base_rss_mib"])
                ratios[f"{a}/{b} (training increment)"] = inc
    print()
    print(
        f"model {opts.model}  device {opts.device}  batch {opts.batch}  completion {opts.max_completion_length} "
        f"tokens  {opts.steps} step(s)  LoRA r={opts.lora_r} all-linear  malloc "
        f"{'glibc defaults' if opts.default_malloc else 'fixed mmap/trim thresholds (128 KiB)'}"
    )
    for k, v in ratios.items():
        print(f"memory ratio {k:<42} = {v:.2f}")
    summary = {"options": vars(opts), "machine": _common.machine(), "results": results, "ratios": ratios}
    _common.dump(summary, opts.json)
    if "prime_lora/grpo_lora" in ratios:
        print(f"memory: PRIME-LoRA/GRPO-LoRA = {ratios['prime_lora/grpo_lora']:.2f}")
    return summary


if __name__ == "__main__":
    main()
