"""`edge-agent version`."""

from __future__ import annotations

import argparse
import platform

from agent import __version__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true", help="also print Python and platform")


def main(args: argparse.Namespace) -> int:
    print(f"edge-agent {__version__}")
    if args.verbose:
        print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    return 0
