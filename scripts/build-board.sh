#!/usr/bin/env bash
# Build a board: a disk a device boots, with a boot partition, root file systems A and B and a data
# partition, from Debian bookworm's packages with the agent's Debian package installed.
#
#   scripts/build-board.sh --deb dist/edge-agent_0.1.0_amd64.deb --config agent.toml --out DIR
#       [--arch amd64] [--hostname board] [--version 1.0.0] [--rauc-keyring CERT.pem]
#       [--slot-only] [--pi] [--containers] [--add SRC:DEST[:MODE[:OWNER]] ...]
#   -> DIR/disk.img (the whole disk) and DIR/rootfs.img (one slot's image: what a RAUC bundle of
#      this version carries), with the slot's vmlinuz and initrd.img beside; --slot-only makes no
#      disk; --pi (arm64) makes only rootfs.img, one root file system for a Raspberry Pi;
#      --containers adds Debian's podman (container applications; its storage on the data partition)
#
# The base (Debian's packages: systemd, udev, a kernel, python3.11, RAUC, GRUB) is made by
# mmdebstrap once and kept as a tarball in $EDGE_AGENT_CACHE (default /var/cache/edge-agent-bench),
# named by a hash of what makes it, so a second build takes seconds: the package goes in with apt,
# the config (DEST /etc/edge-agent/agent.toml) and any --add files are copied in, systemd-networkd
# takes an address by DHCP on the first Ethernet port, and each file system is made with
# `mkfs.ext4 -d` (no loop device, no mount).
#
# The disk (MBR):  1 boot (64 MiB: GRUB's config, its environment, its modules)
#                  2 rootfs A, 3 rootfs B (the slots RAUC writes; the board starts on A)
#                  4 data (/data: the agent's and the helper's state, RAUC's, the applications and
#                    their data; bind-mounted on /var/lib/edge-agent, /var/lib/edge-agent-installer,
#                    /var/lib/edge-agent-apps, /var/lib/private (systemd's DynamicUser state) and
#                    /var/lib/containers (podman's images and volumes), so they outlive a slot)
# amd64: GRUB (in the MBR, its files on an ext4 boot partition) runs RAUC's GRUB logic (ORDER, x_OK,
# x_TRY in grubenv): the first slot in ORDER that is OK and not yet tried boots and is marked
# tried; the agent's commit (`rauc status mark-good`) clears the mark. A slot that did not come up
# is not tried again: the next boot takes the other.
# arm64: Debian's U-Boot for QEMU's `virt` machine runs boot.scr from the FAT boot partition:
# RAUC's U-Boot logic (BOOT_ORDER, BOOT_x_LEFT) on an environment kept in the file uboot.env
# there (U-Boot loads it with `fatload` and `env import`, saves it with `env export` and
# `fatwrite`; RAUC's uboot backend changes it with fw_setenv through /etc/fw_env.config).
# /etc/rauc/system.conf names the two slots, the bootloader and the keyring (--rauc-keyring).
#
# QEMU (see tests/qemu_board.py):  qemu-system-x86_64 -m 1024 -smp 2 -nographic
#   -drive file=DIR/disk.img,if=virtio,format=raw -nic user,model=virtio-net-pci
# or  qemu-system-aarch64 -M virt -cpu cortex-a72 -bios /usr/lib/u-boot/qemu_arm64/u-boot.bin ...
# arm64's base runs its package scripts under qemu-user-static (about 8 minutes, once). For a
# Raspberry Pi (--arch arm64 --pi) the script makes rootfs.img, vmlinuz and initrd.img: the Pi's own
# firmware boots.
set -euo pipefail
umask 022  # the files it writes into the board are read by the board's own users (systemd-network)

PROG="build-board.sh"
ARCH="$(dpkg --print-architecture)"
DEB=""
CONFIG=""
OUT=""
NAME="board"
VERSION="1.0.0"
KEYRING=""
SLOT_ONLY=0
PI=0
CONTAINERS=0
ADDS=()
BOOT_MB=64
SLOT_MB=1536
DATA_MB=1024
COMPATIBLE="edge-agent-board"
CACHE="${EDGE_AGENT_CACHE:-/var/cache/edge-agent-bench}"

