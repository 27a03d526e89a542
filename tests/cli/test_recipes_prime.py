"""The PRIME recipes, run as a user runs them: ``recipes/prime_qwen7b.py`` with its real YAML (the paper's setup)
and ``recipes/prime_lora.py`` (policy and PRM as two LoRA adapters on one base). Both are ``trl-prime prime``
(:mod:`trl_prime.scripts.prime`) with their own YAML as the default ``--config``.

Only what a CPU needs is overridden: model and data (a tiny offline model, a few Eurus-2-RL-Data rows), steps, batch
and lengths, ``use_vllm``/``bf16``/``gradient_checkpointing`` off, ``use_cpu``. Everything else (K=4, filter 0.2-0.8,
the released code's advantage options, learning rates, PRM beta) comes from the YAML, and the tests check it did.

The tiny model is first taught (a few seconds of SFT on the rows' own prompts) to answer every prompt with
``\\boxed{d}`` and a ``print(d)`` program, d = 1 or 2 at even odds: math rows (gold 1) and code rows (tests expect
1) are then right half of the time, so groups of 4 pass the 0.2-0.8 filter, the PRM sees both labels, and both
verifiers (math_reward and code_reward, routed by each row's ability) score real completions.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from helpers import ROOT, SCRIPTS, launch_argv, run_launched
from tiny_recipes import RECIPES, build_coin_model, check_prime_logs, load_recipe, recipe_overrides, write_eurus_jsonl

from trl_prime.scripts import prime
from trl_prime.scripts.utils import normalize_argv


LAUNCHER = os.path.join(SCRIPTS, "recipe_launch.py")


def _weights(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def eurus_jsonl(tmp_path_factory) -> str:
    return write_eurus_jsonl(tmp_path_factory.mktemp("eurus") / "train.jsonl")


@pytest.fixture(scope="module")
def coin_model(tmp_path_factory, eurus_jsonl) -> str:
    return build_coin_model(tmp_path_factory.mktemp("coin_model"), eurus_jsonl)


# the YAML's values the tests check survived the overrides (PRIME arXiv 2502.01456, section 4.1 and Table 5, and the released code's options)
PAPER_OPTIONS = {
    "num_generations": 4,
    "filter_lower": 0.2,
    "filter_upper": 0.8,
    "prm_beta": 0.05,
    "prm_learning_rate": 1e-6,
    "learning_rate": 5e-7,
    "prm_update": "double",
    "prime_baseline": "reference",
    "process_reward_norm": "batch_norm",
    "process_coef": 5.0,
    "outcome_coef": 5.0,
    "whiten_advantages": True,
    "include_last_token": False,
    "beta": 0.0,
    "epsilon": 0.2,
    "num_iterations": 1,
    "vllm_mode": "colocate",
}


def _check_saved(out: str, model: str) -> None:
    """Policy and PRM saved, both trained; the PRM reference saved unchanged (= the initial SFT weights)."""
    init = _weights(os.path.join(model, "model.safetensors"))
    policy = _weights(os.path.join(out, "model.safetensors"))
    prm = _weights(os.path.join(out, "prm", "model.safetensors"))
    ref = _weights(os.path.join(out, "prm", "reference", "model.safetensors"))
    assert os.path.isfile(os.path.join(out, "prm", "implicit_prm_config.json"))
    with open(os.path.join(out, "prm", "implicit_prm_config.json")) as f:
        assert json.load(f)["beta"] == pytest.approx(0.05)
    assert _same(ref, init)
    assert not _same(prm, init) and not _same(policy, init) and not _same(prm, policy)


# ----------------------------------------------------------------------------------------------------- CLI / YAML
def test_without_config_the_recipes_read_their_own_yaml():
    for name in ("prime_qwen7b", "prime_lora"):
        mod = load_recipe(name)
        yaml_path = os.path.join(RECIPES, "configs", f"{name}.yaml")
        assert os.path.samefile(mod.DEFAULT_CONFIG, yaml_path)
        assert normalize_argv(["--max_steps", "3"], mod.DEFAULT_CONFIG) == [
            "--config",
            mod.DEFAULT_CONFIG,
            "--max_steps",
            "3",
        ]
        assert normalize_argv(["--config", "x.yaml"], mod.DEFAULT_CONFIG) == ["--config", "x.yaml"]
        # `--config=<path>` names a config too (split in two: TrlParser only knows `--config <path>`)
        assert normalize_argv(["--config=x.yaml", "--seed", "1"], mod.DEFAULT_CONFIG) == [
            "--config",
            "x.yaml",
            "--seed",
            "1",
        ]


def test_prime_qwen7b_yaml_is_the_papers_setup(tmp_path):
    import yaml

    with open(os.path.join(RECIPES, "configs", "prime_qwen7b.yaml")) as f:
        raw = yaml.safe_load(f)
    # GPU-only keys (a CPU cannot parse bf16=True): checked in the file
    assert (raw["bf16"], raw["use_vllm"], raw["vllm_mode"], raw["dtype"]) == (True, True, "colocate", "bfloat16")
    mod = load_recipe("prime_qwen7b")
    data, args, model = prime.parse_args(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"], mod.DEFAULT_CONFIG
    )
    assert data.trainer == raw["trainer"] == "prime_rloo" and type(args).__name__ == "PrimeRLOOConfig"
    assert model.model_name_or_path == "PRIME-RL/Eurus-2-7B-SFT" and args.prm_model is None
    assert data.dataset_name == ["PRIME-RL/Eurus-2-RL-Data"] and data.reward == "outcome"
    for k, v in PAPER_OPTIONS.items():
        assert getattr(args, k) == pytest.approx(v) if isinstance(v, float) else getattr(args, k) == v, k
    assert (args.max_completion_length, args.prm_reference, args.prm_loss, args.prime_estimator) == (
        3072,
        "sft",
        "ce",
        "rloo",
    )
    # `--config=<path>` is understood too, not rejected as an unknown argument
    _, args_eq, _ = prime.parse_args(
        [f"--config={mod.DEFAULT_CONFIG}", "--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"],
        mod.DEFAULT_CONFIG,
    )
    assert args_eq.prm_update == "double" and args_eq.gradient_accumulation_steps == 16
    # 256 prompts per step on 8 GPUs: 8 x 8 completions x 16 accumulation steps / K
    assert 8 * args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations == 256
    assert args.use_vllm is True  # the YAML's (only bf16 was overridden)


# ------------------------------------------------------------------------------------------------- prime_qwen7b
def test_prime_qwen7b_one_process(coin_model, eurus_jsonl, tmp_path):
    from trl_prime import PrimeRLOOTrainer

    mod = load_recipe("prime_qwen7b")
    out = str(tmp_path / "out")
    trainer = prime.main(
        *prime.parse_args(recipe_overrides(coin_model, eurus_jsonl, out, batch=8), mod.DEFAULT_CONFIG)
    )
    assert isinstance(trainer, PrimeRLOOTrainer) and trainer.accelerator.num_processes == 1
    for k, v in PAPER_OPTIONS.items():
        assert getattr(trainer.args, k) == v, k
    assert trainer.state.global_step == 2 and trainer.prm_optim.num_updates == 2
    assert trainer.implicit_prm.ref_model is not None and trainer.ref_model is None  # beta 0: PRIME owns the ref
    check_prime_logs([h for h in trainer.state.log_history if "prm/loss" in h])
    _check_saved(out, coin_model)


def _launch(config: str, summary: str, recipe_argv: list[str], timeout: int = 600) -> dict:
    cmd = launch_argv(
        LAUNCHER,
        "--recipe",
        "prime_qwen7b",
        "--summary",
        summary,
        "--",
        *recipe_argv,
        config_file=os.path.join(ROOT, "accelerate_configs", config),
    )
    proc = run_launched(cmd, timeout, TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    assert proc.returncode == 0, f"{config} launch failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    with open(summary) as f:
        return json.load(f)


def _check_summary(s: dict, model: str, data: str) -> None:
    assert s["num_processes"] == 2 and s["global_step"] == 2 and s["num_prm_updates"] == 2
    assert s["model_name_or_path"] == model and s["dataset_name"] == [data]
    for k, v in PAPER_OPTIONS.items():
        assert s["args"][k] == v, k
    check_prime_logs(s["logs"])
    r0, r1 = s["checksums"]
    assert r0 == r1, "PRM, policy or PRM reference differ between the two ranks"
    assert r0["prm"] != r0["prm_ref"] and r0["policy"] != r0["prm_ref"]


@pytest.mark.slow
def test_prime_qwen7b_ddp_two_processes(coin_model, eurus_jsonl, tmp_path):
    out = str(tmp_path / "ddp")
    s = _launch(
        "cpu_ddp.yaml", str(tmp_path / "summary.json"), recipe_overrides(coin_model, eurus_jsonl, out, batch=4)
    )
    assert s["distributed_type"] == "DistributedType.MULTI_CPU" and s["zero_stage"] is None
    _check_summary(s, coin_model, eurus_jsonl)
    _check_saved(out, coin_model)


@pytest.mark.slow
def test_prime_qwen7b_zero3_two_processes(coin_model, eurus_jsonl, tmp_path):
    """DeepSpeed ZeRO-3 over gloo (accelerate_configs/cpu_zero3.yaml: every parameter partitioned); the PRM is its
    own DeepSpeed engine; weights are gathered for the checksums and for saving."""
    pytest.importorskip("deepspeed")
    out = str(tmp_path / "zero3")
    s = _launch(
        "cpu_zero3.yaml",
        str(tmp_path / "summary.json"),
        recipe_overrides(coin_model, eurus_jsonl, out, batch=4, zero3=True),
    )
    assert s["distributed_type"] == "DistributedType.DEEPSPEED" and s["zero_stage"] == 3
    assert s["prm_engine"] == "DeepSpeedEngine"
    _check_summary(s, coin_model, eurus_jsonl)
    _check_saved(out, coin_model)


# --------------------------------------------------------------------------------------------------- prime_lora
def test_prime_lora_one_process_two_adapters_on_one_base(coin_model, eurus_jsonl, tmp_path):
    import torch

    from trl_prime.modeling import unwrap

    mod = load_recipe("prime_lora")
    out = str(tmp_path / "lora")
    data, args, model_args = prime.parse_args(
        recipe_overrides(coin_model, eurus_jsonl, out, batch=8), mod.DEFAULT_CONFIG
    )
    assert (model_args.use_peft, model_args.load_in_4bit, model_args.lora_r, args.prm_learning_rate) == (
        True,
        False,
        32,
        1e-5,
    )
    assert data.trainer == "prime_rloo"
    trainer = prime.main(data, args, model_args, require_peft=True)
    assert trainer.state.global_step == 2 and trainer.prm_optim.num_updates == 2
    check_prime_logs([h for h in trainer.state.log_history if "prm/loss" in h], prm_lr=1e-5)

    peft_model = unwrap(trainer.model)
    # the PRM is adapter "prm" on the policy's PeftModel; its reference is that base with adapters disabled
    assert unwrap(trainer.implicit_prm.model) is peft_model
    assert trainer.implicit_prm.adapter_name == "prm" and trainer.implicit_prm.ref_model is None
    assert set(peft_model.peft_config) == {"default", "prm"} and trainer.ref_model is None
    # one base model: its weights appear once, unchanged
    init = _weights(os.path.join(coin_model, "model.safetensors"))
    base = {n: p for n, p in peft_model.named_parameters() if "lora_" not in n}
    assert sum(p.numel() for p in base.values()) == sum(t.numel() for t in init.values())
    assert all(not p.requires_grad for p in base.values())
    base_now = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in base.items()}
    assert all(torch.equal(base_now[k], init[k]) for k in init)
    # both adapters trained: LoRA B starts at 0
    for adapter in ("default", "prm"):
        b = [p for n, p in peft_model.named_parameters() if f"lora_B.{adapter}." in n]
        assert b and all(p.abs().sum() > 0 for p in b), f"adapter {adapter!r} did not train"
    pol_b = torch.cat([p.flatten() for n, p in peft_model.named_parameters() if "lora_B.default." in n])
    prm_b = torch.cat([p.flatten() for n, p in peft_model.named_parameters() if "lora_B.prm." in n])
    assert not torch.equal(pol_b, prm_b)
    # saved: the policy adapter in output_dir, the PRM adapter in output_dir/prm
    for folder in (out, os.path.join(out, "prm")):
        assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))
    assert os.path.isfile(os.path.join(out, "prm", "implicit_prm_config.json"))
    saved_prm = _weights(os.path.join(out, "prm", "adapter_model.safetensors"))
    assert saved_prm and all(t.abs().sum() > 0 for k, t in saved_prm.items() if "lora_B" in k)


def test_prime_lora_8bit_without_cuda_or_4bit_without_bitsandbytes_is_a_clear_error(tmp_path, monkeypatch):
    """8-bit needs CUDA; 4-bit runs on a CPU too (tests/core/test_lora_4bit.py) but needs bitsandbytes."""

    mod = load_recipe("prime_lora")
    cpu = ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"]
    data, args, model_args = prime.parse_args([*cpu, "--load_in_8bit", "true"], mod.DEFAULT_CONFIG)
    with pytest.raises(ValueError, match=r"`load_in_8bit`=true .*CUDA.*`load_in_4bit: true`.*--load_in_8bit false"):
        prime.main(data, args, model_args, require_peft=True)
    _, args, model_args = prime.parse_args([*cpu, "--load_in_4bit", "true"], mod.DEFAULT_CONFIG)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"`load_in_4bit`=true needs bitsandbytes: `pip install bitsandbytes`"):
        prime.check_args(args, model_args, require_peft=True)
    monkeypatch.undo()
    if find_spec("bitsandbytes") is not None:
        prime.check_args(args, model_args, require_peft=True)  # with bitsandbytes, 4-bit on a CPU is fine
    _, args, model_args = prime.parse_args(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true", "--use_peft", "false"],
        mod.DEFAULT_CONFIG,
    )
    with pytest.raises(ValueError, match=r"use_peft: true"):
        prime.check_args(args, model_args, require_peft=True)
    prime.check_args(args, model_args)  # `trl-prime prime` itself also trains without LoRA
