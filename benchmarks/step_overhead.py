"""PRIME's cost per step over plain RLOO / GRPO, phase by phase (issues 7 and 19).

The same model, prompts, batch and seed go through TRL's ``RLOOTrainer``, ``PrimeRLOOTrainer`` (single and double
forward, and with a smaller PRM), TRL's ``GRPOTrainer`` and ``PrimeGRPOTrainer``, and PRIME Table 4's PPO rows on
``PrimeRLOOTrainer`` (``ppo``: a learned value model, ``process_coef=0``; ``prime_ppo``: with PRIME's process rewards;
``prime_as_value``: the implicit PRM as the value, no value model), compared with RLOO. Each configuration runs in its own
subprocess (so peak memory is one configuration's, and no state leaks between them), ``--warmup`` untimed steps then
``--steps`` timed ones; configurations are interleaved round-robin over ``--rounds`` rounds (the order rotates every
round) so that machine noise hits all of them alike. Before every step the torch seed is reset to ``seed + step``, so
that step ``i`` of every configuration samples the same completions; completions are forced to exactly
``--max-completion-length`` tokens (``min_new_tokens``; ``--natural-length`` turns that off) so every configuration
does the same work. Plain RLOO / GRPO run with ``beta=0`` (no KL, no reference model), as PRIME does. By default the
online prompt filter is opened to [0, 1], so PRIME trains on every row as RLOO does (the same-work comparison).
``--filter 0.2,0.8`` uses the paper's filter instead: PRIME's PRM update and policy update then skip the rows of
filtered prompts (the paper filters before both updates), and the table adds PRIME's ``kept_fraction`` per step;
``--skip-filtered-scoring`` also skips their reference and PRM forwards (``prm_score_filtered_rows=False``).

Phases (seconds per step, median over timed steps): ``generation`` (TRL ``_generate``), ``verification``
(``_calculate_rewards``: the math verifier), ``old_logps`` (TRL's rollout log-prob forward), ``reference`` (the PRM's
reference forward), ``value_update`` (the PPO rows' value model: forward + backward + optimizer step),
``prm_update`` (PRM forward + backward + optimizer step; with ``"double"`` also the second
forward, shown again as ``prm_second_forward``, which also counts a no-grad PRM forward of every scored row when the
filter kept no prompt at all), ``rollout_other`` (the rest of TRL's rollout step: advantages,
gathering, logging), ``policy_update`` (the policy's loss forward, backward and optimizer step: step time minus the
rollout step), ``step`` (the whole optimizer step). Each phase is also measured in the process's CPU seconds
(``time.process_time``: with one torch thread it tracks the wall time on an idle machine, and moves less than it when
other processes compete for the cores) and in minor page faults (memory freshly mapped by the allocator).

Statistics. Every timed step of a PRIME configuration is paired with the RLOO step of the same round and step index
(the same completions): the ratio is the geometric mean of the paired step-time ratios with its 95% t-interval
(computed on their logs), also for CPU time. The floor comes from the same run: per pair, ``1 + policy_update(RLOO) /
step(RLOO)`` (PRIME adds one PRM update, the work of one policy update on the same tokens, and swaps RLOO's rollout
log-prob forward for a reference forward of the same size), and ``PRIME / floor`` is the ratio over it, both with
their intervals. Pairs in one round share the machine's state at that time; more rounds average it out.

``--bf16`` is bf16 mixed precision (autocast; weights and optimizer states stay fp32): on the GPU, and on a CPU with
native bf16 (AVX512-BF16 or AMX-BF16, detected from torch's own checks and ``/proc/cpuinfo``; the JSON and the
output record the flags). On a CPU without it the option is refused: bf16 matmuls would be emulated, several times
slower than fp32, and the ratios would measure the emulation.

The output ends with ``overhead: PRIME/RLOO = R [95% lo, hi]; floor F; PRIME/floor = Q [95% lo, hi]``.
``--quick`` runs 1 warm-up + 4 timed steps of three configurations in one round (4 pairs); at the idle step times
of issue 19 (21 s RLOO, 33 s PRIME-RLOO, fp32) that is about 7 minutes on 2 cores. ``--precise`` runs the same over
three interleaved rounds (12 pairs). Neither has been timed end to end on an idle machine yet, so their interval
widths are not known; ``benchmarks/RESULTS.md`` has what was measured.

Examples::

    python benchmarks/step_overhead.py --quick                     # embedded SmolLM2-135M, 128 tokens, CPU
    python benchmarks/step_overhead.py --quick --bf16              # the same in bf16 (a CPU with native bf16)
    python benchmarks/step_overhead.py --precise                   # three rounds: a tighter interval
    python benchmarks/step_overhead.py                             # all six configurations, batch 8, 3 timed steps
    python benchmarks/step_overhead.py --model tiny --steps 3      # seconds, a smoke test
    python benchmarks/step_overhead.py --configs rloo,prime_rloo --batch 16 --filter 0.2,0.8   # the paper's filter
    python benchmarks/step_overhead.py --device cuda --model Qwen/Qwen2.5-0.5B-Instruct --max-completion-length 1024 \\
        --batch 32 --steps 5 --rounds 2 --prm-layers 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


CONFIGS = {
    # name: (trainer, PRIME options)
    "rloo": ("RLOOTrainer", None),
    "prime_rloo": ("PrimeRLOOTrainer", {"prm_update": "single"}),
    "prime_rloo_double": ("PrimeRLOOTrainer", {"prm_update": "double"}),
    "prime_rloo_small": ("PrimeRLOOTrainer", {"prm_update": "single", "small_prm": True}),
    "grpo": ("GRPOTrainer", None),
    "prime_grpo": ("PrimeGRPOTrainer", {"prm_update": "single"}),
    # PRIME Table 4: PPO with a learned value model (a copy of the policy), without and with PRIME's process
    # rewards, and the implicit PRM as the value (no value model)
    "ppo": ("PrimeRLOOTrainer", {"prm_update": "single", "prime_estimator": "ppo", "process_coef": 0.0}),
    "prime_ppo": ("PrimeRLOOTrainer", {"prm_update": "single", "prime_estimator": "ppo"}),
    "prime_as_value": (
        "PrimeRLOOTrainer",
        {"prm_update": "single", "prime_estimator": "ppo", "prime_value": "implicit_prm"},
    ),
}
BASELINE = {
    "prime_rloo": "rloo",
    "prime_rloo_double": "rloo",
    "prime_rloo_small": "rloo",
    "prime_grpo": "grpo",
    "ppo": "rloo",
    "prime_ppo": "rloo",
    "prime_as_value": "rloo",
}
METRICS = ("wall", "cpu", "minflt")  # seconds, process CPU seconds, minor page faults
PHASES = (
    "generation",
    "verification",
    "old_logps",
    "reference",
    "prm_update",
    "prm_second_forward",
    "value_update",
    "rollout_other",
    "policy_update",
    "step",
    "kept_fraction",
)


# --------------------------------------------------------------------------------------------------------------
# Worker: one configuration, warm-up + timed steps, in its own process
# --------------------------------------------------------------------------------------------------------------
def _counters() -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, its minor page faults so far)."""
    import resource

    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed_class(base):
    import torch

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class Timed(base):
        _bench_phases: dict = None  # metric ("wall", "cpu", "minflt") -> phase -> total of the step
        _bench_in_rollout = False

        def _bench(self, name, fn, *a, **k):
            sync()
            start = _counters()
            try:
                return fn(*a, **k)
            finally:
                sync()
                if self._bench_phases is not None:
                    for metric, t0, t1 in zip(METRICS, start, _counters()):
                        self._bench_phases[metric][name] += t1 - t0

        def _generate(self, prompts):
            return self._bench("generation", super()._generate, prompts)

        def _calculate_rewards(self, *a, **k):
            return self._bench("verification", super()._calculate_rewards, *a, **k)

        def _generate_and_score_completions(self, inputs):
            self._bench_in_rollout = True
            try:
                return self._bench("rollout", super()._generate_and_score_completions, inputs)
            finally:
                self._bench_in_rollout = False

        def _get_per_token_logps_and_entropies(self, model, *a, **k):
            if torch.is_grad_enabled() or not self._bench_in_rollout:
                return super()._get_per_token_logps_and_entropies(model, *a, **k)
            name = (
                "reference"
                if getattr(self, "ref_model", None) is not None and model is self.ref_model
                else "old_logps"
            )
            return self._bench(name, super()._get_per_token_logps_and_entropies, model, *a, **k)

        def _train_prm(self, *a, **k):
            return self._bench("prm_update", super()._train_prm, *a, **k)

        def _train_value(self, *a, **k):
            return self._bench("value_update", super()._train_value, *a, **k)

    return Timed


