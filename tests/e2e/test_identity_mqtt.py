"""Device identity end to end, on real processes and a real mosquitto: mutual TLS with
`use_identity_as_username`, a `crlfile`, and the enrolment listener for the claim credential.

A new device makes its key, enrols, waits for `devices approve`, connects with its certificate
and sends; its short-lived certificate renews over its own channel and the agent goes on with
the new one; `devices revoke` refuses its messages at once (a forged replay too), rewrites the
CRL and has the broker reload it: the device cannot connect again.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import msgspec
import paho.mqtt.client as paho
import pytest

from agent.core.codec import Envelope, encode
from agent.identity.certificates import read_certificate
from agent.protocol import KIND_TELEMETRY, Telemetry
from tests.e2e.agent_support import FLEET, db_query, kill, run_agent, wait_for, write_config
from tests.identity_broker import IdentityBroker, can_connect, cli, fleet_files, openssl_verify

pytestmark = pytest.mark.timeout(300)

LEADER = "gw"
DEVICE = "dev-1"


def forge(port: int, envelope: Envelope) -> None:
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ea-forger", protocol=paho.MQTTv5)
    client.username_pw_set("forger", "forger-pw")
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.publish(f"ea/v1/{FLEET}/{DEVICE}/up", encode(envelope), qos=1).wait_for_publish(10)
    finally:
        client.loop_stop()
        client.disconnect()


def test_a_device_enrols_renews_and_is_revoked(tmp_path: Path) -> None:
    leader_dir, worker_dir = tmp_path / LEADER, tmp_path / DEVICE
    identity = {"claims": ["claim"], "cert_days": 0.0003, "clock_skew_s": 2}  # 26 s certificates: renewed at ~18 s
    leader_conf = tmp_path / "leader.toml"
    write_config(leader_conf, "leader", LEADER, agent={"data_dir": str(leader_dir)}, identity=identity)
    certs, passwd = fleet_files(tmp_path, leader_conf)
    (tmp_path / "claim-pw").write_text("claim-pw\n")
    (tmp_path / "claim-pw").chmod(0o600)  # a credentials file others can read is refused
    broker = IdentityBroker(tmp_path / "broker", certs, leader_dir / "identity" / "crl.pem", passwd,
                            leader=LEADER).start()
    leader = worker = None
    try:
        url = f"mqtts://127.0.0.1:{broker.port}"
        write_config(leader_conf, "leader", LEADER, agent={"data_dir": str(leader_dir)},
                     mqtt={"url": url, "tls_ca": str(certs / "ca.crt"), "tls_cert": str(certs / "leader.crt"),
                           "tls_key": str(certs / "leader.key")},
                     identity={**identity, "broker_reload": ["kill", "-HUP", str(broker.pid)]})
        leader = run_agent(leader_conf, tmp_path / "leader.log")
        worker_conf = write_config(
            tmp_path / "worker.toml", "worker", DEVICE, agent={"data_dir": str(worker_dir)},
            mqtt={"url": url, "tls_ca": str(certs / "ca.crt")}, local_api={"socket": str(tmp_path / "api.sock")},
            identity={"claim_url": f"mqtts://127.0.0.1:{broker.claim_port}", "claim_username": "claim",
                      "claim_password_file": str(tmp_path / "claim-pw"), "ask_interval_s": 2.0})
        worker = run_agent(worker_conf, tmp_path / "worker.log")

        # the device's own key, 0600; its request pending until an operator approves it
        key = worker_dir / "identity" / "device.key"
        wait_for(key.exists, "the device key")
        assert key.stat().st_mode & 0o777 == 0o600
        leader_db = leader_dir / "leader.db"
        wait_for(lambda: "dev-1" in cli("devices", "pending", "--config", str(leader_conf)).stdout, "pending")
        assert not (worker_dir / "identity" / "device.crt").exists()
        doctor = cli("doctor", "--config", str(worker_conf))
        assert "not enrolled yet" in doctor.stdout and "edge-agent devices approve dev-1" in doctor.stdout
        key_shown = cli("devices", "pending", "--config", str(leader_conf)).stdout.splitlines()[1].split()[2]
        assert f"key {key_shown}" in doctor.stdout and f"(key {key_shown})" in (tmp_path / "worker.log").read_text()
        approved = cli("devices", "approve", DEVICE, "--config", str(leader_conf))
        assert approved.returncode == 0, approved.stderr
        assert "approved dev-1" in approved.stdout

        # mutual TLS with its own certificate: its heartbeats and messages reach the leader
        cert = worker_dir / "identity" / "device.crt"
        first = read_certificate(wait_for(lambda: cert.exists() and cert.read_bytes(), "the certificate"))
        assert first.subject == DEVICE
        wait_for(lambda: db_query(leader_db, "SELECT 1 FROM devices WHERE device_id = ? AND hb_seq >= 0", (DEVICE,)),
                 "the device's first heartbeat")
        sent = cli("send", "telemetry", "--config", str(worker_conf), "--json", '{"t": 1}')
        assert sent.returncode == 0, sent.stderr
        doctor = cli("doctor", "--config", str(worker_conf))
        assert "certificate of dev-1" in doctor.stdout, doctor.stdout

        # renewed over its own channel before two thirds of its life, the agent goes on with it
        renewed = read_certificate(wait_for(lambda: read_certificate(cert.read_bytes()).serial != first.serial
                                            and cert.read_bytes(), "a renewed certificate", limit_s=60))
        assert renewed.not_after_ms > first.not_after_ms
        seq = db_query(leader_db, "SELECT hb_seq FROM devices WHERE device_id = ?", (DEVICE,))[0][0]
        wait_for(lambda: db_query(leader_db, "SELECT hb_seq FROM devices WHERE device_id = ? AND hb_seq > ?",
                                  (DEVICE, seq)), "a heartbeat on the renewed certificate")
        assert "renewed the certificate of dev-1" in (tmp_path / "worker.log").read_text()

        crl = leader_dir / "identity" / "crl.pem"
        assert openssl_verify(certs / "ca.crt", crl, cert).returncode == 0  # OpenSSL's own check of our CA and CRL

        # revoked: refused at once, the CRL rewritten and reloaded by the broker
        revoked = cli("devices", "revoke", DEVICE, "--config", str(leader_conf), "--reason", "stolen")
        assert revoked.returncode == 0, revoked.stderr
        assert "the broker reloaded it" in revoked.stdout
        now = int(time.time() * 1000)
        reading = Telemetry(device_id=DEVICE, seq=1, ts_ms=now, name="t", value=1.0)
        replay = Envelope(id="replayed-1", kind=KIND_TELEMETRY, sender=DEVICE, receiver="leader", ts_ms=now,
                          payload=msgspec.msgpack.encode(reading))
        forge(broker.forger_port, replay)
        wait_for(lambda: db_query(leader_db, "SELECT reason FROM rejects WHERE msg_id = 'replayed-1'"),
                 "the replay refused")
        assert db_query(leader_db, "SELECT reason FROM rejects WHERE msg_id = 'replayed-1'")[0][0] == \
            "device dev-1 is revoked"
        checked = openssl_verify(certs / "ca.crt", crl, cert)
        assert checked.returncode != 0 and "certificate revoked" in checked.stdout + checked.stderr
        assert kill(worker) == -signal.SIGKILL
        worker = None
        device_key, device_cert = key, cert
        assert not can_connect(broker.port, certs / "ca.crt", device_cert, device_key)
        assert can_connect(broker.port, certs / "ca.crt", certs / "leader.crt", certs / "leader.key")
        listed = cli("devices", "list", "--config", str(leader_conf), "--json")
        assert '"state": "revoked"' in listed.stdout
        # the device says so plainly: doctor, and the agent started again
        doctor = cli("doctor", "--config", str(worker_conf))
        assert "✗ identity" in doctor.stdout and "this device is revoked" in doctor.stdout, doctor.stdout
        again = tmp_path / "worker-again.log"
        worker = run_agent(worker_conf, again)
        wait_for(lambda: again.exists() and "this device is revoked" in again.read_text(), "the worker says so")
    finally:
        for proc in (worker, leader):
            if proc is not None:
                kill(proc, signal.SIGTERM)
        broker.stop()
