"""Releases as a rollout kind on the leader: each part admitted by its own kind from beside the
document (and refused when it is not the part the document signs), one offer per device carrying
each part's own offer, the firmware part's image served, and a device holding the release when
it runs every part of it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from test_release_document import release_folder

from agent.core.codec import decode
from agent.core.errors import RolloutError
from agent.leader.rollout_kinds import ROLLOUT_KINDS
from agent.protocol import ConfigState
from app_rollout.bundle import peek_head
from app_rollout.messages import AppOffer
from config_rollout.layers import LayerValue
from config_rollout.messages import ConfigOffer
from firmware_rollout.messages import UpdateOffer
from release_rollout.build import build_from_toml
from release_rollout.kind import RELEASE, release_image
from release_rollout.messages import KIND_RELEASE_OFFER, ReleaseOffer
from rollout_engine.keys import SigningKey, Verifier
from rollout_engine.kinds import OfferContext, RolloutKind
from rollout_engine.plan import DeviceInfo
from rollout_engine.spec import spec_from_dict
from rollout_engine.store import DeviceRow, RolloutRow

DESCRIBE = {kind: ROLLOUT_KINDS[kind].traits.describe for kind in ("firmware", "config", "app")}


@dataclasses.dataclass
class Host:
    keys: Verifier | None
    artifacts_dir: Path
    configs: dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]] = dataclasses.field(default_factory=dict)
    apps: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def config_states(self) -> dict[str, tuple[tuple[str, ...], dict[str, ConfigState]]]:
        return self.configs

    def device_tags(self) -> dict[str, tuple[str, ...]]:
        return {}

    def layer_values(self, target: str, devices: dict[str, tuple[str, ...]]) -> dict[str, tuple[LayerValue, ...]]:
        return {}

    def app_versions(self, name: str) -> dict[str, str]:
        return self.apps.get(name, {})


def release_kind(host: Host) -> RolloutKind:
    return ROLLOUT_KINDS["release"].make(host)


def built(tmp_path: Path) -> tuple[Path, SigningKey]:
    spec, key, _, _ = release_folder(tmp_path)
    document = spec.parent / "gateway-2.0.0.earel"
    document.write_bytes(build_from_toml(spec, key, DESCRIBE, created_ms=0))
    return document, key


def row(admitted_release: bytes, artifact: str) -> RolloutRow:
    spec = spec_from_dict({"rollout": {"name": "gateway", "kind": "release", "artifact": artifact},
                           "waves": {"canary": 1, "percents": [100.0]}})
    return RolloutRow(id="r2", seq=1, name="gateway", state="running", spec=spec, artifact=artifact, version="2.0.0",
                      signed_manifest=admitted_release, current_wave=0, wave_count=1, detail="", rollback_of="",
                      fail_base_finished=0, fail_base_failed=0, created_ms=0, updated_ms=0, finished_ms=None)


def device_row(device: str) -> DeviceRow:
    return DeviceRow(rollout_id="r2", device_id=device, wave=0, state="offered", detail="", attempts=0,
                     deadline_ms=None, next_try_ms=None, offers=0, last_offer_ms=None, report_seq=0, from_version="",
                     updated_ms=0)


def test_a_release_is_admitted_part_by_part_and_offered_whole_to_each_device(tmp_path: Path) -> None:
    document, key = built(tmp_path)
    host = Host(keys=key.public, artifacts_dir=tmp_path / "artifacts")
    kind = release_kind(host)
    admitted = kind.admit(str(document), undone=None)
    assert admitted.version == "2.0.0" and Path(admitted.artifact).parent == tmp_path / "artifacts"
    described = RELEASE.describe(document)
    assert described.installs == "release gateway 2.0.0"
    assert described.what == "release gateway: firmware 1.1.0, config app 1.1.0, app hello 2.0.0"
    r = row(admitted.release, admitted.artifact)
    image = release_image(r)
    assert image is not None and Path(image[0]).suffix == ".eafw" and Path(image[0]).is_file()  # its chunks served
    out = kind.offers(r, [device_row("pi-0"), device_row("pi-1")],
                      OfferContext(mirrors=("http://gw/artifacts",), trust=b"", approved_waves=frozenset()))
    assert [(o.device, o.kind, o.key) for o in out] == [("pi-0", KIND_RELEASE_OFFER, "release.offer:r2"),
                                                        ("pi-1", KIND_RELEASE_OFFER, "release.offer:r2")]
    offer = decode(out[0].payload, ReleaseOffer)
    parts = {p.part: p.payload for p in offer.parts}
    assert set(parts) == {"firmware", "config:app", "app:hello"}
    assert decode(parts["firmware"], UpdateOffer).rollout_id == "r2"
    assert decode(parts["config:app"], ConfigOffer).release.startswith(b"EACFG")
    app = decode(parts["app:hello"], AppOffer)
    assert peek_head(app.head).version == "2.0.0" and app.mirrors == ("http://gw/artifacts",)
    # the device holds the release when it runs every part of it, as its heartbeats say
    host.configs = {"pi-0": ((), {"app": ConfigState(version="1.1.0", state="committed")}),
                    "pi-1": ((), {"app": ConfigState(version="1.0.0", state="committed")})}
    host.apps = {"hello": {"pi-0": "2.0.0", "pi-1": "2.0.0"}}
    devices = [DeviceInfo("pi-0", firmware_version="1.1.0"), DeviceInfo("pi-1", firmware_version="1.1.0"),
               DeviceInfo("pi-2", firmware_version="1.0.0")]
    assert kind.held(admitted.release, devices) == {  # a device's "from": the release, or the parts that change
        "pi-0": "2.0.0", "pi-1": "config:app 1.0.0",
        "pi-2": "firmware 1.0.0, config:app none, app:hello none"}


def test_a_part_that_is_not_the_one_the_document_signs_is_refused(tmp_path: Path) -> None:
    document, key = built(tmp_path)
    folder = document.parent
    kind = release_kind(Host(keys=key.public, artifacts_dir=tmp_path / "artifacts"))
    other = release_kind(Host(keys=SigningKey.generate().public, artifacts_dir=tmp_path / "other"))
    with pytest.raises(RolloutError, match="gateway-2.0.0.earel: signed by key .*, not the fleet's key"):
        other.admit(str(document), undone=None)
    bundle = folder / "hello-2.0.0.eaapp"
    kept = bundle.read_bytes()
    bundle.unlink()
    with pytest.raises(RolloutError, match=r"part app:hello \(.*hello-2.0.0.eaapp\): not found"):
        kind.admit(str(document), undone=None)
    # another bundle of the same name and version, signed by the fleet too, is not the one signed here
    from apps_support import app_dir

    from app_rollout.bundle import build_bundle

    build_bundle(app_dir(tmp_path / "hello-b", version="2.0.0", files={"bin/server": ("#!/bin/sh\n", 0o755)}), key,
                 bundle)
    with pytest.raises(RolloutError, match=r"part app:hello .*: its sha256 differs from the signed release"):
        kind.admit(str(document), undone=None)
    bundle.write_bytes(kept)
    again = kind.admit(str(document), undone=None)
    assert again.version == "2.0.0"
    # admitted once, it starts again from the store's copy of its document alone (the console's list)
    shutil.rmtree(folder)
    assert kind.admit(again.artifact, undone=None).release == again.release
