"""The CMP code path on this GPU (`cmpchat/cudart/target.py`), checked: what compiled and where it ran, then
teacher-forced logits against the GPU's own code path.

    python3 cuda/cmp_path_check.py probe [--json FILE]            # in this process's profile (CMPCHAT_PROFILE)
    python3 cuda/cmp_path_check.py compare [--models oracle 9B] [--steps 64] [--folder DIR] [--results DIR]
    python3 cuda/cmp_path_check.py side-by-side NATIVE.json CMP.json    # `cmpchat bench --json` files

`probe` prints which NVVM compiled a kernel and for which target (the PTX's header and `.target`), whether early
launch is off (the tuning row, the launcher, and `launched_early_here()` read back from the GPU), the SMs the engine
sizes its grids for and the SMs launches ran on (raw, graph replay, Numba's own launch: each block records its
`%smid`), each stage's memory cap and the streaming-read bandwidth measured in this mode.

`compare` runs, each in its own process: `probe` in the CMP profile, then teacher-forced logits (an 8-token prompt,
then `--steps` decode steps each fed the next token of a fixed sequence, through the engine's graphs; and the
last row of a 300-token prompt, which runs a long-prompt GEMM step) on each model in three code paths: the GPU's
own (native), the CMP's, and the native one with its grids sized for 68 SMs (`CMPCHAT_SM_COUNT=68`, the control:
only summation orders change). Pass marks, per position, |logit difference| / max |logit| against native:

- the oracle model with real head sizes (tests/fixtures/oracle/real_heads.q8_0.gguf): at most 1e-3 (median and
  max), the GPU tier's bound for it (tests/backends/test_cuda_backend_gpu.py);
- the 9B shape (random Q8_0 weights, the released tensor shapes): median at most 2 x the control's median + 1e-4,
  max at most 2 x the control's max + 1e-3 (a random-weight network amplifies every int8 rounding that a
  summation order flips; the control measures how much on this model, the calibration the GPU tier uses for its
  demo model);
- greedy tokens equal wherever native's top-2 margin exceeds twice the max bound (in logits: 2 x bound x the
  position's max |logit|), since each of the two logits may move by the bound.

Writes `cmp_check.json` (and `probe_*.json`) to `--results` ($OUT on the device tool); exit status 1 if a mark
fails. The parent reads the children's logits with numpy and imports cmpchat only to build a benchmark file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORACLE = REPO / "tests" / "fixtures" / "oracle"
BENCH_FOLDER = "/tmp/cmpchat-bench"
PROFILES = {
    "native": {},
    "cmp": {"CMPCHAT_PROFILE": "cmp"},
    "control": {"CMPCHAT_SM_COUNT": "68"},
}
"""The code paths `compare` runs, as the environment each child gets on top of a clean one."""
PROFILE_VARIABLES = ("CMPCHAT_PROFILE", "CMPCHAT_SM_COUNT", "CMPCHAT_TUNING", "CMPCHAT_EARLY_LAUNCH",
                     "NUMBA_FORCE_CUDA_CC", "NUMBA_CACHE_DIR")  # fmt: skip
"""What a profile sets: removed from the parent's environment before each child's own is added."""
ORACLE_BOUND = 1e-3
PROMPT_TOKENS = 8
LONG_PROMPT = 300
SLEEP_NS = 200_000
PROBE_BLOCKS = 4096


# --- probe (a child in one profile) ------------------------------------------------------------------------------


def _sm_probe_kernel():  # type: ignore[no-untyped-def]
    """A Numba kernel, compiled like the engine's: each block's first thread stores its `%smid`, block 0 also
    `launched_early_here()` and exp(x) (a libdevice call), then every thread sleeps so later blocks must go to
    other SMs."""
    import math as device_math

    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda.extending import intrinsic

    from cmpchat.cudart.intrinsics import launched_early_here

    @intrinsic
    def sm_id(typingctx):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), []), "mov.u32 $0, %smid;", "=r", side_effect=True)
            return builder.call(asm, [])

        return types.uint32(), codegen

    @intrinsic
    def nanosleep(typingctx, ns):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(32)]), "nanosleep.u32 $0;", "r",
                               side_effect=True)  # fmt: skip
            builder.call(asm, args)
            return context.get_dummy_value()

        return types.none(types.uint32), codegen

    @cuda.jit
    def sm_probe(out, flags, x, sleep_ns):  # type: ignore[no-untyped-def]
        block = cuda.blockIdx.x
        if cuda.threadIdx.x == 0:
            out[block] = sm_id()
            if block == 0:
                flags[0] = 1 if launched_early_here() else 0
                x[0] = device_math.exp(x[0])
        nanosleep(sleep_ns)

    return sm_probe


def _ptx_facts(ptx: str) -> dict:
    lines = ptx.splitlines()
    release = next((line.strip("/ ").strip() for line in lines if "Cuda compilation tools" in line), None)
    return {
        "nvvm_release": release,
        "ptx_version": next((line.split()[1] for line in lines if line.startswith(".version")), None),
        "ptx_target": next((line.split()[1] for line in lines if line.startswith(".target")), None),
        "griddepcontrol": ptx.count("griddepcontrol"),
    }


def _linked_ptx(kernel) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """The PTX the kernel's module was linked from, and the cache key (the device's cc) it was linked under."""
    library = kernel._codelibrary
    cache = getattr(library, "_ptx_cache", {})
    if cache:
        key, ptxes = next(iter(cache.items()))
        return "\n".join(ptxes), str(key)
    return library.get_asm_str(), "compiled on request"


def _driver_multiprocessors() -> int:
    from cuda.bindings import driver

    from cmpchat.cudart.driver_api import check

    attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(attribute, 0)))


def _linker_backend() -> str | None:
    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode

        from cmpchat.cudart.target import SM_IDS_PTX

        linker = Linker(ObjectCode.from_ptx(SM_IDS_PTX), options=LinkerOptions(arch="sm_90"))
        return str(getattr(linker, "backend", None))
    except Exception as error:  # informative only
        return f"unknown ({type(error).__name__})"


def probe(json_path: Path | None) -> dict:
    import numpy as np
    from numba import cuda
    from numba.cuda.core import sigutils

    from cmpchat.backends.gpu.device import gpu_info, stage_budgets
    from cmpchat.cudart import target
    from cmpchat.cudart.discovery import import_kernel_modules, registered_kernels
    from cmpchat.cudart.graph import LaunchGraph
    from cmpchat.cudart.launch import Launch
    from cmpchat.cudart.raw_launch import RawLaunch, early_launch_allowed
    from cmpchat.kernels.device_table import default_tuning
    from cmpchat.kernels.throughput_probes import streaming_read_bandwidth

    target.activate()
    info = gpu_info(0)  # makes Numba's context: the green context under the CMP profile
    facts: dict = {"code_path": target.status(), "describe": target.describe()}
    tuning = default_tuning(info)
    facts["gpu"] = {"name": info.name, "compute_capability": list(info.compute_capability),
                    "engine_multiprocessors": info.multiprocessors,
                    "numba_multiprocessors": int(cuda.get_current_device().MULTIPROCESSOR_COUNT),
                    "driver_multiprocessors": _driver_multiprocessors(),
                    "free_bytes": info.free_bytes, "total_bytes": info.total_bytes,
                    "one_stage_budget_bytes": stage_budgets([info], None)[0],
                    "three_stage_budget_bytes": stage_budgets([info] * 3, None)}  # fmt: skip
    facts["early_launch"] = {"tuning_row": tuning.name, "row_early_launch": tuning.early_launch,
                             "launches_early": tuning.launches_early(info), "launcher_allows": early_launch_allowed()}  # fmt: skip

    kernel = _sm_probe_kernel()
    stream = cuda.stream()
    out = cuda.device_array(PROBE_BLOCKS, np.uint32)
    flags = cuda.to_device(np.full(1, 7, np.int32))
    x = cuda.to_device(np.ones(1, np.float32))
    launch = Launch(kernel, PROBE_BLOCKS, 32, (out, flags, x, np.uint32(SLEEP_NS)))
    seen = {}
    for how in ("numba", "raw", "graph"):
        out.copy_to_device(np.full(PROBE_BLOCKS, 0xFFFFFFFF, np.uint32), stream=stream)
        if how == "numba":
            launch.run(stream)
        elif how == "raw":
            RawLaunch(launch)(stream)
        else:
            graph = LaunchGraph.capture([launch], stream)
            graph.replay(stream)
        stream.synchronize()
        ids = set(out.copy_to_host().tolist())
        seen[how] = len(ids - {0xFFFFFFFF}) if 0xFFFFFFFF not in ids else f"blocks missing: {sorted(ids)[:4]}"
    facts["sms_used"] = seen
    facts["early_launch"]["launched_early_here_on_gpu"] = bool(flags.copy_to_host()[0])
    ptx, key = _linked_ptx(next(iter(kernel.overloads.values())))
    facts["probe_kernel_ptx"] = {"linked_under": key, **_ptx_facts(ptx)}

    _, failed = import_kernel_modules()
    early = [spec for spec in registered_kernels() if spec.early_launch]
    if early and not failed:
        spec = early[0]
        argtypes, _ = sigutils.normalize_signature(spec.signatures[0])
        compiled = spec.dispatcher.compile(tuple(argtypes))
        ptx, key = _linked_ptx(compiled)
        facts["early_launch_kernel_ptx"] = {"kernel": f"{spec.module}.{spec.name}", "linked_under": key,
                                            **_ptx_facts(ptx)}  # fmt: skip
    facts["import_failures"] = failed
    facts["linker_backend"] = _linker_backend()
    facts["read_bandwidth_GBps"] = round(streaming_read_bandwidth() / 1e9, 1)
    for line in facts["describe"]:
        print(line)
    print(json.dumps({k: v for k, v in facts.items() if k not in ("describe",)}, indent=1), flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps(facts, indent=1))
    return facts


def probe_problems(facts: dict, profile: str) -> list[str]:
    """What contradicts the profile in a probe's facts (empty when it all holds)."""
    problems = []
    ptx = facts.get("probe_kernel_ptx", {})
    used = facts.get("sms_used", {})
    early = facts.get("early_launch", {})
    if profile == "cmp":
        if ptx.get("ptx_target") != "sm_70":
            problems.append(f"the probe kernel's PTX targets {ptx.get('ptx_target')}, not sm_70")
        if not str(ptx.get("nvvm_release", "")).startswith("Cuda compilation tools, release 12."):
            problems.append(f"the PTX came from {ptx.get('nvvm_release')}, not CUDA 12's NVVM")
        if any(early.get(k) for k in ("row_early_launch", "launches_early", "launcher_allows",
                                      "launched_early_here_on_gpu")):  # fmt: skip
            problems.append(f"early launch is not off: {early}")
        if facts.get("early_launch_kernel_ptx", {}).get("griddepcontrol"):
            problems.append("an early-launch kernel's compute_70 PTX holds griddepcontrol")
        if facts.get("gpu", {}).get("engine_multiprocessors") != 68:
            problems.append(f"the engine sizes grids for {facts.get('gpu', {}).get('engine_multiprocessors')} SMs")
        partition: dict = next(iter(facts.get("code_path", {}).get("partitions", {}).values()), {})
        granted = partition.get("granted")
        if granted is not None and any(not isinstance(n, int) or n > granted for n in used.values()):
            problems.append(f"launches ran on more SMs than the {granted}-SM partition: {used}")
    if any(not isinstance(n, int) for n in used.values()):
        problems.append(f"the SM probe's blocks did not all run: {used}")
    return problems


