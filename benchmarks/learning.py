"""Does it learn? A controlled learning benchmark with seeds and error bars (issue 14).

The task (``benchmarks/learning_task.py``): add 4 one-digit numbers step by step (running sums, one step per
line pair, the answer in ``\\boxed{}`` checked by ``trl_prime.rewards.math_reward``); ``--difficulty OxD`` sets the
operands and digits. The model: a 1.06M-parameter Llama with a character-level tokenizer, warm-started with TRL's
``SFTTrainer`` on solutions of a teacher whose running sums are off by one in 30% of the steps, so that the warm
start is right about 40% of the time sampled at temperature 1 (92% greedy) and an early slipped step decides the
outcome. Cached by the hash of its recipe (``~/.cache/trl_prime/learning/<hash>/``, about 3 minutes to build).

Every method gets the same prompts, seeds, batch (8 prompts x 4 completions), sampling (temperature 1), policy
learning rate (``--lr``, constant schedule, AdamW) and step budget:

- ``rloo`` TRL ``RLOOTrainer`` vs ``prime_rloo`` ``PrimeRLOOTrainer`` (PRIME Eq. 5), and ``prime_rloo_oracle``:
  PRIME-RLOO with the implicit PRM's token rewards replaced by exact per-step correctness (-1 on the last token of
  the first wrong step, ``learning_task.oracle_step_rewards``; the PRM is not trained), the headroom process
  rewards have on this task;
- ``grpo`` TRL ``GRPOTrainer`` vs ``prime_grpo`` ``PrimeGRPOTrainer`` (PRIME App. B.3; process term divided by the
  outcome's group std, the default) and ``prime_grpo_process_std`` (``grpo_process_scale="process_std"``);
- ``reinforce`` (PRIME's REINFORCE estimator with ``process_coef=0``) vs ``prime_reinforce``;
- ``prl`` ``PRLGRPOTrainer`` (steps split at blank lines);
- ``prof_grpo``: PROF (keep 2 of 4 completions per prompt, ranked by the online implicit PRM) on GRPO advantages
  (``PrimeGRPOTrainer``, ``prof_mode="both"``, ``prof_prm="implicit"``, ``process_coef=0``);
- ablations: ``prime_rloo_frozen`` (the PRM is the offline implicit PRM of this task, trained with CE on outcome-
  labelled rollouts of the warm start, and never updated: ``prm_learning_rate=0``), ``prime_rloo_warm_prm`` (that
  offline PRM as the starting point of the online PRM, updated at ``--prm-lr``), ``prime_rloo_warm_dpo_prm`` (the
  same from the offline DPO PRM), ``prime_rloo_double``
  (``prm_update="double"``), ``prime_rloo_pc0`` (``process_coef=0``: must equal ``rloo`` up to noise),
  ``prime_rloo_dpo`` (the online PRM trained with the pairwise DPO loss instead of CE), the online PRM's levers
  ``prime_rloo_balanced`` (``prm_class_balance=True``), ``prime_rloo_epochs4`` (``prm_epochs=4``) and
  ``prime_rloo_balanced_epochs4`` (both),
  ``prime_rloo_prm2x`` (PRM learning rate twice the policy's, the paper's ratio; the other PRIME rows use
  ``--prm-lr``), ``prime_rloo_stabilised`` (the same ratio with the released code's stabilisers: advantages
  whitened, process rewards ``batch_norm``) and ``prime_rloo_released`` (exactly the advantage and PRM options of
  ``recipes/configs/prime_qwen7b.yaml``: reference baseline, coefficients 5/5, double update, last token dropped,
  whitening, ``batch_norm``, PRM clip 10, at the paper's ratio);
- PRIME Table 4's PPO rows: ``ppo`` (``prime_estimator="ppo"``, a learned value model copied from the warm start,
  GAE with ``gamma = lam = 1``, ``process_coef=0``) vs ``prime_ppo`` (the same with PRIME's process rewards), and
  ``prime_as_value`` (no learned critic: the implicit PRM's prefix value is the baseline of the outcome reward,
  ``prime_value="implicit_prm"``; compared with ``prime_reinforce``, the PRM as a reward).

PRIME's online prompt filter is opened to [0, 1] for every PRIME method, so every method trains on every row (TRL's
RLOO/GRPO have no filter). Held-out accuracy (256 problems never trained on; sampled at temperature 1, 2 samples
each, and greedy) is measured every ``--eval-every`` steps (default 5), with the training wall-clock seconds at each
point (evaluations excluded). The report: mean and 95% t-interval curves per method, a table of start and final
accuracy, area under the curve, steps and training seconds to reach RLOO's final accuracy (the paper's
sample-efficiency measure; PRIME costs more per step), collapsed seeds, PRIME's ``prm/pair_accuracy`` trajectory, and
a "paper claims" table whose differences are paired over seeds (the seeds are shared by the methods). The offline
implicit PRM section (on by default, off with ``--quick``): CE and DPO PRMs trained on outcome-labelled rollouts of
the warm start, best-of-N (N = 4, 16, 64) against the first sample, majority vote and the oracle, with intervals
over problems. ``--difficulty 8x1`` is the harder task (7 dependent steps; the warm start is right far less often
sampled, so credit assignment matters more): run the benchmark once per difficulty, each report names its own.

Runs are spread over ``--workers`` processes with one torch thread each. Examples::

    python benchmarks/learning.py --quick --json docs/learning/quick.json --plot-dir docs/learning
    python benchmarks/learning.py --json docs/learning/full.json --plot-dir docs/learning   # every method, 5 seeds
    python benchmarks/learning.py --methods prime_grpo,grpo --seeds 5 --steps 100 --json prime_grpo.json  # some rows
    python benchmarks/learning.py --methods rloo,prime_rloo,prime_rloo_oracle --difficulty 8x1 --json hard.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402,F401  (offline environment, repository on sys.path)
import learning_task as lt  # noqa: E402


# the value model's learning rate over the policy's: veRL's critic / actor defaults (1e-5 / 1e-6), on which PRIME's
# released code is built
VALUE_LR_OVER_LR = 10.0
# name: (trainer, config, option overrides)
METHODS = {
    "rloo": ("trl.RLOOTrainer", "trl.RLOOConfig", {}),
    "prime_rloo": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {}),
    "grpo": ("trl.GRPOTrainer", "trl.GRPOConfig", {}),
    "prime_grpo": ("trl_prime.PrimeGRPOTrainer", "trl_prime.PrimeGRPOConfig", {}),
    "prime_grpo_process_std": (
        "trl_prime.PrimeGRPOTrainer",
        "trl_prime.PrimeGRPOConfig",
        {"grpo_process_scale": "process_std", "grpo_process_form": "response"},
    ),
    "reinforce": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prime_estimator": "reinforce", "process_coef": 0.0},
    ),
    "prime_reinforce": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prime_estimator": "reinforce"}),
    "prl": ("trl_prime.PRLGRPOTrainer", "trl_prime.PRLConfig", {"prl_step_split": "double_newline"}),
    "prof_grpo": (
        "trl_prime.PrimeGRPOTrainer",
        "trl_prime.PrimeGRPOConfig",
        {"prof_mode": "both", "prof_prm": "implicit", "process_coef": 0.0},
    ),
    "prime_rloo_frozen": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prm_learning_rate": 0.0, "prm_model": "<offline>"},
    ),
    # the offline implicit PRM as the online PRM's starting point (updated online at --prm-lr, unlike _frozen)
    "prime_rloo_warm_prm": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prm_model": "<offline>"},
    ),
    # the same from the offline DPO PRM (it ranks its training rollouts better than the CE one: RESULTS.md)
    "prime_rloo_warm_dpo_prm": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prm_model": "<offline_dpo>"},
    ),
    "prime_rloo_double": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_update": "double"}),
    "prime_rloo_dpo": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_loss": "dpo"}),
    "prime_rloo_pc0": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"process_coef": 0.0}),
    # levers on the online PRM (issue 26): class-balanced CE, several PRM updates per round, both
    "prime_rloo_balanced": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_class_balance": True}),
    "prime_rloo_epochs4": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_epochs": 4}),
    "prime_rloo_balanced_epochs4": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prm_class_balance": True, "prm_epochs": 4},
    ),
    # a replay of the last 4 rounds' PRM rows; the released script's PRM gradient clip (10; ours: 1.0)
    "prime_rloo_replay4": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_replay_rounds": 4}),
    "prime_rloo_clip10": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_max_grad_norm": 10.0}),
    # the paper's online prompt filter (0.2 <= group accuracy <= 0.8): no all-wrong or all-right group trains
    "prime_rloo_paper_filter": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"filter_lower": 0.2, "filter_upper": 0.8},
    ),
    # the paper's PRM/policy learning-rate ratio (1e-6 / 5e-7 = 2)
    "prime_rloo_prm2x": ("trl_prime.PrimeRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_lr_over_lr": 2.0}),
    # the released code's stabilisers at the paper's ratio: advantages whitened, process rewards batch-normalised
    "prime_rloo_stabilised": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prm_lr_over_lr": 2.0, "whiten_advantages": True, "process_reward_norm": "batch_norm"},
    ),
    # exactly the advantage and PRM options of recipes/configs/prime_qwen7b.yaml (the released recipe)
    "prime_rloo_released": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {
            "prm_lr_over_lr": 2.0,
            "prm_update": "double",
            "prm_max_grad_norm": 10.0,
            "prime_baseline": "reference",
            "process_reward_norm": "batch_norm",
            "process_coef": 5.0,
            "outcome_coef": 5.0,
            "whiten_advantages": True,
            "include_last_token": False,
        },
    ),
    # the headroom of process rewards: PRIME-RLOO with the implicit PRM's token rewards replaced by exact per-step
    # correctness (learning_task.oracle_step_rewards: -1 at the first wrong step); the PRM is not trained
    "prime_rloo_oracle": ("learning_task.OracleRLOOTrainer", "trl_prime.PrimeRLOOConfig", {"prm_learning_rate": 0.0}),
    # PRIME Table 4: PPO with a learned value model (a copy of the warm start; GAE with gamma = lam = 1, advantages
    # whitened as veRL's GAE does), without and with PRIME's process rewards, and the implicit PRM as the value
    # baseline (section 5.4; not whitened, like prime_reinforce, the PRM as a reward, which it is compared with)
    "ppo": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {
            "prime_estimator": "ppo",
            "process_coef": 0.0,
            "whiten_advantages": True,
            "value_lr_over_lr": VALUE_LR_OVER_LR,
        },
    ),
    "prime_ppo": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prime_estimator": "ppo", "whiten_advantages": True, "value_lr_over_lr": VALUE_LR_OVER_LR},
    ),
    "prime_as_value": (
        "trl_prime.PrimeRLOOTrainer",
        "trl_prime.PrimeRLOOConfig",
        {"prime_estimator": "ppo", "prime_value": "implicit_prm"},
    ),
}
# a method's ``prm_model`` placeholder -> the offline implicit PRM it starts from (trained before the runs)
OFFLINE_PLACEHOLDERS = {"<offline>": "ce", "<offline_dpo>": "dpo"}
QUICK_METHODS = [
    "rloo",
    "prime_rloo",
    "grpo",
    "prime_grpo",
    "prime_grpo_process_std",
    "prl",
    "prime_rloo_pc0",
    "prime_rloo_prm2x",
]
PRIME_METHODS = {m for m, (_, c, _) in METHODS.items() if "Prime" in c}
# (baseline, PRIME) pairs of the "gains for every estimator" claim
ESTIMATOR_PAIRS = [
    ("rloo", "prime_rloo"),
    ("grpo", "prime_grpo"),
    ("reinforce", "prime_reinforce"),
    ("ppo", "prime_ppo"),
]
# PRIME Table 4 (average of 7 benchmarks at step 240, %): each row's accuracy without and with PRIME
PAPER_TABLE_4 = {
    "RLOO": ("rloo", 36.9, "prime_rloo", 41.0),
    "REINFORCE": ("reinforce", 36.0, "prime_reinforce", 37.8),
    "GRPO": ("grpo", 36.1, "prime_grpo", 37.8),
    "PPO": ("ppo", 35.8, "prime_ppo", 39.4),
    "PRIME as value model": (None, None, "prime_as_value", 36.6),
}


# ----------------------------------------------------------------------------------------------------------------
# One run (in a worker process)
# ----------------------------------------------------------------------------------------------------------------
def _resolve(dotted: str):
    import importlib

    mod, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(mod), name)


def rl_config(
    method: str,
    *,
    seed: int,
    steps: int,
    lr: float,
    prm_lr: float,
    prompts_per_step: int,
    num_generations: int,
    max_completion_length: int,
    output_dir: str,
    offline_prm: dict[str, str] | None = None,
    warm: str | None = None,
    device: str = "cpu",
    extra: dict | None = None,
):
    """The TRL / trl-prime config of ``method``: the shared settings plus the method's overrides."""
    _, cfg_name, overrides = METHODS[method]
    kw = dict(
        output_dir=output_dir,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        seed=seed,
        use_cpu=device == "cpu",
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        beta=0.0,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_grad_norm=1.0,
        dataloader_num_workers=0,
    )
    if method in PRIME_METHODS:
        kw.update(prm_learning_rate=prm_lr, filter_lower=0.0, filter_upper=1.0, prm_beta=0.05)
    over = dict(overrides)
    if "prm_lr_over_lr" in over:
        over["prm_learning_rate"] = lr * over.pop("prm_lr_over_lr")
    if "value_lr_over_lr" in over:
        over["value_learning_rate"] = lr * over.pop("value_lr_over_lr")
    if over.get("prm_model") in OFFLINE_PLACEHOLDERS:
        if offline_prm is None:
            raise ValueError(f"method {method!r} needs the offline PRM (built by the benchmark before the runs)")
        over["prm_model"], over["prm_ref_model"] = offline_prm[OFFLINE_PLACEHOLDERS[over["prm_model"]]], warm
    kw.update(over)
    kw.update(extra or {})
    return _resolve(cfg_name)(**kw)


