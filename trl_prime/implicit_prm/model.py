"""The implicit process reward model (Implicit PRM arXiv 2412.01981; PRIME arXiv 2502.01456 Eq. 3).

An implicit PRM is a causal language model ``pi_phi`` read against a reference ``pi_ref``: the reward of token
``y_t`` is ``r_t = beta * (log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t))`` (PRIME Eq. 3; Implicit PRM Sec. 3).
Summed over a completion it is the outcome reward ``r(y)`` the model is trained on (cross-entropy on outcome labels);
its prefix sums are Q-values and its per-step sums are step rewards, usable for best-of-N (min over steps by default,
Implicit PRM Sec. 4).

:class:`ImplicitPRM` wraps ``pi_phi`` and one of three references:

- a separate frozen model (default; both start from the same checkpoint, so every reward starts at exactly 0);
- the same PEFT base with adapters disabled, when ``pi_phi`` is an adapter (``adapter_name``) on a ``PeftModel``
  (one base model in memory for policy, PRM and reference);
- an *external* reference: the caller passes reference log-probs (PRIME's ``prm_reference="policy"``, where the
  rollout policy's log-probs serve as reference).

All log-probs (PRM and reference) go through :func:`~trl_prime.modeling.completion_logps`: the same token ids, the
same attention mask, position ids derived from the attention mask (so a left-padded batch scores like its unpadded
rows), models in eval mode (no dropout), and no ``(B, T, V)`` log-softmax is ever materialised (TRL's fused LM head
when the model carries one at temperature 1, else ``selective_log_softmax`` on micro-batches).

The module also holds what scoring, training and sampling share: :func:`tokenize_prompt_completion` (one row's ids,
as TRL's ``GRPOTrainer`` tokenises them), :func:`pad_token_rows` / :func:`pad_prompt_completion` (TRL's batch
layout: prompt left-padded, completion right-padded) and the step splitter of best-of-N scoring. An
:class:`ImplicitPRM` is saved as a ``save_pretrained`` folder with ``implicit_prm_config.json`` and ``reference/``
(:meth:`ImplicitPRM.save_pretrained` / :meth:`ImplicitPRM.from_pretrained`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trl_prime import functional as F
from trl_prime.modeling import adapter_parameters, add_fused_head, completion_logps, eval_mode, peft_adapter, unwrap


CONFIG_NAME = "implicit_prm_config.json"
REFERENCE_SUBFOLDER = "reference"


# ----------------------------------------------------------------------------------------------------------------
# Steps and tokenisation (shared by scoring, training and sampling)
# ----------------------------------------------------------------------------------------------------------------
def scoring_step_ends(
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    tokenizer,
    *,
    delimiter: str | None = "\n\n",
    step_len: int | None = None,
) -> torch.Tensor:
    """``(B, T)`` bool step ends for best-of-N scoring: :func:`trl_prime.functional.step_end_mask`'s steps.

    The same splitter as PRL and PROF: ``delimiter`` found in the decoded completion (character offsets, robust to
    token merges), runs of delimiters and whitespace-only segments collapsed (no empty step), the last valid token
    always a step end. ``step_len``: every ``step_len`` tokens instead (``split="length"``). ``delimiter=None`` and
    ``step_len=None``: one step per completion (the last valid token).

    Raises:
        ValueError: a delimiter split without a ``tokenizer`` (pass ``step_ends`` or ``step_len``), or as
            :func:`~trl_prime.functional.step_end_mask`.
    """
    if step_len is not None:
        return F.step_end_mask(completion_ids, mask, split="length", step_len=step_len)
    if not delimiter:
        return F.last_token_mask(mask)
    if tokenizer is None:
        raise ValueError("Steps split at `delimiter` need a tokenizer: pass `tokenizer=`, `step_ends` or `step_len`.")
    return F.step_end_mask(completion_ids, mask, tokenizer, split="double_newline", delimiter=delimiter)


def tokenize_prompt_completion(
    prompt: Any,
    completion: Any,
    tokenizer,
    *,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
) -> dict[str, list[int]]:
    """``{"prompt_ids", "completion_ids"}`` of one row: the tokenisation shared by scoring and training.

    The ids are those TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (1.16, ``_tokenize_prompts``) put in a batch, so a PRM
    trained online (PRIME) is scored offline (:meth:`ImplicitPRM.score`, best-of-N, :class:`ImplicitPRMTrainer`) on
    the same ids:

    - a string prompt: ``tokenizer(text=[prompt])``, with the tokenizer's special tokens (its BOS, when its
      post-processor adds one), as TRL's trainers call it;
    - a conversation (list of ``{"role", "content"}`` messages): rendered with the chat template and the generation
      prompt and tokenised without added special tokens (``apply_chat_template(..., add_generation_prompt=True,
      tokenize=True)``; a template that wants a BOS writes ``bos_token`` itself), as TRL's trainers do.

    An empty prompt that tokenises to nothing becomes one BOS (or EOS) token. The completion (a string, or a
    conversation whose last message is used) is tokenized without special tokens (no BOS inside the sequence) and
    EOS is appended when the tokenizer has one, as a completion the policy generated ends. Optional truncation:
    the prompt keeps its last ``max_prompt_length`` tokens, the completion its first ``max_length - len(prompt)``
    (at least one).
    """
    if isinstance(prompt, str):
        p = tokenizer(text=[prompt])["input_ids"][0]
    else:
        p = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    if isinstance(completion, list):  # conversational completion [{"role": "assistant", "content": ...}]
        completion = completion[-1]["content"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        c = c + [tokenizer.eos_token_id]
    p = list(p)
    if len(p) == 0:
        p = [tokenizer.eos_token_id if tokenizer.bos_token_id is None else tokenizer.bos_token_id]
    if max_prompt_length is not None and len(p) > max_prompt_length:
        p = p[-max_prompt_length:]
    if max_length is not None:
        c = c[: max(max_length - len(p), 1)]
    return {"prompt_ids": p, "completion_ids": list(c)}


def pad_token_rows(
    rows: Sequence[Sequence[int]], pad_token_id: int, *, padding_side: str = "right", device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``: token-id rows padded to the longest, both ``(B, L)`` long; ``mask`` is 1 on each row's tokens.

    ``padding_side="left"`` for prompts, ``"right"`` for completions (TRL's layout). ``rows`` must not be empty.
    """
    B, L = len(rows), max(map(len, rows))
    ids = torch.full((B, L), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((B, L), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        span = slice(L - len(row), L) if padding_side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def pad_prompt_completion(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """A batch in TRL's layout: each prompt left-padded, followed by its completion right-padded.

    Returns:
        dict with ``input_ids`` ``(B, P+T)``, ``attention_mask`` ``(B, P+T)``, ``completion_ids`` ``(B, T)`` and
        ``completion_mask`` ``(B, T)``, all long, on the CPU.
    """
    p_ids, p_mask = pad_token_rows(prompt_ids, pad_token_id, padding_side="left")
    c_ids, c_mask = pad_token_rows(completion_ids, pad_token_id, padding_side="right")
    return {
        "input_ids": torch.cat([p_ids, c_ids], 1),
        "attention_mask": torch.cat([p_mask, c_mask], 1),
        "completion_ids": c_ids,
        "completion_mask": c_mask,
    }


# ----------------------------------------------------------------------------------------------------------------
# ImplicitPRM
# ----------------------------------------------------------------------------------------------------------------
class ImplicitPRM:
    """An implicit PRM: a causal LM ``pi_phi`` and its reference ``pi_ref`` (Implicit PRM section 3; PRIME Eq. 3).

    Args:
        model: ``pi_phi``, a causal LM, or a ``PeftModel`` holding the PRM as adapter ``adapter_name``. May be wrapped
            (DDP, DeepSpeed engine).
        ref_model: ``pi_ref``, a frozen causal LM (never updated here). ``None``: with ``adapter_name`` the reference
            is ``ref_adapter_name`` if given, else the base model with adapters disabled; without an adapter the
            reference is *external* (pass ``ref_logps`` to the reward methods).
        beta: the reward scale ``beta`` (> 0), 0.05 in PRIME and the Implicit PRM paper.
        tokenizer: used by :meth:`score`, :meth:`encode` and delimiter-based steps.
        adapter_name: name of the PRM adapter on a ``PeftModel`` (e.g. ``"prm"``).
        ref_adapter_name: a frozen adapter serving as reference (a PRM adapter copied from a trained adapter).
        micro_batch_size: rows per forward pass (``None``: the whole batch).
        include_last_token: default of :meth:`token_rewards` (the released PRIME code drops the last token's reward
            from the process rewards; the sequence reward always includes it).
        fused_head: give separate (non-PEFT) models TRL's fused LM head at temperature 1 (no ``(B,T,V)`` logits).
        trained_reference: the reference the PRM was *trained* against, when it differs from the one it scores
            with: ``"policy"`` for a PRM trained online against the rollout policy's log-probs (PRIME's
            ``prm_reference="policy"``). Saved as ``trained_reference`` in ``implicit_prm_config.json``; default:
            :attr:`reference`.

    Both models are run in eval mode for scoring (dropout off) and their train/eval flags are restored afterwards, so
    when ``pi_phi`` and ``pi_ref`` hold the same weights every reward is exactly 0.
    """

    def __init__(
        self,
        model: nn.Module,
        ref_model: nn.Module | None = None,
        *,
        beta: float = 0.05,
        tokenizer=None,
        adapter_name: str | None = None,
        ref_adapter_name: str | None = None,
        micro_batch_size: int | None = None,
        include_last_token: bool = True,
        fused_head: bool = True,
        trained_reference: str | None = None,
    ):
        if not beta > 0:
            raise ValueError(f"beta must be > 0 (got {beta}); PRIME and the Implicit PRM paper use 0.05.")
        if adapter_name is not None and not hasattr(unwrap(model), "peft_config"):
            raise ValueError(
                f"adapter_name={adapter_name!r} needs a peft.PeftModel as `model`; got {type(unwrap(model)).__name__}."
            )
        if adapter_name is not None and adapter_name not in unwrap(model).peft_config:
            raise ValueError(
                f"adapter {adapter_name!r} is not on the PeftModel (adapters: {list(unwrap(model).peft_config)}). "
                "Add it with `model.add_adapter(name, config)` first."
            )
        self.model = model
        self.ref_model = ref_model
        self.beta = float(beta)
        self.tokenizer = tokenizer
        self.adapter_name = adapter_name
        self.ref_adapter_name = ref_adapter_name
        self.micro_batch_size = micro_batch_size
        self.include_last_token = include_last_token
        self.trained_reference = trained_reference
        self.name_or_path = getattr(getattr(unwrap(model), "config", None), "_name_or_path", None)
        self.ref_name_or_path = (
            getattr(getattr(unwrap(ref_model), "config", None), "_name_or_path", None)
            if ref_model is not None
            else None
        )
        if fused_head and adapter_name is None:
            add_fused_head(model)
            if ref_model is not None:
                add_fused_head(ref_model)

    # --------------------------------------------------------------------------------------------------------
    @property
    def reference(self) -> str:
        """``"model"`` (separate frozen model), ``"adapter"``, ``"adapters_disabled"`` or ``"external"``."""
        if self.ref_model is not None:
            return "model"
        if self.adapter_name is not None:
            return "adapter" if self.ref_adapter_name is not None else "adapters_disabled"
        return "external"

    @property
    def device(self) -> torch.device:
        return next(unwrap(self.model).parameters()).device

    def prm_context(self, *, trainable: bool = False):
        """Context in which calling ``self.model`` runs ``pi_phi`` in eval mode (the PRM adapter active if any)."""
        stack = contextlib.ExitStack()
        stack.enter_context(eval_mode(self.model))
        if self.adapter_name is not None:
            stack.enter_context(peft_adapter(self.model, self.adapter_name, trainable=trainable))
        return stack

    @contextlib.contextmanager
    def ref_context(self):
        """Context yielding the module that runs ``pi_ref`` in eval mode: the reference model, or ``self.model`` with
        the reference adapter active (every adapter disabled when there is none).

        Raises:
            ValueError: the reference is external (``prm_reference="policy"``): pass ``ref_logps`` instead.
        """
        if self.ref_model is not None:
            with eval_mode(self.ref_model):
                yield self.ref_model
        elif self.adapter_name is not None:
            with eval_mode(self.model), peft_adapter(self.model, self.ref_adapter_name):
                yield self.model
        else:
            raise ValueError(
                "This ImplicitPRM has an external reference (no ref_model, no PEFT adapter): pass `ref_logps` (e.g. "
                "the rollout policy's log-probs), or build it with a reference model, or score with "
                "`with_reference=False`."
            )

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters of ``pi_phi`` an optimizer should update (the adapter's parameters for a PEFT PRM)."""
        if self.adapter_name is not None:
            return [p for _, p in adapter_parameters(self.model, self.adapter_name)]
        return list(unwrap(self.model).parameters())

    def prm_logps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *,
        requires_grad: bool = False,
        mm_inputs: dict | None = None,
    ) -> torch.Tensor:
        """``(B, T)`` log-probs of the completion tokens under ``pi_phi`` (eval mode); see :func:`completion_logps`
        (``mm_inputs``: a vision-language PRM's multimodal inputs of the rows, e.g. ``pixel_values``).

        For a training step on a PEFT PRM, run the forward *and* the backward inside ``prm_context(trainable=True)``
        (the adapter's ``requires_grad`` flags are restored when the context exits, and autograd skips parameters
        that no longer require grad); ``requires_grad=True`` here suits a separate (non-PEFT) PRM.
        """
        with self.prm_context(trainable=requires_grad), torch.set_grad_enabled(requires_grad):
            return completion_logps(
                self.model,
                input_ids,
                attention_mask,
                logits_to_keep,
                micro_batch_size=self.micro_batch_size,
                mm_inputs=mm_inputs,
            )

    @torch.no_grad()
    def ref_logps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *,
        mm_inputs: dict | None = None,
    ) -> torch.Tensor:
        """``(B, T)`` log-probs of the completion tokens under ``pi_ref`` (eval mode, no grad); ``mm_inputs`` as in
        :meth:`prm_logps`.

        Raises:
            ValueError: the reference is external (``prm_reference="policy"``): pass ``ref_logps`` instead.
        """
        with self.ref_context() as ref_model:
            return completion_logps(
                ref_model,
                input_ids,
                attention_mask,
                logits_to_keep,
                micro_batch_size=self.micro_batch_size,
                mm_inputs=mm_inputs,
            )

    # --------------------------------------------------------------------------------------------------------
    def token_rewards(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        ref_logps: torch.Tensor | None = None,
        prm_logps: torch.Tensor | None = None,
        with_reference: bool = True,
        include_last_token: bool | None = None,
    ) -> torch.Tensor:
        """Token rewards ``r_t = beta * (log pi_phi - log pi_ref) * mask`` (PRIME Eq. 3), no grad.

        Args:
            input_ids: ``(B, L)`` prompt (left-padded) + completion (right-padded) token ids.
            attention_mask: ``(B, L)`` 0/1.
            completion_mask: ``(B, T)`` 0/1 on real completion tokens (EOS included); ``T`` = completion length.
            ref_logps / prm_logps: precomputed ``(B, T)`` log-probs to use instead of a forward pass.
            with_reference: ``False`` scores ``beta * log pi_phi`` alone ("without reference" best-of-N scoring).
            include_last_token: zero the reward of each row's last valid token when ``False``.

        Returns:
            ``(B, T)`` float32 rewards (nats times beta); 0 on padding.
        """
        T = completion_mask.size(1)
        if prm_logps is None:
            prm_logps = self.prm_logps(input_ids, attention_mask, T)
        prm_logps = prm_logps.detach()
        if with_reference:
            if ref_logps is None:
                ref_logps = self.ref_logps(input_ids, attention_mask, T)
        else:
            ref_logps = torch.zeros_like(prm_logps)
        ilt = self.include_last_token if include_last_token is None else include_last_token
        return F.implicit_token_rewards(
            prm_logps=prm_logps,
            ref_logps=ref_logps.detach(),
            mask=completion_mask,
            beta=self.beta,
            include_last_token=ilt,
        )

    def sequence_rewards(self, input_ids, attention_mask, completion_mask, **kwargs) -> torch.Tensor:
        """``(B,)`` outcome reward ``r(y) = sum_t r_t`` (all tokens, last one included).

        Keyword arguments as :meth:`token_rewards`.
        """
        kwargs["include_last_token"] = True
        return (self.token_rewards(input_ids, attention_mask, completion_mask, **kwargs) * completion_mask).sum(-1)

    def step_rewards(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        step_ends: torch.Tensor | None = None,
        delimiter: str | None = "\n\n",
        step_len: int | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step rewards (Implicit PRM Sec. 3): each step's token rewards summed, i.e. the Q-value at the step's end
        minus the Q-value at the previous step's end.

        Steps end at ``step_ends`` (``(B, T)`` bool) if given, else at ``delimiter`` in the decoded completion or
        every ``step_len`` tokens (:func:`trl_prime.functional.step_end_mask`, the splitter of PRL and PROF: runs of
        delimiters collapse, whitespace-only text is no step; needs ``tokenizer``); the last token ends a step.

        Returns:
            ``(step_values (B, S), step_mask (B, S))`` as :func:`trl_prime.functional.step_rewards`.
        """
        kwargs["include_last_token"] = True
        rewards = self.token_rewards(input_ids, attention_mask, completion_mask, **kwargs)
        if step_ends is None:
            if self.tokenizer is None and step_len is None and delimiter:
                raise ValueError("step_rewards needs `step_ends`, `step_len`, or a tokenizer to find `delimiter`.")
            T = completion_mask.size(1)
            step_ends = scoring_step_ends(
                input_ids[:, -T:], completion_mask, self.tokenizer, delimiter=delimiter, step_len=step_len
            )
        return F.step_rewards(token_rewards=rewards, step_ends=step_ends.bool())

    # --------------------------------------------------------------------------------------------------------
    def encode(self, prompts: Sequence[Any], completions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tokenize prompt/completion pairs like TRL does: prompt left-padded, completion right-padded.

        A prompt is a string or a conversation (list of ``{"role", "content"}`` messages, rendered with the chat
        template and the generation prompt). Completions are tokenized without special tokens; an EOS token is
        appended when the tokenizer has one (TRL's completions end with EOS).

        Returns:
            dict with ``input_ids`` ``(B, P+T)``, ``attention_mask`` ``(B, P+T)``, ``completion_ids`` ``(B, T)`` and
            ``completion_mask`` ``(B, T)``, on this PRM's device.
        """
        tok = self.tokenizer
        if tok is None:
            raise ValueError("ImplicitPRM.encode/score need a tokenizer: pass `tokenizer=` when building it.")
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions; pass one prompt each.")
        p_ids, c_ids = [], []
        for prompt, completion in zip(prompts, completions):
            row = tokenize_prompt_completion(prompt, completion, tok)
            p_ids.append(row["prompt_ids"])
            c_ids.append(row["completion_ids"])
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        batch = pad_prompt_completion(p_ids, c_ids, pad)
        return {k: v.to(self.device) for k, v in batch.items()}

    @torch.no_grad()
    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[str],
        *,
        aggregation: str = "min",
        with_reference: bool = True,
        delimiter: str | None = "\n\n",
        step_len: int | None = None,
        batch_size: int = 8,
    ) -> list[float]:
        """Best-of-N response scores: one float per (prompt, completion) pair (Implicit PRM paper, section 4).

        Each completion is split into steps (``delimiter`` or ``step_len``; see :meth:`step_rewards`), each step
        gets the sum of its token rewards, and the steps are aggregated with ``aggregation`` (``"min"`` default,
        ``"mean"``, ``"sum"`` or ``"last"``). ``with_reference=False`` uses ``beta * log pi_phi`` alone.

        Returns:
            list of ``len(completions)`` floats (higher is better).
        """
        F.check_choice(aggregation, F.STEP_AGGREGATIONS, "aggregation")
        scores: list[float] = []
        for start in range(0, len(completions), batch_size):
            enc = self.encode(prompts[start : start + batch_size], completions[start : start + batch_size])
            values, smask = self.step_rewards(
                enc["input_ids"],
                enc["attention_mask"],
                enc["completion_mask"],
                delimiter=delimiter,
                step_len=step_len,
                with_reference=with_reference,
            )
            agg = F.aggregate_step_rewards(step_values=values, step_mask=smask, how=aggregation)
            scores.extend(float(x) for x in agg.float().cpu())
        return scores

    # --------------------------------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        from trl_prime import __version__

        return {
            "beta": self.beta,
            "reference": self.reference,
            "trained_reference": self.trained_reference or self.reference,
            "adapter_name": self.adapter_name,
            "ref_adapter_name": self.ref_adapter_name,
            "include_last_token": self.include_last_token,
            "micro_batch_size": self.micro_batch_size,
            "name_or_path": self.name_or_path,
            "ref_name_or_path": self.ref_name_or_path,
            "trl_prime_version": __version__,
        }

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        save_reference: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
        ref_state_dict: dict[str, torch.Tensor] | None = None,
        is_main_process: bool = True,
        safe_serialization: bool = True,
    ) -> None:
        """Save ``pi_phi`` (``save_pretrained`` folder), its tokenizer, the reference and ``implicit_prm_config.json``.

        Layout: ``save_directory/`` holds the PRM (loadable by ``AutoModelForCausalLM.from_pretrained`` too; for a
        PEFT PRM, the adapter as a standard adapter folder, loadable by ``PeftModel.from_pretrained``),
        ``save_directory/reference/`` the separate reference model (when ``save_reference`` and the reference is a
        model) or the frozen reference adapter, and the config json (beta, reference
        kind, the paths the models came from). ``state_dict``/``ref_state_dict``: full state dicts gathered by the
        caller (DeepSpeed ZeRO-3). Only ``is_main_process`` writes.
        """
        if not is_main_process:
            return
        os.makedirs(save_directory, exist_ok=True)
        model = unwrap(self.model)
        if self.adapter_name is not None:
            _save_adapter(model, self.adapter_name, save_directory)
            if self.ref_adapter_name is not None:
                _save_adapter(model, self.ref_adapter_name, os.path.join(save_directory, REFERENCE_SUBFOLDER))
        else:
            model.save_pretrained(save_directory, state_dict=state_dict, safe_serialization=safe_serialization)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(save_directory)
        cfg = self.config_dict()
        cfg["reference_subfolder"] = REFERENCE_SUBFOLDER if self.ref_adapter_name is not None else None
        if save_reference and self.ref_model is not None:
            unwrap(self.ref_model).save_pretrained(
                os.path.join(save_directory, REFERENCE_SUBFOLDER),
                state_dict=ref_state_dict,
                safe_serialization=safe_serialization,
            )
            cfg["reference_subfolder"] = REFERENCE_SUBFOLDER
        with open(os.path.join(save_directory, CONFIG_NAME), "w") as f:
            json.dump(cfg, f, indent=2)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        ref_model: nn.Module | str | None = None,
        beta: float | None = None,
        tokenizer=None,
        **model_kwargs,
    ) -> ImplicitPRM:
        """Load an implicit PRM saved by :meth:`save_pretrained` (or any causal LM folder, with ``ref_model``).

        Args:
            path: the folder.
            ref_model: a reference model or path overriding the saved one. Default: ``path/reference`` if saved,
                else the path recorded in the config (``ref_name_or_path``), else the PEFT base with adapters off.
            beta: overrides the saved beta (default 0.05 when the folder has no config).
            tokenizer: overrides the tokenizer saved in ``path``.
            model_kwargs: passed to ``from_pretrained`` of the models (e.g. ``dtype``, ``device_map``).

        Raises:
            ValueError: no reference can be found (pass ``ref_model``).

        Warns:
            UserWarning: the PRM was trained against the rollout policy's log-probs (``trained_reference="policy"``):
                its scores here are relative to the reference it is loaded with (the base with adapters disabled,
                ``ref_model``), not to the rollout policy it was trained against.
        """
        path = str(path)
        cfg_path = os.path.join(path, CONFIG_NAME)
        cfg = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else {}
        adapter_name = cfg.get("adapter_name")
        ref_adapter_name = cfg.get("ref_adapter_name")
        if tokenizer is None:
            tokenizer = _load_tokenizer(path)
        model = _load_prm_model(path, adapter_name, ref_adapter_name, model_kwargs)
        ref_model = _load_reference(path, cfg, ref_model, adapter_name, model_kwargs)
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        model.eval()
        trained_reference = cfg.get("trained_reference")
        if trained_reference == "policy":
            _warn_trained_against_policy(path, ref_model, adapter_name)
        return cls(
            model,
            ref_model,
            beta=beta if beta is not None else cfg.get("beta", 0.05),
            tokenizer=tokenizer,
            adapter_name=adapter_name,
            ref_adapter_name=ref_adapter_name,
            micro_batch_size=cfg.get("micro_batch_size"),
            include_last_token=cfg.get("include_last_token", True),
            trained_reference=trained_reference,
        )

    def __repr__(self) -> str:
        return (
            f"ImplicitPRM(model={type(unwrap(self.model)).__name__}, reference={self.reference!r}, beta={self.beta}, "
            f"adapter_name={self.adapter_name!r})"
        )


