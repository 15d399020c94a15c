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
    assert exact_match_number("anything", "no number") is None  # n/a: the reference states no number


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


# ----------------------------------------------------------------------------- CJK mixed with Latin and digits

def test_latin_words_and_numbers_do_not_swallow_ideographs():
    assert tokens("请用USB线连接") == ["请", "用", "usb", "线", "连", "接"]
    assert tokens("温度设为26度") == ["温", "度", "设", "为", "26", "度"]
    assert tokens("温度26.5度, 价格1,200元, USB3.0接口") == [
        "温", "度", "26.5", "度", "价", "格", "1,200", "元", "usb3.0", "接", "口"]
    assert tokens("a.5 end. 3, 4") == ["a", "5", "end", "3", "4"]  # a point or comma joins digits only
    # LCS 6 of prediction 6 and reference 8 tokens: P = 1, R = 0.75
    assert rouge_l("请用USB线连接", "请用USB数据线连接") == pytest.approx(2 * 0.75 / 1.75)
    assert round(rouge_l("请用USB线连接", "请用USB数据线连接"), 3) == 0.857


def _han_ideographs():
    """Every code point Unicode (as the ``regex`` package knows it) marks Ideographic and of the Han script."""
    regex = pytest.importorskip("regex")
    everything = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    return regex.findall(r"(?V1)[\p{Ideographic}&&\p{Han}]", everything)


def test_every_cjk_ideograph_is_a_token_of_its_own():
    ideographs = _han_ideographs()
    assert len(ideographs) > 97000  # URO, Ext A-I (and J), compatibility ideographs and their supplement
    for ch in ("\u4e00", "\u3400", "\U00020000", "\U0002a700", "\U0002b740", "\U0002b820", "\U0002ceb0",
               "\U0002ebf0", "\U00030000", "\U00031350", "\uf900", "\U0002f800", "〇"):
        assert ch in ideographs
    # Glued to Latin letters on both sides, each ideograph still comes out alone and the letters stay one word.
    assert tokens("".join(ch + "Ab" for ch in ideographs)) == [t for ch in ideographs for t in (ch, "ab")]


class _ReferenceCJKTokenizer:
    """rouge_score's Tokenizer interface (``tokenize(text) -> tokens``), written independently of qwenft: a Han
    ideograph (Unicode properties through ``regex``) alone; letters and digits joined, lower-cased, a point or comma
    between two digits kept inside a number; anything else separates."""

    def __init__(self):
        self.regex = pytest.importorskip("regex")

    def tokenize(self, text):
        out, word = [], ""
        for i, ch in enumerate(text):
            if self.regex.fullmatch(r"(?V1)[\p{Ideographic}&&\p{Han}]", ch):
                out += [word] if word else []
                out.append(ch)
                word = ""
            elif ch.isalnum():
                word += ch
            elif (ch in ".," and word and word[-1].isdecimal() and i + 1 < len(text) and text[i + 1].isdecimal()):
                word += ch
            else:
                out += [word] if word else []
                word = ""
        out += [word] if word else []
        return [t.lower() for t in out]


