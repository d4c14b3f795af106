"""chat_template.py: exact Olmo 3 renders, trained-token labels (asserted token by token), the known
prefix-labeling bug, external-template checks, over-length strategies, malformed rows, the dataset
cache, and the CLI contract (list / render / show / export / diff)."""

import collections
import io
import json
import os
import subprocess
import sys

import datasets
import pytest
from transformers import AutoTokenizer

import chat_template as ct
from chat_template import DroppedRow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = "<|endoftext|>"
DEV_SYS = ("<|im_start|>system\nYou are a helpful function-calling AI assistant. You do not currently have access "
           "to any functions. <functions></functions><|im_end|>\n")
REL_SYS = ("<|im_start|>system\nYou are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, "
           "and your model weights are available at https://huggingface.co/allenai. You do not currently have access "
           "to any functions. <functions></functions><|im_end|>\n")
PREAMBLE = ("You are provided with function signatures within <functions></functions> XML tags. You may call one or "
            "more functions to assist with the user query. Output any function calls within "
            "<function_calls></function_calls> XML tags. Do not make assumptions about what values to plug "
            "into functions.")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
# transformers' tojson: json.dumps defaults (", " and ": "), no key sorting, non-ASCII kept.
TOOLS_JSON = ('[{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt", '
              '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]')
USER, ANSWER = ({"role": "user", "content": "What is 7+5?"},
                {"role": "assistant", "content": "<think>7+5=12</think>\n\\boxed{12}"})
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Boston", "days": [1, 2]}}},
    {"type": "function", "function": {"name": "now", "arguments": {}}}]}
TOOL_CONV = [{"role": "user", "content": "Weather?"}, CALL, {"role": "tool", "content": "41"},
             {"role": "environment", "content": "ok"}, {"role": "assistant", "content": "41F."}]


@pytest.fixture(scope="module")
def tok(toy_model_dir):
    return AutoTokenizer.from_pretrained(toy_model_dir)


def r(messages, template="olmo3-instruct-dev", tools=None, agp=False):
    return ct.render(messages, template, tools=tools, add_generation_prompt=agp)


def trained_spans(tok, out):
    """Decoded text of each run of consecutive trained tokens."""
    spans, cur = [], []
    for i, label in zip(out["input_ids"], out["labels"]):
        if label != -100:
            assert label == i
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur)), cur.clear()
    return spans + ([tok.decode(cur)] if cur else [])


def trained_tokens(tok, out):
    return [tok.decode([i]) for i, label in zip(out["input_ids"], out["labels"]) if label != -100]


def strip_blocks(template):
    return template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


# ---------------------------------------------------------------------------------------------
# Rendered text
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,system,gen", [
    ("olmo3-instruct-dev", DEV_SYS, ""), ("olmo3-instruct-release", REL_SYS, ""),
    ("olmo3-think-dev", DEV_SYS, "<think>"), ("olmo3-think-release", REL_SYS, "<think>")])
def test_single_multi_turn_and_generation_prompt(name, system, gen):
    assert r([USER, ANSWER], name) == (system + "<|im_start|>user\nWhat is 7+5?<|im_end|>\n<|im_start|>assistant\n"
                                       "<think>7+5=12</think>\n\\boxed{12}" + EOS)
    multi = [USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "Again?"},
             {"role": "assistant", "content": "12!"}]
    assert r(multi, name) == (system + "<|im_start|>user\nWhat is 7+5?<|im_end|>\n<|im_start|>assistant\n12<|im_end|>\n"
                              "<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n12!" + EOS)
    assert r([USER], name, agp=True) == (system + "<|im_start|>user\nWhat is 7+5?<|im_end|>\n"
                                         "<|im_start|>assistant\n" + gen)
    assert r([USER], name, agp=False) == system + "<|im_start|>user\nWhat is 7+5?<|im_end|>\n"


@pytest.mark.parametrize("name", list(ct.TEMPLATES))
def test_system_messages_and_tools(name):
    sys_msg = {"role": "system", "content": "Be brief."}
    assert r([sys_msg, USER], name) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                        "<|im_start|>user\nWhat is 7+5?<|im_end|>\n")
    fn = {"role": "system", "content": "Be brief.", "functions": '[{"name": "f"}]'}
    assert r([fn, USER], name).startswith(
        '<|im_start|>system\nBe brief. <functions>[{"name": "f"}]</functions><|im_end|>\n')
    # A user system message with tools: the JSON follows the content directly.
    assert r([sys_msg, USER], name, tools=TOOLS).startswith(
        f"<|im_start|>system\nBe brief.<functions>{TOOLS_JSON}</functions><|im_end|>\n<|im_start|>user\n")
    identity = ("You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, and your model "
                "weights are available at https://huggingface.co/allenai." if "release" in name
                else "You are a helpful function-calling AI assistant.")
    assert r([USER], name, tools=TOOLS).startswith(
        f"<|im_start|>system\n{identity} {PREAMBLE}<functions>{TOOLS_JSON}</functions><|im_end|>\n<|im_start|>user\n")
    assert r([USER], name, tools=[]) == r([USER], name)  # empty tools: the no-functions system turn


@pytest.mark.parametrize("name", list(ct.TEMPLATES))
def test_tool_calls_and_results(name):
    text = r(TOOL_CONV, name, tools=TOOLS)
    assert text.endswith(
        '<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<function_calls>get_weather(city="Boston", '
        'days=[1, 2])\nnow()</function_calls><|im_end|>\n<|im_start|>environment\n41<|im_end|>\n'
        "<|im_start|>environment\nok<|im_end|>\n<|im_start|>assistant\n41F." + EOS)
    # `function_calls` string field, rendered unchanged; content before it.
    fc = [USER, {"role": "assistant", "content": "Let me check.", "function_calls": 'f(x="1")'},
          {"role": "environment", "content": "1"}, {"role": "assistant", "content": "1"}]
    assert "<|im_start|>assistant\nLet me check.<function_calls>f(x=\"1\")</function_calls><|im_end|>\n" in r(fc, name)
    # Arguments as a JSON string (OpenAI format) and flat calls render like dict arguments.
    as_string = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Boston", "days": [1, 2]}'}},
        {"name": "now", "arguments": None}]}
    assert r([TOOL_CONV[0], as_string] + TOOL_CONV[2:], name, tools=TOOLS) == text
    # A final tool call ends with eos, as the released templates render it (tests/test_released_template.py).
    assert r(TOOL_CONV[:2], name).endswith("now()</function_calls>" + EOS)


@pytest.mark.parametrize("name", list(ct.TEMPLATES))
def test_reasoning_content(name):
    msg = {"role": "assistant", "reasoning_content": "7+5=12", "content": "\\boxed{12}"}
    # The released Instruct template never reads reasoning_content (tests/test_released_template.py), nor do
    # its dev / think variants (the notes: they differ only in the system and generation prompts).
    assert r([USER, msg], name).endswith("<|im_start|>assistant\n\\boxed{12}" + EOS)


