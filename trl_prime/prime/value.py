"""The value model of ``prime_estimator="ppo"`` (PRIME section 5.4, Table 4: PPO with a learned critic).

- :class:`ValueModel`: a causal-LM backbone (its decoder, no LM head) plus a scalar head ``nn.Linear(hidden, 1)``
  giving one value per completion position, ``values[:, t] = V(y_<t)``, read from the hidden state that predicts token
  ``t`` (the causal shift of the log-probs: position ``t - 1`` of the completion, the last prompt token for ``t = 0``).
- :class:`ValueFunction`: what the PRIME trainer holds as ``self.value_function``: the model (or its DeepSpeed
  engine), its trainable parameters, micro-batched forwards, and its ``value/`` checkpoint folder.
- :class:`Critic`: what the PRIME trainer holds as ``self.critic`` (and calls; it never calls the trainer): the
  :class:`ValueFunction`, its optimizer, one update per generation round, the value metrics and checkpoint files.
  :func:`build_value_spec` builds the value model before TRL loads the policy; :meth:`Critic.from_spec` builds the
  critic after (under PEFT, :func:`adapter_value_model` adds the adapter ``"value"`` to the policy).

Two layouts: a separate model (default: a copy of the policy's initial checkpoint; ``value_model=`` another causal
LM or a saved ``value/`` folder), or, under PEFT, a third adapter ``"value"`` on the policy's shared frozen base plus
the head (the PRM is adapter ``"prm"``). The value model reads the text only (a vision-language policy's images are
not passed to it).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from accelerate.utils import is_peft_model
from torch import nn

from trl_prime import functional as F
from trl_prime.guards import check_causal_lm_source
from trl_prime.modeling import (
    adapter_parameters,
    check_peft_adapter_supported,
    copy_adapter,
    eval_mode,
    load_model_copy,
    model_init_kwargs,
    peft_adapter,
    position_ids_from_mask,
    unwrap,
)
from trl_prime.prime.estimators import get_advantage_estimator
from trl_prime.prime.prm_optimizer import ValueOptimizer, load_weights
from trl_prime.rollout import gather_padded


VALUE_ADAPTER = "value"
VALUE_HEAD_NAME = "value_head.safetensors"


def _decoder(backbone: nn.Module) -> nn.Module:
    """The transformer under a causal LM's head (``get_decoder``), through PEFT wrappers."""
    base = unwrap(backbone)
    if hasattr(base, "get_base_model"):  # PeftModel: the LoRA layers live inside the base model's modules
        base = base.get_base_model()
    return base.get_decoder()