MIXED = [  # (prediction, reference): Chinese with English words, digits, decimals, Ext-B..H and compatibility
    ("请用USB线连接", "请用USB数据线连接"),
    ("温度设为26度", "温度设为26.5度"),
    ("价格是1,200元", "价格为1200元"),
    ("\U00020000\U00020001是扩展B的字", "\U00020000是扩展B字"),
    ("豈更是兼容汉字", "豈是兼容汉字"),
    ("iPhone 15 Pro的电池容量是3274mAh。", "iPhone15Pro电池3274mAh"),
    ("请在Windows 11中打开设置→蓝牙", "打开Windows设置中的蓝牙"),
    ("根据《民法典》第1079条，可以起诉离婚。", "依据民法典第1079条起诉离婚"),
    ("血压应低于140/90 mmHg", "血压低于140/90mmHg为宜"),
    ("服用阿莫西林0.5g，每日3次", "阿莫西林每次0.5g，一日三次"),
    ("Python 3.11版本支持match语句", "Python3.11支持match"),
    ("请访问www.example.com获取帮助", "访问example.com获取更多帮助"),
    ("The answer is 42, 即四十二", "答案是42"),
    ("第二十条：合同自成立时生效", "合同自成立时起生效（第20条）"),
    ("CPU温度达到85℃时会降频", "CPU在85℃降频"),
    ("\U0002a6a5\U0002a6a5（Ext-B）与龘不同", "\U0002a6a5与龘"),
    ("〇和零都表示zero", "零表示zero"),
    ("COVID-19疫苗需接种2剂", "新冠疫苗COVID-19接种两剂"),
    ("版本v2.3.1已发布", "v2.3.1版本发布了"),
    ("使用H2O和CO2做实验", "用CO2与H2O实验"),
    ("年利率为3.85%，期限5年", "5年期利率3.85%"),
    ("\U0002a700扩展C\U0002b740扩展D\U0002b820扩展E", "扩展C\U0002a700和扩展E\U0002b820"),
    ("\U0002ceb0扩展F\U00030000扩展G\U00031350扩展H", "扩展G\U00030000扩展H\U00031350"),
    ("\U0002f800兼容补充\uf900兼容", "兼容\uf900补充\U0002f800"),
    ("Hello world, 你好世界", "hello World 你好"),
    ("Ünïcode测试naïve用例", "unicode测试naive"),
    ("每100 mL含钠23mg", "每100mL含钠23 mg"),
]


@pytest.mark.parametrize("prediction, reference", MIXED)
def test_rouge_l_and_char_f1_match_rouge_score(prediction, reference):
    """ROUGE-L and char-F1 (= ROUGE-1 F, a bag-of-tokens F1) equal Google's rouge-score given a CJK-aware
    tokenizer written separately here."""
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    reference_tokenizer = _ReferenceCJKTokenizer()
    assert tokens(prediction) == reference_tokenizer.tokenize(prediction)
    assert tokens(reference) == reference_tokenizer.tokenize(reference)
    scores = rouge_scorer.RougeScorer(["rouge1", "rougeL"], tokenizer=reference_tokenizer).score(reference, prediction)
    assert rouge_l(prediction, reference) == pytest.approx(scores["rougeL"].fmeasure, abs=1e-12)
    assert char_f1(prediction, reference) == pytest.approx(scores["rouge1"].fmeasure, abs=1e-12)


# ----------------------------------------------------------------------------- exact_match_number: n/a

@pytest.mark.parametrize("reference, number", [
    ("x = 3\n#### 1,200", "1200"), ("42", "42"), ("-3.5.", "-3.5"), ("答案：7", "7"), ("The answer is 12.", "12"),
    ("Locker 1 uses code 1001.", None), ("先协议，协议不成由法院判决，一般需要6个月。", None)])
def test_reference_number(reference, number):
    from qwenft.evaluate.metrics import reference_number

    assert reference_number(reference) == number


def test_exact_match_number_is_na_on_free_text_and_left_out_of_means():
    from qwenft.evaluate.report import metric_table
    from qwenft.evaluate.run import summarise

    assert exact_match_number("Locker 1 uses code 1001.", "Locker 1 uses code 1001.") is None
    rows = [{"text": t, "stop_reason": "eos", "tokens": 3, **score(t, ref, ["exact_match_number", "char_f1"])}
            for t, ref in (("7", "#### 7"), ("6", "#### 7"), ("code 1001", "Locker 1 uses code 1001."))]
    summary = summarise(rows, ["exact_match_number", "char_f1"])
    assert summary["exact_match_number"] == 0.5  # 1 of the 2 scoreable rows; the free-text row is not a 0
    free = summarise(rows[2:], ["exact_match_number", "char_f1"])
    assert free["exact_match_number"] is None and free["char_f1"] > 0
    delta = {k: free[k] - free[k] for k in free if isinstance(free[k], (int, float))}
    table = metric_table({"base": free, "tuned": free, "delta": delta})
    line = next(row for row in table if row.startswith("| exact_match_number"))
    assert line == "| exact_match_number | n/a | n/a |  |"
