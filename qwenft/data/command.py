"""``python -m qwenft data``: validate the data config and show what training will see (tokenizer only)."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence, Tuple

from qwenft.config import Config
from qwenft.data.template import IGNORE_INDEX

PROMPT_CHARS = 600  # a longer prompt span is shown with its middle elided (characters)
ANSWER_CHARS = 1200


RULE_WIDTH = 120  # columns of the example's rules when the console is wider (or not a terminal)

def _elide(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}[... {len(text) - limit} characters ...]{text[-half:]}"


def spans(tokenizer, input_ids: Sequence[int], labels: Sequence[int]) -> List[Tuple[str, bool]]:
    """Decode an example into ``(text, supervised)`` runs of consecutive tokens (special tokens shown)."""
    runs: List[Tuple[List[int], bool]] = []
    for token, label in zip(input_ids, labels):
        supervised = label != IGNORE_INDEX
        if runs and runs[-1][1] == supervised:
            runs[-1][0].append(token)
        else:
            runs.append(([token], supervised))
    return [(tokenizer.decode(ids, skip_special_tokens=False), flag) for ids, flag in runs]


def render_example(tokenizer, input_ids: Sequence[int], labels: Sequence[int], markers: bool):
    """A ``rich.text.Text`` of the example, supervised tokens highlighted (and wrapped in ⟦ ⟧ if ``markers``)."""
    from rich.text import Text

    text = Text()
    for piece, supervised in spans(tokenizer, input_ids, labels):
        if supervised:
            body = _elide(piece, ANSWER_CHARS)
            text.append(f"⟦{body}⟧" if markers else body, style="bold black on green3")
        else:
            text.append(_elide(piece, PROMPT_CHARS), style="grey62")
    return text


def source_table(stats: Dict[str, Any]):
    from rich.table import Table

    table = Table(title="rows per source (used = training examples per epoch; target / achieved share)",
                  title_justify="left", box=None, pad_edge=False)
    for column in ("source", "read", "skipped", "eval", "usable", "trunc.", "dropped", "used", "repeats",
                   "target", "achieved"):
        table.add_column(column, justify="left" if column == "source" else "right", no_wrap=True, overflow="fold")
    for name, c in stats["sources"].items():
        table.add_row(name, str(c["rows_read"]), str(c["skipped"]), str(c["eval"]), str(c["usable"]),
                      str(c["truncated"]), str(c["dropped"]), str(c["used"]), str(c["repeats"]),
                      f"{c['share_target']:.1%}", f"{c['share_achieved']:.1%}")
    return table


def context_warning(config: Config, model_dir) -> "str | None":
    """The rope.context_warning for data.max_seq_len against the model's config.json (None if unreadable)."""
    import json
    from pathlib import Path

    from qwenft.model.rope import context_warning

    try:
        positions = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return context_warning(config.data.max_seq_len, int(positions), config.model.rope_scaling)