# ----------------------------------------------------------------------------------------------------------------
# Saving and loading
# ----------------------------------------------------------------------------------------------------------------
def _save_adapter(peft_model: nn.Module, adapter_name: str, folder: str) -> None:
    """Write one adapter of a ``PeftModel`` as a standard adapter folder (``PeftModel.from_pretrained`` loads it)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()}, os.path.join(folder, "adapter_model.safetensors")
    )
    cfg = copy.deepcopy(peft_model.peft_config[adapter_name])
    cfg.inference_mode = True
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = getattr(peft_model.get_base_model().config, "_name_or_path", None)
    cfg.save_pretrained(folder)


def _load_tokenizer(path: str):
    """The tokenizer saved in ``path``, or ``None`` when the folder holds none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def _load_prm_model(path: str, adapter_name: str | None, ref_adapter_name: str | None, model_kwargs: dict):
    """``pi_phi`` saved in ``path``: a causal LM, or its PEFT base with the PRM adapter (and the reference adapter
    from ``path/reference``, when one was saved) loaded frozen, the PRM adapter active."""
    from transformers import AutoModelForCausalLM

    if adapter_name is None:
        return AutoModelForCausalLM.from_pretrained(path, **model_kwargs)
    from peft import PeftConfig, PeftModel

    peft_cfg = PeftConfig.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(peft_cfg.base_model_name_or_path, **model_kwargs)
    model = PeftModel.from_pretrained(base, path, adapter_name=adapter_name, is_trainable=False)
    if ref_adapter_name:
        model.load_adapter(os.path.join(path, REFERENCE_SUBFOLDER), adapter_name=ref_adapter_name)
    model.set_adapter(adapter_name)
    return model


