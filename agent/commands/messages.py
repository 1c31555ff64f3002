"""`edge-agent messages --db LEADER_DB [--device ID] [--class NAME]`: the application messages
the leader stored, oldest first (`--newest N`: the last N), read-only.

    edge-agent messages --db /var/lib/edge-agent/leader.db --device pi-0001 --class telemetry
    edge-agent messages --db leader.db --newest 20 --json
"""

from __future__ import annotations

import argparse
import json
import time

from agent.commands.arguments import aligned, whole_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, metavar="PATH",
                        help="the leader's database: leader.db, or the fleet's postgresql:// URL")
    parser.add_argument("--device", metavar="ID", help="only this device's")
    parser.add_argument("--class", dest="cls", metavar="NAME", help="only this class")
    parser.add_argument("--limit", type=whole_number, default=100, metavar="N", help="rows to print (default 100)")
    parser.add_argument("--after", type=whole_number, default=0, metavar="ID", help="only rows after this row id")
    parser.add_argument("--newest", type=whole_number, metavar="N", help="the newest N rows instead")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


def _payload_text(content_type: str, payload: bytes) -> str:
    if content_type.split(";")[0].strip() in ("application/json", "text/plain"):
        text = payload.decode("utf-8", "replace")
        return text if len(text) <= 80 else text[:77] + "..."
    return f"<{len(payload)} bytes {content_type}>"


def main(args: argparse.Namespace) -> int:
    from agent.leader.messages import payload_fields, read_messages

    limit = args.newest if args.newest is not None else args.limit
    total, rows = read_messages(args.db, device_id=args.device, cls=args.cls, limit=limit, after_id=args.after,
                                newest=args.newest is not None)
    if args.json:
        for r in rows:
            doc = {"id": r.id, "msg_id": r.msg_id, "device": r.device_id, "class": r.cls, "key": r.key, "seq": r.seq,
                   "ts_ms": r.ts_ms, "received_ms": r.received_ms, "content_type": r.content_type,
                   **payload_fields(r.content_type, r.payload)}
            print(json.dumps(doc, ensure_ascii=False))
        return 0
    if not rows:
        print("no messages" + (f" ({total} match, none after {args.after})" if total else ""))
        return 0
    print(f"{len(rows)} of {total} messages")
    table = [("ID", "RECEIVED (UTC)", "DEVICE", "CLASS", "KEY", "PAYLOAD")]
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.received_ms / 1000.0))
        table.append((str(r.id), when, r.device_id, r.cls, r.key or "-", _payload_text(r.content_type, r.payload)))
    for line in aligned(table):
        print(line)
    return 0
