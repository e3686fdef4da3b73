"""Scorers on hand-written tricky answers."""

from __future__ import annotations

import pytest

from aibrix_operators.evaluation.scorers import extract_letter, extract_number, get_scorer, normalise


@pytest.mark.parametrize("answer", [
    "42", "The answer is 42.", "42.", "42!", " 42 \n", "23 + 19 = 42", "Answer: 42",
    "４２",            # full-width digits
    "٤٢",              # Arabic-Indic digits
    "४२",              # Devanagari digits
    "The answer is 42, not 41.",  # "answer is" wins over the last number
    "42.0",
])
def test_numeric_accepts(answer):
    assert get_scorer("numeric")(answer, "42").value == 1.0


@pytest.mark.parametrize("answer", [
    "41", "4 2", "", "forty-two", "142", "-42", "The answer is 41; 42 is wrong",
])
def test_numeric_rejects(answer):
    assert get_scorer("numeric")(answer, "42").value == 0.0


def test_numeric_thousands_negative_tolerance():
    assert extract_number("It costs 1,234.5 dollars.") == 1234.5
    assert extract_number("−7") == -7.0  # Unicode minus
    assert extract_number("no digits here") is None
    assert get_scorer("numeric", {"abs_tol": 0.01})("3.141", "3.14").value == 1.0
    assert get_scorer("numeric", {"abs_tol": 0.0001})("3.141", "3.14").value == 0.0
    assert get_scorer("numeric", {"rel_tol": 0.01})("1005", "1000").value == 1.0


@pytest.mark.parametrize(("answer", "letter"), [
    ("B", "B"), ("(B)", "B"), ("b)", "B"), ("b", "B"), ("B.", "B"), ("B) 76", "B"), ("(b) 76", "B"),
    ("Answer: c", "C"), ("The answer is (D).", "D"), ("answer is a", "A"), ("**C**", "C"),
    ("B is the largest", "B"), ("  d:  ", "D"),
])
def test_letter_extraction(answer, letter):
    assert extract_letter(answer) == letter


@pytest.mark.parametrize("answer", ["a large number", "E", "", "because", "I think so"])
def test_letter_extraction_finds_nothing(answer):
    assert extract_letter(answer) is None


def test_mc_letter_scores():
    score = get_scorer("mc_letter")
    assert score("(B)", "B").value == 1.0
    assert score("b)", "B").value == 1.0
    assert score("(C)", "B").value == 0.0
    assert score("a large one", "A").value == 0.0  # the article is not option A


def test_normalised_and_exact():
    assert normalise("  The TUESDAY. ") == "tuesday"
    assert get_scorer("normalised")("Tuesday.", "tuesday").value == 1.0
    assert get_scorer("normalised")("ＴＵＥＳＤＡＹ!", "Tuesday").value == 1.0  # NFKC full-width
    assert get_scorer("normalised")("Twenty one", "twenty-one").value == 0.0  # hyphen removed ≠ space
    assert get_scorer("exact")("Tuesday.", "Tuesday").value == 0.0  # exact keeps punctuation
    assert get_scorer("exact")(" Tuesday\n", "Tuesday").value == 1.0


def test_regex():
    score = get_scorer("regex", {"pattern": r"ANSWER:\s*(\w+)"})
    assert score("blah ANSWER: Paris.", "paris").value == 1.0
    assert score("Paris", "paris").value == 0.0
    assert score("ANSWER: Rome", "paris").extracted == "Rome"


def test_unknown_scorer():
    with pytest.raises(ValueError, match="unknown scorer"):
        get_scorer("bleu")
