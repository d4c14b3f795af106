"""Tests for verifiers.py: each verifier on correct, wrong, partial, empty, malformed and hostile
responses; the process pool's hard timeouts (off the main thread too); the code verifiers' labels and
verdicts (the sandbox itself is tested in test_sandbox.py); the LM judge
against a local HTTP server and (slow) a real `vllm` OpenAI server on the toy model.

Fast part: `pytest tests/test_verifiers.py -m "not slow"`; everything: drop the -m.
"""

import asyncio
import collections
import http.server
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

import verifiers as V
from verifiers import VerifierPool, verify, verify_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def py(src: str) -> str:
    return f"Here is my solution.\n```python\n{src}\n```\n"


# ------------------------------------------------------------------------------------------------
# math

@pytest.mark.parametrize("response,label", [
    ("<think>12+30=42</think>\nThe answer is \\boxed{42}.", "42"),
    ("so $x = \\boxed{\\frac{1}{2}}$", "0.5"),
    ("\\boxed{0.5}", "\\frac12"),
    ("\\fbox{3/4}", "\\dfrac{3}{4}"),
    ("The set is \\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}"),
    ("\\boxed{[0, 1)}", "[0,1)"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}}", "\\begin{pmatrix}1 & 2\\\\ 3 & 4\\end{pmatrix}"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "$\\sqrt{2}/2$"),
    ("first \\boxed{7} then corrected: \\boxed{8}", "8"),
    ("Final Answer: The final answer is $\\frac{2}{3}$. I hope it is correct.", "2/3"),
    ("Therefore, the answer is 1,000.", "1000"),
    ("We get 3 apples, then 5 more, total 8", "8"),
    ("<think>maybe \\boxed{5}</think>Thus \\boxed{6}", "\\boxed{6}"),
    ("\\boxed{6}", ["5", "6"]),  # several acceptable answers
])
def test_math_correct(response, label):
    r = verify("math", response, label)
    assert (r.score, r.error) == (1.0, None), r


@pytest.mark.parametrize("response,label", [
    ("The answer is \\boxed{41}.", "42"),
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
    ("first \\boxed{8} then corrected: \\boxed{7}", "8"),
])
def test_math_wrong_is_zero_without_error(response, label):
    r = verify("math", response, label)
    assert (r.score, r.error) == (0.0, None), r
    assert r.extracted is not None


@pytest.mark.parametrize("response", [
    "", "   ", "I do not know.", "<think>the answer is \\boxed{42}", "<think>42</think>", "\\boxed{}",
])
def test_math_no_answer_is_an_error_not_a_wrong_answer(response):
    r = verify("math", response, "42")
    assert r.score == 0.0 and r.error == "no_answer", r


def test_math_think_is_ignored():
    assert verify("math", "<think>\\boxed{42}</think> so \\boxed{41}", "42").score == 0.0
    assert verify("math", "reasoning 42 ... </think> final \\boxed{41}", "41").score == 1.0  # template opened <think>


def test_math_malformed_label_and_unbalanced_latex():
    assert verify("math", "\\boxed{42}", "").error == "bad_label"
    r = verify("math", "\\boxed{\\frac{1}{", "0.5")  # truncated: no complete box, falls back to the last number
    assert (r.score, r.error, r.extracted) == (0.0, None, "1"), r
    r = verify("math", "\\boxed{\\frac{{{{}}", "1")
    assert (r.score, r.error) == (0.0, "no_answer"), r


def test_math_hostile_extraction_is_linear():
    t0 = time.time()
    r = verify("math", "\\boxed{" * 50_000 + "<think>" * 50_000 + "1", "1")
    assert (r.score, r.error) == (0.0, "no_answer") and time.time() - t0 < 10, r


def test_math_off_the_main_thread_works():
    # math-verify raises (and elsewhere silently scores 0) when its SIGALRM timeout runs in a thread.
    out = {}
    t = threading.Thread(target=lambda: out.update(r=verify("math", "\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join(60)
    assert out["r"].score == 1.0 and out["r"].error is None


def verify_in_a_fresh_main_thread(args: str) -> tuple[list, float]:
    """[score, error] of `verifiers.verify(<args>)` in a new interpreter's main thread (where math-verify's
    SIGALRM timeout works and no test runner's alarm is pending), and the seconds it all took."""
    code = f"import verifiers, json; r = verifiers.verify({args}); print(json.dumps([r.score, r.error]))"
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip(), out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), time.time() - t0


def test_math_verify_timeout_is_an_error_not_a_silent_zero():
    # In a clean main thread math-verify's own alarm fires; math-verify would return False, we say "timeout".
    result, seconds = verify_in_a_fresh_main_thread("'math', '\\\\boxed{(x+1)^{100000}}', '7', math_timeout=1")
    assert result == [0.0, "timeout"] and seconds < 60


def test_pool_timeout_works_off_the_main_thread():
    # The hang is C-level (a 9^9^9^9 power in sympy): no signal can interrupt it, only a process kill.
    hostile = ("math", "so \\boxed{9^{9^{9^{9}}}}", "7")
    out = {}
    with VerifierPool(num_workers=1, timeout=2.0) as pool:
        def run():
            t0 = time.time()
            out["results"] = pool.score([hostile, ("math", "\\boxed{7}", "7")])
            out["seconds"] = time.time() - t0
        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        assert not t.is_alive()
        bad, good = out["results"]
        assert bad.error == "timeout" and bad.score == 0.0 and bad.verifier == "math"
        assert bad.elapsed < 2.0 + 1.5
        assert (good.score, good.error) == (1.0, None)  # the replacement worker scores the next row
        assert pool.error_counts == {"math/timeout": 1}


# ------------------------------------------------------------------------------------------------
# gsm8k

@pytest.mark.parametrize("response,label,score,error", [
    ("She has 12 + 30 = 42 apples.", "42", 1.0, None),
    ("Total: $1,234.", "1234", 1.0, None),
    ("Total: 1,234.50 dollars", "1234.5", 1.0, None),
    ("#### -7", "-7", 1.0, None),
    ("42 apples... wait, 43", "42", 0.0, None),
    ("so 1,2,3", "3", 1.0, None),
    ("The answer is 72", "Natalia sold 48/2 = 24 clips... #### 72", 1.0, None),
    ("no numbers here", "42", 0.0, "no_answer"),
    ("<think>42</think>", "42", 0.0, "no_answer"),
    ("", "42", 0.0, "no_answer"),
    ("42", "not a number", 0.0, "bad_label"),
    # exact: a float tolerance scored these wrong answers 1
    ("total 2,000,001", "2,000,000", 0.0, None), ("123456700", "123456789", 0.0, None),
    ("0.000002", "0.000001", 0.0, None), ("0.0000005", "0", 0.0, None),
    ("x " + "9" * 400, "9" * 400, 1.0, None),  # past float range (inf - inf scored it 0)
    ("it is 42.0", "42", 1.0, None), ("1/2", "0.5", 1.0, None),
    ("The temperature is \u22125 degrees", "5", 0.0, None),  # the typographic minus is a minus
    ("The temperature is \u22125 degrees", "-5", 1.0, None),
    ("41", ["41", "42"], 1.0, None), ("42", '["42", "41"]', 1.0, None),  # any of the listed answers
    ("5", "1/0", 0.0, "bad_label"),
])
def test_gsm8k(response, label, score, error):
    r = verify("gsm8k", response, label)
    assert (r.score, r.error) == (score, error), r


def test_math_last_number_keeps_a_typographic_minus():
    assert verify("math", "so it is \u22125", "5").score == 0.0
    assert verify("math", "so it is \u22125", "-5").score == 1.0


def test_math_reads_full_width_digits():
    assert verify("math", "\\boxed{\uff14\uff12}", "42").score == 1.0  # as gsm8k did
    assert verify("math", "\\boxed{\uff14\uff13}", "42").score == 0.0


def test_math_timeout_bounds_the_row_not_each_answer():
    # each of ten acceptable answers took ~3 s of its own 5 s math-verify budget: 31 s for the row
    result, seconds = verify_in_a_fresh_main_thread(
        "'math', '\\\\boxed{(x+y+z+1)^{14}}', [str(i) for i in range(10)], math_timeout=5")
    assert result == [0.0, "timeout"] and seconds < 5 + 8  # the row's 5 s, and the interpreter's start-up


@pytest.mark.parametrize("answer", ["9^(9^9)", "9^{\\frac{9^9}{1}}", "9^{9!!}", "\\binom{10^{9}}{10^{8}}", "2^(2^30)",
                                    "2^{10000}", "12345!", "x^{2*y^3}", "2^" + "(" * 300 + "1", "x^2+" * 300])
def test_answers_too_big_for_sympy_are_compared_as_text_off_the_main_thread(answer):
    """Off the main thread math-verify has no timeout: these hung sympy for 16 s to minutes."""
    assert V._sympy_unsafe(answer)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=verify("math", "\\boxed{%s}" % answer, "7")))
    t.start()
    t.join(20)
    assert not t.is_alive() and out["r"].score == 0.0


