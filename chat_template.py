"""Olmo 3 chat templates, trained-token labels, dataset tokenization and tokenizer tools.

Shared by sft.py, dpo.py and grpo.py: every token a stage trains on is chosen here, so this module
is built to make wrong labels loud (the Olmo 3 tokenizer-settings notes; Olmo 3's team lost time to a
masked opening `<think>` and to drifting templates).

Templates (`TEMPLATES`, rendered text identical to the released Olmo 3 tokenizers):

    olmo3-instruct-dev      allenai/olmo-3-tokenizer-instruct-dev: ChatML turns, tools as JSON in
                            `<functions>...</functions>`, calls in `<function_calls>...</function_calls>`,
                            `tool` / `environment` messages as an `environment` turn, the final
                            assistant turn ends with eos. With no system message it adds the released
                            default system turn ("You are a helpful function-calling AI assistant. ...").
    olmo3-instruct-release  the same with the Olmo identity system prompt in place of that default.
    olmo3-think-dev         instruct-dev plus `<think>` in `add_generation_prompt` (olmo-3.2-tokenizer-think-dev).
    olmo3-think-release     think-dev with the identity prompt (olmo-3.2-tokenizer-think-release).

As the tokenizer notes state it, release = dev + the identity prompt and think = instruct + `<think>` in the
generation prompt: the four differ nowhere else (all render empty calls and ignore `reasoning_content`, as
the released Instruct template does, tests/data/olmo3_released_instruct.jinja).

Options (`python chat_template.py list` names all):
    NAME-handoff            (each of the four) the Olmo 3.5 notes' convention: a turn that calls tools always
                            closes with `<|im_end|>` (it hands control to the environment), so a tool call
                            trains `<|im_end|>` and only an answer trains eos. The released templates close
                            a conversation's final message with eos even when it is a call, so SFT / DPO rows
                            ending in a call train `</function_calls>` + eos there.
    olmo_thinker_no_think_7b, olmo_thinker, olmo_thinker_no_think_sft_tokenization
                            open-instruct's original Olmo 3 Think templates (7B SFT; 7B DPO and RL; 32B
                            SFT), by open-instruct's names, rendering as its definitions do. Their older
                            format reads no `tools` / `tool_calls` (rows with them drop, counted).

Labeling (`tokenize_messages`):
  * templates with blocks: every block trains (`only_last_turn=False`), or, for preference data
    (`only_last_turn=True`), the blocks found between the stable renders before and through the
    final assistant message. The earlier render must be a prefix of the later one (turn endings may
    not change when a message is appended); a block straddling that boundary is ambiguous and drops
    the row; an eos / `<|im_end|>` left just outside a block (only whitespace between) drops the row
    (the model would never learn to stop); another special token right after a block is a warning
    (a missing terminator, or a correctly masked next header).
  * templates without blocks (external, unannotated Hub templates): prefix labeling. Render the
    conversation before the final assistant message with `add_generation_prompt=True` and train
    everything after it, up to and including its closing eos / `<|im_end|>` (not the separator
    whitespace a template writes after it: the model stops at the terminator and never generates it).
    Earlier assistant turns train the same way (`only_last_turn=False`) where the renders are stable:
    the render through each turn, and its generation prompt, are prefixes of the whole conversation's
    (a ChatML template such as SmolLM2's or Qwen2.5's); otherwise only the final turn trains and the
    row is counted (`prefix_labeling_last_turn_only`). This is the path that masks an opening
    `<think>` added by a generation prompt (the known bug; tests show both behaviours).
  * a token trains when its first character lies inside a block. A token straddling a block start
    (e.g. the header's `\\n` merged with a leading `\\n` of the content) is therefore not trained: at
    inference the header is already in the prompt (transformers' own mask trains such a token).
    Offsets come from the fast tokenizer; starts trimmed by a ByteLevel `trim_offsets` post-processor
    are extended back over the gap, so whitespace belongs to the token that holds it.

Decisions on cases the Olmo 3 format leaves open:
  * a final assistant turn ends with eos whether or not it is a tool call (the -handoff options: unless it
    is a call), and every earlier turn
    with `<|im_end|>\\n`, byte for byte as the released Olmo 3 / 3.1 Instruct templates render it
    (tests/data/olmo3_released_instruct.jinja is the released text; the tests compare renders). So a
    conversation that ends in a tool call is not a prefix of the one continued with the tool result.
  * an empty `tool_calls` list or `function_calls` string: the templates print an empty
    `<function_calls></function_calls>`, as the released one does (it tests only `is not none`), so data
    that stores `tool_calls: []` on plain turns trains on that text there.
    When both count as given, `function_calls` wins over `tool_calls`. An assistant turn with content
    None, empty calls and no reasoning drops the row (`missing_content`).
  * `reasoning_content`: the templates ignore it, as the released Instruct template does (counted as the
    warning `reasoning_content_ignored`); a turn with nothing else (no content, no calls) would train on
    its closing token alone and drops the row (`reasoning_content_not_rendered`, for any template that
    never reads the field). Put reasoning in `content` as `<think>...</think>` (Dolci's format).
  * tool call `arguments` given as a JSON string (the OpenAI wire format) are parsed into a dict
    before rendering, so they serialize as `key=json(value)`; a string that is not a JSON object drops
    the row (`bad_tool_call`). Flat calls `{"name", "arguments"}` are accepted like
    `{"function": {...}}`. The template itself renders an unparsed string verbatim inside the
    parentheses instead of failing. Calls with no arguments render `name()`.
  * `content: None` is allowed on an assistant message that has tool calls or reasoning (rendered as
    nothing); elsewhere it drops the row (`missing_content`). Content must be a string (the released
    templates concatenate strings; list-of-parts content drops as `non_string_content`).
  * rows coming through Arrow (`datasets`) get keys that were absent filled with None when structs are
    unified; the dataset helpers remove None values from tool schemas and call arguments for that
    reason (an explicit null argument cannot be told apart). Prefer JSON strings for such columns.

over_length_strategy (rows longer than max_length):
    drop       drop the row (`over_length`).
    terminate  left truncation: keep the last max_length tokens, so the tail with its terminator is
               intact; if the last trained token is not already eos or the tool hand-off `<|im_end|>`
               it becomes eos (an existing hand-off is never overwritten). No trained token left: dropped.
               A preference pair is cut on both sides at the same left position, inside its shared
               prompt, so both answers keep one context; a pair that cannot be is dropped.
    truncate   plain right truncation (RL prompts; it cuts the terminator off a training row).

Dataset helpers: `load_mixture` (Hub datasets, local .json/.jsonl/.parquet files or `save_to_disk`
directories; a decimal amount is a fraction of the source, above 1.0 upsampling, an integer a row
count), and `tokenize_sft` / `tokenize_preference` / `tokenize_rlvr`, which return the tokenized
dataset and a Counter of dropped rows per reason. Results are cached with `save_to_disk` under
$OLMO3_POSTTRAIN_CACHE (default ~/.cache/olmo3_posttrain/tokenized), keyed by the data fingerprint,
the tokenizer (backend JSON, special tokens), the template, the settings and this file's source.
The returned Counter also carries `cache_hit`, `cache_path`, `total`, `kept` and `warnings`;
`cache_dir=""` turns the cache off. Malformed rows never raise: any failure is counted under a reason
(`error_<ExceptionType>` for the unexpected). Mixtures of 20k+ rows tokenize with `num_proc` workers.
RLVR prompts longer than `max_prompt_length` are dropped, or right-truncated with `truncate`.

The stage scripts parse their flags with `parse_stage_args`: exact names (no prefix matching),
open-instruct's names as aliases in each `Args`, and every other flag of open-instruct's Olmo 3 launch
scripts refused with what to use instead (COMMON_UNSUPPORTED_FLAGS and each script's UNSUPPORTED_FLAGS).

Command line (a stable contract; exit 2 on bad input):

    python chat_template.py list
    python chat_template.py render --template NAME --messages FILE.json [--tools FILE.json] [--add-generation-prompt]
    python chat_template.py show --template NAME --tokenizer DIR --messages FILE.json [--only-last-turn]
    python chat_template.py export NAME --tokenizer DIR --out DIR
    python chat_template.py diff A B [--messages FILE.json]       # exit 0 same, 1 different, 2 bad input
                                                                  # A, B: tokenizer directories or Hub ids

NAME is a template name, a `.jinja` file or a tokenizer directory (its `chat_template.jinja` wins over
`tokenizer_config.json`, as in transformers). FILE.json holds a list of messages, or an object with
`messages` (and optionally `tools`). `render` writes the text exactly (no added newline, eos
`<|endoftext|>` unless the tokenizer directory names another). `show` brackets trained tokens (colour
on a terminal). `export` copies the tokenizer files (never weights) and writes the template to both
`chat_template.jinja` and `tokenizer_config.json`. `diff` reports, per directory, whether those two
disagree (a directory that disagrees with itself is a difference), then the effective template
(pretty-printed unified diff), special and added tokens, vocabulary (size, entries, merges), other
config fields (`tokenizer_config.json`, `tokenizer.json` normalizer / pre-tokenizer / post-processor /
decoder), and rendered examples (built-in, or `--messages`), text and token ids.

Transformers-internal API: generation ranges come from
`transformers.utils.chat_template_utils.render_jinja_template` (checked with transformers 5.19);
rerun tests/test_chat_template.py when upgrading transformers.
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import difflib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile

import datasets

# Plumbing: the stage scripts print rather than configure logging, so this module's INFO lines (cache
# hits, drop counts) go to stderr on their own.
logger = logging.getLogger("chat_template")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[chat_template] %(levelname)s %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

# ---------------------------------------------------------------------------------------------
# Templates. One Jinja source, four variants (seed 002: dev vs release, instruct vs think).
# ---------------------------------------------------------------------------------------------
DEV_SYSTEM = "You are a helpful function-calling AI assistant."  # released olmo-3-tokenizer-instruct-dev default
OLMO_IDENTITY = (
    "You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, and your "
    "model weights are available at https://huggingface.co/allenai."
)
NO_FUNCTIONS = "You do not currently have access to any functions. <functions></functions>"
FUNCTIONS_PREAMBLE = (
    "You are provided with function signatures within <functions></functions> XML tags. You may call "
    "one or more functions to assist with the user query. Output any function calls within "
    "<function_calls></function_calls> XML tags. Do not make assumptions about what values to plug "
    "into functions."
)
IM_START, IM_END, DEFAULT_EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# Written as one line per Jinja statement (joined without separators, so the rendered text is the
# same as the released one-line templates). `__SYSTEM__` and `__THINK__` are filled in by `_build`.
_TEMPLATE_LINES = [
    "{%- set has_system = messages|selectattr('role', 'equalto', 'system')|list|length > 0 -%}",
    "{%- if not has_system -%}",
    "{{- '<|im_start|>system\\n__SYSTEM__ ' -}}",
    "{%- if tools is none or (tools | length) == 0 -%}",
    "{{- '" + NO_FUNCTIONS + "<|im_end|>\\n' -}}",
    "{%- else -%}",
    "{{- '" + FUNCTIONS_PREAMBLE + "' -}}",
    "{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions><|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- if message['role'] == 'system' -%}",
    "{{- '<|im_start|>system\\n' + message['content'] -}}",
    "{%- if tools is not none -%}",
    "{{- '<functions>' -}}{{- tools | tojson -}}{{- '</functions>' -}}",
    "{%- elif message.get('functions', none) is not none -%}",
    "{{- ' <functions>' + message['functions'] + '</functions>' -}}",
    "{%- endif -%}",
    "{{- '<|im_end|>\\n' -}}",
    "{%- elif message['role'] == 'user' -%}",
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' -}}",
    "{%- elif message['role'] == 'assistant' -%}",
    # As released: a call counts when given (`is not none`), so an empty list or string prints empty tags.
    "{%- set has_function_calls = message.get('function_calls', none) is not none -%}",
    "{%- set has_tool_calls = message.get('tool_calls', none) is not none -%}",
    "{{- '<|im_start|>assistant\\n' -}}",
    # Seed 002: the block starts after the header and before any generated <think>; it covers
    # reasoning, answer, tool calls and the closing token. The separator `\n` stays outside.
    "{%- generation -%}",
    "{%- if message.get('content', none) is not none -%}{{- message['content'] -}}{%- endif -%}",
    "{%- if has_function_calls -%}",
    "{{- '<function_calls>' + message['function_calls'] + '</function_calls>' -}}",
    "{%- elif has_tool_calls -%}",
    "{{- '<function_calls>' -}}",
    "{%- for tool_call in message['tool_calls'] -%}",
    ("{%- set call = tool_call['function'] if (tool_call is mapping and tool_call.get('function', none) is mapping)"
     " else tool_call -%}"),
    "{%- if call is mapping and call.get('name', none) is not none -%}",
    "{%- set args = call.get('arguments', none) -%}",
    "{%- if args is mapping -%}",
    "{%- set ns = namespace(arguments_list=[]) -%}",
    "{%- for key, value in args.items() -%}",
    "{%- set ns.arguments_list = ns.arguments_list + [key ~ '=' ~ (value | tojson)] -%}",
    "{%- endfor -%}",
    "{{- call['name'] + '(' + (ns.arguments_list | join(', ')) + ')' -}}",
    "{%- elif args is none -%}",
    "{{- call['name'] + '()' -}}",
    "{%- else -%}",
    "{{- call['name'] + '(' + (args | string) + ')' -}}",
    "{%- endif -%}",
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}",
    "{%- else -%}",
    "{{- tool_call -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{{- '</function_calls>' -}}",
    "{%- endif -%}",
    # As released: the final message ends with eos, tool call or not; earlier turns with <|im_end|>\n.
    # `__HANDOFF__` (the -handoff variants): a turn that calls tools always closes with <|im_end|>.
    "{%- if not loop.last__HANDOFF__ -%}",
    "{{- '<|im_end|>' -}}",
    "{%- else -%}",
    "{{- eos_token -}}",
    "{%- endif -%}",
    "{%- endgeneration -%}",
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}",
    "{%- elif message['role'] == 'environment' or message['role'] == 'tool' -%}",
    "{{- '<|im_start|>environment\\n' + message['content'] + '<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- if loop.last and add_generation_prompt -%}",
    "{{- '<|im_start|>assistant\\n__THINK__' -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
]


def _build(release: bool, think: bool, handoff: bool = False) -> str:
    return ("".join(_TEMPLATE_LINES)
            .replace("__SYSTEM__", OLMO_IDENTITY if release else DEV_SYSTEM)
            .replace("__THINK__", "<think>" if think else "")
            .replace("__HANDOFF__", " or has_function_calls or has_tool_calls" if handoff else ""))


# The four released variants (byte-identical renders to the released tokenizers).
TEMPLATES: dict[str, str] = {
    "olmo3-instruct-dev": _build(release=False, think=False),
    "olmo3-instruct-release": _build(release=True, think=False),
    "olmo3-think-dev": _build(release=False, think=True),
    "olmo3-think-release": _build(release=True, think=True),
}
# The Olmo 3.5 notes' convention as an option: a tool call trains <|im_end|> (it hands control to the
# environment), an answer trains eos. Renders differ from the release only in a conversation's final
# tool call: `...</function_calls><|im_end|>` instead of `...</function_calls>` + eos.
HANDOFF_TEMPLATES: dict[str, str] = {
    f"{name}-handoff": _build(release="release" in name, think="think" in name, handoff=True) for name in TEMPLATES}

# The original Olmo 3 Think templates, by their open-instruct names (`--chat_template_name`), rendering exactly
# as open-instruct's definitions (open_instruct/dataset_transformation.py, CHAT_TEMPLATES) with generation
# blocks added. Their format predates the released one: no `tools` or `tool_calls` (calls are a
# `function_calls` string, tool schemas a `functions` string on a system or user message), results only as
# `environment` messages, and a system message always gets the functions sentence.
#   olmo_thinker_no_think_7b                Olmo 3 7B Think SFT data (Olmo identity, no <think> prompt)
#   olmo_thinker                            Olmo 3 7B Think DPO and RL (open-instruct's 7b_think_dpo.sh /
#                                           7b_think_rl.sh): plain system prompt, <think> generation prompt
#   olmo_thinker_no_think_sft_tokenization  Olmo 3 32B Think SFT data (plain system prompt, no <think> prompt)
OI_PLAIN_SYSTEM = "You are a helpful AI assistant."
_OPEN_INSTRUCT_LINES = [
    "{%- set has_system = messages|selectattr('role', 'equalto', 'system')|list|length > 0 -%}",
    "{%- if not has_system -%}{{- '<|im_start|>system\\n__SYSTEM__<|im_end|>\\n' -}}{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- if message['role'] == 'system' -%}",
    "{{- '<|im_start|>system\\n' + message['content'] -}}",
    "{%- if message.get('functions', none) is not none -%}",
    "{{- ' <functions>' + message['functions'] + '</functions><|im_end|>\\n' -}}",
    "{%- else -%}",
    "{{- ' " + NO_FUNCTIONS + "<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- elif message['role'] == 'user' -%}",
    "{{- '<|im_start|>user\\n' + message['content'] -}}",
    "{%- if message.get('functions', none) is not none -%}",
    "{{- '\\n<functions>' + message['functions'] + '</functions>' -}}",
    "{%- endif -%}",
    "{{- '<|im_end|>\\n' -}}",
    "{%- elif message['role'] == 'assistant' -%}",
    "{{- '<|im_start|>assistant\\n' -}}",
    "{%- generation -%}",
    "{%- if message.get('content', none) is not none -%}{{- message['content'] -}}{%- endif -%}",
    "{%- if message.get('function_calls', none) is not none -%}",
    "{{- '<function_calls>' + message['function_calls'] + '</function_calls>' -}}",
    "{%- endif -%}",
    "{%- if not loop.last -%}{{- '<|im_end|>' -}}{%- else -%}{{- eos_token -}}{%- endif -%}",
    "{%- endgeneration -%}",
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}",
    "{%- elif message['role'] == 'environment' -%}",
    "{{- '<|im_start|>environment\\n' + message['content'] + '<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- if loop.last and add_generation_prompt -%}{{- '<|im_start|>assistant\\n__THINK__' -}}{%- endif -%}",
    "{%- endfor -%}",
]


def _build_open_instruct(system: str, think: bool) -> str:
    return "".join(_OPEN_INSTRUCT_LINES).replace("__SYSTEM__", system).replace("__THINK__", "<think>" if think else "")


OPEN_INSTRUCT_TEMPLATES: dict[str, str] = {
    "olmo_thinker_no_think_7b": _build_open_instruct(OLMO_IDENTITY, think=False),
    "olmo_thinker": _build_open_instruct(OI_PLAIN_SYSTEM, think=True),
    "olmo_thinker_no_think_sft_tokenization": _build_open_instruct(OI_PLAIN_SYSTEM, think=False),
}
ALL_TEMPLATES: dict[str, str] = {**TEMPLATES, **HANDOFF_TEMPLATES, **OPEN_INSTRUCT_TEMPLATES}


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _dir_templates(path: str) -> tuple[str | None, str | None]:
    """(chat_template.jinja text, tokenizer_config.json `chat_template`) of a tokenizer directory."""
    jinja_path, config_path = os.path.join(path, "chat_template.jinja"), os.path.join(path, "tokenizer_config.json")
    jinja = _read_text(jinja_path) if os.path.isfile(jinja_path) else None
    config = None
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f).get("chat_template")
        if isinstance(config, list):  # the older list-of-named-templates form
            config = {t.get("name"): t.get("template") for t in config}.get("default")
    return jinja, config


def get_template(name_or_path: str) -> str:
    """A template by name, from a `.jinja` file, or from a tokenizer directory (the `.jinja` file wins).

    Jinja source itself (anything containing `{%` or `{{`) is returned as is.
    """
    if not isinstance(name_or_path, str):
        raise ValueError(f"a template name or path must be a string, got {type(name_or_path).__name__}")
    if name_or_path in ALL_TEMPLATES:
        return ALL_TEMPLATES[name_or_path]
    if "{%" in name_or_path or "{{" in name_or_path:
        return name_or_path
    if os.path.isfile(name_or_path):
        if name_or_path.endswith(".json"):  # a tokenizer_config.json itself
            with open(name_or_path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
            if not isinstance(template, str) or not template:
                raise ValueError(f"{name_or_path} has no chat_template string")
            return template
        return _read_text(name_or_path)
    if os.path.isdir(name_or_path):
        jinja, config = _dir_templates(name_or_path)
        if jinja is not None or config:
            return jinja if jinja is not None else config
    raise ValueError(f"unknown template {name_or_path!r}: not one of {list(ALL_TEMPLATES)}, "
                     "a .jinja file or a tokenizer dir")


def has_generation_blocks(template: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _render(template: str, messages, tools=None, add_generation_prompt=False, special_tokens=None):
    """(text, generation char ranges). Plumbing over transformers' internal renderer (see docstring)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = dict(special_tokens or {"eos_token": DEFAULT_EOS, "bos_token": DEFAULT_EOS})
    texts, ranges = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=template, return_assistant_tokens_mask=True,
        add_generation_prompt=add_generation_prompt, **kwargs)
    return texts[0], [tuple(r) for r in ranges[0]]


