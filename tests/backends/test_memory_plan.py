"""The GPU memory plan for the released shapes on a 16 GB CMP card."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.kv_layout import FP16, LAYOUTS, KvLayout
from cmpchat.backends.gpu.memory_plan import StagePlan, plan_stage
from cmpchat.errors import CmpchatError
from cmpchat.kernels.device_table import SIMULATOR_TUNING, SM_70, SM_90
from cmpchat.model.builder import MODEL_SHAPES, tensor_specs
from cmpchat.model.config import LayerKind, ModelConfig

GIB = 2**30


def config_of(shape_name: str) -> tuple[ModelConfig, int, int]:
    shape = MODEL_SHAPES[shape_name]
    kinds = tuple(
        LayerKind.ATTENTION if shape.is_attention(i) else LayerKind.RECURRENT for i in range(shape.num_layers)
    )
    config = ModelConfig(
        name=shape_name,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        ffn_size=shape.ffn_size,
        context_length=shape.context_length,
        rms_eps=shape.rms_eps,
        layer_kinds=kinds,
        num_mtp_layers=0,
        tied_embeddings=shape.tied_embeddings,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rope_dims=shape.rope_dims,
        rope_theta=shape.rope_theta,
        rope_sections=shape.rope_sections,
        conv_kernel=shape.conv_kernel,
        num_k_heads=shape.num_k_heads,
        num_v_heads=shape.num_v_heads,
        k_head_dim=shape.k_head_dim,
        v_head_dim=shape.v_head_dim,
    )
    sizes = [s.shape[0] * s.shape[1] // 32 * 34 if s.role == "matrix" else 4 * s.shape[0] for s in tensor_specs(shape)]
    return config, sum(sizes), max(sizes)


def plan(config: ModelConfig, weights: int, largest: int, budget: int, layout: KvLayout = FP16, **options) -> StagePlan:
    return plan_stage(
        config,
        weights=weights,
        largest_tensor=largest,
        budget=budget,
        kv_bytes_per_token=layout.bytes_per_token(config, config.attention_layers),
        recurrent_bytes_per_sequence=config.recurrent_state_bytes(),
        kv_layout=layout.name,
        **options,
    )


def test_9b_fits_a_16_gb_card_with_a_long_shared_pool():
    config, weights, largest = config_of("9B")
    stage = plan(config, weights, largest, 16 * GIB, sequences=5)
    assert 8 * GIB < stage.weights < 10 * GIB  # 8.4 GB of layers + the 1 GiB embedding
    assert stage.pool_tokens >= 100_000  # 32 KiB of KV per token leaves room for ~150K tokens, shared
    assert stage.pool_tokens % stage.page_tokens == 0 and stage.context_limit == min(stage.pool_tokens, 262_144)
    assert stage.recurrent_state == 5 * config.recurrent_state_bytes()
    assert stage.total <= stage.budget
    assert stage.host_ram <= 128 * 2**20
    text = "\n".join(stage.describe())
    assert "KV cache pool" in text and f"{stage.pool_tokens} tokens f16" in text and "warning" not in text


def test_a_compressed_pool_holds_its_share_more_tokens():
    # 9B, hd 256: per token and KV head f16 1024 bytes, q8 544, q8k-tq3v 376, tq3 208 (4.9x fewer than f16).
    config, weights, largest = config_of("9B")
    f16 = plan(config, weights, largest, 16 * GIB, sequences=5)
    for name, per_head in (("q8", 544), ("q8k-tq3v", 376), ("tq3", 208)):
        layout = LAYOUTS[name]
        assert layout.bytes_per_token(config, config.attention_layers) == 8 * 4 * per_head
        stage = plan(config, weights, largest, 16 * GIB, layout, sequences=5)
        assert stage.kv_pool <= f16.kv_pool and abs(stage.pool_tokens / f16.pool_tokens - 1024 / per_head) < 0.01
        assert f"{stage.pool_tokens} tokens {name} at {8 * 4 * per_head / 1024:.1f} KiB" in "\n".join(stage.describe())
    assert "at 32.0 KiB" in "\n".join(f16.describe())


def test_a_context_beyond_the_pool_is_capped_with_a_warning():
    config, weights, largest = config_of("9B")
    stage = plan(config, weights, largest, 16 * GIB, context=262_144)
    assert stage.context_limit == stage.pool_tokens < 262_144
    assert any(line.startswith("warning: --ctx 262144 exceeds") for line in stage.describe())


def test_27b_does_not_fit_one_card_and_says_so():
    config, weights, largest = config_of("27B")
    with pytest.raises(CmpchatError, match=r"needs .* GiB on the GPU .* 16\.0 GiB is usable"):
        plan(config, weights, largest, 16 * GIB)


def test_more_sequence_states_leave_a_smaller_pool_and_kv_tokens_cap_it():
    config, weights, largest = config_of("4B")
    one = plan(config, weights, largest, 16 * GIB)
    assert one.pool_tokens == 262_144  # one sequence never reads more than its full context
    two = plan(config, weights, largest, 16 * GIB, sequences=2)
    twenty = plan(config, weights, largest, 16 * GIB, sequences=20)
    assert 262_144 < twenty.pool_tokens < two.pool_tokens < 2 * 262_144  # what the memory holds
    states = 18 * config.recurrent_state_bytes()
    assert two.pool_tokens - twenty.pool_tokens <= states // twenty.kv_bytes_per_token + 256
    capped = plan(config, weights, largest, 16 * GIB, kv_tokens=20_000)
    assert capped.pool_tokens == 20_000 // 256 * 256 and capped.total < one.total


def test_the_image_encoder_is_reserved_beside_the_model_and_named_when_it_does_not_fit():
    from cmpchat.vision.gpu_encoder import RELEASED_9B, device_bytes

    config, weights, largest = config_of("9B")
    encoder = device_bytes(RELEASED_9B, 2048 * 2048 // 16**2)  # weights, and scratch for a 2048 x 2048 image
    bare = plan(config, weights, largest, 16 * GIB, sequences=5)
    seeing = plan(config, weights, largest, 16 * GIB, sequences=5, image_encoder=encoder)
    assert seeing.image_encoder == encoder and seeing.total <= seeing.budget
    lost = bare.pool_tokens - seeing.pool_tokens
    assert encoder // seeing.kv_bytes_per_token <= lost <= encoder // seeing.kv_bytes_per_token + seeing.page_tokens
    assert any(line.startswith("image encoder    1.1") for line in seeing.describe())
    assert not any(line.startswith("image encoder") for line in bare.describe())
    tight = bare.total - bare.kv_pool + 512 * 2**20 + 4096 * bare.kv_bytes_per_token + 100 * 2**20  # 100 MiB spare
    plan(config, weights, largest, tight, sequences=5)
    with pytest.raises(CmpchatError, match=r"the image encoder 1\.1 GiB, .* no vision projector or a larger card"):
        plan(config, weights, largest, tight, sequences=5, image_encoder=encoder)


def test_short_contexts_still_get_a_whole_page_each():
    config, weights, largest = config_of("9B")
    stage = plan(config, weights, largest, 140 * GIB, sequences=6, context=138)
    assert stage.pool_pages == 6 and stage.context_limit == 138


def test_kv_tokens_below_one_sequence_says_which_option_to_raise():
    config, weights, largest = config_of("4B")
    with pytest.raises(CmpchatError, match=r"3072 tokens holds less than one sequence's 4096; raise --kv-tokens"):
        plan(config, weights, largest, 16 * GIB, context=8192, kv_tokens=3072)
    assert plan(config, weights, largest, 16 * GIB, sequences=4, context=1024, kv_tokens=3072).pool_tokens == 3072


@pytest.mark.parametrize("shape_name", ["0.8B", "9B", "27B"])
@pytest.mark.parametrize("sm_count", [68, 132])
def test_the_long_prompt_step_is_reserved_and_covers_its_buffers(shape_name, sm_count):
    """The plan reserves what `PromptBuffers.allocate` takes (simulator arrays are numpy, so their sizes are
    counted on the CPU), and it stays small beside the weights (the 0.8B's 43 MB on 132 SMs: 5.4%, in the
    simulator's tiling)."""
    from dataclasses import fields, is_dataclass

    from cmpchat.backends.gpu.prompt_step import PIPELINE_PROMPT_ROWS, PROMPT_ROWS, PromptBuffers

    config, weights, largest = config_of(shape_name)
    reserved = PromptBuffers.reserved_bytes(config, SIMULATOR_TUNING, sm_count, PROMPT_ROWS, pages_per_row=32)
    buffers = PromptBuffers.allocate(config, SIMULATOR_TUNING, sm_count, PROMPT_ROWS, pages_per_row=32)

    def nbytes(value) -> int:  # an array, the chunked Gated DeltaNet's workspace of arrays, or a staging buffer
        if value is None:  # that a stage at the pipeline's end (or alone) does not have
            return 0
        return sum(nbytes(getattr(value, f.name)) for f in fields(value)) if is_dataclass(value) else value.nbytes

    def allocated(buffers: PromptBuffers) -> int:
        return sum(nbytes(getattr(buffers, f.name)) for f in fields(buffers) if f.name not in NOT_ALLOCATED)

    assert buffers.gdn_workspace is not None and buffers.arrival is None and buffers.departure is None
    assert allocated(buffers) == reserved < 0.06 * weights
    # A pipeline's middle stage: smaller steps, and staging for the hand-offs from the stage before and to the next.
    staged = PromptBuffers.allocate(config, SIMULATOR_TUNING, sm_count, PIPELINE_PROMPT_ROWS, 32, receives=True,
                                    sends=True)  # fmt: skip
    assert staged.arrival is not None and staged.arrival.shape == (PIPELINE_PROMPT_ROWS, config.hidden_size)
    assert allocated(staged) == PromptBuffers.reserved_bytes(config, SIMULATOR_TUNING, sm_count, PIPELINE_PROMPT_ROWS,
                                                             32, receives=True, sends=True)  # fmt: skip
    plain = plan(config, weights, largest, 2 * weights, context=8192)
    with_prompts = plan(config, weights, largest, 2 * weights, context=8192, prompt_scratch=reserved)
    assert with_prompts.scratch == plain.scratch + reserved


NOT_ALLOCATED = {"tokens", "positions", "attention", "_known_pages"}
"""Views of `inputs`, the attention split config and what the device's page table holds."""


@pytest.mark.parametrize("shape_name", ["0.8B", "9B", "27B"])
@pytest.mark.parametrize(
    "row, sm_count", [(SM_70, 68), (SM_70, 80), (SM_90, 132)], ids=["sm_70-68", "sm_70-80", "sm_90"]
)
def test_the_gpu_rows_long_prompt_step_is_reserved_as_allocated(shape_name, row, sm_count):
    """The same for the CMP's and the H200's rows of the device table (their prefill attention tiling, split for
    their SM counts): the plan reserves what loading allocates, under a tenth of the weights (the 0.8B's 68 MB
    on the H200: 8.5%)."""
    from dataclasses import fields

    from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS, PromptBuffers

    config, weights, _ = config_of(shape_name)
    reserved = PromptBuffers.reserved_bytes(config, row, sm_count, PROMPT_ROWS, pages_per_row=32)
    buffers = PromptBuffers.allocate(config, row, sm_count, PROMPT_ROWS, pages_per_row=32)
    assert buffers.attention == row.prefill_attention_config(
        PROMPT_ROWS, config.num_heads, config.num_kv_heads, sm_count
    )
    arrays = [getattr(buffers, f.name) for f in fields(buffers) if f.name not in NOT_ALLOCATED | {"gdn_workspace"}]
    arrays = [a for a in arrays if a is not None]  # no staging buffers: one stage
    workspace = buffers.gdn_workspace
    assert workspace is not None
    allocated = sum(a.nbytes for a in arrays) + sum(getattr(workspace, f.name).nbytes for f in fields(workspace))
    assert allocated == reserved < 0.1 * weights
