"""The dependency bounds: pyproject.toml's TRL range equals trl_prime._compat.TESTED_TRL, the start-up check warns
outside it (and only there), and the installed versions and the CI lock (constraints/ci.txt) lie within pyproject's
bounds."""

from __future__ import annotations

import re
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from trl_prime import _compat
from trl_prime._compat import TESTED_TRL, UntestedTRLVersionWarning, check_trl_version


ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")


def _requirements(extras: bool = True) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    if extras:
        reqs += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    return reqs


def test_pyproject_trl_bound_is_the_tested_range():
    (trl,) = [r for r in _requirements(extras=False) if r.name == "trl"]
    assert trl.specifier == SpecifierSet(",".join(TESTED_TRL))
    assert _compat.tested_trl_specifier() == ">=1.16,<1.17"


def test_every_dependency_has_an_upper_bound():
    for req in _requirements():
        assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{req} has no upper bound"


@pytest.mark.parametrize("installed", ["1.16.0", "1.16.7", "1.16.1.post1"])
def test_no_warning_inside_the_tested_range(installed):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_trl_version(installed) is True


@pytest.mark.parametrize("installed", ["1.15.2", "1.17.0", "1.17.0.dev0", "2.0.0", "not-a-version"])
def test_warning_outside_the_tested_range_names_both_versions(installed):
    with pytest.warns(UntestedTRLVersionWarning) as rec:
        assert check_trl_version(installed) is False
    (w,) = rec
    msg = str(w.message)
    assert f"trl {installed} is installed" in msg
    assert "trl>=1.16,<1.17" in msg
    assert "constraints/ci.txt" in msg and "report" in msg


def test_check_reads_trl_version_and_warns_once_per_process(monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.18.2")
    monkeypatch.setattr(_compat, "_checked", False)
    with pytest.warns(UntestedTRLVersionWarning, match=r"trl 1\.18\.2 is installed") as rec:
        _compat.check_trl_version_once()
        _compat.check_trl_version_once()
    assert len(rec) == 1
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_trl_version() is True


def test_installed_versions_are_within_the_bounds():
    """The suite runs against versions inside pyproject's bounds (the bounds claim what was tested)."""
    checked = 0
    for req in _requirements():
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue  # an extra that is not installed here (vllm, ...)
        assert req.specifier.contains(Version(installed), prereleases=True), f"{req.name} {installed} not in {req}"
        checked += 1
    assert checked >= 8


def test_ci_lock_pins_versions_within_the_bounds():
    lines = (ROOT / "constraints" / "ci.txt").read_text().splitlines()
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert m, f"constraints/ci.txt: {line!r} is not 'name==version'"
        pins[canonicalize_name(m.group(1))] = m.group(2)
    assert "trl-prime" not in pins  # the local package is not locked
    assert pins["torch"] == "2.13.0"  # no local label (+cpu): the lock holds on CPU and GPU machines
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in pins:
            assert req.specifier.contains(Version(pins[name]), prereleases=True), f"lock {name}=={pins[name]} vs {req}"
    for name in ("trl", "transformers", "accelerate", "peft", "datasets", "math-verify", "deepspeed", "pytest"):
        assert name in pins, f"{name} missing from constraints/ci.txt"
