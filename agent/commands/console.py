"""`edge-agent console --db LEADER_DB --token-file FILE [--listen 127.0.0.1:8080]`: the web
console, a process of its own beside the leader (see `agent.console`); `--db postgresql://...
--artifacts DIR` serves the whole fleet of several leaders. Needs the `console` extra (Jinja2):
`pip install 'edge-agent[console]'`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.core.errors import ConfigError
from agent.core.sql import ServerUrl, StoreTarget, is_server_url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, metavar="PATH|URL",
                        help="the leader's database (leader.db), or the fleet's PostgreSQL database"
                             " (postgresql://USER@HOST/DB) that several leaders share")
    parser.add_argument("--token-file", required=True, metavar="FILE",
                        help="the access token, one line, mode 0600 (e.g. `(umask 077; openssl rand -hex 32 > FILE)`)")
    parser.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                        help="where to serve (default 127.0.0.1:8080, loopback only)")
    parser.add_argument("--outbox", metavar="PATH", help="the leader's outbox (default: outbox.db beside --db;"
                                                         " with a postgresql:// database, none unless given)")
    parser.add_argument("--artifacts", metavar="DIR",
                        help="the artifact store uploads go to and rollouts are started from (default: artifacts/"
                             " beside --db; with a postgresql:// database required: a directory every leader reads)")
    parser.add_argument("--public-key", metavar="FILE",
                        help="the fleet's public key (the leader's [firmware] public_key): artifacts uploaded in the"
                             " console are checked against it (without it the console takes no upload)")
    parser.add_argument("--operator-socket", metavar="PATH",
                        help="the leader's operator socket (its data dir's operator.sock): a device's page then fetches"
                             " its logs, as this console's user (one of the leader's remote.logs_operators)")
    parser.add_argument("--max-upload-mib", type=int, default=4096, metavar="MIB",
                        help="the largest artifact the console takes (default 4096)")


def main(args: argparse.Namespace) -> int:
    from agent.leader.readonly import open_leader_db
    from agent.service.files import check_private_file, read_secret
    from agent.service.healthhttp import parse_listen

    try:  # any host the operator names (loopback is the default), never "any free port"
        address = parse_listen(args.listen, allow_remote=True, min_port=1, key="--listen")
    except ConfigError as exc:
        raise ConfigError("--listen", None, exc.reason) from None
    if address is None:
        raise ConfigError("--listen", None, "give HOST:PORT, e.g. 127.0.0.1:8080")
    check_private_file(args.token_file, what="token file")
    token = read_secret(args.token_file)
    if len(token) < 16:
        raise ConfigError(args.token_file, None, "the token is shorter than 16 characters")
    db: StoreTarget
    if is_server_url(args.db):  # the whole fleet of several leaders (each keeps its own outbox)
        if not args.artifacts:
            raise ConfigError("--artifacts", None, "with a postgresql:// database, name the artifact store's directory"
                                                   " (one every leader reads: a shared mount)")
        db = ServerUrl(args.db)
        outbox = Path(args.outbox) if args.outbox else None
    else:
        db = Path(args.db)
        outbox = Path(args.outbox) if args.outbox else db.with_name("outbox.db")
    with open_leader_db(db):
        pass  # a leader database, readable: checked once before serving
    try:
        from agent.console.server import Console, ConsoleConfig, ConsoleServer
    except ImportError as exc:
        raise ConfigError("console", None, f"needs the console extra ({exc.name} is missing):"
                                           " pip install 'edge-agent[console]'") from None
    if args.public_key:
        from rollout_engine.keys import load_verify_key

        load_verify_key(args.public_key)  # a KeyFileError names the file
    if args.max_upload_mib < 1:
        raise ConfigError("--max-upload-mib", None, "give a size of at least 1 MiB")
    config = ConsoleConfig(db=db, outbox=outbox, token=token,
                           artifacts=Path(args.artifacts) if args.artifacts else None,
                           public_key=Path(args.public_key) if args.public_key else None,
                           max_upload_bytes=args.max_upload_mib * 1024 * 1024,
                           operator_socket=Path(args.operator_socket) if args.operator_socket else None)
    try:
        server = ConsoleServer(address, Console(config))
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
