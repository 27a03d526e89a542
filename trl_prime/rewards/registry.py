"""The verifier registry: one entry per verifier, read by the data routing, the trainers' guards and the scripts.

A verifier is a TRL reward function for the rows of one *ability* (the dataset's ``ability`` column). Its entry
names everything the rest of trl-prime needs to know about it:

* ``ability``: the route name (``"math"``, ``"code"``); rows whose ``ability`` is this string are scored by it.
* ``reward``: the reward function, or ``"module:attribute"`` to import it on first use (so that reading the
  registry never imports a verifier).
* ``gold_column``: the dataset column holding each row's gold (``"solution"``, ``"tests"``); the routed reward
  passes it to ``reward`` under that keyword.
* ``failure_metric``: the ``log_metric`` name under which ``reward`` counts its infrastructure failures (rows it
  scored ``None`` because it could not run); the trainers' ``verifier/failure_rate`` guard adds these up.
* ``sources`` / ``source_prefixes``: ``data_source`` values (lower case) that route a row here when its
  ``ability`` is missing.

Adding a verifier is one call::

    from trl_prime.rewards.registry import Verifier, register_verifier

    register_verifier(Verifier("sql", "my_pkg.sql:sql_reward", gold_column="expected_rows",
                               failure_metric="sql/db_error"))

after which :func:`trl_prime.data.route_of`, :data:`trl_prime.data.outcome_reward` (``--reward outcome`` of the
training scripts), ``trl-prime eval`` (reason counts per route) and the failure-rate guard all know it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field


__all__ = ["Verifier", "register_verifier", "get_verifier", "verifiers", "failure_metrics"]


@dataclass(frozen=True)
class Verifier:
    """One registry entry (see the module docstring).

    Raises:
        ValueError: ``ability`` is empty or not lower case, ``gold_column`` is empty, ``failure_metric`` has no
            ``/``, or ``reward`` is a string that is not ``"module:attribute"``.
    """

    ability: str
    reward: Callable | str
    gold_column: str
    failure_metric: str
    sources: frozenset[str] = field(default_factory=frozenset)
    source_prefixes: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.ability, str) or not self.ability or self.ability != self.ability.strip().lower():
            raise ValueError(f"Verifier.ability must be a non-empty lower-case name, got {self.ability!r}")
        if not isinstance(self.gold_column, str) or not self.gold_column:
            raise ValueError(f"Verifier.gold_column must name a dataset column, got {self.gold_column!r}")
        if not isinstance(self.failure_metric, str) or "/" not in self.failure_metric:
            raise ValueError(
                f"Verifier.failure_metric must be a log_metric name such as '{self.ability}/error', "
                f"got {self.failure_metric!r}"
            )
        if isinstance(self.reward, str) and self.reward.count(":") != 1:
            raise ValueError(f"Verifier.reward must be a callable or 'module:attribute', got {self.reward!r}")
        if not (isinstance(self.reward, str) or callable(self.reward)):
            raise ValueError(f"Verifier.reward must be a callable or 'module:attribute', got {self.reward!r}")
        object.__setattr__(self, "sources", frozenset(s.lower() for s in self.sources))
        object.__setattr__(self, "source_prefixes", tuple(p.lower() for p in self.source_prefixes))

    def reward_fn(self) -> Callable:
        """The reward function (imported on first use when ``reward`` is ``"module:attribute"``)."""
        if callable(self.reward):
            return self.reward
        module, attr = self.reward.split(":")
        return getattr(importlib.import_module(module), attr)

    def claims_source(self, data_source: str) -> bool:
        """Whether a row of this (lower-case, stripped) ``data_source`` belongs to this verifier."""
        return data_source in self.sources or data_source.startswith(self.source_prefixes or ("\0",))


_REGISTRY: dict[str, Verifier] = {}


def register_verifier(verifier: Verifier, *, replace: bool = False) -> Verifier:
    """Add ``verifier`` to the registry (under ``verifier.ability``) and return it.

    Raises:
        ValueError: a verifier with that ability is registered already and ``replace`` is False.
    """
    if not isinstance(verifier, Verifier):
        raise ValueError(f"register_verifier takes a Verifier, got {type(verifier).__name__}")
    if verifier.ability in _REGISTRY and not replace:
        raise ValueError(f"a verifier for ability {verifier.ability!r} is registered already; pass replace=True")
    _REGISTRY[verifier.ability] = verifier
    return verifier


def get_verifier(ability: str) -> Verifier:
    """The registered verifier of ``ability``.

    Raises:
        KeyError: no verifier is registered for it (the message lists the registered ones).
    """
    try:
        return _REGISTRY[ability]
    except KeyError:
        raise KeyError(f"no verifier registered for ability {ability!r}; registered: {sorted(_REGISTRY)}") from None


def verifiers() -> tuple[Verifier, ...]:
    """Every registered verifier, in registration order."""
    return tuple(_REGISTRY.values())


def failure_metrics() -> tuple[str, ...]:
    """The ``log_metric`` names of every registered verifier's infrastructure failures."""
    return tuple(v.failure_metric for v in _REGISTRY.values())


register_verifier(
    Verifier(
        "math",
        "trl_prime.rewards.math_verifier:math_reward",
        gold_column="solution",
        failure_metric="math/error",
        # data sources of Eurus-2-RL-Data (and a few common ones) whose ability is known
        sources=frozenset(
            {
                "numina_aops_forum",
                "numina_synthetic_math",
                "numina_amc_aime",
                "numina_synthetic_amc",
                "numina_cn_k12",
                "numina_olympiads",
                "openai/gsm8k",
                "gsm8k",
                "lighteval/math",
                "digitallearninggmbh/math-lighteval",
                "huggingfaceh4/math-500",
                "math",
                "math_dapo",
            }
        ),
        source_prefixes=("numina_", "reasoning_gym/"),
    )
)
register_verifier(
    Verifier(
        "code",
        "trl_prime.rewards.code_verifier:code_reward",
        gold_column="tests",
        failure_metric="code/sandbox_error",
        sources=frozenset(
            {
                "taco",
                "apps",
                "codecontests",
                "codeforces",
                "leetcode",
                "humaneval",
                "openai_humaneval",
                "mbpp",
                "livecodebench",
                "code",
            }
        ),
    )
)
