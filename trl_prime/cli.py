"""The ``trl-prime`` command line (TRL's ``trl`` CLI pattern): ``trl-prime <command> [--config YAML] [--flag V ...]``.

Each command is a module of :mod:`trl_prime.scripts`, whose ``trl.TrlParser`` parses the command's dataclasses (every
field is a flag or a key of the ``--config`` YAML; flags override the YAML).

The training commands (``prime``, ``prl``, ``prof``, ``implicit-prm``) are launched through ``accelerate launch``, as
TRL's ``trl sft`` / ``trl grpo`` are: the command's parser takes its own flags (and the YAML's keys), and every flag it
does not know goes to ``accelerate launch`` (``--num_processes``, ``--config_file``, ``--main_process_port``, ...)::

    trl-prime prime --config recipes/configs/prime_qwen7b.yaml --accelerate_config zero3   # 8 GPUs, ZeRO-3
    trl-prime prl --config recipes/configs/prl_grpo.yaml --num_processes 2 --max_steps 5    # 2 GPUs
    trl-prime prof --config recipes/configs/prof_prime.yaml --accelerate_config cpu_ddp --use_cpu true  # 2 CPU procs

``--accelerate_config NAME`` is one of trl-prime's Accelerate configs (``cpu_ddp``, ``cpu_zero3``, ``multi_gpu``,
``single_gpu``, ``zero2``, ``zero3``, ``zero3_two_nodes``: package data in ``trl_prime/accelerate_configs/``, which the
repository's ``accelerate_configs/`` links to); any other value follows TRL's rule: a file path, else one of TRL's
config names (``fsdp2``, ``zero1``, ...). Without it, accelerate uses its default config (``accelerate config``), or
one process per GPU.

``eval``, ``best-of-n`` and ``demo`` run in this process (they are not distributed)::

    trl-prime eval --model_name_or_path embedded:smollm2-135m-instruct --max_problems 20
    trl-prime demo
    trl-prime prime --help                     # every flag of the command

A training command runs in this process when a launcher already started it (:func:`already_launched`), so
``accelerate launch --config_file accelerate_configs/zero3.yaml -m trl_prime.cli prime --config ...`` or ``torchrun
--nproc_per_node 8 -m trl_prime.cli prime ...`` launches once:

- ``LOCAL_RANK`` or ``WORLD_SIZE`` is set (:data:`DISTRIBUTED_LAUNCH_ENV`): every process of ``torchrun``, of
  ``accelerate launch`` with several processes or DeepSpeed (which start ``torchrun``'s agent), of ``deepspeed``;
- all of :data:`ACCELERATE_LAUNCH_ENV` are set: ``accelerate launch`` of one process sets no rank variable, but sets
  these together (``accelerate.utils.launch.prepare_simple_launcher_cmd_env``). One of them alone is not a launch: a
  user may ``export ACCELERATE_MIXED_PRECISION=bf16`` and still wants ``trl-prime prime`` to launch.

``python -m trl_prime.scripts.<module> ...`` (``prime``, ``prl``, ``prof``, ``implicit_prm``) or a ``recipes/*.py``
file runs it in this process without accelerate. ``python -m trl_prime`` is the same command line.

Mistakes on the command line exit with status 2 and a ``trl-prime <command>: error: ...`` line naming the flag and
its fix (:class:`CommandLineError`): an unknown argument before the command, arguments without a command, a
``--config`` file that does not exist, a ``--trainer`` (or the YAML's ``trainer``) the command does not train with, an
``--accelerate_config`` that names no config. Before launching a training command, this process builds its configs
and checks the run (:func:`check_before_launch`); what fails only in a launched process ends there as one such line
and status 2 as well (:func:`one_line`; ``TRL_PRIME_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import contextlib
import os
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from collections.abc import Mapping
from pathlib import Path

from trl_prime.cli_errors import (  # noqa: F401  (part of this module's interface)
    TRACEBACK_ENV,
    CommandLineError,
    command_line_errors,
    one_line,
)
from trl_prime.methods import COMMANDS as METHOD_COMMANDS
from trl_prime.methods import get_command


#: command -> (module of trl_prime.scripts, one-line help): the registry's commands (:data:`trl_prime.methods.COMMANDS`)
COMMANDS = {name: (entry.script, entry.help) for name, entry in METHOD_COMMANDS.items()}
#: the commands launched through ``accelerate launch`` (TRL's ``TrainingCommand``); the others run in this process
TRAINING_COMMANDS = tuple(name for name, entry in METHOD_COMMANDS.items() if entry.launched)
#: trl-prime's Accelerate configs, the names of ``--accelerate_config`` (package data; the repository's
#: ``accelerate_configs/`` is a link to this folder)
ACCELERATE_CONFIGS = Path(__file__).resolve().parent / "accelerate_configs"
#: set by torch.distributed's launchers in every process they start (``torchrun``, so ``accelerate launch`` with
#: several processes or DeepSpeed, and the ``deepspeed`` launcher): either one set means already launched
DISTRIBUTED_LAUNCH_ENV = ("LOCAL_RANK", "WORLD_SIZE")
#: set together by ``accelerate launch`` in every process it starts, a single process included
#: (``accelerate.utils.launch.prepare_simple_launcher_cmd_env``): all of them set means already launched
ACCELERATE_LAUNCH_ENV = ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")


def make_parser() -> ArgumentParser:
    """The top-level parser: one sub-command per :data:`COMMANDS` entry (its own flags are parsed by its script)."""
    from trl_prime import __version__

    parser = ArgumentParser(
        prog="trl-prime",
        allow_abbrev=False,
        formatter_class=RawDescriptionHelpFormatter,
        description="Process rewards without process labels for TRL: PRIME, Implicit PRM, PRL and PROF.",
        epilog="Run `trl-prime <command> --help` for the flags of a command (every one is also a key of --config). "
        "prime, prl, prof and implicit-prm run through `accelerate launch`: the flags a command does not "
        "know go to accelerate (--num_processes 2, --accelerate_config zero3, ...).",
    )
    parser.add_argument("--version", action="version", version=f"trl-prime {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="<command>")
    for name, (_, help_text) in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def already_launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher started this process (then a training command runs in it instead of launching again).

    Args:
        environ: the environment variables (default ``os.environ``).

    Returns:
        True when ``LOCAL_RANK`` or ``WORLD_SIZE`` is set (:data:`DISTRIBUTED_LAUNCH_ENV`: ``torchrun``, ``accelerate
        launch`` with several processes or DeepSpeed, ``deepspeed``), or when every variable of
        :data:`ACCELERATE_LAUNCH_ENV` is (``accelerate launch`` of one process); one ``ACCELERATE_*`` variable a user
        exported is not enough.
    """
    environ = os.environ if environ is None else environ
    return any(k in environ for k in DISTRIBUTED_LAUNCH_ENV) or all(k in environ for k in ACCELERATE_LAUNCH_ENV)


