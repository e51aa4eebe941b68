"""Summarise one kernel's SASS from Nsight Compute's source page (`ncu --page source --print-source sass --csv`,
as `cuda/kernel_profile.sh` writes it): the opcode mix by executed warp instructions and by stall samples, and
the same two shares for each stretch between barriers (a kernel's phases), with the share of FFMA/IDP in it.

    python3 cuda/sass_hotspots.py NAME.csv [--top 12]
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter
from pathlib import Path

_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_MATH = ("FFMA", "IDP")


def read_rows(path: Path) -> list[dict[str, str]]:
    """The instruction rows of the CSV (ncu prints its own lines before the header)."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise SystemExit(f"{path}: no SASS table (was the kernel profiled with --page source --csv?)")
    return list(csv.DictReader(lines[start:]))


def opcode(source: str) -> str:
    words = _PREDICATE.sub("", source.strip()).split()
    return words[0].split(".")[0] if words else "?"


def summarise(rows: list[dict[str, str]], top: int) -> str:
    executed = [int(row["Instructions Executed"] or 0) for row in rows]
    stalls = [int(row["Warp Stall Sampling (All Samples)"] or 0) for row in rows]
    total, samples = max(1, sum(executed)), max(1, sum(stalls))
    by_opcode, stalled_at = Counter(), Counter()
    for row, count, stall in zip(rows, executed, stalls, strict=True):
        by_opcode[opcode(row["Source"])] += count
        stalled_at[opcode(row["Source"])] += stall
    out = [f"{sum(executed):,} warp instructions, {sum(stalls):,} stall samples", "opcode      instructions  stalls"]
    out += [
        f"{name:10} {count / total:13.1%} {stalled_at[name] / samples:7.1%}"
        for name, count in by_opcode.most_common(top)
    ]
    barriers = [i for i, row in enumerate(rows) if "BAR.SYNC" in row["Source"]]
    edges = [0, *(b + 1 for b in barriers), len(rows)]
    out.append("between barriers (SASS lines)  instructions  stalls  FFMA/IDP share")
    for first, end in zip(edges, edges[1:], strict=False):
        part = sum(executed[first:end])
        math = sum(
            c for c, row in zip(executed[first:end], rows[first:end], strict=True) if opcode(row["Source"]) in _MATH
        )
        out.append(
            f"  {first:6}-{end:<6} {part / total:25.1%} {sum(stalls[first:end]) / samples:7.1%} {math / max(1, part):10.1%}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=12, help="opcodes listed")
    args = parser.parse_args(argv)
    print(summarise(read_rows(args.csv), args.top))


if __name__ == "__main__":
    main()