die() { echo "$PROG: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --deb) [ $# -ge 2 ] || die "--deb needs a value"; DEB="$2"; shift 2 ;;
        --config) [ $# -ge 2 ] || die "--config needs a value"; CONFIG="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a value"; OUT="$2"; shift 2 ;;
        --arch) [ $# -ge 2 ] || die "--arch needs a value"; ARCH="$2"; shift 2 ;;
        --hostname) [ $# -ge 2 ] || die "--hostname needs a value"; NAME="$2"; shift 2 ;;
        --version) [ $# -ge 2 ] || die "--version needs a value"; VERSION="$2"; shift 2 ;;
        --rauc-keyring) [ $# -ge 2 ] || die "--rauc-keyring needs a value"; KEYRING="$2"; shift 2 ;;
        --slot-only) SLOT_ONLY=1; shift ;;
        --pi) PI=1; shift ;;
        --containers) CONTAINERS=1; shift ;;
        --add) [ $# -ge 2 ] || die "--add needs SRC:DEST"; ADDS+=("$2"); shift 2 ;;
        -h|--help) sed -n '2,41p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[ -n "$DEB" ] && [ -f "$DEB" ] || die "--deb names no file: '$DEB'"
[ -n "$CONFIG" ] && [ -f "$CONFIG" ] || die "--config names no file: '$CONFIG'"
[ -n "$OUT" ] || die "--out is required"
[ -z "$KEYRING" ] || [ -f "$KEYRING" ] || die "--rauc-keyring names no file: '$KEYRING'"
[[ "$VERSION" =~ ^[0-9A-Za-z.+~-]{1,64}$ ]] || die "--version: letters, digits and . + ~ - only: '$VERSION'"
[ "$(id -u)" = 0 ] || die "run as root: the root file system keeps its owners"
case "$ARCH" in
    amd64) KERNEL=linux-image-amd64; BOOT_PACKAGES=",rauc,rauc-service,grub-pc-bin,grub-common,fdisk"
           [ "$PI" = 0 ] || die "--pi: a Raspberry Pi is arm64" ;;
    arm64) KERNEL=linux-image-arm64; BOOT_PACKAGES=",rauc,rauc-service,libubootenv-tool,fdisk" ;;
    *) die "--arch: amd64 or arm64" ;;
esac
for tool in mmdebstrap mkfs.ext4 chroot flock; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is missing (apt-get install mmdebstrap e2fsprogs)"
done
if [ "$ARCH" = arm64 ] && [ "$PI" = 0 ] && [ "$SLOT_ONLY" = 0 ]; then
    for tool in mkfs.vfat mcopy mkimage; do
        command -v "$tool" >/dev/null 2>&1 || die "$tool is missing (apt-get install dosfstools mtools u-boot-tools)"
    done
fi

