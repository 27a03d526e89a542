"""Math outcome verifier: final answers checked with ``math-verify`` under hard timeouts.

The user guide (docs/guides/verifiers.md, "How ``math_reward`` judges") explains the judge; in short:

* The final answer is the content of the **last complete top-level** ``\\boxed{...}`` / ``\\fbox{...}`` (nested
  and escaped braces handled); a last box never closed (a truncated completion) means no answer, and a number in
  the prose never counts. ``extraction="boxed_or_answer_phrase"`` also reads, when there is no box, the rest of the
  line after the last "final answer is / the answer is / answer:" (opt-in: it credits "the answer is not 3").
* Golds may be plain (``"42"``, ``"[0, 1)"``), a MATH solution (its last box) or GSM8K's ``#### 72``. Numeric golds
  (also numpy / 0-d tensor scalars) are written out positionally (``1e-05`` -> ``"0.00001"``: math-verify reads
  ``e`` as Euler's number); ``nan``/``inf`` are ``gold_unparseable``. A word gold (letters and spaces, one word of
  two or more letters: ``"banana"``, ``"no solution"``) that math-verify reads as a product of one-letter variables
  is compared as normalised text (wrappers, spacing, case and a trailing period ignored); write a product of
  variables as ``"x y"``.
* Pre-pass (golds and answers): upright ``\\mathrm{e}``/``\\text{i}``/``{\\rm e}`` -> ``e``/``i``; a digit's
  imaginary unit as its own token (``5i``, ``5\\,i`` -> ``5 i``); thin-space thousands (``5\\,600`` -> ``5600``,
  read as 605 otherwise); a sentence's full stop after a whole number (``5.`` -> ``5``). Rationale per form in
  :func:`_normalize_forms`.
* Numbers math-verify calls equal (it rounds to 6 decimals) must also agree to ``rel_tol`` (default ``1e-4``), or,
  when the answer or gold is one plain decimal, by less than half a unit in its last written place
  (``0.001429`` = ``\\frac{1}{700}``; ``0.0000002`` != ``0.0000001``). This only turns "equal" into "not equal".
  When the installed math-verify no longer compares through ``math_verify.grader.sympy_numeric_eq``, the workers
  use its verdict alone and one ``RuntimeWarning`` says so.

Known blind spots (math-verify 0.9 readings this verifier does not correct):

* Subscript bases are ignored: ``52_9`` equals ``52_8`` (both read as 52), ``1011_2`` is 1011, not 11.
* Scientific notation in an answer reads ``e`` as Euler's number: ``1e6`` is ``6e`` (write ``10^6``).
* ``i`` is a symbol, not the imaginary unit: ``(1+i)^2`` does not equal ``2i``.
* A single-letter gold (``x``, ``i``) matches only that letter.
* Repeating decimals (``0.\\overline{3}``) cannot be parsed: such a gold is ``gold_unparseable``.
* Thousands separated by other spacing than ``\\,`` (``5\\;600``, ``5~600``) are not one number.

Where the work happens: a ``pebble.ProcessPool`` whose workers are forked from this module's own forkserver, which
has imported only this module and math-verify (``trl_prime.rewards._math_worker``) and never the caller's
``__main__`` (scripts without a main guard are safe; no worker forks from a process with threads or CUDA). Each
step (a gold's parse with one probe comparison, or an answer's parse and comparison) is one task with a
wall-clock deadline of ``timeout`` seconds (an answer's also allows its gold's parse time); pebble kills and
replaces a worker that misses it, so the deadline holds from any thread. Workers run under ``RLIMIT_AS``
(``memory_limit_mb``) and a per-step ``RLIMIT_CPU`` backstop. Calls from all threads share the pool; identical
pairs are verified once per batch and deterministic outcomes are memoised (the only fast path); golds whose parse
timed out are remembered per ``timeout``. The pool starts lazily, is dropped in a forked child and stops at exit.

Reasons (``reward`` in brackets): ``correct`` (1.0); ``wrong`` (0.0); ``no_answer`` (0.0: no complete, non-empty
box); ``gold_unparseable`` (None: empty, non-finite, unparseable, or its parse timed out; NaN in TRL, counted);
``timeout`` (0.0: the step passed ``timeout`` or hit the memory cap); ``error`` (None: the workers cannot start, or
one died twice on the same item; never a silent 0). Not supported: ``\\boxed 5`` without braces, several boxes meant
as one answer.
"""

from __future__ import annotations

import atexit
import io
import math
import os
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from decimal import Decimal
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

import pebble
import pebble.common


__all__ = [
    "MathResult",
    "REASONS",
    "extract_answer",
    "make_math_reward",
    "math_reward",
    "shutdown_math_workers",
    "start_math_workers",
    "verify_math",
]

REASONS: tuple[str, ...] = ("correct", "wrong", "no_answer", "gold_unparseable", "timeout", "error")
_REWARD_OF = {"correct": 1.0, "wrong": 0.0, "no_answer": 0.0, "timeout": 0.0, "gold_unparseable": None, "error": None}
_EXTRACTIONS = ("boxed", "boxed_or_answer_phrase")

DEFAULT_TIMEOUT = 5.0
DEFAULT_MEMORY_LIMIT_MB = 1024
DEFAULT_REL_TOL = 1e-4  # numbers that math-verify calls equal must also agree to this relative tolerance
_STARTUP_TIMEOUT = 60.0  # beyond its deadline, a task's result is given up on after this (a worker starting)
_CACHE_SIZE = 65536
_CACHE_MAX_CHARS = 2000  # only memoise pairs shorter than this
_PARSED_MAX_CHARS = 200
_GOLD_TIMEOUT_CACHE_SIZE = 4096  # golds whose parse timed out, remembered with the timeout they failed under
_PROBE = "0"  # the gold step verifies the gold against this, so a gold that makes every comparison hang fails once


@dataclass(frozen=True)
class MathResult:
    """Verdict for one completion.

    Attributes:
        reward: 1.0 (``correct``), 0.0 (``wrong``, ``no_answer``, ``timeout``) or None (``gold_unparseable``,
            ``error``: unscorable; TRL turns None into NaN, excluded from means and baselines).
        reason: one of :data:`REASONS`.
        extracted: the final-answer text taken from the completion (content of the last box), None if none.
        gold: the gold answer text that was parsed (after unwrapping ``$``, boxes, ``####``), None if empty.
        parsed: math-verify's parse of the answer (``str`` of the SymPy object, truncated), when available.
        detail: a human-readable explanation for non-trivial outcomes (timeouts, errors, bad golds).
    """

    reward: float | None
    reason: str
    extracted: str | None = None
    gold: str | None = None
    parsed: str | None = None
    detail: str = ""


# --------------------------------------------------------------------------------------------------------------
# Answer extraction (pure string work in the calling process; linear time, cannot hang)
# --------------------------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PHRASE_RE = re.compile(r"(?i)\b(?:final\s+answer|answer)\s*(?:is\b\s*:?|:)\s*")
_DELIMS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))


def _last_box(text: str) -> tuple[str | None, bool]:
    """(content of the last complete top-level box, whether any box opener was seen)."""
    last = None
    pos = 0
    seen = False
    n = len(text)
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return last, seen
        seen = True
        depth, i = 1, m.end()
        while i < n:
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        if depth:  # never closed: the last box is incomplete, so there is no final answer
            return None, True
        last = text[m.end() : i]
        pos = i + 1


def _strip_math(s: str) -> str:
    s = s.strip()
    changed = True
    while changed and s:
        changed = False
        for left, right in _DELIMS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : len(s) - len(right)].strip()
                changed = True
                break
    return s


def _answer_phrase(text: str) -> str | None:
    for m in reversed(list(_PHRASE_RE.finditer(text))):
        eol = text.find("\n", m.end())
        rest = text[m.end() : eol if eol >= 0 else len(text)].strip().strip("*").strip()
        for left, right in _DELIMS:  # a math span right after the phrase is the answer
            if rest.startswith(left):
                end = rest.find(right, len(left))
                if end > 0:
                    rest = rest[: end + len(right)]
                break
        else:
            rest = re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0]
        # emphasis and the sentence's period, in either order: "**73**." and "**73.**" -> "73"
        prev = None
        while prev != rest:
            prev, rest = rest, rest.strip().strip("*").rstrip(".").strip()
        rest = _strip_math(rest)
        if rest:
            return rest
    return None


