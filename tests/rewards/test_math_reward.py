"""Tests of the math outcome verifier (docs/guides/verifiers.md; issue 2, section 3): every case asserts score AND reason."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest

from trl_prime.rewards import math_verifier as mv


TOWER = "So the result is $\\boxed{9^{9^{9^{9}}}}$."


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _fresh_int() -> int:  # answers never seen before, so the memo cannot answer for the workers
    return random.randrange(10**8, 10**9)


def _check(result, reward, reason):
    assert (result.reward, result.reason) == (reward, reason), result


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    assert mv.start_math_workers() >= 1  # the deadline tests measure warm calls
    yield


# ------------------------------------------------------------------------------------------------ verdicts


CORRECT = [
    ("\\boxed{42}", "42"),  # integer
    ("The answer is \\boxed{0.5}.", "\\frac{1}{2}"),  # decimal vs fraction
    ("so $\\boxed{\\frac{1}{2}}$", "0.5"),  # latex fraction vs decimal gold
    ("\\boxed{\\dfrac{3}{4}}", "$0.75$"),  # gold wrapped in $
    ("\\boxed{x^{2}}", "$x^2$"),  # expression
    ("\\boxed{[0, 1)}", "[0,1)"),  # interval
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]"),  # unbounded interval
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),  # set, order-free
    ("\\fbox{7}", "7"),  # \fbox
    ("\\boxed{\\frac{1}{\\sqrt{4}}}", "\\frac12"),  # nested braces
    ("\\boxed{1,000}", "1000"),  # thousands separator
    ("3 + 15 = 18 so \\boxed{18}", "Natalia sold 48/2 = 24 clips.\n#### 18"),  # GSM8K gold
    ("\\boxed{\\sqrt{2}}", "Thus the side is $\\boxed{\\sqrt 2}$."),  # MATH-style gold solution
]


def test_correct_answers_in_several_forms():
    results = mv.verify_math([c for c, _ in CORRECT], [g for _, g in CORRECT])
    for (completion, gold), r in zip(CORRECT, results):
        assert (r.reward, r.reason) == (1.0, "correct"), (completion, gold, r)


def test_wrong_answers():
    results = mv.verify_math(["\\boxed{41}", "\\boxed{(0, 1)}", "\\boxed{\\frac{1}{3}}"], ["42", "[0,1)", "0.34"])
    for r in results:
        _check(r, 0.0, "wrong")
    assert results[0].extracted == "41" and results[0].parsed == "41"


def test_no_box_gets_no_credit_for_numbers_in_text():
    completions = [
        "The answer is 42.",  # right number, no box
        "We get $42$",  # right number in math mode, no box
        "\\boxed{}",  # empty box
        "first \\boxed{42} then \\boxed{4",  # last box never closed (truncated): no final answer
        "",
        None,
    ]
    for r in mv.verify_math(completions, ["42"] * len(completions)):
        _check(r, 0.0, "no_answer")
        assert r.extracted is None


def test_answer_phrase_is_opt_in():
    completions = ["The final answer is $42$.", "Answer: 42", "I have 42 apples.", "the answer is \\boxed{41}"]
    loose = mv.verify_math(completions, ["42"] * 4, extraction="boxed_or_answer_phrase")
    _check(loose[0], 1.0, "correct")
    _check(loose[1], 1.0, "correct")
    _check(loose[2], 0.0, "no_answer")
    _check(loose[3], 0.0, "wrong")  # a box always wins over the phrase
    for r in mv.verify_math(completions[:3], ["42"] * 3):  # default: boxes only
        _check(r, 0.0, "no_answer")


def test_last_box_wins():
    r1, r2 = mv.verify_math(
        ["First \\boxed{41}, on reflection \\boxed{42}.", "First \\boxed{42}, on reflection \\boxed{41}."],
        ["42", "42"],
    )
    _check(r1, 1.0, "correct")
    _check(r2, 0.0, "wrong")
    assert r2.extracted == "41"


def test_extract_answer():
    assert mv.extract_answer("a \\boxed{\\frac{a}{b^{2}}} b") == "\\frac{a}{b^{2}}"
    assert mv.extract_answer("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"  # escaped braces do not close the box
    assert mv.extract_answer("\\boxed{\\boxed{3}}") == "\\boxed{3}"  # outermost of the last top-level box
    assert mv.extract_answer("\\boxed {5} and \\fbox{6}") == "6"
    assert mv.extract_answer("$\\boxed{$7$}$") == "7"
    assert mv.extract_answer("no box 42") is None
    with pytest.raises(ValueError, match="extraction"):
        mv.extract_answer("x", extraction="last_number")


def test_conversational_completion():
    completions = [
        [{"role": "assistant", "content": "Adding up, the total is $\\boxed{7}$."}],
        [
            {"role": "assistant", "content": "\\boxed{7}"},
            {"role": "tool", "content": "\\boxed{8}"},
            {"role": "assistant", "content": [{"type": "text", "text": "Final: \\boxed{9}"}]},
        ],
        [{"role": "assistant", "content": "The total is 7."}],
    ]
    assert mv.math_reward(completions, solution=["7", "7", "7"]) == [1.0, 0.0, 0.0]
    assert [r.reason for r in mv.math_reward.last_results] == ["correct", "wrong", "no_answer"]


def test_unparseable_gold_is_skipped_not_scored():
    golds = ["???", "\\frac{", "", None, "???"]
    completions = ["\\boxed{1}", "\\boxed{1}", "\\boxed{1}", "\\boxed{1}", "no answer here"]
    for r in mv.verify_math(completions, golds):
        _check(r, None, "gold_unparseable")
    rewards = mv.math_reward(completions, solution=golds)
    assert rewards == [None] * 5
    assert mv.math_reward.last_counts["gold_unparseable"] == 5


def test_repeated_pairs_are_consistent():
    n = _fresh_int()
    completions = [f"\\boxed{{{n}}}", f"\\boxed{{{n + 1}}}"] * 8
    first = mv.verify_math(completions, [str(n)] * 16)
    second = mv.verify_math(completions, [str(n)] * 16)  # served from the memo
    assert (
        [(r.reward, r.reason) for r in first]
        == [(r.reward, r.reason) for r in second]
        == [
            (1.0, "correct"),
            (0.0, "wrong"),
        ]
        * 8
    )


# ------------------------------------------------------------------------------------------------ deadlines


def _tower_batch(timeout=1.0):
    # a warm pool (workers started after the previous test's kill): the call's time is then the deadline's
    assert mv.start_math_workers() >= 1
    n = _fresh_int()
    t0 = time.monotonic()
    results = mv.verify_math([TOWER, f"\\boxed{{{n}}}"], ["1", str(n)], timeout=timeout)
    return results, time.monotonic() - t0


def test_power_tower_times_out_and_parent_memory_stays_flat():
    rss0 = _rss_kb()
    (tower, ok), elapsed = _tower_batch(timeout=1.0)
    _check(tower, 0.0, "timeout")
    _check(ok, 1.0, "correct")
    assert elapsed < 1.0 + 2.0, elapsed
    assert _rss_kb() - rss0 < 20 * 1024, "the calling process grew: the work must happen in the killed worker"


def test_timeout_holds_in_a_non_main_thread():
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", _tower_batch(timeout=1.0)))
    thread.start()
    thread.join(30)
    (tower, ok), elapsed = box["out"]
    _check(tower, 0.0, "timeout")
    _check(ok, 1.0, "correct")
    assert elapsed < 3.0, elapsed


def test_timeout_holds_inside_an_event_loop():
    async def main():
        assert asyncio.get_running_loop().is_running()
        return _tower_batch(timeout=1.0)

    (tower, ok), elapsed = asyncio.run(main())
    _check(tower, 0.0, "timeout")
    _check(ok, 1.0, "correct")
    assert elapsed < 3.0, elapsed


def test_threads_share_the_pool_and_a_poisoned_batch_holds_one_worker_only():
    """Threads call at once (issue 28: a clean batch used to wait up to 26 s behind other threads' timeouts). One
    batch holds a power tower that runs into its 6 s deadline; four clean batches started after it on the same two
    workers finish in well under that deadline (half of it), not behind it, and the poisoned batch still gets its
    timeout (and its clean answers)."""
    timeout, out = 6.0, {}

    def call(key, poisoned):
        n = [_fresh_int() for _ in range(3)]
        comps, golds = [f"\\boxed{{{x}}}" for x in n], [str(x) for x in n]
        if poisoned:
            comps, golds = [TOWER, *comps], ["1", *golds]
        t0 = time.monotonic()
        rs = mv.verify_math(comps, golds, timeout=timeout, num_workers=2)
        out[key] = ([(r.reward, r.reason) for r in rs], time.monotonic() - t0)

    poisoned = threading.Thread(target=call, args=("poisoned", True))
    poisoned.start()
    time.sleep(0.5)  # the tower is on a worker
    clean = [threading.Thread(target=call, args=(i, False)) for i in range(4)]
    for t in clean:
        t.start()
    for t in [poisoned, *clean]:
        t.join(60)
    reasons, took = out["poisoned"]
    assert reasons == [(0.0, "timeout")] + [(1.0, "correct")] * 3 and took >= timeout, out["poisoned"]
    for i in range(4):
        reasons, took = out[i]
        assert reasons == [(1.0, "correct")] * 3, out[i]
        assert took < timeout / 2, (i, took)  # served next to the poisoned call, not after it


# ------------------------------------------------------------------------------------------------ pool health


def _address_space_limits() -> list[str]:
    limits = []
    for pid in mv._worker_pids():
        try:
            with open(f"/proc/{pid}/limits") as f:
                limits += [line.split()[3] for line in f if line.startswith("Max address space")]
        except FileNotFoundError:
            pass
    return limits


def test_workers_run_under_a_memory_cap():
    n = [_fresh_int() for _ in range(8)]
    results = mv.verify_math([f"\\boxed{{{x}}}" for x in n], [str(x) for x in n], memory_limit_mb=900)
    for r in results:
        _check(r, 1.0, "correct")
    assert str(900 << 20) in _address_space_limits()
    mv.verify_math([f"\\boxed{{{x}}}" for x in n], [str(x + 1) for x in n])  # back to the default cap


def _wait_dead(pid: int) -> None:
    for _ in range(200):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] in "ZX":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def test_killed_worker_is_replaced():
    for _ in range(100):  # a worker an earlier test timed out may still be on the list while pebble replaces it
        pids = mv._worker_pids()
        assert pids
        try:
            os.kill(pids[0], signal.SIGKILL)
            break
        except ProcessLookupError:
            time.sleep(0.05)
    _wait_dead(pids[0])
    n = [_fresh_int() for _ in range(6)]
    results = mv.verify_math([f"\\boxed{{{x}}}" for x in n], [str(x) for x in n])
    for r in results:
        _check(r, 1.0, "correct")
    assert pids[0] not in mv._worker_pids()


def _cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return -1


def test_worker_crashing_twice_gives_error_not_zero():
    stop = threading.Event()
    killed: list[int] = []

    def kill_busy_workers():  # kill whichever worker is spinning on the item, twice
        first: dict[int, int] = {}  # pid -> its CPU ticks when first seen (an idle worker stays there)
        while not stop.is_set() and len(killed) < 2:
            for pid in mv._worker_pids():
                ticks = _cpu_ticks(pid)
                first.setdefault(pid, ticks)
                if pid not in killed and ticks - first[pid] >= 30:  # busy: 0.3 s of CPU since first seen
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_busy_workers)
    killer.start()
    try:
        (result,) = mv.verify_math([TOWER], ["1"], timeout=8.0)
    finally:
        stop.set()
        killer.join()
    assert len(killed) == 2
    _check(result, None, "error")
    assert "died" in result.detail and "twice" in result.detail, result.detail


def test_pool_that_cannot_start_gives_error(monkeypatch):
    mv.shutdown_math_workers()
    monkeypatch.setattr(mv, "_MATH_MODULE", "no_such_math_verify")  # the workers cannot import their judge
    n = _fresh_int()
    results = mv.verify_math([f"\\boxed{{{n}}}", "no box"], [str(n), str(n)])
    for r in results:
        _check(r, None, "error")
    assert "cannot start" in results[0].detail and "no_such_math_verify" in results[0].detail
    monkeypatch.undo()
    mv.shutdown_math_workers()
    (r,) = mv.verify_math([f"\\boxed{{{n}}}"], [str(n)])  # a later call starts a healthy pool
    _check(r, 1.0, "correct")


def test_a_forked_child_gets_its_own_pool():
    """After fork (a dataloader worker, a launcher): the child's calls start the child's own pool and forkserver;
    the parent's pool goes on serving the parent."""
    n = _fresh_int()
    _check(mv.verify_math([f"\\boxed{{{n}}}"], [str(n)])[0], 1.0, "correct")
    parent_pids = mv._worker_pids()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            rs = mv.verify_math([f"\\boxed{{{n + 1}}}", "\\boxed{3}"], [str(n + 1), "4"])
            mine = mv._worker_pids()
            os.write(w, repr([(x.reward, x.reason) for x in rs] + [bool(mine), set(mine) & set(parent_pids)]).encode())
            mv.shutdown_math_workers()
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = f.read()
    os.waitpid(pid, 0)
    assert child == repr([(1.0, "correct"), (0.0, "wrong"), True, set()]), child
    _check(mv.verify_math([f"\\boxed{{{n + 2}}}"], [str(n + 2)])[0], 1.0, "correct")
    assert set(mv._worker_pids()) & set(parent_pids)  # the parent's workers, untouched by the child


# ------------------------------------------------------------------------------------------------ TRL reward API


def test_log_metric_receives_counts():
    logged: dict[str, float] = {}
    rewards = mv.math_reward(
        prompts=["p"] * 4,
        completions=["\\boxed{3}", "\\boxed{4}", "three", "\\boxed{3}"],
        completion_ids=[[1]] * 4,
        solution=["3", "3", "3", "???"],
        trainer_state=None,
        log_extra=lambda column, values: None,
        log_metric=lambda name, value: logged.__setitem__(name, value),
    )
    assert rewards == [1.0, 0.0, 0.0, None]
    expected = {"correct": 1, "wrong": 1, "no_answer": 1, "gold_unparseable": 1, "timeout": 0, "error": 0}
    assert logged == {f"math/{k}": v for k, v in expected.items()}
    assert mv.math_reward.last_counts == expected
    assert mv.math_reward.__name__ == "math_reward"


def test_make_math_reward_custom_column():
    reward = mv.make_math_reward(answer_column="answer", timeout=2.0)
    assert reward.__name__ == "math_reward_answer"
    assert reward(completions=["\\boxed{12}", "\\boxed{13}"], answer=[12, "12"]) == [1.0, 0.0]
    assert reward.last_counts["correct"] == 1 and reward.last_counts["wrong"] == 1
    with pytest.raises(ValueError, match="'answer'.*make_math_reward"):
        reward(completions=["\\boxed{12}"], solution=["12"])


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="2 completions but 1 gold"):
        mv.verify_math(["\\boxed{1}", "\\boxed{2}"], ["1"])
    with pytest.raises(ValueError, match="'solution' has 1 values for 2 completions"):
        mv.math_reward(["\\boxed{1}", "\\boxed{2}"], solution=["1"])
    with pytest.raises(ValueError, match="column 'solution'.*answer_column"):
        mv.math_reward(["\\boxed{1}"], answer=["1"])
    with pytest.raises(ValueError, match="timeout"):
        mv.verify_math(["\\boxed{1}"], ["1"], timeout=0)
    with pytest.raises(ValueError, match="completion 0"):
        mv.verify_math([42], ["42"])


