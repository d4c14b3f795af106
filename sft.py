"""Supervised finetuning (SFT) on chat data: the first stage of the Olmo 3 post-training recipe.

What it trains: a causal LM on conversations (`messages` rows), next-token cross-entropy on the
assistant's tokens only. Which tokens are trained comes from the chat template's
`{% generation %}` blocks through `chat_template.py` (Olmo 3 sec 4 / the tokenizer-settings note:
reasoning, answer, tool calls and the closing token are trained; system, user, tool results, the
assistant header and inter-turn whitespace are not).

Departures from Olmo 3 (which ran SFT in olmo-core):
  - Defaults follow Tulu 3's SFT (open-instruct `finetune.py`, Tulu 3 paper Table 6): lr 5e-6,
    2 epochs, effective batch 128 sequences, linear schedule, 3% warmup, no weight decay,
    max length 4096. Olmo 3 used packed 32K sequences and per-size learning rates: pass them.
  - The loss is summed over trained tokens and divided by the number of trained tokens in the
    whole optimizer step (all ranks, all accumulation micro-batches): every trained token weighs
    the same however the batch is split. (A per-micro-batch mean over-weights short answers.)
  - Packing (`--packing`) is greedy in shuffled order and never splits a conversation; attention
    and position ids restart at every conversation, so a packed row is exactly several
    independent sequences (tested against the unpacked batch).
  - Master weights stay fp32 on GPU too (bf16 autocast for DDP, bf16 compute / fp32 reduce for
    FSDP2): a bf16 weight cannot hold an update of lr 5e-6 x O(1).

Launch (the same file everywhere; torchrun sets the ranks, world size 1 runs the same code):

    # one GPU
    python sft.py --model_name_or_path allenai/Olmo-3-1025-7B --dataset_mixer_list allenai/Dolci-Think-SFT 1.0 \\
        --per_device_train_batch_size 1 --gradient_accumulation_steps 128 --gradient_checkpointing \\
        --use_lora --output_dir output/sft
    # one node, 8 GPUs (FSDP2 shards a model that does not fit one GPU)
    torchrun --nproc-per-node 8 sft.py --model_name_or_path allenai/Olmo-3-1025-7B \\
        --dataset_mixer_list allenai/Dolci-Think-SFT 1.0 other/mix.jsonl 0.5 --use_fsdp --packing \\
        --gradient_checkpointing --per_device_train_batch_size 1 --gradient_accumulation_steps 16 \\
        --report_to wandb --output_dir output/sft
    # two nodes (run on each node; NODE_RANK 0 and 1, MASTER_ADDR = node 0)
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 --master-addr $MASTER_ADDR --master-port 29500 \\
        sft.py --use_fsdp --packing ... (as above)
    # tiny CPU run on the toy model: 2 ranks x 8 rows, 374 steps; loss 5.9 -> 0.58, the boxed-answer
    # format always, ~3-6% of the toy problems right (measured: 18 min at ~900 tokens/s on 2 shared, busy cores)
    python toy.py model /tmp/toy && python toy.py data /tmp/toy_data
    torchrun --nproc-per-node 2 sft.py --model_name_or_path /tmp/toy --dataset_mixer_list /tmp/toy_data/sft.jsonl 1.0 \\
        --num_train_epochs 2 --learning_rate 3e-3 --per_device_train_batch_size 8 --gradient_accumulation_steps 1 \\
        --output_dir /tmp/toy_sft

Outputs in `--output_dir`: the final model as a Hugging Face directory (weights, config, tokenizer
and its chat template; with `--use_lora` the peft adapter, and with `--merge_lora` also the merged
model in `merged/`), `metrics.jsonl` (one JSON line per step), and `checkpoints/step_N/` (the HF
directory plus `training_state.pt` and per-rank RNG files; `checkpoints/latest` names the newest
complete one; the newest `--keep_last_n_checkpoints` stay). `--resume` continues from it exactly:
same data order, same schedule, same losses. An output_dir that holds a previous run needs `--resume`
(with no checkpoint yet it starts fresh) or `--overwrite_output_dir`.
"""

