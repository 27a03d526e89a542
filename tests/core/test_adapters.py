"""The adapters as a user extends them: the documented custom method trains, a missing step or a wrong config fails
early with a message naming the fix."""

from __future__ import annotations

import textwrap

import pytest
from helpers import tiny_kwargs
from tiny import contains_reward, tiny_prompt_dataset
from trl import GRPOConfig, RLOOConfig


def _documented_trainer():
    """The class of the example in ``trl_prime.adapters``' docstring, executed as written."""
    import trl_prime.adapters

    doc = trl_prime.adapters.__doc__
    code = textwrap.dedent(doc[doc.index("::\n") + 3 :]).strip()
    namespace: dict = {}
    exec(compile(code, "trl_prime/adapters.py (docstring example)", "exec"), namespace)
    return namespace["MyGRPOTrainer"]


def test_the_documented_custom_method_trains_and_logs(tiny_model_path, tmp_path):
    cls = _documented_trainer()
    tr = cls(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        args=GRPOConfig(**tiny_kwargs(tmp_path, max_steps=2)),
        train_dataset=tiny_prompt_dataset(16),
    )
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    logs = [h for h in tr.state.log_history if "my/scorable_fraction" in h]
    assert [h["my/scorable_fraction"] for h in logs] == [1.0, 1.0]  # the reward scores every row
    assert all("verifier/failure_rate" in h for h in logs)  # the adapter's own checks ran
    assert any(not p.equal(q) for p, q in zip(tr.model.parameters(), before))  # the policy trained


def test_a_method_without_its_step_says_which_hook(tiny_model_path, tmp_path):
    from trl_prime.adapters import GRPOAdapter

    class NoStep(GRPOAdapter):
        pass

    tr = NoStep(
        model=tiny_model_path,
        reward_funcs=contains_reward("e"),
        args=GRPOConfig(**tiny_kwargs(tmp_path)),
        train_dataset=tiny_prompt_dataset(8),
    )
    with pytest.raises(NotImplementedError, match=r"NoStep .* does not define _algorithm_step\(output, rollout\)"):
        tr.train()


@pytest.mark.parametrize("adapter", ["GRPOAdapter", "RLOOAdapter"])
def test_a_config_of_another_trainer_is_refused_by_name(tiny_model_path, tmp_path, adapter):
    import trl_prime.adapters

    cls = getattr(trl_prime.adapters, adapter)
    wrong = RLOOConfig if adapter == "GRPOAdapter" else GRPOConfig
    expected = "GRPOConfig" if adapter == "GRPOAdapter" else "RLOOConfig"
    with pytest.raises(TypeError, match=rf"needs `args` to be a {expected} .* got {wrong.__name__}"):
        cls(tiny_model_path, contains_reward("e"), wrong(**tiny_kwargs(tmp_path)))
