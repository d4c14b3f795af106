"""Olmo 3 chat templates, trained-token labels and dataset tokenization (shared by sft.py, dpo.py, grpo.py).

CORE VERSION (lead engineer): templates, `tokenize_messages`, dataset mixing and the three dataset
tokenizers. Hardening, external-template labeling, caching and the CLI are being added.
"""

from __future__ import annotations

import collections
import json
import logging
import os

import datasets

logger = logging.getLogger("chat_template")

# ---------------------------------------------------------------------------------------------
# Templates. One Jinja source, four variants (seed 002: dev vs release, instruct vs think).
# ---------------------------------------------------------------------------------------------
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

_DEFAULT_SYSTEM_DEV = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n<functions>' + (tools | tojson) + '</functions><|im_end|>\\n' -}}"
    "{%- endif -%}"
)
_DEFAULT_SYSTEM_RELEASE = (
    "{{- '<|im_start|>system\\n" + OLMO_IDENTITY + " ' -}}"
    "{%- if tools -%}"
    "{{- '" + FUNCTIONS_PREAMBLE + "<functions>' + (tools | tojson) + '</functions>' -}}"
    "{%- else -%}"
    "{{- '" + NO_FUNCTIONS + "' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
)

_TEMPLATE = (
    "{%- set ns = namespace(has_system=false) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.has_system = true -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if not ns.has_system -%}__DEFAULT_SYSTEM__{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + message['content'] -}}"
    "{%- if tools -%}{{- '<functions>' + (tools | tojson) + '</functions>' -}}"
    "{%- elif message.get('functions') is not none -%}{{- ' <functions>' + message['functions'] + '</functions>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    # Seed 002: the block starts after the header and before any generated <think>; it covers
    # reasoning, answer, tool calls and the closing token. Inter-turn whitespace stays outside.
    "{%- generation -%}"
    "{%- if message.get('reasoning_content') is not none -%}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' -}}"
    "{%- endif -%}"
    "{%- if message.get('content') is not none -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message.get('function_calls') is not none -%}"
    "{{- '<function_calls>' + message['function_calls'] + '</function_calls>' -}}"
    "{%- elif message.get('tool_calls') -%}"
    "{{- '<function_calls>' -}}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- set call = tool_call['function'] if tool_call.get('function') is not none else tool_call -%}"
    "{%- if call['arguments'] is mapping -%}"
    "{%- set args = namespace(items=[]) -%}"
    "{%- for key, value in call['arguments'].items() -%}"
    "{%- set args.items = args.items + [key ~ '=' ~ (value | tojson)] -%}"
    "{%- endfor -%}"
    "{{- call['name'] + '(' + (args.items | join(', ')) + ')' -}}"
    "{%- else -%}"
    "{{- call['name'] + '(' + (call['arguments'] | string) + ')' -}}"
    "{%- endif -%}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '</function_calls>' -}}"
    "{%- endif -%}"
    "{%- if loop.last -%}{{- eos_token -}}{%- else -%}{{- '<|im_end|>' -}}{%- endif -%}"
    "{%- endgeneration -%}"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}"
    "{%- elif message['role'] == 'tool' or message['role'] == 'environment' -%}"
    "{{- '<|im_start|>environment\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n__THINK__' -}}{%- endif -%}"
)


def _build(release: bool, think: bool) -> str:
    default_system = _DEFAULT_SYSTEM_RELEASE if release else _DEFAULT_SYSTEM_DEV
    return _TEMPLATE.replace("__DEFAULT_SYSTEM__", default_system).replace("__THINK__", "<think>" if think else "")


TEMPLATES: dict[str, str] = {
    "olmo3-instruct-dev": _build(release=False, think=False),
    "olmo3-instruct-release": _build(release=True, think=False),
    "olmo3-think-dev": _build(release=False, think=True),
    "olmo3-think-release": _build(release=True, think=True),
}


