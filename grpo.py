"""OlmoRL: GRPO-style RL with verifiable rewards on torch.distributed learners and vLLM actors.

Implements Olmo 3 sec 4.4 (OlmoRL infrastructure) in one file: continuous batching, active sampling,
inflight weight updates, an off-policy bound, truncated importance sampling, clip-higher, and
token-level loss normalization. Data flow (DESIGN.md sec 2):

    learner 0: prompt sampler -> actors (prefetch queue) -> vLLM engine kept full (add_request / step)
    actors -> learner 0: each finished group (token ids, vLLM sampling logprobs, policy version per token)
    learner 0: verifiers.py rewards -> off-policy bound -> drop zero-std groups, keep pulling until
               exactly `num_unique_prompts_per_step` groups carry gradient (active sampling)
               -> advantages -> pack -> split evenly across learners
    learners: clipped loss + optimizer step -> learner 0 gathers full weights -> every actor
    actors: load the new weights between two engine steps, keep running requests and their KV cache
            (inflight update), then check the engine against the learner on a fixed probe sequence

Roles. torchrun ranks [0, num_learners) are learners (one learner: plain module; several: FSDP2),
the other ranks are actors, each owning one vLLM engine (vLLM spawns its engine process). With one
process (`python grpo.py`) the actor runs in a thread beside the learner. nccl on GPU, gloo on CPU;
separate gloo groups carry prompts, finished groups (Python objects) and weights between roles, and
every wait between roles has a timeout (`--timeout_s`).

Departures from the paper / open-instruct's grpo_fast.py, on purpose:
- The off-policy bound drops a whole group if any of its tokens came from a policy older than
  `step - async_steps` (open-instruct bounds only the queue). The drop is counted.
- An inflight update briefly pauses the engine's scheduler (vLLM `pause_scheduler(mode="keep")`,
  no abort, no cache clear) around the in-place `reload_weights`, so that vLLM's per-token weight
  version labels are exact. Running requests keep their KV cache, which was computed by the old
  weights: that staleness is part of the method (PipelineRL) and the lag metrics count it.
- Prompts are sampled by learner 0 (checkpointed position); prompts in flight at a checkpoint are
  skipped on resume, not replayed.
- The learner computes full-vocabulary logits per packed row (no chunked LM head): fine for small
  vocabularies and short rows; a 100k vocabulary at 32K tokens needs chunking.
- `--response_length_sampler exponential` is a BENCHMARK-ONLY knob: it draws each request's
  `max_tokens` from a capped exponential and sets `ignore_eos`, so response lengths are long-tailed
  (the paper's mean/max ~0.46) even for a random model. Never use it to train.

Launch (defaults are Olmo 3 / open-instruct grpo_fast values unless a comment says otherwise):

    # tiny CPU run on the toy model (python toy.py model toy_model; python toy.py data toy_data)
    VLLM_CPU_KVCACHE_SPACE=1 python grpo.py --model_name_or_path toy_sft --output_dir out/grpo_toy \\
        --dataset_mixer_list toy_data/rlvr.jsonl 1.0 --eval_dataset_mixer_list toy_data/eval.jsonl 64 \\
        --learning_rate 3e-5 --num_training_steps 24 --eval_every 12 --num_unique_prompts_per_step 8 \\
        --num_samples_per_prompt 8 --max_prompt_length 128 --max_response_length 64 --pack_length 1024 \\
        --max_num_seqs 32 --enforce_eager
    # same, one learner rank and one actor rank
    VLLM_CPU_KVCACHE_SPACE=1 torchrun --nproc-per-node 2 grpo.py ...same flags... --num_learners 1
    # one GPU: the actor thread and the learner share it (set --vllm_gpu_memory_utilization 0.3)
    python grpo.py --model_name_or_path allenai/Olmo-3-7B-Think-DPO --dataset_mixer_list ... 1.0
    # 8 GPUs on one node: 4 learners (FSDP2) + 4 actors
    torchrun --nproc-per-node 8 grpo.py --num_learners 4 ...
    # two nodes (the paper's Table 23 benchmark layout: one learner node, one actor node)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        grpo.py --num_learners 8 ...

Outputs in `output_dir`: metrics.jsonl (one dict per step and per evaluation), summary.json (run
totals for bench_infra.sh), checkpoints/step_N (HF model + tokenizer + training_state.pt), and
wandb when `--report_to wandb` (offline unless WANDB_MODE says otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import pickle
import queue
import random
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

# vLLM runs functions inside its worker process (collective_rpc) only with this set; the function
# below only loads tensors this process wrote. A worker extension class would avoid it.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


@dataclass
class Args:
    # run and logging
    output_dir: str = field(default="output/grpo", metadata={"help": "Metrics, summary and checkpoints go here."})
    seed: int = field(default=1, metadata={"help": "Random seed (learner ranks add their rank)."})
    report_to: str = field(default="none", metadata={"help": "'wandb' or 'none'. wandb runs offline unless WANDB_MODE is set."})
    run_name: str = field(default="grpo", metadata={"help": "wandb run name."})
    save_every: int = field(default=0, metadata={"help": "Checkpoint every N steps (0: only at the end)."})
    resume: bool = field(default=False, metadata={"help": "Resume from the latest checkpoint in output_dir/checkpoints."})
    eval_every: int = field(default=10, metadata={"help": "Evaluate every N steps, before the first and after the last (0: never)."})
    eval_num_samples: int = field(default=4, metadata={"help": "k: samples per eval prompt, for pass@1 (mean) and pass@k."})
    # model and data
    model_name_or_path: str = field(default="toy_model", metadata={"help": "HF model directory or hub name (the SFT or DPO checkpoint)."})
    dataset_mixer_list: list[str] = field(default_factory=lambda: ["toy_data/rlvr.jsonl", "1.0"], metadata={"help": "RLVR sources and fractions/counts: `a.jsonl 1.0 org/b 500`. Rows: messages, ground_truth, verifier."})
    eval_dataset_mixer_list: list[str] = field(default_factory=list, metadata={"help": "Held-out RLVR sources for evaluation (empty: no eval)."})
    chat_template: str | None = field(default=None, metadata={"help": "Chat template name or path (default: the tokenizer's)."})
    max_prompt_length: int = field(default=2048, metadata={"help": "Prompts longer than this are dropped (Olmo 3: 2048)."})
    max_response_length: int = field(default=32768, metadata={"help": "Generation stops here; such samples are marked truncated (Olmo 3 Think: 32K)."})
    # algorithm (Olmo 3 / open-instruct grpo_fast defaults)
    num_training_steps: int = field(default=1000, metadata={"help": "Learner steps."})
    num_unique_prompts_per_step: int = field(default=64, metadata={"help": "Groups with non-zero reward std per step, exactly (active sampling)."})
    num_samples_per_prompt: int = field(default=8, metadata={"help": "Group size: completions per prompt (Olmo 3: 8)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (Olmo 3: 1.0)."})
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW lr (Olmo 3 7B: 1e-6; the toy: 3e-5, 2e-4 already degrades it)."})
    lr_schedule: str = field(default="constant", metadata={"help": "'constant' or 'linear' decay to 0."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping."})
    num_mini_batches: int = field(default=1, metadata={"help": "Optimizer steps per learner step (the batch split in this many)."})
    num_epochs: int = field(default=1, metadata={"help": "Passes over each step's batch."})
    clip_low: float = field(default=0.2, metadata={"help": "PPO clip epsilon below 1."})
    clip_high: float = field(default=0.272, metadata={"help": "Clip-higher epsilon above 1 (DAPO; Olmo 3 code: 0.272)."})
    tis_cap: float = field(default=2.0, metadata={"help": "Truncated importance sampling cap on exp(learner - vLLM logprob) (0: off)."})
    beta: float = field(default=0.0, metadata={"help": "KL-to-reference coefficient, k3 estimator (Olmo 3 RLVR: 0)."})
    advantage_normalization: str = field(default="centered", metadata={"help": "'centered' (reward - group mean, Olmo 3) or 'standard' (/ group std)."})
    async_steps: int = field(default=1, metadata={"help": "Off-policy bound K: tokens may come from policies at most K versions old (Olmo 3: 1)."})
    max_prompts_per_step_factor: int = field(default=20, metadata={"help": "Active sampling gives up (logged) after this many x num_unique_prompts_per_step prompts in one step."})
    # system
    num_learners: int = field(default=1, metadata={"help": "torchrun ranks [0, num_learners) learn; the rest are actors. Ignored with one process."})
    batching: str = field(default="continuous", metadata={"help": "'continuous' (keep the engine full) or 'static' (one generate-style batch at a time; ablation)."})
    inflight_updates: bool = field(default=True, metadata={"help": "Load new weights between two engine steps without draining (off: drain, then load)."})
    max_num_seqs: int = field(default=64, metadata={"help": "vLLM slots per engine (concurrent sequences)."})
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={"help": "GPU memory fraction for vLLM (GPU only; CPU uses VLLM_CPU_KVCACHE_SPACE)."})
    enforce_eager: bool = field(default=False, metadata={"help": "vLLM without compilation: starts faster, generates slower."})
    pack_length: int = field(default=0, metadata={"help": "Tokens per packed learner row (0: max_prompt_length + max_response_length)."})
    timeout_s: float = field(default=1800.0, metadata={"help": "Longest wait between roles (data, weights) before failing with an error; must exceed the longest learner step (with eval and checkpoint)."})
    startup_timeout_s: float = field(default=1800.0, metadata={"help": "Longest wait for the actors' engines to start (vLLM compiles; slow on a busy CPU)."})
    probe_tolerance: float = field(default=0.0, metadata={"help": "Max mean |learner - engine| probe logprob diff after an update (0: 2e-3 fp32, 5e-2 bf16)."})
    verifier_workers: int = field(default=2, metadata={"help": "Verifier processes."})
    verifier_timeout: float = field(default=10.0, metadata={"help": "Seconds per verifier row."})
    response_length_sampler: str = field(default="none", metadata={"help": "BENCHMARK ONLY: 'exponential' draws max_tokens per request (capped at max_response_length) and ignores eos."})
    response_length_mean: int = field(default=0, metadata={"help": "BENCHMARK ONLY: mean of the exponential response length."})


# -------------------------------------------------------------------------------------------------
# Utilization math (DESIGN.md sec 3): FLOPs and bytes of a dense decoder, counted from first principles
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


def prefill_cost(s: ModelShape, prompt_len: int, bytes_per_el: int) -> tuple[int, int]:
    """(FLOPs, bytes other than weights) of a prefill: causal, so query i attends to i keys, sum =
    p(p+1)/2 (about half of p^2); one sampled position; the prompt's KV is written."""
    p = prompt_len
    return forward_flops(s, p, p * (p + 1) // 2, 1), p * s.kv_bytes_per_token(bytes_per_el)


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
    for p in prefill_lens:
        f, b = prefill_cost(s, p, bytes_per_el)
        flops, nbytes = flops + f, nbytes + b
    for c in decode_contexts:
        f, b = decode_cost(s, c, bytes_per_el)
        flops, nbytes = flops + f, nbytes + b
    if prefill_lens or decode_contexts:
        nbytes += num_engine_steps * weight_bytes(s, bytes_per_el)
    return flops, nbytes


def utilization(flops: float, nbytes: float, seconds: float, peak_flops: float, peak_bytes_per_s: float) -> tuple[float, float]:
    """(MFU, MBU): achieved FLOP/s over peak FLOP/s, achieved bytes/s over peak bandwidth."""
    if seconds <= 0:
        return 0.0, 0.0
    return flops / seconds / peak_flops, nbytes / seconds / peak_bytes_per_s


# name substring -> (peak dense bf16 FLOP/s, peak memory B/s), DESIGN.md sec 3
GPU_PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12)}


