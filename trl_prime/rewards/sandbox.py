"""Process sandbox for untrusted, model-written Python programs (SPEC section 5).

This module is the isolation layer under :func:`trl_prime.rewards.code_reward`. It only imports the
standard library, because the same file is also the sandbox's bootstrap: each run starts
``python -I -c <load this file's cached bytecode as __main__> sandbox.py JOB``.

Public API: :class:`SandboxConfig`, :func:`run_program` (returns :class:`SandboxRun` with one
:class:`CaseOutcome` per test case), :func:`sandbox_layers`, :data:`LAYERS`.

Process tree of one run (one program, all of its test cases)::

    caller thread (parent, trusted: decides every verdict)
      `- bootstrap        own session + process group; joins a fresh pids cgroup; unshare(net, pid[, user])
           `- init        pid 1 of the new pid namespace: when it exits the kernel kills everything inside
                `- harness   trusted; never runs candidate code; child subreaper; not dumpable
                     `- case process, one per test case: rlimits, capabilities dropped, Landlock, then the
                        candidate program runs (``exec``) with stdin/stdout redirected to files

The parent never sends expected outputs into the sandbox: the harness returns what the program printed
(stdin/stdout tests) or the JSON of what the function returned (call tests), and the parent compares.
The harness creates each case's stdin/stdout/stderr files itself, unlinks them at once and reads them back
through its own descriptors, so nothing the program does to paths can redirect the harness.
For HumanEval-style ``check(candidate)`` tests the check has to run in the candidate's process; the case
process reports completion by writing a 128-bit nonce that the parent generated and handed over through an
inherited pipe which the harness reads only *after* ``check()`` returned, so exiting early
(``sys.exit(0)``, ``os._exit(0)``) or printing any success text never counts as a pass.

Isolation layers (each run reports the ones that were active in :attr:`SandboxRun.layers`)
-------------------------------------------------------------------------------------------
``process_group``   the sandbox runs in its own session/process group; the parent kills the group.
``tmpdir``          a private temporary directory (cwd, ``HOME`` and ``TMPDIR``), deleted afterwards.
``rlimit_cpu``, ``rlimit_as``, ``rlimit_fsize``, ``rlimit_nofile``, ``rlimit_core``
                    per case process: CPU seconds, address space (memory), file size (also caps stdout),
                    open files, no core dumps.
``rlimit_nproc``    process-count rlimit; only where the kernel enforces it (the candidate's host uid is
                    not 0); a fallback for ``cgroup_pids``.
``cgroup_pids``     a fresh cgroup (v1 ``pids`` controller, or v2 when delegated) with ``pids.max``;
                    removed afterwards. Stops fork bombs; ``pids.events`` tells when the cap was hit.
``userns``          a user namespace (used when not root, so that net/pid namespaces can be created).
``netns``           an empty network namespace: no interface is up, not even loopback.
``pidns``           a pid namespace: the candidate cannot see or signal host processes, and when its
                    init exits every process inside dies, including daemons that called ``setsid``.
``subreaper``       orphans re-parent to the harness, which kills all of them after each case (the
                    fallback for ``pidns``).
``no_new_privs``    ``PR_SET_NO_NEW_PRIVS``: no set-uid escalation through ``execve``.
``caps_dropped``    the case process has empty effective/permitted/inheritable/bounding/ambient
                    capability sets.
``uid_drop``        (root only) the case process runs as ``nobody`` (65534); used when the interpreter
                    and its ``sys.path`` are readable by other users.
``landlock_fs``     Landlock: writes, creations, removals, renames, truncations only below the temp
                    directory (and writes to ``/dev/null``). Reads are not restricted.
``landlock_net``    Landlock (ABI >= 4): TCP ``bind``/``connect`` denied.
``landlock_signal`` Landlock (ABI >= 6): no signals to (and no abstract unix sockets of) processes
                    outside the sandbox, so the program cannot kill its parent or the trainer.

Layers that a machine does not offer are skipped (fall back) and named in a one-time warning;
``SandboxConfig(require=(...))`` turns a missing layer into an infrastructure failure instead.

Known limits: reads of world/owner-readable host files are not blocked (what a program prints only
reaches the verdict and the short previews in the results); UDP is only blocked by ``netns``; run as
root without ``uid_drop`` the program is uid 0 without capabilities, so ``landlock_fs`` is what keeps
it from writing root-owned files (the interpreter under a 0700 home, as here, rules ``uid_drop`` out);
a program in a HumanEval
``check`` case shares its process with the check and can subvert it deliberately (e.g. return an object
whose ``__eq__`` is always true, or read the nonce pipe) -- the nonce defends against exits and printed
text, not against an adversary that targets this harness.
"""

from __future__ import annotations

# The child side avoids json / signal / traceback: they import re and enum, which would triple the
# interpreter start-up cost of every sandbox (about 18 ms -> 65 ms here).
import _json
import _signal as signal  # the C half of `signal`: same functions and SIG* constants, no enum import
import ctypes
import errno
import io
import marshal
import os
import resource
import select
import stat
import sys
import time
import types

__all__ = [
    "LAYERS",
    "SandboxConfig",
    "CaseOutcome",
    "SandboxRun",
    "run_program",
    "sandbox_layers",
]

#: Layer name -> one-line description (see the module docstring).
LAYERS: dict[str, str] = {
    "process_group": "own session / process group, killed as a whole afterwards",
    "tmpdir": "private temporary working directory, removed afterwards",
    "rlimit_cpu": "RLIMIT_CPU per test case",
    "rlimit_as": "RLIMIT_AS (address space = memory) per process",
    "rlimit_fsize": "RLIMIT_FSIZE (file size; also caps stdout)",
    "rlimit_nofile": "RLIMIT_NOFILE",
    "rlimit_core": "RLIMIT_CORE = 0",
    "rlimit_nproc": "RLIMIT_NPROC (only where the kernel enforces it)",
    "cgroup_pids": "fresh pids cgroup with pids.max",
    "userns": "user namespace (unprivileged namespaces)",
    "netns": "empty network namespace",
    "pidns": "pid namespace; its init's exit kills every process inside",
    "subreaper": "harness is a child subreaper and kills orphans after each case",
    "no_new_privs": "PR_SET_NO_NEW_PRIVS",
    "caps_dropped": "all capability sets (incl. bounding, ambient) empty in the case process",
    "uid_drop": "case process runs as uid/gid 65534 (root only)",
    "landlock_fs": "Landlock: writes only below the temp directory",
    "landlock_net": "Landlock: TCP bind/connect denied",
    "landlock_signal": "Landlock: no signals / abstract sockets outside the sandbox",
}

# Layers that can be switched off with SandboxConfig(disable=...) (for debugging and fallback tests).
_DISABLEABLE = frozenset(
    {"cgroup_pids", "userns", "netns", "pidns", "landlock", "landlock_fs", "landlock_net",
     "landlock_signal", "caps_dropped", "uid_drop", "rlimit_nproc"}
)

