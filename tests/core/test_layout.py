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


ROOT = Path(__file__).resolve().parents[2]

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
    package = ROOT / "trl_prime"
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

    path = ROOT / "trl_prime" / "prime" / "trainer.py"
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


# ---------------------------------------------------------------------------------------------------- import graph


def _is_type_checking(node) -> bool:
    import ast

    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_graph() -> dict[str, set[str]]:
    """``module -> the trl_prime modules it imports``, every import statement counted (inside functions and
    ``if`` blocks too; ``if TYPE_CHECKING:`` blocks excepted)."""
    import ast

    package = ROOT / "trl_prime"
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        pending = [ast.parse(path.read_text())]
        while pending:
            node = pending.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    pending.extend(child.orelse)
                    continue
                if isinstance(child, ast.Import):
                    edges.update(alias.name for alias in child.names if alias.name in modules)
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = name.split(".") if is_package else name.split(".")[:-1]
                        base = base[: len(base) - child.level + 1]
                        source = ".".join(base + ([child.module] if child.module else []))
                    else:
                        source = child.module
                    for alias in child.names:
                        if f"{source}.{alias.name}" in modules:
                            edges.add(f"{source}.{alias.name}")
                        elif source in modules:
                            edges.add(source)
                pending.append(child)
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    """No two trl_prime modules import each other, directly or through others, counting the imports inside functions
    (``command_line_errors`` lives in :mod:`trl_prime.cli_errors`, below :mod:`trl_prime.cli` and the scripts)."""
    graph = _import_graph()
    assert len(graph) > 40 and "trl_prime.cli" in graph["trl_prime.scripts.prime"]  # imports were found
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it finds cycles


def test_each_method_math_lives_in_its_package():
    """:mod:`trl_prime.functional` only re-exports: each method's equations live in ``<method>/functional.py``, the
    shared helpers in :mod:`trl_prime.ops`, the option tuples in :mod:`trl_prime.options`."""
    import ast

    from trl_prime import functional as F

    tree = ast.parse((ROOT / "trl_prime" / "functional.py").read_text())
    allowed = (ast.Import, ast.ImportFrom, ast.Assign, ast.Expr)  # imports, __all__, the docstring
    assert all(isinstance(node, allowed) for node in tree.body)
    assert [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets] == ["__all__"]
    homes = {
        "prime_advantages": "trl_prime.prime.estimators",
        "rloo_advantages": "trl_prime.prime.functional",
        "gae_advantages": "trl_prime.prime.functional",
        "prm_labels": "trl_prime.prime.functional",
        "prl_advantages": "trl_prime.prl.functional",
        "prof_select": "trl_prime.prof.functional",
        "implicit_prm_loss": "trl_prime.implicit_prm.functional",
        "step_rewards": "trl_prime.implicit_prm.functional",
        "grpo_advantages": "trl_prime.ops",
        "masked_whiten": "trl_prime.ops",
        "check_choice": "trl_prime.options",
    }
    for name, module in homes.items():
        assert getattr(F, name).__module__ == module, name
    for name in F.__all__:
        obj = getattr(F, name)
        assert getattr(obj, "__module__", "trl_prime.") != "trl_prime.functional", name