def render(messages, template: str = "olmo3-instruct-dev", tools=None, add_generation_prompt: bool = False,
           eos_token: str = DEFAULT_EOS) -> str:
    """Rendered text of a conversation, the way training sees it (tool calls normalized)."""
    messages, tools = _normalize(messages, tools)
    return _render(get_template(template), messages, tools, add_generation_prompt,
                   {"eos_token": eos_token, "bos_token": eos_token})[0]


# ---------------------------------------------------------------------------------------------
# Validation and normalization
# ---------------------------------------------------------------------------------------------
class DroppedRow(Exception):
    """A row that cannot be trained on; `reason` is the counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


ROLES = ("system", "user", "assistant", "tool", "environment")


def validate_messages(messages) -> None:
    """Raise DroppedRow for anything the templates cannot render faithfully. Never raises anything else."""
    if messages is not None and not isinstance(messages, (list, tuple)):
        raise DroppedRow("bad_messages", f"a {type(messages).__name__}, not a list of messages")
    if not messages:
        raise DroppedRow("empty_conversation")
    for message in messages:
        if not isinstance(message, dict):
            raise DroppedRow("bad_message", f"not a dict: {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise DroppedRow("bad_role", repr(role)[:50])
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise DroppedRow("non_string_content", f"{role}: {type(content).__name__}")
        for key in ("reasoning_content", "function_calls", "functions"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise DroppedRow("non_string_content", f"{role}.{key}: {type(message[key]).__name__}")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, (list, tuple)):
            raise DroppedRow("bad_tool_call", "tool_calls is not a list")
        if content is None:
            has_other = any(message.get(k) for k in ("tool_calls", "function_calls", "reasoning_content"))
            if role != "assistant" or not has_other:
                raise DroppedRow("missing_content", role)


def _strip_none(value):
    """Drop None values from dicts, recursively (Arrow fills absent struct keys with None)."""
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def _decode_json_list(value):
    """A list stored as JSON text (a message list in a column whose rows mix lists with strings is stored
    that way, see _load_json_file; a list of labels or verifiers may be) as the list; anything else as it is."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            pass
    return value


