"""``trl-prime best-of-n``: best-of-N with implicit PRMs (Implicit PRM arXiv 2412.01981) vs majority vote vs first
sample vs oracle (pass@N) on held-out problems.

Usage (TRL script style: every field of ``BestOfNArguments`` is a flag or a key of the ``--config`` YAML)::

    trl-prime best-of-n --config recipes/configs/implicit_prm_eval.yaml
    python recipes/evaluate_best_of_n.py --config recipes/configs/implicit_prm_eval.yaml     # the same
    trl-prime best-of-n --config recipes/configs/implicit_prm_eval.yaml \\
        --prm_paths initial outputs/implicit_prm/prm_dpo outputs/implicit_prm/prm_ce_pairable --score_problems 32

1. Samples ``num_samples`` (64) completions per held-out problem ONCE from the policy and caches them with their
   verifier rewards in ``samples_file`` (JSONL; reused when its settings match, so scoring more PRMs is cheap).
2. Scores every completion with every PRM of ``prm_paths`` (an :meth:`ImplicitPRM.from_pretrained` folder, or
   ``initial``: the untrained PRM, i.e. the policy read against itself) for every aggregation (``min``, ``mean``,
   ``sum``, ``last``) with the reference, and without it (``beta * log pi_phi``) when ``score_without_reference``.
   Scores are cached per PRM next to ``output_file``.
3. For each ``N`` in ``ns`` (the first ``N`` samples of each problem) reports accuracy (%) of:
   ``first`` (sample 0), ``majority`` (most frequent normalised ``\\boxed{}`` answer among the N; ties -> the answer
   seen first; no answer at all -> sample 0), ``oracle`` (pass@N: any of the N correct) and ``bon/<prm>/<variant>``
   (the argmax of the PRM score, first wins on ties).

Writes ``output_file`` (JSON: the accuracies; under ``picks`` what each method picked -- the verifier's reasons
``correct`` / ``wrong`` / ``no_answer`` and the mean length, :func:`best_of_n_picks`; under ``score_by_reason`` each
PRM's mean score by reason, :func:`score_by_reason`) and prints a table.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from trl_prime.scripts.utils import PRM_PROMPTS, parse_script_args


@dataclass
class BestOfNArguments:
    """Arguments of ``trl-prime best-of-n`` (flags, or keys of the ``--config`` YAML)."""

    model_name_or_path: str = field(
        default="embedded:smollm2-135m-instruct", metadata={"help": "The policy that samples the candidates."}
    )
    prm_paths: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Implicit PRM folders (ImplicitPRM.from_pretrained), or 'initial' (the untrained PRM: the "
            "policy against itself). Empty: baselines only."
        },
    )
    dataset_name: str = field(
        default="embedded:arithmetic", metadata={"help": "Held-out problems (trl_prime.data.load_prompt_dataset)."}
    )
    dataset_split: str = field(default="test", metadata={"help": "Split of the held-out problems."})
    max_problems: int = field(default=32, metadata={"help": "Held-out problems (embedded: how many to generate)."})
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the embedded problem generator."})
    num_samples: int = field(default=64, metadata={"help": "Completions sampled per problem (>= max of ns)."})
    ns: list[int] = field(default_factory=lambda: [4, 16, 64], metadata={"help": "The N of best-of-N."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling."})
    max_new_tokens: int = field(default=128, metadata={"help": "Completion budget in tokens."})
    batch_size: int = field(default=128, metadata={"help": "Rows decoded together."})
    seed: int = field(default=1234, metadata={"help": "Sampling seed."})
    aggregations: list[str] = field(
        default_factory=lambda: ["min", "mean", "sum", "last"],
        metadata={"help": "Step aggregations of the PRM score."},
    )
    score_without_reference: bool = field(default=True, metadata={"help": "Also score with beta*log pi_phi alone."})
    step_delimiter: str = field(
        default="\n\n", metadata={"help": "Step delimiter in the decoded completion ('' = one step per completion)."}
    )
    step_len: int | None = field(
        default=None, metadata={"help": "Fixed step length in tokens (overrides the delimiter)."}
    )
    prm_prompt: str = field(
        default="full",
        metadata={
            "help": "'full', 'last_turn' or 'question' (the prompt the "
            "PRM sees; use the value the PRM was trained with)."
        },
    )
    prm_batch_size: int = field(default=32, metadata={"help": "Completions per PRM forward."})
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads (1 is fastest on a busy shared CPU)."}
    )
    samples_file: str = field(
        default="outputs/implicit_prm/heldout_samples.jsonl",
        metadata={"help": "Cache of the sampled candidates and their rewards."},
    )
    output_file: str = field(default="outputs/implicit_prm/best_of_n.json", metadata={"help": "Result JSON."})
    score_problems: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate (score and report) only the first K sampled problems (a smaller "
            "CPU budget; the sample cache keeps all of them). None: all."
        },
    )
    reuse_initial_reference: bool = field(
        default=True,
        metadata={
            "help": "When 'initial' was scored first, reuse its log-probs as the reference of the other PRMs "
            "(valid when their reference is the initial checkpoint, as trl-prime implicit-prm trains "
            "them): one forward per PRM instead of two."
        },
    )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the argument on inconsistent settings."""
        from trl_prime.functional import STEP_AGGREGATIONS, check_choice

        if not self.ns or min(self.ns) < 1 or max(self.ns) > self.num_samples:
            raise ValueError(f"--ns {self.ns} must be >= 1 and <= --num_samples ({self.num_samples}).")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 (sampling), got {self.temperature}.")
        for aggregation in self.aggregations:
            check_choice(aggregation, STEP_AGGREGATIONS, "--aggregations")
        check_choice(self.prm_prompt, PRM_PROMPTS, "--prm_prompt")
        if self.max_problems < 1:
            raise ValueError(f"--max_problems must be >= 1, got {self.max_problems}.")
        from trl_prime.models import is_missing_local_path

        if is_missing_local_path(self.model_name_or_path):
            raise ValueError(
                f"--model_name_or_path {self.model_name_or_path}: no such folder (relative paths start at "
                f"{os.getcwd()}). Give a checkpoint folder, a Hub id or embedded:smollm2-135m-instruct."
            )
        for path in self.prm_paths:
            if path != "initial" and is_missing_local_path(path):
                raise ValueError(
                    f"--prm_paths: {path} does not exist (relative paths start at {os.getcwd()}). Train it first "
                    "(trl-prime implicit-prm --config recipes/configs/implicit_prm.yaml writes outputs/implicit_prm/"
                    "prm_dpo), or list only trained PRMs and 'initial'."
                )


