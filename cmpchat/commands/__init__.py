"""One module per `cmpchat` sub-command, each with `add_parser(subparsers)` and a handler."""
