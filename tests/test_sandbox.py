"""Tests for sandbox.py, through the code verifiers that use it: programs that loop, fork, allocate, exit early,
kill their parent, print gigabytes, hold memory no limit counts or forge a verdict, as root and as an unprivileged
user; the harness that judges their values outside the program; the sandbox's own set-up, clean-up and modes.

Where no isolation exists here the tests that need it are skipped (conftest.py's `sandbox` fixture), unless
REQUIRE_CODE_SANDBOX=1 (.ci/run sets it), which makes such a skip a failure.
"""

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import sandbox as S
import verifiers as V
from conftest import no_code_sandbox
from verifiers import VerifierPool, verify

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE_TESTS = ["assert f(1) == 2", "assert f(2) == 4", "assert f(0) == 0"]
# conftest.py's `sandbox` fixture: skipped where no isolation for model-written code exists here
needs_sandbox = pytest.mark.usefixtures("sandbox")


def py(src: str) -> str:
    return f"Here is my solution.\n```python\n{src}\n```\n"


def _sandbox_uid_processes():
    uids = range(S._uid_base(), S._uid_base() + 8)
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid in uids:
                pids.append(pid)
        except FileNotFoundError:
            pass
    return pids


GOOD_F = "def f(x):\n    return 2 * x\n"
HOSTILE = {
    # name: (program, max score it may get, seconds it may take with code_timeout=2)
    "infinite_loop": (GOOD_F + "while True:\n    pass", 0.0, 4),
    "sleep_forever": (GOOD_F + "import time\ntime.sleep(1000)", 0.0, 4),
    "fork_bomb": ("import os\n" + GOOD_F + "while True:\n    try:\n        os.fork()\n    except OSError:\n"
                  "        pass", 0.0, 5),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n" + GOOD_F, 0.0, 5),
    "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.killpg(0, signal.SIGKILL)\n"
                    "def f(x):\n    return -1", 0.0, 4),
    "os_exit_before_asserts": (GOOD_F + "import os\nos._exit(0)", 0.0, 4),
    "sys_exit_before_asserts": ("def f(x):\n    return -1\nimport sys\nsys.exit(0)", 0.0, 4),
    "print_gigabytes": ("import sys\n" + GOOD_F + "while True:\n    sys.stdout.write('x' * (1 << 20))", 0.0, 5),
    "forged_pass_lines": ("def f(x):\n    return -1\nfor i in range(3):\n    print(f'\\nVERIFIER_0:{i}:pass')\n"
                          "import builtins\nbuiltins.print = lambda *a, **k: None", 0.0, 4),
    "kill_all": ("import os, signal\nos.kill(-1, signal.SIGKILL)\ndef f(x):\n    return -1", 0.0, 4),
    # the pass is decided outside the program: reading the harness, patching __eq__ or builtins,
    # raising SystemExit inside a test or closing its files cannot make a wrong answer pass
    "forged_from_callers_frame": (
        "import os, sys\ndef f(x):\n    return -1\nframe, consts = sys._getframe(0), []\nwhile frame is not None:\n"
        "    consts += [c for c in frame.f_code.co_consts + tuple(frame.f_globals.values()) if isinstance(c, str)]\n"
        "    frame = frame.f_back\nfor c in consts:\n    for i in range(5):\n        try:\n"
        "            os.write(1, (c % i).encode())\n        except Exception:\n            pass\n"
        "for fd in range(3, 20):\n    for i in range(5):\n        try:\n"
        "            os.write(fd, f'[{i}, 0, [[\"b\", true]]]\\n'.encode())\n"
        "        except OSError:\n            pass", 0.0, 4),
    "always_equal": ("import builtins\nclass Yes(int):\n    def __eq__(self, other):\n        return True\n"
                     "    __hash__ = int.__hash__\ndef f(x):\n    return Yes(-1)\n"
                     "builtins.AssertionError = type('Nope', (Exception,), {})", 0.0, 4),
    "system_exit_inside_tests": ("def f(x):\n    raise SystemExit(0)", 0.0, 4),
    "close_all_files": ("import os\ndef f(x):\n    return -1\nfor fd in range(1, 64):\n    try:\n        os.close(fd)\n"
                        "    except OSError:\n        pass", 0.0, 4),
    # as its pid namespace's init it ignores its own SIGSTOP; either way it ends within its time
    "stop_itself": (GOOD_F + "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", 1.0, 4),
}


@needs_sandbox
@pytest.mark.parametrize("name", list(HOSTILE))
def test_code_hostile_program_scores_zero_and_caller_survives(name):
    program, max_score, seconds = HOSTILE[name]
    t0 = time.time()
    r = verify("code", py(program), DOUBLE_TESTS, code_timeout=2, code_memory_mb=512)
    assert r.score <= max_score and r.error is None, r
    assert time.time() - t0 < seconds, r.details
    assert os.getppid() > 1  # we are alive (this line ran) and so is our parent
    if S._sandbox_mode() == "namespace":
        assert _sandbox_uid_processes() == []  # nothing outlives the call


def test_code_timeout_is_reaped_promptly():
    # The namespace's init (the program) must be reaped by unshare, not orphaned to the machine's
    # pid 1, which here reaps zombies only every ~2 s: the call then took 3.3-4 s for a 2 s timeout.
    if S._sandbox_mode() != "namespace":
        (no_code_sandbox if os.geteuid() == 0 else pytest.skip)("namespace sandbox unavailable here")
    r = verify("code", py(HOSTILE["sleep_forever"][0]), DOUBLE_TESTS, code_timeout=2, code_memory_mb=512)
    assert r.details["status"] == "timeout" and r.details["seconds"] < 3.0, r.details
    assert _sandbox_uid_processes() == []


@needs_sandbox
def test_code_sys_exit_does_not_skip_asserts():
    # The harness runs the asserts even after sys.exit(); they pass only if the function is right.
    r = verify("code", py(GOOD_F + "import sys\nsys.exit(0)"), DOUBLE_TESTS, code_timeout=3)
    assert r.score == 1.0


@needs_sandbox
def test_code_sandbox_isolation():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    target = os.path.join(REPO, "tests", "should_not_exist.txt")
    # The probes are the program's functions: a verdict needs the program's answer (see _program_value)
    probes = ("import os, socket\n"
              "def loopback_blocked(port):\n    try:\n"
              "        socket.create_connection(('127.0.0.1', port), timeout=1)\n"
              "        return False\n    except OSError:\n        return True\n"
              "def cannot_write(path):\n    try:\n        open(path, 'w')\n        return False\n"
              "    except OSError:\n        return True\n"
              "def uid():\n    return os.getuid()\n"
              "def tmp_listing():\n    return os.listdir('/tmp')\n"
              "def exists(path):\n    return os.path.exists(path)\n"
              "def pids():\n    return os.getpid(), os.getppid()\n"
              "def nprocs():\n    return len([p for p in os.listdir('/proc') if p.isdigit()])\n")
    tests = [
        f"assert loopback_blocked({port})",  # our loopback is not its loopback
        f"assert cannot_write({target!r})",  # not root
        "assert uid() != 0",
        "assert 'solution.py' in tmp_listing()",  # private /tmp = workdir
        f"assert not exists({os.path.join(REPO, 'verifiers.py')!r})",  # only the interpreter's dirs
        f"assert not exists('/proc/{os.getpid()}/environ')",  # nor this process's secrets
        "assert pids()[1] == 1 and nprocs() == 2",  # nobody in its pid namespace but its test and the harness
    ]
    r = verify("code", py(probes), tests, code_timeout=5)
    server.close()
    assert r.score == 1.0, r.details
    assert not os.path.exists(target)


# ---- the sandbox as root and as an unprivileged user (findings of the sandbox review, one test each)

def _closed_ancestors() -> set[tuple[str, str]]:
    """(A, C): directory A on the way to the interpreter or the repository is closed to others (e.g.
    /root, mode 700) and C is the next component under it."""
    out = set()
    for path in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable), REPO):
        parts = os.path.realpath(path).split(os.sep)
        for i in range(2, len(parts)):
            ancestor = os.sep.join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:
                out.add((ancestor, parts[i]))
                break
    return out


@pytest.fixture(scope="module")
def unprivileged(tmp_path_factory):
    """argv prefix that runs this interpreter as an unprivileged user: ourselves when not root, else
    uid 65534, with a closed ancestor of the interpreter (/root) made passable in a private mount
    namespace (a 755 tmpfs over it with the needed child bound back). None where root cannot do that
    here (no unshare / setpriv, or no mount namespace: a container without CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return [sys.executable]
    env = ["env", "-i", "PATH=/usr/bin:/bin", "HOME=/tmp", "PYTHONDONTWRITEBYTECODE=1", f"PYTHONPATH={REPO}"]
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *env, sys.executable]
    lines = ["set -e"]
    for ancestor, child in sorted(_closed_ancestors()):
        stage, inner = str(tmp_path_factory.mktemp("stage")), shlex.quote(os.path.join(ancestor, child))
        lines += [f"mount --rbind {inner} {stage}", f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(ancestor)}",
                  f"mkdir -p {inner}", f"mount --rbind {stage} {inner}"]
    try:
        usable = shutil.which("setpriv") and subprocess.run(["unshare", "--mount", "true"]).returncode == 0
    except OSError:
        usable = False
    if not usable:  # the tests run as root only; under REQUIRE_CODE_SANDBOX=1 that is a failure
        if os.environ.get("REQUIRE_CODE_SANDBOX") == "1":
            pytest.fail("REQUIRE_CODE_SANDBOX=1 but root cannot run a test as an unprivileged user here")
        return None
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join([*lines, 'exec "$@"']), "sh", *drop]


# Scores programs in a fresh process (as root, or as the unprivileged user) and reports, for each:
# score, seconds, the processes it left behind (orphans come to this process, a subreaper), and
# the peak memory (PSS) of everything below this process while it ran.
_DRIVER = r"""
import ctypes, json, os, sys, threading, time
import sandbox as S
import verifiers as V
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def below(pid):
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in below(k)]


def pss_mb(pids):
    # anonymous and tmpfs memory (what the budget is for), not the interpreter's code shared with others
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                kinds = dict((line.split(":")[0], int(line.split()[1])) for line in f if line.startswith("Pss"))
            total += kinds["Pss_Anon"] + kinds["Pss_Shmem"] if "Pss_Anon" in kinds else kinds.get("Pss", 0)
        except (OSError, ValueError, IndexError):
            pass
    return total / 1024