def measure_peaks(device: str = "cpu") -> tuple[float, float, str]:
    """(peak FLOP/s, peak B/s, where they came from). GPUs from the table; CPUs (and unknown GPUs)
    from a measured fp32 matmul and a measured memory copy on this machine."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for key, (f, b) in GPU_PEAKS.items():
            if key in name:
                return f, b, f"datasheet peaks for {name}"
    n = 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    flops = 5 * 2 * n ** 3 / (time.perf_counter() - t)
    x = torch.empty(64 * 2 ** 20 // 4, device=device)  # 64 MiB fp32, larger than the caches
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    bw = 5 * 2 * x.numel() * 4 / (time.perf_counter() - t)  # a copy reads and writes every byte
    return flops, bw, f"measured on {device}: fp32 matmul {n}^3 and a 64 MiB copy (read+write)"


def static_waste(lengths: list[int]) -> float:
    """Compute wasted by a static batch: (max length - mean length) / max length (Olmo 3 sec 4.4)."""
    if not lengths or max(lengths) == 0:
        return 0.0
    return (max(lengths) - sum(lengths) / len(lengths)) / max(lengths)


# -------------------------------------------------------------------------------------------------
# ALGORITHM: advantages, active sampling, off-policy bound, loss, packing
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


def active_sampling(pull, num_groups: int, max_prompts: int) -> tuple[list, list, Counter]:
    """ALGORITHM: Olmo 3 sec 4.4 active sampling. Pull scored groups (`pull()` -> list of dicts with
    `rewards`) and keep those with non-zero reward std until exactly `num_groups` are kept. Groups
    pulled beyond that are returned as leftovers for the next step. Gives up after `max_prompts`
    prompts (counted as `capped`) so a run where nearly everything is filtered does not spin forever."""
    kept, leftover, counts = [], [], Counter()
    while len(kept) < num_groups:
        if counts["prompts"] >= max_prompts:
            counts["capped"] += 1
            break
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
    return kept, leftover, counts


def offpolicy_filter(groups: list[dict], learner_version: int, async_steps: int) -> tuple[list[dict], Counter, list[int]]:
    """ALGORITHM: off-policy bound. A group is dropped when any of its tokens was sampled by a policy
    older than `learner_version - async_steps`. Returns (kept groups, drop counts, per-token lags of
    every token seen, kept or not, for the lag distribution)."""
    kept, counts, lags = [], Counter(), []
    for g in groups:
        versions = [v for s in g["samples"] for v in s["versions"]]
        lags.extend(learner_version - v for v in versions)
        if versions and learner_version - min(versions) > async_steps:
            counts["groups_dropped_stale"] += 1
            counts["samples_dropped_stale"] += len(g["samples"])
        else:
            kept.append(g)
    return kept, counts, lags


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
        d = ref_logprobs - new_logprobs
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
            "tis_capped_sum": (((old_logprobs - sampling_logprobs).exp() > tis_cap).to(mask.dtype) * mask).sum().item() if tis_cap > 0 else 0.0,
            "tokens": m.item(),
        }
    return loss, stats


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


def collate_bin(rows: list[dict], pad_id: int = 0) -> dict:
    """One packed bin -> tensors over T positions, position t predicting token t + 1:
    input_ids, position_ids (restart per row), seg (row index, for the block-causal mask), and on
    predicting positions of response tokens: targets, mask, advantages, sampling logprobs."""
    ids, pos, seg, tgt, msk, adv, slp = [], [], [], [], [], [], []
    for i, r in enumerate(rows):
        seq = list(r["prompt_ids"]) + list(r["response_ids"])
        p, n = len(r["prompt_ids"]), len(seq)
        ids += seq
        pos += list(range(n))
        seg += [i] * n
        nxt = seq[1:] + [pad_id]
        tgt += nxt
        is_resp = [1 if p - 1 <= t < n - 1 else 0 for t in range(n)]  # predicts a response token
        msk += is_resp
        adv += [r["advantage"]] * n
        lp = [0.0] * (p - 1) + list(r["sampling_logprobs"]) + [0.0]
        slp += lp
    if not rows:  # an empty pad bin: one dummy token, nothing trained
        ids, pos, seg, tgt, msk, adv, slp = [pad_id], [0], [0], [pad_id], [0], [0.0], [0.0]
    t = torch.tensor
    return {"input_ids": t(ids), "position_ids": t(pos), "seg": t(seg), "targets": t(tgt),
            "mask": t(msk, dtype=torch.float32), "advantages": t(adv, dtype=torch.float32),
            "sampling_logprobs": t(slp, dtype=torch.float32)}


def token_logprobs(model, batch: dict, temperature: float = 1.0, with_entropy: bool = False):
    """Logprobs of the targets (T,) under the model, for one packed bin; rows do not attend to each
    other (block-causal 4D mask: transformers does not infer it from position_ids on sdpa/eager)."""
    dev = next(model.parameters()).device
    seg = batch["seg"].to(dev)
    T = seg.numel()
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev)) & (seg[:, None] == seg[None, :])
    logits = model(input_ids=batch["input_ids"][None].to(dev), position_ids=batch["position_ids"][None].to(dev),
                   attention_mask=mask[None, None]).logits[0].float() / temperature  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(-1, batch["targets"].to(dev)[:, None])[:, 0]
    if not with_entropy:
        return out, None
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return out, entropy


# -------------------------------------------------------------------------------------------------
# Plumbing: messages between roles (gloo point-to-point with timeouts), weight transport
# -------------------------------------------------------------------------------------------------
def _wait(work, timeout_s: float, what: str):
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
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


def broadcast_weights(state: dict | None, header: dict | None, src: int, group, timeout_s: float,
                      bucket_bytes: int = 256 * 2 ** 20) -> tuple[dict, dict]:
    """Learner 0 (state, header given) -> every actor: a header object (version, probe, names,
    shapes, dtypes), then the tensors flattened into buckets of one dtype. Returns (header, state)."""
    if header is not None:  # the source; without a state only the header goes (the initial probe)
        header = dict(header, names=[(k, tuple(v.shape), v.dtype) for k, v in state.items()] if state is not None else None)
    header = broadcast_obj(header, src, group, timeout_s)
    if header.get("stop") or not header.get("names"):
        return header, {}
    names, out = header["names"], {}
    i = 0
    while i < len(names):  # a bucket: consecutive tensors of one dtype up to bucket_bytes
        dtype, j, nbytes = names[i][2], i, 0
        while j < len(names) and names[j][2] == dtype and (j == i or nbytes + math.prod(names[j][1]) * dtype.itemsize <= bucket_bytes):
            nbytes += math.prod(names[j][1]) * dtype.itemsize
            j += 1
        if state is not None:
            flat = torch.cat([state[names[k][0]].reshape(-1).to("cpu") for k in range(i, j)])
        else:
            flat = torch.empty(nbytes // dtype.itemsize, dtype=dtype)
        _wait(dist.broadcast(flat, src, group=group, async_op=True), timeout_s, "weight broadcast")
        off = 0
        for k in range(i, j):
            n = math.prod(names[k][1])
            out[names[k][0]] = flat[off:off + n].view(names[k][1])
            off += n
        i = j
    return header, out


def _load_weights_in_worker(worker, path: str, expected: dict):
    """Runs inside the vLLM worker process (collective_rpc): validate, then reload in place. A failed
    reload leaves vLLM's model half loaded (DESIGN.md sec 5), so validate everything first."""
    import torch as _torch

    sd = _torch.load(path, mmap=True, weights_only=True)
    for name, (shape, dtype) in expected.items():
        t = sd.get(name)
        if not isinstance(t, _torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"weight {name}: got {type(t).__name__} {getattr(t, 'shape', None)}, want {shape} {dtype}")
        if not _torch.isfinite(t).all():
            raise ValueError(f"weight {name} has non-finite values")
    worker.model_runner.reload_weights(weights_iterator=iter(sd.items()))
    return len(sd)


