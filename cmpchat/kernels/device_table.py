"""Per-device choices in one table: the tilings, split counts, launch bounds and early launch each GPU runs.

The choices are measured per device on the real shapes (the sweeps of `bash cuda/gpu_run.sh sweep`;
docs/hardware.md, "Per-device choices") and held here, one `DeviceTuning` row per compute capability:

| row | for | GEMM | fused GEMV | decode attention | prefill attention | early launch |
|---|---|---|---|---|---|---|
| `SM_70` | sm_70 up to sm_7x (the CMP 100-210) | `gemm.SM70_TILING` (12 warps per SM) | 16 / 24 warps | 4 blocks per SM at G=4, 2 at G=6 | 8 warps, 64-key tiles | no (sm_90+ only) |
| `SM_80` | sm_80 up to sm_8x | `gemm.GPU_TILING` (16 warps per SM) | as sm_70 | as sm_70 | as sm_70 | no (sm_90+ only) |
| `SM_90` | sm_90 and newer (the H200) | `gemm.GPU_TILING` | as sm_70 | as sm_70 | as sm_70 | yes |

Launch bounds travel with the tilings: the GEMM's follow from its `resident_warps`, prefill attention's from its
`blocks_per_sm`; the other kernels' are the same on every GPU and stay with their definitions (the fused GEMV's
`SM_THREADS`, the Gated DeltaNet kernels').

Kernel modules define the tilings (and register the kernels each one needs, so the PTX check sees them);
their launchers take the tiling and the SM count as arguments and never ask which GPU they run on. The CUDA
backend looks its GPU's row up once, at load (`default_tuning`), and every step it builds takes the row and the
GPU's SM count from there. A test or benchmark runs another row by passing it (`CudaBackend(..., tuning=SM_70)`)
or by naming it in the environment (`CMPCHAT_TUNING=sm_70`: `default_tuning` then gives that row on any GPU).

Lookup (`tuning_for`): the row of the newest compute capability at or below the device's, so an unknown GPU
runs the row of the nearest older one it has (an sm_86 the sm_80 row, an sm_120 the sm_90 row); a GPU older
than every row runs the oldest (sm_70's). No choice is a row per SM count: where the SM count matters (the
GEMV's narrow or wide grid, the split counts), the row's rules take the device's (`gemv_tiling`,
`decode_attention_config`, `prefill_attention_config`), so a row serves a GPU of any size.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

from cmpchat.cudart.intrinsics import EARLY_LAUNCH_CAPABILITY, SIMULATOR, WARP_SIZE
from cmpchat.errors import CmpchatError
from cmpchat.kernels.attention import DecodeAttentionConfig
from cmpchat.kernels.attention_prefill import SIMULATOR_CONFIG, PrefillAttentionConfig
from cmpchat.kernels.gemm import GPU_TILING, SIMULATOR_TILING, SM70_TILING, GemmTiling
from cmpchat.kernels.gemv import row_pairs
from cmpchat.kernels.gemv_fused import FusedGemvTiling

TUNING_VARIABLE = "CMPCHAT_TUNING"
"""The environment variable naming the row every GPU runs (`default_tuning`): "sm_70", "sm_80", "sm_90"."""


class Device(Protocol):
    """What the table needs of a GPU: `backends.gpu.device.GpuInfo` is one, `DeviceSpec` another."""

    @property
    def compute_capability(self) -> tuple[int, int]: ...

    @property
    def multiprocessors(self) -> int: ...


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A GPU named by its compute capability and SM count alone, for tests and benchmarks."""

    compute_capability: tuple[int, int]
    multiprocessors: int


