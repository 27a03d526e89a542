"""The code verifier's jail (issue 28): the program sees nothing of ours, runs as a non-root uid, and the fallback
where the jail cannot start says loudly which guarantees it loses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
from helpers import ROOT as REPO

from trl_prime.rewards import sandbox as sbx
from trl_prime.rewards.code_verifier import verify_code
from trl_prime.rewards.sandbox import SandboxConfig, run_program, sandbox_layers


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

JAIL_HERE = sys.platform == "linux" and "jail" in sandbox_layers()
needs_jail = pytest.mark.skipif(not JAIL_HERE, reason="bubblewrap cannot start on this machine")

# The reward hack of issue 28: walk the usual folders for the .jsonl line that holds this program's stdin and
# print that test's expected output.
HACK = r"""
import json, os, sys
stdin = sys.stdin.read()
starts = {os.getcwd(), os.path.expanduser('~'), '/work', '/home', '/root', '/tmp', '/data', '/srv', '/opt'}
p = os.path.realpath(sys.prefix)
while p != '/':
    starts.add(p)
    p = os.path.dirname(p)
for start in sorted(starts):
    for root, dirs, files in os.walk(start):
        if root.count('/') - start.count('/') > 3:
            dirs[:] = []
        for f in files:
            if not f.endswith('.jsonl'):
                continue
            try:
                lines = open(os.path.join(root, f)).read().splitlines()
            except (OSError, ValueError):
                continue
            for line in lines:
                try:
                    cases = json.loads(json.loads(line)['tests'])['stdin_stdout']
                except Exception:
                    continue
                for case in cases:
                    if case['input'] == stdin:
                        print(case['output'])
                        sys.exit(0)