def extract_answer(text: str, extraction: str = "boxed") -> str | None:
    """Final-answer text of a completion, or None when it has none.

    Args:
        text: the completion text.
        extraction: ``"boxed"`` (default): the content of the last complete top-level ``\\boxed{}``/``\\fbox{}``;
            ``"boxed_or_answer_phrase"``: the same, else the rest of the line after the last
            "final answer is" / "the answer is" / "answer:" phrase.

    Returns:
        The stripped answer text (math delimiters ``$..$``, ``\\(..\\)``, ``\\[..\\]`` removed), or None when
        there is no box (or the last box is not closed, or is empty).

    Raises:
        ValueError: unknown ``extraction``.
    """
    if extraction not in _EXTRACTIONS:
        raise ValueError(f"extraction must be one of {_EXTRACTIONS}, got {extraction!r}")
    content, seen_box = _last_box(text)
    if content is not None:
        content = _strip_math(content)
        return content or None
    if extraction == "boxed_or_answer_phrase" and not seen_box:
        return _answer_phrase(text)
    return None


def _number_text(x: int | float) -> str | None:
    """A numeric gold in plain positional notation (no exponent); None for nan/inf."""
    if isinstance(x, int):
        return str(int(x))
    x = float(x)  # a float subclass (numpy.float64) would repr as "np.float64(...)"
    if not math.isfinite(x):
        return None
    if x.is_integer():
        return str(int(x))
    text = format(Decimal(repr(x)), "f")  # the shortest round-trip decimal, written out: 1e-05 -> 0.00001
    return text


def _short_float_text(value: float, dtype: Any) -> str | None:
    """A half/single precision scalar written with the digits of its own precision (float32 0.1 -> "0.1")."""
    size = getattr(dtype, "itemsize", None)
    if not isinstance(size, int) or size >= 8:
        return None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        return None
    kind = np.float16 if size == 2 and "bfloat" not in str(dtype) else np.float32  # bfloat16 is exact in float32
    text = np.format_float_positional(kind(value), unique=True, trim="-")
    return "0" if text in ("-0", "0") else text


def _normalize_gold(gold: Any) -> str | None:
    if gold is None:
        return None
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        if hasattr(gold, "item") and not isinstance(gold, bool):  # numpy / torch scalars
            scalar = gold
            try:
                gold = gold.item()
            except (ValueError, RuntimeError) as e:  # e.g. a tensor with several elements
                raise ValueError(
                    f"gold answers must be strings or numbers, got {type(gold).__name__}: {gold!r} ({e}); "
                    "convert the answer column to strings"
                ) from None
            if isinstance(gold, float) and math.isfinite(gold):
                short = _short_float_text(gold, getattr(scalar, "dtype", None))
                if short is not None:
                    return short
        if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
            raise ValueError(
                f"gold answers must be strings or numbers, got {type(gold).__name__}: {gold!r}; "
                "convert the answer column to strings"
            )
    if not isinstance(gold, str):
        return _number_text(gold)
    s = gold.strip()
    if "####" in s:  # GSM8K solutions: the answer follows the last '####'
        s = s.rsplit("####", 1)[1].strip()
    if _BOX_RE.search(s):
        content, _ = _last_box(s)
        if content is not None:
            s = content
    s = _strip_math(s)
    return s or None


# Forms math-verify 0.9 mis-parses, rewritten before it sees a gold or an answer (see "Pre-pass" in the module doc)
_UPRIGHT_CONSTANT_RE = re.compile(
    r"\\(?:mathrm|textrm|textnormal|text|mathit|operatorname)\s*\{\s*([ei])\s*\}"  # \mathrm{e}, \text{i}
    r"|\{\s*\\rm\s+([ei])\s*\}"  # {\rm e}
    r"|\\mathrm\s+([ei])(?![A-Za-z])"  # \mathrm e
)
_DIGIT_I_RE = re.compile(r"(?<=\d)i(?![A-Za-z])")  # 5i -> 5 i
_SPACED_DIGIT_I_RE = re.compile(r"(?<=\d)(?:\s|~|\\[,;:! ])+i(?![A-Za-z])")  # 5\,i, 5~i -> 5 i
_THIN_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:\\,\d{3})+(?!\d)")  # 5\,600, 1\,234\,567


def _plain_constant(m: re.Match) -> str:
    """``\\mathrm{e}`` -> ``e``, spaced only where it would merge with a command name or a letter around it."""
    text, letter = m.string, m.group(1) or m.group(2) or m.group(3)
    before = " " if m.start() > 0 and text[m.start() - 1].isalpha() else ""
    after = " " if m.end() < len(text) and text[m.end()].isalpha() else ""
    return before + letter + after


def _normalize_forms(text: str) -> str:
    """Rewrite the answer forms math-verify 0.9 mis-parses into forms it reads right (applied to golds and answers).

    * Upright constants: ``\\mathrm{e}``, ``\\text{e}``, ``\\textrm{e}``, ``\\operatorname{e}``, ``{\\rm e}``,
      ``\\mathrm e`` (and the same for ``i``) -> ``e`` / ``i``. math-verify reads ``\\frac{1}{\\mathrm{e}}`` as
      the truncated ``\\frac{1}{`` (a gold: unparseable, its rows silently dropped) and ``2\\mathrm{e}`` as ``2``.
    * The imaginary unit after a digit is written as a separate token, with any spacing between collapsed:
      ``5i``, ``5 i``, ``5\\,i``, ``5~i`` -> ``5 i``. math-verify makes ``i`` a real symbol when it touches a digit
      (``6 - 5i``) and a complex one when it stands alone (``6 - 5 i``), so the two never compared equal.
    * Thin-space thousands separators: a run of digit groups ``d{1,3}(\\,ddd)+`` not preceded by a digit or a
      decimal point -> the digits alone (``5\\,600`` -> ``5600``, ``1\\,234\\,567`` -> ``1234567``); math-verify
      reads ``5\\,600`` as 605. Only groups of exactly three digits after a ``\\,`` count, so ``(1,\\,2)`` or
      ``2\\,x`` are left alone.
    * A sentence's full stop after a whole number that ends the text or a ``{}`` group: ``5.`` -> ``5``,
      ``\\boxed{5.}`` -> ``\\boxed{5}`` (math-verify reports the gold ``5.`` unparseable and scores ``\\boxed{5.}``
      wrong against 5); decimals (``5.5``, ``.5``) are left alone.
    """
    text = _TRAILING_STOP_RE.sub(r"\1", text)
    if "\\" in text or "{" in text:
        text = _UPRIGHT_CONSTANT_RE.sub(_plain_constant, text)
        text = _THIN_THOUSANDS_RE.sub(lambda m: m.group(0).replace("\\,", ""), text)
    if "i" in text:
        text = _SPACED_DIGIT_I_RE.sub(" i", text)
        text = _DIGIT_I_RE.sub(" i", text)
    return text


_TRAILING_STOP_RE = re.compile(r"(?<![\d.])(\d+)\.(?=\s*(?:\}|$))")
_PLAIN_DECIMAL_RE = re.compile(r"[+-]?\d*\.(\d+)")


def _half_unit(text: str | None) -> str | None:
    """Half a unit in the last decimal place of ``text`` when it is one plain decimal number, else None.

    ``"0.001429"`` -> ``"5e-7"``, ``"-2.50"`` -> ``"5e-3"`` (written trailing zeros count), ``".5"`` -> ``"5e-2"``.
    Anything else (integers, fractions, ``10^{-7}``, ``2.5 \\times 10^{-7}``, percentages, tuples) -> None. The
    precision is read from the text the answer or gold was written in, before math-verify parses it into a
    number that no longer knows how many decimals it was written with.
    """
    if text is None:
        return None
    m = _PLAIN_DECIMAL_RE.fullmatch(text.strip())
    return None if m is None else f"5e-{len(m.group(1)) + 1}"


