"""OlmoRL (Olmo 3 sec 4.4): GRPO-style RL with verifiable rewards, torch.distributed learners and vLLM actors.

Continuous batching keeps every engine full; active sampling trains each step on exactly
`num_unique_prompts_per_step` groups whose rewards differ; inflight updates load new weights between two
engine steps without draining; an off-policy bound, truncated importance sampling against vLLM's sampling
logprobs, clip-higher and token-level normalization make the loss (Olmo 3 / open-instruct grpo_fast defaults).

    learner 0: prompts -> actors; finished groups -> verifiers.py rewards -> zero-std filter -> advantages
    learners:  loss + optimizer step (FSDP2 with several) -> weights to every engine (vLLM's weight transfer)
    actors:    one vLLM engine each; load the weights between two steps, probe them, keep generating

torchrun ranks [0, num_learners) learn, the others are actors; one process (`python grpo.py`) runs the actor
in a thread beside the learner. Every wait between roles has a timeout (`--timeout_s`).

Departures, on purpose (README has the measurements):
- The bound `async_steps` K applies at admission: a prompt starts only on weights at most K versions older
  than the step that trains on it; its later tokens may come from newer weights (inflight updates). Every
  token's version is recorded and the lags logged. `--max_token_lag` adds open-instruct's drop at
  consumption, off by default: it selects against long answers.
- An inflight update pauses the scheduler (keep mode: no abort, no cache clear) so per-token versions are
  exact; running requests keep their KV cache, computed by the old weights (PipelineRL's staleness).
- Prompts in flight at a checkpoint are skipped on resume, not replayed.
- A row with `tools` runs as a multi-turn episode, one token sequence: tool results are appended as tokens and
  trained on as context only (ToolEpisodes; README, tool use).

Reading order: Args, then the sections, each under a ruler whose title starts with its line here (a test holds
the two in step):
    ONE STEP: its data path, in order
    ALGORITHM (Olmo 3 sec 4.4): advantages, the zero-std filter, active sampling, the admission gate, the loss
    The learner's batches: packing rows, and their logprobs
    Tool episodes: calls parsed from a sampled turn, run off the engine loop
    The actor: one vLLM engine kept full (continuous batching)
    Learner 0's side: the link to the actors and the prompt dispatcher
    WEIGHT UPDATES: learner 0 -> every engine through vLLM's weight-transfer engine
    The learner: setup, the loop, `main`
    PLUMBING: messages between roles
    PLUMBING (the same block in sft.py, dpo.py and grpo.py): log-probabilities
    PLUMBING: the cost model
    PLUMBING: devices and CPU cores of each rank
    PLUMBING: metrics, the run summary, checkpoints
    Flags of open-instruct's Olmo 3 RL scripts that grpo.py does not take

    # CPU, the toy model (python toy.py model toy_model; python toy.py data toy_data); README has the rest
    VLLM_CPU_KVCACHE_SPACE=1 python grpo.py --model_name_or_path toy_sft --output_dir out/grpo_toy \\
        --dataset_mixer_list toy_data/rlvr.jsonl 1.0 --eval_dataset_mixer_list toy_data/eval.jsonl 64 \\
        --learning_rate 3e-5 --num_training_steps 24 --eval_every 12 --num_unique_prompts_per_step 8 \\
        --num_samples_per_prompt 8 --max_prompt_length 128 --max_response_length 64 --pack_length 1024 \\
        --max_num_seqs 32 --enforce_eager
    # 8 GPUs: 4 learners (FSDP2) + 4 engines; two nodes: add --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST
    torchrun --nproc-per-node 8 grpo.py --num_learners 4 --model_name_or_path allenai/Olmo-3-7B-Think-DPO \\
        --gradient_checkpointing ...

Outputs in `output_dir`: the final model (HF layout), metrics.jsonl, summary.json, checkpoints/step_N.

LoRA (`--lora_rank 16`): the learner trains a peft adapter over the frozen model and each update sends the adapter
alone; every engine loads it through vLLM's add_lora under a name of its own per policy version, so a request keeps
the adapter it started on (its tokens carry that version) and the prefix cache never mixes versions
(EngineWeights.load_adapter). Checkpoints hold the adapter; output_dir the merged model, output_dir/adapter the adapter.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import datetime
import functools
import importlib.util
import inspect
import json
import math
import os
import pickle
import queue
import random
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist
try:
    from vllm.distributed.weight_transfer import (ParamMeta, WeightSource, WeightTransferEngineFactory,
                                                  WeightTransferTrainerFactory)
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, materialize_full_tensor
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine,
                                                              NCCLWeightTransferEngine)
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
except ImportError:  # the learner alone (bench_learner.py on a GPU machine without vLLM) imports this file too
    WeightTransferEngineFactory = WeightTransferTrainerFactory = None
    NCCLTrainerInitInfo = NCCLTrainerWeightTransferEngine = NCCLWeightTransferEngine = WeightSource = object
    TrainerInitInfo = WeightTransferInitInfo = object



@dataclass
class Args:
    # ---- run and logging
    output_dir: str = field(default="output/grpo", metadata={"help": "Metrics, summary and checkpoints go here."})
    seed: int = field(default=1, metadata={"help": "Random seed (learner ranks add their rank)."})
    # wandb's own mode applies: online when logged in, else offline; WANDB_MODE overrides
    report_to: str = field(default="none", metadata={"help": "'wandb' or 'none'."})
    wandb_project: str = field(default="olmo3-posttrain", metadata={"aliases": ["--wandb_project_name"],
                                                                    "help": "wandb project name."})
    wandb_entity: str | None = field(default=None, metadata={"help": "wandb team or user (default: yours)."})
    run_name: str = field(default="grpo", metadata={"aliases": ["--exp_name"], "help": "wandb run name."})
    save_steps: int = field(default=0, metadata={
        "aliases": ["--save_freq"], "help": "Checkpoint every N steps (0: only at the end; Olmo 3 7B Think RL: 25)."})
    resume: bool = field(default=False, metadata={"help": "Resume from the latest checkpoint in output_dir."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start over in an output_dir that holds a run (deletes its checkpoints and metrics)."})
    keep_last_n_checkpoints: int = field(default=2, metadata={
        "help": "Keep the newest N checkpoints (0: all; the one resumed from is never deleted)."})
    eval_every: int = field(default=10, metadata={
        "aliases": ["--local_eval_every"], "help": "Evaluate every N steps, before the first and after the last."})
    # metrics.jsonl and wandb get every step; evaluations always print
    logging_steps: int = field(default=1, metadata={"help": "Print a step line every N steps and after the last."})
    eval_num_samples: int = field(default=4, metadata={"help": "k samples per eval prompt, for pass@1 and pass@k."})
    # ---- model and data
    model_name_or_path: str = field(default="toy_model", metadata={
        "help": "HF model directory or hub name (the SFT or DPO checkpoint)."})
    # rows: messages, ground_truth, verifier (Olmo 3's RLVR format)
    dataset_mixer_list: list[str] = field(default_factory=lambda: ["toy_data/rlvr.jsonl", "1.0"], metadata={
        "aliases": ["--mixer_list"], "help": "RLVR sources and fractions or counts: `a.jsonl 1.0 org/b 500`."})
    dataset_mixer_list_splits: list[str] = field(default_factory=lambda: ["train"], metadata={
        "help": "Split of each Hub source: one for all, or one per source."})
    eval_dataset_mixer_list: list[str] = field(default_factory=list, metadata={
        "aliases": ["--dataset_mixer_eval_list"], "help": "Held-out RLVR sources for evaluation (empty: no eval)."})
    eval_dataset_mixer_list_splits: list[str] = field(default_factory=lambda: ["train"], metadata={
        "aliases": ["--dataset_mixer_eval_list_splits"], "help": "Split of each held-out Hub source."})
    chat_template: str | None = field(default=None, metadata={
        "aliases": ["--chat_template_name"], "help": "Chat template name or path (default: the tokenizer's)."})
    max_prompt_length: int = field(default=2048, metadata={
        "aliases": ["--max_prompt_token_length"], "help": "Prompts longer than this are dropped (Olmo 3: 2048)."})
    max_response_length: int = field(default=32768, metadata={
        "aliases": ["--response_length"], "help": "Generation stops here, marked truncated; a tool episode's results count (Olmo 3 Think: 32768)."})
    # ---- tool use: a row with a `tools` column (function schemas) runs as a multi-turn episode (Actor)
    tools_module: str | None = field(default=None, metadata={
        "help": "A Python file defining TOOLS = {name: function}, tools beside the built-in `python` (sandboxed)."})
    max_tool_turns: int = field(default=5, metadata={"help": "Tool-calling turns per episode; then it ends."})
    tool_timeout_s: float = field(default=30.0, metadata={
        "help": "A tool call still running after this many seconds is answered as timed out."})
    max_tool_output_chars: int = field(default=4000, metadata={"help": "Tool results are cut to this many characters."})
    # ---- algorithm (Olmo 3 / open-instruct grpo_fast defaults)
    num_training_steps: int = field(default=1000, metadata={"help": "Learner steps (each one rollout batch)."})
    num_unique_prompts_per_step: int = field(default=64, metadata={
        "aliases": ["--num_unique_prompts_rollout"], "help": "Groups with reward std > 0 per step (Olmo 3: 64)."})
    num_samples_per_prompt: int = field(default=8, metadata={
        "aliases": ["--num_samples_per_prompt_rollout"], "help": "Group size: completions per prompt (Olmo 3: 8)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (Olmo 3: 1.0)."})
    # the toy demo: 1e-4, constant (3e-4 degrades it)
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (Olmo 3 7B: 1e-6)."})
    lr_scheduler_type: str = field(default="constant", metadata={
        "help": "'constant' or 'linear' decay to 0 (Olmo 3: constant)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"aliases": ["--clip_grad_norm"], "help": "Gradient clipping."})
    num_mini_batches: int = field(default=1, metadata={"help": "Optimizer steps per learner step."})
    num_epochs: int = field(default=1, metadata={"help": "Passes over each step's batch."})
    clip_low: float = field(default=0.2, metadata={
        "aliases": ["--clip_lower"], "help": "PPO clip epsilon below 1 (Olmo 3: 0.2)."})
    clip_high: float = field(default=0.272, metadata={
        "aliases": ["--clip_higher"], "help": "Clip epsilon above 1 (DAPO; Olmo 3 code: 0.272)."})
    tis_cap: float = field(default=2.0, metadata={"aliases": ["--truncated_importance_sampling_ratio_cap"],
                                                  "help": "Cap on exp(learner - vLLM logprob) (0: no correction)."})
    beta: float = field(default=0.0, metadata={"help": "KL-to-reference coefficient, k3 estimator (Olmo 3: 0)."})
    advantage_normalization: str = field(default="centered", metadata={
        "aliases": ["--advantage_normalization_type"],
        "help": "'centered' (reward - group mean) or 'standard' (also / group std; Olmo 3: centered)."})
    # Applied at admission, so a long answer admitted in time is trained whatever versions its later tokens
    # came from (Olmo 3 7B think RL: 8; the infra benchmark: 4)
    async_steps: int = field(default=1, metadata={
        "help": "A prompt starts only on weights at most K versions older than the step that trains on it."})
    # open-instruct's drop at consumption; it selects against long answers, hence off
    max_token_lag: int = field(default=0, metadata={
        "help": "Drop a group with any token more than N versions old when consumed (0: never)."})
    max_prompts_per_step_factor: int = field(default=20, metadata={
        "help": "Active sampling gives up (logged) after this many x num_unique_prompts_per_step prompts."})
    # ---- LoRA (peft): the learner trains an adapter over frozen base weights; only the adapter goes to the engines
    lora_rank: int = field(default=0, metadata={
        "help": "LoRA rank (0: off, full RL). Seen in RL: 16 (prime-rl), 1 (TRL's 'LoRA without regret' RL recipe), "
                "32 (AReaL)."})
    lora_alpha: float = field(default=32.0, metadata={
        "help": "LoRA alpha; the update is scaled by alpha / rank (prime-rl and TRL's RL recipe: 32)."})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "Dropout on the adapter's input (default 0: vLLM has none; the probe runs without it)."})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "Modules that get an adapter ('all-linear': every linear layer but the LM head, as TRL, prime-rl "
                "and AReaL do)."})
    # Each engine writes the adapters it receives here, on its own node (a RAM disk: vLLM loads adapters from files)
    lora_dir: str = field(default="/dev/shm", metadata={
        "help": "Where engines keep the adapter versions they serve (removed once no request uses them)."})
    # ---- system
    num_learners: int = field(default=1, metadata={
        "help": "torchrun ranks [0, N) learn; the rest are actors (ignored with one process)."})
    batching: str = field(default="continuous", metadata={
        "help": "'continuous' (keep the engine full) or 'static' (one batch at a time; the ablation)."})
    # Off: an engine drains, then loads; learner 0 sends weights only when an engine asks for them (every prompt
    # it holds needs newer ones), when they are async_steps versions old, and before an evaluation, and then only
    # once every engine has drained (WeightClient.drain_engines)
    inflight_updates: bool = field(default=True, metadata={
        "help": "Load new weights between two engine steps without draining (Olmo 3)."})
    max_num_seqs: int = field(default=64, metadata={"help": "vLLM slots per engine (concurrent sequences)."})
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "GPU memory share per engine; one GPU: at most what the learner leaves (CPU: 1 GiB of KV cache)."})
    enforce_eager: bool = field(default=False, metadata={
        "aliases": ["--vllm_enforce_eager"], "help": "vLLM without compilation: starts faster, generates slower."})
    pack_length: int = field(default=0, metadata={
        "help": "Tokens per packed learner row (0: max_prompt_length + max_response_length)."})
    # 0: on GPU the larger of pack_length and 16384; on CPU pack_length (one row per pass was 30% faster there)
    forward_tokens: int = field(default=0, metadata={
        "help": "Padded tokens per learner forward pass (0: auto); the memory plan counts it."})
    # bf16 compute, fp32 master weights, optimizer state and gradient reduction (FSDP2 mixed precision, or
    # autocast with one learner)
    bf16: bool | None = field(default=None, metadata={
        "help": "Train in bf16 (default: on GPU yes, on CPU no; with it, CPU engines generate in bf16 too)."})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "Recompute each decoder layer's activations in backward (Olmo 3 7B think RL: on)."})
    logprob_chunk_size: int = field(default=1024, metadata={
        "help": "Tokens per chunk of the LM head + log-softmax: logits memory is chunk x vocab."})
    # Without it vLLM's engine process busy-polls its worker and starves the learner of a core
    cpu_affinity: bool = field(default=True, metadata={
        "help": "CPU only: give each rank on a node its own share of the cores."})
    # Off: on 2 cores (SmolLM2-135M, --async_steps 1) it removed the learner's waits for the last groups of a step
    # (22 s a step to 0) for 1.27x the completions/s, but 39% of the trained tokens were 2 versions old, against 14%
    # without it (Rollouts.look_ahead)
    release_ahead: bool = field(default=False, metadata={
        "help": "torchrun, inflight updates: once the engines have nothing to run while the learner trains, start "
                "now the gated prompts the coming steps will still miss (no waits; more samples older than "
                "async_steps)."})
    # Off: on 2 cores (SmolLM2-135M) the learner trained 2-8% faster with it alone, and 10-20% slower beside
    # --release_ahead, whose released prompts wake the engine while the learner still computes on its core (IdleCores)
    lend_idle_cores: bool = field(default=False, metadata={
        "help": "CPU, pinned, one learner: it also computes on an actor's cores while that engine has nothing to run."})
    # On a node, torchrun --nproc-per-node = its learners + its engines; it needs learners + engines x this GPUs
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per vLLM engine (tensor parallel)."})
    # must exceed the longest learner step, evaluation and checkpoint included
    timeout_s: float = field(default=1800.0, metadata={
        "help": "Longest wait between roles (data, weights) before failing with an error."})
    startup_timeout_s: float = field(default=1800.0, metadata={
        "help": "Longest wait for the actors' engines to start."})
    probe_tolerance: float = field(default=0.0, metadata={
        "help": "Max mean |learner - engine| probe logprob diff after an update (0: 2e-3 fp32, 5e-2 bf16, 0.15 bf16 "
                "on CPU)."})
    verifier_workers: int = field(default=2, metadata={"help": "Verifier processes."})
    max_infra_failure_rate: float = field(default=0.25, metadata={
        "help": "Stop when verifier infrastructure failures exceed this share of samples 3 steps in a row."})
    verifier_timeout: float = field(default=10.0, metadata={"help": "Seconds per verifier row."})
    # Off: code / code_stdio rows are refused and counted where no sandbox is available (no user namespaces)
    allow_unsandboxed_code: bool = field(default=False, metadata={
        "help": "Run model-written code unisolated, as this user, where no sandbox is available."})
    # Pass the same value to runs you compare
    peak_flops: float = field(default=0.0, metadata={
        "help": "Peak FLOP/s per engine for MFU (0: datasheet on known GPUs, else measured)."})
    peak_memory_bandwidth: float = field(default=0.0, metadata={
        "help": "Peak memory B/s per engine for MBU (0: datasheet or measured)."})
    # BENCHMARK ONLY (bench_infra.sh): long-tailed lengths (the paper's mean / max ~0.46) even from a random model
    response_length_sampler: str = field(default="none", metadata={
        "help": "Benchmark only: 'exponential' draws each request's max_tokens and ignores eos."})
    response_length_mean: int = field(default=0, metadata={"help": "Benchmark only: that exponential's mean."})
    # BENCHMARK ONLY (bench_infra.sh tools_inflight): with the sampler above, each request's drawn length is cut
    # into bench_tool_turns + 1 turns with a tool call of this latency between two, through the tool episodes'
    # own machinery (a random model calls no tool by itself)
    bench_tool_latency_s: float = field(default=0.0, metadata={
        "help": "Benchmark only: seconds of a tool call between two turns of every request (0: no tool)."})
    bench_tool_turns: int = field(default=2, metadata={"help": "Benchmark only: tool calls per request."})



# -------------------------------------------------------------------------------------------------
# ONE STEP: its data path, in order (the learner's loop calls this; each name is defined below)
# -------------------------------------------------------------------------------------------------
def one_step(args: Args, layout: "Layout", policy: "Policy", rollouts: "Rollouts | None", transfer, probe_ids,
             version: int, evaluates: bool) -> dict:
    """Every learner runs it; learner 0 alone holds the rollouts. The actors' finished groups -> verifiers.py
    rewards -> the zero-std filter and active sampling (Rollouts.next_batch) -> advantages, packed rows dealt to
    the learners (plan_step) -> loss, backward, clip, optimizer step on each learner's share (train_on) -> the new
    weights to every engine, when this step sends them (stream_now, sync_weights)."""
    out, plan = {}, None
    if layout.is_main:
        t = time.perf_counter()
        out["batch"], out["counts"], out["scored"] = rollouts.next_batch(version)
        out["data_wait"], out["actor_stats"] = time.perf_counter() - t, rollouts.take_stats()
        rollouts.check_infra(out["counts"])
        plan = plan_step(out["batch"], args, policy, layout.num_learners)
    if layout.num_learners > 1:
        plan = broadcast_list(plan, layout.groups["learners"], args.timeout_s)
    t, pad_id = time.perf_counter(), policy.tokenizer.pad_token_id or 0
    minibatches = [([collate_forward(forward, pad_id) for forward in shares[layout.rank]], num_tokens)
                   for shares, num_tokens in plan]
    look_ahead = None
    if rollouts is not None and args.release_ahead and loads_inflight(args):
        look_ahead = functools.partial(rollouts.look_ahead, version, transfer.client.streamed)
    out["agg"], out["grad_norms"], out["learner_tokens"] = train_on(policy, minibatches, args, layout.num_learners,
                                                                    look_ahead)
    out["train_time"] = time.perf_counter() - t
    out["streams"] = stream_now(args, layout, transfer.client, version + 1, evaluates)
    out["sync"] = (sync_weights(args, policy, layout, transfer, probe_ids, version + 1, full=True) if out["streams"]
                   else {"sync": 0.0})
    return out


# -------------------------------------------------------------------------------------------------
# ALGORITHM (Olmo 3 sec 4.4): advantages, the zero-std filter, active sampling, the admission gate, the loss
# -------------------------------------------------------------------------------------------------
def compute_advantages(rewards: list[list[float]], normalization: str = "centered") -> list[list[float]]:
    """ALGORITHM: GRPO advantages per group: reward - group mean (Olmo 3: `centered`), or also divided
    by the group's std (`standard`, the GRPO paper; eps 1e-6 keeps zero-std groups at 0)."""
    out = []
    for group in rewards:
        r = torch.tensor(group, dtype=torch.float64)
        a = r - r.mean()
        if normalization == "standard":
            a = a / (r.std(unbiased=False) + 1e-6)
        elif normalization != "centered":
            raise ValueError(f"unknown advantage_normalization {normalization!r}")
        out.append(a.tolist())
    return out


def filter_reason(rewards: list[float]) -> str | None:
    """Why a group carries no gradient (None: it does). Zero reward std => zero advantages."""
    if len(rewards) < 2:
        return "too_few_samples"
    if max(rewards) - min(rewards) > 1e-8:
        return None
    if rewards[0] >= 1.0:
        return "all_solved"
    return "all_failed" if rewards[0] <= 0.0 else "zero_std"


def active_sampling(pull, num_groups: int, max_prompts: int, consumed=None) -> tuple[list, list, Counter]:
    """ALGORITHM: Olmo 3 sec 4.4 active sampling. Pull scored groups (`pull()` -> list of dicts with
    `rewards`) and keep those with non-zero reward std until exactly `num_groups` are kept. Groups
    pulled beyond that are returned as leftovers for the next step. Gives up after `max_prompts`
    prompts (counted as `capped`) so a run where nearly everything is filtered does not spin forever.
    The one count of what a step takes: after each pull, `consumed(taken, still_missing)` hears how many of its
    groups this step took (kept or filtered, not the leftovers) and how many kept groups it still misses."""
    kept, leftover, counts = [], [], Counter()
    while len(kept) < num_groups:
        if counts["prompts"] >= max_prompts:
            counts["capped"] += 1
            break
        before = counts["prompts"]
        for g in pull():
            if len(kept) == num_groups:
                leftover.append(g)
                continue
            counts["prompts"] += 1
            reason = filter_reason(g["rewards"])
            if reason is None:
                kept.append(g)
            else:
                counts[reason] += 1
        if consumed is not None:
            consumed(counts["prompts"] - before, num_groups - len(kept))
    return kept, leftover, counts


def offpolicy_filter(groups: list[dict], learner_version: int, max_token_lag: int = 0
                     ) -> tuple[list[dict], Counter, list[int], list[int]]:
    """ALGORITHM: the token-lag record, and the optional drop (`--max_token_lag`). Returns (kept groups, drop
    counts, every token's lag, each sample's first-token lag). With max_token_lag 0 nothing is dropped:
    the off-policy bound applies at admission (`admission_version`), and truncated importance sampling
    corrects for samples that span several versions (PipelineRL; open-instruct grpo_fast)."""
    kept, counts, lags, first_lags = [], Counter(), [], []
    for g in groups:
        versions = [v for s in g["samples"] for v in s["versions"]]
        lags.extend(learner_version - v for v in versions)
        first_lags.extend(learner_version - s["versions"][0] for s in g["samples"] if s["versions"])
        if max_token_lag > 0 and versions and learner_version - min(versions) > max_token_lag:
            counts["groups_dropped_stale"] += 1
            counts["samples_dropped_stale"] += len(g["samples"])
        else:
            kept.append(g)
    return kept, counts, lags, first_lags


def admission_version(index: int, version: int, consumed: int, need: int, per_step: int, async_steps: int,
                      useful_rate: float = 1.0) -> int:
    """ALGORITHM: the policy version a training prompt must wait for before an engine may start it.
    The learner trains version `version`'s step, has consumed the prompts below `consumed` and still
    misses `need` groups with gradient for this step (so it takes at least `need` more prompts);
    every later step needs per_step of them, and about `useful_rate` of the prompts it consumes
    yield one (active sampling filters the rest). So prompts below consumed + need + async_steps x
    per_step / useful_rate are due by step version + async_steps: the current weights are recent
    enough. Anything beyond is for a later step and waits for version + 1. (Without the gate,
    prompts refilled while step t pulls, meant for step t+2, start at once under policy t and reach
    the learner older than the off-policy bound.)"""
    return version if index < consumed + need + math.ceil(async_steps * per_step / useful_rate) else version + 1


def prefetch_window(per_step: int, async_steps: int, useful_rate: float = 1.0) -> int:
    """Training prompts to keep in flight: enough for this step and the next async_steps ones, at the
    observed fraction of prompts that yield a group with gradient."""
    return math.ceil(per_step * (async_steps + 1) / useful_rate)


def admissible(prompt: dict, version: int | None, release: int) -> bool:
    """ALGORITHM: may an engine at `version` start this prompt now? Eval prompts (no min_version)
    always; training prompts once the engine's weights reach their min_version, or once the learner
    needs them now: index < `release` (it consumed up to there and still misses groups for this
    step, e.g. when active sampling filters many; this keeps the gate from ever starving it)."""
    if version is None:
        return False
    mv = prompt.get("min_version")
    return mv is None or version >= mv or prompt["index"] < release


