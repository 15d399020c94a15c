"""The checks of a model directory (a merged model, or an adapter's base with the adapter's own files on top).

Each check is a function of a :class:`View` and the :class:`~qwenft.doctor.findings.Report` it adds to, with its
codes in :data:`~qwenft.doctor.findings.CODES`. The facts: Qwen2.5's special tokens and stop list
(:mod:`qwenft.chat`), the family's numbers (:mod:`qwenft.model.family`), RoPE scaling as transformers validates it
(modeling_rope_utils.py, ``_validate_yarn_rope_parameters``: ``max_position_embeddings /
original_max_position_embeddings`` must be 1 or the factor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from qwenft.chat import END_OF_TEXT, IM_END
from qwenft.doctor.findings import Report
from qwenft.doctor.identify import Identity, identify_config
from qwenft.doctor.read import Tensor, Tokenizer, same_bytes
from qwenft.doctor.template import check_template, ends_turns_with_im_end

FAMILY_IDS = {END_OF_TEXT: 151643, "<|im_start|>": 151644, IM_END: 151645}  # DESIGN.md, "Facts to get right"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


@dataclass
class View:
    """What the checks read: ``config`` (config.json), ``generation`` (generation_config.json, None when absent),
    ``tokenizer``, ``tensors`` (safetensors headers; None: not read), ``names``; ``generation_from`` and
    ``template_from`` say whose files they are (``the merged model``, ``the adapter``, ``the base``)."""

    config: dict
    generation: Optional[dict]
    tokenizer: Optional[Tokenizer]
    tensors: Optional[Dict[str, Tensor]]
    names: List[str] = field(default_factory=list)
    generation_from: str = "this directory"
    template_from: str = "this directory"


def is_qwen2(config: dict) -> bool:
    return config.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (config.get("architectures") or [])


def identity_of(view: View, report: Report) -> Identity:
    """Identify the model and say what it is (an info line)."""
    from qwenft.doctor.identify import describe

    if not is_qwen2(view.config):
        report.note(f"not a Qwen2 model (model_type {view.config.get('model_type')!r}): only the checks that need "
                    "no Qwen2.5 facts apply")
        return Identity(None)
    identity = identify_config(view.config, view.names, view.generation)
    report.note(describe(identity))
    return identity


def token_id(view: View, token: str, identity: Identity) -> Optional[int]:
    """``token``'s id: the tokenizer's, else the family's for a family member."""
    found = (view.tokenizer.ids if view.tokenizer else {}).get(token)
    if found is None and identity.member is not None:
        return FAMILY_IDS.get(token)
    return found


def eos_ids(values) -> List[int]:
    return [values] if isinstance(values, int) else [v for v in (values or []) if isinstance(v, int)]


def check_stops(view: View, report: Report, identity: Identity, need_generation: bool) -> None:
    """``generation-config-missing``, ``eos-missing-im-end``, ``pad-is-im-end``."""
    template = view.tokenizer.template if view.tokenizer else None
    im_end = token_id(view, IM_END, identity)
    if view.generation is None and need_generation:
        report.add("generation-config-missing", f"no generation_config.json in {view.generation_from}",
                   "save one with the stop list [<|im_end|>, <|endoftext|>] (151645, 151643 in Qwen2.5) and the "
                   "sampling defaults of the model trained from (model.generation_config.save_pretrained)")
    source = view.generation if view.generation is not None else view.config
    stops = eos_ids(source.get("eos_token_id"))
    file = "generation_config.json" if view.generation is not None else "config.json (no generation_config.json)"
    if im_end is not None and ends_turns_with_im_end(template) and im_end not in stops:
        report.add("eos-missing-im-end", f"the chat template ends turns with <|im_end|> ({im_end}) but "
                   f"{file} of {view.generation_from} stops on {stops or 'nothing'}: generation runs past the end "
                   "of every answer", f"set eos_token_id to [{im_end}, {token_id(view, END_OF_TEXT, identity)}] in "
                   "generation_config.json")
    pads = [view.tokenizer.pad if view.tokenizer else None]
    pad_ids = eos_ids((view.generation or {}).get("pad_token_id")) + eos_ids(view.config.get("pad_token_id"))
    if IM_END in pads or (im_end is not None and im_end in pad_ids):
        report.add("pad-is-im-end", f"the pad token of {view.template_from} is <|im_end|>, the token that ends a "
                   "turn: a training collator that masks padding by id also masked every answer's end",
                   "set the pad token to <|endoftext|> and retrain if the labels were masked by pad id (mask padding "
                   "by position: qwenft does)")


