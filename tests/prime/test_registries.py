"""The two registries: PRIME's advantage estimators (:mod:`trl_prime.prime.estimators`) and the methods / commands of
``trl-prime`` (:mod:`trl_prime.methods`). Adding an estimator is one function and one entry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trl_prime import functional as F
from trl_prime.prime import estimators as E


@pytest.fixture
def halved_rloo():
    """A registered estimator: half of "rloo" (one function, one entry); unregistered afterwards."""

    def halved(process_rewards, outcome_rewards, mask, group_ids, **options):
        return 0.5 * F.prime_advantages(process_rewards, outcome_rewards, mask, group_ids, estimator="rloo", **options)

    entry = E.AdvantageEstimator(
        "halved_rloo",
        halved,
        options=frozenset({"process_coef", "outcome_coef"}),
        config_fields={"process_coef": "process_coef", "outcome_coef": "outcome_coef"},
    )
    E.register_advantage_estimator(entry)
    yield entry
    E._ESTIMATORS.pop("halved_rloo")


def test_a_registered_estimator_is_one_entry_and_one_function(halved_rloo):
    torch.manual_seed(0)
    P, o = torch.randn(4, 5), torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask, groups = torch.ones(4, 5, dtype=torch.bool), torch.tensor([0, 0, 1, 1])
    expected = 0.5 * F.prime_advantages(P, o, mask, groups, estimator="rloo", process_coef=0.3)
    got = F.prime_advantages(P, o, mask, groups, estimator="halved_rloo", process_coef=0.3)
    assert torch.equal(got, expected)
    assert E.get_advantage_estimator("halved_rloo", "prime_estimator") is halved_rloo
    assert "halved_rloo" in E.advantage_estimator_names() and "halved_rloo" not in F.ESTIMATORS  # built-ins only
    config = SimpleNamespace(prime_estimator="halved_rloo", process_coef=0.3, outcome_coef=1.0)
    assert E.estimator_options(config) == {"estimator": "halved_rloo", "process_coef": 0.3, "outcome_coef": 1.0}
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['gamma'\]"):
        F.prime_advantages(P, o, mask, groups, estimator="halved_rloo", gamma=0.9)
    with pytest.raises(ValueError, match="registered already"):
        E.register_advantage_estimator(halved_rloo)


def test_unknown_estimator_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"prime_estimator='gae' is not supported; choose one of 'rloo', 'grpo'"):
        E.get_advantage_estimator("gae", "prime_estimator")


def test_builtin_estimators_and_what_the_trainer_reads():
    assert F.ESTIMATORS == ("rloo", "grpo", "reinforce", "ppo")
    assert [n for n in F.ESTIMATORS if E.get_advantage_estimator(n).needs_values] == ["ppo"]
    assert [n for n in F.ESTIMATORS if E.get_advantage_estimator(n).group_std] == ["grpo"]
    config = SimpleNamespace(
        prime_estimator="ppo",
        prime_value="implicit_prm",
        process_coef=0.7,
        outcome_coef=1.0,
        prime_gamma=1.0,
        lam=0.95,
    )
    config.whiten_advantages = False
    assert E.estimator_options(config) == {
        "estimator": "ppo",
        "process_coef": 0.0,  # the implicit PRM as the value: the outcome is the only reward
        "outcome_coef": 1.0,
        "gamma": 1.0,
        "lam": 0.95,
        "whiten": False,
    }


def test_method_registry_drives_the_command_line():
    import trl_prime
    from trl_prime import cli, methods
    from trl_prime.scripts import utils

    assert cli.COMMANDS == {name: (c.script, c.help) for name, c in methods.COMMANDS.items()}
    assert cli.TRAINING_COMMANDS == ("prime", "prl", "prof", "implicit-prm")
    assert utils.COMMAND_TRAINERS == {
        "prime": ("prime_rloo", "prime_grpo"),
        "prl": ("prl_grpo",),
        "prof": ("prof_grpo", "prime_grpo"),
    }
    for entry in methods.TRAINERS.values():
        assert entry.config_name in trl_prime.__all__ and entry.trainer_name in trl_prime.__all__
        assert entry.config_class() is getattr(trl_prime, entry.config_name)
    assert [t for t, e in methods.TRAINERS.items() if e.saves_prm] == ["prime_rloo", "prime_grpo"]
    with pytest.raises(ValueError, match=r"`trainer`='ppo_grpo': choose one of \['prime_rloo'"):
        methods.get_trainer("ppo_grpo")
    with pytest.raises(ValueError, match="unknown trainer"):
        methods.register_command(methods.CommandEntry("x", "x", "x", trainers=("nope",)))
