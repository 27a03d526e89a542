"""Conformance of ``trl_prime.functional`` with the authors' released code.

Every JSON file in ``tests/data/conformance/`` (a copy of ``shared/conformance/``) holds inputs and outputs
computed by a released reference implementation plus a ``semantics`` text and a ``tolerance``. Each case is
run through the public functional API with the options that reproduce the released behaviour and compared
with the file's tolerance. Cases (or single outputs) that the library deliberately does not follow are
listed in ``SKIPPED_CASES`` / ``SKIPPED_OUTPUTS`` with the reason and show up as named skips.

Guards against silent gaps: the set of files with a handler must equal the set of files present, and each
handler must check every output key of its case except the named skipped ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import TESTS

from trl_prime import functional as F


DATA_DIR = Path(TESTS, "data", "conformance")
FILES = sorted(DATA_DIR.glob("*.json"))
META_KEYS = {"function", "semantics", "tolerance", "cases"}

# ---------------------------------------------------------------------------------------------------------
# deliberate deviations from PRIME's released veRL code (arXiv 2502.01456; docs/methods/prime.md lists the rest)
# ---------------------------------------------------------------------------------------------------------
_DETACH_DPO = (
    "veRL's detached-DPO PRM loss (compute_detach_dpo_loss_rm: loss against the detached pre-update rewards "
    "of the group, optionally with best-of-N weights) is deliberately not offered; the library's "
    "PRM losses are implicit_prm_loss ce/dpo/kto/nca"
)
SKIPPED_CASES = {
    ("prime_detach_dpo_loss", "mode_none"): _DETACH_DPO,
    ("prime_detach_dpo_loss", "mode_bon_rm"): _DETACH_DPO,
    ("prime_token_reward_verl", "lambda0.95_use_gt"): (
        "veRL's lambda-accumulation of token rewards with prime_use_gt (r_t = q_t + lambda*r_{t+1}, last "
        "token replaced by acc - sum q) is deliberately not offered (PRIME Eq. 3 sums the token rewards); lambda=0 is covered by "
        "case lambda0_default"
    ),
}
_DOWNSAMPLE = (
    "veRL's filter_and_downsample (oversample, order prompts passing-first with torch.argsort, which is NOT a "
    "stable sort, and keep the first int(B/oversample_factor) responses, back-filling with failing prompts) is "
    "deliberately not offered (its down-sampling order is not stable); the library's filter "
    "(prompt_accuracy_mask) is checked against prompt_passes_filter"
)
SKIPPED_OUTPUTS = {
    ("prime_accuracy_filter_verl", "oversample_2", "n_responses_kept"): _DOWNSAMPLE,
    ("prime_accuracy_filter_verl", "oversample_2", "kept_response_indices_as_produced"): _DOWNSAMPLE,
    ("prof_filter_correct", "deterministic_groups", "kept_indices_python_random_seed0"): (
        "PROF-Correct removes random incorrect rows with Python's global `random` module; the library draws "
        "them with an explicit torch.Generator (pure function, no global RNG), so the random negatives differ. "
        "The deterministic parts (kept positives, number of kept negatives per group) are checked"
    ),
}


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------


def parse_tolerance(text: str) -> tuple[float, float]:
    """``(atol, rtol)`` from a file's tolerance text ("exact", "float32; atol 1e-5", "rel 1e-5", ...)."""
    atol = re.search(r"atol\s+([0-9.eE+-]+)", text)
    rtol = re.search(r"rel(?:ative)?\s+([0-9.eE+-]+)", text)
    if atol is None and rtol is None:
        assert text.startswith("exact"), f"unparsed tolerance {text!r}"
        return 0.0, 0.0
    return (float(atol.group(1)) if atol else 0.0), (float(rtol.group(1)) if rtol else 0.0)


