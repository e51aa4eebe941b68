"""Decode speed of two trees of cmpchat on one GPU, alternated in one run: `cmpchat bench decode` of each, in
turn, `--repeats` times, then the median tok/s of every (model, context, batch) row side by side.

    python3 cuda/decode_ab.py --baseline .baseline --shapes 9B 27B --repeats 3 --results "$OUT"

`--baseline` is a folder holding another tree of the repository (e.g. `git archive <commit> | tar -x -C
.baseline`, carried to the GPU machine); the current tree is this file's repository. Both build their
benchmark files in one folder, so a model file is built once. Run it after `cuda/gpu_run.sh` has installed
the carried wheels (it reads PYTHONPATH from the environment). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_FOLDER = "/tmp/cmpchat-bench"


def bench(tree: Path, shape: str, out: Path, args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable, "-m", "cmpchat", "bench", "decode", shape, "--contexts", *map(str, args.contexts),
        "--batches", *map(str, args.batches), "--tokens", str(args.tokens), "--folder", BENCH_FOLDER, "--json", str(out),
    ]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    print(
        f"  {tree.name or 'tree'} {shape}: exit {result.returncode} in {time.monotonic() - started:.0f} s", flush=True
    )
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:], sep="\n", flush=True)
        return []
    return json.loads(out.read_text())[0]["runs"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["9B"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 4096, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, default=REPO / "out" / "decode-ab")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    trees = {"baseline": args.baseline.resolve(), "current": REPO}
    rates: dict[tuple[str, str, int, int], list[float]] = {}
    for repeat in range(args.repeats):
        for shape in args.shapes:
            for name, tree in trees.items():
                out = args.results / f"{name}-{shape}-{repeat}.json"
                for run in bench(tree, shape, out, args):
                    rates.setdefault((shape, name, run["context"], run["batch"]), []).append(run["tok_s"])
    rows = []
    print(
        f"\n{'model':6} {'context':>7} {'batch':>5} {'baseline':>10} {'current':>10} {'ratio':>7}  (medians of tok/s)"
    )
    for shape in args.shapes:
        keys = sorted({(c, b) for (s, _, c, b) in rates if s == shape}, key=lambda k: (k[1], k[0]))
        for context, batch in keys:
            old = rates.get((shape, "baseline", context, batch), [])
            new = rates.get((shape, "current", context, batch), [])
            if not old or not new:
                continue
            ratio = statistics.median(new) / statistics.median(old)
            rows.append({"shape": shape, "context": context, "batch": batch, "baseline": old, "current": new,
                         "ratio": round(ratio, 4)})  # fmt: skip
            print(f"{shape:6} {context:7d} {batch:5d} {statistics.median(old):10.1f} {statistics.median(new):10.1f} "
                  f"{ratio:7.3f}")  # fmt: skip
    (args.results / "decode_ab.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
