"""The CUDA backend on a real GPU against the reference backend in GPU-mirroring mode.

Tolerance: both sides quantise activations to int8 per 32 values and keep K/V in fp16; what differs is
fp32 summation order. Where no activation crosses an int8 rounding boundary the logits agree to ~1e-5 of
their range (the oracle model: median 1.2e-7, max 8.9e-6 over 153 positions). A crossing changes one int8
value by one step, and a random-weight network amplifies that: on the demo model (512 wide) the reference
itself moves by a median 0.8% per position when its input is scaled by 1 + 1e-6. So the demo model is held
to that measured sensitivity (twice it, measured in the same test), the oracle model to 1e-3; top-1 tokens
must agree wherever the reference's margin between its first and second choice exceeds 0.1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS
from cmpchat.backends.reference.model import ReferenceBackend
from cmpchat.cudart.raw_launch import early_launch_allowed
from cmpchat.demo import ensure_demo_model
from cmpchat.errors import CmpchatError
from cmpchat.kernels.device_table import SM_70
from cmpchat.kernels.gemv import TOKEN_BUCKETS
from cmpchat.model.gguf_file import ModelFile

pytestmark = pytest.mark.gpu

ORACLE = Path(__file__).parent.parent / "fixtures" / "oracle"
CLEAR_MARGIN = 0.1


def per_position_error(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return np.abs(got - expected).max(axis=1) / np.abs(expected).max(axis=1)


def sensitivity(reference: ReferenceBackend, tokens: list[int], expected: np.ndarray) -> np.ndarray:
    """How far the reference moves by itself when its embeddings are scaled by 1 + 1e-6."""
    embed = reference.embed
    reference.embed = lambda tokens: embed(tokens) * np.float32(1 + 1e-6)  # type: ignore[method-assign]
    try:
        moved = reference.score(reference.new_sequence(), tokens)
    finally:
        reference.embed = embed  # type: ignore[method-assign]
    return per_position_error(moved, expected)


def compare(model_file: ModelFile, tokens: list[int], *, calibrate: bool) -> None:
    gpu = CudaBackend(model_file, context=4096)
    reference = ReferenceBackend(model_file, mirror_gpu=True)
    expected = reference.score(reference.new_sequence(), tokens)
    got = gpu.score(gpu.new_sequence(), tokens)
    error = per_position_error(got, expected)
    median_bound, max_bound = 1e-3, 1e-3
    if calibrate:
        baseline = sensitivity(reference, tokens, expected)
        median_bound, max_bound = 2 * np.median(baseline) + 1e-4, 2 * baseline.max() + 1e-3
        print(f"reference sensitivity: median {np.median(baseline):.2e}, max {baseline.max():.2e}")
    print(
        f"{model_file.path.name}: |dlogit| / max |logit| per position: median {np.median(error):.2e}, "
        f"max {error.max():.2e} over {len(tokens)} positions"
    )
    assert np.median(error) <= median_bound
    assert error.max() <= max_bound
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > CLEAR_MARGIN
    assert np.array_equal(got[clear].argmax(axis=1), expected[clear].argmax(axis=1))


def test_oracle_model_with_real_head_sizes():
    with np.load(ORACLE / "real_heads.npz") as data:
        tokens = data["ids_long_a"].tolist()
    compare(ModelFile(ORACLE / "real_heads.q8_0.gguf"), tokens, calibrate=False)


def test_demo_model():
    tokens = list(np.random.default_rng(0).integers(0, 248_000, 64))
    compare(ModelFile(ensure_demo_model()), tokens, calibrate=True)


def test_prompt_chunks_give_what_one_token_per_step_gives():
    """A 40-token prompt runs as chunks of 16, 16 and 8 rows; feeding it one decode step per token is the
    spec. Oracle model (real head sizes): per-position logits within 1e-4 of their range, same argmax."""
    with np.load(ORACLE / "real_heads.npz") as data:
        tokens = data["ids_long_a"].tolist()[:40]
    gpu = CudaBackend(ModelFile(ORACLE / "real_heads.q8_0.gguf"), sequences=2, context=4096)
    chunked = gpu.score(gpu.new_sequence(), tokens)
    single = gpu.new_sequence()
    stepped = np.stack([gpu.to_host(gpu.decode([single], [token]))[0] for token in tokens])
    error = per_position_error(chunked, stepped)
    print(f"chunked vs stepped: median {np.median(error):.2e}, max {error.max():.2e}")
    assert error.max() <= 1e-4
    assert np.array_equal(chunked.argmax(axis=1), stepped.argmax(axis=1))


def test_long_prompt_steps_give_what_short_chunks_give():
    """600 tokens: two long-prompt steps (GEMMs, the GDN token loop) and an 88-token tail, against the same
    prompt in 16-token chunks (what `score` runs); then one decode step after each."""
    model_file = ModelFile(ORACLE / "real_heads.q8_0.gguf")
    gpu = CudaBackend(model_file, sequences=2, context=4096)
    assert gpu.stages[0].prompt is not None and PROMPT_ROWS == 256
    tokens = np.random.default_rng(3).integers(0, gpu.config.vocab_size, 600).tolist()
    long_steps, short_chunks = gpu.new_sequence(), gpu.new_sequence()
    got = gpu.to_host(gpu.prefill(long_steps, tokens))[0]
    expected = gpu.score(short_chunks, tokens)[-1]
    assert (
        (long_steps.length, long_steps.next_position)
        == (short_chunks.length, short_chunks.next_position)
        == (
            600,
            600,
        )
    )
    after = [gpu.to_host(gpu.decode([s], [tokens[0]]))[0] for s in (long_steps, short_chunks)]
    for a, b in ((got, expected), tuple(after)):
        error = np.abs(a - b).max() / np.abs(b).max()
        print(f"long steps vs short chunks: {error:.2e}")
        assert error <= 1e-3
        assert a.argmax() == b.argmax()


def greedy_tokens(backend: CudaBackend, prompt: list[int], steps: int) -> list[int]:
    sequence = backend.new_sequence()
    logits = backend.prefill(sequence, prompt)
    out = []
    for _ in range(steps):
        token = int(np.argmax(backend.to_host(logits)[0]))
        out.append(token)
        logits = backend.decode([sequence], [token])
    backend.release(sequence)
    return out


def test_graph_and_eager_decode_give_identical_tokens():
    model_file = ModelFile(ensure_demo_model())
    prompt = [9419, 11, 1814, 0, 5]
    graph = greedy_tokens(CudaBackend(model_file, context=4096, use_graphs=True), prompt, 40)
    eager = greedy_tokens(CudaBackend(model_file, context=4096, use_graphs=False), prompt, 40)
    assert graph == eager


def greedy_logits(backend: CudaBackend, prompt: list[int], steps: int) -> np.ndarray:
    sequence = backend.new_sequence()
    logits = [backend.to_host(backend.prefill(sequence, prompt))[0]]
    for _ in range(steps):
        logits.append(backend.to_host(backend.decode([sequence], [int(np.argmax(logits[-1]))]))[0])
    backend.release(sequence)
    return np.stack(logits)


def bound_early(backend: CudaBackend) -> list[bool]:
    """Whether each launch of the one-row decode step's captured graph was bound to start early."""
    graph = backend.stages[0].decode_steps[0, 1, False].graph
    assert graph is not None
    return [raw.early for raw in graph.launches]


