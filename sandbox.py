"""The code sandbox of verifiers.py: process isolation for model-written code, and the harness that decides a
code test's verdict outside the program. verifiers.py's `code` and `code_stdio` are its only callers.

Isolation. Each run starts in new pid, network, mount, ipc and uts namespaces (util-linux `unshare`): mode
"namespace" when root (the program runs as a spare unprivileged uid), "userns" otherwise (an unprivileged user
namespace, uid 65534 inside), "bwrap" (bubblewrap, the same namespaces and root) where that works and unshare does
not. Its root is built for it: the system dirs and the interpreter's prefixes (venv, conda env, base install,
wherever they live) read-only, a tmpfs /tmp holding its files as its only writable place, a minimal /dev and its
own /proc; nothing of the caller's (repository, checkpoints, /proc/<pid>/environ) is there. It is the pid
namespace's init, so everything it starts (setsid, double forks) dies with it at its wall-clock limit, and with
the caller when the caller is killed; what a killed pool worker leaves on disk is removed by the pool
(`cleanup_sandboxes`). A cgroup per run (where one can be made: root, or a delegated v2 subtree) bounds the memory
(tmpfs included) and processes of the whole sandbox to `memory_mb` and 64; without one, the program may start threads
(64 tasks) but no other process (`refuse_processes`: threads share their process's address space, so one
address-space limit bounds them all), and its one process and the harness get half of the budget each; its tmpfs
mounts have inode limits. In every mode a seccomp filter
makes the calls that hold memory no address-space limit counts (memfd, sockets, SysV / POSIX shared memory and
message queues, io_uring, AIO, inotify, fanotify, userfaultfd, F_SETPIPE_SZ) and perf_event_open fail with EPERM
(`_SECCOMP`). With no usable namespaces (mode "none") the code verifiers refuse to
run unless `allow_unsandboxed_code`; then the program runs as the caller, unisolated, below a launcher that is a
child subreaper and kills everything below it when the program ends, times out or the caller dies (setsid and
double forks included; running as the caller, a hostile program can still kill the launcher, or the caller).
`sandbox_description()` says which mode this machine gets.

Verdicts (`judge_asserts`): the contract is written where the checks are ("verdicts" below). In short: what a
test's text gives as the expected value is computed here; what needs the program is computed in the program's
process, whole, with Python's semantics, and comes back as plain data (exact builtin types; anything else is "not
plain" and equal to nothing here); the comparison is made here. A check with no expected operand is judged inside
the program's process and counted ("judged_inside"). Which is which follows the test's text alone. Each test runs
in a fresh process, with a fresh /tmp, forked from a harness that never ran the program's code and that the
program can neither trace nor impersonate. Stdio tests (`run_stdio_tests`) run the same way, one sandbox per 128
tests and a fresh process per test, its stdin a read-only file of its own; this process compares stdout token by
token, all of it up to the 16 MB file-size limit (past it: status "output_limit", counted). The program's stdin is
read-only, its stdout and stderr append-only and emptied between tests, so nothing one test writes there reaches
the next.
"""

import ast
import collections
import itertools
import json
import logging
import math as pymath
import os
import queue
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("verifiers")


_SANDBOX: dict = {}  # {"mode": one of _MODES, "cgroup": {kind: base dir} or {}}, probed once per process
_SANDBOX_LOCK = threading.Lock()
_UID_LOCK = threading.Lock()
_UID_SLOTS: dict[int, queue.Queue] = {}  # pid -> free sandbox uids
_FSIZE = 16 << 20  # bytes a program may write to one file (its stdout included)
_NPROC = 64  # processes + threads of one sandbox (under a cgroup, which bounds their memory together; without one,
# threads of the program's one process: they share its address space, so its RLIMIT_AS bounds them all)
_NPROC_NO_CGROUP = 4  # mode none (no sandbox, no cgroup): 4 processes of 1/4 of the budget each
_TMP_MB, _SHM_MB = 64, 16  # its /tmp (the work directory) and /dev/shm: tmpfs, part of the memory budget
_TMP_INODES, _SHM_INODES = 16384, 1024  # files and dirs on each: ~1 KB of kernel memory each outside a cgroup
_RUN_PREFIX = "verifiers_run_"  # host work dirs and cgroups: <prefix><pid>_..., removed once pid is gone
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_MODES = {
    "namespace": "pid, net, mount and ipc namespaces, a read-only root, a spare unprivileged uid (as root)",
    "userns": "an unprivileged user namespace (uid 65534 inside) with pid, net, mount and ipc namespaces, "
              "a read-only root",
    "bwrap": "bubblewrap: user, pid, net, mount, ipc, uts and cgroup namespaces (uid 65534 inside), a read-only root",
    "none": "NO ISOLATION (no usable namespaces here): code verifiers refuse to run unless allow_unsandboxed_code",
}


# A seccomp filter, installed last before the program's exec in every mode (it is inherited by all the
# program starts): the calls that hold memory no address-space limit counts fail with EPERM. They are
# memfd files and SysV / POSIX shared memory and message queues (pages held unmapped), sockets (kernel
# buffers: the network namespace leaves only local pairs, and 60 filled pairs held 470 MB), io_uring
# (pinned buffers), F_SETPIPE_SZ (a pipe keeps its default 64 KB), SysV semaphore sets (kernel memory: 1.2-1.8 GB
# held against a 1 GB budget) and extended attributes (kept in memory outside a tmpfs's size: about 3 GB). The
# keyring calls (add_key, request_key, keyctl) fail too: keyrings outlive a run (a uid's, persistent ones) and
# one inherited is the caller's. Also refused: AIO contexts (io_setup: a run held 61,440 of the host's 65,536 AIO
# slots), inotify and fanotify (kernel queues outside any address-space limit: 128 inotify queues held 1 GB),
# userfaultfd, and perf_event_open (a window on the host's performance counters). Code-contest programs use none
# of them; a program that does gets PermissionError.
# On an architecture not listed here it is not installed
# (`sandbox_description` says so): under a cgroup that bounds memory all the same, without one it does not.
_SECCOMP_SYSCALLS = {  # machine: (audit arch, {name: number}); aarch64 has no inotify_init
    "x86_64": (0xC000003E, {"memfd_create": 319, "memfd_secret": 447, "socket": 41, "socketpair": 53,
                            "shmget": 29, "msgget": 68, "semget": 64, "mq_open": 240, "io_uring_setup": 425,
                            "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
                            "add_key": 248, "request_key": 249, "keyctl": 250, "perf_event_open": 298,
                            "fanotify_init": 300, "userfaultfd": 323, "io_setup": 206, "inotify_init": 253,
                            "inotify_init1": 294, "fcntl": 72}),
    "aarch64": (0xC00000B7, {"memfd_create": 279, "memfd_secret": 447, "socket": 198, "socketpair": 199,
                             "shmget": 194, "msgget": 186, "semget": 190, "mq_open": 180, "io_uring_setup": 425,
                             "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463,
                             "add_key": 217, "request_key": 218, "keyctl": 219, "perf_event_open": 241,
                             "fanotify_init": 262, "userfaultfd": 282, "io_setup": 0, "inotify_init1": 26,
                             "fcntl": 25}),
}
_PROCESS_SYSCALLS = {"x86_64": {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435},
                     "aarch64": {"clone": 220, "clone3": 435}}
_SECCOMP = r"""
import ctypes, os, struct

SECCOMP_SYSCALLS = TABLE
PROCESS_SYSCALLS = PROCESSES


def install_filter(prog):
    # prog: (code, jt, jf, k) BPF instructions over struct seccomp_data
    libc, word = ctypes.CDLL(None, use_errno=True), ctypes.c_ulong
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog), ctypes.addressof(code))
    if libc.prctl(22, word(2), ctypes.byref(fprog), word(0), word(0)) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return True


def deny_unbounded_memory():
    # Sets no_new_privs (no setuid binary gives anything back; the filter needs it), then the filter where
    # the architecture is listed (-> False where it is not).
    libc, word = ctypes.CDLL(None, use_errno=True), ctypes.c_ulong  # prctl's arguments are unsigned longs
    if libc.prctl(38, word(1), word(0), word(0), word(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if os.uname().machine not in SECCOMP_SYSCALLS:
        return False
    arch, nr = SECCOMP_SYSCALLS[os.uname().machine]
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, ENOSYS), (LD, 0, 0, 0)]  # another ABI: refused
    if os.uname().machine == "x86_64":  # x32 calls (bit 30) reach the same code under other numbers
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, ENOSYS)]
    for name, number in nr.items():
        if name != "fcntl":
            prog += [(JEQ, 0, 1, number), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 3, nr["fcntl"]), (LD, 0, 0, 24), (JEQ, 0, 1, 1031), (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)]
    return install_filter(prog)


def refuse_processes():
    # Without a cgroup: threads yes, processes no. A second filter (after deny_unbounded_memory: no_new_privs is
    # set) fails fork, vfork and a clone without CLONE_THREAD with EPERM, and clone3 with ENOSYS (its flags sit in
    # a struct a filter cannot read; libc then falls back to clone). CLONE_THREAD needs CLONE_VM: a thread shares
    # its process's address space, so one RLIMIT_AS bounds them all. -> False where the architecture is not listed.
    calls = PROCESS_SYSCALLS.get(os.uname().machine)
    if calls is None:
        return False
    LD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, SECCOMP_SYSCALLS[os.uname().machine][0]), (RET, 0, 0, ALLOW), (LD, 0, 0, 0),
            (JEQ, 0, 1, calls["clone3"]), (RET, 0, 0, ENOSYS)]
    for name in ("fork", "vfork"):  # x86_64 only (aarch64 has clone alone)
        if name in calls:
            prog += [(JEQ, 0, 1, calls[name]), (RET, 0, 0, EPERM)]
    # clone's flags: its first argument's low word (offset 16, little-endian); CLONE_THREAD is 0x10000
    prog += [(JEQ, 0, 3, calls["clone"]), (LD, 0, 0, 16), (JSET, 1, 0, 0x10000), (RET, 0, 0, EPERM),
             (RET, 0, 0, ALLOW)]
    return install_filter(prog)
""".replace("TABLE", repr(_SECCOMP_SYSCALLS), 1).replace("PROCESSES", repr(_PROCESS_SYSCALLS), 1)


