"""Bit-for-bit fingerprint of short runs of every trainer kind: a refactor that keeps behaviour keeps it.

Each variant trains a tiny Qwen2 policy (tests/tiny.py, built locally, seed 0) for 3 steps on 32 tiny prompts (reward:
the completion contains "e"), one torch thread, CPU, fp32. The fingerprint of a run is the SHA-256 of its final
policy weights (and PRM weights for PRIME) and its whole ``log_history`` (every metric, rounded to 10 digits; timing
entries left out). Variants: PRIME-RLOO, PRIME-GRPO, PRIME-RLOO with PPO (a critic), with replay + oversampling + the
paper's filter, with PROF (implicit PRM), PRIME-GRPO with ``steps_per_generation=2``, gradient accumulation 2 and
``num_iterations=2``, PRL and PROF-GRPO.

Usage (from the repository root; ``--root`` another checkout, e.g. a git worktree of the commit before a change)::

    python benchmarks/fingerprint.py --json before.json --root /tmp/before
    python benchmarks/fingerprint.py --json after.json
    python benchmarks/fingerprint.py --compare before.json after.json   # exit 1 when a variant differs

The same code on the same machine gives the same fingerprints; across machines (CPU instruction sets) they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile


VARIANTS = {
    "prime_rloo": ("prime_rloo", {}),
    "prime_grpo": ("prime_grpo", {}),
    "prime_rloo_ppo": ("prime_rloo", {"prime_estimator": "ppo"}),
    "prime_rloo_replay_os": (
        "prime_rloo",
        {"prm_replay_rounds": 2, "oversample_factor": 2.0, "filter_lower": 0.2, "filter_upper": 0.8},
    ),
    "prime_grpo_spg": (
        "prime_grpo",
        {"steps_per_generation": 2, "gradient_accumulation_steps": 2, "num_iterations": 2},
    ),
    "prime_rloo_prof": ("prime_rloo", {"prof_mode": "both", "prof_prm": "implicit", "prof_num_keep": 2}),
    "prl": ("prl", {}),
    "prof": ("prof", {}),
}


def _digest(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _logs(history: list[dict]) -> list[dict]:
    return [
        {
            k: (round(v, 10) if isinstance(v, float) else v)
            for k, v in h.items()
            if "time" not in k and "per_second" not in k
        }
        for h in history
    ]


def fingerprints(root: str, only: list[str] | None = None) -> dict:
    """``{variant: {"policy": sha, "prm": sha (PRIME), "logs": [...]}}`` of the checkout at ``root``."""
    sys.path[:0] = [root, os.path.join(root, "tests")]
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(k, "1")
    import torch
    from helpers import PRIME_OPEN, tiny_kwargs, tiny_trainer
    from tiny import build_tiny_model, contains_reward, tiny_prompt_dataset
    from tiny_prm import build_tiny_step_prm

    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        policy = build_tiny_model(os.path.join(d, "policy"), arch="qwen2", seed=0)
        step_prm = build_tiny_step_prm(os.path.join(d, "step_prm"))
        for name, (kind, extra) in VARIANTS.items():
            if only and name not in only:
                continue
            common = extra if not kind.startswith("prime") else {}
            kw = tiny_kwargs(None, output_dir=os.path.join(d, name), max_steps=3, **common)
            trainer = tiny_trainer(
                kind,
                kw,
                {**PRIME_OPEN, **extra},
                prof_prm=step_prm,
                model=policy,
                reward_funcs=contains_reward("e"),
                train_dataset=tiny_prompt_dataset(32),
            )
            trainer.train()
            out[name] = {"policy": _digest(trainer.model), "logs": _logs(trainer.state.log_history)}
            if hasattr(trainer, "prm_model"):
                out[name]["prm"] = _digest(trainer.prm_model)
            print(name, out[name]["policy"], out[name].get("prm", ""), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--json", help="write the fingerprints here")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    a = p.parse_args()
    if a.compare:
        first, second = (json.load(open(f)) for f in a.compare)
        same = {k: first.get(k) == second.get(k) for k in sorted(set(first) | set(second))}
        for k, v in same.items():
            print(f"{k:24s} {'identical' if v else 'DIFFERS'}")
        return 0 if all(same.values()) else 1
    result = fingerprints(os.path.abspath(a.root), a.variants.split(",") if a.variants else None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
