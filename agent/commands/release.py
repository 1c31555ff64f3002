"""`edge-agent release build release.toml --key KEY [--out FILE]`: a signed release of a device's
whole desired state from a release folder (`release_rollout.build` says the layout);
`edge-agent release verify FILE --key PUBLIC`: the document's signature, and each part beside it
against the document (its size, sha256, name and version), as the leader checks them before a
rollout (the leader then checks each part whole through its own kind)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agent.core.errors import EdgeAgentError

if TYPE_CHECKING:
    from release_rollout.build import Describe
    from release_rollout.document import PartKind


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    build = sub.add_parser("build", help="make a signed release document from a folder's release.toml")
    build.add_argument("spec", type=Path, metavar="RELEASE.toml")
    build.add_argument("--key", required=True, type=Path, help="the fleet's signing key (private.pem)")
    build.add_argument("--out", type=Path, help="the document to write (default: NAME-VERSION.earel beside the toml)")
    build.add_argument("--force", action="store_true", help="replace --out when it exists")
    verify = sub.add_parser("verify", help="check a release document and the parts beside it")
    verify.add_argument("document", type=Path, metavar="FILE")
    verify.add_argument("--key", required=True, type=Path, help="the fleet's public key (public.pem)")


def _describers() -> dict[PartKind, Describe]:
    from agent.leader.rollout_kinds import ROLLOUT_KINDS

    return {kind: ROLLOUT_KINDS[kind].traits.describe for kind in ("firmware", "config", "app")}


def _build(args: argparse.Namespace) -> int:
    from agent.core.files import atomic_write
    from release_rollout.build import build_from_toml
    from release_rollout.document import SUFFIX, peek_release
    from rollout_engine.keys import load_signing_key

    key = load_signing_key(args.key)
    data = build_from_toml(args.spec, key, _describers(), created_ms=int(time.time() * 1000))
    document = peek_release(data)
    out = args.out or args.spec.parent / f"{document.name}-{document.version}{SUFFIX}"
    if out.resolve().parent != args.spec.resolve().parent:
        raise EdgeAgentError(f"--out {out}: a release document goes beside its parts ({args.spec.parent})")
    if out.exists() and not args.force:
        raise EdgeAgentError(f"{out}: exists already (give --force to replace it)")
    atomic_write(out, data)
    order = " then ".join("+".join(stage) for stage in document.order)
    print(f"{out}: release {document.name} {document.version}: {document.says()}; converges {order}; signed by key"
          f" {key.key_id.hex()}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from release_rollout.build import file_digest
    from release_rollout.document import FILE_MAX, parse_release
    from rollout_engine.keys import load_verify_key

    data = args.document.read_bytes()[:FILE_MAX + 1]
    signed = parse_release(data, load_verify_key(args.key), source=str(args.document))
    describe = _describers()
    for p in signed.document.parts:
        file = args.document.parent / p.file
        where = f"{args.document}: part {p.id} ({file})"
        if not file.is_file():
            raise EdgeAgentError(f"{where}: not found (a release's parts are kept beside its document)")
        if file.stat().st_size != p.size or file_digest(file) != p.sha256:
            raise EdgeAgentError(f"{where}: its size or sha256 differs from the signed release")
        found = describe[p.kind](file)
        if (found.name, found.version) != (p.name, p.version):
            raise EdgeAgentError(f"{where}: it is {found.name} {found.version}, the release says {p.name} {p.version}")
    d = signed.document
    print(f"{args.document}: ok: release {d.name} {d.version}: {d.says()}; every part beside it matches")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return _build(args) if args.action == "build" else _verify(args)
    except EdgeAgentError as exc:
        print(f"edge-agent release {args.action}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"edge-agent release {args.action}: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
