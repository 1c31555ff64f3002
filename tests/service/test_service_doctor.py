"""`edge-agent doctor` against the shipped broker config (TLS, passwords, ACL) on a real
mosquitto, with a real leader: every check passes for a device set up right, and each mistake is
one ✗ line naming the check and the fix, exit 1. It changes nothing: a running agent is read
from its /healthz, never connected over."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from svc_broker import ExampleBroker, Pki, make_pki

from agent.cli import main as cli
from agent.core.clock import SystemClock
from agent.service.instance import running_pid

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.agent_support import REPO, leader, stop_all
from mosquitto import free_port

pytestmark = pytest.mark.mqtt

USERS = {"gateway-01": "leader-secret", "pi-0001": "one-secret"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), client_cn="pi-0001")


@pytest.fixture
def broker(tmp_path: Path, pki: Pki):
    with ExampleBroker(tmp_path / "broker", pki, USERS) as running:
        yield running


def worker_config(tmp_path: Path, broker: ExampleBroker, pki: Pki, *, password: str = "one-secret",
                  metrics: str = "", ca: Path | None = None, device: str = "pi-0001") -> Path:
    secret = tmp_path / "pi-0001.password"
    secret.write_text(password + "\n")
    secret.chmod(0o600)
    path = tmp_path / "worker.toml"
    path.write_text(f"""[agent]
role = "worker"
device_id = "{device}"
fleet = "default"
data_dir = "{tmp_path / 'data'}"
[mqtt]
url = "mqtts://localhost:{broker.port}"
username = "pi-0001"
password_file = "{secret}"
tls_ca = "{ca or pki.ca_cert}"
reconnect_min_s = 0.1
reconnect_max_s = 0.5
[metrics]
listen = "{metrics}"
[local_api]
group = "{grp.getgrgid(os.getgid()).gr_name}"
""")
    return path


def doctor(capsys: pytest.CaptureFixture[str], config: Path, *extra: str) -> tuple[int, dict[str, dict[str, object]]]:
    code = cli(["doctor", "--config", str(config), "--skip", "clock", "--json", *extra])
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    return code, checks


async def gateway(tmp_path: Path, broker: ExampleBroker, pki: Pki):
    secret = tmp_path / "gw.password"
    secret.write_text("leader-secret\n")
    secret.chmod(0o600)
    return await leader(SystemClock(), tmp_path, name="gateway-01", url=f"mqtts://localhost:{broker.port}",
                        agent={"fleet": "default"},
                        mqtt={"username": "gateway-01", "password_file": str(secret), "tls_ca": str(pki.ca_cert)})


async def test_a_device_set_up_right_passes_every_check(broker: ExampleBroker, pki: Pki, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    gw = await gateway(tmp_path, broker, pki)
    try:
        await asyncio.wait_for(gw.transport.connected.wait_open(), 30)
        code, checks = await asyncio.to_thread(doctor, capsys, worker_config(tmp_path, broker, pki))
        assert code == 0, [c for c in checks.values() if c["ok"] is not True]
        assert [name for name, c in checks.items() if c["ok"] is True] == [
            "config", "broker", "tls", "credentials", "mqtt v5", "acl", "leader", "housekeeping"]
        assert str(checks["tls"]["text"]).startswith("TLSv1.")
        assert checks["credentials"]["text"] == "accepted by the broker as pi-0001"
        assert str(checks["leader"]["text"]).startswith("answered accepted in ")
        assert not (tmp_path / "data").exists()  # nothing created
    finally:
        await stop_all(gw)


async def test_no_leader_and_wrong_credentials_are_named_with_the_fix(
        broker: ExampleBroker, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = await asyncio.to_thread(doctor, capsys, worker_config(tmp_path, broker, pki), "--timeout", "2")
    assert code == 1 and checks["leader"]["ok"] is False and checks["acl"]["ok"] is True
    assert "is the leader running" in str(checks["leader"]["fix"])
    code, checks = await asyncio.to_thread(doctor, capsys, worker_config(tmp_path, broker, pki, password="wrong"))
    assert code == 1 and checks["credentials"]["ok"] is False
    assert "refused our credentials" in str(checks["credentials"]["text"])
    assert "mqtt.password_file" in str(checks["credentials"]["fix"])
    assert "acl" not in checks
    code, checks = await asyncio.to_thread(doctor, capsys, worker_config(tmp_path, broker, pki, device="pi-0002"))
    assert code == 1 and checks["acl"]["ok"] is False and "(PUBACK reason 0x87)" in str(checks["acl"]["text"])
    assert "'pi-0001' and agent.device_id 'pi-0002' must be the same" in str(checks["acl"]["fix"])
    code, checks = await asyncio.to_thread(doctor, capsys, worker_config(tmp_path, broker, pki, ca=pki.rogue_ca_cert))
    assert code == 1 and checks["tls"]["ok"] is False and "mqtt.tls_ca" in str(checks["tls"]["fix"])


def test_a_stopped_broker_fails_the_broker_check(broker: ExampleBroker, pki: Pki, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = worker_config(tmp_path, broker, pki)
    broker.stop()
    assert cli(["doctor", "--config", str(config), "--skip", "clock"]) == 1
    out = capsys.readouterr().out
    broker_line = next(line for line in out.splitlines() if " broker " in line)
    assert broker_line.startswith("✗ broker") and f"cannot reach localhost:{broker.port}" in broker_line
    assert "fix: check mqtt.url, that the broker runs" in out
    assert "credentials" not in out


def test_a_bad_config_is_the_one_failing_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[agent]\nrole = "worker"\ndevice_id = "pi"\n[mailbox]\ncapacity = 0\n')
    assert cli(["doctor", "--config", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("✗ config") and "mailbox.capacity" in out[0] and len(out) == 2


def test_a_running_agent_is_read_from_its_health_endpoint_not_connected_over(
        broker: ExampleBroker, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    config = worker_config(tmp_path, broker, pki, metrics=f"127.0.0.1:{port}")
    child = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(REPO),
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while running_pid(tmp_path / "data") is None:  # the agent holds its data directory
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        while True:  # until the agent says it is connected
            code, checks = doctor(capsys, config, "--skip", "leader")
            if checks.get("credentials", {}).get("ok") is True or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert code == 0, [c for c in checks.values() if c["ok"] is not True]
        assert str(checks["agent"]["text"]).startswith(f"an agent runs on {tmp_path / 'data'} (pid {child.pid})")
        assert "the running agent reports its broker connection" in str(checks["credentials"]["text"])
        assert "acl" not in checks  # never connected over the running agent
    finally:
        child.terminate()
        child.wait(30)


def test_the_local_api_check_names_a_missing_group_and_finds_the_socket(
        broker: ExampleBroker, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = worker_config(tmp_path, broker, pki)
    config.write_text(config.read_text().replace(f'group = "{grp.getgrgid(os.getgid()).gr_name}"',
                                                 'group = "no-such-group-here"'))
    _, checks = doctor(capsys, config, "--skip", "leader")
    assert checks["local api"]["ok"] is False and "no group 'no-such-group-here'" in str(checks["local api"]["text"])
    assert "groupadd" in str(checks["local api"]["fix"])
    config = worker_config(tmp_path, broker, pki)
    _, checks = doctor(capsys, config, "--skip", "leader")
    assert checks["local api"]["ok"] is None and "not there" in str(checks["local api"]["text"])


def test_a_running_leader_whose_artifact_port_is_taken_leads_and_doctor_names_it(
        broker: ExampleBroker, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The leader starts all the same (no crash loop over a secondary server); /healthz and
    `doctor` say the artifact server cannot listen."""
    import socket

    secret = tmp_path / "gw.password"
    secret.write_text("leader-secret\n")
    secret.chmod(0o600)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    metrics = free_port()
    config = tmp_path / "leader.toml"
    config.write_text(f"""[agent]
role = "leader"
device_id = "gateway-01"
fleet = "default"
data_dir = "{tmp_path / 'gw'}"
[mqtt]
url = "mqtts://localhost:{broker.port}"
username = "gateway-01"
password_file = "{secret}"
tls_ca = "{pki.ca_cert}"
[metrics]
listen = "127.0.0.1:{metrics}"
[artifacts]
listen = "127.0.0.1:{taken.getsockname()[1]}"
""")
    log = tmp_path / "leader.log"
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
                                 stdout=out, stderr=out, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while True:  # until the running leader answers on /healthz
            assert child.poll() is None, log.read_text()
            code, checks = doctor(capsys, config, "--skip", "leader")
            if "artifact server" in checks or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert code == 1 and checks["artifact server"]["ok"] is False, checks
        assert "cannot listen on 127.0.0.1:" in str(checks["artifact server"]["text"])
        assert child.poll() is None  # it leads all the same
        assert "Traceback" not in log.read_text()
    finally:
        taken.close()
        child.terminate()
        child.wait(30)


