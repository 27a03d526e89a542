"""Configuration of offline implicit PRM training (Implicit PRM arXiv 2412.01981 Sec. 3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import TrainingArguments

from trl_prime.functional import PAIRWISE_PRM_LOSSES, PRM_LOSSES, check_choice
from trl_prime.guards import DEFAULT_LR_SCHEDULER, check_scheduler_warmup


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
        default=1024,
        metadata={"help": "Maximum prompt + completion tokens (the completion is truncated). None: no limit."},
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
        metadata={
            "help": "Learning-rate schedule ('constant', as PRIME's PRM; transformers' default 'linear' decays "
            "to 0). With warmup_steps > 0 use 'constant_with_warmup'."
        },
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
        check_choice(self.loss_type, PRM_LOSSES, "loss_type")
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
        if self.loss_type in PAIRWISE_PRM_LOSSES and not self.group_by_prompt:
            raise ValueError(
                f"`loss_type`={self.loss_type!r} pairs completions of the same prompt: keep `group_by_prompt`=True."
            )
        check_scheduler_warmup(self)
        super().__post_init__()
