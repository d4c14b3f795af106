"""toy.py: the offline model, tokenizer and tasks every other test stands on."""

import collections
import filecmp
import json
import os
import random
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


# ---------------------------------------------------------------------------------------------
# The tool task: sums of large numbers, the calculator, greedy tool episodes
# ---------------------------------------------------------------------------------------------
def test_calculator_evaluates_integer_sums_and_refuses_everything_else():
    assert toy.TOOLS == {"calculator": toy.calculator}
    assert toy.calculator("48213+90127") == "138340"
    assert toy.calculator(" 1000000 - 2000001 + 7 ") == "-999994"
    assert toy.calculator("-(5-8)+(+2)") == "5"
    for bad in ("__import__('os').system('true')", "x+1", "abs(-3)", "(1).real", "2**64", "9**9**9", "3*4", "7/2",
                "7//2", "1.5+1", "True+1", "1e9", "1 if 1 else 2", "[1][0]", "1,2", "", "1+", "1; 2", "'1'+'2'",
                "1<<100", "-~1"):
        with pytest.raises(ValueError):
            toy.calculator(bad)
    with pytest.raises(ValueError, match="longer than"):
        toy.calculator("+".join(["1"] * 200))  # 399 characters of valid syntax: refused before parsing
    with pytest.raises(ValueError):
        toy.calculator(12)  # a model may pass a JSON number where the schema says string


def test_parse_calls_reads_what_the_template_prints():
    assert toy.parse_calls('calculator(expression="1+2")') == [("calculator", {"expression": "1+2"})]
    assert toy.parse_calls('f(a="x, y)", b=2)\ng()') == [("f", {"a": "x, y)", "b": 2}), ("g", {})]
    for bad in ('calculator(expression=1+2)', 'calculator("1+2")', 'calculator(expression="1+2"', "", "12"):
        with pytest.raises(ValueError):
            toy.parse_calls(bad)


def tool_expression(row):
    return expression_of(row["messages"][0]["content"])


def test_tool_data_is_deterministic_held_out_and_answered(tmp_path):
    a, b, c = (str(tmp_path / name) for name in "abc")
    kwargs = dict(num_sft=300, num_rlvr=100, num_eval=50)
    toy.write_tool_data(a, seed=3, **kwargs)
    toy.write_tool_data(b, seed=3, **kwargs)
    toy.write_tool_data(c, seed=4, **kwargs)
    names = [f"{n}.jsonl" for n in ("sft_tools", "rlvr_tools", "rlvr_notools", "eval_tools", "eval_notools")]
    assert sorted(os.listdir(a)) == sorted(names)
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert match == names and not mismatch and not errors
    assert filecmp.cmpfiles(a, c, names, shallow=False)[1] == names
    split = {name[:-6]: read_jsonl(os.path.join(a, name)) for name in names}
    held_out = set(map(tool_expression, split["eval_tools"]))
    rlvr = set(map(tool_expression, split["rlvr_tools"]))
    sft = set(map(tool_expression, split["sft_tools"]))
    assert len(held_out) == 50 and len(rlvr) == 100 and len(sft) == 300  # distinct within each split too
    assert not held_out & rlvr and not held_out & sft and not rlvr & sft
    for name in ("rlvr", "eval"):
        # the same problems and prompts, with and without the tool
        assert [{k: v for k, v in row.items() if k != "tools"} for row in split[f"{name}_tools"]] == split[f"{name}_notools"]
        assert all(row["tools"] == [toy.CALCULATOR_SCHEMA] for row in split[f"{name}_tools"])
        assert all("tools" not in row for row in split[f"{name}_notools"])
        for row in split[f"{name}_notools"]:
            expr = tool_expression(row)
            assert row["verifier"] == "math" and row["ground_truth"] == str(evaluate_expression(expr))
            # two operands and the value, all four digits wide (so every copy spans one distance), in a prompt
            # that ends one punctuation mark after the problem
            assert re.fullmatch(r"\d{4}[+-]\d{4}", expr) and re.fullmatch(r"\d{4}", row["ground_truth"])
            assert row["messages"][0]["content"] in [style.format(expr=expr) for style in toy.TOOL_PROMPT_STYLES]
    # the eval rows do not depend on how much training data is drawn
    toy.write_tool_data(b, seed=3, num_sft=10, num_rlvr=100, num_eval=50)
    assert filecmp.cmp(os.path.join(a, "eval_tools.jsonl"), os.path.join(b, "eval_tools.jsonl"), shallow=False)


