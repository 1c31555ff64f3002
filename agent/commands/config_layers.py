"""`edge-agent config layer` and `config diff`: the leader's layers over a config release.

    edge-agent config layer set TARGET DOCUMENT KEY=VALUE... (--tag T | --device D) [--expires 2h] --db DB
    edge-agent config layer unset TARGET DOCUMENT KEY... (--tag T | --device D) --db DB
    edge-agent config layer list [TARGET] --db DB [--json]
    edge-agent config layer order TARGET TAG... --db DB
    edge-agent config diff --device D --db DB --key PUBLIC.pem [--target T] [--release FILE] [--json]
    edge-agent config acknowledge TARGET (--device D ... | --all) --db DB [--json]

A layer value is written into the leader's database and read at the next config offer: a
rollout of the target (`kind = "config"`) carries each device's values with the release; a
device already on the release applies the values again when the next rollout offers them.
`diff` previews what one device would get: the release (the newest config rollout of the
target, or `--release`) rendered with the layers as they are now, each value naming its layer,
against what the device holds, as its heartbeat says. `acknowledge`: the devices' last attempts
at the target that were rolled back or failed are seen (`agent.leader.attempts`): no longer
counted as failed until a device's next attempt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from agent.core.errors import ConfigError
from agent.core.sql import StoreTarget

DB_HELP = "the leader's database: leader.db, or the fleet's postgresql:// URL"


def add_arguments(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    layer = actions.add_parser("layer", help="the leader's layers over a config release (groups by tag, devices)")
    steps = layer.add_subparsers(dest="step", metavar="STEP", required=True)

    def scoped(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("target", help="the configuration target (a release's name)")
        p.add_argument("document", help="the release's document (a .toml or .json file name)")
        who = p.add_mutually_exclusive_group(required=True)
        who.add_argument("--tag", help="the group of the devices with this tag")
        who.add_argument("--device", help="one device's override")
        p.add_argument("--db", required=True, help=DB_HELP)
        return p

    set_ = scoped(steps.add_parser("set", help="set keys of a document for a group or a device"))
    set_.add_argument("values", nargs="+", metavar="KEY=VALUE",
                      help="a dotted key the release defines = a value of its type (8080, debug, true, [1, 2])")
    set_.add_argument("--expires", metavar="DURATION", help="a device's override ends after this long (e.g. 2h)")
    unset = scoped(steps.add_parser("unset", help="remove keys from a group's or a device's layer"))
    unset.add_argument("keys", nargs="+", metavar="KEY")
    listed = steps.add_parser("list", help="the values in force, groups in their order, then devices")
    listed.add_argument("target", nargs="?")
    listed.add_argument("--db", required=True, help=DB_HELP)
    listed.add_argument("--json", action="store_true")
    order = steps.add_parser("order", help="state the order of a target's groups (the last one wins)")
    order.add_argument("target")
    order.add_argument("tags", nargs="+", metavar="TAG")
    order.add_argument("--db", required=True, help=DB_HELP)

    diff = actions.add_parser("diff", help="what one device would get of each target, where each value comes from")
    diff.add_argument("--device", required=True)
    diff.add_argument("--db", required=True, help=DB_HELP)
    diff.add_argument("--key", required=True, metavar="PUBLIC.pem", help="the fleet's public key (checks the release)")
    diff.add_argument("--target", help="one target (default: each with a config rollout)")
    diff.add_argument("--release", metavar="FILE", help="this release instead of the newest config rollout's")
    diff.add_argument("--json", action="store_true")
    ack = actions.add_parser(
        "acknowledge", help="acknowledge a target's attempts that did not commit (no longer counted as failed)",
        description="Acknowledge the devices' last attempts at a configuration target that were rolled back or"
                    " failed: they are no longer counted as last_attempt_failed (status, /metrics, the console),"
                    " and their pages say who acknowledged them. A device's next attempt is counted again.")
    ack.add_argument("target", metavar="TARGET", help="the configuration target (e.g. app)")
    which = ack.add_mutually_exclusive_group(required=True)
    which.add_argument("--device", action="append", metavar="ID", help="this device's attempt (repeat for several)")
    which.add_argument("--all", action="store_true", help="every device whose last attempt at TARGET is open")
    ack.add_argument("--db", required=True, help=DB_HELP)
    ack.add_argument("--json", action="store_true", help="the acknowledgements made, as a JSON list")


def _db(text: str) -> StoreTarget:
    """The leader's database `--db` names: its leader.db (which must exist), or the fleet's
    postgresql:// URL."""
    from agent.core.sql import store_target

    db = store_target(text, source="--db")
    if isinstance(db, Path) and not db.is_file():
        raise ConfigError(str(db), None, "no leader database here (start the leader once, or check the path)")
    return db


