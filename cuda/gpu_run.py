"""The GPU test run behind `cuda/gpu_run.sh` (which installs the carried wheels first; run that, not this).

Phases, each timed: the environment (versions, GPU), the GPU self-test (tests/kernels/test_gpu_selftest.py:
intrinsics, raw launch, graph replay; if it fails nothing else runs), then every test module that has GPU
tests (`-m "gpu and not slow"` in quick mode, `-m gpu` in full mode), then in full and bench modes the
benchmarks (`cmpchat bench decode` on the 9B and 27B shapes, with llama.cpp when the archive that
cuda/build_llama_cpp.sh packs is carried, and the GEMV micro-benchmark), in prefill mode `cmpchat bench
prefill` with the GEMM, prefill-attention and chunked-GDN micro-benchmarks, in marks mode issue 25's engine
marks (cuda/engine_marks.py: serve against bench, the KV pool, the app's second turn), in pipeline mode issue 27's
(the pipeline's GPU tests, slow ones included; `cmpchat bench decode|prefill 27B --gpus 0,0,0 --gpu-mem 16G`; the
3-stage 27B served (cuda/pipeline_smoke.py) and chatted with in the app (tests/tui/speed_check.py)), in cmpcheck
mode issue 34's (cuda/cmp_path_check.py compare: the CMP code path's probe and its teacher-forced logits against this
GPU's own code path); their JSON lands beside the summary.

`--profile cmp` runs every phase on the CMP 100-210's code path (cmpchat/cudart/target.py), after a probe of it
(cuda/cmp_path_check.py probe: which NVVM compiled for which target, early launch off, the SMs used, the memory
cap, the read bandwidth; nothing else runs if it fails): the GPU tests but those that cannot hold on sm_70
(`CMP_DESELECTED`) or run no kernel of the code path (`CMP_SKIPPED_FILES`), and the benchmarks with 27B as three
16 GB stages (`--gpus 0,0,0`: one card cannot hold it), without llama.cpp and the app-speed checks.

Results go to the results folder: log.txt (written by gpu_run.sh), selftest.xml and tests.xml (JUnit,
with the properties tests record, e.g. launch overheads), summary.json and summary.txt, so a later session
can compare runs. Standard library only: it must run before anything else is known to work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SELFTEST = "tests/kernels/test_gpu_selftest.py"
PACKAGES = ("numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core", "gguf", "pytest", "torch")
MARKERS = {"quick": "gpu and not slow", "full": "gpu"}
PIPELINE_TESTS = ["tests/backends/test_cuda_pipeline_gpu.py", "tests/backends/test_bridge.py"]
PIPELINE_STAGES = ["--gpus", "0,0,0", "--gpu-mem", "16G"]  # the seed's setup: 27B on three 16 GB cards
BENCH_FOLDER = "/tmp/cmpchat-bench"  # benchmark model files (tens of GB): built once per machine
LLAMA_ARCHIVE = REPO / ".llama.cpp" / "llama-bench-sm90.tar.xz"  # from cuda/build_llama_cpp.sh, carried
GPU_MARK = re.compile(r"(pytest\.)?mark\.gpu\b")
CMP_MODES = ("quick", "full", "bench", "prefill", "cmpcheck")
"""Modes that run with --profile cmp (the others need wheels .whl-cmp lacks, or measure no code path)."""
CMP_DESELECTED = {
    "tests/kernels/test_ptx_sass.py::test_the_sass_check_catches_a_tensor_core_kernel": (
        "its control kernel's mma.sync.m16n8k8 needs sm_75; compute_70 PTX cannot hold it (the CMP's own limit)"
    ),
}
"""GPU tests that cannot hold on the CMP's code path, with why; deselected under --profile cmp."""
CMP_SKIPPED_FILES = {
    "tests/test_gpu_readings.py": "NVML readings of the app and server (scripted backends): no kernel of the code path",
}
"""GPU test modules that run no engine kernel, left out under --profile cmp (their imports need the server's wheels)."""