# ---------------------------------------------------------------------------------------------------- answers


def normalize_answer(answer: str | None) -> str | None:
    """A canonical key for majority voting: numbers by exact value (``-2``, ``-2.0``, ``-4/2`` agree), else the text
    without spaces, ``$``, ``\\,``, a trailing period and ``\\text{}``/``\\left``/``\\right`` wrappers. None stays
    None."""
    if answer is None:
        return None
    s = answer.strip().replace("$", "").replace("\\,", "").replace("\\!", "").replace(" ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\u2212", "-").rstrip(".")
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[6:-1]
    s = s.replace(",", "") if s.replace(",", "").lstrip("-").replace(".", "", 1).isdigit() else s
    if s.startswith("\\frac{") and s.count("}{") == 1 and s.endswith("}"):
        num, den = s[6:-1].split("}{")
        s = f"{num}/{den}"
    try:
        return str(Fraction(s))
    except (ValueError, ZeroDivisionError):
        return s or None


def majority_index(answers: Sequence[str | None]) -> int:
    """Index of a representative of the most frequent non-None answer key (ties: the key seen first); 0 if none."""
    keys = [normalize_answer(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0
    top = max(counts.values())
    for i, k in enumerate(keys):
        if k is not None and counts[k] == top:
            return i
    return 0  # pragma: no cover


# ---------------------------------------------------------------------------------------------------- sampling


def _sampling_key(args: BestOfNArguments) -> dict:
    return {
        k: getattr(args, k)
        for k in (
            "model_name_or_path",
            "dataset_name",
            "dataset_split",
            "max_problems",
            "dataset_seed",
            "num_samples",
            "temperature",
            "top_p",
            "max_new_tokens",
            "seed",
        )
    }


def load_or_sample(args: BestOfNArguments, generate_fn=None) -> list[dict]:
    """The held-out problems with ``num_samples`` candidates each, from ``samples_file`` or freshly sampled.

    Each record: ``{"id", "prompt", "solution", "completions": [str]*n, "rewards": [float|None]*n,
    "reasons": [str]*n, "answers": [str|None]*n, "truncated": [bool]*n}``. ``generate_fn(prompts, n) -> (texts,
    truncated)`` replaces the policy (tests).
    """
    from trl_prime.data import load_prompt_dataset, outcome_reward
    from trl_prime.implicit_prm.data import _reasons_of
    from trl_prime.rewards.math_verifier import extract_answer

    key = _sampling_key(args)
    path = Path(args.samples_file)
    records = _cached_samples(path, key, args.num_samples)
    if records is not None:
        return records
    ds = load_prompt_dataset(args.dataset_name, args.dataset_split, size=args.max_problems, seed=args.dataset_seed)
    ds = ds.select(range(min(args.max_problems, len(ds))))
    prompts = list(ds["prompt"])
    t0 = time.perf_counter()
    if generate_fn is not None:
        texts, truncated = generate_fn(prompts, args.num_samples)
    else:
        texts, truncated = _sample_policy(prompts, args)
    sampling_s = time.perf_counter() - t0
    n = args.num_samples
    cols = {c: [v for v in ds[c] for _ in range(n)] for c in ds.column_names if c != "prompt"}
    flat = [
        [{"role": "assistant", "content": t}] if not isinstance(p, str) else t
        for p, ts in zip(prompts, texts)
        for t in ts
    ]
    rewards = outcome_reward(completions=flat, **cols)
    reasons = _reasons_of(outcome_reward, rewards)
    records = []
    for i, row in enumerate(ds):
        sl = slice(i * n, (i + 1) * n)
        records.append(
            {
                "id": row.get("id", i),
                "prompt": row["prompt"],
                "solution": row.get("solution"),
                "completions": texts[i],
                "rewards": rewards[sl],
                "reasons": reasons[sl],
                "answers": [extract_answer(t) for t in texts[i]],
                "truncated": truncated[i],
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"settings": key, "sampling_s": round(sampling_s, 1)}) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"[bon] sampled {len(records)} x {n} in {sampling_s:.0f}s -> {path}", flush=True)
    return records


def _cached_samples(path: Path, key: dict, num_samples: int) -> list[dict] | None:
    """The records of ``path`` when its header's settings are ``key``, else None."""
    if not path.is_file():
        return None
    with open(path) as f:
        header = json.loads(f.readline())
        if header.get("settings") == key:
            records = [json.loads(line) for line in f if line.strip()]
            print(f"[bon] reusing {len(records)} problems x {num_samples} samples from {path}", flush=True)
            return records
    print(f"[bon] {path} was sampled with other settings: resampling", flush=True)
    return None


def _sample_policy(prompts: list, args: BestOfNArguments) -> tuple[list, list]:
    """``(texts, truncated)``: ``num_samples`` completions of the policy per prompt (``sample_completions``); the
    policy is freed on return."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_prime.implicit_prm.data import sample_completions
    from trl_prime.models import resolve_model_path

    mp = resolve_model_path(args.model_name_or_path)
    tok = AutoTokenizer.from_pretrained(mp)
    model = AutoModelForCausalLM.from_pretrained(mp)
    return sample_completions(
        model,
        tok,
        prompts,
        args.num_samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=True,
    )


# ---------------------------------------------------------------------------------------------------- scoring


def _prm_label(path: str) -> str:
    return "initial" if path == "initial" else Path(path.rstrip("/")).name


def score_records(
    prm_path: str, records: list[dict], args: BestOfNArguments, prm=None
) -> dict[str, list[list[float]]]:
    """``{variant: [[score] * n] * problems}`` of one PRM, cached in ``<output_file stem>.scores.<label>.json``."""
    from trl_prime.implicit_prm.best_of_n import score_candidates
    from trl_prime.implicit_prm.data import last_turn_prompt, question_prompt

    variants_key = _scores_key(prm_path, records, args)
    cache = Path(args.output_file).with_suffix(f".scores.{_prm_label(prm_path)}.json")
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == variants_key:
            print(f"[bon] reusing PRM scores from {cache}", flush=True)
            return saved["scores"]
    same = prm_path == "initial"
    logps_file = Path(args.output_file).with_suffix(".logps.initial.pt")
    import torch

    initial_logps = None
    if not same and args.reuse_initial_reference:
        initial_logps = _initial_logps(logps_file, variants_key, prm_path)
    kept_logps = []
    if prm is None:
        prm = _load_prm(prm_path, args)
    wr = [True] + ([False] if args.score_without_reference else [])
    scores: dict[str, list[list[float]]] = {}
    t0 = time.perf_counter()
    for i, r in enumerate(records):
        prompt = {"last_turn": last_turn_prompt, "question": question_prompt}.get(args.prm_prompt, lambda x: x)(
            r["prompt"]
        )
        comps = [c if isinstance(prompt, str) else [{"role": "assistant", "content": c}] for c in r["completions"]]
        out, lp, _ = score_candidates(
            prm,
            prompt,
            comps,
            aggregations=args.aggregations,
            with_reference=wr,
            delimiter=args.step_delimiter or None,
            step_len=args.step_len,
            batch_size=args.prm_batch_size,
            same_weights=same,
            ref_logps=None if initial_logps is None else initial_logps[i],
            return_logps=True,
        )
        if same:
            kept_logps.append(lp)
        for k, v in out.items():
            scores.setdefault(k, []).append(v)
        if (i + 1) % 8 == 0 or i + 1 == len(records):
            print(
                f"[bon] {_prm_label(prm_path)}: scored {i + 1}/{len(records)} problems "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": variants_key, "scores": scores}))
    if same:
        torch.save({"key": {k: variants_key[k] for k in ("samples", "prm_prompt")}, "logps": kept_logps}, logps_file)
    return scores


def _scores_key(prm_path: str, records: list[dict], args: BestOfNArguments) -> dict:
    """What a PRM's cached scores depend on: the PRM (and its newest file's mtime), the scoring options, the
    samples."""
    variants_key = {
        "prm": prm_path,
        "aggregations": list(args.aggregations),
        "noref": args.score_without_reference,
        "delimiter": args.step_delimiter,
        "step_len": args.step_len,
        "prm_prompt": args.prm_prompt,
        "samples": hashlib.sha1(json.dumps([r["completions"] for r in records]).encode()).hexdigest(),
    }
    if prm_path != "initial" and os.path.isdir(prm_path):
        # the newest file: retraining into the same folder overwrites files in place (the folder's mtime stays)
        variants_key["prm_mtime"] = max(
            [os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(prm_path) for f in fs]
            or [os.path.getmtime(prm_path)]
        )
    return variants_key


def _initial_logps(logps_file: Path, variants_key: dict, prm_path: str):
    """The initial checkpoint's per-problem log-probs saved in ``logps_file`` for the same samples and PRM prompt
    (the reference of a PRM trained from it), else None."""
    import torch

    if not logps_file.is_file():
        return None
    saved_lp = torch.load(logps_file)
    if saved_lp.get("key") != {k: v for k, v in variants_key.items() if k in ("samples", "prm_prompt")}:
        return None
    print(f"[bon] reference log-probs of {prm_path} from {logps_file} (the initial checkpoint)", flush=True)
    return saved_lp["logps"]


def _load_prm(prm_path: str, args: BestOfNArguments):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_prime import ImplicitPRM
    from trl_prime.models import resolve_model_path

    if prm_path == "initial":
        mp = resolve_model_path(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(mp)
        return ImplicitPRM(model, model, tokenizer=AutoTokenizer.from_pretrained(mp), fused_head=False)
    return ImplicitPRM.from_pretrained(prm_path)


# ---------------------------------------------------------------------------------------------------- metrics


def _correct(reward) -> float:
    return 0.0 if reward is None or (isinstance(reward, float) and math.isnan(reward)) else float(reward >= 1.0)


def best_of_n_metrics(records: list[dict], ns: Sequence[int], prm_scores: dict[str, dict[str, list[list[float]]]]):
    """``{N: {"first", "majority", "oracle", "bon/<prm>/<variant>": accuracy in [0, 1]}}`` over the problems."""
    out = {}
    P = len(records)
    for n in ns:
        picks = _pick_indices(records, n, prm_scores)
        m: dict[str, float] = {}
        for method, idx in picks.items():
            m[method] = sum(_correct(r["rewards"][i]) for r, i in zip(records, idx)) / P
            if method == "majority":  # the fixed columns first, then one per PRM variant
                m["oracle"] = sum(max(_correct(x) for x in r["rewards"][:n]) for r in records) / P
                m["mean_sample"] = sum(sum(_correct(x) for x in r["rewards"][:n]) / n for r in records) / P
        out[n] = m
    return out


def _pick_indices(records: list[dict], n: int, prm_scores: dict[str, dict[str, list[list[float]]]]):
    """``{method: [index of the chosen sample of each problem]}`` among the first ``n`` samples."""
    from trl_prime.implicit_prm.best_of_n import argmax_first

    picks = {"first": [0] * len(records), "majority": [majority_index(r["answers"][:n]) for r in records]}
    for label, variants in prm_scores.items():
        for v, per_problem in variants.items():
            picks[f"bon/{label}/{v}"] = [argmax_first(s[:n]) for s in per_problem]
    return picks


def best_of_n_picks(
    records: list[dict], ns: Sequence[int], prm_scores: dict[str, dict[str, list[list[float]]]]
) -> dict[int, dict[str, dict[str, float]]]:
    """What each method picks: ``{N: {method: {"correct" | "wrong" | "no_answer" | ...: count, "mean_chars": float}}}``.

    The reasons are the verifier's (``records[i]["reasons"]``); a reason no pick has is absent (count 0).
    ``mean_chars`` is the mean length in characters of the picked completions. Read with :func:`score_by_reason`, it
    tells *why* a PRM loses: e.g. one that picks completions without a boxed answer (``no_answer``).
    """
    out = {}
    for n in ns:
        out[n] = {}
        for method, idx in _pick_indices(records, n, prm_scores).items():
            chosen = [(r["reasons"][i], r["completions"][i]) for r, i in zip(records, idx)]
            summary: dict[str, float] = dict(Counter(reason for reason, _ in chosen))
            summary["mean_chars"] = round(sum(len(text) for _, text in chosen) / max(len(chosen), 1), 1)
            out[n][method] = summary
    return out


def score_by_reason(
    records: list[dict], prm_scores: dict[str, dict[str, list[list[float]]]]
) -> dict[str, dict[str, float]]:
    """``{"<prm>/<variant>": {reason: mean score}}``: a PRM's mean score of every scored sample, by verifier reason.

    A PRM that ranks well scores ``correct`` above ``wrong`` and ``no_answer``; one whose scores are negative for
    every kind of completion with ``no_answer`` the least negative will pick answer-less completions.
    """
    out = {}
    for label, variants in prm_scores.items():
        for v, per_problem in variants.items():
            by: dict[str, list[float]] = {}
            for r, scores in zip(records, per_problem):
                for reason, x in zip(r["reasons"], scores):
                    by.setdefault(reason, []).append(x)
            out[f"{label}/{v}"] = {k: round(sum(x) / len(x), 4) for k, x in sorted(by.items())}
    return out


def format_table(metrics: dict[int, dict[str, float]]) -> str:
    """Rows = methods, columns = N, values in %."""
    ns = sorted(metrics)
    names = list(metrics[ns[0]])
    w = max(len(x) for x in names + ["method"])
    lines = ["method".ljust(w) + "".join(f"  N={n:>3}" for n in ns)]
    lines.append("-" * len(lines[0]))
    for name in names:
        lines.append(name.ljust(w) + "".join(f"  {100 * metrics[n][name]:5.1f}" for n in ns))
    return "\n".join(lines)


def main(args: BestOfNArguments, generate_fn=None, prms: dict | None = None) -> dict:
    """Sample (or reuse), score with each PRM, compute the metrics, write ``output_file``; returns the JSON dict.

    ``prms``: optional ``{path_or_label: ImplicitPRM}`` already loaded (tests).
    """
    args.validate()
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    start = time.perf_counter()
    records = load_or_sample(args, generate_fn)
    if args.score_problems is not None:
        records = records[: args.score_problems]
    prm_scores = {}
    for path in args.prm_paths:
        prm_scores[_prm_label(path)] = score_records(path, records, args, prm=(prms or {}).get(path))
    metrics = best_of_n_metrics(records, args.ns, prm_scores)
    n_total = sum(len(r["rewards"]) for r in records)
    result = {
        "arguments": asdict(args),
        "n_problems": len(records),
        "sample_accuracy": sum(_correct(x) for r in records for x in r["rewards"]) / n_total,
        "n_unscored": sum(1 for r in records for x in r["rewards"] if x is None),
        "reasons": dict(Counter(x for r in records for x in r["reasons"])),
        "metrics": {str(n): m for n, m in metrics.items()},
        "picks": {str(n): m for n, m in best_of_n_picks(records, args.ns, prm_scores).items()},
        "score_by_reason": score_by_reason(records, prm_scores),
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    out = Path(args.output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(metrics))
    print(
        f"[bon] {len(records)} problems, per-sample accuracy {100 * result['sample_accuracy']:.1f}%; wrote {out}",
        flush=True,
    )
    return result


def parse_args(argv: Sequence[str] | None = None, default_config: str | None = None) -> BestOfNArguments:
    """The arguments from the command line (default ``sys.argv[1:]``) and the ``--config`` YAML."""
    return parse_script_args((BestOfNArguments,), "trl-prime best-of-n", argv, default_config)[0]


def run(argv: Sequence[str] | None = None, default_config: str | None = None) -> dict:
    """The command line: :func:`parse_args`, then :func:`main`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trl_prime.cli_errors import command_line_errors

    with command_line_errors():
        parsed = parse_args(argv, default_config)
        parsed.validate()  # a missing --prm_paths folder: a one-line error before any sampling
    return main(parsed)


if __name__ == "__main__":
    run()
