"""The tiny Eurus-2-RL-Data rows, the coin-flip model and the recipe helpers of the recipe tests
(``tests/cli/test_recipes_prime.py``, ``tests/core/test_lora_4bit.py``): see the former's docstring."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
from helpers import ROOT


RECIPES = os.path.join(ROOT, "recipes")
SYSTEM = "Think step by step."  # Eurus-2-RL-Data rows carry a (longer) system prompt
CODE_TESTS = json.dumps({"inputs": ["\n"], "outputs": ["1\n"]})


def write_eurus_jsonl(path) -> str:
    """Two math rows (gold 1) and two code rows (stdin/stdout tests expecting 1) in the Eurus-2-RL-Data format."""
    rows = []
    for i in range(2):
        rows.append(
            {
                "data_source": "numina_synthetic_math",
                "ability": "math",
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {i} + {1 - i}? Answer in \\boxed{{}}."},
                ],
                "reward_model": {"style": "rule", "ground_truth": "1"},
                "extra_info": {"split": "train", "index": i},
            }
        )
        rows.append(
            {
                "data_source": "taco",
                "ability": "code",
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Write Python code that prints 1 (task {i})."},
                ],
                "reward_model": {"style": "rule", "ground_truth": CODE_TESTS},
                "extra_info": {"split": "train", "index": 10 + i},
            }
        )
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def build_coin_model(path, data_path, steps: int = 120) -> str:
    """A tiny model (tests/tiny.py) SFT'd to answer each prompt of ``data_path`` with d = 1 or 2 at even odds."""
    import torch
    from tiny import build_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(path, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with open(data_path) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    seqs = []
    for p in prompts:
        pid = tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for d in "12":
            cid = tok(f"\\boxed{{{d}}}\n```python\nprint({d})\n```", add_special_tokens=False)["input_ids"]
            seqs.append((pid["input_ids"], cid + [tok.eos_token_id]))
    L = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id)
    labels = torch.full((len(seqs), L), -100)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(c)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared machine
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    # the only uncertainty left is the digit (two coin flips of the ~30 completion tokens): loss ~ 2 ln 2 / 30
    assert loss.item() < 0.2, loss.item()
    model.save_pretrained(path)
    return path


def load_recipe(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(RECIPES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def recipe_overrides(
    model: str, data: str, out: str, *, batch: int, ddp: bool = False, zero3: bool = False
) -> list[str]:
    """Model, data, steps, and what a CPU needs; no ``--config``: the recipe must default to its own YAML."""
    return [
        "--model_name_or_path",
        model,
        "--dataset_name",
        data,
        "--output_dir",
        out,
        "--max_steps",
        "2",
        "--oversample_factor",  # the recipe's 4 needs 4x the prompts per step: more than the tiny data set holds
        "1",
        "--per_device_train_batch_size",
        str(batch),
        "--gradient_accumulation_steps",
        "1",
        "--max_completion_length",
        "32",
        "--save_strategy",
        "no",
        "--dtype",
        "float32",
        "--use_vllm",
        "false",
        "--bf16",
        "false",
        "--gradient_checkpointing",
        "false",
        "--use_cpu",
        "false" if zero3 else "true",
    ]


def check_prime_logs(logs: list[dict], prm_lr: float = 1e-6) -> None:
    """Two PRIME steps: the PRM was updated each step, on a mixed batch of math and code rows."""
    assert len(logs) == 2
    for h in logs:
        for k in (
            "loss",
            "prm/loss",
            "prm/pair_accuracy",
            "prm/abs_accuracy",
            "prm/token_reward_std",
            "filter/kept_fraction",
            "prm/grad_norm",
        ):
            assert h[k] is not None and math.isfinite(h[k]), (k, h.get(k))
        assert 0.0 <= h["prm/pair_accuracy"] <= 1.0 and 0.0 < h["filter/kept_fraction"] <= 1.0
        assert h["prm/grad_norm"] > 0 and h["prm/learning_rate"] == pytest.approx(prm_lr)
    # prm_update "double" (the YAML's): the PRM is updated before it scores, so even step 1's token rewards are not 0
    # (with "single" they are exactly 0 at step 1, where the PRM equals its reference)
    assert logs[0]["prm/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert logs[0]["prm/token_reward_std"] > 0
    # both verifiers scored completions: the rows are routed by ability, none left unrouted
    assert sum(h["route/math"] for h in logs) > 0 and sum(h["route/code"] for h in logs) > 0
    assert all(h["route/unrouted"] == 0 for h in logs)
    assert sum(h["math/correct"] for h in logs) > 0 and sum(h["math/wrong"] for h in logs) > 0
    assert sum(h["code/passed"] for h in logs) > 0 and sum(h["code/failed"] for h in logs) > 0
