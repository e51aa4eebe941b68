"""`cmpchat eval`: perplexity over a text, divergence of engine configurations from a base, pass-key grid.

    cmpchat eval MODEL --text FILE                                   # perplexity
    cmpchat eval MODEL --text FILE --base backend=cpu --test backend=cpu,mirror_gpu=1
    cmpchat eval MODEL --text FILE --test model=OTHER.gguf           # mean / p99 KL, top-1 agreement
    cmpchat eval MODEL --needle --needle-max 65536                   # pass key at depths 10-90%

A configuration is `key=value,...` (keys: see --help); every --test is compared with --base on the same
windows of the text, in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cmpchat import Model, open_model
from cmpchat.commands.progress import StderrProgress
from cmpchat.errors import CmpchatError
from cmpchat.evaluation.needle import DEPTHS, MIN_TRIALS, NeedleGrid, lengths_up_to, needle_grid
from cmpchat.evaluation.quality import TextScore, score_text
from cmpchat.evaluation.spec import EngineSpec, keys_help

CONTEXT_MARGIN = 64  # tokens past the longest prompt that a GPU sequence needs for the answer


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval",
        help="perplexity, KL divergence between configurations, pass-key retrieval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help="GGUF model file")
    parser.add_argument("--text", metavar="FILE", help="text file to measure perplexity and divergence on")
    parser.add_argument("--ctx", type=int, default=512, metavar="N", help="window size in tokens (default 512)")
    parser.add_argument("--chunks", type=int, metavar="N", help="use at most N windows of the text")
    parser.add_argument("--base", default="", metavar="SPEC", help=f"the reference configuration ({keys_help()})")
    parser.add_argument(
        "--test", action="append", default=[], metavar="SPEC", help="a configuration to compare (repeatable)"
    )
    parser.add_argument("--needle", action="store_true", help="run the pass-key grid")
    parser.add_argument("--needle-max", type=int, default=8192, metavar="N", help="longest context (default 8192)")
    parser.add_argument("--lengths", metavar="N,N", help="context lengths instead of 1K doubling to --needle-max")
    parser.add_argument("--depths", metavar="P,P", help="depths in percent (default 10,20,...,90)")
    parser.add_argument(
        "--trials", type=int, default=MIN_TRIALS, metavar="N", help=f"trials per cell (default {MIN_TRIALS})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(handler=run)


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CmpchatError(f"{what} must be whole numbers separated by commas, not '{text}'") from None
    if not values:
        raise CmpchatError(f"{what} is empty")
    return values


def run(args: argparse.Namespace) -> int:
    if not args.text and not args.needle:
        raise CmpchatError("nothing to measure: give --text FILE, --needle, or both")
    if args.chunks is not None and args.chunks < 1:
        raise CmpchatError("--chunks must be at least 1")
    base_spec = EngineSpec.parse(args.base)
    test_specs = [EngineSpec.parse(t) for t in args.test]
    text = None
    if args.text:
        try:
            text = Path(args.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CmpchatError(f"cannot read the text file {args.text}: {err}") from None
    lengths: list[int] = []
    depths = list(DEPTHS)
    if args.needle:
        lengths = _int_list(args.lengths, "--lengths") if args.lengths else lengths_up_to(args.needle_max)
        if args.depths:
            depths = [d / 100 for d in _int_list(args.depths, "--depths")]
    context = max([args.ctx] + lengths) + CONTEXT_MARGIN

    base = _open(base_spec, args.model, context)
    tests: dict[str, Model] = {}
    for spec in test_specs:
        name, copy = spec.describe(), 1
        while name in tests or name == base_spec.describe():
            copy += 1  # the same configuration twice still gets a row of its own
            name = f"{spec.describe()} ({copy})"
        tests[name] = _open(spec, args.model, context)
    result: dict = {"model": str(args.model), "base": base_spec.describe()}
    progress = StderrProgress()
    try:
        if text is not None:
            tokens = base.tokenize(text)
            for name, model in tests.items():
                if model.tokenize(text) != tokens:
                    raise CmpchatError(f"configuration '{name}' tokenizes the text differently from the base")
            score = score_text(base, tests, tokens, args.ctx, max_windows=args.chunks, progress=progress)
            result["text"] = {"file": str(args.text), **score.as_dict()}
        grids: dict[str, NeedleGrid] = {}
        if args.needle:
            for name, model in {base_spec.describe(): base, **tests}.items():
                grids[name] = needle_grid(model, lengths, depths, args.trials, seed=args.seed, progress=progress)
            result["needle"] = {name: {**g.as_dict(), "longest_at_90": g.longest_at(0.9)} for name, g in grids.items()}
    finally:
        progress.close()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        if text is not None:
            _print_text(base_spec.describe(), score)
        for name, grid in grids.items():
            _print_grid(name, grid)
    return 0


def _open(spec: EngineSpec, default_model: str, context: int) -> Model:
    arguments = {"context": context, **spec.open_arguments()}
    progress = StderrProgress()
    try:
        return open_model(spec.model_path(default_model), progress=progress, **arguments)
    finally:
        progress.close()


def _print_text(base_name: str, score: TextScore) -> None:
    print(
        f"text: {score.tokens} tokens, {score.windows} windows of {score.window_tokens}, "
        f"{score.scored_tokens} scored (the second half of each window)"
    )
    width = max([len(base_name)] + [len(n) for n in score.tests])
    print(f"  {'configuration':<{width}}  perplexity  KL mean    KL p99     KL max     top-1")
    print(f"  {base_name:<{width}}  {score.perplexity:10.4f}  (base)")
    for name, d in score.tests.items():
        print(
            f"  {name:<{width}}  {d.perplexity:10.4f}  {d.kl_mean:9.3e}  {d.kl_p99:9.3e}  {d.kl_max:9.3e}  "
            f"{100 * d.top1_agreement:6.2f}%"
        )


def _print_grid(name: str, grid: NeedleGrid) -> None:
    print(f"pass key, {name}: accuracy over {grid.trials} trials per cell")
    print("  length " + "".join(f"{round(100 * d):>6d}%" for d in grid.depths) + "     all")
    for length, row in zip(grid.lengths, grid.accuracy):
        print(f"  {length:>6d} " + "".join(f"{v:7.2f}" for v in row) + f"{sum(row) / len(row):8.2f}")
    longest = grid.longest_at(0.9)
    print(f"  longest context with every depth >= 90%: {longest if longest else 'none'}")
    sys.stdout.flush()
