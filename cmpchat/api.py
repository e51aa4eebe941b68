"""The public Python API: open a model on a backend, tokenize, get logits, generate and chat.

import cmpchat
model = cmpchat.open_model("Qwen3.5-9B-Q8_0.gguf")        # or open_model() for the demo model
for event in model.chat([cmpchat.Message("user", "Hello!")]):
    if isinstance(event, cmpchat.ContentDelta):
        print(event.text, end="", flush=True)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from cmpchat.backends.base import Backend
from cmpchat.backends.gpu.device import cuda_gpu_present
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.chat.messages import Message, Tool
from cmpchat.chat.template import ChatFormat, RenderedPrompt
from cmpchat.demo import ensure_demo_model
from cmpchat.engine.events import GenerationEvent
from cmpchat.engine.generator import GenerationOptions, Generator
from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer

BackendName = Literal["auto", "cpu", "cuda"]
BACKENDS: tuple[str, ...] = ("auto", "cpu", "cuda")


class Model:
    """A model file opened on a backend, with its tokenizer and chat format."""

    def __init__(self, model_file: ModelFile, backend: Backend, *, is_demo: bool = False) -> None:
        self.model_file = model_file
        self.backend = backend
        self.is_demo = is_demo
        self.tokenizer = Tokenizer.from_metadata(model_file.metadata)
        self.chat_format = ChatFormat.from_metadata(model_file.metadata)
        self.generator = Generator(backend, self.tokenizer)

    @property
    def config(self) -> ModelConfig:
        return self.backend.config

    @property
    def path(self) -> Path:
        return self.model_file.path

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token text is matched only when `parse_special` is set."""
        return self.tokenizer.encode(text, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Next-token logits after every position of `tokens`, [T, vocab], from a fresh sequence."""
        sequence = self.backend.new_sequence()
        try:
            return self.backend.prefill(sequence, tokens, all_logits=True)
        finally:
            self.backend.release(sequence)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        enable_thinking: bool | None = None,
    ) -> RenderedPrompt:
        """The prompt text the chat template makes of a conversation (ending with the assistant's turn)."""
        return self.chat_format.render(messages, tools=tools, enable_thinking=enable_thinking)

    def chat(
        self,
        messages: Sequence[Message],
        options: GenerationOptions | None = None,
        *,
        tools: Sequence[Tool] | None = None,
        enable_thinking: bool | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream the assistant's next reply to a conversation."""
        prompt = self.render(messages, tools=tools, enable_thinking=enable_thinking)
        tokens = self.tokenizer.encode(prompt.text, parse_special=True)
        return self.generator.generate(tokens, options, starts_in_reasoning=prompt.thinking, tools=tools, cancel=cancel)

    def generate(
        self,
        prompt: str | Sequence[int],
        options: GenerationOptions | None = None,
        *,
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream a raw continuation of `prompt` (text with special tokens parsed, or token ids)."""
        tokens = self.tokenizer.encode(prompt, parse_special=True) if isinstance(prompt, str) else list(prompt)
        return self.generator.generate(tokens, options, cancel=cancel)


def open_model(
    path: str | Path | None = None,
    *,
    backend: BackendName = "auto",
    mirror_gpu: bool = False,
    sequences: int = 1,
    context: int | None = None,
    gpu_mem: int | None = None,
    use_graphs: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> Model:
    """Open a GGUF model (None: the demo model, built on first use) on a backend.

    backend: "cuda" (an NVIDIA GPU), "cpu" (the numpy reference) or "auto" (cuda when a GPU is usable).
    `mirror_gpu` makes the CPU reference round as the GPU engine does (int8 activations, fp16 KV cache).
    GPU options: `sequences` decoded together at most, `context` tokens per sequence at most (default:
    what fits), `gpu_mem` bytes usable per GPU (to emulate a smaller card), `use_graphs` (False: launch
    kernels one by one, for debugging). `progress(stage, done, total)` reports slow steps. The model comes
    back ready: a GPU backend has compiled and captured the steps a first chat turn runs.
    """
    if backend not in BACKENDS:
        raise CmpchatError(f"unknown backend '{backend}'; choose one of: {', '.join(BACKENDS)}")
    is_demo = path is None
    model_path = ensure_demo_model(progress) if is_demo else Path(path)
    model_file = ModelFile(model_path)
    config = ModelConfig.from_model_file(model_file)
    if backend == "auto":
        backend = "cuda" if cuda_gpu_present() else "cpu"
    engine: Backend
    if backend == "cuda":
        from cmpchat.backends.gpu.model import CudaBackend

        engine = CudaBackend(
            model_file,
            config,
            sequences=sequences,
            context=context,
            gpu_mem=gpu_mem,
            use_graphs=use_graphs,
            progress=progress,
        )
    else:
        if progress is not None:
            progress("loading the model", 0, 1)
        engine = ReferenceBackend(model_file, config, mirror_gpu=mirror_gpu)
        if progress is not None:
            progress("loading the model", 1, 1)
    engine.warm_up(progress)
    return Model(model_file, engine, is_demo=is_demo)
