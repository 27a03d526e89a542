"""Training rows for an implicit PRM: K rollouts per prompt from a policy, labelled by a verifier.

An implicit PRM is trained on outcome labels of the policy's own samples (Implicit PRM arXiv 2412.01981 Sec. 3; the
data of its Sec. 4 experiments):

- :func:`sample_completions`: ``num_generations`` completions per prompt from a KV-cached sampler that drops
  finished rows (ancestral sampling at ``temperature`` with nucleus ``top_p``, seeded per batch);
- :func:`build_outcome_dataset`: rolls out a policy with :func:`sample_completions` and labels each completion with
  a verifier (default :data:`trl_prime.data.outcome_reward`, the checkers of :mod:`trl_prime.rewards`);
- :func:`pairable_rows`, :func:`question_prompt`, :func:`last_turn_prompt`: a row filter for ``dpo``/``nca`` and
  shorter PRM prompts (``prm_prompt=`` in the recipes).

The outcome dataset has one row per scorable completion: ``prompt`` (as given), ``completion`` (a string for a
string prompt; ``[{"role": "assistant", "content": text}]`` for a conversational prompt, TRL's convention),
``label`` (float reward in [0, 1]), ``prompt_id`` (int, index of the prompt in the prompt set; the ``id`` column's
value is kept in ``source_id`` when present), ``reason`` (the verifier's reason: ``correct``, ``wrong``,
``no_answer``, ...) and ``truncated`` (bool, hit ``max_new_tokens``). Its statistics (``return_stats=True``):
``n_prompts``, ``n_completions``, ``n_rows``, ``n_unscored`` (rows dropped: the verifier returned ``None``/NaN, e.g.
bad gold or a sandbox failure), ``reasons`` (counts, unscored included), ``mean_label``, ``n_truncated``,
``n_mixed_prompts`` (prompts with both a label > 0.5 and one < 0.5: the ones DPO/NCA can pair) and ``sampling_s``.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_prime.implicit_prm.model import pad_token_rows, tokenize_prompt_completion
from trl_prime.modeling import eval_mode, position_ids_from_mask, unwrap


REQUIRED_COLUMNS = ("prompt", "completion", "label")


def prompt_key(prompt: Any) -> str:
    """A hashable key of a prompt (a conversation as sorted JSON): rows with equal keys form one prompt group."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------------------
# Sampling
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
        model / tokenizer: a causal LM (eval mode is set for the call) and its tokenizer.
        prompts: ``P`` prompts (strings or lists of messages).
        num_generations: ``K >= 1`` completions per prompt.
        max_new_tokens: completion budget in tokens (EOS included), ``>= 1``.
        temperature / top_p: ``temperature > 0`` (a small value for near-greedy decoding); nucleus mass ``top_p`` in
            ``(0, 1]``.
        batch_size: rows decoded together (rounded to whole prompts, at least one prompt).
        seed: sampling seed.
        progress: print one line per batch.

    Returns:
        ``(texts, truncated)``: ``P`` lists of ``K`` decoded completions (special tokens skipped) and, for each,
        whether it stopped at ``max_new_tokens`` without EOS.

    Raises:
        ValueError: ``num_generations < 1``, ``temperature <= 0``, ``top_p`` outside ``(0, 1]`` or
            ``max_new_tokens < 1``.
    """
    _check_sampling_args(num_generations, temperature, top_p, max_new_tokens)
    model = unwrap(model)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    per_batch = max(1, batch_size // num_generations)  # whole prompts per batch
    texts, truncated = [], []  # P lists of K completions / of K flags
    with eval_mode(model):
        for b0 in range(0, len(prompts), per_batch):
            t0 = time.perf_counter()
            chunk = [prompts[i] for i in range(b0, min(b0 + per_batch, len(prompts)))]
            chunk_texts, chunk_truncated, n_tokens = _sample_prompts(
                model, tokenizer, chunk, num_generations, seed=int(seed) + b0, **sampling
            )
            texts += chunk_texts
            truncated += chunk_truncated
            if progress:
                _print_progress(b0 + len(chunk), len(prompts), n_tokens, time.perf_counter() - t0)
    return texts, truncated


def _check_sampling_args(num_generations: int, temperature: float, top_p: float, max_new_tokens: int) -> None:
    """Raise the :func:`sample_completions` ``ValueError`` of an out-of-range argument."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")


