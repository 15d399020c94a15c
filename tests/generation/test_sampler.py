"""The KV-cached sampler (qwenft.generation): parity with transformers, cache, batching, stops, streaming, CLI.

Sampling parity is tested as *exact RNG parity*: for the same seed, the sampler's tokens equal
``torch.manual_seed(seed); model.generate(do_sample=True, ...)`` token for token. Each processor is
also compared bit for bit with the matching transformers logits processor (ties, a single token holding
more than top_p), and a chi-square test checks the draws against the processed distribution.
"""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from qwenft.config import ConfigError, GenerateConfig, QwenftError
from qwenft.generation import sampling
from qwenft.generation.command import read_prompts
from qwenft.generation.generate import bucket_length
from qwenft.generation.kv_cache import left_pad, position_ids
from qwenft.generation.params import SamplingParams, resolve_params
from qwenft.generation.text import REPLACEMENT, RowText, ends_with_any
from qwenft.model import load_model
from qwenft.generation import Sampler
from tests.conftest import compose_config, qwenft_in_process

PROMPTS = ["Hello there, how are you", "春天来了", "The quick brown fox jumps over the lazy dog. And then", "0 1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny-random model in fp32 (eval mode) and its tokenizer."""
    config = compose_config("model=tiny-random", "quant=none", f"out_dir={tmp_path_factory.mktemp('run')}",
                            command="generate")
    torch.manual_seed(0)
    model, tokenizer = load_model(config, device="cpu")
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def sharp(tiny):
    """tiny-random with its output layer scaled x20, so the argmax gaps (about 0.1 logit before scaling) dwarf
    the ~1e-6 float noise that a different batch shape introduces: greedy paths are then comparable."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.eval(), tokenizer


def encode(tokenizer, prompts):
    return [tokenizer(p)["input_ids"] for p in prompts]


def hf_generate(model, tokenizer, prompts, **kwargs):
    """transformers' generate on the same left-padded batch; returns each row's new tokens (pads dropped after
    a stop)."""
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    return [row[ids.shape[1]:].tolist() for row in out]


def assert_same_tokens(ours, reference, max_new_tokens, pad_id=0):
    assert len(ours.sequences) == len(reference)
    for row, (seq, ref) in enumerate(zip(ours.sequences, reference)):
        assert seq.token_ids == ref[:len(seq.token_ids)], f"row {row}: {seq.token_ids} != {ref}"
        if seq.stop_reason == "length":
            assert len(seq.token_ids) == max_new_tokens == len(ref)
        else:  # transformers pads a finished row
            assert set(ref[len(seq.token_ids):]) <= {pad_id}, ref


# ---------------------------------------------------------------- parity with transformers' generate


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_transformers(tiny, batch):
    model, tokenizer = tiny
    prompts = encode(tokenizer, PROMPTS[:batch])
    # The model's generation_config keeps repetition_penalty 1.05 in greedy mode, for both implementations.
    ours = Sampler(model, tokenizer).generate(prompts, max_new_tokens=24, do_sample=False)
    reference = hf_generate(model, tokenizer, prompts, max_new_tokens=24, do_sample=False)
    assert_same_tokens(ours, reference, 24)


@pytest.mark.parametrize("settings", [
    dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
    dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0),
    dict(temperature=0.7, top_k=5, top_p=0.5, min_p=0.1, repetition_penalty=0.8),
])
def test_sampling_equals_transformers_for_the_same_seed(tiny, settings):
    """Exact RNG parity: the sampler's private generator seeded with 123 draws what the global RNG draws after
    torch.manual_seed(123), and the processed scores are bit-identical."""
    model, tokenizer = tiny
    prompts = encode(tokenizer, PROMPTS)
    ours = Sampler(model, tokenizer).generate(prompts, max_new_tokens=30, do_sample=True, seed=123, **settings)
    torch.manual_seed(123)
    reference = hf_generate(model, tokenizer, prompts, max_new_tokens=30, do_sample=True, **settings)
    assert_same_tokens(ours, reference, 30)


def test_seed_is_private_and_none_uses_global_rng(tiny):
    model, tokenizer = tiny
    sampler, prompts = Sampler(model, tokenizer), encode(tokenizer, PROMPTS[:2])
    state = torch.get_rng_state()
    first = sampler.generate(prompts, max_new_tokens=12, do_sample=True, seed=7)
    assert torch.equal(state, torch.get_rng_state()), "a seeded call must not touch the global RNG"
    again = sampler.generate(prompts, max_new_tokens=12, do_sample=True, seed=7)
    other = sampler.generate(prompts, max_new_tokens=12, do_sample=True, seed=8)
    assert [s.token_ids for s in first.sequences] == [s.token_ids for s in again.sequences]
    assert [s.token_ids for s in first.sequences] != [s.token_ids for s in other.sequences]
    torch.manual_seed(7)
    unseeded = sampler.generate(prompts, max_new_tokens=12, do_sample=True)
    assert [s.token_ids for s in unseeded.sequences] == [s.token_ids for s in first.sequences]


def test_peft_wrapped_model_equals_its_own_generate(tiny):
    from qwenft.config import LoraConfig
    from qwenft.model import attach_lora

    model, tokenizer = tiny
    peft_model = attach_lora(copy.deepcopy(model), LoraConfig(r=4, lora_dropout=0.0), gradient_checkpointing=False)
    peft_model.eval()
    peft_model.config.use_cache = True
    torch.manual_seed(1)
    with torch.no_grad():  # a non-zero B, so the adapter changes the output
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    prompts = encode(tokenizer, PROMPTS)
    ours = Sampler(peft_model, tokenizer).generate(prompts, max_new_tokens=16, do_sample=False)
    reference = hf_generate(peft_model, tokenizer, prompts, max_new_tokens=16, do_sample=False)
    assert_same_tokens(ours, reference, 16)
    base = Sampler(model, tokenizer).generate(prompts, max_new_tokens=16, do_sample=False)
    assert [s.token_ids for s in base.sequences] != [s.token_ids for s in ours.sequences]


def test_nf4_tiny_greedy_equals_transformers(tmp_path):
    config = compose_config("model=tiny-random", "quant=nf4", f"out_dir={tmp_path}", command="generate")
    model, tokenizer = load_model(config, device="cpu")
    model.eval()
    prompts = encode(tokenizer, PROMPTS)
    ours = Sampler(model, tokenizer).generate(prompts, max_new_tokens=12, do_sample=False)
    assert_same_tokens(ours, hf_generate(model, tokenizer, prompts, max_new_tokens=12, do_sample=False), 12)


# ---------------------------------------------------------------- cache and batching


def test_decode_feeds_one_token_per_step_and_cache_grows(tiny):
    model, tokenizer = tiny
    prompts = encode(tokenizer, PROMPTS[:3])
    calls = []

    def record(module, args, kwargs):
        calls.append((tuple(kwargs["input_ids"].shape), kwargs["cache"].get_seq_length()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = Sampler(model, tokenizer).generate(prompts, max_new_tokens=10, min_new_tokens=10, stop_token_ids=[])
    finally:
        handle.remove()
    width = max(len(p) for p in prompts)
    assert calls[0] == ((3, width), 0)  # one prefill over the padded batch
    assert calls[1:] == [((3, 1), width + i) for i in range(9)]  # then one new token per row per step
    layers, kv_heads, head_dim = 2, 2, 16
    assert out.stats.kv_cache_bytes == 2 * layers * 3 * kv_heads * (width + 9) * head_dim * 4  # fp32


def test_cached_logits_equal_full_recomputation(tiny):
    """At every decode step, the logits from the cache equal a forward over the whole sequence without a cache.

    Tolerance 1e-4 (fp32): only the summation order of the attention and matmuls differs between a 1-token and a
    full-length forward; measured differences are ~1e-6 on logits of magnitude ~1.
    """
    model, tokenizer = tiny
    prompts = encode(tokenizer, PROMPTS[:3])
    steps = 12
    out = Sampler(model, tokenizer).generate(prompts, max_new_tokens=steps, min_new_tokens=steps, do_sample=True,
                                             seed=3, stop_token_ids=[], keep_logits=True)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    generated = torch.tensor([s.token_ids for s in out.sequences])
    worst = 0.0
    with torch.no_grad():
        for step in range(steps):
            full_ids = torch.cat([ids, generated[:, :step]], dim=1)
            full_mask = torch.cat([mask, torch.ones_like(generated[:, :step])], dim=1)
            logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=position_ids(full_mask),
                           use_cache=False).logits[:, -1].float()
            worst = max(worst, (logits - out.logits[step]).abs().max().item())
    assert worst < 1e-4, worst


def test_batched_equals_each_prompt_alone(sharp):
    model, tokenizer = sharp
    sampler = Sampler(model, tokenizer)
    prompts = encode(tokenizer, PROMPTS)
    batched = sampler.generate(prompts, max_new_tokens=20, do_sample=False, repetition_penalty=1.0)
    for row, prompt in enumerate(prompts):
        alone = sampler.generate([prompt], max_new_tokens=20, do_sample=False, repetition_penalty=1.0).sequences[0]
        assert alone.token_ids == batched.sequences[row].token_ids, row
        assert alone.text == batched.sequences[row].text
        # Same tokens, so the log-probs differ only by batch-shape float noise (fp32 on logits scaled x20).
        assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.sequences[row].logprobs)) < 1e-3


# ---------------------------------------------------------------- processors against transformers


def _logits_with_ties(batch=4, vocab=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 2
    logits[0, :8] = 1.5  # ties across the top-k and top-p boundaries
    logits[1] = torch.round(logits[1])  # many ties
    logits[2, 5] = 30.0  # one token holds more than any top_p
    logits[3, :] = 0.0  # flat row
    return logits


@pytest.mark.parametrize("k", [1, 3, 8, 64])
def test_top_k_equals_transformers(k):
    from transformers import TopKLogitsWarper

    logits = _logits_with_ties()
    assert torch.equal(sampling.top_k(logits, k), TopKLogitsWarper(top_k=k)(None, logits.clone()))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.8, 0.95, 0.999])
def test_top_p_equals_transformers(p):
    from transformers import TopPLogitsWarper

    logits = _logits_with_ties()
    ours = sampling.top_p(logits, p)
    assert torch.equal(ours, TopPLogitsWarper(top_p=p)(None, logits.clone()))
    assert (ours[2] > -math.inf).sum() == 1  # the dominant token alone survives


@pytest.mark.parametrize("value", [0.0, 0.05, 0.3, 1.0])
def test_min_p_and_temperature_equal_transformers(value):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits = _logits_with_ties()
    assert torch.equal(sampling.min_p(logits, value), MinPLogitsWarper(min_p=value)(None, logits.clone()))
    assert torch.equal(sampling.temperature(logits, 0.6), TemperatureLogitsWarper(0.6)(None, logits.clone()))


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_and_min_new_tokens_equal_transformers(penalty):
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    logits = _logits_with_ties()
    input_ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(1))
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    assert torch.equal(sampling.repetition_penalty(logits.clone(), input_ids, penalty), expected)
    expected = MinNewTokensLengthLogitsProcessor(10, 2, [3, 9])(input_ids, logits.clone())
    assert torch.equal(sampling.suppress_tokens(logits.clone(), torch.tensor([3, 9])), expected)


def test_draws_follow_the_processed_distribution():
    """Chi-square goodness of fit of 20,000 draws against softmax(top_k(top_p(temperature(logits))))."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.2, 0.0, -1.0, -3.0]])
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=6, top_p=0.95)
    scores = sampling.process_scores(logits.clone(), params, None, None, 0)
    probs = torch.softmax(scores, -1)[0]
    keep = probs > 0
    assert 2 < int(keep.sum()) < 8  # the filters removed something and kept several tokens
    gen = torch.Generator().manual_seed(0)
    draws = sampling.select_tokens(scores.expand(20000, -1).contiguous(), False, gen)[0]
    counts = torch.bincount(draws, minlength=8).double()
    assert counts[~keep].sum() == 0  # nothing drawn outside the kept set
    expected = 20000 * probs[keep].double()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # p = 0.001 one-sided; Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical)


