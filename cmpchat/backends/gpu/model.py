"""The CUDA backend: Qwen3.5 on one GPU, decode steps replayed from CUDA graphs.

Weights stream from the mapped file to the GPU at load; every sequence owns a slot of preallocated state
(KV cache pages, GDN conv and delta states), so a decode step allocates nothing and is captured once per
batch-size bucket (1, 2, 4, 8, 16 rows) as a graph. A prompt runs in steps of PROMPT_ROWS of its tokens
(`prompt_step`: DP4A GEMMs, the Gated DeltaNet token loop, attention over each row's causal prefix of the
cache the step has just written; captured once per sequence slot), and its tail through the decode step in
chunks of up to 16 tokens as the rows (one weight read per chunk; the GDN layers take the rows in order).
Logits stay on the GPU unless asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from cmpchat.backends.base import Backend, Choice
from cmpchat.backends.gpu.device import gpu_info, usable_bytes
from cmpchat.backends.gpu.memory_plan import MemoryPlan, plan_memory, weight_bytes
from cmpchat.backends.gpu.prompt_step import (
    KEY_TILE,
    PROMPT_ROWS,
    PromptBuffers,
    prompt_launches,
    prompt_step_supported,
)
from cmpchat.backends.gpu.sampler import GpuChoice, GpuSampler
from cmpchat.backends.gpu.step import (
    MAX_ROWS,
    AttentionSplits,
    SequenceStates,
    StepBuffers,
    decode_launches,
    fill_zero,
)
from cmpchat.backends.gpu.weights import upload_weights
from cmpchat.cudart.graph import StepLaunches
from cmpchat.errors import CmpchatError
from cmpchat.kernels.attention import DecodeAttentionConfig
from cmpchat.kernels.gemv import TOKEN_BUCKETS, token_bucket
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams

Progress = Callable[[str, int, int], None]


@dataclass
class CudaSequence:
    slot: int
    length: int = 0
    next_position: int = 0


@dataclass(frozen=True)
class CudaLogits:
    """Logits of the last step's rows, still on the GPU ([rows, vocab] view of the step buffer)."""

    device: Any
    rows: int


