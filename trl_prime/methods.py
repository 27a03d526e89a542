"""The methods of trl-prime and the commands of ``trl-prime``: one registry each, PEFT's ``register_peft_method`` style.

- :class:`TrainerEntry`: a value of the RL scripts' ``trainer`` field: its config class and trainer class, named by
  their modules (imported on first use, so building a parser or a config imports no trainer).
- :class:`CommandEntry`: a command of ``trl-prime``: its script (a module of :mod:`trl_prime.scripts`), its help,
  whether it is launched through ``accelerate launch``, and the trainers it accepts (its default first).

The command line (:mod:`trl_prime.cli`), the scripts (:mod:`trl_prime.scripts.utils`) and ``import trl_prime`` read
these tables; adding a method is its package, one :func:`register_trainer` per trainer and one
:func:`register_command` (with its script).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any


__all__ = [
    "TrainerEntry",
    "CommandEntry",
    "register_trainer",
    "register_command",
    "get_trainer",
    "get_command",
    "TRAINERS",
    "COMMANDS",
]


def _load(path: str) -> Any:
    """The object at ``"package.module.Name"``, its module imported."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class TrainerEntry:
    """A ``trainer`` value of the RL scripts (``trl-prime prime`` / ``prl`` / ``prof``).

    Attributes:
        name: The ``trainer`` value.
        config: Dotted path of its config class (``trl_prime.prime.config.PrimeRLOOConfig``).
        trainer: Dotted path of its trainer class.
        saves_prm: The trainer trains an implicit PRM online, saved next to the policy (``output_dir/prm``).
    """

    name: str
    config: str
    trainer: str
    saves_prm: bool = False

    @property
    def config_name(self) -> str:
        """The config class's name (a public name of :mod:`trl_prime`)."""
        return self.config.rsplit(".", 1)[1]

    @property
    def trainer_name(self) -> str:
        """The trainer class's name (a public name of :mod:`trl_prime`)."""
        return self.trainer.rsplit(".", 1)[1]

    def config_class(self) -> type:
        """The config class (imports its module only: no trainer)."""
        return _load(self.config)

    def trainer_class(self) -> type:
        """The trainer class (imports the trainer and TRL's)."""
        return _load(self.trainer)


@dataclass(frozen=True)
class CommandEntry:
    """A command of ``trl-prime``.

    Attributes:
        name: The command (``trl-prime <name>``).
        script: Its module in :mod:`trl_prime.scripts`.
        help: One line for ``trl-prime --help``.
        launched: Launched through ``accelerate launch`` (a training command) rather than run in this process.
        trainers: The :data:`TRAINERS` it trains with, its default first (empty: not an RL script).
    """

    name: str
    script: str
    help: str
    launched: bool = False
    trainers: tuple[str, ...] = ()

    @property
    def module_name(self) -> str:
        return f"trl_prime.scripts.{self.script}"

    def module(self) -> ModuleType:
        """The command's script module."""
        return importlib.import_module(self.module_name)


#: ``trainer`` value -> :class:`TrainerEntry`
TRAINERS: dict[str, TrainerEntry] = {}
#: command -> :class:`CommandEntry`, in ``trl-prime --help`` order
COMMANDS: dict[str, CommandEntry] = {}


def register_trainer(entry: TrainerEntry) -> TrainerEntry:
    """Add ``entry`` to :data:`TRAINERS` (refused when the name is taken)."""
    if entry.name in TRAINERS:
        raise ValueError(f"a trainer named {entry.name!r} is registered already.")
    TRAINERS[entry.name] = entry
    return entry


def register_command(entry: CommandEntry) -> CommandEntry:
    """Add ``entry`` to :data:`COMMANDS` (refused when the name is taken or a trainer is unknown)."""
    if entry.name in COMMANDS:
        raise ValueError(f"a command named {entry.name!r} is registered already.")
    unknown = [t for t in entry.trainers if t not in TRAINERS]
    if unknown:
        raise ValueError(f"command {entry.name!r}: unknown trainer(s) {unknown}; register them first.")
    COMMANDS[entry.name] = entry
    return entry


def get_trainer(name: str) -> TrainerEntry:
    """The :class:`TrainerEntry` of ``name``.

    Raises:
        ValueError: ``name`` is no registered trainer (the message lists them).
    """
    if name not in TRAINERS:
        raise ValueError(f"`trainer`={name!r}: choose one of {list(TRAINERS)}.")
    return TRAINERS[name]


def get_command(name: str) -> CommandEntry:
    """The :class:`CommandEntry` of ``name`` (``KeyError`` when there is none)."""
    return COMMANDS[name]


# ------------------------------------------------------------------------------------------------------------ methods

for _entry in (
    TrainerEntry(
        "prime_rloo", "trl_prime.prime.config.PrimeRLOOConfig", "trl_prime.prime.trainer.PrimeRLOOTrainer", True
    ),
    TrainerEntry(
        "prime_grpo", "trl_prime.prime.config.PrimeGRPOConfig", "trl_prime.prime.trainer.PrimeGRPOTrainer", True
    ),
    TrainerEntry("prl_grpo", "trl_prime.prl.config.PRLConfig", "trl_prime.prl.trainer.PRLGRPOTrainer"),
    TrainerEntry("prof_grpo", "trl_prime.prof.config.ProfGRPOConfig", "trl_prime.prof.trainer.ProfGRPOTrainer"),
):
    register_trainer(_entry)

for _entry in (
    CommandEntry(
        "prime",
        "prime",
        "PRIME (arXiv 2502.01456): trainer prime_rloo (default) or prime_grpo",
        launched=True,
        trainers=("prime_rloo", "prime_grpo"),
    ),
    CommandEntry("prl", "prl", "PRL on GRPO (arXiv 2601.10201)", launched=True, trainers=("prl_grpo",)),
    CommandEntry(
        "prof",
        "prof",
        "PROF (arXiv 2509.03403): trainer prof_grpo (default) or prime_grpo (PROF inside PRIME)",
        launched=True,
        trainers=("prof_grpo", "prime_grpo"),
    ),
    CommandEntry(
        "implicit-prm",
        "implicit_prm",
        "train an implicit PRM offline on verifier-labelled rollouts (arXiv 2412.01981)",
        launched=True,
    ),
    CommandEntry("eval", "evaluate", "pass@k / avg@k of a model with the math and code verifiers"),
    CommandEntry("best-of-n", "best_of_n", "best-of-N with implicit PRMs vs majority vote vs oracle"),
    CommandEntry("demo", "demo", "PRIME on the embedded model and problems, offline on a CPU (make demo)"),
):
    register_command(_entry)
del _entry