# --- logits (a child in one profile) ------------------------------------------------------------------------------


def logits(model: Path, steps: int, out: Path) -> None:
    import numpy as np

    from cmpchat.backends.gpu.model import CudaBackend
    from cmpchat.cudart import target
    from cmpchat.model.gguf_file import ModelFile

    target.activate()
    backend = CudaBackend(ModelFile(model), sequences=2, context=1024)
    vocab = backend.config.vocab_size
    rng = np.random.default_rng(34)
    forced = rng.integers(0, vocab, PROMPT_TOKENS + steps).tolist()
    long_prompt = rng.integers(0, vocab, LONG_PROMPT).tolist()
    sequence = backend.new_sequence()
    rows = [backend.to_host(backend.prefill(sequence, forced[:PROMPT_TOKENS]))[0]]
    for token in forced[PROMPT_TOKENS:]:
        rows.append(backend.to_host(backend.decode([sequence], [token]))[0])
    backend.release(sequence)
    sequence = backend.new_sequence()
    prompt_last = backend.to_host(backend.prefill(sequence, long_prompt))[0]
    backend.release(sequence)
    meta = {"gpu": backend.gpu.name, "multiprocessors": backend.gpu.multiprocessors, "tuning": backend.tuning.name,
            "early_launch": bool(backend.early_launch), "code_path": target.status()}  # fmt: skip
    np.savez(out, decode=np.stack(rows).astype(np.float32), prompt_last=prompt_last.astype(np.float32),
             tokens=np.array(forced), meta=json.dumps(meta))  # fmt: skip
    print(f"{model.name}: {len(rows)} rows, {meta}", flush=True)


