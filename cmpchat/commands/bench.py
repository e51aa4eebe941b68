"""`cmpchat bench decode|prefill`: decode tok/s on this GPU against the limit its read bandwidth sets, and
prompt tok/s by prompt length; both beside llama.cpp on the same file when given its llama-bench.

    cmpchat bench decode 9B 27B --llama-bench ./run-llama-bench.sh
    cmpchat bench decode 9B --mix Q8_0 Q4_K_M
    cmpchat bench prefill 9B --tokens 297 1160 4620

A MODEL is a released size (0.8B, 2B, 4B, 9B, 27B: a file with those exact tensor shapes, random weights in
each `--mix` (Q8_0, or llama.cpp's Q4_K_M / Q5_K_M type mix) and the real tokenizer is built once in the cache
folder, and llama.cpp can load it too) or a path to a GGUF file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cmpchat.bench.model_files import BENCH_SHAPES, bench_model_path
from cmpchat.commands.model_args import gpu_memory, int_list
from cmpchat.commands.progress import StderrProgress
from cmpchat.cudart.target import add_profile_option, apply_profile_option
from cmpchat.errors import CmpchatError
from cmpchat.model.builder import MIXES
from cmpchat.paths import cache_dir

if TYPE_CHECKING:
    from cmpchat.bench.report import DecodeReport


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="measure decode speed on the GPU", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    decode = kinds.add_parser("decode", help="decode tok/s by context and batch size, with a kernel profile")
    decode.add_argument("models", nargs="*", default=["9B"], metavar="MODEL",
                        help=f"a released size ({', '.join(BENCH_SHAPES)}) or a GGUF file (default: 9B)")  # fmt: skip
    decode.add_argument("--contexts", type=int, nargs="+", default=[0, 4096, 32768], metavar="N")
    decode.add_argument("--batches", type=int, nargs="*", default=[4, 16], metavar="B",
                        help="batched runs (aggregate tok/s) at the first context")  # fmt: skip
    decode.add_argument("--tokens", type=int, default=128, help="timed steps per run (default 128)")
    _add_mix_option(decode)
    decode.add_argument("--folder", type=Path, help="where benchmark files are built (default: the cache folder)")
    decode.add_argument("--structured", action="store_true",
                        help="add a batch-1 run at the first context whose reply follows a JSON schema "
                        "(what structured output costs)")  # fmt: skip
    decode.add_argument("--llama-bench", type=Path, metavar="PATH", help="llama.cpp's llama-bench, to compare")
    decode.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    decode.add_argument("--gpus", metavar="LIST", help="pipeline stages' GPUs, e.g. 0,0,0 (three stages on GPU 0): "
                        "adds each stage's time and a projection to one CMP card per stage")  # fmt: skip
    decode.add_argument("--gpu-mem", metavar="SIZE", help="memory per stage, e.g. 16G (emulates smaller cards)")
    add_profile_option(decode)
    decode.set_defaults(handler=run_decode_bench)
    prefill = kinds.add_parser("prefill", help="prompt tok/s by prompt length")
    prefill.add_argument("models", nargs="*", default=["9B"], metavar="MODEL",
                         help=f"a released size ({', '.join(BENCH_SHAPES)}) or a GGUF file (default: 9B)")  # fmt: skip
    prefill.add_argument("--tokens", type=int, nargs="+", default=[297, 1160, 4620, 18440, 65536], metavar="N",
                         help="prompt lengths (default 297 1160 4620 18440 65536)")  # fmt: skip
    prefill.add_argument("--folder", type=Path, help="where benchmark files are built (default: the cache folder)")
    _add_mix_option(prefill)
    prefill.add_argument("--llama-bench", type=Path, metavar="PATH", help="llama.cpp's llama-bench, to compare")
    prefill.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    prefill.add_argument("--gpus", metavar="LIST", help="pipeline stages' GPUs, e.g. 0,0,0 (three stages on GPU 0): "
                         "adds each stage's time and a projection to one CMP card per stage")  # fmt: skip
    prefill.add_argument("--gpu-mem", metavar="SIZE", help="memory per stage, e.g. 16G (emulates smaller cards)")
    add_profile_option(prefill)
    prefill.set_defaults(handler=run_prefill_bench)


def _add_mix_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mix", nargs="+", choices=list(MIXES), default=["Q8_0"], metavar="MIX",
                        help=f"weight types of the files built for released sizes: {', '.join(MIXES)} "
                        "(llama.cpp's type mixes; default Q8_0); each size runs in each mix")  # fmt: skip


def bench_runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(model, mix) of every run: each released size in each mix, a path once."""
    return [(name, mix) for name in args.models for mix in (args.mix if name in BENCH_SHAPES else ["Q8_0"])]