def test_early_launches_give_the_bits_ordinary_launches_give(monkeypatch: pytest.MonkeyPatch):
    """Programmatic dependent launch (sm_90+) overlaps each decode kernel's start with the one before: a kernel
    touching its inputs before its grid wait would read stale values, and show here as different bits."""
    model_file = ModelFile(ensure_demo_model())
    prompt = [9419, 11, 1814, 0, 5]
    backend = CudaBackend(model_file, context=4096)
    if not (backend.early_launch and early_launch_allowed()):
        pytest.skip("this GPU's row has no programmatic dependent launch (sm_90+)")
    early = greedy_logits(backend, prompt, 24)
    assert sum(bound_early(backend)) > len(bound_early(backend)) // 2
    monkeypatch.setenv("CMPCHAT_EARLY_LAUNCH", "0")  # read when each launch is bound, before the graph's capture
    ordinary = CudaBackend(model_file, context=4096)
    assert np.array_equal(early.view(np.uint32), greedy_logits(ordinary, prompt, 24).view(np.uint32))
    assert not any(bound_early(ordinary))


def test_the_cmps_row_runs_on_this_gpu_with_the_same_bits():
    """A backend given another device's row (the CMP's sm_70) builds its steps with it on this GPU: no early
    launch, the sm_70 tilings. A short prompt runs no GEMM, the one tiling that differs; early launch and the
    split counts (the same in both rows at this SM count) do not change a bit, so the logits are the GPU row's."""
    model_file = ModelFile(ensure_demo_model())
    prompt = [9419, 11, 1814, 0, 5]
    cmp_row = CudaBackend(model_file, context=4096, tuning=SM_70)
    assert cmp_row.stages[0].tuning is SM_70 and not cmp_row.early_launch
    logits = greedy_logits(cmp_row, prompt, 24)
    assert not any(bound_early(cmp_row))
    own = CudaBackend(model_file, context=4096)
    assert np.array_equal(logits.view(np.uint32), greedy_logits(own, prompt, 24).view(np.uint32))