def _normalize(messages, tools=None, from_arrow=False):
    """Copies with tool calls in the `{"function": {"name", "arguments": dict}}` form and tools as a list."""
    messages = _decode_json_list(messages)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            raise DroppedRow("bad_tools", "tools is a string but not JSON") from None
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
            raise DroppedRow("bad_tools", "tools must be a list of JSON schemas")
        tools = [_strip_none(t) if from_arrow else t for t in tools]
    if not isinstance(messages, (list, tuple)):
        return messages, tools
    out = []
    for message in messages:
        if not isinstance(message, dict) or not message.get("tool_calls"):
            out.append(message)
            continue
        message = dict(message)
        calls = []
        for call in message["tool_calls"]:
            if not isinstance(call, dict):
                raise DroppedRow("bad_tool_call", f"tool call is a {type(call).__name__}")
            fn = call.get("function") if isinstance(call.get("function"), dict) else call
            name, args = fn.get("name"), fn.get("arguments")
            if not isinstance(name, str) or not name:
                raise DroppedRow("bad_tool_call", "tool call without a name")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise DroppedRow("bad_tool_call", "arguments string is not JSON") from None
            if args is None:
                args = {}
            if not isinstance(args, dict):
                raise DroppedRow("bad_tool_call", "arguments is not a JSON object")
            if from_arrow:
                args = {k: v for k, v in args.items() if v is not None}
            calls.append({**({k: v for k, v in call.items() if k != "function"} if "function" in call else {}),
                          "type": call.get("type") or "function", "function": {"name": name, "arguments": args}})
        message["tool_calls"] = calls
        out.append(message)
    return out, tools


# ---------------------------------------------------------------------------------------------
# Messages -> input_ids + labels
# ---------------------------------------------------------------------------------------------
def _special_tokens(tokenizer) -> dict:
    """What transformers passes to the template: bos_token, eos_token, pad_token, ... as strings."""
    out = {}
    for key, value in getattr(tokenizer, "special_tokens_map", {}).items():
        out[key] = value if isinstance(value, (str, list)) else str(value)
    out.setdefault("eos_token", tokenizer.eos_token or DEFAULT_EOS)
    return out


def _resolve_template(tokenizer, chat_template) -> str:
    if chat_template:
        return get_template(chat_template)
    if getattr(tokenizer, "chat_template", None):
        template = tokenizer.chat_template
        return template if isinstance(template, str) else template.get("default")
    raise ValueError("no chat template: pass chat_template= or use a tokenizer that has one")


def _all_special_strings(tokenizer) -> list[str]:
    """Special-token strings (longest first) for the checks after a block."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    specials.update({IM_START, IM_END})
    return sorted((s for s in specials if s), key=len, reverse=True)


def _label_conversation(tokenizer, messages, tools=None, template=None, only_last_turn=False,
                        warnings=None) -> dict:
    """Core labeling: returns text, input_ids, offsets (token start chars), mask and the labeled char ranges.

    Raises DroppedRow with the reason when a row's trained span cannot be established safely.
    """
    special = _special_tokens(tokenizer)
    eos = special["eos_token"]

    def render_or_drop(*args):
        try:
            return _render(*args)
        except Exception as e:  # noqa: BLE001 - e.g. an external template's raise_exception()
            raise DroppedRow("render_error", f"{type(e).__name__}: {e}") from None

    full, ranges = render_or_drop(template, messages, tools, False, special)
    if has_generation_blocks(template):
        if sorted(ranges) != ranges or any(not (0 <= a <= b <= len(full)) for a, b in ranges) or any(
                ranges[i][1] > ranges[i + 1][0] for i in range(len(ranges) - 1)):
            raise DroppedRow("bad_generation_ranges", str(ranges)[:200])
        ranges = [(a, b) for a, b in ranges if b > a]
        if only_last_turn:
            # Seed 002, external-template last-turn labeling: blocks between the stable render before the
            # final assistant message and the render through it. Ownership comes from position, never
            # from counting blocks against messages.
            before = render_or_drop(template, messages[:-1], tools, False, special)[0]
            if not full.startswith(before):
                raise DroppedRow("unstable_render", "the render before the final message is not a prefix")
            boundary = len(before)
            if any(a < boundary < b for a, b in ranges):
                raise DroppedRow("ambiguous_block_ownership", "a block straddles the final message's start")
            ranges = [(a, b) for a, b in ranges if a >= boundary]
        if not ranges:
            raise DroppedRow("no_generation_block")
        if warnings is not None and template not in _BUNDLED:
            _review_external_blocks(template, messages, tools, special, full, ranges, warnings,
                                    boundary if only_last_turn else 0)
        specials = _all_special_strings(tokenizer)
        for a, b in ranges:
            after = full[b:]
            stripped = after.lstrip()
            if (eos and stripped.startswith(eos)) or stripped.startswith(IM_END):
                raise DroppedRow("closing_token_outside_block", repr(after[:20]))
            hit = next((s for s in specials if after.startswith(s)), None)
            if hit is not None and warnings is not None:
                warnings[f"special_token_after_block:{hit}"] += 1
                _log_once(f"special token {hit!r} right after a generation block: a missing terminator, or a "
                          "correctly masked next header? (the tokenize summary names the rows)")
    else:
        # Prefix labeling (templates without blocks): train everything after the generation prompt of
        # the final assistant message. Known limitation: it masks whatever the generation prompt adds.
        before = render_or_drop(template, messages[:-1], tools, False, special)[0]
        prompt = render_or_drop(template, messages[:-1], tools, True, special)[0]
        if not full.startswith(before):
            raise DroppedRow("unstable_render", "the render before the final message is not a prefix")
        if not full.startswith(prompt):
            raise DroppedRow("prompt_not_prefix", "the generation prompt does not start the final turn")
        if len(full) == len(prompt):
            raise DroppedRow("empty_completion")
        ranges = [(len(prompt), _end_at_terminator(full, len(prompt), len(full), eos))]
        if not only_last_turn and sum(m.get("role") == "assistant" for m in messages) > 1:
            earlier = _earlier_turn_ranges(template, messages, tools, special, full, eos)
            if earlier is None and warnings is not None:
                warnings["prefix_labeling_last_turn_only"] += 1
            ranges = (earlier or []) + ranges
        if warnings is not None and "<think>" in prompt[len(before):]:
            warnings["prefix_labeling_masks_think"] = 1  # per row (a pair's two sides count once); the known bug
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(enc["input_ids"]), _token_starts(enc["offset_mapping"])
    mask, r = [], 0
    for start in offsets:
        while r < len(ranges) and start >= ranges[r][1]:
            r += 1
        mask.append(1 if r < len(ranges) and ranges[r][0] <= start < ranges[r][1] else 0)
    if not any(mask):
        raise DroppedRow("no_trained_tokens")
    return {"text": full, "input_ids": input_ids, "offsets": offsets, "mask": mask, "ranges": ranges}


_BUNDLED = frozenset(ALL_TEMPLATES.values())  # tested here: the review aids below are for external templates
_LOGGED = set()


def _log_once(message: str) -> None:
    """A warning logged once per process (the per-row counts go to the tokenize summary)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)


def _review_external_blocks(template, messages, tools, special, full, ranges, warnings, trained_from=0) -> None:
    """Review aids for an external template's blocks, in every labeling mode: a block that starts where an
    assistant message starts trains its header (`block_covers_header`); a message's tool calls rendered only
    outside blocks go untrained (`tool_calls_outside_block`). A message's start is the length of the render of
    the messages before it, where that render is a prefix of the whole (one render per assistant message)."""
    starts = {}
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            try:
                before = _render(template, messages[:i], tools, False, special)[0]
            except Exception:  # noqa: BLE001 - a template that needs a first message: no start known
                continue
            if full.startswith(before):
                starts[i] = len(before)
    bounds = sorted(starts.values()) + [len(full)]
    for i, start in starts.items():
        end = bounds[bounds.index(start) + 1]
        if start < trained_from:
            continue  # last-turn labeling: earlier messages do not train
        if any(a == start < b for a, b in ranges):
            warnings["block_covers_header"] += 1
            _log_once("a generation block starts where an assistant message starts: its header trains "
                      "(the tokenize summary names the rows)")
        for call in messages[i].get("tool_calls") or []:
            name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
            at = [m.start() for m in re.finditer(re.escape(name), full[start:end])] if name else []
            if at and not any(a <= start + k < b for k in at for a, b in ranges):
                warnings["tool_calls_outside_block"] += 1
                _log_once("an assistant message's tool calls render outside its generation blocks: they do not "
                          "train (the tokenize summary names the rows)")
                break


def _end_at_terminator(text: str, start: int, end: int, eos: str) -> int:
    """End of a prefix-labeled turn: a turn that closes with eos or `<|im_end|>` followed only by whitespace
    (ChatML's separator newline, which the template writes and the model never generates: it stops at the
    terminator) trains through the terminator; other turns keep their end."""
    body = text[start:end].rstrip()
    for terminator in filter(None, (eos, IM_END)):
        if body.endswith(terminator):
            return start + len(body)
    return end


