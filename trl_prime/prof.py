"""PROF: process-consistency filtering of GRPO / RLOO rollouts with a step PRM (PROF arXiv 2509.03403; SPEC section 4).

After outcome verification and before the advantages, each completion's reasoning steps are scored by a step PRM
(probabilities in [0, 1]), their mean is the completion's process *consistency* (penalised when it has fewer than
``prof_min_steps`` or more than ``prof_max_steps`` steps, signed by correctness), and ``m`` of the ``n`` completions of
each prompt are kept: ``k+`` correct and ``k-`` incorrect with ``k+ + k- = m`` maximising ``k+ * k-``, the most
consistent correct ones and the least consistent incorrect ones (``prof_mode="both"``) or random incorrect ones
(``"correct"``). Advantages are computed on the kept rows only; dropped rows get loss weight 0 (no gradient). The PRM
only ranks: it never enters the advantage.

Pieces (the algorithm is :func:`trl_prime.functional.prof_consistency_scores` / ``prof_select``; this is plumbing):

- :class:`ProfOptions`: the ``prof_*`` config fields, mixed into :class:`~trl_prime.PrimeRLOOConfig`,
  :class:`~trl_prime.PrimeGRPOConfig` and :class:`ProfGRPOConfig`.
- Step PRMs behind one interface (:class:`StepPRM`: ``step_scores(batch) -> (scores (B, S), step_mask (B, S))``):
  :class:`TokenClassificationStepPRM` (an external step PRM in the style of Qwen2.5-Math-PRM-7B) and
  :class:`ImplicitStepPRM` (the implicit PRM's step rewards squashed to [0, 1]; inside the PRIME trainers it reuses
  the online PRM's token rewards, so it needs no extra model or forward).
- :class:`ProfFilter`: step scores -> consistency -> selection over the global batch (identical on every process),
  and the ``prof/*`` metrics.
- :class:`ProfGRPOTrainer` / :class:`ProfGRPOConfig`: PROF on plain GRPO (outcome-only advantages on the kept rows).
  The PRIME trainers call :class:`ProfFilter` from ``PrimeMixin._prime_step`` when ``prof_mode != "off"``.
"""

from __future__ import annotations

import codecs
import copy
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from trl import GRPOConfig, GRPOTrainer

from trl_prime import functional as F
from trl_prime._guards import (
    DEFAULT_LR_SCHEDULER, GuardOptions, GuardsMixin, check_peft_config, check_sum_then_normalize,
)
from trl_prime._reference import prepare_frozen
from trl_prime._rollout import (
    DropZeroWeightRowsMixin, gather_padded, mask_loss_rows, outcome_rewards, replace_logged_advantages,
)
from trl_prime.implicit_prm import CONFIG_NAME as IMPLICIT_PRM_CONFIG_NAME
from trl_prime.implicit_prm import ImplicitPRM, eval_mode, position_ids_from_mask, unwrap

PROF_MODES = ("both", "correct", "off")
PROF_PENALTY_POSITIONS = ("reference", "paper")
PROF_ROUNDINGS = ("half_even", "half_up", "half_down")
PROF_CENTERS = ("none", "batch")
# loss aggregations normalised by the kept tokens of the whole generation batch (`num_items_in_batch`); TRL's "grpo",
# "sapo" and "dr_grpo" count the dropped rows, "bnpo" normalises each micro-batch by its own kept tokens
PROF_LOSS_TYPES = ("dapo", "cispo")
#: system message of Qwen2.5-Math-PRM-7B's model card (the released PROF code sends "...\\boxed{{}}." verbatim)
QWEN_PRM_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
#: steps scored per completion by an external PRM (the released code's max_steps)
PRM_MAX_SCORED_STEPS = 100


#: string options whose escape sequences are decoded (``--prof_step_delimiter '\\n\\n'`` on a command line)
PROF_ESCAPED_FIELDS = ("prof_step_delimiter", "prof_prm_separator")


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
def decode_escapes(value):
    """Decode backslash escape sequences (``'\\n'`` -> newline, ``'\\t'``, ``'\\u2029'``...) of a string holding a
    backslash; other strings (and non-strings) are returned unchanged. Non-ASCII characters survive."""
    if not isinstance(value, str) or "\\" not in value:
        return value
    try:
        return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{value!r}: invalid escape sequence ({e.reason}); write a literal backslash as '\\\\'."
        ) from e


def _looks_local(path: str) -> bool:
    """``path`` is meant as a local path, not a Hub id (``org/name``: one slash, no leading ``/``, ``.``, ``~``)."""
    seps = {os.sep, os.altsep} - {None}
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or any(s in path for s in seps - {"/"})


def check_prof_prm_path(prof_prm) -> None:
    """Raise a ValueError naming ``prof_prm`` when it is a local path that does not exist (checked before any model is
    loaded; a Hub id such as ``Qwen/Qwen2.5-Math-PRM-7B`` is not checked here)."""
    if not isinstance(prof_prm, str) or prof_prm == "implicit" or not _looks_local(prof_prm):
        return
    if not os.path.exists(os.path.expanduser(prof_prm)):
        raise ValueError(
            f"`prof_prm`={prof_prm!r} looks like a local path but does not exist: give an existing folder (a "
            "token-classification step PRM, or one saved by ImplicitPRM.save_pretrained), a Hub id such as "
            "'Qwen/Qwen2.5-Math-PRM-7B', or 'implicit' (PRIME trainers)."
        )


