#!/usr/bin/env bash
# Build the Debian package of the agent: dist/edge-agent_VERSION_ARCH.deb, for Debian bookworm and
# Raspberry Pi OS (Python 3.11).
#
#   scripts/build-deb.sh                       # for this machine's architecture
#   scripts/build-deb.sh --arch arm64          # for a Raspberry Pi (wheels for aarch64 from PyPI)
#   scripts/build-deb.sh --version 0.2.0+1 --out /tmp/debs
#
# Installed with `apt install ./edge-agent_VERSION_ARCH.deb`. What it holds and why:
#   /usr/lib/edge-agent           a private Python environment: the agent and the exact versions of
#                                 its dependencies (aiomqtt, paho-mqtt 2.2, msgspec, ...), which
#                                 Debian's own packages do not have at these versions (bookworm's
#                                 paho-mqtt is 1.6; aiomqtt is not packaged). It runs on Debian's
#                                 python3.11; bytecode is compiled at install, removed at removal
#   /usr/bin/edge-agent           the command
#   /lib/systemd/system/          edge-agent.service, edge-agent@.service, the root install helper
#                                 and its socket, the application helper and its socket, as in systemd/
#                                 (ExecStart names /usr/lib/edge-agent)
#   /usr/lib/sysusers.d/          the user edge-agent and the helper's group (systemd-sysusers)
#   /etc/edge-agent/agent.toml    conffiles: configs/worker.toml (state in /var/lib/edge-agent)
#   /etc/edge-agent/installer.toml  and the root helper's config (root's alone)
# An upgrade keeps /var/lib/edge-agent and the conffiles as the operator left them, and starts the
# agent again if it ran; `apt purge` removes the state, the configuration and the CRL folder.
set -euo pipefail
umask 022  # what it makes is the package's, not this shell's (dpkg-deb refuses a 0750 DEBIAN/)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="build-deb.sh"
ARCH="$(dpkg --print-architecture)"
OUT="$ROOT/dist"
VERSION=""
PYTHON_VERSION="3.11"
PREFIX="/usr/lib/edge-agent"
MAINTAINER="${DEBFULLNAME:-edge-agent developers} <${DEBEMAIL:-edge-agent@users.noreply.github.com}>"

die() { echo "$PROG: error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) [ $# -ge 2 ] || die "--arch needs a value"; ARCH="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a value"; OUT="$2"; shift 2 ;;
        --version) [ $# -ge 2 ] || die "--version needs a value"; VERSION="$2"; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
case "$ARCH" in
    amd64) PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64) ;;
    arm64) PLATFORMS=(manylinux_2_17_aarch64 manylinux2014_aarch64 manylinux_2_28_aarch64 manylinux_2_31_aarch64) ;;
    *) die "--arch must be amd64 or arm64, not '$ARCH'" ;;
esac
for tool in dpkg-deb fakeroot python3; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is missing (apt-get install dpkg-dev fakeroot python3)"
done
[ -n "$VERSION" ] || VERSION="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$ROOT/agent/__init__.py")"
[ -n "$VERSION" ] || die "no __version__ in agent/__init__.py"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
stage="$tmp/root"
pip=(env PIP_ROOT_USER_ACTION=ignore python3 -m pip --disable-pip-version-check --quiet)

# -- the private environment: wheels for the target, laid out as a virtual environment -------------
mkdir -p "$tmp/src" "$tmp/wheels"
(cd "$ROOT" && cp -r pyproject.toml README.md agent firmware_rollout config_rollout app_rollout release_rollout rollout_engine "$tmp/src/")
find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
"${pip[@]}" wheel --no-deps --wheel-dir "$tmp/wheels" "$tmp/src"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
site="$stage$PREFIX/lib/python$PYTHON_VERSION/site-packages"
"${pip[@]}" install --no-compile --only-binary=:all: "${platform_args[@]}" --python-version "$PYTHON_VERSION" \
    --implementation cp --target "$site" --find-links "$tmp/wheels" "$tmp"/wheels/edge_agent-*.whl
rm -rf "$site/bin"
find "$site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p "$stage$PREFIX/bin"
ln -s "../../../bin/python$PYTHON_VERSION" "$stage$PREFIX/bin/python"
ln -s python "$stage$PREFIX/bin/python3"
printf 'home = /usr/bin\ninclude-system-site-packages = false\nversion = %s\n' "$PYTHON_VERSION" \
    > "$stage$PREFIX/pyvenv.cfg"
cat > "$stage$PREFIX/bin/edge-agent" <<EOF
#!$PREFIX/bin/python
import sys

from agent.cli import main

sys.exit(main())
EOF
chmod 0755 "$stage$PREFIX/bin/edge-agent"
mkdir -p "$stage/usr/bin"
ln -s ../lib/edge-agent/bin/edge-agent "$stage/usr/bin/edge-agent"

