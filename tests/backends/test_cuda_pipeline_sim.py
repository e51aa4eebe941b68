"""The CUDA backend as a pipeline of two stages on one GPU, under Numba's CUDA simulator, against one stage: the
same logits bit for bit (fp32 on the wire) through a prompt chunk, and the id the GPU chose from them written
into the first stage's token input (where the next decode step reads it). The simulator takes tens of
seconds a step, so the model is the tiny one cut to two layers (a Gated DeltaNet layer, then an attention
layer), one a stage. The GPU tests run longer comparisons at real shapes; the split is tested in
test_pipeline_plan.py."""

from __future__ import annotations

import numpy as np
import pytest

from cmpchat.backends.base import Chosen, Selector
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.errors import CmpchatError
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams

PAGE = 128  # the smallest page that holds whole attention tiles at the tiny model's head size 32


def load(path, **options) -> CudaBackend:
    return CudaBackend(ModelFile(path), sequences=1, saved_states=0, context=512, kv_tokens=4 * PAGE,
                       page_tokens=PAGE, **options)  # fmt: skip


def prompt_then_choose(backend: CudaBackend) -> tuple[np.ndarray, list[int]]:
    """A two-token prompt's logits, and the greedy choice the GPU made from them."""
    sequence = backend.new_sequence()
    logits = backend.prefill(sequence, [72, 33])
    host = backend.to_host(logits)
    choice = backend.select(logits, [Selector(SamplingParams(), [], np.random.default_rng(0))])
    chosen = choice.tokens()
    # The next decode step would read the id from the first stage's token input, where the selection on the
    # last stage wrote it (both on one GPU), before it reaches the host.
    fed = backend._chosen_here([Chosen(choice, 0)])
    assert fed and int(backend.stages[0].buffers.tokens.copy_to_host()[0]) == chosen[0]
    backend.release(sequence)
    return host, chosen


@pytest.mark.slow
def test_two_stages_on_one_gpu_give_one_stages_logits_bit_for_bit(two_layer_model):
    one = load(two_layer_model)
    two = load(two_layer_model, gpus=[0, 0])
    assert [stage.layers for stage in two.stages] == [range(0, 1), range(1, 2)]
    assert two.stages[0].weights.lm_head is None and two.stages[1].weights.embedding is None
    assert two.pool.total_tokens == one.pool.total_tokens
    (expected, expected_choice), (got, got_choice) = prompt_then_choose(one), prompt_then_choose(two)
    assert np.array_equal(expected.view(np.uint32), got.view(np.uint32)) and expected_choice == got_choice
    assert two.bridges[0].handoffs == 1 and two.bridges[0].bytes == 2 * 4 * two.config.hidden_size
    assert two.stage_summaries()[0].handoff_bytes == two.bridges[0].bytes
    assert "layers           1-1" in "\n".join(two.describe())


def test_a_split_that_does_not_name_every_stage_is_refused(two_layer_model):
    with pytest.raises(CmpchatError, match="--split needs 2 layer counts"):
        load(two_layer_model, gpus=[0, 0], split=[1, 2])
    with pytest.raises(CmpchatError, match="--gpus takes GPU indices"):
        load(two_layer_model, gpus=[])


def test_long_prompts_are_pipelined_stage_k_running_chunk_t_minus_k(tiny_model_path, monkeypatch):
    """The schedule alone (no kernels run): 4 chunks of PIPELINE_PROMPT_ROWS through 3 stages in 6 ticks; in each
    tick, stage by stage, a stage receives its chunk, runs it and sends it on, so a stage's next chunk is queued
    before the host waits for the chunk it sent."""
    from cmpchat.backends.gpu.bridge import OverlappedHandOff
    from cmpchat.backends.gpu.prompt_step import PIPELINE_PROMPT_ROWS, PromptBuffers
    from cmpchat.backends.gpu.stage import Stage

    log: list[tuple[str, int, int]] = []
    uploaded: dict[int, int] = {}
    backend = CudaBackend(ModelFile(tiny_model_path), sequences=1, saved_states=0, context=2048, gpus=[0, 0, 0],
                          split=[2, 1, 1])  # fmt: skip
    rows = backend.prompt_rows
    prompts = [stage.prompt for stage in backend.stages if stage.prompt is not None]
    assert rows == PIPELINE_PROMPT_ROWS and [p.rows for p in prompts] == [rows] * 3
    assert [(p.arrival is None, p.departure is None) for p in prompts] == [(True, False), (False, False), (False, True)]
    stage_of = {id(stage.prompt): stage.index for stage in backend.stages}
    hop_of = {id(hop): index for index, hop in enumerate(backend.prompt_hops)}

    def upload(self, tokens, positions, pages, stream, images=()):
        uploaded[stage_of[id(self)]] = int(positions[0, 0]) // rows

    monkeypatch.setattr(PromptBuffers, "upload", upload)
    monkeypatch.setattr(Stage, "run_prompt", lambda self, slot: log.append(("run", self.index, uploaded[self.index])))
    monkeypatch.setattr(OverlappedHandOff, "send", lambda self: log.append(("send", hop_of[id(self)], -1)))
    monkeypatch.setattr(OverlappedHandOff, "receive", lambda self: log.append(("receive", hop_of[id(self)], -1)))
    sequence = backend.new_sequence()
    backend.prefill(sequence, [i % 200 for i in range(4 * rows)])
    expected = []
    for tick in range(6):
        for k in range(3):
            if not 0 <= tick - k < 4:
                continue
            if k > 0:
                expected.append(("receive", k - 1, -1))
            expected.append(("run", k, tick - k))
            if k < 2:
                expected.append(("send", k, -1))
    assert log == expected
    assert sequence.length == 4 * rows and sequence.next_position == 4 * rows


