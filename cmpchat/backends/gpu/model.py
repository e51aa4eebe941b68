"""The CUDA backend: Qwen3.5 on NVIDIA GPUs as a list of stages, decode steps replayed from CUDA graphs.

A stage (`stage.py`) is one GPU running a contiguous range of layers; today the backend holds one stage with
every layer, on GPU 0. The embedding runs on the first stage, the final norm, LM head and token selection on
the last; the hand-off of hidden states between stages is explicit (`_hand_off`, nothing to do with one stage).

Sequences draw KV pages from one pool (`kv_pool`, shared by all of them; a fork shares its pages) and each holds
one recurrent-state slot. A decode step allocates nothing: its inputs (tokens, positions, state slots and page
tables) are uploaded into fixed buffers, so it is captured once per batch-size bucket (1, 2, 4, 8, 16 rows). A
prompt runs in steps of PROMPT_ROWS of its tokens (`prompt_step`: DP4A GEMMs, the chunked Gated DeltaNet,
FlashAttention-style prefill attention; captured once per state slot) and its tail through the decode step in
chunks of up to 16 tokens as the rows. Logits stay on the GPU unless asked for; tokens are chosen there
(`sampler`) and a decode step reads the ids the last selection wrote into its token input, before they reach
the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cmpchat.backends.base import Backend, Chosen, Logits, Progress, Selector, TokenInput, host_tokens
from cmpchat.backends.gpu.device import GpuInfo, gpu_info, usable_bytes
from cmpchat.backends.gpu.kv_layout import FP16, KvLayout
from cmpchat.backends.gpu.memory_plan import MAX_SEQUENCES, PAGE_TOKENS, StagePlan, plan_stage
from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS, PromptBuffers
from cmpchat.backends.gpu.sampler import GpuChoice, GpuSampler
from cmpchat.backends.gpu.stage import Stage
from cmpchat.backends.gpu.step import MAX_ROWS, StepBuffers
from cmpchat.backends.gpu.weights import check_gpu_types, stage_weight_bytes
from cmpchat.backends.kv_pool import PageCopy, PageList, PagePool, PoolExhausted
from cmpchat.errors import CmpchatError
from cmpchat.kernels.device_table import DeviceTuning, default_tuning
from cmpchat.kernels.gemv import TOKEN_BUCKETS, token_bucket
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams


@dataclass(eq=False)
class CudaSequence:
    slot: int
    """Its recurrent-state slot, the same on every stage."""
    pages: PageList
    next_position: int = 0

    @property
    def length(self) -> int:
        return self.pages.length


@dataclass(frozen=True)
class CudaLogits(Logits):
    """Logits of a step's rows, still on the last stage's GPU ([rows, vocab] view of a step buffer)."""

    device: Any
    rows: int


class CudaBackend(Backend[CudaSequence]):
    name = "cuda"
    max_batch = MAX_ROWS

    def __init__(
        self,
        model_file: ModelFile,
        config: ModelConfig | None = None,
        *,
        sequences: int = 1,
        saved_states: int = 4,
        context: int | None = None,
        kv_tokens: int | None = None,
        gpu_mem: int | None = None,
        use_graphs: bool = True,
        layout: KvLayout = FP16,
        page_tokens: int | None = None,
        progress: Progress | None = None,
        tuning: DeviceTuning | None = None,
    ) -> None:
        """`tuning`: the launch choices to run (`kernels/device_table.py`); default, the GPU's own row
        (`default_tuning`: the one CMPCHAT_TUNING names, if set)."""
        self.config = config = config or ModelConfig.from_model_file(model_file)
        check_gpu_types(model_file, config)  # before any device call: a k-quant file is refused in one line
        self.use_graphs = use_graphs
        self.max_sequences = min(sequences + saved_states, MAX_SEQUENCES)
        self.gpu = gpu_info(0)
        self.tuning = tuning or default_tuning(self.gpu)
        plan = self.memory_plan(
            model_file, config, sequences=self.max_sequences, context=context, kv_tokens=kv_tokens, gpu_mem=gpu_mem,
            layout=layout, page_tokens=page_tokens, gpu=self.gpu, tuning=self.tuning,
        )  # fmt: skip
        self.plans = [plan]
        last_index = len(self.plans) - 1
        total = sum(
            stage_weight_bytes(model_file, config, p.layers, first=i == 0, last=i == last_index)
            for i, p in enumerate(self.plans)
        )
        uploaded = 0

        def on_upload(nbytes: int) -> None:
            nonlocal uploaded
            uploaded += nbytes
            if progress is not None:
                progress("loading weights onto the GPU", min(uploaded, total), total)

        self.stages = [
            Stage.load(i, self.gpu, self.tuning, p, model_file, config, layout, first=i == 0,
                       last=i == len(self.plans) - 1, use_graphs=use_graphs, on_upload=on_upload)
            for i, p in enumerate(self.plans)
        ]  # fmt: skip
        if progress is not None:
            progress("loading weights onto the GPU", total, total)
        self.pool = PagePool(min(p.pool_pages for p in self.plans), plan.page_tokens)
        self.context_limit = min(p.context_limit for p in self.plans)
        last = self.stages[-1]
        self._sampler = GpuSampler(last.stream, use_graphs, last.buffers.logits, self.stages[0].buffers.tokens)
        self._free_slots = list(range(self.max_sequences))[::-1]
        self._fed: GpuChoice | None = None
        """The selection whose ids the first stage's token input holds (no step has uploaded tokens since)."""

    @staticmethod
    def memory_plan(
        model_file: ModelFile,
        config: ModelConfig,
        *,
        sequences: int = 1,
        context: int | None = None,
        kv_tokens: int | None = None,
        gpu_mem: int | None = None,
        layout: KvLayout = FP16,
        page_tokens: int | None = None,
        gpu: GpuInfo | None = None,
        tuning: DeviceTuning | None = None,
    ) -> StagePlan:
        """What loading would allocate on GPU 0 for `sequences` sequence states (running and saved): the weights,
        their states, the step buffers and a KV pool of what is left; raises CmpchatError when the pool cannot
        hold even a short context. `gpu`: GPU 0 as already read (else it is read here); `tuning`: the launch
        choices loading would run (default, the GPU's: `default_tuning`)."""
        check_gpu_types(model_file, config)
        info = gpu or gpu_info(0)
        tuning = tuning or default_tuning(info)
        layers = range(config.num_layers)
        page_tokens = _page_tokens(config, page_tokens or PAGE_TOKENS, tuning)
        pages_per_row = -(-min(context or config.context_length, config.context_length) // page_tokens)
        step_scratch = PromptBuffers.reserved_bytes(config, tuning, info.multiprocessors, PROMPT_ROWS, pages_per_row)
        step_scratch += StepBuffers.page_table_bytes(pages_per_row)
        return plan_stage(
            config,
            weights=stage_weight_bytes(model_file, config, layers, first=True, last=True),
            largest_tensor=max(t.n_bytes for t in model_file.tensors.values()),
            budget=usable_bytes(info, gpu_mem),
            kv_bytes_per_token=layout.bytes_per_token(config, config.attention_layers),
            recurrent_bytes_per_sequence=config.recurrent_state_bytes(),
            layers=layers,
            kv_layout=layout.name,
            sequences=sequences,
            context=context,
            kv_tokens=kv_tokens,
            page_tokens=page_tokens,
            prompt_scratch=step_scratch,
        )

    @property
    def plan(self) -> StagePlan:
        return self.plans[0]

    def close(self) -> None:
        """Let go of every device buffer now (benchmarks load the next model, or llama.cpp, right after);
        the backend cannot run steps afterwards."""
        self.stages = []
        del self._sampler

    def describe(self) -> list[str]:
        lines = []
        for stage in self.stages:
            gpu = f"GPU {stage.gpu.index} ({stage.gpu.name})"
            lines += [f"{gpu}, stage {stage.index}, tuning {stage.tuning.name}: memory plan"]
            lines += [f"  {line}" for line in stage.plan.describe()]
        return lines

    def warm_up(self, progress: Progress | None = None, *, max_rows: int = 1) -> None:
        """Compile, load and capture every step the engine runs, so no request waits for any of it (seconds
        where Numba's cache is cold): the decode step of every batch bucket up to `max_rows` rows, the prompt-tail
        step of every chunk size, the token selections, and the long-prompt step of every state slot. The
        steps run on idle rows (no token, no cache index, no state slot: they write nothing a sequence reads),
        except the first long-prompt step, which runs once into a free slot (cleared when a sequence takes it)."""
        buckets = [b for b in TOKEN_BUCKETS if b <= token_bucket(max(1, min(max_rows, MAX_ROWS)))]
        work: list[tuple[str, int]] = [("decode", b) for b in buckets] + [("tail", b) for b in TOKEN_BUCKETS]
        if all(stage.prompt is not None for stage in self.stages):
            work += [("prompt", slot) for slot in range(self.max_sequences)]
        for done, (kind, size) in enumerate(work):
            if progress is not None:
                progress("preparing the GPU kernels", done, len(work))
            if kind == "prompt":
                for stage in self.stages:
                    stage.prepare_prompt_step(size, run=size == 0)
                continue
            self._upload_inputs([], [], [], [], tokens_on_device=False)
            for stage in self.stages:
                stage.run_decode(size, kind == "tail")
            if kind == "decode":
                logits = CudaLogits(self.stages[-1].buffers.logits[:size], size)
                rng = np.random.default_rng(0)
                for params in (SamplingParams(), SamplingParams(temperature=1.0)):  # both selections' graphs
                    self.select(logits, [Selector(params, [0], rng)] * size).tokens()
        self._fed = None
        for stage in self.stages:
            stage.stream.synchronize()
        if progress is not None:
            progress("preparing the GPU kernels", len(work), len(work))

    # -- sequences --------------------------------------------------------------------------------

    @property
    def held_sequences(self) -> int:
        return self.max_sequences - len(self._free_slots)

    def new_sequence(self) -> CudaSequence:
        slot = self._take_slot()
        for stage in self.stages:
            stage.states.clear(slot, stage.stream)
        return CudaSequence(slot, PageList(self.pool))

    def fork(self, sequence: CudaSequence) -> CudaSequence:
        _check_live(sequence)
        slot = self._take_slot()
        for stage in self.stages:
            stage.states.copy(sequence.slot, slot, stage.stream)
        return CudaSequence(slot, sequence.pages.share(), sequence.next_position)

    def release(self, sequence: CudaSequence) -> None:
        if sequence.slot >= 0:
            sequence.pages.release()
            self._free_slots.append(sequence.slot)
            sequence.slot = -1

    def length(self, sequence: CudaSequence) -> int:
        return sequence.length

    def pages_to_grow(self, sequence: CudaSequence, tokens: int) -> int:
        return sequence.pages.pages_to_grow(tokens)

    def _take_slot(self) -> int:
        if not self._free_slots:
            raise CmpchatError(
                f"all {self.max_sequences} sequence states are in use; finish a conversation or load with more"
            )
        return self._free_slots.pop()

    # -- steps ------------------------------------------------------------------------------------

    def prefill(
        self, sequence: CudaSequence, tokens: Sequence[int], *, positions: np.ndarray | None = None
    ) -> CudaLogits:
        return self._read(sequence, tokens, positions, every_row=False)[-1]

    def score(self, sequence: CudaSequence, tokens: Sequence[int]) -> np.ndarray:
        rows: list[np.ndarray] = []
        self._read(sequence, tokens, None, every_row=True, take=lambda logits: rows.append(self.to_host(logits)))
        return np.concatenate(rows)

    def _read(
        self,
        sequence: CudaSequence,
        tokens: Sequence[int],
        positions: np.ndarray | None,
        *,
        every_row: bool,
        take: Callable[[CudaLogits], None] | None = None,
    ) -> list[CudaLogits]:
        """Feed `tokens` into `sequence`: long-prompt steps while PROMPT_ROWS remain (unless `every_row` wants
        every row's logits), then 16-row chunks; the logits of each step (every row, or the last row). Each
        step's logits lie in a buffer the next step overwrites: `take` gets them before it runs."""
        _check_live(sequence)
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        if positions is not None and len(positions) != len(tokens):
            raise ValueError(f"{len(positions)} positions for {len(tokens)} tokens")
        if sequence.length + len(tokens) > self.context_limit:
            raise CmpchatError(
                f"{sequence.length + len(tokens)} tokens do not fit the {self.context_limit}-token context of one "
                "sequence; start a new conversation or shorten the prompt"
            )
        ids = np.asarray(tokens, np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        if sequence.pages.pages_to_grow(len(tokens)) > self.pool.free_pages:
            raise PoolExhausted(
                f"{len(tokens)} more tokens need {sequence.pages.pages_to_grow(len(tokens))} KV pages but "
                f"{self.pool.free_pages} are free"
            )
        out: list[CudaLogits] = []
        done = 0
        long_steps = not every_row and all(stage.prompt is not None for stage in self.stages)
        while long_steps and len(tokens) - done >= PROMPT_ROWS:
            chunk_positions = None if positions is None else np.asarray(positions[done : done + PROMPT_ROWS])
            out.append(self._prompt_step(sequence, ids[done : done + PROMPT_ROWS], chunk_positions))
            if take is not None:
                take(out[-1])
            done += PROMPT_ROWS
        for start in range(done, len(tokens), MAX_ROWS):
            chunk = [int(t) for t in ids[start : start + MAX_ROWS]]
            row_positions = [None] * len(chunk) if positions is None else list(positions[start : start + len(chunk)])
            logits = self._step([sequence] * len(chunk), chunk, row_positions, prompt=True)
            out.append(logits if every_row else CudaLogits(logits.device[logits.rows - 1 :], 1))
            if take is not None:
                take(out[-1])
        return out

    def decode(self, sequences: Sequence[CudaSequence], tokens: Sequence[TokenInput]) -> CudaLogits:
        if len(sequences) != len(tokens):
            raise ValueError("one token per sequence")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one decode step")
        needed = sum(s.pages.pages_to_grow(1) for s in sequences)
        if needed > self.pool.free_pages:
            raise PoolExhausted(f"this step needs {needed} KV pages but {self.pool.free_pages} are free")
        on_device = self._chosen_here(tokens)
        ids = None if on_device else host_tokens(tokens)
        return self._step(sequences, ids, [None] * len(sequences))

    def _chosen_here(self, tokens: Sequence[TokenInput]) -> bool:
        """Whether the inputs are the ids the latest selection wrote into the token input, row for row (so the
        step reads them there, without waiting for them)."""
        fed = self._fed
        rows = len(tokens)
        return (
            fed is not None
            and rows == fed.rows == token_bucket(rows)
            and all(isinstance(t, Chosen) and t.selection is fed and t.row == i for i, t in enumerate(tokens))
        )

    def select(self, logits: Logits, selectors: Sequence[Selector]) -> GpuChoice:
        """Select on the GPU: only the B chosen ids cross PCIe (a CMP's Gen1 x1 link moves ~250 MB/s)."""
        if not isinstance(logits, CudaLogits):
            raise TypeError(f"{type(logits).__name__} is not this backend's logits")
        if len(selectors) != logits.rows:
            raise ValueError(f"{len(selectors)} selectors for {logits.rows} rows of logits")
        self._fed = self._sampler.select(
            logits.device, [s.params for s in selectors], [s.history for s in selectors], [s.rng for s in selectors]
        )
        return self._fed

    def to_host(self, logits: Logits) -> np.ndarray:
        if not isinstance(logits, CudaLogits):
            raise TypeError(f"{type(logits).__name__} is not this backend's logits")
        stream = self.stages[-1].stream
        host = logits.device.copy_to_host(stream=stream)
        stream.synchronize()
        return host

    def _grow(self, sequence: CudaSequence, tokens: int) -> None:
        """Take the pages for `tokens` more tokens, queuing the copy-on-write of a shared partial page."""
        copies: list[PageCopy] = sequence.pages.grow(tokens)
        if copies:
            for stage in self.stages:
                stage.kv.copy(copies, stage.stream)

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
        for sequence in sequences:
            _check_live(sequence)
            if sequence.length + sequences.count(sequence) > self.context_limit:
                raise CmpchatError(
                    f"the conversation reached the {self.context_limit}-token context of one sequence; start a new one"
                )
        if tokens is not None and not all(0 <= token < self.config.vocab_size for token in tokens):
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        row_tokens, row_positions, row_slots, row_pages = [], [], [], []
        for row, (sequence, position) in enumerate(zip(sequences, positions, strict=True)):
            token = 0 if tokens is None else tokens[row]
            length = sequence.length
            self._grow(sequence, 1)
            t, h, w = (sequence.next_position,) * 3 if position is None else (int(p) for p in position)
            sequence.next_position = max(t, h, w) + 1
            row_tokens.append(token)
            row_positions.append((length, t, h, w))
            row_slots.append(sequence.slot)
            row_pages.append(sequence.pages.pages)
        self._upload_inputs(row_tokens, row_positions, row_slots, row_pages, tokens_on_device=tokens is None)
        bucket = token_bucket(rows)
        for stage in self.stages:
            stage.run_decode(bucket, prompt)
            self._hand_off(stage)
        return CudaLogits(self.stages[-1].buffers.logits[:rows], rows)

    def _upload_inputs(
        self,
        tokens: list[int],
        positions: list[tuple[int, int, int, int]],
        slots: list[int],
        pages: list[list[int]],
        *,
        tokens_on_device: bool,
    ) -> None:
        """Stage and queue every stage's step inputs; rows past those given stay idle."""
        rows = len(tokens)
        for stage in self.stages:
            host_tokens_, host_positions, host_slots = stage.buffers.inputs.stage()
            host_tokens_[:rows] = tokens
            if rows:
                host_positions[:rows] = positions
            host_slots[:rows] = slots
            stage.buffers.inputs.upload(stage.stream, pages, tokens_on_device=tokens_on_device)
        if not tokens_on_device:
            self._fed = None

    def _prompt_step(self, sequence: CudaSequence, ids: np.ndarray, positions: np.ndarray | None) -> CudaLogits:
        """PROMPT_ROWS tokens of one sequence in one step (room in its context checked by the caller)."""
        offsets = np.arange(len(ids))
        rows = np.empty((len(ids), 4), np.int64)
        rows[:, 0] = sequence.length + offsets
        rows[:, 1:] = (sequence.next_position + offsets)[:, None] if positions is None else positions
        self._grow(sequence, len(ids))
        for stage in self.stages:
            assert stage.prompt is not None
            stage.prompt.upload(ids, rows, sequence.pages.pages, stage.stream)
            stage.run_prompt(sequence.slot)
            self._hand_off(stage)
        sequence.next_position = int(rows[-1, 1:].max()) + 1
        last = self.stages[-1].prompt
        assert last is not None
        return CudaLogits(last.logits, 1)

    def _hand_off(self, stage: Stage) -> None:
        """Pass the hidden states of `stage`'s rows to the next stage (device -> pinned host -> device, never
        P2P); the last stage hands nothing on. With one stage there is no next one."""
        if stage.index + 1 < len(self.stages):
            raise NotImplementedError("pipelines of several stages come with the multi-GPU work")

    # -- benchmarks ---------------------------------------------------------------------------------------

    def step_launches(self, rows: int) -> list[Any]:
        """The launches of a decode step of `rows` sequences on the only stage, as last run."""
        return self.stages[0].decode_steps[token_bucket(rows), False].launches

    def prompt_step_launches(self, sequence: CudaSequence) -> list[Any]:
        """The launches of `sequence`'s long-prompt step on the only stage, as last run."""
        return self.stages[0].prompt_steps[sequence.slot].launches

    @property
    def stream(self) -> Any:
        """The only stage's stream (benchmarks time and profile on it)."""
        return self.stages[0].stream

    @property
    def early_launch(self) -> bool:
        """Whether the only stage's steps start early-launch kernels early (benchmarks profile them so)."""
        return self.stages[0].early_launch

    def skip_ahead(self, sequence: CudaSequence, length: int) -> None:
        """Benchmarks only: make `sequence` `length` tokens long without running those tokens. Its cached keys
        and values are zeros, so the next steps read (and cost) what a real context that long does."""
        _check_live(sequence)
        if not 0 <= length - sequence.length < self.context_limit - sequence.length:
            raise ValueError(f"length must be below the {self.context_limit}-token context")
        before = len(sequence.pages.pages)
        self._grow(sequence, length - sequence.length)
        for stage in self.stages:
            stage.kv.zero(sequence.pages.pages[before:], stage.stream)
        sequence.next_position = length


def _page_tokens(config: ModelConfig, wanted: int, tuning: DeviceTuning) -> int:
    """The KV page size nearest above `wanted` that holds whole tiles of both attention kernels."""
    tile = tuning.page_tile(config.head_dim)
    return -(-wanted // tile) * tile


def _check_live(sequence: CudaSequence) -> None:
    if sequence.slot < 0:
        raise ValueError("the sequence was released")


__all__ = ["CudaBackend", "CudaLogits", "CudaSequence", "GpuInfo"]