from __future__ import annotations

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


@dataclass
class Args:
    # --- run and logging ---
    output_dir: str = field(default="output/sft", metadata={
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
    resume: bool = field(default=False, metadata={"help": "continue from output_dir/checkpoints/latest (same args)"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "start over in an output_dir that holds a previous run (deletes its checkpoints and metrics)"})
    keep_last_n_checkpoints: int = field(default=2, metadata={
        "help": "keep the newest N checkpoints (0: all); the one a --resume started from is never deleted"})
    # --- model and data ---
    model_name_or_path: str = field(default=None, metadata={
        "help": "HF model directory or hub id (offline: a local dir)"})
    dataset_mixer_list: list[str] = field(default_factory=list, metadata={
        "aliases": ["--mixer_list"],
        "help": "source / amount pairs: `a.jsonl 1.0 org/b 500` (a fraction <= 1 or a row count per source)"})
    dataset_mixer_list_splits: list[str] = field(default_factory=lambda: ["train"], metadata={
        "help": "split of each Hub source: one for all or one per source (Olmo 3: train)"})
    chat_template: str = field(default=None, metadata={
        "aliases": ["--chat_template_name"],
        "help": "a template name (`python chat_template.py list`) or a .jinja path; default: the tokenizer's own. "
                "The template used for training is saved with the model"})
    max_seq_length: int = field(
        default=4096, metadata={"help": "max tokens per conversation (and per packed row); Tulu 3: 4096"})
    over_length_strategy: str = field(default="drop", metadata={
        "help": "what to do with longer conversations (see chat_template.py)"})
    packing: bool = field(default=False, metadata={
        "help": "pack several conversations per row up to max_seq_length (attention never crosses them)"})
    # --- algorithm (defaults: Tulu 3 SFT, open-instruct finetune.py) ---
    num_train_epochs: int = field(default=2, metadata={"help": "passes over the data (Tulu 3: 2)"})
    max_steps: int = field(default=-1, metadata={"aliases": ["--max_train_steps"],
                                                 "help": "optimizer steps; overrides num_train_epochs when > 0"})
    learning_rate: float = field(default=5e-6, metadata={"help": "peak AdamW learning rate (Tulu 3 8B: 5e-6)"})
    lr_scheduler_type: str = field(default="linear", metadata={
        "help": "linear | cosine decay to 0 after warmup, or constant (Tulu 3: linear)"})
    warmup_ratio: float = field(default=0.03, metadata={"help": "fraction of steps with linear warmup (Tulu 3: 0.03)"})
    weight_decay: float = field(default=0.0, metadata={
        "help": "AdamW weight decay on matrices; never on norms (Tulu 3: 0)"})
    max_grad_norm: float = field(default=1.0, metadata={
        "aliases": ["--clip_grad_norm"], "help": "clip the global gradient norm (<= 0: no clipping, still logged)"})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "rows per micro-batch per rank"})
    gradient_accumulation_steps: int = field(default=16, metadata={
        "help": "micro-batches per optimizer step (Tulu 3: 1 x 16 x 8 GPUs = 128 sequences)"})
    use_lora: bool = field(default=False, metadata={"help": "train LoRA adapters (peft) instead of all weights"})
    lora_rank: int = field(default=64, metadata={"help": "LoRA rank (open-instruct: 64)"})
    lora_alpha: float = field(default=16, metadata={
        "help": "LoRA alpha; the update is scaled by alpha / rank (open-instruct: 16)"})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"], metadata={
        "help": "module names to adapt, or `all-linear` (every linear layer except the LM head)"})
    merge_lora: bool = field(default=False, metadata={"help": "also save base + adapter merged, in output_dir/merged"})
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