def test_a_pipelined_prompt_hands_each_chunk_on_byte_for_byte(tiny_model_path, monkeypatch):
    """The hand-offs' data path under the simulator, the steps replaced by one that writes a chunk's number and
    stage into the hidden states (first stage) or checks what arrived (later stages) and adds its own mark."""
    from cmpchat.backends.gpu.stage import Stage

    backend = CudaBackend(ModelFile(tiny_model_path), sequences=1, saved_states=0, context=2048, gpus=[0, 0, 0],
                          split=[2, 1, 1])  # fmt: skip
    ran: dict[int, int] = {0: 0, 1: 0, 2: 0}
    arrived: list[tuple[int, int, float]] = []

    def run_prompt(self, slot):
        hidden = self.prompt.hidden
        chunk = ran[self.index]
        if self.index > 0:
            got = hidden.copy_to_host()
            arrived.append((self.index, chunk, float(got[0, 0])))
            assert np.all(got == got[0, 0])
        hidden.copy_to_device(np.full(hidden.shape, 100 * chunk + self.index, np.float32))
        ran[self.index] += 1

    monkeypatch.setattr(Stage, "run_prompt", run_prompt)
    sequence = backend.new_sequence()
    backend.prefill(sequence, [i % 200 for i in range(3 * backend.prompt_rows)])
    assert sorted(arrived) == [(k, c, 100 * c + k - 1) for k in (1, 2) for c in range(3)]
    assert [hop.bridge.handoffs for hop in backend.prompt_hops] == [3, 3]
    hidden_bytes = 4 * backend.prompt_rows * backend.config.hidden_size
    assert [s.handoff_bytes for s in backend.stage_summaries()] == [3 * hidden_bytes, 3 * hidden_bytes, 0]


def test_a_stage_that_fails_to_load_names_its_gpu_and_layers(two_layer_model, monkeypatch):
    from numba.cuda.cudadrv.driver import CudaAPIError

    from cmpchat.backends.gpu import stage as stage_module

    upload = stage_module.upload_stage_weights

    def second_stage_out_of_memory(model_file, config, layers, **options):
        if layers.start == 1:
            raise CudaAPIError(2, "Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY")
        return upload(model_file, config, layers, **options)

    monkeypatch.setattr(stage_module, "upload_stage_weights", second_stage_out_of_memory)
    with pytest.raises(CmpchatError) as refused:
        load(two_layer_model, gpus=[0, 0])
    message = str(refused.value)
    assert message.startswith("GPU 0 (Numba CUDA simulator), stage 1 (layers 1-1): loading failed:")
    assert "CUDA_ERROR_OUT_OF_MEMORY" in message and "--gpus" in message and "\n" not in message


def test_each_stage_reports_its_own_upload(two_layer_model):
    reports: list[tuple[str, int, int]] = []
    backend = load(
        two_layer_model, gpus=[0, 0], progress=lambda label, done, total: reports.append((label, done, total))
    )
    summaries = backend.stage_summaries()
    assert [(s.index, s.gpu_index, s.layers, s.handoffs) for s in summaries] == [(0, 0, range(0, 1), 0),
                                                                                 (1, 0, range(1, 2), 0)]  # fmt: skip
    labels = list(dict.fromkeys(label for label, _, _ in reports))
    assert labels == [
        "loading weights onto GPU 0 (stage 0, layers 0-0)",
        "loading weights onto GPU 0 (stage 1, layers 1-1)",
    ]
    for label in labels:
        mine = [(done, total) for name, done, total in reports if name == label]
        assert mine[-1][0] == mine[-1][1] > 0 and all(a[0] <= b[0] for a, b in zip(mine, mine[1:]))
