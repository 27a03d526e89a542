"""Checkpointing of the PRIME, PRL and PROF trainers: atomic checkpoints and exact resume.

:class:`CheckpointMixin` (a base of the trainers, with :class:`~trl_prime.guards.GuardsMixin`, before TRL's class in
the MRO):

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

The guard counters (:class:`~trl_prime.guards.GuardsMixin`) are saved with every checkpoint (``guard_state.json``)
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

#: the guard counters of :class:`~trl_prime.guards.GuardsMixin` (consecutive and total skipped steps)
GUARD_STATE_NAME = "guard_state.json"
#: per process (``.format(process_index)``): TRL's buffered generation batch and micro-step counter (module doc)
GENERATION_STATE_NAME = "generation_state_{}.pt"
GENERATION_STATE_VERSION = 1
STAGING_PREFIX = ".staging-"


class CheckpointMixin:
    """Atomic checkpoints and exact resume for the trl-prime trainers (see the module docstring). Place it before
    :class:`~trl_prime.guards.GuardsMixin` and TRL's trainer class in the bases: it saves and restores the guard
    counters and the poisoned-batch flag with the buffered generation batch."""

    _guard_saving = False  # inside a checkpoint save (reentrant saves write into the same staging folder)
    _guard_staging_root: str | None = None  # the staging folder of the save in progress

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint is not None:
            path = os.path.join(resume_from_checkpoint, GUARD_STATE_NAME)
            if os.path.isfile(path):
                with open(path) as f:
                    state = json.load(f)
                self._guard_consecutive_skips = state.get("consecutive_skips", 0)
                self._guard_total_skips = state.get("total_skips", 0)
            self._guard_load_generation_state(resume_from_checkpoint)
        return model, train_dataloader

    # --------------------------------------------------------------------------------------------------------
    # Atomic checkpoints
    # --------------------------------------------------------------------------------------------------------
    def _get_output_dir(self, trial):
        run_dir = super()._get_output_dir(trial)
        if getattr(self, "_guard_staging_root", None) is not None:
            return self._guard_staging_root
        return run_dir

    @contextlib.contextmanager
    def _guard_atomic_checkpoint(self, trial):
        """Redirect the checkpoint into a staging folder; publish it with one rename once complete. Reentrant."""
        if getattr(self, "_guard_saving", False):
            yield
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        acc = self.accelerator
        if self.args.should_save and os.path.exists(staging_root):
            shutil.rmtree(staging_root)  # left over by a process killed mid-save
        acc.wait_for_everyone()
        limit = self.args.save_total_limit
        self._guard_saving, self._guard_staging_root = True, staging_root
        self.args.save_total_limit = None  # rotate only once the new checkpoint is published
        try:
            yield
            self._guard_save_generation_state(os.path.join(staging_root, name))
            if self.args.should_save:
                with open(os.path.join(staging_root, name, GUARD_STATE_NAME), "w") as f:
                    json.dump(
                        {"consecutive_skips": self._guard_consecutive_skips, "total_skips": self._guard_total_skips}, f
                    )
        finally:
            self._guard_saving, self._guard_staging_root = False, None
            self.args.save_total_limit = limit
        acc.wait_for_everyone()
        staging_prefix = os.path.join(staging_root, "")
        best = self.state.best_model_checkpoint
        if best and best.startswith(staging_prefix):
            # on every rank (each loads the best model at the end), and in the checkpoint's own trainer_state.json
            # (a resumed run must protect and load the published folder, not the vanished staging one)
            self.state.best_model_checkpoint = os.path.join(run_dir, best[len(staging_prefix) :])
            state_file = os.path.join(staging_root, name, "trainer_state.json")
            if self.args.should_save and os.path.isfile(state_file):
                self.state.save_to_json(state_file)
        if self.args.should_save:
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
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        acc.wait_for_everyone()

    def _save_checkpoint(self, model, trial):
        with self._guard_atomic_checkpoint(trial):
            super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Trainer's weight loading, keeping every parameter's dtype. On a quantised base TRL casts the trainable LoRA
        weights to bfloat16 (QLoRA), but Trainer reloads a PEFT checkpoint with ``PeftModel.load_adapter``, whose
        ``autocast_adapter_dtype`` upcasts them to float32: the resumed run would train another model than the
        interrupted one (and its optimizer state would be cast to float32). The values saved are bfloat16, so the
        cast back is exact."""
        target = self.model if model is None else model
        dtypes = {n: p.dtype for n, p in target.named_parameters()}
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        for n, p in target.named_parameters():
            if n in dtypes and p.dtype != dtypes[n]:
                p.data = p.data.to(dtypes[n])

    # --------------------------------------------------------------------------------------------------------
    # Buffered generation batch and prompt order (exact resume inside a generation window, in a later epoch)
    # --------------------------------------------------------------------------------------------------------
    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        self._guard_train_sampler = sampler
        return sampler

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        epochs_trained, steps_in_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        sampler, self._guard_train_sampler = getattr(self, "_guard_train_sampler", None), None  # this train() call's
        shuffled = getattr(sampler, "generator", None) is not None
        if resume_from_checkpoint is not None and epochs_trained > 0 and shuffled:
            # TRL's RepeatSampler draws each epoch's permutation from its own generator on the first index of the
            # epoch and has no set_epoch: replay the draws of the epochs the interrupted run went through
            for _ in range(epochs_trained):
                next(iter(sampler), None)
        return epochs_trained, steps_in_epoch

    def _guard_generation_layout(self) -> dict:
        """What fixes the meaning of ``_step`` and the shape of the buffer: a resumed run must match it."""
        a = self.args
        return {
            "steps_per_generation": a.steps_per_generation,
            "num_iterations": self.num_iterations,
            "gradient_accumulation_steps": a.gradient_accumulation_steps,
            "per_device_train_batch_size": a.per_device_train_batch_size,
            "num_generations": self.num_generations,
            "num_processes": self.accelerator.num_processes,
        }

    def _guard_generate_every(self) -> int:
        return self.args.steps_per_generation * self.num_iterations

    def _guard_save_generation_state(self, checkpoint_dir: str) -> None:
        """Write this process's buffered generation batch and micro-step counter (every process; see the module doc).

        The buffer is written only when the next micro-step reuses it (``_step`` not a multiple of
        ``steps_per_generation * num_iterations``); otherwise the resumed run generates anew, as the uninterrupted
        one does, and the file holds ``_step`` alone."""
        if not hasattr(self, "_buffered_inputs") or not hasattr(self, "_step"):
            return
        reused = self._step % self._guard_generate_every() != 0
        state = {
            "version": GENERATION_STATE_VERSION,
            "step": self._step,
            "layout": self._guard_generation_layout(),
            "buffered_inputs": self._buffered_inputs if reused else None,
            "poison": self._guard_poison,
            "step_pending": self._guard_step_pending,
        }
        os.makedirs(checkpoint_dir, exist_ok=True)
        torch.save(state, os.path.join(checkpoint_dir, GENERATION_STATE_NAME.format(self.accelerator.process_index)))

    def _guard_load_generation_state(self, checkpoint: str) -> None:
        """Restore what :meth:`_guard_save_generation_state` wrote; without it (a checkpoint of an older trl-prime, or
        another layout) the resumed run generates a new batch at its first micro-step, with a warning when the
        checkpoint lies inside a generation window (the run then differs from an uninterrupted one)."""
        if not hasattr(self, "_buffered_inputs") or not hasattr(self, "_step"):
            return
        path = os.path.join(checkpoint, GENERATION_STATE_NAME.format(self.accelerator.process_index))
        micro = self.state.global_step * self.args.gradient_accumulation_steps
        inside = micro % self._guard_generate_every() != 0
        if not os.path.isfile(path):
            if inside:
                logger.warning(
                    "%s has no %s (written by an older trl-prime): the checkpoint lies inside a generation window "
                    "(steps_per_generation=%d, num_iterations=%d), so the resumed run generates a new batch from the "
                    "next prompts at step %d instead of reusing the buffered one, and differs from an uninterrupted "
                    "run.",
                    checkpoint,
                    GENERATION_STATE_NAME.format(self.accelerator.process_index),
                    self.args.steps_per_generation,
                    self.num_iterations,
                    self.state.global_step + 1,
                )
            return
        from accelerate.utils import send_to_device
        from transformers.trainer_pt_utils import safe_globals

        with safe_globals():  # tensors, containers and numpy scalars/arrays, as Trainer loads its RNG states
            state = torch.load(path, map_location="cpu", weights_only=True)  # (torch.load rejects e.g. "cpu:0")
        layout = self._guard_generation_layout()
        if state.get("version") != GENERATION_STATE_VERSION or state.get("layout") != layout:
            changed = {k: (v, layout.get(k)) for k, v in (state.get("layout") or {}).items() if layout.get(k) != v}
            logger.warning(
                "The buffered generation batch in %s was written with another batch layout (checkpoint -> now: %s): "
                "it is dropped and the resumed run generates a new batch at step %d.",
                path,
                changed,
                self.state.global_step + 1,
            )
            return
        self._step = state["step"]
        self._buffered_inputs = send_to_device(state["buffered_inputs"], self.accelerator.device)
        self._guard_poison = state["poison"]
        self._guard_step_pending = state["step_pending"]


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
