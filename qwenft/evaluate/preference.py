"""Preference evidence on held-out pairs: which answer of each pair a model prefers, base vs tuned.

For every held-out pair (a row of ``DataBundle.eval_rows`` with ``rejected_input_ids``,
:mod:`qwenft.preference.pipeline`) and each side, the answers' log-probabilities given the prompt are computed
(:func:`answer_logprobs`, no ``[tokens, vocab]`` logits tensor) and:

- ``pref_accuracy``: 1 when the side's log-prob margin ``log p(chosen) - log p(rejected)`` is > 0, else 0 (per
  answer token, ``mean log p``, for the reference-free objectives SimPO and ORPO, which rank by that); a 0/1
  metric of ``eval.metrics``, judged by the verdict like ``contains_fact`` (Newcombe's paired interval);
- ``pref_margin``: that margin (nats);
- after both sides (:func:`preference_summary`), the tuned model's implicit reward accuracy: the share of pairs with
  ``(log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)) > 0``, the reference being the base
  side (Rafailov et al. 2023, Eq. 5: the reward DPO learns is ``beta log pi / ref``), with Wilson's 95% interval;
  and the mean margin of each side with its 95% interval (a bootstrap over pairs), the mean answer length of the
  generated answers base vs tuned (DPO's known drift to longer answers).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from qwenft.kernels import target_logprobs

LENGTH_NORMALISED = ("simpo", "orpo")
PAIR_KEYS = ("pref_accuracy", "pref_margin", "logp_chosen", "logp_rejected")


def answer_logprobs(model, examples: Sequence[Tuple[Sequence[int], Sequence[int]]], batch_size: int,
                    pad_id: int) -> List[Tuple[float, int]]:
    """The summed log-prob (nats) and token count of each example's answer tokens (``labels != -100``).

    Args:
        model: a causal LM (a ``PeftModel``: the side its adapter is set to).
        examples: ``(input_ids [seq], labels [seq])``, unshifted labels as the data pipeline builds them.
        batch_size: examples per forward pass (right padding with ``pad_id``).

    Returns:
        ``[(logp_sum, tokens)]`` in the order of ``examples``.
    """
    from qwenft.evaluate.perplexity import causal_parts

    device = next(model.parameters()).device
    body, head = causal_parts(model)
    out: List[Tuple[float, int]] = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(batch):
            ids[i, :len(row_ids)] = torch.tensor(list(row_ids))
            attention[i, :len(row_ids)] = 1
            labels[i, :len(row_labels)] = torch.tensor(list(row_labels))
        ids, attention, labels = ids.to(device), attention.to(device), labels.to(device)
        keep = labels[:, 1:] != -100
        with torch.no_grad():
            hidden = body(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
            logprobs, _ = target_logprobs(hidden[:, :-1][keep], head, labels[:, 1:][keep])
        owner = torch.arange(len(batch), device=device)[:, None].expand_as(keep)[keep]
        sums = torch.zeros(len(batch), dtype=torch.float64, device=device).index_add(0, owner, logprobs.double())
        counts = keep.sum(dim=1)
        out += [(float(s), int(c)) for s, c in zip(sums.tolist(), counts.tolist())]
    return out


def is_pair_row(row: Dict[str, Any]) -> bool:
    """Whether a held-out row is a preference pair that could be encoded."""
    return row.get("rejected_input_ids") is not None and row.get("input_ids") is not None


def pair_scores(model, rows: Sequence[Dict[str, Any]], batch_size: int, pad_id: int,
                objective: str) -> List[Optional[Dict[str, float]]]:
    """Per held-out row, ``{pref_accuracy, pref_margin, logp_chosen, logp_rejected}`` on this side (None for a row
    that is no pair). ``pref_margin`` is per answer token for the objectives in :data:`LENGTH_NORMALISED`; the
    ``logp_*`` are sums (nats)."""
    pairs = [i for i, row in enumerate(rows) if is_pair_row(row)]
    examples = [(rows[i]["input_ids"], rows[i]["labels"]) for i in pairs] + \
        [(rows[i]["rejected_input_ids"], rows[i]["rejected_labels"]) for i in pairs]
    scored = answer_logprobs(model, examples, batch_size, pad_id) if pairs else []
    out: List[Optional[Dict[str, float]]] = [None] * len(rows)
    per_token = objective in LENGTH_NORMALISED
    for k, i in enumerate(pairs):
        (chosen, n_chosen), (rejected, n_rejected) = scored[k], scored[len(pairs) + k]
        margin = (chosen / max(n_chosen, 1) - rejected / max(n_rejected, 1)) if per_token else chosen - rejected
        out[i] = {"pref_accuracy": float(margin > 0), "pref_margin": margin, "logp_chosen": chosen,
                  "logp_rejected": rejected}
    return out


def preference_summary(rows: Sequence[Dict[str, Any]], seed: int = 0) -> Optional[Dict[str, Any]]:
    """The pairs' evidence after both sides ran (module docstring), from a source's report rows (``{base: {...},
    tuned: {...}}`` with :func:`pair_scores`' keys); None when the source has no scored pair.

    Returns:
        ``{n, margin: {side: mean}, margin_ci95: {side: [low, high]}, reward_accuracy, reward_accuracy_ci95,
        reward_margin}`` (the reward keys only with both sides; nats).
    """
    from qwenft.evaluate.intervals import mean_interval, wilson

    def margins(row):
        return [(row.get(side) or {}).get("pref_margin") for side in ("base", "tuned") if side in row]

    scored = [r for r in rows if margins(r) and None not in margins(r)]  # a pair scored on every side it has
    if not scored:
        return None
    out: Dict[str, Any] = {"n": len(scored), "margin": {}, "margin_ci95": {}}
    for side in ("base", "tuned"):
        values = [r[side]["pref_margin"] for r in scored if side in r]
        if values:
            out["margin"][side] = sum(values) / len(values)
            out["margin_ci95"][side] = list(mean_interval(values, seed)[0])
    if all("base" in r and "tuned" in r for r in scored):
        rewards = [(r["tuned"]["logp_chosen"] - r["base"]["logp_chosen"])
                   - (r["tuned"]["logp_rejected"] - r["base"]["logp_rejected"]) for r in scored]
        right = sum(value > 0 for value in rewards)
        out["reward_accuracy"] = right / len(rewards)
        out["reward_accuracy_ci95"] = list(wilson(right, len(rewards)))
        out["reward_margin"] = sum(rewards) / len(rewards)
    return out


def preference_lines(summaries: Dict[str, Dict[str, Any]], sources: Dict[str, Dict[str, Any]]) -> List[str]:
    """report.md's "Preference pairs" section: per source, the pairs' n, each side's preference accuracy and mean
    margin (95% intervals), the tuned model's implicit reward accuracy against the base, and the generated answers'
    mean length base vs tuned."""
    if not summaries:
        return []
    lines = ["## Preference pairs (held out)", "",
             "pref_accuracy: the share of pairs whose chosen answer the model gives the higher log-probability; "
             "reward accuracy: the share whose log-prob ratio tuned / base is higher for the chosen answer than for "
             "the rejected one (DPO's implicit reward, the base as reference).", ""]
    for name, summary in summaries.items():
        by_side = sources.get(name) or {}
        lines += [f"### {name} ({summary['n']} pairs)", "", "| | base | tuned |", "|---|---|---|"]
        acc = [by_side.get(s, {}).get("pref_accuracy") for s in ("base", "tuned")]
        lines.append("| pref_accuracy | " + " | ".join("n/a" if v is None else f"{v:.3f}" for v in acc) + " |")
        cells = []
        for side in ("base", "tuned"):
            if side in summary["margin"]:
                low, high = summary["margin_ci95"][side]
                cells.append(f"{summary['margin'][side]:+.2f} [{low:+.2f}, {high:+.2f}]")
            else:
                cells.append("n/a")
        lines.append("| mean margin, nats (95% CI) | " + " | ".join(cells) + " |")
        length = [by_side.get(s, {}).get("answer_tokens") for s in ("base", "tuned")]
        lines.append("| generated answer, tokens | " + " | ".join("n/a" if v is None else f"{v:.1f}"
                                                                  for v in length) + " |")
        if "reward_accuracy" in summary:
            low, high = summary["reward_accuracy_ci95"]
            lines += ["", f"Implicit reward accuracy (tuned vs base): {summary['reward_accuracy']:.3f} "
                          f"[{low:.3f}, {high:.3f}] (Wilson 95%), mean reward margin {summary['reward_margin']:+.2f} "
                          "nats."]
        lines.append("")
    return lines