def loads_inflight(args: Args) -> bool:
    """Inflight updates (Olmo 3 sec 4.5; continuous batching only): an engine loads new weights between any two
    steps, its running requests keeping their KV cache. Otherwise (drained updates, static batches) an engine loads
    only once nothing runs, and learner 0 sends only once every engine has drained (WeightClient.drain_engines)."""
    return args.inflight_updates and args.batching != "static"


def grpo_loss(new_logprobs, old_logprobs, sampling_logprobs, advantages, mask, clip_low: float, clip_high: float,
              tis_cap: float, ref_logprobs=None, beta: float = 0.0, num_tokens_global: float | None = None):
    """ALGORITHM: the OlmoRL policy loss. All tensors (B, T) over response tokens; `mask` 1 on trained
    tokens. Returns (loss, stats).

    - ratio = exp(new - old); clipped surrogate with clip-higher: clamp(ratio, 1 - clip_low, 1 + clip_high)
      (DAPO; Olmo 3 uses 0.2 / 0.272), per-token max of the two negative surrogates.
    - Truncated importance sampling: the tokens came from vLLM, whose logprobs differ from the
      learner's (other kernels, older weights with async/inflight updates); each token's loss is
      weighted by min(exp(old - sampling), tis_cap) (no gradient through the weight).
    - Optional KL to a frozen reference, k3 estimator exp(ref - new) - (ref - new) - 1, times beta.
    - Token-level normalization: the sum over tokens divided by `num_tokens_global`, the trained
      tokens of the whole global (mini-)batch on all learners, so every token weighs the same no
      matter which row, learner or micro-batch holds it (DAPO / Olmo 3). Default: this mask's sum.
    """
    mask = mask.to(new_logprobs.dtype)
    n = num_tokens_global if num_tokens_global is not None else mask.sum().clamp(min=1)
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    if tis_cap > 0:
        tis = torch.exp(old_logprobs - sampling_logprobs).clamp(max=tis_cap).detach()
        pg = pg * tis
    else:
        tis = torch.ones_like(pg)
    per_token = pg
    kl = torch.zeros_like(pg)
    if ref_logprobs is not None:
        d = (ref_logprobs - new_logprobs).clamp(-40.0, 40.0)  # exp(d) stays finite: a far-off token is no inf loss
        kl = torch.exp(d) - d - 1.0
        if beta:
            per_token = per_token + beta * kl
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        m = mask.sum().clamp(min=1)
        stats = {
            "pg_loss_sum": (pg * mask).sum().item(),
            "clipfrac_sum": ((pg2 > pg1).to(mask.dtype) * mask).sum().item(),
            "approx_kl_sum": (0.5 * log_ratio ** 2 * mask).sum().item(),
            "ref_kl_sum": (kl * mask).sum().item(),
            "tis_capped_sum": ((((old_logprobs - sampling_logprobs).exp() > tis_cap).to(mask.dtype) * mask).sum().item()
                               if tis_cap > 0 else 0.0),
            "tokens": m.item(),
        }
    return loss, stats



# -------------------------------------------------------------------------------------------------
# The learner's batches: packing rows, and their logprobs
# -------------------------------------------------------------------------------------------------
def pack_rows(rows: list[dict], pack_length: int) -> list[list[dict]]:
    """Pack rows (`prompt_ids` + `response_ids`) into bins of at most `pack_length` tokens,
    first-fit decreasing. Rows longer than `pack_length` get a bin of their own."""
    bins, sizes = [], []
    for row in sorted(rows, key=lambda r: -(len(r["prompt_ids"]) + len(r["response_ids"]))):
        n = len(row["prompt_ids"]) + len(row["response_ids"])
        for i, size in enumerate(sizes):
            if size + n <= pack_length:
                bins[i].append(row)
                sizes[i] += n
                break
        else:
            bins.append([row])
            sizes.append(n)
    return bins


def split_bins(bins: list[list[dict]], num_learners: int) -> list[list[list[dict]]]:
    """Deal bins to learners, largest first to the least-loaded, then pad every learner to the same
    number of bins with empty ones (FSDP2 collectives need the same number of forwards on each)."""
    shares, loads = [[] for _ in range(num_learners)], [0] * num_learners
    for b in sorted(bins, key=lambda b: -sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in b)):
        i = loads.index(min(loads))
        shares[i].append(b)
        loads[i] += sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in b)
    most = max(len(s) for s in shares)
    for s in shares:
        s.extend([[] for _ in range(most - len(s))])
    return shares


def learner_forwards(bins: list[list[dict]], num_learners: int, token_budget: int) -> list[list[list[list[dict]]]]:
    """Each learner's forward passes (each a list of bins): bins dealt by split_bins, grouped by
    forward_batches, then every learner padded to the same number of passes (FSDP2's collectives run
    once per pass on every learner) with passes of one empty bin."""
    shares = [forward_batches([b for b in share if b], token_budget) for share in split_bins(bins, num_learners)]
    most = max(1, *(len(s) for s in shares))
    return [s + [[[]] for _ in range(most - len(s))] for s in shares]


def collate_bin(rows: list[dict], pad_id: int = 0) -> dict:
    """One packed bin -> tensors over T positions, position t predicting token t + 1:
    input_ids, position_ids (restart per row: rows never attend to each other), and on
    predicting positions of response tokens: targets, mask, advantages, sampling logprobs. A tool episode's
    appended tokens (`loss_mask` 0) are context only: their positions have mask 0."""
    ids, pos, tgt, msk, adv, slp = [], [], [], [], [], []
    for r in rows:
        seq = list(r["prompt_ids"]) + list(r["response_ids"])
        p, n = len(r["prompt_ids"]), len(seq)
        ids += seq
        pos += list(range(n))
        nxt = seq[1:] + [pad_id]
        tgt += nxt
        is_resp = [1 if p - 1 <= t < n - 1 else 0 for t in range(n)]  # predicts a response token
        if r.get("loss_mask") is not None:  # position p - 1 + k predicts response token k
            is_resp[p - 1:n - 1] = r["loss_mask"]
        msk += is_resp
        adv += [r["advantage"]] * n
        lp = [0.0] * (p - 1) + list(r["sampling_logprobs"]) + [0.0]
        slp += lp
    if not rows:  # an empty pad bin: one dummy token, nothing trained
        ids, pos, tgt, msk, adv, slp = [pad_id], [0], [pad_id], [0], [0.0], [0.0]
    t = torch.tensor
    return {"input_ids": t(ids), "position_ids": t(pos), "targets": t(tgt),
            "mask": t(msk, dtype=torch.float32), "advantages": t(adv, dtype=torch.float32),
            "sampling_logprobs": t(slp, dtype=torch.float32)}


def bin_tokens(b: list[dict]) -> int:
    return sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in b)


def forward_batches(bins: list[list[dict]], token_budget: int) -> list[list[list[dict]]]:
    """Group packed bins into forward passes of at most `token_budget` padded tokens (rows x the longest
    row), longest first: a few large matmuls beat many small ones on every device. A bin longer than
    the budget gets a pass of its own."""
    batches, width = [], 0
    for b in sorted(bins, key=bin_tokens, reverse=True):
        if batches and max(width, bin_tokens(b)) * (len(batches[-1]) + 1) <= token_budget:
            batches[-1].append(b)
        else:
            batches.append([b])
            width = bin_tokens(b)
    return batches


def collate_forward(bins: list[list[dict]], pad_id: int = 0) -> dict:
    """Several packed bins -> one (B, T) batch, padded on the right: pad positions restart at 0 (a segment
    of their own, attended by nothing real) and train nothing."""
    cols = [collate_bin(b, pad_id) for b in bins]
    width = max(len(c["input_ids"]) for c in cols)
    fill = {"input_ids": pad_id, "targets": pad_id, "mask": 0.0, "advantages": 0.0, "sampling_logprobs": 0.0}
    out = {}
    for key in ("input_ids", "position_ids", "targets", "mask", "advantages", "sampling_logprobs"):
        rows = []
        for c in cols:
            pad = width - len(c[key])
            extra = torch.arange(pad) if key == "position_ids" else torch.full((pad,), fill[key], dtype=c[key].dtype)
            rows.append(torch.cat([c[key], extra.to(c[key].dtype)]))
        out[key] = torch.stack(rows)
    out["real_tokens"] = sum(bin_tokens(b) for b in bins)
    return out


def token_logprobs(model, batch: dict, temperature: float = 1.0, with_entropy: bool = False):
    """Logprobs of the targets (T,) of one packed bin, or (B, T) of a `collate_forward` batch, and their
    entropy or None. Rows attend only to themselves through their restarting position ids (see
    `target_logprobs`): no (T, T) mask is built here."""
    dev = next(model.parameters()).device
    one = batch["input_ids"].dim() == 1
    ids, pos, tgt = (batch[k][None] if one else batch[k] for k in ("input_ids", "position_ids", "targets"))
    logprobs, entropy = target_logprobs(model, ids.to(dev), pos.to(dev), tgt.to(dev), temperature, with_entropy)
    if one:
        return logprobs[0], (entropy[0] if with_entropy else None)
    return logprobs, entropy



# -------------------------------------------------------------------------------------------------
# Tool episodes: calls parsed from a sampled turn, run off the engine loop, their results appended as tokens
# -------------------------------------------------------------------------------------------------
class ToolCallError(ValueError):
    """A call that cannot run; `kind` names its counter (tools/errors_<kind>). The model gets the message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


MAX_CALLS_PER_TURN, MAX_CALL_CHARS = 8, 20_000
_LITERAL_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node):
    """A call's argument: a JSON (or Python) literal. Nothing is evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    raise ToolCallError("malformed", f"an argument is not a literal: {ast.unparse(node)[:80]}")


def parse_tool_calls(text: str) -> list[tuple[str, list, dict]] | None:
    """The calls of one sampled turn, in the syntax Olmo 3's templates print and its function-calling data
    trains: `<function_calls>name(key=value, ...)</function_calls>`, one call per line, values as JSON; a line
    may also be a JSON object {"name", "arguments"}. Returns [(name, positional, keyword)], or None when the
    turn calls nothing (it is the answer). Raises ToolCallError("malformed") for anything else."""
    start = text.find("<function_calls>")
    if start < 0:
        return None
    end = text.find("</function_calls>", start)
    if end < 0:
        raise ToolCallError("malformed", "<function_calls> without </function_calls>")
    body = text[start + len("<function_calls>"):end].strip()
    if len(body) > MAX_CALL_CHARS:
        raise ToolCallError("malformed", f"the calls are {len(body)} characters long (at most {MAX_CALL_CHARS})")
    try:
        calls = [_call(stmt) for stmt in ast.parse(body, mode="exec").body]
    except ToolCallError:
        raise
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as e:  # TypeError: {[1]: 2}
        raise ToolCallError("malformed", f"the calls do not parse: {type(e).__name__}: {str(e)[:120]}") from None
    if not calls:
        raise ToolCallError("malformed", "<function_calls> holds no call")
    if len(calls) > MAX_CALLS_PER_TURN:
        raise ToolCallError("malformed", f"{len(calls)} calls in one turn (at most {MAX_CALLS_PER_TURN})")
    return calls


def _call(stmt) -> tuple[str, list, dict]:
    node = stmt.value if isinstance(stmt, ast.Expr) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and all(
            not isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords):
        return node.func.id, [_literal(a) for a in node.args], {k.arg: _literal(k.value) for k in node.keywords}
    if isinstance(node, ast.Dict):
        obj = _literal(node)
        name, arguments = obj.get("name"), obj.get("arguments", {})
        if isinstance(name, str) and isinstance(arguments, dict):
            return name, [], arguments
    raise ToolCallError("malformed", f"not a call: {ast.unparse(stmt)[:80]}")


