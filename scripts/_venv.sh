# Sourced by scripts/test.sh and scripts/simulate.sh: make .venv with the project installed.
# Usage: ensure_venv EXTRAS   (e.g. "test" or "")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EDGE_AGENT_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo "$@"
    else return 1
    fi
}

apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    if [ -z "${_APT_UPDATED:-}" ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || return 1
        _APT_UPDATED=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

ensure_venv() {
    local extras="${1:-}"
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "edge-agent needs Python >= 3.11; found: $("$PYTHON" --version 2>&1)" >&2
        exit 2
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        if ! "$PYTHON" -m venv "$VENV" >/dev/null 2>&1; then
            rm -rf "$VENV"
            echo "python3 -m venv is missing; installing Debian's python3-venv" >&2
            apt_install python3-venv || { echo "cannot install python3-venv; install it and retry" >&2; exit 2; }
            "$PYTHON" -m venv "$VENV"
        fi
    fi
    local stamp="$VENV/.edge-agent-installed-$extras"
    if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
        local spec="$ROOT"
        [ -n "$extras" ] && spec="$ROOT[$extras]"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$spec" >&2
        touch "$stamp"
    fi
}
