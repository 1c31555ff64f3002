"""`simulate --enrol`: every device enrols at its first boot through the worker's stages before
its assembly (`agent.app.prepare`), with the leaders' real identity part, before it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from postgres import PostgresCluster

from agent.core.errors import ConfigError
from agent.identity.certificates import read_certificate
from agent.sim import SimOptions, Simulation


def _certificates(workdir: Path) -> dict[str, x509.Certificate]:
    """Each device's stored certificate, by the device its subject names."""
    found: dict[str, x509.Certificate] = {}
    for path in sorted(workdir.glob("**/identity/device.crt")):
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        found[read_certificate(path.read_bytes()).subject] = cert
    return found


def _authorities(workdir: Path) -> list[x509.Certificate]:
    return [x509.load_pem_x509_certificate(path.read_bytes()) for path in sorted(workdir.glob("**/identity/ca.crt"))]


async def test_every_device_enrols_at_its_first_boot_then_runs(tmp_path: Path) -> None:
    opts = SimOptions(devices=12, duration_s=240.0, seed=3, heartbeat_s=30.0, telemetry_s=20.0, progress=False,
                      enrol=True, crash_rate=0.25, crash_downtime_s=20.0)
    report = await Simulation(opts, workdir=tmp_path).run()
    assert report["enrolment"]["enrolled"] == report["enrolment"]["devices"] == 12
    assert report["enrolment"]["not_enrolled"] == 0
    assert report["lost"] == 0 and report["conservation_ok"] is True
    assert report["leader"]["devices_known"] == 12 and report["heartbeats"]["stale_devices"] == 0
    certificates = _certificates(tmp_path)
    assert sorted(certificates) == [f"dev-{i:05d}" for i in range(12)]  # each its own, from the fleet's CA
    (authority,) = _authorities(tmp_path)
    for cert in certificates.values():
        cert.verify_directly_issued_by(authority)
    # a crashed device restarts on the certificate it has: nothing enrols twice
    assert report["devices"]["crashed_and_restarted"] > 0


async def test_two_leaders_on_postgresql_enrol_the_fleet_with_one_authority(
        tmp_path: Path, postgres_shared: PostgresCluster) -> None:
    opts = SimOptions(devices=10, duration_s=180.0, seed=4, heartbeat_s=30.0, telemetry_s=0.0, progress=False,
                      enrol=True, leaders=2, database=postgres_shared.url())
    report = await Simulation(opts, workdir=tmp_path).run()
    assert report["enrolment"]["enrolled"] == 10 and report["lost"] == 0
    certificates = _certificates(tmp_path)
    assert len(certificates) == 10
    authorities = _authorities(tmp_path)  # each leader's copy of the fleet's one CA
    assert len(authorities) == 2 and authorities[0] == authorities[1]
    for cert in certificates.values():  # whichever leader signed it
        cert.verify_directly_issued_by(authorities[0])


def test_enrolment_needs_the_in_memory_broker_in_one_process() -> None:
    with pytest.raises(ConfigError, match="enrol"):
        SimOptions(devices=4, enrol=True, broker_url="mqtt://127.0.0.1:1883")