def _relatively_different(a: Any, b: Any, rel_tol: float, abs_tol: str | None = None) -> bool:
    """Whether two SymPy numbers differ by more than ``rel_tol`` relative to the larger and, with ``abs_tol`` (see
    :func:`_half_unit`), by ``abs_tol`` or more; evaluated at 50 digits. Vetoes math-verify's numeric "equal" in
    the workers. With free symbols, only when they cancel in ``a - b`` (two equations): their symbol-free terms; a
    percentage is compared both as 0.09 and as 9. Anything else (symbols left, sets, non-finite, an error): False.
    """
    from sympy import Abs, Basic, Float, Mul, Rational, UnevaluatedExpr

    if not (isinstance(a, Basic) and isinstance(b, Basic)):
        return False

    def pct(x):  # math-verify's percentage form X * UnevaluatedExpr(1/100) -> X
        if isinstance(x, Mul) and len(x.args) == 2 and x.args[1] == UnevaluatedExpr(Rational(1, 100)):
            return x.args[0]
        return x

    try:
        symbols = a.free_symbols | b.free_symbols
        if symbols:
            if (a - b).free_symbols:
                return False
            pairs = [(a.as_independent(*symbols, as_Add=True)[0], b.as_independent(*symbols, as_Add=True)[0])]
        else:
            pairs = [(a, b), (pct(a), pct(b))]
        for x, y in pairs:
            x, y = x.doit().evalf(50), y.doit().evalf(50)
            if not (x.is_number and y.is_number and x.is_finite and y.is_finite):
                return False
            diff, scale = Abs(x - y).evalf(50), max(Abs(x).evalf(50), Abs(y).evalf(50))
            if not (isinstance(diff, Float) or diff == 0) or not (isinstance(scale, Float) or scale == 0):
                return False
            if diff <= Float(rel_tol, 50) * scale:
                return False
            # less than half a unit; a tie (0.00000015 vs 0.0000001) is out, also when the binary rounding of the
            # parsed floats (53 bits: ~1e-16 relative) puts it a hair inside
            if abs_tol is not None and diff < Float(abs_tol, 50) * (1 - Float("1e-9", 50)):
                return False
        return True
    except Exception:  # math-verify's verdict stands
        return False


_HOOK_UNUSABLE = (
    "trl_prime math verifier: the installed math-verify ({version}) does not compare numbers through "
    "math_verify.grader.sympy_numeric_eq as versions 0.8/0.9 do, so the relative tolerance cannot be applied; "
    "falling back to math-verify's verdict alone (rel_tol=None: numbers below ~1e-6 all compare equal). Install "
    "math-verify>=0.8,<0.10 to restore it."
)


def _install_numeric_hook(
    grader: Any, accept: Callable[[Any, Any], bool], same: Callable[[str, str], bool]
) -> str | None:
    """Make math-verify's numeric "equal" also require ``accept(a, b)``; returns None, or why it could not.

    Wraps ``grader.sympy_numeric_eq`` (through which math-verify 0.8/0.9 compares every pair of numbers), then
    checks with ``same(gold, answer)`` that the wrapper is used: ``\\frac{1}{3}`` must still equal ``0.333333`` and
    ``\\frac{1}{2^{98}}`` no longer equal ``\\frac{1}{2^{99}}``. Otherwise ``grader`` is restored.
    """
    try:
        from importlib.metadata import version

        installed = version("math-verify")
    except Exception:
        installed = "unknown version"
    original = getattr(grader, "sympy_numeric_eq", None)
    if not callable(original):
        return _HOOK_UNUSABLE.format(version=installed)

    def numeric_eq_with_tolerance(a, b, *args, **kwargs):
        return original(a, b, *args, **kwargs) and accept(a, b)

    grader.sympy_numeric_eq = numeric_eq_with_tolerance
    try:
        used = same("\\frac{1}{3}", "0.333333") and not same("\\frac{1}{2^{99}}", "\\frac{1}{2^{98}}")
    except MemoryError:
        raise
    except Exception:
        used = False
    if used:
        return None
    grader.sympy_numeric_eq = original
    return _HOOK_UNUSABLE.format(version=installed)


_WORD_GOLD_RE = re.compile(r"[A-Za-z]+(?:\s+[A-Za-z]+)*")
_TEXT_WRAPPER_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|textnormal|mathrm|mathbf|mathit|mathsf|mathtt|mathnormal|mbox|"
    r"operatorname)\s*\{([^{}]*)\}"
)
_TEXT_SPACE_RE = re.compile(r"\\(?:[,;:! ]|quad\b|qquad\b)|~")
_TEXT_COMMAND_RE = re.compile(r"\\(?!quad\b|qquad\b)([A-Za-z]+)")  # \pi -> pi, \sin -> sin


def _is_word_gold(text: str) -> bool:
    """Letters and spaces only, with a word of two or more letters (a candidate for the text comparison)."""
    return _WORD_GOLD_RE.fullmatch(text) is not None and any(len(w) >= 2 for w in text.split())


def _text_key(text: str) -> str:
    """Normalised text of an answer for word golds: wrappers and spacing removed, case and whitespace ignored."""
    prev = None
    while prev != text:
        prev, text = text, _TEXT_WRAPPER_RE.sub(r"\1", text)
    text = _TEXT_SPACE_RE.sub(" ", _TEXT_COMMAND_RE.sub(r"\1", text))
    return "".join(text.split()).lower().rstrip(".")


def _missing_gold_detail(raw: Any) -> str:
    value = raw.item() if hasattr(raw, "item") and not isinstance(raw, (str, int, float)) else raw
    if isinstance(value, float) and not math.isfinite(value):
        return f"the gold answer {value!r} is not a finite number"
    return "the gold answer is empty"


def _completion_text(completion: Any, index: int) -> str:
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                content = message.get("content")
                if content is None:
                    return ""
                if isinstance(content, str):
                    return content
                if isinstance(content, (list, tuple)):  # content parts: [{"type": "text", "text": ...}]
                    return "".join(
                        p.get("text", "") if isinstance(p, dict) else str(p) for p in content if p is not None
                    )
                return str(content)
        return ""
    raise ValueError(
        f"completion {index} has type {type(completion).__name__}; expected a string (standard format) or a "
        "list of {'role', 'content'} messages (conversational format)"
    )


# --------------------------------------------------------------------------------------------------------------
# Worker side (runs in the pool's processes)
# --------------------------------------------------------------------------------------------------------------

_W: dict[str, Any] = {}  # in a worker: the judge set up by _worker_init (parse, same, ...), or "broken": why not


def _worker_init(math_module: str = "math_verify") -> None:  # pragma: no cover - runs in the worker process
    """pebble initializer, once per worker: import math-verify, install the tolerance hook, warm up.

    A failure is remembered (``_W["broken"]``) and every task of this worker answers with it, so the caller
    gets reason ``error`` at once instead of a pool that keeps restarting workers.
    """
    import logging
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _W.get("module") == math_module:
        return  # set up already in the forkserver this worker was forked from (trl_prime.rewards._math_worker)
    _W.clear()
    _W["module"] = math_module
    try:
        mv = __import__(math_module, fromlist=["parse"])
        grader = __import__(math_module + ".grader", fromlist=["sympy_numeric_eq"])
        import sympy
    except Exception as e:  # noqa: BLE001
        _W["broken"] = f"cannot start a math worker ({sys.executable}): {type(e).__name__}: {e}"
        return
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # also silences "timeout disabled" warnings
    _W.update(mv=mv, sympy=sympy, config=[mv.LatexExtractionConfig(boxed_match_priority=0)], golds=OrderedDict())
    _W.update(hard_cpu=resource.getrlimit(resource.RLIMIT_CPU)[1], hard_as=resource.getrlimit(resource.RLIMIT_AS)[1])
    # of the task being served: the relative tolerance, and half a unit in the last place of a plain-decimal answer
    # or gold, if any
    _W.update(rel_tol=[DEFAULT_REL_TOL], abs_tol=[None], probe=_w_parse_box(_PROBE))
    rel_tol, abs_tol = _W["rel_tol"], _W["abs_tol"]
    _W["hook_problem"] = _install_numeric_hook(
        grader,
        lambda a, b: rel_tol[0] is None or not _relatively_different(a, b, rel_tol[0], abs_tol[0]),
        lambda g, a: _w_same(_w_parse_box(g), _w_parse_box(a)),
    )
    for a, b in (("\\frac{1}{2}", "0.5"), ("x^2+1", "1+x^{2}"), ("[0,1)", "\\{1,2\\}"), ("x=3", "3")):
        _w_same(_w_parse_box(a), _w_parse_box(b))  # warm-up: lazy imports and regex compilation
        _w_same(_w_parse_box(a), _W["probe"])