def test_common_answers_still_go_to_sympy():
    for answer in ["x^2 + 123!", "x^{2}+y^{2}", "\\frac{1}{2}", "e^{i\\pi}", "2^{10}", "10^{-3}", "(1+x)^{n}",
                   "\\binom{10}{3}", "2^(n+1)"]:
        assert not V._sympy_unsafe(answer), answer
    for text in ["^(" * 100_000, "x^2+" * 100_000, "\\binom{" * 50_000]:
        t0 = time.time()
        V._sympy_unsafe(text)
        assert time.time() - t0 < 0.5, text[:10]


def test_labels_no_response_can_match_are_bad_labels_not_response_errors():
    """A bad label is the data's fault: "bad_label" drops and counts the sample. As "exception:*" (the
    response's fault) it scored 0, and some scored 0 or 1 with no error at all."""
    deep = "[" * 100_000  # JSON nested past the recursion limit raised RecursionError out of the pool
    cases = [("max_length", "a b", "abc"), ("max_length", "a b", '{"max_length": 3, "scale": 0}'),
             ("max_length", "a b", "nan"), ("up_to_max_length", "a b", "abc"),
             ("code_stdio", py("print(1)"), '{"inputs": ["a"]}'),
             ("code_stdio", py("print(1)"), {"inputs": 5, "outputs": 6}),
             ("string_f1", "red dog", []), ("string_match", "none", None), ("string_match", "x", ""),
             ("math", "\\boxed{1}", {"a": 1}),
             ("ifeval", "hello", {"instruction_id_list": ["length_constraints:number_words"],
                                  "kwargs": [{"num_words": 1e400, "relation": "less than"}]}),
             (["gsm8k"], "42", deep), (["gsm8k", "max_length"], "42", deep)]
    for verifier, response, label in cases:
        r = verify_row(verifier, response, label)
        assert (r.score, r.error) == (0.0, "bad_label"), (verifier, str(label)[:40], r)
    assert verify_row(deep, "42", "42").error == "unknown_verifier"
    # checked before training (grpo.py stops on such rows), not found one sample at a time
    for verifier, label in (("math", ""), ("math", []), ("math", {"a": 1}), ("gsm8k", "abc"), ("string_f1", [None])):
        assert V.row_problem(verifier, label), (verifier, label)
    assert V.row_problem("gsm8k", "#### 1,234") is V.row_problem("math", ["1/2", "0.5"]) is None
    assert len(V.row_problem(deep, "42")) < 400 and not V.runs_code(deep, "42")
    with VerifierPool(num_workers=1, timeout=10.0) as pool:
        results = pool.score([(deep, "42", "42"), ("gsm8k", "42", deep), ("gsm8k", "so 42", "42")])
    assert [r.error for r in results] == ["unknown_verifier", "bad_label", None] and results[2].score == 1.0


# ------------------------------------------------------------------------------------------------
# ifeval: one following and one violating response per instruction type

