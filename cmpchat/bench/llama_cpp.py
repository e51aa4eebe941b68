"""llama.cpp's `llama-bench` on the same file and GPU, for the comparison column of `cmpchat bench`.

`cuda/build_llama_cpp.sh` builds it; any llama-bench (or a wrapper script that runs one) works. It runs
with every layer on the GPU, FlashAttention on, and JSON output; this module parses that output.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cmpchat.errors import CmpchatError


@dataclass(frozen=True)
class LlamaResult:
    prompt_tokens: int
    generated_tokens: int
    depth: int
    """Context already in the cache when the timed tokens run."""
    tokens_per_second: float
    build: str


def decode_command(executable: Path, model: Path, depths: Sequence[int], tokens: int = 128) -> list[str]:
    """tg`tokens` at each context depth on GPU 0, all layers offloaded, FlashAttention on."""
    return [
        str(executable), "-m", str(model), "-p", "0", "-n", str(tokens), "-d", ",".join(str(d) for d in depths),
        "-ngl", "99", "-fa", "1", "-r", "3", "-o", "json",
    ]  # fmt: skip


def prompt_command(executable: Path, model: Path, prompt_sizes: Sequence[int]) -> list[str]:
    """pp`N` for each prompt size, no generation."""
    return [
        str(executable), "-m", str(model), "-p", ",".join(str(n) for n in prompt_sizes), "-n", "0",
        "-ngl", "99", "-fa", "1", "-r", "2", "-o", "json",
    ]  # fmt: skip


def run_llama_bench(command: list[str], timeout: float = 1800) -> list[LlamaResult]:
    """Run llama-bench and parse its results; one clear error line when it fails."""
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise CmpchatError(f"llama-bench not found at {command[0]}; build it with cuda/build_llama_cpp.sh") from None
    except subprocess.TimeoutExpired:
        raise CmpchatError(f"llama-bench ran longer than {timeout:.0f} s; stopped") from None
    if finished.returncode != 0:
        last = (finished.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CmpchatError(f"llama-bench failed (exit {finished.returncode}): {last}")
    return parse_llama_bench_json(finished.stdout)


def parse_llama_bench_json(text: str) -> list[LlamaResult]:
    """The entries of llama-bench's `-o json` output (a JSON list; log lines before it are skipped)."""
    start = text.find("[")
    try:
        entries = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        entries = None
    if not isinstance(entries, list):
        raise CmpchatError("could not read llama-bench's JSON output")
    results = []
    for entry in entries:
        build = f"{entry.get('build_number', '?')} ({str(entry.get('build_commit', '?'))[:9]})"
        results.append(
            LlamaResult(
                prompt_tokens=int(entry.get("n_prompt", 0)),
                generated_tokens=int(entry.get("n_gen", 0)),
                depth=int(entry.get("n_depth", 0)),
                tokens_per_second=float(entry["avg_ts"]),
                build=build,
            )
        )
    return results
