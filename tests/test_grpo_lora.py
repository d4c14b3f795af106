"""grpo.py with --lora_rank: the learner trains a peft adapter and only the adapter goes to the engines. Fast: the
bytes of an update on the real model's shape. Slow, on real vLLM (CPU) with the toy model: torchrun 2 FSDP2 learners
+ 1 actor with an actor killed mid-run, and --resume from the saved adapter as 1 learner + 1 actor; a colocated run
whose engine stops loading adapters fails the probe; the prefix cache never serves KV computed under another adapter
version."""

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import grpo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = ["--lora_rank", "8", "--lora_alpha", "32", "--learning_rate", "1e-3"]


def _cmd(model, data, out, *extra):
    return ["grpo.py", "--model_name_or_path", model, "--output_dir", out,
            "--dataset_mixer_list", os.path.join(data, "rlvr.jsonl"), "1.0", "--eval_every", "0", "--enforce_eager",
            "--report_to", "none", "--max_prompt_length", "128", "--max_response_length", "48", "--max_num_seqs", "32",
            "--num_unique_prompts_per_step", "2", "--num_samples_per_prompt", "4", "--max_prompts_per_step_factor", "2",
            "--timeout_s", "120", *LORA, *extra]  # a TP 2 engine beside its learner on 2 busy cores: ~1 min a step


def _by_length(toy_data_dir, tmp_path) -> str:
    """Toy RL prompts scored by length (max_length against 0 words): every group has a gradient, so every update
    moves the adapter."""
    rows = [json.loads(line) for line in open(os.path.join(toy_data_dir, "rlvr.jsonl"))][:200]
    (tmp_path / "by_length").mkdir()
    with open(tmp_path / "by_length" / "rlvr.jsonl", "w") as f:
        f.writelines(json.dumps({**r, "verifier": "max_length", "ground_truth": "0"}) + "\n" for r in rows)
    return str(tmp_path / "by_length")


def _train_rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "rollout/groups" in r]