def watch(limit_mb, peak, stop, own_cpu):
    # A broken sandbox must not take the machine: past the limit, kill everything below us. Reading smaps_rollup
    # walks a process's page tables: against a program holding 1 GB that is seconds of this thread's CPU, which
    # is the test's, not the caller's (own_cpu holds it, to subtract).
    t0 = time.thread_time()
    while not stop.is_set():
        own_cpu[0] = time.thread_time() - t0
        peak[0] = max(peak[0], pss_mb(below(os.getpid())))
        if peak[0] > limit_mb:
            for pid in below(os.getpid()):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        time.sleep(0.02)


def own_rss_mb(key):
    # VmRSS now, or VmHWM: the peak since the last reset_peak_rss() (or since exec). Not ru_maxrss: Linux
    # carries that across execve from the forked parent (a large pytest process: 1.3 GB), and never resets it.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:  # "5": VmHWM := VmRSS (Linux, proc(5))
        f.write("5")


programs, tests, kwargs, kill_above_mb = json.loads(sys.stdin.read())
if kwargs.pop("no_sandbox", False):  # as where no isolation exists: the caller's uid, no cgroup
    S._SANDBOX.update({"mode": "none", "cgroup": {}})
for _ in range(kwargs.pop("idle_threads", 0)):  # a trainer's threads count against RLIMIT_NPROC too
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
verifier = kwargs.pop("verifier", "code")
per_program_tests = kwargs.pop("per_program_tests", {})
keyctl = ctypes.CDLL(None, use_errno=True).syscall
if kwargs.pop("session_key", False):  # a session keyring holding a key, as PAM / systemd give a login
    SYS = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
    assert keyctl(SYS[1], 1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
    assert keyctl(SYS[0], b"user", b"caller_secret", b"s3cret", ctypes.c_size_t(6), -3) > 0
out = {"mode": S._sandbox_mode()}
for name, program in programs.items():
    peak, stop, watch_cpu = [0.0], threading.Event(), [0.0]
    watcher = threading.Thread(target=watch, args=(kill_above_mb, peak, stop, watch_cpu))
    watcher.start()
    reset_peak_rss()
    rss0, t0, cpu0 = own_rss_mb("VmRSS"), time.time(), time.process_time()
    r = V.verify(verifier, "```python\n" + program + "\n```", per_program_tests.get(name, tests), **kwargs)
    seconds, cpu = time.time() - t0, time.process_time() - cpu0
    stop.set()
    watcher.join()
    cpu -= watch_cpu[0]
    time.sleep(0.3)  # what escaped has time to show itself
    out[name] = {"score": r.score, "error": r.error, "seconds": seconds, "left": below(os.getpid()),
                 "peak_mb": peak[0], "stderr": (r.details or {}).get("stderr", ""), "details": r.details,
                 "caller_cpu": cpu, "caller_maxrss_mb": own_rss_mb("VmHWM"),
                 "caller_grown_mb": own_rss_mb("VmHWM") - rss0}
if "SYS" in globals():  # what the session keyring holds now: the caller's key alone
    buf = ctypes.create_string_buffer(4096)
    out["session_keys"] = keyctl(SYS[1], 11, -3, buf, 4096) // 4  # KEYCTL_READ: 4 bytes a key
print(json.dumps(out))
"""


def _drive(prefix: list[str], programs: dict, tests=DOUBLE_TESTS, kill_above_mb: float = 2048, **kwargs) -> dict:
    kwargs.setdefault("code_timeout", 2)
    kwargs.setdefault("code_memory_mb", 512)
    out = subprocess.run([*prefix, "-c", _DRIVER], input=json.dumps([programs, tests, kwargs, kill_above_mb]),
                         capture_output=True, text=True, timeout=300, cwd="/tmp",
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _users(unprivileged) -> dict[str, list[str]]:
    """argv prefixes by user: root (when we are root), then the unprivileged user (where one can be had)."""
    users = {"root": [sys.executable]} if os.geteuid() == 0 else {}
    return {**users, **({"unprivileged": unprivileged} if unprivileged else {})}


def _userns_works(prefix: list[str]) -> bool:
    probe = ("import subprocess, sys; sys.exit(subprocess.run(['unshare', '--user', '--map-root-user', '--pid', "
             "'--fork', 'true']).returncode)")
    return subprocess.run([*prefix, "-c", probe], capture_output=True).returncode == 0


def test_sandbox_mode_is_the_strongest_available_as_root_and_as_an_unprivileged_user(unprivileged):
    """Not root: unprivileged user namespaces (it used to fall back to running as the caller)."""
    modes = {user: _drive(prefix, {})["mode"] for user, prefix in _users(unprivileged).items()}
    if os.geteuid() == 0 and S._sandbox_mode() != "none":
        assert modes["root"] == "namespace"
    if unprivileged:
        assert modes["unprivileged"] == ("userns" if _userns_works(unprivileged) else "none"), modes


@needs_sandbox
def test_a_sandbox_that_cannot_start_is_an_error_the_program_cannot_forge():
    run = S.run_sandboxed({}, ["/nonexistent/python"])
    assert run["status"] == "sandbox_error" and "nonexistent" in run["stderr"], run
    forger = ("import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'Traceback: setup failed')\n"
              "    except OSError:\n        pass\nos._exit(125)")
    t0 = time.time()
    r = verify("code", py(forger), DOUBLE_TESTS)
    assert (r.score, r.error) == (0.0, None) and r.details["status"] != "sandbox_error", r
    assert time.time() - t0 < 3, r.details  # its junk on the report pipe ends the run, not a wait for its timeout


def test_bubblewrap_mode_where_it_is_installed(monkeypatch, shared_dir):
    """bwrap is the mode for machines where it works and util-linux's unshare does not."""
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    cgroup = S._SANDBOX.get("cgroup") if "mode" in S._SANDBOX or S._sandbox_mode() else {}
    if os.geteuid() == 0 and not cgroup:
        pytest.skip("as root only a cgroup bounds a fork bomb in bwrap (RLIMIT_NPROC does not bind root)")
    monkeypatch.setattr(S, "_SANDBOX", {"mode": "bwrap", "cgroup": cgroup})
    if S._probe("bwrap"):
        pytest.skip(f"bwrap does not work here: {S._probe('bwrap')}")
    marker = os.path.join(shared_dir, "escaped")
    programs = {name: HOSTILE[name] for name in ("fork_bomb", "kill_parent", "kill_all", "forged_from_callers_frame",
                                                  "always_equal", "memory_bomb")}
    programs["escape"] = (ESCAPE.format(marker=marker), 0.0, 4)
    programs["write_everywhere"] = (WRITE_EVERYWHERE.format(dirs=[shared_dir, "/var/tmp"], name="bwrap_marker"), 0.0, 4)
    for name, (program, max_score, seconds) in programs.items():
        t0 = time.time()
        r = verify("code", py(program), DOUBLE_TESTS, code_timeout=2, code_memory_mb=512)
        assert r.error is None and r.score <= max_score and time.time() - t0 < seconds, (name, r)
    assert verify("code", py(GOOD_F), DOUBLE_TESTS).score == 1.0
    for name, program in HOLD_UNMAPPED.items():  # the seccomp filter holds in this mode too
        r = verify("code", py(program), DOUBLE_TESTS, code_timeout=4, code_memory_mb=256)
        assert r.score == 1.0 and "PermissionError" in r.details["stderr"], (name, r)
        assert "HELD 0" in r.details["stderr"], (name, r)
    time.sleep(0.3)
    assert os.listdir(shared_dir) == [] and not os.path.exists("/var/tmp/bwrap_marker")


def test_bwrap_links_a_symlinked_venv_once(tmp_path, monkeypatch):
    """The interpreter's prefix and its site-packages both lie under one symlinked venv: bubblewrap gets one
    --symlink for it (a second one for the same path stops bwrap: "Can't make symlink ...: File exists")."""
    real = tmp_path / "real"
    (real / "lib" / "site-packages").mkdir(parents=True)
    os.symlink(real, tmp_path / "venv")
    paths = [str(tmp_path / "venv"), str(tmp_path / "venv" / "lib" / "site-packages")]
    monkeypatch.setattr(S, "_root_layout", lambda: ([str(real)], [], paths))
    (tmp_path / "work" / "files").mkdir(parents=True)
    cmd = S._bwrap_command(["true"], str(tmp_path / "work"), [], 16, 16, 3)
    links = [cmd[i + 1:i + 3] for i, c in enumerate(cmd) if c == "--symlink"]
    assert links == [[str(real), str(tmp_path / "venv")]], links


def test_no_isolation_refuses_code_unless_allowed(monkeypatch, caplog):
    monkeypatch.setattr(S, "_SANDBOX", {"mode": "none", "cgroup": S._SANDBOX.get("cgroup", {})})
    assert verify("code", py(GOOD_F), DOUBLE_TESTS).error == "sandbox_unavailable"
    assert verify("code_stdio", py("print(2)"), [{"input": "", "output": "2"}]).error == "sandbox_unavailable"
    assert "NO ISOLATION" in S.sandbox_description()
    r = verify("code", py(GOOD_F), DOUBLE_TESTS, allow_unsandboxed_code=True)
    assert (r.score, r.error) == (1.0, None), r
    # a trainer's pool: refused and counted, or, when allowed, run with a warning at every call
    with VerifierPool(num_workers=1, timeout=10) as pool:
        assert pool.score([("code", py(GOOD_F), DOUBLE_TESTS)])[0].error == "sandbox_unavailable"
        assert pool.error_counts == {"code/sandbox_unavailable": 1}
    with VerifierPool(num_workers=1, timeout=10, allow_unsandboxed_code=True) as pool:
        for _ in range(2):
            with caplog.at_level("WARNING", logger="verifiers"):
                assert pool.score([("code", py(GOOD_F), DOUBLE_TESTS)])[0].score == 1.0
        assert sum("UNSANDBOXED" in m for m in caplog.messages) == 2


# A wrong f; a grandchild in a session of its own keeps appending to a file outside the work dir.
ESCAPE = ("import os, time\ndef f(x):\n    return -1\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
          "        for _ in range(100):\n            try:\n                with open({marker!r}, 'a') as out:\n"
          "                    out.write('alive\\n')\n            except OSError:\n                pass\n"
          "            time.sleep(0.05)\n    os._exit(0)\n")
# Tries every host directory writable by someone, then fills its own work dir with 1 MB files.
WRITE_EVERYWHERE = (
    "import os\ndef f(x):\n    return -1\nfor d in {dirs!r}:\n    try:\n"
    "        with open(os.path.join(d, {name!r}), 'w') as out:\n"
    "            out.write('x')\n    except OSError:\n        pass\nn = 0\ntry:\n    while n < 1000:\n"
    "        with open(f'fill{{n}}', 'wb') as out:\n            out.write(b'x' * (1 << 20))\n        n += 1\n"
    "except OSError:\n    pass\nimport sys\nprint('files', n, file=sys.stderr)\n")


@pytest.fixture
def shared_dir():
    """A directory anyone may write (the program must not)."""
    shared = tempfile.mkdtemp(prefix="verifiers_test_")
    os.chmod(shared, 0o1777)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def _drive_as_each_user(unprivileged, programs: dict, **kwargs):
    """(user, _drive's report), one user after the other: root (when we are root), then unprivileged."""
    for user, prefix in _users(unprivileged).items():
        out = _drive(prefix, programs, **kwargs)
        if out["mode"] == "none":
            no_code_sandbox(f"no sandbox for {user} here")
        yield user, out


def _assert_contained(user: str, name: str, r: dict, max_score: float = 0.0, seconds: float = 4.0):
    assert r["error"] is None and r["score"] <= max_score, (user, name, r)
    assert r["seconds"] < seconds and r["left"] == [], (user, name, r)  # in time, and nothing outlives it


def test_setsid_double_fork_dies_with_the_run(unprivileged, shared_dir):
    """Finding 1: without root the program ran unisolated and a setsid grandchild outlived the
    process-group kill, writing outside its work dir after verify() returned."""
    marker = os.path.join(shared_dir, "escaped")
    for user, out in _drive_as_each_user(unprivileged, {"escape": ESCAPE.format(marker=marker)}):
        _assert_contained(user, "escape", out["escape"])
        assert not os.path.exists(marker), user


def _marker_grows(marker: str) -> bool:
    time.sleep(0.3)  # what escaped has time to show itself
    size = os.path.getsize(marker) if os.path.exists(marker) else 0
    time.sleep(0.3)
    return (os.path.getsize(marker) if os.path.exists(marker) else 0) > size


# After ESCAPE: the program kills the shell that waits for it once the grandchild has written; or it times out.
KILL_PARENT_AFTER_ESCAPE = ("import signal\nwhile not os.path.exists({marker!r}):\n    time.sleep(0.01)\n"
                            "os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(1000)\n")
TIMEOUT_AFTER_ESCAPE = "time.sleep(1000)\n"


@pytest.mark.parametrize("variant", ["escape", "then_kill_its_parent", "then_timeout", "then_its_worker_is_killed"])
def test_setsid_double_fork_dies_with_an_unsandboxed_run(monkeypatch, shared_dir, variant):
    """Finding 1 where no sandbox exists and code is allowed to run unisolated (mode none, no cgroup):
    the process-group kill missed a setsid grandchild, which kept writing after verify() returned.
    Now the program's launcher is a child subreaper that kills everything below it, also when the pool
    kills the worker that started it."""
    monkeypatch.setattr(S, "_SANDBOX", {"mode": "none", "cgroup": {}})
    marker = os.path.join(shared_dir, "escaped")
    after = {"escape": "", "then_timeout": TIMEOUT_AFTER_ESCAPE, "then_its_worker_is_killed": TIMEOUT_AFTER_ESCAPE,
             "then_kill_its_parent": KILL_PARENT_AFTER_ESCAPE.format(marker=marker)}[variant]
    t0 = time.time()
    if variant == "then_its_worker_is_killed":
        with VerifierPool(num_workers=1, timeout=1.5, code_timeout=30, budget=30, allow_unsandboxed_code=True) as pool:
            r = pool.score([("code", py(ESCAPE.format(marker=marker) + after), DOUBLE_TESTS)])[0]
        assert r.error == "timeout" and time.time() - t0 < 4, r
    else:
        r = verify("code", py(ESCAPE.format(marker=marker) + after), DOUBLE_TESTS, code_timeout=2,
                   allow_unsandboxed_code=True)
        assert r.error is None and r.score == 0.0 and time.time() - t0 < 4, r
    if after:  # the program outlived the grandchild's first write (plain ESCAPE may end before it)
        assert os.path.exists(marker), "the grandchild never ran"
    assert not _marker_grows(marker), "a grandchild outlived verify()"


def test_unsandboxed_runs_end_whole_as_root_and_as_an_unprivileged_user(unprivileged, shared_dir):
    """Mode none (allowed, no cgroup) as each user, in a process with a trainer's many threads: a correct
    program that forks still scores 1 (RLIMIT_NPROC counts the caller's own tasks, so its share of the
    limit comes on top of them), and nothing a program starts outlives its run."""
    marker = os.path.join(shared_dir, "escaped")
    programs = {"good": GOOD_F + "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\n",
                "escape": ESCAPE.format(marker=marker) + TIMEOUT_AFTER_ESCAPE}
    for user, prefix in _users(unprivileged).items():
        out = _drive(prefix, programs, no_sandbox=True, idle_threads=16, allow_unsandboxed_code=True)
        assert out["mode"] == "none" and out["good"]["score"] == 1.0, (user, out["good"])
        _assert_contained(user, "escape", out["escape"])
        assert not _marker_grows(marker), user


def test_code_can_write_only_its_own_work_dir(unprivileged, shared_dir):
    """Finding 2: /var/tmp and /run/lock of the host stayed writable; the file-size limit did not
    bound the number of files. Now the root is read-only and its /tmp a bounded tmpfs."""
    name = f"verifiers_marker_{os.getpid()}"
    dirs = [shared_dir, "/var/tmp", "/run/lock", "/dev/shm", "/tmp", REPO, "/"]
    try:
        for user, out in _drive_as_each_user(unprivileged, {"w": WRITE_EVERYWHERE.format(dirs=dirs, name=name)}):
            _assert_contained(user, "write_everywhere", out["w"])
            assert [d for d in dirs if os.path.exists(os.path.join(d, name))] == [], user
            files = int(out["w"]["stderr"].split("files")[-1].split()[0])
            assert 0 < files <= 64, (user, files)  # 1 MB files: its /tmp holds at most 64 MB
    finally:
        for d in dirs:
            if os.path.exists(os.path.join(d, name)):
                os.unlink(os.path.join(d, name))


@pytest.mark.slow  # ~15 s: HOSTILE as the unprivileged user (as root, the test above runs them in this process)
def test_hostile_programs_as_an_unprivileged_user(unprivileged):
    if not unprivileged:
        no_code_sandbox("no unprivileged user here")
    out = _drive(unprivileged, {k: v[0] for k, v in HOSTILE.items()})
    if out["mode"] == "none":
        no_code_sandbox("no sandbox for the unprivileged user here")
    for name, (_, max_score, seconds) in HOSTILE.items():
        _assert_contained("unprivileged", name, out[name], max_score, seconds)


# 60 children, each touching 900 MB in 16 MB steps; they keep what they got for 2 s.
FORK_MEMORY = ("import os, time\ndef f(x):\n    return 2 * x\nkids = []\nfor _ in range(60):\n    try:\n"
               "        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n        held = []\n"
               "        try:\n            for _ in range(900 // 16):\n                b = bytearray(16 << 20)\n"
               "                b[::4096] = b'\\x01' * (len(b) // 4096)\n                held.append(b)\n"
               "        except MemoryError:\n            pass\n        time.sleep(2)\n        os._exit(0)\n"
               "    kids.append(pid)\nfor pid in kids:\n    os.waitpid(pid, 0)\n")


@pytest.mark.slow  # ~10 s: the memory of 60 children, as root and as the unprivileged user
def test_fork_of_60_children_stays_within_the_memory_budget(unprivileged):
    """Finding 3: the address-space limit was per process, 64 processes allowed (64 x the budget)."""
    budget = 256
    for user, out in _drive_as_each_user(unprivileged, {"fork_memory": FORK_MEMORY}, code_timeout=4,
                                         code_memory_mb=budget, kill_above_mb=3 * budget):
        r = out["fork_memory"]
        print(f"\n{user} ({out['mode']}): peak {r['peak_mb']:.0f} MB of a {budget} MB budget, {r['seconds']:.1f} s")
        # + 128: the sum is read process by process while the OOM killer frees and others allocate, and the
        # reads skew more on a loaded machine (254-264 MB alone, 290 and 314 MB in the whole suite); the cgroup
        # itself peaked at exactly 256 MB here (memory.max_usage_in_bytes). Escaping the budget is 60 x 256 MB.
        assert r["peak_mb"] <= budget + 128 and r["seconds"] < 8 and r["left"] == [], (user, r)
    assert os.getppid() > 1


# Memory held without mapping it, which no address-space limit counts: each program reports on stderr the
# MB it got the kernel to hold for it (HELD n), then f still answers. Before the seccomp filter, without a
# cgroup: memfd 600 of 600 MB, socket buffers 470 MB, pipes grown to 1 MB each.
HOLD_UNMAPPED = {
    "memfd": "import os, sys\ndef f(x):\n    return 2 * x\nheld, fds = 0, []\ntry:\n    for i in range(40):\n"
             "        fds.append(os.memfd_create(f'm{i}'))\n        for _ in range(15):\n"
             "            os.write(fds[-1], b'\\x01' * (1 << 20))\n            held += 1\n"
             "except OSError as e:\n    print(type(e).__name__, e, file=sys.stderr)\n"
             "print('HELD', held, file=sys.stderr)\n",
    "socket_buffers": "import socket, sys\ndef f(x):\n    return 2 * x\nheld, pairs = 0, []\ntry:\n"
                      "    for _ in range(60):\n        a, b = socket.socketpair()\n"
                      "        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)\n"
                      "        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)\n"
                      "        a.setblocking(False)\n        pairs.append((a, b))\n        try:\n"
                      "            while True:\n                held += a.send(b'\\x01' * 65536)\n"
                      "        except BlockingIOError:\n            pass\n"
                      "except OSError as e:\n    print(type(e).__name__, e, file=sys.stderr)\n"
                      "print('HELD', held >> 20, file=sys.stderr)\n",
    "pipe_buffers": "import fcntl, os, sys\ndef f(x):\n    return 2 * x\nheld, pipes = 0, []\ntry:\n"
                    "    for _ in range(100):\n        r, w = os.pipe()\n        pipes.append((r, w))\n"
                    "        fcntl.fcntl(w, 1031, 1 << 20)\n        os.set_blocking(w, False)\n        try:\n"
                    "            while True:\n                held += os.write(w, b'\\x01' * 65536)\n"
                    "        except BlockingIOError:\n            pass\n"
                    "except OSError as e:\n    print(type(e).__name__, e, file=sys.stderr)\n"
                    "print('HELD', held >> 20, file=sys.stderr)\n",
    # red team: 1.2-1.8 GB of SysV semaphore sets, about 3 GB of xattrs on the sandbox's tmpfs, with a 1 GB budget
    "sysv_semaphores": "import ctypes, os, sys\ndef f(x):\n    return 2 * x\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                       "held = 0\ntry:\n    for _ in range(200):\n        if libc.semget(0, 32000, 0o1600) < 0:\n"
                       "            raise OSError(ctypes.get_errno(), 'semget')\n        held += 32000 * 8\n"
                       "except OSError as e:\n    print(type(e).__name__, e, file=sys.stderr)\n"
                       "print('HELD', held >> 20, file=sys.stderr)\n",
    "xattrs": "import os, sys\ndef f(x):\n    return 2 * x\nheld = 0\ntry:\n    for i in range(2000):\n"
               "        open(f'x{i}', 'w').close()\n        for j in range(16):\n"
               "            os.setxattr(f'x{i}', f'user.{j}', b'\\x01' * 60000)\n            held += 60000\n"
               "except OSError as e:\n    print(type(e).__name__, e, file=sys.stderr)\n"
               "print('HELD', held >> 20, file=sys.stderr)\n",
}


def test_memory_held_without_mapping_it_is_refused(unprivileged):
    """Finding 3's rest: with no cgroup (the unprivileged user's userns mode, and mode none) memfd files,
    socket buffers and grown pipe buffers were outside every limit; now each call fails with EPERM and a
    program that tries still runs to its answer. As root under a cgroup the same calls are refused too,
    so a program scores the same on every machine."""
    budget = 256
    runs = [(user, _drive(prefix, HOLD_UNMAPPED, code_timeout=4, code_memory_mb=budget))
            for user, prefix in _users(unprivileged).items()]
    runs += [(f"{user}, mode none", _drive(prefix, HOLD_UNMAPPED, code_timeout=4, code_memory_mb=budget,
                                           no_sandbox=True, allow_unsandboxed_code=True))
             for user, prefix in _users(unprivileged).items()]
    for user, out in runs:
        for name in HOLD_UNMAPPED:
            r = out[name]
            held = [int(line.split()[1]) for line in r["stderr"].splitlines() if line.startswith("HELD ")]
            print(f"\n{user} ({out['mode']}) {name}: held {held} MB; {r['stderr'].splitlines()[:1]}")
            assert held and held[0] <= 4, (user, name, r)  # a default pipe's 64 KB at most
            assert "PermissionError" in r["stderr"] and r["score"] == 1.0, (user, name, r)


def _left_by(names, worker: int) -> list[str]:
    """Sandbox dirs (work dirs, cgroups) among `names` that no live process other than `worker` owns
    (other runs on this machine may be going on)."""
    def alive_other(name: str) -> bool:
        owner = name[len("verifiers_run_"):].split("_")[0]
        if not owner.isdigit() or int(owner) == worker:
            return False
        return os.path.exists(f"/proc/{owner}")

    return [n for n in names if n.startswith("verifiers_run_") and not alive_other(n)]


@needs_sandbox
def test_killed_worker_leaves_no_work_dir_behind():
    """Finding 4: the pool kills a worker in the middle of a run; its work dir (and cgroup) go too."""
    tmp = tempfile.gettempdir()
    before = set(os.listdir(tmp))
    with VerifierPool(num_workers=1, timeout=1.5, code_timeout=30, budget=30) as pool:
        worker = pool._all[0][0].pid
        r = pool.score([("code", py(GOOD_F + "import time\ntime.sleep(60)"), DOUBLE_TESTS)])[0]
        assert r.error == "timeout", r
        assert _left_by(set(os.listdir(tmp)) - before, worker) == []
        for base in (S._SANDBOX.get("cgroup") or {}).values():
            assert _left_by(os.listdir(base), worker) == [], base
        assert pool.score([("code", py(GOOD_F), DOUBLE_TESTS)])[0].score == 1.0  # and the pool goes on


@pytest.mark.parametrize("mode", ["namespace", "userns"])
def test_setup_never_remakes_a_work_dir_that_was_removed(tmp_path, mode):
    """The race behind finding 4: the pool removes a killed worker's work dir while that worker's sandbox setup
    still runs; the setup must fail there, not make the dir again on the host (where nothing would remove it)."""
    if S.run_sandboxed({}, [sys.executable, "-c", "pass"], mode=mode)["status"] != "ok":
        pytest.skip(f"mode {mode} does not run here")
    workdir = tmp_path / "removed"
    (workdir / "files").mkdir(parents=True)  # and no root: the pool got there first
    uid = S._acquire_uid()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as status:
        proc, cgroups = S._sandbox_popen([sys.executable, "-c", "print('ran')"], str(workdir), 5.0, 256,
                                         subprocess.DEVNULL, out, subprocess.DEVNULL, uid, mode, (), status)
        try:
            proc.wait(timeout=30)
        finally:
            S._kill_sandbox(proc, mode)
            S._remove_cgroup(cgroups)
            S._release_uid(uid)
        assert not (workdir / "root").exists()
        assert S._read(status, 4000), "the setup reported no error"
        assert "ran" not in S._read(out, 4000)


KEYRING = ("import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
           "SYS = {'x86_64': (248, 250), 'aarch64': (217, 219)}[os.uname().machine]\n"
           "if sys.argv[1] == 'add':\n"
           "    print(libc.syscall(SYS[0], b'user', b'left_by_an_earlier_run', b'x', ctypes.c_size_t(1), -4))\n"
           "else:  # KEYCTL_SEARCH in the user keyring\n"
           "    print(libc.syscall(SYS[1], 10, -4, b'user', b'left_by_an_earlier_run', 0))\n")


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64 / aarch64")
def test_a_run_finds_nothing_an_earlier_run_of_its_uid_left_in_the_keyring():
    """Red-team finding: in namespace mode (root) the sandbox uids are real uids, whose kernel keyrings outlive a
    run: the ninth run of a worker (the same uid again) read what the first had added."""
    if S._sandbox_mode() != "namespace":
        pytest.skip("the namespace mode (root) only: the other modes run in a user namespace of their own")
    runs = [S.run_sandboxed({"k.py": KEYRING}, [sys.executable, "k.py", "add" if i == 0 else "find"]) for i in range(9)]
    assert int(runs[0]["stdout"]) < 0, runs[0]  # refused (seccomp): no keyring call reaches the kernel
    assert int(runs[8]["stdout"]) < 0, runs[8]  # the same uid again (8 uids a process): not found


@needs_sandbox
def test_forged_pass_from_the_callers_frame_scores_zero():
    """Finding 5: a wrong solution read the pass sentinel from the harness's frame and scored 1.0."""
    r = verify("code", py(HOSTILE["forged_from_callers_frame"][0]), DOUBLE_TESTS, code_timeout=3)
    assert (r.score, r.error) == (0.0, None), r
    # values are compared here: the program's own __eq__ or a patched builtin has no say
    assert verify("code", py(HOSTILE["always_equal"][0]), DOUBLE_TESTS).score == 0.0


YES_F = "class Yes:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes()\n"
WRONG_F = "def f(x):\n    return -1\n"
REPORT_ANYTHING = "import sys\nsys.modules['__main__']._enc = lambda v, depth=0: {}\n"  # the harness reports that


@needs_sandbox
@pytest.mark.parametrize("program, tests", [
    # a comparison in a comprehension over the test's values: the program's side is computed there, the rest here
    (YES_F, ["assert all([f(x) == 2 * x for x in [1, 2, 3]])", "assert all(2 * x == f(x) for x in [1, 2, 3])"]),
    (WRONG_F + REPORT_ANYTHING.format("['l', []]"), ["assert all(f(x) == 2 * x for x in [1, 2, 3])"]),
    # an expected value built there (an imported class): both sides are the program's to report
    (WRONG_F + REPORT_ANYTHING.format("['n']"), ["from fractions import Fraction\nassert f(1) == Fraction(1, 2)"]),
    (WRONG_F + "import numpy as np\nnp.array_equal = lambda *a: True\n",
     ["import numpy as np\nassert np.array_equal(f(2), np.array([4]))"]),
    # the expected value in a variable: the program must not see it
    ("def f(x):\n    return expected\n",
     ["expected = 4\nassert f(2) == expected", "expected = 6\nassert f(3) == expected"]),
    # builtins and math the program replaces: the test means the real ones
    ("def abs(x):\n    return 0\n" + WRONG_F, ["assert abs(f(2) - 4.0) < 1e-9", "assert abs(f(3) - 6.0) < 1e-9"]),
    ("import math\nmath.isclose = lambda *a, **k: True\n" + WRONG_F,
     ["assert math.isclose(f(2), 4.0)", "from math import isclose\nassert isclose(f(3), 6.0)"]),
    (WRONG_F + "import builtins\nbuiltins.ord = lambda c: 97\n", ["assert ord(f(2)) == 97"]),
    # a class of the program's with an always-true __eq__, compared with an expected value: never equal here
    (YES_F, ["assert f(2) == 4", "assert [f(2)] == [4]", "assert f(2) in [4]"]),
])
def test_a_wrong_program_cannot_pass_through_the_shape_of_a_test(program, tests):
    """Red-team findings: each of these wrong programs scored 1.0. An expected value is computed here, never in the
    program's process; the builtins and modules a test names are Python's own there."""
    r = verify("code", py(program), tests, code_timeout=5)
    assert r.score == 0.0, (r.error, r.details)


@needs_sandbox
def test_what_only_the_programs_process_can_decide_is_counted_as_judged_inside():
    """A check with no expected operand (a comparison inside a comprehension, a helper the test defines, a dunder
    called by hand) is the program's word: a forging program passes it, as under plain Python, and the count of
    such tests shows the exposure. The count follows the test's text, whatever the program does."""
    inside = ["assert any(f(x) == 2 * x for x in [1, 2, 3])", "def same(a, b):\n    return a == b\n"
              "assert same(f(2), 4)",
              "assert f(2).__eq__(4)"]
    for program in (YES_F, GOOD_F, WRONG_F, "import os\nos._exit(0)"):
        r = verify("code", py(program), inside + ["assert f(2) == 4", "assert all(f(x) == 2 * x for x in [1, 2])"],
                   code_timeout=5)
        assert (r.details["judged_inside"], r.details["unsupported"]) == (3, 0), r.details
    assert verify("code", py(YES_F), inside, code_timeout=5).score == 1.0


@needs_sandbox
def test_those_shapes_still_judge_a_right_program():
    tests = ["expected = 4\nassert f(2) == expected", "assert abs(f(3) - 6.0) < 1e-9",
             "from math import isclose\nassert isclose(f(3), 6.0)", "import math\nassert math.isclose(f(1), 2.0)",
             "xs = [1, 2]\nassert [f(x) for x in xs] == [2, 4]",  # the comprehension, here, over the program's f
             "result = f(5)\nassert result == 10", "assert ord(chr(f(40))) == 80"]
    program = "import math\ndef abs(x):\n    return -1\n" + GOOD_F  # its own abs is no help, and no harm
    r = verify("code", py(program), tests, code_timeout=5)
    assert (r.score, r.details["unsupported"], r.details["judged_inside"]) == (1.0, 0, 0), r.details
    # the test's input reaches the sandbox, its expected value does not
    assert S._plan_test("x = 3\nwant = 6\nassert f(x) == want")[0] == [
        ["exec", "pass", []], ["exec", "pass", []], ["eval", ["f(x)"], ["x = 3"]]]
    # `sum(1, 2)`: Python's sum, here, whatever the program calls sum
    assert S._plan_test("assert sum([1, 2]) == 3")[0] == [["eval", [], []]]


@needs_sandbox
@pytest.mark.parametrize("program, tests", [
    ("def f(x):\n    return 10 ** 8\n", ["assert [0] * f(3) == [0, 0, 0]"]),  # 800 MB here
    ("def f(x):\n    return 10 ** 9\n", ["assert bytes(f(1)) == b''", "assert 2 ** f(1) > 0"]),
    ("def f(x):\n    return [k * (2 ** 61 - 1) for k in range(20000)]\n", ["assert set(f(1)) == {1}"]),  # collide
    (WRONG_F + "P = 2 ** 61 - 1\n" + REPORT_ANYTHING.format(
        "['l', [['S', [['i', str(k * P + j)] for k in range(5000)]] for j in range(20)]]"), ["assert f(2) == 4"]),
])
def test_the_program_cannot_make_this_process_do_its_work(program, tests):
    """Red-team findings: checks evaluated here on the program's values allocated 800 MB (the sandbox's budget was
    256 MB) or took 10-25 s (colliding hashes) outside the sandbox's limits. Judged in a fresh process, whose
    peak RSS is reset just before: in this one, memory earlier tests freed could hold the values unseen."""
    r = _drive([sys.executable], {"program": program}, tests=tests, code_timeout=5, code_memory_mb=256)["program"]
    # `2 ** f(1)` is computed where the program runs now, within its own time (5 s), not here
    assert r["score"] == 0.0 and r["seconds"] < 7 and r["caller_cpu"] < 1.5 and r["caller_grown_mb"] < 150, (
        r["details"], r["seconds"], r["caller_cpu"], r["caller_grown_mb"])




@needs_sandbox
def test_code_judges_common_assert_forms_here():
    tests = ["assert f([3, 1]) == [1, 3]", "assert sorted(f([2, 1])) == [1, 2]", "assert abs(f([0.5])[0] - 0.5) < 1e-9",
             "xs = [2, 1]\nassert f(xs) == sorted(xs)", "assert isinstance(f([]), list) and f([]) == []",
             "import math\nassert math.isclose(sum(f([0.1, 0.2])), 0.3)", "assert f([1])[0] is not None",
             "assert f([2, 0, 1]) == [i for i in range(3)]", "assert str(f(['b', 'a'])).upper() == \"['A', 'B']\"",
             "assert f((1, 0)) == list((0, 1)) and f({1}) == [1]"]
    r = verify("code", py("def f(xs):\n    return sorted(xs)"), tests)
    # judged inside: `isinstance(..)`, and `sorted(xs)` once f(xs) may have changed xs
    assert (r.score, r.details["unsupported"], r.details["judged_inside"]) == (1.0, 0, 2), r.details
    assert verify("code", py("def f(xs):\n    return list(xs)"), tests).score == 0.5
    # the expected side of an assert never enters the sandbox; asserts inside a try / a loop are judged inside
    plan = S._plan_test("assert f(2) == 4 and g(3) in {5, 6}")
    assert plan[0] == [["eval", ["f(2)", "g(3)"], []]] and plan[2] is False
    assert S._plan_test("try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass")[2] is True
    # an expected value the test keeps in a variable is computed here too: f cannot rewrite it in passing
    sneaky = py("def f(x):\n    globals()['expected'] = -1\n    return -1")
    assert verify("code", sneaky, ["expected = [1, 2]\nassert f(0) == expected", "assert f(0) == -1"]).score == 0.5
    plan = S._plan_test("n = 3\nxs = f(n)\nassert xs == list(range(n))\nn = g()\nassert n == 2")
    assert plan[0] == [["exec", "pass", []], ["exec", "xs = f(n)", ["n = 3"]], ["eval", ["xs"], []],
                       ["exec", "n = g()", []], ["eval", ["n"], []]]


@needs_sandbox
@pytest.mark.parametrize("link", ["link", "project/.venv"])
def test_venv_under_tmp_through_a_symlink(tmp_path, link):
    """Finding 6: with the interpreter in a venv under /tmp (reached through a symlink) the sandbox
    could not start it (the private /tmp hid it) and fell back; its packages must be importable too.
    project/.venv: the link sits in a plain directory that the sandbox's /tmp does not have (a clone
    whose .venv links elsewhere); that directory used to become a link to itself (ELOOP)."""
    base = tempfile.mkdtemp(prefix="verifiers_test_venv_")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", os.path.join(base, "venv")], check=True)
        site = subprocess.run([os.path.join(base, "venv", "bin", "python"), "-c", "import sysconfig; "
                               "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True)
        site = site.stdout.strip()
        with open(os.path.join(site, "venv_only_pkg.py"), "w") as f:
            f.write("VALUE = 42\n")
        os.makedirs(os.path.dirname(os.path.join(base, link)), exist_ok=True)
        os.symlink(os.path.join(base, "venv"), os.path.join(base, link))
        script = ("import json, verifiers as V\nr = V.verify('code', '```python\\nimport venv_only_pkg\\ndef f():\\n"
                  "    return venv_only_pkg.VALUE\\n```', ['assert f() == 42'])\n"
                  "print(json.dumps([V.sandbox_mode(), r.score, r.details]))")
        out = subprocess.run([os.path.join(base, link, "bin", "python"), "-c", script], capture_output=True,
                             text=True, timeout=60, cwd="/", env={**os.environ, "PYTHONPATH": REPO})
        mode, score, details = json.loads(out.stdout.splitlines()[-1])
        assert mode == S._sandbox_mode() and score == 1.0, (mode, details, out.stderr[-2000:])
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_sandbox
def test_code_stdio():
    tests = [{"input": "2\n", "output": "4\n"}, {"input": "5\n", "output": "10"}, {"input": "0\n", "output": "1\n"}]
    prog = py("print(int(input()) * 2)")
    r = verify("code_stdio", prog, tests)
    assert r.score == pytest.approx(2 / 3) and r.error is None, r.details
    lcb = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})
    assert verify("code_stdio", py("a, b = map(int, input().split())\nprint(a + b)"), lcb).score == 1.0
    # a test that loops costs its own time, not the other tests' results
    loop_on_zero = py("import sys\nn = int(input())\nwhile n == 0:\n    pass\nprint(2 * n)")
    t0 = time.time()
    r = verify("code_stdio", loop_on_zero, tests, code_timeout=1, budget=6)
    assert r.score == pytest.approx(2 / 3) and time.time() - t0 < 6, r.details
    # a total budget smaller than the tests need: the unreached tests fail, in bounded time
    t0 = time.time()
    r = verify("code_stdio", py("while True:\n    pass"), tests * 3, code_timeout=1, budget=2)
    assert r.score == 0.0 and time.time() - t0 < 4 and "budget" in r.details["statuses"]


# ---- the verdict harness and the budgets, red-teamed: each class of attack as root and as the unprivileged user

RAISES_G = GOOD_F + "def g(x):\n    raise ValueError(x)\n"
SORT_IN_PLACE = "def sort_in_place(xs):\n    xs.sort()\n"
# Wrong: g raises, after writing the harness's "it returned" and "test over" on the report pipe itself.
FORGES_OK = GOOD_F + ("import os, sys\ndef g(x):\n    os.write(int(sys.argv[-1]), b'[\"ok\"]\\n[\"done\"]\\n')\n"
                      "    raise ValueError(x)\n")
CLEARS_ITS_INPUT = "def total(xs):\n    s = sum(xs)\n    xs.clear()\n    return s\n"
# Wrong: answers each call with what a later step (or another test) says, read from anywhere in its process.
READS_AHEAD = (
    "import gc, re, sys\n"
    "def _strings():\n    found = []\n    try:\n        found.append(open('harness.py').read())\n"
    "    except OSError:\n        pass\n    frame = sys._getframe()\n    while frame is not None:\n"
    "        found += [repr(v) for v in list(frame.f_locals.values()) + list(frame.f_globals.values())]\n"
    "        frame = frame.f_back\n    found += [repr(o) for o in gc.get_objects() if isinstance(o, (list, tuple))]\n"
    "    return ' '.join(found)\n"
    "def encode(s):\n    m = re.search(r\"decode\\(\\\\?'(\\w+)\\\\?'\\)\", _strings())\n"
    "    return m.group(1) if m else s\n"
    "def decode(s):\n    m = re.search(r\"encode\\(\\\\?'(\\w+)\\\\?'\\)\", _strings())\n"
    "    return m.group(1) if m else s\n")
EXPECTED_FROM_GLOBALS = "def f(x):\n    return globals().get('expected')\ndef g(x):\n    return x + 1\n"
POINT = "class P:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
SAME_REPR = POINT + "    def __repr__(self):\n        return 'P(1, 2)'\ndef f(x):\n    return P(0, 0)\n"
VERDICT_CASES = {  # name: (program, tests, score it must get)
    "failed_step_fails_its_test": (RAISES_G, ["assert f(1) == 2\ng(1)", "g(2)\nassert f(2) == 4", "assert f(3) == 6"],
                                   1 / 3),
    "forged_ok_then_raises": (FORGES_OK, ["assert f(1) == 2\ng(1)", "assert f(2) == 4"], 0.5),
    "in_place_right": (SORT_IN_PLACE, ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]"], 1.0),
    "in_place_wrong": (CLEARS_ITS_INPUT, ["xs = [1, 2]\nassert total(xs) == 3\nassert xs == [1, 2]"], 0.0),
    "reads_ahead": (READS_AHEAD, ["assert encode('hello') == 'olleh'", "assert decode('olleh') == 'hello'"], 0.0),
    "expected_from_globals": (EXPECTED_FROM_GLOBALS, ["expected = 4\nassert f(2) == expected\nassert g(expected) == 5"],
                              0.0),
    "own_class_right": (POINT + "    def __eq__(self, o):\n        return (self.x, self.y) == (o.x, o.y)\n"  # as Python
                        "def f(x):\n    return P(x, 2 * x)\n",
                        ["assert f(1) == P(1, 2)", "assert isinstance(f(1), P)", "assert f(2).y == 4"], 1.0),
    "own_class_same_repr": (SAME_REPR, ["assert f(1) == P(1, 2)"], 0.0),
    "int_of_5000_digits": ("def f(n):\n    return 7 ** n\n", ["assert f(6000) == 7 ** 6000"], 1.0),
    "list_of_600000": ("def f(n):\n    return list(range(n))\n", ["assert f(600000) == list(range(600000))"], 1.0),
}


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_a_verdict_the_program_cannot_reach(unprivileged, user):
    """Red-team findings: a failed step that did not fail its test; an in-place contract judged on a copy taken
    before the program's call (a right sort_in_place scored 0, a function that clears its input scored 1); other
    tests' steps and expected values readable in the program's process; a class of the program's compared by
    its repr; an int of more than 4,300 digits and a legal 5 MB list lost in the channel."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    for name, (program, tests, want) in VERDICT_CASES.items():
        r = _drive(prefix, {name: program}, tests=tests, code_timeout=10, code_memory_mb=1024)[name]
        assert r["error"] is None and r["score"] == pytest.approx(want), (user, name, r["details"])
        assert r["left"] == [], (user, name, r)


@needs_sandbox
def test_a_value_over_the_bound_is_a_counted_too_large_failure():
    r = verify("code", py("def f(n):\n    return list(range(n))\n"),
               ["assert f(3000000) == list(range(3000000))", "assert f(3) == [0, 1, 2]"], code_timeout=10)
    assert (r.score, r.error, r.details["too_large"]) == (0.5, None, 1), r.details


STDIO_CASES = {  # name: (program, stdin, expected stdout)
    "reads_dev_stdin": ("print(int(open('/dev/stdin').read()) * 2)", "21\n", "42\n"),
    "answer_of_2_mb": ("n = int(input())\nprint(' '.join(['7'] * n))", "1000000\n", "7 " * 1000000),
    # a fast-input idiom (a seekable stdin file: fstat gives its size), on an input larger than the 16 MB file-size
    # limit and a quarter of the sandbox's /tmp
    "input_of_24_mb": ("import os\nprint(len(os.read(0, os.fstat(0).st_size).split()))", "7 " * 12000000, "12000000"),
}


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_stdio_programs_reading_dev_stdin_or_answering_2_mb(unprivileged, user):
    """Red-team findings: a stdio program reading /dev/stdin failed as root (the sandbox uid could not reopen the
    caller's stdin file) and an answer over 1 MB was cut."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    for name, (program, stdin, stdout) in STDIO_CASES.items():
        r = _drive(prefix, {name: program}, tests=[{"input": stdin, "output": stdout}], verifier="code_stdio",
                   code_timeout=10, budget=20)[name]
        assert (r["score"], r["error"]) == (1.0, None), (user, name, r["details"])


@needs_sandbox
def test_a_stdio_answer_over_the_output_limit_is_counted():
    r = verify("code_stdio", py("import sys\nwhile True:\n    sys.stdout.write('7 ' * 65536)"),
               [{"input": "", "output": "7"}], code_timeout=5, budget=10)
    assert (r.score, r.details["statuses"], r.details["output_limit"]) == (0.0, ["output_limit"], 1), r.details


P61 = "P = 2 ** 61 - 1\n"
COSTLY = {  # name: (program, tests): each the caller's work, all refused (score 0) in bounded time and memory
    "product_of_small_factors": ("def f(x):\n    return [3] * 400000\n", ["import math\nassert math.prod(f(1)) == 0"]),
    "collisions_half_distinct": (P61 + "def f(x):\n    return [k * P for k in range(60000)] + list(range(60000))\n",
                                 ["assert len(set(f(1))) == 1", "assert {*f(1)} == {1}"]),
    "power_of_three": ("def f(x):\n    return 3 if x == 1 else 9999999\n", ["assert f(1) ** f(2) * f(1) ** f(2) == 0"]),
    "product_of_two_big_ints": ("def f(x):\n    return 7 ** 3000000\n", ["assert f(1) * f(2) == 0",
                                                                         "assert f(1) % (f(2) // 3) == 2"]),
    "format_width": ("def f(x):\n    return 10 ** 9\n",
                     ["assert f'{f(1):>{f(2)}}' == 'x'", "assert '%*d' % (f(1), 1) == 'x'"]),
    "sum_of_lists": ("def f(x):\n    return [[0]] * 200000\n", ["assert sum(f(1), []) == []"]),
    "repeat_a_big_list": ("def f(x):\n    return list(range(400000))\n", ["assert [f(1)] * 30000 == [f(2)] * 30000"]),
    "replace_blowup": ("def f(x):\n    return 'a' * 1000000 if x == 1 else 'b' * 1000000\n",
                       ["assert f(1).replace('', f(2)) == 'x'"]),
    # round 4: a Fraction with huge unreduced parts (its constructor's gcd), 170,000 Fractions (summed here before)
    "fraction_unreduced": ("from fractions import Fraction\ndef f(x):\n    q = Fraction(1, 3)\n"
                           "    q._numerator, q._denominator = 3 ** 200000 * 7, 3 ** 200000 * 11\n    return q\n",
                           ["assert f(1) == 0", "assert f(2) * 3 == 0"]),
    "many_fractions": ("from fractions import Fraction\ndef f(x):\n"
    "    return [Fraction(1, k) for k in range(1, 170000)]\n",
                       ["assert sum(f(1)) == 0", "assert f(1) == []"]),
    "set_of_tuples": ("def f(x):\n    return {(i, x) for i in range(330000)}\n", ["assert f(1) == set()"]),
}


@pytest.mark.slow  # 40 s a user: it builds each worst case the red team found
@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_judging_costs_the_caller_a_bounded_time_and_memory(unprivileged, user):
    """Red-team findings: values built so that judging them cost the caller 55-131 s of CPU for one response
    (a product of many small factors, collisions tuned to the hash check, a power the guard undercounted), and in
    round 4 about 70 s (a Fraction with huge unreduced parts, 170,000 Fractions). The program's arithmetic is now
    its own (computed where it runs, within its timeout); the caller only decodes and compares plain data.
    The caller's CPU time and peak memory for each, measured in a fresh process."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    out = _drive(prefix, {name: program for name, (program, _) in COSTLY.items()}, tests=[], code_timeout=4,
                 code_memory_mb=1024, per_program_tests={name: tests for name, (_, tests) in COSTLY.items()})
    for name in COSTLY:
        r = out[name]
        print(f"\n{user} {name}: caller {r['caller_cpu']:.2f} s CPU, max RSS {r['caller_maxrss_mb']:.0f} MB, "
              f"{r['seconds']:.2f} s in all")
        assert r["error"] is None and r["score"] == 0.0, (user, name, r["details"])
        assert r["caller_cpu"] < 2.0 and r["caller_maxrss_mb"] < 400, (user, name, r)


# ---- round 4: the verdict contract (sandbox.py, "verdicts"), each class of program as an attacker or a careful
# solver would write it; name: (program, tests, the score plain Python gives it)
FORGE_PROTOCOL = (  # written against the old harness: its report pipe is the last argument, its fence echoed
    "import json, os, sys\ndef f(x):\n    return 2 * x\ndef g(x):\n"
    "    for fd in range(3, 40):\n        try:\n            os.write(fd, b'[\"ok\"]\\n[\"done\"]\\n')\n"
    "        except OSError:\n            pass\n    req, line = int(sys.argv[-2]), b''\n"
    "    while True:\n        byte = os.read(req, 1)\n        if not byte:\n            break\n        line += byte\n"
    "        if byte == b'\\n':\n            m = json.loads(line)\n            line = b''\n"
    "            if m[0] == 'fence':\n                for fd in range(3, 40):\n                    try:\n"
    "                        os.write(fd, json.dumps(['fenced', m[1]]).encode() + b'\\n')\n"
    "                    except OSError:\n                        pass\n                os._exit(0)\n")
SUBCLASS_STATE = ("from collections import deque\nfrom decimal import Decimal\nclass D(deque):\n    pass\n"
                  "class Dec(Decimal):\n    pass\ndef f(x):\n    return D([x])\ndef g(x):\n    return Dec(x)\n")
TMP_MEMO = ("def encode(s):\n    with open('/tmp/memo', 'w') as f:\n        f.write(s)\n    return s[::-1]\n"
            "def decode(s):\n    return open('/tmp/memo').read()\n")
LRU = ("from collections import OrderedDict\nclass LRUCache:\n    def __init__(self, n):\n"
       "        self.n, self.d = n, OrderedDict()\n"
       "    def get(self, k):\n        if k not in self.d:\n            return -1\n        self.d.move_to_end(k)\n"
       "        return self.d[k]\n"
       "    def put(self, k, v):\n        self.d[k] = v\n        self.d.move_to_end(k)\n"
       "        if len(self.d) > self.n:\n"
       "            self.d.popitem(last=False)\n    def copy(self):\n        c = LRUCache(self.n)\n"
       "        c.d = OrderedDict(self.d)\n"
       "        return c\n")
VECTOR = ("class V:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n    def __add__(self, o):\n"
          "        return V(self.x + o.x, self.y + o.y)\n    def __eq__(self, o):\n"
          "        return (self.x, self.y) == (o.x, o.y)\n"
          "    def __lt__(self, o):\n        return (self.x, self.y) < (o.x, o.y)\n    def __abs__(self):\n"
          "        return (self.x ** 2 + self.y ** 2) ** 0.5\n    def __getitem__(self, i):\n"
          "        return (self.x, self.y)[i]\n"
          "    def __contains__(self, v):\n        return v in (self.x, self.y)\n    def __bool__(self):\n"
          "        return bool(self.x or self.y)\n")
DLL = ("class Node:\n    def __init__(self, v):\n        self.v, self.prev, self.next = v, None, None\n"
       "def chain(n):\n    head = cur = Node(0)\n    for i in range(1, n):\n        cur.next = Node(i)\n"
       "        cur.next.prev = cur\n"
       "        cur = cur.next\n    return head\ndef nested(d):\n    x = []\n    for _ in range(d):\n"
       "        x = [x]\n    return x\n"
       "def loop():\n    a = [1]\n    a.append(a)\n    return a\n")
POOL = ("from multiprocessing import Pool\ndef sq(x):\n    return x * x\ndef f(xs):\n    with Pool(2) as p:\n"
        "        return p.map(sq, xs)\n")
CONTRACT_CASES = {
    # wrong programs that scored on b006eb3
    "writes_the_protocol": (FORGE_PROTOCOL, ["assert f(1) == 2\ng(1)"], 0.0),
    "subclass_of_c_type_state": (SUBCLASS_STATE, ["assert f(2) == D([4])", "assert g(2) == Dec(4)"], 0.0),
    "imports_the_tested_name": ("from operator import neg as f\n", ["assert f(1) == 2", "assert f(2) == 4"], 0.0),
    "shadows_a_builtin": ("sorted = sorted\ndef f(xs):\n    return xs\n"
    "", ["assert f(sorted([3, 1, 2])) == [3, 2, 1]"], 0.0),
    "shared_tmp": (TMP_MEMO, ["assert encode('hello') == 'olleh'", "assert decode('olleh') == 'hello'"], 0.5),
    "stale_alias": ("def sorted_copy(a):\n    a.sort()\n    return a\n",
                    ["xs = [3, 1, 2]\nys = xs\nassert sorted_copy(ys) == [1, 2, 3] and xs == [3, 1, 2]"], 0.0),
    "builtin_subclass_exact_type": ("class L(list):\n    pass\ndef f(x):\n    return L([x])\n",
                                    ["assert type(f(1)) is list and f(1) == [1]"], 0.0),
    # a memo from one test to the next through the run's stdin (it was writable) or stdout's size (it was kept)
    "memo_in_stdin": ("import os\ndef remember(n):\n    os.pwrite(0, str(n).encode(), 0)\n    return 1\n"
                      "def recall():\n    return int(os.pread(0, 20, 0))\n",
                      ["assert remember(1234) in (1, None)", "assert recall() == 1234"], 0.0),
    "memo_in_output_size": ("import os\ndef remember(n):\n    os.write(1, b' ' * n)\n    return 1\n"
                            "def recall():\n    return os.fstat(1).st_size\n",
                            ["assert remember(1234) == 1", "assert recall() == 1234"], 0.5),
    "patched_math": ("import math\nmath.factorial = lambda n: 0\ndef f(n):\n    return 0\n",
                     ["import math\nassert f(5) == math.factorial(5)"], 0.0),
    # correct programs scored below 1 on b006eb3
    "methods_named_like_builtins": (LRU, ["c = LRUCache(2)\nc.put(1, 1)\nc.put(2, 2)\nassert c.get(1) == 1\n"
    "c.put(3, 3)\n"
                                          "assert c.get(2) == -1", "c = LRUCache(1)\nc.put(1, 5)\n"
                                          "assert c.copy().get(1) == 5"],
                                    1.0),
    "operators_on_own_objects": (VECTOR, ["assert V(1, 2) + V(3, 4) == V(4, 6)", "assert abs(V(3, 4)) == 5",
                                          "assert V(1, 2) < V(2, 0)", "assert V(1, 2)[1] == 2 and 2 in V(1, 2)",
                                          "assert not V(0, 0)",
                                          "assert sorted([V(2, 1), V(1, 2)]) == [V(1, 2), V(2, 1)]",
                                          "v = V(1, 2)\nassert v is v"], 1.0),
    "builtin_types_in_checks": ("def f():\n    return {'a': 1}\n",
                                ["assert isinstance(f(), dict)", "assert type(f()) == dict",
                                 "assert type(f()) is dict"],
                                1.0),
    "repeated_equal_items": ("def f(x):\n    return [x] * 20\ndef g():\n    return [('a', 1)] * 20\n",
                             ["assert set(f(1)) == {1}", "assert dict(g()) == {'a': 1}",
                              "assert f(1) == [1] * 20"], 1.0),
    "deep_or_cyclic": (DLL, ["h = chain(3)\nassert h.next.prev is h", "assert str(nested(300)).count('[') == 301",
                             "assert nested(300) != []", "assert loop() is not None"], 1.0),
    "large_legal_values": ("def s():\n    return 'é' * 1500000\n"
                           "def fl():\n    return [i / 7 for i in range(400000)]\n",
                           ["assert s() == 'é' * 1500000", "assert fl() == [i / 7 for i in range(400000)]",
                            "assert len(s()) == 1500000"], 1.0),
}


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_the_verdict_contract_scores_what_plain_python_scores(unprivileged, user):
    """Red-team findings (round 4): wrong programs passed by writing the harness's protocol themselves, by hiding
    their state where the encoder did not look (subclasses of deque, Decimal, list), by making tests "unsupported"
    through their own names (an import, `sorted = sorted`), through /tmp shared by tests, through a stale copy of an
    alias, through a patched math; correct programs scored below 1 for methods named like builtins' (an LRU cache's
    get), operators and __eq__ of their own classes, isinstance / type checks, repeated items, deep or cyclic
    values, multiprocessing.Pool, and legal values the channel undercounted (1.5M non-ASCII characters, 400,000
    floats: the channel closed and the tests after them failed too)."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    out = _drive(prefix, {name: program for name, (program, _, _) in CONTRACT_CASES.items()}, tests=[],
                 code_timeout=10, code_memory_mb=1024,
                 per_program_tests={name: tests for name, (_, tests, _) in CONTRACT_CASES.items()})
    for name, (_, _, want) in CONTRACT_CASES.items():
        r = out[name]
        assert (r["score"], r["error"]) == (pytest.approx(want), None), (user, name, r["details"])
        assert r["left"] == [], (user, name, r)


