"""Unit tests of ``trl_prime.functional``: worked examples, invariants, hand-computed cases, validation."""

from __future__ import annotations

import math

import pytest
import torch

from trl_prime import functional as F


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def close(a, b, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=rtol
    )


def right_mask(lengths, T):
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


# ---------------------------------------------------------------------------------------------------------
# implicit token rewards (PRIME Eq. 3)
# ---------------------------------------------------------------------------------------------------------


def test_seed000_worked_example():
    prm = torch.log(torch.tensor([[0.80, 0.20]]))
    ref = torch.log(torch.tensor([[0.40, 0.80]]))
    r = F.implicit_token_rewards(prm, ref, torch.ones(1, 2))  # default beta = 0.05
    assert round(r[0, 0].item(), 4) == 0.0347
    assert round(r[0, 1].item(), 4) == -0.0693
    close(r, [[0.05 * math.log(2.0), 0.05 * math.log(0.25)]])


def test_implicit_rewards_exactly_zero_when_prm_equals_ref():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 9, generator=g) * 5
    mask = right_mask([9, 3, 1, 0], 9)
    for beta in (0.05, 1.0, 7.3):
        r = F.implicit_token_rewards(lp, lp.clone(), mask, beta=beta)
        assert torch.equal(r, torch.zeros_like(r))
        r = F.implicit_token_rewards(lp, lp.clone(), mask, beta=beta, include_last_token=False)
        assert torch.equal(r, torch.zeros_like(r))


def test_implicit_rewards_mask_last_token_and_without_reference():
    prm = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    ref = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    close(F.implicit_token_rewards(prm, ref, mask, beta=0.5), [[0.5, 0.5, 0.0], [1.5, 2.0, 2.5]])
    close(F.implicit_token_rewards(prm, ref, mask, beta=0.5, include_last_token=False), [[0.5, 0, 0], [1.5, 2.0, 0]])
    close(F.implicit_token_rewards(prm, None, mask, beta=0.5), [[0.5, 1.0, 0.0], [2.0, 2.5, 3.0]])


# ---------------------------------------------------------------------------------------------------------
# log-probs
# ---------------------------------------------------------------------------------------------------------


def test_token_logps_matches_log_softmax_and_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    got = F.token_logps(logits, ids, chunk_size=3)
    want = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    close(got, want)
    (gg,) = torch.autograd.grad(got.sum(), logits)
    (gw,) = torch.autograd.grad(want.sum(), logits)
    close(gg, gw)
    bf = F.token_logps(logits.detach().to(torch.bfloat16), ids)
    assert bf.dtype == torch.bfloat16
    close(bf.float(), want.detach(), atol=5e-2, rtol=2e-2)


def test_sequence_logps_hand_case():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 7, generator=g)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    am = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    prompt_lengths = torch.tensor([2, 3])
    s, mean = F.sequence_logps(logits, ids, am, prompt_lengths)
    ls = torch.log_softmax(logits, -1)
    want0 = sum(ls[0, t - 1, ids[0, t]].item() for t in (2, 3, 4))
    want1 = ls[1, 2, ids[1, 3]].item()  # t=3 only: t=4 is padding
    close(s, [want0, want1])
    close(mean, [want0 / 3, want1])


# ---------------------------------------------------------------------------------------------------------
# implicit PRM losses
# ---------------------------------------------------------------------------------------------------------


