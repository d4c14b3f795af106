"""sft.py: unit tests of its pieces (fast) and the real script on the toy model (slow).

Fast: labels on assistant tokens only (decoded), packing == unpacked, loss normalised over the
global batch, schedule, FLOPs, checkpoint selection. Slow (subprocess, the real script): DDP and
FSDP2 under `torchrun --nproc-per-node 2` and a single process with gradient accumulation give the
same loss curve; resume after a kill reproduces it; SFT makes the toy model answer better
(toy.evaluate + verifiers, on the session's SFT fixture); LoRA trains only the adapter and it loads
with peft; packing, gradient checkpointing and the cosine schedule run end to end.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import chat_template
import sft
from conftest import flops_per_token_bounds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
# Small and fast: 2 ranks x 8 rows (or 1 process x 2 micro-batches of 8) = a global batch of 16 rows.
TINY = ["--learning_rate", "3e-3", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
        "--seed", "0", "--report_to", "none", "--warmup_ratio", "0.1"]


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(toy_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.fixture(scope="module")
def rows_and_examples(toy_data_dir, tokenizer):
    """The first 40 toy SFT conversations, raw and tokenized the way sft.py tokenizes them."""
    with open(os.path.join(toy_data_dir, "sft.jsonl")) as f:
        rows = [json.loads(line) for line in f][:40]
    dataset, drops = chat_template.tokenize_sft(rows, tokenizer, max_length=4096)
    assert sum(drops.values()) == 0, dict(drops)
    return rows, [{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in dataset]


@pytest.fixture(scope="module")
def model(toy_model_dir):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.no_grad():  # a random init predicts almost uniformly; perturb so positions and context matter
        for p in m.parameters():
            p.add_(0.02 * torch.randn_like(p))
    sft.install_chunked_head(m, chunk_size=7)  # a chunk size that divides no batch evenly
    return m.eval()


def run(cmd, timeout=600, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, (f"{' '.join(cmd)}\n--- stdout\n{result.stdout[-4000:]}\n"
                                    f"--- stderr\n{result.stderr[-6000:]}")
    return result


def read_metrics(out_dir):
    """step -> metrics; a later line for the same step (after a resume) wins."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


# ---------------------------------------------------------------------------------------------
# Fast unit tests
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
def test_labels_cover_assistant_tokens_only(rows_and_examples, tokenizer, packing):
    """Decode a real training batch: the trained targets are exactly the assistant replies + eos."""
    rows, examples = rows_and_examples
    order = list(range(6))
    batch = sft.collate(sft.pack_rows([len(e["input_ids"]) for e in examples], order, 4096, packing), examples,
                        tokenizer.pad_token_id)
    ids, targets = batch["input_ids"], batch["targets"]
    assert ids.shape == targets.shape and ids.shape[0] == (1 if packing else 6)
    trained, untrained = [], []
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if targets[b, t] != -100:
                assert targets[b, t] == ids[b, t + 1], "target t must be the token at t + 1"
                trained.append(int(targets[b, t]))
            elif t + 1 < ids.shape[1]:
                untrained.append(int(ids[b, t + 1]))
    expected = "".join(rows[i]["messages"][-1]["content"] + tokenizer.eos_token for i in order)
    assert tokenizer.decode(trained) == expected
    untrained_text = tokenizer.decode(untrained)
    for i in order:
        assert rows[i]["messages"][0]["content"] in untrained_text  # the prompt is there, but not trained
    assert "<|im_start|>" not in tokenizer.decode(trained) and "user" not in tokenizer.decode(trained)


