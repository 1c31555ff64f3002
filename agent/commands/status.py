"""`edge-agent status --db PATH`: the fleet as the leader's database records it."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, metavar="PATH", help="the leader's registry database")
    parser.add_argument("--json", action="store_true", help="print JSON")


def main(args: argparse.Namespace) -> int:
    from agent.leader.status import status_command

    return status_command(args.db, args.json)
