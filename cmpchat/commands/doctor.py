"""`cmpchat doctor`: measure every GPU's memory, compute and link paths and say which look throttled."""

from __future__ import annotations

import argparse
import json

from cmpchat.commands.progress import StderrProgress
from cmpchat.cudart.target import add_profile_option, apply_profile_option, describe, status
from cmpchat.doctor.probe import measure_gpus
from cmpchat.doctor.report import format_report, json_report


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "doctor", help="measure each GPU and say which paths look throttled", description=__doc__
    )
    parser.add_argument(
        "--gpu", type=int, nargs="+", action="extend", metavar="N", help="GPU index to measure (default: all)"
    )
    parser.add_argument(
        "--tensor-cores", action="store_true",
        help="also measure tensor-core (wmma) throughput; cmpchat itself never uses them",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller host copies")
    parser.add_argument("--json", action="store_true", help="print the figures and findings as JSON")
    add_profile_option(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    apply_profile_option(args)  # the probes compile for the code path it names (cudart/target.py)
    progress = StderrProgress()
    try:
        measurements = measure_gpus(args.gpu, tensor_cores=args.tensor_cores, quick=args.quick, progress=progress)
    finally:
        progress.close()
    code_path = describe()  # the GPU is still named as it is; under a profile, the code that ran is said too
    if args.json:
        print(json.dumps(json_report(measurements) | ({"code_path": status()} if code_path else {}), indent=1))
    else:
        print("\n".join([*code_path, format_report(measurements)]))
    return 0
