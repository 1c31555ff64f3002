"""The worker's config offers: an offer outside its maintenance window waits for it (the leader
told `waiting_window` with when it opens) and is applied when it opens; a cancel drops an offer
still waiting; a layer value the release does not take is refused with the reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.agent_support import worker

from agent.core.clock import VirtualClock
from agent.transport.memory import MemoryBroker
from agent.worker.config_targets import ConfigTargetsPart
from config_rollout.layers import LayerValue
from config_rollout.messages import ConfigOffer
from config_rollout.release import build_release
from rollout_engine.keys import SigningKey
from rollout_engine.messages import RolloutCancel

KEY = SigningKey.generate()


def release(tmp: Path, version: str, text: str) -> bytes:
    src = tmp / f"src-{version}"
    src.mkdir()
    (src / "app.toml").write_text(text)
    return build_release("app", version, [src / "app.toml"], KEY, created_ms=1)


async def test_an_offer_waits_for_its_window_and_a_cancel_drops_one_still_waiting(
        tmp_path: Path, clock: VirtualClock, broker: MemoryBroker) -> None:
    etc = tmp_path / "etc" / "app"
    etc.mkdir(parents=True)
    (etc / "app.toml").write_text("port = 1\n")
    (tmp_path / "public.pem").write_bytes(KEY.public.to_pem())
    device = await worker(clock, tmp_path, "pi-1", broker=broker, sections={
        "firmware": {"public_key": str(tmp_path / "public.pem")},
        "config_targets": {"app": {"directory": str(etc), "settle_s": 0, "confirm_s": 5}}})
    part = ConfigTargetsPart(device, KEY.public)
    await part.start()
    runner, ref = part.runner, part.ref
    assert ref is not None
    reports: list[tuple[str, str, str, int]] = []

    async def report(rollout_id: str, version: str, state: str, phase: str, detail: str, *, until_ms: int = 0) -> None:
        reports.append((rollout_id, state, detail, until_ms))

    async def fine() -> str:
        return ""

    runner.report = report  # type: ignore[method-assign]
    part.module._host_check = lambda *args: fine  # type: ignore[method-assign]  # (no leader on this broker)
    runner._utc_offset_s = lambda: 0.0
    try:
        second = clock.now_ms() // 1000 % 86_400
        opens = (second // 3600 + 2) % 24  # a window two to three hours from now
        window = f"{opens:02d}:00-{(opens + 1) % 24:02d}:00" if opens != 23 else "23:00-24:00"
        ref.tell(ConfigOffer(rollout_id="r1", release=release(tmp_path, "1.1.0", "port = 2\n"),
                             maintenance_windows=(window,)))
        await clock.advance(1)
        assert [(r, s) for r, s, _, _ in reports] == [("r1", "waiting_window")]
        assert "device time" in reports[0][2] and reports[0][3] > clock.now_ms() + 3600_000
        assert (etc / "app.toml").read_text() == "port = 1\n"  # nothing before the window
        ref.tell(ConfigOffer(rollout_id="r2", release=release(tmp_path, "1.2.0", "port = 3\n"),
                             maintenance_windows=(window,)))
        await clock.advance(1)
        ref.tell(RolloutCancel(rollout_id="r2", reason="canceled by the operator"))
        await clock.advance(1)
        assert reports[-1][:2] == ("r2", "canceled") and "canceled by the operator" in reports[-1][2]
        await clock.advance(3 * 3600)  # the window opens: r1 is applied, r2 never
        assert [(r, s) for r, s, _, _ in reports if r == "r1"] == [("r1", "waiting_window"), ("r1", "installing"),
                                                                   ("r1", "succeeded")]
        assert (etc / "app.toml").read_text() == "port = 2\n"
        assert not [s for r, s, _, _ in reports if r == "r2" and s not in ("waiting_window", "canceled")]

        bad = LayerValue(document="app.toml", key="colour", value=json.dumps("red"), source="tag x")
        ref.tell(ConfigOffer(rollout_id="r3", release=release(tmp_path, "1.3.0", "port = 4\n"), layers=(bad,)))
        await clock.advance(1)
        assert reports[-1][:2] == ("r3", "rejected") and "defines no key colour" in reports[-1][2]
    finally:
        await device.stop()