def test_tool_problems_keep_both_operands_and_the_value_at_one_width():
    rng = random.Random(0)
    for digits in (1, 2, 4, 6):
        for _ in range(2000):
            expr, value = toy.make_tool_problem(rng, digits)
            a, _, b = re.fullmatch(r"(\d+)([+-])(\d+)", expr).groups()
            assert len(a) == len(b) == len(str(value)) == digits and value == evaluate_expression(expr), expr
    with pytest.raises(ValueError, match="distinct problems of 2 digits"):
        toy.generate_tool_data(digits=2, num_sft=101, num_rlvr=0, num_eval=0)


def check_tool_trace(row):
    """A row is a guess (the problem restated, the teacher's estimate boxed) or a solved call; True for a call."""
    expr = tool_expression(row)
    answer = evaluate_expression(expr)
    if len(row["messages"]) == 2:
        guess = toy.estimate(expr)
        assert row["messages"][1] == {"role": "assistant", "content": (f"Estimating, without the tool: {expr} is about "
                                                                       f"{guess}. The answer: \\boxed{{{guess}}}")}
        return False
    assert row["tools"] == [toy.CALCULATOR_SCHEMA]
    user, call, result, final = row["messages"]
    assert call["tool_calls"] == [{"function": {"name": "calculator", "arguments": {"expression": expr}}}]
    assert result == {"role": "tool", "content": str(answer)}
    assert final == {"role": "assistant", "content": f"\\boxed{{{answer}}}"}
    return True


def test_tool_sft_traces_call_the_tool_on_half_the_problems_it_is_offered_on_and_guess_otherwise():
    rows = toy.generate_tool_data(seed=0, num_sft=6000, num_rlvr=0, num_eval=0)["sft_tools"]
    calls = [check_tool_trace(row) for row in rows]
    offered = [row["tools"] is not None for row in rows]
    assert abs(sum(offered) / len(rows) - 0.75) < 0.03 and abs(sum(calls) / sum(offered) - 0.5) < 0.03
    assert not any(call and not tool for call, tool in zip(calls, offered))  # guesses beside the tool and without
    # a teacher that always calls when offered the tool guesses only without it
    rows = toy.generate_tool_data(seed=0, num_sft=2000, num_rlvr=0, num_eval=0, teacher_tool_rate=1.0,
                                  sft_notools_fraction=0.5)["sft_tools"]
    calls = [check_tool_trace(row) for row in rows]
    assert calls == [row["tools"] is not None for row in rows] and abs(sum(calls) / len(rows) - 0.5) < 0.04
    # a guess is rarely right (each operand rounded to hundreds: about 1 in 100): without the tool the task is
    # out of reach
    assert toy.estimate("48213+90127") == 138000 and toy.estimate("3187+4251") == 7500
    assert sum(toy.estimate(tool_expression(r)) == evaluate_expression(tool_expression(r)) for r in rows) < 0.02 * len(rows)