def _require_gpu() -> None:
    from cmpchat.backends.gpu.device import cuda_gpu_present

    if not cuda_gpu_present():
        raise CmpchatError("cmpchat bench needs an NVIDIA GPU with a working driver; none is usable here")


def run_prefill_bench(args: argparse.Namespace) -> int:
    apply_profile_option(args)  # before any kernel is defined (cudart/target.py)
    _require_gpu()
    if any(n < 1 for n in args.tokens):
        raise CmpchatError("prompt lengths must be >= 1")
    folder = args.folder or cache_dir() / "bench"
    results = [_prefill_one(name, mix, folder, args) for name, mix in bench_runs(args)]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _prefill_one(name: str, mix: str, folder: Path, args: argparse.Namespace) -> dict:
    from cmpchat.backends.gpu.model import CudaBackend, CudaSequence
    from cmpchat.bench.llama_cpp import prompt_command, run_llama_bench
    from cmpchat.bench.prefill import PrefillRates, run_prefill
    from cmpchat.bench.report import format_prefill, prefill_json
    from cmpchat.cudart.profile import profile_launches
    from cmpchat.kernels.throughput_probes import DP4A_PROBE, OPS_PER_DP4A, compute_rate, streaming_read_bandwidth
    from cmpchat.model.gguf_file import ModelFile

    progress = StderrProgress()
    try:
        path = bench_model_path(name, folder, progress, mix=mix)
        _say(f"{path.name}: measuring streaming-read bandwidth and the dp4a rate")
        rates = PrefillRates(streaming_read_bandwidth(), compute_rate(DP4A_PROBE) / OPS_PER_DP4A)
        backend = CudaBackend(ModelFile(path), context=max(args.tokens) + 64, progress=progress,
                              gpus=int_list(args.gpus, "--gpus"), gpu_mem=gpu_memory(args.gpu_mem))  # fmt: skip
    finally:
        progress.close()

    def profile_step(sequence: CudaSequence) -> list[tuple[Sequence[str], Sequence[float]]]:
        """Each stage's long-prompt step, timed alone (stages on one GPU would contend if run at once)."""
        profiles: list[tuple[Sequence[str], Sequence[float]]] = []
        for index, stage in enumerate(backend.stages):
            with stage.on_device():
                launches = backend.prompt_step_launches(sequence, index)
                timings = profile_launches(launches, stage.stream, early_launch=stage.early_launch)
            profiles.append((timings.names, timings.attributed()))
        return profiles

    _say(f"{path.name}: prompts of {args.tokens} tokens")
    runs = run_prefill(backend, args.tokens, say=_say, profile_step=profile_step)
    gpu = backend.gpu.name
    backend.close()  # its GPU memory goes back before llama.cpp loads the file
    _free_gpu_memory()
    llama = []
    if args.llama_bench:
        _say(f"  llama-bench pp at {args.tokens}")
        try:
            llama = run_llama_bench(prompt_command(args.llama_bench, path, args.tokens))
        except CmpchatError as error:
            _say(f"  no llama.cpp comparison: {error}")
    shape = name if name in BENCH_SHAPES else None
    print("\n".join(format_prefill(path.name, gpu, runs, llama, shape, rates)), flush=True)
    return prefill_json(path.name, gpu, runs, llama, shape, rates)