# ---------------------------------------------------------------- defaults and controls


def test_defaults_come_from_generation_config_and_presets_win(tiny, tmp_path):
    model, tokenizer = tiny
    params = resolve_params(GenerateConfig(), model.generation_config, tokenizer)
    assert (params.do_sample, params.temperature, params.top_p, params.top_k, params.repetition_penalty) == \
        (True, 0.7, 0.8, 20, 1.05)
    assert params.stop_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    creative = compose_config("model=tiny-random", "generate=creative", f"out_dir={tmp_path}").generate
    params = resolve_params(creative, model.generation_config, tokenizer)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 0.95, 50, 0.05)
    assert params.repetition_penalty == 1.05  # not in the preset: still the model's
    precise = compose_config("model=tiny-random", "generate=precise", f"out_dir={tmp_path}").generate
    assert resolve_params(precise, model.generation_config, tokenizer).greedy
    assert resolve_params(creative, model.generation_config, tokenizer, temperature=0.0).greedy
    with pytest.raises(ConfigError, match="generate.top_p"):
        resolve_params(creative, model.generation_config, tokenizer, top_p=1.5)
    with pytest.raises(ConfigError, match="unknown sampler setting 'topp'"):
        resolve_params(creative, model.generation_config, tokenizer, topp=0.5)


