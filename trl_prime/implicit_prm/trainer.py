"""Offline training of an implicit PRM on outcome labels (Implicit PRM arXiv 2412.01981 Sec. 3).

:class:`ImplicitPRMTrainer` trains :class:`~trl_prime.ImplicitPRM`'s ``pi_phi`` on rows ``{prompt, completion,
label}`` (labels 0/1 or fractional in [0, 1]; :func:`~trl_prime.implicit_prm.data.build_outcome_dataset` makes them)
with :func:`trl_prime.functional.implicit_prm_loss`:

- ``ce`` (default, unpaired): ``BCE(sigmoid(r(y)), label)``;
- ``dpo`` / ``nca``: pairs (correct, incorrect) built *within each prompt*. Batches are made of whole prompt groups
  (:class:`PromptGroupBatchSampler`), so all completions of a prompt are in the same batch, on the same process:
  under ``accelerate launch`` the prepared loader deals *whole* batches to the ranks round-robin, so N processes with
  accumulation 1 see the same batches per optimizer step as one process with accumulation N (and, under DDP's
  gradient averaging, compute the same update: tested with 2 CPU processes, full and LoRA);
- ``kto`` (unpaired): reference points from the batch's rows of the other label.

with ``r(y) = beta * sum_t (log pi_phi - log pi_ref)`` (PRIME arXiv 2502.01456 Eq. 3, summed over the completion)
against a frozen reference: a separate model (default: a frozen copy of the initial checkpoint) or, under PEFT, the
base model with adapters disabled.

Tokenisation is exactly :meth:`ImplicitPRM.encode`'s (so a trained PRM scores what it was trained on): a standard
prompt is tokenised as is, a conversational one (list of messages) with the chat template and the generation prompt;
the completion (a string, or a list of messages whose last content is used) is tokenised without special tokens and
EOS is appended. :class:`ImplicitPRMCollator` pads a batch as TRL does: a left-padded prompt followed by a
right-padded completion. :func:`freeze_lower_layers` serves ``trainable_layers``; :func:`pairable_group_rows` picks
the prompts whose rows a ranking metric can pair.
"""

from __future__ import annotations

import copy
import os
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

from trl_prime import functional as F
from trl_prime.implicit_prm.config import ImplicitPRMConfig
from trl_prime.implicit_prm.data import REQUIRED_COLUMNS, prompt_key
from trl_prime.implicit_prm.model import ImplicitPRM, pad_prompt_completion, tokenize_prompt_completion
from trl_prime.modeling import completion_logps, eval_mode, unwrap