_MODES = ("stdin", "fn", "check")
_NOBODY = 65534

# ----------------------------------------------------------------------------------------------
# Linux constants
# ----------------------------------------------------------------------------------------------
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4

# Landlock (same syscall numbers on every architecture that has it: unified table since 5.13).
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_LL_FS_WRITE_FILE = 1 << 1
_LL_FS_WRITE_V1 = (
    _LL_FS_WRITE_FILE
    | (1 << 4)  # REMOVE_DIR
    | (1 << 5)  # REMOVE_FILE
    | (1 << 6)  # MAKE_CHAR
    | (1 << 7)  # MAKE_DIR
    | (1 << 8)  # MAKE_REG
    | (1 << 9)  # MAKE_SOCK
    | (1 << 10)  # MAKE_FIFO
    | (1 << 11)  # MAKE_BLOCK
    | (1 << 12)  # MAKE_SYM
)
_LL_FS_REFER = 1 << 13  # ABI 2
_LL_FS_TRUNCATE = 1 << 14  # ABI 3
_LL_NET_BIND_TCP = 1 << 0  # ABI 4
_LL_NET_CONNECT_TCP = 1 << 1
_LL_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_LL_SCOPE_SIGNAL = 1 << 1

_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Exit code of a case process whose sandbox set-up failed (the verdict uses the set-up pipe, not this).
_SETUP_FAILED_RC = 125


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.prctl.restype = ctypes.c_int
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        libc.unshare.restype = ctypes.c_int
        libc.unshare.argtypes = [ctypes.c_int]
        _LIBC = libc
    return _LIBC


def _oserror(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def _prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    r = _libc().prctl(option, a2, a3, a4, a5)
    if r < 0:
        raise _oserror(f"prctl({option})")
    return r


def _unshare(flags: int) -> None:
    if _libc().unshare(flags) != 0:
        raise _oserror(f"unshare({flags:#x})")


def _syscall(nr: int, *args) -> int:
    r = _libc().syscall(ctypes.c_long(nr), *args)
    if r < 0:
        raise _oserror(f"syscall({nr})")
    return r


def _landlock_abi() -> int:
    try:
        return int(_syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION)))
    except (OSError, AttributeError):
        return 0


def _landlock_restrict(abi: int, writable_dirs, writable_files, fs: bool, net: bool, scope: bool) -> None:
    """Apply one Landlock domain to the calling process (irrevocable; inherited by children)."""
    fs_rights = 0
    if fs:
        fs_rights = _LL_FS_WRITE_V1
        if abi >= 2:
            fs_rights |= _LL_FS_REFER
        if abi >= 3:
            fs_rights |= _LL_FS_TRUNCATE
    net_rights = (_LL_NET_BIND_TCP | _LL_NET_CONNECT_TCP) if (net and abi >= 4) else 0
    scoped = (_LL_SCOPE_ABSTRACT_UNIX_SOCKET | _LL_SCOPE_SIGNAL) if (scope and abi >= 6) else 0
    if not (fs_rights or net_rights or scoped):
        return
    attr = _RulesetAttr(fs_rights, net_rights, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    rfd = _syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        if fs_rights:
            file_rights = fs_rights & (_LL_FS_WRITE_FILE | _LL_FS_TRUNCATE)
            rules = [(d, fs_rights, os.O_DIRECTORY) for d in writable_dirs]
            rules += [(f, file_rights, 0) for f in writable_files if os.path.exists(f)]
            for path, rights, extra in rules:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC | extra)
                try:
                    rule = _PathBeneathAttr(rights, pfd)
                    _syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(rfd), ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                             ctypes.byref(rule), ctypes.c_uint32(0))
                finally:
                    os.close(pfd)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        _syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(rfd), ctypes.c_uint32(0))
    finally:
        os.close(rfd)


def _cap_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cap"):
                k, v = line.split(":", 1)
                out[k] = int(v.strip(), 16)
    return out


