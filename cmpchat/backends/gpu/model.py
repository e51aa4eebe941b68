"""The CUDA backend: Qwen3.5 on NVIDIA GPUs as a list of stages, decode steps replayed from CUDA graphs.

A stage (`stage.py`) is one GPU running a contiguous range of layers (`pipeline_plan.py` chooses the ranges); a
GPU may hold several. The embedding runs on the first stage, the final norm, LM head and token selection on the
last; hidden states cross from stage to stage through pinned host memory (`bridge.py`), for decode steps as
`decode_pipeline.py` hands them on (a step of each of up to one decode group a stage in flight at once), for a
pipelined prompt's chunks through an overlapped hand-off per hop.

Sequences draw KV pages from one pool (`kv_pool`, shared by all of them; a fork shares its pages) and each holds
one recurrent-state slot. A decode step allocates nothing: its inputs (tokens, positions, state slots and page
tables) are uploaded into fixed buffers, so it is captured once per batch-size bucket (1, 2, 4, 8, 16 rows). A
prompt runs in steps of `prompt_rows` of its tokens (`prompt_step`: DP4A GEMMs, the chunked Gated DeltaNet,
FlashAttention-style prefill attention; captured once per state slot) and its tail through the decode step in
chunks of up to 16 tokens as the rows. Logits stay on the GPU unless asked for; tokens are chosen there
(`sampler`) and a decode step reads the ids the last selection wrote into its token input, before they reach
the host.

Images enter a prompt as hidden rows (`prefill_with_images`): the first stage's steps copy them into their
hidden states where the embedding would write, and mark those tokens so the embedding leaves them
(`elementwise.PLACED_ROW`); the rows' (t, h, w) positions reach the RoPE as every step's do. Later stages get
the image's hidden states as any others, through the hand-offs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from cmpchat.backends.base import (
    Backend,
    Chosen,
    ImageRows,
    Logits,
    Progress,
    Selection,
    Selector,
    StageSummary,
    TokenInput,
    checked_images,
    host_tokens,
)
from cmpchat.backends.gpu.bridge import HandOffSide, OverlappedHandOff
from cmpchat.backends.gpu.buffers import images_within, mark_placed, place_image_rows
from cmpchat.backends.gpu.decode_pipeline import DecodePipeline, InFlightStep
from cmpchat.backends.gpu.device import GpuInfo, gpu_count, gpu_info, stage_budgets
from cmpchat.backends.gpu.kv_layout import FP16, layout_named
from cmpchat.backends.gpu.memory_plan import (
    MAX_SEQUENCES,
    PAGE_TOKENS,
    StagePlan,
    check_kv_tokens,
    least_pool_tokens,
    plan_stage,
    scratch_bytes,
)
from cmpchat.backends.gpu.pipeline_plan import LayerCosts, split_layers
from cmpchat.backends.gpu.prompt_step import PromptBuffers
from cmpchat.backends.gpu.prompt_step import prompt_rows as default_prompt_rows
from cmpchat.backends.gpu.stage import Stage
from cmpchat.backends.gpu.stage_loading import StageLoad, load_stages
from cmpchat.backends.gpu.step import MAX_ROWS, StepBuffers
from cmpchat.backends.gpu.weights import check_gpu_types, stage_weight_bytes
from cmpchat.backends.kv_pool import PageCopy, PageList, PagePool, PoolExhausted
from cmpchat.errors import CmpchatError
from cmpchat.kernels.device_table import DeviceTuning, default_tuning
from cmpchat.kernels.gemv import TOKEN_BUCKETS, token_bucket
from cmpchat.kv_formats import FORMATS
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams, mask_words


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
    """Logits of a step's rows, still on the last stage's GPU ([rows, vocab] view of a step buffer), of decode
    group `group`'s step `step` while that is in flight."""

    device: Any
    rows: int
    group: int = 0
    step: InFlightStep | None = None


def pipeline_decode_groups(stages: int) -> int:
    """Decode groups a pipeline of `stages` keeps in flight: one a stage, so each can run a group's step."""
    return stages