def test_estimator_names_are_compared_only_in_the_registry():
    """No module but :mod:`trl_prime.prime.estimators` compares a value with an estimator's name (``== "ppo"``,
    ``in ("rloo", "grpo")``): they ask the registry (``get_advantage_estimator(name).needs_values``, ...)."""
    import ast

    from trl_prime.prime.estimators import ESTIMATORS

    names = set(ESTIMATORS)
    offenders = []
    for path in sorted((ROOT / "trl_prime").rglob("*.py")):
        if path.name == "estimators.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            text = " ".join(ast.unparse(o) for o in operands)
            constants = {
                c.value
                for o in operands
                for c in ast.walk(o)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            if constants & names and "estimator" in text:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------------- adapters (MRO)


def _trainer_classes():
    import trl_prime

    return (
        trl_prime.PrimeGRPOTrainer,
        trl_prime.PrimeRLOOTrainer,
        trl_prime.PRLGRPOTrainer,
        trl_prime.ProfGRPOTrainer,
    )


def _ours(cls) -> list[type]:
    return [k for k in cls.__mro__ if k.__module__.startswith("trl_prime")]


def test_each_trainer_has_at_most_three_trl_prime_classes_and_one_adapter():
    """Composition over inheritance: a trainer is its method's class (PRIME's shared by its two trainers) on one
    adapter per TRL base; guards, checkpoints, optimizers, the PROF filter are plain objects it holds."""
    from trl import GRPOTrainer, RLOOTrainer

    from trl_prime.adapters import GRPOAdapter, RLOOAdapter

    for cls in _trainer_classes():
        ours = _ours(cls)
        assert len(ours) <= 3, f"{cls.__name__}: {[k.__name__ for k in ours]}"
        adapters = [k for k in ours if k in (GRPOAdapter, RLOOAdapter)]
        assert len(adapters) == 1, cls.__name__
        assert adapters[0].__bases__ in ((GRPOTrainer,), (RLOOTrainer,))


def test_only_the_adapters_override_trl_private_methods_each_once():
    """A private method of TRL's trainers or of transformers.Trainer (``_name``, not dunder) is overridden by the
    adapter alone, and by no other trl-prime class of the trainer's MRO: one place per hook to update on a TRL
    release."""
    from transformers import Trainer
    from trl import GRPOTrainer, RLOOTrainer

    from trl_prime.adapters import GRPOAdapter, RLOOAdapter

    def private(cls):
        return {
            n
            for k in cls.__mro__
            if k.__module__.split(".")[0] in ("trl", "transformers")
            for n in vars(k)
            if n.startswith("_") and not n.startswith("__")
        }

    theirs = private(GRPOTrainer) | private(RLOOTrainer) | private(Trainer)
    assert {"_generate_and_score_completions", "_compute_loss", "_save_checkpoint"} <= theirs  # found them
    overridden = {}
    for cls in _trainer_classes():
        for k in _ours(cls):
            for n in set(vars(k)) & theirs:
                if isinstance(vars(k)[n], (int, float, str, bool, list, type(None))):
                    continue  # class attributes (e.g. `_tag_names`, `_name`) are settings, not hooks
                overridden.setdefault(n, set()).add(k)
    outside = {n: sorted(k.__name__ for k in ks) for n, ks in overridden.items() if ks - {GRPOAdapter, RLOOAdapter}}
    assert not outside, f"TRL private methods overridden outside the adapters: {outside}"
    assert overridden, "no override found: the check is broken"


def test_prime_round_is_written_by_the_step_alone():
    """Each line of PRIME's Algorithm 1 returns its result (typed: ``PromptFilter``, ``Advantages``, tensors); only
    ``_algorithm_step`` writes them into the round, so the step shows every piece of state a round gets."""
    import ast

    tree = ast.parse((ROOT / "trl_prime" / "prime" / "trainer.py").read_text())
    writers = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "r":
                    writers.setdefault(fn.name, set()).add(t.attr)
    assert set(writers) == {"_algorithm_step"}, writers
    assert {"filter", "ref_logps", "prm_logps", "token_rewards", "policy_kept", "values", "adv"} <= writers[
        "_algorithm_step"
    ]


def test_the_two_adapters_hook_trl_alike():
    """``GRPOAdapter`` and ``RLOOAdapter`` override the same hooks with the same code, except the policy loss (RLOO's
    is PRIME's token-level one): a fix made in one adapter cannot be missed in the other."""
    import inspect
    import textwrap

    from trl_prime.adapters import GRPOAdapter, RLOOAdapter

    def methods(cls):
        return {n: v for n, v in vars(cls).items() if callable(v) or isinstance(v, property)}

    grpo, rloo = methods(GRPOAdapter), methods(RLOOAdapter)
    differ = {"_compute_loss", "_log_loss_metrics", "_generate_and_score_completions"}
    assert set(grpo) - differ == set(rloo) - differ
    for name in set(grpo) - differ:
        src = [textwrap.dedent(inspect.getsource(getattr(m[name], "fget", m[name]))) for m in (grpo, rloo)]
        assert src[0] == src[1], f"{name} differs between GRPOAdapter and RLOOAdapter"
