"""Best-of-N reranking with an implicit PRM (Implicit PRM arXiv 2412.01981 Sec. 4).

A candidate's score is its step rewards (each step's token rewards ``r_t = beta * (log pi_phi - log pi_ref)``,
PRIME arXiv 2502.01456 Eq. 3, summed between step ends) aggregated over the steps: ``min`` by default (the paper's
choice), ``mean``, ``sum`` or ``last``; without reference, ``beta * log pi_phi`` alone.

- :func:`best_of_n`: the best candidate of each prompt under :meth:`ImplicitPRM.score`;
- :func:`score_candidates`: many candidates of one prompt under every aggregation at once, the prompt run once per
  model with its KV cache shared (``recipes/evaluate_best_of_n.py``);
- :func:`argmax_first`: the selection rule (first maximum; NaN never wins).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trl_prime import functional as F
from trl_prime.implicit_prm.model import ImplicitPRM, pad_token_rows, scoring_step_ends, tokenize_prompt_completion
from trl_prime.modeling import unwrap


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
        raise ValueError(
            f"got {len(prompts)} prompts but {len(candidates)} candidate lists; pass one list per prompt."
        )
    flat_p, flat_c, sizes = [], [], []
    for i, (p, cands) in enumerate(zip(prompts, candidates)):
        if isinstance(cands, str) or len(cands) == 0:
            raise ValueError(f"candidates[{i}] must be a non-empty list of completions, got {cands!r}.")
        flat_p.extend([p] * len(cands))
        flat_c.extend(cands)
        sizes.append(len(cands))
    scores = prm.score(
        flat_p,
        flat_c,
        aggregation=aggregation,
        with_reference=with_reference,
        delimiter=delimiter,
        step_len=step_len,
        batch_size=batch_size,
    )
    out, start = [], 0
    for n in sizes:
        out.append(argmax_first(scores[start : start + n]))
        start += n
    return out


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
    res = torch.zeros((len(completion_ids), T), dtype=torch.float32)
    for b0 in range(0, len(completion_ids), batch_size):
        ids, completion_mask = pad_token_rows(completion_ids[b0 : b0 + batch_size], 0, device=device)
        B, Tb = ids.shape
        prompt_mask = torch.ones((B, P), dtype=torch.long, device=device)
        am = torch.cat([prompt_mask, completion_mask], dim=1)
        cache = copy.deepcopy(cache0)
        cache.batch_select_indices(torch.zeros(B, dtype=torch.long, device=device))
        pos = (P + torch.arange(Tb, device=device)).unsqueeze(0).expand(B, -1)
        logits = model(
            input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True
        ).logits
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
    ``aggregations`` x ``with_reference`` variants; the values equal :meth:`ImplicitPRM.score`'s (Implicit PRM §3:
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
    rows = [tokenize_prompt_completion(prompt, c, prm.tokenizer) for c in completions]
    p_ids = rows[0]["prompt_ids"]
    c_ids = [r["completion_ids"] for r in rows]
    with prm.prm_context():
        lp = _shared_prompt_logps(prm.model, p_ids, c_ids, batch_size)
    ref = None
    if any(with_reference):
        ref = _candidate_ref_logps(prm, p_ids, c_ids, lp, batch_size, same_weights=same_weights, ref_logps=ref_logps)
    completion_ids, mask = pad_token_rows(c_ids, prm.tokenizer.pad_token_id or 0)
    ends = scoring_step_ends(completion_ids, mask, prm.tokenizer, delimiter=delimiter, step_len=step_len)
    out: dict[str, list[float]] = {}
    for wr in with_reference:
        r = F.implicit_token_rewards(
            prm_logps=lp, ref_logps=ref if wr else torch.zeros_like(lp), mask=mask, beta=prm.beta
        )
        values, smask = F.step_rewards(token_rewards=r, step_ends=ends)
        for how in aggregations:
            key = how if wr else f"{how}/noref"
            out[key] = [float(x) for x in F.aggregate_step_rewards(step_values=values, step_mask=smask, how=how)]
    return (out, lp, ref) if return_logps else out


def _candidate_ref_logps(
    prm: ImplicitPRM,
    prompt_ids: list[int],
    completion_ids: list[list[int]],
    prm_logps: torch.Tensor,
    batch_size: int,
    *,
    same_weights: bool,
    ref_logps: torch.Tensor | None,
) -> torch.Tensor:
    """``(N, T)`` reference log-probs for :func:`score_candidates`: the given ``ref_logps`` (cut to ``T``), the PRM's
    own (``same_weights``), else a shared-prompt forward of the reference model or of the reference adapter.

    Raises:
        ValueError: ``ref_logps`` is shorter than ``T`` or has another number of rows, or the PRM has no reference.
    """
    if ref_logps is not None:
        ref = ref_logps[:, : prm_logps.size(1)].float()
        if ref.shape != prm_logps.shape:
            raise ValueError(
                f"ref_logps has shape {tuple(ref_logps.shape)}; "
                f"expected ({prm_logps.size(0)}, >= {prm_logps.size(1)})."
            )
        return ref
    if same_weights:
        return prm_logps
    if prm.reference == "external":
        raise ValueError("score_candidates needs a reference model or a PEFT PRM (or with_reference=(False,)).")
    with prm.ref_context() as ref_model:
        return _shared_prompt_logps(ref_model, prompt_ids, completion_ids, batch_size)


def argmax_first(scores: Sequence[float]) -> int:
    """Index of the largest score, the first one on ties; NaN never wins over a number (best-of-N selection)."""
    best, bv = 0, None
    for j, x in enumerate(scores):
        v = float("-inf") if x is None or math.isnan(float(x)) else float(x)
        if bv is None or v > bv:
            best, bv = j, v
    return best
