"""Renders of `olmo3-instruct-release` against the released Olmo 3.1 Instruct template, byte for byte.

tests/data/olmo3_released_instruct.jinja is the `chat_template` of allenai/Olmo-3.1-32B-Instruct (the
same text as allenai/olmo-3-tokenizer-instruct-release), kept as data. Both templates render through
the tokenizer's own `apply_chat_template`. The released template reads `tool_call['function']['arguments']`
as a mapping, so the cases give calls in that form; ours also accepts JSON-string arguments and flat calls.
"""

import os

import pytest
from transformers import AutoTokenizer

import chat_template as ct

with open(os.path.join(os.path.dirname(__file__), "data", "olmo3_released_instruct.jinja"), encoding="utf-8") as f:
    RELEASED = f.read()
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Wetter für eine Stadt", "parameters": CITY}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


USER = {"role": "user", "content": "Weather in Boston?"}
CALL_ONLY = {"role": "assistant", "content": None, "tool_calls": [call("get_weather", city="Boston")]}
CALL_NO_CONTENT_KEY = {"role": "assistant", "tool_calls": [call("get_weather", city="Zürich", days=[1, 2])]}
CALL_WITH_TEXT = {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", city="Boston")]}
TWO_CALLS = {"role": "assistant", "content": None,
             "tool_calls": [call("get_weather", city="Boston", units={"temp": "F", "wind": None}), call("now")]}
RESULT = {"role": "tool", "content": '{"temp": 41}'}
ENV = {"role": "environment", "content": "12:00"}
ANSWER = {"role": "assistant", "content": "It is 41F."}
SYSTEM = {"role": "system", "content": "Be brief."}
# Arrow / OpenAI-style data stores empty calls on plain turns; the released template prints them (`is not none`).
EMPTY_LIST = {"role": "assistant", "content": "x", "tool_calls": []}
EMPTY_STRING = {"role": "assistant", "content": "x", "function_calls": ""}
# The released Instruct template never reads reasoning_content.
REASONING = {"role": "assistant", "reasoning_content": "41F, say so.", "content": "It is 41F."}
REASONING_CALL = {**CALL_ONLY, "reasoning_content": "I need the weather."}

# name -> (messages, tools, add_generation_prompt)
CASES = {
    "plain_answer": ([USER, ANSWER], None, False),
    "final_call_without_content": ([USER, CALL_ONLY], TOOLS, False),  # the render that differed before
    "final_call_without_content_key": ([USER, CALL_NO_CONTENT_KEY], TOOLS, False),
    "final_call_with_text": ([USER, CALL_WITH_TEXT], TOOLS, False),
    "final_two_calls_no_tools_given": ([USER, TWO_CALLS], None, False),
    "call_result_answer": ([USER, CALL_ONLY, RESULT, ANSWER], TOOLS, False),
    "two_rounds_ending_in_call": ([SYSTEM, USER, CALL_ONLY, RESULT, TWO_CALLS, ENV, CALL_WITH_TEXT], TOOLS, False),
    "call_first_in_conversation": ([CALL_ONLY, RESULT, ANSWER], TOOLS, False),
    "call_first_and_last": ([CALL_ONLY], TOOLS, False),
    "result_last_generation_prompt": ([USER, CALL_ONLY, RESULT], TOOLS, True),
    "environment_role_then_answer": ([USER, TWO_CALLS, ENV, RESULT, ANSWER], None, False),
    "system_with_tools": ([SYSTEM, USER, CALL_ONLY], TOOLS, False),
    "system_functions_string": ([{**SYSTEM, "functions": '[{"name": "now"}]'}, USER, CALL_ONLY], None, False),
    "function_calls_string_last": ([USER, {"role": "assistant", "content": None, "function_calls": "now()"}], None,
                                   False),
    "generation_prompt_after_user": ([USER], TOOLS, True),
    "empty_tool_calls_last": ([USER, EMPTY_LIST], None, False),
    "empty_function_calls_last": ([USER, EMPTY_STRING], None, False),
    "empty_tool_calls_mid_conversation": ([USER, EMPTY_LIST, USER, EMPTY_STRING, USER, ANSWER], TOOLS, False),
    "empty_function_calls_beside_tool_calls": ([USER, {**CALL_ONLY, "function_calls": ""}], TOOLS, False),
    "none_function_calls_beside_tool_calls": ([USER, {**CALL_ONLY, "function_calls": None}], TOOLS, False),
    "reasoning_content_ignored": ([USER, REASONING], None, False),
    "reasoning_content_with_call_mid_conversation": ([USER, REASONING_CALL, RESULT, REASONING], TOOLS, False),
}

@pytest.fixture(scope="module")
def tok(toy_model_dir):
    return AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.mark.parametrize("case", sorted(CASES))
def test_release_renders_like_the_released_template(tok, case):
    messages, tools, agp = CASES[case]
    released = tok.apply_chat_template(messages, tools=tools, chat_template=RELEASED, tokenize=False,
                                       add_generation_prompt=agp)
    ours = tok.apply_chat_template(messages, tools=tools, chat_template=ct.TEMPLATES["olmo3-instruct-release"],
                                   tokenize=False, add_generation_prompt=agp)
    assert ours == released
    assert ct.render(messages, "olmo3-instruct-release", tools=tools, add_generation_prompt=agp,
                     eos_token=tok.eos_token) == released
    if not agp:
        assert released.endswith(tok.eos_token)  # the final turn ends with eos, a tool call included


def test_final_tool_call_trains_eos(tok):
    """The final call's closing token is eos, trained; the earlier call's `<|im_end|>` trains too."""
    messages = [USER, CALL_ONLY, RESULT, TWO_CALLS]
    out = ct.tokenize_messages(tok, messages, tools=TOOLS, chat_template="olmo3-instruct-release")
    trained = [i for i, label in zip(out["input_ids"], out["labels"]) if label != -100]
    assert trained[-1] == tok.eos_token_id and out["input_ids"][-1] == tok.eos_token_id
    text = tok.decode(trained)
    assert 'get_weather(city="Boston")</function_calls><|im_end|>' in text
    assert text.endswith('now()</function_calls>' + tok.eos_token)


def test_dev_and_think_templates_differ_from_release_only_in_system_prompt_and_generation_prompt(tok):
    """The notes: release = dev + the identity system prompt, think = instruct + `<think>` in the generation
    prompt. Every case, empty calls and reasoning_content included, renders the same in all four once the
    system turn is given; without one, only the system turn differs; with a generation prompt, only it."""
    for name, (messages, tools, agp) in CASES.items():
        with_system = messages if messages and messages[0]["role"] == "system" else [SYSTEM, *messages]
        texts = {t: tok.apply_chat_template(with_system, tools=tools, chat_template=ct.TEMPLATES[t], tokenize=False,
                                            add_generation_prompt=agp).removesuffix("<think>")
                 for t in ct.TEMPLATES}
        assert len(set(texts.values())) == 1, (name, texts)
        dev = ct.render(messages, "olmo3-instruct-dev", tools=tools, eos_token=tok.eos_token)
        release = ct.render(messages, "olmo3-instruct-release", tools=tools, eos_token=tok.eos_token)
        assert dev.replace(ct.DEV_SYSTEM, ct.OLMO_IDENTITY, 1) == release, name
        assert ct.render(messages, "olmo3-think-dev", tools=tools, eos_token=tok.eos_token) == dev


@pytest.mark.parametrize("case", sorted(name for name in CASES if not CASES[name][2]))
def test_think_release_renders_like_the_released_template(tok, case):
    """Without a generation prompt olmo3-think-release renders as the release does, empty calls and reasoning too."""
    messages, tools, _ = CASES[case]
    released = tok.apply_chat_template(messages, tools=tools, chat_template=RELEASED, tokenize=False)
    assert ct.render(messages, "olmo3-think-release", tools=tools, eos_token=tok.eos_token) == released


def test_empty_calls_print_and_reasoning_content_is_ignored_in_all_four(tok):
    for name in ct.TEMPLATES:
        for message in (EMPTY_LIST, EMPTY_STRING):
            assert ct.render([USER, message], name, eos_token=tok.eos_token).endswith(
                "x<function_calls></function_calls>" + tok.eos_token)
        text = ct.render([USER, REASONING], name, eos_token=tok.eos_token)
        assert "41F, say so." not in text and text.endswith("assistant\nIt is 41F." + tok.eos_token)


def test_reasoning_only_turn_is_a_counted_drop_under_instruct_release(tok):
    """Rendered without its reasoning the turn would be empty and train on eos alone: dropped, not trained."""
    only = {"role": "assistant", "content": None, "reasoning_content": "thinking"}
    empty = {"role": "assistant", "content": "", "reasoning_content": "thinking"}
    rows = [{"messages": [USER, only]}, {"messages": [USER, empty]}, {"messages": [USER, REASONING]}]
    ds, drops = ct.tokenize_sft(rows, tok, 512, chat_template="olmo3-instruct-release", cache_dir="")
    assert len(ds) == 1 and drops["reasoning_content_not_rendered"] == 2
    assert drops.warnings["reasoning_content_ignored"] == 1
    with pytest.raises(ct.DroppedRow, match="reasoning_content_not_rendered"):
        ct.tokenize_prompt(tok, [USER, only, USER], chat_template="olmo3-instruct-release")
    ds, drops = ct.tokenize_sft(rows, tok, 512, chat_template="olmo3-think-release", cache_dir="")
    assert len(ds) == 1 and drops["reasoning_content_not_rendered"] == 2  # the think templates too


@pytest.mark.parametrize("name", sorted(ct.TEMPLATES))
def test_handoff_option_closes_every_call_with_im_end(tok, name):
    """NAME-handoff (the Olmo 3.5 notes' convention): a tool call trains <|im_end|>, an answer eos. It renders as
    NAME everywhere but a conversation's final call, and such a conversation is a prefix of its continuation."""
    handoff = name + "-handoff"
    for case, (messages, tools, agp) in CASES.items():
        ends_in_call = messages[-1]["role"] == "assistant" and any(
            messages[-1].get(k) is not None for k in ("tool_calls", "function_calls"))
        ours = ct.render(messages, handoff, tools=tools, add_generation_prompt=agp, eos_token=tok.eos_token)
        base = ct.render(messages, name, tools=tools, add_generation_prompt=agp, eos_token=tok.eos_token)
        if not ends_in_call or agp:
            assert ours == base, case
            continue
        assert ours == base.removesuffix(tok.eos_token) + "<|im_end|>", case
        continued = ct.render(messages + [RESULT, ANSWER], handoff, tools=tools, eos_token=tok.eos_token)
        assert continued.startswith(ours + "\n<|im_start|>environment\n"), case
        out = ct.tokenize_messages(tok, messages, tools=tools, chat_template=handoff)
        trained = [i for i, label in zip(out["input_ids"], out["labels"]) if label != -100]
        assert tok.decode(trained).endswith("</function_calls><|im_end|>") and tok.eos_token_id not in trained
    out = ct.tokenize_messages(tok, [USER, CALL_ONLY, RESULT, ANSWER], tools=TOOLS, chat_template=handoff)
    assert out["input_ids"][-1] == out["labels"][-1] == tok.eos_token_id  # an answer still trains eos
