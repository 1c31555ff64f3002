#!/usr/bin/env bash
# Install edge-agent as a systemd service, from this checkout.
#
#   sudo scripts/install.sh --role worker            # a device
#   sudo scripts/install.sh --role leader            # a gateway
#   sudo scripts/install.sh --role leader --instance leader   # a second agent on one host
#   scripts/install.sh --role worker --prefix /tmp/root       # stage into a temporary root
#   sudo scripts/install.sh --uninstall [--purge]
#   sudo scripts/install.sh --role worker --device-id pi-0042 --broker mqtts://gw:8883 \
#        --fleet-ca ca.crt --enrol mqtts://gw:8884 --claim-password-file claim-pw
#                                            # a device that enrols itself (docs/service.md)
#
# Lays out:  /opt/edge-agent (virtual environment with the package), /etc/edge-agent/agent.toml
# (from configs/<role>.toml, never overwritten, mode 0600, owned by the service user),
# /etc/systemd/system/edge-agent.service and edge-agent@.service, the multi-user.target.wants
# link that enables the unit, and /etc/sysusers.d/edge-agent.conf declaring the system user.
#
# --prefix DIR (or DESTDIR=DIR) installs under DIR instead of /: no user is created (the
# sysusers.d file records it; systemd-sysusers creates it at first boot), nothing is chown'ed,
# systemctl is not called and the unit is enabled by writing its wants symlink by hand. The
# virtual environment's scripts point at DIR/opt/edge-agent, so a staged tree is for checking the
# layout (and CI), not for copying to a device: run the installer on the device.
#
# Idempotent: a second run with the same checkout changes no file.
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="install.sh"
USER_NAME="edge-agent"
HELPER_GROUP="edge-agent-installer"  # the install helper's socket: the agent's user alone
APPS_GROUP="edge-agent-apps"  # the application helper's socket: the agent's user alone
MIN_PYTHON="3.11"

ROLE="worker"
PREFIX="${DESTDIR:-}"
INSTANCE=""
UNINSTALL=0
PURGE=0
PYTHON="${PYTHON:-python3}"
SYSTEMD_VERSION=""
DEVICE_ID=""
BROKER=""
FLEET_CA=""
ENROL=""
CLAIM_USER="claim"
CLAIM_PASSWORD_FILE=""
TOKEN_FILE=""

die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*"; }

usage() {
    cat <<EOF
usage: $PROG [--role worker|leader] [--instance NAME] [--prefix DIR] [--python PATH]
             [--systemd-version N] [--uninstall [--purge]]

  --role ROLE          which configs/ROLE.toml seeds the config (default: worker)
  --instance NAME      install edge-agent@NAME.service with /etc/edge-agent/NAME.toml and
                       state in /var/lib/edge-agent/NAME (several agents on one host)
  --prefix DIR         install under DIR instead of / (also: DESTDIR=DIR), for tests and CI
  --python PATH        interpreter for the virtual environment (default: python3, >= $MIN_PYTHON)
  --systemd-version N  the target's systemd version (default: asked from systemctl); >= 254 gets
                       the restart back-off drop-in (RestartSteps=, RestartMaxDelaySec=)
  --device-id ID       the new config's agent.device_id (default: this host's name)
  --broker URL         the new config's [mqtt] url (a device with --enrol: mqtts://host:8883)
  --fleet-ca FILE      the fleet's CA certificate, copied to /etc/edge-agent/fleet-ca.crt ([mqtt] tls_ca)
  --enrol URL          a device enrols itself at the broker's enrolment listener (mqtts://host:8884):
                       it makes its own key, an operator runs edge-agent devices approve ID
  --claim-user NAME    the fleet's claim credential (default: claim)
  --claim-password-file FILE   its password, copied to /etc/edge-agent/claim-password (0600)
  --token-file FILE    a batch's enrolment token (edge-agent devices token), approved at once
  --uninstall          disable and remove the unit and /opt/edge-agent; keeps config and state
  --purge              with --uninstall: also remove /etc/edge-agent, /var/lib/edge-agent, the user
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --role) [ $# -ge 2 ] || die "--role needs a value"; ROLE="$2"; shift 2 ;;
        --role=*) ROLE="${1#*=}"; shift ;;
        --instance) [ $# -ge 2 ] || die "--instance needs a value"; INSTANCE="$2"; shift 2 ;;
        --instance=*) INSTANCE="${1#*=}"; shift ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a value"; PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs a value"; PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        --systemd-version) [ $# -ge 2 ] || die "--systemd-version needs a value"
                           SYSTEMD_VERSION="$2"; shift 2 ;;
        --systemd-version=*) SYSTEMD_VERSION="${1#*=}"; shift ;;
        --device-id) [ $# -ge 2 ] || die "--device-id needs a value"; DEVICE_ID="$2"; shift 2 ;;
        --broker) [ $# -ge 2 ] || die "--broker needs a value"; BROKER="$2"; shift 2 ;;
        --fleet-ca) [ $# -ge 2 ] || die "--fleet-ca needs a value"; FLEET_CA="$2"; shift 2 ;;
        --enrol) [ $# -ge 2 ] || die "--enrol needs a value"; ENROL="$2"; shift 2 ;;
        --claim-user) [ $# -ge 2 ] || die "--claim-user needs a value"; CLAIM_USER="$2"; shift 2 ;;
        --claim-password-file) [ $# -ge 2 ] || die "--claim-password-file needs a value"
                               CLAIM_PASSWORD_FILE="$2"; shift 2 ;;
        --token-file) [ $# -ge 2 ] || die "--token-file needs a value"; TOKEN_FILE="$2"; shift 2 ;;
        --uninstall) UNINSTALL=1; shift ;;
        --purge) PURGE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

