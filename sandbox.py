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
(tmpfs included) and processes of the whole sandbox to `memory_mb` and 64; without one, 4 processes of a quarter
of the budget each (an address-space limit). In every mode a seccomp filter makes the calls that hold memory no
address-space limit counts (memfd, sockets, SysV / POSIX shared memory and message queues, io_uring,
F_SETPIPE_SZ) fail with EPERM (`_SECCOMP`). With no usable namespaces (mode "none") the code verifiers refuse to
run unless `allow_unsandboxed_code`; then the program runs as the caller, unisolated, below a launcher that is a
child subreaper and kills everything below it when the program ends, times out or the caller dies (setsid and
double forks included; running as the caller, a hostile program can still kill the launcher, or the caller).
`sandbox_description()` says which mode this machine gets.

Verdicts (`judge_asserts`). The sandbox only reports the values of the parts of each assert that need the
program (`f(2)` of `assert f(2) == 4`) and this process compares them with the real builtins and math, so
exiting early, forging output, patching builtins or `__eq__` cannot pass a test. Nothing the judge needs is in
the program's process before its own calls have returned: this process sends one step at a time, each test runs
in a process of its own forked from a harness that never ran the program's code, and a test's expected values go
there only right before a later step that reads them. Every step that raises fails its test; values are read
after the assert's calls returned, from a copy of the process with no thread of the program's; a test's list the
program was given is judged as the program left it (an in-place contract). Values travel as data (ints of any
size in hex, containers, Fractions, numpy values, the program's own classes as their attributes), at most
_MAX_BYTES / _MAX_NODES per assert: past it a counted `too_large` failure. What judging them may cost this
process is bounded before each operation starts (see the rule at _MAX_NODES). Tests that cannot be judged that
way, because their asserts are not top-level statements (inside a loop or a function) or because a verdict would
need a value that is not the program's answer computed in the sandbox (a comparison inside a comprehension, a
helper the test defines, an expected value built with an imported class), are not judged: "unsupported" counts
them. For stdio tests (`run_stdio_tests`) this process compares stdout token by token, all of it up to the
16 MB file-size limit (past it: status "output_limit", counted).
"""

import ast
import builtins
import collections
import dataclasses
import fractions
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
import types
from typing import Any, Callable

logger = logging.getLogger("verifiers")


_SANDBOX: dict = {}  # {"mode": one of _MODES, "cgroup": {kind: base dir} or {}}, probed once per process
_SANDBOX_LOCK = threading.Lock()
_UID_LOCK = threading.Lock()
_UID_SLOTS: dict[int, queue.Queue] = {}  # pid -> free sandbox uids
_FSIZE = 16 << 20  # bytes a program may write to one file (its stdout included)
_NPROC = 64  # processes + threads of one sandbox whose memory a cgroup bounds together
_NPROC_NO_CGROUP = 4  # without a cgroup each process may use 1/4 of the budget, so that 4 fill it
_TMP_MB, _SHM_MB = 64, 16  # its /tmp (the work directory) and /dev/shm: tmpfs, part of the memory budget
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
# one inherited is the caller's. Code-contest programs use none of them; a program that does gets PermissionError.
# On an architecture not listed here it is not installed
# (`sandbox_description` says so): under a cgroup that bounds memory all the same, without one it does not.
_SECCOMP_SYSCALLS = {  # machine: (audit arch, {name: number}); the same names on each
    "x86_64": (0xC000003E, {"memfd_create": 319, "memfd_secret": 447, "socket": 41, "socketpair": 53,
                            "shmget": 29, "msgget": 68, "semget": 64, "mq_open": 240, "io_uring_setup": 425,
                            "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
                            "add_key": 248, "request_key": 249, "keyctl": 250, "fcntl": 72}),
    "aarch64": (0xC00000B7, {"memfd_create": 279, "memfd_secret": 447, "socket": 198, "socketpair": 199,
                             "shmget": 194, "msgget": 186, "semget": 190, "mq_open": 180, "io_uring_setup": 425,
                             "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463,
                             "add_key": 217, "request_key": 218, "keyctl": 219, "fcntl": 25}),
}
_SECCOMP = r"""
import ctypes, os, struct

SECCOMP_SYSCALLS = TABLE


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
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog), ctypes.addressof(code))
    if libc.prctl(22, word(2), ctypes.byref(fprog), word(0), word(0)) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return True
""".replace("TABLE", repr(_SECCOMP_SYSCALLS), 1)


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


def tmpfs(dst, size_mb, mode="1777"):
    os.makedirs(dst, exist_ok=True)
    mount("tmpfs", dst, "tmpfs", NOSUID | NODEV, f"size={size_mb}m,mode={mode}")


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
mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
tmpfs(root + "/tmp", cfg["tmp_mb"])
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
tmpfs(root + "/dev", 1, "755")
for dev in ("null", "zero", "full", "random", "urandom"):
    bind("/dev/" + dev, f"{root}/dev/{dev}", writable=True)
for i, name in enumerate(("stdin", "stdout", "stderr")):
    os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
os.symlink("/proc/self/fd", root + "/dev/fd")
tmpfs(root + "/dev/shm", cfg["shm_mb"])
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

def _limits(timeout: float, memory_mb: int, cgroup: bool) -> tuple[list[tuple[str, int, int]], int, int, int]:
    """(rlimits, nproc, tmp_mb, shm_mb). Under a cgroup each process may use the whole budget, which
    the cgroup bounds for all together; without one, nproc x RLIMIT_AS + the tmpfs sizes = the budget."""
    cpu = max(1, pymath.ceil(timeout))
    tmp_mb, shm_mb = max(1, min(_TMP_MB, memory_mb // 8)), max(1, min(_SHM_MB, memory_mb // 16))
    nproc = _NPROC if cgroup else _NPROC_NO_CGROUP
    address_space = memory_mb if cgroup else (memory_mb - tmp_mb - shm_mb) // nproc
    rlimits = [("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", address_space << 20, address_space << 20),
               ("RLIMIT_FSIZE", _FSIZE, _FSIZE), ("RLIMIT_NOFILE", 256, 256), ("RLIMIT_CORE", 0, 0),
               ("RLIMIT_NPROC", nproc, nproc)]
    return rlimits, nproc, tmp_mb, shm_mb


def _sandbox_env() -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if os.environ.get("LD_LIBRARY_PATH"):  # its directories are bound read-only (_interpreter_paths)
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def _namespace_command(mode: str, argv: list[str], workdir: str, rlimits: list, tmp_mb: int, shm_mb: int,
                       uid: int, status_fd: int, alive_fd: int) -> list[str]:
    binds, links, paths = _root_layout()
    cfg = {"root": os.path.join(workdir, "root"), "files": os.path.join(workdir, "files"),
           "uid": 65534 if mode == "userns" else uid, "userns": mode == "userns", "tmp_mb": tmp_mb,
           "shm_mb": shm_mb, "binds": binds, "links": links, "paths": paths, "rlimits": rlimits, "argv": argv,
           "env": _sandbox_env(), "status_fd": status_fd, "alive_fd": alive_fd}
    user = ["--user", "--map-root-user"] if mode == "userns" else []
    # pdeathsig: if our process is killed (pool timeout), unshare dies, and --kill-child takes the
    # namespace's init (the program) and with it every process in the pid namespace.
    return ["setpriv", "--pdeathsig", "KILL", "unshare", *user, "--mount", "--net", "--pid", "--ipc", "--uts",
            "--fork", "--kill-child", "--propagation", "private",
            sys.executable, "-I", "-S", "-c", _SECCOMP + _SETUP, json.dumps(cfg)]


_BWRAP_START = """
import json, os, resource, sys
fd, rlimits, argv = json.loads(sys.argv[1])
for name, soft, hard in rlimits:
    resource.setrlimit(getattr(resource, name), (soft, hard))
