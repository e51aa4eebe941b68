"""Arguments and model opening shared by the commands that load a model."""

from __future__ import annotations

import argparse
import sys

from cmpchat.commands.progress import StderrProgress
from cmpchat.demo import DEMO_NOTICE
from cmpchat.engine import BACKENDS, Model, open_model


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", metavar="MODEL", help="GGUF model file (default: the built-in demo model)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="compute backend (default: auto)")


def open_from_args(args: argparse.Namespace) -> Model:
    progress = StderrProgress()
    try:
        model = open_model(args.model, backend=args.backend, progress=progress)
    finally:
        progress.close()
    if model.is_demo:
        print(f"note: {DEMO_NOTICE}", file=sys.stderr)
    return model
