"""The embedded default: a tiny Olmo 3 model, its tokenizer, and synthetic verifiable tasks, all offline.

Everything here is built from a seed on the spot, so the demo and the tests need no download:

    python toy.py model OUT_DIR        # tiny Olmo3ForCausalLM + fast tokenizer (save_pretrained format)
    python toy.py data OUT_DIR         # sft.jsonl, preference.jsonl, rlvr.jsonl, eval.jsonl
    python toy.py eval MODEL_DIR OUT_DIR/eval.jsonl   # greedy accuracy, scored by verifiers.py
    python toy.py report --stage base=DIR --stage sft=DIR ... --eval_path EVAL --out_dir DIR   # demo table
    python toy.py tool_data OUT_DIR    # the tool task: sft_tools, rlvr_/eval_tools and rlvr_/eval_notools.jsonl
    python toy.py tool_eval MODEL_DIR OUT_DIR/eval_tools.jsonl        # greedy multi-turn episodes with the tool
    python toy.py tool_report --stage sft=DIR ... --eval tools=EVAL --out_dir DIR   # demo_tools.sh's table

The task is chained small-number arithmetic with a short reasoning trace and a boxed answer, written
in the formats real post-training datasets use (Dolci-style `messages`; `chosen` / `rejected`
message lists; RLVR rows with `ground_truth` and a `verifier` column):

    user:      What is 7+5-3?
    assistant: <think>7+5=12
               12-3=9</think>
               \\boxed{9}

Difficulty is adjustable (`--max_operand`, `--min_operands`, `--max_operands`): each extra operand
is one more step a tiny model must get right.

Each stage gets what it gets in the real recipe, so each has something to add:
  - SFT traces are distilled from an imperfect teacher and never verified (as most SFT data is).
    It makes two consistent slips, and imitation learns both along with everything else:
      - in an addition that crosses a ten it forgets the carry with probability
        `--teacher_carry_slip` (default 0.75: `17+5=12`), and carries the error forward;
      - in a trace of two or more steps it boxes the result of the step before the last with
        probability `--teacher_box_slip` (default 0.75: `<think>3+5=8\\n8+1=9</think>\\n\\boxed{8}`).
    Both are well above one half, so greedy decoding after SFT makes both slips whatever the seed (at 0.6
    the model's learned odds sat near even, and which answers greedy decoding got right changed with the
    seed: SFT greedy accuracy 11.5 / 12.5 / 36.5% in three seeds); both stay below one, so sampling
    still finds the right answer for RL to reinforce.
  - Preference pairs follow Olmo 3's delta learning: the chosen answer is correct, the rejected one
    is what a weaker model writes (it forgets every carry; where there is none, one step is off by
    a little). The contrast teaches the carry. Both sides box their own last step, so the box slip
    is not in the contrast and DPO has little reason to fix it.
  - RLVR prompts come with the true answer only: the verifier rewards the final answer, so RL
    unlearns both slips, fastest the box slip: one token per answer that decides the reward of a
    multi-step problem on its own (a tiny model's scattered arithmetic mistakes are too diffuse
    for a few CPU minutes of RL to fix).
Same seed, same bytes: the model weights, the tokenizer files and the data files are deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

# Olmo 3's special tokens. `<|endoftext|>` is both bos and eos, as in the released tokenizers.
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
# Added but not "special": they must survive `decode(skip_special_tokens=True)` for the verifiers.
MARKUP_TOKENS = ["<think>", "</think>", "<functions>", "</functions>", "<function_calls>", "</function_calls>"]
PROMPT_STYLES = ["What is {expr}?", "Compute {expr}.", "Calculate {expr}.", "{expr} = ?"]


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------
def make_problem(rng: random.Random, max_operand: int, num_operands: int) -> tuple[str, list[str], int]:
    """An expression like `7+5-3`, its steps (`7+5=12`, `12-3=9`) and the answer. Results stay >= 0."""
    value = rng.randint(0, max_operand)
    expr, steps = str(value), []
    for _ in range(num_operands - 1):
        operand = rng.randint(0, max_operand)
        if rng.random() < 0.5 or operand > value:
            new = value + operand
            steps.append(f"{value}+{operand}={new}")
            expr += f"+{operand}"
        else:
            new = value - operand
            steps.append(f"{value}-{operand}={new}")
            expr += f"-{operand}"
        value = new
    return expr, steps, value


def solution_text(steps: list[str], answer: int) -> str:
    return "<think>" + "\n".join(steps) + "</think>\n\\boxed{" + str(answer) + "}"


def parse_expression(expr: str) -> tuple[list[int], list[str]]:
    numbers = [int(x) for x in expr.replace("-", " - ").replace("+", " + ").split() if x.isdigit()]
    return numbers, [c for c in expr if c in "+-"]


def forgets_carry(value: int, op: str, operand: int) -> bool:
    """An addition of non-negative numbers whose ones digits sum past 9: the step that needs a carry."""
    return op == "+" and value >= 0 and value % 10 + operand % 10 >= 10


def teacher_solution(rng: random.Random, expr: str, carry_slip: float, box_slip: float = 0.0) -> tuple[str, int]:
    """The imperfect teacher's trace: in each addition that needs a carry it forgets the carry with
    probability `carry_slip` (17+5 -> 12, 7+5 -> 2), and carries its own result forward. In a trace
    of two or more steps it boxes the result of the step before the last with probability `box_slip`
    (it copies from the wrong line)."""
    numbers, ops = parse_expression(expr)
    value, steps, results = numbers[0], [], []
    for op, operand in zip(ops, numbers[1:]):
        new = value + operand if op == "+" else value - operand
        if forgets_carry(value, op, operand) and rng.random() < carry_slip:
            new -= 10
        steps.append(f"{value}{op}{operand}={new}")
        results.append(new)
        value = new
    # No draw when box_slip is 0 or there is one step: the data stays byte-identical to before.
    if box_slip > 0 and len(results) > 1 and rng.random() < box_slip:
        value = results[-2]
    return solution_text(steps, value), value


def needs_carry(expr: str) -> bool:
    """Whether solving `expr` step by step involves an addition that needs a carry."""
    numbers, ops = parse_expression(expr)
    value = numbers[0]
    for op, operand in zip(ops, numbers[1:]):
        if forgets_carry(value, op, operand):
            return True
        value = value + operand if op == "+" else value - operand
    return False


def wrong_solution(rng: random.Random, expr: str, steps: list[str]) -> tuple[str, int]:
    """A weaker model's answer (delta learning): it forgets every carry; in a problem without a
    carry, one step is off by 1-3 instead. Either way the error is carried forward."""
    if needs_carry(expr):
        return teacher_solution(rng, expr, carry_slip=1.0)
    numbers, ops = parse_expression(expr)
    bad_step = rng.randrange(len(ops))
    value, new_steps = numbers[0], []
    for i, (op, operand) in enumerate(zip(ops, numbers[1:])):
        new = value + operand if op == "+" else value - operand
        if i == bad_step:
            new += rng.choice([-3, -2, -1, 1, 2, 3])
        new_steps.append(f"{value}{op}{operand}={new}")
        value = new
    return solution_text(new_steps, value), value


def generate_data(seed: int = 0, num_sft: int = 8000, num_preference: int = 2000, num_rlvr: int = 4000,
                  num_eval: int = 200, max_operand: int = 9, min_operands: int = 2, max_operands: int = 4,
                  teacher_carry_slip: float = 0.75, teacher_box_slip: float = 0.75,
                  distinct_training_problems: bool = False) -> dict:
    """All splits as lists of rows. Evaluation problems are distinct and never appear in a training split. SFT
    traces come from the imperfect teacher (`teacher_solution`, both slips); preference, RLVR and eval answers
    are true.

    Training problems are drawn independently and may repeat (`distinct_training_problems=False`): there are
    only 155 two-operand problems with single-digit operands, so distinct draws would leave about 100 of them
    (1% of the SFT split) after the eval split takes its share, and whether a tiny model then answers the
    held-out two-operand problems at all was a matter of luck (3% or 42% greedy, by the SFT seed alone).
    Repeats keep each operand count at its share in every split."""
    rng = random.Random(seed)
    training = num_sft + num_preference + num_rlvr
    total = num_eval + (training if distinct_training_problems else 0)
    seen, problems = set(), []
    attempts = 0
    while len(problems) < total:
        attempts += 1
        if attempts > 50 * total:
            raise ValueError(f"cannot draw {total} distinct problems with max_operand={max_operand}, "
                             f"operands {min_operands}..{max_operands}: make the task harder or ask for fewer rows")
        problem = make_problem(rng, max_operand, rng.randint(min_operands, max_operands))
        if problem[0] not in seen:
            seen.add(problem[0])
            problems.append(problem)
    attempts = 0
    while len(problems) < num_eval + training:  # repeats allowed; never an eval problem
        attempts += 1
        if attempts > 50 * (num_eval + training):
            raise ValueError(f"the eval split holds every problem with max_operand={max_operand}, "
                             f"operands {min_operands}..{max_operands}: make the task harder or ask for fewer rows")
        problem = make_problem(rng, max_operand, rng.randint(min_operands, max_operands))
        if problem[0] not in seen:
            problems.append(problem)

    def prompt(expr):
        return rng.choice(PROMPT_STYLES).format(expr=expr)

    splits = {"sft": [], "preference": [], "rlvr": [], "eval": []}
    it = iter(problems)
    for _ in range(num_eval):
        expr, steps, answer = next(it)
        splits["eval"].append({"messages": [{"role": "user", "content": prompt(expr)}],
                               "ground_truth": str(answer), "verifier": "math", "dataset": "toy_arithmetic"})
    for _ in range(num_sft):
        expr, steps, answer = next(it)
        splits["sft"].append({"messages": [{"role": "user", "content": prompt(expr)},
                                           {"role": "assistant", "content": teacher_solution(
                                               rng, expr, teacher_carry_slip, teacher_box_slip)[0]}]})
    for _ in range(num_preference):
        expr, steps, answer = next(it)
        user = {"role": "user", "content": prompt(expr)}
        rejected, _ = wrong_solution(rng, expr, steps)
        splits["preference"].append({
            "chosen": [user, {"role": "assistant", "content": solution_text(steps, answer)}],
            "rejected": [user, {"role": "assistant", "content": rejected}],
        })
    for _ in range(num_rlvr):
        expr, steps, answer = next(it)
        splits["rlvr"].append({"messages": [{"role": "user", "content": prompt(expr)}],
                               "ground_truth": str(answer), "verifier": "math", "dataset": "toy_arithmetic"})
    return splits


def write_splits(out_dir: str, splits: dict[str, list[dict]]) -> dict[str, str]:
    """Each split as OUT_DIR/<name>.jsonl (keys sorted: same rows, same bytes); returns name -> path."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
    return paths