# Run by the sandbox's interpreter inside the new namespaces, as (namespace) root: builds a root of
# read-only binds (system dirs, the interpreter's prefixes), a tmpfs /tmp holding the run's files,
# a minimal /dev and the namespace's own /proc; then chroot, drop to the unprivileged id, limits, exec.
_SETUP = r"""
import ctypes, json, os, resource, select, sys, traceback
cfg = json.loads(sys.argv[1])
os.set_inheritable(cfg["status_fd"], False)  # closed by the exec: the program cannot write a setup failure


def failed(kind, value, tb):  # says so on a channel of its own: an error of the sandbox, not of the program
    os.write(cfg["status_fd"], "".join(traceback.format_exception(kind, value, tb))[-2000:].encode())
    os._exit(125)


sys.excepthook = failed
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND = 1, 2, 4, 8, 32, 4096
KEEP = ((os.ST_NODEV, NODEV), (os.ST_NOEXEC, NOEXEC), (1024, 1024), (2048, 2048), (4096, 1 << 21))  # + atime


def mount(src, dst, fstype=None, flags=0, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {dst}: {os.strerror(err)}")


def bind(src, dst, writable=False):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, flags=BIND)
    # A user namespace may add read-only and nosuid but must keep what the host set (nodev, noexec, atime).
    kept = sum(ms for st, ms in KEEP if os.statvfs(dst).f_flag & st)
    mount(None, dst, flags=REMOUNT | BIND | NOSUID | kept | (0 if writable else RDONLY))


def tmpfs(dst, size_mb, inodes, mode="1777"):
    # nr_inodes: without it a million empty files held 1.5 GB of kernel memory that no size= counts
    os.makedirs(dst, exist_ok=True)
    mount("tmpfs", dst, "tmpfs", NOSUID | NODEV, f"size={size_mb}m,nr_inodes={inodes},mode={mode}")


def reachable(root, path):
    # the path as the trainer names it (a symlinked venv) resolves inside too: link its first missing part
    # that is a link; plain directories before it (e.g. a project dir under the private /tmp) are made
    parts, cur = path.strip("/").split("/"), ""
    for part in parts:
        cur += "/" + part
        if not os.path.lexists(root + cur):
            if os.path.realpath(cur) == cur:  # a plain directory: a link to itself would be a loop
                os.mkdir(root + cur)
                continue
            os.symlink(os.path.realpath(cur), root + cur)
            return


root, uid = cfg["root"], cfg["uid"]
# The root is never made here: once the pool has removed a killed worker's work dir, a setup still running
# must not make it again on the host (it would be left behind).
mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,nr_inodes=4096,mode=755")
tmpfs(root + "/tmp", cfg["tmp_mb"], cfg["tmp_inodes"])
for name in os.listdir(cfg["files"]):
    with open(os.path.join(cfg["files"], name), "rb") as src, open(f"{root}/tmp/{name}", "wb") as dst:
        dst.write(src.read())
    if not cfg["userns"]:
        os.chown(f"{root}/tmp/{name}", uid, uid)
for link, target in cfg["links"]:
    os.symlink(target, root + link)
for path in cfg["binds"]:
    bind(path, root + path)
for path in cfg["paths"]:
    reachable(root, path)
tmpfs(root + "/dev", 1, 64, "755")
for dev in ("null", "zero", "full", "random", "urandom"):
    bind("/dev/" + dev, f"{root}/dev/{dev}", writable=True)
for i, name in enumerate(("stdin", "stdout", "stderr")):
    os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
os.symlink("/proc/self/fd", root + "/dev/fd")
tmpfs(root + "/dev/shm", cfg["shm_mb"], cfg["shm_inodes"])
os.makedirs(root + "/proc")
try:  # refused where the host's /proc is partly hidden (some containers): then there is no /proc at all
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
except OSError:
    pass
mount(None, root + "/dev", flags=REMOUNT | RDONLY | NOSUID | NODEV)
mount(None, root, flags=REMOUNT | RDONLY | NOSUID | NODEV)
if cfg["userns"]:  # a nested user namespace maps us to uid 65534; made before chroot (the kernel refuses after)
    if libc.unshare(0x10000000) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} 0 1"), ("gid_map", f"{uid} 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
os.chroot(root)
os.chdir("/tmp")
os.setsid()  # kill(0, ...) must reach only the namespace, not unshare (the same uid outside, in userns mode)
for name, soft, hard in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 271, "s390x": 280}.get(os.uname().machine)
if SYS_KEYCTL:  # a session keyring of its own, empty: the caller's (PAM, systemd give one) is out of reach
    libc.syscall(ctypes.c_long(SYS_KEYCTL), ctypes.c_long(1), None)  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
if not cfg["userns"]:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    # The kernel keeps a uid's keyrings across runs (no user namespace of its own here): what an earlier run of
    # this uid left would be a channel to this one. Start them empty (KEYCTL_CLEAR of the user and user-session
    # keyrings); the seccomp filter then refuses every keyring call (persistent keyrings included).
    for keyring in (-4, -5) if SYS_KEYCTL else ():
        libc.syscall(ctypes.c_long(SYS_KEYCTL), ctypes.c_long(7), ctypes.c_long(keyring))
# The uid change cleared the parent-death signal that `unshare --kill-child` gave this process (the pid
# namespace's init: all of the run dies with it). Set it again; the caller gone before that (its end of the
# `alive` pipe closed) ends the run here.
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
if select.select([cfg["alive_fd"]], [], [], 0)[0]:
    os._exit(125)
os.close(cfg["alive_fd"])
deny_unbounded_memory()  # and no_new_privs
if cfg["refuse_processes"]:
    refuse_processes()
os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
"""