class ValueModel(nn.Module):
    """A causal LM's decoder plus a scalar head: ``(B, T)`` values ``V(y_<t)`` of the completion positions.

    Args:
        backbone: a causal LM (``AutoModelForCausalLM``); its LM head is not used. With ``adapter_name`` it is the
            policy's ``PeftModel``, shared, not registered as a submodule (its parameters are the policy's; only the
            adapter and the head are the value model's).
        adapter_name: the PEFT adapter of the value model (``"value"``), or ``None`` for a separate model.
        seed: seeds the head's initialisation (normal with the backbone's ``initializer_range``, 0.02 by default, as
            the score head of veRL's critic; bias 0) without touching the global random state (the rollouts of a run
            with and without a value model sample the same numbers).
    """

    def __init__(self, backbone: nn.Module, *, adapter_name: str | None = None, seed: int = 0):
        super().__init__()
        if adapter_name is None:
            self.backbone = backbone
            backbone.requires_grad_(True)
            lm_head, embeddings = backbone.get_output_embeddings(), backbone.get_input_embeddings()
            if lm_head is not None and lm_head.weight is not embeddings.weight:
                lm_head.requires_grad_(False)  # unused: the head reads the hidden states
        else:
            object.__setattr__(self, "backbone", backbone)  # the policy's PeftModel: not a submodule
        self.adapter_name = adapter_name
        decoder = _decoder(backbone)
        hidden = unwrap(backbone).config.get_text_config().hidden_size
        param = next(decoder.parameters())
        self.head = nn.utils.skip_init(nn.Linear, hidden, 1, device=param.device, dtype=param.dtype)
        std = getattr(unwrap(backbone).config.get_text_config(), "initializer_range", 0.02)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, hidden, generator=gen) * std)
            self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """``(B, T)`` float32 values of the last ``T = logits_to_keep`` tokens of each row: ``values[:, t]`` is read
        from the hidden state at position ``L - T - 1 + t`` (the one that predicts token ``L - T + t``), so it sees
        the prompt and ``y_<t`` only. ``input_ids`` / ``attention_mask`` ``(B, L)``: left-padded prompt, right-padded
        completion; position ids come from the mask. Values at padded positions are unspecified."""
        out = _decoder(self.backbone)(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        hidden = out.last_hidden_state[:, -(logits_to_keep + 1) : -1]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


class ValueFunction:
    """The trainer's value model: ``model`` (a :class:`ValueModel`, or its DeepSpeed engine), ``adapter_name``,
    ``micro_batch_size`` (rows per forward and backward), as :class:`~trl_prime.prime.prm_optimizer.ModelOptimizer`
    expects."""

    def __init__(self, model: ValueModel, *, micro_batch_size: int):
        self.model = model
        self.adapter_name = model.adapter_name
        self.micro_batch_size = micro_batch_size

    @property
    def module(self) -> ValueModel:
        """The :class:`ValueModel` (unwrapped)."""
        return unwrap(self.model)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The head's parameters and the backbone's (a separate model) or the ``"value"`` adapter's (PEFT)."""
        if self.adapter_name is None:
            return [p for p in self.module.parameters() if p.requires_grad]
        return [p for _, p in adapter_parameters(self.module.backbone, self.adapter_name)] + list(
            self.module.head.parameters()
        )

    def context(self, *, trainable: bool = False):
        """Context in which ``self.model`` runs the value model in eval mode (no dropout; the ``"value"`` adapter
        active under PEFT, its parameters requiring grad when ``trainable``)."""
        stack = contextlib.ExitStack()
        stack.enter_context(eval_mode(self.module, self.module.backbone))
        if self.adapter_name is not None:
            stack.enter_context(peft_adapter(self.module.backbone, self.adapter_name, trainable=trainable))
        return stack

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """``(B, T)`` values (:meth:`ValueModel.forward`) in one forward; call it inside :meth:`context`."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep)

    def save_pretrained(self, folder: str, *, state_dict: dict | None = None, is_main_process: bool = True) -> None:
        """Write ``folder``: the backbone as a ``save_pretrained`` causal LM (or the ``"value"`` adapter as an
        adapter folder) and the head as ``value_head.safetensors``. ``state_dict``: the full :class:`ValueModel`
        state gathered by the caller (ZeRO-3). Only ``is_main_process`` writes."""
        if not is_main_process:
            return
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        module = self.module
        state = state_dict if state_dict is not None else module.state_dict()
        head = {k[len("head.") :]: v.detach().cpu().contiguous() for k, v in state.items() if k.startswith("head.")}
        save_file(head, os.path.join(folder, VALUE_HEAD_NAME))
        if self.adapter_name is not None:
            from trl_prime.implicit_prm.model import _save_adapter

            _save_adapter(unwrap(module.backbone), self.adapter_name, folder)
            return
        backbone = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
        module.backbone.save_pretrained(folder, state_dict=backbone)

    def load_weights(self, folder: str) -> None:
        """Load a :meth:`save_pretrained` folder into the value model in place (backbone or adapter, and head)."""
        from safetensors.torch import load_file

        module = self.module
        device = str(module.head.weight.device)
        module.head.load_state_dict(load_file(os.path.join(folder, VALUE_HEAD_NAME), device=device))
        if self.adapter_name is not None:
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            weights = load_peft_weights(folder, device=device)
            set_peft_model_state_dict(unwrap(module.backbone), weights, adapter_name=self.adapter_name)
        else:
            load_weights(module.backbone, folder)


def load_value_head(model: ValueModel, source: str | None) -> None:
    """Load the head saved in ``source`` (a :meth:`ValueFunction.save_pretrained` folder) into ``model``, when the
    folder has one; a plain causal-LM checkpoint keeps the new head."""
    if isinstance(source, str) and os.path.isfile(os.path.join(source, VALUE_HEAD_NAME)):
        from safetensors.torch import load_file

        model.head.load_state_dict(
            load_file(os.path.join(source, VALUE_HEAD_NAME), device=str(model.head.weight.device))
        )


def build_value_spec(model, args, value_model, peft_config) -> dict | None:
    """Build the value model *before* TRL loads, patches or wraps the policy (as the PRM; PRIME section 5.4).

    Args:
        model: the policy as the trainer receives it (a path, a causal LM or a ``PeftModel``).
        args: the trainer's config (a :class:`~trl_prime.prime.config.PrimeOptions`).
        value_model: the value model's initial causal LM (a path, a module, a saved ``value/`` folder) or ``None``
            (``args.value_model``, else a copy of the policy's initial checkpoint, or the PEFT adapter).
        peft_config: the trainer's ``peft_config`` (``None`` without PEFT).

    Returns:
        ``None`` without a learned critic (``prime_estimator`` other than ``"ppo"``, or ``prime_value`` other than
        ``"critic"``); ``{"kind": "adapter", "pretrained_adapter": bool}`` for the PEFT adapter ``"value"`` (built
        by :func:`adapter_value_model` once the policy is a ``PeftModel``); else ``{"kind": "model", "model": vm}``
        with ``vm`` a :class:`ValueModel` (its head seeded by ``args.seed``, loaded from ``value_model`` when that
        folder holds one).

    Raises:
        ValueError: ``value_model`` given for a run without a learned critic, a ``PeftModel`` to copy into a separate
            value model, or a ``value_model`` that is not a causal LM.
    """
    value_model = value_model if value_model is not None else args.value_model
    if (
        not get_advantage_estimator(args.prime_estimator, "prime_estimator").needs_values
        or args.prime_value != "critic"
    ):
        if value_model is not None:
            raise ValueError(
                "`value_model` was given but this run has no learned critic (it needs prime_estimator='ppo' and "
                "prime_value='critic'). Drop value_model, or set those options."
            )
        return None
    is_peft_policy = isinstance(model, nn.Module) and is_peft_model(model)
    if value_model is None and (peft_config is not None or is_peft_policy):
        return {"kind": "adapter", "pretrained_adapter": is_peft_policy}
    init_kw = model_init_kwargs(args)
    check_causal_lm_source(
        value_model,
        "value_model",
        trust_remote_code=init_kw.get("trust_remote_code", False),
        revision=init_kw.get("revision"),
    )
    source = value_model if value_model is not None else model
    backbone = load_model_copy(
        source,
        args,
        peft_message="A PeftModel cannot be copied into a separate value model; pass `value_model` (a path or a "
        "causal LM), or let the value model be the adapter 'value' on the policy (the default with PEFT).",
    )
    vm = ValueModel(backbone, seed=args.seed)
    load_value_head(vm, source)
    return {"kind": "model", "model": vm}


def adapter_value_model(policy, *, pretrained_adapter: bool, seed: int, deepspeed: bool) -> ValueModel:
    """The PEFT value model (PRIME section 5.4): a third adapter ``"value"`` on the policy's ``PeftModel`` plus the
    head (seeded by ``seed``).

    Args:
        policy: the policy's ``PeftModel`` (the trainer's ``self.model``, before ``accelerator.prepare``); the
            adapter is added to it in place.
        pretrained_adapter: the policy came as a ``PeftModel``: the adapter ``"value"`` is a copy of its adapter;
            else a fresh adapter of the policy's config, its parameters frozen for the policy's optimizer and DDP.
        seed: ``args.seed``, for the head's initialisation (:class:`ValueModel`).
        deepspeed: whether the trainer runs under DeepSpeed.

    Raises:
        ValueError: under DeepSpeed (the adapter would be partitioned inside the policy's engine), or for a PEFT
            method the shared-base adapters do not support.
    """
    if deepspeed:
        raise ValueError(
            "The shared-base PEFT value model (adapter 'value' on the policy) is not supported with DeepSpeed: "
            "its adapter would be partitioned inside the policy's engine. Pass `value_model` (a separate value "
            "model, trained as its own DeepSpeed engine) or train without DeepSpeed."
        )
    check_peft_adapter_supported(policy)
    if pretrained_adapter:
        copy_adapter(policy, VALUE_ADAPTER)
    else:
        import copy

        cfg = copy.deepcopy(policy.peft_config["default"])
        cfg.inference_mode = False
        policy.add_adapter(VALUE_ADAPTER, cfg)
        for _, p in adapter_parameters(policy, VALUE_ADAPTER):
            p.requires_grad_(False)  # the policy's optimizer and DDP must not see them
    return ValueModel(policy, adapter_name=VALUE_ADAPTER, seed=seed)


def value_metrics(accelerator, values, returns, train_mask, stats: dict) -> dict[str, float]:
    """The value metrics of a generation round, in logging order: ``value/mean`` and ``value/explained_variance``
    over the global batch's trained tokens (NaN without a trained token, resp. with fewer than 2), then ``value/<k>``
    for each ``stats`` entry (the critic's ``loss``, ``clipfrac``; ``grad_norm``, ``learning_rate`` after a step).

    ``values``, ``returns``, ``train_mask``: this process's ``(B, T)`` tensors (float32 values and returns; the 0/1
    mask of the trained tokens), gathered (padded) over processes: collective, call it on every rank. Used for the
    learned critic (:meth:`Critic.metrics`) and for ``prime_value="implicit_prm"`` (no critic, empty ``stats``).
    """
    v, ret, w = (gather_padded(accelerator, x) for x in (values, returns, train_mask))
    w = w.bool()
    out = {"value/mean": v[w].mean().item() if w.any() else math.nan}
    ev = F.explained_variance(v, ret, w) if int(w.sum()) >= 2 else torch.tensor(math.nan)
    out["value/explained_variance"] = float(ev)
    out.update({f"value/{k}": val for k, val in stats.items()})
    return out


class Critic:
    """The learned critic of ``prime_estimator="ppo"``, ``prime_value="critic"`` (PRIME section 5.4, Table 4): the
    value model and its optimizer, one update per generation round, its metrics and checkpoint files. The PRIME
    trainer holds it as ``self.critic`` and calls it; it never calls the trainer (the trainer passes the decisions it
    owns, ``poisoned`` and ``defer``, and dispatches ``on_value_step`` from :meth:`step_payload`).

    Args:
        value_function: the :class:`ValueFunction` (its model on the accelerator's device, or to be wrapped by
            DeepSpeed).
        args: the trainer's config (``value_epochs``, ``vf_coef``, ``cliprange_value``, ``prime_gamma``, ``lam`` and
            the ``value_*`` optimizer settings).
        accelerator: the trainer's ``Accelerator`` (reductions and gathers over processes).
        deepspeed: whether the trainer runs under DeepSpeed (the value model becomes its own engine).

    Attributes:
        value_function: the :class:`ValueFunction` (the trainer's ``value_function``).
        value_optim: its :class:`~trl_prime.prime.prm_optimizer.ValueOptimizer` (the trainer's ``value_optim``).
    """

    def __init__(self, value_function: ValueFunction, args, accelerator, *, deepspeed: bool):
        self.value_function = value_function
        self.value_optim = ValueOptimizer(value_function, args, accelerator, deepspeed=deepspeed)
        self.args = args
        self.accelerator = accelerator

    @classmethod
    def from_spec(cls, spec: dict | None, policy, args, accelerator, *, deepspeed: bool, micro_batch_size: int):
        """The critic of :func:`build_value_spec`'s ``spec`` (``None`` for ``None``): the separate value model moved
        to the accelerator's device (not under DeepSpeed), or the adapter ``"value"`` added to ``policy``
        (:func:`adapter_value_model`, which raises its ``ValueError``). ``micro_batch_size``: rows per forward."""
        if spec is None:
            return None
        if spec["kind"] == "adapter":
            vm = adapter_value_model(
                policy, pretrained_adapter=spec["pretrained_adapter"], seed=args.seed, deepspeed=deepspeed
            )
        else:
            vm = spec["model"]
            if not deepspeed:
                vm = vm.to(accelerator.device)
        return cls(ValueFunction(vm, micro_batch_size=micro_batch_size), args, accelerator, deepspeed=deepspeed)

    # ------------------------------------------------------------------------------------------------------------
    # One update per generation round
    # ------------------------------------------------------------------------------------------------------------
    def train(self, r, rewards: torch.Tensor, train_mask: torch.Tensor, *, poisoned: bool, defer: bool):
        """The critic's round: value forwards by micro-batches, each with grad and one backward of ``vf_coef`` times
        the clipped value loss (:func:`trl_prime.functional.clipped_value_loss`, token mean over the global batch's
        ``train_mask``) against the GAE returns of ``rewards`` (:func:`trl_prime.functional.gae_advantages`), then one
        optimizer step; ``value_epochs > 1`` repeats it with fresh forwards (returns and clip centre of epoch 1, so
        ``cliprange_value`` acts from epoch 2 on: one value forward per micro-batch, no separate no-grad forward for
        the old values as veRL runs). The value model has its own AdamW (nearly scale-invariant; TRL's old PPO shared
        one optimizer with the policy), so ``vf_coef`` only rescales the loss relative to ``value_max_grad_norm``
        (and Adam's eps). Evaluation (``r.mode != "train"``), a batch without trained token or a ``poisoned`` one:
        the forwards without grad, no step. Collective (reductions over processes).

        Args:
            r: the generation round (a :class:`~trl_prime.prime.trainer.PrimeRound`): ``mode``, ``input_ids`` /
                ``attention_mask`` ``(B, L)``, ``actions`` ``(B, T)`` (the policy's own tokens).
            rewards: ``(B, T)`` PPO token rewards (:func:`trl_prime.functional.ppo_token_rewards`).
            train_mask: ``(B, T)`` 0/1 tokens the value loss trains on.
            poisoned: the trainer's guards will skip this batch's steps (``guard_poisoned``): no update.
            defer: the last epoch's optimizer step waits for the policy's (held, ``value_optim.pending``; the
                trainer's ``_defers_model_steps``, as the PRM's).

        Returns:
            ``(values, returns, stats)``: ``(B, T)`` float32 detached values of the first forward and GAE returns, and
            the metrics (``loss``, ``clipfrac``; ``grad_norm``, ``learning_rate`` when the optimizer stepped, see
            :meth:`step_payload`).
        """
        a = self.args
        n_global = self.accelerator.reduce(train_mask.sum().float(), reduction="sum").item()
        train = r.mode == "train" and n_global > 0 and not poisoned
        values, returns = (
            torch.zeros_like(rewards, dtype=torch.float32),
            torch.zeros_like(rewards, dtype=torch.float32),
        )
        losses, clips, norm = [], [], None
        for epoch in range(a.value_epochs if train else 1):
            totals = self._epoch(r, rewards, train_mask, values, returns, max(n_global, 1.0), epoch, train)
            totals = self.accelerator.reduce(totals, reduction="sum")
            losses.append(totals[0].item())
            clips.append(totals[1].item() / n_global if n_global else math.nan)
            if train:
                # the last epoch's step waits for the policy's (as the PRM's: _defers_model_steps)
                last = epoch == a.value_epochs - 1
                norm = self.value_optim.step(loss_finite=math.isfinite(losses[-1]), defer=last and defer)
        stats = {"loss": sum(losses) / len(losses) if n_global else math.nan, "clipfrac": sum(clips) / len(clips)}
        if norm is not None:
            stats.update(grad_norm=norm, learning_rate=self.value_optim.learning_rate)
        return values, returns, stats

    def step_payload(self, stats: dict) -> dict | None:
        """The keyword arguments of the ``on_value_step`` callbacks after :meth:`train` returned ``stats``: ``loss``,
        ``grad_norm``, ``learning_rate``, ``num_updates`` (counting a step held for the policy's) and ``value_model``
        (the unwrapped :class:`ValueModel`); ``None`` when the optimizer did not step. Call it right after
        :meth:`train` (it reads the optimizer's update count)."""
        if "grad_norm" not in stats:
            return None
        return dict(
            loss=stats["loss"],
            grad_norm=stats["grad_norm"],
            learning_rate=stats["learning_rate"],
            num_updates=self.value_optim.num_updates + int(self.value_optim.pending),
            value_model=self.value_function.module,
        )

    def _epoch(self, r, rewards, train_mask, values, returns, normalizer: float, epoch: int, train: bool):
        """One pass of the critic over this process's rows (see :meth:`train`); fills ``values`` and ``returns`` in
        epoch 0. Returns the ``(2,)`` local sums ``(value loss, clipped tokens)``."""
        a, fn = self.args, self.value_function
        T, mb = rewards.size(1), fn.micro_batch_size
        totals = torch.zeros(2, device=rewards.device)
        with fn.context(trainable=train), torch.set_grad_enabled(train):
            for s in range(0, rewards.size(0), mb):
                rows = slice(s, s + mb)
                v = fn(r.input_ids[rows], r.attention_mask[rows], T)
                if epoch == 0:  # the old values V of GAE and of the clip
                    values[rows] = v.detach()
                    _, returns[rows] = F.gae_advantages(
                        rewards[rows], values[rows], r.actions[rows], gamma=a.prime_gamma, lam=a.lam
                    )
                loss, clipfrac = F.clipped_value_loss(
                    v,
                    values[rows],
                    returns[rows],
                    train_mask[rows],
                    cliprange_value=a.cliprange_value,
                    normalizer=normalizer,
                )
                if train:
                    self.value_optim.backward(a.vf_coef * loss)
                totals += torch.stack([loss.detach().float(), clipfrac.detach().float() * train_mask[rows].sum()])
        return totals

    def metrics(self, values, returns, train_mask, stats: dict) -> dict[str, float]:
        """The round's value metrics, name -> value in logging order (:func:`value_metrics`: ``value/mean``,
        ``value/explained_variance``, then ``value/loss``, ``value/clipfrac`` and after a step ``value/grad_norm``,
        ``value/learning_rate``); the trainer appends them to its metrics. Collective."""
        return value_metrics(self.accelerator, values, returns, train_mask, stats)

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: value/ (weights, optimizer.pt, scheduler.pt, prime_state.json), value_deepspeed/
    # ------------------------------------------------------------------------------------------------------------
    def prepare(self, max_steps: int, resume_from_checkpoint: str | None) -> None:
        """Create the optimizer (and DeepSpeed engine) for ``max_steps`` policy steps (``value_epochs`` updates
        each); with ``resume_from_checkpoint`` (a ``checkpoint-N`` folder) load its ``value/`` state."""
        self.value_optim.create(max_steps)
        if resume_from_checkpoint is not None:
            self.value_optim.load_state(resume_from_checkpoint, self.value_function.module)

    def save_state(self, output_dir: str, is_main_process: bool) -> None:
        """Write the optimisation state into the checkpoint folder ``output_dir`` (``value/``,
        ``value_deepspeed/``); call it on every rank, ``is_main_process`` writes the shared files."""
        self.value_optim.save_state(output_dir, is_main_process=is_main_process)

    def save_pretrained(self, output_dir: str, is_main_process: bool) -> None:
        """Save the value model into ``output_dir`` (the backbone or adapter ``"value"``, and
        ``value_head.safetensors``; ``value_model=`` loads it back), gathered under ZeRO-3; call it on every rank,
        only ``is_main_process`` writes."""
        self.value_optim.save_pretrained(output_dir, is_main_process=is_main_process)
