"""Evaluation metrics: pass@k (the unbiased estimator of Chen et al. 2021), avg@k, micro and macro averages.

Pure Python (no torch, no datasets), used by ``recipes/evaluate.py``.

Definitions, for one problem with ``n`` sampled completions of which ``c`` are correct (reward at least
``threshold``, 1.0 by default; rewards in [0, 1]):

* ``pass@k`` = ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on
  Code", eq. 1): the probability that at least one of ``k`` completions drawn without replacement from the
  ``n`` is correct. ``pass@1 = c / n``. Requires ``1 <= k <= n``.
* ``avg@n`` = the mean reward of the ``n`` completions (for 0/1 rewards, the same as ``pass@1``; for partial
  code rewards, the mean fraction of tests passed).

A dataset's metric is the mean over its problems. Over several datasets, **micro** is the problem-weighted
mean (each problem counts once) and **macro** the plain mean of the per-dataset metrics (each dataset counts
once). A group of a dataset's problems (a data source; MATH's level or subject) gets the same metrics over its
own problems (:func:`grouped_metrics`), with its problem count.

Unscorable samples (reward ``None``/NaN: a gold answer math-verify cannot parse, malformed tests, an
infrastructure error) count as **incorrect with reward 0** -- an evaluation never gets better because the
verifier failed -- and are counted separately (``n_unscored``) so that they are visible.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


__all__ = [
    "aggregate",
    "dataset_metrics",
    "default_ks",
    "format_breakdowns",
    "format_table",
    "grouped_metrics",
    "metric_names",
    "pass_at_k",
    "paired_difference_interval",
    "wilson_interval",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate for one problem: ``1 - C(n - c, k) / C(n, k)``.

    Args:
        n: completions sampled for the problem (``n >= 1``).
        c: correct completions among them (``0 <= c <= n``).
        k: the ``k`` of pass@k (``1 <= k <= n``).

    Returns:
        The estimate in [0, 1], computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (numerically stable; exact 1.0
        when ``n - c < k``).

    Raises:
        ValueError: ``n``, ``c`` or ``k`` out of range (not integers, ``c > n``, ``k > n``, ...).
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}] (sample at least k completions per problem), got {k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def default_ks(n: int) -> list[int]:
    """The k values reported by default for ``n`` samples: 1, the powers of two below ``n``, and ``n``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks = [1]
    k = 2
    while k < n:
        ks.append(k)
        k *= 2
    if n > 1:
        ks.append(n)
    return ks


def metric_names(n: int, ks: Iterable[int] | None = None) -> list[str]:
    """Names of the metrics :func:`dataset_metrics` returns, in table order: ``pass@k``..., ``avg@n``."""
    ks = sorted(set(default_ks(n) if ks is None else ks))
    return [f"pass@{k}" for k in ks] + [f"avg@{n}"]


def _clean(reward) -> tuple[float, bool]:
    """(reward in [0, 1] with unscorable -> 0.0, whether it was scorable)."""
    if reward is None:
        return 0.0, False
    r = float(reward)
    if math.isnan(r):
        return 0.0, False
    if not -1e-9 <= r <= 1.0 + 1e-9:
        raise ValueError(f"rewards must lie in [0, 1] (or be None for unscorable), got {reward!r}")
    return min(max(r, 0.0), 1.0), True