def _loss_inputs():
    # beta * (prm - ref) summed per row: r = [1, -2, 0.5, 0.25] with beta = 0.05
    prm = torch.tensor([[10.0, 10.0, 99.0], [-40.0, 0.0, 0.0], [4.0, 6.0, 0.0], [5.0, 0.0, 0.0]])
    ref = torch.zeros(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    return prm, ref, mask, [1.0, -2.0, 0.5, 0.25]


def test_ce_loss_hand_and_fractional_labels():
    prm, ref, mask, r = _loss_inputs()
    labels = torch.tensor([1.0, 0.25, 0.0, 1.0])
    loss = F.implicit_prm_loss(prm, ref, mask, labels)
    rows = [-(y * logsig(x) + (1 - y) * logsig(-x)) for x, y in zip(r, labels.tolist())]
    close(loss, sum(rows) / 4)
    # matches torch BCE (log clamped at -100) including a saturated row
    big = torch.tensor([[3000.0], [-3000.0], [1.0]])
    lab = torch.tensor([0.0, 1.0, 0.5])
    got = F.implicit_prm_loss(big, torch.zeros_like(big), torch.ones_like(big), lab, beta=1.0)
    want = torch.nn.functional.binary_cross_entropy(torch.sigmoid(big.squeeze(-1)), lab)
    close(got, want)


def test_ce_loss_nan_label_has_weight_zero():
    prm, ref, mask, _ = _loss_inputs()
    labels = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    got = F.implicit_prm_loss(prm, ref, mask, labels)
    keep = torch.tensor([0, 2, 3])
    want = F.implicit_prm_loss(prm[keep], ref[keep], mask[keep], labels[keep])
    close(got, want)
    assert torch.isfinite(got)


def test_dpo_nca_kto_hand():
    prm, ref, mask, r = _loss_inputs()
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    # pairs inside groups only: (0 > 1) and (3 > 2)
    dpo = F.implicit_prm_loss(prm, ref, mask, labels, loss_type="dpo", group_ids=groups)
    close(dpo, (-logsig(r[0] - r[1]) - logsig(r[3] - r[2])) / 2)
    nca = F.implicit_prm_loss(prm, ref, mask, labels, loss_type="nca", group_ids=groups)
    n1 = -logsig(r[0]) - 0.5 * logsig(-r[0]) - 0.5 * logsig(-r[1])
    n2 = -logsig(r[3]) - 0.5 * logsig(-r[3]) - 0.5 * logsig(-r[2])
    close(nca, (n1 + n2) / 2)
    # without group ids every correct row pairs with every incorrect row of the batch
    dpo_all = F.implicit_prm_loss(prm, ref, mask, labels, loss_type="dpo")
    pairs = [(0, 1), (0, 2), (3, 1), (3, 2)]
    close(dpo_all, sum(-logsig(r[a] - r[b]) for a, b in pairs) / 4)
    kto = F.implicit_prm_loss(prm, ref, mask, labels, loss_type="kto")
    z_neg = max(0.0, (r[1] + r[2]) / 2)  # = 0
    z_pos = max(0.0, (r[0] + r[3]) / 2)  # = 0.625
    terms = [1 - sig(r[0] - z_neg), 1 - sig(r[3] - z_neg), 1 - sig(z_pos - r[1]), 1 - sig(z_pos - r[2])]
    close(kto, sum(terms) / 4)


@pytest.mark.parametrize("loss_type", ["ce", "dpo", "kto", "nca"])
def test_prm_loss_gradient_flows_into_prm_logps(loss_type):
    g = torch.Generator().manual_seed(3)
    prm = (-torch.rand(4, 6, generator=g) * 3).requires_grad_(True)
    ref = -torch.rand(4, 6, generator=g) * 3
    mask = right_mask([6, 4, 5, 2], 6)
    loss = F.implicit_prm_loss(
        prm, ref, mask, torch.tensor([1.0, 0.0, 0.0, 1.0]), loss_type=loss_type, group_ids=torch.tensor([0, 0, 1, 1])
    )
    loss.backward()
    assert prm.grad is not None and torch.isfinite(prm.grad).all()
    assert (prm.grad[mask] != 0).all()
    assert (prm.grad[~mask] == 0).all()
    assert ref.grad is None


# ---------------------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------------------


def test_step_rewards_and_aggregation_hand():
    tok = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]], requires_grad=True
    )
    ends = torch.tensor([[0, 1, 0, 0, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]).bool()
    vals, smask = F.step_rewards(tok, ends)
    close(vals, [[3.0, 12.0], [3.0, 0.0], [0.0, 0.0]])
    assert smask.tolist() == [[True, True], [True, False], [False, False]]
    q, _ = F.step_rewards(tok, ends, cumulative=True)
    close(torch.where(smask, q, torch.zeros_like(q)), [[3.0, 15.0], [3.0, 0.0], [0.0, 0.0]])
    vals.sum().backward()
    close(tok.grad, [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    close(F.aggregate_step_rewards(vals, smask, how="min"), [3.0, 3.0, 0.0])
    close(F.aggregate_step_rewards(vals, smask, how="mean"), [7.5, 3.0, 0.0])
    close(F.aggregate_step_rewards(vals, smask, how="sum"), [15.0, 3.0, 0.0])
    close(F.aggregate_step_rewards(vals, smask, how="last"), [12.0, 3.0, 0.0])
    assert F.aggregate_step_rewards(vals, smask).tolist() == [3.0, 3.0, 0.0]  # default: min


def test_split_and_join_steps():
    assert F.split_steps("  a\n\nb \n\n\n\n c  ") == ["a", "b", "c"]
    assert F.split_steps("one\nline") == ["one\nline"]
    assert F.split_steps("\n\n  \n\n") == [""]
    assert F.split_steps("x;y", delimiter=";") == ["x", "y"]
    assert F.join_steps(["a", "b"]) == "a<extra_0>b<extra_0>"


class PieceTokenizer:
    def __init__(self, pieces):
        self.pieces = pieces

    def batch_decode(self, seqs):
        return ["".join(self.pieces[i] for i in s) for s in seqs]


def test_step_end_mask_text_splits_on_two_tokenizer_styles():
    # Qwen-style: ".\n\n" merged into one token, "\n\n" a token of its own; pad id = the "\n\n" token
    qwen = PieceTokenizer({0: "Step 1", 1: ".\n\n", 2: "Step 2", 3: "\n\n", 4: "done"})
    ids = torch.tensor([[0, 1, 2, 3, 4, 3, 3]])
    mask = right_mask([5], 7)
    ends = F.step_end_mask(ids, mask, qwen)
    assert ends[0].tolist() == [False, True, False, True, True, False, False]
    # Llama-style: BOS, byte-fallback newlines "\n" "\n" as two tokens
    llama = PieceTokenizer({1: "<s>", 10: "First", 11: "Second", 12: "end", 13: "\n"})
    ids = torch.tensor([[1, 10, 13, 13, 11, 13, 12]])
    mask = torch.ones(1, 7)
    assert F.step_end_mask(ids, mask, llama)[0].tolist() == [False, False, False, True, False, False, True]
    # "\n" "\n" is a run of two newline delimiters: one step end at the run's last delimiter (split_steps'
    # steps "First", "Second", "end"; the lone "\n" between them is not a step)
    assert F.step_end_mask(ids, mask, llama, split="newline")[0].tolist() == [
        False,
        False,
        False,
        True,
        False,
        True,
        True,
    ]
    # a triple newline holds one delimiter (non-overlapping, like str.split)
    tri = PieceTokenizer({0: "A", 1: "\n\n\n", 2: "B"})
    assert F.step_end_mask(torch.tensor([[0, 1, 2]]), torch.ones(1, 3), tri)[0].tolist() == [False, True, True]


def test_step_end_mask_length_and_token():
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = right_mask([7, 4], 7)
    ends = F.step_end_mask(ids, mask, split="length", step_len=3)
    assert ends.tolist() == [
        [False, False, True, False, False, True, True],
        [False, False, True, True, False, False, False],
    ]
    assert torch.equal(F.step_end_mask(ids, mask, split="token"), mask)


# ---------------------------------------------------------------------------------------------------------
# generic helpers
# ---------------------------------------------------------------------------------------------------------


def test_masked_whiten_zero_mean_unit_variance():
    g = torch.Generator().manual_seed(4)
    v = torch.randn(5, 8, generator=g) * 3 + 2
    mask = right_mask([8, 5, 3, 1, 6], 8)
    w = F.masked_whiten(v, mask)
    close(w[mask].mean(), 0.0, atol=1e-6)
    close(w[mask].var(unbiased=True), 1.0, atol=1e-6)
    w2 = F.masked_whiten(v, mask, shift_mean=False)
    close(w2 - w, torch.full_like(w, v[mask].mean().item()), atol=1e-5, rtol=1e-5)  # mean added back
    close(F.masked_mean(v, mask), v[mask].mean())


def test_discounted_cumsum_against_loop():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 600, generator=g, dtype=torch.float64)
    for gamma in (1.0, 0.95, 0.5, 0.0):
        want = torch.zeros_like(x)
        run = torch.zeros(3, dtype=torch.float64)
        for t in reversed(range(600)):
            run = x[:, t] + gamma * run
            want[:, t] = run
        close(F.discounted_cumsum(x, gamma), want, atol=1e-9, rtol=1e-9)


def test_batch_norm_hand():
    x = torch.tensor([[1.0, -3.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # reverse cumsum of [1, -3, 1, 0] = [-1, -2, 1, 0] -> max |.| = 2
    close(F.process_reward_batch_norm(x, mask), [[1 / (2 + 1e-6), -3 / (2 + 1e-6), 1 / (2 + 1e-6), 0.0]])


def test_fills_and_last_token_mask():
    values = torch.tensor([[1.0, 0.0, 3.0, 4.0]])
    ends = torch.tensor([[False, True, False, True]])
    close(F.fill_from_step_end(values, ends), [[0.0, 0.0, 4.0, 4.0]])  # the 0 at the first step end survives
    close(F.left_fill_by_next_nonzero(values * ends), [[4.0, 4.0, 4.0, 4.0]])  # released fill loses it
    close(F.left_fill_by_next_nonzero(torch.tensor([[0.0, 2.0, 0.0, 5.0, 0.0]])), [[2.0, 2.0, 5.0, 5.0, 0.0]])
    m = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert F.last_token_mask(m).tolist() == [[False, False, True, False], [False] * 4, [False, False, False, True]]


# ---------------------------------------------------------------------------------------------------------
# RLOO / PRIME advantages (PRIME Eq. 5, Appendix B.3)
# ---------------------------------------------------------------------------------------------------------

P2 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])  # junk in row 1's padding must be ignored
M2 = torch.tensor([[1, 1, 1], [1, 0, 0]])
O2 = torch.tensor([1.0, 0.0])


def test_rloo_paper_hand():
    # rbar = [2, 4]; baselines b0 = 4, b1 = 2; outcome LOO = [1, -1]
    adv, ret = F.rloo_advantages(P2, O2, M2, 2)
    close(ret, [[-6 + 1, -3 + 1, -1 + 1], [2 - 1, 0, 0]])
    close(adv, ret)
    _, ret = F.rloo_advantages(P2, O2, M2, 2, gamma=0.5)  # process tokens [-3, -2, -1]
    close(ret, [[-4.25 + 1, -2.5 + 1, -1 + 1], [1.0, 0, 0]])
    _, ret = F.rloo_advantages(P2, O2, M2, 2, gamma=0.5, outcome_gamma=0.5)
    close(ret, [[-4.25 + 0.25, -2.5 + 0.5, -1 + 1], [1.0, 0, 0]])
    _, ret = F.rloo_advantages(P2, O2, M2, 2, process_coef=2.0, outcome_coef=3.0)
    close(ret, [[-12 + 3, -6 + 3, -2 + 3], [4 - 3, 0, 0]])


def test_rloo_reference_hand():
    # x*K/(K-1) - S/(K-1) with K=2, S = 2 + 4: tokens row0 [-4, -2, 0], row1 [2]; outcome [2-1, 0-1]
    adv, ret = F.rloo_advantages(P2, O2, M2, 2, baseline="reference")
    close(ret, [[-6 + 1, -2 + 1, 0 + 1], [2 - 1, 0, 0]])
    _, ret = F.rloo_advantages(P2, O2, M2, 2, baseline="reference", include_last_token=False)
    # last tokens zeroed (rbar over the unchanged mask): P = [[1,2,0],[0]] -> rbar [1, 0], S = 1
    close(ret, [[(2 - 1) + (4 - 1) + (0 - 1) + 1, (4 - 1) + (0 - 1) + 1, (0 - 1) + 1], [(0 - 1) - 1, 0, 0]])


def test_rloo_three_way_leave_one_out():
    P = torch.zeros(3, 2)
    _, ret = F.rloo_advantages(P, torch.tensor([1.0, 0.0, 0.0]), torch.ones(3, 2), 3)
    close(ret, [[1.0, 1.0], [-0.5, -0.5], [-0.5, -0.5]])


def test_rloo_invariant_return_at_t0_is_the_loo_difference():
    g = torch.Generator().manual_seed(6)
    B, K, T = 8, 4, 7
    P = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [7, 3, 5, 1, 6, 7, 2, 4]
    mask = right_mask(lengths, T)
    o = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    L = torch.tensor(lengths, dtype=torch.float64)
    Pm = P * mask
    rbar = Pm.sum(1) / L
    loo_r = torch.stack([(rbar[(i // K) * K : (i // K + 1) * K].sum() - rbar[i]) / (K - 1) for i in range(B)])
    loo_o = torch.stack([(o[(i // K) * K : (i // K + 1) * K].sum() - o[i]) / (K - 1) for i in range(B)])
    _, ret_p = F.rloo_advantages(P, o, mask, K, outcome_coef=0.0)
    close(ret_p[:, 0], Pm.sum(1) - L * loo_r, atol=1e-12)
    _, ret_o = F.rloo_advantages(P, o, mask, K, process_coef=0.0)
    close(ret_o[:, 0], o - loo_o, atol=1e-12)
    close(ret_o * mask, (o - loo_o)[:, None] * mask, atol=1e-12)  # gamma=1: the same at every token
    # the released per-token form has the same per-completion sums
    _, ret_ref = F.rloo_advantages(P, o, mask, K, baseline="reference")
    _, ret_pap = F.rloo_advantages(P, o, mask, K)
    close(ret_ref[:, 0], ret_pap[:, 0], atol=1e-12)
    assert not torch.allclose(ret_ref[mask], ret_pap[mask])


def test_rloo_whiten_and_batch_norm_options():
    g = torch.Generator().manual_seed(7)
    P = torch.randn(4, 5, generator=g)
    mask = right_mask([5, 2, 4, 3], 5)
    o = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv, ret = F.rloo_advantages(P, o, mask, 2, whiten=True)
    close(adv[mask], F.masked_whiten(ret, mask)[mask])
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    _, ret_bn = F.rloo_advantages(P, o, mask, 2, process_reward_norm="batch_norm")
    _, ret_manual = F.rloo_advantages(F.process_reward_batch_norm(P, mask), o, mask, 2)
    close(ret_bn, ret_manual)


def test_rloo_nan_outcome_excluded_and_zero():
    g = torch.Generator().manual_seed(8)
    P = torch.randn(6, 4, generator=g)
    mask = right_mask([4, 3, 2, 4, 1, 3], 4)
    o = torch.tensor([1.0, 0.0, float("nan"), 0.0, 1.0, 1.0])
    adv, ret = F.rloo_advantages(P, o, mask, group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[2] == 0).all() and (ret[2] == 0).all()
    keep = torch.tensor([0, 1, 3, 4, 5])
    _, ret_sub = F.rloo_advantages(P[keep], o[keep], mask[keep], group_ids=torch.tensor([0, 0, 1, 1, 1]))
    close(ret[keep], ret_sub)
    # whitening statistics exclude the unscorable row too
    adv_w, ret_w = F.rloo_advantages(P, o, mask, group_ids=torch.tensor([0, 0, 0, 1, 1, 1]), whiten=True)
    adv_sub, _ = F.rloo_advantages(P[keep], o[keep], mask[keep], group_ids=torch.tensor([0, 0, 1, 1, 1]), whiten=True)
    close(adv_w[keep], adv_sub)
    assert (adv_w[2] == 0).all()
    # a group left with a single scorable row has no baseline: advantage 0
    o2 = torch.tensor([1.0, float("nan"), float("nan"), 0.0, 1.0, 1.0])
    adv2, _ = F.rloo_advantages(P, o2, mask, group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    assert (adv2[:3] == 0).all() and (adv2[3:][mask[3:]] != 0).any()


def test_grpo_advantages_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0])
    adv = F.grpo_advantages(r, torch.tensor([0, 0, 0, 0, 1]))
    s = math.sqrt(1.0 / 3.0)
    # a group of one has no baseline: advantage 0 (single_row_compat: the released mean 0, std 1)
    close(adv, [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0])
    close(F.grpo_advantages(r, torch.tensor([0, 0, 0, 0, 1]), scale_rewards=False), [0.5, -0.5, 0.5, -0.5, 0.0])
    close(F.grpo_advantages(r, torch.tensor([0, 0, 0, 0, 1]), single_row_compat=True)[4], 3.0 / (1 + 1e-6))
    # NaN excluded from mean/std, advantage 0
    rn = torch.tensor([1.0, 0.0, float("nan"), 1.0])
    adv = F.grpo_advantages(rn, num_generations=4)
    s = math.sqrt(1.0 / 3.0)
    close(adv, [(1 - 2 / 3) / (s + 1e-6), (0 - 2 / 3) / (s + 1e-6), 0.0, (1 - 2 / 3) / (s + 1e-6)])
    # all-equal group: zeros with finite gradients
    x = torch.ones(4, requires_grad=True)
    a = F.grpo_advantages(x, num_generations=4)
    a.sum().backward()
    assert (a == 0).all() and torch.isfinite(x.grad).all()


def test_prime_advantages_estimators_hand():
    P = torch.tensor([[1.0, 1.0], [3.0, 0.0], [2.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    o = torch.tensor([1.0, 0.0, 0.0])
    gid = torch.tensor([0, 0, 0])
    # reinforce: reverse cumsum of P + r_o at every token (gamma = 1)
    close(F.prime_advantages(P, o, mask, gid, estimator="reinforce"), [[3.0, 2.0], [3.0, 0.0], [4.0, 2.0]])
    # grpo: rbar = [1, 3, 2] -> mean 2, std 1; outcome mean 1/3, std sqrt(1/3)
    eps = 1e-6
    pt = lambda x: (x - 2.0) / (1.0 + eps)  # noqa: E731
    so = math.sqrt(1.0 / 3.0)
    oa = [(1 - 1 / 3) / (so + eps), (0 - 1 / 3) / (so + eps), (0 - 1 / 3) / (so + eps)]
    want = [[pt(1) + pt(1) + oa[0], pt(1) + oa[0]], [pt(3) + oa[1], 0.0], [pt(2) + pt(2) + oa[2], pt(2) + oa[2]]]
    close(
        F.prime_advantages(
            P, o, mask, gid, estimator="grpo", grpo_process_form="token", grpo_process_scale="process_std"
        ),
        want,
    )  # printed Eq. 8
    # rloo through prime_advantages = rloo_advantages
    adv, _ = F.rloo_advantages(P, o, mask, 3, baseline="reference", whiten=True)
    close(F.prime_advantages(P, o, mask, gid, baseline="reference", whiten=True), adv)
    close(F.prime_advantages(P, o, mask, None, num_generations=3), F.rloo_advantages(P, o, mask, 3)[0])


def test_group_ids_any_order_equals_contiguous():
    g = torch.Generator().manual_seed(9)
    B, T = 12, 6
    P = torch.randn(B, T, generator=g)
    old, ref = -torch.rand(B, T, generator=g), -torch.rand(B, T, generator=g)
    mask = right_mask([6, 2, 5, 3, 6, 1, 4, 6, 2, 3, 5, 6], T)
    o = torch.tensor([1.0, 0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 1])
    contiguous = torch.arange(B) // 4
    perm = torch.randperm(B, generator=g)
    labels = torch.tensor([17, 3, 8])  # arbitrary, non-contiguous integer ids
    shuffled = labels[contiguous[perm]]
    for est in ("rloo", "grpo", "reinforce"):
        a = F.prime_advantages(P, o, mask, None, estimator=est, num_generations=4, whiten=True)
        b = F.prime_advantages(P[perm], o[perm], mask[perm], shuffled, estimator=est, whiten=True)
        close(b, a[perm], atol=1e-5, rtol=1e-5)
    close(F.grpo_advantages(o[perm], shuffled), F.grpo_advantages(o, num_generations=4)[perm])
    a = F.prl_advantages(o, old, ref, mask, contiguous, eta=2.0)
    b = F.prl_advantages(o[perm], old[perm], ref[perm], mask[perm], [f"p{int(i)}" for i in shuffled], eta=2.0)
    close(b, a[perm])
    close(
        F.prm_pair_accuracy(P.sum(1)[perm], o[perm], group_ids=shuffled),
        F.prm_pair_accuracy(P.sum(1), o, group_ids=contiguous),
    )


# ---------------------------------------------------------------------------------------------------------
# PRIME filter and PRM metrics
# ---------------------------------------------------------------------------------------------------------


def test_prompt_accuracy_mask_hand():
    acc = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0])
    assert F.prompt_accuracy_mask(acc, 4).tolist() == [False] * 4 + [True] * 12
    assert F.prompt_accuracy_mask(acc, 4, lower=0.25, upper=0.75).tolist() == [False] * 4 + [True] * 12  # inclusive
    assert F.prompt_accuracy_mask(acc, 4, lower=0.3, upper=0.7).tolist() == [False] * 8 + [True] * 4 + [False] * 4
    lengths = torch.tensor([5] * 9 + [8] + [5] * 6)
    keep = F.prompt_accuracy_mask(acc, 4, completion_lengths=lengths, max_completion_length=8)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 4
    nan = torch.tensor([1.0, float("nan"), 0.0, 0.0, float("nan")] + [float("nan")] * 3)
    assert F.prompt_accuracy_mask(nan, 4).tolist() == [True] * 4 + [False] * 4  # mean over 3 scorable = 1/3


def test_prm_pair_and_abs_accuracy_hand():
    r = torch.tensor([3.0, 1.0, 2.0, 1.0, 2.0, 0.0, 5.0, 1.0, 1.0])
    o = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    # group 1: both weighted pairs ranked right -> 1; group 2: one right one wrong -> 0.5; group 3: equal -> 0.5
    assert F.prm_pair_accuracy(r, o, 3) == pytest.approx(2.0 / 3.0)
    # fractional outcomes weight by |do|; a score tie counts as "not greater"
    # pairs: (0,1) tie & o0<o1 -> right (w .7); (0,2) r0<r2 but o0>o2 -> wrong (.1); (1,2) wrong (.8)
    assert F.prm_pair_accuracy(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.2, 0.9, 0.1]), 3) == pytest.approx(
        0.7 / (0.7 + 0.1 + 0.8)
    )
    # ties="half": the tied pair (0,1) scores half its weight -> (0.35 + 0) / 1.6
    assert F.prm_pair_accuracy(
        torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.2, 0.9, 0.1]), 3, ties="half"
    ) == pytest.approx(0.35 / 1.6)
    # a PRM that ties everything reads exactly 0.5 whatever the row order (the default depends on it)
    zeros = torch.zeros(4)
    for o in ([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]):
        assert F.prm_pair_accuracy(zeros, torch.tensor(o), 4, ties="half") == 0.5
    assert F.prm_pair_accuracy(zeros, torch.tensor([1.0, 1.0, 0.0, 0.0]), 4) == 0.0
    assert F.prm_pair_accuracy(zeros, torch.tensor([0.0, 0.0, 1.0, 1.0]), 4) == 1.0
    with pytest.raises(ValueError, match="ties"):
        F.prm_pair_accuracy(zeros, zeros, 4, ties="zero")
    s = torch.tensor([0.5, -0.2, 0.0, 0.0, 3.0])
    assert F.prm_abs_accuracy(s, torch.tensor([1.0, 0.0, 0.5, 1.0, float("nan")])) == pytest.approx(0.75)


# ---------------------------------------------------------------------------------------------------------
# PRL
# ---------------------------------------------------------------------------------------------------------


def test_prl_exact_zero_step_end_survives():
    old = torch.tensor([[0.0, 1.0, 0.5, -0.5]])  # k = old - ref; S = [1, 1, 0, -0.5]
    ref = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    o = torch.tensor([1.0])
    ends = torch.tensor([[False, True, False, False]])  # + the last token
    kw = dict(eta=1.0, order="process_first", step_ends=ends)
    adv, at_ends = F.prl_advantages(o, old, ref, mask, None, return_step_end_values=True, **kw)
    close(at_ends, [[0.0, 0.0, 0.0, 1.5]])
    close(adv, [[0.0, 0.0, 1.5, 1.5]])  # rho at the first step end is exactly 0 and is kept
    close(F.prl_advantages(o, old, ref, mask, None, zero_fill_compat=True, **kw), [[1.5, 1.5, 1.5, 1.5]])
    dense = F.prl_advantages(o, old, ref, mask, None, eta=1.0, order="process_first")
    close(dense, [[0.0, 0.0, 1.0, 1.5]])
    close(F.prl_advantages(o, old, ref, mask, None, eta=2.0, order="process_first"), [[0.5, 0.5, 1.0, 1.25]])


def test_prl_advantage_first_hand_and_large_eta_is_grpo():
    g = torch.Generator().manual_seed(10)
    old = (-torch.rand(4, 5, generator=g)).requires_grad_(True)
    ref = -torch.rand(4, 5, generator=g)
    mask = right_mask([5, 3, 4, 2], 5)
    o = torch.tensor([1.0, 0.0, 0.0, 0.0])
    gid = torch.tensor([0, 0, 1, 1])
    adv = F.prl_advantages(o, old, ref, mask, gid, eta=1e12)
    assert not adv.requires_grad  # detached weights
    close(adv, F.grpo_advantages(o, gid)[:, None] * mask, atol=1e-6)
    close(F.prl_advantages(o, old.detach(), old.detach(), mask, gid)[0, 0], 0.5 / (math.sqrt(0.5) + 1e-6))
    # S_t / eta subtracted token by token
    k = (old - ref).detach() * mask
    S = k.flip(-1).cumsum(-1).flip(-1)
    close(F.prl_advantages(o, old, ref, mask, gid, eta=3.0), (F.grpo_advantages(o, gid)[:, None] - S / 3.0) * mask)
    no_scale = F.prl_advantages(o, old, ref, mask, gid, eta=3.0, scale_rewards=False)
    close(no_scale, (torch.tensor([0.5, -0.5, 0.0, 0.0])[:, None] - S / 3.0) * mask)
    # NaN outcome: row gets 0, excluded from its group's statistics
    on = torch.tensor([1.0, float("nan"), 1.0, 0.0])
    a = F.prl_advantages(on, old, ref, mask, gid, eta=3.0)
    assert (a[1] == 0).all() and torch.isfinite(a).all()
    close(a[0], (0.0 - S[0] / 3.0) * mask[0])  # a single scorable row: no baseline, A = 0 (KL-to-go only)


# ---------------------------------------------------------------------------------------------------------
# PROF
# ---------------------------------------------------------------------------------------------------------


def test_prof_figure_example_5_correct_3_incorrect_keep_4():
    c = torch.tensor([0.9, 0.1, 0.5, 0.7, 0.3, 0.2, 0.8, 0.6])
    o = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 0])
    kept = F.prof_select(torch.zeros(8, dtype=torch.long), c, torch.full((8,), 5), o, num_remove=4)
    # 2 + 2: the two most consistent correct (0.9, 0.7), the two least consistent incorrect (0.2, 0.6)
    assert kept.tolist() == [0, 3, 5, 7]
    assert F.prof_select(torch.zeros(8, dtype=torch.long), c, torch.full((8,), 5), o, num_keep=4).tolist() == [
        0,
        3,
        5,
        7,
    ]


def test_prof_k_plus_k_minus_maximise_product_brute_force():
    groups, cons, outs = [], [], []
    sizes = []
    g = torch.Generator().manual_seed(11)
    for n in range(1, 9):
        for n_pos in range(0, n + 1):
            gid = len(sizes)
            sizes.append((n, n_pos))
            groups += [gid] * n
            outs += [1.0] * n_pos + [0.0] * (n - n_pos)
    cons = torch.rand(len(groups), generator=g)
    groups_t, outs_t = torch.tensor(groups), torch.tensor(outs)
    steps = torch.full((len(groups),), 5)
    for r in range(0, 9):
        for rounding in ("half_even", "half_up", "half_down"):
            kept = F.prof_select(groups_t, cons, steps, outs_t, num_remove=r, rounding=rounding)
            is_kept = torch.zeros(len(groups), dtype=torch.bool)
            is_kept[kept] = True
            for gid, (n, n_pos) in enumerate(sizes):
                sel = groups_t == gid
                kp = int((is_kept & sel & (outs_t == 1)).sum())
                kn = int((is_kept & sel & (outs_t == 0)).sum())
                m = n - min(r, n)
                best = max(a * (m - a) for a in range(0, m + 1) if a <= n_pos and m - a <= n - n_pos)
                assert kp + kn == m and kp <= n_pos and kn <= n - n_pos
                assert kp * kn == best, (n, n_pos, r, rounding, kp, kn)


def test_prof_rounding_breaks_odd_ties():
    gid = torch.zeros(8, dtype=torch.long)
    c = torch.linspace(0.1, 0.8, 8)
    steps = torch.full((8,), 5)

    def split(n_pos, rounding):
        o = torch.tensor([1.0] * n_pos + [0.0] * (8 - n_pos))
        kept = F.prof_select(gid, c, steps, o, num_remove=3, rounding=rounding)
        return int((o[kept] == 1).sum()), int((o[kept] == 0).sum())

    assert split(5, "half_even") == (3, 2)  # round(2.5) = 2 correct removed
    assert split(5, "half_up") == (2, 3)
    assert split(5, "half_down") == (3, 2)
    assert split(3, "half_even") == (3, 2)  # round(0.5) = 0
    assert split(3, "half_up") == (2, 3)
    assert split(3, "half_down") == (3, 2)


def test_prof_penalty_position():
    gid = torch.zeros(5, dtype=torch.long)
    c = torch.tensor([0.9, 0.8, 0.2, 0.5, 0.9])
    o = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])
    H = torch.tensor([5, 5, 1, 5, 5])  # row 2: too few steps (H < 2)
    # m = 4 -> keep both correct and 2 of 3 incorrect: one incorrect row is removed
    ref = F.prof_select(gid, c, H, o, num_remove=1, penalty_position="reference")  # critic -0.2-10 removed
    assert ref.tolist() == [0, 1, 3, 4]
    # PROF Eq. (1) (v2) subtracts lambda * r_o * pen from the unsigned mean: the same selection
    paper = F.prof_select(gid, c, H, o, num_remove=1, penalty_position="paper")
    assert paper.tolist() == [0, 1, 3, 4]
    # a penalised correct row is removed first under both positions
    o2 = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    H2 = torch.tensor([5, 31, 5, 5, 5])
    for pos in ("reference", "paper"):
        assert 1 not in F.prof_select(gid, c, H2, o2, num_remove=1, penalty_position=pos).tolist()


def test_prof_mode_correct_is_seeded_and_random_only_on_incorrect():
    n = 8
    gid = torch.tensor([0] * n + [1] * n)
    g = torch.Generator().manual_seed(12)
    c = torch.rand(2 * n, generator=g)
    o = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0] * 3 + [0.0] * 5)
    H = torch.full((2 * n,), 4)
    both = F.prof_select(gid, c, H, o, num_remove=4)
    sets = set()
    for seed in range(10):
        a = F.prof_select(gid, c, H, o, num_remove=4, mode="correct", generator=torch.Generator().manual_seed(seed))
        b = F.prof_select(gid, c, H, o, num_remove=4, mode="correct", generator=torch.Generator().manual_seed(seed))
        assert torch.equal(a, b)
        assert [i for i in a.tolist() if o[i] == 1] == [i for i in both.tolist() if o[i] == 1]
        assert int((o[a] == 0).sum()) == int((o[both] == 0).sum())
        sets.add(tuple(a.tolist()))
    assert len(sets) > 1


def test_prof_nan_outcome_never_kept():
    gid = torch.zeros(5, dtype=torch.long)
    o = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.0])
    kept = F.prof_select(gid, torch.tensor([0.5, 0.9, 0.1, 0.4, 0.3]), torch.full((5,), 3), o, num_remove=0)
    assert kept.tolist() == [0, 2, 3, 4]


def test_prof_consistency_hand():
    s = torch.tensor([[0.9, 0.8, 7.0], [0.3, 7.0, 7.0], [7.0, 7.0, 7.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    c, n = F.prof_consistency_scores(s, m)
    close(c, [0.85, 0.3, 0.0])
    assert n.tolist() == [2, 1, 0] and n.dtype == torch.long
    c, _ = F.prof_consistency_scores(s, m, center="batch")
    mu = (0.9 + 0.8 + 0.3) / 3
    close(c, [2 * (0.85 - mu), 2 * (0.3 - mu), 0.0])


def test_prof_step_scores_from_logits_and_implicit():
    logits = torch.zeros(2, 4, 2)
    logits[0, 1, 1] = math.log(3.0)  # p = 0.75
    logits[0, 3, 1] = math.log(0.25)  # p = 0.2
    logits[1, 0, 1] = 0.0  # p = 0.5
    sep = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0]])
    scores, smask = F.prof_step_scores_from_logits(logits, sep)
    close(scores, [[0.75, 0.2], [0.5, 0.0]])
    assert smask.tolist() == [[True, True], [True, False]]
    scores, smask = F.prof_step_scores_from_logits(logits, sep, 1, padding_value=-99.0)
    close(scores, [[0.75], [0.5]])
    scores, _ = F.prof_step_scores_from_logits(logits, sep, 3, padding_value=-99.0)
    close(scores, [[0.75, 0.2, -99.0], [0.5, -99.0, -99.0]])
    v = torch.tensor([[0.0, 1.0, -1.0]])
    close(F.prof_step_scores_from_implicit(v, torch.tensor([[1, 1, 0]])), [[0.5, sig(1.0), 0.0]])
    close(F.prof_step_scores_from_implicit(v, torch.ones(1, 3), temperature=0.5), [[0.5, sig(2.0), sig(-2.0)]])


# ---------------------------------------------------------------------------------------------------------
# dtypes and shapes
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_and_shapes_preserved(dtype):
    g = torch.Generator().manual_seed(13)
    B, T = 4, 6
    prm64, ref64 = (
        -torch.rand(B, T, generator=g, dtype=torch.float64),
        -torch.rand(B, T, generator=g, dtype=torch.float64),
    )
    mask = right_mask([6, 3, 5, 2], T)
    o64 = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 1, 1])
    prm, ref, o = prm64.to(dtype), ref64.to(dtype), o64.to(dtype)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float64 else dict(atol=3e-2, rtol=3e-2)

    def check(got, want):
        assert got.dtype == dtype and got.shape == want.shape
        close(got.double(), want, **tol)

    r = F.implicit_token_rewards(prm, ref, mask, beta=1.0)
    check(r, F.implicit_token_rewards(prm.double(), ref.double(), mask, beta=1.0))
    adv, ret = F.rloo_advantages(r, o, mask, 2, whiten=True)
    adv64, ret64 = F.rloo_advantages(r.double(), o64, mask, 2, whiten=True)
    check(adv, adv64)
    check(ret, ret64)
    for est in ("grpo", "reinforce"):
        check(
            F.prime_advantages(r, o, mask, gid, estimator=est),
            F.prime_advantages(r.double(), o64, mask, gid, estimator=est),
        )
    check(F.grpo_advantages(o, gid), F.grpo_advantages(o64, gid))
    check(
        F.prl_advantages(o, prm, ref, mask, gid, eta=2.0),
        F.prl_advantages(o64, prm.double(), ref.double(), mask, gid, eta=2.0),
    )
    check(F.masked_whiten(prm, mask), F.masked_whiten(prm.double(), mask))
    check(F.discounted_cumsum(prm, 0.9), F.discounted_cumsum(prm.double(), 0.9))
    ends = F.step_end_mask(torch.zeros(B, T, dtype=torch.long), mask, split="length", step_len=2)
    vals, _ = F.step_rewards(r, ends)
    check(vals, F.step_rewards(r.double(), ends)[0])
    c, _ = F.prof_consistency_scores(prm.exp(), mask)
    check(c, F.prof_consistency_scores(prm64.exp(), mask)[0])
    loss = F.implicit_prm_loss(prm, ref, mask, o)
    assert loss.dtype == dtype and loss.dim() == 0


