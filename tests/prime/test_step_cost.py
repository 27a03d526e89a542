"""PRIME's work per step against TRL's RLOO, counted (issue 19): matmul FLOPs, matmul precisions and operator counts
per phase, recorded by a ``TorchDispatchMode`` (independent of machine load, unlike wall-clock time).

PRIME's irreducible cost over RLOO is one PRM forward + backward on the policy's tokens (the work of one policy
update) plus one reference forward (which replaces TRL's rollout log-prob forward): so, with a PRM the size of the
policy, the PRM update must cost exactly the FLOPs of RLOO's policy update, PRIME's policy update exactly RLOO's, and
PRIME's rollout exactly RLOO's. Under bf16 mixed precision the PRM and its reference run in the policy's precision
(TRL autocasts its policy and reference), and the policy's optimizer step makes one pass over the gradients for their
norm (the Trainer's clipping), as TRL's does.
"""

from __future__ import annotations

import collections
import math
from types import SimpleNamespace

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import tiny_kwargs
from tiny import contains_reward, tiny_prompt_dataset
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from transformers import TrainerCallback
from trl import RLOOConfig, RLOOTrainer

from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer
from trl_prime.guards import Guards


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


class Census(TorchDispatchMode):
    """Per phase (``self.phase``; ``None``: not recorded): matmul FLOPs (torch's formulas), ``(op, input dtypes)``
    counts of the matmuls, and every aten operator's call count."""

    def __init__(self):
        super().__init__()
        self.phase = None
        self.flops = collections.Counter()
        self.matmuls = collections.defaultdict(collections.Counter)
        self.ops = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.phase is not None:
            name = str(func.overloadpacket)
            self.ops[self.phase][name] += 1
            if func.overloadpacket in flop_registry:
                shape = lambda x: x.shape if isinstance(x, torch.Tensor) else x  # noqa: E731
                a, k, o = (pytree.tree_map(shape, v) for v in (args, kwargs, out))
                self.flops[self.phase] += flop_registry[func.overloadpacket](*a, **k, out_val=o)
            if name in MATMULS:
                dtypes = tuple(x.dtype for x in args if isinstance(x, torch.Tensor))
                self.matmuls[self.phase][(name, dtypes)] += 1
        return out


