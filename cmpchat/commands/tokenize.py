"""`cmpchat tokenize`: the token ids of a text, space-separated; needs only the tokenizer metadata."""

from __future__ import annotations

import argparse

from cmpchat.model.gguf_file import ModelFile
from cmpchat.tokenizer import Tokenizer


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("tokenize", help="print the token ids of a text", description=__doc__)
    parser.add_argument("-m", "--model", required=True, metavar="MODEL", help="GGUF file (a vocab-only file works)")
    parser.add_argument("text", help="the text to tokenize (special tokens such as <|im_start|> are matched)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    tokenizer = Tokenizer.from_metadata(ModelFile(args.model).metadata)
    print(" ".join(str(i) for i in tokenizer.encode(args.text)))
    return 0
