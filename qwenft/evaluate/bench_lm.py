"""qwenft's model as an lm-evaluation-harness ``LM``: the loaded model, its sampler, one process for both sides.

lm-eval (EleutherAI's lm-evaluation-harness) owns the tasks: their prompts, few-shot examples, answer extraction
and metrics. It asks a model three things, all answered here from the model qwenft already holds:

- ``loglikelihood``: lm-eval's own tokenization of each ``(context, continuation)`` pair (``TemplateLM``: the whole
  text encoded, the context's tokens split off, as ``HFLM`` does), scored by
  :func:`qwenft.evaluate.bench_score.score_pairs` (shared few-shot prefixes run once, one row for all single-token
  choices, only the read positions projected);
- ``generate_until``: qwenft's KV-cached sampler (:func:`qwenft.generation.batches.generate_many`), greedy (no
  sampling, no repetition penalty), stopping at the task's ``until`` strings and the model's end tokens, so a GSM8K
  answer comes from the same sampler as every other answer qwenft reports;
- ``loglikelihood_rolling``: lm-eval's rolling windows of ``max_length`` tokens, scored the same way.

Prompts are plain text, as lm-eval renders them by default (no chat template), unless
``eval.bench_chat_template=true``: then lm-eval puts them through :meth:`QwenftLM.apply_chat_template` (the
tokenizer's ChatML template, few-shot examples as turns).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from lm_eval.api.model import TemplateLM


class QwenftLM(TemplateLM):
    """An lm-eval model over a loaded qwenft model.

    Args:
        model: the model the side runs on (set again per side with :meth:`use`).
        tokenizer: its tokenizer.
        sampler: a :class:`qwenft.generation.Sampler` over ``model`` (generative tasks).
        batch_size: rows per forward pass / prompts per generation batch.
        max_length: longest input in tokens (the model's context window by default).
        max_gen_tokens: cap on generated tokens (None: each task's ``max_gen_toks``, lm-eval's default 256).
        progress: a callable ``(desc, total) -> tqdm-like`` for progress bars, or None.
    """

    def __init__(self, model, tokenizer, sampler, *, batch_size: int, max_length: Optional[int] = None,
                 max_gen_tokens: Optional[int] = None, progress=None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.batch_size = batch_size
        self.max_gen_tokens = max_gen_tokens
        self._max_length = max_length or int(getattr(model.config, "max_position_embeddings", 32768))
        self._progress = progress
        self.generated_tokens = 0

    def use(self, model) -> None:
        """Score with ``model`` from now on (the side :class:`qwenft.generation.engine.Engine` yields)."""
        self.model = model  # the sampler already runs this object: the engine yields the model it was built on

    # --- tokenization, as lm-eval's HFLM does it for a model without a BOS token -----------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "qwenft")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over lm-eval's turns (system, shots as user/assistant, the question)."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # --- the three requests ------------------------------------------------------------------------------
    def _bar(self, desc: str, total: int):
        return self._progress(desc, total) if self._progress is not None else None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[tuple]:
        from qwenft.evaluate.bench_score import score_pairs

        bar = None if disable_tqdm else self._bar("benchmark log-likelihoods", len(requests))
        try:
            return score_pairs(self.model, [(ctx, cont) for _, ctx, cont in requests], batch_size=self.batch_size,
                               max_length=self.max_length, pad_id=self._pad_id(),
                               progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner = [], []
        for index, request in enumerate(requests):
            (string,) = request.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                pairs.append(((None, None), list(context), list(continuation)))
                owner.append(index)
        scores = self._loglikelihood_tokens(pairs, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scores):
            totals[index] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        from qwenft.generation.batches import generate_many

        groups: Dict[tuple, List[int]] = {}
        settings = []
        for index, request in enumerate(requests):
            context, kwargs = request.args
            until, max_new = self._generation_settings(dict(kwargs or {}))
            settings.append((context, until, max_new))
            groups.setdefault((until, max_new), []).append(index)
        out: List[str] = [""] * len(requests)
        for (until, max_new), indices in groups.items():
            prompts = [self.tok_encode(settings[i][0])[-(self.max_length - max_new):] for i in indices]
            results, stats = generate_many(
                self.sampler, prompts, self.batch_size, desc=None if disable_tqdm else "benchmark generation",
                max_new_tokens=max_new, do_sample=False, temperature=0.0, repetition_penalty=1.0,
                stop_strings=list(until))
            self.generated_tokens += stats.generated_tokens
            for i, result in zip(indices, results):
                out[i] = _cut(result.text, until)
        return out

    def _generation_settings(self, kwargs: Dict[str, Any]):
        """``(until strings, max new tokens)`` from a task's ``generation_kwargs`` (lm-eval's names)."""
        until = kwargs.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        max_new = int(kwargs.pop("max_gen_toks", 256))
        if self.max_gen_tokens is not None:
            max_new = min(max_new, self.max_gen_tokens)
        return tuple(str(u) for u in until), max_new

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else self.eot_token_id)


def _cut(text: str, until) -> str:
    """``text`` up to the first of the ``until`` strings (the sampler already stops there; this is lm-eval's
    rule for text produced past a stop string inside one token)."""
    for stop in until:
        if stop and stop in text:
            text = text.split(stop, 1)[0]
    return text
