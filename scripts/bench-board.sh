#!/usr/bin/env bash
# A U-Boot A/B bench board on this machine, every boot decided by Debian's real U-Boot in QEMU:
#   scripts/bench-board.sh DIR               make the board, print the worker's [firmware] lines
#   scripts/bench-board.sh DIR boot          power-cycle once
#   scripts/bench-board.sh DIR run CONFIG    run the worker on the board, power-cycling it at each reboot
#   scripts/bench-board.sh DIR env           its U-Boot environment
# Installs qemu-system-arm, u-boot-qemu and libubootenv-tool when they are missing (Debian).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

if ! command -v qemu-system-aarch64 >/dev/null 2>&1 || [ ! -f /usr/lib/u-boot/qemu_arm64/u-boot.bin ] \
        || ! command -v fw_setenv >/dev/null 2>&1; then
    echo "installing Debian's qemu-system-arm, u-boot-qemu and libubootenv-tool for the bench board" >&2
    apt_install qemu-system-arm u-boot-qemu libubootenv-tool || true
fi
ensure_venv cli
exec "$VENV/bin/python" "$ROOT/scripts/bench_board.py" "$@"
