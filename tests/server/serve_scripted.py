"""The server over the scripted backend in a process of its own, for tests that send it signals.

    python -m tests.server.serve_scripted MODEL.gguf [--grace SECONDS]

It prints the address it listens on, then serves, as `cmpchat serve` does, until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cmpchat.server.app import create_app
from cmpchat.server.runner import address_of, bind, make_server
from cmpchat.server.settings import ServerSettings
from tests.server.conftest import scripted_model

STEP_SECONDS = 0.005
"""Each decode step's time: a reply of N tokens takes about N * 5 ms."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--grace", type=float, default=ServerSettings().shutdown_grace_seconds)
    args = parser.parse_args()
    model = scripted_model(args.model, step_delay=STEP_SECONDS)
    settings = ServerSettings(port=0, shutdown_grace_seconds=args.grace)
    sock = bind("127.0.0.1", 0)
    server = make_server(create_app(settings, lambda: model), log_level="warning", access_log=False)
    print(address_of(sock), flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