def load_tools(args: Args) -> dict:
    """The tool registry: the built-in `python` (the code sandbox, verifiers.python_tool) and the TOOLS dict of
    --tools_module (name -> a plain function of the call's arguments that returns text)."""
    import verifiers

    def python(code: str) -> str:
        """Runs Python code in a sandbox and returns what it printed."""
        return verifiers.python_tool(code, timeout=min(10.0, args.tool_timeout_s),
                                     max_output_chars=args.max_tool_output_chars,
                                     allow_unsandboxed_code=args.allow_unsandboxed_code)

    tools = {"python": python}
    if args.bench_tool_latency_s > 0:  # BENCHMARK ONLY: the tool of bench_infra.sh's tools_inflight
        tools["bench_sleep"] = lambda: time.sleep(args.bench_tool_latency_s) or "ok"
    if args.tools_module:
        spec = importlib.util.spec_from_file_location("grpo_tools_module", args.tools_module)
        if spec is None or not os.path.isfile(args.tools_module):
            raise ValueError(f"--tools_module {args.tools_module}: no such Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        user = getattr(module, "TOOLS", None)
        if not isinstance(user, dict) or not all(isinstance(k, str) and callable(v) for k, v in user.items()):
            raise ValueError(f"--tools_module {args.tools_module}: it must define TOOLS, a dict of name -> function")
        tools.update(user)
    return tools


class ToolRunner:
    """Runs each turn's calls off the engine loop, every call in a daemon thread of its own, so other requests
    keep decoding while a tool runs. A call that raises, times out, names an unknown tool or does not fit the
    function's signature is answered with an error text, counted by kind, and never ends the run; a call still
    running at its deadline is abandoned (a daemon thread: it cannot hold up the exit)."""

    def __init__(self, tools: dict, timeout_s: float, max_output_chars: int):
        self.tools, self.timeout_s, self.max_chars = tools, timeout_s, max_output_chars
        self.turns, self.lock = {}, threading.Lock()  # key -> {"results", "kinds", "t0"}

    def submit(self, key: str, calls: list, offered: list[str] | None = None) -> None:
        """`calls`: parse_tool_calls' list, or a ToolCallError (the turn's calls did not parse). `offered`: the
        tools the row offers (None: every registered one); a call to any other is an unknown tool."""
        offered = sorted(self.tools if offered is None else set(offered) & set(self.tools))
        calls = calls if isinstance(calls, list) else [calls]
        turn = {"results": [None] * len(calls), "kinds": [None] * len(calls), "t0": time.monotonic()}
        with self.lock:
            self.turns[key] = turn
        for i, call in enumerate(calls):
            try:
                if isinstance(call, ToolCallError):
                    raise call
                name, pos, kw = call
                if name not in offered:
                    raise ToolCallError("unknown_tool", f"no tool named {name!r} (tools: {', '.join(offered)})")
                try:
                    inspect.signature(self.tools[name]).bind(*pos, **kw)
                except TypeError as e:
                    raise ToolCallError("bad_arguments", f"{name}: {e}") from None
                except ValueError:  # a builtin without a signature: let the call say
                    pass
            except ToolCallError as e:
                self._answer(turn, i, f"error: {e}", e.kind)
                continue
            threading.Thread(target=self._run, args=(turn, i, self.tools[name], pos, kw), daemon=True,
                             name=f"tool-{name}").start()

    def _run(self, turn, i, fn, pos, kw):
        try:
            out = fn(*pos, **kw)
            self._answer(turn, i, out if isinstance(out, str) else json.dumps(out, default=str), None)
        except BaseException as e:  # noqa: BLE001 - a tool's SystemExit must not end the actor either
            self._answer(turn, i, f"error: {type(e).__name__}: {e}", "exception")

    def _answer(self, turn, i, text: str, kind: str | None):
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"... [cut at {self.max_chars} characters]"
        with self.lock:
            if turn["results"][i] is None:  # a timed-out call that returns later changes nothing
                turn["results"][i], turn["kinds"][i] = text, kind

    def finished(self) -> list[tuple[str, list[str], list[str | None], float]]:
        """Turns whose calls have all answered or timed out: [(key, result texts, error kinds, seconds)]."""
        now, out = time.monotonic(), []
        with self.lock:
            for key, turn in list(self.turns.items()):
                late = now - turn["t0"] > self.timeout_s
                if late or all(r is not None for r in turn["results"]):
                    for i, r in enumerate(turn["results"]):
                        if r is None:
                            turn["results"][i] = f"error: the call timed out after {self.timeout_s:g}s"
                            turn["kinds"][i] = "timeout"
                    del self.turns[key]
                    out.append((key, turn["results"], turn["kinds"], now - turn["t0"]))
        return out


class ToolEpisodes:
    """An actor's tool episodes (rows with `tools`), one token sequence each: a finished turn's calls run off the
    engine loop (ToolRunner); their results and the next assistant header are appended as tokens (context, out of
    the loss) and the same sequence goes on as a new request."""

    def __init__(self, actor):
        import chat_template

        self.actor, self.args = actor, actor.args
        self.tokenizer = actor.llm.get_tokenizer()
        self.turns = chat_template.ToolTurns(self.tokenizer, self.args.chat_template)
        self.runner = ToolRunner(load_tools(self.args), self.args.tool_timeout_s, self.args.max_tool_output_chars)
        self.waiting = {}  # request id -> its episode state while its turn's tool calls run

    def end_turn(self, rid: str, st: dict, c):
        """A turn of a tool episode finished. Calls in it run (ToolRunner) unless the episode is out of turns or
        tokens or the call closed with eos; a turn without a call is the answer, and the episode ends."""
        actor = self.actor
        st["versions"] += actor.token_versions(c, len(st["tokens"]) - st["turn_start"], st)
        del actor.pending[rid]
        calls = None
        if c.finish_reason == "stop" and len(st["tokens"]) < self.args.max_response_length:
            text = self.tokenizer.decode(st["tokens"][st["turn_start"]:], skip_special_tokens=False)
            try:
                calls = parse_tool_calls(text)
            except ToolCallError as e:
                calls = e
            if calls is not None and st["tokens"][-1] not in self.turns.stop_token_ids:
                # A call closed by eos, not the hand-off token (the released templates train eos after a
                # conversation's final call): no template renders a turn after eos, so the episode ends here,
                # the call not run and no answer to score; counted (tools/errors_call_closed_by_eos).
                actor.stats["tool_errors_call_closed_by_eos"] += 1
                st["turn_start"] = len(st["tokens"])
                return actor.finish_sample(st, "call_closed_by_eos", st["versions"])
        meta = actor.groups[st["group"]]["meta"]
        if calls is None and c.finish_reason == "length" and st["turns"] < meta.get("bench_turns", 0) \
                and len(st["tokens"]) < self.args.max_response_length:
            calls = [("bench_sleep", [], {})]  # BENCHMARK ONLY (Dispatcher.prompt)
        if calls is None:
            return actor.finish_sample(st, c.finish_reason, st["versions"])
        if st["turns"] >= self.args.max_tool_turns:  # the last turn is a call, not an answer: nothing to score
            actor.stats["tool_turn_limit"] += 1
            st["turn_start"] = len(st["tokens"])
            return actor.finish_sample(st, "tool_turn_limit", st["versions"])
        st["turns"] += 1
        self.waiting[st["rid"]] = st
        self.runner.submit(st["rid"], calls, meta["tools"])

    def continue_episodes(self):
        """Episodes whose tool calls answered: append the results and the next assistant header as the template
        renders them (ToolTurns: context, out of the loss), then continue the same token sequence as a new
        request. Its prefix KV is reused from the prefix cache under the episode's first salt."""
        actor, stats = self.actor, self.actor.stats
        for key, results, kinds, seconds in self.runner.finished():
            st = self.waiting.pop(key)
            st["calls"] += len(results)
            stats["tool_calls"] += len(results)
            stats["tool_s"] += seconds
            for kind in filter(None, kinds):
                stats[f"tool_errors_{kind}"] += 1
            ids = self.turns.results_ids(results)
            left = self.args.max_response_length - len(st["tokens"])
            fit = ids[:left]
            st["tokens"] += fit
            st["logprobs"] += [0.0] * len(fit)
            st["mask"] += [0] * len(fit)
            stats["appended_tokens"] += len(fit)
            if len(ids) >= left:  # no token left to sample: the episode ends truncated
                actor.finish_sample(st, "length", st["versions"])
                continue
            meta = actor.groups[st["group"]]["meta"]
            st["turn_start"] = len(st["tokens"])
            st["prompt_len"] = len(meta["prompt_ids"]) + st["turn_start"]
            rid = f"{st['rid']}-turn{st['turns']}"
            actor.pending[rid] = st
            actor.add_request(rid, list(meta["prompt_ids"]) + st["tokens"], st["salt"],
                              actor._sampling_params(meta, st["j"], max_tokens=left - len(ids)), st["adapter"])


# -------------------------------------------------------------------------------------------------
# The actor: one vLLM engine kept full (continuous batching), weights loaded between two steps (inflight updates)
# -------------------------------------------------------------------------------------------------
class Actor:
    """Owns one engine. Inputs: `inbox` (prompt messages from learner 0), `updates` (weight updates: the
    version, the learner's logprobs of a probe sequence, and vLLM's update_info when weights stream into the
    engine's workers; EngineWeights makes their calls). Output: `emit(message)` for finished groups and errors.
    `run()` is the engine loop; in the colocated mode it runs in a thread."""

    def __init__(self, args: Args, model_path: str, actor_id: int, emit, device: str, num_actors: int = 1,
                 memory_share: float | None = None):
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        self.args, self.actor_id, self.emit = args, actor_id, emit
        self.inbox, self.updates = queue.Queue(), queue.Queue()
        self.stop = threading.Event()
        # bf16 on GPU; on CPU as the learner trains (--bf16: avx512_bf16 decodes about 1.7x faster than fp32)
        self.dtype = torch.bfloat16 if device != "cpu" or args.bf16 else torch.float32
        self.engine_on_cpu = device == "cpu"
        saved = {k: os.environ.pop(k) for k in TORCHRUN_VARS if k in os.environ}
        try:  # vLLM starts its own torch.distributed in its engine process: hide torchrun's variables
            # On CPU, vLLM without a KV-cache size reserves 92% of the NUMA node's free memory and refuses to
            # start when the page cache holds more than 8% of it: 1 GiB, unless VLLM_CPU_KVCACHE_SPACE says.
            kwargs = ({"kv_cache_memory_bytes": 1 << 30} if device == "cpu" else
                      {"gpu_memory_utilization": memory_share or args.vllm_gpu_memory_utilization})
            if args.lora_rank:
                kwargs.update(engine_lora_options(args, model_path))
            self.llm = LLM(model=model_path, dtype=self.dtype, seed=args.seed + actor_id,
                           enforce_eager=args.enforce_eager,
                           max_model_len=args.max_prompt_length + args.max_response_length,
                           max_num_seqs=args.max_num_seqs,
                           enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                           tensor_parallel_size=args.vllm_tensor_parallel_size,
                           worker_extension_cls="grpo.WorkerExtension",
                           weight_transfer_config=WeightTransferConfig(backend=weight_backend(device)), **kwargs)
        finally:
            os.environ.update(saved)
        self.engine = self.llm.llm_engine
        self.llm.collective_rpc("grpo_watch_owner", args=(os.getpid(),))
        self.version = None  # the learner version the engine's weights come from
        self.adapter = None  # --lora_rank: the LoRARequest of `version`'s adapter, which new requests start on
        self.meter = EngineMeter(self.engine.model_config.hf_config, self.dtype, args.max_num_seqs,
                                 device if device == "cpu" else "cuda")
        self.stats = self.meter.stats  # this engine's counts since the last group it emitted
        self.weights = EngineWeights(self)
        self.tools = None  # ToolEpisodes, set up by the first prompt that offers tools
        self.pending = {}  # request id -> {"group": group id, "tokens", "logprobs", "prompt_len"}
        self.groups = {}  # group id -> {"meta", "samples", "left"}
        self.waiting = []  # prompt messages received but not yet admitted
        self.release = -1  # training prompts with a smaller index are needed now: no version gate
        self.static_batch = math.ceil(args.num_unique_prompts_per_step / num_actors)  # prompts per static batch
        self.busy_since = None  # when the call into the engine now running began (None: none runs)
        self.on_idle = None  # torchrun: told True once the engine sat idle a moment, False when it runs again
        self.idle_from, self.said_idle = None, False

    @property
    def in_tools(self) -> dict:
        """Tool episodes whose turn's calls are running (request id -> episode state)."""
        return self.tools.waiting if self.tools else {}

    def take_stats(self) -> dict:
        return self.meter.take(self.actor_id)

    # -- requests -------------------------------------------------------------------------------
    def _sampling_params(self, prompt: dict, j: int, max_tokens: int | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # a benchmark's prompts carry each sample's length (Dispatcher.prompt); training's never do
        if max_tokens is None:
            max_tokens = prompt["max_tokens"][j] if "max_tokens" in prompt else self.args.max_response_length
        if "bench_turns" in prompt:  # BENCHMARK ONLY: a turn's share of the drawn length
            max_tokens = min(max_tokens, math.ceil(prompt["max_tokens"][j] / (prompt["bench_turns"] + 1)))
        # a tool episode's turn also stops at the template's closing token of a turn that calls tools
        stop = self.tools.turns.stop_token_ids if prompt.get("tools") and not prompt.get("ignore_eos") else None
        return SamplingParams(temperature=self.args.temperature, max_tokens=max_tokens,
                              ignore_eos=prompt.get("ignore_eos", False), logprobs=0, stop_token_ids=stop,
                              output_kind=RequestOutputKind.DELTA)

    def add_request(self, rid: str, token_ids: list[int], cache_salt: str, params, adapter=None):
        """A request of token ids, through vLLM 0.32's supported input path: the prompt rendered by its Renderer
        (render_cmpl) and the result handed to add_request (raw prompts there are deprecated). With LoRA, on
        `adapter` (default: the newest one's), which it keeps to its end (EngineWeights.load_adapter)."""
        from vllm import TokensPrompt

        (engine_input,) = self.llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=token_ids,
                                                                      cache_salt=cache_salt)])
        self.engine.add_request(rid, engine_input, params, lora_request=adapter or self.adapter)

    def _admit(self, prompt: dict):
        gid = f"{prompt['kind']}-{prompt['index']}"
        self.groups[gid] = {"meta": prompt, "samples": [None] * prompt["n"], "left": prompt["n"],
                            "t0": time.perf_counter()}
        if prompt.get("tools") and self.tools is None:
            self.tools = ToolEpisodes(self)
        # Salted by policy version: a request reuses only prompt KV computed by the weights it starts on,
        # never an old policy's (the shared template header would otherwise stay cached all run).
        salt = f"policy-{self.version}"
        for j in range(prompt["n"]):
            rid = f"{gid}-{j}"
            self.pending[rid] = {"group": gid, "j": j, "tokens": [], "logprobs": [],
                                 "prompt_len": len(prompt["prompt_ids"]), "turn_start": 0,
                                 "version": self.version, "adapter": self.adapter}
            if prompt.get("tools"):  # a tool episode: what ToolEpisodes needs
                self.pending[rid].update(rid=rid, salt=salt, mask=[], versions=[], turns=0, calls=0)
            self.add_request(rid, prompt["prompt_ids"], salt, self._sampling_params(prompt, j))

    def _process(self, outs):
        """Append each request's new tokens (DELTA outputs) and emit groups as soon as they finish."""
        decode_ctx, prefill, steps = [], [], 1
        for out in outs:
            if self.weights.probe and out.request_id == self.weights.probe[0]:
                if out.finished:
                    self.weights.check_probe(out)
                continue
            st = self.pending.get(out.request_id)
            if st is None:
                continue
            c = out.outputs[0]
            g0, k = len(st["tokens"]) - st["turn_start"], len(c.token_ids)
            steps = max(steps, k)
            if g0 == 0 and k:  # prompt tokens found in the prefix cache cost no prefill compute
                prefill.append((st["prompt_len"], out.num_cached_tokens or 0))
            decode_ctx += [st["prompt_len"] + j for j in range(max(g0, 1), g0 + k)]
            st["tokens"] += c.token_ids
            st["logprobs"] += [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
            if "mask" in st:
                st["mask"] += [1] * k
                self.stats["sampled_tokens"] += k
            if out.finished and "mask" in st:
                self.tools.end_turn(out.request_id, st, c)
            elif out.finished:
                del self.pending[out.request_id]
                self.finish_sample(st, c.finish_reason, self.token_versions(c, len(st["tokens"]), st))
        self.meter.engine_steps(prefill, decode_ctx, steps)
        if len(self.weights.adapters) > 1:
            self.weights.remove_unused_adapters()

    def token_versions(self, c, n: int, st: dict) -> list[int]:
        """The policy version of each of a request's n tokens: vLLM labels token spans with set_weight_version().
        LoRA: the version of the adapter the request (the episode) started on, which it keeps to its end."""
        if self.args.lora_rank:
            return [st["version"]] * n
        versions = [self.version] * n
        for span in c.weight_versions or []:
            for i in range(span.start, min(span.end, n)):
                versions[i] = int(span.version) if span.version.lstrip("-").isdigit() else self.version
        return versions

    def finish_sample(self, st: dict, finish_reason: str, versions: list[int]):
        n = len(st["tokens"])
        if self.args.batching == "static":
            self.meter.static_lens.append(n)
        g = self.groups[st["group"]]
        sample = {"response_ids": st["tokens"], "sampling_logprobs": st["logprobs"],
                  "versions": versions, "finish_reason": finish_reason,
                  "truncated": finish_reason == "length" and n >= self.args.max_response_length}
        if "mask" in st:  # a tool episode: versions are the sampled tokens'; the verifier reads the last turn only
            sample.update(loss_mask=st["mask"], answer_start=st["turn_start"], tool_calls=st["calls"],
                          tool_turns=st["turns"])
            self.stats["episodes"] += 1
        g["samples"][st["j"]] = sample
        g["left"] -= 1
        if g["left"] == 0:
            del self.groups[st["group"]]
            self.emit({"group": dict(g["meta"], samples=g["samples"], gen_time=time.perf_counter() - g["t0"]),
                       "stats": self.take_stats()})

    # -- the engine loop ------------------------------------------------------------------------
    def run(self):
        # The peaks of the cores (or GPUs) the engine computes on, measured by its workers with their threads: not by
        # this process, whose threads and cores are not the engine's (an actor rank's thread count is its launcher's
        # OMP_NUM_THREADS; the colocated actor thread runs on the learner's core). Measured in this process, the same
        # first step on SmolLM2-135M, one engine core either way, logged MFU 0.73 colocated, 0.37 under torchrun: 0.37
        # at 172 tokens/s (>= 2 x 134.5M FLOPs each) means a peak of >= 125 GFLOP/s, more than the one core the
        # engine had (97 GFLOP/s fp32 here): a peak of both cores.
        self.meter.start(self.args.peak_flops, self.args.peak_memory_bandwidth,
                         lambda: engine_peaks(self.llm.collective_rpc("grpo_measure_peaks")))
        while not self.stop.is_set():
            self._take_prompts()
            if self.in_tools:
                self.tools.continue_episodes()
            if self.weights.between_steps() and self.version is not None:  # no update waits: admit
                startable_left = self._admit_ready()
                if not loads_inflight(self.args) and self.waiting and not startable_left and self.drained():
                    self.weights.ask()
            self._step_engine()

    def _take_prompts(self):
        """Prompts that arrived (the prefetch thread / learner keeps this topped up), and release indices."""
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg is None:
                self.stop.set()
                return
            for m in msg:
                if "release" in m:
                    self.release = max(self.release, m["release"])
                else:
                    self.waiting.append(m)

    def drained(self) -> bool:
        """Nothing runs: no request in the engine, no tool episode waiting on its calls."""
        return not (self.pending or self.in_tools)

    def _admit_ready(self):
        """Start the waiting prompts the version gate lets through (generation never runs more than
        async_steps policies ahead of the step that consumes it: admission_version). Continuous batching
        (Olmo 3 sec 4.4) keeps max_num_seqs plus one group of slack queued in vLLM; static batching admits a
        whole batch only when the previous one has finished (what llm.generate does). Returns how many
        prompts the gate would let through are left waiting (no room for them now)."""
        ok = [p for p in self.waiting if admissible(p, self.version, self.release)]
        static, n = self.args.batching == "static", self.args.num_samples_per_prompt
        if static:
            batch = ok[:self.static_batch] if self.drained() else []
        else:
            batch = ok[:math.ceil(max(0, self.args.max_num_seqs + n - len(self.pending)) / n)]
        if not batch:
            return len(ok)
        for p in batch:
            self._admit(p)
        taken = {id(p) for p in batch}
        self.waiting = [p for p in self.waiting if id(p) not in taken]
        if static:
            self.stats["static_batches"] += 1
        return len(ok) - len(batch)

    def _step_engine(self):
        """One engine step (or a short sleep when nothing runs), timed for the meter."""
        t, tools_running = time.perf_counter(), bool(self.in_tools)
        if not self.engine.has_unfinished_requests():
            self._say_idle(not tools_running)
            time.sleep(0.005)
            return self.meter.idle(time.perf_counter() - t, tools_running)
        self._say_idle(False)
        running = min(len(self.pending) + (self.weights.probe is not None), self.args.max_num_seqs)
        self.busy_since = time.monotonic()
        outs = self.engine.step()
        self.busy_since = None
        self._process(outs)
        self.meter.busy(time.perf_counter() - t, running, tools_running, batch_done=self.drained())

    def _say_idle(self, idle: bool):
        """Tell learner 0 once the engine has had nothing to run for 0.2 s (it waits on the off-policy bound), and
        again as soon as it runs (Rollouts.look_ahead, IdleCores)."""
        if self.on_idle is None:
            return
        if not idle:
            self.idle_from = None
            if self.said_idle:
                self.said_idle = False
                self.on_idle(False)
        elif self.idle_from is None:
            self.idle_from = time.monotonic()
        elif not self.said_idle and time.monotonic() - self.idle_from >= 0.2:
            self.said_idle = True
            self.on_idle(True)

    def shutdown(self):
        self.stop.set()
        with contextlib.suppress(Exception):
            self.engine.engine_core.shutdown()
        remove_adapter_roots()


def kill_stalled_engine(rank: int, actor_id: int, busy: float, timeout_s: float) -> str:
    """Say which engine stopped answering, and kill its processes (a stopped one ignores anything gentler, and its
    own owner watch cannot run): they must not outlive this actor rank."""
    import psutil  # a vLLM dependency

    engine = [p.pid for p in psutil.Process().children(recursive=True)]
    for pid in engine:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return (f"actor rank {rank} (actor {actor_id}): its vLLM engine (processes {engine}, now killed) did not finish "
            f"a call in {busy:.0f}s (--timeout_s {timeout_s:.0f}): stopped, hung or starved")


def run_actor_rank(args: Args, rank: int, learner0: int, groups: dict, device: str, model_path: str,
                   cores: list[int] | None = None, gpus: str | None = None):
    """An actor rank: threads move prompts in, groups out, and learner 0's weight-transfer calls in over gloo (the
    weights themselves go from learner 0 straight into the engine's workers); the main thread runs the engine loop.
    Any failure is sent to learner 0 and the process exits non-zero."""
    print(f"[actor rank {rank}] pid {os.getpid()}: starting vLLM" + (f" on GPUs {gpus}" if gpus else ""), flush=True)
    if gpus:  # the engine's workers (vLLM's processes, one per GPU) see only this engine's GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    outbox = queue.Queue()
    num_learners = min(args.num_learners, dist.get_world_size() - 1)
    actor = Actor(args, model_path, rank - num_learners, outbox.put, device, dist.get_world_size() - num_learners)
    if cores:  # the engine is up: from now on it shares only this rank's cores (see pin_cpu_cores)
        pin_process_tree(cores)
    # Learner 0 hears when the engine has nothing to run: it releases gated prompts the next step will miss
    # (Rollouts.look_ahead), and on CPU computes on this rank's cores meanwhile (IdleCores)
    lent, host = (cores if args.lend_idle_cores else None), socket.gethostname()
    if args.release_ahead or args.lend_idle_cores:
        actor.on_idle = lambda idle: outbox.put({"idle": idle, "rank": rank, "cores": lent, "host": host})
    # The engine is up: say so, then join learner 0's weight stream with its first call. Learner 0 opens the
    # stream's rendezvous only once every engine said so (WeightClient.wait_for_engines), so no engine's start time
    # counts against vLLM's fixed store limit.
    send_obj({"ready": rank}, learner0, groups["data"], args.startup_timeout_s)
    if not args.lora_rank:  # LoRA: adapters travel as files vLLM loads (EngineWeights.load_adapter), no stream
        actor.weights.join(broadcast_obj(None, learner0, groups["weights"], args.startup_timeout_s)["init_info"])
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except Exception as e:
                if not actor.stop.is_set():
                    errors.append(e)
                    actor.stop.set()
        return threading.Thread(target=run, daemon=True)

    def prompts_in():
        while not actor.stop.is_set():
            msg = recv_obj(learner0, groups["prompts"], args.timeout_s)
            actor.inbox.put(msg)
            if msg is None:
                return

    def groups_out():
        while True:
            msg = outbox.get()
            if msg is None:
                return
            send_obj(msg, learner0, groups["data"], args.timeout_s)

    def weights_in():  # the updates' calls only: the engine loop makes them, and its workers receive the weights
        while not actor.stop.is_set():
            msg = broadcast_obj(None, learner0, groups["weights"], args.timeout_s)
            if msg.get("stop"):
                return
            actor.updates.put(msg)

    def watchdog():
        """The engine loop blocks inside vLLM while the engine process does not answer, and nothing else
        would ever end it: after --timeout_s in one engine call, or 5 s after a link thread failed while
        one runs (learner 0 is gone), report it to learner 0 and exit."""
        while True:
            time.sleep(1.0)
            since = actor.busy_since
            busy = time.monotonic() - since if since is not None else 0.0
            if busy > args.timeout_s or (errors and busy > 5.0):
                what = kill_stalled_engine(rank, actor.actor_id, busy, args.timeout_s) + (
                    f"; and {errors[0]}" if errors else "")
                print(f"[actor rank {rank}] FATAL: {what}", file=sys.stderr, flush=True)
                remove_adapter_roots()
                if threads[1].is_alive():  # the data thread owns the link to learner 0: it sends the error
                    outbox.put({"error": what})
                    outbox.put(None)
                    threads[1].join(timeout=10.0)
                os._exit(1)

    threads = [guarded(prompts_in), guarded(groups_out), guarded(weights_in),
               threading.Thread(target=watchdog, daemon=True)]
    for th in threads:
        th.start()
    try:
        actor.run()
    except KeyboardInterrupt as e:  # torchrun stops this rank (learner 0 failed), maybe mid engine call
        since = actor.busy_since
        if since is not None and time.monotonic() - since > 5.0:
            why = kill_stalled_engine(rank, actor.actor_id, time.monotonic() - since, args.timeout_s)
            print(f"[actor rank {rank}] FATAL: interrupted ({e}); {why}", file=sys.stderr, flush=True)
        raise
    except Exception as e:
        errors.append(e)
    if errors:
        msg = "".join(traceback.format_exception(errors[0]))
        print(f"[actor rank {rank}] FATAL: {msg}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            send_obj({"error": f"actor rank {rank}: {errors[0]}"}, learner0, groups["data"], 10.0)
        actor.shutdown()
        os._exit(1)
    outbox.put({"done": rank, "stats": actor.take_stats()})  # what the last groups did not carry (the last loads)
    outbox.put(None)
    threads[1].join(timeout=10.0)
    actor.shutdown()


def start_colocated_actor(args: Args, model_path: str, emit, device: str, memory_share: float | None) -> "Actor":
    """`python grpo.py`: the actor in a thread of the learner's process, its vLLM engine in processes of
    its own. On CPU (--cpu_affinity) the learner and the engine each get half of the cores, as torchrun
    ranks do: unpinned, the engine's busy-polling processes took CPU from the learner (its step ran
    1.6x slower than in the two-process run). Threads are set before vLLM starts: it then makes
    torch.set_num_threads a no-op in this process."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    mine, engine = split_cores(cores, 0, 2), split_cores(cores, 1, 2)
    pin = device == "cpu" and args.cpu_affinity and mine and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if pin:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(engine, args.vllm_tensor_parallel_size)
        torch.set_num_threads(len(mine))
    actor = Actor(args, model_path, 0, emit, device, 1, memory_share)
    if pin:
        import psutil

        me = psutil.Process()
        pin_threads([me], mine)  # the learner and the actor thread
        pin_threads(me.children(recursive=True), engine)  # vLLM's engine core and worker
        print(f"[grpo] colocated: learner on CPU cores {mine}, vLLM engine on {engine}", flush=True)
    return actor



# -------------------------------------------------------------------------------------------------
# Learner 0's side: the link to the actors and the prompt dispatcher
# -------------------------------------------------------------------------------------------------
class Link:
    """Learner 0's view of the actors: `send_prompts(actor, list)`, a `results` queue of messages (groups, errors),
    and what the actors said about their engines (up, drained, wanting weights: read by WeightClient). Colocated:
    queues. torchrun: gloo groups, one per kind of traffic (prompts, data, weights)."""

    def __init__(self, args: Args, actor_ranks: list[int], groups: dict | None, local_actor: Actor | None,
                 results: queue.Queue | None = None):
        self.args, self.actor_ranks, self.groups, self.local = args, actor_ranks, groups, local_actor
        # colocated: the queue the actor thread already emits into
        self.results = results if results is not None else queue.Queue()
        self.heard = {r: time.time() for r in actor_ranks}  # when each actor rank last sent anything
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.error = None  # the first error an actor reported (stops a weight stream waiting on it)
        self.wants = {}  # actor rank -> the version whose successor it asked for (drained updates)
        self.ready = set()  # actor ranks whose engine is up
        self.drained = {}  # actor rank -> the last version it drained for (drained updates)
        self.idle = {}  # actor rank -> the number of idle messages heard when it said so, while its engine is idle
        self.idle_said = 0
        self.idle_cores = {}  # actor rank -> its cores on this machine, while its engine sits idle (IdleCores)
        if local_actor is None:
            for r in actor_ranks:
                threading.Thread(target=self._receive, args=(r,), daemon=True).start()

    def _receive(self, rank: int):
        wait = self.args.startup_timeout_s  # the first message comes once the actor's engine is up
        try:
            while True:
                msg = recv_obj(rank, self.groups["data"], wait)
                self.heard[rank] = time.time()
                wait = self.args.timeout_s
                if "want_weights" in msg:
                    self.wants[rank] = msg["want_weights"]
                    continue
                if "ready" in msg:
                    self.ready.add(rank)
                    continue
                if "drained" in msg:
                    self.drained[rank] = msg["drained"]
                    continue
                if "idle" in msg:
                    self.on_idle(rank, msg)
                    continue
                self.error = self.error or msg.get("error")
                self.results.put(msg)
                if "done" in msg or "error" in msg:
                    return
        except Exception as e:
            if not self.closing.is_set():
                self.error = self.error or f"link to actor rank {rank}: {e}"
                self.results.put({"error": f"link to actor rank {rank}: {e}"})

    def on_idle(self, rank: int, msg: dict):
        """An actor's engine has nothing to run (msg["idle"]) or runs again; its cores, where it lends them."""
        if msg["idle"]:
            self.idle_said += 1
            self.idle[rank] = self.idle_said
            if msg["cores"] and msg["host"] == socket.gethostname():
                self.idle_cores[rank] = msg["cores"]
        else:
            self.idle.pop(rank, None)
            self.idle_cores.pop(rank, None)

    def wait_for_actors(self, done, timeout_s: float, what: str):
        """Wait until done() holds, at most timeout_s; an actor's error or the timeout ends the wait with an error
        naming the actors that were waited on. Polls from 1 ms up to 50 ms: a weight update's wait is often a few
        ms, and a fixed 50 ms sleep made every inflight sync cost at least that."""
        deadline, pause = time.monotonic() + timeout_s, 0.001
        while not done():
            why = self.error or (time.monotonic() > deadline and f"not in {timeout_s:.0f}s ({self.silent_actors()})")
            if why:
                raise RuntimeError(f"waiting for {what}: {why}")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def silent_actors(self) -> str:
        """Who a timeout waited on: each actor rank and how long since it last sent anything."""
        if self.local is not None:
            return "the actor thread (colocated)"
        now = time.time()
        return ", ".join(f"actor rank {r} silent for {now - self.heard[r]:.0f}s"
                         for r in sorted(self.heard, key=self.heard.get))

    def send_prompts(self, actor: int, prompts: list | None):
        if self.local is not None:
            self.local.inbox.put(prompts)
        else:
            with self.lock:  # the dispatcher thread and evaluation both send; a message is two sends
                send_obj(prompts, self.actor_ranks[actor], self.groups["prompts"], self.args.timeout_s)

    def final_stats(self, num_actors: int, timeout_s: float) -> list[dict]:
        """After close(): the stats deltas of the messages nobody consumed and of each actor's last word
        (its "done"), waiting at most timeout_s for all of them. An actor that loaded the last updates may
        have sent no group since."""
        stats, done, deadline = [], 0, time.time() + timeout_s
        while done < num_actors and time.time() < deadline:
            try:
                msg = self.results.get(timeout=max(0.0, min(1.0, deadline - time.time())))
            except queue.Empty:
                continue
            if "stats" in msg:
                stats.append(msg["stats"])
            done += "done" in msg or "error" in msg
        return stats

    def close(self):
        self.closing.set()
        for i in range(len(self.actor_ranks) or 1):
            with contextlib.suppress(Exception):
                self.send_prompts(i, None)
        if self.local is None:
            with contextlib.suppress(Exception):
                broadcast_obj({"stop": True}, 0, self.groups["weights"], 30.0)


class Dispatcher(threading.Thread):
    """Learner 0's prompt sampler and the actors' prefetch: keeps up to num_unique_prompts_per_step x
    (async_steps + 1) / (useful fraction of prompts, last step) training prompts in flight (sent, not yet
    consumed by the learner), spread over the actors, so the engines never wait on the learner for
    prompts. Each training prompt
    carries `min_version` (admission_version): the actors start it only once their weights are that
    recent, so generation never runs more than async_steps policies ahead of the step that consumes
    it. When active sampling needs more groups than the gate lets through, `consumed(n, need)` sends
    a release index with the refill: the prompts the learner needs now start at once."""

    def __init__(self, args: Args, dataset, link: Link, num_actors: int, start: int, version: int = 0):
        super().__init__(daemon=True)
        self.args, self.dataset, self.link, self.num_actors = args, dataset, link, num_actors
        self.position = start  # the sampler position (checkpointed)
        self.in_flight = 0
        self.cond = threading.Condition()
        self.error = None
        self.stop = threading.Event()
        self.sent = [0] * num_actors
        self.rate, self.rate_counts = 1.0, [0, 0]  # useful fraction of consumed prompts (last step), [useful, consumed]
        self.done = start  # prompts consumed by the learner (sampler positions below this, in total)
        # the learner's step, groups it still misses
        self.version, self.need = version, args.num_unique_prompts_per_step
        self.release, self.release_sent = -1, -1
        self.labels = {}  # training prompt index -> its min_version, for those not yet consumed (release_gated)
        self.length_rng = random.Random(args.seed)  # the benchmark's response lengths (prompt)

    def prompt(self, i: int, kind: str, row: dict, n: int, min_version: int | None = None) -> dict:
        p = {"kind": kind, "index": i, "prompt_ids": row["prompt_input_ids"], "ground_truth": row["ground_truth"],
             "verifier": row["verifier"], "n": n}
        if min_version is not None:
            p["min_version"] = min_version
        if row.get("tool_names"):  # a tool episode (ToolEpisodes)
            p["tools"] = list(row["tool_names"])
        if kind == "train" and self.args.response_length_sampler == "exponential":  # BENCHMARK ONLY (bench_infra.sh)
            mean, longest = self.args.response_length_mean, self.args.max_response_length
            p["max_tokens"] = [max(1, min(longest, int(self.length_rng.expovariate(1.0 / mean)))) for _ in range(n)]
            p["ignore_eos"] = True
            if self.args.bench_tool_latency_s > 0:  # each turn ends at its share of the length, then the tool runs
                p["tools"], p["bench_turns"] = ["bench_sleep"], self.args.bench_tool_turns
        return p

    def row(self, i: int) -> dict:
        epoch, j = divmod(i, len(self.dataset))
        perm = np.random.default_rng(self.args.seed + epoch).permutation(len(self.dataset))  # same order on resume
        return self.dataset[int(perm[j])]

    def consumed(self, n: int = 1, need: int | None = None):
        """The learner took n groups; `need`: groups it still misses for this step (None: unknown)."""
        with self.cond:
            self.in_flight -= n
            self.done += n
            self.rate_counts[1] += n
            if need is not None:
                self.rate_counts[0] += max(0, self.need - need)
                self.need = need
                if need > 0:
                    self.release = max(self.release, self.done + need)
            self.cond.notify()

    def release_gated(self, n: int):
        """Let the first n prompts the gate still holds start now (Rollouts.look_ahead): release past them, or past
        prompts not sent yet when the gate holds fewer."""
        with self.cond:
            gated = sorted(i for i, v in self.labels.items() if v > self.version and i >= max(self.release, self.done))
            release = gated[n - 1] + 1 if len(gated) >= n else max(self.position, self.release) + n - len(gated)
            if release > self.release:
                self.release = release
                self.cond.notify()

    def begin_step(self, version: int):
        """The learner starts training on `version` (its weights are on their way to the actors)."""
        with self.cond:
            self.labels = {i: v for i, v in self.labels.items() if i >= self.done}  # consumed: no longer gated
            self.version, self.need = version, self.args.num_unique_prompts_per_step
            # this step's own prompts may start on any weights the engines hold: these are at most
            # async_steps versions old (stream_now), and a gate that lets none through would stall the step
            self.release = max(self.release, self.done + self.need)
            useful, seen = self.rate_counts
            if seen:  # clamped: a step where nearly everything was filtered must not blow up the prefetch
                self.rate = min(1.0, max(0.25, useful / seen))
            self.rate_counts = [0, 0]
            self.cond.notify()

    def run(self):
        P, K = self.args.num_unique_prompts_per_step, self.args.async_steps
        try:
            while not self.stop.is_set():
                with self.cond:
                    while (self.in_flight >= prefetch_window(P, K, self.rate) and self.release <= self.release_sent
                           and not self.stop.is_set()):
                        self.cond.wait(0.5)
                    free = max(0, prefetch_window(P, K, self.rate) - self.in_flight)
                    version, done, need, release, rate = self.version, self.done, self.need, self.release, self.rate
                if self.stop.is_set():
                    return
                per_actor = defaultdict(list)
                for _ in range(free):
                    a = self.sent.index(min(self.sent))
                    mv = admission_version(self.position, version, done, need, P, K, rate)
                    with self.cond:
                        self.labels[self.position] = mv
                    per_actor[a].append(self.prompt(self.position, "train", self.row(self.position),
                                                    self.args.num_samples_per_prompt, mv))
                    self.sent[a] += 1
                    self.position += 1
                with self.cond:
                    self.in_flight += free
                if release > self.release_sent:
                    for a in range(self.num_actors):
                        per_actor[a].append({"release": release})
                    self.release_sent = release
                for a, prompts in per_actor.items():
                    self.link.send_prompts(a, prompts)
        except Exception as e:
            self.error = e



# -------------------------------------------------------------------------------------------------
# WEIGHT UPDATES: learner 0 -> every engine through vLLM's weight-transfer engine (vLLM's nccl, our gloo on CPU)
# -------------------------------------------------------------------------------------------------
# In order: whether a step sends (stream_now); the send (sync_weights, WeightClient: vLLM's four calls); the engines'
# end (EngineWeights: the calls made between two engine steps, the probe); the handshake at the start
# (weight_transfer); our gloo backend and the weights' source (WireWeights); with --lora_rank the adapter alone
# (AdapterTransfer), loaded by vLLM's add_lora; code in vLLM's workers (WorkerExtension).
# -------------------------------------------------------------------------------------------------
def stream_now(args: Args, layout: Layout, client: WeightClient | None, version: int, evaluates: bool) -> bool:
    """ALL learners call this: does this step end with a weight update? Inflight updates: always. Drained
    ones (departure, see EngineWeights.ask): when an engine asked, when the engines' weights would
    otherwise be async_steps versions old at the next step (the off-policy bound: an engine may load one
    step late), and before an evaluation (it measures the policy after this step). Learner 0 decides."""
    if loads_inflight(args):
        return True
    decision = None
    if layout.is_main:
        decision = bool(evaluates or version - client.streamed >= args.async_steps or client.wants_weights())
    if layout.num_learners > 1:
        decision = broadcast_list([decision], layout.groups["learners"], args.timeout_s)[0]
    return decision


def sync_weights(args: Args, policy: Policy, layout: Layout, transfer, probe_ids, version: int, full: bool) -> dict:
    """ALL learners call this (FSDP2 gathers are collective). Learner 0 sends the header (the version and the
    learner's logprobs of the probe sequence) and, with `full`, the weights, in the training dtype, through vLLM's
    trainer engine `transfer` (its client's send_weights; without `full`: the initial check). Returns seconds: sync
    (all of it), and on learner 0 for full updates gather (producing the full tensors), drain (drained updates:
    waiting for every engine to drain) and transfer (the rest)."""
    t = time.perf_counter()
    groups, num_learners = layout.groups, layout.num_learners
    probe = None
    if layout.is_main or num_learners > 1:
        ids = broadcast_list(probe_ids, groups["learners"], args.timeout_s) if num_learners > 1 else probe_ids
        policy.model.eval()  # no dropout (LoRA's): the engine has none; train_on sets train mode again
        with torch.no_grad():
            batch = collate_bin([{"prompt_ids": ids[:1], "response_ids": ids[1:], "advantage": 0.0,
                                  "sampling_logprobs": [0.0] * (len(ids) - 1)}])
            with policy.autocast:
                lp, _ = token_logprobs(policy.model, batch)
        probe = lp[:-1].tolist()
    t_send, transfer.source.seconds, drain = time.perf_counter(), 0.0, 0.0
    if layout.is_main:
        header = {"version": version, "stream": full, "probe_ids": probe_ids, "probe_logprobs": probe}
        drain = transfer.client.send_weights(header, transfer, args.timeout_s if full else args.startup_timeout_s)
    elif full:  # each gather is a collective of all learners
        transfer.send_weights()
    gather = transfer.source.seconds
    times = ({"gather": gather, "drain": drain, "transfer": time.perf_counter() - t_send - gather - drain,
              "bytes": update_bytes(policy, transfer)} if full and layout.is_main else {})
    return dict(times, sync=time.perf_counter() - t)


def update_bytes(policy: Policy, transfer) -> int:
    """The bytes one weight update moves to each engine: the adapter's (LoRA) or every weight in the training dtype."""
    if isinstance(transfer, AdapterTransfer):
        return transfer.bytes
    return sum(p.numel() for p in policy.model.parameters()) * policy.wire_dtype.itemsize


class WeightClient:
    """Learner 0's client of the engines' weight transfer (vLLM's VLLMWeightSyncClient: its four calls), the trainer
    engine's `client`: the calls travel on the link's weights channel (colocated: the actor's update queue) and each
    actor makes them on its LLM between two engine steps (EngineWeights). An update's calls travel as one message,
    when the backend says (`receives_in_background`): at update_weights for NCCL, whose workers receive inside that
    call; at finish for our gloo backend, whose workers already hold the whole update then, so that an engine pauses
    for the load only, never for the wire.
    Departure from vLLM's clients, which block until the engine has run each call: these return once the message is
    sent, so send_weights returns before the engines have loaded (they load at their next step boundary). A failed
    load ends its actor, which reports the error; learner 0 raises it at its next pull of groups or its next update,
    whichever comes first: within one learner step of the update (at most --timeout_s)."""

    def __init__(self, link: Link):
        self.link, self.args = link, link.args
        self.header = {}  # of the update under way: its version and probe (vLLM's trainer engines pass none)
        self.streamed = None  # the version of the last update sent to the engines
        self.sends_at_finish = False  # the update's calls go at finish_weight_update (the backend says)

    def wait_for_engines(self, timeout_s: float):
        """Every actor's engine is up (its first message). Learner 0 opens the weight stream's rendezvous only after
        this: vLLM's NCCL store waits a fixed 300 s for the workers (StatelessProcessGroup's store_timeout), less
        than a large engine may take to start; --startup_timeout_s bounds the start instead."""
        link = self.link
        if link.local is None:
            link.wait_for_actors(lambda: link.ready >= set(link.actor_ranks), timeout_s,
                                 f"the engines to start (up: actor ranks {sorted(link.ready)})")

    def init_weight_transfer_engine(self, init_info: dict):
        if self.link.local is not None:  # the actor thread runs, but its engine idles until the first update
            return self.link.local.weights.join(init_info)
        self._post({"init_info": init_info})

    def start_weight_update(self):
        pass  # sent with the update

    def update_weights(self, update_info: dict):
        self.update = dict(self.header, update_info=update_info)
        if not self.sends_at_finish:
            self._post(self.update)

    def finish_weight_update(self, weight_version: str | None = None):
        if self.sends_at_finish:  # the version and probe the update carries are self.header
            self._post(self.update)

    def _post(self, msg: dict):
        if self.link.local is not None:
            self.link.local.updates.put(msg)
        else:
            broadcast_obj(msg, 0, self.link.groups["weights"], max(self.args.timeout_s, self.args.startup_timeout_s))

    def wants_weights(self) -> bool:
        """Has an engine asked for newer weights than the last update sent (drained updates)? A request made
        before that update arrived is answered by it."""
        local = self.link.local
        asked = [local.weights.wants] if local is not None else list(self.link.wants.values())
        return any(v is not None and v >= self.streamed for v in asked)

    def drain_engines(self, version: int, timeout_s: float):
        """Drained updates: ask every engine to drain and wait until all have, before any byte of the update moves.
        (With NCCL an engine receives only inside update_weights, which it calls once drained: sending earlier would
        hold learner 0 in the broadcast, and the other learners in their gathers, under NCCL's watchdog, until the
        slowest engine drains. Our gloo backend waits here the same way.)"""
        link = self.link
        self._post({"drain": version})
        drained = (lambda: link.local.weights.drained == version) if link.local is not None else (
            lambda: all(link.drained.get(r) == version for r in link.actor_ranks))
        link.wait_for_actors(drained, timeout_s, f"every engine to drain for version {version}")

    def send_weights(self, header: dict, transfer, timeout_s: float):
        """A weight update: its header (version, probe) and, with `stream`, the weights (vLLM's send_weights, in a
        thread: a dead or stopped engine ends it with an error within timeout_s, NCCL's waits included). Drained
        updates first wait for every engine to drain (drain_engines). Returns the seconds that wait took."""
        self.streamed, self.header = header["version"], {k: v for k, v in header.items() if k != "stream"}
        if not header.get("stream"):
            return self._post(self.header)
        t = time.perf_counter()
        if not loads_inflight(self.args):
            self.drain_engines(header["version"], timeout_s)
        drain_s = time.perf_counter() - t
        self.sends_at_finish = getattr(transfer, "receives_in_background", False)  # vLLM's NCCL engine: False
        errors, done = [], threading.Event()
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def send():
            try:
                if device is not None:  # a new thread's current CUDA device is 0, whatever this rank's is
                    torch.cuda.set_device(device)
                transfer.send_weights()
            except Exception as e:
                errors.append(e)
            done.set()

        threading.Thread(target=send, daemon=True).start()
        self.link.wait_for_actors(done.is_set, timeout_s, f"the weight update to version {header['version']}")
        if errors:
            raise RuntimeError(f"weight update to version {header['version']} failed: {errors[0]}") from errors[0]
        return drain_s


ADAPTER_ROOTS = []  # LoRA: this process's engines' adapter directories


def remove_adapter_roots():
    """LoRA: delete this process's engines' adapter directories (on a RAM disk by default), whatever the exit."""
    for root in ADAPTER_ROOTS:
        shutil.rmtree(root, ignore_errors=True)


def remove_dead_adapter_roots(lora_dir: str):
    """LoRA: delete the adapter directories of engines whose process is gone (a killed run's, kept on the RAM disk)."""
    for name in os.listdir(lora_dir) if os.path.isdir(lora_dir) else []:
        parts = name.split("-")
        if name.startswith("grpo-adapters-") and len(parts) == 4 and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(lora_dir, name), ignore_errors=True)
            except PermissionError:  # alive, another user's
                pass


class EngineWeights:
    """An actor's end of the weight updates, called by its engine loop between two engine steps: it makes learner
    0's calls on the engine's LLM (vLLM's weight-transfer protocol), holds admission while an update waits, tells
    learner 0 when its engine drained or needs newer weights (drained updates), and probes every update."""

    def __init__(self, actor):
        self.actor = actor
        self.next = None  # the update (or drain request) received and not loaded yet
        self.drain_t0 = None  # when the engine began draining for `next`
        self.probe = None  # (request id, learner probe logprobs, version, probe ids) while a probe runs
        self.wants = None  # drained updates: the version whose successor this engine asked for (ask)
        self.drained = None  # drained updates: the version it last drained for, told learner 0
        self.adapters = {}  # LoRA: version -> its LoRARequest, loaded in the engine and not removed yet
        self.adapter_root = os.path.join(actor.args.lora_dir, f"grpo-adapters-{os.getpid()}-{actor.actor_id}")
        ADAPTER_ROOTS.append(self.adapter_root)  # removed at exit, failed runs' too (remove_adapter_roots)
        if actor.args.lora_rank:
            remove_dead_adapter_roots(actor.args.lora_dir)

    def join(self, init_info: dict):
        """vLLM's init_weight_transfer_engine: this engine's workers join learner 0's weight stream as ranks
        rank_offset + actor id x tensor_parallel_size + their tensor-parallel rank; returns once all have."""
        actor = self.actor
        offset = init_info["rank_offset"] + actor.actor_id * actor.args.vllm_tensor_parallel_size
        actor.llm.init_weight_transfer_engine({"init_info": dict(init_info, rank_offset=offset)})

    def between_steps(self) -> bool:
        """Load the next update when the engine may: inflight updates at once; drained ones (and static batches) once
        nothing runs, after answering learner 0's drain request, which arrives first. Returns whether no update
        waits, so that the engine may admit prompts."""
        actor = self.actor
        if self.next is None or "drain" in self.next:  # a drain request holds until its update comes
            with contextlib.suppress(queue.Empty):
                self.next = actor.updates.get_nowait()
        if self.next is None:
            return True
        if not (actor.version is None or loads_inflight(actor.args) or actor.drained()):
            self.drain_t0 = self.drain_t0 or time.perf_counter()  # draining: admit nothing until it loads
            return False
        if self.drain_t0 is not None:
            actor.stats["drain_s"] += time.perf_counter() - self.drain_t0
            self.drain_t0 = None
        if "drain" in self.next:  # learner 0 sends once every engine said this
            if self.drained != self.next["drain"]:
                self.drained = self.next["drain"]
                actor.emit({"drained": self.drained, "actor": actor.actor_id})
            return False
        actor.busy_since = time.monotonic()
        self.load(self.next)
        actor.busy_since, self.next = None, None
        return True

    def load(self, update: dict):
        """Make learner 0's calls on the LLM: with `update_info`, start_weight_update, update_weights (the workers load
        the weights learner 0 sends them) and finish_weight_update with the version; without, update_weight_version
        only. Inflight: running requests and their KV cache stay; the scheduler pause only makes vLLM's per-token
        version labels exact. With LoRA, `update_info` holds the adapter: load_adapter instead."""
        actor, t = self.actor, time.perf_counter()
        if "update_info" in update:
            if "adapter" in update["update_info"]:
                self.load_adapter(update["version"], update["update_info"]["adapter"])
            else:
                self.load_weights(update)
            actor.stats["weight_load_s"] += time.perf_counter() - t
            actor.stats["weight_loads"] += 1
        else:
            actor.llm.update_weight_version(str(update["version"]))
        actor.version, self.wants = update["version"], None
        actor.stats["updates"] += 1
        if update.get("probe_ids"):
            self.start_probe(update["probe_ids"], update["probe_logprobs"], update["version"])

    def load_weights(self, update: dict):
        """The full weights, through vLLM's weight-transfer calls, the scheduler paused (not the requests)."""
        actor = self.actor
        actor.engine.engine_core.call_utility("pause_scheduler", "keep", False)  # keep: no abort, no cache clear
        try:
            actor.llm.start_weight_update()
            actor.llm.update_weights({"update_info": update["update_info"]})
            actor.llm.finish_weight_update(str(update["version"]))
        except Exception as e:
            raise RuntimeError(f"actor {actor.actor_id}: weight update after version {actor.version} failed; the "
                               f"engine is unusable now: {e}") from e
        actor.engine.engine_core.call_utility("resume_scheduler")

    def load_adapter(self, version: int, adapter: dict):
        """LoRA: the adapter of policy `version` (peft's format) written to its own directory (a temporary one,
        renamed once complete) and loaded through vLLM's public path (add_lora) under its own name and id. Requests
        started before keep their adapter to their end (vLLM binds a request to its LoRARequest), and the prefix
        cache never mixes versions (vLLM's block hash includes the adapter's name and path). Not vLLM's
        `load_inplace`, which would switch running requests mid-sequence with no record of where. Versions no
        request uses any more are removed (remove_unused_adapters)."""
        from vllm.lora.request import LoRARequest

        actor = self.actor
        skip_from = os.environ.get("GRPO_TEST_SKIP_ADAPTER_LOAD")  # TEST ONLY: from this version on, loads never happen
        if skip_from and version >= int(skip_from) and self.adapters:  # (the engine keeps serving an older adapter)
            return
        name = f"policy-{version}"
        path, tmp = os.path.join(self.adapter_root, name), os.path.join(self.adapter_root, f".tmp-{name}")
        shutil.rmtree(tmp, ignore_errors=True)
        write_adapter(tmp, adapter["config"], adapter["tensors"])
        shutil.rmtree(path, ignore_errors=True)  # the same version again (the initial update after a resume)
        os.rename(tmp, path)
        request = LoRARequest(name, version + 1, path)  # vLLM's ids start at 1
        if not actor.engine.add_lora(request):
            raise RuntimeError(f"actor {actor.actor_id}: vLLM did not load the adapter of version {version} ({path})")
        self.adapters[version] = actor.adapter = request

    def remove_unused_adapters(self):
        """LoRA: remove from the engine, and delete, every adapter version older than the newest that no request
        (nor a tool episode between turns) runs on any more."""
        actor = self.actor
        used = {st["version"] for st in list(actor.pending.values()) + list(actor.in_tools.values())}
        for version in [v for v in self.adapters if v not in used and self.adapters[v] is not actor.adapter]:
            request = self.adapters.pop(version)
            actor.engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def ask(self):
        """Departure (drained updates): an engine that must drain to load asks for new weights only when it
        needs them: once it has drained by itself and every prompt it holds needs newer weights than its own (the
        version gate; the engine loop calls this then), so that it drains about once per async_steps learner steps,
        not at every one, and learner 0, which sends only once every engine has drained, does not wait on its
        running requests. Learner 0 streams at its next step boundary (stream_now). Once per version. (Asking as
        soon as nothing more was startable, running requests or not, made learner 0 stream at 29 of 30 steps of
        bench_infra.sh's continuous_drained run and wait for each drain.)"""
        if self.wants is None:
            self.wants = self.actor.version
            self.actor.emit({"want_weights": self.wants, "actor": self.actor.actor_id})

    def start_probe(self, probe_ids: list[int], learner_logprobs: list[float], version: int):
        from vllm import SamplingParams

        rid = f"probe-{version}"  # a fresh cache salt: the probe must not hit KV cached under old weights
        self.actor.add_request(rid, probe_ids, rid, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
        self.probe = (rid, learner_logprobs, version, probe_ids)

    def check_probe(self, out):
        """The engine's logprobs of the probe against the learner's: a mismatch is fatal (stale or corrupted
        weights, which would otherwise show only as drifting logprobs)."""
        actor, (rid, learner_lp, version, ids) = self.actor, self.probe
        self.probe = None
        engine_lp = [d[ids[t]].logprob for t, d in enumerate(out.prompt_logprobs) if t > 0]
        diff = np.abs(np.array(engine_lp) - np.array(learner_lp))
        exact = actor.dtype == torch.float32 and not actor.args.bf16  # both sides in fp32
        # vLLM's CPU engine in bf16 keeps its residual stream and norms in bf16, the learner's autocast in fp32: on
        # SmolLM2-135M (30 layers) the mean diff was 0.050-0.072 over 14 steps of correctly served weights, 0.059 at
        # version 0 (the same weights on both sides)
        bf16_tol = 0.15 if actor.dtype == torch.bfloat16 and actor.engine_on_cpu else 5e-2
        tol = actor.args.probe_tolerance or (2e-3 if exact else bf16_tol)
        actor.stats["probe_checks"] += 1
        actor.stats["probe_mean_abs_diff"] = max(actor.stats["probe_mean_abs_diff"], float(diff.mean()))
        actor.stats["probe_max_abs_diff"] = max(actor.stats["probe_max_abs_diff"], float(diff.max()))
        if not diff.mean() <= tol:
            raise RuntimeError(f"actor {actor.actor_id}: engine logprobs of the probe differ from the learner's after "
                               f"the update to version {version}: mean |diff| {diff.mean():.3g} "
                               f"(max {diff.max():.3g}) > {tol:g}. "
                               "The engine is serving stale or corrupted weights.")


def weight_transfer(args: Args, policy: Policy, layout: Layout, link: Link | None):
    """ALL learners: vLLM's trainer engine over the policy's weights in the training dtype (WireWeights), learner 0
    the sender: once every engine is up, it opens the stream's rendezvous at transfer_address() and every engine's
    workers join it (through its client, WeightClient over `link`). The other learners only join the gathers."""
    address, port, workers = "", 0, layout.num_actors * args.vllm_tensor_parallel_size
    client = WeightClient(link) if layout.is_main else None
    if layout.is_main:
        client.wait_for_engines(args.startup_timeout_s)
        address = transfer_address(layout.world_size)
    if args.lora_rank:
        return AdapterTransfer(policy, client)
    if weight_backend(layout.device) == "nccl":
        if layout.is_main:
            from vllm.utils.network_utils import get_open_port

            port = get_open_port()
        info = NCCLTrainerInitInfo(address, port, 1 + workers, rank=layout.rank)
    else:
        info = GlooTrainerInitInfo(address, port, 1 + workers, timeout_s=max(args.timeout_s, args.startup_timeout_s),
                                   rank=layout.rank)
    return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                     source=WireWeights(policy.model, policy.wire_dtype))


class AdapterTransfer:
    """--lora_rank: the weight transfer of the adapter alone, with the calls the learners make on vLLM's trainer
    engine (send_weights, source.seconds, shutdown). The base weights never travel: every engine loaded them from
    the model at start. Learner 0 sends an update's adapter tensors (peft's names, the training dtype) on the same
    bounded control plane as a full update's calls (WeightClient, one message), and each engine writes them as a
    peft directory on its own node and loads it through vLLM's public path (EngineWeights.load_adapter): no shared
    filesystem needed, and no patch of vLLM's private LoRA manager for in-memory adapters."""
    receives_in_background = True  # the adapter goes in the message of finish_weight_update

    def __init__(self, policy: Policy, client: WeightClient | None):
        self.policy, self.client = policy, client
        self.source, self.seconds, self.bytes = self, 0.0, 0  # sync_weights times source.seconds: the gather

    def send_weights(self):
        """ALL learners (with FSDP2 each adapter tensor's gather is a collective); learner 0 sends the adapter."""
        t = time.perf_counter()
        tensors = adapter_state(self.policy.model, self.policy.wire_dtype)
        self.seconds += time.perf_counter() - t
        if self.client is not None:
            self.bytes = sum(v.numel() * v.element_size() for v in tensors.values())
            self.client.update_weights({"adapter": {"config": self.policy.model.peft_config["default"],
                                                    "tensors": tensors}})
            self.client.finish_weight_update()

    def shutdown(self):
        pass


def adapter_state(model, dtype: torch.dtype) -> dict:
    """ALL learners: the LoRA adapter's tensors under peft's saved names, on CPU in `dtype` (copies: the learner
    trains on). With FSDP2 each tensor's gather (full_tensor) is a collective, in the same order on every learner."""
    from peft import get_peft_model_state_dict

    live = {name: p for name, p in model.named_parameters() if p.requires_grad}
    full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to("cpu", dtype, copy=True)
            for name, p in live.items()}
    return get_peft_model_state_dict(model, state_dict=full)


