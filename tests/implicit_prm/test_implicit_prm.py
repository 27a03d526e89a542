"""ImplicitPRM: token/sequence/step rewards, padding invariance, eval-mode scoring, best-of-N, save/load, PEFT."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import naive_logps

from trl_prime import ImplicitPRM
from trl_prime import functional as F
from trl_prime.modeling import completion_logps, has_fused_head


PROMPTS = ["What is 2 + 3?", [{"role": "user", "content": "Compute 7 * 6."}], "Let x be 4."]
COMPLETIONS = [
    "First, add.\n\nThe answer is 5.",
    "Step one: 7 * 6 = 42.\n\nSo the answer is \\boxed{42}.",
    "x + 4 = 9",
]


def _load(path, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, **kw), AutoTokenizer.from_pretrained(path)


def _perturb(model, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def prm_pair(tiny_model_path):
    """(ImplicitPRM with a perturbed PRM and the original as reference, tokenizer)."""
    prm, tok = _load(tiny_model_path)
    ref, _ = _load(tiny_model_path)
    _perturb(prm)
    return ImplicitPRM(prm, ref, beta=0.05, tokenizer=tok), tok


def test_identical_models_give_exactly_zero_rewards_even_with_dropout(tiny_llama_path):
    prm, tok = _load(tiny_llama_path)
    ref, _ = _load(tiny_llama_path)
    assert prm.config.attention_dropout == 0.1
    prm.train()  # dropout on: scoring must switch it off and restore the mode afterwards
    iprm = ImplicitPRM(prm, ref, tokenizer=tok)
    enc = iprm.encode(PROMPTS, COMPLETIONS)
    r = iprm.token_rewards(enc["input_ids"], enc["attention_mask"], enc["completion_mask"])
    assert r.shape == enc["completion_mask"].shape
    assert torch.equal(r, torch.zeros_like(r))
    assert prm.training and all(m.training for m in prm.modules())
    assert iprm.score(PROMPTS, COMPLETIONS) == [0.0, 0.0, 0.0]


def test_token_rewards_match_naive_unpadded_rows(prm_pair):
    iprm, _ = prm_pair
    enc = iprm.encode(PROMPTS, COMPLETIONS)
    ids, am, cm = enc["input_ids"], enc["attention_mask"], enc["completion_mask"]
    T = cm.size(1)
    assert (am[:, 0] == 0).any() and (cm[:, -1] == 0).any()  # both paddings present
    r = iprm.token_rewards(ids, am, cm)
    expected = 0.05 * (naive_logps(iprm.model, ids, am, T) - naive_logps(iprm.ref_model, ids, am, T)) * cm
    torch.testing.assert_close(r, expected, atol=2e-6, rtol=1e-4)
    assert r.abs().max() > 1e-3  # the perturbed PRM differs from its reference
    # batched left-padded scoring == row-by-row scoring without any padding
    for i in range(len(PROMPTS)):
        one = iprm.encode(PROMPTS[i : i + 1], COMPLETIONS[i : i + 1])
        ri = iprm.token_rewards(one["input_ids"], one["attention_mask"], one["completion_mask"])
        n = int(one["completion_mask"].sum())
        torch.testing.assert_close(r[i, :n], ri[0, :n], atol=1e-6, rtol=1e-5)
        assert torch.all(r[i, n:] == 0)


def test_fused_head_and_logits_path_agree(prm_pair, tiny_model_path):
    iprm, _ = prm_pair
    assert has_fused_head(iprm.model) and has_fused_head(iprm.ref_model)
    plain, _ = _load(tiny_model_path)
    _perturb(plain)  # same perturbation, no fused head
    assert not has_fused_head(plain)
    enc = iprm.encode(PROMPTS, COMPLETIONS)
    T = enc["completion_mask"].size(1)
    with torch.no_grad():
        fused = completion_logps(iprm.model, enc["input_ids"], enc["attention_mask"], T, micro_batch_size=2)
        logits = completion_logps(plain, enc["input_ids"], enc["attention_mask"], T)
    m = enc["completion_mask"].bool()
    torch.testing.assert_close(fused[m], logits[m], atol=1e-5, rtol=1e-5)


def test_sequence_and_step_rewards_and_best_of_n(prm_pair):
    iprm, tok = prm_pair
    enc = iprm.encode(PROMPTS, COMPLETIONS)
    ids, am, cm = enc["input_ids"], enc["attention_mask"], enc["completion_mask"]
    T = cm.size(1)
    tok_r = iprm.token_rewards(ids, am, cm)
    seq = iprm.sequence_rewards(ids, am, cm)
    torch.testing.assert_close(seq, tok_r.sum(-1))
    # steps end on the token that carries the last "\n" of each "\n\n", and on the last token
    ends = F.step_end_mask(enc["completion_ids"], cm, tok, delimiter="\n\n")
    for i, text in enumerate(COMPLETIONS):
        n = int(cm[i].sum())
        assert ends[i, n - 1] and int(ends[i].sum()) == text.count("\n\n") + 1
        e = int(ends[i].nonzero()[0])
        prefix = tok.decode(enc["completion_ids"][i, : e + 1])
        if "\n\n" in text:
            assert prefix.endswith("\n\n") or "\n\n" in prefix
            assert "\n\n" not in tok.decode(enc["completion_ids"][i, :e])
    values, smask = iprm.step_rewards(ids, am, cm)
    torch.testing.assert_close((values * smask).sum(-1), seq, atol=1e-6, rtol=1e-5)
    assert smask.sum(-1).tolist() == [t.count("\n\n") + 1 for t in COMPLETIONS]
    # best-of-N scores: min over steps by default; the other aggregations; without reference
    s_min = iprm.score(PROMPTS, COMPLETIONS)
    expected_min = [float(values[i][smask[i]].min()) for i in range(3)]
    assert s_min == pytest.approx(expected_min, abs=1e-6)
    assert iprm.score(PROMPTS, COMPLETIONS, aggregation="sum") == pytest.approx(seq.tolist(), abs=1e-6)
    last = [float(values[i][smask[i]][-1]) for i in range(3)]
    assert iprm.score(PROMPTS, COMPLETIONS, aggregation="last") == pytest.approx(last, abs=1e-6)
    no_ref = iprm.score(PROMPTS, COMPLETIONS, with_reference=False, aggregation="sum")
    lp = iprm.prm_logps(ids, am, T)
    assert no_ref == pytest.approx((0.05 * lp * cm).sum(-1).tolist(), abs=1e-5)
    # fixed-length steps
    v4, m4 = iprm.step_rewards(ids, am, cm, step_len=4)
    assert m4.sum(-1).tolist() == [-(-int(n) // 4) for n in cm.sum(-1)]
    with pytest.raises(
        ValueError, match="aggregation='max' is not supported; choose one of 'min', 'mean', 'sum', 'last'"
    ):
        iprm.score(PROMPTS, COMPLETIONS, aggregation="max")


def test_save_and_reload_scores_identically(prm_pair, tmp_path):
    iprm, _ = prm_pair
    iprm.save_pretrained(tmp_path / "prm")
    files = set(os.listdir(tmp_path / "prm"))
    assert {"config.json", "model.safetensors", "implicit_prm_config.json", "reference", "tokenizer.json"} <= files
    cfg = json.load(open(tmp_path / "prm" / "implicit_prm_config.json"))
    assert cfg["beta"] == 0.05 and cfg["reference"] == "model"
    loaded = ImplicitPRM.from_pretrained(tmp_path / "prm")
    assert loaded.beta == 0.05 and loaded.reference == "model"
    assert loaded.score(PROMPTS, COMPLETIONS) == iprm.score(PROMPTS, COMPLETIONS)
    assert loaded.score(PROMPTS, COMPLETIONS, aggregation="mean") == iprm.score(
        PROMPTS, COMPLETIONS, aggregation="mean"
    )
    # overriding beta rescales every reward linearly
    twice = ImplicitPRM.from_pretrained(tmp_path / "prm", beta=0.1)
    assert twice.score(PROMPTS, COMPLETIONS, aggregation="sum") == pytest.approx(
        [2 * s for s in iprm.score(PROMPTS, COMPLETIONS, aggregation="sum")], rel=1e-5
    )
    # without the reference folder, the reference is reloaded from the path it came from (recorded in the json)
    iprm.save_pretrained(tmp_path / "noref", save_reference=False)
    assert "reference" not in os.listdir(tmp_path / "noref")
    assert ImplicitPRM.from_pretrained(tmp_path / "noref").score(PROMPTS, COMPLETIONS) == iprm.score(
        PROMPTS, COMPLETIONS
    )
    # ... and when that path is gone too, loading fails with a message naming the fix
    cfg_file = tmp_path / "noref" / "implicit_prm_config.json"
    cfg = json.load(open(cfg_file))
    cfg["ref_name_or_path"] = str(tmp_path / "gone")
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(ValueError, match="ref_model"):
        ImplicitPRM.from_pretrained(tmp_path / "noref")
    loaded2 = ImplicitPRM.from_pretrained(tmp_path / "noref", ref_model=str(tmp_path / "prm" / "reference"))
    assert loaded2.score(PROMPTS, COMPLETIONS) == iprm.score(PROMPTS, COMPLETIONS)


def test_external_reference_and_errors(tiny_model_path):
    prm, tok = _load(tiny_model_path)
    iprm = ImplicitPRM(prm, None, tokenizer=tok)
    assert iprm.reference == "external"
    enc = iprm.encode(PROMPTS, COMPLETIONS)
    T = enc["completion_mask"].size(1)
    with pytest.raises(ValueError, match="ref_logps"):
        iprm.token_rewards(enc["input_ids"], enc["attention_mask"], enc["completion_mask"])
    ref = iprm.prm_logps(enc["input_ids"], enc["attention_mask"], T) - 1.0
    r = iprm.token_rewards(enc["input_ids"], enc["attention_mask"], enc["completion_mask"], ref_logps=ref)
    torch.testing.assert_close(r, 0.05 * enc["completion_mask"].float(), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="beta"):
        ImplicitPRM(prm, None, beta=0.0)
    with pytest.raises(ValueError, match="PeftModel"):
        ImplicitPRM(prm, None, adapter_name="prm")


def test_peft_adapter_prm_with_disabled_adapter_reference(tiny_model_path, tmp_path):
    from peft import LoraConfig, get_peft_model

    base, tok = _load(tiny_model_path)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    model.add_adapter("prm", cfg)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    iprm = ImplicitPRM(model, None, tokenizer=tok, adapter_name="prm")
    assert iprm.reference == "adapters_disabled"
    enc = iprm.encode(PROMPTS, COMPLETIONS)
    args = (enc["input_ids"], enc["attention_mask"], enc["completion_mask"])
    assert torch.equal(iprm.token_rewards(*args), torch.zeros_like(enc["completion_mask"], dtype=torch.float))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".prm." in n and "lora_B" in n:
                p.normal_(0, 0.5)
    r = iprm.token_rewards(*args)
    assert r.abs().max() > 1e-4
    # the policy adapter "default" is untouched by PRM scoring; grads flow into "prm" only
    T = enc["completion_mask"].size(1)
    with iprm.prm_context(
        trainable=True
    ):  # forward and backward inside: PEFT's requires_grad flags are restored after
        lp = completion_logps(iprm.model, enc["input_ids"], enc["attention_mask"], T)
        (lp * enc["completion_mask"]).sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".prm." in n for n in grads)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert model.active_adapter == "default"
    # save / reload the adapter PRM
    iprm.save_pretrained(tmp_path / "peft_prm")
    loaded = ImplicitPRM.from_pretrained(tmp_path / "peft_prm")
    assert loaded.adapter_name == "prm" and loaded.reference == "adapters_disabled"
    assert loaded.score(PROMPTS, COMPLETIONS) == pytest.approx(iprm.score(PROMPTS, COMPLETIONS), abs=1e-7)