@needs_sandbox
def test_multiprocessing_pool_under_a_cgroup():
    """Red-team finding: a program using multiprocessing.Pool failed (its functions were pickled by a __main__ that
    was the harness). Under a cgroup only: without one a run may start threads but no second process, and a Pool's
    workers are processes (see README)."""
    S._sandbox_mode()
    if not S._SANDBOX.get("cgroup"):
        pytest.skip("no cgroup here")
    r = verify("code", py(POOL), ["assert f([1, 2, 3]) == [1, 4, 9]"], code_timeout=10)
    assert (r.score, r.error) == (1.0, None), r.details


SYSCALLS = ("import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
            "NR = {'x86_64': {'perf_event_open': 298, 'fanotify_init': 300, 'userfaultfd': 323, 'io_setup': 206,\n"
            "                 'inotify_init1': 294},\n"
            "      'aarch64': {'perf_event_open': 241, 'fanotify_init': 262, 'userfaultfd': 282, 'io_setup': 0,\n"
            "                  'inotify_init1': 26}}[os.uname().machine]\n"
            "ctx = ctypes.c_ulong(0)\nattr = (ctypes.c_char * 128)()\nattr[4] = 128\n"
            "ARGS = {'perf_event_open': (ctypes.byref(attr), 0, -1, -1, 0), 'fanotify_init': (0, 0),\n"
            "        'userfaultfd': (1,), 'io_setup': (64, ctypes.byref(ctx)), 'inotify_init1': (0,)}\n"
            "def refused(name):\n    ctypes.set_errno(0)\n    r = libc.syscall(ctypes.c_long(NR[name]), *ARGS[name])\n"
            "    return r == -1 and ctypes.get_errno() == errno.EPERM\n")