def test_compile_needs_cuda(tiny):
    model, tokenizer = tiny  # on the CPU
    with pytest.raises(QwenftError, match="generate.compile=true .* needs the model on a CUDA device"):
        Sampler(model, tokenizer, GenerateConfig(compile=True))  # a bool is read as "true"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="generate.compile runs on a CUDA device only")
def test_compiled_decode_equals_the_dynamic_cache_on_cuda(tiny):
    """generate.compile=true (static cache + torch.compile of the decode step): the same greedy tokens as the
    plain dynamic-cache path, for one prompt and a padded batch of 4, on a copy of the tiny model on the GPU."""
    import copy

    model, tokenizer = tiny
    gpu = copy.deepcopy(model).to("cuda").eval()
    for batch in (1, 4):
        prompts = encode(tokenizer, PROMPTS[:batch])
        plain = Sampler(gpu, tokenizer).generate(prompts, max_new_tokens=12, do_sample=False)
        compiled = Sampler(gpu, tokenizer, GenerateConfig(compile=True)).generate(prompts, max_new_tokens=12,
                                                                                   do_sample=False)
        assert [s.token_ids for s in compiled.sequences] == [s.token_ids for s in plain.sequences]


@pytest.mark.parametrize("batch", [1, 4])
def test_static_cache_equals_dynamic_and_transformers_static(tiny, batch):
    """generate.static_cache: the fixed-size cache (the compile path's cache) changes no token, for a padded batch
    too; transformers' generate with cache_implementation="static" agrees."""
    model, tokenizer = tiny
    prompts = encode(tokenizer, PROMPTS[:batch])
    dynamic = Sampler(model, tokenizer).generate(prompts, max_new_tokens=20, do_sample=False)
    static = Sampler(model, tokenizer, GenerateConfig(static_cache=True)).generate(prompts, max_new_tokens=20,
                                                                                    do_sample=False)
    assert [s.token_ids for s in static.sequences] == [s.token_ids for s in dynamic.sequences]
    # The static cache holds prompt width + max_new_tokens positions rounded up to a bucket (a power of two, at
    # least 64) from the start: K and V, every layer.
    cfg = model.config
    positions = bucket_length(max(len(p) for p in prompts) + 20)
    assert positions == 64
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert static.stats.kv_cache_bytes == (2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * positions
                                           * head_dim * model.dtype.itemsize)
    reference = hf_generate(model, tokenizer, prompts, max_new_tokens=20, do_sample=False,
                            cache_implementation="static")
    assert_same_tokens(static, reference, 20)


