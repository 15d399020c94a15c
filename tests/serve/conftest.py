"""Helpers of the server tests: a tiny-random adapter on disk, a served model, a live uvicorn on 127.0.0.1."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from pathlib import Path

import torch

from tests.conftest import compose_config


def make_adapter(folder: Path) -> Path:
    """A LoRA adapter for tiny-random with random B weights (so tuned differs from base), and its qwenft.json:
    ``folder/RUN/adapter``, loadable by ``adapter=`` like a trained one."""
    from qwenft.model import attach_lora, load_model, save_adapter_meta

    adapter = folder / "RUN" / "adapter"
    if (adapter / "adapter_config.json").is_file():
        return adapter
    config = compose_config("model=tiny-random", "quant=none", "lora.r=4")
    model, _ = load_model(config, device="cpu")
    peft_model = attach_lora(model, config.lora, gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    peft_model.save_pretrained(str(adapter))
    save_adapter_meta(adapter, config)
    return adapter


def serve_config(adapter=None, *overrides: str):
    """A validated ``serve`` config on tiny-random (fp32, no quantization)."""
    extra = [f"adapter={adapter}"] if adapter else []
    return compose_config("model=tiny-random", "quant=none", *extra, *overrides, command="serve")


def served(adapter=None, *overrides: str, sharpen: float = 0.0):
    """:func:`qwenft.serve.command.load_served` for tiny-random; ``sharpen`` > 0 scales the output layer so that
    argmax gaps dwarf the float noise of another batch shape (batched greedy then equals alone)."""
    from qwenft.serve.command import load_served

    result = load_served(serve_config(adapter, *overrides))
    if sharpen:
        model = result.engine.model
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
        with torch.no_grad():
            head.weight.mul_(sharpen)
    return result


def with_serve(served_model, **serve_fields):
    """The same loaded model with other ``serve`` settings (a second app shares the weights)."""
    config = served_model.config
    serve = dataclasses.replace(config.serve, **serve_fields)
    return dataclasses.replace(served_model, config=dataclasses.replace(config, serve=serve))


class LiveServer:
    """``create_app(served)`` under uvicorn in a thread, on 127.0.0.1 and a free port; a context manager."""

    def __init__(self, served_model):
        from qwenft.serve.app import create_app

        self.app = create_app(served_model)
        self.scheduler = self.app.state.scheduler

    def __enter__(self) -> "LiveServer":
        import uvicorn

        from qwenft.serve.command import bind

        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def client(self, api_key: str = "none", **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples ``name`` with ``labels`` (others free) in a Prometheus exposition (0.0: none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def copy_served(served_model):
    """A deep copy of a served model (a test may change its weights)."""
    return copy.deepcopy(served_model)
