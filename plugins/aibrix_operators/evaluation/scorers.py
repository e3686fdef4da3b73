"""Scorers: turn a model's answer and a reference into a score in [0, 1] and what was extracted.

Model answers are prose ("The answer is 42.", "(B)", "b) 45", full-width or Arabic-Indic
digits), so each scorer first *extracts* the part it compares and keeps it, so a person reading
the per-item results sees why an item scored 0. Pure Python, no Airflow.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Score", "SCORERS", "get_scorer", "to_ascii_digits", "normalise"]


@dataclass(frozen=True)
class Score:
    value: float
    extracted: str | None


def to_ascii_digits(text: str) -> str:
    """Every Unicode decimal digit (full-width ４２, Arabic-Indic ٤٢, Devanagari ४२) as ASCII."""
    if text.isascii():
        return text
    out = []
    for ch in text:
        d = unicodedata.decimal(ch, None)
        out.append(str(d) if d is not None else ch)
    return "".join(out)


_PUNCT = str.maketrans("", "", string.punctuation + "“”‘’«»。，、！？：；")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """NFKC, case-folded, punctuation and English articles removed, whitespace collapsed:
    SQuAD-style normalisation (``"The Tuesday."`` → ``"tuesday"``)."""
    text = unicodedata.normalize("NFKC", to_ascii_digits(text)).casefold()
    text = _ARTICLES.sub(" ", text.translate(_PUNCT))
    return _SPACE.sub(" ", text).strip()


def exact(answer: str, reference: str, **_: Any) -> Score:
    got = answer.strip()
    return Score(float(got == reference.strip()), got)


def normalised(answer: str, reference: str, **_: Any) -> Score:
    got = normalise(answer)
    return Score(float(got == normalise(reference)), got)


# A number: optional sign, digits with optional thousands commas, optional decimals/exponent.
_NUMBER = re.compile(r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*", re.IGNORECASE)


def extract_number(answer: str) -> float | None:
    """The number after "answer is/:" if there is one, else the last number in the text
    (``"23 + 45 = 68"`` → 68); trailing punctuation ("42.") is not a decimal point."""
    text = to_ascii_digits(unicodedata.normalize("NFKC", answer))
    markers = list(_ANSWER_IS.finditer(text))
    if markers:
        marker = markers[-1]
        found = _NUMBER.search(text, marker.end())
        if found:
            return _to_float(found.group())
    numbers = _NUMBER.findall(text)
    return _to_float(numbers[-1]) if numbers else None


def _to_float(token: str) -> float:
    return float(token.replace(",", "").replace("−", "-"))


def numeric(answer: str, reference: str, *, abs_tol: float = 0.0, rel_tol: float = 0.0,
            **_: Any) -> Score:
    got = extract_number(answer)
    want = extract_number(reference)
    if got is None or want is None:
        return Score(0.0, None)
    ok = abs(got - want) <= max(abs_tol, rel_tol * abs(want))
    return Score(float(ok), _fmt(got))


def _fmt(x: float) -> str:
    return str(int(x)) if x.is_integer() else repr(x)


def extract_letter(answer: str, letters: str = "ABCD") -> str | None:
    """The chosen option's letter: "B", "(B)", "b)", "B. 45", "Answer: c", "The answer is (D).".

    A lower-case letter counts only when marked as an option ("b)", "(b)", "b.", "b:" or alone),
    so the article in "a large one" is not read as option A."""
    text = unicodedata.normalize("NFKC", answer).strip()
    up, low = re.escape(letters.upper()), re.escape(letters.lower())
    patterns = [
        rf"answer\s*(?:is|:)?\s*\(?([{up}{low}])\b",
        rf"^\W*\(([{up}{low}])\)",                    # (B) / (b)
        rf"^\W*([{up}{low}])\s*[).:](?!\w)",           # B) b) B. b:  (not "a.m.")
        rf"^\W*([{up}{low}])\W*$",                    # just the letter
        rf"^\W*([{up}])\b",                           # "B 45", "B is the largest"
    ]
    for pattern in patterns:
        found = re.search(pattern, text, re.IGNORECASE if pattern.startswith("answer") else 0)
        if found:
            return found.group(1).upper()
    return None


def mc_letter(answer: str, reference: str, *, letters: str = "ABCD", **_: Any) -> Score:
    got = extract_letter(answer, letters)
    return Score(float(got is not None and got == reference.strip().upper()), got)


def regex(answer: str, reference: str, *, pattern: str, **_: Any) -> Score:
    """Group 1 (or the whole match) of ``pattern``, compared normalised."""
    found = re.search(pattern, answer)
    if not found:
        return Score(0.0, None)
    got = found.group(1) if found.groups() else found.group(0)
    return Score(float(normalise(got) == normalise(reference)), got)


SCORERS: dict[str, Callable[..., Score]] = {
    "exact": exact, "normalised": normalised, "numeric": numeric, "mc_letter": mc_letter,
    "regex": regex,
}


def get_scorer(name: str, options: dict[str, Any] | None = None) -> Callable[[str, str], Score]:
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")
    fn, opts = SCORERS[name], dict(options or {})
    return lambda answer, reference: fn(answer, reference, **opts)