def child(args: argparse.Namespace) -> int:
    facts = probe(args.json) if args.probe else None
    for model, out in zip(args.model, args.out, strict=True):
        logits(Path(model), args.steps, Path(out))
    return 0 if facts is None or not probe_problems(facts, args.profile) else 1


# --- compare (the parent: numpy only) -----------------------------------------------------------------------------


def per_position(got, expected):  # type: ignore[no-untyped-def]
    import numpy as np

    return np.abs(got - expected).max(axis=-1) / np.abs(expected).max(axis=-1)


def judge(name: str, runs: dict, oracle: bool) -> dict:
    """The pass marks for one model (see the module docstring), from each profile's npz."""
    import numpy as np

    native = runs["native"]["decode"]
    cmp_error = per_position(runs["cmp"]["decode"], native)
    prompt_error = float(per_position(runs["cmp"]["prompt_last"], runs["native"]["prompt_last"]))
    result: dict = {"model": name, "positions": int(len(native)),
                    "cmp": {"median": float(np.median(cmp_error)), "max": float(cmp_error.max()),
                            "prompt_last": prompt_error}}  # fmt: skip
    if "control" in runs:
        control_error = per_position(runs["control"]["decode"], native)
        against_control = per_position(runs["cmp"]["decode"], runs["control"]["decode"])
        # what the code path changes beyond the SM count (NVVM, libdevice, the tuning row): information
        result["cmp_vs_control"] = {"median": float(np.median(against_control)), "max": float(against_control.max())}
        result["control"] = {"median": float(np.median(control_error)), "max": float(control_error.max()),
                             "prompt_last": float(per_position(runs["control"]["prompt_last"],
                                                               runs["native"]["prompt_last"]))}  # fmt: skip
    if oracle:
        median_bound = max_bound = ORACLE_BOUND
        result["bound_from"] = "the GPU tier's bound for the oracle model"
    elif "control" in runs:
        control = result["control"]
        median_bound = 2 * control["median"] + 1e-4
        max_bound = 2 * max(control["max"], control["prompt_last"]) + 1e-3
        result["bound_from"] = "2 x the control (native at 68 SMs): median + 1e-4, max + 1e-3"
    else:
        median_bound = max_bound = 1e-2
        result["bound_from"] = "no control run: a fixed 1e-2"
    top2 = np.sort(native, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    clear = margin > 2 * max_bound * np.abs(native).max(axis=1)
    agree = runs["cmp"]["decode"].argmax(axis=1) == native.argmax(axis=1)
    result["bounds"] = {"median": median_bound, "max": max_bound}
    result["greedy"] = {"clear_positions": int(clear.sum()), "equal_where_clear": int(agree[clear].sum()),
                        "equal_everywhere": int(agree.sum())}  # fmt: skip
    result["passed"] = bool(
        result["cmp"]["median"] <= median_bound
        and result["cmp"]["max"] <= max_bound
        and prompt_error <= max_bound
        and bool(agree[clear].all())
    )
    return result


def clean_environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROFILE_VARIABLES}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def compare(args: argparse.Namespace) -> int:
    import numpy as np

    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cmpchat-cmp-check-"))
    models: dict[str, Path] = {}
    for name in args.models:
        if name == "oracle":
            models[name] = ORACLE / "real_heads.q8_0.gguf"
        else:
            sys.path.insert(0, str(REPO))
            from cmpchat.bench.model_files import bench_model_path

            print(f"building (once) the {name} benchmark file in {args.folder}", flush=True)
            models[name] = bench_model_path(name, Path(args.folder))
    profiles = [p for p in PROFILES if p != "control" or not args.no_control]
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": args.steps, "children": {}}
    for profile in profiles:
        outs = [scratch / f"{name}-{profile}.npz" for name in models]
        command = [sys.executable, str(Path(__file__).resolve()), "child", "--profile", profile, "--steps",
                   str(args.steps), "--probe", "--json", str(results / f"probe_{profile}.json")]  # fmt: skip
        for path, out in zip(models.values(), outs, strict=True):
            command += ["--model", str(path), "--out", str(out)]
        print(f"\n$ {' '.join(f'{k}={v}' for k, v in PROFILES[profile].items())} {' '.join(command)}", flush=True)
        start = time.perf_counter()
        finished = subprocess.run(command, env=clean_environment(PROFILES[profile]), cwd=REPO, check=False)
        report["children"][profile] = {
            "returncode": finished.returncode,
            "seconds": round(time.perf_counter() - start, 1),
        }
        try:
            facts = json.loads((results / f"probe_{profile}.json").read_text())
        except (OSError, ValueError):
            facts = {}
        report["children"][profile]["probe_problems"] = probe_problems(facts, profile)
        report["children"][profile]["read_bandwidth_GBps"] = facts.get("read_bandwidth_GBps")
        report["children"][profile]["sms_used"] = facts.get("sms_used")
        if finished.returncode != 0:
            print(f"{profile}: exit {finished.returncode}", flush=True)
    report["models"] = []
    for name in models:
        runs = {}
        for profile in profiles:
            path = scratch / f"{name}-{profile}.npz"
            if path.exists():
                with np.load(path) as data:
                    runs[profile] = {"decode": data["decode"], "prompt_last": data["prompt_last"]}
        if "native" in runs and "cmp" in runs:
            report["models"].append(judge(name, runs, oracle=name == "oracle"))
        else:
            report["models"].append({"model": name, "passed": False, "missing": sorted(set(profiles) - set(runs))})
    report["passed"] = (
        bool(report["models"])
        and all(m["passed"] for m in report["models"])
        and all(c["returncode"] == 0 and not c["probe_problems"] for c in report["children"].values())
    )
    (results / "cmp_check.json").write_text(json.dumps(report, indent=1))
    print("\n" + "\n".join(format_report(report)), flush=True)
    return 0 if report["passed"] else 1


