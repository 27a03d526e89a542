"""What the test files share besides the tiny models (``tests/tiny.py``): the repository's paths, the tiny trainer
configs of the single-process tests and the ``accelerate launch`` of the multi-process ones.

``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so every test file, wherever it stands below ``tests/``,
imports ``from helpers import ...``; the scripts of ``tests/scripts/`` run with ``tests/`` on ``PYTHONPATH`` too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRIPTS = os.path.join(TESTS, "scripts")
DATA = os.path.join(TESTS, "data")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")

K = 4  # completions per prompt of the tiny trainer configs

# the settings every tiny single-process trainer run shares: CPU, fp32, no reports, no checkpoints, one prompt group
# of K completions per 8-row batch
TINY = dict(
    bf16=False,
    gradient_checkpointing=False,
    use_cpu=True,
    report_to=[],
    disable_tqdm=True,
    per_device_train_batch_size=8,
    num_generations=K,
    max_completion_length=8,
    max_steps=1,
    logging_steps=1,
    save_strategy="no",
    seed=0,
    learning_rate=1e-3,
)


def tiny_kwargs(tmp_path, drop=(), **overrides) -> dict:
    """The keyword arguments of a tiny trainer config writing to ``tmp_path/out``: :data:`TINY` less the keys in
    ``drop`` (left at the config's default), with ``overrides``."""
    kw = {k: v for k, v in TINY.items() if k not in drop}
    kw.update(overrides)
    if "output_dir" not in kw:
        kw["output_dir"] = str(tmp_path / "out")
    return kw


def tiny_config(cls, tmp_path, drop=(), **overrides):
    """A tiny trainer config of class ``cls`` (``PrimeRLOOConfig``, ``PRLConfig``, ...): see :func:`tiny_kwargs`."""
    return cls(**tiny_kwargs(tmp_path, drop, **overrides))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_argv(script: str, *args: str, config_file: str | None = None) -> list[str]:
    """``accelerate launch`` of ``script`` with ``args``: 2 CPU processes (DDP over gloo) without mixed precision or
    dynamo, or the processes ``config_file`` names, on a free port."""
    if config_file is None:
        how = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
        how += ["--dynamo_backend", "no"]
    else:
        how = ["--config_file", config_file]
    return [ACCELERATE, "launch", *how, "--main_process_port", str(free_port()), script, *args]


def launch_env(**extra: str) -> dict:
    """The environment of a launched test script: the repository and ``tests/`` importable, one thread, offline."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, TESTS]),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        **extra,
    )


def run_launched(cmd: list[str], timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """Runs ``cmd`` (a :func:`launch_argv`, or a single process) from the repository root in :func:`launch_env`."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch_env(**env), cwd=ROOT)


def read_summary(out: str) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def naive_logps(model, input_ids, attention_mask, T):
    """Per-token log-probs of the last ``T`` positions, the reference implementation: one unpadded row at a time, full log_softmax, default positions."""
    import torch

    out = torch.zeros(input_ids.size(0), T)
    with torch.no_grad():
        for i in range(input_ids.size(0)):
            keep = attention_mask[i].bool()
            ids = input_ids[i][keep].unsqueeze(0)
            n_comp = int(attention_mask[i, -T:].sum())
            logits = model(input_ids=ids).logits[0]
            lp = logits.log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            out[i, :n_comp] = lp[-n_comp:]
    return out


# ---------------------------------------------------------------------------------------------------------------
# snapshots of everything a PRIME step could move (tests/prime/test_empty_steps.py, tests/prime/test_prm_levers.py)
# ---------------------------------------------------------------------------------------------------------------
def snapshot_config(cls, tmp_path, **overrides):
    """The tiny config of the snapshot tests: 2 steps, short completions, linear schedules for both optimizers (a
    step that moves a schedule shows)."""
    return tiny_config(
        cls,
        tmp_path,
        **{
            "max_completion_length": 6,
            "max_steps": 2,
            "prm_learning_rate": 1e-3,
            "lr_scheduler_type": "linear",
            "prm_lr_scheduler": "linear",
            **overrides,
        },
    )


def trainer_state(trainer) -> dict:
    """Everything a step could move: weights, AdamW state (moments, step counts), schedules (cloned)."""
    import torch

    def opt_state(opt):
        return {
            i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            for i, st in enumerate(opt.state.values())
        }

    return {
        "policy": [p.detach().clone() for p in trainer.model.parameters()],
        "prm": [p.detach().clone() for p in trainer.prm_model.parameters()],
        "policy_opt": opt_state(trainer.optimizer),
        "prm_opt": opt_state(trainer.prm_optimizer),
        "policy_sched": trainer.lr_scheduler.state_dict()["last_epoch"],
        "prm_sched": trainer.prm_lr_scheduler.state_dict()["last_epoch"],
        "prm_updates": trainer.prm_optim.num_updates,
    }


def assert_same_state(a: dict, b: dict) -> None:
    import torch

    for k in ("policy", "prm"):
        assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), f"{k} weights moved"
    for k in ("policy_opt", "prm_opt"):
        assert a[k].keys() == b[k].keys()
        for i in a[k]:
            for name, v in a[k][i].items():
                w = b[k][i][name]
                assert torch.equal(v, w) if torch.is_tensor(v) else v == w, f"{k}[{i}].{name} moved"
    for k in ("policy_sched", "prm_sched", "prm_updates"):
        assert a[k] == b[k], k