def write_adapter(path: str, config, tensors: dict) -> None:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors), as PeftModel.save_pretrained
    writes it and vLLM and peft load it."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))


def engine_lora_options(args: Args, model_path: str) -> dict:
    """vLLM's LoRA settings for --lora_rank. max_lora_rank: the smallest rank vLLM offers that holds it.
    max_loras (adapters a batch may mix): one per policy version a running request may still be on, async_steps + 1,
    plus the probe's newest: async_steps + 2 (TRL's async trainer sizes it so too); a request on an older one waits
    for a slot. lora_target_modules: the adapter's modules (lora_module_names), so that vLLM leaves the LM head
    unwrapped: vLLM 0.32's LoRA logits processor fails on prompt logprobs (the probe) batched with other requests
    (its einsum sizes one row per request against one per prompt token), on native models such as Llama."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    ranks = [r for r in typing.get_args(MaxLoRARanks) if r >= args.lora_rank]
    if not ranks:
        raise SystemExit(f"--lora_rank {args.lora_rank}: vLLM serves ranks up to {max(typing.get_args(MaxLoRARanks))}")
    return {"enable_lora": True, "max_lora_rank": ranks[0], "max_loras": args.async_steps + 2,
            "lora_target_modules": lora_module_names(args, model_path)}


def lora_module_names(args: Args, model_path: str) -> list[str]:
    """The module names --lora_target_modules puts adapters on: 'all-linear' as peft resolves it (every linear
    layer's name but the output layer's), on the model built on the meta device. The LM head is refused (see
    engine_lora_options)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    head = next(name for name, m in model.named_modules() if m is model.get_output_embeddings()).rsplit(".", 1)[-1]
    if args.lora_target_modules != ["all-linear"]:
        names = list(args.lora_target_modules)
    else:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)} - {head})
    if head in names:
        raise SystemExit(f"--lora_target_modules {head}: an adapter on the LM head is not supported (vLLM's LoRA "
                         "logits processor fails on the probe's prompt logprobs)")
    return names


def transfer_address(world_size: int) -> str:
    """Where the engines' workers reach learner 0's weight stream: VLLM_HOST_IP when set, else this host's outbound
    interface (vLLM's get_ip(), as vLLM's own examples bind); 127.0.0.1 when the engine runs beside the learner.
    (Not MASTER_ADDR: under torchrun's c10d rendezvous that is the first node's host name, maybe not learner 0's,
    and it may resolve to an interface the other nodes cannot reach.)"""
    if world_size == 1 and not os.environ.get("VLLM_HOST_IP"):
        return "127.0.0.1"
    from vllm.utils.network_utils import get_ip

    return get_ip()


def probe_ids_for(train_ds, tokenizer) -> list[int]:
    """The sequence whose logprobs learner and engines compare after every update: a training prompt and
    a fixed answer."""
    return (list(train_ds[0]["prompt_input_ids"])
            + tokenizer.encode("<think>1+1=2</think>\n\\boxed{2}", add_special_tokens=False))


# vLLM's weight-transfer engine (vllm/distributed/weight_transfer) carries the weights: vLLM's `nccl` backend between
# GPUs; on CPU, and where the learner shares its GPU with the engine (NCCL takes one rank per GPU; vLLM's `ipc` sends
# pickled handles), ours: vLLM's NCCL engines with a gloo group, an update sent as one broadcast of its bytes.
GLOO_BACKEND = "grpo_gloo"