IFEVAL_CASES = [
    ("keywords:existence", {"keywords": ["apple", "pie"]}, "I like apple pie.", "I like apple tart."),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "at least"}, "cat and cat", "one cat"),
    ("keywords:frequency", {"keyword": "cat", "frequency": 2, "relation": "less than"}, "one cat", "cat cat"),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "evil"]}, "All is good.", "That was Bad."),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": "at least"}, "zzZ", "zz"),
    ("language:response_language", {"language": "en"},
     "This is a perfectly ordinary English sentence about the weather today.",
     "Ceci est une phrase tout à fait ordinaire en français sur le temps qu'il fait aujourd'hui."),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "One. Two.", "One. Two. Three. Four."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First.\n***\nSecond.", "Only one."),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five", "one two"),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
     "Hello there.\n\nThen we left.", "Hello there.\n\nAfter that we left."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], at [address].", "Dear [name]."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. bye"),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi.\nP.P.S bye", "Hi.\nP.S. bye"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b", "* a\n* b\n* c"),
    ("detectable_format:constrained_response", {}, "My answer is yes.", "Yes."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", "*one* only"),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nfoo\nSection 2\nbar", "Section 1\nfoo"),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{'a': 1}"),
    ("detectable_format:title", {}, "<<My Title>>\ntext", "My Title\ntext"),
    ("combination:two_responses", {}, "First answer.\n******\nSecond answer.", "Same.\n******\nSame."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "Write a poem. Roses...", "Roses..."),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Done. Any other questions?", "Done."),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": "at least"},
     "THIS is VERY nice", "This is nice"),
    ("change_case:english_capital", {}, "THIS IS ALL IN CAPITAL LETTERS, AS ASKED.", "This is not all capitals."),
    ("change_case:english_lowercase", {}, "this is all in lowercase letters, as asked.", "This is Not lowercase."),
    ("punctuation:no_comma", {}, "No commas here.", "Commas, here."),
    ("startend:quotation", {}, '"Wrapped in quotes."', "Not wrapped."),
    # open-instruct's IFEvalG additions
    ("copy:repeat_phrase", {"phrase": "The early bird catches the worm", "small_n": 2},
     "The early cat catches the worm. The early bird eats the worm.",
     "The early bird catches the worm. The early bird catches the worm."),  # each must change one word
    ("copy:copy", {"prompt_to_repeat": "Write a haiku about rain."}, " write a HAIKU about rain. ",
     "Write a haiku about rain. Rain falls."),
    ("new:copy_span_idx", {"prompt_to_repeat": "Hello brave new world", "n_start": 6, "n_end": 15}, "Brave new",
     "brave new world"),
    ("detectable_format:sentence_hyphens", {}, "I came.-I saw.-I won.", "I came. - I saw."),
    ("keywords:no_adjacent_consecutive", {}, "The cat sat down.", "A big cat"),
    ("detectable_format:square_brackets", {}, "[Hello] [world]", "[Hello] world"),
    ("keywords:word_once", {"keyword": "moon"}, "The moon is bright.", "Moon, moon."),
    ("keywords:word_count_different_numbers", {"keyword": "sun", "frequency": 2, "relation": "less than"},
     "The sun rose.", "Sun and sun."),
    ("keywords:exclude_word_harder", {"keyword": "blue"}, "Blue sky. It is blue.", "The blue sky."),
    ("paragraphs:paragraphs", {}, "First part.\n***\nSecond part.", "Only one part."),
    ("paragraphs:paragraphs2", {}, "First part.\n\nSecond part.", "First.\n\n\n\nSecond."),  # an empty middle one
    ("first_word:first_word_sent", {"first_word": "we"}, "We run. We jump!", "We run. They jump."),
    ("first_word:first_word_answer", {"first_word": "Yes"}, "yes it is.", "Yes, it is."),  # 'yes,' is the word
    ("last_word:last_word_sent", {"last_word": "end"}, "This is the end. Not the END!", "This is the end. Not yet."),
    ("last_word:last_word_answer", {"last_word": "done"}, "We are DONE!", "Done we are."),
    ("detectable_format:bigram_wrapping", {}, "<<I am>> <<at home>> alone", "<<I am>> at home"),
    ("copy:copying_simple", {"prompt_to_repeat": "Say hi."}, "say HI.", "Hi!"),
    ("copy:copying_multiple", {"prompt_to_repeat": "Say hi.", "N": 3}, "Say hi.\n******\nSay hi.\n******\nsay HI.",
     "Say hi.\n******\nSay hi."),
    ("punctuation:punctuation_dot", {}, "No dots here!", "A dot."),
    ("punctuation:punctuation_exclamation", {}, "Calm.", "Wow!"),
    ("count:lowercase_counting", {"N": 2}, "Hello World, it is.", "this is too many"),
    ("letters:letter_counting", {"N": 5, "relation": "less than"}, "abc 123", "abcdef"),
    ("letters:letter_counting2", {"letter": "B", "let_frequency": 2, "let_relation": "at least"}, "bob", "bat"),
    ("count:counting_composition", {"n_sent": 1, "n_words": 3}, "Hi there.\n***\nGood day.\n***\nBye now.",
     "Hi there.\n***\nGood day."),  # 3 tokens a sentence: the final period is one
    ("count:count_unique", {}, "One two three.", "one two one."),
    ("count:count_increment_word", {"keyword1": "red", "keyword2": "blue"}, "red blue blue", "red red blue blue"),
    ("keywords:palindrome", {}, "Wow, a racecar!", "Hello world"),
    ("keywords:keyword_specific_position", {"keyword": "cat", "n": 2, "m": 3}, "I sleep. The big cat runs.",
     "I sleep. The cat runs."),
    ("keywords:start_end", {}, "Love is all you need, love", "Love is all you need, love."),
]

IFEVALG_IDS = """keywords:existence keywords:frequency keywords:forbidden_words keywords:letter_frequency
    language:response_language length_constraints:number_sentences length_constraints:number_paragraphs
    length_constraints:number_words length_constraints:nth_paragraph_first_word detectable_content:number_placeholders
    detectable_content:postscript detectable_format:number_bullet_lists detectable_format:constrained_response
    detectable_format:number_highlighted_sections detectable_format:multiple_sections detectable_format:json_format
    detectable_format:title combination:two_responses combination:repeat_prompt startend:end_checker
    change_case:capital_word_frequency change_case:english_capital change_case:english_lowercase punctuation:no_comma
    startend:quotation copy:repeat_phrase copy:copy new:copy_span_idx detectable_format:sentence_hyphens
    keywords:no_adjacent_consecutive detectable_format:square_brackets keywords:word_once
    keywords:word_count_different_numbers keywords:exclude_word_harder paragraphs:paragraphs paragraphs:paragraphs2
    first_word:first_word_sent first_word:first_word_answer last_word:last_word_sent last_word:last_word_answer
    detectable_format:bigram_wrapping copy:copying_simple copy:copying_multiple punctuation:punctuation_dot
    punctuation:punctuation_exclamation count:lowercase_counting letters:letter_counting letters:letter_counting2
    count:counting_composition count:count_unique count:count_increment_word keywords:palindrome
    keywords:keyword_specific_position keywords:start_end""".split()


def test_ifeval_covers_the_54_ifevalg_instruction_types():
    assert len(IFEVALG_IDS) == len(set(IFEVALG_IDS)) == 54
    assert set(V.IFEVAL_CHECKS) == set(IFEVALG_IDS)
    assert {case[0] for case in IFEVAL_CASES} == set(V.IFEVAL_CHECKS)


@pytest.mark.parametrize("inst,kwargs,good,bad", IFEVAL_CASES, ids=[c[0] + str(i) for i, c in enumerate(IFEVAL_CASES)])
def test_ifeval_instruction(inst, kwargs, good, bad):
    label = {"instruction_id_list": [inst], "kwargs": [kwargs]}
    assert verify("ifeval", good, label).score == 1.0, verify("ifeval", good, label)
    assert verify("ifeval", bad, label).score == 0.0, verify("ifeval", bad, label)


def test_ifeval_partial_hf_nones_json_string_and_think():
    # The HF dataset stores every kwarg key in every dict, None where unused.
    kwargs = [{"keywords": None, "num_words": None, "relation": None}, {"keywords": ["apple"], "num_words": None}]
    label = json.dumps({"key": 1, "prompt": "...",
                        "instruction_id_list": ["punctuation:no_comma", "keywords:existence"],
                        "kwargs": kwargs})
    r = verify("ifeval", "<think>apple, apple</think>I like pears, a lot.", label)
    assert (r.score, r.error) == (0.0, None)
    r = verify("ifeval", "<think>apple, apple</think>I like apples, a lot.", label)
    assert (r.score, r.error) == (0.5, None) and r.details["followed"] == {"punctuation:no_comma": False,
                                                                          "keywords:existence": True}
    # Olmo's RLVR rows: a list holding one dict with "instruction_id".
    olmo = json.dumps([{"instruction_id": ["punctuation:no_comma"], "kwargs": [None]}])
    assert verify("ifeval", "fine", olmo).score == 1.0


@pytest.mark.parametrize("label", [
    "not json", {"instruction_id_list": ["no:such_instruction"], "kwargs": [{}]},
    {"instruction_id_list": ["copy:copy"], "kwargs": [{}]},  # the reference raises without prompt_to_repeat
    {"instruction_id_list": ["count:count_increment_word"], "kwargs": [{"keyword1": "x"}]},  # and without keyword2
    "[{'instruction_id': ['punctuation:no_comma'], 'kwargs': [{'nonsense': 1}]}]",  # an argument it does not take
    {"instruction_id_list": ["keywords:frequency"], "kwargs": [{"keyword": "x", "frequency": 1, "relation": "about"}]},
    {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}, {"instruction_id_list": []}, None, 42,
])
def test_ifeval_malformed_label_is_bad_label(label):
    r = verify("ifeval", "some response", label)
    assert r.score == 0.0 and r.error == "bad_label", r