def test_degenerate_batches_give_finite_zeros():
    P = torch.randn(4, 3)
    mask = right_mask([0, 1, 0, 1], 3)  # empty and length-1 completions
    o = torch.tensor([1.0, 1.0, 1.0, 1.0])  # every reward equal
    for est in ("rloo", "grpo", "reinforce"):
        for whiten in (False, True):
            adv = F.prime_advantages(P, o, mask, torch.tensor([0, 0, 1, 1]), estimator=est, whiten=whiten)
            assert torch.isfinite(adv).all() and (adv[~mask] == 0).all()
    adv, ret = F.rloo_advantages(P, o, mask, 2)
    assert (ret[0] == 0).all() and (ret[2] == 0).all()  # nothing to credit in an empty completion
    assert torch.isfinite(F.prl_advantages(o, P, P * 0, mask, torch.tensor([0, 0, 1, 1]))).all()
    assert F.prompt_accuracy_mask(o, 2).tolist() == [False] * 4  # every group filtered out
    loss = F.implicit_prm_loss(P, P * 0, mask, torch.tensor([float("nan")] * 4))
    assert loss.item() == 0.0
    for lt in ("dpo", "nca"):  # all outcomes equal: no (correct, incorrect) pair
        assert F.implicit_prm_loss(P, P * 0, mask, o, loss_type=lt).item() == 0.0
    r = 0.05 * (P * mask).sum(-1)  # KTO is unpaired: all-correct rows use the reference point 0
    close(F.implicit_prm_loss(P, P * 0, mask, o, loss_type="kto"), (1 - torch.sigmoid(r)).mean())
    assert F.prof_select(torch.tensor([0, 0, 1, 1]), o, torch.ones(4), o, num_remove=4).tolist() == []


