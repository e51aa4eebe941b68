"""Decode speed of the CUDA backend on random Q8_0 models of the released shapes (GPU machine).

    python3 cuda/bench_decode.py [9B 27B ...] [--tokens 64] [--folder /tmp/cmpchat-bench]

Builds each model file once with the project's builder (same tensor shapes as the released models, random
weights, the real tokenizer), loads it on GPU 0, decodes greedily with CUDA-graph replay at batch 1 and
prints tok/s beside the limit set by the GPU's streaming-read bandwidth measured in the same run:
limit = bytes read per token (every layer weight once + the LM head) / read bandwidth. The full
`cmpchat bench` command (contexts, kernel families, llama.cpp) is the decode-speed issue's work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cmpchat.backends.cuda.model import CudaBackend  # noqa: E402
from cmpchat.cuda.kernels.gemv_bench import read_bandwidth  # noqa: E402
from cmpchat.generation.sampling import SamplingParams  # noqa: E402
from cmpchat.model.builder import MODEL_SHAPES, build_model  # noqa: E402
from cmpchat.model.gguf_file import ModelFile  # noqa: E402
from cmpchat.vocab import qwen35_vocabulary  # noqa: E402


def decode_bytes(model_file: ModelFile, tied: bool) -> int:
    """Weight bytes one decode step reads: every main-layer tensor and the LM head, not the embedding."""
    total = 0
    for name, info in model_file.tensors.items():
        if name.startswith("blk."):
            total += info.n_bytes
        elif name == "output.weight" or (tied and name == "token_embd.weight"):
            total += info.n_bytes
    return total


def bench(shape_name: str, folder: Path, tokens: int) -> dict:
    path = folder / f"random-qwen35-{shape_name}-q8_0.gguf"
    if not path.exists():
        started = time.perf_counter()
        build_model(path, MODEL_SHAPES[shape_name], add_tokenizer=qwen35_vocabulary().add_to_gguf, chat_template=None)
        print(f"built {path.name} in {time.perf_counter() - started:.0f} s", flush=True)
    model_file = ModelFile(path)
    started = time.perf_counter()
    backend = CudaBackend(model_file, context=8192)
    load_s = time.perf_counter() - started
    sequence = backend.new_sequence()
    logits = backend.prefill(sequence, [1, 2, 3, 4])
    greedy, rng, history = SamplingParams(), np.random.default_rng(0), [1, 2, 3, 4]

    def step(logits: object) -> object:
        token = backend.sample(logits, [greedy], [history], [rng])[0]  # on the GPU; one id comes back
        return backend.decode([sequence], [token])

    for _ in range(8):  # warm-up: compile, capture the graphs
        logits = step(logits)
    started = time.perf_counter()
    for _ in range(tokens):
        logits = step(logits)
    backend.stream.synchronize()
    seconds = time.perf_counter() - started
    bandwidth = read_bandwidth() * 1e9  # bytes/s
    config = backend.config
    per_token = decode_bytes(model_file, config.tied_embeddings)
    tok_s = tokens / seconds
    limit = bandwidth / per_token
    return {
        "shape": shape_name,
        "decode_tok_s": round(tok_s, 1),
        "bytes_per_token": per_token,
        "read_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "limit_tok_s": round(limit, 1),
        "ratio_of_limit": round(tok_s / limit, 3),
        "load_s": round(load_s, 1),
        "gpu": backend.gpu.name,
        "note": "batch 1, context < 100 tokens, greedy selection on the GPU, CUDA-graph replay",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["9B"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/cmpchat-bench"))
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    results = [bench(name, args.folder, args.tokens) for name in args.shapes]
    text = json.dumps(results, indent=1)
    print(text)
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "bench_decode.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
