"""One adapter per TRL trainer: the only trl-prime classes that override TRL's or ``transformers.Trainer``'s private
methods.

:class:`GRPOAdapter` (on ``trl.GRPOTrainer``) and :class:`RLOOAdapter` (on ``trl.RLOOTrainer``) override each hook
once, in a few lines that say what TRL does there, and hand the work to plain objects and functions:

- :class:`~trl_prime.guards.Guards` (``self.guards``): non-finite rows and steps, empty steps, verifier failures;
- :class:`~trl_prime.checkpointing.Checkpoints` (``self.checkpoints``): atomic checkpoints, exact resume;
- :mod:`trl_prime.rollout`: the capture of TRL's generation step and the outcome preamble (:func:`generation_round`).

A method's trainer (PRIME, PRL, PROF) subclasses an adapter and fills in the method's own hooks, none of them TRL's:

- ``_algorithm_step(output, rollout) -> output`` (required): the method's work on a scored generation round;
- ``_rollout_logps(output, input_ids, attention_mask, mode)``: log-probs the guard checks with the rewards;
- ``_prepare_method(max_steps, resume_from_checkpoint)``, ``_save_method_state(checkpoint_dir)``: a method's own
  optimizers and checkpoint files;
- ``_after_policy_step(applied, reason)``: the guarded policy step was taken (``applied``) or skipped;
- ``_method_train_sampler(dataset)``: a sampler in place of TRL's (``None``: TRL's);
- ``_token_logps(trl_fn, model, ...)``: around TRL's per-token log-prob forward (PRIME records the rollout and
  reference log-probs there).

Metrics of a round go through one call, :meth:`GRPOAdapter.record_metric`; ``log_advantages`` puts the advantages
that reach the loss into TRL's completions log. The guards' per-round checks are the method's to call, on the tensors
it builds (``self.guards.inspect``, ``single_row_groups``, ``degenerate_metrics``: the ``guard/*`` metrics); the
adapter itself checks the rewards and the ``_rollout_logps`` (:func:`~trl_prime.rollout.score_rollout`), the verifier
failures and every policy step.

A method of its own, in a few lines (group-normalised outcome advantages; unscorable rows, ``NaN`` outcomes, get
loss weight 0)::

    import torch

    from trl_prime import functional as F
    from trl_prime.adapters import GRPOAdapter
    from trl_prime.rollout import hand_advantages


    class MyGRPOTrainer(GRPOAdapter):
        def _algorithm_step(self, output, rollout):
            group_ids = torch.arange(rollout.outcome.numel(), device=rollout.outcome.device) // rollout.num_generations
            advantages = F.grpo_advantages(rollout.outcome, group_ids, scale_rewards=self.args.scale_rewards)
            self.guards.inspect(rollout.mode, global_rows={"advantages": advantages})
            hand_advantages(self, output, rollout, advantages, keep=rollout.scorable)
            self.record_metric(rollout.mode, "my/scorable_fraction", rollout.scorable.float().mean().item())
            return output  # what TRL's loss consumes
"""

from __future__ import annotations

import torch
from torch import nn
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.trainer.utils import nanmax, nanmin

from trl_prime import functional as F
from trl_prime.checkpointing import Checkpoints
from trl_prime.guards import Guards, check_train_dataset, keep_4bit_layers_differentiable
from trl_prime.rollout import (
    MM_KEYS,
    ROW_COUNT_FREE_LOSS_TYPES,
    Rollout,
    capture_rewards,
    drop_zero_weight_rows,
    score_rollout,
)


def check_config(trainer, args: tuple, kwargs: dict) -> None:
    """Refuse a config that is not the adapter's TRL config (``GRPOConfig`` / ``RLOOConfig`` or a subclass), which
    TRL would only reject with an ``AttributeError`` deep in its constructor.

    Raises:
        TypeError: ``args`` (the third positional argument or the keyword) is another class."""
    config = args[2] if len(args) > 2 else kwargs.get("args")
    expected = GRPOConfig if isinstance(trainer, GRPOTrainer) else RLOOConfig
    if config is not None and not isinstance(config, expected):
        raise TypeError(
            f"{type(trainer).__name__} needs `args` to be a {expected.__name__} (or a subclass, e.g. a trl-prime "
            f"method's config); got {type(config).__name__}. Build it with {expected.__name__}(output_dir=..., ...)."
        )


