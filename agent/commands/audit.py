"""`edge-agent audit --config leader.toml [--since 24h] [--json]`: who did what to the fleet.

Every rollout control, identity action, configuration layer change and remote session, oldest
first, with who did it (docs/remote.md, "Who did what"). `--json` exports it as JSON lines, one
action a line, for a log store or a SIEM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from agent.core.durations import parse_seconds
from agent.core.errors import ConfigError, EdgeAgentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the leader's config (its database)")
    where.add_argument("--db", metavar="PATH", help="the leader's database: leader.db, or a postgresql:// URL")
    parser.add_argument("--since", default="30d", help="how far back (default 30d; e.g. 24h, 90m)")
    parser.add_argument("--limit", type=int, default=10_000, help="at most this many of each kind")
    parser.add_argument("--json", action="store_true", help="JSON lines, one action a line")


def main(args: argparse.Namespace) -> int:
    from agent.leader.audit_view import audit_trail
    from agent.leader.readonly import open_leader_db

    try:
        try:
            since_ms = int((time.time() - parse_seconds(args.since)) * 1000)
        except ValueError:
            raise ConfigError("--since", None, f"{args.since!r} is not a duration (e.g. 24h, 90m, 30d)") from None
        if args.config:
            from agent.core.config import load_config
            from agent.leader.agent import LEADER_DB
            from agent.leader.database import shared_database

            config = load_config(args.config)
            base = Path(config.agent.data_dir)
            context = open_leader_db(base / LEADER_DB, shared=shared_database(config, base))
        else:
            context = open_leader_db(args.db)
        with context as db:
            entries = audit_trail(db, since_ms=since_ms, limit=max(1, args.limit))
    except EdgeAgentError as exc:
        print(f"edge-agent audit: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import msgspec

        for entry in entries:
            print(json.dumps(msgspec.to_builtins(entry), sort_keys=True, ensure_ascii=False))
        return 0
    if not entries:
        print(f"no operator actions on record since {args.since} ago")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at_ms / 1000))
        print(f"{when}  {e.area:<8} {e.action:<8} {e.subject:<24} by {e.actor or 'someone unrecorded'}"
              + (f": {e.outcome}" if e.outcome else "") + (f"  ({e.detail})" if e.detail else ""))
    return 0


__all__ = ["add_arguments", "main"]