@pytest.mark.parametrize("name", list(ct.TEMPLATES))
def test_prefix_property(name):
    """Rendering n messages is a prefix of rendering n+1 whenever message n is not an assistant turn
    (a final assistant turn, tool call or not, ends with eos)."""
    conv = [{"role": "system", "content": "S"}] + TOOL_CONV
    for n in range(1, len(conv)):
        if conv[n - 1]["role"] == "assistant":
            assert not r(conv[:n + 1], name, tools=TOOLS).startswith(r(conv[:n], name, tools=TOOLS))
            continue
        assert r(conv[:n + 1], name, tools=TOOLS).startswith(r(conv[:n], name, tools=TOOLS))


def test_templates_accept_transformers_and_named_sources(tmp_path, toy_model_dir):
    path = tmp_path / "t.jinja"
    path.write_text(ct.TEMPLATES["olmo3-think-dev"])
    assert ct.get_template(str(path)) == ct.TEMPLATES["olmo3-think-dev"]
    assert ct.get_template(toy_model_dir) == ct.TEMPLATES["olmo3-instruct-dev"]  # toy.py's tokenizer
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ 'x' }}"}))
    assert ct.get_template(str(config)) == "{{ 'x' }}"
    assert ct.get_template(str(tmp_path)) == "{{ 'x' }}"  # a directory with only the config field
    (tmp_path / "chat_template.jinja").write_text("{{ 'y' }}")
    assert ct.get_template(str(tmp_path)) == "{{ 'y' }}"  # the .jinja file wins, as in transformers
    with pytest.raises(ValueError):
        ct.get_template("no-such-template")


# ---------------------------------------------------------------------------------------------
# Labels, asserted token by token
# ---------------------------------------------------------------------------------------------
def test_single_turn_labels_exact(tok):
    out = ct.tokenize_messages(tok, [USER, ANSWER])
    assert trained_tokens(tok, out) == ["<think>", "7", "+", "5", "=", "1", "2", "</think>", "\n", "\\", "boxed",
                                        "{", "1", "2", "}", EOS]
    assert len(out["input_ids"]) == len(out["labels"])
    assert tok.decode(out["input_ids"]) == r([USER, ANSWER])


@pytest.mark.parametrize("name", list(ct.TEMPLATES))
def test_multi_turn_tool_labels_exact(tok, name):
    out = ct.tokenize_messages(tok, TOOL_CONV, tools=TOOLS, chat_template=name)
    # Tool call turn trains its hand-off <|im_end|>; the answer trains eos; headers, tool results and
    # the `\n` between turns do not train.
    assert trained_spans(tok, out) == [
        '<function_calls>get_weather(city="Boston", days=[1, 2])\nnow()</function_calls><|im_end|>', "41F." + EOS]
    last = ct.tokenize_messages(tok, TOOL_CONV, tools=TOOLS, chat_template=name, only_last_turn=True)
    assert last["input_ids"] == out["input_ids"] and trained_spans(tok, last) == ["41F." + EOS]
    # Final tool call (e.g. a preference pair over calls): ends with eos, trained, as released.
    call = ct.tokenize_messages(tok, TOOL_CONV[:2], chat_template=name)
    assert trained_tokens(tok, call)[-1] == EOS and call["labels"][-1] == tok.eos_token_id


def test_mask_matches_transformers_assistant_mask(tok):
    """Our generation-range labels equal transformers' return_assistant_tokens_mask on every example."""
    for name in ct.TEMPLATES:
        for example in ct.EXAMPLES.values():
            msgs = example["messages"]
            if msgs[-1]["role"] != "assistant":
                continue
            ours = ct.tokenize_messages(tok, msgs, tools=example.get("tools"), chat_template=name)
            theirs = tok.apply_chat_template(msgs, tools=example.get("tools"), chat_template=ct.TEMPLATES[name],
                                             tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            assert ours["input_ids"] == list(theirs["input_ids"])
            assert [int(label != -100) for label in ours["labels"]] == list(theirs["assistant_masks"])


def test_known_bug_prefix_labeling_masks_think_generation_ranges_train_it(tok):
    """Seed 002: the think template's generation prompt adds `<think>`; prefix labeling masks it."""
    think = ct.TEMPLATES["olmo3-think-dev"]
    prefix = ct.tokenize_messages(tok, [USER, ANSWER], chat_template=strip_blocks(think))  # a Hub-style template
    assert trained_tokens(tok, prefix)[:2] == ["7", "+"]  # the opening <think> is masked: the bug
    assert "<think>" not in trained_tokens(tok, prefix)
    blocks = ct.tokenize_messages(tok, [USER, ANSWER], chat_template=think)
    assert trained_tokens(tok, blocks)[:2] == ["<think>", "7"]  # generation ranges train it
    mask = tok.apply_chat_template([USER, ANSWER], chat_template=think, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)["assistant_masks"]
    assert [t for t, m in zip(blocks["input_ids"], mask) if m][0] == tok.convert_tokens_to_ids("<think>")
    # Without a think generation prompt, prefix labeling trains it (why 3.2+ tokenizes with instruct-dev).
    plain = ct.tokenize_messages(tok, [USER, ANSWER], chat_template=strip_blocks(ct.TEMPLATES["olmo3-instruct-dev"]))
    assert trained_tokens(tok, plain) == trained_tokens(tok, blocks)


def test_prefix_labeling_trains_only_final_turn_and_checks_prefix(tok):
    plain = strip_blocks(ct.TEMPLATES["olmo3-instruct-dev"])
    out = ct.tokenize_messages(tok, TOOL_CONV, tools=TOOLS, chat_template=plain)
    assert trained_spans(tok, out) == ["41F." + EOS]
    think = strip_blocks(ct.TEMPLATES["olmo3-think-dev"])  # generation prompt `<think>` but the answer has none
    with pytest.raises(DroppedRow, match="prompt_not_prefix"):
        ct.tokenize_messages(tok, [USER, {"role": "assistant", "content": "12"}], chat_template=think)


# A Hub-style ChatML template without generation blocks (SmolLM2's and Qwen2.5's shape): every turn ends with
# '<|im_end|>\n'; with `drop_reasoning` earlier assistant turns lose their <think> part (Qwen3's shape), so a
# turn renders differently once later messages follow it.
def chatml(drop_reasoning=False):
    content = ("m['content'].split('</think>')[-1] if (not loop.last and '</think>' in m['content']) "
               "else m['content']") if drop_reasoning else "m['content']"
    return ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + (" + content + ") + '<|im_end|>\\n' -}}"
            "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_prefix_labeling_trains_each_turn_through_im_end_not_the_newline(tok):
    """Without generation blocks, each assistant turn trains its content and its closing <|im_end|>: not the
    header, not the separator newline after <|im_end|> (the model stops at the terminator; the newline is never
    generated). Earlier turns train too where the renders are stable; where a later message changes how a turn
    renders (reasoning dropped from earlier turns), only the final turn trains and the row is counted."""
    conv = [USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "x"},
            {"role": "assistant", "content": "13"}]
    warnings = collections.Counter()
    out = ct.tokenize_messages(tok, conv[:2], chat_template=chatml(), warnings=warnings)
    assert trained_spans(tok, out) == ["12<|im_end|>"] and not warnings
    out = ct.tokenize_messages(tok, conv, chat_template=chatml(), warnings=warnings)
    assert trained_spans(tok, out) == ["12<|im_end|>", "13<|im_end|>"] and not warnings
    out = ct.tokenize_messages(tok, conv, chat_template=chatml(), only_last_turn=True)
    assert trained_spans(tok, out) == ["13<|im_end|>"]
    thinking = [USER, {"role": "assistant", "content": "<think>7+5</think>12"}] + conv[2:]
    out = ct.tokenize_messages(tok, thinking, chat_template=chatml(drop_reasoning=True), warnings=warnings)
    assert trained_spans(tok, out) == ["13<|im_end|>"] and warnings["prefix_labeling_last_turn_only"] == 1