def _w_parse_box(text: str) -> list:  # pragma: no cover - in the worker
    """math-verify's parse of ``text`` as the content of a box ([] when it finds nothing; MemoryError passes)."""
    try:
        return _W["mv"].parse(
            "\\boxed{" + _normalize_forms(text) + "}",
            extraction_config=_W["config"],
            fallback_mode="first_match",
            parsing_timeout=None,  # no signal.alarm: the pool kills the worker on deadline
            raise_on_error=True,
        )
    except MemoryError:
        raise
    except Exception:  # what math-verify does with raise_on_error=False
        return []


def _w_same(gold: list, answer: list) -> bool:  # pragma: no cover - in the worker
    """``math_verify.verify(gold, answer)`` (any over the product), but lets MemoryError through."""
    from itertools import product

    for g, a in product(gold, answer):
        try:
            if _W["mv"].verify(g, a, timeout_seconds=None, raise_on_error=True):
                return True
        except MemoryError:
            raise
        except Exception:
            continue
    return False


def _w_is_math(parsed: list) -> bool:  # pragma: no cover - in the worker
    sympy = _W["sympy"]
    return any(isinstance(x, (sympy.Basic, sympy.MatrixBase)) for x in parsed)


def _w_show(parsed: list) -> str | None:  # pragma: no cover - in the worker
    """A short text of the parsed expression (for ``MathResult.parsed``)."""
    sympy = _W["sympy"]
    for x in parsed:
        if isinstance(x, (sympy.Basic, sympy.MatrixBase)):
            try:
                return str(x)[:_PARSED_MAX_CHARS]
            except Exception:
                return None
    return str(parsed[0])[:_PARSED_MAX_CHARS] if parsed else None


def _w_letter_product(parsed: list) -> bool:  # pragma: no cover - in the worker
    """Whether math-verify read a word: a product of one-letter symbols (e = E, repeated letters as powers)."""
    sympy = _W["sympy"]
    expr = next((x for x in parsed if isinstance(x, sympy.Basic)), None)
    if expr is None or not isinstance(expr, (sympy.Mul, sympy.Pow, sympy.Symbol)):
        return False
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, (sympy.Mul, sympy.Pow, sympy.Symbol)) or node in (sympy.S.Exp1, sympy.S.ImaginaryUnit):
            continue
        if isinstance(node, sympy.Integer) and node > 0:  # exponents of repeated letters
            continue
        return False  # a function, number, relation, set...: math-verify read real math
    return True


def _w_limits(seconds: float, mb: int) -> None:  # pragma: no cover - in the worker
    """RLIMIT_CPU backstop (should the pool die while we spin) and the soft RLIMIT_AS of this task."""
    import resource

    hard_cpu, hard_as = _W["hard_cpu"], _W["hard_as"]
    try:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(ru.ru_utime + ru.ru_stime + seconds) + 10
        resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard_cpu) if hard_cpu >= 0 else soft, hard_cpu))
    except (ValueError, OSError):
        pass
    if _W.get("memory") != mb:
        soft = (int(mb) << 20) if mb and mb > 0 else resource.RLIM_INFINITY
        if hard_as != resource.RLIM_INFINITY:
            soft = hard_as if soft == resource.RLIM_INFINITY else min(soft, hard_as)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard_as))
            _W["memory"] = mb
        except (ValueError, OSError):
            pass


def _worker_gold(gold_text: str, seconds: float, memory_mb: int) -> tuple:  # pragma: no cover - in the worker
    """Parse one gold answer (and probe one comparison with it): ``(status, shown, hook problem, seconds)``.

    ``status``: ``ok``, ``unparseable``, ``memory`` or ``broken`` (the worker could not start; ``shown`` says why).
    """
    if "broken" in _W:
        return "broken", _W["broken"], None, 0.0
    t0 = time.monotonic()
    _w_limits(seconds, memory_mb)
    golds = _W["golds"]
    if gold_text in golds:
        golds.move_to_end(gold_text)
        status, gold, word = golds[gold_text]
    else:
        try:
            gold = _w_parse_box(gold_text)
            status = "ok" if _w_is_math(gold) else "unparseable"
            word = None
            if status == "ok" and _is_word_gold(gold_text) and _w_letter_product(gold):
                word = _text_key(gold_text)  # a word, not a product of variables: compared as text
            elif status == "ok":
                _w_same(gold, _W["probe"])  # a gold whose every comparison hangs fails here, under its deadline
        except MemoryError:
            return "memory", None, _W["hook_problem"], time.monotonic() - t0
        golds[gold_text] = (status, gold, word)
        if len(golds) > 1024:
            golds.popitem(last=False)
    shown = ("text: " + word) if word is not None else _w_show(gold)
    return status, shown, _W["hook_problem"], time.monotonic() - t0


def _worker_answer(
    gold_text: str, answer: str, seconds: float, memory_mb: int, rel_tol: float | None
) -> tuple:  # pragma: no cover - runs in the worker process
    """Parse one answer and compare it with the gold: ``(verdict, shown)``.

    ``verdict``: ``correct``, ``wrong``, ``no_answer``, ``timeout`` (the step itself took longer than ``seconds``:
    the gold was parsed first in this worker and the hard deadline covers both), ``memory``, ``gold_failed`` or
    ``broken``.
    """
    if "broken" in _W:
        return "broken", _W["broken"]
    status, _, _, _ = _worker_gold(gold_text, seconds, memory_mb)
    if status != "ok":
        return ("memory", None) if status == "memory" else ("gold_failed", None)
    _, gold, word = _W["golds"][gold_text]
    if word is not None:
        key = _text_key(answer)
        return ("correct" if key == word else "wrong") if key else "no_answer", key[:_PARSED_MAX_CHARS] or None
    t0 = time.monotonic()
    _W["rel_tol"][0] = None if _W["hook_problem"] else rel_tol
    try:
        _w_limits(seconds, memory_mb)
        parsed = _w_parse_box(answer)
        if not parsed:
            return "no_answer", None
        units = [u for u in (_half_unit(gold_text), _half_unit(answer)) if u is not None]
        _W["abs_tol"][0] = max(units, key=float) if units else None  # the coarser written precision
        verdict = "correct" if _w_same(gold, parsed) else "wrong"
    except MemoryError:
        return "memory", None
    finally:
        _W["abs_tol"][0] = None
    if time.monotonic() - t0 > seconds:
        return "timeout", None
    return verdict, _w_show(parsed)


# --------------------------------------------------------------------------------------------------------------
# Pool (calling process): pebble, workers forked from a clean forkserver
# --------------------------------------------------------------------------------------------------------------


def _default_num_workers() -> int:
    env = os.environ.get("TRL_PRIME_MATH_WORKERS")
    if env:
        return max(1, int(env))
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


