"""`edge-agent config check FILE...`: load each file as the agent would, report the first error."""

from __future__ import annotations

import argparse
import sys

from agent.core.config import load_config
from agent.core.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="check config files; exit 2 on the first bad one")
    check.add_argument("files", nargs="+", metavar="FILE")


def main(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            config = load_config(path)
        except ConfigError as exc:
            print(f"edge-agent config: {exc}", file=sys.stderr)
            status = 2
            continue
        print(f"{path}: ok ({config.agent.role} {config.agent.device_id!r}, fleet {config.agent.fleet!r})")
    return status