def weight_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") and dist.is_initialized() else GLOO_BACKEND


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """What a worker needs to join learner 0's gloo group (no NCCL packing: an update travels as one broadcast)."""
    master_address: str
    master_port: int
    rank_offset: int  # the worker's rank = rank_offset + its tensor-parallel rank
    world_size: int
    timeout_s: float = 1800.0
    update_bytes: int = 0  # every update's size: the sender's metadata, fixed for the run


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = GLOO_BACKEND
    master_address: str
    master_port: int  # 0: any free port
    world_size: int  # learner 0 and every engine worker
    timeout_s: float = 1800.0


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """A vLLM worker's end of our gloo backend. start / finish_weight_update are the NCCL engine's: vLLM's layerwise
    in-place reload, which also redoes vLLM CPU's packed copies of the weights (assigning parameters would not).
    A thread receives each update as learner 0 sends it, while the engine generates (NCCL's receive waits for the
    engine's next step: the learner waited 2x longer in a toy run); it holds at most two updates (a CPU model is
    small), and learner 0 waits beyond that."""
    init_info_cls = GlooInitInfo

    def init_transfer_engine(self, info: GlooInitInfo) -> None:
        if info.update_bytes <= 0:  # the receiving thread would fail at once, and every update with it
            raise ValueError("grpo_gloo: the init info gives no update size (the trainer engine sends it)")
        self.timeout, self.inbox = datetime.timedelta(seconds=info.timeout_s), queue.Queue(maxsize=1)
        store = dist.TCPStore(info.master_address, info.master_port, is_master=False, timeout=self.timeout)
        self.gloo = dist.ProcessGroupGloo(store, info.rank_offset + self.parallel_config.rank, info.world_size,
                                          self.timeout)
        threading.Thread(target=self._receive, args=(info.update_bytes,), daemon=True).start()

    def _receive(self, size: int) -> None:
        try:  # update after update; an error ends the thread and fails the next update
            while True:
                flat = torch.empty(size, dtype=torch.uint8)
                self.gloo.broadcast([flat], dist.BroadcastOptions()).wait(self.timeout)
                self.inbox.put(flat)
        except Exception as e:
            self.inbox.put(e)

    def update_weights(self, update_info: dict) -> None:  # the base's, less torch.accelerator.synchronize() (no GPU)
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update) -> None:
        """The next update's bytes cut into the announced tensors, checked, then loaded (load_weights: a
        tensor-parallel worker takes its shard)."""
        try:
            flat = self.inbox.get(timeout=self.timeout.total_seconds())
        except queue.Empty:
            raise TimeoutError(f"weight stream: no update from learner 0 within {self.timeout}") from None
        if isinstance(flat, Exception):
            raise RuntimeError(f"weight stream from learner 0: {flat}") from flat
        dtypes = [getattr(torch, d) for d in update.dtype_names]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(update.shapes, dtypes)]
        if sum(sizes) != flat.numel():
            raise ValueError(f"weight stream: {flat.numel()} bytes where the update's tensors take {sum(sizes)}")
        weights = unpack_tensor(flat, update.names, update.shapes, dtypes, sizes)
        if bad := [name for name, w in weights if not torch.isfinite(w).all()]:
            raise ValueError(f"weight stream: non-finite values in {', '.join(bad)}")
        self.model.load_weights(weights)


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """Learner 0's end of our gloo backend: vLLM's NCCL trainer engine (its send_weights makes the four calls and
    checks the source against its metadata), its group and broadcast gloo's; the other learners only iterate."""
    init_info_cls = GlooTrainerInitInfo
    receives_in_background = True  # its workers hold the whole update before their engine calls update_weights

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.timeout, address = datetime.timedelta(seconds=init_info.timeout_s), init_info.master_address
        if engine.is_sender:  # one buffer of the update's bytes, kept across updates
            engine.buffer = torch.empty(sum(math.prod(m.shape) * m.dtype.itemsize for m in source.metadata()),
                                        dtype=torch.uint8)
            store = dist.TCPStore(address, init_info.master_port, is_master=True, wait_for_workers=False,
                                  timeout=engine.timeout)
            info = GlooInitInfo(master_address=address, master_port=store.port, rank_offset=1,
                                world_size=init_info.world_size, timeout_s=init_info.timeout_s,
                                update_bytes=engine.buffer.numel())
            with ThreadPoolExecutor(1) as pool:  # the workers join while this rank does
                joined = pool.submit(client.init_weight_transfer_engine, dataclasses.asdict(info))
                engine.gloo = dist.ProcessGroupGloo(store, 0, init_info.world_size, engine.timeout)
                joined.result()
            engine.store = store
        return engine

    def shutdown(self) -> None:
        self.gloo = self.store = None  # the group's connections and the store's server close with them

    def _broadcast(self, source, meta) -> None:
        if not self.is_sender:
            return super()._broadcast(source, meta)
        at = 0  # _checked_iter holds each tensor to its metadata, so the bytes fill the buffer exactly
        for _, tensor in self._checked_iter(source, meta):
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            self.buffer[at:at + flat.numel()].copy_(flat)
            at += flat.numel()
        self.gloo.broadcast([self.buffer], dist.BroadcastOptions()).wait(self.timeout)


_OUR_ENGINES = ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine))


for _factory, _engine in _OUR_ENGINES if WeightTransferEngineFactory else ():
    with contextlib.suppress(ValueError):  # registered already: a forked vLLM process inherits its parent's registry
        _factory.register_engine(GLOO_BACKEND, _engine)


class WireWeights(WeightSource):
    """The state dict in the training dtype, one full tensor at a time (FSDP2: each shard cast, then gathered, just
    before it goes; every learner iterates, in order). `seconds`: the time spent producing them (the gather)."""

    def __init__(self, model, dtype):
        self.model, self.dtype, self.seconds = model, dtype, 0.0

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(k, self.dtype, tuple(v.shape)) for k, v in self.model.state_dict().items()]

    def __iter__(self):
        for name, v in self.model.state_dict().items():
            t = time.perf_counter()
            tensor = materialize_full_tensor(v.detach().to(self.dtype))
            self.seconds += time.perf_counter() - t
            yield name, tensor


class WorkerExtension:
    """Methods vLLM adds to each of its workers (`worker_extension_cls`, imported there by name, so nothing is pickled
    into a worker; the import also registers our gloo backend before the worker builds its engine)."""

    def grpo_watch_owner(self, owner_pid: int) -> None:
        """vLLM's engine processes outlive a frontend killed with SIGKILL: a thread here takes the engine core (this
        worker's parent) and the worker down once the process that owns the engine is gone."""
        engine_core = os.getppid()

        def watch():
            while True:
                time.sleep(1.0)
                try:
                    os.kill(owner_pid, 0)
                except ProcessLookupError:
                    # Only while the engine core is still our parent: once it is gone this process has
                    # been re-parented, and getppid() names an unrelated process (a test runner, a shell).
                    if os.getppid() == engine_core:
                        os.kill(engine_core, signal.SIGKILL)
                    os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
        # vLLM's in-place reload warns "<layer>: Failed to load weights" for every layer that received no tensor. A
        # rotary embedding has none (its cos/sin cache comes from the config): that warning meant nothing.
        import logging

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda r: not (str(r.msg).endswith("Failed to load weights") and "RotaryEmbedding" in str(r.args)))

    def grpo_measure_peaks(self) -> tuple[float, float, str]:
        """This worker's peaks (measure_peaks), measured where the engine's FLOPs run: in the worker, with the
        threads vLLM bound to its cores (VLLM_CPU_OMP_THREADS_BIND), or on its GPU."""
        return measure_peaks(self.device, dtype=self.model_config.dtype)  # the engine computes in its dtype





# -------------------------------------------------------------------------------------------------
# The learner: setup, the loop, `main`
# -------------------------------------------------------------------------------------------------
def check_rlvr_rows(dataset, flag: str, limit: int = 20, allow_unsandboxed_code: bool = False) -> None:
    """Stop before any training on rows that can never earn a reward, naming each by file and line: no
    ground truth, malformed messages, an unknown verifier name, labels that do not fit the verifiers; and
    code rows where no sandbox exists and --allow_unsandboxed_code is off (the verifiers refuse them).
    (Unchecked, an unknown verifier scores every sample 0 and the steps train on nothing; refused code
    rows are infrastructure failures, dropped from every step, silently while under --max_infra_failure_rate.)"""
    import chat_template
    import verifiers

    problems, code_rows = {}, []
    for row in dataset:
        where = f"{row.get('source')}:{row.get('source_line')}"
        if where not in problems:  # an upsampled source repeats its rows
            verifier = chat_template.rlvr_verifier(row)
            problems[where] = chat_template.rlvr_row_problem(row) or verifiers.row_problem(
                verifier, row.get("ground_truth"))
            if not problems[where] and verifiers.runs_code(verifier, row.get("ground_truth")):
                code_rows.append(where)

    def listed(items):
        return "".join(f"\n  {item}" for item in items[:limit]) + (
            f"\n  ... and {len(items) - limit} more" if len(items) > limit else "")

    bad = [f"{where}: {reason}" for where, reason in problems.items() if reason]
    if bad:
        raise ValueError(f"{flag}: {len(bad)} row(s) can never be scored, so nothing was trained (fix or remove "
                         f"them):{listed(bad)}")
    if code_rows and not allow_unsandboxed_code and verifiers.sandbox_mode() == "none":
        raise ValueError(
            f"{flag}: {len(code_rows)} row(s) use the code / code_stdio verifiers, which run model-written code, "
            f"and this machine has no sandbox for it ({verifiers.sandbox_description()}), so they would be refused "
            "and dropped from every step. Install bubblewrap (bwrap), or enable unprivileged user namespaces "
            "(sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 on Debian; "
            "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04+; a container must allow unshare), "
            "or pass --allow_unsandboxed_code to run it as this user with no isolation, or remove these rows:"
            f"{listed(code_rows)}")


@dataclass
class Layout:
    """Where this process sits in the run: its rank among the learners (ranks 0..num_learners-1) and
    the actors (the rest), its device, and the process groups (prompts, data, weights: learner 0 and
    the actors; learners: the learners)."""
    rank: int
    world_size: int
    num_learners: int
    device: str
    groups: dict
    actor_ranks: list

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_actors(self) -> int:  # a colocated run has one, in a thread
        return max(1, len(self.actor_ranks))


@dataclass
class Policy:
    """The model being trained and everything that steps it, on each learner rank."""
    tokenizer: object
    model: torch.nn.Module
    ref_model: torch.nn.Module | None  # the frozen KL reference (--beta > 0)
    optimizer: torch.optim.Optimizer
    scheduler: object
    autocast: object  # bf16 matmuls for one unsharded learner (FSDP2 casts its own parameters)
    bf16: bool
    pack_length: int  # tokens per packed row
    forward_tokens: int  # tokens per forward pass
    engine_share: float | None = None  # one GPU: the colocated engine's gpu_memory_utilization (colocated_engine_share)
    idle_cores: "IdleCores | None" = None  # CPU, one learner: the actors' idle cores it may compute on

    @property
    def wire_dtype(self) -> torch.dtype:  # the weights go to the engines in the training dtype
        return torch.bfloat16 if self.bf16 else torch.float32


def load_policy(args: Args, model_path: str, layout: Layout, adapter_from: str | None = None) -> Policy:
    """The model (FSDP2-sharded over several learners), the reference, AdamW and the lr schedule, after
    the memory plan says they fit (else a clear error naming the knobs). With --lora_rank: the frozen base from
    `model_path` and a peft adapter, new or `adapter_from`'s (a checkpoint); AdamW holds the adapter only."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device, num_learners = layout.device, layout.num_learners
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pack_length = args.pack_length or args.max_prompt_length + args.max_response_length
    bf16 = args.bf16 if args.bf16 is not None else device.startswith("cuda")
    # Varlen flash attention separates packed rows by position ids with no mask at all; sdpa needs a
    # (T, T) boolean one, which transformers builds from the same position ids.
    flash = device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None
    # Few large matmuls beat many small ones on a GPU. On CPU one packed row per pass is faster beside a running
    # engine: batched rows trained 30% slower there (4.5 s against 3.4 s a step, toy model, 32 samples).
    forward_tokens = args.forward_tokens or (pack_length if device == "cpu" else max(pack_length, 16384))
    config = AutoConfig.from_pretrained(model_path)
    plan = memory_plan(config, forward_tokens, 1, num_learners, bf16, args.gradient_checkpointing,
                       args.logprob_chunk_size, trained=args.lora_rank == 0, flash_attention=flash)
    if args.beta > 0:  # the frozen reference: fp32, unsharded, on every learner
        plan["reference"] = plan["weights"] * num_learners
        plan["total"] += plan["reference"]
    available = device_memory_bytes(torch.device(device), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    knobs = ("--gradient_checkpointing, more learners (--num_learners), a smaller --pack_length, --bf16, a smaller "
             "--logprob_chunk_size")
    line = check_memory_plan(plan, available, knobs)
    engine_share = None
    if layout.world_size == 1 and device.startswith("cuda"):  # one GPU: the engine gets what the learner leaves
        need = engine_memory_need(ModelShape.from_config(config), plan["weights"] / 4,
                                  args.max_prompt_length + args.max_response_length)
        engine_share = colocated_engine_share(plan["total"], available, args.vllm_gpu_memory_utilization, need, knobs)
        line += (f"; the colocated vLLM engine: {engine_share:.2f} of the GPU ({engine_share * available / 2**30:.1f} "
                 f"GiB, its weights and one full-length sequence's KV cache need {need / 2**30:.1f})")
    if layout.is_main:
        print(f"[grpo] {line}", flush=True)
    attn = "flash_attention_2" if flash else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=attn).to(device)
    model.config.use_cache = False
    install_chunked_head(model, args.logprob_chunk_size)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        model = add_adapter(args, model, adapter_from)
    ref_model = None
    if args.beta > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32,
                                                         attn_implementation=attn).to(device).eval()
        ref_model.requires_grad_(False)
        install_chunked_head(ref_model, args.logprob_chunk_size)
    if num_learners > 1:  # FSDP2: shard every decoder layer, then the root (works on gloo too)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh(device.split(":")[0], list(range(num_learners)))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
        base = model.get_base_model() if args.lora_rank else model
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16 and num_learners == 1)
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter only
    optimizer = torch.optim.AdamW(trained, lr=args.learning_rate, weight_decay=args.weight_decay)
    updates = args.num_training_steps * args.num_mini_batches * args.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 1.0 if args.lr_scheduler_type == "constant" else max(0.0, 1.0 - s / max(1, updates)))
    return Policy(tokenizer, model, ref_model, optimizer, scheduler, autocast, bf16, pack_length, forward_tokens,
                  engine_share)


def add_adapter(args: Args, model, adapter_from: str | None):
    """--lora_rank: the model frozen under a peft LoRA adapter, a new one (B = 0: the policy starts as the base
    model) or the one saved in `adapter_from` (a checkpoint, trainable)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_from:
        return PeftModel.from_pretrained(model, adapter_from, is_trainable=True)
    targets = "all-linear" if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
    return get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))


# What a GPU holds beside the learner's plan and the engine's share: two CUDA contexts (learner and engine processes,
# about 0.5 GiB each) and the caching allocator's slack. An estimate, not a measurement (no GPU with vLLM here).
COLOCATED_HEADROOM_BYTES = 2 * 2**30


def engine_memory_need(shape: ModelShape, params: float, max_model_len: int) -> int:
    """The least a vLLM engine starts with: its bf16 weights and the KV cache of one sequence of max_model_len tokens
    (vLLM refuses to start with less)."""
    return int(2 * params + shape.kv_bytes_per_token(2) * max_model_len)


def colocated_engine_share(learner_bytes: float, device_bytes: int, requested: float, engine_need: int,
                           knobs: str) -> float:
    """One GPU for learner and engine (`python grpo.py`): the engine's gpu_memory_utilization. vLLM reads it as a
    share of the whole GPU and refuses to start when less than that is free, and the learner, loaded first, keeps its
    plan's memory (weights, gradients, AdamW, compute copy, activations, logits): the engine gets what that plan
    leaves, less COLOCATED_HEADROOM_BYTES, at most --vllm_gpu_memory_utilization. Stops the run, naming the knobs,
    when that cannot hold the engine's weights and one full-length sequence (`engine_need`)."""
    share = min(requested, (device_bytes - learner_bytes - COLOCATED_HEADROOM_BYTES) / device_bytes)
    if share * device_bytes < engine_need:
        gib = 2**30
        raise SystemExit(
            f"memory plan: one GPU of {device_bytes / gib:.1f} GiB cannot hold the learner ({learner_bytes / gib:.1f} "
            f"GiB planned) and a vLLM engine beside it (at least {engine_need / gib:.1f} GiB: its weights and one "
            f"sequence of --max_prompt_length + --max_response_length tokens; {max(share, 0) * device_bytes / gib:.1f} "
            f"GiB left). Run learner and engine on separate GPUs (torchrun --nproc-per-node 2), or change one of: "
            f"{knobs}, shorter sequences.")
    return share


def restore_training_state(latest: str, policy: Policy, num_learners: int) -> tuple[int, int]:
    """Optimizer, schedule and RNG states from a checkpoint (its weights were loaded with the model).
    Returns the step to start from and the prompt sampler's position."""
    state = torch.load(os.path.join(latest, "training_state.pt"), weights_only=False)
    load_optimizer(policy.model, policy.optimizer, state["optimizer"], num_learners)
    policy.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    return state["step"], state["sampler_position"]


def load_prompts(args: Args, tokenizer) -> tuple:
    """The training and evaluation prompts (learner 0), checked before any training (check_rlvr_rows)."""
    import chat_template

    def load(mixer, splits, flag):
        raw = chat_template.load_mixture(mixer, split=splits, seed=args.seed)
        check_rlvr_rows(raw, flag, allow_unsandboxed_code=args.allow_unsandboxed_code)
        return chat_template.tokenize_rlvr(raw, tokenizer, args.max_prompt_length, args.chat_template)

    train_ds, drops = load(args.dataset_mixer_list, args.dataset_mixer_list_splits, "--dataset_mixer_list")
    if len(train_ds) == 0:
        raise ValueError(f"no training prompts left after tokenization (dropped: {dict(drops)}); "
                         "raise --max_prompt_length?")
    eval_ds = None
    if args.eval_dataset_mixer_list:
        eval_ds, _ = load(args.eval_dataset_mixer_list, args.eval_dataset_mixer_list_splits,
                          "--eval_dataset_mixer_list")
    check_tool_rows({"--dataset_mixer_list": train_ds, "--eval_dataset_mixer_list": eval_ds}, args)
    return train_ds, eval_ds, drops


def check_tool_rows(datasets: dict, args: Args) -> None:
    """Stop before any training when rows offer tools the registry lacks (the built-in `python` and
    --tools_module's TOOLS): the model would be told of a tool whose every call fails."""
    offered = defaultdict(Counter)
    for flag, ds in datasets.items():
        for names in ds["tool_names"] if ds is not None else []:
            offered[flag].update(names or [])
    if not any(offered.values()):
        return
    tools = load_tools(args)
    missing = [f"{flag}: {name!r} ({n} rows)" for flag, names in offered.items() for name, n in names.items()
               if name not in tools]
    if missing:
        raise ValueError("rows offer tools that no registered function implements (built-in: python; add yours "
                         f"with --tools_module FILE defining TOOLS = {{name: function}}; have: "
                         f"{', '.join(sorted(tools))}):\n  " + "\n  ".join(missing))


def connect_actors(args: Args, policy: Policy, layout: Layout, model_path: str) -> tuple[Link, Actor | None]:
    """Learner 0's link to the actors. A colocated run (one process) starts its engine here, run by a thread."""
    local_actor = None
    if layout.world_size == 1:
        results = queue.Queue()
        local_actor = start_colocated_actor(args, model_path, results.put, layout.device, policy.engine_share)
        link = Link(args, [], None, local_actor, results)
    else:
        link = Link(args, layout.actor_ranks, layout.groups, None)
    if local_actor is not None:
        def actor_thread():
            try:
                local_actor.run()
                link.results.put({"done": 0, "stats": local_actor.take_stats()})
            except Exception as e:
                link.error = link.error or f"the actor thread: {e}"
                link.results.put({"error": "".join(traceback.format_exception(e))})

        threading.Thread(target=actor_thread, daemon=True).start()
    return link, local_actor


def score_groups(groups: list[dict], counts: Counter, tokenizer, pool) -> None:
    """verifiers.py rewards, set on each sample and as the group's `rewards`. An error the response
    caused (no answer, a check that timed out on it, a verifier that raised on it) scores 0; an
    infrastructure error (a lost pool worker, the judge unreachable) drops the sample. Both are counted
    (verifier_error/<reason>, infra_failures)."""
    from verifiers import caused_by_response

    # a tool episode's verifier reads its last turn, the answer: not the calls, nor the tools' results
    rows = [(g["verifier"], tokenizer.decode(s["response_ids"][s.get("answer_start", 0):], skip_special_tokens=True),
             g["ground_truth"]) for g in groups for s in g["samples"]]
    results = iter(pool.score(rows))
    for g in groups:
        kept = []
        for s in g["samples"]:
            r = next(results)
            counts[f"verifier_error/{r.error}"] += r.error is not None
            counts["samples_verified"] += 1
            if r.error is not None and not caused_by_response(r.error):
                counts["infra_failures"] += 1
                continue
            s["reward"] = float(r.score) if r.error is None else 0.0
            kept.append(s)
        g["samples"], g["rewards"] = kept, [s["reward"] for s in kept]