def run_decode_bench(args: argparse.Namespace) -> int:
    apply_profile_option(args)  # before any kernel is defined (cudart/target.py)
    _require_gpu()
    if any(c < 0 for c in args.contexts) or args.tokens < 1 or any(not 1 <= b <= 16 for b in args.batches):
        raise CmpchatError("contexts must be >= 0, --tokens >= 1 and batches 1..16")
    folder = args.folder or cache_dir() / "bench"
    reports = [_bench_one(name, mix, folder, args) for name, mix in bench_runs(args)]
    if args.json:
        from cmpchat.bench.report import decode_json

        args.json.write_text(json.dumps([decode_json(r) for r in reports], indent=1))
    return 0


def _bench_one(name: str, mix: str, folder: Path, args: argparse.Namespace) -> DecodeReport:
    from cmpchat.backends.gpu.model import CudaBackend
    from cmpchat.bench.decode import WARMUP_STEPS, run_decode
    from cmpchat.bench.limits import weight_bytes_per_step
    from cmpchat.bench.llama_cpp import decode_command, run_llama_bench
    from cmpchat.bench.report import DecodeReport, format_decode
    from cmpchat.cudart.raw_launch import early_launch_allowed
    from cmpchat.kernels.throughput_probes import streaming_read_bandwidth
    from cmpchat.model.config import ModelConfig
    from cmpchat.model.gguf_file import ModelFile
    from cmpchat.tokenizer import Tokenizer

    progress = StderrProgress()
    try:
        path = bench_model_path(name, folder, progress, mix=mix)
    finally:
        progress.close()
    model_file = ModelFile(path)
    config = ModelConfig.from_model_file(model_file)
    margin = args.tokens + WARMUP_STEPS + 2  # the generated tokens
    slots = max([1, *args.batches])
    progress = StderrProgress()
    try:
        backend = CudaBackend(model_file, config, sequences=slots, saved_states=2,
                              context=max(args.contexts) + margin, progress=progress,
                              gpus=int_list(args.gpus, "--gpus"), gpu_mem=gpu_memory(args.gpu_mem))  # fmt: skip
        backend.warm_up(progress, max_rows=slots)
    finally:
        progress.close()
    for line in backend.describe():
        _say(line)
    pool = backend.pool.total_tokens
    contexts = [c for c in args.contexts if c + margin <= backend.context_limit]
    batches = [
        b
        for b in args.batches
        if contexts and b * backend.pool.pages_for(contexts[0] + margin) < backend.pool.total_pages
    ]
    for skipped in sorted(set(args.contexts) - set(contexts)):
        _say(f"{path.name}: context {skipped} does not fit the {backend.context_limit}-token context here; skipped")
    for skipped in sorted(set(args.batches) - set(batches)):
        _say(f"{path.name}: {skipped} sequences do not fit the {pool}-token KV pool here; skipped")
    if not contexts:
        raise CmpchatError(f"{path.name}: none of the requested runs fits on this GPU")
    _say(f"{path.name}: measuring streaming-read bandwidth")
    bandwidth = streaming_read_bandwidth()  # as `cmpchat doctor` measures it
    weights = weight_bytes_per_step(model_file, config)
    tokenizer = Tokenizer.from_metadata(model_file.metadata)
    runs = run_decode(backend, tokenizer, weights, bandwidth, contexts, batches, args.tokens, _say, args.structured)
    gpu = backend.gpu.name
    early = backend.early_launch and early_launch_allowed()  # what the step's graphs were bound with
    del backend
    _free_gpu_memory()  # before llama.cpp loads the file
    llama = []
    if args.llama_bench:
        _say(f"  llama-bench tg{args.tokens} at contexts {contexts}")
        try:
            llama = run_llama_bench(decode_command(args.llama_bench, path, contexts, args.tokens))
        except CmpchatError as error:  # our figures still stand; the comparison is missing, and says why
            _say(f"  no llama.cpp comparison: {error}")
    shape = name if name in BENCH_SHAPES else None
    report = DecodeReport(path.name, gpu, bandwidth, runs, llama, shape=shape, early_launch=early)
    print("\n".join(format_decode(report)), flush=True)
    return report


def _free_gpu_memory() -> None:
    import gc

    from numba import cuda

    gc.collect()
    cuda.current_context().deallocations.clear()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
