"""Throughput of the outcome verifiers with their timeouts on (issue 7): math answers/s and code programs/s.

Math: ``trl_prime.rewards.verify_math`` (math-verify in a pool of worker processes, a hard wall-clock deadline per
answer, default ``timeout=5``) on completions of the shape a policy writes -- a few lines of reasoning and a final
``\\boxed{}`` -- over integer, fraction, decimal and expression answers, correct, wrong and unboxed, in batches the
size of a training step. Every ``(gold, answer)`` pair is distinct, so the verifier's memoisation of repeated pairs
never helps. The pool is started before timing (it is started once per training run); ``cold`` reports the first
batch including pool start-up separately.

Math from threads (issue 28): ``--threads`` (8) threads call ``verify_math`` at once, each with a batch of
``--thread-batch`` distinct clean answers; then the same with one more batch holding a poisoned answer (a power tower
that runs into its ``--poison-timeout`` deadline) started just before them. The poison holds one worker for its
whole deadline, so the clean batches may lose at most that worker's share of the pool: their latency may grow by a
factor of ``workers / (workers - 1)``, never by the deadline. Reported: the clean batches' latencies without and
with the poison, that bound, and the poisoned batch's own latency.

Code: ``trl_prime.rewards.verify_code`` (one sandbox per program: the bubblewrap jail with its rlimits, pids cgroup,
seccomp and wall-clock timeout per case; the run reports whether the jail was active) on simple stdin/stdout
programs with two test cases each (correct and wrong ones).

Examples::

    python benchmarks/verifiers.py                 # 1024 math answers, 64 programs
    python benchmarks/verifiers.py --quick         # 256 math answers, 24 programs
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def math_items(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` distinct (completion, gold) pairs: 50% correct (in several notations), 35% wrong, 15% no box."""
    rng = random.Random(seed)
    comps, golds, seen = [], [], set()
    while len(comps) < n:
        kind = rng.choice(["int", "frac", "dec", "expr"])
        a, b = rng.randint(2, 9999), rng.randint(2, 97)
        if kind == "int":
            gold, right, wrong = str(a), str(a), str(a + rng.randint(1, 50))
        elif kind == "frac":
            gold, right, wrong = f"{a}/{b}", f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{a + 1}}}{{{b}}}"
        elif kind == "dec":
            gold, right, wrong = f"{a / 4:g}", f"\\frac{{{a}}}{{4}}", f"{a / 4 + 0.5:g}"
        else:
            gold, right, wrong = f"{a}x + {b}", f"{b} + {a}x", f"{a}x - {b}"
        r = rng.random()
        if r < 0.5:
            tail = f"So the answer is \\boxed{{{right}}}."
        elif r < 0.85:
            tail = f"Therefore the final answer is \\boxed{{{wrong}}}."
        else:
            tail = f"I think it is {right} but I am not sure."
        text = f"We compute step by step.\n\nFirst, {a} and {b} give an intermediate value.\n\n{tail}"
        if (text, gold) in seen:
            continue
        seen.add((text, gold))
        comps.append(text)
        golds.append(gold)
    return comps, golds