def test_ifeval_empty_response_is_no_answer():
    r = verify("ifeval", "<think>x</think>  ", {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]})
    assert r.error == "no_answer"  # not a free 1.0 for "no commas"


def test_ifeval_unclosed_think_checks_the_whole_text():
    """As open-instruct's IFEvalG reward: with no </think> the whole text is checked, the tag included;
    the other verifiers keep their rule (an unclosed <think> is no answer)."""
    no_comma = "[{'instruction_id': ['punctuation:no_comma'], 'kwargs': [None]}]"
    r = verify("ifeval", "<think>no commas here", no_comma)
    assert (r.score, r.error) == (1.0, None), r
    assert verify("ifeval", "<think>a, b", no_comma).score == 0.0
    lower = "[{'instruction_id': ['change_case:english_lowercase'], 'kwargs': [None]}]"
    assert verify("ifeval", "<think>all lower", lower).score == 1.0
    assert verify("ifeval", "<|assistant|><think>", no_comma).score == 1.0  # the bare tag is text there too
    assert verify("math", "<think>\\boxed{42}", "42").error == "no_answer"


IFEVAL_REFERENCE_QUIRKS = [
    ("detectable_format:title", {}, "<<<a>>>", True),
    ("detectable_format:title", {}, "<< >>\n<<>>\n<<a\n>>", False),  # empty, too short, across a line
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "**bold**", False),  # counts once
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[a[b]c]", False),  # one [...] match
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "Then"},
     'Hi.\n\n"Then," he said.', True),  # quotes and punctuation around the word are dropped
    ("keywords:existence", {"keywords": ["b.g"]}, "a big dog", True),  # keywords are regexes there
    ("keywords:existence", {"keywords": ["c++"]}, "I like C++", True),  # one that does not compile is literal
    ("keywords:forbidden_words", {"forbidden_words": ["cat"]}, "Concatenate.", True),  # whole words only
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Bye.\np. p. s. more", True),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "SECTION 1 a SECTION 2 b", False),  # case-sensitive
    ("letters:letter_counting", {"N": 1, "relation": "more than"}, "abc", False),  # never followed, no error
    ("count:count_unique", {}, "One two one.", True),  # case-sensitive tokens
    ("count:counting_composition", {"n_sent": 1, "n_words": 3}, "Hi there.\n***\nGood day.\n***\nBye now.\n***",
     False),  # a trailing divider leaves an empty paragraph, which has no sentences
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": "less than"},
     "I DON'T know", False),  # I, DO, N'T: treebank tokens, not whitespace words
    ("keywords:start_end", {}, "Hello world hello.", False),  # the final period is the last token
    ("keywords:exclude_word_harder", {"keyword": "red", "instruction": "Do not say red."}, "A red car.", False),
    ("keywords:keyword_specific_position", {"keyword": "Cat", "n": 1, "m": 2}, "The cat sat.", False),
    ("startend:end_checker", {"end_phrase": "Bye now"}, '"Ok. bye NOW"', True),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "at least"},
     "Dr. Smith left. He ran! Why?", True),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "Dr. Smith left. He ran! Why?", False),
    # punkt's sentences: abbreviations and "..." before a lowercase word go on, "e.g." is no abbreviation to it
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "Dr. Smith met Mr. Jones at 5 p.m. on Jan. 5th. They talked.", True),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "Wow... that is it.", False),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "at least"},
     "Experts, e.g. economists, agree. Yes.", True),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "less than"}, "Use file.txt now", True),
    # Missing kwargs that the reference draws at random, where no draw changes the outcome.
    ("count:lowercase_counting", {}, "HELLO THERE", True),
    ("count:lowercase_counting", {}, "a b c d", False),
    ("length_constraints:number_words", {"relation": "less than"}, "few words here", True),
    ("detectable_format:number_bullet_lists", {}, "no bullets", False),
    ("keywords:forbidden_words", {}, "xyzzy", True),
]


@pytest.mark.parametrize("inst,kwargs,response,followed", IFEVAL_REFERENCE_QUIRKS,
                         ids=[c[0] + str(i) for i, c in enumerate(IFEVAL_REFERENCE_QUIRKS)])
def test_ifeval_matches_reference_quirks(inst, kwargs, response, followed):
    r = verify("ifeval", response, str([{"instruction_id": [inst], "kwargs": [kwargs]}]))
    assert (r.score, r.error) == (float(followed), None), r


def test_ifeval_open_instruct_literal_label_scores_the_fraction():
    # ground_truth as open-instruct stores it: a Python literal (single quotes, None), not JSON.
    label = ("[{'instruction_id': ['punctuation:no_comma', 'keywords:word_once', 'detectable_format:title'], "
             "'kwargs': [None, {'keyword': 'moon', 'frequency': None}, {}]}]")
    r = verify("ifeval", "<think>moon, moon</think><<Night>>\nThe moon, bright.", label)
    assert r.error is None and r.score == pytest.approx(2 / 3), r  # the comma fails; the think block is gone
    assert r.details["followed"] == {"punctuation:no_comma": False, "keywords:word_once": True,
                                     "detectable_format:title": True}
    assert verify("ifeval", "<<Night>>\nThe moon is bright.", label).score == 1.0
    assert verify("ifeval", "<think>moon</think>", label).score == 0.0  # nothing left after the think block
    # What follows the last </think> is checked (a second block's content is no answer).
    assert verify("ifeval", "<think>a</think>x, y<think>b</think><<Night>> The moon.", label).score == 1.0
    assert verify("ifeval", "", label).score == 0.0
    quoted = "[{'instruction_id': ['startend:quotation'], 'kwargs': [None]}]"
    assert verify("ifeval", '<answer>"Quoted."</answer>', quoted).score == 1.0  # answer tags are dropped


def test_ifeval_punkt_sentences():
    # The counts NLTK's punkt (English model) gives.
    for text, count in [("Dr. Smith met Mr. Jones at 5 p.m. on Jan. 5th. They talked.", 2), ("Good luck!!", 2),
                        ("It costs 10 dollars vs. 20 dollars. Choose wisely.", 2), ("1. Apples\n2. Pears", 3),
                        ("The end. and then we left.", 2), ("This is **bold.** Next one.", 2), ("Is it? Yes. No!", 3),
                        ("Wait... it is fine.", 1), ("Wait... The end.", 2)]:
        assert len(V.punkt_sentences(text)) == count, (text, V.punkt_sentences(text))


def test_ifeval_word_tokens_follow_treebank_rules():
    assert V.word_tokens('"Hello," he said. "Bye."') == ["``", "Hello", ",", "''", "he", "said", ".", "``", "Bye",
                                                         ".", "''"]
    assert V.word_tokens("I can't, it's Mr. Smith's well-known U.S. dog... ok?") == [
        "I", "ca", "n't", ",", "it", "'s", "Mr.", "Smith", "'s", "well-known", "U.S.", "dog", "...", "ok", "?"]


