"""Direct preference optimization (DPO) with cached reference logprobs: stage two of the Olmo 3 recipe.

What it trains: a causal LM on preference pairs (`chosen` / `rejected` message lists that share
the conversation up to the final assistant turn), so that the policy raises the likelihood of the
chosen answer relative to the rejected one, measured against the model it started from (the
reference). Olmo 3 (sec 4.3 / 5.2, "delta learning") pairs a strong chosen answer with a weaker
model's rejected one: the contrast helps where imitation of the chosen answers alone does not.
Only the final assistant turn is scored (multi-turn rows keep the earlier turns as context); which
tokens those are comes from the template's `{% generation %}` blocks through `chat_template.py`.

Losses (`--loss_type`, all in `dpo_loss` below; h = policy log-ratio margin minus reference margin):
  - `dpo`       Rafailov et al. 2023, eq. 7: -log sigmoid(beta h), on summed logprobs.
                `--label_smoothing` eps gives conservative DPO (Mitchell 2023):
                -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
  - `dpo_norm`  the same on per-token mean logprobs (length-normalized): the Tulu 3 and Olmo 3 default
                (open-instruct dpo_tune_cache.py `--dpo_loss_type dpo_norm --dpo_beta 5`).
  - `simpo`     Meng et al. 2024, eq. 6: -log sigmoid(beta (mean logp_c - mean logp_r) - gamma),
                gamma = gamma_beta_ratio x beta; reference-free (no reference pass at all).
  - `ipo`       Azar et al. 2023, eq. 17: (h - 1 / (2 beta))^2 on summed logprobs (beta is their tau).
  `--rpo_alpha a` adds a x the chosen answer's per-token NLL to any of them (RPO, Pang et al. 2024,
  "Iterative Reasoning Preference Optimization", eq. 3; TRL's `rpo_alpha`). Off by default, as in
  Olmo 3. It counters "likelihood displacement": DPO can lower the chosen answer's likelihood too,
  only less than the rejected one's, and a small model then generates worse. Measured on an
  earlier toy task at lr 1e-4: pure dpo_norm took greedy accuracy from 53.5% to 32.5% while
  held-out preference accuracy rose; with `--rpo_alpha 1` it ended at 46%.

Departures from open-instruct's dpo_tune_cache.py (the code Olmo 3 used):
  - Reference logprobs are cached on disk, keyed by a hash of the model files (config + weights,
    full sha256), the tokenized pairs, the template, the reduction and the precision, so a second
    run with the same model and data skips the reference pass entirely (log: "reference logprobs:
    cache hit <path>"). open-instruct keys its cache on names and arguments, not on contents.
  - No reference model is held in memory during training: the reference pass runs once with the
    initial policy (the LoRA adapter disabled), before training starts.
  - `ipo` is added, on summed logprobs as in the paper (TRL's trainer averages them over the completion for
    ipo); open-instruct's `wpo` is left out.
  - The defaults are Olmo 3 7B Instruct DPO's (open-instruct scripts/train/olmo3/7b_instruct_dpo.sh):
    dpo_norm, beta 5, lr 1e-6, linear schedule with 10% warmup, no weight decay, 1 epoch, 128
    pairs per optimizer step (4 nodes x 8 GPUs x 1 x 4 accumulation), max length 16384. Olmo 3
    did not clip gradients (open-instruct's DPO default max_grad_norm -1); the norm is still logged.
  - Master weights stay fp32 on GPU (bf16 autocast for DDP, bf16 compute / fp32 reduce for FSDP2):
    a bf16 weight cannot hold an update of lr 1e-6 x O(1).

Launch (the same file everywhere; torchrun sets the ranks, world size 1 runs the same code):

    # one GPU
    python dpo.py --model_name_or_path output/sft --dataset_mixer_list allenai/Dolci-Instruct-DPO 1.0 \\
        --per_device_train_batch_size 1 --gradient_accumulation_steps 128 --gradient_checkpointing \\
        --use_lora --output_dir output/dpo
    # one node, 8 GPUs (FSDP2 shards a model that does not fit one GPU)
    torchrun --nproc-per-node 8 dpo.py --model_name_or_path output/sft \\
        --dataset_mixer_list allenai/Dolci-Instruct-DPO 1.0 --use_fsdp --gradient_checkpointing \\
        --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --report_to wandb --output_dir output/dpo
    # two nodes (run on each node; NODE_RANK 0 and 1, MASTER_ADDR = node 0)
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 --master-addr $MASTER_ADDR --master-port 29500 \\
        dpo.py --use_fsdp ... (as above, --gradient_accumulation_steps 8)
    # only build the reference cache (e.g. on another job), then train against it
    torchrun --nproc-per-node 8 dpo.py ... --cache_reference_only
    # tiny CPU run on the toy model (start from the SFT model of sft.py's tiny run; a few minutes on 2 cores)
    python toy.py model /tmp/toy && python toy.py data /tmp/toy_data
    torchrun --nproc-per-node 2 sft.py --model_name_or_path /tmp/toy --dataset_mixer_list /tmp/toy_data/sft.jsonl 1.0 \\
        --num_train_epochs 2 --learning_rate 3e-3 --per_device_train_batch_size 16 --output_dir /tmp/toy_sft
    torchrun --nproc-per-node 2 dpo.py --model_name_or_path /tmp/toy_sft \\
        --dataset_mixer_list /tmp/toy_data/preference.jsonl 1.0 --eval_split_fraction 0.2 --max_seq_length 256 \\
        --learning_rate 3e-4 --max_grad_norm 1 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 \\
        --output_dir /tmp/toy_dpo     # 32 pairs per step
    python toy.py eval /tmp/toy_sft /tmp/toy_data/eval.jsonl && python toy.py eval /tmp/toy_dpo /tmp/toy_data/eval.jsonl

Outputs in `--output_dir`: the final model as a Hugging Face directory (weights, config, tokenizer
and its chat template; with `--use_lora` the peft adapter, and with `--merge_lora` also the merged
model in `merged/`), `metrics.jsonl` (one JSON line per step; step 0 holds the reference-cache and
pre-training eval numbers), and `checkpoints/step_N/` (the HF directory plus `training_state.pt`
and per-rank RNG files; `checkpoints/latest` names the newest complete one). `--resume` continues
from it exactly (the newest `--keep_last_n_checkpoints` stay; an output_dir that holds a previous
run needs `--resume` or `--overwrite_output_dir`). The reference cache lives in
`--reference_cache_dir` (default: a `reference_cache/` directory next to `--output_dir`, so sibling
runs share it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import chat_template

# Per-loss defaults. beta: dpo 0.1 (Rafailov et al. 2023), dpo_norm 5 (Tulu 3 8B / Olmo 3 7B Instruct
# DPO scripts), simpo 2.0 (SimPO paper, sec 3 / Table 7: beta 2.0-2.5), ipo 0.1 (TRL's default tau).
DEFAULT_BETA = {"dpo": 0.1, "dpo_norm": 5.0, "simpo": 2.0, "ipo": 0.1}
# How each loss reduces token logprobs to one number per sequence: sum, or mean over trained tokens.
AVERAGE_LOGPS = {"dpo": False, "dpo_norm": True, "simpo": True, "ipo": False}


@dataclass
class Args:
    # --- run and logging ---
    output_dir: str = field(default="output/dpo", metadata={
        "help": "final model, metrics.jsonl and checkpoints/ go here"})
    seed: int = field(default=42, metadata={
        "help": "seeds data order, LoRA init and RNGs (rank r uses seed + r for its own RNG)"})
    report_to: str = field(default="none", metadata={
        "help": "none | wandb (wandb's own mode: online when logged in, else offline; WANDB_MODE overrides)"})
    wandb_project: str = field(default="olmo3-posttrain", metadata={"aliases": ["--wandb_project_name"],
                                                                    "help": "wandb project name"})
    wandb_entity: str = field(default=None, metadata={"help": "wandb team or user (default: your wandb default)"})
    run_name: str = field(default=None, metadata={"aliases": ["--exp_name"],
                                                  "help": "wandb run name (default: wandb's)"})
    logging_steps: int = field(default=10, metadata={"help": "print a metrics line every N optimizer steps (the "
                               "progress bar runs in between); metrics.jsonl and wandb get every step"})
    save_steps: int = field(default=500, metadata={
        "aliases": ["--checkpointing_steps"],
        "help": "write a resumable checkpoint every N optimizer steps (0: never)"})
    eval_steps: int = field(default=0, metadata={
        "help": "held-out preference eval every N steps (0: only before training and at the end)"})
    resume: bool = field(default=False, metadata={"help": "continue from output_dir/checkpoints/latest (same args)"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "start over in an output_dir that holds a previous run (deletes its checkpoints and metrics)"})
    keep_last_n_checkpoints: int = field(default=2, metadata={
        "help": "keep the newest N checkpoints (0: all); the one a --resume started from is never deleted"})
    # --- model and data ---
    model_name_or_path: str = field(default=None, metadata={
        "help": "HF model directory or hub id (offline: a local dir); usually the SFT model"})
    dataset_mixer_list: list[str] = field(default_factory=list, metadata={
        "aliases": ["--mixer_list"],
        "help": "source / amount pairs of preference data (`chosen` / `rejected` message lists): "
                "`a.jsonl 1.0 org/b 500`"})
    dataset_mixer_list_splits: list[str] = field(default_factory=lambda: ["train"], metadata={
        "help": "split of each Hub source: one for all or one per source (Olmo 3: train)"})
    eval_dataset_mixer_list: list[str] = field(default_factory=list, metadata={
        "aliases": ["--dataset_mixer_eval_list"],
        "help": "held-out preference pairs, same format; or use --eval_split_fraction"})
    eval_dataset_mixer_list_splits: list[str] = field(default_factory=lambda: ["train"], metadata={
        "aliases": ["--dataset_mixer_eval_list_splits"],
        "help": "split of each held-out Hub source (one, or one per source)"})
    eval_split_fraction: float = field(default=0.0, metadata={
        "help": "hold out this fraction of the training pairs for eval/accuracy (when no eval mixer list is given)"})
    chat_template: str = field(default=None, metadata={
        "aliases": ["--chat_template_name"],
        "help": "a template name (`python chat_template.py list`) or a .jinja path; default: the tokenizer's own. "
                "The template used for training is saved with the model"})
    max_seq_length: int = field(
        default=16384, metadata={"help": "max tokens per chosen / rejected conversation (Olmo 3 7B DPO: 16384)"})
    over_length_strategy: str = field(default="drop", metadata={
        "help": "longer pairs: drop, or terminate (both sides cut at the same left position inside their shared "
                "prompt; a pair that cannot be is dropped); see chat_template.py"})
    # --- algorithm (defaults: Olmo 3 7B Instruct DPO, open-instruct scripts/train/olmo3/7b_instruct_dpo.sh) ---
    loss_type: str = field(default="dpo_norm", metadata={
        "aliases": ["--dpo_loss_type"], "help": "dpo | dpo_norm | simpo | ipo (Olmo 3 / Tulu 3: dpo_norm)"})
    beta: float = field(default=None, metadata={
        "aliases": ["--dpo_beta"],
        "help": "loss temperature; default per loss: dpo 0.1, dpo_norm 5 (Olmo 3), simpo 2.0, ipo 0.1"})
    rpo_alpha: float = field(default=0.0, metadata={
        "help": "weight of the chosen answer's per-token NLL added to the loss "
                "(RPO, Pang et al. 2024; 0: off, Olmo 3)"})
    gamma_beta_ratio: float = field(default=0.5, metadata={
        "help": "SimPO target margin gamma / beta (SimPO paper: 0.5)"})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "conservative DPO: assumed probability that a pair's label is flipped (dpo, dpo_norm, simpo)"})
    num_train_epochs: int = field(default=1, metadata={"help": "passes over the data (Olmo 3: 1)"})
    max_steps: int = field(default=-1, metadata={"aliases": ["--max_train_steps"],
                                                 "help": "optimizer steps; overrides num_train_epochs when > 0"})
    learning_rate: float = field(default=1e-6, metadata={"help": "peak AdamW learning rate (Olmo 3 7B Instruct: 1e-6)"})
    lr_scheduler_type: str = field(default="linear", metadata={
        "help": "linear | cosine decay to 0 after warmup, or constant (Olmo 3: linear)"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "fraction of steps with linear warmup (Olmo 3: 0.1)"})
    weight_decay: float = field(default=0.0, metadata={
        "help": "AdamW weight decay on matrices; never on norms (Olmo 3: 0)"})
    max_grad_norm: float = field(default=-1.0, metadata={
        "aliases": ["--clip_grad_norm"],
        "help": "clip the global gradient norm (<= 0: no clipping, still logged; open-instruct DPO: -1)"})
    per_device_train_batch_size: int = field(default=1, metadata={
        "help": "pairs per micro-batch per rank (each pair is 2 rows)"})
    gradient_accumulation_steps: int = field(default=16, metadata={
        "help": "micro-batches per optimizer step (Olmo 3: 1 x 4 x 32 GPUs = 128 pairs)"})
    use_lora: bool = field(default=False, metadata={"help": "train LoRA adapters (peft) instead of all weights"})
    lora_rank: int = field(default=64, metadata={"help": "LoRA rank (open-instruct: 64)"})
    lora_alpha: float = field(default=16, metadata={
        "help": "LoRA alpha; the update is scaled by alpha / rank (open-instruct: 16)"})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "module names to adapt, or `all-linear` (every linear layer except the LM head)"})
    merge_lora: bool = field(default=False, metadata={"help": "also save base + adapter merged, in output_dir/merged"})
    # --- reference cache ---
    reference_cache_dir: str = field(default=None, metadata={
        "help": "where reference logprobs are cached (default: reference_cache/ next to output_dir)"})
    cache_reference_only: bool = field(default=False, metadata={
        "help": "compute (or find) the reference logprobs, then exit"})
    # --- system ---
    use_fsdp: bool = field(default=False, metadata={
        "help": "FSDP2: shard each decoder layer, then the root (automatic on GPU when weights + Adam do not fit)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in the backward pass"})
    bf16: bool | None = field(default=None, metadata={
        "help": "bf16 compute with fp32 master weights, optimizer state and gradient reduction (autocast, or "
                "FSDP2 mixed precision); default: on for GPU, off on CPU"})
    logprob_chunk_size: int = field(default=1024, metadata={
        "help": "tokens per chunk of the LM head + log-softmax, recomputed in backward: logits memory is "
                "chunk x vocab, never sequence x vocab"})


# Flags of open-instruct's Olmo 3 DPO launch scripts (scripts/train/olmo3/7b_*_dpo.sh, dpo_tune_cache.py) that
# this script does not take are all refused by every stage, each with what to use instead
# (chat_template.COMMON_UNSUPPORTED_FLAGS: DeepSpeed, Beaker / oe-eval, --with_tracking, ...); open-instruct's
# names of the options we share are aliases in `Args` (see --help). Refused here: grpo.py's names for the
# same ideas, which count differently at 0 / -1.
UNSUPPORTED_FLAGS: dict = {
    "num_training_steps": "use --max_steps (optimizer steps; overrides --num_train_epochs when > 0)",
    "eval_every": "use --eval_steps N (0: only before training and at the end; grpo.py's --eval_every 0 is never)",
}

# Arguments a resumed run may change without the "changed arguments" warning: they do not change what is trained
# (the reference cache is found by the hash of its contents, wherever it lives).
RESUME_IGNORED_ARGS = ("resume", "use_fsdp", "save_steps", "logging_steps", "report_to", "reference_cache_dir")


# -------------------------------------------------------------------------------------------------
# ALGORITHM: the losses, batches of pairs, sequence logprobs, the reference cache's key
# -------------------------------------------------------------------------------------------------
# ALGORITHM: the preference losses. Inputs are per-sequence logprobs (N,), already reduced by the
# caller (sum for dpo / ipo, mean over trained tokens for dpo_norm / simpo: AVERAGE_LOGPS).
def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None,
             beta: float, loss_type: str, label_smoothing: float = 0.0,
             gamma_beta_ratio: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (per-pair losses (N,), chosen rewards (N,), rejected rewards (N,)); rewards are detached.

    Rewards are the implicit rewards beta x (policy - reference) logps; for simpo, which has no
    reference, beta x policy logps. A pair is "accurate" when its chosen reward is the larger.
    """
    if loss_type == "simpo":
        # SimPO (Meng et al. 2024, eq. 6): the mean logprob is the reward, gamma a target margin.
        logits = beta * (policy_chosen_logps - policy_rejected_logps) - gamma_beta_ratio * beta
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
        return losses, (beta * policy_chosen_logps).detach(), (beta * policy_rejected_logps).detach()
    chosen_logratio = policy_chosen_logps - ref_chosen_logps  # log pi(y_w|x) / pi_ref(y_w|x)
    rejected_logratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratio - rejected_logratio
    if loss_type in ("dpo", "dpo_norm"):
        # DPO (Rafailov et al. 2023, eq. 7); label smoothing = cDPO (Mitchell 2023), open-instruct's form.
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        # IPO (Azar et al. 2023, eq. 17): regress the margin onto 1 / (2 tau), tau = beta. No smoothing.
        if label_smoothing:
            raise ValueError("label_smoothing is not defined for ipo")
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown loss_type {loss_type!r} (dpo | dpo_norm | simpo | ipo)")
    return losses, (beta * chosen_logratio).detach(), (beta * rejected_logratio).detach()