class Rollouts:
    """Learner 0's side of the rollout stream, and all the state the learner keeps between steps:
    groups of one kind that arrived while it waited for the other (`stash`), groups active sampling
    pulled beyond a step's batch (`surplus`: the next step takes them first), the actors' stats deltas
    not yet logged (`pending_stats`), and how many steps in a row mostly dropped samples
    (`infra_streak`). `score(groups, counts)` sets each group's rewards (score_groups)."""

    def __init__(self, args: Args, link: Link, dispatcher: Dispatcher, score):
        self.args, self.link, self.dispatcher, self.score = args, link, dispatcher, score
        self.stash, self.surplus, self.pending_stats, self.infra_streak = [], [], [], 0
        self.ahead_counts = Counter()  # what scoring the groups look_ahead took counted: the next step's
        self.released_at = -1  # the link's idle count when look_ahead last released prompts

    def pull(self, timeout_s: float, kind: str = "train") -> list[dict]:
        """The next finished groups of `kind` (blocks up to timeout_s); groups of the other kind wait in
        `stash`; an actor's error becomes an exception here."""
        out, deadline = [g for g in self.stash if g["kind"] == kind], time.time() + timeout_s
        self.stash = [g for g in self.stash if g["kind"] != kind]
        while not out:
            try:
                msg = self.link.results.get(timeout=max(0.0, min(1.0, deadline - time.time())))
            except queue.Empty:
                if self.dispatcher.error:
                    raise RuntimeError(f"prompt dispatcher failed: {self.dispatcher.error}")
                if time.time() > deadline:
                    raise TimeoutError(f"no finished group from any actor in {timeout_s:.0f}s (--timeout_s): "
                                       f"{self.link.silent_actors()}")
                continue
            out += self._take_waiting(msg, kind)
        return out

    def _take_waiting(self, msg: dict | None, kind: str) -> list[dict]:
        """`msg` and every message already waiting: the groups of `kind`; the others' go to `stash`."""
        out = []
        while True:
            if msg is None:
                try:
                    msg = self.link.results.get_nowait()
                except queue.Empty:
                    return out
            if "error" in msg:
                raise RuntimeError(f"actor failed: {msg['error']}")
            if "group" in msg:
                self.pending_stats.append(msg["stats"])
                (out if msg["group"]["kind"] == kind else self.stash).append(msg["group"])
            msg = None

    def look_ahead(self, version: int, engines_version: int):
        """While the learner trains step `version` (between its forward passes): score the training groups that
        arrived (the coming steps take them first, as surplus), and once every engine has nothing left to run while
        they hold fewer groups with gradient than the steps the engines' weights may still generate for, release
        that many of the prompts the gate holds, so they run now instead of after the learner's step. Measured
        without it (SmolLM2-135M, 8 prompts a step, about 60% of them useful): in a third of the steps the last
        groups were behind the gate when the learner finished, and it waited 28-35 s for a whole generation of them.
        The engines hold `engines_version`, whose samples may train up to step engines_version + async_steps; with
        fewer useful groups than those steps take, the first short one among them should train on the released
        prompts. Measured, more groups outlive the bound with it: a group a step leaves over waits for the next, one
        version older (39% of the trained tokens were 2 versions old with --async_steps 1, against 14% without), hence
        off by default (--release_ahead). Drained updates release nothing: an engine there also idles while its
        prompts wait for weights. Releases again only after every engine has run and gone idle since."""
        if not self.link.actor_ranks:  # colocated: the engine loop runs in this process, and says nothing
            return
        got = self._take_waiting(None, "train")
        if got:
            self.score(got, self.ahead_counts)
            self.surplus.extend(got)
        idle = dict(self.link.idle)
        if len(idle) < len(self.link.actor_ranks) or min(idle.values()) <= self.released_at:
            return
        steps = engines_version + self.args.async_steps - version  # the coming steps these weights may feed
        useful = sum(filter_reason(g["rewards"]) is None for g in self.surplus)
        missing = steps * self.args.num_unique_prompts_per_step - useful
        if missing > 0:
            self.dispatcher.release_gated(missing)
            self.released_at = max(idle.values())

    def next_batch(self, version: int) -> tuple[list[dict], Counter, list[float]]:
        """One step's groups (Olmo 3 sec 4.4: active sampling until num_unique_prompts_per_step groups
        with gradient), after the off-policy filter and scoring. Returns them, the step's counts, and the
        rewards of every group the step consumed, kept or filtered (the policy's solve rate)."""
        args, counts, pulled = self.args, self.ahead_counts, []
        self.ahead_counts = Counter()

        def pull_scored():
            if self.surplus:  # pulled and scored last step, beyond that step's batch
                gs, self.surplus = self.surplus, []
            else:
                gs = self.pull(args.timeout_s)
            n_pulled = len(gs)
            gs, dropped, _, _ = offpolicy_filter(gs, version, args.max_token_lag)
            counts.update(dropped)
            if n_pulled > len(gs):  # dropped as stale: consumed
                self.dispatcher.consumed(n_pulled - len(gs))
            self.score([g for g in gs if "rewards" not in g], counts)
            pulled.extend(gs)
            return gs

        # Departure (the admission gate, see admission_version): the dispatcher counts as consumed only what active
        # sampling takes this step, in order, until it has its groups. The surplus stays in flight until a later step
        # takes it, so the prefetch window and the gate bound the groups that wait here too (else, when an engine
        # delivers in bursts, the surplus and the lag grow).
        batch, extra, selection = active_sampling(pull_scored, args.num_unique_prompts_per_step,
                                                  args.max_prompts_per_step_factor * args.num_unique_prompts_per_step,
                                                  consumed=self.dispatcher.consumed)
        self.surplus.extend(extra)
        counts.update(selection)
        # surplus groups count in the step that consumes them: a step fed from the last one's alone is not empty
        surplus = {id(g) for g in extra}
        scored = [r for g in pulled if id(g) not in surplus for r in g["rewards"]]
        return batch, counts, scored

    def take_stats(self) -> list[dict]:
        """The actors' stats deltas that arrived since the last call."""
        stats, self.pending_stats = self.pending_stats, []
        return stats

    def check_infra(self, counts: Counter) -> None:
        """Infrastructure failures drop samples instead of scoring them: a run that mostly drops must stop."""
        args = self.args
        failing = counts["infra_failures"] > args.max_infra_failure_rate * max(1, counts["samples_verified"])
        self.infra_streak = self.infra_streak + 1 if failing else 0
        if self.infra_streak >= 3:
            raise RuntimeError(
                f"verifier infrastructure failures in 3 steps in a row (last: {counts['infra_failures']} of "
                f"{counts['samples_verified']} samples; --max_infra_failure_rate {args.max_infra_failure_rate}): "
                + ", ".join(f"{k[15:]} {v}" for k, v in counts.items() if k.startswith("verifier_error/") and v))

    def evaluate(self, eval_ds, num_actors: int) -> dict:
        """pass@1 (mean over k samples) and pass@k on the held-out prompts, at the engines' current weights."""
        args, t = self.args, time.perf_counter()
        prompts = [self.dispatcher.prompt(i, "eval", eval_ds[i], args.eval_num_samples) for i in range(len(eval_ds))]
        for a in range(num_actors):
            self.link.send_prompts(a, prompts[a::num_actors])
        got, counts = [], Counter()
        while len(got) < len(prompts):
            got += self.pull(args.timeout_s, kind="eval")
        self.score(got, counts)  # responses that failed their check score 0; infrastructure failures are dropped
        scores = [g["rewards"] for g in got if g["rewards"]]
        lens = [len(s["response_ids"]) for g in got for s in g["samples"]]
        k = args.eval_num_samples
        episodes = [s for g in got for s in g["samples"] if "tool_turns" in s]
        return {**(tool_metrics(episodes, Counter(), "eval/tools/") if episodes else {}),"eval/pass@1": float(np.mean([np.mean(r) for r in scores])) if scores else 0.0,
                f"eval/pass@{k}": float(np.mean([max(r) > 0.5 for r in scores])) if scores else 0.0,
                "eval/response_length": float(np.mean(lens)) if lens else 0.0, "eval/prompts": len(scores),
                "eval/verifier_errors": sum(v for k, v in counts.items() if k.startswith("verifier_error/")),
                "eval/samples_dropped_infra": counts["infra_failures"], "time/eval": time.perf_counter() - t}


def plan_step(batch: list[dict], args: Args, policy: Policy, num_learners: int) -> list[tuple]:
    """The step's samples with their advantages (Olmo 3 sec 4.4), split into minibatches, each packed
    into rows and the rows shared out to the learners' forward passes: [(shares, minibatch tokens)]."""
    advantages = compute_advantages([g["rewards"] for g in batch], args.advantage_normalization)
    rows = [{"prompt_ids": g["prompt_ids"], "response_ids": s["response_ids"], "loss_mask": s.get("loss_mask"),
             "sampling_logprobs": s["sampling_logprobs"], "advantage": a}
            for g, adv in zip(batch, advantages) for s, a in zip(g["samples"], adv) if s["response_ids"]]
    minibatches = [rows[i::args.num_mini_batches] for i in range(args.num_mini_batches)]
    return [(learner_forwards(pack_rows(mb, policy.pack_length), num_learners, policy.forward_tokens),
             sum(trained_tokens(r) for r in mb)) for mb in minibatches]


def trained_tokens(row: dict) -> int:
    """A row's tokens in the loss: its response, less a tool episode's appended results (loss_mask 0)."""
    mask = row.get("loss_mask")
    return len(row["response_ids"]) if mask is None else sum(mask)


def train_on(policy: Policy, minibatches: list[tuple], args: Args, num_learners: int,
             look_ahead=None) -> tuple[Counter, list, int]:
    """This learner's share of one step: for each epoch and minibatch, the loss over its forward passes,
    backward, clip, an optimizer step. `minibatches`: [(collated forwards, minibatch tokens on all
    learners)]. Returns the loss stats (sums), the grad norms and the real tokens trained here. Before each
    forward pass: `look_ahead()` (learner 0: Rollouts.look_ahead), and the cores to compute on (IdleCores)."""
    model, autocast = policy.model, policy.autocast
    model.train()
    lent = policy.idle_cores or IdleCores(None)  # None: this learner's own cores, always

    def between_passes():
        if look_ahead is not None:
            look_ahead()
        lent.adjust()
    with torch.no_grad(), autocast:  # the logprobs a reused batch is clipped against, and the reference's
        for forwards, _ in minibatches:
            for b in forwards:
                between_passes()
                if args.num_mini_batches > 1 or args.num_epochs > 1:
                    b["old_logprobs"] = token_logprobs(model, b, args.temperature)[0]
                if policy.ref_model is not None:
                    b["ref_logprobs"] = token_logprobs(policy.ref_model, b, args.temperature)[0]
    agg, grad_norms, learner_tokens = Counter(), [], 0
    for _ in range(args.num_epochs):
        for forwards, num_tokens in minibatches:
            for b in forwards:
                between_passes()
                with autocast:
                    new_lp, entropy = token_logprobs(model, b, args.temperature, with_entropy=True)
                dev = new_lp.device
                loss, stats = grpo_loss(new_lp, b.get("old_logprobs", new_lp.detach()), b["sampling_logprobs"].to(dev),
                                        b["advantages"].to(dev), b["mask"].to(dev), args.clip_low, args.clip_high,
                                        args.tis_cap, b["ref_logprobs"].to(dev) if "ref_logprobs" in b else None,
                                        args.beta, num_tokens_global=max(num_tokens, 1))
                # FSDP2 averages gradients over learners; the loss is already a global token mean
                (loss * num_learners).backward()
                agg.update(stats)
                agg["entropy_sum"] += (entropy * b["mask"].to(dev)).sum().item()
                agg["loss"] += loss.item()
                learner_tokens += b["real_tokens"]
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            grad_norms.append(float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn))
            policy.optimizer.step()
            policy.scheduler.step()
            policy.optimizer.zero_grad(set_to_none=True)
    agg["lent_core_s"] += lent.restore()
    return agg, grad_norms, learner_tokens


def train_metrics(agg: Counter, grad_norms: list, lr: float, args: Args) -> dict:
    """The train/ part of a step's metrics, from loss stats summed over all learners' tokens."""
    n = max(agg["tokens"], 1)
    return {"train/loss": agg["loss"] / max(1, args.num_epochs), "train/pg_loss": agg["pg_loss_sum"] / n,
            "train/clip_fraction": agg["clipfrac_sum"] / n, "train/approx_kl": agg["approx_kl_sum"] / n,
            "train/ref_kl": agg["ref_kl_sum"] / n, "train/entropy": agg["entropy_sum"] / n,
            "train/tis_capped_fraction": agg["tis_capped_sum"] / n, "train/grad_norm": float(np.mean(grad_norms)),
            "train/lr": lr, "train/trained_tokens": int(agg["tokens"]) // max(1, args.num_epochs)}


def rollout_metrics(batch, counts, lags, first_lags, scored, stats_list, args) -> dict:
    """The rollout/ and perf/ part of a step's metrics, from the kept groups, the filter counts, the
    per-token lags, the rewards of every prompt consumed this step and the actors' stats deltas.
    Keys starting with `_` are totals for the summary."""
    rewards = [r for g in batch for r in g["rewards"]]
    lens = [len(s["response_ids"]) for g in batch for s in g["samples"]]
    m = {"rollout/reward": float(np.mean(rewards)) if rewards else 0.0,
         # The kept groups' reward is pulled toward 0.5 by active sampling's filter; this is the
         # policy's own solve rate on every prompt the step consumed, the learning curve to watch.
         "rollout/reward_all_scored": float(np.mean(scored)) if scored else 0.0,
         "rollout/samples_scored": len(scored),
         "rollout/solve_rate": float(np.mean([r >= 1.0 for r in rewards])) if rewards else 0.0,
         "rollout/response_length": float(np.mean(lens)) if lens else 0.0,
         "rollout/response_length_max": max(lens) if lens else 0,
         "rollout/truncated_fraction": (float(np.mean([s["truncated"] for g in batch for s in g["samples"]]))
                                        if lens else 0.0),
         "rollout/groups": len(batch), "rollout/samples": len(rewards),
         "rollout/prompts_consumed": counts["prompts"], "rollout/filtered_all_solved": counts["all_solved"],
         "rollout/filtered_all_failed": counts["all_failed"],
         "rollout/filtered_zero_std": counts["zero_std"] + counts["too_few_samples"],
         "rollout/active_sampling_capped": counts["capped"],
         "rollout/groups_dropped_stale": counts["groups_dropped_stale"],
         "rollout/samples_dropped_stale": counts["samples_dropped_stale"],
         "rollout/verifier_errors": sum(v for k, v in counts.items() if k.startswith("verifier_error/")),
         "rollout/verifier_infra_failures": counts["infra_failures"],
         }
    for k, v in counts.items():
        if k.startswith("verifier_error/"):
            m[f"rollout/{k}"] = v
    per_verifier = defaultdict(list)
    for g in batch:
        per_verifier[str(g["verifier"])].extend(g["rewards"])
    for name, rs in per_verifier.items():
        m[f"rollout/reward/{name}"] = float(np.mean(rs))
    if first_lags:
        m["rollout/lag_first_token_mean"] = float(np.mean(first_lags))
        m["rollout/lag_first_token_max"] = int(max(first_lags))
    if lags:
        la = np.array(lags)
        m.update({"rollout/lag_mean": float(la.mean()), "rollout/lag_max": int(la.max()),
                  **{f"rollout/lag_frac_{i}": float((la == i).mean()) for i in range(args.async_steps + 1)},
                  f"rollout/lag_frac_gt{args.async_steps}": float((la > args.async_steps).mean())})
    s = sum_actor_stats(stats_list)
    el = max(s["elapsed"], 1e-9)
    m.update({"perf/actor_tokens_per_s": engines_tokens_per_s(s),
              "perf/actor_mfu": s["flops"] / max(s["peak_flops_s"], 1e-9),
              "perf/actor_mbu": s["bytes"] / max(s["peak_bw_s"], 1e-9),
              "perf/actor_occupancy": s["occupancy_s"] / el,
              "time/actor_weight_wait": s["idle_s"] + s["drain_s"] + s["weight_load_s"],
              "time/actor_idle": s["idle_s"], "time/actor_drain": s["drain_s"],
              "time/actor_weight_load": s["weight_load_s"],
              "sync/probe_checks": s["probe_checks"], "sync/probe_mean_abs_diff": s["probe_mean"],
              "sync/probe_max_abs_diff": s["probe_max"]})
    if stats_list:
        m["perf/peak_source"] = stats_list[-1]["peak_source"]
        m["perf/peak_flops"], m["perf/peak_memory_bandwidth"] = stats_list[-1]["peak_flops"], stats_list[-1]["peak_bw"]
    if s["weight_loads"]:  # the engines' own loading of the updates they reported this step, mean per engine
        m["time/weight_load"] = s["weight_load_s"] / s["weight_loads"]
    if s["static_waste_n"]:
        m["perf/static_wasted_fraction"] = s["static_waste_sum"] / s["static_waste_n"]
    episodes = [smp for g in batch for smp in g["samples"] if "tool_turns" in smp]
    if episodes or s["episodes"]:
        m.update(tool_metrics(episodes, s))
    return m


def tool_metrics(episodes: list[dict], s: Counter, prefix: str = "tools/") -> dict:
    """Tool episodes: turns and calls per episode (the step's kept samples), and from the engines' stats the
    calls, errors by kind, seconds in tools, sampled vs appended tokens and occupancy while tools ran."""
    m = {f"{prefix}episodes": len(episodes),
         f"{prefix}turns_per_episode": float(np.mean([1 + e["tool_turns"] for e in episodes])) if episodes else 0.0,
         f"{prefix}calls_per_episode": float(np.mean([e["tool_calls"] for e in episodes])) if episodes else 0.0}
    if prefix == "tools/":
        m.update({"tools/calls": s["tool_calls"], "tools/turn_limit": s["tool_turn_limit"],
                  "time/tools": s["tool_s"], "tokens/sampled": s["sampled_tokens"],
                  "tokens/appended": s["appended_tokens"],
                  **{f"tools/{k[5:]}": v for k, v in s.items() if k.startswith("tool_errors_")}})
        if s["tool_window_s"]:
            m["perf/actor_occupancy_while_tools"] = s["tool_window_occupancy_s"] / s["tool_window_s"]
    return m


def learner(args: Args, layout: Layout, latest: str | None, model_path: str) -> int:
    import datasets

    datasets.disable_progress_bars()
    is_main, num_learners, groups = layout.is_main, layout.num_learners, layout.groups
    policy = load_policy(args, model_path, layout, adapter_from=latest if args.lora_rank else None)
    start_step, position = restore_training_state(latest, policy, num_learners) if latest else (0, 0)
    link = local_actor = dispatcher = rollouts = logger = pool = train_ds = eval_ds = probe_ids = None
    if is_main:
        from verifiers import VerifierPool, sandbox_description

        train_ds, eval_ds, drops = load_prompts(args, policy.tokenizer)
        probe_ids = probe_ids_for(train_ds, policy.tokenizer)
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"[grpo] {len(train_ds)} train prompts (dropped {dict(drops)}), {len(eval_ds) if eval_ds else 0} "
              f"eval prompts; {num_learners} learner(s), {layout.num_actors} actor(s)"
              f"{' (colocated thread)' if layout.world_size == 1 else ''}; "
              f"pack_length {policy.pack_length}; start step {start_step}", flush=True)
        pool = VerifierPool(num_workers=args.verifier_workers, timeout=args.verifier_timeout,
                            allow_unsandboxed_code=args.allow_unsandboxed_code)
        print(f"[grpo] {sandbox_description()}", flush=True)
        link, local_actor = connect_actors(args, policy, layout, model_path)
        if args.lend_idle_cores and local_actor is None and num_learners == 1 and layout.device == "cpu":
            policy.idle_cores = IdleCores(link)  # the actors lend only where they are pinned (run_actor_rank)
        logger = MetricsLogger(args, append=latest is not None)
    transfer = weight_transfer(args, policy, layout, link)
    version = start_step
    # the engines loaded model_path; LoRA: they load the adapter now (new: B = 0, the base model; or the checkpoint's)
    sync_weights(args, policy, layout, transfer, probe_ids, version, full=bool(args.lora_rank))
    if is_main:
        dispatcher = Dispatcher(args, train_ds, link, layout.num_actors, position, version)
        dispatcher.start()
        rollouts = Rollouts(args, link, dispatcher, lambda gs, counts: score_groups(gs, counts, policy.tokenizer, pool))

    run_t0, totals, eval_history = time.perf_counter(), Counter(), []
    for step in range(start_step, args.num_training_steps):
        t_step = time.perf_counter()
        if is_main and eval_ds is not None and args.eval_every and step % args.eval_every == 0:
            ev = rollouts.evaluate(eval_ds, layout.num_actors)  # the policy after `step` updates
            eval_history.append((step, ev["eval/pass@1"]))
            logger.log(step, ev, kind="eval")
            t_step = time.perf_counter()  # step time excludes evaluation
        evaluates = eval_ds is not None and args.eval_every and ((step + 1) % args.eval_every == 0
                                                                 or step + 1 == args.num_training_steps)
        out = one_step(args, layout, policy, rollouts, transfer, probe_ids, version, evaluates)
        agg, grad_norms, learner_tokens = out["agg"], out["grad_norms"], out["learner_tokens"]
        train_time, sync, streams = out["train_time"], out["sync"], out["streams"]
        version += 1
        if is_main:
            dispatcher.begin_step(version)  # the prompt gate moves on
            batch, actor_stats = out["batch"], out["actor_stats"]
            _, _, lags, first_lags = offpolicy_filter(batch, version - 1)  # the lag of what this step trained on
            metrics = {"time/data_wait": out["data_wait"], **rollout_metrics(batch, out["counts"], lags, first_lags,
                                                                            out["scored"], actor_stats, args)}
        if num_learners > 1:  # each learner trained its own bins: the step's numbers are sums over learners
            parts = broadcast_list([dict(agg, learner_tokens=learner_tokens)], groups["learners"], args.timeout_s,
                                   gather=True)
            agg = Counter()
            for part in parts:
                agg.update(part)  # update() adds and keeps negative sums (pg_loss), unlike Counter's +
            learner_tokens = agg.pop("learner_tokens")
        step_time = time.perf_counter() - t_step  # excludes evaluation and checkpointing (time/save)
        t = time.perf_counter()
        if args.save_steps and (step + 1) % args.save_steps == 0 or step + 1 == args.num_training_steps:
            save_checkpoint(args, policy.model, policy.tokenizer, policy.optimizer, policy.scheduler, step + 1,
                            dispatcher.position if is_main else 0, is_main, num_learners, groups, protect=latest)
        save_time = time.perf_counter() - t
        if is_main:
            metrics.update(train_metrics(agg, grad_norms, policy.scheduler.get_last_lr()[0], args))
            metrics.update({"time/train": train_time, "time/train_on_lent_cores": agg["lent_core_s"],
                            "time/weight_sync": sync["sync"], "time/step": step_time,
                            "sync/streamed": int(streams),
                            "time/save": save_time,
                            **{f"time/weight_{k}": sync[k] for k in ("gather", "drain", "transfer") if k in sync},
                            **({"sync/update_bytes": sync["bytes"]} if "bytes" in sync else {}),
                            "perf/learner_tokens_per_s": learner_tokens / max(train_time, 1e-9)})
            totals.update({"steps": 1, "step_time": step_time, "data_wait": metrics["time/data_wait"],
                           "learner_tokens": learner_tokens, "train_time": train_time, "sync_time": sync["sync"],
                           "lent_core_time": agg["lent_core_s"],
                           "save_time": save_time, "weight_updates": int(streams),
                           **{f"sync_{k}_time": sync.get(k, 0.0) for k in ("gather", "drain", "transfer")}})
            add_actor_totals(totals, actor_stats)
            logger.log(step + 1, metrics)
    finish_run(args, policy, layout, link, transfer, local_actor, dispatcher, rollouts, pool, logger, eval_ds, totals,
               eval_history, run_t0)
    return 0


def finish_run(args, policy, layout, link, transfer, local_actor, dispatcher, rollouts, pool, logger, eval_ds, totals,
               eval_history, run_t0) -> None:
    """The final model in output_dir (HF layout, as sft.py and dpo.py leave it: the next stage points
    here), then on learner 0 the final evaluation, the summary, and shutdown."""
    t = time.perf_counter()
    final_state = saved_state(args, policy.model, layout.num_learners)  # collective with several learners
    if not layout.is_main:
        return
    if args.lora_rank:
        save_final_adapter(args, policy, final_state)
    else:
        save_final_model(args, policy.model, policy.tokenizer, final_state, policy.bf16)
    print(f"[grpo] saved the final model ({'bf16' if policy.bf16 else 'fp32'}) to {args.output_dir} "
          f"in {time.perf_counter() - t:.1f}s", flush=True)
    del final_state
    if eval_ds is not None and args.eval_every:
        final = rollouts.evaluate(eval_ds, layout.num_actors)
        eval_history.append((args.num_training_steps, final["eval/pass@1"]))
        logger.log(args.num_training_steps, final, kind="eval")
    dispatcher.stop.set()
    dispatcher.join(timeout=10)
    link.close()
    last_stats = rollouts.take_stats() + link.final_stats(layout.num_actors, timeout_s=30.0)
    transfer.shutdown()  # the actors have stopped: the weight stream's group and store go
    add_actor_totals(totals, last_stats, loads_only=True)
    write_summary(args, totals, eval_history, run_t0, local_actor)
    pool.close()
    logger.close()
    if local_actor is not None:
        local_actor.shutdown()



def main():
    import chat_template

    args = chat_template.parse_stage_args(Args, UNSUPPORTED_FLAGS)
    if args.lr_scheduler_type not in ("constant", "linear"):
        raise SystemExit(f"--lr_scheduler_type {args.lr_scheduler_type}: grpo.py has constant and linear")
    if args.response_length_sampler == "exponential" and args.response_length_mean <= 0:
        raise ValueError("--response_length_sampler exponential needs --response_length_mean > 0")
    check_output_dir(args.output_dir, args.resume, args.overwrite_output_dir, int(os.environ.get("RANK", 0)) == 0)
    if args.lora_rank:  # a bad --lora_target_modules stops every rank now, not the engines once started
        lora_module_names(args, args.model_name_or_path)

    # ---------------------------------------------------------------------------------------------
    # Distributed setup plus the role split
    # ---------------------------------------------------------------------------------------------
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = f"cuda:{local_rank}" if use_cuda else "cpu"
    timeout = datetime.timedelta(seconds=args.timeout_s)
    num_learners = min(args.num_learners, world_size - 1) if world_size > 1 else 1
    if world_size > 1:  # roles by each node's process count, whatever order torchrun numbered the nodes in
        rank, local_learners, store = join_run(num_learners, timeout)
        os.environ["RANK"] = str(rank)
    is_learner = rank < num_learners
    gpus = None
    if use_cuda and world_size > 1 and not is_learner:  # this actor rank's engine: its own tensor-parallel GPUs
        first, gpus = engine_gpus(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_learners,
                                  args.vllm_tensor_parallel_size, torch.cuda.device_count())
        device = f"cuda:{first}"
    cores = None
    if world_size > 1 and not use_cuda and args.cpu_affinity:  # before gloo and vLLM start their threads
        cores = pin_cpu_cores(local_rank, not is_learner, args.vllm_tensor_parallel_size)
        print(f"[rank {rank}] pinned to CPU cores {cores}" if cores
              else f"[rank {rank}] not pinned to cores (alone on this node, fewer cores than ranks on it, "
                   "or VLLM_CPU_OMP_THREADS_BIND is set)", flush=True)
    if world_size > 1:
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    actor_ranks = list(range(num_learners, world_size))
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    groups = {}
    if world_size > 1:  # one gloo group per kind of traffic, so that two threads never share one
        link_ranks = [0] + actor_ranks
        # gloo caps every op at the group's timeout; each wait passes its own (shorter) one
        link_timeout = datetime.timedelta(seconds=max(args.timeout_s, args.startup_timeout_s))
        for name in ("prompts", "data", "weights"):
            groups[name] = dist.new_group(link_ranks, backend="gloo", timeout=link_timeout)
        # the other learners' first collective waits while learner 0 starts the engines (--startup_timeout_s)
        groups["learners"] = dist.new_group(list(range(num_learners)), timeout=link_timeout)
    latest = resume_checkpoint(args.output_dir, args.resume, rank == 0)
    if latest and not os.path.isfile(os.path.join(latest, "adapter_config.json" if args.lora_rank else "config.json")):
        raise SystemExit(f"--resume: {latest} holds a {'full model' if args.lora_rank else 'LoRA adapter'}; resume "
                         f"with the --lora_rank it was trained with")
    model_path = args.model_name_or_path if args.lora_rank else latest or args.model_name_or_path  # LoRA: the base

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_sigterm)
    if world_size > 1 and sys.platform == "linux":  # torchrun's agent killed -9: take this rank down too
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    if not is_learner:
        try:
            run_actor_rank(args, rank, 0, groups, device, model_path, cores, gpus)
        except KeyboardInterrupt:
            remove_adapter_roots()
            os._exit(130)
        except Exception:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    status = 1
    try:
        status = learner(args, Layout(rank, world_size, num_learners, device, groups, actor_ranks), latest, model_path)
    except KeyboardInterrupt as e:
        print(f"[rank {rank}] interrupted ({e}); exiting. The last checkpoint (if any) is intact.", file=sys.stderr,
              flush=True)
        status = 130
    except Exception as e:
        traceback.print_exc()
        print(f"[rank {rank}] FATAL: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    remove_adapter_roots()  # a colocated engine's
    os._exit(status)  # threads blocked in gloo or in vLLM must not keep the process alive



# -------------------------------------------------------------------------------------------------
# PLUMBING: messages between roles (gloo point-to-point with timeouts)
# -------------------------------------------------------------------------------------------------
def _wait(work, timeout_s: float, what: str, abort=None):
    """Wait for a gloo / NCCL op. `abort`, polled meanwhile, returns why to give up (an actor reported an
    error) or None: a stream to an engine that died must not hold learner 0 for the whole timeout."""
    deadline = time.monotonic() + timeout_s
    while abort is not None and not work.is_completed() and time.monotonic() < deadline:
        why = abort()
        if why:
            raise RuntimeError(f"{what} abandoned: {why}")
        time.sleep(0.0005)
    try:
        work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except Exception as e:  # gloo raises on timeout and when the peer's connection closes
        raise RuntimeError(f"{what} failed (peer dead or no answer within {timeout_s:.0f}s): {e}") from e


def send_obj(obj, dst: int, group, timeout_s: float):
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    _wait(dist.isend(torch.tensor([data.numel()]), dst, group=group), timeout_s, f"send to rank {dst}")
    _wait(dist.isend(data, dst, group=group), timeout_s, f"send to rank {dst}")


def recv_obj(src: int, group, timeout_s: float):
    size = torch.zeros(1, dtype=torch.int64)
    _wait(dist.irecv(size, src, group=group), timeout_s, f"receive from rank {src}")
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.irecv(data, src, group=group), timeout_s, f"receive from rank {src}")
    return pickle.loads(data.numpy().tobytes())


