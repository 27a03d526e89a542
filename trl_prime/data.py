"""Prompt datasets for trl-prime: embedded reasoning-gym problems, local files and the Eurus-2-RL-Data format.

Every loader returns a :class:`datasets.Dataset` with the same columns (:data:`FEATURES`), which are the
columns the outcome verifiers read (TRL passes every dataset column to reward functions as a keyword):

* ``id`` (``str``): stable row id -- the same row gets the same id on every load.
* ``data_source`` (``str``): where the row comes from (``numina_olympiads``, ``taco``,
  ``reasoning_gym/basic_arithmetic``, ...).
* ``ability`` (``str``): ``"math"`` or ``"code"`` -- which verifier scores the row.
* ``prompt`` (``list[{"role": str, "content": str}]``): the conversational prompt (TRL's conversational format).
* ``solution`` (``str | None``): math gold answer, parsed by :func:`~trl_prime.rewards.math_reward`; None on
  code rows.
* ``tests`` (``str | None``): code test cases as a JSON string, read by :func:`~trl_prime.rewards.code_reward`;
  None on math rows.

Sources
-------
* ``embedded:<name>`` (:data:`EMBEDDED_DATASETS`): problems generated offline by the ``reasoning-gym`` package
  (Apache-2.0; ``pip install reasoning-gym``) -- real task families with gold answers: ``basic_arithmetic``,
  ``chain_sum``, ``gsm_symbolic`` (built from GSM8K templates), ... See :func:`load_reasoning_gym`.
* a local ``.json`` / ``.jsonl`` / ``.parquet`` file, or a folder of them (``train.jsonl``, ``test.jsonl``, ...).
* a Hugging Face Hub dataset id (e.g. ``PRIME-RL/Eurus-2-RL-Data``), loaded with :func:`datasets.load_dataset`.

Files and Hub datasets are read in the **Eurus-2-RL-Data format** (PRIME's prompt set)::

    {"data_source": "numina_olympiads",              # or "taco", "apps", "codecontests", "codeforces", ...
     "prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "ability": "math",                              # or "code"
     "reward_model": {"style": "rule", "ground_truth": "\\\\frac{1}{2}"},   # code: JSON string of test cases
     "extra_info": {"split": "train", "index": 17}}

Simpler rows are accepted too: ``prompt`` may be a plain string (it becomes one user message); the gold answer
may be in a ``solution`` or ``answer`` column (math) or a ``tests`` column (code, a dict or its JSON string);
``ability`` may be missing when ``data_source`` names a known source (:func:`route_of`). Columns other than
those above are dropped.

Two public math formats are read too, picked from the columns by :func:`detect_format` (or forced with
``dataset_format``), so that a benchmark file downloaded once is evaluated without Hub access:

* **GSM8K** (``openai/gsm8k``): ``{"question": ..., "answer": "...reasoning...\\n#### 1,234"}``; the prompt is
  the question, the gold the number after ``####`` with its commas removed (:func:`gsm8k_gold`: ``"1234"``).
* **MATH / MATH-500**: ``{"problem": ..., "solution": "...\\boxed{...}...", "answer": ..., "level": "Level 3",
  "subject": "Algebra"}`` (MATH-500; the original MATH has no ``answer`` and calls the subject ``type``); the
  prompt is the problem, the gold ``answer``, else the last ``\\boxed{}`` of ``solution`` (:func:`math_gold`).
  With ``metadata=True`` the ``level`` and ``subject`` are kept (:data:`METADATA_COLUMNS`), for per-level and
  per-subject accuracy in ``trl-prime eval``.

Both are math rows (``ability="math"``); the prompt is the question as written (no instruction is added: pass
a system prompt that asks for ``\\boxed{}``, e.g. ``trl-prime eval --system_prompt``).

Bad input
---------
* **Dataset-level problems raise** :class:`ValueError` naming the column and the fix: no prompt column, no
  gold column at all (``reward_model`` / ``solution`` / ``answer`` / ``tests``), a file that does not exist or
  has an unknown extension, no usable row, or more than ``max_bad_fraction`` of the rows malformed (a format
  mismatch, not a few bad rows). So does a local JSON file that is broken rather than holding a bad row, naming
  the file and line: bytes that are not UTF-8, JSON nested deeper than Python's json reader goes, a row longer
  than ``max_row_bytes`` (1 MiB by default). JSON Lines rows end at ``\\n`` only (U+2028, U+2029 and U+0085 are
  legal inside JSON strings), and a UTF-8 byte-order mark is accepted.
* **Row-level problems drop the row with a warning and a count** (``on_bad_rows="drop"``, the default): an
  empty prompt or one that is not a string / list of chat messages, a missing gold answer, a gold that is not a
  finite number (JSON ``NaN`` / ``Infinity``, or the strings ``"nan"`` / ``"inf"``: ``bad_gold``), code tests
  that are not a JSON object, an ability that is neither math nor code and a data source that does not say which
  (unless every row is read as math: ``ability="math"``), a line of a JSONL file that is not JSON, a GSM8K
  ``answer`` with no number after ``####``. One
  :class:`UserWarning` per load lists the count of each reason and the first row numbers;
  ``return_report=True`` also returns them as a :class:`LoadReport`. With ``on_bad_rows="error"`` the first
  malformed row raises instead, naming the field (and, in a JSONL file, the file and line). A run therefore
  never dies on one bad row, and never loses rows silently.

Routing rewards
---------------
:func:`make_routed_reward` (default instance :data:`outcome_reward`) is a TRL reward function that sends each
row to :func:`~trl_prime.rewards.math_reward` or :func:`~trl_prime.rewards.code_reward` by its ``ability``
(falling back to ``data_source``), and returns ``None`` (counted in ``last_counts["unrouted"]``) for rows it
cannot route.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any


logger = logging.getLogger(__name__)

__all__ = [
    "BOXED_INSTRUCTION",
    "COLUMNS",
    "DATASET_FORMATS",
    "EMBEDDED_DATASETS",
    "EMBEDDED_PREFIX",
    "FEATURES",  # noqa: F822 (built on first access by the module __getattr__)
    "EmbeddedDataset",
    "LoadReport",
    "METADATA_COLUMNS",
    "detect_format",
    "gsm8k_gold",
    "load_prompt_dataset",
    "load_reasoning_gym",
    "make_routed_reward",
    "math_gold",
    "normalize_rows",
    "outcome_reward",
    "route_of",
]

EMBEDDED_PREFIX = "embedded:"

#: appended to every reasoning-gym question (one blank line after it)
BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."

#: the columns of every dataset this module returns, in order
COLUMNS: tuple[str, ...] = ("id", "data_source", "ability", "prompt", "solution", "tests")

#: extra columns of file / Hub data loaded with ``metadata=True`` (MATH's difficulty level and subject)
METADATA_COLUMNS: tuple[str, ...] = ("level", "subject")

#: row formats of files and Hub data (``"auto"``: :func:`detect_format` picks one from the columns)
DATASET_FORMATS: tuple[str, ...] = ("auto", "eurus", "gsm8k", "math")

#: fraction of the question space (by hash of the question text) reserved for the held-out split
TEST_FRACTION = 0.125
# the test split draws reasoning-gym items from a seed range far from the train split's
_TEST_SEED_OFFSET = 1_000_000_007


def _features(metadata: bool = False):
    from datasets import Features, List, Value

    columns = {
        "id": Value("string"),
        "data_source": Value("string"),
        "ability": Value("string"),
        "prompt": List({"role": Value("string"), "content": Value("string")}),
        "solution": Value("string"),
        "tests": Value("string"),
    }
    if metadata:
        columns.update({c: Value("string") for c in METADATA_COLUMNS})
    return Features(columns)


def __getattr__(name):
    if name == "FEATURES":
        return _features()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ====================================================================================================== routing


def route_of(ability: Any = None, data_source: Any = None) -> str | None:
    """Which verifier scores a row: a registered ability (``"math"``, ``"code"``, ...) or ``None`` (unknown).

    ``ability`` decides when it names a verifier of :mod:`trl_prime.rewards.registry` (case-insensitive);
    otherwise ``data_source`` does (each verifier's ``sources``):
    the Eurus-2-RL-Data sources (``numina_*`` are math; ``taco``, ``apps``, ``codecontests``, ``codeforces``
    are code), ``gsm8k`` / MATH variants, ``reasoning_gym/*`` (math), and ``humaneval`` / ``mbpp`` /
    ``livecodebench`` / ``leetcode`` (code).
    """
    from trl_prime.rewards.registry import verifiers

    registered = verifiers()
    if isinstance(ability, str) and ability.strip().lower() in {v.ability for v in registered}:
        return ability.strip().lower()
    if isinstance(data_source, str):
        s = data_source.strip().lower()
        for v in registered:
            if v.claims_source(s):
                return v.ability
    return None


def make_routed_reward(
    math_fn: Callable[..., list] | None = None,
    code_fn: Callable[..., list] | None = None,
    *,
    name: str = "outcome_reward",
    reward_fns: Mapping[str, Callable[..., list]] | None = None,
) -> Callable[..., list[float | None]]:
    """A TRL reward function that scores each row with the verifier of its route.

    The routes and their gold columns come from :mod:`trl_prime.rewards.registry` (``math``: ``solution``,
    ``code``: ``tests``, and any verifier registered there), read at each call.

    Args:
        math_fn: reward function for math rows, called as ``math_fn(completions, solution=[...])``
            (default: the registry's, :func:`trl_prime.rewards.math_reward`).
        code_fn: reward function for code rows, called as ``code_fn(completions, tests=[...])``
            (default: the registry's, :func:`trl_prime.rewards.code_reward`).
        name: the function's ``__name__`` (TRL logs ``rewards/<name>/mean``).
        reward_fns: ability -> reward function, overriding the registry's for any route.

    Returns:
        ``reward(completions, *, ability=None, data_source=None, <gold columns>=None, **kwargs)`` returning one
        ``float | None`` per completion. Each row is routed with :func:`route_of`; rows routed nowhere get
        ``None`` (NaN in TRL: excluded from means and baselines) and are counted. After each call,
        ``reward.last_counts == {"math": m, "code": c, ..., "unrouted": u}``; when TRL passes ``log_metric``, the
        counts are logged as ``route/<key>`` and the verifiers log their own reason counts.

    Raises:
        ValueError: (when called) rows are routed to a verifier whose gold column is missing, or a column's
            length differs from ``completions``.
    """
    from trl_prime.rewards.registry import verifiers

    overrides = {"math": math_fn, "code": code_fn, **(reward_fns or {})}

    def reward(completions, ability=None, data_source=None, **kwargs):
        n = len(completions)
        registered = verifiers()
        columns = {"ability": ability, "data_source": data_source}
        columns.update({v.gold_column: kwargs.pop(v.gold_column, None) for v in registered})
        for col, values in columns.items():
            if values is not None and len(values) != n:
                raise ValueError(f"{reward.__name__}: column {col!r} has {len(values)} values for {n} completions")
        routes = [
            route_of(ability[i] if ability is not None else None, data_source[i] if data_source is not None else None)
            for i in range(n)
        ]
        out: list[float | None] = [None] * n
        extra = {"log_metric": kwargs["log_metric"]} if callable(kwargs.get("log_metric")) else {}
        counts = {v.ability: 0 for v in registered}
        for v in registered:
            idx = [i for i, r in enumerate(routes) if r == v.ability]
            counts[v.ability] = len(idx)
            if not idx:
                continue
            values = columns[v.gold_column]
            if values is None:
                raise ValueError(
                    f"{reward.__name__}: {len(idx)} rows are routed to the {v.ability} verifier but the dataset has "
                    f"no {v.gold_column!r} column; load the data with trl_prime.data.load_prompt_dataset, or add the "
                    "column"
                )
            fn = overrides.get(v.ability) or v.reward_fn()
            scores = fn([completions[i] for i in idx], **{v.gold_column: [values[i] for i in idx]}, **extra)
            for i, s in zip(idx, scores):
                out[i] = s
        counts["unrouted"] = n - sum(counts.values())
        if counts["unrouted"]:
            first = next(i for i, r in enumerate(routes) if r is None)
            logger.warning(
                "%s: %d of %d rows have no route (ability %r, data_source %r for row %d); they get reward None. "
                "Set the 'ability' column to one of %s.",
                reward.__name__,
                counts["unrouted"],
                n,
                ability[first] if ability is not None else None,
                data_source[first] if data_source is not None else None,
                first,
                [v.ability for v in registered],
            )
        reward.last_counts = counts
        if extra:
            for key, value in counts.items():
                extra["log_metric"](f"route/{key}", float(value))
        return out

    reward.__name__ = reward.__qualname__ = name
    reward.last_counts = {**{v.ability: 0 for v in verifiers()}, "unrouted": 0}
    return reward


#: the default routed reward: each row scored by its registered verifier (``math_reward``, ``code_reward``), else None
outcome_reward = make_routed_reward()


# ====================================================================================================== reasoning-gym


@dataclass(frozen=True)
class EmbeddedDataset:
    """A named reasoning-gym mixture: the tasks and their generator settings."""

    tasks: tuple[str, ...]
    task_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    description: str = ""
    few_shot: int = 1


#: settings of the offline demo's problems: one addition, subtraction or multiplication of two 1-2 digit
#: numbers (reasoning-gym's simple mode: operands 0..10 or 0..100, no parentheses, no negative operands).
#: reasoning-gym draws the operator uniformly from the list, so ``+`` comes 1 time in 5 and ``-`` and ``*``
#: 2 times in 5 each. Measured on 100 held-out problems (``embedded:arithmetic``, one-shot, seed 0) with
#: ``recipes/evaluate.py``: SmolLM2-135M-Instruct is right 13.0% of the time sampled at temperature 1
#: (pass@4 29%; additions 31%, subtractions 8%, multiplications 11%) and 27% greedy.
DEMO_ARITHMETIC = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ("+", "-", "-", "*", "*"),
    "allow_parentheses": False,
    "allow_negation": False,
}

_CHAIN_SUM_EASY = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}

#: names accepted as ``embedded:<name>`` by :func:`load_prompt_dataset`
EMBEDDED_DATASETS: dict[str, EmbeddedDataset] = {
    "arithmetic": EmbeddedDataset(
        ("basic_arithmetic",),
        {"basic_arithmetic": DEMO_ARITHMETIC},
        "a + b, a - b or a * b with 1-2 digit operands; the offline demo's problems (one-shot)",
    ),
    "chain_sum": EmbeddedDataset(
        ("chain_sum",), {"chain_sum": _CHAIN_SUM_EASY}, "sums/differences of 2-3 numbers of 1-2 digits"
    ),
    "gsm_symbolic": EmbeddedDataset(("gsm_symbolic",), {}, "GSM8K-style word problems from GSM-Symbolic templates"),
    "mixed": EmbeddedDataset(
        ("basic_arithmetic", "chain_sum", "gsm_symbolic"),
        {"basic_arithmetic": DEMO_ARITHMETIC, "chain_sum": _CHAIN_SUM_EASY},
        "the three above, interleaved",
    ),
}


def _question_hash(task: str, question: str) -> float:
    digest = hashlib.sha256(f"{task}\n{' '.join(question.split())}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


_ALLOWED_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _exact_value(expression: str) -> Fraction | None:
    """Exact value of an integer + - * / expression (true division); None if it is not such an expression."""
    try:
        tree = ast.parse(expression.strip().rstrip("="), mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_BINOPS:
            return _ALLOWED_BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported")

    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def _gold_is_exact(item: Mapping[str, Any]) -> bool:
    """For arithmetic tasks, check the gold answer against the exact value of the expression.

    reasoning-gym's ``basic_arithmetic`` evaluates ``/`` as floor division; a row whose expression does not
    divide exactly would teach a wrong answer, so such rows are skipped.
    """
    expression = (item.get("metadata") or {}).get("expression")
    if not isinstance(expression, str):
        return True
    value = _exact_value(expression)
    if value is None:
        return True  # not a plain arithmetic expression: trust the generator
    try:
        return Fraction(str(item["answer"]).strip()) == value
    except (ValueError, ZeroDivisionError):
        return False


# the solved examples of few-shot prompts come from this seed's stream, restricted to the train partition
_SHOT_SEED = 2_718_281_828


def _demonstration(item: Mapping[str, Any]) -> str:
    """A worked answer for a solved example: the task's own chain of thought or expression, then the box."""
    answer = str(item["answer"]).strip()
    meta = item.get("metadata") or {}
    cot = meta.get("answer_cot")
    if isinstance(cot, str) and cot.strip():
        lines = [line for line in cot.strip().splitlines() if not line.strip().startswith("####")]
        return "\n".join(lines + [f"The final answer is \\boxed{{{answer}}}."])
    expression = meta.get("expression")
    if isinstance(expression, str) and expression.strip():
        return f"{expression.strip()} = {answer}. The final answer is \\boxed{{{answer}}}."
    return f"The final answer is \\boxed{{{answer}}}."


def _user_content(question: str, instruction: str) -> str:
    return f"{question}\n\n{instruction}" if instruction else question


def _shots(
    rg, task: str, config: Mapping[str, Any], k: int, test_fraction: float, instruction: str
) -> tuple[list[dict[str, str]], set[str]]:
    """``k`` solved train-partition examples as alternating user/assistant messages, and their questions."""
    if k <= 0:
        return [], set()
    gen = rg.create_dataset(task, seed=_SHOT_SEED, size=1000 + 50 * k, **dict(config))
    messages: list[dict[str, str]] = []
    questions: set[str] = set()
    for idx in range(1000 + 50 * k):
        item = gen[idx]
        question = str(item["question"]).strip()
        key = " ".join(question.split())
        answer = str(item["answer"]).strip()
        if (
            _question_hash(task, question) < test_fraction
            or key in questions
            or not answer
            or not _gold_is_exact(item)
        ):
            continue
        if answer in re.findall(r"-?\d+(?:\.\d+)?", question):
            continue  # a degenerate example (0 * 7 = 0, 9 - 0 = 9) teaches copying a number
        questions.add(key)
        messages += [
            {"role": "user", "content": _user_content(question, instruction)},
            {"role": "assistant", "content": _demonstration(item)},
        ]
        if len(questions) == k:
            return messages, questions
    raise ValueError(
        f"reasoning-gym task {task!r}: could not find {k} distinct solved examples for the few-shot "
        "prompt; lower few_shot"
    )


def _require_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "the embedded problems need the `reasoning-gym` package: `pip install reasoning-gym` "
            "(or `pip install -e '.[demo]'`)"
        ) from e
    return reasoning_gym


def _task_rows(
    rg,
    task: str,
    config: Mapping[str, Any],
    size: int,
    seed: int,
    split: str,
    test_fraction: float,
    instruction: str,
    few_shot: int,
) -> tuple[list[dict], Counter]:
    shots, shot_questions = _shots(rg, task, config, few_shot, test_fraction, instruction)
    base_seed = seed if split == "train" else seed + _TEST_SEED_OFFSET
    budget = 50 * size + 1000
    try:
        gen = rg.create_dataset(task, seed=base_seed, size=budget, **dict(config))
    except (ValueError, TypeError, AssertionError) as e:
        raise ValueError(f"reasoning-gym task {task!r} rejected task_configs[{task!r}] = {dict(config)!r}: {e}") from e
    rows: list[dict] = []
    seen: set[str] = set()
    skipped: Counter = Counter()
    for idx in range(budget):
        if len(rows) >= size:
            break
        item = gen[idx]
        question = str(item["question"]).strip()
        answer = str(item["answer"]).strip()
        key = " ".join(question.split())
        if (_question_hash(task, question) < test_fraction) != (split == "test"):
            continue  # belongs to the other split
        if key in seen:
            skipped["duplicate"] += 1
            continue
        if key in shot_questions:
            skipped["few_shot_example"] += 1
            continue
        if not answer:
            skipped["empty_answer"] += 1
            continue
        if not _gold_is_exact(item):
            skipped["inexact_gold"] += 1
            continue
        seen.add(key)
        rows.append(
            {
                "id": f"{task}/{split}/{seed}/{idx}",
                "data_source": f"reasoning_gym/{task}",
                "ability": "math",
                "prompt": shots + [{"role": "user", "content": _user_content(question, instruction)}],
                "solution": answer,
                "tests": None,
            }
        )
    if len(rows) < size:
        warnings.warn(
            f"reasoning-gym task {task!r} ({split} split) yielded only {len(rows)} distinct questions of the "
            f"{size} requested in {budget} draws; its question space is too small for this size (widen "
            f"task_configs[{task!r}], e.g. more digits or terms, or ask for fewer rows)",
            UserWarning,
            stacklevel=3,
        )
    return rows, skipped


def load_reasoning_gym(
    tasks: str | Sequence[str] = ("basic_arithmetic",),
    size: int = 1000,
    seed: int = 0,
    split: str = "train",
    task_configs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    instruction: str = BOXED_INSTRUCTION,
    few_shot: int = 0,
    test_fraction: float = TEST_FRACTION,
):
    """Generate reasoning-gym problems offline as a prompt dataset with gold answers.

    Args:
        tasks: reasoning-gym task names (``"basic_arithmetic"``, ``"chain_sum"``, ``"gsm_symbolic"``, ... any
            task whose answer is a number or expression ``math_reward`` can check).
        size: total rows, split as evenly as possible across ``tasks`` (earlier tasks get the remainder); the
            tasks are interleaved round-robin, so any prefix of the dataset mixes them.
        seed: generator seed; the same arguments always give the same rows (and ids).
        split: ``"train"`` or ``"test"``. The two never share a question: each question belongs to exactly one
            split by a hash of its (whitespace-normalised) text (``test_fraction`` of the question space is
            held out), and the test split also draws from a different seed range. Within a split, duplicate
            questions are skipped.
        task_configs: per task, keyword arguments of its reasoning-gym config (difficulty), e.g.
            ``{"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}``;
            unspecified fields keep reasoning-gym's defaults. :data:`DEMO_ARITHMETIC` is the demo's setting.
        instruction: appended to each question after a blank line (default :data:`BOXED_INSTRUCTION`).
        few_shot: solved examples put before the question as earlier user/assistant turns of the conversation
            (the same ones for every row of a task, in both splits; drawn from the train side of the question
            space, and never also a row). An example's answer is the task's own chain of thought (GSM-Symbolic)
            or ``"<expression> = <answer>."``, then ``"The final answer is \\boxed{<answer>}."``. Small models
            rarely use ``\\boxed{}`` from the instruction alone: on the demo's arithmetic, SmolLM2-135M-Instruct
            boxes 0 of 50 greedy answers zero-shot and 99 of 100 one-shot.
        test_fraction: share of the question space held out; keep the default so train and test loads agree.

    Returns:
        A :class:`datasets.Dataset` with the :data:`COLUMNS`: ``id`` = ``"<task>/<split>/<seed>/<index>"``,
        ``data_source`` = ``"reasoning_gym/<task>"``, ``ability`` = ``"math"``, ``prompt`` = the ``few_shot``
        example turns and one user message (question + instruction),
        ``solution`` = the gold answer string, ``tests`` = None. Arithmetic rows whose gold answer is not the
        exact value of their expression (reasoning-gym floors ``/``) are skipped.

    Raises:
        ValueError: unknown task, bad ``split`` / ``size`` / ``test_fraction``, or a config reasoning-gym rejects.
        ImportError: ``reasoning-gym`` is not installed (the message gives the pip command).

    Warns:
        UserWarning: a task's question space is too small to give its share of ``size`` distinct questions.
    """
    from datasets import Dataset

    rg = _require_reasoning_gym()
    if isinstance(tasks, str):
        tasks = (tasks,)
    tasks = tuple(tasks)
    if not tasks:
        raise ValueError("tasks is empty; name at least one reasoning-gym task, e.g. tasks=('basic_arithmetic',)")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not (isinstance(size, int) and size >= 1):
        raise ValueError(f"size must be a positive integer, got {size!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if not (isinstance(few_shot, int) and few_shot >= 0):
        raise ValueError(f"few_shot must be an integer >= 0, got {few_shot!r}")
    from reasoning_gym.factory import DATASETS

    unknown = [t for t in tasks if t not in DATASETS]
    if unknown:
        raise ValueError(f"unknown reasoning-gym task(s) {unknown}; known tasks include {sorted(DATASETS)[:40]}...")
    task_configs = dict(task_configs or {})
    extra = sorted(set(task_configs) - set(tasks))
    if extra:
        raise ValueError(f"task_configs has entries {extra} for tasks not in tasks={list(tasks)}")
    shares = [size // len(tasks) + (i < size % len(tasks)) for i in range(len(tasks))]
    per_task = []
    for task, share in zip(tasks, shares):
        if share == 0:
            per_task.append([])
            continue
        rows, skipped = _task_rows(
            rg, task, task_configs.get(task, {}), share, seed, split, test_fraction, instruction, few_shot
        )
        if skipped:
            logger.info("reasoning-gym %s (%s): skipped %s", task, split, dict(skipped))
        per_task.append(rows)
    mixed = [rows[i] for i in range(max(map(len, per_task))) for rows in per_task if i < len(rows)]
    return Dataset.from_list(mixed, features=_features())


# ====================================================================================================== files / Hub


@dataclass
class LoadReport:
    """What :func:`normalize_rows` kept and dropped.

    Attributes:
        source: the dataset name or path.
        total: rows read (including malformed lines of a JSONL file).
        kept: rows in the returned dataset.
        dropped: ``{reason: count}``; reasons: ``bad_json``, ``empty_prompt``, ``bad_prompt``, ``missing_gold``,
            ``bad_gold`` (a GSM8K answer without a number), ``bad_tests``, ``unknown_ability``.
        examples: ``{reason: [row numbers]}`` (0-based, at most 5 per reason).
    """

    source: str
    total: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)

    def summary(self) -> str:
        parts = [f"{k}={v} (rows {', '.join(map(str, self.examples.get(k, [])))})" for k, v in self.dropped.items()]
        return "; ".join(parts)


class _BadRow(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


_GOLD_COLUMNS = ("reward_model", "solution", "answer", "tests")


def _prompt_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow("empty_prompt", "the prompt is an empty string")
        return [{"role": "user", "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise _BadRow(
            "bad_prompt" if value not in (None, [], ()) else "empty_prompt",
            f"the prompt must be a string or a non-empty list of {{'role', 'content'}} messages, "
            f"got {type(value).__name__}",
        )
    messages = []
    for j, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _BadRow("bad_prompt", f"prompt message {j} must be a dict with a string 'role' and 'content'")
        content = m.get("content")
        if isinstance(content, (list, tuple)):  # content parts
            content = "".join(p.get("text", "") if isinstance(p, Mapping) else str(p) for p in content)
        if not isinstance(content, str):
            raise _BadRow(
                "bad_prompt", f"prompt message {j} has content of type {type(content).__name__}; use a string"
            )
        messages.append({"role": m["role"], "content": content})
    if not any(m["role"] != "system" and m["content"].strip() for m in messages):
        raise _BadRow("empty_prompt", "the prompt has no non-empty user message")
    return messages


def _gold_of(row: Mapping[str, Any], route: str) -> Any:
    rm = row.get("reward_model")
    if isinstance(rm, str):
        try:
            rm = json.loads(rm)
        except ValueError:
            rm = None
    if isinstance(rm, Mapping) and rm.get("ground_truth") not in (None, ""):
        return rm["ground_truth"]
    keys = ("solution", "answer") if route == "math" else ("tests",)
    for k in keys:
        if row.get(k) not in (None, ""):
            return row[k]
    return None


# ------------------------------------------------------------------------------------------ GSM8K and MATH rows

_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d+)?(?:/\d+)?|\.\d+)")  # 72, -5, 2.5, .5, 3/4


def gsm8k_gold(answer: Any) -> str:
    """The gold number of a GSM8K ``answer`` field: the number after its last ``####``, commas removed.

    GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") ends each reference solution
    with a line ``#### <number>``: ``"...reasoning...\n#### 1,234"`` -> ``"1234"``, ``"#### -5"`` -> ``"-5"``,
    ``"#### 0.25"`` -> ``"0.25"``, ``"#### $18"`` -> ``"18"``, ``"#### 3/4"`` -> ``"3/4"``. An ``answer`` without ``####`` is accepted when it is
    itself a number (``"72"``, ``72``, ``"1,000"``).

    Raises:
        ValueError: ``answer`` is missing/empty, not a string or number, or holds no number where one is expected.
    """
    if answer is None:
        raise ValueError("the gold field 'answer' is missing")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise ValueError(f"the gold field 'answer' must be a non-empty string or number, got {answer!r}")
    text = str(answer)
    if "####" in text:
        tail = text.rsplit("####", 1)[1].replace(",", "").strip()
        m = _NUMBER_RE.search(tail)
        if m is None:
            raise ValueError(f"the gold field 'answer' has no number after its last '####' (got {tail[:40]!r})")
        return m.group(0)
    plain = text.replace(",", "").strip()
    if _NUMBER_RE.fullmatch(plain) is None:
        raise ValueError(
            "the gold field 'answer' has no '#### <number>' final line and is not a number "
            f"(got {text.strip()[-40:]!r})"
        )
    return plain


def math_gold(answer: Any = None, solution: Any = None) -> str:
    """The gold answer of a MATH / MATH-500 row: ``answer`` when present, else the last ``\\boxed{...}`` of
    ``solution``.

    MATH (Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With the MATH Dataset") marks the final
    answer of each solution with ``\\boxed{}``; MATH-500 also stores it in an ``answer`` field. The box is the last
    complete top-level ``\\boxed{}`` / ``\\fbox{}``, braces balanced (``\\boxed{\\frac{1}{2}}`` ->
    ``\\frac{1}{2}``), found by :func:`trl_prime.rewards.math_verifier.extract_answer`, the reader of completions.

    Raises:
        ValueError: no non-empty ``answer`` and no complete ``\\boxed{}`` in ``solution``.
    """
    if not isinstance(answer, bool) and isinstance(answer, (str, int, float)) and str(answer).strip():
        return str(answer).strip()
    if isinstance(solution, str):
        from trl_prime.rewards.math_verifier import extract_answer

        boxed = extract_answer(solution)
        if boxed:
            return boxed
    raise ValueError(
        "no gold answer: the field 'answer' is missing or empty and the field 'solution' has no complete "
        f"\\boxed{{...}} (solution: {str(solution)[-60:]!r})"
    )


def detect_format(columns: Iterable[str], prompt_column: str = "prompt") -> str:
    """The row format of a file or Hub dataset from its column names (:data:`DATASET_FORMATS`).

    * ``"eurus"`` (Eurus-2-RL-Data and the simpler rows of the module doc) when ``prompt_column`` or
      ``reward_model`` is a column;
    * else ``"gsm8k"`` when ``question`` and ``answer`` are columns (``openai/gsm8k``);
    * else ``"math"`` when ``problem`` and ``answer`` or ``solution`` are (MATH, MATH-500);
    * else ``"eurus"`` (whose checks then name the missing columns).
    """
    cols = set(columns)
    if prompt_column in cols or "reward_model" in cols:
        return "eurus"
    if {"question", "answer"} <= cols:
        return "gsm8k"
    if "problem" in cols and cols & {"answer", "solution"}:
        return "math"
    return "eurus"


def _level_subject(row: Mapping[str, Any], fmt: str) -> dict[str, str | None]:
    """``level`` (an integer level ``3`` of MATH-500 becomes ``"Level 3"``, as in MATH) and ``subject`` (MATH's
    ``type``), as strings or None."""
    level = row.get("level")
    if isinstance(level, int) and not isinstance(level, bool):
        level = f"Level {level}"
    subject = row.get("subject")
    if subject in (None, "") and fmt == "math":
        subject = row.get("type")
    clean = {}
    for key, value in (("level", level), ("subject", subject)):
        clean[key] = value.strip() if isinstance(value, str) and value.strip() else None
    return clean


def _public_row(row: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    """A GSM8K / MATH row as a generic math row (``prompt``, ``solution``, ``ability="math"``, ``id``, source)."""
    field_name = "question" if fmt == "gsm8k" else "problem"
    prompt = row.get(field_name)
    if not isinstance(prompt, str) or not prompt.strip():
        raise _BadRow("empty_prompt", f"{fmt} row without its prompt: the field {field_name!r} is {prompt!r}")
    try:
        if fmt == "gsm8k":
            gold = gsm8k_gold(row.get("answer"))
        else:
            gold = math_gold(row.get("answer"), row.get("solution"))
    except ValueError as e:
        reason = "bad_gold" if fmt == "gsm8k" and row.get("answer") not in (None, "") else "missing_gold"
        raise _BadRow(reason, f"{fmt} row: {e}") from None
    _check_finite_gold(gold)
    out = {"prompt": prompt, "solution": gold, "ability": "math", "data_source": row.get("data_source")}
    rid = row.get("id", row.get("unique_id"))
    if rid is not None:
        out["id"] = rid
    return out


def _check_finite_gold(gold: Any) -> None:
    """Refuse a gold answer that is a non-finite number (JSON's ``NaN`` / ``Infinity``, which Python's ``json`` reads
    as floats, or their strings): ``\\boxed{nan}`` would score 1.0 against it."""
    text = gold.strip().lower().lstrip("+-") if isinstance(gold, str) else None
    if (isinstance(gold, float) and not math.isfinite(gold)) or text in ("nan", "inf", "infinity"):
        raise _BadRow("bad_gold", f"the gold answer is {gold!r}, not a finite number or expression; fix the row")


def _normalize_row(
    row: Mapping[str, Any], i: int, source: str, split: str, prompt_column: str, ability: str | None = None
) -> dict:
    prompt = _prompt_messages(row.get(prompt_column))
    data_source = row.get("data_source")
    data_source = data_source.strip() if isinstance(data_source, str) and data_source.strip() else source
    route = ability or route_of(row.get("ability"), data_source)
    if route is None:
        raise _BadRow(
            "unknown_ability",
            f"ability {row.get('ability')!r} and data_source {data_source!r} do not say "
            "whether the row is math or code; set 'ability' to 'math' or 'code', or read every row as math "
            "(ability='math'; trl-prime: --reward math)",
        )
    gold = _gold_of(row, route)
    solution = tests = None
    if route == "math":
        if gold is None or isinstance(gold, bool) or not isinstance(gold, (str, int, float)) or not str(gold).strip():
            raise _BadRow(
                "missing_gold",
                "math row without a gold answer (reward_model.ground_truth, 'solution' "
                "or 'answer' must be a non-empty string or number)",
            )
        _check_finite_gold(gold)
        solution = str(gold).strip()
    else:
        if isinstance(gold, (bytes, bytearray)):
            gold = gold.decode("utf-8", "replace")
        if isinstance(gold, str):
            try:
                parsed = json.loads(gold)
            except ValueError:
                raise _BadRow(
                    "bad_tests",
                    "code tests are a string but not JSON; store them as a JSON object "
                    'such as {"inputs": [...], "outputs": [...]}',
                ) from None
        else:
            parsed = gold
        if gold is None:
            raise _BadRow("missing_gold", "code row without test cases (reward_model.ground_truth or 'tests')")
        if not isinstance(parsed, Mapping) or not parsed:
            raise _BadRow("bad_tests", f"code tests must be a non-empty JSON object, got {type(parsed).__name__}")
        tests = gold if isinstance(gold, str) else json.dumps(parsed)
    rid = row.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
        extra = row.get("extra_info")
        index = extra.get("index") if isinstance(extra, Mapping) else None
        rid = (
            f"{data_source}/{index}"
            if isinstance(index, (int, str)) and not isinstance(index, bool)
            else f"{source}/{split}/{i}"
        )
    return {
        "id": str(rid),
        "data_source": data_source,
        "ability": route,
        "prompt": prompt,
        "solution": solution,
        "tests": tests,
    }


def _check_columns(columns: Iterable[str], source: str, prompt_column: str) -> None:
    columns = list(columns)
    if prompt_column not in columns:
        hint = next((c for c in ("prompt", "problem", "question", "messages", "query") if c in columns), None)
        fix = (
            f"pass prompt_column={hint!r} (recipes: --prompt_column {hint})"
            if hint
            else f"add a {prompt_column!r} column (a string or a list of {{'role', 'content'}} chat messages)"
        )
        raise ValueError(f"{source}: no prompt column {prompt_column!r} (columns: {columns}); {fix}")
    if not any(c in columns for c in _GOLD_COLUMNS):
        raise ValueError(
            f"{source}: no gold-answer column (columns: {columns}); add 'reward_model' "
            "({'style': 'rule', 'ground_truth': ...}, the Eurus-2-RL-Data format), 'solution' or 'answer' "
            "(math gold answers) or 'tests' (code test cases)"
        )


def _resolve_format(columns: Iterable[str], source: str, prompt_column: str, dataset_format: str) -> str:
    """The format of the rows (``dataset_format``, or :func:`detect_format` for ``"auto"``), after checking that
    its prompt and gold columns exist (``ValueError`` naming them and the fix otherwise)."""
    columns = list(columns)
    fmt = detect_format(columns, prompt_column) if dataset_format == "auto" else dataset_format
    if fmt == "eurus":
        _check_columns(columns, source, prompt_column)
        return fmt
    need = ("question", ("answer",)) if fmt == "gsm8k" else ("problem", ("answer", "solution"))
    if need[0] not in columns or not any(c in columns for c in need[1]):
        raise ValueError(
            f"{source}: dataset_format={fmt!r} needs a {need[0]!r} column and a gold column "
            f"{' or '.join(map(repr, need[1]))} (columns: {columns}); pass the right dataset_format or fix the data"
        )
    return fmt


def _normalize_any(
    row: Any, i: int, fmt: str, source: str, split: str, prompt_column: str, metadata: bool, ability: str | None = None
) -> dict:
    """One row of :func:`normalize_rows` (``_BadRow`` when malformed)."""
    if isinstance(row, Exception):
        raise _BadRow("bad_json", f"unreadable row: {row}")
    if not isinstance(row, Mapping):
        raise _BadRow("bad_json", f"row is a {type(row).__name__}, not an object")
    if fmt == "eurus":
        out = _normalize_row(row, i, source, split, prompt_column, ability)
    else:
        out = _normalize_row(_public_row(row, fmt), i, source, split, "prompt")
    if metadata:
        out.update(_level_subject(row, fmt))
    return out


def _check_report(report: LoadReport, max_bad_fraction: float, row_names: Sequence[str] | None = None) -> None:
    """Raise ``ValueError`` when no row, or more than ``max_bad_fraction`` of the rows, is usable; warn once (with
    the counts, and where the rows come from when ``row_names`` says: ``"<file> line <n>"``) when some rows were
    dropped."""
    source, bad = report.source, report.total - report.kept
    if report.total == 0:
        raise ValueError(f"{source}: the dataset is empty")
    if not report.kept:
        fix = "the data does not look like the Eurus-2-RL-Data, GSM8K or MATH format (see trl_prime.data)"
        if report.dropped.get("unknown_ability"):
            fix = (
                "rows must say which verifier scores them: add an 'ability' column ('math' or 'code'), or read "
                "every row as a math row with ability='math' (trl-prime: --reward math, the math verifier on "
                "every row)"
            )
        raise ValueError(f"{source}: none of the {report.total} rows is usable ({report.summary()}); {fix}")
    if bad > max_bad_fraction * report.total:
        raise ValueError(
            f"{source}: {bad} of {report.total} rows are malformed ({report.summary()}), more than "
            f"max_bad_fraction={max_bad_fraction}; fix the data or raise max_bad_fraction"
        )
    if bad:
        where = ""
        if row_names is not None:
            named = [row_names[i] for rows in report.examples.values() for i in rows if i < len(row_names)]
            where = f" at {', '.join(named)}" if named else ""
        warnings.warn(
            f"{source}: dropped {bad} of {report.total} malformed rows: {report.summary()}{where}",
            UserWarning,
            stacklevel=3,
        )


def normalize_rows(
    rows: Iterable[Mapping[str, Any] | Exception],
    *,
    source: str,
    split: str = "train",
    prompt_column: str = "prompt",
    columns: Iterable[str] | None = None,
    on_bad_rows: str = "drop",
    max_bad_fraction: float = 0.5,
    return_report: bool = False,
    dataset_format: str = "auto",
    metadata: bool = False,
    row_names: Sequence[str] | None = None,
    ability: str | None = None,
):
    """Normalise rows in the Eurus-2-RL-Data format (or the simpler variants above), GSM8K or MATH format to
    :data:`COLUMNS`.

    Args:
        rows: dicts (an ``Exception`` item stands for an unreadable row, e.g. a JSONL line that is not JSON).
        source: name used in ids of rows without one, as the default ``data_source``, and in messages.
        split: used in fallback ids.
        prompt_column: the column holding the prompt (Eurus-2-RL-Data format).
        columns: the dataset's column names, checked up front (default: the keys of the first row).
        on_bad_rows: ``"drop"`` (default: drop malformed rows, warn once with counts) or ``"error"``.
        max_bad_fraction: raise when more than this share of the rows is malformed.
        return_report: also return the :class:`LoadReport`.
        dataset_format: one of :data:`DATASET_FORMATS`: ``"auto"`` (:func:`detect_format`), ``"eurus"``,
            ``"gsm8k"`` (prompt ``question``, gold :func:`gsm8k_gold` of ``answer``) or ``"math"`` (prompt
            ``problem``, gold :func:`math_gold` of ``answer`` / ``solution``).
        metadata: also return the string columns :data:`METADATA_COLUMNS` (``level``; ``subject``, or MATH's
            ``type``), None where a row has none.
        row_names: where each row comes from (``"data/test.jsonl line 7"``), added to the messages of
            malformed rows.
        ability: ``"math"`` or ``"code"``: every row is read as a row of this ability (its ``ability`` and
            ``data_source`` are not consulted, so none is needed); None (default): each row's own
            (:func:`route_of`), rows that say neither are dropped (``unknown_ability``).

    Returns:
        A :class:`datasets.Dataset` (and the :class:`LoadReport` when ``return_report``).

    Raises:
        ValueError: a missing prompt or gold column, no usable row, too many malformed rows, or (with
            ``on_bad_rows="error"``) the first malformed row; each message names the column and the fix.
    """
    from datasets import Dataset

    if on_bad_rows not in ("drop", "error"):
        raise ValueError(f"on_bad_rows must be 'drop' or 'error', got {on_bad_rows!r}")
    if dataset_format not in DATASET_FORMATS:
        raise ValueError(f"dataset_format must be one of {DATASET_FORMATS}, got {dataset_format!r}")
    from trl_prime.rewards.registry import verifiers

    abilities = tuple(v.ability for v in verifiers())
    if ability not in (None, *abilities):
        raise ValueError(f"ability must be None or a registered verifier's ability {abilities}, got {ability!r}")
    report = LoadReport(source=source)
    out: list[dict] = []
    columns = list(columns) if columns is not None else []
    fmt = _resolve_format(columns, source, prompt_column, dataset_format) if columns else None
    for i, row in enumerate(rows):
        report.total += 1
        try:
            if fmt is None and isinstance(row, Mapping):
                fmt = _resolve_format(row.keys(), source, prompt_column, dataset_format)
            out.append(_normalize_any(row, i, fmt or "eurus", source, split, prompt_column, metadata, ability))
        except _BadRow as e:
            if on_bad_rows == "error":
                where = f" at {row_names[i]}" if row_names is not None and i < len(row_names) else ""
                raise ValueError(
                    f"{source}: row {i} is malformed ({e.reason}){where}: {e}; fix the row, or pass "
                    "on_bad_rows='drop' (command line: --on_bad_rows drop) to skip malformed rows"
                ) from None
            report.dropped[e.reason] = report.dropped.get(e.reason, 0) + 1
            ex = report.examples.setdefault(e.reason, [])
            if len(ex) < 5:
                ex.append(i)
    report.kept = len(out)
    _check_report(report, max_bad_fraction, row_names)
    ids = [r["id"] for r in out]
    if len(set(ids)) != len(ids):  # ids from the data collide: fall back to positions, which are stable
        for r, i in zip(out, range(len(out))):
            r["id"] = f"{source}/{split}/{i}"
    ds = Dataset.from_list(out, features=_features(metadata))
    return (ds, report) if return_report else ds


#: the largest row (one line of a JSON Lines file, one item of a JSON array) :func:`load_prompt_dataset` reads, in
#: bytes: a longer one stops the load naming its file and line (``max_row_bytes``; command line ``--max_row_bytes``)
MAX_ROW_BYTES = 1 << 20


def _read_json_rows(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> tuple[list, list[str], list[int] | None]:
    """Rows of a .json (array, or {"data": [...]}) or .jsonl file, the union of their keys, and the 1-based line
    number of each row (JSON Lines; None for a JSON array).

    Unreadable JSONL lines become exception items (dropped and counted by :func:`normalize_rows`). Raises
    ``ValueError`` naming the file and line for what is not a malformed row but a broken or hostile file (see
    :func:`_read_json_items`).
    """
    rows, lines = _read_json_items(path, max_row_bytes)
    columns: dict[str, None] = {}
    for row in rows:
        if isinstance(row, Mapping):
            columns.update(dict.fromkeys(row))
    return rows, list(columns), lines


_BOM = b"\xef\xbb\xbf"


def _json_value(text: str, where: str) -> Any:
    """``json.loads(text)``; JSON nested deeper than Python's recursion limit is a ``ValueError`` naming ``where``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(
            f"{where}: the JSON is nested too deeply for Python's json reader (its recursion limit); a prompt "
            "row needs a few levels: fix or remove the line"
        ) from None


def _decode(data: bytes, where: str, line_offset: int = 0) -> str:
    """``data`` decoded as UTF-8 (a leading byte-order mark dropped); invalid UTF-8 is a ``ValueError`` naming the
    line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = line_offset + data[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{where} line {line}: not valid UTF-8 ({e.reason}, byte 0x{data[e.start]:02x}); save the file as UTF-8"
        ) from None


def _read_json_items(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> tuple[list, list[int] | None]:
    """The items of a JSON array file, or the rows of a JSON Lines file with their 1-based line numbers.

    JSON Lines rows are separated by ``\\n`` only (the JSON Lines rule): U+2028, U+2029 and U+0085 are legal inside
    a JSON string and stay in it; a trailing ``\\r`` (CRLF files) is whitespace. A UTF-8 byte-order mark at the
    start of the file is dropped. ``json.loads`` reads each line; a line that is not JSON becomes an exception item
    (a malformed row, dropped and counted by :func:`normalize_rows`).

    ``datasets.load_dataset("json", ...)`` is not used: measured with datasets 5.2, it reads a column whose rows hold
    different JSON types (a string gold in one row, a number in the next) as JSON-encoded text and decodes the
    strings too (the gold ``"[1, 2]"`` comes back as the list ``[1, 2]``, ``"1"`` as the integer ``1``), it turns
    ``NaN`` into null without a word, and one line that is not JSON fails the whole file without its line number.

    Raises:
        ValueError: naming the file and line: a row (line, or array item) longer than ``max_row_bytes`` bytes (read
            no further than that), bytes that are not UTF-8, JSON nested deeper than Python's json reader goes; a
            ``.json`` file that holds neither an array of rows nor an object with exactly one list of rows.
    """
    if path.suffix == ".json":
        data = path.read_bytes()
        text = _decode(data, str(path))
        try:
            parsed = _json_value(text, str(path))
        except ValueError as e:
            if "nested too deeply" in str(e):
                raise
            parsed = None  # maybe JSON Lines with a .json extension
        if parsed is not None:
            if isinstance(parsed, Mapping):
                lists = [v for v in parsed.values() if isinstance(v, list)]
                if len(lists) != 1:
                    raise ValueError(
                        f"{path}: a JSON object must hold exactly one list of rows; store a JSON array "
                        "of row objects or JSON Lines"
                    )
                parsed = lists[0]
            if not isinstance(parsed, list):
                raise ValueError(f"{path}: expected a JSON array of row objects, got {type(parsed).__name__}")
            for i, item in enumerate(parsed):
                size = len(json.dumps(item, ensure_ascii=False).encode())
                if size > max_row_bytes:
                    raise ValueError(
                        f"{path}: row {i} of the JSON array holds {size} bytes, more than max_row_bytes="
                        f"{max_row_bytes}; fix the row, or raise max_row_bytes (command line: --max_row_bytes)"
                    )
            return parsed, None
    rows: list = []
    lines: list[int] = []
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(max_row_bytes + 2)  # the row, its "\r\n", and one byte more
            if not raw:
                break
            n += 1
            if n == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            body = raw.rstrip(b"\r\n")
            if len(body) > max_row_bytes:
                raise ValueError(
                    f"{path} line {n}: a row longer than max_row_bytes={max_row_bytes} bytes (read no further); "
                    "fix the line, or raise max_row_bytes (command line: --max_row_bytes)"
                )
            line = _decode(body, str(path), line_offset=n - 1)
            if not line.strip():
                continue
            lines.append(n)
            try:
                rows.append(_json_value(line, f"{path} line {n}"))
            except ValueError as e:
                if "nested too deeply" in str(e):
                    raise
                rows.append(ValueError(f"{path.name} line {n} is not JSON ({e})"))
    return rows, lines


_EXTENSIONS = (".json", ".jsonl", ".parquet")


def _split_file(folder: Path, split: str) -> Path:
    names = [split] + (["validation", "val", "dev"] if split == "test" else [])
    for name in names:
        for ext in _EXTENSIONS:
            for candidate in sorted(folder.glob(f"{name}{ext}")) + sorted(folder.glob(f"{name}-*{ext}")):
                return candidate
    raise ValueError(
        f"{folder}: no file for split {split!r}; name it {split}.jsonl / {split}.json / "
        f"{split}.parquet (found {sorted(p.name for p in folder.iterdir())})"
    )


def _read_local(
    path: Path, split: str, size: int | None, max_row_bytes: int = MAX_ROW_BYTES
) -> tuple[Path, Any, list[str], list[str] | None]:
    """``(file, rows, columns, row names)`` of a local file, or of a folder's file for ``split``: the first ``size``
    rows, and for JSON Lines each row's ``"<file> line <n>"`` (None otherwise)."""
    if not path.exists():
        raise ValueError(f"no such file or folder: {path}")
    if path.is_dir():
        path = _split_file(path, split)
    if path.suffix not in _EXTENSIONS:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .json, .jsonl or .parquet")
    if path.suffix == ".parquet":
        from datasets import Dataset

        table = Dataset.from_parquet(str(path), keep_in_memory=True)
        rows = iter(table) if size is None else (table[i] for i in range(min(size, len(table))))
        return path, rows, table.column_names, None
    rows, columns, lines = _read_json_rows(path, max_row_bytes)
    rows = rows[:size] if size is not None else rows
    return path, rows, columns, None if lines is None else [f"{path} line {n}" for n in lines[: len(rows)]]


def load_prompt_dataset(
    name_or_path: str,
    split: str = "train",
    *,
    size: int | None = None,
    seed: int = 0,
    prompt_column: str = "prompt",
    on_bad_rows: str = "drop",
    max_bad_fraction: float = 0.5,
    return_report: bool = False,
    dataset_format: str = "auto",
    metadata: bool = False,
    ability: str | None = None,
    max_row_bytes: int = MAX_ROW_BYTES,
    **kwargs: Any,
):
    """Load a prompt dataset by the names the recipes accept, normalised to :data:`COLUMNS`.

    Args:
        name_or_path: ``embedded:<name>`` (:data:`EMBEDDED_DATASETS`: ``arithmetic`` -- the demo's --,
            ``chain_sum``, ``gsm_symbolic``, ``mixed``); a ``.json`` / ``.jsonl`` / ``.parquet`` file; a folder
            holding ``<split>.jsonl`` (or ``.json`` / ``.parquet``; ``test`` falls back to ``validation``); or a
            Hub dataset id (``PRIME-RL/Eurus-2-RL-Data``; ``split="test"`` falls back to ``"validation"`` when
            the dataset has no test split). Files and Hub data are read in the Eurus-2-RL-Data, GSM8K or MATH
            format (``dataset_format``).
        split: ``"train"`` or ``"test"`` (a single file is the split you asked for).
        size: embedded: number of rows (default 1000 train / 200 test); others: keep the first ``size`` rows.
        seed: embedded only: generator seed.
        prompt_column, on_bad_rows, max_bad_fraction, return_report, dataset_format, metadata, ability: see
            :func:`normalize_rows` (not used for embedded data, which is always well formed math and has no
            metadata; the report is then None). Malformed rows of a JSONL file are named by file and line.
        max_row_bytes: local JSON / JSON Lines files: the largest row read (default :data:`MAX_ROW_BYTES`, 1 MiB);
            a longer one stops the load with its file and line (:func:`_read_json_items`).
        **kwargs: embedded: passed to :func:`load_reasoning_gym` (``task_configs``, ``instruction``, ...);
            Hub: passed to :func:`datasets.load_dataset` (``revision``, ``data_dir``, ...).

    Returns:
        A :class:`datasets.Dataset` with :data:`COLUMNS` (and a :class:`LoadReport` when ``return_report``).

    Raises:
        ValueError: unknown embedded name, missing file or split, unsupported extension, a local JSON file that is
            not UTF-8, nests too deeply or holds a row over ``max_row_bytes`` (file and line named), and every
            dataset-level problem of :func:`normalize_rows`.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"name_or_path must be a non-empty string, got {name_or_path!r}")
    if name_or_path.startswith(EMBEDDED_PREFIX):
        key = name_or_path[len(EMBEDDED_PREFIX) :]
        if key not in EMBEDDED_DATASETS:
            known = ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED_DATASETS)
            raise ValueError(f"unknown embedded dataset {name_or_path!r}; known: {known}")
        spec = EMBEDDED_DATASETS[key]
        kwargs.setdefault("task_configs", spec.task_configs)
        kwargs.setdefault("few_shot", spec.few_shot)
        ds = load_reasoning_gym(
            spec.tasks, size=size or (1000 if split == "train" else 200), seed=seed, split=split, **kwargs
        )
        return (ds, None) if return_report else ds

    common = dict(
        split=split,
        prompt_column=prompt_column,
        on_bad_rows=on_bad_rows,
        max_bad_fraction=max_bad_fraction,
        return_report=True,
        dataset_format=dataset_format,
        metadata=metadata,
        ability=ability,
    )
    path = Path(os.path.expanduser(name_or_path))
    looks_local = path.exists() or path.suffix in _EXTENSIONS or name_or_path.startswith((".", "/", "~"))
    if looks_local:
        path, rows, columns, row_names = _read_local(path, split, size, max_row_bytes)
        source = path.stem if path.stem not in ("train", "test") else str(path)
        ds, report = normalize_rows(rows, source=source, columns=columns, row_names=row_names, **common)
    else:
        from datasets import load_dataset

        try:
            dd = load_dataset(name_or_path, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised with what to do
            raise ValueError(
                f"could not load {name_or_path!r} as a local file or a Hub dataset ({type(e).__name__}: "
                f"{e}); pass an existing .json/.jsonl/.parquet path or a Hub dataset id"
            ) from e
        chosen = split if split in dd else ("validation" if split == "test" and "validation" in dd else None)
        if chosen is None:
            raise ValueError(f"{name_or_path}: no split {split!r} (splits: {list(dd)})")
        table = dd[chosen]
        if size is not None:
            table = table.select(range(min(size, len(table))))
        ds, report = normalize_rows(iter(table), source=name_or_path, columns=table.column_names, **common)
    return (ds, report) if return_report else ds
