"""The CUDA backend as a pipeline of 2 and 3 stages on one GPU against one stage, on real shapes: the same greedy
tokens and the same logits bit for bit (hidden states cross stages as fp32 through pinned host memory), through
a long prompt (long-prompt steps and a tail), 64 decode steps fed the ids the GPU chose, batched decode, and
batches in one decode group a stage, each group's steps in flight through the stages at once. The
one stage runs the pipeline's long-prompt steps (PIPELINE_PROMPT_ROWS tokens; its own default is PROMPT_ROWS,
whose attention splits its keys otherwise).

Several stages on one GPU run the code several GPUs run: their own streams, memory budgets and host bridges;
only the devices' indices coincide (so the chosen ids reach the first stage on the device, not through the host).
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from cmpchat.backends.base import Chosen, Selector
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.gpu.prompt_step import PIPELINE_PROMPT_ROWS, PROMPT_ROWS
from cmpchat.bench.model_files import bench_model_path
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile
from cmpchat.paths import cache_dir
from cmpchat.sampling import SamplingParams

pytestmark = pytest.mark.gpu

ORACLE = Path(__file__).parent.parent / "fixtures" / "oracle" / "real_heads.q8_0.gguf"
STEPS = 64
GREEDY = SamplingParams()


def model_path(name: str) -> Path:
    return ORACLE if name == "oracle" else bench_model_path(name, cache_dir() / "bench")


def load(path: Path, stages: int, **options) -> CudaBackend:
    return CudaBackend(ModelFile(path), sequences=4, saved_states=0, context=4096, gpus=[0] * stages, **options)


def greedy(rows: int) -> list[Selector]:
    return [Selector(GREEDY, [], np.random.default_rng(0)) for _ in range(rows)]


def prompt_and_decode(backend: CudaBackend, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    """Every step's logits and the greedy tokens: the prompt, then STEPS decode steps each fed the id the
    last one chose on the GPU."""
    sequence = backend.new_sequence()
    logits = backend.prefill(sequence, prompt)
    rows, tokens = [backend.to_host(logits)], []
    for _ in range(STEPS):
        choice = backend.select(logits, greedy(1))
        logits = backend.decode([sequence], [Chosen(choice, 0)])
        tokens += choice.tokens()
        rows.append(backend.to_host(logits))
    backend.release(sequence)
    return np.concatenate(rows), tokens


def batched(backend: CudaBackend, prompts: list[list[int]]) -> np.ndarray:
    """16 batched greedy decode steps of len(prompts) sequences after their prompts: every step's logits."""
    sequences = [backend.new_sequence() for _ in prompts]
    for sequence, prompt in zip(sequences, prompts, strict=True):
        backend.prefill(sequence, prompt)
    tokens = [prompt[-1] for prompt in prompts]
    steps = []
    for _ in range(16):
        logits = backend.decode(sequences, tokens)
        steps.append(backend.to_host(logits))
        tokens = backend.select(logits, greedy(len(prompts))).tokens()
    for sequence in sequences:
        backend.release(sequence)
    return np.stack(steps)


