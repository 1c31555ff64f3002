"""The shipped configs/mosquitto/identity.conf and acl on a real mosquitto, with a test's ports
and files; and what the identity tests ask of it (a CLI call, a TLS probe, OpenSSL's check)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import paho.mqtt.client as paho

from tests.e2e.agent_support import FLEET, REPO
from tests.mosquitto import Mosquitto, free_port

SHIPPED = REPO / "configs" / "mosquitto"


class IdentityBroker(Mosquitto):
    """The shipped configs/mosquitto/identity.conf and acl, with the test's ports and files:
    mutual TLS for devices and the leader (the certificate's subject as username, the CRL
    checked), the enrolment listener for the claim credential; and a plain listener for the
    test's forger, who may write any up topic (a replay the broker lets through)."""

    def __init__(self, workdir: Path, certs: Path, crl: Path, passwd: Path, *, leader: str) -> None:
        super().__init__(workdir)
        self.claim_port = free_port()
        self.forger_port = free_port()
        self.certs, self.crl, self.passwd = certs, crl, passwd
        acl = (SHIPPED / "acl").read_text().replace("/default/", f"/{FLEET}/").replace("gateway-01", leader)
        (workdir / "acl").write_text(acl + "user forger\ntopic write ea/v1/#\n")

    def config_text(self) -> str:
        text = (SHIPPED / "identity.conf").read_text()
        for shipped, ours in (("/etc/mosquitto/certs/", f"{self.certs}/"),
                              ("/etc/mosquitto/edge-agent.passwd", str(self.passwd)),
                              ("/etc/mosquitto/edge-agent.acl", str(self.workdir / "acl")),
                              ("/var/lib/edge-agent-crl/crl.pem", str(self.crl)),
                              ("listener 8883", f"listener {self.port} 127.0.0.1"),
                              ("listener 8884", f"listener {self.claim_port} 127.0.0.1"),
                              ("persistence true", "persistence false"), ("log_dest syslog", "log_dest stderr")):
            assert shipped in text, shipped
            text = text.replace(shipped, ours)
        text += f"listener {self.forger_port} 127.0.0.1\n"
        return text + ("user root\n" if os.geteuid() == 0 else "")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, cwd=str(REPO),
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)


def can_connect(port: int, ca: Path, cert: Path, key: Path) -> bool:
    """A TLS MQTT connection with this certificate: does the broker take it?"""
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ea-probe", protocol=paho.MQTTv5)
    client.tls_set(ca_certs=str(ca), certfile=str(cert), keyfile=str(key), cert_reqs=ssl.CERT_REQUIRED)
    try:
        client.connect("127.0.0.1", port)
        for _ in range(40):
            client.loop(0.1)
            if client.is_connected():
                return True
    except (OSError, ssl.SSLError):
        return False
    finally:
        client.disconnect()
    return False


def openssl_verify(ca: Path, crl: Path, cert: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["openssl", "verify", "-crl_check", "-CAfile", str(ca), "-CRLfile", str(crl), str(cert)],
                          capture_output=True, text=True, timeout=30)


def fleet_files(tmp: Path, conf: Path) -> tuple[Path, Path]:
    """The broker's certificates from the leader's `devices certs` (`tmp/certs`) and a password
    file with the claim credential (`claim`/`claim-pw`) and the test's forger: (certs, passwd)."""
    certs, passwd = tmp / "certs", tmp / "passwd"
    made = cli("devices", "certs", "--config", str(conf), "--out", str(certs), "--server-host", "127.0.0.1")
    assert made.returncode == 0, made.stderr
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwd), "claim", "claim-pw"], check=True, capture_output=True)
    subprocess.run(["mosquitto_passwd", "-b", str(passwd), "forger", "forger-pw"], check=True, capture_output=True)
    return certs, passwd
