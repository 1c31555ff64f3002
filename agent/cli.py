"""`edge-agent` command line.

Each subcommand lives in its own module under `agent.commands` with two functions,
`add_arguments(parser)` and `main(args) -> int`. Only the module of the command being run is
imported, so `edge-agent status` on a device does not pay for the simulator's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from agent import __version__
from agent.core.errors import EdgeAgentError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("agent.commands.run", "run a worker or leader agent from a config file"),
    "simulate": ("agent.commands.simulate", "simulate a fleet of devices on this machine"),
    "rollout": ("agent.commands.rollout", "start and control firmware rollouts in waves"),
    "outbox": ("agent.commands.outbox", "inspect an agent's store-and-forward outbox"),
    "dlq": ("agent.commands.dlq", "list, show, replay or purge dead letters"),
    "status": ("agent.commands.status", "show the fleet as the leader sees it, device by device"),
    "broker": ("agent.commands.broker", "a fleet's roles on mosquitto's dynamic-security plugin (several leaders)"),
    "devices": ("agent.commands.devices", "device identities: enrolments to approve or reject, revocations, tokens"),
    "rejects": ("agent.commands.rejects", "list and show the messages the leader refused"),
    "audit": ("agent.commands.audit", "who did what to the fleet: controls, identities, layers, sessions"),
    "send": ("agent.commands.send", "hand the agent on this device one message (through its local API)"),
    "messages": ("agent.commands.messages", "list the application messages the leader stored"),
    "leader": ("agent.commands.leader", "grow a leader's state into PostgreSQL (leader migrate)"),
    "install-helper": ("agent.commands.install_helper", "the root helper that writes slots and reboots for the agent"),
    "app": ("agent.commands.app", "build and verify application bundles; the root application helper"),
    "release": ("agent.commands.release", "build and verify a release of a device's whole state"),
    "firmware": ("agent.commands.firmware", "make and check artifacts; install, commit, revert on a device"),
    "config": ("agent.commands.config", "check agent config files"),
    "console": ("agent.commands.console", "serve the web console over a leader's database"),
    "doctor": ("agent.commands.doctor", "check that this agent is set up to work: config, files, broker, leader"),
    "version": ("agent.commands.version", "print the version"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 2 with the usage line, never a traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(selected: str | None) -> tuple[argparse.ArgumentParser, object | None]:
    parser = _Parser(
        prog="edge-agent",
        description="Actor-based edge agent: durable outbox, coalesced heartbeats, wave rollouts.",
    )
    parser.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            module = importlib.import_module(module_name)
            module.add_arguments(command_parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in args_list if not a.startswith("-")), None)
    if selected not in COMMANDS:
        selected = None
    parser, module = build_parser(selected)
    args, extra = parser.parse_known_args(args_list)
    if extra:
        # argparse matches an optional positional only where the positionals start: a command may
        # take such a word given after its options (`send CLASS --key K -`) through `take_extra`
        take_extra = getattr(module, "take_extra", None)
        if take_extra is None or not take_extra(args, extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if module is None:
        parser.print_help()
        return 0 if not args_list else 2
    try:
        return int(module.main(args) or 0)  # type: ignore[attr-defined]
    except EdgeAgentError as exc:
        print(f"edge-agent {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # piped into `head`, which has read enough: end quietly
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
