"""Rewards for RL with verifiable rewards: response text -> score in [0, 1].

Model output is hostile input: it loops, lies, and tries to exit early so that tests look passed.
Every verifier here returns a score in [0, 1] in bounded time or a counted error; none may take
down or stall the run that called it. The same functions serve evaluation and reward.

Verifiers (`VERIFIERS`, name -> plain function `(response, label) -> score or VerifierResult`)

  math            final answer = last \\boxed{} / \\fbox{}, else "the answer is X" (Minerva's
                  "Final Answer: The final answer is X. I hope it is correct."), else the last
                  number. Equivalence by math-verify (fractions, decimals, LaTeX, sets, intervals,
                  tuples, matrices, expressions). Label: the answer ("42", "\\frac{1}{2}",
                  "$x^2$", "\\boxed{3}"), or a list of acceptable answers.
  gsm8k           last number of the response, thousands separators removed, numeric equality.
                  Label: a number ("1234", "#### 1,234").
  ifeval          the 25 IFEval instruction types (Zhou et al. 2023), strict mode. Label in the
                  dataset's form {"instruction_id_list": [...], "kwargs": [{...}, ...]} (also
                  "instruction_id", or a one-element list of such dicts, as Olmo's RLVR data has
                  it). Score = fraction of instructions followed.
  code            the last fenced python block, run against a JSON list of assert statements.
  code_stdio      the same program run once per test of a JSON list of {"input", "output"}
                  (also {"inputs": [...], "outputs": [...]}); output compared token by token.
                  Score = fraction of tests passed (see "Sandbox" below).
  string_match    normalized exact match (SQuAD normalization), max over labels.
  string_f1       token F1 after the same normalization, max over labels. For both, the answer is
                  the last <answer>...</answer> if there is one, else the whole response.
  llm_judge       an OpenAI-compatible chat endpoint grades the response against a reference;
                  label: the reference, or {"question": ..., "reference": ...}. Asks for JSON
                  {"score": 0..10} with structured output (falls back to parsing the plain reply
                  where the server refuses `response_format`), retries with backoff, score / 10.
                  Config: kwargs or env `judge_base_url` / JUDGE_BASE_URL, `judge_model` /
                  JUDGE_MODEL (default: the server's first model), `judge_api_key` / JUDGE_API_KEY.
                  A weak judge under a JSON grammar may pad with whitespace: serve it with
                  `--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'`.
  max_length      length penalty as in open-instruct: 1 - |len - label| / scale, clamped to
                  [0, 1]; `up_to_max_length`: 1 up to the label, then falling linearly. Length in
                  words (whitespace), or in tokens when `num_tokens=` is passed.

Every response first loses its <think>...</think> section (an unclosed <think> means the answer
never came). A row may name several verifiers with parallel labels (`verify_row`): score = mean,
error if any part errored.

Errors. `VerifierResult.error` is None or a short reason. A wrong answer is score 0, error None.
Errors are never a silent 0: the trainer counts them (`VerifierPool.error_counts`) and drops the
sample. Reasons: "no_answer" and "syntax_error" (nothing gradable came out: `ANSWER_ERRORS`, which a
trainer may prefer to score 0 rather than drop), "timeout", "worker_died", "bad_label",
"unknown_verifier", "judge_unavailable", "judge_bad_output", "judge_bad_request",
"sandbox_error", "exception:<Type>".

Timeouts. SIGALRM only works in the main thread (DESIGN.md sec 6), and math-verify's own timeout is
SIGALRM-based and, worse, returns False on timeout. So: `verify()` uses math-verify's timeout only
when it runs in the main thread with no alarm of the caller's pending, and reports it as "timeout";
the hard guarantee is `VerifierPool`, a process pool whose workers are killed and replaced when a
row runs past `timeout` (C-level work such as a huge sympy power cannot be interrupted any other way).

Sandbox (code, code_stdio). Each run is a fresh process in a fresh temporary directory with
RLIMIT_CPU / AS / NPROC / FSIZE / NOFILE and a wall-clock limit; its process group is killed on
timeout. When root with util-linux (`unshare`, `setpriv`, `prlimit`) it also runs in new network,
pid and mount namespaces (no network; the whole process tree dies with it; private /tmp and
/dev/shm) as an unprivileged uid (RLIMIT_NPROC does not bind root, so this is what bounds a fork
bomb). Elsewhere it degrades to rlimits only and says so once. Tests are counted passed only by a
random per-run sentinel printed after each assert, so an early exit cannot pass them. Not a defence
against: a program that reads the harness's sentinel from its own process and forges it, or an
object whose __eq__ always returns True.

Usage

  python verifiers.py --verifier math --label 42 <<< 'so \\boxed{42}'
  echo 'The answer is 1,234.' | python verifiers.py --verifier gsm8k --label 1234
  python verifiers.py --verifier code --label '["assert f(2) == 4"]' < response.md
  python verifiers.py --verifier llm_judge --label 'Paris' --judge_base_url http://localhost:8000/v1 < r.txt

  from verifiers import verify, VerifierPool
  verify("math", "<think>12+30=42</think>\\nThe answer is \\boxed{42}.", "42").score   # 1.0
  with VerifierPool(num_workers=8, timeout=10) as pool:
      results = await pool.ascore([(row["verifier"], response, row["ground_truth"]), ...])
      log(pool.error_counts)
"""

import argparse
import asyncio
import collections
import concurrent.futures
import ctypes
import dataclasses
import inspect
import json
import logging
import math as pymath
import multiprocessing
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

logger = logging.getLogger("verifiers")


@dataclasses.dataclass
class VerifierResult:
    score: float  # in [0, 1]
    error: str | None = None  # None, or a short reason ("timeout", "no_answer", ...)
    extracted: str | None = None  # what was extracted / compared, for logs
    verifier: str = ""  # name used
    details: dict | None = None  # per-instruction / per-test outcomes, stderr tail, ...
    elapsed: float = 0.0  # seconds spent on this row (set by verify / the pool)

    def __float__(self):
        return float(self.score)


# Errors that mean "the response had nothing gradable" rather than "the verifier failed".
ANSWER_ERRORS = frozenset({"no_answer", "syntax_error"})


def _fail(error: str, extracted: str | None = None, **details) -> VerifierResult:
    return VerifierResult(0.0, error, extracted, details=details or None)


def strip_think(text: str) -> str:
    """Remove <think>...</think> sections; text before a stray </think> (the template opened the
    think block in the prompt) goes too, and an unclosed <think> swallows the rest.
    Written with str.find, not a regex, so it stays linear on thousands of unclosed tags."""
    if "</think>" in text and ("<think>" not in text or text.find("</think>") < text.find("<think>")):
        text = text.split("</think>", 1)[1]
    out, pos = [], 0
    while True:
        start = text.find("<think>", pos)
        if start < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        end = text.find("</think>", start)
        if end < 0:
            break
        pos = end + len("</think>")
    return "".join(out).replace("</think>", "").strip()


