"""The evidence on held-out pairs (qwenft/evaluate/preference.py): each side's preference accuracy and margin from
the answers' log-probs, the tuned model's implicit reward accuracy against the base, and the report's section."""

from __future__ import annotations

import pytest
import torch


def test_pair_scores_are_the_answers_log_prob_margins_on_each_side():
    from qwenft.evaluate.preference import answer_logprobs, pair_scores
    from qwenft.evaluate.perplexity import causal_parts
    from tests.train.test_preference import encoded_pairs, tiny_peft

    model, tokenizer = tiny_peft(lora_b=0.05)
    model.eval()
    rows = []
    for f in encoded_pairs(tokenizer, 3):
        n = len(f["prompt_ids"])
        rows.append({"input_ids": f["prompt_ids"] + f["chosen_ids"], "labels": [-100] * n + f["chosen_ids"],
                     "rejected_input_ids": f["prompt_ids"] + f["rejected_ids"],
                     "rejected_labels": [-100] * n + f["rejected_ids"]})
    rows.append({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]})  # an SFT row: no pair
    scores = pair_scores(model, rows, batch_size=2, pad_id=tokenizer.pad_token_id, objective="dpo")
    assert scores[3] is None and all(s is not None for s in scores[:3])
    body, head = causal_parts(model)
    for row, score in zip(rows[:3], scores):
        want = []
        for ids, labels in ((row["input_ids"], row["labels"]), (row["rejected_input_ids"], row["rejected_labels"])):
            with torch.no_grad():  # one sequence alone, the full log-softmax
                hidden = body(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
                logp = torch.log_softmax((hidden @ head.t()).double(), dim=-1)
            want.append(sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if labels[t] != -100))
        # batched with right padding (fp32 forward) vs one sequence in float64 log-softmax: fp32 rounding only
        assert score["logp_chosen"] == pytest.approx(want[0], abs=1e-3)
        assert score["logp_rejected"] == pytest.approx(want[1], abs=1e-3)
        assert score["pref_margin"] == pytest.approx(want[0] - want[1], abs=2e-3)
        assert score["pref_accuracy"] == float(want[0] > want[1])
    per_token = pair_scores(model, rows[:1], 2, tokenizer.pad_token_id, "simpo")[0]  # length-normalised
    n_chosen, n_rejected = (sum(lab != -100 for lab in rows[0][k]) - 0 for k in ("labels", "rejected_labels"))
    assert per_token["pref_margin"] == pytest.approx(scores[0]["logp_chosen"] / n_chosen
                                                     - scores[0]["logp_rejected"] / n_rejected, abs=1e-5)
    assert answer_logprobs(model, [], 2, 0) == []


def test_the_summary_counts_reward_accuracy_against_the_base_with_intervals():
    from qwenft.evaluate.preference import preference_lines, preference_summary

    def side(chosen, rejected):
        return {"logp_chosen": chosen, "logp_rejected": rejected, "pref_margin": chosen - rejected,
                "pref_accuracy": float(chosen > rejected)}

    rows = [{"base": side(-10, -8), "tuned": side(-9, -12)},   # reward 1 - (-4) = +5: right
            {"base": side(-5, -6), "tuned": side(-6, -6.5)},   # reward (-1) - (-0.5) = -0.5: wrong
            {"base": side(-7, -7.5), "tuned": side(-6, -9)},   # reward 1 - (-1.5) = +2.5: right
            {"base": side(-3, -2), "tuned": side(-2, -4)}]     # reward +3: right
    summary = preference_summary(rows)
    assert summary["n"] == 4
    assert summary["reward_accuracy"] == 0.75 and summary["reward_margin"] == pytest.approx((5 - 0.5 + 2.5 + 3) / 4)
    low, high = summary["reward_accuracy_ci95"]
    assert 0.0 < low < 0.75 < high < 1.0  # Wilson's interval for 3 of 4
    assert summary["margin"]["base"] == pytest.approx((-2 + 1 + 0.5 - 1) / 4)
    assert summary["margin"]["tuned"] == pytest.approx((3 + 0.5 + 3 + 2) / 4)
    lo, hi = summary["margin_ci95"]["tuned"]
    assert lo <= summary["margin"]["tuned"] <= hi
    assert preference_summary([{"base": {"text": "x"}}]) is None  # no pair scored
    base_only = preference_summary([{"base": side(-1, -2)}])
    assert base_only["n"] == 1 and "reward_accuracy" not in base_only
    lines = "\n".join(preference_lines({"pairs": summary}, {"pairs": {"base": {"pref_accuracy": 0.25,
                                                                             "answer_tokens": 30.0},
                                                                    "tuned": {"pref_accuracy": 1.0,
                                                                              "answer_tokens": 41.5}}}))
    assert "### pairs (4 pairs)" in lines and "| pref_accuracy | 0.250 | 1.000 |" in lines
    assert "| generated answer, tokens | 30.0 | 41.5 |" in lines
    assert "Implicit reward accuracy (tuned vs base): 0.750 [" in lines