def format_report(report: dict) -> list[str]:
    lines = ["CMP code path against the native one, teacher-forced logits "
             f"({report['steps']} decode steps after an {PROMPT_TOKENS}-token prompt; a {LONG_PROMPT}-token prompt's last row)"]  # fmt: skip
    for profile, run in report["children"].items():
        lines.append(f"  {profile}: exit {run['returncode']} in {run['seconds']} s; read {run['read_bandwidth_GBps']} "
                     f"GB/s; SMs used {run['sms_used']}" + (f"; PROBLEMS {run['probe_problems']}"
                                                             if run["probe_problems"] else ""))  # fmt: skip
    for model in report["models"]:
        if "missing" in model:
            lines.append(f"  {model['model']}: FAIL, no logits from {model['missing']}")
            continue
        cmp, bounds, greedy = model["cmp"], model["bounds"], model["greedy"]
        control = model.get("control")
        lines.append(
            f"  {model['model']}: |dlogit|/max|logit| median {cmp['median']:.2e} (bound {bounds['median']:.2e}), "
            f"max {cmp['max']:.2e} (bound {bounds['max']:.2e}), long prompt {cmp['prompt_last']:.2e}"
            + (f"; control median {control['median']:.2e}, max {control['max']:.2e}" if control else "")
            + (f"; CMP against control: median {model['cmp_vs_control']['median']:.2e}" if control else "")
        )
        lines.append(
            f"    greedy: equal at {greedy['equal_where_clear']} of {greedy['clear_positions']} clear positions "
            f"({greedy['equal_everywhere']} of {model['positions']} in all); bound: {model['bound_from']}; "
            + ("PASS" if model["passed"] else "FAIL")
        )
    lines.append("RESULT: " + ("PASS" if report["passed"] else "FAIL"))
    return lines