def write_data(out_dir: str, **kwargs) -> dict:
    return write_splits(out_dir, generate_data(**kwargs))


# ---------------------------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------------------------
def tokenizer_corpus(seed: int) -> list[str]:
    """Text the byte-level BPE learns its merges from: task data plus chat and tool-use markup."""
    from chat_template import DEV_SYSTEM, FUNCTIONS_PREAMBLE, NO_FUNCTIONS, OLMO_IDENTITY

    # Every draw setting fixed here, not the data defaults: changing a default must not change the tokenizer.
    splits = generate_data(seed=seed, num_sft=2000, num_preference=0, num_rlvr=0, num_eval=0,
                           teacher_carry_slip=0.6, teacher_box_slip=0.0, distinct_training_problems=False)
    texts = [m["content"] for row in splits["sft"] for m in row["messages"]]
    texts += ["system", "user", "assistant", "environment", "You are a helpful AI assistant.",
              "The answer is", "Final Answer: The final answer is", "function", "arguments", "name"] * 50
    # The templates' default system prompts: a real tokenizer compresses the text it sees every row,
    # and short rows keep the CPU demo fast.
    texts += [f"{DEV_SYSTEM} {NO_FUNCTIONS}", f"{OLMO_IDENTITY} {NO_FUNCTIONS}", FUNCTIONS_PREAMBLE] * 50
    return texts