def test_token_straddling_block_start_is_not_trained(tok):
    template = ("{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{- m['content'] + '\\n' -}}{%- else -%}"
                "{{- 'box' -}}{%- generation -%}{{- 'ed{' + m['content'] + '}' + eos_token -}}{%- endgeneration -%}"
                "{%- endif -%}{%- endfor -%}")
    out = ct.tokenize_messages(tok, [USER, {"role": "assistant", "content": "1"}], chat_template=template)
    assert trained_tokens(tok, out) == ["{", "1", "}", EOS]  # "boxed" starts before the block: prompt side
    mask = tok.apply_chat_template([USER, {"role": "assistant", "content": "1"}], chat_template=template, tokenize=True,
                                   return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
    assert [tok.decode([t]) for t, m in zip(out["input_ids"], mask) if m][0] == "boxed"  # transformers trains it


def test_trimmed_offsets_give_the_same_labels(tok, toy_model_dir):
    """A ByteLevel post-processor with trim_offsets (GPT-2 style tokenizers) must not shift labels."""
    from tokenizers import processors
    trimmed = AutoTokenizer.from_pretrained(toy_model_dir)
    trimmed.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    conv = [USER, {"role": "assistant", "content": " It is  12 .\n\n"}, {"role": "user", "content": " ok "},
            {"role": "assistant", "content": "  yes"}]
    assert ct.tokenize_messages(trimmed, conv) == ct.tokenize_messages(tok, conv)
    assert trained_spans(tok, ct.tokenize_messages(trimmed, conv)) == [" It is  12 .\n\n<|im_end|>", "  yes" + EOS]
    # A header ending in a space: the trimmed " is" token must still count as starting before the block.
    spaced = ("{%- for m in messages -%}{{- m['role'] + ' ' -}}{%- if m['role'] == 'assistant' -%}{%- generation -%}"
              "{{- m['content'] + eos_token -}}{%- endgeneration -%}{%- else -%}{{- m['content'] + '\\n' -}}"
              "{%- endif -%}"
              "{%- endfor -%}")
    conv = [USER, {"role": "assistant", "content": "is 12"}]
    assert trained_tokens(tok, ct.tokenize_messages(tok, conv, chat_template=spaced)) == [" ", "1", "2", EOS]
    assert (ct.tokenize_messages(trimmed, conv, chat_template=spaced)
            == ct.tokenize_messages(tok, conv, chat_template=spaced))


# External (annotated) templates: the seed's checks.
EXT_HEAD = "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{- '<|im_start|>user\\n' + m['content'] -}}"


def ext(user_end, assistant):
    return EXT_HEAD + user_end + "{%- else -%}" + assistant + "{%- endif -%}{%- endfor -%}"


GOOD_USER_END = "{{- '<|im_end|>\\n' -}}"
GOOD_ASSISTANT = ("{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- m['content'] -}}"
                  "{{- eos_token if loop.last else '<|im_end|>' -}}{%- endgeneration -%}"
                  "{{- '' if loop.last else '\\n' -}}")
CONV = [USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "x"},
        {"role": "assistant", "content": "13"}]


def test_external_template_last_turn_labeling(tok):
    out = ct.tokenize_messages(tok, CONV, chat_template=ext(GOOD_USER_END, GOOD_ASSISTANT), only_last_turn=True)
    assert trained_spans(tok, out) == ["13" + EOS]
    # Several blocks per assistant message are supported (ownership by position, not by counting).
    two = GOOD_ASSISTANT.replace("{{- m['content'] -}}",
                                 "{{- m['content'] -}}{%- endgeneration -%}{{- '|' -}}{%- generation -%}")
    out = ct.tokenize_messages(tok, CONV, chat_template=ext(GOOD_USER_END, two), only_last_turn=True)
    assert trained_spans(tok, out) == ["13", EOS]


def test_external_template_checks_drop_or_warn(tok):
    # Closing eos left just outside the block.
    outside = ("{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- m['content'] -}}{%- endgeneration -%}"
               "{{- eos_token if loop.last else '<|im_end|>\\n' -}}")
    with pytest.raises(DroppedRow, match="closing_token_outside_block"):
        ct.tokenize_messages(tok, CONV, chat_template=ext(GOOD_USER_END, outside), only_last_turn=True)
    with pytest.raises(DroppedRow, match="closing_token_outside_block"):
        ct.tokenize_messages(tok, CONV, chat_template=ext(GOOD_USER_END, outside))
    # The user's <|im_end|> is emitted inside the next assistant block: a block straddles the boundary.
    straddle_user = "{{- '<|im_end|>\\n' if loop.last else '' -}}"
    straddle = ("{%- generation -%}{{- '<|im_end|>\\n<|im_start|>assistant\\n' + m['content'] -}}"
                "{{- eos_token if loop.last else '<|im_end|>' -}}{%- endgeneration -%}"
                "{{- '' if loop.last else '\\n' -}}")
    with pytest.raises(DroppedRow, match="ambiguous_block_ownership"):
        ct.tokenize_messages(tok, CONV, chat_template=ext(straddle_user, straddle), only_last_turn=True)
    # Turn endings that change when a message is appended.
    unstable_user = "{{- '<|im_end|>' + ('\\n' if loop.last else '') -}}"
    with pytest.raises(DroppedRow, match="unstable_render"):
        ct.tokenize_messages(tok, CONV, chat_template=ext(unstable_user, GOOD_ASSISTANT), only_last_turn=True)
    # Another special token right after a block: a warning, the row is kept.
    no_newline = GOOD_ASSISTANT.replace("'' if loop.last else '\\n'", "''")
    warnings = collections.Counter()
    out = ct.tokenize_messages(tok, CONV, chat_template=ext(GOOD_USER_END, no_newline), warnings=warnings)
    assert warnings["special_token_after_block:<|im_start|>"] == 1
    assert trained_spans(tok, out) == ["12<|im_end|>", "13" + EOS]