def _step_timer(opts, steps: list, holder: dict):
    """The callback timing every optimizer step of ``holder["trainer"]`` (wall, CPU, page faults per phase) into
    ``steps``; it resets the torch seed before each step, so step ``i`` samples the same completions everywhere."""
    import torch
    from transformers import TrainerCallback

    on_gpu = opts.device != "cpu"

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.manual_seed(opts.seed + state.global_step)
            holder["trainer"]._bench_phases = {m: defaultdict(float) for m in METRICS}
            if on_gpu:
                torch.cuda.synchronize()
            self.start = _counters()

        def on_step_end(self, args, state, control, **kwargs):
            if on_gpu:
                torch.cuda.synchronize()
            phases = holder["trainer"]._bench_phases
            for metric, t0, t1 in zip(METRICS, self.start, _counters()):
                ph = phases[metric]
                ph["step"] = t1 - t0
                ph["policy_update"] = ph["step"] - ph["rollout"]
                inner = sum(
                    ph[k]
                    for k in ("generation", "verification", "old_logps", "reference", "prm_update", "value_update")
                )
                ph["rollout_other"] = ph["rollout"] - inner
            extra = {m: dict(phases[m]) for m in METRICS[1:]}
            # kept_fraction: 1 for RLOO / GRPO (every row trains); PRIME's comes from its log (on_log)
            steps.append({"step": state.global_step, **phases["wall"], "kept_fraction": 1.0, **extra})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if steps and logs and "filter/kept_fraction" in logs:
                steps[-1]["kept_fraction"] = logs["filter/kept_fraction"]

    return StepTimer()