class _NoMainPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver launch, without the data that makes a child import the caller's ``__main__``.

    A worker only needs this module and math-verify (preloaded in the forkserver), so a training script without an
    ``if __name__ == "__main__":`` guard is not run again in every worker. Body: CPython's ``Popen._launch`` minus
    the ``init_main_from_*`` keys.
    """

    def _launch(self, process_obj):
        prep_data = {
            k: v for k, v in spawn.get_preparation_data(process_obj._name).items() if not k.startswith("init_main")
        }
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = _FORKSERVER[0].connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def _new_forkserver() -> forkserver.ForkServer:
    """This module's own forkserver (not multiprocessing's global one): it preloads and warms the judge."""
    server = forkserver.ForkServer()
    server.set_forkserver_preload(["trl_prime.rewards._math_worker"])
    return server


_FORKSERVER = [_new_forkserver()]  # started on first use; a new one in a forked child


class _WorkerContext(mp_context.ForkServerContext):
    class Process(mp_context.ForkServerProcess):
        @staticmethod
        def _Popen(process_obj):
            return _NoMainPopen(process_obj)


def _new_pool(num_workers: int) -> pebble.ProcessPool:
    """``num_workers`` processes forked from the forkserver (a clean process: no threads, no CUDA of the caller's),
    which has this module and math-verify imported already, so a replaced worker is ready in well under a second."""
    ctx = _WorkerContext()
    # a timed-out task's worker gets SIGTERM and then SIGKILL after term_timeout; a worker stuck in C code (a huge
    # integer power) ignores SIGTERM, and pebble's manager thread would wait 3 s for it, holding every result
    pebble.common.CONSTS.term_timeout = min(pebble.common.CONSTS.term_timeout, 0.1)
    return pebble.ProcessPool(max_workers=num_workers, initializer=_worker_init, initargs=(_MATH_MODULE,), context=ctx)


_MATH_MODULE = "math_verify"  # what the workers import (tests point it elsewhere to break the workers)


class _Pool:
    """A pebble pool shared by every thread of this process (``users`` calls in flight)."""

    def __init__(self, size: int):
        self.pid = os.getpid()
        self.size = size
        self.pool = _new_pool(size)
        self.users = 0

    def pids(self) -> list[int]:
        try:
            return [w.pid for w in self.pool._pool_manager.worker_manager.workers.values() if w.is_alive()]
        except AttributeError:  # pebble internals moved; diagnostics only
            return []

    def stop(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=10)


_LOCK = threading.Lock()  # guards _POOL and the caches (never held while waiting for workers)
_POOL: _Pool | None = None
_CLOSING = False  # set at interpreter exit
# (gold, answer, rel_tol) -> (reason, parsed)
_ANSWER_CACHE: OrderedDict[tuple[str, str, float | None], tuple[str, str | None]] = OrderedDict()
# gold -> seconds its parse took (parseable) or False (unparseable): deterministic outcomes only
_GOLD_CACHE: OrderedDict[str, float | bool] = OrderedDict()
# gold -> the largest timeout (s) under which parsing it timed out: a call with that timeout or less skips it
_GOLD_TIMEOUTS: OrderedDict[str, float] = OrderedDict()
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A worker's start-up problem (e.g. the tolerance hook cannot be applied), warned once per process."""
    with _LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=2)


def _acquire_pool(num_workers: int) -> _Pool:
    """The shared pool (created on first use; re-created at another size when no call is using it)."""
    global _POOL
    with _LOCK:
        if _CLOSING:
            raise RuntimeError("the interpreter is exiting")
        pool = _POOL
        if pool is not None and pool.pid != os.getpid():  # inherited through fork: not ours to use or stop
            pool = _POOL = None
        try:
            alive = pool is None or pool.pool.active
        except Exception:  # noqa: BLE001 - its workers cannot start
            alive = False
        if not alive:  # pebble gave up on it (e.g. a worker died while idle)
            pool.pool.stop()
            pool = _POOL = None
        if pool is not None and pool.size != num_workers and pool.users == 0:
            pool.stop()
            pool = _POOL = None
        if pool is None:
            pool = _POOL = _Pool(num_workers)
            _stop_before_multiprocessing_joins()
        pool.users += 1
        return pool


def _release_pool(pool: _Pool) -> None:
    with _LOCK:
        pool.users -= 1


def _swap_pool(broken: _Pool, num_workers: int) -> _Pool:
    """A working pool in place of ``broken`` (which pebble stopped): the one another thread made already, or new."""
    _release_pool(broken)
    broken.pool.stop()
    return _acquire_pool(num_workers)


class _Batch:
    """One call's steps on the shared pool: ``todo`` maps gold -> distinct answers (golds of unknown parseability
    are parsed first). Each step is one pebble task with a hard deadline; a call keeps at most ``num_workers`` tasks
    in the pool's queue (the rest in its backlog), so concurrent calls take turns on the workers."""

    def __init__(self, todo, timeout: float, memory_limit_mb: int, rel_tol, num_workers: int, out: _Outcomes):
        self.pool = _acquire_pool(num_workers)  # replaced should pebble give up on it
        self.todo, self.timeout, self.memory_limit_mb, self.rel_tol = todo, timeout, memory_limit_mb, rel_tol
        self.num_workers, self.out = num_workers, out
        self.pending: dict[Any, tuple] = {}  # future -> (kind, gold, answer, attempt, deadline of our own wait)
        self.backlog: deque[tuple] = deque()  # (kind, gold, answer, attempt) not handed to the pool yet

    def submit(self, kind: str, gold: str, answer: str | None, attempt: int = 1) -> None:
        if attempt == 1:
            self.backlog.append((kind, gold, answer, 1))
        else:  # a retry of a step whose worker died goes first
            self.backlog.appendleft((kind, gold, answer, attempt))

    def flush(self) -> None:
        while self.backlog and len(self.pending) < self.num_workers:
            self.schedule(*self.backlog.popleft())

    def schedule(self, kind: str, gold: str, answer: str | None, attempt: int) -> None:
        """Hand one step to the pool; its result is given up on past its deadline + a worker's start + one deadline
        per call sharing the pool."""
        failed = {gold: [] if answer is None else [answer]}
        try:
            if not self.pool.pool.active:  # (pebble starts its workers here)
                self.pool = _swap_pool(self.pool, self.num_workers)
        except Exception as e:  # noqa: BLE001 - the workers cannot start: an infrastructure failure
            self.out.fail_all(failed, f"math worker pool unavailable: {type(e).__name__}: {e}")
            return
        timeout = self.timeout
        if kind == "g":
            fn, args, limit = _worker_gold, (gold, timeout, self.memory_limit_mb), timeout
        else:
            known = _GOLD_CACHE.get(gold)
            gold_seconds = known if isinstance(known, float) and not isinstance(known, bool) else timeout
            fn, args = _worker_answer, (gold, answer, timeout, self.memory_limit_mb, self.rel_tol)
            limit = timeout + gold_seconds + 0.25
        try:
            fut = self.pool.pool.schedule(fn, args=args, timeout=limit)
        except Exception as e:  # noqa: BLE001 - the pool stopped (e.g. at exit)
            self.out.fail_all(failed, f"math worker pool unavailable: {type(e).__name__}: {e}")
            return
        grace = _STARTUP_TIMEOUT + timeout * max(1, self.pool.users)
        self.pending[fut] = (kind, gold, answer, attempt, time.monotonic() + limit + grace)

    def run(self) -> None:
        try:
            for gold, answers in self.todo.items():
                if gold in _GOLD_CACHE:
                    for a in answers:
                        self.submit("a", gold, a)
                else:
                    self.submit("g", gold, None)
            self.flush()
            while self.pending:
                done, _ = futures_wait(list(self.pending), timeout=0.5, return_when=FIRST_COMPLETED)
                now = time.monotonic()
                for fut in [f for f, job in self.pending.items() if f not in done and now > job[4]]:
                    _, gold, answer, _, _ = self.pending.pop(fut)
                    fut.cancel()
                    failed = {gold: [] if answer is None else [answer]}
                    self.out.fail_all(failed, "no result from the math worker pool")
                for fut in done:
                    kind, gold, answer, attempt, _ = self.pending.pop(fut)
                    args = (kind, gold, answer, attempt, self.timeout, self.memory_limit_mb, self.todo)
                    _collect(fut, *args, self.out, self.submit)
                self.flush()
        finally:
            for fut in self.pending:
                fut.cancel()
            _release_pool(self.pool)


