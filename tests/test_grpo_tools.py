"""grpo.py's tool episodes: the call parser, the tool runner, the loss mask of appended tokens, the startup check
of the rows' tools, the template's tokens between turns; then, on real vLLM (marked slow), episodes of a toy model
that memorized a few tool-using conversations: two calls in one episode trained token for token as sampled,
a slow tool while another request keeps decoding, failing tools answered and counted, --max_tool_turns, a call
closed by eos, and a `python grpo.py` run on rows that offer tools."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import chat_template as ct
import grpo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_FILE = os.path.join(REPO, "tests", "data", "episode_tools.py")


# -------------------------------------------------------------------------------------------------
# Parsing calls
# -------------------------------------------------------------------------------------------------
def test_parse_tool_calls_reads_what_the_template_prints():
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "Let me add.", "tool_calls": [
                    {"function": {"name": "calculator", "arguments": {"expression": "12+30"}}},
                    {"function": {"name": "lookup", "arguments": {"keys": ["a", "b"], "exact": True, "limit": -3,
                                                                  "opts": {"x": None}}}}]},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "done"}]
    for template in ("olmo3-instruct-dev", "olmo3-instruct-release"):
        text = ct.render(messages, template=template)
        turn = text[text.index("Let me add."):text.index("<|im_start|>environment")]
        assert grpo.parse_tool_calls(turn) == [
            ("calculator", [], {"expression": "12+30"}),
            ("lookup", [], {"keys": ["a", "b"], "exact": True, "limit": -3, "opts": {"x": None}})]
    assert grpo.parse_tool_calls("The answer is \\boxed{3}.") is None
    assert grpo.parse_tool_calls('<function_calls>{"name": "f", "arguments": {"a": 1}}</function_calls>') == [
        ("f", [], {"a": 1})]
    assert grpo.parse_tool_calls("<function_calls>f(1, 'two')</function_calls> trailing") == [("f", [1, "two"], {})]


@pytest.mark.parametrize("body, says", [
    ("calculator(expression=", "do not parse"),
    ("__import__('os').system('true')", "not a call"),
    ("os.system('true')", "not a call"),
    ("f(x=open('/etc/passwd'))", "not a literal"),
    ("f(x=1+2)", "not a literal"),
    ("f(*[1, 2])", "not a call"),
    ("f(**{'a': 1})", "not a call"),
    ("f(x={[1]: 2})", "do not parse"),
    ("f(x=" + "[" * 300 + "]" * 300 + ")", "do not parse"),
    ("x = 1", "not a call"),
    ("", "holds no call"),
    ("\n".join(["f()"] * 9), "9 calls"),
    ("f(x='" + "a" * 30000 + "')", "characters long"),
])
def test_malformed_calls_are_named_errors(body, says):
    with pytest.raises(grpo.ToolCallError, match=says) as e:
        grpo.parse_tool_calls(f"<function_calls>{body}</function_calls>")
    assert e.value.kind == "malformed"
    with pytest.raises(grpo.ToolCallError, match="without </function_calls>"):
        grpo.parse_tool_calls("<function_calls>f()")


# -------------------------------------------------------------------------------------------------
# Running tools
# -------------------------------------------------------------------------------------------------
def _wait_finished(runner, limit_s):
    deadline, got = time.monotonic() + limit_s, []
    while not got:
        assert time.monotonic() < deadline, "the runner never finished the turn"
        got = runner.finished()
        time.sleep(0.01)
    return got


def test_tool_runner_answers_every_kind_of_failure_and_counts_it():
    def echo(text: str) -> str:
        return text

    def boom():
        raise KeyError("x")

    def leave():
        raise SystemExit(3)

    def hang():
        time.sleep(60)

    runner = grpo.ToolRunner({"echo": echo, "boom": boom, "leave": leave, "hang": hang, "num": lambda: 7},
                             timeout_s=0.5, max_output_chars=100)
    calls = [("echo", [], {"text": "hi"}), ("nope", [], {}), ("echo", [], {"txt": 1}), ("boom", [], {}),
             ("leave", [], {}), ("hang", [], {}), ("echo", ["x" * 150], {}), ("num", [], {})]
    t0 = time.monotonic()
    runner.submit("a", calls)
    runner.submit("b", grpo.ToolCallError("malformed", "the calls do not parse"))
    runner.submit("c", [("echo", [], {"text": "hi"}), ("num", [], {})], offered=["num", "missing"])
    got = {}
    while len(got) < 3:
        got.update({key: (results, kinds) for key, results, kinds, _ in _wait_finished(runner, 5)})
    assert time.monotonic() - t0 < 2.0  # the hanging call was abandoned at its deadline, not waited for
    results, kinds = got["a"]
    assert results[0] == "hi" and kinds[0] is None
    assert results[1].startswith("error: no tool named 'nope' (tools: boom, echo, hang, leave, num)")
    assert kinds[1:6] == ["unknown_tool", "bad_arguments", "exception", "exception", "timeout"]
    assert "KeyError" in results[3] and "SystemExit" in results[4] and "timed out after 0.5s" in results[5]
    assert results[6] == "x" * 100 + "... [cut at 100 characters]" and results[7] == "7"
    assert got["b"] == (["error: the calls do not parse"], ["malformed"])
    # a row's calls reach only the tools it offers (and that exist)
    assert got["c"] == (["error: no tool named 'echo' (tools: num)", "7"], ["unknown_tool", None])
    assert runner.finished() == [] and runner.turns == {}


def test_tool_runner_runs_calls_off_the_callers_thread():
    """Four 0.5 s calls in two turns answer in about 0.5 s, and submit() returns at once."""
    runner = grpo.ToolRunner({"nap": lambda: time.sleep(0.5) or "ok"}, timeout_s=10, max_output_chars=100)
    t0 = time.monotonic()
    runner.submit("a", [("nap", [], {})] * 2)
    runner.submit("b", [("nap", [], {})] * 2)
    assert time.monotonic() - t0 < 0.1
    done = []
    while len(done) < 2:
        done += _wait_finished(runner, 5)
    assert time.monotonic() - t0 < 1.5
    assert sorted(k for k, *_ in done) == ["a", "b"] and all(r == ["ok", "ok"] for _, r, _, _ in done)


def test_load_tools_takes_a_users_module_and_refuses_a_bad_one(tmp_path):
    tools = grpo.load_tools(grpo.Args(tools_module=TOOLS_FILE))
    assert sorted(tools) == ["calculator", "fails", "hang", "python", "sleepy"]
    assert tools["calculator"]("12+30") == "42"
    bad = tmp_path / "bad.py"
    bad.write_text("TOOLS = ['calculator']\n")
    with pytest.raises(ValueError, match="must define TOOLS"):
        grpo.load_tools(grpo.Args(tools_module=str(bad)))
    with pytest.raises(ValueError, match="no such Python file"):
        grpo.load_tools(grpo.Args(tools_module=str(tmp_path / "missing.py")))


def test_builtin_python_tool_runs_in_the_sandbox(sandbox):
    python = grpo.load_tools(grpo.Args())["python"]
    assert python("print(sum(range(10)))") == "45\n"
    out = python("import sys; print('a'); sys.exit('bad')")
    assert out.startswith("a\n") and "bad" in out and "[exit_1]" in out


def test_rows_offering_unregistered_tools_stop_the_run(toy_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    rows = [{"messages": [{"role": "user", "content": "What is 1+1?"}], "ground_truth": "2", "verifier": "math",
             "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]},
            {"messages": [{"role": "user", "content": "What is 2+2?"}], "ground_truth": "4", "verifier": "math"}]
    ds, _ = ct.tokenize_rlvr(rows, tok, 512, cache_dir="")
    assert ds[0]["tool_names"] == ["calculator"] and ds[1]["tool_names"] == []
    assert grpo.Dispatcher.prompt(_dispatcher(), 0, "train", ds[0], 2)["tools"] == ["calculator"]
    assert "tools" not in grpo.Dispatcher.prompt(_dispatcher(), 1, "train", ds[1], 2)
    with pytest.raises(ValueError, match=r"--dataset_mixer_list: 'calculator' \(1 rows\)"):
        grpo.check_tool_rows({"--dataset_mixer_list": ds, "--eval_dataset_mixer_list": None}, grpo.Args())
    grpo.check_tool_rows({"--dataset_mixer_list": ds}, grpo.Args(tools_module=TOOLS_FILE))


def _dispatcher():
    class D:
        args = grpo.Args()
    return D()


# -------------------------------------------------------------------------------------------------
# Tokens between turns, and the loss mask
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["olmo3-instruct-dev", "olmo3-instruct-release"])
def test_appended_tokens_are_the_templates_own(toy_model_dir, template):
    """Prompt + a sampled turn + ToolTurns' results tokens + the next sampled turn: exactly the tokens of the
    template's render of the whole conversation, each piece tokenized on its own. (A think template's next
    header is its generation prompt, `<think>` included, which a render of a finished turn does not hold.)"""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    turns = ct.ToolTurns(tok, template)
    assert tok.convert_ids_to_tokens(turns.stop_token_ids) == ["<|im_end|>"]
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    call = {"function": {"name": "calculator", "arguments": {"expression": "12+30"}}}
    messages = [{"role": "user", "content": "What is 12+30+8?"},
                {"role": "assistant", "content": "Adding.", "tool_calls": [call, call]},
                {"role": "tool", "content": "42"}, {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "\\boxed{50}"}]
    full = ct.render(messages, template=template, tools=tools)
    prompt = ct.tokenize_prompt(tok, messages[:1], tools=tools, chat_template=template)
    first = full[len(tok.decode(prompt)):full.index("<|im_end|>", full.index("Adding.")) + len("<|im_end|>")]
    rest = full[full.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    pieces = prompt + tok(first, add_special_tokens=False)["input_ids"] + turns.results_ids(["42", "42"]) + tok(
        rest, add_special_tokens=False)["input_ids"]
    assert pieces == tok(full, add_special_tokens=False)["input_ids"]
    think = ct.ToolTurns(tok, template.replace("instruct", "think"))
    assert tok.decode(think.results_ids(["42"])) == "\n<|im_start|>environment\n42<|im_end|>\n<|im_start|>assistant\n<think>"


RELEASED = os.path.join(REPO, "tests", "data", "olmo3_released_instruct.jinja")  # Olmo 3.1 Instruct's own


def test_function_calling_rows_load_and_render_as_the_released_template(toy_model_dir, tmp_path):
    """Rows in Olmo 3's function-calling format (tool schemas in `tools`, calls in `tool_calls` with the
    arguments as a JSON string, results in `tool` messages), read from a file by load_mixture: the RL
    prompt is what the released template renders, a call it renders parses back to the same call, and the
    tokens ToolTurns appends after a call are the released render's, piece by piece."""
    from transformers import AutoTokenizer

    with open(RELEASED, encoding="utf-8") as f:
        released = f.read()
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    user = {"role": "user", "content": "Weather in Boston?"}
    wire = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Boston"})}}]}
    result = {"role": "tool", "content": "{\"temp\": 61}", "tool_call_id": "c1"}
    answer = {"role": "assistant", "content": "61 degrees."}
    path = tmp_path / "fc.jsonl"
    path.write_text(json.dumps({"messages": [user, wire, result, answer], "tools": tools, "ground_truth": "61",
                                "verifier": "math"}) + "\n")
    rows = ct.load_mixture([str(path), "1.0"])
    ds, drops = ct.tokenize_rlvr(rows, tok, 1024, chat_template=RELEASED, cache_dir="")
    assert not drops and ds[0]["tool_names"] == ["get_weather"]
    # the prompt drops the trailing answer only; the released template sees the call with dict arguments
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Boston"}}}]}
    prompt = tok.apply_chat_template([user, call, result], tools=tools, chat_template=released, tokenize=False,
                                     add_generation_prompt=True)
    assert tok.decode(ds[0]["prompt_input_ids"]) == prompt
    assert ds[0]["prompt_input_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    full = tok.apply_chat_template([user, call, result, answer], tools=tools, chat_template=released,
                                   tokenize=False)
    turn = full[full.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    assert grpo.parse_tool_calls(turn[:turn.index("<|im_end|>")]) == [("get_weather", [], {"city": "Boston"})]
    turns = ct.ToolTurns(tok, RELEASED)
    before = full[:full.index("<|im_end|>", full.index("<|im_start|>assistant\n")) + len("<|im_end|>")]
    after = full[len(before):full.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")]
    assert turns.results_ids(['{"temp": 61}']) == tok(after, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(turns.stop_token_ids) == ["<|im_end|>"]


def test_appended_tokens_are_context_not_loss():
    row = {"prompt_ids": [1, 2, 3], "response_ids": [10, 11, 90, 91, 92, 12, 13], "advantage": 1.0,
           "sampling_logprobs": [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4], "loss_mask": [1, 1, 0, 0, 0, 1, 1]}
    b = grpo.collate_bin([row])
    # position t predicts token t + 1: the response starts at position 2; appended 90..92 are never targets
    assert b["mask"].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1, 0]
    assert b["targets"][b["mask"] > 0].tolist() == [10, 11, 12, 13]
    assert b["sampling_logprobs"][b["mask"] > 0].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert grpo.trained_tokens(row) == 4 and grpo.trained_tokens(dict(row, loss_mask=None)) == 7


# -------------------------------------------------------------------------------------------------
# Episodes on real vLLM: a toy model that memorized four tool-using conversations
# -------------------------------------------------------------------------------------------------
TOOLS = [{"name": n} for n in ("calculator", "sleepy", "fails", "hang")]  # short prompts: a fast fixture
SYSTEM = {"role": "system", "content": "Use tools."}
TIMEOUT_S = 3.0  # --tool_timeout_s of these episodes: the hanging tool's answer says it
TEMPERATURE = 0.3  # the memorized conversations, sampled all but greedily


def _call(name, **arguments):
    return {"function": {"name": name, "arguments": arguments}}


def _conversations() -> dict:
    """prompt text -> (the conversation the model memorizes, the tool results it will be answered with)."""
    unknown = "error: no tool named 'nope' (tools: calculator, fails, hang, sleepy)"  # the row's, not python
    episodes = {
        "Add 12, 30 and 8.": [("First 12+30.", [_call("calculator", expression="12+30")], ["42"]),
                              ("Then 42+8.", [_call("calculator", expression="42+8")], ["50"]),
                              ("\\boxed{50}", None, None)],
        "Try every tool.": [("<function_calls>calculator(expression=</function_calls>", None,
                             ["error: the calls do not parse: SyntaxError: '(' was never closed (<unknown>, line 1)"]),
                            ("Unknown.", [_call("nope")], [unknown]),
                            ("Fails.", [_call("fails")], ["error: RuntimeError: tool failed"]),
                            ("Hangs.", [_call("hang")], [f"error: the call timed out after {TIMEOUT_S:g}s"]),
                            ("\\boxed{0}", None, None)],
        "Sleep a while.": [("Sleeping.", [_call("sleepy", seconds=2)], ["slept"]), ("\\boxed{1}", None, None)],
        "Count forever.": [("One.", [_call("calculator", expression="1+1")], ["2"]),
                           ("Two.", [_call("calculator", expression="2+1")], ["3"]),
                           ("Three.", [_call("calculator", expression="3+1")], ["4"]),
                           ("\\boxed{4}", None, None)],
        # ends in a call: the released templates close it with eos, so the model learns eos after it
        "Call, then stop.": [("Stopping.", [_call("calculator", expression="1+2")], None)],
    }
    out = {}
    for prompt, turns in episodes.items():
        messages, results = [SYSTEM, {"role": "user", "content": prompt}], []
        for content, calls, answers in turns:
            messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            messages += [{"role": "tool", "content": a} for a in answers or []]
            results += [answers] if answers else []
        out[prompt] = (messages, results)
    return out


MEMORIZE = {"lr": 5e-3, "max_steps": 300, "stop_loss": 5e-3, "seed": 0}


@pytest.fixture(scope="module")
def tool_model_dir(toy_model_dir, tmp_path_factory):
    """The toy model trained on the four conversations until it reproduces them at a low temperature (one to
    three minutes), cached on disk like the SFT fixture, keyed by the toy model, the conversations and the
    training settings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import _fixture_key, cached_fixture_dir

    conversations = _conversations()
    cached, store = cached_fixture_dir("tool_model", _fixture_key(
        [toy_model_dir], [json.dumps([conversations, TOOLS, SYSTEM, MEMORIZE], sort_keys=True)]))
    if cached:
        return cached
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    rows = [ct.tokenize_messages(tok, m, tools=TOOLS) for m, _ in conversations.values()]
    torch.manual_seed(MEMORIZE["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=MEMORIZE["lr"])
    for _ in range(MEMORIZE["max_steps"]):
        losses = []
        for r in rows:  # one conversation per forward: no padding
            loss = model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]])).loss
            (loss / len(rows)).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if max(losses) < MEMORIZE["stop_loss"]:
            break
    assert max(losses) < 3e-2, f"the toy model did not memorize the conversations (losses {losses})"
    out = str(tmp_path_factory.mktemp("tool_model"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return store(out)


def _prompt(tok, index, text, n=1, **extra):
    return {"kind": "train", "index": index, "n": n, "ground_truth": "0", "verifier": "math", "tools": None,
            "prompt_ids": ct.tokenize_prompt(tok, [SYSTEM, {"role": "user", "content": text}], tools=TOOLS), **extra}


@pytest.fixture(scope="module")
def episode_actor(tool_model_dir):
    """An Actor on the memorized model, its engine loop in a thread; `run(prompts)` returns their groups."""
    from transformers import AutoTokenizer

    args = grpo.Args(enforce_eager=True, max_num_seqs=8, max_prompt_length=256, max_response_length=400,
                     timeout_s=120, tools_module=TOOLS_FILE, tool_timeout_s=TIMEOUT_S, temperature=TEMPERATURE)
    out, errors = [], []
    actor = grpo.Actor(args, tool_model_dir, 0, out.append, "cpu")

    def loop():
        try:
            actor.run()
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threading.Thread(target=loop, daemon=True).start()
    actor.updates.put({"version": 0})  # no weights: update_weight_version only

    def run(prompts, limit_s=120, watch=None):
        first = len(out)
        actor.inbox.put(prompts)
        deadline = time.time() + limit_s
        while len([m for m in out[first:] if "group" in m]) < len(prompts):
            assert time.time() < deadline and not errors, errors
            if watch:
                watch()
            time.sleep(0.005)
        groups = [m["group"] for m in out[first:] if "group" in m]
        stats = grpo.sum_actor_stats([m["stats"] for m in out[first:] if "stats" in m] + [actor.take_stats()])
        return {g["index"]: g for g in groups}, stats

    actor.tok = AutoTokenizer.from_pretrained(tool_model_dir)
    actor.run_prompts = run
    yield actor
    actor.shutdown()


def _spans(mask):
    """[(start, end, value)] of the runs in a 0/1 mask."""
    spans, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            spans.append((start, i, mask[start]))
            start = i
    return spans


@pytest.mark.slow
def test_episode_with_two_calls_trains_exactly_the_sampled_tokens(episode_actor, tool_model_dir):
    """Two calculator calls, then the answer: the appended spans are the template's tokens for the real
    results, the sampled spans are vLLM's tokens with their logprobs and one version each, and the learner's
    batch trains those and only those: its targets under the mask are the sampled ids position by position,
    and the learner's logprobs of them in this very sequence are vLLM's sampling logprobs."""
    from transformers import AutoModelForCausalLM

    actor = episode_actor
    groups, stats = actor.run_prompts([_prompt(actor.tok, 0, "Add 12, 30 and 8.", n=2, tools=["calculator"])])
    turns = ct.ToolTurns(actor.tok)
    for s in groups[0]["samples"]:
        ids, mask = s["response_ids"], s["loss_mask"]
        assert s["tool_turns"] == 2 and s["tool_calls"] == 2 and s["finish_reason"] == "stop"
        spans = _spans(mask)
        assert [v for _, _, v in spans] == [1, 0, 1, 0, 1]
        assert ids[spans[1][0]:spans[1][1]] == turns.results_ids(["42"])
        assert ids[spans[3][0]:spans[3][1]] == turns.results_ids(["50"])
        assert actor.tok.decode(ids[spans[4][0]:]) == "\\boxed{50}<|endoftext|>"
        assert s["answer_start"] == spans[4][0]
        assert len(s["versions"]) == sum(mask) and set(s["versions"]) == {0}
        assert all(s["sampling_logprobs"][i] == 0.0 for i, m in enumerate(mask) if not m)
        assert all(ids[e - 1] == turns.stop_token_ids[0] for _, e, v in spans[:3] if v)  # each call turn closed
        # the learner's view of the same sample
        prompt_ids = groups[0]["prompt_ids"]
        row = {"prompt_ids": prompt_ids, "response_ids": ids, "loss_mask": mask, "advantage": 1.0,
               "sampling_logprobs": s["sampling_logprobs"]}
        batch = grpo.collate_bin([row])
        trained = batch["mask"] > 0
        assert batch["targets"][trained].tolist() == [t for t, m in zip(ids, mask) if m]
        assert batch["input_ids"].tolist() == list(prompt_ids) + ids
        model = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32).eval()
        grpo.install_chunked_head(model, chunk_size=256)
        with torch.no_grad():
            learner_lp = grpo.token_logprobs(model, batch, TEMPERATURE)[0][trained]
        assert (learner_lp - batch["sampling_logprobs"][trained]).abs().max() < 2e-3
    assert stats["tool_calls"] == 4 and stats["episodes"] == 2
    assert stats["appended_tokens"] == 2 * (len(turns.results_ids(["42"])) + len(turns.results_ids(["50"])))
    assert stats["sampled_tokens"] == sum(sum(s["loss_mask"]) for s in groups[0]["samples"])


@pytest.mark.slow
def test_failing_tools_are_answered_and_counted(episode_actor):
    """A malformed call, an unknown tool, a tool that raises and one that hangs: each answered with its error
    (which the model then reads), counted by kind, and the episode goes on to its answer."""
    actor = episode_actor
    t0 = time.monotonic()
    groups, stats = actor.run_prompts([_prompt(actor.tok, 1, "Try every tool.", tools=["calculator", "fails",
                                                                                       "hang", "sleepy"])])
    (s,) = groups[1]["samples"]
    assert s["tool_turns"] == 4 and s["tool_calls"] == 4
    text = actor.tok.decode(s["response_ids"])
    for answer in _conversations()["Try every tool."][1]:
        assert f"<|im_start|>environment\n{answer[0]}<|im_end|>" in text
    assert actor.tok.decode(s["response_ids"][s["answer_start"]:]) == "\\boxed{0}<|endoftext|>"
    assert {k: stats[f"tool_errors_{k}"] for k in ("malformed", "unknown_tool", "exception", "timeout")} == {
        "malformed": 1, "unknown_tool": 1, "exception": 1, "timeout": 1}
    assert time.monotonic() - t0 < 60  # the hanging tool cost its timeout, not an hour


@pytest.mark.slow
def test_a_slow_tool_leaves_the_engine_to_other_requests(episode_actor):
    """While one episode's tool sleeps 2 s, a request without tools keeps decoding: it gains tokens during the
    sleep, and the engine's occupancy while tools ran is measured (perf/actor_occupancy_while_tools)."""
    actor = episode_actor
    seen = []

    def watch():
        other = [st for rid, st in actor.pending.items() if rid.startswith("train-3-")]
        seen.append((time.monotonic(), bool(actor.in_tools), len(other[0]["tokens"]) if other else None))

    long_request = _prompt(actor.tok, 3, "Count forever.", max_tokens=[390], ignore_eos=True)
    groups, stats = actor.run_prompts([_prompt(actor.tok, 2, "Sleep a while.", tools=["sleepy"]), long_request],
                                      watch=watch)
    (slept,) = groups[2]["samples"]
    assert slept["tool_calls"] == 1 and slept["tool_turns"] == 1 and stats["tool_s"] >= 2.0
    during = [n for _, in_tools, n in seen if in_tools and n is not None]
    assert during and during[-1] - during[0] >= 10, "the other request did not decode while the tool slept"
    assert len(groups[3]["samples"][0]["response_ids"]) == 390 and "loss_mask" not in groups[3]["samples"][0]
    assert stats["tool_window_s"] >= 1.9
    occupancy = grpo.tool_metrics([slept], stats)["perf/actor_occupancy_while_tools"]
    assert 0 < occupancy <= 1.0 / actor.args.max_num_seqs + 1e-9  # one of eight slots decoded while it slept


@pytest.mark.slow
def test_max_tool_turns_ends_the_episode(episode_actor):
    """The memorized conversation calls three times; with --max_tool_turns 2 the third call is not run: the
    episode ends there, counted as tool_turn_limit."""
    actor = episode_actor
    actor.args.max_tool_turns = 2
    try:
        groups, stats = actor.run_prompts([_prompt(actor.tok, 4, "Count forever.", tools=["calculator"])])
    finally:
        actor.args.max_tool_turns = 5
    (s,) = groups[4]["samples"]
    assert s["tool_turns"] == 2 and s["tool_calls"] == 2 and s["finish_reason"] == "tool_turn_limit"
    assert stats["tool_turn_limit"] == 1 and "calculator(expression=\"3+1\")" in actor.tok.decode(s["response_ids"])
    assert s["answer_start"] == len(s["response_ids"])  # the verifier sees no answer, not the call


@pytest.mark.slow
def test_a_call_closed_by_eos_ends_the_episode(episode_actor):
    """A call the model closes with eos instead of the hand-off <|im_end|> (what the released templates train on
    a conversation's final call): no template renders a turn after eos, so the call is not run and the episode
    ends there with no answer to score, counted as tool_errors_call_closed_by_eos."""
    actor = episode_actor
    groups, stats = actor.run_prompts([_prompt(actor.tok, 5, "Call, then stop.", tools=["calculator"])])
    (s,) = groups[5]["samples"]
    assert actor.tok.decode(s["response_ids"]) == (
        'Stopping.<function_calls>calculator(expression="1+2")</function_calls><|endoftext|>')
    assert s["finish_reason"] == "call_closed_by_eos" and s["tool_calls"] == 0 and s["tool_turns"] == 0
    assert stats["tool_errors_call_closed_by_eos"] == 1 and stats["tool_calls"] == 0
    assert s["answer_start"] == len(s["response_ids"]) and s["loss_mask"] == [1] * len(s["response_ids"])
    assert grpo.tool_metrics([s], stats)["tools/errors_call_closed_by_eos"] == 1


@pytest.mark.slow
def test_grpo_trains_on_rows_that_offer_tools(tool_model_dir, tmp_path):
    """`python grpo.py` on rows in Olmo 3's function-calling format: episodes run, the verifier scores the
    final answer, appended tokens stay out of the loss, and the tool metrics are logged."""
    # sampled at temperature 1, the memorized episode sometimes slips: groups whose rewards differ, to train on
    rows = [{"messages": [SYSTEM, {"role": "user", "content": "Add 12, 30 and 8."}], "tools": TOOLS,
             "ground_truth": "50", "verifier": "math", "dataset": "tools"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 8))
    out = str(tmp_path / "out")
    cmd = [sys.executable, os.path.join(REPO, "grpo.py"), "--model_name_or_path", tool_model_dir,
           "--output_dir", out, "--dataset_mixer_list", str(data), "1.0", "--eval_dataset_mixer_list", str(data), "2",
           "--tools_module", TOOLS_FILE, "--max_tool_turns", "2", "--num_training_steps", "2", "--eval_every", "2",
           "--num_unique_prompts_per_step", "2", "--num_samples_per_prompt", "4", "--max_prompt_length", "256",
           "--max_response_length", "300", "--max_num_seqs", "16", "--enforce_eager", "--timeout_s", "120",
           "--learning_rate", "1e-5", "--report_to", "none", "--max_prompts_per_step_factor", "10"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    train = [m for m in metrics if "train/loss" in m]
    assert len(train) == 2
    # the engines' counts come with the groups they finish, so a step may carry another's: summed over the run
    assert sum(m["tools/calls"] for m in train) > 0 and sum(m["tokens/appended"] for m in train) > 0
    assert all(m["tools/episodes"] == m["rollout/samples"] > 0 and m["tools/turns_per_episode"] > 1 for m in train)
    assert all(k.startswith("tools/errors_") for m in train for k in m if k.startswith("tools/err"))
    # appended tokens are in each response and out of the loss
    assert all(m["train/trained_tokens"] < m["rollout/response_length"] * m["rollout/samples"] for m in train)
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert evals and all(m["eval/tools/episodes"] == 2 * 4 and m["eval/pass@1"] > 0 for m in evals)
