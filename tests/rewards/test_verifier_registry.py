"""The verifier registry: one entry adds a verifier to the routing, the failure-rate guard, the scripts and eval."""

from __future__ import annotations

import pytest

from trl_prime import data as D
from trl_prime.rewards import registry
from trl_prime.rewards.registry import Verifier, get_verifier, register_verifier


def _echo_reward(completions, expected, log_metric=None, **kwargs):
    """A toy verifier: 1.0 when the completion equals the gold, None (an infrastructure failure) for gold '?'."""
    out = [None if e == "?" else float(c == e) for c, e in zip(completions, expected)]
    if log_metric is not None:
        log_metric("echo/broken", float(sum(r is None for r in out)))
    return out


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return register_verifier(
        Verifier("echo", _echo_reward, gold_column="expected", failure_metric="echo/broken", sources={"Echo_Set"})
    )


def test_builtin_entries():
    assert [v.ability for v in registry.verifiers()] == ["math", "code"]
    assert registry.failure_metrics() == ("math/error", "code/sandbox_error")
    from trl_prime.rewards import code_reward, math_reward

    assert get_verifier("math").reward_fn() is math_reward and get_verifier("math").gold_column == "solution"
    assert get_verifier("code").reward_fn() is code_reward and get_verifier("code").gold_column == "tests"
    with pytest.raises(KeyError, match="registered: \\['code', 'math'\\]"):
        get_verifier("sql")


def test_one_entry_adds_a_verifier_everywhere(echo):
    # routing by ability and by data source
    assert D.route_of("ECHO") == "echo" and D.route_of(None, "echo_set") == "echo"
    assert D.route_of("math", "echo_set") == "math"
    # the routed reward passes the verifier its gold column and counts the route
    logged = []
    reward = D.make_routed_reward(name="routed")
    out = reward(
        ["a", "b", "c"],
        ability=["echo", "echo", "echo"],
        expected=["a", "x", "?"],
        log_metric=lambda k, v: logged.append((k, v)),
    )
    assert out == [1.0, 0.0, None]
    assert reward.last_counts == {"math": 0, "code": 0, "echo": 3, "unrouted": 0}
    assert ("echo/broken", 1.0) in logged and ("route/echo", 3.0) in logged
    with pytest.raises(ValueError, match="no 'expected' column"):
        reward(["a"], ability=["echo"])
    # the trainers' failure-rate guard counts its failure metric
    import trl_prime.guards as guards

    assert "echo/broken" in guards.INFRASTRUCTURE_FAILURE_METRICS
    # the scripts' --reward outcome is the routed reward, which now includes it
    from trl_prime.scripts.utils import RLScriptArguments, reward_functions

    assert reward_functions(RLScriptArguments(dataset_name="embedded:gsm_symbolic")) == [D.outcome_reward]
    assert D.outcome_reward(["a"], ability=["echo"], expected=["a"]) == [1.0]
    # --reward math: the registry's math verifier
    assert reward_functions(RLScriptArguments(dataset_name="embedded:gsm_symbolic", reward="math")) == [
        get_verifier("math").reward_fn()
    ]


def test_entries_are_validated(echo):
    with pytest.raises(ValueError, match="registered already"):
        register_verifier(Verifier("echo", _echo_reward, gold_column="expected", failure_metric="echo/broken"))
    with pytest.raises(ValueError, match="failure_metric"):
        Verifier("sql", _echo_reward, gold_column="rows", failure_metric="broken")
    with pytest.raises(ValueError, match="module:attribute"):
        Verifier("sql", "my_pkg.sql_reward", gold_column="rows", failure_metric="sql/error")
    with pytest.raises(ValueError, match="lower-case"):
        Verifier("SQL", _echo_reward, gold_column="rows", failure_metric="sql/error")
