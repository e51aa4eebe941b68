"""The CUDA backend builds its steps with the tuning row it is given (`kernels/device_table.py`): under the
simulator its GPU's row is the simulator's, and a test or benchmark can hand it another device's (here the CMP's
sm_70 row), which reaches every launcher. The steps are built, not run (their kernels have their own tests)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from cmpchat.backends.gpu.device import SIMULATED_GPU
from cmpchat.backends.gpu.model import CudaBackend
from cmpchat.backends.gpu.prompt_step import PROMPT_ROWS, prompt_launches
from cmpchat.backends.gpu.step import AttentionSplits, decode_launches
from cmpchat.cudart.launch import Launch
from cmpchat.kernels import attention_prefill
from cmpchat.kernels.device_table import SIMULATOR_TUNING, SM_70, TUNING_VARIABLE, DeviceTuning
from cmpchat.kernels.gemm import gemm_kernel
from cmpchat.kernels.gemv_fused import GEMV_FUSED
from cmpchat.model.gguf_file import ModelFile


def load(path: Path, tuning: DeviceTuning | None = None) -> CudaBackend:
    return CudaBackend(ModelFile(path), context=1024, page_tokens=128, tuning=tuning)


def prompt_step(backend: CudaBackend) -> list[Launch]:
    stage = backend.stages[0]
    assert stage.prompt is not None  # the tiny model takes the long-prompt step
    return prompt_launches(backend.config, stage.weights, stage.kv, stage.states, stage.prompt, 0,
                           stage.gpu.multiprocessors, stage.tuning)  # fmt: skip


def test_without_a_row_the_backend_runs_its_gpus(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TUNING_VARIABLE, raising=False)
    backend = load(tiny_model_path)
    assert backend.tuning is SIMULATOR_TUNING and backend.stages[0].tuning is SIMULATOR_TUNING
    assert not backend.early_launch
    gemms = [launch for launch in prompt_step(backend) if launch.dispatcher is gemm_kernel(SIMULATOR_TUNING.gemm)]
    assert gemms and {launch.block for launch in gemms} == {SIMULATOR_TUNING.gemm.threads}
    assert "tuning simulator: memory plan" in backend.describe()[0]


def test_the_cmps_row_reaches_every_launcher(tiny_model_path: Path) -> None:
    backend = load(tiny_model_path, SM_70)
    stage, config = backend.stages[0], backend.config
    sms = stage.gpu.multiprocessors
    assert stage.tuning is SM_70 and not stage.early_launch
    assert backend.plan.page_tokens % SM_70.page_tile(config.head_dim) == 0

    # The long-prompt step: the sm_70 GEMM tiling (its launch bounds), prefill attention in the sm_70 row's tiling.
    launches = prompt_step(backend)
    gemms = [launch for launch in launches if launch.dispatcher is gemm_kernel(SM_70.gemm)]
    assert len(gemms) == 4 * config.num_layers  # input projection, output, gate|up, down
    assert {launch.block for launch in gemms} == {SM_70.gemm.threads}  # 128 threads, not the simulator's 32
    assert not any(launch.dispatcher is gemm_kernel(SIMULATOR_TUNING.gemm) for launch in launches)
    assert stage.prompt is not None
    wanted = SM_70.prefill_attention_config(PROMPT_ROWS, config.num_heads, config.num_kv_heads, sms)
    assert stage.prompt.attention == wanted and wanted.warps == 8  # the simulator's has 2
    group = config.num_heads // config.num_kv_heads
    partial = attention_prefill.partial_kernel(group, config.head_dim, wanted)
    assert [launch.block for launch in launches if launch.dispatcher is partial] == [wanted.threads] * len(
        config.attention_layers
    )

    # A one-row decode step: the fused GEMVs in the row's tilings, attention split as the row says.
    splits = AttentionSplits.allocate(config, 1, sms, SM_70)
    assert splits.config == SM_70.decode_attention_config(1, config.num_heads, config.num_kv_heads, sms)
    step = decode_launches(config, stage.weights, stage.kv, stage.states, stage.buffers, splits, 1, sms, SM_70)
    fused = [launch for launch in step if launch.dispatcher in GEMV_FUSED.values()]
    narrow = SM_70.gemv_narrow
    assert fused and all(launch.dispatcher is GEMV_FUSED[T.Q8_0, narrow.steps, narrow.groups] for launch in fused)


def test_the_memory_plan_is_the_rows(tiny_model_path: Path) -> None:
    """The plan reserves the row's buffers: on 80 SMs the sm_70 row's prefill attention takes more splits than the
    simulator's (4-token query tiles: fewer tiles to fill the SMs with), so more scratch; loading plans as asked."""
    model_file = ModelFile(tiny_model_path)
    backend = load(tiny_model_path, SM_70)
    config, eighty = backend.config, replace(SIMULATED_GPU, multiprocessors=80)
    plans = {
        row.name: CudaBackend.memory_plans(
            model_file, config, context=1024, page_tokens=128, gpus=[eighty], tunings=[row]
        )[0]
        for row in (SIMULATOR_TUNING, SM_70)
    }
    assert plans["sm_70"].scratch > plans["simulator"].scratch
    sequences = backend.max_sequences
    assert backend.plans == CudaBackend.memory_plans(
        model_file, config, sequences=sequences, context=1024, page_tokens=128, tunings=[SM_70]
    )