deny_unbounded_memory()
os.write(fd, b"started\\n")
os.close(fd)
os.execv(argv[0], argv)
"""


def _bwrap_command(argv: list[str], workdir: str, rlimits: list, tmp_mb: int, shm_mb: int,
                   status_fd: int) -> list[str]:
    """The same root and namespaces built by bubblewrap (where it works and unshare does not, e.g. a
    setuid bwrap). Inside, python sets the limits, says "started" on the status descriptor, closes it
    and execs the program."""
    binds, links, paths = _root_layout()
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534", "--die-with-parent",
           "--new-session", "--clearenv"]
    for key, value in _sandbox_env().items():
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
            json.dumps([status_fd, rlimits, argv])]


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
                   uid: int, mode: str, pass_fds: tuple, status):
    """Start `argv` sandboxed, in its own session, with workdir/files as its /tmp; returns (Popen, cgroups).
    A failure to set the sandbox up is written to `status` (a file), never by the program."""
    cgroups = None
    if _SANDBOX.get("cgroup"):
        cgroups = _make_cgroup(_SANDBOX["cgroup"], os.path.basename(workdir), memory_mb, _NPROC)
    rlimits, nproc, tmp_mb, shm_mb = _limits(timeout, memory_mb, cgroups is not None)
    if mode == "none":
        # RLIMIT_NPROC counts every task of the uid, here the trainer's own (a trainer has many): the
        # program's share comes on top of those, the launcher and its shell.
        used = _tasks_of(os.getuid()) + 2
        rlimits = [(n, s + used, h + used) if n == "RLIMIT_NPROC" else (n, s, h) for n, s, h in rlimits]
        cmd, cwd, env = _unsandboxed_command(argv, rlimits), os.path.join(workdir, "files"), _sandbox_env()
        env["HOME"] = env["TMPDIR"] = cwd
    elif mode == "bwrap":
        pass_fds = (*pass_fds, status.fileno())
        cmd = _bwrap_command(argv, workdir, rlimits, tmp_mb, shm_mb, status.fileno())
        cwd, env = workdir, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    else:
        alive = os.pipe()  # its read end sees the end of file once this process is gone
        pass_fds = (*pass_fds, status.fileno(), alive[0])
        cmd = _namespace_command(mode, argv, workdir, rlimits, tmp_mb, shm_mb, uid, status.fileno(), alive[0])
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
              if cgroup else f"no cgroup: {_NPROC_NO_CGROUP} processes with 1/{_NPROC_NO_CGROUP} of the memory each")
    seccomp = ("memfd, sockets, SysV IPC, xattrs and keyrings refused (seccomp)"
               if os.uname().machine in _SECCOMP_SYSCALLS
               else f"no seccomp filter on {os.uname().machine}: memory held unmapped is bounded only by a cgroup")
    return f"code sandbox: {mode}: {_MODES[mode]}; {budget}; {seccomp}"


def _sandbox_state() -> dict:
    """What a pool worker needs to skip its own probe: the parent's mode and cgroup bases."""
    _sandbox_mode()
    return dict(_SANDBOX)


def run_sandboxed(files: dict[str, str], argv: list[str], stdin_text: str | None = None, timeout: float = 5.0,
                  memory_mb: int = 1024, max_output: int = 1 << 20, converse: Callable | None = None,
                  mode: str | None = None) -> dict:
    """Run argv in a fresh sandbox whose /tmp (also its cwd) holds `files`, under limits; never raises for the
    program's behaviour. With `converse`, its last two arguments are the numbers of a pipe it reads requests from
    and one it writes reports to, and `converse(request_fd, report_fd, deadline)` talks to it while it runs (its
    result: "conversation"); the run ends when it returns. Returns {"status": ok|exit_<rc>|signal_<n>|timeout|
    output_limit|sandbox_error, "stdout", "stderr", "seconds", "conversation"}."""
    mode = mode or _sandbox_mode()
    # Named after this process, so that whoever kills it (the pool) can remove what it leaves.
    workdir = tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}_")
    uid = _acquire_uid()
    pipes = [*os.pipe(), *os.pipe()] if converse else []  # request: read, write; report: read, write

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
            extra = [str(pipes[0]), str(pipes[3])] if converse else []
            t0 = time.monotonic()
            proc, cgroups = _sandbox_popen(argv + extra, workdir, timeout, memory_mb, fin, fout, ferr, uid, mode,
                                           pass_fds=(pipes[0], pipes[3]) if converse else (), status=fstatus)
            conversation, status = None, "timeout"
            try:
                if converse:
                    close(0, 3)
                    conversation = converse(pipes[1], pipes[2], t0 + timeout)
                    close(1, 2)  # the harness reads the end of its requests (or a broken pipe) and exits
                rc = proc.wait(timeout=max(0.0, t0 + timeout - time.monotonic()))
                status = "ok" if rc == 0 else (f"signal_{-rc}" if rc < 0 else f"exit_{rc}")
            except subprocess.TimeoutExpired:
                pass
            finally:
                _kill_sandbox(proc, mode)
                _remove_cgroup(cgroups)
                if status != "ok" and mode == "namespace":
                    _wait_uid_gone(uid)
            seconds = time.monotonic() - t0
            if max(fout.seek(0, os.SEEK_END), ferr.seek(0, os.SEEK_END)) >= _FSIZE:
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


