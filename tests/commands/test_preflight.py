"""`config check` makes every check `run` makes before it connects, and both say the same one
line naming the config file, the key and what is wrong with what it names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import main as cli
from agent.core.errors import ConfigError
from agent.service.healthhttp import parse_listen

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\nrole = "worker"\ndevice_id = "pi-0001"\ndata_dir = "{tmp_path / "data"}"\n{extra}')
    return path


def secret(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "mqtt.password"
    path.write_text("s3cret\n")
    path.chmod(mode)
    return path


CASES = {
    "missing password file": (lambda t: f'[mqtt]\npassword_file = "{t}/none"\n',
                              "mqtt.password_file: {t}/none: file not found"),
    "readable password file": (lambda t: f'[mqtt]\npassword_file = "{secret(t, 0o644)}"\n',
                               "mqtt.password_file: {t}/mqtt.password: file has mode 0644"),
    "missing CA": (lambda t: f'[mqtt]\nurl = "mqtts://broker.example"\ntls_ca = "{t}/ca.crt"\n',
                   "mqtt.tls_ca: {t}/ca.crt: cannot load CA file"),
    "enrolment without mqtts": (lambda t: '[mqtt]\nurl = "mqtts://b.example"\n[identity]\nclaim_url = "mqtt://b.example"'
                                          '\nclaim_username = "claim"\n',
                                "identity.claim_url: the broker's enrolment listener, mqtts://host:port, is needed"),
    "readable claim password": (lambda t: f'[mqtt]\nurl = "mqtts://b.example"\n[identity]\nclaim_url = "mqtts://b.example"'
                                          f'\nclaim_username = "claim"\nclaim_password_file = "{secret(t, 0o644)}"\n',
                                "identity.claim_password_file: {t}/mqtt.password: file has mode 0644"),
    "a device certificate by hand and by enrolment": (
        lambda t: '[mqtt]\nurl = "mqtts://b.example"\ntls_cert = "/x.crt"\n[identity]\nclaim_url = "mqtts://b.example"'
                  '\nclaim_username = "claim"\n',
        "mqtt.tls_cert: [identity] keeps the device's own key and certificate: leave it out"),
    "URL without host": (lambda t: '[mqtt]\nurl = "mqtt://:1883"\n', "mqtt.url: expected mqtt://host[:port]"),
    "listen port": (lambda t: '[metrics]\nlisten = "127.0.0.1:99999"\n', "metrics.listen: port 99999 is not 0-65535"),
    "listen host": (lambda t: '[metrics]\nlisten = "gateway:9100"\n',
                    "metrics.listen: 'gateway' is not a loopback address"),
    "listen remote": (lambda t: '[metrics]\nlisten = "0.0.0.0:9100"\n',
                      "metrics.listen: '0.0.0.0' is not a loopback address"),
    "public key": (lambda t: f'[firmware]\npublic_key = "{secret(t, 0o600)}"\n',
                   "firmware.public_key: {t}/mqtt.password: not a PEM public key"),
    "reboot command": (lambda t: '[firmware]\nreboot_command = ["no-such-reboot-tool", "now"]\n',
                       "firmware.reboot_command: 'no-such-reboot-tool' is not an executable on PATH"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_check_and_run_refuse_alike_naming_file_and_key(tmp_path: Path, case: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    body, expected = CASES[case]
    path = write(tmp_path, body(tmp_path))
    line = f"{path}: {expected.format(t=tmp_path)}"
    assert cli(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"edge-agent config: {line}") and "\n" not in err
    run = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--config", str(path)], capture_output=True,
                         text=True, cwd=str(REPO), timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().startswith(f"edge-agent run: {line}") and "\n" not in run.stderr.strip()
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_a_good_config_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, f'[mqtt]\npassword_file = "{secret(tmp_path, 0o600)}"\n[metrics]\nlisten = "[::1]:9100"\n')
    assert cli(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"{path}: ok (worker 'pi-0001', fleet 'default')"


@pytest.mark.parametrize(("listen", "ok"), [("127.0.0.1:9100", True), ("localhost:1", True), ("[::1]:9100", True),
                                            ("0.0.0.0:65535", True), ("9100", False), (":9100", False),
                                            ("127.0.0.1:0", False), ("127.0.0.1:http", False)])
def test_console_listen_addresses(listen: str, ok: bool) -> None:
    """The console's --listen: any host, a real port."""
    try:
        parse_listen(listen, allow_remote=True, min_port=1, key="--listen")
    except ConfigError:
        assert not ok
    else:
        assert ok


def test_metrics_listen_is_checked_as_the_health_endpoint_checks_it(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Port 0 (any free port) is what the endpoint accepts, so config check and run accept it."""
    path = write(tmp_path, '[metrics]\nlisten = "127.0.0.1:0"\n')
    assert cli(["config", "check", str(path)]) == 0
    capsys.readouterr()


@pytest.mark.skipif(os.geteuid() != 0, reason="checks the folders as another user")
def test_a_config_target_needs_its_own_folder_writable_not_its_parent(open_dir: Path) -> None:
    """A sandboxed agent holds /etc/app through `ReadWritePaths=/etc/app`: /etc stays read-only to
    it, and a release is staged in the agent's own state, so the parent's mode is not its
    business (a missing folder needs it, to be made)."""
    from otheruser import NOBODY, as_user

    from agent.commands.preflight import preflight
    from rollout_engine.keys import generate_keypair

    etc = open_dir / "etc"  # root's, 0755: like /etc
    etc.mkdir(mode=0o755)
    app = etc / "app"
    app.mkdir()
    os.chown(app, NOBODY, NOBODY)  # the agent's own
    key = generate_keypair(open_dir / "keys").public
    for made in (open_dir / "keys", key):
        made.chmod(0o755 if made.is_dir() else 0o644)

    def config(name: str, folder: Path) -> Path:
        path = open_dir / f"{name}.toml"
        path.write_text(f'[agent]\nrole = "worker"\ndevice_id = "pi-0001"\ndata_dir = "{open_dir / "data"}"\n'
                        f'[firmware]\npublic_key = "{key}"\n[config_targets.{name}]\ndirectory = "{folder}"\n')
        path.chmod(0o644)
        return path

    def check(path: Path) -> bytes:
        try:
            preflight(path)
        except ConfigError as exc:
            return str(exc).encode()
        return b"ok"

    holds, makes = config("app", app), config("other", etc / "other")
    assert check(holds) == b"ok"  # as root (and every module it needs imported before the child starts)
    assert as_user(NOBODY, lambda: check(holds)) == b"ok"
    assert as_user(NOBODY, lambda: check(makes)) == (
        f"{makes}: config_targets.other.directory: {etc / 'other'}: the agent cannot write there (to make the "
        "folder)").encode()
