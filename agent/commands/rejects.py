"""`edge-agent rejects list|show --db LEADER_DB`: the messages the leader refused, and why.

    edge-agent rejects list --db leader.db                 counts by sender and reason, newest rows
    edge-agent rejects list --db leader.db --device pi-7   one device's
    edge-agent rejects show --db leader.db 42              one row with the first bytes it kept
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from agent.commands.arguments import aligned, whole_number
from agent.leader.reject_view import printable

if TYPE_CHECKING:
    from agent.leader.reject_view import RejectCount, RejectRow



def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="counts by sender and reason, and the newest rows")
    listing.add_argument("--device", metavar="ID", help="only what this device sent")
    listing.add_argument("--limit", type=whole_number, default=20, metavar="N",
                         help="rows to print (default 20; 0: all)")
    show = actions.add_parser("show", help="one refused message in full")
    show.add_argument("id", type=whole_number, metavar="ID")
    for action in (listing, show):
        action.add_argument("--db", required=True, metavar="PATH",
                            help="the leader's database: leader.db, or the fleet's postgresql:// URL")
        action.add_argument("--json", action="store_true", help="print JSON")


def main(args: argparse.Namespace) -> int:
    import msgspec

    from agent.leader.readonly import open_leader_db

    with open_leader_db(args.db) as db:
        if args.action == "show":
            row = db.rejects.get(args.id)
            if row is None:
                print(f"edge-agent rejects: {args.db}: no reject {args.id}", file=sys.stderr)
                return 1
            print(msgspec.json.encode(row).decode() if args.json else format_reject(row))
            return 0
        counts = db.rejects.counts(device=args.device)
        rows = db.rejects.newest(device=args.device, limit=args.limit)
    if args.json:
        print(msgspec.json.encode({"counts": counts, "rows": rows}).decode())
    else:
        print(format_rejects(counts, rows))
    return 0


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000.0))


def format_rejects(counts: list[RejectCount], rows: list[RejectRow]) -> str:
    if not counts:
        return "no rejects"
    total = sum(c.count for c in counts)
    lines = [f"{total} rejects kept, by sender and reason:"]
    lines += ["  " + line for line in aligned([
        ("SENDER", "COUNT", "LAST (UTC)", "REASON"),
        *[(c.sender or "-", str(c.count), _when(c.last_ms), c.reason) for c in counts]])]
    lines.append(f"newest {len(rows)}:")
    lines += ["  " + line for line in aligned([
        ("ID", "AT (UTC)", "SENDER", "KIND", "SIZE", "REASON", "FIRST BYTES"),
        *[(str(r.id), _when(r.at_ms), r.sender or "-", r.kind or "-", str(r.size), r.reason, printable(r.head, 24))
          for r in rows]])]
    return "\n".join(lines)


def format_reject(row: RejectRow) -> str:
    lines = [
        f"reject {row.id} at {_when(row.at_ms)} UTC",
        f"  topic   {row.topic}",
        f"  sender  {row.sender or '-'}   kind {row.kind or '-'}   message id {row.msg_id or '-'}",
        f"  reason  {row.reason}",
        f"  size    {row.size} bytes, first {len(row.head)} kept:",
    ]
    for offset in range(0, len(row.head), 16):
        chunk = row.head[offset:offset + 16]
        lines.append(f"    {offset:04x}  {chunk.hex(' '):<47}  {printable(chunk, 16)}")
    return "\n".join(lines)
