"""``trl-prime eval``: evaluate a model, pass@1, avg@k and pass@k with the math / code verifiers on one or more
datasets.

Usage (TRL script style: every field of ``EvaluateScriptArguments`` is a flag, or a key of a YAML config)::

    trl-prime eval --config recipes/configs/evaluate.yaml
    python recipes/evaluate.py --config recipes/configs/evaluate.yaml     # the same
    trl-prime eval --model_name_or_path embedded:smollm2-135m-instruct \\
        --datasets embedded:arithmetic embedded:gsm_symbolic --max_problems 100 \\
        --num_samples 4 --temperature 0.7 --top_p 0.95 --max_new_tokens 256
    trl-prime eval --model_name_or_path PRIME-RL/Eurus-2-7B-PRIME \\
        --datasets PRIME-RL/Eurus-2-RL-Data --dataset_split test --use_vllm true --num_samples 16

Each dataset is loaded with :func:`trl_prime.data.load_prompt_dataset` (``embedded:<name>`` reasoning-gym
problems, local JSON/JSONL/Parquet files or Hub datasets in the Eurus-2-RL-Data format), every prompt is
sampled ``num_samples`` times (HF ``generate`` in batches, or vLLM with ``--use_vllm``), and each completion
is scored by :data:`trl_prime.data.outcome_reward` (``math_reward`` for math rows, ``code_reward`` for code
rows). The metrics (:mod:`trl_prime.evaluation`): ``pass@k`` for the requested k (unbiased estimator of Chen et
al. 2021), ``avg@n`` (mean reward), per dataset and per data source, and their micro (problem-weighted) and
macro (mean over datasets) averages. Unscorable completions count as wrong and are reported (``n_unscored``).
Local GSM8K and MATH / MATH-500 JSONL files are read by path (no Hub access; format from the columns, see
:mod:`trl_prime.data`); when the rows have MATH's ``level`` / ``subject`` (or ``type``), the metrics per level and
per subject are reported too, in the JSON and in a second table::

    trl-prime eval --model_name_or_path Qwen/Qwen2.5-Math-1.5B-Instruct --datasets data/gsm8k_test.jsonl \\
        data/math500_test.jsonl --system_prompt "Put your final answer within \\boxed{}."

Writes ``output_file`` (JSON; layout in :func:`main`) and, with ``save_completions``, a JSONL file next to it
with every completion and its reward; prints a table.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl_prime.evaluation import (
    aggregate,
    dataset_metrics,
    default_ks,
    format_breakdowns,
    format_table,
    grouped_metrics,
    metric_names,
)
from trl_prime.scripts.utils import parse_script_args


#: ``generate_fn(prompt_texts, num_samples) -> [[completion] * num_samples] * len(prompt_texts)``
GenerateFn = Callable[[Sequence[str], int], list[list[str]]]


@dataclass
class EvaluateScriptArguments:
    """Arguments of ``trl-prime eval`` (flags, or keys of the ``--config`` YAML)."""

    model_name_or_path: str = field(
        default="embedded:smollm2-135m-instruct",
        metadata={"help": "Hub id, local folder, or embedded:<key> (see trl_prime.models)."},
    )
    datasets: list[str] = field(
        default_factory=lambda: ["embedded:arithmetic"],
        metadata={
            "help": "Datasets for trl_prime.data.load_prompt_dataset: embedded:<name>, a .json/.jsonl/"
            ".parquet file or folder, or a Hub id, in the Eurus-2-RL-Data, GSM8K (question, answer '... #### N') "
            "or MATH / MATH-500 (problem, solution, answer, level, subject or type) format, detected from the "
            "columns."
        },
    )
    on_bad_rows: str = field(
        default="error",
        metadata={
            "help": "A malformed row (e.g. without its gold answer): 'error' stops with its file, line and field "
            "(an evaluation's denominator never shrinks silently); 'drop' skips it with a warning and a count."
        },
    )
    dataset_split: str = field(
        default="test", metadata={"help": "Split to evaluate ('test' falls back to 'validation' on the Hub)."}
    )
    max_problems: int | None = field(
        default=None,
        metadata={"help": "Problems per dataset (first N; embedded data: how many to generate, default 200)."},
    )
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the embedded problem generator."})
    num_samples: int = field(default=1, metadata={"help": "Completions per prompt (n)."})
    pass_k: list[int] = field(
        default_factory=list, metadata={"help": "k values of pass@k (default: 1, powers of 2 below n, and n)."}
    )
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (then num_samples must be 1)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling (ignored when greedy)."})
    max_new_tokens: int = field(default=512, metadata={"help": "Maximum completion length in tokens."})
    batch_size: int = field(default=32, metadata={"help": "Sequences per HF generate call."})
    seed: int = field(default=42, metadata={"help": "Sampling seed (reset before each dataset)."})
    dtype: str = field(
        default="auto",
        metadata={"help": "auto (bf16 on a GPU that supports it, else float32), float32, bfloat16 or float16."},
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "Prepended as a system message (replaces the dataset's own system message)."}
    )
    success_threshold: float = field(
        default=1.0,
        metadata={"help": "A completion is correct when its reward is >= this (code rewards are fractions)."},
    )
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (must be installed)."})
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM GPU memory share."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallel size."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})
    num_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch CPU threads (default: torch's). On a CPU shared with other busy "
            "processes, 1 can be ~10x faster than oversubscribed OpenMP threads."
        },
    )
    output_file: str = field(default="outputs/eval/results.json", metadata={"help": "Where the JSON goes."})
    save_completions: bool = field(default=True, metadata={"help": "Also write <output>.completions.jsonl."})

    def validate(self) -> None:
        """Raise ``ValueError`` (naming the argument and the fix) on inconsistent settings."""
        if not self.datasets:
            raise ValueError("--datasets is empty; name at least one dataset, e.g. --datasets embedded:arithmetic")
        if self.num_samples < 1:
            raise ValueError(f"--num_samples must be >= 1, got {self.num_samples}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.num_samples > 1:
            raise ValueError(
                "--temperature 0 is greedy decoding, whose samples are all the same; use "
                f"--num_samples 1 or a temperature > 0 (got --num_samples {self.num_samples})"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}")
        bad = [k for k in self.pass_k if not 1 <= k <= self.num_samples]
        if bad:
            raise ValueError(
                f"--pass_k {bad}: pass@k needs 1 <= k <= --num_samples ({self.num_samples}); sample more "
                "completions or lower k"
            )
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("--max_new_tokens and --batch_size must be >= 1")
        if self.max_problems is not None and self.max_problems < 1:
            raise ValueError(f"--max_problems must be >= 1, got {self.max_problems}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.on_bad_rows not in ("error", "drop"):
            raise ValueError(f"--on_bad_rows must be error or drop, got {self.on_bad_rows!r}")
        if not 0 < self.success_threshold <= 1:
            raise ValueError(f"--success_threshold must be in (0, 1], got {self.success_threshold}")


# ---------------------------------------------------------------------------------------------------- generation


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        if device == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The text the model continues: the chat template with the generation prompt, or the plain contents."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


class HFGenerator:
    """Batched sampling with ``transformers`` ``generate`` (left padding, sequences grouped by prompt)."""

    def __init__(self, model_path: str, args: EvaluateScriptArguments, tokenizer):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = tokenizer
        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=_torch_dtype(args.dtype, self.device), trust_remote_code=args.trust_remote_code
        ).to(self.device)
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos = eos

    def _generation_config(self):
        from transformers import GenerationConfig

        a = self.args
        sample = a.temperature > 0
        kw = dict(
            max_new_tokens=a.max_new_tokens,
            do_sample=sample,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        if sample:
            kw.update(temperature=a.temperature, top_p=a.top_p, top_k=0)
        return GenerationConfig(**kw)

    def __call__(self, texts: Sequence[str], num_samples: int) -> list[list[str]]:
        import torch
        from tqdm.auto import tqdm

        templated = bool(getattr(self.tokenizer, "chat_template", None))
        jobs = [i for i in range(len(texts)) for _ in range(num_samples)]
        out: list[list[str]] = [[] for _ in texts]
        config = self._generation_config()
        bs = self.args.batch_size
        for start in tqdm(range(0, len(jobs), bs), desc="generate", unit="batch"):
            idx = jobs[start : start + bs]
            enc = self.tokenizer(
                [texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=not templated
            ).to(self.device)
            with torch.no_grad():
                seqs = self.model.generate(**enc, generation_config=config)
            completions = self.tokenizer.batch_decode(seqs[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for i, c in zip(idx, completions):
                out[i].append(c)
        return out


class VLLMGenerator:
    """Sampling with vLLM (``--use_vllm``): prompts are tokenised here, so both backends see the same ids."""

    def __init__(self, model_path: str, args: EvaluateScriptArguments, tokenizer):
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                "--use_vllm needs vLLM: `pip install vllm` (or `pip install -e '.[vllm]'`), or drop "
                "--use_vllm to generate with transformers"
            ) from e
        self.args = args
        self.tokenizer = tokenizer
        dtype = "auto" if args.dtype == "auto" else args.dtype
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=args.seed,
            trust_remote_code=args.trust_remote_code,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
        )

    def __call__(self, texts: Sequence[str], num_samples: int) -> list[list[str]]:
        from vllm import SamplingParams

        a = self.args
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        params = SamplingParams(
            n=num_samples,
            temperature=a.temperature,
            top_p=a.top_p if a.temperature > 0 else 1.0,
            max_tokens=a.max_new_tokens,
            seed=a.seed,
        )
        prompts = [
            {"prompt_token_ids": self.tokenizer(t, add_special_tokens=not templated)["input_ids"]} for t in texts
        ]
        results = self.llm.generate(prompts, params)
        return [[o.text for o in r.outputs] for r in results]


# ---------------------------------------------------------------------------------------------------- evaluation


def _messages(prompt: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt is None:
        return list(prompt)
    return [{"role": "system", "content": system_prompt}] + [m for m in prompt if m["role"] != "system"]


def evaluate_dataset(
    name: str, dataset, generate: GenerateFn, tokenizer, args: EvaluateScriptArguments, ks: list[int]
) -> tuple[dict, list[dict]]:
    """Generate, score and summarise one dataset; returns (its JSON entry, its completion records)."""
    from trl_prime.data import METADATA_COLUMNS, make_routed_reward
    from trl_prime.rewards.registry import verifiers

    n = args.num_samples
    texts = [render_prompt(tokenizer, _messages(p, args.system_prompt)) for p in dataset["prompt"]]
    t0 = time.perf_counter()
    completions = generate(texts, n)
    gen_s = time.perf_counter() - t0
    if len(completions) != len(texts) or any(len(c) != n for c in completions):
        raise RuntimeError(
            f"the generator returned {len(completions)} prompts x {[len(c) for c in completions][:5]} "
            f"samples; expected {len(texts)} x {n}"
        )
    flat = [c for cs in completions for c in cs]

    def rep(col):
        return [v for v in dataset[col] for _ in range(n)]

    reward_fn = make_routed_reward()
    t0 = time.perf_counter()
    golds = {v.gold_column: rep(v.gold_column) for v in verifiers() if v.gold_column in dataset.column_names}
    flat_rewards = reward_fn(flat, ability=rep("ability"), data_source=rep("data_source"), **golds)
    score_s = time.perf_counter() - t0
    routes = dict(reward_fn.last_counts)
    rewards = [flat_rewards[i * n : (i + 1) * n] for i in range(len(texts))]

    entry = dict(dataset_metrics(rewards, ks, threshold=args.success_threshold))
    entry["split"] = args.dataset_split
    entry["routes"] = routes
    for v in verifiers():  # each route's reason counts, e.g. "math_reasons"
        if routes.get(v.ability):
            entry[f"{v.ability}_reasons"] = dict(v.reward_fn().last_counts)
    sources = sorted(set(dataset["data_source"]))
    if len(sources) > 1:
        entry["by_data_source"] = grouped_metrics(rewards, dataset["data_source"], ks, args.success_threshold)
    for column in METADATA_COLUMNS:  # MATH's level and subject
        if column in dataset.column_names and any(v is not None for v in dataset[column]):
            entry[f"by_{column}"] = grouped_metrics(rewards, dataset[column], ks, args.success_threshold)
    entry["generation_s"] = round(gen_s, 3)
    entry["scoring_s"] = round(score_s, 3)
    records = [
        {
            "dataset": name,
            "id": row_id,
            "data_source": src,
            "prompt": text,
            "solution": sol,
            "completions": cs,
            "rewards": rs,
        }
        for row_id, src, text, sol, cs, rs in zip(
            dataset["id"], dataset["data_source"], texts, dataset["solution"], completions, rewards
        )
    ]
    return entry, records


def main(args: EvaluateScriptArguments, generate_fn: GenerateFn | None = None) -> dict:
    """Run the evaluation and write the results.

    Args:
        args: the script arguments.
        generate_fn: optional generator (``texts, n -> n completions per text``) replacing the model; the model
            is then not loaded, but its tokenizer still renders the prompts when ``model_name_or_path`` loads.

    Returns:
        The JSON written to ``args.output_file``::

            {"model_name_or_path": ..., "model_path": <resolved folder or id>, "backend": "hf" | "vllm" | "custom",
             "arguments": {...every argument...}, "metric_names": ["pass@1", ..., "avg@n"],
             "datasets": {name: {"pass@1": ..., "pass@k": ..., "avg@n": ..., "n_problems", "n_samples",
                                 "n_correct", "n_unscored", "split", "routes": {"math", "code", "unrouted"},
                                 "math_reasons" / "code_reasons": {reason: count},
                                 "by_data_source": {source: metrics} (when the dataset mixes sources),
                                 "by_level" / "by_subject": {group: metrics} (when the rows have them: MATH),
                                 "generation_s", "scoring_s"}},
             "micro": {metric: problem-weighted mean, "n_problems"},
             "macro": {metric: mean over datasets, "n_datasets"},
             "elapsed_s": ...}
    """
    args.validate()
    from transformers import set_seed

    from trl_prime.data import load_prompt_dataset
    from trl_prime.models import resolve_model_path

    start = time.perf_counter()
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    ks = sorted(set(args.pass_k)) if args.pass_k else default_ks(args.num_samples)
    model_path = resolve_model_path(args.model_name_or_path)  # first: a missing folder fails before any loading
    datasets = {}
    load = dict(size=args.max_problems, seed=args.dataset_seed, on_bad_rows=args.on_bad_rows, metadata=True)
    for name in args.datasets:
        datasets[name] = load_prompt_dataset(name, args.dataset_split, **load)
        print(f"[evaluate] {name} ({args.dataset_split}): {len(datasets[name])} problems", flush=True)

    backend, generate, tokenizer = make_generator(args, model_path, generate_fn)
    per_dataset, records = {}, []
    for name, ds in datasets.items():
        set_seed(args.seed)
        entry, recs = evaluate_dataset(name, ds, generate, tokenizer, args, ks)
        per_dataset[name] = entry
        records.extend(recs)
    names = metric_names(args.num_samples, ks)
    averages = aggregate(per_dataset, names)
    result = {
        "model_name_or_path": args.model_name_or_path,
        "model_path": model_path,
        "backend": backend,
        "arguments": asdict(args),
        "metric_names": names,
        "datasets": per_dataset,
        "micro": averages["micro"],
        "macro": averages["macro"],
        "elapsed_s": round(time.perf_counter() - start, 3),
    }
    write_results(args, result, records)
    return result


def make_generator(args: EvaluateScriptArguments, model_path: str, generate_fn: GenerateFn | None = None):
    """``(backend, generate, tokenizer)``: ``generate_fn`` (``"custom"``; the tokenizer is None when it does not
    load), else vLLM (``use_vllm``) or HF ``generate`` on ``model_path``."""
    tokenizer = None
    try:
        tokenizer = load_tokenizer(model_path, args.trust_remote_code)
    except Exception:
        if generate_fn is None:
            raise
    if generate_fn is not None:
        return "custom", generate_fn, tokenizer
    if args.use_vllm:
        return "vllm", VLLMGenerator(model_path, args, tokenizer), tokenizer
    return "hf", HFGenerator(model_path, args, tokenizer), tokenizer


def write_results(args: EvaluateScriptArguments, result: dict, records: list[dict]) -> None:
    """``output_file`` (the JSON), ``<output_file>.completions.jsonl`` (with ``save_completions``) and the table."""
    out = Path(args.output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.save_completions:
        with open(out.with_suffix(".completions.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    averages = {"micro": result["micro"], "macro": result["macro"]}
    print(format_table(result["datasets"], averages, result["metric_names"]))
    breakdowns = format_breakdowns(result["datasets"], result["metric_names"])
    if breakdowns:
        print(breakdowns)
    print(
        f"[evaluate] wrote {out}" + (f" and {out.with_suffix('.completions.jsonl')}" if args.save_completions else ""),
        flush=True,
    )


def parse_args(argv: Sequence[str] | None = None, default_config: str | None = None) -> EvaluateScriptArguments:
    """The arguments from the command line (default ``sys.argv[1:]``) and the ``--config`` YAML."""
    return parse_script_args((EvaluateScriptArguments,), "trl-prime eval", argv, default_config)[0]


def run(argv: Sequence[str] | None = None, default_config: str | None = None) -> dict:
    """The command line: :func:`parse_args`, then :func:`main`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trl_prime.cli_errors import command_line_errors

    with command_line_errors():
        parsed = parse_args(argv, default_config)
    with command_line_errors():  # bad input found while reading the datasets (a malformed row, a missing file)
        return main(parsed)


if __name__ == "__main__":
    run()
