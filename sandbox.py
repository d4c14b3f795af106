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
exiting early, forging output, patching builtins or `__eq__` cannot pass a test; the test's expected values
reach the sandbox only where a later step there reads them. Tests that cannot be judged that way, because their
asserts are not top-level statements (inside a loop or a function) or because a verdict would need a value that
is not the program's answer computed in the sandbox (a comparison inside a comprehension, a helper the test
defines, an expected value built with an imported class), are not judged: "unsupported" counts them. For stdio
tests (`run_stdio_tests`) this process compares stdout.
"""

import ast
import builtins
import json
import logging
import math as pymath
import os
import queue
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
# (pinned buffers) and F_SETPIPE_SZ (a pipe keeps its default 64 KB). Code-contest programs use none of
# them; a program that does gets PermissionError. On an architecture not listed here it is not installed
# (`sandbox_description` says so): under a cgroup that bounds memory all the same, without one it does not.
_SECCOMP_SYSCALLS = {  # machine: (audit arch, {name: number}); the same names on each
    "x86_64": (0xC000003E, {"memfd_create": 319, "memfd_secret": 447, "socket": 41, "socketpair": 53,
                            "shmget": 29, "msgget": 68, "mq_open": 240, "io_uring_setup": 425, "fcntl": 72}),
    "aarch64": (0xC00000B7, {"memfd_create": 279, "memfd_secret": 447, "socket": 198, "socketpair": 199,
                             "shmget": 194, "msgget": 186, "mq_open": 180, "io_uring_setup": 425, "fcntl": 25}),
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
    for name in ("memfd_create", "memfd_secret", "socket", "socketpair", "shmget", "msgget", "mq_open",
                 "io_uring_setup"):
        prog += [(JEQ, 0, 1, nr[name]), (RET, 0, 0, EPERM)]
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
import ctypes, json, os, resource, sys, traceback
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
if not cfg["userns"]:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    # The kernel keeps a uid's keyrings across runs (no user namespace of its own here): what an earlier run of
    # this uid left would be a channel to this one. Start them empty (KEYCTL_CLEAR of the user and user-session
    # keyrings; an unknown architecture keeps them).
    SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 271, "s390x": 280}.get(os.uname().machine)
    for keyring in (-4, -5) if SYS_KEYCTL else ():
        libc.syscall(ctypes.c_long(SYS_KEYCTL), ctypes.c_long(7), ctypes.c_long(keyring))
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
                       uid: int, status_fd: int) -> list[str]:
    binds, links, paths = _root_layout()
    cfg = {"root": os.path.join(workdir, "root"), "files": os.path.join(workdir, "files"),
           "uid": 65534 if mode == "userns" else uid, "userns": mode == "userns", "tmp_mb": tmp_mb,
           "shm_mb": shm_mb, "binds": binds, "links": links, "paths": paths, "rlimits": rlimits, "argv": argv,
           "env": _sandbox_env(), "status_fd": status_fd}
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
        pass_fds = (*pass_fds, status.fileno())
        cmd = _namespace_command(mode, argv, workdir, rlimits, tmp_mb, shm_mb, uid, status.fileno())
        cwd, env = workdir, {}
    if cgroups:
        cmd = _in_cgroup(cmd, cgroups)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                            start_new_session=True, pass_fds=pass_fds)
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
    seccomp = ("memfd, sockets and shared memory refused (seccomp)" if os.uname().machine in _SECCOMP_SYSCALLS
               else f"no seccomp filter on {os.uname().machine}: memory held unmapped is bounded only by a cgroup")
    return f"code sandbox: {mode}: {_MODES[mode]}; {budget}; {seccomp}"


def _sandbox_state() -> dict:
    """What a pool worker needs to skip its own probe: the parent's mode and cgroup bases."""
    _sandbox_mode()
    return dict(_SANDBOX)