def test_packed_batch_gives_the_same_per_token_loss_as_unpacked(rows_and_examples, model, tokenizer):
    _, examples = rows_and_examples
    order = [3, 0, 7, 5, 1]
    lengths = [len(examples[i]["input_ids"]) for i in order]
    assert len(set(lengths)) > 1, "want conversations of different lengths (padding in the unpacked batch)"
    unpacked = sft.collate([[i] for i in order], examples, tokenizer.pad_token_id)
    packed = sft.collate([order], examples, tokenizer.pad_token_id)
    assert packed["input_ids"].shape == (1, sum(lengths))
    with torch.no_grad():
        nll_unpacked = sft.token_nll(model, unpacked, torch.device("cpu"))  # (5, max_len)
        nll_packed = sft.token_nll(model, packed, torch.device("cpu"))[0]  # (sum of lengths,)
        # Negative control: the same packed row with one running position id -> attention crosses
        # conversations and the losses move. This is what the test would see if packing leaked.
        leaky = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1])[None])
        nll_leaky = sft.token_nll(model, leaky, torch.device("cpu"))[0]
    start = 0
    for row, (i, L) in enumerate(zip(order, lengths)):
        mask = unpacked["targets"][row, :L] != -100
        assert torch.equal(mask, packed["targets"][0, start:start + L] != -100)
        torch.testing.assert_close(nll_packed[start:start + L], nll_unpacked[row, :L], atol=1e-5, rtol=1e-5)
        # and both equal the plainest forward: this conversation alone, no padding, no position ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([examples[i]["input_ids"]])).logits[0]  # (L, V)
        alone = torch.nn.functional.cross_entropy(logits, packed["targets"][0, start:start + L], ignore_index=-100,
                                                  reduction="none")
        torch.testing.assert_close(nll_packed[start:start + L], alone, atol=1e-5, rtol=1e-5)
        start += L
    second = slice(lengths[0], lengths[0] + lengths[1])
    assert (nll_leaky[second] - nll_packed[second]).abs().max() > 1e-2
    # the loss over trained tokens is the same number either way
    total = int((unpacked["targets"] != -100).sum())
    torch.testing.assert_close(nll_packed.sum() / total, nll_unpacked.sum() / total, atol=1e-6, rtol=1e-6)


def test_loss_is_normalised_by_trained_tokens_of_the_whole_step(rows_and_examples, model, tokenizer):
    """Accumulating two uneven micro-batches == one batch's (sum / all trained tokens); a per-micro-batch
    mean is not."""
    _, examples = rows_and_examples
    micro = [sft.collate([[0]], examples, tokenizer.pad_token_id),  # one conversation
             sft.collate([[1], [2], [3], [4]], examples, tokenizer.pad_token_id)]  # four
    whole = sft.collate([[0], [1], [2], [3], [4]], examples, tokenizer.pad_token_id)
    counts = [int((mb["targets"] != -100).sum()) for mb in micro]
    params = [p for p in model.parameters()]
    cpu = torch.device("cpu")

    def grads(losses_fn):
        model.zero_grad(set_to_none=True)
        losses_fn()
        return torch.cat([p.grad.flatten() for p in params])

    def accumulate():
        for mb in micro:
            sft.sft_loss(model, mb, cpu, num_trained_tokens=sum(counts), world_size=1)[0].backward()

    def reference():
        nll = sft.token_nll(model, whole, cpu)
        (nll.sum() / (whole["targets"] != -100).sum()).backward()

    def per_micro_batch_mean():
        for mb, n in zip(micro, counts):
            (sft.token_nll(model, mb, cpu).sum() / n / len(micro)).backward()

    g_acc, g_ref, g_mean = grads(accumulate), grads(reference), grads(per_micro_batch_mean)
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(g_acc, g_ref, atol=1e-6, rtol=1e-4)
    assert (g_mean - g_ref).norm() > 0.05 * g_ref.norm()
    # world_size: DDP/FSDP average gradients over ranks, so each rank's loss carries a factor world_size
    loss1, _ = sft.sft_loss(model, micro[0], cpu, num_trained_tokens=100, world_size=1)
    loss2, _ = sft.sft_loss(model, micro[0], cpu, num_trained_tokens=100, world_size=2)
    torch.testing.assert_close(loss2, 2 * loss1)


