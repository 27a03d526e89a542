"""Offline training of an implicit PRM on outcome labels (Implicit PRM arXiv 2412.01981; SPEC section 1).

:class:`ImplicitPRMTrainer` trains :class:`~trl_prime.ImplicitPRM`'s ``pi_phi`` on rows ``{prompt, completion,
label}`` (labels 0/1 or fractional in [0, 1]) with :func:`trl_prime.functional.implicit_prm_loss`:

- ``ce`` (default, unpaired): ``BCE(sigmoid(r(y)), label)``;
- ``dpo`` / ``nca``: pairs (correct, incorrect) built *within each prompt*. Batches are made of whole prompt groups
  (:class:`PromptGroupBatchSampler`), so all completions of a prompt are in the same batch, on the same process:
  under ``accelerate launch`` the prepared loader deals *whole* batches to the ranks round-robin, so N processes with
  accumulation 1 see the same batches per optimizer step as one process with accumulation N (and, under DDP's
  gradient averaging, compute the same update: tested with 2 CPU processes, full and LoRA);
- ``kto`` (unpaired): reference points from the batch's rows of the other label.

with ``r(y) = beta * sum_t (log pi_phi - log pi_ref)`` against a frozen reference: a separate model (default: a
frozen copy of the initial checkpoint) or, under PEFT, the base model with adapters disabled.

Tokenisation is exactly :meth:`ImplicitPRM.encode`'s (so a trained PRM scores what it was trained on): a standard
prompt is tokenised as is, a conversational one (list of messages) with the chat template and the generation prompt;
the completion (a string, or a list of messages whose last content is used) is tokenised without special tokens and
EOS is appended. Batches are a left-padded prompt followed by a right-padded completion, as in TRL.

:func:`best_of_n` reranks candidates with :meth:`ImplicitPRM.score` (``min`` over steps by default).
:func:`build_outcome_dataset` turns a prompt set, a policy and a verifier into the training rows (K rollouts per
prompt from :func:`sample_completions`, labels from :mod:`trl_prime.rewards`); :func:`score_candidates` scores many
candidates of one prompt under every aggregation at once (``recipes/evaluate_best_of_n.py``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from trl_prime import functional as F
from trl_prime._guards import DEFAULT_LR_SCHEDULER, check_scheduler_warmup
from trl_prime.implicit_prm import (
    ImplicitPRM,
    completion_logps,
    eval_mode,
    position_ids_from_mask,
    tokenize_prompt_completion,
    unwrap,
)

LOSS_TYPES = ("ce", "dpo", "kto", "nca")
REQUIRED_COLUMNS = ("prompt", "completion", "label")


# ----------------------------------------------------------------------------------------------------------------
# Metrics

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


# ----------------------------------------------------------------------------------------------------------------
# Config
@dataclass
class ImplicitPRMConfig(TrainingArguments):
    """Configuration of :class:`ImplicitPRMTrainer`: ``transformers.TrainingArguments`` plus the implicit PRM options.

    ``per_device_train_batch_size`` is a target number of *rows* per batch: batches are packed with whole prompt
    groups, so a batch may hold fewer rows (the next group did not fit) or more (one group larger than the target).

    Learning rate: 1e-6 at a constant rate (``lr_scheduler_type`` ``"constant"``; transformers' default ``"linear"``
    decays it to 0). The Implicit PRM paper states no rate or schedule; these are PRIME's PRM's (PRIME section 4.1),
    the same model trained on the same outcome labels online.
    """

    beta: float = field(
        default=0.05, metadata={"help": "Implicit reward scale beta: r_t = beta * (log pi_phi - log pi_ref). > 0."}
    )
    loss_type: str = field(
        default="ce",
        metadata={"help": "'ce' (BCE on sigmoid(r(y)), default), 'dpo', 'nca' (pairs within a prompt) or 'kto'."},
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum prompt + completion tokens (the completion is truncated). None: no limit."}
    )
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Maximum prompt tokens (the prompt's start is dropped). None: no limit."}
    )
    ref_model: str | None = field(
        default=None,
        metadata={
            "help": "Path or Hub id of the frozen reference. Default: the PRM's initial checkpoint (under PEFT: the "
            "base model with adapters disabled)."
        },
    )
    group_by_prompt: bool = field(
        default=True,
        metadata={"help": "Batch whole prompt groups together (needed by 'dpo'/'nca'; required for them)."},
    )
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (PRIME's PRM: 1e-6)."})
    lr_scheduler_type: str = field(
        default=DEFAULT_LR_SCHEDULER,
        metadata={"help": "Learning-rate schedule ('constant', as PRIME's PRM; transformers' default 'linear' decays "
                          "to 0). With warmup_steps > 0 use 'constant_with_warmup'."},
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: the trainer tokenises and collates its own columns."}
    )
    trainable_layers: int | None = field(
        default=None,
        metadata={
            "help": "Train only the top N transformer blocks and the final norm of the PRM (embeddings / LM head and "
            "lower blocks frozen; backward stops at block L-N). None: every parameter (the paper). Ignored under PEFT."
        },
    )

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"`loss_type`={self.loss_type!r} is not supported; use one of {list(LOSS_TYPES)}.")
        if not (isinstance(self.beta, (int, float)) and self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"`beta`={self.beta!r} must be a finite number > 0 (the paper uses 0.05).")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"`max_length`={self.max_length} must be >= 2 (one prompt and one completion token).")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"`max_prompt_length`={self.max_prompt_length} must be >= 1.")
        if (
            self.max_length is not None
            and self.max_prompt_length is not None
            and self.max_prompt_length >= self.max_length
        ):
            raise ValueError(
                f"`max_prompt_length`={self.max_prompt_length} must be smaller than `max_length`={self.max_length} "
                "to leave room for the completion."
            )
        if self.trainable_layers is not None and self.trainable_layers < 1:
            raise ValueError(f"`trainable_layers`={self.trainable_layers} must be >= 1 (or None: train everything).")
        if self.loss_type in ("dpo", "nca") and not self.group_by_prompt:
            raise ValueError(
                f"`loss_type`={self.loss_type!r} pairs completions of the same prompt: keep `group_by_prompt`=True."
            )
        check_scheduler_warmup(self)
        super().__post_init__()


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def _prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


class ImplicitPRMCollator:
    """Pads tokenised rows: prompt left-padded, completion right-padded, concatenated (TRL's layout).

    Returns ``input_ids``/``attention_mask`` ``(B, P+T)``, ``completion_mask`` ``(B, T)``, ``labels`` ``(B,)`` float
    and ``group_ids`` ``(B,)`` long (the prompt's index in the dataset).
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        B = len(features)
        P = max(len(f["prompt_ids"]) for f in features)
        T = max(len(f["completion_ids"]) for f in features)
        ids = torch.full((B, P + T), self.pad_token_id, dtype=torch.long)
        am = torch.zeros((B, P + T), dtype=torch.long)
        for i, f in enumerate(features):
            p, c = f["prompt_ids"], f["completion_ids"]
            ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
            am[i, P - len(p) : P] = 1
            ids[i, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
            am[i, P : P + len(c)] = 1
        return {
            "input_ids": ids,
            "attention_mask": am,
            "completion_mask": am[:, P:].clone(),
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


# ----------------------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------------------
class ImplicitPRMTrainer(Trainer):
    """Trains an implicit PRM offline on ``{prompt, completion, label}`` rows (SPEC section 1).

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
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            args = ImplicitPRMConfig(f"{str(name).split('/')[-1] or 'model'}-implicit-prm")
        if not isinstance(args, ImplicitPRMConfig):
            raise TypeError(f"`args` must be an ImplicitPRMConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ValueError("ImplicitPRMTrainer needs a `train_dataset` with columns 'prompt', 'completion', 'label'.")

        model_path = model if isinstance(model, str) else None
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model)
        if processing_class is None:
            src = model_path or getattr(unwrap(model).config, "_name_or_path", None)
            if not src:
                raise ValueError("Pass `processing_class`: the model records no path to load its tokenizer from.")
            processing_class = AutoTokenizer.from_pretrained(src)
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token

        is_peft = hasattr(unwrap(model), "peft_config")
        if peft_config is not None:
            if is_peft:
                raise ValueError("`model` is already a PeftModel: do not pass `peft_config` too.")
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
            is_peft = True

        if args.trainable_layers is not None and not is_peft:
            freeze_lower_layers(model, args.trainable_layers)

        if isinstance(ref_model, str):
            ref_model = AutoModelForCausalLM.from_pretrained(ref_model)
        elif ref_model is None and args.ref_model is not None:
            ref_model = AutoModelForCausalLM.from_pretrained(args.ref_model)
        elif ref_model is None and not is_peft:
            ref_model = AutoModelForCausalLM.from_pretrained(model_path) if model_path else copy.deepcopy(model)
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        self.ref_model = ref_model
        self.adapter_name = unwrap(model).active_adapter if is_peft and ref_model is None else None
        if is_peft and ref_model is not None:
            self.adapter_name = None  # explicit reference model: adapters stay on, the PRM is the PEFT model

        self.beta = float(args.beta)
        self.loss_type = args.loss_type

        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        if eval_dataset is not None:
            if isinstance(eval_dataset, dict):
                eval_dataset = {
                    k: self._prepare_dataset(v, processing_class, args, f"eval[{k}]") for k, v in eval_dataset.items()
                }
            else:
                eval_dataset = self._prepare_dataset(eval_dataset, processing_class, args, "eval")

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
        group_ids = [keys.setdefault(_prompt_key(p), len(keys)) for p in dataset["prompt"]]
        dataset = dataset.add_column("group_id", group_ids)
        if "label" in cols:
            dataset = dataset.remove_columns("label").add_column("label", labels)

        def tok(row):
            return tokenize_prompt_completion(
                row["prompt"], row["completion"], tokenizer,
                max_length=args.max_length, max_prompt_length=args.max_prompt_length,
            )

        with args.main_process_first(desc=f"tokenizing {name} dataset"):
            dataset = dataset.map(tok, desc=f"Tokenizing {name} dataset")
        keep = ("prompt_ids", "completion_ids", "label", "group_id")
        return dataset.remove_columns([c for c in dataset.column_names if c not in keep])

    def _dataloader(self, dataset, batch_size: int, shuffle: bool) -> DataLoader:
        if self.args.group_by_prompt:
            sampler = PromptGroupBatchSampler(dataset["group_id"], batch_size, shuffle=shuffle, seed=self.args.seed)
            dl = DataLoader(
                dataset, batch_sampler=sampler, collate_fn=self.data_collator,
                num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
            )
        else:
            g = torch.Generator().manual_seed(self.args.seed)
            dl = DataLoader(
                dataset, batch_size=batch_size, shuffle=shuffle, generator=g, collate_fn=self.data_collator,
                drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers,
                pin_memory=self.args.dataloader_pin_memory,
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
            prm_logps, ref_logps, cmask, inputs["labels"],
            beta=self.beta, loss_type=self.loss_type, group_ids=inputs["group_ids"],
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
            m["pair_accuracy"].append(F.prm_pair_accuracy(
                rewards[pairable], labels[pairable], group_ids=group_ids[pairable], ties="half"))
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
            output_dir, state_dict=state_dict, is_main_process=self.args.should_save,
            safe_serialization=True,
        )
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


# ----------------------------------------------------------------------------------------------------------------
# Best-of-N
# ----------------------------------------------------------------------------------------------------------------
def best_of_n(
    prm: ImplicitPRM,
    prompts: Sequence[Any],
    candidates: Sequence[Sequence[Any]],
    *,
    aggregation: str = "min",
    with_reference: bool = True,
    delimiter: str | None = "\n\n",
    step_len: int | None = None,
    batch_size: int = 8,
) -> list[int]:
    """Index of the best candidate of each prompt under ``prm.score`` (Implicit PRM best-of-N).

    Args:
        prm: an :class:`ImplicitPRM` (anything with its ``score`` method).
        prompts: one prompt per problem (string or list of messages).
        candidates: ``candidates[i]`` is the list of completions for ``prompts[i]`` (any number, >= 1).
        aggregation / with_reference / delimiter / step_len / batch_size: passed to :meth:`ImplicitPRM.score`
            (``min`` over steps by default; ``with_reference=False`` scores ``beta * log pi_phi`` alone).

    Returns:
        ``len(prompts)`` indices: the argmax of each prompt's scores, the first one on ties (a NaN score never wins
        over a number).

    Raises:
        ValueError: ``prompts`` and ``candidates`` differ in length, or a prompt has no candidate.
    """
    if len(prompts) != len(candidates):
        raise ValueError(f"got {len(prompts)} prompts but {len(candidates)} candidate lists; pass one list per prompt.")
    flat_p, flat_c, sizes = [], [], []
    for i, (p, cands) in enumerate(zip(prompts, candidates)):
        if isinstance(cands, str) or len(cands) == 0:
            raise ValueError(f"candidates[{i}] must be a non-empty list of completions, got {cands!r}.")
        flat_p.extend([p] * len(cands))
        flat_c.extend(cands)
        sizes.append(len(cands))
    scores = prm.score(
        flat_p, flat_c, aggregation=aggregation, with_reference=with_reference, delimiter=delimiter,
        step_len=step_len, batch_size=batch_size,
    )
    out, start = [], 0
    for n in sizes:
        s = [float("-inf") if math.isnan(x) else float(x) for x in scores[start : start + n]]
        best = 0
        for j in range(1, n):
            if s[j] > s[best]:  # strict: the first maximum wins
                best = j
        out.append(best)
        start += n
    return out


# ----------------------------------------------------------------------------------------------------------------
# Sampling and the outcome-labelled dataset builder
# ----------------------------------------------------------------------------------------------------------------
def _render_prompt(prompt: Any, tokenizer) -> list[int]:
    """Token ids the policy continues: :func:`tokenize_prompt_completion`'s prompt ids (chat template for messages)."""
    return tokenize_prompt_completion(prompt, "", tokenizer)["prompt_ids"]


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Any],
    num_generations: int,
    *,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[list[str]], list[list[bool]]]:
    """Sample ``num_generations`` completions per prompt with a KV-cached loop that drops finished rows.

    Each prompt is prefilled once and its cache repeated ``num_generations`` times; rows that emit EOS (any of the
    model's and tokenizer's EOS ids) or reach ``max_new_tokens`` leave the batch at once, so the cost is the sum of
    the completion lengths, not ``batch x longest`` as with ``generate``. Sampling is ancestral at ``temperature``
    with nucleus ``top_p`` (no top-k), from a ``torch.Generator`` seeded with ``seed`` per batch, so the output is
    a deterministic function of (model, prompts, arguments) on one device. Prompts are tokenised like
    :func:`tokenize_prompt_completion` (chat template + generation prompt for a conversation).

    Args:
        model: a causal LM (eval mode is set for the call).
        tokenizer: its tokenizer.
        prompts: ``P`` prompts (strings or lists of messages).
        num_generations: ``K >= 1`` completions per prompt.
        max_new_tokens: completion budget in tokens (EOS included).
        temperature: ``> 0`` (use a small value for near-greedy decoding).
        top_p: nucleus mass in ``(0, 1]``.
        batch_size: rows decoded together (rounded to whole prompts, at least one prompt).
        seed: sampling seed.
        progress: print one line per batch.

    Returns:
        ``(texts, truncated)``: ``P`` lists of ``K`` decoded completions (special tokens skipped) and, for each, whether
        it stopped at ``max_new_tokens`` without EOS.

    Raises:
        ValueError: ``num_generations < 1``, ``temperature <= 0``, ``top_p`` outside ``(0, 1]`` or ``max_new_tokens < 1``.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    import time

    model = unwrap(model)
    device = next(model.parameters()).device
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    eos_t = torch.tensor(sorted(eos), device=device, dtype=torch.long)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    K = num_generations
    per_batch = max(1, batch_size // K)
    texts: list[list[str]] = [[] for _ in prompts]
    truncated: list[list[bool]] = [[] for _ in prompts]
    with eval_mode(model):
        for b0 in range(0, len(prompts), per_batch):
            t0 = time.perf_counter()
            chunk = list(range(b0, min(b0 + per_batch, len(prompts))))
            ids = [_render_prompt(prompts[i], tokenizer) for i in chunk]
            L = max(map(len, ids))
            input_ids = torch.full((len(ids), L), pad, dtype=torch.long)
            am = torch.zeros((len(ids), L), dtype=torch.long)
            for r, p in enumerate(ids):
                input_ids[r, L - len(p) :] = torch.tensor(p)
                am[r, L - len(p) :] = 1
            input_ids, am = input_ids.to(device), am.to(device)
            gen = torch.Generator(device=device).manual_seed(int(seed) + b0)
            out = model(
                input_ids=input_ids, attention_mask=am, position_ids=position_ids_from_mask(am), use_cache=True,
                logits_to_keep=1,
            )
            rows = torch.arange(len(chunk), device=device).repeat_interleave(K)
            cache = out.past_key_values
            cache.batch_select_indices(rows)
            logits = out.logits[:, -1].float()[rows]
            am = am[rows]
            owner = rows.tolist()  # chunk row of each active row
            slot = [k for _ in chunk for k in range(K)]
            tokens: dict[tuple[int, int], list[int]] = {(r, k): [] for r in range(len(chunk)) for k in range(K)}
            for step in range(max_new_tokens):
                probs = torch.softmax(logits / temperature, dim=-1)
                if top_p < 1.0:
                    sp, si = probs.sort(dim=-1, descending=True)
                    drop = sp.cumsum(-1) - sp > top_p  # keep the smallest prefix with mass >= top_p
                    sp = sp.masked_fill(drop, 0.0)
                    probs = torch.zeros_like(probs).scatter_(-1, si, sp)
                # inverse-CDF sampling (torch.multinomial is ~50x slower on CPU over a 50k vocabulary); right=True:
                # the first index whose cdf exceeds u, so a token of probability 0 is never drawn
                cdf = probs.cumsum(-1)
                u = torch.rand((cdf.size(0), 1), generator=gen, device=device) * cdf[:, -1:]
                nxt = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.size(-1) - 1)
                done = torch.isin(nxt, eos_t)
                for j, tok in enumerate(nxt.tolist()):
                    tokens[(owner[j], slot[j])].append(tok)
                if step == max_new_tokens - 1:
                    for j in range(len(owner)):
                        if not bool(done[j]):
                            truncated_key = (owner[j], slot[j])
                            tokens[truncated_key].append(-1)  # marker: stopped at the budget
                    break
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                if keep.numel() < len(owner):
                    cache.batch_select_indices(keep)
                    am, nxt = am[keep], nxt[keep]
                    kl = keep.tolist()
                    owner, slot = [owner[j] for j in kl], [slot[j] for j in kl]
                am = torch.cat([am, am.new_ones((am.size(0), 1))], dim=1)
                out = model(
                    input_ids=nxt[:, None], attention_mask=am, position_ids=(am.sum(-1, keepdim=True) - 1),
                    past_key_values=cache, use_cache=True,
                )
                cache = out.past_key_values
                logits = out.logits[:, -1].float()
            n_tok = 0
            for r, i in enumerate(chunk):
                for k in range(K):
                    seq = tokens[(r, k)]
                    cut = bool(seq) and seq[-1] == -1
                    seq = seq[:-1] if cut else seq
                    n_tok += len(seq)
                    texts[i].append(tokenizer.decode(seq, skip_special_tokens=True))
                    truncated[i].append(cut)
            if progress:
                print(
                    f"[sample] prompts {chunk[-1] + 1}/{len(prompts)}: {n_tok} tokens in "
                    f"{time.perf_counter() - t0:.1f}s", flush=True,
                )
    return texts, truncated


def _reasons_of(reward_func, rewards: list) -> list[str]:
    """Reason of each reward: the verifier's own (``last_results[i].reason``) when it exposes them, else by value.

    A routed reward (:func:`trl_prime.data.make_routed_reward`) that sent every row to the math verifier
    (``last_counts["math"] == len(rewards)``) reads the reasons of :data:`trl_prime.rewards.math_reward`'s last call.
    """
    results = None
    sources = [reward_func]
    counts = getattr(reward_func, "last_counts", None)
    if isinstance(counts, dict) and counts.get("math") == len(rewards):
        from trl_prime.rewards import math_reward

        sources.append(math_reward)
    for src in sources:
        res = getattr(src, "last_results", None)
        try:
            res = list(res) if res is not None else None
        except TypeError:
            res = None
        if res is not None and len(res) == len(rewards) and all(hasattr(r, "reason") for r in res):
            results = res
            break
    if results is not None:
        return [str(r.reason) for r in results]
    return [
        "unscored" if r is None or (isinstance(r, float) and math.isnan(r)) else ("correct" if r >= 1.0 else
                                                                                   ("wrong" if r <= 0 else "partial"))
        for r in rewards
    ]


def build_outcome_dataset(
    policy: str | nn.Module,
    prompts_dataset,
    *,
    reward_func=None,
    num_generations: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
    tokenizer=None,
    prompt_column: str = "prompt",
    progress: bool = False,
    return_stats: bool = False,
):
    """Roll out a policy on a prompt set and label each completion with a verifier: the PRM's training data.

    The first call of the two-call workflow (Implicit PRM arXiv 2412.01981, section 3: an implicit PRM is trained on
    outcome labels of the policy's own samples)::

        data = build_outcome_dataset("embedded:smollm2-135m-instruct", load_prompt_dataset("embedded:arithmetic"))
        ImplicitPRMTrainer(model=path, args=ImplicitPRMConfig(...), train_dataset=data).train()

    Args:
        policy: the sampling policy: a causal LM, or a path / Hub id / ``embedded:<key>``
            (:func:`trl_prime.models.resolve_model_path`).
        prompts_dataset: a ``datasets.Dataset`` (or list of dicts) with ``prompt_column`` (string or messages) and
            the columns the verifier needs (``solution`` for math; ``ability``/``data_source``/``tests`` for the
            routed :data:`trl_prime.data.outcome_reward`).
        reward_func: a TRL-style reward function ``f(prompts=, completions=, **columns) -> list[float | None]``
            (default: :data:`trl_prime.data.outcome_reward`, math or code by each row's ability). Rewards must lie
            in [0, 1]; ``None``/NaN (unscorable: bad gold, sandbox failure) rows are *dropped*, not zeroed, and
            counted in the stats.
        num_generations: ``K`` rollouts per prompt.
        max_new_tokens / temperature / top_p / batch_size / seed: sampling (:func:`sample_completions`).
        tokenizer: the policy's tokenizer (default: loaded from the policy's path).
        prompt_column: the prompt column of ``prompts_dataset``.
        progress: print sampling progress.
        return_stats: also return the statistics dict.

    Returns:
        A ``datasets.Dataset`` with one row per scorable completion: ``prompt`` (as given), ``completion`` (a string
        for a string prompt; ``[{"role": "assistant", "content": text}]`` for a conversational prompt, TRL's
        convention), ``label`` (float reward in [0, 1]), ``prompt_id`` (int, index of the prompt in
        ``prompts_dataset``; the ``id`` column's value is kept in ``source_id`` when present), ``reason`` (the
        verifier's reason: ``correct``, ``wrong``, ``no_answer``, ...) and ``truncated`` (bool, hit
        ``max_new_tokens``). With ``return_stats``: ``(dataset, stats)`` with ``n_prompts``, ``n_completions``,
        ``n_rows``, ``n_unscored`` (dropped), ``reasons`` (counts), ``mean_label``, ``n_truncated``,
        ``n_mixed_prompts`` (prompts with both a label > 0.5 and one < 0.5: the ones DPO/NCA can pair) and
        ``sampling_s``.

    Raises:
        ValueError: ``prompt_column`` is missing, a reward is outside [0, 1], or the verifier returns the wrong
            number of rewards.
    """
    import time

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(prompts_dataset, list):
        prompts_dataset = Dataset.from_list(prompts_dataset)
    cols = list(prompts_dataset.column_names)
    if prompt_column not in cols:
        raise ValueError(f"the prompts dataset has no column {prompt_column!r} (columns: {cols}).")
    if isinstance(policy, str):
        from trl_prime.models import resolve_model_path

        path = resolve_model_path(policy)
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    else:
        model = policy
        if tokenizer is None:
            src = getattr(unwrap(model).config, "_name_or_path", None)
            if not src:
                raise ValueError("Pass `tokenizer`: the policy records no path to load its tokenizer from.")
            tokenizer = AutoTokenizer.from_pretrained(src)
    if reward_func is None:
        from trl_prime.data import outcome_reward as reward_func

    prompts = list(prompts_dataset[prompt_column])
    t0 = time.perf_counter()
    texts, truncated = sample_completions(
        model, tokenizer, prompts, num_generations, max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, batch_size=batch_size, seed=seed, progress=progress,
    )
    sampling_s = time.perf_counter() - t0
    K = num_generations
    flat_prompts = [p for p in prompts for _ in range(K)]
    flat_completions = [
        c if isinstance(p, str) else [{"role": "assistant", "content": c}]
        for p, cs in zip(prompts, texts) for c in cs
    ]
    extra = {c: [v for v in prompts_dataset[c] for _ in range(K)] for c in cols if c != prompt_column}
    rewards = list(reward_func(prompts=flat_prompts, completions=flat_completions, **extra))
    if len(rewards) != len(flat_completions):
        raise ValueError(f"the reward function returned {len(rewards)} rewards for {len(flat_completions)} completions.")
    reasons = _reasons_of(reward_func, rewards)
    ids = list(prompts_dataset["id"]) if "id" in cols else None
    rows = {"prompt": [], "completion": [], "label": [], "prompt_id": [], "reason": [], "truncated": []}
    if ids is not None:
        rows["source_id"] = []
    n_unscored = 0
    counts: dict[str, int] = defaultdict(int)
    for j, (p, c, r, why) in enumerate(zip(flat_prompts, flat_completions, rewards, reasons)):
        counts[why] += 1
        if r is None or math.isnan(float(r)):
            n_unscored += 1
            continue
        r = float(r)
        if not -1e-9 <= r <= 1 + 1e-9:
            raise ValueError(f"reward {r!r} of completion {j} is outside [0, 1]; labels must be in [0, 1].")
        i = j // K
        rows["prompt"].append(p)
        rows["completion"].append(c)
        rows["label"].append(min(max(r, 0.0), 1.0))
        rows["prompt_id"].append(i)
        rows["reason"].append(why)
        rows["truncated"].append(bool(truncated[i][j % K]))
        if ids is not None:
            rows["source_id"].append(ids[i])
    dataset = Dataset.from_dict(rows)
    if not return_stats:
        return dataset
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for i, y in zip(rows["prompt_id"], rows["label"]):
        by_prompt[i].append(y)
    stats = {
        "n_prompts": len(prompts),
        "n_completions": len(flat_completions),
        "n_rows": len(dataset),
        "n_unscored": n_unscored,
        "reasons": dict(counts),
        "mean_label": (sum(rows["label"]) / len(rows["label"])) if rows["label"] else float("nan"),
        "n_truncated": sum(sum(t) for t in truncated),
        "n_mixed_prompts": sum(1 for ys in by_prompt.values() if max(ys) > 0.5 and min(ys) < 0.5),
        "sampling_s": round(sampling_s, 1),
    }
    return dataset, stats


def pairable_rows(dataset):
    """Keep only the rows of prompts that have both a label > 0.5 and a label < 0.5 (the ones DPO/NCA can pair).

    Args:
        dataset: a ``datasets.Dataset`` with ``prompt`` and ``label`` columns.

    Returns:
        The filtered dataset (row order kept). Prompts whose completions are all correct or all wrong contribute no
        (correct, incorrect) pair to ``dpo``/``nca`` but still cost a forward; dropping them saves that compute.
    """
    by_prompt: dict[str, set[bool]] = defaultdict(set)
    keys = [_prompt_key(p) for p in dataset["prompt"]]
    for k, y in zip(keys, dataset["label"]):
        if y > 0.5:
            by_prompt[k].add(True)
        elif y < 0.5:
            by_prompt[k].add(False)
    keep = [i for i, k in enumerate(keys) if len(by_prompt[k]) == 2]
    return dataset.select(keep)


def question_prompt(prompt: Any) -> str:
    """The content of the prompt's last user message as a plain string (no chat template, no system prompt).

    The shortest PRM prompt (``prm_prompt="question"`` in the recipes): a forward costs a few tokens of context.
    Train and score with the same choice.
    """
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"]
    return str((users or list(prompt))[-1]["content"])


def last_turn_prompt(prompt: Any) -> Any:
    """The prompt with earlier turns dropped: ``[system messages..., last user message]`` (a string stays as is).

    Few-shot prompts (earlier user/assistant turns) make every PRM forward longer without changing what is being
    judged; a recipe may train and score its PRM on this shorter prompt (``prm_prompt="last_turn"``). Train and score
    with the same choice.
    """
    if isinstance(prompt, str):
        return prompt
    msgs = list(prompt)
    users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
    if not users:
        return msgs
    return [m for m in msgs if m.get("role") == "system"] + [msgs[users[-1]]]


@torch.no_grad()
def _shared_prompt_logps(model: nn.Module, prompt_ids: list[int], completion_ids: list[list[int]], batch_size: int):
    """``(B, T)`` log-probs of several completions of ONE prompt, the prompt run once (its KV cache is shared).

    Numerically the same quantity as :func:`completion_logps` on ``prompt + completion`` rows (positions 0..P-1 for
    the prompt, P.. for the completion; right padding after a completion cannot change it: attention is causal).
    """
    from trl.trainer.utils import selective_log_softmax

    device = next(unwrap(model).parameters()).device
    p = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out = model(input_ids=p, use_cache=True)
    cache0, first = out.past_key_values, out.logits[:, -1].float().log_softmax(-1)
    P, T = len(prompt_ids), max(map(len, completion_ids))
    pad = 0
    res = torch.zeros((len(completion_ids), T), dtype=torch.float32)
    for b0 in range(0, len(completion_ids), batch_size):
        rows = completion_ids[b0 : b0 + batch_size]
        B, Tb = len(rows), max(map(len, rows))
        ids = torch.full((B, Tb), pad, dtype=torch.long, device=device)
        am = torch.zeros((B, P + Tb), dtype=torch.long, device=device)
        am[:, :P] = 1
        for i, c in enumerate(rows):
            ids[i, : len(c)] = torch.tensor(c, device=device)
            am[i, P : P + len(c)] = 1
        cache = copy.deepcopy(cache0)
        cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))
        pos = (P + torch.arange(Tb, device=device)).unsqueeze(0).expand(B, -1)
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True).logits
        lp = torch.empty((B, Tb), dtype=torch.float32, device=device)
        lp[:, 0] = first[0, ids[:, 0]]
        if Tb > 1:
            lp[:, 1:] = selective_log_softmax(logits[:, :-1].float(), ids[:, 1:])
        res[b0 : b0 + B, :Tb] = lp.cpu()
    return res


@torch.no_grad()
def score_candidates(
    prm: ImplicitPRM,
    prompt: Any,
    completions: Sequence[Any],
    *,
    aggregations: Sequence[str] = ("min", "mean", "sum", "last"),
    with_reference: Sequence[bool] = (True,),
    delimiter: str | None = "\n\n",
    step_len: int | None = None,
    batch_size: int = 16,
    same_weights: bool = False,
    ref_logps: torch.Tensor | None = None,
    return_logps: bool = False,
):
    """:meth:`ImplicitPRM.score` for many completions of one prompt and several aggregations at once.

    The prompt is run once per model (shared KV cache) and each model's log-probs are computed once for all
    ``aggregations`` x ``with_reference`` variants; the values equal :meth:`ImplicitPRM.score`'s (SPEC section 1:
    ``r_t = beta (log pi_phi - log pi_ref)``, step rewards summed between step ends, then ``min``/``mean``/``sum``/
    ``last``; without reference ``beta * log pi_phi``).

    Args:
        prm: the implicit PRM (its ``tokenizer`` is used; separate or adapter reference).
        prompt: one prompt (string or messages).
        completions: its ``N`` candidates (strings or ``[{"role": "assistant", "content": ...}]``).
        aggregations / with_reference: the variants to return.
        delimiter / step_len: step boundaries (see :meth:`ImplicitPRM.step_rewards`).
        batch_size: completions per forward.
        same_weights: ``pi_phi`` and ``pi_ref`` are known to hold the same weights (an untrained PRM): the reference
            forward is skipped and its log-probs are the PRM's (every reward exactly 0).
        ref_logps: precomputed ``(N, T')`` float reference log-probs of these completions (``T' >=`` the longest
            completion incl. EOS; e.g. the untrained PRM's ``return_logps`` output, when the reference is that
            checkpoint): the reference forward is skipped.
        return_logps: also return the ``(N, T)`` float32 log-probs of ``pi_phi`` and of ``pi_ref`` (None if unused).

    Returns:
        ``{"<aggregation>" (with reference) or "<aggregation>/noref": [N floats]}``; with ``return_logps``
        ``(scores, prm_logps, ref_logps)``.
    """
    from trl_prime.implicit_prm import _bon_step_ends, peft_adapter

    tok = prm.tokenizer
    rows = [tokenize_prompt_completion(prompt, c, tok) for c in completions]
    p_ids = rows[0]["prompt_ids"]
    c_ids = [r["completion_ids"] for r in rows]
    with prm.prm_context():
        lp = _shared_prompt_logps(prm.model, p_ids, c_ids, batch_size)
    ref = None
    if any(with_reference):
        if ref_logps is not None:
            ref = ref_logps[:, : lp.size(1)].float()
            if ref.shape != lp.shape:
                raise ValueError(f"ref_logps has shape {tuple(ref_logps.shape)}; expected ({lp.size(0)}, >= {lp.size(1)}).")
        elif same_weights:
            ref = lp
        elif prm.ref_model is not None:
            with eval_mode(prm.ref_model):
                ref = _shared_prompt_logps(prm.ref_model, p_ids, c_ids, batch_size)
        elif prm.adapter_name is not None:
            with eval_mode(prm.model), peft_adapter(prm.model, prm.ref_adapter_name):
                ref = _shared_prompt_logps(prm.model, p_ids, c_ids, batch_size)
        else:
            raise ValueError("score_candidates needs a reference model or a PEFT PRM (or with_reference=(False,)).")
    T = lp.size(1)
    mask = torch.zeros((len(c_ids), T), dtype=torch.long)
    cid = torch.full((len(c_ids), T), tok.pad_token_id if tok.pad_token_id is not None else 0, dtype=torch.long)
    for i, c in enumerate(c_ids):
        mask[i, : len(c)] = 1
        cid[i, : len(c)] = torch.tensor(c)
    ends = _bon_step_ends(cid, mask, tok, delimiter=delimiter, step_len=step_len)
    out: dict[str, list[float]] = {}
    for wr in with_reference:
        r = F.implicit_token_rewards(
            prm_logps=lp, ref_logps=ref if wr else torch.zeros_like(lp), mask=mask, beta=prm.beta,
        )
        values, smask = F.step_rewards(token_rewards=r, step_ends=ends)
        for how in aggregations:
            key = how if wr else f"{how}/noref"
            out[key] = [float(x) for x in F.aggregate_step_rewards(step_values=values, step_mask=smask, how=how)]
    return (out, lp, ref) if return_logps else out


def argmax_first(scores: Sequence[float]) -> int:
    """Index of the largest score, the first one on ties; NaN never wins over a number (best-of-N selection)."""
    best, bv = 0, None
    for j, x in enumerate(scores):
        v = float("-inf") if x is None or math.isnan(float(x)) else float(x)
        if bv is None or v > bv:
            best, bv = j, v
    return best
