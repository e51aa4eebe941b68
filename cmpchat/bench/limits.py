"""What a decode step must read, and the speed limit that sets on a GPU of a given read bandwidth.

Decode is bound by memory bandwidth: every weight byte is read once per step, plus each sequence's KV
cache up to its context and its recurrent state (read and written back). The limit is those bytes divided
by the streaming-read bandwidth measured on the same GPU in the same run; a kernel or a whole step is then
judged by its ratio to that limit, which carries over from one GPU to another.
"""

from __future__ import annotations

from dataclasses import dataclass

from cmpchat.model.config import ModelConfig
from cmpchat.model.gguf_file import ModelFile

CMP_READ_BANDWIDTH = 818e9
"""Bytes/s a CMP 100-210 streams from its HBM2 (docs/hardware.md, "The CMP 100-210"), for the labelled projections."""

PUBLISHED_CMP_9B_DECODE = {"llama.cpp": 46.6, "qengine": 70.4}
"""Published tok/s of 9B Q8_0 decode on one CMP 100-210 (the decode-speed issue), printed beside ours."""


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step reads, by source."""

    weights: int
    kv_cache: int
    recurrent_state: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.recurrent_state


def weight_bytes_per_step(model_file: ModelFile, config: ModelConfig) -> int:
    """Every main-layer tensor and the LM head (the tied embedding when there is no output.weight); the
    embedding lookup reads one row per token, which is left out."""
    total = 0
    for name, info in model_file.tensors.items():
        layer = name.split(".")[1] if name.startswith("blk.") else None
        if layer is not None and int(layer) < config.num_layers:
            total += info.n_bytes
        elif name == "output.weight" or (config.tied_embeddings and name == "token_embd.weight"):
            total += info.n_bytes
        elif name == "output_norm.weight":
            total += info.n_bytes
    return total


def step_bytes(weights: int, config: ModelConfig, context: int, batch: int = 1) -> StepBytes:
    """Bytes a step of `batch` sequences, each `context` tokens long, reads (fp16 KV cache)."""
    return StepBytes(
        weights=weights,
        kv_cache=batch * context * config.kv_bytes_per_token(),
        recurrent_state=batch * 2 * config.recurrent_state_bytes(),
    )


def limit_tokens_per_second(read_bandwidth: float, bytes_per_step: int, batch: int = 1) -> float:
    """Tokens/s if every step ran at the streaming-read bandwidth (batch tokens per step)."""
    return batch * read_bandwidth / bytes_per_step


def cmp_projection(ratio: float, bytes_per_step: int, batch: int = 1) -> float:
    """Tokens/s on a CMP 100-210 if it reached the same ratio of its own limit (information only)."""
    return ratio * limit_tokens_per_second(CMP_READ_BANDWIDTH, bytes_per_step, batch)