def run_sandboxed(files: dict[str, str], argv: list[str], stdin_text: str | None = None, timeout: float = 5.0,
                  memory_mb: int = 1024, max_output: int = 1 << 20, channel: bool = False,
                  mode: str | None = None) -> dict:
    """Run argv in a fresh sandbox whose /tmp (also its cwd) holds `files`, under limits; never
    raises for the program's behaviour. With channel=True the last argument is the number of a
    file descriptor it may write results to. Returns {"status": ok|exit_<rc>|signal_<n>|timeout|
    output_limit|sandbox_error, "stdout", "stderr", "seconds", "channel"}."""
    mode = mode or _sandbox_mode()
    # Named after this process, so that whoever kills it (the pool) can remove what it leaves.
    workdir = tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}_")
    uid = _acquire_uid()
    try:
        os.makedirs(os.path.join(workdir, "root"))
        os.makedirs(os.path.join(workdir, "files"))
        for name, text in files.items():
            with open(os.path.join(workdir, "files", name), "w") as f:
                f.write(text)
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr, \
                tempfile.TemporaryFile() as fchan, tempfile.TemporaryFile() as fstatus:
            # Output goes to files, not pipes: no reader threads, no deadlock, and RLIMIT_FSIZE
            # stops a program that prints gigabytes.
            fin.write((stdin_text or "").encode())
            fin.seek(0)
            extra = [str(fchan.fileno())] if channel else []
            t0 = time.monotonic()
            proc, cgroups = _sandbox_popen(argv + extra, workdir, timeout, memory_mb, fin, fout, ferr, uid, mode,
                                           pass_fds=(fchan.fileno(),) if channel else (), status=fstatus)
            try:
                rc = proc.wait(timeout=timeout)
                status = "ok" if rc == 0 else (f"signal_{-rc}" if rc < 0 else f"exit_{rc}")
            except subprocess.TimeoutExpired:
                status = "timeout"
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
            out, chan = _read(fout, max_output), _read(fchan, 8 << 20)  # values of big results too
        return {"status": status, "stdout": out, "stderr": err, "seconds": seconds, "channel": chan}
    finally:
        _release_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)


def _failed_to_start(mode: str, status: str) -> bool:
    """From the sandbox's own status channel: our setup wrote its error there, bwrap the program's start."""
    return bool(status) if mode in ("namespace", "userns") else mode == "bwrap" and status != "started\n"


def _read(f, limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


# The tests' verdicts are decided here, not in the program's interpreter (which the program owns:
# it can read the harness, patch builtins or __eq__, exit early, forge any line it prints). The
# sandbox only evaluates the parts of each `assert` that depend on the program (e.g. `f(2)` of
# `assert f(2) == 4`) and writes their values, as plain data, to a channel; this process
# evaluates the rest (`_v0 == 4`) on those values. The expected values never enter the sandbox, so
# a forged report passes only by carrying the right values, which is solving the test.
_HARNESS = """\
import json, os, sys
_fd = int(sys.argv[-1])
_tests = {tests!r}
_ns = {{"__name__": "__main__"}}


def _enc(v, depth=0):
    if depth > 100:
        raise RecursionError
    if v is None or isinstance(v, bool):
        return ["n"] if v is None else ["b", bool(v)]
    for base, tag in ((int, "i"), (float, "f"), (complex, "c")):
        if isinstance(v, base):
            return [tag, base.__repr__(base(v))]
    if isinstance(v, (str, bytes)):
        return ["s", str.__str__(v)] if isinstance(v, str) else ["y", bytes(v).hex()]
    for base, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(v, base):
            return [tag, [_enc(x, depth + 1) for x in base.__iter__(v)]]
    if isinstance(v, dict):
        return ["d", [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in dict.items(v)]]
    if type(v).__module__ == "numpy" and getattr(v, "shape", None) == ():
        return _enc(v.item(), depth)
    return ["o", type(v).__name__ + ":" + repr(v)[:1000]]


try:  # a crash or sys.exit() while defining things does not skip the tests
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
except BaseException:
    pass
for _i, _steps in enumerate(_tests):
    try:
        for _j, (_kind, _code) in enumerate(_steps):
            if _kind == "exec":
                exec(_code, _ns)
                continue
            _vals = []
            for _e in _code:
                try:
                    _vals.append(_enc(eval(_e, _ns)))
                except BaseException as _x:
                    _vals.append(["e", type(_x).__name__])
            os.write(_fd, (json.dumps([_i, _j, _vals]) + "\\n").encode())
    except BaseException:
        pass
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
_MAX_ITEMS = 5000  # a larger set or dict of the program's is opaque: colliding hashes make it quadratic
_MAX_SIZE = 10 ** 7  # items or characters (or bits of an int) that an operation here may make of the program's values


class _Opaque:
    """A value with no plain-data form (an instance of the program's class): equal only to another
    whose repr is the same, truthy, and good for nothing else."""

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other):
        return isinstance(other, _Opaque) and other.text == self.text

    def __hash__(self):
        return hash(self.text)

    def __repr__(self):
        return self.text


class _Raised(Exception):
    pass


class _Leaves(dict):
    """The program's values by name `_v<k>`; one that raised in the sandbox raises when it is read."""

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        if isinstance(value, _Raised):
            raise value
        return value


def _hash_safe(items: list) -> list:
    """`items`, unless they are many whose hashes collide (ints k * (2**61 - 1) all hash alike): a set or dict of
    them takes quadratic time to build here, outside the sandbox's limits. Distinct items rarely collide."""
    if len(items) > 64 and len({hash(v) for v in items}) < len(items) // 2:
        raise ValueError("colliding hashes")
    return items


def _bin(op: str, left: Any, right: Any) -> Any:
    """`left op right` for the checks here, refusing results that would take the caller's memory or time
    (`[0] * f(x)` with f returning 10**9, `2 ** f(x)`): the sandbox's budget does not cover this process."""
    if op == "Mult":
        n, seq = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)) and len(seq) * n > _MAX_SIZE:
            raise ValueError("result too large")
    elif op in ("Pow", "LShift") and isinstance(left, int) and isinstance(right, int):
        bits = right if op == "LShift" else right * max(abs(left).bit_length() - 1, 0)
        if bits > _MAX_SIZE:
            raise ValueError("result too large")
    return _BINARY_OPS[op](left, right)