def t32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def assert_close(actual, expected, tol, where=None):
    atol, rtol = tol
    a = torch.as_tensor(actual).detach().to(torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    if where is not None:
        a, e = a[where], e[where]
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


def mask_from_lengths(lengths, T) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def load(stem: str) -> dict:
    return json.loads((DATA_DIR / f"{stem}.json").read_text())


class IdTokenizer:
    """Decodes the conformance vocabulary: 198 -> '\\n', 271 -> '\\n\\n' (Qwen2 ids), anything else -> 'w'."""

    pieces = {198: "\n", 271: "\n\n"}

    def batch_decode(self, seqs):
        return ["".join(self.pieces.get(i, "w") for i in s) for s in seqs]


# ---------------------------------------------------------------------------------------------------------
# one handler per file: run the case, assert, return the set of output keys it checked
# ---------------------------------------------------------------------------------------------------------


def h_grpo_outcome_advantage(inp, out, tol):
    T = len(out["advantages"][0])
    mask = mask_from_lengths(inp["response_lengths"], T)
    # single_row_compat: the semantics' group of size 1 -> mean 0, std 1 (the library's default gives it 0)
    adv = F.grpo_advantages(
        t32(inp["scores"]), inp["uid"], scale_rewards=inp["norm_adv_by_std_in_grpo"], single_row_compat=True
    )
    assert_close(adv[:, None] * mask, out["advantages"], tol)
    return {"advantages"}


def h_implicit_prm_ce_loss(inp, out, tol):
    pol, ref = t32(inp["policy_logps_sum"])[:, None], t32(inp["reference_logps_sum"])[:, None]
    loss = F.implicit_prm_loss(pol, ref, torch.ones_like(pol), t32(inp["labels"]), beta=inp["beta"], loss_type="ce")
    assert_close(loss, out["loss"], tol)
    return {"loss"}


def _paired(inp):
    pc, pr = t32(inp["policy_chosen_logps"]), t32(inp["policy_rejected_logps"])
    rc, rr = t32(inp["reference_chosen_logps"]), t32(inp["reference_rejected_logps"])
    n = pc.shape[0]
    prm = torch.cat([pc, pr])[:, None]
    ref = torch.cat([rc, rr])[:, None]
    labels = torch.cat([torch.ones(n), torch.zeros(n)])
    pair_ids = torch.cat([torch.arange(n), torch.arange(n)])  # each (chosen, rejected) pair is a group
    return prm, ref, labels, pair_ids, n


def _check_chosen_rejected(prm, ref, n, beta, out, tol):
    r = F.implicit_token_rewards(prm, ref, torch.ones_like(prm), beta=beta).sum(-1)
    assert_close(r[:n], out["chosen_rewards"], tol)
    assert_close(r[n:], out["rejected_rewards"], tol)


def h_implicit_prm_dpo_loss(inp, out, tol):
    # label_smoothing_passed is ignored by the released loss; the library has no label smoothing.
    prm, ref, labels, pair_ids, n = _paired(inp)
    loss = F.implicit_prm_loss(
        prm, ref, torch.ones_like(prm), labels, beta=inp["beta"], loss_type="dpo", group_ids=pair_ids
    )
    assert_close(loss, out["loss"], tol)
    _check_chosen_rejected(prm, ref, n, inp["beta"], out, tol)
    return {"loss", "chosen_rewards", "rejected_rewards"}


def h_implicit_prm_kto_loss(inp, out, tol):
    prm, ref, labels, _, n = _paired(inp)
    loss = F.implicit_prm_loss(prm, ref, torch.ones_like(prm), labels, beta=inp["beta"], loss_type="kto")
    assert_close(loss, out["loss"], tol)
    _check_chosen_rejected(prm, ref, n, inp["beta"], out, tol)
    return {"loss", "chosen_rewards", "rejected_rewards"}


def h_implicit_prm_step_rewards_bon(inp, out, tol):
    pol, ref = t32(inp["policy_token_logps"]), t32(inp["ref_token_logps"])
    mask = torch.tensor(inp["label_mask"])[:, 1:].bool()  # raw_t uses label_mask[t+1]
    sp = torch.tensor(inp["special_tokens"])
    B, T = pol.shape
    ends = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for k in sp[b, 1:].tolist():  # ends of the prefixes with 1..K steps
            if k != -100:
                ends[b, k] = True
    checked = set()
    for ref_name, ref_lp in (("w_ref", ref), ("wo_ref", None)):
        tok = F.implicit_token_rewards(pol, ref_lp, mask, beta=inp["coef"])
        single, smask = F.step_rewards(tok, ends)
        accum, _ = F.step_rewards(tok, ends, cumulative=True)
        for kind, vals in (("single", single), ("accumulative", accum)):
            for how in ("min", "sum"):
                key = f"{ref_name}_{kind}_{how}"
                assert_close(F.aggregate_step_rewards(vals, smask, how=how), out[key], tol)
                checked.add(key)
        if ref_name == "w_ref":
            expected_mask = torch.tensor(out["w_ref_single_step_rewards"]) != 1000.0  # 1e3 = padded step
            assert torch.equal(smask, expected_mask)
            assert_close(single, out["w_ref_single_step_rewards"], tol, where=smask)
            assert_close(accum, out["w_ref_accumulative_step_values"], tol, where=smask)
            scores = F.aggregate_step_rewards(single, smask, how="min")
            assert int(torch.argmax(scores)) == out["bon_selected_position_w_ref_single_min"]  # first max wins
            checked |= {
                "w_ref_single_step_rewards",
                "w_ref_accumulative_step_values",
                "bon_selected_position_w_ref_single_min",
            }
    return checked


def h_prime_accuracy_filter_original(inp, out, tol):
    assert inp["filter_accuracy"]
    kwargs = {}
    if inp["filter_truncated"]:
        kwargs = dict(
            completion_lengths=torch.tensor(inp["response_lengths"]), max_completion_length=inp["max_response_length"]
        )
    keep = F.prompt_accuracy_mask(
        t32(inp["acc"]),
        inp["n_samples"],
        lower=inp["accuracy_lower_bound"],
        upper=inp["accuracy_upper_bound"],
        **kwargs,
    )
    assert keep.tolist() == out["keep_response_mask"]
    return {"keep_response_mask"}


def h_prime_accuracy_filter_verl(inp, out, tol):
    n = inp["n_samples"]
    keep = F.prompt_accuracy_mask(
        t32(inp["acc"]),
        n,
        lower=inp["accuracy_lower_bound"],
        upper=inp["accuracy_upper_bound"],
        completion_lengths=torch.tensor(inp["response_lengths"]),
        max_completion_length=inp["max_response_length"] - 1,
    )  # veRL: max < L - 1
    assert keep[::n].tolist() == out["prompt_passes_filter"]
    return {"prompt_passes_filter"}


def h_prime_ce_loss(inp, out, tol):
    q = t32(inp["q"])
    loss = F.implicit_prm_loss(
        q, torch.zeros_like(q), torch.tensor(inp["response_mask"]), t32(inp["acc"]), beta=inp["beta"], loss_type="ce"
    )
    assert_close(loss, out["loss"], tol)
    return {"loss"}


def h_prime_detach_dpo_loss(inp, out, tol):  # every case is in SKIPPED_CASES
    raise AssertionError("prime_detach_dpo_loss cases are deliberately skipped")


def _sequence_scores(inp):
    s = t32(inp["token_level_scores"])
    m = torch.tensor(inp["response_mask"])
    return (s * m).sum(-1)


def h_prime_dpo_abs_accuracy(inp, out, tol):
    acc = F.prm_abs_accuracy(_sequence_scores(inp), t32(inp["acc"]))
    assert_close(acc, out["dpo_acc_abs"], tol)
    return {"dpo_acc_abs"}


def h_prime_dpo_accuracy(inp, out, tol):
    acc = F.prm_pair_accuracy(_sequence_scores(inp), t32(inp["acc"]), inp["n_samples"])
    assert_close(acc, out["dpo_acc"], tol)
    return {"dpo_acc"}


def h_prime_masked_rloo(inp, out, tol):
    # masked_rloo is the per-token transform of rloo_advantages(baseline="reference"); gamma=0 makes the
    # "return" at t equal to the transformed value at t (no accumulation), and the outcome source is off.
    x = t32(inp["x"])
    mask = torch.tensor(inp["mask"]).bool()
    _, y = F.rloo_advantages(
        x, torch.zeros(x.shape[0]), mask, inp["n_samples"], baseline="reference", outcome_coef=0.0, gamma=0.0
    )
    assert_close(y, out["y"], tol)
    return {"y"}


def h_prime_rloo_advantage_verl(inp, out, tol):
    rm = t32(inp["rm_scores"])  # holds junk in padded positions: must be ignored
    mask = torch.tensor(inp["response_mask"]).bool()
    assert torch.equal(mask, mask_from_lengths(inp["response_lengths"], rm.shape[1]))
    adv, ret = F.rloo_advantages(
        rm,
        t32(inp["acc"]),
        mask,
        inp["n_samples"],
        process_coef=inp["reward_dpo_coef"],
        outcome_coef=inp["reward_gt_coef"],
        baseline="reference",
        whiten=True,
    )
    assert_close(ret, out["returns"], tol)
    # docs/conventions.md: values at padded positions are not part of the contract. The released code leaves (0-mean)/std there; the
    # library returns 0. Compare on the valid tokens and pin the library's padding value.
    assert_close(adv, out["advantages"], tol, where=mask)
    assert torch.all(adv[~mask] == 0)
    return {"advantages", "returns"}


def h_prime_rloo_returns_original(inp, out, tol):
    rm = t32(inp["rm_scores"])
    mask = torch.tensor(inp["response_mask"]).bool()
    acc = t32(inp["acc"])
    # gt_scores is acc placed at the last valid token: the library takes acc (B,) and places it itself.
    assert_close(t32(inp["gt_scores"]), F.last_token_mask(mask) * acc[:, None], (0.0, 0.0))
    adv, ret = F.rloo_advantages(
        rm,
        acc,
        mask,
        inp["n_samples"],
        gamma=inp["reward_model_gamma"],
        outcome_gamma=inp["verifier_gamma"],
        baseline="reference",
        whiten=True,
    )
    assert_close(ret, out["returns"], tol)
    assert_close(
        adv, out["advantages"], tol, where=mask
    )  # padded positions: not part of the contract (docs/conventions.md)
    return {"advantages", "returns"}


def _token_reward_inputs(inp):
    rm, ref = t32(inp["rm_log_probs"]), t32(inp["ref_log_probs"])
    mask = mask_from_lengths(inp["response_lengths"], rm.shape[1])
    return rm, ref, mask


def h_prime_token_reward_original(inp, out, tol):
    assert inp["granularity"] == "token"
    rm, ref, mask = _token_reward_inputs(inp)
    # original: q = rm - ref (no beta), last token included
    assert_close(
        F.implicit_token_rewards(rm, ref, mask, beta=1.0, include_last_token=True), out["token_level_score"], tol
    )
    assert_close(F.implicit_token_rewards(rm, ref, torch.ones_like(mask), beta=1.0), out["q_unmasked"], tol)
    return {"token_level_score", "q_unmasked"}


def h_prime_token_reward_verl(inp, out, tol):
    assert inp["granularity"] == "token" and inp["lambda"] == 0.0
    rm, ref, mask = _token_reward_inputs(inp)
    # veRL: beta_train * q, the last valid token left 0
    score = F.implicit_token_rewards(rm, ref, mask, beta=inp["beta_train"], include_last_token=False)
    assert_close(score, out["token_level_score"], tol)
    assert_close(F.implicit_token_rewards(rm, ref, mask, beta=1.0), out["q"], tol)
    return {"token_level_score", "q"}


def h_batch_norm_of_case0(extra, tol):
    y = F.process_reward_batch_norm(t32(extra["input"]))
    assert_close(y, extra["output"], tol)


def h_prl_advantage(inp, out, tol):
    T = len(out["advantages"][0])
    mask = mask_from_lengths(inp["response_lengths"], T)
    r = t32(inp["outcome_reward"])
    if inp["adv_estimator"] == "grpo":  # PRL block skipped: plain GRPO, outcome at the last token
        adv = F.grpo_advantages(r, inp["uid"], scale_rewards=inp["norm_adv_by_std_in_grpo"], single_row_compat=True)
        assert_close(adv[:, None] * mask, out["advantages"], tol)
        assert_close(F.last_token_mask(mask) * r[:, None], out["token_level_scores_before_fill"], tol)
        return {"advantages", "token_level_scores_before_fill"}
    assert inp["adv_estimator"] == "prm"
    responses = torch.tensor(inp["responses"])
    if inp["prm_adv"] == "orm":
        split = {"length": "length", "n": "newline", "nn": "double_newline"}[inp["step_split"]]
        step_ends = F.step_end_mask(
            responses, mask, IdTokenizer(), split=split, step_len=inp["step_len"] if split == "length" else None
        )
        # normalisation only when rollout_n > 1 (else the raw outcome, = process_first ordering)
        order = "advantage_first" if inp["rollout_n"] > 1 else "process_first"
    else:  # prm_adv == "prm": raw outcome, no segmentation
        step_ends, order = None, "process_first"
    adv, before_fill = F.prl_advantages(
        r,
        t32(inp["old_log_probs"]),
        t32(inp["ref_log_probs"]),
        mask,
        inp["uid"],
        eta=inp["eta"],
        step_ends=step_ends,
        order=order,
        scale_rewards=inp["norm_adv_by_std_in_grpo"],
        zero_fill_compat=True,
        return_step_end_values=True,
        single_row_compat=True,
    )
    assert_close(adv, out["advantages"], tol)
    assert_close(before_fill, out["token_level_scores_before_fill"], tol)
    return {"advantages", "token_level_scores_before_fill"}


def h_prl_left_fill_by_next_nonzero(inp, out, tol):
    assert_close(F.left_fill_by_next_nonzero(t32(inp["x"])), out["y"], tol)
    return {"y"}


def h_prof_consistency_score(inp, out, tol):
    s = t32(inp["step_scores"])
    smask = s != -99.0
    c, n = F.prof_consistency_scores(s, smask, center="batch")
    sign = 2 * t32(inp["final_rewards"]) - 1  # released scores are signed by correctness
    assert_close(c * sign, out["scores_ic"], tol)
    assert n.tolist() == out["len_segs"]
    return {"scores_ic", "len_segs"}


def _prof_inputs(inp):
    r = torch.tensor(inp["seq_reward"], dtype=torch.float64)
    signed = torch.tensor(inp["scores_ic"], dtype=torch.float64)
    unsigned = signed * (2 * r - 1)  # prof_select takes the unsigned consistency and signs it itself
    return r, unsigned, torch.tensor(inp["len_segs"])


def h_prof_filter_both(inp, out, tol):
    r, c, H = _prof_inputs(inp)
    kept = F.prof_select(
        inp["uid"], c, H, r, num_remove=inp["n_remove_per_group"], penalty=inp["len_step_reward_coef"], mode="both"
    )
    assert kept.tolist() == sorted(out["kept_indices"])  # library order: ascending row index
    return {"kept_indices"}


def h_prof_filter_correct(inp, out, tol):
    r, c, H = _prof_inputs(inp)
    kept = F.prof_select(
        inp["uid"],
        c,
        H,
        r,
        num_remove=inp["n_remove_per_group"],
        penalty=inp["len_step_reward_coef"],
        mode="correct",
        generator=torch.Generator().manual_seed(0),
    )
    kept_list = kept.tolist()
    assert [i for i in kept_list if r[i] == 1] == sorted(out["kept_positive_indices"])
    neg_counts = {}
    for i in kept_list:
        if r[i] == 0:
            neg_counts[inp["uid"][i]] = neg_counts.get(inp["uid"][i], 0) + 1
    for uid, count in out["kept_negative_count_per_group"].items():
        assert neg_counts.get(uid, 0) == count, uid
    return {"kept_positive_indices", "kept_negative_count_per_group"}


def h_prof_make_step_rewards(inp, out, tol):
    scores, smask = F.prof_step_scores_from_logits(
        t32(inp["logits"]), torch.tensor(inp["token_masks"]).bool(), inp["max_steps"], padding_value=-99.0
    )
    assert_close(scores, out["step_rewards"], tol)
    assert torch.equal(smask, torch.tensor(out["step_rewards"]) != -99.0)
    return {"step_rewards"}


def h_prof_prm_step_split(inp, out, tol):
    steps = F.split_steps(inp["response_text"])
    assert steps == out["steps"]
    assert F.join_steps(steps) == out["assistant_content"]
    return {"steps", "assistant_content"}


HANDLERS = {
    "grpo_outcome_advantage": h_grpo_outcome_advantage,
    "implicit_prm_ce_loss": h_implicit_prm_ce_loss,
    "implicit_prm_dpo_loss": h_implicit_prm_dpo_loss,
    "implicit_prm_kto_loss": h_implicit_prm_kto_loss,
    "implicit_prm_step_rewards_bon": h_implicit_prm_step_rewards_bon,
    "prime_accuracy_filter_original": h_prime_accuracy_filter_original,
    "prime_accuracy_filter_verl": h_prime_accuracy_filter_verl,
    "prime_ce_loss": h_prime_ce_loss,
    "prime_detach_dpo_loss": h_prime_detach_dpo_loss,
    "prime_dpo_abs_accuracy": h_prime_dpo_abs_accuracy,
    "prime_dpo_accuracy": h_prime_dpo_accuracy,
    "prime_masked_rloo": h_prime_masked_rloo,
    "prime_rloo_advantage_verl": h_prime_rloo_advantage_verl,
    "prime_rloo_returns_original": h_prime_rloo_returns_original,
    "prime_token_reward_original": h_prime_token_reward_original,
    "prime_token_reward_verl": h_prime_token_reward_verl,
    "prl_advantage": h_prl_advantage,
    "prl_left_fill_by_next_nonzero": h_prl_left_fill_by_next_nonzero,
    "prof_consistency_score": h_prof_consistency_score,
    "prof_filter_both": h_prof_filter_both,
    "prof_filter_correct": h_prof_filter_correct,
    "prof_make_step_rewards": h_prof_make_step_rewards,
    "prof_prm_step_split": h_prof_prm_step_split,
}
# top-level entries besides function/semantics/tolerance/cases
EXTRA_HANDLERS = {
    ("prime_token_reward_original", "batch_norm_of_case0"): h_batch_norm_of_case0,
    ("prime_token_reward_verl", "batch_norm_of_case0"): h_batch_norm_of_case0,
}


def _case_params():
    params = []
    for path in FILES:
        data = json.loads(path.read_text())
        for case in data["cases"]:
            params.append(pytest.param(path.stem, case["name"], id=f"{path.stem}::{case['name']}"))
    return params


def _extra_params():
    params = []
    for path in FILES:
        data = json.loads(path.read_text())
        for key in sorted(set(data) - META_KEYS):
            params.append(pytest.param(path.stem, key, id=f"{path.stem}::{key}"))
    return params


def test_conformance_files_present():
    assert len(FILES) >= 23, f"expected the shared conformance files in {DATA_DIR}"


def test_every_conformance_file_is_covered():
    """A new JSON file without a handler (or a handler without its file) fails here."""
    assert {p.stem for p in FILES} == set(HANDLERS)


def test_every_extra_entry_is_covered():
    present = {(p.stem, k) for p in FILES for k in set(json.loads(p.read_text())) - META_KEYS}
    assert present == set(EXTRA_HANDLERS)


def test_skip_lists_name_real_cases():
    present = {}
    for p in FILES:
        present[p.stem] = {c["name"]: c for c in json.loads(p.read_text())["cases"]}
    for stem, name in SKIPPED_CASES:
        assert name in present[stem], (stem, name)
    for stem, name, key in SKIPPED_OUTPUTS:
        assert key in present[stem][name]["outputs"], (stem, name, key)


@pytest.mark.parametrize("stem,name", _case_params())
def test_conformance_case(stem, name):
    if (stem, name) in SKIPPED_CASES:
        pytest.skip(f"deliberately not followed: {SKIPPED_CASES[(stem, name)]}")
    data = load(stem)
    case = next(c for c in data["cases"] if c["name"] == name)
    tol = parse_tolerance(data["tolerance"])
    checked = HANDLERS[stem](case["inputs"], case["outputs"], tol)
    skipped = {k for (s, n, k) in SKIPPED_OUTPUTS if (s, n) == (stem, name)}
    assert checked == set(case["outputs"]) - skipped, "every output must be checked or named as skipped"


@pytest.mark.parametrize("stem,name,key", [pytest.param(*k, id="::".join(k)) for k in sorted(SKIPPED_OUTPUTS)])
def test_conformance_output_deliberately_skipped(stem, name, key):
    pytest.skip(f"deliberately not followed: {SKIPPED_OUTPUTS[(stem, name, key)]}")


@pytest.mark.parametrize("stem,key", _extra_params())
def test_conformance_extra_entry(stem, key):
    data = load(stem)
    EXTRA_HANDLERS[(stem, key)](data[key], parse_tolerance(data["tolerance"]))