def _sample_prompts(
    model: nn.Module, tokenizer, prompts: list[Any], num_generations: int, *, seed: int, **sampling
) -> tuple[list[list[str]], list[list[bool]], int]:
    """One batch of :func:`sample_completions`: ``(texts, truncated, n_tokens)`` of ``num_generations`` completions
    of each prompt, sampled from a ``torch.Generator`` seeded with ``seed`` (``sampling``: ``max_new_tokens``,
    ``temperature``, ``top_p``)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens, cut = _sample_token_ids(
        model,
        [_render_prompt(p, tokenizer) for p in prompts],
        num_generations,
        pad_token_id=pad,
        eos_ids=_eos_token_ids(model, tokenizer, device),
        generator=generator,
        **sampling,
    )
    rows, ks = range(len(prompts)), range(num_generations)
    texts = [[tokenizer.decode(tokens[(r, k)], skip_special_tokens=True) for k in ks] for r in rows]
    truncated = [[(r, k) in cut for k in ks] for r in rows]
    return texts, truncated, sum(map(len, tokens.values()))


def _eos_token_ids(model: nn.Module, tokenizer, device: torch.device) -> torch.Tensor:
    """Sorted ``(E,)`` long tensor of the ids that end a completion: the model's generation EOS ids and the
    tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return torch.tensor(sorted(eos), device=device, dtype=torch.long)


def _sample_token_ids(
    model: nn.Module,
    prompt_ids: list[list[int]],
    num_generations: int,
    *,
    pad_token_id: int,
    eos_ids: torch.Tensor,
    generator: torch.Generator,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
) -> tuple[dict[tuple[int, int], list[int]], set[tuple[int, int]]]:
    """Decode ``num_generations`` completions of each prompt; a row leaves the batch (and the cache) once it ends.

    Returns:
        ``(tokens, truncated)``: ``tokens[(r, k)]`` the ids of completion ``k`` of prompt ``r`` (its EOS included)
        and the ``(r, k)`` that stopped at ``max_new_tokens`` without EOS.
    """
    cache, logits, am, owner = _prefill(model, prompt_ids, num_generations, pad_token_id)
    slot = [k for _ in prompt_ids for k in range(num_generations)]  # owner[j], slot[j]: the (r, k) of active row j
    tokens = {(r, k): [] for r in range(len(prompt_ids)) for k in range(num_generations)}
    truncated: set[tuple[int, int]] = set()
    for step in range(max_new_tokens):
        nxt = _sample_next_token(logits, temperature, top_p, generator)
        done = torch.isin(nxt, eos_ids)
        for j, tok in enumerate(nxt.tolist()):
            tokens[(owner[j], slot[j])].append(tok)
        if step == max_new_tokens - 1:
            truncated = {(owner[j], slot[j]) for j in range(len(owner)) if not bool(done[j])}
            break
        keep = (~done).nonzero().squeeze(-1)
        if keep.numel() == 0:
            break
        if keep.numel() < len(owner):
            cache.batch_select_indices(keep)
            am, nxt = am[keep], nxt[keep]
            owner, slot = [owner[j] for j in keep.tolist()], [slot[j] for j in keep.tolist()]
        am = torch.cat([am, am.new_ones((am.size(0), 1))], dim=1)
        out = model(
            input_ids=nxt[:, None],
            attention_mask=am,
            position_ids=(am.sum(-1, keepdim=True) - 1),
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
    return tokens, truncated


def _prefill(model: nn.Module, prompt_ids: list[list[int]], num_generations: int, pad_token_id: int):
    """Run the (left-padded) prompts once and repeat each prompt's KV cache ``num_generations`` times.

    Returns:
        ``(cache, logits, attention_mask, rows)``: the repeated cache, the ``(B*K, V)`` float32 next-token logits,
        the ``(B*K, P)`` attention mask and the prompt index of each of the ``B*K`` rows.
    """
    device = next(model.parameters()).device
    input_ids, attention_mask = pad_token_rows(prompt_ids, pad_token_id, padding_side="left")
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=True,
        logits_to_keep=1,
    )
    rows = torch.arange(len(prompt_ids), device=device).repeat_interleave(num_generations)
    cache = out.past_key_values
    cache.batch_select_indices(rows)
    return cache, out.logits[:, -1].float()[rows], attention_mask[rows], rows.tolist()


