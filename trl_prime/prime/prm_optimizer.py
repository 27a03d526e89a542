"""The optimisation state of a second trained model inside a PRIME trainer: optimizer, LR scheduler, DeepSpeed
engine, steps and checkpoint files. Two models use it: the implicit PRM (PRIME Algorithm 1 line 8, arXiv 2502.01456)
and the value model of ``prime_estimator="ppo"`` (PRIME section 5.4).

:class:`ModelOptimizer` is the machinery, :class:`PRMOptimizer` (``self.prm_optim`` of the PRIME trainers) and
:class:`ValueOptimizer` (``self.value_optim``) name its settings: each model is trained by its own AdamW and scheduler
(``prm_learning_rate``, ``prm_lr_scheduler``, ... / ``value_learning_rate``, ...), next to the policy's optimizer
that TRL's Trainer owns. Under DDP the model's gradients are all-reduced by hand (each rank's loss is already its share
of the global mean); under DeepSpeed the model is its own engine (a copy of the Trainer's DeepSpeed config without
optimizer/scheduler).

Checkpoint layout (inside ``checkpoint-N/``): ``prm/`` (the :meth:`~trl_prime.ImplicitPRM.save_pretrained` folder
written by the trainer's ``save_model``) plus ``prm/optimizer.pt``, ``prm/scheduler.pt`` and ``prm/prime_state.json``
(``{"num_updates": n}``), or ``prm_deepspeed/`` (the engine's checkpoint) under DeepSpeed; the value model likewise in
``value/`` and ``value_deepspeed/``.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import get_scheduler

from trl_prime.modeling import unwrap


PRM_ADAPTER = "prm"
PRM_CHECKPOINT_DIR = "prm"
PRM_DEEPSPEED_DIR = "prm_deepspeed"
VALUE_CHECKPOINT_DIR = "value"
VALUE_DEEPSPEED_DIR = "value_deepspeed"
PRIME_STATE_NAME = "prime_state.json"


def _drop_auto(cfg: Any) -> Any:
    """A DeepSpeed config without the unresolved ``"auto"`` values (DeepSpeed rejects them)."""
    if isinstance(cfg, dict):
        return {k: _drop_auto(v) for k, v in cfg.items() if v != "auto"}
    return cfg


def load_weights(model: nn.Module, folder: str) -> None:
    """Load a ``save_pretrained`` folder's weights (single file or sharded) into ``model`` in place."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        from safetensors.torch import load_file

        state = load_file(single, device=str(next(model.parameters()).device))
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        missing = [k for k in missing if k not in tied]
        if unexpected or missing:
            raise RuntimeError(
                f"Checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}"
            )
    else:
        from transformers.trainer_utils import load_sharded_checkpoint

        load_sharded_checkpoint(model, folder, strict=False)


@dataclass(frozen=True)
class OptimizerSettings:
    """What differs between the models a :class:`ModelOptimizer` trains: the names of the config fields holding its
    hyperparameters, and its checkpoint folders."""

    name: str  # the model, in messages: "PRM", "value model"
    learning_rate: str  # config field names
    weight_decay: str
    max_grad_norm: str
    lr_scheduler: str | None  # None: a constant schedule without warmup
    warmup_steps: str | None
    checkpoint_dir: str
    deepspeed_dir: str


