"""What device identities cost: the leader's work per enrolment and per renewal, the device's
per key and request, and the trust document's check per artifact; each against a baseline in the
same run.

    python scripts/bench_identity.py [--devices N]

- enrol: N enrolment requests through the leader's own path (decode, check the certificate
  request's signature, subject and key, record it pending, approve: sign the certificate and
  store it), per device, against the baseline of recording the same rows without any
  certificate work (what a password-file fleet costs the leader: nothing but the row).
- renew: N renewals (check the request against the key on record, sign, store).
- device: making the P-256 key and its certificate request, once each (median of N).
- trust: checking an artifact's manifest signature through a trust document (the key looked up
  by id, its expiry checked) against checking it with the one pinned key.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def per_item_us(started: float, count: int) -> float:
    return round((time.perf_counter() - started) / count * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=300)
    args = parser.parse_args()
    n = args.devices

    import msgspec

    from agent.core.codec import decode
    from agent.identity.authority import FleetAuthority, new_authority
    from agent.identity.certificates import read_certificate, read_request
    from agent.identity.device_key import certificate_request, device_key_fingerprint, new_device_key
    from agent.identity.messages import EnrolRequest
    from agent.leader.identities import IdentityStore
    from firmware_rollout.artifact.manifest import Manifest, make_signed_manifest, verify_signed_manifest
    from rollout_engine.keys import SigningKey
    from rollout_engine.trust import TrustedKeys, make_trust_document

    now = int(time.time() * 1000)
    keys_made, requests_made = [], []
    devices = []
    for i in range(n):
        t0 = time.perf_counter()
        key = new_device_key()
        keys_made.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        csr = certificate_request(key, f"pi-{i:05d}").decode()
        requests_made.append(time.perf_counter() - t0)
        devices.append((f"pi-{i:05d}", key, msgspec.msgpack.encode(EnrolRequest(device=f"pi-{i:05d}", csr=csr))))
    ca = FleetAuthority(*new_authority("bench", now_ms=now))
    result: dict[str, object] = {"devices": n,
                                 "device_key_ms": round(statistics.median(keys_made) * 1000, 2),
                                 "device_request_ms": round(statistics.median(requests_made) * 1000, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        with IdentityStore.open(Path(tmp) / "baseline.db") as store:
            t0 = time.perf_counter()
            for device, _, _ in devices:
                store.record_request(device=device, fingerprint=device, csr="", hw_serial="", machine_id="",
                                     agent_version="", claim="claim", now_ms=now)
                store.issued(device, cert="", serial=int.from_bytes(device.encode()[-8:], "big"), not_after_ms=now,
                             by="op", now_ms=now)
            result["baseline_rows_only_us"] = per_item_us(t0, n)
        with IdentityStore.open(Path(tmp) / "leader.db") as store:
            t0 = time.perf_counter()
            for device, _, wire in devices:
                request = decode(wire, EnrolRequest)
                checked = read_request(request.csr, device_id=device)
                store.record_request(device=device, fingerprint=checked.fingerprint, csr=request.csr, hw_serial="",
                                     machine_id="", agent_version="", claim="claim", now_ms=now)
                cert = ca.issue_device(checked, now_ms=now, days=365)
                info = read_certificate(cert)
                store.issued(device, cert=cert.decode(), serial=info.serial, not_after_ms=info.not_after_ms, by="op",
                             now_ms=now)
            result["enrol_us"] = per_item_us(t0, n)
            t0 = time.perf_counter()
            for device, key, _ in devices:
                checked = read_request(certificate_request(key, device), device_id=device)
                record = store.get(device)
                assert record is not None and record.fingerprint == device_key_fingerprint(key)
                cert = ca.issue_device(checked, now_ms=now, days=365)
                info = read_certificate(cert)
                store.issued(device, cert=cert.decode(), serial=info.serial, not_after_ms=info.not_after_ms, by="op",
                             now_ms=now)
            result["renew_us"] = per_item_us(t0, n)
    result["enrol_vs_baseline"] = round(float(result["enrol_us"]) / float(result["baseline_rows_only_us"]), 1)
    result["enrolments_per_s"] = round(1e6 / float(result["enrol_us"]))

    root, signer = SigningKey.generate(), SigningKey.generate()
    others = [SigningKey.generate() for _ in range(7)]
    trusted = TrustedKeys([root.public], now_ms=lambda: now)
    trusted.accept(make_trust_document(version=1, roots=[root.public], issued_ms=now, signers=[root],
                                       keys=[(k.public, now + 86_400_000) for k in [*others, signer]]))
    manifest = make_signed_manifest(Manifest(name="fw", version="1.2.0", size=4096, sha256=bytes(32),
                                             chunk_size=4096, chunks=(bytes(32),)), signer).raw
    rounds = 2000
    t0 = time.perf_counter()
    for _ in range(rounds):
        verify_signed_manifest(manifest, signer.public)
    result["baseline_pinned_key_verify_us"] = per_item_us(t0, rounds)
    t0 = time.perf_counter()
    for _ in range(rounds):
        verify_signed_manifest(manifest, trusted)
    result["trust_document_verify_us"] = per_item_us(t0, rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