def train_with_snapshots(cls, cfg_cls, model, tmp_path, reward, **overrides):
    """Trains ``cls`` on 32 tiny prompts with :func:`snapshot_config`; returns the trainer and the states it had
    after steps 1 and 2 (``.after_step1``, ``.after_step2``)."""
    from tiny import tiny_prompt_dataset
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        trainer = after_step1 = after_step2 = None

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (1, 2):
                setattr(self, f"after_step{state.global_step}", trainer_state(self.trainer))

    snap = Snapshots()
    trainer = cls(
        model=model,
        reward_funcs=reward,
        args=snapshot_config(cfg_cls, tmp_path, **overrides),
        train_dataset=tiny_prompt_dataset(32),
        callbacks=[snap],
    )
    snap.trainer = trainer
    trainer.train()
    return trainer, snap


#: the PRIME settings of the tiny runs whose PRM must train: a high PRM learning rate, every prompt group kept by the
#: online filter (zero-spread groups included)
PRIME_OPEN = dict(prm_learning_rate=1e-2, filter_lower=0.0, filter_upper=1.0)


def trainer_kinds() -> dict:
    """The trainer and config classes of each kind: ``{"prime_rloo": (PrimeRLOOTrainer, PrimeRLOOConfig), ...}``
    ("prime_rloo", "prime_grpo", "prl", "prof")."""
    from trl_prime import (
        PrimeGRPOConfig,
        PrimeGRPOTrainer,
        PrimeRLOOConfig,
        PrimeRLOOTrainer,
        PRLConfig,
        PRLGRPOTrainer,
        ProfGRPOConfig,
        ProfGRPOTrainer,
    )

    return {
        "prime_rloo": (PrimeRLOOTrainer, PrimeRLOOConfig),
        "prime_grpo": (PrimeGRPOTrainer, PrimeGRPOConfig),
        "prl": (PRLGRPOTrainer, PRLConfig),
        "prof": (ProfGRPOTrainer, ProfGRPOConfig),
    }


def tiny_trainer(which: str, kw: dict, prime: dict | None = None, prof_prm: str | None = None, **common):
    """A trainer of kind ``which`` (see :func:`trainer_kinds`) on the config keyword arguments ``kw`` and the kind's
    own settings, defaults that ``kw`` overrides: ``prime`` for the PRIME trainers, PRL with eta 2 and token steps,
    PROF keeping 2 completions per group, scored by the step PRM ``prof_prm``. ``common``: the trainer's keyword
    arguments."""
    trainer_cls, config_cls = trainer_kinds()[which]
    extra = {
        "prl": dict(prl_eta=2.0, prl_step_split="token"),
        "prof": dict(prof_prm=prof_prm, prof_num_keep=2),
    }.get(which, prime or {})
    return trainer_cls(args=config_cls(**{**extra, **kw}), **common)


def poison_advantages_on_round(monkeypatch, round_number: int = 2) -> None:
    """Make the PRIME trainer's advantages (``F.prime_advantages``) non-finite on its ``round_number``-th call: the
    PRM's backward has run, so the policy step the guard then skips must drop the PRM step held for it."""
    import trl_prime.prime.trainer as prime_trainer

    real, calls = prime_trainer.F.prime_advantages, []

    def poisoned(**kw):
        adv = real(**kw)
        calls.append(1)
        if len(calls) == round_number:
            adv = adv.clone()
            adv[0, 0] = float("nan")
        return adv

    monkeypatch.setattr(prime_trainer.F, "prime_advantages", poisoned)


def stop_at(step: int):
    """A callback that ends training after ``step`` (a checkpoint saved there is the one to resume from)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == step:
                control.should_training_stop = True

    return StopAt()


def interrupted_and_full(make, tmp_path, step: int = 2):
    """Train ``make(out)`` to the end, and ``make(out2, callbacks)`` stopped at ``step`` then resumed from its
    ``checkpoint-<step>`` in a new trainer. Returns ``(full, resumed)`` (the resumed trainer)."""
    full = make(tmp_path / "full")
    full.train()
    make(tmp_path / "resumed", callbacks=[stop_at(step)]).train()
    resumed = make(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / f"checkpoint-{step}"))
    return full, resumed