def in_groups(backend: CudaBackend, prompts: list[list[int]], groups: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """16 greedy decode steps of the sequences of `prompts` in `groups` decode groups (sequence i in group
    i % groups), as the engine runs them: each step queues every group's step, then reads the ids chosen the
    step before, then queues the choices (each group's step stays in flight through the stages meanwhile).
    Every sequence's tokens, and each group's last logits."""
    sequences = [backend.new_sequence() for _ in prompts]
    for sequence, prompt in zip(sequences, prompts, strict=True):
        backend.prefill(sequence, prompt)
    members = [list(range(g, len(prompts), groups)) for g in range(groups)]
    inputs: list[list] = [[prompts[i][-1] for i in rows] for rows in members]
    tokens: list[list[int]] = [[] for _ in prompts]
    choices = None
    for _ in range(16):
        logits = [backend.decode([sequences[i] for i in rows], inputs[g], group=g) for g, rows in enumerate(members)]
        if choices is not None:
            for rows, choice in zip(members, choices, strict=True):
                for i, token in zip(rows, choice.tokens(), strict=True):
                    tokens[i].append(token)
        choices = [backend.select(step, greedy(step.rows)) for step in logits]
        inputs = [[Chosen(choice, row) for row in range(choice.rows)] for choice in choices]
    assert choices is not None
    for rows, choice in zip(members, choices, strict=True):
        for i, token in zip(rows, choice.tokens(), strict=True):
            tokens[i].append(token)
    last = [backend.to_host(step) for step in logits]
    for sequence in sequences:
        backend.release(sequence)
    return tokens, last


def alone_in_groups(backend: CudaBackend, prompts: list[list[int]], groups: int):
    """What `in_groups` gives, from a backend of one decode group: each group's sequences as a batch of their own."""
    tokens: list[list[int]] = [[] for _ in prompts]
    last: list[np.ndarray] = []
    for g in range(groups):
        rows = list(range(g, len(prompts), groups))
        group_tokens, group_last = in_groups(backend, [prompts[i] for i in rows], 1)
        for i, got in zip(rows, group_tokens, strict=True):
            tokens[i] = got
        last += group_last
    return tokens, last


def free(backend: CudaBackend) -> None:
    from numba import cuda

    backend.close()
    gc.collect()
    cuda.current_context().deallocations.clear()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", ["oracle", "0.8B", pytest.param("9B", marks=pytest.mark.slow)])
def test_two_and_three_stages_equal_one_stage_bit_for_bit(name: str):
    path = model_path(name)
    rng = np.random.default_rng(1)
    vocab = ModelConfig.from_model_file(ModelFile(path)).vocab_size
    prompt = rng.integers(0, vocab, 2 * PROMPT_ROWS + 37).tolist()
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 300, 17, 64)]
    one = load(path, 1, prompt_rows=PIPELINE_PROMPT_ROWS)
    expected_logits, expected_tokens = prompt_and_decode(one, prompt)
    expected_batch = batched(one, prompts)
    expected_groups = {stages: alone_in_groups(one, prompts, stages) for stages in (2, 3)}
    free(one)
    for stages in (2, 3):
        pipeline = load(path, stages)
        assert len(pipeline.stages) == stages and pipeline.stages[0].prompt is not None
        assert pipeline.prompt_rows == PIPELINE_PROMPT_ROWS
        logits, tokens = prompt_and_decode(pipeline, prompt)
        # Only the long-prompt steps cross the prompt bridge; the tail takes the 16-row step and the decode bridge.
        hops = pipeline.bridges[0].handoffs, pipeline.prompt_hops[0].bridge.handoffs
        assert hops[1] == len(prompt) // PIPELINE_PROMPT_ROWS
        assert tokens == expected_tokens, f"{stages} stages: greedy tokens differ"
        assert same_bits(logits, expected_logits), f"{stages} stages: logits differ"
        assert same_bits(batched(pipeline, prompts), expected_batch), f"{stages} stages: batched logits differ"
        assert pipeline.decode_groups == stages
        group_tokens, last = in_groups(pipeline, prompts, stages)
        want_tokens, want_last = expected_groups[stages]
        assert group_tokens == want_tokens, f"{stages} stages: tokens of groups in flight differ"
        assert all(same_bits(a, b) for a, b in zip(last, want_last, strict=True)), f"{stages} stages: group logits"
        layers = [f"{s.layers.start}-{s.layers.stop - 1}" for s in pipeline.stages]
        print(f"{name}, {stages} stages (layers {' / '.join(layers)}): {hops[0]} decode and {hops[1]} prompt hand-offs")
        free(pipeline)


def test_stages_on_two_gpus_upload_at_once_and_equal_one_stage_bit_for_bit():
    """Two real GPUs (issue 28's machines): the stages upload on a thread each (`stage_loading`), the hidden
    states cross between the cards through host memory, and the tokens and logits are one stage's."""
    from cmpchat.backends.gpu.device import gpu_count

    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    path = model_path("0.8B")
    prompt = np.random.default_rng(2).integers(0, 1000, PIPELINE_PROMPT_ROWS + 21).tolist()
    one = load(path, 1, prompt_rows=PIPELINE_PROMPT_ROWS)
    expected = prompt_and_decode(one, prompt)
    free(one)
    labels: list[str] = []
    two = CudaBackend(ModelFile(path), sequences=4, saved_states=0, context=4096, gpus=[0, 1],
                      progress=lambda label, done, total: labels.append(label))  # fmt: skip
    assert any("2 GPUs at once" in label for label in labels)
    logits, tokens = prompt_and_decode(two, prompt)
    assert tokens == expected[1] and same_bits(logits, expected[0])
    free(two)


@pytest.mark.slow
def test_three_stages_of_16_gb_hold_27b():
    """The planner on the 27B benchmark file (29 GB, built on first use) as three 16 GB cards; nothing loads."""
    from cmpchat.backends.gpu.device import gpu_info

    path = bench_model_path("27B", cache_dir() / "bench")
    model_file = ModelFile(path)
    config = ModelConfig.from_model_file(model_file)
    gpu = gpu_info(0)
    plans = CudaBackend.memory_plans(
        model_file, config, gpus=[gpu] * 3, sequences=5, context=262_144, gpu_mem=16 * 2**30
    )  # fmt: skip
    assert [p.layers.start for p in plans] == [0, plans[0].layers.stop, plans[1].layers.stop]
    assert plans[-1].layers.stop == config.num_layers and all(p.total <= 16 * 2**30 for p in plans)
    assert plans[0].pool_tokens >= 100_000
    print("27B on 3 x 16 GiB:", [f"{p.layers.start}-{p.layers.stop - 1}" for p in plans], plans[0].pool_tokens)