def data_command(config: Config) -> None:
    """Build the data of ``config`` and print counts, ratio, token lengths and one masked example (for preference
    data, :func:`pair_preview`).

    Loads only the tokenizer (never model weights): rows per source, ratio achieved, token-length
    p50 / p95 / max, truncated / dropped / skipped counts, supervised-token share, then the first training
    example with its supervised tokens highlighted.

    Raises:
        QwenftError: a bad model source or bad data (one line, exit 2 through the CLI).
    """
    from qwenft.preference.pipeline import has_preference

    if has_preference(config):
        return pair_preview(config)
    from qwenft.data.pipeline import build
    from qwenft.logfilter import result_console
    from qwenft.model import load_tokenizer, tokenizer_dir

    start = time.perf_counter()
    model_dir = tokenizer_dir(config.model)  # the embedded model's tokenizer without converting its weights
    tokenizer = load_tokenizer(model_dir, config.model.revision if config.model.source == "hub" else None)
    tokenizer_seconds = time.perf_counter() - start
    bundle = build(config, tokenizer)
    stats = bundle.stats
    console = result_console(highlight=False)  # not a terminal: full width (COLUMNS when set), no cell cut
    console.print(source_table(stats))
    tokens = stats["tokens"]
    ratio = " : ".join(f"{c['used']}" for c in stats["sources"].values() if c["weight"] > 0)
    shares = " / ".join(f"{c['share_achieved']:.3f}" for c in stats["sources"].values() if c["weight"] > 0)
    if not stats["train_examples"]:
        console.print("training examples: 0 (evaluation only: every source has weight 0); the example below is "
                      "held out")
    else:
        console.print(f"training examples: {stats['train_examples']} ({ratio}, shares {shares})"
                      + (f"; packed into {stats['train_rows']} rows of {stats['max_seq_len']} tokens, "
                         f"fill {stats['pack_fill']:.1%}" if stats["packing"] else ""))
    console.print(f"eval examples: {stats['eval_examples']} "
                  f"({', '.join(f'{n} {len(r)}' for n, r in bundle.eval_rows.items()) or 'none held out'})")
    console.print(f"tokens per example (before truncation): p50 {tokens['p50']}, p95 {tokens['p95']}, "
                  f"max {tokens['max']} (max_seq_len {stats['max_seq_len']}, overlong={config.data.overlong})")
    console.print(f"truncated: {stats['truncated']}, dropped: {stats['dropped']}, skipped bad rows: "
                  f"{stats['skipped']}; supervised tokens: {stats['supervised_share']:.1%} "
                  f"(train_on={config.data.train_on})")
    console.print(f"tokenized cache: {stats['cache_hits']} hit(s), {stats['cache_misses']} miss(es); data ready in "
                  f"{tokenizer_seconds + stats['seconds']:.1f} s (tokenizer {tokenizer_seconds:.1f} s, "
                  f"build {stats['seconds']:.1f} s)")
    warning = context_warning(config, model_dir)
    if warning:
        console.print(f"[yellow]warning:[/] {warning}")
    sample = bundle.sample
    if sample is None:
        return
    markers = console.color_system is None
    from rich.rule import Rule

    rule_width = min(console.width, RULE_WIDTH)  # off a terminal the console is very wide: a rule would fill it
    console.print(Rule(f"example: {sample['source']} row {sample['row']}, {len(sample['input_ids'])} tokens; "
                       + ("supervised tokens in ⟦ ⟧" if markers else "supervised tokens highlighted")), width=rule_width)
    console.print(render_example(tokenizer, sample["input_ids"], sample["labels"], markers))
    console.print(Rule(), width=rule_width)