def test_external_template_review_aids_warn_in_both_modes_and_name_rows(tok, caplog):
    """A block covering the assistant header, and tool calls rendered outside a content-only block: warned in
    SFT and last-turn labeling alike, logged once, and the tokenize summary names the first rows of each
    warning and drop reason."""
    header_in_block = ("{%- generation -%}{{- '<|im_start|>assistant\\n' + m['content'] -}}"
                       "{{- eos_token if loop.last else '<|im_end|>' -}}{%- endgeneration -%}"
                       "{{- '' if loop.last else '\\n' -}}")
    covers = ext(GOOD_USER_END, header_in_block)
    for last_turn, count in ((False, 2), (True, 1)):
        warnings = collections.Counter()
        ct.tokenize_messages(tok, CONV, chat_template=covers, only_last_turn=last_turn, warnings=warnings)
        assert warnings == {"block_covers_header": count}
    calls_outside = ("{{- '<|im_start|>assistant\\n' -}}{%- for c in m.get('tool_calls') or [] -%}"
                     "{{- c['function']['name'] + '()' -}}{%- endfor -%}{%- generation -%}{{- m['content'] or '' -}}"
                     "{{- eos_token if loop.last else '<|im_end|>' -}}{%- endgeneration -%}"
                     "{{- '' if loop.last else '\\n' -}}")
    call = {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "lookup", "arguments": {}}}]}
    for last_turn in (False, True):
        warnings = collections.Counter()
        ct.tokenize_messages(tok, [USER, call], chat_template=ext(GOOD_USER_END, calls_outside),
                             only_last_turn=last_turn, warnings=warnings)
        assert warnings == {"tool_calls_outside_block": 1}
    warnings = collections.Counter()
    ct.tokenize_messages(tok, CONV, chat_template=ext(GOOD_USER_END, GOOD_ASSISTANT), warnings=warnings)
    assert not warnings  # a good template: nothing to say
    ct._LOGGED.clear()
    caplog.clear()
    rows = [{"messages": CONV}, {"messages": [USER]}, {"messages": CONV}, {"messages": CONV}]
    ds, drops = ct.tokenize_sft(rows, tok, 512, chat_template=covers, cache_dir="")
    err = caplog.text
    assert len(ds) == 3 and drops.warnings == {"block_covers_header": 6}
    assert err.count("starts where an assistant message starts") == 1  # logged once, not once per row
    assert "dropped 1 of 4 rows: no_final_assistant: 1 (row 1)" in err
    assert "warnings: block_covers_header: 6 (rows 0, 2, 3)" in err


def test_external_template_errors_drop_the_row(tok):
    strict = ("{%- if messages[0]['role'] != 'system' -%}{{- raise_exception('needs a system message') -}}"
              "{%- endif -%}" + ext(GOOD_USER_END, GOOD_ASSISTANT))
    with pytest.raises(DroppedRow, match="render_error"):
        ct.tokenize_messages(tok, CONV, chat_template=strict)
    with pytest.raises(DroppedRow, match="render_error"):
        ct.tokenize_prompt(tok, CONV[:1], chat_template=strict)
    ds, drops = ct.tokenize_sft([{"messages": CONV}], tok, 512, chat_template=strict, cache_dir="")
    assert len(ds) == 0 and drops == {"render_error": 1}


# ---------------------------------------------------------------------------------------------
# Over-length strategies
# ---------------------------------------------------------------------------------------------
def test_over_length_drop_terminate_truncate(tok):
    full = ct.tokenize_messages(tok, [USER, ANSWER])
    n = len(full["input_ids"])
    assert ct.tokenize_messages(tok, [USER, ANSWER], max_length=n) == full
    with pytest.raises(DroppedRow, match="over_length"):
        ct.tokenize_messages(tok, [USER, ANSWER], max_length=n - 1)
    term = ct.tokenize_messages(tok, [USER, ANSWER], max_length=10, over_length_strategy="terminate")
    assert term["input_ids"] == full["input_ids"][-10:] and term["labels"] == full["labels"][-10:]  # intact tail
    assert tok.decode(term["input_ids"][-1:]) == EOS
    # A tail that ends in a trained <|im_end|> keeps it (never overwritten with eos).
    handoff = ("{%- for m in messages -%}{%- generation -%}{{- m['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
               "{%- endfor -%}")
    call = ct.tokenize_messages(tok, [{"role": "assistant", "content": "12345"}], chat_template=handoff, max_length=3,
                                over_length_strategy="terminate")
    assert tok.decode(call["input_ids"][-1:]) == "<|im_end|>" and call["labels"][-1] != -100
    # A tail without a terminator (an external template that ends without one) gets eos.
    bare = "{%- for m in messages -%}{%- generation -%}{{- m['content'] -}}{%- endgeneration -%}{%- endfor -%}"
    out = ct.tokenize_messages(tok, [{"role": "assistant", "content": "12345"}], chat_template=bare, max_length=3,
                               over_length_strategy="terminate")
    assert [tok.decode([i]) for i in out["input_ids"]] == ["3", "4", EOS] and out["labels"][-1] == tok.eos_token_id
    with pytest.raises(DroppedRow, match="over_length"):  # no trained token left in the tail
        ct.tokenize_messages(tok, [{"role": "assistant", "content": "12"}], chat_template=bare + "{{- ' tail text' -}}",
                             max_length=2, over_length_strategy="terminate")
    for bad in ({"max_length": 0, "over_length_strategy": "terminate"},
                {"max_length": 5, "over_length_strategy": "cut"}):
        with pytest.raises(ValueError):
            ct.tokenize_messages(tok, [USER, ANSWER], **bad)
        with pytest.raises(ValueError):  # a bad setting is not a per-row drop
            ct.tokenize_sft([{"messages": [USER, ANSWER]}], tok, cache_dir="", **bad)
    right = ct.tokenize_messages(tok, [USER, ANSWER], max_length=10, over_length_strategy="truncate")
    assert right["input_ids"] == full["input_ids"][:10]