# Flags of the Olmo 3 SFT launch scripts (OLMo-core's, in open-instruct scripts/train/olmo3/7b_*_sft.sh) that
# this script does not take, with what to use instead; chat_template.COMMON_UNSUPPORTED_FLAGS adds the ones
# all stages refuse. open-instruct's names of options we share are aliases in `Args` (see --help).
UNSUPPORTED_FLAGS = {
    "trainer.max_duration.value": "use --num_train_epochs (Olmo 3 7B SFT: 2)",
    "train_module.optim.lr": "use --learning_rate (Olmo 3 7B Think SFT: 5e-5, Instruct SFT: 8e-5)",
    "trainer.callbacks.wandb.enabled": ({"false"}, "use --report_to wandb"),
    "seq_len": "use --max_seq_length with --packing (OLMo-core packs conversations into rows of seq_len tokens; "
               "Olmo 3: 32768)",
    "global_batch_size": "a step here is per_device_train_batch_size x gradient_accumulation_steps x ranks rows "
                         "(OLMo-core counts tokens: 1048576 = 32 packed rows of 32768)",
    "launch.num_gpus": "launch with torchrun --nproc-per-node N",
    "num_nodes": "launch with torchrun --nnodes N --node-rank R --rdzv-endpoint HOST:PORT",
    "model_name": "use --model_name_or_path (an HF checkpoint directory or hub id)",
    "dataset_path": "use --dataset_mixer_list SOURCE 1.0 with chat data (messages), e.g. allenai/Dolci-Think-SFT-7B; "
                    "OLMo-core's pre-tokenized numpy files are not read",
    "dataset_mixer_eval_list": "not needed here: sft.py has no held-out evaluation",
    # grpo.py's names of the same ideas
    "num_training_steps": "use --max_steps (optimizer steps; overrides --num_train_epochs when > 0)",
    "eval_every": "not needed here: sft.py has no held-out evaluation",
}

# Arguments a resumed run may change without the "changed arguments" warning: they do not change what is trained.
RESUME_IGNORED_ARGS = ("resume", "use_fsdp", "save_steps", "logging_steps", "report_to")


# -------------------------------------------------------------------------------------------------
# ALGORITHM: rows of conversations, batches, the loss
# -------------------------------------------------------------------------------------------------
def pack_rows(lengths: list[int], order: list[int], max_seq_length: int, packing: bool) -> list[list[int]]:
    """Conversation indices (in `order`) -> rows, each a list of conversation indices.

    Without packing a row is one conversation. With packing, conversations are appended greedily
    until the next one would overflow `max_seq_length`; a conversation is never split.
    """
    if not packing:
        return [[i] for i in order]
    rows, row, used = [], [], 0
    for i in order:
        if row and used + lengths[i] > max_seq_length:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += lengths[i]
    if row:
        rows.append(row)
    return rows


def collate(rows: list[list[int]], examples: list[dict], pad_id: int) -> dict:
    """Rows of conversations -> `input_ids`, `targets`, `position_ids`, all (B, T), padded on the right.

    `targets[t]` is the label of token t + 1, shifted inside each conversation, so the last token
    of one conversation never predicts the first token of the next. Position ids restart at 0 for
    every conversation and for the padding: transformers (5.x) turns restarting position ids into
    a block-diagonal causal mask when no attention mask is passed (masking_utils.
    find_packed_sequence_indices), so attention never crosses conversations either.
    """
    seqs = []
    for row in rows:
        ids, tgt, pos = [], [], []
        for i in row:
            ex = examples[i]
            ids += ex["input_ids"]
            tgt += ex["labels"][1:] + [-100]
            pos += range(len(ex["input_ids"]))
        seqs.append((ids, tgt, pos))
    width = max(len(s[0]) for s in seqs)
    batch = {"input_ids": [], "targets": [], "position_ids": []}
    for ids, tgt, pos in seqs:
        pad = width - len(ids)
        batch["input_ids"].append(ids + [pad_id] * pad)
        batch["targets"].append(tgt + [-100] * pad)
        batch["position_ids"].append(pos + list(range(pad)))  # the padding is its own "conversation"
    batch = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
    batch["doc_lengths"] = [len(examples[i]["input_ids"]) for row in rows for i in row]  # for FLOPs
    return batch


