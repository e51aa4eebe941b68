"""The public Python API: open a model on a backend, tokenize, get logits, generate and chat.

import cmpchat
model = cmpchat.open_model("Qwen3.5-9B-Q8_0.gguf")        # or open_model() for the demo model
for event in model.chat([cmpchat.Message("user", "Hello!")]):
    if isinstance(event, cmpchat.ContentDelta):
        print(event.text, end="", flush=True)

With a vision projector (`open_model(..., mmproj=FILE)`, or an mmproj file beside the model), messages may hold
images: `Message("user", [ImagePart("photo.jpg"), TextPart("What is this?")])`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from cmpchat.backends.base import Backend
from cmpchat.backends.gpu.device import cuda_gpu_present
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.chat.messages import Message, Tool
from cmpchat.chat.template import ChatFormat, RenderedPrompt
from cmpchat.demo import ensure_demo_model
from cmpchat.engine.engine import Engine
from cmpchat.engine.events import GenerationEvent
from cmpchat.engine.reply import GenerationOptions
from cmpchat.engine.request import Failed, GenerationRequest, Started
from cmpchat.errors import CmpchatError
from cmpchat.gpu_readings import GpuStage, activity
from cmpchat.kv_formats import F16
from cmpchat.kv_formats import kv_format as kv_format_named
from cmpchat.model.config import ModelConfig
from cmpchat.model.discovery import projector_beside
from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer
from cmpchat.vision.image_encoder import ImageEncoder
from cmpchat.vision.mmproj import open_projector
from cmpchat.vision.preprocess import PixelBudget
from cmpchat.vision.prompt_images import PromptImages

BackendName = Literal["auto", "cpu", "cuda"]
BACKENDS: tuple[str, ...] = ("auto", "cpu", "cuda")
IMAGE_PAD = "<|image_pad|>"
"""The token the chat template writes for each image; the prompt holds one per merged image token."""
ImageSource = str | Path | bytes
"""An image file's path, or its bytes."""
CUDA_IMAGE_MAX_PIXELS = 2048 * 2048
"""The cuda backend's default pixel budget: 4096 merged tokens an image. Qwen3.5's own (16.8 MP) would reserve
2.7 GiB of encoder scratch on the first GPU at the 9B's width, a sixth of a 16 GB CMP, and its patches' attention
(65,536 of them) would take tens of seconds there; at this budget the scratch is 0.7 GiB, and a 1280x720
photograph (880 tokens) is not resized."""


