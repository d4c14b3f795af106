"""dpo.py: the preference losses against their published formulas, batching, the reference cache,
and real runs of the script on the toy model (learning, cache reuse, torchrun with resume)."""

import json
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import dpo
import toy
from conftest import REPO, flops_per_token_bounds


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def neg_log_sigmoid(x):
    return -math.log(sigmoid(x))


def as_tensors(*values):
    return [torch.tensor(v, dtype=torch.float64) for v in values]


# ---------------------------------------------------------------------------------------------
# Losses: each one against its formula, written out with plain floats
# ---------------------------------------------------------------------------------------------
# Two pairs: policy (chosen, rejected) and reference (chosen, rejected) sequence logprobs.
PC, PR, RC, RR = [-10.0, -4.0], [-12.0, -3.5], [-11.0, -4.5], [-11.5, -2.0]


def test_dpo_matches_rafailov_eq7():
    beta = 0.1
    losses, chosen_r, rejected_r = dpo.dpo_loss(*as_tensors(PC, PR, RC, RR), beta=beta, loss_type="dpo")
    for i in range(2):
        # L = -log sigmoid(beta * [(log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))])
        h = (PC[i] - RC[i]) - (PR[i] - RR[i])
        assert losses[i].item() == pytest.approx(neg_log_sigmoid(beta * h), rel=1e-12)
        assert chosen_r[i].item() == pytest.approx(beta * (PC[i] - RC[i]), rel=1e-12)
        assert rejected_r[i].item() == pytest.approx(beta * (PR[i] - RR[i]), rel=1e-12)
    # pair 0: h = 1 - (-0.5) = 1.5, so the loss is log(1 + e^-0.15)
    assert losses[0].item() == pytest.approx(math.log1p(math.exp(-0.15)), rel=1e-12)
    assert not chosen_r.requires_grad and not rejected_r.requires_grad


def test_dpo_label_smoothing_is_conservative_dpo():
    beta, eps = 0.5, 0.2
    losses, _, _ = dpo.dpo_loss(*as_tensors(PC, PR, RC, RR), beta=beta, loss_type="dpo", label_smoothing=eps)
    for i in range(2):
        h = (PC[i] - RC[i]) - (PR[i] - RR[i])
        expected = (1 - eps) * neg_log_sigmoid(beta * h) + eps * neg_log_sigmoid(-beta * h)
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)


def test_dpo_norm_is_dpo_on_mean_logprobs_with_olmo3_beta():
    # The caller passes per-token means for dpo_norm; the formula is DPO's. Olmo 3 / Tulu 3: beta 5.
    assert dpo.AVERAGE_LOGPS == {"dpo": False, "dpo_norm": True, "simpo": True, "ipo": False}
    assert dpo.DEFAULT_BETA["dpo_norm"] == 5.0 and dpo.Args().loss_type == "dpo_norm"
    means = [[-1.0, -0.4], [-1.3, -0.5], [-1.1, -0.45], [-1.2, -0.6]]
    losses, chosen_r, rejected_r = dpo.dpo_loss(*as_tensors(*means), beta=5.0, loss_type="dpo_norm")
    pc, pr, rc, rr = means
    for i in range(2):
        h = (pc[i] - rc[i]) - (pr[i] - rr[i])
        assert losses[i].item() == pytest.approx(neg_log_sigmoid(5.0 * h), rel=1e-12)
        assert chosen_r[i].item() - rejected_r[i].item() == pytest.approx(5.0 * h, rel=1e-9)


