"""Text of a sequence as it is generated: incremental detokenization, stop strings, streaming deltas.

Byte-level BPE (Qwen2.5's tokenizer) can split one UTF-8 character over several tokens; decoding such
a prefix ends in U+FFFD. :class:`IncrementalDetokenizer` commits text only once the decoded window no
longer ends in a partial character, decoding a short window of recent tokens rather than the whole
sequence each step. :class:`RowText` matches stop strings on the committed text and holds back any tail
that could still become a stop string, so a stream of deltas never shows text the final result cuts off:
the concatenation of all deltas equals the final text.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into committed text, one token at a time.

    Keeps two offsets into the ids: ``prefix`` (start of a context window, so tokenizers whose pieces
    depend on their left neighbour decode correctly) and ``read`` (end of the committed text). A new
    token's text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``, committed only when it does not
    end in U+FFFD (an incomplete multi-byte character).

    Args:
        tokenizer: any Hugging Face tokenizer.
        skip_special_tokens: passed to ``tokenizer.decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly committed text ("" while a character is incomplete)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def full_text(self) -> str:
        """The decode of every pushed id (what a one-shot ``tokenizer.decode`` gives)."""
        return self._decode(self.ids)


class RowText:
    """The text of one row: detokenization, stop-string matching and the streaming hold-back.

    Args:
        tokenizer: any Hugging Face tokenizer.
        stop_strings: texts that end the sequence; the final text stops before the first match.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.emitted = 0  # characters of committed text already handed out as deltas
        self.searched = 0  # committed characters already scanned for stop strings
        self.skip_before = 0  # a match starting before this was ignored (min_new_tokens)
        self.stop_at: Optional[int] = None

    @property
    def text(self) -> str:
        """The committed text so far (stop strings included)."""
        return self.detok.text

    def _find(self) -> Optional[int]:
        text = self.detok.text
        start = max(self.skip_before, self.searched - self.longest + 1, 0)
        hits = [i for i in (text.find(s, start) for s in self.stop_strings) if i >= 0]
        self.searched = len(text)
        return min(hits) if hits else None

    def _holdback(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        text = self.detok.text
        limit = min(self.longest - 1, len(text) - self.emitted)
        for size in range(limit, 0, -1):
            tail = text[len(text) - size:]
            if any(s.startswith(tail) for s in self.stop_strings if len(s) > size):
                return size
        return 0

    def push(self, token_id: int, stop_allowed: bool = True) -> Tuple[str, bool]:
        """Add one generated token (never a stop token).

        Args:
            token_id: the token.
            stop_allowed: False while min_new_tokens is not reached; a match found then is skipped for good.

        Returns:
            ``(delta, stopped)``: text safe to show now, and whether a stop string just matched.
        """
        if not self.detok.push(token_id) or not self.stop_strings:
            return self._release(len(self.detok.text) - (self._holdback() if self.stop_strings else 0)), False
        while (hit := self._find()) is not None:
            if stop_allowed:
                self.stop_at = hit
                return self._release(hit), True
            self.skip_before = hit + 1
            self.searched = hit + 1
        return self._release(len(self.detok.text) - self._holdback()), False

    def _release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.detok.text[self.emitted:end]
        self.emitted = end
        return delta

    def finish(self) -> Tuple[str, str]:
        """End the row: ``(final_text, last_delta)``; all deltas concatenated equal ``final_text``.

        After a stop string the text ends before it; otherwise it is the full decode of the tokens (a
        partial character cut by ``max_new_tokens`` shows as U+FFFD at the very end).
        """
        if self.stop_at is not None:
            final = self.detok.text[:self.stop_at]
        else:
            final = self.detok.full_text()
        sent = self.detok.text[:self.emitted]
        if not final.startswith(sent):  # a tokenizer whose pieces change with later context
            log.warning("streamed text is not a prefix of the final decode; the stream may differ from the result")
            return final, ""
        self.emitted = len(final)
        return final, final[len(sent):]


def ends_with_any(tokens: Sequence[int], sequences: Sequence[Sequence[int]]) -> bool:
    """True when ``tokens`` ends with one of ``sequences`` (token-level stop sequences).

    Comparing suffixes after every token, rather than advancing a partial-match state, cannot miss an
    overlapping start: stop sequence ``[1, 2]`` is found in the stream ``1, 1, 2``.
    """
    n = len(tokens)
    return any(0 < len(seq) <= n and list(tokens[n - len(seq):]) == list(seq) for seq in sequences)