def _earlier_turn_ranges(template, messages, tools, special, full, eos) -> list | None:
    """Prefix labeling of every assistant turn before the final one: each trains from the end of its generation
    prompt to the end of its own render, as the final turn does. Only where the renders are stable (the render
    through a turn and its generation prompt are prefixes of the full one, so the turn's text is exactly what the
    conversation holds); otherwise None (e.g. a template that drops earlier turns' reasoning), and only the
    final turn trains."""
    ranges = []
    for i, message in enumerate(messages[:-1]):
        if message.get("role") != "assistant":
            continue
        try:
            prompt = _render(template, messages[:i], tools, True, special)[0]
            through = _render(template, messages[:i + 1], tools, False, special)[0]
        except Exception:  # noqa: BLE001 - a template may refuse a conversation cut short (raise_exception)
            return None
        if not (through.startswith(prompt) and full.startswith(through)) or len(through) == len(prompt):
            return None
        ranges.append((len(prompt), _end_at_terminator(through, len(prompt), len(through), eos)))
    return ranges


def _token_starts(offset_mapping) -> list[int]:
    """First character of each token. A ByteLevel post-processor with `trim_offsets` moves a token's
    start past its leading whitespace (a lone " " token becomes empty): extend each start back over
    any gap to the previous token's end, so whitespace is owned by the token that holds it."""
    starts, prev_end = [], 0
    for start, end in offset_mapping:
        starts.append(prev_end if prev_end < start else int(start))
        prev_end = max(prev_end, int(end))
    return starts


def _terminator_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return {i for i in ids if i is not None}


OVER_LENGTH_STRATEGIES = ("drop", "terminate", "truncate")


def apply_over_length(tokenizer, input_ids, labels, max_length, over_length_strategy="drop"):
    """`drop`, `terminate` (left truncation, intact tail) or `truncate` (right truncation); see module doc."""
    if over_length_strategy not in OVER_LENGTH_STRATEGIES:
        raise ValueError(f"unknown over_length_strategy {over_length_strategy!r} {OVER_LENGTH_STRATEGIES}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if max_length is None or len(input_ids) <= max_length:
        return input_ids, labels
    if over_length_strategy == "drop":
        raise DroppedRow("over_length")
    if over_length_strategy == "terminate":
        input_ids, labels = list(input_ids[-max_length:]), list(labels[-max_length:])
        trained = [i for i, label in enumerate(labels) if label != -100]
        if not trained:
            raise DroppedRow("over_length")
        last = trained[-1]
        if input_ids[last] not in _terminator_ids(tokenizer):  # never overwrite an existing hand-off
            input_ids[last] = labels[last] = tokenizer.eos_token_id
        return input_ids, labels
    return list(input_ids[:max_length]), list(labels[:max_length])  # truncate


def _check_fields_rendered(messages, template: str, tools=None, warnings=None) -> None:
    """Fields a template never reads are left out of the text. The released Olmo 3 templates ignore
    `reasoning_content`: an assistant turn with nothing else would render empty and train on its closing
    token alone, so the row drops (`reasoning_content_not_rendered`); otherwise each ignored field is counted
    as a warning. Tool calls or tool schemas given to a template that never reads them (open-instruct's
    original Olmo 3 Think templates, a Hub template without tool support) drop the row
    (`tool_calls_not_rendered`, `tools_not_rendered`): the text would not hold them."""
    if tools and "tools" not in template:
        raise DroppedRow("tools_not_rendered", "the template ignores `tools`")
    if "tool_calls" not in template and any(m.get("tool_calls") for m in messages):
        raise DroppedRow("tool_calls_not_rendered", "the template ignores `tool_calls`")
    if "reasoning_content" in template:
        return
    for message in messages:
        if message.get("role") != "assistant" or message.get("reasoning_content") is None:
            continue
        if not (message.get("content") or message.get("tool_calls") or message.get("function_calls")):
            raise DroppedRow("reasoning_content_not_rendered", "the template ignores an assistant turn's only text")
        if warnings is not None:
            warnings["reasoning_content_ignored"] += 1


def tokenize_messages(tokenizer, messages, tools=None, chat_template=None, max_length=None,
                      over_length_strategy="drop", only_last_turn=False, warnings=None) -> dict:
    """Render `messages` and return `input_ids` and `labels` (-100 where a token is not trained).

    Labels come from the template's `{% generation %}` blocks (prefix labeling for templates without
    them). `only_last_turn` trains the final assistant turn only (preference data). Raises
    `DroppedRow` for rows that cannot be used; `warnings` (a Counter) collects non-fatal findings.
    """
    apply_over_length(tokenizer, [], [], max_length, over_length_strategy)  # a bad setting fails on every row
    validate_messages(messages)
    if messages[-1]["role"] != "assistant":
        raise DroppedRow("no_final_assistant")
    messages, tools = _normalize(messages, tools)
    template = _resolve_template(tokenizer, chat_template)
    _check_fields_rendered(messages, template, tools, warnings)
    out = _label_conversation(tokenizer, messages, tools, template, only_last_turn, warnings)
    labels = [t if m else -100 for t, m in zip(out["input_ids"], out["mask"])]
    input_ids, labels = apply_over_length(tokenizer, out["input_ids"], labels, max_length, over_length_strategy)
    return {"input_ids": input_ids, "labels": labels}


def tokenize_prompt(tokenizer, messages, tools=None, chat_template=None) -> list[int]:
    """Prompt tokens with the generation prompt appended (RLVR, evaluation)."""
    validate_messages(messages)
    messages, tools = _normalize(messages, tools)
    template = _resolve_template(tokenizer, chat_template)
    _check_fields_rendered(messages, template, tools)
    try:
        text = _render(template, messages, tools, True, _special_tokens(tokenizer))[0]
    except Exception as e:  # noqa: BLE001 - e.g. an external template's raise_exception()
        raise DroppedRow("render_error", f"{type(e).__name__}: {e}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# Datasets: loading a mixture
# ---------------------------------------------------------------------------------------------
def _read_json_rows(path: str):
    """Yield (line, row) for every row of a .jsonl file (or of a .json list of rows, numbered from 1),
    parsed by Python's json: values exactly as written, and the line of a malformed row."""
    with open(path, "rb") as f:  # bytes, decoded line by line: a bad byte names its line; rows end at \n only
        first = f.read(1024).lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()[:1]
        f.seek(0)
        if first == b"[":
            try:
                rows = json.loads(f.read().decode("utf-8-sig"))
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e})") from None
            except ValueError as e:
                raise ValueError(f"{path}:{getattr(e, 'lineno', '?')}: not valid JSON ({e})") from None
            for i, row in enumerate(rows if isinstance(rows, list) else [rows], 1):
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: item {i} of the JSON list must be an object (a row), "
                                     f"not {type(row).__name__}")
                yield i, row
            return
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i}: not UTF-8 text ({e})") from None
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{i}: a row must be a JSON object, not {type(row).__name__}")
                yield i, row


def _utf8_encodable(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _json_text(value):
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _load_json_file(path: str) -> datasets.Dataset:
    """A .json / .jsonl file with every value as written, plus `source_line` (the row's line in the file).

    `datasets` stores a column that mixes strings with lists or numbers as JSON text and decodes all of
    it when read, so the string label "[1, 2]" came back as a list, "1e3" as 1000.0 and "007" as 7.
    Such a column is rebuilt here from Python's parse: strings as written, the other values as their
    JSON text (verifiers.py reads a JSON-text label and the Python value alike)."""
    lines, kinds = [], collections.defaultdict(set)  # one pass, without keeping the rows
    for i, row in _read_json_rows(path):
        lines.append(i)
        for key, value in row.items():
            kinds[key].update(() if value is None else (isinstance(value, str),))  # a null mixes with anything
    mixed = [key for key, k in kinds.items() if k == {True, False}]
    ds = None
    if not mixed:  # one type per Arrow column; a mixed column is rebuilt from Python's rows below
        try:
            ds = datasets.load_dataset("json", data_files=path, split="train")
        except Exception:  # e.g. blank lines, which its reader does not skip: the rows Python read, below
            pass
    if ds is None:
        rows = [{k: _json_text(r.get(k)) if k in mixed else r.get(k) for k in kinds} for _, r in _read_json_rows(path)]
        try:
            ds = datasets.Dataset.from_list(rows)
        except UnicodeEncodeError:  # a "\ud800" escape: a lone surrogate, which Arrow cannot store
            bad = next(i for i, row in zip(lines, rows) if not _utf8_encodable(row))
            raise ValueError(f"{path}:{bad}: a string holds a lone surrogate escape (\\ud800-\\udfff), which is "
                             "not text: fix or remove the row") from None
        except (TypeError, ValueError) as e:  # pyarrow: values of one column whose types do not mix
            raise ValueError(f"{path}: {e}: one column holds values of types that do not mix") from None
    if len(lines) != len(ds):
        raise ValueError(f"{path}: datasets read {len(ds)} rows, Python's json {len(lines)}")
    if "source_line" in ds.column_names:
        ds = ds.remove_columns("source_line")
    return ds.add_column("source_line", lines)


def _load_source(name: str, split: str) -> datasets.Dataset:
    if not os.path.exists(name) and name.lower().endswith((".jsonl", ".json", ".parquet")):
        raise FileNotFoundError(f"no such data file: {name!r}")  # not a Hub name: do not ask the Hub
    if os.path.isfile(name):
        ext = name.rsplit(".", 1)[-1].lower()
        kind = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(ext)
        if kind is None:
            raise ValueError(f"unsupported data file {name!r} (use .jsonl, .json or .parquet)")
        if kind == "json":
            return _load_json_file(name)
        return datasets.load_dataset(kind, data_files=name, split="train")
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_info.json")):
        ds = datasets.load_from_disk(name)
        return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    return datasets.load_dataset(name, split=split)


def _parse_amount(amount) -> tuple[str, float]:
    """`"0.5"` / `"3.0"` -> fraction (above 1 upsamples), `"500"` -> row count (open-instruct's convention)."""
    text = str(amount).strip()
    if re.fullmatch(r"\d+", text):
        return "count", float(int(text))
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"amount {amount!r}: a fraction (0.5, 3.0) or a row count (500)")
    return "fraction", value