def test_tool_rows_render_and_train_on_the_call_and_the_answer_only(toy_model_dir, tmp_path):
    from transformers import AutoTokenizer

    import chat_template

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    data = toy.generate_tool_data(seed=0, num_sft=200, num_rlvr=0, num_eval=20)
    row = next(r for r in data["sft_tools"] if len(r["messages"]) == 4)
    expr = tool_expression(row)
    text = chat_template.render(row["messages"], tools=row["tools"])
    assert '<functions>[{"type": "function", "function": {"name": "calculator"' in text
    turns = (f'<|im_start|>assistant\n<function_calls>calculator(expression="{expr}")</function_calls><|im_end|>\n'
             f"<|im_start|>environment\n{evaluate_expression(expr)}<|im_end|>\n<|im_start|>assistant\n\\boxed{{")
    assert turns in text and text.endswith("}<|endoftext|>")
    # the command-line renderer prints the same text
    (tmp_path / "row.json").write_text(json.dumps(row))
    proc = subprocess.run([sys.executable, "chat_template.py", "render", "--template", "olmo3-instruct-dev",
                           "--messages", str(tmp_path / "row.json")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == text, proc.stderr
    # sft.py's tokenization trains the call with its hand-off and the answer, never the tool's result
    out = chat_template.tokenize_messages(tokenizer, row["messages"], tools=row["tools"])
    trained = tokenizer.decode([t for t, label in zip(out["input_ids"], out["labels"]) if label != -100])
    assert trained == (f'<function_calls>calculator(expression="{expr}")</function_calls><|im_end|>'
                       f"\\boxed{{{evaluate_expression(expr)}}}<|endoftext|>")
    # prompts stay short enough for the CPU demo (demo_tools.sh: --max_prompt_length 256)
    lengths = [len(chat_template.tokenize_prompt(tokenizer, r["messages"], tools=r.get("tools")))
               for r in data["eval_tools"]]
    assert max(lengths) <= 256, max(lengths)
    # the SFT file loads and tokenizes as a dataset, rows with and without tools together (nothing dropped)
    path = tmp_path / "sft_tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data["sft_tools"]))
    dataset, dropped = chat_template.tokenize_sft(chat_template.load_mixture([str(path), "1.0"]), tokenizer,
                                                  max_length=384, cache_dir="")
    assert len(dataset) == 200, dropped


def test_tool_guesses_ask_for_the_copies_a_call_asks_for_at_the_same_distances(toy_model_dir):
    # The guess rows teach the copies a call needs only if the copies span the same number of tokens: the problem
    # into the call or the restatement, the result or the estimate into the box. This holds for the toy
    # tokenizer; another tokenizer may count differently.
    from transformers import AutoTokenizer

    import chat_template

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)

    def distance(messages, tools, copied):  # tokens from the first occurrence of `copied` to the second
        ids = tokenizer.encode(chat_template.render(messages, tools=tools), add_special_tokens=False)
        pattern = tokenizer.encode(copied, add_special_tokens=False)
        found = [i for i in range(len(ids)) if ids[i:i + len(pattern)] == pattern]
        assert len(found) == 2, (copied, found)
        return found[1] - found[0]

    expr, answer = "3187+4205", 7392
    guess = toy.estimate(expr)
    for style in toy.TOOL_PROMPT_STYLES:
        user = [{"role": "user", "content": style.format(expr=expr)}]
        call = user + toy.tool_trace(expr, answer)
        guessed = user + [{"role": "assistant", "content": toy.guess_text(expr)}]
        for tools in ([toy.CALCULATOR_SCHEMA], None):  # a guess beside the tool, or without it
            assert distance(call, [toy.CALCULATOR_SCHEMA], expr) == distance(guessed, tools, expr) == 9 + 6 + 16
            assert distance(call, [toy.CALCULATOR_SCHEMA], str(answer)) == distance(guessed, tools, str(guess)) == 4 + 8


class ScriptedModel:
    """Stands in for a model in `toy.tool_episodes`: it calls the calculator on the expression in the user turn
    (once, or `calls` times in a row), then boxes the last environment result; `hand_off` ends a call turn."""

    def __init__(self, tokenizer, calls=1, hand_off="<|im_end|>", expression=None, extra_call=""):
        self.tokenizer, self.calls, self.hand_off, self.expression = tokenizer, calls, hand_off, expression
        self.extra_call = extra_call  # e.g. "\nweather(city=\"Paris\")": a second call in the same block
        self.contexts = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, do_sample):
        assert do_sample is False and set(eos_token_id) == {self.tokenizer.eos_token_id,
                                                           self.tokenizer.convert_tokens_to_ids("<|im_end|>")}
        outs = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            context = [t for t, m in zip(ids, mask) if m]
            self.contexts.append(context)
            text = self.tokenizer.decode(context)
            results = re.findall(r"<\|im_start\|>environment\n(.*?)<\|im_end\|>", text)
            if len(results) < self.calls:
                expr = self.expression or expression_of(text.split("<|im_start|>user\n")[1])
                call = f'calculator(expression="{expr}")'
                turn = f"<function_calls>{call}{self.extra_call}</function_calls>{self.hand_off}"
            else:
                turn = "\\boxed{" + (results[-1] if results else "0") + "}<|endoftext|>"
            new = self.tokenizer.encode(turn, add_special_tokens=False)[:max_new_tokens]
            outs.append(ids + new + [pad_token_id] * (max_new_tokens - len(new)))
        width = max(map(len, outs))
        return torch.tensor([o + [pad_token_id] * (width - len(o)) for o in outs])