def _census(base, cfg_cls, model_path, tmp_path, **overrides) -> Census:
    """One training step of ``base`` (TRL's RLOO or PRIME-RLOO, batch 8 = 2 prompts x 4, completions forced to 8
    tokens), recorded by phase: ``"rollout"`` (TRL's rollout step without generation and, for PRIME, without the PRM
    update: log-prob / reference forwards, rewards, advantages), ``"prm_update"`` and ``"policy"`` (the rest of the
    optimizer step: the policy's loss forward + backward, clipping and AdamW)."""
    census = Census()

    class Recorded(base):
        def _generate(self, prompts):
            phase, census.phase = census.phase, None
            try:
                return super()._generate(prompts)
            finally:
                census.phase = phase

        def _generate_and_score_completions(self, inputs):
            census.phase = "rollout"
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                census.phase = "policy"

        def _train_prm(self, *args, **kwargs):
            census.phase = "prm_update"
            try:
                return super()._train_prm(*args, **kwargs)
            finally:
                census.phase = "rollout"

    class Step(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            census.__enter__()
            census.phase = "policy"

        def on_step_end(self, args, state, control, **kwargs):
            census.phase = None
            census.__exit__(None, None, None)

    kw = tiny_kwargs(
        tmp_path,
        drop=("learning_rate",),
        output_dir=str(tmp_path / base.__name__),
        generation_kwargs={"min_new_tokens": 8},
        beta=0.0,
    )
    if base is not RLOOTrainer:
        kw.update(filter_lower=0.0, filter_upper=1.0)
    kw.update(overrides)
    trainer = Recorded(
        model=model_path,
        reward_funcs=contains_reward("e"),
        args=cfg_cls(**kw),
        train_dataset=tiny_prompt_dataset(16),
        callbacks=[Step()],
    )
    trainer.train()
    return census


@pytest.fixture(scope="module")
def fp32_census(tiny_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cost")
    return {
        "rloo": _census(RLOOTrainer, RLOOConfig, tiny_model_path, tmp),
        "prime": _census(PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp),
    }


def test_prm_update_costs_one_policy_update(fp32_census):
    """Same-size PRM: the PRM update (forward + backward on the 8 rows) has exactly the matmul FLOPs of RLOO's policy
    update, PRIME's policy update exactly RLOO's, and PRIME's rollout (the reference forward) exactly RLOO's (its
    rollout log-prob forward): PRIME's extra work is one policy update, no more."""
    rloo, prime = fp32_census["rloo"], fp32_census["prime"]
    assert rloo.flops["policy"] > 0 and rloo.flops["rollout"] > 0
    assert prime.flops["prm_update"] == rloo.flops["policy"]
    assert prime.flops["policy"] == rloo.flops["policy"]
    assert prime.flops["rollout"] == rloo.flops["rollout"]
    assert prime.flops["prm_update"] > 2 * prime.flops["rollout"]  # a forward + a backward vs a forward
    assert prime.matmuls["prm_update"] == rloo.matmuls["policy"]


def test_policy_step_takes_one_gradient_norm_pass(fp32_census):
    """The policy's optimizer step reads the gradients once for their norm (the Trainer's clipping), as TRL's does:
    the non-finite guard judges that norm instead of computing a second one."""
    rloo, prime = fp32_census["rloo"], fp32_census["prime"]
    assert rloo.ops["policy"]["aten._foreach_norm"] == 1
    assert prime.ops["policy"]["aten._foreach_norm"] == 1
    assert prime.ops["prm_update"]["aten._foreach_norm"] == 1  # the PRM's own clipping


def test_prm_and_reference_follow_the_policys_bf16_autocast(tiny_model_path, tmp_path):
    """bf16=True (CPU autocast here; the same code path on a GPU): the PRM update runs the same matmuls in the same
    precisions as the policy update (bf16, and the fp32 accumulation of TRL's fused LM-head backward), and the
    reference forward runs in bf16, as TRL's own policy and reference do. Before, the PRM and the reference ran in
    fp32 next to a bf16 policy."""
    prime = _census(PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, bf16=True)
    bf16 = torch.bfloat16
    assert prime.matmuls["prm_update"] == prime.matmuls["policy"]
    assert {d for (_, dtypes) in prime.matmuls["policy"] for d in dtypes} >= {bf16}
    assert prime.matmuls["rollout"] and all(set(d) == {bf16} for (_, d) in prime.matmuls["rollout"])


def _guards(clip_norm):
    """A one-process :class:`~trl_prime.guards.Guards` whose Trainer recorded the clipping norm ``clip_norm``."""
    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True)
    guards = Guards(SimpleNamespace(), acc, record=lambda *a: None, global_step=lambda: 0)
    guards.clip_norm = clip_norm
    return guards


@pytest.mark.parametrize(
    "clip_norm,grad,expected",
    [
        (1.5, 1.0, None),  # the clipping's norm is finite: every gradient is finite, no second pass needed
        (math.inf, 1.0, "overflow"),  # an overflowing norm: clipping scaled the gradients to finite zeros
        (math.nan, 1.0, "overflow"),
        (None, 1.0, None),  # no clipping norm recorded (a custom loop): the gradients themselves are read
        (None, math.nan, "overflow"),
        (None, math.inf, "overflow"),
    ],
)
def test_guard_judges_the_clipping_norm_else_the_gradients(clip_norm, grad, expected):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([0.5, grad, -0.25])
    opt = torch.optim.SGD([p], lr=0.1)
    guards = _guards(clip_norm)
    reason = guards.step_problem(opt)
    if expected is None:
        assert reason is None
    else:
        assert reason == "non-finite policy gradient norm: gradient overflow (no single row)"
    assert guards.clip_norm is None  # consumed: the next step is judged on its own norm
