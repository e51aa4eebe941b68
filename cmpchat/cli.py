"""The `cmpchat` command line: parses arguments, runs one command, turns user errors into one line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cmpchat import __version__
from cmpchat.commands import bench, chat_app, doctor, info, run, serve, tokenize
from cmpchat.commands import eval as evaluate
from cmpchat.errors import CmpchatError

COMMANDS = (chat_app, run, serve, info, tokenize, bench, doctor, evaluate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cmpchat",
        description="Chat with Qwen3.5 / Qwen3.6 models on NVIDIA CMP 100-210 mining GPUs. "
        "With no command, opens the chat app.",
        allow_abbrev=False,  # the app's options would make a command's own short forms ambiguous (doctor's --gpu)
    )
    parser.add_argument("--version", action="version", version=f"cmpchat {__version__}")
    chat_app.add_app_arguments(parser)  # `cmpchat [-m FILE]` alone opens the chat app
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args.handler = chat_app.run
    try:
        return args.handler(args)
    except CmpchatError as err:
        print(f"cmpchat: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `cmpchat tokenize ... | head`); nothing left to say.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
