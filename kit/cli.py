"""The ``kit`` command line: one sub-command per room (``kit demo``, ``kit dht``, ...).

Each room that has a command exposes ``add_command(subparsers)``, registering its parser with a
``handler(args) -> int``; this module only collects them, so ``kit --help`` is the index.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# Modules that register sub-commands, in the order ``kit --help`` lists them.
COMMAND_MODULES = (
    "kit.demo",
    "kit.volunteer",
    "kit.coordinator_cli",
    "kit.revoke_cli",
    "kit.preflight",
    "kit.p2p.demo",
    "kit.data.cli",
    "kit.evaluate_cli",
    "kit.dht.cli",
    "kit.member_relay",  # adds --join to `kit dht`
    # kit-cli-modules (rooms add their module above this line)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kit", description="Train one model together over the Internet."
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="kit's logging level (DEBUG also shows other libraries' INFO lines; default INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_command(subparsers)
    return parser


def configure_logging(level_name: str) -> None:
    """kit's own messages at ``level_name``; other libraries' only from WARNING, unless DEBUG.

    websockets logs every HTTP answer and connection at INFO ("HTTP response sent", "connection
    closed"): on a console those lines would bury kit's messages and break its progress line.
    """
    level = getattr(logging, level_name.upper(), None)
    if not isinstance(level, int):
        level = logging.INFO
    logging.basicConfig(
        level=level if level <= logging.DEBUG else max(level, logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("kit").setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(str(args.log_level))
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