PACKAGES="systemd,systemd-sysv,udev,$KERNEL,wireless-regdb,python3.11,procps,iproute2,ca-certificates,dbus,kmod$BOOT_PACKAGES"
[ "$CONTAINERS" = 0 ] || PACKAGES="$PACKAGES,podman"
# The initramfs holds the modules that find the root file system on QEMU's disk, not "most" of
# them: a sixth of the size, and seconds of every boot under emulation (set before the kernel's
# package makes it; the list is read from initramfs-tools' modules.d)
INITRAMFS_HOOK='mkdir -p "$1/etc/initramfs-tools/conf.d" "$1/usr/share/initramfs-tools/modules.d"
printf "MODULES=list\n" > "$1/etc/initramfs-tools/conf.d/board"
printf "virtio_pci\nvirtio_mmio\nvirtio_blk\next4\n" > "$1/usr/share/initramfs-tools/modules.d/board"'
BASE_ARGS=(--variant=minbase --architectures="$ARCH" --include="$PACKAGES" --essential-hook="$INITRAMFS_HOOK" bookworm)
key="$(printf '%s\n' "${BASE_ARGS[@]}" | sha256sum | cut -c1-16)"
base="$CACHE/board-base-$ARCH-$key.tar"
mkdir -p "$CACHE"
exec 9>"$CACHE/.board-base-$ARCH.lock"
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
    case "$dest" in /*) ;; *) die "--add: '$dest' is not an absolute path" ;; esac
    chroot "$root" mkdir -p "$(dirname "$dest")"
    # a link in the board (/sbin/init) is replaced, never followed: it may point anywhere on this host
    rm -f "$root$dest"
    cp "$src" "$root$dest"
    [ -z "$mode" ] || chmod "$mode" "$root$dest"
    [ -z "$owner" ] || chroot "$root" chown "$owner" "$dest"
done

echo "$NAME" > "$root/etc/hostname"
printf '127.0.1.1\t%s\n' "$NAME" >> "$root/etc/hosts"
printf 'VERSION=%s\n' "$VERSION" > "$root/etc/edge-agent-board"
# eth*: the boards boot with net.ifnames=0 (below), a Pi's own kernel names it eth0 or end0
printf '[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n' > "$root/etc/systemd/network/20-wired.network"
ln -sf /lib/systemd/system/systemd-networkd.service "$root/etc/systemd/system/multi-user.target.wants/"
# networkd starts once udev has handled the coldplug's events: systemd-networkd 252 that took eth0 at
# its enumeration and again at udev's late "add" failed the link for good under load ("eth0: Failed
# to configure DHCPv4 client: Device or resource busy", then "eth0: Failed"; systemd issue 24201),
# and the board stayed without an address until the next boot
mkdir -p "$root/etc/systemd/system/systemd-networkd.service.d"
printf '[Unit]\nWants=systemd-udev-settle.service\nAfter=systemd-udev-settle.service\n' \
    > "$root/etc/systemd/system/systemd-networkd.service.d/after-udev-settle.conf"
chroot "$root" passwd -d root >/dev/null
for unit in "$root"/etc/systemd/system/*.service "$root"/etc/systemd/system/*.path; do  # --add'ed units:
    # enable those that name a target
    [ -f "$unit" ] || continue
    wanted="$(sed -n 's/^WantedBy=//p' "$unit" | head -n 1)"
    [ -n "$wanted" ] || continue
    mkdir -p "$root/etc/systemd/system/$wanted.wants"
    ln -sf "/etc/systemd/system/$(basename "$unit")" "$root/etc/systemd/system/$wanted.wants/"
done
mkdir -p "$OUT"

if [ "$PI" = 1 ]; then  # a Pi: its firmware boots the kernel; one root file system
    printf '/dev/mmcblk0p2\t/\text4\trw,errors=remount-ro\t0\t1\n' > "$root/etc/fstab"
    cp -L "$root/vmlinuz" "$OUT/vmlinuz"
    cp -L "$root/initrd.img" "$OUT/initrd.img"
    rm -f "$OUT/rootfs.img"
    mkfs.ext4 -q -F -L rootfs -d "$root" "$OUT/rootfs.img" 2G
    echo "$OUT/rootfs.img"
    exit 0
fi

# -- the A/B layout: the data partition holds what outlives a slot --------------------------------
# The slot is what an update carries, so it holds what QEMU's machine needs: the drivers of real
# hardware (graphics, sound, wireless, USB, Ethernet cards, CPU frequency drivers, other file
# systems) and the documentation go (a third of the size, so of a full update's bytes and time).
# (QEMU's CPUs scale no frequency: udev loaded pcc_cpufreq beside powernow_k8 and logged an error.)
modules="$(echo "$root"/usr/lib/modules/*)"
for gone in sound net/wireless net/mac80211 net/bluetooth \
        drivers/{gpu,media,infiniband,staging,usb,iio,comedi,mtd,hwmon,target,video,scsi,ata,isdn,bluetooth} \
        drivers/{nfc,thunderbolt,platform,misc,mfd,power,leds,gnss,mmc,memstick,pcmcia,firewire,parport,w1} \
        drivers/cpufreq \
        drivers/net/{ethernet,wireless,usb,can,wan,wwan,ieee802154,hamradio,arcnet,fddi,appletalk,hippi,hyperv} \
        fs/{xfs,btrfs,nfs,nfsd,ocfs2,smb,f2fs,gfs2,ceph,afs}; do
    rm -rf "${modules:?}/kernel/$gone"
done
chroot "$root" depmod -a "$(basename "$modules")"
rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*/
if [ "$ARCH" = amd64 ]; then
    BOOT_MOUNT="/dev/vda1	/boot/grub	ext4	rw,nodev,nosuid,noexec	0	2"
    BOOTLOADER="bootloader=grub
