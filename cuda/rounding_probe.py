"""How far the CUDA backend's own read paths differ on a model: long prompt steps, 16-row chunks, one-row decode
and a row of a 4-row decode, at the last token of the engine marks' growing prompts. Prints each difference as
a share of the largest |logit| beside the top-2 gap, for the demo model and a benchmark shape.

    python3 cuda/rounding_probe.py [--shape 9B] [--json FILE]      # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from engine_marks import prompt_tokens  # noqa: E402

from cmpchat.backends.gpu.model import CudaBackend  # noqa: E402
from cmpchat.bench.model_files import bench_model_path  # noqa: E402
from cmpchat.demo import ensure_demo_model  # noqa: E402
from cmpchat.evaluation.agreement import read_paths  # noqa: E402
from cmpchat.model.gguf_file import ModelFile  # noqa: E402
from cmpchat.tokenizer import Tokenizer  # noqa: E402


def probe(path: Path, seeds: list[int], length: int) -> list[dict]:
    model_file = ModelFile(path)
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    gpu = CudaBackend(model_file, sequences=4, context=4096)
    results = []
    prompts = [prompt_tokens(tokenizer, length, seed) for seed in seeds]
    for seed, prompt in zip(seeds, prompts):
        long_steps, chunks, one_row = read_paths(gpu, prompt)
        others = [p for p in prompts if p is not prompt][:3]
        seqs = [gpu.new_sequence() for _ in range(4)]
        for q, p in zip(seqs, [prompt, *others]):
            gpu.prefill(q, p[:-1])
        four = gpu.to_host(gpu.decode(seqs, [p[-1] for p in [prompt, *others]]))[0]
        for q in seqs:
            gpu.release(q)
        scale = float(np.abs(long_steps).max())
        top2 = np.sort(long_steps)[-2:]
        row = {
            "model": path.name, "seed": seed, "max_abs_logit": round(scale, 3),
            "top2_gap_share": float((top2[1] - top2[0]) / scale),
            "chunks_vs_long": float(np.abs(chunks - long_steps).max() / scale),
            "one_row_vs_long": float(np.abs(one_row - long_steps).max() / scale),
            "four_rows_vs_one_row": float(np.abs(four - one_row).max() / scale),
            "argmax": [int(x.argmax()) for x in (long_steps, chunks, one_row, four)],
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="9B")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/cmpchat-bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seeds = [11 * i + 3 for i in (6, 10, 0, 1)]
    rows = probe(ensure_demo_model(), seeds, 300)
    args.folder.mkdir(parents=True, exist_ok=True)
    rows += probe(bench_model_path(args.shape, args.folder), seeds, 300)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