INODES = ("import os\ndef files(d):\n    n = 0\n    try:\n        while n < 40000:\n"
          "            os.close(os.open(f'{d}/f{n}', os.O_CREAT | os.O_WRONLY))\n            n += 1\n"
          "    except OSError:\n        pass\n    return n\n")
TRACE = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "def trace(pid):\n    if libc.ptrace(0x4206, pid, 0, 0) == 0:  # PTRACE_SEIZE\n        return 'traced'\n"
         "    return os.strerror(ctypes.get_errno())\n"
         "def fds(pid):\n    try:\n        return len(os.listdir(f'/proc/{pid}/fd'))\n    except OSError:\n"
         "        return -1\n")
ISOLATION_CASES = {
    "syscalls_refused": (SYSCALLS, [f"assert refused({n!r})" for n in
                                    ("perf_event_open", "fanotify_init", "userfaultfd", "io_setup",
                                     "inotify_init1")], 1.0),
    "tmpfs_inodes_bounded": (INODES, ["assert files('/tmp') <= 16384", "assert files('/dev/shm') <= 1024"], 1.0),
    "harness_not_traceable": (TRACE, ["assert trace(os.getppid()) != 'traced' and fds(os.getppid()) == -1"], 1.0),
}


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_inodes_inotify_aio_perf_userfaultfd_and_tracing_are_refused(unprivileged, user):
    """Red-team findings (round 4): without a cgroup a million empty files on the sandbox's tmpfs (1.5 GB of kernel
    memory) and 128 inotify queues (1 GB) outside the budget; perf_event_open, fanotify_init, userfaultfd and
    io_setup allowed (one run held 61,440 of the host's 65,536 AIO slots); with no Yama the program could ptrace
    the harness (and read its descriptors)."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    out = _drive(prefix, {name: program for name, (program, _, _) in ISOLATION_CASES.items()}, tests=[],
                 code_timeout=10, per_program_tests={name: tests for name, (_, tests, _) in ISOLATION_CASES.items()})
    for name, (_, _, want) in ISOLATION_CASES.items():
        assert (out[name]["score"], out[name]["error"]) == (want, None), (user, name, out[name]["details"])


KEYS = ("import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
        "ADD, CTL = {'x86_64': (248, 250), 'aarch64': (217, 219)}[os.uname().machine]\n"
        "def f(x):\n    return 2 * x\n"
        "for ring in (-1, -2, -3, -4, -5):  # thread, process, session, user, user-session\n"
        "    if libc.syscall(CTL, 10, ring, b'user', b'caller_secret', 0) > 0:  # KEYCTL_SEARCH\n"
        "        print('FOUND in', ring, file=sys.stderr)\n"
        "    if libc.syscall(ADD, b'user', b'planted', b'x', ctypes.c_size_t(1), ring) > 0:\n"
        "        print('PLANTED in', ring, file=sys.stderr)\n"
        "persistent = libc.syscall(CTL, 22, -1, -4)  # KEYCTL_GET_PERSISTENT, linked into the user keyring\n"
        "if persistent > 0 and libc.syscall(ADD, b'user', b'planted', b'x', ctypes.c_size_t(1), persistent) > 0:\n"
        "    print('PLANTED in persistent', file=sys.stderr)\n"
        "print('errno', ctypes.get_errno(), file=sys.stderr)\n")


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64 / aarch64")
@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_no_keyring_of_the_caller_or_of_an_earlier_run_is_reachable(unprivileged, user):
    """Red-team findings: keys read from and planted in the caller's session keyring (as nobody; as root when
    the caller has one, as PAM and systemd give), and persistent keyrings that survive the setup's clear."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    out = _drive(prefix, {"keys": KEYS}, session_key=True)
    r = out["keys"]
    assert r["score"] == 1.0 and "FOUND" not in r["stderr"] and "PLANTED" not in r["stderr"], (user, r)
    assert out["session_keys"] == 1, (user, out)  # the caller's own key alone


