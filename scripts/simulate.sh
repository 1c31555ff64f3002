#!/usr/bin/env bash
# Run a fleet simulation on the built-in in-memory broker: makes .venv with the project on the
# first run, then `edge-agent simulate` with the given arguments.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

ensure_venv cli
exec "$VENV/bin/edge-agent" simulate "$@"
