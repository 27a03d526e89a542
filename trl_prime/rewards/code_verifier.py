"""Code outcome verifier: run a completion's program against test cases in a sandbox.

Public API: :func:`code_reward` (TRL reward function), :func:`make_code_reward`, :func:`verify_code` (one
:class:`CodeResult` per completion), :func:`extract_code`, :func:`default_deadline`, :data:`REASONS`.

Program (:func:`extract_code`): fences count only at the start of a line (after optional indentation) and close at
a line of backticks only (at least as many as opened it). The program is the last block tagged Python
(```` ```python ````, ```` ```py ```` and the other spellings in ``_PY_TAGS``, case-insensitive), else the last
untagged block, else the last block of any language; an unterminated final fence counts (truncated generations);
with no fence, the whole text. Conversational completions use the last message.

Tests (one entry per completion, a dict or its JSON string; keys whose value is ``None`` count as absent):

- ``{"stdin_stdout": [{"input": str, "output": str}, ...]}``: the program reads stdin and prints.
- ``{"fn_name": str, "inputs": [[args...], ...], "outputs": [value, ...]}``: ``fn_name`` (a top-level function or
  a method of a ``Solution`` class) is called with each argument list.
- ``{"check": str, "entry_point": str}`` (HumanEval; ``"test"`` is accepted for ``"check"``; an optional
  ``"prompt"`` is prepended when the program does not define ``entry_point``): a separate judge process runs the
  trusted prompt, the check and ``check(<entry_point>)`` against a plain-data proxy of the program (see
  :mod:`trl_prime.rewards.sandbox`); one test case. Give the ``prompt`` when the check uses its helpers
  (HumanEval/32 ``poly``, /38 ``encode_cyclic``, /50 ``encode_shift``).
- APPS / TACO / Eurus-2-RL-Data ``{"inputs": [...], "outputs": [...]}`` with optional ``fn_name``: without it the
  inputs are stdin strings (a list of lines is joined with newlines).

A malformed entry (also a stdin/stdout string that is not valid Unicode, e.g. ``"\ud800"``) scores ``None`` with
reason ``bad_tests`` and a ``RuntimeWarning`` naming the entry, the field and the fix (``strict=True`` raises).

Comparison, in the trusted parent: stdout matches when equal after stripping each line's trailing whitespace and
surrounding blank lines, or when the whitespace-separated tokens agree: two plain decimal literals (at least one
with a decimal point) within 1e-6 (relative or absolute), every other token exactly. Return values are compared
structurally after a JSON round trip (tuples are lists; floats within 1e-6; ``bool`` is not ``int``); as in APPS,
an expected ``[x]`` also accepts ``x``. Reward = passed / total test cases.

Infrastructure failures are ``None`` (``sandbox_error``, counted in ``verifier/failure_rate``), never 0: a sandbox
that could not run, one stopped or frozen from outside while a limit ran, or a backend call past its outer
deadline (``verify_code(deadline=...)``, default :func:`default_deadline`).
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import textwrap
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from trl_prime.rewards.executors import Executor, LocalJail
from trl_prime.rewards.sandbox import SandboxConfig, SandboxRun


__all__ = [
    "CodeResult",
    "REASONS",
    "code_reward",
    "make_code_reward",
    "verify_code",
    "extract_code",
    "default_deadline",
    "DEADLINE_SLACK",
]

#: reason -> (meaning, reward). Every :class:`CodeResult` has exactly one of these reasons.
REASONS: dict[str, tuple[str, str]] = {
    "passed": ("every test case passed", "1.0"),
    "partial": ("some but not all test cases passed", "passed/total"),
    "failed": (
        "no case passed: wrong output / return value, check() failed, the program exited "
        "before check() completed, or it returned something that is not plain data",
        "0.0",
    ),
    "timeout": ("no case passed; the first failing case exceeded the wall-clock or CPU-time limit", "0.0"),
    "memory": ("no case passed; the first failing case ran out of memory (its RLIMIT_AS)", "0.0"),
    "output_limit": (
        "no case passed; the first failing case wrote more than the output cap, the file-size "
        "limit or the work dir's disk quota allows",
        "0.0",
    ),
    "process_limit": ("no case passed and the program hit the process-count limit (fork bomb)", "0.0"),
    "runtime_error": (
        "no case passed; the first failing case raised, exited non-zero or was killed "
        "(incl. blocked network / file / signal operations)",
        "0.0",
    ),
    "syntax_error": ("the program does not compile", "0.0"),
    "no_code": ("the completion holds no program", "0.0"),
    "bad_tests": (
        "the tests entry is malformed or its check/prompt source does not compile (a warning "
        "names the field); not scored",
        "None",
    ),
    "sandbox_error": (
        "infrastructure failure: the sandbox could not run (interpreter missing, set-up "
        "failed, a required isolation layer missing), was stopped or frozen from outside while "
        "a time limit ran, or the backend did not return within the outer deadline; not scored",
        "None",
    ),
}

_PER_CASE_FAILURES = ("failed", "timeout", "memory", "output_limit", "runtime_error")


@dataclass(frozen=True)
class CodeResult:
    """Verdict for one completion.

    Attributes:
        reward: ``passed / total`` in [0, 1], or ``None`` (reasons ``bad_tests`` / ``sandbox_error``).
        reason: one of :data:`REASONS`.
        passed: test cases passed.
        total: test cases (0 when no case could run: ``no_code``, ``syntax_error``, ``bad_tests``, or a
            ``sandbox_error`` before the tests were known).
        layers: isolation layers that were active (see :data:`trl_prime.rewards.sandbox.LAYERS`).
        case_reasons: per test case: ``passed`` or a failure reason (``failed``, ``timeout``, ...).
        detail: short human-readable explanation of the first failure (or of the error).
        elapsed: wall seconds spent on this completion (sandbox start to teardown).
        stdout: per test case, the first 1000 characters the program printed.
    """

    reward: float | None
    reason: str
    passed: int = 0
    total: int = 0
    layers: tuple[str, ...] = ()
    case_reasons: tuple[str, ...] = ()
    detail: str = ""
    elapsed: float = 0.0
    stdout: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Spec:
    mode: str  # stdin | fn | check
    inputs: tuple = ()
    outputs: tuple = ()
    fn_name: str | None = None
    check: str | None = None
    entry_point: str | None = None
    prompt: str | None = None


# ------------------------------------------------------------------ completions and programs

_OPEN_FENCE_RE = re.compile(r"[ \t]*(`{3,})[ \t]*([^\s`]*)[^`]*\Z")
_CLOSE_FENCE_RE = re.compile(r"[ \t]*(`{3,})[ \t]*\Z")
_PY_TAGS = {"python", "py", "python3", "py3", "python2", "pycon", "ipython"}


def _completion_text(completion: Any) -> str:
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _completion_text(completion.get("content"))
    if isinstance(completion, Sequence) and completion:
        last = completion[-1]
        if isinstance(last, Mapping):
            content = last.get("content")
            if isinstance(content, list):  # multimodal content parts
                return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
            return "" if content is None else str(content)
        if isinstance(last, str):
            return last
    if isinstance(completion, Sequence):
        return ""
    return str(completion)


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(tag, body) of every fenced block; fences count only at the start of a line (after indentation).

    A block closes at a line holding only a fence at least as long as the opening one; an unterminated
    final block runs to the end of the text.
    """
    blocks: list[tuple[str, str]] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = _OPEN_FENCE_RE.match(lines[i].rstrip("\r\n"))
        if not m:
            i += 1
            continue
        width, tag = len(m.group(1)), m.group(2)
        body: list[str] = []
        i += 1
        while i < len(lines):
            c = _CLOSE_FENCE_RE.match(lines[i].rstrip("\r\n"))
            if c and len(c.group(1)) >= width:
                break
            body.append(lines[i])
            i += 1
        blocks.append((tag, "".join(body)))
        i += 1
    return blocks