def _worker(opts) -> None:
    import torch

    torch.set_num_threads(opts.threads)
    import trl

    import trl_prime
    from trl_prime.rewards import math_reward

    name = opts.worker
    trainer_name, prime = CONFIGS[name]
    base = getattr(trl_prime, trainer_name, None) or getattr(trl, trainer_name)
    cls = _timed_class(base)
    cfg_name = trainer_name.replace("Trainer", "Config")
    cfg_cls = getattr(trl_prime, cfg_name, None) or getattr(trl, cfg_name)
    on_gpu = opts.device != "cpu"
    T = opts.max_completion_length
    kw = dict(
        output_dir=tempfile.mkdtemp(prefix=f"bench_{name}_"),
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        seed=opts.seed,
        use_cpu=not on_gpu,
        bf16=opts.bf16,  # mixed precision (autocast) on the GPU, or on a CPU with native bf16 (checked by main)
        gradient_checkpointing=False,
        per_device_train_batch_size=opts.batch,
        num_generations=opts.num_generations,
        max_completion_length=T,
        max_steps=opts.warmup + opts.steps,
        learning_rate=5e-7,
        beta=0.0,
        temperature=1.0,
    )
    if not opts.natural_length:
        kw["generation_kwargs"] = {"min_new_tokens": T}
    extra = {}
    if prime is not None:
        lower, upper = (float(x) for x in opts.filter.split(","))
        kw.update(
            prm_update=prime["prm_update"],
            filter_lower=lower,
            filter_upper=upper,
            prm_score_filtered_rows=not opts.skip_filtered_scoring,
        )
        kw.update({k: v for k, v in prime.items() if k not in ("prm_update", "small_prm")})
        if prime.get("small_prm"):
            kw["prm_model"] = opts.small_prm_path
    args = cfg_cls(**kw)
    if opts.model_path.endswith("/tiny") or opts.dataset == "tiny":
        from tiny import tiny_prompt_dataset

        ds = tiny_prompt_dataset(max(64, opts.batch * (opts.warmup + opts.steps)))
    else:
        from trl_prime.data import load_prompt_dataset

        ds = load_prompt_dataset(opts.dataset, size=max(64, opts.batch * (opts.warmup + opts.steps)), seed=opts.seed)

    steps, holder = [], {}

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = cls(
        model=opts.model_path,
        reward_funcs=math_reward,
        args=args,
        train_dataset=ds,
        callbacks=[_step_timer(opts, steps, holder)],
        **extra,
    )
    holder["trainer"] = trainer
    if prime is not None:  # time the PRM's second forward ("double") and the reference forward
        prm = trainer.implicit_prm
        ref_fn, prm_fn = prm.ref_logps, prm.prm_logps
        prm.ref_logps = lambda *a, **k: trainer._bench("reference", ref_fn, *a, **k)
        prm.prm_logps = lambda *a, **k: trainer._bench("prm_second_forward", prm_fn, *a, **k)
    trainer.train()
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    completion_len = None
    for h in trainer.state.log_history:
        if "completions/mean_length" in h:
            completion_len = h["completions/mean_length"]
    out = {
        "config": name,
        "steps": steps[opts.warmup :],
        "warmup": steps[: opts.warmup],
        "peak_rss_mib": peak,
        "completion_mean_length": completion_len,
        "prm_params": sum(p.numel() for p in trainer.prm_model.parameters()) if prime is not None else None,
        "policy_params": sum(p.numel() for p in trainer.model.parameters()),
    }
    if on_gpu:
        out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(opts.out).write_text(json.dumps(out))


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