def build_tokenizer(seed: int = 0, vocab_size: int = 512):
    """A fast byte-level BPE tokenizer: any text encodes, every digit is its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from chat_template import TEMPLATES

    tok = Tokenizer(models.BPE())
    # Digits split one by one before byte-level BPE, so no merge can fuse them (arithmetic stays legible).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[], show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=4096,
    )
    fast.add_tokens(MARKUP_TOKENS)
    fast.chat_template = TEMPLATES["olmo3-instruct-dev"]
    return fast


def build_model(tokenizer, seed: int = 0, hidden_size: int = 256, num_layers: int = 4, num_heads: int = 4,
                intermediate_size: int = 768, max_position_embeddings: int = 2048):
    """A tiny Olmo3ForCausalLM. head_dim is 64: vLLM's CPU attention rejects smaller heads."""
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    vocab_size = (len(tokenizer) + 63) // 64 * 64  # pad the embedding like real checkpoints do
    config = Olmo3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings, sliding_window=max_position_embeddings,
        # Olmo 3's pattern: three sliding-window layers, then one full-attention layer.
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "sliding_attention") for i in range(num_layers)],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, dtype="float32",
    )
    torch.manual_seed(seed)
    return Olmo3ForCausalLM(config).to(torch.float32)


def write_model(out_dir: str, seed: int = 0, **model_kwargs) -> str:
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(seed=seed)
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------
# Evaluation: greedy answers to the held-out split, scored by verifiers.py
# ---------------------------------------------------------------------------------------------
def box_matches_last_step(response: str) -> bool | None:
    """Whether a response boxes the result of its own last step (None: fewer than two steps or no box,
    where copying from the wrong line cannot be told apart). It measures the teacher's box slip."""
    results = re.findall(r"=(-?\d+)", response)
    boxed = re.search(r"\\boxed\{(-?\d+)\}", response)
    if len(results) < 2 or not boxed or results[-1] == results[-2]:
        return None
    return boxed.group(1) == results[-1]


def copies_operands(expr: str, response: str) -> bool | None:
    """Whether a response to a multi-step problem works through the expression's own operands in order:
    step k writes `<running value><op k><operand k+1>=`, whatever the running value (None: a one-step
    problem). A tiny model can learn to take, say, the last operand where the third belongs; then no
    carry or box fix makes the answer right, and the reward never tells it which number it skipped."""
    numbers, ops = parse_expression(expr)
    if len(ops) < 2:
        return None
    written = re.findall(r"-?\d+([+-])(\d+)=", response)
    return written[:len(ops)] == [(op, str(n)) for op, n in zip(ops, numbers[1:])]