def dataset_metrics(
    rewards: Sequence[Sequence[float | None]],
    ks: Iterable[int] | None = None,
    *,
    threshold: float = 1.0,
) -> dict[str, float | int]:
    """pass@k and avg@n of one dataset from its per-problem rewards.

    Args:
        rewards: one list per problem with the rewards of its ``n`` completions (the same ``n`` for every
            problem); ``None``/NaN = unscorable (counted as incorrect, reward 0).
        ks: the k values of pass@k (default :func:`default_ks`); each must be ``<= n``.
        threshold: a completion is correct when its reward is ``>= threshold``.

    Returns:
        ``{"pass@<k>": ..., "avg@<n>": ..., "n_problems": P, "n_samples": n, "n_correct": C, "n_unscored": U}``
        where each metric is the mean over problems; ``pass@1 == n_correct / (P * n)``.

    Raises:
        ValueError: no problems, problems with different numbers of samples, ``k > n``, rewards outside
            [0, 1], or a threshold outside (0, 1].
    """
    if not rewards:
        raise ValueError("no problems to evaluate")
    n = len(rewards[0])
    if n < 1:
        raise ValueError("each problem needs at least one completion")
    if any(len(r) != n for r in rewards):
        raise ValueError(
            f"every problem must have the same number of completions; got {sorted({len(r) for r in rewards})}"
        )
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    ks = sorted(set(default_ks(n) if ks is None else ks))
    bad = [k for k in ks if not (isinstance(k, int) and 1 <= k <= n)]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n = {n} samples per problem; got k = {bad}")
    sums = dict.fromkeys(ks, 0.0)
    avg_sum = 0.0
    n_correct = n_unscored = 0
    for problem in rewards:
        cleaned = [_clean(r) for r in problem]
        c = sum(1 for r, _ in cleaned if r >= threshold - 1e-12)
        n_correct += c
        n_unscored += sum(1 for _, ok in cleaned if not ok)
        avg_sum += sum(r for r, _ in cleaned) / n
        for k in ks:
            sums[k] += pass_at_k(n, c, k)
    p = len(rewards)
    out: dict[str, float | int] = {f"pass@{k}": sums[k] / p for k in ks}
    out[f"avg@{n}"] = avg_sum / p
    out.update(n_problems=p, n_samples=n, n_correct=n_correct, n_unscored=n_unscored)
    return out


