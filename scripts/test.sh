#!/usr/bin/env bash
# Run the whole test suite: makes .venv, installs the project with its test extra, installs
# Debian's mosquitto when it is missing (the tests start their own broker on a free loopback
# port), Debian's chromium + chromium-driver (the console's browser test), libubootenv-tool
# (the U-Boot installer's fw_setenv), qemu-system-arm with u-boot-qemu (a real U-Boot deciding
# the boots of the U-Boot tests' board), rauc with squashfs-tools and dbus (the RAUC installer),
# nginx (a static HTTP mirror for range downloads), casync and xdelta3 (the delta benchmark's
# baselines), mmdebstrap, lintian and fakeroot (the Debian package: built, checked, installed into
# a bookworm root cached in /var/cache/edge-agent-bench), qemu-system-x86 (a board booted with the
# package under systemd), podman and busybox-static (a container application's image, made
# and loaded), prometheus (promtool: the shipped alerting rules), checks the import contracts
# (lint-imports: the layers of docs/architecture.md), then runs pytest. Extra arguments go to pytest; without any, ruff and mypy run first too, the
# suite is spread over every core, and the release's SBOM is written to dist/edge-agent.cdx.json.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

ensure_venv test,sim,lint,postgresql

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    echo "installing Debian's mosquitto for the integration tests" >&2
    apt_install mosquitto || echo "warning: could not install mosquitto; MQTT tests will fail" >&2
fi
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    echo "installing Debian's chromium and chromium-driver for the console's browser test" >&2
    apt_install chromium chromium-driver || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi
if ! command -v fw_setenv >/dev/null 2>&1; then
    echo "installing Debian's libubootenv-tool for the U-Boot installer tests" >&2
    apt_install libubootenv-tool || echo "warning: could not install libubootenv-tool; the U-Boot tests will be skipped" >&2
fi
if ! command -v qemu-system-aarch64 >/dev/null 2>&1 || [ ! -f /usr/lib/u-boot/qemu_arm64/u-boot.bin ]; then
    echo "installing Debian's qemu-system-arm and u-boot-qemu: a real U-Boot boots the U-Boot tests' board" >&2
    apt_install qemu-system-arm u-boot-qemu || echo "warning: could not install qemu/u-boot-qemu; the real U-Boot tests will be skipped" >&2
fi
if ! command -v rauc >/dev/null 2>&1 || ! command -v mksquashfs >/dev/null 2>&1 || ! command -v dbus-daemon >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1; then
    echo "installing Debian's rauc, squashfs-tools and dbus for the RAUC installer tests" >&2
    apt_install rauc squashfs-tools dbus openssl || echo "warning: could not install rauc; the RAUC tests will be skipped" >&2
fi
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    echo "installing Debian's nginx for the HTTP mirror tests" >&2
    apt_install nginx || echo "warning: could not install nginx; the nginx mirror tests will be skipped" >&2
fi
if ! command -v casync >/dev/null 2>&1 || ! command -v xdelta3 >/dev/null 2>&1; then
    echo "installing Debian's casync and xdelta3 for the delta benchmark's test" >&2
    apt_install casync xdelta3 || echo "warning: could not install casync/xdelta3; their baselines are skipped" >&2
fi
if ! command -v mmdebstrap >/dev/null 2>&1 || ! command -v lintian >/dev/null 2>&1 || ! command -v fakeroot >/dev/null 2>&1; then
    echo "installing Debian's mmdebstrap, lintian and fakeroot: the Debian package is built, checked and installed" >&2
    apt_install mmdebstrap lintian fakeroot || echo "warning: could not install them; the package tests will be skipped" >&2
fi
if ! command -v qemu-system-x86_64 >/dev/null 2>&1; then
    echo "installing Debian's qemu-system-x86: the board the package is booted on" >&2
    apt_install qemu-system-x86 || echo "warning: could not install qemu-system-x86; the board tests will be skipped" >&2
fi
if ! command -v podman >/dev/null 2>&1 || [ ! -x /bin/busybox ]; then
    echo "installing Debian's podman and busybox-static: a container application's image is made and loaded" >&2
    apt_install podman busybox-static || echo "warning: could not install podman; the container tests will be skipped" >&2
fi
if ! command -v promtool >/dev/null 2>&1; then
    echo "installing Debian's prometheus for promtool: the shipped alerting rules are checked and tested" >&2
    apt_install prometheus || echo "warning: could not install prometheus; the rules' promtool tests will be skipped" >&2
fi
if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "installing Debian's systemd for \`systemd-analyze verify\` of the units" >&2
    apt_install systemd || echo "warning: could not install systemd; unit checks will be skipped" >&2
fi

cd "$ROOT"
if [ $# -eq 0 ]; then
    echo "ruff check, mypy" >&2
    "$VENV/bin/ruff" check .
    "$VENV/bin/mypy"
fi
echo "lint-imports: the layers" >&2
"$VENV/bin/lint-imports" --no-cache --no-logo >&2
if [ $# -eq 0 ]; then
    # the whole suite on two workers a core (pytest-xdist; many tests wait on processes, the board
    # scenarios on QEMU: tests/conftest.py orders them): each test runs its own brokers and
    # processes on free loopback ports, so tests of two workers never meet
    "$VENV/bin/python" -m pytest -n "$(( $(nproc) * 2 ))" --maxschedchunk 1 --durations=15
    # then the release's SBOM (CycloneDX), of edge-agent installed alone as on a device
    exec bash "$ROOT/scripts/sbom.sh" "$ROOT/dist/edge-agent.cdx.json"
fi
exec "$VENV/bin/python" -m pytest "$@"
