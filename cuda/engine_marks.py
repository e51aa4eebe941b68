"""Issue 25's engine pass marks, measured in one run on one GPU: the server's streamed decode against `cmpchat
bench decode`, the shared KV pool (admission, refusal, preemption), and the app's second turn.

    python3 cuda/engine_marks.py [--shape 9B] [--results DIR] [--only serve pool app]
    python3 cuda/engine_marks.py --model tiny.gguf --backend cpu --scale 0.05    # this script's CPU check

The model is the benchmark file of the shape (`cmpchat.bench.model_files`, built once in --folder and shared
with `cmpchat bench`) or --model's GGUF file. Each part runs in a child process of its own with a time budget
(--budget; a part that runs out stops, keeps what it measured and says so), so a failing part, or one whose GPU
context breaks, leaves the others their run. The parts:

serve  `cmpchat bench decode FILE --contexts 0 --batches 4` (GPU only), then `python3 -m cmpchat serve -m FILE
       --slots 4 --port 0` as a subprocess: 4 concurrent streamed greedy chat requests of max_tokens 512, tokens
       counted at the client (one per SSE chunk with text, checked against the usage chunk), aggregate decode
       tok/s from the last first token to the first finish, and its ratio to the bench's 4-sequence tok/s
       (mark: >= 0.90). The server has no `ignore_eos`, so a random-weight model may end a reply early: the
       window ends at the first finish whatever its reason, and the finish reasons are reported (the mark wants
       them all "length").
pool   the Python API with gpu_mem 16 GiB, 16 sequences and 1 saved state, context 262144: the pool's size in
       tokens and the load's warning that the context exceeds it; with 15 short requests running, a
       100,000-token request is admitted and completes; a prompt larger than the pool is refused in one line;
       then, with a pool of 20,000 tokens, 16 growing requests (prompts of 300 tokens, 1500 generated, end tokens
       ignored) all complete with preemptions, and each one's greedy tokens are compared with its run alone.
       On the GPU a resumed sequence is re-read by the prompt kernels, so the tokens may part where two
       candidates are close: where a reply parts from its run alone, that step is read three ways by the
       backend and the parting passes if the two choices lie within the read paths' rounding
       (cmpchat.evaluation.agreement).
app    `Model.chat`, the path the app's reply worker runs (not the app's drawing): a first turn that leaves an
       8K-token conversation (a long user message, a 64-token reply), then a short second message; the second
       turn's time to first token against the time to prefill, on a fresh sequence, only the tokens new in it
       (from where its prompt parts from the first turn's: the template re-renders the reply there) (mark:
       <= 1.5); also those tokens' prefill after the conversation's context, and how many the engine read.

--scale multiplies every size (prompts, replies, pools) for a quick run; --backend cpu runs the parts on the
numpy reference (no bench: `cmpchat bench` needs a GPU), with KV pages scaled too, so that the small pool
preempts at tiny sizes. Results: DIR/engine_marks.json (every part's figures and the marks), DIR/PART.json,
DIR/bench_decode.json; progress on stderr; the table of marks last, on stdout. Exit status 0 when every part
ran to its end (whatever the marks say), 1 otherwise. Standard library and the project's own dependencies
(httpx for the client; the server needs uvicorn, starlette and pydantic, which the GPU machine's image lacks:
their wheels travel in .whl/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH_FOLDER = "/tmp/cmpchat-bench"
PARTS = ("serve", "pool", "app")
BUDGETS = {"serve": 150.0, "pool": 260.0, "app": 90.0}
"""Seconds per part at most; on an H200 with the 9B shape about 1.5, 3.5 and 0.5 minutes are expected."""
GRACE_SECONDS = 60.0
"""How long past its budget a child may run before it is killed (a model load cannot be interrupted)."""

FULL_SIZES = {  # name: (full size, least after --scale)
    "serve_max_tokens": (512, 8),
    "bench_tokens": (128, 16),
    "short_prompt": (100, 8),
    "short_max_tokens": (200, 8),
    "long_prompt": (100_000, 64),
    "long_max_tokens": (16, 4),
    "small_pool": (20_000, 256),
    "grow_prompt": (300, 8),
    "grow_max_tokens": (1500, 16),
    "app_conversation": (8000, 64),
    "app_reply": (64, 8),
    "cpu_page_tokens": (256, 16),
}
SERVE_REQUESTS = 4
POOL_GPU_MEM = 16 * 2**30
POOL_CONTEXT = 262_144
POOL_SEQUENCES = 16
SHORT_REQUESTS = 15
GROW_REQUESTS = 16
PREFILL_REPEATS = 3
SERVE_MARK = 0.90
APP_MARK = 1.5

PASSAGE = (
    "A Gated DeltaNet layer folds every token into one state that cannot be rewound, so the engine saves states "
    "where a conversation's next turn will part from this one. Decode reads every weight once a step; the "
    "pool of key and value pages is shared by all sequences, and the youngest gives its pages back when it "
    "runs dry. Numbers, names and dates: 1942, 2026, Ada, Lovelace, Turing, 3.14159, forty-two, seventeen. "
)
SECOND_MESSAGE = "Thank you. Now sum that up in one short sentence."


class OutOfTime(Exception):
    """A part's budget ran out; what it measured so far stays in its results."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def scaled_sizes(scale: float) -> dict[str, int]:
    return {name: max(least, round(full * scale)) for name, (full, least) in FULL_SIZES.items()}