def test_a_template_without_generation_blocks_is_said_once_with_the_rows_it_affects(tokenizer, tmp_path, monkeypatch,
                                                                                     capsys):
    """A checkpoint's own template without {% generation %} blocks (prefix labeling): start-up says so once, with
    the rows whose earlier turns go untrained and whose opening <think> is masked, and the fix."""
    monkeypatch.setenv("OLMO3_POSTTRAIN_CACHE", str(tmp_path / "cache"))
    user = {"role": "user", "content": "What is 2+3?"}
    rows = [[user, {"role": "assistant", "content": "<think>2+3=5</think>\\boxed{5}"}],
            [user, {"role": "assistant", "content": "<think>a</think>5"}, user,
             {"role": "assistant", "content": "<think>b</think>5"}],
            [user, {"role": "assistant", "content": "\\boxed{5}"}]]  # no <think>: not a prefix, dropped
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    args = sft.Args(model_name_or_path="unused", dataset_mixer_list=[str(data), "1.0"], max_seq_length=512)
    world = sft.World(0, 1, 0, torch.device("cpu"))
    think = chat_template.TEMPLATES["olmo3-think-dev"]
    tokenizer.chat_template = think.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    try:
        examples, drops = sft.load_data(args, tokenizer, world)
        out = capsys.readouterr().out
        assert len(examples) == 2 and drops["prompt_not_prefix"] == 1
        assert out.count("WARNING: the checkpoint's own chat template has no {% generation %} blocks") == 1
        assert "1 of 3 train only their last" in out and "2 have the opening <think>" in out
        assert "--chat_template with a bundled template" in out
        tokenizer.chat_template = think  # annotated: nothing to say
        sft.load_data(args, tokenizer, world)
        assert "WARNING" not in capsys.readouterr().out
    finally:
        tokenizer.chat_template = chat_template.TEMPLATES["olmo3-instruct-dev"]


def test_pack_rows_never_splits_or_overfills():
    lengths = [5, 3, 8, 2, 7, 1]
    rows = sft.pack_rows(lengths, [0, 1, 2, 3, 4, 5], max_seq_length=10, packing=True)
    assert rows == [[0, 1], [2, 3], [4, 5]]  # 5+3 (+8 would overflow), 8+2, 7+1
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert sft.pack_rows(lengths, [2, 0], 10, packing=False) == [[2], [0]]


def test_lr_schedule():
    total, warmup = 100, 10
    assert sft.lr_at(0, total, warmup, "linear") == pytest.approx(0.1)
    assert sft.lr_at(9, total, warmup, "linear") == pytest.approx(1.0)
    assert sft.lr_at(10, total, warmup, "linear") == pytest.approx(1.0)
    assert sft.lr_at(55, total, warmup, "linear") == pytest.approx(0.5)
    assert sft.lr_at(55, total, warmup, "cosine") == pytest.approx(0.5)
    assert sft.lr_at(32, total, warmup, "cosine") == pytest.approx(
        0.5 * (1 + __import__("math").cos(__import__("math").pi * 22 / 90)))
    assert sft.lr_at(99, total, 0, "linear") == pytest.approx(0.01)
    assert sft.lr_at(5, total, warmup, "constant") == pytest.approx(0.6)  # warmup, then the peak to the end
    assert sft.lr_at(10, total, warmup, "constant") == sft.lr_at(99, total, warmup, "constant") == 1.0
    with pytest.raises(ValueError):
        sft.lr_at(50, total, warmup, "constant-ish")


def test_train_flops_by_hand():
    # two conversations of 3 and 5 tokens, N = 100, 2 layers, hidden 4:
    # matmuls 6 * 100 * 8 = 4800; attention 6 * 2 * 4 * (9 + 25) = 1632
    assert sft.train_flops([3, 5], 100, 2, 4) == 6432


def test_latest_checkpoint_ignores_half_written_ones(tmp_path):
    root = tmp_path / "checkpoints"
    assert sft.latest_checkpoint(str(tmp_path)) is None
    (root / "step_4").mkdir(parents=True)
    (root / "step_4" / "training_state.pt").write_bytes(b"x")
    (root / ".tmp-step_8").mkdir()  # a save killed half-way
    (root / ".tmp-step_8" / "training_state.pt").write_bytes(b"x")
    (root / "step_6").mkdir()  # no training state: incomplete
    assert sft.latest_checkpoint(str(tmp_path)) == str(root / "step_4")
    (root / "latest").write_text("step_4")
    assert sft.latest_checkpoint(str(tmp_path)) == str(root / "step_4")


def test_check_output_dir_needs_resume_or_overwrite(tmp_path):
    out = str(tmp_path)
    sft.check_output_dir(out, resume=False, overwrite=False, is_main=True)  # an empty directory: fine
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    with pytest.raises(SystemExit, match="holds a previous run.*--resume.*--overwrite_output_dir"):
        sft.check_output_dir(out, resume=False, overwrite=False, is_main=True)
    sft.check_output_dir(out, resume=True, overwrite=False, is_main=True)  # continue: nothing deleted
    sft.check_output_dir(out, resume=False, overwrite=True, is_main=False)  # only rank 0 deletes
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoints").exists()
    with pytest.raises(SystemExit, match="pass one"):
        sft.check_output_dir(out, resume=True, overwrite=True, is_main=True)
    sft.check_output_dir(out, resume=False, overwrite=True, is_main=True)
    assert sorted(os.listdir(out)) == []