# ---------------------------------------------------------------------------------------------
# Malformed rows
# ---------------------------------------------------------------------------------------------
HOSTILE = [None, [], "hi", 5, [None], [["user", "hi"]], [{"content": "hi"}], [{"role": 3, "content": "x"}],
           [{"role": ["user"], "content": "x"}], [{"role": "wizard", "content": "x"}],
           [{"role": "user", "content": 3}, ANSWER], [{"role": "user", "content": ["a"]}, ANSWER],
           [{"role": "user", "content": {"text": "a"}}, ANSWER], [{"role": "user"}, ANSWER],
           [{"role": "user", "content": None}, ANSWER], [USER], [USER, {"role": "assistant", "content": None}],
           [USER, {"role": "assistant", "content": None, "tool_calls": "f()"}],
           [USER, {"role": "assistant", "content": None,
                   "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
           [USER, {"role": "assistant", "content": None,
                   "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
           [USER, {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": {}}}]}],
           [USER, {"role": "assistant", "content": None, "tool_calls": [5]}],
           [USER, {"role": "assistant", "content": "x", "reasoning_content": 5}],
           [{"role": "system", "content": "s", "functions": ["f"]}, USER, ANSWER]]


@pytest.mark.parametrize("messages", HOSTILE)
def test_hostile_messages_raise_only_dropped_row(tok, messages):
    with pytest.raises(DroppedRow):
        ct.tokenize_messages(tok, messages)


def test_bad_tools_dropped(tok):
    for tools in ("not json", 5, ["x"]):
        with pytest.raises(DroppedRow, match="bad_tools"):
            ct.tokenize_messages(tok, [USER, ANSWER], tools=tools)


def test_mixed_dataset_counts_reasons(tok, tmp_path):
    good = {"messages": [USER, ANSWER]}
    rows = [good, {"messages": []}, {"messages": None}, {"messages": [{"role": "wizard", "content": "x"}, ANSWER]},
            {"messages": [{"role": None, "content": "x"}, ANSWER]}, {"messages": [USER]},
            {"messages": [{"role": "user", "content": None}, ANSWER]}, good]
    ds, drops = ct.tokenize_sft(datasets.Dataset.from_list(rows), tok, 512, cache_dir=str(tmp_path))
    assert len(ds) == 2 and drops == {"empty_conversation": 2, "bad_role": 2, "no_final_assistant": 1,
                                      "missing_content": 1}
    assert drops.total == 8 and drops.kept == 2
    # Python rows Arrow could not hold (mixed types) go through the same counting.
    py_rows = [good, None, {"messages": "x"}, {"messages": [{"role": "user", "content": 3}, ANSWER]}, {"nothing": 1}]
    ds, drops = ct.tokenize_sft(py_rows, tok, 512, cache_dir="")
    assert len(ds) == 1 and drops == {"bad_row": 1, "empty_conversation": 1, "bad_messages": 1, "non_string_content": 1}
    assert ds[0] == ct.tokenize_messages(tok, [USER, ANSWER])


# ---------------------------------------------------------------------------------------------
# Dataset helpers and cache
# ---------------------------------------------------------------------------------------------
def test_tokenize_sft_cache_hit_and_keying(tok, toy_data_dir, tmp_path, monkeypatch):
    data = ct.load_mixture([os.path.join(toy_data_dir, "sft.jsonl"), "100"])
    monkeypatch.setenv("OLMO3_POSTTRAIN_CACHE", str(tmp_path / "cache"))
    first, drops = ct.tokenize_sft(data, tok, 512)
    assert not drops.cache_hit and drops.cache_path.startswith(str(tmp_path / "cache"))
    second, drops2 = ct.tokenize_sft(data, tok, 512)
    assert drops2.cache_hit and drops2.cache_path == drops.cache_path
    assert second["input_ids"] == first["input_ids"] and second["labels"] == first["labels"]
    assert first[0] == ct.tokenize_messages(tok, data[0]["messages"])
    # Keyed by template, settings and data.
    assert not ct.tokenize_sft(data, tok, 512, chat_template="olmo3-think-dev")[1].cache_hit
    assert not ct.tokenize_sft(data, tok, 256)[1].cache_hit
    assert not ct.tokenize_sft(data.select(range(50)), tok, 512)[1].cache_hit


def test_tokenize_preference_and_rlvr(tok, toy_data_dir, tmp_path):
    pref = ct.load_mixture([os.path.join(toy_data_dir, "preference.jsonl"), "20"])
    ds, drops = ct.tokenize_preference(pref, tok, 512, cache_dir=str(tmp_path))
    assert len(ds) == 20 and not drops
    row = ds[0]
    assert trained_tokens(tok, {"input_ids": row["chosen_input_ids"], "labels": row["chosen_labels"]})[0] == "<think>"
    assert tok.decode(row["rejected_labels"][-1:]) == EOS
    trl = [{"prompt": [USER], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "13"}]}]
    ds, drops = ct.tokenize_preference(trl, tok, 512, cache_dir="")
    assert not drops and ds[0]["chosen_input_ids"] == ct.tokenize_messages(tok, [USER, ANSWER])["input_ids"]
    assert trained_spans(tok, {"input_ids": ds[0]["rejected_input_ids"],
                               "labels": ds[0]["rejected_labels"]}) == ["13" + EOS]
    rl = ct.load_mixture([os.path.join(toy_data_dir, "rlvr.jsonl"), "20"])
    rows = [dict(rl[0]), dict(rl[1], ground_truth=None), dict(rl[2], messages=rl[2]["messages"] + [ANSWER])]
    ds, drops = ct.tokenize_rlvr(rows, tok, 512, cache_dir="")
    assert drops == {"missing_ground_truth": 1} and len(ds) == 2
    assert ds[0]["prompt_input_ids"] == ct.tokenize_prompt(tok, rl[0]["messages"])
    assert tok.decode(ds[0]["prompt_input_ids"]).endswith("<|im_start|>assistant\n")
    assert ds[1]["prompt_input_ids"] == ct.tokenize_prompt(tok, rl[2]["messages"])  # trailing answer removed
    assert ds[0]["ground_truth"] == rl[0]["ground_truth"] and ds[0]["verifier"] == "math"
    n = len(ds[0]["prompt_input_ids"])
    assert ct.tokenize_rlvr(rows[:1], tok, n - 1, cache_dir="")[1] == {"over_length": 1}
    trunc, _ = ct.tokenize_rlvr(rows[:1], tok, n - 1, over_length_strategy="truncate", cache_dir="")
    assert trunc[0]["prompt_input_ids"] == ds[0]["prompt_input_ids"][:n - 1]
    think = ct.tokenize_rlvr(rows[:1], tok, 512, chat_template="olmo3-think-dev", cache_dir="")[0]
    assert tok.decode(think[0]["prompt_input_ids"]).endswith("<|im_start|>assistant\n<think>")


def test_load_mixture_keeps_labels_exactly_as_written(tmp_path, toy_model_dir):
    """One file that mixes string and list labels: `datasets` types such a column as JSON and decoded
    every string in it, so "[1, 2]" became a list, "1e3" 1000.0 and "007" 7. Strings stay as written;
    a list becomes its JSON text, which verifiers.py reads like the list. Rows keep their file line."""
    labels = ["[1, 2]", "1e3", ["x", "y"], "007", 42, "plain", "{\"a\": 1}"]
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "ground_truth": g, "verifier": "math"})
             for i, g in enumerate(labels)]
    for name, text in (("mixed.jsonl", "\n".join(lines) + "\n"), ("blank.jsonl", "\n\n".join(lines) + "\n")):
        (tmp_path / name).write_text(text)
        mix = ct.load_mixture([str(tmp_path / name), "1.0"])
        got = {r["messages"][0]["content"]: (r["ground_truth"], r["source_line"]) for r in mix}
        step = 1 if name == "mixed.jsonl" else 2  # blank lines between the rows
        for i, g in enumerate(labels):
            want = g if isinstance(g, str) else json.dumps(g)
            assert got[f"q{i}"] == (want, 1 + i * step), (name, i, got[f"q{i}"])
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    ds, _ = ct.tokenize_rlvr(ct.load_mixture([str(path), "1.0"]), tok, 512, cache_dir="")
    assert sorted(ds["ground_truth"]) == sorted(g if isinstance(g, str) else json.dumps(g) for g in labels)
    import verifiers  # the JSON text of a list label scores like the list itself
    assert verifiers.verify("math", "\\boxed{y}", json.dumps(["x", "y"])).score == \
        verifiers.verify("math", "\\boxed{y}", ["x", "y"]).score == 1.0
    # a file with only string labels (Dolci, the toy data) is read as before
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}], "ground_truth": "[3]"}) + "\n")
    assert ct.load_mixture([str(plain), "1.0"])[0]["ground_truth"] == "[3]"
    # a malformed row is reported with its file and line
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n" + lines[1][:-1] + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        ct.load_mixture([str(tmp_path / "bad.jsonl"), "1.0"])


