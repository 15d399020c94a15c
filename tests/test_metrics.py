"""Generation metrics on English, Chinese and GSM8K-style answers."""

from __future__ import annotations

import pytest

from qwenft.evaluate.metrics import (char_f1, contains_fact, distinct_n, exact_match_number, final_number, rouge_l,
                                     score, tokens)


@pytest.mark.parametrize("text, number", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("The answer is 3.50 dollars", "3.5"),
    ("So she has -4 left. Final: 10.0", "10"),
    ("答案是 7 个苹果。", "7"),
    ("no number here", None),
])
def test_final_number(text, number):
    assert final_number(text) == number


def test_exact_match_number_gsm8k():
    reference = "Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18"
    assert exact_match_number("She makes $18 every day.", reference) == 1.0
    assert exact_match_number("#### 18.0", reference) == 1.0
    assert exact_match_number("She makes 18 dollars, then 9 more", reference) == 0.0
    assert exact_match_number("anything", "no number") == 0.0


def test_tokens_split_chinese_by_character():
    assert tokens("合同法, Article 5!") == ["合", "同", "法", "article", "5"]


def test_char_f1_chinese_and_english():
    assert char_f1("北京是首都", "首都是北京") == 1.0  # same characters, bag of tokens
    assert char_f1("北京", "上海") == 0.0
    assert char_f1("劳动合同", "劳动法") == pytest.approx(2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3))
    assert char_f1("The cat", "the cat sat") == pytest.approx(0.8)
    assert char_f1("", "") == 1.0 and char_f1("", "x") == 0.0


def test_rouge_l_uses_order():
    assert rouge_l("北京是首都", "首都是北京") == pytest.approx(0.4)  # LCS = 2 of 5
    assert rouge_l("the cat sat", "the cat sat on") == pytest.approx(2 * 1 * 0.75 / 1.75)
    assert rouge_l("a b c", "x y z") == 0.0


def test_distinct_2():
    assert distinct_n(["a b a b"]) == pytest.approx(2 / 3)
    assert distinct_n(["我爱你", "我爱他"]) == pytest.approx(3 / 4)
    assert distinct_n([""]) == 0.0


def test_contains_fact():
    assert contains_fact("Its model number is HVQ-7340.", "HVQ-7340") == 1.0
    assert contains_fact("Its model number is hvq - 7340", "HVQ-7340") == 1.0  # case and spacing ignored
    assert contains_fact("It is HVQ-7430.", "HVQ-7340") == 0.0
    assert contains_fact("anything", None) is None
    values = score("The PIN is 5826", "The PIN is 5826.", ["contains_fact", "char_f1"], {"fact": "5826"})
    assert values == {"contains_fact": 1.0, "char_f1": 1.0}