def load_mixture(mixer_list: list[str], split: str | list[str] = "train", seed: int = 0) -> datasets.Dataset:
    """`["a.jsonl", "1.0", "org/b", "500"]` -> one shuffled dataset with `source` and `source_line` columns
    (a row's line in a .jsonl file, its 1-based row number in other sources). JSON files keep every value
    exactly as written (see _load_json_file).

    A decimal amount is a fraction of the source (`"0.5"`; `"3.0"` repeats it three times); an integer
    is a row count (repeating the source when it has fewer rows). `split` is the Hub / `save_to_disk`
    split of every source, or a list: one split for all, or one per source (open-instruct's
    `--dataset_mixer_list_splits`). Local .jsonl / .json / .parquet files have no splits.
    """
    if len(mixer_list) % 2 or not mixer_list:
        raise ValueError(f"dataset mixer list needs (source, fraction_or_count) pairs, got {mixer_list}")
    splits = [split] if isinstance(split, str) else list(split)
    if len(splits) == 1:
        splits = splits * (len(mixer_list) // 2)
    if len(splits) != len(mixer_list) // 2:
        raise ValueError(f"{len(splits)} splits {splits} for {len(mixer_list) // 2} sources: give one split, "
                         "or one per source")
    parts = []
    for name, amount, source_split in zip(mixer_list[0::2], mixer_list[1::2], splits):
        try:
            kind, value = _parse_amount(amount)
        except ValueError as e:
            raise ValueError(f"dataset mixer list, {name}: {e}") from None
        ds = _load_source(name, source_split)
        if "source_line" not in ds.column_names:  # where a row came from, for error messages (1-based)
            ds = ds.add_column("source_line", list(range(1, len(ds) + 1)))
        n = int(value) if kind == "count" else int(value * len(ds))
        if len(ds) == 0 and kind == "count" and n > 0:
            raise ValueError(f"{name}: empty source")
        if n == 0:  # an empty file, or a fraction of under one row: said, not silently nothing
            logger.warning("mixture: %s gives 0 rows (%s %s of %d): left out", name, kind, amount, len(ds))
            continue
        # the shuffled source repeated as often as n asks, then its first rows (one index list, not n copies)
        ds = ds.shuffle(seed=seed).select([i % len(ds) for i in range(n)])
        if "source" in ds.column_names:
            ds = ds.remove_columns("source")
        parts.append(ds.add_column("source", [name] * len(ds)))
        logger.info("mixture: %s -> %d rows (%s %s)", name, len(ds), kind, amount)
    if not parts:
        raise ValueError(f"the dataset mixture {mixer_list} has no rows (see the warnings above)")
    try:
        mixed = datasets.concatenate_datasets(parts)
    except (TypeError, ValueError):  # different features (one source has `tools`, "2" here and 2 there)
        mixed = _rows_to_dataset([row for part in parts for row in part], [p[0]["source"] for p in parts])
    return mixed.shuffle(seed=seed)


def _rows_to_dataset(rows: list[dict], sources: list[str]) -> datasets.Dataset:
    """Rows of several sources as one dataset. A column whose sources disagree on its type (a string label
    here, a number there; a message list with string content here, with parts there) is stored as JSON text,
    as _load_json_file stores a column that mixes types within one file."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    try:
        return datasets.Dataset.from_list(rows)
    except (TypeError, ValueError):
        pass
    text = []
    for column in columns:
        try:
            datasets.Dataset.from_dict({column: [row.get(column) for row in rows]})
        except (TypeError, ValueError):
            text.append(column)
    try:
        return datasets.Dataset.from_list([{k: _json_text(row.get(k)) if k in text else row.get(k) for k in columns}
                                           for row in rows])
    except (TypeError, ValueError) as e:
        raise ValueError(f"the sources {sources} cannot be mixed into one dataset ({e})") from None


# ---------------------------------------------------------------------------------------------
# Datasets: tokenization with drop counts and an on-disk cache
# ---------------------------------------------------------------------------------------------
class DropCounts(collections.Counter):
    """Dropped rows per reason. Also: `cache_hit`, `cache_path`, `total`, `kept`, `warnings` (a Counter)."""

    cache_hit: bool = False
    cache_path: str | None = None
    total: int = 0
    kept: int = 0
    warnings: collections.Counter = None


def default_cache_dir() -> str:
    return os.environ.get("OLMO3_POSTTRAIN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "olmo3_posttrain", "tokenized")


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of what decides token ids: the backend tokenizer (vocab, merges, added tokens, pre-tokenizer)
    and special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(_special_tokens(tokenizer), sort_keys=True, default=str).encode())
    h.update(json.dumps(sorted((i, str(t))
                               for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def _source_hash() -> str:
    with open(os.path.abspath(__file__), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _data_fingerprint(dataset) -> str:
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint:  # datasets' fingerprint: content-based for in-memory data, file + transforms otherwise
        return fingerprint
    h = hashlib.sha256()
    for row in dataset:
        h.update(json.dumps(row, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def _tokenize_dataset(dataset, tokenizer, kind, row_fn, settings, columns, cache_dir=None, num_proc=None):
    """Map `row_fn` over rows, count drops by reason, cache the result (plumbing shared by the three helpers).

    `row_fn(row, warnings) -> dict` returns the output columns or raises DroppedRow. Any other
    exception from a malformed row is counted as `error_<ExceptionType>`, never raised.
    """
    if not isinstance(dataset, datasets.Dataset):
        dataset = list(dataset)
    template = settings.get("chat_template_source")
    key = hashlib.sha256(json.dumps({
        "kind": kind, "data": _data_fingerprint(dataset), "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": template, "settings": {k: v for k, v in settings.items() if k != "chat_template_source"},
        "code": _source_hash(), "datasets": datasets.__version__,
    }, sort_keys=True, default=str).encode()).hexdigest()[:24]
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    path = os.path.join(cache_dir, f"{kind}-{key}") if cache_dir else None
    stats = DropCounts()
    if path and os.path.isfile(os.path.join(path, "drops.json")):
        with open(os.path.join(path, "drops.json")) as f:
            meta = json.load(f)
        stats.update(meta["drops"])
        stats.cache_hit, stats.cache_path, stats.total, stats.kept = True, path, meta["total"], meta["kept"]
        stats.warnings = collections.Counter(meta.get("warnings", {}))
        logger.info("tokenize %s: cache hit %s (%d rows kept, %d dropped: %s)", kind, path, stats.kept,
                    sum(stats.values()), dict(stats))
        return datasets.load_from_disk(path), stats

    def fn(row):
        warnings = collections.Counter()
        try:
            if not isinstance(row, collections.abc.Mapping):
                raise DroppedRow("bad_row", type(row).__name__)
            out = row_fn(row, warnings)
            reason = ""
        except DroppedRow as e:
            out, reason = {}, e.reason
        except Exception as e:  # a malformed row must never crash the run
            out, reason = {}, f"error_{type(e).__name__}"
            logger.debug("row failed: %r", e)
        result = {c: out.get(c) for c in columns}
        result["_drop"], result["_warnings"] = reason, json.dumps(warnings) if warnings else ""
        return result

    if isinstance(dataset, datasets.Dataset):
        if num_proc is None:
            num_proc = min(os.cpu_count() or 1, 8) if len(dataset) >= 20000 else None
        # With a cache, intermediate Arrow files go to a scratch dir next to it (big mixtures do not fit
        # in memory); without one, everything stays in memory.
        work = tempfile.mkdtemp(prefix=".work-", dir=_makedirs(cache_dir)) if path else None
        files = {"keep_in_memory": True} if work is None else {}
        mapped = dataset.map(fn, remove_columns=dataset.column_names, num_proc=num_proc, load_from_cache_file=False,
                             new_fingerprint=f"{kind}-{key}", desc=f"tokenize {kind}",
                             **(files or {"cache_file_name": os.path.join(work, "map.arrow")}))
        reasons, warning_strings = mapped["_drop"], mapped["_warnings"]
        kept = mapped.filter(lambda r: r == "", input_columns="_drop", load_from_cache_file=False,
                             **(files or {"cache_file_name": os.path.join(work, "filter.arrow")}))
        kept = kept.remove_columns(["_drop", "_warnings"])
    else:  # plain Python rows (any shape, even ones Arrow could not hold)
        results = [fn(row) for row in dataset]
        reasons, warning_strings = [r["_drop"] for r in results], [r["_warnings"] for r in results]
        kept_rows = [{c: r[c] for c in columns} for r in results if not r["_drop"]]
        kept = (datasets.Dataset.from_list(kept_rows) if kept_rows
                else datasets.Dataset.from_dict({c: [] for c in columns}))
    drops = collections.Counter(r for r in reasons if r)
    warnings, rows_of, num_rows = collections.Counter(), collections.defaultdict(list), collections.Counter()
    for i, (reason, w) in enumerate(zip(reasons, warning_strings)):
        for key in ([reason] if reason else []) + (list(json.loads(w)) if w else []):
            num_rows[key] += 1
            if len(rows_of[key]) < 5:  # the first few row indices of each reason
                rows_of[key].append(i)
        if w:
            warnings.update(json.loads(w))
    stats.update(drops)
    stats.total, stats.kept, stats.warnings = len(dataset), len(kept), warnings

    def where(i):  # a row as its file and line where load_mixture says it, else its index in the dataset given
        columns = getattr(dataset, "column_names", [])
        if "source" in columns and "source_line" in columns:
            return f"{i} = {dataset[i]['source']}:{dataset[i]['source_line']}"
        return str(i)

    def named(counts):  # reason: count (rows 3 = a.jsonl:7, ...), the first few rows of each
        return "; ".join(f"{k}: {n} (row{'s' if num_rows[k] > 1 else ''} {', '.join(map(where, rows_of[k]))}"
                         f"{', ...' if num_rows[k] > len(rows_of[k]) else ''})" for k, n in counts.most_common())

    if drops:
        logger.warning("tokenize %s: dropped %d of %d rows: %s", kind, sum(drops.values()), len(dataset), named(drops))
    if warnings:
        logger.warning("tokenize %s: warnings: %s", kind, named(warnings))
    if len(kept) == 0 and len(dataset):
        logger.error("tokenize %s: every row was dropped", kind)
    if path:
        tmp = tempfile.mkdtemp(prefix=f".{kind}-{key}-", dir=_makedirs(cache_dir))
        try:
            kept.save_to_disk(tmp)
            with open(os.path.join(tmp, "drops.json"), "w") as f:
                json.dump({"drops": drops, "warnings": warnings, "total": len(dataset), "kept": len(kept),
                           "settings": {k: v for k, v in settings.items() if k != "chat_template_source"}},
                          f, indent=2, default=str)
            os.rename(tmp, path)  # atomic; another process may have won the race, which is fine
            logger.info("tokenize %s: %d of %d rows kept, cached at %s", kind, len(kept), len(dataset), path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(path):
            stats.cache_path = path
            kept = datasets.load_from_disk(path)
        if isinstance(dataset, datasets.Dataset):
            shutil.rmtree(work, ignore_errors=True)
    return kept, stats


def _makedirs(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def tokenize_sft(dataset, tokenizer, max_length, over_length_strategy="drop", chat_template=None,
                 cache_dir=None, num_proc=None):
    """Rows with `messages` (and optional `tools`) -> `input_ids`, `labels`; plus a DropCounts."""
    apply_over_length(tokenizer, [], [], max_length, over_length_strategy)  # fail fast on bad settings
    template = _resolve_template(tokenizer, chat_template)

    def row_fn(row, warnings):
        messages, tools = _normalize(row.get("messages"), row.get("tools"), from_arrow=True)
        return tokenize_messages(tokenizer, messages, tools=tools, chat_template=chat_template,
                                 max_length=max_length, over_length_strategy=over_length_strategy, warnings=warnings)

    settings = {"max_length": max_length, "over_length_strategy": over_length_strategy,
                "chat_template_source": template}
    return _tokenize_dataset(dataset, tokenizer, "sft", row_fn, settings, ["input_ids", "labels"], cache_dir, num_proc)


def _pair_over_length(tokenizer, pair: dict, max_length, over_length_strategy) -> dict:
    """A preference pair longer than max_length, on either side. A pair is compared on one context, so
    `terminate` cuts both sides at the same left position, inside the prompt they share (both tails intact);
    a pair whose cut would reach either answer drops (`over_length`). `drop` and `truncate` act on each
    side as for single rows."""
    sides = ("chosen", "rejected")
    longest = max(len(pair[f"{k}_input_ids"]) for k in sides)
    if over_length_strategy != "terminate" or max_length is None or longest <= max_length:
        for k in sides:
            pair[f"{k}_input_ids"], pair[f"{k}_labels"] = apply_over_length(
                tokenizer, pair[f"{k}_input_ids"], pair[f"{k}_labels"], max_length, over_length_strategy)
        return pair
    cut = longest - max_length
    chosen, rejected = pair["chosen_input_ids"], pair["rejected_input_ids"]
    shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    first_trained = min(next(i for i, label in enumerate(pair[f"{k}_labels"]) if label != -100) for k in sides)
    if cut > min(shared, first_trained):
        raise DroppedRow("over_length", "cutting the pair to max_length would reach an answer")
    return {key: list(value[cut:]) for key, value in pair.items()}


def tokenize_preference(dataset, tokenizer, max_length, over_length_strategy="drop", chat_template=None,
                        cache_dir=None, num_proc=None):
    """Rows with `chosen` / `rejected` message lists -> ids and labels on the final assistant turn only.

    Full conversations (Dolci / open-instruct style) or a `prompt` message list with completion-only
    `chosen` / `rejected` (TRL style). Labels use last-turn labeling (see the module docstring).
    """
    apply_over_length(tokenizer, [], [], max_length, over_length_strategy)  # fail fast on bad settings
    template = _resolve_template(tokenizer, chat_template)

    def row_fn(row, warnings):
        out, prompt, prompts = {}, _decode_json_list(row.get("prompt")), []
        if isinstance(prompt, str) and prompt.strip():  # TRL's plain-text prompt: one user turn
            prompt = [{"role": "user", "content": prompt}]
        for key in ("chosen", "rejected"):
            if key not in row:
                raise DroppedRow(f"missing_{key}")
            messages = _decode_json_list(row.get(key))
            # TRL-style rows: `prompt` messages plus completion-only `chosen` / `rejected`.
            if isinstance(messages, list) and messages and isinstance(messages[0], dict) \
                    and messages[0].get("role") == "assistant":
                if not isinstance(prompt, list):
                    raise DroppedRow("missing_prompt", f"{key} holds only the answer and the row has no prompt")
                messages = prompt + messages
            messages, tools = _normalize(messages, row.get("tools"), from_arrow=True)
            # Arrow fills keys that only the other column has with None: compared without them
            prompts.append(_strip_none(list(messages[:-1])) if isinstance(messages, (list, tuple)) else None)
            if len(prompts) == 2 and prompts[0] != prompts[1]:  # a pair answers one prompt
                raise DroppedRow("prompt_mismatch", "chosen and rejected differ before their last turn")
            # the pair's length is settled below, on both sides at once
            t = tokenize_messages(tokenizer, messages, tools=tools, chat_template=chat_template,
                                  only_last_turn=True, warnings=warnings)
            out[f"{key}_input_ids"], out[f"{key}_labels"] = t["input_ids"], t["labels"]
        return _pair_over_length(tokenizer, out, max_length, over_length_strategy)

    settings = {"max_length": max_length, "over_length_strategy": over_length_strategy,
                "chat_template_source": template}
    columns = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    return _tokenize_dataset(dataset, tokenizer, "preference", row_fn, settings, columns, cache_dir, num_proc)


def prefix_labeling_notice(tokenizer, chat_template, stats: DropCounts) -> str | None:
    """The start-up message of sft.py / dpo.py when the template has no `{% generation %}` blocks (None when it
    has): what prefix labeling does to this data, with the rows affected, and the fix."""
    template = _resolve_template(tokenizer, chat_template)
    if has_generation_blocks(template):
        return None
    warnings = stats.warnings or {}
    source = f"--chat_template {chat_template}" if chat_template else "the checkpoint's own chat template"
    return (f"{source} has no {{% generation %}} blocks, so labels come from prefix labeling: everything after the "
            "generation prompt of the final assistant turn trains, nothing else. Rows affected: "
            f"{warnings.get('prefix_labeling_last_turn_only', 0)} of {stats.total} train only their last of several "
            f"assistant turns; {warnings.get('prefix_labeling_masks_think', 0)} have the opening <think> of their "
            "answer masked, because the generation prompt holds it (the known bug generation blocks fix). Fix: "
            "--chat_template with a bundled template (`python chat_template.py list`; the Olmo 3 tokenizer notes "
            "train think data with olmo3-instruct-dev) or a .jinja file with {% generation %} blocks.")


def rlvr_verifier(row):
    """An RL row's verifier name(s): its `verifier` column, else open-instruct's `dataset`, else math."""
    return row.get("verifier") or row.get("dataset") or "math"


def rlvr_row_problem(row) -> str | None:
    """Why an RL row can never be trained on (None: it can): what tokenize_rlvr would drop it for, short
    of tokenizing it (a prompt that is only too long is not a problem of the row)."""
    if not isinstance(row, collections.abc.Mapping):
        return f"not a JSON object ({type(row).__name__})"
    if row.get("ground_truth") is None:
        return "no ground_truth"
    messages = row.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    try:
        messages, _ = _normalize(messages, row.get("tools"), from_arrow=True)
        validate_messages(messages)
    except DroppedRow as e:
        return f"messages: {e}"
    return None


# Names of the LM judge in RL rows (Dolci / open-instruct: "general-quality", "general-quality_ref").
JUDGE_VERIFIERS = ("llm_judge", "judge", "general_quality", "general_quality_ref")


def _is_judge(verifier) -> bool:
    """A row graded by the LM judge alone (one name, or a one-element list); a row that mixes the judge
    with other verifiers keeps its labels as they are."""
    names = _maybe_json_list(verifier)
    return len(names) == 1 and str(names[0]).strip().lower().replace("-", "_") in JUDGE_VERIFIERS


def _maybe_json_list(value) -> list:
    value = _decode_json_list(value)
    return list(value) if isinstance(value, (list, tuple)) else [value]


def tokenize_rlvr(dataset, tokenizer, max_prompt_length, chat_template=None, over_length_strategy="drop",
                  cache_dir=None, num_proc=None):
    """Rows with `messages` (prompt), `ground_truth`, `verifier` -> `prompt_input_ids` (generation prompt added).

    A trailing assistant message is removed (it is the reference answer, not part of the prompt).
    A row's `tools` (function schemas) are rendered into the prompt, and their names kept as `tool_names`:
    grpo.py runs such a row as a tool episode (ToolTurns below).
    Over-long prompts are dropped, or right-truncated with `over_length_strategy="truncate"`.
    Also kept: `dataset` (the row's `dataset` or `source` column, for per-source metrics). Dolci /
    open-instruct rows name the verifier in `dataset` ("math", "ifeval", "code", "general-quality",
    "general-quality_ref"; a string or a list parallel to `ground_truth`). A row graded by the LM judge
    gets `ground_truth` = JSON {"question": the last user message, "reference": its ground truth}.
    """
    template = _resolve_template(tokenizer, chat_template)
    if over_length_strategy not in ("drop", "truncate"):
        raise ValueError(f"RL prompts support over_length_strategy drop or truncate, not {over_length_strategy!r}")

    def row_fn(row, warnings):
        messages = row.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
                and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        messages, tools = _normalize(messages, row.get("tools"), from_arrow=True)
        if row.get("ground_truth") is None:
            raise DroppedRow("missing_ground_truth")
        ids = tokenize_prompt(tokenizer, messages, tools=tools, chat_template=chat_template)
        if len(ids) > max_prompt_length:
            if over_length_strategy == "drop":
                raise DroppedRow("over_length")
            ids = ids[:max_prompt_length]
        verifier = rlvr_verifier(row)
        ground_truth = row["ground_truth"]
        if _is_judge(verifier):  # an LM judge grades against the question: carry it with the reference
            question = next((m.get("content") for m in reversed(messages)
                             if isinstance(m, dict) and m.get("role") == "user"), "")
            wrap = lambda reference: json.dumps({"question": question, "reference": reference}, ensure_ascii=False)
            if isinstance(ground_truth, list):
                ground_truth = [wrap(g) for g in ground_truth]
            else:  # a reference given as a one-element JSON list is that element
                refs = _maybe_json_list(ground_truth)
                ground_truth = wrap(refs[0] if len(refs) == 1 else ground_truth)
        name = row.get("dataset") or row.get("source") or ""
        return {"prompt_input_ids": ids, "ground_truth": ground_truth, "verifier": verifier,
                "dataset": "+".join(map(str, name)) if isinstance(name, list) else str(name),
                "tool_names": tool_names(tools)}

    settings = {"max_prompt_length": max_prompt_length, "over_length_strategy": over_length_strategy,
                "chat_template_source": template}
    columns = ["prompt_input_ids", "ground_truth", "verifier", "dataset", "tool_names"]
    return _tokenize_dataset(dataset, tokenizer, "rlvr", row_fn, settings, columns, cache_dir, num_proc)


def tool_names(tools) -> list[str]:
    """The function names a row's tool schemas offer (OpenAI `{"function": {"name"}}` or flat `{"name"}`)."""
    names = []
    for t in tools or []:
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DroppedRow("bad_tools", "a tool schema without a name")
        names.append(fn["name"])
    return names


# ---------------------------------------------------------------------------------------------
# Tool episodes (grpo.py): the tokens between a sampled turn that called tools and the next turn
# ---------------------------------------------------------------------------------------------
class ToolTurns:
    """What the template puts around tool results, for a rollout that continues one token sequence.

    A sampled assistant turn that calls tools ends with the template's closing token of a non-final turn
    (`<|im_end|>` in Olmo 3's; `stop_token_ids` makes generation stop there as at eos). `results_ids` are
    the tokens that follow it: the tool results as `environment` turns and the next assistant header,
    rendered by the template for exactly these turns and tokenized on their own. Nothing sampled before is
    rendered or tokenized again (re-tokenizing a conversation between turns changes its tokens). Each
    piece starts at a special token or a newline after one, so its tokens are the ones a render of the
    whole conversation has there."""

    def __init__(self, tokenizer, chat_template=None):
        self.tokenizer, self.template = tokenizer, _resolve_template(tokenizer, chat_template)
        self.special = _special_tokens(tokenizer)
        _, closing = self._split(["x"])
        ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
        self.stop_token_ids = list(ids) if len(ids) == 1 else []  # a one-token closer, e.g. <|im_end|>

    def _split(self, results: list[str]) -> tuple[str, str]:
        """(the text after a tool-calling assistant turn up to the next header, that turn's closing token)."""
        mark = "\x00turn\x00"
        messages = [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": mark,
                     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
                    *({"role": "tool", "content": r} for r in results)]
        full, ranges = _render(self.template, messages, None, True, self.special)
        at = full.index(mark)
        blocks = [(a, b) for a, b in ranges if a <= at < b]
        if blocks:  # the generation block holds the sampled turn, its closing token included
            end = blocks[0][1]
            closing = next((s for s in _all_special_strings(self.tokenizer) if full[:end].endswith(s)), "")
        else:  # no blocks: the turn ends at the first special token after it
            end, closing = min(((full.find(s, at), s) for s in _all_special_strings(self.tokenizer)
                                if full.find(s, at) >= 0), default=(len(full), ""))
            end += len(closing)
        return full[end:], closing

    def results_ids(self, results: list[str]) -> list[int]:
        return list(self.tokenizer(self._split(results)[0], add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# The stage scripts' command line: open-instruct's flag names
# ---------------------------------------------------------------------------------------------
# Flags of the Olmo 3 launch scripts (open-instruct, and OLMo-core for SFT) that no stage script takes,
# with what to use instead. A `(values, message)` entry is taken silently when the flag asks for what the
# scripts do anyway (its values, lower-cased, all in `values`; "" in `values`: the flag given alone).
LAUNCHER_NOT_NEEDED = "a Beaker / oe-eval launcher setting; not needed here (evaluate output_dir with your own harness)"
COMMON_UNSUPPORTED_FLAGS = {
    "lr": "use --learning_rate (flag names are exact here; prefixes are not expanded)",
    "with_tracking": ({"false"}, "use --report_to wandb (with --wandb_project, --wandb_entity, --run_name)"),
    "deepspeed_stage": "not needed here: FSDP2 shards the model (sft.py / dpo.py: --use_fsdp, turned on by itself "
                       "when the model does not fit one GPU; grpo.py: automatic with several learners)",
    "zero_hpz_partition_size": "not needed here: FSDP2 replaces DeepSpeed ZeRO (see --deepspeed_stage)",
    "use_flash_attn": "not needed here: flash attention 2 is chosen by itself on GPU when the flash_attn package "
                      "is installed and a forward holds one row (sft.py / dpo.py: --per_device_train_batch_size 1; "
                      "grpo.py: always), else PyTorch sdpa; both keep packed conversations apart",
    "tokenizer_name": "not needed here: the tokenizer is loaded from --model_name_or_path",
    "tokenizer_name_or_path": "not needed here: the tokenizer is loaded from --model_name_or_path",
    "use_slow_tokenizer": ({"false"}, "only the fast tokenizer is used (trained-token labels need its offsets)"),
    "max_train_samples": "use a row count as the amount in --dataset_mixer_list (e.g. SOURCE 150000)",
    **{name: LAUNCHER_NOT_NEEDED for name in (
        "eval_workspace", "eval_priority", "oe_eval_tasks", "oe_eval_max_length", "oe_eval_gpu_multiplier",
        "oe_eval_beaker_image", "try_launch_beaker_eval_jobs_on_weka", "beaker_eval_freq", "budget", "workspace",
        "cluster", "launch.priority", "gs_model_name", "hf_entity", "hf_repo_id", "push_to_hub")},
}
# open-instruct `--chat_template_name` values that are not templates here. `olmo123` is not an
# open-instruct template either: open-instruct then takes the tokenizer's own, as omitting the flag does.
OPEN_INSTRUCT_TEMPLATE_NAMES = {
    "olmo123": None,
    "olmo": ("open-instruct's `olmo` template (OLMo identity, November 2024 cutoff) is not bundled: omit "
             "--chat_template to use the checkpoint's own (the released Olmo 3 checkpoints carry the template they "
             "were trained with), or give one of `python chat_template.py list` or a .jinja file"),
}


def parse_stage_args(args_class, unsupported: dict | None = None, argv: list[str] | None = None):
    """A stage script's command line -> its `Args` (transformers' HfArgumentParser).

    Flag names are exact (argparse's prefix matching is off: `--lr` is not `--learning_rate`).
    open-instruct's names of the same options are aliases in `Args` (`metadata["aliases"]`; --help
    shows both). Every other flag of the Olmo 3 launch scripts, from `unsupported` (the script's own)
    or COMMON_UNSUPPORTED_FLAGS, fails with a message naming what to use instead (SystemExit).
    """
    from transformers import HfArgumentParser

    table = {**COMMON_UNSUPPORTED_FLAGS, **(unsupported or {})}
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, i = [], 0
    while i < len(argv):
        token = argv[i]
        name, has_value, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        end = i + 1
        if name and not has_value:
            while end < len(argv) and not argv[end].startswith("--"):
                end += 1
        entry = table.get(name.replace("-", "_")) if name else None
        if entry is None:
            kept.append(token)
            i += 1
            continue
        values = [inline] if has_value else argv[i + 1:end]
        accepted, message = entry if isinstance(entry, tuple) else (set(), entry)
        lowered = [v.lower() for v in values] or [""]
        if all(v in accepted for v in lowered):
            i = end  # asks for what this script does anyway
            continue
        raise SystemExit(f"--{name} {' '.join(values)}".rstrip() + f": {message}")
    parser = HfArgumentParser(args_class, allow_abbrev=False)
    args, remaining = parser.parse_args_into_dataclasses(args=kept, return_remaining_strings=True)
    if remaining:
        raise SystemExit(f"unrecognized arguments: {' '.join(remaining)} (--help lists every flag)")
    template = getattr(args, "chat_template", None)
    if template in OPEN_INSTRUCT_TEMPLATE_NAMES:
        if OPEN_INSTRUCT_TEMPLATE_NAMES[template] is not None:
            message = OPEN_INSTRUCT_TEMPLATE_NAMES[template]
            raise SystemExit(f"--chat_template_name / --chat_template {template}: {message}")
        args.chat_template = None
    return args


# ---------------------------------------------------------------------------------------------
# Tokenizer tools (CLI): list, render, show, export, diff
# ---------------------------------------------------------------------------------------------
class BadInput(Exception):
    """Exit code 2."""


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "vocab.txt"]

EXAMPLES = {
    "basic_chat": {"messages": [
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
        {"role": "user", "content": "Show me how chat templating works."}]},
    "system_prompt": {"messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}]},
    "reasoning": {"messages": [
        {"role": "user", "content": "What is 7+5-3?"},
        {"role": "assistant", "content": "<think>7+5=12\n12-3=9</think>\n\\boxed{9}"}]},
    "reasoning_content": {"messages": [
        {"role": "user", "content": "What is 3*4?"},
        {"role": "assistant", "reasoning_content": "3*4=12", "content": "12"}]},
    "tool_use": {"tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        "messages": [
            {"role": "user", "content": "Weather in Boston?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Boston"}}}]},
            {"role": "tool", "content": "{\"temp_f\": 41}"},
            {"role": "assistant", "content": "It is 41°F in Boston."}]},
    "generation_prompt": {"messages": [{"role": "user", "content": "Say hi."}], "add_generation_prompt": True},
}


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot read {what} {path!r}: {e}") from None


