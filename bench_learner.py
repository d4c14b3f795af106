"""The learner at Olmo 3 scale: one FSDP2 bf16 step at 32K tokens, measured against its memory plan.

Olmo 3 7B think RL packs 2,048 prompt + 32,768 response = 35,840 tokens per learner row. This check
builds a randomly initialised model of Olmo 3 7B's shape (hidden 4096, 32 heads, MLP 11008, vocabulary
100,278) with fewer layers, so that it needs no download and fits one GPU, packs eight samples into one
35,840-token row (restarting position ids), and runs grpo.py's learner path on it: the chunked LM head,
gradient checkpointing, FSDP2 with bf16 compute and fp32 master weights, the GRPO loss, AdamW. It
prints grpo.py's memory plan for the same shape beside the measured peak, and the step's MFU
(model FLOPs: 6 x non-embedding parameters per token plus causal attention, without the recompute).

    torchrun --nproc-per-node 1 bench_learner.py                  # one GPU, 4 layers (about 3 min)
    torchrun --nproc-per-node 8 bench_learner.py --num_layers 32  # the real depth, sharded over 8 GPUs
    python bench_learner.py --device cpu --num_layers 2 --hidden_size 128 --intermediate_size 256 \\
        --num_heads 2 --tokens 1024 --vocab_size 1000              # a smoke test of the script itself
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import HfArgumentParser, Olmo3Config, Olmo3ForCausalLM

import grpo


@dataclass
class Args:
    device: str = field(default="cuda", metadata={"help": "cuda (NCCL) or cpu (gloo; a smoke test, no MFU peak)"})
    num_layers: int = field(default=4, metadata={"help": "decoder layers (Olmo 3 7B: 32)"})
    hidden_size: int = field(default=4096, metadata={"help": "Olmo 3 7B: 4096"})
    intermediate_size: int = field(default=11008, metadata={"help": "Olmo 3 7B: 11008"})
    num_heads: int = field(default=32, metadata={"help": "attention (and key/value) heads; Olmo 3 7B: 32"})
    vocab_size: int = field(default=100278, metadata={"help": "Olmo 3's tokenizer: 100,278"})
    tokens: int = field(default=35840,
                        metadata={"help": "tokens in the packed row (Olmo 3 7B think RL: 2,048 + 32,768)"})
    samples_per_row: int = field(default=8, metadata={"help": "samples packed into the row (separate segments)"})
    logprob_chunk_size: int = field(default=1024, metadata={"help": "grpo.py's --logprob_chunk_size"})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "grpo.py's --gradient_checkpointing"})
    bf16: bool = field(default=True, metadata={"help": "bf16 compute (FSDP2 mixed precision), fp32 master weights"})
    steps: int = field(default=2, metadata={"help": "learner steps; the last is measured (the first warms up)"})
    peak_flops: float = field(default=989e12, metadata={"help": "peak FLOP/s per GPU (H100 / H200 bf16 dense: 989e12)"})


def model_flops(config, non_embedding_params: int, segment_lengths: list[int]) -> float:
    """Forward + backward FLOPs of one packed row: 6 x N per token, plus causal attention (QK^T and AV,
    2 x 2 x hidden x context per token and layer forward, mean causal context L / 2, backward twice)."""
    tokens = sum(segment_lengths)
    attention = 6 * config.num_hidden_layers * config.hidden_size * sum(n * n for n in segment_lengths)
    return 6.0 * non_embedding_params * tokens + attention


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # plain `python bench_learner.py`: a world of one
    os.environ.setdefault("MASTER_PORT", "29517")
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600))
    config = Olmo3Config(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                         num_attention_heads=args.num_heads, num_key_value_heads=args.num_heads,
                         max_position_embeddings=max(65536, args.tokens), tie_word_embeddings=False,
                         layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                      for i in range(args.num_layers)])
    import importlib.util
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    config._attn_implementation = "flash_attention_2" if flash else "sdpa"
    plan = grpo.memory_plan(config, args.tokens, 1, world_size, args.bf16, args.gradient_checkpointing,
                            args.logprob_chunk_size, flash_attention=flash, fsdp=True)

    torch.manual_seed(0)
    with device:
        model = Olmo3ForCausalLM(config)
    non_embedding = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    grpo.install_chunked_head(model, args.logprob_chunk_size)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    # One packed row of `samples_per_row` samples: half prompt, half response each; random tokens.
    length = args.tokens // args.samples_per_row
    segments = [length] * (args.samples_per_row - 1) + [args.tokens - length * (args.samples_per_row - 1)]
    rows = [{"prompt_ids": torch.randint(0, args.vocab_size, (n // 2,)).tolist(),
             "response_ids": torch.randint(0, args.vocab_size, (n - n // 2,)).tolist(),
             "sampling_logprobs": [-1.0] * (n - n // 2), "advantage": 1.0 if i % 2 else -1.0}
            for i, n in enumerate(segments)]
    batch = grpo.collate_bin(rows)
    model.train()
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        new_lp, _ = grpo.token_logprobs(model, batch)
        dev = new_lp.device
        loss, _ = grpo.grpo_loss(new_lp[None], new_lp.detach()[None], batch["sampling_logprobs"].to(dev)[None],
                                 batch["advantages"].to(dev)[None], batch["mask"].to(dev)[None], 0.2, 0.272, 2.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    gib = 2 ** 30
    flops = model_flops(config, non_embedding, segments)
    result = {
        "shape": {"layers": args.num_layers, "hidden": args.hidden_size, "vocab": args.vocab_size,
                  "tokens": args.tokens, "learners": world_size, "attention": config._attn_implementation},
        "plan_gib": {k: round(v / gib, 2) for k, v in plan.items()},
        "measured_peak_gib": round(torch.cuda.max_memory_allocated(device) / gib, 2) if cuda else None,
        "step_s": round(seconds, 3), "tokens_per_s": round(args.tokens / seconds, 1),
        "mfu": round(flops / seconds / args.peak_flops, 4) if cuda else None,
        "loss": loss.item(),
    }
    if rank == 0:
        print(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
