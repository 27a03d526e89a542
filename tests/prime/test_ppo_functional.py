"""PPO's pure functions (PRIME Table 4, section 5.4): GAE, PPO token rewards, the implicit PRM as value, the clipped
value loss and explained variance -- on hand-computed values and against a plain per-row loop."""

from __future__ import annotations

import math

import pytest
import torch

import trl_prime.functional as F


def _t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def _gae_loop(rewards, values, mask, gamma, lam):
    """Textbook GAE per row over the mask positions (Schulman et al. 2016, Eq. 16), V after the last = 0."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.size(0)):
        pos = [t for t in range(rewards.size(1)) if mask[b, t]]
        last = 0.0
        for i in reversed(range(len(pos))):
            t = pos[i]
            v_next = values[b, pos[i + 1]] if i + 1 < len(pos) else 0.0
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def test_gae_lam_one_is_return_minus_value():
    r, v, m = _t([[0.0, 0.0, 1.0]]), _t([[0.5, 0.6, 0.7]]), _t([[1, 1, 1]])
    adv, ret = F.gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, _t([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, _t([[1.0, 1.0, 1.0]]))


def test_gae_lam_zero_is_one_step_td_error():
    r, v, m = _t([[0.0, 0.0, 1.0]]), _t([[0.5, 0.6, 0.7]]), _t([[1, 1, 1]])
    adv, ret = F.gae_advantages(r, v, m, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, _t([[0.1, 0.1, 0.3]]))  # r_t + V_{t+1} - V_t, V after the end = 0
    torch.testing.assert_close(ret, _t([[0.6, 0.7, 1.0]]))


def test_gae_discounted_hand_values():
    r, v, m = _t([[0.0, 0.0, 1.0]]), _t([[0.5, 0.6, 0.7]]), _t([[1, 1, 1]])
    adv, _ = F.gae_advantages(r, v, m, gamma=0.5, lam=0.5)
    # delta = [0.3 - 0.5, 0.35 - 0.6, 1 - 0.7]; A_2 = 0.3, A_1 = -0.25 + 0.25 * 0.3, A_0 = -0.2 + 0.25 * A_1
    torch.testing.assert_close(adv, _t([[-0.24375, -0.175, 0.3]]))


def test_gae_padding_and_skipped_tokens():
    r = _t([[0.0, 2.0, 9.0], [0.0, 5.0, 1.0]])
    v = _t([[1.0, 1.0, 99.0], [0.5, 9.0, 0.7]])
    m = _t([[1, 1, 0], [1, 0, 1]])  # right padding; a tool-response token in the middle
    adv, ret = F.gae_advantages(r, v, m, gamma=1.0, lam=0.0)
    # row 0: delta = [0 + 1 - 1, 2 + 0 - 1]; row 1 skips position 1: delta = [0 + 0.7 - 0.5, 1 - 0.7]
    torch.testing.assert_close(adv, _t([[0.0, 1.0, 0.0], [0.2, 0.0, 0.3]]))
    torch.testing.assert_close(ret, _t([[1.0, 2.0, 0.0], [0.7, 0.0, 1.0]]))


def test_gae_matches_a_loop_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 300  # T > 256 crosses discounted_cumsum's block boundary
    r, v = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.rand(B, T, generator=g) < 0.8
    m[0] = False  # an empty row
    for gamma, lam in [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.9, 0.0), (1.0, 0.0)]:
        adv, ret = F.gae_advantages(r, v, m, gamma=gamma, lam=lam)
        ref = _gae_loop(r, v, m, gamma, lam)
        torch.testing.assert_close(adv, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ret, torch.where(m, ref + v, torch.zeros_like(v)), rtol=1e-9, atol=1e-9)


def _gae_batch_reversed_loop(rewards, values, mask, gamma, lam):
    """GAE as veRL's ``compute_gae_advantage_return`` describes it (restated from its description): one reversed loop
    over ``t`` on the whole batch at once. ``nextvalues`` and ``lastgaelam`` start at 0; at each ``t`` the candidate
    ``delta = r_t + gamma * nextvalues - V_t`` and ``lastgaelam_new = delta + gamma * lam * lastgaelam`` are kept
    only where the mask is 1: a masked-out position keeps the carried value and ``lastgaelam``
    (``x = x_new * mask + (1 - mask) * x``). Returns ``(advantages, returns = advantages + values)``, unwhitened,
    meaningful on the mask only."""
    m = mask.to(rewards.dtype)
    nextvalues = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    lastgaelam = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    out = []
    for t in reversed(range(rewards.size(1))):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_new = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_new * m[:, t] + (1 - m[:, t]) * lastgaelam
        out.append(lastgaelam)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values


@pytest.mark.parametrize("T", [12, 300])  # 300 > 256: discounted_cumsum's block boundary
def test_gae_matches_verl_batch_loop_with_holes_in_the_mask(T):
    g = torch.Generator().manual_seed(T)
    B = 7
    r, v = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    m = torch.arange(T)[None, :] < lengths[:, None]  # right padding
    m &= torch.rand(B, T, generator=g) < 0.7  # holes: tool-response tokens inside the completion
    m[1] = False  # an empty row
    m[2] = True  # a full row
    assert bool((m[:, :-1] & ~m[:, 1:]).any()) and bool((~m[:, :-1] & m[:, 1:]).any())  # holes and padding present
    for gamma, lam in [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.9, 0.0)]:
        adv, ret = F.gae_advantages(r, v, m, gamma=gamma, lam=lam)
        adv_ref, ret_ref = _gae_batch_reversed_loop(r, v, m, gamma, lam)
        zero = torch.zeros_like(v)
        torch.testing.assert_close(adv, torch.where(m, adv_ref, zero), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ret, torch.where(m, ret_ref, zero), rtol=1e-9, atol=1e-9)
        assert bool((adv[~m] == 0).all()) and bool((ret[~m] == 0).all())
        assert float(adv[m].abs().max()) > 0.1  # not all zero


def test_gae_nan_rows_excluded_and_whitening():
    r = _t([[0.0, 1.0], [0.0, 3.0], [float("nan"), float("nan")]])
    v = _t([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    m = _t([[1, 1], [1, 1], [1, 1]])
    adv, ret = F.gae_advantages(r, v, m)
    torch.testing.assert_close(adv, _t([[1.0, 1.0], [3.0, 3.0], [0.0, 0.0]]))
    torch.testing.assert_close(ret, _t([[1.0, 1.0], [3.0, 3.0], [0.0, 0.0]]))
    white, ret_w = F.gae_advantages(r, v, m, whiten=True)
    torch.testing.assert_close(ret_w, ret)  # returns are never whitened
    # mean 2, unbiased std over the 4 valid tokens = sqrt(4/3): (1 - 2) / sqrt(4/3)
    x = 1.0 / math.sqrt(4.0 / 3.0)
    torch.testing.assert_close(white, _t([[-x, -x], [x, x], [0.0, 0.0]]), rtol=1e-6, atol=1e-6)


def test_gae_rejects_bad_arguments():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="lam"):
        F.gae_advantages(r, r, m, lam=1.5)
    with pytest.raises(ValueError, match="gamma"):
        F.gae_advantages(r, r, m, gamma=-0.1)
    with pytest.raises(ValueError, match="same shape"):
        F.gae_advantages(r, torch.zeros(2, 4), m)


def test_ppo_token_rewards():
    p = _t([[0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [1.0, 1.0, 1.0]])
    o = _t([1.0, 0.0, float("nan")])
    m = _t([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    out = F.ppo_token_rewards(p, o, m, process_coef=0.5, outcome_coef=2.0)
    torch.testing.assert_close(out[:2], _t([[0.05, 0.1, 2.15], [0.05, 0.1, 0.0]]))
    assert torch.isnan(out[2]).all()  # an unscorable row: excluded by gae_advantages
    plain = F.ppo_token_rewards(p, o, m, process_coef=0.0)
    torch.testing.assert_close(plain[:2], _t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))


def test_implicit_prm_values_and_prm_as_value_advantages():
    p = _t([[0.1, 0.2, 0.3], [0.5, 0.0, 0.25]])
    m = _t([[1, 1, 1], [1, 0, 1]])
    v = F.implicit_prm_values(p, m)
    torch.testing.assert_close(v, _t([[0.0, 0.1, 0.3], [0.0, 0.0, 0.5]]))  # V(y_<t) = sum_{s<t} r_s
    o = _t([1.0, 0.0])
    rewards = F.ppo_token_rewards(p, o, m, process_coef=0.0)  # the outcome only
    adv, _ = F.gae_advantages(rewards, v, m, gamma=1.0, lam=1.0)
    # gamma = lam = 1: A_t = r_o - sum_{s<t} r_phi(y_s)
    torch.testing.assert_close(adv, _t([[1.0, 0.9, 0.7], [0.0, 0.0, -0.5]]))
    via = F.prime_advantages(p, o, m, None, estimator="ppo", values=v, process_coef=0.0)
    torch.testing.assert_close(via, adv)


def test_prime_advantages_ppo_needs_values_and_rejects_group_options():
    p, o, m = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs `values`"):
        F.prime_advantages(p, o, m, None, estimator="ppo")
    with pytest.raises(ValueError, match="baseline"):
        F.prime_advantages(p, o, m, None, estimator="ppo", values=p, baseline="paper")
    assert "ppo" in F.ESTIMATORS and F.PRIME_VALUES == ("critic", "implicit_prm")


def test_clipped_value_loss_hand_values_and_gradient():
    values = _t([[1.0, 2.0]]).requires_grad_()
    old, ret, m = _t([[0.5, 2.0]]), _t([[2.0, 1.0]]), _t([[1, 1]])
    loss, clipfrac = F.clipped_value_loss(values, old, ret, m, cliprange_value=0.2)
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69 (clipped); token 1: (2-1)^2 = 1 both ways
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    # the clipped term is constant in V at token 0; token 1: d/dV 0.5 (V-R)^2 / 2 = (2-1)/2
    torch.testing.assert_close(values.grad, _t([[0.0, 0.5]]))
    same, frac = F.clipped_value_loss(old, old, ret, m, normalizer=4.0)
    assert same.item() == pytest.approx(0.5 * (2.25 + 1.0) / 4) and frac.item() == 0.0
    with pytest.raises(ValueError, match="cliprange_value"):
        F.clipped_value_loss(old, old, ret, m, cliprange_value=-1.0)


def test_explained_variance():
    r, m = _t([[1.0, 2.0, 3.0, 100.0]]), _t([[1, 1, 1, 0]])
    assert F.explained_variance(r, r, m).item() == pytest.approx(1.0)
    assert F.explained_variance(torch.full_like(r, 2.0), r, m).item() == pytest.approx(0.0)
    assert F.explained_variance(-r, r, m).item() == pytest.approx(1.0 - 4.0)  # Var(R - V) = Var(2R) = 4 Var(R)
    assert math.isnan(F.explained_variance(r, r, _t([[1, 0, 0, 0]])).item())