def _trl_cli_helpers():
    """``(_subtract_subsequence, resolve_accelerate_config_argument)`` of TRL 1.16's ``trl`` command line (private
    helpers of ``trl.cli``).

    Raises:
        ImportError: the installed TRL has no such helpers (another version than the one trl-prime supports).
    """
    try:
        from trl.cli.accelerate_config import resolve_accelerate_config_argument
        from trl.cli.commands.training import _subtract_subsequence
    except ImportError as error:
        import trl

        raise ImportError(
            f"`trl-prime <training command>` launches with the helpers of TRL 1.16's `trl` command line "
            f"(trl.cli.commands.training._subtract_subsequence, trl.cli.accelerate_config), which TRL "
            f"{trl.__version__} lacks. Install trl>=1.16,<1.17, or launch the script yourself: `accelerate launch "
            f"-m trl_prime.scripts.<prime|prl|prof|implicit_prm> ...`."
        ) from error
    return _subtract_subsequence, resolve_accelerate_config_argument


def accelerate_config_names() -> list[str]:
    """The names ``--accelerate_config`` resolves to trl-prime's own configs (:data:`ACCELERATE_CONFIGS`)."""
    return sorted(path.stem for path in ACCELERATE_CONFIGS.glob("*.yaml"))


def _deepspeed_file_args(config: Path, launch_args: list[str]) -> list[str]:
    """``["--deepspeed_config_file", <absolute path>]`` when trl-prime's ``config`` names a DeepSpeed JSON by a path
    relative to the repository root (which works there only), else ``[]``. The path, e.g.
    ``accelerate_configs/cpu_zero3.json``, is taken relative to the package folder, where it is the same file."""
    import yaml

    ds_file = ((yaml.safe_load(config.read_text()) or {}).get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file is None or os.path.isabs(ds_file) or "--deepspeed_config_file" in launch_args:
        return []
    return ["--deepspeed_config_file", str(ACCELERATE_CONFIGS.parent / ds_file)]


def resolve_accelerate_config(launch_args: list[str]) -> list[str]:
    """``launch_args`` with ``--accelerate_config NAME`` replaced by ``--config_file <path>`` (TRL's ``trl <command>
    --accelerate_config``): ``NAME`` is one of trl-prime's configs (:func:`accelerate_config_names`), else TRL's rule
    applies (``trl.cli.accelerate_config.resolve_accelerate_config_argument``: a file path, else a TRL config name).

    Raises:
        CommandLineError: no value after ``--accelerate_config``, or a value that is no trl-prime name, file or TRL
            name (a ``ValueError``).
    """
    _, resolve_trl_config = _trl_cli_helpers()
    extra = []
    if "--accelerate_config" in launch_args:
        index = launch_args.index("--accelerate_config")
        name = launch_args[index + 1] if index + 1 < len(launch_args) else None
        if name in accelerate_config_names():
            config = ACCELERATE_CONFIGS / f"{name}.yaml"
            launch_args = [*launch_args[: index + 1], str(config), *launch_args[index + 2 :]]
            extra = _deepspeed_file_args(config, launch_args)
    try:
        return resolve_trl_config(launch_args) + extra
    except ValueError as error:
        raise CommandLineError(
            f"--accelerate_config: {error} trl-prime's configs: {', '.join(accelerate_config_names())}; TRL's: a name "
            "of trl/accelerate_configs/; or the path of an Accelerate config file (`accelerate config` writes one)."
        ) from error


def check_command_argv(command: str, argv: list[str]) -> None:
    """Check the flags of ``trl-prime <command> <argv>`` that decide how the command is parsed, before it is launched
    or run: ``--config`` names a file, and (training commands of :data:`trl_prime.scripts.utils.COMMAND_TRAINERS`)
    the trainer (``--trainer``, else the YAML's ``trainer``) is one the command trains with.

    Raises:
        CommandLineError: the message names the flag and the fix.
    """
    from trl_prime.scripts.utils import COMMAND_TRAINERS, _option, choose_trainer, normalize_argv

    argv = normalize_argv(argv)
    config = _option(argv, "config")
    if config is not None and not os.path.isfile(config):
        raise CommandLineError(
            f"--config {config}: no such file (relative paths start at {os.getcwd()}). Give the path of an existing "
            "YAML file, e.g. one of the repository's recipes/configs/."
        )
    if config is not None:
        import yaml

        with open(config) as f:
            try:
                yaml.safe_load(f)
            except yaml.YAMLError as error:
                raise CommandLineError(
                    f"--config {config} is not valid YAML: {' '.join(str(error).split())}"
                ) from error
    if command in COMMAND_TRAINERS:
        try:
            choose_trainer(argv, COMMAND_TRAINERS[command])
        except ValueError as error:
            source = "--trainer" if _option(argv, "trainer") is not None else f"the `trainer` key of --config {config}"
            raise CommandLineError(
                f"{str(error).rstrip('.')} (read from {source}); pass --trainer {COMMAND_TRAINERS[command][0]} (the "
                "default) or another of them."
            ) from error


def accelerate_launch_argv(command: str, argv: list[str]) -> list[str]:
    """The ``accelerate launch`` command line of ``trl-prime <command> <argv>`` (TRL's ``TrainingCommand.run``): the
    command's parser takes its flags and the ``--config`` YAML's keys; what it leaves, from the command line and the
    YAML, goes to accelerate (``--accelerate_config`` resolved by :func:`resolve_accelerate_config`); the processes
    run ``python -m trl_prime.scripts.<module>`` with the rest of ``argv``, in its order.

    The configs are built, and the run checked, by :func:`launch` (:func:`check_before_launch`).

    Raises:
        SystemExit: ``--help`` (after printing the command's flags) or a flag value the command's parser rejects.
        CommandLineError: a bad ``--accelerate_config`` (:func:`resolve_accelerate_config`), a
            ``--model_name_or_path`` folder that is not there, or a method option its config refuses
            (:data:`METHOD_OPTION_CHECKS`, e.g. ``--lam 1.5``).
    """
    from trl_prime.scripts.utils import normalize_argv

    subtract_subsequence, _ = _trl_cli_helpers()
    module = get_command(command).module_name
    argv = normalize_argv(argv)
    parser = get_command(command).module().make_parser(argv)
    dataclass_types = parser.dataclass_types
    parser.dataclass_types = ()  # split the flags only: parsed values stay in a namespace, no config is built
    # cli_remaining is an ordered subsequence of argv; config_remaining (YAML keys: `--key value`) is not
    namespace, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
    _check_launch_args(command, launch_args, config_remaining, module)
    _check_model_path(command, namespace)
    _check_method_options(command, dataclass_types, namespace)
    return [*launch_args, "-m", module, *subtract_subsequence(argv, cli_remaining)]


def launched_processes(launch_args: list[str], module: str) -> int:
    """How many processes ``accelerate launch <launch_args> -m <module>`` starts (its own reading of the flags and of
    its config file: ``accelerate.commands.launch._validate_launch_command``, warnings silenced: the launch prints
    them)."""
    import logging
    import warnings

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args([*launch_args, "-m", module])
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = _validate_launch_command(args)[0]
    except (ValueError, OSError) as error:
        raise CommandLineError(f"accelerate launch refuses the launch flags: {error}") from error
    finally:
        logging.disable(logging.NOTSET)
    return max(int(args.num_processes or 1), 1)


@contextlib.contextmanager
def _world_size(num_processes: int):
    """``TrainingArguments.world_size`` is ``num_processes`` inside (the configs built before the launch check their
    batch sizes for the processes accelerate will start)."""
    from unittest import mock

    from transformers import TrainingArguments

    with mock.patch.object(TrainingArguments, "world_size", property(lambda self: num_processes)):
        yield


def check_before_launch(command: str, script_argv: list[str], num_processes: int) -> None:
    """Build the configs of ``trl-prime <command> <script_argv>`` in this process, as ``num_processes`` processes
    will (TRL's and transformers' own checks: bf16 without a GPU, ``num_generations`` < 2 for GRPO, batch sizes),
    then run the command's ``check`` (:func:`trl_prime.scripts.utils.check_run`: model, data, rewards, output folder,
    checkpoint to resume from, learning rates, Hub access), so that none of it fails after the launch.

    Raises:
        CommandLineError: the config's or the check's message (it names the field and the fix).
    """
    import warnings

    module = get_command(command).module()
    with command_line_errors(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the launched processes warn, once each
        with _world_size(num_processes):
            parsed = module.parse_args(script_argv)
        module.check(*parsed)


#: the config methods that check a method's own options (no TRL field, nothing that depends on the number of
#: processes): run on the parsed values before launching, so a bad value is refused before any process starts
METHOD_OPTION_CHECKS = ("_validate_prime",)


def _check_method_options(command: str, dataclass_types, namespace) -> None:
    """Run the configs' :data:`METHOD_OPTION_CHECKS` on the parsed flags and YAML keys, without building the configs
    (TRL's own checks need the number of processes, which only the launched processes know).

    Raises:
        CommandLineError: the check's message (it names the field and the fix).
    """
    import dataclasses
    import warnings

    values = vars(namespace)
    for cls in dataclass_types:
        checks = [getattr(cls, name) for name in METHOD_OPTION_CHECKS if hasattr(cls, name)]
        if not checks:
            continue
        config = object.__new__(cls)  # the fields as parsed, no __post_init__ (TRL's checks run after launch)
        for f in dataclasses.fields(cls):
            if f.name in values:
                setattr(config, f.name, values[f.name])
            elif f.default is not dataclasses.MISSING:
                setattr(config, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                setattr(config, f.name, f.default_factory())
        with warnings.catch_warnings():  # the launched processes warn, once each
            warnings.simplefilter("ignore")
            for check in checks:
                try:
                    check(config)
                except (ValueError, TypeError) as error:  # TypeError: e.g. a YAML list where a number belongs
                    raise CommandLineError(f"{error} (trl-prime {command}: refused before launching)") from error


def _check_model_path(command: str, namespace) -> None:
    """Refuse a ``--model_name_or_path`` that can only be a local folder and is not there, before launching.

    Raises:
        CommandLineError: naming the flag, the path and where relative paths start.
    """
    from trl_prime.models import is_missing_local_path

    path = getattr(namespace, "model_name_or_path", None)
    if isinstance(path, str) and is_missing_local_path(path):
        raise CommandLineError(
            f"--model_name_or_path {path}: no such folder (relative paths start at {os.getcwd()}). Give a checkpoint "
            f"folder, a Hub id (org/name) or embedded:smollm2-135m-instruct (trl-prime {command}: refused before "
            "launching)."
        )


def _check_launch_args(command: str, launch_args: list[str], from_config: list[str], module: str) -> None:
    """Refuse the flags that neither ``trl-prime <command>`` nor ``accelerate launch`` knows, naming where they come
    from (a key of the ``--config`` YAML or the command line), before anything is launched.

    Raises:
        CommandLineError: the unknown flags, their source and the fix.
    """
    from accelerate.commands.launch import launch_command_parser

    # every `--flag` is looked up (argparse's parse_known_args stops at the first unknown one: its value is taken for
    # the script, and the rest for the script's arguments), with argparse's rule for abbreviations
    parser = launch_command_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    flags = [a.split("=", 1)[0] for a in launch_args if a.startswith("--")]
    unknown = [
        a
        for a in dict.fromkeys(flags)
        if a not in known and not (parser.allow_abbrev and sum(k.startswith(a) for k in known) == 1)
    ]
    if unknown:
        source = {a: "a key of the --config YAML" if a in from_config else "the command line" for a in unknown}
        listed = ", ".join(f"{a} ({where})" for a, where in source.items())
        raise CommandLineError(
            f"unknown option(s) {listed}: neither a field of `trl-prime {command}` nor a flag of `accelerate "
            f"launch`. See `trl-prime {command} --help` for the command's fields; fix or remove the option."
        )


def launch(command: str, argv: list[str]) -> None:
    """Run ``trl-prime <command> <argv>`` through ``accelerate launch`` (:func:`accelerate_launch_argv`).

    Before the launch, this process builds the configs for the number of processes accelerate will start (TRL's
    ``GRPOConfig`` checks ``per_device_train_batch_size * num_processes`` against ``num_generations``) and checks
    the run (:func:`check_before_launch`: the model, the data, the rewards, the output folder, the checkpoint to
    resume from).

    Raises:
        CommandLineError: raised before anything is launched: a bad ``--accelerate_config``, a missing
            ``--model_name_or_path`` folder, a method option its config refuses (:func:`accelerate_launch_argv`),
            what the configs or :func:`check_before_launch` refuse.
        SystemExit: with the launched processes' exit status when they fail (each has printed its one
            ``trl-prime <command>: error: ...`` line, :func:`main`), instead of accelerate's and torch's tracebacks.
    """
    import subprocess

    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_argv = accelerate_launch_argv(command, argv)
    split = launch_argv.index("-m")
    # as TRL's `trl grpo`, build the configs here, and check the run, before anything is launched
    check_before_launch(
        command, launch_argv[split + 2 :], launched_processes(launch_argv[:split], launch_argv[split + 1])
    )
    args = launch_command_parser().parse_args(launch_argv)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as error:  # one process (accelerate's simple launcher)
        raise SystemExit(error.returncode) from None
    except Exception as error:  # several processes: torch.distributed.elastic's ChildFailedError
        failures = getattr(error, "failures", None)
        if not failures:
            raise
        raise SystemExit(next(iter(failures.values())).exitcode or 1) from None


def main(argv: list[str] | None = None, launch_training: bool | None = None) -> int:
    """Run ``trl-prime`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    ``launch_training``: launch a training command (:data:`TRAINING_COMMANDS`) through ``accelerate launch`` (True) or
    run it in this process (False); default: launch, unless a launcher already started this process
    (:func:`already_launched`).

    Raises:
        SystemExit: status 2 with usage and ``error: ...`` for an unknown argument before the command, arguments
            without a command, or a :class:`CommandLineError` of the command (``trl-prime <command>: error: ...``);
            status 2 with one ``trl-prime <command>: error: ...`` line for any error of a training command run in
            this process (a launched one: :func:`one_line`; ``TRL_PRIME_TRACEBACK=1`` raises it instead); the
            launched processes' status when they fail (:func:`launch`); status 0 after ``--help`` / ``--version``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args, _ = parser.parse_known_args(argv)
    if args.command is None:
        if argv:
            parser.error(f"unrecognized arguments: {' '.join(argv)} (no command given; see `trl-prime --help`)")
        parser.print_help()
        return 0
    position = argv.index(args.command)
    if position > 0:
        parser.error(f"unrecognized arguments: {' '.join(argv[:position])} (before the command {args.command!r})")
    command_argv = argv[position + 1 :]
    if launch_training is None:
        launch_training = not already_launched()
    try:
        check_command_argv(args.command, command_argv)
        if args.command in TRAINING_COMMANDS and launch_training:
            launch(args.command, command_argv)
        else:
            get_command(args.command).module().run(command_argv)
    except CommandLineError as error:
        parser.exit(2, f"{parser.prog} {args.command}: error: {error}\n")
    except Exception as error:  # inside a training process: what could only fail there, as one line
        if args.command not in TRAINING_COMMANDS or launch_training or os.environ.get(TRACEBACK_ENV):
            raise
        # on a line of its own: a progress bar may have left the cursor after its last "\r"
        parser.exit(2, f"\n{parser.prog} {args.command}: error: {one_line(error)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