grubenv=/boot/grub/grubenv"
else
    BOOT_MOUNT="/dev/vda1	/boot/firmware	vfat	rw,nodev,nosuid,noexec,umask=0077	0	0"
    BOOTLOADER="bootloader=uboot"
    printf '# the U-Boot environment: a file on the boot partition (boot.scr loads and saves it)\n/boot/firmware/uboot.env 0x0000 0x4000\n' \
        > "$root/etc/fw_env.config"
fi
cat > "$root/etc/fstab" <<FSTAB
# the root file system is the slot the boot loader booted (root= on the kernel command line)
$BOOT_MOUNT
/dev/vda4	/data	ext4	rw,nodev,nosuid	0	2
/data/edge-agent	/var/lib/edge-agent	none	bind	0	0
/data/edge-agent-installer	/var/lib/edge-agent-installer	none	bind	0	0
/data/edge-agent-apps	/var/lib/edge-agent-apps	none	bind	0	0
/data/private	/var/lib/private	none	bind	0	0
/data/containers	/var/lib/containers	none	bind	0	0
FSTAB
mkdir -p "$root/boot/grub" "$root/boot/firmware" "$root/data" "$root/var/lib/edge-agent-installer" "$root/etc/rauc" \
    "$root/var/lib/edge-agent-apps" "$root/var/lib/private" "$root/var/lib/containers"
[ -z "$KEYRING" ] || install -m 0644 "$KEYRING" "$root/etc/rauc/keyring.pem"
cat > "$root/etc/rauc/system.conf" <<CONF
[system]
compatible=$COMPATIBLE
$BOOTLOADER
data-directory=/data/rauc

[keyring]
path=/etc/rauc/keyring.pem

[slot.rootfs.0]
device=/dev/vda2
type=raw
bootname=A

[slot.rootfs.1]
device=/dev/vda3
type=raw
bootname=B
CONF
# the agent marks a slot good after its own health check, never RAUC at every boot
ln -sf /dev/null "$root/etc/systemd/system/rauc-mark-good.service"

slot_mb=$(( $(du -sm "$root" | cut -f1) * 5 / 4 + 160 ))
[ "$slot_mb" -le "$SLOT_MB" ] || die "the root file system needs ${slot_mb} MiB, the slots have ${SLOT_MB}"
rm -f "$OUT/rootfs.img"
mkfs.ext4 -q -F -L "rootfs-$VERSION" -d "$root" "$OUT/rootfs.img" "${slot_mb}M"
cp -L "$root/vmlinuz" "$OUT/vmlinuz"  # (the slot's own: GRUB loads it from the slot)
cp -L "$root/initrd.img" "$OUT/initrd.img"
if [ "$SLOT_ONLY" = 1 ]; then echo "$OUT/rootfs.img"; exit 0; fi

# the data partition: the state folders, owned as the package made them
data="$tmp/data"
install -d -m 0755 "$data"
install -d -m 0750 -o "$(chroot "$root" id -u edge-agent)" -g "$(chroot "$root" id -g edge-agent)" "$data/edge-agent"
install -d -m 0700 "$data/edge-agent-installer" "$data/rauc" "$data/private" "$data/containers"
install -d -m 0755 "$data/edge-agent-apps"
mkfs.ext4 -q -F -L data -d "$data" "$tmp/data.img" "${DATA_MB}M"

total_mb=$(( 1 + BOOT_MB + 2 * SLOT_MB + DATA_MB ))
disk="$root/tmp/disk.img"
truncate -s "${total_mb}M" "$disk"
# the partition table first (GRUB's boot sector goes in beside it): partition 1 is FAT on arm64
chroot "$root" sfdisk -q --no-reread --no-tell-kernel /tmp/disk.img >/dev/null <<LAYOUT
label: dos
start=1MiB, size=${BOOT_MB}MiB, type=$([ "$ARCH" = arm64 ] && echo c || echo 83), bootable
size=${SLOT_MB}MiB, type=83
size=${SLOT_MB}MiB, type=83
size=${DATA_MB}MiB, type=83
LAYOUT
boot="$tmp/boot"
mkdir -p "$boot"
if [ "$ARCH" = arm64 ]; then
    # the boot partition (FAT, U-Boot reads and writes it): boot.scr, RAUC's U-Boot logic, and
    # uboot.env, its variables (4-byte CRC-32, then NUL-separated name=value up to 16 KiB, as
    # U-Boot's `env export -c` and libubootenv write it)
    cat > "$tmp/boot.cmd" <<'UBOOT'
