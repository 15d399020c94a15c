"""The chat template rendered once per message shape, not twice per answer of every row.

:func:`qwenft.data.template.cut` renders a conversation with the tokenizer's Jinja template twice per answer (the
prompt with ``add_generation_prompt=True``, then the prompt and the answer). The pieces it cuts are the template's
literal text around the turns' contents, and for a template that writes a content as it is (ChatML: ``'<|im_start|>'
+ message.role + '\\n' + message.content + '<|im_end|>'``) that literal text depends only on the roles. So
:class:`TemplateCache` cuts each shape (the sequence of roles, system prompt applied) once, with sentinel contents
(``\\ue000K\\ue001``, private-use characters), keeps every piece as literal text and content slots, and builds a row
of that shape by concatenation.

A template may treat a content by what it holds (strip a ``</think>`` part, test it for emptiness), which
sentinels cannot show; so the first :data:`VERIFY_FIRST` rows of every shape, and every :data:`VERIFY_EVERY`-th
after, are also cut by the template itself and compared, piece for piece. A difference (or a shape whose sentinels
do not come back whole) sends that shape to the template for the rest of the run, with a warning; the row compared
gets the template's pieces.
"""

from __future__ import annotations

import logging
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

from qwenft.data.formats import DataError
from qwenft.data.template import Segments, check_contents, cut

log = logging.getLogger(__name__)

VERIFY_FIRST = 64  # rows of each shape cut by the template too
VERIFY_EVERY = 4096  # then one row in this many
_SLOT = re.compile("\ue000(\\d+)\ue001")
Part = Union[str, int]  # literal text, or the index of the message whose content goes there
Recipe = Tuple[List[Tuple[Tuple[Part, ...], bool]], int]  # (pieces as parts + supervised flag, pieces in the prompt)


def sentinel(k: int) -> str:
    """The stand-in content of message ``k`` (text no template writes by itself, no ChatML token)."""
    return f"\ue000{k}\ue001"


def recipe_of(tokenizer, roles: Sequence[str], train_on: str) -> Optional[Recipe]:
    """The pieces of :func:`~qwenft.data.template.cut` for conversations with these ``roles``, as literal text and
    content slots, and how many of them make the last answer's prompt; None where the template does not give the
    sentinels back as they went in (or refuses the shape: the template path then says why, per row)."""
    messages = [{"role": role, "content": sentinel(k)} for k, role in enumerate(roles)]
    try:
        pieces, prompt_chars = cut(tokenizer, messages, train_on)
    except DataError:
        return None
    parts_of: List[Tuple[Tuple[Part, ...], bool]] = []
    chars = prompt_pieces = 0
    for text, flag in pieces:
        split = _SLOT.split(text)  # literal, slot, literal, slot, ..., literal
        parts = tuple(int(p) if i % 2 else p for i, p in enumerate(split) if i % 2 or p)
        literal = "".join(p for p in parts if isinstance(p, str))
        if "\ue000" in literal or "\ue001" in literal or any(
                isinstance(p, int) and p >= len(roles) for p in parts):
            return None
        parts_of.append((parts, flag))
        if chars < prompt_chars:
            chars, prompt_pieces = chars + len(text), prompt_pieces + 1
    if chars != prompt_chars:  # the prompt must end on a piece boundary
        return None
    return parts_of, prompt_pieces


class TemplateCache:
    """A drop-in for :func:`~qwenft.data.template.cut` (``cache(tokenizer, messages, train_on)``) that renders each
    message shape once (see the module docstring). One per tokenization run; it travels to ``datasets.map``'s
    workers with what it knows (plain dicts and tuples).

    Attributes:
        recipes: ``(roles, train_on)`` -> the shape's :func:`recipe_of`, or None (cut by the template).
        seen: rows of each shape so far.
        mismatches: shapes sent to the template after a verified row differed.
    """

    def __init__(self) -> None:
        self.recipes: Dict[Tuple[Tuple[str, ...], str], Optional[Recipe]] = {}
        self.seen: Dict[Tuple[Tuple[str, ...], str], int] = {}
        self.mismatches = 0

    def __call__(self, tokenizer, messages: Sequence[Dict[str, str]], train_on: str) -> Tuple[Segments, int]:
        """``(pieces, prompt_chars)`` of ``messages`` (system prompt applied), exactly as :func:`cut` gives them.

        Raises:
            DataError: as :func:`cut` (a ChatML special token in a content, a shape the template refuses).
        """
        shape = (tuple(m["role"] for m in messages), train_on)
        if shape not in self.recipes:
            self.recipes[shape] = recipe_of(tokenizer, shape[0], train_on)
        recipe = self.recipes[shape]
        if recipe is None:
            return cut(tokenizer, messages, train_on)
        check_contents(messages)
        seen = self.seen[shape] = self.seen.get(shape, 0) + 1
        contents = [m["content"] for m in messages]
        pieces: Segments = []
        prompt_chars = 0
        for k, (parts, flag) in enumerate(recipe[0]):
            text = "".join(p if isinstance(p, str) else contents[p] for p in parts)
            prompt_chars += len(text) if k < recipe[1] else 0
            if text:  # as cut: no empty piece (an empty content alone in one)
                pieces.append((text, flag))
        if seen <= VERIFY_FIRST or seen % VERIFY_EVERY == 0:
            expected = cut(tokenizer, messages, train_on)
            if expected != (pieces, prompt_chars):
                self.recipes[shape] = None
                self.mismatches += 1
                log.warning("the chat template renders the roles %s differently from its shape with these contents "
                            "(row %d of that shape); such rows are rendered by the template itself from now on",
                            "/".join(shape[0]), seen)
                return expected
        return pieces, prompt_chars