def _interpreter_paths() -> list[str]:
    """What the interpreter needs: its prefixes (a venv, its base, a conda env) and package dirs."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))]
    paths += [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    # an interpreter of a cluster's module system may find its libraries only through LD_LIBRARY_PATH
    paths += [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if os.path.isabs(p) and os.path.isdir(p)]
    return paths


def _root_layout() -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(dirs to bind read-only, (symlink, target) pairs, paths that must resolve) for the sandbox's root."""
    binds, links = [], []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            binds.append(d)
    for p in _interpreter_paths():
        real = os.path.realpath(p)
        if real != os.sep and os.path.isdir(real) and not any(real.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(real)
    binds = sorted(set(binds), key=lambda b: (b.count("/"), b))  # parents first: nested binds stay visible
    given = {os.path.abspath(p) for p in [sys.executable, *_interpreter_paths()]}
    return binds, links, sorted(given - set(binds))


def _uid_base() -> int:
    """First of 8 sandbox uids of this process. RLIMIT_NPROC counts per user, so concurrent
    sandboxes (pool workers, threads of one process) must not share a uid. No passwd entry needed."""
    return 20000 + (os.getpid() % 3750) * 8


def _acquire_uid() -> int:
    with _UID_LOCK:
        if os.getpid() not in _UID_SLOTS:
            _UID_SLOTS[os.getpid()] = queue.Queue()
            for i in range(8):
                _UID_SLOTS[os.getpid()].put(_uid_base() + i)
        slots = _UID_SLOTS[os.getpid()]
    return slots.get()  # a 9th concurrent run in one process waits for a free uid


def _release_uid(uid: int) -> None:
    _UID_SLOTS[os.getpid()].put(uid)


# ---- cgroups: one per run bounds the memory (tmpfs included) and the processes of the whole sandbox

def _cgroup_bases() -> dict[str, str]:
    """{kind: dir} under which this process may make cgroups: {"memory": .., "pids": ..} (v1) or
    {"v2": ..} where memory and pids are enabled for children; {} where it may not (not root, no
    delegation). Probed by making one."""
    try:
        with open("/proc/self/cgroup") as f:
            own = dict((line.split(":", 2)[1], line.split(":", 2)[2].strip()) for line in f if line.count(":") >= 2)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return {}
    v1, v2 = {}, None
    for fields in mounts:
        sep = fields.index("-")
        fstype, point, options = fields[sep + 1], fields[4], fields[-1].split(",")
        for kind in ("memory", "pids"):
            if fstype == "cgroup" and kind in options and kind not in v1:
                path = next((p for k, p in own.items() if kind in k.split(",")), None)
                if path is not None:
                    v1[kind] = os.path.join(point, path.lstrip("/"))
        if fstype == "cgroup2" and "" in own and v2 is None:
            v2 = os.path.join(point, own[""].lstrip("/"))
    for bases in (v1 if len(v1) == 2 else None, {"v2": v2} if v2 else None):
        if bases and _make_cgroup(bases, f"{_RUN_PREFIX}{os.getpid()}_probe", 64, 8) is not None:
            _remove_cgroup([os.path.join(b, f"{_RUN_PREFIX}{os.getpid()}_probe") for b in bases.values()])
            return bases
    return {}


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _make_cgroup(bases: dict[str, str], name: str, memory_mb: int, nproc: int) -> list[str] | None:
    made = []
    try:
        for kind, base in bases.items():
            made.append(os.path.join(base, name))
            os.mkdir(made[-1])
            if kind == "memory":
                _write(os.path.join(made[-1], "memory.limit_in_bytes"), str(memory_mb << 20))
            if kind == "pids" or kind == "v2":
                _write(os.path.join(made[-1], "pids.max"), str(nproc))
            if kind == "v2":
                _write(os.path.join(made[-1], "memory.max"), str(memory_mb << 20))
                if os.path.exists(os.path.join(made[-1], "memory.swap.max")):
                    _write(os.path.join(made[-1], "memory.swap.max"), "0")
        return made
    except OSError:
        _remove_cgroup(made)
        return None


def _remove_cgroup(dirs: list[str], timeout: float = 3.0) -> None:
    """Kill what is left in the cgroups and remove them."""
    deadline = time.monotonic() + timeout
    for d in dirs:
        while os.path.isdir(d):
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                os.rmdir(d)
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    logger.warning("could not remove sandbox cgroup %s", d)
                    break
                time.sleep(0.01)


def cleanup_sandboxes(pid: int | None = None) -> None:
    """Remove the work dirs and cgroups of sandboxes whose process is gone: all of `pid`'s (a pool
    worker just killed), or, with no pid, those of any process that no longer exists and older than
    10 minutes (a process of another pid namespace sharing this temp dir may be alive)."""
    def gone(path: str) -> bool:
        try:
            owner = int(os.path.basename(path)[len(_RUN_PREFIX):].split("_")[0])
            if pid is not None:
                return owner == pid
            if time.time() - os.stat(path).st_mtime < 600:
                return False
            os.kill(owner, 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError):  # alive (another user's), or not one of ours
            pass
        return False

    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if name.startswith(_RUN_PREFIX) and gone(os.path.join(tmp, name)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    for base in (_SANDBOX.get("cgroup") or {}).values():
        try:
            names = [os.path.join(base, n) for n in os.listdir(base) if n.startswith(_RUN_PREFIX)]
        except OSError:
            continue
        _remove_cgroup([n for n in names if gone(n)])


# ---- starting and ending a run

def _limits(timeout: float, memory_mb: int, cgroup: bool, mode: str) -> tuple[list[tuple[str, int, int]], int, int, int]:
    """(rlimits, nproc, tmp_mb, shm_mb). Under a cgroup each process may use the whole budget, which the cgroup
    bounds for all together. Without one (a sandbox mode) the program may start threads but no process
    (`refuse_processes`): the harness (a process that never runs the program's code) and the program's one process
    each get half of what the tmpfs sizes leave; in mode none (and where that filter is not known) 4 processes of a
    quarter each."""
    cpu = max(1, pymath.ceil(timeout))
    tmp_mb, shm_mb = max(1, min(_TMP_MB, memory_mb // 8)), max(1, min(_SHM_MB, memory_mb // 16))
    processes = cgroup or mode == "none" or os.uname().machine not in _PROCESS_SYSCALLS
    nproc = _NPROC_NO_CGROUP if processes and not cgroup else _NPROC
    address_space = memory_mb if cgroup else (memory_mb - tmp_mb - shm_mb) // (nproc if processes else 2)
    rlimits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", address_space << 20, address_space << 20),
               ("RLIMIT_FSIZE", _FSIZE, _FSIZE), ("RLIMIT_NOFILE", 256, 256), ("RLIMIT_CORE", 0, 0),
               ("RLIMIT_NPROC", nproc, nproc)]
    return rlimits, nproc, tmp_mb, shm_mb


def _sandbox_env(no_processes: bool = False) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if no_processes:  # a harness that forks its tests installs `refuse_processes` in each test's process itself
        env["SANDBOX_NO_PROCESSES"] = "1"
    if os.environ.get("LD_LIBRARY_PATH"):  # its directories are bound read-only (_interpreter_paths)
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def _namespace_command(mode: str, argv: list[str], workdir: str, rlimits: list, tmp_mb: int, shm_mb: int,
                       uid: int, status_fd: int, alive_fd: int, no_processes: tuple[bool, bool] = (False, False)) -> list[str]:
    binds, links, paths = _root_layout()
    cfg = {"root": os.path.join(workdir, "root"), "files": os.path.join(workdir, "files"),
           "uid": 65534 if mode == "userns" else uid, "userns": mode == "userns", "tmp_mb": tmp_mb,
           "shm_mb": shm_mb, "tmp_inodes": _TMP_INODES, "shm_inodes": _SHM_INODES, "binds": binds, "links": links,
           "paths": paths, "rlimits": rlimits, "argv": argv, "refuse_processes": no_processes[0] and not no_processes[1],
           "env": _sandbox_env(no_processes[0]), "status_fd": status_fd, "alive_fd": alive_fd}
    user = ["--user", "--map-root-user"] if mode == "userns" else []
    # pdeathsig: if our process is killed (pool timeout), unshare dies, and --kill-child takes the
    # namespace's init (the program) and with it every process in the pid namespace.
    return ["setpriv", "--pdeathsig", "KILL", "unshare", *user, "--mount", "--net", "--pid", "--ipc", "--uts",
            "--fork", "--kill-child", "--propagation", "private",
            sys.executable, "-I", "-S", "-c", _SECCOMP + _SETUP, json.dumps(cfg)]


_BWRAP_START = """
import json, os, resource, sys
fd, rlimits, argv, no_processes = json.loads(sys.argv[1])
for name, soft, hard in rlimits:
    resource.setrlimit(getattr(resource, name), (soft, hard))
deny_unbounded_memory()
if no_processes:
    refuse_processes()
os.write(fd, b"started\\n")
os.close(fd)
os.execv(argv[0], argv)
"""


def _bwrap_command(argv: list[str], workdir: str, rlimits: list, tmp_mb: int, shm_mb: int,
                   status_fd: int, no_processes: tuple[bool, bool] = (False, False)) -> list[str]:
    """The same root and namespaces built by bubblewrap (where it works and unshare does not, e.g. a
    setuid bwrap). Inside, python sets the limits, says "started" on the status descriptor, closes it
    and execs the program."""
    binds, links, paths = _root_layout()
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534", "--die-with-parent",
           "--new-session", "--clearenv"]
    for key, value in _sandbox_env(no_processes[0]).items():
        cmd += ["--setenv", key, value]
    cmd += ["--size", str(tmp_mb << 20), "--tmpfs", "/tmp", "--dev", "/dev", "--size", str(shm_mb << 20),
            "--tmpfs", "/dev/shm", "--proc", "/proc"]
    for link, target in links:
        cmd += ["--symlink", target, link]
    for path in binds:
        cmd += ["--ro-bind", path, path]
    linked = set()  # several paths (prefix, site-packages) share one link: bwrap refuses a second one
    for path in paths:  # the path as the trainer names it (a symlinked venv): link its first symlinked part
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            part = "/" + "/".join(parts[:i])
            if os.path.realpath(part) != part:
                if part not in linked and not any(part == b or part.startswith(b + "/") for b in binds):
                    cmd += ["--symlink", os.path.realpath(part), part]
                    linked.add(part)
                break
    for name in os.listdir(os.path.join(workdir, "files")):
        cmd += ["--ro-bind", os.path.join(workdir, "files", name), f"/tmp/{name}"]
    return [*cmd, "--chdir", "/tmp", "--", sys.executable, "-I", "-S", "-c", _SECCOMP + _BWRAP_START,
            json.dumps([status_fd, rlimits, argv, no_processes[0] and not no_processes[1]])]


# Mode none has no pid namespace or cgroup to end a run with, and a process group does not hold a
# program that calls setsid(). This launcher is a child subreaper (orphans below it come to it, not
# to pid 1): when the shell that waits for the program exits, or on SIGTERM (a timeout; the caller
# died: pdeathsig), it freezes everything below it with SIGSTOP (no fork can race the kill), kills
# it, reaps it, and exits with the shell's status. The program runs in a session of its own, so
# that its killpg(0) does not reach the launcher.
_REAPER = """
import ctypes, json, os, signal, sys, time
argv, caller = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
rc = 128 + signal.SIGKILL
if os.getppid() == caller:  # else the caller died before pdeathsig was set
    shell = os.fork()
    if shell == 0:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            os.setsid()
            deny_unbounded_memory()
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    running = True
    while running:
        if signal.sigwait({signal.SIGTERM, signal.SIGCHLD}) == signal.SIGTERM:
            break
        try:  # reap as they end: the shell, and orphans that came to us
            pid, status = os.waitpid(-1, os.WNOHANG)
            while pid:
                if pid == shell:
                    rc, running = os.waitstatus_to_exitcode(status), False
                    rc = 128 - rc if rc < 0 else rc
                pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            running = False


def below():
    children = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [os.getpid()]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    pids = below()
    while True:  # freeze until no new process shows up: a stopped process forks no more
        signal_all(pids, signal.SIGSTOP)
        more = set(below()) - set(pids)
        if not more:
            break
        pids += more
    signal_all(pids, signal.SIGKILL)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break  # nothing below us is left
    time.sleep(0.005)
else:
    print("unsandboxed run: processes below its launcher survived SIGKILL", file=sys.stderr)
os._exit(rc)
"""


def _tasks_of(uid: int) -> int:
    """Processes and threads whose real uid is `uid` (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Threads:")))
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            pass
    return count


def _unsandboxed_command(argv: list[str], rlimits: list) -> list[str]:
    # The program's parent is a shell that waits for it, not this process: `os.kill(os.getppid(),
    # SIGKILL)` then takes down the shell, never the trainer. The launcher (_REAPER) ends the rest.
    cmd = ["prlimit", *(f"--{name[7:].lower()}={soft}:{hard}" for name, soft, hard in rlimits),
           "sh", "-c", '"$@"; exit $?', "sh", *argv]
    return [sys.executable, "-I", "-S", "-c", _SECCOMP + _REAPER, json.dumps([cmd, os.getpid()])]


def _in_cgroup(cmd: list[str], cgroups: list[str]) -> list[str]:
    """The command, started inside the cgroups (the shell joins them, then execs it)."""
    join = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; n=$((n-1)); done'
    return ["sh", "-c", join + '; exec "$@"', "sh", str(len(cgroups)), *cgroups, *cmd]


def _sandbox_popen(argv: list[str], workdir: str, timeout: float, memory_mb: int, stdin, stdout, stderr,
                   uid: int, mode: str, pass_fds: tuple, status, harness_forks: bool = False):
    """Start `argv` sandboxed, in its own session, with workdir/files as its /tmp; returns (Popen, cgroups).
    A failure to set the sandbox up is written to `status` (a file), never by the program. Without a cgroup the
    run may start no process (`refuse_processes`, from its exec on; with `harness_forks`, argv is a harness that
    forks the program's processes and refuses them processes itself: SANDBOX_NO_PROCESSES=1 says so)."""
    cgroups = None
    if _SANDBOX.get("cgroup"):
        cgroups = _make_cgroup(_SANDBOX["cgroup"], os.path.basename(workdir), memory_mb, _NPROC)
    rlimits, nproc, tmp_mb, shm_mb = _limits(timeout, memory_mb, cgroups is not None, mode)
    no_processes = (cgroups is None and mode != "none", harness_forks)
    if mode == "none":
        # RLIMIT_NPROC counts every task of the uid, here the trainer's own (a trainer has many): the
        # program's share comes on top of those, the launcher and its shell.
        used = _tasks_of(os.getuid()) + 2
        rlimits = [(n, s + used, h + used) if n == "RLIMIT_NPROC" else (n, s, h) for n, s, h in rlimits]
        cmd, cwd, env = _unsandboxed_command(argv, rlimits), os.path.join(workdir, "files"), _sandbox_env()
        env["HOME"] = env["TMPDIR"] = cwd
    elif mode == "bwrap":
        pass_fds = (*pass_fds, status.fileno())
        cmd = _bwrap_command(argv, workdir, rlimits, tmp_mb, shm_mb, status.fileno(), no_processes)
        cwd, env = workdir, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    else:
        alive = os.pipe()  # its read end sees the end of file once this process is gone
        pass_fds = (*pass_fds, status.fileno(), alive[0])
        cmd = _namespace_command(mode, argv, workdir, rlimits, tmp_mb, shm_mb, uid, status.fileno(), alive[0],
                                 no_processes)
        cwd, env = workdir, {}
    if cgroups:
        cmd = _in_cgroup(cmd, cgroups)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                                start_new_session=True, pass_fds=pass_fds)
    finally:
        if mode in ("namespace", "userns"):
            os.close(alive[0])
    proc.alive_fd = alive[1] if mode in ("namespace", "userns") else None
    return proc, cgroups or []


def _kill_sandbox(proc: subprocess.Popen, mode: str) -> None:
    """Kill a sandboxed run and reap all of it. In the namespace modes the program is the pid
    namespace's init, a child of unshare: kill it first, so that the kernel kills and reaps the
    rest of the namespace and unshare reaps the init. Killing unshare at the same moment would
    orphan the init to this machine's pid 1, which may reap zombies only every few seconds (and a
    zombie still counts against the sandbox's RLIMIT_NPROC). In mode none the launcher (_REAPER) ends
    everything below it on SIGTERM; the session kill is for a launcher that did not."""
    if proc.poll() is None and mode == "none":
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=12)
        except subprocess.TimeoutExpired:
            pass
    elif proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                for child in f.read().split():
                    os.kill(int(child), signal.SIGKILL)
            proc.wait(timeout=5)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session: unshare, or the program and its children
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if getattr(proc, "alive_fd", None) is not None:
        os.close(proc.alive_fd)
        proc.alive_fd = None


def _wait_uid_gone(uid: int, timeout: float = 3.0) -> None:
    """After a kill, the namespace's processes die asynchronously: wait until the sandbox uid owns
    none, so that nothing outlives the call and the uid's next run starts with RLIMIT_NPROC free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                    alive = True
                    break
            except FileNotFoundError:
                pass
        if not alive:
            return
        time.sleep(0.01)
    logger.warning("sandbox processes of uid %d still alive after %.0f s", uid, timeout)


def _probe(mode: str) -> str | None:
    """None if python runs in `mode` here, else why not."""
    try:
        run = run_sandboxed({}, [sys.executable, "-c", "import os; print(os.getuid())"], timeout=10, mode=mode)
    except Exception as e:
        return str(e)[:300]
    if run["status"] == "ok" and (mode == "none" or run["stdout"].strip() not in ("", "0")):
        return None
    return f"{run['status']}: {run['stderr'].strip()[-300:]}"


def _sandbox_mode() -> str:
    """The strongest sandbox that works here, probed once per process by running python in it:
    namespace (root), userns (anyone, where unprivileged user namespaces work), else none."""
    with _SANDBOX_LOCK:
        if "mode" in _SANDBOX:
            return _SANDBOX["mode"]
        _SANDBOX["cgroup"] = _cgroup_bases()
        cleanup_sandboxes()  # what killed processes left behind
        mode, why = "none", {}
        have = shutil.which("unshare") and shutil.which("setpriv")
        for candidate in ("namespace", "userns", "bwrap"):
            if candidate == "namespace" and os.geteuid() != 0 or candidate != "bwrap" and not have:
                continue
            if candidate == "bwrap" and not (shutil.which("bwrap") and shutil.which("prlimit")):
                continue
            why[candidate] = _probe(candidate)
            if why[candidate] is None:
                mode = candidate
                break
        if mode == "none" and os.geteuid() == 0 and have:
            logger.warning("code sandbox unavailable: %s", why)
        elif mode == "none":
            logger.warning("code sandbox unavailable: %s", why or "no unshare / setpriv (util-linux)")
        _SANDBOX["mode"] = mode
        return mode


def sandbox_mode() -> str:
    """The sandbox mode model-written code runs in here (namespace, userns, bwrap; none: no isolation)."""
    return _sandbox_mode()


def sandbox_description() -> str:
    """One line for a trainer's log: the sandbox mode model-written code runs in here, and its budget."""
    mode = _sandbox_mode()
    cgroup = _SANDBOX.get("cgroup")
    budget = (f"memory and {_NPROC} processes per run bounded by a cgroup ({'v1' if 'memory' in cgroup else 'v2'})"
              if cgroup else f"no cgroup: {_NPROC_NO_CGROUP} processes with 1/{_NPROC_NO_CGROUP} of the memory each"
              if mode == "none" else "no cgroup: threads but no other process, with half of the memory (the harness "
              "the other half)")
    seccomp = ("memfd, sockets, SysV IPC, xattrs, keyrings, AIO, inotify, fanotify, userfaultfd and perf events "
               "refused (seccomp)"
               if os.uname().machine in _SECCOMP_SYSCALLS
               else f"no seccomp filter on {os.uname().machine}: memory held unmapped is bounded only by a cgroup")
    return f"code sandbox: {mode}: {_MODES[mode]}; {budget}; {seccomp}"


def _sandbox_state() -> dict:
    """What a pool worker needs to skip its own probe: the parent's mode and cgroup bases."""
    _sandbox_mode()
    return dict(_SANDBOX)


def run_sandboxed(files: dict[str, str], argv: list[str], stdin_text: str | None = None, timeout: float = 5.0,
                  memory_mb: int = 1024, max_output: int = 1 << 20, converse: Callable | None = None,
                  mode: str | None = None, pass_fds: tuple = ()) -> dict:
    """Run argv in a fresh sandbox whose /tmp (also its cwd) holds `files`, under limits; never raises for the
    program's behaviour. With `converse`, its last three arguments are the numbers of a pipe it reads requests
    from, one it writes reports to and one for its control messages, and `converse(request_fd, report_fd,
    control_fd, deadline, stdout_file, stderr_file)` talks to it while it runs (its result: "conversation"); the run ends when it returns; argv
    is then a harness that forks the program's processes (without a cgroup it refuses them processes itself).
    `pass_fds`: descriptors of this process the run inherits, under the same numbers.
    Returns {"status": ok|exit_<rc>|signal_<n>|timeout|output_limit|sandbox_error, "stdout", "stderr", "seconds",
    "conversation"}."""
    mode = mode or _sandbox_mode()
    # Named after this process, so that whoever kills it (the pool) can remove what it leaves.
    workdir = tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}_")
    uid = _acquire_uid()
    # request (read, write), report (read, write), control (read, write): the program's process gets the
    # request's read end and the report's write end; the control pipe's write end is the harness's alone
    pipes = [*os.pipe(), *os.pipe(), *os.pipe()] if converse else []

    def close(*ends: int) -> None:  # once each: a number closed twice may by then be another file's
        for end in ends:
            if pipes[end] >= 0:
                os.close(pipes[end])
                pipes[end] = -1

    try:
        os.makedirs(os.path.join(workdir, "root"))
        os.makedirs(os.path.join(workdir, "files"))
        for name, text in files.items():
            with open(os.path.join(workdir, "files", name), "w") as f:
                f.write(text)
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr, \
                tempfile.TemporaryFile() as fstatus:
            # Output goes to files, not pipes: no reader threads, no deadlock, and RLIMIT_FSIZE
            # stops a program that prints gigabytes.
            fin.write((stdin_text or "").encode())
            fin.seek(0)
            os.fchmod(fin.fileno(), 0o444)  # a program that reopens /dev/stdin runs as another uid (as root)
            # The run's ends of them one way only (stdin read-only, stdout and stderr append-only): what one test's
            # process writes there no later test of the run reads back.
            ends = [open(f"/proc/self/fd/{f.fileno()}", how) for f, how in ((fin, "rb"), (fout, "ab"), (ferr, "ab"))]
            extra = [str(pipes[0]), str(pipes[3]), str(pipes[5])] if converse else []
            t0 = time.monotonic()
            proc, cgroups = _sandbox_popen(argv + extra, workdir, timeout, memory_mb, *ends, uid, mode,
                                           pass_fds=(*pass_fds, *((pipes[0], pipes[3], pipes[5]) if converse else ())),
                                           status=fstatus,
                                           harness_forks=converse is not None)
            conversation, status = None, "timeout"
            try:
                if converse:
                    close(0, 3, 5)
                    for end in ends:
                        end.close()
                    conversation = converse(pipes[1], pipes[2], pipes[4], t0 + timeout, fout, ferr)
                    close(1, 2, 4)  # the harness reads the end of its requests (or a broken pipe) and exits
                rc = proc.wait(timeout=max(0.0, t0 + timeout - time.monotonic()))
                status = "ok" if rc == 0 else (f"signal_{-rc}" if rc < 0 else f"exit_{rc}")
            except subprocess.TimeoutExpired:
                pass
            finally:
                for end in ends:
                    end.close()
                _kill_sandbox(proc, mode)
                _remove_cgroup(cgroups)
                if status != "ok" and mode == "namespace":
                    _wait_uid_gone(uid)
            seconds = time.monotonic() - t0
            if _flooded(fout, ferr):
                status = "output_limit"
            if _failed_to_start(mode, _read(fstatus, 4000)):
                status, err = "sandbox_error", (_read(fstatus, 4000) or _read(ferr, 4000))[-2000:]
            if status != "sandbox_error":
                err = _read(ferr, 64 << 10)[-2000:]
            out = _read(fout, max_output)
        return {"status": status, "stdout": out, "stderr": err, "seconds": seconds, "conversation": conversation}
    finally:
        close(*range(len(pipes)))
        _release_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)