def _read(f, limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


# The tests' verdicts are decided here, not in the program's interpreter (which the program owns: it can read
# the harness, patch builtins or __eq__, exit early, forge any line it writes). The sandbox only evaluates the
# parts of each `assert` that depend on the program (`f(2)` of `assert f(2) == 4`) and reports their values as
# data; this process evaluates the rest (`_v0 == 4`) on them (`_check_test`). What the judge needs never enters
# the program's process before the program's own calls have returned: the harness holds no test; this process
# sends one step at a time and the next only after the last one's report; each test runs in a fresh process
# forked from the harness before the program's code ran (so no test's inputs meet another's), which then kills
# what the test left; a test's expected values are sent only where a later step there reads them, right before
# it. A forged report passes only by carrying the right values, which is solving the test; a forged "it returned"
# of a step that then raised is caught by the fence after each test (`_run_test`). What the program can still
# claim, since the harness runs in its process: that a call returned which never did (a thread of its own
# answering in the harness's place while the call hangs) -- worth something only for a bare call no check reads.
_HARNESS = r"""
import json, os, sys, types
REQ, REP = int(sys.argv[-2]), int(sys.argv[-1])
MAX_BYTES, MAX_NODES, MAX_DEPTH = LIMITS
PROGRAM = compile(open("solution.py").read(), "solution.py", "exec")  # run anew by each test's process
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
    return json.loads(line)


def send(message):
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
    try:
        while data:
            data = data[os.write(REP, data):]
    except OSError:  # the caller stopped listening (its deadline, a report over its bound)
        os._exit(0)


class TooLarge(Exception):
    pass


def fields(v):
    # An instance's attributes, read through the C descriptors of object and of __slots__ only: a property or
    # __getattr__ of the program's class never runs here.
    out = {}
    for klass in reversed(type.__getattribute__(type(v), "__mro__")):
        for name, desc in list(type.__getattribute__(klass, "__dict__").items()):  # a mappingproxy: C code
            if type(desc) is types.MemberDescriptorType:
                try:
                    out[name] = desc.__get__(v, type(v))
                except AttributeError:
                    pass
            elif name == "__dict__" and type(desc) is types.GetSetDescriptorType:
                found = desc.__get__(v, type(v))
                if isinstance(found, dict):
                    out.update((k, x) for k, x in dict.items(found) if type(k) is str)
    return out


def enc(v, budget, depth=0):
    # Plain data by each builtin type's own methods (a subclass's overrides never run): JSON numbers and strings,
    # [tag, ...] for the rest. `budget` counts nodes and bytes down: past either the value is too large.
    budget[0] -= 1
    if budget[0] < 0 or budget[1] < 0 or depth > MAX_DEPTH:
        raise TooLarge
    t = type(v)
    if v is None or t is bool:
        return v
    if issubclass(t, int) and t is not bool:
        n = int.__int__(v)
        if -(1 << 53) < n < (1 << 53):
            budget[1] -= 2 + (int.bit_length(n) * 5 >> 4)  # its digits (log10(2) < 5/16) and a comma
            return n
        budget[1] -= int.bit_length(n) >> 2
        if budget[1] < 0:
            raise TooLarge
        return ["i", int.__format__(n, "x")]
    if issubclass(t, float):
        return ["f", float.__repr__(v)]
    if issubclass(t, complex):
        return ["c", float.__repr__(complex.real.__get__(v)), float.__repr__(complex.imag.__get__(v))]
    if issubclass(t, str):
        budget[1] -= str.__len__(v) + 2
        if budget[1] < 0:
            raise TooLarge
        return str.__str__(v)
    if issubclass(t, (bytes, bytearray)):
        budget[1] -= 2 * len(v)
        if budget[1] < 0:
            raise TooLarge
        return ["y", (bytes.hex if issubclass(t, bytes) else bytearray.hex)(v)]
    for base, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if issubclass(t, base):
            if base.__len__(v) > budget[0]:
                raise TooLarge
            return [tag, *(enc(x, budget, depth + 1) for x in list(base.__iter__(v)))]
    if issubclass(t, dict):
        if dict.__len__(v) > budget[0]:
            raise TooLarge
        return ["d", *([enc(k, budget, depth + 1), enc(x, budget, depth + 1)] for k, x in list(dict.items(v)))]
    if issubclass(t, type):
        return ["T", str(type.__getattribute__(v, "__qualname__"))]
    module = str(type.__getattribute__(t, "__module__"))
    if module == "fractions" and t.__name__ == "Fraction" and t is sys.modules["fractions"].Fraction:
        return ["q", enc(v.numerator, budget), enc(v.denominator, budget)]
    if module == "numpy" or module.startswith("numpy."):
        numpy = sys.modules["numpy"]
        if t is numpy.ndarray and v.size <= budget[0]:
            return ["l", *(enc(x, budget, depth + 1) for x in numpy.ndarray.tolist(v))] if v.ndim else enc(
                numpy.ndarray.tolist(v), budget, depth)
        if isinstance(v, numpy.generic):
            return enc(numpy.generic.item(v), budget, depth)
    if module == "__main__":  # the program's own class: its name, its bases' names and its attributes
        mro = [str(type.__getattribute__(k, "__qualname__")) for k in type.__getattribute__(t, "__mro__")]
        return ["o", mro, *([name, enc(x, budget, depth + 1)] for name, x in fields(v).items())]
    return ["u", module + "." + str(type.__getattribute__(t, "__qualname__"))]


def report(values):
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
        budget, out = [MAX_NODES, MAX_BYTES], []
        for v in values:
            try:
                out.append(["e", v[1]] if v[0] == "e" else enc(v[1], budget))
            except (TooLarge, RecursionError, MemoryError):
                out.append(["z"])  # too large to carry: a counted failure
                budget[0] = budget[1] = -1
            except Exception as e:
                out.append(["u", type(e).__name__])
        send(["values", out])
    finally:
        if child == 0:
            os._exit(0)


def run_test(ns):
    while True:
        kind, code, pre = receive()
        if kind == "end":
            return
        try:
            for source in pre:
                exec(source, ns)
            if kind == "exec":
                exec(code, ns)
                send(["ok"])
                continue
        except BaseException as e:
            send(["raised", type(e).__name__])
            continue
        values = []
        for source in code:
            try:
                values.append(["v", eval(source, ns)])
            except BaseException as e:
                values.append(["e", type(e).__name__])
        report(values)  # after all of the assert's calls returned: the values as the program left them


while True:
    message = receive()
    if message[0] == "fence":  # from the caller, after this test's process is gone: what came before is over
        send(["fenced", message[1]])
    if message[0] != "test":
        continue
    test = os.fork()
    if test == 0:
        ns = {"__name__": "__main__"}
        try:  # a crash or sys.exit() while defining things does not skip the test
            exec(PROGRAM, ns)
        except BaseException:
            pass
        run_test(ns)
        os._exit(0)
    os.waitpid(test, 0)
    if KILL_STRAYS:  # in a pid namespace: what the test started dies with it, before the next test
        try:
            os.kill(-1, 9)
        except OSError:
            pass
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            pass
    send(["done"])
"""


# Evaluated here on the program's plain values: pure builtins (and math), never the program's.
_LOCAL_CALLS = {"abs": abs, "all": all, "any": any, "bin": bin, "bool": bool, "bytes": bytes, "chr": chr,
                "complex": complex, "dict": dict, "divmod": divmod, "float": float, "frozenset": frozenset,
                "hex": hex, "int": int, "isinstance": isinstance, "len": len, "list": list, "max": max, "min": min,
                "oct": oct, "ord": ord, "repr": repr, "reversed": reversed, "round": round, "set": set,
                "sorted": sorted, "str": str, "sum": sum, "tuple": tuple, "type": type}
_LOCAL_MATH = {"isclose", "isnan", "isinf", "isfinite", "fabs", "floor", "ceil", "sqrt", "pi", "e", "inf", "nan",
               "trunc", "log", "log2", "log10", "exp", "gcd", "prod", "fsum"}
_LOCAL_METHODS = {"upper", "lower", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "join", "replace",
                  "count", "find", "rfind", "index", "startswith", "endswith", "isdigit", "isalpha", "isalnum",
                  "isspace", "isupper", "islower", "title", "capitalize", "casefold", "keys", "values", "items",
                  "get", "copy", "issubset", "issuperset", "isdisjoint", "union", "intersection", "difference"}
_LOCAL_NODES = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict,
                ast.Subscript, ast.Slice, ast.Starred, ast.JoinedStr, ast.FormattedValue, ast.Constant)
