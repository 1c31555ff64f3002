"""A hostile leader (or whoever writes a device's down topic) against a real worker process on a
real mosquitto: the trust documents and config releases it offers. The device pins only the
fleet's root; each forgery is refused with its reason in the device's report, and nothing
changes: not the target's document, not the trust document it holds. The device goes on working.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import paho.mqtt.client as paho
import pytest

from agent.core.codec import Envelope, decode, encode
from agent.transport import topics
from config_rollout.layers import LayerValue
from config_rollout.messages import KIND_CONFIG_OFFER, ConfigOffer
from config_rollout.release import build_release
from rollout_engine.keys import SigningKey
from rollout_engine.messages import KIND_ROLLOUT_REPORT, RolloutReport
from rollout_engine.trust import STATE_FILE, make_trust_document
from tests.e2e.agent_support import FLEET, kill, run_agent, wait_for, write_config
from tests.mosquitto import Mosquitto

pytestmark = [pytest.mark.mqtt, pytest.mark.timeout(300)]

DEVICE = "pi-1"
ROOT, NEW_ROOT, STRANGER, K1, K2 = (SigningKey.generate() for _ in range(5))
YEAR_MS = 365 * 86_400_000
FIRST = b"port = 1\n"


class HostileLeader:
    """A client that writes the device's down topic and reads its reports on its up topic."""

    def __init__(self, port: int) -> None:
        self.reports: dict[str, list[RolloutReport]] = {}
        self.heard = 0  # envelopes of any kind from the device
        self._lock = threading.Lock()
        client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="ea-hostile", protocol=paho.MQTTv5)
        client.on_message = self._on_message
        client.connect("127.0.0.1", port)
        client.subscribe(topics.up(FLEET, DEVICE), qos=1)
        client.loop_start()
        self.client = client

    def _on_message(self, _: paho.Client, __: Any, message: paho.MQTTMessage) -> None:
        try:
            envelope = decode(message.payload, Envelope)
        except Exception:
            return
        with self._lock:
            self.heard += 1
            if envelope.kind == KIND_ROLLOUT_REPORT:
                report = decode(envelope.payload, RolloutReport)
                self.reports.setdefault(report.rollout_id, []).append(report)

    def offer(self, rollout_id: str, release: bytes, **fields: Any) -> None:
        offer = ConfigOffer(rollout_id=rollout_id, release=release, **fields)
        envelope = Envelope(id=f"offer-{rollout_id}", kind=KIND_CONFIG_OFFER, sender="gw", receiver=DEVICE,
                            ts_ms=int(time.time() * 1000), payload=msgspec.msgpack.encode(offer))
        self.client.publish(topics.down(FLEET, DEVICE), encode(envelope), qos=1).wait_for_publish(10)

    def outcome(self, rollout_id: str) -> RolloutReport:
        """The device's final word on the offer: rejected or failed."""
        def final() -> RolloutReport | None:
            with self._lock:
                return next((r for r in self.reports.get(rollout_id, ()) if r.state in ("rejected", "failed")), None)
        return wait_for(final, f"the device's report on {rollout_id}")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def trust(version: int, *keys: tuple[SigningKey, int], roots: tuple[SigningKey, ...] = (ROOT,),
          signers: tuple[SigningKey, ...] = (ROOT,)) -> bytes:
    return make_trust_document(version=version, roots=[r.public for r in roots],
                               keys=[(k.public, expires) for k, expires in keys], signers=list(signers),
                               issued_ms=int(time.time() * 1000))


def release(tmp: Path, name: str, version: str, key: SigningKey, text: bytes = b"port = 2\n") -> bytes:
    src = tmp / f"src-{name}-{version}"
    src.mkdir()
    (src / "app.toml").write_bytes(text)
    return build_release(name, version, [src / "app.toml"], key, created_ms=1)