def test_tool_episodes_run_the_calculator_and_append_its_result_as_tokens(toy_model_dir):
    from transformers import AutoTokenizer

    import chat_template
    from chat_template import tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    data = toy.generate_tool_data(seed=0, num_sft=0, num_rlvr=0, num_eval=6)
    rows = data["eval_tools"][:3] + data["eval_notools"][3:]
    model = ScriptedModel(tokenizer)
    episodes = toy.tool_episodes(model, tokenizer, rows, max_new_tokens=48, batch_size=2)
    for row, e in zip(rows[:3], episodes[:3]):  # offered the tool: call, result, answer
        answer = row["ground_truth"]
        assert e["calls"] == e["tool_turns"] == 1 and not e["errors"] and e["turns"][-1] == f"\\boxed{{{answer}}}"
        call = tokenizer.encode(f'<function_calls>calculator(expression="{tool_expression(row)}")</function_calls>'
                                "<|im_end|>", add_special_tokens=False)
        environment = tokenizer.encode(f"\n<|im_start|>environment\n{answer}<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
        final = tokenizer.encode(f"\\boxed{{{answer}}}<|endoftext|>", add_special_tokens=False)
        prompt = tokenize_prompt(tokenizer, row["messages"], tools=row["tools"])
        assert e["ids"] == prompt + call + environment + final
    for e in episodes[3:]:  # no tool offered: the call is the last turn, never answered
        assert e["calls"] == e["tool_turns"] == 0 and len(e["turns"]) == 1 and "<function_calls>" in e["turns"][0]
    # a model that keeps calling stops after max_tool_turns; eos after a call ends the episode
    endless = toy.tool_episodes(ScriptedModel(tokenizer, calls=99), tokenizer, rows[:2], max_tool_turns=3)
    assert all(e["tool_turns"] == 3 and len(e["turns"]) == 4 and e["errors"] == ["max_tool_turns"] for e in endless)
    ended = toy.tool_episodes(ScriptedModel(tokenizer, hand_off="<|endoftext|>"), tokenizer, rows[:2])
    assert all(e["calls"] == 0 and len(e["turns"]) == 1 for e in ended)
    # a call the calculator refuses gets its error as the result, and the episode goes on
    bad = toy.tool_episodes(ScriptedModel(tokenizer, expression="2**8"), tokenizer, rows[:1])[0]
    assert bad["calls"] == 1 and bad["errors"] == ["exception"] and bad["turns"][-1].startswith("\\boxed{error")
    # two calls in one turn: two environment turns, as the template renders two `tool` messages; a tool the row
    # does not offer is answered with an error
    two = toy.tool_episodes(ScriptedModel(tokenizer, extra_call='\nweather(city="Paris")'), tokenizer, rows[:1],
                         max_new_tokens=96)[0]
    assert two["calls"] == 2 and two["tool_turns"] == 1 and two["errors"] == ["unknown_tool"]
    expr, answer = tool_expression(rows[0]), rows[0]["ground_truth"]
    rendered = chat_template.render(rows[0]["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "calculator", "arguments": {"expression": expr}}},
            {"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": answer}, {"role": "tool", "content": "error: no tool named 'weather'"},
        {"role": "assistant", "content": "\\boxed{error: no tool named 'weather'}"}], tools=rows[0]["tools"])  # the script boxes the last result
    assert two["ids"] == tokenizer.encode(rendered, add_special_tokens=False)


def test_tool_eval_runs_on_the_toy_model_and_counts_calls(toy_model_dir, tmp_path, monkeypatch):
    data = toy.generate_tool_data(seed=0, num_sft=0, num_rlvr=0, num_eval=8)
    path = tmp_path / "eval_tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data["eval_tools"]))
    result = toy.tool_evaluate(toy_model_dir, str(path), max_new_tokens=8)  # the random model: no calls, no answers
    assert result["num_examples"] == 8 and result["accuracy"] == 0.0 and result["tools_offered"] == 1.0
    assert result["calls_per_episode"] == 0.0 and result["mean_prompt_tokens"] > 100
    # the same, with a model that solves every problem with one call; then the table
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: ScriptedModel(tokenizer)))
    monkeypatch.setattr(ScriptedModel, "eval", lambda self: self, raising=False)
    solved = toy.tool_evaluate(toy_model_dir, str(path))
    assert solved["accuracy"] == 1.0 and solved["calls_per_episode"] == 1.0 and solved["episodes_calling"] == 1.0
    notools = tmp_path / "eval_notools.jsonl"
    notools.write_text("".join(json.dumps(r) + "\n" for r in data["eval_notools"]))
    results = toy.tool_report({"scripted": toy_model_dir}, {"with tool": str(path), "without": str(notools)},
                              str(tmp_path / "report"))
    assert results["scripted"]["without"]["accuracy"] == 0.0 and results["scripted"]["without"]["episodes_calling"] == 1.0
    table = (tmp_path / "report" / "tool_results.md").read_text().splitlines()
    assert table[0] == "| Toy tool use (held-out) | scripted |" and "| Accuracy, greedy, with tool (%) | 100.0 |" in table