def evaluate(model_dir: str, eval_path: str, max_new_tokens: int = 64, limit: int | None = None,
             batch_size: int = 64, num_samples: int = 4, temperature: float = 1.0, seed: int = 0) -> dict:
    """Greedy-decode each eval prompt with transformers and score it with its row's verifier; then,
    if num_samples > 0, sample num_samples completions per prompt at `temperature` and report their
    mean score (pass@1 as reasoning models are evaluated, and the quantity RL optimizes: grpo.py's
    eval/pass@1 uses the same estimator at its training temperature).

    Plain `generate` rather than vLLM: for a model this small it is faster than starting an engine,
    and it keeps evaluation independent of the RL actor code it is used to check.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import verifiers
    from chat_template import tokenize_prompt

    with open(eval_path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:limit]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id

    def generate(rows: list[dict], **sampling) -> list[str]:
        responses = []
        for start in range(0, len(rows), batch_size):
            prompts = [tokenize_prompt(tokenizer, row["messages"]) for row in rows[start:start + batch_size]]
            width = max(map(len, prompts))
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding for generation
            attention_mask = (torch.arange(width)[None, :]
                              >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                     pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **sampling)
            responses += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        return responses

    responses = generate(rows, do_sample=False)
    results = [verifiers.verify(row["verifier"], response, row["ground_truth"])
               for row, response in zip(rows, responses)]
    sampled = {}
    if num_samples > 0:
        torch.manual_seed(seed)
        repeated = [row for row in rows for _ in range(num_samples)]
        # top_k=0 / top_p=1: the full distribution at `temperature`, as vLLM samples it in grpo.py
        texts = generate(repeated, do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        scores = [verifiers.verify(row["verifier"], text, row["ground_truth"]).score
                  for row, text in zip(repeated, texts)]
        sampled = {"sampled_pass@1": sum(scores) / max(len(scores), 1), "sampled_num_samples": num_samples,
                   "sampled_temperature": temperature}
    by_operands, by_carry, copy_checks = {}, {}, []
    for row, result, response in zip(rows, results, responses):
        expr = re.search(r"\d+(?:[+-]\d+)+", row["messages"][-1]["content"]).group(0)
        by_operands.setdefault(expr.count("+") + expr.count("-") + 1, []).append(result.score)
        by_carry.setdefault("needs a carry" if needs_carry(expr) else "no carry", []).append(result.score)
        if (check := copies_operands(expr, response)) is not None:
            copy_checks.append(check)
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    box_checks = [check for check in map(box_matches_last_step, responses) if check is not None]
    return {
        "accuracy": mean([r.score for r in results]),
        "accuracy_by_operands": {k: mean(v) for k, v in sorted(by_operands.items())},
        "accuracy_by_carry": {k: mean(v) for k, v in sorted(by_carry.items(), reverse=True)},
        "answer_found": mean([r.error is None for r in results]),
        "boxes_last_step": mean(box_checks) if box_checks else None,  # None: no multi-step answer to check
        "copies_operands": mean(copy_checks) if copy_checks else None,  # None: no multi-step problem
        "num_examples": len(results),
        "num_errors": sum(r.error is not None for r in results),
        "mean_response_chars": mean([len(r) for r in responses]),
        **sampled,
        "examples": [{"prompt": row["messages"][-1]["content"], "response": response,
                      "ground_truth": row["ground_truth"],
                      "score": r.score} for row, response, r in list(zip(rows, responses, results))[:5]],
    }


# ---------------------------------------------------------------------------------------------
# Demo report: a Table-26-style table across stages, and the training curves
# ---------------------------------------------------------------------------------------------
CURVES = [  # (stage, metric in its metrics.jsonl, panel title)
    ("sft", "train/loss", "SFT loss"),
    ("dpo", "train/loss", "DPO loss"),
    ("dpo", "eval/accuracy", "DPO held-out preference accuracy"),
    ("rl", "rollout/reward_all_scored", "RL solve rate (all sampled prompts)"),
    ("rl", "eval/pass@1", "RL eval pass@1"),
    ("rl", "rollout/response_length", "RL response length"),
]


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(stage_dirs: dict[str, str], out_path: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def metrics_of(stage):
        # A stage's column may name a checkpoint inside its run (run/checkpoints/step_N): look up to the run.
        path = {k.lower(): v for k, v in stage_dirs.items()}.get(stage)
        for candidate in ([path, os.path.join(path, "..", "..")] if path else []):
            if os.path.exists(os.path.join(candidate, "metrics.jsonl")):
                return read_metrics(os.path.join(candidate, "metrics.jsonl"))
        return []

    panels = []
    for stage, key, title in CURVES:
        rows = [r for r in metrics_of(stage) if key in r]
        if rows:
            panels.append((title, [r.get("step", i) for i, r in enumerate(rows)], [r[key] for r in rows]))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (title, xs, ys) in zip(axes[0], panels):
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def write_table(table: list[list[str]], results: dict, out_dir: str, stem: str) -> str:
    """Write `results` as STEM.json and `table` (header row first) as STEM.md; return the table as aligned text."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    text = "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in table)
    markdown = "\n".join("| " + " | ".join(row) + " |" for row in table[:1] + [["---"] * len(table[0])] + table[1:])
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown + "\n")
    return text


def report(stage_dirs: dict[str, str], eval_path: str, out_dir: str, max_new_tokens: int = 64,
           num_samples: int = 4, temperature: float = 1.0) -> dict:
    """Evaluate every stage's checkpoint on the held-out split, print the table, write JSON, Markdown, PNG."""
    os.makedirs(out_dir, exist_ok=True)
    results = {stage: evaluate(path, eval_path, max_new_tokens=max_new_tokens, num_samples=num_samples,
                               temperature=temperature) for stage, path in stage_dirs.items()}
    operands = sorted({k for r in results.values() for k in r["accuracy_by_operands"]})
    rows = [("Accuracy, greedy (all, %)", lambda r: 100 * r["accuracy"])]
    rows += [(f"  {k} operands (%)", lambda r, k=k: 100 * r["accuracy_by_operands"].get(k, float("nan")))
             for k in operands]
    rows += [(f"  {k} (%)", lambda r, k=k: 100 * r["accuracy_by_carry"].get(k, float("nan")))
             for k in ("no carry", "needs a carry")]
    if num_samples > 0:
        rows += [(f"pass@1, sampled (T={temperature:g}, k={num_samples}, %)", lambda r: 100 * r["sampled_pass@1"])]
    rows += [("Boxes its last step (%)",
              lambda r: None if r["boxes_last_step"] is None else 100 * r["boxes_last_step"]),
             ("Copies its operands (%)",
              lambda r: None if r["copies_operands"] is None else 100 * r["copies_operands"]),
             ("Answer found (%)", lambda r: 100 * r["answer_found"]),
             ("Mean response (chars)", lambda r: r["mean_response_chars"])]
    header = ["Toy arithmetic (held-out)"] + list(results)
    # "-": no such answers / no such problems
    format_cell = lambda v: "-" if v is None or v != v else f"{v:.1f}"  # noqa: E731
    table = [header] + [[name] + [format_cell(fn(r)) for r in results.values()] for name, fn in rows]
    text = write_table(table, results, out_dir, "results")
    plot = plot_curves(stage_dirs, os.path.join(out_dir, "curves.png"))
    print("\n" + text + "\n")
    for stage, path in stage_dirs.items():
        print(f"  {stage:>5}: {path}")
    print(f"  table: {os.path.join(out_dir, 'results.md')}  details: {os.path.join(out_dir, 'results.json')}"
          + (f"  curves: {plot}" if plot else ""))
    return results