def test_warm_up_prepares_every_step_and_leaves_no_trace():
    model_file = ModelFile(ensure_demo_model())
    warmed = CudaBackend(model_file, sequences=4, saved_states=2, context=4096)
    stages = []
    warmed.warm_up(lambda stage, done, total: stages.append((done, total)), max_rows=4)
    steps = warmed.stages[0].decode_steps
    assert set(steps) == {(0, rows, True) for rows in TOKEN_BUCKETS} | {(0, rows, False) for rows in (1, 2, 4)}
    assert set(warmed.stages[0].prompt_steps) == set(range(warmed.max_sequences))
    assert stages[0][0] == 0 and stages[-1][0] == stages[-1][1]  # progress from start to end
    prompt = [(7 * i) % 5000 for i in range(PROMPT_ROWS + 21)]  # a long-prompt step, then a tail
    cold = CudaBackend(model_file, context=4096)
    assert greedy_tokens(warmed, prompt, 24) == greedy_tokens(cold, prompt, 24)


def test_tokens_selected_on_the_gpu_are_the_argmax_of_each_steps_logits():
    # A prompt's logits lie in a chunk's last row or in the long-prompt step's buffer, a decode step's in
    # row 0: the selection must read each (its graphs were once bound to the first buffer they saw).
    from cmpchat.backends.base import Selector
    from cmpchat.sampling import SamplingParams

    gpu = CudaBackend(ModelFile(ensure_demo_model()), context=4096)
    gpu.warm_up()
    for length in (5, PROMPT_ROWS, PROMPT_ROWS + 3):
        sequence = gpu.new_sequence()
        logits = gpu.prefill(sequence, [(11 * i) % 7000 for i in range(length)])
        for _ in range(6):
            expected = int(np.argmax(gpu.to_host(logits)[-1]))
            token = gpu.select(logits, [Selector(SamplingParams(), [], np.random.default_rng(0))]).tokens()[0]
            assert token == expected, f"prompt of {length}"
            logits = gpu.decode([sequence], [token])
        gpu.release(sequence)


