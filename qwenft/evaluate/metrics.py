"""Text metrics for generation eval that work for Chinese as well as English.

Tokens are characters for CJK text and lower-cased words for everything else (see :func:`tokens`), so
character-level F1 and ROUGE-L are meaningful on Chinese answers without a segmenter. The widely used
``rouge_score`` package drops non-ASCII characters in its default tokenizer (a Chinese answer scores 0), which
is why these few functions are written here; the tests check them against ``rouge_score`` given a CJK-aware
tokenizer (ROUGE-L and ROUGE-1, which is the bag-of-tokens F1).

A metric is None ("n/a") for a row it cannot score: ``exact_match_number`` when the reference states no final
answer (see :func:`reference_number`), ``contains_fact`` when the row has no fact. Means leave such rows out.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Optional, Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_ANSWER_MARKER = re.compile(r"(?:\\boxed\{|\banswer\s*(?:is|:)|答案\s*(?:是|为|：|:))\s*(-?\d[\d,]*(?:\.\d+)?)",
                            re.IGNORECASE)
_BARE_NUMBER = re.compile(r"\$?\s*(-?\d[\d,]*(?:\.\d+)?)\s*[.。]?")
# Every CJK ideograph block Unicode defines (Unicode 17: Blocks.txt), whole blocks so that ideographs assigned
# later inside them count too, plus the Han ideographs outside them: the iteration mark, zero and Hangzhou numerals
# (U+3005-3007, U+3021-3029, U+3038-303A) and U+16FF2-16FF6. Kana and Hangul syllables are also one token each.
IDEOGRAPH_RANGES = (
    ("\u3400", "\u4dbf"),            # CJK Unified Ideographs Extension A
    ("\u4e00", "\u9fff"),            # CJK Unified Ideographs (URO)
    ("\uf900", "\ufaff"),            # CJK Compatibility Ideographs
    ("\U00020000", "\U0002a6df"),    # Extension B
    ("\U0002a700", "\U0002b73f"),    # Extension C
    ("\U0002b740", "\U0002b81f"),    # Extension D
    ("\U0002b820", "\U0002ceaf"),    # Extension E
    ("\U0002ceb0", "\U0002ebef"),    # Extension F
    ("\U0002ebf0", "\U0002ee5f"),    # Extension I
    ("\U0002f800", "\U0002fa1f"),    # CJK Compatibility Ideographs Supplement
    ("\U00030000", "\U0003134f"),    # Extension G
    ("\U00031350", "\U000323af"),    # Extension H
    ("\U000323b0", "\U0003347f"),    # Extension J
    ("\u3005", "\u3007"),            # 々 〆 〇
    ("\u3021", "\u3029"),            # Hangzhou numerals
    ("\u3038", "\u303a"),            # Hangzhou numerals 10, 20, 30
    ("\U00016ff2", "\U00016ff6"),    # Han ideographs in Ideographic Symbols and Punctuation (Unicode 17)
)
_OWN_TOKEN = "".join(f"{a}-{b}" for a, b in IDEOGRAPH_RANGES) + "\u3040-\u30ff\uac00-\ud7af"
# One token: a character of _OWN_TOKEN; or a run of other letters and digits, where "." or "," between two
# digits stays inside (26.5, 1,200, 3.0) so numbers stay whole. Punctuation and spaces separate tokens.
_WORD = f"[^\\W_{_OWN_TOKEN}]"
_TOKEN = re.compile(f"[{_OWN_TOKEN}]|{_WORD}+(?:(?<=\\d)[.,]\\d{_WORD}*)*")


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


def reference_number(reference: str) -> Optional[str]:
    """The final answer a reference states as a number, or None when it states none.

    A reference states one with a final-answer marker (GSM8K's ``#### N``; ``\\boxed{N}``, ``the answer is N``,
    ``答案是 N`` / ``答案：N``) or by being a number alone (``42``, ``-3.5``, ``1,200.``); a free-text answer that
    merely contains numbers (``Locker 1 uses code 1001.``) states none.
    """
    marked = _GSM8K_FINAL.findall(reference) or _ANSWER_MARKER.findall(reference)
    if marked:
        return _normalise_number(marked[-1])
    bare = _BARE_NUMBER.fullmatch(reference.strip())
    return _normalise_number(bare.group(1)) if bare else None


def exact_match_number(prediction: str, reference: str) -> Optional[float]:
    """1.0 when the prediction's final number (:func:`final_number`) equals the reference's final answer
    (:func:`reference_number`), 0.0 when it does not, None (n/a) when the reference states no numeric answer."""
    ref = reference_number(reference)
    if ref is None:
        return None
    return float(final_number(prediction) == ref)


def tokens(text: str) -> List[str]:
    """The tokens ROUGE-L, char-F1 and distinct-n count: every CJK ideograph (any CJK block, see
    :data:`IDEOGRAPH_RANGES`), kana and Hangul syllable on its own; other text as lower-cased runs of letters and
    digits, a number with its decimal point or thousands separators whole; punctuation and spaces dropped.

    >>> tokens("请用USB线连接, 温度设为26.5度")
    ['请', '用', 'usb', '线', '连', '接', '温', '度', '设', '为', '26.5', '度']
    """
    return [t.lower() for t in _TOKEN.findall(text)]


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


LOGPROB_METRICS = ("pref_accuracy",)  # from the answers' log-probs on held-out pairs, not from the generated text
METRICS = {"exact_match_number": exact_match_number, "char_f1": char_f1, "rouge_l": rouge_l}


def score(prediction: str, reference: str, names: Sequence[str],
          meta: Optional[dict] = None) -> Dict[str, Optional[float]]:
    """The per-row metrics ``names`` of one prediction: keys of :data:`METRICS` against the reference, and
    ``contains_fact`` against ``meta["fact"]``; None where the row cannot be scored (see the module docstring)."""
    values: Dict[str, Optional[float]] = {}
    for name in names:
        if name in LOGPROB_METRICS:  # not a property of the text: filled in by qwenft.evaluate.preference
            values[name] = None
        elif name == "contains_fact":
            values[name] = contains_fact(prediction, (meta or {}).get("fact"))
        else:
            values[name] = METRICS[name](prediction, reference)
    return values
