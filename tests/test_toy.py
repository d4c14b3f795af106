"""toy.py: the offline model, tokenizer and tasks every other test stands on."""

import collections
import filecmp
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import toy
from conftest import REPO


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def expression_of(prompt: str) -> str:
    match = re.search(r"\d+(?:[+-]\d+)+", prompt)
    assert match, prompt
    return match.group(0)


def evaluate_expression(expr: str) -> int:
    # Left to right, + and - only: exactly what the task promises.
    tokens = re.findall(r"[+-]|\d+", expr)
    value = int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2]):
        value = value + int(number) if op == "+" else value - int(number)
    return value


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def test_data_is_deterministic_per_seed(tmp_path):
    a, b, c = (str(tmp_path / name) for name in "abc")
    toy.write_data(a, seed=3, num_sft=50, num_preference=20, num_rlvr=50, num_eval=10)
    toy.write_data(b, seed=3, num_sft=50, num_preference=20, num_rlvr=50, num_eval=10)
    toy.write_data(c, seed=4, num_sft=50, num_preference=20, num_rlvr=50, num_eval=10)
    names = ["sft.jsonl", "preference.jsonl", "rlvr.jsonl", "eval.jsonl"]
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert match == names and not mismatch and not errors
    _, mismatch, _ = filecmp.cmpfiles(a, c, names, shallow=False)
    assert mismatch == names


def test_every_ground_truth_answers_its_prompt(toy_data_dir):
    for split in ("rlvr", "eval"):
        rows = read_jsonl(os.path.join(toy_data_dir, f"{split}.jsonl"))
        assert rows
        for row in rows:
            assert row["verifier"] == "math"
            assert [m["role"] for m in row["messages"]] == ["user"]
            assert row["ground_truth"] == str(evaluate_expression(expression_of(row["messages"][0]["content"])))


STEP = re.compile(r"^(-?\d+)([+-])(\d+)=(-?\d+)$")


def trace_steps(content):
    """(steps as (a, op, b, c) ints, boxed answer) of a toy answer, checking its format."""
    think, boxed = re.fullmatch(r"<think>(.*)</think>\n\\boxed\{(-?\d+)\}", content, re.S).groups()
    steps = [STEP.match(line).groups() for line in think.split("\n")]
    return [(int(a), op, int(b), int(c)) for a, op, b, c in steps], int(boxed)


def test_sft_traces_are_the_imperfect_teachers():
    # Every step is right except a forgotten carry (c = a + b - 10 where the ones digits pass 9),
    # each step starts from the previous result, the box holds the last one, and the teacher
    # forgets about teacher_carry_slip of its carries.
    for slip in (0.6, 0.0):
        rows = toy.generate_data(seed=1, num_sft=3000, num_preference=0, num_rlvr=0, num_eval=0,
                                 teacher_carry_slip=slip, teacher_box_slip=0.0)["sft"]
        carries = slipped = wrong_answers = 0
        for row in rows:
            user, assistant = row["messages"]
            expr = expression_of(user["content"])
            steps, boxed = trace_steps(assistant["content"])
            numbers = [int(x) for x in re.findall(r"\d+", expr)]
            assert steps[0][0] == numbers[0] and [b for _, _, b, _ in steps] == numbers[1:]
            for k, (a, op, b, c) in enumerate(steps):
                assert k == 0 or a == steps[k - 1][3]
                right = a + b if op == "+" else a - b
                if toy.forgets_carry(a, op, b):
                    carries += 1
                    slipped += c == right - 10
                    assert c in (right, right - 10)
                else:
                    assert c == right
            assert boxed == steps[-1][3]
            wrong_answers += boxed != evaluate_expression(expr)
        assert abs(slipped / carries - slip) < 0.04, (slip, slipped / carries)
        assert (wrong_answers > 0.3 * len(rows)) if slip else wrong_answers == 0


def test_teacher_boxes_the_step_before_the_last_at_the_given_rate():
    # With teacher_box_slip s the teacher's trace is unchanged, but in traces of two or more steps it
    # boxes the second-to-last result for a fraction s of them; one-step traces are never affected.
    for carry_slip in (0.0, 0.6):
        rows = toy.generate_data(seed=2, num_sft=3000, num_preference=0, num_rlvr=0, num_eval=0,
                                 teacher_carry_slip=carry_slip, teacher_box_slip=0.6)["sft"]
        multi = slipped = 0
        for row in rows:
            user, assistant = row["messages"]
            steps, boxed = trace_steps(assistant["content"])
            if carry_slip == 0:
                assert steps[-1][3] == evaluate_expression(expression_of(user["content"]))
            if len(steps) == 1:
                assert boxed == steps[-1][3]
                continue
            assert boxed in (steps[-1][3], steps[-2][3])
            if steps[-1][3] != steps[-2][3]:  # a last step of +0 / -0 hides the slip
                multi += 1
                slipped += boxed != steps[-1][3]
        assert abs(slipped / multi - 0.6) < 0.04, slipped / multi