def code_items(n: int, seed: int = 0) -> tuple[list[str], list[dict]]:
    """``n`` simple programs (75% correct) with two stdin/stdout test cases each."""
    rng = random.Random(seed)
    comps, tests = [], []
    for i in range(n):
        k = rng.randint(2, 9)
        correct = rng.random() < 0.75
        body = f"n = int(input())\nprint(n * {k if correct else k + 1})"
        if i % 2:
            body = f"import sys\nvals = [int(x) for x in sys.stdin.read().split()]\nprint(sum(vals[:1]) * {k if correct else k + 1})"
        comps.append(f"Here is my solution.\n\n```python\n{body}\n```")
        x, y = rng.randint(1, 1000), rng.randint(1, 1000)
        tests.append(
            {
                "stdin_stdout": [
                    {"input": f"{x}\n", "output": f"{x * k}\n"},
                    {"input": f"{y}\n", "output": f"{y * k}\n"},
                ]
            }
        )
    return comps, tests


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its reaped children (the verifier workers / sandboxes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def bench_math(n: int, batch: int, timeout: float) -> dict:
    from trl_prime.rewards.math_verifier import shutdown_math_workers, start_math_workers, verify_math

    comps, golds = math_items(n + batch, seed=1)
    shutdown_math_workers()
    t0 = time.perf_counter()
    first = verify_math(comps[:batch], golds[:batch], timeout=timeout)  # includes starting the pool
    cold = time.perf_counter() - t0
    comps, golds = comps[batch:], golds[batch:]
    del first  # the cold batch only starts the pool: its answers are not in the rate nor in the reason counts
    reasons: Counter = Counter()
    per_batch = []
    shutdown_math_workers()  # reap the pool: its CPU time is then counted in os.times() children
    c0 = _cpu_seconds()
    start_math_workers()
    shutdown_math_workers()
    startup_cpu = _cpu_seconds() - c0  # CPU cost of starting the pool (imports), not of verifying
    workers = start_math_workers()
    c0 = _cpu_seconds()
    t0 = time.perf_counter()
    for s in range(0, n, batch):
        tb = time.perf_counter()
        res = verify_math(comps[s : s + batch], golds[s : s + batch], timeout=timeout)
        per_batch.append(len(res) / (time.perf_counter() - tb))
        reasons.update(r.reason for r in res)
    total = time.perf_counter() - t0
    shutdown_math_workers()
    cpu = max(_cpu_seconds() - c0 - startup_cpu, 1e-9)  # the pool's start-up cost measured above is excluded
    return {
        "answers": n,
        "seconds": total,
        "answers_per_s": n / total,
        "batch": batch,
        "workers": workers,
        "cpu_seconds": cpu,
        "answers_per_cpu_s": n / cpu,
        "pool_startup_cpu_s": startup_cpu,
        "median_batch_answers_per_s": statistics.median(per_batch),
        "cold_first_batch_s": cold,
        "timeout_s": timeout,
        "reasons": dict(reasons),
    }


POISON = "So the result is $\\boxed{9^{9^{9^{9}}}}$."  # math-verify runs into any deadline on it


def _thread_round(batches: list[tuple[list[str], list[str]]], timeout: float, poisoned: bool) -> list[float]:
    """Verify each batch in its own thread, all at once (a poisoned first batch 0.3 s ahead, so that its tower is
    on a worker); each batch's latency in seconds (the poisoned one first)."""
    import threading

    from trl_prime.rewards.math_verifier import verify_math

    took: dict[int, float] = {}

    def call(i: int) -> None:
        t0 = time.perf_counter()
        verify_math(*batches[i], timeout=timeout)
        took[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(batches))]
    threads[0].start()
    if poisoned:
        time.sleep(0.3)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    return [took[i] for i in range(len(batches))]


def bench_math_threads(threads: int, per_thread: int, timeout: float, rounds: int = 3) -> dict:
    """``rounds`` clean rounds and ``rounds`` poisoned ones (fresh answers each); medians over the rounds of each
    round's median and slowest clean batch."""
    from trl_prime.rewards.math_verifier import shutdown_math_workers, start_math_workers

    comps, golds = math_items((2 * rounds * (threads + 1) + 4) * per_thread, seed=3)
    batches = [(comps[i : i + per_thread], golds[i : i + per_thread]) for i in range(0, len(comps), per_thread)]
    workers = start_math_workers()
    _thread_round(batches[-4:], timeout, False)  # warm-up (each worker's first answers)
    clean, mixed, poisoned = [], [], []
    for r in range(rounds):
        chunk = batches[2 * r * (threads + 1) : 2 * (r + 1) * (threads + 1)]
        clean.append(_thread_round(chunk[:threads], timeout, False))
        poison = (chunk[threads][0] + [POISON], chunk[threads][1] + ["1"])
        took = _thread_round([poison, *chunk[threads + 1 : 2 * threads + 1]], timeout, True)
        poisoned.append(took[0])
        mixed.append(took[1:])
    shutdown_math_workers()
    med = statistics.median
    clean_max, mixed_max = med(max(x) for x in clean), med(max(x) for x in mixed)
    bound = clean_max * workers / max(workers - 1, 1)
    return {
        "threads": threads,
        "answers_per_batch": per_thread,
        "rounds": rounds,
        "workers": workers,
        "poison_timeout_s": timeout,
        "clean_only_median_s": med(med(x) for x in clean),
        "clean_only_max_s": clean_max,
        "with_poison_clean_median_s": med(med(x) for x in mixed),
        "with_poison_clean_max_s": mixed_max,
        "one_worker_share_bound_s": bound,
        "within_bound": mixed_max <= bound,
        "poisoned_batch_s": med(poisoned),
    }