class ScriptedLM(torch.nn.Module):
    """A stand-in causal LM whose next token follows a script (logit 10 on the scripted id, 0 elsewhere)."""

    def __init__(self, script, vocab, eos=0):
        super().__init__()
        self.script, self.vocab, self.calls = list(script), vocab, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = None
        self.generation_config = SimpleNamespace(eos_token_id=[eos], pad_token_id=eos)

    def forward(self, input_ids, cache=None, **kwargs):
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        logits[:, -1, self.script[min(self.calls, len(self.script) - 1)]] = 10.0
        self.calls += 1
        return SimpleNamespace(logits=logits)


def test_stop_sequence_with_overlapping_prefix():
    """Stop sequence [1, 2] in the stream 1, 1, 2 (the case a stateful matcher misses)."""
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids, **kw: "".join(chr(97 + i) for i in ids))
    model = ScriptedLM([1, 1, 2, 3, 4], vocab=8)
    out = Sampler(model, tokenizer).generate([[5, 6]], max_new_tokens=5, stop_sequences=[[1, 2]], stop_token_ids=[])
    assert out.sequences[0].token_ids == [1, 1, 2]
    assert out.sequences[0].stop_reason == "stop_string"
    assert ends_with_any([1, 1, 2], [[1, 2]]) and not ends_with_any([1, 2, 1], [[1, 2]])


