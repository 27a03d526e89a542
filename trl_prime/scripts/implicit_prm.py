"""``trl-prime implicit-prm``: train an implicit PRM offline (Implicit PRM arXiv 2412.01981): policy rollouts ->
verifier labels -> PRM.

Usage (TRL script style: every field of ``ImplicitPRMScriptArguments``, :class:`trl_prime.ImplicitPRMConfig` and
``trl.ModelConfig`` is a flag or a key of the YAML; flags override the YAML)::

    trl-prime implicit-prm --config recipes/configs/implicit_prm.yaml
    trl-prime implicit-prm --config recipes/configs/implicit_prm.yaml --loss_type ce \\
        --output_dir outputs/implicit_prm/prm_ce           # reuses the cached rollouts
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/implicit_prm.py \\
        --config recipes/configs/implicit_prm.yaml --model_name_or_path Qwen/Qwen2.5-Math-7B-Instruct \\
        --dataset_name PRIME-RL/Eurus-2-RL-Data --num_generations 8 --bf16 true
    trl-prime implicit-prm --config recipes/configs/implicit_prm.yaml --accelerate_config multi_gpu ...  # the same

1. Rollouts: ``num_generations`` completions of the policy (``model_name_or_path``) per training problem, labelled
   by the verifier (:func:`trl_prime.implicit_prm.data.build_outcome_dataset`); unscorable ones are dropped and
   counted. Saved to ``rollouts_path`` (JSONL) and reused while the sampling settings are the same.
2. Training: :class:`trl_prime.ImplicitPRMTrainer` from the same checkpoint (the reference is a frozen copy), saved
   with ``save_model(output_dir)``; load it with ``ImplicitPRM.from_pretrained(output_dir)``.

Evaluate with ``trl-prime best-of-n`` (:mod:`trl_prime.scripts.best_of_n`: best-of-N vs majority vote). The YAML's
defaults run offline on a CPU (embedded SmolLM2-135M-Instruct, embedded arithmetic problems).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from trl_prime.scripts.utils import (
    PRM_PROMPTS,
    REWARDS,
    check_hub,
    check_learning_rates,
    check_model,
    check_output_dir,
    end,
    finish,
    parse_script_args,
    resume_checkpoint,
    weights_bytes,
)


@dataclass
class ImplicitPRMScriptArguments:
    """Rollout data of the implicit PRM recipe (flags, or keys of the ``--config`` YAML)."""

    dataset_name: str = field(
        default="embedded:arithmetic", metadata={"help": "Training problems (trl_prime.data.load_prompt_dataset)."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Split of the training problems."})
    max_train_samples: int = field(default=64, metadata={"help": "Training problems (embedded: generated)."})
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the embedded problem generator."})
    num_generations: int = field(default=8, metadata={"help": "Rollouts per problem (K)."})
    max_new_tokens: int = field(default=128, metadata={"help": "Rollout budget in tokens."})
    temperature: float = field(default=0.7, metadata={"help": "Rollout temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Rollout nucleus."})
    generation_batch_size: int = field(default=128, metadata={"help": "Rows decoded together."})
    generation_seed: int = field(default=0, metadata={"help": "Rollout sampling seed."})
    reward: str = field(
        default="outcome",
        metadata={
            "help": "'outcome' (routed math/code, by each row's ability) or 'math' (every row; no ability needed)."
        },
    )
    max_row_bytes: int = field(
        default=1 << 20,
        metadata={"help": "Local JSON / JSONL files: the largest row read, in bytes; a longer one stops the run."},
    )
    rollouts_path: str = field(
        default="outputs/implicit_prm/rollouts.jsonl",
        metadata={"help": "Where the labelled rollouts are cached (reused while the sampling settings are the same)."},
    )
    prm_prompt: str = field(
        default="full",
        metadata={
            "help": "The prompt the PRM sees: 'full', 'last_turn' (drop "
            "few-shot turns) or 'question' (the last user message "
            "as plain text). Score with the same."
        },
    )
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads."})
    rollouts_only: bool = field(default=False, metadata={"help": "Stop after building the rollouts."})
    pairable_only: bool = field(
        default=False,
        metadata={"help": "Train only on prompts with both correct and incorrect rollouts (all DPO/NCA can pair)."},
    )

    def __post_init__(self):
        from trl_prime.functional import check_choice

        check_choice(self.prm_prompt, PRM_PROMPTS, "prm_prompt")
        check_choice(self.reward, REWARDS, "reward")


def load_problems(script_args: ImplicitPRMScriptArguments):
    """The training problems (:func:`trl_prime.data.load_prompt_dataset`; with ``reward: math`` every row is a math
    row)."""
    from trl_prime.data import load_prompt_dataset

    problems = load_prompt_dataset(
        script_args.dataset_name,
        script_args.dataset_split,
        size=script_args.max_train_samples,
        seed=script_args.dataset_seed,
        ability="math" if script_args.reward == "math" else None,
        max_row_bytes=script_args.max_row_bytes,
    )
    return problems.select(range(min(script_args.max_train_samples, len(problems))))


def _saved_rollouts(script_args: ImplicitPRMScriptArguments, settings: dict) -> Path | None:
    """``rollouts_path`` when it holds rollouts sampled with ``settings`` (reused), else None."""
    path = Path(script_args.rollouts_path)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.with_suffix(".stats.json").read_text()).get("settings")
    except (OSError, ValueError):
        saved = None
    if saved is None or saved == json.loads(json.dumps(settings)):
        return path
    print(f"[implicit_prm] {path} was sampled with other settings ({saved}); sampling again", flush=True)
    return None


def _settings(script_args: ImplicitPRMScriptArguments, model_path: str) -> dict:
    settings = {
        k: getattr(script_args, k)
        for k in (
            "dataset_name",
            "dataset_split",
            "max_train_samples",
            "dataset_seed",
            "reward",
            "num_generations",
            "max_new_tokens",
            "temperature",
            "top_p",
            "generation_seed",
        )
    }
    settings["model"] = model_path
    return settings


def rollouts(script_args: ImplicitPRMScriptArguments, model_path: str):
    """The labelled rollouts (a ``datasets.Dataset``), from ``rollouts_path`` or built and saved there."""
    from datasets import Dataset

    from trl_prime.implicit_prm.data import build_outcome_dataset

    path = Path(script_args.rollouts_path)
    settings = _settings(script_args, model_path)
    stats_path = path.with_suffix(".stats.json")
    if _saved_rollouts(script_args, settings) is not None:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        print(f"[implicit_prm] reusing {len(rows)} labelled rollouts from {path}", flush=True)
        return Dataset.from_list(rows)
    problems = load_problems(script_args)
    reward_func = None
    if script_args.reward == "math":
        from trl_prime.rewards import math_reward as reward_func
    data, stats = build_outcome_dataset(
        model_path,
        problems,
        reward_func=reward_func,
        num_generations=script_args.num_generations,
        max_new_tokens=script_args.max_new_tokens,
        temperature=script_args.temperature,
        top_p=script_args.top_p,
        batch_size=script_args.generation_batch_size,
        seed=script_args.generation_seed,
        progress=True,
        return_stats=True,
    )
    print(f"[implicit_prm] rollouts: {json.dumps(stats)}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in data:
            f.write(json.dumps(row) + "\n")
    stats_path.write_text(json.dumps({**stats, "settings": settings}, indent=2) + "\n")
    return data


def main(script_args: ImplicitPRMScriptArguments, training_args, model_args):
    """Build (or reuse) the rollouts, train the PRM, save it to ``output_dir``. Returns the trainer (None when
    ``rollouts_only``)."""
    from trl import get_peft_config

    from trl_prime import ImplicitPRMTrainer
    from trl_prime.implicit_prm.data import last_turn_prompt, pairable_rows, question_prompt
    from trl_prime.models import resolve_model_path

    if script_args.num_threads:
        import torch

        torch.set_num_threads(script_args.num_threads)
    if not model_args.model_name_or_path:
        raise ValueError("Set `model_name_or_path` (a Hub id, a local folder or embedded:<key>).")
    model_path = resolve_model_path(model_args.model_name_or_path)
    data = rollouts(script_args, model_path)
    if script_args.rollouts_only:
        return None
    if script_args.pairable_only:
        n = len(data)
        data = pairable_rows(data)
        print(f"[implicit_prm] pairable_only: {len(data)} of {n} rows", flush=True)
    if script_args.prm_prompt != "full":
        fn = last_turn_prompt if script_args.prm_prompt == "last_turn" else question_prompt
        data = data.map(
            lambda row: {
                "prompt": fn(row["prompt"]),
                "completion": row["completion"]
                if not isinstance(fn(row["prompt"]), str) or isinstance(row["completion"], str)
                else row["completion"][-1]["content"],
            }
        )
    trainer = ImplicitPRMTrainer(
        model=model_path, args=training_args, train_dataset=data, peft_config=get_peft_config(model_args)
    )
    finish(trainer, training_args, dataset_name=script_args.dataset_name)  # the PRM is the model: its own repo
    return trainer


def check(script_args: ImplicitPRMScriptArguments, training_args, model_args) -> None:
    """What ``trl-prime implicit-prm`` checks before launching (:func:`trl_prime.cli.check_before_launch`): the
    model's config, the output folder, the checkpoint to resume from, the learning rate, the Hub for
    ``push_to_hub``, and the problems (unless saved rollouts are reused).

    Raises:
        ValueError: naming the field and the fix.
    """
    model_path = check_model(model_args.model_name_or_path, model_args.model_revision)
    check_output_dir(training_args.output_dir, weights_bytes(model_path))
    resume_checkpoint(training_args)
    check_learning_rates(training_args)
    check_hub(training_args)
    if _saved_rollouts(script_args, _settings(script_args, model_path)) is None:
        load_problems(script_args)


def dataclass_types() -> tuple:
    """``(ImplicitPRMScriptArguments, trl_prime.ImplicitPRMConfig, trl.ModelConfig)``."""
    from trl import ModelConfig

    from trl_prime import ImplicitPRMConfig

    return ImplicitPRMScriptArguments, ImplicitPRMConfig, ModelConfig


def make_parser(argv=None):
    """The command's ``trl.TrlParser`` (``argv`` is unused: one parser for every command line)."""
    from trl import TrlParser

    return TrlParser(dataclass_types(), prog="trl-prime implicit-prm")


def parse_args(argv=None, default_config: str | None = None):
    """``(script_args, training_args, model_args)`` from the command line (default ``sys.argv[1:]``) and the
    ``--config`` YAML (default ``default_config``)."""
    return parse_script_args(dataclass_types(), "trl-prime implicit-prm", argv, default_config)


def run(argv=None, default_config: str | None = None):
    """The command line: :func:`parse_args`, :func:`main`, then end the trainer
    (:func:`trl_prime.scripts.utils.end`)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trl_prime.cli_errors import command_line_errors

    with command_line_errors():
        parsed = parse_args(argv, default_config)
    return end(main(*parsed))


if __name__ == "__main__":
    import sys

    from trl_prime.cli import main as _cli

    raise SystemExit(_cli(["implicit-prm", *sys.argv[1:]], launch_training=False))