def broadcast_obj(obj, src: int, group, timeout_s: float):
    """Python object from `src` to every rank of `group` (callers other than src pass None)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if obj is not None else None
    size = torch.tensor([data.numel() if data is not None else 0])
    _wait(dist.broadcast(size, src, group=group, async_op=True), timeout_s, "broadcast (size)")
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.broadcast(data, src, group=group, async_op=True), timeout_s, "broadcast")
    return pickle.loads(data.numpy().tobytes())


def broadcast_list(obj, group, timeout_s, gather=False):
    """Among learners (rank 0 is the source). gather=True: every learner's list, concatenated."""
    if gather:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return [x for o in out for x in o]
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]



# -------------------------------------------------------------------------------------------------
# PLUMBING (the same block in sft.py, dpo.py and grpo.py): log-probabilities without the (T, V)
# logits tensor, and a memory plan printed before anything loads
# -------------------------------------------------------------------------------------------------
class ChunkedLogprobs(torch.autograd.Function):
    """Hidden states (N, H) and head weight (V, H) -> log p(target) (N,) and the entropy (N,) or None.

    The logits exist one chunk of `chunk_size` tokens at a time: the forward keeps only its inputs and
    each token's log-normalizer, and the backward recomputes each chunk's logits and turns them in place
    into the gradient (softmax subtracted from the target's one-hot). Peak memory is one chunk x V fp32
    tensor, never N x V: at 35,840 tokens and Olmo 3's 100,278-token vocabulary fp32 logits are 14 GB.
    Matmuls run in autocast's dtype when autocast is on (bf16), softmax and its sums in fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size: int, temperature: float, with_entropy: bool):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        logprobs, norms = hidden.new_empty(len(h), dtype=torch.float32), hidden.new_empty(len(h), dtype=torch.float32)
        entropy = hidden.new_empty(len(h), dtype=torch.float32) if with_entropy else None
        for i in range(0, len(h), chunk_size):
            logits = (h[i:i + chunk_size] @ w.T).float() / temperature  # (C, V)
            norms[i:i + chunk_size] = norm = torch.logsumexp(logits, -1)
            logprobs[i:i + chunk_size] = logits.gather(-1, targets[i:i + chunk_size, None])[:, 0] - norm
            if with_entropy:  # H = log Z - sum p * logit, the sum as a batched dot product (no second (C, V))
                probs = torch.softmax(logits, -1)
                entropy[i:i + chunk_size] = norm - (probs[:, None, :] @ logits[:, :, None]).view(-1)
        ctx.save_for_backward(h, w, targets, norms)
        ctx.chunk_size, ctx.temperature, ctx.dtypes = chunk_size, temperature, (hidden.dtype, weight.dtype)
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        h, w, targets, norms = ctx.saved_tensors
        step = ctx.chunk_size
        grad_hidden, grad_weight = torch.empty_like(h), torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for i in range(0, len(h), step):
            g = grad_logprobs[i:i + step].float()
            grad = (h[i:i + step] @ w.T).float().div_(ctx.temperature)  # the chunk's logits again (C, V)
            grad.sub_(norms[i:i + step, None]).exp_().mul_(-g[:, None])  # d/dlogits of logp: one-hot - softmax
            grad.scatter_add_(1, targets[i:i + step, None], g[:, None]).div_(ctx.temperature)
            grad = grad.to(h.dtype)
            grad_hidden[i:i + step] = grad @ w
            grad_weight += (grad.T @ h[i:i + step]).float()
        return grad_hidden.to(ctx.dtypes[0]), grad_weight.to(ctx.dtypes[1]), None, None, None, None


class ChunkedLogprobHead(torch.nn.Module):
    """The LM head, swapped in for `model.lm_head`: returns each position's log-probability of its target
    token (and, if asked, its entropy) through `ChunkedLogprobs` instead of the (B, T, V) logits.

    It holds the head's own weight Parameter, so parameter names (`lm_head.weight`), FSDP2 sharding, mixed
    precision and checkpoints are unchanged, and it runs inside the model's forward, where FSDP2 has
    gathered the weight. With `targets` None it is the plain linear head (generation, saving).
    """

    def __init__(self, head: torch.nn.Linear, chunk_size: int):
        super().__init__()
        if head.bias is not None:
            raise ValueError("the chunked LM head supports heads without a bias (every Olmo, Llama, Qwen)")
        self.weight, self.chunk_size = head.weight, chunk_size
        self.targets, self.temperature, self.with_entropy = None, 1.0, False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, T, 1 or 2)
        if self.targets is None:
            return torch.nn.functional.linear(hidden, self.weight)
        targets = self.targets.flatten().clamp(min=0)  # -100 (not trained) gathers any id; the caller masks it
        logprobs, entropy = ChunkedLogprobs.apply(hidden.flatten(0, 1), self.weight, targets, self.chunk_size,
                                                  self.temperature, self.with_entropy)
        columns = [logprobs, entropy] if self.with_entropy else [logprobs]
        return torch.stack([c.view(hidden.shape[:2]) for c in columns], -1)  # a new tensor, not a view


def install_chunked_head(model, chunk_size: int) -> ChunkedLogprobHead:
    """Swap the model's LM head for a ChunkedLogprobHead (before FSDP2 or DDP wrap it)."""
    head = model.get_output_embeddings()
    if not isinstance(head, ChunkedLogprobHead):
        head = ChunkedLogprobHead(head, chunk_size)
        model.set_output_embeddings(head)
    return head


def target_logprobs(model, input_ids, position_ids, targets, temperature: float = 1.0, with_entropy: bool = False):
    """log p(targets[b, t] | tokens <= t) (B, T) and the entropy (B, T) or None, through the chunked head.

    Packed rows need no mask: with `attention_mask=None`, transformers turns position ids that restart
    at 0 into a block-diagonal causal mask (masking_utils.find_packed_sequence_indices), and flash
    attention into its variable-length kernel, so a segment never attends to the one before it.
    """
    head = getattr(model, "module", model).get_output_embeddings()  # DDP keeps the model in .module
    if not isinstance(head, ChunkedLogprobHead):
        raise TypeError("call install_chunked_head(model, chunk_size) before wrapping the model")
    head.targets, head.temperature, head.with_entropy = targets, temperature, with_entropy
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits  # (B, T, 1 or 2)
    finally:
        head.targets = None
    return out[..., 0], (out[..., 1] if with_entropy else None)


def memory_plan(config, row_tokens: int, rows: int, num_shards: int, bf16: bool, checkpointing: bool,
                chunk_size: int, trained: bool = True, flash_attention: bool = False,
                fsdp: bool | None = None) -> dict[str, float]:
    """Bytes per rank of one training step, from the model config alone (nothing loads; the model is
    built on the meta device to count its parameters). A planning estimate, not an allocator trace:
    - weights: fp32 master weights, 4 B per parameter, split over `num_shards` FSDP2 ranks;
    - gradients (fp32, 4 B) and AdamW's two moments (8 B) of the trained parameters, split the same way
      (`trained` False: LoRA, whose adapters are small enough to leave out);
    - compute copy: bf16 weights cached by autocast (one rank) or gathered by FSDP2 (two decoder layers
      in flight, plus the root's embedding and head; `fsdp` defaults to num_shards > 1), 2 B per
      parameter (fp32 FSDP2: 4 B);
    - activations of one micro-batch (`rows` x `row_tokens` tokens): a decoder layer keeps about
      16 x hidden + 4 x intermediate values per token for its backward (the inputs of its matmuls,
      norms and activation); with checkpointing only each layer's input (hidden values per token)
      plus one layer's full set while it is recomputed;
    - attention mask: flash attention needs none; sdpa on packed rows builds a dense (T, T) boolean;
    - logits: `chunk_size` x vocab fp32 values, two live in a chunk's backward, plus the head's fp32
      gradient accumulator (vocab x hidden).
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in meta.parameters())  # a tied head is counted once
    root = meta.get_input_embeddings().weight.numel()
    if meta.get_output_embeddings().weight is not meta.get_input_embeddings().weight:
        root += meta.get_output_embeddings().weight.numel()
    layers, hidden, ffn = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    act_bytes, tokens = (2 if bf16 else 4), rows * row_tokens
    layer_acts = tokens * (16 * hidden + 4 * ffn) * act_bytes
    if (num_shards > 1 if fsdp is None else fsdp):
        compute_copy = (2 if bf16 else 4) * (2 * (params - root) / layers + root)
    else:
        compute_copy = 2 * params if bf16 else 0
    plan = {
        "weights": 4 * params / num_shards,
        "gradients": 4 * params / num_shards if trained else 0,
        "optimizer": 8 * params / num_shards if trained else 0,
        "compute_copy": compute_copy,
        "activations": layers * tokens * hidden * act_bytes + layer_acts if checkpointing else layers * layer_acts,
        "attention_mask": 0 if flash_attention else rows * row_tokens ** 2,
        "logits_chunk": 2 * 4 * min(chunk_size, tokens) * config.vocab_size + 4 * config.vocab_size * hidden,
    }
    plan["total"] = sum(plan.values())
    return plan


def device_memory_bytes(device, local_world_size: int) -> int:
    """What one rank may use: the GPU's memory, or on CPU the machine's RAM split over the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_world_size)


def check_memory_plan(plan: dict, available: int, knobs: str) -> str:
    """The plan as one line; stops the run before anything loads when it cannot fit the device."""
    gib = 2 ** 30
    line = (", ".join(f"{k} {v / gib:.2f}" for k, v in plan.items())
            + f" GiB per rank; {available / gib:.1f} GiB available")
    if plan["total"] > available:
        raise SystemExit(f"memory plan: {line}.\nIt does not fit. Change one of: {knobs}.")
    return f"memory plan: {line}"



# -------------------------------------------------------------------------------------------------
# PLUMBING: the cost model (MFU / MBU of the engines), counted from first principles
# -------------------------------------------------------------------------------------------------
@dataclass
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, c):
        heads = c.num_attention_heads
        return cls(c.hidden_size, c.num_hidden_layers, heads, getattr(c, "num_key_value_heads", None) or heads,
                   getattr(c, "head_dim", None) or c.hidden_size // heads, c.intermediate_size, c.vocab_size)

    def matmul_params(self) -> int:
        """Parameters of the per-layer matmuls (q, k, v, o and the gated MLP); no norms, no embeddings."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (h * q + 2 * h * kv + q * h + 3 * h * self.intermediate)

    def kv_bytes_per_token(self, bytes_per_el: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_el  # K and V, every layer


def forward_flops(s: ModelShape, num_tokens: int, attended_sum: int, num_sampled: int) -> int:
    """2 x matmul params per token, 4 x layers x heads x head_dim per (query, key) pair for QK^T and
    AV, 2 x hidden x vocab per token that goes through the LM head (the sampled positions)."""
    return (2 * s.matmul_params() * num_tokens + 4 * s.layers * s.heads * s.head_dim * attended_sum
            + 2 * s.hidden * s.vocab * num_sampled)


def prefill_cost(s: ModelShape, prompt_len: int, bytes_per_el: int, cached: int = 0) -> tuple[int, int]:
    """(FLOPs, bytes other than weights) of a prefill: causal, so query i attends to i keys, sum =
    p(p+1)/2 (about half of p^2); one sampled position; the prompt's KV is written. The first `cached`
    tokens came from the prefix cache: only queries cached+1..p run (each still attends to every key
    before it) and only their KV is written."""
    p, c = prompt_len, cached
    return forward_flops(s, p - c, (p * (p + 1) - c * (c + 1)) // 2, 1), (p - c) * s.kv_bytes_per_token(bytes_per_el)


def decode_cost(s: ModelShape, context: int, bytes_per_el: int) -> tuple[int, int]:
    """(FLOPs, bytes other than weights) of one decode token attending to `context` tokens (itself
    included): reads context-1 cached tokens' KV and writes its own."""
    return forward_flops(s, 1, context, 1), context * s.kv_bytes_per_token(bytes_per_el)


def weight_bytes(s: ModelShape, bytes_per_el: int) -> int:
    """Weights read by one forward pass: the matmuls and the LM head (embedding rows are gathered)."""
    return (s.matmul_params() + s.hidden * s.vocab) * bytes_per_el


def engine_step_cost(s: ModelShape, prefill_lens: list[int], decode_contexts: list[int], bytes_per_el: int,
                     num_engine_steps: int = 1) -> tuple[int, int]:
    """(FLOPs, bytes) of `num_engine_steps` engine steps that together ran these prefills and decode
    tokens. A continuous batch shares one read of the weights per engine step across all running
    sequences: weights are counted once per step, never once per sequence."""
    flops = nbytes = 0
    for p in prefill_lens:  # a length, or (length, tokens found in the prefix cache)
        length, cached = p if isinstance(p, tuple) else (p, 0)
        f, b = prefill_cost(s, length, bytes_per_el, cached)
        flops, nbytes = flops + f, nbytes + b
    for c in decode_contexts:
        f, b = decode_cost(s, c, bytes_per_el)
        flops, nbytes = flops + f, nbytes + b
    if prefill_lens or decode_contexts:
        nbytes += num_engine_steps * weight_bytes(s, bytes_per_el)
    return flops, nbytes


# name substring -> (peak dense bf16 FLOP/s, peak memory B/s), from the datasheets
GPU_PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}