# ------------------------------------------------------------------------------------------------ review regressions


def test_numeric_golds_are_written_without_exponent():
    np = pytest.importorskip("numpy")
    assert mv._normalize_gold(1e-05) == "0.00001"
    assert mv._normalize_gold(1e16) == "10000000000000000"
    assert mv._normalize_gold(1e20) == "100000000000000000000"
    assert mv._normalize_gold(-2.5e-07) == "-0.00000025"
    assert mv._normalize_gold(12.0) == "12" and mv._normalize_gold(np.int64(7)) == "7"
    assert mv._normalize_gold(np.float64(1e-5)) == "0.00001"  # a float subclass whose repr is "np.float64(...)"
    assert mv._normalize_gold(np.float32(0.1)) == "0.1"  # the digits of its own precision
    cases = [
        ("\\boxed{0.00001}", 1e-05, 1.0, "correct"),  # was "1e-05": e read as Euler's number -> wrong
        ("\\boxed{10000000000000000}", 1e16, 1.0, "correct"),
        ("\\boxed{e+20}", 1e20, 0.0, "wrong"),  # was "1e+20" = 1*e + 20 -> correct
        ("\\boxed{100000000000000000000}", 1e20, 1.0, "correct"),
        ("\\boxed{0.00001}", np.float64(1e-5), 1.0, "correct"),
        ("\\boxed{0.1}", np.float32(0.1), 1.0, "correct"),
        ("\\boxed{12}", 12.0, 1.0, "correct"),
    ]
    results = mv.verify_math([c for c, *_ in cases], [g for _, g, *_ in cases])
    for (completion, gold, reward, reason), r in zip(cases, results):
        assert (r.reward, r.reason) == (reward, reason), (completion, gold, r)
    for r in mv.verify_math(
        ["\\boxed{5}", "\\boxed{nan}", "\\boxed{\\infty}"], [float("nan"), float("nan"), np.float64("inf")]
    ):
        _check(r, None, "gold_unparseable")
        assert "not a finite number" in r.detail
    (r,) = mv.verify_math(["\\boxed{\\infty}"], ["\\infty"])  # a string gold "\infty" is still an answer
    _check(r, 1.0, "correct")


