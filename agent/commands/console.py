"""`edge-agent console --db LEADER_DB --token-file FILE [--listen 127.0.0.1:8080]`: the web
console, a process of its own beside the leader (see `agent.console`). Needs the `console` extra
(Jinja2): `pip install 'edge-agent[console]'`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.core.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, metavar="PATH", help="the leader's database (leader.db)")
    parser.add_argument("--token-file", required=True, metavar="FILE",
                        help="the access token, one line, mode 0600 (e.g. `openssl rand -hex 32 > FILE`)")
    parser.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                        help="where to serve (default 127.0.0.1:8080, loopback only)")
    parser.add_argument("--outbox", metavar="PATH", help="the leader's outbox (default: outbox.db beside --db)")


def main(args: argparse.Namespace) -> int:
    from agent.commands.preflight import listen_problem
    from agent.leader.readonly import open_leader_db
    from agent.service.files import check_private_file, read_secret

    problem = listen_problem(args.listen)
    if problem:
        raise ConfigError("--listen", None, problem)
    check_private_file(args.token_file, what="token file")
    token = read_secret(args.token_file)
    if len(token) < 16:
        raise ConfigError(args.token_file, None, "the token is shorter than 16 characters")
    with open_leader_db(args.db):
        pass  # a leader database, readable: checked once before serving
    try:
        from agent.console.server import Console, ConsoleConfig, ConsoleServer
    except ImportError as exc:
        raise ConfigError("console", None, f"needs the console extra ({exc.name} is missing):"
                                           " pip install 'edge-agent[console]'") from None
    db = Path(args.db)
    config = ConsoleConfig(db=db, outbox=Path(args.outbox) if args.outbox else db.with_name("outbox.db"), token=token)
    host, _, port = args.listen.rpartition(":")
    try:
        server = ConsoleServer((host.strip("[]"), int(port)), Console(config))
    except OSError as exc:
        raise ConfigError("--listen", None, f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    print(f"edge-agent console on http://{args.listen}/ for {db}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