_BINARY_OPS = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mult": lambda a, b: a * b,
               "MatMult": lambda a, b: a @ b, "Div": lambda a, b: a / b, "FloorDiv": lambda a, b: a // b,
               "Mod": lambda a, b: a % b, "Pow": lambda a, b: a ** b, "LShift": lambda a, b: a << b,
               "RShift": lambda a, b: a >> b, "BitOr": lambda a, b: a | b, "BitXor": lambda a, b: a ^ b,
               "BitAnd": lambda a, b: a & b}


class _GuardOps(ast.NodeTransformer):
    """Every binary operation of a check goes through `_bin`."""

    def visit_BinOp(self, node: ast.BinOp) -> ast.expr:
        self.generic_visit(node)
        return ast.copy_location(ast.Call(func=ast.Name(id="_bin", ctx=ast.Load()),
                                          args=[ast.Constant(type(node.op).__name__), node.left, node.right],
                                          keywords=[]), node)


def _sized(make: Callable) -> Callable:
    """A constructor (set, dict, bytes, ...) that refuses the program's hostile values: an int asking for
    gigabytes (`bytes(10**10)`), or items whose hashes collide."""
    def call(*args, **kwargs):
        if args and type(args[0]) is int and args[0] > _MAX_SIZE:
            raise ValueError("result too large")
        if make in (set, frozenset, dict) and args and isinstance(args[0], (list, tuple, str, bytes)):
            items = list(args[0])
            _hash_safe([item[0] if make is dict and isinstance(item, (list, tuple)) and item else item
                        for item in items])
            args = (items, *args[1:])
        return make(*args, **kwargs)
    return call


def _decode(x: Any) -> Any:
    tag = x[0]
    if tag in ("n", "b", "s"):
        return None if tag == "n" else x[1] if tag == "b" else str(x[1])
    if tag in ("i", "f", "c"):
        return {"i": int, "f": float, "c": complex}[tag](x[1])
    if tag == "y":
        return bytes.fromhex(x[1])
    if tag in ("S", "F", "d") and len(x[1]) > _MAX_ITEMS:
        return _Opaque(f"{tag}:{len(x[1])} items")
    if tag in ("l", "t"):
        return (list if tag == "l" else tuple)(_decode(v) for v in x[1])
    if tag in ("S", "F"):
        return (set if tag == "S" else frozenset)(_hash_safe([_decode(v) for v in x[1]]))
    if tag == "d":
        keys = _hash_safe([_decode(k) for k, _ in x[1]])
        return dict(zip(keys, (_decode(v) for _, v in x[1])))
    if tag == "e":
        return _Raised(str(x[1])[:100])
    return _Opaque(str(x[1])[:1000])


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