@dataclass(frozen=True, slots=True)
class DeviceTuning:
    """One row of the table: every launch choice that depends on the GPU."""

    name: str
    """How benchmarks, reports and CMPCHAT_TUNING name the row: "sm_70"."""
    capability: tuple[int, int]
    """The oldest compute capability the row is for."""
    gemm: GemmTiling
    """The prefill GEMM's tiling (its launch bounds follow from its `resident_warps`)."""
    gemv_narrow: FusedGemvTiling
    """The one-token fused GEMV's tiling, unless `gemv_tiling` picks the wide one."""
    gemv_wide: FusedGemvTiling
    """The fused GEMV's tiling for inputs wider than `gemv_wide_columns` with more row pairs than the narrow
    grid has warps."""
    gemv_wide_columns: int
    """Inputs up to this wide always take `gemv_narrow`."""
    decode_attention: DecodeAttentionConfig
    """Decode attention's tiling (warps, unroll, minimum split); `decode_attention_config` sets the splits."""
    split_blocks_per_sm: tuple[tuple[int, int], ...]
    """(G, blocks per SM) the decode-attention split count aims at, G = query heads per KV head."""
    split_blocks_per_sm_otherwise: int
    """Blocks per SM for any G not in `split_blocks_per_sm`."""
    prefill_attention: PrefillAttentionConfig
    """Prefill attention's tiling, launch bounds included (`blocks_per_sm`); `prefill_attention_config` sets the
    splits."""
    early_launch: bool
    """Whether early-launch kernels start while the launch before them finishes (`cudart/raw_launch.py`); only
    a GPU of `EARLY_LAUNCH_CAPABILITY` or newer has it (`launches_early`)."""

    def gemv_tiling(self, rows: int, cols: int, mode: str, sm_count: int) -> FusedGemvTiling:
        """The fused GEMV's tiling for a W [rows, cols] launch in `mode` on `sm_count` SMs: the wide one for
        inputs wider than `gemv_wide_columns`, unless the narrow grid has a warp for every row pair."""
        narrow = self.gemv_narrow
        narrow_warps = sm_count * narrow.blocks_per_sm * narrow.block_threads // WARP_SIZE
        wide = cols > self.gemv_wide_columns and row_pairs(rows, mode) > narrow_warps
        return self.gemv_wide if wide else narrow

    def split_blocks(self, group: int) -> int:
        """Blocks per SM the decode-attention split count aims at for G = `group`."""
        return dict(self.split_blocks_per_sm).get(group, self.split_blocks_per_sm_otherwise)

    def decode_attention_config(
        self, batch: int, num_heads: int, num_kv_heads: int, sm_count: int
    ) -> DecodeAttentionConfig:
        """Decode attention for `batch` rows on `sm_count` SMs: the row's tiling, split to fill the GPU."""
        blocks = self.split_blocks(num_heads // num_kv_heads)
        return DecodeAttentionConfig.splits_for(batch, num_kv_heads, sm_count, blocks, **_tiling(self.decode_attention))

    def prefill_attention_config(
        self, rows: int, num_heads: int, num_kv_heads: int, sm_count: int
    ) -> PrefillAttentionConfig:
        """Prefill attention for a step of `rows` rows on `sm_count` SMs: the row's tiling, split to fill the GPU."""
        tiling = _tiling(self.prefill_attention)
        return PrefillAttentionConfig.splits_for(rows, num_heads, num_kv_heads, sm_count, **tiling)

    def page_tile(self, head_dim: int) -> int:
        """Tokens a KV page must hold a whole number of: both attention kernels' tiles."""
        decode = self.decode_attention.tile_tokens(head_dim)
        return math.lcm(decode, self.prefill_attention.tile_keys)

    def launches_early(self, device: Device) -> bool:
        """Whether early-launch kernels start early on `device`: the row asks for it and the GPU has it."""
        return self.early_launch and tuple(device.compute_capability) >= EARLY_LAUNCH_CAPABILITY


def _tiling(config: DecodeAttentionConfig | PrefillAttentionConfig) -> dict[str, Any]:
    """A config's fields but its split count: what `splits_for` takes to keep them."""
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name != "num_splits"}


NARROW_GEMV = FusedGemvTiling(steps=4, blocks_per_sm=1, groups=2)
"""One 16-warp block per SM. Measured (`gemv_bench --sweep`, H200, 2026-12-01, after the launch bounds): on the
9B shapes' 4096-column inputs one 16-warp block per SM is 0.1-0.5 µs faster per launch than three 8-warp blocks
or one 24-warp block (the 9B step's GEMVs 2.70 -> 2.65 ms)."""
WIDE_GEMV = FusedGemvTiling(steps=4, blocks_per_sm=1, groups=3)
"""One 24-warp block per SM. On the 27B's wider inputs (H200, as above) it is as fast or faster on the shapes a
step runs most (ffn gate+up 50.5 against 51.1 µs for 16 warps, ffn down 31.0 against 34.0). Only inputs with
more row pairs than the narrow grid has warps take it: in whole steps (A/B, H200, 2026-12-01, same bits) 9B's
ffn down (4096 rows, 12288 columns: 2048 pairs for 2112 narrow warps) on 16-warp blocks made the step 2.811 ->
2.793 ms at context 0 (3.220 -> 3.200 at 32K), while every 27B input (2560 pairs or more) on them made its step
8.36 -> 8.51 ms."""
WIDE_GEMV_COLUMNS = 4096