class CudaBackend(Backend[CudaSequence]):
    name = "cuda"
    max_batch = MAX_ROWS
    reads_images = True

    def __init__(
        self,
        model_file: ModelFile,
        config: ModelConfig | None = None,
        *,
        sequences: int = 1,
        saved_states: int = 4,
        context: int | None = None,
        kv_tokens: int | None = None,
        gpu_mem: int | Sequence[int | None] | None = None,
        gpus: Sequence[int] | None = None,
        split: Sequence[int] | None = None,
        use_graphs: bool = True,
        kv: str = FP16.name,
        page_tokens: int | None = None,
        prompt_rows: int | None = None,
        progress: Progress | None = None,
        tuning: DeviceTuning | None = None,
        image_encoder_bytes: int = 0,
    ) -> None:
        """`gpus`: the GPU of each pipeline stage, repeats allowed (`[0, 0, 0]`: three stages on GPU 0); default,
        the fewest GPUs, in index order, that hold the model and the asked context. `split`: layers per stage
        (default: the split with the largest KV pool, then the most even weights). `gpu_mem`: bytes each stage
        may use, one value or one per stage. `prompt_rows`: tokens per long-prompt step (default
        `prompt_step.prompt_rows`: fewer in a pipeline; tests give one stage a pipeline's to compare them).
        `tuning`: the launch choices every stage runs (`kernels/device_table.py`); default, each GPU's own row
        (`default_tuning`: the one CMPCHAT_TUNING names, if set). `image_encoder_bytes`: what the first stage's
        GPU leaves for an image encoder beside the model (`gpu_encoder.device_bytes`). `kv`: the KV cache's
        format (`kv_layout.LAYOUTS`)."""
        self.config = config = config or ModelConfig.from_model_file(model_file)
        check_gpu_types(model_file, config)  # before any device call: a k-quant file is refused in one line
        layout = layout_named(kv)
        self.kv_format = kv
        self.use_graphs = use_graphs
        self.max_sequences = min(sequences + saved_states, MAX_SEQUENCES)
        options: dict[str, Any] = dict(
            sequences=self.max_sequences, context=context, kv_tokens=kv_tokens, gpu_mem=gpu_mem, kv=kv,
            page_tokens=page_tokens, split=split, prompt_rows=prompt_rows, image_encoder_bytes=image_encoder_bytes,
        )  # fmt: skip
        infos, self.plans = choose_stages(model_file, config, gpus, tuning, context, options)
        tunings = [tuning or default_tuning(info) for info in infos]
        self.gpu, self.tuning = infos[0], tunings[0]
        last_index = len(self.plans) - 1
        self.decode_groups = pipeline_decode_groups(len(self.plans))
        self.spread_decode_groups = len({info.index for info in infos}) == len(infos) > 1
        """Stages on separate GPUs run different groups' steps at once; on one GPU they would contend, so the
        engine fills one group before it starts the next."""
        self.prompt_rows = prompt_rows or default_prompt_rows(len(self.plans))
        """Tokens per long-prompt step (fewer in a pipeline: `prompt_step.PIPELINE_PROMPT_ROWS`)."""

        loads = []
        for i, (info, row, p) in enumerate(zip(infos, tunings, self.plans, strict=True)):
            label = "loading weights onto the GPU"  # with several stages, a bar per stage
            if len(self.plans) > 1:
                label = (
                    f"loading weights onto GPU {info.index} (stage {i}, layers {p.layers.start}-{p.layers.stop - 1})"
                )
            load = partial(Stage.load, i, info, row, p, model_file, config, layout, first=i == 0, last=i == last_index,
                           prompt_rows=self.prompt_rows, decode_groups=self.decode_groups,
                           use_graphs=use_graphs)  # fmt: skip
            loads.append(StageLoad(info.index, label, p.weights, load))  # the plan's weights: what the stage uploads
        self.stages = load_stages(loads, progress)
        if {stage.gpu.index for stage in self.stages} == {0}:
            # Numba makes GPU 0's context current in any thread that touches CUDA, so a backend on GPU 0 alone
            # never switches: a switch costs a lock and two driver calls, several times a decode step.
            for stage in self.stages:
                stage.switches_device = False
        self.pool = PagePool(self.plans[0].pool_pages, self.plans[0].page_tokens)
        self.context_limit = min(p.context_limit for p in self.plans)
        hops = list(zip(self.stages, self.stages[1:], strict=False))
        self._pipeline = DecodePipeline(self.stages, self.decode_groups, config.hidden_size, use_graphs)
        self.bridges = self._pipeline.bridges
        self.prompt_hops = [
            OverlappedHandOff(
                HandOffSide(
                    stage.on_device, stage.stream, stage.departure_stream, stage.prompt.hidden, stage.prompt.departure
                ),
                HandOffSide(
                    after.on_device, after.stream, after.arrival_stream, after.prompt.hidden, after.prompt.arrival
                ),
            )
            for stage, after in hops
            if stage.prompt is not None and after.prompt is not None
        ]
        """Each hop's hand-offs of a pipelined prompt's chunks (none where a stage has no long-prompt step)."""
        self._free_slots = list(range(self.max_sequences))[::-1]

    @staticmethod
    def memory_plans(
        model_file: ModelFile,
        config: ModelConfig,
        *,
        gpus: Sequence[GpuInfo] | None = None,
        tunings: Sequence[DeviceTuning] | None = None,
        split: Sequence[int] | None = None,
        sequences: int = 1,
        context: int | None = None,
        kv_tokens: int | None = None,
        gpu_mem: int | Sequence[int | None] | None = None,
        kv: str = FP16.name,
        page_tokens: int | None = None,
        prompt_rows: int | None = None,
        image_encoder_bytes: int = 0,
    ) -> list[StagePlan]:
        """What loading would allocate on each stage's GPU (`gpus`, default GPU 0 alone) for `sequences` sequence
        states (running and saved): its layers' weights and states, its step buffers and its share of a KV pool
        that every stage holds for its attention layers. Raises CmpchatError, with the numbers, when the pool
        cannot hold even a short context. `tunings`: the launch choices each stage would run (default, each
        GPU's: `default_tuning`). `image_encoder_bytes`: reserved on the first stage's GPU for the image encoder
        (its weights and its scratch at the largest image), where images enter. `kv`: the KV cache's format."""
        check_gpu_types(model_file, config)
        layout = layout_named(kv)
        infos = list(gpus) if gpus else [gpu_info(0)]
        rows = list(tunings) if tunings else [default_tuning(info) for info in infos]
        page_tokens = _page_tokens(config, page_tokens or PAGE_TOKENS, rows)
        model_context = min(context or config.context_length, config.context_length)
        pages_per_row = -(-model_context // page_tokens)
        last = len(infos) - 1
        rows_per_step = prompt_rows or default_prompt_rows(len(infos))
        decode_scratch = pipeline_decode_groups(len(infos)) * scratch_bytes(config)
        prompt_scratch = [
            PromptBuffers.reserved_bytes(config, row, info.multiprocessors, rows_per_step, pages_per_row,
                                         receives=i > 0, sends=i < last)
            + StepBuffers.page_table_bytes(pages_per_row)
            for i, (info, row) in enumerate(zip(infos, rows, strict=True))
        ]  # fmt: skip
        budgets = stage_budgets(infos, gpu_mem)
        largest = max(t.n_bytes for t in model_file.tensors.values())
        every = range(config.num_layers)

        def stage_plan(stage: int, layers: range, pool_tokens: int | None) -> StagePlan:
            return plan_stage(
                config,
                weights=stage_weight_bytes(
                    model_file, config, layers, first=stage == 0, last=layers.stop == every.stop
                ),
                largest_tensor=largest,
                budget=budgets[stage],
                kv_bytes_per_token=layout.bytes_per_token(config, [i for i in layers if i in config.attention_layers]),
                recurrent_bytes_per_sequence=config.recurrent_state_bytes(layers),
                layers=layers,
                kv_layout=layout.name,
                sequences=sequences,
                context=context,
                kv_tokens=pool_tokens,
                page_tokens=page_tokens,
                prompt_scratch=prompt_scratch[stage],
                decode_scratch=decode_scratch,
                image_encoder=image_encoder_bytes if stage == 0 else 0,
            )

        if len(infos) == 1:
            if split is not None and list(split) != [config.num_layers]:
                raise CmpchatError(f"--split names {len(split)} stages but there is one (--gpus names the stages)")
            return [stage_plan(0, every, kv_tokens)]
        least = least_pool_tokens(model_context)
        check_kv_tokens(kv_tokens, least)
        costs = LayerCosts(
            weights=[stage_weight_bytes(model_file, config, range(i, i + 1), first=False, last=False) for i in every],
            kv_per_token=[layout.bytes_per_token(config, [i] if i in config.attention_layers else []) for i in every],
            state_per_sequence=[config.recurrent_state_bytes([i]) for i in every],
            first_extra=stage_weight_bytes(model_file, config, range(0), first=True, last=False),
            last_extra=stage_weight_bytes(model_file, config, range(0), first=False, last=True),
        )
        full_contexts = sequences * pages_per_row * page_tokens
        most = full_contexts if kv_tokens is None else min(kv_tokens, full_contexts)
        found = split_layers(
            costs, budgets, [decode_scratch + s + (image_encoder_bytes if i == 0 else 0)
                             for i, s in enumerate(prompt_scratch)], sequences=sequences,
            page_tokens=page_tokens, most_tokens=most, least_tokens=least, counts=split, describe=lambda: config.name,
            labels=[f"GPU {info.index}" for info in infos],
        )  # fmt: skip
        return [stage_plan(i, layers, found.pool_tokens) for i, layers in enumerate(found.ranges)]

    @property
    def plan(self) -> StagePlan:
        return self.plans[0]

    def close(self) -> None:
        """Let go of every device buffer now (benchmarks load the next model, or llama.cpp, right after);
        the backend cannot run steps afterwards."""
        self.stages = []
        del self._pipeline

    def stage_summaries(self) -> list[StageSummary]:
        sent = [(bridge.handoffs, bridge.bytes) for bridge in self.bridges] + [(0, 0)]
        for index, hop in enumerate(self.prompt_hops):
            handoffs, nbytes = sent[index]
            sent[index] = (handoffs + hop.bridge.handoffs, nbytes + hop.bridge.bytes)
        return [
            StageSummary(stage.index, stage.gpu.index, stage.gpu.uuid, stage.layers, *sent[stage.index])
            for stage in self.stages
        ]

    def describe(self) -> list[str]:
        lines = []
        for stage in self.stages:
            gpu = f"GPU {stage.gpu.index} ({stage.gpu.name})"
            lines += [f"{gpu}, stage {stage.index}, tuning {stage.tuning.name}: memory plan"]
            lines += [f"  {line}" for line in stage.plan.describe()]
        fmt = FORMATS[self.kv_format]
        lines.append(
            f"KV cache: {fmt.name} ({fmt.bits_per_value:g} bits a value, {fmt.bytes_per_token(self.config):,} bytes a "
            f"token): {self.context_limit} tokens of context at most"
        )
        return lines

    def warm_up(self, progress: Progress | None = None, *, max_rows: int = 1) -> None:
        """Compile, load and capture every step the engine runs, so no request waits for any of it (seconds
        where Numba's cache is cold): every decode group's decode step of every batch bucket up to `max_rows`
        rows, the prompt-tail step of every chunk size, the token selections (at one row also with a grammar's
        mask and with log-probabilities, whose kernels would otherwise compile during the first request that asks
        for them), and the long-prompt step of every state slot. The steps run on idle rows (no token, no cache
        index, no state slot: they write nothing a sequence reads), except the first long-prompt step, which runs
        once into a free slot (cleared when a sequence takes it)."""
        buckets = [b for b in TOKEN_BUCKETS if b <= token_bucket(max(1, min(max_rows, MAX_ROWS)))]
        groups = range(self.decode_groups)
        work: list[tuple[str, int, int]] = [("decode", b, g) for g in groups for b in buckets]
        work += [("tail", b, 0) for b in TOKEN_BUCKETS]
        if all(stage.prompt is not None for stage in self.stages):
            work += [("prompt", slot, 0) for slot in range(self.max_sequences)]
        self._pipeline.drain()
        for done, (kind, size, group) in enumerate(work):
            if progress is not None:
                progress("preparing the GPU kernels", done, len(work))
            if kind == "prompt":
                for stage in self.stages:
                    with stage.on_device():
                        stage.prepare_prompt_step(size, run=size == 0)
                continue
            self._upload_inputs([], [], [], [], tokens_on_device=False, group=group)
            for stage in self.stages:
                with stage.on_device():
                    stage.run_decode(size, kind == "tail", group)
            if kind == "decode":
                self._warm_selections(CudaLogits(self.stages[-1].group_buffers[group].logits[:size], size, group))
        self._pipeline.fed = [None] * self.decode_groups
        for stage in self.stages:
            with stage.on_device():
                stage.stream.synchronize()
        if progress is not None:
            progress("preparing the GPU kernels", len(work), len(work))

    def _warm_selections(self, logits: CudaLogits) -> None:
        rng = np.random.default_rng(0)
        every = np.full(mask_words(self.config.vocab_size), 0xFFFFFFFF, np.uint32)
        for params in (SamplingParams(), SamplingParams(temperature=1.0)):  # both selections' graphs
            self.select(logits, [Selector(params, [0], rng)] * logits.rows).tokens()
            if logits.rows == 1:
                for allowed, logprobs in ((every, None), (None, 1), (every, 1)):
                    self.select(logits, [Selector(params, [0], rng, allowed=allowed, logprobs=logprobs)]).tokens()

    # -- sequences --------------------------------------------------------------------------------

    @property
    def held_sequences(self) -> int:
        return self.max_sequences - len(self._free_slots)

    def new_sequence(self) -> CudaSequence:
        self._pipeline.drain()  # a step in flight may still write the state of a slot given back
        slot = self._take_slot()
        for stage in self.stages:
            with stage.on_device():
                stage.states.clear(slot, stage.stream)
        return CudaSequence(slot, PageList(self.pool))

    def fork(self, sequence: CudaSequence) -> CudaSequence:
        _check_live(sequence)
        self._pipeline.drain()  # the state copied is the one after every step queued for `sequence`
        slot = self._take_slot()
        for stage in self.stages:
            with stage.on_device():
                stage.states.copy(sequence.slot, slot, stage.stream)
        return CudaSequence(slot, sequence.pages.share(), sequence.next_position)

    def release(self, sequence: CudaSequence) -> None:
        if sequence.slot >= 0:
            self._pipeline.drain()  # its steps in flight still write its pages and state slot
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

    def prefill_with_images(
        self, sequence: CudaSequence, tokens: Sequence[int], *, positions: np.ndarray, images: Sequence[ImageRows]
    ) -> CudaLogits:
        # C-contiguous float32 rows, as a copy to the device takes them
        placed = [ImageRows(image.start, np.ascontiguousarray(image.rows, np.float32))
                  for image in checked_images(images, len(tokens), self.config.hidden_size)]  # fmt: skip
        return self._read(sequence, tokens, positions, every_row=False, images=placed)[-1]

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
        images: Sequence[ImageRows] = (),
    ) -> list[CudaLogits]:
        """Feed `tokens` into `sequence`, `images` in place of their tokens' embeddings: long-prompt steps while
        `prompt_rows` remain (unless `every_row` wants every row's logits), then 16-row chunks; the logits of the
        long steps' last row, then of each chunk (every row, or the last row). A chunk's logits lie in a buffer
        the next step overwrites: `take` gets them before it runs. With `positions`, the sequence's next text
        position is one past the largest read, as the reference's."""
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
        self._pipeline.drain()  # a prompt step uses the first group's buffers and every stage's streams in turn
        out: list[CudaLogits] = []
        done = 0
        long_steps = not every_row and all(stage.prompt is not None for stage in self.stages)
        if long_steps and len(tokens) >= self.prompt_rows:
            done = len(tokens) // self.prompt_rows * self.prompt_rows
            out.append(self._prompt_steps(sequence, ids[:done], None if positions is None else positions[:done],
                                          images_within(images, 0, done)))  # fmt: skip
        for start in range(done, len(tokens), MAX_ROWS):
            chunk = [int(t) for t in ids[start : start + MAX_ROWS]]
            row_positions = [None] * len(chunk) if positions is None else list(positions[start : start + len(chunk)])
            logits = self._step([sequence] * len(chunk), chunk, row_positions, prompt=True,
                                images=images_within(images, start, start + len(chunk)))  # fmt: skip
            out.append(logits if every_row else CudaLogits(logits.device[logits.rows - 1 :], 1))
            if take is not None:
                take(out[-1])
        if positions is not None:
            sequence.next_position = int(np.max(positions)) + 1
        return out

    def decode(self, sequences: Sequence[CudaSequence], tokens: Sequence[TokenInput], *, group: int = 0) -> CudaLogits:
        if not 0 <= group < self.decode_groups:
            raise ValueError(f"decode group {group} of {self.decode_groups}")
        if len(sequences) != len(tokens):
            raise ValueError("one token per sequence")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one decode step")
        needed = sum(s.pages.pages_to_grow(1) for s in sequences)
        if needed > self.pool.free_pages:
            raise PoolExhausted(f"this step needs {needed} KV pages but {self.pool.free_pages} are free")
        on_device = self._chosen_here(tokens, group)
        ids = None if on_device else host_tokens(tokens)
        return self._step(sequences, ids, [None] * len(sequences), group=group)

    def _chosen_here(self, tokens: Sequence[TokenInput], group: int = 0) -> bool:
        """Whether the inputs are the ids the group's latest selection wrote into its token input, row for row
        (so the step reads them there, without waiting for them)."""
        fed = self._pipeline.fed[group]
        rows = len(tokens)
        return (
            self._pipeline.ids_on_device
            and fed is not None
            and rows == fed.rows == token_bucket(rows)
            and all(isinstance(t, Chosen) and t.selection is fed and t.row == i for i, t in enumerate(tokens))
        )

    def select(self, logits: Logits, selectors: Sequence[Selector]) -> Selection:
        """Select on the GPU: only the B chosen ids cross PCIe (a CMP's Gen1 x1 link moves ~250 MB/s)."""
        if not isinstance(logits, CudaLogits):
            raise TypeError(f"{type(logits).__name__} is not this backend's logits")
        if len(selectors) != logits.rows:
            raise ValueError(f"{len(selectors)} selectors for {logits.rows} rows of logits")
        return self._pipeline.select(logits.group, logits.device, logits.step, selectors)

    def to_host(self, logits: Logits) -> np.ndarray:
        if not isinstance(logits, CudaLogits):
            raise TypeError(f"{type(logits).__name__} is not this backend's logits")
        self._pipeline.drain()
        last = self.stages[-1]
        with last.on_device():
            host = logits.device.copy_to_host(stream=last.stream)
            last.stream.synchronize()
        return host

    def _grow(self, sequence: CudaSequence, tokens: int) -> None:
        """Take the pages for `tokens` more tokens, queuing the copy-on-write of a shared partial page."""
        copies: list[PageCopy] = sequence.pages.grow(tokens)
        if copies:
            for stage in self.stages:
                with stage.on_device():
                    stage.kv.copy(copies, stage.stream)

    def _step(
        self,
        sequences: Sequence[CudaSequence],
        tokens: Sequence[int] | None,
        positions: Sequence[np.ndarray | None],
        *,
        prompt: bool = False,
        group: int = 0,
        images: Sequence[ImageRows] = (),
    ) -> CudaLogits:
        """One step of `group`: a token for each row's sequence, or (`prompt`) consecutive tokens of one sequence,
        `images` in place of some of their embeddings. None for `tokens`: the group's last selection's ids,
        already in the step's token input. A decode step is left in flight through the stages
        (`DecodePipeline`); a prompt's is queued on every stage at once."""
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
        self._pipeline.force_group(group)  # its buffers on every stage are about to be written
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
        if images:
            marked = np.asarray(row_tokens, np.int64)
            mark_placed(marked, images)
            row_tokens = [int(token) for token in marked]
            first = self.stages[0]
            with first.on_device():
                place_image_rows(first.group_buffers[group].hidden, images, first.stream)
        self._upload_inputs(
            row_tokens, row_positions, row_slots, row_pages, tokens_on_device=tokens is None, group=group
        )
        step = self._pipeline.start(group, rows, token_bucket(rows), prompt)
        if prompt:
            self._pipeline.force(step)
        return CudaLogits(self.stages[-1].group_buffers[group].logits[:rows], rows, group, step)

    def _upload_inputs(
        self,
        tokens: list[int],
        positions: list[tuple[int, int, int, int]],
        slots: list[int],
        pages: list[list[int]],
        *,
        tokens_on_device: bool,
        group: int = 0,
    ) -> None:
        """Stage and queue every stage's step inputs of `group`; rows past those given stay idle."""
        rows = len(tokens)
        for stage in self.stages:
            inputs = stage.group_buffers[group].inputs
            host_tokens_, host_positions, host_slots = inputs.stage()
            host_tokens_[:rows] = tokens
            if rows:
                host_positions[:rows] = positions
            host_slots[:rows] = slots
            with stage.on_device():
                inputs.upload(stage.stream, pages, tokens_on_device=tokens_on_device)
        if not tokens_on_device:
            self._pipeline.fed[group] = None

    def _prompt_steps(
        self, sequence: CudaSequence, ids: np.ndarray, positions: np.ndarray | None, images: Sequence[ImageRows]
    ) -> CudaLogits:
        """Long-prompt steps of `prompt_rows` tokens each (room in the context checked by the caller), `images`
        entering on the first stage in place of their tokens' embeddings, pipelined over the stages: at tick t
        stage k runs chunk t - k, so with S stages up to S chunks are in flight. Each stage's chunk is received,
        queued and sent on in stage order (`OverlappedHandOff`): the host waits for a chunk's bytes only after the
        stage that sent them has its next chunk queued, so no stage's stream runs dry while the host waits, and the
        copies run beside the steps. The logits are the last chunk's last row."""
        chunks = []
        size = self.prompt_rows
        offsets = np.arange(size)
        for start in range(0, len(ids), size):
            rows = np.empty((size, 4), np.int64)
            rows[:, 0] = sequence.length + offsets
            if positions is None:
                rows[:, 1:] = (sequence.next_position + offsets)[:, None]
            else:
                rows[:, 1:] = np.asarray(positions[start : start + size])
            self._grow(sequence, size)
            sequence.next_position = int(rows[-1, 1:].max()) + 1
            parts = images_within(images, start, start + size)
            chunks.append((ids[start : start + size], rows, list(sequence.pages.pages), parts))
        stages = self.stages
        for tick in range(len(chunks) + len(stages) - 1):
            for stage in stages:
                if not 0 <= tick - stage.index < len(chunks):
                    continue
                chunk, rows, pages, chunk_images = chunks[tick - stage.index]
                assert stage.prompt is not None
                with stage.on_device():
                    if stage.index > 0:
                        self.prompt_hops[stage.index - 1].receive()
                    stage.prompt.upload(chunk, rows, pages, stage.stream, chunk_images if stage.index == 0 else ())
                    stage.run_prompt(sequence.slot)
                    if stage.index + 1 < len(stages):
                        self.prompt_hops[stage.index].send()
        last = stages[-1].prompt
        assert last is not None
        return CudaLogits(last.logits, 1)

    # -- benchmarks ---------------------------------------------------------------------------------------

    def has_step(self, rows: int) -> bool:
        """Whether the first decode group has run a decode step of `rows` sequences (`step_launches` has it)."""
        return all((0, token_bucket(rows), False) in stage.decode_steps for stage in self.stages)

    def step_launches(self, rows: int, stage: int = 0) -> list[Any]:
        """The launches of the first decode group's step of `rows` sequences on stage `stage`, as last run."""
        return self.stages[stage].decode_steps[0, token_bucket(rows), False].launches

    def prompt_step_launches(self, sequence: CudaSequence, stage: int = 0) -> list[Any]:
        """The launches of `sequence`'s long-prompt step on stage `stage`, as last run."""
        return self.stages[stage].prompt_steps[sequence.slot].launches

    def synchronize(self) -> None:
        """Wait until every stage's GPU has run everything queued on it."""
        self._pipeline.drain()
        for stage in self.stages:
            with stage.on_device():
                stage.stream.synchronize()

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
        self._pipeline.drain()
        if not 0 <= length - sequence.length < self.context_limit - sequence.length:
            raise ValueError(f"length must be below the {self.context_limit}-token context")
        before = len(sequence.pages.pages)
        self._grow(sequence, length - sequence.length)
        for stage in self.stages:
            with stage.on_device():
                stage.kv.zero(sequence.pages.pages[before:], stage.stream)
        sequence.next_position = length


