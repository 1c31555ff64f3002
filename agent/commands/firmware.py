"""`edge-agent firmware`: make, sign, check and look into signed firmware artifacts.

    keygen  --out DIR [--force]                 DIR/private.pem (0600) and DIR/public.pem
    build   IMAGE --version V (--key PRIV | --unsigned) --out ARTIFACT [--name N]
            [--chunks MIN:AVG:MAX | --chunk-size B] [--mirror URL ...]
            [--hardware H ...] [--min-version V] [--rollback [--rollback-from V ...]]
    publish ARTIFACT DIR                        copy as DIR/{image sha256}.eafw, for a static mirror
    sign    ARTIFACT --key PRIV [--out OUT]     (re)sign after checking the image
    verify  ARTIFACT --pubkey PUB [--installed-version V] [--hardware H] [--image NAME]
    inspect ARTIFACT [--json]
    install ARTIFACT --config CONFIG            into the inactive slot, a trial boot armed (agent stopped)
    status  --config CONFIG [--json]            the installer's slots and the update in progress
    commit  --config CONFIG                     keep the new slot booted on its trial
    revert  --config CONFIG                     the old slot is the default again

Every refusal or bad input is one line on stderr and exit status 2; `verify` exits 0 only when
the signature, every chunk, the whole image and the given policy all check out.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from agent.core.clock import SystemClock
from agent.core.errors import ConfigError, EdgeAgentError

if TYPE_CHECKING:
    from firmware_rollout.artifact.files import ContentDefined


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))

    keygen = sub.add_parser("keygen", help="create an ed25519 signing key pair")
    keygen.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for private.pem, public.pem")
    keygen.add_argument("--force", action="store_true", help="replace existing key files")

    build = sub.add_parser("build", help="make a signed artifact from an image file")
    build.add_argument("image", type=Path, metavar="IMAGE")
    build.add_argument("--version", required=True, help="semantic version of the image, e.g. 1.4.0")
    signer = build.add_mutually_exclusive_group(required=True)
    signer.add_argument("--key", type=Path, metavar="PRIVATE_PEM", help="ed25519 private key to sign with")
    signer.add_argument("--unsigned", action="store_true", help="leave unsigned, to sign later with `sign`")
    build.add_argument("--out", required=True, type=Path, metavar="ARTIFACT")
    build.add_argument("--force", action="store_true", help="replace an existing ARTIFACT")
    build.add_argument("--name", help="image name (default: the image file's stem)")
    chunking = build.add_mutually_exclusive_group()
    chunking.add_argument("--chunks", metavar="MIN:AVG:MAX", default="16384:65536:262144",
                          help="content-defined chunk sizes (FastCDC), the default 16384:65536:262144: two"
                               " versions share most chunks, and a device copies those from its active slot")
    chunking.add_argument("--chunk-size", type=int, default=None, metavar="BYTES",
                          help="fixed chunks instead (for devices whose agent predates content-defined chunks)")
    build.add_argument("--mirror", action="append", default=[], metavar="URL",
                       help="an HTTP(S) mirror serving URL/{image sha256}.eafw (see publish); repeatable")
    build.add_argument(
        "--hardware", action="extend", nargs="+", default=[], metavar="H", help="compatible hardware (default: any)"
    )
    build.add_argument("--min-version", metavar="V", help="lowest installed version this image may update")
    build.add_argument("--rollback", action="store_true", help="sign as an explicit rollback (may downgrade)")
    build.add_argument("--rollback-from", action="extend", nargs="+", default=[], metavar="V",
                       help="with --rollback: the versions it replaces; a device on another version refuses it"
                            " (required by the leader to roll it out)")

    publish = sub.add_parser("publish", help="copy an artifact into a static mirror's directory under its"
                                            " content address")
    publish.add_argument("artifact", type=Path, metavar="ARTIFACT")
    publish.add_argument("dir", type=Path, metavar="DIR")

    sign = sub.add_parser("sign", help="(re)sign an artifact with a private key")
    sign.add_argument("artifact", type=Path, metavar="ARTIFACT")
    sign.add_argument("--key", required=True, type=Path, metavar="PRIVATE_PEM")
    sign.add_argument("--out", type=Path, metavar="OUT", help="write a signed copy instead of signing in place")

    verify = sub.add_parser("verify", help="check an artifact as a device would before installing it")
    verify.add_argument("artifact", type=Path, metavar="ARTIFACT")
    verify.add_argument("--pubkey", required=True, type=Path, metavar="PUBLIC_PEM")
    verify.add_argument("--installed-version", metavar="V", help="refuse a downgrade from this version")
    verify.add_argument("--hardware", metavar="H", help="refuse an image not made for this hardware")
    verify.add_argument("--image", metavar="NAME", help="refuse an image of another name (as [firmware] image)")

    trust = sub.add_parser("trust", help="make (or show) the fleet's signed trust document: the signing keys"
                                         " devices accept, each until its expiry, signed by the root key")
    trust.add_argument("--show", type=Path, metavar="FILE", help="print a trust document (nothing is checked)")
    trust.add_argument("--version", type=int, metavar="N", help="the document's version: higher than the last one")
    trust.add_argument("--root-key", action="append", default=[], type=Path, metavar="PRIVATE_PEM",
                       help="a root key that signs it (repeat: the old and the new root when the root rotates)")
    trust.add_argument("--root", action="append", default=[], type=Path, metavar="PUBLIC_PEM",
                       help="the roots it names, which sign the next document (default: the --root-key ones)")
    trust.add_argument("--key", action="append", default=[], metavar="PUBLIC_PEM[=EXPIRES]",
                       help="a signing key devices accept, and for how long (e.g. k1/public.pem=365d; default 365d)")
    trust.add_argument("--out", type=Path, metavar="FILE")

    inspect = sub.add_parser("inspect", help="show an artifact's manifest (no key needed, nothing trusted)")
    inspect.add_argument("artifact", type=Path, metavar="ARTIFACT")
    inspect.add_argument("--json", action="store_true", help="print JSON")

    from agent.commands.firmware_device import add_device_actions

    add_device_actions(sub)


def _keygen(args: argparse.Namespace) -> int:
    from rollout_engine.keys import generate_keypair

    paths = generate_keypair(args.out, force=args.force)
    print(f"wrote {paths.private} (keep it secret) and {paths.public}; key id {paths.key_id}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from firmware_rollout.artifact.files import build_artifact
    from firmware_rollout.artifact.manifest import DEFAULT_CHUNK_SIZE
    from rollout_engine.keys import load_signing_key

    if args.out.exists() and not args.force:
        raise ConfigError(str(args.out), None, "exists already: give --force to replace it (a rollout that"
                                               " serves it would see its chunks change)")
    if args.rollback_from and not args.rollback:
        raise ConfigError("firmware build", "--rollback-from", "applies with --rollback")
    content_defined = None
    if args.chunk_size is None:
        content_defined = _chunk_bounds(args.chunks)
    for url in args.mirror:
        if not url.startswith(("http://", "https://")):
            raise ConfigError("firmware build", "--mirror", f"{url!r} is not an http:// or https:// URL")
    key = None if args.unsigned else load_signing_key(args.key)
    signed = build_artifact(
        args.image,
        args.out,
        name=args.name or args.image.stem,
        version=args.version,
        key=key,
        created_ts=SystemClock().now_ms(),
        chunk_size=args.chunk_size or DEFAULT_CHUNK_SIZE,
        content_defined=content_defined,
        hardware=args.hardware,
        min_version=args.min_version,
        rollback=args.rollback,
        rollback_from=args.rollback_from,
        mirrors=args.mirror,
    )
    m = signed.manifest
    state = f"signed by key {signed.key_id.hex()}" if key is not None else "UNSIGNED"
    kind = "content-defined chunks" if m.content_defined else "chunks"
    print(f"wrote {args.out}: {m.name} {m.version}, {m.size} bytes in {m.chunk_count} {kind}, {state}")
    return 0


def _chunk_bounds(text: str) -> ContentDefined:
    from firmware_rollout.artifact.files import ContentDefined

    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ConfigError("firmware build", "--chunks",
                          f"{text!r} is not MIN:AVG:MAX in bytes (e.g. 16384:65536:262144)")
    low, avg, high = (int(p) for p in parts)
    try:
        return ContentDefined(min_size=low, avg_size=avg, max_size=high)
    except EdgeAgentError as exc:
        raise ConfigError("firmware build", "--chunks", str(exc)) from None


def _publish(args: argparse.Namespace) -> int:
    import shutil

    from firmware_rollout.artifact.files import read_signed_manifest

    signed = read_signed_manifest(args.artifact)
    args.dir.mkdir(parents=True, exist_ok=True)
    target = args.dir / f"{signed.manifest.sha256.hex()}.eafw"
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(args.artifact, tmp)
    tmp.replace(target)
    print(f"published {args.artifact} as {target}; serve {args.dir}/ over HTTP(S) and give its URL to"
          " `firmware build --mirror` or a rollout's [download] mirrors")
    return 0


def _sign(args: argparse.Namespace) -> int:
    from firmware_rollout.artifact.files import sign_artifact
    from rollout_engine.keys import load_signing_key

    signed = sign_artifact(args.artifact, load_signing_key(args.key), out=args.out)
    print(f"signed {args.out or args.artifact} with key {signed.key_id.hex()}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from firmware_rollout.artifact.files import verify_artifact
    from rollout_engine.keys import load_verify_key

    signed = verify_artifact(
        args.artifact, load_verify_key(args.pubkey), hardware=args.hardware, installed_version=args.installed_version,
        image=args.image
    )
    m = signed.manifest
    kind = "rollback " if m.rollback else ""
    print(
        f"ok: {args.artifact}: {kind}{m.name} {m.version}, {m.size} bytes, {m.chunk_count} chunks verified, "
        f"signed by key {signed.key_id.hex()}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from firmware_rollout.artifact.files import inspect_artifact

    info = inspect_artifact(args.artifact)
    data = info.to_dict()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    m = info.manifest
    created = datetime.fromtimestamp(m.created_ts / 1000, tz=UTC).isoformat(timespec="seconds")
    rows = [
        ("artifact", str(info.path)),
        ("name", m.name),
        ("version", m.version + (" (rollback)" if m.rollback else "")),
        ("size", f"{m.size} bytes"),
        ("chunks", f"{m.chunk_count} content-defined, at most {m.chunk_size} bytes" if m.content_defined
         else f"{m.chunk_count} x {m.chunk_size} bytes"),
        ("mirrors", ", ".join(m.mirrors) or "-"),
        ("sha256", m.sha256.hex()),
        ("hardware", ", ".join(m.hardware) or "any"),
        ("min version", m.min_version or "-"),
        ("created", created),
        ("signature", f"key {data['key_id']} (not verified: use verify)" if info.signed.is_signed else "UNSIGNED"),
        ("file size", f"{info.file_size} bytes (image at offset {info.signed.size})"),
    ]
    for label, value in rows:
        print(f"{label:<12} {value}")
    return 0


def _on_device(args: argparse.Namespace) -> int:
    import asyncio

    from agent.commands import firmware_device

    action = {"install": firmware_device.install, "status": firmware_device.status,
              "commit": firmware_device.commit, "revert": firmware_device.revert}[args.action]
    return asyncio.run(action(args))


def _trust(args: argparse.Namespace) -> int:
    import time

    from agent.core.durations import parse_seconds
    from rollout_engine.keys import load_signing_key, load_verify_key
    from rollout_engine.trust import TrustDocument, make_trust_document, read_trust_document

    now = int(time.time() * 1000)
    if args.show is not None:
        doc = TrustDocument(read_trust_document(args.show))
        print(f"trust document v{doc.version}, issued {_utc(doc.body.issued_ms)}")
        print("roots: " + ", ".join(r.key_id_hex for r in doc.roots))
        for kid, (_, expires) in sorted(doc.keys.items(), key=lambda item: item[1][1]):
            print(f"key {kid}  until {_utc(expires)}{'  (expired)' if expires <= now else ''}")
        return 0
    if args.version is None or args.version < 1 or args.out is None or not args.root_key:
        raise ConfigError("firmware trust", "--version" if args.version is None or args.version < 1 else
                          "--out" if args.out is None else "--root-key",
                          "making a document needs --version N (>= 1), --root-key and --out")
    signers = [load_signing_key(path) for path in args.root_key]
    roots = [load_verify_key(path) for path in args.root] or [s.public for s in signers]
    keys = []
    for item in args.key:
        path, _, expires = item.partition("=")
        try:
            seconds = parse_seconds(expires or "365d")
        except ValueError as exc:
            raise ConfigError("--key", None, f"{item}: {exc}") from None
        keys.append((load_verify_key(path), now + int(seconds * 1000)))
    data = make_trust_document(version=args.version, roots=roots, keys=keys, signers=signers, issued_ms=now)
    doc = TrustDocument(data)
    for root in doc.roots:  # a new root must sign the document that names it
        if not doc.signed_by(root) and root.key_id not in {s.public.key_id for s in signers}:
            raise ConfigError("--root", None, f"root {root.key_id_hex} is named but did not sign: give its --root-key"
                                              " (with the old root's) to rotate the root")
    from agent.core.files import atomic_write

    atomic_write(args.out, data)
    print(f"wrote {args.out}: trust document v{args.version}, {len(keys)} signing key(s), roots "
          + ", ".join(r.key_id_hex for r in roots))
    return 0


def _utc(ms: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


_ACTIONS = {"keygen": _keygen, "trust": _trust, "build": _build, "publish": _publish, "sign": _sign, "verify": _verify,
            "inspect": _inspect,
            "install": _on_device, "status": _on_device, "commit": _on_device, "revert": _on_device}


def main(args: argparse.Namespace) -> int:
    try:
        return _ACTIONS[args.action](args)
    except EdgeAgentError as exc:
        print(f"edge-agent firmware {args.action}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # piped into `head`: the command line ends quietly (agent.cli)
    except OSError as exc:  # a file the helpers did not translate: still one line, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"edge-agent firmware {args.action}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
