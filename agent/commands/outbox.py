"""`edge-agent outbox stats --db PATH`."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    stats = actions.add_parser("stats", help="depth by status and class, counters, conservation")
    stats.add_argument("--db", required=True, metavar="PATH", help="the agent's outbox database")
    stats.add_argument("--json", action="store_true", help="print JSON")


def main(args: argparse.Namespace) -> int:
    from agent.outbox.commands import outbox_stats

    return outbox_stats(args.db, args.json)
