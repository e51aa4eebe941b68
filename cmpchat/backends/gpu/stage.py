"""A stage: one GPU running a contiguous range of the model's layers, with everything it needs for them.

Its weights (and the embedding if it is the first stage, the output norm and LM head if it is the last), the KV
pages of its attention layers, the recurrent states of its GDN layers for every sequence slot, its step
buffers, its stream, its captured steps and its memory plan. Nothing here asks CUDA for "the current device":
the stage's device is made current around everything it allocates or launches, and the stage is given its
tuning row (`kernels/device_table.py`: tilings, split counts, early launch), which every step it builds takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

from cmpchat.backends.gpu.device import GpuInfo
from cmpchat.backends.gpu.kv_layout import KvLayout, KvPages
from cmpchat.backends.gpu.memory_plan import StagePlan
from cmpchat.backends.gpu.prompt_step import PromptBuffers, prompt_launches, prompt_step_supported
from cmpchat.backends.gpu.states import RecurrentStates
from cmpchat.backends.gpu.step import AttentionSplits, StepBuffers, decode_launches
from cmpchat.backends.gpu.weights import StageWeights, upload_stage_weights
from cmpchat.cudart.driver_api import CudaDriverError
from cmpchat.cudart.graph import StepLaunches
from cmpchat.cudart.intrinsics import SIMULATOR
from cmpchat.errors import CmpchatError
from cmpchat.kernels.device_table import DeviceTuning
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile


@dataclass
class Stage:
    index: int
    gpu: GpuInfo
    tuning: DeviceTuning
    """The launch choices the stage's steps are built with: its GPU's row, or another a test or benchmark runs."""
    plan: StagePlan
    config: ModelConfig
    weights: StageWeights
    kv: KvPages
    states: RecurrentStates
    group_buffers: list[StepBuffers]
    """The decode step's buffers of each decode group: a pipeline keeps a step of every group in flight at once."""
    prompt: PromptBuffers | None
    """The long-prompt step's buffers (None: this stage's layers cannot take it; prompts run 16 rows a step)."""
    stream: Any
    arrival_stream: Any
    departure_stream: Any
    """A pipelined prompt's hand-offs copy into and out of the stage on these, beside its steps and apart from each
    other, so an arrival never queues behind a departure that waits for a step (`bridge.OverlappedHandOff`)."""
    use_graphs: bool
    switches_device: bool = True
    """Whether `on_device` makes the stage's GPU current (the backend turns it off when every stage is on GPU 0)."""
    decode_steps: dict[tuple[int, int, bool], StepLaunches] = field(default_factory=dict)
    """(decode group, rows bucket, rows are one prompt's tokens) -> the step (its launches hold their attention
    scratch)"""
    prompt_steps: dict[int, StepLaunches] = field(default_factory=dict)
    """sequence state slot -> its long-prompt step (the GDN kernels take the slot)"""

    @property
    def is_first(self) -> bool:
        return self.weights.embedding is not None

    @property
    def is_last(self) -> bool:
        return self.weights.lm_head is not None

    @property
    def buffers(self) -> StepBuffers:
        """The first decode group's step buffers (prompt tails and warm-up run there)."""
        return self.group_buffers[0]

    @property
    def layers(self) -> range:
        return self.plan.layers

    @property
    def early_launch(self) -> bool:
        """Whether the stage's captured steps start early-launch kernels early: its row asks and its GPU can."""
        return self.tuning.launches_early(self.gpu)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Make this stage's GPU the current one (no-op under the simulator, or where it need not switch)."""
        if SIMULATOR or not self.switches_device:
            yield
            return
        with cuda.gpus[self.gpu.index]:
            yield

    @classmethod
    def load(
        cls,
        index: int,
        gpu: GpuInfo,
        tuning: DeviceTuning,
        plan: StagePlan,
        model_file: ModelFile,
        config: ModelConfig,
        layout: KvLayout,
        *,
        first: bool,
        last: bool,
        prompt_rows: int,
        decode_groups: int,
        use_graphs: bool,
        on_upload: Callable[[int], None],
    ) -> Stage:
        """The stage's weights, caches, states and buffers on its GPU; its long-prompt step runs `prompt_rows`
        tokens, with staging buffers for the hand-offs from the stage before (unless `first`) and to the next
        (unless `last`); a decode step's buffers for each of `decode_groups`."""

        def make() -> Stage:
            layers = plan.layers
            weights = upload_stage_weights(model_file, config, layers, first=first, last=last, progress=on_upload)
            attention = [i for i in layers if i in config.attention_layers]
            recurrent = [i for i in layers if i in config.recurrent_layers]
            pages_per_row = -(-plan.context_limit // plan.page_tokens)
            prompt = None
            if prompt_step_supported(config, weights) is None:
                prompt = PromptBuffers.allocate(config, tuning, gpu.multiprocessors, prompt_rows, pages_per_row,
                                                receives=not first, sends=not last)  # fmt: skip
            return cls(
                index=index,
                gpu=gpu,
                tuning=tuning,
                plan=plan,
                config=config,
                weights=weights,
                kv=layout.allocate(config, attention, plan.pool_pages, plan.page_tokens),
                states=RecurrentStates.allocate(config, recurrent, plan.sequences),
                group_buffers=[StepBuffers.allocate(config, pages_per_row) for _ in range(decode_groups)],
                prompt=prompt,
                stream=cuda.stream(),
                arrival_stream=cuda.stream(),
                departure_stream=cuda.stream(),
                use_graphs=use_graphs,
            )

        try:
            if SIMULATOR:
                return make()
            with cuda.gpus[gpu.index]:
                return make()
        except (CudaAPIError, CudaDriverError) as error:  # out of memory, a lost device: say which GPU
            raise CmpchatError(
                f"GPU {gpu.index} ({gpu.name}), stage {index} (layers {plan.layers.start}-{plan.layers.stop - 1}): "
                f"loading failed: {' '.join(str(error).split())}; free the GPU's memory, lower --ctx or --gpu-mem, "
                "or split over more GPUs (--gpus)"
            ) from error

    # -- steps ------------------------------------------------------------------------------------

    def run_decode(self, bucket: int, prompt: bool, group: int = 0) -> None:
        """Replay `group`'s decode step of `bucket` rows (built, run eagerly and captured the first time)."""
        step = self.decode_steps.get((group, bucket, prompt))
        if step is None:
            sms = self.gpu.multiprocessors
            splits = AttentionSplits.allocate(self.config, bucket, sms, self.tuning)  # held by the launches
            buffers = self.group_buffers[group]
            launches = decode_launches(
                self.config, self.weights, self.kv, self.states, buffers, splits, bucket, sms, self.tuning,
                tokens_per_sequence=bucket if prompt else 1,
            )  # fmt: skip
            self.decode_steps[group, bucket, prompt] = StepLaunches.run_then_capture(
                launches, self.stream, self.use_graphs, early_launch=self.early_launch
            )
        else:
            step.run(self.stream)

    def prepare_prompt_step(self, slot: int, *, run: bool) -> None:
        """Build and capture the long-prompt step of `slot` if it is not there yet; `run` also runs it (once,
        eagerly, which compiles its kernels: the first one needs it, later slots can be captured alone)."""
        assert self.prompt is not None
        if slot in self.prompt_steps:
            return
        launches = prompt_launches(
            self.config, self.weights, self.kv, self.states, self.prompt, slot, self.gpu.multiprocessors, self.tuning
        )
        early = self.early_launch
        if run:
            self.prompt_steps[slot] = StepLaunches.run_then_capture(
                launches, self.stream, self.use_graphs, early_launch=early
            )
        else:
            self.prompt_steps[slot] = StepLaunches(launches, self.stream, self.use_graphs, early_launch=early)

    def run_prompt(self, slot: int) -> None:
        step = self.prompt_steps.get(slot)
        if step is None:
            self.prepare_prompt_step(slot, run=True)
        else:
            step.run(self.stream)