def _read_conversations(path: str) -> dict:
    """FILE.json: a list of messages, an object with `messages` (+ `tools`), or a list of such objects."""
    data = _read_json(path, "messages file")
    if isinstance(data, dict) and "messages" in data:
        out = {"messages": data}
    elif isinstance(data, list) and data and all(isinstance(d, dict) and "messages" in d for d in data):
        out = {f"conversation_{i}": d for i, d in enumerate(data)}
    elif isinstance(data, list):
        out = {"messages": {"messages": data}}
    else:
        raise BadInput(f"{path}: expected a list of messages or an object with `messages`")
    for name, conversation in out.items():
        messages = conversation["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadInput(f"{path}: {name} is not a non-empty list of messages with string roles")
    return out


def _cli_template(name: str) -> str:
    try:
        return get_template(name)
    except (ValueError, OSError) as e:
        raise BadInput(str(e)) from None


def _dir_eos(name: str) -> str:
    config = os.path.join(name, "tokenizer_config.json") if os.path.isdir(name) else None
    if config and os.path.isfile(config):
        eos = _read_json(config, "tokenizer config").get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return DEFAULT_EOS


def _load_tokenizer(path: str):
    if not os.path.isdir(path):
        raise BadInput(f"not a directory: {path!r}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is bad input for the CLI
        raise BadInput(f"cannot load a tokenizer from {path!r}: {type(e).__name__}: {e}") from None


def cmd_list(args) -> int:
    sys.stdout.write("".join(name + "\n" for name in ALL_TEMPLATES))
    return 0


def cmd_render(args) -> int:
    template = _cli_template(args.template)
    data = _read_conversations(args.messages)
    if len(data) != 1:
        raise BadInput("render takes one conversation")
    conversation = next(iter(data.values()))
    tools = _read_json(args.tools, "tools file") if args.tools else conversation.get("tools")
    try:
        messages, tools = _normalize(conversation["messages"], tools)
        text = _render(template, messages, tools, args.add_generation_prompt,
                       {"eos_token": _dir_eos(args.template), "bos_token": DEFAULT_EOS})[0]
    except DroppedRow as e:
        raise BadInput(f"cannot render: {e}") from None
    except Exception as e:  # noqa: BLE001 - a template error on this input
        raise BadInput(f"cannot render: {type(e).__name__}: {e}") from None
    sys.stdout.buffer.write(text.encode("utf-8"))
    sys.stdout.flush()
    return 0


def format_labels(text, offsets, mask, color=False) -> str:
    """Token pieces of `text`, trained ones bracketed (or coloured), for `show`."""
    pieces = []
    bounds = offsets + [len(text)]
    for i, m in enumerate(mask):
        piece = text[bounds[i]:max(bounds[i + 1], bounds[i])]
        if m:
            piece = f"\x1b[1;32m{piece}\x1b[0m" if color else f"[{piece}]"
        pieces.append(piece)
    return "".join(pieces)


def cmd_show(args) -> int:
    template = _cli_template(args.template)
    tokenizer = _load_tokenizer(args.tokenizer)
    color = {"always": True, "never": False}.get(args.color, sys.stdout.isatty())
    status = 0
    for name, conversation in _read_conversations(args.messages).items():
        warnings = collections.Counter()
        try:
            validate_messages(conversation["messages"])
            messages, tools = _normalize(conversation["messages"], conversation.get("tools"))
            if messages[-1]["role"] != "assistant":
                raise DroppedRow("no_final_assistant")
            out = _label_conversation(tokenizer, messages, tools, template, args.only_last_turn, warnings)
        except DroppedRow as e:
            sys.stderr.write(f"{name}: dropped: {e}\n")
            status = 2
            continue
        sys.stdout.write(format_labels(out["text"], out["offsets"], out["mask"], color) + "\n")
        sys.stdout.write(f"-- {name}: {len(out['mask'])} tokens, {sum(out['mask'])} trained"
                         + (f", warnings: {dict(warnings)}" if warnings else "") + "\n")
    return status


def export_template(template_name: str, tokenizer_dir: str, out_dir: str) -> str:
    """Copy the tokenizer files of `tokenizer_dir` to `out_dir` with the template in both places."""
    template = _cli_template(template_name)
    if not os.path.isdir(tokenizer_dir):
        raise BadInput(f"not a directory: {tokenizer_dir!r}")
    config_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    config = _read_json(config_path, "tokenizer config") if os.path.isfile(config_path) else {}
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)  # fail before writing anything
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"template does not compile: {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src) and name != "tokenizer_config.json" and os.path.abspath(src) != os.path.abspath(
                os.path.join(out_dir, name)):
            shutil.copyfile(src, os.path.join(out_dir, name))
    config["chat_template"] = template
    for name, text in (("tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n"),
                       ("chat_template.jinja", template)):
        tmp = os.path.join(out_dir, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))
    # an older processor-style file would shadow nothing, but confuse
    stale = os.path.join(out_dir, "chat_template.json")
    if os.path.isfile(stale):
        os.remove(stale)
    jinja, in_config = _dir_templates(out_dir)
    assert jinja == in_config == template, "exported templates are out of sync"
    return out_dir