def _split(node: ast.expr, leaves: list[str], names: set[str]) -> ast.expr:
    """`node` with each maximal part that needs the program replaced by a name `_v<k>` (its source
    appended to `leaves`, for the sandbox to evaluate)."""
    if _is_local(node, names) or _test_only(node, names):
        return node
    method = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LOCAL_METHODS
    if method:  # `f(x).strip()`: the method of the plain value it reported, called here
        node.func.value = _split(node.func.value, leaves, names)
    if method or isinstance(node, ast.Call) and _is_local(node.func, names):
        node.args = [_split(a, leaves, names) for a in node.args]
        for kw in node.keywords:
            kw.value = _split(kw.value, leaves, names)
        return node
    if isinstance(node, _LOCAL_NODES):
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, _split(value, leaves, names))
            elif isinstance(value, list):
                setattr(node, field, [_split(v, leaves, names) if isinstance(v, ast.expr) else v for v in value])
        return node
    leaves.append(ast.unparse(node))
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


def _plan_test(test: str, shadowed: set[str], imported: set[str] = frozenset()) -> tuple[list, list] | None:
    """(steps for the sandbox: ["exec", source] runs there, ["eval", [sources]] reports values;
    steps here: ("check", j, expression over the values of step j, how many) per top-level assert,
    ("set", statement) for `name = <test-only expression>`, so that an expected value the test
    keeps in a variable is computed here, out of the program's reach: it is sent to the sandbox only where a
    later step there reads it). None: no such assert, or one whose verdict the program could forge.

    `shadowed`: names the program defines at top level; builtins and math here are always the real ones.
    `imported`: names the program imports (a module's function is not the program's answer)."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    names = set(_LOCAL_CALLS) | _TEST_ONLY_CALLS | {"math"}
    not_program = set(imported)  # roots whose sandbox value is not the program's: the test's helpers, imports
    steps, here, sets = [], [], {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assert):
            if _calls_shadowed_builtin(stmt.test, shadowed, names):
                return None
            leaves: list[str] = []
            split = _GuardOps().visit(_split(stmt.test, leaves, names))
            if not all(_program_value(ast.parse(leaf, mode="eval").body, not_program) for leaf in leaves):
                return None
            steps.append(["eval", leaves])
            expr = ast.fix_missing_locations(ast.Expression(split))
            here.append(("check", len(steps) - 1, compile(expr, "<test>", "eval"), len(leaves)))
            continue
        steps.append(["exec", ast.unparse(stmt)])
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
            not_program.discard(stmt.targets[0].id)
            sets[len(steps) - 1] = stmt.targets[0].id
            continue
        names -= stored
        # `result = f(2)`: the program's answer under a name; `ok = f(2) == 4`, a `def`, an import: not
        if isinstance(stmt, ast.Assign) and _program_value(stmt.value, not_program):
            not_program -= stored
        else:
            not_program |= stored
    if not any(h[0] == "check" for h in here):
        return None
    # The test's own values reach the sandbox only where a later step there reads them (an input, not an
    # expected value: `expected = 4` then `assert f(2) == expected` must not let f return `expected`).
    read: set[str] = set()
    for k in range(len(steps) - 1, -1, -1):
        if k in sets and sets[k] not in read:
            steps[k] = ["exec", "pass"]
            continue
        for source in (steps[k][1] if steps[k][0] == "eval" else [steps[k][1]]):
            read |= {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    return steps, here


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


def _reports(channel: str, plans: list) -> dict[tuple[int, int], list | None]:
    """(test, step) -> the values the sandbox reported for an assert; None where reports disagree.
    Each decoded once, and only where an assert waits for it: the program may write anything here."""
    expected = {(i, step[1]) for i, plan in enumerate(plans) if plan for step in plan[1] if step[0] == "check"}
    raw: dict = {}
    for line in channel.splitlines():
        try:
            i, j, values = json.loads(line)
            key = (int(i), int(j))
            text = json.dumps(values) if key in expected else None
        except (ValueError, TypeError, RecursionError):
            continue
        if text is not None:
            raw[key] = text if raw.get(key, text) == text else None
    out: dict = {}
    for key, text in raw.items():
        try:
            out[key] = None if text is None else [_decode(v) for v in json.loads(text)]
        except (ValueError, TypeError, IndexError, KeyError, RecursionError):
            out[key] = None
    return out


def _test_passed(i: int, plan: tuple[list, list] | None, reports: dict) -> bool:
    if plan is None:
        return False
    namespace = {"__builtins__": {}, "math": pymath, **_LOCAL_CALLS, "range": range, "enumerate": enumerate,
                 "zip": zip, "map": map, "filter": filter, "_bin": _bin,
                 **{name: _sized(_LOCAL_CALLS[name]) for name in ("set", "frozenset", "dict", "bytes")}}
    for step in plan[1]:
        try:
            if step[0] == "set":  # the test's own constant, e.g. `expected = [1, 2]`
                exec(step[1], namespace)
                continue
            _, j, check, num_leaves = step
            values = reports.get((i, j))
            if values is None or len(values) != num_leaves:
                return False
            if not eval(check, namespace, _Leaves((f"_v{k}", v) for k, v in enumerate(values))):
                return False
        except Exception:  # raised in the sandbox, or here (a type error on the program's values)
            return False
    return True



def judgeable(test: str) -> bool:
    """Whether `test` has a top-level assert this process can judge (a dataset check before training)."""
    return _plan_test(test, set()) is not None


def judge_asserts(program: str, tests: list[str], timeout: float, memory_mb: int) -> dict:
    """Run `program` once in a sandbox with the parts of `tests` that need it, and judge each test here.
    Returns {"passed", "judged", "unsupported", "status", "seconds", "stderr"}; status "sandbox_error" when the
    sandbox could not start (nothing was judged)."""
    try:
        shadowed, imported = _top_level_names(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        shadowed, imported = set(), set()
    plans = [_plan_test(t, shadowed, imported) for t in tests]
    verdict = {"passed": 0, "judged": sum(plan is not None for plan in plans),
               "unsupported": sum(plan is None for plan in plans), "status": "unsupported", "seconds": 0.0,
               "stderr": ""}
    if not verdict["judged"]:
        return verdict
    harness = _HARNESS.format(tests=[plan[0] if plan else [] for plan in plans])
    run = run_sandboxed({"solution.py": program, "harness.py": harness}, [sys.executable, "harness.py"],
                        timeout=timeout, memory_mb=memory_mb, channel=True)
    verdict.update(status=run["status"], seconds=round(run["seconds"], 3), stderr=run["stderr"][-500:])
    if run["status"] != "sandbox_error":
        reports = _reports(run["channel"], plans) if run["status"] != "output_limit" else {}  # a flood fails all
        verdict["passed"] = sum(_test_passed(i, plan, reports) for i, plan in enumerate(plans) if plan is not None)
    return verdict


def run_stdio_tests(program: str, tests: list[tuple[str, str]], timeout: float, memory_mb: int,
                    budget: float | None) -> dict:
    """One sandboxed run of `program` per (stdin, expected stdout) test, within `budget` seconds in all (tests
    not reached fail, status "budget"); stdout compared token by token here. Returns {"passed", "statuses",
    "status"}, status "sandbox_error" (with "stderr") when the sandbox could not start."""
    deadline = time.monotonic() + (budget or float("inf"))
    passed, statuses = 0, []
    for stdin_text, expected in tests:
        remaining = deadline - time.monotonic()
        if remaining < 0.2:
            statuses.append("budget")
            continue
        run = run_sandboxed({"solution.py": program}, [sys.executable, "solution.py"], stdin_text,
                            timeout=min(timeout, remaining), memory_mb=memory_mb)
        if run["status"] == "sandbox_error":
            return {"passed": 0, "statuses": statuses, "status": "sandbox_error", "stderr": run["stderr"][-500:]}
        ok = run["status"] == "ok" and run["stdout"].split() == expected.split()
        passed += ok
        statuses.append("pass" if ok else run["status"])
    return {"passed": passed, "statuses": statuses, "status": "ok"}