def _drop_bounding_caps() -> None:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read().strip())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        try:
            _prctl(_PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno == errno.EINVAL:
                break
            raise
    try:
        _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass


def _clear_caps() -> None:
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc().capset(ctypes.byref(hdr), data) != 0:
        raise _oserror("capset")
    st = _cap_status()
    if any(st.get(k, 1) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb") if k in st):
        raise OSError(errno.EPERM, f"capabilities still present after dropping: {st}")


_SIGNAL_NAMES = {getattr(signal, n): n for n in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGKILL", "SIGUSR1",
    "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGXCPU", "SIGXFSZ", "SIGSYS") if hasattr(signal, n)}
_enc_str = _json.encode_basestring_ascii


def _jdump(obj) -> str:
    """Minimal JSON encoder for the harness's records (dict/list/str/int/float/bool/None)."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, str):
        return _enc_str(obj)
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        return float.__repr__(obj) if obj == obj and abs(obj) != float("inf") else "null"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_jdump(v) for v in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(_enc_str(str(k)) + ":" + _jdump(v) for k, v in obj.items()) + "}"
    return _enc_str(repr(obj))


def _format_exc_short() -> str:
    import traceback  # slow import (~35 ms): only on the rare infrastructure-failure paths

    return traceback.format_exc(limit=6)


def _format_exception(e: BaseException, skip: int = 1, keep: int = 30) -> str:
    """A traceback without the `traceback` module; drops the harness's own first frame."""
    tb = e.__traceback__
    for _ in range(skip):
        if tb is not None:
            tb = tb.tb_next
    frames = []
    while tb is not None:
        co = tb.tb_frame.f_code
        frames.append(f'  File "{co.co_filename}", line {tb.tb_lineno}, in {co.co_name}')
        tb = tb.tb_next
    if len(frames) > keep:
        frames = frames[: keep // 2] + [f"  [... {len(frames) - keep} more frames ...]"] + frames[-keep // 2:]
    try:
        msg = str(e)
    except BaseException:  # noqa: BLE001
        msg = "<unprintable>"
    last = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return "\n".join(["Traceback (most recent call last):", *frames, last]) + "\n"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _proc_children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        try:
            rest = data[data.rindex(b")") + 2:].split()
            ppid = int(rest[1])
        except (ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    return children


def _kill_descendants(root: int, rounds: int = 6) -> None:
    """SIGKILL every process below ``root`` (found through /proc); repeat to catch racing forks."""
    for _ in range(rounds):
        children = _proc_children_map()
        todo, found = list(children.get(root, [])), []
        while todo:
            p = todo.pop()
            found.append(p)
            todo.extend(children.get(p, []))
        if not found:
            return
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)


def _count_tasks_of_uid(uid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                uid_ok, threads = False, 1
                for line in f:
                    if line.startswith("Uid:"):
                        uid_ok = int(line.split()[1]) == uid
                    elif line.startswith("Threads:"):
                        threads = int(line.split()[1])
                if uid_ok:
                    n += threads
        except (OSError, ValueError, IndexError):
            continue
    return n


def _readable_by_others(paths) -> bool:
    """True when every path (and all its ancestors) can be reached and read by an unrelated user."""
    for p in paths:
        if not p or not os.path.exists(p):
            continue
        p = os.path.realpath(p)
        parts = p.split(os.sep)
        cur = os.sep
        for part in parts[1:]:
            try:
                if not os.stat(cur).st_mode & stat.S_IXOTH:
                    return False
            except OSError:
                return False
            cur = os.path.join(cur, part)
        try:
            mode = os.stat(cur).st_mode
        except OSError:
            return False
        need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        if mode & need != need:
            return False
    return True


# ==============================================================================================
# Child side: bootstrap -> init -> harness -> case processes. Runs in a fresh interpreter.
# ==============================================================================================


def _bootstrap_main(job_path: str) -> None:
    with open(job_path, "rb") as f:
        job = marshal.loads(f.read())  # written by the trusted parent
    os.unlink(job_path)
    rfd = job["result_fd"]

    def fatal(msg: str) -> None:
        try:
            _write_all(rfd, (_jdump({"event": "fatal", "error": msg}) + "\n").encode())
        finally:
            os._exit(3)

    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != job["parent_pid"]:
            os._exit(3)  # the parent already died
        disable = set(job["disable"])
        layers = ["process_group", "tmpdir"]
        notes: list[str] = []
        cg = job.get("cgroup")
        if cg:
            # the parent normally moved us already (overlapping our start-up); verify before any fork
            try:
                leaf = "/" + os.path.basename(cg)
                with open("/proc/self/cgroup") as f:
                    inside = any(line.rstrip("\n").endswith(leaf) for line in f)
                if not inside:
                    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                        f.write(str(os.getpid()))
                layers.append("cgroup_pids")
            except OSError as e:
                notes.append(f"cgroup join failed: {e}")
        layers += _enter_namespaces(disable, notes)
        try:
            _prctl(_PR_SET_NO_NEW_PRIVS, 1)
            layers.append("no_new_privs")
        except OSError as e:
            notes.append(f"no_new_privs failed: {e}")
        pid = os.fork()
    except BaseException:  # noqa: BLE001 - report any set-up failure to the parent
        fatal("bootstrap failed: " + _format_exc_short())
        return
    if pid == 0:
        _init_main(job, layers, notes)
    os.close(rfd)
    if job.get("nonce_fd") is not None:
        os.close(job["nonce_fd"])
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 0
            break
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _enter_namespaces(disable: set[str], notes: list[str]) -> list[str]:
    want = []
    if "netns" not in disable:
        want.append(("netns", _CLONE_NEWNET))
    if "pidns" not in disable:
        want.append(("pidns", _CLONE_NEWPID))
    if not want:
        return []
    flags = 0
    for _, f in want:
        flags |= f
    if os.geteuid() == 0:
        try:
            _unshare(flags)
            return [n for n, _ in want]
        except OSError as e:
            notes.append(f"unshare as root failed: {e}")
        got = []
        for n, f in want:
            try:
                _unshare(f)
                got.append(n)
            except OSError:
                pass
        if got:
            return got
    if "userns" in disable:
        return []
    uid, gid = os.geteuid(), os.getegid()
    for combo in ([*want], want[:1], want[1:]):
        if not combo:
            continue
        fl = _CLONE_NEWUSER
        for _, f in combo:
            fl |= f
        try:
            _unshare(fl)
        except OSError as e:
            notes.append(f"unshare(user) failed: {e}")
            continue
        # inside the new user namespace: map our uid/gid to 0 (the only mapping allowed unprivileged)
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
        return ["userns", *[n for n, _ in combo]]
    return []


def _init_main(job: dict, layers: list[str], notes: list[str]) -> None:
    """pid 1 of the sandbox's pid namespace (when there is one): runs the harness, reaps, exits."""
    try:
        if "pidns" in layers and os.getpid() != 1:
            layers.remove("pidns")
            notes.append("pid namespace requested but init is not pid 1")
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        w = os.fork()
        if w == 0:
            _harness_main(job, layers, notes)
        os.close(job["result_fd"])
        if job.get("nonce_fd") is not None:
            os.close(job["nonce_fd"])
        code = 0
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == w:
                code = os.waitstatus_to_exitcode(status) & 0xFF
                break
        os._exit(code)  # in a pid namespace this kills every remaining process inside
    except BaseException:  # noqa: BLE001
        os.write(2, _format_exc_short().encode())
        os._exit(4)


def _plan_layers(job: dict, layers: list[str]) -> dict:
    """Which per-case layers to apply, verified in a throw-away probe process."""
    disable = set(job["disable"])
    ll_off = "landlock" in disable
    abi = 0 if ll_off else _landlock_abi()
    root = os.geteuid() == 0
    in_userns = "userns" in layers
    plan = {
        "abi": abi,
        "landlock_fs": abi >= 1 and "landlock_fs" not in disable and not ll_off,
        "landlock_net": abi >= 4 and "landlock_net" not in disable and not ll_off,
        "landlock_signal": abi >= 6 and "landlock_signal" not in disable and not ll_off,
        "caps_dropped": "caps_dropped" not in disable,
        "uid_drop": (root and not in_userns and "uid_drop" not in disable
                     and _readable_by_others([sys.executable, *sys.path,
                                              os.path.dirname(os.path.dirname(job["work_dir"]))])),
        "nproc": None,
    }
    if "rlimit_nproc" not in disable:
        if in_userns:
            plan["nproc"] = job["max_processes"]  # counted per user namespace: only our processes
        elif plan["uid_drop"]:
            plan["nproc"] = _count_tasks_of_uid(_NOBODY) + job["max_processes"]
        elif not root:
            plan["nproc"] = _count_tasks_of_uid(os.getuid()) + job["max_processes"]
    # probe: apply everything leniently in a child that runs nothing, keep what worked
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            applied = _apply_case_layers(plan, job, strict=False)
            _write_all(w, "\n".join(applied).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    applied = data.decode().split("\n") if data else []
    for k in ("landlock_fs", "landlock_net", "landlock_signal", "caps_dropped", "uid_drop"):
        plan[k] = plan[k] and k in applied
    if "rlimit_nproc" not in applied:
        plan["nproc"] = None
    return plan


def _apply_case_layers(plan: dict, job: dict, strict: bool) -> list[str]:
    """Per-case privilege layers, in dependency order. strict=False records instead of raising."""
    applied: list[str] = []

    def step(name, fn):
        try:
            fn()
            applied.append(name)
        except Exception:  # noqa: BLE001
            if strict:
                raise

    if plan.get("nproc"):
        n = int(plan["nproc"])
        step("rlimit_nproc", lambda: resource.setrlimit(resource.RLIMIT_NPROC, (n, n)))
    if plan["caps_dropped"]:
        step("_bounding", _drop_bounding_caps)  # needs CAP_SETPCAP: before the uid drop
    if plan["uid_drop"]:
        def drop():
            os.setgroups([])
            os.setresgid(_NOBODY, _NOBODY, _NOBODY)
            os.setresuid(_NOBODY, _NOBODY, _NOBODY)
        step("uid_drop", drop)
    if plan["caps_dropped"] and "_bounding" in applied:
        step("caps_dropped", _clear_caps)
    elif plan["caps_dropped"] and strict:
        raise OSError("could not drop the capability bounding set")
    if plan["landlock_fs"] or plan["landlock_net"] or plan["landlock_signal"]:
        def ll():
            _landlock_restrict(plan["abi"], [job["work_dir"]], ["/dev/null"],
                               plan["landlock_fs"], plan["landlock_net"], plan["landlock_signal"])
        before = len(applied)
        step("_landlock", ll)
        if len(applied) > before:
            applied += [k for k in ("landlock_fs", "landlock_net", "landlock_signal") if plan[k]]
    return [a for a in applied if not a.startswith("_")]


def _harness_main(job: dict, layers: list[str], notes: list[str]) -> None:
    rfd = job["result_fd"]

    def send(obj) -> None:
        _write_all(rfd, (_jdump(obj) + "\n").encode())

    try:
        try:
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)
            layers.append("subreaper")
        except OSError as e:
            notes.append(f"subreaper failed: {e}")
        try:
            _prctl(_PR_SET_DUMPABLE, 0)
        except OSError:
            pass
        sys.dont_write_bytecode = True
        if job["memory_bytes"]:
            _setrlimit(resource.RLIMIT_AS, job["memory_bytes"])
        plan = _plan_layers(job, layers)
        layers += ["rlimit_cpu", "rlimit_fsize", "rlimit_nofile", "rlimit_core"]
        if job["memory_bytes"]:
            layers.append("rlimit_as")
        layers += [k for k in ("caps_dropped", "uid_drop", "landlock_fs", "landlock_net", "landlock_signal")
                   if plan[k]]
        if plan["nproc"]:
            layers.append("rlimit_nproc")
        if plan["uid_drop"]:
            os.chown(job["work_dir"], _NOBODY, _NOBODY)
        missing = [r for r in job["require"] if r not in layers]
        if missing:
            send({"event": "fatal", "layers": layers, "notes": notes,
                  "error": f"required sandbox layers unavailable: {missing} (active: {layers}; notes: {notes})"})
            os._exit(0)
        send({"event": "ready", "layers": layers, "notes": notes})
    except BaseException:  # noqa: BLE001
        send({"event": "fatal", "error": "harness set-up failed: " + _format_exc_short()})
        os._exit(5)

    try:
        code = compile(job["program"], "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
        send({"event": "compile_error", "detail": f"{type(e).__name__}: {e}"[:2000]})
        os._exit(0)
    check_code = None
    if job["mode"] == "check":
        try:
            check_code = compile(job["check"], "check.py", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
            send({"event": "check_error", "detail": f"{type(e).__name__}: {e}"[:2000]})
            os._exit(0)

    if job["mode"] == "fn":
        import json  # noqa: F401 - imported once here, so that every case process has it ready

    pidns = "pidns" in layers
    total_deadline = time.monotonic() + job["total_timeout"]
    for i in range(job["n_cases"]):
        if time.monotonic() >= total_deadline:
            send({"event": "case", "i": i, "status": "timeout", "detail": "total time limit reached before this case"})
            continue
        rec = _run_case(job, plan, i, code, check_code, total_deadline, pidns)
        send(rec)
    send({"event": "done"})
    os._exit(0)


def _setrlimit(which: int, value: int) -> None:
    """Set soft = hard = value (never above the current hard limit, so it works unprivileged)."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _cleanup_case_processes(pgid: int, pidns: bool) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 2.0
    while True:
        if pidns:
            try:
                os.kill(-1, signal.SIGKILL)  # everything in our pid namespace except init and us
            except OSError:
                pass
        else:
            _kill_descendants(os.getpid())
        busy = False
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                busy = True
                break
        if not busy or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def _wait_case(pid: int, deadline: float):
    timed_out = False
    pfd = None
    try:
        pfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pfd = None
    if pfd is not None:
        try:
            poller = select.poll()
            poller.register(pfd, select.POLLIN)
            while True:
                rem = deadline - time.monotonic()
                if rem <= 0:
                    timed_out = True
                    break
                if poller.poll(int(rem * 1000) + 1):
                    break
        finally:
            os.close(pfd)
    else:
        delay = 0.0005
        while True:
            try:
                done = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if done is not None:
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
    if timed_out:
        for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
            except OSError:
                pass
    _, status, ru = os.wait4(pid, 0)
    return status, ru, timed_out


def _run_case(job: dict, plan: dict, i: int, code, check_code, total_deadline: float, pidns: bool) -> dict:
    io_dir, work = job["io_dir"], job["work_dir"]
    mode = job["mode"]
    cap = int(job["caps"][i])
    # The harness creates every per-case file itself (O_EXCL | O_NOFOLLOW, after removing whatever a
    # previous case may have planted there) and reads them back through its own descriptors, never by
    # path: where neither Landlock nor the uid drop is available the program could otherwise swap a
    # path for a symlink or a FIFO and make this (privileged) process write, read or block on it.
    fds = {}
    names = [os.path.join(io_dir, f"{k}{i}") for k in ("in", "out", "err", "diag", "res")]
    try:
        for k, path in zip(("in", "out", "err", "diag", "res"), names):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            fds[k] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.unlink(path)  # nothing else needs the name
        if mode == "stdin":
            _write_all(fds["in"], job["inputs"][i].encode("utf-8", "surrogateescape"))
            os.lseek(fds["in"], 0, os.SEEK_SET)
        setup_r, setup_w = os.pipe()
        start = time.monotonic()
        deadline = min(start + job["timeout"], total_deadline)
        pid = os.fork()
        if pid == 0:
            os.close(setup_r)
            _case_child(job, plan, i, code, check_code, fds, setup_w, cap)  # never returns
        os.close(setup_w)
        status, ru, timed_out = _wait_case(pid, deadline)
        elapsed = time.monotonic() - start
        _cleanup_case_processes(pid, pidns)
        setup = os.read(setup_r, 65536)
        os.close(setup_r)

        out_size = os.fstat(fds["out"]).st_size
        stdout = os.pread(fds["out"], cap, 0)
        err_size = os.fstat(fds["err"]).st_size
        stderr = os.pread(fds["err"], 2000, max(0, err_size - 2000))
        diag_raw = os.pread(fds["diag"], 65536, 0)
        res = os.pread(fds["res"], cap + 1, 0)
    finally:
        for fd in fds.values():
            os.close(fd)
    _clear_dir(work)

    rec = {"event": "case", "i": i, "time": round(elapsed, 4), "cpu": round(ru.ru_utime + ru.ru_stime, 4),
           "stderr": stderr.decode("utf-8", "replace")}
    if setup[:1] != b"K":
        rec.update(status="sandbox_error",
                   detail=("case set-up failed: " + setup[1:].decode("utf-8", "replace")) if setup
                   else f"case process died during set-up (wait status {status})")
        return rec
    # diag: "<exception type>\n<errno>\n<message>" written by the case process (the program could
    # overwrite it; it only ever chooses between failure reasons, never decides a pass)
    parts = diag_raw.decode("utf-8", "replace").split("\n", 2) if diag_raw else []
    exc = parts[0] if parts else ""
    diag_errno = int(parts[1]) if len(parts) > 1 and parts[1].lstrip("-").isdigit() else None
    diag_msg = parts[2] if len(parts) > 2 else ""
    detail = (f"{exc}: {diag_msg}" if exc else "")[:1000]
    text = stdout.decode("utf-8", "replace")
    rec["stdout"] = text if mode == "stdin" else text[:2000]
    if timed_out:
        rec.update(status="timeout", detail=f"wall-clock limit ({job['timeout']} s) exceeded")
    elif out_size >= cap or diag_errno == errno.EFBIG:
        rec.update(status="output_limit", detail=f"output exceeded {cap} bytes")
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = _SIGNAL_NAMES.get(sig, f"signal {sig}")
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and rec["cpu"] >= job["cpu_seconds"]):
            rec.update(status="timeout", detail=f"CPU-time limit ({job['cpu_seconds']} s) exceeded")
        elif sig == signal.SIGXFSZ:
            rec.update(status="output_limit", detail="file-size limit exceeded")
        elif b"MemoryError" in stderr or b"Cannot allocate memory" in stderr or exc == "MemoryError":
            rec.update(status="memory", detail=f"killed by {name} while out of memory")
        else:
            rec.update(status="runtime_error", detail=f"killed by {name}")
    else:
        rc = os.WEXITSTATUS(status)
        if rc != 0:
            if exc == "MemoryError":
                rec.update(status="memory", detail=detail or "MemoryError")
            elif mode == "check" and exc == "AssertionError":
                rec.update(status="assertion", detail=detail or "AssertionError")
            else:
                rec.update(status="runtime_error", detail=detail or f"exit status {rc}")
        elif mode == "stdin":
            rec.update(status="ok", detail="")
        elif not res:
            if mode == "check":
                rec.update(status="no_record", detail="exited before check() completed")
            else:
                rec.update(status="runtime_error", detail="exited before the function returned")
        elif len(res) > cap:
            rec.update(status="output_limit", detail=f"return value exceeded {cap} bytes")
        else:
            rec.update(status="ok", detail="", res=res.decode("utf-8", "replace"))
    return rec


def _clear_dir(path: str) -> None:
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        p = os.path.join(path, name)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                _rmtree_force(p)
            else:
                os.unlink(p)
        except OSError:
            pass


def _rmtree_force(path: str) -> None:
    import shutil

    def onerror(func, p, exc_info):
        try:
            os.chmod(os.path.dirname(p) or p, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda func, p, exc: onerror(func, p, None))
    else:
        shutil.rmtree(path, onerror=onerror)


def _close_fds_except(keep: set[int]) -> None:
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: close the whole range around the kept descriptors
        top = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        top = 65536 if top == resource.RLIM_INFINITY or top > 65536 else top
        lo = 0
        for k in sorted(keep) + [top]:
            os.closerange(lo, k)
            lo = k + 1
        return
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _case_child(job, plan, i, code, check_code, fds, setup_w, cap) -> None:
    """Fork of the harness for one test case: set up the sandbox, report, run the program, _exit."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as CPython does: writes past the cap fail with EFBIG
        os.setpgid(0, 0)
        if job["mode"] == "stdin":
            os.dup2(fds["in"], 0)
        else:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
        os.dup2(fds["out"], 1)
        os.dup2(fds["err"], 2)
        diag_fd, res_fd = fds["diag"], fds["res"]
        nonce_fd = job.get("nonce_fd") if job["mode"] == "check" else None
        keep = {0, 1, 2, diag_fd, res_fd, setup_w}
        if nonce_fd is not None:
            keep.add(nonce_fd)
        _close_fds_except(keep)
        for fd in (diag_fd, res_fd, setup_w) + ((nonce_fd,) if nonce_fd is not None else ()):
            os.set_inheritable(fd, False)
        _setrlimit(resource.RLIMIT_CORE, 0)
        _setrlimit(resource.RLIMIT_CPU, job["cpu_seconds"])
        _setrlimit(resource.RLIMIT_FSIZE, cap)
        _setrlimit(resource.RLIMIT_NOFILE, job["max_open_files"])
        if job["memory_bytes"]:
            _setrlimit(resource.RLIMIT_AS, job["memory_bytes"])
        try:
            _setrlimit(resource.RLIMIT_STACK, job["stack_bytes"])
        except (OSError, ValueError):
            pass
        os.chdir(job["work_dir"])
        _apply_case_layers(plan, job, strict=True)
        os.write(setup_w, b"K")
        os.close(setup_w)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(setup_w, b"E" + f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:4000])
        finally:
            os._exit(_SETUP_FAILED_RC)
    rc = _execute_candidate(job, i, code, check_code, diag_fd, res_fd, nonce_fd)
    os._exit(rc)


def _jsonable_default(obj):
    """JSON for return values that JSON lacks; tagged, so they never equal a plain expected value."""
    if isinstance(obj, (set, frozenset)):
        try:
            items = sorted(obj)
        except TypeError:
            items = list(obj)
        return {"__set__": items}
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": obj.decode("utf-8", "replace")}
    return {"__unserializable__": type(obj).__name__}


def _execute_candidate(job, i, code, check_code, diag_fd, res_fd, nonce_fd) -> int:
    import builtins

    _os_write, _os_read = os.write, os.read
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    main.__dict__["__file__"] = "solution.py"
    sys.modules["__main__"] = main
    sys.argv = ["solution.py"]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                  encoding="utf-8", errors="replace")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                    encoding="utf-8", errors="backslashreplace")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                    encoding="utf-8", errors="backslashreplace",
                                                    line_buffering=True)
    our_stdout = sys.stdout
    g = main.__dict__
    rc = 0
    mode = job["mode"]
    try:
        exec(code, g)
        if mode == "fn":
            name = job["fn_name"]
            fn = g.get(name)
            if not callable(fn):
                cls = g.get("Solution")
                if isinstance(cls, type) and hasattr(cls, name):
                    fn = getattr(cls(), name)
            if not callable(fn):
                raise NameError(f"function {name!r} is not defined")
            args = job["inputs"][i]
            value = fn(*args) if isinstance(args, list) else fn(args)
            import json

            data = json.dumps({"value": value}, default=_jsonable_default).encode()
            _write_all(res_fd, data)
        elif mode == "check":
            exec(check_code, g)
            entry = job["entry_point"]
            candidate = g.get(entry)
            if not callable(candidate):
                raise NameError(f"entry point {entry!r} is not defined")
            g["check"](candidate)
            # check() returned normally: only now fetch the parent's nonce and write the record
            nonce = _os_read(nonce_fd, 4096)
            _os_write(res_fd, nonce)
    except SystemExit as e:
        c = e.code
        if c is None:
            rc = 0
        elif isinstance(c, int):
            rc = c & 0xFF
        else:
            try:
                print(c, file=sys.stderr)
            except Exception:  # noqa: BLE001
                pass
            rc = 1
    except BaseException as e:  # noqa: BLE001
        rc = 1
        _write_diag(diag_fd, e)
        try:  # the program's traceback, without the harness's own frame
            try:
                sys.stderr.flush()
            except BaseException:  # noqa: BLE001
                pass
            _os_write(2, _format_exception(e).encode("utf-8", "backslashreplace"))
        except BaseException:  # noqa: BLE001
            pass
    for stream in {id(sys.stdout): sys.stdout, id(our_stdout): our_stdout, id(sys.stderr): sys.stderr}.values():
        try:
            stream.flush()
        except BaseException as e:  # noqa: BLE001
            if rc == 0:
                rc = 1
            _write_diag(diag_fd, e)
    return rc


def _write_diag(fd: int, e: BaseException) -> None:
    try:
        try:
            msg = str(e)[:500].replace("\n", " ")
        except BaseException:  # noqa: BLE001
            msg = ""
        en = getattr(e, "errno", None)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, f"{type(e).__name__}\n{en if isinstance(en, int) else ''}\n{msg}".encode("utf-8", "replace"))
    except BaseException:  # noqa: BLE001
        pass