def _writable(db: StoreTarget) -> StoreTarget:
    """`db`, checked to hold a leader's registry before a layer is written beside it: a
    `StoreError` says where the layers are instead (a PostgreSQL leader's own leader.db)."""
    from agent.leader.readonly import open_leader_db

    with open_leader_db(db):
        pass
    return db


def _name(value: str, option: str, pattern: str) -> str:
    import re

    if not re.match(pattern, value):
        raise ConfigError(option, None, f"{value!r} is not a valid name")
    return value


def layer_main(args: argparse.Namespace) -> int:
    from agent.commands.rollout import cli_actor
    from config_rollout.layer_store import TARGET, LayerEdit, LayerStore

    db = _db(args.db)
    now_ms = int(time.time() * 1000)
    if args.step == "list":
        from agent.leader.readonly import open_leader_db

        with open_leader_db(db) as leader:
            reads = leader.layers
            rows = reads.rows(args.target, now_ms=now_ms)
            orders = {t: reads.group_order(t) for t in {r.target for r in rows}}
        if args.json:
            print(json.dumps([{"target": r.target, "scope": r.scope, "selector": r.selector, "document": r.document,
                               "key": r.key, "value": json.loads(r.value), "expires_ms": r.expires_ms,
                               "set_by": r.set_by, "set_ms": r.set_ms} for r in rows], indent=2))
            return 0
        if not rows:
            print("no layer values" + (f" for target {args.target}" if args.target else ""))
        for target in sorted(orders):
            print(f"{target}: groups in order {', '.join(orders[target]) or '-'} (the last wins), then devices")
            for r in (r for r in rows if r.target == target):
                until = "" if r.expires_ms is None else f"  until {_when(r.expires_ms)}"
                print(f"  {r.scope} {r.selector}  {r.document}  {r.key} = {r.value}{until}  (set by {r.set_by})")
        return 0

    target = _name(args.target, "target", TARGET)
    if args.step == "order":
        for tag in args.tags:
            _name(tag, "TAG", r"^[A-Za-z0-9_.:-]{1,64}$")
        with LayerStore.open(_writable(db)) as store:
            store.order(target, args.tags, by=cli_actor(), now_ms=int(time.time() * 1000))
        print(f"{target}: groups in order {', '.join(args.tags)} (the last wins), then devices")
        return 0
    scope = "tag" if args.tag is not None else "device"
    selector = args.tag if args.tag is not None else args.device
    names = {"selector": "--tag" if scope == "tag" else "--device", "document": "DOCUMENT", "target": "TARGET"}
    if args.step == "unset":
        edits = [LayerEdit.checked(target=target, scope=scope, selector=selector, document=args.document, key=k,
                                   fields={**names, "key": k}) for k in args.keys]
        with LayerStore.open(_writable(db)) as store:
            gone = [e.key for e in edits if store.unset(e.target, e.scope, e.selector, e.document, e.key,
                                                        by=cli_actor(), now_ms=int(time.time() * 1000))]
        print(f"{target} {scope} {selector} {args.document}: unset {', '.join(gone) or 'nothing (no such key)'}")
        return 0
    edits = []
    for item in args.values:
        key, sep, text = item.partition("=")
        if not sep or not text:
            raise ConfigError(item, None, "write KEY=VALUE")
        edits.append(LayerEdit.checked(target=target, scope=scope, selector=selector, document=args.document,
                                       key=key.strip(), value_text=text, expires_text=args.expires, now_ms=now_ms,
                                       fields={**names, "key": item, "value": item, "expires": "--expires"}))
    by = cli_actor()
    with LayerStore.open(_writable(db)) as store:
        for e in edits:
            store.set_value(e.target, e.scope, e.selector, e.document, e.key, e.value, set_by=by, now_ms=now_ms,
                            expires_ms=e.expires_ms)
    expires_ms = edits[0].expires_ms
    until = f" until {_when(expires_ms)}" if expires_ms is not None else ""
    print(f"{target} {scope} {selector} {args.document}: "
          + ", ".join(f"{e.key} = {json.dumps(e.value)}" for e in edits) + until
          + " (offered with the target's next config rollout)")
    return 0