@dataclass
class ProfOptions:
    """The PROF options (SPEC section 4), shared by every trainer that can filter with PROF.

    ``prof_mode="off"`` (default here; :class:`ProfGRPOConfig` defaults to ``"both"``) leaves the trainer unchanged.
    Defaults otherwise are the paper's: keep ``m = n/2`` (``n=8, m=4``), penalty ``lambda=10`` outside 2..30 steps,
    steps split at ``"\\n\\n"``, consistency = the mean step score (not centred), ties broken by banker's rounding as
    the released code.
    """

    prof_mode: str = field(
        default="off",
        metadata={
            "help": "PROF filter: 'both' (keep the most consistent correct and the least consistent incorrect "
            "completions), 'correct' (PROF-POS: rank the correct ones, pick the incorrect ones at random) or 'off'."
        },
    )
    prof_num_keep: int | None = field(
        default=None,
        metadata={"help": "m, completions kept per prompt (2..num_generations: a single kept row has no GRPO "
                          "baseline, so its advantage would be 0). Default: num_generations // 2."},
    )
    prof_num_remove: int | None = field(
        default=None,
        metadata={"help": "n - m, completions dropped per prompt (alternative to prof_num_keep; not both)."},
    )
    prof_penalty: float = field(
        default=10.0, metadata={"help": "lambda, subtracted from the consistency outside the allowed step range."}
    )
    prof_min_steps: int = field(default=2, metadata={"help": "Fewer steps than this are penalised (paper: 2)."})
    prof_max_steps: int = field(default=30, metadata={"help": "More steps than this are penalised (paper: 30)."})
    prof_penalty_position: str = field(
        default="reference",
        metadata={
            "help": "Where the step-count penalty enters the critic: 'reference' (released code) and 'paper' (PROF "
            "Eq. (1), arXiv v2) both give critic = sign*c - lambda*pen, so a completion with too few or too many "
            "steps is dropped first from its class, correct or incorrect (functional.prof_select). The v1 preprint's "
            "sign*(c - lambda*pen), which kept such incorrect completions first, is not offered."
        },
    )
    prof_rounding: str = field(
        default="half_even",
        metadata={
            "help": "Rounding of the number of correct rows removed per prompt, r+ = round((n+ - n- + r)/2) with "
            "r = n - m removed; it only matters when that is x.5 (odd m with both classes large enough: two equally "
            "balanced (k+, k-) splits). 'half_up' rounds x.5 up: one more correct row removed, i.e. k+ = floor(m/2) "
            "correct and ceil(m/2) incorrect kept. 'half_down' rounds x.5 down: k+ = ceil(m/2), one more correct row "
            "kept. 'half_even' (default, the released code's Python round) rounds x.5 to the even integer, so it "
            "matches half_up or half_down depending on the counts (e.g. n=8, m=3: 5 correct/3 incorrect -> 1 correct "
            "kept; 4/4 -> 2 correct kept)."
        },
    )
    prof_prm: str | None = field(
        default="implicit",
        metadata={
            "help": "Step PRM: 'implicit' (the PRIME trainers' online implicit PRM: no extra model), a folder saved by "
            "ImplicitPRM.save_pretrained (a frozen implicit PRM), or the path / Hub id of a token-classification step "
            "PRM such as Qwen/Qwen2.5-Math-PRM-7B (probability of label 1 at each step separator)."
        },
    )
    prof_center: str = field(
        default="none",
        metadata={"help": "Consistency: 'none' (paper: mean step score) or 'batch' (released: 2*(mean - batch mean))."},
    )
    prof_correct_threshold: float = field(
        default=1.0, metadata={"help": "A completion is correct when its outcome reward is >= this."}
    )
    prof_step_delimiter: str = field(
        default="\n\n",
        metadata={"help": "Delimiter of reasoning steps. Escape sequences are decoded, so '\\n\\n' typed on the "
                          "command line means two newlines."},
    )
    prof_implicit_temperature: float = field(
        default=1.0,
        metadata={"help": "Implicit PRM step scores: sigmoid(step reward / temperature) (> 0; monotone, keeps ranks)."},
    )
    prof_prm_separator: str = field(
        default="<extra_0>",
        metadata={"help": "External PRM: the step-separator token placed after every step (escape sequences are "
                          "decoded)."},
    )
    prof_prm_system_prompt: str | None = field(
        default=QWEN_PRM_SYSTEM_PROMPT,
        metadata={"help": "External PRM: system message (None: no system message); removed from the user text."},
    )
    prof_prm_max_length: int = field(
        default=4096,
        metadata={"help": "External PRM: max tokens per input. A completion whose trailing steps are cut off by right "
                          "truncation still counts all its steps (H) but is unscored: its consistency is NaN, the "
                          "least consistent of its class (logged as prof/prm_truncated_fraction)."},
    )
    prof_prm_micro_batch_size: int | None = field(
        default=None, metadata={"help": "External PRM: rows per forward. Default: per_device_train_batch_size."}
    )

    def prof_keep_count(self) -> int:
        """``m``, the number of completions kept per prompt."""
        K = self.num_generations
        if self.prof_num_keep is not None:
            return self.prof_num_keep
        if self.prof_num_remove is not None:
            return K - self.prof_num_remove
        return max(1, K // 2)

    def _validate_prof(self) -> None:
        for name in PROF_ESCAPED_FIELDS:  # '\\n\\n' from a command line -> two newlines
            setattr(self, name, decode_escapes(getattr(self, name)))

        def one_of(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}`={getattr(self, name)!r} is not supported; choose one of {list(allowed)}.")

        one_of("prof_mode", PROF_MODES)
        one_of("prof_penalty_position", PROF_PENALTY_POSITIONS)
        one_of("prof_rounding", PROF_ROUNDINGS)
        one_of("prof_center", PROF_CENTERS)
        if self.prof_num_keep is not None and self.prof_num_remove is not None:
            raise ValueError("Set `prof_num_keep` (m) or `prof_num_remove` (n - m), not both.")
        K = self.num_generations
        for name in ("prof_num_keep", "prof_num_remove", "prof_min_steps", "prof_max_steps"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"`{name}`={v!r} must be a non-negative int.")
        if self.prof_min_steps > self.prof_max_steps:
            raise ValueError(f"`prof_min_steps`={self.prof_min_steps} > `prof_max_steps`={self.prof_max_steps}.")
        if not self.prof_penalty >= 0:
            raise ValueError(f"`prof_penalty`={self.prof_penalty} must be >= 0 (paper: 10).")
        if not self.prof_implicit_temperature > 0:
            raise ValueError(f"`prof_implicit_temperature`={self.prof_implicit_temperature} must be > 0.")
        if not self.prof_step_delimiter:
            raise ValueError("`prof_step_delimiter` must be a non-empty string (paper: '\\n\\n').")
        if self.prof_prm_max_length < 1:
            raise ValueError(f"`prof_prm_max_length`={self.prof_prm_max_length} must be >= 1.")
        if self.prof_prm_micro_batch_size is not None and self.prof_prm_micro_batch_size < 1:
            raise ValueError(f"`prof_prm_micro_batch_size`={self.prof_prm_micro_batch_size} must be >= 1 (or None).")
        if self.prof_mode == "off":
            return
        if K is not None and self.prof_num_keep is not None and not 1 <= self.prof_num_keep <= K:
            raise ValueError(
                f"`prof_num_keep`={self.prof_num_keep} must lie in [1, num_generations={K}] (paper: n=8, m=4)."
            )
        if K is not None and self.prof_num_remove is not None and not 0 <= self.prof_num_remove < K:
            raise ValueError(
                f"`prof_num_remove`={self.prof_num_remove} must lie in [0, num_generations={K}) (paper: n=8, remove 4)."
            )
        if K is not None and self.prof_keep_count() < 2:
            if self.prof_num_keep is not None:
                why, fix = f"`prof_num_keep`={self.prof_num_keep}", "set prof_num_keep >= 2"
            elif self.prof_num_remove is not None:
                why, fix = (f"`prof_num_remove`={self.prof_num_remove} with num_generations={K}",
                            f"set prof_num_remove <= {K - 2}")
            else:
                why, fix = (f"the default m = num_generations // 2 with `num_generations`={K}",
                            "set num_generations >= 4 (or prof_num_keep=2 with num_generations >= 2)")
            raise ValueError(
                f"PROF would keep one completion per prompt ({why}): a group of one row has no GRPO baseline, so "
                f"every kept row would get advantage 0 and the policy would learn nothing. {fix[0].upper() + fix[1:]} "
                "(paper: n=8, m=4)."
            )
        if not self.prof_prm:
            raise ValueError(
                "`prof_prm` is empty: set it to 'implicit' (PRIME trainers), an ImplicitPRM folder, or a step PRM path "
                "such as 'Qwen/Qwen2.5-Math-PRM-7B'."
            )
        check_prof_prm_path(self.prof_prm)
        loss_type = getattr(self, "loss_type", None)
        if loss_type is not None and loss_type not in PROF_LOSS_TYPES:
            raise ValueError(
                f"`loss_type`={loss_type!r} does not normalise by the kept tokens of the batch (it averages per "
                "completion, per micro-batch or by a constant), so the rows PROF drops would still scale the update. "
                f"With PROF use {list(PROF_LOSS_TYPES)} ('dapo', the default, is the paper's token mean)."
            )


@dataclass
class ProfGRPOConfig(GuardOptions, ProfOptions, GRPOConfig):
    """Configuration of :class:`ProfGRPOTrainer`: TRL's ``GRPOConfig`` plus the PROF options.

    PROF defaults here: ``prof_mode="both"``, ``num_generations`` 8 with ``m = 4`` kept, the step PRM
    ``Qwen/Qwen2.5-Math-PRM-7B`` (``prof_prm``; a token-classification PRM path, or a saved ImplicitPRM folder), and a
    constant policy learning rate (``lr_scheduler_type`` ``"constant"``; TRL's default ``"linear"`` decays it to 0).
    The paper also uses KL 0.001 (``beta``), entropy 0.001 (``entropy_coef``), temperature 1.0 and lr 1e-6 (set them).

    Raises:
        ValueError: an invalid PROF option (the message names the field and the fix).
    """

    prof_mode: str = field(default="both", metadata={"help": "'both' (PROF-BOTH), 'correct' (PROF-POS) or 'off'."})
    prof_prm: str | None = field(
        default="Qwen/Qwen2.5-Math-PRM-7B",
        metadata={"help": "Step PRM: a token-classification PRM path / Hub id, or a folder saved by ImplicitPRM."},
    )
    num_generations: int | None = field(default=8, metadata={"help": "Completions per prompt n (PROF: 8)."})
    lr_scheduler_type: str = field(
        default=DEFAULT_LR_SCHEDULER,
        metadata={"help": "Policy learning-rate schedule ('constant': PROF Appendix A.1 states no schedule; TRL's "
                          "default 'linear' decays to 0). With warmup_steps > 0 use 'constant_with_warmup'."},
    )

    def __post_init__(self):
        self._validate_prof()
        self._validate_guards()
        super().__post_init__()
        if self.prof_mode != "off" and self.prof_prm == "implicit":
            raise ValueError(
                "`prof_prm`='implicit' needs an online implicit PRM: use PrimeGRPOTrainer / PrimeRLOOTrainer, or give a "
                "folder saved by ImplicitPRM.save_pretrained (a frozen implicit PRM) or a token-classification PRM."
            )
        if self.scale_rewards not in ("group", "none"):
            raise ValueError(
                f"`scale_rewards`={self.scale_rewards!r}: PROF computes GRPO advantages within each prompt's kept rows; "
                "use 'group' or 'none'."
            )
        check_sum_then_normalize(self, "PROF splits correct/incorrect on the weighted sum of the rewards")


# ----------------------------------------------------------------------------------------------------------------
# Step PRMs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class StepBatch:
    """The local completions a step PRM scores (one row per completion, TRL's layout).

    ``prompts``/``completions`` are TRL's (strings or conversations); ``completion_ids``/``completion_mask`` ``(B, T)``
    right-padded; ``input_ids``/``attention_mask`` ``(B, P+T)`` prompt + completion; ``token_rewards`` ``(B, T)``
    implicit-PRM token rewards when the trainer already has them (PRIME).
    """

    prompts: Sequence[Any]
    completions: Sequence[Any]
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None


@runtime_checkable
class StepPRM(Protocol):
    """A step PRM: ``step_scores(batch) -> (scores (B, S) in [0, 1], step_mask (B, S) bool)``, one row per completion,
    steps left to right. A NaN score at a valid step marks a step the PRM could not score (its input was truncated):
    :class:`ProfFilter` then gives the row a NaN consistency. Implementations: :class:`TokenClassificationStepPRM`,
    :class:`ImplicitStepPRM`."""

    def step_scores(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


def _text(x: Any) -> str:
    """Text of a completion / message content (a string, a conversation, or a list of content parts)."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return _text(x.get("content", x.get("text", "")))
    if isinstance(x, (list, tuple)):
        if x and isinstance(x[0], dict) and "role" in x[0]:  # a conversation: the last message
            return _text(x[-1])
        return "".join(_text(p) for p in x if not isinstance(p, dict) or p.get("type", "text") == "text")
    return "" if x is None else str(x)


def _question(prompt: Any) -> str:
    """The question of a TRL prompt: the string itself, or the last user message of a conversation."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        users = [m for m in prompt if m.get("role") == "user"]
        return _text(users[-1] if users else prompt[-1])
    return _text(prompt)


class TokenClassificationStepPRM:
    """An external step PRM in the style of Qwen2.5-Math-PRM-7B (SPEC section 4; PROF's released scoring).

    Each completion is split into steps at ``delimiter`` (:func:`trl_prime.functional.split_steps`: stripped, empty
    steps dropped), the steps are joined with ``separator`` after every step (:func:`~trl_prime.functional.join_steps`),
    put in a conversation ``[system?, user: question, assistant: steps]`` rendered with the PRM's chat template, and
    tokenized (left padding, right truncation at ``max_length``). The model runs with the attention mask (and position
    ids from it); the score of step k is ``softmax(logits)[label positive_label]`` at the k-th separator token
    (:func:`~trl_prime.functional.prof_step_scores_from_logits`), at most :data:`PRM_MAX_SCORED_STEPS` steps.

    Truncation: a row's steps (``step_mask``) are the steps of its text (``split_steps``, capped at
    :data:`PRM_MAX_SCORED_STEPS`), not the separators left after truncation, so the step-count penalty sees the true
    number of steps. A step whose separator was cut off is *unscored*: its score is NaN (with ``step_mask`` true).
    :class:`ProfFilter` gives a row with an unscored step a NaN consistency (its mean would cover only the leading
    steps), which ``functional.prof_select`` ranks as the least consistent of its class; ``prof/prm_truncated_fraction``
    logs how often that happens (raise ``max_length`` when it is not ~0).

    Args:
        model: a token-classification model (``logits`` ``(B, L, C)``), e.g. ``AutoModelForTokenClassification`` or
            Qwen2.5-Math-PRM-7B's remote-code model. Used frozen (eval mode, no grad); may be a DeepSpeed engine.
        tokenizer: the PRM's tokenizer (with a chat template and the ``separator`` as one token).
        separator, delimiter, system_prompt, max_length: see :class:`ProfOptions` (``prof_prm_*``).
        micro_batch_size: rows per forward (``None``: all at once).
        positive_label: class index of "step is correct" (1 for Qwen2.5-Math-PRM).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        separator: str = "<extra_0>",
        delimiter: str = "\n\n",
        system_prompt: str | None = QWEN_PRM_SYSTEM_PROMPT,
        max_length: int = 4096,
        micro_batch_size: int | None = None,
        positive_label: int = 1,
    ):
        sep_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
        if len(sep_ids) != 1:
            raise ValueError(
                f"The step separator {separator!r} is {len(sep_ids)} tokens for this PRM's tokenizer; it must be one "
                "token (Qwen2.5-Math-PRM uses '<extra_0>'). Set `prof_prm_separator` to the PRM's separator token."
            )
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("The PRM's tokenizer has no chat template: the step PRM scores a rendered conversation.")
        self.model = model
        self.tokenizer = copy.copy(tokenizer)  # own padding / truncation sides, shared vocabulary
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.separator = separator
        self.separator_id = sep_ids[0]
        self.delimiter = delimiter
        self.system_prompt = system_prompt
        self.max_length = max_length
        self.micro_batch_size = micro_batch_size
        self.positive_label = positive_label

    def conversations(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[list[dict[str, str]]]:
        """The PRM's input conversation of each completion."""
        out = []
        for prompt, completion in zip(prompts, completions):
            question = _question(prompt)
            if self.system_prompt:
                question = question.replace(self.system_prompt, "")
            steps = F.split_steps(_text(completion), delimiter=self.delimiter)
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages += [
                {"role": "user", "content": question.strip()},
                {"role": "assistant", "content": F.join_steps(steps, separator=self.separator)},
            ]
            out.append(messages)
        return out

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The PRM's input texts (chat template applied, not tokenized)."""
        return [
            self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=False)
            for m in self.conversations(prompts, completions)
        ]

    @torch.no_grad()
    def step_scores(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        device = batch.completion_ids.device
        texts = self.texts(batch.prompts, batch.completions)
        B = len(texts)
        S = PRM_MAX_SCORED_STEPS
        num_steps = torch.tensor(  # the true number of steps (a truncated input holds fewer separators)
            [min(len(F.split_steps(_text(c), delimiter=self.delimiter)), S) for c in batch.completions],
            dtype=torch.long, device=device,
        )
        scores = torch.zeros(B, S, dtype=torch.float32, device=device)
        smask = torch.zeros(B, S, dtype=torch.bool, device=device)
        mb = self.micro_batch_size or max(B, 1)
        with eval_mode(self.model):
            for start in range(0, B, mb):
                enc = self.tokenizer(
                    texts[start : start + mb], return_tensors="pt", padding=True, truncation=True,
                    max_length=self.max_length, add_special_tokens=False,
                ).to(device)
                ids, am = enc["input_ids"], enc["attention_mask"]
                out = self.model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am))
                logits = out.logits if hasattr(out, "logits") else out[0]
                sep = (ids == self.separator_id) & am.bool()
                s, m = F.prof_step_scores_from_logits(logits.float(), sep, S, positive_label=self.positive_label)
                scores[start : start + mb], smask[start : start + mb] = s, m
        steps = torch.arange(S, device=device) < num_steps[:, None]
        unscored = steps & ~smask  # separators cut off by right truncation
        scores = torch.where(unscored, torch.full_like(scores, float("nan")), scores)
        width = int(num_steps.max().item()) if B else 0
        return scores[:, :width], steps[:, :width]


class ImplicitStepPRM:
    """The implicit PRM as PROF's step PRM (SPEC section 4): step rewards mapped to [0, 1] with a sigmoid.

    Steps end at ``delimiter`` in the decoded completion (:func:`trl_prime.functional.step_end_mask`, robust to how
    the tokenizer merges it) and at the last token; a step's reward is the sum of its token rewards
    (:func:`~trl_prime.functional.step_rewards`); its score ``sigmoid(reward / temperature)``
    (:func:`~trl_prime.functional.prof_step_scores_from_implicit`).

    Args:
        tokenizer: decodes the completion ids (the policy's tokenizer).
        implicit_prm: an :class:`~trl_prime.ImplicitPRM` computing the token rewards; ``None`` when the batch carries
            them (``StepBatch.token_rewards``, the PRIME trainers' online PRM).
        delimiter, temperature: see :class:`ProfOptions` (``prof_step_delimiter``, ``prof_implicit_temperature``).
    """

    def __init__(self, tokenizer, implicit_prm: ImplicitPRM | None = None, *, delimiter: str = "\n\n",
                 temperature: float = 1.0):
        self.tokenizer = tokenizer
        self.implicit_prm = implicit_prm
        self.delimiter = delimiter
        self.temperature = temperature

    @torch.no_grad()
    def step_scores(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.completion_mask
        rewards = batch.token_rewards
        if rewards is None:
            if self.implicit_prm is None:
                raise ValueError("ImplicitStepPRM needs token rewards in the batch or an `implicit_prm` to compute them.")
            rewards = self.implicit_prm.token_rewards(batch.input_ids, batch.attention_mask, mask)
        ends = F.step_end_mask(
            batch.completion_ids, mask, self.tokenizer, split="double_newline", delimiter=self.delimiter
        )
        values, smask = F.step_rewards(rewards.float() * mask.float(), ends)
        return F.prof_step_scores_from_implicit(values, smask, temperature=self.temperature), smask


def load_step_prm(path: str, args, tokenizer=None) -> StepPRM:
    """Build the step PRM named by ``path`` (``prof_prm``) for a trainer's ``args``.

    A folder holding ``implicit_prm_config.json`` (written by :meth:`ImplicitPRM.save_pretrained`) is a frozen implicit
    PRM (:class:`ImplicitStepPRM`); anything else is a token-classification step PRM (:class:`TokenClassificationStepPRM`)
    loaded with ``AutoModelForTokenClassification``, or with ``AutoModel`` when its config maps only that class to
    remote code (Qwen2.5-Math-PRM-7B; needs ``trust_remote_code=True``).
    """
    from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification, AutoTokenizer

    dtype = (args.model_init_kwargs or {}).get("dtype", "float32")  # the policy's dtype; nothing else of its kwargs
    if isinstance(dtype, str) and dtype in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, dtype)
    kwargs = {"dtype": dtype}
    trust = bool(args.trust_remote_code)
    if os.path.isfile(os.path.join(path, IMPLICIT_PRM_CONFIG_NAME)):
        prm = ImplicitPRM.from_pretrained(path, tokenizer=tokenizer, **kwargs)
        return ImplicitStepPRM(
            tokenizer, prm, delimiter=args.prof_step_delimiter, temperature=args.prof_implicit_temperature
        )
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    auto_map = getattr(cfg, "auto_map", None) or {}
    if "AutoModel" in auto_map and "AutoModelForTokenClassification" not in auto_map:
        if not trust:
            raise ValueError(
                f"The step PRM {path!r} is remote code (e.g. Qwen2.5-Math-PRM-7B's Qwen2ForProcessRewardModel): set "
                "`trust_remote_code=True` in the config to load it."
            )
        model = AutoModel.from_pretrained(path, trust_remote_code=True, **kwargs)
    else:
        model = AutoModelForTokenClassification.from_pretrained(path, trust_remote_code=trust, **kwargs)
    prm_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    return TokenClassificationStepPRM(
        model, prm_tokenizer, separator=args.prof_prm_separator, delimiter=args.prof_step_delimiter,
        system_prompt=args.prof_prm_system_prompt, max_length=args.prof_prm_max_length,
        micro_batch_size=args.prof_prm_micro_batch_size or args.per_device_train_batch_size,
    )


# ----------------------------------------------------------------------------------------------------------------
# The filter
# ----------------------------------------------------------------------------------------------------------------
class ProfFilter:
    """PROF selection over a generation batch: step scores -> consistency -> keep ``m`` of ``n`` per prompt.

    Args:
        prm: the step PRM (:class:`StepPRM`).
        num_keep: ``m``, completions kept per prompt. A prompt with ``m`` or fewer eligible completions keeps them all.
        mode, penalty, min_steps, max_steps, penalty_position, rounding, center, correct_threshold: see
            :class:`ProfOptions` (``prof_*``).
        seed: seed of ``mode="correct"``'s random choice (combined with the step, so every process and a resumed run
            draw the same rows).

    :meth:`select` is the pure selection over global tensors; :meth:`__call__` runs the whole step inside a trainer
    (scores the local rows, gathers them, selects identically on every process, logs the ``prof/*`` metrics).
    ``last`` holds the tensors of the latest call (global; for callbacks, tests and debugging).
    """

    def __init__(
        self,
        prm: StepPRM,
        *,
        num_keep: int,
        mode: str = "both",
        penalty: float = 10.0,
        min_steps: int = 2,
        max_steps: int = 30,
        penalty_position: str = "reference",
        rounding: str = "half_even",
        center: str = "none",
        correct_threshold: float = 1.0,
        seed: int = 0,
    ):
        if mode not in ("both", "correct"):
            raise ValueError(f"ProfFilter mode={mode!r}: choose 'both' or 'correct' (no filter: build none).")
        if isinstance(num_keep, bool) or not isinstance(num_keep, int) or num_keep < 1:
            raise ValueError(f"num_keep={num_keep!r} must be a positive int (m, completions kept per prompt).")
        self.prm = prm
        self.num_keep = num_keep
        self.mode = mode
        self.penalty = penalty
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.penalty_position = penalty_position
        self.rounding = rounding
        self.center = center
        self.correct_threshold = correct_threshold
        self.seed = seed
        self.last: dict[str, Any] = {}
        self._warned_truncation = False

    @classmethod
    def from_trainer(cls, trainer, prm: StepPRM | ImplicitPRM | str | None = None) -> ProfFilter | None:
        """The filter a trainer's ``args`` ask for (``None`` when ``prof_mode="off"``).

        ``prm`` overrides ``args.prof_prm``: a :class:`StepPRM`, an :class:`~trl_prime.ImplicitPRM` (frozen), or a
        path. ``"implicit"`` uses the trainer's online implicit PRM (``trainer.implicit_prm``: PRIME trainers only).
        """
        args = trainer.args
        if args.prof_mode == "off":
            return None
        source = args.prof_prm if prm is None else prm
        tokenizer = trainer._tokenizer
        step_kw = dict(delimiter=args.prof_step_delimiter, temperature=args.prof_implicit_temperature)
        if isinstance(source, str) and source == "implicit":
            if getattr(trainer, "implicit_prm", None) is None:
                raise ValueError(
                    f"`prof_prm`='implicit' needs the trainer's online implicit PRM ({type(trainer).__name__} has "
                    "none): use PrimeGRPOTrainer / PrimeRLOOTrainer, or set prof_prm to a step PRM."
                )
            step_prm = ImplicitStepPRM(tokenizer, None, **step_kw)  # token rewards come from the PRIME step
        elif isinstance(source, ImplicitPRM):
            step_prm = ImplicitStepPRM(tokenizer, source, **step_kw)
        elif isinstance(source, str):
            check_prof_prm_path(source)
            try:
                step_prm = load_step_prm(source, args, tokenizer=tokenizer)
            except Exception as e:  # the Hub client's / transformers' message alone does not say which option failed
                raise ValueError(
                    f"`prof_prm`={source!r} could not be loaded as a step PRM ({type(e).__name__}: {e}). Set "
                    "`prof_prm` to an existing local folder (a token-classification step PRM, or one saved by "
                    "ImplicitPRM.save_pretrained) or a reachable Hub id such as 'Qwen/Qwen2.5-Math-PRM-7B'."
                ) from e
        elif isinstance(source, StepPRM):
            step_prm = source
        else:
            raise TypeError(f"prof_prm must be 'implicit', a path, an ImplicitPRM or a StepPRM; got {type(source)}.")
        # the PRM only ranks: frozen (no grad, eval) and placed like the reference model, whether loaded from a path or
        # passed in memory (a TokenClassificationStepPRM / ImplicitStepPRM / ImplicitPRM object)
        if isinstance(step_prm, TokenClassificationStepPRM) and isinstance(step_prm.model, nn.Module):
            step_prm.model = prepare_frozen(step_prm.model, trainer)
        if isinstance(step_prm, ImplicitStepPRM) and step_prm.implicit_prm is not None:
            ip = step_prm.implicit_prm
            if unwrap(ip.model) is unwrap(trainer.model):
                raise ValueError(
                    "`prof_prm`: the ImplicitPRM shares the policy's model (e.g. a PEFT adapter on it); PROF here "
                    "needs a frozen, separate implicit PRM (or use PrimeGRPOTrainer with prof_prm='implicit')."
                )
            ip.model = prepare_frozen(ip.model, trainer)
            if ip.ref_model is not None:
                ip.ref_model = prepare_frozen(ip.ref_model, trainer)
        return cls(
            step_prm, num_keep=args.prof_keep_count(), mode=args.prof_mode, penalty=args.prof_penalty,
            min_steps=args.prof_min_steps, max_steps=args.prof_max_steps,
            penalty_position=args.prof_penalty_position, rounding=args.prof_rounding, center=args.prof_center,
            correct_threshold=args.prof_correct_threshold, seed=args.seed,
        )

    # --------------------------------------------------------------------------------------------------------
    def select(
        self,
        group_ids: torch.Tensor,
        step_scores: torch.Tensor,
        step_mask: torch.Tensor,
        outcome_rewards: torch.Tensor,
        *,
        step: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Pure selection over a whole (global) batch; rows with a NaN outcome are never kept.

        A NaN step score at a valid step is an unscored step (the external PRM's input was truncated before its
        separator): the step counts in ``num_steps`` (the step-count penalty), and the row's consistency is NaN, which
        ``functional.prof_select`` ranks as the least consistent of its class (removed first among correct rows and
        among incorrect rows alike), as a mean over the leading steps only would be biased.

        Returns a dict: ``kept`` ``(B,)`` bool, ``consistency`` ``(B,)`` (unsigned; NaN on truncated rows),
        ``num_steps`` ``(B,)``, ``correct`` ``(B,)`` bool, ``eligible`` ``(B,)`` bool (non-NaN outcome),
        ``truncated`` ``(B,)`` bool (rows with an unscored step).
        """
        step_mask = step_mask.bool()
        unscored = step_mask & torch.isnan(step_scores)
        truncated = unscored.any(-1)
        c, _ = F.prof_consistency_scores(
            torch.where(unscored, torch.zeros_like(step_scores), step_scores), step_mask & ~unscored, center=self.center
        )
        H = step_mask.sum(-1)
        c = torch.where(truncated, torch.full_like(c, float("nan")), c)
        gen = None
        if self.mode == "correct":
            gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(step))
        idx = F.prof_select(
            group_ids, c, H, outcome_rewards, num_keep=self.num_keep, penalty=self.penalty, min_steps=self.min_steps,
            max_steps=self.max_steps, penalty_position=self.penalty_position, mode=self.mode,
            rounding=self.rounding, generator=gen, correct_threshold=self.correct_threshold,
        )
        kept = torch.zeros_like(outcome_rewards, dtype=torch.bool)
        kept[idx] = True
        eligible = ~torch.isnan(outcome_rewards)
        correct = eligible & (outcome_rewards >= self.correct_threshold)
        return {"kept": kept, "consistency": c, "num_steps": H, "correct": correct, "eligible": eligible,
                "truncated": truncated}

    @staticmethod
    def metrics(sel: dict[str, torch.Tensor]) -> dict[str, float]:
        """The ``prof/*`` metrics of a selection (global batch).

        ``kept_fraction``: kept / generated completions; ``kept_correct`` / ``kept_incorrect``: counts of kept correct /
        incorrect completions; ``consistency_kept_mean`` / ``consistency_dropped_mean``: mean unsigned consistency of
        the kept / dropped eligible completions; ``dropped_correct_fraction``: the fraction of the eligible correct
        completions that were dropped; ``num_steps_mean``: mean number of PRM steps of the eligible completions;
        ``prm_truncated_fraction``: the fraction of the generated completions the external PRM could not score in full
        (input truncated at ``prof_prm_max_length``; their consistency is NaN, left out of the consistency means).
        """
        kept, c, H, correct, eligible = (sel[k] for k in ("kept", "consistency", "num_steps", "correct", "eligible"))
        truncated = sel.get("truncated", torch.zeros_like(kept))
        dropped = eligible & ~kept
        nan = float("nan")

        def mean(x, m):
            if x.is_floating_point():
                m = m & ~torch.isnan(x)
            return x[m].float().mean().item() if bool(m.any()) else nan

        n_correct = int(correct.sum().item())
        return {
            "prof/kept_fraction": kept.float().mean().item() if kept.numel() else nan,
            "prof/kept_correct": float((kept & correct).sum().item()),
            "prof/kept_incorrect": float((kept & ~correct).sum().item()),
            "prof/consistency_kept_mean": mean(c, kept),
            "prof/consistency_dropped_mean": mean(c, dropped),
            "prof/dropped_correct_fraction": (dropped & correct).sum().item() / n_correct if n_correct else nan,
            "prof/num_steps_mean": mean(H, eligible),
            "prof/prm_truncated_fraction": truncated.float().mean().item() if kept.numel() else nan,
        }

    def __call__(
        self,
        trainer,
        *,
        outcome: torch.Tensor,
        eligible: torch.Tensor,
        output: dict,
        capture: dict,
        num_generations: int,
        token_rewards: torch.Tensor | None = None,
        mode: str = "train",
    ) -> torch.Tensor:
        """Run PROF on a trainer's generation batch; returns the global ``(B_global,)`` bool mask of kept rows.

        ``outcome`` ``(B_global,)`` and ``eligible`` ``(B_global,)`` (rows that may be kept: scorable, and not removed
        by another filter) are global; ``output`` is TRL's local generation output; ``capture`` holds the local
        ``prompts`` and ``completions``; ``token_rewards`` ``(B, T)`` local implicit-PRM rewards (PRIME). Collective.
        """
        acc = trainer.accelerator
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        batch = StepBatch(
            prompts=capture["prompts"], completions=capture["completions"], completion_ids=completion_ids,
            completion_mask=completion_mask,
            input_ids=torch.cat([output["prompt_ids"], completion_ids], dim=1),
            attention_mask=torch.cat([output["prompt_mask"], completion_mask], dim=1),
            token_rewards=token_rewards,
        )
        scores, smask = self.prm.step_scores(batch)
        if scores.size(1) == 0:  # pad_across_processes needs a non-empty dim
            scores, smask = scores.new_zeros(scores.size(0), 1), smask.new_zeros(smask.size(0), 1)
        scores_g = gather_padded(acc, scores.float().contiguous())
        smask_g = gather_padded(acc, smask.long().contiguous()).bool()
        group_ids = torch.arange(outcome.numel(), device=outcome.device) // num_generations
        masked_outcome = torch.where(eligible, outcome, torch.full_like(outcome, torch.nan))
        sel = self.select(group_ids, scores_g, smask_g, masked_outcome, step=trainer.state.global_step)
        if not self._warned_truncation and bool(sel["truncated"].any()):
            self._warned_truncation = True
            if acc.is_main_process:
                warnings.warn(
                    f"PROF: the step PRM's input was truncated for {int(sel['truncated'].sum())} of "
                    f"{sel['truncated'].numel()} completions (prof_prm_max_length): their trailing steps are unscored, "
                    "so they rank as the least consistent of their class. Raise `prof_prm_max_length` (the fraction "
                    "is logged as prof/prm_truncated_fraction). Warned once.",
                    stacklevel=2,
                )
        for k, v in self.metrics(sel).items():
            trainer._metrics[mode][k].append(v)
        self.last = dict(sel, step_scores=scores_g, step_mask=smask_g, outcome=outcome, group_ids=group_ids)
        return sel["kept"]


# ----------------------------------------------------------------------------------------------------------------
# PROF on plain GRPO
# ----------------------------------------------------------------------------------------------------------------
class ProfGRPOTrainer(GuardsMixin, DropZeroWeightRowsMixin, GRPOTrainer):
    """PROF on TRL's ``GRPOTrainer`` (PROF-BOTH / PROF-POS): a step PRM filters each prompt's completions to ``m``.

    Args: as ``trl.GRPOTrainer`` (``args`` a :class:`ProfGRPOConfig`), plus, by keyword, ``prof_prm``: a
    :class:`StepPRM`, a frozen :class:`~trl_prime.ImplicitPRM` or a path, overriding ``args.prof_prm``.

    In training, after the outcome rewards: the step PRM scores every completion, :class:`ProfFilter` keeps ``m`` per
    prompt, the GRPO advantages (:func:`trl_prime.functional.grpo_advantages`: group mean, unbiased std, eps 1e-6,
    ``scale_rewards``) are computed over the kept rows of each prompt only, and the dropped rows get loss weight 0
    (TRL's ``tool_mask``); ``num_items_in_batch`` counts the kept tokens of the global batch, so the token-mean loss is
    over the kept tokens. Evaluation is not filtered. Metrics: ``prof/*`` (see :meth:`ProfFilter.metrics`) besides
    TRL's; the completions log shows the advantages that reached the loss (0 on dropped rows).

    Example::

        from trl_prime import ProfGRPOConfig, ProfGRPOTrainer
        from trl_prime.rewards import math_reward

        args = ProfGRPOConfig("out", num_generations=8, prof_num_keep=4, prof_prm="Qwen/Qwen2.5-Math-PRM-7B",
                              trust_remote_code=True, beta=0.001, entropy_coef=0.001)
        ProfGRPOTrainer(model="Qwen/Qwen2.5-Math-7B", reward_funcs=math_reward, args=args, train_dataset=ds).train()
    """

    _tag_names = ["trl", "grpo", "prof", "trl-prime"]
    _name = "PROF-GRPO"

    def __init__(self, model, reward_funcs=None, args: ProfGRPOConfig | None = None, *trainer_args,
                 prof_prm: StepPRM | ImplicitPRM | str | None = None, **trainer_kwargs):
        if args is None:
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ProfGRPOConfig(f"{name.split('/')[-1]}-PROF")
        if not isinstance(args, ProfGRPOConfig):
            raise TypeError(
                f"ProfGRPOTrainer needs `args` to be a ProfGRPOConfig (got {type(args).__name__}); build it with "
                "ProfGRPOConfig(output_dir=..., ...) to get the PROF options."
            )
        self._prof_capture: dict | None = None
        check_peft_config(trainer_args[7] if len(trainer_args) > 7 else trainer_kwargs.get("peft_config"), model)
        super().__init__(model, reward_funcs, args, *trainer_args, **trainer_kwargs)
        self.prof_filter = ProfFilter.from_trainer(self, prm=prof_prm)
        self._guard_setup()  # start-up checks of the dataset; non-finite / verifier guards (trl_prime/_guards.py)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._prof_capture is not None:
            self._prof_capture.update(rewards_per_func=rewards_per_func, prompts=prompts, completions=completions)
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._prof_capture = {}
        try:
            output = super()._generate_and_score_completions(inputs)
            capture = self._prof_capture
        finally:
            self._prof_capture = None
        if not self.model.training:
            return output
        acc = self.accelerator
        K = self.num_generations
        outcome = outcome_rewards(self, capture["rewards_per_func"])
        # inf rewards poison the batch (its step is skipped); NaN rewards are unscorable rows (never kept)
        self._guard_inspect("train", global_rows={"rewards": outcome.nan_to_num(0.0, posinf=torch.inf, neginf=-torch.inf)},
                            local_rows={"old_logps": output.get("old_per_token_logps")},
                            masks={"old_logps": output["completion_mask"]})
        outcome = torch.where(torch.isinf(outcome), torch.full_like(outcome, torch.nan), outcome)
        B = output["completion_ids"].size(0)
        mask_g = gather_padded(acc, output["completion_mask"])
        if self.prof_filter is None:
            self._guard_inspect("train", local_rows={"advantages": output["advantages"]})
            self._guard_degenerate_metrics("train", outcome=outcome, completion_mask_g=mask_g, num_generations=K)
            return output
        kept = self.prof_filter(
            self, outcome=outcome, eligible=~torch.isnan(outcome), output=output, capture=capture, num_generations=K
        )
        group_ids = torch.arange(outcome.numel(), device=outcome.device) // K
        kept_outcome = torch.where(kept, outcome, torch.full_like(outcome, torch.nan))
        advantages_g = F.grpo_advantages(kept_outcome, group_ids, scale_rewards=self.args.scale_rewards != "none")
        self._guard_single_row_groups("train", rewards=kept_outcome, group_ids=group_ids)
        self._guard_inspect("train", global_rows={"advantages": advantages_g})
        self._guard_degenerate_metrics("train", outcome=outcome, completion_mask_g=mask_g, num_generations=K,
                                       kept=kept)
        local = slice(acc.process_index * B, (acc.process_index + 1) * B)
        output["advantages"] = advantages_g[local]
        mask_loss_rows(acc, output, kept[local])
        replace_logged_advantages(self, advantages_g)
        return output


def prime_prof_rows(trainer, *, mode: str, kept: torch.Tensor, scorable: torch.Tensor, outcome: torch.Tensor,
                    output: dict, capture: dict, token_rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """The rows a PRIME trainer trains its policy on: ``kept`` (the online prompt filter) narrowed by PROF.

    Called from ``PrimeMixin._prime_step`` after the implicit PRM's token rewards and before the advantages. Returns
    ``kept`` unchanged when the trainer has no PROF filter (``prof_mode="off"``) or in evaluation. The PRM update is
    not affected (it already ran, on every row of the kept groups).
    """
    prof = getattr(trainer, "prof_filter", None)
    if prof is None or mode != "train":
        return kept
    return prof(
        trainer, outcome=outcome, eligible=kept & scorable, output=output, capture=capture,
        num_generations=num_generations, token_rewards=token_rewards, mode=mode,
    )
