"""Issue 27's setup as a user runs it: a model split into pipeline stages (`--gpus`, `--gpu-mem`) planned by
`cmpchat info`, then served by `cmpchat serve`, answering a chat completion, streamed and not, and reporting its
stages at /v1/cmpchat/gpus and /metrics. (The app's side: `tests/tui/speed_check.py --app-args "--gpus ..."`.)

    python3 cuda/pipeline_smoke.py [--model 27B] [--gpus 0,0,0] [--gpu-mem 16G] [--results DIR]

Exit status 0 when every check passed; results.json in DIR says what each returned. Standard library only, beside
cmpchat itself.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (http://\S+?)/v1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="27B", help="a benchmark shape (built on first use) or a GGUF file")
    parser.add_argument("--gpus", default="0,0,0")
    parser.add_argument("--gpu-mem", default="16G")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/cmpchat-bench"))
    parser.add_argument("--results", type=Path, default=REPO / "out" / "pipeline-smoke")
    parser.add_argument("--load-timeout", type=float, default=300)
    args = parser.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from cmpchat.bench.model_files import bench_model_path

    path = bench_model_path(args.model, args.folder)
    stages = ["--gpus", args.gpus, "--gpu-mem", args.gpu_mem]
    checks: dict[str, Any] = {"model": str(path), "stages": stages}
    info = subprocess.run([sys.executable, "-m", "cmpchat", "info", str(path), *stages], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    print(info.stdout, info.stderr, flush=True)
    checks["info"] = {"returncode": info.returncode, "stage lines": info.stdout.count("stage ")}
    server = subprocess.Popen([sys.executable, "-m", "cmpchat", "serve", "-m", str(path), *stages, "--port", "0"],
                              cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    url: list[str] = []
    tail: list[str] = []

    def read() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            print("  [server]", line.rstrip(), flush=True)
            tail.append(line.rstrip())
            if not url and (match := LISTENING.search(line)):
                url.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    started = time.monotonic()
    try:
        while not (url and _get(url[0] + "/health")[0] == 200):
            if server.poll() is not None or time.monotonic() - started > args.load_timeout:
                checks["serve"] = {"error": f"not ready (exit {server.poll()}): {' | '.join(tail[-3:])}"}
                return finish(checks, args.results)
            time.sleep(0.5)
        base = url[0]
        checks["load_seconds"] = round(time.monotonic() - started, 1)
        request = {"model": "any", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 32}
        status, body = _post(base + "/v1/chat/completions", request)
        reply = json.loads(body) if status == 200 else {}
        checks["chat"] = {"status": status, "finish_reason": (reply.get("choices") or [{}])[0].get("finish_reason"),
                          "completion_tokens": (reply.get("usage") or {}).get("completion_tokens")}  # fmt: skip
        status, body = _post(base + "/v1/chat/completions", {**request, "stream": True})
        events = [line for line in body.splitlines() if line.startswith("data: ")]
        checks["stream"] = {
            "status": status,
            "events": len(events),
            "done": bool(events) and events[-1] == "data: [DONE]",
        }
        status, body = _get(base + "/v1/cmpchat/gpus")
        checks["gpus_endpoint"] = {"status": status, "body": json.loads(body) if status == 200 else body[:300]}
        status, body = _get(base + "/metrics")
        checks["metrics"] = {"status": status, "stage lines": sum("stage=" in line for line in body.splitlines())}
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return finish(checks, args.results)


def finish(checks: dict[str, Any], results: Path) -> int:
    expected_stages = len(checks["stages"][1].split(","))
    passed = {
        "info plans every stage": checks["info"]["returncode"] == 0
        and checks["info"]["stage lines"] >= expected_stages,
        "chat answers": checks.get("chat", {}).get("status") == 200 and bool(checks["chat"].get("completion_tokens")),
        "stream ends with [DONE]": bool(checks.get("stream", {}).get("done")),
        "gpus endpoint answers": checks.get("gpus_endpoint", {}).get("status") == 200,
        "metrics per stage": checks.get("metrics", {}).get("stage lines", 0) >= expected_stages,
    }
    checks["passed"] = passed
    (results / "results.json").write_text(json.dumps(checks, indent=1))
    for what, ok in passed.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    print(json.dumps({k: v for k, v in checks.items() if k != "gpus_endpoint"}, indent=1), flush=True)
    return 0 if all(passed.values()) else 1


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except OSError as error:
        return 0, str(error)


def _post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


if __name__ == "__main__":
    sys.exit(main())