def test_stop_strings_eos_length_and_min_new_tokens(tiny):
    _, tokenizer = tiny
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    # Overlapping prefix in text: stop string "ab" in "a", "a", "b"; the text ends before the stop string.
    out = Sampler(ScriptedLM([a, a, b, a], 512), tokenizer).generate([[5]], max_new_tokens=6, stop_strings=["ab"])
    assert (out.sequences[0].text, out.sequences[0].stop_reason, len(out.sequences[0].token_ids)) == \
        ("a", "stop_string", 3)
    # A stop string spanning tokens; streaming never shows what the result cuts off.
    answer = tokenizer("The capital of France is Paris. Yes")["input_ids"]
    deltas = []
    out = Sampler(ScriptedLM(answer, 512), tokenizer).generate(
        [[5]], max_new_tokens=len(answer), stop_strings=["Paris."], on_text=lambda row, d: deltas.append(d))
    assert out.sequences[0].text == "The capital of France is " == "".join(deltas)
    # EOS (id 2) ends the row and is not in the text; min_new_tokens holds it off for 3 tokens.
    out = Sampler(ScriptedLM([a, 2], 512), tokenizer).generate([[5]], max_new_tokens=6, stop_token_ids=[2])
    assert (out.sequences[0].token_ids, out.sequences[0].text, out.sequences[0].stop_reason) == ([a, 2], "a", "eos")
    model = ScriptedLM([2], 512)
    model.script = [2]
    out = Sampler(model, tokenizer).generate([[5]], max_new_tokens=6, min_new_tokens=3, stop_token_ids=[2])
    assert len(out.sequences[0].token_ids) == 4 and out.sequences[0].token_ids[:3].count(2) == 0
    assert out.sequences[0].stop_reason == "eos"
    out = Sampler(ScriptedLM([a], 512), tokenizer).generate([[5]], max_new_tokens=4)
    assert (out.sequences[0].stop_reason, len(out.sequences[0].token_ids)) == ("length", 4)


def _stream_chinese(tokenizer, answer):
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    broken = [i for i in ids if tokenizer.decode([i]).endswith(REPLACEMENT)]
    assert broken, "the answer must split at least one character over tokens, or the test cannot fail"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = ScriptedLM(ids + [im_end], max(len(tokenizer), max(ids) + 1), eos=im_end)
    stream = Sampler(model, tokenizer).stream([{"role": "user", "content": "春天"}], max_new_tokens=len(ids) + 5,
                                              stop_token_ids=[im_end])
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == answer
    assert all(REPLACEMENT not in d for d in deltas)
    assert len(deltas) > 3 and stream.result.stop_reason == "eos"


def test_streaming_chinese_with_tiny_tokenizer(tiny):
    _, tokenizer = tiny
    _stream_chinese(tokenizer, "春天来了，花开了。我们一起去公园散步吧！🌸 春眠不觉晓")