def token_nll(model, batch: dict, device) -> torch.Tensor:
    """Per-token negative log-likelihood (B, T), 0 where the target is -100.

    No attention mask on purpose: with `attention_mask=None` (and no KV cache) transformers builds
    the per-conversation causal mask from the restarting `position_ids` (see `collate`). The LM
    head runs in chunks (`target_logprobs`): no (B, T, V) logits tensor.
    """
    targets = batch["targets"].to(device)  # (B, T)
    logprobs, _ = target_logprobs(model, batch["input_ids"].to(device), batch["position_ids"].to(device), targets)
    return -logprobs * (targets != -100)


# ALGORITHM: the SFT loss. Summed over this micro-batch's trained tokens and divided by the trained
# tokens of the whole optimizer step (all ranks, all accumulation steps, all-reduced before any
# backward). Accumulating these gradients over micro-batches and summing over ranks gives
# d(sum of all token NLLs / all trained tokens): every token weighs the same, however the batch is
# split. DDP and FSDP2 *average* gradients over ranks, so the loss is multiplied by world_size to
# turn their average back into a sum.
def sft_loss(model, batch: dict, device, num_trained_tokens: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (loss to backpropagate, detached NLL sum of this micro-batch for logging)."""
    nll_sum = token_nll(model, batch, device).sum()
    return nll_sum * world_size / num_trained_tokens, nll_sum.detach()


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
# ALGORITHM: this stage's data and its training step
# -------------------------------------------------------------------------------------------------
def load_data(args, tokenizer, world: World) -> tuple[list[dict], dict]:
    """The mixture's conversations tokenized for SFT, [{"input_ids", "labels"}], and the drops by reason."""
    if not world.is_main:
        world.barrier()  # rank 0 fills the datasets cache first
    dataset = chat_template.load_mixture(args.dataset_mixer_list, split=args.dataset_mixer_list_splits, seed=args.seed)
    dataset, drops = chat_template.tokenize_sft(dataset, tokenizer, args.max_seq_length,
                                                over_length_strategy=args.over_length_strategy,
                                                chat_template=args.chat_template)
    if world.is_main:
        world.barrier()
    notice = chat_template.prefix_labeling_notice(tokenizer, args.chat_template, drops)
    if notice and world.is_main:  # once, at start-up: labels a template without generation blocks cannot give
        print(f"WARNING: {notice}", flush=True)
    examples = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in dataset]
    if not examples:
        raise SystemExit(f"no trainable rows left (dropped: {dict(drops)})")
    return examples, drops


def train_step(args, world: World, train_model, autocast, micro: list[dict], shape: tuple) -> tuple:
    """Forward and backward over this rank's micro-batches of one step, accumulating the gradients.

    The trained tokens of the whole step (all ranks, all micro-batches) are counted first: `sft_loss`
    divides by them. Returns this rank's NLL sum and, over all ranks, the trained tokens, tokens and FLOPs.
    """
    local_trained = sum(int((mb["targets"] != -100).sum()) for mb in micro)
    local_flops = sum(train_flops(mb["doc_lengths"], *shape) for mb in micro)
    num_trained, num_tokens, step_flops = world.all_reduce_sum(
        [local_trained, sum(sum(mb["doc_lengths"]) for mb in micro), local_flops])
    nll_total = 0.0
    for k, mb in enumerate(micro):
        sync_gradients(args, world, train_model, last=k == len(micro) - 1)
        with autocast:
            loss, nll_sum = sft_loss(train_model, mb, world.device, max(num_trained, 1), world.size)
        loss.backward()
        nll_total += nll_sum.item()
    return nll_total, num_trained, num_tokens, step_flops