def _failed_to_start(mode: str, status: str) -> bool:
    """From the sandbox's own status channel: our setup wrote its error there, bwrap the program's start."""
    return bool(status) if mode in ("namespace", "userns") else mode == "bwrap" and status != "started\n"


def _empty_outputs(out, err) -> None:
    """Before each test of a run: its stdout and stderr files start empty (the run writes them in append mode), so
    neither what an earlier test wrote there nor its size reaches the next."""
    for f in (out, err):
        os.ftruncate(f.fileno(), 0)


def _flooded(out, err) -> bool:
    """Has the run's stdout or stderr reached the file-size limit (_FSIZE)?"""
    return max(os.fstat(f.fileno()).st_size for f in (out, err)) >= _FSIZE


def _read(f, limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


# ---- verdicts (judge_asserts): the contract
#
# A code test is a snippet of statements (`xs = [3, 1]`, `sort_in_place(xs)`, `assert f(2) == 4`). What is judged
# where is decided from the test's text alone, never from the program's (its imports, names, behaviour):
# - Each assert at the top level of a test is split at `and` into checks. A check that is a comparison (`==`, `!=`,
#   `<`, `is`, `in`, chains) with at least one operand that needs nothing of the program (literals, builtins and
#   math over the test's own values: an "expected" operand) is JUDGED OUTSIDE: the expected operands are evaluated
#   in this process, the others in the program's process, whole, with Python's own semantics (the program's calls,
#   methods and operators run where its objects live), and come back as plain data; the comparison is made here.
#   `abs(f(x) - 0.3) < 1e-9` and `math.isclose(f(x), 0.3)` send only f(x) there (_tolerance_form), and
#   `all(f(x) == 2 * x for x in <the test's values>)` sends only [f(x) for x in ...] (_each_form).
# - Every other check (`f(x) == g(x)`, `isinstance(f(1), P)`, `f(2)`, `not f(3)`, `x in obj` where the container
#   is the program's: its __contains__ answers), an assert that is not a top-level statement (in a loop, in a helper
#   the test defines), and a test that ends with a statement (that it ran without raising) is JUDGED INSIDE: its
#   truth is the program's process's word, which the program could forge. Such a test is scored like any other and
#   counted again in `judged_inside`, so that a user sees the exposure.
# - A test that does not parse is `unsupported`: not scored (the label's fault, the same for every program).
# Plain data is None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset and those types themselves,
# exact types only: a subclass, an instance of the program's classes, numpy, Decimal, range, a generator, a value
# that contains itself is "not plain" and equal to nothing here (its __eq__ never runs here; counted in
# `not_plain`). Nothing the program's process writes is trusted as a message: a value counts only as what it is
# (forging the right value is giving the answer), every report carries the test's nonce (lines from an earlier
# test's processes are refused), and a test is over only when the harness says so on a pipe the program's processes
# cannot reach (closed in them; the harness is not dumpable, so its /proc/<pid>/fd and ptrace are out of their
# reach whatever Yama allows). Expected operands never enter the program's process; a value the test keeps in a
# variable goes there only when a step there reads it, and once one has, every list the test made is read there
# (`ys = xs` may alias it). The builtins and modules the test's text names are, there, Python's own, taken before
# the program ran (`def abs`, `math.isclose = ...` in the program change nothing the test computes).
# Each test runs in a fresh process forked from a harness that never ran the program's code, as module __main__,
# with a fresh /tmp and /dev/shm (the harness kills what the test left and empties them before the next test), a
# read-only stdin, and stdout and stderr append-only, emptied here between tests (their size is no message either).
# Cost here (the caller's): a report is at most _MAX_BYTES bytes as it travels (UTF-8 JSON, measured by the harness
# before it sends and again here) and _MAX_NODES values; a response at most _MAX_RUN_BYTES and _MAX_RUN_NODES;
# past them the test fails as `too_large`, counted, and the channel stays usable. Decoding is linear in those
# (ints in hex; no Fraction, no arithmetic but the tolerance forms' one subtraction: only comparisons run here, each
# linear in its operands); a set or dict with more than _MAX_SAME_HASH distinct items of one hash (building it is
# quadratic) is too_large.
_MAX_NODES, _MAX_BYTES, _MAX_DEPTH = 1_000_000, 8 << 20, 400
_MAX_RUN_BYTES, _MAX_RUN_NODES = 24 << 20, 1_000_000
_MAX_SAME_HASH = 8

_HARNESS_BASE = r"""
import builtins, ctypes, json, math, os, shutil, signal, sys, types
REQ, REP, CTL = (int(a) for a in sys.argv[-3:])
SANDBOXED = IN_SANDBOX
# Not dumpable: no process of the program's (the same uid) can ptrace this one or open its /proc/<pid>/fd (the
# control pipe), whatever Yama allows. Inherited by the tests' processes: they cannot trace each other either.
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
PROGRAM = compile(open("solution.py").read(), "solution.py", "exec")  # run anew by each test's process
NO_PROCESSES = os.environ.pop("SANDBOX_NO_PROCESSES", None) == "1"
WORK = os.getcwd()


def entries(d):
    # every path below d, mount points listed but not entered (a read-only bind of the interpreter's prefix)
    found = set()
    for top, dirs, files in os.walk(d):
        found.update(os.path.join(top, n) for n in dirs + files)
        dirs[:] = [n for n in dirs if not os.path.ismount(os.path.join(top, n))]
    return found


# What /tmp held before any program ran: the run's files, and the directories that make the interpreter's paths
# reachable when they lie under /tmp (a project cloned there). A test leaves nothing beyond it.
KEEP = entries(WORK)
# Libraries the program imports whose import is slow, imported once here (never from /tmp, the program's dir),
# so that each test's process does not pay for it again.
path, sys.path = sys.path, [p for p in sys.path if p not in ("", os.getcwd(), os.path.dirname(sys.argv[0]))]
for module in PRELOAD:
    try:
        __import__(module)
    except Exception:
        pass
sys.path = path


def receive():
    # Byte by byte: what follows this line is for whoever reads next (a test's process, or the harness after it).
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(REQ, 1)
        if not byte:
            os._exit(0)
        line += byte
    try:
        return json.loads(line)
    except ValueError:  # the rest of a line a killed test's process had begun to read
        return [None, None, []]


def dump(message):
    return (json.dumps(message, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8", "surrogatepass")


def write(fd, data):
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # the caller stopped listening (its deadline, a report over its bound)
        os._exit(0)


def remove(path):
    def writable(func, p, exc):  # a directory the program made read-only is still this uid's
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, onerror=writable)
        else:
            os.unlink(path)
    except (OSError, RecursionError):
        pass


def fresh_files():
    # -> whether /tmp (and /dev/shm, in a sandbox) hold nothing a test left
    clean = True
    for d in (WORK, "/dev/shm") if SANDBOXED else (WORK,):
        kept = KEEP if d == WORK else set()
        try:
            for path in sorted(entries(d) - kept, key=len):  # a directory before what it holds
                if os.path.lexists(path):
                    remove(path)
            clean = clean and not entries(d) - kept
        except OSError:
            clean = False
    return clean


def stop_test(signum, frame):
    TIMED_OUT.append(True)
    try:
        os.kill(test, 9)
    except OSError:
        pass


TIMED_OUT, test = [], 0
signal.signal(signal.SIGALRM, stop_test)


def run_alone(body, seconds):
    # body() in a fresh process forked from this one (which never ran the program's code), within `seconds`; what it
    # started dies with it. -> its wait status, or None when it ran out of time.
    global test
    test = os.fork()
    if test == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        try:
            body()
        finally:
            os._exit(0)
    TIMED_OUT.clear()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    status = os.waitpid(test, 0)[1]
    signal.setitimer(signal.ITIMER_REAL, 0)
    if SANDBOXED:  # in a pid namespace: what the test started dies with it, before the next test
        try:
            os.kill(-1, 9)
        except OSError:
            pass
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            pass
    return None if TIMED_OUT else status
"""

# The `code` harness: each test's steps in a fresh process of it, the program run there first.
_HARNESS = r"""
MAX_BYTES, MAX_NODES, MAX_DEPTH, PER_TEST = LIMITS
# The names a test's text uses for builtins and math: Python's own, taken before any program ran.
TEST_NAMES = {k: v for k, v in builtins.__dict__.items() if not k.startswith("_")}
TEST_NAMES["__clean_import__"] = lambda name: CLEAN[name] if name in CLEAN else __import__(name, fromlist=["_"])
PLAIN_TYPES = {t: t.__name__ for t in (type(None), bool, int, float, str, bytes, list, tuple, dict, set, frozenset)}
CONTAINERS = {list: "l", tuple: "t", set: "S", frozenset: "F"}
# The modules the tests import, imported here (never from /tmp).
path, sys.path = sys.path, [p for p in sys.path if p not in ("", os.getcwd(), os.path.dirname(sys.argv[0]))]
CLEAN = {}  # the modules the tests import, as copies taken here (attributes the program assigns are not in them)
for name in ("math", *TEST_IMPORTS):
    try:
        module = __import__(name, fromlist=["_"])
        CLEAN[name] = types.ModuleType(name)
        CLEAN[name].__dict__.update(module.__dict__)
    except Exception:
        pass
TEST_NAMES["math"] = CLEAN["math"]
sys.path = path


class TooLarge(Exception):
    pass


def enc(v, budget, depth=0):
    # Plain data, exact builtin types only, read by their own C methods (no code of the program's runs here):
    # JSON scalars and strings, [tag, ...] for the rest, ["n"] for anything else. `budget`: nodes and a lower bound
    # of the bytes left (the line's exact size is checked once it is written), and the containers on the way here.
    budget[0] -= 1
    if budget[0] < 0 or budget[1] < 0 or depth > MAX_DEPTH:
        raise TooLarge
    t = type(v)
    if t is str:
        budget[1] -= len(v) + 3
        return v
    if v is None or t is bool or t is float:
        budget[1] -= 4
        return v
    if t is int:
        budget[1] -= 2 + (v.bit_length() >> 2)
        if -(1 << 53) < v < (1 << 53):
            return v
        if budget[1] < 0:
            raise TooLarge
        return ["i", format(v, "x")]
    if t is bytes:
        budget[1] -= 2 * len(v) + 6
        if budget[1] < 0:
            raise TooLarge
        return ["y", v.hex()]
    if t in CONTAINERS or t is dict:
        if len(v) > budget[0]:
            raise TooLarge
        if id(v) in budget[2]:
            return ["n"]  # a value that contains itself: no plain form
        budget[2].add(id(v))
        try:
            if t is dict:
                return ["d", *([enc(k, budget, depth + 1), enc(x, budget, depth + 1)] for k, x in list(v.items()))]
            return [CONTAINERS[t], *(enc(x, budget, depth + 1) for x in list(v))]
        finally:
            budget[2].discard(id(v))
    if t is type and v in PLAIN_TYPES:
        return ["T", PLAIN_TYPES[v]]
    return ["n"]  # not plain data: it compares equal to nothing outside


def report(nonce, values):
    # In a process of its own when one can be had: a copy of this moment's memory with no thread of the
    # program's, so nothing the program left running changes a value while it is read.
    child = -1
    try:
        child = os.fork()
    except OSError:
        pass
    if child > 0:
        os.waitpid(child, 0)
        return
    try:
        budget, out = [MAX_NODES, MAX_BYTES, set()], []  # nodes, bytes, the containers being encoded
        for kind, v in values:
            try:
                out.append(["e", v] if kind == "e" else enc(v, budget))
            except (TooLarge, RecursionError, MemoryError):
                out.append(["z"])
                budget[0] = budget[1] = -1
        data = dump([nonce, "values", out])
        if len(data) > MAX_BYTES:  # the bytes as they travel: past the bound, too large (never a cut channel)
            data = dump([nonce, "values", [["z"]] * len(values)])
        write(REP, data)
    finally:
        if child == 0:
            os._exit(0)


def run_step(source, ns, scope, mode):
    # The test's own scope holds its names (Python's builtins and math first); the program's module is the
    # globals, so the test reaches the program's names, and its functions see the test's names, as in one module.
    code = compile(source, "<test>", mode)
    if mode == "eval":
        return eval(code, ns, scope)
    exec(code, ns, scope)
    for name, value in scope.items():
        if TEST_NAMES.get(name, ns) is not value:
            ns[name] = value


def run_test(nonce):
    os.close(CTL)
    if NO_PROCESSES:  # no cgroup: threads, but no process of the program's (sandbox.py, _limits)
        refuse_processes()
    main = types.ModuleType("__main__")  # the program's module is __main__ (multiprocessing pickles by it)
    main.__file__, main.__builtins__ = os.path.join(WORK, "solution.py"), builtins
    sys.modules["__main__"] = main
    ns, scope = main.__dict__, dict(TEST_NAMES)
    try:  # a crash or sys.exit() while defining things does not skip the test
        exec(PROGRAM, ns)
    except BaseException:
        pass
    while True:
        kind, code, pre = receive()
        if kind not in ("exec", "eval"):
            return
        try:
            for source in pre:
                run_step(source, ns, scope, "exec")
            if kind == "exec":
                run_step(code, ns, scope, "exec")
                write(REP, dump([nonce, "ok"]))
                continue
        except BaseException as e:
            write(REP, dump([nonce, "raised", type(e).__name__]))
            continue
        values = []
        for source in code:
            try:
                values.append(("v", run_step(source, ns, scope, "eval")))
            except BaseException as e:
                values.append(("e", type(e).__name__))
        report(nonce, values)  # after all of the assert's calls returned: the values as the program left them


while True:
    message = receive()
    if message[0] == "test":
        nonce = str(message[1])
        run_alone(lambda: run_test(nonce), PER_TEST)
        write(CTL, dump(["done", nonce, fresh_files()]))
"""

# The `code_stdio` harness: the program run as __main__ in a fresh process of it per test, its stdin the test's
# own file (a descriptor the run was given), ended as the interpreter ends a script (non-daemon
# threads joined, atexit, flushed), its exit status told on the control pipe.
_STDIO_HARNESS = r"""
import atexit
STDINS = set(STDIN_DESCRIPTORS)  # each test's stdin, a read-only file of the caller's


def run_program(stdin):
    os.dup2(stdin, 0)
    os.closerange(3, 1 << 30)  # the pipes, every test's stdin file: none of them is the program's
    if NO_PROCESSES:  # no cgroup: threads, but no process of the program's (sandbox.py, _limits)
        refuse_processes()
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = os.path.join(WORK, "solution.py"), builtins
    sys.modules["__main__"], sys.argv, code = main, ["solution.py"], 0
    try:
        exec(PROGRAM, main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # waits for the non-daemon threads, as at a script's end
        atexit._run_exitfuncs()
    except BaseException:
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120
    os._exit(code & 0xFF)


while True:
    message = receive()
    if message[0] != "test":
        continue
    nonce, stdin = str(message[1]), message[2]
    if stdin not in STDINS:  # each of the descriptors the run was given, once
        write(CTL, dump(["done", nonce, "malformed", fresh_files()]))
        continue
    STDINS.remove(stdin)
    status = run_alone(lambda: run_program(stdin), float(message[3]))
    os.close(stdin)
    if status is None:
        status = "timeout"
    else:
        code = os.waitstatus_to_exitcode(status)
        status = "ok" if code == 0 else f"signal_{-code}" if code < 0 else f"exit_{code}"
    write(CTL, dump(["done", nonce, status, fresh_files()]))
"""


class _Raised(Exception):
    """A value that raised in the program's process (or was malformed): using it fails the check."""


class _TooLarge(_Raised):
    """A value over the bound: using it fails the check, and the test counts as too_large."""


class _NotPlain:
    """A value of a type that is not plain data: equal to nothing here (`==` and `in` are False, `<` raises)."""

    __hash__ = object.__hash__

    def __repr__(self):
        return "<not plain data>"


_SCALARS = frozenset({type(None), bool, int, float, str})  # what JSON gives as itself
_TYPES = {t.__name__: t for t in (type(None), bool, int, float, str, bytes, list, tuple, dict, set, frozenset)}


def _hash_safe(items: list, encoded: list) -> list:
    """`items`, unless more than _MAX_SAME_HASH distinct ones share a hash (ints k * (2**61 - 1) all hash alike: a set
    of them costs quadratic time). Equal items sharing a hash are cheap, and fine; distinct is told by their encoding
    (strings hash with a random key)."""
    if len(items) <= _MAX_SAME_HASH:
        return items
    hashes = list(map(hash, items))
    crowded = {h for h, n in collections.Counter(hashes).items() if n > _MAX_SAME_HASH}
    groups: dict = {}
    for h, code in zip(hashes, encoded):
        if h in crowded:
            groups.setdefault(h, set()).add(json.dumps(code))
            if len(groups[h]) > _MAX_SAME_HASH:
                raise _TooLarge("colliding hashes")
    return items


def _decode(x: Any, budget: list, depth: int = 0) -> Any:
    """A value the harness encoded, checked again here: the program may have written anything."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        raise _TooLarge("too_large")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    tag, rest = x[0], x[1:]
    if tag == "i":
        if len(rest[0]) > 2 * _MAX_BYTES:
            raise _TooLarge("too_large")
        return int(rest[0], 16)
    if tag == "y":
        return bytes.fromhex(rest[0])
    if tag in ("l", "t", "S", "F"):
        if all(map(_SCALARS.__contains__, map(type, rest))):  # the common case, without a call per item
            budget[0] -= len(rest)
            if budget[0] < 0:
                raise _TooLarge("too_large")
            items = rest
        else:
            items = [_decode(v, budget, depth + 1) for v in rest]
        if tag in ("S", "F"):
            return (set if tag == "S" else frozenset)(_hash_safe(items, rest))
        return items if tag == "l" else tuple(items)
    if tag == "d":
        if all(type(p) is list and len(p) == 2 and type(p[0]) in _SCALARS and type(p[1]) in _SCALARS for p in rest):
            budget[0] -= 2 * len(rest)
            if budget[0] < 0:
                raise _TooLarge("too_large")
            pairs = rest
        else:
            pairs = [(_decode(k, budget, depth + 1), _decode(v, budget, depth + 1)) for k, v in rest]
        return dict(zip(_hash_safe([k for k, _ in pairs], [k for k, _ in rest]), (v for _, v in pairs)))
    if tag == "T":
        return _TYPES[rest[0]]
    if tag == "n":
        return _NotPlain()
    if tag == "z":
        raise _TooLarge("too_large")
    if tag == "e":
        return _Raised(str(rest[0])[:100])
    raise ValueError("unknown tag")


def _decode_values(values: Any, run_nodes: list) -> list:
    """An assert's reported values; one that raised, is too large or is malformed reads as that failure.
    `run_nodes`: the values the response may still bring (_MAX_RUN_NODES at its start), counted down."""
    budget, out = [min(_MAX_NODES, run_nodes[0])], []
    for value in values if isinstance(values, list) else []:
        try:
            out.append(_decode(value, budget))
        except _Raised as e:
            out.append(e)
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, RecursionError, ZeroDivisionError):
            out.append(_Raised("malformed report"))
    run_nodes[0] -= min(_MAX_NODES, run_nodes[0]) - max(0, budget[0])
    return out


# What an expected operand may use: the test's own values, builtins and math, evaluated here.
_LOCAL_CALLS = {"abs": abs, "all": all, "any": any, "bin": bin, "bool": bool, "bytes": bytes, "chr": chr,
                "complex": complex, "dict": dict, "divmod": divmod, "float": float, "frozenset": frozenset,
                "hex": hex, "int": int, "len": len, "list": list, "max": max, "min": min, "oct": oct, "ord": ord,
                "repr": repr, "reversed": reversed, "round": round, "set": set, "sorted": sorted, "str": str,
                "sum": sum, "tuple": tuple, "type": type, "range": range, "enumerate": enumerate, "zip": zip,
                "map": map, "filter": filter, "True": True, "False": False, "None": None}
_LOCAL_MATH = {"isclose", "isnan", "isinf", "isfinite", "fabs", "floor", "ceil", "sqrt", "pi", "e", "inf", "nan",
               "trunc", "log", "log2", "log10", "exp", "gcd", "prod", "fsum", "factorial", "comb", "perm"}
_EXPECTED_NODES = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple, ast.List, ast.Set,
                   ast.Dict, ast.Subscript, ast.Slice, ast.Starred, ast.JoinedStr, ast.FormattedValue, ast.Constant,
                   ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.comprehension, ast.Name, ast.Call,
                   ast.Attribute, ast.keyword, ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)
_STR_METHODS = {"upper", "lower", "strip", "split", "join", "replace", "keys", "values", "items"}


def _expected_only(node: ast.expr, names: set[str]) -> bool:
    """True when `node` needs nothing of the program: literals, builtins, math, comprehensions over the test's own
    values (`names`: the names whose values this process holds)."""
    bound = {n.id for c in ast.walk(node) if isinstance(c, ast.comprehension) for n in ast.walk(c.target)
             if isinstance(n, ast.Name)}
    for n in ast.walk(node):
        if not isinstance(n, _EXPECTED_NODES):
            return False
        if isinstance(n, ast.Name) and n.id not in names | bound:
            return False
        if isinstance(n, ast.Attribute) and not (
                isinstance(n.value, ast.Name) and n.value.id == "math" and n.attr in _LOCAL_MATH and "math" in names
                or n.attr in _STR_METHODS and not isinstance(n.value, ast.Name)):
            return False
    return True


def _names_in(nodes: list) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def _bound_names(stmt: ast.stmt) -> set[str]:
    """Names a top-level statement of a test binds: assigned, defined, imported."""
    names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(stmt.name)
    elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
        names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    return names


def _conjuncts(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        return [c for v in node.values for c in _conjuncts(v)]
    return [node]


def _clean_imports(stmt: ast.stmt) -> list[ast.stmt] | None:
    """A test's top-level import as assignments from copies of the modules taken before the program ran (the
    harness's `__clean_import__`): `import numpy as np` -> `np = __clean_import__('numpy')`, `from math import
    isclose` -> `isclose = math.isclose`. None: not an import (or a relative one)."""
    out = []
    if isinstance(stmt, ast.Import):
        for a in stmt.names:
            if a.name == "math" and a.asname in (None, "math"):
                continue  # the test's math is the harness's copy already
            name, value = (a.asname, a.name) if a.asname else (a.name.split(".")[0], a.name.split(".")[0])
            out.append(f"{name} = __clean_import__({value!r})")
            if not a.asname and "." in a.name:
                out.insert(0, f"__clean_import__({a.name!r})")  # `import os.path`: the submodule is imported too
    elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level and all(a.name != "*" for a in stmt.names):
        module = "math" if stmt.module == "math" else f"__clean_import__({stmt.module!r})"
        out += [f"{a.asname or a.name} = {module}.{a.name}" for a in stmt.names]
    else:
        return None
    return [ast.parse(line).body[0] for line in out]


_MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp, ast.Call)


def _each_form(conj: ast.expr, names: set[str]) -> tuple[str, str, Any, bool] | None:
    """`all(<a> <op> <b> for <x> in <the test's values>)` (or over a list comprehension), one of a, b expected-only:
    (the source of [the program's side for each x], to run there; op; [the expected side for each x], compiled for
    here; whether the program's side is on the left). None for any other shape."""
    if not (isinstance(conj, ast.Call) and isinstance(conj.func, ast.Name) and conj.func.id == "all" and
            len(conj.args) == 1 and not conj.keywords and isinstance(conj.args[0], (ast.GeneratorExp, ast.ListComp))):
        return None
    comp = conj.args[0]
    if len(comp.generators) != 1 or comp.generators[0].ifs or comp.generators[0].is_async or not (
            isinstance(comp.elt, ast.Compare) and len(comp.elt.ops) == 1):
        return None
    gen = comp.generators[0]
    if not _expected_only(gen.iter, names):
        return None
    inner = names | {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
    sides = [comp.elt.left, comp.elt.comparators[0]]
    expected = [_expected_only(side, inner) for side in sides]
    if expected.count(True) != 1:
        return None
    program, wanted = (sides[0], sides[1]) if expected[1] else (sides[1], sides[0])
    target, iterable = ast.unparse(gen.target), ast.unparse(gen.iter)
    here = ast.parse(f"[{ast.unparse(wanted)} for {target} in {iterable}]", mode="eval")
    return (f"[{ast.unparse(program)} for {target} in {iterable}]", type(comp.elt.ops[0]).__name__,
            compile(here, "<test>", "eval"), expected[1])


def _tolerance_form(conj: ast.expr, names: set[str], iscloses: set[str]) -> tuple[ast.expr, Any] | None:
    """A float check whose expected value sits inside a call (`abs(f(x) - 0.3) < 1e-9`, `math.isclose(f(x), 0.3,
    rel_tol=...)`, `isclose(..)` after `from math import isclose`: `iscloses` names it): (the program's operand, the
    check compiled with `_v` in its place), so that only f(x) is computed there and the expected value never goes
    there. None for any other shape."""
    def split(parts: list[ast.expr]) -> int | None:  # the one part that is not expected-only
        there = [i for i, p in enumerate(parts) if not _expected_only(p, names)]
        return there[0] if len(there) == 1 else None

    if isinstance(conj, ast.Compare) and len(conj.ops) == 1 and isinstance(conj.ops[0], (ast.Lt, ast.LtE)) and \
            _expected_only(conj.comparators[0], names) and isinstance(conj.left, ast.Call) and \
            isinstance(conj.left.func, ast.Name) and conj.left.func.id == "abs" and len(conj.left.args) == 1 and \
            isinstance(conj.left.args[0], ast.BinOp) and isinstance(conj.left.args[0].op, ast.Sub):
        parts, setter = [conj.left.args[0].left, conj.left.args[0].right], "left right".split()
    elif isinstance(conj, ast.Call) and (isinstance(conj.func, ast.Attribute) and conj.func.attr == "isclose" and
                                         isinstance(conj.func.value, ast.Name) and conj.func.value.id == "math" and
                                         "math" in names or isinstance(conj.func, ast.Name) and
                                         conj.func.id in names & iscloses) and \
            len(conj.args) == 2 and all(_expected_only(k.value, names) for k in conj.keywords):
        parts, setter = conj.args, None
    else:
        return None
    k = split(parts)
    if k is None:
        return None
    operand, check = parts[k], ast.parse(ast.unparse(conj), mode="eval")
    target = check.body.left.args[0] if setter else check.body
    if setter:
        setattr(target, setter[k], ast.Name(id="_v", ctx=ast.Load()))
    else:
        target.args[k] = ast.Name(id="_v", ctx=ast.Load())
    return operand, compile(ast.fix_missing_locations(check), "<test>", "eval")


def _plan_test(test: str) -> tuple[list, list, bool] | None:
    """(steps for the program's process: [kind, source, pre], "exec" runs a statement there, "eval" reports the
    values of [sources], each after running `pre`; steps here: ("set", statement) for `name = <expected-only
    expression>`, ("check", j, checks) per top-level assert over the values of step j; whether the test is judged
    inside). None: the test does not parse. Decided from the test's text alone.

    A name set here reaches the program's process only right before the first step there that reads it (an input,
    not an expected value: `expected = 4` then `assert f(2) == expected` must not let f return `expected`). Once a
    step there has read it, the program may have changed it (an in-place contract: `sort_in_place(xs)`), so later
    operands that read it are evaluated there."""
    try:
        tree = ast.parse(test)
        source = [ast.unparse(s) for s in tree.body]
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    names = set(_LOCAL_CALLS) | {"math"}  # whose values this process holds
    steps, here, sets, set_here, inside = [], [], {}, set(), False
    iscloses = set()  # names the test gave math.isclose (`from math import isclose`)
    body = []
    for stmt, text in zip(tree.body, source):
        rewritten = _clean_imports(stmt)
        body += [(s, ast.unparse(s)) for s in rewritten] if rewritten is not None else [(stmt, text)]
    for stmt, text in body:
        if isinstance(stmt, ast.Assert):
            leaves, checks = [], []
            for conj in _conjuncts(stmt.test):
                each = _each_form(conj, names)
                if each is not None:  # `all(f(x) == 2 * x for x in [1, 2])`: [f(x) for x in [1, 2]] there only
                    program_side, op, expected, program_first = each
                    leaves.append(program_side)
                    checks.append(("each", op, len(leaves) - 1, expected, program_first))
                    if set_here & _names_in([conj]):
                        names -= set_here
                    continue
                tolerance = _tolerance_form(conj, names, iscloses)
                if tolerance is not None:  # `abs(f(x) - 0.3) < 1e-9`, `math.isclose(f(x), 0.3)`: f(x) there only
                    operand, check = tolerance
                    leaves.append(ast.unparse(operand))
                    checks.append(("here", check, len(leaves) - 1))
                    if set_here & _names_in([operand]):
                        names -= set_here
                    continue
                if isinstance(conj, ast.Compare):
                    operands, trial, kinds = [conj.left, *conj.comparators], set(names), []
                    for operand in operands:  # in Python's order: a program operand may change a name for the next
                        kinds.append("here" if _expected_only(operand, trial) else "there")
                        if kinds[-1] == "there" and set_here & _names_in([operand]):
                            trial -= set_here  # read there: its value, and any alias's, may change there
                    # `x in obj`: the container's own __contains__ answers (a class of the program's): inside
                    contains = any(isinstance(op, (ast.In, ast.NotIn)) and kinds[i + 1] == "there"
                                   for i, op in enumerate(conj.ops))
                    if "here" in kinds and not contains:
                        names, entries = trial, []
                        for operand, kind in zip(operands, kinds):
                            if kind == "here":
                                code = compile(ast.fix_missing_locations(ast.Expression(operand)), "<test>", "eval")
                                entries.append(("here", code))
                            else:
                                leaves.append(ast.unparse(operand))
                                entries.append(("there", len(leaves) - 1))
                        checks.append(("compare", [type(op).__name__ for op in conj.ops], entries))
                        continue
                leaves.append(f"(True if ({ast.unparse(conj)}) else False)")
                if set_here & _names_in([conj]):
                    names -= set_here
                checks.append(("inside", len(leaves) - 1))
                inside = True
            steps.append(["eval", leaves, []])
            here.append(("check", len(steps) - 1, checks))
            continue
        inside = inside or any(isinstance(n, ast.Assert) for n in ast.walk(stmt))  # in a loop, a helper
        steps.append(["exec", text, []])
        simple = isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
        if simple and _expected_only(stmt.value, names):
            name = stmt.targets[0].id
            if ast.unparse(stmt.value) == "math.isclose":
                iscloses.add(name)
            else:
                iscloses.discard(name)
            here.append(("set", compile(ast.Module([stmt], []), "<test>", "exec")))
            names.add(name)
            set_here.discard(name)
            if any(isinstance(n, _MUTABLE_NODES) or isinstance(n, ast.Name) and n.id in set_here
                   for n in ast.walk(stmt.value)):  # a list, dict, set (or an alias of one): a call may change it
                set_here.add(name)
            sets[len(steps) - 1] = name
            continue
        if set_here & _names_in([stmt]):  # a list the test made, read there: it (and `ys = xs`) may change there
            names -= set_here
        names -= _bound_names(stmt)
        set_here -= _bound_names(stmt)
    if not body or not isinstance(body[-1][0], ast.Assert):
        inside = True  # that its last statements ran without raising is the program's process's word
    _defer_sets(steps, sets)
    return steps, here, inside


def _defer_sets(steps: list, sets: dict[int, str]) -> None:
    """Move each expected-only assignment to the `pre` of the first later step there that reads its name (drop it
    where a step rebinds the name first, or none reads it)."""
    for k, name in reversed(list(sets.items())):  # the last first: an earlier one may be read by its source
        source, steps[k] = steps[k][1], ["exec", "pass", []]
        for step in steps[k + 1:]:
            trees = [ast.parse(s) for s in [*step[2], *(step[1] if step[0] == "eval" else [step[1]])]]
            if any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                   for t in trees for n in ast.walk(t)):
                step[2].insert(0, source)
                break
            if any(name in _bound_names(stmt) for t in trees[len(step[2]):] for stmt in t.body):
                break


_COMPARE = {"Eq": lambda a, b: a == b, "NotEq": lambda a, b: a != b, "Lt": lambda a, b: a < b,
            "LtE": lambda a, b: a <= b, "Gt": lambda a, b: a > b, "GtE": lambda a, b: a >= b,
            "Is": lambda a, b: a is b, "IsNot": lambda a, b: a is not b, "In": lambda a, b: a in b,
            "NotIn": lambda a, b: a not in b}


def _check_namespace() -> dict:
    """Where a test's expected operands are evaluated: builtins and math, never the program's."""
    return {"__builtins__": {}, "math": pymath, **_LOCAL_CALLS}


def _judge(checks: list, values: list, namespace: dict) -> str:
    """-> "pass", "fail", "too_large" or "not_plain" for one assert's checks on its reported values."""
    verdict = "pass"
    for check in checks:
        try:
            if check[0] == "here":  # a float check computed here on the program's plain value (_tolerance_form)
                value = values[check[2]]
                if isinstance(value, _Raised):
                    raise value
                if type(value) not in (int, float, complex):  # plain numbers only: no arithmetic on the rest
                    return "not_plain" if isinstance(value, _NotPlain) else "fail"
                if eval(check[1], {**namespace, "_v": value}) is not True:
                    return "fail"
                continue
            if check[0] == "each":  # _each_form: the program's side for each item, against the expected side's
                _, op, k, code, program_first = check
                got, wanted = values[k], eval(code, namespace)
                if isinstance(got, _Raised):
                    raise got
                if type(got) is not list or len(got) != len(wanted):
                    return "not_plain" if isinstance(got, _NotPlain) else "fail"
                for a, b in zip(got, wanted) if program_first else zip(wanted, got):
                    if _COMPARE[op](a, b) is not True:
                        return "not_plain" if isinstance(a if program_first else b, _NotPlain) else "fail"
                continue
            if check[0] == "inside":
                value = values[check[1]]
                if isinstance(value, _Raised):
                    raise value
                if value is not True:
                    return "fail"
                continue
            operands = []
            for where, what in check[2]:
                operands.append(eval(what, namespace) if where == "here" else values[what])
                if isinstance(operands[-1], _Raised):
                    raise operands[-1]
            for op, left, right in zip(check[1], operands, operands[1:]):
                if _COMPARE[op](left, right) is not True:
                    return "not_plain" if any(isinstance(v, _NotPlain) for v in operands) else "fail"
        except _TooLarge:
            return "too_large"
        except Exception:  # raised there, or here (a test-only operand that raises, `<` on what is not plain)
            return "not_plain" if any(isinstance(v, _NotPlain) for v in values) else "fail"
    return verdict


class _Channel:
    """The caller's ends of the conversation with the harness: requests out; reports (from a test's process: any line
    may be the program's) and control lines (the harness's alone) in. Every wait is bounded by the run's deadline,
    a line by _MAX_BYTES, all of them together by _MAX_RUN_BYTES (past it: closed, too_large)."""

    def __init__(self, req: int, rep: int, ctl: int, deadline: float):
        self.req, self.rep, self.ctl, self.deadline = req, rep, ctl, deadline
        self.pending, self.scanned = {rep: bytearray(), ctl: bytearray()}, {rep: 0, ctl: 0}
        self.received, self.closed, self.too_large, self.dirty = 0, False, False, False
        self.nodes = [_MAX_RUN_NODES]  # values decoded in this response, counted down (_decode_values)
        for fd in (req, rep, ctl):
            os.set_blocking(fd, False)

    def send(self, message: list) -> bool:
        data = (json.dumps(message) + "\n").encode()
        while data and not self.closed:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.req], [], left)[1]:
                self.closed = True
                break
            try:
                data = data[os.write(self.req, data):]
            except BlockingIOError:
                continue
            except OSError:
                self.closed = True
        return not self.closed

    def _read(self, fd: int) -> int:
        """Bytes read (0: none there now; -1: the end of the pipe)."""
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return 0
        except OSError:
            chunk = b""
        self.pending[fd] += chunk
        self.received += len(chunk)
        return len(chunk) or -1

    def _line(self, fd: int) -> Any:
        end = self.pending[fd].find(b"\n", self.scanned[fd])  # only the bytes not looked at yet: linear time
        if end < 0:
            self.scanned[fd] = len(self.pending[fd])
            return None
        line = bytes(self.pending[fd][:end])
        del self.pending[fd][:end + 1]
        self.scanned[fd] = 0
        try:
            return json.loads(line.decode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError):
            return ["malformed"]

    def next(self) -> tuple[str, Any] | None:
        """("report", line) or ("control", line), reports first; None: the harness is gone, or the run ran out of
        time or bytes."""
        while not self.closed:
            line = self._line(self.rep)
            if line is not None:
                return "report", line
            if len(self.pending[self.rep]) > _MAX_BYTES + 4096 or self.received > _MAX_RUN_BYTES:
                self.closed = self.too_large = True
                break
            line = self._line(self.ctl)
            if line is not None:
                while self._read(self.rep) > 0 and len(self.pending[self.rep]) <= _MAX_BYTES + 4096:
                    pass  # what the test wrote before it ended is read before the harness's word that it did
                if b"\n" in self.pending[self.rep]:
                    self.pending[self.ctl][:0] = json.dumps(line).encode() + b"\n"
                    self.scanned[self.ctl] = 0
                    continue
                return "control", line
            left = self.deadline - time.monotonic()
            ready = select.select([self.rep, self.ctl], [], [], left)[0] if left > 0 else []
            if not ready:
                self.closed = True
            for fd in (self.rep, self.ctl):
                if fd in ready and self._read(fd) < 0 and fd == self.ctl:
                    self.closed = True  # the harness is gone (its control pipe's only writer)
        return None


def _run_test(plan: tuple, channel: _Channel) -> str:
    """One test in a fresh process of the harness: its steps one at a time, each judged as its report comes.
    -> "pass", "fail", "too_large" or "not_plain"."""
    steps, here, _ = plan
    nonce = secrets.token_hex(16)
    namespace, h, verdict, ended = _check_namespace(), 0, "pass", None
    if channel.dirty or not channel.send(["test", nonce]):
        return "too_large" if channel.too_large else "fail"
    for kind, code, pre in steps:
        if kind == "exec" and code == "pass" and not pre:
            continue
        got = channel.next() if channel.send([kind, code, pre]) else None
        if got is None or got[0] == "control":  # the test's process ended, or the run did
            ended = got
            verdict = "too_large" if channel.too_large else "fail"
            break
        report = got[1]
        if not isinstance(report, list) or report[:1] != [nonce]:  # not this test's: the program's writing
            verdict = "fail"
            break
        if kind == "exec":
            if report[1:] != ["ok"]:  # every failed step fails its test
                verdict = "fail"
                break
            continue
        values = _decode_values(report[2], channel.nodes) if report[1:2] == ["values"] and len(report) == 3 else []
        while h < len(here) and here[h][0] == "set":
            exec(here[h][1], namespace)  # the test's own constant, e.g. `expected = [1, 2]`
            h += 1
        verdict = _judge(here[h][2], values, namespace) if len(values) == len(steps[here[h][1]][1]) else "fail"
        h += 1
        if verdict != "pass":
            break
    got = ended
    if not ended:
        channel.send(["end", None, []])
        while (got := channel.next()) is not None and got[0] != "control":
            pass  # what the test's process still writes: nothing after its last step counts
    if got is None or got[1][:2] != ["done", nonce]:
        return "too_large" if channel.too_large else "fail"
    channel.dirty = got[1][2:] != [True]  # files a test left that the harness could not remove: no later test runs
    return verdict


def judgeable(test: str) -> bool:
    """Whether `test` can be judged at all (it parses; a dataset check before training)."""
    return _plan_test(test) is not None


_SLOW_LIBRARIES = frozenset({"numpy", "scipy", "sympy", "pandas", "networkx", "sortedcontainers"})


def _slow_imports(program: str) -> list[str]:
    """The slow-to-import libraries the program imports at its top level (the harness imports them once)."""
    try:
        body = ast.parse(program).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    names = [a.name for n in body if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in body if isinstance(n, ast.ImportFrom) and n.module and not n.level]
    return sorted({name.split(".")[0] for name in names} & _SLOW_LIBRARIES)


def _harness(main: str, program: str, mode: str) -> str:
    """A harness's source: the seccomp functions, the shared part, then its own `main`."""
    return _SECCOMP + _HARNESS_BASE.replace("IN_SANDBOX", repr(mode != "none"), 1).replace(
        "PRELOAD", repr(_slow_imports(program)), 1) + main


def _test_imports(plans: list) -> list[str]:
    """The modules the tests import (the harness copies them before any program runs)."""
    found = set()
    for plan in plans:
        for step in plan[0] if plan else []:
            for source in [*step[2], *(step[1] if step[0] == "eval" else [step[1]])]:
                found.update(re.findall(r"__clean_import__\('([\w.]+)'\)", source))
    return sorted(found)


def judge_asserts(program: str, tests: list[str], timeout: float, memory_mb: int) -> dict:
    """Run `program` in a sandbox, each of `tests` in a fresh process of it, and judge each test by the contract
    above. Returns {"passed", "judged", "judged_inside", "unsupported", "too_large", "not_plain", "status",
    "seconds", "stderr"}; status "sandbox_error" when the sandbox could not start (nothing was judged)."""
    plans = [_plan_test(t) for t in tests]
    verdict = {"passed": 0, "judged": sum(plan is not None for plan in plans),
               "judged_inside": sum(plan is not None and plan[2] for plan in plans),
               "unsupported": sum(plan is None for plan in plans), "too_large": 0, "not_plain": 0,
               "status": "unsupported", "seconds": 0.0, "stderr": ""}
    if not verdict["judged"]:
        return verdict
    mode = sandbox_mode()
    harness = _harness(_HARNESS.replace("LIMITS", repr((_MAX_BYTES, _MAX_NODES, _MAX_DEPTH, float(timeout))), 1).replace(
        "TEST_IMPORTS", repr(_test_imports(plans)), 1), program, mode)

    flooded = []

    def converse(req: int, rep: int, ctl: int, deadline: float, out, err) -> list[str]:
        channel, results = _Channel(req, rep, ctl, deadline), []
        for plan in plans:
            _empty_outputs(out, err)
            results.append(_run_test(plan, channel) if plan else "unsupported")
            if _flooded(out, err):
                flooded.append(True)
        return results

    run = run_sandboxed({"solution.py": program, "harness.py": harness}, [sys.executable, "harness.py"],
                        timeout=timeout, memory_mb=memory_mb, converse=converse, mode=mode)
    verdict.update(status=run["status"], seconds=round(run["seconds"], 3), stderr=run["stderr"][-500:])
    results = run.get("conversation") or [] if run["status"] != "output_limit" and not flooded else []  # a flood fails all
    verdict.update(passed=results.count("pass"), too_large=results.count("too_large"),
                   not_plain=results.count("not_plain"))
    if verdict["judged_inside"]:
        logger.info("code: %d of %d tests judged inside the program's process (their verdict is its word)",
                    verdict["judged_inside"], verdict["judged"])
    return verdict


def _same_tokens(out: str, expected: str) -> bool:
    """Whitespace-separated tokens equal, compared one pair at a time (no list of millions of tokens here)."""
    pairs = itertools.zip_longest(re.finditer(r"\S+", out), re.finditer(r"\S+", expected))
    return all(a is not None and b is not None and a.group() == b.group() for a, b in pairs)


_STDIO_BATCH = 128  # tests per sandbox run: their stdin files are descriptors it is given


def run_stdio_tests(program: str, tests: list[tuple[str, str]], timeout: float, memory_mb: int,
                    budget: float | None) -> dict:
    """Run `program` once per (stdin, expected stdout) test, _STDIO_BATCH tests to a sandbox: each test in a fresh
    process forked from a harness that never ran the program's code, with a fresh /tmp and /dev/shm (as
    `judge_asserts`) and its stdin a read-only file of its own, within `timeout` seconds each and `budget` seconds in
    all (tests not reached fail, status "budget"); stdout, all of it up to the file-size limit (_FSIZE, 16 MB a test;
    past it the test fails with status "output_limit"), compared token by token here. Returns {"passed", "statuses",
    "status"}, status "sandbox_error" (with "stderr") when the sandbox could not start."""
    mode, statuses = sandbox_mode(), []
    deadline = time.monotonic() + (budget or timeout * len(tests) + 10)
    for start in range(0, len(tests), _STDIO_BATCH):
        batch = tests[start:start + _STDIO_BATCH]
        if deadline - time.monotonic() < 0.2:
            statuses += ["budget"] * len(batch)
            continue
        run = _stdio_batch(program, batch, timeout, memory_mb, deadline, mode)
        if run["status"] == "sandbox_error":
            return {"passed": 0, "statuses": statuses, "status": "sandbox_error", "stderr": run["stderr"][-500:]}
        statuses += run["conversation"] or ["budget"] * len(batch)
    return {"passed": statuses.count("pass"), "statuses": statuses, "status": "ok"}


def _stdio_batch(program: str, tests: list[tuple[str, str]], timeout: float, memory_mb: int, deadline: float,
                 mode: str) -> dict:
    """One sandbox run of `tests` (run_stdio_tests); its "conversation" holds their statuses."""
    stdins = []
    for stdin_text, _ in tests:  # each a file here, given to the run read-only (a seekable file, as a shell gives)
        with tempfile.TemporaryFile() as f:
            f.write((stdin_text or "").encode())
            f.flush()
            os.fchmod(f.fileno(), 0o444)  # a program that reopens /dev/stdin runs as another uid (as root)
            stdins.append(os.open(f"/proc/self/fd/{f.fileno()}", os.O_RDONLY))

    def converse(req: int, rep: int, ctl: int, deadline: float, out, err) -> list[str]:
        channel, statuses = _Channel(req, rep, ctl, deadline), []
        for (_, expected), stdin in zip(tests, stdins):
            _empty_outputs(out, err)
            remaining, nonce = deadline - time.monotonic(), secrets.token_hex(16)
            if remaining < 0.2 or not channel.send(["test", nonce, stdin, min(timeout, remaining - 0.1)]):
                statuses.append("budget")
                continue
            while (got := channel.next()) is not None and got[0] != "control":
                pass  # the report pipe carries nothing here: the program's processes never hold it
            if got is None or got[1][:2] != ["done", nonce] or len(got[1]) != 4:
                statuses.append("timeout")
                continue
            status = str(got[1][2])
            if _flooded(out, err):
                status = "output_limit"
            elif status == "ok" and _same_tokens(os.pread(out.fileno(), _FSIZE, 0).decode(errors="replace"), expected):
                status = "pass"
            statuses.append(status)
        return statuses

    harness = _harness(_STDIO_HARNESS.replace("STDIN_DESCRIPTORS", repr(stdins), 1), program, mode)
    try:
        return run_sandboxed({"solution.py": program, "harness.py": harness}, [sys.executable, "harness.py"],
                             timeout=max(0.0, deadline - time.monotonic()), memory_mb=memory_mb, converse=converse,
                             mode=mode, pass_fds=tuple(stdins))
    finally:
        for fd in stdins:
            os.close(fd)