def test_word_golds_compare_as_text_not_as_letter_products():
    word_cases = [  # plain word golds: math-verify alone reads them as products of letters (anagrams "equal")
        ("\\boxed{nabana}", "banana", 0.0, "wrong"),
        ("\\boxed{banana}", "banana", 1.0, "correct"),
        ("\\boxed{\\text{Banana}}", "banana", 1.0, "correct"),
        ("\\boxed{BANANA.}", "banana", 1.0, "correct"),
        ("\\boxed{sey}", "yes", 0.0, "wrong"),
        ("\\boxed{\\textbf{Yes}}", "yes", 1.0, "correct"),
        ("\\boxed{\\text{No solution}}", "no solution", 1.0, "correct"),
        ("\\boxed{solution no}", "no solution", 0.0, "wrong"),
        ("\\boxed{\\pi}", "pi", 1.0, "correct"),
        ("\\boxed{\\text{ }}", "banana", 0.0, "no_answer"),
    ]
    math_cases = [  # the other direction: \text golds, letters and real math keep the math-verify judge
        ("\\boxed{nabana}", "\\text{banana}", 0.0, "wrong"),
        ("\\boxed{banana}", "\\text{banana}", 1.0, "correct"),
        ("\\boxed{\\text{(C)}}", "C", 1.0, "correct"),  # multiple choice
        ("\\boxed{(C)}", "C", 1.0, "correct"),
        ("\\boxed{B}", "C", 0.0, "wrong"),
        ("\\boxed{y+x^2}", "x^2+y", 1.0, "correct"),  # symbolic
        ("\\boxed{x^2+z}", "x^2+y", 0.0, "wrong"),
        ("\\boxed{y x}", "x y", 1.0, "correct"),  # a product of variables written with a space
        ("\\boxed{\\infty}", "inf", 1.0, "correct"),  # a word math-verify reads as math
    ]
    cases = word_cases + math_cases
    results = mv.verify_math([c for c, *_ in cases], [g for _, g, *_ in cases])
    for (completion, gold, reward, reason), r in zip(cases, results):
        assert (r.reward, r.reason) == (reward, reason), (completion, gold, r)
    assert results[0].parsed == "nabana" and results[10].parsed == "a*a*a*b*n*n"  # text key vs SymPy parse


