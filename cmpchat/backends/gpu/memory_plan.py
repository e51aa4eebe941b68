"""How a model fits on a GPU: weights, KV cache, recurrent state, scratch and host RAM, in bytes.

Pure arithmetic, so it is tested on the CPU and printed before anything is allocated. A model that does
not fit is refused with the numbers and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile

MAX_SEQUENCES = 64
"""Sequence states one GPU holds at most: the ones being decoded (16 per step at most) and saved prefixes."""
MIN_CONTEXT = 4096
"""The smallest context per sequence worth running; below it the model is refused."""
HOST_CHUNK_BYTES = 64 * 2**20
"""Weights travel to the GPU in pieces of at most this size, so host RAM stays small while loading."""
RESERVE_BYTES = 512 * 2**20
"""Left free for the CUDA context, kernels' code and allocator slack."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    weights: int
    kv_cache: int
    recurrent_state: int
    scratch: int
    host_ram: int
    sequences: int
    context_per_sequence: int
    budget: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.recurrent_state + self.scratch

    def describe(self) -> list[str]:
        def gib(n: int) -> str:
            return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

        return [
            f"weights          {gib(self.weights)}",
            f"KV cache (fp16)  {gib(self.kv_cache)}  ({self.sequences} x {self.context_per_sequence} tokens)",
            f"recurrent state  {gib(self.recurrent_state)}  ({self.sequences} sequences)",
            f"scratch          {gib(self.scratch)}",
            f"total on GPU     {gib(self.total)} of {gib(self.budget)} usable",
            f"host RAM         {gib(self.host_ram)} while loading",
        ]


def weight_bytes(model_file: ModelFile, config: ModelConfig) -> int:
    """GPU bytes of the main layers' weights as stored (Q8_0 keeps its 34 bytes per 32 values)."""
    layer_prefixes = tuple(f"blk.{i}." for i in range(config.num_layers))
    total = 0
    for name, info in model_file.tensors.items():
        if name.startswith("blk.") and not name.startswith(layer_prefixes):
            continue  # MTP blocks are not used for decoding
        total += info.n_bytes
    return total


def scratch_bytes(config: ModelConfig, batch: int = 16) -> int:
    """Activations of one decode step for `batch` tokens, with room for the widest fused projection."""
    widest = max(
        2 * config.num_heads * config.head_dim + 2 * config.num_kv_heads * config.head_dim,
        config.conv_dim + config.num_v_heads * config.v_head_dim + 2 * config.num_v_heads,
        2 * config.ffn_size,
    )
    per_token = 4 * (4 * config.hidden_size + 2 * widest + config.vocab_size)
    return batch * per_token


def plan_memory(
    config: ModelConfig,
    *,
    weights: int,
    largest_tensor: int,
    budget: int,
    sequences: int = 1,
    context: int | None = None,
    prompt_scratch: int = 0,
) -> MemoryPlan:
    """Fit `weights` bytes, state for `sequences` and the longest context that fits (at most `context`),
    with `prompt_scratch` bytes for the long-prompt step's buffers (`PromptBuffers.reserved_bytes`)."""
    if not 1 <= sequences <= MAX_SEQUENCES:
        raise CmpchatError(f"a GPU holds 1 to {MAX_SEQUENCES} sequence states, not {sequences}")
    recurrent = sequences * config.recurrent_state_bytes()
    scratch = scratch_bytes(config) + prompt_scratch
    fixed = weights + recurrent + scratch + RESERVE_BYTES
    per_token = sequences * config.kv_bytes_per_token()
    wanted = min(context or config.context_length, config.context_length)
    fits = (budget - fixed) // per_token if budget > fixed else 0
    if fits < min(MIN_CONTEXT, wanted):
        need = fixed + per_token * min(MIN_CONTEXT, wanted)
        raise CmpchatError(
            f"{config.name} needs {need / 2**30:.1f} GiB on the GPU (weights {weights / 2**30:.1f} GiB, "
            f"{sequences} sequence(s) of {min(MIN_CONTEXT, wanted)} tokens) but {budget / 2**30:.1f} GiB is usable; "
            "use a smaller model or fewer sequences"
        )
    context_per_sequence = int(min(wanted, fits))
    return MemoryPlan(
        weights=weights,
        kv_cache=per_token * context_per_sequence,
        recurrent_state=recurrent,
        scratch=scratch,
        host_ram=2 * min(largest_tensor, HOST_CHUNK_BYTES),
        sequences=sequences,
        context_per_sequence=context_per_sequence,
        budget=budget,
    )
