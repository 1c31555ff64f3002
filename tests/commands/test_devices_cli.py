"""`edge-agent devices` on a leader's config: one line for a user mistake, a batch token printed
once and kept as a hash, the allow-list, and a decision the leader has not applied yet."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import main as cli
from agent.core.clock import SystemClock
from agent.leader.identities import IdentityStore, token_digest
from agent.leader.registry import DeviceRegistry


def leader_config(tmp_path: Path, identity: bool = True) -> Path:
    path = tmp_path / "leader.toml"
    path.write_text(f'[agent]\nrole = "leader"\ndevice_id = "gw"\ndata_dir = "{tmp_path}"\n'
                    + ('[identity]\nclaims = ["claim"]\n' if identity else ""))
    DeviceRegistry.open(tmp_path / "leader.db", clock=SystemClock()).close()
    IdentityStore.open(tmp_path / "leader.db").close()
    return path


def test_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    worker = tmp_path / "worker.toml"
    worker.write_text('[agent]\ndevice_id = "pi"\n')
    assert cli(["devices", "pending", "--config", str(worker)]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"edge-agent devices: {worker}: agent.role: devices works on a leader's config"
    off = leader_config(tmp_path, identity=False)
    assert cli(["devices", "pending", "--config", str(off)]) == 2
    assert "identity: this leader has no [identity] section" in capsys.readouterr().err
    on = leader_config(tmp_path)
    assert cli(["devices", "token", "--config", str(on), "--uses", "0"]) == 2
    assert "--uses: a token enrols at least one device" in capsys.readouterr().err
    assert cli(["devices", "token", "--config", str(on), "--uses", "3", "--expires", "soon"]) == 2
    assert "--expires: not a duration: 'soon'" in capsys.readouterr().err


def test_a_token_is_printed_once_and_kept_as_a_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = leader_config(tmp_path)
    assert cli(["devices", "token", "--config", str(conf), "--uses", "50", "--expires", "7d"]) == 0
    out = capsys.readouterr()
    token = out.out.strip()
    assert len(token) >= 32 and "enrols 50 device(s)" in out.err
    with IdentityStore.open(tmp_path / "leader.db") as store:
        stored = [row[0] for row in store._conn.execute("SELECT digest FROM enrol_tokens")]
        assert stored == [token_digest(token)] and token not in stored
        assert store.take_token(token, SystemClock().now_ms()) and not store.take_token("guess", 0)
    assert cli(["devices", "allow", "--config", str(conf), "1000cafe", "1000cafe", "2000beef"]) == 0
    assert "2 serial number(s) added" in capsys.readouterr().out


def test_a_decision_the_leader_has_not_applied_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = leader_config(tmp_path)
    assert cli(["devices", "approve", "--config", str(conf), "pi-1", "--wait", "0.3"]) == 3
    assert "the leader is not running; it applies it when it starts" in capsys.readouterr().err
    with IdentityStore.open_readonly(tmp_path / "leader.db") as store:
        assert [(c.action, c.device, c.applied_ms) for c in store.controls()] == [("approve", "pi-1", None)]
    assert cli(["devices", "list", "--config", str(conf)]) == 0
    assert "no enrolments" in capsys.readouterr().out


def test_certs_for_the_broker_and_the_operators_and_doctor_on_reserved_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The broker's key for the group mosquitto (as root); a client certificate only for a name of
    [leader] operators; doctor names a device certificate of a reserved name on record."""
    import grp
    import os

    from agent.identity.certificates import read_certificate

    conf = leader_config(tmp_path)
    conf.write_text(conf.read_text() + '[leader]\noperators = ["ops-1"]\n')
    out = tmp_path / "certs"
    assert cli(["devices", "certs", "--config", str(conf), "--out", str(out), "--server-host", "127.0.0.1",
                "--client", "ops-1"]) == 0
    assert read_certificate((out / "ops-1.crt").read_bytes()).subject == "ops-1"
    said = capsys.readouterr().out
    if os.geteuid() == 0 and "mosquitto" in {g.gr_name for g in grp.getgrall()}:
        st = (out / "server.key").stat()
        assert (st.st_mode & 0o777, st.st_gid) == (0o640, grp.getgrnam("mosquitto").gr_gid)
        assert "0640 root:mosquitto" in said
    assert cli(["devices", "certs", "--config", str(conf), "--out", str(out), "--server-host", "127.0.0.1",
                "--client", "pi-1"]) == 2
    assert "--client: 'pi-1' is not one of [leader] operators" in capsys.readouterr().err
    with IdentityStore.open(tmp_path / "leader.db") as store:  # made before the name was an operator's
        store.record_request(device="ops-1", fingerprint="f", csr="", hw_serial="", machine_id="", agent_version="",
                             claim="claim", now_ms=1)
        store.issued("ops-1", cert="", serial=1, not_after_ms=10**13, by="op", now_ms=1)
    cli(["doctor", "--config", str(conf), "--skip", "broker"])
    doctor = capsys.readouterr().out
    assert "✗ identity" in doctor
    assert "ops-1 (the name 'ops-1' is reserved: it is an operator, never a device)" in doctor
    assert "fix: revoke it at once: edge-agent devices revoke ops-1" in doctor


def test_status_says_when_a_device_certificate_holds_a_reserved_name(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    leader_config(tmp_path)
    db = tmp_path / "leader.db"
    assert cli(["status", "--db", str(db)]) == 0
    assert "RESERVED" not in capsys.readouterr().out
    with IdentityStore.open(db) as store:  # a name of the broker's client ids, issued before that was refused
        store.record_request(device="ea-t-leader-gw", fingerprint="f", csr="", hw_serial="", machine_id="",
                             agent_version="", claim="claim", now_ms=1)
        store.issued("ea-t-leader-gw", cert="", serial=1, not_after_ms=10**13, by="op", now_ms=1)
    assert cli(["status", "--db", str(db)]) == 0
    assert capsys.readouterr().out.startswith("RESERVED: a device certificate is on record for a name no device may"
                                              " hold: ea-t-leader-gw")


def test_status_takes_the_leaders_config_as_the_devices_commands_do(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    conf = leader_config(tmp_path)
    assert cli(["status", "--config", str(conf)]) == 0
    assert capsys.readouterr().out.startswith("fleet: 0 devices")
    worker = tmp_path / "worker.toml"
    worker.write_text('[agent]\ndevice_id = "pi"\n')
    assert cli(["status", "--config", str(worker)]) == 2
    assert capsys.readouterr().err.strip() == (f"edge-agent status: {worker}: agent.role: status reads a leader's"
                                               " database: give a leader's config")