def _watch_owner_in_worker(worker, owner_pid: int):
    """Runs inside the vLLM worker process: vLLM's engine processes outlive a frontend killed with
    SIGKILL, so a thread here takes the engine core (the worker's parent) and the worker down once the
    process that owns the engine is gone."""
    import os as _os
    import signal as _signal
    import threading as _threading
    import time as _time

    def watch():
        while True:
            _time.sleep(1.0)
            try:
                _os.kill(owner_pid, 0)
            except ProcessLookupError:
                _os.kill(_os.getppid(), _signal.SIGKILL)
                _os._exit(1)

    _threading.Thread(target=watch, daemon=True).start()


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(os.environ.get("TMPDIR", "/tmp"))


TORCHRUN_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID"]


# -------------------------------------------------------------------------------------------------
# Plumbing: the actor. One vLLM engine, kept full; finished groups go out as soon as they finish.
# -------------------------------------------------------------------------------------------------
class Actor:
    """Owns one engine. Inputs: `inbox` (prompt messages from learner 0), `updates` (new weights:
    dicts with version, path, probe). Output: `emit(message)` for finished groups and errors.
    `run()` is the engine loop; in the colocated mode it runs in a thread."""

    def __init__(self, args: Args, model_path: str, actor_id: int, emit, device: str, num_actors: int = 1):
        from vllm import LLM

        self.args, self.actor_id, self.emit = args, actor_id, emit
        self.inbox, self.updates = queue.Queue(), queue.Queue()
        self.stop = threading.Event()
        self.dtype = torch.float32 if device == "cpu" else torch.bfloat16
        saved = {k: os.environ.pop(k) for k in TORCHRUN_VARS if k in os.environ}
        try:  # vLLM starts its own torch.distributed in its engine process: hide torchrun's variables
            kwargs = {} if device == "cpu" else {"gpu_memory_utilization": args.vllm_gpu_memory_utilization}
            self.llm = LLM(model=model_path, dtype=self.dtype, seed=args.seed + actor_id, enforce_eager=args.enforce_eager,
                           max_model_len=args.max_prompt_length + args.max_response_length, max_num_seqs=args.max_num_seqs,
                           enable_prefix_caching=True, logprobs_mode="processed_logprobs", **kwargs)
        finally:
            os.environ.update(saved)
        self.engine = self.llm.llm_engine
        self.llm.collective_rpc(_watch_owner_in_worker, args=(os.getpid(),))
        self.version = None  # the learner version the engine's weights come from
        self.shape = ModelShape.from_config(self.engine.model_config.hf_config)
        self.peak_flops, self.peak_bw, self.peak_source = measure_peaks(device if device == "cpu" else "cuda")
        self.rng = random.Random(args.seed + 1000 * actor_id)
        self.pending = {}  # request id -> {"group": group id, "tokens", "logprobs", "prompt_len"}
        self.groups = {}  # group id -> {"meta", "samples", "left"}
        self.waiting = []  # prompt messages received but not yet admitted
        self.probe = None  # (request id, learner probe logprobs, version) while a probe runs
        self.stats = Counter()
        self.stats_t = time.perf_counter()
        self.static_batch = math.ceil(args.num_unique_prompts_per_step / num_actors)  # prompts per static batch
        self.static_lens = []  # response lengths of the running static batch

    # -- requests -------------------------------------------------------------------------------
    def _sampling_params(self, kind: str):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_tokens, ignore_eos = self.args.max_response_length, False
        if kind == "train" and self.args.response_length_sampler == "exponential":  # BENCHMARK ONLY
            max_tokens = max(1, min(self.args.max_response_length, int(self.rng.expovariate(1.0 / self.args.response_length_mean))))
            ignore_eos = True
        return SamplingParams(temperature=self.args.temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                              logprobs=0, output_kind=RequestOutputKind.DELTA)

    def _admit(self, prompt: dict):
        from vllm import TokensPrompt

        gid = f"{prompt['kind']}-{prompt['index']}"
        self.groups[gid] = {"meta": prompt, "samples": [None] * prompt["n"], "left": prompt["n"], "t0": time.perf_counter()}
        for j in range(prompt["n"]):
            rid = f"{gid}-{j}"
            self.pending[rid] = {"group": gid, "j": j, "tokens": [], "logprobs": [], "prompt_len": len(prompt["prompt_ids"])}
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt["prompt_ids"]), self._sampling_params(prompt["kind"]))

    def _start_probe(self, probe_ids: list[int], learner_logprobs: list[float], version: int):
        from vllm import SamplingParams, TokensPrompt

        rid = f"probe-{version}"  # a fresh cache salt: the probe must not hit KV cached under old weights
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=probe_ids, cache_salt=rid),
                                SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
        self.probe = (rid, learner_logprobs, version, probe_ids)

    def _finish_probe(self, out):
        rid, learner_lp, version, ids = self.probe
        self.probe = None
        engine_lp = [d[ids[t]].logprob for t, d in enumerate(out.prompt_logprobs) if t > 0]
        diff = np.abs(np.array(engine_lp) - np.array(learner_lp))
        tol = self.args.probe_tolerance or (2e-3 if self.dtype == torch.float32 else 5e-2)
        self.stats["probe_checks"] += 1
        self.stats["probe_mean_abs_diff"] = max(self.stats["probe_mean_abs_diff"], float(diff.mean()))
        self.stats["probe_max_abs_diff"] = max(self.stats["probe_max_abs_diff"], float(diff.max()))
        if not diff.mean() <= tol:
            raise RuntimeError(f"actor {self.actor_id}: engine logprobs of the probe differ from the learner's after the "
                               f"update to version {version}: mean |diff| {diff.mean():.3g} (max {diff.max():.3g}) > {tol:g}. "
                               "The engine is serving stale or corrupted weights.")

    def _process(self, outs):
        """Append each request's new tokens (DELTA outputs) and emit groups as soon as they finish."""
        decode_ctx, prefill, steps = [], [], 1
        for out in outs:
            if self.probe and out.request_id == self.probe[0]:
                if out.finished:
                    self._finish_probe(out)
                continue
            st = self.pending.get(out.request_id)
            if st is None:
                continue
            c = out.outputs[0]
            g0, k = len(st["tokens"]), len(c.token_ids)
            steps = max(steps, k)
            if g0 == 0 and k:
                prefill.append(st["prompt_len"])
            decode_ctx += [st["prompt_len"] + j for j in range(max(g0, 1), g0 + k)]
            st["tokens"] += c.token_ids
            st["logprobs"] += [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
            if out.finished:
                self._finish_sample(out.request_id, st, c)
        flops, nbytes = engine_step_cost(self.shape, prefill, decode_ctx, self.dtype.itemsize, steps)
        self.stats["flops"] += flops
        self.stats["bytes"] += nbytes
        self.stats["gen_tokens"] += len(decode_ctx) + len(prefill)
        self.stats["prefill_tokens"] += sum(prefill)

    def _finish_sample(self, rid, st, c):
        del self.pending[rid]
        n = len(st["tokens"])
        versions = [self.version] * n
        for span in c.weight_versions or []:  # vLLM labels token spans with set_weight_version()
            for i in range(span.start, min(span.end, n)):
                versions[i] = int(span.version) if span.version.lstrip("-").isdigit() else self.version
        if self.args.batching == "static":
            self.static_lens.append(n)
        g = self.groups[st["group"]]
        g["samples"][st["j"]] = {"response_ids": st["tokens"], "sampling_logprobs": st["logprobs"], "versions": versions,
                                 "finish_reason": c.finish_reason, "truncated": c.finish_reason == "length" and n >= self.args.max_response_length}
        g["left"] -= 1
        if g["left"] == 0:
            del self.groups[st["group"]]
            self.emit({"group": dict(g["meta"], samples=g["samples"], gen_time=time.perf_counter() - g["t0"]),
                       "stats": self._take_stats()})

    def _take_stats(self) -> dict:
        now = time.perf_counter()
        s = dict(self.stats, actor=self.actor_id, elapsed=now - self.stats_t, peak_flops=self.peak_flops, peak_bw=self.peak_bw,
                 peak_source=self.peak_source, max_num_seqs=self.args.max_num_seqs)
        self.stats, self.stats_t = Counter(), now
        return s

    # -- weights --------------------------------------------------------------------------------
    def _apply_update(self, upd: dict):
        """Load new weights between two engine steps. Inflight: running requests and their KV cache
        stay; the scheduler pause only makes vLLM's per-token version labels exact."""
        t = time.perf_counter()
        core = self.engine.engine_core
        if upd.get("path"):
            core.call_utility("pause_scheduler", "keep", False)  # mode keep: no abort, no cache clear
            try:
                self.llm.collective_rpc(_load_weights_in_worker, args=(upd["path"], upd["expected"]))
            except Exception as e:
                raise RuntimeError(f"actor {self.actor_id}: weight reload for version {upd['version']} failed; the "
                                   f"engine is unusable now: {e}") from e
            finally:
                with contextlib.suppress(OSError):
                    os.remove(upd["path"])
            self.engine.set_weight_version(str(upd["version"]))
            core.call_utility("resume_scheduler")
        else:
            self.engine.set_weight_version(str(upd["version"]))
        self.version = upd["version"]
        self.stats["weight_load_s"] += time.perf_counter() - t
        self.stats["updates"] += 1
        if upd.get("probe_ids"):
            self._start_probe(upd["probe_ids"], upd["probe_logprobs"], upd["version"])

    # -- the engine loop ------------------------------------------------------------------------
    def run(self):
        args, engine = self.args, self.engine
        static = args.batching == "static"
        next_update, drain_t0 = None, None
        while not self.stop.is_set():
            while True:  # prompts that arrived (the prefetch thread / learner keeps this topped up)
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if msg is None:
                    self.stop.set()
                    break
                self.waiting.extend(msg)
            if next_update is None:
                try:
                    next_update = self.updates.get_nowait()
                except queue.Empty:
                    pass
            busy = len(self.pending) > 0
            # weights: inflight = now; otherwise (drain mode, static batches) once nothing runs
            if next_update is not None and (self.version is None or (args.inflight_updates and not static) or not busy):
                if drain_t0 is not None:
                    self.stats["drain_s"] += time.perf_counter() - drain_t0
                    drain_t0 = None
                self._apply_update(next_update)
                next_update = None
            elif next_update is not None and drain_t0 is None:
                drain_t0 = time.perf_counter()
            # admit: continuous keeps max_num_seqs plus one group of slack queued in vLLM; static
            # admits a whole batch only when the previous one has finished (what llm.generate does)
            if self.version is not None and next_update is None:
                if static and not busy and self.waiting:
                    batch, self.waiting = self.waiting[:self.static_batch], self.waiting[self.static_batch:]
                    for p in batch:
                        self._admit(p)
                    self.stats["static_batches"] += 1
                elif not static:
                    while self.waiting and len(self.pending) < args.max_num_seqs + args.num_samples_per_prompt:
                        self._admit(self.waiting.pop(0))
            t = time.perf_counter()
            if engine.has_unfinished_requests():
                running = min(len(self.pending) + (self.probe is not None), args.max_num_seqs)
                outs = engine.step()
                self._process(outs)
                if static and not self.pending and self.static_lens:  # the batch is done
                    self.stats["static_waste_sum"] += static_waste(self.static_lens)
                    self.stats["static_waste_n"] += 1
                    self.static_lens = []
                dt = time.perf_counter() - t
                self.stats["occupancy_s"] += dt * running / args.max_num_seqs
                self.stats["busy_s"] += dt
            else:
                time.sleep(0.005)
                self.stats["idle_s"] += time.perf_counter() - t

    def shutdown(self):
        self.stop.set()
        with contextlib.suppress(Exception):
            self.engine.engine_core.shutdown()


def run_actor_rank(args: Args, rank: int, learner0: int, groups: dict, device: str, model_path: str):
    """An actor rank: threads move prompts in, groups out, and weights in over gloo; the main thread
    runs the engine loop. Any failure is sent to learner 0 and the process exits non-zero."""
    print(f"[actor rank {rank}] pid {os.getpid()}: starting vLLM", flush=True)
    outbox = queue.Queue()
    num_learners = min(args.num_learners, dist.get_world_size() - 1)
    actor = Actor(args, model_path, rank - num_learners, outbox.put, device, dist.get_world_size() - num_learners)
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

    def weights_in():
        wait = args.startup_timeout_s  # the first message: learner 0 waits for every engine to start
        while not actor.stop.is_set():
            header, state = broadcast_weights(None, None, learner0, groups["weights"], wait)
            wait = args.timeout_s
            if header.get("stop"):
                return
            if not header.get("names"):  # the initial probe of the weights the engine loaded from disk
                actor.updates.put(header)
                continue
            path = os.path.join(shm_dir(), f"grpo_{os.getpid()}_v{header['version']}.pt")
            torch.save(state, path)
            actor.updates.put(dict(header, path=path, expected={k: (s, d) for k, s, d in header["names"]}))

    threads = [guarded(prompts_in), guarded(groups_out), guarded(weights_in)]
    for th in threads:
        th.start()
    outbox.put({"ready": rank})
    try:
        actor.run()
    except Exception as e:
        errors.append(e)
    if errors:
        msg = "".join(traceback.format_exception(errors[0]))
        print(f"[actor rank {rank}] FATAL: {msg}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            send_obj({"error": f"actor rank {rank}: {errors[0]}"}, learner0, groups["data"], 10.0)
        actor.shutdown()
        os._exit(1)
    outbox.put({"done": rank})
    outbox.put(None)
    threads[1].join(timeout=10.0)
    actor.shutdown()


# -------------------------------------------------------------------------------------------------
# Plumbing: learner 0's side of the link (same interface in both modes)
# -------------------------------------------------------------------------------------------------
class Link:
    """Learner 0's view of the actors: `send_prompts(actor, list)`, a `results` queue of messages
    (groups, errors), `send_weights(header, state)`. Colocated: queues. torchrun: gloo groups."""

    def __init__(self, args: Args, actor_ranks: list[int], groups: dict | None, local_actor: Actor | None):
        self.args, self.actor_ranks, self.groups, self.local = args, actor_ranks, groups, local_actor
        self.results = queue.Queue()
        self.closing = threading.Event()
        self.lock = threading.Lock()
        if local_actor is None:
            for r in actor_ranks:
                threading.Thread(target=self._receive, args=(r,), daemon=True).start()

    def _receive(self, rank: int):
        wait = self.args.startup_timeout_s  # the first message comes once the actor's engine is up
        try:
            while True:
                msg = recv_obj(rank, self.groups["data"], wait)
                wait = self.args.timeout_s
                self.results.put(msg)
                if "done" in msg or "error" in msg:
                    return
        except Exception as e:
            if not self.closing.is_set():
                self.results.put({"error": f"link to actor rank {rank}: {e}"})

    def send_prompts(self, actor: int, prompts: list | None):
        if self.local is not None:
            self.local.inbox.put(prompts)
        else:
            with self.lock:  # the dispatcher thread and evaluation both send; a message is two sends
                send_obj(prompts, self.actor_ranks[actor], self.groups["prompts"], self.args.timeout_s)

    def send_weights(self, header: dict, state: dict | None, timeout_s: float):
        """state None: only the probe (the initial check). Colocated: a file in /dev/shm."""
        if self.local is not None:
            upd = dict(header)
            if state is not None:
                upd["path"] = os.path.join(shm_dir(), f"grpo_{os.getpid()}_v{header['version']}.pt")
                torch.save(state, upd["path"])
                upd["expected"] = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
            self.local.updates.put(upd)
        else:
            broadcast_weights(state, header, 0, self.groups["weights"], timeout_s)

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
    (async_steps + 1) training prompts in flight (sent, not yet consumed by the learner), spread
    over the actors, so the engines never wait on the learner for prompts; generation still can't
    run more than async_steps policies ahead of training."""

    def __init__(self, args: Args, dataset, link: Link, num_actors: int, start: int):
        super().__init__(daemon=True)
        self.args, self.dataset, self.link, self.num_actors = args, dataset, link, num_actors
        self.position = start  # the sampler position (checkpointed)
        self.in_flight = 0
        self.cond = threading.Condition()
        self.error = None
        self.stop = threading.Event()
        self.sent = [0] * num_actors

    def prompt(self, i: int, kind: str, row: dict, n: int) -> dict:
        return {"kind": kind, "index": i, "prompt_ids": row["prompt_input_ids"], "ground_truth": row["ground_truth"],
                "verifier": row["verifier"], "n": n}

    def row(self, i: int) -> dict:
        epoch, j = divmod(i, len(self.dataset))
        perm = np.random.default_rng(self.args.seed + epoch).permutation(len(self.dataset))  # same order on resume
        return self.dataset[int(perm[j])]

    def consumed(self, n: int = 1):
        with self.cond:
            self.in_flight -= n
            self.cond.notify()

    def run(self):
        limit = self.args.num_unique_prompts_per_step * (self.args.async_steps + 1)
        try:
            while not self.stop.is_set():
                with self.cond:
                    while self.in_flight >= limit and not self.stop.is_set():
                        self.cond.wait(0.5)
                    free = limit - self.in_flight
                if self.stop.is_set():
                    return
                per_actor = defaultdict(list)
                for _ in range(free):
                    a = self.sent.index(min(self.sent))
                    per_actor[a].append(self.prompt(self.position, "train", self.row(self.position), self.args.num_samples_per_prompt))
                    self.sent[a] += 1
                    self.position += 1
                with self.cond:
                    self.in_flight += free
                for a, prompts in per_actor.items():
                    self.link.send_prompts(a, prompts)
        except Exception as e:
            self.error = e


# -------------------------------------------------------------------------------------------------
# main
# -------------------------------------------------------------------------------------------------
def main():
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    if args.response_length_sampler == "exponential" and args.response_length_mean <= 0:
        raise ValueError("--response_length_sampler exponential needs --response_length_mean > 0")

    # ---------------------------------------------------------------------------------------------
    # Distributed setup (same block as sft.py / dpo.py) plus the role split
    # ---------------------------------------------------------------------------------------------
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = f"cuda:{local_rank}" if use_cuda else "cpu"
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if world_size > 1:
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    num_learners = min(args.num_learners, world_size - 1) if world_size > 1 else 1
    is_learner, is_main = rank < num_learners, rank == 0
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
        groups["learners"] = dist.new_group(list(range(num_learners)), timeout=timeout)
    ckpt_root = os.path.join(args.output_dir, "checkpoints")
    latest = latest_checkpoint(ckpt_root) if args.resume else None
    model_path = latest or args.model_name_or_path

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_sigterm)
    if world_size > 1 and sys.platform == "linux":  # torchrun's agent killed -9: take this rank down too
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    if not is_learner:
        try:
            run_actor_rank(args, rank, 0, groups, device, model_path)
        except KeyboardInterrupt:
            os._exit(130)
        except Exception:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)

    status = 1
    try:
        status = learner(args, rank, world_size, num_learners, is_main, device, groups, actor_ranks, latest, model_path)
    except KeyboardInterrupt as e:
        print(f"[rank {rank}] interrupted ({e}); exiting. The last checkpoint (if any) is intact.", file=sys.stderr, flush=True)
        status = 130
    except Exception as e:
        traceback.print_exc()
        print(f"[rank {rank}] FATAL: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # threads blocked in gloo or in vLLM must not keep the process alive


def latest_checkpoint(root: str) -> str | None:
    steps = [int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_") and d.split("_")[1].isdigit()] if os.path.isdir(root) else []
    return os.path.join(root, f"step_{max(steps)}") if steps else None


def learner(args, rank, world_size, num_learners, is_main, device, groups, actor_ranks, latest, model_path) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import datasets

    import chat_template

    datasets.disable_progress_bars()

    # ---------------------------------------------------------------------------------------------
    # Model, optimizer, data
    # ---------------------------------------------------------------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.config.use_cache = False
    ref_model = None
    if args.beta > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).to(device).eval()
        ref_model.requires_grad_(False)
    if num_learners > 1:  # FSDP2: shard every decoder layer, then the root (DESIGN.md sec 5: works on gloo)
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh(device.split(":")[0], list(range(num_learners)))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    total = args.num_training_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 1.0 if args.lr_schedule == "constant" else max(0.0, 1.0 - s / max(1, total * args.num_mini_batches * args.num_epochs)))
    start_step, position = 0, 0
    if latest:
        state = torch.load(os.path.join(latest, "training_state.pt"), weights_only=False)
        load_optimizer(model, optimizer, state["optimizer"], num_learners)
        scheduler.load_state_dict(state["scheduler"])
        start_step, position = state["step"], state["sampler_position"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
    pack_length = args.pack_length or args.max_prompt_length + args.max_response_length

    train_ds = eval_ds = probe_ids = None
    if is_main:
        raw = chat_template.load_mixture(args.dataset_mixer_list, seed=args.seed)
        train_ds, drops = chat_template.tokenize_rlvr(raw, tokenizer, args.max_prompt_length, args.chat_template)
        if args.eval_dataset_mixer_list:
            eval_ds, _ = chat_template.tokenize_rlvr(chat_template.load_mixture(args.eval_dataset_mixer_list, seed=args.seed),
                                                     tokenizer, args.max_prompt_length, args.chat_template)
        if len(train_ds) == 0:
            raise ValueError(f"no training prompts left after tokenization (dropped: {dict(drops)}); raise --max_prompt_length?")
        probe_ids = list(train_ds[0]["prompt_input_ids"]) + tokenizer.encode("<think>1+1=2</think>\n\\boxed{2}", add_special_tokens=False)
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"[grpo] {len(train_ds)} train prompts (dropped {dict(drops)}), {len(eval_ds) if eval_ds else 0} eval prompts; "
              f"{num_learners} learner(s), {max(1, len(actor_ranks))} actor(s){' (colocated thread)' if world_size == 1 else ''}; "
              f"pack_length {pack_length}; start step {start_step}", flush=True)

    # ---------------------------------------------------------------------------------------------
    # Actors and the link (learner 0 only)
    # ---------------------------------------------------------------------------------------------
    local_actor = link = dispatcher = pool = logger = None
    if is_main:
        from verifiers import ANSWER_ERRORS, VerifierPool

        pool = VerifierPool(num_workers=args.verifier_workers, timeout=args.verifier_timeout)
        if world_size == 1:
            results = queue.Queue()
            local_actor = Actor(args, model_path, 0, results.put, device, 1)
            link = Link(args, [], None, local_actor)
            link.results = results

            def actor_thread():
                try:
                    local_actor.run()
                except Exception as e:
                    results.put({"error": "".join(traceback.format_exception(e))})
            threading.Thread(target=actor_thread, daemon=True).start()
        else:
            link = Link(args, actor_ranks, groups, None)
        num_actors = max(1, len(actor_ranks))
        logger = MetricsLogger(args)
    version = start_step

    def sync_weights(v: int, full: bool):
        """ALL learners call this (FSDP2 gathers are collective). Learner 0 sends the weights (or, for
        the initial check, only the probe) with the learner's logprobs of the probe sequence."""
        t = time.perf_counter()
        state = gather_full_state(model, num_learners) if full else None
        probe = None
        if is_main or num_learners > 1:
            ids = probe_ids if is_main else None
            if num_learners > 1:
                ids = broadcast_list(ids, groups["learners"], args.timeout_s)
            with torch.no_grad():
                batch = collate_bin([{"prompt_ids": ids[:1], "response_ids": ids[1:], "advantage": 0.0,
                                      "sampling_logprobs": [0.0] * (len(ids) - 1)}])
                lp, _ = token_logprobs(model, batch)
            probe = lp[:-1].tolist()
        if is_main:
            link.send_weights({"version": v, "probe_ids": probe_ids, "probe_logprobs": probe}, state,
                              args.timeout_s if full else args.startup_timeout_s)
        return time.perf_counter() - t

    sync_weights(version, full=False)  # the engine loaded model_path from disk: probe it
    if is_main:
        dispatcher = Dispatcher(args, train_ds, link, num_actors, position)
        dispatcher.start()

    def pull(timeout_s: float, kind="train") -> list[dict]:
        """Next finished groups of `kind` from the actors (blocks up to timeout_s); groups of the other
        kind wait in `stash`; an actor's error becomes an exception here."""
        out, deadline = [g for g in stash if g["kind"] == kind], time.time() + timeout_s
        stash[:] = [g for g in stash if g["kind"] != kind]
        while not out:
            try:
                msg = link.results.get(timeout=max(0.0, min(1.0, deadline - time.time())))
            except queue.Empty:
                if dispatcher.error:
                    raise RuntimeError(f"prompt dispatcher failed: {dispatcher.error}")
                if time.time() > deadline:
                    raise TimeoutError(f"no finished group from any actor in {timeout_s:.0f}s (--timeout_s)")
                continue
            while True:
                if "error" in msg:
                    raise RuntimeError(f"actor failed: {msg['error']}")
                if "group" in msg:
                    pending_stats.append(msg["stats"])
                    if msg["group"]["kind"] == kind:
                        out.append(msg["group"])
                    else:
                        stash.append(msg["group"])
                try:
                    msg = link.results.get_nowait()
                except queue.Empty:
                    break
        return out

    def score(gs: list[dict], counts: Counter):
        """verifiers.py rewards; infrastructure errors drop the sample (counted), "no answer" scores 0."""
        rows = [(g["verifier"], tokenizer.decode(s["response_ids"], skip_special_tokens=True), g["ground_truth"])
                for g in gs for s in g["samples"]]
        results = iter(pool.score(rows))
        for g in gs:
            kept = []
            for s in g["samples"]:
                r = next(results)
                counts[f"verifier_error/{r.error}"] += r.error is not None
                if r.error is not None and r.error not in ANSWER_ERRORS:
                    continue
                s["reward"] = float(r.score) if r.error is None else 0.0
                kept.append(s)
            g["samples"], g["rewards"] = kept, [s["reward"] for s in kept]

    def evaluate() -> dict:
        """pass@1 (mean over k samples) and pass@k on the held-out prompts, at the engine's current weights."""
        t = time.perf_counter()
        prompts = [dispatcher.prompt(i, "eval", eval_ds[i], args.eval_num_samples) for i in range(len(eval_ds))]
        for a in range(num_actors):
            link.send_prompts(a, prompts[a::num_actors])
        got = []
        while len(got) < len(prompts):
            got += pull(args.timeout_s, kind="eval")
        score(got, Counter())
        scores = [g["rewards"] for g in got if g["rewards"]]
        lens = [len(s["response_ids"]) for g in got for s in g["samples"]]
        return {"eval/pass@1": float(np.mean([np.mean(r) for r in scores])), f"eval/pass@{args.eval_num_samples}": float(np.mean([max(r) > 0.5 for r in scores])),
                "eval/response_length": float(np.mean(lens)), "eval/prompts": len(scores), "time/eval": time.perf_counter() - t}

    # ---------------------------------------------------------------------------------------------
    # Training loop
    # ---------------------------------------------------------------------------------------------
    stash, leftover, pending_stats = [], [], []
    run_t0, totals = time.perf_counter(), Counter()
    eval_history = []
    for step in range(start_step, args.num_training_steps):
        metrics, t_step = {}, time.perf_counter()
        # ---- evaluate / save
        if is_main and eval_ds is not None and args.eval_every and step % args.eval_every == 0:
            ev = evaluate()  # of the policy after `step` updates: logged under that step
            eval_history.append((step, ev["eval/pass@1"]))
            logger.log(step, ev, kind="eval")
            t_step = time.perf_counter()  # step time excludes evaluation
        # ---- rollout: active sampling (learner 0), then split the packed batch across learners
        if is_main:
            t = time.perf_counter()
            counts, lags = Counter(), []

            def pull_scored():
                if leftover:  # pulled and scored last step, beyond that step's batch
                    gs = leftover[:]
                    leftover.clear()
                else:
                    gs = pull(args.timeout_s)
                    dispatcher.consumed(len(gs))
                gs, c, lg = offpolicy_filter(gs, version, args.async_steps)
                counts.update(c)
                lags.extend(lg)
                score([g for g in gs if "rewards" not in g], counts)
                return gs

            batch, extra, sel = active_sampling(pull_scored, args.num_unique_prompts_per_step,
                                                args.max_prompts_per_step_factor * args.num_unique_prompts_per_step)
            leftover.extend(extra)
            counts.update(sel)
            metrics["time/data_wait"] = time.perf_counter() - t
            rewards = [g["rewards"] for g in batch]
            advantages = compute_advantages(rewards, args.advantage_normalization)
            rows = [{"prompt_ids": g["prompt_ids"], "response_ids": s["response_ids"], "sampling_logprobs": s["sampling_logprobs"],
                     "advantage": a} for g, adv in zip(batch, advantages) for s, a in zip(g["samples"], adv)]
            rows = [r for r in rows if r["response_ids"]]
            minibatches = [rows[i::args.num_mini_batches] for i in range(args.num_mini_batches)]
            plan = [(split_bins(pack_rows(mb, pack_length), num_learners), sum(len(r["response_ids"]) for r in mb)) for mb in minibatches]
            metrics.update(rollout_metrics(batch, counts, lags, pending_stats, args))
            pending_stats.clear()
        else:
            plan = None
        if num_learners > 1:
            plan = broadcast_list(plan, groups["learners"], args.timeout_s)
        # ---- loss, backward, clip, step: old logprobs first when the batch is reused
        t = time.perf_counter()
        model.train()
        mbs = [([collate_bin(b, tokenizer.pad_token_id or 0) for b in shares[rank]], ntok) for shares, ntok in plan]
        if args.num_mini_batches > 1 or args.num_epochs > 1:
            with torch.no_grad():
                for bins, _ in mbs:
                    for b in bins:
                        b["old_logprobs"] = token_logprobs(model, b, args.temperature)[0]
        if ref_model is not None:
            with torch.no_grad():
                for bins, _ in mbs:
                    for b in bins:
                        b["ref_logprobs"] = token_logprobs(ref_model, b, args.temperature)[0]
        agg, grad_norms, learner_tokens = Counter(), [], 0
        for epoch in range(args.num_epochs):
            for bins, ntok in mbs:
                for b in bins:
                    new_lp, entropy = token_logprobs(model, b, args.temperature, with_entropy=True)
                    old_lp = b.get("old_logprobs", new_lp.detach())
                    dev = new_lp.device
                    loss, stats = grpo_loss(new_lp[None], old_lp[None], b["sampling_logprobs"].to(dev)[None], b["advantages"].to(dev)[None],
                                            b["mask"].to(dev)[None], args.clip_low, args.clip_high, args.tis_cap,
                                            b["ref_logprobs"].to(dev)[None] if ref_model is not None else None, args.beta,
                                            num_tokens_global=max(ntok, 1))
                    # FSDP2 averages gradients over learners; the loss is already a global token mean
                    (loss * num_learners).backward()
                    agg.update(stats)
                    agg["entropy_sum"] += (entropy * b["mask"].to(dev)).sum().item()
                    agg["loss"] += loss.item()
                    learner_tokens += int(b["input_ids"].numel()) if b["mask"].sum() > 0 else 0
                gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                grad_norms.append(float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        train_time = time.perf_counter() - t
        version += 1
        # ---- weight sync (inflight on the actors) + probe
        sync_time = sync_weights(version, full=True)
        if num_learners > 1:
            learner_tokens = sum(broadcast_list([learner_tokens], groups["learners"], args.timeout_s, gather=True))
        # ---- save
        if args.save_every and (step + 1) % args.save_every == 0 or step + 1 == args.num_training_steps:
            save_checkpoint(args, model, tokenizer, optimizer, scheduler, step + 1, dispatcher.position if is_main else 0,
                            is_main, num_learners, groups)
        # ---- log
        if is_main:
            n = max(agg["tokens"], 1)
            step_time = time.perf_counter() - t_step
            metrics.update({
                "train/loss": agg["loss"] / max(1, args.num_epochs), "train/pg_loss": agg["pg_loss_sum"] / n,
                "train/clip_fraction": agg["clipfrac_sum"] / n, "train/approx_kl": agg["approx_kl_sum"] / n,
                "train/ref_kl": agg["ref_kl_sum"] / n, "train/entropy": agg["entropy_sum"] / n,
                "train/tis_capped_fraction": agg["tis_capped_sum"] / n, "train/grad_norm": float(np.mean(grad_norms)),
                "train/lr": scheduler.get_last_lr()[0], "train/trained_tokens": int(agg["tokens"]) // max(1, args.num_epochs),
                "time/train": train_time, "time/weight_sync": sync_time, "time/step": step_time,
                "perf/learner_tokens_per_s": learner_tokens / max(train_time, 1e-9),
            })
            totals.update({"steps": 1, "step_time": step_time, "data_wait": metrics["time/data_wait"], "learner_tokens": learner_tokens,
                           "train_time": train_time, "sync_time": sync_time})
            for k in ("actor_gen_tokens", "actor_flops", "actor_bytes", "actor_elapsed", "actor_peak_flops_s", "actor_peak_bw_s",
                      "actor_occupancy_s", "actor_weight_wait_s", "static_waste_sum", "static_waste_n"):
                totals[k] += metrics.pop("_" + k, 0)
            logger.log(step + 1, metrics)
    # ---- final evaluation, summary, shutdown
    if is_main:
        final = {}
        if eval_ds is not None and args.eval_every:
            final = evaluate()
            eval_history.append((args.num_training_steps, final["eval/pass@1"]))
            logger.log(args.num_training_steps, final, kind="eval")
        write_summary(args, totals, eval_history, run_t0, local_actor)
        dispatcher.stop.set()
        dispatcher.join(timeout=10)
        link.close()
        pool.close()
        logger.close()
        if local_actor is not None:
            local_actor.shutdown()
    return 0


def rollout_metrics(batch, counts, lags, stats_list, args) -> dict:
    """The rollout/ and perf/ part of a step's metrics, from the kept groups, the filter counts, the
    per-token lags and the actors' stats deltas. Keys starting with `_` are totals for the summary."""
    rewards = [r for g in batch for r in g["rewards"]]
    lens = [len(s["response_ids"]) for g in batch for s in g["samples"]]
    m = {"rollout/reward": float(np.mean(rewards)) if rewards else 0.0,
         "rollout/solve_rate": float(np.mean([r >= 1.0 for r in rewards])) if rewards else 0.0,
         "rollout/response_length": float(np.mean(lens)) if lens else 0.0,
         "rollout/response_length_max": max(lens) if lens else 0,
         "rollout/truncated_fraction": float(np.mean([s["truncated"] for g in batch for s in g["samples"]])) if lens else 0.0,
         "rollout/groups": len(batch), "rollout/samples": len(rewards),
         "rollout/prompts_consumed": counts["prompts"], "rollout/filtered_all_solved": counts["all_solved"],
         "rollout/filtered_all_failed": counts["all_failed"], "rollout/filtered_zero_std": counts["zero_std"] + counts["too_few_samples"],
         "rollout/active_sampling_capped": counts["capped"],
         "rollout/groups_dropped_stale": counts["groups_dropped_stale"], "rollout/samples_dropped_stale": counts["samples_dropped_stale"],
         "rollout/verifier_errors": sum(v for k, v in counts.items() if k.startswith("verifier_error/")),
         }
    for k, v in counts.items():
        if k.startswith("verifier_error/"):
            m[f"rollout/{k}"] = v
    per_verifier = defaultdict(list)
    for g in batch:
        per_verifier[str(g["verifier"])].extend(g["rewards"])
    for name, rs in per_verifier.items():
        m[f"rollout/reward/{name}"] = float(np.mean(rs))
    if lags:
        la = np.array(lags)
        m.update({"rollout/lag_mean": float(la.mean()), "rollout/lag_max": int(la.max()),
                  **{f"rollout/lag_frac_{i}": float((la == i).mean()) for i in range(args.async_steps + 1)},
                  f"rollout/lag_frac_gt{args.async_steps}": float((la > args.async_steps).mean())})
    # actors: sums of their stats deltas; MFU / MBU are totals over (elapsed x peak), i.e. averaged over engines
    s = Counter()
    for st in stats_list:
        for k, v in st.items():
            if isinstance(v, (int, float)) and k not in ("actor", "peak_flops", "peak_bw", "max_num_seqs") and not k.startswith("probe_"):
                s[k] += v
        s["peak_flops_s"] += st["elapsed"] * st["peak_flops"]
        s["peak_bw_s"] += st["elapsed"] * st["peak_bw"]
        s["probe_mean"] = max(s["probe_mean"], st.get("probe_mean_abs_diff", 0.0))
        s["probe_max"] = max(s["probe_max"], st.get("probe_max_abs_diff", 0.0))
    el = max(s["elapsed"], 1e-9)
    weight_wait = s["idle_s"] + s["drain_s"] + s["weight_load_s"]
    per_actor = defaultdict(lambda: [0, 0.0])  # actor -> [tokens, seconds]; engines run in parallel
    for st in stats_list:
        per_actor[st["actor"]][0] += st.get("gen_tokens", 0)
        per_actor[st["actor"]][1] += st["elapsed"]
    m.update({"perf/actor_tokens_per_s": sum(t / max(e, 1e-9) for t, e in per_actor.values()),
              "perf/actor_mfu": s["flops"] / max(s["peak_flops_s"], 1e-9), "perf/actor_mbu": s["bytes"] / max(s["peak_bw_s"], 1e-9),
              "perf/actor_occupancy": s["occupancy_s"] / el, "time/actor_weight_wait": weight_wait,
              "time/actor_idle": s["idle_s"], "time/actor_drain": s["drain_s"], "time/actor_weight_load": s["weight_load_s"],
              "sync/probe_checks": s["probe_checks"], "sync/probe_mean_abs_diff": s["probe_mean"], "sync/probe_max_abs_diff": s["probe_max"]})
    if stats_list:
        m["perf/peak_source"] = stats_list[-1]["peak_source"]
    if s["static_waste_n"]:
        m["perf/static_wasted_fraction"] = s["static_waste_sum"] / s["static_waste_n"]
    m.update({"_actor_gen_tokens": s["gen_tokens"], "_actor_flops": s["flops"], "_actor_bytes": s["bytes"], "_actor_elapsed": s["elapsed"],
              "_actor_peak_flops_s": s["peak_flops_s"], "_actor_peak_bw_s": s["peak_bw_s"], "_actor_occupancy_s": s["occupancy_s"],
              "_actor_weight_wait_s": weight_wait, "_static_waste_sum": s["static_waste_sum"], "_static_waste_n": s["static_waste_n"]})
    return m


# -------------------------------------------------------------------------------------------------
# Plumbing: logging, checkpoints, summary, learner collectives
# -------------------------------------------------------------------------------------------------
class MetricsLogger:
    """One line to stdout, one JSON dict to metrics.jsonl and (optionally) wandb, per step."""

    def __init__(self, args: Args):
        os.makedirs(args.output_dir, exist_ok=True)
        self.file = open(os.path.join(args.output_dir, "metrics.jsonl"), "a")
        self.wandb, self.k = None, args.eval_num_samples
        if args.report_to == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self.wandb = wandb.init(name=args.run_name, config=dataclasses.asdict(args), dir=args.output_dir)

    def log(self, step: int, metrics: dict, kind: str = "train"):
        rec = {"step": step, "kind": kind, "time": time.time(), **metrics}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        g = metrics.get
        line = f"step {step}"
        if "rollout/reward" in metrics:
            line += (f" | reward {g('rollout/reward'):.3f} solve {g('rollout/solve_rate'):.2f} len {g('rollout/response_length'):.0f}"
                     f" | prompts {g('rollout/prompts_consumed')} (solved {g('rollout/filtered_all_solved')}, failed {g('rollout/filtered_all_failed')})"
                     f" stale {g('rollout/groups_dropped_stale')} lag {g('rollout/lag_mean', 0):.2f}"
                     f" | loss {g('train/loss'):.4f} clip {g('train/clip_fraction'):.3f} gnorm {g('train/grad_norm'):.3f}"
                     f" | step {g('time/step'):.1f}s data {g('time/data_wait'):.1f}s sync {g('time/weight_sync'):.2f}s"
                     f" probe {g('sync/probe_max_abs_diff'):.1e} | gen {g('perf/actor_tokens_per_s'):.0f} tok/s"
                     f" occ {g('perf/actor_occupancy'):.2f} mfu {g('perf/actor_mfu'):.4f} mbu {g('perf/actor_mbu'):.4f}")
        if "eval/pass@1" in metrics:
            line += f" | eval pass@1 {g('eval/pass@1'):.3f} pass@{self.k} {g(f'eval/pass@{self.k}'):.3f}"
        print(line, flush=True)

    def close(self):
        self.file.close()
        if self.wandb:
            self.wandb.finish()


def write_summary(args, totals: Counter, eval_history, run_t0, local_actor):
    steps = max(totals["steps"], 1)
    summary = {
        "args": dataclasses.asdict(args), "steps": totals["steps"], "wall_s": time.perf_counter() - run_t0,
        "mean_step_time_s": totals["step_time"] / steps, "mean_data_wait_s": totals["data_wait"] / steps,
        "mean_weight_sync_s": totals["sync_time"] / steps,
        "generated_tokens_per_s": totals["actor_gen_tokens"] / max(totals["actor_elapsed"], 1e-9),
        "learner_tokens_per_s": totals["learner_tokens"] / max(totals["train_time"], 1e-9),
        "actor_mfu": totals["actor_flops"] / max(totals["actor_peak_flops_s"], 1e-9),
        "actor_mbu": totals["actor_bytes"] / max(totals["actor_peak_bw_s"], 1e-9),
        "actor_occupancy": totals["actor_occupancy_s"] / max(totals["actor_elapsed"], 1e-9),
        "actor_weight_wait_s": totals["actor_weight_wait_s"], "learner_data_wait_s": totals["data_wait"],
        "static_wasted_fraction": totals["static_waste_sum"] / totals["static_waste_n"] if totals["static_waste_n"] else None,
        "peak_source": local_actor.peak_source if local_actor else "see metrics.jsonl perf/peak_source",
        "eval_pass@1": [{"step": s, "pass@1": p} for s, p in eval_history],
    }
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("[grpo] summary: " + json.dumps({k: v for k, v in summary.items() if k != "args"}), flush=True)


def broadcast_list(obj, group, timeout_s, gather=False):
    """Among learners (rank 0 is the source). gather=True: every learner's list, concatenated."""
    if gather:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return [x for o in out for x in o]
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_full_state(model, num_learners: int) -> dict | None:
    """The full (unsharded) state dict on learner 0, on CPU; collective with several learners."""
    if num_learners == 1:
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if dist.get_rank() == 0 else None


def load_optimizer(model, optimizer, state, num_learners):
    if num_learners == 1:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def save_checkpoint(args, model, tokenizer, optimizer, scheduler, step, position, is_main, num_learners, groups):
    """HF directory + tokenizer + training_state.pt, written to a temporary directory and renamed, so a
    crash mid-write never leaves a half checkpoint behind as the latest one."""
    state = gather_full_state(model, num_learners)
    if num_learners == 1:
        opt_state = optimizer.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opt_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    root = os.path.join(args.output_dir, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".tmp_step_{step}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    unwrapped = model
    unwrapped.save_pretrained(tmp, state_dict=state)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": opt_state, "scheduler": scheduler.state_dict(), "step": step, "sampler_position": position,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                "args": dataclasses.asdict(args)}, os.path.join(tmp, "training_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


if __name__ == "__main__":
    main()
