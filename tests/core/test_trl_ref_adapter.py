"""TRL's KL reference for a ready-made PeftModel (issue 26 item 5), single process on CPU.

Given a PeftModel holding a trained adapter ``"default"`` and ``beta > 0``, TRL adds an adapter ``"ref"`` and copies
the parameters whose names contain ``".default."`` into it. IA3's names end in ``".default"``, so TRL's copy misses
them and its reference is the base model: the KL would pull the policy toward the base, not the SFT adapter. Every
trainer built on TRL's GRPO / RLOO (PRIME-RLOO, PRIME-GRPO, PRL, PROF) re-copies ``"default"`` into ``"ref"`` through
PEFT's tuner layers (:func:`trl_prime.modeling.sync_trl_ref_adapter`). LoRA (names ``...lora_A.default.weight``)
was right before and stays right.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_kwargs, tiny_trainer
from tiny import contains_reward, tiny_prompt_dataset

from trl_prime.modeling import adapter_parameters, reference_logps, sync_trl_ref_adapter, unwrap


K = 4


@pytest.fixture(scope="module")
def tiny_step_prm(tmp_path_factory):
    from tiny_prm import build_tiny_step_prm

    return build_tiny_step_prm(tmp_path_factory.mktemp("ref_adapter_step_prm"))


def _trained_peft_model(path: str, kind: str):
    """A PeftModel whose adapter "default" is away from its identity init, as an SFT adapter is (seeded)."""
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = IA3Config(task_type="CAUSAL_LM") if kind == "ia3" else LoraConfig(task_type="CAUSAL_LM", r=4)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in adapter_parameters(model, "default"):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.5 * noise if kind == "ia3" else 0.3 * noise)  # IA3 init: ones; LoRA's B init: zeros
    return model


def _build(which: str, model, tmp_path, step_prm):
    # TRL's KL to its reference is on (beta): TRL adds the "ref" adapter; logging and learning rates: the configs'
    kw = tiny_kwargs(tmp_path, drop=("logging_steps", "learning_rate"), beta=0.04)
    common = dict(model=model, reward_funcs=contains_reward("e"), train_dataset=tiny_prompt_dataset(8))
    return tiny_trainer(which, kw, prof_prm=step_prm, **common)


@pytest.mark.parametrize(
    "which, kind, arch",
    [
        ("prime_rloo", "ia3", "qwen2"),
        ("prime_rloo", "lora", "qwen2"),
        ("prime_grpo", "ia3", "llama"),
        ("prime_grpo", "lora", "llama"),
        ("prl", "ia3", "qwen2"),
        ("prl", "lora", "qwen2"),
        ("prof", "ia3", "qwen2"),
    ],
)
def test_trl_reference_adapter_is_the_sft_adapter(
    which, kind, arch, tiny_model_path, tiny_llama_path, tiny_step_prm, tmp_path
):
    model = _trained_peft_model(tiny_llama_path if arch == "llama" else tiny_model_path, kind)
    sft = [p.detach().clone() for _, p in adapter_parameters(model, "default")]
    tr = _build(which, model, tmp_path, tiny_step_prm)
    peft_model = unwrap(tr.model)
    assert "ref" in peft_model.peft_config  # TRL made its reference adapter (beta > 0)
    default = adapter_parameters(peft_model, "default")
    ref = adapter_parameters(peft_model, "ref")
    assert len(ref) == len(default) == len(sft) > 0
    if kind == "ia3":
        assert all(n.endswith(".ia3_l.ref") for n, _ in ref)  # no ".ref." in IA3's names: TRL's copy missed them
    for (_, d), (_, q), s in zip(default, ref, sft):
        assert torch.equal(d, s)  # the policy still holds the SFT adapter
        assert torch.equal(q, d)  # TRL's reference is exactly that adapter
        assert not q.requires_grad  # and frozen: the policy's optimizer never sees it
    # the log-probs TRL's KL uses ("ref" active) are the SFT adapter's, not the base model's
    tok = tr.processing_class
    ids = tok(["What is 1 + 1? The answer is 2 and it is even."], return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    T = ids.size(1) - 2
    ref_lp = reference_logps(tr, ids, mask, T, adapter_name="ref")
    sft_lp = reference_logps(tr, ids, mask, T, adapter_name="default")
    base_lp = reference_logps(tr, ids, mask, T, adapter_name=None)
    torch.testing.assert_close(ref_lp, sft_lp, rtol=0.0, atol=1e-6)
    assert (ref_lp - base_lp).abs().max().item() > 1e-2


def test_sync_trl_ref_adapter_only_for_a_pretrained_adapter(tiny_model_path):
    """No "ref" adapter, or an adapter TRL did not copy from a PeftModel given to it (``peft_config``): nothing to do;
    a "ref" adapter with IA3's identity init next to a trained "default" is overwritten by "default"."""
    from transformers import AutoModelForCausalLM

    model = _trained_peft_model(tiny_model_path, "ia3")
    assert sync_trl_ref_adapter(model, pretrained_adapter=True) is False  # no "ref" adapter
    model.add_adapter("ref", model.peft_config["default"])  # what TRL does
    ref = adapter_parameters(model, "ref")
    assert all(torch.equal(p, torch.ones_like(p)) for _, p in ref)  # IA3's init: the base model
    assert sync_trl_ref_adapter(model, pretrained_adapter=False) is False
    assert all(torch.equal(p, torch.ones_like(p)) for _, p in ref)
    assert sync_trl_ref_adapter(model, pretrained_adapter=True) is True
    assert all(torch.equal(q, d) for (_, q), (_, d) in zip(ref, adapter_parameters(model, "default")))
    assert not any(torch.equal(q, torch.ones_like(q)) for _, q in ref)
    assert (
        sync_trl_ref_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_path), pretrained_adapter=True) is False
    )