def _maybe_json(label: Any) -> Any:
    """Datasets store structured labels as JSON strings; accept those and Python objects alike."""
    if isinstance(label, str) and label.strip()[:1] in ("[", "{", '"'):
        try:
            return json.loads(label)
        except ValueError:
            return label
    return label


def _as_list(label: Any) -> list:
    label = _maybe_json(label)
    return list(label) if isinstance(label, (list, tuple)) else [label]


# ---------------------------------------------------------------------------------------------
# math and gsm8k

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} or \\fbox{...} (also "\\boxed 5"), else None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\b", text)]
    for start in reversed(starts[-20:]):  # a few truncated ones are skipped, not scanned quadratically
        rest = text[start:]
        stripped = rest.lstrip()
        if not stripped.startswith("{"):
            m = re.match(r"\s+([^\s$]+)", rest)
            if m:
                return m.group(1)
            continue
        depth = 0
        begin = len(rest) - len(stripped)
        for i in range(begin, len(rest)):
            if rest[i] == "{":
                depth += 1
            elif rest[i] == "}":
                depth -= 1
                if depth == 0:
                    return rest[begin + 1 : i].strip()
    return None


def _strip_math_delims(ans: str) -> str:
    ans = ans.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if ans.startswith(left) and ans.endswith(right) and len(ans) >= len(left) + len(right):
            ans = ans[len(left) : len(ans) - len(right)].strip()
    return ans.rstrip(".").strip()


def extract_math_answer(response: str) -> str | None:
    """Last boxed answer, else "the answer is X", else "Answer: X", else the last number."""
    text = strip_think(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed or None
    for pattern in (r"answer\s+is\s*:?\s*([^\n]+)", r"answer\s*:\s*([^\n]+)"):
        matches = list(re.finditer(pattern, text, flags=re.IGNORECASE))
        if matches:
            ans = re.split(r"\.\s+I hope", matches[-1].group(1), flags=re.IGNORECASE)[0]
            ans = re.split(r"\.\s", ans + " ")[0]  # end of sentence ("3.5" has no space after its point)
            ans = _strip_math_delims(ans)
            if ans:
                return ans
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _signal_timeout_ok() -> bool:
    """math-verify's timeout is SIGALRM: usable only in the main thread, and only when the caller
    has no alarm pending (math-verify would cancel it, e.g. pytest-timeout's)."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None))


# Powers of powers, 4+ digit exponents and factorials: sympy computes them in C, where no signal
# reaches, for minutes. Without a timeout (off the main thread) such answers are compared as strings.
_SYMPY_UNSAFE = re.compile(r"(?:\^|\*\*)\s*\{?\s*[-+(]*\s*\d{4,}|(?:\^|\*\*)\s*\{[^{}]*(?:\^|\*\*)|\d{4,}\s*!")


def _math_norm(s: str) -> str:
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    return re.sub(r"[\s$]", "", s).lower()


def math(response: str, label: Any, math_timeout: int = 5) -> VerifierResult:
    """Math answer equivalence through math-verify.

    >>> math("<think>0.5?</think> So $x = \\\\boxed{\\\\frac{1}{2}}$.", "0.5").score
    1.0
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    from math_verify import verify as mv_verify
    from math_verify.errors import TimeoutException

    pred = extract_math_answer(response)
    if pred is None:
        return _fail("no_answer")
    t = int(math_timeout) if _signal_timeout_ok() and math_timeout else None
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    golds = label if isinstance(label, (list, tuple)) else [label]
    decoded = _maybe_json(label) if isinstance(label, str) else None
    if isinstance(decoded, list) and decoded and all(isinstance(g, str) for g in decoded):
        golds = decoded  # '["1/2", "0.5"]': several acceptable answers; "[1, 2]" stays an interval
    golds = [g for g in golds if g is not None and str(g).strip()]
    if not golds:
        return _fail("bad_label", pred)
    if t is None and _SYMPY_UNSAFE.search(pred):
        golds = [_strip_math_delims(last_boxed(str(g)) or str(g)) for g in golds]
        return VerifierResult(float(any(_math_norm(g) == _math_norm(pred) for g in golds)), None, pred,
                              details={"compared": "string (unsafe for sympy without a timeout)"})
    try:
        pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=config, parsing_timeout=t, raise_on_error=True)
    except TimeoutException:
        return _fail("timeout", pred)
    except Exception:  # unparseable: compared as a string below
        pred_parsed = []
    for gold in golds:
        gold = str(gold)
        gold = _strip_math_delims(last_boxed(gold) or gold)
        try:
            gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=config, parsing_timeout=t, raise_on_error=True)
            # raise_on_error: math-verify otherwise scores a timeout as a silent False.
            if pred_parsed and gold_parsed and mv_verify(gold_parsed, pred_parsed, timeout_seconds=t, raise_on_error=True):
                return VerifierResult(1.0, None, pred)
        except TimeoutException:
            return _fail("timeout", pred)
        except Exception:
            pass
        if _math_norm(gold) == _math_norm(pred):
            return VerifierResult(1.0, None, pred)
    return VerifierResult(0.0, None, pred)


def _to_number(s: str) -> float | None:
    s = s.replace(",", "").strip()
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return float(num) / float(den)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k(response: str, label: Any) -> VerifierResult:
    """Last number in the response equals the label (thousands separators removed).

    >>> gsm8k("12 + 30 = 42, so she has 1,234 apples.", "1234").score
    1.0
    """
    numbers = _NUMBER.findall(strip_think(response))
    if not numbers:
        return _fail("no_answer")
    pred = numbers[-1].replace(",", "")
    gold_numbers = _NUMBER.findall(str(label))
    if not gold_numbers:
        return _fail("bad_label", pred)
    a, b = _to_number(pred), _to_number(gold_numbers[-1])
    if a is None or b is None:
        return VerifierResult(0.0, None, pred)
    return VerifierResult(float(abs(a - b) <= 1e-6 * max(1.0, abs(b))), None, pred)


# ---------------------------------------------------------------------------------------------
# ifeval: the 25 instruction types of google-research/instruction_following_eval, strict mode,
# with their kwargs names. Regexes that were quadratic on hostile input (a leading \s* under
# re.MULTILINE, \[.*?\] on a line of "[") are rewritten to count the same things in linear time.


