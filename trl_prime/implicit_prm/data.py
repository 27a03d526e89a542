"""Training rows for an implicit PRM from outcome labels: K rollouts per prompt from a policy, labelled by a verifier
(Implicit PRM arXiv 2412.01981 Sec. 4).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_prime.implicit_prm.model import tokenize_prompt_completion
from trl_prime.modeling import eval_mode, position_ids_from_mask, unwrap

REQUIRED_COLUMNS = ("prompt", "completion", "label")


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def _prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


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
