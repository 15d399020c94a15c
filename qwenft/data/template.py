"""Chat template, tokenization and response-only labels.

The conversation is rendered with the tokenizer's own chat template (``apply_chat_template``, ChatML for
Qwen2.5) and cut at the turn boundaries: for every assistant turn ``i``, the template renders
``messages[:i]`` with ``add_generation_prompt=True`` (the prompt the sampler will feed) and
``messages[:i + 1]`` (the same plus the answer); the difference is the answer: its content, the
end-of-turn token ``<|im_end|>`` and the template's ``"\\n"`` separator. Each piece is tokenized on its own,
so the tokens before an answer are exactly :func:`prompt_ids` of that conversation (pitfall 3 of DESIGN).

Labels are ``-100`` except the supervised answers' content and their ``<|im_end|>``. The ``"\\n"`` after
``<|im_end|>`` is **not** supervised: the sampler stops at ``<|im_end|>``, so the model never predicts
that newline at inference; the template writes it, as it writes the ``<|im_start|>assistant\\n`` header,
and it belongs to the next prompt. (``train_on=all`` supervises every token, separators included.)

For ordinary text the pieces tokenize exactly as the whole rendered conversation does (a boundary always
falls next to a special token or between ``"\\n"`` and a non-space character, where Qwen's pre-tokenizer
splits anyway); the tests check this on the real Qwen tokenizer.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from qwenft.chat import END_OF_TEXT, IM_END
from qwenft.data.formats import CHATML_SPECIALS, DataError

IGNORE_INDEX = -100  # the label value the loss ignores (torch cross_entropy's default ignore_index)
Segments = List[Tuple[str, bool]]  # (text, supervised) pieces of one rendered conversation


def token_id(tokenizer, token: str) -> Optional[int]:
    """The id of ``token`` if it is a single token of the vocabulary, else None (``get_vocab`` is too slow
    to call per example: about 0.6 s for Qwen's 151k tokens)."""
    ids = tokenizer.convert_tokens_to_ids([token])
    tid = ids[0] if ids else None
    if tid is None or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        return None
    return int(tid)


def end_of_turn(tokenizer) -> str:
    """The token that closes a turn: ``<|im_end|>`` when the tokenizer has it, else its EOS token."""
    return IM_END if token_id(tokenizer, IM_END) is not None else tokenizer.eos_token


def end_of_text_id(tokenizer) -> int:
    """The document separator appended to ``text`` rows: ``<|endoftext|>``, else the EOS token."""
    tid = token_id(tokenizer, END_OF_TEXT)
    return tokenizer.eos_token_id if tid is None else tid


def with_system(messages: Sequence[Dict[str, str]], system_prompt: Optional[str]) -> List[Dict[str, str]]:
    """Prepend ``system_prompt`` as a system turn unless ``messages`` has its own (the row's wins).

    With ``system_prompt=None`` the template's default applies (Qwen2.5: "You are Qwen, created by Alibaba
    Cloud. You are a helpful assistant.").
    """
    messages = list(messages)
    if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def system_counts(rows: Sequence[dict], system_prompt: Optional[str]) -> Dict[Optional[str], int]:
    """How many of ``rows`` (normalised rows; ``text`` rows, without messages, are not counted) are trained with
    each system prompt: the row's own system turn, else ``system_prompt`` (:func:`with_system`); None stands for
    the template's default (no system turn and ``system_prompt`` None)."""
    counts: Dict[Optional[str], int] = {}
    for row in rows:
        messages = row.get("messages") or []
        if messages:
            system = messages[0]["content"] if messages[0]["role"] == "system" else system_prompt
            counts[system] = counts.get(system, 0) + 1
    return counts


def trained_system(counts: Dict[str, Dict[Optional[str], int]], used: Dict[str, int]) -> Optional[dict]:
    """The system prompt most of the training examples carried, from each source's :func:`system_counts` scaled
    to the examples the mix took from it (``used``, :func:`qwenft.data.mix_counts`).

    Returns:
        ``{"text": prompt or None (the template's default), "share": fraction of the examples (0-1)}``, or None
        when no conversation was trained on.
    """
    total: Dict[Optional[str], float] = {}
    for name, by_prompt in counts.items():
        rows = sum(by_prompt.values())
        for prompt, n in by_prompt.items():
            total[prompt] = total.get(prompt, 0.0) + used.get(name, 0) * n / max(rows, 1)
    examples = sum(total.values())
    if not examples:
        return None
    text = max(total, key=lambda k: total[k])  # ties: the first seen (dicts keep insertion order)
    return {"text": text, "share": round(total[text] / examples, 6)}


def _render(tokenizer, messages: Sequence[Dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def segments(tokenizer, messages: Sequence[Dict[str, str]], train_on: str) -> Segments:
    """Cut the rendered conversation into prompt and answer pieces (:func:`cut`, without the prompt length)."""
    return cut(tokenizer, messages, train_on)[0]


def check_contents(messages: Sequence[Dict[str, str]]) -> None:
    """Refuse a turn whose content holds a ChatML special token as text (it would tokenize as the token itself).

    Raises:
        DataError: ``turn N contains the special token <|im_end|> as text``.
    """
    for i, message in enumerate(messages):
        content = message["content"]
        if "<|" in content:
            for special in CHATML_SPECIALS:
                if special in content:
                    raise DataError(f"turn {i + 1} contains the special token {special} as text")


def cut(tokenizer, messages: Sequence[Dict[str, str]], train_on: str) -> Tuple[Segments, int]:
    """Cut the rendered conversation into prompt and answer pieces.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: a validated conversation (system prompt already applied), ending with an assistant turn.
        train_on: ``assistant`` (every answer), ``last_assistant`` (the final answer) or ``all`` (every token).

    Returns:
        ``([(text, supervised), ...], prompt_chars)``: the pieces, whose texts concatenate to the rendered
        conversation, and the length in characters of the generation prompt of the last answer (a piece
        boundary: the pieces before it are that prompt, token for token :func:`prompt_ids`).

    Raises:
        DataError: no assistant turn, a content holding a ChatML special token as text, or a template that
            does not render a conversation as the extension of its prefix (it must, for the sampler's prompt
            to match).
    """
    eot = end_of_turn(tokenizer)
    check_contents(messages)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:  # e.g. a ``text`` row (no messages): encode it with encode_text
        raise DataError("the conversation has no assistant turn to supervise")
    pieces: Segments = []
    done = full = ""  # the rendered text already cut into pieces; the last rendering
    for k, i in enumerate(answers):
        prompt = _render(tokenizer, messages[:i], True)
        full = _render(tokenizer, messages[: i + 1], False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError("the tokenizer's chat template does not render a conversation as an extension of "
                            "its generation prompt; response-only labels need a prefix-stable template")
        answer = full[len(prompt):]
        end = answer.rfind(eot)
        end = len(answer) if end < 0 else end + len(eot)  # content + end-of-turn; the separator goes on
        supervised = train_on != "last_assistant" or k == len(answers) - 1
        pieces.append((prompt[len(done):], train_on == "all"))
        pieces.append((answer[:end], supervised))
        done = prompt + answer[:end]
    # The conversation ends with its last answer, so the last ``full`` is the whole rendered conversation.
    tail = full[len(done):] if answers and answers[-1] == len(messages) - 1 else _render(tokenizer, messages,
                                                                                         False)[len(done):]
    if tail:
        pieces.append((tail, train_on == "all"))
    return [(text, flag) for text, flag in pieces if text], len(prompt)


def assemble(piece_ids: Sequence[Sequence[int]], flags: Sequence[bool], max_seq_len: int) -> Dict[str, object]:
    """Join tokenized pieces into ``input_ids`` / ``labels``, keeping the first ``max_seq_len`` tokens.

    An example that only loses unsupervised tokens after its last supervised one (the template's ``"\\n"`` after
    the final ``<|im_end|>``) fits: that tail is cut silently and ``overflow`` is 0, since no label is lost. The
    counts come from the pieces' lengths, not from a pass over the tokens.

    Returns:
        ``{"input_ids": [seq], "labels": [seq], "overflow": tokens cut (0 when it fits or only lost that tail),
        "supervised": supervised tokens kept}``.
    """
    input_ids: List[int] = []
    labels: List[int] = []
    supervised = 0  # kept
    first = last = None  # where the supervised tokens start and end (token positions)
    for ids, flag in zip(piece_ids, flags):
        if flag and ids:
            first = len(input_ids) if first is None else first
            last = len(input_ids) + len(ids)
            supervised += max(0, min(last, max_seq_len) - len(input_ids))
        input_ids.extend(ids)
        labels.extend(ids if flag else [IGNORE_INDEX] * len(ids))
    overflow = max(0, len(input_ids) - max_seq_len)
    if overflow and first is not None and last <= max_seq_len:
        overflow = 0  # only an unsupervised tail is cut: nothing the loss sees is lost
    return {"input_ids": input_ids[:max_seq_len], "labels": labels[:max_seq_len], "overflow": overflow,
            "supervised": supervised}


def _tokenize(tokenizer, texts: List[str]) -> List[List[int]]:
    """The ids of each text, no special tokens added: ``tokenizer(texts, add_special_tokens=False)["input_ids"]``.

    A fast tokenizer whose backend is set as that call sets it (no truncation or padding, the same
    ``split_special_tokens``) is called directly (``encode_batch_fast``: no offsets, no per-text conversion to
    dicts; 22% less time on Qwen's tokenizer, the same ids)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


tokenize_texts = _tokenize  # the public name, for the preference pairs (qwenft.preference.data)


def encode_example(tokenizer, messages: Sequence[Dict[str, str]], *, max_seq_len: int, train_on: str,
                   system_prompt: Optional[str] = None) -> Dict[str, object]:
    """Tokenize one conversation with response-only labels.

    Args:
        tokenizer: the model's tokenizer (its chat template is used).
        messages: ``[{role, content}]``, ending with an assistant turn.
        max_seq_len: tokens kept (the first ones); ``overflow`` says how many were cut.
        train_on: ``assistant`` | ``last_assistant`` | ``all``.
        system_prompt: prepended as a system turn when the conversation has none (None: the template's).

    Returns:
        ``{"input_ids": [seq], "labels": [seq], "overflow": int}``: labels are ``-100`` except supervised
        answer tokens (content + ``<|im_end|>``, not the ``"\\n"`` after it).

    Raises:
        DataError: no token is supervised (before truncation), or see :func:`segments`.

    >>> encode_example(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    ...                max_seq_len=64, train_on="assistant")["labels"][-4:]   # doctest: +SKIP
    [9707, 13, 151645, -100]
    """
    pieces = segments(tokenizer, with_system(messages, system_prompt), train_on)
    example = assemble(_tokenize(tokenizer, [t for t, _ in pieces]), [f for _, f in pieces], max_seq_len)
    if example["overflow"] == 0 and example["supervised"] == 0:
        raise DataError("no supervised tokens")
    return example


def encode_text(tokenizer, text: str, *, max_seq_len: int) -> Dict[str, object]:
    """Tokenize plain text for continued pre-training: every token supervised, ``<|endoftext|>`` appended.

    Returns:
        As :func:`encode_example`.
    """
    ids = _tokenize(tokenizer, [text])[0] + [end_of_text_id(tokenizer)]
    return assemble([ids], [True], max_seq_len)


def prompt_ids(tokenizer, messages: Sequence[Dict[str, str]], system_prompt: Optional[str] = None) -> List[int]:
    """The generation prompt for ``messages``: all turns but a final assistant answer, then the assistant
    header (``add_generation_prompt=True``). Token for token the prefix :func:`encode_example` trains on.

    Args:
        messages: a conversation; a trailing assistant turn (the reference answer) is left out.
        system_prompt: as in :func:`encode_example` (use the same value as in training).

    Returns:
        Token ids ``[seq]``.
    """
    messages = list(messages)
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    text = _render(tokenizer, with_system(messages, system_prompt), True)
    return _tokenize(tokenizer, [text])[0]
