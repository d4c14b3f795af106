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
  gsm8k           last number of the response, thousands separators removed, exact rational
                  equality (42 = 42.0 = 84/2; 2,000,001 is not 2,000,000). Label: a number ("1234",
                  "#### 1,234"), or a list of acceptable ones.
  ifeval          the 54 instruction types of open-instruct's IFEvalG (IFEval's 25, Zhou et al.
                  2023, plus copy:*, count:*, first_word:*, ...), strict mode as its RL reward has
                  it. Label {"instruction_id_list": [...], "kwargs": [{...}, ...]} (also
                  "instruction_id"), as a dict, JSON, or open-instruct's ground_truth: a Python
                  literal list whose first element is that dict. Score = fraction followed.
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
never came; `ifeval` alone, as open-instruct's IFEvalG reward, checks the whole text when there is no
</think>). A row may name several verifiers with parallel labels (`verify_row`): score = mean,
error if any part errored.

Errors. `VerifierResult.error` is None or a short reason. A wrong answer is score 0, error None.
Errors are never a silent 0: the trainer counts them (`VerifierPool.error_counts`) and drops the
sample. Reasons: "no_answer" and "syntax_error" (nothing gradable came out: `ANSWER_ERRORS`, which a
trainer may prefer to score 0 rather than drop), "timeout", "worker_died", "bad_label",
"unknown_verifier", "judge_unavailable", "judge_bad_output", "judge_bad_request",
"sandbox_error", "sandbox_unavailable", "exception:<Type>". "bad_label" covers every label no response
could match (not a number where one is due, an empty list, JSON nested past Python's recursion limit).

Timeouts. SIGALRM only works in the main thread (a pool of threads never times out), and math-verify's own timeout is
SIGALRM-based and, worse, returns False on timeout. So: `verify()` uses math-verify's timeout only
when it runs in the main thread with no alarm of the caller's pending, and reports it as "timeout"
(`math_timeout`, 5 s, bounds a row's whole math-verify work, however many answers its label lists);
elsewhere answers sympy could compute on for minutes (powers of powers, huge exponents and factorials)
are compared as text. The hard guarantee is `VerifierPool`, a process pool whose workers are killed and
replaced when a row runs past `timeout` (C-level work such as a huge sympy power cannot be interrupted any
other way).

Sandbox (code, code_stdio): sandbox.py runs model-written code isolated (namespaces, a read-only root, seccomp,
a cgroup where one can be made) and decides a test's verdict in this process, on plain values the sandbox reports,
never in the program's; its docstring says how. Without isolation here the code verifiers return
"sandbox_unavailable" unless `allow_unsandboxed_code`; `sandbox_description()` says which mode this machine gets.
A test's asserts are judged outside the program where the test's text gives an expected value, else inside it
(counted in the details as "judged_inside", scored all the same); a test that does not parse is not scored
("unsupported"), and a row with none that parses is the error "unsupported_tests" (reported before training, and
dropped, never scored 0).

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
import ast
import asyncio
import collections
import concurrent.futures
import ctypes
import dataclasses
import fractions
import inspect
import json
import logging
import math as pymath
import multiprocessing
import os
import queue
import re
import signal
import string
import sys
import threading
import time
from typing import Any, Callable

import sandbox
from sandbox import _sandbox_mode, cleanup_sandboxes, run_sandboxed, sandbox_description, sandbox_mode  # noqa: F401

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
# Errors the response caused: nothing gradable in it, its check ran out of time (a hostile input can make
# any check slow), or a verifier raised on it ("exception:<Type>"). A trainer scores these 0 and counts
# them. Every other error ("worker_died", "judge_*", "sandbox_*", "bad_label", ...) is the
# infrastructure's or the data's: the sample says nothing about the response, so it is dropped and counted.
RESPONSE_ERRORS = ANSWER_ERRORS | {"timeout"}


def caused_by_response(error: str | None) -> bool:
    """True for an error that the response itself caused (see RESPONSE_ERRORS)."""
    return error is not None and (error in RESPONSE_ERRORS or error.startswith("exception:"))


class LabelError(ValueError):
    """A label no response can be scored against: `verify` reports it as "bad_label" (the data's fault, so
    the sample is dropped and counted), not as an exception the response caused (scored 0)."""


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


# Labels arrive as Python values or as JSON text: a dataset may store structure as a JSON string (code
# tests, IFEval instructions), and the loader writes every non-string value of a column that mixes them
# with strings as its JSON text (chat_template._load_json_file). So where a label is structure (code,
# code_stdio, ifeval, max_length, llm_judge dicts, a row's parallel labels) JSON text is decoded; where it
# is text (math, gsm8k, string_match, string_f1) a string is the answer exactly as written ("[1, 2]",
# "1e3", '"quoted"'), except a JSON list of strings, which is how a list of acceptable answers arrives.
def _maybe_json(label: Any) -> Any:
    """A structured label: JSON text decoded, Python objects as they are."""
    if isinstance(label, str) and label.strip()[:1] in ("[", "{", '"'):
        try:
            return json.loads(label)
        except (ValueError, RecursionError):  # nested past the recursion limit: not a label we can read
            return label
    return label


def _as_list(label: Any) -> list:
    label = _maybe_json(label)
    return list(label) if isinstance(label, (list, tuple)) else [label]


_TEXT_LABELS = ("math", "gsm8k", "string_match", "string_f1")


def _answers(label: Any) -> list:
    """The acceptable answers of a text label: a list's items; a string as written, unless it is a JSON list
    of strings (several answers, as the loader writes a list in a mixed column)."""
    if isinstance(label, (list, tuple)):
        return list(label)
    if isinstance(label, str) and label.lstrip().startswith("["):
        try:
            decoded = json.loads(label)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, list) and decoded and all(isinstance(g, str) for g in decoded):
            return decoded
    return [label]


def _label_answers(label: Any) -> list:
    """The answers of a text label that a response could match: no None, no blank, no dict (a structure
    is another verifier's label)."""
    return [a for a in _answers(label) if a is not None and str(a).strip() and not isinstance(a, dict)]


# ---------------------------------------------------------------------------------------------
# math and gsm8k

# A number as models write one: thousands separators, decimals, a fraction; the sign may be U+2212, the
# typographic minus (dropping it would turn "\u22125" into a correct "5").
_NUMBER = re.compile(r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-\u2212]?\.\d+")


def _plain_number(text: str) -> str:
    """A `_NUMBER` match without its thousands separators, with an ASCII minus."""
    return text.replace(",", "").replace("\u2212", "-")


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
    return _plain_number(numbers[-1]) if numbers else None


def _signal_timeout_ok() -> bool:
    """math-verify's timeout is SIGALRM: usable only in the main thread, and only when the caller
    has no alarm pending (math-verify would cancel it, e.g. pytest-timeout's)."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None))


# Powers of powers, 4+ digit exponents and factorials: sympy computes them in C, where no signal
# reaches, for minutes. Without a timeout (off the main thread) such answers are compared as strings.
# Possessive quantifiers and a digit run matched only from its start: linear in the answer's length (the guard
# protects the path that has no timeout, so it must not be slow itself).
_SYMPY_UNSAFE = re.compile(r"(?:\^|\*\*)\s*+(?:\{\s*+)?[-+(\s]*+\d{4}"  # a 4+ digit exponent
                           r"|(?:\^|\*\*)\s*+\{[^{}^*]*+(?:\*(?!\*)[^{}^*]*+)*+(?:\^|\*\*)"  # a power in an exponent
                           r"|(?<!\d)\d{4,}+\s*+!")  # the factorial of a 4+ digit number
_POWER_OR_BINOMIAL = re.compile(r"\^|\*\*|\\[dt]?binom|\\choose")
_HUGE_IN_EXPONENT = re.compile(r"\^|\*\*|!|\d{4}")  # a power, a factorial or 4+ digits make a number huge
_HUGE_IN_BINOMIAL = re.compile(r"\^|\*\*|!|\d{6}")


def _exponent(text: str) -> str | None:
    """The exponent at the start of `text`: the inside of a braced or parenthesized group, or a bare token;
    None when the group does not close within `text`."""
    text = text.lstrip()
    if text[:1] not in ("{", "("):
        return re.match(r"[\w.!]*", text).group()
    depth = 0
    for i, ch in enumerate(text):
        if ch in "{(":
            depth += 1
        elif ch in "})":
            depth -= 1
            if depth == 0:
                return text[1:i]
    return None


def _sympy_unsafe(answer: str, window: int = 200) -> bool:
    """Whether sympy might compute for minutes on this answer: what _SYMPY_UNSAFE finds, and any power whose
    exponent (braced, in parentheses or bare: `9^(9^9)`, `9^{\\frac{9^9}{1}}`, `9^{9!!}`) holds a power, a
    factorial or a 4+ digit number, and a binomial followed by one of those or a 6+ digit number. Linear: each
    of at most 200 powers reads `window` characters ahead (an exponent longer than that is unsafe, and so
    are more powers)."""
    if _SYMPY_UNSAFE.search(answer):
        return True
    for n, m in enumerate(_POWER_OR_BINOMIAL.finditer(answer)):
        ahead = answer[m.end():m.end() + window]
        if n == 200:
            return True
        if m.group().endswith(("binom", "choose")):
            if _HUGE_IN_BINOMIAL.search(ahead):
                return True
            continue
        exponent = _exponent(ahead)
        if exponent is None or _HUGE_IN_EXPONENT.search(exponent):
            return True
    return False


# Full-width forms (U+FF01-FF5E: "４２", "ｘ") read as their ASCII characters; NFKC would also turn x² into x2.
_FULL_WIDTH_TO_ASCII = {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F)}


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
    pred = pred.translate(_FULL_WIDTH_TO_ASCII)
    t = int(math_timeout) if _signal_timeout_ok() and math_timeout else None
    # math_timeout bounds the row, not each math-verify call (a label with ten answers made ten calls)
    deadline = time.monotonic() + t if t else None

    def seconds_left() -> int | None:
        """The whole seconds (math-verify's timeouts are SIGALRM's) left of math_timeout; None: no timeout."""
        if deadline is None:
            return None
        left = pymath.ceil(deadline - time.monotonic())
        if left <= 0:  # 0 would switch math-verify's timeout off
            raise TimeoutException("math_timeout spent")
        return left

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # '["1/2", "0.5"]': several acceptable answers; "[1, 2]" stays an interval
    golds = _label_answers(label)
    if not golds:
        return _fail("bad_label", pred)
    if t is None and _sympy_unsafe(pred):
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
            gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=config, parsing_timeout=seconds_left(),
                                raise_on_error=True)
            # raise_on_error: math-verify otherwise scores a timeout as a silent False.
            if pred_parsed and gold_parsed and mv_verify(gold_parsed, pred_parsed, timeout_seconds=seconds_left(),
                                                         raise_on_error=True):
                return VerifierResult(1.0, None, pred)
        except TimeoutException:
            return _fail("timeout", pred)
        except Exception:
            pass
        if _math_norm(gold) == _math_norm(pred):
            return VerifierResult(1.0, None, pred)
    return VerifierResult(0.0, None, pred)


def _exact_number(s: str) -> fractions.Fraction | None:
    """A `_NUMBER` match as an exact rational (no float rounding: 2,000,001 is not 2,000,000); None when it
    has none (a zero denominator, or more digits than Python converts)."""
    num, _, den = _plain_number(s).partition("/")
    try:
        return fractions.Fraction(num) / fractions.Fraction(den or 1)
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k(response: str, label: Any) -> VerifierResult:
    """The last number in the response equals the label's (its last number) exactly as a rational: thousands
    separators removed, 42 = 42.0, a list label accepts any of its answers. open-instruct compares the two
    strings, so that "42.0" fails against "42".

    >>> gsm8k("12 + 30 = 42, so she has 1,234 apples.", "1234").score
    1.0
    """
    numbers = _NUMBER.findall(strip_think(response))
    if not numbers:
        return _fail("no_answer")
    pred = _plain_number(numbers[-1])
    golds = [g for g in (_NUMBER.findall(str(a)) for a in _label_answers(label)) if g]
    golds = [_exact_number(g[-1]) for g in golds]
    if not golds or None in golds:
        return _fail("bad_label", pred)
    value = _exact_number(pred)
    if value is None:  # more digits than Python converts (4,300): longer than any label here
        return VerifierResult(0.0, None, pred)
    return VerifierResult(float(value in golds), None, pred)


# ---------------------------------------------------------------------------------------------
# ifeval: the 54 instruction types of open-instruct's IFEvalG (Google's 25 IFEval ones plus 29 of
# its own), strict mode as its RL reward uses them, with their kwargs names. Behaviour follows that
# reference, quirks included, so that rewards match it; the differences are:
#   * no NLTK, whose punkt model downloads at run time: where the reference splits sentences with punkt
#     (number_sentences, and inside word_tokenize), `punkt_sentences` approximates it with the common
#     abbreviations and sentence starters of punkt's English model; `word_tokens` applies NLTK's Penn
#     Treebank rules to those sentences. Ids that use IFEval's regex splitter use `split_into_sentences`;
#   * a kwarg the reference draws at random when missing gets a fixed value from the same range
#     (so the score is the reference's whenever the draw cannot change it), and a missing word to
#     look for counts as absent from the response;
#   * every check is linear in the response: the reference's patterns that were quadratic on hostile
#     input (a leading \s* under re.MULTILINE, \[.*?\], <<[^\n]+>>, "first .*? last") are rewritten
#     to count the same things.


def split_into_sentences(text: str) -> list[str]:
    """IFEval's own regex sentence splitter (instructions_util.py); no NLTK download needed."""
    alphabets, prefixes, suffixes = "([A-Za-z])", "(Mr|St|Mrs|Ms|Dr)[.]", "(Inc|Ltd|Jr|Sr|Co)"
    starters = (r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|However\s|That\s"
                r"|This\s|Wherever)")
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


# Words that end in a period without ending a sentence unless the next word starts one: punkt's English model's
# abbreviation list (abbrev_types of NLTK's punkt_tab/english, 155 entries besides ". . ", which is never one
# whitespace-separated word; the same set is printed in nltk/nltk issue #2500). The single letters are initials,
# which `_ends_sentence` handles first.
_ABBREVIATIONS = frozenset(
    "adm ala ariz aug ave bros c calif chg cie co col colo conn corp cos ct d dec dr e f feb fla fri ft g "
    "ga gen h ill inc jan jr k kan ky l lt ltd m maj messrs mg mich minn mr mrs ms n nev nov oct ok okla "
    "ore p pa prof r rep reps s sen sep sept sr st sw t tenn tues v va vs vt w wash wed wis yr a.a a.c "
    "a.d a.g a.h a.m a.m.e a.s a.t b.f b.v c.i.t c.o.m.b c.v d.c d.h d.w e.f e.h e.l e.m f.g f.j g.d g.f "
    "g.k h.c h.f h.m i.m.s j.b j.c j.j j.k j.p j.r l.a l.f l.p m.b.a m.d.c m.j n.c n.d n.h n.j n.m n.v "
    "n.y p.a.m p.m ph.d r.a r.h r.i r.j r.k r.t s.a s.a.y s.c s.g s.p.a s.s t.j u.k u.n u.s u.s.a u.s.s.r "
    "w.c w.r w.va w.w"
    .split())
# Listed abbreviations that are also everyday words. punkt ends a sentence after an abbreviation before a
# capitalized word that its corpus statistics show is a sentence's first (seen lowercase, never capitalized in
# mid-sentence); without those statistics a capitalized word of unknown kind counts as a name (no break, right
# after "Dr." / "Mr."), except after these, where it is far more often the next sentence ("It is ok. Let me ...").
_WORD_ABBREVIATIONS = frozenset("ill ok ore wash wed".split())
_CLOSERS = "])}>\"'\u00bb\u201d\u2019"  # may follow a sentence's final period
_ENDERS = frozenset(".?!" + _CLOSERS)  # the last character of a word that may end a sentence
_OPEN_DOUBLE = re.compile(r"(?<=[ (\[{<])(?:\"|'')")
_OPEN_SINGLE = re.compile(r"(?i)(?<!\w)'(?!(?:re|ve|ll|m|t|s|d|n)\b)(?=\w)")
_PADDED = re.compile(r"\.{2,}|[;@#$%&\u2012-\u2015?!]")  # before the "' " rule; asterisks, brackets and dashes after
_PADDED_LATE = re.compile(r"[*\[\](){}<>]|--")
# Clitics split off before a space, in two passes as NLTK does: "can't'" ends in "'" first, then in "n't".
_CLITICS = (re.compile(r"(?<=[^' ])('[sSmMdD]|')(?= )"),
            re.compile(r"(?<=[^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T)(?= )"))
# MacIntyre's contractions, the ones needing a space before them after the others ("gonna'tis": gon na 't is).
_CONTRACTIONS = (re.compile(r"(?i)\b(?:(can)(not)|(d)('ye)|(gim|lem)(me)|(gon)(na)|(got)(ta)|(more)('n))\b"
                            r"|\b(wan)(na)(?=\s)"), re.compile(r"(?i) ('t)(is|was)\b"))


# Capitalized, these end a sentence even after an abbreviation (punkt's English sentence starters).
_SENTENCE_STARTERS = frozenset("according although among both but despite even he however i if in indeed instead it "
                               "many meanwhile moreover most nevertheless nonetheless nor sales separately similarly "
                               "since so some the there these they this though thus under when while yet".split())


# punkt's word tokens (its word_tokenize): "--" or "...", a word up to a mark that cannot be inside one ("I'm" is
# "I", "'m"), or one mark. The marks that cannot start one it splits off the front ("**Dr." is "*", "*", "Dr."; it
# keeps a quote: "'Dr." is no abbreviation to it).
_PUNKT_MARK = "[)\";}\\]*:@'({\\[\u2018\u2019\u201c\u201d\u00ab\u00bb!?]|-{2,}|\\.{2,}"
_PUNKT_TOKEN = re.compile(rf"-{{2,}}|\.{{2,}}|(?=[^(\"`{{\[:;&#*@)}}\]\-,])\S+?"
                          rf"(?=\s|$|{_PUNKT_MARK}|,(?=$|\s|{_PUNKT_MARK}))|\S")
_PUNKT_WORD_FRONT = "(\"`{[:;&#*@)}]-,"


def _ortho_starts_sentence(word: str) -> bool | None:
    """Whether the word looks like a sentence's first: punkt's orthographic evidence, guessed without its corpus
    statistics (a lowercase word or a punctuation mark does not; a capitalized common word does)."""
    if not word[:1].isalpha():
        return False if word[:1] in ";:,.!?" else None
    if word[:1].islower():
        return False
    return True if _PUNKT_TOKEN.match(word).group(0).rstrip(".").lower() in _SENTENCE_STARTERS else None


def _ends_sentence(word: str, next_word: str) -> bool:
    """Whether punkt would end a sentence after this word, approximately: after a final period, unless it is an
    ellipsis, or an abbreviation, initial or number that the next word does not show to end a sentence."""
    core = word.rstrip(_CLOSERS)
    if not core.endswith("."):
        return False
    starts = _ortho_starts_sentence(word[len(core):] or next_word)  # a closing bracket or quote comes next
    if core.endswith(".."):  # an ellipsis, like an abbreviation
        return starts is True
    stem = core[:-1].lstrip(_PUNKT_WORD_FRONT).lower()
    if not stem:
        return False
    if re.fullmatch(r"-?[.,]?\d[\d,.-]*", stem):  # a number: only a lowercase word or a mark keeps the sentence
        return starts is not False
    if len(stem) == 1 and stem.isalpha():  # an initial: some are listed abbreviations; a name may follow
        return stem not in _ABBREVIATIONS and (starts is True or starts is None and not next_word[:1].isupper())
    if stem in _ABBREVIATIONS or stem.split("-")[-1] in _ABBREVIATIONS:
        if stem in _WORD_ABBREVIATIONS:  # "ok.", "ill.": a capitalized word after one starts a sentence
            return starts is True or starts is None and next_word[:1].isupper()
        return starts is True
    return True


# A sentence's last period, before closing quotes/brackets and spaces (sentences are lines here).
_FINAL_PERIOD = re.compile(r"(?m)(?<=[^.\n])\.(?=[\]\)}>\"'\u00bb\u201d\u2019 ]*+[^\S\n]*$)")


def _treebank_tokens(lines: str) -> list[str]:
    """Tokens of sentences given one a line, by the Penn Treebank rules as NLTK's word tokenizer applies them
    to each sentence, in its order (all lines at once: a rule anchored at a sentence's start or end uses ^ / $)."""
    s = re.sub("([\u00ab\u201c\u2018\u201e]|`+)", r" \1 ", lines)
    s = _OPEN_DOUBLE.sub(" `` ", re.sub(r'(?m)^"', "``", s).replace("``", " `` "))
    s = _FINAL_PERIOD.sub(" . ", _OPEN_SINGLE.sub("' ", s))
    s = re.sub(r"(?m)([:,])$", r" \1 ", re.sub(r"([:,])([^\d])", r" \1 \2", s))  # not inside 1,000 or 10:30
    s = _PADDED_LATE.sub(r" \g<0> ", re.sub(r"([^'])' ", r"\1 ' ", _PADDED.sub(r" \g<0> ", s)))
    s = re.sub("([\u00bb\u201d\u2019])", r" \1 ", " " + s + " ").replace("''", " '' ").replace('"', " '' ")
    s = re.sub(r"\s+", " ", s)
    for rule in _CLITICS:
        s = rule.sub(r" \1", s)
    for rule in _CONTRACTIONS:
        s = rule.sub(lambda m: " " + " ".join(g for g in m.groups() if g) + " ", s)
    return s.split()


# Whitespace-separated words, also cut after a period that punkt sees as ending a sentence before a mark ("bold.**").
_WORD_PIECES = re.compile(r"\S*?\.(?=[?!;*:@({\[])|\S+")
_NON_SPACE = re.compile(r"\S+")
_INNER_END = re.compile(r"[.?!]\S")  # a word with a sentence end inside has one of these


def _split_trailing_marks(last: str) -> list[str]:
    """At the end of the text punkt cuts a word after its last '.', '?' or '!' that another mark follows
    ("Really???" -> "Really??", "?"), unless only closing quotes/brackets are left."""
    cuts = [m.end() for m in re.finditer(r"[.?!](?=[?!)\";}\]*:@'({\[])", last)]
    if cuts and last[cuts[-1]:].strip("\"')]}"):
        head, tail = last[:cuts[-1]], last[cuts[-1]:]
        if head[-1] in "?!" or _ends_sentence(head, tail):
            return [head, tail]
    return [last]


def _breaks_inside(word: str) -> bool:
    """Whether punkt sees a sentence end inside this word, before its last token ("Smith." in 'Smith."'). punkt
    judges a period by its word and the next one together, so such a next word ends a sentence there too:
    'Call Dr. Smith."' is 'Call Dr.', 'Smith."'."""
    if not _INNER_END.search(word):
        return False
    tokens = _PUNKT_TOKEN.findall(word)
    return any(t in ".?!" or _ends_sentence(t, n) for t, n in zip(tokens, tokens[1:]))


def punkt_sentences(text: str) -> list[str]:
    """Sentences roughly as NLTK's punkt (English model) finds them, with no model to download: after '?' / '!',
    and after a final period unless `_ends_sentence` says the period is an abbreviation's, an initial's or a
    number's (and even then where the next word holds a sentence end, `_breaks_inside`); not at line breaks.
    Used where the reference counts sentences with punkt."""
    sentences, start = [], 0
    words = list(_WORD_PIECES.finditer(text))
    for m, following in zip(words, words[1:]):
        word = m.group(0)
        if word[-1] not in _ENDERS:
            continue
        if (word.rstrip(_CLOSERS)[-1:] in ("?", "!") or _ends_sentence(word, following.group(0))
                or word[-1] == "." and following.start() > m.end()
                and _breaks_inside(_NON_SPACE.match(text, following.start()).group(0))):
            sentences.append(text[start:m.end()].strip())
            start = m.end()
    rest = text[start:].strip()
    if not rest:
        return sentences
    last = words[-1].group(0)
    return sentences + [rest[:len(rest) - len(last)] + p if i == 0 else p
                        for i, p in enumerate(_split_trailing_marks(last))]


def word_tokens(text: str) -> list[str]:
    """Words as NLTK's word_tokenize gives them (Penn Treebank rules: punctuation, quotes and clitics such as
    n't / 's are tokens, a sentence's final period is one, hyphenated words stay whole), with `punkt_sentences`."""
    # A line break inside a sentence is a tab here: whitespace to every rule, and no sentence boundary.
    return _treebank_tokens("\n".join(sentence.replace("\n", "\t") for sentence in punkt_sentences(text)))


def _label_regex(pattern: str, flags: int = 0, word: bool = False) -> re.Pattern:
    """Keywords in labels are regexes in the reference (unescaped); one that does not compile is taken literally."""
    wrap = (lambda p: r"\b" + p + r"\b") if word else (lambda p: p)
    try:
        return re.compile(wrap(pattern), flags)
    except re.error:
        return re.compile(wrap(re.escape(pattern)), flags)


def _occurrences(text: str, keyword: str | None) -> int:
    """Case-insensitive matches of a keyword; a missing keyword (drawn at random by the reference) is absent."""
    return len(_label_regex(keyword.strip(), re.I).findall(text)) if keyword else 0


def _count(value: Any, default: int) -> int:
    """A count kwarg: missing or negative takes the default (the reference draws one from a range holding it)."""
    return default if value is None or int(value) < 0 else int(value)


def _truthy(value: Any, default: int) -> int:
    """A count kwarg that the reference replaces when falsy (0 included)."""
    return int(value) if value else default


def _relation(relation: str | None) -> str:
    if relation is None:
        return "at least"  # the reference draws one of the two
    if relation not in ("less than", "at least"):
        raise ValueError(f"unknown relation {relation!r}")
    return relation


def _compare(count: int, relation: str | None, n: int) -> bool:
    return count < n if _relation(relation) == "less than" else count >= n


def _detect_language(text: str) -> str | None:
    import langdetect

    langdetect.DetectorFactory.seed = 0  # langdetect is random without a seed
    try:
        return langdetect.detect(text)
    except langdetect.LangDetectException:
        return None  # IFEval counts an undetectable language as followed


def _star_paragraph_count(text: str) -> int | None:
    """Paragraphs between *** dividers; None when one in the middle is empty."""
    paragraphs = re.split(r"\s?\*\*\*\s?", text)
    count = len(paragraphs)
    for i, p in enumerate(paragraphs):
        if not p.strip():
            if i not in (0, len(paragraphs) - 1):
                return None
            count -= 1
    return count


# --- Google's 25 IFEval instructions


def keyword_existence(t: str, keywords: list[str] | None = None) -> bool:
    """Every keyword occurs (case-insensitive, substring)."""
    return bool(keywords) and all(_label_regex(k, re.I).search(t) for k in keywords)


def keyword_frequency(t: str, keyword: str | None = None, frequency: int | None = None,
                      relation: str | None = None) -> bool:
    """The keyword occurs `relation` `frequency` times (case-insensitive, substring)."""
    return _compare(_occurrences(t, keyword), relation, _count(frequency, 1))


def forbidden_words(t: str, forbidden_words: list[str] | None = None) -> bool:
    """None of the words occurs as a whole word (case-insensitive)."""
    return not any(_label_regex(w, re.I, word=True).search(t) for w in forbidden_words or [])


def letter_frequency(t: str, letter: str | None = None, let_frequency: int | None = None,
                     let_relation: str | None = None) -> bool:
    """The ASCII letter (either case) occurs `let_relation` `let_frequency` times."""
    valid = bool(letter) and len(letter) == 1 and "a" <= letter.lower() <= "z"
    count = t.lower().count(letter.lower()) if valid else 0  # an invalid letter is drawn at random: absent
    return _compare(count, let_relation, _count(let_frequency, 1))


def response_language(t: str, language: str | None = None) -> bool:
    """langdetect names the language (an undetectable text passes)."""
    return _detect_language(t) in (None, "en" if language is None else language)


def number_sentences(t: str, num_sentences: int | None = None, relation: str | None = None) -> bool:
    """Sentence count (as punkt splits them) `relation` `num_sentences`."""
    return _compare(len(punkt_sentences(t)), relation, _count(num_sentences, 1))


def number_paragraphs(t: str, num_paragraphs: int | None = None) -> bool:
    """Exactly `num_paragraphs` paragraphs between *** dividers, none empty."""
    return _star_paragraph_count(t) == _count(num_paragraphs, 1)


def number_words(t: str, num_words: int | None = None, relation: str | None = None) -> bool:
    """Count of \\w+ runs `relation` `num_words`."""
    return _compare(len(re.findall(r"\w+", t)), relation, _count(num_words, 100))


def nth_paragraph_first_word(t: str, num_paragraphs: int | None = None, nth_paragraph: int | None = None,
                             first_word: str | None = None) -> bool:
    """`num_paragraphs` non-empty paragraphs split by blank lines, the nth starting with `first_word`."""
    num = _count(num_paragraphs, 1)
    nth = int(nth_paragraph) if nth_paragraph is not None else 0
    if not 1 <= nth <= num or not first_word:
        return False  # the reference draws these at random, possibly one past the last paragraph
    paragraphs = t.split("\n\n")
    count = sum(1 for p in paragraphs if p.strip())
    if nth > count or not paragraphs[nth - 1].strip():
        return False
    word = paragraphs[nth - 1].split()[0].lstrip("'").lstrip('"')
    got = re.match(r"[^.,?!'\"]*", word).group(0).lower()
    return count == num and got == first_word.lower()


def number_placeholders(t: str, num_placeholders: int | None = None) -> bool:
    """At least `num_placeholders` [bracketed] spans on one line."""
    # Counts what \[.*?\] finds: each ']' whose nearest bracket before it on its line is '['.
    return len(re.findall(r"\[[^\[\]\n]*\]", t)) >= _count(num_placeholders, 1)


def postscript(t: str, postscript_marker: str | None = None) -> bool:
    """The marker occurs (case-insensitive; P.S. / P.P.S allow a space after each period)."""
    marker = ("P.S." if postscript_marker is None else postscript_marker).strip()
    patterns = {"P.P.S": r"p\.\s?p\.\s?s", "P.S.": r"p\.\s?s\."}
    pattern = re.compile(patterns[marker]) if marker in patterns else _label_regex(marker.lower())
    return pattern.search(t.lower()) is not None


def number_bullet_lists(t: str, num_bullets: int | None = None) -> bool:
    """Exactly `num_bullets` lines starting with '* ' or '-' (markdown bullets)."""
    # [^\S\n]* in place of \s*: the same lines, without the quadratic scan of blank lines.
    stars = re.findall(r"^[^\S\n]*\*[^\*].*$", t, re.M)
    return len(stars) + len(re.findall(r"^[^\S\n]*-.*$", t, re.M)) == _count(num_bullets, 1)


def constrained_response(t: str) -> bool:
    """Contains 'My answer is yes.', '... no.' or '... maybe.'."""
    return any(o in t for o in ("My answer is yes.", "My answer is no.", "My answer is maybe."))


def number_highlighted_sections(t: str, num_highlights: int | None = None) -> bool:
    """At least `num_highlights` non-empty *single* or **double** starred spans on one line."""
    count = sum(1 for h in re.findall(r"\*[^\n\*]*\*", t) if h.strip("*").strip())
    count += sum(1 for h in re.findall(r"\*\*[^\n\*]*\*\*", t) if h[2:-2].strip())
    return count >= _count(num_highlights, 1)


def multiple_sections(t: str, section_spliter: str | None = None, num_sections: int | None = None) -> bool:
    """At least `num_sections` '<spliter> <number>' headers (case-sensitive)."""
    spliter = ("Section" if section_spliter is None else section_spliter).strip()
    try:
        pattern = re.compile(r"\s?" + spliter + r"\s?\d+\s?")
    except re.error:
        pattern = re.compile(r"\s?" + re.escape(spliter) + r"\s?\d+\s?")
    return len(pattern.split(t)) - 1 >= _count(num_sections, 1)


def json_format(t: str) -> bool:
    """The whole response, less a ``` / ```json fence, parses as JSON."""
    t = t.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        t = t.removeprefix(prefix)
    try:
        json.loads(t.removesuffix("```").strip())
        return True
    except (ValueError, RecursionError):
        return False


def title(t: str) -> bool:
    """A line holds a <<title>> with something in it."""
    # Same answer as any(m.strip("<>") for m in findall("<<[^\n]+>>")), which is quadratic on a line of '<':
    # per line the one candidate runs from the first '<<' to the last '>>'.
    for line in t.split("\n"):
        start, end = line.find("<<"), line.rfind(">>")
        if start >= 0 and end >= start + 3 and line[start:end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


def two_responses(t: str) -> bool:
    """Two different non-empty responses separated by ******."""
    parts = t.split("******")
    valid = []
    for i, part in enumerate(parts):
        if part.strip():
            valid.append(part.strip())
        elif i not in (0, len(parts) - 1):
            return False
    return len(valid) == 2 and valid[0] != valid[1]


def _prompt(prompt_to_repeat: str | None) -> str:
    if not prompt_to_repeat:
        raise ValueError("prompt_to_repeat must be set")
    return prompt_to_repeat.strip().lower()


def repeat_prompt(t: str, prompt_to_repeat: str | None = None) -> bool:
    """Starts with the prompt (case-insensitive)."""
    return t.strip().lower().startswith(_prompt(prompt_to_repeat))


def end_checker(t: str, end_phrase: str | None = None) -> bool:
    """Ends with the phrase (case-insensitive, outer quotes ignored)."""
    phrase = "Any other questions?" if end_phrase is None else end_phrase
    return t.strip().strip('"').lower().endswith(phrase.strip().lower())


def capital_word_frequency(t: str, capital_frequency: int | None = None, capital_relation: str | None = None) -> bool:
    """Count of all-capital words `capital_relation` `capital_frequency`."""
    n = 1 if capital_frequency is None else int(capital_frequency)  # no check for negatives here
    return _compare(sum(1 for w in word_tokens(t) if w.isupper()), capital_relation, n)


def english_capital(t: str) -> bool:
    """All capitals, and English (or undetectable)."""
    return t.isupper() and _detect_language(t) in (None, "en")


def english_lowercase(t: str) -> bool:
    """All lowercase, and English (or undetectable)."""
    return t.islower() and _detect_language(t) in (None, "en")


def no_comma(t: str) -> bool:
    """No ','."""
    return "," not in t


def quotation(t: str) -> bool:
    """Wrapped in double quotes."""
    t = t.strip()
    return len(t) > 1 and t[0] == '"' and t[-1] == '"'


# --- open-instruct's 29 further instructions


def _find_phrases(t: str, first: str, last: str) -> list[str]:
    """What re.findall(f"{first} .*? {last}", t) returns, in linear time for plain words."""
    if re.search(r"[.^$*+?{}\[\]\\|()]", first + last):  # a regex as the reference reads it: quadratic at worst
        import regex  # re has no timeout; this one does (a requirement of transformers)

        try:
            return regex.findall(rf"{first} .*? {last}", t, timeout=1.0)
        except (TimeoutError, regex.error):
            return []  # a response built to stall the match (or a phrase that is no regex) is not followed
    found = []
    for line in t.split("\n"):  # '.' does not cross a newline
        pos = 0
        while (i := line.find(first + " ", pos)) >= 0:
            j = line.find(" " + last, i + len(first) + 1)
            if j < 0:
                break  # no later start can find one either
            pos = j + 1 + len(last)
            found.append(line[i:pos])
    return found


def repeat_phrase(t: str, phrase: str | None = None, small_n: int | None = None) -> bool:
    """The phrase (from its first word to its last) appears `small_n` times, each of the same length with at most
    one word changed, and the last one with exactly one changed."""
    if not phrase or not phrase.split():
        return False  # drawn at random by the reference: taken as absent
    ref = phrase.strip().split()
    found = _find_phrases(t, ref[0], ref[-1])
    if len(found) != _truthy(small_n, 2):
        return False
    differences = 0
    for words in (f.split() for f in found):
        if len(words) != len(ref):
            return False
        differences = sum(a != b for a, b in zip(words, ref))
        if differences > 1:
            return False
    return differences == 1


def copy_prompt(t: str, prompt_to_repeat: str | None = None) -> bool:
    """The response is the prompt (case-insensitive, outer whitespace ignored)."""
    return t.strip().lower() == _prompt(prompt_to_repeat)


def copy_span_idx(t: str, prompt_to_repeat: str | None = None, n_start: int | None = None,
                  n_end: int | None = None) -> bool:
    """The response is prompt[n_start:n_end] (case-insensitive, outer whitespace ignored)."""
    _prompt(prompt_to_repeat)
    start = _truthy(n_start, 0)
    end = _truthy(n_end, len(prompt_to_repeat) - 1)
    return t.strip().lower() == prompt_to_repeat[start:end].strip().lower()


def sentence_hyphens(t: str) -> bool:
    """Sentences are joined by '-' with no spaces around them."""
    gold = split_into_sentences(t.replace("-", " "))
    return all(s.strip() == s and s == g for s, g in zip(t.split("-"), gold))


def no_adjacent_consecutive(t: str) -> bool:
    """No two adjacent words start with consecutive letters (by code point, case-insensitive)."""
    words = t.split()
    for a, b in zip(words, words[1:]):
        first, second = a[0].lower(), b[0].lower()
        if len(first) != 1 or len(second) != 1 or ord(second) - ord(first) == 1:
            return False
    return True


def square_brackets(t: str) -> bool:
    """Every whitespace-separated word is [wrapped]."""
    return all(w.startswith("[") and w.endswith("]") for w in t.split())


def word_once(t: str, keyword: str | None = None) -> bool:
    """The keyword occurs exactly once (case-insensitive, substring)."""
    return _occurrences(t, keyword) == 1


def exclude_word_harder(t: str, keyword: str | None = None, instruction: str | None = None) -> bool:
    """The keyword never occurs between two spaces (case-sensitive)."""
    if not keyword and not (instruction and instruction.split()):
        raise ValueError("keyword must be set")  # the reference fails too: it would draw one from `instruction`
    keyword = keyword or instruction.split()[0]  # the reference draws a word of the instruction at random
    return " " + keyword.strip() + " " not in t


def paragraphs_stars(t: str) -> bool:
    """Exactly 2 paragraphs between *** dividers."""
    return _star_paragraph_count(t) == 2


def paragraphs_blank_lines(t: str) -> bool:
    """Exactly 2 paragraphs separated by a blank line, none empty in the middle."""
    parts = t.split("\n\n")
    count = len(parts)
    for i, p in enumerate(parts):
        if not p.strip():
            if i not in (0, len(parts) - 1):
                return False
            count -= 1
    return count == 2


def _one_word(word: Any) -> str | None:
    """first_word / last_word / keyword kwargs may come as a list: the reference takes its first item."""
    if not word:
        return None
    return (word if isinstance(word, str) else word[0]).strip()


def first_word_sent(t: str, first_word: str | list | None = None) -> bool:
    """Every sentence starts with the word (case-insensitive)."""
    word = _one_word(first_word)
    for sentence in split_into_sentences(t):
        if not sentence.strip() or word is None or sentence.split()[0].lower() != word.lower():
            return False
    return True


def first_word_answer(t: str, first_word: str | None = None) -> bool:
    """The response starts with the word (case-insensitive, punctuation included)."""
    return bool(first_word) and bool(t.split()) and t.split()[0].lower() == first_word.strip().lower()


def _bare(word: str) -> str:
    return re.sub(r"[^\w\s]", "", word).lower()


def last_word_sent(t: str, last_word: str | list | None = None) -> bool:
    """Every sentence ends with the word, punctuation removed (case-insensitive)."""
    word = _one_word(last_word)
    for sentence in split_into_sentences(t):
        if not sentence.strip() or word is None or _bare(sentence.split()[-1]) != word.lower():
            return False
    return True


def last_word_answer(t: str, last_word: str | None = None) -> bool:
    """The response ends with the word, punctuation removed (case-insensitive)."""
    return bool(last_word) and _bare(t.split()[-1]) == last_word.strip().lower()


def bigram_wrapping(t: str) -> bool:
    """Words come in pairs <<like this>> (a final odd word is not checked)."""
    words = t.split()
    return all(words[i].startswith("<<") and words[i + 1].endswith(">>") for i in range(0, len(words) - 1, 2))


def copying_multiple(t: str, prompt_to_repeat: str | None = None, N: int | None = None) -> bool:
    """The prompt N times separated by ****** and nothing else (case-insensitive)."""
    prompt = _prompt(prompt_to_repeat)
    parts = t.split("******")
    return len(parts) == _truthy(N, 2) and all(p.strip().lower() == prompt for p in parts)


def punctuation_dot(t: str) -> bool:
    """No '.'."""
    return "." not in t


def punctuation_exclamation(t: str) -> bool:
    """No '!'."""
    return "!" not in t


def lowercase_counting(t: str, N: int | None = None) -> bool:
    """At most N all-lowercase ASCII words."""
    return len(re.findall(r"\b[a-z]+\b", t)) <= _truthy(N, 2)


def letter_counting(t: str, N: int | None = None, relation: str | None = None) -> bool:
    """Count of ASCII letters `relation` N (any other relation is never followed)."""
    count, n = len(re.findall(r"[a-zA-Z]", t)), _truthy(N, 2)
    relation = relation or "at least"
    return count >= n if relation == "at least" else count < n if relation == "less than" else False


def counting_composition(t: str, n_sent: int | None = None, n_words: int | None = None) -> bool:
    """3 paragraphs between *** dividers, each of n_sent sentences of n_words words (tokens)."""
    n_sent, n_words = _truthy(n_sent, 2), _truthy(n_words, 2)
    paragraphs = re.split(r"\s?\*\*\*\s?", t)
    count = len(paragraphs)
    for i, p in enumerate(paragraphs):
        if not p.strip():
            if i not in (0, len(paragraphs) - 1):
                return False
            count -= 1  # and still checked below: an empty end paragraph has no sentences, so fails
        sentences = split_into_sentences(p)
        if len(sentences) != n_sent or any(len(word_tokens(s)) != n_words for s in sentences):
            return False
    return count == 3


def count_unique(t: str) -> bool:
    """No token repeats (case-sensitive, punctuation tokens included)."""
    words = word_tokens(t)
    return len(words) == len(set(words))


def count_increment_word(t: str, keyword1: str | None = None, keyword2: str | None = None) -> bool:
    """keyword1 occurs once and keyword2 twice (case-insensitive, substring)."""
    if not keyword1 or not keyword2:
        raise ValueError("keyword1 and keyword2 must be set")  # the reference fails on its own default here
    return _occurrences(t, keyword1) == 1 and _occurrences(t, keyword2) == 2


def palindrome(t: str) -> bool:
    """Some whitespace-separated word reads the same reversed (one character counts)."""
    return any(w == w[::-1] for w in t.split())


def keyword_specific_position(t: str, keyword: str | list | None = None, n: int | None = None,
                              m: int | None = None) -> bool:
    """The m-th token of the n-th sentence is the keyword (case-sensitive)."""
    keyword, n, m = _one_word(keyword), _truthy(n, 1), _truthy(m, 1)
    sentences = split_into_sentences(t)
    if keyword is None or len(sentences) < n:
        return False
    words = word_tokens(sentences[n - 1])
    return len(words) >= m and words[m - 1] == keyword


def start_end(t: str) -> bool:
    """The first and last tokens are the same word (case-insensitive; a final '.' is a token)."""
    words = word_tokens(t)
    return len(words) >= 2 and words[0].lower() == words[-1].lower()


IFEVAL_CHECKS: dict[str, Callable[..., bool]] = {
    "keywords:existence": keyword_existence,
    "keywords:frequency": keyword_frequency,
    "keywords:forbidden_words": forbidden_words,
    "keywords:letter_frequency": letter_frequency,
    "language:response_language": response_language,
    "length_constraints:number_sentences": number_sentences,
    "length_constraints:number_paragraphs": number_paragraphs,
    "length_constraints:number_words": number_words,
    "length_constraints:nth_paragraph_first_word": nth_paragraph_first_word,
    "detectable_content:number_placeholders": number_placeholders,
    "detectable_content:postscript": postscript,
    "detectable_format:number_bullet_lists": number_bullet_lists,
    "detectable_format:constrained_response": constrained_response,
    "detectable_format:number_highlighted_sections": number_highlighted_sections,
    "detectable_format:multiple_sections": multiple_sections,
    "detectable_format:json_format": json_format,
    "detectable_format:title": title,
    "combination:two_responses": two_responses,
    "combination:repeat_prompt": repeat_prompt,
    "startend:end_checker": end_checker,
    "change_case:capital_word_frequency": capital_word_frequency,
    "change_case:english_capital": english_capital,
    "change_case:english_lowercase": english_lowercase,
    "punctuation:no_comma": no_comma,
    "startend:quotation": quotation,
    "copy:repeat_phrase": repeat_phrase,
    "copy:copy": copy_prompt,
    "new:copy_span_idx": copy_span_idx,
    "detectable_format:sentence_hyphens": sentence_hyphens,
    "keywords:no_adjacent_consecutive": no_adjacent_consecutive,
    "detectable_format:square_brackets": square_brackets,
    "keywords:word_once": word_once,
    "keywords:word_count_different_numbers": keyword_frequency,
    "keywords:exclude_word_harder": exclude_word_harder,
    "paragraphs:paragraphs": paragraphs_stars,
    "paragraphs:paragraphs2": paragraphs_blank_lines,
    "first_word:first_word_sent": first_word_sent,
    "first_word:first_word_answer": first_word_answer,
    "last_word:last_word_sent": last_word_sent,
    "last_word:last_word_answer": last_word_answer,
    "detectable_format:bigram_wrapping": bigram_wrapping,
    "copy:copying_simple": copy_prompt,
    "copy:copying_multiple": copying_multiple,
    "punctuation:punctuation_dot": punctuation_dot,
    "punctuation:punctuation_exclamation": punctuation_exclamation,
    "count:lowercase_counting": lowercase_counting,
    "letters:letter_counting": letter_counting,
    "letters:letter_counting2": letter_frequency,
    "count:counting_composition": counting_composition,
    "count:count_unique": count_unique,
    "count:count_increment_word": count_increment_word,
    "keywords:palindrome": palindrome,
    "keywords:keyword_specific_position": keyword_specific_position,
    "keywords:start_end": start_end,
}


def _parse_literal(label: Any) -> Any:
    """A label string is JSON or, as open-instruct's ground_truth is, a Python literal (single quotes, None)."""
    if not isinstance(label, str):
        return label
    try:
        return json.loads(label)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(label.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError("label is neither JSON nor a Python literal") from e


def _ifeval_instructions(label: Any) -> list[tuple[str, dict]]:
    item = _parse_literal(label)
    if isinstance(item, (list, tuple)):  # Olmo's RLVR rows: a list whose first element is the dict
        if not item:
            raise ValueError("empty label")
        item = _parse_literal(item[0])
    if not isinstance(item, dict):
        raise ValueError("label is not an IFEval dict")
    ids = item.get("instruction_id_list", item.get("instruction_id"))
    ids = [ids] if isinstance(ids, str) else list(ids or [])
    kwargs = item.get("kwargs") or [{}] * len(ids)
    kwargs = [_parse_literal(k) for k in (kwargs if isinstance(kwargs, list) else [kwargs])]
    if len(kwargs) != len(ids):
        raise ValueError("instruction_id_list and kwargs differ in length")
    if not ids:
        raise ValueError("no instructions")
    # The HF dataset fills every kwargs dict with all keys, None where unused.
    return [(i, {k: v for k, v in (kw or {}).items() if v is not None}) for i, kw in zip(ids, kwargs)]


def _answer_text(response: str) -> str:
    """The part that is checked, as open-instruct's IFEvalG reward takes it: what follows the last </think>,
    without <answer> tags. With no </think> the whole text is checked, an unclosed <think> included (the
    reference splits on </think> only; the other verifiers' `strip_think` would leave no answer)."""
    text = response.rsplit("</think>", 1)[1] if "</think>" in response else response
    return text.replace("<|assistant|>", "").replace("<answer>", "").replace("</answer>", "").strip()


def ifeval(response: str, label: Any) -> VerifierResult:
    """Fraction of IFEval / IFEvalG instructions followed (strict), after removing <think>.

    >>> ifeval("hello world", {"instruction_id_list": ["punctuation:no_comma", "change_case:english_capital"],
    ...                        "kwargs": [{}, {}]}).score
    0.5
    >>> ifeval("One. Two.", "[{'instruction_id': ['length_constraints:number_sentences', 'punctuation:no_comma'], "
    ...        "'kwargs': [{'num_sentences': 3, 'relation': 'at least'}, None]}]").score
    0.5
    """
    try:
        instructions = _ifeval_instructions(label)
    except (ValueError, TypeError, AttributeError) as e:
        return _fail("bad_label", message=str(e)[:200])
    text = _answer_text(response)
    if not text:
        return _fail("no_answer")  # an empty reply would "follow" no_comma, forbidden_words, ...
    followed = []
    for inst_id, kwargs in instructions:
        check = IFEVAL_CHECKS.get(inst_id) if isinstance(inst_id, str) else None
        if check is None:
            return _fail("bad_label", message=f"unknown instruction {inst_id}")
        try:
            followed.append(bool(check(text, **kwargs)))
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError,
                re.error) as e:  # malformed kwargs
            return _fail("bad_label", message=f"{inst_id}: {e}"[:200])
    details = {"followed": dict(zip((i for i, _ in instructions), followed))}
    return VerifierResult(sum(followed) / len(followed), None, None, details=details)


# ---------------------------------------------------------------------------------------------
# string_match, string_f1, max_length


_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    s = str(s).lower().translate(_DROP_PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _text_golds(label: Any) -> list[str]:
    """The normalized answers of a string_match / string_f1 label; none that normalizes to nothing (a None,
    an empty string or list: a bad label, never an answer that "none" or an empty response would match)."""
    return [g for g in map(normalize_answer, _label_answers(label)) if g]


def _short_answer(response: str) -> str:
    text = strip_think(response)
    # The last of re.findall(r"<answer>(.*?)</answer>", text, re.S), found in linear time (that regex is
    # quadratic in the number of unclosed tags).
    last, pos = None, 0
    while (start := text.find("<answer>", pos)) >= 0 and (end := text.find("</answer>", start + 8)) >= 0:
        last, pos = text[start + 8:end], end + 9
    return last.strip() if last is not None else text


def string_match(response: str, label: Any) -> VerifierResult:
    """Normalized exact match against any of the labels.

    >>> string_match("<answer>The Eiffel Tower!</answer>", ["eiffel tower", "tour eiffel"]).score
    1.0
    """
    pred, golds = normalize_answer(_short_answer(response)), _text_golds(label)
    if not golds:
        return _fail("bad_label", pred)
    if not pred:
        return _fail("no_answer")
    return VerifierResult(float(pred in golds), None, pred)


def _f1(pred: collections.Counter, gold: collections.Counter) -> float:
    """Token F1 of two bags of normalized words."""
    common = sum((pred & gold).values())
    if common == 0:
        return 0.0
    precision, recall = common / sum(pred.values()), common / sum(gold.values())
    return 2 * precision * recall / (precision + recall)


def string_f1(response: str, label: Any) -> VerifierResult:
    """Token F1 (SQuAD), max over labels.

    >>> round(string_f1("the big red dog", "red dog").score, 3)
    0.8
    """
    pred, golds = _short_answer(response), _text_golds(label)
    if not golds:
        return _fail("bad_label", pred[:200])
    words = collections.Counter(normalize_answer(pred).split())  # once, not once per label
    if not words:
        return _fail("no_answer")
    return VerifierResult(max(_f1(words, collections.Counter(g.split())) for g in golds), None, pred[:200])


def _length_and_target(response: str, label: Any, num_tokens: int | None) -> tuple[int, float, float]:
    label = _maybe_json(label)
    scale = 8192.0  # open-instruct's max_length_verifier_max_length
    try:
        if isinstance(label, dict):
            scale = float(label.get("scale", scale))
            label = label.get("max_length")
        target = float(label)
    except (TypeError, ValueError, OverflowError) as e:
        raise LabelError(f"max_length label {str(label)[:100]!r} is not a number") from e
    if not (pymath.isfinite(target) and pymath.isfinite(scale) and scale > 0):
        raise LabelError(f"max_length label: length {target} and scale {scale} must be finite, scale > 0")
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
# code: model-written code, run and judged by sandbox.py (see its docstring)

def extract_code(response: str) -> str | None:
    """The last fenced python block (```python / ```py / ```python3), else the last bare ``` block."""
    text = strip_think(response)
    blocks = re.findall(r"```[ \t]*(python3?|py)[ \t]*\n(.*?)```", text, flags=re.S | re.I)
    if blocks:
        return blocks[-1][1]
    bare = re.findall(r"```[ \t]*\n(.*?)```", text, flags=re.S)
    return bare[-1] if bare else None


def _refused(allow_unsandboxed_code: bool) -> VerifierResult | None:
    """Model-written code runs unisolated only when the caller says so."""
    if sandbox.sandbox_mode() != "none" or allow_unsandboxed_code:
        return None
    return _fail("sandbox_unavailable", message="no isolation for model-written code here (see sandbox_description"
                 "()); allow_unsandboxed_code=True (--allow_unsandboxed_code) runs it as this user, unisolated")


def _check_code(response: str) -> tuple[str | None, VerifierResult | None]:
    program = extract_code(response)
    if program is None or not program.strip():
        return None, _fail("no_answer")
    try:
        compile(program, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        return None, _fail("syntax_error", program[:2000], message=str(e)[:200])
    return program, None


def code(response: str, label: Any, code_timeout: float = 5.0, code_memory_mb: int = 1024, budget: float | None = None,
         allow_unsandboxed_code: bool = False) -> VerifierResult:
    """Fraction of tests that pass, each in a fresh process of one sandboxed run, judged as sandbox.py says.

    >>> code("```python\\ndef f(x):\\n    return 2 * x\\n```", ["assert f(2) == 4", "assert f(3) == 7"]).score
    0.5
    """
    tests = [t for t in _as_list(label) if isinstance(t, str) and t.strip()]
    if not tests:
        return _fail("bad_label")
    program, failed = _check_code(response)
    if failed:
        return failed
    refused = _refused(allow_unsandboxed_code)
    if refused:
        return refused
    verdict = sandbox.judge_asserts(program, tests, min(code_timeout, budget) if budget else code_timeout,
                                    code_memory_mb)
    if verdict["status"] == "sandbox_error":
        return _fail("sandbox_error", program[:2000], message=verdict["stderr"])
    if not verdict["judged"]:  # no test parses: the label's fault, never a 0
        return _fail("unsupported_tests", program[:2000], message="no test parses as Python")
    details = {key: verdict[key] for key in ("passed", "status", "judged_inside", "unsupported", "too_large",
                                             "not_plain", "seconds", "stderr")}
    return VerifierResult(verdict["passed"] / verdict["judged"], None, program[:2000],
                          details={**details, "total": len(tests)})


def _stdio_tests(label: Any) -> list[tuple[str, str]]:
    label = _maybe_json(label)
    if isinstance(label, dict) and "inputs" in label:  # LiveCodeBench / APPS style
        inputs, outputs = label["inputs"], label.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            return []  # a bad label (code_stdio says so)
        label = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    tests = []
    for t in label if isinstance(label, list) else []:
        t = _maybe_json(t)
        if isinstance(t, dict) and "input" in t and "output" in t:
            tests.append((str(t["input"]), str(t["output"])))
    return tests


def code_stdio(response: str, label: Any, code_timeout: float = 5.0, code_memory_mb: int = 1024,
               budget: float | None = 8.0, allow_unsandboxed_code: bool = False) -> VerifierResult:
    """Fraction of stdin -> stdout tests passed; one sandbox per row, a fresh process per test, within
    `budget` seconds in all (tests not reached count as failed).

    >>> code_stdio("```python\\nprint(int(input()) * 2)\\n```", [{"input": "2\\n", "output": "4\\n"}]).score
    1.0
    """
    tests = _stdio_tests(label)
    if not tests:
        return _fail("bad_label")
    program, failed = _check_code(response)
    if failed:
        return failed
    refused = _refused(allow_unsandboxed_code)
    if refused:
        return refused
    run = sandbox.run_stdio_tests(program, tests, code_timeout, code_memory_mb, budget)
    if run["status"] == "sandbox_error":
        return _fail("sandbox_error", program[:2000], message=run["stderr"])
    return VerifierResult(run["passed"] / len(tests), None, program[:2000],
                          details={"passed": run["passed"], "total": len(tests), "statuses": run["statuses"],
                                   "output_limit": run["statuses"].count("output_limit")})


def python_tool(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output_chars: int = 4000,
                allow_unsandboxed_code: bool = False) -> str:
    """grpo.py's built-in `python` tool (tool episodes): run model-written code in the code sandbox, as the code
    verifiers do, and return what it printed: stdout, then stderr, each cut to `max_output_chars`, and how it
    ended when not normally. Raises where no sandbox exists and allow_unsandboxed_code is off; the rollout then
    answers the model with the error, as for any failing tool.

    >>> python_tool("print(6 * 7)", allow_unsandboxed_code=True)
    '42\\n'
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, not {type(code).__name__}")
    if _refused(allow_unsandboxed_code):
        raise RuntimeError("this machine has no sandbox for model-written code (" + sandbox_description() + ")")
    run = run_sandboxed({"main.py": code}, [sys.executable, "main.py"], timeout=timeout, memory_mb=memory_mb,
                        max_output=max_output_chars)
    if run["status"] == "sandbox_error":
        raise RuntimeError(f"sandbox error: {run['stderr'][-500:]}")
    out = run["stdout"][:max_output_chars]
    if run["stderr"]:
        out += ("\n" if out and not out.endswith("\n") else "") + run["stderr"][-max_output_chars:]
    if run["status"] != "ok":
        out += ("\n" if out and not out.endswith("\n") else "") + f"[{run['status']}]"
    return out


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
            out = fn("" if response is None else str(response), label,
                     **{k: v for k, v in kwargs.items() if k in accepted})
            result = out if isinstance(out, VerifierResult) else VerifierResult(float(out))
        except LabelError as e:
            result = _fail("bad_label", message=str(e)[:200])
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
        labels = _answers(label) if _canonical(names[0]) in _TEXT_LABELS else _maybe_json(label)
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


def row_problem(verifier: Any, label: Any) -> str | None:
    """Why no response to a dataset row can ever be scored (None: it can): a verifier name this module
    does not have, labels that do not match the verifiers, or a text label with no answer in it. Checked
    before training: a typo in a verifier name would otherwise score every sample 0, and steps would train
    on nothing."""
    try:
        parts = _split_row(verifier, label)
    except (ValueError, TypeError) as e:
        return f"labels do not match the verifiers: {e}"
    unknown = sorted({str(name)[:100] for name, _ in parts if _canonical(name) not in VERIFIERS})
    if unknown:
        return f"unknown verifier {', '.join(map(repr, unknown))} (known: {', '.join(sorted(VERIFIERS))})"
    for name, part in parts:
        key = _canonical(name)
        answers = _label_answers(part) if key in _TEXT_LABELS else None
        if answers == []:
            return f"{key}: the label holds no answer ({str(part)[:100]!r})"
        if key == "gsm8k" and not any(_NUMBER.search(str(a)) for a in answers):
            return f"gsm8k: the label holds no number ({str(part)[:100]!r})"
        tests = [t for t in _as_list(part) if isinstance(t, str) and t.strip()] if key == "code" else []
        if tests and not any(sandbox.judgeable(t) for t in tests):
            return "no code test parses as Python (e.g. `assert f(2) == 4`): none can be judged"
    return None


def runs_code(verifier: Any, label: Any) -> bool:
    """Whether scoring a dataset row runs model-written code (it has a code or code_stdio part)."""
    try:
        return any(_canonical(name) in ("code", "code_stdio") for name, _ in _split_row(verifier, label))
    except (ValueError, TypeError):
        return False


def _error_keys(result: VerifierResult) -> list[str]:
    """Counter keys "verifier/error", one per failed part of a multi-verifier row."""
    if not result.error:
        return []
    if result.details and "parts" in result.details:
        return [f"{p['verifier']}/{p['error']}" for p in result.details["parts"] if p["error"]]
    return [f"{result.verifier}/{result.error}"]


# ---------------------------------------------------------------------------------------------
# VerifierPool: processes with a hard per-row timeout


def _worker_main(conn, kwargs, sandbox_state=None):
    sandbox._SANDBOX.update(sandbox_state or {})  # the parent's probe: no second probe, no second message
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
                 preload: tuple[str, ...] = ("math_verify", "langdetect", "openai"),
                 allow_unsandboxed_code: bool = False, **verifier_kwargs):
        self.timeout = timeout
        # The sandbox is probed here, once, and its mode handed to the workers; without isolation,
        # code rows are refused ("sandbox_unavailable") unless allow_unsandboxed_code.
        self.sandbox = sandbox._sandbox_state()
        self.allow_unsandboxed_code = allow_unsandboxed_code
        verifier_kwargs["allow_unsandboxed_code"] = allow_unsandboxed_code
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
        self._ctx.set_forkserver_preload([__name__, "sandbox", *(m for m in preload if importlib.util.find_spec(m))])
        self._idle: queue.Queue = queue.Queue()
        self._all: list = []
        for _ in range(num_workers):
            self._idle.put(self._start_worker())
        self._threads = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="verifier")
        self._closed = False

    def _start_worker(self):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.kwargs, self.sandbox), daemon=True)
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
        cleanup_sandboxes(proc.pid)  # the work dir and cgroup of a run it was in the middle of

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

    def _warn_unsandboxed(self, rows: list) -> None:
        if self.sandbox.get("mode") != "none" or not self.allow_unsandboxed_code:
            return
        names = " ".join(str(r["verifier"] if isinstance(r, dict) else r[0]) for r in rows)
        if "code" in names or "stdio" in names:
            logger.warning("!!! model-written code is running UNSANDBOXED as uid %d: it can read and write this "
                           "user's files, reach the network and kill this process (allow_unsandboxed_code) !!!",
                           os.getuid())

    async def ascore(self, rows: list) -> list[VerifierResult]:
        """Score rows concurrently (at most num_workers at a time); order is kept."""
        self._warn_unsandboxed(rows)
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(loop.run_in_executor(self._threads, self._score_one, r) for r in rows)))

    def score(self, rows: list) -> list[VerifierResult]:
        self._warn_unsandboxed(rows)
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
    p.add_argument("--label", required=True,
                   help="the label / ground truth (JSON where the verifier takes a structure)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="hard per-row timeout (runs in a 1-worker pool); 0 = in-process")
    p.add_argument("--judge_base_url", default=None,
                   help="llm_judge: OpenAI-compatible base URL (or env JUDGE_BASE_URL)")
    p.add_argument("--judge_model", default=None,
                   help="llm_judge: model name (or env JUDGE_MODEL; default the server's first)")
    p.add_argument("--judge_api_key", default=None, help="llm_judge: API key (or env JUDGE_API_KEY)")
    p.add_argument("--allow_unsandboxed_code", action="store_true",
                   help="code verifiers: run model-written code even where no sandbox is available (unisolated)")
    args = p.parse_args(argv)
    kwargs = {k: v for k, v in vars(args).items() if k.startswith("judge_") and v is not None}
    kwargs["allow_unsandboxed_code"] = args.allow_unsandboxed_code
    print(sandbox_description(), file=sys.stderr)
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