def diff_main(args: argparse.Namespace) -> int:
    import difflib

    from agent.leader.readonly import open_leader_db
    from config_rollout.attempt_acks import acknowledged, attempt_said
    from config_rollout.kind import CONFIG
    from config_rollout.layers import render
    from config_rollout.release import parse_release, peek_release, read_release
    from rollout_engine.keys import load_verify_key

    key = load_verify_key(args.key)
    now_ms = int(time.time() * 1000)
    with open_leader_db(_db(args.db)) as leader:
        found = leader.registry.device(args.device)
        if found is None:
            raise ConfigError("--device", None, f"{args.device}: no such device in {args.db}")
        line, state = found
        releases: dict[str, tuple[str, bytes]] = {}  # target -> (where from, the release)
        if args.release:
            data = Path(args.release).read_bytes()
            releases[peek_release(data).name] = (args.release, data)
        else:
            for rollout_id, rollout_state, _version, data in leader.rollouts.of_kind(CONFIG.name):
                if rollout_state in ("aborted", "canceled"):
                    continue
                releases.setdefault(peek_release(data).name, (f"rollout {rollout_id}", data))
        if args.target:
            releases = {t: r for t, r in releases.items() if t == args.target}
            if not releases:
                raise ConfigError("--target", None, f"{args.target}: no config rollout of it (give --release FILE)")
        reads = leader.layers
        values = {t: reads.values_for(t, args.device, line.tags, now_ms=now_ms) for t in releases}
        acks = leader.attempt_acks.newest([args.device])
    out: list[dict[str, Any]] = []
    for target, (origin, data) in sorted(releases.items()):
        release = read_release(args.release, key) if args.release else parse_release(data, key, source=origin)
        rendered = render(release.documents, values[target])
        held = (state.configs or {}).get(target)
        out.append({"target": target, "release": release.version, "from": origin, "layers": rendered.digest,
                    "holds": None if held is None else {
                        "version": held.version, "state": held.state, "layers": held.layers,
                        "last_attempt": held.last_attempt, "attempt": held.attempt,
                        "acknowledged_by": (ack.by if (ack := acknowledged(held, acks.get((args.device, target))))
                                            else None),
                        "said": attempt_said(held, acks.get((args.device, target)))},
                    "pending": held is None or held.version != release.version or held.layers != rendered.digest,
                    "sources": rendered.sources,
                    "documents": {n: {"default": release.documents[n].decode("utf-8", "replace"),
                                      "rendered": rendered.documents[n].decode("utf-8", "replace")}
                                  for n in sorted(rendered.documents)}})
    if args.json:
        print(json.dumps({"device": args.device, "tags": list(line.tags), "targets": out}, indent=2))
        return 0
    if not out:
        print(f"{args.device}: no config rollout yet (give --release FILE to preview one)")
    for t in out:
        holds = t["holds"]
        said = ("nothing applied" if holds is None else
                f"{holds['version'] or 'nothing'}, layers {holds['layers'] or 'none'}")
        attempt = f" ({holds['said']})" if holds is not None and holds["said"] else ""
        print(f"{args.device} (tags {', '.join(line.tags) or '-'}) · {t['target']} {t['release']} from {t['from']},"
              f" layers {t['layers'] or 'none'}")
        print(f"  holds {said}: {'PENDING, the next config rollout brings it' if t['pending'] else 'in sync'}{attempt}")
        for n, docs in t["documents"].items():
            diff = list(difflib.unified_diff(docs["default"].splitlines(), docs["rendered"].splitlines(),
                                             f"{n} (release {t['release']})", f"{n} ({args.device})", lineterm=""))
            print("\n".join(f"  {d}" for d in diff) if diff else f"  {n}: the release's, unchanged")
            for k, source in sorted(t["sources"].get(n, {}).items()):
                print(f"    {k}  from {source}")
    return 0


def acknowledge_main(args: argparse.Namespace) -> int:
    from agent.commands.rollout import cli_actor
    from agent.leader.attempts import acknowledge_attempts
    from config_rollout.layer_store import TARGET

    target = _name(args.target, "TARGET", TARGET)
    done = acknowledge_attempts(_writable(_db(args.db)), target, None if args.all else args.device, by=cli_actor(),
                                now_ms=int(time.time() * 1000))
    if args.json:
        print(json.dumps([{"device": a.device_id, "target": a.target, "attempt": a.attempt, "outcome": a.outcome,
                           "holds": a.version, "by": a.by, "at_ms": a.at_ms} for a in done], indent=2))
        return 0
    if not done:
        print(f"{target}: no attempt to acknowledge (every device's last attempt committed or was acknowledged)")
    for a in done:
        print(f"{a.device_id} · {target}: attempt {a.attempt} ({a.outcome.replace('_', ' ')}, holds"
              f" {a.version or 'nothing'}) acknowledged")
    return 0


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(ms / 1000))


__all__ = ["acknowledge_main", "add_arguments", "diff_main", "layer_main"]