def measure_peaks(device, reps: int = 6, dtype: torch.dtype = torch.float32) -> tuple[float, float, str]:
    """(peak FLOP/s, peak memory B/s, their source) of one device as this process uses it.

    Known GPUs: the datasheet. Otherwise measured with the threads this process runs on (so call it
    after pinning): a 1536^3 matmul in the compute dtype (a CPU with avx512_bf16 multiplies bf16 about twice
    as fast as fp32) and a 256 MiB copy (read + write), each the best of `reps`,
    since a busy machine slows some repetitions and never speeds one up. A measured peak is still only a
    lower bound of the true one; the stages raise it to any higher rate they achieve, so MFU <= 1.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (flops, bandwidth) in GPU_PEAKS.items():
            if key in name:
                return flops, bandwidth, f"datasheet bf16 dense peaks of {name}"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def best_seconds(fn) -> float:
        fn()  # warm up
        times = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    n = 1536
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n ** 3 / best_seconds(lambda: torch.mm(a, b))
    x = torch.empty(64 * 2 ** 20, device=device)  # 256 MiB of fp32: larger than any cache
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / best_seconds(lambda: y.copy_(x))
    return flops, bandwidth, (f"measured on {device.type} with {torch.get_num_threads()} threads: "
                              f"{str(dtype).removeprefix('torch.')} {n}^3 matmul and a 256 MiB copy, best of {reps}")


def resolve_peaks(peak_flops: float, peak_bw: float, device: str = "cpu", measure=None) -> tuple[float, float, str]:
    """--peak_flops / --peak_memory_bandwidth when given (> 0), else measured for the missing ones: by `measure()`
    (an engine's: engine_peaks of its workers' measurements), or measure_peaks(device) in this process."""
    if peak_flops > 0 and peak_bw > 0:
        return peak_flops, peak_bw, "given (--peak_flops, --peak_memory_bandwidth)"
    f, b, src = measure() if measure is not None else measure_peaks(device)
    return ((peak_flops if peak_flops > 0 else f), (peak_bw if peak_bw > 0 else b),
            src + (" (one peak given)" if peak_flops > 0 or peak_bw > 0 else ""))


def engine_peaks(worker_peaks: list[tuple[float, float, str]]) -> tuple[float, float, str]:
    """One engine's peaks from its workers' (FLOP/s, B/s, source): their sums. A tensor-parallel engine's workers
    each compute their share of every step's FLOPs and read their share of the weights, on their own cores or GPU,
    and engine_step_cost counts the whole model: its MFU divides by all of them (one GPU's datasheet peak for an
    engine of two overstated its MFU twice)."""
    if not worker_peaks:
        raise ValueError("an engine without workers has no peaks")
    n, source = len(worker_peaks), worker_peaks[0][2]
    return (sum(f for f, _, _ in worker_peaks), sum(b for _, b, _ in worker_peaks),
            f"{source}, in the engine's worker" if n == 1 else f"{source}, in each of the engine's {n} workers, summed")


def static_waste(lengths: list[int]) -> float:
    """Compute wasted by a static batch: (max length - mean length) / max length (Olmo 3 sec 4.4)."""
    if not lengths or max(lengths) == 0:
        return 0.0
    return (max(lengths) - sum(lengths) / len(lengths)) / max(lengths)


class EngineMeter:
    """One engine's accounting for the metrics: the FLOPs, bytes and tokens of its steps (engine_step_cost), its
    busy, idle and occupied seconds, static batches' waste, and the peaks MFU and MBU divide by. `stats` holds the
    counts since the last `take()` (the delta each finished group carries to learner 0).

    What perf/actor_mfu counts: the model FLOPs of the work the engine did (2 x matmul parameters per token, the
    attention's QK^T and AV, the LM head at sampled positions only; each sample's prompt prefill as vLLM ran it:
    prompt tokens it served from its prefix cache (num_cached_tokens) cost nothing, so a group's samples share a
    prefill exactly as far as vLLM's cache shared it), over wall seconds (idle time and weight waits included: the
    busy share is perf/actor_occupancy's business) x the peak of the cores or GPUs the engine's workers compute on
    (engine_peaks). On SmolLM2-135M a generated token cost about 412M FLOPs in a first RL step (4 x 4 samples of
    ~100-token prompts): 269M of decode (2 x 134.5M parameters, the tied head once), the rest prefills."""

    def __init__(self, config, dtype: torch.dtype, max_num_seqs: int, peak_device: str):
        self.shape, self.bytes_per_el = ModelShape.from_config(config), dtype.itemsize
        self.max_num_seqs, self.peak_device = max_num_seqs, peak_device
        self.stats, self.stats_t = Counter(), time.perf_counter()
        self.static_lens = []  # response lengths of the running static batch
        self.peak_flops = self.peak_bw = self.peak_source = None  # measured in start(), on the cores it runs on

    def start(self, peak_flops: float, peak_bw: float, measure=None):
        """Peaks given (> 0) or measured: `measure()` (the engine's workers: Actor.run), else in this process."""
        self.peak_flops, self.peak_bw, self.peak_source = resolve_peaks(peak_flops, peak_bw, self.peak_device, measure)
        self.run_totals, self.run_t0 = Counter(), time.perf_counter()

    def engine_steps(self, prefill: list[tuple[int, int]], decode_ctx: list[int], steps: int):
        """What `steps` engine steps computed: these prefills (length, cached) and decode tokens (their context)."""
        flops, nbytes = engine_step_cost(self.shape, prefill, decode_ctx, self.bytes_per_el, steps)
        self.stats["flops"] += flops
        self.stats["bytes"] += nbytes
        self.stats["gen_tokens"] += len(decode_ctx) + len(prefill)
        self.stats["prefill_tokens"] += sum(p - cached for p, cached in prefill)

    def idle(self, seconds: float, tools_running: bool):
        self.stats["idle_s"] += seconds
        self.stats["tool_window_s"] += seconds * tools_running

    def busy(self, seconds: float, running: int, tools_running: bool, batch_done: bool):
        """An engine step of `seconds` with `running` sequences; `batch_done`: nothing runs after it (a static batch
        has finished)."""
        if batch_done and self.static_lens:
            self.stats["static_waste_sum"] += static_waste(self.static_lens)
            self.stats["static_waste_n"] += 1
            self.static_lens = []
        self.stats["occupancy_s"] += seconds * running / self.max_num_seqs
        self.stats["busy_s"] += seconds
        if tools_running:  # the engine's occupancy while some episode waits on its tools
            self.stats["tool_window_s"] += seconds
            self.stats["tool_window_occupancy_s"] += seconds * running / self.max_num_seqs

    def take(self, actor_id: int) -> dict:
        now = time.perf_counter()
        # MFU, MBU <= 1 with measured peaks: a run whose average rate so far beats one proves the engine's
        # peak is at least that rate. The run's totals, not this delta's: an engine step's work can land
        # in a delta shorter than the step. Peaks given by the user (--peak_flops) are kept as given.
        self.run_totals.update({"flops": self.stats["flops"], "bytes": self.stats["bytes"]})
        if not self.peak_source.startswith("given"):
            elapsed = max(now - self.run_t0, 1e-9)
            self.peak_flops = max(self.peak_flops, self.run_totals["flops"] / elapsed)
            self.peak_bw = max(self.peak_bw, self.run_totals["bytes"] / elapsed)
        s = dict(self.stats, actor=actor_id, elapsed=now - self.stats_t, peak_flops=self.peak_flops,
                 peak_bw=self.peak_bw, peak_source=self.peak_source, max_num_seqs=self.max_num_seqs)
        self.stats.clear()  # in place: the actor and its tool episodes count into the same Counter
        self.stats_t = now
        return s



# -------------------------------------------------------------------------------------------------
# PLUMBING: devices and CPU cores of each rank
# -------------------------------------------------------------------------------------------------
def assign_roles(procs: list[tuple[int, int]], num_learners: int) -> list[int]:
    """The role rank of each torchrun process, given each one's (node, local rank) in torchrun's rank order: ranks
    [0, num_learners) learn, the rest are actors. Learners take whole nodes, the largest first that still fit in what
    is left, then the first local ranks of the next largest node; the others drive engines. So README's two-node
    launch (a node of 8 for 8 learners, a node of 4 engines) gives the same roles whatever order the nodes join in:
    torchrun's c10d rendezvous ignores --node-rank and numbers nodes by host name. On one node: ranks as torchrun's."""
    sizes = Counter(node for node, _ in procs)
    order = sorted(sizes, key=lambda n: (-sizes[n], n))
    left, whole = num_learners, set()
    for n in order:
        if sizes[n] <= left:
            whole.add(n)
            left -= sizes[n]
    rest = sorted((i for i, (n, _) in enumerate(procs) if n not in whole),
                  key=lambda i: (order.index(procs[i][0]), procs[i][1]))
    learners = sorted([i for i, (n, _) in enumerate(procs) if n in whole] + rest[:left])
    actors = sorted(rest[left:])
    roles = [0] * len(procs)
    for role, i in enumerate(learners + actors):
        roles[i] = role
    return roles


def join_run(num_learners: int, timeout) -> tuple[int, int, object]:
    """torchrun's processes agree on their roles (assign_roles, from each one's node and local rank, shared
    through torchrun's store). Returns (role rank, learners on this node, a store for the process group)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    here = (int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)))
    shared = dist.PrefixStore("grpo_roles", store)
    shared.set(str(rank), f"{here[0]} {here[1]}")
    procs = [tuple(map(int, shared.get(str(r)).decode().split())) for r in range(world_size)]
    roles = assign_roles(procs, num_learners)
    local_learners = sum(1 for p, role in zip(procs, roles) if p[0] == here[0] and role < num_learners)
    return roles[rank], local_learners, dist.PrefixStore("grpo", store)


def engine_gpus(local_rank: int, local_world: int, local_learners: int, tp: int, device_count: int) -> tuple[int, str]:
    """(this process's device index, CUDA_VISIBLE_DEVICES for its engine) of an actor rank. A node's learners are its
    first local ranks (assign_roles) and take its first GPUs, one each; its actor ranks follow and each takes the next
    `tp` GPUs for its engine (vLLM starts one worker per GPU)."""
    first = local_learners + (local_rank - local_learners) * tp
    need = local_learners + (local_world - local_learners) * tp
    if need > device_count:
        raise SystemExit(f"this node has {device_count} GPUs, but its {local_learners} learner rank(s) and "
                         f"{local_world - local_learners} engine(s) of --vllm_tensor_parallel_size {tp} need {need}: "
                         "run torchrun --nproc-per-node = learners + engines on the node")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else [str(i) for i in range(device_count)]
    return first, ",".join(physical[first:first + tp])


TORCHRUN_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID"]


def split_cores(cores: list[int], local_rank: int, local_world_size: int) -> list[int] | None:
    """This rank's contiguous share of the node's cores (the first ranks get one more when they do not
    divide evenly); None when there are fewer cores than ranks (then nothing is pinned)."""
    if local_world_size < 2 or len(cores) < local_world_size:
        return None
    base, extra = divmod(len(cores), local_world_size)
    start = local_rank * base + min(local_rank, extra)
    return cores[start:start + base + (local_rank < extra)]


def omp_bind(cores: list[int], tensor_parallel: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `tensor_parallel` workers on `cores`: each worker its own share
    ("0|1"), or every worker all of them when there are fewer cores than workers."""
    return "|".join(",".join(map(str, split_cores(cores, i, tensor_parallel) or cores)) for i in range(tensor_parallel))


def pin_cpu_cores(local_rank: int, is_actor: bool, tensor_parallel: int = 1) -> list[int] | None:
    """CPU torchrun runs: this rank's share of the cores. Measured on 2 cores, 1 learner + 1 actor:
    unpinned, vLLM's engine-core process spins on sched_yield while its worker computes, the two take
    both cores, and the learner's step ran 5-17x slower than alone; pinned, the learner runs at its
    solo speed and the engine generates as fast on its one core as it did on two. A learner pins
    itself now, before gloo starts threads (they inherit it). An actor only tells vLLM's worker where
    to bind its OpenMP threads, and pins itself and vLLM's processes once the engine is up
    (pin_process_tree): the engine's start (two processes importing and loading) took 43 s on one
    core against 32 s unpinned, while the learner waits for it anyway.
    An actor with no share of its own (alone on its node in a multi-node launch, or on a node with fewer cores
    than ranks) still binds a tensor-parallel engine's workers, each to its share of all the node's cores: vLLM's
    "auto" binding gives each worker a NUMA node of its own and refuses to start with fewer nodes than workers."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if is_actor and os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return None  # the user binds vLLM's threads themselves
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    mine = split_cores(cores, local_rank, local_world)
    if mine is None and is_actor and tensor_parallel > 1 and cores:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(cores, tensor_parallel)
        return cores if local_world == 1 else None  # alone: the node's cores are its own; else it shares them
    if mine is None:
        return None  # alone on the node, or too few cores to split
    if is_actor:  # vLLM's "auto" binding would hold one core back for its scheduler
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(mine, tensor_parallel)
    else:
        os.sched_setaffinity(0, mine)
    return mine


class IdleCores:
    """One learner pinned beside actor ranks on this machine (CPU): while an actor's engine has nothing to run, the
    learner computes on that actor's cores too, and gives them back as soon as it runs again. Measured with
    SmolLM2-135M on 2 cores, 1 learner + 1 actor: the learner trained 55-75 s a step on its core while the actor
    generated the next step's samples in 27-50 s, then waited on the off-policy bound (--async_steps); alone, the
    learner trained 98 tokens/s on one core and 142-170 on two. The learner adjusts before each forward pass (a
    pass is 1.5-4 s here), so an engine that starts again shares its core with the learner for at most one pass.
    Learner 0 hears the actors' idle and busy messages (Actor._say_idle) in `link`; None: never lends. Off by default
    (--lend_idle_cores): in RL the learner gained 2-8% tokens/s with it, and lost 10-20% beside --release_ahead."""

    def __init__(self, link: "Link | None"):
        self.link = link
        self.own = sorted(os.sched_getaffinity(0)) if link is not None else []
        self.threads = torch.get_num_threads()  # its own (torchrun's OMP_NUM_THREADS); one more per lent core
        self.now, self.since, self.lent_s = self.own, None, 0.0

    def adjust(self):
        if self.link is None:
            return
        lent = sorted({c for cores in list(self.link.idle_cores.values()) for c in cores} - set(self.own))
        self._use(self.own + lent)

    def restore(self) -> float:
        """Back to this learner's own cores; the seconds it computed on lent ones since the last restore."""
        if self.link is not None:
            self._use(self.own)
        lent_s, self.lent_s = self.lent_s, 0.0
        return lent_s

    def _use(self, cores: list[int]):
        if cores == self.now:
            return
        if self.since is not None:
            self.lent_s += time.perf_counter() - self.since
        self.since = time.perf_counter() if len(cores) > len(self.own) else None
        for tid in os.listdir("/proc/self/task"):  # every thread: the compute pool's were made on the own cores
            with contextlib.suppress(OSError):  # a thread may end meanwhile
                os.sched_setaffinity(int(tid), cores)
        torch.set_num_threads(self.threads + len(cores) - len(self.own))
        self.now = cores


def pin_threads(processes: list, cores: list[int]):
    """Pin every thread of these psutil processes to `cores`, but for those bound within them already (a
    tensor-parallel engine's workers, each to its share: omp_bind)."""
    import psutil  # a vLLM dependency

    for proc in processes:
        with contextlib.suppress(psutil.Error, OSError):  # a thread or process may end meanwhile
            for th in proc.threads():
                with contextlib.suppress(OSError):
                    if not os.sched_getaffinity(th.id) <= set(cores):
                        os.sched_setaffinity(th.id, cores)


def pin_process_tree(cores: list[int]):
    """Pin every thread of this process and of its descendants (vLLM's engine core and worker)."""
    import psutil

    me = psutil.Process()
    pin_threads([me, *me.children(recursive=True)], cores)



# -------------------------------------------------------------------------------------------------
# PLUMBING: metrics, the run summary, checkpoints
# -------------------------------------------------------------------------------------------------
class MetricsLogger:
    """One line to stdout, one JSON dict to metrics.jsonl and (optionally) wandb, per step."""

    def __init__(self, args: Args, append: bool = False):
        os.makedirs(args.output_dir, exist_ok=True)  # append: a resumed run goes on with the same file
        self.file = open(os.path.join(args.output_dir, "metrics.jsonl"), "a" if append else "w")
        self.wandb, self.k = None, args.eval_num_samples
        self.every, self.last = max(1, args.logging_steps), args.num_training_steps
        if args.report_to == "wandb":
            import wandb

            # wandb's own mode: WANDB_MODE when set, else online when logged in, else offline
            mode = (None if os.environ.get("WANDB_MODE")
                    else "online" if wandb.login(prompt=False, verify=False) else "offline")
            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=args.run_name,
                                    config=dataclasses.asdict(args), dir=args.output_dir, mode=mode)

    def log(self, step: int, metrics: dict, kind: str = "train"):
        rec = {"step": step, "kind": kind, "time": time.time(), **metrics}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if kind != "eval" and step % self.every and step != self.last:
            return
        g = metrics.get
        line = f"step {step}"
        if "rollout/reward" in metrics:
            line += (f" | reward {g('rollout/reward'):.3f} solve {g('rollout/solve_rate'):.2f}"
                     f" len {g('rollout/response_length'):.0f}"
                     f" | prompts {g('rollout/prompts_consumed')} (solved {g('rollout/filtered_all_solved')}"
                     f", failed {g('rollout/filtered_all_failed')})"
                     f" stale {g('rollout/groups_dropped_stale')} lag {g('rollout/lag_mean', 0):.2f}"
                     f" | loss {g('train/loss'):.4f} clip {g('train/clip_fraction'):.3f}"
                     f" gnorm {g('train/grad_norm'):.3f}"
                     f" | step {g('time/step'):.1f}s data {g('time/data_wait'):.1f}s sync {g('time/weight_sync'):.2f}s"
                     f" probe {g('sync/probe_max_abs_diff'):.1e} | gen {g('perf/actor_tokens_per_s'):.0f} tok/s"
                     f" occ {g('perf/actor_occupancy'):.2f} mfu {g('perf/actor_mfu'):.4f}"
                     f" mbu {g('perf/actor_mbu'):.4f}")
        if "eval/pass@1" in metrics:
            line += f" | eval pass@1 {g('eval/pass@1'):.3f} pass@{self.k} {g(f'eval/pass@{self.k}'):.3f}"
        print(line, flush=True)

    def close(self):
        self.file.close()
        if self.wandb:
            self.wandb.finish()


def sum_actor_stats(stats_list: list[dict]) -> Counter:
    """The actors' stats deltas summed (the probe's diffs: their max), with each engine's elapsed x peak (MFU and
    MBU divide by their sum: a mean over engines), and per engine A its tokens (`tokens/A`), seconds
    (`elapsed/A`) and whether it loaded a streamed update (`loaded/A`)."""
    s = Counter()
    for st in stats_list:
        for k, v in st.items():
            if isinstance(v, (int, float)) and k not in ("actor", "peak_flops", "peak_bw", "max_num_seqs",
                                                          "probe_mean_abs_diff", "probe_max_abs_diff"):
                s[k] += v
        s["peak_flops_s"] += st["elapsed"] * st["peak_flops"]
        s["peak_bw_s"] += st["elapsed"] * st["peak_bw"]
        s["probe_mean"] = max(s["probe_mean"], st.get("probe_mean_abs_diff", 0.0))
        s["probe_max"] = max(s["probe_max"], st.get("probe_max_abs_diff", 0.0))
        s[f"tokens/{st['actor']}"] += st.get("gen_tokens", 0)
        s[f"elapsed/{st['actor']}"] += st["elapsed"]
        if st.get("weight_loads"):
            s[f"loaded/{st['actor']}"] = 1
    return s


def engines_tokens_per_s(s: Counter, prefix: str = "") -> float:
    """Engines run side by side: the rate is the sum of each engine's tokens over its own time, not all
    tokens over all engines' time (their mean)."""
    head = f"{prefix}tokens/"
    return sum(v / max(s[f"{prefix}elapsed/{k[len(head):]}"], 1e-9) for k, v in s.items() if k.startswith(head))


def add_actor_totals(totals: Counter, stats_list: list[dict], loads_only: bool = False) -> None:
    """Add a step's actor stats deltas to the run's totals for the summary (keys `actor_*`, and
    `weight_loaded/A` for each engine that loaded a streamed update). loads_only: only the loads, from the
    stats that no consumed group carried (the last updates; their seconds are the shutdown, not generation)."""
    s = sum_actor_stats(stats_list)
    for k, v in s.items():
        if k.startswith("loaded/"):
            totals[f"weight_{k}"] = 1
        elif (not loads_only or k in ("weight_loads", "weight_load_s")) and k not in ("probe_mean", "probe_max"):
            totals[f"actor_{k}"] += v
    if stats_list and not loads_only:  # the latest peaks, assigned (a Counter's update() would add them)
        for k in ("peak_source", "peak_flops", "peak_bw"):
            totals[k] = stats_list[-1][k]


def write_summary(args, totals: Counter, eval_history, run_t0, local_actor):
    steps = max(totals["steps"], 1)
    summary = {
        "args": dataclasses.asdict(args), "steps": totals["steps"], "wall_s": time.perf_counter() - run_t0,
        "mean_step_time_s": totals["step_time"] / steps, "mean_data_wait_s": totals["data_wait"] / steps,
        "mean_weight_sync_s": totals["sync_time"] / steps, "weight_updates": totals["weight_updates"],
        **{f"mean_weight_{k}_s": totals[f"sync_{k}_time"] / steps for k in ("gather", "drain", "transfer")},
        "mean_weight_load_s": totals["actor_weight_load_s"] / max(totals["actor_weight_loads"], 1),
        "engines_loaded": sum(1 for k in totals if k.startswith("weight_loaded/")),
        "generated_tokens_per_s": engines_tokens_per_s(totals, "actor_"),
        "learner_tokens_per_s": totals["learner_tokens"] / max(totals["train_time"], 1e-9),
        "learner_share_on_lent_cores": totals["lent_core_time"] / max(totals["train_time"], 1e-9),
        "actor_mfu": totals["actor_flops"] / max(totals["actor_peak_flops_s"], 1e-9),
        "actor_mbu": totals["actor_bytes"] / max(totals["actor_peak_bw_s"], 1e-9),
        "actor_occupancy": totals["actor_occupancy_s"] / max(totals["actor_elapsed"], 1e-9),
        "actor_weight_wait_s": totals["actor_idle_s"] + totals["actor_drain_s"] + totals["actor_weight_load_s"],
        "learner_data_wait_s": totals["data_wait"],
        "static_wasted_fraction": (totals["actor_static_waste_sum"] / totals["actor_static_waste_n"]
                                   if totals["actor_static_waste_n"] else None),
        "peak_source": (local_actor.meter.peak_source if local_actor
                        else totals.get("peak_source", "see metrics.jsonl perf/peak_source")),
        "peak_flops": local_actor.meter.peak_flops if local_actor else totals.get("peak_flops"),
        "peak_memory_bandwidth": local_actor.meter.peak_bw if local_actor else totals.get("peak_bw"),
        "mean_save_time_s": totals["save_time"] / steps,
        "eval_pass@1": [{"step": s, "pass@1": p} for s, p in eval_history],
    }
    path = os.path.join(args.output_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"[grpo] {summary['steps']} steps in {summary['wall_s']:.0f}s: {summary['generated_tokens_per_s']:.0f} "
          f"generated and {summary['learner_tokens_per_s']:.0f} trained tokens/s, actor MFU {summary['actor_mfu']:.3f} "
          f"MBU {summary['actor_mbu']:.3f} occupancy {summary['actor_occupancy']:.2f}; the rest in {path}", flush=True)


def saved_state(args, model, num_learners: int) -> dict | None:
    """ALL learners (a collective with several): what a checkpoint and the final save hold, the LoRA adapter's
    tensors (fp32) or the full model's state."""
    return adapter_state(model, torch.float32) if args.lora_rank else gather_full_state(model, num_learners)


def gather_full_state(model, num_learners: int) -> dict | None:
    """The full (unsharded) state dict on learner 0, on CPU; collective with several learners."""
    if num_learners == 1:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.get_rank() == 0 else None


def load_optimizer(model, optimizer, state, num_learners):
    """The optimizer's state from a checkpoint, which another number of learners may have saved: one learner saves
    the optimizer's own state dict (parameters by index), several the full state by parameter name (FSDP2 keeps
    the names)."""
    if num_learners == 1:  # it maps the saved parameters to its own by position, whatever their keys
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not isinstance(state["param_groups"][0]["params"][0], str):  # saved by one learner: by index
        names = [name for name, p in model.named_parameters() if p.requires_grad]  # the optimizer's order
        state = renamed_optimizer_state(state, dict(enumerate(names)))
    # Every learner read the full state from disk, so each only keeps its own shard. No broadcast:
    # broadcast_from_rank0 broadcasts on the default group, which holds the actor ranks too, and hung.
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def renamed_optimizer_state(state: dict, keys: dict) -> dict:
    """An optimizer state dict with its parameters' keys mapped through `keys` (indices to names)."""
    return {"state": {keys[k]: v for k, v in state["state"].items()},
            "param_groups": [dict(group, params=[keys[k] for k in group["params"]]) for group in state["param_groups"]]}


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint. Complete = renamed from its temp dir, so half-written `.tmp-*` dirs
    never count."""
    root = os.path.join(output_dir, "checkpoints")
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(path, "training_state.pt")):
            return path
    steps = [d for d in os.listdir(root) if d.startswith("step_")] if os.path.isdir(root) else []
    steps = [d for d in steps if os.path.isfile(os.path.join(root, d, "training_state.pt"))]
    return os.path.join(root, max(steps, key=lambda d: int(d.split("_")[1]))) if steps else None


def resume_checkpoint(output_dir: str, resume: bool, is_main: bool) -> str | None:
    """The checkpoint this run continues from: with --resume, the latest complete one; None without --resume
    or when there is none yet (the run starts fresh, so a preemptible job can always pass --resume)."""
    latest = latest_checkpoint(output_dir) if resume else None
    if resume and latest is None and is_main:
        print(f"--resume: no checkpoint in {output_dir}/checkpoints, starting from scratch", flush=True)
    return latest


def fsync_dir(path: str) -> None:
    """Flush every file under `path` and the directory entries themselves to disk (plumbing)."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def check_output_dir(output_dir: str, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Never mix two runs in one directory. A previous run's checkpoints or metrics there stop this one
    unless --resume (continue it; with no checkpoint yet it starts fresh, so a preemptible job can
    always pass it) or --overwrite_output_dir (start over: rank 0 deletes them first)."""
    if resume and overwrite:
        raise SystemExit("--resume continues the run in output_dir and --overwrite_output_dir deletes it: pass one")
    found = [n for n in ("checkpoints", "metrics.jsonl") if os.path.exists(os.path.join(output_dir, n))]
    if not found or resume:
        return
    if not overwrite:
        raise SystemExit(f"{output_dir} holds a previous run ({', '.join(found)}): pass --resume to continue it, "
                         "--overwrite_output_dir to start over (deletes its checkpoints), or another --output_dir")
    if is_main:
        for name in found:
            path = os.path.join(output_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def publish_checkpoint(root: str, tmp: str, name: str) -> None:
    """Make the complete temp dir `tmp` the checkpoint `name`: fsync it, rename it, then move `latest`
    (each step atomic and on disk before the next, so a crash anywhere leaves a loadable latest)."""
    fsync_dir(tmp)
    final = os.path.join(root, name)
    if os.path.exists(final):  # the same step saved again (after a resume): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    fd = os.open(root, os.O_RDONLY)  # the renames themselves
    os.fsync(fd)
    os.close(fd)


def prune_checkpoints(root: str, keep: int, protect: str | None = None) -> None:
    """Delete all but the newest `keep` checkpoints (keep <= 0: delete none). Never the one `latest` names, nor
    `protect` (the one this run resumed from: a resumed run that goes wrong can still go back to it)."""
    if keep <= 0:
        return
    steps = sorted((d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()), key=lambda d: int(d[5:]))
    spared = {os.path.abspath(p) for p in (protect, latest_checkpoint(os.path.dirname(root))) if p}
    for name in steps[:-keep]:
        if os.path.abspath(os.path.join(root, name)) not in spared:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_final_model(args, model, tokenizer, state: dict, bf16: bool) -> None:
    """Weights (bf16 when training in bf16, else fp32), config, tokenizer and chat template, in output_dir."""
    import chat_template

    dtype = torch.bfloat16 if bf16 else torch.float32
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if args.chat_template:  # the template trained with goes with the model, so inference renders the same way
        tokenizer.chat_template = chat_template.get_template(args.chat_template)
    model.save_pretrained(args.output_dir, state_dict=state)
    config = copy.deepcopy(model.config)  # save_pretrained names the live model's dtype: name the saved one
    config.dtype = dtype
    config.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)


def save_final_adapter(args, policy: Policy, adapter: dict) -> None:
    """LoRA: the adapter (peft directory) in output_dir/adapter, and base + adapter merged as the final model in
    output_dir (save_final_model), where the next stage points. Merged once, here, on CPU from the fp32 base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = os.path.join(args.output_dir, "adapter")
    write_adapter(adapter_dir, policy.model.peft_config["default"], adapter)
    base = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    save_final_model(args, merged, policy.tokenizer, merged.state_dict(), policy.bf16)


def save_checkpoint(args, model, tokenizer, optimizer, scheduler, step, position, is_main, num_learners, groups,
                    protect=None):
    """HF directory (LoRA: the peft adapter's) + tokenizer + training_state.pt, written to a temporary directory,
    fsynced and renamed (publish_checkpoint), so a crash mid-write never leaves a half checkpoint behind as the
    latest one. Then all but the newest --keep_last_n_checkpoints go, never `protect` (the one this run resumed
    from)."""
    lora = args.lora_rank > 0
    state = saved_state(args, model, num_learners)
    if num_learners == 1:
        opt_state = optimizer.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opt_state = get_optimizer_state_dict(model, optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    root = os.path.join(args.output_dir, "checkpoints")
    name, tmp = f"step_{step}", os.path.join(root, f".tmp-step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if lora:
        write_adapter(tmp, model.peft_config["default"], state)
    else:
        model.save_pretrained(tmp, state_dict=state)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": opt_state, "scheduler": scheduler.state_dict(), "step": step, "sampler_position": position,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                "args": dataclasses.asdict(args)}, os.path.join(tmp, "training_state.pt"))
    publish_checkpoint(root, tmp, name)
    prune_checkpoints(root, args.keep_last_n_checkpoints, protect)



# -------------------------------------------------------------------------------------------------
# Flags of open-instruct's Olmo 3 RL scripts that grpo.py does not take, and what to use instead
# -------------------------------------------------------------------------------------------------
# Flags of open-instruct's Olmo 3 RL launch scripts (scripts/train/olmo3/7b_*_rl.sh, grpo_fast.py) that this
# script does not take, with what to use instead; chat_template.COMMON_UNSUPPORTED_FLAGS adds the ones all
# stages refuse. A `(values, message)` entry is taken when its values ask for what grpo.py does anyway.
# open-instruct's names of the options we share are aliases in `Args` (see --help).
UNSUPPORTED_FLAGS = {
    "total_episodes": "use --num_training_steps: episodes = steps x num_unique_prompts_per_step x "
                      "num_samples_per_prompt (Olmo 3 7B Think: 10000000 / (64 x 8) = 19531 steps)",
    # sft.py / dpo.py names; not aliases: -1 (no limit there) and 0 (eval only at the ends there) differ here.
    **dict.fromkeys(("max_steps", "max_train_steps"),
                    "use --num_training_steps: learner steps, each one rollout batch (sft.py / dpo.py call their "
                    "optimizer steps --max_steps; here --num_mini_batches optimizer steps make one learner step)"),
    "eval_steps": "use --eval_every N: evaluates before step 0, every N steps and after the last (0: never; "
                  "dpo.py's --eval_steps 0 still evaluates before and after)",
    "num_learners_per_node": "use --num_learners, the total over nodes (8 8 -> 16): torchrun ranks "
                             "[0, num_learners) learn, the others run one vLLM engine each",
    "vllm_num_engines": "the number of actor ranks: every torchrun rank from --num_learners on runs one vLLM engine "
                        "(engines = world size - num_learners)",
    "weight_dir": "not needed any more: weight updates stream from learner 0 straight into the engines' workers; "
                  "nothing is staged on disk or in /dev/shm (with --lora_rank each engine keeps its adapter "
                  "versions in --lora_dir)",
    "vllm_enable_prefix_caching": ({"", "true"}, "prefix caching is always on"),
    "per_device_train_batch_size": ({"1"}, "the learner trains one packed row of up to --pack_length tokens at a time"),
    "kl_estimator": ({"kl3", "2"}, "the KL penalty (--beta, Olmo 3: 0) uses the k3 estimator only"),
    "max_token_length": "not needed here: prompts are limited by --max_prompt_length, responses by "
                        "--max_response_length",
    "non_stop_penalty": ({"false"}, "not supported: a response cut at --max_response_length keeps its verifier "
                                    "reward (Olmo 3: False)"),
    "non_stop_penalty_value": "not supported (see --non_stop_penalty)",
    "mask_truncated_completions": ({"false"}, "not supported: truncated responses are trained like the others "
                                              "(Olmo 3: False)"),
    "ground_truths_key": ({"ground_truth"}, "rows must carry their label in `ground_truth`"),
    "sft_messages_key": ({"messages"}, "rows must carry their prompt in `messages`"),
    "apply_verifiable_reward": ({"", "true"}, "rewards always come from verifiers.py"),
    "active_sampling": ({"", "true"}, "active sampling is always on"),
    "no_resampling_pass_rate": "not supported: every prompt stays in the sampler's rotation",
    "checkpoint_state_freq": "use --save_steps: every checkpoint holds the HF model and the whole training state",
    "backend_timeout": "use --timeout_s (seconds)",
    "allow_world_padding": ({"false"}, "batches are never padded to the world size"),
    "use_fp8_kv_cache": ({"false"}, "the KV cache is kept in the model's dtype"),
    "stop_strings": "not supported: generation stops at eos or --max_response_length",
    "llm_judge_model": "set JUDGE_BASE_URL (an OpenAI-compatible endpoint, e.g. `vllm serve Qwen/Qwen3-32B`) and "
                       "JUDGE_MODEL for verifiers.py's llm_judge",
    "llm_judge_timeout": "not needed here: a row's whole scoring is bounded by --verifier_timeout (seconds)",
    "llm_judge_max_tokens": "not needed here: verifiers.py's llm_judge asks for a JSON score of a few tokens",
    "llm_judge_max_context_length": "not needed here: verifiers.py's llm_judge sends the first 8000 characters",
    "code_api_url": "not needed here: code runs in verifiers.py's local sandbox",
    "code_pass_rate_reward_threshold": "not supported: a code reward is the fraction of tests passed "
                                       "(Olmo 3 used 0.99, all or nothing)",
    "deepspeed_stage": "not needed here: with several learners FSDP2 shards the model by itself",
}



if __name__ == "__main__":
    main()