# The test's own expressions (no program in them) are evaluated here whole, comprehensions and range included.
_TEST_ONLY_NODES = (*_LOCAL_NODES, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.comprehension,
                    ast.Name, ast.Call, ast.Attribute, ast.keyword, ast.expr_context, ast.operator, ast.unaryop,
                    ast.boolop, ast.cmpop)
_TEST_ONLY_CALLS = {"range", "enumerate", "zip", "map", "filter"}

# The judge's cost. The program's values reach this process under a bound checked in the sandbox and again
# here: per assert at most _MAX_NODES nodes and _MAX_BYTES bytes of encoded data (ints in hex, any size), per run
# _MAX_RUN_BYTES; past it a value is a counted `too_large` failure. Every operation a check makes on them is
# bounded before it starts (`_bin`, `_sized`, `_method`, `_fmt`, `_sum`, `_prod`, `_gcd`): ints of at most
# _MAX_BITS bits out of *, ** and <<, at most _MAX_WORDS machine-word products for //, % and gcd; at most _MAX_SIZE
# items (an int counting one per 64 bits) out of sequence repetition, sum(), join, replace and a format width; no
# set or dict of items that share a hash more than _MAX_SAME_HASH times (collisions make building it quadratic).
# Everything else a check can do is linear in its values (comparisons, len, sorted, in), so one response costs
# this process time and memory linear in _MAX_RUN_BYTES (measured in test_sandbox.py: below 2 s and 400 MB).
_MAX_NODES, _MAX_BYTES, _MAX_DEPTH = 1_000_000, 8 << 20, 200
_MAX_RUN_BYTES = 32 << 20
_MAX_BITS, _MAX_WORDS, _MAX_SIZE, _MAX_SAME_HASH = 1 << 22, 1 << 27, 10 ** 7, 8


class _Raised(Exception):
    pass


class _TooLarge(_Raised):
    """A value over the bound: using it fails the check, and the test counts as too_large."""


class _Leaves(dict):
    """The program's values by name `_v<k>`; one that raised in the sandbox raises when it is read."""

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        if isinstance(value, _Raised):
            raise value
        return value


class _Instance:
    """An instance of the program's class, as data: its class's name and bases' names and its attributes. Equal to
    another of the same class with equal attributes (what the program's __eq__ says never counts here)."""

    def __init__(self, mro: tuple, fields: dict):
        self.mro, self.fields = mro, fields

    def __eq__(self, other):
        return type(other) is _Instance and other.mro[0] == self.mro[0] and other.fields == self.fields

    def __hash__(self):
        try:
            return hash((self.mro[0], tuple(sorted(self.fields.items()))))
        except TypeError:
            return hash(self.mro[0])

    def __repr__(self):
        return f"{self.mro[0]}({', '.join(f'{k}={v!r}' for k, v in self.fields.items())})"


@dataclasses.dataclass(frozen=True)
class _Class:
    """A class of the program's, by name (for isinstance)."""
    name: str


def _size(value: Any, cap: int = _MAX_SIZE) -> int:
    """Items in `value`, nested ones included (an int counts one per 64 bits, a string one per character), counted
    up to just past `cap`."""
    total, todo = 0, [value]
    while todo and total <= cap:
        v = todo.pop()
        total += 1
        if isinstance(v, int):
            total += v.bit_length() >> 6
        elif isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, _Instance):
            todo.extend(v.fields.values())
    return total


def _hash_safe(items: list) -> list:
    """`items`, unless more than _MAX_SAME_HASH of them share a hash (ints k * (2**61 - 1) all hash alike)."""
    if len(items) > _MAX_SAME_HASH and max(collections.Counter(map(hash, items)).values()) > _MAX_SAME_HASH:
        raise ValueError("colliding hashes")
    return items