# -- units, the user, the configuration --------------------------------------------------------------
units="$stage/lib/systemd/system"
mkdir -p "$units"
for f in edge-agent.service edge-agent@.service edge-agent-installer.service edge-agent-installer.socket \
         edge-agent-apps.service edge-agent-apps.socket; do
    sed "s|/usr/bin/env /opt/edge-agent/bin/edge-agent|$PREFIX/bin/edge-agent|; s|/opt/edge-agent/bin/edge-agent|$PREFIX/bin/edge-agent|" \
        "$ROOT/systemd/$f" > "$units/$f"
done
mkdir -p "$stage/usr/lib/sysusers.d"
cat > "$stage/usr/lib/sysusers.d/edge-agent.conf" <<'EOF'
# edge-agent's service user; its group edge-agent is the local API's (add applications' users to it)
u edge-agent - "edge-agent service" /var/lib/edge-agent /usr/sbin/nologin
# the root install helper's socket: the agent's user alone may ask it
g edge-agent-installer -
m edge-agent edge-agent-installer
# the root application helper's socket: the agent's user alone may ask it
g edge-agent-apps -
m edge-agent edge-agent-apps
EOF
mkdir -p "$stage/etc/edge-agent"
sed -E 's|^data_dir = .*|data_dir = "/var/lib/edge-agent"|' "$ROOT/configs/worker.toml" > "$stage/etc/edge-agent/agent.toml"
cp "$ROOT/configs/installer.toml" "$stage/etc/edge-agent/installer.toml"
chmod 0644 "$stage/etc/edge-agent/agent.toml" "$stage/etc/edge-agent/installer.toml"  # postinst: statoverrides

# -- Debian's files ---------------------------------------------------------------------------------
doc="$stage/usr/share/doc/edge-agent"
mkdir -p "$doc" "$stage/usr/share/lintian/overrides"
cat > "$doc/copyright" <<'EOF'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: edge-agent

Files: *
Copyright: the edge-agent developers
License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
 .
 The private environment in /usr/lib/edge-agent holds the agent's Python dependencies, each
 under its own license, as listed in its dist-info folder there.
EOF
printf 'edge-agent (%s) stable; urgency=medium\n\n  * Built from the edge-agent source tree.\n\n -- %s  %s\n' \
    "$VERSION" "$MAINTAINER" "$(date -R -u -d @"${SOURCE_DATE_EPOCH:-$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || date +%s)}")" \
    | gzip -9n > "$doc/changelog.gz"
cat > "$stage/usr/share/lintian/overrides/edge-agent" <<'EOF'
# the private environment holds the agent's dependencies as their wheels built them (PyPI's
# manylinux builds): their compiled modules are theirs, not built by this package
edge-agent: embedded-library *[usr/lib/edge-agent/*]
edge-agent: hardening-no-fortify-functions [usr/lib/edge-agent/*]
edge-agent: unstripped-binary-or-object [usr/lib/edge-agent/*]
edge-agent: shared-library-lacks-prerequisites [usr/lib/edge-agent/*]
edge-agent: library-not-linked-against-libc [usr/lib/edge-agent/*]
edge-agent: spelling-error-in-binary * [usr/lib/edge-agent/*]
edge-agent: package-contains-documentation-outside-usr-share-doc [usr/lib/edge-agent/*]
edge-agent: executable-not-elf-or-script [usr/lib/edge-agent/*]
edge-agent: script-not-executable [usr/lib/edge-agent/*]
edge-agent: package-contains-vcs-control-file [usr/lib/edge-agent/*]
edge-agent: no-manual-page [usr/bin/edge-agent]
EOF
find "$stage" -type d -exec chmod 0755 {} +
find "$site" -type f -exec chmod u=rw,go=r {} +
find "$site" -type f -name '*.so' -exec chmod 0644 {} +

debian="$stage/DEBIAN"
mkdir -p "$debian"
size="$(du -sk --exclude=DEBIAN "$stage" | cut -f1)"
cat > "$debian/control" <<EOF
Package: edge-agent
Version: $VERSION
Architecture: $ARCH
Maintainer: $MAINTAINER
Installed-Size: $size
Depends: python$PYTHON_VERSION, systemd, procps, libc6
Section: admin
Priority: optional
Homepage: https://github.com/edge-agent/edge-agent
Description: agent for fleets of small Linux devices
 A worker on every device and a leader on a gateway, over MQTT v5: a durable
 store-and-forward outbox that never loses a message across offline periods,
 firmware and configuration rolled out in waves, device identities with mutual
 TLS, and a local API for the device's applications.
EOF
printf '/etc/edge-agent/agent.toml\n/etc/edge-agent/installer.toml\n' > "$debian/conffiles"
install -m 0755 "$ROOT/packaging/debian/postinst" "$debian/postinst"
install -m 0755 "$ROOT/packaging/debian/prerm" "$debian/prerm"
install -m 0755 "$ROOT/packaging/debian/postrm" "$debian/postrm"

mkdir -p "$OUT"
deb="$OUT/edge-agent_${VERSION}_${ARCH}.deb"
fakeroot dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