case "$ROLE" in worker|leader) ;; *) die "--role must be worker or leader, not '$ROLE'" ;; esac
if [ -n "$ENROL" ]; then
    [ "$ROLE" = worker ] || die "--enrol is for a device (--role worker)"
    [[ "$ENROL" == mqtts://* ]] || die "--enrol must be the broker's mqtts:// enrolment listener, not '$ENROL'"
    [[ "$BROKER" == mqtts://* ]] || die "--enrol needs --broker mqtts://HOST:PORT (the device's mutual TLS listener)"
    [ -n "$CLAIM_PASSWORD_FILE" ] || die "--enrol needs --claim-password-file FILE"
fi
for f in "$FLEET_CA" "$CLAIM_PASSWORD_FILE" "$TOKEN_FILE"; do
    [ -z "$f" ] || [ -r "$f" ] || die "cannot read $f"
done
if [ -n "$DEVICE_ID" ] && ! [[ "$DEVICE_ID" =~ ^[A-Za-z0-9_.:-]+$ ]]; then
    die "--device-id must be letters, digits, '_', '.', ':' or '-', not '$DEVICE_ID'"
fi
if [ -n "$INSTANCE" ] && ! [[ "$INSTANCE" =~ ^[A-Za-z0-9_.-]+$ ]]; then
    die "--instance must be letters, digits, '_', '.' or '-', not '$INSTANCE'"
fi
[ "$PURGE" = 1 ] && [ "$UNINSTALL" = 0 ] && die "--purge only goes with --uninstall"
if [ -n "$SYSTEMD_VERSION" ] && ! [[ "$SYSTEMD_VERSION" =~ ^[0-9]+$ ]]; then
    die "--systemd-version must be a number"
fi

# -- where ----------------------------------------------------------------------------------------
PREFIX="${PREFIX%/}"
STAGING=0
if [ -n "$PREFIX" ]; then
    case "$PREFIX" in /*) ;; *) PREFIX="$(pwd)/$PREFIX" ;; esac
    if [ "$(cd "$PREFIX" 2>/dev/null && pwd -P)" != "/" ]; then STAGING=1; else PREFIX=""; fi
fi

if [ "$(id -u)" != 0 ]; then
    if [ "$STAGING" = 0 ]; then
        die "must run as root to install into / (use sudo), or stage with --prefix DIR"
    fi
    mkdir -p "$PREFIX" 2>/dev/null || die "cannot create --prefix $PREFIX"
    [ -w "$PREFIX" ] || die "--prefix $PREFIX is not writable by you (uid $(id -u))"
fi

LIVE=0   # talk to the running systemd?
if [ "$STAGING" = 0 ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    LIVE=1
fi

OPT="$PREFIX/opt/edge-agent"
ETC="$PREFIX/etc/edge-agent"
UNITDIR="$PREFIX/etc/systemd/system"
WANTS="$UNITDIR/multi-user.target.wants"
SYSUSERS="$PREFIX/etc/sysusers.d/edge-agent.conf"
STATE="$PREFIX/var/lib/edge-agent"
if [ -n "$INSTANCE" ]; then
    UNIT="edge-agent@$INSTANCE.service"
    UNIT_FILE="edge-agent@.service"
    CONFIG="$ETC/$INSTANCE.toml"
    DATA_DIR="/var/lib/edge-agent/$INSTANCE"
else
    UNIT="edge-agent.service"
    UNIT_FILE="edge-agent.service"
    CONFIG="$ETC/agent.toml"
    DATA_DIR="/var/lib/edge-agent"
fi

user_exists() { getent passwd "$USER_NAME" >/dev/null 2>&1; }

# put_file SRC DEST MODE: install only when the content or mode differs
put_file() {
    local src="$1" dest="$2" mode="$3"
    if [ -f "$dest" ] && cmp -s "$src" "$dest" && [ "$(stat -c %a "$dest")" = "${mode#0}" ]; then
        say "unchanged $dest"
        return 0
    fi
    install -D -m "$mode" "$src" "$dest"
    say "wrote $dest"
}

# put_link TARGET LINK
put_link() {
    local target="$1" link="$2"
    if [ -L "$link" ] && [ "$(readlink "$link")" = "$target" ]; then
        say "unchanged $link"
        return 0
    fi
    mkdir -p "$(dirname "$link")"
    ln -sfn "$target" "$link"
    say "linked $link -> $target"
}

systemd_version() {
    if [ -n "$SYSTEMD_VERSION" ]; then echo "$SYSTEMD_VERSION"; return; fi
    if command -v systemctl >/dev/null 2>&1; then
        systemctl --version 2>/dev/null | awk 'NR == 1 { print $2 }' | grep -E '^[0-9]+$' || true
    fi
}

# -- uninstall ------------------------------------------------------------------------------------
if [ "$UNINSTALL" = 1 ]; then
    units=()
    for link in "$WANTS"/edge-agent.service "$WANTS"/edge-agent@*.service; do
        [ -L "$link" ] && units+=("$(basename "$link")")
    done
    if [ "$LIVE" = 1 ]; then
        for unit in "${units[@]}"; do systemctl disable --now "$unit" || true; done
    fi
    for unit in "${units[@]}"; do rm -f "$WANTS/$unit"; say "removed $WANTS/$unit"; done
    rmdir "$WANTS" 2>/dev/null || true
    if [ "$LIVE" = 1 ] && [ -e "$UNITDIR/edge-agent-installer.socket" ]; then
        systemctl disable --now edge-agent-installer.socket edge-agent-installer.service || true
    fi
    if [ "$LIVE" = 1 ] && [ -e "$UNITDIR/edge-agent-apps.socket" ]; then
        systemctl disable --now edge-agent-apps.socket edge-agent-apps.service || true
    fi
    rm -f "$UNITDIR/sockets.target.wants/edge-agent-installer.socket" "$UNITDIR/sockets.target.wants/edge-agent-apps.socket"
    rmdir "$UNITDIR/sockets.target.wants" 2>/dev/null || true
    for f in edge-agent.service edge-agent@.service edge-agent-installer.socket edge-agent-installer.service \
             edge-agent-apps.socket edge-agent-apps.service; do
        if [ -e "$UNITDIR/$f" ]; then rm -f "$UNITDIR/$f"; say "removed $UNITDIR/$f"; fi
        rm -rf "$UNITDIR/$f.d"
    done
    if [ -d "$OPT" ]; then rm -rf "$OPT"; say "removed $OPT"; fi
    rm -f "$SYSUSERS"
    [ "$LIVE" = 1 ] && systemctl daemon-reload
    if [ "$PURGE" = 1 ]; then
        rm -rf "$ETC" "$STATE"
        say "purged $ETC and $STATE"
        if [ "$STAGING" = 0 ] && user_exists; then
            userdel "$USER_NAME" && say "removed user $USER_NAME"
        fi
    else
        say "kept $ETC and $STATE (use --purge to remove them)"
    fi
    exit 0
fi

# -- checks ---------------------------------------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || die "Python interpreter '$PYTHON' not found (use --python)"
if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    found="$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null \
             || echo unknown)"
    die "edge-agent needs Python >= $MIN_PYTHON; $PYTHON is $found (use --python PATH)"
fi
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
    || die "$PYTHON cannot create virtual environments; install python3-venv (apt-get install python3-venv)"
[ -f "$SRC/configs/$ROLE.toml" ] || die "missing $SRC/configs/$ROLE.toml"
[ -f "$SRC/systemd/$UNIT_FILE" ] || die "missing $SRC/systemd/$UNIT_FILE"

# -- user -----------------------------------------------------------------------------------------
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
printf '%s\n' \
    "# edge-agent service user (scripts/install.sh); systemd-sysusers creates it if missing" \
    "u $USER_NAME - \"edge-agent service\" /var/lib/edge-agent /usr/sbin/nologin" > "$tmp/sysusers"
if [ "$ROLE" = worker ]; then
    printf '%s\n' "g $HELPER_GROUP -" "m $USER_NAME $HELPER_GROUP" "g $APPS_GROUP -" "m $USER_NAME $APPS_GROUP" \
        >> "$tmp/sysusers"
fi
put_file "$tmp/sysusers" "$SYSUSERS" 0644
if [ "$STAGING" = 1 ]; then
    say "staging root: not creating user $USER_NAME (recorded in $SYSUSERS for systemd-sysusers)"
elif user_exists; then
    say "unchanged user $USER_NAME"
else
    useradd --system --user-group --home-dir /var/lib/edge-agent --no-create-home \
        --shell /usr/sbin/nologin --comment "edge-agent service" "$USER_NAME"
    say "created system user $USER_NAME"
fi
if [ "$ROLE" = worker ] && [ "$STAGING" = 0 ]; then
    for group in "$HELPER_GROUP" "$APPS_GROUP"; do
        if ! getent group "$group" >/dev/null; then
            groupadd --system "$group"
            say "created group $group (a root helper's socket)"
        fi
        if ! id -nG "$USER_NAME" | tr ' ' '\n' | grep -qx "$group"; then
            usermod -a -G "$group" "$USER_NAME"
            say "added $USER_NAME to $group"
        fi
    done
fi

# -- virtual environment and package --------------------------------------------------------------
if [ -x "$OPT/bin/python" ]; then
    say "unchanged $OPT (virtual environment)"
else
    mkdir -p "$(dirname "$OPT")"
    "$PYTHON" -m venv "$OPT"
    say "created virtual environment $OPT"
fi

# the package is reinstalled only when the checkout's sources changed (same sources: same files)
sources=()
for p in pyproject.toml README.md LICENSE agent firmware_rollout config_rollout app_rollout release_rollout rollout_engine; do
    [ -e "$SRC/$p" ] && sources+=("$p")
done
stamp="$(cd "$SRC" && find "${sources[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' \
         -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
if [ -f "$OPT/.source-sha256" ] && [ "$(cat "$OPT/.source-sha256")" = "$stamp" ]; then
    say "unchanged edge-agent package in $OPT"
else
    # build from a copy so the checkout gets no build/ or *.egg-info
    mkdir "$tmp/src"
    (cd "$SRC" && cp -r "${sources[@]}" "$tmp/src/")
    find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
    "$OPT/bin/python" -m pip install --quiet --disable-pip-version-check "$tmp/src"
    echo "$stamp" > "$OPT/.source-sha256"
    say "installed edge-agent package into $OPT"
fi
[ -x "$OPT/bin/edge-agent" ] || die "$OPT/bin/edge-agent is missing after the install"

# -- config ---------------------------------------------------------------------------------------
if [ -d "$ETC" ]; then say "unchanged $ETC"; else install -d -m 0750 "$ETC"; say "created $ETC"; fi
if [ -e "$CONFIG" ]; then
    say "kept existing $CONFIG"
else
    sed -E "s|^data_dir = .*|data_dir = \"$DATA_DIR\"|" "$SRC/configs/$ROLE.toml" > "$tmp/config"
    if [ -n "$DEVICE_ID$BROKER$FLEET_CA$ENROL" ]; then
        id="${DEVICE_ID:-$(hostname)}"
        sed -i -E "s|^device_id = .*|device_id = \"$id\"|" "$tmp/config"
        [ -z "$BROKER" ] || sed -i -E "0,/^url = .*/s||url = \"$BROKER\"|" "$tmp/config"
        [ -z "$FLEET_CA" ] || sed -i -E "s|^# tls_ca = .*|tls_ca = \"$ETC/fleet-ca.crt\"|" "$tmp/config"
    fi
    if [ -n "$ENROL" ]; then
        {
            echo
            echo "# This device enrols itself (docs/service.md, \"Device identity\"): its own key, then mutual TLS."
            echo "[identity]"
            echo "claim_url = \"$ENROL\""
            echo "claim_username = \"$CLAIM_USER\""
            echo "claim_password_file = \"$ETC/claim-password\""
            [ -z "$TOKEN_FILE" ] || echo "token_file = \"$ETC/enrol-token\""
        } >> "$tmp/config"
    fi
    install -m 0600 "$tmp/config" "$CONFIG"
    if [ -n "$ENROL" ]; then
        say "wrote $CONFIG from configs/$ROLE.toml: device ${DEVICE_ID:-$(hostname)} enrols at $ENROL"
    else
        say "wrote $CONFIG from configs/$ROLE.toml: set device_id and [mqtt] before starting"
    fi
fi
copy_secret() {  # FILE DEST MODE: copied once, owned by the service user
    if [ -z "$1" ]; then return; fi
    if [ -e "$2" ] && cmp -s "$1" "$2"; then say "unchanged $2"; return; fi
    install -m "$3" "$1" "$2"
    [ "$STAGING" = 0 ] && chown "$USER_NAME:$USER_NAME" "$2"
    say "wrote $2"
}
copy_secret "$FLEET_CA" "$ETC/fleet-ca.crt" 0644
copy_secret "$CLAIM_PASSWORD_FILE" "$ETC/claim-password" 0600
copy_secret "$TOKEN_FILE" "$ETC/enrol-token" 0600
if [ "$STAGING" = 0 ]; then
    chown "root:$USER_NAME" "$ETC"
    chown "$USER_NAME:$USER_NAME" "$CONFIG"
fi

# the root install helper's own config: root-owned, the agent cannot change which key it trusts
HELPER_CONFIG="$ETC/installer.toml"
if [ "$ROLE" = worker ]; then
    if [ -e "$HELPER_CONFIG" ]; then
        say "kept existing $HELPER_CONFIG"
    else
        install -m 0600 "$SRC/configs/installer.toml" "$HELPER_CONFIG"
        [ "$STAGING" = 0 ] && chown root:root "$HELPER_CONFIG"
        say "wrote $HELPER_CONFIG: set the installer and its table for the install helper"
    fi
fi

# the leader's revocation list for the broker: a folder of its own that the agent writes (the
# units' ReadWritePaths) and the `mosquitto` user reads through its group (the CRL is public;
# the CA's folder under the state directory is 0700)
if [ "$ROLE" = leader ]; then
    CRL_DIR="$PREFIX/var/lib/edge-agent-crl"
    if [ -d "$CRL_DIR" ]; then say "unchanged $CRL_DIR"; else install -d -m 2750 "$CRL_DIR"; say "created $CRL_DIR"; fi
    if [ "$STAGING" = 0 ]; then
        crl_group="$USER_NAME"
        getent group mosquitto >/dev/null 2>&1 && crl_group=mosquitto
        chown "$USER_NAME:$crl_group" "$CRL_DIR"
    fi
fi

# -- units ----------------------------------------------------------------------------------------
for f in edge-agent.service edge-agent@.service; do
    put_file "$SRC/systemd/$f" "$UNITDIR/$f" 0644
done
if [ "$ROLE" = worker ]; then
    for f in edge-agent-installer.socket edge-agent-installer.service edge-agent-apps.socket edge-agent-apps.service; do
        put_file "$SRC/systemd/$f" "$UNITDIR/$f" 0644
    done
fi
version="$(systemd_version)"
dropin="$UNITDIR/$UNIT_FILE.d/restart-backoff.conf"
if [ -n "$version" ] && [ "$version" -ge 254 ]; then
    printf '%s\n' "# written by scripts/install.sh: systemd $version supports a growing restart delay" \
        "[Service]" "RestartSteps=10" "RestartMaxDelaySec=5min" > "$tmp/backoff"
    put_file "$tmp/backoff" "$dropin" 0644
else
    say "systemd ${version:-version unknown}: fixed RestartSec= (RestartSteps= needs 254)"
fi

if [ "$LIVE" = 1 ]; then
    systemctl daemon-reload
    systemctl enable "$UNIT"
    say "enabled $UNIT; start it with: systemctl start $UNIT"
    if [ "$ROLE" = worker ]; then
        systemctl enable --now edge-agent-installer.socket edge-agent-apps.socket
        say "enabled edge-agent-installer.socket and edge-agent-apps.socket (the root helpers start on their first request)"
    fi
else
    put_link "/etc/systemd/system/$UNIT_FILE" "$WANTS/$UNIT"
    if [ "$ROLE" = worker ]; then
        put_link "/etc/systemd/system/edge-agent-installer.socket" \
            "$UNITDIR/sockets.target.wants/edge-agent-installer.socket"
        put_link "/etc/systemd/system/edge-agent-apps.socket" "$UNITDIR/sockets.target.wants/edge-agent-apps.socket"
    fi
    if [ "$STAGING" = 1 ]; then why="staging into $PREFIX"; else why="systemd is not running"; fi
    say "enabled $UNIT by symlink (systemctl not used: $why)"
fi