QUICK = dict(warmup=1, steps=4, rounds=1)  # --quick; --precise: the same configuration over more rounds
PRECISE = dict(warmup=1, steps=4, rounds=3)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_common.DEFAULT_MODEL, help="'tiny', embedded:<key>, a folder or a Hub id")
    p.add_argument("--dataset", default="embedded:arithmetic")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 mixed precision (autocast): on the GPU, or on a CPU with native bf16 (AVX512-BF16 / AMX-BF16; "
        "refused on a CPU without it, where bf16 is emulated)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--batch", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--natural-length", action="store_true", help="let completions stop at EOS")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prm-model", default=None, help="the smaller PRM checkpoint of prime_rloo_small")
    p.add_argument(
        "--prm-layers",
        type=int,
        default=None,
        help="else build it: the policy's first N layers (default: a quarter of them)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (1 is fastest on a small CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filter", default="0,1", help="PRIME's online prompt filter 'lower,upper' (0.2,0.8 = the paper)")
    p.add_argument(
        "--skip-filtered-scoring",
        action="store_true",
        help="PRIME with prm_score_filtered_rows=False: no reference / PRM forward on filtered rows",
    )
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick",
        action="store_true",
        help="embedded default model, 128-token completions, batch 4 (one prompt x 4), configs rloo, "
        f"prime_rloo and prime_rloo_small, {QUICK['warmup']} warm-up + {QUICK['steps']} timed steps, "
        f"{QUICK['rounds']} round (overrides those options)",
    )
    preset.add_argument(
        "--precise",
        action="store_true",
        help=f"--quick's configuration over {PRECISE['rounds']} interleaved rounds of {PRECISE['steps']} timed steps",
    )
    p.add_argument("--json", default=None, help="write every measurement to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--small-prm-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def _check_options(p: argparse.ArgumentParser, opts) -> list[str]:
    """Validate the options (``p.error`` on a bad one); returns the configurations."""
    configs = [c.strip() for c in opts.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown or not configs:
        p.error(
            f"unknown configs {sorted(unknown)}; known: {list(CONFIGS)}"
            if unknown
            else f"--configs is empty; choose from {list(CONFIGS)}"
        )
    for name in ("steps", "rounds", "batch", "num_generations", "max_completion_length", "threads"):
        if getattr(opts, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.warmup < 0:
        p.error(f"--warmup must be >= 0, got {opts.warmup}")
    try:
        lower, upper = (float(x) for x in opts.filter.split(","))
    except ValueError:
        p.error(f"--filter takes 'lower,upper', two numbers in [0, 1] (e.g. 0.2,0.8), got {opts.filter!r}")
    if not 0.0 <= lower <= upper <= 1.0:
        p.error(f"--filter needs 0 <= lower <= upper <= 1, got {opts.filter!r}")
    has_prime = any(c.startswith("prime") for c in configs)
    if ((lower, upper) != (0.0, 1.0) or opts.skip_filtered_scoring) and not has_prime:
        p.error("--filter / --skip-filtered-scoring apply to the PRIME configurations only; none is selected")
    if opts.bf16 and opts.device == "cpu":
        feats = _common.cpu_features()
        if not feats["native_bf16"]:
            p.error(
                "--bf16 on CPU needs native bf16 (AVX512-BF16 or AMX-BF16), and this CPU has neither "
                f"(/proc/cpuinfo: {feats['cpuinfo']}; torch: {feats['torch']}): its bf16 matmuls would be emulated, "
                "several times slower than fp32, and the ratios would measure the emulation. Run without --bf16."
            )
    if opts.skip_filtered_scoring and (lower, upper) == (0.0, 1.0):
        print("note: --skip-filtered-scoring has no effect with the filter open (--filter 0,1 keeps every prompt)")
    if opts.warmup == 0:
        print("note: --warmup 0 times the first step too (math worker pool start-up, lazy initialisation)")
    if opts.model == "tiny" and (lower, upper) != (0.0, 1.0):
        print(
            "note: the tiny model's random completions are almost never correct, so the filter will drop nearly "
            "every prompt (kept_fraction ~0); use the embedded model for filtered runs"
        )
    return configs


def _worker_command(opts, name: str, model_path: str, small: str | None, out: str) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--model-path", model_path, "--out", out]
    for flag in ("device", "dataset", "batch", "num_generations", "max_completion_length", "warmup", "steps"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(opts, flag))]
    cmd += ["--threads", str(opts.threads), "--seed", str(opts.seed), "--filter", opts.filter]
    flags = {"--skip-filtered-scoring": opts.skip_filtered_scoring, "--natural-length": opts.natural_length}
    cmd += [flag for flag, on in flags.items() if on] + (["--bf16"] if opts.bf16 else [])
    return cmd + (["--small-prm-path", small] if small else [])


def _run_rounds(opts, configs, model_path, small, work) -> tuple[dict, dict, list]:
    """Every configuration in its own process, round-robin over the rounds (the order rotates each round). Returns
    ``(config -> [per round: timed step records], config -> metadata, load averages before each process)``."""
    results: dict[str, list] = defaultdict(list)
    meta, loads = {}, []
    for r in range(opts.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for name in order:
            out = os.path.join(work, f"{name}_{r}.json")
            loads.append(os.getloadavg()[0])
            t0 = time.time()
            proc = subprocess.run(_worker_command(opts, name, model_path, small, out), capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
                raise SystemExit(f"worker {name} failed (exit {proc.returncode})")
            res = json.loads(Path(out).read_text())
            results[name].append(res["steps"])
            meta[name] = {k: v for k, v in res.items() if k not in ("steps", "warmup")}
            print(
                f"[round {r + 1}/{opts.rounds}] {name:<18} median step {_median([s['step'] for s in res['steps']]):7.2f} s"
                f"   (process {time.time() - t0:5.0f} s, peak RSS {res['peak_rss_mib']:.0f} MiB, "
                f"load {loads[-1]:.2f})",
                flush=True,
            )
    return results, meta, loads


def _pairs(results: dict, a: str, b: str) -> list[tuple[dict, dict]]:
    """(step of ``a``, step of ``b``) for the same round and step index (the same completions)."""
    return [(sa, sb) for ra, rb in zip(results[a], results[b]) for sa, sb in zip(ra, rb)]


def _interval_dict(values: list[float]) -> dict:
    mean, low, high = _common.ratio_interval(values)
    return {"mean": mean, "low": low, "high": high, "n": len(values)}


def _ratios(results: dict, configs: list[str]) -> dict:
    """Per baseline pair: the per-step paired step-time ratios, their median, geometric mean and 95% t-interval (on
    the logs), the same for process CPU time, and the per-round geometric means."""
    ratios = {}
    for c, b in BASELINE.items():
        if c not in configs or b not in configs:
            continue
        per_step = [sc["step"] / sb["step"] for sc, sb in _pairs(results, c, b)]
        cpu = [sc["cpu"]["step"] / sb["cpu"]["step"] for sc, sb in _pairs(results, c, b)]
        per_round = [
            _common.ratio_interval([sc["step"] / sb["step"] for sc, sb in zip(rc, rb)])[0]
            for rc, rb in zip(results[c], results[b])
        ]
        ratios[f"{c}/{b}"] = {
            "median": _median(per_step),
            **_interval_dict(per_step),
            "per_step": per_step,
            "per_round": per_round,
            "cpu": _interval_dict(cpu),
        }
    return ratios


def _floor(results: dict) -> dict | None:
    """PRIME's cost floor from the same run, per paired step: ``1 + policy_update(RLOO) / step(RLOO)`` (the PRM
    update costs one policy update on the same tokens; the reference forward replaces RLOO's old-log-prob forward),
    and PRIME-RLOO's step ratio over it. Both with 95% t-intervals."""
    if not results.get("prime_rloo") or not results.get("rloo"):
        return None
    pairs = _pairs(results, "prime_rloo", "rloo")
    floors = [1.0 + sb["policy_update"] / sb["step"] for _, sb in pairs]
    over = [sc["step"] / sb["step"] / f for (sc, sb), f in zip(pairs, floors)]
    return {"floor": _interval_dict(floors), "prime_over_floor": _interval_dict(over)}


def _fmt_interval(d: dict, digits: int = 3) -> str:
    if math.isnan(d["low"]):
        return f"{d['mean']:.{digits}f} (one pair: no interval)"
    return f"{d['mean']:.{digits}f} [95% {d['low']:.{digits}f}, {d['high']:.{digits}f}]"


def _print_tables(opts, configs, results, meta, small) -> dict:
    print()
    print(
        f"model {opts.model}  device {opts.device}  {'bf16 autocast' if opts.bf16 else 'fp32'}  batch {opts.batch} "
        f"(K={opts.num_generations})  completion {opts.max_completion_length} tokens"
        f"{' (natural length)' if opts.natural_length else ''}  {opts.steps} timed steps x {opts.rounds} round(s) "
        f"after {opts.warmup} warm-up; threads {opts.threads}; PRIME filter [{opts.filter}]"
    )
    if small:
        print(
            f"smaller PRM: {small} ({meta.get('prime_rloo_small', {}).get('prm_params')} parameters, "
            f"policy {meta.get('prime_rloo_small', {}).get('policy_params')})"
        )
    print(f"{'phase (s/step, median)':<24}" + "".join(f"{c:>19}" for c in configs))
    table = {}
    for ph in PHASES:
        row = {c: _median([s.get(ph, 0.0) for rnd in results[c] for s in rnd]) for c in configs}
        table[ph] = row
        print(f"{ph:<24}" + "".join(f"{row[c]:>19.3f}" for c in configs))
    extra = {}
    for metric, label, scale in (("cpu", "CPU s/step", 1.0), ("minflt", "page faults/step (k)", 1e-3)):
        print(f"{label + ', median':<24}" + "".join(f"{c:>19}" for c in configs))
        extra[metric] = {}
        for ph in ("old_logps", "reference", "prm_update", "value_update", "policy_update", "step"):
            row = {c: _median([s[metric].get(ph, 0.0) for rnd in results[c] for s in rnd]) for c in configs}
            extra[metric][ph] = row
            print(f"  {ph:<22}" + "".join(f"{row[c] * scale:>19.3f}" for c in configs))
    return {"wall": table, **extra}


def main(argv=None) -> dict:
    p = _parser()
    opts = p.parse_args(argv)
    if opts.worker:
        _worker(opts)
        return {}
    if opts.quick or opts.precise:
        opts.model, opts.max_completion_length, opts.batch = _common.DEFAULT_MODEL, 128, 4
        opts.configs = "rloo,prime_rloo,prime_rloo_small"
        for k, v in (QUICK if opts.quick else PRECISE).items():
            setattr(opts, k, v)
    configs = _check_options(p, opts)
    work = tempfile.mkdtemp(prefix="bench_step_")
    model_path = _common.resolve_model(opts.model, work)
    small = opts.prm_model
    if "prime_rloo_small" in configs and small is None:
        import transformers

        n = transformers.AutoConfig.from_pretrained(model_path).num_hidden_layers
        layers = opts.prm_layers or max(1, n // 4)
        small = _common.truncated_copy(model_path, layers, os.path.join(work, f"prm_{layers}_layers"))

    started, load_before = time.time(), os.getloadavg()
    results, meta, loads = _run_rounds(opts, configs, model_path, small, work)
    load_after = os.getloadavg()
    tables = _print_tables(opts, configs, results, meta, small)
    ratios, floor = _ratios(results, configs), _floor(results)
    machine = _common.machine()
    print()
    for k, v in ratios.items():
        print(
            f"ratio {k:<24} = {_fmt_interval(v)}   (n={v['n']} paired steps; median {v['median']:.3f}; "
            f"per round {', '.join(f'{x:.3f}' for x in v['per_round'])}; CPU time {_fmt_interval(v['cpu'])})"
        )
    if floor:
        print(f"floor = 1 + policy_update(RLOO) / step(RLOO) = {_fmt_interval(floor['floor'])}")
        print(f"PRIME / floor = {_fmt_interval(floor['prime_over_floor'])}")
    feats = machine["cpu_features"]
    print(
        f"CPU {machine['cpu']}: native bf16 {feats['native_bf16']}; /proc/cpuinfo {feats['cpuinfo']}; "
        f"torch {feats['torch']}"
    )
    print(
        f"load average (1 min) before {load_before[0]:.2f}, at each process start {min(loads):.2f}-{max(loads):.2f}, "
        f"after {load_after[0]:.2f}; total wall time {time.time() - started:.0f} s"
    )
    summary = {
        "options": vars(opts),
        "machine": machine,
        "phases": tables["wall"],
        "cpu_phases": tables["cpu"],
        "minflt_phases": tables["minflt"],
        "ratios": ratios,
        "floor": floor,
        "load": {"before": load_before, "per_process": loads, "after": load_after},
        "meta": meta,
        "raw": results,
        "small_prm": small,
    }
    _common.dump(summary, opts.json)
    if "prime_rloo/rloo" in ratios:
        line = f"overhead: PRIME/RLOO = {_fmt_interval(ratios['prime_rloo/rloo'])}"
        if floor:
            line += f"; floor {floor['floor']['mean']:.3f}; PRIME/floor = {_fmt_interval(floor['prime_over_floor'])}"
        print(line)
    return summary


if __name__ == "__main__":
    main()
