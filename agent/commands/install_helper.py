"""`edge-agent install-helper --config CONFIG [--socket PATH]`: the root helper that writes slots,
switches the boot target and reboots for an unprivileged agent (`firmware_rollout.device.helper`).

Started by `edge-agent-installer.socket` (systemd hands it the listening socket) or with
`--socket` by hand. It builds the backend `[firmware] installer` names with `helper_state_dir`
and checks everything with the key `[firmware] public_key` names, read by itself: keep the
config and the key root-owned and not writable by the agent's user. It answers root and the
uid of `[firmware] helper_user` only; `[agent] firmware_version` is the version of the image
the device was made with, the floor below which it takes no image until it wrote one itself.
"""

from __future__ import annotations

import argparse
import asyncio
import grp
import logging
import os
import pwd
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from agent.core.clock import SystemClock
from agent.core.config import FirmwareSection, load_config
from agent.core.errors import EdgeAgentError

if TYPE_CHECKING:
    from firmware_rollout.device.slots import Installer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, metavar="CONFIG",
                        help="the helper's own config (/etc/edge-agent/installer.toml: root-owned, not the agent's)")
    parser.add_argument("--check", action="store_true",
                        help="check the config, its key, its backend and who may ask, then exit (nothing served)")
    parser.add_argument("--socket", type=Path, metavar="PATH",
                        help="listen here (default: the socket systemd passes, else [firmware] helper_socket)")


async def _serve(args: argparse.Namespace) -> int:
    from firmware_rollout.device.backends import InstallerContext, configured_backend, rebooter_from_config
    from firmware_rollout.device.helper import (
        UNAVAILABLE_LINGER_S,
        InstallHelper,
        listening_socket,
        serve_unavailable,
    )
    from firmware_rollout.errors import InstallError
    from rollout_engine.trust import load_fleet_keys

    config = load_config(args.config)
    fw = config.firmware
    if not fw.keyed:
        raise EdgeAgentError(f"{args.config}: firmware.public_key: required (or trust_root): the helper checks every"
                             " image with it")
    clock = SystemClock()
    state_dir = Path(fw.helper_state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # its own trust, kept in its own root-owned state directory: the agent only carries documents
    key = load_fleet_keys(public_key=fw.public_key, trust_root=fw.trust_root, trust_document=fw.trust_document,
                          state_dir=state_dir / "trust", now_ms=clock.now_ms)
    assert key is not None
    backend = configured_backend(fw, source=str(args.config))
    context = InstallerContext(state_dir, clock, key)
    log = logging.getLogger(__name__)
    try:
        uids = frozenset({pwd.getpwnam(fw.helper_user).pw_uid})
    except KeyError:
        uids = frozenset({0})
        log.warning("firmware.helper_user: no user %r: only root may ask the helper", fw.helper_user)
    if args.check:
        return _check(args.config, fw, backend.build(context), uids)
    sock = listening_socket(args.socket or (Path(fw.helper_socket) if fw.helper_socket else None))
    if args.socket is not None:
        try:
            os.chown(args.socket, 0, grp.getgrnam(fw.helper_group).gr_gid)
        except KeyError:
            log.warning("firmware.helper_group: no group %r: the socket stays root's", fw.helper_group)
    try:
        installer = backend.build(context)
    except InstallError as exc:
        reason = f"the {backend.name} installer cannot start: {exc}"
        log.error("install helper: %s (answered to every request for %.0f s, then tried again)", reason,
                  UNAVAILABLE_LINGER_S)
        await serve_unavailable(sock, reason, allowed_uids=uids)
        return 1
    helper = InstallHelper(installer, rebooter_from_config(fw, clock=clock, source=str(args.config)),
                           verify_key=key, state_dir=state_dir, made_with=config.agent.firmware_version,
                           allowed_uids=uids, image=fw.image or None, hardware=fw.hardware or None)
    log.info("install helper for the %s installer: slots %s, booted %s (version %s)", installer.name,
             "/".join(installer.slots), installer.booted_slot(), helper.records.booted_version)
    await helper.serve(sock)
    return 0


def _check(path: Path, fw: FirmwareSection, installer: Installer, uids: frozenset[int]) -> int:
    """`--check`: what the helper would run, and who could ask it; 1 when someone it needs is missing."""
    print(f"config: {path} (the install helper's own)")
    print(f"key: {fw.public_key}" if fw.public_key else
          f"trust root: {fw.trust_root} (the trust document it took is kept in {fw.helper_state_dir}/trust)")
    print(f"backend: {installer.name}: slots {'/'.join(installer.slots)}, booted {installer.booted_slot()}, "
          f"default {installer.default_slot()}")
    problems = 0
    agent = [pwd.getpwuid(uid).pw_name for uid in sorted(uids - {0})]
    if agent:
        print(f"answers: root and {', '.join(agent)} (uid {', '.join(str(u) for u in sorted(uids - {0}))})")
    else:
        print(f"answers: root only: no user {fw.helper_user!r} (firmware.helper_user)")
        problems += 1
    try:
        group = grp.getgrnam(fw.helper_group)
    except KeyError:
        print(f"socket group: no group {fw.helper_group!r} (firmware.helper_group; install.sh creates it)")
        problems += 1
    else:
        others = sorted(set(group.gr_mem) - {fw.helper_user})
        print(f"socket group: {group.gr_name}: {', '.join(group.gr_mem) or 'no members'}"
              + (f" (also {', '.join(others)}: the helper refuses them)" if others else ""))
    return 1 if problems else 0


HELPER_KEYS = ("helper_state_dir", "helper_user", "helper_group")  # set only in the helper's own config


def is_helper_config(path: str | Path) -> bool:
    """Whether a config file is the install helper's own: its [firmware] sets a key only the
    helper reads (an agent's names `helper_socket` at most)."""
    from agent.core.config import read_toml

    firmware = read_toml(path).get("firmware")
    return isinstance(firmware, dict) and any(key in firmware for key in HELPER_KEYS)


def check_config(path: str | Path) -> str:
    """`config check` of the helper's config: what the helper checks at its start, without
    starting (nothing is created); a `ConfigError` naming the key, or one line saying what it runs."""
    from agent.commands.preflight import preflight
    from agent.core.errors import ConfigError

    source = str(path)
    config = preflight(path)  # the file, the key it names, the backend's table
    fw = config.firmware
    if not fw.keyed:
        raise ConfigError(source, "firmware.public_key", "required (or trust_root): the helper checks every image"
                                                         " with it")
    if fw.installer == "helper":
        raise ConfigError(source, "firmware.installer", "the helper runs a backend itself (uboot, tryboot, rauc,"
                                                        " directory), not \"helper\"")
    try:
        pwd.getpwnam(fw.helper_user)
    except KeyError:
        raise ConfigError(source, "firmware.helper_user", f"no user {fw.helper_user!r} on this machine") from None
    try:
        grp.getgrnam(fw.helper_group)
    except KeyError:
        raise ConfigError(source, "firmware.helper_group", f"no group {fw.helper_group!r} on this machine"
                                                           " (install.sh creates it)") from None
    return (f"ok (the install helper's own config: the {fw.installer} backend, answers root and {fw.helper_user},"
            f" socket group {fw.helper_group}, device made with {config.agent.firmware_version or '?'})")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_serve(args))
    except EdgeAgentError as exc:
        print(f"edge-agent install-helper: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"edge-agent install-helper: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