def test_prune_checkpoints_keeps_the_newest_and_the_resumed_one(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5, 10):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "training_state.pt").write_bytes(b"x")
    (root / "latest").write_text("step_10")
    sft.prune_checkpoints(str(root), 0)  # 0: keep them all
    assert len(os.listdir(root)) == 7
    sft.prune_checkpoints(str(root), 2, protect=str(root / "step_2"))
    assert sorted(os.listdir(root)) == ["latest", "step_10", "step_2", "step_5"]  # by step number, not name
    (root / "latest").write_text("step_5")  # `latest` always stays, even when it is not the newest
    sft.prune_checkpoints(str(root), 1)
    assert sorted(os.listdir(root)) == ["latest", "step_10", "step_5"]


# ---------------------------------------------------------------------------------------------
# Slow: the real script
# ---------------------------------------------------------------------------------------------
STEPS = ["--max_steps", "6", "--save_steps", "3"]


@pytest.mark.slow
def test_output_dir_reuse_needs_resume_or_overwrite_and_keeps_last_n(toy_model_dir, toy_data_dir, tmp_path):
    """--resume on an empty output_dir starts fresh (a preemptible job always passes it); a plain rerun
    there stops before any work with a message; --resume continues from the newest checkpoint and never
    deletes it while it keeps the newest --keep_last_n_checkpoints (2); --overwrite_output_dir starts over."""
    out = str(tmp_path / "run")
    ckpts = os.path.join(out, "checkpoints")
    cmd = [sys.executable, "sft.py", "--model_name_or_path", toy_model_dir, "--dataset_mixer_list",
           os.path.join(toy_data_dir, "sft.jsonl"), "1.0", *TINY, "--save_steps", "1", "--output_dir", out]
    first = run(cmd + ["--max_steps", "4", "--resume"])
    assert "starting from scratch" in first.stdout + first.stderr
    assert sorted(os.listdir(ckpts)) == ["latest", "step_2", "step_3"]  # saved after steps 1, 2, 3
    assert sorted(read_metrics(out)) == [1, 2, 3, 4]  # every step, while the console prints every
    assert first.stdout.count("train/loss=") == 1  # --logging_steps (10) and the last step: one line
    assert json.load(open(os.path.join(out, "run_config.json")))["derived"]["total_steps"] == 4
    t = time.time()
    again = subprocess.run(cmd + ["--max_steps", "4"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "holds a previous run" in again.stderr, again.stderr[-3000:]
    assert time.time() - t < 60 and sorted(os.listdir(ckpts)) == ["latest", "step_2", "step_3"]
    resumed = run(cmd + ["--max_steps", "6", "--resume"])
    assert "step_3" in resumed.stdout
    assert sorted(os.listdir(ckpts)) == ["latest", "step_3", "step_4", "step_5"]  # step_3: resumed from
    assert open(os.path.join(ckpts, "latest")).read() == "step_5"
    run(cmd + ["--max_steps", "2", "--overwrite_output_dir"])
    assert sorted(os.listdir(ckpts)) == ["latest", "step_1"] and sorted(read_metrics(out)) == [1, 2]


@pytest.fixture(scope="module")
def reference_runs(toy_model_dir, toy_data_dir, tmp_path_factory):
    """6 steps, global batch 16, three ways: 1 process x 2 accumulation steps, DDP x 2 ranks, FSDP2 x 2 ranks."""
    data = ["--model_name_or_path", toy_model_dir, "--dataset_mixer_list", os.path.join(toy_data_dir, "sft.jsonl"),
            "1.0"]
    outs = {name: str(tmp_path_factory.mktemp(f"sft_{name}")) for name in ("single", "ddp", "fsdp")}
    common = [*data, *TINY, *STEPS]
    run([sys.executable, "sft.py", *common, "--gradient_accumulation_steps", "2", "--output_dir", outs["single"]])
    run([*TORCHRUN, "sft.py", *common, "--output_dir", outs["ddp"]])
    run([*TORCHRUN, "sft.py", *common, "--use_fsdp", "--output_dir", outs["fsdp"]])
    return outs, common


@pytest.mark.slow
def test_ddp_fsdp_and_accumulation_give_the_same_run(reference_runs):
    """Same global batch split three ways -> the same losses: the token normalisation spans ranks and micro-batches."""
    from safetensors.torch import load_file
    outs, _ = reference_runs
    curves = {name: read_metrics(out) for name, out in outs.items()}
    for name, curve in curves.items():
        assert sorted(curve) == list(range(1, 7)), name
        assert curve[6]["train/loss"] < curve[1]["train/loss"] - 1.0, f"{name}: loss did not fall"
        assert curve[6]["train/grad_norm"] > 0 and curve[6]["perf/tokens_per_s"] > 0, name
        derived = json.load(open(os.path.join(outs[name], "run_config.json")))["derived"]
        assert derived["gradient_checkpointing"] is False, name  # not asked for (the smoke run asks)
    # MFU is the step's FLOPs over the device's peak: on one process (whose peak run_config.json records),
    # MFU x peak / tokens per second is the FLOPs of one token, which a hand count of the toy model bounds.
    peak = json.load(open(os.path.join(outs["single"], "run_config.json")))["derived"]["peak_flops_per_device"]
    low, high = flops_per_token_bounds(outs["single"])
    for row in curves["single"].values():
        assert low <= row["perf/mfu"] * peak / row["perf/tokens_per_s"] <= high, row
    for step in range(1, 7):
        ref = curves["single"][step]
        for name in ("ddp", "fsdp"):
            assert curves[name][step]["train/trained_tokens"] == ref["train/trained_tokens"]
            assert (curves[name][step]["train/loss"]
                    == pytest.approx(ref["train/loss"], rel=1e-4, abs=1e-5)), (name, step)
    weights = {name: load_file(os.path.join(out, "model.safetensors")) for name, out in outs.items()}
    for key, value in weights["single"].items():
        for name in ("ddp", "fsdp"):
            torch.testing.assert_close(weights[name][key], value, atol=1e-4, rtol=1e-3)
    # a final HF directory with the tokenizer and its chat template
    for out in outs.values():
        for name in ("config.json", "tokenizer.json", "chat_template.jinja", "metrics.jsonl"):
            assert os.path.isfile(os.path.join(out, name)), name


@pytest.mark.slow
def test_resume_after_kill_reproduces_the_uninterrupted_run(reference_runs, tmp_path):
    """FSDP2, 2 ranks: kill -9 right after the first checkpoint, resume, compare with the uninterrupted run."""
    outs, common = reference_runs
    out = str(tmp_path / "resumed")
    cmd = [*TORCHRUN, "sft.py", *common, "--use_fsdp", "--output_dir", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    latest = os.path.join(out, "checkpoints", "latest")
    deadline = time.time() + 300
    while not os.path.exists(latest) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert os.path.exists(latest), "no checkpoint appeared"
    killed = read_metrics(out)
    assert max(killed) < 6, "the run finished before it was killed: nothing to resume"
    run(cmd + ["--resume"])
    resumed, reference = read_metrics(out), read_metrics(outs["fsdp"])
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        assert resumed[step]["train/loss"] == pytest.approx(reference[step]["train/loss"], rel=1e-5, abs=1e-6), step
        assert resumed[step]["train/lr"] == pytest.approx(reference[step]["train/lr"])


@pytest.mark.slow
def test_sft_makes_the_toy_model_answer_better(toy_model_dir, toy_data_dir, toy_sft_model_dir):
    """Loss falls and accuracy (greedy decoding scored by verifiers.py, via toy.evaluate) rises.

    Uses the session's `toy_sft_model_dir` (sft.py on the toy data, the model DPO and RL start
    from), so the learning run is paid once per session. That it is the same run under
    `torchrun --nproc-per-node 2` is test_ddp_fsdp_and_accumulation_give_the_same_run.
    """
    import toy
    curve = read_metrics(toy_sft_model_dir)
    losses = [curve[s]["train/loss"] for s in sorted(curve)]
    assert len(losses) >= 20, f"the fixture ran only {len(losses)} steps"
    assert sum(losses[-10:]) / 10 < 0.25 * losses[0], losses
    eval_path = os.path.join(toy_data_dir, "eval.jsonl")
    before = toy.evaluate(toy_model_dir, eval_path, num_samples=0)
    after = toy.evaluate(toy_sft_model_dir, eval_path, num_samples=0)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}")
    # The random model scores ~2% by luck (the math verifier takes the last number in its noise), so
    # "better" needs a margin: 10 more of the 200 problems right.
    assert after["accuracy"] >= before["accuracy"] + 0.05 - 1e-9, (
        f"SFT did not beat the initial model by 5 points ({before['accuracy']:.3f} -> {after['accuracy']:.3f}): "
        f"the toy_sft_model_dir fixture trains too little for the toy task")


@pytest.mark.slow
def test_lora_trains_only_the_adapter_and_it_loads_with_peft(toy_model_dir, toy_data_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = str(tmp_path / "lora")
    run([sys.executable, "sft.py", "--model_name_or_path", toy_model_dir,
         "--dataset_mixer_list", os.path.join(toy_data_dir, "sft.jsonl"), "1.0", *TINY,
         "--learning_rate", "1e-2", "--max_steps", "4", "--save_steps", "0", "--use_lora", "--lora_rank", "8",
         "--lora_alpha", "16", "--merge_lora", "--output_dir", out])
    curve = read_metrics(out)
    assert curve[4]["train/loss"] < curve[1]["train/loss"]
    adapter = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert adapter and all("lora_A" in k or "lora_B" in k for k in adapter), sorted(adapter)[:5]
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), "lora_B starts at 0: it must have moved"

    base = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = PeftModel.from_pretrained(base, out)  # the saved adapter loads with peft
    assert sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n) > 0
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"), dtype=torch.float32).state_dict()
    scale = 16 / 8
    adapted = 0
    for key, base_value in base_sd.items():
        module = key[: -len(".weight")]
        a_key = f"base_model.model.{module}.lora_A.weight"
        if a_key in adapter:  # an adapted linear: merged = base + scale * B @ A, nothing else moved
            delta = scale * adapter[f"base_model.model.{module}.lora_B.weight"] @ adapter[a_key]
            torch.testing.assert_close(merged[key], base_value + delta, atol=1e-5, rtol=1e-4)
            adapted += 1
        else:  # embeddings, norms, LM head: untouched
            assert torch.equal(merged[key], base_value), key
    assert adapted == 4 * 7  # q k v o gate up down in each of the 4 layers ("all-linear" skips the LM head)
    assert os.path.isfile(os.path.join(out, "merged", "tokenizer.json"))


@pytest.mark.slow
def test_packing_checkpointing_and_cosine_run(toy_model_dir, toy_data_dir, tmp_path):
    """The optional paths of the loop run end to end: packed rows, recomputed activations (gradient checkpointing
    on in the model), the cosine schedule (each step's lr by hand). (wandb offline, and disabled:
    test_launch_flags.py's test_wandb_follows_its_own_mode_with_project_entity_and_run_name.)"""
    out = str(tmp_path / "packed")
    run([sys.executable, "sft.py", "--model_name_or_path", toy_model_dir,
         "--dataset_mixer_list", os.path.join(toy_data_dir, "sft.jsonl"), "0.2", *TINY,
         "--per_device_train_batch_size", "2", "--packing", "--max_seq_length", "1024", "--gradient_checkpointing",
         "--lr_scheduler_type", "cosine", "--max_steps", "4", "--output_dir", out])
    curve = read_metrics(out)
    assert sorted(curve) == [1, 2, 3, 4]
    # 2 packed rows of <= 1024 tokens hold many ~100-token conversations: far more trained tokens than 2 rows unpacked
    assert curve[1]["train/trained_tokens"] > 10 * 30
    assert curve[4]["train/loss"] < curve[1]["train/loss"]
    # warmup 10% of 4 steps = 1 step, then 0.5 (1 + cos(pi p)) over the 3 steps left, p = 0, 1/3, 2/3 (linear
    # decay would give 1, 0.667, 0.333)
    for step, multiplier in zip((1, 2, 3, 4), (1.0, 1.0, 0.75, 0.25)):
        assert curve[step]["train/lr"] == pytest.approx(3e-3 * multiplier), step
    assert json.load(open(os.path.join(out, "run_config.json")))["derived"]["gradient_checkpointing"] is True