def get_template(name_or_path: str) -> str:
    """A template by name, from a `.jinja` file, or from a tokenizer directory (the `.jinja` file wins)."""
    if name_or_path in TEMPLATES:
        return TEMPLATES[name_or_path]
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            return f.read()
    jinja = os.path.join(name_or_path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    config = os.path.join(name_or_path, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            template = json.load(f).get("chat_template")
        if template:
            return template
    raise ValueError(f"unknown template {name_or_path!r}: not one of {sorted(TEMPLATES)}, a .jinja file or a tokenizer dir")


# ---------------------------------------------------------------------------------------------
# Messages -> input_ids + labels
# ---------------------------------------------------------------------------------------------
class DroppedRow(Exception):
    """A row that cannot be trained on; `reason` is the counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise DroppedRow("empty_conversation")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool", "environment"):
            raise DroppedRow("bad_role")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise DroppedRow("non_string_content")
        if content is None and message["role"] != "assistant":
            raise DroppedRow("missing_content")


def tokenize_messages(tokenizer, messages, tools=None, chat_template=None, max_length=None,
                      over_length_strategy="drop", only_last_turn=False) -> dict:
    """Render `messages` and return `input_ids` and `labels` (-100 where a token is not trained).

    Labels come from the template's `{% generation %}` blocks. `only_last_turn` trains the final
    assistant turn only (preference data). Raises `DroppedRow` for rows that cannot be used.
    """
    validate_messages(messages)
    if messages[-1]["role"] != "assistant":
        raise DroppedRow("no_final_assistant")
    template = get_template(chat_template) if chat_template else None
    out = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )
    input_ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask):
        raise DroppedRow("no_generation_block")
    if only_last_turn:
        # The last trained span is the final assistant message (one block per assistant message).
        end = len(mask)
        while end > 0 and not mask[end - 1]:
            end -= 1
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        mask = [1 if start <= i < end else 0 for i in range(len(mask))]
    labels = [t if m else -100 for t, m in zip(input_ids, mask)]
    if max_length is not None and len(input_ids) > max_length:
        if over_length_strategy == "drop":
            raise DroppedRow("over_length")
        elif over_length_strategy == "truncate":
            input_ids, labels = input_ids[:max_length], labels[:max_length]
        else:
            raise ValueError(f"unknown over_length_strategy {over_length_strategy!r}")
    return {"input_ids": input_ids, "labels": labels}


def tokenize_prompt(tokenizer, messages, tools=None, chat_template=None) -> list[int]:
    """Prompt tokens with the generation prompt appended (RLVR, evaluation)."""
    validate_messages(messages)
    template = get_template(chat_template) if chat_template else None
    return list(tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=True, add_generation_prompt=True,
        return_dict=True,
    )["input_ids"])


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------
def _load_source(name: str, split: str) -> datasets.Dataset:
    if os.path.isfile(name):
        ext = name.rsplit(".", 1)[-1]
        kind = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(ext)
        if kind is None:
            raise ValueError(f"unsupported data file {name!r} (use .jsonl, .json or .parquet)")
        return datasets.load_dataset(kind, data_files=name, split="train")
    return datasets.load_dataset(name, split=split)


def load_mixture(mixer_list: list[str], split: str = "train", seed: int = 0) -> datasets.Dataset:
    """`["a.jsonl", "1.0", "org/b", "500"]` -> one shuffled dataset: a fraction (<= 1) or a row count per source."""
    if len(mixer_list) % 2:
        raise ValueError(f"dataset mixer list needs (source, fraction_or_count) pairs, got {mixer_list}")
    parts = []
    for name, amount in zip(mixer_list[0::2], mixer_list[1::2]):
        ds = _load_source(name, split)
        amount = float(amount)
        n = int(round(amount * len(ds))) if amount <= 1.0 else int(amount)
        if n > len(ds):
            raise ValueError(f"{name}: asked for {n} rows, it has {len(ds)}")
        ds = ds.shuffle(seed=seed).select(range(n))
        ds = ds.add_column("source", [name] * len(ds))
        parts.append(ds)
    return datasets.concatenate_datasets(parts).shuffle(seed=seed)


def _tokenize_rows(dataset, fn) -> tuple[datasets.Dataset, collections.Counter]:
    rows, drops = [], collections.Counter()
    for row in dataset:
        try:
            rows.append(fn(row))
        except DroppedRow as e:
            drops[e.reason] += 1
    if drops:
        logger.warning("dropped %d of %d rows: %s", sum(drops.values()), len(dataset), dict(drops))
    return datasets.Dataset.from_list(rows), drops


def tokenize_sft(dataset, tokenizer, max_length, over_length_strategy="drop", chat_template=None):
    """Rows with `messages` -> `input_ids`, `labels`."""
    return _tokenize_rows(dataset, lambda row: tokenize_messages(
        tokenizer, row["messages"], tools=row.get("tools"), chat_template=chat_template,
        max_length=max_length, over_length_strategy=over_length_strategy))


def tokenize_preference(dataset, tokenizer, max_length, over_length_strategy="drop", chat_template=None):
    """Rows with `chosen` / `rejected` message lists -> token ids and labels on the final assistant turn."""
    def fn(row):
        out = {}
        for key in ("chosen", "rejected"):
            t = tokenize_messages(tokenizer, row[key], chat_template=chat_template, max_length=max_length,
                                  over_length_strategy=over_length_strategy, only_last_turn=True)
            out[f"{key}_input_ids"], out[f"{key}_labels"] = t["input_ids"], t["labels"]
        return out
    return _tokenize_rows(dataset, fn)


def tokenize_rlvr(dataset, tokenizer, max_prompt_length, chat_template=None):
    """Rows with `messages` (prompt), `ground_truth`, `verifier` -> `prompt_input_ids` + the labels."""
    def fn(row):
        messages = row["messages"]
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        ids = tokenize_prompt(tokenizer, messages, chat_template=chat_template)
        if len(ids) > max_prompt_length:
            raise DroppedRow("over_length")
        if row.get("ground_truth") is None:
            raise DroppedRow("missing_ground_truth")
        return {"prompt_input_ids": ids, "ground_truth": row["ground_truth"],
                "verifier": row.get("verifier") or row.get("dataset") or "math"}
    return _tokenize_rows(dataset, fn)
