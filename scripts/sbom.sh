#!/usr/bin/env bash
# The release's SBOM: edge-agent installed alone (its runtime dependencies and the sbom extra)
# in a fresh virtual environment, as on a device, then `edge-agent version --sbom` (CycloneDX
# 1.6 JSON, made by the CycloneDX generator).   Usage: scripts/sbom.sh [OUT] (default dist/edge-agent.cdx.json)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/dist/edge-agent.cdx.json}"
PYTHON="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PYTHON" -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q --disable-pip-version-check "$ROOT[sbom]" >&2
mkdir -p "$(dirname "$OUT")"
"$TMP/venv/bin/edge-agent" version --sbom > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "SBOM written to $OUT" >&2