def _collect(fut, kind, gold, answer, attempt, timeout, memory_limit_mb, todo, out, submit) -> None:
    """Record one finished task; submit what follows from it (a parsed gold's answers, a crashed step's retry)."""
    try:
        res = fut.result()
    except FuturesTimeout:
        if kind == "g":
            out.gold_failed(gold, "gold_unparseable", f"parsing the gold answer took longer than {timeout:g}s", True)
        else:
            out.answer(gold, answer, "timeout", None, f"parse/verify exceeded {timeout:g}s")
        return
    except (pebble.ProcessExpired, BrokenProcessPool) as e:  # the worker (or pebble) died: retry once elsewhere
        if attempt < 2:
            submit(kind, gold, answer, attempt + 1)
            return
        who = f"math worker {e.pid} died (exit code {e.exitcode})" if hasattr(e, "pid") else f"the pool broke ({e})"
        detail = f"{who} while "
        if kind == "g":
            out.gold_failed(gold, "error", detail + "parsing the gold answer, twice")
        else:
            out.answer(gold, answer, "error", None, detail + "verifying this answer, twice")
        return
    except Exception as e:  # noqa: BLE001 - anything else is the infrastructure's, never the completion's
        out.fail_all({gold: [] if answer is None else [answer]}, f"math worker failed: {type(e).__name__}: {e}")
        return
    if kind == "g":
        status, shown, hook_problem, seconds = res
        if hook_problem:
            _warn_once(hook_problem)
        if status == "broken":
            out.fail_all({gold: todo[gold]}, shown)
        elif status == "ok":
            out.ok[gold] = float(seconds)
            with _LOCK:
                _cache_put(_GOLD_CACHE, gold, float(seconds))
            for a in todo[gold]:
                submit("a", gold, a)
        elif status == "unparseable":
            out.gold_failed(gold, "gold_unparseable", "math-verify could not parse the gold answer", cacheable=True)
        else:
            out.gold_failed(gold, "gold_unparseable", "parsing the gold answer exceeded the worker memory limit")
        return
    verdict, shown = res
    if verdict == "broken":
        out.answer(gold, answer, "error", None, shown)
    elif verdict == "memory":
        out.answer(gold, answer, "timeout", None, f"exceeded the worker memory limit ({memory_limit_mb} MiB)")
    elif verdict == "timeout":
        out.answer(gold, answer, "timeout", None, f"parse/verify exceeded {timeout:g}s")
    elif verdict == "gold_failed":  # parsed before, not in this worker: cannot happen for a deterministic parser
        out.answer(gold, answer, "error", None, "the gold answer could not be parsed again in another worker")
    else:
        out.answer(gold, answer, verdict, shown, "")


class _Outcomes:
    """Results of one call, keyed by gold and (gold, answer)."""

    def __init__(self):
        self.golds: dict[str, tuple[str, str]] = {}  # gold -> (reason, detail) when the gold failed
        self.ok: dict[str, float] = {}  # gold -> seconds its parse took
        self.answers: dict[tuple[str, str], tuple[str, str | None, str]] = {}
        self.cacheable_golds: set[str] = set()
        self.timed_out_golds: set[str] = set()

    def gold_failed(self, gold: str, reason: str, detail: str, timed_out: bool = False, cacheable: bool = False):
        self.golds.setdefault(gold, (reason, detail))
        if cacheable:
            self.cacheable_golds.add(gold)
        if timed_out:
            self.timed_out_golds.add(gold)

    def answer(self, gold: str, answer: str, reason: str, parsed: str | None, detail: str) -> None:
        self.answers.setdefault((gold, answer), (reason, parsed, detail))

    def fail_all(self, todo: dict[str, list[str]], why: str) -> None:
        """An infrastructure failure: every listed gold (when not known yet) and answer gets ``error``."""
        for gold, answers in todo.items():
            if gold not in self.ok and gold not in _GOLD_CACHE:
                self.gold_failed(gold, "error", why)
            for a in answers:
                self.answer(gold, a, "error", None, why)


def shutdown_math_workers() -> None:
    """Stop the worker processes; the next call starts new ones. Workers also stop at interpreter exit."""
    global _POOL
    with _LOCK:
        pool, _POOL = _POOL, None
    if pool is not None and pool.pid == os.getpid():
        pool.stop()


def start_math_workers(num_workers: int | None = None, *, wait: float = 60.0) -> int:
    """Start the worker pool now (workers otherwise start on the first call, which then waits for them).

    Args:
        num_workers: pool size, as in :func:`verify_math` (default: CPUs available, at most 8).
        wait: seconds to wait for the workers to be ready (each imports math-verify and warms up once); 0 returns
            at once.

    Returns:
        The number of workers that answered a probe within ``wait`` (at most ``num_workers``).

    Raises:
        ValueError: ``num_workers`` is not a positive integer.
    """
    if num_workers is None:
        num_workers = _default_num_workers()
    if not (isinstance(num_workers, int) and num_workers >= 1):
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    pool = _acquire_pool(num_workers)
    try:
        if wait <= 0:
            return 0
        probes = [
            pool.pool.schedule(_worker_gold, args=(_PROBE, DEFAULT_TIMEOUT, DEFAULT_MEMORY_LIMIT_MB))
            for _ in range(num_workers)
        ]
        done, _ = futures_wait(probes, timeout=wait)
        return min(num_workers, sum(1 for f in done if not f.exception() and f.result()[0] == "ok"))
    finally:
        _release_pool(pool)


def _worker_pids() -> list[int]:
    """PIDs of the live worker processes (for tests and diagnostics)."""
    with _LOCK:
        pool = _POOL
    return pool.pids() if pool is not None and pool.pid == os.getpid() else []


def _after_fork_in_child() -> None:
    global _POOL, _LOCK, _CLOSING
    _LOCK = threading.Lock()
    _CLOSING = False
    _POOL = None  # the parent's pool (its threads did not survive the fork): not ours to use or stop
    _FORKSERVER[0] = _new_forkserver()  # the parent's forkserver answers the parent only


def _at_exit() -> None:
    """Stop the workers at interpreter exit; a call still running in a daemon thread gets ``error`` results."""
    global _CLOSING, _POOL
    _CLOSING = True
    pool, _POOL = _POOL, None
    if pool is not None and pool.pid == os.getpid():
        pool.stop()


atexit.register(_at_exit)
_FINALIZER_PID = [0]


def _stop_before_multiprocessing_joins() -> None:
    """In a process started by ``multiprocessing``, ``atexit`` runs only after multiprocessing joins the process's
    non-daemon children, and pebble's workers are non-daemon: they would wait for work forever and the process would
    never exit. A finalizer with an exit priority runs before those joins (in every process, once per pid)."""
    if _FINALIZER_PID[0] != os.getpid():
        _FINALIZER_PID[0] = os.getpid()
        util.Finalize(None, _at_exit, exitpriority=100)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _cache_put(cache: OrderedDict, key, value, size: int = _CACHE_SIZE) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > size:
        cache.popitem(last=False)


def _gold_timed_out_before(gold: str, timeout: float) -> float | None:
    """The timeout under which parsing ``gold`` already timed out, if it is >= ``timeout`` (else None)."""
    seconds = _GOLD_TIMEOUTS.get(gold)
    if seconds is None or timeout > seconds:
        return None
    _GOLD_TIMEOUTS.move_to_end(gold)
    return seconds


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------


def _check_rel_tol(rel_tol: Any) -> float | None:
    if rel_tol is None:
        return None
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, (int, float)) or not 0 <= rel_tol < 1:
        raise ValueError(
            f"rel_tol must be a number in [0, 1) (relative tolerance for numbers; default {DEFAULT_REL_TOL:g}) or "
            f"None (math-verify's verdict alone), got {rel_tol!r}"
        )
    return float(rel_tol)