def test_pathological_gold_is_unparseable_once_and_remembered():
    assert mv.start_math_workers() >= 1
    gold = f"9^{{9^{{9^{{9}}}}}} + {_fresh_int()}"  # never seen: no cache answers for it yet
    completions = ["\\boxed{5}", "\\boxed{7}", TOWER, "no box"]
    t0 = time.monotonic()
    results = mv.verify_math(completions, [gold] * 4, timeout=1.0)
    elapsed = time.monotonic() - t0
    for r in results:  # was: a 0.0 "timeout" for every completion, each paying the deadline
        _check(r, None, "gold_unparseable")
        assert "took longer than 1s" in r.detail
    assert elapsed < 1.0 + 2.0, elapsed
    for timeout in (1.0, 0.5):  # remembered: no worker pays the deadline again (a smaller deadline fails too)
        t0 = time.monotonic()
        results = mv.verify_math(["\\boxed{8}", "\\boxed{5}"], [gold] * 2, timeout=timeout)
        assert time.monotonic() - t0 < 0.5
        for r in results:
            _check(r, None, "gold_unparseable")
            assert "remembered" in r.detail
    assert 0 < len(mv._GOLD_TIMEOUTS) <= mv._GOLD_TIMEOUT_CACHE_SIZE
    n = _fresh_int()
    ok, unparseable = mv.verify_math([f"\\boxed{{{n}}}", f"\\boxed{{{n}}}"], [str(n), gold], timeout=1.0)
    _check(ok, 1.0, "correct")  # other golds of the same batch are unaffected
    _check(unparseable, None, "gold_unparseable")