def _load_reference(
    path: str,
    cfg: dict[str, Any],
    ref_model: nn.Module | str | os.PathLike | None,
    adapter_name: str | None,
    model_kwargs: dict,
) -> nn.Module | None:
    """``pi_ref`` of a saved PRM: ``ref_model`` (a model, or a path to load), else ``path/reference``, else the
    recorded ``ref_name_or_path``; ``None`` for a PEFT PRM (adapters-off base) or an external reference.

    Raises:
        ValueError: a separate reference is needed but none can be found.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(ref_model, (str, os.PathLike)):
        return AutoModelForCausalLM.from_pretrained(str(ref_model), **model_kwargs)
    if ref_model is not None or adapter_name is not None:
        return ref_model
    sub = cfg.get("reference_subfolder")
    if sub and os.path.isdir(os.path.join(path, sub)):
        return AutoModelForCausalLM.from_pretrained(os.path.join(path, sub), **model_kwargs)
    if cfg.get("ref_name_or_path") and os.path.isdir(cfg["ref_name_or_path"]):
        return AutoModelForCausalLM.from_pretrained(cfg["ref_name_or_path"], **model_kwargs)
    if cfg.get("reference") == "external":
        return None
    raise ValueError(
        f"No reference model found for the implicit PRM in {path!r}: it was saved without "
        "`reference/` and records no reachable `ref_name_or_path`. Pass `ref_model=` (a model or a path)."
    )


def _warn_trained_against_policy(path: str, ref_model: nn.Module | None, adapter_name: str | None) -> None:
    """Warn that a PRM trained against the rollout policy's log-probs (PRIME's ``prm_reference="policy"``) is loaded
    with another reference (reported at the caller of :meth:`ImplicitPRM.from_pretrained`)."""
    if ref_model is not None:
        scoring_ref = "the reference model given or saved with it"
    elif adapter_name is not None:
        scoring_ref = "the PEFT base with adapters disabled"
    else:
        scoring_ref = "the `ref_logps` you pass"
    warnings.warn(
        f"The implicit PRM in {path!r} was trained against the rollout policy's log-probs "
        "(prm_reference='policy'); its scores here are relative to "
        f"{scoring_ref}, not to the rollout policy it was trained against. Pass `ref_model=` (the policy "
        "checkpoint) or `ref_logps` to score against that policy.",
        stacklevel=3,
    )