def pair_preview(config: Config) -> None:
    """``qwenft data`` for a run with preference sources (tokenizer only, no weights): what was read and kept per
    source, then the first training pair: its prompt (not supervised) with the chosen answer, then with the rejected
    one, the supervised tokens marked (KTO: the first example and its label).

    Raises:
        QwenftError: a bad model source or bad data (one line, exit 2 through the CLI).
    """
    from rich.rule import Rule

    from qwenft.logfilter import result_console
    from qwenft.model import load_tokenizer, tokenizer_dir
    from qwenft.preference.pipeline import build_preference

    start = time.perf_counter()
    model_dir = tokenizer_dir(config.model)
    tokenizer = load_tokenizer(model_dir, config.model.revision if config.model.source == "hub" else None)
    tokenizer_seconds = time.perf_counter() - start
    bundle = build_preference(config, tokenizer)
    stats = bundle.stats
    console = result_console(highlight=False)
    console.print(source_table(stats))
    unit = "examples" if config.train.objective == "kto" else "pairs"
    tokens = stats["tokens"]
    sft_rows = stats.get("sft_rows", 0)
    console.print(f"objective: {config.train.objective}; training {unit}: {stats['train_examples'] - sft_rows}"
                  + (f", SFT rows mixed in: {sft_rows} (their NLL added to the loss)" if sft_rows else "")
                  + f"; held out: {', '.join(f'{n} {len(r)}' for n, r in bundle.eval_rows.items()) or 'none'}")
    console.print(f"tokens per {unit[:-1]} (prompt + each answer{'; per SFT row, its tokens' if sft_rows else ''}): "
                  f"p50 {tokens['p50']}, p95 {tokens['p95']}, "
                  f"max {tokens['max']} (max_seq_len {stats['max_seq_len']} per sequence, "
                  f"overlong={config.data.overlong})")
    console.print(f"truncated: {stats['truncated']}, dropped: {stats['dropped']}, skipped bad rows: "
                  f"{stats['skipped']}; answer tokens: {stats['supervised_share']:.1%}")
    console.print(f"tokenized cache: {stats['cache_hits']} hit(s), {stats['cache_misses']} miss(es); data ready in "
                  f"{tokenizer_seconds + stats['seconds']:.1f} s")
    warning = context_warning(config, model_dir)
    if warning:
        console.print(f"[yellow]warning:[/] {warning}")
    sample = bundle.sample
    if sample is None:
        return
    markers = console.color_system is None
    width = min(console.width, RULE_WIDTH)
    prompt = list(sample["prompt_ids"])
    masked = [IGNORE_INDEX] * len(prompt)
    if "completion_ids" in sample:  # KTO
        answers = [(f"answer ({'desirable' if sample['label'] else 'undesirable'})", sample["completion_ids"])]
    else:
        answers = [("chosen", sample["chosen_ids"]), ("rejected", sample["rejected_ids"])]
    how = "supervised tokens in ⟦ ⟧" if markers else "supervised tokens highlighted"
    for label, answer in answers:
        console.print(Rule(f"{sample['source']}, first training {unit[:-1]}: {label}, {len(prompt)} prompt + "
                           f"{len(answer)} answer tokens; {how}"), width=width)
        console.print(render_example(tokenizer, prompt + list(answer), masked + list(answer), markers))
    console.print(Rule(), width=width)


def cache_command(args: Sequence[str]) -> None:
    """``python -m qwenft data cache=list`` (the tokenized-data cache entries: key, source, rows, size, date, or
    the shards a killed run finished) and ``cache=clear`` (remove them all; ``cache=clear KEY...`` those whose key
    starts with a given prefix).

    Raises:
        QwenftError: any other argument; ``cache=clear KEY...`` matching no entry (nothing removed).
    """
    from qwenft.config import QwenftError
    from qwenft.data.store import clear, data_root, entries

    action, keys = args[0].partition("=")[2], list(args[1:])
    if action not in ("list", "clear") or (keys and action == "list"):
        raise QwenftError(f"data {' '.join(args)}: expected cache=list or cache=clear [KEY_PREFIX ...]")
    if action == "clear":
        removed = clear(keys)
        if keys and not removed:
            raise QwenftError(f"data cache=clear {' '.join(keys)}: no cache entry's key starts with "
                              f"{' or '.join(keys)}; nothing removed (python -m qwenft data cache=list shows the keys)")
        (data_root() / ".digests.json").unlink(missing_ok=True)  # file hashes: recomputed when next needed
        print(f"removed {len(removed)} cache entr{'y' if len(removed) == 1 else 'ies'} "
              f"({sum(e['bytes'] for e in removed) / 2**20:.1f} MB) from {data_root()}")
        return
    found = entries()
    print(f"{len(found)} cache entr{'y' if len(found) == 1 else 'ies'} in {data_root()}"
          f" ({sum(e['bytes'] for e in found) / 2**20:.1f} MB)")
    for e in found:
        state = (f"{e.get('rows', '?')} rows, {e.get('created', '')}" if e["complete"]
                 else "written by an older qwenft, not used" if e.get("legacy")
                 else f"incomplete: {e['shards_done']} shard(s) done (the next run resumes them)")
        source = f"{e.get('name', '?')}: {e['source']}" if "source" in e else "(source not recorded)"
        print(f"  {e['key'][:12]}  {source}  {e['bytes'] / 2**20:.1f} MB  {state}")