def other_warm_starts(merged: dict[str, dict | None], here: dict) -> dict[str, dict]:
    """The ``--merge`` files (path -> their warm start's held-out accuracy) whose runs started from other weights
    than the warm start made here: the recipe's cache key names its settings, not its weights, and the same recipe
    trained on another CPU (other float kernels) gives another model. Files that recorded none are trusted."""
    return {path: acc for path, acc in merged.items() if acc is not None and acc != here}


def runs_to_do(methods: list[str], seeds: int, seed_offset: int, merged) -> list[tuple[str, int]]:
    """The ``(method, seed)`` runs to do, seed-major: seeds ``seed_offset .. seed_offset + seeds - 1``, less those
    ``merged`` (an earlier ``--json`` file's runs, keyed by ``(method, seed)``) holds. (Before 2026-12-03 the jobs
    added the offset a second time: a run asked for ``--seed-offset 500`` trained seeds 1000, 1001, ...; the JSON
    files record the seeds used.)"""
    wanted = [(m, seed_offset + i) for i in range(seeds) for m in methods]
    return [(m, s) for m, s in wanted if (m, s) not in merged]


def flip_advantage_sign(trainer) -> None:
    """Test-only sabotage: negate every advantage the trainer computes (the policy then unlearns the task)."""
    inner = trainer._generate_and_score_completions

    def flipped(inputs):
        out = inner(inputs)
        out["advantages"] = -out["advantages"]
        return out

    trainer._generate_and_score_completions = flipped