def _int_cost_ok(op: str, a: int, b: int) -> bool:
    small, big = sorted((abs(a).bit_length(), abs(b).bit_length()))
    if op == "Mult":
        return small <= 64 or small + big <= _MAX_BITS
    if op == "Pow":
        return b < 0 or abs(a) <= 1 or b * max(1, abs(a).bit_length()) <= _MAX_BITS
    if op == "LShift":
        return b <= _MAX_BITS and abs(a).bit_length() + b <= _MAX_BITS
    if op in ("FloorDiv", "Mod", "divmod", "gcd"):
        return (small // 64 + 1) * (big // 64 + 1) <= _MAX_WORDS
    return True


_FORMAT_NUMBER = re.compile(r"\d+")


def _format_ok(spec: str) -> bool:
    """A width or precision of at most _MAX_SIZE; no `*` (its width comes from the values)."""
    return "*" not in spec and all(len(n) < 9 and int(n) <= _MAX_SIZE for n in _FORMAT_NUMBER.findall(spec))


def _bin(op: str, left: Any, right: Any) -> Any:
    """`left op right` for the checks here, refused ("result too large") where it would take this process more
    than the bounds above (`[0] * f(x)` with f returning 10**9, `3 ** f(x)`, `'%*d' % (f(x), 1)`)."""
    if isinstance(left, int) and isinstance(right, int) and not _int_cost_ok(op, left, right):
        raise ValueError("result too large")
    if op == "Mult":
        n, seq = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)) and n > 0 and (
                n > _MAX_SIZE or _size(seq, _MAX_SIZE // n) * n > _MAX_SIZE):
            raise ValueError("result too large")
    elif op == "Mod" and isinstance(left, (str, bytes)) and not _format_ok(str(left)):
        raise ValueError("result too large")
    return _BINARY_OPS[op](left, right)


_BINARY_OPS = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mult": lambda a, b: a * b,
               "MatMult": lambda a, b: a @ b, "Div": lambda a, b: a / b, "FloorDiv": lambda a, b: a // b,
               "Mod": lambda a, b: a % b, "Pow": lambda a, b: a ** b, "LShift": lambda a, b: a << b,
               "RShift": lambda a, b: a >> b, "BitOr": lambda a, b: a | b, "BitXor": lambda a, b: a ^ b,
               "BitAnd": lambda a, b: a & b}


def _fmt(value: Any, conversion: int, spec: str) -> str:
    """An f-string's `{value!conversion:spec}`, its width and precision bounded."""
    if not _format_ok(spec):
        raise ValueError("result too large")
    value = {115: str, 114: repr, 97: ascii}.get(conversion, lambda v: v)(value)
    return format(value, spec)


def _method(obj: Any, name: str, *args, **kwargs) -> Any:
    """`obj.name(*args)` with the results of join and replace bounded, and the items a set method hashes checked."""
    if name == "join" and args:
        items = list(args[0])
        if sum(len(x) if isinstance(x, (str, bytes)) else 1 for x in items) + len(obj) * len(items) > _MAX_SIZE:
            raise ValueError("result too large")
        args = (items,)
    elif name == "replace" and len(args) >= 2 and isinstance(obj, (str, bytes)):
        if len(obj) + (len(obj) + 1) * len(args[1]) > _MAX_SIZE and args[0] in obj:
            raise ValueError("result too large")
    elif name in ("union", "intersection", "difference", "issubset", "issuperset", "isdisjoint"):
        args = tuple(a if isinstance(a, (set, frozenset, dict)) else _hash_safe(list(a)) for a in args)
    return getattr(obj, name)(*args, **kwargs)


def _int_loop_ok(items: list, start: Any) -> bool:
    """sum() or prod() over ints: each step makes a new int as large as the running result, so the work is at most
    the count times the result's size (for a product, the sum of the operands' sizes)."""
    ints = [x for x in (*items, start) if isinstance(x, int)]
    bits = sum(abs(x).bit_length() for x in ints)
    return len(ints) * (bits // 64 + 1) <= _MAX_WORDS


def _sum(items, start=0):
    items = list(items)
    if not isinstance(start, (int, float, complex)) or any(isinstance(x, (list, tuple, str, bytes)) for x in items):
        if len(items) * _size(items, _MAX_SIZE) > _MAX_SIZE * 10:  # each + copies what came before
            raise ValueError("result too large")
    elif not _int_loop_ok(items, start):
        raise ValueError("result too large")
    return sum(items, start)


def _prod(items, start=1):
    items = list(items)
    if not _int_loop_ok(items, start):
        raise ValueError("result too large")
    for x in items:
        start = _bin("Mult", start, x)
    return start


def _gcd(*ints):
    for a in ints:
        for b in ints:
            if isinstance(a, int) and isinstance(b, int) and not _int_cost_ok("gcd", a, b):
                raise ValueError("result too large")
    return pymath.gcd(*ints)


def _divmod(a, b):
    if isinstance(a, int) and isinstance(b, int) and not _int_cost_ok("divmod", a, b):
        raise ValueError("result too large")
    return divmod(a, b)


def _round(x, *ndigits):
    if ndigits and isinstance(ndigits[0], int) and abs(ndigits[0]) > 10_000:
        raise ValueError("result too large")
    return round(x, *ndigits)


def _isinstance(value, kind):
    if isinstance(kind, _Class):
        return isinstance(value, _Instance) and kind.name in value.mro
    if isinstance(kind, tuple) and any(isinstance(k, _Class) for k in kind):
        return any(_isinstance(value, k) for k in kind)
    return isinstance(value, kind)


class _GuardOps(ast.NodeTransformer):
    """Routes a check's costly operations through the bounded versions above: binary operations (`_bin`), the
    methods that can blow up (`_method`), f-string fields (`_fmt`) and set displays (`_sized(set)`)."""

    def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
        self.generic_visit(node)
        return ast.copy_location(ast.Call(func=ast.Name(id="_bin", ctx=ast.Load()),
                                          args=[ast.Constant(type(node.op).__name__), node.left, node.right],
                                          keywords=[]), node)

    def visit_Call(self, node: ast.Call) -> ast.expr:
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr in _LOCAL_METHODS:
            return ast.copy_location(ast.Call(func=ast.Name(id="_method", ctx=ast.Load()),
                                              args=[node.func.value, ast.Constant(node.func.attr), *node.args],
                                              keywords=node.keywords), node)
        return node

    def visit_Set(self, node: ast.Set) -> ast.expr:
        self.generic_visit(node)
        return ast.copy_location(ast.Call(func=ast.Name(id="set", ctx=ast.Load()),
                                          args=[ast.List(elts=node.elts, ctx=ast.Load())], keywords=[]), node)

    def visit_FormattedValue(self, node: ast.FormattedValue) -> ast.expr:
        self.generic_visit(node)
        spec = node.format_spec or ast.Constant("")
        call = ast.Call(func=ast.Name(id="_fmt", ctx=ast.Load()), args=[node.value, ast.Constant(node.conversion),
                        spec], keywords=[])
        return ast.copy_location(ast.FormattedValue(value=call, conversion=-1, format_spec=None), node)


def _sized(make: Callable) -> Callable:
    """A constructor (set, dict, bytes, ...) that refuses the program's hostile values: an int asking for
    gigabytes (`bytes(10**10)`), or items whose hashes collide."""
    def call(*args, **kwargs):
        if args and type(args[0]) is int and args[0] > _MAX_SIZE:
            raise ValueError("result too large")
        if make in (set, frozenset, dict) and args and not isinstance(args[0], (set, frozenset, dict)):
            items = list(args[0])
            _hash_safe([item[0] if make is dict and isinstance(item, (list, tuple)) and item else item
                        for item in items])
            args = (items, *args[1:])
        return make(*args, **kwargs)
    return call


def _decode(x: Any, budget: list, depth: int = 0) -> Any:
    """A value the sandbox encoded (see _HARNESS's enc), checked again here: the program may write anything."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        raise _TooLarge("too_large")
    if x is None or isinstance(x, (bool, int, str)):
        return x
    tag, rest = x[0], x[1:]
    if tag == "i":
        if len(rest[0]) > 2 * _MAX_BYTES:
            raise _TooLarge("too_large")
        return int(rest[0], 16)
    if tag in ("f", "c"):
        return float(rest[0]) if tag == "f" else complex(float(rest[0]), float(rest[1]))
    if tag == "y":
        return bytes.fromhex(rest[0])
    if tag in ("l", "t", "S", "F"):
        items = [_decode(v, budget, depth + 1) for v in rest]
        if tag in ("S", "F"):
            return (set if tag == "S" else frozenset)(_hash_safe(items))
        return items if tag == "l" else tuple(items)
    if tag == "d":
        pairs = [(_decode(k, budget, depth + 1), _decode(v, budget, depth + 1)) for k, v in rest]
        return dict(zip(_hash_safe([k for k, _ in pairs]), (v for _, v in pairs)))
    if tag == "q":
        return fractions.Fraction(_decode(rest[0], budget), _decode(rest[1], budget))
    if tag == "o":
        fields = {str(name): _decode(v, budget, depth + 1) for name, v in rest[1:]}
        return _Instance(tuple(str(n) for n in rest[0]), fields)
    if tag == "T":
        return _Class(str(rest[0]))
    if tag == "z":
        raise _TooLarge("too_large")
    if tag == "e":
        return _Raised(str(rest[0])[:100])
    return _Raised(f"unsupported value {str(rest[0])[:100]}")  # "u": a type with no plain form here


def _decode_values(values: list) -> list:
    """An assert's reported values; one that raised, is too large or is malformed reads as that failure."""
    budget, out = [_MAX_NODES], []
    for value in values if isinstance(values, list) else []:
        try:
            out.append(_decode(value, budget))
        except _TooLarge as e:
            out.append(e)
        except (ValueError, TypeError, IndexError, KeyError, AttributeError, RecursionError, ZeroDivisionError):
            out.append(_Raised("malformed report"))
    return out


_GUARDED_MATH = types.SimpleNamespace(**{name: getattr(pymath, name) for name in _LOCAL_MATH} | {
    "prod": _prod, "gcd": _gcd})


def _check_namespace() -> dict:
    """Where a test's checks run: pure builtins and math, the costly ones bounded; never the program's."""
    return {"__builtins__": {}, "math": _GUARDED_MATH, **_LOCAL_CALLS, "range": range, "enumerate": enumerate,
            "zip": zip, "map": map, "filter": filter, "_bin": _bin, "_fmt": _fmt, "_method": _method,
            "sum": _sum, "divmod": _divmod, "round": _round, "isinstance": _isinstance,
            **{name: _sized(_LOCAL_CALLS[name]) for name in ("set", "frozenset", "dict", "bytes")}}


def _is_local(node: ast.expr, names: set[str]) -> bool:
    """A builtin (or a constant the test itself set) or one of math's, evaluated here."""
    if isinstance(node, ast.Name):  # range() and the like only over the test's own values: no range(f(x)) here
        return node.id in names and node.id not in _TEST_ONLY_CALLS
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _LOCAL_MATH and (
            "math" in names)
    return False


def _test_only(node: ast.expr, names: set[str]) -> bool:
    """True when `node` needs nothing of the program: literals, builtins, math, comprehensions over them."""
    bound = {n.id for c in ast.walk(node) if isinstance(c, ast.comprehension) for n in ast.walk(c.target)
             if isinstance(n, ast.Name)}
    allowed = names | bound
    for n in ast.walk(node):
        if not isinstance(n, _TEST_ONLY_NODES):
            return False
        if isinstance(n, ast.Name) and n.id not in allowed:
            return False
        if isinstance(n, ast.Attribute) and not (_is_local(n, names) or n.attr in _LOCAL_METHODS):
            return False
    return True


def _split(node: ast.expr, leaves: list[str], names: set[str], set_here: set[str] = frozenset()) -> ast.expr:
    """`node` with each maximal part that needs the program replaced by a name `_v<k>` (its source
    appended to `leaves`, for the sandbox to evaluate). A name of `set_here` that a leaf reads is read there
    from then on (`names` loses it): the program's call may have changed it."""
    if _is_local(node, names) or _test_only(node, names):
        return node
    method = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LOCAL_METHODS
    if method:  # `f(x).strip()`: the method of the plain value it reported, called here
        node.func.value = _split(node.func.value, leaves, names, set_here)
    if method or isinstance(node, ast.Call) and _is_local(node.func, names):
        node.args = [_split(a, leaves, names, set_here) for a in node.args]
        for kw in node.keywords:
            kw.value = _split(kw.value, leaves, names, set_here)
        return node
    if isinstance(node, _LOCAL_NODES):
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, _split(value, leaves, names, set_here))
            elif isinstance(value, list):
                setattr(node, field, [_split(v, leaves, names, set_here) if isinstance(v, ast.expr) else v
                                      for v in value])
        return node
    leaves.append(ast.unparse(node))
    names.difference_update(set_here & {n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
    return ast.copy_location(ast.Name(id=f"_v{len(leaves) - 1}", ctx=ast.Load()), node)


# Names whose sandbox value is never the program's answer: the builtins (the program may replace them there).
_BUILTIN_NAMES = frozenset(dir(builtins))


def _spine_root(node: ast.expr) -> str | None:
    """The name a value hangs from: `f` of `f(2)[0].x`, `Solution` of `Solution().run(3)`; None for anything
    else (a comprehension, a lambda, a constant's method) and for a dunder on the way (`f(2).__eq__(4)`)."""
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            return None
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _program_value(node: ast.expr, not_program: set[str]) -> bool:
    """Whether the sandbox's value of `node` is the program's answer: a call into, or a value of, what the program
    defines. Anything else evaluated there (a comparison inside a comprehension, a helper the test defines, an
    expected value built with an imported class, a builtin) the program could forge, so a test needing one is
    not judged."""
    root = _spine_root(node)
    return root is not None and root not in not_program and root not in _BUILTIN_NAMES


def _bound_names(stmt: ast.stmt) -> set[str]:
    """Names a top-level statement of a test binds: assigned, defined, imported."""
    names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(stmt.name)
    elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
        names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    return names


def _calls_shadowed_builtin(node: ast.expr, shadowed: set[str], names: set[str]) -> bool:
    """A call of a builtin that the program redefines, on the test's own values (`sum(1, 2)` with the program's
    `def sum`): the program's function or the builtin? Neither reading is safe to judge."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in shadowed
               and n.func.id in _LOCAL_CALLS and all(_test_only(a, names) for a in n.args)
               for n in ast.walk(node))


_MUTABLE_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp, ast.Call)


def _plan_test(test: str, shadowed: set[str], imported: set[str] = frozenset()) -> tuple[list, list] | None:
    """(steps for the sandbox: [kind, source, pre], "exec" runs a statement there, "eval" reports the values of
    [sources], each after running `pre`; steps here: ("check", j, expression over the values of step j, how many)
    per top-level assert, ("set", statement) for `name = <test-only expression>`, so that an expected value the
    test keeps in a variable is computed here, out of the program's reach). None: no such assert, or one whose
    verdict the program could forge.

    A name set here reaches the sandbox only right before the first step there that reads it (an input, not an
    expected value: `expected = 4` then `assert f(2) == expected` must not let f return `expected`). Once a step
    there has read it, the program may have changed it (an in-place contract: `sort_in_place(xs)`), so later
    checks read its value there, not the copy here.

    `shadowed`: names the program defines at top level; builtins and math here are always the real ones.
    `imported`: names the program imports (a module's function is not the program's answer)."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    names = set(_LOCAL_CALLS) | _TEST_ONLY_CALLS | {"math"}
    not_program = set(imported)  # roots whose sandbox value is not the program's: the test's helpers, imports
    steps, here, sets = [], [], {}
    set_here: set[str] = set()

    def touch(sources: list[str]) -> None:  # names set here that a sandbox step reads: its values from now on
        names.difference_update(set_here & {n.id for s in sources for n in ast.walk(ast.parse(s))
                                            if isinstance(n, ast.Name)})

    for stmt in tree.body:
        if isinstance(stmt, ast.Assert):
            if _calls_shadowed_builtin(stmt.test, shadowed, names):
                return None
            leaves: list[str] = []
            split = _GuardOps().visit(_split(stmt.test, leaves, names, set_here))
            if not all(_program_value(ast.parse(leaf, mode="eval").body, not_program) for leaf in leaves):
                return None
            steps.append(["eval", leaves, []])
            expr = ast.fix_missing_locations(ast.Expression(split))
            here.append(("check", len(steps) - 1, compile(expr, "<test>", "eval"), len(leaves)))
            continue
        steps.append(["exec", ast.unparse(stmt), []])
        if isinstance(stmt, ast.Import) and [(a.name, a.asname) for a in stmt.names] == [("math", None)]:
            continue  # math here is our own
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "math" and all(
                a.name in _LOCAL_MATH and a.asname is None for a in stmt.names):
            for a in stmt.names:  # `from math import isclose`: math's isclose, here
                here.append(("set", compile(f"{a.name} = math.{a.name}", "<test>", "exec")))
                names.add(a.name)
                not_program.discard(a.name)
            continue
        stored = _bound_names(stmt)
        simple = isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
        if simple and _test_only(stmt.value, names):
            here.append(("set", compile(ast.Module([stmt], []), "<test>", "exec")))
            names.add(stmt.targets[0].id)
            set_here.discard(stmt.targets[0].id)
            if any(isinstance(n, _MUTABLE_NODES) or isinstance(n, ast.Name) and n.id in set_here
                   for n in ast.walk(stmt.value)):  # a list, dict, set (or an alias of one): a call may change it
                set_here.add(stmt.targets[0].id)
            not_program.discard(stmt.targets[0].id)
            sets[len(steps) - 1] = stmt.targets[0].id
            continue
        touch([steps[-1][1]])
        names -= stored
        set_here -= stored
        # `result = f(2)`: the program's answer under a name; `ok = f(2) == 4`, a `def`, an import: not
        if isinstance(stmt, ast.Assign) and _program_value(stmt.value, not_program):
            not_program -= stored
        else:
            not_program |= stored
    if not any(h[0] == "check" for h in here):
        return None
    _defer_sets(steps, sets)
    return steps, here


def _defer_sets(steps: list, sets: dict[int, str]) -> None:
    """Move each test-only assignment to the `pre` of the first later sandbox step that reads its name (drop it
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


def _top_level_names(program: str) -> tuple[set[str], set[str]]:
    """Names the program defines at module level, and those it imports."""
    defined, imported = set(), set()
    for node in ast.parse(program).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return defined, imported


class _Channel:
    """Both ends of the conversation with the harness: one JSON line each way, every wait bounded by the run's
    deadline, every report by _MAX_BYTES, all of them together by _MAX_RUN_BYTES (past it: closed, too_large)."""

    def __init__(self, req: int, rep: int, deadline: float):
        self.req, self.rep, self.deadline = req, rep, deadline
        self.pending, self.received, self.closed, self.too_large = bytearray(), 0, False, False
        os.set_blocking(req, False)
        os.set_blocking(rep, False)

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

    def receive(self) -> Any:
        """The next line, decoded as JSON (None: the harness is gone, the run ran out of time or bytes)."""
        end = self.pending.find(b"\n")
        while end < 0 and not self.closed:
            left = self.deadline - time.monotonic()
            if len(self.pending) > _MAX_BYTES + 4096 or self.received > _MAX_RUN_BYTES:
                self.closed = self.too_large = True
                break
            if left <= 0 or not select.select([self.rep], [], [], left)[0]:
                self.closed = True
                break
            try:
                chunk = os.read(self.rep, 1 << 20)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            self.closed = not chunk
            if chunk.find(b"\n") >= 0:  # looked for in the new bytes only: a long report is read in linear time
                end = len(self.pending) + chunk.find(b"\n")
            self.pending += chunk
            self.received += len(chunk)
        if end < 0 or self.received > _MAX_RUN_BYTES:  # past the run's budget: this report and all after it
            self.too_large = self.too_large or end >= 0
            self.closed = True
            return None
        line, self.pending = bytes(self.pending[:end]), self.pending[end + 1:]
        try:
            return json.loads(line)
        except (ValueError, RecursionError):  # not the harness's: nothing after it can be trusted either
            self.closed = True
            return None


def _run_test(plan: tuple[list, list], channel: _Channel) -> str:
    """One test in a fresh process of the harness: its steps one at a time, each judged as its report comes.
    -> "pass", "fail" or "too_large"."""
    steps, here = plan
    namespace, h, verdict, ended = _check_namespace(), 0, "pass", False
    if not channel.send(["test"]):
        return "too_large" if channel.too_large else "fail"
    for j, (kind, code, pre) in enumerate(steps):
        if kind == "exec" and code == "pass" and not pre:
            continue
        report = channel.receive() if channel.send([kind, code, pre]) else None
        if not isinstance(report, list) or not report or report[0] == "done":
            ended = isinstance(report, list) and report[:1] == ["done"]
            verdict = "too_large" if channel.too_large else "fail"
            break
        if kind == "exec":
            if report != ["ok"]:  # every failed step fails its test
                verdict = "fail"
                break
            continue
        values = _decode_values(report[1]) if report[0] == "values" and len(report) == 2 else []
        while h < len(here) and here[h][0] == "set":
            exec(here[h][1], namespace)  # the test's own constant, e.g. `expected = [1, 2]`
            h += 1
        verdict = _check(here[h], values, namespace)
        h += 1
        if verdict != "pass":
            break
    if not (ended or channel.send(["end", None, []]) and _reads_only(channel, ["done"])):
        verdict = "fail"
    # A fence: a nonce the harness echoes once this test's process is gone. A line between the test's last report
    # and the echo (a report of a step that raised, after the program had forged its "ok" and "done") fails it.
    nonce = secrets.token_hex(8)
    if not (channel.send(["fence", nonce]) and _reads_only(channel, ["fenced", nonce])):
        verdict = "too_large" if channel.too_large else "fail"
    return verdict


def _reads_only(channel: _Channel, wanted: list) -> bool:
    """Read up to the line `wanted`: True if no other line came first (a closed channel: False)."""
    clean = True
    while (line := channel.receive()) is not None:
        if line == wanted:
            return clean
        clean = False
    return False


def _check(check: tuple, values: list, namespace: dict) -> str:
    _, _, expr, num_leaves = check
    if len(values) != num_leaves:
        return "fail"
    try:
        return "pass" if eval(expr, namespace, _Leaves((f"_v{k}", v) for k, v in enumerate(values))) else "fail"
    except _TooLarge:
        return "too_large"
    except Exception:  # raised in the sandbox, or here (a type error on the program's values, a refused cost)
        return "fail"


def judgeable(test: str) -> bool:
    """Whether `test` has a top-level assert this process can judge (a dataset check before training)."""
    return _plan_test(test, set()) is not None


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


def judge_asserts(program: str, tests: list[str], timeout: float, memory_mb: int) -> dict:
    """Run `program` in a sandbox, each of `tests` in a fresh process of it, and judge each test here on the
    values of its program parts. Returns {"passed", "judged", "unsupported", "too_large", "status", "seconds",
    "stderr"}; status "sandbox_error" when the sandbox could not start (nothing was judged)."""
    try:
        shadowed, imported = _top_level_names(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        shadowed, imported = set(), set()
    plans = [_plan_test(t, shadowed, imported) for t in tests]
    verdict = {"passed": 0, "judged": sum(plan is not None for plan in plans), "too_large": 0,
               "unsupported": sum(plan is None for plan in plans), "status": "unsupported", "seconds": 0.0,
               "stderr": ""}
    if not verdict["judged"]:
        return verdict
    mode = sandbox_mode()
    harness = _HARNESS.replace("LIMITS", repr((_MAX_BYTES, _MAX_NODES, _MAX_DEPTH)), 1).replace(
        "KILL_STRAYS", repr(mode != "none"), 1).replace("PRELOAD", repr(_slow_imports(program)), 1)

    def converse(req: int, rep: int, deadline: float) -> list[str]:
        channel = _Channel(req, rep, deadline)
        return [_run_test(plan, channel) if plan else "unsupported" for plan in plans]

    run = run_sandboxed({"solution.py": program, "harness.py": harness}, [sys.executable, "harness.py"],
                        timeout=timeout, memory_mb=memory_mb, converse=converse, mode=mode)
    verdict.update(status=run["status"], seconds=round(run["seconds"], 3), stderr=run["stderr"][-500:])
    results = run.get("conversation") or [] if run["status"] != "output_limit" else []  # a flood fails all
    verdict.update(passed=results.count("pass"), too_large=results.count("too_large"))
    return verdict


def _same_tokens(out: str, expected: str) -> bool:
    """Whitespace-separated tokens equal, compared one pair at a time (no list of millions of tokens here)."""
    pairs = itertools.zip_longest(re.finditer(r"\S+", out), re.finditer(r"\S+", expected))
    return all(a is not None and b is not None and a.group() == b.group() for a, b in pairs)


def run_stdio_tests(program: str, tests: list[tuple[str, str]], timeout: float, memory_mb: int,
                    budget: float | None) -> dict:
    """One sandboxed run of `program` per (stdin, expected stdout) test, within `budget` seconds in all (tests
    not reached fail, status "budget"); stdout, all of it up to the file-size limit (_FSIZE, 16 MB; past it the
    test fails with status "output_limit"), compared token by token here. Returns {"passed", "statuses",
    "status"}, status "sandbox_error" (with "stderr") when the sandbox could not start."""
    deadline = time.monotonic() + (budget or float("inf"))
    passed, statuses = 0, []
    for stdin_text, expected in tests:
        remaining = deadline - time.monotonic()
        if remaining < 0.2:
            statuses.append("budget")
            continue
        run = run_sandboxed({"solution.py": program}, [sys.executable, "solution.py"], stdin_text,
                            timeout=min(timeout, remaining), memory_mb=memory_mb, max_output=_FSIZE)
        if run["status"] == "sandbox_error":
            return {"passed": 0, "statuses": statuses, "status": "sandbox_error", "stderr": run["stderr"][-500:]}
        ok = run["status"] == "ok" and _same_tokens(run["stdout"], expected)
        passed += ok
        statuses.append("pass" if ok else run["status"])
    return {"passed": passed, "statuses": statuses, "status": "ok"}
