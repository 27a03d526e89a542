"""The PRL / PROF recipes (``trl-prime prl`` / ``trl-prime prof``, :mod:`trl_prime.scripts.prl` / ``prof``, with the
recipe's YAML as the default ``--config``): their YAML configs parse with trl.TrlParser (with command-line overrides),
and each recipe trains for a step end to end on the tiny offline model and a local JSONL dataset in the
Eurus-2-RL-Data format."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
from helpers import ROOT

from trl_prime.scripts import prl, prof, utils


RECIPES = os.path.join(ROOT, "recipes")


def _recipe(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(RECIPES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _config_cls(name):
    from trl_prime import PrimeGRPOConfig, PRLConfig, ProfGRPOConfig

    return {"prl_grpo": PRLConfig, "prof_grpo": ProfGRPOConfig, "prof_prime": PrimeGRPOConfig}[name]


#: recipe -> (its script module, the trainer its thin entry point defaults to)
SCRIPTS = {"prl_grpo": (prl, None), "prof_grpo": (prof, None), "prof_prime": (prof, "prime_grpo")}


def _parse(name, argv):
    """What ``python recipes/<name>.py <argv>`` parses: the script's parser, the recipe's YAML by default."""
    script, trainer = SCRIPTS[name]
    script_args, args, model = script.parse_args(argv, _recipe(name).DEFAULT_CONFIG, trainer)
    assert type(args) is _config_cls(name)
    return script_args, args, model


def _main(name, parsed):
    return SCRIPTS[name][0].main(*parsed)


@pytest.fixture(scope="module")
def math_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            f.write(
                json.dumps(
                    {
                        "data_source": "numina_synthetic_math",
                        "ability": "math",
                        "prompt": [{"role": "user", "content": f"What is {i} + 1? Put the answer in \\boxed{{}}."}],
                        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
                    }
                )
                + "\n"
            )
    return str(path)


def test_yaml_configs_parse_with_overrides(tmp_path):
    data, args, model = _parse(
        "prl_grpo",
        [
            "--config",
            os.path.join(RECIPES, "configs", "prl_grpo.yaml"),
            "--output_dir",
            str(tmp_path),
            "--prl_eta",
            "150",
        ],
    )
    assert (args.prl_eta, args.prl_step_split, args.prl_step_len, args.num_generations) == (150.0, "length", 256, 5)
    assert model.model_name_or_path == "embedded:smollm2-135m-instruct" and data.dataset_name == [
        "embedded:arithmetic"
    ]
    data, args, model = _parse(
        "prof_grpo",
        [
            "--config",
            os.path.join(RECIPES, "configs", "prof_grpo.yaml"),
            "--output_dir",
            str(tmp_path),
            "--bf16",
            "false",
            "--gradient_checkpointing",
            "false",
            "--model_name_or_path",
            "some/model",
        ],
    )
    assert (args.prof_mode, args.prof_prm, args.prof_keep_count(), args.num_generations) == (
        "both",
        "Qwen/Qwen2.5-Math-PRM-7B",
        4,
        8,
    )
    assert (args.beta, args.entropy_coef, args.prof_step_delimiter, model.model_name_or_path) == (
        0.001,
        0.001,
        "\n\n",
        "some/model",
    )
    data, args, model = _parse(
        "prof_prime",
        [
            "--config",
            os.path.join(RECIPES, "configs", "prof_prime.yaml"),
            "--output_dir",
            str(tmp_path),
        ],
    )
    assert (args.prof_mode, args.prof_prm, args.prof_keep_count(), args.prime_estimator) == (
        "both",
        "implicit",
        4,
        "grpo",
    )


@pytest.mark.parametrize("name", ["prl_grpo", "prof_grpo", "prof_prime"])
def test_recipe_trains_one_step(name, tiny_model_path, math_jsonl, tmp_path):
    argv = [
        "--config",
        os.path.join(RECIPES, "configs", f"{name}.yaml"),
        "--output_dir",
        str(tmp_path / "out"),
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_name",
        math_jsonl,
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--gradient_checkpointing",
        "false",
        "--dtype",
        "float32",
        "--max_steps",
        "1",
        "--max_completion_length",
        "8",
        "--per_device_train_batch_size",
        "8",
        "--learning_rate",
        "1e-3",
        "--save_strategy",
        "no",
        "--trust_remote_code",
        "false",
    ]
    if name == "prl_grpo":
        argv += ["--num_generations", "4", "--prl_step_len", "3"]
    if name == "prof_grpo":
        from tiny_prm import build_tiny_step_prm

        argv += [
            "--prof_prm",
            build_tiny_step_prm(tmp_path / "prm"),
            "--num_generations",
            "8",
            "--gradient_accumulation_steps",
            "1",
            "--beta",
            "0.0",
        ]
    if name == "prof_prime":  # the tiny model answers nothing right: keep its all-wrong groups for PROF to filter
        argv += ["--filter_lower", "0.0", "--filter_upper", "1.0"]
    trainer = _main(name, _parse(name, argv))
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == 1 and math.isfinite(logs[0]["loss"])
    key = "prl/kl_to_go_mean" if name == "prl_grpo" else "prof/kept_fraction"
    assert key in logs[0]
    if name != "prl_grpo":
        assert logs[0]["prof/kept_fraction"] == 0.5
    assert os.path.isfile(os.path.join(tmp_path / "out", "model.safetensors"))
    if name == "prof_prime":
        assert os.path.isfile(os.path.join(tmp_path / "out", "prm", "implicit_prm_config.json"))


def test_cli_prompt_column_delimiter_escapes_and_missing_prof_prm(tmp_path):
    """Review fixes, through the recipes' command-line parser: `--prompt_column query` reads a dataset whose prompts
    are in 'query' (the loader's error suggests it); `--prof_step_delimiter '\\n'` (backslash-n as a shell passes it)
    is a newline; a missing local `--prof_prm` fails at parse time naming prof_prm, before any model is loaded. (A file
    with GSM8K's own columns, 'question' and 'answer', needs no option: it is read as GSM8K.)"""
    path = tmp_path / "q.jsonl"
    with open(path, "w") as f:
        for i in range(3):
            f.write(json.dumps({"query": f"What is {i} + 1?", "answer": str(i + 1), "ability": "math"}) + "\n")
    base = [
        "--config",
        os.path.join(RECIPES, "configs", "prof_grpo.yaml"),
        "--output_dir",
        str(tmp_path / "o"),
        "--bf16",
        "false",
        "--gradient_checkpointing",
        "false",
        "--dataset_name",
        str(path),
    ]
    data, _, _ = _parse("prof_grpo", base)
    with pytest.raises(ValueError, match=r"--prompt_column query"):
        utils.load_train_dataset(data)
    data, args, _ = _parse("prof_grpo", base + ["--prompt_column", "query", "--prof_step_delimiter", "\\n"])
    ds = utils.load_train_dataset(data)
    assert len(ds) == 3 and ds[0]["prompt"][-1]["content"] == "What is 0 + 1?" and ds[0]["solution"] == "1"
    assert args.prof_step_delimiter == "\n"
    with pytest.raises(ValueError, match=r"`prof_prm`=.*does not exist"):
        _parse("prof_grpo", base + ["--prof_prm", str(tmp_path / "missing_prm")])
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n")
    data, _, _ = _parse("prof_grpo", base[:-1] + [str(gsm8k)])
    ds = utils.load_train_dataset(data)
    assert ds[0]["prompt"][-1]["content"] == "What is 2 + 2?" and ds[0]["solution"] == "4"