# -------------------------------------------------------------------------------------------------
def main():
    args = chat_template.parse_stage_args(Args, UNSUPPORTED_FLAGS)
    if not args.model_name_or_path or not args.dataset_mixer_list:
        raise SystemExit("--model_name_or_path and --dataset_mixer_list are required")
    check_output_dir(args.output_dir, args.resume, args.overwrite_output_dir, int(os.environ.get("RANK", 0)) == 0)
    world = setup_world(args.seed)

    # ---- data: the run's global batches of rows (a row: one conversation, or several packed) ----
    tokenizer, pad_id = load_tokenizer(args)
    examples, drops = load_data(args, tokenizer, world)
    lengths = [len(e["input_ids"]) for e in examples]
    micro_bs, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_rows = micro_bs * accum * world.size
    batches, epoch, total_steps, warmup_steps = plan_batches(
        args, len(examples), global_rows, lambda order: pack_rows(lengths, order, args.max_seq_length, args.packing),
        "rows")

    # ---- model, optimizer, resume ----------------------------------------------------------------
    resume_from = resume_checkpoint(args.output_dir, args.resume, world.is_main)
    weights_from = resume_from if (resume_from and not args.use_lora) else args.model_name_or_path
    model, train_model, autocast, bf16, shape = build_model(args, world, weights_from, resume_from,
                                                            rows_per_forward=micro_bs)
    trainable, optimizer = make_optimizer(args, model)
    start_step = restore_training_state(args, world, model, optimizer, resume_from)

    # ---- logging -----------------------------------------------------------------------------------
    peak, _, peak_source = measure_peaks(world.device, dtype=torch.bfloat16 if bf16 else torch.float32)
    peak_total = world.all_reduce_sum([peak])[0]
    derived = {"world_size": world.size, "global_batch_rows": global_rows, "total_steps": total_steps,
               "warmup_steps": warmup_steps, "epochs": epoch, "conversations": len(examples),
               "dropped": dict(drops), "trained_params": sum(p.numel() for _, p in trainable),
               "non_embedding_params": shape[0], "fsdp": args.use_fsdp, "bf16": bf16,
               "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
               "peak_flops_per_device": peak, "peak_flops_source": peak_source, "resume_from": resume_from}
    run_log = RunLog(args, world, derived, resume_from)
    progress = tqdm(total=total_steps, initial=start_step, disable=not world.is_main, desc="sft", dynamic_ncols=True)

    # ---- loop --------------------------------------------------------------------------------------
    train_model.train()
    for step in range(start_step, total_steps):
        lr = set_lr(args, optimizer, step, total_steps, warmup_steps)
        if args.save_steps > 0 and step > start_step and step % args.save_steps == 0:  # the state after `step` updates
            save_checkpoint(args, world, model, tokenizer, optimizer, step, total_steps, warmup_steps, resume_from)
        t0 = time.perf_counter()
        batch_epoch, rows = batches[step]
        micro = [collate(part, examples, pad_id) for part in micro_batches(rows, world, micro_bs, accum)]
        nll_total, num_trained, num_tokens, step_flops = train_step(args, world, train_model, autocast, micro, shape)
        grad_norm = clip_and_step(args, trainable, optimizer)
        nll_total = world.all_reduce_sum([nll_total])[0]
        dt = time.perf_counter() - t0
        # MFU <= 1: a step faster than the measured peak proves the devices' peak is at least its rate
        peak_total = max(peak_total, step_flops / dt)
        progress.update(1)
        last_step = step + 1 == total_steps
        metrics = {"step": step + 1, "train/loss": nll_total / max(num_trained, 1), "train/lr": lr,
                   "train/grad_norm": grad_norm, "train/epoch": batch_epoch,
                   "train/trained_tokens": int(num_trained), "time/step_s": dt,
                   "perf/tokens_per_s": num_tokens / dt, "perf/mfu": step_flops / dt / peak_total}
        progress.set_postfix(loss=f"{metrics['train/loss']:.4f}", lr=f"{lr:.2e}")
        run_log.log(metrics, echo=last_step or (step + 1) % max(1, args.logging_steps) == 0)
    progress.close()
    save_final_model(args, world, model, tokenizer)
    finish(world, run_log)


if __name__ == "__main__":
    main()