def check_tied(view: View, report: Report, identity: Identity) -> None:
    """``tied-lm-head-differs``, ``lm-head-missing``."""
    if view.tensors is None or EMBED not in view.tensors:
        return
    tied = bool(view.config.get("tie_word_embeddings", False))
    head = view.tensors.get(HEAD)
    if tied and head is not None and not same_bytes(head, view.tensors[EMBED]):
        report.add("tied-lm-head-differs", "config.json has tie_word_embeddings=true but the saved lm_head.weight "
                   "differs from embed_tokens: transformers ties them on load and one of the two trained matrices "
                   "is thrown away", "set \"tie_word_embeddings\": false in config.json")
    if not tied and head is None:
        member = identity.member
        was = f" ({member.repo_id} is tied)" if member is not None and member.config.get("tie_word_embeddings") else ""
        report.add("lm-head-missing", f"tie_word_embeddings is false and no lm_head.weight is saved{was}: the "
                   "output layer is initialised at random on load", "set \"tie_word_embeddings\": true in config.json "
                   "if the output layer is the input embedding, or save the model again with its lm_head")


def check_quantization(view: View, report: Report) -> None:
    """``quantization-config-leftover``: a quantization_config over 16/32-bit float weights."""
    quant = view.config.get("quantization_config")
    if not quant or not view.tensors:
        return
    dtypes = {t.dtype for t in view.tensors.values()}
    packed = [n for n in view.tensors if n.endswith((".absmax", ".quant_map", ".quant_state", ".qweight", ".scales"))
              or "quant_state" in n]
    if dtypes <= FLOAT_DTYPES and not packed:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        report.add("quantization-config-leftover", f"config.json has a quantization_config ({method}) but every "
                   f"weight is {'/'.join(sorted(dtypes))}: loaders quantize again or refuse the file",
                   "delete \"quantization_config\" from config.json (a merge into a dequantized base is 16-bit)")


def embedding_rows(view: View) -> Optional[int]:
    embed = (view.tensors or {}).get(EMBED)
    return embed.shape[0] if embed is not None and embed.shape else view.config.get("vocab_size")


def check_vocab(view: View, report: Report, identity: Identity) -> None:
    """``embedding-rows-shrunk`` (a family member), ``tokens-beyond-rows`` (any model)."""
    rows = embedding_rows(view)
    if not isinstance(rows, int):
        return
    member = identity.member
    if member is not None:
        want = member.config.get("vocab_size")
        vocab = view.config.get("vocab_size")
        small = min(r for r in (rows, vocab) if isinstance(r, int))
        if isinstance(want, int) and small < want:
            report.add("embedding-rows-shrunk", f"{small} embedding rows (config vocab_size {vocab}); "
                       f"{member.repo_id} has {want}: likely resized to len(tokenizer): the spare rows the family keeps are "
                       "gone and its tools expect them", f"resize the embeddings back to {want} rows "
                       f"(model.resize_token_embeddings({want})) before saving, and never shrink them")
            return
    size = view.tokenizer.size if view.tokenizer else None
    if isinstance(size, int) and size > rows:
        report.add("tokens-beyond-rows", f"the tokenizer has {size} tokens but the embedding has {rows} rows: the "
                   "last ones have no embedding (an index error or garbage when they occur)",
                   f"resize the embeddings to at least {size} rows and train the new ones, or save the tokenizer "
                   "the model was trained with")