def extract_code(completion: Any, *, dedent: bool = True) -> str:
    """Return the program of a completion (standard text or conversational messages).

    Fences are recognised only at the start of a line (after optional indentation), so a ```` ``` ````
    inside a string of the code does not end the block. Choice: the last block tagged Python
    (``python``, ``py``, ``python3``, ... case-insensitive); else the last untagged block; else the last
    block of any language (an unterminated final fence counts: truncated generations); with no fence,
    the whole text. The result is dedented unless ``dedent=False`` (a HumanEval body-only completion
    keeps its indentation); it may be empty (reason ``no_code``).
    """
    text = _completion_text(completion)
    blocks = _fenced_blocks(text)
    if blocks:
        python = [body for tag, body in blocks if tag.lower() in _PY_TAGS]
        untagged = [body for tag, body in blocks if not tag]
        code = python[-1] if python else untagged[-1] if untagged else blocks[-1][1]
    else:
        code = text
    code = code.replace("\r\n", "\n")
    return (textwrap.dedent(code) if dedent else code).strip("\n")


# ------------------------------------------------------------------ tests parsing


def _as_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        text = "\n".join(value)
    else:
        raise ValueError(
            f"{where} must be a string (or a list of lines), got {type(value).__name__}; "
            f"store stdin/stdout test data as text"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} is not valid Unicode text: lone surrogate {text[e.start]!r} at index {e.start} "
            "(it cannot be written to stdin or printed); fix the dataset's encoding"
        ) from None
    return text