def test_simpo_matches_meng_eq6_and_ignores_reference():
    beta, ratio = 2.0, 0.5
    pc, pr = [-1.2, -0.8], [-1.5, -0.7]  # per-token means
    losses, chosen_r, rejected_r = dpo.dpo_loss(*as_tensors(pc, pr), None, None, beta=beta, loss_type="simpo",
                                                gamma_beta_ratio=ratio)
    for i in range(2):
        # L = -log sigmoid(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma), gamma = ratio * beta
        expected = neg_log_sigmoid(beta * pc[i] - beta * pr[i] - ratio * beta)
        assert losses[i].item() == pytest.approx(expected, rel=1e-12)
        assert chosen_r[i].item() == pytest.approx(beta * pc[i]) and rejected_r[i].item() == pytest.approx(beta * pr[i])
    # pair 0 by hand: 2 * 0.3 - 1 = -0.4 -> log(1 + e^0.4)
    assert losses[0].item() == pytest.approx(math.log1p(math.exp(0.4)), rel=1e-12)
    with_ref, _, _ = dpo.dpo_loss(*as_tensors(pc, pr, [5.0, 5.0], [-9.0, -9.0]), beta=beta, loss_type="simpo",
                                  gamma_beta_ratio=ratio)
    assert torch.equal(with_ref, losses)


def test_simpo_label_smoothing():
    beta, ratio, eps = 2.0, 0.5, 0.1
    losses, _, _ = dpo.dpo_loss(*as_tensors([-1.2], [-1.5]), None, None, beta=beta, loss_type="simpo",
                                gamma_beta_ratio=ratio, label_smoothing=eps)
    z = beta * (-1.2 + 1.5) - ratio * beta
    assert losses[0].item() == pytest.approx((1 - eps) * neg_log_sigmoid(z) + eps * neg_log_sigmoid(-z), rel=1e-12)


def test_ipo_matches_azar_eq17():
    for tau in (0.1, 0.5):
        losses, chosen_r, rejected_r = dpo.dpo_loss(*as_tensors(PC, PR, RC, RR), beta=tau, loss_type="ipo")
        for i in range(2):
            h = (PC[i] - RC[i]) - (PR[i] - RR[i])
            assert losses[i].item() == pytest.approx((h - 1 / (2 * tau)) ** 2, rel=1e-12)
            assert chosen_r[i].item() == pytest.approx(tau * (PC[i] - RC[i]))
    losses, _, _ = dpo.dpo_loss(*as_tensors(PC, PR, RC, RR), beta=0.5, loss_type="ipo")
    assert losses[0].item() == pytest.approx(0.25)  # (1.5 - 1)^2
    with pytest.raises(ValueError):
        dpo.dpo_loss(*as_tensors(PC, PR, RC, RR), beta=0.5, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError):
        dpo.dpo_loss(*as_tensors(PC, PR, RC, RR), beta=0.5, loss_type="kto")


def test_dpo_gradient_matches_the_derivative():
    # d/d log pi(y_w) of -log sigmoid(beta h) = -beta sigmoid(-beta h); the rejected gets the opposite sign.
    beta = 0.3
    pc, pr = (torch.tensor([-10.0], dtype=torch.float64, requires_grad=True),
              torch.tensor([-12.0], dtype=torch.float64, requires_grad=True))
    loss, _, _ = dpo.dpo_loss(pc, pr, torch.tensor([-11.0]).double(), torch.tensor([-11.5]).double(), beta=beta,
                              loss_type="dpo")
    loss.sum().backward()
    h = 1.5
    assert pc.grad.item() == pytest.approx(-beta * sigmoid(-beta * h), rel=1e-12)
    assert pr.grad.item() == pytest.approx(beta * sigmoid(-beta * h), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Batching and sequence logprobs
# ---------------------------------------------------------------------------------------------
PAIRS = [
    {"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [-100, -100, 7, 8],
     "rejected_input_ids": [5, 6, 9], "rejected_labels": [-100, -100, 9]},
    {"chosen_input_ids": [5, 1, 2], "chosen_labels": [-100, 1, 2],
     "rejected_input_ids": [5, 1, 3, 3, 4], "rejected_labels": [-100, 1, 3, 3, 4]},
]


def test_collate_pairs_stacks_chosen_then_rejected_padded_to_one_width():
    batch = dpo.collate_pairs([1, 0], PAIRS, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 1, 2, 0, 0], [5, 6, 7, 8, 0], [5, 1, 3, 3, 4], [5, 6, 9, 0, 0]]
    # targets[t] = label of token t + 1; -100 for the prompt and the padding
    assert batch["targets"].tolist() == [[1, 2, -100, -100, -100], [-100, 7, 8, -100, -100],
                                         [1, 3, 3, 4, -100], [-100, 9, -100, -100, -100]]
    assert batch["index"].tolist() == [1, 0] and batch["doc_lengths"] == [3, 4, 5, 3]