def test_the_engine_feeds_each_choice_on_the_gpu_and_gets_the_host_fed_tokens():
    # The engine queues each step with the selection's ids still on the GPU and reads them while it runs: its
    # greedy reply must be the host-fed argmax loop's, and a seeded sampled reply the same twice.
    from cmpchat.engine.engine import Engine
    from cmpchat.engine.events import Finished
    from cmpchat.engine.reply import GenerationOptions
    from cmpchat.engine.request import GenerationRequest
    from cmpchat.sampling import SamplingParams
    from cmpchat.tokenizer import Tokenizer

    model_file = ModelFile(ensure_demo_model())
    gpu = CudaBackend(model_file, context=4096)
    gpu.warm_up()
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    engine = Engine(gpu, tokenizer, slots=1, cache_states=0)
    prompt = [(13 * i) % 9000 for i in range(PROMPT_ROWS + 5)]
    steps = 60
    expected = greedy_tokens(gpu, prompt, steps)
    ends = [i for i, t in enumerate(expected) if t in tokenizer.eos_token_ids]
    expected = expected[: ends[0]] if ends else expected

    def reply(options: GenerationOptions) -> str:
        *_, finished = engine.generate(GenerationRequest(tuple(prompt), options))
        assert isinstance(finished, Finished)
        return finished.content

    assert reply(GenerationOptions(max_tokens=steps, raw_text=True)) == tokenizer.decode(expected)
    sampled = GenerationOptions(max_tokens=steps, raw_text=True, sampling=SamplingParams(temperature=0.8, seed=4))
    assert reply(sampled) == reply(sampled)


def test_a_fork_shares_pages_and_both_continue_as_fresh_sequences():
    """A prompt ending inside a page, forked: each side appends different tokens (the fork copies the shared
    partial page first) and gets the logits of a fresh sequence that reads the same tokens the same way (one
    prefill, then one decode step a token), to the bit."""
    gpu = CudaBackend(ModelFile(ORACLE / "real_heads.q8_0.gguf"), sequences=4, context=4096)
    prompt = np.random.default_rng(4).integers(0, gpu.config.vocab_size, 300).tolist()  # page 256 + 44

    def continue_(sequence, tail: list[int]) -> np.ndarray:
        return np.stack([gpu.to_host(gpu.decode([sequence], [token]))[0] for token in tail])

    original = gpu.new_sequence()
    gpu.prefill(original, prompt)
    fork = gpu.fork(original)
    assert fork.pages.pages == original.pages.pages
    forked = continue_(fork, [8, 9])  # the fork writes first: its partial page is a copy
    ours = continue_(original, [5, 6, 7])
    assert fork.pages.pages[0] == original.pages.pages[0] and fork.pages.pages[1] != original.pages.pages[1]
    for got, tail in ((forked, [8, 9]), (ours, [5, 6, 7])):
        fresh = gpu.new_sequence()
        gpu.prefill(fresh, prompt)
        assert np.array_equal(got.view(np.uint32), continue_(fresh, tail).view(np.uint32))
        gpu.release(fresh)