def test_ifeval_punkt_knows_the_english_models_abbreviations():
    # punkt's English model lists u.s.a, n.y, l.a and bros among its abbreviations, and it never ends a sentence
    # after one when a lowercase word follows: NLTK's sent_tokenize gives each of these texts as one sentence.
    for text in ["I moved to the U.S.A. last year.", "She flew to N.Y. on Monday.", "Warner Bros. released it in May.",
                 "We met in L.A. and then left."]:
        assert V.punkt_sentences(text) == [text]
    # Some listed ones are everyday words ("ok", "ill"): there a capitalized word is taken as the next sentence (punkt
    # decides it by corpus statistics this splitter does not have), a lowercase one still continues the sentence.
    assert V.punkt_sentences("It is ok. Let me know.") == ["It is ok.", "Let me know."]
    assert V.punkt_sentences("I feel ill. Please help. I was ill. and tired.") == [
        "I feel ill.", "Please help.", "I was ill. and tired."]
    assert V.punkt_sentences("Ask Dr. Watson.") == ["Ask Dr. Watson."]
    # "c" is one of its initials, after which it never ends a sentence, even before a sentence starter.
    assert V.punkt_sentences("Vitamin C. The end.") == ["Vitamin C. The end."]
    # So the reference finds 1 sentence (< 2), and unique tokens: "U.S.A." keeps its period, one "." ends the text.
    text = "I moved to the U.S.A. last year."
    assert V.word_tokens(text) == ["I", "moved", "to", "the", "U.S.A.", "last", "year", "."]
    for inst, kwargs in [("length_constraints:number_sentences", {"num_sentences": 2, "relation": "less than"}),
                         ("count:count_unique", {})]:
        assert verify("ifeval", text, str([{"instruction_id": [inst], "kwargs": [kwargs]}])).score == 1.0, inst


def test_ifeval_punkt_sees_words_as_its_tokens_and_judges_a_period_with_the_next_word():
    # NLTK's sent_tokenize (English model) on these: punkt's next token after "U.S.A." is "I" of "I'm", a sentence
    # starter; it splits "*" off the front of "**Dr." (an abbreviation) but keeps the quote in "'Dr." (none);
    # and it ends a sentence at a period whose next word holds a sentence end before its last token ('Smith."').
    for text, sentences in [("I live in the U.S.A. I'm happy.", ["I live in the U.S.A.", "I'm happy."]),
                            ("We met **Dr. and Mrs. Smith** today.", ["We met **Dr. and Mrs. Smith** today."]),
                            ("It was 'Dr. Who' there.", ["It was 'Dr.", "Who' there."]),
                            ('He said, "Call Dr. Smith." Then.', ['He said, "Call Dr.', 'Smith."', "Then."]),
                            ("(We moved to N.Y. later.) Then.", ["(We moved to N.Y.", "later.)", "Then."])]:
        assert V.punkt_sentences(text) == sentences, text


def test_ifeval_word_tokens_split_a_contraction_before_a_closing_quote():
    # NLTK's word tokenizer splits the closing quote off first, then the clitic before it, at the end of the text too.
    assert V.word_tokens("He said 'I CAN'T'") == ["He", "said", "'", "I", "CA", "N'T", "'"]
    assert V.word_tokens("Tell them 'I won't'") == ["Tell", "them", "'", "I", "wo", "n't", "'"]
    assert V.word_tokens('She wrote "\'I\'ve\'" twice.') == ["She", "wrote", "``", "'", "I", "'ve", "'", "''", "twice",
                                                          "."]
    # So the reference counts 3 capital words (I, CA, N'T) and finds "n't" as the 6th token.
    for inst, kwargs, response in [
            ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": "at least"},
             "He said 'I CAN'T'"),
            ("keywords:keyword_specific_position", {"keyword": "n't", "n": 1, "m": 6}, "Tell them 'I won't'")]:
        assert verify("ifeval", response, str([{"instruction_id": [inst], "kwargs": [kwargs]}])).score == 1.0, inst


def test_ifeval_word_tokens_pad_brackets_and_asterisks_after_the_quote_rule():
    # NLTK pads ( ) [ ] * -- only after splitting "' " off, so a quote before one of them leaves the clitic: these are
    # NLTK's word tokens. A text's opening '"' is `` before the rule for '"' / "''" after a space or bracket runs.
    assert V.word_tokens("(He said 'it's')") == ["(", "He", "said", "'", "it's", "'", ")"]
    assert V.word_tokens("*'It's'* he said.") == ["*", "'", "It's", "'", "*", "he", "said", "."]
    assert V.word_tokens("It's 'John's'--really") == ["It", "'s", "'", "John's", "'", "--", "really"]
    assert V.word_tokens('""Hi" there') == ["``", "``", "Hi", "''", "there"]


def _hostile_label(inst: str) -> dict:
    pool = {"keywords": ["a"], "keyword": "a", "frequency": 1, "relation": "at least", "forbidden_words": ["b"],
            "letter": "a", "let_frequency": 1, "let_relation": "at least", "language": "en", "num_sentences": 1,
            "num_paragraphs": 1, "num_words": 1, "nth_paragraph": 1, "first_word": "a", "num_placeholders": 1,
            "postscript_marker": "P.S.", "num_bullets": 1, "num_highlights": 1, "section_spliter": "Section",
            "num_sections": 1, "prompt_to_repeat": "a", "end_phrase": "a", "capital_frequency": 1,
            "capital_relation": "at least", "phrase": "The early bird catches the worm", "small_n": 2, "n_start": 1,
            "n_end": 2, "last_word": "a", "N": 2, "n_sent": 2, "n_words": 2, "keyword1": "a", "keyword2": "b", "n": 1,
            "m": 1, "instruction": "a b"}
    params = list(inspect.signature(V.IFEVAL_CHECKS[inst]).parameters)[1:]
    return {"instruction_id_list": [inst], "kwargs": [{k: pool[k] for k in params}]}


def test_ifeval_hostile_inputs_are_fast():
    # 200,000 characters each; "<" * 40,000 alone took 1.3 s in the old title regex.
    texts = ["<" * 200_000, "<<" + "x" * 199_998, "[" * 200_000, "[" * 100_000 + "]" * 100_000, "*" * 200_000,
             " " * 199_999 + "x", "\n" * 199_999 + "x", "p. " * 66_666 + "xx", "a. " * 66_666 + "xx",
             "Section " * 25_000, "The " * 50_000, "a" * 200_000, "- " * 100_000, "'" * 200_000, "*** " * 50_000]
    worst = (0.0, "")
    for inst in V.IFEVAL_CHECKS:
        label = _hostile_label(inst)
        for text in texts:
            t0 = time.process_time()  # CPU time: the wall clock also counts other processes on a busy machine
            r = verify("ifeval", text, label)
            elapsed = time.process_time() - t0
            assert r.error is None, (inst, text[:10], r)
            assert elapsed < 2, (inst, text[:10], elapsed)
            worst = max(worst, (elapsed, f"{inst} on {text[:6]!r}..."))
    print(f"slowest IFEval check on a hostile 200,000-character response: {worst[0]:.3f} s CPU ({worst[1]})")


# ------------------------------------------------------------------------------------------------
# string_match, string_f1, max_length