def collate_pairs(indices: list[int], pairs: list[dict], pad_id: int) -> dict:
    """Pairs -> one concatenated batch: `input_ids` and `targets` (2B, T), chosen rows first, then rejected.

    Chosen and rejected are padded (on the right) to one width and stacked on the batch dim, so
    one forward pass scores both (what open-instruct calls the concatenated forward).
    `targets[t]` is the label of token t + 1 (-100: not trained), so logits[t] scores targets[t].
    """
    seqs = [(pairs[i][f"{side}_input_ids"], pairs[i][f"{side}_labels"])
            for side in ("chosen", "rejected") for i in indices]
    width = max(len(ids) for ids, _ in seqs)
    input_ids = [ids + [pad_id] * (width - len(ids)) for ids, _ in seqs]
    targets = [labels[1:] + [-100] * (width - len(labels) + 1) for _, labels in seqs]
    return {"input_ids": torch.tensor(input_ids, dtype=torch.long), "targets": torch.tensor(targets, dtype=torch.long),
            "index": torch.tensor(indices, dtype=torch.long), "doc_lengths": [len(ids) for ids, _ in seqs]}


def sequence_logps(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed logprob of the trained tokens of every row (2B,), and how many there are (2B,).

    No attention mask: with right padding and causal attention a real token never attends to the
    padding after it, so its logprobs are exact (and sdpa keeps its fused causal path). The LM head
    runs in chunks (`target_logprobs`): no (2B, T, V) logits tensor.
    """
    targets = batch["targets"].to(device)  # (2B, T)
    mask = targets != -100
    token_logps, _ = target_logprobs(model, batch["input_ids"].to(device), None, targets)
    return (token_logps * mask).sum(-1), mask.sum(-1)



def model_fingerprint(name_or_path: str) -> dict:
    """sha256 of the files that decide a model's logprobs (config and weights), by file name.

    Contents, not timestamps: a copied model still hits, a retrained one in the same path misses.
    Hashing reads every weight file once (about 10 s for a 7B model in bf16).
    """
    path = name_or_path
    if not os.path.isdir(path):  # a hub id: its local snapshot (nothing is downloaded here)
        from huggingface_hub import snapshot_download
        path = snapshot_download(name_or_path, local_files_only=True)
    files = {}
    for name in sorted(os.listdir(path)):
        if name == "config.json" or name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            with open(os.path.join(path, name), "rb") as f:
                files[name] = hashlib.file_digest(f, "sha256").hexdigest()
    if not any(n != "config.json" for n in files):
        raise ValueError(f"no weight files found in {path}")
    return {"name_or_path": name_or_path, "files": files}


def pairs_fingerprint(pairs: list[dict]) -> str:
    """sha256 of the tokenized pairs in order (ids and labels): the cache is indexed by position."""
    h = hashlib.sha256()
    for pair in pairs:
        for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
            h.update(json.dumps(pair[key], separators=(",", ":")).encode())
    return h.hexdigest()


def reference_cache_key(model_key: dict, pairs: list[dict], template: str | None, average_logps: bool,
                        bf16: bool) -> tuple[str, dict]:
    """The cache file name and what it hashes: everything that changes a reference logprob.

    Model files, the tokenized pairs (which already reflect template, max length and truncation),
    the template text itself, sum vs mean reduction, and the compute precision (bf16 logprobs
    differ from fp32 ones). LoRA is not in it: with the adapter off the reference is the base model.
    """
    material = {"model": model_key, "data": pairs_fingerprint(pairs), "num_pairs": len(pairs),
                "template": hashlib.sha256(str(template).encode()).hexdigest(),
                "reduction": "mean" if average_logps else "sum", "precision": "bf16" if bf16 else "fp32"}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24], material


def shard_batches(num_items: int, batch_size: int, rank: int, world_size: int) -> list[tuple[list[int], int]]:
    """This rank's batches of a pass over `num_items` (reference pass, eval): (indices, how many are real).

    Every rank gets the same number of batches (FSDP's collectives need every rank to run every
    forward), so the last global chunk is padded with repeated indices whose results are ignored.
    """
    out, chunk = [], batch_size * world_size
    for start in range(0, num_items, chunk):
        real = list(range(start + rank * batch_size, min(start + (rank + 1) * batch_size, num_items)))
        out.append(((real + [0] * batch_size)[:batch_size] if real else [0] * batch_size, len(real)))
    return out

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
# PLUMBING (the same in sft.py and dpo.py; GPU_PEAKS and measure_peaks also in grpo.py): the lr
# schedule, training FLOPs and the devices' peak FLOP/s (for MFU)
# -------------------------------------------------------------------------------------------------
def lr_at(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Learning-rate multiplier: linear warmup to 1, then linear or cosine decay towards 0, or constant.

    A pure function of the step, so the step count is the whole scheduler state in a checkpoint.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "constant":
        return 1.0
    raise ValueError(f"unknown lr_scheduler_type {kind!r} (linear | cosine | constant)")


def train_flops(doc_lengths: list[int], non_embedding_params: int, num_layers: int, hidden_size: int) -> float:
    """FLOPs of one forward + backward over these conversations (Kaplan et al. 2020 / PaLM appendix B).

    6 x N per token for the matmuls (N = parameters except the input embedding; the untied LM head
    is a real matmul, so it counts), plus causal attention: QK^T and AV cost 4 x hidden x context
    per token per layer forward; the mean causal context of a length-L conversation is L / 2, and
    backward is twice forward, so a conversation costs 6 x layers x hidden x L^2 (packed rows too: attention
    never crosses conversations). LoRA's frozen weights skip their weight-gradient matmul: this overstates
    LoRA's FLOPs by up to a third.
    """
    tokens = sum(doc_lengths)
    return 6.0 * non_embedding_params * tokens + 6.0 * num_layers * hidden_size * sum(L * L for L in doc_lengths)


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


# -------------------------------------------------------------------------------------------------
# PLUMBING (the same functions in sft.py, dpo.py and grpo.py): output_dir, checkpoints
# -------------------------------------------------------------------------------------------------
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


# -------------------------------------------------------------------------------------------------
# PLUMBING (the same functions in sft.py and dpo.py, in this order): distributed setup, tokenizer,
# the run's batches, the model, optimizer, resume, checkpoints, logging, the final save
# -------------------------------------------------------------------------------------------------
@dataclass
class World:
    """This process's place in the torchrun job (world size 1: a plain `python` run of the same code)."""
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.size > 1:
            dist.all_reduce(t)
        return t.tolist()


def setup_world(seed: int) -> World:
    """Ranks from torchrun's environment, this rank's device, the process group, and the seeds."""
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(seed)  # same on every rank until the model is built (LoRA init must agree)
    random.seed(seed + rank)
    return World(rank, size, local_rank, device)


def load_tokenizer(args) -> tuple:
    """The tokenizer with the chat template to train with (saved with the model, so inference renders the same
    way), and the padding id."""
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if args.chat_template:
        tokenizer.chat_template = chat_template.get_template(args.chat_template)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return tokenizer, pad_id


def plan_batches(args, num_items: int, global_batch: int, rows_of, unit: str) -> tuple[list, int, int, int]:
    """The whole run's global batches [(epoch, rows)], the epochs they span, the total and warmup steps.

    A pure function of (seed, epoch): epoch e shuffles the items with seed + e, and `rows_of` turns that order
    into rows. Batch s of the run is the data position a checkpoint stores, so a resume sees the same rows.
    """
    batches, epoch = [], 0
    while True:
        order = torch.randperm(num_items, generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        rows = rows_of(order)
        if len(rows) < global_batch:
            raise SystemExit(f"{len(rows)} {unit} cannot fill one global batch of {global_batch} {unit}")
        batches += [(epoch, rows[i:i + global_batch]) for i in range(0, len(rows) - global_batch + 1, global_batch)]
        epoch += 1
        if ((args.max_steps > 0 and len(batches) >= args.max_steps)
            or (args.max_steps <= 0 and epoch >= args.num_train_epochs)):
            break
    total_steps = args.max_steps if args.max_steps > 0 else len(batches)
    return batches[:total_steps], epoch, total_steps, math.ceil(args.warmup_ratio * total_steps)


def plan_memory(args, shards: int, rows_per_forward: int, bf16: bool, flash: bool) -> dict:
    """`memory_plan` of this run's model and arguments, its weights sharded over `shards` ranks."""
    return memory_plan(AutoConfig.from_pretrained(args.model_name_or_path), args.max_seq_length, rows_per_forward,
                       shards, bf16, args.gradient_checkpointing, args.logprob_chunk_size,
                       trained=not args.use_lora, flash_attention=flash)


def build_model(args, world: World, weights_from: str, resume_from: str | None, rows_per_forward: int) -> tuple:
    """The memory plan (printed; the run stops here if it cannot fit), then the model: fp32 weights, the chunked
    LM head, LoRA, FSDP2 or DDP. Returns (model, the module to train through, autocast, bf16, the FLOPs shape)."""
    # Weights stay fp32 (master weights, fp32 optimizer state); with --bf16 (default on GPU) compute runs
    # in bf16 through autocast (one rank, DDP) or FSDP2's mixed-precision policy (fp32 gradient reduction).
    bf16 = args.bf16 if args.bf16 is not None else world.device.type == "cuda"
    # Flash attention separates packed rows (restarting position ids) only at batch size 1; sdpa honours
    # the block-diagonal mask that transformers derives from them at any batch size.
    flash = world.device.type == "cuda" and args.per_device_train_batch_size == 1 and \
        importlib.util.find_spec("flash_attn") is not None
    available = device_memory_bytes(world.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if (world.device.type == "cuda" and world.size > 1 and not args.use_fsdp
            and plan_memory(args, 1, rows_per_forward, bf16, flash)["total"] > available):
        args.use_fsdp = True  # it would not fit one GPU: shard it
    plan = plan_memory(args, world.size if args.use_fsdp else 1, rows_per_forward, bf16, flash)
    plan_line = check_memory_plan(plan, available,
                                  "--gradient_checkpointing, --use_fsdp or more GPUs, a smaller --max_seq_length or "
                                  "--per_device_train_batch_size, --use_lora, a smaller --logprob_chunk_size")
    if world.is_main:
        print(plan_line, flush=True)
    model = AutoModelForCausalLM.from_pretrained(weights_from, dtype=torch.float32,
                                                 attn_implementation="flash_attention_2" if flash else "sdpa")
    model.config.use_cache = False
    non_embedding_params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    shape = (non_embedding_params, model.config.num_hidden_layers, model.config.hidden_size)  # for train_flops
    install_chunked_head(model, args.logprob_chunk_size)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.use_lora:
        from peft import LoraConfig, PeftModel, get_peft_model
        if resume_from:
            model = PeftModel.from_pretrained(model, resume_from, is_trainable=True)
        else:
            targets = "all-linear" if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
            model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                     target_modules=targets, task_type="CAUSAL_LM"))
    torch.manual_seed(args.seed + world.rank)  # from here on each rank has its own RNG stream
    if not args.use_fsdp:
        model.to(world.device)  # (FSDP2 moves each rank's shard to the device itself, never the whole model)
    if args.use_fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(world.device.type, (world.size,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
        base = model.get_base_model() if args.use_lora else model
        layer_names = set(base._no_split_modules or [])  # the decoder layer class, e.g. Olmo3DecoderLayer
        for module in model.modules():
            if type(module).__name__ in layer_names:
                fully_shard(module, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        train_model = model
    elif world.size > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[world.local_rank] if world.device.type == "cuda" else None)
    else:
        train_model = model
    autocast = torch.autocast(world.device.type, dtype=torch.bfloat16, enabled=bf16 and not args.use_fsdp)
    return model, train_model, autocast, bf16, shape


def make_optimizer(args, model) -> tuple[list, torch.optim.Optimizer]:
    """AdamW over the trained parameters; weight decay on matrices only, never on norms (or biases)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for n, p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    return trainable, torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8)


def restore_training_state(args, world: World, model, optimizer, resume_from: str | None) -> int:
    """From a checkpoint (the weights are already loaded): the optimizer, this rank's RNG; returns its step."""
    if not resume_from:
        return 0
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    state = torch.load(os.path.join(resume_from, "training_state.pt"), weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    changed = {k: (v, getattr(args, k)) for k, v in state["args"].items()
               if k not in RESUME_IGNORED_ARGS and getattr(args, k, v) != v}
    if changed and world.is_main:  # a different run would not continue "exactly"; say so loudly
        print(f"WARNING: resuming {resume_from} with changed arguments (saved, now): {changed}")
    rng_file = os.path.join(resume_from, f"rng_rank{world.rank}.pt")
    if os.path.isfile(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if world.device.type == "cuda" and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    return state["step"]


def full_state_dict(model) -> dict:
    """The whole model's weights (or LoRA adapter) on CPU, gathered from every rank: a collective, every rank
    calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_hf(model, tokenizer, path: str, state_dict: dict) -> None:
    """Rank 0: weights (or the LoRA adapter), config, tokenizer and its chat template."""
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def save_checkpoint(args, world: World, model, tokenizer, optimizer, step: int, total_steps: int, warmup_steps: int,
                    resume_from: str | None) -> None:
    """Atomic: write everything into a temp dir, fsync, rename, then move `latest`; old ones go last."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    model_sd = full_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    root = os.path.join(args.output_dir, "checkpoints")
    name, tmp = f"step_{step}", os.path.join(root, f".tmp-step_{step}")
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(model, tokenizer, tmp, model_sd)
        torch.save({"optimizer": optim_sd, "step": step, "args": asdict(args), "world_size": world.size,
                    "scheduler": {"step": step, "total_steps": total_steps, "warmup_steps": warmup_steps}},
                   os.path.join(tmp, "training_state.pt"))
    world.barrier()
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state() if world.device.type == "cuda" else None},
               os.path.join(tmp, f"rng_rank{world.rank}.pt"))
    world.barrier()
    if world.is_main:
        publish_checkpoint(root, tmp, name)
        prune_checkpoints(root, args.keep_last_n_checkpoints, protect=resume_from)  # the new one is complete
    world.barrier()


class RunLog:
    """Rank 0: run_config.json (every argument and what was derived from them), wandb, and `log`: one JSON line
    per call in metrics.jsonl (appended to on resume), one wandb row and (echo) one line on stdout."""

    def __init__(self, args, world: World, derived: dict, resume_from: str | None):
        self.file, self.wandb_run = None, None
        if not world.is_main:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "run_config.json"), "w") as f:
            json.dump({"args": asdict(args), "derived": derived}, f, indent=1, default=str)
        print("run: " + " ".join(f"{k}={v}" for k, v in derived.items()) + f" (all arguments: {f.name})", flush=True)
        if args.report_to == "wandb":
            import wandb
            # wandb's own mode: WANDB_MODE when set, else online when logged in, else offline
            mode = (None if os.environ.get("WANDB_MODE")
                    else "online" if wandb.login(prompt=False, verify=False) else "offline")
            self.wandb_run = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=args.run_name,
                                        dir=args.output_dir, config={**asdict(args), **derived}, mode=mode)
        self.file = open(os.path.join(args.output_dir, "metrics.jsonl"), "a" if resume_from else "w")

    def log(self, metrics: dict, echo: bool = True) -> None:
        if self.file is None:
            return
        if echo:
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()))
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=metrics["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def set_lr(args, optimizer, step: int, total_steps: int, warmup_steps: int) -> float:
    """The schedule's learning rate for `step`, set in every parameter group."""
    lr = args.learning_rate * lr_at(step, total_steps, warmup_steps, args.lr_scheduler_type)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def micro_batches(rows: list, world: World, micro_bs: int, accum: int) -> list[list]:
    """This rank's `accum` micro-batches of one global batch: micro-batch k of rank r is slice k x ranks + r."""
    return [rows[(k * world.size + world.rank) * micro_bs:(k * world.size + world.rank + 1) * micro_bs]
            for k in range(accum)]


def sync_gradients(args, world: World, train_model, last: bool) -> None:
    """Gradients are all-reduced on the last micro-batch of a step only (accumulation needs no communication)."""
    if args.use_fsdp:
        train_model.set_requires_gradient_sync(last)
    elif world.size > 1:
        train_model.require_backward_grad_sync = last  # what DDP's no_sync() context toggles


def clip_and_step(args, trainable: list, optimizer) -> float:
    """Clip the global gradient norm (<= 0: no clipping), step, zero the gradients; returns the norm before
    clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in trainable],
                                               args.max_grad_norm if args.max_grad_norm > 0 else float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def save_final_model(args, world: World, model, tokenizer) -> None:
    """The trained model (or LoRA adapter) as a Hugging Face directory in output_dir; with --merge_lora also
    base + adapter merged, in output_dir/merged."""
    model_sd = full_state_dict(model)
    if not world.is_main:
        return
    save_hf(model, tokenizer, args.output_dir, model_sd)
    if args.use_lora and args.merge_lora:
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, args.output_dir).merge_and_unload()
        merged.save_pretrained(os.path.join(args.output_dir, "merged"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "merged"))
    print(f"saved {'LoRA adapter' if args.use_lora else 'model'} to {args.output_dir}")


def finish(world: World, run_log) -> None:
    """Close the logs, wait for every rank, leave the process group."""
    if run_log is not None:
        run_log.close()
    world.barrier()
    if world.size > 1:
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------------------
# ALGORITHM: this stage's data, the reference logprobs, eval and its training step
# -------------------------------------------------------------------------------------------------
def tokenize_pairs(args, tokenizer, mixer_list: list[str], splits: list[str]) -> tuple:
    dataset = chat_template.load_mixture(mixer_list, split=splits, seed=args.seed)
    return chat_template.tokenize_preference(dataset, tokenizer, args.max_seq_length,
                                             over_length_strategy=args.over_length_strategy,
                                             chat_template=args.chat_template)


def load_data(args, tokenizer, world: World) -> tuple[list[dict], list[dict], dict, dict]:
    """Training and held-out pairs tokenized for DPO (ids and labels of each side), and the drops by reason."""
    if not world.is_main:
        world.barrier()  # rank 0 fills the datasets cache first
    dataset, drops = tokenize_pairs(args, tokenizer, args.dataset_mixer_list, args.dataset_mixer_list_splits)
    eval_dataset, eval_drops = None, {}
    if args.eval_dataset_mixer_list:
        eval_dataset, eval_drops = tokenize_pairs(args, tokenizer, args.eval_dataset_mixer_list,
                                                  args.eval_dataset_mixer_list_splits)
    elif args.eval_split_fraction > 0:
        split = dataset.train_test_split(test_size=args.eval_split_fraction, seed=args.seed)
        dataset, eval_dataset = split["train"], split["test"]
    if world.is_main:
        world.barrier()
    notice = chat_template.prefix_labeling_notice(tokenizer, args.chat_template, drops)
    if notice and world.is_main:  # once, at start-up: labels a template without generation blocks cannot give
        print(f"WARNING: {notice}", flush=True)
    keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    pairs = [{k: r[k] for k in keys} for r in dataset]
    eval_pairs = [{k: r[k] for k in keys} for r in eval_dataset] if eval_dataset is not None else []
    if not pairs:
        raise SystemExit(f"no trainable pairs left (dropped: {dict(drops)})")
    return pairs, eval_pairs, drops, eval_drops


def pair_logps(net, batch: dict, autocast, average_logps: bool, device) -> tuple:
    """(chosen, rejected) logps reduced for the loss, each (B,), and their per-token means (eval, RPO)."""
    with autocast:
        sums, counts = sequence_logps(net, batch, device)
    counts = counts.clamp(min=1)
    logps = sums / counts if average_logps else sums
    means = sums / counts
    b = len(batch["index"])
    return logps[:b], logps[b:], means[:b], means[b:]


def preference_loss(args, chosen: torch.Tensor, rejected: torch.Tensor, ref: tuple | None, idx: torch.Tensor) -> tuple:
    """`dpo_loss` of these pairs against rows `idx` of the reference table `ref` (None: simpo, no reference)."""
    return dpo_loss(chosen.float(), rejected.float(), ref[0][idx] if ref is not None else None,
                    ref[1][idx] if ref is not None else None, args.beta, args.loss_type, args.label_smoothing,
                    args.gamma_beta_ratio)


# ALGORITHM: the reference is the model training starts from (for LoRA: the adapter switched off).
# Its logprobs depend only on model, data, template, reduction and precision, so they are computed
# once, stored under a hash of those, and no reference model is kept for training.
def reference_tables(args, world: World, model, score, tokenizer, pad_id: int, splits: dict, average_logps: bool,
                     bf16: bool) -> tuple[dict, dict, str]:
    """split name -> its (chosen, rejected) reference logps (N,) each, from the cache or computed; the log
    numbers (cache hit, pairs computed, seconds) and the cache directory."""
    cache_dir = args.reference_cache_dir or os.path.join(os.path.dirname(os.path.abspath(args.output_dir)),
                                                         "reference_cache")
    reference_log = {"reference/cache_hit": 1, "reference/computed_pairs": 0, "time/reference_s": 0.0}
    t_ref = time.perf_counter()
    key_obj = [model_fingerprint(args.model_name_or_path) if splits and world.is_main else None]
    if splits and world.size > 1:
        dist.broadcast_object_list(key_obj, src=0)  # rank 0 reads the weight files, the others wait
    tables = {}
    for split, split_pairs in splits.items():
        key, material = reference_cache_key(key_obj[0], split_pairs, tokenizer.chat_template, average_logps, bf16)
        path = os.path.join(cache_dir, f"{key}.pt")
        hit = torch.tensor([int(os.path.isfile(path)) if world.is_main else 0], device=world.device)
        if world.size > 1:
            dist.broadcast(hit, src=0)  # rank 0 decides, so nodes without a shared filesystem agree
        if hit.item():
            cached = torch.load(path, weights_only=True) if world.is_main else None
            ref = cached["logps"].to(world.device) if world.is_main else torch.empty(2, len(split_pairs),
                                                                                      device=world.device)
            if world.size > 1:
                dist.broadcast(ref, src=0)
            if world.is_main:
                print(f"reference logprobs: cache hit {path} ({split}, {len(split_pairs)} pairs)")
        else:
            if world.is_main:
                print(f"reference logprobs: cache miss, computing {split} ({len(split_pairs)} pairs) -> {path}")
            ref = compute_reference_logps(args, world, model, score, pad_id, split_pairs, split)
            if world.is_main:
                save_reference_logps(args, cache_dir, key, material, split, ref)
            reference_log["reference/cache_hit"] = 0
            reference_log["reference/computed_pairs"] += len(split_pairs)
        tables[split] = (ref[0], ref[1])
    reference_log["time/reference_s"] = time.perf_counter() - t_ref
    return tables, reference_log, cache_dir


def compute_reference_logps(args, world: World, model, score, pad_id: int, split_pairs: list[dict],
                            split: str) -> torch.Tensor:
    """The reference pass: (2, N) logps of the initial policy. Each rank scores its shard; -inf marks "not
    mine", and a max all-reduce assembles the full table."""
    ref = torch.full((2, len(split_pairs)), float("-inf"), device=world.device)
    adapter_off = model.disable_adapter() if args.use_lora else contextlib.nullcontext()
    model.eval()
    with torch.no_grad(), adapter_off:
        for indices, real in tqdm(shard_batches(len(split_pairs), args.per_device_train_batch_size, world.rank,
                                                world.size), disable=not world.is_main, desc=f"reference {split}",
                                  dynamic_ncols=True):
            chosen, rejected, _, _ = score(model, collate_pairs(indices, split_pairs, pad_id))
            ref[0, indices[:real]], ref[1, indices[:real]] = chosen[:real].float(), rejected[:real].float()
    model.train()
    if world.size > 1:
        dist.all_reduce(ref, op=dist.ReduceOp.MAX)
    if not torch.isfinite(ref).all():
        raise RuntimeError(f"reference pass left {int((~torch.isfinite(ref)).sum())} logprobs unset")
    return ref


def save_reference_logps(args, cache_dir: str, key: str, material: dict, split: str, ref: torch.Tensor) -> None:
    """Rank 0. Atomic: a crash never leaves a half-written cache file under the final name."""
    path = os.path.join(cache_dir, f"{key}.pt")
    os.makedirs(cache_dir, exist_ok=True)
    torch.save({"logps": ref.cpu(), "material": material}, path + ".tmp")
    with open(path + ".tmp", "rb") as f:
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    with open(os.path.join(cache_dir, f"{key}.json"), "w") as f:
        json.dump({**material, "split": split, "args": asdict(args)}, f, indent=1)
    print(f"reference logprobs: saved {path}")


def load_resumed_weights(model, resume_from: str, world: World) -> None:
    """The trained full weights of a checkpoint, now that the reference pass has used the initial ones."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    weights = (AutoModelForCausalLM.from_pretrained(resume_from, dtype=torch.float32).state_dict() if world.is_main
               else {})
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True,
                                                                 broadcast_from_rank0=world.size > 1))


def evaluate(args, world: World, model, score, eval_pairs: list[dict], ref_eval: tuple | None, pad_id: int) -> dict:
    """Held-out pairs: loss, reward accuracy (what DPO optimises) and policy accuracy.

    `eval/accuracy`: chosen reward > rejected reward. With a reference it starts at 0 (the
    policy is the reference, every margin is 0) and measures how often training moved the
    pair the right way. `eval/policy_accuracy`: the policy itself gives the chosen answer the
    higher mean per-token logprob; meaningful before training too.
    """
    sums = torch.zeros(5, dtype=torch.float64, device=world.device)  # loss, accuracy, margin, policy accuracy, pairs
    model.eval()
    with torch.no_grad():
        for indices, real in shard_batches(len(eval_pairs), args.per_device_train_batch_size, world.rank, world.size):
            batch = collate_pairs(indices, eval_pairs, pad_id)
            chosen, rejected, chosen_mean, rejected_mean = score(model, batch)
            idx = batch["index"].to(world.device)
            losses, chosen_r, rejected_r = preference_loss(args, chosen, rejected, ref_eval, idx)
            for i, value in enumerate([losses, (chosen_r > rejected_r).float(), chosen_r - rejected_r,
                                       (chosen_mean > rejected_mean).float(), torch.ones_like(losses)]):
                sums[i] += value[:real].double().sum()
    model.train()
    if world.size > 1:
        dist.all_reduce(sums)
    n = max(sums[4].item(), 1)
    return {"eval/loss": sums[0].item() / n, "eval/accuracy": sums[1].item() / n,
            "eval/rewards/margin": sums[2].item() / n, "eval/policy_accuracy": sums[3].item() / n}


def train_step(args, world: World, train_model, score, micro: list[dict], ref_train: tuple | None) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches of one step, accumulating the gradients.

    Returns this rank's sums: loss, rewards chosen / rejected, accuracy, logps chosen / rejected, tokens, NLL.
    """
    stats = torch.zeros(8, dtype=torch.float64, device=world.device)
    for k, mb in enumerate(micro):
        sync_gradients(args, world, train_model, last=k == len(micro) - 1)
        chosen, rejected, chosen_mean, _ = score(train_model, mb)
        idx = mb["index"].to(world.device)
        # ALGORITHM: every pair weighs the same. Mean over this micro-batch, / accum over the
        # accumulation steps; DDP / FSDP2 average over ranks: the mean over the global batch.
        losses, chosen_r, rejected_r = preference_loss(args, chosen, rejected, ref_train, idx)
        nll = -chosen_mean.float()  # RPO's term: the chosen answer's per-token NLL, per pair
        ((losses.mean() + args.rpo_alpha * nll.mean()) / len(micro)).backward()
        stats += torch.stack([losses.detach().sum(), chosen_r.sum(), rejected_r.sum(),
                              (chosen_r > rejected_r).float().sum(), chosen.detach().sum(), rejected.detach().sum(),
                              torch.tensor(float(sum(mb["doc_lengths"])), device=world.device),
                              nll.detach().sum()]).double()
    return stats


# -------------------------------------------------------------------------------------------------
def main():
    args = chat_template.parse_stage_args(Args, UNSUPPORTED_FLAGS)
    if not args.model_name_or_path or not args.dataset_mixer_list:
        raise SystemExit("--model_name_or_path and --dataset_mixer_list are required")
    if not args.cache_reference_only:  # that writes only the reference cache, nothing into output_dir
        check_output_dir(args.output_dir, args.resume, args.overwrite_output_dir, int(os.environ.get("RANK", 0)) == 0)
    if args.loss_type not in DEFAULT_BETA:
        raise SystemExit(f"unknown --loss_type {args.loss_type!r} (dpo | dpo_norm | simpo | ipo)")
    if args.beta is None:
        args.beta = DEFAULT_BETA[args.loss_type]
    average_logps, use_reference = AVERAGE_LOGPS[args.loss_type], args.loss_type != "simpo"
    world = setup_world(args.seed)

    # ---- data: the run's global batches of pairs -----------------------------------------------
    tokenizer, pad_id = load_tokenizer(args)
    pairs, eval_pairs, drops, eval_drops = load_data(args, tokenizer, world)
    micro_bs, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_pairs = micro_bs * accum * world.size
    batches, epoch, total_steps, warmup_steps = plan_batches(args, len(pairs), global_pairs, lambda order: order,
                                                             "pairs")

    # ---- model; the reference logprobs; optimizer, resume --------------------------------------
    resume_from = resume_checkpoint(args.output_dir, args.resume, world.is_main)
    # Always the initial weights here: the reference pass below needs them; resumed full weights are
    # loaded after it.
    model, train_model, autocast, bf16, shape = build_model(args, world, args.model_name_or_path, resume_from,
                                                            rows_per_forward=2 * micro_bs)  # chosen and rejected
    score = functools.partial(pair_logps, autocast=autocast, average_logps=average_logps, device=world.device)
    splits = {"train": pairs, **({"eval": eval_pairs} if eval_pairs else {})} if use_reference else {}
    tables, reference_log, cache_dir = reference_tables(args, world, model, score, tokenizer, pad_id, splits,
                                                        average_logps, bf16)
    ref_train, ref_eval = tables.get("train"), tables.get("eval")
    if args.cache_reference_only:
        if world.is_main:
            print(json.dumps(reference_log))
        finish(world, None)
        return
    if resume_from and not args.use_lora:
        load_resumed_weights(model, resume_from, world)
    trainable, optimizer = make_optimizer(args, model)
    start_step = restore_training_state(args, world, model, optimizer, resume_from)

    # ---- logging -----------------------------------------------------------------------------------
    peak, _, peak_source = measure_peaks(world.device, dtype=torch.bfloat16 if bf16 else torch.float32)
    peak_total = world.all_reduce_sum([peak])[0]
    derived = {"world_size": world.size, "global_batch_pairs": global_pairs, "total_steps": total_steps,
               "warmup_steps": warmup_steps, "epochs": epoch, "pairs": len(pairs), "eval_pairs": len(eval_pairs),
               "dropped": dict(drops), "eval_dropped": dict(eval_drops), "beta": args.beta,
               "logps_reduction": "mean" if average_logps else "sum", "reference_cache_dir": cache_dir,
               "trained_params": sum(p.numel() for _, p in trainable),
               "non_embedding_params": shape[0], "fsdp": args.use_fsdp, "bf16": bf16,
               "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
               "peak_flops_per_device": peak, "peak_flops_source": peak_source, "resume_from": resume_from}
    run_log = RunLog(args, world, derived, resume_from)
    run_log.log({"step": start_step, **reference_log,
                 **(evaluate(args, world, model, score, eval_pairs, ref_eval, pad_id) if eval_pairs else {})})
    progress = tqdm(total=total_steps, initial=start_step, disable=not world.is_main, desc="dpo", dynamic_ncols=True)

    # ---- loop --------------------------------------------------------------------------------------
    train_model.train()
    for step in range(start_step, total_steps):
        lr = set_lr(args, optimizer, step, total_steps, warmup_steps)
        if args.save_steps > 0 and step > start_step and step % args.save_steps == 0:  # the state after `step` updates
            save_checkpoint(args, world, model, tokenizer, optimizer, step, total_steps, warmup_steps, resume_from)
        t0 = time.perf_counter()
        batch_epoch, indices = batches[step]
        micro = [collate_pairs(part, pairs, pad_id) for part in micro_batches(indices, world, micro_bs, accum)]
        local_flops = sum(train_flops(mb["doc_lengths"], *shape) for mb in micro)
        stats = train_step(args, world, train_model, score, micro, ref_train)
        grad_norm = clip_and_step(args, trainable, optimizer)
        if world.size > 1:
            dist.all_reduce(stats)
        step_flops = world.all_reduce_sum([local_flops])[0]
        dt = time.perf_counter() - t0
        # MFU <= 1: a step faster than the measured peak proves the devices' peak is at least its rate
        peak_total = max(peak_total, step_flops / dt)
        progress.update(1)
        last_step = step + 1 == total_steps
        eval_now = bool(eval_pairs) and (last_step or (args.eval_steps > 0 and (step + 1) % args.eval_steps == 0))
        loss, r_chosen, r_rejected, acc, logp_c, logp_r = (stats[:6] / global_pairs).tolist()
        metrics = {"step": step + 1, "train/loss": loss, "train/rewards/chosen": r_chosen,
                   "train/rewards/rejected": r_rejected, "train/rewards/margin": r_chosen - r_rejected,
                   "train/accuracy": acc, "train/logps/chosen": logp_c, "train/logps/rejected": logp_r,
                   "train/nll": stats[7].item() / global_pairs, "train/lr": lr, "train/grad_norm": grad_norm,
                   "train/epoch": batch_epoch, "time/step_s": dt, "perf/tokens_per_s": stats[6].item() / dt,
                   "perf/mfu": step_flops / dt / peak_total}
        progress.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.2f}", lr=f"{lr:.2e}")
        if eval_now:  # the model after step + 1 updates
            metrics.update(evaluate(args, world, model, score, eval_pairs, ref_eval, pad_id))
        run_log.log(metrics, echo=eval_now or last_step or (step + 1) % max(1, args.logging_steps) == 0)
    progress.close()
    save_final_model(args, world, model, tokenizer)
    finish(world, run_log)


if __name__ == "__main__":
    main()
