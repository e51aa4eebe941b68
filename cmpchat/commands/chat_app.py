"""`cmpchat chat` (and `cmpchat` with no command): the terminal chat app.

The model: `-m FILE`, else the one used last, else a picker of GGUF files found on the machine, else the
demo model (with a banner saying its replies are random). With `--url`, the model of an OpenAI-compatible
server instead (`cmpchat serve` on another machine, llama-server, vLLM...); the history stays on this one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cmpchat.api import BACKENDS
from cmpchat.commands.model_args import add_load_arguments, load_options
from cmpchat.errors import CmpchatError


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "chat", help="open the terminal chat app (what `cmpchat` alone does)", description=__doc__
    )
    add_app_arguments(parser)
    parser.set_defaults(handler=run)


def add_app_arguments(parser: argparse.ArgumentParser) -> None:
    """The app's options; also added to the top-level parser so `cmpchat -m FILE` works without `chat`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("-m", "--model", metavar="MODEL", help="GGUF model file (default: the last one used)")
    source.add_argument("--demo", action="store_true", help="open the demo model (random weights)")
    source.add_argument("--pick", action="store_true", help="choose among the GGUF files found on this machine")
    source.add_argument(
        "--url",
        metavar="URL",
        help="chat with the model of an OpenAI-compatible server, e.g. http://HOST:8080/v1 (`cmpchat serve`)",
    )
    parser.add_argument("--api-key", metavar="KEY", help="with --url: the server's API key (sent as a bearer token)")
    parser.add_argument(
        "--model-name", metavar="NAME", help="with --url: the served model to use (default: the first one listed)"
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, help="compute backend (default: from config, else auto)"
    )
    add_load_arguments(parser)
    parser.add_argument(
        "--mmproj",
        metavar="FILE",
        help="with -m: the model's vision projector, to send images (default: the mmproj file beside the model)",
    )
    parser.add_argument(
        "--simulated-gpus",
        type=int,
        metavar="N",
        help="show N simulated GPUs in the GPU panel instead of reading NVML (to try the panel on any machine)",
    )


def run(args: argparse.Namespace) -> int:
    # Imported here: Textual and the image protocols are only needed when the app opens, and
    # textual_image must query the terminal before Textual takes it over.
    from cmpchat.gpu_readings import FakeGpuSampler, GpuSampler
    from cmpchat.tui.app import CmpchatApp
    from cmpchat.tui.model_request import ModelRequest
    from cmpchat.tui.remote_model import RemoteServer
    from cmpchat.tui.settings import load_settings

    settings, problems = load_settings()
    if args.backend:
        settings.backend = args.backend
    if (args.api_key or args.model_name) and not args.url:
        raise CmpchatError("--api-key and --model-name go with --url (the server to chat with)")
    options = load_options(args)
    if options and args.url:
        raise CmpchatError("--gpus, --gpu-mem, --split, --ctx, --kv-tokens and --kv lay a model out on this machine; "
                           "with --url the server has its own (give them to `cmpchat serve`)")  # fmt: skip
    projector = Path(args.mmproj).expanduser() if args.mmproj else None
    if projector is not None and not args.model:
        raise CmpchatError("--mmproj goes with -m (the model file whose vision projector it is)")
    if projector is not None and not projector.is_file():
        raise CmpchatError(f"{projector}: no such file; give the path of the model's mmproj .gguf file")
    request: ModelRequest | None = None
    if args.url:
        request = ModelRequest(server=RemoteServer(args.url.rstrip("/"), args.api_key, args.model_name))
    elif args.model:
        path = Path(args.model).expanduser()
        if not path.is_file():
            raise CmpchatError(f"{path}: no such file; give the path of a .gguf model file")
        request = ModelRequest(path, projector)
    elif args.demo:
        request = ModelRequest(None)
    sampler: GpuSampler | None = FakeGpuSampler(args.simulated_gpus) if args.simulated_gpus else None
    app = CmpchatApp(model_request=request, settings=settings, settings_problems=problems, gpu_sampler=sampler,
                     load_options=options)  # fmt: skip
    if args.pick:
        app.requested_model = None
        app.app_state.last_model = None
    app.run()
    return app.return_code or 0