def test_string_match_and_f1():
    assert verify("string_match", "<answer>The Eiffel Tower!</answer>", "eiffel tower").score == 1.0
    assert verify("string_match", "Eiffel Tower", '["Louvre", "eiffel  tower"]').score == 1.0
    assert verify("string_match", "<think>Louvre</think>Eiffel", "Louvre").score == 0.0
    assert verify("string_match", "  ", "x").error == "no_answer"
    assert verify("string_f1", "the big red dog", "red dog").score == pytest.approx(0.8)
    assert verify("string_f1", "red dog", ["cat", "red dog"]).score == 1.0
    assert verify("string_f1", "blue", "red dog").score == 0.0
    assert verify("string_f1", "", "red").error == "no_answer"
    assert verify("string_matcher", "a", "a").verifier == "string_match"  # open-instruct's name


def test_max_length_is_clamped():
    assert verify("max_length", "one two three", "3").score == 1.0
    assert verify("max_length", "w " * 100_000, "10").score == 0.0  # open-instruct's went negative
    assert verify("max_length", "w " * 110, {"max_length": 10, "scale": 200}).score == pytest.approx(0.5)
    assert verify("max_length", "x", "10", num_tokens=20).score == pytest.approx(1 - 10 / 8192)
    assert verify("up_to_max_length", "a b", "5").score == 1.0
    assert verify("max_length", "x", "not a number").error == "bad_label"  # the data's fault: dropped, not 0


# ------------------------------------------------------------------------------------------------
# code and code_stdio

DOUBLE_TESTS = ["assert f(1) == 2", "assert f(2) == 4", "assert f(0) == 0"]
GOOD_F = "def f(x):\n    return 2 * x\n"


# conftest.py's `sandbox` fixture: skipped where no isolation for model-written code exists here
needs_sandbox = pytest.mark.usefixtures("sandbox")


@needs_sandbox
def test_code_correct_partial_wrong():
    assert verify("code", py("def f(x):\n    return 2 * x"), DOUBLE_TESTS).score == 1.0
    r = verify("code", py("def f(x):\n    return 2 * x if x else 1"), json.dumps(DOUBLE_TESTS))
    assert r.score == pytest.approx(2 / 3) and r.error is None and r.details["passed"] == 2
    assert verify("code", py("def f(x):\n    return x"), DOUBLE_TESTS).score == pytest.approx(1 / 3)
    # the last fenced python block is the program
    two = py("def f(x):\n    return -1") + py("def f(x):\n    return 2 * x")
    assert verify("code", two, DOUBLE_TESTS).score == 1.0


@pytest.mark.parametrize("response,error", [
    ("no code at all", "no_answer"), ("", "no_answer"), ("```python\n```", "no_answer"),
    (py("def f(x) return 2"), "syntax_error"), ("<think>" + py("def f(x): return 2*x") + "</think>", "no_answer"),
])
def test_code_no_answer_and_syntax_error(response, error):
    r = verify("code", response, DOUBLE_TESTS)
    assert (r.score, r.error) == (0.0, error), r


def test_code_bad_label():
    assert verify("code", py("x = 1"), "[]").error == "bad_label"
    assert verify("code_stdio", py("x = 1"), '[{"in": 1}]').error == "bad_label"


def test_text_checks_are_linear_on_hostile_responses():
    """Red-team findings: `<answer>` tags left open made string_match quadratic (32 s for 128 KB); the guard that
    keeps sympy from hanging when there is no timeout was quadratic in a digit run and cubic in spaces after '^';
    a repeat_phrase label whose phrase is a regex made the reference's pattern quadratic."""
    for name, response, label in [
            ("string_match", "<answer>" * 16384, "x"), ("string_f1", "<answer>" * 16384, "x"),
            ("ifeval", "a " * 16384, {"instruction_id_list": ["copy:repeat_phrase"],
                                      "kwargs": [{"phrase": "a b c.", "small_n": 2}]})]:
        t0 = time.time()
        r = verify(name, response, label)
        assert r.score == 0.0 and time.time() - t0 < 2, (name, time.time() - t0)
    for text in ["1" * 50_000, "^" + " " * 5000 + "x", "^{" + "a*" * 50_000, "**{" * 20_000]:
        t0 = time.time()
        V._SYMPY_UNSAFE.search(text)
        assert time.time() - t0 < 0.1, text[:10]
    assert V._SYMPY_UNSAFE.search("2^{10000}") and V._SYMPY_UNSAFE.search("12345!")
    assert V._SYMPY_UNSAFE.search("x^{2*y^3}") and not V._SYMPY_UNSAFE.search("x^2 + 123!")
    assert V._short_answer("a<answer>x</answer><answer>y</answer>b") == "y"
    assert V._short_answer("<answer>a<answer>b</answer>") == "a<answer>b"  # as re.findall reads it


# ------------------------------------------------------------------------------------------------
# routing, labels and never raising

LOWERCASE = {"instruction_id": ["change_case:english_lowercase"], "kwargs": [{}]}
# (verifier, label as written in the file, response, score): strings and lists / dicts mixed in one column
LABEL_ROWS = [
    ("string_match", "[1, 2]", "[1, 2]", 1.0), ("string_match", "[1, 2]", "1", 0.0),  # not the answers 1 and 2
    ("string_match", "1e3", "1e3", 1.0), ("string_match", "1e3", "1000", 0.0),  # not 1000.0
    ("string_f1", "[1, 2]", "[1, 2]", 1.0), ("string_match", '"quoted"', '"quoted"', 1.0),
    ("math", "[1, 2]", "\\boxed{[1, 2]}", 1.0), ("math", "1e3", "\\boxed{1e3}", 1.0),
    ("string_match", ["5", "6"], "6", 1.0), ("string_match", ["5", "6"], "[5, 6]", 0.0),  # a list: its answers
    (["string_match"], "[1]", "[1]", 1.0), (["string_match"], ["7"], "7", 1.0),
    ("ifeval", LOWERCASE, "all lower case", 1.0), ("ifeval", LOWERCASE, "Not Lower", 0.0),  # structure
    ("max_length", {"max_length": 2, "scale": 10}, "two words", 1.0),
]


def test_labels_are_kept_exactly_as_written_through_loading_and_scoring(tmp_path, toy_model_dir):
    """A string label of a verifier whose label is text is the answer exactly as written, also in a file
    that mixes string and list labels (the loader then writes each list or dict as its JSON text), where
    it used to be decoded again: "[1, 2]" became the answers 1 and 2 (string_match scored "[1, 2]" 0).
    Lists of answers, and structured labels (IFEval, max_length) that come as JSON text, still work."""
    import chat_template
    from transformers import AutoTokenizer

    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q"}], "verifier": verifier,
                                        "ground_truth": label}) + "\n" for verifier, label, _, _ in LABEL_ROWS))
    data = chat_template.load_mixture([str(path), "1.0"])
    out, drops = chat_template.tokenize_rlvr(data, AutoTokenizer.from_pretrained(toy_model_dir), 512, cache_dir="")
    assert len(out) == len(LABEL_ROWS) and sum(drops.values()) == 0, dict(drops)
    rows = {source["source_line"]: row for source, row in zip(data, out)}  # what a trainer scores with
    for line, (verifier, label, response, score) in enumerate(LABEL_ROWS, 1):
        row = rows[line]
        assert row["ground_truth"] == (label if isinstance(label, str) else json.dumps(label)), row
        assert V.row_problem(row["verifier"], row["ground_truth"]) is None, row
        r = verify_row(row["verifier"], response, row["ground_truth"])
        assert (r.score, r.error) == (score, None), (line, verifier, label, response, r)
    assert verify("string_match", "[1, 2]", "[1, 2]").score == 1.0  # the example, without a file
    assert verify("string_f1", "1e3", "1e3").score == 1.0


