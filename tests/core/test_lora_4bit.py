"""LoRA on a 4-bit (bitsandbytes NF4) base, on CPU: PRIME with the policy and the implicit PRM as two adapters on one
quantised base (reference = adapters disabled), PRL with its adapter, and ``recipes/prime_lora.py --load_in_4bit
true``.

Each run checks that the base really is 4-bit (every decoder ``Linear`` a ``bnb.nn.Linear4bit`` holding packed uint8
NF4 weights), that the adapters train (finite metrics, non-zero gradient norms, changed LoRA weights), that the base
(packed weights and quantisation state) is bit-identical after training, and that a run resumed from a checkpoint ends
bit-identical to the uninterrupted run (policy and PRM adapters, PRM optimizer state, logged metrics).

Compute dtype float32: a CPU has no fast bf16 matmul; on a GPU the recipe uses ``dtype: bfloat16`` (see the docs).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import tiny_kwargs


bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (`pip install -e .[dev]`)")

from peft import LoraConfig  # noqa: E402
from tiny import tiny_prompt_dataset  # noqa: E402
from transformers import BitsAndBytesConfig  # noqa: E402

from trl_prime import PrimeRLOOConfig, PrimeRLOOTrainer, PRLConfig, PRLGRPOTrainer  # noqa: E402
from trl_prime.modeling import unwrap  # noqa: E402


K = 4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_4bit"), arch="llama", seed=1)


def alternating_reward(completions, prompts, **kwargs):
    """Groups alternate between all 1.0 (dropped by PRIME's 0.2-0.8 filter) and 1, 0, 1, 0 (kept)."""
    return [1.0 if (i // K) % 2 == 0 else float(i % 2 == 0) for i in range(len(prompts))]


def _kwargs(out, **overrides) -> dict:
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    four_bit = dict(max_completion_length=10, max_steps=3, save_strategy="steps", save_steps=2)
    four_bit.update(model_init_kwargs=dict(quantization_config=quant, dtype=torch.float32))
    return tiny_kwargs(out, **{"output_dir": str(out), **four_bit, **overrides})


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _check_4bit(model) -> None:
    """Every decoder projection is a bnb Linear4bit with packed uint8 NF4 weights (under LoRA: its base layer)."""
    layers = [getattr(m, "base_layer", m) for n, m in unwrap(model).named_modules() if n.split(".")[-1] in PROJECTIONS]
    assert len(layers) == 2 * len(PROJECTIONS)  # 2 decoder layers
    for layer in layers:
        assert isinstance(layer, bnb.nn.Linear4bit), type(layer)
        assert layer.weight.dtype == torch.uint8 and layer.weight.quant_state.quant_type == "nf4"
        assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


def _base(model) -> dict:
    """The base's state: packed 4-bit weights, their quantisation state (absmax, quant_map, ...), the rest."""
    state = {k: v.detach().clone() for k, v in unwrap(model).state_dict().items() if "lora_" not in k}
    assert any(k.endswith("weight.absmax") for k in state) and any(v.dtype == torch.uint8 for v in state.values())
    return state


def _adapter(model, name: str) -> dict:
    return {k: p.detach().clone() for k, p in unwrap(model).named_parameters() if "lora_" in k and f".{name}." in k}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(trainer) -> dict:
    return {
        h["step"]: {k: v for k, v in h.items() if "time" not in k and "per_second" not in k}
        for h in trainer.state.log_history
        if "loss" in h and "train_runtime" not in h
    }


def _check_trained(trainer, before_base, before, adapters, metrics) -> None:
    rows = _rows(trainer)
    assert sorted(rows) == [1, 2, 3]
    for step, row in rows.items():
        for k in ("loss", "grad_norm", *metrics):
            assert math.isfinite(row[k]), (step, k, row[k])
        # the policy's gradient reaches its adapter through the 4-bit layers (0 if bitsandbytes' CPU inference
        # repacking kicks in after the first generation: trl_prime.guards.keep_4bit_layers_differentiable)
        assert row["grad_norm"] > 0, (step, row["grad_norm"])
    for name in adapters:
        now = _adapter(trainer.model, name)
        changed = [k for k in now if not torch.equal(now[k], before[name][k])]
        assert set(changed) == set(now), f"adapter {name!r}: unchanged {set(now) - set(changed)}"
    assert _same(_base(trainer.model), before_base)  # the quantised base never moves
    _check_4bit(trainer.model)


def _check_resume(make, full, tmp_path) -> None:
    """A run resumed from the full run's checkpoint-2 ends bit-identical to it (adapters, base, metrics of step 3)."""
    checkpoint = os.path.join(full.args.output_dir, "checkpoint-2")
    assert os.path.isdir(checkpoint)
    resumed = make(tmp_path / "resumed")
    fresh = {k: v.detach().clone() for k, v in unwrap(resumed.model).state_dict().items()}
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 3
    # the resumed adapters keep their dtypes (TRL's QLoRA cast of the policy adapter to bfloat16 included)
    assert {n: p.dtype for n, p in resumed.model.named_parameters()} == {
        n: p.dtype for n, p in full.model.named_parameters()
    }
    final = {k: v.detach().clone() for k, v in unwrap(resumed.model).state_dict().items()}
    assert _same(final, {k: v.detach().clone() for k, v in unwrap(full.model).state_dict().items()})
    assert not _same(final, fresh)
    assert _rows(resumed)[3] == _rows(full)[3]


def test_prime_policy_and_prm_adapters_on_a_4bit_base(llama_path, tmp_path):
    """PRIME-RLOO, PEFT on an NF4 base: adapters 'default' (policy) and 'prm' train, the base does not, step 1's
    token rewards are exactly 0 (PRM == its adapters-disabled reference), and resume from checkpoint-2 is exact
    (PRM adapter and PRM optimizer restored: a fresh PRM optimizer would step differently at step 3)."""

    def make(out):
        return PrimeRLOOTrainer(
            model=llama_path,
            reward_funcs=alternating_reward,
            train_dataset=tiny_prompt_dataset(8),
            args=PrimeRLOOConfig(**_kwargs(out, prm_learning_rate=1e-2)),
            peft_config=LoraConfig(**LORA),
        )

    full = make(tmp_path / "full")
    _check_4bit(full.model)
    assert full.implicit_prm.adapter_name == "prm" and full.implicit_prm.reference == "adapters_disabled"
    assert full.prm_model is unwrap(full.model)  # one 4-bit base for policy, PRM and reference
    before_base = _base(full.model)
    before = {a: _adapter(full.model, a) for a in ("default", "prm")}
    full.train()
    _check_trained(
        full, before_base, before, ("default", "prm"), ("prm/loss", "prm/grad_norm", "prm/token_reward_std")
    )
    rows = _rows(full)
    assert rows[1]["prm/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[1]["prm/token_reward_min"] == rows[1]["prm/token_reward_max"] == 0.0
    assert all(rows[s]["prm/grad_norm"] > 0 for s in rows) and rows[3]["prm/token_reward_std"] > 0
    prm_dir = os.path.join(full.args.output_dir, "checkpoint-2", "prm")
    assert {"adapter_model.safetensors", "optimizer.pt", "implicit_prm_config.json"} <= set(os.listdir(prm_dir))

    resumed = make(tmp_path / "resumed")
    _check_resume(lambda out: resumed, full, tmp_path)
    assert resumed.prm_optim.num_updates == full.prm_optim.num_updates == 3

    def adam(opt):
        return [(s["exp_avg"], s["exp_avg_sq"]) for s in (opt.state[p] for g in opt.param_groups for p in g["params"])]

    assert all(
        torch.equal(x, y) for a, b in zip(adam(full.prm_optimizer), adam(resumed.prm_optimizer)) for x, y in zip(a, b)
    )


def test_prl_adapter_on_a_4bit_base(llama_path, tmp_path):
    """PRL-GRPO, PEFT on an NF4 base: the policy adapter trains against the base with adapters disabled (k_t = 0 at
    step 1), the base does not move, and resume from checkpoint-2 is exact."""

    def make(out):
        return PRLGRPOTrainer(
            model=llama_path,
            reward_funcs=alternating_reward,
            train_dataset=tiny_prompt_dataset(8),
            args=PRLConfig(**_kwargs(out, prl_eta=2.0, prl_step_split="length", prl_step_len=3, learning_rate=1e-2)),
            peft_config=LoraConfig(**LORA),
        )

    full = make(tmp_path / "full")
    _check_4bit(full.model)
    assert full.prl_reference == "adapters_disabled" and full.prl_ref_model is None
    before_base = _base(full.model)
    before = {"default": _adapter(full.model, "default")}
    full.train()
    _check_trained(full, before_base, before, ("default",), ("prl/kl_to_go_mean", "prl/sign_flip_fraction"))
    rows = _rows(full)
    assert rows[1]["prl/kl_to_go_min"] == rows[1]["prl/kl_to_go_max"] == 0.0  # policy == reference at step 1
    assert rows[3]["prl/kl_to_go_max"] > 0
    _check_resume(make, full, tmp_path)


def test_prime_lora_recipe_with_load_in_4bit_on_cpu(tmp_path):
    """``recipes/prime_lora.py --load_in_4bit true --use_cpu true`` (its YAML: LoRA on every projection, PRM adapter,
    prm_update double): the base loads as NF4 on the CPU, both adapters train for two PRIME steps on mixed math/code
    rows, the quantised base is bit-identical to a fresh NF4 load of the model, and both adapters are saved."""
    from tiny_recipes import build_coin_model, check_prime_logs, load_recipe, recipe_overrides, write_eurus_jsonl
    from transformers import AutoModelForCausalLM

    from trl_prime.scripts import prime

    data_path = write_eurus_jsonl(tmp_path / "train.jsonl")
    model_path = build_coin_model(tmp_path / "coin_model", data_path)
    mod = load_recipe("prime_lora")
    out = str(tmp_path / "lora4")
    data, args, model_args = prime.parse_args(
        [*recipe_overrides(model_path, data_path, out, batch=8), "--load_in_4bit", "true"], mod.DEFAULT_CONFIG
    )
    assert model_args.load_in_4bit and model_args.bnb_4bit_quant_type == "nf4"
    trainer = prime.main(data, args, model_args, require_peft=True)
    assert trainer.state.global_step == 2 and trainer.prm_optim.num_updates == 2
    check_prime_logs([h for h in trainer.state.log_history if "prm/loss" in h], prm_lr=1e-5)
    assert all(h["grad_norm"] > 0 for h in trainer.state.log_history if "prm/loss" in h)
    _check_4bit(trainer.model)
    peft_model = unwrap(trainer.model)
    assert unwrap(trainer.implicit_prm.model) is peft_model and trainer.implicit_prm.ref_model is None
    for adapter in ("default", "prm"):
        b = [p for n, p in peft_model.named_parameters() if f"lora_B.{adapter}." in n]
        assert len(b) == 2 * len(PROJECTIONS) and all(p.abs().sum() > 0 for p in b), adapter
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quant, device_map={"": "cpu"})
    expected = fresh.state_dict()
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in _base(peft_model).items()}
    assert base.keys() == expected.keys() and all(torch.equal(base[k], expected[k]) for k in base)
    for folder in (out, os.path.join(out, "prm")):
        assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))