class ModelOptimizer:
    """A second trained model's optimizer, LR scheduler and (under DeepSpeed) engine, with its backward, step and
    checkpoint state.

    Args:
        holder: the object holding the model: ``model`` (an ``nn.Module``; it becomes the DeepSpeed engine),
            ``trainable_parameters()``, ``adapter_name`` (a PEFT adapter on the policy, or ``None``) and
            ``micro_batch_size`` (rows per forward / backward); e.g. :class:`~trl_prime.ImplicitPRM`.
        args: the PRIME config (the fields named by ``settings``, batch sizes, AdamW betas and eps, ``optim``).
        accelerator: the trainer's ``Accelerator``.
        deepspeed: whether the trainer runs under DeepSpeed.
        settings: the config fields and folders of this model (:class:`OptimizerSettings`).

    Attributes: ``optimizer`` and ``lr_scheduler`` (``None`` until :meth:`create`), ``engine`` (the model's DeepSpeed
    engine or ``None``), ``num_updates`` (steps applied; saved in ``prime_state.json``).
    """

    def __init__(self, holder, args, accelerator, *, deepspeed: bool, settings: OptimizerSettings):
        self.holder = holder
        self.args = args
        self.accelerator = accelerator
        self.deepspeed = deepspeed
        self.settings = settings
        self.optimizer = None
        self.lr_scheduler = None
        self.engine = None
        self.num_updates = 0
        self.pending = False  # a judged step held back until the policy's step decides (step(defer=True))

    def _option(self, key: str, default=None):
        """The config value of the field ``settings.<key>`` names (``default`` when it names none)."""
        name = getattr(self.settings, key)
        return default if name is None else getattr(self.args, name)

    # ------------------------------------------------------------------------------------------------------
    # Creation
    # ------------------------------------------------------------------------------------------------------
    def _local_batch(self) -> int:
        """Rows of one generation round on this process: TRL's generation batch share, or with
        ``oversample_factor > 1`` the oversampled one (every row is scored before the filter's selection)."""
        a = self.args
        rows = a.per_device_train_batch_size * a.steps_per_generation
        factor = getattr(a, "oversample_factor", 1.0)
        if factor == 1.0:
            return rows
        from trl_prime.prime.oversample import oversampled_groups

        K, n = a.num_generations, self.accelerator.num_processes
        return oversampled_groups(a.generation_batch_size // K, factor, K, n) * K // n

    def _num_micro(self) -> int:
        """Backward passes per optimizer step (one per micro-batch of the local rows)."""
        return math.ceil(self._local_batch() / self.holder.micro_batch_size)

    def _micro_batch(self) -> int:
        return self.holder.micro_batch_size

    def _total_updates(self, max_steps: int) -> int:
        a = self.args
        rounds = max_steps * a.gradient_accumulation_steps / (a.steps_per_generation * a.num_iterations)
        return max(1, math.ceil(rounds))

    def _deepspeed_config(self) -> dict:
        base = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        base.pop("optimizer", None)
        base.pop("scheduler", None)
        cfg = _drop_auto(base)
        n_micro = self._num_micro()
        mb = self._micro_batch()
        cfg["train_micro_batch_size_per_gpu"] = mb
        cfg["gradient_accumulation_steps"] = n_micro
        cfg["train_batch_size"] = mb * n_micro * self.accelerator.num_processes
        cfg["gradient_clipping"] = self._option("max_grad_norm") or 0.0
        cfg.setdefault("steps_per_print", 10**9)
        return cfg

    def create(self, max_steps: int) -> None:
        """Build AdamW and the scheduler (``max_steps`` policy steps), and the DeepSpeed engine when there is one."""
        if self.optimizer is not None:
            return
        a = self.args
        params = self.holder.trainable_parameters()
        # the fused AdamW kernel when the policy's optimizer uses it too (TRL's default "adamw_torch_fused"): about 4x
        # faster than the for-loop AdamW on CPU; not under DeepSpeed (its engine wraps the optimizer)
        fused = (
            "fused" in str(getattr(a.optim, "value", a.optim))
            and not self.deepspeed
            and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        )
        optimizer = torch.optim.AdamW(
            params,
            lr=self._option("learning_rate"),
            betas=(a.adam_beta1, a.adam_beta2),
            eps=a.adam_epsilon,
            weight_decay=self._option("weight_decay"),
            **({"fused": True} if fused else {}),
        )
        total = self._total_updates(max_steps)

        def make_scheduler(opt):
            return get_scheduler(
                self._option("lr_scheduler", "constant"),
                opt,
                num_warmup_steps=self._option("warmup_steps", 0),
                num_training_steps=total,
            )

        if self.deepspeed and self.holder.adapter_name is None:
            import deepspeed

            engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
                model=unwrap(self.holder.model),
                optimizer=optimizer,
                lr_scheduler=make_scheduler,
                config=self._deepspeed_config(),
            )
            self.engine = engine
            self.holder.model = engine
            self.optimizer, self.lr_scheduler = ds_optimizer, ds_scheduler
        else:
            self.optimizer, self.lr_scheduler = optimizer, make_scheduler(optimizer)

    # ------------------------------------------------------------------------------------------------------
    # Backward and step
    # ------------------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (its share of the global mean); under DeepSpeed the engine's backward
        and (accumulation-aware) step."""
        if self.engine is not None:
            # DeepSpeed averages gradients over ranks and divides the loss by its accumulation steps: undo both,
            # our per-rank losses are already shares of the global mean.
            scale = self.accelerator.num_processes * self.engine.gradient_accumulation_steps()
            self.engine.backward(loss * scale)
            self.engine.step()
        else:
            loss.backward()

    def step(self, loss_finite: bool = True, *, defer: bool = False) -> float | None:
        """All-reduce (DDP), clip, step, schedule; returns the pre-clip gradient norm (NaN under DeepSpeed), or
        ``None`` when the step was skipped because the (global) loss or gradient norm is not finite (the norm is the
        one clipping returns, computed before it scales the gradients: an overflow reads inf even though clipping
        leaves zeros or NaN behind). ``num_updates`` counts the applied steps.

        ``defer=True`` (not under DeepSpeed): all-reduce, clip and judge now, but hold the optimizer and scheduler
        step back (``pending``) until :meth:`apply_pending` or :meth:`discard_pending`: the trainer takes it with the
        policy's step, or drops it when that step is skipped, so a skipped step leaves the model, its optimizer state
        and its schedule bit-identical.

        Under DeepSpeed the engine has already stepped in :meth:`backward`: see :meth:`_engine_step_result`."""
        if self.engine is not None:
            norm = self._engine_step_result(loss_finite)
        else:
            norm = self._judged_norm(loss_finite)
            if norm is not None:
                self.pending = True
                if defer:
                    # off the parameters while held: a PEFT PRM / critic is an adapter of the policy's model, whose
                    # gradient clipping and norm would otherwise include these gradients
                    params = self.holder.trainable_parameters()
                    self._held_grads = [(p, p.grad) for p in params]
                    for p in params:
                        p.grad = None
                else:
                    self.apply_pending()
                return norm
        if norm is not None:
            self.num_updates += 1
        return norm

    def apply_pending(self) -> None:
        """Take the held step (if any): optimizer step, scheduler step, gradients cleared, ``num_updates`` + 1."""
        if not self.pending:
            return
        self.pending = False
        for p, g in getattr(self, "_held_grads", None) or []:
            p.grad = g
        self._held_grads = None
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_updates += 1

    def discard_pending(self) -> None:
        """Drop the held step (if any): gradients cleared; weights, moments and schedule unchanged."""
        if self.pending:
            self.pending = False
            self._held_grads = None
            self.optimizer.zero_grad(set_to_none=True)

    def discard(self, loss_finite: bool = True) -> None:
        """Drop this batch's gradients (a poisoned batch): weights, moments and schedule unchanged. Under
        DeepSpeed the engine stepped inside :meth:`backward` and cannot be held back: its step is accounted for."""
        if self.engine is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.step(loss_finite)

    @property
    def learning_rate(self) -> float:
        """The current learning rate (the ``prm/learning_rate`` metric of the PRM)."""
        return self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else self._option("learning_rate")

    def _engine_step_result(self, loss_finite: bool) -> float | None:
        """The DeepSpeed engine's step, judged. Its ZeRO optimizer skips a step whose gradient norm is not finite
        (fp32, and bf16 with DeepSpeed's default ``check_grad_overflow``), which is reported as a skip (``None``),
        except an fp16 loss-scale overflow with a finite loss (the loss scaler's own skip, returned as NaN like the
        policy's GradScaler skips). A non-finite norm whose step the engine applied anyway raises (the PRM is lost)."""
        norm = self.engine.get_global_grad_norm()
        applied = self.engine.was_step_applied()
        if norm is not None and math.isfinite(float(norm)) and loss_finite and applied:
            return float(norm)
        if norm is None and applied and loss_finite:
            return float("nan")  # ZeRO gradient-norm computation disabled: nothing to judge
        if not applied and loss_finite and self.engine.fp16_enabled():
            # fp16 dynamic loss scaling: an overflowing scaled gradient skips the step and lowers the scale
            # (as torch's GradScaler does for the policy): calibration, not a poisoned batch
            return float("nan")
        if applied:
            raise RuntimeError(
                f"The {self.settings.name}'s DeepSpeed engine applied a step whose gradient norm is {norm} (loss "
                f"finite: {loss_finite}): its weights are no longer finite. Enable DeepSpeed's overflow check (bf16: "
                f"`check_grad_overflow: true`), lower `{self.settings.learning_rate}`, and resume from the last "
                "checkpoint."
            )
        return None

    def _all_reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum the model's gradients over processes (one flat all-reduce; a parameter without gradient counts 0)."""
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def _judged_norm(self, loss_finite: bool) -> float | None:
        """All-reduce (DDP) and clip the gradients; their pre-clip norm, or ``None`` (gradients cleared) when the loss
        or the norm is not finite."""
        params = self.holder.trainable_parameters()
        if self.accelerator.num_processes > 1:
            self._all_reduce_gradients(params)
        max_norm = self._option("max_grad_norm")
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()
        if not (loss_finite and math.isfinite(norm)):  # same on every rank: loss reduced, gradients all-reduced
            self.optimizer.zero_grad(set_to_none=True)  # skipped: weights, moments and schedule unchanged
            return None
        return norm

    # ------------------------------------------------------------------------------------------------------
    # Saving and loading
    # ------------------------------------------------------------------------------------------------------
    def gathered_state_dict(self, module: nn.Module | None) -> dict | None:
        """Full state dict of a ZeRO-3 partitioned module (``None`` otherwise: ``save_pretrained`` reads the module
        itself); every rank must call it."""
        if module is None:
            return None
        inner = unwrap(module)
        if self.deepspeed and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None):
                return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}
        return None

    def save_state(self, checkpoint: str, *, is_main_process: bool) -> None:
        """Write the optimisation state into ``checkpoint`` (next to the model's weights, in
        ``settings.checkpoint_dir``); call it on every rank."""
        if self.engine is not None:
            self.engine.save_checkpoint(os.path.join(checkpoint, self.settings.deepspeed_dir))
        if is_main_process:
            folder = os.path.join(checkpoint, self.settings.checkpoint_dir)
            os.makedirs(folder, exist_ok=True)
            if self.engine is None and self.optimizer is not None:
                torch.save(self.optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
                torch.save(self.lr_scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
            with open(os.path.join(folder, PRIME_STATE_NAME), "w") as f:
                json.dump({"num_updates": self.num_updates}, f)

    def load_state(self, checkpoint: str, model: nn.Module) -> None:
        """Restore the model's weights (``model``: the unwrapped model, or the PeftModel holding its adapter) and
        optimisation state from a PRIME checkpoint.

        Raises:
            FileNotFoundError: when ``checkpoint`` has no ``settings.checkpoint_dir`` folder (not written by a PRIME
                trainer with this model).
        """
        folder = os.path.join(checkpoint, self.settings.checkpoint_dir)
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"{checkpoint} has no `{self.settings.checkpoint_dir}/` folder: it was not written by a PRIME trainer "
                f"with a {self.settings.name}, so the {self.settings.name} cannot be restored. Resume from such a "
                "checkpoint, or start a new run."
            )
        with open(os.path.join(folder, PRIME_STATE_NAME)) as f:
            self.num_updates = json.load(f)["num_updates"]
        if self.engine is not None:
            self.engine.load_checkpoint(
                os.path.join(checkpoint, self.settings.deepspeed_dir),
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
            return
        self.load_weights(folder, model)
        # loaded on the CPU (torch.load rejects map_location "cpu:0", the device of a CPU DDP process); the optimizer
        # moves its state to the parameters' device
        self.optimizer.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt"), map_location="cpu"))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(folder, "scheduler.pt")))

    def load_weights(self, folder: str, model: nn.Module) -> None:
        """Load the saved weights of ``folder`` into ``model`` (a subclass's format: :class:`PRMOptimizer` and the value
        model's optimizer implement it).

        Raises:
            TypeError: on a subclass that does not define its checkpoint format.
        """
        raise TypeError(f"{type(self).__name__} must define load_weights(folder, model): its checkpoint format.")


class PRMOptimizer(ModelOptimizer):
    """The implicit PRM's :class:`ModelOptimizer` (PRIME Algorithm 1 line 8): ``prm_learning_rate``,
    ``prm_weight_decay``, ``prm_lr_scheduler``, ``prm_warmup_steps``, ``prm_max_grad_norm``; folders ``prm/`` and
    ``prm_deepspeed/``. The pairwise / KTO losses (``prm_loss`` other than ``"ce"``) take every local row in one
    backward.

    Args:
        implicit_prm: the trainer's :class:`~trl_prime.ImplicitPRM` (its ``model`` becomes the DeepSpeed engine).
        args, accelerator, deepspeed: as :class:`ModelOptimizer`.
    """

    SETTINGS = OptimizerSettings(
        name="PRM",
        learning_rate="prm_learning_rate",
        weight_decay="prm_weight_decay",
        max_grad_norm="prm_max_grad_norm",
        lr_scheduler="prm_lr_scheduler",
        warmup_steps="prm_warmup_steps",
        checkpoint_dir=PRM_CHECKPOINT_DIR,
        deepspeed_dir=PRM_DEEPSPEED_DIR,
    )

    def __init__(self, implicit_prm, args, accelerator, *, deepspeed: bool):
        super().__init__(implicit_prm, args, accelerator, deepspeed=deepspeed, settings=self.SETTINGS)

    @property
    def implicit_prm(self):
        return self.holder

    def _num_micro(self) -> int:
        if self.args.prm_loss != "ce":
            return 1  # pairwise / KTO: every local row at once
        # the round's rows and each replayed round's (padded to the full window under DeepSpeed)
        return super()._num_micro() * (1 + getattr(self.args, "prm_replay_rounds", 0))

    def _total_updates(self, max_steps: int) -> int:
        return super()._total_updates(max_steps) * getattr(self.args, "prm_epochs", 1)  # prm_epochs per round

    def _micro_batch(self) -> int:
        return self.holder.micro_batch_size if self.args.prm_loss == "ce" else self._local_batch()

    def save_pretrained(self, output_dir: str, *, save_reference: bool, is_main_process: bool) -> None:
        """Save the implicit PRM as an :meth:`~trl_prime.ImplicitPRM.save_pretrained` folder; call it on every rank."""
        prm = self.implicit_prm
        sd = self.gathered_state_dict(prm.model) if prm.adapter_name is None else None
        save_ref = save_reference and prm.ref_model is not None
        ref_sd = self.gathered_state_dict(prm.ref_model) if save_ref else None
        prm.save_pretrained(
            output_dir,
            save_reference=save_ref,
            state_dict=sd,
            ref_state_dict=ref_sd,
            is_main_process=is_main_process,
        )

    def load_weights(self, folder: str, model: nn.Module) -> None:
        """The PRM's weights: adapter ``"prm"`` of a PEFT PRM, else the full model."""
        if self.implicit_prm.adapter_name is not None:
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            weights = load_peft_weights(folder, device=str(self.accelerator.device))
            set_peft_model_state_dict(model, weights, adapter_name=PRM_ADAPTER)
        else:
            load_weights(model, folder)


class ValueOptimizer(ModelOptimizer):
    """The value model's :class:`ModelOptimizer` (``prime_estimator="ppo"``, ``prime_value="critic"``):
    ``value_learning_rate``, ``value_weight_decay``, ``value_max_grad_norm``, a constant schedule; folders ``value/``
    and ``value_deepspeed/``. One optimizer step per value epoch of a generation round.

    Args:
        value_function: the trainer's :class:`~trl_prime.prime.value.ValueFunction`.
        args, accelerator, deepspeed: as :class:`ModelOptimizer`.
    """

    SETTINGS = OptimizerSettings(
        name="value model",
        learning_rate="value_learning_rate",
        weight_decay="value_weight_decay",
        max_grad_norm="value_max_grad_norm",
        lr_scheduler=None,
        warmup_steps=None,
        checkpoint_dir=VALUE_CHECKPOINT_DIR,
        deepspeed_dir=VALUE_DEEPSPEED_DIR,
    )

    def __init__(self, value_function, args, accelerator, *, deepspeed: bool):
        super().__init__(value_function, args, accelerator, deepspeed=deepspeed, settings=self.SETTINGS)

    def _total_updates(self, max_steps: int) -> int:
        return super()._total_updates(max_steps) * self.args.value_epochs

    def save_pretrained(self, output_dir: str, *, is_main_process: bool) -> None:
        """Save the value model (:meth:`~trl_prime.prime.value.ValueFunction.save_pretrained`); call it on every
        rank."""
        fn = self.holder
        sd = self.gathered_state_dict(fn.model) if fn.adapter_name is None else None
        fn.save_pretrained(output_dir, state_dict=sd, is_main_process=is_main_process)

    def load_weights(self, folder: str, model: nn.Module) -> None:
        """The value model's weights (backbone or adapter ``"value"``, and the head)."""
        self.holder.load_weights(folder)
