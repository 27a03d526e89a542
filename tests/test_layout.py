"""Package layout: one method, one package, and a config imports no trainer.

Building a config (a command line's ``--help``, a recipe's YAML check, the docs' config tables) must not import the
trainers: no ``trl_prime.*trainer*`` module and none of TRL's GRPO / RLOO trainers (``trl.trainer.grpo_trainer``,
``trl.trainer.rloo_trainer``), which pull in generation, vLLM checks and the rest. Each config module is imported in a
fresh interpreter, so modules another test imported do not hide an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]

CONFIG_MODULES = (
    "trl_prime.prime.config",
    "trl_prime.prl.config",
    "trl_prime.prof.config",
    "trl_prime.implicit_prm.config",
)
TRL_TRAINERS = ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")

PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if "trainer" in m)))
"""


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_config_module_imports_no_trainer(module):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [m for m in loaded if m.startswith("trl_prime")]
    theirs = [m for m in loaded if m in TRL_TRAINERS]
    assert not ours and not theirs, f"`import {module}` imports trainer modules: {ours + theirs}"


def test_option_tuples_have_one_source():
    """Every config validates its string options against the tuples of :mod:`trl_prime.functional` (the same objects
    the functions there check), through the one :func:`trl_prime.functional.check_choice`."""
    from trl_prime import functional as F
    from trl_prime.prime.config import PRIME_CHOICES
    from trl_prime.prof.config import PROF_CHOICES

    public = {id(v) for k, v in vars(F).items() if k.isupper() and isinstance(v, tuple)}
    for choices in (*PRIME_CHOICES.values(), *PROF_CHOICES.values()):
        assert id(choices) in public
    with pytest.raises(ValueError, match=r"prof_mode='on' is not supported; choose one of 'both', 'correct', 'off'\."):
        F.check_choice("on", F.PROF_MODES, "prof_mode")


def _function_lengths(path: Path) -> dict[str, int]:
    """Physical lines (decorators and docstring included) of every function and method in ``path``, by qualname."""
    import ast

    lengths = {}

    def walk(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                lengths[f"{path.name}:{prefix}{child.name}"] = child.end_lineno - first + 1
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()))
    return lengths


def test_method_packages_have_no_function_over_60_lines():
    """One method, one package, read like the papers: no function or method over 60 lines in the method packages."""
    package = Path(__file__).resolve().parents[1] / "trl_prime"
    lengths = {}
    for name in ("prime", "prl", "prof", "implicit_prm"):
        for path in sorted((package / name).glob("*.py")):
            lengths.update(_function_lengths(path))
    assert len(lengths) > 100  # the packages were found
    too_long = {k: n for k, n in lengths.items() if n > 60}
    assert not too_long, f"split these into named steps: {too_long}"


def test_prime_step_reads_as_algorithm_1():
    """PRIME's step (Algorithm 1) is under 30 lines, and each step it calls is 40 lines or fewer."""
    import ast

    path = Path(__file__).resolve().parents[1] / "trl_prime" / "prime" / "trainer.py"
    lengths = _function_lengths(path)
    assert lengths["trainer.py:PrimeMixin._algorithm_step"] < 30
    tree = ast.parse(path.read_text())
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_algorithm_step")
    called = {
        c.func.attr
        for c in ast.walk(step)
        if isinstance(c, ast.Call)
        and isinstance(c.func, ast.Attribute)
        and isinstance(c.func.value, ast.Name)
        and c.func.value.id == "self"
    }
    assert {"_filter_prompts", "_reference_logps", "_update_prm", "_token_rewards", "_advantages"} <= called
    for name in called:
        assert lengths[f"trainer.py:PrimeMixin.{name}"] <= 40, name