def test_last_counts_and_results_are_per_thread():
    mv.math_reward(["\\boxed{4}"], solution=["4"])  # this thread's last call
    barrier = threading.Barrier(2)
    seen: dict[str, tuple] = {}

    def job(name, completions, golds):
        mv.math_reward(completions, solution=golds)
        barrier.wait(timeout=120)  # both calls are done before either thread reads
        seen[name] = (dict(mv.math_reward.last_counts), [r.reason for r in mv.math_reward.last_results])

    threads = [
        threading.Thread(target=job, args=("a", ["\\boxed{1}"], ["1"])),
        threading.Thread(target=job, args=("b", ["\\boxed{2}", "no box", "\\boxed{2}"], ["3", "3", "???"])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert seen["a"] == ({**dict.fromkeys(mv.REASONS, 0), "correct": 1}, ["correct"])
    assert seen["b"] == (
        {**dict.fromkeys(mv.REASONS, 0), "wrong": 1, "no_answer": 1, "gold_unparseable": 1},
        ["wrong", "no_answer", "gold_unparseable"],
    )
    assert [r.reason for r in mv.math_reward.last_results] == ["correct"]  # the main thread's own last call
    assert mv.math_reward.last_counts["correct"] == 1 and mv.math_reward.last_counts["wrong"] == 0
    fresh: dict = {}
    t = threading.Thread(
        target=lambda: fresh.update(counts=dict(mv.math_reward.last_counts), results=list(mv.math_reward.last_results))
    )
    t.start()
    t.join(30)
    assert fresh == {"counts": dict.fromkeys(mv.REASONS, 0), "results": []}  # a thread that made no call


def _verify_in_child(queue) -> None:
    from trl_prime.rewards import verify_math

    queue.put(verify_math(["\\boxed{2}"], ["2"])[0].reward)


def test_a_multiprocessing_child_that_verified_math_exits():
    """A process started by ``multiprocessing`` (as the learning benchmark's seed workers are) joins its non-daemon
    children before ``atexit`` runs: the math workers must be stopped before that, or the process never exits (the
    learning benchmark hung in CI)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_verify_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=120) == 1.0
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
