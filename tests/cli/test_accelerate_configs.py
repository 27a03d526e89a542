"""Every Accelerate config in accelerate_configs/ loads with accelerate's own loader, holds the values its name
promises, and is used: named by a recipe, the README, a docs page or a test."""

from __future__ import annotations

import glob
import json
import os

import pytest
from helpers import ROOT


CONFIGS = os.path.join(ROOT, "accelerate_configs")

# name: (num_processes, num_machines, distributed_type, zero stage, mixed precision)
EXPECTED = {
    "single_gpu.yaml": (1, 1, "NO", None, "bf16"),
    "multi_gpu.yaml": (8, 1, "MULTI_GPU", None, "bf16"),
    "zero2.yaml": (8, 1, "DEEPSPEED", 2, "bf16"),
    "zero3.yaml": (8, 1, "DEEPSPEED", 3, "bf16"),  # the PRIME paper's setup (recipes/prime_qwen7b.py)
    "zero3_two_nodes.yaml": (16, 2, "DEEPSPEED", 3, "bf16"),
    "cpu_ddp.yaml": (2, 1, "MULTI_GPU", None, "no"),  # + the trainer's use_cpu=True: gloo on CPU
    "cpu_zero3.yaml": (2, 1, "DEEPSPEED", 3, "no"),  # stage and precision in cpu_zero3.json
}


def _yaml_files():
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.yaml")))


def test_every_config_is_listed():
    assert _yaml_files() == sorted(EXPECTED), "add the new config to EXPECTED (and use it in a recipe or a test)"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    cfg = load_config_from_file(os.path.join(CONFIGS, name))
    assert isinstance(cfg, ClusterConfig)
    processes, machines, dist_type, stage, precision = EXPECTED[name]
    assert (cfg.num_processes, cfg.num_machines) == (processes, machines)
    assert cfg.distributed_type == DistributedType[dist_type]
    assert cfg.use_cpu is False  # CPU runs go through MULTI_GPU / DEEPSPEED + the trainer's use_cpu (see notes)
    ds = cfg.deepspeed_config or {}
    if "deepspeed_config_file" in ds:
        with open(os.path.join(ROOT, ds["deepspeed_config_file"])) as f:  # relative to the repository root
            ds_json = json.load(f)
        assert ds_json["zero_optimization"]["stage"] == stage
        assert ds_json["zero_optimization"]["stage3_param_persistence_threshold"] == 0  # tiny models get partitioned
        got = "bf16" if ds_json["bf16"]["enabled"] else "fp16" if ds_json["fp16"]["enabled"] else "no"
        assert got == precision
        assert cfg.mixed_precision is None  # accelerate refuses both a DeepSpeed JSON and its own precision key
    else:
        assert ds.get("zero_stage") == stage
        assert cfg.mixed_precision == precision
    if stage == 3 and "deepspeed_config_file" not in ds:
        assert ds["zero3_save_16bit_model"] is True  # full weights in saved checkpoints
    if machines > 1:
        assert cfg.main_process_ip and cfg.main_process_port and cfg.same_network is False


def _referencing_files():
    patterns = [
        "recipes/*.py",
        "recipes/configs/*.yaml",
        "README.md",
        "docs/**/*.md",
        "tests/**/*.py",
    ]
    files = set()
    for p in patterns:
        files.update(glob.glob(os.path.join(ROOT, p), recursive=True))
    return {os.path.relpath(f, ROOT): open(f, encoding="utf-8").read() for f in files}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_is_used_by_a_recipe_or_a_test(name):
    users = [
        f
        for f, text in _referencing_files().items()
        if f"accelerate_configs/{name}" in text or (f.startswith("tests/") and f'"{name}"' in text)
    ]
    users = [u for u in users if u != "tests/cli/test_accelerate_configs.py"]
    assert users, f"accelerate_configs/{name} is used by no recipe, README section or test"
    if name.startswith("cpu_"):
        assert any(u.startswith("tests/") and os.path.basename(u).startswith("test_") for u in users), (
            f"{name} should be launched by a test"
        )
    else:
        documented = any(u.startswith(("recipes/", "README", "docs/")) for u in users)
        assert documented, f"{name} should be documented by a recipe"