def missing_step(trainer) -> str:
    """The message of an adapter subclass without its method's step."""
    return (
        f"{type(trainer).__name__} subclasses a trl-prime adapter but does not define _algorithm_step(output, rollout), "
        "the method's work on a scored generation round: it returns TRL's output for the loss, e.g. after "
        "trl_prime.rollout.hand_advantages(self, output, rollout, advantages). See trl_prime/adapters.py."
    )


def setup_parts(trainer) -> None:
    """The plain objects an adapter calls (``guards``, ``checkpoints``) and the start-up checks of the dataset; at the
    end of the adapter's ``__init__``."""
    trainer.guards = Guards(
        trainer.args,
        trainer.accelerator,
        trainer.record_metric,
        lambda: trainer.state.global_step,
        getattr(trainer, "max_completion_length", None),
    )
    trainer.checkpoints = Checkpoints(trainer, trainer.guards)
    trainer._rollout_capture = None  # {} while TRL's generation step runs
    check_train_dataset(getattr(trainer, "train_dataset", None), trainer.reward_funcs)
    if isinstance(getattr(trainer, "model", None), nn.Module):
        keep_4bit_layers_differentiable(trainer.model)


def generation_round(trainer, trl_step, inputs) -> dict:
    """TRL's generation step (``trl_step``: generate, score, TRL's advantages) with its reward capture on, then the
    outcome preamble (:func:`~trl_prime.rollout.score_rollout`) and the method's ``_algorithm_step``."""
    trainer.guards.new_generation_batch(inputs, trainer.model.training)
    trainer._rollout_capture = {}
    try:
        output = trl_step(inputs)
        capture = trainer._rollout_capture
    finally:
        trainer._rollout_capture = None
    return trainer._algorithm_step(output, score_rollout(trainer, output, capture))