def grouped_metrics(
    rewards: Sequence[Sequence[float | None]],
    groups: Sequence[str | None],
    ks: Iterable[int] | None = None,
    threshold: float = 1.0,
) -> dict[str, dict[str, float | int]]:
    """:func:`dataset_metrics` of each group of problems (a data source, MATH's level or subject).

    Args:
        rewards: one list of rewards per problem, as in :func:`dataset_metrics`.
        groups: the group of each problem (``None``: the group ``"(none)"``).
        ks, threshold: as in :func:`dataset_metrics`.

    Returns:
        ``{group: metrics}`` in sorted group order; the groups' ``n_problems`` add up to ``len(rewards)``.

    Raises:
        ValueError: ``groups`` and ``rewards`` differ in length, and the errors of :func:`dataset_metrics`.
    """
    if len(groups) != len(rewards):
        raise ValueError(f"{len(groups)} groups for {len(rewards)} problems")
    names = ["(none)" if g is None else str(g) for g in groups]
    return {
        g: dataset_metrics([r for r, name in zip(rewards, names) if name == g], ks, threshold=threshold)
        for g in sorted(set(names))
    }


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927), 95% by default.

    Better behaved than ``p +- z*sqrt(p(1-p)/n)`` near 0 and 1 (never outside [0, 1], not empty at p = 0).

    Args:
        successes: correct problems, ``0 <= successes <= n``.
        n: problems, ``>= 1``.
        z: the normal quantile (1.96: 95%).

    Returns:
        ``(low, high)``, fractions in [0, 1].

    Raises:
        ValueError: ``n < 1`` or ``successes`` outside ``[0, n]``.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends: no rounding residue at p = 0 or 1
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def paired_difference_interval(
    before: Sequence[float], after: Sequence[float], z: float = 1.96
) -> tuple[float, float, float]:
    """Mean difference ``after - before`` of per-problem scores on the same problems, with its normal 95% interval.

    Pairing removes the between-problem variance: for 0/1 scores the variance comes only from the problems whose
    verdict changed (the quantity McNemar's test looks at), so the interval is much tighter than two independent
    intervals. It is the normal (Wald) interval of the mean difference: good when dozens of verdicts changed (the
    demo's case), too narrow when only a few did, and ``[0, 0]`` when none did; report the counts of problems that
    changed each way next to it.

    Args:
        before, after: one score per problem (0/1 correctness, or a reward in [0, 1]), same problems, same order.
        z: the normal quantile (1.96: 95%).

    Returns:
        ``(mean, low, high)`` in score units (a fraction for 0/1 scores).

    Raises:
        ValueError: different lengths, or fewer than 2 problems.
    """
    if len(before) != len(after) or len(before) < 2:
        raise ValueError(
            f"paired_difference_interval needs two equally long score lists of >= 2 problems, got "
            f"{len(before)} and {len(after)}"
        )
    d = [float(a) - float(b) for b, a in zip(before, after)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def aggregate(per_dataset: Mapping[str, Mapping[str, float | int]], keys: Iterable[str] | None = None) -> dict:
    """Micro (problem-weighted) and macro (mean over datasets) averages of per-dataset metrics.

    Args:
        per_dataset: ``{dataset: metrics}`` as returned by :func:`dataset_metrics` (each needs ``n_problems``).
        keys: metrics to average (default: the float metrics ``pass@*`` / ``avg@*`` present in every dataset).

    Returns:
        ``{"micro": {key: value, "n_problems": total}, "macro": {key: value, "n_datasets": D}}``; a key missing
        from some dataset (e.g. ``pass@8`` where a dataset has 4 samples) is left out.

    Raises:
        ValueError: no datasets, or a dataset without a positive ``n_problems``.
    """
    if not per_dataset:
        raise ValueError("no datasets to aggregate")
    for name, m in per_dataset.items():
        if not isinstance(m.get("n_problems"), int) or m["n_problems"] < 1:
            raise ValueError(f"dataset {name!r} needs a positive integer 'n_problems', got {m.get('n_problems')!r}")
    if keys is None:
        common = None
        for m in per_dataset.values():
            ks = {k for k in m if k.startswith(("pass@", "avg@"))}
            common = ks if common is None else common & ks
        keys = sorted(common or (), key=_metric_order)
    total = sum(m["n_problems"] for m in per_dataset.values())
    micro: dict[str, float | int] = {}
    macro: dict[str, float | int] = {}
    for key in keys:
        if not all(key in m for m in per_dataset.values()):
            continue
        micro[key] = sum(m[key] * m["n_problems"] for m in per_dataset.values()) / total
        macro[key] = sum(m[key] for m in per_dataset.values()) / len(per_dataset)
    micro["n_problems"] = total
    macro["n_datasets"] = len(per_dataset)
    return {"micro": micro, "macro": macro}


def _metric_order(key: str) -> tuple[int, int]:
    kind, _, k = key.partition("@")
    return (0 if kind == "pass" else 1, int(k) if k.isdigit() else 0)


def format_table(
    per_dataset: Mapping[str, Mapping],
    averages: Mapping[str, Mapping] | None = None,
    keys: Sequence[str] | None = None,
    first_column: str = "dataset",
) -> str:
    """A plain-text table: one row per dataset (metrics in %, problems, unscored) and the micro/macro rows."""
    if keys is None:
        keys = sorted(
            {k for m in per_dataset.values() for k in m if k.startswith(("pass@", "avg@"))}, key=_metric_order
        )
    header = [first_column, "problems", *keys, "unscored"]
    rows = []
    for name, m in per_dataset.items():
        rows.append(
            [
                name,
                str(m.get("n_problems", "")),
                *[f"{100 * m[k]:.1f}" if k in m else "-" for k in keys],
                str(m.get("n_unscored", "")),
            ]
        )
    for label, m in (averages or {}).items():
        # the micro row counts problems; the macro row is a mean over datasets: say so instead of a bare count
        size = str(m["n_problems"]) if "n_problems" in m else (f"{m['n_datasets']} sets" if "n_datasets" in m else "")
        rows.append([f"{label} avg", size, *[f"{100 * m[k]:.1f}" if k in m else "-" for k in keys], ""])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    sep = "  ".join("-" * w for w in widths)
    out = [line(header), sep, *[line(r) for r in rows[: len(per_dataset)]]]
    if averages:
        out += [sep, *[line(r) for r in rows[len(per_dataset) :]]]
    return "\n".join(out)


#: the per-group breakdowns :func:`format_breakdowns` prints, in order, and their row labels
BREAKDOWNS = (("by_level", "level"), ("by_subject", "subject"))


def format_breakdowns(per_dataset: Mapping[str, Mapping], keys: Sequence[str] | None = None) -> str:
    """One table per dataset that has per-level or per-subject metrics (MATH): a row per level, then a row per
    subject (``"level Level 3"``, ``"subject Algebra"``), as in :func:`format_table`; ``""`` when none has."""
    tables = []
    for name, m in per_dataset.items():
        rows = {f"{label} {g}": gm for key, label in BREAKDOWNS for g, gm in (m.get(key) or {}).items()}
        if rows:
            tables.append(f"{name}: by level and subject\n" + format_table(rows, None, keys, first_column="group"))
    return "\n\n".join(tables)