SPLIT_BLOCKS_PER_SM = ((4, 4), (6, 2))
"""(G, blocks per SM) decode attention's split count aims at: no more than fit on an SM at once, so long rows
run in one wave (H200: 4 of G=4's 128-register blocks, 3 of G=6's 168; the CMP's sm_70: 3 and 2 of 156 and
211). Measured on the H200, 2026-12-01, partial + combine at one sequence, against the 8 of before: G=4 equal up
to 4K tokens, 51.5 -> 42.1 µs at 16K and 75.1 -> 65.5 at 32K; G=6 (2 beat 4) equal up to 1K, 33.6 -> 25.6 at
4K, 74.5 -> 62.6 at 16K, 110.5 -> 107.5 at 32K. On sm_70 G=4's 4 are 1 1/3 waves: not yet measured on a CMP.
Other G (no released model): 4."""

SM_90 = DeviceTuning(
    name="sm_90",
    capability=(9, 0),
    gemm=GPU_TILING,
    gemv_narrow=NARROW_GEMV,
    gemv_wide=WIDE_GEMV,
    gemv_wide_columns=WIDE_GEMV_COLUMNS,
    decode_attention=DecodeAttentionConfig(num_splits=1),
    split_blocks_per_sm=SPLIT_BLOCKS_PER_SM,
    split_blocks_per_sm_otherwise=4,
    prefill_attention=PrefillAttentionConfig(num_splits=1),
    early_launch=True,
)
"""Hopper and newer: the H200, where every choice was measured."""
SM_80 = replace(SM_90, name="sm_80", capability=(8, 0), early_launch=False)
"""Ampere and Ada: the H200's choices, without early launch (which they lack)."""
SM_70 = replace(SM_80, name="sm_70", capability=(7, 0), gemm=SM70_TILING)
"""The CMP 100-210 (Volta): the GEMM holds its prefetch in 168 registers; the rest as measured on the H200."""
SIMULATOR_TUNING = replace(
    SM_70,
    name="simulator",
    gemm=SIMULATOR_TILING,
    prefill_attention=PrefillAttentionConfig(num_splits=1, **SIMULATOR_CONFIG),
)
"""Numba's CUDA simulator (one Python thread per CUDA thread; it simulates an sm_70): 1-warp GEMM blocks and
2-warp prefill attention with 32-key tiles, the same bodies small enough to simulate; the rest as sm_70's."""

TABLE = (SM_70, SM_80, SM_90)
"""The rows, oldest compute capability first."""
NAMED = {row.name: row for row in (*TABLE, SIMULATOR_TUNING)}


def tuning_for(device: Device) -> DeviceTuning:
    """The row for `device`: that of the newest compute capability at or below its own (the oldest row for a
    GPU older than every row)."""
    capability = tuple(device.compute_capability)
    older = [row for row in TABLE if row.capability <= capability]
    return older[-1] if older else TABLE[0]


def tuning_named(name: str) -> DeviceTuning:
    """The row called `name` ("sm_70", "sm_80", "sm_90" or "simulator")."""
    try:
        return NAMED[name]
    except KeyError:
        raise CmpchatError(f"no tuning row is called '{name}'; the rows are {', '.join(NAMED)}") from None


def default_tuning(device: Device) -> DeviceTuning:
    """The row a backend or benchmark runs on `device` unless given one: the row CMPCHAT_TUNING names, else
    under the simulator `SIMULATOR_TUNING` (it compiles only the simulator's tilings), else `tuning_for`."""
    name = os.environ.get(TUNING_VARIABLE)
    if name:
        return tuning_named(name)
    return SIMULATOR_TUNING if SIMULATOR else tuning_for(device)