print('not found')
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """PROJECT/.venv (the interpreter the trainer runs) + PROJECT/data/train.jsonl (the training set)."""
    root = tmp_path_factory.mktemp("project")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(root / ".venv")], check=True
    )
    (root / "data").mkdir()
    rows = [
        {"prompt": "echo the secret", "tests": json.dumps({"stdin_stdout": [{"input": "q-7781", "output": "s-42"}]})}
    ]
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _hack(project, **cfg):
    tests = {"stdin_stdout": [{"input": "q-7781", "output": "s-42"}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return verify_code([HACK], [tests], python_executable=str(project / ".venv" / "bin" / "python"), **cfg)[0]


@needs_jail
def test_reward_hack_on_data_beside_the_code_scores_zero(project):
    r = _hack(project)
    assert "jail" in r.layers and "fs_minimal" in r.layers
    assert (r.reward, r.reason) == (0.0, "failed"), r
    assert r.stdout[0].strip() == "not found"


def test_the_hack_test_can_fail_without_the_jail(project):
    """The same hack in the fallback (as the sandbox stood before issue 28, less its Landlock read rule): it scores
    1.0 -- the first guarantee the fallback's warning names as lost; ``require=("jail",)`` refuses to run it."""
    r = _hack(project, disable=("jail",))
    assert "fs_minimal" not in r.layers
    assert (r.reward, r.reason) == (1.0, "passed"), r
    r = _hack(project, disable=("jail",), require=("jail",))
    assert (r.reward, r.reason) == (None, "sandbox_error") and "required sandbox layers" in r.detail, r


WHO = r"""
import json, os
out = {"uid": os.getuid(), "gid": os.getgid(), "root": sorted(os.listdir("/")), "shadow": os.path.exists("/etc/shadow")}
try:
    os.setuid(0)
    out["setuid0"] = "succeeded"
except OSError as e:
    out["setuid0"] = type(e).__name__
out["repo"] = sorted(os.listdir(REPO)) if os.path.isdir(REPO) else None
out["caps"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
print(json.dumps(out))
"""


@needs_jail
def test_the_program_is_not_root_and_sees_only_the_interpreter():
    run = run_program(WHO.replace("REPO", repr(REPO)), mode="stdin", inputs=[""])
    assert run.ok and run.cases[0].status == "ok", run
    out = json.loads(run.cases[0].stdout)
    assert (out["uid"], out["gid"], out["shadow"], out["caps"]) == (65534, 65534, False, "0000000000000000")
    assert out["setuid0"] in ("PermissionError", "OSError")  # EPERM, or EINVAL: uid 0 does not exist in the jail
    assert {"uid_drop", "caps_dropped", "netns", "pidns", "fs_minimal", "fs_readonly"} <= set(run.layers)
    # the top level: system directories, /proc, /dev, the work dir and the parents of the interpreter's prefixes
    assert {"usr", "proc", "dev", "tmp"} <= set(out["root"]) and not {"home", "run", "var", "srv"} & set(out["root"])
    # the repository is visible only as the path to its .venv (when the interpreter lives there): no source, no data
    if sys.prefix.startswith(REPO + "/"):
        assert out["repo"] == [os.path.relpath(sys.prefix, REPO).split("/")[0]]
    else:
        assert out["repo"] is None


def test_fallback_warns_loudly_naming_the_lost_guarantees(monkeypatch, caplog):
    monkeypatch.setattr(sbx, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="THE JAIL IS NOT RUNNING") as caught:
        run = run_program("print(1)", mode="stdin", inputs=[""], config=SandboxConfig(disable=("jail", "landlock")))
    assert run.ok and run.cases[0].stdout == "1\n" and "jail" not in run.layers
    message = str(caught[0].message)
    assert "file reads (training data beside the code" in message and "disabled" in message
    assert any("THE JAIL IS NOT RUNNING" in r.getMessage() for r in caplog.records)  # on the log too


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback's capability and uid drop apply to a root caller")
def test_fallback_run_by_root_keeps_no_capability(tmp_path):
    """Without the jail, a root caller's program keeps no capability (no mount, module, ptrace, raw I/O), runs as
    uid/gid 65534 where that user can read the interpreter (else uid 0 is named lost in the warning), and is the
    OOM killer's first choice."""
    victim = tmp_path / "victim"
    victim.write_text("data")
    os.chmod(victim, 0o600)
    probe = (
        WHO.replace("REPO", repr(REPO))
        + f"""
try:
    os.chown({str(victim)!r}, 1234, 1234)
    print("chown succeeded")
except OSError as e:
    print("chown", type(e).__name__)
print("oom", open("/proc/self/oom_score_adj").read().strip())
"""
    )
    sbx._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        run = run_program(probe, mode="stdin", inputs=[""], config=SandboxConfig(disable=("jail",)))
    assert run.ok and run.cases[0].status == "ok", run
    lines = run.cases[0].stdout.splitlines()
    out = json.loads(lines[0])
    assert out["caps"] == "0000000000000000" and lines[1:] == ["chown PermissionError", "oom 1000"]
    assert "caps_dropped" in run.layers and "jail" not in run.layers and victim.stat().st_uid == 0
    message = " ".join(str(w.message) for w in caught)
    assert "THE JAIL IS NOT RUNNING" in message and "no capabilities" not in message
    if sbx._readable_by_others([sys.executable, *sys.path, tempfile.gettempdir()]):
        assert (out["uid"], out["gid"], out["setuid0"]) == (
            65534,
            65534,
            "PermissionError",
        ) and "uid_drop" in run.layers
    else:  # nobody could not read the interpreter: the program stays uid 0 (without capabilities), named lost
        assert out["uid"] == 0 and "uid_drop" not in run.layers and "non-root uid" in message
    # switched off, the capabilities are back (the layer is what makes the difference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cfg = SandboxConfig(disable=("jail", "caps_dropped", "uid_drop"))
        run = run_program(WHO.replace("REPO", repr(REPO)), mode="stdin", inputs=[""], config=cfg)
    assert json.loads(run.cases[0].stdout)["caps"] != "0000000000000000" and "caps_dropped" not in run.layers


def test_require_jail_refuses_where_bwrap_cannot_start(tmp_path):
    """A bwrap that cannot start: the run falls back (warning), or, with require=("jail",), runs nothing and is an
    infrastructure failure naming why."""
    marker = tmp_path / "ran"
    cfg = SandboxConfig(bwrap=str(tmp_path / "no-bwrap"), require=("jail",))
    run = run_program(f"open({str(marker)!r}, 'w').write('x')", mode="stdin", inputs=[""], config=cfg)
    assert not run.ok and "required sandbox layers unavailable: ['jail']" in run.error, run.error
    assert "jail unavailable" in run.error and not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run = run_program("print(2)", mode="stdin", inputs=[""], config=SandboxConfig(bwrap=str(tmp_path / "x")))
    assert run.ok and run.cases[0].stdout == "2\n" and "jail" not in run.layers


def test_an_installed_trl_prime_is_hidden_in_the_jail(monkeypatch):
    """Installed into the interpreter's prefix (not editable), trl_prime's own folder is covered by an empty tmpfs."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(sbx.__file__)))
    monkeypatch.setattr(sbx, "_interpreter_paths", lambda python: [os.path.dirname(package)])
    argv = sbx._jail_argv("bwrap", sys.executable, SandboxConfig())
    i = argv.index("--tmpfs", argv.index("--ro-bind", argv.index("--ro-bind-try")))
    assert argv[i : i + 4] == ["--tmpfs", package, "--remount-ro", package]
    monkeypatch.setattr(sbx, "_interpreter_paths", lambda python: ["/opt/elsewhere"])
    assert package not in sbx._jail_argv("bwrap", sys.executable, SandboxConfig())


# A cold hostile probe (2026-12-04) found these; each test fails on the code before its fix.

KERNEL_KNOBS = r"""
import os
for p in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches",
          "/proc/self/oom_score_adj"):
    try:
        os.close(os.open(p, os.O_WRONLY))  # opened for writing only: nothing is written, whatever happens
        print(p, "writable")
    except OSError as e:
        print(p, e.strerror)
print("oom", open("/proc/self/oom_score_adj").read().strip())
"""


@needs_jail
def test_the_jail_cannot_write_kernel_settings():
    """Run by root, the jail's uid 65534 is uid 0 on the host, and the kernel lets host uid 0 write /proc/sys without
    a capability: kernel.core_pattern = "|cmd" then runs cmd as root outside the jail at the next crash. /proc is
    read-only in the jail (``fs_readonly`` checks it from inside); the OOM score is set before bwrap starts."""
    run = run_program(KERNEL_KNOBS, mode="stdin", inputs=[""])
    assert run.ok and "fs_readonly" in run.layers, run
    lines = run.cases[0].stdout.splitlines()
    assert not [line for line in lines if line.endswith("writable")], lines
    assert lines[-1] == "oom 1000"


DEEP_TREE = r"""
import os
for _ in range(3000):
    os.mkdir("a")
    os.chdir("a")
print("wrong")
"""


@pytest.mark.parametrize("disable", [(), ("jail",)], ids=["jail", "fallback"])
def test_a_tree_too_deep_for_rmtree_is_still_the_programs_verdict(tmp_path, disable):
    """shutil.rmtree recurses: the work dir of a program that nests 3000 folders raised RecursionError in the harness
    (the run became ``sandbox_error``, reward None instead of 0) and, in the fallback, out of ``run_program`` itself."""
    if not disable and not JAIL_HERE:
        pytest.skip("bubblewrap cannot start on this machine")
    cfg = SandboxConfig(disable=disable, tmp_root=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run = run_program(DEEP_TREE, mode="stdin", inputs=["", ""], config=cfg)
        r = verify_code(
            [f"```python\n{DEEP_TREE}\n```"],
            [{"stdin_stdout": [{"input": "", "output": "right"}]}],
            disable=disable,
            tmp_root=str(tmp_path),
        )[0]
    assert run.ok, run.error
    assert [c.status for c in run.cases] == ["ok", "ok"] and run.cases[1].stdout == "wrong\n"
    assert (r.reward, r.reason) == (0.0, "failed"), r
    assert os.listdir(tmp_path) == []  # the fallback's run dirs are gone


STOP = "def f(x):\n    raise StopIteration\n"


@pytest.mark.parametrize(
    "check",
    [
        "def check(candidate):\n    for got, want in zip(map(candidate, [1, 2, 3]), [2, 4, 6]):\n        assert got == want\n",
        "def check(candidate):\n    assert all(map(lambda p: candidate(p[0]) == p[1], [(1, 2), (2, 4)]))\n",
    ],
    ids=["zip-map", "all-map"],
)
def test_a_programs_stopiteration_does_not_end_the_checks_loop(check):
    """A program raising StopIteration was re-raised as such in the judge, where it ends ``map``/``zip`` early: the
    check passed. It is a RuntimeError there now, which fails the check."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        run = run_program(STOP, mode="check", check=check, entry_point="f")
    assert run.ok, run.error
    assert not run.cases[0].verified and run.cases[0].status == "runtime_error", run.cases[0]
    assert "StopIteration" in run.cases[0].detail


def test_output_caps_tell_only_the_order_of_magnitude_of_the_expected_output():
    from trl_prime.rewards.code_verifier import _output_cap

    cfg = SandboxConfig()
    assert _output_cap(cfg, 10) == cfg.output_limit == 256 << 10
    assert _output_cap(cfg, 140_000) == _output_cap(cfg, 200_000) == 1 << 19  # 281,024 and 401,024 bytes needed
    assert _output_cap(cfg, 300_000) == 1 << 20
    for n in (130_000, 300_000, 5_000_000):
        assert _output_cap(cfg, n) >= 2 * n + 1024


# A second hostile round (same day) found these.

DEVICES_AND_IPC = r"""
import ctypes, os, stat
libc = ctypes.CDLL(None, use_errno=True)
p = "/dev/null"
try:
    os.chmod(p, stat.S_IMODE(os.stat(p).st_mode))  # its own mode: changes nothing but the host node's ctime
    print("chmod /dev/null allowed")
except OSError as e:
    print("chmod /dev/null", e.strerror)
try:
    open("/dev/x", "w").close()
    print("/dev/x created")
except OSError as e:
    print("/dev/x", e.strerror)
st = os.stat(p)
try:
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # its own times
    print("utime /dev/null allowed")
except OSError as e:
    print("utime /dev/null", e.strerror)
for name, call in (("shmget", lambda: libc.shmget(0, 1 << 20, 0o1600)), ("msgget", lambda: libc.msgget(0, 0o1600)),
                   ("inotify_init1", lambda: libc.inotify_init1(0))):
    r = call()
    print(name, "allowed" if r >= 0 else os.strerror(ctypes.get_errno()))
"""


@needs_jail
def test_the_jail_cannot_change_device_nodes_or_hold_memory_outside_its_limits():
    """bwrap binds the host's device nodes into /dev, owned by host uid 0 = the root-run jail's uid: chmod 0 of
    /dev/null would break it on the host. /dev is a tmpfs outside the disk quota, and SysV shared memory and message
    queues outlive the processes that made them: memory no limit counts. inotify instances count against host root's
    quota. /dev is read-only now (checked from inside: ``fs_readonly``); seccomp denies chmod, chown and xattrs (the
    device nodes themselves cannot be remounted read-only: bwrap would make them nodev), SysV IPC and inotify."""
    run = run_program(DEVICES_AND_IPC, mode="stdin", inputs=[""])
    assert run.ok and "fs_readonly" in run.layers and "seccomp" in run.layers, run
    assert run.cases[0].stdout.splitlines() == [
        "chmod /dev/null Operation not permitted",
        "/dev/x Read-only file system",
        "utime /dev/null Operation not permitted",
        "shmget Operation not permitted",
        "msgget Operation not permitted",
        "inotify_init1 Operation not permitted",
    ]


LOCK_WORK_DIR = 'import os\nos.chmod(".", 0)\nprint("wrong")\n'


@pytest.mark.parametrize("disable", [("seccomp",), ("jail", "seccomp")], ids=["jail", "fallback"])
def test_a_program_locking_its_work_dir_gets_its_own_verdict(tmp_path, disable):
    """``chmod(".", 0)`` made the next case's set-up fail (``sandbox_error``: reward None on demand, for a program
    that expects to fail). seccomp denies chmod now; where it is missing, the harness restores the work dir's mode
    between cases."""
    if "jail" not in disable and not JAIL_HERE:
        pytest.skip("bubblewrap cannot start on this machine")
    tests = {"stdin_stdout": [{"input": "", "output": "right"}] * 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = verify_code([LOCK_WORK_DIR], [tests], disable=disable, tmp_root=str(tmp_path))[0]
    assert (r.reward, r.reason, r.stdout) == (0.0, "failed", ("wrong\n", "wrong\n")), r


SURVIVORS = r"""
import os, time
def spin():  # leaves the case's process group, then takes every process slot that frees up
    os.setsid()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            if os.fork() == 0:
                spin()
        except OSError:
            time.sleep(0.005)
    os._exit(0)
if os.fork() == 0:
    spin()
time.sleep(0.3)
print("wrong")
"""


@pytest.mark.parametrize("disable", [(), ("jail",)], ids=["jail", "fallback"])
def test_processes_that_left_the_case_do_not_fail_the_next_case(tmp_path, disable):
    """In the fallback, ``setsid`` children outlived their case (only the case's process group was killed) and kept
    the pids cgroup full: the next case's fork failed, ``sandbox_error``. Every other member of the cgroup is killed
    between cases now (in the jail, every process of its pid namespace already was)."""
    cfg = SandboxConfig(disable=disable, tmp_root=str(tmp_path), max_processes=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if "cgroup_pids" not in sandbox_layers(cfg) or not (disable or JAIL_HERE):
            pytest.skip("no pids cgroup (or no jail) here: nothing would bound these processes")
        run = run_program(SURVIVORS, mode="stdin", inputs=["", ""], config=cfg)
    assert run.ok, run.error
    assert [(c.status, c.stdout) for c in run.cases] == [("ok", "wrong\n")] * 2
    assert run.process_limit_hit


def test_clearing_the_work_dir_is_bounded_and_finishes_what_python_cannot(tmp_path, monkeypatch):
    """Clearing runs in a child killed after its ``seconds`` (what is left only costs the program disk); given time,
    coreutils removes what shutil.rmtree cannot (a tree thousands of folders deep)."""
    work = tmp_path / "work"
    work.mkdir()
    build = "import os\nfor _ in range(1500):\n    os.mkdir('a')\n    os.chdir('a')\n"
    subprocess.run([sys.executable, "-c", build], cwd=work, check=True)
    (work / "f").write_text("x")
    forked, fork = [], os.fork
    monkeypatch.setattr(os, "fork", lambda: forked.append(fork()) or forked[-1])
    sbx._clear_dir(str(work), False, 0.0)  # killed at once: returns, leaves no child behind
    assert len(forked) == 1 and forked[0] > 0
    with pytest.raises(ChildProcessError):  # reaped already
        os.waitpid(forked[0], os.WNOHANG)
    monkeypatch.undo()
    sbx._clear_dir(str(work), False, 60.0)
    assert os.listdir(work) == []


# A third hostile round (same day) found these.

SUPERSCRIPT_ERRNO = 'raise type("X\\n\\u00b2\\n", (Exception,), {})()\n'


@pytest.mark.parametrize("disable", [(), ("jail",)], ids=["jail", "fallback"])
def test_a_program_cannot_make_its_failure_unreadable(tmp_path, disable):
    """The harness read the errno line of a program's failure with ``isdigit()``, which ``"²"`` passes and ``int``
    refuses: an exception class named ``"X\\n²\\n"`` made the harness fail, ``sandbox_error`` (reward None) on
    demand. The name is one line now and the errno is read as ASCII."""
    if not disable and not JAIL_HERE:
        pytest.skip("bubblewrap cannot start on this machine")
    kw = dict(disable=disable, tmp_root=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = verify_code([SUPERSCRIPT_ERRNO], [{"stdin_stdout": [{"input": "", "output": "right"}]}], **kw)[0]
        run = run_program(
            SUPERSCRIPT_ERRNO, mode="check", check=CHECK_TWICE, entry_point="f", config=SandboxConfig(**kw)
        )
    assert (r.reward, r.reason) == (0.0, "runtime_error"), r
    assert run.ok and run.cases[0].status == "runtime_error" and not run.cases[0].verified, run


CHECK_TWICE = "def check(candidate):\n    assert candidate(candidate(1)) == 3\n"
DEEP_RETURN = """
def f(x):
    v = 1
    for _ in range(DEPTH):
        v = [v]
    return v
"""


@pytest.mark.parametrize("depth", [300, 400])
def test_a_deep_return_value_is_the_programs_bad_value_not_the_checks(depth):
    """The judge accepted a return value 400 levels deep but could not send it back as an argument (one level more):
    ``candidate(candidate(1))`` became ``UnsupportedArgument``, ``sandbox_error``. Values deeper than half the wire's
    limit are the program's ``bad_value`` now."""
    run = run_program(DEEP_RETURN.replace("DEPTH", str(depth)), mode="check", check=CHECK_TWICE, entry_point="f")
    assert run.ok, run.error
    assert run.cases[0].status == "bad_value" and not run.cases[0].verified, run.cases[0]


SHM_NOTE = """
import os
print(os.path.exists("/dev/shm/note"))
open("/dev/shm/note", "w").write("case state")
"""


@needs_jail
def test_dev_shm_is_cleared_between_cases():
    """The jail's /dev/shm (its own tmpfs) kept what one case wrote for the next; it is cleared like the work dir."""
    run = run_program(SHM_NOTE, mode="stdin", inputs=["", ""])
    assert run.ok and [c.stdout for c in run.cases] == ["False\n", "False\n"], run
