"""`cmpchat run`: one prompt, the reply streamed to the terminal, then the speeds."""

from __future__ import annotations

import argparse
import json
import sys

from cmpchat.chat.messages import ImagePart, Message, TextPart
from cmpchat.commands.model_args import add_model_arguments, open_from_args
from cmpchat.engine.events import ContentDelta, Finished, ReasoningDelta, ToolCallEvent
from cmpchat.engine.reply import GenerationOptions
from cmpchat.errors import CmpchatError
from cmpchat.sampling import SamplingParams

_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("run", help="answer one prompt and print the speeds", description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("-p", "--prompt", required=True, help="the user message")
    parser.add_argument("-s", "--system", help="a system prompt")
    parser.add_argument(
        "--image", action="append", default=[], metavar="FILE", help="an image the message shows (repeatable)"
    )
    parser.add_argument(
        "-n", "--max-tokens", type=int, default=512, metavar="N", help="most tokens to generate (default 512)"
    )
    parser.add_argument(
        "--temp", type=float, default=0.7, metavar="T", help="sampling temperature, 0 = greedy (default 0.7)"
    )
    parser.add_argument(
        "--top-p", type=float, default=0.8, metavar="P", help="nucleus sampling threshold (default 0.8)"
    )
    parser.add_argument(
        "--top-k", type=int, default=20, metavar="K", help="sample among the K likeliest tokens (default 20)"
    )
    parser.add_argument("--seed", type=int, metavar="S", help="seed for reproducible sampling")
    parser.add_argument("--no-think", action="store_true", help="answer without a reasoning block")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise CmpchatError("-n must be at least 1")
    sampling = SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    model = open_from_args(args)
    content: str | list[ImagePart | TextPart] = args.prompt
    if args.image:
        content = [*(ImagePart(path) for path in args.image), TextPart(args.prompt)]
    messages = ([Message("system", args.system)] if args.system else []) + [Message("user", content)]
    options = GenerationOptions(sampling=sampling, max_tokens=args.max_tokens)
    styled = sys.stdout.isatty()
    in_reasoning = False
    out = sys.stdout
    for event in model.chat(messages, options, enable_thinking=False if args.no_think else None):
        if isinstance(event, ReasoningDelta):
            if styled and not in_reasoning:
                out.write(_DIM)
            in_reasoning = True
            out.write(event.text)
        elif isinstance(event, ContentDelta | ToolCallEvent):
            if in_reasoning:
                out.write((_RESET if styled else "") + "\n\n")
                in_reasoning = False
            if isinstance(event, ContentDelta):
                out.write(event.text)
            else:
                call = event.call
                out.write(f"\n[tool call] {call.name}({json.dumps(call.arguments, ensure_ascii=False)})\n")
        elif isinstance(event, Finished):
            if in_reasoning and styled:
                out.write(_RESET)
            out.write("\n")
            out.flush()
            _print_timings(event)
        out.flush()
    return 0


def _print_timings(finished: Finished) -> None:
    t = finished.timings
    print(
        f"prompt: {t.prompt_tokens} tokens, {t.prompt_tokens_per_second:.1f} tok/s | "
        f"reply: {t.generated_tokens} tokens, {t.decode_tokens_per_second:.1f} tok/s | "
        f"first token after {t.time_to_first_token:.2f} s | finished: {finished.reason}",
        file=sys.stderr,
    )