# ----------------------------------------------------------------------------------------------------------------
# Batching and freezing
# ----------------------------------------------------------------------------------------------------------------
def pairable_group_rows(labels: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: rows of the groups (prompts) holding at least two different finite labels, i.e. at least one
    ranking pair. ``labels`` ``(B,)`` float (NaN = unlabelled), ``group_ids`` ``(B,)`` int."""
    out = torch.zeros_like(labels, dtype=torch.bool)
    finite = torch.isfinite(labels)
    for g in torch.unique(group_ids):
        rows = (group_ids == g) & finite
        if rows.any() and labels[rows].max() > labels[rows].min():
            out |= rows
    return out


class ImplicitPRMCollator:
    """Pads tokenised rows: prompt left-padded, completion right-padded, concatenated (TRL's layout).

    Returns ``input_ids``/``attention_mask`` ``(B, P+T)``, ``completion_mask`` ``(B, T)``, ``labels`` ``(B,)`` float
    and ``group_ids`` ``(B,)`` long (the prompt's index in the dataset).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = pad_prompt_completion(
            [f["prompt_ids"] for f in features], [f["completion_ids"] for f in features], self.pad_token_id
        )
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "completion_mask": batch["completion_mask"],
            "labels": torch.tensor([float(f["label"]) for f in features], dtype=torch.float32),
            "group_ids": torch.tensor([int(f["group_id"]) for f in features], dtype=torch.long),
        }


class PromptGroupBatchSampler(Sampler[list[int]]):
    """Batches of whole prompt groups: every row of a prompt lands in the same batch.

    Groups are shuffled once (``seed``) and packed first-fit into batches of at most ``batch_size`` rows (a group
    larger than ``batch_size`` forms its own batch); the composition is then fixed, so ``len`` is stable, and the
    order of the batches is reshuffled every epoch (``seed + epoch``). ``shuffle=False`` keeps the dataset order.
    """

    def __init__(self, group_ids: Sequence[int], batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        groups: dict[int, list[int]] = defaultdict(list)
        for i, g in enumerate(group_ids):
            groups[int(g)].append(i)
        order = list(groups)
        if shuffle:
            random.Random(seed).shuffle(order)
        batches, cur = [], []
        for g in order:
            rows = groups[g]
            if cur and len(cur) + len(rows) > batch_size:
                batches.append(cur)
                cur = []
            cur = cur + rows
        if cur:
            batches.append(cur)
        self.batches = batches
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        order = list(range(len(self.batches)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        for i in order:
            yield list(self.batches[i])


def freeze_lower_layers(model: nn.Module, n: int) -> list[str]:
    """Freeze every parameter of a causal LM except its top ``n`` transformer blocks and the final norm.

    The blocks are the model's ``nn.ModuleList`` of ``config.num_hidden_layers`` modules (``model.model.layers`` for
    Llama / Qwen / Mistral). Returns the names of the parameters left trainable.

    Raises:
        ValueError: no such block list is found, or ``n`` exceeds the number of blocks.
    """
    base = unwrap(model)
    L = getattr(getattr(base, "config", None), "num_hidden_layers", None)
    blocks = next((m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == L), None)
    if blocks is None:
        raise ValueError(f"trainable_layers: cannot find the {L} transformer blocks of {type(base).__name__}.")
    if not 1 <= n <= L:
        raise ValueError(f"trainable_layers={n} must be in [1, {L}] (the model has {L} blocks).")
    base.requires_grad_(False)
    blocks[L - n :].requires_grad_(True)
    norm = getattr(getattr(base, "model", base), "norm", None)
    if isinstance(norm, nn.Module):
        norm.requires_grad_(True)
    return [name for name, p in base.named_parameters() if p.requires_grad]


def _default_args(model: str | nn.Module) -> ImplicitPRMConfig:
    """:class:`ImplicitPRMConfig` with ``output_dir`` ``<model name>-implicit-prm``."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
    return ImplicitPRMConfig(f"{str(name).split('/')[-1] or 'model'}-implicit-prm")


def _prm_tokenizer(model: nn.Module, model_path: str | None, processing_class):
    """The PRM's tokenizer: ``processing_class``, else loaded from the model's path; given a pad token (EOS) if it
    has none.

    Raises:
        ValueError: no tokenizer is given and the model records no path.
    """
    if processing_class is None:
        src = model_path or getattr(unwrap(model).config, "_name_or_path", None)
        if not src:
            raise ValueError("Pass `processing_class`: the model records no path to load its tokenizer from.")
        processing_class = AutoTokenizer.from_pretrained(src)
    if processing_class.pad_token_id is None:
        processing_class.pad_token = processing_class.eos_token
    return processing_class


def _apply_peft(model: nn.Module, peft_config) -> tuple[nn.Module, bool]:
    """``(model, is_peft)``: the model wrapped with ``peft_config`` when one is given.

    Raises:
        ValueError: ``model`` is already a ``PeftModel`` and ``peft_config`` is given too.
    """
    is_peft = hasattr(unwrap(model), "peft_config")
    if peft_config is None:
        return model, is_peft
    if is_peft:
        raise ValueError("`model` is already a PeftModel: do not pass `peft_config` too.")
    from peft import get_peft_model

    return get_peft_model(model, peft_config), True


def _frozen_reference(
    ref_model: str | nn.Module | None, args: ImplicitPRMConfig, model: nn.Module, model_path: str | None, is_peft: bool
) -> nn.Module | None:
    """The frozen reference ``pi_ref`` (eval mode, no grad): ``ref_model`` (a model or a path), else
    ``args.ref_model``, else the PRM's initial checkpoint (reloaded from ``model_path``, or a deep copy of ``model``);
    ``None`` for a PEFT PRM (its base with adapters disabled is the reference)."""
    if isinstance(ref_model, str):
        ref_model = AutoModelForCausalLM.from_pretrained(ref_model)
    elif ref_model is None and args.ref_model is not None:
        ref_model = AutoModelForCausalLM.from_pretrained(args.ref_model)
    elif ref_model is None and not is_peft:
        ref_model = AutoModelForCausalLM.from_pretrained(model_path) if model_path else copy.deepcopy(model)
    if ref_model is not None:
        ref_model.eval()
        ref_model.requires_grad_(False)
    return ref_model


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------
class ImplicitPRMTrainer(Trainer):
    """Trains an implicit PRM offline on ``{prompt, completion, label}`` rows (Implicit PRM section 3).

    Args:
        model: the PRM's initial checkpoint: a path / Hub id or a causal LM (or a ``peft.PeftModel``).
        args: :class:`ImplicitPRMConfig`.
        train_dataset / eval_dataset: ``datasets.Dataset`` with columns ``prompt`` (string or list of messages),
            ``completion`` (string or list of messages) and ``label`` (float in [0, 1]).
        ref_model: the frozen reference (a model or a path). Default: ``args.ref_model``, else the initial checkpoint
            (reloaded from its path, or a deep copy of ``model``); under PEFT, the base with adapters disabled.
        processing_class: the tokenizer (default: loaded from the model's path).
        peft_config: a ``peft`` config: the PRM is trained as an adapter, the reference is the adapters-off base.

    Logged: ``loss``, ``pair_accuracy`` (weighted pairwise ranking accuracy of the sequence rewards within prompts,
    ties count half), ``rewards/correct`` and ``rewards/incorrect`` (mean ``r(y)`` of rows with label > 0.5 / < 0.5)
    and ``rewards/margin``. ``save_model(dir)`` writes an :meth:`ImplicitPRM.save_pretrained` folder (with its
    reference), which :meth:`ImplicitPRM.from_pretrained` loads; :attr:`prm` is the live :class:`ImplicitPRM`.
    """

    _tag_names = ["trl", "trl-prime", "implicit-prm"]

    def __init__(
        self,
        model: str | nn.Module,
        args: ImplicitPRMConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        ref_model: str | nn.Module | None = None,
        processing_class=None,
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
    ):
        if args is None:
            args = _default_args(model)
        if not isinstance(args, ImplicitPRMConfig):
            raise TypeError(f"`args` must be an ImplicitPRMConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ValueError(
                "ImplicitPRMTrainer needs a `train_dataset` with columns 'prompt', 'completion', 'label'."
            )

        model_path = model if isinstance(model, str) else None
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model)
        processing_class = _prm_tokenizer(model, model_path, processing_class)
        model, is_peft = _apply_peft(model, peft_config)
        if args.trainable_layers is not None and not is_peft:
            freeze_lower_layers(model, args.trainable_layers)
        self.ref_model = _frozen_reference(ref_model, args, model, model_path, is_peft)
        # PEFT and no reference model: the base with adapters disabled is the reference (else the adapters stay on)
        self.adapter_name = unwrap(model).active_adapter if is_peft and self.ref_model is None else None
        self.beta = float(args.beta)
        self.loss_type = args.loss_type

        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        eval_dataset = self._prepare_eval_dataset(eval_dataset, processing_class, args)

        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        super().__init__(
            model=model,
            args=args,
            data_collator=ImplicitPRMCollator(processing_class.pad_token_id),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        # the loss is a mean over rows / pairs: Trainer must scale it for gradient accumulation, not count tokens
        self.model_accepts_loss_kwargs = False
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        self.prm = ImplicitPRM(
            self.model,
            self.ref_model,
            beta=self.beta,
            tokenizer=processing_class,
            adapter_name=self.adapter_name,
            fused_head=False,
        )

    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _prepare_dataset(dataset, tokenizer, args: ImplicitPRMConfig, name: str):
        cols = list(getattr(dataset, "column_names", None) or [])
        missing = [c for c in REQUIRED_COLUMNS if c not in cols]
        if missing:
            raise ValueError(
                f"The {name} dataset lacks the column(s) {missing}: ImplicitPRMTrainer needs columns 'prompt', "
                f"'completion' and 'label' (label in [0, 1]); got columns {cols}."
            )
        labels = [float(x) if x is not None else float("nan") for x in dataset["label"]]
        bad = [i for i, y in enumerate(labels) if not (0.0 <= y <= 1.0)]
        if bad:
            raise ValueError(
                f"The {name} dataset's column 'label' must hold numbers in [0, 1]; row {bad[0]} has "
                f"{dataset[bad[0]]['label']!r}."
            )
        keys: dict[str, int] = {}
        group_ids = [keys.setdefault(prompt_key(p), len(keys)) for p in dataset["prompt"]]
        dataset = dataset.add_column("group_id", group_ids)
        if "label" in cols:
            dataset = dataset.remove_columns("label").add_column("label", labels)

        def tok(row):
            return tokenize_prompt_completion(
                row["prompt"],
                row["completion"],
                tokenizer,
                max_length=args.max_length,
                max_prompt_length=args.max_prompt_length,
            )

        with args.main_process_first(desc=f"tokenizing {name} dataset"):
            dataset = dataset.map(tok, desc=f"Tokenizing {name} dataset")
        keep = ("prompt_ids", "completion_ids", "label", "group_id")
        return dataset.remove_columns([c for c in dataset.column_names if c not in keep])

    @classmethod
    def _prepare_eval_dataset(cls, eval_dataset, tokenizer, args: ImplicitPRMConfig):
        """:meth:`_prepare_dataset` of an eval dataset, or of each one of a ``{name: dataset}`` dict."""
        if isinstance(eval_dataset, dict):
            return {k: cls._prepare_dataset(v, tokenizer, args, f"eval[{k}]") for k, v in eval_dataset.items()}
        if eval_dataset is not None:
            return cls._prepare_dataset(eval_dataset, tokenizer, args, "eval")
        return None

    def _dataloader(self, dataset, batch_size: int, shuffle: bool) -> DataLoader:
        loader_kwargs = dict(
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        if self.args.group_by_prompt:
            sampler = PromptGroupBatchSampler(dataset["group_id"], batch_size, shuffle=shuffle, seed=self.args.seed)
            dl = DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)
        else:
            g = torch.Generator().manual_seed(self.args.seed)
            dl = DataLoader(
                dataset,
                batch_size=batch_size,
                shuffle=shuffle,
                generator=g,
                drop_last=self.args.dataloader_drop_last,
                **loader_kwargs,
            )
        return self.accelerator.prepare(dl)

    def get_train_dataloader(self) -> DataLoader:
        return self._dataloader(self.train_dataset, self._train_batch_size, shuffle=True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        if eval_dataset is None:
            raise ValueError("Evaluation needs an `eval_dataset`.")
        return self._dataloader(eval_dataset, self.args.per_device_eval_batch_size, shuffle=False)

    # ------------------------------------------------------------------------------------------------------------
    def _reference_logps(self, model, input_ids, attention_mask, T) -> torch.Tensor:
        with torch.no_grad():
            if self.ref_model is not None:
                with eval_mode(self.ref_model):
                    return completion_logps(self.ref_model, input_ids, attention_mask, T)
            base = unwrap(model)
            with eval_mode(base), base.disable_adapter():
                return completion_logps(base, input_ids, attention_mask, T)

    def _loss_and_rewards(self, model, inputs):
        ids, am, cmask = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
        T = cmask.size(1)
        prm_logps = completion_logps(model, ids, am, T)
        ref_logps = self._reference_logps(model, ids, am, T)
        loss = F.implicit_prm_loss(
            prm_logps,
            ref_logps,
            cmask,
            inputs["labels"],
            beta=self.beta,
            loss_type=self.loss_type,
            group_ids=inputs["group_ids"],
        )
        m = cmask.bool()
        diff = (prm_logps.detach() - ref_logps).float()
        rewards = self.beta * torch.where(m, diff, torch.zeros_like(diff)).sum(-1)
        return loss, rewards

    def _record_metrics(self, rewards, labels, group_ids, mode: str) -> None:
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            rewards = torch.tensor(gather_object(rewards.cpu().tolist()))
            labels = torch.tensor(gather_object(labels.cpu().tolist()))
            group_ids = torch.tensor(gather_object(group_ids.cpu().tolist()))
        rewards, labels, group_ids = rewards.float().cpu(), labels.float().cpu(), group_ids.cpu()
        m = self._metrics[mode]
        pairable = pairable_group_rows(labels, group_ids)
        if bool(pairable.any()):  # prompts whose labels all agree have no pair: they would read 0.5, not skipped
            m["pair_accuracy"].append(
                F.prm_pair_accuracy(rewards[pairable], labels[pairable], group_ids=group_ids[pairable], ties="half")
            )
        pos, neg = labels > 0.5, labels < 0.5
        if bool(pos.any()):
            m["rewards/correct"].append(rewards[pos].mean().item())
        if bool(neg.any()):
            m["rewards/incorrect"].append(rewards[neg].mean().item())
        if bool(pos.any()) and bool(neg.any()):
            m["rewards/margin"].append(rewards[pos].mean().item() - rewards[neg].mean().item())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        loss, rewards = self._loss_and_rewards(model, inputs)
        self._record_metrics(rewards, inputs["labels"], inputs["group_ids"], mode)
        if return_outputs:
            return loss, {"rewards": rewards}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, rewards = self._loss_and_rewards(model, inputs)
            self._record_metrics(rewards, inputs["labels"], inputs["group_ids"], "eval")
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        return loss, rewards.detach(), inputs["labels"]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {k: sum(v) / len(v) for k, v in self._metrics[mode].items() if v}
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        super().log({**logs, **metrics}, start_time)
        self._metrics[mode].clear()

    # ------------------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write an :meth:`ImplicitPRM.save_pretrained` folder (PRM, tokenizer, ``reference/``, config json)."""
        output_dir = output_dir or self.args.output_dir
        state_dict = None
        if self.is_deepspeed_enabled and self.adapter_name is None:
            state_dict = self.accelerator.get_state_dict(self.model)
        self.prm.model = self.model
        self.prm.save_pretrained(
            output_dir,
            state_dict=state_dict,
            is_main_process=self.args.should_save,
            safe_serialization=True,
        )
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
