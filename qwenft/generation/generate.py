"""The KV-cached sampler: prefill a left-padded prompt batch once, then decode one token per step.

Works on any causal LM that takes ``cache=`` (transformers 5 models, PEFT-wrapped or merged) and any
tokenizer. One call:

1. encodes the prompts (text, chat messages rendered with ``apply_chat_template(add_generation_prompt=True)``,
   or token ids) and left-pads them (:mod:`qwenft.generation.kv_cache`);
2. prefill: one forward over the whole batch with the attention mask and mask-derived position ids,
   filling a fresh ``DynamicCache`` and keeping only the last position's logits;
3. decode: each step feeds only the token just chosen per row (``[batch, 1]``), its position and the
   grown mask; the model reads everything earlier from the cache. Finished rows keep receiving the pad
   token, as in transformers, and their outputs are ignored.

The model inputs of every step are the ones ``model.generate`` builds (same mask, positions, cache class,
``logits_to_keep=1``), and the processors are bit-identical (:mod:`qwenft.generation.sampling`), so greedy
output equals ``model.generate(do_sample=False)`` token for token and, for the same seed, sampled output
equals ``model.generate(do_sample=True)``.

Seeds: with ``seed`` set, draws come from a private ``torch.Generator`` seeded with it; the global RNG is
neither read nor advanced. That generator produces the same numbers as the global RNG right after
``torch.manual_seed(seed)``, which is what ``torch.manual_seed(seed); model.generate(...)`` draws from, so
both give the same tokens. With ``seed=None`` the sampler draws from the global RNG, as transformers does.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import torch

from qwenft.config import GenerateConfig, QwenftError
from qwenft.generation.kv_cache import (cache_bytes, left_pad, new_cache, new_static_cache, position_ids,
                                        token_history)
from qwenft.generation.params import SamplingParams, resolve_params
from qwenft.generation.results import GenerationOutput, GenerationStats, RowControl, SequenceResult, TextStream
from qwenft.generation.sampling import check_finite, process_scores, raw_logprobs, select_tokens
from qwenft.generation.text import RowText, ends_with_any

log = logging.getLogger(__name__)

Messages = Sequence[Mapping[str, str]]
Prompt = Union[str, Messages, Sequence[int]]
TextCallback = Callable[[int, str], None]


def encode_prompts(tokenizer, prompts: Sequence[Prompt], chat: bool = False) -> List[List[int]]:
    """Token ids of each prompt.

    A string is tokenized as is (``chat=False``) or as the content of one user turn (``chat=True``); a list
    of ``{"role", "content"}`` messages is rendered with the tokenizer's chat template and
    ``add_generation_prompt=True`` (the prefix the trainer supervises after); a list of ints is used as is.

    Raises:
        QwenftError: an empty prompt, or an item of another type; the message names its index.
    """
    encoded = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str) and chat:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.tolist()
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt) and len(prompt):
            ids = tokenizer.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise QwenftError(f"prompt {index}: expected a string, a list of chat messages or a list of token ids, "
                              f"got {type(prompt).__name__}")
        if not ids:
            raise QwenftError(f"prompt {index}: empty prompt (it needs at least one token)")
        encoded.append([int(t) for t in ids])
    return encoded


def check_supported(config: GenerateConfig, model=None) -> None:
    """Refuse settings this sampler cannot run here.

    Raises:
        QwenftError: ``generate.compile=true`` without the model on a CUDA device (torch.compile with CUDA
            graphs is a GPU path; ``generate.static_cache=true`` gives the fixed-shape cache on any device).
    """
    if config.compile == "true":
        on_cuda = _device(model).type == "cuda" if model is not None else torch.cuda.is_available()
        if not on_cuda:
            raise QwenftError("generate.compile=true (static cache + torch.compile) needs the model on a CUDA device; "
                              "use generate.static_cache=true (no compile) or generate.compile=false")


def _accepts(model, name: str) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return name in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False


def auto_compile(device: str, sixteen_bit: bool) -> bool:
    """``generate.compile=auto``: compile the decode step on a CUDA device when the base runs in 16-bit."""
    return device == "cuda" and sixteen_bit


def compile_decode(config: GenerateConfig, model) -> bool:
    """Whether decode steps are compiled: ``generate.compile`` true, or auto on a CUDA device with no 4-bit layer
    (a 16-bit base: :mod:`qwenft.generation.engine` dequantizes one when it fits)."""
    if config.compile != "auto":
        return config.compile == "true"
    from qwenft.model.load import has_4bit_layers

    return auto_compile(_device(model).type, not has_4bit_layers(model))


def bucket_length(tokens: int) -> int:
    """The static cache length for ``tokens`` positions: the next power of two, at least 64 (so that calls with
    different prompt lengths share a few compiled shapes)."""
    return max(64, 1 << (max(tokens, 1) - 1).bit_length())


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Sampler:
    """KV-cached generation over ``model`` and ``tokenizer``.

    Args:
        model: a causal LM (base, PEFT-wrapped or merged), in eval mode.
        tokenizer: its tokenizer (decoding, chat template, pad id).
        config: the ``generate`` config section; its None fields come from ``model.generation_config``.

        compile_backend: a ``torch.compile`` backend for the decode step (tests pass a counting one to check the
            number of compiles on a CPU); None: inductor with CUDA graphs (``mode="reduce-overhead"``) when
            :func:`compile_decode` says so.

    Compiled or with ``static_cache``, the cache is a ``StaticCache`` of a fixed length and the attention mask a
    fixed ``[rows, length]`` tensor, so every decode step has the same shapes; ``generate(cache_len=, rows=)``
    pins both (:func:`qwenft.generation.batches.generate_many` pads an evaluation to at most 3 such shapes).

    Raises:
        QwenftError: ``config.compile`` is true and the model is not on a CUDA device.

    >>> sampler = Sampler(model, tokenizer, config.generate)
    >>> out = sampler.generate([[{"role": "user", "content": "春天"}]], max_new_tokens=32)
    >>> out.sequences[0].text, out.stats.decode_tokens_per_s
    """

    def __init__(self, model, tokenizer, config: Optional[GenerateConfig] = None, compile_backend=None):
        config = config or GenerateConfig()
        if compile_backend is None:
            check_supported(config, model)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self._logits_to_keep = _accepts(model, "logits_to_keep")
        self._decode_forward = model
        self.compiled = compile_backend is not None or compile_decode(config, model)
        self.static = self.compiled or config.static_cache
        if self.compiled:  # decode steps only: the prefill's shapes change with every batch of prompts
            options = {"backend": compile_backend} if compile_backend is not None else {"mode": "reduce-overhead"}
            self._decode_forward = torch.compile(model, dynamic=False, fullgraph=False, **options)

    @property
    def generation_config(self):
        return getattr(self.model, "generation_config", None)

    def params(self, **overrides: Any) -> SamplingParams:
        """The resolved :class:`SamplingParams` for a call with ``overrides`` (see :func:`resolve_params`)."""
        return resolve_params(self.config, self.generation_config, self.tokenizer, **overrides)

    def _pad_id(self, params: SamplingParams) -> int:
        for value in (getattr(self.tokenizer, "pad_token_id", None),
                      getattr(self.generation_config, "pad_token_id", None)):
            if value is not None:
                return int(value)
        return params.stop_token_ids[0] if params.stop_token_ids else 0

    def generate(self, prompts: Sequence[Prompt], *, chat: bool = False, on_text: Optional[TextCallback] = None,
                 keep_logits: bool = False, cache_len: Optional[int] = None, rows: Optional[int] = None,
                 control: Optional[RowControl] = None, **overrides: Any) -> GenerationOutput:
        """Generate a continuation for every prompt, as one batch.

        Args:
            prompts: strings, chat message lists or token id lists (see :func:`encode_prompts`).
            chat: treat string prompts as one user turn of the chat template.
            on_text: called as ``on_text(row, delta)`` whenever a row's text grows; deltas never split a
                UTF-8 character and a row's deltas concatenate to its final ``text``.
            keep_logits: also return the raw logits of every step (tests, inspection).
            cache_len: static cache length (tokens) on the static / compiled path; default
                :func:`bucket_length` of the prompt width + max_new_tokens.
            rows: pad the batch to this many rows (copies of the first prompt, finished from the start and
                dropped from the results) so that batches of an evaluation share one shape.
            control: per-row limits, cancellation and a per-token callback (the server's batches,
                :class:`~qwenft.generation.results.RowControl`); None: every row runs to ``max_new_tokens``.
            **overrides: :class:`qwenft.config.GenerateConfig` fields for this call only.

        Returns:
            A :class:`GenerationOutput` with one :class:`SequenceResult` per prompt, in order.

        Raises:
            QwenftError: a bad prompt; ConfigError: a bad override; ValueError: ``cache_len`` shorter than the prompt
                width + max_new_tokens, or ``rows`` fewer than the prompts; NonFiniteLogits: the model gave NaN or
                inf logits (:func:`~qwenft.generation.sampling.check_finite`).

        Example:
            >>> sampler = Sampler(model, tokenizer)  # model, tokenizer = qwenft.model.load_model(config, device="cpu")
            >>> out = sampler.generate(["Hello there, how are you", "0 1"], max_new_tokens=24, do_sample=False)
            >>> out.sequences[0].text, out.sequences[0].stop_reason
            >>> sampler.generate(["春天来了"], chat=True, on_text=lambda row, delta: print(delta, end=""))
        """
        run = self._run(encode_prompts(self.tokenizer, prompts, chat), self.params(**overrides),
                        stream=on_text is not None, keep_logits=keep_logits, cache_len=cache_len, rows=rows,
                        control=control)
        while True:
            try:
                row, delta = next(run)
            except StopIteration as done:
                return done.value
            on_text(row, delta)

    def stream(self, prompt: Prompt, *, chat: bool = False, **overrides: Any) -> "TextStream":
        """Stream one prompt's text: iterate the returned :class:`TextStream` for deltas, then read ``.result``."""
        run = self._run(encode_prompts(self.tokenizer, [prompt], chat), self.params(**overrides),
                        stream=True, keep_logits=False)
        return TextStream(run)

    @torch.inference_mode()
    def _run(self, prompts: List[List[int]], params: SamplingParams, stream: bool, keep_logits: bool,
             cache_len: Optional[int] = None, rows: Optional[int] = None, control: Optional[RowControl] = None):
        """The prefill + decode loop; yields ``(row, delta)`` text events and returns the :class:`GenerationOutput`."""
        model, device = self.model, _device(self.model)
        if getattr(model, "training", False):
            log.warning("the model is in training mode (dropout active); call model.eval() before sampling")
        real = len(prompts)
        if rows is not None and rows < real:
            raise ValueError(f"rows={rows} is fewer than the {real} prompts of the batch")
        prompts = list(prompts) + [prompts[0]] * ((rows or real) - real)  # padding rows, dropped at the end
        batch = len(prompts)
        pad_id = self._pad_id(params)
        input_ids, mask = left_pad(prompts, pad_id, device)
        positions = position_ids(mask)
        width = input_ids.shape[1]
        if self.static:
            # One [rows, length] mask for the whole call: positions past the prompt are 1 (a position not yet
            # written is hidden by the causal mask over cache positions), so no decode step changes a shape.
            length = cache_len or bucket_length(width + params.max_new_tokens)
            if length < width + params.max_new_tokens:
                raise ValueError(f"cache_len={length} < prompt width {width} + max_new_tokens {params.max_new_tokens}")
            cache = new_static_cache(model, length)
            attn = mask.new_ones((batch, length))
            attn[:, :width] = mask
        else:
            cache = new_cache(model)
            # As model.generate does: with no padding the mask is dropped, so attention takes its causal fast path.
            attn = None if bool((mask == 1).all()) else mask
        extra = {"logits_to_keep": 1} if self._logits_to_keep else {}
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        stop_ids = set(params.stop_token_ids)
        texts = [RowText(self.tokenizer, params.stop_strings) for _ in range(batch)] \
            if (stream or params.stop_strings) else None

        start = time.perf_counter()
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, cache=cache, use_cache=True,
                    **extra)
        _sync(device)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()

        vocab = out.logits.shape[-1]
        history, seen = None, input_ids.shape[1]
        if params.repetition_penalty != 1.0:
            history = token_history(prompts, vocab, params.max_new_tokens, device)
        stop_index = torch.tensor([t for t in params.stop_token_ids if 0 <= t < vocab], dtype=torch.long,
                                  device=device) if params.min_new_tokens > 0 else None
        tokens: List[List[int]] = [[] for _ in range(batch)]
        logprobs: List[List[float]] = [[] for _ in range(batch)]
        entropies: List[List[float]] = [[] for _ in range(batch)]
        reasons: List[Optional[str]] = [None] * real + ["padding"] * (batch - real)
        kept: Optional[List[torch.Tensor]] = [] if keep_logits else None
        unfinished = torch.tensor([r is None for r in reasons], dtype=torch.bool, device=device)
        steps = 0
        for step in range(params.max_new_tokens):
            logits = out.logits[:, -1, :].to(dtype=torch.float32, copy=True)
            check_finite(logits, unfinished, step, out.logits.dtype)  # fp16 overflow: an error, never token 0
            del out
            if kept is not None:
                kept.append(logits[:real].clone())
            raw = torch.log_softmax(logits, dim=-1) if control is not None and control.logprobs >= 0 else None
            scores = process_scores(logits, params, None if history is None else history[:, :seen], stop_index, step)
            chosen, chosen_logp, entropy = select_tokens(scores, params.greedy, generator)
            # Finished rows emit the pad token (transformers does the same; it keeps the batch rectangular).
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad_id))
            top = raw_logprobs(raw, chosen, control.logprobs) if raw is not None else None
            if history is not None:
                history[:, seen] = chosen
                seen += 1
            steps += 1
            chosen_list, logp_list, ent_list = chosen.tolist(), chosen_logp.tolist(), entropy.tolist()
            for row in range(batch):
                if reasons[row] is not None:
                    continue
                token = chosen_list[row]
                tokens[row].append(token)
                logprobs[row].append(logp_list[row])
                entropies[row].append(ent_list[row])
                if control is not None:
                    control.token(row, token, ent_list[row], None if top is None else top[row])
                stop_allowed = step >= params.min_new_tokens
                if token in stop_ids:
                    reasons[row] = "eos"
                    continue
                if texts is not None:
                    delta, hit = texts[row].push(token, stop_allowed)
                    if delta and stream:
                        yield row, delta
                    if hit:
                        reasons[row] = "stop_string"
                        continue
                if stop_allowed and params.stop_sequences and ends_with_any(tokens[row], params.stop_sequences):
                    reasons[row] = "stop_string"
                elif step + 1 == params.max_new_tokens:
                    reasons[row] = "length"
                elif control is not None:
                    reasons[row] = control.finish(row, len(tokens[row]))
            if all(r is not None for r in reasons):
                break
            unfinished = torch.tensor([r is None for r in reasons], dtype=torch.bool, device=device)
            # Decode step: only the new token per row; positions continue from each row's last one.
            positions = positions[:, -1:] + 1
            if attn is not None and not self.static:
                attn = torch.cat([attn, attn.new_ones((batch, 1))], dim=-1)
            out = self._decode_forward(input_ids=chosen[:, None], attention_mask=attn, position_ids=positions,
                                       cache=cache, use_cache=True, **extra)
        _sync(device)
        decode_s = time.perf_counter() - start

        results = []
        for row in range(real):
            body = tokens[row][:-1] if reasons[row] == "eos" else tokens[row]
            if texts is not None:
                text, delta = texts[row].finish()
                if delta and stream:
                    yield row, delta
            else:
                text = self.tokenizer.decode(body, skip_special_tokens=True)
            results.append(SequenceResult(text=text, token_ids=tokens[row], stop_reason=reasons[row] or "length",
                                          logprobs=logprobs[row], entropies=entropies[row],
                                          prompt_tokens=len(prompts[row])))
        generated = sum(len(t) for t in tokens)
        stats = GenerationStats(batch_size=real, prompt_tokens=sum(len(p) for p in prompts[:real]),
                                generated_tokens=generated, decode_tokens=max(generated - real, 0),
                                prefill_s=prefill_s, decode_s=decode_s, kv_cache_bytes=cache_bytes(cache), steps=steps)
        return GenerationOutput(sequences=results, stats=stats, logits=kept)