def split_into_sentences(text: str) -> list[str]:
    """IFEval's own regex sentence splitter (instructions_util.py); no NLTK download needed."""
    alphabets, prefixes, suffixes = "([A-Za-z])", "(Mr|St|Mrs|Ms|Dr)[.]", "(Inc|Ltd|Jr|Sr|Co)"
    starters = r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|However\s|That\s|This\s|Wherever)"
    acronyms, websites, digits = "([A-Z][.][A-Z][.](?:[A-Z][.])?)", "[.](com|net|org|io|gov|edu|me)", "([0-9])"
    text = " " + text + "  "
    text = text.replace("\n", " ")
    text = re.sub(prefixes, "\\1<prd>", text)
    text = re.sub(websites, "<prd>\\1", text)
    text = re.sub(digits + "[.]" + digits, "\\1<prd>\\2", text)
    text = re.sub(r"\.{2,}", lambda m: "<prd>" * len(m.group(0)) + "<stop>", text)
    text = text.replace("Ph.D.", "Ph<prd>D<prd>")
    text = re.sub(r"\s" + alphabets + "[.] ", " \\1<prd> ", text)
    text = re.sub(acronyms + " " + starters, "\\1<stop> \\2", text)
    text = re.sub(alphabets + "[.]" + alphabets + "[.]" + alphabets + "[.]", "\\1<prd>\\2<prd>\\3<prd>", text)
    text = re.sub(alphabets + "[.]" + alphabets + "[.]", "\\1<prd>\\2<prd>", text)
    text = re.sub(" " + suffixes + "[.] " + starters, " \\1<stop> \\2", text)
    text = re.sub(" " + suffixes + "[.]", " \\1<prd>", text)
    text = re.sub(" " + alphabets + "[.]", " \\1<prd>", text)
    text = text.replace(".\u201d", "\u201d.").replace('."', '".').replace('!"', '"!').replace('?"', '"?')
    text = text.replace(".", ".<stop>").replace("?", "?<stop>").replace("!", "!<stop>").replace("<prd>", ".")
    sentences = [s.strip() for s in text.split("<stop>")]
    if sentences and not sentences[-1]:
        sentences = sentences[:-1]
    return sentences


def _compare(count: int, relation: str, n: int) -> bool:
    if relation == "less than":
        return count < n
    if relation == "at least":
        return count >= n
    raise ValueError(f"unknown relation {relation!r}")


def _detect_language(text: str) -> str | None:
    import langdetect

    langdetect.DetectorFactory.seed = 0  # langdetect is random without a seed
    try:
        return langdetect.detect(text)
    except langdetect.LangDetectException:
        return None  # IFEval counts an undetectable language as followed


def _paragraphs_stars(text: str, num_paragraphs: int) -> bool:
    paragraphs = re.split(r"\s?\*\*\*\s?", text)
    count = len(paragraphs)
    for i, p in enumerate(paragraphs):
        if not p.strip():
            if i in (0, len(paragraphs) - 1):
                count -= 1
            else:
                return False
    return count == int(num_paragraphs)