def _page_tokens(config: ModelConfig, wanted: int, tunings: Sequence[DeviceTuning]) -> int:
    """The KV page size nearest above `wanted` that holds whole tiles of both attention kernels in every stage's
    tuning (a page number means the same tokens on every stage)."""
    tile = math.lcm(*(tuning.page_tile(config.head_dim) for tuning in tunings))
    return -(-wanted // tile) * tile


def choose_stages(
    model_file: ModelFile,
    config: ModelConfig,
    gpus: Sequence[int] | None,
    tuning: DeviceTuning | None,
    context: int | None,
    options: dict[str, Any],
    *,
    lookup: Callable[[int], GpuInfo] = gpu_info,
    available: Callable[[], int] = gpu_count,
) -> tuple[list[GpuInfo], list[StagePlan]]:
    """Each stage's GPU and plan (`options`: `memory_plans`' own): the GPUs `gpus` names; else as many stages as
    a manual split names; else the fewest GPUs, in index order, that hold the model and (when asked) a
    `context`-token sequence, or, when no count holds that context, the most that hold the model. `lookup` and
    `available` describe the GPUs (default: this machine's; `cmpchat info` plans for cards it names)."""

    def plans_for(indices: Sequence[int]) -> tuple[list[GpuInfo], list[StagePlan]]:
        known = {index: lookup(index) for index in dict.fromkeys(indices)}
        infos = [known[index] for index in indices]
        tunings = [tuning or default_tuning(info) for info in infos]
        return infos, CudaBackend.memory_plans(model_file, config, gpus=infos, tunings=tunings, **options)

    if gpus is not None:
        if not gpus or any(index < 0 for index in gpus):
            raise CmpchatError("--gpus takes GPU indices such as 0,1,2 (one per stage, repeats allowed)")
        return plans_for(list(gpus))
    split = options.get("split")
    counts = [len(split)] if split is not None else list(range(1, max(available(), 1) + 1))
    fitting: tuple[list[GpuInfo], list[StagePlan]] | None = None
    refusal: CmpchatError | None = None
    wanted = None if context is None else min(context, config.context_length)
    for count in counts:
        try:
            fitting = plans_for(list(range(count)))
        except CmpchatError as error:
            refusal = error
            continue
        if wanted is None or min(p.context_limit for p in fitting[1]) >= wanted:
            return fitting
    if fitting is None:
        assert refusal is not None
        raise refusal
    return fitting


def _check_live(sequence: CudaSequence) -> None:
    if sequence.slot < 0:
        raise ValueError("the sequence was released")


__all__ = ["CudaBackend", "CudaLogits", "CudaSequence", "GpuInfo"]
