"""The ``trl-prime`` command line (TRL's ``trl`` CLI pattern): ``trl-prime <command> [--config YAML] [--flag V ...]``.

Each command runs ``run(argv)`` of its module in :mod:`trl_prime.scripts`, which parses the command's dataclasses
with ``trl.TrlParser`` (every field is a flag or a key of the ``--config`` YAML; flags override the YAML)::

    trl-prime prime --config recipes/configs/prime_qwen7b.yaml
    trl-prime prof --config recipes/configs/prof_prime.yaml --max_steps 5
    trl-prime eval --model_name_or_path embedded:smollm2-135m-instruct --max_problems 20
    trl-prime demo
    trl-prime prime --help                     # every flag of the command

The command runs in this process. For several processes or DeepSpeed, launch it with accelerate, e.g.
``accelerate launch --config_file accelerate_configs/zero3.yaml -m trl_prime.cli prime --config ...``, or launch
the recipe file (``accelerate launch recipes/prime_qwen7b.py``). ``python -m trl_prime`` is the same command line.
"""

from __future__ import annotations

import importlib
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter


#: command -> (module of trl_prime.scripts, one-line help)
COMMANDS = {
    "prime": ("prime", "PRIME (arXiv 2502.01456): trainer prime_rloo (default) or prime_grpo"),
    "prl": ("prl", "PRL on GRPO (arXiv 2601.10201)"),
    "prof": ("prof", "PROF (arXiv 2509.03403): trainer prof_grpo (default) or prime_grpo (PROF inside PRIME)"),
    "implicit-prm": ("implicit_prm", "train an implicit PRM offline from verifier-labelled rollouts (arXiv 2412.01981)"),
    "eval": ("evaluate", "pass@k / avg@k of a model with the math and code verifiers"),
    "best-of-n": ("best_of_n", "best-of-N with implicit PRMs vs majority vote vs oracle"),
    "demo": ("demo", "PRIME on the embedded model and problems, offline on a CPU (make demo)"),
}


def make_parser() -> ArgumentParser:
    """The top-level parser: one sub-command per :data:`COMMANDS` entry (its own flags are parsed by its script)."""
    from trl_prime import __version__

    parser = ArgumentParser(
        prog="trl-prime", allow_abbrev=False, formatter_class=RawDescriptionHelpFormatter,
        description="Process rewards without process labels for TRL: PRIME, Implicit PRM, PRL and PROF.",
        epilog="Run `trl-prime <command> --help` for the flags of a command (every one is also a key of --config).",
    )
    parser.add_argument("--version", action="version", version=f"trl-prime {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="<command>")
    for name, (_, help_text) in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``trl-prime`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    args, _ = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(f"trl_prime.scripts.{COMMANDS[args.command][0]}")
    module.run(argv[argv.index(args.command) + 1 :])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