def _nth_paragraph_first_word(text: str, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    paragraphs = re.split(r"\n\n", text)
    count = sum(1 for p in paragraphs if p.strip())
    nth = int(nth_paragraph)
    if not 1 <= nth <= count or nth > len(paragraphs):
        return False
    paragraph = paragraphs[nth - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    got = ""
    for ch in word:
        if ch in {".", ",", "?", "!", "'", '"'}:
            break
        got += ch.lower()
    return count == int(num_paragraphs) and got == first_word.lower()


def _postscript(text: str, postscript_marker: str) -> bool:
    text = text.lower()
    if postscript_marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s"
    elif postscript_marker == "P.S.":
        pattern = r"p\.\s?s\."
    else:
        pattern = re.escape(postscript_marker.lower())
    return re.search(pattern, text, flags=re.MULTILINE) is not None


def _highlights(text: str, num_highlights: int) -> bool:
    count = sum(1 for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip())
    count += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h[2:-2].strip())
    return count >= int(num_highlights)


def _json_format(text: str) -> bool:
    text = text.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(prefix)
    try:
        json.loads(text.removesuffix("```").strip())
        return True
    except (ValueError, RecursionError):
        return False


def _two_responses(text: str) -> bool:
    parts = text.split("******")
    valid = []
    for i, part in enumerate(parts):
        if not part.strip():
            if i not in (0, len(parts) - 1):
                return False
        else:
            valid.append(part)
    return len(valid) == 2 and valid[0].strip() != valid[1].strip()


IFEVAL_CHECKS: dict[str, Callable[..., bool]] = {
    "keywords:existence": lambda t, keywords: all(re.search(re.escape(k), t, re.I) for k in keywords),
    "keywords:frequency": lambda t, keyword, frequency, relation: _compare(
        len(re.findall(re.escape(keyword), t, re.I)), relation, int(frequency)),
    "keywords:forbidden_words": lambda t, forbidden_words: not any(
        re.search(r"\b" + re.escape(w) + r"\b", t, re.I) for w in forbidden_words),
    "keywords:letter_frequency": lambda t, letter, let_frequency, let_relation: _compare(
        collections.Counter(t.lower())[letter.lower()], let_relation, int(let_frequency)),
    "language:response_language": lambda t, language: _detect_language(t) in (None, language),
    "length_constraints:number_sentences": lambda t, num_sentences, relation: _compare(
        len(split_into_sentences(t)), relation, int(num_sentences)),
    "length_constraints:number_paragraphs": _paragraphs_stars,
    "length_constraints:number_words": lambda t, num_words, relation: _compare(
        len(re.findall(r"\w+", t)), relation, int(num_words)),
    "length_constraints:nth_paragraph_first_word": _nth_paragraph_first_word,
    "detectable_content:number_placeholders": lambda t, num_placeholders: len(
        re.findall(r"\[[^\[\]\n]*\]", t)) >= int(num_placeholders),
    "detectable_content:postscript": _postscript,
    "detectable_format:number_bullet_lists": lambda t, num_bullets: len(
        re.findall(r"^[^\S\n]*\*[^\*].*$", t, re.M)) + len(re.findall(r"^[^\S\n]*-.*$", t, re.M)) == int(num_bullets),
    "detectable_format:constrained_response": lambda t: any(
        o in t.strip() for o in ("My answer is yes.", "My answer is no.", "My answer is maybe.")),
    "detectable_format:number_highlighted_sections": _highlights,
    "detectable_format:multiple_sections": lambda t, section_spliter, num_sections: len(
        re.split(r"\s?" + re.escape(section_spliter) + r"\s?\d+\s?", t)) - 1 >= int(num_sections),
    "detectable_format:json_format": _json_format,
    "detectable_format:title": lambda t: any(m.lstrip("<").rstrip(">").strip() for m in re.findall(r"<<[^\n]+>>", t)),
    "combination:two_responses": _two_responses,
    "combination:repeat_prompt": lambda t, prompt_to_repeat: t.strip().lower().startswith(prompt_to_repeat.strip().lower()),
    "startend:end_checker": lambda t, end_phrase: t.strip().strip('"').lower().endswith(end_phrase.strip().lower()),
    "change_case:capital_word_frequency": lambda t, capital_frequency, capital_relation: _compare(
        sum(1 for w in re.findall(r"\b\w+\b", t) if w.isupper()), capital_relation, int(capital_frequency)),
    "change_case:english_capital": lambda t: t.isupper() and _detect_language(t) in (None, "en"),
    "change_case:english_lowercase": lambda t: t.islower() and _detect_language(t) in (None, "en"),
    "punctuation:no_comma": lambda t: "," not in t,
    "startend:quotation": lambda t: len(t.strip()) > 1 and t.strip()[0] == '"' and t.strip()[-1] == '"',
}


def _ifeval_instructions(label: Any) -> list[tuple[str, dict]]:
    label = _maybe_json(label)
    if isinstance(label, list):  # Olmo's RLVR rows wrap the dict in a list
        items = [_maybe_json(x) for x in label]
    else:
        items = [label]
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("label is not an IFEval dict")
        ids = item.get("instruction_id_list", item.get("instruction_id"))
        ids = [ids] if isinstance(ids, str) else list(ids or [])
        kwargs = item.get("kwargs") or [{}] * len(ids)
        kwargs = [_maybe_json(k) for k in (kwargs if isinstance(kwargs, list) else [kwargs])]
        if len(kwargs) != len(ids):
            raise ValueError("instruction_id_list and kwargs differ in length")
        # The HF dataset fills every kwargs dict with all keys, None where unused.
        out += [(i, {k: v for k, v in (kw or {}).items() if v is not None}) for i, kw in zip(ids, kwargs)]
    if not out:
        raise ValueError("no instructions")
    return out


def ifeval(response: str, label: Any) -> VerifierResult:
    """Fraction of IFEval instructions followed (strict), after removing <think>.

    >>> ifeval("hello world", {"instruction_id_list": ["punctuation:no_comma", "change_case:english_capital"],
    ...                        "kwargs": [{}, {}]}).score
    0.5
    """
    try:
        instructions = _ifeval_instructions(label)
    except (ValueError, TypeError, AttributeError) as e:
        return _fail("bad_label", message=str(e)[:200])
    text = strip_think(response)
    if not text:
        return _fail("no_answer")  # an empty reply would "follow" no_comma, forbidden_words, ...
    followed = {}
    for inst_id, kwargs in instructions:
        check = IFEVAL_CHECKS.get(inst_id)
        if check is None:
            return _fail("bad_label", message=f"unknown instruction {inst_id}")
        try:
            followed[inst_id] = bool(check(text, **kwargs))
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # missing / malformed kwargs
            return _fail("bad_label", message=f"{inst_id}: {e}"[:200])
    score = sum(followed.values()) / len(instructions)
    return VerifierResult(score, None, None, details={"followed": followed})


# ---------------------------------------------------------------------------------------------
# string_match, string_f1, max_length


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in str(s).lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _short_answer(response: str) -> str:
    text = strip_think(response)
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    return tagged[-1].strip() if tagged else text


def string_match(response: str, label: Any) -> VerifierResult:
    """Normalized exact match against any of the labels.

    >>> string_match("<answer>The Eiffel Tower!</answer>", ["eiffel tower", "tour eiffel"]).score
    1.0
    """
    pred = normalize_answer(_short_answer(response))
    if not pred:
        return _fail("no_answer")
    return VerifierResult(float(any(pred == normalize_answer(g) for g in _as_list(label))), None, pred)


def _f1(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(p) & collections.Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def string_f1(response: str, label: Any) -> VerifierResult:
    """Token F1 (SQuAD), max over labels.

    >>> round(string_f1("the big red dog", "red dog").score, 3)
    0.8
    """
    pred = _short_answer(response)
    if not normalize_answer(pred):
        return _fail("no_answer")
    return VerifierResult(max(_f1(pred, str(g)) for g in _as_list(label)), None, pred[:200])


def _length_and_target(response: str, label: Any, num_tokens: int | None) -> tuple[int, float, float]:
    label = _maybe_json(label)
    scale = 8192.0  # open-instruct's max_length_verifier_max_length
    if isinstance(label, dict):
        scale = float(label.get("scale", scale))
        label = label.get("max_length")
    target = float(label)
    length = int(num_tokens) if num_tokens is not None else len(strip_think(response).split())
    return length, target, scale


def max_length(response: str, label: Any, num_tokens: int | None = None) -> float:
    """1 - |length - label| / scale, clamped to [0, 1] (open-instruct's was not clamped).

    >>> max_length("one two three", "3")
    1.0
    """
    length, target, scale = _length_and_target(response, label, num_tokens)
    return min(1.0, max(0.0, 1.0 - abs(length - target) / scale))


def up_to_max_length(response: str, label: Any, num_tokens: int | None = None) -> float:
    """1 up to the label, then 1 - (length - label) / scale, clamped to [0, 1].

    >>> up_to_max_length("short", "100")
    1.0
    """
    length, target, scale = _length_and_target(response, label, num_tokens)
    return min(1.0, max(0.0, 1.0 - max(0.0, length - target) / scale))


# ---------------------------------------------------------------------------------------------
# code: a sandboxed subprocess per run (see the module docstring)

_SANDBOX: dict = {}  # {"mode": "namespace" | "prlimit" | "rlimit"}, probed once per process
_SANDBOX_LOCK = threading.Lock()
_UID_LOCK = threading.Lock()
_UID_SLOTS: dict[int, queue.Queue] = {}  # pid -> free sandbox uids
_FSIZE = 16 << 20  # bytes a program may write to one file (its stdout included)
_NPROC = 64  # processes + threads of the sandbox uid


def extract_code(response: str) -> str | None:
    """The last fenced python block (```python / ```py / ```python3), else the last bare ``` block."""
    text = strip_think(response)
    blocks = re.findall(r"```[ \t]*(python3?|py)[ \t]*\n(.*?)```", text, flags=re.S | re.I)
    if blocks:
        return blocks[-1][1]
    bare = re.findall(r"```[ \t]*\n(.*?)```", text, flags=re.S)
    return bare[-1] if bare else None


def _blocked_ancestor(path: str) -> tuple[str, str] | None:
    """(A, C) when directory A on the way to `path` is closed to others (e.g. /root, mode 700)
    and C is the next component under it; the sandbox bind-mounts around it."""
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts)):
        ancestor = os.sep.join(parts[:i]) or os.sep
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor, parts[i]
    return None


