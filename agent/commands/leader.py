"""`edge-agent leader migrate --from LEADER_DB --to postgresql://...`: grow a single gateway's
leader into a fleet whose leaders share a PostgreSQL database.

    edge-agent leader migrate --from /var/lib/edge-agent/leader.db --to postgresql://ea@db/fleet
    edge-agent leader migrate --from leader.db --to postgresql://ea@db/fleet --password-file pw

The leader is stopped first; its device registry (with the processed message ids), application
messages, rejects, device identities, job queue, rollouts and configuration layers are copied in
one transaction, and each table's rows are counted; then `[leader] database` names the URL and
the same leader starts again on the same data directory (its outbox stays in its leader.db). The
password: `--password-file` (mode 0600), else libpq's own (PGPASSWORD, ~/.pgpass).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    migrate = actions.add_parser("migrate", help="copy a stopped leader's shared state into PostgreSQL")
    migrate.add_argument("--from", dest="source", required=True, metavar="LEADER_DB",
                         help="the stopped leader's database (DATA_DIR/leader.db)")
    migrate.add_argument("--to", dest="target", required=True, metavar="URL",
                         help="the fleet's database: postgresql://USER@HOST[:PORT]/DB")
    migrate.add_argument("--password-file", metavar="FILE", help="the database password (a file of mode 0600)")
    migrate.add_argument("--into-non-empty", action="store_true",
                         help="add to a database that already holds devices, messages or rejects (rows there win)")


def main(args: argparse.Namespace) -> int:
    from agent.core.errors import ConfigError
    from agent.core.sql import ServerUrl, store_target
    from agent.leader.migrate import copy_to_server
    from agent.service.files import read_secret

    source = Path(args.source)
    if not source.is_file():
        raise ConfigError("--from", None, f"{source}: no such file (the leader's DATA_DIR/leader.db)")
    password = read_secret(args.password_file, what="--password-file") if args.password_file else None
    target = store_target(args.target, password=password, source="--to", key="")
    if not isinstance(target, ServerUrl):
        raise ConfigError("--to", None, f"{args.target}: not a postgresql:// URL")
    copied = copy_to_server(source, target, into_non_empty=args.into_non_empty)
    for table, rows in copied.items():
        print(f"{table}: {rows} rows")
    print(f"copied {sum(copied.values())} rows of {len(copied)} tables into {target}. Next: set [leader] database ="
          f" \"{target}\" in the leader's config and start it again on {source.parent} (its outbox stays in"
          f" {source.name}).")
    return 0