# Runs as long as it is let; its name (comm) is how the test finds it.
LINGER = ("import ctypes, time\nctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\ndef f(x):\n    return 2 * x\n"
          "time.sleep(120)\n")


def _with_comm(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == marker:
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_the_program_dies_with_its_caller_killed_by_sigkill(unprivileged, user):
    """Red-team finding: as root a program kept running after its caller was killed with SIGKILL (the uid change
    cleared the parent-death signal of the namespace's init)."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    marker = f"linger{os.getpid() % 100000}"
    args = [{"linger": LINGER.format(marker=marker)}, DOUBLE_TESTS, {"code_timeout": 100, "code_memory_mb": 256}, 2048]
    caller = subprocess.Popen([*prefix, "-c", _DRIVER], cwd="/tmp", stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": REPO}, text=True)
    caller.stdin.write(json.dumps(args))
    caller.stdin.close()
    try:
        deadline = time.time() + 60
        while not _with_comm(marker) and time.time() < deadline:
            time.sleep(0.05)
        assert _with_comm(marker), "the program never ran"
        caller.kill()
        caller.wait()
        deadline = time.time() + 3
        while _with_comm(marker) and time.time() < deadline:
            time.sleep(0.05)
        left = _with_comm(marker)
    finally:
        caller.kill()
        for pid in _with_comm(marker):
            os.kill(pid, signal.SIGKILL)
        S._sandbox_mode()
        S.cleanup_sandboxes(caller.pid)  # its work dir and cgroup, as a pool does for a worker it killed
    assert left == [], (user, "the program outlived its caller")


@needs_sandbox
def test_an_interpreter_under_tmp_still_judges_every_test():
    """A project cloned under /tmp (a CI runner's fresh clone, a scratch checkout) has its venv there: the sandbox
    binds the interpreter's prefix inside its own /tmp, and the harness must not take that for something a test
    left behind (it did: after the first test /tmp never came clean, and every later test failed)."""
    venv = tempfile.mkdtemp(dir="/tmp", prefix="venv-")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
        ours = next(p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p))
        site = os.path.join(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages")
        with open(os.path.join(site, "ours.pth"), "w") as f:
            f.write(ours + "\n")  # this venv's packages, seen from the one under /tmp
        r = _drive([os.path.join(venv, "bin", "python")], {"double": "def f(x):\n    return 2 * x\n"})["double"]
        assert (r["score"], r["error"]) == (1.0, None), r["details"]
    finally:
        shutil.rmtree(venv, ignore_errors=True)


THREADS = ("import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"  # all 4 (or n) alive at once
           "def f(xs):\n    meet = threading.Barrier(4)\n    def square(x):\n        meet.wait(5)\n        return x * x\n"
           "    with ThreadPoolExecutor(4) as pool:\n        return list(pool.map(square, xs))\n"
           "def g(n):\n    out, meet = [0] * n, threading.Barrier(n)\n    def work(i):\n        meet.wait(5)\n"
           "        out[i] = i * i\n"
           "    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]\n"
           "    for t in threads:\n        t.start()\n    for t in threads:\n        t.join()\n    return out\n")
STARTS_A_PROCESS = ("import os, subprocess, sys\ndef started():\n    try:\n"
                    "        return subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True).stdout\n"
                    "    except OSError as e:\n        return type(e).__name__\n")


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_threads_run_with_or_without_a_cgroup(unprivileged, user):
    """Red-team finding (round 4): a correct program starting 4 threads (threading.Thread, a ThreadPoolExecutor)
    failed without a cgroup, where processes and threads were 4 in all. Threads share their process's address
    space, so they do not multiply its limit: without a cgroup a run may start threads (64 tasks) but no other
    process (fork and clone without CLONE_THREAD fail with EPERM), and the program's one process gets half of the
    budget (the harness the other half); under a cgroup, processes too."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    programs = {"threads": THREADS, "process": STARTS_A_PROCESS}
    out = _drive(prefix, programs, tests=[], code_timeout=10, code_memory_mb=512, per_program_tests={
        "threads": ["assert f([1, 2, 3, 4]) == [1, 4, 9, 16]", "assert g(4) == [0, 1, 4, 9]",
                    "assert g(8) == [i * i for i in range(8)]"],
        "process": ["assert started() in (b'1\\n', 'PermissionError')"]})
    for name in programs:
        assert (out[name]["score"], out[name]["error"]) == (1.0, None), (user, name, out[name]["details"])
    stdio = _drive(prefix, {"threads": THREADS + "print(*f([int(input())] * 4), *g(4))"},
                   tests=[{"input": "3\n", "output": "9 9 9 9 0 1 4 9"}], verifier="code_stdio", code_timeout=10,
                   budget=20)["threads"]
    assert (stdio["score"], stdio["error"]) == (1.0, None), (user, stdio["details"])



# Wrong: answers "dec t" from a memo of an earlier test's "enc s", kept wherever a test could leave it for the next one
# (a file, its stdin or stderr descriptor, read back through those or stdout's); right: reverses.
STDIO_MEMO = ("import os, sys\nkind, s = input().split()\nmemo = ''\nfor read in (lambda: open('/tmp/memo').read(),\n"
              "             lambda: os.pread(0, 100, 0).decode(), lambda: os.pread(1, 100, 0).decode(),\n"
              "             lambda: os.pread(2, 100, 0).decode()):\n    try:\n        memo += read()\n"
              "    except (OSError, UnicodeDecodeError):\n        pass\n"
              "if kind == 'enc':\n    print(s[::-1])\n    sys.stdout.flush()\n"
              "    for fd in (0, 2):\n        try:\n            os.pwrite(fd, f' {s}:{s[::-1]} '.encode(), 0)\n"
              "        except OSError:\n            pass\n    open('/tmp/memo', 'w').write(f' {s}:{s[::-1]} ')\n"
              "else:\n    print(next((p.split(':')[0] for p in memo.split() if p.endswith(':' + s)), 'x'))\n")
STDIO_RIGHT = "kind, s = input().split()\nprint(s[::-1])\n"


@pytest.mark.parametrize("user", ["root", "unprivileged"])
def test_150_stdio_tests_within_the_row_budget_each_in_a_fresh_process(unprivileged, user):
    """Red-team finding (round 4): 62 of 150 stdio tests failed within the 8 s budget as root, each test in a sandbox
    of its own. Now one sandbox per row forks a fresh process per test from a harness that never ran the program; a
    test still sees no file, descriptor or process an earlier test left."""
    prefix = _users(unprivileged).get(user) or pytest.skip(f"no {user} here")
    tests = [{"input": f"{i} {i + 1}\n", "output": f"{2 * i + 1}\n"} for i in range(150)]
    r = _drive(prefix, {"sum": "a, b = map(int, input().split())\nprint(a + b)"}, tests=tests,
               verifier="code_stdio", code_timeout=5, budget=8)["sum"]
    print(f"\n{user}: 150 stdio tests in {r['seconds']:.2f} s")
    assert (r["score"], r["error"]) == (1.0, None), (user, r["details"])
    memo_tests = [{"input": "enc hello\n", "output": "olleh\n"}, {"input": "dec olleh\n", "output": "hello\n"}]
    out = _drive(prefix, {"memo": STDIO_MEMO, "right": STDIO_RIGHT}, tests=memo_tests, verifier="code_stdio",
                 code_timeout=5, budget=8)
    assert (out["memo"]["score"], out["right"]["score"]) == (0.5, 1.0), (user, out)