def test_load_mixture_fractions_counts_formats(tmp_path):
    rows = [{"messages": [{"role": "user", "content": str(i)}], "k": i} for i in range(10)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    parquet = str(tmp_path / "b.parquet")
    datasets.Dataset.from_list(rows).to_parquet(parquet)
    mix = ct.load_mixture([str(jsonl), "0.5", parquet, "3"], seed=1)
    assert len(mix) == 8 and collections.Counter(mix["source"]) == {str(jsonl): 5, parquet: 3}
    up = ct.load_mixture([str(jsonl), "2.0"])  # a fraction above 1 upsamples
    assert len(up) == 20 and collections.Counter(up["k"]) == {i: 2 for i in range(10)}
    assert len(ct.load_mixture([str(jsonl), "25"])) == 25
    assert ct.load_mixture([str(jsonl), "0.5"], seed=3)["k"] == ct.load_mixture([str(jsonl), "0.5"], seed=3)["k"]
    with pytest.raises(ValueError):
        ct.load_mixture([str(jsonl)])
    assert len(ct.load_mixture([str(jsonl), "32000"])) == 32000  # one index list, not 3,200 copies to concatenate


def _rows_file(path, rows, text=None):
    path.write_bytes(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows).encode())
    return str(path)


def test_one_bad_row_does_not_spoil_its_file(tmp_path, toy_model_dir):
    """A null or a string in a column of message lists made the column mixed, then every row's list became
    JSON text that tokenization did not read: 6 of 6 rows dropped (or, as the only column, a crash)."""
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    good = {"messages": [USER, ANSWER]}
    for bad in (None, "oops"):
        path = _rows_file(tmp_path / f"sft_{bad}.jsonl", [good] * 5 + [{"messages": bad}])
        ds, drops = ct.tokenize_sft(ct.load_mixture([path, "1.0"]), tok, 512, cache_dir="")
        assert len(ds) == 5 and drops.total == 6 and sum(drops.values()) == 1, dict(drops)
    pairs = [{"chosen": [USER, ANSWER], "rejected": [USER, {"role": "assistant", "content": "no"}]}] * 3
    path = _rows_file(tmp_path / "pref.jsonl", pairs + [dict(pairs[0], rejected=None)])
    ds, drops = ct.tokenize_preference(ct.load_mixture([path, "1.0"]), tok, 512, cache_dir="")
    assert len(ds) == 3 and sum(drops.values()) == 1