def verify_math(
    completions: Sequence[Any],
    golds: Sequence[Any],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    num_workers: int | None = None,
    extraction: str = "boxed",
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    rel_tol: float | None = DEFAULT_REL_TOL,
) -> list[MathResult]:
    """Check the final answer of each completion against its gold answer with ``math-verify``.

    Args:
        completions: one per row: a string (standard format), or a list of ``{"role", "content"}`` messages
            (conversational format: the last assistant message is used; ``content`` may be a string or a list
            of ``{"type": "text", "text": ...}`` parts). None counts as an empty completion.
        golds: one gold answer per completion: a string (``"42"``, ``"\\frac{1}{2}"``, ``"$x^2$"``, a solution
            with a ``\\boxed{}`` or ending in ``#### 42``) or a number. None or empty -> ``gold_unparseable``.
        timeout: wall-clock seconds allowed for each step in a worker: parsing one gold answer, or parsing and
            verifying one answer. A step past it is killed: the answer scores 0 (``timeout``); a gold past it
            makes its rows ``gold_unparseable``. The call itself takes about (distinct answers x their cost) /
            ``num_workers``; the first call also waits for the workers to start (about a second).
        num_workers: worker processes (default: the CPUs this process may use, at most 8; environment
            variable ``TRL_PRIME_MATH_WORKERS`` overrides). The pool persists across calls.
        extraction: ``"boxed"`` (default; only the last ``\\boxed{}``/``\\fbox{}`` is a final answer) or
            ``"boxed_or_answer_phrase"`` (see :func:`extract_answer`).
        memory_limit_mb: address-space cap (``RLIMIT_AS``) of each worker, in MiB; 0 disables it.
        rel_tol: relative tolerance for numbers (default ``1e-4``, as in the ToRA / Qwen2.5-Math graders): a
            numeric "equal" of math-verify (also inside tuples, sets, intervals, matrices, equations) also needs
            ``|a - b| <= rel_tol * max(|a|, |b|)``, or, for one plain decimal answer or gold, a difference below
            half a unit in its last written place (see the module docstring). It only turns "equal" into "not
            equal". None: math-verify's verdict alone (also the fallback, warned once, when the installed
            math-verify cannot take it).

    Returns:
        One :class:`MathResult` per completion, in order. ``reason`` is one of :data:`REASONS`: ``correct``
        (reward 1.0), ``wrong``/``no_answer``/``timeout`` (0.0), ``gold_unparseable``/``error`` (None). A gold
        answer that cannot be parsed makes every row with that gold ``gold_unparseable`` (None), whatever the
        completion holds. Infrastructure failures (workers cannot start, a worker crashes twice on the same
        item) give ``error`` (None), never 0.

    Raises:
        ValueError: ``completions`` and ``golds`` differ in length or are not sequences, a completion or gold has
            an unsupported type, or ``timeout``/``num_workers``/``extraction``/``rel_tol`` is invalid.

    Thread-safe: calls from any number of threads (or a running event loop, which it blocks) share the workers;
    a slow answer holds one worker for at most its deadline, enforced by killing the worker.
    """
    num_workers = _check_arguments(completions, golds, timeout, extraction, num_workers, memory_limit_mb)
    rel_tol = _check_rel_tol(rel_tol)
    answers = [extract_answer(_completion_text(c, i), extraction) for i, c in enumerate(completions)]
    gold_texts = [_normalize_gold(g) for g in golds]
    with _LOCK:
        todo = _new_work(gold_texts, answers, timeout, rel_tol)
    out = _Outcomes()
    if todo:  # the lock is not held here: other threads' calls share the workers meanwhile
        try:
            batch = _Batch(todo, float(timeout), int(memory_limit_mb), rel_tol, num_workers, out)
        except Exception as e:  # noqa: BLE001 - whatever stops the pool is an infrastructure failure
            out.fail_all(todo, f"math worker pool unavailable: {type(e).__name__}: {e}")
        else:
            batch.run()
    with _LOCK:
        _memoise(out, timeout, rel_tol)
        return [
            _result(raw, gold, answer, out, timeout, rel_tol) for raw, gold, answer in zip(golds, gold_texts, answers)
        ]


def _check_arguments(completions, golds, timeout, extraction, num_workers, memory_limit_mb) -> int:
    """Validate :func:`verify_math`'s arguments (ValueError); the number of workers to use."""
    if isinstance(completions, (str, bytes)) or not hasattr(completions, "__len__"):
        raise ValueError("completions must be a list (one completion per row), got " + type(completions).__name__)
    if isinstance(golds, (str, bytes)) or not hasattr(golds, "__len__"):
        raise ValueError("golds must be a list with one gold answer per completion, got " + type(golds).__name__)
    if len(completions) != len(golds):
        raise ValueError(
            f"got {len(completions)} completions but {len(golds)} gold answers; pass exactly one gold answer per "
            "completion (in TRL, the dataset's answer column is repeated for each of the num_generations samples)"
        )
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if extraction not in _EXTRACTIONS:
        raise ValueError(f"extraction must be one of {_EXTRACTIONS}, got {extraction!r}")
    if num_workers is None:
        num_workers = _default_num_workers()
    if not (isinstance(num_workers, int) and num_workers >= 1):
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    if not (isinstance(memory_limit_mb, int) and memory_limit_mb >= 0):
        raise ValueError(f"memory_limit_mb must be an integer >= 0 (0: no cap), got {memory_limit_mb!r}")
    return num_workers


def _new_work(gold_texts, answers, timeout: float, rel_tol: float | None) -> dict[str, list[str]]:
    """What must go to the workers (under ``_LOCK``): gold -> its distinct new answers, for each gold whose
    parseability is unknown or that has an answer not memoised yet."""
    todo: dict[str, dict[str, None]] = {}  # gold -> distinct answers (an ordered set)
    for gold, answer in zip(gold_texts, answers):
        if gold is None:
            continue
        parseable = _GOLD_CACHE.get(gold)
        if parseable is False or (parseable is None and _gold_timed_out_before(gold, timeout) is not None):
            continue
        if answer is None or (gold, answer, rel_tol) in _ANSWER_CACHE:
            if parseable is None:
                todo.setdefault(gold, {})
            continue
        todo.setdefault(gold, {})[answer] = None
    return {g: list(a) for g, a in todo.items()}


def _memoise(out: _Outcomes, timeout: float, rel_tol: float | None) -> None:
    """Remember a call's deterministic outcomes (under ``_LOCK``)."""
    for gold, seconds in out.ok.items():
        _cache_put(_GOLD_CACHE, gold, seconds)
        _GOLD_TIMEOUTS.pop(gold, None)
    for gold in out.cacheable_golds:
        _cache_put(_GOLD_CACHE, gold, False)
    for gold in out.timed_out_golds:
        seconds = max(float(timeout), _GOLD_TIMEOUTS.get(gold, 0.0))
        _cache_put(_GOLD_TIMEOUTS, gold, seconds, _GOLD_TIMEOUT_CACHE_SIZE)
    for (gold, answer), (reason, parsed, _) in out.answers.items():
        if reason in ("correct", "wrong", "no_answer") and len(gold) + len(answer) <= _CACHE_MAX_CHARS:
            _cache_put(_ANSWER_CACHE, (gold, answer, rel_tol), (reason, parsed))


def _result(raw, gold: str | None, answer: str | None, out: _Outcomes, timeout: float, rel_tol) -> MathResult:
    """One row's :class:`MathResult` from this call's outcomes and the memo (under ``_LOCK``)."""
    if gold is None:
        return MathResult(None, "gold_unparseable", answer, None, None, _missing_gold_detail(raw))
    if gold not in out.golds and gold not in out.ok:
        if _GOLD_CACHE.get(gold) is False:
            out.golds[gold] = ("gold_unparseable", "math-verify could not parse the gold answer")
        elif _GOLD_CACHE.get(gold) is None:
            seconds = _gold_timed_out_before(gold, timeout)
            if seconds is not None:
                why = f"parsing the gold answer took longer than {seconds:g}s (remembered from an earlier call)"
                out.golds[gold] = ("gold_unparseable", why)
    if gold in out.golds:
        reason, detail = out.golds[gold]
        return MathResult(None, reason, answer, gold, None, detail)
    if answer is None:
        return MathResult(0.0, "no_answer", None, gold, None, "no complete \\boxed{} answer")
    got = out.answers.get((gold, answer))
    if got is None:
        cached = _ANSWER_CACHE.get((gold, answer, rel_tol))
        if cached is not None:
            _ANSWER_CACHE.move_to_end((gold, answer, rel_tol))
            got = (cached[0], cached[1], "")
        else:  # cannot happen unless the pool lost the item; never a silent 0
            got = ("error", None, "no verdict was produced for this answer")
    reason, parsed, detail = got
    if reason == "no_answer" and not detail:
        detail = "math-verify found no expression in the final answer"
    return MathResult(_REWARD_OF[reason], reason, answer, gold, parsed, detail)


