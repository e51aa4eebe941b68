"""The GPU memory plan for the released shapes on a 16 GB CMP card."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.memory_plan import plan_memory
from cmpchat.errors import CmpchatError
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


def test_9b_fits_a_16_gb_card_with_a_long_context():
    config, weights, largest = config_of("9B")
    plan = plan_memory(config, weights=weights, largest_tensor=largest, budget=16 * GIB)
    assert 8 * GIB < plan.weights < 10 * GIB  # 8.4 GB of layers + the 1 GiB embedding
    assert plan.context_per_sequence >= 100_000  # 32 KiB of KV per token leaves room for ~150K tokens
    assert plan.total <= plan.budget
    assert plan.host_ram <= 128 * 2**20
    assert "KV cache" in "\n".join(plan.describe())


def test_27b_does_not_fit_one_card_and_says_so():
    config, weights, largest = config_of("27B")
    with pytest.raises(CmpchatError, match=r"needs .* GiB on the GPU .* 16\.0 GiB is usable"):
        plan_memory(config, weights=weights, largest_tensor=largest, budget=16 * GIB)


def test_more_sequences_share_the_kv_budget():
    config, weights, largest = config_of("4B")
    one = plan_memory(config, weights=weights, largest_tensor=largest, budget=16 * GIB, context=262_144)
    four = plan_memory(config, weights=weights, largest_tensor=largest, budget=16 * GIB, sequences=4, context=262_144)
    assert four.context_per_sequence < one.context_per_sequence
    assert one.context_per_sequence == 262_144  # the whole context fits for one sequence
    assert four.total <= four.budget


@pytest.mark.parametrize("shape_name", ["0.8B", "9B", "27B"])
@pytest.mark.parametrize("sm_count", [68, 132])
def test_the_long_prompt_step_is_reserved_and_covers_its_buffers(shape_name, sm_count):
    """The plan reserves what `PromptBuffers.allocate` takes (simulator arrays are numpy, so their sizes are
    counted on the CPU), and it stays small beside the weights (the 0.8B's 43 MB on 132 SMs: 5.4%)."""
    from dataclasses import fields, is_dataclass

    from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS, PromptBuffers

    config, weights, largest = config_of(shape_name)
    reserved = PromptBuffers.reserved_bytes(config, sm_count, PROMPT_ROWS)
    buffers = PromptBuffers.allocate(config, sm_count, PROMPT_ROWS)

    def nbytes(value) -> int:  # an array, or the chunked Gated DeltaNet's workspace of arrays
        return sum(nbytes(getattr(value, f.name)) for f in fields(value)) if is_dataclass(value) else value.nbytes

    allocated = sum(nbytes(getattr(buffers, f.name)) for f in fields(buffers) if f.name not in NOT_ALLOCATED)
    assert buffers.gdn_workspace is not None
    assert allocated == reserved < 0.06 * weights
    plain = plan_memory(config, weights=weights, largest_tensor=largest, budget=2 * weights, context=8192)
    with_prompts = plan_memory(config, weights=weights, largest_tensor=largest, budget=2 * weights, context=8192,
                               prompt_scratch=reserved)  # fmt: skip
    assert with_prompts.scratch == plain.scratch + reserved


NOT_ALLOCATED = {"tokens", "positions", "page_table", "attention"}
"""Views of `inputs`, and the attention split config."""