def test_sequence_logps_sums_trained_tokens_only():
    from transformers import Olmo3Config, Olmo3ForCausalLM

    torch.manual_seed(0)
    model = Olmo3ForCausalLM(Olmo3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1)).eval()
    batch = dpo.collate_pairs([0, 1], PAIRS, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits  # the full (2B, T, V) logits, for the hand sum
        dpo.install_chunked_head(model, chunk_size=3)  # then the chunked head the trainer uses
        sums, counts = dpo.sequence_logps(model, batch, torch.device("cpu"))
    for row, (ids, labels) in enumerate([(p[f"{s}_input_ids"], p[f"{s}_labels"])
                                         for s in ("chosen", "rejected") for p in PAIRS]):
        expected, n = 0.0, 0
        for t in range(1, len(ids)):
            if labels[t] == -100:
                continue
            z = logits[row, t - 1].tolist()  # the token at t is predicted at t - 1
            expected += z[labels[t]] - math.log(sum(math.exp(v) for v in z))
            n += 1
        assert sums[row].item() == pytest.approx(expected, rel=1e-5)
        assert counts[row].item() == n


def test_shard_batches_cover_every_item_once_with_equal_batch_counts():
    for n, bs, world in [(10, 3, 2), (7, 4, 3), (4, 8, 2), (12, 2, 3)]:
        seen, counts = [], set()
        for rank in range(world):
            shards = dpo.shard_batches(n, bs, rank, world)
            counts.add(len(shards))
            for indices, real in shards:
                assert len(indices) == bs and 0 <= real <= bs
                seen += indices[:real]
        assert sorted(seen) == list(range(n)) and len(counts) == 1


# ---------------------------------------------------------------------------------------------
# Reference cache key and multi-turn labels
# ---------------------------------------------------------------------------------------------
def test_reference_cache_key_changes_with_model_data_template_and_reduction(toy_model_dir, tmp_path):
    model_key = dpo.model_fingerprint(toy_model_dir)
    copy = str(tmp_path / "copy")
    shutil.copytree(toy_model_dir, copy)
    assert dpo.model_fingerprint(copy)["files"] == model_key["files"]  # contents, not paths or timestamps
    key, _ = dpo.reference_cache_key(model_key, PAIRS, "T", True, False)
    assert key == dpo.reference_cache_key(model_key, [dict(p) for p in PAIRS], "T", True, False)[0]
    other_pairs = [dict(PAIRS[0], rejected_labels=[-100, -100, -100]), PAIRS[1]]
    changed = [dpo.reference_cache_key(model_key, other_pairs, "T", True, False)[0],
               dpo.reference_cache_key(model_key, PAIRS[::-1], "T", True, False)[0],
               dpo.reference_cache_key(model_key, PAIRS, "T2", True, False)[0],
               dpo.reference_cache_key(model_key, PAIRS, "T", False, False)[0],
               dpo.reference_cache_key(model_key, PAIRS, "T", True, True)[0]]
    # a retrained model under the same path: the weights change, so the key does
    from safetensors.torch import load_file, save_file
    weights = load_file(os.path.join(copy, "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, os.path.join(copy, "model.safetensors"), metadata={"format": "pt"})
    changed.append(dpo.reference_cache_key(dpo.model_fingerprint(copy), PAIRS, "T", True, False)[0])
    assert len({key, *changed}) == len(changed) + 1


def test_multi_turn_preference_labels_only_the_final_assistant_turn(toy_model_dir):
    import chat_template
    from datasets import Dataset
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    history = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "\\boxed{5}"},
               {"role": "user", "content": "And 5+4?"}]
    rows = Dataset.from_list([{"chosen": history + [{"role": "assistant", "content": "\\boxed{9}"}],
                               "rejected": history + [{"role": "assistant", "content": "\\boxed{8}"}]}])
    tokenized, drops = chat_template.tokenize_preference(rows, tokenizer, max_length=512)
    assert not drops
    row = tokenized[0]
    for side, answer in (("chosen", "9"), ("rejected", "8")):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        trained = [t for t in labels if t != -100]
        assert tokenizer.decode(trained) == f"\\boxed{{{answer}}}" + tokenizer.eos_token
        first = labels.index(next(t for t in labels if t != -100))
        assert tokenizer.decode(ids[:first]).count("\\boxed{5}") == 1  # the earlier answer is context only
    batch = dpo.collate_pairs([0], [row], pad_id=tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 2


def test_terminate_cuts_both_sides_of_a_pair_at_the_same_left_position(toy_model_dir):
    """over_length_strategy terminate on a pair whose chosen side is too long: both sides lose the same number of
    prompt tokens from the left, so the answers are compared on one context, tails intact; a pair that could only
    fit by cutting into an answer is dropped."""
    import chat_template
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    prompt = [{"role": "user", "content": "Add these numbers: " + " + ".join(str(i) for i in range(30))}]
    pair = {"chosen": prompt + [{"role": "assistant", "content": "Step by step: " + ", ".join(
                str(sum(range(i + 1))) for i in range(30)) + ". \\boxed{435}"}],
            "rejected": prompt + [{"role": "assistant", "content": "\\boxed{400}"}]}
    full, _ = chat_template.tokenize_preference([pair], tokenizer, max_length=None, cache_dir="")
    chosen, rejected = full[0]["chosen_input_ids"], full[0]["rejected_input_ids"]
    answer_len = len(chosen) - full[0]["chosen_labels"].index(next(t for t in full[0]["chosen_labels"] if t != -100))
    max_length = answer_len + 20  # room for the chosen answer and the prompt's last 20 tokens
    cut, drops = chat_template.tokenize_preference([pair], tokenizer, max_length=max_length,
                                                   over_length_strategy="terminate", cache_dir="")
    assert not drops
    row = cut[0]
    assert len(row["chosen_input_ids"]) == max_length
    removed = len(chosen) - max_length
    for side, ids in (("chosen", chosen), ("rejected", rejected)):
        assert row[f"{side}_input_ids"] == ids[removed:]  # the same left cut, the tail as it was
        assert row[f"{side}_labels"] == full[0][f"{side}_labels"][removed:]
    context = [row[f"{side}_input_ids"][:row[f"{side}_labels"].index(
        next(t for t in row[f"{side}_labels"] if t != -100))] for side in ("chosen", "rejected")]
    assert context[0] == context[1] and len(context[0]) == 20
    _, drops = chat_template.tokenize_preference([pair], tokenizer, max_length=answer_len - 1,
                                                 over_length_strategy="terminate", cache_dir="")
    assert drops["over_length"] == 1


def test_a_template_without_generation_blocks_is_said_once_at_start_up(toy_model_dir, tmp_path, monkeypatch, capsys):
    """dpo.py with a template without {% generation %} blocks: one start-up warning with the rows whose opening
    <think> prefix labeling masks, and the fix."""
    import chat_template
    from transformers import AutoTokenizer
    monkeypatch.setenv("OLMO3_POSTTRAIN_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    think = chat_template.TEMPLATES["olmo3-think-dev"]
    tokenizer.chat_template = think.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    user = {"role": "user", "content": "What is 2+3?"}
    pairs = [{side: [user, {"role": "assistant", "content": f"<think>{i}</think>\\boxed{{{answer}}}"}]
              for side, answer in (("chosen", 5), ("rejected", 6))} for i in range(3)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    args = dpo.Args(model_name_or_path="unused", dataset_mixer_list=[str(data), "1.0"], max_seq_length=512,
                    eval_split_fraction=0.0)
    pairs_out, _, _, _ = dpo.load_data(args, tokenizer, dpo.World(0, 1, 0, torch.device("cpu")))
    out = capsys.readouterr().out
    assert len(pairs_out) == 3 and out.count("has no {% generation %} blocks") == 1
    assert "3 have the opening <think> of their answer masked" in out


# ---------------------------------------------------------------------------------------------
# The real script on the toy model
# ---------------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dpo(args, nproc=1, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1" if nproc > 1 else "2")  # one process: both cores
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(free_port())]
                if nproc > 1 else [sys.executable])
    out = subprocess.run(launcher + [os.path.join(REPO, "dpo.py"), *args], cwd=REPO, env=env, timeout=timeout,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_reused_output_dir_stops_before_any_work(tmp_path):
    """A previous run's metrics in output_dir stop dpo.py at once (no model or data is loaded: both are
    bogus here) unless --resume or --overwrite_output_dir; --cache_reference_only writes nothing there."""
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    out = subprocess.run([sys.executable, os.path.join(REPO, "dpo.py"), "--model_name_or_path", "no_such_model",
                          "--dataset_mixer_list", "no_such.jsonl", "1.0", "--output_dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "holds a previous run (metrics.jsonl)" in out.stderr, out.stderr[-3000:]
    assert (tmp_path / "metrics.jsonl").exists()


def test_resume_without_a_checkpoint_starts_fresh(tmp_path, capsys):
    """--resume where output_dir holds no complete checkpoint yet (a preemptible job's first start, or one
    stopped before its first save: metrics and a half-written temp dir) starts from scratch, so such a job
    can always pass --resume; with a checkpoint it continues from it. main() decides through this function."""
    out = str(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints" / ".tmp-step_2").mkdir(parents=True)
    dpo.check_output_dir(out, True, False, True)  # no stop, nothing deleted
    assert dpo.resume_checkpoint(out, True, True) is None
    assert "--resume: no checkpoint" in capsys.readouterr().out and (tmp_path / "metrics.jsonl").exists()
    assert dpo.resume_checkpoint(out, True, False) is None and capsys.readouterr().out == ""  # one rank says it
    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir()
    (step / "training_state.pt").write_bytes(b"")
    assert dpo.resume_checkpoint(out, True, True) == str(step)
    assert dpo.resume_checkpoint(out, False, True) is None  # without --resume, never


# demo.sh's DPO stage (lr 1e-5, 16 pairs per step, 1 epoch), with 10% of the pairs held out.
LEARN_ARGS = ["--dataset_mixer_list", "PREF", "1.0", "--eval_split_fraction", "0.1", "--max_seq_length", "256",
              "--loss_type", "dpo_norm", "--learning_rate", "1e-5", "--per_device_train_batch_size", "16",
              "--gradient_accumulation_steps", "1", "--num_train_epochs", "1", "--eval_steps", "50",
              "--logging_steps", "5", "--save_steps", "0", "--seed", "0", "--report_to", "none"]


@pytest.fixture(scope="module")
def first_dpo_run(toy_sft_model_dir, toy_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    out, cache = str(root / "run1"), str(root / "reference_cache")
    args = [a.replace("PREF", os.path.join(toy_data_dir, "preference.jsonl")) for a in LEARN_ARGS]
    log = run_dpo(args + ["--model_name_or_path", toy_sft_model_dir, "--output_dir", out,
                          "--reference_cache_dir", cache])
    return {"args": args, "out": out, "cache": cache, "log": log, "root": root}


@pytest.mark.slow
def test_dpo_raises_heldout_preference_accuracy_and_keeps_task_accuracy(first_dpo_run, toy_sft_model_dir, toy_data_dir):
    metrics = read_metrics(first_dpo_run["out"])
    start, end = metrics[0], metrics[-1]
    print("held-out:", {k: (start[k], end[k]) for k in ("eval/accuracy", "eval/policy_accuracy", "eval/loss")})
    assert start["step"] == 0 and start["reference/computed_pairs"] > 0
    assert "reference logprobs: cache miss" in first_dpo_run["log"]
    # Before training the policy is the reference: every implicit-reward margin is 0 and the loss log 2.
    assert start["eval/accuracy"] == 0.0 and start["eval/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert end["eval/accuracy"] > 0.5                                   # held-out pairs ranked right by the reward
    assert end["eval/policy_accuracy"] > start["eval/policy_accuracy"]  # and by the policy's own likelihood
    assert end["eval/loss"] < start["eval/loss"]
    assert end["eval/rewards/margin"] > 0 and end["train/rewards/chosen"] > end["train/rewards/rejected"]
    for key in ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margin",
                "train/accuracy", "perf/tokens_per_s", "perf/mfu", "train/lr", "train/grad_norm"):
        assert math.isfinite(end[key]), key
    # MFU x peak / tokens per second (both sides of each pair) is the FLOPs of one token: bounded by a hand count.
    peak = json.load(open(os.path.join(first_dpo_run["out"], "run_config.json")))["derived"]["peak_flops_per_device"]
    low, high = flops_per_token_bounds(first_dpo_run["out"])
    for row in (row for row in metrics if "perf/mfu" in row):
        assert low <= row["perf/mfu"] * peak / row["perf/tokens_per_s"] <= high, row
    steps = [row["step"] for row in metrics if "train/loss" in row]  # every step in the file, a line every 5
    assert steps == list(range(1, len(steps) + 1)) and first_dpo_run["log"].count("train/loss=") <= len(steps) // 5 + 2
    eval_path = os.path.join(toy_data_dir, "eval.jsonl")
    sft_acc = toy.evaluate(toy_sft_model_dir, eval_path, max_new_tokens=64, num_samples=0)["accuracy"]
    dpo_acc = toy.evaluate(first_dpo_run["out"], eval_path, max_new_tokens=64, num_samples=0)["accuracy"]
    print(f"toy task accuracy: sft {sft_acc:.3f} -> dpo {dpo_acc:.3f}")
    # measured: held-out reward accuracy 0 -> 0.875, policy accuracy 0.34 -> 0.655, toy accuracy 52% -> 59%
    assert dpo_acc >= sft_acc


@pytest.mark.slow
def test_second_run_uses_the_reference_cache(first_dpo_run, toy_sft_model_dir):
    cache_files = sorted(f for f in os.listdir(first_dpo_run["cache"]) if f.endswith(".pt"))
    assert len(cache_files) == 2  # train and eval splits
    mtimes = {f: os.path.getmtime(os.path.join(first_dpo_run["cache"], f)) for f in cache_files}
    out = str(first_dpo_run["root"] / "run2")
    # (--rpo_alpha changes the loss, not the reference: the cache must still hit)
    log = run_dpo(first_dpo_run["args"] + ["--model_name_or_path", toy_sft_model_dir, "--output_dir", out,
                                           "--reference_cache_dir", first_dpo_run["cache"], "--max_steps", "2",
                                           "--rpo_alpha", "1.0"])
    assert log.count("reference logprobs: cache hit") == 2 and "cache miss" not in log
    start = read_metrics(out)[0]
    assert start["reference/cache_hit"] == 1 and start["reference/computed_pairs"] == 0
    assert start["eval/accuracy"] == 0.0 and start["eval/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert {f: os.path.getmtime(os.path.join(first_dpo_run["cache"], f)) for f in cache_files} == mtimes
    # RPO's term is the chosen answer's per-token NLL: positive, and minus the mean chosen logprob
    # that dpo_norm reports (both are per-pair means of the same per-token mean).
    last = read_metrics(out)[-1]
    assert last["train/nll"] > 0 and last["train/nll"] == pytest.approx(-last["train/logps/chosen"], rel=1e-5)
    # (that a different model, data, template or reduction misses: test_reference_cache_key_changes_...)


def write_multi_turn(toy_data_dir, path, n=40):
    """Two-turn pairs built from toy pairs: a finished exchange, then the next question; the answers differ last."""
    with open(os.path.join(toy_data_dir, "preference.jsonl")) as f:
        rows = [json.loads(line) for line in f][-n:]
    with open(path, "w") as f:
        for a, b in zip(rows[::2], rows[1::2]):
            f.write(json.dumps({"chosen": a["chosen"] + b["chosen"], "rejected": a["chosen"] + b["rejected"]}) + "\n")
    return str(path)


def table_of(cache_dir, split):
    """The cached (2, N) reference table of one split."""
    [name] = [f for f in os.listdir(cache_dir) if f.endswith(".json")
              and json.load(open(os.path.join(cache_dir, f)))["split"] == split]
    return torch.load(os.path.join(cache_dir, name[:-5] + ".pt"))["logps"]


@pytest.mark.slow
def test_torchrun_two_ranks_multiturn_checkpoint_and_resume(toy_sft_model_dir, toy_data_dir, tmp_path):
    multi = write_multi_turn(toy_data_dir, tmp_path / "multi.jsonl")
    out, cache = str(tmp_path / "ddp"), str(tmp_path / "cache")
    args = ["--model_name_or_path", toy_sft_model_dir, "--output_dir", out, "--reference_cache_dir", cache,
            "--dataset_mixer_list", os.path.join(toy_data_dir, "preference.jsonl"), "60", multi, "1.0",
            "--eval_split_fraction", "0.2", "--max_seq_length", "512", "--learning_rate", "3e-4",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "4",
            "--save_steps", "2", "--seed", "1", "--report_to", "none"]
    log = run_dpo(args, nproc=2)
    assert log.count("reference logprobs: cache miss") == 2
    full = read_metrics(out)
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4] and full[0]["eval/accuracy"] == 0.0
    assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == "step_2"
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    # Each rank scored half the pairs; the gathered table is complete and equals one process's.
    two_rank = table_of(cache, "train")
    assert two_rank.shape == (2, 64) and torch.isfinite(two_rank).all()
    single = str(tmp_path / "cache1")
    run_dpo(args + ["--reference_cache_dir", single, "--cache_reference_only"])
    torch.testing.assert_close(table_of(single, "train"), two_rank, rtol=1e-5, atol=1e-5)
    # Resume from step 2: the reference comes from the cache (computed from the initial weights,
    # not the resumed ones) and steps 3-4 repeat the uninterrupted run.
    log = run_dpo(args + ["--resume"], nproc=2)
    assert "cache hit" in log and "cache miss" not in log
    resumed = read_metrics(out)[len(full):]
    assert [m["step"] for m in resumed] == [2, 3, 4]
    for a, b in zip(full[3:], resumed[1:]):
        for key in ("train/loss", "train/rewards/margin", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert resumed[-1]["eval/accuracy"] == pytest.approx(full[-1]["eval/accuracy"])


@pytest.mark.slow
def test_lora_reference_is_the_base_model_with_the_adapter_off(toy_sft_model_dir, toy_data_dir, tmp_path):
    out, cache = str(tmp_path / "lora"), str(tmp_path / "cache")
    args = ["--model_name_or_path", toy_sft_model_dir, "--output_dir", out, "--reference_cache_dir", cache,
            "--dataset_mixer_list", os.path.join(toy_data_dir, "preference.jsonl"), "48", "--max_seq_length", "256",
            "--use_lora", "--lora_rank", "8", "--lora_alpha", "16", "--merge_lora", "--learning_rate", "1e-2",
            "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_steps", "3",
            "--save_steps", "2", "--seed", "0", "--report_to", "none"]
    run_dpo(args)
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
    assert os.path.isfile(os.path.join(out, "merged", "model.safetensors"))
    base = table_of(cache, "train")
    # Resume loads the trained adapter before the reference pass; with a fresh cache the pass
    # must switch the adapter off and reproduce the base model's table.
    fresh = str(tmp_path / "cache2")
    log = run_dpo(args + ["--resume", "--reference_cache_dir", fresh, "--cache_reference_only"])
    assert "cache miss" in log
    torch.testing.assert_close(table_of(fresh, "train"), base, rtol=1e-5, atol=1e-5)
    # ... which is a real check: the adapter did train (LoRA's B starts at 0, so it moved).
    from safetensors.torch import load_file
    adapter = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert max(t.abs().max().item() for name, t in adapter.items() if "lora_B" in name) > 1e-3