def test_verify_row_several_verifiers_with_parallel_labels():
    r = verify_row(["gsm8k", "max_length"], "so 42", ["42", "2"])
    assert (r.score, r.error, r.verifier) == (1.0, None, "gsm8k+max_length")
    r = verify_row('["gsm8k", "string_match"]', "so 42", '["42", "nope"]')
    assert (r.score, r.error) == (0.5, None)
    r = verify_row(["gsm8k", "math"], "no digits", ["42", "42"])
    assert r.score == 0.0 and r.error == "gsm8k:no_answer;math:no_answer" and len(r.details["parts"]) == 2
    assert verify_row(["gsm8k", "math"], "1", ["1"]).error == "bad_label"
    assert verify_row(["math"], "\\boxed{1}", ["1"]).score == 1.0  # Olmo rows: one-element lists
    assert verify_row("string_f1", "a b", ["x", "a b"]).score == 1.0  # one verifier, several labels


MALFORMED_LABELS = [None, 0, "", "{", [], {}, [[[]]], {"a": None}, "\x00" * 10, float("nan")]
# What each gives where it is not "bad_label": a named error, or a label some response could match (a number, a
# text answer) scoring this response's wrong answer 0 with no error. Labels by their index in MALFORMED_LABELS.
MALFORMED_NOT_BAD_LABEL = {
    **{("code", i): (0.0, "unsupported_tests") for i in (3, 8)},  # a test that is no assert statement
    **{("math", i): (0.0, None) for i in (1, 3, 6, 8, 9)}, **{("gsm8k", 1): (0.0, None)},
    **{(name, i): (0.0, None) for name in ("string_match", "string_f1") for i in (1, 8, 9)},
    **{(name, 1): (1 - 3 / 2048, None) for name in ("max_length", "up_to_max_length")},  # a length of 0 words
    **{("llm_judge", i): (0.0, "judge_unavailable") for i in range(len(MALFORMED_LABELS))},  # no server here
}


@pytest.mark.parametrize("name", sorted(V.VERIFIERS))
@pytest.mark.parametrize("index", range(len(MALFORMED_LABELS)))
def test_every_verifier_names_what_is_wrong_with_a_malformed_label(name, index):
    label = MALFORMED_LABELS[index]
    if name == "llm_judge":
        label = label if label else "ref"
    r = verify(name, py("def f(x): return x") + " \\boxed{1} 1", label, judge_base_url="http://127.0.0.1:9/v1",
               judge_retries=0, code_timeout=2)
    assert isinstance(r, V.VerifierResult)
    assert (r.score, r.error) == MALFORMED_NOT_BAD_LABEL.get((name, index), (0.0, "bad_label")), r


def test_unknown_verifier_and_odd_responses():
    assert verify("nope", "x", "y").error == "unknown_verifier"
    assert verify("math", None, "1").error == "no_answer"
    assert verify("math", 1, "1").score == 1.0
    assert float(verify("gsm8k", "7", "7")) == 1.0


# ------------------------------------------------------------------------------------------------
# llm_judge against a local OpenAI-compatible HTTP server (fast) and a real vLLM server (slow)

