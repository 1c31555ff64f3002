"""`edge-agent config check FILE...`: check each file as `run` would before it connects (the
config, then the files, keys, addresses and commands it names); report the first error of each.
The install helper's own config (its [firmware] sets helper_state_dir, helper_user or
helper_group) is checked as `edge-agent install-helper` checks it at its start."""

from __future__ import annotations

import argparse
import sys

from agent.commands.preflight import preflight
from agent.core.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="check config files; exit 2 on the first bad one")
    check.add_argument("files", nargs="+", metavar="FILE")


def main(args: argparse.Namespace) -> int:
    from agent.commands.install_helper import check_config, is_helper_config

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
