"""Splitting a model's layers over a pipeline of stages: the largest shared KV pool, then even weights."""

from __future__ import annotations

import pytest

from cmpchat.backends.gpu.memory_plan import RESERVE_BYTES
from cmpchat.backends.gpu.pipeline_plan import LayerCosts, Split, split_layers
from cmpchat.errors import CmpchatError
from cmpchat.model.builder import MODEL_SHAPES, tensor_specs

GIB = 2**30
PAGE = 256


def shape_costs(name: str) -> LayerCosts:
    """Q8_0 bytes per layer of a released shape, its fp16 KV bytes per token and fp32 states per sequence."""
    shape = MODEL_SHAPES[name]
    weights = [0] * shape.num_layers
    extras = {"token_embd.weight": 0, "output.weight": 0, "output_norm.weight": 0}
    for spec in tensor_specs(shape):
        size = spec.shape[0] * spec.shape[1] // 32 * 34 if spec.role == "matrix" else 4 * spec.shape[0]
        if spec.name.startswith("blk."):
            weights[int(spec.name.split(".")[1])] += size
        else:
            extras[spec.name] = size
    head = extras["token_embd.weight"] if shape.tied_embeddings else extras["output.weight"]
    kv = [2 * shape.num_kv_heads * shape.head_dim * 2 if shape.is_attention(i) else 0 for i in range(shape.num_layers)]
    per_gdn = 4 * ((shape.conv_kernel - 1) * shape.conv_dim + shape.num_v_heads * shape.k_head_dim * shape.v_head_dim)
    states = [0 if shape.is_attention(i) else per_gdn for i in range(shape.num_layers)]
    return LayerCosts(weights, kv, states, extras["token_embd.weight"], extras["output_norm.weight"] + head)


def uniform(layers: int, weight: int = 100, kv: int = 1, state: int = 0, first: int = 0, last: int = 0) -> LayerCosts:
    return LayerCosts([weight] * layers, [kv] * layers, [state] * layers, first, last)


def split(costs: LayerCosts, budgets: list[int], **options) -> Split:
    defaults = {"sequences": 1, "page_tokens": PAGE, "most_tokens": 10**9, "least_tokens": PAGE}
    return split_layers(costs, [b + RESERVE_BYTES for b in budgets], [0] * len(budgets), **(defaults | options))


def stage_bytes(costs: LayerCosts, plan: Split, stage: int, sequences: int = 1) -> int:
    layers = plan.ranges[stage]
    total = sum(costs.weights[i] + sequences * costs.state_per_sequence[i] for i in layers)
    total += plan.pool_tokens * sum(costs.kv_per_token[i] for i in layers)
    total += costs.first_extra if stage == 0 else 0
    return total + (costs.last_extra if stage == len(plan.ranges) - 1 else 0)


def test_equal_stages_get_equal_layers_and_the_pool_the_fullest_one_allows():
    costs = uniform(12, weight=1000, kv=1)
    plan = split(costs, [4000 + 4 * 3 * PAGE] * 3)
    assert [len(r) for r in plan.ranges] == [4, 4, 4]
    assert plan.pool_tokens == 3 * PAGE  # each stage: 4 layers of 1000 bytes and 4 bytes a token


def test_the_ranges_are_contiguous_and_cover_every_layer():
    costs = shape_costs("27B")
    plan = split(costs, [15 * GIB] * 3, sequences=4, most_tokens=4 * 262_144)
    assert plan.ranges[0].start == 0 and plan.ranges[-1].stop == 64
    assert all(a.stop == b.start for a, b in zip(plan.ranges, plan.ranges[1:]))


def test_27b_on_three_16_gb_cards_fits_and_the_last_card_carries_the_head_with_fewer_layers():
    costs = shape_costs("27B")
    budgets = [16 * GIB - RESERVE_BYTES] * 3
    plan = split(costs, budgets, sequences=5, most_tokens=5 * 262_144, least_tokens=4096)
    counts = [len(r) for r in plan.ranges]
    assert sum(counts) == 64 and counts[-1] < max(counts)
    assert plan.pool_tokens >= 100_000 and plan.pool_tokens % PAGE == 0
    assert all(stage_bytes(costs, plan, s, 5) <= budgets[s] for s in range(3))
    # A larger pool fits nowhere: some stage would overflow with one more page, whatever the split.
    with pytest.raises(CmpchatError):
        split(costs, budgets, sequences=5, most_tokens=plan.pool_tokens + PAGE, least_tokens=plan.pool_tokens + PAGE)


def test_a_stage_with_more_memory_takes_more_layers_for_a_larger_pool():
    costs = uniform(12, weight=100, kv=1)
    uneven = split(costs, [4000, 8000])
    assert [len(r) for r in uneven.ranges] == [4, 8] and uneven.pool_tokens == 3 * PAGE
    assert split(costs, [4000, 8000], counts=[6, 6]).pool_tokens == 2 * PAGE  # the even split holds less
    with pytest.raises(CmpchatError, match="change --split"):
        split(costs, [4000, 8000], counts=[10, 2], least_tokens=2 * PAGE)


def test_once_the_pool_is_capped_the_weights_are_balanced():
    costs = uniform(10, weight=1000, kv=1, last=1500)
    plan = split(costs, [100_000, 100_000], most_tokens=4 * PAGE)
    assert plan.pool_tokens == 4 * PAGE
    assert [len(r) for r in plan.ranges] == [6, 4]  # 6000 against 4000 + the head's 1500


def test_a_manual_split_is_kept_and_its_pool_is_what_its_fullest_stage_leaves():
    costs = uniform(12, weight=1000, kv=1)
    plan = split(costs, [20_000, 20_000], counts=[8, 4])
    assert plan.ranges == [range(0, 8), range(8, 12)]
    assert plan.pool_tokens == (20_000 - 8000) // 8 // PAGE * PAGE
    with pytest.raises(CmpchatError, match=r"--split needs 2 layer counts of at least 1 that add up to 12"):
        split(costs, [20_000, 20_000], counts=[8, 3])


def test_a_model_that_does_not_fit_is_refused_with_the_numbers():
    costs = shape_costs("27B")
    with pytest.raises(CmpchatError) as refused:
        split(costs, [12 * GIB, 12 * GIB], sequences=2, least_tokens=4096, labels=["GPU 0", "GPU 3"])
    message = str(refused.value)
    assert "does not fit 2 stage(s)" in message and "12.5 (GPU 0), 12.5 (GPU 3) GiB" in message
    assert "add a GPU (--gpus)" in message
    assert "\n" not in message


def test_more_stages_than_layers_is_refused():
    with pytest.raises(CmpchatError, match="at least one layer"):
        split(uniform(2), [10**6] * 3)


def test_a_stage_without_attention_layers_holds_no_kv():
    costs = LayerCosts([1000] * 4, [0, 0, 0, 1], [0] * 4, 0, 0)
    plan = split(costs, [3000, 10**6], counts=[3, 1])  # the first stage's 3 layers hold no pages
    assert plan.pool_tokens == (10**6 - 1000) // PAGE * PAGE