def test_copies_operands_checks_each_steps_operator_and_operand_in_order():
    # Every teacher trace copies its operands, slips or not: the check holds on all multi-step ones.
    rows = toy.generate_data(seed=3, num_sft=300, num_preference=0, num_rlvr=0, num_eval=0)["sft"]
    checks = [toy.copies_operands(expression_of(user["content"]), assistant["content"])
              for user, assistant in (row["messages"] for row in rows)]
    assert None in checks and set(checks) == {None, True}
    right = "<think>6+9=15\n15+2=17\n17+1=18</think>\n\\boxed{18}"
    assert toy.copies_operands("6+9+2+1", right)
    assert toy.copies_operands("6+9+2+1", right.replace("=17", "=27").replace("18", "28"))  # arithmetic is not copying
    assert not toy.copies_operands("6+9+2+1", "<think>6+9=15\n15+1=16\n16+1=17</think>\n\\boxed{17}")  # skips the 2
    assert not toy.copies_operands("6+9+2+1", "<think>6+9=15\n15-2=13\n13+1=14</think>")  # wrong operator
    assert not toy.copies_operands("6+9+2+1", "<think>6+9=15\n15+2=17</think>\n\\boxed{17}")  # a step missing
    assert not toy.copies_operands("6+9+2+1", "no steps at all")
    assert toy.copies_operands("7+5", "<think>7+5=12</think>") is None  # one step: nothing to pick from


def test_preferences_contrast_a_correct_answer_with_a_weaker_models(toy_data_dir):
    rows = read_jsonl(os.path.join(toy_data_dir, "preference.jsonl"))
    forgot = 0
    for row in rows:
        expr = expression_of(row["chosen"][0]["content"])
        answer = evaluate_expression(expr)
        assert row["chosen"][0] == row["rejected"][0]
        steps, boxed = trace_steps(row["chosen"][1]["content"])
        assert boxed == answer and all(c == (a + b if op == "+" else a - b) for a, op, b, c in steps)
        rejected_steps, rejected_boxed = trace_steps(row["rejected"][1]["content"])
        assert rejected_boxed != answer and rejected_boxed == rejected_steps[-1][3]
        if toy.needs_carry(expr):  # the weaker model forgets every carry
            forgot += 1
            assert all(c == (a + b - 10 if toy.forgets_carry(a, op, b) else a + b if op == "+" else a - b)
                       for a, op, b, c in rejected_steps)
    assert 0.3 < forgot / len(rows) < 0.7


def test_eval_split_is_held_out(toy_data_dir):
    def expressions(split, key="messages"):
        return {expression_of(r[key][0]["content"]) for r in read_jsonl(os.path.join(toy_data_dir, f"{split}.jsonl"))}
    held_out = expressions("eval")
    for split in ("sft", "rlvr"):
        assert not held_out & expressions(split)
    assert not held_out & expressions("preference", key="chosen")


def test_difficulty_is_adjustable():
    easy = toy.generate_data(seed=0, num_sft=30, num_preference=0, num_rlvr=0, num_eval=0, max_operand=5,
                             max_operands=2)
    hard = toy.generate_data(seed=0, num_sft=200, num_preference=0, num_rlvr=0, num_eval=0, max_operand=50,
                             min_operands=4, max_operands=5)
    steps = lambda rows: max(r["messages"][1]["content"].count("=") for r in rows)  # noqa: E731
    assert steps(easy["sft"]) == 1 and steps(hard["sft"]) >= 3
    with pytest.raises(ValueError, match="distinct problems"):
        toy.generate_data(seed=0, num_sft=500, num_preference=0, num_rlvr=0, num_eval=0, max_operand=2, max_operands=2,
                          distinct_training_problems=True)
    with pytest.raises(ValueError, match="distinct problems"):  # the eval split's problems are always distinct
        toy.generate_data(seed=0, num_sft=0, num_preference=0, num_rlvr=0, num_eval=500, max_operand=2, max_operands=2)


def test_training_problems_repeat_so_every_operand_count_keeps_its_share():
    """Only 155 two-operand problems exist (single digits): drawn distinct, the eval split took a third of them
    and the SFT split kept 1% of its rows for them; whether SFT then answered held-out two-operand problems
    swung from 3% to 42% greedy with the seed alone. Repeats (never of an eval problem) keep their share."""
    data = toy.generate_data(seed=0)
    operands = lambda row: len(re.findall(r"[+-]", expression_of(row["messages"][0]["content"]))) + 1  # noqa: E731
    counts = {split: collections.Counter(map(operands, data[split])) for split in ("sft", "rlvr", "eval")}
    for split in ("sft", "rlvr"):
        assert counts[split][2] > 0.2 * len(data[split]), counts  # about a quarter: a third, less the eval's share
    held_out = {expression_of(r["messages"][0]["content"]) for r in data["eval"]}
    assert len(held_out) == len(data["eval"]) and not held_out & {expression_of(r["messages"][0]["content"])
                                                                  for r in data["sft"] + data["rlvr"]}
    distinct = toy.generate_data(seed=0, distinct_training_problems=True)
    assert collections.Counter(map(operands, distinct["sft"]))[2] < 0.02 * len(distinct["sft"])


