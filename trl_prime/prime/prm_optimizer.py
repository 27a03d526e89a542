"""The implicit PRM's optimisation state inside a PRIME trainer: optimizer, LR scheduler, DeepSpeed engine, steps and
checkpoint files (PRIME Algorithm 1 line 8, arXiv 2502.01456).

:class:`PRMOptimizer` is what the PRIME trainers hold as ``self.prm_optim``: the PRM is trained by its own AdamW and
scheduler (``prm_learning_rate``, ``prm_lr_scheduler``, ...), next to the policy's optimizer that TRL's Trainer owns.
Under DDP the PRM's gradients are all-reduced by hand (each rank's loss is already its share of the global mean);
under DeepSpeed the PRM is its own engine (a copy of the Trainer's DeepSpeed config without optimizer/scheduler).

Checkpoint layout (inside ``checkpoint-N/``): ``prm/`` (the :meth:`~trl_prime.ImplicitPRM.save_pretrained` folder
written by the trainer's ``save_model``) plus ``prm/optimizer.pt``, ``prm/scheduler.pt`` and ``prm/prime_state.json``
(``{"num_updates": n}``), or ``prm_deepspeed/`` (the engine's checkpoint) under DeepSpeed.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import get_scheduler

from trl_prime.modeling import unwrap


PRM_ADAPTER = "prm"
PRM_CHECKPOINT_DIR = "prm"
PRM_DEEPSPEED_DIR = "prm_deepspeed"
PRIME_STATE_NAME = "prime_state.json"


def _drop_auto(cfg: Any) -> Any:
    """A DeepSpeed config without the unresolved ``"auto"`` values (DeepSpeed rejects them)."""
    if isinstance(cfg, dict):
        return {k: _drop_auto(v) for k, v in cfg.items() if v != "auto"}
    return cfg


def _load_weights(model: nn.Module, folder: str) -> None:
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
                f"PRM checkpoint {folder} does not match the PRM: missing {missing}, unexpected {unexpected}"
            )
    else:
        from transformers.trainer_utils import load_sharded_checkpoint

        load_sharded_checkpoint(model, folder, strict=False)


class PRMOptimizer:
    """The implicit PRM's optimizer, LR scheduler and (under DeepSpeed) engine, with its backward, step and
    checkpoint state.

    Args:
        implicit_prm: the trainer's :class:`~trl_prime.ImplicitPRM` (its ``model`` becomes the DeepSpeed engine).
        args: the PRIME config (``prm_learning_rate``, ``prm_weight_decay``, ``prm_lr_scheduler``,
            ``prm_warmup_steps``, ``prm_max_grad_norm``, ``prm_loss``, batch sizes, AdamW betas and eps, ``optim``).
        accelerator: the trainer's ``Accelerator``.
        deepspeed: whether the trainer runs under DeepSpeed.

    Attributes: ``optimizer`` and ``lr_scheduler`` (``None`` until :meth:`create`), ``engine`` (the PRM's DeepSpeed
    engine or ``None``), ``num_updates`` (PRM steps applied; saved in ``prime_state.json``).
    """

    def __init__(self, implicit_prm, args, accelerator, *, deepspeed: bool):
        self.implicit_prm = implicit_prm
        self.args = args
        self.accelerator = accelerator
        self.deepspeed = deepspeed
        self.optimizer = None
        self.lr_scheduler = None
        self.engine = None
        self.num_updates = 0

    # ------------------------------------------------------------------------------------------------------
    # Creation
    # ------------------------------------------------------------------------------------------------------
    def _local_batch(self) -> int:
        return self.args.per_device_train_batch_size * self.args.steps_per_generation

    def _num_micro(self) -> int:
        if self.args.prm_loss != "ce":
            return 1  # pairwise / KTO losses need every local row in one backward
        return math.ceil(self._local_batch() / self.implicit_prm.micro_batch_size)

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
        mb = self.implicit_prm.micro_batch_size if self.args.prm_loss == "ce" else self._local_batch()
        cfg["train_micro_batch_size_per_gpu"] = mb
        cfg["gradient_accumulation_steps"] = n_micro
        cfg["train_batch_size"] = mb * n_micro * self.accelerator.num_processes
        cfg["gradient_clipping"] = self.args.prm_max_grad_norm or 0.0
        cfg.setdefault("steps_per_print", 10**9)
        return cfg

    def create(self, max_steps: int) -> None:
        """Build AdamW and the scheduler (``max_steps`` policy steps), and the DeepSpeed engine when there is one."""
        if self.optimizer is not None:
            return
        a = self.args
        params = self.implicit_prm.trainable_parameters()
        # the fused AdamW kernel when the policy's optimizer uses it too (TRL's default "adamw_torch_fused"): about 4x
        # faster than the for-loop AdamW on CPU; not under DeepSpeed (its engine wraps the optimizer)
        fused = (
            "fused" in str(getattr(a.optim, "value", a.optim))
            and not self.deepspeed
            and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        )
        optimizer = torch.optim.AdamW(
            params,
            lr=a.prm_learning_rate,
            betas=(a.adam_beta1, a.adam_beta2),
            eps=a.adam_epsilon,
            weight_decay=a.prm_weight_decay,
            **({"fused": True} if fused else {}),
        )
        total = self._total_updates(max_steps)

        def make_scheduler(opt):
            return get_scheduler(
                a.prm_lr_scheduler, opt, num_warmup_steps=a.prm_warmup_steps, num_training_steps=total
            )

        if self.deepspeed and self.implicit_prm.adapter_name is None:
            import deepspeed

            engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
                model=unwrap(self.implicit_prm.model),
                optimizer=optimizer,
                lr_scheduler=make_scheduler,
                config=self._deepspeed_config(),
            )
            self.engine = engine
            self.implicit_prm.model = engine
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

    def step(self, loss_finite: bool = True) -> float | None:
        """All-reduce (DDP), clip, step, schedule; returns the pre-clip gradient norm (NaN under DeepSpeed), or
        ``None`` when the step was skipped because the (global) loss or gradient norm is not finite (the norm is the
        one clipping returns, computed before it scales the gradients: an overflow reads inf even though clipping
        leaves zeros or NaN behind). ``num_updates`` counts the applied steps.

        Under DeepSpeed the engine has already stepped in :meth:`backward`: see :meth:`_engine_step_result`."""
        norm = self._engine_step_result(loss_finite) if self.engine is not None else self._optimizer_step(loss_finite)
        if norm is not None:
            self.num_updates += 1
        return norm

    def discard(self, loss_finite: bool = True) -> None:
        """Drop this batch's PRM gradients (a poisoned batch): weights, moments and schedule unchanged. Under
        DeepSpeed the engine stepped inside :meth:`backward` and cannot be held back: its step is accounted for."""
        if self.engine is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.step(loss_finite)

    @property
    def learning_rate(self) -> float:
        """The PRM's current learning rate (the ``prm/learning_rate`` metric)."""
        return self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else self.args.prm_learning_rate

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
                f"The PRM's DeepSpeed engine applied a step whose gradient norm is {norm} (loss finite: "
                f"{loss_finite}): its weights are no longer finite. Enable DeepSpeed's overflow check (bf16: "
                "`check_grad_overflow: true`), lower `prm_learning_rate`, and resume from the last checkpoint."
            )
        return None

    def _all_reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum the PRM's gradients over processes (one flat all-reduce; a parameter without gradient counts 0)."""
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def _optimizer_step(self, loss_finite: bool) -> float | None:
        params = self.implicit_prm.trainable_parameters()
        if self.accelerator.num_processes > 1:
            self._all_reduce_gradients(params)
        if self.args.prm_max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.args.prm_max_grad_norm).item()
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()
        if not (loss_finite and math.isfinite(norm)):  # same on every rank: loss reduced, gradients all-reduced
            self.optimizer.zero_grad(set_to_none=True)  # skipped: weights, moments and schedule unchanged
            return None
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
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

    def save_state(self, checkpoint: str, *, is_main_process: bool) -> None:
        """Write the optimisation state into ``checkpoint`` (next to the ``prm/`` weights); call it on every rank."""
        if self.engine is not None:
            self.engine.save_checkpoint(os.path.join(checkpoint, PRM_DEEPSPEED_DIR))
        if is_main_process:
            prm_dir = os.path.join(checkpoint, PRM_CHECKPOINT_DIR)
            if self.engine is None and self.optimizer is not None:
                torch.save(self.optimizer.state_dict(), os.path.join(prm_dir, "optimizer.pt"))
                torch.save(self.lr_scheduler.state_dict(), os.path.join(prm_dir, "scheduler.pt"))
            with open(os.path.join(prm_dir, PRIME_STATE_NAME), "w") as f:
                json.dump({"num_updates": self.num_updates}, f)

    def load_state(self, checkpoint: str, prm_model: nn.Module) -> None:
        """Restore the PRM's weights (``prm_model``: the unwrapped PRM, or the PeftModel holding adapter ``"prm"``)
        and optimisation state from a PRIME checkpoint.

        Raises:
            FileNotFoundError: when ``checkpoint`` has no ``prm/`` folder (not written by a PRIME trainer).
        """
        prm_dir = os.path.join(checkpoint, PRM_CHECKPOINT_DIR)
        if not os.path.isdir(prm_dir):
            raise FileNotFoundError(
                f"{checkpoint} has no `{PRM_CHECKPOINT_DIR}/` folder: it was not written by a PRIME trainer, so the "
                "PRM cannot be restored. Resume from a PRIME checkpoint, or start a new run."
            )
        with open(os.path.join(prm_dir, PRIME_STATE_NAME)) as f:
            self.num_updates = json.load(f)["num_updates"]
        if self.engine is not None:
            self.engine.load_checkpoint(
                os.path.join(checkpoint, PRM_DEEPSPEED_DIR), load_optimizer_states=True, load_lr_scheduler_states=True
            )
            return
        if self.implicit_prm.adapter_name is not None:
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            weights = load_peft_weights(prm_dir, device=str(self.accelerator.device))
            set_peft_model_state_dict(prm_model, weights, adapter_name=PRM_ADAPTER)
        else:
            _load_weights(prm_model, prm_dir)
        # loaded on the CPU (torch.load rejects map_location "cpu:0", the device of a CPU DDP process); the optimizer
        # moves its state to the parameters' device
        self.optimizer.load_state_dict(torch.load(os.path.join(prm_dir, "optimizer.pt"), map_location="cpu"))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(prm_dir, "scheduler.pt")))