def rope_of(config: dict) -> dict:
    """The RoPE scaling of a config.json (``rope_parameters`` in transformers 5, ``rope_scaling`` before)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if kind not in (None, "default"):
                return dict(value, rope_type=kind)
    return {}


def context_of(config: dict) -> int:
    """Tokens a config is meant for: ``max_position_embeddings``, or the scaled context when it is larger."""
    positions = int(config.get("max_position_embeddings") or 0)
    rope = rope_of(config)
    factor = rope.get("factor")
    if rope.get("rope_type") in ("yarn", "linear") and isinstance(factor, (int, float)):
        original = rope.get("original_max_position_embeddings") or positions
        return max(positions, int(original * factor))
    return positions


def rope_problem(kind, factor, positions, original) -> Optional[str]:
    """Why these RoPE scaling settings contradict each other (transformers' rule), or None."""
    if kind in (None, "", "none", "default"):
        return None
    if not isinstance(factor, (int, float)) or factor < 1:
        return f"{kind} scaling with factor {factor!r} (it must be a number >= 1)"
    if kind == "yarn" and original and positions:
        implicit = positions / original
        if implicit not in (1, factor):
            return (f"yarn factor {factor} but the context {positions} / original context {original} = "
                    f"{implicit:g} (it must be 1 or the factor)")
    return None


def check_rope(view: View, report: Report, max_seq_len: Optional[int]) -> None:
    """``rope-scaling-inconsistent`` and ``rope-trained-past-window`` for a config.json and the recorded length."""
    rope = rope_of(view.config)
    positions = view.config.get("max_position_embeddings")
    problem = rope_problem(rope.get("rope_type"), rope.get("factor"), positions,
                           rope.get("original_max_position_embeddings"))
    if problem:
        report.add("rope-scaling-inconsistent", f"config.json: {problem}",
                   "write the scaling with the RoPE base inside it, in rope_scaling and rope_parameters alike: "
                   "{\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768, "
                   "\"rope_theta\": 1000000.0} (Qwen2.5's base), with max_position_embeddings 32768 or 131072")
    context = context_of(view.config)
    if isinstance(max_seq_len, int) and context and max_seq_len > context:
        report.add("rope-trained-past-window", f"trained with data.max_seq_len={max_seq_len} (qwenft.json) but the "
                   f"model is meant for {context} tokens" + ("" if rope else " and has no RoPE scaling"),
                   "train again with model.rope_scaling set (yarn, factor >= data.max_seq_len / "
                   "max_position_embeddings), or with a shorter data.max_seq_len")


def declared_theta(config: dict) -> tuple:
    """``(rope_theta, where)`` as config.json writes it: rope_parameters', else top-level, else rope_scaling's;
    ``(None, "")`` when it writes none."""
    for key in ("rope_parameters", None, "rope_scaling"):
        holder = config.get(key) if key else config
        value = holder.get("rope_theta") if isinstance(holder, dict) else None
        if isinstance(value, (int, float)):
            return float(value), key or "top level"
    return None, ""


def loaded_theta(config: dict) -> tuple:
    """``(rope_theta, version)``: the RoPE base transformers uses for this Qwen2 config.json (metadata only;
    ``(None, why)`` when it refuses the config)."""
    import logging

    import transformers

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its warnings on odd scaling are the rope-scaling-inconsistent finding's
    try:
        loaded = transformers.Qwen2Config.from_dict(dict(config))
        rope = getattr(loaded, "rope_parameters", None) or {}
        value = rope.get("rope_theta") if isinstance(rope, dict) else None
        value = getattr(loaded, "rope_theta", None) if value is None else value  # transformers 4
    except Exception as exc:  # noqa: BLE001 -- transformers' validation raises many kinds
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        quiet.setLevel(level)
    return (float(value) if isinstance(value, (int, float)) else None), transformers.__version__


def check_rope_theta(view: View, report: Report, identity: Identity) -> None:
    """``rope-theta-lost``: the RoPE base transformers loads differs from the one config.json declares, or (none
    declared) from the family member's: e.g. a ``rope_scaling`` without ``rope_theta`` beside transformers 5's
    ``rope_parameters`` replaces them, and the base falls back to 10,000."""
    if not is_qwen2(view.config):
        return
    declared, where = declared_theta(view.config)
    places = [isinstance(view.config.get("rope_theta"), (int, float)),
              isinstance((view.config.get("rope_parameters") or {}).get("rope_theta"), (int, float))]
    if sum(places) == 1 and not isinstance(view.config.get("rope_scaling"), dict):
        loaded, version = declared, ""  # one declaration and nothing to override it: read as written (no import)
    else:
        loaded, version = loaded_theta(view.config)
    if loaded is None:
        report.note(f"skipped: the RoPE base as transformers loads it (it refuses config.json: {version})")
        return
    family = identity.member.config.get("rope_theta") if identity.member is not None else None
    want = declared if declared is not None else family
    if want is None or float(want) == loaded:
        return
    said = (f"config.json declares rope_theta {declared:,.0f} ({where})" if declared is not None else
            f"config.json declares no rope_theta ({identity.member.repo_id} uses {float(family):,.0f})")
    scaling = " (rope_scaling, which has no rope_theta, replaces rope_parameters)" if \
        isinstance(view.config.get("rope_scaling"), dict) and "rope_theta" not in view.config["rope_scaling"] else ""
    report.add("rope-theta-lost", f"{said} but transformers {version} loads it with rope_theta {loaded:,.0f}"
               f"{scaling}: every position is rotated wrongly and the model is degraded without an error",
               f"write \"rope_theta\": {float(want)} inside rope_scaling and inside rope_parameters (or at the top "
               "level of config.json when it has neither)")


def check_model(view: View, report: Report, need_generation: bool = True, max_seq_len: Optional[int] = None,
                template_known: bool = True) -> Identity:
    """Every check of a model directory; returns its identity for the caller's own checks.

    Args:
        need_generation: a missing generation_config.json is a finding (a model directory; an adapter's base from
            the family table has the table's).
        max_seq_len: the training length recorded (qwenft.json's ``data.max_seq_len``), None when unknown.
        template_known: the template checks apply (False: no tokenizer files were readable; said as an info line).
    """
    identity = identity_of(view, report)
    if template_known:
        tokenizer = view.tokenizer
        where = (tokenizer.template_from if tokenizer and tokenizer.template else "no tokenizer files")
        check_template(report, tokenizer.template if tokenizer else None, f"{where} of {view.template_from}",
                       is_qwen2(view.config), identity.member, identity.instruct)
    else:
        report.note("skipped: the chat template checks and the stop list against the template (no tokenizer files "
                    "in the adapter, and the base's are not on this machine)")
    check_stops(view, report, identity, need_generation)
    check_tied(view, report, identity)
    check_quantization(view, report)
    check_vocab(view, report, identity)
    check_rope(view, report, max_seq_len)
    check_rope_theta(view, report, identity)
    return identity
