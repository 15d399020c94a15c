"""The published numbers of every Qwen2.5 model qwenft has a preset for, one row per Hugging Face repository.

:mod:`qwenft.model.family` turns the rows into :class:`~qwenft.model.family.Member` objects; nothing else reads
this module. Every number was read from a copy of the model's own ``config.json`` / ``generation_config.json`` (the
copies are named in :data:`REFS` and cited by each row), or from its model card; a number no copy showed is named
in the row's ``unverified`` keys and keeps the value DESIGN.md expects (the sliding-window keys, which DESIGN.md
does not give, are then left out of the config rather than guessed).
"""

from __future__ import annotations

# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size,
# tie_word_embeddings. Every config.json of a size that a row cites agrees with these (Qwen2.5-Coder and
# Qwen2.5-Math reuse the Qwen2.5 shapes: their model cards give the same layers, heads and parameter counts).
SHAPES = {
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "3B": (2048, 11008, 36, 16, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
    "14B": (5120, 13824, 48, 40, 8, 152064, False),
    "32B": (5120, 27648, 64, 40, 8, 152064, False),
    "72B": (8192, 29568, 80, 64, 8, 152064, False),
}

# Where the copies were read (search of public repositories and issues, 2026-12-07).
REFS = {
    "card": "the model card (huggingface.co/{repo}): layers, Q/KV heads, tied embeddings, parameters, context",
    "prof": "citsjtu2020/LLM-Prof sglang/Model_Config.md: the config.json of Qwen2.5-3B, -7B, -14B and -32B",
    "tf35896": "huggingface/transformers#35896: a Qwen2.5-3B config.json (max_window_layers 36, 32768 positions)",
    "i05": "mlx-audio's tests and a Rust test fixture: the config.json of Qwen2.5-0.5B-Instruct (transformers 4.43.1)",
    "b05": "a config dump titled Qwen/Qwen2.5-0.5B and a page quoting huggingface.co/Qwen/Qwen2.5-0.5B config.json",
    "i15": "a vLLM log loading Qwen/Qwen2.5-1.5B-Instruct/config.json, and its ModelScope copy quoted in a blog",
    "i7": "a planner fixture quoting Qwen/Qwen2.5-7B-Instruct config.json; DESIGN.md (checked on the real file)",
    "i14": "a vLLM long-context note quoting Qwen2.5-14B-Instruct's config.json (48 layers, 32768 positions)",
    "i32": "vllm issue text quoting Qwen2.5-32B-Instruct's config.json (4.43.1); its GPTQ-Int4 twin's config",
    "i72": "msmodelslim's guide quoting Qwen2.5-72B-Instruct's config.json; its AWQ twin's config (vocab 152064)",
    "math": "open-r1#469, GAIR-NLP/ToRL#23, NVIDIA-NeMo/Skills#468, Qwen2.5-Math#59: Qwen2.5-Math's config.json has "
            "max_position_embeddings 4096 and rope_theta 10000.0 (4k context)",
    "gen7": "Qwen2.5-7B-Instruct's model card: its default decoding is temperature 0.7, top_p 0.8, "
            "repetition_penalty 1.05",
    "qcfg": "a file of transformers.Qwen2Config calls, each 'From https://huggingface.co/Qwen/Qwen2.5-<size>/blob/main/"
            "config.json': every key of the 0.5B to 72B base models",
    "litgpt": "a copy of litgpt's config.py citing each base model's config.json: context (block_size), norm_eps, "
              "rope_base, layers, heads, KV groups, hidden, intermediate, padded vocab (Qwen2.5, -Coder, -Math)",
    "lev3": "a training config 'matching defaults in' Qwen2.5-3B-Instruct's config.json (32768 positions, eps 1e-6, "
            "tied, rope_theta 1e6); a course note checking that file's 32,768-token context",
}

# The generation_config.json defaults. Instruct models end a turn with <|im_end|> (151645) and stop on
# <|endoftext|> (151643) too, pad with <|endoftext|> (DESIGN.md, "Facts to get right"); base models end with
# <|endoftext|> (their config.json's eos_token_id, read in every base row's copies).
INSTRUCT_GENERATION = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                       "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
BASE_GENERATION = {"bos_token_id": 151643, "eos_token_id": 151643, "do_sample": False}
# generation keys no copy showed for a row (its generation_config.json itself was not found)
GEN_UNVERIFIED = ("do_sample", "top_k", "repetition_penalty")

Q = "Qwen2.5"
C = "Qwen2.5-Coder"
M = "Qwen2.5-Math"
ALL_CONTEXT = ("max_position_embeddings", "rope_theta", "rms_norm_eps")  # DESIGN.md's values kept, unverified

# (repo name, line, size, instruct, max_position_embeddings, rope_theta, rms_norm_eps, sliding_window,
#  max_window_layers, repetition_penalty, unverified config keys, refs). None: not published in a copy read.
ROWS = [
    ("Qwen2.5-0.5B-Instruct", Q, "0.5B", True, 32768, 1e6, 1e-6, 32768, 21, 1.1, (), ("i05",)),
    ("Qwen2.5-0.5B", Q, "0.5B", False, 32768, 1e6, 1e-6, 32768, 24, None, (), ("b05", "qcfg")),
    ("Qwen2.5-1.5B-Instruct", Q, "1.5B", True, 32768, 1e6, 1e-6, 32768, 21, 1.1, (), ("i15",)),
    # base models were published with 131,072 positions from the 1.5B up, except the 3B (32,768)
    ("Qwen2.5-1.5B", Q, "1.5B", False, 131072, 1e6, 1e-6, 131072, 28, None, (), ("qcfg", "litgpt")),
    # not verified: sliding_window, max_window_layers (no full copy of the file was found)
    ("Qwen2.5-3B-Instruct", Q, "3B", True, 32768, 1e6, 1e-6, None, None, 1.05, (), ("lev3", "card")),
    ("Qwen2.5-3B", Q, "3B", False, 32768, 1e6, 1e-6, 32768, 36, None, (), ("prof", "tf35896", "qcfg")),
    ("Qwen2.5-7B-Instruct", Q, "7B", True, 32768, 1e6, 1e-6, 131072, 28, 1.05, (), ("i7", "gen7")),
    ("Qwen2.5-7B", Q, "7B", False, 131072, 1e6, 1e-6, 131072, 28, None, (), ("prof", "qcfg")),
    # not verified: rms_norm_eps (the copy read shows the other keys; DESIGN.md's 1e-6 of the 7B kept)
    ("Qwen2.5-14B-Instruct", Q, "14B", True, 32768, 1e6, 1e-6, 131072, 70, 1.05, ("rms_norm_eps",), ("i14",)),
    # the base models of 14B and up have rms_norm_eps 1e-5 (their Instruct models 1e-6, where read)
    ("Qwen2.5-14B", Q, "14B", False, 131072, 1e6, 1e-5, 131072, 48, None, (), ("prof", "qcfg")),
    ("Qwen2.5-32B-Instruct", Q, "32B", True, 32768, 1e6, 1e-6, 131072, 70, 1.05, (), ("i32",)),
    ("Qwen2.5-32B", Q, "32B", False, 131072, 1e6, 1e-5, 131072, 64, None, (), ("prof", "qcfg")),
    ("Qwen2.5-72B-Instruct", Q, "72B", True, 32768, 1e6, 1e-6, 131072, 70, 1.05, (), ("i72",)),
    ("Qwen2.5-72B", Q, "72B", False, 131072, 1e6, 1e-5, 131072, 80, None, (), ("qcfg", "litgpt")),
    # Qwen2.5-Coder: the base models' context, eps and shape read (32,768 positions; 128k with YaRN per the cards);
    # not verified: the sliding-window keys, and every Instruct model's context keys (no copy found)
    ("Qwen2.5-Coder-1.5B-Instruct", C, "1.5B", True, 32768, 1e6, 1e-6, None, None, 1.1, ALL_CONTEXT, ("card",)),
    ("Qwen2.5-Coder-1.5B", C, "1.5B", False, 32768, 1e6, 1e-6, None, None, None, (), ("litgpt", "card")),
    ("Qwen2.5-Coder-7B-Instruct", C, "7B", True, 32768, 1e6, 1e-6, None, None, 1.05, ALL_CONTEXT, ("card",)),
    ("Qwen2.5-Coder-7B", C, "7B", False, 32768, 1e6, 1e-6, None, None, None, (), ("litgpt", "card")),
    ("Qwen2.5-Coder-14B-Instruct", C, "14B", True, 32768, 1e6, 1e-6, None, None, 1.05, ALL_CONTEXT, ("card",)),
    ("Qwen2.5-Coder-14B", C, "14B", False, 32768, 1e6, 1e-5, None, None, None, (), ("litgpt",)),
    ("Qwen2.5-Coder-32B-Instruct", C, "32B", True, 32768, 1e6, 1e-6, None, None, 1.05, ALL_CONTEXT, ("card",)),
    ("Qwen2.5-Coder-32B", C, "32B", False, 32768, 1e6, 1e-5, None, None, None, (), ("litgpt",)),
    # Qwen2.5-Math: a 4,096-token context and RoPE base 10,000 (the surprise of the family). Not verified: the
    # sliding-window keys, and the Instruct models' rms_norm_eps (DESIGN.md's 1e-6 kept; the 72B base has 1e-5)
    ("Qwen2.5-Math-1.5B-Instruct", M, "1.5B", True, 4096, 1e4, 1e-6, None, None, 1.05, ("rms_norm_eps",),
     ("math", "card")),
    ("Qwen2.5-Math-1.5B", M, "1.5B", False, 4096, 1e4, 1e-6, None, None, None, (), ("math", "litgpt")),
    ("Qwen2.5-Math-7B-Instruct", M, "7B", True, 4096, 1e4, 1e-6, None, None, 1.05, ("rms_norm_eps",),
     ("math", "card")),
    ("Qwen2.5-Math-7B", M, "7B", False, 4096, 1e4, 1e-6, None, None, None, (), ("math", "litgpt")),
    ("Qwen2.5-Math-72B-Instruct", M, "72B", True, 4096, 1e4, 1e-6, None, None, 1.05, ("rms_norm_eps",),
     ("math", "card")),
    ("Qwen2.5-Math-72B", M, "72B", False, 4096, 1e4, 1e-5, None, None, None, (), ("math", "litgpt")),
]