# -- the parent: model file, one child per part, the table ---------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    started = time.monotonic()
    total_deadline = started + args.total_budget if args.total_budget else None
    args.results.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shape": None if args.model else args.shape,
        "backend": args.backend,
        "scale": args.scale,
        "sizes": scaled_sizes(args.scale),
        "parts": {},
    }
    try:
        path, built = model_path(args)
    except Exception as error:  # noqa: BLE001 - one line, then the table says what is missing
        say(f"engine marks: no model file: {_line(error)}")
        report["error"] = _line(error)
        return finish(report, args, ok=False)
    report["model"] = str(path)
    report["model_file_seconds"] = built
    ok = True
    for part in args.only:
        budget = args.budget[part]
        if total_deadline is not None:
            budget = min(budget, total_deadline - time.monotonic() - 5)
        if budget < 5:
            why = "skipped: no time left in the total budget" if total_deadline is not None else "skipped: budget < 5 s"
            say(f"{part}: {why}")
            report["parts"][part] = {"ok": False, "error": why}
            ok = False
            continue
        say(f"\n== {part} (budget {budget:.0f} s)")
        grace = (
            GRACE_SECONDS
            if total_deadline is None
            else max(min(GRACE_SECONDS, total_deadline - time.monotonic() - budget), 1)
        )
        result = run_part(part, path, budget, grace, args)
        report["parts"][part] = result
        ok = ok and bool(result.get("ok"))
        if not result.get("ok"):
            say(f"{part}: FAILED: {result.get('error')}")
        _write_json(args.results / "engine_marks.json", report)
    return finish(report, args, ok=ok)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="9B", help="benchmark shape (0.8B ... 27B) or a GGUF path (default 9B)")
    parser.add_argument("--model", type=Path, help="a GGUF file instead of the shape's benchmark file")
    parser.add_argument("--folder", type=Path, default=Path(BENCH_FOLDER), help="where benchmark files are built")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--results", type=Path, default=REPO / "out" / "engine-marks")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), metavar="PART")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every size (default 1)")
    parser.add_argument("--budget", nargs="*", default=[], metavar="PART=SECONDS",
                        help=f"per-part time budgets (default {' '.join(f'{k}={v:.0f}' for k, v in BUDGETS.items())})")  # fmt: skip
    parser.add_argument("--total-budget", type=float, help="seconds for the whole run (parts are cut to fit)")
    parser.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--part-budget", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    budgets = dict(BUDGETS)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in budgets or not seconds:
            parser.error(f"--budget takes PART=SECONDS with PART one of {', '.join(PARTS)}, not {item!r}")
        budgets[name] = float(seconds)
    args.budget = budgets
    if args.scale <= 0:
        parser.error("--scale must be > 0")
    return args


def model_path(args: argparse.Namespace) -> tuple[Path, float]:
    if args.model is not None:
        if not args.model.is_file():
            raise FileNotFoundError(f"no model file {args.model}")
        return args.model.resolve(), 0.0
    _import_project()
    from cmpchat.bench.model_files import bench_model_path
    from cmpchat.commands.progress import StderrProgress

    start = time.perf_counter()
    progress = StderrProgress()
    try:
        path = bench_model_path(args.shape, args.folder, progress)
    finally:
        progress.close()
    return path.resolve(), round(time.perf_counter() - start, 1)


def run_part(part: str, path: Path, budget: float, grace: float, args: argparse.Namespace) -> dict:
    """One part in a child process (its own GPU context), killed `grace` seconds past its budget."""
    out = args.results / f"{part}.json"
    out.unlink(missing_ok=True)
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", part, "--model", str(path), "--backend",
        args.backend, "--scale", str(args.scale), "--results", str(args.results), "--part-budget", f"{budget:.1f}",
    ]  # fmt: skip
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO, stdout=sys.stderr, env=_child_env())
    try:
        returncode: int | str = child.wait(timeout=budget + grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        returncode = "killed"
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"ok": False}
    result["returncode"] = returncode
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    if returncode != 0 and not result.get("error"):
        result["ok"] = False
        result["error"] = (
            f"killed {grace:.0f} s past its {budget:.0f} s budget"
            if returncode == "killed"
            else f"the child exited with status {returncode} before writing its results"
        )
    return result


def finish(report: dict, args: argparse.Namespace, *, ok: bool) -> int:
    """Writes and prints the table; the exit status is 1 when a part failed or, on the GPU, a mark was missed (the
    marks are the GPU's: on the reference backend at tiny sizes the timings are the interpreter's)."""
    report["marks"] = marks(report)
    missed = any(row["passed"] is False for row in report["marks"])
    ok = ok and not (missed and report["backend"] == "cuda")
    report["ok"] = ok
    _write_json(args.results / "engine_marks.json", report)
    print(format_table(report), flush=True)
    return 0 if ok else 1


