"""Arguments and model opening shared by the commands that load a model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cmpchat.api import BACKENDS, Model, open_model
from cmpchat.backends.gpu.device import parse_size
from cmpchat.commands.progress import StderrProgress
from cmpchat.demo import DEMO_NOTICE
from cmpchat.errors import CmpchatError
from cmpchat.kv_formats import FORMATS
from cmpchat.long_lived import freeze_loaded


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", metavar="MODEL", help="GGUF model file (default: the built-in demo model)")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="compute backend (default: auto = cuda when a GPU is usable)",
    )
    add_load_arguments(parser)
    parser.add_argument(
        "--mmproj", metavar="FILE", help="vision projector (default: the mmproj file beside the model, if any)"
    )
    parser.add_argument("--eager", action="store_true", help="launch GPU kernels one by one (debugging)")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """How a model is laid out on this machine's GPUs and how much context it gets (`load_options` reads them)."""
    parser.add_argument(
        "--gpu-mem",
        metavar="SIZE",
        help="GPU memory each stage may use, e.g. 16G (emulates a smaller card), or one per stage: 16G,16G,12G",
    )
    parser.add_argument(
        "--gpus",
        metavar="LIST",
        help="the GPU of each pipeline stage, e.g. 0,1,2 (repeats allowed: 0,0 is two stages on GPU 0; "
        "default: the fewest GPUs that hold the model and --ctx)",
    )
    parser.add_argument(
        "--split", metavar="LIST", help="layers per stage, e.g. 22,22,20 (default: the largest KV pool, then even)"
    )
    parser.add_argument("--ctx", type=int, metavar="N", help="most tokens of context per conversation")
    parser.add_argument(
        "--kv-tokens", type=int, metavar="N", help="most tokens the shared KV cache holds (default: what fits)"
    )
    add_kv_argument(parser, "(default: f16 on the GPU, fp32 on the CPU)")


def add_kv_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """The `--kv FORMAT` option; `default` says what its absence means."""
    parser.add_argument(
        "--kv", choices=list(FORMATS), metavar="FORMAT", help="KV cache format: " + ", ".join(FORMATS) + f" {default}"
    )


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """`open_model`'s keyword arguments from `add_load_arguments`' options: only those given."""
    options = {
        "gpu_mem": gpu_memory(args.gpu_mem),
        "gpus": int_list(args.gpus, "--gpus"),
        "split": int_list(args.split, "--split"),
        "context": args.ctx,
        "kv_tokens": args.kv_tokens,
        "kv": args.kv,
    }
    return {name: value for name, value in options.items() if value is not None}


def open_from_args(
    args: argparse.Namespace,
    *,
    sequences: int = 1,
    cache_states: int = 4,
    max_waiting: int = 64,
    prefill_chunk: int = 512,
) -> Model:
    """Open the model the arguments name, with `open_model`'s engine options (replies decoded together, states
    kept for reuse, requests queued, prompt tokens read between decode steps)."""
    progress = StderrProgress()
    try:
        model = open_model(
            args.model,
            backend=args.backend,
            mmproj=args.mmproj,
            use_graphs=not args.eager,
            progress=progress,
            sequences=sequences,
            cache_states=cache_states,
            max_waiting=max_waiting,
            prefill_chunk=prefill_chunk,
            **load_options(args),
        )
    finally:
        progress.close()
    freeze_loaded()
    if model.is_demo:
        print(f"note: {DEMO_NOTICE}", file=sys.stderr)
    for line in model.backend.describe():
        print(line, file=sys.stderr)
    return model


def gpu_memory(text: str | None) -> int | list[int | None] | None:
    """--gpu-mem: one size for every stage, or a comma-separated size per stage."""
    if text is None:
        return None
    sizes = [parse_size(part) for part in text.split(",")]
    return sizes[0] if len(sizes) == 1 else list(sizes)


def int_list(text: str | None, option: str) -> list[int] | None:
    """A comma-separated list of non-negative integers (`--gpus 0,1,2`, `--split 22,22,20`)."""
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise CmpchatError(f"{option} takes numbers separated by commas, e.g. 0,1,2; not '{text}'") from None
    if any(value < 0 for value in values):
        raise CmpchatError(f"{option} takes numbers of 0 or more, not '{text}'")
    return values
