"""The CUDA backend's per-step host <-> device traffic.

A decode step's integer inputs (tokens, positions, GDN slots, page table) are views of one device buffer that
copies from pinned memory fill: every step the first three, and only the page-table rows that changed; GPU
selection uploads one packed buffer (only the part its graph reads) and brings the ids back through pinned
memory. These tests check the views' layout, that staged rows land where the kernels read them, that selection
picks what the unpacked path (fresh device arrays, every input uploaded, as before the packing) picks, with the
same draws from each reply's generator, and that it reads the logits it is given wherever they lie (its graphs
are captured with one buffer's address). They run under the CUDA simulator; the `gpu` variants repeat them on a
GPU (`pytest -m gpu`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numba import cuda

from cmpchat.backends.base import Chosen, Selector
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.gpu.sampler import RING, WINDOW, GpuSampler
from cmpchat.backends.gpu.step import MAX_ROWS, StepInputs
from cmpchat.errors import CmpchatError
from cmpchat.kernels.sampling import (
    SamplingWorkspace,
    greedy_launches,
    pack_params,
    rng_state,
    sampling_launches,
    window_from_histories,
)
from cmpchat.model.gguf_file import ModelFile
from cmpchat.sampling import SamplingParams, sample_token

ON_DEVICE = [pytest.param("simulator", id="sim"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]
"""Each test runs once: under the simulator by default, on the GPU with `-m gpu`."""


def address(array) -> int:
    interface = getattr(array, "__cuda_array_interface__", None)
    return interface["data"][0] if interface is not None else array.ctypes.data  # the simulator's numpy arrays


def device_inputs(inputs: StepInputs) -> tuple[np.ndarray, ...]:
    return tuple(view.copy_to_host() for view in (inputs.tokens, inputs.positions, inputs.gdn_slots, inputs.page_table))


def idle_rows(rows: int) -> tuple[np.ndarray, ...]:
    return np.full(rows, -1, np.int32), np.full((rows, 4), -1, np.int32), np.full(rows, -1, np.int32)


@pytest.mark.parametrize("where", ON_DEVICE)
def test_step_inputs_are_aligned_views_of_one_buffer(where) -> None:
    inputs = StepInputs(MAX_ROWS, pages_per_row=5)
    base = address(inputs.device)
    layout = {"tokens": ((16,), 0), "positions": ((16, 4), 64), "gdn_slots": ((16,), 320), "page_table": ((16, 5), 384)}
    for name, (shape, offset) in layout.items():
        view = getattr(inputs, name)
        assert tuple(view.shape) == shape and view.dtype == np.int32 and view.is_c_contiguous(), name
        assert address(view) - base == offset, name
        assert address(view) % 16 == 0, name


class CopyCounter:
    """Counts the host-to-device copies `StepInputs` queues and the entries they carry."""

    def __init__(self, inputs: StepInputs) -> None:
        self.sizes: list[int] = []
        copy = inputs._copy

        def counted(turn: int, start: int, stop: int, stream: Any) -> None:
            self.sizes.append(stop - start)
            copy(turn, start, stop, stream)

        inputs._copy = counted  # type: ignore[method-assign]  # a spy on this one object


@pytest.mark.parametrize("where", ON_DEVICE)
def test_staged_rows_and_changed_page_table_rows_land_on_the_device(where) -> None:
    inputs = StepInputs(MAX_ROWS, pages_per_row=4)
    copies = CopyCounter(inputs)
    stream = cuda.stream()
    tokens, positions, slots = inputs.stage()
    tokens[:2] = [5, 7]
    positions[:2] = [(3, 3, 3, 3), (0, 10, 11, 12)]
    slots[:2] = [1, 0]
    inputs.upload(stream, [[4, 2], [3]])
    stream.synchronize()
    got = device_inputs(inputs)
    np.testing.assert_array_equal(got[0][:2], [5, 7])
    np.testing.assert_array_equal(got[1][:2], [(3, 3, 3, 3), (0, 10, 11, 12)])
    np.testing.assert_array_equal(got[2][:2], [1, 0])
    assert got[3][0, :2].tolist() == [4, 2] and got[3][1, 0] == 3
    for value, idle in zip(got[:3], idle_rows(MAX_ROWS - 2), strict=True):
        np.testing.assert_array_equal(value[2:], idle)
    assert copies.sizes[-1] == 2 * 4  # the header went up, then the two changed page-table rows
    # Three steps queued without waiting: the mirrors alternate, each starts idle; unchanged tables stay put.
    copies.sizes.clear()
    for step in range(3):
        staged = inputs.stage()
        for value, idle in zip(staged, idle_rows(MAX_ROWS), strict=True):
            np.testing.assert_array_equal(value, idle)
        staged[0][0], staged[1][0], staged[2][0] = 40 + step, (step, 1, 2, 3), 2
        inputs.upload(stream, [[4, 2, 9]] if step == 2 else [[4, 2]])
    stream.synchronize()
    got = device_inputs(inputs)
    assert (got[0][0], tuple(got[1][0]), got[2][0]) == (42, (2, 1, 2, 3), 2)
    assert got[3][0, :3].tolist() == [4, 2, 9]
    assert len(copies.sizes) == 4  # three headers, one table row: only the step that added a page sent it
    # Rows changed in turn through both mirrors: a span sent from one mirror carries the rows between too.
    inputs.stage()
    inputs.upload(stream, [[4, 2, 9], [6, 7]])  # row 1 through one mirror
    inputs.stage()
    inputs.upload(stream, [[5], [6, 7], [8]])  # rows 0 and 2 through the other: the span covers row 1
    stream.synchronize()
    table = device_inputs(inputs)[3]
    assert table[0, 0] == 5 and table[1, :2].tolist() == [6, 7] and table[2, 0] == 8


@pytest.mark.parametrize("where", ON_DEVICE)
def test_decode_stages_each_rows_inputs_and_pages(
    tiny_model_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = CudaBackend(ModelFile(tiny_model_path), context=256, sequences=3, page_tokens=128)
    runs: list[tuple[int, bool]] = []
    stage = backend.stages[0]
    # the inputs only: kernels have their own tests
    monkeypatch.setattr(stage, "run_decode", lambda bucket, prompt, group=0: runs.append((bucket, prompt)))
    first, second = backend.new_sequence(), backend.new_sequence()
    backend.decode([first, second], [72, 33])
    stage.stream.synchronize()
    tokens, positions, slots, pages = device_inputs(stage.buffers.inputs)
    np.testing.assert_array_equal(tokens[:2], [72, 33])
    np.testing.assert_array_equal(positions[:2], [(0, 0, 0, 0), (0, 0, 0, 0)])
    np.testing.assert_array_equal(slots[:2], [first.slot, second.slot])
    assert [pages[0, 0], pages[1, 0]] == [
        first.pages.pages[0],
        second.pages.pages[0],
    ] and first.pages.pages != second.pages.pages
    # A prompt's tokens are the rows of one step: one slot, consecutive cache indices, their own positions.
    backend.prefill(second, [5, 6], positions=np.array([[7, 8, 9], [10, 10, 11]]))
    stage.stream.synchronize()
    tokens, positions, slots, pages = device_inputs(stage.buffers.inputs)
    np.testing.assert_array_equal(tokens[:2], [5, 6])
    np.testing.assert_array_equal(positions[:2], [(1, 7, 8, 9), (2, 10, 10, 11)])
    np.testing.assert_array_equal(slots[:2], [second.slot] * 2)
    assert pages[0, 0] == pages[1, 0] == second.pages.pages[0]
    backend.decode([first], [9])
    stage.stream.synchronize()
    assert runs == [(2, False), (2, True), (1, False)]
    got = device_inputs(stage.buffers.inputs)
    assert (got[0][0], tuple(got[1][0]), got[2][0]) == (9, (1, 1, 1, 1), first.slot)
    for value, idle in zip(got[:3], idle_rows(MAX_ROWS - 1), strict=True):
        np.testing.assert_array_equal(value[1:], idle)
    assert (second.length, second.next_position) == (3, 12)
    with pytest.raises(CmpchatError, match="do not fit"):
        backend.prefill(first, [1] * backend.context_limit)
    assert first.length == 2  # refused before anything ran


def unpacked_select(logits: np.ndarray, params, histories, rngs) -> list[int]:
    """Selection as `GpuSampler.select` did it before its inputs were packed: fresh device arrays, every
    input uploaded, a key drawn from every generator."""
    batch, vocab = logits.shape
    width = max([WINDOW, *(p.penalty_window for p in params if p.has_penalties)])
    window, count = window_from_histories(histories, width)
    keys = rng_state([int(rng.integers(0, 2**63)) for rng in rngs])
    device = [cuda.to_device(a) for a in (logits, pack_params(params, width), keys, window, count)]
    logits_d, params_d, rng_d, window_d, count_d = device
    tokens = cuda.to_device(np.zeros(batch, np.int32))
    workspace = SamplingWorkspace.allocate(batch, vocab)
    if all(p.is_greedy for p in params):
        launches = greedy_launches(logits_d, params_d, window_d, count_d, tokens, workspace)
    else:
        launches = sampling_launches(logits_d, params_d, rng_d, window_d, count_d, tokens, workspace)
    for launch in launches:
        launch.run()
    return tokens.copy_to_host().tolist()


GREEDY = SamplingParams()
PENALISED = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, penalty_window=16)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1)
SAMPLED_PENALISED = SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.2, penalty_window=48, seed=2)
WIDE = SamplingParams(temperature=0.7, frequency_penalty=0.3, penalty_window=80)  # a wider device window
# Steps of one batch, so one cached selection sees every switch: penalties on and off (the window is then
# not uploaded), greedy and sampled graphs (the keys are not uploaded for greedy), settings changed, kept and back;
# then a penalty window wider than the device's, which rebuilds the selection.
STEPS = [
    [GREEDY, PENALISED],
    [SAMPLED, GREEDY],
    [GREEDY, GREEDY],
    [GREEDY, GREEDY],  # nothing to upload: the device keeps the parameters
    [SAMPLED_PENALISED, SAMPLED],
    [SAMPLED, GREEDY],
    [PENALISED, SAMPLED_PENALISED],
    [WIDE, GREEDY],
]


@pytest.mark.parametrize("where", ON_DEVICE)
def test_selection_matches_the_unpacked_path(where) -> None:
    batch, vocab = (2, 300) if where == "simulator" else (4, 248_320)
    data = np.random.default_rng(5)
    stream = cuda.stream()
    rngs = [np.random.default_rng(100 + row) for row in range(batch)]
    reference_rngs = [np.random.default_rng(100 + row) for row in range(batch)]
    histories = [data.integers(0, vocab, 90 + 7 * row).tolist() for row in range(batch)]
    logits = cuda.device_array((batch, vocab), np.float32)  # one buffer, as the backend's step logits
    token_rows = cuda.device_array(16, np.int32)
    sampler = GpuSampler(stream, use_graphs=True, logits_rows=logits, token_rows=token_rows)
    for step, settings in enumerate(STEPS):
        params = [settings[row % 2] for row in range(batch)]
        host = (data.standard_normal((batch, vocab)) * 3).astype(np.float32)
        host[:, histories[0][-3:]] += 4  # recent tokens near the top, so the penalties matter
        expected = unpacked_select(host, params, histories, reference_rngs)
        logits.copy_to_device(host)
        got = sampler.select(logits, params, histories, rngs).tokens()
        assert got == expected, f"step {step}"
        assert token_rows.copy_to_host()[:batch].tolist() == got  # where the next decode step reads them
        for row, p in enumerate(params):
            if p.is_greedy:
                assert got[row] == sample_token(host[row], p, histories[row], np.random.default_rng()), f"step {step}"
        for history, token in zip(histories, got, strict=True):
            history.append(token)
    # Every step took one draw from each reply's generator, as before.
    assert [int(r.integers(0, 2**63)) for r in rngs] == [int(r.integers(0, 2**63)) for r in reference_rngs]


@pytest.mark.parametrize("where", ON_DEVICE)
def test_each_selection_reads_the_logits_it_is_given(where) -> None:
    # A decode step's rows, a prompt chunk's last row and the long-prompt step's own buffer, in turn.
    vocab = 96
    stream = cuda.stream()
    step_rows = cuda.to_device(np.zeros((4, vocab), np.float32))  # a step's logits buffer
    sampler = GpuSampler(stream, use_graphs=True, logits_rows=step_rows, token_rows=cuda.device_array(16, np.int32))
    own_buffer = cuda.to_device(np.zeros((1, vocab), np.float32))
    rng = [np.random.default_rng(0)]
    greedy = [SamplingParams()]
    for source, row, winner in ((step_rows, 0, 5), (step_rows, 2, 17), (own_buffer, 0, 40), (step_rows, 0, 63)):
        host = np.zeros((source.shape[0], vocab), np.float32)
        host[row, winner] = 1.0
        source.copy_to_device(host)
        assert sampler.select(source[row : row + 1], greedy, [[]], rng).tokens() == [winner]


@pytest.mark.parametrize("where", ON_DEVICE)
def test_unread_choices_keep_their_ids_while_later_ones_are_made(where) -> None:
    vocab = 64
    stream = cuda.stream()
    logits = cuda.to_device(np.zeros((1, vocab), np.float32))
    sampler = GpuSampler(stream, use_graphs=True, logits_rows=logits, token_rows=cuda.device_array(16, np.int32))
    rng, greedy = [np.random.default_rng(0)], [SamplingParams()]
    choices = []
    for winner in range(RING + 3):  # more than the ring holds: the oldest get their ids as their place is reused
        logits.copy_to_device(np.eye(1, vocab, winner, dtype=np.float32))
        choices.append(sampler.select(logits, greedy, [[]], rng))
    assert [choice.tokens() for choice in choices] == [[winner] for winner in range(RING + 3)]


@pytest.mark.parametrize("where", ON_DEVICE)
def test_a_chosen_token_feeds_the_next_step_on_the_device(
    tiny_model_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = CudaBackend(ModelFile(tiny_model_path), context=256, page_tokens=128)
    stage = backend.stages[0]
    runs: list[tuple[int, bool]] = []
    # the inputs only: kernels have their own tests
    monkeypatch.setattr(stage, "run_decode", lambda bucket, prompt, group=0: runs.append((bucket, prompt)))
    sequence = backend.new_sequence()
    logits = backend.decode([sequence], [5])
    logits.device.copy_to_device(np.eye(1, backend.config.vocab_size, 77, dtype=np.float32))
    choice = backend.select(logits, [Selector(SamplingParams(), [5], np.random.default_rng(0))])
    backend.decode([sequence], [Chosen(choice, 0)])  # queued before the id is read back
    stage.stream.synchronize()
    tokens, positions, slots, _ = device_inputs(stage.buffers.inputs)
    assert (tokens[0], tuple(positions[0]), slots[0]) == (77, (1, 1, 1, 1), sequence.slot)
    assert choice.tokens() == [77]
    # After a host-fed step the token input holds that step's token, so the choice's id comes from the host.
    backend.decode([sequence], [9])
    backend.decode([sequence], [Chosen(choice, 0)])
    stage.stream.synchronize()
    assert device_inputs(stage.buffers.inputs)[0][0] == 77
    assert runs == [(1, False)] * 4 and sequence.length == 4