def _namespace_script(workdir: str, uid: int, limits: list[str], argv: list[str]) -> str:
    """Shell run inside new mount/pid/net namespaces: make the interpreter reachable for the
    unprivileged uid, give it a private /tmp (= workdir) and /dev/shm, drop to the uid, exec."""
    lines = ["set -e"]
    blocked = {b for p in (sys.prefix, sys.base_prefix, sys.executable) if (b := _blocked_ancestor(p))}
    for ancestor, child in sorted(blocked):
        stage = os.path.join(tempfile.gettempdir(), f"verifiers_stage{ancestor.replace(os.sep, '_')}")
        os.makedirs(os.path.join(stage, child), exist_ok=True)
        os.chmod(stage, 0o755)
        lines += [f"mount --rbind {shlex.quote(os.path.join(ancestor, child))} {shlex.quote(os.path.join(stage, child))}",
                  f"mount --rbind {shlex.quote(stage)} {shlex.quote(ancestor)}"]
    lines += [f"mount --bind {shlex.quote(workdir)} /tmp", "mount -t tmpfs -o size=16m,mode=1777 tmpfs /dev/shm", "cd /tmp",
              "exec prlimit " + " ".join(limits) + f" setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs "
              + " ".join(shlex.quote(a) for a in _reachable_interpreter(argv))]
    return "\n".join(lines)


def _reachable_interpreter(argv: list[str]) -> list[str]:
    """Inside the namespace /tmp is the run's own directory, so an interpreter that lives under the
    temp dir (a checkout or virtualenv in /tmp) would vanish: run its real base interpreter instead
    (the standard library only; the virtualenv's packages are not reachable from there)."""
    tmp = os.path.realpath(tempfile.gettempdir()) + os.sep
    if argv and argv[0] == sys.executable and (sys.executable.startswith(tmp) or sys.prefix.startswith(tmp)):
        return [os.path.realpath(sys.executable), *argv[1:]]
    return argv


def _uid_base() -> int:
    """First of 8 sandbox uids of this process. RLIMIT_NPROC counts per user, so concurrent
    sandboxes (pool workers, threads of one process) must not share a uid. No passwd entry needed."""
    return 20000 + (os.getpid() % 3750) * 8


def _acquire_uid() -> int:
    with _UID_LOCK:
        if os.getpid() not in _UID_SLOTS:
            _UID_SLOTS[os.getpid()] = queue.Queue()
            for i in range(8):
                _UID_SLOTS[os.getpid()].put(_uid_base() + i)
        slots = _UID_SLOTS[os.getpid()]
    return slots.get()  # a 9th concurrent run in one process waits for a free uid


def _release_uid(uid: int) -> None:
    _UID_SLOTS[os.getpid()].put(uid)


def _sandbox_popen(argv: list[str], workdir: str, timeout: float, memory_mb: int, stdin, stdout, stderr,
                   uid: int, mode: str | None = None):
    """Start `argv` (relative to workdir) sandboxed, in its own session; returns the Popen."""
    mode = mode or _sandbox_mode()
    cpu = max(1, pymath.ceil(timeout))
    limits = [f"--cpu={cpu}:{cpu + 1}", f"--as={memory_mb << 20}", f"--fsize={_FSIZE}", "--nofile=256", "--core=0"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if mode == "namespace":
        os.chown(workdir, uid, uid)
        script = _namespace_script(workdir, uid, limits + [f"--nproc={_NPROC}"], argv)
        # pdeathsig: if our process is killed (pool timeout), unshare dies, and --kill-child takes
        # the namespace's init and with it every process inside.
        cmd = ["setpriv", "--pdeathsig", "KILL", "unshare", "--mount", "--net", "--pid", "--fork", "--kill-child",
               "--mount-proc", "--propagation", "private", "sh", "-c", script]
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True)
    env["HOME"] = workdir
    # Without a pid namespace the program's parent is a shell that waits for it, not this process:
    # `os.kill(os.getppid(), SIGKILL)` in model output then takes down the shell, never the trainer.
    argv = ["sh", "-c", '"$@"; exit $?', "sh", *argv]
    if mode == "prlimit":
        cmd = ["prlimit", *limits, f"--nproc={_NPROC * 8}", *argv]
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True)
    import resource

    def limit():  # last resort; preexec_fn is not safe beside threads, hence the modes above
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (_FSIZE, _FSIZE))

    return subprocess.Popen(argv, cwd=workdir, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                            start_new_session=True, preexec_fn=limit)


def _kill_sandbox(proc: subprocess.Popen) -> None:
    """Kill a sandboxed run and reap all of it. In namespace mode the program is the pid
    namespace's init, a child of unshare: kill it first, so that the kernel kills and reaps the
    rest of the namespace and unshare reaps the init. Killing unshare at the same moment would
    orphan the init to this machine's pid 1, which may reap zombies only every few seconds (and a
    zombie still counts against the sandbox uid's RLIMIT_NPROC)."""
    if proc.poll() is None and _SANDBOX.get("mode") == "namespace":
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                for child in f.read().split():
                    os.kill(int(child), signal.SIGKILL)
            proc.wait(timeout=5)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session: unshare, or the program and its children
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _wait_uid_gone(uid: int, timeout: float = 3.0) -> None:
    """After a kill, the namespace's processes die asynchronously: wait until the sandbox uid owns
    none, so that nothing outlives the call and the uid's next run starts with RLIMIT_NPROC free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                    alive = True
                    break
            except FileNotFoundError:
                pass
        if not alive:
            return
        time.sleep(0.01)
    logger.warning("sandbox processes of uid %d still alive after %.0f s", uid, timeout)


def _sandbox_mode() -> str:
    """The strongest sandbox that works here, probed once per process by running python in it."""
    with _SANDBOX_LOCK:
        if "mode" in _SANDBOX:
            return _SANDBOX["mode"]
        candidates = [m for m, tools in (("namespace", ("unshare", "setpriv", "prlimit")), ("prlimit", ("prlimit",)))
                      if all(shutil.which(t) for t in tools) and (m != "namespace" or os.geteuid() == 0)]
        mode = "rlimit"
        for candidate in candidates:
            workdir = tempfile.mkdtemp(prefix="verifiers_probe_")
            try:
                proc = _sandbox_popen([sys.executable, "-c", "import os; print(os.getuid())"], workdir, 10, 1024,
                                      subprocess.DEVNULL, subprocess.PIPE, subprocess.PIPE, _uid_base(), candidate)
                out, err = proc.communicate(timeout=30)
                if proc.returncode == 0 and out.strip().isdigit() and (candidate != "namespace" or int(out) != 0):
                    mode = candidate
                    break
                logger.warning("code sandbox %s unavailable: %s", candidate, err.decode(errors="replace")[-300:])
            except Exception as e:
                logger.warning("code sandbox %s unavailable: %s", candidate, e)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        if mode != "namespace":
            logger.warning("code sandbox degraded to %s: no network/pid isolation, fork bombs bounded by time only", mode)
        _SANDBOX["mode"] = mode
        return mode


def run_sandboxed(files: dict[str, str], argv: list[str], stdin_text: str | None = None, timeout: float = 5.0,
                  memory_mb: int = 1024, max_output: int = 1 << 20) -> dict:
    """Write `files` into a fresh temp dir, run argv there under limits; never raises for the
    program's behaviour. Returns {"status": ok|exit_<rc>|signal_<n>|timeout|output_limit,
    "stdout", "stderr", "seconds"}."""
    workdir = tempfile.mkdtemp(prefix="verifiers_run_")
    uid = _acquire_uid()
    try:
        for name, text in files.items():
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)
        with open(os.path.join(workdir, ".stdin"), "w+b") as fin, \
                tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
            # Output goes to files, not pipes: no reader threads, no deadlock, and RLIMIT_FSIZE
            # stops a program that prints gigabytes.
            fin.write((stdin_text or "").encode())
            fin.seek(0)
            t0 = time.monotonic()
            proc = _sandbox_popen(argv, workdir, timeout, memory_mb, fin, fout, ferr, uid)
            try:
                rc = proc.wait(timeout=timeout)
                status = "ok" if rc == 0 else (f"signal_{-rc}" if rc < 0 else f"exit_{rc}")
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                _kill_sandbox(proc)
                if status != "ok" and _SANDBOX.get("mode") == "namespace":
                    _wait_uid_gone(uid)
            seconds = time.monotonic() - t0
            if fout.seek(0, os.SEEK_END) >= _FSIZE:
                status = "output_limit"
            fout.seek(0)
            ferr.seek(0)
            out = fout.read(max_output).decode(errors="replace")
            err = ferr.read(64 << 10).decode(errors="replace")
        return {"status": status, "stdout": out, "stderr": err[-2000:], "seconds": seconds}
    finally:
        _release_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)


_HARNESS = """\
import os, sys
os.unlink(__file__)  # the sentinel is in this file: a program that reads its directory won't find it
_write, _flush = sys.stdout.write, sys.stdout.flush  # kept before the program can replace them
_tests = {tests!r}
_ns = {{"__name__": "__main__"}}
try:  # a crash or sys.exit() while defining things does not skip the tests; os._exit() does, and fails them
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
except BaseException:
    pass