def marks(report: dict) -> list[dict]:
    """The table: each measured figure beside its mark; `passed` is None where a reader has to judge."""
    rows: list[dict] = []

    def row(part: str, what: str, value: Any, mark: str, passed: bool | None) -> None:
        # A figure that is missing has no verdict: its part's failure row says why.
        rows.append(
            {"part": part, "what": what, "value": value, "mark": mark, "passed": None if value is None else passed}
        )

    parts = report.get("parts", {})
    serve = parts.get("serve", {})
    if serve:
        ratio = serve.get("ratio_to_bench")
        reasons = serve.get("finish_reasons") or []
        by_length = bool(reasons) and all(r == "length" for r in reasons)
        row("serve", "client decode tok/s (4 streams)", serve.get("client_tok_s"), "", None)
        row("serve", "bench decode tok/s (4 sequences)", serve.get("bench_tok_s"), "", None)
        row("serve", "client / bench", ratio, f">= {SERVE_MARK}",
            None if ratio is None else ratio >= SERVE_MARK and by_length)  # fmt: skip
        row(
            "serve", "  with text-less tokens (usage)", serve.get("ratio_to_bench_usage_scaled"), "for the reader", None
        )
        row("serve", "finish reasons", ",".join(reasons) or None, "all length", by_length if reasons else None)
    pool = parts.get("pool", {})
    if pool:
        cuda = report.get("backend") == "cuda"
        row("pool", "pool tokens (16 GiB)", pool.get("pool_tokens"), "printed at load",
            bool(pool.get("pool_tokens_printed")) if cuda else None)  # fmt: skip
        warned = pool.get("warning")
        row("pool", "context > pool warning", ("yes" if warned else "no") if cuda else "no plan on the CPU",
            "warns", bool(warned) if cuda and "warning" in pool else None)  # fmt: skip
        long = pool.get("long") or {}
        row("pool", f"{long.get('prompt_tokens', '?')}-token request beside 15",
            long.get("finish_reason"), "admitted, completes",
            None if not long else bool(long.get("admitted") and long.get("finish_reason") == "length"))  # fmt: skip
        row("pool", "its prompt tok/s", long.get("prompt_tok_s"), "", None)
        refusal = pool.get("refusal") or {}
        row("pool", "prompt > pool refused", refusal.get("message"), "one line",
            None if not refusal else bool(refusal.get("refused") and refusal.get("one_line")))  # fmt: skip
        grow = pool.get("growing") or {}
        completed, count = grow.get("completed"), grow.get("requests")
        row("pool", "growing requests completed", None if count is None else f"{completed}/{count}",
            "all", None if count is None else completed == count)  # fmt: skip
        row("pool", "preemptions", grow.get("preemptions"), "> 0",
            None if grow.get("preemptions") is None else grow["preemptions"] > 0)  # fmt: skip
        compared = grow.get("compared")
        same = grow.get("identical")
        on_gpu = report.get("backend") == "cuda"
        row("pool", "tokens equal to the run alone", grow.get("alone_stopped") if compared is None else f"{same}/{compared}",
            "to rounding (GPU)" if on_gpu else "all (reference)",
            None if compared != count else same == compared if not on_gpu else None)  # fmt: skip
        if grow.get("first_differences"):
            row("pool", "first differing token", grow["first_differences"], "", None)
        if on_gpu and compared:
            explained = grow.get("explained_by_rounding") or {}
            parted = len(grow.get("first_differences") or {})
            row("pool", "partings within read-path rounding", f"{sum(explained.values())}/{parted}", "all",
                None if compared != count or len(explained) != parted else all(explained.values()))  # fmt: skip
    app = parts.get("app", {})
    if app:
        row("app", "2nd turn time to first token s", app.get("ttft_s"), "", None)
        row("app", "tokens read / new / prompt",
            None if app.get("prompt_tokens") is None
            else f"{app['prompt_tokens']}/{app.get('new_tokens')}/{app.get('prompt_length')}", "", None)  # fmt: skip
        row("app", "fresh prefill of the new tokens s", app.get("prefill_new_s"), "", None)
        ratio = app.get("ratio")
        row("app", "ttft / fresh prefill", ratio, f"<= {APP_MARK}", None if ratio is None else ratio <= APP_MARK)
    for name, part in parts.items():
        if not part.get("ok"):
            row(name, "part failed", part.get("error"), "runs", False)
    return rows


def format_table(report: dict) -> str:
    model = Path(report.get("model") or "?").name
    lines = [f"engine marks (issue 25): {model}, backend {report['backend']}, scale {report['scale']}"]
    lines.append(f"{'part':6} {'what':40} {'value':>24}  {'mark':20} verdict")
    for row in report["marks"]:
        value = row["value"]
        if isinstance(value, float):
            value = f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        text = "-" if value is None else str(value)
        if len(text) > 24:
            text = text[:21] + "..."
        verdict = {True: "PASS", False: "FAIL", None: "-"}[row["passed"]]
        lines.append(f"{row['part']:6} {row['what'][:40]:40} {text:>24}  {row['mark'][:20]:20} {verdict}")
    return "\n".join(lines)


# -- a child: one part --------------------------------------------------------------------------------


@dataclass
class Part:
    name: str
    args: argparse.Namespace
    sizes: dict[str, int]
    deadline: float
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.args.backend == "cuda"

    @property
    def path(self) -> Path:
        return Path(self.args.model)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check_time(self, what: str) -> None:
        if self.left() <= 0:
            raise OutOfTime(f"out of time before {what}")

    def save(self) -> None:
        _write_json(self.args.results / f"{self.name}.json", self.data)


def run_child(args: argparse.Namespace) -> int:
    _import_project()
    part = Part(args.child, args, scaled_sizes(args.scale), time.monotonic() + args.part_budget - 3)
    part.data.update({"ok": False, "error": None, "backend": args.backend, "model": str(args.model)})
    start = time.perf_counter()
    try:
        {"serve": part_serve, "pool": part_pool, "app": part_app}[args.child](part)
        part.data["ok"] = True
    except Exception as error:  # noqa: BLE001 - recorded, and the next part runs
        part.data["error"] = _line(error)
        if not isinstance(error, OutOfTime):
            part.data["traceback"] = traceback.format_exc()
        say(f"{part.name}: FAILED: {part.data['error']}")
    part.data["seconds"] = round(time.perf_counter() - start, 1)
    part.save()
    return 0 if part.data["ok"] else 1


# -- serve ------------------------------------------------------------------------------------------