# ---------------------------------------------------------------------------------------------
# Tool use: sums and differences of 4-digit numbers, which a tiny model gets right only with the calculator
# ---------------------------------------------------------------------------------------------
# The tool grpo.py offers with `--tools_module toy.py`: any file whose TOOLS maps a name to a function
# that takes the parsed call's arguments and returns text.
CALCULATOR_MAX_CHARS = 200  # plenty for three 7-digit operands; bounds the work a model-written call can ask for
# As small as a valid schema gets, without even a description: the toy tokenizer never saw JSON schemas and
# spells this one out in 129 tokens of every system turn (with a one-line description 166, and prompts of 260
# tokens instead of 225), and every one of them costs SFT and RL compute on two CPU cores.
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {"name": "calculator",
                 "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                "required": ["expression"]}},
}


def calculator(expression: str) -> str:
    """The value of an integer expression with + and - (and parentheses), as text: `calculator("48213+90127")`
    is "138340". Evaluated from its syntax tree, never by eval: anything else (names, calls, attributes, *, **,
    floats) raises ValueError, and so does an expression longer than CALCULATOR_MAX_CHARS."""
    import ast

    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, not {type(expression).__name__}")
    if len(expression) > CALCULATOR_MAX_CHARS:
        raise ValueError(f"expression longer than {CALCULATOR_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:  # not bool, not float
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left - right
        raise ValueError(f"only integers, + and - are allowed, not {type(node).__name__}")

    return str(value(tree.body))


TOOLS = {"calculator": calculator}


# The prompt styles whose problem ends one punctuation token before the user turn does ("{expr} = ?" is left out):
# with fixed widths (make_tool_problem) every copy an episode needs then spans one distance.
TOOL_PROMPT_STYLES = PROMPT_STYLES[:3]


def make_tool_problem(rng: random.Random, digits: int) -> tuple[str, int]:
    """`a+b` or `a-b` (even odds) and its value, the two operands and the value all `digits` digits wide
    (4: `3187+4205`, `8031-2514`). Fixed widths put each copy an episode needs (the problem into the call, the
    result into the box, the problem into a restatement) at one distance from its source, which the toy model
    learns within the demo's 300 SFT steps; with two or three operands of 4 to 7 digits it took about 600
    (docs/demo.md)."""
    low, half = 10 ** (digits - 1), 10 ** digits // 2
    if rng.random() < 0.5:
        a, b = rng.randint(low, half - 1), rng.randint(low, half - 1)
        return f"{a}+{b}", a + b
    a, b = rng.randint(half, 10 ** digits - 1), rng.randint(low, half - low - 1)
    return f"{a}-{b}", a - b


def estimate(expr: str) -> int:
    """The teacher's answer without the tool: each operand rounded to its two leading digits, then summed
    (3187+4251 -> 3200+4300 = 7500). Plausible, and right on about 1 in 100 problems of 4-digit numbers (when the
    roundings cancel)."""
    numbers, ops = parse_expression(expr)
    rounded = [round(n, 2 - len(str(n))) for n in numbers]
    value = rounded[0]
    for op, n in zip(ops, rounded[1:]):
        value = value + n if op == "+" else value - n
    return value


# What the teacher writes before restating the problem when it guesses, and between its estimate and the box: as
# many toy tokens as the call's `<function_calls>calculator(expression="` (16) and as what lies between the
# calculator's result and the boxed answer (the environment turn's `<|im_end|>`, a new assistant header and
# `\boxed{`: 8). So every copy a row asks for spans the same distance with or without the tool, and the guess rows
# train the copies a call needs (tests/test_toy.py checks the counts).
GUESS_PREFIX = "Estimating, without the tool: "
GUESS_TO_BOX = ". The answer: \\boxed{"


def guess_text(expr: str) -> str:
    """The teacher's answer without the tool: the problem restated, its estimate, the estimate boxed
    (`Estimating, without the tool: 4821+3012 is about 7800. The answer: \\boxed{7800}`)."""
    guess = estimate(expr)
    return f"{GUESS_PREFIX}{expr} is about {guess}{GUESS_TO_BOX}{guess}}}"


def tool_trace(expr: str, answer: int) -> list[dict]:
    """The assistant's side of a solved tool episode: the call, the calculator's result, the boxed answer."""
    return [{"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": expr}}}]},
            {"role": "tool", "content": calculator(expr)},
            {"role": "assistant", "content": "\\boxed{" + str(answer) + "}"}]


