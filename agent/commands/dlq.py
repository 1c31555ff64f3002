"""`edge-agent dlq list|show|replay|purge --db PATH`."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="list dead letters")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = actions.add_parser("show", help="show one dead letter")
    show.add_argument("id", type=int)
    for name, text in (("replay", "send dead letters again"), ("purge", "delete dead letters")):
        action = actions.add_parser(name, help=text)
        which = action.add_mutually_exclusive_group(required=True)
        which.add_argument("ids", nargs="*", type=int, default=[], metavar="ID")
        which.add_argument("--all", action="store_true", help=f"{name} every dead letter")
    for action_parser in (listing, show, *[actions.choices[n] for n in ("replay", "purge")]):
        action_parser.add_argument("--db", required=True, metavar="PATH", help="outbox database")


def main(args: argparse.Namespace) -> int:
    from agent.outbox import commands

    if args.action == "list":
        return commands.dlq_list(args.db, args.limit, args.json)
    if args.action == "show":
        return commands.dlq_show(args.db, args.id)
    ids = None if args.all else list(args.ids)
    if args.action == "replay":
        return commands.dlq_replay(args.db, ids)
    return commands.dlq_purge(args.db, ids)