def test_doctor_names_a_helper_socket_others_may_open(tmp_path: Path) -> None:
    """The install helper's socket belongs to its own group with the agent's user alone: doctor
    names the wrong group, or the other members of the right one."""
    import socket

    from agent.commands.doctor import _helper_door

    path = tmp_path / "installer.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        group = grp.getgrgid(path.stat().st_gid)
        assert _helper_door(path, "edge-agent-installer", "edge-agent") == (
            f"{path} belongs to group {group.gr_name!r}, not 'edge-agent-installer'")
        others = sorted(set(group.gr_mem) - {"edge-agent"})
        assert _helper_door(path, group.gr_name, "edge-agent") == (
            f"group {group.gr_name!r} also holds {', '.join(others)}: they may open the socket (the helper refuses "
            "them)" if others else "")
    assert _helper_door(tmp_path / "absent.sock", "edge-agent-installer", "edge-agent") == ""


def test_doctor_checks_a_leaders_postgresql_database(tmp_path: Path, pg_url: str) -> None:
    from agent.commands.doctor import _fleet_database
    from agent.core.clock import VirtualClock
    from agent.core.config import AgentConfig, convert
    from agent.leader.registry import DeviceRegistry
    from agent.protocol import Heartbeat

    def config(url: str) -> AgentConfig:
        return convert({"agent": {"role": "leader", "device_id": "gw-1", "fleet": "t"}, "leader": {"database": url}},
                       AgentConfig, source="test")

    first = _fleet_database(config(pg_url), tmp_path)
    assert first.ok is None and "the first leader to start makes them" in first.text
    with DeviceRegistry.open(pg_url, clock=VirtualClock()) as reg:
        reg.leader = "gw-1"
        reg.apply_heartbeat(Heartbeat(device_id="pi-1", seq=1, uptime_s=1.0))
    done = _fleet_database(config(pg_url), tmp_path)
    assert done.ok is True and "1 devices (served last by: gw-1 1)" in done.text
    gone = _fleet_database(config(f"postgresql://ea@127.0.0.1:{free_port()}/ea?connect_timeout=2"), tmp_path)
    assert gone.ok is False and "cannot connect" in gone.text and "PostgreSQL up" in gone.fix