# RAUC's U-Boot logic: BOOT_ORDER, BOOT_x_LEFT (boots a slot may still try). The first slot in
# BOOT_ORDER with attempts left boots and loses one; the agent's commit (`rauc status mark-good`)
# gives them back. The variables live in uboot.env on this partition: `saveenv` has no flash to
# write on QEMU's virt machine, so the script loads and saves them itself (at 0x4f000000, clear of
# this script at scriptaddr, the kernel, its compressed copy and the initramfs).
setenv BOOT_ORDER
setenv BOOT_A_LEFT
setenv BOOT_B_LEFT
if fatload virtio 0:1 0x4f000000 uboot.env; then env import -c 0x4f000000 0x4000; fi
test -n "${BOOT_ORDER}" || setenv BOOT_ORDER "A B"
test -n "${BOOT_A_LEFT}" || setenv BOOT_A_LEFT 3
test -n "${BOOT_B_LEFT}" || setenv BOOT_B_LEFT 0
setenv bootpart
for BOOT_SLOT in "${BOOT_ORDER}"; do
  if test "x${bootpart}" != "x"; then
    # a slot was chosen: skip the others
  elif test "x${BOOT_SLOT}" = "xA"; then
    if test 0x${BOOT_A_LEFT} -gt 0; then
      setexpr BOOT_A_LEFT ${BOOT_A_LEFT} - 1
      setenv bootpart 2
      setenv raucslot A
    fi
  elif test "x${BOOT_SLOT}" = "xB"; then
    if test 0x${BOOT_B_LEFT} -gt 0; then
      setexpr BOOT_B_LEFT ${BOOT_B_LEFT} - 1
      setenv bootpart 3
      setenv raucslot B
    fi
  fi
done
if test -z "${bootpart}"; then
  echo "EA-BOOT no slot has attempts left: both get 3 again"
  setenv BOOT_A_LEFT 3
  setenv BOOT_B_LEFT 3
fi
env export -c -s 0x4000 0x4f000000 BOOT_ORDER BOOT_A_LEFT BOOT_B_LEFT
fatwrite virtio 0:1 0x4f000000 uboot.env 0x4000
if test -z "${bootpart}"; then reset; fi
echo "EA-BOOT slot=${raucslot} order=${BOOT_ORDER} A_LEFT=${BOOT_A_LEFT} B_LEFT=${BOOT_B_LEFT}"
setenv kernel_comp_addr_r 0x50000000
ext4load virtio 0:${bootpart} ${kernel_addr_r} /vmlinuz
setenv kernel_comp_size ${filesize}
ext4load virtio 0:${bootpart} 0x48000000 /initrd.img
setenv bootargs "root=/dev/vda${bootpart} rw console=ttyAMA0 panic=5 net.ifnames=0 systemd.show_status=0 rauc.slot=${raucslot}"
booti ${kernel_addr_r} 0x48000000:${filesize} ${fdtcontroladdr}
UBOOT
    mkimage -q -A arm64 -T script -C none -n "edge-agent A/B" -d "$tmp/boot.cmd" "$boot/boot.scr" >/dev/null
    python3 - "$boot/uboot.env" <<'ENV'
import sys, zlib
data = b"BOOT_ORDER=A B\0BOOT_A_LEFT=3\0BOOT_B_LEFT=0\0".ljust(0x4000 - 4, b"\0")
open(sys.argv[1], "wb").write(zlib.crc32(data).to_bytes(4, "little") + data)
ENV
    rm -f "$tmp/boot.img"
    mkfs.vfat -C -n BOOT "$tmp/boot.img" $(( BOOT_MB * 1024 )) >/dev/null
    mcopy -i "$tmp/boot.img" "$boot/boot.scr" "$boot/uboot.env" ::/