@pytest.mark.slow  # the real Qwen tokenizer: Chinese text streamed whole across multi-byte tokens
def test_streaming_chinese_with_qwen_tokenizer(embedded_dir):
    from qwenft.model import load_tokenizer

    _stream_chinese(load_tokenizer(str(embedded_dir)), "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。🌸𠀋")


def test_row_text_holds_back_possible_stop_prefix(tiny):
    _, tokenizer = tiny
    row = RowText(tokenizer, ["END"])
    shown = []
    for token in tokenizer("abc EN")["input_ids"]:
        shown.append(row.push(token)[0])
    assert "".join(shown) == "abc "  # "EN" may still become "END"
    row.push(tokenizer.convert_tokens_to_ids("D"))
    final, last = row.finish()
    assert final == "abc " and last == ""
    # A match before min_new_tokens is passed over for good; the next one stops the row.
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    row = RowText(tokenizer, ["ab"])
    shown = [row.push(a, False), row.push(b, False), row.push(a, True), row.push(b, True)]
    assert shown == [("", False), ("ab", False), ("", False), ("", True)]
    assert row.finish() == ("ab", "")


# ---------------------------------------------------------------- the command


def test_prompts_file_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "p.jsonl"
    cases = [('{"prompt": "ok"}\n{"prompt": 3}\n', ":2: field 'prompt'"),
             ('{"prompt": "ok"}\n\n{bad json\n', ":3: not valid JSON"),
             ('{"messages": [{"role": "bot", "content": "x"}]}\n', ":1: field 'messages[0].role'"),
             ('{"messages": [{"role": "user"}]}\n', ":1: field 'messages[0].content'"),
             ('{"text": "x"}\n', ":1: missing field 'prompt'"),
             ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}\n', ":1: fields 'prompt' and 'messages'"),
             ("\n", "has no prompts")]
    for content, message in cases:
        path.write_text(content, encoding="utf-8")
        with pytest.raises(QwenftError, match=message.replace("[", r"\[").replace("]", r"\]")):
            read_prompts(str(path))


def test_prompts_file_goes_through_the_data_files_reader(tmp_path):
    """A BOM is not content; bytes that are not UTF-8 stop with file, line and byte offset (issue 19)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n')
    assert read_prompts(str(path)) == [(1, {"prompt": "hi"})]
    path.write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(QwenftError, match=r"p\.jsonl: line 2: not UTF-8 text: byte 0xe9 at byte offset 32 "):
        read_prompts(str(path))


def test_cli_prompts_file(tmp_path, capsys, monkeypatch):
    """The command line (COMMAND_TABLE, Hydra, exit code), in this process: a JSONL file in, a JSONL file out."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello", "id": 1}, {"messages": [{"role": "user", "content": "春天"}]}, {"prompt": "0 1 2"}]
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in rows]
    prompts.write_text(lines[0] + "\n" + "".join(lines[1:]), encoding="utf-8")  # a blank line 2 is skipped
    monkeypatch.chdir(tmp_path)
    done = qwenft_in_process(capsys, "generate", "model=tiny-random", "quant=none", f"prompts_file={prompts}",
                             "generate.max_new_tokens=5", "generate.batch_size=2")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (tmp_path / "prompts.generations.jsonl").read_text().splitlines()]
    assert [line.get("id") for line in lines] == [1, None, None] and "messages" in lines[1]
    assert [line["input_line"] for line in lines] == [1, 3, 4]  # each output names its line in the prompts file
    assert all(line["completion_tokens"] == len(line["token_ids"]) == len(line["logprobs"]) for line in lines)
    assert "decode" in done.stderr and "tokens/s" in done.stderr and "peak" in done.stderr
    assert not list(tmp_path.glob("*.tmp"))  # the temporary file was renamed into place


