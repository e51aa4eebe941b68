"""`cmpchat serve`: the model behind an OpenAI-compatible HTTP API. It listens on 127.0.0.1 (this
machine only) unless --host says otherwise."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cmpchat.api import Model
from cmpchat.commands.model_args import add_model_arguments, open_from_args
from cmpchat.errors import CmpchatError
from cmpchat.server.settings import ServerSettings


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API", description=__doc__
    )
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument("--slots", type=int, default=4, metavar="N", help="requests generated together (default 4)")
    parser.add_argument(
        "--queue",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait for a slot; more get 503 (default 64)",
    )
    key = parser.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        metavar="KEY",
        help="require the key on every route but /health, as 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'",
    )
    key.add_argument("--api-key-file", metavar="FILE", help="read the API key from FILE (keeps it out of `ps`)")
    parser.add_argument("--alias", metavar="NAME", help="the model id clients see (default: the file name)")
    parser.add_argument(
        "--max-tokens", type=int, default=4096, metavar="N", help="reply limit when a request sets none (default 4096)"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        metavar="N",
        help="prompt tokens per engine step; prompt states are saved for reuse at these boundaries (default 512)",
    )
    parser.add_argument(
        "--cache-states",
        type=int,
        default=16,
        metavar="N",
        help="saved prompt states kept for prefix reuse, 0 = off (default 16)",
    )
    parser.add_argument(
        "--max-request-mb", type=float, default=8.0, metavar="MB", help="largest request body (default 8 MB)"
    )
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed to call the API (CORS), e.g. http://localhost:3000; repeatable",
    )
    parser.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="fetch images that requests give by http(s) URL (default: only data: URIs are read); the server then "
        "connects wherever its clients point it",
    )
    parser.set_defaults(handler=run)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    try:
        return ServerSettings(
            host=args.host,
            port=args.port,
            slots=args.slots,
            max_queue=args.queue,
            api_key=_api_key(args),
            max_request_bytes=int(args.max_request_mb * 2**20),
            default_max_tokens=args.max_tokens,
            prefill_chunk=args.prefill_chunk,
            prefix_cache_entries=args.cache_states,
            model_name=args.alias,
            allowed_origins=tuple(args.allow_origin),
            allow_remote_images=args.allow_remote_images,
        )
    except ValueError as err:
        raise CmpchatError(str(err).replace("_", "-")) from None


def run(args: argparse.Namespace) -> int:
    # The web stack is imported only here: other commands (and machines without it) never load it.
    from cmpchat.server.app import create_app
    from cmpchat.server.runner import address_of, bind, is_loopback, make_server

    settings = settings_from_args(args)
    failure: list[str] = []

    def load() -> Model:
        return open_from_args(
            args,
            sequences=settings.slots,
            cache_states=settings.prefix_cache_entries,
            max_waiting=settings.max_queue,
            prefill_chunk=settings.prefill_chunk,
        )

    def on_load_failure(message: str) -> None:
        failure.append(message)
        server.should_exit = True

    sock = bind(settings.host, settings.port)
    server = make_server(create_app(settings, load, on_load_failure=on_load_failure))
    print(f"cmpchat serve: listening on {address_of(sock)}/v1 (the model is loading)", file=sys.stderr)
    if not is_loopback(settings.host) and settings.api_key is None:
        print(
            f"warning: listening on {settings.host} without --api-key: anyone who can reach this machine can use it",
            file=sys.stderr,
        )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failure:
        raise CmpchatError(f"the model failed to load: {failure[0]}")
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is None:
        return args.api_key
    try:
        key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise CmpchatError(f"cannot read the API key file {args.api_key_file}: {err.strerror}") from None
    if not key:
        raise CmpchatError(f"the API key file {args.api_key_file} is empty")
    return key