_TRL_KWARGS = ("prompts", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


class _LastCall:
    """``reward.last_counts`` / ``reward.last_results``: the value of the last call made **in the current thread**
    (``default()`` in a thread that made none), read like that dict or list (``==``, ``dict(...)``, ``list(...)``).
    Concurrent callers in different threads never see each other's batches (coroutines of one event loop share it:
    read it right after the call)."""

    def __init__(self, default: Callable[[], Any]):
        self._local, self._default = threading.local(), default

    def _get(self):
        return getattr(self._local, "value", None) or self._default()

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())

    def keys(self):
        return self._get().keys()

    def __eq__(self, other):
        return self._get() == (other._get() if isinstance(other, _LastCall) else other)

    __hash__ = None

    def __repr__(self):
        return repr(self._get())


def _remember_last_call(fn: Callable, counts: dict, results: list) -> None:
    for name, value, default in (("last_counts", counts, _zero_counts), ("last_results", results, list)):
        if not isinstance(getattr(fn, name, None), _LastCall):  # never set, or replaced by the user
            setattr(fn, name, _LastCall(default))
        getattr(fn, name)._local.value = value


def _zero_counts() -> dict[str, int]:
    return dict.fromkeys(REASONS, 0)


def _score(
    fn: Callable,
    column: str,
    completions: Sequence[Any],
    golds: Sequence[Any] | None,
    kwargs: dict,
    options: dict,
) -> list[float | None]:
    if golds is None:
        columns = sorted(k for k in kwargs if k not in _TRL_KWARGS)
        raise ValueError(
            f"{fn.__name__} needs the gold answers in the dataset column {column!r}, which was not passed "
            f"(columns received: {columns}). Add a {column!r} column to the dataset, or build the reward with "
            f"make_math_reward(answer_column='<your column>')."
        )
    if isinstance(golds, (str, bytes)) or not hasattr(golds, "__len__"):
        raise ValueError(
            f"{fn.__name__}: column {column!r} must be a list with one gold answer per completion, got "
            f"{type(golds).__name__}"
        )
    if len(golds) != len(completions):
        raise ValueError(
            f"{fn.__name__}: column {column!r} has {len(golds)} values for {len(completions)} completions; it "
            "must hold exactly one gold answer per completion"
        )
    results = verify_math(completions, golds, **options)
    counts = dict.fromkeys(REASONS, 0)
    for r in results:
        counts[r.reason] += 1
    _remember_last_call(fn, counts, list(results))
    log_metric = kwargs.get("log_metric")
    if callable(log_metric):
        for reason, count in counts.items():
            log_metric(f"math/{reason}", float(count))
    return [r.reward for r in results]


def make_math_reward(
    answer_column: str = "solution",
    *,
    timeout: float = DEFAULT_TIMEOUT,
    num_workers: int | None = None,
    extraction: str = "boxed",
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
    rel_tol: float | None = DEFAULT_REL_TOL,
    name: str | None = None,
) -> Callable[..., list[float | None]]:
    """Build a TRL reward function that scores math completions against the dataset column ``answer_column``.

    Args:
        answer_column: the dataset column holding the gold answers (TRL passes every dataset column to reward
            functions as a keyword argument).
        timeout, num_workers, extraction, memory_limit_mb, rel_tol: as in :func:`verify_math`.
        name: the function's ``__name__`` (TRL logs rewards under it); default ``"math_reward"`` for the
            ``solution`` column, else ``"math_reward_<column>"``.

    Returns:
        ``reward(completions, **kwargs) -> list[float | None]``: 1.0 correct, 0.0 wrong / no answer / timeout,
        None when unscorable (``gold_unparseable``, ``error``; TRL turns None into NaN). After each call
        ``reward.last_counts`` maps every reason of :data:`REASONS` to its count in the batch and
        ``reward.last_results`` holds the :class:`MathResult` list - both of the last call **made in the calling
        thread** (thread-local, so concurrent callers never see each other's batches); when TRL passes
        ``log_metric``, each count is logged as ``math/<reason>`` (per call).

    Raises:
        ValueError: (when called) the answer column is missing or its length differs from ``completions``; see
        :func:`verify_math` for the rest. Invalid options raise here, at construction.
    """
    if not isinstance(answer_column, str) or not answer_column:
        raise ValueError(f"answer_column must be a non-empty string, got {answer_column!r}")
    if extraction not in _EXTRACTIONS:
        raise ValueError(f"extraction must be one of {_EXTRACTIONS}, got {extraction!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    rel_tol = _check_rel_tol(rel_tol)
    options = dict(
        timeout=timeout,
        num_workers=num_workers,
        extraction=extraction,
        memory_limit_mb=memory_limit_mb,
        rel_tol=rel_tol,
    )

    def reward(completions, **kwargs):
        return _score(reward, answer_column, completions, kwargs.get(answer_column), kwargs, options)

    reward.__name__ = reward.__qualname__ = name or (
        "math_reward" if answer_column == "solution" else f"math_reward_{answer_column}"
    )
    reward.__doc__ = (
        f"TRL reward: math-verify check of the last \\boxed{{}} against column {answer_column!r} "
        "(see trl_prime.rewards.math_verifier.make_math_reward)."
    )
    reward.last_counts = _LastCall(_zero_counts)
    reward.required_columns = (answer_column,)  # checked by the trl-prime trainers at start-up
    reward.last_results = _LastCall(list)
    return reward


def math_reward(completions: Sequence[Any], solution: Sequence[Any] | None = None, **kwargs) -> list[float | None]:
    """TRL reward function: 1.0 if the last ``\\boxed{}`` of a completion equals the ``solution`` column.

    Args:
        completions: standard (strings) or conversational (lists of messages) completions, as TRL passes them.
        solution: the gold answer of each completion (the dataset column ``solution``). For another column
            use ``make_math_reward(answer_column="answer")``.
        **kwargs: the other dataset columns and TRL's extras; ``log_metric`` (if given) receives
            ``math/<reason>`` counts for every reason in :data:`REASONS`.

    Returns:
        One reward per completion: 1.0 ``correct``; 0.0 ``wrong``, ``no_answer`` (no complete box: a number in
        the prose never counts), ``timeout``; None ``gold_unparseable`` or ``error`` (NaN in TRL). The counts of
        the last batch are in ``math_reward.last_counts``, the full :class:`MathResult` list in
        ``math_reward.last_results``; both are thread-local: they hold the last call made in the reading thread.
        Defaults: ``timeout=5`` s per step, workers = CPUs (at most 8), 1 GiB per worker, ``rel_tol=1e-4``.

    Raises:
        ValueError: the ``solution`` column is missing or has a different length than ``completions``.
    """
    return _score(math_reward, "solution", completions, solution, kwargs, _DEFAULT_OPTIONS)


_DEFAULT_OPTIONS = dict(
    timeout=DEFAULT_TIMEOUT,
    num_workers=None,
    extraction="boxed",
    memory_limit_mb=DEFAULT_MEMORY_LIMIT_MB,
    rel_tol=DEFAULT_REL_TOL,
)
math_reward.last_counts = _LastCall(_zero_counts)
math_reward.required_columns = ("solution",)  # type: ignore[attr-defined]  # checked at trainer start-up
math_reward.last_results = _LastCall(list)