def test_generate_command_streams_and_refuses_compile(tmp_path, capsys):
    """The summary line names the memory it measured (CUDA's allocator on a GPU, the process RSS on a CPU), and
    generate.compile=true is refused on a CPU only (on a GPU it runs: test_compiled_decode_... covers its tokens)."""
    from qwenft.generation.command import generate_command

    cuda = torch.cuda.is_available()
    config = compose_config("model=tiny-random", "quant=none", "prompt=hello", "generate.max_new_tokens=6",
                            "generate.do_sample=false", f"out_dir={tmp_path}", command="generate")
    generate_command(config)
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and "tokens/s" in captured.err
    assert ("peak GPU memory" if cuda else "peak RSS") in captured.err
    config.generate.compile = "true"
    if cuda:
        generate_command(config)
        assert "tokens/s" in capsys.readouterr().err
    else:
        with pytest.raises(QwenftError, match="generate.compile=true"):
            generate_command(config)
    config.generate.compile, config.prompt = "false", None
    with pytest.raises(QwenftError, match="exactly one of"):
        generate_command(config)


def test_generate_refuses_a_bad_out_before_loading(tmp_path):
    from qwenft.generation.command import generate_command

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n', encoding="utf-8")
    base = ["model=tiny-random", "quant=none", f"prompts_file={prompts}"]
    for out, message in ((tmp_path, "is a directory"), (prompts, "is the prompts file itself")):
        with pytest.raises(QwenftError, match=message):
            generate_command(compose_config(*base, f"out={out}", command="generate"))
    assert prompts.read_text(encoding="utf-8") == '{"prompt": "hello"}\n'  # the input is untouched
    with pytest.raises(QwenftError, match="out= names the results file of prompts_file"):  # not silently unused
        generate_command(compose_config("model=tiny-random", "quant=none", "prompt=hi", f"out={tmp_path / 'a.jsonl'}",
                                        command="generate"))
    prompts.write_text('\ufeff{"prompt": "hello"}\n', encoding="utf-8")  # a byte-order mark is not content
    assert read_prompts(str(prompts)) == [(1, {"prompt": "hello"})]


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny):
    from qwenft.config import ConfigError, GenerateConfig
    from qwenft.generation.params import resolve_params

    model, tokenizer = tiny
    size = len(tokenizer)
    assert resolve_params(GenerateConfig(stop_token_ids=[size - 1]), None, tokenizer).stop_token_ids == (size - 1,)
    for key, config in (("stop_token_ids", GenerateConfig(stop_token_ids=[size])),
                        ("stop_sequences", GenerateConfig(stop_sequences=[[1, -1]]))):
        with pytest.raises(ConfigError, match=f"generate.{key}: token id .* outside the vocabulary"):
            resolve_params(config, None, tokenizer)


# ---------------------------------------------------------------- the embedded 0.5B model (slow)


@pytest.mark.slow  # the real 0.5B: greedy tokens equal transformers' on real weights
@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_embedded_greedy_equals_transformers(embedded_dir, quant, tmp_path):
    """bf16 and NF4: greedy tokens equal model.generate(do_sample=False) for batch 1 and a batch of 4.

    NF4 (compute dtype from quant.compute_dtype=auto) runs 10 new tokens instead of 16: bitsandbytes' CPU 4-bit
    matmul decodes several times slower than bf16 here (measured 1.3 vs 4.7 tokens/s on one thread), and the
    test must stay near a minute.
    """
    new = 16 if quant == "none" else 10
    config = compose_config(f"quant={quant}", "model.dtype=bfloat16", f"out_dir={tmp_path}", command="generate")
    model, tokenizer = load_model(config, device="cpu")
    model.eval()
    messages = [[{"role": "user", "content": text}] for text in
                ["What is 2+2?", "春天", "Write a haiku about the sea.", "Name three primary colors, briefly."]]
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
               for m in messages]
    sampler = Sampler(model, tokenizer)
    outputs = []
    for batch in (prompts[:1], prompts):
        outputs.append(sampler.generate(batch, max_new_tokens=new, do_sample=False))
        reference = hf_generate(model, tokenizer, batch, max_new_tokens=new, do_sample=False)
        assert_same_tokens(outputs[-1], reference, new, tokenizer.pad_token_id)
    # Chat messages render to the same prompt as apply_chat_template(add_generation_prompt=True).
    chat = sampler.generate(messages[:1], max_new_tokens=4, do_sample=False).sequences[0]
    assert chat.token_ids == outputs[0].sequences[0].token_ids[:4]
