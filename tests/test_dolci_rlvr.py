"""RL rows in the Dolci / open-instruct format load, tokenize and score for every verifier of the Olmo 3 RL mix.

The format: `messages` (the prompt), `ground_truth`, and `dataset` naming the verifier, as strings or as
one-element lists (allenai/Dolci-Think-RL-7B has lists; its names: "math", "ifeval", "code", "code_stdio",
"general-quality", "general-quality_ref"). The LM judge is a
local stand-in for an OpenAI-compatible server that answers {"score": 7} and records what it was asked.
"""

import http.server
import json
import threading

import pytest
from transformers import AutoTokenizer

import chat_template
import verifiers

GOOD = {
    "math": "<think>6*7=42</think>\nSo the answer is \\boxed{42}.",
    "ifeval": "all of this answer is in lowercase letters.",
    "code": "```python\ndef add(a, b):\n    return a + b\n```",
    "code_stdio": "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
}
BAD = {
    "math": "<think>6*7=48</think>\nSo the answer is \\boxed{48}.",
    "ifeval": "This Answer Has Capitals.",
    "code": "```python\ndef add(a, b):\n    return a - b\n```",
    "code_stdio": "```python\na, b = map(int, input().split())\nprint(a - b)\n```",
}
ROWS = [
    {"messages": [{"role": "user", "content": "What is 6*7? Put the answer in \\boxed{}."}],
     "ground_truth": "42", "dataset": "math"},
    {"messages": [{"role": "user", "content": "Describe the sea. Your entire response must be in lowercase."}],
     "ground_truth": json.dumps({"instruction_id": ["change_case:english_lowercase"], "kwargs": [{}]}),
     "dataset": "ifeval"},
    {"messages": [{"role": "user", "content": "Write add(a, b) in Python."}],
     "ground_truth": json.dumps(["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]), "dataset": "code"},
    {"messages": [{"role": "user", "content": "Read two integers and print their sum."}],
     "ground_truth": json.dumps([{"input": "2 3\n", "output": "5\n"}, {"input": "-1 1\n", "output": "0\n"}]),
     "dataset": "code_stdio"},
    {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Write a haiku about rain."}],
     "ground_truth": "", "dataset": "general-quality"},
    {"messages": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."}],  # a reference answer in messages is not prompt
     "ground_truth": "Paris", "dataset": "general-quality_ref"},
]


class _Judge(http.server.BaseHTTPRequestHandler):
    prompts: list = []

    def log_message(self, *args):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "judge", "object": "model", "created": 0, "owned_by": "t"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).prompts.append(req["messages"][0]["content"])
        self._send({"id": "x", "object": "chat.completion", "created": 0, "model": req["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": '{"score": 7}'}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture()
def judge_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Judge.prompts = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _write(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _load_rows(toy_model_dir, tmp_path, as_lists):
    """The rows as a trainer gets them (loaded, tokenized), by verifier name."""
    rows = [{**r, "ground_truth": [r["ground_truth"]], "dataset": [r["dataset"]]} if as_lists else r for r in ROWS]
    data = chat_template.load_mixture([_write(tmp_path / "rl.jsonl", rows), "1.0"], split=["train"])
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    out, drops = chat_template.tokenize_rlvr(data, tok, 512, cache_dir="")
    assert len(out) == len(ROWS) and sum(drops.values()) == 0, dict(drops)
    by_name = {}
    for row in out:
        name = row["verifier"][0] if isinstance(row["verifier"], list) else row["verifier"]
        by_name[name] = row
        prompt = tok.decode(row["prompt_input_ids"])
        assert prompt.endswith("<|im_start|>assistant\n") and "Paris." not in prompt
    assert sorted(by_name) == sorted(r["dataset"] for r in ROWS)
    return by_name


def _good_and_bad_score(row, name):
    good = verifiers.verify_row(row["verifier"], GOOD[name], row["ground_truth"])
    bad = verifiers.verify_row(row["verifier"], BAD[name], row["ground_truth"])
    assert (good.score, good.error, bad.score, bad.error) == (1.0, None, 0.0, None), (name, good, bad)
    assert good.verifier == name


@pytest.mark.parametrize("as_lists", [False, True], ids=["strings", "one_element_lists"])
def test_dolci_rows_load_and_score_for_every_verifier(toy_model_dir, tmp_path, judge_url, as_lists):
    by_name = _load_rows(toy_model_dir, tmp_path, as_lists)
    for name in ("math", "ifeval"):
        _good_and_bad_score(by_name[name], name)
    for name, question, reference in (("general-quality", "Write a haiku about rain.", ""),
                                      ("general-quality_ref", "What is the capital of France?", "Paris")):
        row = by_name[name]
        result = verifiers.verify_row(row["verifier"], "<think>hm</think>Soft rain on the roof.", row["ground_truth"],
                                      judge_base_url=judge_url)
        assert (result.score, result.error, result.verifier) == (0.7, None, "llm_judge"), result
        # the judge was asked about the prompt's question, against the row's reference
        assert f"Question: {question}\nReference: {reference}\nResponse: Soft rain on the roof." in _Judge.prompts[-1]


def test_judge_rows_mixed_with_other_verifiers_keep_their_labels():
    assert chat_template._is_judge("general-quality_ref") and chat_template._is_judge(["general-quality"])
    assert chat_template._is_judge('["llm_judge"]') and not chat_template._is_judge(["math", "general-quality"])
    assert not chat_template._is_judge("math") and not chat_template._is_judge("ifeval")


# Dolci's own ifeval label: a string holding a Python literal (single quotes, None), not JSON.
DOLCI_IFEVAL = ("[{'instruction_id': ['punctuation:no_comma', 'detectable_format:number_highlighted_sections'], "
                "'kwargs': [None, {'num_highlights': 2}]}]")


@pytest.mark.parametrize("as_lists", [False, True], ids=["strings", "one_element_lists"])
def test_dolci_ifeval_literal_label_loads_and_scores_the_fraction(toy_model_dir, tmp_path, as_lists):
    import grpo

    prompt = [{"role": "user", "content": "Describe the sea with two *highlighted* parts and no commas."}]
    row = {"messages": prompt, "ground_truth": [DOLCI_IFEVAL] if as_lists else DOLCI_IFEVAL,
           "dataset": ["ifeval"] if as_lists else "ifeval"}
    data = chat_template.load_mixture([_write(tmp_path / "rl.jsonl", [row]), "1.0"], split=["train"])
    grpo.check_rlvr_rows(data, "--dataset_mixer_list")  # the trainer's own check: this label can be scored
    out, drops = chat_template.tokenize_rlvr(data, AutoTokenizer.from_pretrained(toy_model_dir), 512, cache_dir="")
    assert len(out) == 1 and sum(drops.values()) == 0, dict(drops)
    verifier, label = out[0]["verifier"], out[0]["ground_truth"]
    for response, score in (("The *calm* sea and the *deep* sea.", 1.0),
                            ("The *calm* sea, and the *deep* sea.", 0.5),  # a comma: one of two holds
                            ("The *calm* sea and the deep sea.", 0.5),  # one highlight: one of two holds
                            ("The calm sea, and the deep sea.", 0.0)):
        result = verifiers.verify_row(verifier, "<think>a, b</think>" + response, label)
        assert (result.score, result.error, result.verifier) == (score, None, "ifeval"), (response, result)


@pytest.mark.usefixtures("sandbox")  # skipped where no isolation for model-written code exists here
@pytest.mark.parametrize("as_lists", [False, True], ids=["strings", "one_element_lists"])
def test_dolci_code_rows_load_and_score(toy_model_dir, tmp_path, as_lists):
    by_name = _load_rows(toy_model_dir, tmp_path, as_lists)
    for name in ("code", "code_stdio"):
        _good_and_bad_score(by_name[name], name)
