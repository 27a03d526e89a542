"""The ``trl-prime`` command line (trl_prime/cli.py, trl_prime/scripts/): its help, its ``[project.scripts]`` entry,
the choice of trainer, one real tiny training run through the entry point, and the recipe files building exactly the
config the command builds."""

from __future__ import annotations

import dataclasses
import os
import runpy
import subprocess
import sys

import pytest
from test_recipes_prl_prof import math_jsonl  # noqa: F401 (a fixture)

from trl_prime import cli
from trl_prime.scripts import best_of_n, demo, evaluate, implicit_prm, prime, utils


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
CONFIGS = os.path.join(RECIPES, "configs")
ENV = dict(os.environ, PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def _run_cli(*argv: str, module: str = "trl_prime.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=300)


# ----------------------------------------------------------------------------------------------------------- help
@pytest.mark.parametrize("module", ["trl_prime.cli", "trl_prime"])
def test_help_lists_every_command(module):
    proc = _run_cli("--help", module=module)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: trl-prime")
    for name in ("prime", "prl", "prof", "implicit-prm", "eval", "best-of-n", "demo"):
        assert f"\n    {name}" in proc.stdout, name
    assert set(cli.COMMANDS) == {"prime", "prl", "prof", "implicit-prm", "eval", "best-of-n", "demo"}


def test_no_command_prints_the_help(capsys):
    assert cli.main([]) == 0
    assert "trl-prime" in capsys.readouterr().out


# a flag of each command's own dataclasses, which its --help must list
COMMAND_FLAGS = {
    "prime": ["--trainer", "--prm_beta", "--filter_lower", "--lora_r", "--dataset_name"],
    "prl": ["--trainer", "--prl_eta", "--model_name_or_path"],
    "prof": ["--trainer", "--prof_mode", "--prof_prm"],
    "implicit-prm": ["--rollouts_path", "--loss_type", "--model_name_or_path"],
    "eval": ["--datasets", "--pass_k", "--use_vllm"],
    "best-of-n": ["--prm_paths", "--ns", "--aggregations"],
    "demo": ["--train_problems", "--precision", "--prm_beta"],
}


@pytest.mark.parametrize("command", list(COMMAND_FLAGS))
def test_each_command_help(command):
    proc = _run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: trl-prime {command}")
    for flag in COMMAND_FLAGS[command]:
        assert flag in proc.stdout, (command, flag)


def test_pyproject_declares_the_console_script():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"trl-prime": "trl_prime.cli:main"}
    module, _, name = scripts["trl-prime"].partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is cli.main


# ------------------------------------------------------------------------------------------------ trainer choice
def test_trainer_comes_from_the_flag_then_the_yaml_then_the_default(tmp_path):
    choices = utils.COMMAND_TRAINERS["prof"]
    prof_prime = os.path.join(CONFIGS, "prof_prime.yaml")
    assert utils.choose_trainer([], choices) == "prof_grpo"
    assert utils.choose_trainer([], choices, default="prime_grpo") == "prime_grpo"
    assert utils.choose_trainer(["--config", prof_prime], choices) == "prime_grpo"  # the YAML's key
    assert utils.choose_trainer(["--config", prof_prime, "--trainer", "prof_grpo"], choices) == "prof_grpo"
    assert utils.choose_trainer(["--trainer=prof_grpo", "--config", prof_prime], choices) == "prof_grpo"
    with pytest.raises(ValueError, match=r"`trainer`='prl_grpo': this command trains with one of"):
        utils.choose_trainer(["--trainer", "prl_grpo"], choices)
    # the YAMLs name their trainer: the command picks the config class from it
    for name, (command, trainer) in {"prime_qwen7b": ("prime", "prime_rloo"), "prime_lora": ("prime", "prime_rloo"),
                                     "prl_grpo": ("prl", "prl_grpo"), "prof_grpo": ("prof", "prof_grpo"),
                                     "prof_prime": ("prof", "prime_grpo")}.items():
        argv = ["--config", os.path.join(CONFIGS, f"{name}.yaml")]
        assert utils.choose_trainer(argv, utils.COMMAND_TRAINERS[command]) == trainer, name
    # `trl-prime prime` with the GRPO estimator's trainer: PrimeGRPOConfig
    script_args, args, _ = prime.parse_args(
        ["--trainer", "prime_grpo", "--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"])
    assert script_args.trainer == "prime_grpo" and type(args).__name__ == "PrimeGRPOConfig"
    assert args.prime_estimator == "grpo"


# ------------------------------------------------------------------------------------- a real run through the entry
def test_console_entry_trains_prof_inside_prime(tiny_model_path, math_jsonl, tmp_path, monkeypatch):  # noqa: F811
    """``trl-prime prof --config recipes/configs/prof_prime.yaml`` (its ``trainer: prime_grpo``) for one step on the
    tiny model: the PRIME trainer with PROF, the policy and the implicit PRM saved."""
    from trl_prime import PrimeGRPOTrainer

    trainers = []
    train = utils.train
    monkeypatch.setattr(utils, "train", lambda *a: trainers.append(train(*a)) or trainers[-1])
    out = tmp_path / "out"
    status = cli.main([
        "prof", "--config", os.path.join(CONFIGS, "prof_prime.yaml"), "--output_dir", str(out),
        "--model_name_or_path", tiny_model_path, "--dataset_name", math_jsonl, "--use_cpu", "true", "--bf16", "false",
        "--dtype", "float32", "--max_steps", "1", "--max_completion_length", "8", "--per_device_train_batch_size", "8",
        "--save_strategy", "no", "--filter_lower", "0.0", "--filter_upper", "1.0", "--report_to", "none",
    ])
    assert status == 0 and len(trainers) == 1
    trainer = trainers[0]
    assert type(trainer) is PrimeGRPOTrainer and trainer.args.prof_prm == "implicit"
    assert trainer.state.global_step == 1
    logs = [h for h in trainer.state.log_history if "prof/kept_fraction" in h]
    assert len(logs) == 1 and logs[0]["prof/kept_fraction"] == 0.5  # m = 4 of n = 8
    assert (out / "model.safetensors").is_file() and (out / "prm" / "implicit_prm_config.json").is_file()


# ------------------------------------------------------------------------------ recipe file == trl-prime command
def _plain(obj):
    """A comparable view of a parsed dataclass (TrainingArguments through its own ``to_dict``)."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return dataclasses.asdict(obj)


def _captured(monkeypatch, module, attr: str) -> list:
    """Replace ``module.<attr>`` (the function the command hands its parsed arguments to) by a recorder."""
    calls = []
    monkeypatch.setattr(module, attr, lambda *args, **kwargs: calls.append((args, kwargs)))
    return calls


# recipe -> (command, module whose `attr` receives the parsed arguments, attr, flags a CPU needs)
CPU = ["--bf16", "false", "--use_cpu", "true"]
RECIPE_COMMANDS = {
    "prime_qwen7b": ("prime", prime, "train", CPU),
    "prime_lora": ("prime", prime, "train", CPU),
    "prl_grpo": ("prl", utils, "train", []),
    "prof_grpo": ("prof", utils, "train", ["--bf16", "false", "--gradient_checkpointing", "false"]),
    "prof_prime": ("prof", utils, "train", []),
    "implicit_prm": ("implicit-prm", implicit_prm, "main", []),
    "evaluate": ("eval", evaluate, "main", []),
    "evaluate_best_of_n": ("best-of-n", best_of_n, "main", []),
    "demo": ("demo", demo, "main", []),
}
RECIPE_CONFIGS = {"evaluate": "evaluate.yaml", "evaluate_best_of_n": "implicit_prm_eval.yaml"}


@pytest.mark.parametrize("name", list(RECIPE_COMMANDS))
def test_recipe_file_and_command_build_the_same_config(name, tmp_path, monkeypatch):
    """``python recipes/<name>.py <flags>`` (its YAML by default) and ``trl-prime <command> --config <its YAML>
    <flags>`` hand the same parsed arguments to the same function."""
    command, module, attr, flags = RECIPE_COMMANDS[name]
    monkeypatch.delenv("DEMO_STEPS", raising=False)
    for var in ("TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, os.environ.get(var, "1" if var != "TOKENIZERS_PARALLELISM" else "false"))
    monkeypatch.chdir(tmp_path)  # anything the parse creates lands here
    calls = _captured(monkeypatch, module, attr)
    yaml_path = os.path.join(CONFIGS, RECIPE_CONFIGS.get(name, f"{name}.yaml"))
    flags = [*flags, "--seed", "7"]
    if name in RECIPE_CONFIGS:  # no default YAML: the recipe file is the command itself
        flags = ["--config", yaml_path, *flags]
    elif name != "demo":
        flags += ["--output_dir", str(tmp_path / "out")]
    recipe = os.path.join(RECIPES, f"{name}.py")
    monkeypatch.setattr(sys, "argv", [recipe, *flags])
    runpy.run_path(recipe, run_name="__main__")
    config_flags = [] if "--config" in flags else ["--config", yaml_path]
    assert cli.main([command, *config_flags, *flags]) == 0
    assert len(calls) == 2
    (from_recipe, recipe_kwargs), (from_cli, cli_kwargs) = calls
    assert [type(a) for a in from_recipe] == [type(a) for a in from_cli]
    assert [_plain(a) for a in from_recipe] == [_plain(a) for a in from_cli]
    assert recipe_kwargs == cli_kwargs
    if name == "prime_lora":  # the LoRA recipe refuses full fine-tuning; `trl-prime prime` allows it
        assert from_recipe[2].use_peft is True
