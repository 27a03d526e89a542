"""Step PRMs behind one interface, :class:`StepPRM` (PROF arXiv 2509.03403, Sec. 3).

``step_scores(batch) -> (scores (B, S), step_mask (B, S))``: for each of a completion's ``S`` reasoning steps (split at
``prof_step_delimiter``, ``"\\n\\n"`` in the paper), the probability in [0, 1] that the step is correct.
:class:`~trl_prime.prof.filter.ProfFilter` averages them into the completion's process consistency; the PRM only
ranks completions, it never enters an advantage.

- :class:`TokenClassificationStepPRM`: an external step PRM in the style of Qwen2.5-Math-PRM-7B (the probability of
  its "correct" label at the separator placed after every step, PROF's released scoring).
- :class:`ImplicitStepPRM`: the implicit PRM (Implicit PRM arXiv 2412.01981, Sec. 3: a step's reward is the sum of its
  token rewards ``beta * log(pi_phi / pi_ref)``) squashed to [0, 1] by ``sigmoid(reward / prof_implicit_temperature)``.
  Inside the PRIME trainers it reuses the online PRM's token rewards, so it needs no extra model or forward.
- :func:`load_step_prm`: the step PRM a path or Hub id names (``prof_prm``: a token-classification PRM, or a folder
  saved by ``ImplicitPRM.save_pretrained``).
- :class:`StepBatch`: the local completions a step PRM scores.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from trl_prime import functional as F
from trl_prime.implicit_prm.model import CONFIG_NAME as IMPLICIT_PRM_CONFIG_NAME
from trl_prime.implicit_prm.model import ImplicitPRM
from trl_prime.modeling import eval_mode, position_ids_from_mask
from trl_prime.prof.config import PRM_MAX_SCORED_STEPS, QWEN_PRM_SYSTEM_PROMPT


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
    """An external step PRM in the style of Qwen2.5-Math-PRM-7B (PROF's released scoring).

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
            dtype=torch.long,
            device=device,
        )
        scores = torch.zeros(B, S, dtype=torch.float32, device=device)
        smask = torch.zeros(B, S, dtype=torch.bool, device=device)
        mb = self.micro_batch_size or max(B, 1)
        with eval_mode(self.model):
            for start in range(0, B, mb):
                enc = self.tokenizer(
                    texts[start : start + mb],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=False,
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
    """The implicit PRM as PROF's step PRM: step rewards mapped to [0, 1] with a sigmoid.

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

    def __init__(
        self, tokenizer, implicit_prm: ImplicitPRM | None = None, *, delimiter: str = "\n\n", temperature: float = 1.0
    ):
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
                raise ValueError(
                    "ImplicitStepPRM needs token rewards in the batch or an `implicit_prm` to compute them."
                )
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
        model,
        prm_tokenizer,
        separator=args.prof_prm_separator,
        delimiter=args.prof_step_delimiter,
        system_prompt=args.prof_prm_system_prompt,
        max_length=args.prof_prm_max_length,
        micro_batch_size=args.prof_prm_micro_batch_size or args.per_device_train_batch_size,
    )