# ---------------------------------------------------------------------------------------------
# Model and tokenizer
# ---------------------------------------------------------------------------------------------
def test_model_and_tokenizer_load_with_auto_classes(toy_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    assert type(model).__name__ == "Olmo3ForCausalLM"
    assert model.config.hidden_size // model.config.num_attention_heads == 64  # vLLM CPU needs head_dim >= 32
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    assert tokenizer.bos_token == tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token == "<|pad|>"
    for token in toy.SPECIAL_TOKENS + toy.MARKUP_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == token, token
    # Digits and arithmetic symbols are single tokens, never fused.
    ids = tokenizer.encode("12+345=357 \\boxed{-8}", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    for piece in pieces:
        assert not (any(c.isdigit() for c in piece) and len(piece.strip()) > 1), pieces
    # Any text survives a round trip (byte-level), and <think> survives skip_special_tokens.
    text = "<think>ünïcödé → 你好</think> \x00 done"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True) == text
    assert model.config.vocab_size >= len(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()


def test_model_files_are_deterministic(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    toy.write_model(a, seed=0)
    toy.write_model(b, seed=0)
    names = sorted(os.listdir(a))
    assert "model.safetensors" in names and "tokenizer.json" in names and "chat_template.jinja" in names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert match == names, (mismatch, errors)


def test_cli_writes_model_and_data(tmp_path):
    for command in ("model", "data"):
        out = tmp_path / command
        subprocess.run([sys.executable, "toy.py", command, str(out)], cwd=REPO, check=True, capture_output=True)
    assert (tmp_path / "model" / "config.json").exists()
    assert sorted(os.listdir(tmp_path / "data")) == ["eval.jsonl", "preference.jsonl", "rlvr.jsonl", "sft.jsonl"]


def test_evaluate_scores_a_random_model_near_zero(toy_model_dir, toy_data_dir):
    result = toy.evaluate(toy_model_dir, os.path.join(toy_data_dir, "eval.jsonl"), max_new_tokens=8, limit=16)
    assert result["num_examples"] == 16
    assert result["accuracy"] <= 0.2


@pytest.mark.slow  # needs the session's trained SFT model (about 6 min to build on 2 cores)
def test_evaluate_sampled_pass_at_1_matches_greedy_at_near_zero_temperature(toy_sft_model_dir, toy_data_dir):
    # Near-zero temperature samples the argmax: the k samples of each prompt must score exactly as its
    # greedy answer does, which fails if repeated prompts and their scores were misaligned.
    eval_path = os.path.join(toy_data_dir, "eval.jsonl")
    cold = toy.evaluate(toy_sft_model_dir, eval_path, limit=48, num_samples=3, temperature=1e-4)
    assert 0.2 < cold["accuracy"] < 1.0 and cold["sampled_pass@1"] == pytest.approx(cold["accuracy"])
    warm = toy.evaluate(toy_sft_model_dir, eval_path, limit=48, num_samples=3, temperature=1.0)
    assert warm["sampled_num_samples"] == 3 and 0.0 < warm["sampled_pass@1"] < 1.0


# ---------------------------------------------------------------------------------------------
# vLLM serves the toy model
# ---------------------------------------------------------------------------------------------
VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    model_dir = sys.argv[1]
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=4, seed=0, enforce_eager=True)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], tokenize=True,
                                           add_generation_prompt=True, return_dict=True)["input_ids"]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params)[0].outputs[0]
    print("RESULT " + json.dumps({"prompt": list(prompt), "tokens": list(out.token_ids),
                                  "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]}))
"""


@pytest.mark.slow
def test_vllm_generates_from_a_chat_prompt_with_matching_logprobs(toy_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), toy_model_dir], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # the engine rendered the chat template as transformers does, and sampled at most max_tokens=16
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    assert result["prompt"] == list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3+4?"}], tokenize=True, add_generation_prompt=True,
        return_dict=True)["input_ids"])
    assert 1 <= len(result["tokens"]) <= 16
    # The engine's sampling logprobs are the model's own: recompute them with transformers.
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    ids = torch.tensor([result["prompt"] + result["tokens"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
    start = len(result["prompt"]) - 1
    expected = logprobs[start:start + len(result["tokens"])].gather(1, torch.tensor(result["tokens"])[:, None])[:, 0]
    assert torch.allclose(expected, torch.tensor(result["logprobs"]), atol=2e-3), (expected, result["logprobs"])
