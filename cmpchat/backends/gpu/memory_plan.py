"""How a stage fits on its GPU: weights, sequence states, scratch and a KV pool of what is left, in bytes.

Pure arithmetic, so it is tested on the CPU and printed before anything is allocated. The KV pool is shared by
every sequence: it is sized from what remains after the weights, the recurrent states of every sequence the
stage holds (running and saved), the step buffers, the image encoder (on the first stage, where images enter,
when a projector is loaded) and a reserve, and `--ctx` only caps one sequence. A model that does not fit is
refused with the numbers and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cmpchat.errors import CmpchatError
from cmpchat.model.config import ModelConfig

MAX_SEQUENCES = 64
"""Sequence states one GPU holds at most: the ones being decoded (16 per step at most) and saved prefixes."""
MIN_CONTEXT = 4096
"""The smallest KV pool worth running; below it the model is refused."""
HOST_CHUNK_BYTES = 64 * 2**20
"""Weights travel to the GPU in pieces of at most this size, so host RAM stays small while loading."""
RESERVE_BYTES = 512 * 2**20
"""Left free for the CUDA context, kernels' code and allocator slack."""
PAGE_TOKENS = 256
"""Tokens per KV page: whole tiles of both attention kernels, and a page table of 1024 entries per row at 256K."""


@dataclass(frozen=True, slots=True)
class StagePlan:
    """What one stage allocates on its GPU: its layers' weights and states, its scratch and its share of the pool."""

    layers: range
    weights: int
    recurrent_state: int
    sequences: int
    """Sequence states held: running and saved ones."""
    scratch: int
    kv_layout: str
    kv_bytes_per_token: int
    pool_tokens: int
    page_tokens: int
    context_limit: int
    """Tokens one sequence may hold: --ctx, the model's own limit and the pool, whichever is least."""
    asked_context: int | None
    host_ram: int
    budget: int
    image_encoder: int = 0
    """The image encoder's weights and its scratch at the largest image (0: no projector on this stage)."""

    @property
    def kv_pool(self) -> int:
        return self.kv_bytes_per_token * self.pool_tokens

    @property
    def pool_pages(self) -> int:
        return self.pool_tokens // self.page_tokens

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.recurrent_state + self.scratch + self.image_encoder

    def describe(self) -> list[str]:
        lines = [
            f"layers           {self.layers.start}-{self.layers.stop - 1}",
            f"weights          {_size(self.weights)}",
            f"KV cache pool    {_size(self.kv_pool)}  ({self.pool_tokens} tokens {self.kv_layout} at "
            f"{self.kv_bytes_per_token / 1024:.1f} KiB, {self.pool_pages} pages of {self.page_tokens}, shared by all "
            "sequences)",
            f"recurrent state  {_size(self.recurrent_state)}  ({self.sequences} sequences, running and saved)",
            f"scratch          {_size(self.scratch)}",
            *self._image_encoder_lines(),
            f"total on GPU     {_size(self.total)} of {_size(self.budget)} usable",
            f"context          {self.context_limit} tokens per sequence at most",
            f"host RAM         {_size(self.host_ram)} while loading",
        ]
        if self.asked_context is not None and self.asked_context > self.pool_tokens:
            lines.append(
                f"warning: --ctx {self.asked_context} exceeds the {self.pool_tokens}-token KV pool; one sequence "
                f"holds at most {self.context_limit} tokens (free GPU memory or use a smaller model)"
            )
        return lines

    def _image_encoder_lines(self) -> list[str]:
        if not self.image_encoder:
            return []
        return [f"image encoder    {_size(self.image_encoder)}  (weights, and scratch for the largest image)"]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def least_pool_tokens(context: int) -> int:
    """The smallest pool a model runs with: one sequence of MIN_CONTEXT tokens, or of its whole context."""
    return min(MIN_CONTEXT, context)


def check_kv_tokens(kv_tokens: int | None, least: int) -> None:
    """Refuse a `--kv-tokens` below the `least` tokens one sequence needs, naming the option."""
    if kv_tokens is not None and kv_tokens < least:
        raise CmpchatError(
            f"a KV pool of {kv_tokens} tokens holds less than one sequence's {least}; "
            f"raise --kv-tokens to at least {least} or lower --ctx"
        )