# ---------------------------------------------------------------------------------------------------------
# validation errors
# ---------------------------------------------------------------------------------------------------------


def test_validation_errors():
    P = torch.zeros(4, 3)
    m = torch.ones(4, 3)
    o = torch.zeros(4)
    with pytest.raises(ValueError, match="num_generations=3 does not divide the batch size B=4"):
        F.rloo_advantages(P, o, m, 3)
    with pytest.raises(ValueError, match="at least 2 completions per group"):
        F.rloo_advantages(P, o, m, 1)
    with pytest.raises(ValueError, match=r"at least 2 completions per group, but the group of group_ids\[2\]=5 has 1"):
        F.rloo_advantages(P, o, m, group_ids=torch.tensor([0, 0, 5, 7]))
    with pytest.raises(ValueError, match="baseline='loo' is not supported; choose one of 'paper', 'reference'"):
        F.rloo_advantages(P, o, m, 2, baseline="loo")
    with pytest.raises(ValueError, match="process_reward_norm='max'"):
        F.rloo_advantages(P, o, m, 2, process_reward_norm="max")
    with pytest.raises(ValueError, match="`process_rewards` and `mask` must have the same shape"):
        F.rloo_advantages(P, o, torch.ones(4, 2), 2)
    with pytest.raises(ValueError, match=r"`outcome_rewards` must have shape \(4,\)"):
        F.rloo_advantages(P, torch.zeros(3), m, 2)
    with pytest.raises(ValueError, match="gamma=1.5 must be in"):
        F.rloo_advantages(P, o, m, 2, gamma=1.5)
    with pytest.raises(ValueError, match="estimator='ppo'"):
        F.prime_advantages(P, o, m, torch.tensor([0, 0, 1, 1]), estimator="ppo")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['baseline'\]"):
        F.prime_advantages(P, o, m, torch.tensor([0, 0, 1, 1]), estimator="reinforce", baseline="reference")
    with pytest.raises(ValueError, match="either `group_ids` or `num_generations`"):
        F.grpo_advantages(o, torch.tensor([0, 0, 1, 1]), num_generations=2)
    with pytest.raises(ValueError, match="`group_ids` must have shape"):
        F.grpo_advantages(o, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="loss_type='ipo'"):
        F.implicit_prm_loss(P, P, m, o, loss_type="ipo")
    with pytest.raises(ValueError, match=r"`labels` must lie in \[0, 1\]"):
        F.implicit_prm_loss(P, P, m, torch.tensor([0.0, 2.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="`mask` must contain only 0/1"):
        F.implicit_token_rewards(P, P, torch.full((4, 3), 2.0))
    with pytest.raises(ValueError, match="`prm_logps` and `ref_logps` must have the same shape"):
        F.implicit_token_rewards(P, torch.zeros(4, 2), m)
    with pytest.raises(ValueError, match="eta=0"):
        F.prl_advantages(o, P, P, m, torch.tensor([0, 0, 1, 1]), eta=0)
    with pytest.raises(ValueError, match="order='reverse'"):
        F.prl_advantages(o, P, P, m, torch.tensor([0, 0, 1, 1]), order="reverse")
    with pytest.raises(ValueError, match="needs `group_ids`"):
        F.prl_advantages(o, P, P, m, None)
    with pytest.raises(ValueError, match='split="length" needs `step_len`'):
        F.step_end_mask(torch.zeros(4, 3, dtype=torch.long), m, split="length")
    with pytest.raises(ValueError, match="needs a `tokenizer`"):
        F.step_end_mask(torch.zeros(4, 3, dtype=torch.long), m)
    with pytest.raises(ValueError, match="split='sentence'"):
        F.step_end_mask(torch.zeros(4, 3, dtype=torch.long), m, split="sentence")
    with pytest.raises(ValueError, match="how='max'"):
        F.aggregate_step_rewards(P, m, how="max")
    with pytest.raises(ValueError, match="at least 2 masked entries"):
        F.masked_whiten(P, torch.tensor([[1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="pass both `completion_lengths` and `max_completion_length`"):
        F.prompt_accuracy_mask(o, 2, completion_lengths=torch.ones(4))
    with pytest.raises(ValueError, match="center='median'"):
        F.prof_consistency_scores(P, m, center="median")
    gid = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one of `num_remove`"):
        F.prof_select(gid, o, torch.ones(4), o, num_remove=1, num_keep=3)
    with pytest.raises(ValueError, match="mode='pos'"):
        F.prof_select(gid, o, torch.ones(4), o, num_remove=1, mode="pos")
    with pytest.raises(ValueError, match="rounding='nearest'"):
        F.prof_select(gid, o, torch.ones(4), o, num_remove=1, rounding="nearest")
    with pytest.raises(ValueError, match="penalty_position='before'"):
        F.prof_select(gid, o, torch.ones(4), o, num_remove=1, penalty_position="before")
    with pytest.raises(ValueError, match="`ids` must have shape"):
        F.token_logps(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_public_api_matches_spec_signatures():
    import inspect

    pinned = {
        "implicit_token_rewards": ["prm_logps", "ref_logps", "mask", "beta", "include_last_token"],
        "sequence_logps": ["logits", "input_ids", "attention_mask", "prompt_lengths"],
        "implicit_prm_loss": ["prm_logps", "ref_logps", "mask", "labels", "beta", "loss_type", "group_ids"],
        "step_rewards": ["token_rewards", "step_ends"],
        "aggregate_step_rewards": ["step_values", "step_mask", "how"],
        "split_steps": ["text", "delimiter"],
        "step_end_mask": ["completion_ids", "mask", "tokenizer", "split", "step_len"],
        "masked_whiten": ["values", "mask", "shift_mean", "eps"],
        "rloo_advantages": [
            "process_rewards",
            "outcome_rewards",
            "mask",
            "num_generations",
            "process_coef",
            "outcome_coef",
            "gamma",
            "outcome_gamma",
            "baseline",
            "whiten",
            "process_reward_norm",
        ],
        "grpo_advantages": ["rewards", "group_ids", "scale_rewards", "eps"],
        "prime_advantages": ["process_rewards", "outcome_rewards", "mask", "group_ids", "estimator"],
        "prompt_accuracy_mask": [
            "outcome_rewards",
            "num_generations",
            "lower",
            "upper",
            "completion_lengths",
            "max_completion_length",
        ],
        "prm_pair_accuracy": ["sequence_rewards", "outcome_rewards", "num_generations"],
        "prm_abs_accuracy": ["sequence_rewards", "outcome_rewards"],
        "prl_advantages": [
            "outcome_rewards",
            "old_logps",
            "ref_logps",
            "mask",
            "group_ids",
            "eta",
            "step_ends",
            "order",
            "scale_rewards",
            "eps",
            "zero_fill_compat",
        ],
        "prof_consistency_scores": ["step_scores", "step_mask", "center"],
        "prof_select": [
            "group_ids",
            "consistency",
            "num_steps",
            "outcome_rewards",
            "num_remove",
            "penalty",
            "min_steps",
            "max_steps",
            "penalty_position",
            "mode",
            "rounding",
            "generator",
        ],
    }
    defaults = {
        ("implicit_token_rewards", "beta"): 0.05,
        ("implicit_prm_loss", "loss_type"): "ce",
        ("rloo_advantages", "baseline"): "paper",
        ("rloo_advantages", "whiten"): False,
        ("rloo_advantages", "process_reward_norm"): "none",
        ("grpo_advantages", "eps"): 1e-6,
        ("prime_advantages", "estimator"): "rloo",
        ("prompt_accuracy_mask", "lower"): 0.2,
        ("prompt_accuracy_mask", "upper"): 0.8,
        ("prl_advantages", "eta"): 200.0,
        ("prl_advantages", "order"): "advantage_first",
        ("prl_advantages", "zero_fill_compat"): False,
        ("prof_select", "penalty"): 10.0,
        ("prof_select", "min_steps"): 2,
        ("prof_select", "max_steps"): 30,
        ("prof_select", "penalty_position"): "reference",
        ("prof_select", "mode"): "both",
        ("prof_select", "rounding"): "half_even",
        ("masked_whiten", "eps"): 1e-8,
        ("aggregate_step_rewards", "how"): "min",
        ("split_steps", "delimiter"): "\n\n",
        ("step_end_mask", "split"): "double_newline",
        ("prof_consistency_scores", "center"): "none",
    }
    for name, params in pinned.items():
        assert name in F.__all__
        sig_params = inspect.signature(getattr(F, name)).parameters
        for p in params:
            assert p in sig_params, (name, p)
    for (name, p), value in defaults.items():
        assert inspect.signature(getattr(F, name)).parameters[p].default == value, (name, p)


# ---------------------------------------------------------------------------------------------------------
# review regressions (one per finding)
# ---------------------------------------------------------------------------------------------------------


def test_prof_select_nan_consistency_is_removed_first():
    gid = [0] * 4
    H = torch.full((4,), 3)
    o = torch.tensor([1.0, 1.0, 0.0, 0.0])
    # correct rows: NaN would sort as the largest critic (most consistent, kept); it must go first instead
    kept = F.prof_select(gid, torch.tensor([float("nan"), 0.2, 0.3, 0.4]), H, o, num_remove=2)
    assert kept.tolist() == [1, 2]  # correct: 0.2 kept over NaN; incorrect: the least consistent (0.3) kept
    # incorrect rows: a NaN row is removed before the most consistent incorrect one
    kept = F.prof_select(gid, torch.tensor([0.2, 0.3, 0.9, float("nan")]), H, o, num_remove=2)
    assert kept.tolist() == [1, 2]
    # kept only when its class must keep more rows than it has scored ones
    kept = F.prof_select(gid, torch.tensor([float("nan"), float("nan"), 0.1, 0.2]), H, o, num_remove=0)
    assert kept.tolist() == [0, 1, 2, 3]


def test_prof_consistency_rejects_step_scores_outside_unit_interval():
    m = torch.tensor([[1, 1, 0]])
    for bad in (2.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"`step_scores` must be probabilities in \[0, 1\].*step_scores\[0, 1\]"):
            F.prof_consistency_scores(torch.tensor([[0.5, bad, 0.0]]), m)
    # padded (step_mask=0) positions are ignored, whatever they hold (the released code pads with -99)
    c, n = F.prof_consistency_scores(
        torch.tensor([[0.0, 1.0, float("nan")], [0.5, -99.0, 9.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    )
    close(c, [0.5, 0.5])
    assert n.tolist() == [2, 1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_process_reward_at_a_valid_token_raises(bad):
    P = torch.zeros(4, 3)
    P[1, 2] = bad
    o = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=r"`process_rewards` must be finite.*process_rewards\[1, 2\]"):
        F.rloo_advantages(P, o, torch.ones(4, 3), 2)
    for est in ("grpo", "reinforce"):
        with pytest.raises(ValueError, match="`process_rewards` must be finite"):
            F.prime_advantages(P, o, torch.ones(4, 3), [0, 0, 1, 1], estimator=est)
    # the same value in padding is ignored (values outside the mask are unspecified)
    mask = torch.ones(4, 3)
    mask[1, 2] = 0
    adv, _ = F.rloo_advantages(P, o, mask, 2)
    assert torch.isfinite(adv).all()
    # NaN stays allowed (and excluded) in the outcome rewards
    adv, _ = F.rloo_advantages(torch.zeros(4, 3), torch.tensor([1.0, float("nan"), 1.0, 0.0]), mask, 2)
    assert torch.isfinite(adv).all() and (adv[:2] == 0).all()


def test_grpo_eps_zero_constant_group_gives_zero_not_nan():
    r = torch.tensor([1.0, 1.0, 0.1, 0.1, 0.1, 1.0, 0.0])
    adv = F.grpo_advantages(r, [0, 0, 1, 1, 1, 2, 2], eps=0.0)
    assert torch.isfinite(adv).all()
    # constant groups (even 0.1 x 3, whose float mean is not exactly 0.1) are exactly 0; others unchanged
    assert adv[:5].tolist() == [0.0] * 5
    close(adv[5:], [math.sqrt(0.5), -math.sqrt(0.5)])  # (1 - 0.5) / std, std = sqrt(0.5)
    assert (F.grpo_advantages(torch.tensor([0.1] * 3), num_generations=3) == 0).all()  # default eps too
    P = torch.tensor([[1.0, 1.0], [2.0, 0.0]])  # response means equal (1, 1): process std 0
    adv = F.prime_advantages(P, torch.tensor([1.0, 1.0]), torch.ones(2, 2), [0, 0], estimator="grpo", eps=0.0)
    assert torch.isfinite(adv).all() and (adv == 0).all()
    with pytest.raises(ValueError, match="eps=-1"):
        F.grpo_advantages(r, [0] * 7, eps=-1e-6)


def test_num_generations_accepts_any_integral():
    np = pytest.importorskip("numpy")
    P = torch.randn(4, 3)
    o = torch.tensor([1.0, 0.0, 1.0, 0.0])
    m = torch.ones(4, 3)
    want, _ = F.rloo_advantages(P, o, m, 2)
    for k in (np.int64(2), np.int32(2), torch.tensor(2)):
        close(F.rloo_advantages(P, o, m, k)[0], want)
        close(F.grpo_advantages(o, num_generations=k), F.grpo_advantages(o, num_generations=2))
        assert F.prompt_accuracy_mask(o, k).tolist() == [True] * 4
    for bad in (2.0, True, torch.tensor(2.0), torch.tensor([2]), "2"):
        with pytest.raises(ValueError, match="`num_generations` must be a positive integer"):
            F.rloo_advantages(P, o, m, bad)


def test_unhashable_group_ids_raise_value_error_naming_them():
    o = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match=r"`group_ids` entries must be hashable.*group_ids\[0\] is list.*1-D integer"):
        F.grpo_advantages(o, [[1], [1]])
    # 0-d tensors in a list are grouped by value, not by object identity
    ids = list(torch.tensor([5, 5, 7, 7]))
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    close(F.grpo_advantages(r, ids), F.grpo_advantages(r, num_generations=2))


def test_sequence_logps_validates_ids_and_accepts_list_prompt_lengths():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 5, generator=g)
    ids = torch.randint(0, 5, (2, 4), generator=g)
    am = torch.ones(2, 4)
    want = F.sequence_logps(logits, ids, am, torch.tensor([1, 2]))
    for pl in ([1, 2], (1, 2)):
        got = F.sequence_logps(logits, ids, am, pl)
        close(got[0], want[0])
        close(got[1], want[1])
    bad = ids.clone()
    bad[1, 3] = 7
    with pytest.raises(ValueError, match=r"`input_ids` holds token id 7 at input_ids\[1, 3\].*V=5"):
        F.sequence_logps(logits, bad, am, 1)
    bad[1, 3] = -1
    with pytest.raises(ValueError, match="`input_ids` holds token id -1"):
        F.sequence_logps(logits, bad, am, 1)
    # out-of-vocabulary ids where nothing is scored (prompt, padding) are never gathered
    ids2 = ids.clone()
    ids2[0, 0] = -100  # prompt
    ids2[1, 3] = 99  # padding
    am2 = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    s, _ = F.sequence_logps(logits, ids2, am2, 1)
    close(s, F.sequence_logps(logits, ids, am2, 1)[0])
    with pytest.raises(ValueError, match="`prompt_lengths` must hold integers"):
        F.sequence_logps(logits, ids, am, [1.5, 2])
    with pytest.raises(ValueError, match=r"`prompt_lengths` must have shape \(2,\)"):
        F.sequence_logps(logits, ids, am, [1, 2, 3])


def test_prof_select_without_group_ids_accepts_num_generations():
    c = torch.tensor([0.1, 0.9, 0.2, 0.8])
    o = torch.tensor([1.0, 1.0, 0.0, 0.0])
    H = torch.full((4,), 3)
    with pytest.raises(ValueError, match="pass `group_ids`.*or `num_generations`"):
        F.prof_select(None, c, H, o, num_remove=2)
    assert F.prof_select(None, c, H, o, num_remove=2, num_generations=4).tolist() == (
        F.prof_select([0] * 4, c, H, o, num_remove=2).tolist()
    )


def test_step_end_mask_agrees_with_split_steps_on_delimiter_runs():
    tok = PieceTokenizer({0: "A", 1: "\n\n", 2: "B", 3: " ", 4: "\n", 5: "C."})
    cases = [
        ([0, 1, 1, 2], [False, False, True, True]),  # "A\n\n\n\nB": one end, after the run
        ([1, 0, 1, 2], [False, False, True, True]),  # leading delimiter ends no (empty) step
        ([0, 1, 3, 1, 2], [False, False, False, True, True]),  # delimiters separated by whitespace collapse
        ([0, 1, 2, 1, 3], [False, True, False, False, True]),  # trailing "\n\n " : the last token ends "B"
        ([0, 1, 1], [False, False, True]),
        ([1, 1], [False, True]),  # only delimiters: one (empty) step, the last token
        ([5, 4, 4, 4, 0, 4, 2], [False, False, True, False, False, False, True]),  # "\n\n\n": one delimiter
    ]
    for ids, want in cases:
        ends = F.step_end_mask(torch.tensor([ids]), torch.ones(1, len(ids)), tok)[0]
        assert ends.tolist() == want, (ids, ends.tolist())
        text = "".join(tok.pieces[i] for i in ids)
        if text.strip():  # one step end per split_steps step
            assert int(ends.sum()) == len(F.split_steps(text)), (text, ends.tolist())
    # split="newline" on "A\n\n\n\nB" with "\n\n" tokens: the same single boundary
    ends = F.step_end_mask(torch.tensor([[0, 1, 1, 2]]), torch.ones(1, 4), tok, split="newline")[0]
    assert ends.tolist() == [False, False, True, True]


# ---------------------------------------------------------------------------------------------------------
# token-level PPO-clip loss (PRIME Eq. 6)
# ---------------------------------------------------------------------------------------------------------


class TestTokenPPOClipLoss:
    """``token_ppo_clip_loss`` on hand-computed ratios, clips, masks and normalizers."""

    def test_hand_computed_clip_both_sides(self):
        # ratios 1.5, 0.5, 1.0 (old log-probs 0); advantages 1, -1, 2; the third token is masked out
        logps = torch.log(torch.tensor([[1.5, 0.5, 1.0]], dtype=torch.float64))
        adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
        mask = torch.tensor([[1, 1, 0]])
        loss = F.token_ppo_clip_loss(logps, torch.zeros_like(logps), adv, mask, epsilon_low=0.2, epsilon_high=0.28)
        # token 1: min(1.5 * 1, 1.28 * 1) = 1.28; token 2: min(0.5 * -1, 0.8 * -1) = -0.8; mean of -(1.28, -0.8)
        close(loss, (-1.28 + 0.8) / 2)
        assert loss.dtype == torch.float64 and loss.dim() == 0

    def test_unclipped_ratio_inside_the_range(self):
        logps = torch.log(torch.tensor([[1.1, 0.9]]))
        adv = torch.tensor([[2.0, 3.0]])
        loss = F.token_ppo_clip_loss(logps, torch.zeros_like(logps), adv, torch.ones(1, 2))
        close(loss, -(1.1 * 2.0 + 0.9 * 3.0) / 2, atol=1e-6)

    def test_on_policy_sequence_advantages_and_normalizer(self):
        # old_logps None: ratio 1, loss = -sum_t A m / N; (B,) advantages broadcast over the tokens
        logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
        adv = torch.tensor([0.5, -2.0])
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
        loss = F.token_ppo_clip_loss(logps, None, adv, mask, normalizer=torch.tensor(4.0))
        close(loss, -(0.5 + 0.5 - 2.0) / 4.0)
        loss.backward()
        # d loss / d logps_t = -A_t m_t / N (the ratio's derivative is 1 at ratio 1)
        close(logps.grad, torch.tensor([[-0.125, -0.125, 0.0], [0.5, 0.0, 0.0]]))

    def test_empty_mask_gives_zero(self):
        logps = torch.zeros(2, 3)
        loss = F.token_ppo_clip_loss(logps, logps, torch.ones(2, 3), torch.zeros(2, 3))
        assert loss.item() == 0.0

    def test_shape_errors(self):
        logps = torch.zeros(2, 3)
        with pytest.raises(ValueError, match="`logps` must have shape"):
            F.token_ppo_clip_loss(torch.zeros(3), None, torch.zeros(3), torch.ones(3))
        with pytest.raises(ValueError, match="`logps` and `mask`"):
            F.token_ppo_clip_loss(logps, None, torch.zeros(2, 3), torch.ones(2, 4))
        with pytest.raises(ValueError, match="`logps` and `old_logps`"):
            F.token_ppo_clip_loss(logps, torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 3))
        with pytest.raises(ValueError, match="`advantages` must have shape \\(2,\\)"):
            F.token_ppo_clip_loss(logps, None, torch.zeros(3), torch.ones(2, 3))
        with pytest.raises(ValueError, match="`logps` and `advantages`"):
            F.token_ppo_clip_loss(logps, None, torch.zeros(2, 4), torch.ones(2, 3))


# ----------------------------------------------------------------------------------------------------------------
# PRM labels (prm_label) and TRL's scale_rewards="batch"
# ----------------------------------------------------------------------------------------------------------------
NAN = float("nan")


def _same(a, b):
    b = b.to(a.dtype) if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)
    torch.testing.assert_close(a, b, equal_nan=True, atol=1e-6, rtol=1e-6)


def test_prm_labels_hand():
    """Each prm_label mode on hand-computed cases; NaN (unscorable) passes through every mode."""
    assert F.PRM_LABELS == ("identity", "threshold", "sigmoid", "group_rank")
    _same(F.prm_labels(torch.tensor([0.0, 0.5, 1.0, NAN])), [0.0, 0.5, 1.0, NAN])
    r = torch.tensor([0.2, 0.5, 0.7, NAN, -3.0])
    _same(F.prm_labels(r, "threshold"), [0.0, 1.0, 1.0, NAN, 0.0])  # default threshold 0.5, inclusive
    _same(F.prm_labels(r, "threshold", threshold=-3.0), [1.0, 1.0, 1.0, NAN, 1.0])
    s1 = 1.0 / (1.0 + math.exp(-1.0))  # sigmoid(2 / 2)
    _same(F.prm_labels(torch.tensor([0.0, 2.0, -2.0, NAN]), "sigmoid", temperature=2.0), [0.5, s1, 1.0 - s1, NAN])
    # group_rank, K=4: 1 above the group's mean, 0 below; ties to the mean (all-equal groups, a lone scorable row)
    # get no label
    r = torch.tensor([3.0, 1.0, 1.0, 3.0, 5.0, 5.0, 5.0, 5.0, 2.0, NAN, 0.0, 1.0, NAN, NAN, 7.0, NAN])
    want = [1.0, 0.0, 0.0, 1.0] + [NAN] * 4 + [1.0, NAN, 0.0, NAN] + [NAN] * 4
    _same(F.prm_labels(r, "group_rank", num_generations=4), want)
    _same(F.prm_labels(100.0 * r - 3.0, "group_rank", num_generations=4), want)  # scale and shift invariant
    gid = torch.tensor([0, 1, 0, 1])
    _same(F.prm_labels(torch.tensor([1.0, 4.0, 0.0, 2.0]), "group_rank", group_ids=gid), [1.0, 1.0, 0.0, 0.0])
    # a 0/1 verifier: group_rank equals identity except in all-equal groups
    v = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    _same(F.prm_labels(v, "group_rank", num_generations=4), [1.0, 0.0, 0.0, 1.0] + [NAN] * 4)
    assert F.prm_labels(torch.tensor([0.3], dtype=torch.float64), "sigmoid").dtype == torch.float64
    assert F.prm_labels(torch.tensor([0.3], dtype=torch.bfloat16), "threshold").dtype == torch.float32


def test_prm_labels_weighted_sum_of_two_verifiers():
    """Two 0/1 verifiers weighted 0.7 and 0.6 (sum 1.3 > 1): identity refuses, the other modes label in [0, 1]."""
    a = torch.tensor([1.0, 1.0, 0.0, 0.0])
    b = torch.tensor([1.0, 0.0, 1.0, 0.0])
    r = 0.7 * a + 0.6 * b  # [1.3, 0.7, 0.6, 0.0]
    with pytest.raises(ValueError, match=r"prm_label='identity'.*\[0, 1\].*\[0, 1.3\].*'threshold'.*'group_rank'"):
        F.prm_labels(r)
    _same(F.prm_labels(r, "threshold", threshold=0.65), [1.0, 1.0, 0.0, 0.0])
    _same(F.prm_labels(r, "group_rank", num_generations=4), [1.0, 1.0, 0.0, 0.0])  # mean 0.65
    lab = F.prm_labels(r, "sigmoid")
    assert bool(((lab > 0) & (lab < 1)).all()) and bool((lab[:-1] > lab[1:]).all())  # monotone in the reward


def test_prm_labels_identity_float32_weighted_sum_rounding():
    """TRL sums the weighted rewards in float32: weights [0.3, 0.4, 0.1, 0.2] give 1.0000001 when every verifier
    passes. identity accepts a reward within 1e-6 of [0, 1] and clamps it; one further out is still refused."""
    w = torch.tensor([0.3, 0.4, 0.1, 0.2])
    passed = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    r = (passed * w).nansum(dim=1)  # TRL's weighted sum
    assert r[0].item() > 1.0  # 1.0000001
    lab = F.prm_labels(r)
    assert lab.tolist() == [1.0, 0.0, pytest.approx(0.3)]
    assert F.prm_labels(torch.tensor([-5e-7, 1.0 + 5e-7], dtype=torch.float64)).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"prm_label='identity'.*\[0, 1\]"):
        F.prm_labels(torch.tensor([0.5, 1.00001]))
    with pytest.raises(ValueError, match=r"prm_label='identity'.*\[0, 1\]"):
        F.prm_labels(torch.tensor([-0.00001, 0.5]))


def test_prm_labels_group_rank_ties_follow_the_group_spread():
    """group_rank's tie tolerance is 1e-6 * (max - min) of the group: shift and scale invariant at any magnitude."""
    # tiny rewards: mean 7.5e-8, spread 2e-7 -> tolerance 2e-13; 1e-7 and 2e-7 are above the mean, the zeros below
    _same(F.prm_labels(torch.tensor([1e-7, 0.0, 0.0, 2e-7], dtype=torch.float64), "group_rank", num_generations=4),
          [1.0, 0.0, 0.0, 1.0])  # fmt: skip
    # huge rewards: mean 1e8 + 2, spread 5 -> tolerance 5e-6
    r = torch.tensor([1e8, 1e8 + 3, 1e8 + 5, 1e8], dtype=torch.float64)
    _same(F.prm_labels(r, "group_rank", num_generations=4), [0.0, 1.0, 1.0, 0.0])
    # a reward within 1e-6 * spread of the mean ties it: [0, 2, 1, 1] (mean 1, spread 2) -> the 1s get no label
    _same(F.prm_labels(torch.tensor([0.0, 2.0, 1.0, 1.0]), "group_rank", num_generations=4), [0.0, 1.0, NAN, NAN])
    # all equal (mean(0.1, 0.1, 0.1) rounds away from 0.1): all ties
    _same(F.prm_labels(torch.tensor([0.1, 0.1, 0.1]), "group_rank", num_generations=3), [NAN] * 3)


def test_prm_labels_errors():
    r = torch.tensor([0.0, 1.0])
    with pytest.raises(ValueError, match=r"prm_label='rank' is not supported; choose one of 'identity'"):
        F.prm_labels(r, "rank")
    for t in (0.0, -1.0, NAN, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            F.prm_labels(r, "sigmoid", temperature=t)
    with pytest.raises(ValueError, match="threshold"):
        F.prm_labels(r, "threshold", threshold=NAN)
    with pytest.raises(ValueError, match="num_generations"):
        F.prm_labels(r, "group_rank")
    with pytest.raises(ValueError, match="divisible|divide"):
        F.prm_labels(torch.zeros(3), "group_rank", num_generations=2)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        F.prm_labels(torch.zeros(2, 2), "threshold")


def test_grpo_advantages_batch_scale_hand():
    """scale_rewards="batch" (TRL's): centred on the group mean, divided by the std of every scorable reward."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, NAN])
    # scorable: 1,0,0,0,1,1,0 -> mean 3/7, unbiased var (3 (4/7)^2 + 4 (3/7)^2) / 6 = 2/7
    std_b = math.sqrt(2.0 / 7.0)
    want = [0.75 / std_b, -0.25 / std_b, -0.25 / std_b, -0.25 / std_b, 1 / 3 / std_b, 1 / 3 / std_b, -2 / 3 / std_b]
    _same(F.grpo_advantages(r, num_generations=4, scale_rewards="batch", eps=0.0), want + [0.0])
    _same(F.grpo_advantages(r, num_generations=4, scale_rewards="group"), F.grpo_advantages(r, num_generations=4))
    _same(
        F.grpo_advantages(r, num_generations=4, scale_rewards="none"),
        F.grpo_advantages(r, num_generations=4, scale_rewards=False),
    )
    with pytest.raises(ValueError, match=r"scale_rewards='global' is not supported"):
        F.grpo_advantages(r, num_generations=4, scale_rewards="global")


def test_prime_grpo_estimator_batch_scale_hand():
    """PRIME's "grpo" estimator with scale_rewards="batch": outcome term (o - mean_g) / std_B(o); process term
    (response form, t=0) (rbar - mean_g rbar) / std_B(o) ("outcome_std") or / std_B(rbar) ("process_std"); a group
    with equal outcomes keeps its process term."""
    o = torch.tensor([1.0, 0.0, 1.0, 1.0])  # groups of 2: [1, 0], [1, 1]
    P = torch.tensor([[0.2, 0.2], [0.0, 0.0], [0.4, 0.4], [0.1, 0.1]])
    mask = torch.ones(4, 2)
    kw = dict(num_generations=2, estimator="grpo", scale_rewards="batch", eps=0.0, gamma=1.0)
    kw["grpo_process_form"] = "response"  # t=0: the mean token reward; the default "token" form is L=2 times it
    std_o = math.sqrt(((0.25 * 3) * 0.25 + 0.75**2) / 3)  # o: mean 0.75, deviations 0.25 (x3) and -0.75
    out = F.prime_advantages(P, o, mask, None, process_coef=0.0, **kw)
    _same(out[:, 0], [0.5 / std_o, -0.5 / std_o, 0.0, 0.0])
    _same(out[:, 1], out[:, 0])  # the outcome sits at the last token, gamma 1
    proc = F.prime_advantages(P, o, mask, None, outcome_coef=0.0, **kw)
    _same(proc[:, 0], [0.1 / std_o, -0.1 / std_o, 0.15 / std_o, -0.15 / std_o])
    token = F.prime_advantages(P, o, mask, None, outcome_coef=0.0, **dict(kw, grpo_process_form="token"))
    _same(token[:, 0], [0.2 / std_o, -0.2 / std_o, 0.3 / std_o, -0.3 / std_o])
    rbar = torch.tensor([0.2, 0.0, 0.4, 0.1], dtype=torch.float64)
    std_r = rbar.std().item()
    proc = F.prime_advantages(P, o, mask, None, outcome_coef=0.0, grpo_process_scale="process_std", **kw)
    _same(proc[:, 0], [0.1 / std_r, -0.1 / std_r, 0.15 / std_r, -0.15 / std_r])
    # every outcome of the batch equal: no scale for "outcome_std", both terms 0
    same = F.prime_advantages(P, torch.ones(4), mask, None, **kw)
    _same(same[:, 0], [0.0] * 4)
    # "group" keeps the former behaviour (True is "group"), and the equal-outcome group gets process term 0
    group = F.prime_advantages(P, o, mask, None, outcome_coef=0.0, **dict(kw, scale_rewards="group"))
    _same(group[2:, 0], [0.0, 0.0])
    _same(group, F.prime_advantages(P, o, mask, None, outcome_coef=0.0, **dict(kw, scale_rewards=True)))


def test_prl_advantages_batch_scale_hand():
    """PRL's advantage-first order with scale_rewards="batch": A divided by the batch std, then minus S_t / eta."""
    o = torch.tensor([1.0, 0.0, 1.0, 1.0])
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-0.5, -0.5], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0], [-1.0, -1.0], [-0.5, -0.5], [-1.0, -1.0]])
    mask = torch.ones(4, 2)
    std_o = math.sqrt(0.25)  # unbiased std of [1, 0, 1, 1]: var (3 * 0.0625 + 0.5625) / 3 = 0.25
    adv = F.prl_advantages(o, old, ref, mask, None, num_generations=2, eta=2.0, scale_rewards="batch", eps=0.0)
    # row 0: k = [0.5, 0], S = [0.5, 0]; A = 0.5 / 0.5 = 1
    _same(adv, [[1.0 - 0.25, 1.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])
    assert std_o == 0.5


def test_rank_within_class_stable_hand():
    """PROF selection's rank: ascending key inside each class, ties in row order, classes in any row order."""
    key = torch.tensor([0.5, 0.1, 0.5, -1.0, 0.3, 0.1], dtype=torch.float64)
    cls = torch.tensor([1, 0, 1, 1, 0, 0])
    # class 0 rows 1 (0.1), 5 (0.1), 4 (0.3); class 1 rows 3 (-1.0), 0 (0.5), 2 (0.5)
    assert F._rank_within_class(key, cls).tolist() == [1.0, 0.0, 2.0, 0.0, 2.0, 1.0]
