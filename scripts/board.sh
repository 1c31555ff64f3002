#!/usr/bin/env bash
# Try the agent on a board: builds its Debian package and a Debian bookworm board with it
# (scripts/build-deb.sh, scripts/build-board.sh: the board's base is cached after the first run),
# boots the board's A/B disk under QEMU (GRUB, RAUC, systemd as PID 1), a mosquitto and a leader on
# this machine, cuts its power a few times while an application sends, rolls a new root file
# system out to it and then a bad one, and prints what it measured as one JSON line
# (scripts/bench_device.py; extra arguments go to it, e.g. --trials 20). Needs root: it installs
# Debian's mmdebstrap, qemu-system-x86, mosquitto, rauc and squashfs-tools when they are missing
# (with --arch arm64, the emulated arm64 board: qemu-system-arm, u-boot-qemu, u-boot-tools,
# dosfstools, mtools, qemu-user-static, binfmt-support and arch-test, which mmdebstrap needs for a
# foreign architecture, too).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

if [ "$(id -u)" != 0 ]; then
    echo "board.sh: run as root: the board's root file system keeps its owners" >&2
    exit 2
fi
missing=()
tools=(mmdebstrap:mmdebstrap qemu-system-x86_64:qemu-system-x86 mosquitto:mosquitto fakeroot:fakeroot
       rauc:rauc mksquashfs:squashfs-tools openssl:openssl)
if [[ " $* " == *" --arch arm64 "* ]]; then  # the emulated arm64 board: U-Boot, its FAT boot partition
    tools+=(qemu-system-aarch64:qemu-system-arm mkimage:u-boot-tools mkfs.vfat:dosfstools mcopy:mtools
            qemu-aarch64-static:qemu-user-static update-binfmts:binfmt-support arch-test:arch-test)
    [ -f /usr/lib/u-boot/qemu_arm64/u-boot.bin ] || missing+=(u-boot-qemu)
fi
for tool in "${tools[@]}"; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${tool%%:*}" ] || missing+=("${tool#*:}")
done
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
if [[ " $* " == *" --arch arm64 "* ]] && [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    # the arm64 base's package scripts run under qemu-user-static
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    update-binfmts --enable qemu-aarch64
fi
ensure_venv test
exec "$VENV/bin/python" "$ROOT/scripts/bench_device.py" --trials 3 "$@"