def scratch_bytes(config: ModelConfig, batch: int = 16) -> int:
    """Activations of one decode step for `batch` tokens, with room for the widest fused projection."""
    widest = max(
        2 * config.num_heads * config.head_dim + 2 * config.num_kv_heads * config.head_dim,
        config.conv_dim + config.num_v_heads * config.v_head_dim + 2 * config.num_v_heads,
        2 * config.ffn_size,
    )
    per_token = 4 * (4 * config.hidden_size + 2 * widest + config.vocab_size)
    return batch * per_token


def plan_stage(
    config: ModelConfig,
    *,
    weights: int,
    largest_tensor: int,
    budget: int,
    kv_bytes_per_token: int,
    recurrent_bytes_per_sequence: int,
    layers: Sequence[int] | range | None = None,
    kv_layout: str = "f16",
    sequences: int = 1,
    context: int | None = None,
    kv_tokens: int | None = None,
    page_tokens: int = PAGE_TOKENS,
    prompt_scratch: int = 0,
    decode_scratch: int | None = None,
    image_encoder: int = 0,
) -> StagePlan:
    """Fit `weights` bytes and `sequences` recurrent states, then a KV pool of what is left (at most
    `kv_tokens`, and at most `sequences` full contexts), with `prompt_scratch` bytes for the long-prompt step's buffers and the page tables
    (`PromptBuffers.reserved_bytes`, `StepBuffers.page_table_bytes`) and `decode_scratch` for the decode steps'
    buffers (default: one decode group's, `scratch_bytes`), and `image_encoder` bytes for the image encoder."""
    if not 1 <= sequences <= MAX_SEQUENCES:
        raise CmpchatError(f"a GPU holds 1 to {MAX_SEQUENCES} sequence states, not {sequences}")
    layer_range = range(config.num_layers) if layers is None else range(min(layers), max(layers) + 1)
    recurrent = sequences * recurrent_bytes_per_sequence
    model_context = min(context or config.context_length, config.context_length)
    scratch = (scratch_bytes(config) if decode_scratch is None else decode_scratch) + prompt_scratch
    fixed = weights + recurrent + scratch + image_encoder + RESERVE_BYTES
    # No set of sequences reads more than all of them at full context, each in whole pages: a larger pool
    # would only hold memory.
    full_contexts = sequences * -(-model_context // page_tokens) * page_tokens
    if budget <= fixed:
        fits = 0
    else:  # a stage of Gated DeltaNet layers only keeps no KV: the pool's pages cost it nothing
        fits = (budget - fixed) // kv_bytes_per_token if kv_bytes_per_token else full_contexts
    pool = min(fits, full_contexts, kv_tokens or fits)
    pool = pool // page_tokens * page_tokens
    least = least_pool_tokens(model_context)
    check_kv_tokens(kv_tokens, least)
    if pool < least:
        need = fixed + kv_bytes_per_token * least
        images = f", the image encoder {image_encoder / 2**30:.1f} GiB" if image_encoder else ""
        without_images = ", no vision projector" if image_encoder else ""
        raise CmpchatError(
            f"{config.name} needs {need / 2**30:.1f} GiB on the GPU (weights {weights / 2**30:.1f} GiB{images}, "
            f"{sequences} sequence state(s) of {recurrent_bytes_per_sequence / 2**20:.0f} MiB, a KV pool of "
            f"{least} tokens) but {budget / 2**30:.1f} GiB is usable; use a smaller model, fewer sequences "
            f"(--slots, --cache-states){without_images} or a larger card"
        )
    return StagePlan(
        layers=layer_range,
        weights=weights,
        recurrent_state=recurrent,
        sequences=sequences,
        scratch=scratch,
        kv_layout=kv_layout,
        kv_bytes_per_token=kv_bytes_per_token,
        pool_tokens=int(pool),
        page_tokens=page_tokens,
        context_limit=int(min(model_context, pool)),
        asked_context=context,
        host_ram=2 * min(largest_tensor, HOST_CHUNK_BYTES),
        budget=budget,
        image_encoder=image_encoder,
    )
