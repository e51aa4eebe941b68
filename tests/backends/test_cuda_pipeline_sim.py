"""The CUDA backend as a pipeline of two stages on one GPU, under Numba's CUDA simulator, against one stage: the
same logits bit for bit (fp32 on the wire), through a prompt step and a decode step fed the id the GPU chose
(the selection on the last stage writes it into the first stage's token input). The GPU tests run longer
comparisons at real shapes; the split itself is tested in test_pipeline_plan.py."""

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


def prompt_then_chosen(backend: CudaBackend) -> tuple[np.ndarray, np.ndarray, list[int]]:
    sequence = backend.new_sequence()
    prompt = backend.prefill(sequence, [72, 33])
    first = backend.to_host(prompt)
    choice = backend.select(prompt, [Selector(SamplingParams(), [], np.random.default_rng(0))])
    second = backend.to_host(backend.decode([sequence], [Chosen(choice, 0)]))
    backend.release(sequence)
    return first, second, choice.tokens()


@pytest.mark.slow
def test_two_stages_on_one_gpu_give_one_stages_logits_bit_for_bit(tiny_model_path):
    one = load(tiny_model_path)
    two = load(tiny_model_path, gpus=[0, 0])
    assert [stage.layers for stage in two.stages] == [range(0, 2), range(2, 4)]
    assert two.stages[0].weights.lm_head is None and two.stages[1].weights.embedding is None
    assert two.pool.total_tokens == one.pool.total_tokens
    expected, got = prompt_then_chosen(one), prompt_then_chosen(two)
    for want, have in zip(expected[:2], got[:2], strict=True):
        assert np.array_equal(want.view(np.uint32), have.view(np.uint32))
    assert expected[2] == got[2]
    assert two.bridges[0].handoffs == 2 and two.bridges[0].bytes == 3 * 4 * two.config.hidden_size
    assert "layers           2-3" in "\n".join(two.describe())


def test_a_split_that_does_not_name_every_stage_is_refused(tiny_model_path):
    with pytest.raises(CmpchatError, match="--split needs 2 layer counts"):
        load(tiny_model_path, gpus=[0, 0], split=[1, 2])
    with pytest.raises(CmpchatError, match="--gpus takes GPU indices"):
        load(tiny_model_path, gpus=[])