def scored_rewards(trainer, trl_rewards, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
    """TRL's reward functions (``trl_rewards``), with the verifier-failure guard and the round's capture."""
    trainer.guards.infra_failures = 0.0
    rewards_per_func = trl_rewards(inputs, prompts, completions, completion_ids_list)
    trainer.guards.check_failure_rate("train" if trainer.model.training else "eval", len(prompts))
    if trainer._rollout_capture is not None:
        capture_rewards(trainer, trainer._rollout_capture, rewards_per_func, prompts, completions, completion_ids_list)
    return rewards_per_func


def prepared(trainer, out: tuple, max_steps: int, resume_from_checkpoint) -> tuple:
    """After Trainer's ``_prepare_for_training`` (optimizer, scheduler, wrapped model): guard the policy's optimizer
    step (not under DeepSpeed: its step runs inside ``backward``), restore the guard and generation state on resume,
    then the method's own preparation."""
    if not trainer.is_deepspeed_enabled:
        trainer.guards.wrap_optimizer(trainer.optimizer, trainer._after_policy_step)
    if resume_from_checkpoint is not None:
        trainer.checkpoints.restore(resume_from_checkpoint)
    trainer._prepare_method(max_steps, resume_from_checkpoint)
    return out


def counted(trainer, inputs):
    """A micro-batch TRL hands to its loss: its weighted tokens count towards the empty-step check."""
    if trainer.model.training and isinstance(inputs, dict):
        trainer.guards.count_micro_batch(inputs)
    return inputs


def grad_norm_seen(trainer, out):
    """Trainer's gradient norm (from its clipping, before it): the guarded step judges the step on it."""
    value = out.item() if hasattr(out, "item") else out
    trainer.guards.clip_norm = None if value is None else float(value)
    return out


def save_checkpoint(trainer, trl_save, model, trial) -> None:
    """Trainer's checkpoint (``trl_save``: model, optimizer, scheduler, RNG, trainer state), staged and published
    atomically with the method's own state (:class:`~trl_prime.checkpointing.Checkpoints`)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    with trainer.checkpoints.atomic(trainer._get_output_dir(trial=trial)):
        trl_save(model, trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        trainer._save_method_state(f"{trainer._get_output_dir(trial=trial)}/{name}")


def log_advantages(trainer, values) -> None:
    """Replace the advantages TRL appended to its completions log (``trainer._logs["advantages"]``, a deque whose
    length is the generation batch) by ``values`` (a sequence or a ``(B_global,)`` tensor)."""
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    logged = trainer._logs["advantages"]
    if len(logged) >= len(values):
        for _ in range(len(values)):
            logged.pop()
    logged.extend(values)


class GRPOAdapter(GRPOTrainer):
    """trl-prime's hooks into ``trl.GRPOTrainer`` (see the module docstring). Not a method on its own: PRIME-GRPO,
    PRL and PROF subclass it."""

    _rollout_class: type = Rollout

    def __init__(self, *args, **kwargs):
        check_config(self, args, kwargs)
        super().__init__(*args, **kwargs)
        setup_parts(self)

    def record_metric(self, mode: str, name: str, value: float) -> None:
        """Append ``value`` to the metric ``name`` of ``mode`` (``"train"`` / ``"eval"``), logged (averaged) at the
        next ``logging_steps`` as TRL's own."""
        self._metrics[mode][name].append(value)

    def log_advantages(self, values) -> None:
        """Replace the global advantages TRL just appended to its completions log (one per generated completion) by
        ``values`` (``(B_global,)``), the advantages that reach the loss."""
        log_advantages(self, values)

    @property
    def guard_poisoned(self) -> bool:
        """Whether the current generation batch's optimizer steps will be skipped."""
        return self.guards.poisoned

    # ---- the method's hooks (defaults) ----------------------------------------------------------------------------
    def _algorithm_step(self, output: dict, rollout: Rollout) -> dict:
        raise NotImplementedError(missing_step(self))

    def _rollout_logps(self, output, input_ids, attention_mask, mode) -> dict:
        return {}

    def _prepare_method(self, max_steps, resume_from_checkpoint) -> None:
        pass

    def _save_method_state(self, checkpoint_dir: str) -> None:
        pass

    def _after_policy_step(self, applied: bool, reason: str | None = None) -> None:
        pass

    def _method_train_sampler(self, dataset):
        return None

    def _token_logps(self, trl_fn, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        return trl_fn(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    # ---- TRL's and Trainer's hooks, each once -------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        # TRL: generate K completions per prompt, reward them, GRPO's advantages; then the method's round
        return generation_round(self, super()._generate_and_score_completions, inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL: every reward function on the local rows, gathered: (B_global, n_funcs)
        trl_rewards = super()._calculate_rewards
        return scored_rewards(self, trl_rewards, inputs, prompts, completions, completion_ids_list)

    def _log_metric(self, name, value):
        # TRL: a reward function's `log_metric` (verifier failures counted here)
        self.guards.count_metric(name, value)
        return super()._log_metric(name, value)

    def _prepare_inputs(self, generation_batch):
        # TRL: generate (or reuse the buffered generation batch) and slice one micro-batch for the loss
        return counted(self, super()._prepare_inputs(generation_batch))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # TRL: per-token log-probs (and entropies) of the completions, by micro-batches
        trl_fn = super()._get_per_token_logps_and_entropies
        return self._token_logps(trl_fn, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    def _compute_loss(self, model, inputs):
        # TRL: GRPO's clipped loss on the micro-batch; rows of loss weight 0 (filtered, dropped, unscorable) add
        # nothing to a token-sum loss type, so they skip the forward (not with a MoE router loss: a statistic of
        # every attended token)
        if (
            self.loss_type in ROW_COUNT_FREE_LOSS_TYPES
            and inputs.get("tool_mask") is not None
            and not self.aux_loss_enabled
        ):
            weight = inputs["completion_mask"] * inputs["tool_mask"]
            inputs = drop_zero_weight_rows(inputs, weight, self.accelerator)
        return super()._compute_loss(model, inputs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # Trainer: optimizer, scheduler, the model wrapped by accelerate, state loaded on resume
        out = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        return prepared(self, out, max_steps, resume_from_checkpoint)

    def _get_grad_norm(self, model, grad_norm=None):
        # Trainer: the gradient norm its clipping returned (before clipping)
        return grad_norm_seen(self, super()._get_grad_norm(model, grad_norm=grad_norm))

    def _get_output_dir(self, trial):
        # Trainer: the run's folder of checkpoints (the staging folder while one is saved)
        return self.checkpoints.output_dir(super()._get_output_dir(trial))

    def _save_checkpoint(self, model, trial):
        # Trainer: checkpoint-N with model, optimizer, scheduler, RNG and state (atomic, with the method's state)
        save_checkpoint(self, super()._save_checkpoint, model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Trainer: the weights of a checkpoint (keeping each parameter's dtype)
        with self.checkpoints.same_dtypes(self.model if model is None else model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _get_train_sampler(self, dataset=None):
        # TRL: its RepeatSampler (K copies of each prompt, reused for steps_per_generation * num_iterations)
        sampler = self._method_train_sampler(dataset)  # (a RepeatSampler of 0 batches is falsy: test None)
        if sampler is None:
            sampler = super()._get_train_sampler(dataset)
        self.checkpoints.train_sampler = sampler
        return sampler

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        # Trainer: epochs and steps already trained (on resume); TRL's sampler replays its earlier epochs' draws
        epochs, steps = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        self.checkpoints.replay_epochs(epochs, resume_from_checkpoint)
        return epochs, steps


class RLOOAdapter(RLOOTrainer):
    """trl-prime's hooks into ``trl.RLOOTrainer`` (see the module docstring): the same hooks as
    :class:`GRPOAdapter`, and PRIME's token-level PPO-clip loss (Eq. 6) in place of TRL 1.16's sequence-level RLOO
    loss: ``-min(rho_t A_t, clip(rho_t, 1-eps, 1+eps_high) A_t)`` with ``rho_t = pi_theta(y_t)/pi_old(y_t)``, averaged
    over the kept tokens of the global batch (as TRL's ``"dapo"`` aggregation); rows of weight 0 in
    ``prime_loss_mask`` add nothing."""

    _rollout_class: type = Rollout
    loss_is_scaled_for_ga = True

    def __init__(self, *args, **kwargs):
        check_config(self, args, kwargs)
        super().__init__(*args, **kwargs)
        setup_parts(self)

    def record_metric(self, mode: str, name: str, value: float) -> None:
        """Append ``value`` to the metric ``name`` of ``mode`` (``"train"`` / ``"eval"``), logged (averaged) at the
        next ``logging_steps`` as TRL's own."""
        self._metrics[mode][name].append(value)

    def log_advantages(self, values) -> None:
        """Replace the global advantages TRL just appended to its completions log (one per generated completion) by
        ``values`` (``(B_global,)``), the advantages that reach the loss."""
        log_advantages(self, values)

    @property
    def guard_poisoned(self) -> bool:
        """Whether the current generation batch's optimizer steps will be skipped."""
        return self.guards.poisoned

    # ---- the method's hooks (defaults) ----------------------------------------------------------------------------
    def _algorithm_step(self, output: dict, rollout: Rollout) -> dict:
        raise NotImplementedError(missing_step(self))

    def _rollout_logps(self, output, input_ids, attention_mask, mode) -> dict:
        return {}

    def _prepare_method(self, max_steps, resume_from_checkpoint) -> None:
        pass

    def _save_method_state(self, checkpoint_dir: str) -> None:
        pass

    def _after_policy_step(self, applied: bool, reason: str | None = None) -> None:
        pass

    def _method_train_sampler(self, dataset):
        return None

    def _token_logps(self, trl_fn, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        return trl_fn(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    # ---- TRL's and Trainer's hooks, each once -------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        # TRL: generate K completions per prompt, reward them, RLOO's advantages; then the method's round
        return generation_round(self, super()._generate_and_score_completions, inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL: every reward function on the local rows, gathered: (B_global, n_funcs)
        trl_rewards = super()._calculate_rewards
        return scored_rewards(self, trl_rewards, inputs, prompts, completions, completion_ids_list)

    def _log_metric(self, name, value):
        # TRL: a reward function's `log_metric` (verifier failures counted here)
        self.guards.count_metric(name, value)
        return super()._log_metric(name, value)

    def _prepare_inputs(self, generation_batch):
        # TRL: generate (or reuse the buffered generation batch) and slice one micro-batch for the loss
        return counted(self, super()._prepare_inputs(generation_batch))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        # TRL: per-token log-probs (and entropies) of the completions, by micro-batches
        trl_fn = super()._get_per_token_logps_and_entropies
        return self._token_logps(trl_fn, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    def _compute_loss(self, model, inputs):
        # TRL: RLOO's sequence-level loss; here PRIME's token-level PPO-clip (Eq. 6) over the kept tokens. Rows of
        # weight 0 add nothing to this token-sum loss: they skip the forward (not with a MoE router loss)
        if not self.aux_loss_enabled:
            inputs = drop_zero_weight_rows(inputs, inputs["prime_loss_mask"], self.accelerator)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in MM_KEYS},
        )
        mask = inputs["prime_loss_mask"].to(per_token_logps.dtype)
        mode = "train" if self.model.training else "eval"
        normalizer = None  # evaluation: the token mean of the micro-batch
        if mode == "train":
            # token mean over the kept tokens of the whole optimisation step, across processes and accumulation
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss = F.token_ppo_clip_loss(
            per_token_logps,
            inputs.get("old_per_token_logps"),
            inputs["advantages"],
            mask,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            normalizer=normalizer,
        )
        if self.aux_loss_enabled:
            acc = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / acc
            self.record_metric(mode, "aux_loss", self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._log_loss_metrics(mode, per_token_logps, inputs, entropies, mask)
        return loss

    def _log_loss_metrics(self, mode: str, per_token_logps, inputs: dict, entropies, mask) -> None:
        """Entropy and clip ratios of Eq. 6 over the trained tokens (global), as TRL's GRPO logs them."""
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        ratio = torch.exp(per_token_logps - (per_token_logps.detach() if old is None else old))

        def global_masked_mean(x, w):
            totals = self.accelerator.reduce(torch.stack([(x * w).sum(), w.sum().float()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        self.record_metric(mode, "entropy", global_masked_mean(entropies, mask))  # over the trained tokens, as GRPO
        is_low = ((ratio < 1 - self.epsilon_low) & (advantages < 0)).float()
        is_high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
        self.record_metric(mode, "clip_ratio/low_mean", global_masked_mean(is_low, mask))
        self.record_metric(mode, "clip_ratio/high_mean", global_masked_mean(is_high, mask))
        self.record_metric(mode, "clip_ratio/region_mean", global_masked_mean(torch.maximum(is_low, is_high), mask))
        live = mask.sum(-1) > 0  # per-completion clip ratios of the trained rows only (NaN elsewhere)
        seq = lambda x: torch.where(live, (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0), torch.nan)  # noqa: E731
        self.record_metric(mode, "clip_ratio/low_min", nanmin(self.accelerator.gather(seq(is_low))).item())
        self.record_metric(mode, "clip_ratio/high_max", nanmax(self.accelerator.gather(seq(is_high))).item())

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # Trainer: optimizer, scheduler, the model wrapped by accelerate, state loaded on resume
        out = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        return prepared(self, out, max_steps, resume_from_checkpoint)

    def _get_grad_norm(self, model, grad_norm=None):
        # Trainer: the gradient norm its clipping returned (before clipping)
        return grad_norm_seen(self, super()._get_grad_norm(model, grad_norm=grad_norm))

    def _get_output_dir(self, trial):
        # Trainer: the run's folder of checkpoints (the staging folder while one is saved)
        return self.checkpoints.output_dir(super()._get_output_dir(trial))

    def _save_checkpoint(self, model, trial):
        # Trainer: checkpoint-N with model, optimizer, scheduler, RNG and state (atomic, with the method's state)
        save_checkpoint(self, super()._save_checkpoint, model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Trainer: the weights of a checkpoint (keeping each parameter's dtype)
        with self.checkpoints.same_dtypes(self.model if model is None else model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _get_train_sampler(self, dataset=None):
        # TRL: its RepeatSampler (K copies of each prompt, reused for steps_per_generation * num_iterations)
        sampler = self._method_train_sampler(dataset)  # (a RepeatSampler of 0 batches is falsy: test None)
        if sampler is None:
            sampler = super()._get_train_sampler(dataset)
        self.checkpoints.train_sampler = sampler
        return sampler

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        # Trainer: epochs and steps already trained (on resume); TRL's sampler replays its earlier epochs' draws
        epochs, steps = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        self.checkpoints.replay_epochs(epochs, resume_from_checkpoint)
        return epochs, steps
