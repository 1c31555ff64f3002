#!/usr/bin/env bash
# Build a board: a Debian bookworm root file system with systemd, a kernel and the agent's Debian
# package installed, as an ext4 image QEMU boots (or dd writes to a card's root partition).
#
#   scripts/build-board.sh --deb dist/edge-agent_0.1.0_amd64.deb --config agent.toml --out DIR
#       [--arch amd64] [--hostname board] [--add SRC:DEST[:MODE[:OWNER]] ...]
#   -> DIR/rootfs.img (ext4), DIR/vmlinuz, DIR/initrd.img
#
# The base (Debian's packages: systemd, udev, a kernel, python3.11) is made by mmdebstrap once and
# kept as a tarball in $EDGE_AGENT_CACHE (default /var/cache/edge-agent-bench), named by a hash
# of what makes it, so a second build takes seconds: the package goes in with apt, the config
# (DEST /etc/edge-agent/agent.toml) and any --add files are copied in, systemd-networkd takes an
# address by DHCP on the first Ethernet port, and the image is made with `mkfs.ext4 -d` (no loop
# device, no mount). For a Raspberry Pi: --arch arm64 with the arm64 package (the base's package
# scripts run under qemu-user-static and binfmt: about 17 minutes, once).
#
# QEMU (see tests/board.py):  qemu-system-x86_64 -m 1024 -smp 2 -nographic -kernel DIR/vmlinuz
#   -initrd DIR/initrd.img -append "root=/dev/vda rw console=ttyS0" -drive
#   file=DIR/rootfs.img,if=virtio,format=raw -nic user,model=virtio-net-pci
set -euo pipefail
umask 022  # the files it writes into the board are read by the board's own users (systemd-network)

PROG="build-board.sh"
ARCH="$(dpkg --print-architecture)"
DEB=""
CONFIG=""
OUT=""
NAME="board"
ADDS=()
SIZE="2G"
CACHE="${EDGE_AGENT_CACHE:-/var/cache/edge-agent-bench}"

die() { echo "$PROG: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --deb) [ $# -ge 2 ] || die "--deb needs a value"; DEB="$2"; shift 2 ;;
        --config) [ $# -ge 2 ] || die "--config needs a value"; CONFIG="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a value"; OUT="$2"; shift 2 ;;
        --arch) [ $# -ge 2 ] || die "--arch needs a value"; ARCH="$2"; shift 2 ;;
        --hostname) [ $# -ge 2 ] || die "--hostname needs a value"; NAME="$2"; shift 2 ;;
        --add) [ $# -ge 2 ] || die "--add needs SRC:DEST"; ADDS+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[ -n "$DEB" ] && [ -f "$DEB" ] || die "--deb names no file: '$DEB'"
[ -n "$CONFIG" ] && [ -f "$CONFIG" ] || die "--config names no file: '$CONFIG'"
[ -n "$OUT" ] || die "--out is required"
[ "$(id -u)" = 0 ] || die "run as root: the root file system keeps its owners"
case "$ARCH" in amd64) KERNEL=linux-image-amd64 ;; arm64) KERNEL=linux-image-arm64 ;; *) die "--arch: amd64 or arm64" ;; esac
for tool in mmdebstrap mkfs.ext4 chroot; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is missing (apt-get install mmdebstrap e2fsprogs)"
done

PACKAGES="systemd,systemd-sysv,udev,$KERNEL,wireless-regdb,python3.11,procps,iproute2,ca-certificates,dbus,kmod"
BASE_ARGS=(--variant=minbase --architectures="$ARCH" --include="$PACKAGES" bookworm)
key="$(printf '%s\n' "${BASE_ARGS[@]}" | sha256sum | cut -c1-16)"
base="$CACHE/board-base-$ARCH-$key.tar"
mkdir -p "$CACHE"
exec 9>"$CACHE/.board-base.lock"
flock 9  # two builds at once (tests on two workers) make the base once
if [ ! -f "$base" ]; then
    echo "$PROG: making the base root file system (once; kept as $base)" >&2
    mmdebstrap --quiet "${BASE_ARGS[@]}" "$CACHE/board-base-$ARCH-$key.part.tar"
    mv "$CACHE/board-base-$ARCH-$key.part.tar" "$base"
fi
flock -u 9

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
root="$tmp/root"
mkdir "$root"
tar -C "$root" -xf "$base"
cp "$DEB" "$root/tmp/edge-agent.deb"
chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q /tmp/edge-agent.deb >"$tmp/apt.log" 2>&1 \
    || { cat "$tmp/apt.log" >&2; die "the package did not install"; }
rm "$root/tmp/edge-agent.deb"
install -m 0640 -g "$(chroot "$root" getent group edge-agent | cut -d: -f3)" "$CONFIG" "$root/etc/edge-agent/agent.toml"
for add in "${ADDS[@]}"; do  # SRC:DEST[:MODE[:OWNER]]
    IFS=: read -r src dest mode owner <<<"$add"
    [ -f "$src" ] || die "--add: no file '$src'"
    mkdir -p "$root$(dirname "$dest")"
    cp "$src" "$root$dest"
    [ -z "$mode" ] || chmod "$mode" "$root$dest"
    [ -z "$owner" ] || chroot "$root" chown "$owner" "$dest"
done

echo "$NAME" > "$root/etc/hostname"
printf '127.0.1.1\t%s\n' "$NAME" >> "$root/etc/hosts"
printf '/dev/vda\t/\text4\trw,errors=remount-ro\t0\t1\n' > "$root/etc/fstab"
printf '[Match]\nName=en*\n\n[Network]\nDHCP=yes\n' > "$root/etc/systemd/network/20-wired.network"
ln -sf /lib/systemd/system/systemd-networkd.service "$root/etc/systemd/system/multi-user.target.wants/"
chroot "$root" passwd -d root >/dev/null
for unit in "$root"/etc/systemd/system/*.service; do  # --add'ed units: enable those that name a target
    [ -f "$unit" ] || continue
    wanted="$(sed -n 's/^WantedBy=//p' "$unit" | head -n 1)"
    [ -n "$wanted" ] || continue
    mkdir -p "$root/etc/systemd/system/$wanted.wants"
    ln -sf "/etc/systemd/system/$(basename "$unit")" "$root/etc/systemd/system/$wanted.wants/"
done

mkdir -p "$OUT"
cp -L "$root/vmlinuz" "$OUT/vmlinuz"
cp -L "$root/initrd.img" "$OUT/initrd.img"
rm -f "$OUT/rootfs.img"
mkfs.ext4 -q -F -L rootfs -d "$root" "$OUT/rootfs.img" "$SIZE"
echo "$OUT/rootfs.img"