@pytest.fixture
def device(tmp_path: Path, mosquitto: Mosquitto) -> Iterator[tuple[Path, Path, HostileLeader]]:
    etc = tmp_path / "etc" / "app"
    etc.mkdir(parents=True)
    (etc / "app.toml").write_bytes(FIRST)
    (tmp_path / "root.pem").write_bytes(ROOT.public.to_pem())
    conf = write_config(tmp_path / "pi-1.toml", "worker", DEVICE, agent={"data_dir": str(tmp_path / DEVICE)},
                        mqtt={"url": f"mqtt://127.0.0.1:{mosquitto.port}"},
                        local_api={"socket": str(tmp_path / "api.sock")},
                        firmware={"trust_root": str(tmp_path / "root.pem")},
                        config_targets={"app": {"directory": str(etc), "max_document_kib": 4, "settle_s": 0,
                                                "confirm_s": 5}})
    hostile = HostileLeader(mosquitto.port)
    worker = run_agent(conf, tmp_path / "pi-1.log")
    try:
        wait_for(lambda: hostile.heard, "the device's first message")
        yield etc / "app.toml", tmp_path / DEVICE / "trust" / STATE_FILE, hostile
        assert "Traceback" not in (tmp_path / "pi-1.log").read_text()
    finally:
        kill(worker, signal.SIGTERM)
        hostile.close()


def held_version(state: Path) -> int:
    """The version of the trust document the device keeps (`TrustedKeys` state: the document as text)."""
    return int(json.loads(json.loads(state.read_bytes())["document"])["body"]["version"]) if state.exists() else 0


def test_forged_trust_documents_and_releases_are_refused_and_change_nothing(
        tmp_path: Path, device: tuple[Path, Path, HostileLeader]) -> None:
    document, state, hostile = device
    now = int(time.time() * 1000)
    # a genuine document rides on an offer whose release is for a target this device has not
    hostile.offer("r0", release(tmp_path, "other", "1.0.0", K1), trust=trust(2, (K1, now + YEAR_MS)))
    assert "this device has no [config_targets.other]" in hostile.outcome("r0").detail
    assert held_version(state) == 2
    held = state.read_bytes()
    good = release(tmp_path, "app", "1.1.0", K1)
    flipped = bytearray(trust(3, (K1, now + YEAR_MS), (K2, now + YEAR_MS)))
    flipped[-10] ^= 1
    attacks: list[tuple[str, dict[str, Any], str]] = [
        ("a lower version", {"release": good, "trust": trust(1, (K1, now + YEAR_MS))},
         "trust document v1 is not newer than the one held (v2)"),
        ("a bad signature", {"release": good, "trust": bytes(flipped)}, "v3: not signed by a trusted root"),
        ("a stranger root", {"release": good, "trust": trust(3, (K2, now + YEAR_MS), signers=(STRANGER,))},
         "not signed by a trusted root"),
        ("only a new root's signature", {"release": good, "trust": trust(3, (K2, now + YEAR_MS), roots=(NEW_ROOT,),
                                                                         signers=(NEW_ROOT,))},
         "v3: not signed by a trusted root"),
        ("a release by a key the document does not list", {"release": release(tmp_path, "app", "1.2.0", K2)},
         "which trust document v2 does not list"),
        ("a tampered release", {"release": good[:-3] + bytes([good[-3] ^ 1]) + good[-2:]},
         "its sha256 differs from the signed manifest"),
        ("an oversized document", {"release": release(tmp_path, "app", "1.3.0", K1, b"x = '" + b"y" * 8192 + b"'\n")},
         "over 4 KiB"),
        ("a layer adding a key the release does not define",
         {"release": good, "layers": (LayerValue(document="app.toml", key="apply_command", value='"sh -c reboot"'),)},
         "defines no key apply_command: a layer may set only a key the release defines"),
    ]
    for n, (what, fields, why) in enumerate(attacks, start=1):
        hostile.offer(f"r{n}", **fields)
        report = hostile.outcome(f"r{n}")
        assert why in report.detail, (what, report.detail)
        assert document.read_bytes() == FIRST, what
        assert state.read_bytes() == held, what
    # a genuine newer document whose key has expired: taken, and the release signed by it refused
    hostile.offer("r-expired", release(tmp_path, "app", "1.4.0", K2),
                  trust=trust(4, (K1, now + YEAR_MS), (K2, now - 60_000)))
    assert "expired" in hostile.outcome("r-expired").detail
    assert document.read_bytes() == FIRST and held_version(state) == 4
    heard = hostile.heard
    wait_for(lambda: hostile.heard > heard, "the device still sends")