for _i, _t in enumerate(_tests):
    try:
        exec(_t, _ns)
        _write("\\n{sentinel}:%d:pass\\n" % _i)
    except BaseException as _e:
        _write("\\n{sentinel}:%d:fail:%s\\n" % (_i, type(_e).__name__))
    _flush()
"""


def _check_code(response: str) -> tuple[str | None, VerifierResult | None]:
    program = extract_code(response)
    if program is None or not program.strip():
        return None, _fail("no_answer")
    try:
        compile(program, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return None, _fail("syntax_error", program[:2000], message=str(e)[:200])
    return program, None


def code(response: str, label: Any, code_timeout: float = 5.0, code_memory_mb: int = 1024, budget: float | None = None) -> VerifierResult:
    """Fraction of assert statements that pass, all run in one sandboxed process.

    >>> code("```python\\ndef f(x):\\n    return 2 * x\\n```", ["assert f(2) == 4", "assert f(3) == 7"]).score
    0.5
    """
    tests = [t for t in _as_list(label) if isinstance(t, str) and t.strip()]
    if not tests:
        return _fail("bad_label")
    program, failed = _check_code(response)
    if failed:
        return failed
    sentinel = "VERIFIER_" + secrets.token_hex(16)  # unknown to the program until it runs
    harness = _HARNESS.format(tests=tests, sentinel=sentinel)
    timeout = min(code_timeout, budget) if budget else code_timeout
    run = run_sandboxed({"solution.py": program, "harness.py": harness}, [sys.executable, "harness.py"],
                        timeout=timeout, memory_mb=code_memory_mb)
    passed = set(int(i) for i in re.findall(re.escape(sentinel) + r":(\d+):pass", run["stdout"]))
    passed &= set(range(len(tests)))
    return VerifierResult(len(passed) / len(tests), None, program[:2000],
                          details={"passed": len(passed), "total": len(tests), "status": run["status"],
                                   "seconds": round(run["seconds"], 3), "stderr": run["stderr"][-500:]})


def _stdio_tests(label: Any) -> list[tuple[str, str]]:
    label = _maybe_json(label)
    if isinstance(label, dict) and "inputs" in label:  # LiveCodeBench / APPS style
        label = [{"input": i, "output": o} for i, o in zip(label["inputs"], label["outputs"])]
    tests = []
    for t in label if isinstance(label, list) else []:
        t = _maybe_json(t)
        if isinstance(t, dict) and "input" in t and "output" in t:
            tests.append((str(t["input"]), str(t["output"])))
    return tests


def code_stdio(response: str, label: Any, code_timeout: float = 5.0, code_memory_mb: int = 1024,
               budget: float | None = 8.0) -> VerifierResult:
    """Fraction of stdin -> stdout tests passed; one sandboxed run per test, within `budget`
    seconds in all (tests not reached count as failed).

    >>> code_stdio("```python\\nprint(int(input()) * 2)\\n```", [{"input": "2\\n", "output": "4\\n"}]).score
    1.0
    """
    tests = _stdio_tests(label)
    if not tests:
        return _fail("bad_label")
    program, failed = _check_code(response)
    if failed:
        return failed
    deadline = time.monotonic() + (budget or float("inf"))
    passed, statuses = 0, []
    for stdin_text, expected in tests:
        remaining = deadline - time.monotonic()
        if remaining < 0.2:
            statuses.append("budget")
            continue
        run = run_sandboxed({"solution.py": program}, [sys.executable, "solution.py"], stdin_text,
                            timeout=min(code_timeout, remaining), memory_mb=code_memory_mb)
        ok = run["status"] in ("ok",) and run["stdout"].split() == expected.split()
        passed += ok
        statuses.append("pass" if ok else run["status"])
    return VerifierResult(passed / len(tests), None, program[:2000],
                          details={"passed": passed, "total": len(tests), "statuses": statuses})


# ---------------------------------------------------------------------------------------------
# llm_judge

JUDGE_TEMPLATE = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {question}\nReference: {reference}\nResponse: {response}\n"
    'Reply with JSON only: {{"score": N}} with N an integer from 0 (wrong) to 10 (fully correct).')
_JUDGE_CLIENTS: dict = {}
_JUDGE_MODELS: dict = {}


def _judge_schema(max_score: float) -> dict:
    # An enum, not a bare integer: a weak judge under a grammar otherwise writes digits until max_tokens.
    return {"type": "object", "properties": {"score": {"type": "integer", "enum": list(range(int(max_score) + 1))}},
            "required": ["score"], "additionalProperties": False}


def _judge_score(text: str, structured: bool) -> float | None:
    """The score of a JSON reply; a plain-text reply may also say `score: 7` around other words.
    A structured reply that is not valid JSON was cut off (max_tokens): no score."""
    try:
        obj = json.loads(text)
        if isinstance(obj, dict) and isinstance(obj.get("score"), (int, float)) and not isinstance(obj["score"], bool):
            return float(obj["score"])
    except ValueError:
        pass
    if structured:
        return None
    m = re.search(r'"?score"?\s*[:=]\s*(-?\d+(?:\.\d+)?)\b', text or "")
    return float(m.group(1)) if m else None


def llm_judge(response: str, label: Any, judge_base_url: str | None = None, judge_model: str | None = None,
              judge_api_key: str | None = None, judge_template: str = JUDGE_TEMPLATE, judge_max_score: float = 10.0,
              judge_max_tokens: int = 64, judge_timeout: float = 30.0, judge_retries: int = 3,
              budget: float | None = None) -> VerifierResult:
    """An OpenAI-compatible endpoint grades the response; score / judge_max_score.

    >>> llm_judge("Paris", "Paris", judge_base_url="http://127.0.0.1:8000/v1").score  # doctest: +SKIP
    1.0
    """
    deadline = time.monotonic() + (budget or float("inf"))
    import openai

    label = _maybe_json(label)
    question, reference = "", label
    if isinstance(label, dict):
        question = label.get("question", label.get("prompt", ""))
        reference = label.get("reference", label.get("ground_truth", label.get("answer", "")))
    text = strip_think(response)
    if not text:
        return _fail("no_answer")
    base_url = judge_base_url or os.environ.get("JUDGE_BASE_URL")
    if not base_url:
        return _fail("judge_unavailable", message="no judge_base_url / JUDGE_BASE_URL")
    api_key = judge_api_key or os.environ.get("JUDGE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    key = (base_url, api_key)
    if key not in _JUDGE_CLIENTS:  # max_retries=0: retries are ours, visible and bounded by the budget
        _JUDGE_CLIENTS[key] = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client = _JUDGE_CLIENTS[key]
    prompt = judge_template.format(question=question, reference=reference, response=text[:8000])
    use_schema, last_error, reply = True, "judge_unavailable", None
    for attempt in range(judge_retries + 1):
        timeout = min(judge_timeout, deadline - time.monotonic())
        if timeout <= 0.1:
            break
        try:
            model = judge_model or os.environ.get("JUDGE_MODEL") or _JUDGE_MODELS.get(base_url)
            if not model:  # the server's first model (vLLM serves one), asked once per process
                model = _JUDGE_MODELS[base_url] = client.models.list(timeout=timeout).data[0].id
            extra = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "judgement", "schema": _judge_schema(judge_max_score), "strict": True}}} if use_schema else {}
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 temperature=0.0, max_tokens=judge_max_tokens, timeout=timeout, **extra)
            reply = out.choices[0].message.content or ""
            score = _judge_score(reply, use_schema)
            if score is None or not pymath.isfinite(score):
                last_error = "judge_bad_output"
            else:
                return VerifierResult(min(1.0, max(0.0, score / judge_max_score)), None, reply[:200],
                                      details={"structured": use_schema, "attempts": attempt + 1})
        except openai.BadRequestError as e:  # e.g. no structured output here: ask again in plain text
            if not use_schema:
                return _fail("judge_bad_request", message=str(e)[:200])
            use_schema, last_error = False, "judge_bad_request"
            continue
        except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError, IndexError) as e:
            last_error = "judge_unavailable"  # down, overloaded, restarting: worth another try
            logger.debug("judge attempt %d failed: %s", attempt, e)
        except openai.APIStatusError as e:  # 401, 404 (wrong model or URL), ...: asking again won't help
            return _fail("judge_bad_request", message=str(e)[:200])
        if attempt < judge_retries:
            time.sleep(max(0.0, min(0.5 * 2 ** attempt, deadline - time.monotonic() - 0.2)))
    return _fail(last_error, reply[:200] if reply else None)


# ---------------------------------------------------------------------------------------------
# routing

VERIFIERS: dict[str, Callable[..., Any]] = {
    "math": math, "gsm8k": gsm8k, "ifeval": ifeval, "code": code, "code_stdio": code_stdio,
    "string_match": string_match, "string_f1": string_f1, "llm_judge": llm_judge,
    "max_length": max_length, "up_to_max_length": up_to_max_length,
}
# Names other datasets use for the same verifiers (open-instruct / Olmo RLVR "dataset" column).
ALIASES = {"string_matcher": "string_match", "f1": "string_f1", "judge": "llm_judge",
           "general_quality": "llm_judge", "general_quality_ref": "llm_judge", "instruction_following": "ifeval",
           "stdio": "code_stdio", "code_asserts": "code"}


def _canonical(name: Any) -> str:
    key = str(name).strip().lower().replace("-", "_")
    return ALIASES.get(key, key)


def _accepted(fn) -> set[str]:
    return set(list(inspect.signature(fn).parameters)[2:])


def verify(name: str, response: str, label: Any, **kwargs) -> VerifierResult:
    """Score one response with one verifier; never raises (exceptions become errors)."""
    t0 = time.perf_counter()
    key = _canonical(name)
    fn = VERIFIERS.get(key)
    if fn is None:
        result = _fail("unknown_verifier", message=str(name)[:100])
    else:
        try:
            accepted = _accepted(fn)
            out = fn("" if response is None else str(response), label, **{k: v for k, v in kwargs.items() if k in accepted})
            result = out if isinstance(out, VerifierResult) else VerifierResult(float(out))
        except (Exception, RecursionError) as e:  # label or response of a shape nobody expected
            result = _fail(f"exception:{type(e).__name__}", message=str(e)[:200])
    if not isinstance(result.score, (int, float)) or not pymath.isfinite(result.score):
        result = _fail("bad_score", message=repr(result.score)[:100])
    result.score = min(1.0, max(0.0, float(result.score)))
    result.verifier = key
    result.elapsed = time.perf_counter() - t0
    return result


def _split_row(verifier: Any, label: Any) -> list[tuple[str, Any]]:
    names = _maybe_json(verifier) if isinstance(verifier, str) else verifier
    if isinstance(names, str):
        return [(names, label)]
    names = list(names)
    if len(names) == 1:  # one verifier: a one-element label list is unwrapped, a longer one is its labels
        labels = _maybe_json(label)
        if isinstance(labels, (list, tuple)) and len(labels) == 1:
            return [(names[0], labels[0])]
        return [(names[0], label)]
    labels = _maybe_json(label)
    if not isinstance(labels, (list, tuple)) or len(labels) != len(names):
        raise ValueError(f"{len(names)} verifiers but labels {str(label)[:100]}")
    return list(zip(names, labels))


def verify_row(verifier: str | list[str], response: str, label: Any, **kwargs) -> VerifierResult:
    """A dataset row: one verifier, or several with parallel labels (score = mean; error if any part errored).

    >>> verify_row(["gsm8k", "max_length"], "so 42", ["42", "2"]).score
    1.0
    """
    t0 = time.perf_counter()
    try:
        parts = _split_row(verifier, label)
    except (ValueError, TypeError) as e:
        return VerifierResult(0.0, "bad_label", None, str(verifier)[:100], details={"message": str(e)[:200]})
    if len(parts) == 1:
        return verify(parts[0][0], response, parts[0][1], **kwargs)
    results = [verify(name, response, lab, **kwargs) for name, lab in parts]
    errors = [f"{r.verifier}:{r.error}" for r in results if r.error]
    return VerifierResult(sum(r.score for r in results) / len(results), ";".join(errors) or None,
                          None, "+".join(r.verifier for r in results),
                          details={"parts": [dataclasses.asdict(r) for r in results]}, elapsed=time.perf_counter() - t0)


def _error_keys(result: VerifierResult) -> list[str]:
    """Counter keys "verifier/error", one per failed part of a multi-verifier row."""
    if not result.error:
        return []
    if result.details and "parts" in result.details:
        return [f"{p['verifier']}/{p['error']}" for p in result.details["parts"] if p["error"]]
    return [f"{result.verifier}/{result.error}"]


# ---------------------------------------------------------------------------------------------
# VerifierPool: processes with a hard per-row timeout


def _worker_main(conn, kwargs):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we exit when the pipe closes
    try:  # die with our parent (the forkserver, which dies with the trainer)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    while True:
        try:
            row = conn.recv()
        except (EOFError, OSError):
            return
        if row is None:
            return
        conn.send(verify_row(*row, **kwargs))


class VerifierPool:
    """Scores (verifier, response, label) rows in `num_workers` processes. A row running past
    `timeout` seconds gets error "timeout" and its worker is killed and replaced, so no row blocks
    another beyond its timeout. `error_counts` (cumulative Counter, "verifier/error") is for the
    trainer to log; `row_counts` counts rows per verifier."""

    def __init__(self, num_workers: int = 2, timeout: float = 10.0,
                 preload: tuple[str, ...] = ("math_verify", "langdetect", "openai"), **verifier_kwargs):
        self.timeout = timeout
        # Time-budgeted verifiers (code_stdio, llm_judge) stop a little before the hard kill, so
        # that a slow program scores 0 for its unfinished tests instead of losing the whole row.
        # The margin covers sandbox start-up, kill and clean-up on a loaded machine.
        verifier_kwargs.setdefault("budget", max(0.5, timeout - max(1.5, 0.25 * timeout)))
        verifier_kwargs.setdefault("code_timeout", min(5.0, verifier_kwargs["budget"]))
        self.kwargs = verifier_kwargs
        self.error_counts: collections.Counter = collections.Counter()
        self.row_counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        # forkserver: workers fork from a clean server process, never from a trainer with threads
        # (vLLM, torch); the server preloads this module so a replacement worker starts in ms.
        self._ctx = multiprocessing.get_context("forkserver")
        import importlib.util

        # Imported once in the server, so that a worker replaced after a timeout starts warm.
        self._ctx.set_forkserver_preload([__name__, *(m for m in preload if importlib.util.find_spec(m))])
        self._idle: queue.Queue = queue.Queue()
        self._all: list = []
        for _ in range(num_workers):
            self._idle.put(self._start_worker())
        self._threads = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="verifier")
        self._closed = False

    def _start_worker(self):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.kwargs), daemon=True)
        proc.start()
        child.close()
        worker = (proc, parent)
        self._all.append(worker)
        return worker

    def _kill(self, worker):
        proc, conn = worker
        proc.kill()
        proc.join(5)
        conn.close()
        self._all.remove(worker)

    def _score_one(self, row) -> VerifierResult:
        if isinstance(row, dict):
            row = (row["verifier"], row["response"], row.get("label", row.get("ground_truth")))
        verifier, response, label = row
        worker = self._idle.get()
        t0 = time.perf_counter()
        try:
            if not worker[0].is_alive():  # died while idle (OOM killer, a stray signal): replace quietly
                self._kill(worker)
                worker = self._start_worker()
            try:
                worker[1].send((verifier, response, label))
                if worker[1].poll(self.timeout):
                    result = worker[1].recv()
                else:
                    result = VerifierResult(0.0, "timeout", None, "", details={"timeout": self.timeout})
                    self._kill(worker)
                    worker = self._start_worker()
            except (EOFError, OSError, BrokenPipeError) as e:  # the worker died mid-row
                result = VerifierResult(0.0, "worker_died", None, "", details={"message": str(e)[:200]})
                self._kill(worker)
                worker = self._start_worker()
        finally:
            self._idle.put(worker)
        if not result.verifier:
            try:
                result.verifier = "+".join(_canonical(n) for n, _ in _split_row(verifier, label))
            except (ValueError, TypeError):
                result.verifier = _canonical(verifier)
        result.elapsed = time.perf_counter() - t0
        keys = _error_keys(result)
        if result.error in ("timeout", "worker_died"):  # the whole row: count it under each of its verifiers
            keys = [f"{name}/{result.error}" for name in result.verifier.split("+")]
        with self._lock:
            self.row_counts[result.verifier] += 1
            self.error_counts.update(keys)
        return result

    async def ascore(self, rows: list) -> list[VerifierResult]:
        """Score rows concurrently (at most num_workers at a time); order is kept."""
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(loop.run_in_executor(self._threads, self._score_one, r) for r in rows)))

    def score(self, rows: list) -> list[VerifierResult]:
        return list(self._threads.map(self._score_one, rows))

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        for proc, conn in list(self._all):
            try:
                conn.send(None)
            except OSError:
                pass
        for worker in list(self._all):
            worker[0].join(2)
            self._kill(worker)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Score one response (stdin) with one verifier; prints JSON.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--verifier", required=True, help=f"one of {sorted(VERIFIERS)}, or a JSON list of them")
    p.add_argument("--label", required=True, help="the label / ground truth (JSON where the verifier takes a structure)")
    p.add_argument("--timeout", type=float, default=30.0, help="hard per-row timeout (runs in a 1-worker pool); 0 = in-process")
    p.add_argument("--judge_base_url", default=None, help="llm_judge: OpenAI-compatible base URL (or env JUDGE_BASE_URL)")
    p.add_argument("--judge_model", default=None, help="llm_judge: model name (or env JUDGE_MODEL; default the server's first)")
    p.add_argument("--judge_api_key", default=None, help="llm_judge: API key (or env JUDGE_API_KEY)")
    args = p.parse_args(argv)
    kwargs = {k: v for k, v in vars(args).items() if k.startswith("judge_") and v is not None}
    response = sys.stdin.read()
    if args.timeout > 0:
        with VerifierPool(num_workers=1, timeout=args.timeout, preload=(), **kwargs) as pool:
            result = pool.score([(args.verifier, response, args.label)])[0]
    else:
        result = verify_row(args.verifier, response, args.label, **kwargs)
    print(json.dumps(dataclasses.asdict(result), default=str))
    return 0


logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning is by design here

if __name__ == "__main__":
    # Run as `verifiers`, not `__main__`, so that pool workers and pickled results name one module.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import verifiers

    sys.exit(verifiers.main())
