"""Kernel micro-benchmarks (each a `python -m` command line) beside the model benchmarks."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def add_shapes_argument(parser: argparse.ArgumentParser, shapes: Iterable[str], default: Iterable[str]) -> None:
    """The optional model-shape names a micro-benchmark takes. argparse checks a list default of `nargs="*"`
    against `choices` as one value and refuses it, so each name is checked as it is parsed instead."""
    known = list(shapes)

    def shape(name: str) -> str:
        if name not in known:
            raise argparse.ArgumentTypeError(f"unknown model shape {name!r} (choose from {', '.join(known)})")
        return name

    parser.add_argument("models", nargs="*", type=shape, default=list(default), metavar="SHAPE",
                        help=f"model shapes (default: {' '.join(default)})")  # fmt: skip
