"""``qwenft doctor PATH``: read an adapter directory, a merged model directory or a GGUF file, made by qwenft or any
other tool, and report what would make it behave wrongly (:mod:`qwenft.doctor.command`).

A command room: it may import any lower room (model, chat, config, ...) and ``export``'s facts; no lower room imports
it. It reads metadata only (JSON files, safetensors headers, GGUF key-values and tensor infos), never a model's weights.
"""