def test_requests_preempted_for_kv_pages_on_the_gpu_say_what_they_say_alone():
    """16 requests growing past a small pool: preempted and resumed as needed; each one's greedy tokens equal its
    run alone, or part where the two choices lie within the rounding of the backend's read paths."""
    from cmpchat.engine.engine import Engine
    from cmpchat.engine.events import Finished
    from cmpchat.engine.reply import GenerationOptions
    from cmpchat.engine.request import GenerationRequest
    from cmpchat.evaluation.agreement import parting_is_explained
    from cmpchat.tokenizer import Tokenizer

    model_file = ModelFile(ensure_demo_model())
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    gpu = CudaBackend(model_file, sequences=16, saved_states=1, context=1024, kv_tokens=12 * 256)
    options = GenerationOptions(max_tokens=200, ignore_eos=True, raw_text=True)
    prompts = [tuple((31 * i + 7 * j) % 9000 for j in range(20 + i)) for i in range(16)]
    engine = Engine(gpu, tokenizer, slots=16, cache_states=0)
    events: list[list] = [[] for _ in prompts]
    for prompt, sink in zip(prompts, events, strict=True):
        engine.submit(GenerationRequest(prompt, options), sink.extend)
    engine.run_until_idle()
    assert engine.stats.preemptions > 0
    alone = Engine(gpu, tokenizer, slots=1, cache_states=0)
    identical = 0
    for prompt, sink in zip(prompts, events, strict=True):
        together = sink[-1]
        assert isinstance(together, Finished) and together.timings.generated_tokens == 200
        *_, expected = alone.generate(GenerationRequest(prompt, options))
        assert isinstance(expected, Finished)
        if together.token_ids == expected.token_ids:
            identical += 1
            continue
        first_difference = next(i for i, (a, b) in enumerate(zip(together.token_ids, expected.token_ids)) if a != b)
        assert parting_is_explained(gpu, prompt, expected.token_ids, together.token_ids, first_difference), (
            f"tokens differ at {first_difference}, beyond the read paths' rounding"
        )
    print(f"{identical} of {len(prompts)} resumed requests generated exactly their tokens alone")
    assert gpu.held_sequences == 0 and gpu.pool.free_pages == gpu.pool.total_pages


def test_batched_decode_matches_single_sequences():
    gpu = CudaBackend(ModelFile(ensure_demo_model()), sequences=4, context=4096)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    sequences = [gpu.new_sequence() for _ in prompts]
    for sequence, prompt in zip(sequences, prompts):
        gpu.prefill(sequence, prompt)
    together = gpu.to_host(gpu.decode(sequences, [10, 11, 12]))
    for sequence in sequences:
        gpu.release(sequence)
    for row, (prompt, token) in enumerate(zip(prompts, [10, 11, 12])):
        sequence = gpu.new_sequence()
        gpu.prefill(sequence, prompt)
        alone = gpu.to_host(gpu.decode([sequence], [token]))[0]
        gpu.release(sequence)
        np.testing.assert_allclose(together[row], alone, atol=1e-4 * np.abs(alone).max())


def test_a_model_that_does_not_fit_is_refused_with_numbers():
    with pytest.raises(CmpchatError, match="GiB"):
        CudaBackend(ModelFile(ensure_demo_model()), gpu_mem=64 * 2**20)


def test_selection_happens_on_the_gpu():
    from cmpchat.backends.base import Selector
    from cmpchat.sampling import SamplingParams

    gpu = CudaBackend(ModelFile(ensure_demo_model()), sequences=2, context=4096)
    first, second = gpu.new_sequence(), gpu.new_sequence()
    gpu.prefill(first, [1, 2, 3])
    gpu.prefill(second, [4, 5])
    logits = gpu.decode([first, second], [6, 7])
    host = gpu.to_host(logits)

    def select(params, histories, seed):
        rng = np.random.default_rng(seed)
        return gpu.select(logits, [Selector(params, h, rng) for h in histories]).tokens()

    assert select(SamplingParams(), [[], []], 0) == list(host.argmax(axis=1))
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1)
    draws = [select(sampled, [[1], [2]], 5) for _ in range(2)]
    assert draws[0] == draws[1]  # the same generator state gives the same keys, so the same draws
    top40 = np.argsort(-host, axis=1)[:, :40]
    assert all(token in top40[row] for row, token in enumerate(draws[0]))


def test_chat_runs_end_to_end_on_the_gpu():
    from cmpchat import ContentDelta, Finished, GenerationOptions, Message, SamplingParams, open_model

    model = open_model(None, backend="cuda", context=4096)
    options = GenerationOptions(max_tokens=48, sampling=SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3))
    events = list(model.chat([Message("user", "Hello!")], options))
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.timings.generated_tokens >= 1
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == finished.content
    assert isinstance(model.backend, CudaBackend)
    print(f"demo model on {model.backend.gpu.name}: {finished.timings.decode_tokens_per_second:.0f} tok/s decode")