def cmd_export(args) -> int:
    export_template(args.name, args.tokenizer, args.out)
    sys.stdout.write(f"wrote {args.out} (chat_template.jinja and tokenizer_config.json in sync)\n")
    return 0


def prettify_jinja(template: str) -> list[str]:
    """One Jinja statement or expression per line, indented by nesting (for readable diffs)."""
    tokens = re.split(r"(\{%-?.*?-?%\}|\{\{-?.*?-?\}\}|\{#.*?#\})", template, flags=re.S)
    lines, indent = [], 0
    for token in tokens:
        if not token.strip():
            continue
        if re.match(r"\{%-?\s*(endif|endfor|endgeneration|endmacro|else|elif)\b", token):
            indent = max(indent - 1, 0)
        lines.append("  " * indent + token.strip("\n") if token.startswith("{") else "  " * indent + repr(token))
        if re.match(r"\{%-?\s*(if|for|generation|macro|else|elif)\b", token):
            indent += 1
    return lines


def _unified(a_lines, b_lines, label_a, label_b) -> list[str]:
    return list(difflib.unified_diff(a_lines, b_lines, fromfile=label_a, tofile=label_b, lineterm=""))


def _tokenizer_dir(name: str) -> str:
    """A tokenizer directory, or a Hub id as `from_pretrained` takes it: its snapshot in the local Hugging Face
    cache (offline), else its tokenizer files (never weights) downloaded into that cache when online."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name) or not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise BadInput(f"not a tokenizer directory or a Hub id: {name!r}")
    from huggingface_hub import snapshot_download

    files = TOKENIZER_FILES + ["chat_template.jinja", "chat_template.json", "config.json"]
    try:
        return snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the local cache: try the Hub below
        pass
    try:
        return snapshot_download(name, allow_patterns=files)
    except Exception as e:  # noqa: BLE001 - offline, unknown, gated: bad input for the CLI
        raise BadInput(f"{name!r} is not a local directory, not in the Hugging Face cache, and could not be "
                       f"downloaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _tokenizer_facts(name: str) -> dict:
    path = _tokenizer_dir(name)
    config_path = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_path, "tokenizer config") if os.path.isfile(config_path) else {}
    if not isinstance(config, dict):
        raise BadInput(f"{config_path}: not a JSON object")
    try:
        jinja, in_config = _dir_templates(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read the templates in {path!r}: {e}") from None
    tok_json_path = os.path.join(path, "tokenizer.json")
    tok_json = _read_json(tok_json_path, "tokenizer.json") if os.path.isfile(tok_json_path) else {}
    tokenizer = _load_tokenizer(path)
    added = sorted((int(i), str(t), bool(getattr(t, "special", False)))
                   for i, t in tokenizer.added_tokens_decoder.items())
    return {
        "path": name if name == path else f"{name} ({path})", "config": config, "jinja": jinja,
        "config_template": in_config,
        "template": jinja if jinja is not None else in_config, "tokenizer": tokenizer,
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()}, "added": added,
        "vocab": tokenizer.get_vocab(), "len": len(tokenizer),
        "backend": {k: tok_json.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder",
                                                 "truncation", "padding")} if isinstance(tok_json, dict) else {},
        "merges": (tok_json.get("model") or {}).get("merges") if isinstance(tok_json, dict) else None,
    }


def _render_example(facts, conversation) -> tuple[str, list[int] | None]:
    tokenizer = facts["tokenizer"]
    if not facts["template"]:
        return "<no chat template>", None
    try:
        messages, tools = _normalize(conversation["messages"], conversation.get("tools"))
        text = _render(facts["template"], messages, tools, bool(conversation.get("add_generation_prompt")),
                       _special_tokens(tokenizer))[0]
    except Exception as e:  # noqa: BLE001 - a template that fails on an example is a finding, not a crash
        return f"<render error: {type(e).__name__}: {e}>", None
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def diff_tokenizers(dir_a: str, dir_b: str, conversations: dict | None = None, out=None) -> int:
    """Print the differences between two tokenizer directories; return 0 (same) or 1 (different)."""
    out = out or sys.stdout
    a, b = _tokenizer_facts(dir_a), _tokenizer_facts(dir_b)
    differs = []

    def section(title):
        out.write(f"== {title} ==\n")

    section("template files (chat_template.jinja vs tokenizer_config.json)")
    for label, f in (("A", a), ("B", b)):
        if f["jinja"] is not None and f["config_template"] is not None and f["jinja"] != f["config_template"]:
            out.write(f"{label} {f['path']}: DISAGREE: transformers uses chat_template.jinja\n")
            for line in _unified(prettify_jinja(f["config_template"]), prettify_jinja(f["jinja"]),
                                 "tokenizer_config.json", "chat_template.jinja"):
                out.write(f"    {line}\n")
            differs.append(f"template_files_{label}")
        else:
            where = [n for n, t in (("chat_template.jinja", f["jinja"]),
                                    ("tokenizer_config.json", f["config_template"]))
                     if t is not None]
            out.write(f"{label} {f['path']}: "
                      f"{'in sync' if len(where) == 2 else ('only ' + where[0]) if where else 'no template'}\n")

    section("effective chat template")
    if a["template"] == b["template"]:
        out.write("identical\n")
    else:
        differs.append("chat_template")
        for line in _unified(prettify_jinja(a["template"] or ""), prettify_jinja(b["template"] or ""), "A", "B"):
            out.write(f"    {line}\n")

    section("special and added tokens")
    lines = []
    for key in sorted(set(a["special"]) | set(b["special"])):
        if a["special"].get(key) != b["special"].get(key):
            lines.append(f"{key}: A={a['special'].get(key)!r} B={b['special'].get(key)!r}")
    added_a, added_b = set(a["added"]), set(b["added"])
    lines += [f"added token only in A: id={i} {t!r} special={s}" for i, t, s in sorted(added_a - added_b)]
    lines += [f"added token only in B: id={i} {t!r} special={s}" for i, t, s in sorted(added_b - added_a)]
    out.write("".join(line + "\n" for line in lines) if lines else "identical\n")
    if lines:
        differs.append("special_tokens")

    section("vocabulary")
    lines = []
    if a["len"] != b["len"]:
        lines.append(f"size: A={a['len']} B={b['len']}")
    changed = {t for t in set(a["vocab"]) | set(b["vocab"]) if a["vocab"].get(t) != b["vocab"].get(t)}
    if changed:
        lines.append(f"{len(changed)} token->id entries differ, e.g. " + ", ".join(
            f"{t!r}: A={a['vocab'].get(t)} B={b['vocab'].get(t)}" for t in sorted(changed)[:5]))
    if a["merges"] != b["merges"]:
        lines.append("BPE merges differ")
    out.write("".join(line + "\n" for line in lines) if lines else f"identical (size {a['len']})\n")
    if lines:
        differs.append("vocabulary")

    section("other config fields")
    skip = {"chat_template", "added_tokens_decoder"}
    ca = {k: v for k, v in a["config"].items() if k not in skip}
    cb = {k: v for k, v in b["config"].items() if k not in skip}
    ca.update({f"tokenizer.json:{k}": v for k, v in a["backend"].items()})
    cb.update({f"tokenizer.json:{k}": v for k, v in b["backend"].items()})
    diff = _unified(json.dumps(ca, indent=2, sort_keys=True, default=str).splitlines(),
                    json.dumps(cb, indent=2, sort_keys=True, default=str).splitlines(), "A", "B")
    out.write("".join(f"    {line}\n" for line in diff) if diff else "identical\n")
    if diff:
        differs.append("config")

    section("rendered examples")
    any_diff = False
    for name, conversation in (conversations or EXAMPLES).items():
        text_a, ids_a = _render_example(a, conversation)
        text_b, ids_b = _render_example(b, conversation)
        if text_a == text_b and ids_a == ids_b:
            out.write(f"{name}: identical\n")
            continue
        any_diff = True
        if text_a == text_b:
            out.write(f"{name}: same text, different token ids\n    A: {ids_a}\n    B: {ids_b}\n")
        else:
            out.write(f"{name}: DIFFERENT\n")
            for line in _unified(text_a.splitlines(keepends=False), text_b.splitlines(keepends=False), "A", "B"):
                out.write(f"    {line}\n")
    if any_diff:
        differs.append("rendered_examples")

    out.write(f"Result: {'DIFFERENT (' + ', '.join(differs) + ')' if differs else 'IDENTICAL'}\n")
    return 1 if differs else 0


def cmd_diff(args) -> int:
    conversations = _read_conversations(args.messages) if args.messages else None
    return diff_tokenizers(args.a, args.b, conversations)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the template names")
    p = sub.add_parser("render", help="write the rendered text to stdout exactly")
    p.add_argument("--template", required=True, help="template name, .jinja file or tokenizer directory")
    p.add_argument("--messages", required=True, help="JSON file: a list of messages or {messages, tools}")
    p.add_argument("--tools", default=None, help="JSON file with a list of tool schemas")
    p.add_argument("--add-generation-prompt", action="store_true")
    p = sub.add_parser("show", help="print tokens with the trained ones bracketed / coloured")
    p.add_argument("--template", required=True)
    p.add_argument("--tokenizer", required=True, help="tokenizer directory")
    p.add_argument("--messages", required=True)
    p.add_argument("--only-last-turn", action="store_true",
                   help="label the final assistant turn only (preference data)")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    p = sub.add_parser("export", help="write a tokenizer directory with the template in both files")
    p.add_argument("name", help="template name, .jinja file or tokenizer directory")
    p.add_argument("--tokenizer", required=True, help="source tokenizer directory")
    p.add_argument("--out", required=True, help="output directory")
    p = sub.add_parser("diff", help="compare two tokenizers, directories or Hub ids (exit 0 same, 1 different, "
                                    "2 bad input)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--messages", default=None,
                   help="JSON file with a conversation to render (default: built-in examples)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    try:
        return {"list": cmd_list, "render": cmd_render, "show": cmd_show, "export": cmd_export,
                "diff": cmd_diff}[args.command](args)
    except BadInput as e:
        sys.stderr.write(f"error: {e}\n")
        return 2


if __name__ == "__main__":
    datasets.disable_progress_bars()
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
