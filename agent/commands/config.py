"""`edge-agent config check FILE...`: check each file as `run` would before it connects (the
config, then the files, keys, addresses and commands it names); report the first error of each.
The install helper's own config (its [firmware] sets helper_state_dir, helper_user or
helper_group) is checked as `edge-agent install-helper` checks it at its start.

`edge-agent config release build NAME --version V FILE... --key PRIVATE.pem [--out F]` makes a
signed config release of the files (`config_rollout.release`); `edge-agent config release show
F --key PUBLIC.pem` verifies one and says what it holds. `config layer` and `config diff`: the
leader's layers over a release; `config acknowledge`: attempts that did not commit, seen
(`agent.commands.config_layers`)."""

from __future__ import annotations

import argparse
import sys

from agent.commands.preflight import preflight
from agent.core.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="check config files; exit 2 on the first bad one")
    check.add_argument("files", nargs="+", metavar="FILE")
    release = actions.add_parser("release", help="build or show a signed config release")
    steps = release.add_subparsers(dest="step", metavar="STEP", required=True)
    build = steps.add_parser("build", help="sign the files as a release of a configuration target")
    build.add_argument("name", help="the configuration target it is for (e.g. app)")
    build.add_argument("files", nargs="+", metavar="FILE", help="the documents, each kept under its file name")
    build.add_argument("--version", required=True, help="its version (MAJOR.MINOR.PATCH): only ever increases")
    build.add_argument("--key", required=True, metavar="PRIVATE.pem", help="the fleet's signing key")
    build.add_argument("--out", metavar="FILE", help="where to write it (default: NAME-VERSION.eacfg here)")
    build.add_argument("--max-document-kib", type=int, default=64, metavar="KIB",
                       help="the cap on each document (default 64, as devices apply it)")
    build.add_argument("--force", action="store_true", help="replace an existing file")
    apply = actions.add_parser("apply", help="apply a signed config release to this device's target, commit-confirmed")
    apply.add_argument("release", metavar="RELEASE.eacfg")
    apply.add_argument("--config", required=True, metavar="CONFIG", help="the worker's config ([config_targets.NAME])")
    status = actions.add_parser("status", help="what each configuration target holds, and local edits (drift)")
    status.add_argument("--config", required=True, metavar="CONFIG")
    status.add_argument("--json", action="store_true")
    show = steps.add_parser("show", help="verify a release and list what it holds")
    show.add_argument("file")
    show.add_argument("--key", required=True, metavar="PUBLIC.pem", help="the fleet's public key")
    show.add_argument("--json", action="store_true")
    from agent.commands.config_layers import add_arguments as add_layer_arguments

    add_layer_arguments(actions)


def _release(args: argparse.Namespace) -> int:
    import json
    import time

    from config_rollout.release import SUFFIX, build_release, read_release, write_release
    from rollout_engine.keys import load_signing_key, load_verify_key

    if args.step == "build":
        if args.max_document_kib < 1:
            raise ConfigError("--max-document-kib", None, "give at least 1")
        data = build_release(args.name, args.version, args.files, load_signing_key(args.key),
                             created_ms=int(time.time() * 1000), max_document_bytes=args.max_document_kib * 1024)
        out = write_release(data, args.out or f"{args.name}-{args.version}{SUFFIX}", force=args.force)
        print(f"wrote {out}: config release {args.name} {args.version}, {len(args.files)} documents, "
              f"{len(data)} bytes")
        return 0
    release = read_release(args.file, load_verify_key(args.key))
    m = release.manifest
    if args.json:
        print(json.dumps({"name": m.name, "version": m.version, "release_id": release.release_id,
                          "key_id": release.key_id, "created_ms": m.created_ms,
                          "documents": [{"name": d.name, "size": d.size, "sha256": d.sha256} for d in m.documents]},
                         indent=2))
        return 0
    print(f"{args.file}: config release {m.name} {m.version}, signed by key {release.key_id}, "
          f"id {release.release_id[:16]}")
    for d in m.documents:
        print(f"  {d.name}  {d.size} bytes  sha256 {d.sha256[:16]}")
    return 0


def _apply(args: argparse.Namespace) -> int:
    """Apply a release by hand (stop the service first: one applier per target)."""
    import asyncio
    from pathlib import Path

    from agent.core.config import load_config
    from config_rollout.device.apply import ConfigApplier
    from config_rollout.release import read_release
    from rollout_engine.keys import load_verify_key

    config = load_config(args.config)
    if not config.firmware.public_key:
        raise ConfigError(args.config, "firmware.public_key", "required: a config release is checked with it")
    key = load_verify_key(config.firmware.public_key)
    release = read_release(args.release, key, max_document_bytes=16 * 1024 * 1024)
    if release.name == "agent":
        raise ConfigError(args.release, None, "a release of the agent's own settings is applied by the running agent,"
                                              " which starts itself again on it: roll it out")
    target = config.config_targets.get(release.name)
    if target is None:
        raise ConfigError(args.config, f"config_targets.{release.name}",
                          f"not declared: this device takes no release {release.name!r}")
    applier = ConfigApplier(release.name, target, Path(config.agent.data_dir))
    result = asyncio.run(applier.apply(release))
    print(f"{release.name}: {result.state} ({result.detail}); the target holds {result.version or 'nothing yet'}")
    return 0 if result.state == "committed" else 1


def _status(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from agent.core.config import load_config
    from config_rollout.device.apply import ConfigApplier

    config = load_config(args.config)
    statuses = [(name, ConfigApplier(name, target, Path(config.agent.data_dir)).status())
                for name, target in sorted(config.config_targets.items())]
    if args.json:
        print(json.dumps([{"target": name, "version": st.version, "state": st.state, "drifted": list(st.drifted),
                           "detail": st.detail} for name, st in statuses], indent=2))
        return 0
    if not statuses:
        print("no [config_targets] in this config")
    for name, st in statuses:
        said = f"{name}: {st.version or 'nothing applied'} ({st.state}" + (f": {st.detail})" if st.detail else ")")
        print(said + (f"; DRIFTED: {', '.join(st.drifted)} changed on the device" if st.drifted else ""))
    return 0


def main(args: argparse.Namespace) -> int:
    from agent.commands.install_helper import check_config, is_helper_config

    if args.action == "release":
        return _release(args)
    if args.action == "apply":
        return _apply(args)
    if args.action == "status":
        return _status(args)
    if args.action in ("layer", "diff", "acknowledge"):
        from agent.commands.config_layers import acknowledge_main, diff_main, layer_main

        return {"layer": layer_main, "diff": diff_main, "acknowledge": acknowledge_main}[args.action](args)

    status = 0
    for path in args.files:
        try:
            if is_helper_config(path):  # the install helper's own: checked as the helper checks it
                print(f"{path}: {check_config(path)}")
                continue
            config = preflight(path)
        except ConfigError as exc:
            print(f"edge-agent config: {exc}", file=sys.stderr)
            status = 2
            continue
        print(f"{path}: ok ({config.agent.role} {config.agent.device_id!r}, fleet {config.agent.fleet!r})")
    return status
