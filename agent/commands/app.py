"""`edge-agent app build DIR --key KEY --out FILE`: a signed application bundle from a directory
holding `app.toml`, its unit and its files (`app_rollout.bundle` says the layout);
`edge-agent app removal NAME --version V --key KEY --out FILE`: a signed removal of an
application, rolled out like a bundle (it stops it and removes its versions, its data kept);
`edge-agent app verify FILE --key PUBLIC`: a bundle checked whole, as a device checks it;
`edge-agent app helper --config CONFIG [--socket PATH]`: the root application helper
(`app_rollout.device.helper`), started by edge-agent-apps.socket.

The helper reads the fleet's key from its own root-owned config (`[firmware] public_key` or
`trust_root`, the same file as the install helper's), keeps applications under `[apps] root`,
writes their units to `[apps] unit_dir`, hides `[apps] hidden` from every application, and
answers root and `[firmware] helper_user` only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pwd
import sys
import time
from pathlib import Path

from agent.core.errors import EdgeAgentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    build = sub.add_parser("build", help="make a signed bundle from a directory with app.toml")
    build.add_argument("directory", type=Path, metavar="DIR")
    build.add_argument("--key", required=True, type=Path, help="the fleet's signing key (private.pem)")
    build.add_argument("--out", required=True, type=Path, help="the bundle to write (NAME-VERSION.eaapp)")
    build.add_argument("--force", action="store_true", help="replace --out when it exists")
    build.add_argument("--whole-files", action="store_true",
                       help="list no file by its chunks: a changed file is fetched whole (needs no fastcdc)")
    removal = sub.add_parser("removal", help="make a signed removal of an application, to roll out like a bundle")
    removal.add_argument("name", metavar="NAME", help="the application to remove")
    removal.add_argument("--version", required=True,
                         help="above the version the devices run (a removal goes forward, like a version)")
    removal.add_argument("--key", required=True, type=Path, help="the fleet's signing key (private.pem)")
    removal.add_argument("--out", required=True, type=Path, help="the file to write (NAME-removed-VERSION.eaapp)")
    removal.add_argument("--force", action="store_true", help="replace --out when it exists")
    verify = sub.add_parser("verify", help="check a bundle whole, as a device would")
    verify.add_argument("bundle", type=Path, metavar="FILE")
    verify.add_argument("--key", required=True, type=Path, help="the fleet's public key (public.pem)")
    helper = sub.add_parser("helper", help="the root helper that installs and starts applications for the agent")
    helper.add_argument("--config", required=True, type=Path, metavar="CONFIG",
                        help="the helper's own config (/etc/edge-agent/installer.toml: root-owned)")
    helper.add_argument("--socket", type=Path, metavar="PATH",
                        help="listen here (default: the socket systemd passes, else [apps] helper_socket)")


def _build(args: argparse.Namespace) -> int:
    from app_rollout.bundle import build_bundle
    from rollout_engine.keys import load_signing_key

    key = load_signing_key(args.key)
    app = build_bundle(args.directory, key, args.out, created_ms=int(time.time() * 1000), force=args.force,
                       chunks=not args.whole_files)
    m = app.manifest
    chunked = [f for f in m.files if f.chunks]
    by_chunks = f" ({len(chunked)} by {sum(len(f.chunks) for f in chunked)} chunks)" if chunked else ""
    kind = f"container application (image sha256:{m.container.image_id[:12]})" if m.container else "application"
    print(f"{args.out}: {kind} {m.name} {m.version}, {len(m.files)} files{by_chunks}, {app.size} bytes,"
          f" health {m.health.check}, signed by key {app.key_id}")
    return 0


def _removal(args: argparse.Namespace) -> int:
    from app_rollout.bundle import build_removal
    from rollout_engine.keys import load_signing_key

    app = build_removal(args.name, args.version, load_signing_key(args.key), args.out,
                        created_ms=int(time.time() * 1000), force=args.force)
    print(f"{args.out}: removal of application {app.name} at {app.version}, signed by key {app.key_id}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from app_rollout.bundle import read_bundle
    from rollout_engine.keys import load_verify_key

    app = read_bundle(args.bundle, load_verify_key(args.key))
    what = (f"removal of application {app.name} at {app.version}" if app.manifest.runtime == "removed"
            else f"application {app.name} {app.version}, {len(app.manifest.files)} files")
    print(f"{args.bundle}: ok: {what}, signed by key {app.key_id}")
    return 0


async def _helper(args: argparse.Namespace) -> int:
    from agent.core.clock import SystemClock
    from agent.core.config import load_config
    from agent.service.helper_socket import listening_socket
    from app_rollout.device.helper import AppHelper
    from rollout_engine.trust import load_fleet_keys

    config = load_config(args.config)
    fw, apps = config.firmware, config.apps
    if not fw.keyed:
        raise EdgeAgentError(f"{args.config}: firmware.public_key: required (or trust_root): the helper checks every"
                             " bundle with it")
    root = Path(apps.root)
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    key = load_fleet_keys(public_key=fw.public_key, trust_root=fw.trust_root, trust_document=fw.trust_document,
                          state_dir=root / ".trust", now_ms=SystemClock().now_ms)
    assert key is not None
    log = logging.getLogger(__name__)
    try:
        uids = frozenset({pwd.getpwnam(fw.helper_user).pw_uid})
    except KeyError:
        uids = frozenset({0})
        log.warning("firmware.helper_user: no user %r: only root may ask the helper", fw.helper_user)
    sock = listening_socket(args.socket or (Path(apps.helper_socket) if apps.helper_socket else None))
    if sock is None:
        raise EdgeAgentError(f"{args.config}: apps.helper_socket: no socket: not started by systemd's socket unit"
                             " and none given (--socket)")
    helper = AppHelper(key=key, root=root, unit_dir=Path(apps.unit_dir), hidden=tuple(apps.hidden),
                       allowed_uids=uids)
    log.info("application helper: %d applications kept in %s", len(helper.records()), root)
    await helper.serve(sock)
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        if args.action == "build":
            return _build(args)
        if args.action == "verify":
            return _verify(args)
        if args.action == "removal":
            return _removal(args)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return asyncio.run(_helper(args))
    except EdgeAgentError as exc:
        print(f"edge-agent app {args.action}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"edge-agent app {args.action}: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
