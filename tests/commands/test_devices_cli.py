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