else
# the boot partition: GRUB's config, its environment (RAUC's variables) and its modules
cp -r "$root/usr/lib/grub/i386-pc" "$boot/i386-pc"
cat > "$boot/grub.cfg" <<'GRUB'
# RAUC's A/B logic: ORDER, A_OK/B_OK (the slot may boot), A_TRY/B_TRY (it was tried and not yet
# marked good). The first slot in ORDER that is OK and untried boots and is marked tried.
# GRUB writes to the serial port itself (the board's console): through the BIOS screen its
# lines reach the serial port only when the BIOS gets round to it.
serial --unit=0 --speed=115200
terminal_output serial
terminal_input serial
set timeout=0
set ORDER="A B"
set A_OK=0
set B_OK=0
set A_TRY=0
set B_TRY=0
load_env
set BOOT=""
for SLOT in $ORDER; do
    if [ -z "$BOOT" -a "$SLOT" = "A" -a "$A_OK" = "1" -a "$A_TRY" = "0" ]; then set BOOT=A; set A_TRY=1; fi
    if [ -z "$BOOT" -a "$SLOT" = "B" -a "$B_OK" = "1" -a "$B_TRY" = "0" ]; then set BOOT=B; set B_TRY=1; fi
done
# every slot tried and none marked good since (a power loss early in a boot): the first OK slot
# in ORDER boots again, so a device always boots
for SLOT in $ORDER; do
    if [ -z "$BOOT" -a "$SLOT" = "A" -a "$A_OK" = "1" ]; then set BOOT=A; fi
    if [ -z "$BOOT" -a "$SLOT" = "B" -a "$B_OK" = "1" ]; then set BOOT=B; fi
done
if [ -z "$BOOT" ]; then set BOOT=A; fi
save_env A_TRY B_TRY
echo "EA-BOOT slot=$BOOT order=$ORDER A_OK=$A_OK A_TRY=$A_TRY B_OK=$B_OK B_TRY=$B_TRY"
if [ "$BOOT" = "A" ]; then set PART=2; else set PART=3; fi
# (no_timer_check: under a loaded host the kernel finds the emulated timer late and logs an error;
# net.ifnames=0: no rename of eth0, which raced systemd-networkd 252 under load: "ens3: Failed to
# configure DHCPv4 client: Device or resource busy", and the board stayed without an address)
linux (hd0,msdos$PART)/vmlinuz root=/dev/vda$PART rw console=ttyS0 panic=5 no_timer_check net.ifnames=0 systemd.show_status=0 rauc.slot=$BOOT
initrd (hd0,msdos$PART)/initrd.img
boot
GRUB
chroot "$root" sh -c 'grub-editenv /tmp/grubenv create && grub-editenv /tmp/grubenv set ORDER="A B" A_OK=1 A_TRY=0 B_OK=0 B_TRY=0'
mv "$root/tmp/grubenv" "$boot/grubenv"
mkfs.ext4 -q -F -L boot -d "$boot" "$tmp/boot.img" "${BOOT_MB}M"
# GRUB's boot sector and core image, before partition 1
chroot "$root" grub-mkimage -O i386-pc -o /tmp/core.img -p '(hd0,msdos1)/' \
    biosdisk part_msdos ext2 normal linux echo test loadenv configfile minicmd
[ "$(stat -c %s "$root/tmp/core.img")" -lt $(( 1024 * 1024 - 512 )) ] || die "GRUB's core image does not fit before partition 1"
dd if="$root/usr/lib/grub/i386-pc/boot.img" of="$disk" bs=440 count=1 conv=notrunc status=none
dd if="$root/tmp/core.img" of="$disk" bs=512 seek=1 conv=notrunc status=none
fi
# then each file system
offset=1
for part in "$tmp/boot.img:$BOOT_MB" "$OUT/rootfs.img:$SLOT_MB" "" "$tmp/data.img:$DATA_MB"; do
    if [ -n "$part" ]; then
        dd if="${part%%:*}" of="$disk" bs=1M seek="$offset" conv=notrunc,sparse status=none
        offset=$(( offset + ${part##*:} ))
    else
        offset=$(( offset + SLOT_MB ))  # slot B: empty until the first update
    fi
done
rm -f "$OUT/disk.img"
mv "$disk" "$OUT/disk.img"
echo "$OUT/disk.img"