def _parse_tests(entry: Any, idx: int) -> _Spec:
    """Validate one ``tests`` entry. Raises ValueError naming the field and the fix."""
    where = f"tests[{idx}]"
    if isinstance(entry, (bytes, bytearray)):
        entry = entry.decode("utf-8", "replace")
    if isinstance(entry, str):
        try:
            entry = json.loads(entry)
        except ValueError as e:
            raise ValueError(
                f"{where} is a string but not valid JSON ({e}); pass a dict or json.dumps(dict)"
            ) from None
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"{where} must be a dict (or its JSON string), got {type(entry).__name__}; use "
            "{'stdin_stdout': [...]}, {'fn_name', 'inputs', 'outputs'} or {'check', 'entry_point'}"
        )
    # `datasets` stores a dict column as a struct with the union of all keys: absent keys arrive as None
    entry = {k: v for k, v in entry.items() if v is not None}
    if "stdin_stdout" in entry:
        cases = entry["stdin_stdout"]
        if not isinstance(cases, (list, tuple)) or not cases:
            raise ValueError(f"{where}['stdin_stdout'] must be a non-empty list of {{'input': str, 'output': str}}")
        ins, outs = [], []
        for j, c in enumerate(cases):
            if not isinstance(c, Mapping) or "input" not in c or "output" not in c:
                raise ValueError(f"{where}['stdin_stdout'][{j}] must be a dict with keys 'input' and 'output'")
            ins.append(_as_text(c["input"], f"{where}['stdin_stdout'][{j}]['input']"))
            outs.append(_as_text(c["output"], f"{where}['stdin_stdout'][{j}]['output']"))
        return _Spec("stdin", tuple(ins), tuple(outs))
    if "check" in entry or ("test" in entry and "entry_point" in entry):
        check = entry.get("check", entry.get("test"))
        ep = entry.get("entry_point")
        if not isinstance(check, str) or "def check" not in check:
            raise ValueError(f"{where}['check'] must be Python source defining check(candidate)")
        if not isinstance(ep, str) or not ep.isidentifier():
            raise ValueError(
                f"{where}['entry_point'] must be the name of the function under test (an identifier), got {ep!r}"
            )
        prompt = entry.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"{where}['prompt'] must be a string (the HumanEval prompt) or absent")
        return _Spec("check", check=check, entry_point=ep, prompt=prompt)
    if "inputs" in entry and "outputs" in entry:
        ins, outs = entry["inputs"], entry["outputs"]
        if not isinstance(ins, (list, tuple)) or not isinstance(outs, (list, tuple)):
            raise ValueError(f"{where}['inputs'] and ['outputs'] must be lists (one entry per test case)")
        if len(ins) != len(outs):
            raise ValueError(
                f"{where}: 'inputs' has {len(ins)} entries but 'outputs' has {len(outs)}; give one "
                "expected output per input"
            )
        if not ins:
            raise ValueError(f"{where}['inputs'] is empty; give at least one test case")
        fn = entry.get("fn_name")
        if fn not in (None, ""):
            if not isinstance(fn, str) or not fn.isidentifier():
                raise ValueError(f"{where}['fn_name'] must be a function name (an identifier), got {fn!r}")
            args = tuple(list(a) if isinstance(a, (list, tuple)) else [a] for a in ins)
            try:
                json.dumps(args)
                json.dumps(list(outs))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: 'inputs'/'outputs' must be JSON values ({e})") from None
            return _Spec("fn", args, tuple(outs), fn_name=fn)
        return _Spec(
            "stdin",
            tuple(_as_text(x, f"{where}['inputs'][{j}]") for j, x in enumerate(ins)),
            tuple(_as_text(x, f"{where}['outputs'][{j}]") for j, x in enumerate(outs)),
        )
    raise ValueError(
        f"{where} has keys {sorted(map(str, entry))}; expected one of "
        "{'stdin_stdout': [{'input', 'output'}, ...]}, {'fn_name', 'inputs', 'outputs'}, "
        "{'inputs', 'outputs'} (stdin) or {'check', 'entry_point'} (HumanEval)"
    )