class _FakeOpenAI(http.server.BaseHTTPRequestHandler):
    mode = "json"  # json | garbage | no_schema | error500
    requests: list = []

    def log_message(self, *args):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"object": "list",
                         "data": [{"id": "fake-judge", "object": "model", "created": 0, "owned_by": "t"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(req)
        if self.mode == "error500":
            return self._send(500, {"error": {"message": "boom"}})
        if self.mode == "no_schema" and "response_format" in req:
            return self._send(400, {"error": {"message": "response_format is not supported",
                                              "type": "invalid_request"}})
        content = {"json": '{"score": 7}', "garbage": "I refuse.", "no_schema": 'Sure! {"score": 11}'}[self.mode]
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": req["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture()
def fake_judge():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeOpenAI.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_llm_judge_plumbing_against_a_local_server(fake_judge):
    label = {"question": "Capital of France?", "reference": "Paris"}
    _FakeOpenAI.mode = "json"
    r = verify("llm_judge", "<think>hmm</think>Paris", label, judge_base_url=fake_judge)
    assert (r.score, r.error) == (0.7, None) and r.details["structured"]
    req = _FakeOpenAI.requests[-1]
    assert req["model"] == "fake-judge" and req["response_format"]["type"] == "json_schema"
    assert "Capital of France?" in req["messages"][0]["content"] and "hmm" not in req["messages"][0]["content"]
    _FakeOpenAI.mode = "no_schema"  # server without structured output: plain reply parsed, 11/10 clamped
    r = verify("llm_judge", "Paris", "Paris", judge_base_url=fake_judge, judge_model="m")
    assert (r.score, r.error) == (1.0, None) and not r.details["structured"]
    _FakeOpenAI.mode = "garbage"
    r = verify("llm_judge", "Paris", "Paris", judge_base_url=fake_judge, judge_retries=1)
    assert (r.score, r.error) == (0.0, "judge_bad_output")
    _FakeOpenAI.mode = "error500"
    n = len(_FakeOpenAI.requests)
    r = verify("llm_judge", "Paris", "Paris", judge_base_url=fake_judge, judge_model="m", judge_retries=2)
    assert r.error == "judge_unavailable" and len(_FakeOpenAI.requests) - n == 3  # retried


def test_llm_judge_server_down_is_a_counted_error_not_a_hang():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    t0 = time.time()
    r = verify("llm_judge", "Paris", "Paris", judge_base_url=url, judge_model="m", judge_retries=2)
    assert (r.score, r.error) == (0.0, "judge_unavailable") and time.time() - t0 < 10
    # in the pool, retries stop within the row's budget: an error, not a hard-timeout kill
    with VerifierPool(num_workers=1, timeout=3, judge_base_url=url, judge_model="m", judge_retries=10) as pool:
        t0 = time.time()
        r = pool.score([("llm_judge", "Paris", "Paris")])[0]
        assert (r.score, r.error) == (0.0, "judge_unavailable") and time.time() - t0 < 3 + 1
        assert pool.error_counts == {"llm_judge/judge_unavailable": 1}


@pytest.fixture(scope="module")
def vllm_judge(toy_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", toy_model_dir, "--dtype", "float32",
           "--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "toy",
           # eager: skips a minute of compilation; no free whitespace in JSON: a random model would
           # otherwise fill max_tokens with it (a real judge model does not)
           "--enforce-eager", "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    log = open(os.path.join(toy_model_dir, "..", f"vllm_judge_{port}.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(url + "/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.flush()
                    pytest.fail("vllm server did not start:\n" + open(log.name).read()[-3000:])
                time.sleep(1)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        log.close()


@pytest.mark.slow
def test_llm_judge_against_vllm_structured_output(vllm_judge):
    # The random toy model's judgement is garbage: this checks the plumbing, not the grade.
    template = "Q: {question}\nRef: {reference}\nAnswer: {response}\nScore 0-10 as JSON."
    r = verify("llm_judge", "Paris", {"question": "Capital of France?", "reference": "Paris"},
               judge_base_url=vllm_judge, judge_template=template, judge_max_tokens=32)
    assert r.error is None, r
    assert r.details["structured"] and 0.0 <= r.score <= 1.0
    assert isinstance(json.loads(r.extracted)["score"], int)  # the structured reply is valid JSON
    with VerifierPool(num_workers=2, timeout=30, judge_base_url=vllm_judge, judge_model="toy",
                      judge_template=template, judge_max_tokens=32) as pool:
        results = pool.score([("llm_judge", f"answer {i}", "Paris") for i in range(4)])
    assert all(r.error is None and 0.0 <= r.score <= 1.0 for r in results), results


# ------------------------------------------------------------------------------------------------
# VerifierPool

def test_pool_async_order_dict_rows_and_dead_workers():
    with VerifierPool(num_workers=2, timeout=5) as pool:
        rows = [("gsm8k", f"so {i}", str(i if i % 2 else i + 1)) for i in range(20)]
        results = asyncio.run(pool.ascore(rows))
        assert [r.score for r in results] == [float(i % 2) for i in range(20)]
        for proc, _ in list(pool._all):  # workers killed while idle are replaced without an error
            os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        r = pool.score([{"verifier": "math", "response": "\\boxed{2}", "ground_truth": "2"}])[0]
        assert (r.score, r.error) == (1.0, None)
        assert sum(pool.error_counts.values()) == 0 and sum(pool.row_counts.values()) == 21


def test_cli():
    run = lambda *args, stdin: subprocess.run([sys.executable, os.path.join(REPO, "verifiers.py"), *args],  # noqa: E731
                                              input=stdin, capture_output=True, text=True, timeout=120, cwd="/")
    out = run("--verifier", "gsm8k", "--label", "1234", stdin="The answer is 1,234.")
    assert json.loads(out.stdout) | {"elapsed": 0} == {"score": 1.0, "error": None, "extracted": "1234",
                                                        "verifier": "gsm8k", "details": None, "elapsed": 0}, out.stderr
    assert out.stderr.count("code sandbox: ") == 1  # the mode model-written code would run in, said once
    out = run("--verifier", "math", "--label", "7", "--timeout", "2", stdin="\\boxed{9^{9^{9^{9}}}}")
    assert json.loads(out.stdout)["error"] == "timeout", out.stderr
    assert run("--help", stdin="").returncode == 0


def _mixed_rows(n: int):
    """Rows of every verifier with their expected scores; None = don't check (errors checked by name)."""
    ifeval_label = json.dumps({"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
                               "kwargs": [{}, {"num_words": 3, "relation": "at least"}]})
    kinds = [
        (("math", "<think>12+30=42</think>\nThe answer is \\boxed{42}.", "42"), 1.0),
        (("math", "The answer is \\boxed{41}.", "42"), 0.0),
        (("math", "\\boxed{\\frac{1}{2}}", "0.5"), 1.0),
        (("math", "I give up", "42"), "no_answer"),
        (("gsm8k", "so 1,234 apples", "1234"), 1.0),
        (("gsm8k", "so 12 apples", "1234"), 0.0),
        (("ifeval", "one two three four", ifeval_label), 1.0),
        (("ifeval", "one, two", ifeval_label), 0.0),
        (("string_match", "<answer>Paris</answer>", "paris"), 1.0),
        (("string_f1", "the red dog", "red dog"), 1.0),
        (("max_length", "a b c", "3"), 1.0),
        ((["math", "max_length"], "\\boxed{2}", ["2", "1"]), 1.0),
        (("code", py(GOOD_F), DOUBLE_TESTS), 1.0),
        (("code_stdio", py("print(int(input()) * 2)"), [{"input": "2", "output": "4"}]), 1.0),
    ]
    rows, expected = [], []
    for i in range(n):
        row, want = kinds[i % len(kinds)]
        rows.append(row)
        expected.append(want)
    # hostile rows: two hangs (killed by the pool) and one looping program (scored 0 by the sandbox)
    for i, (row, want) in enumerate([(("math", "\\boxed{9^{9^{9^{9}}}}", "7"), "timeout"),
                                     (("code", py("while True:\n    pass"), DOUBLE_TESTS), 0.0),
                                     (("math", "\\boxed{(x+1)^{100000}}", "7"), "timeout")]):
        rows[100 + 300 * i] = row
        expected[100 + 300 * i] = want
    return rows, expected


@pytest.mark.slow  # ~20 s on 2 cores, a third of it the three rows that run into their timeouts
def test_batch_1000_mixed_rows():
    rows, expected = _mixed_rows(1000)
    # Generous: the looping program's own wall limit must end it before the pool's hard timeout even
    # when other processes starve these 2 cores (at 6 s it was once cut by the hard timeout instead).
    timeout = 10.0
    with VerifierPool(num_workers=2, timeout=timeout) as pool:
        asyncio.run(pool.ascore(rows[:20]))  # warm the workers' imports (math-verify, langdetect)
        before = collections.Counter(pool.error_counts)
        t0 = time.time()
        results = asyncio.run(pool.ascore(rows))
        seconds = time.time() - t0
        counts = dict(pool.error_counts - before)
    errors = sum(r.error is not None for r in results)
    print(f"\n1000 mixed rows: {len(rows) / seconds:.1f} rows/s ({seconds:.1f} s, 2 workers), "
          f"{errors} errors: {counts}")
    for row, r, want in zip(rows, results, expected):
        assert r.elapsed <= timeout + 1.0, (row, r)  # no row blocks beyond its timeout
        if isinstance(want, str):
            assert r.error == want, (row, r)
        else:
            assert (r.score, r.error) == (want, None), (row, r)
    assert counts == {"math/timeout": 2, "math/no_answer": sum(w == "no_answer" for w in expected)}


@needs_sandbox
def test_code_tests_judged_inside_the_program_count_and_are_never_a_silent_zero():
    """Asserts inside a function or a loop are judged inside the program's process: scored like the others and
    counted apart ("judged_inside"); a row whose tests do not parse is an error (dropped and counted by a trainer,
    reported before training by row_problem), not a 0 for a correct solution."""
    program = "```python\ndef f(x):\n    return 2 * x\n```"
    humaneval_style = "def check(candidate):\n    assert candidate(2) == 4\ncheck(f)"
    r = V.code(program, [humaneval_style])
    assert (r.score, r.error, r.details["judged_inside"]) == (1.0, None, 1), r.details
    assert V.code(program.replace("2 * x", "x"), [humaneval_style]).score == 0.0
    r = V.code(program, ["assert f(2) ==", "def broken("])
    assert r.error == "unsupported_tests" and not V.caused_by_response(r.error)
    assert "parses" in V.row_problem("code", ["assert f(2) =="])
    assert V.row_problem("code", ["assert f(2) == 4"]) is None
    mixed = V.code(program, ["for i in range(3):\n    assert f(i) == 2 * i", "assert f(2) == 4", "assert f(3) == 7",
                             "assert f(("])
    assert mixed.error is None and mixed.score == 2 / 3 and mixed.details["unsupported"] == 1, mixed.details
    assert mixed.details["judged_inside"] == 1