def bench_code(n: int, timeout: float) -> dict:
    from trl_prime.rewards.code_verifier import verify_code

    comps, tests = code_items(n, seed=2)
    verify_code(comps[:2], tests[:2], timeout=timeout)  # warm-up (sandbox probes)
    c0 = _cpu_seconds()
    t0 = time.perf_counter()
    res = verify_code(comps, tests, timeout=timeout)
    total = time.perf_counter() - t0
    cpu = _cpu_seconds() - c0
    reasons = Counter(r.reason for r in res)
    jail = all("jail" in r.layers for r in res if r.layers)
    expected_correct = sum(1 for c in comps if "print(n * " in c or "vals[:1]" in c)
    return {
        "programs": n,
        "test_cases": 2 * n,
        "seconds": total,
        "programs_per_s": n / total,
        "cpu_seconds": cpu,
        "programs_per_cpu_s": n / cpu,
        "timeout_s": timeout,
        "reasons": dict(reasons),
        "programs_seen": expected_correct,
        "jail": jail,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--math-answers", type=int, default=1024)
    p.add_argument("--math-batch", type=int, default=64, help="completions per verify call (a training step)")
    p.add_argument("--math-timeout", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=8, help="threads calling verify_math at once (0: skip)")
    p.add_argument("--thread-batch", type=int, default=16, help="distinct answers per thread's batch")
    p.add_argument("--poison-timeout", type=float, default=4.0, help="the poisoned round's deadline per answer")
    p.add_argument("--thread-rounds", type=int, default=3, help="clean and poisoned rounds each (medians reported)")
    p.add_argument("--code-programs", type=int, default=64)
    p.add_argument("--code-timeout", type=float, default=5.0, help="wall-clock seconds per test case")
    p.add_argument(
        "--quick", action="store_true", help="256 answers, 24 programs (overrides --math-answers and --code-programs)"
    )
    p.add_argument("--json", default=None)
    opts = p.parse_args(argv)
    if opts.quick:
        opts.math_answers, opts.code_programs = 256, 24
    for name in ("math_answers", "math_batch", "code_programs"):
        if getattr(opts, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.threads < 0 or opts.thread_batch < 1 or opts.thread_rounds < 1:
        p.error("--threads must be >= 0, --thread-batch and --thread-rounds >= 1")
    for name in ("math_timeout", "code_timeout", "poison_timeout"):
        if not getattr(opts, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(opts, name)}")
    out = {"machine": _common.machine(), "options": vars(opts)}
    m = bench_math(opts.math_answers, opts.math_batch, opts.math_timeout)
    out["math"] = m
    print(
        f"math: {m['answers']} answers in {m['seconds']:.2f} s = {m['answers_per_s']:.0f} answers/s "
        f"(median batch {m['median_batch_answers_per_s']:.0f}/s; {m['workers']} workers; timeout {m['timeout_s']:g} s; "
        f"first batch with pool start {m['cold_first_batch_s']:.2f} s) reasons {m['reasons']}",
        flush=True,
    )
    print(
        f"math: {m['cpu_seconds']:.2f} CPU s = {m['answers_per_cpu_s']:.0f} answers per CPU second "
        f"(x{os.cpu_count()} cores = {m['answers_per_cpu_s'] * os.cpu_count():.0f} answers/s on an idle machine)"
    )
    if opts.threads:
        t = out["math_threads"] = bench_math_threads(
            opts.threads, opts.thread_batch, opts.poison_timeout, opts.thread_rounds
        )
        print(
            f"math threads: {t['threads']} threads x {t['answers_per_batch']} answers on {t['workers']} workers: clean "
            f"batches {t['clean_only_median_s']:.2f} s median / {t['clean_only_max_s']:.2f} s max alone, "
            f"{t['with_poison_clean_median_s']:.2f} / {t['with_poison_clean_max_s']:.2f} s next to a poisoned batch "
            f"(one worker's share bound {t['one_worker_share_bound_s']:.2f} s: "
            f"{'within' if t['within_bound'] else 'EXCEEDED'}); the poisoned batch {t['poisoned_batch_s']:.2f} s "
            f"(deadline {t['poison_timeout_s']:g} s); medians of {t['rounds']} rounds",
            flush=True,
        )
    c = bench_code(opts.code_programs, opts.code_timeout)
    out["code"] = c
    print(
        f"code: {c['programs']} programs ({c['test_cases']} test cases) in {c['seconds']:.2f} s = "
        f"{c['programs_per_s']:.1f} programs/s (timeout {c['timeout_s']:g} s per case; jail "
        f"{'on' if c['jail'] else 'OFF'}) reasons {c['reasons']}"
    )
    print(
        f"code: {c['cpu_seconds']:.2f} CPU s = {c['programs_per_cpu_s']:.1f} programs per CPU second "
        f"(x{os.cpu_count()} cores = {c['programs_per_cpu_s'] * os.cpu_count():.1f} programs/s on an idle machine)"
    )
    _common.dump(out, opts.json)
    return out


if __name__ == "__main__":
    main()
