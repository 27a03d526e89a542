"""The TRL versions trl-prime is tested against, and the start-up check that names them.

trl-prime's trainers override private methods of TRL's trainers (``_generate_and_score_completions``,
``_calculate_rewards``, ``_compute_loss``, ``_prepare_inputs``, ...), whose signatures and behaviour TRL changes
between minor versions. :data:`TESTED_TRL` is the range the test suite has run against; ``pyproject.toml`` pins the
same range (``tests/core/test_compat.py`` checks that the two agree). To widen it: run the test suite against the new TRL,
fix what breaks, then raise both (and rewrite ``constraints/ci.txt`` with ``make lock``).
"""

from __future__ import annotations

import warnings


# The single source of truth of the tested TRL range (PEP 440 specifiers, joined with ",").
TESTED_TRL: tuple[str, ...] = (">=1.16", "<1.17")

_checked = False


class UntestedTRLVersionWarning(UserWarning):
    """The installed TRL is outside :data:`TESTED_TRL`: trl-prime may still work, but nothing here has checked it."""


def tested_trl_specifier() -> str:
    """``TESTED_TRL`` as one PEP 440 specifier string, e.g. ``">=1.16,<1.17"``."""
    return ",".join(TESTED_TRL)


def check_trl_version(installed: str | None = None, *, stacklevel: int = 2) -> bool:
    """Warn (:class:`UntestedTRLVersionWarning`) when the installed TRL is outside :data:`TESTED_TRL`.

    A warning, not an error, so that a user can try a newer TRL. Called when a trainer module is imported (once per
    process); pass ``installed`` to check a given version string instead of ``trl.__version__``.

    Args:
        installed: a TRL version string (default: ``trl.__version__``).

    Returns:
        ``True`` if the version lies in the tested range, else ``False`` (after warning).
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if installed is None:
        import trl

        installed = trl.__version__
    spec = SpecifierSet(tested_trl_specifier())
    try:
        ok = spec.contains(Version(installed), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        warnings.warn(
            f"trl-prime is tested with trl{tested_trl_specifier()}, but trl {installed} is installed. trl-prime "
            "overrides private methods of TRL's trainers, which change between TRL minor versions, so training may "
            "fail or silently differ. Install a tested version (pip install 'trl" + tested_trl_specifier() + "', or "
            "the exact versions of constraints/ci.txt), or, if you keep this one, report what breaks in a trl-prime "
            "issue with the output of `pip list`.",
            UntestedTRLVersionWarning,
            stacklevel=stacklevel,
        )
    return ok


def check_trl_version_once() -> None:
    """:func:`check_trl_version` for the installed TRL, once per process.

    :mod:`trl_prime.rollout`, which every RL trainer imports, calls it on import.
    """
    global _checked
    if not _checked:
        _checked = True
        check_trl_version(stacklevel=4)  # the trainer module's line that imports it