class CudaBackend(Backend):
    name = "cuda"
    decode_is_queued = True

    def __init__(
        self,
        model_file: ModelFile,
        config: ModelConfig | None = None,
        *,
        sequences: int = 1,
        context: int | None = None,
        gpu_mem: int | None = None,
        use_graphs: bool = True,
        progress: Progress | None = None,
    ) -> None:
        self.config = config or ModelConfig.from_model_file(model_file)
        self.use_graphs = use_graphs
        info = gpu_info(0)
        total_weights = weight_bytes(model_file, self.config)
        self.plan: MemoryPlan = self.memory_plan(
            model_file, self.config, sequences=sequences, context=context, gpu_mem=gpu_mem
        )
        self.gpu = info
        uploaded = 0

        def on_upload(nbytes: int) -> None:
            nonlocal uploaded
            uploaded += nbytes
            if progress is not None:
                progress("loading weights onto the GPU", min(uploaded, total_weights), total_weights)

        self.weights = upload_weights(model_file, self.config, on_upload)
        tile = math.lcm(DecodeAttentionConfig(num_splits=1).tile_tokens(self.config.head_dim), KEY_TILE)
        page_tokens = max(tile, self.plan.context_per_sequence // tile * tile)
        self.states = SequenceStates.allocate(self.config, self.plan.sequences, page_tokens)
        self.buffers = StepBuffers.allocate(self.config)
        self.stream = cuda.stream()
        self._sm_count = info.multiprocessors
        self._free_slots = list(range(self.plan.sequences))[::-1]
        # (bucket, rows are one prompt's tokens) -> the step (its launches hold their attention scratch)
        self._steps: dict[tuple[int, bool], StepLaunches] = {}
        self._sampler = GpuSampler(self.stream, use_graphs, self.buffers.logits, self.buffers.tokens)
        self._fed: GpuChoice | None = None
        """The choice whose ids the step's token input holds (no step has uploaded tokens since)."""
        # Long prompts: one step of PROMPT_ROWS tokens, captured per slot (None: the model cannot take it).
        self.prompt_buffers: PromptBuffers | None = None
        if prompt_step_supported(self.config, self.weights) is None:
            self.prompt_buffers = PromptBuffers.allocate(self.config, self._sm_count, PROMPT_ROWS)
        self._prompt_steps: dict[int, StepLaunches] = {}
        if progress is not None:
            progress("loading weights onto the GPU", total_weights, total_weights)

    @staticmethod
    def memory_plan(
        model_file: ModelFile,
        config: ModelConfig,
        *,
        sequences: int = 1,
        context: int | None = None,
        gpu_mem: int | None = None,
    ) -> MemoryPlan:
        """What loading would allocate on GPU 0: the weights, `sequences` states and the longest context
        per sequence that fits (at most `context`); raises CmpchatError when not even a short one fits."""
        info = gpu_info(0)
        return plan_memory(
            config,
            weights=weight_bytes(model_file, config),
            largest_tensor=max(t.n_bytes for t in model_file.tensors.values()),
            budget=usable_bytes(info, gpu_mem),
            sequences=sequences,
            context=context,
            prompt_scratch=PromptBuffers.reserved_bytes(config, info.multiprocessors, PROMPT_ROWS),
        )

    def warm_up(self, progress: Progress | None = None) -> None:
        """Compile, load and capture what a first chat turn runs, so its first reply waits for none of it
        (seconds where Numba's cache is cold): the long-prompt step where the model has one, the prompt-tail
        step of every chunk size, the one-sequence decode step and the token selections. Runs on scratch
        sequences; a slot is cleared whenever a sequence takes it."""
        prompts = [PROMPT_ROWS] if self.prompt_buffers is not None else []
        prompts += TOKEN_BUCKETS  # one chunk each: the prompt-tail step of every size
        prompts = [rows for rows in prompts if rows < self.states.page_tokens]
        for done, rows in enumerate(prompts):
            if progress is not None:
                progress("preparing the GPU kernels", done, len(prompts))
            sequence = self.new_sequence()
            try:
                self.prefill(sequence, [0] * rows)
                if rows == 1:
                    logits = self.decode([sequence], [0])
                    # Either selection captures both (greedy and sampled).
                    self.sample(logits, [SamplingParams()], [[0]], [np.random.default_rng(0)])
            finally:
                self.release(sequence)
        if progress is not None:
            progress("preparing the GPU kernels", len(prompts), len(prompts))

    @property
    def context_per_sequence(self) -> int:
        return self.states.page_tokens

    def describe(self) -> list[str]:
        return [f"GPU {self.gpu.name}: memory plan", *(f"  {line}" for line in self.plan.describe())]

    # -- sequences ----------------------------------------------------------------------------------------

    def new_sequence(self) -> CudaSequence:
        if not self._free_slots:
            raise CmpchatError(
                f"all {self.plan.sequences} sequence slots are in use; finish a conversation or load with more"
            )
        sequence = CudaSequence(self._free_slots.pop())
        self.states.clear_slot(sequence.slot)
        return sequence

    def copy_sequence(self, sequence: CudaSequence) -> CudaSequence:
        copy = self.new_sequence()
        self.states.copy_slot(sequence.slot, copy.slot, sequence.length)
        copy.length, copy.next_position = sequence.length, sequence.next_position
        return copy

    def release(self, sequence: CudaSequence) -> None:
        if sequence.slot >= 0:
            self._free_slots.append(sequence.slot)
            sequence.slot = -1

    def sequence_length(self, sequence: CudaSequence) -> int:
        return sequence.length

    # -- steps --------------------------------------------------------------------------------------------

    def prefill(
        self,
        sequence: CudaSequence,
        tokens: Sequence[int],
        *,
        positions: np.ndarray | None = None,
        all_logits: bool = False,
    ) -> Any:
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        if positions is not None and len(positions) != len(tokens):
            raise ValueError(f"{len(positions)} positions for {len(tokens)} tokens")
        if sequence.length + len(tokens) > self.states.page_tokens:
            raise CmpchatError(
                f"{sequence.length + len(tokens)} tokens do not fit the {self.states.page_tokens}-token context "
                "this GPU holds; start a new conversation or shorten the prompt"
            )
        rows = []
        logits: CudaLogits | None = None
        done = 0
        if self.prompt_buffers is not None and not all_logits:
            while len(tokens) - done >= PROMPT_ROWS:
                chunk_positions = None if positions is None else np.asarray(positions[done : done + PROMPT_ROWS])
                logits = self._prompt_step(sequence, tokens[done : done + PROMPT_ROWS], chunk_positions)
                done += PROMPT_ROWS
        for start in range(done, len(tokens), MAX_ROWS):
            chunk = tokens[start : start + MAX_ROWS]
            chunk_positions = [None] * len(chunk) if positions is None else list(positions[start : start + len(chunk)])
            logits = self._step([sequence] * len(chunk), chunk, chunk_positions, prompt=True)
            if all_logits:
                rows.append(self.to_host(logits))
        assert logits is not None
        if all_logits:
            return np.concatenate(rows)
        return CudaLogits(logits.device[logits.rows - 1 :], 1)

    def decode(self, sequences: Sequence[CudaSequence], tokens: Sequence[int]) -> CudaLogits:
        if len(sequences) != len(tokens):
            raise ValueError("one token per sequence")
        return self._decode(sequences, tokens)

    def decode_chosen(self, sequences: Sequence[CudaSequence], choice: Choice) -> CudaLogits:
        """The step reads the chosen ids where the selection wrote them, in the step's token input, so it is
        queued without waiting for them (when a full batch bucket of rows was chosen there last)."""
        rows = len(sequences)
        if choice is not self._fed or rows != choice.rows or rows != token_bucket(rows):
            return self.decode(sequences, choice.ids())
        return self._decode(sequences, None)

    def _decode(self, sequences: Sequence[CudaSequence], tokens: Sequence[int] | None) -> CudaLogits:
        if len({s.slot for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one decode step")
        return self._step(sequences, tokens, [None] * len(sequences))

    def to_host(self, logits: Any) -> np.ndarray:
        if not isinstance(logits, CudaLogits):
            return np.asarray(logits)
        host = logits.device.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def sample(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        rngs: Sequence[np.random.Generator],
    ) -> list[int]:
        return self.choose(logits, params, histories, rngs).ids()

    def choose(
        self,
        logits: Any,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        rngs: Sequence[np.random.Generator],
    ) -> Choice:
        """Select on the GPU: only the B chosen ids cross PCIe (a CMP's Gen1 x1 link moves ~250 MB/s)."""
        if not isinstance(logits, CudaLogits):
            return super().choose(logits, params, histories, rngs)
        if len(params) != logits.rows:
            raise ValueError(f"{len(params)} sampling settings for {logits.rows} rows of logits")
        self._fed = self._sampler.select(logits.device, params, histories, rngs)
        return self._fed

    def _step(
        self,
        sequences: Sequence[CudaSequence],
        tokens: Sequence[int] | None,
        positions: Sequence[np.ndarray | None],
        *,
        prompt: bool = False,
    ) -> CudaLogits:
        """One step: a token for each row's sequence, or (`prompt`) consecutive tokens of one sequence. None for
        `tokens`: the last selection's ids, already in the step's token input."""
        rows = len(sequences)
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"a step takes 1 to {MAX_ROWS} rows, got {rows}")
        bucket = token_bucket(rows)
        row_tokens, row_positions, row_slots = [], [], []
        lengths = {id(s): s.length for s in sequences}
        next_positions = {id(s): s.next_position for s in sequences}
        for sequence, token, position in zip(
            sequences, [0] * rows if tokens is None else tokens, positions, strict=True
        ):
            if sequence.slot < 0:
                raise ValueError("the sequence was released")
            length = lengths[id(sequence)]
            if length >= self.states.page_tokens:
                raise CmpchatError(
                    f"the conversation reached the {self.states.page_tokens}-token context this GPU holds; "
                    "start a new one"
                )
            if not 0 <= token < self.config.vocab_size:
                raise ValueError(f"token id {token} out of range 0..{self.config.vocab_size - 1}")
            t, h, w = (next_positions[id(sequence)],) * 3 if position is None else (int(p) for p in position)
            row_tokens.append(token)
            row_positions.append((length, t, h, w))
            row_slots.append(sequence.slot)
            lengths[id(sequence)] = length + 1
            next_positions[id(sequence)] = max(t, h, w) + 1
        # One copy from pinned memory carries all four inputs; rows past `rows` stay idle.
        b = self.buffers
        host_tokens, host_positions, host_pages, host_slots = b.stage()
        host_tokens[:rows] = row_tokens
        host_positions[:rows] = row_positions
        host_pages[:rows, 0] = row_slots
        host_slots[:rows] = row_slots
        b.upload(self.stream, tokens_on_device=tokens is None)
        if tokens is not None:
            self._fed = None
        self._run(bucket, prompt)
        for sequence in sequences:
            sequence.length = lengths[id(sequence)]
            sequence.next_position = next_positions[id(sequence)]
        return CudaLogits(b.logits[:rows], rows)

    def _prompt_step(self, sequence: CudaSequence, tokens: Sequence[int], positions: np.ndarray | None) -> CudaLogits:
        """PROMPT_ROWS tokens of one sequence in one step (room in its context checked by the caller)."""
        assert self.prompt_buffers is not None
        if sequence.slot < 0:
            raise ValueError("the sequence was released")
        ids = np.asarray(tokens, np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        offsets = np.arange(len(ids))
        rows = np.empty((len(ids), 4), np.int64)
        rows[:, 0] = sequence.length + offsets
        rows[:, 1:] = (sequence.next_position + offsets)[:, None] if positions is None else positions
        self.prompt_buffers.upload(ids, rows, sequence.slot, self.stream)
        step = self._prompt_steps.get(sequence.slot)
        if step is None:
            launches = prompt_launches(
                self.config, self.weights, self.states, self.prompt_buffers, sequence.slot, self._sm_count
            )
            self._prompt_steps[sequence.slot] = StepLaunches.run_then_capture(launches, self.stream, self.use_graphs)
        else:
            step.run(self.stream)
        sequence.length += len(ids)
        sequence.next_position = int(rows[-1, 1:].max()) + 1
        return CudaLogits(self.prompt_buffers.logits, 1)

    def _run(self, bucket: int, prompt: bool) -> None:
        step = self._steps.get((bucket, prompt))
        if step is None:
            splits = AttentionSplits.allocate(self.config, bucket, self._sm_count)  # held by the launches
            launches = decode_launches(
                self.config, self.weights, self.states, self.buffers, splits, bucket, self._sm_count,
                tokens_per_sequence=bucket if prompt else 1,
            )  # fmt: skip
            self._steps[bucket, prompt] = StepLaunches.run_then_capture(launches, self.stream, self.use_graphs)
        else:
            step.run(self.stream)

    # -- benchmarks ---------------------------------------------------------------------------------------

    def step_launches(self, rows: int) -> list[Any]:
        """The launches of a decode step of `rows` sequences, as last run (run a step of that size first)."""
        return self._steps[token_bucket(rows), False].launches

    def prompt_step_launches(self, sequence: CudaSequence) -> list[Any]:
        """The launches of `sequence`'s long-prompt step, as last run (feed it a long prompt first)."""
        return self._prompt_steps[sequence.slot].launches

    def skip_ahead(self, sequence: CudaSequence, length: int) -> None:
        """Benchmarks only: make `sequence` `length` tokens long without running those tokens. Its cached
        keys and values are zeros, so the next steps read (and cost) what a real context that long does."""
        if not 0 <= length < self.states.page_tokens:
            raise ValueError(f"length must be below the {self.states.page_tokens}-token context")
        for caches in (self.states.k_cache, self.states.v_cache):
            for array in caches.values():
                if length:
                    fill_zero(array[sequence.slot, :length])
        sequence.length = sequence.next_position = length