# ------------------------------------------------------------------ comparison (parent side)

_INT_RE = re.compile(r"[+-]?[0-9]+\Z")
_DECIMAL_RE = re.compile(r"[+-]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)\Z")  # plain decimal literal, ASCII only
_TOL = 1e-6


def _tokens_match(a: str, b: str) -> bool:
    """Two stdout tokens: exact, or both plain decimal literals (not both integers) within 1e-6."""
    if a == b:
        return True
    if not (_DECIMAL_RE.match(a) and _DECIMAL_RE.match(b)):
        return False  # words, 1_000, 1e3, nan, inf, 0x10 ... compare as text
    if _INT_RE.match(a) and _INT_RE.match(b):
        return False  # integers are exact
    return math.isclose(float(a), float(b), rel_tol=_TOL, abs_tol=_TOL)


def _stdout_matches(got: str, expected: str) -> bool:
    if got == expected:
        return True
    g = [line.rstrip() for line in got.strip().splitlines()]
    e = [line.rstrip() for line in expected.strip().splitlines()]
    if g == e:
        return True
    gt, et = got.split(), expected.split()
    if gt == et:
        return True
    if len(gt) != len(et):
        return False
    return all(_tokens_match(a, b) for a, b in zip(gt, et))


def _values_equal(got: Any, exp: Any, depth: int = 0) -> bool:
    if depth > 200:
        return got == exp
    if isinstance(got, bool) or isinstance(exp, bool):
        return type(got) is type(exp) and got == exp
    if isinstance(got, (int, float)) and isinstance(exp, (int, float)):
        if isinstance(got, int) and isinstance(exp, int):
            return got == exp
        if math.isnan(got) or math.isnan(exp):
            return math.isnan(got) and math.isnan(exp)
        return math.isclose(got, exp, rel_tol=_TOL, abs_tol=_TOL)
    if isinstance(exp, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(exp) and all(_values_equal(a, b, depth + 1) for a, b in zip(got, exp))
    if isinstance(exp, Mapping) and isinstance(got, Mapping):
        return set(got) == set(exp) and all(_values_equal(got[k], exp[k], depth + 1) for k in exp)
    if type(got) is not type(exp):
        return False
    return got == exp


def _return_matches(got: Any, exp: Any) -> bool:
    exp = json.loads(json.dumps(exp))  # same normalisation as the sandbox's value (tuples -> lists)
    if _values_equal(got, exp):
        return True
    return isinstance(exp, list) and len(exp) == 1 and _values_equal(got, exp[0])


# ------------------------------------------------------------------ verification

_ENTRY_DEF = "^[ \t]*(?:async[ \t]+)?def[ \t]+{}[ \t]*\\("


def _default_workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(2, n + 1)


#: Seconds added to a completion's time limits to form its default outer deadline (see :func:`default_deadline`).
DEADLINE_SLACK = 30.0


def _n_cases(spec: _Spec) -> int:
    return 1 if spec.mode == "check" else len(spec.inputs)


def default_deadline(config: SandboxConfig, n_cases: int) -> float:
    """Default outer deadline (wall seconds) of one completion with ``n_cases`` test cases.

    ``startup_grace + min(total_timeout, n_cases * timeout) + timeout + DEADLINE_SLACK`` (30 s): the
    sandbox's start-up allowance, the longest its cases may run, one more case's limit and slack for
    teardown on a loaded machine. With the default :class:`~trl_prime.rewards.sandbox.SandboxConfig`
    that is 48 s for one case and 74 s for 8 or more.
    """
    return config.startup_grace + min(config.total_timeout, n_cases * config.timeout) + config.timeout + DEADLINE_SLACK


def _output_cap(cfg: SandboxConfig, expected_bytes: int) -> int:
    """A case's output cap: at least ``2 * expected_bytes + 1024`` (a correct answer always fits), rounded up to a
    power of two, so the program's RLIMIT_FSIZE tells it no more than the expected output's order of magnitude."""
    need = 2 * expected_bytes + 1024
    return cfg.output_limit if need <= cfg.output_limit else 1 << (need - 1).bit_length()


def _verify_one(completion: Any, spec: _Spec, cfg: SandboxConfig, executor: Executor) -> CodeResult:
    program = extract_code(completion)
    if not program.strip():
        return CodeResult(0.0, "no_code", total=0, detail="no program found in the completion")
    if (
        spec.mode == "check"
        and spec.prompt
        and not re.search(_ENTRY_DEF.format(re.escape(spec.entry_point)), program, re.MULTILINE)
    ):
        program = spec.prompt + extract_code(completion, dedent=False)  # a body-only HumanEval completion
    if spec.mode == "stdin":
        caps = [_output_cap(cfg, len(o.encode("utf-8", "replace"))) for o in spec.outputs]
        run = executor.run(program, mode="stdin", inputs=list(spec.inputs), output_caps=caps, config=cfg)
    elif spec.mode == "fn":
        caps = [_output_cap(cfg, len(json.dumps(o))) for o in spec.outputs]
        run = executor.run(
            program,
            mode="fn",
            inputs=[list(a) for a in spec.inputs],
            fn_name=spec.fn_name,
            output_caps=caps,
            config=cfg,
        )
    else:
        run = executor.run(
            program,
            mode="check",
            check=spec.check,
            entry_point=spec.entry_point,
            check_prelude=spec.prompt,
            config=cfg,
        )
    return _judge(run, spec)


def _judge(run: SandboxRun, spec: _Spec) -> CodeResult:
    if not run.ok:
        return CodeResult(None, "sandbox_error", layers=run.layers, detail=run.error[:2000], elapsed=run.elapsed)
    if run.compile_error is not None:
        return CodeResult(0.0, "syntax_error", layers=run.layers, detail=run.compile_error, elapsed=run.elapsed)
    if run.check_error is not None:
        return CodeResult(
            None,
            "bad_tests",
            layers=run.layers,
            detail=f"check source does not compile: {run.check_error}",
            elapsed=run.elapsed,
        )
    reasons, details = [], []
    for i, case in enumerate(run.cases):
        if case.status == "ok":
            if spec.mode == "stdin":
                ok = _stdout_matches(case.stdout, spec.outputs[i])
                why = "" if ok else "wrong output"
            elif spec.mode == "fn":
                try:
                    ok = case.has_value and _return_matches(case.value, spec.outputs[i])
                except (RecursionError, ValueError, TypeError):
                    ok = False
                why = "" if ok else "wrong return value"
            else:
                ok = case.verified
                why = "" if ok else "completion record did not carry the nonce"
            reasons.append("passed" if ok else "failed")
            details.append(why)
        elif case.status in ("assertion", "no_record", "bad_value"):
            reasons.append("failed")
            details.append(case.detail or case.status)
        elif case.status in _PER_CASE_FAILURES:
            reasons.append(case.status)
            details.append(case.detail)
        else:
            reasons.append("runtime_error")
            details.append(case.detail or case.status)
    total = len(reasons)
    passed = sum(r == "passed" for r in reasons)
    first_fail = next((i for i, r in enumerate(reasons) if r != "passed"), None)
    if passed == total:
        reason = "passed"
    elif passed:
        reason = "partial"
    else:
        reason = reasons[first_fail]
        if run.process_limit_hit and reason in ("runtime_error", "timeout", "memory"):
            reason = "process_limit"
    detail = "" if first_fail is None else f"case {first_fail}: {details[first_fail]}"
    if first_fail is not None and run.cases[first_fail].stderr and reasons[first_fail] == "runtime_error":
        detail += " | stderr: " + run.cases[first_fail].stderr.strip()[-300:]
    return CodeResult(
        reward=passed / total if total else 0.0,
        reason=reason,
        passed=passed,
        total=total,
        layers=run.layers,
        case_reasons=tuple(reasons),
        detail=detail[:2000],
        elapsed=run.elapsed,
        stdout=tuple(c.stdout[:1000] for c in run.cases),
    )


def verify_code(
    completions: Sequence[Any],
    tests: Sequence[Any],
    *,
    config: SandboxConfig | None = None,
    max_workers: int | None = None,
    strict: bool = False,
    deadline: float | None = None,
    executor: Executor | None = None,
    **overrides: Any,
) -> list[CodeResult]:
    """Run every completion's program against its tests in the sandbox.

    Args:
        completions: standard strings or conversational message lists (last message's content).
        tests: one entry per completion (dict or JSON string; shapes in the module docstring).
        config: :class:`~trl_prime.rewards.sandbox.SandboxConfig` (limits, required layers, ...).
        max_workers: concurrent sandboxes (default: CPUs + 1; each is supervised by one thread).
        strict: raise on a malformed ``tests`` entry instead of scoring it ``None`` (``bad_tests``).
        deadline: outer deadline in wall seconds for each completion, counted from the start of its
            sandbox run; default :func:`default_deadline` (``startup_grace + min(total_timeout,
            cases * timeout) + timeout + 30``). A run still going then is abandoned and scored ``None``
            with reason ``sandbox_error`` (an infrastructure failure, counted in
            ``verifier/failure_rate``); its thread is left to finish in the background. The sandbox
            enforces its own limits well within this: the deadline only catches a backend that hangs.
            While ``MAX_ABANDONED_PER_WORKER * max_workers`` abandoned runs (over all calls in this
            process) are still going, further completions are not started but scored ``None`` /
            ``sandbox_error`` at once, so a hanging backend cannot pile up sandboxes step after step.
        executor: where the programs run (:mod:`trl_prime.rewards.executors`): default
            :class:`~trl_prime.rewards.executors.LocalJail` (this machine's jail); e.g.
            ``SandboxFusion("http://host:8080")`` for a remote sandbox service.
        **overrides: fields of ``SandboxConfig`` to replace (e.g. ``timeout=1.0``).

    Returns:
        One :class:`CodeResult` per completion, in order. The call takes at most about
        ``ceil(completions / max_workers) * deadline`` seconds, whatever the backend does. It runs at most
        ``max_workers`` sandboxes at once, plus the abandoned runs still going in the background; as new runs
        start only while fewer than ``MAX_ABANDONED_PER_WORKER * max_workers`` are abandoned (see
        ``deadline``), fewer than ``(MAX_ABANDONED_PER_WORKER + 1) * max_workers`` sandboxes are ever alive at
        once (for calls with the same ``max_workers``).

    Raises:
        ValueError: ``len(completions) != len(tests)``; a malformed ``tests`` entry when ``strict``
            (the message names the entry, the field and the fix); bad ``SandboxConfig`` values; a
            ``deadline`` that is not a positive number.
        TypeError: an unknown keyword in ``overrides``.
    """
    if len(completions) != len(tests):
        raise ValueError(
            f"got {len(completions)} completions but {len(tests)} tests entries; pass one tests "
            "entry per completion (TRL repeats dataset columns per generation)"
        )
    if deadline is not None and (
        isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0
    ):
        raise ValueError(f"deadline must be a positive number of seconds (or None for the default), got {deadline!r}")
    cfg = config or SandboxConfig()
    if overrides:
        cfg = replace(cfg, **overrides)
    results: list[CodeResult | None] = [None] * len(completions)
    jobs = []
    for i, (c, t) in enumerate(zip(completions, tests)):
        try:
            spec = _parse_tests(t, i)
        except ValueError as e:
            if strict:
                raise
            warnings.warn(
                f"code_reward: {e}; this completion is not scored (reward None, reason bad_tests)",
                RuntimeWarning,
                stacklevel=2,
            )
            results[i] = CodeResult(None, "bad_tests", detail=str(e))
            continue
        jobs.append((i, c, spec))
    if jobs:
        workers = max(1, min(max_workers or _default_workers(), len(jobs)))
        limits = {
            i: deadline if deadline is not None else default_deadline(cfg, _n_cases(spec)) for i, _, spec in jobs
        }
        cap = MAX_ABANDONED_PER_WORKER * (max_workers or _default_workers())
        for i, r in _run_with_deadlines(jobs, cfg, workers, limits, cap, executor or LocalJail()).items():
            results[i] = r
    return results  # type: ignore[return-value]


# Abandoned runs (past their outer deadline, their thread and sandbox still going) allowed per worker
# (``max_workers`` of the call) before new completions are scored ``sandbox_error`` without being started.
MAX_ABANDONED_PER_WORKER = 2
_ABANDONED_LOCK = threading.Lock()
_ABANDONED = [0]  # abandoned runs still going, over all calls in this process


def _run_with_deadlines(
    jobs, cfg: SandboxConfig, workers: int, limits: dict[int, float], cap: int, executor: Executor
) -> dict[int, CodeResult]:
    """Run the jobs on at most ``workers`` daemon threads; a job past its limit is scored ``sandbox_error``.

    Python cannot stop a thread: a job past its deadline is abandoned (its late result is dropped) and
    a new thread takes its slot, so one hung backend call delays no other completion. The threads are
    daemons: an abandoned one cannot keep the interpreter from exiting. Abandoned jobs still going are
    counted over all calls (``_ABANDONED``; a job leaves the count when its backend call finally returns);
    while there are ``cap`` of them, a job is scored ``sandbox_error`` at once and no thread is started.
    """
    done: queue.SimpleQueue = queue.SimpleQueue()
    out: dict[int, CodeResult] = {}
    pending = list(reversed(jobs))
    running: dict[int, float] = {}  # job index -> time its outer deadline expires
    state: dict[int, list[str]] = {}  # job index -> ["running" | "done" | "abandoned"], under _ABANDONED_LOCK

    def work(job, st):
        i, c, spec = job
        try:
            r = _verify_one(c, spec, cfg, executor)
        except Exception as e:  # noqa: BLE001 - an infrastructure bug must not look like a 0
            r = CodeResult(None, "sandbox_error", detail=f"{type(e).__name__}: {e}")
        with _ABANDONED_LOCK:
            if st[0] == "abandoned":
                _ABANDONED[0] -= 1
            st[0] = "done"
        done.put((i, r))

    while pending or running:
        while pending and len(running) < workers:
            job = pending.pop()
            i = job[0]
            with _ABANDONED_LOCK:
                stuck = _ABANDONED[0]
            if stuck >= cap:
                out[i] = CodeResult(
                    None,
                    "sandbox_error",
                    detail=f"not run: {stuck} earlier sandbox runs abandoned past their outer deadline are still "
                    f"going (cap MAX_ABANDONED_PER_WORKER * max_workers = {cap}); the sandbox backend hangs",
                )
                continue
            running[i] = time.monotonic() + limits[i]
            state[i] = ["running"]
            try:
                threading.Thread(target=work, args=(job, state[i]), name=f"code_reward-{i}", daemon=True).start()
            except RuntimeError as e:  # no thread could be started
                del running[i]
                out[i] = CodeResult(None, "sandbox_error", detail=f"could not start a worker thread: {e}")
        if not running:
            continue
        try:
            i, r = done.get(timeout=max(0.0, min(running.values()) - time.monotonic()))
        except queue.Empty:
            now = time.monotonic()
            for i in [i for i, t in running.items() if t <= now]:
                with _ABANDONED_LOCK:
                    if state[i][0] == "done":  # returned just now: its result is in the queue
                        continue
                    state[i][0] = "abandoned"
                    _ABANDONED[0] += 1
                del running[i]
                out[i] = CodeResult(
                    None,
                    "sandbox_error",
                    elapsed=limits[i],
                    detail=f"the sandbox backend did not return within the outer deadline of {limits[i]:g} s "
                    "(verify_code(deadline=...)); the run was abandoned",
                )
            continue
        if i in running:  # else: already scored past its deadline
            del running[i]
            out[i] = r
    return out


def _report(fn, results: list[CodeResult], log_metric: Callable[[str, float], Any] | None) -> None:
    counts = Counter(r.reason for r in results)
    fn.last_counts = {k: counts.get(k, 0) for k in REASONS}
    fn.last_results = results
    if log_metric is not None:
        for k in REASONS:
            log_metric(f"code/{k}", float(counts.get(k, 0)))


def make_code_reward(
    config: SandboxConfig | None = None,
    *,
    max_workers: int | None = None,
    tests_column: str = "tests",
    deadline: float | None = None,
    executor: Executor | None = None,
    **overrides: Any,
) -> Callable[..., list[float | None]]:
    """Build a TRL reward function like :func:`code_reward` with other limits or another tests column.

    The returned function is named ``code_reward`` (TRL logs ``rewards/code_reward/...``), reads the
    dataset column ``tests_column``, and keeps ``last_counts`` / ``last_results`` like :func:`code_reward`.
    ``deadline`` is :func:`verify_code`'s outer deadline per completion (default :func:`default_deadline`);
    ``executor`` where the programs run (default: this machine's jail; see :mod:`trl_prime.rewards.executors`).
    """
    cfg = config or SandboxConfig()
    if overrides:
        cfg = replace(cfg, **overrides)
    if deadline is not None and (
        isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0
    ):
        raise ValueError(f"deadline must be a positive number of seconds (or None for the default), got {deadline!r}")

    def code_reward(completions, **kwargs):  # noqa: D401 - TRL reward function
        if tests_column not in kwargs:
            raise ValueError(
                f"code_reward needs the dataset column {tests_column!r} (one tests entry per row); "
                f"got columns {sorted(k for k in kwargs if k not in ('log_metric', 'log_extra'))}"
            )
        results = verify_code(
            completions,
            kwargs[tests_column],
            config=cfg,
            max_workers=max_workers,
            deadline=deadline,
            executor=executor,
        )
        _report(code_reward, results, kwargs.get("log_metric"))
        return [r.reward for r in results]

    code_reward.last_counts = {}
    code_reward.required_columns = (tests_column,)  # checked by the trl-prime trainers at start-up
    code_reward.last_results = []
    code_reward.config = cfg
    code_reward.__doc__ = _CODE_REWARD_DOC
    return code_reward


def code_reward(completions: Sequence[Any], tests: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function: fraction of test cases each completion's program passes in the sandbox.

    Args:
        completions: from TRL: strings, or lists of chat messages (the last message's content is used).
        tests: dataset column, one entry per completion: ``{"stdin_stdout": [{"input", "output"}, ...]}``,
            ``{"fn_name", "inputs", "outputs"}``, ``{"check", "entry_point"}`` (HumanEval), APPS/Eurus
            ``{"inputs", "outputs"[, "fn_name"]}``, or the JSON string of any of these.
        **kwargs: other TRL arguments (``prompts``, ``completion_ids``, ``trainer_state``, other dataset
            columns) are ignored, except ``log_metric``: when given, ``log_metric(f"code/{reason}", count)``
            is called for every reason of :data:`REASONS` (zeros included).

    Returns:
        One reward per completion: ``passed/total`` in [0, 1], or ``None`` for ``bad_tests`` (malformed
        entry; a RuntimeWarning names the field and the fix) and ``sandbox_error`` (infrastructure
        failure). Never a silent 0 for something the program did not do.

    Side effects:
        ``code_reward.last_counts`` -- ``{reason: count}`` of the last call; ``code_reward.last_results``
        -- its :class:`CodeResult` list.

    Raises:
        ValueError: ``len(completions) != len(tests)``.

    Default limits: :class:`~trl_prime.rewards.sandbox.SandboxConfig` (4 s per case, 30 s per program,
    1 GiB address space, 256 KiB output or twice the expected output) and the outer deadline
    :func:`default_deadline` (48 s for one test case, 74 s for 8 or more); use :func:`make_code_reward`
    to change them.
    """
    results = verify_code(completions, tests)
    _report(code_reward, results, kwargs.get("log_metric"))
    return [r.reward for r in results]


_CODE_REWARD_DOC = code_reward.__doc__
code_reward.last_counts = {}  # type: ignore[attr-defined]
code_reward.required_columns = ("tests",)  # type: ignore[attr-defined]  # checked at trainer start-up
code_reward.last_results = []  # type: ignore[attr-defined]
