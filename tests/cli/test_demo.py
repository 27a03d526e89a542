"""`make demo` (`trl-prime demo`, trl_prime/scripts/demo.py; recipes/demo.py is the same): its YAML and DEMO_STEPS parse, its helpers compute what they say, and the whole
pipeline (held-out evaluation before/after, PRIME training, metrics.jsonl, plots, token-reward heatmap, summary) runs
end to end on the tiny offline model and the embedded arithmetic problems."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
from helpers import ROOT


@pytest.fixture(scope="module")
def demo():
    from trl_prime.scripts import demo as script

    return script


def test_recipe_file_and_command_read_the_same_yaml(demo):
    """``python recipes/demo.py`` and ``trl-prime demo`` both default to ``recipes/configs/demo.yaml``."""
    spec = importlib.util.spec_from_file_location("recipe_demo", os.path.join(ROOT, "recipes", "demo.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    yaml_path = os.path.join(ROOT, "recipes", "configs", "demo.yaml")
    assert os.path.samefile(recipe.DEFAULT_CONFIG, yaml_path) and os.path.samefile(demo.DEFAULT_CONFIG, yaml_path)
    with pytest.raises(FileNotFoundError, match="pass --config"):
        demo.parse([], default_config=os.path.join(ROOT, "no_such_demo.yaml"))


def test_default_config_and_demo_steps(demo, monkeypatch, tmp_path):
    monkeypatch.delenv("DEMO_STEPS", raising=False)
    args, training = demo.parse(["--output_dir", str(tmp_path)])
    assert args.model_name_or_path == "embedded:smollm2-135m-instruct" and args.dataset_name == "embedded:arithmetic"
    assert (training.num_generations, training.per_device_train_batch_size, training.max_steps) == (8, 8, 36)
    assert training.learning_rate == 3.5e-6  # 1e-5 x the kept fraction: the step RLOO takes per group at 1e-5
    assert training.gradient_accumulation_steps == 4 == training.steps_per_generation  # 4 prompts x 8 per step
    assert (training.filter_lower, training.filter_upper, training.prm_beta) == (0.1, 0.9, 0.05)
    assert training.beta == 0.0 and args.trainer == "prime"
    # TRL defaults bf16 to True; on a CPU without native bf16 that autocasts every matmul to a slow path
    native = demo.native_bf16(use_cpu=training.use_cpu)  # the demo trains on the CPU (use_cpu: true)
    assert training.use_cpu is True
    assert training.bf16 is native and training.mixed_precision == ("bf16" if native else "no")
    _, training = demo.parse([f"--config={demo.DEFAULT_CONFIG}", "--output_dir", str(tmp_path), "--precision", "fp32"])
    assert training.bf16 is False and training.mixed_precision == "no"
    for steps in ("0", "-1"):  # TRL would read them as "train num_train_epochs" (1500 steps)
        monkeypatch.setenv("DEMO_STEPS", steps)
        with pytest.raises(ValueError, match=f"DEMO_STEPS={steps}: the demo trains a number of steps"):
            demo.parse(["--output_dir", str(tmp_path)])
    for flag, value in (("--model_name_or_path", "embedded:smollm2-360m"), ("--dataset_name", "embedded:arithmetc")):
        with pytest.raises(
            ValueError, match=f"`{flag[2:]}`='{value}': no such embedded name; choose one of embedded:"
        ):
            demo.parse(["--output_dir", str(tmp_path), flag, value])
    monkeypatch.setenv("DEMO_STEPS", "3")
    _, training = demo.parse(["--output_dir", str(tmp_path), "--max_steps", "50"])
    assert training.max_steps == 3  # DEMO_STEPS wins over the YAML and the flags
    with pytest.raises(ValueError, match="`trainer`='ppo'"):
        demo.parse(["--output_dir", str(tmp_path), "--trainer", "ppo"])
    with pytest.raises(ValueError, match="`precision`"):
        demo.parse(["--output_dir", str(tmp_path), "--precision", "fp8"])


def test_rolling_mean_skips_missing_values(demo):
    out = demo.rolling_mean([1.0, float("nan"), 3.0, None, 5.0, 7.0], window=2)
    assert out == [1.0, 1.0, 2.0, 2.0, 4.0, 6.0]
    assert math.isnan(demo.rolling_mean([float("nan")], 3)[0])


def test_pick_heatmap_rows_balances_right_and_wrong(demo):
    records = [
        {"id": f"p{i}", "completions": [f"c{i}"], "rewards": [r]}
        for i, r in enumerate([0.0, 1.0, None, 0.0, 1.0, 1.0, 0.0])
    ]
    rows = demo.pick_heatmap_rows(records, 4)
    assert rows == [("p1", "c1", True), ("p4", "c4", True), ("p0", "c0", False), ("p2", "c2", False)]
    # fewer right answers than half: the rest are wrong ones
    assert [ok for _, _, ok in demo.pick_heatmap_rows(records[:3], 3)] == [True, False, False]


def test_plot_metrics_writes_the_three_plots(demo, tmp_path):
    records = [
        {
            "step": s,
            "reward": 0.1 * s,
            "prm/pair_accuracy": 0.5 + 0.01 * s,
            "filter/kept_fraction": float("nan") if s == 2 else 0.25,
        }
        for s in range(1, 6)
    ]
    paths = demo.plot_metrics(records, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["kept_fraction.png", "prm_pair_accuracy.png", "reward.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # plain RLOO logs no PRM metrics: only the reward plot
    os.makedirs(tmp_path / "rloo")
    paths = demo.plot_metrics([{"step": 1, "reward": 0.2}], str(tmp_path / "rloo"), label="plain RLOO")
    assert [os.path.basename(p) for p in paths] == ["reward.png"]


def test_comparison_plot_and_its_argument(demo, tmp_path):
    """`--compare_with` folders must hold a finished run; the comparison plot draws every run, labelled with its
    trainer, learning rate and seed."""
    folders = []
    for name, trainer in (("prime", "prime"), ("rloo", "rloo")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "reward": 0.1 * s}) + "\n" for s in (1, 2, 3))
        )
        summary = {"trainer": trainer, "learning_rate": 1e-5, "seed": 42, "heldout_accuracy_before": 0.2}
        summary.update(heldout_accuracy_after=0.25, heldout_accuracy_before_95ci=[0.16, 0.25])
        (folder / "summary.json").write_text(json.dumps(summary))
        folders.append(str(folder))
    assert (
        demo.run_label(json.loads((tmp_path / "rloo" / "summary.json").read_text())) == "plain RLOO, lr 1e-05, seed 42"
    )
    assert demo.run_label({"trainer": "prime"}) == "PRIME"
    assert demo.run_label({"trainer": "prime", "filter": [0.1, 0.9], "learning_rate": 3.5e-6}) == (
        "PRIME, filter 0.1-0.9, lr 3.5e-06"
    )
    path = demo.plot_comparison(folders, str(tmp_path / "comparison.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    args = demo.DemoArguments(compare_with=[str(tmp_path)])
    with pytest.raises(ValueError, match="`compare_with`: .* has no summary.json"):
        args.validate()
    demo.DemoArguments(compare_with=folders).validate()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("eval_problems", 1, "give 0 .* or >= 2"),
        ("eval_problems", -3, "give 0 .* or >= 2"),
        ("eval_batch_size", 0, "`eval_batch_size`=0 must be >= 1"),
        ("eval_max_new_tokens", 0, "`eval_max_new_tokens`=0 must be >= 1"),
        ("model_name_or_path", "./no/such/policy", "`model_name_or_path`='./no/such/policy': no such folder"),
    ],
)
def test_demo_arguments_refuse_bad_values_before_training(demo, field, value, message):
    with pytest.raises(ValueError, match=message):
        demo.DemoArguments(**{field: value}).validate()


def test_heldout_intervals_count_the_problems_that_changed(demo, tmp_path):
    """Wilson intervals of each accuracy and the paired change, from the completions files of the two evaluations."""
    from trl_prime.evaluation import wilson_interval

    for name, rewards in (("before", [1, 0, 0, 1, 0]), ("after", [1, 1, 1, 0, None])):
        rows = [{"id": f"p{i}", "completions": ["c"], "rewards": [r]} for i, r in enumerate(rewards)]
        (tmp_path / f"eval_{name}.completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = demo.heldout_intervals(str(tmp_path))
    assert out["heldout_accuracy_before_95ci"] == list(wilson_interval(2, 5))
    change = out["heldout_accuracy_change"]
    # differences 0, +1, +1, -1, 0 (unscored counts 0): mean 0.2
    assert change["mean"] == pytest.approx(0.2) and change["n_problems"] == 5
    assert (change["n_now_right"], change["n_now_wrong"]) == (2, 1)
    assert change["low"] < 0.2 < change["high"]


def test_demo_end_to_end_on_the_tiny_model(demo, tiny_model_path, tmp_path, monkeypatch):
    """The tiny model never boxes an answer: every group is filtered out, so the PRM never moves and stays equal to
    its reference; every token reward in the heatmap is then exactly 0 (the implicit-PRM invariant)."""
    pytest.importorskip("reasoning_gym")
    monkeypatch.delenv("DEMO_STEPS", raising=False)
    out = tmp_path / "demo"
    args, training = demo.parse(
        [
            "--model_name_or_path",
            tiny_model_path,
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "1",
            "--max_completion_length",
            "8",
            "--train_problems",
            "16",
            "--eval_problems",
            "4",
            "--eval_max_new_tokens",
            "8",
            "--heatmap_completions",
            "2",
            "--num_threads",
            "1",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ]
    )
    summary = demo.main(args, training)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        for key in (
            "reward",
            "prm/loss",
            "prm/pair_accuracy",
            "prm/abs_accuracy",
            "filter/kept_fraction",
            "prm/token_reward_mean",
        ):
            assert key in r, key
        assert r["reward"] == 0.0 and r["filter/kept_fraction"] == 0.0
        assert r["prm/loss"] is None and r["prm/pair_accuracy"] is None  # every group filtered: no PRM update
        assert r["prm/token_reward_mean"] == 0.0 == r["prm/token_reward_max"]  # PRM == reference
    assert summary["heldout_accuracy_before"] == 0.0 == summary["heldout_accuracy_after"]
    # 0 of 4 right both times: Wilson upper bound z^2 / (n + z^2), no paired change and no uncertainty about it
    assert summary["heldout_accuracy_before_95ci"] == [0.0, pytest.approx(1.96**2 / (4 + 1.96**2))]
    assert summary["heldout_accuracy_change"] == {
        "mean": 0.0,
        "low": 0.0,
        "high": 0.0,
        "n_problems": 4,
        "n_now_right": 0,
        "n_now_wrong": 0,
    }
    assert summary["num_generations"] == 8 and summary["prompts_per_step"] == 1 and summary["max_steps"] == 2
    for name in (
        "reward.png",
        "kept_fraction.png",
        "token_rewards.png",
        "token_rewards.html",
        "summary.json",
        "eval_before.json",
        "eval_after.json",
    ):
        assert (out / name).is_file(), name
    assert (out / "policy" / "prm" / "implicit_prm_config.json").is_file()
    html = (out / "token_rewards.html").read_text()
    assert html.count("<p><b>wrong</b>, sum +0.000") == 2
    assert json.loads((out / "summary.json").read_text())["trainer"] == "prime"