def run_one(
    method: str,
    seed: int,
    *,
    warm: str,
    spec: lt.TaskSpec,
    steps: int,
    eval_every: int,
    lr: float,
    prm_lr: float,
    prompts_per_step: int = 8,
    num_generations: int = 4,
    n_heldout: int = 256,
    eval_samples: int = 2,
    offline_prm: dict[str, str] | None = None,
    flip_sign: bool = False,
    progress=None,
    device: str = "cpu",
    extra: dict | None = None,
) -> dict:
    """Train ``method`` from the warm start ``warm`` for ``steps`` steps; return its held-out accuracy curve.

    Returns ``{"method", "seed", "steps": [0, e, 2e, ...], "greedy": [...], "sampled": [...], "train_seconds":
    [...], "pair_accuracy": [per step, PRIME only], "seconds"}``. ``train_seconds`` is the wall-clock time the run
    had trained for at each evaluation point (from the start of ``trainer.train()``, the held-out evaluations
    excluded; generation, rewards, PRM and policy updates included): what a user pays for that accuracy. ``seconds``
    is the whole run. ``progress(n)`` (optional) is called after each step.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from trl_prime.rewards import math_reward

    t0 = time.time()
    recipe = lt.WarmStartRecipe(task=spec)
    train, heldout = lt.make_splits(spec, max(4096, steps * prompts_per_step), n_heldout, recipe.data_seed)
    ds = Dataset.from_list([{"prompt": p["prompt"], "solution": p["solution"]} for p in train])
    T = lt.max_completion_tokens(spec)
    out_dir = tempfile.mkdtemp(prefix=f"learning_{method}_{seed}_")
    args = rl_config(
        method,
        seed=seed,
        steps=steps,
        lr=lr,
        prm_lr=prm_lr,
        prompts_per_step=prompts_per_step,
        num_generations=num_generations,
        max_completion_length=T,
        output_dir=out_dir,
        offline_prm=offline_prm,
        warm=warm,
        device=device,
        extra=extra,
    )
    tokenizer = AutoTokenizer.from_pretrained(warm)
    curve = {"steps": [], "greedy": [], "sampled": [], "train_seconds": []}
    clock = {"start": 0.0, "eval": 0.0}  # when training began; seconds spent in held-out evaluations since

    def measure(model, step):
        t = time.perf_counter()
        curve["train_seconds"].append(round(t - clock["start"] - clock["eval"], 2))
        acc = lt.evaluate(model, tokenizer, heldout, greedy=True, samples=eval_samples, seed=10_000 + step, spec=spec)
        curve["steps"].append(step)
        curve["greedy"].append(acc["greedy"])
        curve["sampled"].append(acc.get("sampled", float("nan")))
        clock["eval"] += time.perf_counter() - t

    class Eval(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["start"] = time.perf_counter()
            measure(trainer.model, 0)

        def on_step_end(self, args, state, control, **kw):
            if progress is not None:
                progress(1)
            if state.global_step % eval_every == 0 or state.global_step == args.max_steps:
                measure(trainer.model, state.global_step)

    trainer = _resolve(METHODS[method][0])(
        model=warm,
        reward_funcs=math_reward,
        args=args,
        train_dataset=ds,
        processing_class=tokenizer,
        callbacks=[Eval()],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the per-step log dicts (disable_tqdm=True prints them)
    if flip_sign:
        flip_advantage_sign(trainer)
    torch.manual_seed(seed)
    trainer.train()
    pair = [h.get("prm/pair_accuracy") for h in trainer.state.log_history if "prm/pair_accuracy" in h]
    import shutil

    shutil.rmtree(out_dir, ignore_errors=True)
    return {"method": method, "seed": seed, **curve, "pair_accuracy": pair, "seconds": round(time.time() - t0, 1)}


def _exit_with_parent() -> None:
    """Linux: the worker gets SIGTERM when the benchmark's main process dies (a killed benchmark otherwise leaves its
    ProcessPoolExecutor workers training on as orphans); elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)


def _init_worker(q, threads: int) -> None:
    _exit_with_parent()
    import torch

    torch.set_num_threads(threads)
    os.environ.setdefault("TRL_PRIME_MATH_WORKERS", "1")
    global _PROGRESS_QUEUE
    _PROGRESS_QUEUE = q
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("datasets").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")


def _job(kw: dict) -> dict:
    q = _PROGRESS_QUEUE
    return run_one(**kw, progress=lambda n: q.put(n))


# ----------------------------------------------------------------------------------------------------------------
# Offline implicit PRM (Implicit PRM arXiv 2412.01981): CE and DPO on outcome-labelled rollouts, best-of-N
# ----------------------------------------------------------------------------------------------------------------
def offline_prm(
    warm: str,
    spec: lt.TaskSpec,
    workdir: Path,
    *,
    n_prompts: int,
    rollouts: int,
    n_problems: int,
    max_n: int = 64,
    epochs: int = 2,
    lr: float = 5e-4,
    log=print,
) -> tuple[dict, str]:
    """Train CE and DPO implicit PRMs on outcome-labelled rollouts of the warm start; best-of-N on held-out problems.

    Returns ``(results, {"ce": folder, "dpo": folder})``; the CE PRM also serves as the frozen PRM of
    ``prime_rloo_frozen``, and each as the starting point of a warm-started row (``OFFLINE_PLACEHOLDERS``).
    """
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_prime import ImplicitPRMConfig, ImplicitPRMTrainer, build_outcome_dataset
    from trl_prime.implicit_prm.data import sample_completions
    from trl_prime.rewards import math_reward
    from trl_prime.rewards.math_verifier import extract_answer

    t0 = time.time()
    recipe = lt.WarmStartRecipe(task=spec)
    train, heldout = lt.make_splits(spec, 4096, recipe.n_heldout, recipe.data_seed)
    T = lt.max_completion_tokens(spec)
    prompts = Dataset.from_list(
        [{"prompt": p["prompt"], "solution": p["solution"]} for p in random.Random(7).sample(train, n_prompts)]
    )
    data, stats = build_outcome_dataset(
        warm,
        prompts,
        reward_func=math_reward,
        num_generations=rollouts,
        max_new_tokens=T,
        batch_size=256,
        seed=0,
        return_stats=True,
    )
    res = {
        "rollouts": len(data),
        "rollout_accuracy": sum(data["label"]) / max(1, len(data)),
        "n_prompts": n_prompts,
        "rollouts_per_prompt": rollouts,
    }
    log(f"offline PRM data: {len(data)} rollouts, accuracy {res['rollout_accuracy']:.3f}")
    folders = {}
    for loss in ("ce", "dpo"):
        folder = workdir / f"prm_{loss}"
        args = ImplicitPRMConfig(
            output_dir=str(folder),
            loss_type=loss,
            beta=0.05,
            learning_rate=lr,
            num_train_epochs=epochs,
            per_device_train_batch_size=64,
            lr_scheduler_type="constant",
            warmup_steps=0,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=10,
            disable_tqdm=True,
            seed=0,
            max_length=lt.sft_max_length(spec),
            max_prompt_length=max(64, lt.longest_prompt_tokens(spec)),
        )
        tr = ImplicitPRMTrainer(model=warm, args=args, train_dataset=data)
        tr.train()
        tr.save_model(str(folder))
        hist = [h for h in tr.state.log_history if "pair_accuracy" in h]
        res[f"{loss}_train_pair_accuracy"] = hist[-1]["pair_accuracy"] if hist else None
        folders[loss] = (str(folder), tr.prm)
    log(f"offline PRMs trained ({time.time() - t0:.0f} s)")

    # best-of-N on held-out problems: max_n samples each, disjoint groups of N
    problems = heldout[:n_problems]
    tok = AutoTokenizer.from_pretrained(warm)
    model = AutoModelForCausalLM.from_pretrained(warm)
    texts, _ = sample_completions(
        model, tok, [p["prompt"] for p in problems], max_n, max_new_tokens=T, batch_size=512, seed=1
    )
    flat = [c for cs in texts for c in cs]
    golds = [p["solution"] for p in problems for _ in range(max_n)]
    labels = [r or 0.0 for r in math_reward(flat, solution=golds)]
    answers = [extract_answer(c) for c in flat]
    flat_prompts = [p["prompt"] for p in problems for _ in range(max_n)]
    scores = {}
    for loss, (_, prm) in folders.items():
        for agg in ("min", "sum"):
            with torch.no_grad():
                scores[f"{loss}_{agg}"] = prm.score(flat_prompts, flat, aggregation=agg, batch_size=256)
    res.update(best_of_n(labels, answers, scores, len(problems), max_n))
    res["n_problems"] = n_problems
    res["seconds"] = round(time.time() - t0, 1)
    return res, {loss: folder for loss, (folder, _) in folders.items()}


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------
T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}