class Model:
    """A model file opened on a backend, with its tokenizer, chat format and engine."""

    def __init__(
        self,
        model_file: ModelFile,
        backend: Backend[Any],
        *,
        is_demo: bool = False,
        slots: int | None = None,
        max_waiting: int = 64,
        prefill_chunk: int = 512,
        image_encoder: ImageEncoder | None = None,
        projector_path: Path | None = None,
    ) -> None:
        self.model_file = model_file
        self.backend = backend
        self.is_demo = is_demo
        self.image_encoder = image_encoder
        """Turns images into prompt rows (None: the model was opened without a usable projector)."""
        self.projector_path = projector_path
        """The vision projector paired with the model, loaded or not (a backend without images leaves it)."""
        self.tokenizer = Tokenizer.from_metadata(model_file.metadata)
        self.chat_format = ChatFormat.from_metadata(model_file.metadata)
        self.engine: Engine[Any] = Engine(
            backend, self.tokenizer, slots=slots, max_waiting=max_waiting, prefill_chunk=prefill_chunk
        )
        """Generates every reply; driven by the caller's thread unless a front end starts its own (the server)."""

    def configure_engine(
        self, *, slots: int, max_waiting: int, prefill_chunk: int, cache_states: int | None = None
    ) -> Engine[Any]:
        """Replace the engine by one with these settings (before any request: a front end's own, e.g. the
        server's `--slots`); the backend must hold `slots` sequences and what is saved beside them."""
        if self.engine.running or self.engine.waiting:
            raise RuntimeError("the engine is busy")
        self.engine.prefix_cache.clear()
        self.engine = Engine(
            self.backend,
            self.tokenizer,
            slots=slots,
            max_waiting=max_waiting,
            prefill_chunk=prefill_chunk,
            cache_states=cache_states,
        )
        return self.engine

    @property
    def config(self) -> ModelConfig:
        return self.backend.config

    def gpu_stages(self) -> list[GpuStage] | None:
        """Each pipeline stage, its GPU and layers, and what the engine's requests are doing now (for GPU panels);
        None for a backend without stages (the CPU reference). Read without the engine's lock, from any thread:
        at worst a step old."""
        summaries = self.backend.stage_summaries()
        if summaries is None:
            return None
        work = activity(item.is_decoding for item in list(self.engine.scheduler.running))
        return [GpuStage(s.gpu_index, s.gpu_uuid or None, s.index, s.layers, work) for s in summaries]

    @property
    def supports_images(self) -> bool:
        """Whether prompts may hold images: a projector is loaded and the backend reads image rows."""
        return self.image_encoder is not None and self.backend.reads_images

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
            return self.backend.score(sequence, tokens)
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

    def chat_request(
        self,
        messages: Sequence[Message],
        options: GenerationOptions | None = None,
        *,
        tools: Sequence[Tool] | None = None,
        enable_thinking: bool | None = None,
    ) -> GenerationRequest:
        """What the engine runs for the assistant's next reply to a conversation."""
        prompt = self.render(messages, tools=tools, enable_thinking=enable_thinking)
        tokens = self.tokenizer.encode(prompt.text, parse_special=True)
        points = {
            *self._opening_end(messages, tokens, tools=tools, enable_thinking=enable_thinking),
            *self.next_turn_point(messages, tokens, tools=tools, enable_thinking=enable_thinking),
        }
        images = [part.data if part.data is not None else part.ref for m in messages for part in m.images]
        expanded, placed = self._place_images(tokens, images)
        return GenerationRequest(
            tuple(expanded),
            options or GenerationOptions(),
            starts_in_reasoning=prompt.thinking,
            tools=tuple(tools) if tools else None,
            cache_points=tuple(sorted(_after_expansion(tokens, placed, self._image_pad(), points))),
            images=placed,
        )

    def _place_images(
        self, tokens: Sequence[int], images: Sequence[ImageSource]
    ) -> tuple[list[int], PromptImages | None]:
        """The prompt with each image's one pad token expanded to its rows (encoded, or found encoded)."""
        if not images:
            return list(tokens), None
        encoder = self._image_encoder()
        image_pad = self._image_pad()
        if image_pad < 0:
            raise CmpchatError(f"{self.path.name}'s tokenizer has no {IMAGE_PAD} token; it is not a vision model")
        encoded = [encoder.encode(image) for image in images]
        return PromptImages.place(tokens, encoded, image_pad, encoder.projector.config.merge_size)

    def _image_pad(self) -> int:
        """The id of `<|image_pad|>`; -1 (no token) when the vocabulary has none."""
        found = self.tokenizer.token_to_id(IMAGE_PAD)
        return -1 if found is None else found

    def _image_encoder(self) -> ImageEncoder:
        if self.projector_path is None:
            raise CmpchatError(
                f"{self.path.name} was opened without a vision projector; give its mmproj file "
                "(--mmproj FILE, open_model(mmproj=...)) to send images"
            )
        if self.image_encoder is None or not self.backend.reads_images:
            raise CmpchatError(f"the {self.backend.name} backend does not read images")
        return self.image_encoder

    def _opening_end(
        self,
        messages: Sequence[Message],
        tokens: Sequence[int],
        *,
        tools: Sequence[Tool] | None,
        enable_thinking: bool | None,
    ) -> tuple[int, ...]:
        """Where the conversation's first message ends (a system prompt, say), if on a token boundary: other
        conversations that open the same way resume there."""
        if len(messages) < 2:
            return ()
        try:
            opening = self.chat_format.render(
                messages[:1], tools=tools, enable_thinking=enable_thinking, add_generation_prompt=False
            ).text
        except CmpchatError:
            return ()
        opening_tokens = self.tokenizer.encode(opening, parse_special=True)
        end = len(opening_tokens)
        return (end,) if 0 < end < len(tokens) and list(tokens[:end]) == opening_tokens else ()

    def next_turn_point(
        self,
        messages: Sequence[Message],
        tokens: Sequence[int],
        *,
        tools: Sequence[Tool] | None = None,
        enable_thinking: bool | None = None,
    ) -> tuple[int, ...]:
        """Where the next turn's prompt will stop matching `tokens` (this turn's prompt): templates render an
        earlier reply without the generation prompt's thinking markers, so the next turn diverges inside them.
        The state saved there lets the next turn read only its new tokens. Found by rendering the conversation
        with a stand-in reply and a next message."""
        follow = [*messages, Message("assistant", _STAND_IN), Message("user", _STAND_IN)]
        try:
            text = self.chat_format.render(follow, tools=tools, enable_thinking=enable_thinking).text
        except CmpchatError:
            return ()
        following = self.tokenizer.encode(text, parse_special=True)
        common = 0
        for a, b in zip(tokens, following):
            if a != b:
                break
            common += 1
        return (common,) if 0 < common < len(tokens) else ()

    def chat(
        self,
        messages: Sequence[Message],
        options: GenerationOptions | None = None,
        *,
        tools: Sequence[Tool] | None = None,
        enable_thinking: bool | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream the assistant's next reply to a conversation. A conversation that grows by a turn resumes
        from the state its previous turn left, so only the new tokens are read."""
        request = self.chat_request(messages, options, tools=tools, enable_thinking=enable_thinking)
        return self._events(request, cancel)

    def generate(
        self,
        prompt: str | Sequence[int],
        options: GenerationOptions | None = None,
        *,
        images: Sequence[ImageSource] = (),
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream a raw continuation of `prompt` (text with special tokens parsed, or token ids), whose
        `<|image_pad|>` tokens stand, one each, for `images` in order."""
        tokens = self.tokenizer.encode(prompt, parse_special=True) if isinstance(prompt, str) else list(prompt)
        expanded, placed = self._place_images(tokens, images)
        return self._events(GenerationRequest(tuple(expanded), options or GenerationOptions(), images=placed), cancel)

    def _events(self, request: GenerationRequest, cancel: threading.Event | None) -> Iterator[GenerationEvent]:
        for event in self.engine.generate(request, cancel):
            if isinstance(event, Failed):
                raise CmpchatError(event.message)
            if not isinstance(event, Started):
                yield event


_STAND_IN = "…"
"""The text of the stand-in messages `Model.next_turn_point` renders."""


def _after_expansion(tokens: Sequence[int], placed: PromptImages | None, image_pad: int, points: set[int]) -> set[int]:
    """`points` (indices into the template's `tokens`) moved to the prompt where each image's one pad became
    its run of tokens."""
    if placed is None:
        return points
    pads = [i for i, token in enumerate(tokens) if token == image_pad]
    runs = [len(image.rows) for image in placed.images]
    return {point + sum(run - 1 for pad, run in zip(pads, runs) if pad < point) for point in points}


def open_model(
    path: str | Path | None = None,
    *,
    backend: BackendName = "auto",
    mirror_gpu: bool = False,
    sequences: int = 1,
    cache_states: int = 4,
    context: int | None = None,
    kv_tokens: int | None = None,
    gpu_mem: int | Sequence[int | None] | None = None,
    gpus: Sequence[int] | None = None,
    split: Sequence[int] | None = None,
    use_graphs: bool = True,
    max_waiting: int = 64,
    prefill_chunk: int = 512,
    kv: str | None = None,
    mmproj: str | Path | None = None,
    image_budget: PixelBudget | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Model:
    """Open a GGUF model (None: the demo model, built on first use) on a backend.

    backend: "cuda" (an NVIDIA GPU), "cpu" (the numpy reference) or "auto" (cuda when a GPU is usable).
    `mirror_gpu` makes the CPU reference round as the GPU engine does (int8 activations, fp16 KV cache).
    `sequences` replies are decoded together at most; `cache_states` more sequence states are kept for reuse
    (a conversation's next turn resumes from one). `context` caps the tokens of one sequence, `kv_tokens` the
    KV-cache pool that all sequences share (default: what fits; the CPU keeps four contexts' worth). GPU
    options: `gpus`, the GPU of each pipeline stage (repeats allowed; default, the fewest GPUs that hold the
    model and `context`), `split`, layers per stage (default: the largest KV pool, then even weights),
    `gpu_mem`, bytes each stage may use (one value or one per stage; to emulate smaller cards), `use_graphs`
    (False: launch kernels one by one, for debugging). Engine options: `max_waiting` requests queued beyond the running ones,
    `prefill_chunk` prompt tokens read between decode steps. `kv`: the KV cache's format
    (`cmpchat.kv_formats`: "f16", "q8", "tq3", "q8k-tq3v"; "naive3" and "q4_0" are measurement baselines);
    default the backend's own (the GPU's fp16, the CPU's fp32 or, with `mirror_gpu`, fp16); the baselines run
    on the CPU reference only. `mmproj`: the vision projector (default: the mmproj file
    beside the model, if there is one); `image_budget` the pixel area images are resized within (default
    Qwen3.5's, 64 to 16384 tokens an image; on cuda at most `CUDA_IMAGE_MAX_PIXELS`). On cuda the encoder runs
    on the first stage's GPU, whose memory plan reserves its weights and its scratch at the budget's largest
    image. `progress(stage, done, total)` reports slow steps. The model comes back ready: a GPU backend has compiled and captured every step the engine runs.
    """
    if backend not in BACKENDS:
        raise CmpchatError(f"unknown backend '{backend}'; choose one of: {', '.join(BACKENDS)}")
    if sequences < 1 or cache_states < 0:
        raise CmpchatError("sequences must be at least 1 and cache_states at least 0")
    if backend == "auto":
        backend = "cuda" if cuda_gpu_present() else "cpu"
    if backend == "cpu" and (gpus is not None or split is not None):
        raise CmpchatError("--gpus and --split choose GPU pipeline stages; the cpu backend has none")
    is_demo = path is None
    model_path = ensure_demo_model(progress) if path is None else Path(path)
    kv_format = None if kv is None else kv_format_named(kv)
    model_file = ModelFile(model_path)
    config = ModelConfig.from_model_file(model_file)
    if kv_format is not None:
        kv_format.check(config.head_dim)
    projector_path = Path(mmproj) if mmproj is not None else None if is_demo else projector_beside(model_path)
    projector = None
    if projector_path is not None:  # before the model: a projector of another width is refused at once
        if progress is not None:
            progress("loading the vision projector", 0, 1)
        projector = open_projector(projector_path, text_width=config.hidden_size)
        if progress is not None:
            progress("loading the vision projector", 1, 1)
    if image_budget is None and backend == "cuda":
        image_budget = PixelBudget(max_pixels=CUDA_IMAGE_MAX_PIXELS)
    loaded: Backend[Any]
    encoder_gpu = None
    """Where images are encoded: the first stage's GPU on cuda, where they enter the pipeline; None: numpy."""
    if backend == "cuda":
        from cmpchat.backends.gpu.model import CudaBackend
        from cmpchat.vision.gpu_encoder import device_bytes

        encoder_bytes = 0
        if projector is not None:
            assert image_budget is not None
            patches = image_budget.max_pixels // projector.config.patch_size**2
            encoder_bytes = device_bytes(projector.config, patches)
        loaded = gpu_backend = CudaBackend(
            model_file,
            config,
            sequences=sequences,
            saved_states=cache_states,
            context=context,
            kv_tokens=kv_tokens,
            gpu_mem=gpu_mem,
            gpus=gpus,
            split=split,
            use_graphs=use_graphs,
            progress=progress,
            image_encoder_bytes=encoder_bytes,
            kv=(kv_format or F16).name,
        )
        encoder_gpu = gpu_backend.stages[0].gpu.index
    else:
        if progress is not None:
            progress("loading the model", 0, 1)
        loaded = ReferenceBackend(
            model_file,
            config,
            mirror_gpu=mirror_gpu,
            context=context,
            pool_tokens=kv_tokens,
            max_sequences=sequences + cache_states,
            kv=kv_format,
        )
        if progress is not None:
            progress("loading the model", 1, 1)
    image_encoder = None
    if projector is not None:
        if encoder_gpu is None:
            image_encoder = ImageEncoder(projector, image_budget)
        else:
            if progress is not None:
                progress("loading the vision projector onto the GPU", 0, 1)
            image_encoder = ImageEncoder.on_gpu(projector, image_budget, gpu_index=encoder_gpu)
            if progress is not None:
                progress("loading the vision projector onto the GPU", 1, 1)
    loaded.warm_up(progress, max_rows=min(sequences, loaded.max_batch))
    return Model(model_file, loaded, is_demo=is_demo, slots=sequences, max_waiting=max_waiting,
                 prefill_chunk=prefill_chunk, image_encoder=image_encoder,
                 projector_path=projector_path)  # fmt: skip
