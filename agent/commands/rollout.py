"""`edge-agent rollout`: arrives with wave rollouts and signed artifacts; says so until then."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    print(
        "edge-agent rollout: not available in this version (it comes with firmware rollouts in waves)",
        file=sys.stderr,
    )
    return 2