def _sample_next_token(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """``(B,)`` next tokens drawn from ``softmax(logits / temperature)`` restricted to its nucleus ``top_p``."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp > top_p  # keep the smallest prefix with mass >= top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    # inverse-CDF sampling (torch.multinomial is ~50x slower on CPU over a 50k vocabulary); right=True:
    # the first index whose cdf exceeds u, so a token of probability 0 is never drawn
    cdf = probs.cumsum(-1)
    u = torch.rand((cdf.size(0), 1), generator=generator, device=logits.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.size(-1) - 1)


def _print_progress(n_done: int, n_prompts: int, n_tokens: int, seconds: float) -> None:
    print(f"[sample] prompts {n_done}/{n_prompts}: {n_tokens} tokens in {seconds:.1f}s", flush=True)  # noqa: T201


# ----------------------------------------------------------------------------------------------------------------
# The outcome-labelled dataset
# ----------------------------------------------------------------------------------------------------------------
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
        "unscored"
        if r is None or (isinstance(r, float) and math.isnan(r))
        else ("correct" if r >= 1.0 else ("wrong" if r <= 0 else "partial"))
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

    The first call of the two-call workflow (Implicit PRM arXiv 2412.01981 Sec. 3: an implicit PRM is trained on
    outcome labels of the policy's own samples); the rows and the stats are described in this module's docstring::

        data = build_outcome_dataset("embedded:smollm2-135m-instruct", load_prompt_dataset("embedded:arithmetic"))
        ImplicitPRMTrainer(model=path, args=ImplicitPRMConfig(...), train_dataset=data).train()

    Args:
        policy: a causal LM, or a path / Hub id / ``embedded:<key>`` (:func:`trl_prime.models.resolve_model_path`).
        prompts_dataset: a ``datasets.Dataset`` (or list of dicts) with ``prompt_column`` (string or messages) and the
            columns the verifier needs (``solution``; ``ability``/``data_source``/``tests`` for code).
        reward_func: TRL-style ``f(prompts=, completions=, **columns) -> list[float | None]``, rewards in [0, 1]
            (default :data:`trl_prime.data.outcome_reward`); ``None``/NaN (unscorable) rows are dropped and counted.
        num_generations / max_new_tokens / temperature / top_p / batch_size / seed / progress: sampling
            (:func:`sample_completions`; ``K = num_generations`` rollouts per prompt).
        tokenizer: the policy's tokenizer (default: loaded from the policy's path).
        prompt_column / return_stats: the prompt column; also return the statistics dict.

    Returns:
        A ``datasets.Dataset`` of the outcome rows (one per scorable completion); with ``return_stats``,
        ``(dataset, stats)``.

    Raises:
        ValueError: ``prompt_column`` is missing, a reward is outside [0, 1], or the verifier returns the wrong
            number of rewards.
    """
    from datasets import Dataset

    prompts_dataset = _prompts_dataset(prompts_dataset, prompt_column)
    model, tokenizer = _load_policy(policy, tokenizer)
    prompts = list(prompts_dataset[prompt_column])
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, batch_size=batch_size)
    t0 = time.perf_counter()
    texts, truncated = sample_completions(
        model, tokenizer, prompts, num_generations, seed=seed, progress=progress, **sampling
    )
    sampling_s = time.perf_counter() - t0
    verified = _verify_rollouts(prompts_dataset, prompt_column, prompts, texts, reward_func)
    rows, n_unscored, reasons = _outcome_rows(*verified, truncated, prompts_dataset)
    dataset = Dataset.from_dict(rows)
    if not return_stats:
        return dataset
    return dataset, _outcome_stats(rows, truncated, n_unscored, reasons, sampling_s)


def _prompts_dataset(prompts_dataset, prompt_column: str):
    """``prompts_dataset`` as a ``datasets.Dataset`` (a list of dicts is converted) holding ``prompt_column``."""
    from datasets import Dataset

    if isinstance(prompts_dataset, list):
        prompts_dataset = Dataset.from_list(prompts_dataset)
    cols = list(prompts_dataset.column_names)
    if prompt_column not in cols:
        raise ValueError(f"the prompts dataset has no column {prompt_column!r} (columns: {cols}).")
    return prompts_dataset