def generate_tool_data(seed: int = 0, num_sft: int = 8000, num_rlvr: int = 2000, num_eval: int = 200,
                       digits: int = 4, teacher_tool_rate: float = 0.5, sft_notools_fraction: float = 0.25) -> dict:
    """The tool task's splits as lists of rows: sft_tools, rlvr_tools, rlvr_notools, eval_tools, eval_notools.

    Every problem is a sum or difference of two `digits`-digit numbers (`make_tool_problem`), drawn distinct (an
    eval problem must never be trained on). SFT traces come from a teacher that, offered the calculator, calls it
    with probability teacher_tool_rate and otherwise restates the problem and boxes its estimate (`guess_text`); a
    fraction sft_notools_fraction of the SFT rows offers no tool, and there it always guesses. With the defaults
    3 rows in 8 are calls, and a model sampled after SFT calls on about half the problems it is offered the tool
    on: RL with the tool has to learn to call on all of them. RLVR and eval rows are the same problems with and
    without the tool (`tools` absent), answers true."""
    rng = random.Random(seed)
    total = num_sft + num_rlvr + num_eval
    if total > 10 ** (2 * digits - 2):  # far fewer than the distinct problems, or the loop below would not end
        raise ValueError(f"{total} distinct problems of {digits} digits: use more digits or fewer rows")
    seen, problems = set(), []
    while len(problems) < total:
        expr, answer = make_tool_problem(rng, digits)
        if expr not in seen:  # the prompt is drawn with its problem: the eval rows do not depend on num_sft
            seen.add(expr)
            problems.append((expr, answer, rng.choice(TOOL_PROMPT_STYLES).format(expr=expr)))
    eval_problems, rlvr_problems, sft_problems = (problems[:num_eval], problems[num_eval:num_eval + num_rlvr],
                                                 problems[num_eval + num_rlvr:])
    splits = {"sft_tools": []}
    for expr, answer, prompt in sft_problems:
        messages = [{"role": "user", "content": prompt}]
        offered = rng.random() >= sft_notools_fraction
        if offered and rng.random() < teacher_tool_rate:
            messages += tool_trace(expr, answer)
        else:
            messages.append({"role": "assistant", "content": guess_text(expr)})
        splits["sft_tools"].append({"messages": messages, "tools": [CALCULATOR_SCHEMA] if offered else None})
    for name, chosen in (("rlvr", rlvr_problems), ("eval", eval_problems)):
        rows = [{"messages": [{"role": "user", "content": prompt}], "ground_truth": str(answer), "verifier": "math",
                 "dataset": "toy_tools"} for expr, answer, prompt in chosen]
        splits[f"{name}_tools"] = [{**row, "tools": [CALCULATOR_SCHEMA]} for row in rows]
        splits[f"{name}_notools"] = rows
    return splits


def write_tool_data(out_dir: str, **kwargs) -> dict:
    return write_splits(out_dir, generate_tool_data(**kwargs))


CALL_BLOCK = re.compile(r"<function_calls>(.*?)</function_calls>", re.S)


def parse_calls(block: str) -> list[tuple[str, dict]]:
    """The calls in a `<function_calls>` block as the template prints them, one a line:
    `name(key="json value", other=2)`. Raises ValueError on anything else."""
    calls = []
    decoder = json.JSONDecoder()
    for line in filter(None, (line.strip() for line in block.strip().split("\n"))):
        match = re.fullmatch(r"([A-Za-z_][\w.-]*)\((.*)\)", line, re.S)
        if not match:
            raise ValueError(f"not a call: {line!r}")
        name, rest, args = match.group(1), match.group(2).strip(), {}
        while rest:
            key = re.match(r"([A-Za-z_]\w*)\s*=\s*", rest)
            if not key:
                raise ValueError(f"bad arguments in {line!r}")
            try:
                args[key.group(1)], end = decoder.raw_decode(rest, key.end())
            except json.JSONDecodeError:
                raise ValueError(f"an argument is not JSON in {line!r}") from None
            rest = rest[end:].lstrip()
            if rest and not rest.startswith(","):
                raise ValueError(f"bad arguments in {line!r}")
            rest = rest[1:].lstrip()
        calls.append((name, args))
    if not calls:
        raise ValueError("no call in <function_calls>")
    return calls


def run_calls(block: str, tools: dict, offered: set) -> list[tuple[str, str | None]]:
    """The environment's answers to one `<function_calls>` block, as grpo.py's episodes give them: per call its
    result or an error text, and the error's kind (malformed, unknown_tool, exception) or None. A block that does
    not parse is one malformed call."""
    try:
        calls = parse_calls(block)
    except ValueError as e:
        return [(f"error: {e}", "malformed")]
    answers = []
    for name, args in calls:
        if name not in offered or name not in tools:
            answers.append((f"error: no tool named {name!r}", "unknown_tool"))
            continue
        try:
            answers.append((str(tools[name](**args)), None))
        except Exception as e:  # noqa: BLE001 - the model's call failing is an answer, not a crash
            answers.append((f"error: {type(e).__name__}: {e}", "exception"))
    return answers


def tool_episodes(model, tokenizer, rows: list[dict], max_new_tokens: int = 48, max_tool_turns: int = 5,
                  batch_size: int = 64, tools: dict | None = None) -> list[dict]:
    """Greedy multi-turn episodes, batched: each turn generates until <|im_end|> or eos; a turn that hands off
    with <|im_end|> after a `<function_calls>` block, in a row that offers tools, gets the tools' results as an
    environment turn and a new assistant header, appended as tokens (what the model generated is never
    re-tokenized), and the episode goes on, at most max_tool_turns times. Anything else ends the episode."""
    import torch

    from chat_template import tokenize_prompt

    tools = TOOLS if tools is None else tools
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    episodes = [{"ids": tokenize_prompt(tokenizer, row["messages"], tools=row.get("tools")),
                 "offered": {t["function"]["name"] for t in row.get("tools") or []},
                 "turns": [], "calls": 0, "tool_turns": 0, "errors": []} for row in rows]
    for e in episodes:
        e["prompt_length"] = len(e["ids"])
    active = list(range(len(episodes)))
    while active:
        still = []
        for start in range(0, len(active), batch_size):
            batch = active[start:start + batch_size]
            contexts = [episodes[i]["ids"] for i in batch]
            width = max(map(len, contexts))
            input_ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])  # left padding
            attention_mask = (torch.arange(width)[None, :]
                              >= torch.tensor([width - len(c) for c in contexts])[:, None]).long()
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                     max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=[eos, im_end])
            for i, generated in zip(batch, out[:, width:].tolist()):
                e = episodes[i]
                stop = next((k for k, t in enumerate(generated) if t in (eos, im_end)), None)
                turn = generated if stop is None else generated[:stop + 1]
                e["ids"] = e["ids"] + turn
                text = tokenizer.decode(turn, skip_special_tokens=True)
                e["turns"].append(text)
                block = CALL_BLOCK.search(text)
                if block is None or stop is None or turn[-1] != im_end or not e["offered"]:
                    continue  # an answer, a truncated turn, or a call where no tool is offered: the episode ends
                if e["tool_turns"] == max_tool_turns:
                    e["errors"].append("max_tool_turns")
                    continue
                answers = run_calls(block.group(1), tools, e["offered"])
                e["calls"] += len(answers)
                e["tool_turns"] += 1
                e["errors"] += [kind for _, kind in answers if kind]
                # each result its own environment turn, as the template renders `tool` messages
                appended = "".join(f"\n<|im_start|>environment\n{text}<|im_end|>" for text, _ in answers)
                e["ids"] = e["ids"] + tokenizer.encode(appended + "\n<|im_start|>assistant\n", add_special_tokens=False)
                still.append(i)
        active = still
    return episodes