def part_serve(part: Part) -> None:
    data = part.data
    max_tokens = part.sizes["serve_max_tokens"]
    data.update({"requests": SERVE_REQUESTS, "max_tokens": max_tokens, "ignore_eos": False,
                 "note": "the server accepts no ignore_eos (cmpchat/server/schemas.py): the window ends at the "
                         "first finish, whatever its reason"})  # fmt: skip
    if part.cuda:
        data["bench"] = bench_decode(part)
        runs = [r for r in data["bench"].get("runs", []) if r.get("batch") == SERVE_REQUESTS and r.get("context") == 0]
        data["bench_tok_s"] = runs[0]["tok_s"] if runs else None
    else:
        data["bench"] = {"skipped": "cmpchat bench needs a GPU"}
        data["bench_tok_s"] = None
    part.save()
    missing = [name for name in ("httpx", "uvicorn", "starlette", "pydantic") if not _importable(name)]
    if missing:
        raise RuntimeError(f"the server or its client cannot run here: {', '.join(missing)} not installed "
                           "(carry their wheels in .whl/)")  # fmt: skip
    import httpx

    part.check_time("starting the server")
    server = Server(part)
    try:
        url = server.start()
        data["server_load_seconds"] = server.load_seconds
        part.save()
        streams = stream_requests(url, max_tokens, part)
        data["streams"] = [s.summary() for s in streams]
        try:
            data["metrics"] = _metrics(httpx.get(url + "/metrics", timeout=10).text)
        except httpx.HTTPError as error:
            data["metrics"] = {"error": _line(error)}
    finally:
        data["server_stopped"] = server.stop()
        data["server_log_tail"] = server.tail[-20:]
    failures = [s.error for s in streams if s.error]
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(streams)} streams failed: {failures[0]}")
    data.update(aggregate(streams))
    bench = data["bench_tok_s"]
    data["ratio_to_bench"] = round(data["client_tok_s"] / bench, 4) if bench and data["client_tok_s"] else None
    scaled = data["client_tok_s_usage_scaled"]
    data["ratio_to_bench_usage_scaled"] = round(scaled / bench, 4) if bench and scaled else None
    say(f"serve: {data['client_tok_s']} tok/s at the client over {data['window_tokens']} tokens in "
        f"{data['window_seconds']} s; bench {bench}; ratio {data['ratio_to_bench']}; "
        f"finish reasons {data['finish_reasons']}")  # fmt: skip
    part.save()
    if part.cuda and bench is None:
        raise RuntimeError(f"cmpchat bench decode did not give a 4-sequence rate (exit {data['bench']['returncode']})")