def _load_policy(policy: str | nn.Module, tokenizer) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of the sampling policy: loaded from a path / Hub id / ``embedded:<key>``, or the model
    given with its tokenizer (loaded from the model's recorded path when ``tokenizer`` is ``None``)."""
    if isinstance(policy, str):
        from trl_prime.models import resolve_model_path

        path = resolve_model_path(policy)
        return AutoModelForCausalLM.from_pretrained(path), tokenizer or AutoTokenizer.from_pretrained(path)
    if tokenizer is None:
        src = getattr(unwrap(policy).config, "_name_or_path", None)
        if not src:
            raise ValueError("Pass `tokenizer`: the policy records no path to load its tokenizer from.")
        tokenizer = AutoTokenizer.from_pretrained(src)
    return policy, tokenizer


def _verify_rollouts(prompts_dataset, prompt_column: str, prompts: list[Any], texts: list[list[str]], reward_func):
    """Label every rollout with the verifier (``reward_func``, default :data:`trl_prime.data.outcome_reward`).

    Returns:
        ``(prompts, completions, rewards, reasons)``, flat over prompts then rollouts (``P * K`` each); a
        conversational prompt's completion is ``[{"role": "assistant", "content": text}]`` (TRL's convention).
    """
    if reward_func is None:
        from trl_prime.data import outcome_reward as reward_func

    K = len(texts[0]) if texts else 0
    flat_prompts = [p for p in prompts for _ in range(K)]
    flat_completions = [
        c if isinstance(p, str) else [{"role": "assistant", "content": c}] for p, cs in zip(prompts, texts) for c in cs
    ]
    columns = [c for c in prompts_dataset.column_names if c != prompt_column]
    extra = {c: [v for v in prompts_dataset[c] for _ in range(K)] for c in columns}
    rewards = list(reward_func(prompts=flat_prompts, completions=flat_completions, **extra))
    if len(rewards) != len(flat_completions):
        raise ValueError(
            f"the reward function returned {len(rewards)} rewards for {len(flat_completions)} completions."
        )
    return flat_prompts, flat_completions, rewards, _reasons_of(reward_func, rewards)


def _outcome_rows(prompts, completions, rewards, reasons, truncated: list[list[bool]], prompts_dataset):
    """The columns of the outcome dataset, the number of unscorable rollouts dropped and the count of each reason.

    Raises:
        ValueError: a reward is outside [0, 1].
    """
    K = len(truncated[0]) if truncated else 0
    ids = list(prompts_dataset["id"]) if "id" in prompts_dataset.column_names else None
    rows = {"prompt": [], "completion": [], "label": [], "prompt_id": [], "reason": [], "truncated": []}
    if ids is not None:
        rows["source_id"] = []
    n_unscored = 0
    counts: dict[str, int] = defaultdict(int)
    for j, (p, c, r, why) in enumerate(zip(prompts, completions, rewards, reasons)):
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
    return rows, n_unscored, counts


def _outcome_stats(rows, truncated: list[list[bool]], n_unscored: int, reasons, sampling_s: float) -> dict:
    """The statistics of :func:`build_outcome_dataset` (keys in this module's docstring)."""
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for i, y in zip(rows["prompt_id"], rows["label"]):
        by_prompt[i].append(y)
    return {
        "n_prompts": len(truncated),
        "n_completions": sum(map(len, truncated)),
        "n_rows": len(rows["label"]),
        "n_unscored": n_unscored,
        "reasons": dict(reasons),
        "mean_label": (sum(rows["label"]) / len(rows["label"])) if rows["label"] else float("nan"),
        "n_truncated": sum(sum(t) for t in truncated),
        "n_mixed_prompts": sum(1 for ys in by_prompt.values() if max(ys) > 0.5 and min(ys) < 0.5),
        "sampling_s": round(sampling_s, 1),
    }


# ----------------------------------------------------------------------------------------------------------------
# Row filters and PRM prompts
# ----------------------------------------------------------------------------------------------------------------
def pairable_rows(dataset):
    """Keep only the rows of prompts that have both a label > 0.5 and a label < 0.5 (the ones DPO/NCA can pair).

    Args:
        dataset: a ``datasets.Dataset`` with ``prompt`` and ``label`` columns.

    Returns:
        The filtered dataset (row order kept). Prompts whose completions are all correct or all wrong contribute no
        (correct, incorrect) pair to ``dpo``/``nca`` but still cost a forward; dropping them saves that compute.
    """
    by_prompt: dict[str, set[bool]] = defaultdict(set)
    keys = [prompt_key(p) for p in dataset["prompt"]]
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