if __name__ == "__main__":
    _bootstrap_main(sys.argv[-1])
    sys.exit(0)


# ==============================================================================================
# Parent side
# ==============================================================================================

import atexit  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import itertools  # noqa: E402
import secrets  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

_SCRIPT = os.path.abspath(__file__)
# Start the bootstrap from this file's cached bytecode: running it as a script would recompile the
# whole module in every sandbox (~25-90 ms of CPU, the largest start-up cost).
_BOOT = (
    "import sys\n"
    "from importlib.machinery import SourceFileLoader\n"
    "_c = SourceFileLoader('__main__', sys.argv[1]).get_code('__main__')\n"
    "del SourceFileLoader\n"
    "exec(_c)\n"
)
_COUNTER = itertools.count()
_WARNED: set[tuple[str, ...]] = set()
_WARN_LOCK = threading.Lock()
_STALE_CGROUPS: list[str] = []


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and options of one sandboxed run.

    Attributes:
        timeout: wall-clock seconds per test case (the CPU-time limit is ``int(timeout) + 2``).
        total_timeout: wall-clock seconds for all test cases of one program; cases not started by then
            are reported as ``timeout``.
        memory_mb: address-space limit (RLIMIT_AS) per process, MiB; 0 disables it.
        output_limit: bytes of stdout (and of a returned value's JSON) kept per test case; a program
            writing this much (or more) is stopped by RLIMIT_FSIZE and gets ``output_limit``. The
            verifier raises it per case to at least ``2 * len(expected) + 1024`` bytes, so a correct
            answer always fits.
        max_processes: processes+threads in the sandbox (pids cgroup ``pids.max``; the bootstrap,
            init and harness count too).
        max_open_files: RLIMIT_NOFILE.
        stack_mb: RLIMIT_STACK for the case process (deep recursion in competitive code).
        python_executable: interpreter of the sandbox (default: ``sys.executable``); it must have
            the packages candidate programs may import.
        tmp_root: where per-run temp directories are created (default: ``tempfile.gettempdir()``).
        require: layer names (see :data:`LAYERS`) that must be active; if one is missing the run is an
            infrastructure failure (``sandbox_error``) and no candidate code runs.
        disable: layers to switch off (``cgroup_pids``, ``userns``, ``netns``, ``pidns``, ``landlock``,
            ``landlock_fs``, ``landlock_net``, ``landlock_signal``, ``caps_dropped``, ``uid_drop``,
            ``rlimit_nproc``), for debugging and fallback tests.
        startup_grace: extra seconds the parent waits (beyond the time limits) before it kills a
            sandbox that does not answer.
    """

    timeout: float = 4.0
    total_timeout: float = 30.0
    memory_mb: int = 1024
    output_limit: int = 256 << 10
    max_processes: int = 12
    max_open_files: int = 256
    stack_mb: int = 64
    python_executable: str | None = None
    tmp_root: str | None = None
    require: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    startup_grace: float = 10.0

    def __post_init__(self):
        for name in ("timeout", "total_timeout", "startup_grace"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive number of seconds, got {v!r}")
        for name in ("output_limit", "max_processes", "max_open_files", "stack_mb"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.memory_mb, int) or self.memory_mb < 0:
            raise ValueError(f"SandboxConfig.memory_mb must be an integer >= 0, got {self.memory_mb!r}")
        if self.max_processes < 4:
            raise ValueError("SandboxConfig.max_processes must be >= 4 (bootstrap, init and harness count)")
        object.__setattr__(self, "require", tuple(self.require))
        object.__setattr__(self, "disable", tuple(self.disable))
        unknown = [r for r in self.require if r not in LAYERS]
        if unknown:
            raise ValueError(f"SandboxConfig.require: unknown layer(s) {unknown}; known: {sorted(LAYERS)}")
        unknown = [d for d in self.disable if d not in _DISABLEABLE]
        if unknown:
            raise ValueError(f"SandboxConfig.disable: unknown layer(s) {unknown}; use {sorted(_DISABLEABLE)}")


@dataclass
class CaseOutcome:
    """What happened to one test case, as observed by the trusted harness.

    ``status``: ``ok`` (ran to completion; the parent still has to compare), ``timeout``, ``memory``,
    ``output_limit``, ``runtime_error``, ``assertion`` (``check`` raised AssertionError), ``no_record``
    (``check`` mode: exited 0 without completing ``check()``) or ``sandbox_error``.
    ``stdout`` is what the program printed (complete up to the cap in ``stdin`` mode, a preview
    otherwise). ``value`` is the decoded return value (``fn`` mode, ``has_value``). ``verified`` is set
    in ``check`` mode when the completion record carried the parent's nonce.
    """

    status: str
    stdout: str = ""
    value: Any = None
    has_value: bool = False
    verified: bool = False
    detail: str = ""
    stderr: str = ""
    time: float = 0.0


@dataclass
class SandboxRun:
    """Result of :func:`run_program`.

    ``ok`` is False on an infrastructure failure (``error`` says why; no verdict may be drawn).
    ``compile_error`` is set when the program does not compile (no case ran). ``cases`` has one
    :class:`CaseOutcome` per test case otherwise. ``process_limit_hit`` is True when the pids cgroup
    refused a fork. ``layers`` are the isolation layers that were active.
    """

    ok: bool
    error: str = ""
    layers: tuple[str, ...] = ()
    compile_error: str | None = None
    check_error: str | None = None
    cases: list[CaseOutcome] = field(default_factory=list)
    process_limit_hit: bool = False
    elapsed: float = 0.0
    notes: tuple[str, ...] = ()


# ------------------------------------------------------------------ cgroups


def _pids_cgroup_base() -> str | None:
    """Directory under which this process may create a pids cgroup (v1 pids controller or v2)."""
    own_v1, own_v2 = None, None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if "pids" in parts[1].split(","):
                    own_v1 = parts[2]
                elif parts[0] == "0" and parts[1] == "":
                    own_v2 = parts[2]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for m in mounts:
        try:
            sep = m.index("-")
        except ValueError:
            continue
        fstype, opts, root, point = m[sep + 1], m[-1], m[3], m[4]
        if fstype == "cgroup" and "pids" in opts.split(",") and own_v1 is not None:
            rel = own_v1[len(root):] if own_v1.startswith(root) and root != "/" else own_v1
            return os.path.join(point, rel.lstrip("/"))
    for m in mounts:
        try:
            sep = m.index("-")
        except ValueError:
            continue
        if m[sep + 1] == "cgroup2" and own_v2 is not None:
            root, point = m[3], m[4]
            rel = own_v2[len(root):] if own_v2.startswith(root) and root != "/" else own_v2
            base = os.path.join(point, rel.lstrip("/"))
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    if "pids" in f.read().split():
                        return base
            except OSError:
                pass
    return None


_CG_BASE: list = []


def _cgroup_create(cfg: SandboxConfig) -> str | None:
    if "cgroup_pids" in cfg.disable:
        return None
    if not _CG_BASE:
        _CG_BASE.append(_pids_cgroup_base())
    base = _CG_BASE[0]
    if base is None:
        return None
    path = os.path.join(base, f"trl_prime_sbx_{os.getpid()}_{next(_COUNTER)}_{secrets.token_hex(3)}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    try:
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(cfg.max_processes))
    except OSError:
        _cgroup_remove(path)
        return None
    return path


def _cgroup_limit_hit(path: str) -> bool:
    try:
        with open(os.path.join(path, "pids.events")) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "max" and int(v) > 0:
                    return True
    except (OSError, ValueError):
        pass
    return False


def _cgroup_kill_all(path: str) -> None:
    for _ in range(100):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


def _cgroup_remove(path: str, wait: float = 2.0) -> bool:
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                _STALE_CGROUPS.append(path)
                return False
            time.sleep(0.005)


def _retry_stale_cgroups() -> None:
    while _STALE_CGROUPS:
        p = _STALE_CGROUPS.pop()
        try:
            os.rmdir(p)
        except FileNotFoundError:
            pass
        except OSError:
            _STALE_CGROUPS.append(p)
            return


atexit.register(_retry_stale_cgroups)


# ------------------------------------------------------------------ run


def _wait_exit_nowait(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` (our child) has exited, leaving it a zombie so its pid cannot be reused."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        try:
            res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        if res is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _env(work: str) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": work,
        "TMPDIR": work,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_NUM_THREADS": "1",
    }
    return env


def _maybe_warn(layers: tuple[str, ...]) -> None:
    groups = {
        "network": ("netns", "landlock_net"),
        "process count": ("cgroup_pids", "rlimit_nproc"),
        "leftover processes": ("pidns", "cgroup_pids"),
        "filesystem writes": ("landlock_fs", "uid_drop"),
        "signals to the host": ("pidns", "landlock_signal"),
    }
    missing = tuple(sorted(k for k, alts in groups.items() if not any(a in layers for a in alts)))
    if not missing:
        return
    with _WARN_LOCK:
        if missing in _WARNED:
            return
        _WARNED.add(missing)
    warnings.warn(
        f"trl_prime sandbox: no active isolation layer covers {', '.join(missing)} (unavailable on this "
        f"machine or disabled; active layers: {', '.join(layers)}). Untrusted code runs with weaker "
        f"containment; set SandboxConfig(require=...) to refuse instead.",
        RuntimeWarning,
        stacklevel=3,
    )


def run_program(
    program: str,
    *,
    mode: str,
    inputs: list | None = None,
    fn_name: str | None = None,
    check: str | None = None,
    entry_point: str | None = None,
    output_caps: list[int] | None = None,
    config: SandboxConfig | None = None,
) -> SandboxRun:
    """Run ``program`` once per test case in a fresh sandbox and return what was observed.

    Args:
        program: Python source of the candidate.
        mode: ``"stdin"`` (``inputs`` are strings fed to stdin; ``CaseOutcome.stdout`` is returned),
            ``"fn"`` (``inputs`` are argument lists for ``fn_name``; the return value comes back as
            JSON, decoded into ``CaseOutcome.value``), or ``"check"`` (HumanEval: run ``program``, then
            ``check`` source, then ``check(<entry_point>)``; one case, ``CaseOutcome.verified`` is True
            only when the completion record carries this call's secret nonce).
        output_caps: per-case stdout caps in bytes (default ``config.output_limit``).
        config: :class:`SandboxConfig`.

    Returns:
        :class:`SandboxRun`. Never raises for anything the program does; ``ok=False`` marks an
        infrastructure failure (interpreter missing, sandbox set-up failed, a required layer missing).

    Raises:
        ValueError: bad arguments (unknown mode, missing ``fn_name``/``check``/``entry_point``).
    """
    cfg = config or SandboxConfig()
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "check":
        if not isinstance(check, str) or not isinstance(entry_point, str):
            raise ValueError("mode='check' needs check= (source defining check(candidate)) and entry_point=")
        n = 1
        inputs = []
    else:
        if inputs is None:
            raise ValueError(f"mode={mode!r} needs inputs=")
        if mode == "fn" and not isinstance(fn_name, str):
            raise ValueError("mode='fn' needs fn_name=")
        n = len(inputs)
    caps = list(output_caps) if output_caps is not None else [cfg.output_limit] * n
    if len(caps) != n:
        raise ValueError(f"output_caps has {len(caps)} entries for {n} cases")
    t0 = time.monotonic()
    if _STALE_CGROUPS:
        _retry_stale_cgroups()

    base = cg = proc = None
    r = w = nonce_r = None
    errf = None
    try:
        base = tempfile.mkdtemp(prefix="trl_prime_sbx_", dir=cfg.tmp_root)
        os.chmod(base, 0o711)
        work, io_dir = os.path.join(base, "work"), os.path.join(base, "io")
        os.mkdir(work, 0o700)
        os.mkdir(io_dir, 0o700)
        cg = _cgroup_create(cfg)
        r, w = os.pipe()
        nonce = None
        if mode == "check":
            nonce = secrets.token_hex(16)
            nonce_r, nonce_w = os.pipe()
            os.write(nonce_w, nonce.encode())
            os.close(nonce_w)
        cpu_seconds = int(cfg.timeout) + 2
        job = {
            "parent_pid": os.getpid(),
            "result_fd": w,
            "nonce_fd": nonce_r,
            "cgroup": cg,
            "disable": list(cfg.disable),
            "require": list(cfg.require),
            "work_dir": work,
            "io_dir": io_dir,
            "mode": mode,
            "program": program,
            "inputs": inputs,
            "fn_name": fn_name,
            "check": check,
            "entry_point": entry_point,
            "n_cases": n,
            "caps": caps,
            "timeout": float(cfg.timeout),
            "total_timeout": float(cfg.total_timeout),
            "cpu_seconds": cpu_seconds,
            "memory_bytes": cfg.memory_mb << 20,
            "stack_bytes": cfg.stack_mb << 20,
            "max_open_files": cfg.max_open_files,
            "max_processes": cfg.max_processes,
        }
        job_path = os.path.join(base, "job.json")
        fd = os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps(job))
        errf = tempfile.TemporaryFile()
        pass_fds = (w,) if nonce_r is None else (w, nonce_r)
        proc = subprocess.Popen(
            [cfg.python_executable or sys.executable, "-I", "-c", _BOOT, _SCRIPT, job_path],
            stdin=subprocess.DEVNULL, stdout=errf, stderr=errf, pass_fds=pass_fds,
            start_new_session=True, env=_env(work), cwd=base, close_fds=True,
        )
        if cg:
            try:
                with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                    f.write(str(proc.pid))
            except OSError:
                pass  # the bootstrap joins itself
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        err = f"could not start the sandbox: {type(e).__name__}: {e}"
        for fd in (r, w, nonce_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if cg:
            _cgroup_remove(cg)
        if base:
            _rmtree_force(base)
        if errf is not None:
            errf.close()
        return SandboxRun(ok=False, error=err, elapsed=time.monotonic() - t0)

    os.close(w)
    if nonce_r is not None:
        os.close(nonce_r)
    events, timed_out, overflow, finished = [], False, False, False
    try:
        events, timed_out, overflow = _read_events(r, t0 + cfg.startup_grace + cfg.total_timeout + cfg.timeout,
                                                   budget=sum(caps) * 7 + (n + 16) * 8192 + (1 << 20))
        finished = True
    finally:
        # Teardown runs even if this thread is interrupted. The bootstrap stays a zombie until its
        # process group and the cgroup are empty, so its pid (= the group id) cannot be reused meanwhile.
        os.close(r)
        if not finished or timed_out or overflow or not _wait_exit_nowait(proc.pid, 5.0):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            _wait_exit_nowait(proc.pid, 5.0)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        limit_hit = False
        if cg:
            limit_hit = _cgroup_limit_hit(cg)
            _cgroup_kill_all(cg)
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if cg:
            _cgroup_remove(cg)
        errf.seek(0)
        stderr_text = errf.read()[-4000:].decode("utf-8", "replace")
        errf.close()
        _rmtree_force(base)

    run = _assemble(events, n, mode, nonce, timed_out, overflow, rc, stderr_text)
    run.process_limit_hit = limit_hit
    run.elapsed = time.monotonic() - t0
    if run.layers:
        _maybe_warn(run.layers)
    return run


def _read_events(r: int, deadline: float, budget: int):
    events, buf, total = [], b"", 0
    poller = select.poll()
    poller.register(r, select.POLLIN)
    while True:
        rem = deadline - time.monotonic()
        if rem <= 0:
            return events, True, False
        if not poller.poll(int(rem * 1000) + 1):
            continue
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        total += len(chunk)
        if total > budget:
            return events, False, True
        buf += chunk
        if b"\n" in chunk:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass
    return events, False, False


def _assemble(events, n, mode, nonce, timed_out, overflow, rc, stderr_text) -> SandboxRun:
    ready = next((e for e in events if e.get("event") == "ready"), None)
    fatal = next((e for e in events if e.get("event") == "fatal"), None)
    if fatal is not None or ready is None:
        if fatal is not None:
            err = fatal.get("error", "sandbox failed")
        elif timed_out:
            err = "sandbox did not start in time"
        else:
            err = f"sandbox exited before it was ready (exit status {rc}); stderr: {stderr_text.strip()[-1500:]}"
        return SandboxRun(ok=False, error=err, layers=tuple((fatal or {}).get("layers", ())))
    layers = tuple(ready.get("layers", ()))
    notes = tuple(ready.get("notes", ()))
    if overflow:
        return SandboxRun(ok=False, error="sandbox sent more data than its output caps allow", layers=layers)
    for e in events:
        if e.get("event") == "compile_error":
            return SandboxRun(ok=True, layers=layers, compile_error=str(e.get("detail", "")), notes=notes)
        if e.get("event") == "check_error":
            return SandboxRun(ok=True, layers=layers, check_error=str(e.get("detail", "")), notes=notes)
    cases: list[CaseOutcome | None] = [None] * n
    for e in events:
        if e.get("event") != "case":
            continue
        i = e.get("i")
        if not isinstance(i, int) or not 0 <= i < n:
            continue
        st = str(e.get("status", "runtime_error"))
        c = CaseOutcome(status=st, stdout=str(e.get("stdout", "")), detail=str(e.get("detail", "")),
                        stderr=str(e.get("stderr", "")), time=float(e.get("time", 0.0)))
        if st == "sandbox_error":
            return SandboxRun(ok=False, error=c.detail, layers=layers, notes=notes)
        if st == "ok" and mode == "fn":
            try:
                payload = json.loads(e.get("res", ""))
                c.value, c.has_value = payload["value"], True
            except (ValueError, TypeError, KeyError, RecursionError):
                c.status, c.detail = "runtime_error", "return value could not be decoded"
        elif st == "ok" and mode == "check":
            c.verified = nonce is not None and e.get("res") == nonce
        cases[i] = c
    done = any(e.get("event") == "done" for e in events)
    for i in range(n):
        if cases[i] is None:
            if timed_out:
                cases[i] = CaseOutcome(status="timeout", detail="sandbox wall-clock limit reached")
            else:
                why = "harness terminated before reporting this case (killed by the program?)"
                cases[i] = CaseOutcome(status="runtime_error", detail=why if not done else "case not reported")
    return SandboxRun(ok=True, layers=layers, cases=cases, notes=notes)


_LAYER_CACHE: dict = {}


def sandbox_layers(config: SandboxConfig | None = None) -> tuple[str, ...]:
    """Isolation layers active on this machine for ``config`` (runs one trivial program; cached).

    Returns an empty tuple when the sandbox cannot run at all.
    """
    cfg = config or SandboxConfig()
    key = (cfg.python_executable, cfg.disable, cfg.tmp_root)
    if key not in _LAYER_CACHE:
        run = run_program("pass", mode="stdin", inputs=[""], config=dataclasses.replace(cfg, require=()))
        _LAYER_CACHE[key] = run.layers if run.ok else ()
    return _LAYER_CACHE[key]
