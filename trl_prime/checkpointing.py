"""Checkpointing of the PRIME, PRL and PROF trainers: atomic checkpoints and exact resume.

:class:`Checkpoints` (a plain object each trainer's adapter, :mod:`trl_prime.adapters`, calls from Trainer's
checkpoint hooks):

  * **atomic checkpoints**: a checkpoint is written into ``<output_dir>/.staging-checkpoint-N/checkpoint-N`` and
    renamed to ``<output_dir>/checkpoint-N`` only once every file of every process (policy, PRM, optimizers,
    schedulers, RNG states, trainer and guard state) is on disk; older checkpoints are rotated only after that. A
    process killed mid-save leaves the staging folder behind, which ``resume_from_checkpoint=True`` ignores.
  * **exact resume inside a generation window**: TRL generates once every ``steps_per_generation * num_iterations``
    micro-steps and trains the micro-steps in between on its buffered generation batch (``_buffered_inputs``, slice
    ``_step % steps_per_generation``). Every process writes that buffer (only when the next micro-step does not
    generate anew) and its micro-step counter ``_step``, with the guard's poison flag, into
    ``generation_state_<process index>.pt`` of the checkpoint; a resumed run restores them, so it trains on the very
    rollouts, advantages, old log-probs and PRM token rewards the interrupted run had (no second PRIME PRM update on
    one generation batch), and Trainer's data skip (``global_step * gradient_accumulation_steps`` batches) and RNG
    restore put it where the uninterrupted run would be. TRL's ``RepeatSampler`` draws a new permutation of the prompts
    from its own generator at every epoch and has no ``set_epoch``: a run resumed in epoch ``e`` replays the ``e``
    earlier draws first, so it walks the prompts in the uninterrupted run's order.

The guard counters (:class:`~trl_prime.guards.Guards`) are saved with every checkpoint (``guard_state.json``)
and restored on resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

import torch


logger = logging.getLogger(__name__)

#: the guard counters of :class:`~trl_prime.guards.Guards` (consecutive and total skipped steps)
GUARD_STATE_NAME = "guard_state.json"
#: per process (``.format(process_index)``): TRL's buffered generation batch and micro-step counter (module doc)
GENERATION_STATE_NAME = "generation_state_{}.pt"
GENERATION_STATE_VERSION = 1
STAGING_PREFIX = ".staging-"


class Checkpoints:
    """Atomic checkpoints and exact resume of one trl-prime trainer (see the module docstring): a plain object the
    trainer's adapter (:mod:`trl_prime.adapters`) owns and calls from Trainer's checkpoint hooks.

    Args:
        trainer: the TRL trainer whose state it saves: ``args``, ``state``, ``accelerator`` and TRL's buffered
            generation batch (``_buffered_inputs``, ``_step``), read at save and resume time.
        guards: the run's :class:`~trl_prime.guards.Guards` (counters and poisoned-batch flag, saved and restored).
    """

    def __init__(self, trainer, guards):
        self.trainer, self.guards = trainer, guards
        self.staging_root: str | None = None  # the staging folder of the save in progress (reentrant saves share it)
        self.train_sampler = None  # this train() call's sampler (TRL's RepeatSampler), for the epoch replay

    def output_dir(self, run_dir: str) -> str:
        """Where Trainer writes a checkpoint: the staging folder while :meth:`atomic` runs, else ``run_dir``."""
        return run_dir if self.staging_root is None else self.staging_root

    @contextlib.contextmanager
    def atomic(self, run_dir: str):
        """Redirect the checkpoint of this step into a staging folder under ``run_dir`` (Trainer's run folder);
        publish it with one rename once complete, then rotate. Reentrant. Collective."""
        if self.staging_root is not None:
            yield
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        t = self.trainer
        name = f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}"
        staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        if t.args.should_save and os.path.exists(staging_root):
            shutil.rmtree(staging_root)  # left over by a process killed mid-save
        t.accelerator.wait_for_everyone()
        limit = t.args.save_total_limit
        self.staging_root = staging_root
        t.args.save_total_limit = None  # rotate only once the new checkpoint is published
        try:
            yield
            self.save_generation_state(os.path.join(staging_root, name))
            if t.args.should_save:
                with open(os.path.join(staging_root, name, GUARD_STATE_NAME), "w") as f:
                    json.dump(
                        {"consecutive_skips": self.guards.consecutive_skips, "total_skips": self.guards.total_skips}, f
                    )
        finally:
            self.staging_root = None
            t.args.save_total_limit = limit
        t.accelerator.wait_for_everyone()
        self._publish(run_dir, staging_root, name, limit)
        t.accelerator.wait_for_everyone()

    def _publish(self, run_dir: str, staging_root: str, name: str, limit: int | None) -> None:
        """Point the best checkpoint at its published folder, rename the staged checkpoint into place, rotate."""
        t = self.trainer
        staging_prefix = os.path.join(staging_root, "")
        best = t.state.best_model_checkpoint
        if best and best.startswith(staging_prefix):
            # on every rank (each loads the best model at the end), and in the checkpoint's own trainer_state.json
            # (a resumed run must protect and load the published folder, not the vanished staging one)
            t.state.best_model_checkpoint = os.path.join(run_dir, best[len(staging_prefix) :])
            state_file = os.path.join(staging_root, name, "trainer_state.json")
            if t.args.should_save and os.path.isfile(state_file):
                t.state.save_to_json(state_file)
        if not t.args.should_save:
            return
        staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        _fsync_tree(staged)
        old = None
        if os.path.exists(final):  # a re-run of the same step: swap it out, then drop it
            old = os.path.join(run_dir, f"{STAGING_PREFIX}old-{name}")
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(staged, final)
        _fsync_dir(run_dir)
        shutil.rmtree(staging_root, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        from transformers.trainer_utils import rotate_checkpoints

        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=limit,
            best_model_checkpoint=t.state.best_model_checkpoint,
            use_mtime=True,
        )

    def restore(self, checkpoint: str) -> None:
        """On resume: the guard counters (``guard_state.json``) and this process's buffered generation batch."""
        path = os.path.join(checkpoint, GUARD_STATE_NAME)
        if os.path.isfile(path):
            with open(path) as f:
                state = json.load(f)
            self.guards.consecutive_skips = state.get("consecutive_skips", 0)
            self.guards.total_skips = state.get("total_skips", 0)
        self.load_generation_state(checkpoint)

    @contextlib.contextmanager
    def same_dtypes(self, model):
        """Trainer's weight loading, keeping every parameter's dtype. On a quantised base TRL casts the trainable LoRA
        weights to bfloat16 (QLoRA), but Trainer reloads a PEFT checkpoint with ``PeftModel.load_adapter``, whose
        ``autocast_adapter_dtype`` upcasts them to float32: the resumed run would train another model than the
        interrupted one (and its optimizer state would be cast to float32). The values saved are bfloat16, so the
        cast back is exact."""
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        yield
        for n, p in model.named_parameters():
            if n in dtypes and p.dtype != dtypes[n]:
                p.data = p.data.to(dtypes[n])

    def replay_epochs(self, epochs_trained: int, resume_from_checkpoint) -> None:
        """TRL's RepeatSampler draws each epoch's permutation from its own generator on the first index of the epoch
        and has no ``set_epoch``: on resume in a later epoch, replay the draws of the epochs the interrupted run went
        through."""
        sampler, self.train_sampler = self.train_sampler, None  # this train() call's
        shuffled = getattr(sampler, "generator", None) is not None
        if resume_from_checkpoint is not None and epochs_trained > 0 and shuffled:
            for _ in range(epochs_trained):
                next(iter(sampler), None)

    # --------------------------------------------------------------------------------------------------------
    # Buffered generation batch (exact resume inside a generation window)
    # --------------------------------------------------------------------------------------------------------
    def generation_layout(self) -> dict:
        """What fixes the meaning of ``_step`` and the shape of the buffer: a resumed run must match it."""
        t = self.trainer
        a = t.args
        return {
            "steps_per_generation": a.steps_per_generation,
            "num_iterations": t.num_iterations,
            "gradient_accumulation_steps": a.gradient_accumulation_steps,
            "per_device_train_batch_size": a.per_device_train_batch_size,
            "num_generations": t.num_generations,
            "num_processes": t.accelerator.num_processes,
        }

    def _generate_every(self) -> int:
        return self.trainer.args.steps_per_generation * self.trainer.num_iterations

    def save_generation_state(self, checkpoint_dir: str) -> None:
        """Write this process's buffered generation batch and micro-step counter (every process; see the module doc).

        The buffer is written only when the next micro-step reuses it (``_step`` not a multiple of
        ``steps_per_generation * num_iterations``); otherwise the resumed run generates anew, as the uninterrupted
        one does, and the file holds ``_step`` alone."""
        t = self.trainer
        if not hasattr(t, "_buffered_inputs") or not hasattr(t, "_step"):
            return
        reused = t._step % self._generate_every() != 0
        state = {
            "version": GENERATION_STATE_VERSION,
            "step": t._step,
            "layout": self.generation_layout(),
            "buffered_inputs": t._buffered_inputs if reused else None,
            "poison": self.guards.poison,
            "step_pending": self.guards.step_pending,
        }
        os.makedirs(checkpoint_dir, exist_ok=True)
        torch.save(state, os.path.join(checkpoint_dir, GENERATION_STATE_NAME.format(t.accelerator.process_index)))

    def load_generation_state(self, checkpoint: str) -> None:
        """Restore what :meth:`save_generation_state` wrote; without it (a checkpoint of an older trl-prime, or
        another layout) the resumed run generates a new batch at its first micro-step, with a warning when the
        checkpoint lies inside a generation window (the run then differs from an uninterrupted one)."""
        t = self.trainer
        if not hasattr(t, "_buffered_inputs") or not hasattr(t, "_step"):
            return
        path = os.path.join(checkpoint, GENERATION_STATE_NAME.format(t.accelerator.process_index))
        micro = t.state.global_step * t.args.gradient_accumulation_steps
        inside = micro % self._generate_every() != 0
        if not os.path.isfile(path):
            if inside:
                logger.warning(
                    "%s has no %s (written by an older trl-prime): the checkpoint lies inside a generation window "
                    "(steps_per_generation=%d, num_iterations=%d), so the resumed run generates a new batch from the "
                    "next prompts at step %d instead of reusing the buffered one, and differs from an uninterrupted "
                    "run.",
                    checkpoint,
                    GENERATION_STATE_NAME.format(t.accelerator.process_index),
                    t.args.steps_per_generation,
                    t.num_iterations,
                    t.state.global_step + 1,
                )
            return
        from accelerate.utils import send_to_device
        from transformers.trainer_pt_utils import safe_globals

        with safe_globals():  # tensors, containers and numpy scalars/arrays, as Trainer loads its RNG states
            state = torch.load(path, map_location="cpu", weights_only=True)  # (torch.load rejects e.g. "cpu:0")
        layout = self.generation_layout()
        if state.get("version") != GENERATION_STATE_VERSION or state.get("layout") != layout:
            changed = {k: (v, layout.get(k)) for k, v in (state.get("layout") or {}).items() if layout.get(k) != v}
            logger.warning(
                "The buffered generation batch in %s was written with another batch layout (checkpoint -> now: %s): "
                "it is dropped and the resumed run generates a new batch at step %d.",
                path,
                changed,
                t.state.global_step + 1,
            )
            return
        t._step = state["step"]
        t._buffered_inputs = send_to_device(state["buffered_inputs"], t.accelerator.device)
        self.guards.poison = state["poison"]
        self.guards.step_pending = state["step_pending"]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Flush every file and folder under ``root`` to disk (so a rename publishes complete files)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                with open(os.path.join(dirpath, f), "rb") as fh:
                    os.fsync(fh.fileno())
            except OSError:
                pass
        _fsync_dir(dirpath)