def tool_evaluate(model_dir: str, eval_path: str, max_new_tokens: int = 48, max_tool_turns: int = 5,
                  limit: int | None = None, batch_size: int = 64) -> dict:
    """Greedy tool episodes (`tool_episodes`) on an eval JSONL, the final assistant turn scored by its row's
    verifier as `evaluate` scores an answer; an episode that ends on a call has no final answer and scores 0.
    Rows without `tools` run the same way, and a call there is counted but never answered."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import verifiers

    with open(eval_path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:limit]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    episodes = tool_episodes(model, tokenizer, rows, max_new_tokens, max_tool_turns, batch_size)
    scores, found, called = [], [], []
    for row, e in zip(rows, episodes):
        final = e["turns"][-1]
        e["called"] = bool(CALL_BLOCK.search("".join(e["turns"])))
        if CALL_BLOCK.search(final):
            result = verifiers.VerifierResult(0.0, error="no final answer")
        else:
            result = verifiers.verify(row["verifier"], final, row["ground_truth"])
        scores.append(result.score)
        found.append(result.error is None)
        called.append(e["called"])
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    by_operation = {}  # sums and differences, about half the problems each
    for row, score, e in zip(rows, scores, episodes):
        expr = re.search(r"\d+(?:[+-]\d+)+", row["messages"][-1]["content"]).group(0)
        by_operation.setdefault("difference" if "-" in expr else "sum", []).append((score, e["called"]))
    errors = {}
    for e in episodes:
        for kind in e["errors"]:
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "accuracy": mean(scores),
        "tools_offered": mean([bool(row.get("tools")) for row in rows]),
        "calls_per_episode": mean([e["calls"] for e in episodes]),
        "tool_turns_per_episode": mean([e["tool_turns"] for e in episodes]),
        "episodes_calling": mean(called),
        "accuracy_when_calling": mean([s for s, c in zip(scores, called) if c]) if any(called) else None,
        "accuracy_by_operation": {k: mean([s for s, _ in v]) for k, v in sorted(by_operation.items())},
        "calling_by_operation": {k: mean([c for _, c in v]) for k, v in sorted(by_operation.items())},
        "answer_found": mean(found),
        "tool_errors": errors,
        "num_examples": len(rows),
        "mean_prompt_tokens": mean([e["prompt_length"] for e in episodes]),
        "mean_episode_tokens": mean([len(e["ids"]) - e["prompt_length"] for e in episodes]),
        "examples": [{"prompt": row["messages"][-1]["content"], "turns": e["turns"], "ground_truth": row["ground_truth"],
                      "score": s} for row, e, s in list(zip(rows, episodes, scores))[:5]],
    }


def tool_report(stage_dirs: dict[str, str], eval_paths: dict[str, str], out_dir: str, max_new_tokens: int = 48,
                max_tool_turns: int = 5) -> dict:
    """`tool_evaluate` of every stage's checkpoint on every eval file; print the table, write JSON and Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    results = {stage: {name: tool_evaluate(path, eval_path, max_new_tokens, max_tool_turns)
                       for name, eval_path in eval_paths.items()} for stage, path in stage_dirs.items()}
    rows = []
    for name in eval_paths:
        rows += [(f"Accuracy, greedy, {name} (%)", lambda r, n=name: 100 * r[n]["accuracy"]),
                 (f"  tool calls per episode, {name}", lambda r, n=name: r[n]["calls_per_episode"]),
                 (f"  episodes calling (%), {name}", lambda r, n=name: 100 * r[n]["episodes_calling"])]
    header = ["Toy tool use (held-out)"] + list(results)
    format_cell = lambda v: "-" if v is None else f"{v:.2f}" if v < 10 and v != int(v) else f"{v:.1f}"  # noqa: E731
    table = [header] + [[label] + [format_cell(fn(r)) for r in results.values()] for label, fn in rows]
    text = write_table(table, results, out_dir, "tool_results")
    print("\n" + text + "\n")
    for stage, path in stage_dirs.items():
        print(f"  {stage}: {path}")
    print(f"  table: {os.path.join(out_dir, 'tool_results.md')}  details: {os.path.join(out_dir, 'tool_results.json')}")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_model = sub.add_parser("model", help="write the tiny model and tokenizer to OUT_DIR")
    p_model.add_argument("out_dir")
    p_model.add_argument("--seed", type=int, default=0)
    p_model.add_argument("--hidden_size", type=int, default=256)
    p_model.add_argument("--num_layers", type=int, default=4)
    p_model.add_argument("--num_heads", type=int, default=4, help="head_dim = hidden_size / num_heads; keep it 64")
    p_model.add_argument("--intermediate_size", type=int, default=768)
    p_data = sub.add_parser("data", help="write sft / preference / rlvr / eval JSONL files to OUT_DIR")
    p_data.add_argument("out_dir")
    p_data.add_argument("--seed", type=int, default=0)
    p_data.add_argument("--num_sft", type=int, default=8000)
    p_data.add_argument("--num_preference", type=int, default=2000)
    p_data.add_argument("--num_rlvr", type=int, default=4000)
    p_data.add_argument("--num_eval", type=int, default=200)
    p_data.add_argument("--max_operand", type=int, default=9, help="operands are drawn from 0..max_operand")
    p_data.add_argument("--min_operands", type=int, default=2)
    p_data.add_argument("--max_operands", type=int, default=4, help="each extra operand is one more reasoning step")
    p_data.add_argument("--teacher_carry_slip", type=float, default=0.75,
                        help="probability that the SFT teacher forgets a carry (0: every SFT trace is correct)")
    p_data.add_argument("--teacher_box_slip", type=float, default=0.75,
                        help="probability that the SFT teacher boxes the result of the step before the last "
                             "(traces of two or more steps)")
    p_data.add_argument("--distinct_training_problems", action="store_true",
                        help="no problem twice in the training splits (default: repeats allowed, so that each "
                             "operand count keeps its share; there are only 155 two-operand problems)")
    p_eval = sub.add_parser("eval", help="greedy accuracy and sampled pass@1 of a model on an eval JSONL "
                                         "(e.g. OUT_DIR/eval.jsonl)")
    p_eval.add_argument("model_dir")
    p_eval.add_argument("eval_path")
    p_eval.add_argument("--max_new_tokens", type=int, default=64)
    p_eval.add_argument("--limit", type=int, default=None)
    p_report = sub.add_parser("report", help="evaluate several checkpoints; print and write the results table")
    p_report.add_argument("--stage", action="append", required=True, metavar="NAME=DIR",
                          help="a column of the table, in order: e.g. --stage base=DIR --stage sft=DIR")
    p_report.add_argument("--eval_path", required=True)
    p_report.add_argument("--out_dir", required=True)
    p_report.add_argument("--max_new_tokens", type=int, default=64)
    for p in (p_eval, p_report):
        p.add_argument("--num_samples", type=int, default=4,
                       help="k sampled completions per prompt for sampled pass@1 (0: greedy accuracy only)")
        p.add_argument("--temperature", type=float, default=1.0,
                       help="sampling temperature (grpo.py trains and evaluates at 1.0)")
    p_tool_data = sub.add_parser("tool_data", help="write the tool task's JSONL files to OUT_DIR: sft_tools, "
                                                   "rlvr_tools / rlvr_notools, eval_tools / eval_notools")
    p_tool_data.add_argument("out_dir")
    p_tool_data.add_argument("--seed", type=int, default=0)
    p_tool_data.add_argument("--num_sft", type=int, default=8000)
    p_tool_data.add_argument("--num_rlvr", type=int, default=2000)
    p_tool_data.add_argument("--num_eval", type=int, default=200)
    p_tool_data.add_argument("--digits", type=int, default=4, help="digits of both operands and of the value")
    p_tool_data.add_argument("--teacher_tool_rate", type=float, default=0.5,
                             help="probability that the SFT teacher, offered the calculator, calls it (otherwise it "
                                  "boxes an estimate)")
    p_tool_data.add_argument("--sft_notools_fraction", type=float, default=0.25,
                             help="SFT rows that offer no tool (the teacher boxes its estimate)")
    p_tool_eval = sub.add_parser("tool_eval", help="greedy multi-turn accuracy and tool calls of a model on a tool "
                                                   "eval JSONL (e.g. OUT_DIR/eval_tools.jsonl)")
    p_tool_eval.add_argument("model_dir")
    p_tool_eval.add_argument("eval_path")
    p_tool_eval.add_argument("--limit", type=int, default=None)
    p_tool_report = sub.add_parser("tool_report", help="tool_eval of several checkpoints on several eval files; "
                                                       "print and write the table")
    p_tool_report.add_argument("--stage", action="append", required=True, metavar="NAME=DIR",
                               help="a column of the table, in order: e.g. --stage SFT=DIR --stage RL=DIR")
    p_tool_report.add_argument("--eval", action="append", required=True, metavar="NAME=FILE", dest="eval_paths",
                               help="an eval file, in order: e.g. --eval 'with tool=eval_tools.jsonl'")
    p_tool_report.add_argument("--out_dir", required=True)
    for p in (p_tool_eval, p_tool_report):
        p.add_argument("--max_new_tokens", type=int, default=48, help="per assistant turn")
        p.add_argument("--max_tool_turns", type=int, default=5, help="tool turns per episode; then it ends")
    args = vars(parser.parse_args())
    command = args.pop("command")
    if command == "tool_report":
        stages = dict(item.split("=", 1) for item in args.pop("stage"))
        evals = dict(item.split("=", 1) for item in args.pop("eval_paths"))
        tool_report(stages, evals, **args)
        return
    if command == "tool_eval":
        print(json.dumps(tool_evaluate(**args), indent=2))
        return
    if command == "tool_data":
        paths = write_tool_data(args.pop("out_dir"), **args)
        print("\n".join(f"wrote {p}" for p in paths.values()))
        return
    if command == "report":
        stages = dict(item.split("=", 1) for item in args.pop("stage"))
        report(stages, **args)
        return
    if command == "eval":
        print(json.dumps(evaluate(**args), indent=2))
        return
    out_dir = args.pop("out_dir")
    if command == "model":
        write_model(out_dir, **args)
        print(f"wrote toy model and tokenizer to {out_dir}")
    else:
        paths = write_data(out_dir, **args)
        print("\n".join(f"wrote {p}" for p in paths.values()))


if __name__ == "__main__":
    main()
