"""A bounded load generator for `cmpchat serve`: N streamed chat requests, C at a time, over loopback.

    python -m tests.server.loadgen --model tiny     # or demo, or a GGUF path; starts its own server process
    python -m tests.server.loadgen --url http://127.0.0.1:8080 --requests 300 --concurrency 16

It reports latency and time-to-first-token percentiles, requests/s and generated tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

LOOPBACK_PREFIXES = ("http://127.", "http://localhost", "http://[::1]")


@dataclass
class LoadReport:
    wall_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failures: list[str] = field(default_factory=list)

    def summary(self, label: str) -> str:
        done = len(self.latencies)
        return "\n".join(
            [
                f"load test ({label}): {done} requests ok, {len(self.failures)} failed, {self.wall_seconds:.2f} s",
                f"  latency        {_percentiles(self.latencies)}",
                f"  first token    {_percentiles(self.first_tokens)}",
                f"  throughput     {done / self.wall_seconds:.1f} req/s, "
                f"{self.completion_tokens / self.wall_seconds:.1f} generated tok/s, "
                f"{self.prompt_tokens / self.wall_seconds:.1f} prompt tok/s "
                f"({self.cached_tokens} of {self.prompt_tokens} prompt tokens reused)",
            ]
        )


def _percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return f"p50 {cuts[49] * 1000:.0f} ms, p90 {cuts[89] * 1000:.0f} ms, p99 {cuts[98] * 1000:.0f} ms, max {max(values) * 1000:.0f} ms"


async def run_load(
    api_url: str, *, requests: int, concurrency: int, max_tokens: int, timeout: float = 120.0
) -> LoadReport:
    """Send `requests` streamed chat completions, `concurrency` at a time, to a loopback server."""
    if not api_url.startswith(LOOPBACK_PREFIXES):
        raise ValueError("the load generator only targets servers on this machine (loopback)")
    report = LoadReport()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        body = {
            "model": "load",
            "messages": [{"role": "user", "content": f"Request {index % 40}: tell me something new."}],
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "seed": index,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with gate:
            start = time.perf_counter()
            first: float | None = None
            try:
                async with client.stream("POST", api_url + "/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        report.failures.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                        return
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            report.failures.append(chunk["error"]["message"])
                            return
                        delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                        if first is None and (delta.get("content") or delta.get("reasoning_content")):
                            first = time.perf_counter() - start
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                            report.completion_tokens += usage["completion_tokens"]
                            report.prompt_tokens += usage["prompt_tokens"]
                            report.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            except httpx.HTTPError as err:
                report.failures.append(f"{type(err).__name__}: {err}")
                return
            elapsed = time.perf_counter() - start
            report.latencies.append(elapsed)
            report.first_tokens.append(first if first is not None else elapsed)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        report.wall_seconds = time.perf_counter() - began
    return report


def _serve_in_subprocess(model: str, slots: int, port: int) -> subprocess.Popen[bytes]:
    """`cmpchat serve` in its own process, so the load generator does not share its GIL."""
    code = (
        "import argparse, sys\n"
        "from cmpchat.commands import serve\n"
        "parser = argparse.ArgumentParser(); serve.add_parser(parser.add_subparsers(dest='command'))\n"
        "args = parser.parse_args(['serve', *sys.argv[1:]])\n"
        "sys.exit(args.handler(args))\n"
    )
    command = [sys.executable, "-c", code, "--port", str(port), "--slots", str(slots), "--queue", "1024"]
    if model != "demo":
        command += ["-m", model]
    return subprocess.Popen(
        command, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=Path(__file__).parents[2]
    )


def _tiny_model_path() -> Path:
    from cmpchat.chat.template import builtin_template
    from cmpchat.model.builder import build_model
    from tests.conftest import TINY_SHAPE, add_byte_vocabulary

    path = Path(os.environ.get("TMPDIR", "/tmp")) / "cmpchat-loadgen-tiny.gguf"
    if not path.exists():
        build_model(path, TINY_SHAPE, add_tokenizer=add_byte_vocabulary, chat_template=builtin_template(), seed=7)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's base URL (loopback only)")
    parser.add_argument("--model", default="tiny", help="tiny, demo or a GGUF path (when no --url)")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--port", type=int, default=18765)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        model = str(_tiny_model_path()) if args.model == "tiny" else args.model
        server = _serve_in_subprocess(model, args.slots, args.port)
        url = f"http://127.0.0.1:{args.port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                server.terminate()
                print("the server did not come up", file=sys.stderr)
                return 1
            time.sleep(0.2)
    try:
        report = asyncio.run(
            run_load(url + "/v1", requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens)
        )
        metrics = httpx.get(url + "/metrics").text
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    print(report.summary(f"{args.model}, {args.slots} slots, {args.concurrency} clients, {args.max_tokens} tokens"))
    for line in metrics.splitlines():
        if line.startswith(("cmpchat_prompt_tokens_per_second", "cmpchat_decode_tokens_per_second")):
            print("  server", line)
    for failure in report.failures[:5]:
        print("  failure:", failure)
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