# --- side by side (bench JSON) ----------------------------------------------------------------------------------


def _cells(run: dict) -> str:
    """tok/s, the ratio (decode: of the bandwidth limit; prefill: the GEMMs' share of the dp4a peak), the one-card
    CMP projection and the pipeline's (one CMP card a stage), as `cmpchat bench --json` gives them."""
    ratio = run.get("ratio_of_limit", run.get("gemm_share_of_dp4a_peak"))
    projection = run.get("cmp_projection_tok_s")
    pipeline = run.get("pipeline_projection_tok_s")
    if pipeline is None and isinstance(run.get("pipeline_projection"), dict):
        pipeline = run["pipeline_projection"].get("tok_s")
    return (f"{run.get('tok_s', math.nan):>8} {'-' if ratio is None else f'{ratio:.3f}':>6} "
            f"{'-' if projection is None else projection:>8} {'-' if pipeline is None else pipeline:>8}")  # fmt: skip


def side_by_side(native_path: Path, cmp_path: Path) -> int:
    """Decode or prefill figures of `cmpchat bench --json` runs, native beside CMP code path, with the projection."""
    native, cmp = json.loads(native_path.read_text()), json.loads(cmp_path.read_text())
    by_model = {entry.get("shape") or entry["model"]: entry for entry in native}
    for entry in cmp:
        name = entry.get("shape") or entry["model"]
        other = by_model.get(name)
        print(f"\n{name}: native on {other['gpu'] if other else '-'} (read {other and other['read_bandwidth_GBps']} "
              f"GB/s) | {entry['gpu']} (read {entry['read_bandwidth_GBps']} GB/s)")  # fmt: skip
        decode = "context" in (entry["runs"][0] if entry["runs"] else {})
        key = (lambda r: (r["context"], r["batch"])) if decode else (lambda r: r["tokens"])
        native_runs = {key(r): r for r in (other or {}).get("runs", [])}
        header = "context/batch" if decode else "prompt tokens"
        columns = f"{'tok/s':>8} {'ratio':>6} {'CMP proj':>8} {'pipeline':>8}"
        print(f"  {header:>14} | {columns} | {columns}")
        for run in entry["runs"]:
            base = native_runs.get(key(run), {})

            print(f"  {str(key(run)):>14} | {_cells(base) if base else '-':>33} | {_cells(run)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("probe", help="the code path's facts in this process's profile")
    one.add_argument("--json", type=Path)
    both = commands.add_parser("compare", help="probe and teacher-forced logits in each code path, compared")
    both.add_argument("--models", nargs="+", default=["oracle", "9B"], help="'oracle' and/or benchmark shapes")
    both.add_argument("--steps", type=int, default=64)
    both.add_argument("--folder", default=BENCH_FOLDER, help="where benchmark files are built")
    both.add_argument("--results", default=os.environ.get("OUT", "out/cmp-check"))
    both.add_argument("--no-control", action="store_true", help="skip the native run at 68 SMs (fixed 9B bound)")
    run = commands.add_parser("child", help=argparse.SUPPRESS)
    run.add_argument("--profile", required=True)
    run.add_argument("--steps", type=int, default=64)
    run.add_argument("--probe", action="store_true")
    run.add_argument("--json", type=Path)
    run.add_argument("--model", action="append", default=[])
    run.add_argument("--out", action="append", default=[])
    table = commands.add_parser("side-by-side", help="native and CMP `cmpchat bench --json` files, side by side")
    table.add_argument("native", type=Path)
    table.add_argument("cmp", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.command == "probe":
        facts = probe(args.json)
        profile = "cmp" if facts["code_path"].get("profile") == "cmp" else "native"
        problems = probe_problems(facts, profile)
        for problem in problems:
            print(f"PROBLEM: {problem}")
        return 1 if problems else 0
    if args.command == "child":
        return child(args)
    if args.command == "side-by-side":
        return side_by_side(args.native, args.cmp)
    return compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