def bench_decode(part: Part) -> dict:
    out = part.args.results / "bench_decode.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "cmpchat", "bench", "decode", str(part.path), "--contexts", "0",
               "--batches", str(SERVE_REQUESTS), "--tokens", str(part.sizes["bench_tokens"]), "--json", str(out)]  # fmt: skip
    say("serve: $ " + " ".join(command))
    start = time.perf_counter()
    try:
        finished = subprocess.run(command, cwd=REPO, stdout=sys.stderr, env=_child_env(),
                                  timeout=max(part.left() - 30, 10), check=False)  # fmt: skip
        returncode: int | str = finished.returncode
    except subprocess.TimeoutExpired:
        returncode = "timeout"
    result: dict[str, Any] = {"command": command, "returncode": returncode,
                              "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    if returncode == 0 and out.exists():
        report = json.loads(out.read_text())[0]
        result["runs"] = [
            {k: run[k] for k in ("context", "batch", "tok_s", "ratio_of_limit")} for run in report["runs"]
        ]
        result["read_bandwidth_GBps"] = report.get("read_bandwidth_GBps")
    else:
        say(f"serve: the bench exited with {returncode}; the ratio will be missing")
    return result


class Server:
    """`python3 -m cmpchat serve` in a subprocess on a free port; its stderr echoed to ours."""

    LISTENING = re.compile(r"listening on (http://\S+?)/v1")

    def __init__(self, part: Part) -> None:
        self.part = part
        self.process: subprocess.Popen[str] | None = None
        self.url: str | None = None
        self.tail: list[str] = []
        self.load_seconds: float | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> str:
        import httpx

        command = [sys.executable, "-m", "cmpchat", "serve", "-m", str(self.part.path), "--backend",
                   self.part.args.backend, "--slots", str(SERVE_REQUESTS), "--port", "0"]  # fmt: skip
        say("serve: $ " + " ".join(command))
        start = time.perf_counter()
        self.process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env=_child_env())  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = min(self.part.deadline - 20, time.monotonic() + 300)
        say(f"serve: waiting up to {deadline - time.monotonic():.0f} s for the server to listen and /health to "
            "answer 200 (the model loads: weights onto the GPU, kernels compiled and graphs captured)")  # fmt: skip
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode} while loading: "
                                   f"{' | '.join(self.tail[-3:])}")  # fmt: skip
            if time.monotonic() > deadline:
                raise OutOfTime(f"the server did not answer /health 200 in time "
                                f"({'never listened' if self.url is None else 'still loading'})")  # fmt: skip
            if self.url is not None:
                try:
                    response = httpx.get(self.url + "/health", timeout=5)
                    if response.status_code == 200:
                        break
                    if response.json().get("status") == "failed":
                        raise RuntimeError(f"the server's model failed to load: {response.text[:300]}")
                except (httpx.HTTPError, ValueError):
                    pass
            time.sleep(0.25)
        self.load_seconds = round(time.perf_counter() - start, 1)
        say(f"serve: ready at {self.url} after {self.load_seconds} s")
        return self.url

    def _read(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            line = line.rstrip()
            if not line:
                continue
            match = self.LISTENING.search(line)
            if match and self.url is None:
                self.url = match.group(1)
            self.tail = [*self.tail[-199:], line[-300:]]
            say(f"  [server] {line}")

    def stop(self) -> str:
        """SIGINT (uvicorn's clean shutdown), then a kill after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return "not running" if self.process is None else f"exited with {self.process.returncode}"
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
            how = f"SIGINT, exit {self.process.returncode}"
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            how = "killed 30 s after SIGINT"
        if self._reader is not None:
            self._reader.join(timeout=5)
        return how


@dataclass
class Stream:
    """One streamed request as the client saw it: the arrival time of every chunk with text."""

    index: int
    sent_at: float = 0.0
    chunks: list[float] = field(default_factory=list)
    finished_at: float | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    error: str | None = None

    def summary(self) -> dict:
        first = self.chunks[0] - self.sent_at if self.chunks else None
        return {
            "index": self.index,
            "chunks_with_text": len(self.chunks),
            "completion_tokens": (self.usage or {}).get("completion_tokens"),
            "prompt_tokens": (self.usage or {}).get("prompt_tokens"),
            "finish_reason": self.finish_reason,
            "first_chunk_s": None if first is None else round(first, 4),
            "server_timings": self.timings,
            "error": self.error,
        }


def stream_requests(url: str, max_tokens: int, part: Part) -> list[Stream]:
    """SERVE_REQUESTS streamed greedy chat completions at once, one client thread each."""
    import httpx

    streams = [Stream(i) for i in range(SERVE_REQUESTS)]
    gate = threading.Barrier(SERVE_REQUESTS)
    timeout = httpx.Timeout(max(part.left() - 10, 10), connect=10)

    def one(stream: Stream) -> None:
        body = {
            "model": "engine-marks",
            "messages": [{"role": "user", "content": f"Request {stream.index}. {PASSAGE} Go on in your words."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False},
        }
        try:
            with httpx.Client(timeout=timeout) as client:
                gate.wait(timeout=30)
                stream.sent_at = time.perf_counter()
                with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        stream.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                        return
                    for line in response.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            stream.error = str(chunk["error"].get("message"))
                            return
                        if chunk.get("usage"):
                            stream.usage = chunk["usage"]
                        for choice in chunk.get("choices") or []:
                            delta = choice.get("delta") or {}
                            if delta.get("content") or delta.get("reasoning_content"):
                                stream.chunks.append(now)
                            if choice.get("finish_reason") and stream.finished_at is None:
                                stream.finished_at, stream.finish_reason = now, choice["finish_reason"]
                                stream.timings = chunk.get("timings")
        except Exception as error:  # noqa: BLE001 - reported per stream
            stream.error = _line(error)

    say(f"serve: {SERVE_REQUESTS} streamed greedy requests of max_tokens {max_tokens} at once")
    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(part.left(), 1))
    if any(thread.is_alive() for thread in threads):
        raise OutOfTime("the streams did not finish in time")
    return streams


def aggregate(streams: list[Stream]) -> dict:
    """Tokens counted at the client from the last first token to the first finish, over that time."""
    if any(not s.chunks or s.finished_at is None for s in streams):
        raise RuntimeError("a stream ended without text or without a finish")
    start = max(s.chunks[0] for s in streams)
    end = min(s.finished_at for s in streams if s.finished_at is not None)
    tokens = sum(sum(1 for t in s.chunks if start < t <= end) for s in streams)
    seconds = end - start
    counted = [len(s.chunks) for s in streams]
    usage = [(s.usage or {}).get("completion_tokens") for s in streams]
    return {
        "window_seconds": round(seconds, 4),
        "window_tokens": tokens,
        "client_tok_s": round(tokens / seconds, 2) if seconds > 0 else None,
        # Tokens that complete no text (a held-back UTF-8 fragment, a special token) send no chunk: the usage
        # chunk's count says how many; this scales the client's rate by it, for the reader.
        "client_tok_s_usage_scaled": round(tokens / seconds * sum(usage) / sum(counted), 2)
        if seconds > 0 and all(usage) and sum(counted)
        else None,
        "first_tokens_spread_s": round(start - min(s.chunks[0] for s in streams), 4),
        "finish_reasons": [s.finish_reason or "?" for s in streams],
        "chunks_with_text": counted,
        "usage_completion_tokens": usage,
        "chunks_match_usage": counted == usage,
        "server_decode_tok_s_sum": round(sum((s.timings or {}).get("predicted_per_second", 0.0) for s in streams), 2),
    }


def _metrics(text: str) -> dict:
    wanted = ("cmpchat_preemptions", "cmpchat_decode_tokens_per_second", "cmpchat_prompt_tokens_per_second")
    found = {}
    for line in text.splitlines():
        if line.startswith(wanted):
            name, _, value = line.rpartition(" ")
            found[name] = value
    return found


# -- pool -------------------------------------------------------------------------------------------


def part_pool(part: Part) -> None:
    from cmpchat.engine.reply import GenerationOptions
    from cmpchat.engine.request import GenerationRequest
    from cmpchat.errors import CmpchatError
    from cmpchat.evaluation.agreement import parting_is_explained

    data, sizes = part.data, part.sizes
    data["gpu_mem"] = POOL_GPU_MEM if part.cuda else None
    data["context_asked"] = POOL_CONTEXT
    model = open_part_model(part, sequences=POOL_SEQUENCES, cache_states=1, context=POOL_CONTEXT,
                            gpu_mem=POOL_GPU_MEM, what="the 16 GiB pool")  # fmt: skip
    backend, engine, tokenizer = model.backend, model.engine, model.tokenizer
    pool = backend.pool
    lines = backend.describe()
    for line in lines:
        say(f"  {line}")
    plan = getattr(backend, "plan", None)
    data.update({
        "pool_tokens": pool.total_tokens,
        "pool_pages": pool.total_pages,
        "page_tokens": pool.page_tokens,
        "plan_pool_tokens": getattr(plan, "pool_tokens", None),
        "context_limit": backend.context_limit,
        "describe": lines,
        "warning": next((line for line in lines if "warning" in line), None),
        "pool_tokens_printed": any(f"{pool.total_tokens} tokens" in line for line in lines),
    })  # fmt: skip
    say(f"pool: {pool.total_tokens} tokens in {pool.total_pages} pages; context limit {backend.context_limit}; "
        f"warning: {data['warning']}")  # fmt: skip
    part.save()

    # 15 short requests, then a long one admitted while they run.
    part.check_time("the long request")
    short = GenerationOptions(max_tokens=sizes["short_max_tokens"], ignore_eos=True)
    shorts = [Collector() for _ in range(SHORT_REQUESTS)]
    handles = [engine.submit(GenerationRequest(tuple(prompt_tokens(tokenizer, sizes["short_prompt"], i)), short), s)
               for i, s in enumerate(shorts)]  # fmt: skip
    engine.step()  # admits them and starts their prompts
    long_max = sizes["long_max_tokens"]
    room = (
        pool.total_tokens
        - SHORT_REQUESTS * pool.pages_for(sizes["short_prompt"] + sizes["short_max_tokens"] + 1) * pool.page_tokens
    )
    length = min(sizes["long_prompt"], backend.context_limit - long_max - 1, room - long_max - pool.page_tokens)
    running = lambda: sum(1 for s in shorts if s.started is not None and s.finished is None)  # noqa: E731
    long = Collector(on_start=running)
    data["long"] = {"prompt_tokens": length, "asked_tokens": sizes["long_prompt"], "max_tokens": long_max}
    say(f"pool: a {length}-token request while {running()} short requests run")
    handles.append(engine.submit(
        GenerationRequest(tuple(prompt_tokens(tokenizer, length, 99)), GenerationOptions(max_tokens=long_max, ignore_eos=True)),
        long))  # fmt: skip
    drive(part, engine, handles, "the long request")
    timings = long.finished.timings if long.finished else None
    data["long"].update({
        "admitted": long.started is not None,
        "short_running_at_admission": long.value_at_start,
        "finish_reason": long.finished.reason if long.finished else None,
        "failed": long.failed,
        "generated": timings.generated_tokens if timings else None,
        "prompt_seconds": round(timings.prompt_seconds, 3) if timings else None,
        "prompt_tok_s": round(timings.prompt_tokens_per_second, 1) if timings else None,
        "decode_tok_s": round(timings.decode_tokens_per_second, 1) if timings else None,
        "shorts_finished": [s.finished.reason if s.finished else s.failed for s in shorts].count("length"),
    })  # fmt: skip
    say(f"pool: long request {data['long']}")
    part.save()

    # A prompt larger than the whole pool.
    oversize = pool.total_tokens + pool.page_tokens
    refusal: dict[str, Any] = {"prompt_tokens": oversize}
    try:
        handle = engine.submit(GenerationRequest(tuple(prompt_tokens(tokenizer, oversize, 5)), short), Collector())
    except CmpchatError as error:
        refusal.update({"refused": True, "message": str(error), "one_line": "\n" not in str(error)})
    else:
        refusal.update({"refused": False, "message": None, "one_line": None})
        handle.cancel()
        engine.run_until_idle()
    data["refusal"] = refusal
    say(f"pool: a {oversize}-token prompt: {refusal}")
    part.save()
    engine.stop()
    del model, backend, engine, pool, handles
    free_gpu(part)

    # A small pool: 16 growing requests, preempted and resumed, against each one's run alone.
    part.check_time("the small pool")
    model = open_part_model(part, sequences=POOL_SEQUENCES, cache_states=1, kv_tokens=sizes["small_pool"],
                            gpu_mem=POOL_GPU_MEM, what="the small pool")  # fmt: skip
    engine, tokenizer = model.engine, model.tokenizer
    grow = GenerationOptions(max_tokens=sizes["grow_max_tokens"], ignore_eos=True)
    requests = [GenerationRequest(tuple(prompt_tokens(tokenizer, sizes["grow_prompt"], 11 * i + 3)), grow)
                for i in range(GROW_REQUESTS)]  # fmt: skip
    result: dict[str, Any] = {"requests": GROW_REQUESTS, "pool_tokens": model.backend.pool.total_tokens,
                              "prompt_tokens": sizes["grow_prompt"], "max_tokens": sizes["grow_max_tokens"]}  # fmt: skip
    data["growing"] = result
    say(f"pool: {GROW_REQUESTS} requests of {sizes['grow_prompt']} + {sizes['grow_max_tokens']} tokens in a "
        f"{result['pool_tokens']}-token pool")  # fmt: skip
    start = time.perf_counter()
    together = [Collector() for _ in requests]
    handles = [engine.submit(request, sink) for request, sink in zip(requests, together)]
    items = [_active_request(engine, handle) for handle in handles]
    drive(part, engine, handles, "the growing requests")
    result.update({
        "seconds": round(time.perf_counter() - start, 2),
        "completed": sum(1 for c in together if c.finished is not None and c.finished.reason == "length"),
        "finish_reasons": [c.finished.reason if c.finished else f"failed: {c.failed}" for c in together],
        "preemptions": engine.stats.preemptions,
        "admissions": [getattr(item, "admissions", None) for item in items],
    })  # fmt: skip
    say(f"pool: {result['completed']}/{GROW_REQUESTS} completed with {result['preemptions']} preemptions "
        f"in {result['seconds']} s")  # fmt: skip
    part.save()

    # Each alone (greedy), compared token by token where the engine's internals show the ids, else by text.
    firsts: list[int | None] = []
    explained: dict[str, bool] = {}
    identical = 0
    longest = 0.0
    for index, (request, batched, item) in enumerate(zip(requests, together, items)):
        if part.left() < 1.5 * longest + 3:
            result["alone_stopped"] = f"out of time after {index} of {GROW_REQUESTS} runs alone"
            say(f"pool: {result['alone_stopped']}")
            break
        engine.prefix_cache.clear()
        alone = Collector()
        handle = engine.submit(request, alone)
        alone_item = _active_request(engine, handle)
        began = time.perf_counter()
        drive(part, engine, [handle], "a run alone")
        longest = max(longest, time.perf_counter() - began)
        first = first_difference(batched, item, alone, alone_item, len(request.prompt))
        firsts.append(first)
        identical += first is None
        if first is not None and alone_item is not None and item is not None:
            explained[str(index)] = parting_is_explained(model.backend, request.prompt,
                                                         alone_item.tokens[len(request.prompt):],
                                                         item.tokens[len(request.prompt):], first)  # fmt: skip
        result.update({"compared": len(firsts), "identical": identical,
                       "first_differences": {str(i): f for i, f in enumerate(firsts) if f is not None},
                       "explained_by_rounding": explained,
                       "compared_by": "token ids" if item is not None else "text (characters)"})  # fmt: skip
        part.save()
    say(f"pool: {identical} of {len(firsts)} equal to their runs alone; first differences "
        f"{result.get('first_differences')}; parted within rounding: {explained}")  # fmt: skip
    engine.stop()


@dataclass
class Collector:
    """An event sink that keeps what a measurement needs."""

    on_start: Callable[[], int] | None = None
    started: float | None = None
    value_at_start: int | None = None
    finished: Any = None
    failed: str | None = None
    text: list[str] = field(default_factory=list)

    def __call__(self, events: Sequence[Any]) -> None:
        from cmpchat.engine.events import ContentDelta, Finished, ReasoningDelta
        from cmpchat.engine.request import Failed, Started

        for event in events:
            if isinstance(event, Started):
                self.started = time.perf_counter()
                if self.on_start is not None:
                    self.value_at_start = self.on_start()
            elif isinstance(event, ContentDelta | ReasoningDelta):
                self.text.append(event.text)
            elif isinstance(event, Finished):
                self.finished = event
            elif isinstance(event, Failed):
                self.failed = event.message


def drive(part: Part, engine: Any, handles: Sequence[Any], what: str) -> None:
    """Step the engine on this thread until it is idle; past the deadline, cancel and stop."""
    while engine.step():
        if part.left() <= 0:
            for handle in handles:
                handle.cancel()
            engine.run_until_idle()
            raise OutOfTime(f"out of time during {what}")


def _active_request(engine: Any, handle: Any) -> Any:
    """The engine's own record of a just-submitted request (it holds the token ids it read and generated); None
    if the engine's internals have moved (then replies are compared by text)."""
    try:
        return next(item for item in engine.scheduler.waiting if item.handle is handle)
    except (AttributeError, StopIteration):
        return None


def first_difference(batched: Collector, item: Any, alone: Collector, alone_item: Any, prompt: int) -> int | None:
    """The first generated token (or, without the ids, character) where two replies differ; None if equal."""
    if item is not None and alone_item is not None:
        a, b = list(item.tokens[prompt:]), list(alone_item.tokens[prompt:])
    else:
        a, b = list("".join(batched.text)), list("".join(alone.text))  # type: ignore[arg-type]
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


# -- app --------------------------------------------------------------------------------------------


def part_app(part: Part) -> None:
    from cmpchat.chat.messages import Message
    from cmpchat.engine.reply import GenerationOptions

    data, sizes = part.data, part.sizes
    data["path"] = ("Model.chat, as the app's reply worker calls it (on this script's thread, the engine driven "
                    "by the caller); the app's drawing is not measured")  # fmt: skip
    model = open_part_model(part, sequences=1, cache_states=4, what="the app's defaults")
    tokenizer = model.tokenizer
    # Random weights may end a reply at once: end tokens are ignored so the first reply is as long as asked.
    options = GenerationOptions(max_tokens=sizes["app_reply"], ignore_eos=True)
    first = [Message("user", long_message(tokenizer, sizes["app_conversation"]))]
    say(
        f"app: first turn, a user message of about {sizes['app_conversation']} tokens, a {sizes['app_reply']}-token reply"
    )
    reply = chat(part, model, first, options, "the first turn")
    data["first_turn"] = _turn(reply, len(model.chat_request(first, options, enable_thinking=False).prompt))
    part.save()
    second = [
        *first,
        Message("assistant", reply.content, reasoning_content=reply.reasoning or None,
                tool_calls=[event.call for event in reply.tool_calls]),
        Message("user", SECOND_MESSAGE),
    ]  # fmt: skip
    say("app: second turn")
    answer = chat(part, model, second, options, "the second turn")
    before = list(model.chat_request(first, options, enable_thinking=False).prompt)
    prompt = list(model.chat_request(second, options, enable_thinking=False).prompt)
    # New in the second turn: everything after the point where its prompt parts from the first turn's (the
    # template re-renders the earlier reply there), whatever the engine resumed.
    common = next((i for i, (a, b) in enumerate(zip(before, prompt)) if a != b), min(len(before), len(prompt)))
    new = len(prompt) - common
    read = answer.timings.prompt_tokens
    data["second_turn"] = _turn(answer, len(prompt))
    data.update({"ttft_s": round(answer.timings.time_to_first_token, 4), "prompt_tokens": read,
                 "new_tokens": new, "prompt_length": len(prompt), "cached_tokens": len(prompt) - read,
                 "conversation_tokens": data["first_turn"]["prompt_length"]})  # fmt: skip
    say(f"app: second turn read {read} of its {len(prompt)} prompt tokens ({new} new since the first turn's "
        f"prompt); time to first token {data['ttft_s']} s")  # fmt: skip
    part.save()

    # Those new tokens on a fresh sequence (warm-up first; the logits' copy to the host waits for the GPU).
    model.engine.prefix_cache.clear()
    backend, chunk = model.backend, model.engine.scheduler.prefill_chunk
    tail = prompt[len(prompt) - new :]
    seconds = []
    for _ in range(PREFILL_REPEATS + 1):
        part.check_time("the fresh prefill")
        sequence = backend.new_sequence()
        try:
            seconds.append(timed_prefill(backend, sequence, tail, chunk))
        finally:
            backend.release(sequence)
    data["prefill_new_runs_s"] = [round(s, 5) for s in seconds[1:]]
    data["prefill_new_s"] = round(statistics.median(seconds[1:]), 5)
    data["ratio"] = round(data["ttft_s"] / data["prefill_new_s"], 3) if data["prefill_new_s"] > 0 else None
    part.save()
    # For information: the same tokens read after the conversation they follow (attention over its context).
    part.check_time("the prefill after the context")
    sequence = backend.new_sequence()
    try:
        timed_prefill(backend, sequence, prompt[: len(prompt) - new], chunk)
        data["prefill_new_after_context_s"] = round(timed_prefill(backend, sequence, tail, chunk), 5)
    finally:
        backend.release(sequence)
    say(f"app: fresh prefill of {new} tokens {data['prefill_new_s']} s (after the context "
        f"{data['prefill_new_after_context_s']} s); ratio {data['ratio']} (mark <= {APP_MARK})")  # fmt: skip
    model.engine.stop()


def chat(part: Part, model: Any, messages: list, options: Any, what: str) -> Any:
    from cmpchat.engine.events import Finished

    part.check_time(what)
    cancel = threading.Event()
    finished = None
    for event in model.chat(messages, options, enable_thinking=False, cancel=cancel):
        if isinstance(event, Finished):
            finished = event
        elif part.left() <= 0:
            cancel.set()
    if finished is None or finished.reason == "cancelled":
        raise OutOfTime(f"out of time during {what}")
    return finished


def _turn(finished: Any, prompt_length: int) -> dict:
    t = finished.timings
    return {"finish_reason": finished.reason, "prompt_length": prompt_length, "prompt_tokens": t.prompt_tokens,
            "generated": t.generated_tokens, "ttft_s": round(t.time_to_first_token, 4),
            "prompt_tok_s": round(t.prompt_tokens_per_second, 1)}  # fmt: skip


def timed_prefill(backend: Any, sequence: Any, tokens: Sequence[int], chunk: int) -> float:
    """Seconds to read `tokens` into `sequence` in the engine's chunks, until the last logits reach the host."""
    start = time.perf_counter()
    logits = None
    for offset in range(0, len(tokens), chunk):
        logits = backend.prefill(sequence, tokens[offset : offset + chunk])
    backend.to_host(logits)
    return time.perf_counter() - start


# -- shared ------------------------------------------------------------------------------------------


def open_part_model(part: Part, *, sequences: int, cache_states: int, what: str, context: int | None = None,
                    kv_tokens: int | None = None, gpu_mem: int | None = None) -> Any:  # fmt: skip
    """The model as `open_model` opens it; on the CPU with KV pages scaled like every other size."""
    from cmpchat.commands.progress import StderrProgress

    part.check_time(f"loading {what}")
    say(f"{part.name}: loading {part.path.name} ({what}: {sequences} sequences, {cache_states} saved, context "
        f"{context or 'of the model'}, KV pool {kv_tokens or 'what fits'}"
        f"{f', gpu_mem {gpu_mem / 2**30:.0f} GiB' if gpu_mem and part.cuda else ''})")  # fmt: skip
    start = time.perf_counter()
    if part.cuda:
        from cmpchat.api import open_model

        progress = StderrProgress()
        try:
            model = open_model(part.path, backend="cuda", sequences=sequences, cache_states=cache_states,
                               context=context, kv_tokens=kv_tokens, gpu_mem=gpu_mem, progress=progress)  # fmt: skip
        finally:
            progress.close()
    else:
        from cmpchat.api import Model
        from cmpchat.backends.reference.model import ReferenceBackend
        from cmpchat.model.gguf_file import ModelFile

        model_file = ModelFile(part.path)
        backend = ReferenceBackend(model_file, context=context, pool_tokens=kv_tokens, max_sequences=sequences + cache_states,
                                   page_tokens=part.sizes["cpu_page_tokens"])  # fmt: skip
        backend.warm_up(None, max_rows=min(sequences, backend.max_batch))
        model = Model(model_file, backend, slots=sequences)
    seconds = round(time.perf_counter() - start, 1)
    part.data.setdefault("load_seconds", {})[what] = seconds
    say(f"{part.name}: loaded in {seconds} s")
    return model


def free_gpu(part: Part) -> None:
    gc.collect()
    if part.cuda:
        from numba import cuda

        cuda.current_context().deallocations.clear()
        free, total = cuda.current_context().get_memory_info()
        part.data.setdefault("gpu_free_after_release_GiB", []).append(round(free / 2**30, 1))


def prompt_tokens(tokenizer: Any, count: int, seed: int) -> list[int]:
    """`count` ordinary tokens, different for each seed: a header and the passage's tokens, rotated."""
    head = tokenizer.encode(f"Request {seed}: ", parse_special=False)
    body = tokenizer.encode(PASSAGE * 4, parse_special=False)
    tokens = head + [body[(seed * 7 + i) % len(body)] for i in range(max(count - len(head), 0))]
    return tokens[:count]


def long_message(tokenizer: Any, target: int) -> str:
    """A user message of about `target` tokens: numbered notes of the passage's sentences."""
    sentences = [s.strip().rstrip(".") + "." for s in PASSAGE.split(". ") if s.strip()]
    sizes = [len(tokenizer.encode(f" {s}", parse_special=False)) for s in sentences]
    notes: list[str] = []
    count = 0
    while count < target:
        label = f"Note {len(notes)}:"
        sentence = len(notes) % len(sentences)
        notes.append(f"{label} {sentences[sentence]}")
        count += len(tokenizer.encode(label, parse_special=False)) + sizes[sentence] + 1
    return "\n".join(notes)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _import_project() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def _child_env() -> dict[str, str]:
    """Our environment, with the repository first on the path (the carried wheels' PYTHONPATH kept)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p), "PYTHONUNBUFFERED": "1"}


def _line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, OutOfTime | RuntimeError) else f"{type(error).__name__}: {text}"


def _write_json(path: Path, data: dict) -> None:
    scratch = path.with_suffix(".json.tmp")
    scratch.write_text(json.dumps(data, indent=1, default=str))
    scratch.replace(path)


if __name__ == "__main__":
    sys.exit(main())