def test_lora_update_is_under_5_percent_of_a_full_one_on_the_real_model_shape():
    """SmolLM2-135M-Instruct's shape (real_model.py's model; Llama, tied embeddings), rank 16 (prime-rl's default,
    named in --help), every linear layer: the adapter an update sends (grpo.adapter_state, peft's saved names) is at
    most 5% of the bytes of a full update (every weight, grpo.update_bytes), and it names only adapter tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192)
    model = AutoModelForCausalLM.from_config(config)
    full = grpo.update_bytes(types.SimpleNamespace(model=model, wire_dtype=torch.bfloat16), None)
    assert 130e6 * 2 < full < 140e6 * 2  # 135M parameters in bf16
    args = grpo.Args(lora_rank=16)
    model = grpo.add_adapter(args, model, None)
    adapter = grpo.adapter_state(model, torch.bfloat16)
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter), sorted(adapter)[:4]
    assert not any("lm_head" in k or "embed" in k for k in adapter)
    sent = sum(v.numel() * v.element_size() for v in adapter.values())
    print(f"bytes per update, rank 16: LoRA {sent / 1e6:.2f} MB, full {full / 1e6:.1f} MB ({sent / full:.2%})")
    assert sent <= 0.05 * full
    # what the optimizer holds: the adapter alone
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) * 2 == sent


@pytest.mark.slow
def test_torchrun_lora_actor_killed_then_resume_from_the_adapter(toy_model_dir, toy_data_dir, tmp_path):
    """torchrun, 2 learners (FSDP2 on gloo, each holding a shard of the peft-wrapped policy) + 1 actor, LoRA rank 8:
    every update sends the adapter alone, gathered whole from both learners' shards (bytes logged, a few % of the
    model's), and its probe matches; a checkpoint each step holds the peft adapter, not the model. kill -9 the actor:
    the learners exit with an error naming it. --resume as 1 learner + 1 actor (the optimizer's state, saved by name
    by the two learners, loads into one), on an engine of two tensor-parallel workers, continues from the saved
    adapter for two steps (start step printed; the adapter loaded into learner and engine: the probes after resuming
    match), removes the killed engine's adapter files, and ends with the adapter and the merged model, which is
    base + B A x alpha / r."""
    data = _by_length(toy_data_dir, tmp_path)
    out, log_path = str(tmp_path / "run"), tmp_path / "log.txt"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                             *_cmd(toy_model_dir, data, out, "--num_training_steps", "1000", "--save_steps", "1",
                                   "--num_learners", "2")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not os.path.isdir(os.path.join(out, "checkpoints", "step_2")):
            assert proc.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.5)
        text = open(log_path).read()
        assert "2 learner(s), 1 actor(s)" in text, text[-3000:]
        actor_pid = int(text.split("[actor rank 2] pid ")[1].split(":")[0])
        os.kill(actor_pid, signal.SIGKILL)
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = open(log_path).read()
    assert rc != 0 and ("FATAL" in text and "actor" in text or "Root Cause" in text), text[-3000:]
    rows = _train_rows(out)  # the killed run may have logged a step after its last checkpoint: resuming logs it again
    full = os.path.getsize(os.path.join(toy_model_dir, "model.safetensors"))
    assert rows and all(0 < r["sync/update_bytes"] < 0.06 * full for r in rows), (full, rows[0])
    # the two learners' adapter shards, gathered, are what the engine serves: the probes match (checks > 0: a run
    # whose every probe was skipped would pass the next line on nothing)
    assert sum(r["sync/probe_checks"] for r in rows) >= 1, rows
    assert all(r["sync/probe_max_abs_diff"] < 2e-3 for r in rows if r["sync/probe_checks"])
    last = grpo.latest_checkpoint(out)
    assert sorted(f for f in os.listdir(last) if f.startswith(("adapter", "model"))) == [
        "adapter_config.json", "adapter_model.safetensors"]
    step = torch.load(os.path.join(last, "training_state.pt"), weights_only=False)["step"]
    from safetensors.torch import load_file

    saved = load_file(os.path.join(last, "adapter_model.safetensors"))

    with open(tmp_path / "resumed.txt", "w") as log:
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             *_cmd(toy_model_dir, data, out, "--num_training_steps", str(step + 2), "--resume",
                                  "--vllm_tensor_parallel_size", "2", "--seed", "2", "--num_learners", "1")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=400).returncode
    text = open(tmp_path / "resumed.txt").read()
    assert rc == 0 and f"start step {step}" in text and "1 learner(s), 1 actor(s)" in text, text[-3000:]
    after = _train_rows(out)[len(rows):]
    assert [r["step"] for r in after] == [step + 1, step + 2], after
    assert sum(r["sync/probe_checks"] for r in after) >= 1 and all(r["sync/probe_max_abs_diff"] < 2e-3 for r in after)
    # the run went on from the saved adapter: lora_A moved by two AdamW steps (about lr each), not re-drawn (a new
    # adapter under --seed 2 would differ by the init's scale, ~0.1)
    final = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    a_keys = [k for k in saved if ".lora_A." in k]
    assert a_keys and sorted(final) == sorted(saved)
    assert max((final[k] - saved[k]).abs().max().item() for k in a_keys) < 0.02
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = load_file(os.path.join(out, "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, os.path.join(out, "adapter"))
    layer = adapted.base_model.model.model.layers[0].self_attn.q_proj
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    assert delta.abs().max() > 0  # trained
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(merged[key], layer.base_layer.weight + delta, atol=1e-6)
    # the killed engine's adapters stayed on the RAM disk; the resumed run's engine removed them
    assert f"grpo-adapters-{actor_pid}-0" not in os.listdir("/dev/shm")


@pytest.mark.slow
def test_colocated_lora_engine_that_keeps_an_old_adapter_fails_the_probe(toy_model_dir, toy_data_dir, tmp_path):
    """Colocated (`python grpo.py`), LoRA: updates 1 and 2 load and their probes match; from version 3 on the engine
    skips the load (GRPO_TEST_SKIP_ADAPTER_LOAD, test only: it keeps serving version 2's adapter, as engines that
    silently serve an old adapter do) and the run stops at the probe with an error saying so."""
    out = str(tmp_path / "run")
    with open(tmp_path / "log.txt", "w") as log:  # a file, not a pipe: nothing the run leaves behind holds it open
        rc = subprocess.run([sys.executable, *_cmd(toy_model_dir, _by_length(toy_data_dir, tmp_path), out,
                                                   "--num_training_steps", "6")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=400,
                            env=dict(os.environ, GRPO_TEST_SKIP_ADAPTER_LOAD="3")).returncode
    text = open(tmp_path / "log.txt").read()
    assert rc != 0, text[-3000:]
    assert "engine logprobs of the probe differ from the learner's after the update to version 3" in text, text[-3000:]
    rows = _train_rows(out)
    assert [r["step"] for r in rows][:2] == [1, 2], rows
    assert all(r["sync/probe_max_abs_diff"] < 2e-3 for r in rows[:2] if r["sync/probe_checks"])
    assert all(r["train/grad_norm"] > 0 for r in rows[:2])  # the adapter moved at every step


@pytest.mark.slow
def test_lora_prefix_cache_never_crosses_adapter_versions_and_requests_keep_theirs(toy_model_dir, tmp_path):
    """The same prompt under the same cache salt: computed again on another adapter version (vLLM's block hash
    holds the adapter's name and path, and each version has its own, EngineWeights.load_adapter), reused from the
    cache on the same version (the control). A request keeps the adapter it started on and its tokens that version;
    unused versions are removed from the engine and disk."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    args = grpo.Args(lora_rank=8, num_samples_per_prompt=1, max_prompt_length=400, max_response_length=4,
                     max_num_seqs=8, enforce_eager=True, lora_dir=str(tmp_path))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32),
                           LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    actor = grpo.Actor(args, toy_model_dir, 0, lambda m: None, "cpu")
    prompt = [5 + i % 300 for i in range(320)]  # spans several KV blocks, so whole blocks can be cached
    try:
        for version in (0, 1):
            actor.weights.load_adapter(version, {"config": model.peft_config["default"],
                                                 "tensors": grpo.adapter_state(model, torch.float32)})
        first, second = actor.weights.adapters[0], actor.weights.adapters[1]
        assert first.lora_name != second.lora_name and first.lora_path != second.lora_path

        def cached_tokens(rid, adapter):
            actor.add_request(rid, prompt, "one-salt", SamplingParams(max_tokens=1), adapter)
            while True:
                for out in actor.engine.step():
                    if out.request_id == rid and out.finished:
                        return out.num_cached_tokens or 0

        assert cached_tokens("a", first) == 0
        assert cached_tokens("b", first) > 0  # control: the same adapter reuses the prompt's blocks
        assert cached_tokens("c", second) == 0  # another version: computed again
        actor.weights.remove_unused_adapters()  # nothing runs: every version but the newest goes
        assert list(actor.weights.adapters) == [1] and not os.path.exists(first.lora_path)

        # Inflight: a group admitted on version 1 keeps adapter 1 while version 2 loads mid-generation, every token
        # records version 1 (vLLM's own labels would say 2 for the later ones), and version 1 goes once it finished.
        emitted = []
        actor.emit, actor.version = emitted.append, 1
        actor.meter.start(1e12, 1e11)
        actor._admit({"kind": "train", "index": 0, "prompt_ids": prompt[:16], "n": 2})
        actor._step_engine()  # prefill and the first token, on version 1
        actor.weights.load_adapter(2, {"config": model.peft_config["default"],
                                       "tensors": grpo.adapter_state(model, torch.float32)})
        actor.version = 2
        actor.weights.remove_unused_adapters()
        assert sorted(actor.weights.adapters) == [1, 2]  # version 1 still runs
        while not emitted:
            actor._step_engine()
        samples = emitted[0]["group"]["samples"]
        assert [s["versions"] for s in samples] == [[1] * 4, [1] * 4], samples
        actor.weights.remove_unused_adapters()
        assert list(actor.weights.adapters) == [2]
    finally:
        actor.shutdown()
    assert not os.listdir(tmp_path)  # the engine's adapter directory goes with it
