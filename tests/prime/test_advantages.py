"""Advantage fixes: PRIME-GRPO's response-level process term (PRIME App. B.3, Eq. 8) and groups left with a single
scorable row (no baseline: advantage 0), in the functional API, the configs and the trainers (single process, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_kwargs, tiny_trainer
from tiny import tiny_prompt_dataset
from tiny_prm import build_tiny_step_prm

from trl_prime import PrimeGRPOConfig, PrimeRLOOConfig, PRLConfig, PRLGRPOTrainer, ProfGRPOConfig, ProfGRPOTrainer
from trl_prime import functional as F
from trl_prime.callbacks import PrimeCallback


K = 4
EPS = 1e-6
NAN = float("nan")


def close(a, b, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=rtol
    )


def right_mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def samuelson(k):
    """The largest |z-score| K values can have with the unbiased std: (K-1)/sqrt(K)."""
    return (k - 1) / math.sqrt(k)


# ----------------------------------------------------------------------------------------------------------------
# 1. PRIME-GRPO process term
# ----------------------------------------------------------------------------------------------------------------
def test_grpo_response_form_is_bounded_at_l1024_and_the_printed_form_is_not():
    """Token rewards of pure noise (1e-3), completions of 512..1024 tokens, divided by the process rewards' own std:
    in the response form the process advantage at t=0 is the group z-score of the mean token reward (|A_0| <=
    (K-1)/sqrt(K)); the printed Eq. 8 is L_i times it. With the default divisor (the outcome's std) the printed form
    is Eq. 5's sum of centred token rewards over the outcome's scale."""
    g = torch.Generator().manual_seed(0)
    G, T = 16, 1024
    B = G * K
    lengths = torch.randint(512, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = right_mask(lengths.tolist(), T)
    P = 1e-3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    o = torch.ones(B, dtype=torch.float64)  # equal outcomes: the outcome term is exactly 0, A_0 is the process term
    gid = torch.arange(B) // K
    zs = dict(grpo_process_scale="process_std", grpo_process_form="response")
    adv = F.prime_advantages(P, o, mask, gid, estimator="grpo", **zs)
    assert adv[:, 0].abs().max().item() <= samuelson(K)
    # exactly the z-score of rbar
    rbar = (P * mask).sum(1) / lengths
    r = rbar.view(G, K)
    z = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + EPS)).view(-1)
    close(adv[:, 0], z, atol=1e-9, rtol=1e-9)
    # finite at every token, no growth with the length
    assert torch.isfinite(adv).all() and adv[mask].abs().max().item() < 10
    printed = F.prime_advantages(
        P, o, mask, gid, estimator="grpo", grpo_process_form="token", grpo_process_scale="process_std"
    )
    close(printed[:, 0], lengths * z, atol=1e-6, rtol=1e-9)
    assert printed[:, 0].abs().max().item() > 100 * samuelson(K)
    # the outcome scale with outcomes that vary: the response form's process term at t=0 is
    # (rbar_i - mean_g rbar) / std_g r_o, and the default (the printed form) is L_i times it: the centred process
    # return of Eq. 5 in the outcome's unit, which for noise of 1e-3 per token stays far below the outcome term
    o2 = (torch.arange(B) % 2).to(torch.float64)  # 0, 1, 0, 1: std_g r_o = sqrt(1/3)
    proc = F.prime_advantages(P, o2, mask, gid, estimator="grpo", outcome_coef=0.0, grpo_process_form="response")
    assert proc[:, 0].abs().max().item() <= samuelson(K)
    r_std = (rbar.view(G, K) - rbar.view(G, K).mean(1, keepdim=True)).view(-1) / (math.sqrt(1 / 3) + EPS)
    close(proc[:, 0], r_std, atol=1e-9, rtol=1e-9)
    printed2 = F.prime_advantages(P, o2, mask, gid, estimator="grpo", outcome_coef=0.0)
    close(printed2[:, 0], lengths * r_std, atol=1e-6, rtol=1e-9)
    assert printed2[:, 0].abs().max().item() < 0.5  # noise of 1e-3 per token: below the outcome term's 0.87


def test_grpo_default_is_bounded_at_every_token_for_a_structured_prm():
    """Mean token rewards that nearly agree across the group but vary inside each completion (+0.02 on the first
    half, -0.02 on the second, 1e-5 noise): dividing by the process rewards' own group std explodes at t>0
    (|A| in the thousands); the default (Eq. 8's token sum over the outcome's std) is Eq. 5's process return in the
    outcome's unit: exactly sum_{s>=t} (r_s - mean_g rbar) / std_g r_o, within 2 (L - t) max|r| / std_g r_o."""
    g = torch.Generator().manual_seed(3)
    B, T = 8, 512
    mask = torch.ones(B, T, dtype=torch.bool)
    P = torch.cat([torch.full((B, T // 2), 0.02), torch.full((B, T // 2), -0.02)], 1).double()
    P = P + 1e-5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    o = (torch.arange(B) % 2).to(torch.float64)
    gid = torch.arange(B) // K
    kw = dict(estimator="grpo", outcome_coef=0.0)
    wild = F.prime_advantages(P, o, mask, gid, grpo_process_scale="process_std", grpo_process_form="response", **kw)
    assert wild.abs().max().item() > 1000
    tame = F.prime_advantages(P, o, mask, gid, **kw)
    so = math.sqrt(1 / 3) + EPS
    rbar = P.mean(1).view(-1, K)
    centred = P - rbar.mean(1, keepdim=True).repeat_interleave(K, 0)
    want = centred.flip(1).cumsum(1).flip(1) / so
    close(tame, want, atol=1e-9, rtol=1e-9)
    remaining = torch.arange(T, 0, -1, dtype=torch.float64)
    assert bool((tame.abs() <= 2 * remaining * P.abs().max() / so).all())
    assert tame.abs().max().item() < 10  # about 256 * 0.02 / 0.577 = 8.9, not thousands


def test_grpo_response_form_hand():
    """K=3: rbar = [1, 3, 2] (mean 2, std 1), outcome [1, 0, 0] (mean 1/3, std sqrt(1/3))."""
    P = torch.tensor([[1.0, 1.0], [3.0, 0.0], [2.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    o = torch.tensor([1.0, 0.0, 0.0])
    gid = torch.tensor([0, 0, 0])
    so = math.sqrt(1.0 / 3.0)
    oa = [(2 / 3) / (so + EPS), (-1 / 3) / (so + EPS), (-1 / 3) / (so + EPS)]
    # process tokens (r_s - 2) / (L_i (1 + eps)): row 0 [-1/2, -1/2], row 1 [1], row 2 [0, 0]
    p = 1.0 / (1.0 + EPS)
    want = [[-1.0 * p + oa[0], -0.5 * p + oa[0]], [1.0 * p + oa[1], 0.0], [oa[2], oa[2]]]
    zs = dict(grpo_process_scale="process_std", grpo_process_form="response")
    close(F.prime_advantages(P, o, mask, gid, estimator="grpo", **zs), want)
    # discounted: row 0 at t=0 is -1/2 + 0.5 * (-1/2) = -0.75
    want_g = [[-0.75 * p + oa[0], -0.5 * p + oa[0]], [1.0 * p + oa[1], 0.0], [oa[2], oa[2]]]
    close(F.prime_advantages(P, o, mask, gid, estimator="grpo", gamma=0.5, **zs), want_g)
    # scale_rewards=False: centred only; response form A_0 = rbar_i - mean (process) + o_i - mean (outcome), the
    # default token form sums the centred token rewards (row 0: [-2, -1])
    ob = [2 / 3, -1 / 3, -1 / 3]
    close(
        F.prime_advantages(P, o, mask, gid, estimator="grpo", scale_rewards=False, grpo_process_form="response"),
        [[-1.0 + ob[0], -0.5 + ob[0]], [1.0 + ob[1], 0.0], [ob[2], ob[2]]],
    )
    close(
        F.prime_advantages(P, o, mask, gid, estimator="grpo", scale_rewards=False),
        [[-2.0 + ob[0], -1.0 + ob[0]], [1.0 + ob[1], 0.0], [ob[2], ob[2]]],
    )
    # the outcome's std as the process divisor, response form
    q = 1.0 / (so + EPS)
    want_o = [[-1.0 * q + oa[0], -0.5 * q + oa[0]], [1.0 * q + oa[1], 0.0], [oa[2], oa[2]]]
    close(F.prime_advantages(P, o, mask, gid, estimator="grpo", grpo_process_form="response"), want_o)
    # the defaults: token form (Eq. 8 as printed: the centred token rewards summed, not divided by L_i) over the
    # outcome's std; centred tokens: row 0 [-1, -1] -> [-2, -1], row 1 [1] -> [1], row 2 [0, 0]
    want_t = [[-2.0 * q + oa[0], -1.0 * q + oa[0]], [1.0 * q + oa[1], 0.0], [oa[2], oa[2]]]
    close(F.prime_advantages(P, o, mask, gid, estimator="grpo"), want_t)
    close(F.prime_advantages(P, o, mask, gid, estimator="grpo", grpo_process_form="token"), want_t)


def test_grpo_default_process_term_keeps_eq5_size():
    """Issue example: K=8, one right completion, L=24, a PRM that ranks correctly (+0.03 per token on the right
    completion, -0.03/7 on the others). On a wrong row the process part of A_0 over the outcome part is, by hand:
    GRPO token form / outcome std: (24 * 0.03/7) / (1/8) = 0.72 * 8/7 = 0.822857;
    RLOO Eq. 5: 24 * (0.03/7 + 0.03/49) / (1/7) = 0.72 * 8/7 = 0.822857 (the same);
    GRPO response form: 0.822857 / 24 = 0.034286 (PRIME-GRPO was nearly plain GRPO)."""
    K, L = 8, 24
    P = torch.full((K, L), -0.03 / 7, dtype=torch.float64)
    P[0] = 0.03
    o = torch.zeros(K, dtype=torch.float64)
    o[0] = 1.0
    mask = torch.ones(K, L, dtype=torch.bool)
    gid = torch.zeros(K, dtype=torch.long)

    def ratio(**kw):
        full = F.prime_advantages(P, o, mask, gid, **kw)[1, 0]
        outcome = F.prime_advantages(P, o, mask, gid, process_coef=0.0, **kw)[1, 0]
        return ((full - outcome) / outcome).item()

    assert ratio(estimator="rloo") == pytest.approx(0.72 * 8 / 7, rel=1e-9)
    assert ratio(estimator="grpo") == pytest.approx(0.72 * 8 / 7, rel=1e-9)  # the defaults
    assert ratio(estimator="grpo", grpo_process_form="response") == pytest.approx(0.72 * 8 / 7 / 24, rel=1e-9)
    # absolute size: the outcome part is -(1/8) / (sqrt(1/8) + eps)
    so = math.sqrt(1 / 8) + EPS
    full = F.prime_advantages(P, o, mask, gid, estimator="grpo")[1, 0].item()
    assert full == pytest.approx(-(24 * 0.03 / 7) / so - 0.125 / so, rel=1e-9)


def test_grpo_outcome_std_scale_untrained_prm_and_equal_outcomes():
    g = torch.Generator().manual_seed(1)
    B, T = 8, 50
    mask = right_mask([50, 40, 30, 20, 50, 45, 35, 25], T)
    noise = 1e-5 * torch.randn(B, T, generator=g)  # an untrained PRM: rewards of pure noise
    o = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # group 1: every outcome equal
    gid = torch.arange(B) // K
    proc = lambda **kw: F.prime_advantages(noise, o, mask, gid, estimator="grpo", outcome_coef=0.0, **kw)  # noqa: E731
    z = proc(grpo_process_scale="process_std", grpo_process_form="response")[:, 0]
    assert z[:4].abs().max() > 0.5 and z[:4].abs().max() <= samuelson(K)  # noise weighs as much as the outcome
    scaled = proc()  # the default: outcome_std
    assert scaled[:4].abs().max() < 1e-3  # noise stays noise
    assert torch.equal(scaled[4:], torch.zeros(4, T))  # equal outcomes: no scale, process term 0
    assert z[4:].abs().max() > 0.5  # the z-score form still uses it


def test_grpo_process_options_validated():
    P, mask, o, gid = torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    for form in ("response", "token"):
        for scale in ("process_std", "outcome_std"):
            adv = F.prime_advantages(
                P, o, mask, gid, estimator="grpo", grpo_process_form=form, grpo_process_scale=scale
            )
            close(adv, [[0.5 / (math.sqrt(0.5) + EPS)] * 3, [-0.5 / (math.sqrt(0.5) + EPS)] * 3])
    with pytest.raises(ValueError, match="grpo_process_form"):
        F.prime_advantages(P, o, mask, gid, estimator="grpo", grpo_process_form="sequence")
    with pytest.raises(ValueError, match="grpo_process_scale"):
        F.prime_advantages(P, o, mask, gid, estimator="grpo", grpo_process_scale="batch")
    with pytest.raises(ValueError, match="grpo_process_form"):
        F.prime_advantages(P, o, mask, gid, estimator="rloo", grpo_process_form="token")


def test_config_grpo_process_fields(tmp_path):
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    for cls in (PrimeGRPOConfig, PrimeRLOOConfig):
        c = cls(**plain)
        assert (c.grpo_process_form, c.grpo_process_scale) == ("token", "outcome_std")
        cls(**plain, grpo_process_form="token", grpo_process_scale="process_std")
        with pytest.raises(ValueError, match="grpo_process_form"):
            cls(**plain, grpo_process_form="sequence")
        with pytest.raises(ValueError, match="grpo_process_scale"):
            cls(**plain, grpo_process_scale="batch")


class _Scored(PrimeCallback):
    def __init__(self):
        self.events = []

    def on_rollouts_scored(self, args, state, control, **kw):
        self.events.append(kw)


def alternating_reward(completions, prompts, **kwargs):
    """1, 0, 1, 0 in every group: accuracy 0.5, kept by the online filter, outcome z-scores +-sqrt(3)/2."""
    return [float(i % 2 == 0) for i in range(len(prompts))]


def _prime_kwargs(tmp_path, **overrides):
    return tiny_kwargs(
        tmp_path, **{"max_completion_length": 16, "max_steps": 2, "prm_learning_rate": 1e-1, **overrides}
    )


def _train_prime(which, model, tmp_path, reward):
    """Trains a tiny PRIME trainer of kind ``which`` (:func:`_prime_kwargs`, 8 prompts); returns it and its
    :class:`_Scored` recorder."""
    rec = _Scored()
    common = dict(model=model, reward_funcs=reward, train_dataset=tiny_prompt_dataset(8), callbacks=[rec])
    tr = tiny_trainer(which, _prime_kwargs(tmp_path), **common)
    tr.train()
    return tr, rec


def test_default_prime_grpo_trainer_advantages_are_bounded(tiny_model_path, tmp_path):
    """A default PrimeGRPOConfig run (tiny model): at step 2 the PRM has moved (token rewards != 0); every advantage
    at the first token is bounded by the two z-score bounds, 2 (K-1)/sqrt(K), and equals the functional's default
    (response-level) form; the printed form on the same rewards exceeds that bound."""
    tr, rec = _train_prime("prime_grpo", tiny_model_path, tmp_path, alternating_reward)
    ev = rec.events[-1]
    adv, mask = ev["global_advantages"], ev["advantage_inputs"]["mask"].bool()
    assert ev["token_rewards"].abs().max() > 1e-4  # the PRM has moved away from its reference
    bound = 2 * samuelson(K)
    assert adv[:, 0].abs().max().item() <= bound + 1e-5
    assert adv[mask].abs().max().item() < 2 * bound
    inputs = dict(ev["advantage_inputs"])
    close(adv, F.prime_advantages(**inputs), atol=1e-6, rtol=1e-5)
    inputs.update(grpo_process_form="token", grpo_process_scale="process_std")
    assert F.prime_advantages(**inputs)[:, 0].abs().max().item() > bound


# ----------------------------------------------------------------------------------------------------------------
# 2. a group with a single scorable row: no baseline, advantage 0
# ----------------------------------------------------------------------------------------------------------------
def test_grpo_advantages_single_row_group_is_zero():
    r = torch.tensor([1.0, NAN, NAN, 0.5, 0.0, 1.0, 3.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2])  # group 0: one scorable row; group 2: a group of one
    d = 0.5 + EPS  # group 1: mean 0.5, std 0.5
    close(F.grpo_advantages(r, gid), [0.0, 0.0, 0.0, 0.0, -0.5 / d, 0.5 / d, 0.0])
    close(F.grpo_advantages(r, gid, scale_rewards=False), [0.0, 0.0, 0.0, 0.0, -0.5, 0.5, 0.0])
    # the released code's rule (mean 0, std 1) behind the compat option
    close(
        F.grpo_advantages(r, gid, single_row_compat=True),
        [1.0 / (1 + EPS), 0.0, 0.0, 0.0, -0.5 / d, 0.5 / d, 3.0 / (1 + EPS)],
    )
    close(F.grpo_advantages(r, gid, scale_rewards=False, single_row_compat=True), [1.0, 0.0, 0.0, 0.0, -0.5, 0.5, 3.0])
    assert F.single_row_group_mask(r, gid).tolist() == [True, False, False, False, False, False, True]
    assert F.single_row_group_mask(torch.tensor([1.0, NAN, 0.0, 1.0]), num_generations=2).tolist() == [
        True,
        False,
        False,
        False,
    ]


def test_prime_estimators_single_row_group():
    """Group 0 keeps one scorable row (others NaN): 0 with "grpo" (was its raw rewards) and "rloo"; "reinforce" has no
    baseline for any group and keeps its returns. Group 1 is computed as if group 0 were absent."""
    P = torch.tensor([[0.2, 0.3], [0.1, 0.0], [0.4, 0.5], [1.0, 1.0], [3.0, 0.0], [2.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 0], [1, 1]])
    o = torch.tensor([1.0, NAN, NAN, 1.0, 0.0, 0.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    for est in ("grpo", "rloo"):
        adv = F.prime_advantages(P, o, mask, gid, estimator=est)
        assert torch.equal(adv[:3], torch.zeros(3, 2)), est
        close(adv[3:], F.prime_advantages(P[3:], o[3:], mask[3:], gid[3:], estimator=est))
    adv = F.prime_advantages(P, o, mask, gid, estimator="reinforce")
    close(adv[0], [0.5 + 1.0, 0.3 + 1.0])
    assert torch.equal(adv[1:3], torch.zeros(2, 2))


def test_prl_advantages_single_row_group():
    """advantage_first: the lone row's outcome advantage is 0, its weights the KL-to-go alone (-S_t / eta), as in a
    group with equal outcomes; process_first (no baseline, the released rollout_n == 1 path) keeps the raw outcome."""
    old = torch.tensor([[0.0, 1.0, 0.5], [0.2, 0.1, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ref = torch.zeros(4, 3)
    mask = torch.ones(4, 3)
    o = torch.tensor([1.0, NAN, 1.0, 0.0])
    gid = torch.tensor([0, 0, 1, 1])  # S of row 0: [1.5, 1.5, 0.5]
    adv = F.prl_advantages(o, old, ref, mask, gid, eta=1.0)
    close(adv[0], [-1.5, -1.5, -0.5])
    close(adv[2:], [[0.5 / (math.sqrt(0.5) + EPS)] * 3, [-0.5 / (math.sqrt(0.5) + EPS)] * 3])
    close(
        F.prl_advantages(o, old, ref, mask, gid, eta=1.0, single_row_compat=True)[0],
        [1 / (1 + EPS) - 1.5, 1 / (1 + EPS) - 1.5, 1 / (1 + EPS) - 0.5],
    )
    close(F.prl_advantages(o, old, ref, mask, gid, eta=1.0, order="process_first")[0], [-0.5, -0.5, 0.5])


def test_prof_num_keep_one_is_refused(tmp_path):
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match="prof_num_keep`=1.*prof_num_keep >= 2"):
        ProfGRPOConfig(**plain, prof_num_keep=1)
    with pytest.raises(ValueError, match="prof_num_remove`=7.*prof_num_remove <= 6"):
        ProfGRPOConfig(**plain, prof_num_remove=7)
    with pytest.raises(ValueError, match="num_generations`=3"):  # default m = 3 // 2 = 1
        ProfGRPOConfig(**plain, num_generations=3)
    with pytest.raises(ValueError, match="prof_num_keep`=1"):
        PrimeGRPOConfig(**plain, num_generations=8, prof_mode="both", prof_num_keep=1)
    with pytest.raises(ValueError, match="num_generations`=2"):
        PrimeRLOOConfig(**plain, num_generations=2, prof_mode="both")
    assert ProfGRPOConfig(**plain, prof_num_keep=2).prof_keep_count() == 2
    assert ProfGRPOConfig(**plain, num_generations=2, prof_num_keep=2).prof_keep_count() == 2
    PrimeRLOOConfig(**plain, num_generations=2)  # PROF off: no constraint


def lone_row_reward(completions, prompts, **kwargs):
    """Per generation batch of two groups of 4: group 0 has one scorable row (0.5, accuracy 0.5: kept by PRIME's
    filter), group 1 is 1, 0, 1, 0."""
    return [(0.5 if i % K == 0 else None) if (i // K) % 2 == 0 else float(i % 2 == 0) for i in range(len(prompts))]


def _logged(tr, key):
    return [h[key] for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]


@pytest.mark.parametrize("which", ["prime_grpo", "prime_rloo"], ids=["prime-grpo", "prime-rloo"])
def test_prime_trainers_single_row_group_zero_and_counted(tiny_model_path, tmp_path, which):
    tr, rec = _train_prime(which, tiny_model_path, tmp_path, lone_row_reward)
    for ev in rec.events:
        adv = ev["global_advantages"]
        assert torch.equal(adv[0], torch.zeros_like(adv[0]))
        assert adv[4:][ev["advantage_inputs"]["mask"][4:].bool()].abs().min() > 0
    assert _logged(tr, "guard/single_row_groups") == [1.0, 1.0]


def test_prl_trainer_single_row_group_zero_and_counted(tiny_model_path, tmp_path):
    def reward(completions, prompts, **kw):  # the lone row scores 1.0 (PRL has no prompt filter)
        return [1.0 if r == 0.5 else r for r in lone_row_reward(completions, prompts)]

    kw = _prime_kwargs(tmp_path, learning_rate=1e-2)
    del kw["prm_learning_rate"]
    args = PRLConfig(**kw, prl_eta=2.0, prl_step_split="token")
    rounds = []

    class Spy(PRLGRPOTrainer):
        def _algorithm_step(self, output, cap):
            out = super()._algorithm_step(output, cap)
            rounds.append(dict(self._prl_last))
            return out

    tr = Spy(model=tiny_model_path, reward_funcs=reward, args=args, train_dataset=tiny_prompt_dataset(8))
    tr.train()
    for rnd in rounds:
        inputs = {k: v for k, v in rnd.items() if k not in ("advantages", "process_slice")}
        o = inputs["outcome_rewards"]
        assert o[0].item() == 1.0 and torch.isnan(o[1:4]).all()
        other = F.prl_advantages(**dict(inputs, outcome_rewards=torch.where(torch.arange(8) == 0, 0.0, o)))
        close(rnd["advantages"][0], other[0])  # the lone row's outcome does not enter its weights
        S = F.discounted_cumsum(torch.where(inputs["mask"], inputs["old_logps"] - inputs["ref_logps"], 0.0), 1.0)
        close(rnd["advantages"][0], (-S[0] / 2.0) * inputs["mask"][0], atol=1e-5, rtol=1e-5)
    assert _logged(tr, "guard/single_row_groups") == [1.0, 1.0]


def test_prof_grpo_trainer_single_row_group_zero_and_counted(tiny_model_path, tmp_path):
    """PROF keeps 4 of 8; the first group has one scorable row, which PROF keeps alone: advantage 0, counted."""
    n = 8
    prm = build_tiny_step_prm(tmp_path / "prm")

    def reward(completions, prompts, **kw):
        return [(1.0 if i % n == 0 else None) if (i // n) % 2 == 0 else float(i % 2 == 0) for i in range(len(prompts))]

    rounds = []

    class Spy(ProfGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            rounds.append((out["advantages"].clone(), dict(self.prof_filter.last)))
            return out

    kw = _prime_kwargs(tmp_path, per_device_train_batch_size=16, num_generations=n)
    del kw["prm_learning_rate"]
    args = ProfGRPOConfig(**kw, prof_prm=prm)
    tr = Spy(
        model=tiny_model_path,
        reward_funcs=reward,
        args=args,
        train_dataset=tiny_prompt_dataset(8, conversational=True),
    )
    tr.train()
    for adv, last in rounds:
        kept = last["kept"]
        assert kept[:n].tolist() == [True] + [False] * (n - 1) and int(kept[n:].sum()) == 4
        assert adv[0].item() == 0.0 and adv[n:][kept[n:]].abs().min() > 0
    assert _logged(tr, "guard/single_row_groups") == [1.0, 1.0]


def test_grpo_outcome_std_outcomes_equal_up_to_rounding_have_no_scale():
    """A weighted sum of two rewards in float32 (0 + 0.7 and 0.1 + 0.6) leaves outcomes that differ by rounding
    (std ~3e-8): they count as equal, process term 0, not token rewards divided by ~1e-7 (max |A| was 572)."""
    g = torch.Generator().manual_seed(4)
    o = torch.tensor([0.0, 0.1, 0.0, 0.1]) + torch.tensor([0.7, 0.6, 0.7, 0.6])
    assert o.std().item() > 0  # not exactly equal
    P = 1e-3 * torch.randn(4, 6, generator=g)
    adv = F.prime_advantages(P, o, torch.ones(4, 6), None, estimator="grpo", num_generations=4, outcome_coef=0.0)
    assert torch.equal(adv, torch.zeros(4, 6))
    # a real spread on a large reward scale still scales: rewards of a reward model around 50, std 1
    o2 = torch.tensor([49.0, 51.0, 49.0, 51.0])
    adv2 = F.prime_advantages(P, o2, torch.ones(4, 6), None, estimator="grpo", num_generations=4, outcome_coef=0.0)
    close(adv2[:, 0], 6 * (P.mean(1) - P.mean()) / (o2.std() + EPS), atol=1e-7, rtol=1e-5)  # L = 6 tokens
