"""Text metrics for generation eval that work for Chinese as well as English.

Tokens are characters for CJK text and lower-cased words for everything else (see :func:`tokens`), so
character-level F1 and ROUGE-L are meaningful on Chinese answers without a segmenter. The widely used
``rouge_score`` package drops non-ASCII characters in its default tokenizer (a Chinese answer scores 0), which
is why these few functions are written here.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Optional, Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af]")
_WORD_OR_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af]|[^\W_]+",
                          re.UNICODE)


def _normalise_number(text: str) -> Optional[str]:
    text = text.replace(",", "").strip()
    if not text or text in ("-", "."):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else repr(value)


def final_number(text: str) -> Optional[str]:
    """The answer's final number: the one after GSM8K's ``#### `` marker, else the last number in the text.

    Thousands separators are removed and ``42.0`` equals ``42``.

    >>> final_number("She pays 3 * 4 = 12 dollars.\\n#### 1,200")
    '1200'
    >>> final_number("答案是 7 个苹果")
    '7'
    """
    marked = _GSM8K_FINAL.findall(text)
    if marked:
        return _normalise_number(marked[-1])
    numbers = _NUMBER.findall(text)
    return _normalise_number(numbers[-1]) if numbers else None


def exact_match_number(prediction: str, reference: str) -> float:
    """1.0 when the final numbers of prediction and reference exist and are equal, else 0.0."""
    ref = final_number(reference)
    return float(ref is not None and final_number(prediction) == ref)


def tokens(text: str) -> List[str]:
    """CJK characters one by one, other text as lower-cased alphanumeric words (punctuation dropped)."""
    return [t.lower() for t in _WORD_OR_CJK.findall(text)]


def char_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 (SQuAD-style bag of tokens) over :func:`tokens`; for Chinese, characters."""
    pred, ref = tokens(prediction), tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries", section 3)
    over :func:`tokens`, with beta = 1: ``2 * P * R / (P + R)`` where ``P = LCS / len(pred)``, ``R = LCS / len(ref)``."""
    pred, ref = tokens(prediction), tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    lcs = _lcs(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
    """Distinct-n (Li et al. 2016): unique n-grams / all n-grams over every text's :func:`tokens`; 0 if none."""
    grams: List[tuple] = []
    for text in texts:
        toks = tokens(text)
        grams.extend(tuple(toks[i:i + n]) for i in range(len(toks) - n + 1))
    return len(set(grams)) / len(grams) if grams else 0.0


def contains_fact(prediction: str, fact: Optional[str]) -> Optional[float]:
    """1.0 when ``fact`` (a row's ``fact`` field, e.g. a product code) occurs in the prediction, ignoring case
    and spacing; None for rows that carry no fact (they are left out of the mean)."""
    if not fact:
        return None
    squash = lambda text: "".join(text.lower().split())  # noqa: E731
    return float(squash(str(fact)) in squash(prediction))


METRICS = {"exact_match_number": exact_match_number, "char_f1": char_f1, "rouge_l": rouge_l}
ROW_METRICS = ("contains_fact",)  # computed from a row field rather than the reference answer


def score(prediction: str, reference: str, names: Sequence[str], meta: Optional[dict] = None) -> Dict[str, float]:
    """The per-row metrics ``names`` of one prediction: keys of :data:`METRICS` against the reference, and
    ``contains_fact`` against ``meta["fact"]`` (None when the row has none)."""
    values: Dict[str, Optional[float]] = {}
    for name in names:
        if name == "contains_fact":
            values[name] = contains_fact(prediction, (meta or {}).get("fact"))
        else:
            values[name] = METRICS[name](prediction, reference)
    return values