def environment() -> dict:
    """Versions and the GPU, read without importing anything that might fail."""
    info: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "packages": {}}
    for name in PACKAGES:
        try:
            info["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["packages"][name] = None
    info["nvidia_smi"] = _output(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    probe = "from numba import cuda; d = cuda.get_current_device(); print(d.name, d.compute_capability)"
    info["numba_device"] = _output([sys.executable, "-c", probe], timeout=120)
    info["commit"] = _output(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    info["tree"] = content_tree(REPO)
    return info


def content_tree(repo: Path) -> str | None:
    """Git's tree hash of the tracked files as they are on disk: what ran. A copied checkout's HEAD can lag
    behind its files (the device tool copies the working tree); this equals `git rev-parse COMMIT^{tree}` of
    the commit whose files these are (`git log --format='%H %T'` finds it), and differs if any was edited."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        for command in (["read-tree", "HEAD"], ["add", "--update", "."]):
            try:
                subprocess.run(["git", "-C", str(repo), *command], env=env, capture_output=True, check=True, timeout=60)
            except (OSError, subprocess.SubprocessError):
                return None
        tree = _output(["git", "-C", str(repo), "write-tree"], env=env)
    return tree


def gpu_test_files(profile: str = "native") -> list[str]:
    """Test modules with GPU tests, the self-test excepted (collecting only these keeps modules that need
    packages absent on the GPU machine, like the TUI's, out of the run); under the CMP profile, not those of
    `CMP_SKIPPED_FILES`."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative == SELFTEST or (profile == "cmp" and relative in CMP_SKIPPED_FILES):
            continue
        if GPU_MARK.search(path.read_text(errors="replace")):
            found.append(relative)
    return found


def profile_pytest_args(profile: str) -> list[str]:
    """pytest arguments a profile adds: the CMP one applies before collection (tests/cmp_profile_plugin.py) and
    deselects `CMP_DESELECTED`."""
    if profile != "cmp":
        return []
    return ["-p", "tests.cmp_profile_plugin", *(arg for test in CMP_DESELECTED for arg in ("--deselect", test))]


def cmp_benchmarks(results: Path, shapes: list[str], mode: str, tokens: list[int]) -> dict[str, list[str]]:
    """The benchmarks of `mode` on the CMP code path: `cmpchat bench decode|prefill` per shape (27B as three
    16 GB stages on GPU 0, as three CMP cards would hold it) and the kernel micro-benchmarks, which run the
    profile's tuning row on its partition."""
    kind = "prefill" if mode == "prefill" else "decode"
    lengths = ["--tokens", *map(str, tokens)] if tokens and kind == "prefill" else []
    commands: dict[str, list[str]] = {}
    for shape in shapes:
        stages = ["--gpus", "0,0,0"] if shape == "27B" else []
        name = f"{kind}_{shape}" + ("_3_stages" if stages else "")
        commands[name] = [sys.executable, "-m", "cmpchat", "bench", kind, shape, *stages, *lengths,
                          "--folder", BENCH_FOLDER, "--json", str(results / f"bench_{name}_cmp.json")]  # fmt: skip
    kernel_shapes = [s for s in shapes if s in ("9B", "27B")]
    if kind == "decode":
        commands["gemv"] = [sys.executable, "-m", "cmpchat.bench.kernels.gemv", *kernel_shapes, "--tokens", "1", "4",
                            "16"]  # fmt: skip
    else:
        commands["gemm"] = [sys.executable, "-m", "cmpchat.bench.kernels.gemm", *kernel_shapes, "--tokens", "256",
                            "512", "2048"]  # fmt: skip
    return commands


def run_pytest(files: list[str], marker: str, junit: Path, timeout: int, extra: list[str], deadline: float) -> dict:
    command = [
        sys.executable, "-m", "pytest", *files, "-m", marker, f"--junitxml={junit}", "-p", "no:cacheprovider",
        "-q", "-rfE", "--durations=15", "--continue-on-collection-errors", "-o", "junit_family=xunit1", *extra,
    ]  # fmt: skip
    if _installed("pytest-timeout"):
        command.append(f"--timeout={timeout}")
    return _timed(command, timeout=max(deadline - time.monotonic(), 1))


def run_benchmarks(
    results: Path, deadline: float, shapes: list[str], mode: str, tokens: list[int], profile: str = "native"
) -> dict:
    """The measurements: decode (bench and full modes), prompt processing (prefill mode), the tuning
    sweeps (sweep mode: each compiles and times dozens of kernel variants, so they get a device call of
    their own), the engine's marks (marks mode: its table goes into the summary), or the CMP code path's check
    (cmpcheck mode: its verdicts go into the summary, then `cmpchat doctor --profile cmp`); under the CMP profile,
    `cmp_benchmarks`."""
    if mode == "cmpcheck":
        command = [sys.executable, "cuda/cmp_path_check.py", "compare", "--folder", BENCH_FOLDER,
                   "--results", str(results)]  # fmt: skip
        result = _timed(command, timeout=max(deadline - time.monotonic(), 1))
        try:
            check = json.loads((results / "cmp_check.json").read_text())
            result["cmp_check"] = {"passed": check["passed"], "models": check["models"], "children": check["children"]}
        except (OSError, ValueError, KeyError):
            pass
        # the doctor on the CMP code path: the H200 named as it is, the probes compiled and run as a CMP's
        doctor = [sys.executable, "-m", "cmpchat", "doctor", "--quick", "--profile", "cmp"]
        return {"cmp_check": result, "doctor_cmp": _timed(doctor, timeout=max(deadline - time.monotonic(), 1))}
    if profile == "cmp":
        commands = cmp_benchmarks(results, shapes, mode, tokens)
        return {n: _timed(c, timeout=max(deadline - time.monotonic(), 1)) for n, c in commands.items()}
    if mode == "marks":
        folder = results / "engine-marks"
        left = int(deadline - time.monotonic()) - 15
        command = [sys.executable, "cuda/engine_marks.py", "--shape", shapes[0], "--folder", BENCH_FOLDER,
                   "--results", str(folder), "--total-budget", str(max(left, 1))]  # fmt: skip
        result = _timed(command, timeout=max(deadline - time.monotonic(), 1))
        try:
            result["marks"] = json.loads((folder / "engine_marks.json").read_text())["marks"]
        except (OSError, ValueError, KeyError):
            pass
        return {"engine_marks": result}
    if mode == "pipeline":
        bench = [sys.executable, "-m", "cmpchat", "bench"]
        commands = {
            "decode_3_stages": [*bench, "decode", "27B", *PIPELINE_STAGES, "--folder", BENCH_FOLDER,
                                "--json", str(results / "bench_decode_3_stages.json")],
            "prefill_3_stages": [*bench, "prefill", "27B", *PIPELINE_STAGES, "--tokens", "1160", "4620", "18440",
                                 "--folder", BENCH_FOLDER, "--json", str(results / "bench_prefill_3_stages.json")],
            "serve_3_stages": [sys.executable, "cuda/pipeline_smoke.py", "--model", "27B", "--gpus", "0,0,0",
                               "--gpu-mem", "16G", "--folder", BENCH_FOLDER, "--results", str(results / "smoke")],
            "app_3_stages": [sys.executable, "tests/tui/speed_check.py", "--folder", BENCH_FOLDER, "--model", "27B",
                             "--tokens", "64", "--rounds", "1", "--app-args", " ".join(PIPELINE_STAGES)],
        }  # fmt: skip
        return {n: _timed(c, timeout=max(deadline - time.monotonic(), 1)) for n, c in commands.items()}
    kernel_shapes = [s for s in shapes if s in ("9B", "27B")]
    gemv = [sys.executable, "-m", "cmpchat.bench.kernels.gemv", *kernel_shapes]
    gemm = [sys.executable, "-m", "cmpchat.bench.kernels.gemm", *kernel_shapes, "--tokens", "256", "512", "2048"]
    llama = []
    if LLAMA_ARCHIVE.exists() and mode != "sweep":
        subprocess.run(["tar", "xf", str(LLAMA_ARCHIVE), "-C", "/tmp"], check=True)
        llama = ["--llama-bench", "/tmp/llama-bench-sm90/run-llama-bench.sh"]
    if mode == "sweep":
        commands = {
            "gemv_sweep": [*gemv, "--sweep"],
            "gemv_fixed_costs": [*gemv, "--fixed-costs"],
            "attention_sweep": [sys.executable, "-m", "cmpchat.bench.kernels.attention"],
            "gemm_sweep": [*gemm, "--sweep"],
        }
    elif mode == "prefill":
        lengths = ["--tokens", *map(str, tokens)] if tokens else []
        prefill = [sys.executable, "-m", "cmpchat", "bench", "prefill", *shapes, *lengths, "--folder", BENCH_FOLDER,
                   "--json", str(results / "bench_prefill.json"), *llama]  # fmt: skip
        commands = {
            "prefill": prefill,
            "gemm": gemm,
            "attention_prefill": [
                sys.executable,
                "-m",
                "cmpchat.bench.kernels.attention_prefill",
                *kernel_shapes,
                "--context",
                "256",
                "4096",
                "16384",
                "65536",
            ],  # fmt: skip
            "gdn_chunked": [
                sys.executable,
                "-m",
                "cmpchat.bench.kernels.gdn_chunked",
                *kernel_shapes,
                "--tokens",
                "1160",
                "4620",
                "16384",
            ],  # fmt: skip
        }
    else:
        decode = [sys.executable, "-m", "cmpchat", "bench", "decode", *shapes, "--folder", BENCH_FOLDER,
                  "--json", str(results / "bench_decode.json"), *llama]  # fmt: skip
        # The app against `cmpchat run`: on the 9B shape (a few hundred tok/s, as people use it) and on the 0.8B
        # one (~670 tok/s, host-bound) with long replies, where every millisecond of UI work shows.
        app_speed = [sys.executable, "tests/tui/speed_check.py", "--folder", BENCH_FOLDER, "--rounds", "2"]
        commands = {
            "decode": decode,
            "gemv": [*gemv, "--tokens", "1", "4", "16"],
            "app_speed_9B": [*app_speed, "--model", "9B", "--tokens", "1000"],
            "app_speed_0.8B": [*app_speed, "--model", "0.8B", "--tokens", "8000"],
        }
    return {name: _timed(command, timeout=max(deadline - time.monotonic(), 1)) for name, command in commands.items()}


def junit_summary(path: Path) -> dict:
    """Totals, every test's outcome, duration and recorded properties, from a JUnit XML file."""
    if not path.exists():
        return {"missing": str(path.name)}
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    totals = {
        key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    tests = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        entry = {
            "name": f"{case.get('classname')}::{case.get('name')}",
            "outcome": outcome,
            "seconds": float(case.get("time", 0)),
        }
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        if properties:
            entry["properties"] = properties
        tests.append(entry)
    return {**totals, "cases": tests}


def format_summary(summary: dict) -> str:
    lines = [
        f"cmpchat GPU run, mode {summary['mode']}, profile {summary.get('profile', 'native')}, {summary['started']}"
    ]
    env = summary["environment"]
    lines.append(f"GPU: {env['nvidia_smi']} | numba sees: {env['numba_device']}")
    lines.append("packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v))
    lines.append(f"files: tree {env.get('tree')} (the copy's HEAD, which may lag: {env.get('commit')})")
    for name, phase in summary["phases"].items():
        result = phase.get("junit", {})
        counts = ", ".join(f"{k} {result[k]}" for k in ("tests", "failures", "errors", "skipped") if k in result)
        lines.append(f"{name}: exit {phase.get('returncode')} in {phase.get('seconds', 0):.1f} s  {counts}")
        for case in result.get("cases", []):
            if case["outcome"] in ("failure", "error"):
                lines.append(f"  {case['outcome'].upper()} {case['name']}")
            if "properties" in case:
                lines.append(f"  {case['name']}: {case['properties']}")
    for name, bench in summary.get("benchmarks", {}).items():
        lines.append(f"benchmark {name}: exit {bench['returncode']} in {bench['seconds']:.1f} s")
        for row in bench.get("marks", []):
            verdict = {True: "PASS", False: "FAIL", None: "-"}[row["passed"]]
            lines.append(f"  {row['part']}: {row['what']}: {row['value']} (mark {row['mark'] or '-'}) {verdict}")
        for model in bench.get("cmp_check", {}).get("models", []):
            cmp, verdict = model.get("cmp", {}), "PASS" if model.get("passed") else "FAIL"
            lines.append(f"  {model['model']}: median {cmp.get('median')}, max {cmp.get('max')} (bounds "
                         f"{model.get('bounds')}), greedy {model.get('greedy')} {verdict}")  # fmt: skip
    for problem in summary.get("code_path_problems", []):
        lines.append(f"  CODE PATH PROBLEM: {problem}")
    lines.append("RESULT: " + ("PASS" if summary["passed"] else "FAIL"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the GPU tests (use cuda/gpu_run.sh).")
    parser.add_argument("--mode", choices=[*sorted(MARKERS), "bench", "prefill", "sweep", "marks", "pipeline",
                                           "cmpcheck"], default="quick")  # fmt: skip
    parser.add_argument("--profile", choices=["native", "cmp"], default="native",
                        help="the code path every phase runs (cmp: the CMP 100-210's, cmpchat/cudart/target.py)")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", default=["9B", "27B"], help="model shapes the benchmarks run")
    parser.add_argument("--tokens", type=int, nargs="+", default=[], help="prompt lengths (prefill mode)")
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument(
        "--budget", type=float, default=560, help="seconds for the whole run (device calls stop at 600)"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest for the GPU tests")
    args = parser.parse_args(argv)
    if args.profile == "cmp" and args.mode not in CMP_MODES:
        parser.error(f"--profile cmp runs the modes {', '.join(CMP_MODES)}, not {args.mode}")
    deadline = time.monotonic() + args.budget
    args.results.mkdir(parents=True, exist_ok=True)
    os.chdir(REPO)
    os.environ["CMPCHAT_PROFILE"] = args.profile  # every phase's processes take the code path it names

    summary: dict = {"mode": args.mode, "profile": args.profile, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "phases": {}}  # fmt: skip
    summary["environment"] = environment()
    print(json.dumps(summary["environment"], indent=1), flush=True)

    passed = True
    if args.profile == "cmp":
        probe_json = args.results / "code_path.json"
        phase = _timed([sys.executable, "cuda/cmp_path_check.py", "probe", "--json", str(probe_json)],
                       timeout=max(deadline - time.monotonic(), 1))  # fmt: skip
        summary["phases"]["code_path"] = phase
        try:
            summary["code_path"] = json.loads(probe_json.read_text())
        except (OSError, ValueError):
            pass
        if phase["returncode"] != 0:
            summary["code_path_problems"] = ["cuda/cmp_path_check.py probe failed: see log.txt"]
        _write(summary, args.results)
        passed = phase["returncode"] == 0
    if passed:
        selftest_xml = args.results / "selftest.xml"
        phase = run_pytest([SELFTEST], "gpu", selftest_xml, args.timeout, profile_pytest_args(args.profile), deadline)
        phase["junit"] = junit_summary(selftest_xml)
        summary["phases"]["selftest"] = phase
        _write(summary, args.results)
        passed = phase["returncode"] == 0
    if passed and (args.mode in MARKERS or args.mode == "pipeline"):
        tests_xml = args.results / "tests.xml"
        files = gpu_test_files(args.profile) if args.mode in MARKERS else PIPELINE_TESTS
        print(f"\nGPU test modules: {' '.join(files)}", flush=True)
        marker = MARKERS.get(args.mode, "gpu")
        extra = [*profile_pytest_args(args.profile), *args.pytest_args]
        if args.profile == "cmp":
            summary["cmp_left_out"] = {**CMP_DESELECTED, **CMP_SKIPPED_FILES}
        phase = run_pytest(files, marker, tests_xml, args.timeout, extra, deadline)
        phase["junit"] = junit_summary(tests_xml)
        phase["files"] = files
        summary["phases"]["gpu_tests"] = phase
        _write(summary, args.results)
        passed = phase["returncode"] in (0, 5)  # 5: no GPU tests selected (none written yet)
    if passed and args.mode != "quick":
        summary["benchmarks"] = run_benchmarks(args.results, deadline, args.shapes, args.mode, args.tokens,
                                               args.profile)  # fmt: skip
        passed = all(b["returncode"] == 0 for b in summary["benchmarks"].values())
    if phase["returncode"] != 0 and "gpu_tests" not in summary["phases"]:
        print(f"\n{'self-test' if 'selftest' in summary['phases'] else 'code-path probe'} failed: the other GPU tests "
              "were not run", flush=True)  # fmt: skip
    summary["passed"] = passed
    _write(summary, args.results)
    text = format_summary(summary)
    (args.results / "summary.txt").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if passed else 1


def _timed(command: list[str], timeout: int | None = None) -> dict:
    """Run a command, its output going to ours (and so to the log)."""
    print(f"\n$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    try:
        finished = subprocess.run(command, timeout=timeout, text=True, check=False)
    except subprocess.TimeoutExpired:
        return {"returncode": "timeout", "seconds": round(time.perf_counter() - start, 2)}
    return {"returncode": finished.returncode, "seconds": round(time.perf_counter() - start, 2)}


def _write(summary: dict, results: Path) -> None:
    """Written after every phase, so a run cut off by the machine's time limit still leaves its results."""
    (results / "summary.json").write_text(json.dumps(summary, indent=1))


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _output(command: list[str], timeout: int = 30, env: dict | None = None) -> str | None:
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unavailable: {error}"
    text = (finished.stdout or finished.stderr).strip()
    return text.splitlines()[-1] if text else None


if __name__ == "__main__":
    raise SystemExit(main())