def t975(df: int) -> float:
    if df <= 0:
        return float("nan")
    return T975.get(df) or T975[max(k for k in T975 if k <= df)]


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval (NaN half-width for one value)."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def best_of_n(
    labels: list[float],
    answers: list,
    scores: dict[str, list[float]],
    n_problems: int,
    max_n: int,
    ns: tuple[int, ...] = (4, 16, 64),
) -> dict:
    """Best-of-N accuracy of each selector, with 95% intervals over problems (pure; the offline PRM section's table).

    Args:
        labels: ``n_problems * max_n`` outcome labels (1 right, 0 wrong), problem-major: problem i's samples are
            ``labels[i * max_n : (i + 1) * max_n]``.
        answers: the extracted answer of each sample (``None``: none), same layout (majority vote).
        scores: per PRM selector (e.g. ``"ce_min"``), a score per sample (NaN never chosen unless all are).
        n_problems, max_n: the layout; each problem's samples form ``max_n // N`` disjoint groups of N.
        ns: the N values (those above ``max_n`` are skipped).

    Returns:
        ``{"best_of_n": {N: {selector: accuracy}}, "best_of_n_ci": {N: {selector: [mean, half-width]}},
        "best_of_n_vs_majority": {N: {PRM selector: [difference, low, high]}}}``. Selectors: ``first`` (the first
        sample of the group), ``majority`` (the most frequent answer, ties to the first seen), ``oracle`` (right if
        any sample is), and each of ``scores`` (the highest score, ties to the first). A problem's accuracy is the
        mean over its groups; means and t-intervals are over problems, and the PRM - majority difference is paired
        per problem (both choose from the same samples).
    """
    table, ci, vs = {}, {}, {}
    for n in ns:
        if n > max_n:
            continue
        per = {k: [] for k in ("first", "majority", "oracle", *scores)}  # per problem: mean over its groups
        for i in range(n_problems):
            rows = {k: [] for k in per}
            for g in range(max_n // n):
                idx = list(range(i * max_n + g * n, i * max_n + (g + 1) * n))
                rows["first"].append(labels[idx[0]])
                rows["oracle"].append(max(labels[j] for j in idx))
                counts = {}
                for j in idx:  # most frequent extracted answer; ties -> the one seen first
                    if answers[j] is not None:
                        counts.setdefault(answers[j], []).append(j)
                best = max(counts.values(), key=len)[0] if counts else idx[0]
                rows["majority"].append(labels[best])
                for k, s in scores.items():
                    j = max(idx, key=lambda j: (s[j] if not math.isnan(s[j]) else -math.inf, -j))
                    rows[k].append(labels[j])
            for k, v in rows.items():
                per[k].append(statistics.fmean(v))
        table[n] = {k: statistics.fmean(v) for k, v in per.items()}
        ci[n] = {k: list(mean_ci(v)) for k, v in per.items()}
        vs[n] = {
            k: list(paired_diff_ci(dict(enumerate(per["majority"])), dict(enumerate(per[k])))[:3]) for k in scores
        }
    return {"best_of_n": table, "best_of_n_ci": ci, "best_of_n_vs_majority": vs}


def paired_diff_ci(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float, int]:
    """Paired difference ``b - a`` over the seeds both ran, and its 95% t-interval.

    Args:
        a, b: per seed (the key) one value of each method (AUC, final accuracy ...). The methods share their seeds'
            prompts, data order and sampling seed, so the per-seed difference removes the seed's own luck.

    Returns:
        ``(mean difference, low, high, n)`` with ``n`` the number of common seeds; ``low`` / ``high`` are NaN for
        fewer than 2 common seeds (no interval), all NaN for none. Interval: ``mean +- t(0.975, n-1) sd / sqrt(n)``.
    """
    common = sorted(set(a) & set(b))
    ds = [b[s] - a[s] for s in common if not (math.isnan(a[s]) or math.isnan(b[s]))]
    if not ds:
        return float("nan"), float("nan"), float("nan"), 0
    m, h = mean_ci(ds)
    return m, m - h, m + h, len(ds)


def paired(summary: dict, a: str, b: str, key: str = "auc_per_seed") -> tuple[float, float, float, int]:
    """:func:`paired_diff_ci` of method ``b`` minus method ``a`` on ``summary[m][key]`` (per seed)."""
    sa, sb = summary[a], summary[b]
    return paired_diff_ci(dict(zip(sa["seeds"], sa[key])), dict(zip(sb["seeds"], sb[key])))


def effect_verdict(d: float, lo: float, hi: float, effect: float | None = None) -> str:
    """Verdict of a claim "B beats A" from the paired difference ``d`` (B - A) and its 95% interval ``[lo, hi]``.

    ``effect`` is the paper's gain on the same scale (e.g. PRIME Table 4's RLOO +4.1 points = 0.041), if it has one.
    "replicated": the interval lies above 0; "not replicated (reversed)": below 0; an interval across 0 is "not
    replicated" only when it also lies below the paper's effect (the effect is excluded), and otherwise "not
    detected (inconclusive)": no gain was seen, but one of the paper's size cannot be ruled out either."""
    if math.isnan(lo):
        return "inconclusive (one seed)"
    if lo > 0:
        return (
            "replicated" if effect is None or hi >= effect else f"replicated (smaller than the paper's {effect:+.3f})"
        )
    if hi < 0:
        return "not replicated (reversed)"
    if effect is not None and hi < effect:
        return f"not replicated (the interval excludes the paper's {effect:+.3f})"
    return (
        "not detected (inconclusive: the interval cannot exclude a gain)"
        if effect is None
        else f"not detected (inconclusive: the interval cannot exclude the paper's {effect:+.3f})"
    )


def auc(steps: list[int], ys: list[float]) -> float:
    """Mean accuracy over the run (trapezoid area under the curve divided by the step span)."""
    area = sum((steps[i + 1] - steps[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(steps) - 1))
    return area / (steps[-1] - steps[0])


def steps_to(steps: list[float], ys: list[float], threshold: float) -> float:
    """First ``steps`` value at which ``ys`` reaches ``threshold`` (linear interpolation between evals); inf if never.

    ``steps`` may be any increasing x: evaluation steps, or the training seconds at each evaluation (time to
    threshold in wall-clock seconds)."""
    for i, y in enumerate(ys):
        if y >= threshold:
            if i == 0:
                return float(steps[0])
            y0 = ys[i - 1]
            return steps[i - 1] + (steps[i] - steps[i - 1]) * (threshold - y0) / (y - y0)
    return float("inf")


def collapsed(start: float, final: float) -> bool:
    """A run collapsed when its final held-out accuracy is below half its start (e.g. 0.31 -> 0.10)."""
    return final < start / 2


def finite_mean(xs) -> float:
    """The mean of the finite values of ``xs``: a step whose every group was filtered out logs no pair accuracy
    (``None`` / NaN), and a window of such steps reads NaN."""
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(vals) if vals else math.nan


def summarize(runs: dict[str, list[dict]], key: str = "greedy") -> dict:
    """Per method: curves (mean, 95% half-width), start, final, AUC, collapsed seeds, training seconds at each
    evaluation (mean over the seeds that recorded them), pair accuracy; per-seed values keyed by ``seeds``."""
    out = {}
    for m, rs in runs.items():
        steps = rs[0]["steps"]
        curves = [r[key] for r in rs]
        mean = [mean_ci([c[i] for c in curves])[0] for i in range(len(steps))]
        half = [mean_ci([c[i] for c in curves])[1] for i in range(len(steps))]
        secs = [r["train_seconds"] for r in rs if r.get("train_seconds") and len(r["train_seconds"]) == len(steps)]
        s = {
            "steps": steps,
            "seeds": [r["seed"] for r in rs],
            "mean": mean,
            "half": half,
            "start": mean_ci([c[0] for c in curves]),
            "final": mean_ci([c[-1] for c in curves]),
            "auc": mean_ci([auc(steps, c) for c in curves]),
            "auc_per_seed": [auc(steps, c) for c in curves],
            "final_per_seed": [c[-1] for c in curves],
            "collapsed_seeds": sum(collapsed(c[0], c[-1]) for c in curves),
            "train_seconds": [statistics.fmean(x[i] for x in secs) for i in range(len(steps))] if secs else None,
        }
        pairs = [r["pair_accuracy"] for r in rs if r.get("pair_accuracy")]
        if pairs:
            n = min(len(p) for p in pairs)
            w = max(1, n // 5)
            s["pair_accuracy"] = {
                "first": mean_ci([finite_mean(p[:w]) for p in pairs]),
                "middle": mean_ci([finite_mean(p[n // 2 - w // 2 : n // 2 - w // 2 + w]) for p in pairs]),
                "last": mean_ci([finite_mean(p[n - w :]) for p in pairs]),
                "window": w,
                "curve": [finite_mean([p[i] for p in pairs]) for i in range(n)],
            }
        out[m] = s
    return out


def _diff_text(d: float, lo: float, hi: float) -> str:
    return f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _collapse_text(s: dict) -> str:
    return (
        f"{s['collapsed_seeds']}/{len(s['seeds'])} seeds collapse (final {fmt(s['final'])}, start {fmt(s['start'])})"
    )


def claims(summary: dict, offline: dict | None) -> list[tuple[str, str, str]]:
    """The PRIME paper's claims, what we measured (paired over seeds), and a verdict (:data:`VERDICT_RULES`)."""
    rows = []
    if "rloo" in summary and "prime_rloo" in summary:
        a, b = summary["rloo"], summary["prime_rloo"]
        thr = a["final"][0]
        sa, sb = steps_to(a["steps"], a["mean"], thr), steps_to(b["steps"], b["mean"], thr)
        ratio = sa / sb if sb > 0 and math.isfinite(sb) else (float("inf") if sb == 0 else 0.0)
        d, lo, hi, _ = paired(summary, "rloo", "prime_rloo")
        verdict = (
            "inconclusive (one seed)"
            if math.isnan(lo)
            else "replicated"
            if lo > 0 and ratio >= 2.0
            else f"not replicated (a gain, but step ratio {ratio:.2f} < 2)"
            if lo > 0
            else effect_verdict(d, lo, hi)
        )
        rows.append(
            (
                "2.5x sample efficiency of PRIME over RLOO (steps to RLOO's final accuracy)",
                f"RLOO reaches {thr:.3f} at step {_to_threshold(a, thr)}, PRIME-RLOO at {_to_threshold(b, thr)} "
                f"(step ratio {ratio:.2f}); paired AUC difference {_diff_text(d, lo, hi)}",
                verdict,
            )
        )
    if "prime_rloo" in summary and "pair_accuracy" in summary["prime_rloo"]:
        p = summary["prime_rloo"]["pair_accuracy"]
        (f, _), (last, lh) = p["first"], p["last"]
        verdict = (
            "inconclusive (one seed)"
            if math.isnan(lh)
            else "replicated"
            if last - lh >= 0.65
            else "not replicated"
            if last + lh < 0.65
            else "not detected (inconclusive)"
        )
        ceiling = ""
        oracle = [m for m in summary if "oracle" in m and "pair_accuracy" in summary[m]]
        if oracle:
            o = summary[oracle[0]]["pair_accuracy"]["last"]
            ceiling = (
                f"; {oracle[0]} (exact rewards) reads {fmt(o)} on its own batches, the metric's ceiling "
                "(a group whose outcomes are all equal scores 0.5)"
            )
        rows.append(
            (
                "online PRM pair accuracy rises from 0.5 to ~0.75",
                f"PRIME-RLOO prm/pair_accuracy {f:.3f} (first {p['window']} steps) -> {last:.3f} +- {lh:.3f} "
                f"(last {p['window']}){ceiling}",
                verdict,
            )
        )
    if "prime_rloo" in summary and "prime_rloo_frozen" in summary:
        on, fr = summary["prime_rloo"], summary["prime_rloo_frozen"]
        d, lo, hi, _ = paired(summary, "prime_rloo_frozen", "prime_rloo")
        verdict = effect_verdict(d, lo, hi)
        if verdict.startswith("replicated") and fr["collapsed_seeds"] * 2 >= len(fr["seeds"]):
            verdict += " only because the frozen PRM collapses the policy"
        vs_rloo = ""
        if "rloo" in summary:
            vs_rloo = "; online - RLOO " + _diff_text(*paired(summary, "rloo", "prime_rloo")[:3])
        rows.append(
            (
                "an online PRM beats a frozen (offline-trained) one",
                f"paired AUC online - frozen {_diff_text(d, lo, hi)}; frozen: {_collapse_text(fr)}; online: "
                f"{_collapse_text(on)}{vs_rloo}",
                verdict,
            )
        )
    pairs = [(a, b) for a, b in ESTIMATOR_PAIRS if a in summary and b in summary]
    if pairs:
        parts, verdicts = [], []
        for a, b in pairs:
            d, lo, hi, _ = paired(summary, a, b)
            parts.append(f"{b} - {a} AUC {_diff_text(d, lo, hi)}")
            verdicts.append("?" if math.isnan(lo) else "up" if lo > 0 else "down" if hi < 0 else "flat")
        verdict = (
            "inconclusive (one seed)"
            if "?" in verdicts
            else "replicated"
            if all(v == "up" for v in verdicts) and len(pairs) == len(ESTIMATOR_PAIRS)
            else "not replicated (reversed for one estimator)"
            if any(v == "down" for v in verdicts)
            else "not detected (inconclusive)"
        )
        rows.append(("PRIME gains for every estimator (RLOO, GRPO, REINFORCE, PPO)", "; ".join(parts), verdict))
    if "prime_reinforce" in summary and "prime_as_value" in summary:
        d, lo, hi, _ = paired(summary, "prime_as_value", "prime_reinforce")
        rows.append(
            (
                "the implicit PRM works better as a reward (REINFORCE w/ PRIME) than as a value (section 5.4)",
                f"paired AUC prime_reinforce - prime_as_value {_diff_text(d, lo, hi)}",
                effect_verdict(d, lo, hi),
            )
        )
    for oracle in [m for m in summary if "oracle" in m]:
        if "rloo" not in summary:
            continue
        d, lo, hi, _ = paired(summary, "rloo", oracle)
        df, lof, hif, _ = paired(summary, "rloo", oracle, "final_per_seed")
        extra = ""
        if "prime_rloo" in summary:
            extra = "; PRIME-RLOO - oracle AUC " + _diff_text(*paired(summary, oracle, "prime_rloo")[:3])
        v = effect_verdict(d, lo, hi)
        verdict = (
            "detected"
            if v.startswith("replicated")
            else "reversed"
            if "reversed" in v
            else v.replace("not detected (inconclusive: the interval cannot exclude a gain)", "not detected")
        )
        rows.append(
            (
                "(headroom) exact per-step process rewards in Eq. 5 beat outcome-only RLOO",
                f"paired {oracle} - RLOO: AUC {_diff_text(d, lo, hi)}, final {_diff_text(df, lof, hif)}{extra}",
                verdict,
            )
        )
    if "rloo" in summary and "prime_rloo_pc0" in summary:
        d, lo, hi, _ = paired(summary, "rloo", "prime_rloo_pc0")
        rows.append(
            (
                "(check) process_coef=0 equals RLOO up to noise",
                f"paired AUC pc0 - RLOO {_diff_text(d, lo, hi)}",
                "inconclusive (one seed)" if math.isnan(lo) else "consistent" if lo <= 0 <= hi else "NOT consistent",
            )
        )
    if offline:
        t, vs = offline["best_of_n"], offline.get("best_of_n_vs_majority")
        parts, verdicts = [], []
        for n, r in sorted(t.items(), key=lambda kv: int(kv[0])):
            best = max(("ce_min", "dpo_min"), key=lambda k: r[k])
            if vs:  # paired over problems, with its interval
                d, lo, hi = vs[n][best]
                parts.append(f"N={n}: PRM ({best}) - majority {_diff_text(d, lo, hi)}")
                verdicts.append("up" if lo > 0 else "down" if hi < 0 else "flat")
            else:  # an older JSON: means only
                parts.append(f"N={n}: PRM {r[best]:.3f} vs majority {r['majority']:.3f}")
                verdicts.append("up" if r[best] - r["majority"] > 0.01 else "flat")
        verdict = (
            "replicated"
            if all(v == "up" for v in verdicts)
            else "not replicated (reversed at some N)"
            if "down" in verdicts
            else "not detected (inconclusive)"
        )
        rows.append(
            ("(Implicit PRM paper) best-of-N with the implicit PRM beats majority vote", "; ".join(parts), verdict)
        )
    return rows


VERDICT_RULES = (
    "Verdict rules: every difference is paired over seeds (the methods share each seed's prompts and sampling), with "
    "its 95% t-interval. 'replicated': the interval lies above 0 (sample efficiency: and the step ratio is >= 2); "
    "'not replicated (reversed)': below 0; an interval across 0 reads 'not replicated' only where it also lies below "
    "the paper's effect (PRIME Table 4's gains), else 'not detected (inconclusive)'. Pair accuracy: 'replicated' if "
    "the last window's lower bound is >= 0.65, 'not replicated' if its upper bound is < 0.65. Best-of-N: paired over "
    "problems, 'replicated' if the better PRM beats majority vote at every N. A collapsed seed ends below half its "
    "start. One seed: 'inconclusive'."
)


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
def fmt(mc: tuple[float, float]) -> str:
    m, h = mc
    return f"{m:.3f}" if math.isnan(h) else f"{m:.3f} ± {h:.3f}"


def table4_lines(summ: dict) -> list[str]:
    """PRIME Table 4 next to this task: each estimator without and with PRIME (final held-out accuracy, sampled),
    the paired differences (final and AUC) and the verdict against the paper's gain."""
    rows = [(k, v) for k, v in PAPER_TABLE_4.items() if v[2] in summ]
    if not rows:
        return []
    lines = [
        "",
        "PRIME Table 4 (average accuracy of 7 benchmarks at step 240, %) next to this task (final held-out accuracy, "
        "sampled; differences paired over seeds, 95% intervals; the verdict sets the final difference against the "
        "paper's gain in accuracy points):",
        "",
        "| estimator | paper: without -> with PRIME | here: without -> with PRIME | final with - without | "
        "AUC with - without | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for name, (base, paper_base, prime, paper_prime) in rows:
        paper = (
            f"{paper_prime}" if base is None else f"{paper_base} -> {paper_prime} ({paper_prime - paper_base:+.1f})"
        )
        here = fmt(summ[prime]["final"])
        final = diff = verdict = ""
        if base is not None and base in summ:
            here = f"{fmt(summ[base]['final'])} -> {here}"
            d, lo, hi, _ = paired(summ, base, prime, "final_per_seed")
            final = _diff_text(d, lo, hi)
            verdict = effect_verdict(d, lo, hi, (paper_prime - paper_base) / 100)
            diff = _diff_text(*paired(summ, base, prime)[:3])
        lines.append(f"| {name} | {paper} | {here} | {final} | {diff} | {verdict} |")
    return lines


def _to_threshold(s: dict, thr: float | None) -> str:
    """Steps (and training seconds) at which the mean curve reaches ``thr``."""
    if thr is None:
        return ""
    st = steps_to(s["steps"], s["mean"], thr)
    if math.isinf(st):
        return "never"
    if not s.get("train_seconds"):
        return f"{st:.0f}"
    return f"{st:.0f} ({steps_to(s['train_seconds'], s['mean'], thr):.0f} s)"


def report(result: dict) -> str:
    lines = []
    summ_s, summ_g = result["summary"]["sampled"], result["summary"]["greedy"]
    task = result["task"]
    lines.append(
        f"Task: {task['difficulty']} ({task['operands']} operands of {task['digits']} digit"
        f"{'s' if task['digits'] > 1 else ''}, {task['operands'] - 1} dependent steps); {task['heldout']} held-out "
        f"problems; warm start {task.get('warm_start_hash', '')}."
    )
    lines.append("")
    thr = summ_s["rloo"]["final"][0] if "rloo" in summ_s else None
    if thr is not None:
        lines.append(
            f"Accuracy: held-out, sampled at temperature 1 (2 samples per problem) unless marked greedy. "
            f"To threshold: first step (and training wall-clock seconds, evaluations excluded, mean over seeds) where "
            f"the mean curve reaches RLOO's final mean ({thr:.3f}). Collapsed: seeds ending below half their start."
        )
        lines.append("")
    lines.append(
        "| method | seeds | start | final | AUC | to threshold: steps (s) | collapsed | final (greedy) | "
        "AUC (greedy) | prm/pair_accuracy first -> last |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for m, s in summ_s.items():
        g = summ_g[m]
        pa = s.get("pair_accuracy")
        pa_txt = f"{pa['first'][0]:.3f} -> {fmt(pa['last'])}" if pa else ""
        lines.append(
            f"| {m} | {len(s['auc_per_seed'])} | {fmt(s['start'])} | {fmt(s['final'])} | {fmt(s['auc'])} | "
            f"{_to_threshold(s, thr)} | {s['collapsed_seeds']}/{len(s['seeds'])} | {fmt(g['final'])} | "
            f"{fmt(g['auc'])} | {pa_txt} |"
        )
    lines.append("")
    lines.append("| paper claim | measured | verdict |")
    lines.append("|---|---|---|")
    for c, meas, v in result["claims"]:
        lines.append(f"| {c} | {meas} | **{v}** |")
    lines += table4_lines(summ_s)
    off = result.get("offline_prm")
    if off:
        ci = off.get("best_of_n_ci")
        lines.append("")
        lines.append(
            f"Offline implicit PRM: {off['rollouts']} rollouts of the warm start ({off['n_prompts']} train "
            f"prompts x {off['rollouts_per_prompt']}, accuracy {off['rollout_accuracy']:.3f}); training pair "
            f"accuracy CE {off['ce_train_pair_accuracy']}, DPO {off['dpo_train_pair_accuracy']}. Best-of-N "
            f"on {off['n_problems']} held-out problems (accuracy of the chosen completion, averaged over "
            "disjoint groups of N of 64 samples" + ("; 95% t-interval over problems):" if ci else "):")
        )
        lines.append("")
        keys = ["first", "majority", "ce_min", "ce_sum", "dpo_min", "dpo_sum", "oracle"]
        lines.append(
            "| N | first sample | majority vote | PRM CE (min) | PRM CE (sum) | PRM DPO (min) | PRM DPO (sum) | "
            "oracle |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for n, r in sorted(off["best_of_n"].items(), key=lambda kv: int(kv[0])):
            cells = [fmt(tuple(ci[n][k])) if ci else f"{r[k]:.3f}" for k in keys]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(VERDICT_RULES)
    return "\n".join(lines)


GROUPS = [
    (
        "RLOO family",
        [
            "rloo",
            "prime_rloo",
            "prime_rloo_oracle",
            "prime_rloo_pc0",
            "prime_rloo_frozen",
            "prime_rloo_double",
            "prime_rloo_prm2x",
            "prime_rloo_dpo",
            "prime_rloo_warm_prm",
            "prime_rloo_stabilised",
            "prime_rloo_released",
        ],
    ),
    ("GRPO family", ["grpo", "prime_grpo", "prime_grpo_process_std", "prl", "prof_grpo"]),
    ("REINFORCE", ["reinforce", "prime_reinforce"]),
    ("PPO (PRIME Table 4)", ["ppo", "prime_ppo", "prime_as_value"]),
]


def plot(result: dict, folder: str, tag: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(folder).mkdir(parents=True, exist_ok=True)
    files = []
    for key in ("sampled", "greedy"):
        summ = result["summary"][key]
        groups = [(t, [m for m in ms if m in summ]) for t, ms in GROUPS]
        groups = [(t, ms) for t, ms in groups if ms]
        if not groups:  # no plotted method among the runs
            continue
        fig, axes = plt.subplots(1, len(groups), figsize=(max(7.0, 5 * len(groups)), 4.0), sharey=True, squeeze=False)
        for ax, (title, ms) in zip(axes[0], groups):
            for m in ms:
                s = summ[m]
                lo = [max(0.0, a - (0 if math.isnan(h) else h)) for a, h in zip(s["mean"], s["half"])]
                hi = [min(1.0, a + (0 if math.isnan(h) else h)) for a, h in zip(s["mean"], s["half"])]
                (line,) = ax.plot(s["steps"], s["mean"], label=f"{m} (n={len(s['auc_per_seed'])})")
                ax.fill_between(s["steps"], lo, hi, color=line.get_color(), alpha=0.18)
            ax.set_title(title)
            ax.set_ylim(0, 1)
            ax.set_xlabel("RL step (8 prompts x 4 completions)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel(f"held-out accuracy ({key})")
        fig.suptitle(
            f"{result['task']['difficulty']} addition, 1M-parameter Llama: mean and 95% t-interval over seeds",
            fontsize=10,
        )
        fig.tight_layout()
        f = str(Path(folder) / f"learning_curves_{key}_{tag}.png")
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    summ = result["summary"]["sampled"]
    pm = [m for m in summ if "pair_accuracy" in summ[m]]
    if pm:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for m in pm:
            c = summ[m]["pair_accuracy"]["curve"]
            w = 5
            smooth = [statistics.fmean(c[max(0, i - w + 1) : i + 1]) for i in range(len(c))]
            ax.plot(range(1, len(c) + 1), smooth, label=m)
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("RL step")
        ax.set_ylabel("prm/pair_accuracy (mean over seeds, 5-step moving average)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        f = str(Path(folder) / f"prm_pair_accuracy_{tag}.png")
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"3 seeds (instead of 5), the main comparisons ({','.join(QUICK_METHODS)}), no offline PRM",
    )
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per method (default 5; --quick 3)")
    p.add_argument("--seed-offset", type=int, default=0, help="shift every seed by N (seeds are N, N+1, ...)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 60)")
    p.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every N steps (default 5)")
    p.add_argument(
        "--difficulty",
        default="4x1",
        help="OPERANDSxDIGITS, e.g. 4x1 (default) or 8x1 (the harder task: 7 dependent steps, sparse success)",
    )
    p.add_argument("--lr", type=float, default=5e-5, help="policy learning rate, every method (constant schedule)")
    p.add_argument("--prm-lr", type=float, default=1e-5, help="implicit PRM learning rate (PRIME methods)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--heldout", type=int, default=256, help="held-out problems per evaluation")
    p.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--offline-prm",
        dest="offline_prm",
        action="store_true",
        default=None,
        help="run the offline implicit PRM section (default: on, off with --quick)",
    )
    p.add_argument("--no-offline-prm", dest="offline_prm", action="store_false")
    p.add_argument(
        "--offline-prompts",
        type=int,
        default=256,
        help="train prompts whose 8 rollouts each train the offline PRMs (default 256)",
    )
    p.add_argument(
        "--offline-problems",
        type=int,
        default=128,
        help="held-out problems of the best-of-N evaluation, 64 samples each (default 128)",
    )
    p.add_argument("--json", default=None, help="write the results (per-seed curves) to this JSON file")
    p.add_argument("--report", default=None, help="write the markdown tables to this file")
    p.add_argument("--plot-dir", default=None, help="write the learning-curve plots (PNG) into this folder")
    p.add_argument("--tag", default=None, help="suffix of the plot files (default: quick / full)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="JSON",
        help="start from the runs of an earlier --json file (same settings): only the (method, seed) pairs "
        "it lacks are run; repeatable",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="with --merge: run nothing, only combine the merged runs into the JSON, tables and plots",
    )
    p.add_argument(
        "--rerun",
        action="store_true",
        help="with --merge: run --methods again and replace their merged runs (e.g. after a trainer fix)",
    )
    p.add_argument(
        "--allow-other-warm-start",
        action="store_true",
        help="with --merge: accept a file whose runs started from other warm-start weights (same recipe, trained on "
        "another machine: its held-out accuracy differs). Its runs are then paired with new ones only within a "
        "seed whose methods all ran on one machine; the default refuses",
    )
    a = p.parse_args(argv)
    methods = a.methods.split(",") if a.methods else (QUICK_METHODS if a.quick else list(METHODS))
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown --methods {bad}; choose from {list(METHODS)}")
    seeds = a.seeds or (3 if a.quick else 5)
    steps = a.steps or 60
    use_offline = a.offline_prm if a.offline_prm is not None else (not a.quick or "prime_rloo_frozen" in methods)
    if "prime_rloo_frozen" in methods and not use_offline:
        p.error("prime_rloo_frozen needs the offline PRM: drop --no-offline-prm")
    settings = {
        "difficulty": a.difficulty,
        "steps": steps,
        "eval_every": a.eval_every,
        "lr": a.lr,
        "prm_lr": a.prm_lr,
        "prompts_per_step": a.prompts_per_step,
        "num_generations": a.num_generations,
        "heldout": a.heldout,
    }
    merged: dict[tuple[str, int], dict] = {}
    merged_offline, merged_warm = None, {}
    for path in a.merge:
        old = json.loads(Path(path).read_text())
        merged_warm[path] = old["task"].get("warm_start", {}).get("heldout_accuracy")
        theirs = {**old["settings"], "difficulty": old["task"]["difficulty"], "heldout": old["task"]["heldout"]}
        diff = {k: (theirs.get(k), v) for k, v in settings.items() if theirs.get(k) != v}
        if diff:
            p.error(f"--merge {path}: settings differ (theirs, ours): {diff}")
        for m, d in old["methods"].items():
            for i, seed in enumerate(d["seeds"]):
                merged[(m, seed)] = {
                    "method": m,
                    "seed": seed,
                    "steps": d["steps"],
                    "sampled": d["accuracy"][i],
                    "greedy": d["accuracy_greedy"][i],
                    "seconds": d["seconds"][i],
                    "train_seconds": (d.get("train_seconds") or [None] * len(d["seeds"]))[i],
                    "pair_accuracy": d["prm_pair_accuracy"][i] if d["prm_pair_accuracy"] else [],
                }
        merged_offline = old.get("offline_prm") or merged_offline
    if a.rerun:
        merged = {k: v for k, v in merged.items() if k[0] not in methods}
    if seeds < 1 or steps < 1 or a.eval_every < 1 or a.workers < 1:
        p.error("--seeds, --steps, --eval-every and --workers must be >= 1")
    spec = lt.TaskSpec.parse(a.difficulty)
    tag = a.tag or ("quick" if a.quick else "full")
    from tqdm.auto import tqdm

    t0 = time.time()
    import torch

    torch.set_num_threads(max(1, a.threads * a.workers))
    recipe = lt.WarmStartRecipe(task=spec)
    warm = lt.warm_start(recipe, log=tqdm.write)
    info = json.loads((Path(warm) / "info.json").read_text())
    other = other_warm_starts(merged_warm, info["heldout_accuracy"])
    if other and not a.allow_other_warm_start:
        p.error(
            f"--merge: {sorted(other)} started from other warm-start weights (held-out accuracy {other} against "
            f"{info['heldout_accuracy']} here): the recipe {Path(warm).name} trained on another machine (CPU kernels "
            "differ), so their runs are not paired with runs made here. Re-run every method here, or pass "
            "--allow-other-warm-start."
        )
    tqdm.write(
        f"warm start: {warm} ({info['parameters']} parameters, SFT {info['sft_seconds']} s, held-out "
        f"{info['heldout_accuracy']})"
    )
    torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp(prefix="learning_bench_"))
    todo = [] if a.report_only else runs_to_do(methods, seeds, a.seed_offset, merged)
    offline, offline_folder = merged_offline, None
    needs_offline = any(METHODS[m][2].get("prm_model") in OFFLINE_PLACEHOLDERS for m, _ in todo)
    if needs_offline or (use_offline and offline is None and not a.report_only):
        os.environ.setdefault("TRL_PRIME_MATH_WORKERS", "2")
        torch.set_num_threads(a.threads * a.workers)  # before the workers start
        offline, offline_folder = offline_prm(
            warm, spec, work, n_prompts=a.offline_prompts, rollouts=8, n_problems=a.offline_problems, log=tqdm.write
        )
        torch.set_num_threads(a.threads)
        tqdm.write(f"offline PRM section: {offline['seconds']} s")

    jobs = [
        dict(
            method=m,
            seed=s,
            warm=warm,
            spec=spec,
            steps=steps,
            eval_every=a.eval_every,
            lr=a.lr,
            prm_lr=a.prm_lr,
            prompts_per_step=a.prompts_per_step,
            num_generations=a.num_generations,
            n_heldout=a.heldout,
            offline_prm=offline_folder,
            device=a.device,
        )
        for m, s in todo
    ]

    def build(runs: dict[str, list[dict]], partial: bool) -> dict:
        runs = {m: sorted(runs[m], key=lambda r: r["seed"]) for m in METHODS if m in runs}
        summary = {k: summarize(runs, k) for k in ("greedy", "sampled")}
        result = {
            "methods": {
                m: {
                    "steps": rs[0]["steps"],
                    "seeds": [r["seed"] for r in rs],
                    "accuracy": [r["sampled"] for r in rs],
                    "accuracy_greedy": [r["greedy"] for r in rs],
                    "start": summary["sampled"][m]["start"][0],
                    "final": [r["sampled"][-1] for r in rs],
                    "final_greedy": [r["greedy"][-1] for r in rs],
                    "prm_pair_accuracy": [r["pair_accuracy"] for r in rs] if rs[0]["pair_accuracy"] else None,
                    "seconds": [r["seconds"] for r in rs],
                    "train_seconds": [r.get("train_seconds") for r in rs],
                }
                for m, rs in runs.items()
            },
            "task": {
                "name": "step-by-step multi-operand addition",
                "difficulty": str(spec),
                "operands": spec.operands,
                "digits": spec.digits,
                "heldout": a.heldout,
                "warm_start": info,
                "warm_start_hash": Path(warm).name,
            },
            "settings": {
                "steps": steps,
                "seeds": seeds,
                "seed_offset": a.seed_offset,
                "eval_every": a.eval_every,
                "merged": a.merge,
                "lr": a.lr,
                "prm_lr": a.prm_lr,
                "prompts_per_step": a.prompts_per_step,
                "num_generations": a.num_generations,
                "lr_scheduler_type": "constant",
                "temperature": 1.0,
                "filter": [0.0, 1.0],
                "accuracy": "sampled at temperature 1, 2 samples per held-out problem (accuracy_greedy: greedy)",
                "command": " ".join(
                    ["python", "benchmarks/learning.py", *(argv if argv is not None else sys.argv[1:])]
                ),
            },
            "machine": _common.machine(),
            "summary": summary,
            "offline_prm": offline,
            "seconds": round(time.time() - t0, 1),
            "partial": partial,
        }
        result["claims"] = claims(summary["sampled"], offline)
        return result

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Manager().Queue()
    runs: dict[str, list[dict]] = {}
    for (m, _), r in merged.items():
        runs.setdefault(m, []).append(r)
    bar = tqdm(total=len(jobs) * steps, desc="RL steps", unit="step", smoothing=0.05)
    done = threading.Event()

    def pump():
        while not done.is_set():
            try:
                bar.update(q.get(timeout=0.5))
            except queue.Empty:
                pass

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    with ProcessPoolExecutor(
        max_workers=a.workers, mp_context=ctx, initializer=_init_worker, initargs=(q, a.threads)
    ) as ex:
        futures = [ex.submit(_job, j) for j in jobs]
        for f in futures:
            r = f.result()
            runs.setdefault(r["method"], []).append(r)
            tqdm.write(
                f"{r['method']:>18} seed {r['seed']}: greedy {r['greedy'][0]:.3f} -> {r['greedy'][-1]:.3f}, "
                f"sampled {r['sampled'][0]:.3f} -> {r['sampled'][-1]:.3f} ({r['seconds']} s)"
            )
            if a.json:  # after every run, so an interrupted benchmark keeps its finished runs (--merge it)
                _common.dump(build(runs, partial=True), a.json)
    done.set()
    th.join()
    bar.close()
    result = build(runs, partial=False)
    text = report(result)
    print(text)
    if a.report:
        Path(a.report).parent.mkdir(parents=True, exist_ok=True)
        Path(a.report).write_text(text + "\n")
    if a.plot_dir:
        for f in plot(result, a.plot_dir, tag):
            tqdm.write(f"plot: {f}")
    if a.json:
        _common.dump(result, a.json)
    tqdm.write(f"total {time.time() - t0:.0f} s")
    return result


if __name__ == "__main__":
    main()
