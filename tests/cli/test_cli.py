"""The ``trl-prime`` command line (trl_prime/cli.py, trl_prime/scripts/): its help, its ``[project.scripts]`` entry,
the choice of trainer, the ``accelerate launch`` of the training commands (the split of their flags, the
``--accelerate_config`` names, in-process when already launched, a real two-process run), the demo's packaged config,
one real tiny training run through the entry point in this process, and the recipe files building exactly the config
the command builds."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import runpy
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, free_port
from test_recipes_prl_prof import math_jsonl  # noqa: F401 (a fixture)

from trl_prime import cli
from trl_prime.scripts import best_of_n, demo, evaluate, implicit_prm, prime, prl, utils


RECIPES = os.path.join(ROOT, "recipes")
CONFIGS = os.path.join(RECIPES, "configs")
ENV = dict(os.environ, PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")


def _run_cli(*argv: str, module: str = "trl_prime.cli") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *argv], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300
    )


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


def _clear_launch_env(monkeypatch):
    for var in (*cli.DISTRIBUTED_LAUNCH_ENV, *cli.ACCELERATE_LAUNCH_ENV):
        monkeypatch.delenv(var, raising=False)


_LAUNCH = cli.launch  # the real one, before a test patches it


def _exit_status(argv, capsys, **kwargs) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv, **kwargs)
    return exit_info.value.code, capsys.readouterr().err


def test_unknown_arguments_before_the_command_are_an_error(capsys, monkeypatch):
    """argparse's rule (exit status 2, usage, ``error:``): an unknown argument before the command is not dropped, and
    arguments without a command are not answered with the help and status 0."""
    monkeypatch.setattr(cli, "launch", lambda *args: pytest.fail("launched"))
    monkeypatch.setattr(prl, "run", lambda argv: pytest.fail("ran"))
    code, err = _exit_status(["--bogus"], capsys)
    assert code == 2 and err.startswith("usage: trl-prime")
    assert "trl-prime: error: unrecognized arguments: --bogus (no command given" in err
    code, err = _exit_status(["--bogus", "prl", "--max_steps", "1"], capsys)
    assert code == 2 and "trl-prime: error: unrecognized arguments: --bogus (before the command 'prl')" in err
    code, err = _exit_status(["--bogus=1", "-x", "prl"], capsys, launch_training=False)
    assert code == 2 and "unrecognized arguments: --bogus=1 -x (before the command 'prl')" in err


def test_command_line_mistakes_name_the_flag_and_exit_2(tmp_path, capsys, monkeypatch):
    """A missing ``--config`` file, a trainer the command does not train with (flag or YAML key) and a bad
    ``--accelerate_config`` give ``trl-prime <command>: error: ...`` and status 2, not a traceback; nothing is
    launched or run."""
    monkeypatch.setattr(cli, "launch", lambda *args: pytest.fail("launched"))
    for module in (prime, prl, evaluate):
        monkeypatch.setattr(module, "run", lambda argv: pytest.fail("ran"))
    missing = str(tmp_path / "missing.yaml")
    for argv, launch_training in [(["prime", "--config", missing], None), (["eval", f"--config={missing}"], None)]:
        code, err = _exit_status(argv, capsys, launch_training=launch_training)
        assert code == 2 and f": error: --config {missing}: no such file" in err, err
        assert err.startswith(f"trl-prime {argv[0]}: error:") and "Give the path of an existing YAML file" in err
    code, err = _exit_status(["prime", "--trainer", "prl_grpo"], capsys, launch_training=False)
    assert code == 2 and err.startswith("trl-prime prime: error: `trainer`='prl_grpo': this command trains with")
    assert "(read from --trainer); pass --trainer prime_rloo (the default)" in err
    code, err = _exit_status(["prof", "--config", os.path.join(CONFIGS, "prl_grpo.yaml")], capsys)
    assert code == 2 and "(read from the `trainer` key of --config " in err and "pass --trainer prof_grpo" in err


def test_parse_errors_of_every_kind_are_command_line_errors(tmp_path, capsys, monkeypatch):
    """What the command's parsing rejects -- an unknown flag of an in-process command, a value its config refuses, a
    malformed ``--config`` YAML, a YAML key that neither the command nor ``accelerate launch`` knows -- is
    ``trl-prime <command>: error: ...`` with status 2 (no traceback), and nothing is launched or trained."""
    monkeypatch.setattr(cli, "launch", lambda *args: pytest.fail("launched"))
    monkeypatch.setattr(demo, "main", lambda *args: pytest.fail("ran"))
    code, err = _exit_status(["demo", "--bogus_flag", "3"], capsys)
    assert code == 2 and err.startswith("trl-prime demo: error:") and "--bogus_flag" in err, err
    code, err = _exit_status(["demo", "--precision", "fp16"], capsys)
    assert code == 2 and "trl-prime demo: error: `precision`='fp16'" in err, err
    malformed = tmp_path / "bad.yaml"
    malformed.write_text("trainer: [unclosed\n")
    code, err = _exit_status(["prime", "--config", str(malformed)], capsys)
    assert code == 2 and f"trl-prime prime: error: --config {malformed} is not valid YAML" in err, err
    import accelerate.commands.launch

    monkeypatch.setattr(cli, "launch", _LAUNCH)  # the real launch: its argument check runs; accelerate never starts
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", lambda args: pytest.fail("launched"))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("max_steps: 1\nnot_a_key: 3\n")
    code, err = _exit_status(["prime", "--config", str(unknown)], capsys)
    assert code == 2 and "unknown option(s) --not_a_key (a key of the --config YAML)" in err, err
    code, err = _exit_status(["prl", "--not_a_flag", "1"], capsys)
    assert code == 2 and "unknown option(s) --not_a_flag (the command line)" in err, err


def test_bad_accelerate_config_is_an_error_before_the_launch(capsys, monkeypatch):
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: launched.append(args))
    for argv in (["--accelerate_config", "zero4"], ["--max_steps", "1", "--accelerate_config"]):
        code, err = _exit_status(["prl", *argv], capsys, launch_training=True)
        assert code == 2 and err.startswith("trl-prime prl: error: --accelerate_config: "), err
        assert "trl-prime's configs: cpu_ddp, cpu_zero3" in err and "the path of an Accelerate config file" in err
    assert launched == []
    with pytest.raises(cli.CommandLineError):  # a ValueError, as before
        cli.resolve_accelerate_config(["--accelerate_config", "zero4"])


def test_a_bad_method_option_is_refused_before_the_launch(tmp_path, capsys, monkeypatch):
    """PRIME's own checks (no TRL field, nothing that depends on the number of processes) run on the parsed flags and
    YAML keys before `accelerate launch`; the shipped recipes pass them."""
    launched = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: launched.append(args))
    config = tmp_path / "bad.yaml"
    config.write_text("prime_estimator: ppo\nlam: 1.5\n")
    for argv, message in (
        (["--prime_estimator", "ppo", "--lam", "1.5"], "`lam`=1.5 must lie in [0, 1]"),
        (["--config", str(config)], "`lam`=1.5 must lie in [0, 1]"),
        (["--prm_beta", "0"], "`prm_beta`=0.0 must be > 0"),
        (["--trainer", "prime_grpo", "--process_coef", "0", "--outcome_coef", "0"], "are both 0"),
    ):
        code, err = _exit_status(["prime", *argv], capsys, launch_training=True)
        assert code == 2 and err.startswith("trl-prime prime: error: "), err
        assert message in err and "refused before launching" in err, err
    monkeypatch.chdir(tmp_path)
    code, err = _exit_status(["prime", "--model_name_or_path", "./outputs/sft"], capsys, launch_training=True)
    assert code == 2 and "--model_name_or_path ./outputs/sft: no such folder" in err, err
    assert launched == []
    for command, name in (("prime", "prime_qwen7b"), ("prime", "prime_lora"), ("prof", "prof_prime")):
        argv = cli.accelerate_launch_argv(
            command, ["--config", os.path.join(RECIPES, "configs", f"{name}.yaml"), "--max_steps", "3"]
        )
        assert argv[-2:] == ["--max_steps", "3"]


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
    for name, (command, trainer) in {
        "prime_qwen7b": ("prime", "prime_rloo"),
        "prime_lora": ("prime", "prime_rloo"),
        "prl_grpo": ("prl", "prl_grpo"),
        "prof_grpo": ("prof", "prof_grpo"),
        "prof_prime": ("prof", "prime_grpo"),
    }.items():
        argv = ["--config", os.path.join(CONFIGS, f"{name}.yaml")]
        assert utils.choose_trainer(argv, utils.COMMAND_TRAINERS[command]) == trainer, name
    # `trl-prime prime` with the GRPO estimator's trainer: PrimeGRPOConfig
    script_args, args, _ = prime.parse_args(
        ["--trainer", "prime_grpo", "--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"]
    )
    assert script_args.trainer == "prime_grpo" and type(args).__name__ == "PrimeGRPOConfig"
    assert args.prime_estimator == "grpo"


# ------------------------------------------------------------------------------------------- accelerate launch
TINY_PRL = ["--max_steps", "1", "--use_cpu", "true", "--prl_eta", "150"]


def test_training_command_flags_it_does_not_know_go_to_accelerate():
    """TRL's split (``trl.cli.commands.training``): the command's parser keeps its flags, in their order, for
    ``python -m trl_prime.scripts.<module>``; accelerate gets the rest, from the command line and the YAML."""
    prl_yaml = os.path.join(CONFIGS, "prl_grpo.yaml")
    argv = [f"--config={prl_yaml}", "--num_processes", "2", *TINY_PRL, "--main_process_port", "29555"]
    assert cli.accelerate_launch_argv("prl", argv) == [
        "--num_processes",
        "2",
        "--main_process_port",
        "29555",
        "-m",
        "trl_prime.scripts.prl",
        "--config",
        prl_yaml,
        *TINY_PRL,
    ]
    assert cli.accelerate_launch_argv("implicit-prm", ["--loss_type", "dpo", "--num_machines", "1"]) == [
        "--num_machines",
        "1",
        "-m",
        "trl_prime.scripts.implicit_prm",
        "--loss_type",
        "dpo",
    ]
    assert cli.accelerate_launch_argv("prime", ["--trainer", "prime_grpo", "--use_cpu", "true"]) == [
        "-m",
        "trl_prime.scripts.prime",
        "--trainer",
        "prime_grpo",
        "--use_cpu",
        "true",
    ]


def test_launch_split_builds_no_config():
    """The configs are built in the launched processes, which know the world size: 8 processes x 1 completion hold
    a group of 8, which one process (the launcher's) could not (GRPOConfig: generation batch % num_generations)."""
    argv = ["--per_device_train_batch_size", "1", "--num_generations", "8", "--num_processes", "8"]
    assert cli.accelerate_launch_argv("prl", argv) == [
        "--num_processes",
        "8",
        "-m",
        "trl_prime.scripts.prl",
        *argv[:4],
    ]
    with pytest.raises(ValueError, match="must be divisible by num_generations"):
        prl.parse_args(argv[:4] + ["--bf16", "false"])  # the same flags in one process


def test_accelerate_config_keys_of_the_yaml_go_to_accelerate(tmp_path):
    config = tmp_path / "prl.yaml"
    config.write_text(yaml.safe_dump({"trainer": "prl_grpo", "bf16": False, "num_processes": 2}))
    assert cli.accelerate_launch_argv("prl", ["--config", str(config), "--max_steps", "1"]) == [
        "--num_processes",
        "2",
        "-m",
        "trl_prime.scripts.prl",
        "--config",
        str(config),
        "--max_steps",
        "1",
    ]


def test_accelerate_config_names(tmp_path):
    """``--accelerate_config NAME``: trl-prime's configs (package data: the repository's accelerate_configs/ links to
    them), then TRL's rule (a file path, else a TRL name); a DeepSpeed JSON path made absolute."""
    ours = Path(cli.ACCELERATE_CONFIGS)
    assert ours.parent == Path(cli.__file__).resolve().parent  # inside the package
    names = ["cpu_ddp", "cpu_zero3", "multi_gpu", "single_gpu", "zero2", "zero3", "zero3_two_nodes"]
    assert cli.accelerate_config_names() == names
    assert sorted(p.stem for p in Path(ROOT, "accelerate_configs").glob("*.yaml")) == names  # the repository's link
    for name in names:
        assert os.path.samefile(ours / f"{name}.yaml", Path(ROOT, "accelerate_configs", f"{name}.yaml"))
    assert cli.resolve_accelerate_config(["--num_processes", "2", "--accelerate_config", "cpu_ddp"]) == [
        "--config_file",
        str(ours / "cpu_ddp.yaml"),
        "--num_processes",
        "2",
    ]
    zero3 = ["--config_file", str(ours / "zero3.yaml")]
    assert cli.resolve_accelerate_config(["--accelerate_config", "zero3"]) == zero3
    # cpu_zero3.yaml names its JSON relative to the repository root: launched from anywhere, it is the package's file
    resolved = cli.resolve_accelerate_config(["--accelerate_config", "cpu_zero3"])
    assert resolved == [
        "--config_file",
        str(ours / "cpu_zero3.yaml"),
        "--deepspeed_config_file",
        str(ours / "cpu_zero3.json"),
    ]
    given = ["--deepspeed_config_file", "x.json"]
    assert cli.resolve_accelerate_config(["--accelerate_config", "cpu_zero3", *given]) == [
        "--config_file",
        str(ours / "cpu_zero3.yaml"),
        *given,
    ]
    # TRL's names (those trl-prime does not ship), then a path
    fsdp2 = cli.resolve_accelerate_config(["--accelerate_config", "fsdp2"])
    assert fsdp2[0] == "--config_file" and Path(fsdp2[1]).parts[-2:] == ("accelerate_configs", "fsdp2.yaml")
    assert "trl_prime" not in Path(fsdp2[1]).parts
    mine = tmp_path / "mine.yaml"
    mine.write_text("num_processes: 2\n")
    assert cli.resolve_accelerate_config(["--accelerate_config", str(mine)]) == ["--config_file", str(mine)]
    assert cli.resolve_accelerate_config(["--num_processes", "2"]) == ["--num_processes", "2"]
    with pytest.raises(ValueError, match="trl-prime's configs: cpu_ddp, cpu_zero3, multi_gpu"):
        cli.resolve_accelerate_config(["--accelerate_config", "zero4"])


def test_package_data_ships_the_configs():
    """pyproject's package-data globs cover every accelerate config and the demo's YAML: a wheel ships them."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["trl_prime"]
    package = Path(ROOT, "trl_prime")
    files = [p for p in Path(cli.ACCELERATE_CONFIGS).iterdir() if p.is_file()] + [Path(demo.DEFAULT_CONFIG)]
    for path in files:
        relative = path.relative_to(package).as_posix()
        assert any(fnmatch(relative, g) for g in globs), relative


@pytest.mark.parametrize("command", ["prime", "prl", "prof", "implicit-prm"])
def test_training_command_launches_unless_already_launched(command, monkeypatch):
    """``trl-prime <training command>`` goes through ``accelerate launch``; under a launcher (``torchrun``'s
    ``LOCAL_RANK``) or with ``launch_training=False`` it runs in this process (no second launch)."""
    module = importlib.import_module(f"trl_prime.scripts.{cli.COMMANDS[command][0]}")
    launched, ran = [], []
    monkeypatch.setattr(cli, "launch", lambda *args: launched.append(args))
    monkeypatch.setattr(module, "run", lambda argv: ran.append(argv))
    _clear_launch_env(monkeypatch)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # a user's own export: still launched
    assert cli.main([command, "--max_steps", "1"]) == 0
    assert launched == [(command, ["--max_steps", "1"])] and ran == []
    assert cli.main([command, "--max_steps", "2"], launch_training=False) == 0
    monkeypatch.setenv("LOCAL_RANK", "0")  # what torchrun (and accelerate launch of several processes) sets
    assert cli.already_launched()
    assert cli.main([command, "--max_steps", "3"]) == 0
    assert launched == [(command, ["--max_steps", "1"])] and ran == [["--max_steps", "2"], ["--max_steps", "3"]]


def test_already_launched_by_each_launcher(monkeypatch):
    """Launched: torch.distributed's rank variables (``torchrun``, ``accelerate launch`` of several processes or
    DeepSpeed, ``deepspeed``), or every variable accelerate's single-process launch sets (taken from accelerate's own
    ``prepare_simple_launcher_cmd_env``). Not launched: a bare environment, or ``ACCELERATE_*`` variables a user
    exported."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    _clear_launch_env(monkeypatch)
    bare = dict(os.environ)
    assert not cli.already_launched(bare) and not cli.already_launched()
    torchrun = {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    assert cli.already_launched({**bare, **torchrun})
    assert cli.already_launched({**bare, "LOCAL_RANK": "0"}) and cli.already_launched({**bare, "WORLD_SIZE": "1"})
    args = launch_command_parser().parse_args(["--num_processes", "1", "--cpu", "-m", "trl_prime.scripts.prl"])
    _, accelerate_env = prepare_simple_launcher_cmd_env(_validate_launch_command(args)[0])
    assert not any(k in accelerate_env for k in cli.DISTRIBUTED_LAUNCH_ENV)  # one process: no rank variables
    assert cli.already_launched(accelerate_env)
    for user_export in ({"ACCELERATE_MIXED_PRECISION": "bf16"}, {"ACCELERATE_USE_CPU": "true"}):
        assert not cli.already_launched({**bare, **user_export})
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.already_launched()  # os.environ by default


@pytest.mark.parametrize("command", ["eval", "best-of-n", "demo"])
def test_other_commands_run_in_this_process(command, monkeypatch):
    module = {"eval": evaluate, "best-of-n": best_of_n, "demo": demo}[command]
    ran = []
    monkeypatch.setattr(cli, "launch", lambda *args: pytest.fail("launched"))
    monkeypatch.setattr(module, "run", lambda argv: ran.append(argv))
    _clear_launch_env(monkeypatch)
    assert cli.main([command, "--seed", "1"]) == 0 and ran == [["--seed", "1"]]


@pytest.mark.slow
def test_console_entry_launches_two_processes(tiny_model_path, math_jsonl, tmp_path):  # noqa: F811
    """``python -m trl_prime.cli prl ... --accelerate_config cpu_ddp``: one step of PRL on the tiny model in two CPU
    processes (DDP over gloo) started by ``accelerate launch``; each rank saves its RNG state in the checkpoint."""
    out = tmp_path / "out"
    env = dict(ENV, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for var in (*cli.DISTRIBUTED_LAUNCH_ENV, *cli.ACCELERATE_LAUNCH_ENV):
        env.pop(var, None)
    argv = [
        "prl",
        "--config",
        os.path.join(CONFIGS, "prl_grpo.yaml"),
        "--accelerate_config",
        "cpu_ddp",
        "--main_process_port",
        str(free_port()),
        "--output_dir",
        str(out),
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_name",
        math_jsonl,
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        "--dtype",
        "float32",
        "--max_steps",
        "1",
        "--max_completion_length",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--prl_step_len",
        "3",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--report_to",
        "none",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trl_prime.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    checkpoint = out / "checkpoint-1"
    assert sorted(p.name for p in checkpoint.glob("rng_state*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    with open(checkpoint / "trainer_state.json") as f:
        state = json.load(f)
    logs = [h for h in state["log_history"] if "loss" in h and "train_runtime" not in h]
    assert state["global_step"] == 1 and len(logs) == 1 and "prl/kl_to_go_mean" in logs[0]
    assert (out / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------- demo's packaged YAML
def test_demo_default_config_without_a_checkout(tmp_path, monkeypatch):
    """``trl-prime demo`` without ``--config`` reads the YAML shipped in the package (no ``recipes/`` needed), which is
    the file ``recipes/configs/demo.yaml`` of the checkout links to."""
    package = Path(demo.__file__).resolve().parent
    assert Path(demo.DEFAULT_CONFIG).parent == package and Path(demo.DEFAULT_CONFIG).is_file()
    assert Path(CONFIGS, "demo.yaml").read_bytes() == Path(demo.DEFAULT_CONFIG).read_bytes()
    monkeypatch.chdir(tmp_path)  # no checkout around: relative paths would not resolve
    monkeypatch.delenv("DEMO_STEPS", raising=False)
    demo_args, training_args = demo.parse(["--precision", "fp32"])
    named_args, named_training_args = demo.parse(["--config", demo.DEFAULT_CONFIG, "--precision", "fp32"])
    assert dataclasses.asdict(demo_args) == dataclasses.asdict(named_args)
    assert training_args.to_dict() == named_training_args.to_dict()
    with open(demo.DEFAULT_CONFIG) as f:
        expected = yaml.safe_load(f)
    for field in dataclasses.fields(demo.DemoArguments):
        if field.name != "precision":
            assert getattr(demo_args, field.name) == expected[field.name], field.name
    assert demo_args.precision == "fp32" and training_args.output_dir == expected["output_dir"] == "outputs/demo"
    assert (training_args.max_steps, training_args.prm_beta) == (expected["max_steps"], expected["prm_beta"])


# ------------------------------------------------------------------------------------- a real run through the entry
def test_console_entry_trains_prof_inside_prime(tiny_model_path, math_jsonl, tmp_path, monkeypatch):  # noqa: F811
    """``trl-prime prof --config recipes/configs/prof_prime.yaml`` (its ``trainer: prime_grpo``) for one step on the
    tiny model, in this process (``launch_training=False``): the PRIME trainer with PROF, the policy and the implicit
    PRM saved."""
    from trl_prime import PrimeGRPOTrainer

    trainers = []
    train = utils.train
    monkeypatch.setattr(utils, "train", lambda *a: trainers.append(train(*a)) or trainers[-1])
    out = tmp_path / "out"
    status = cli.main(
        [
            "prof",
            "--config",
            os.path.join(CONFIGS, "prof_prime.yaml"),
            "--output_dir",
            str(out),
            "--model_name_or_path",
            tiny_model_path,
            "--dataset_name",
            math_jsonl,
            "--use_cpu",
            "true",
            "--bf16",
            "false",
            "--dtype",
            "float32",
            "--max_steps",
            "1",
            "--max_completion_length",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--save_strategy",
            "no",
            "--filter_lower",
            "0.0",
            "--filter_upper",
            "1.0",
            "--report_to",
            "none",
        ],
        launch_training=False,
    )
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
    "evaluate_best_of_n": ("best-of-n", best_of_n, "main", ["--prm_paths", "initial"]),  # no trained PRM here
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
    assert cli.main([command, *config_flags, *flags], launch_training=False) == 0
    assert len(calls) == 2
    (from_recipe, recipe_kwargs), (from_cli, cli_kwargs) = calls
    assert [type(a) for a in from_recipe] == [type(a) for a in from_cli]
    assert [_plain(a) for a in from_recipe] == [_plain(a) for a in from_cli]
    assert recipe_kwargs == cli_kwargs
    if name == "prime_lora":  # the LoRA recipe refuses full fine-tuning; `trl-prime prime` allows it
        assert from_recipe[2].use_peft is True