def test_preference_pairs_answer_one_prompt(tmp_path, toy_model_dir):
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    other_user = {"role": "user", "content": "something else"}
    rows = [{"chosen": [USER, ANSWER], "rejected": [other_user, ANSWER]},  # two prompts: not a pair
            {"prompt": "What is 1+1?", "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "3"}]},
            {"chosen": [ANSWER], "rejected": [ANSWER]}]  # answers only, no prompt
    ds, drops = ct.tokenize_preference(rows, tok, 512, cache_dir="")
    assert len(ds) == 1 and drops == {"prompt_mismatch": 1, "missing_prompt": 1}
    assert "What is 1+1?" in tok.decode(ds[0]["chosen_input_ids"])  # TRL's plain-text prompt is a user turn


def test_load_mixture_names_the_file_and_line_of_bad_data(tmp_path):
    row = json.dumps({"messages": [USER], "ground_truth": "2"})
    cases = {
        "latin1.jsonl": ((row + "\n" + row + "\n").encode() + b'{"x": "caf\xe9"}\n', r"latin1\.jsonl:3: not UTF-8"),
        "surrogate.jsonl": ((row + "\n" + '{"x": "\\ud800"}' + "\n").encode(), r"surrogate\.jsonl:2: .*surrogate"),
        "items.json": (b'[{"x": 1}, "junk"]', r"items\.json: item 2 of the JSON list must be an object"),
    }
    for name, (data, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            ct.load_mixture([_rows_file(tmp_path / name, None, data), "1.0"])
    good = _rows_file(tmp_path / "good.jsonl", [{"k": 1}, {"k": 2}])
    for amount in ("nan", "inf", "abc", "-1"):
        with pytest.raises(ValueError, match=r"good\.jsonl: amount"):
            ct.load_mixture([good, amount])
    with pytest.raises(FileNotFoundError, match="no such data file"):  # at once, not after asking the Hub
        ct.load_mixture(["data/nope.jsonl", "1.0"])


def test_load_mixture_leaves_out_sources_with_no_rows_and_mixes_types(tmp_path):
    two = _rows_file(tmp_path / "two.jsonl", [{"k": 1, "ground_truth": "2"}, {"k": 2, "ground_truth": "3"}])
    empty = _rows_file(tmp_path / "empty.jsonl", None, b"\n  \n")
    for mixer in ([two, "0"], [two, "0.1"], [empty, "1.0"]):  # crashed in Arrow, or gave 0 rows quietly
        with pytest.raises(ValueError, match="has no rows"):
            ct.load_mixture(mixer)
    mix = ct.load_mixture([two, "1.0", empty, "1.0", two, "0.1"])
    assert len(mix) == 2 and set(mix["source"]) == {two}
    # "2" in one file, 2 in another: a column the sources disagree on is JSON text (crashed in Arrow)
    ints = _rows_file(tmp_path / "ints.jsonl", [{"k": 3, "ground_truth": 4}])
    mix = ct.load_mixture([two, "1.0", ints, "1.0"])
    assert sorted(mix["ground_truth"]) == ["2", "3", "4"]


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def run_main(argv, capsys):
    code = ct.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def test_cli_list_and_render_exact(tmp_path):
    msgs = write(tmp_path / "m.json", TOOL_CONV)
    tools = write(tmp_path / "t.json", TOOLS)
    out = subprocess.run([sys.executable, os.path.join(REPO, "chat_template.py"), "render", "--template",
                          "olmo3-think-release", "--messages", msgs, "--tools", tools, "--add-generation-prompt"],
                         capture_output=True, check=True)
    assert out.stdout.decode() == r(TOOL_CONV, "olmo3-think-release", tools=TOOLS, agp=True)  # no added newline
    assert out.stdout.decode().endswith("<|im_start|>assistant\n<think>")
    listed = subprocess.run([sys.executable, os.path.join(REPO, "chat_template.py"), "list"], capture_output=True)
    assert listed.returncode == 0 and listed.stdout.decode().split() == list(ct.ALL_TEMPLATES)


def test_cli_render_sources_and_bad_input(tmp_path, toy_model_dir, capsys):
    msgs = write(tmp_path / "m.json", {"messages": [USER, ANSWER]})
    code, out, _ = run_main(["render", "--template", toy_model_dir, "--messages", msgs], capsys)
    assert code == 0 and out == r([USER, ANSWER])
    jinja = tmp_path / "x.jinja"
    jinja.write_text(ct.TEMPLATES["olmo3-instruct-release"])
    assert (run_main(["render", "--template", str(jinja), "--messages", msgs], capsys)[1]
            == r([USER, ANSWER], "olmo3-instruct-release"))
    (tmp_path / "bad.json").write_text("{nope")
    for i, bad in enumerate(([], {"messages": "x"}, 5, [5], [{"role": "user"}],
                             {"messages": [USER], "tools": {"a": 1}})):
        path = write(tmp_path / f"bad{i}.json", bad)
        assert run_main(["render", "--template", "olmo3-instruct-dev", "--messages", path], capsys)[0] == 2, bad
    for argv in (["render", "--template", "nope", "--messages", msgs],
                 ["render", "--template", "olmo3-instruct-dev", "--messages", str(tmp_path / "missing.json")],
                 ["render", "--template", "olmo3-instruct-dev", "--messages", str(tmp_path / "bad.json")],
                 ["render"], ["frobnicate"]):
        assert run_main(argv, capsys)[0] == 2


def test_cli_show_brackets_trained_tokens(tmp_path, toy_model_dir, capsys):
    msgs = write(tmp_path / "m.json", [USER, {"role": "assistant", "content": "12"}])
    code, out, _ = run_main(["show", "--template", "olmo3-think-dev", "--tokenizer", toy_model_dir, "--messages", msgs,
                             "--color", "never"], capsys)
    assert code == 0
    assert "<|im_start|>assistant\n[1][2][<|endoftext|>]\n" in out and "-- messages:" in out and "3 trained" in out
    code, out, _ = run_main(["show", "--template", "olmo3-think-dev", "--tokenizer", toy_model_dir, "--messages", msgs,
                             "--color", "always"], capsys)
    assert "\x1b[" in out
    bad = write(tmp_path / "b.json", [USER])
    assert run_main(["show", "--template", "olmo3-think-dev", "--tokenizer", toy_model_dir, "--messages", bad],
                    capsys)[0] == 2


def test_cli_export_writes_both_in_sync(tmp_path, toy_model_dir, capsys):
    out_dir = str(tmp_path / "exp")
    code, _, _ = run_main(["export", "olmo3-think-release", "--tokenizer", toy_model_dir, "--out", out_dir], capsys)
    assert code == 0
    with open(os.path.join(out_dir, "chat_template.jinja")) as f:
        assert f.read() == ct.TEMPLATES["olmo3-think-release"]
    with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == ct.TEMPLATES["olmo3-think-release"]
    loaded = AutoTokenizer.from_pretrained(out_dir)
    assert loaded.chat_template == ct.TEMPLATES["olmo3-think-release"]
    assert loaded.get_vocab() == AutoTokenizer.from_pretrained(toy_model_dir).get_vocab()
    assert run_main(["diff", toy_model_dir, out_dir], capsys)[0] == 1
    assert run_main(["export", "nope", "--tokenizer", toy_model_dir, "--out", out_dir], capsys)[0] == 2


@pytest.fixture(scope="module")
def exported(toy_model_dir, tmp_path_factory):
    base = str(tmp_path_factory.mktemp("diff_base"))
    ct.export_template("olmo3-instruct-dev", toy_model_dir, base)
    return base


def copy_dir(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(path, fn):
    p = os.path.join(path, "tokenizer_config.json")
    with open(p) as f:
        config = json.load(f)
    fn(config)
    with open(p, "w") as f:
        json.dump(config, f)


def diff(a, b, *extra):
    stream = io.StringIO()
    conversations = ct._read_conversations(extra[0]) if extra else None
    return ct.diff_tokenizers(a, b, conversations, out=stream), stream.getvalue()


def test_diff_identical_and_bad_input(exported, tmp_path, capsys):
    same = copy_dir(exported, tmp_path / "same")
    code, text = diff(exported, same)
    assert code == 0 and "Result: IDENTICAL" in text and "in sync" in text
    assert run_main(["diff", exported, same], capsys)[0] == 0
    assert run_main(["diff", exported, str(tmp_path / "missing")], capsys)[0] == 2
    broken = copy_dir(exported, tmp_path / "broken")
    with open(os.path.join(broken, "tokenizer_config.json"), "w") as f:
        f.write("{not json")
    assert run_main(["diff", exported, broken], capsys)[0] == 2
    assert run_main(["diff", exported, same, "--messages", str(tmp_path / "nope.json")], capsys)[0] == 2


def test_diff_finds_each_planted_difference(exported, tmp_path):
    # chat_template.jinja vs tokenizer_config.json disagree inside one directory.
    stale = copy_dir(exported, tmp_path / "stale")
    edit_config(stale, lambda c: c.update(chat_template=ct.TEMPLATES["olmo3-instruct-release"]))
    code, text = diff(exported, stale)
    assert code == 1 and "DISAGREE: transformers uses chat_template.jinja" in text and "template_files_B" in text
    assert "== effective chat template ==\nidentical" in text  # the .jinja wins, so the effective one is the same
    # Effective template (pretty-printed diff).
    rel = copy_dir(exported, tmp_path / "rel")
    ct.export_template("olmo3-instruct-release", exported, rel)
    code, text = diff(exported, rel)
    assert code == 1 and "+  {{- '<|im_start|>system\\nYou are Olmo" in text and "rendered_examples" in text
    # Special tokens.
    special = copy_dir(exported, tmp_path / "special")
    edit_config(special, lambda c: c.update(pad_token="<|im_end|>"))
    code, text = diff(exported, special)
    assert code == 1 and "pad_token: A='<|pad|>' B='<|im_end|>'" in text
    # Added tokens and vocabulary size.
    added = str(tmp_path / "added")
    t = AutoTokenizer.from_pretrained(exported)
    t.add_tokens(["<tool_x>"])
    t.save_pretrained(added)
    ct.export_template("olmo3-instruct-dev", added, added)
    code, text = diff(exported, added)
    assert code == 1 and "added token only in B" in text and "<tool_x>" in text and "size: A=" in text
    # Other config fields.
    other = copy_dir(exported, tmp_path / "other")
    edit_config(other, lambda c: c.update(model_max_length=8))
    code, text = diff(exported, other)
    assert code == 1 and '"model_max_length": 8' in text and "config" in text.splitlines()[-1]
    # Rendered examples (user-supplied conversation).
    msgs = write(tmp_path / "m.json", [USER, ANSWER])
    code, text = diff(exported, rel, msgs)
    assert code == 1 and "messages: DIFFERENT" in text


# ---------------------------------------------------------------------------------------------
# open-instruct's original Olmo 3 Think templates, bundled with generation blocks
# ---------------------------------------------------------------------------------------------
with open(os.path.join(REPO, "tests", "data", "open_instruct_think_templates.json"), encoding="utf-8") as _f:
    OPEN_INSTRUCT = json.load(_f)["templates"]  # their definition strings, as facts (source named in the file)
OI_SYS = {"role": "system", "content": "Be brief."}
OI_CASES = {
    "single_turn": ([USER, ANSWER], False),
    "generation_prompt": ([USER], True),
    "multi_turn": ([USER, {"role": "assistant", "content": "12"}, {"role": "user", "content": "Again?"},
                    {"role": "assistant", "content": "12!"}], False),
    "system_message": ([OI_SYS, USER, ANSWER], False),
    "functions_and_calls": ([{**OI_SYS, "functions": '[{"name": "now"}]'},
                             {"role": "user", "content": "Time?", "functions": '[{"name": "f"}]'},
                             {"role": "assistant", "content": "Checking.", "function_calls": "now()"},
                             {"role": "environment", "content": "12:00"}, {"role": "assistant", "content": "Noon."}],
                            False),
    "final_call": ([USER, {"role": "assistant", "content": None, "function_calls": "now()"}], False),
    "environment_then_prompt": ([USER, {"role": "assistant", "content": "x", "function_calls": "f()"},
                                 {"role": "environment", "content": "1"}], True),
}


@pytest.mark.parametrize("name", sorted(OPEN_INSTRUCT))
@pytest.mark.parametrize("case", sorted(OI_CASES))
def test_open_instruct_think_templates_render_as_open_instruct(tok, name, case):
    """Without its generation tags ours renders byte for byte as open-instruct's definition, and its labels are
    the assistant turns (content, calls and closing token; the generation prompt and headers untrained)."""
    messages, agp = OI_CASES[case]
    theirs = tok.apply_chat_template(messages, chat_template=OPEN_INSTRUCT[name], tokenize=False,
                                     add_generation_prompt=agp)
    ours = ct.get_template(name)
    assert ct.has_generation_blocks(ours)
    assert tok.apply_chat_template(messages, chat_template=strip_blocks(ours), tokenize=False,
                                   add_generation_prompt=agp) == theirs
    assert ct.render(messages, name, add_generation_prompt=agp, eos_token=tok.eos_token) == theirs
    if not agp:
        out = ct.tokenize_messages(tok, messages, chat_template=name)
        turns = [m for m in messages if m["role"] == "assistant"]
        assert trained_spans(tok, out) == [(m.get("content") or "") + (
            f"<function_calls>{m['function_calls']}</function_calls>" if m.get("function_calls") else "")
            + ("<|im_end|>" if m is not messages[-1] else EOS) for m in turns]


def test_open_instruct_think_templates_by_name_and_their_limits(tok):
    """`--chat_template_name olmo_thinker` (open-instruct's 7B Think DPO / RL template) is taken by the stage
    scripts; data the old format cannot hold drops with a reason instead of rendering without it."""
    import sft

    args = ct.parse_stage_args(sft.Args, sft.UNSUPPORTED_FLAGS, [
        "--model_name_or_path", "m", "--dataset_mixer_list", "d.jsonl", "1.0", "--chat_template_name", "olmo_thinker"])
    assert ct.get_template(args.chat_template) == ct.OPEN_INSTRUCT_TEMPLATES["olmo_thinker"]
    assert ct.render([USER], "olmo_thinker", add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>")
    with pytest.raises(DroppedRow, match="tool_calls_not_rendered"):
        ct.tokenize_messages(tok, TOOL_CONV, chat_template="olmo_thinker_no_think_7b")
    with pytest.raises(DroppedRow, match="tools_not_rendered"):
        ct.tokenize_prompt(tok, [USER], tools=TOOLS, chat_template="olmo_thinker")


def test_diff_takes_hub_ids_from_the_local_cache(exported, tmp_path):
    """`diff A B` with Hub ids, as the tokenizer notes use it: an id resolves from the Hugging Face cache offline
    (as from_pretrained does); an id that is neither cached nor downloadable is a clear error naming it."""
    import shutil
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--allenai--olmo-3-tokenizer-instruct-dev"
    shutil.copytree(exported, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")

    def cli(*argv):
        return subprocess.run([sys.executable, os.path.join(REPO, "chat_template.py"), "diff", *argv], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=120)

    same = cli("allenai/olmo-3-tokenizer-instruct-dev", exported)
    assert same.returncode == 0 and "Result: IDENTICAL" in same.stdout, same.stderr
    assert f"allenai/olmo-3-tokenizer-instruct-dev ({repo / 'snapshots' / commit})" in same.stdout
    missing = cli("allenai/olmo-3-tokenizer-think-release", exported)
    assert missing.returncode == 2 and "'allenai/olmo-3-tokenizer-think-release' is not a local directory" in \
        missing.stderr


def test_drop_log_names_the_file_and_line_of_mixture_rows(tok, tmp_path, caplog):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in ([USER, ANSWER], [USER], [USER, ANSWER])))
    ct.tokenize_sft(ct.load_mixture([str(path), "1.0"]), tok, 512, cache_dir="")
    assert "no_final_assistant: 1 (row " in caplog.text and f" = {path}:2)" in caplog.text
