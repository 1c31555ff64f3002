"""`edge-agent rollout`: controls written into the leader's database, applied by the orchestrator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollout_support import FakePort, engine_kinds

from agent.cli import main as cli
from agent.core.clock import VirtualClock
from agent.core.config import HeartbeatSection
from agent.leader.registry import DeviceRegistry
from agent.protocol import Heartbeat
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.orchestrator import Orchestrator
from rollout_engine.store import RolloutStore

HEARTBEAT_DEFAULT_S = HeartbeatSection().fast_interval_s  # a worker beats this often through a soak

SPEC = """
[rollout]
name = "cli test"
artifact = "fw-1.1.0.eafw"

[waves]
canary = 1
counts = [2]

[gates]
manual_approval = true
"""


@pytest.fixture
def leader(tmp_path: Path, leader_store: Path | str) -> tuple[Path, Path]:
    """A leader's database as its first start leaves it (the registry and the rollout tables):
    `leader.db`, then the fleet's PostgreSQL database (`--db postgresql://...`)."""
    make_artifact(tmp_path, chunk_size=1024, size=2048)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    db: Any = leader_store
    DeviceRegistry.open(db, clock=VirtualClock()).close()
    RolloutStore.open(db, clock=VirtualClock()).close()
    return db, spec


def register(db: Path, devices: list[str] | dict[str, str]) -> None:
    """Devices as the leader's registry has them (the CLI plans against it): at 1.0.0, or at the
    version given for each."""
    versions = devices if isinstance(devices, dict) else dict.fromkeys(devices, "1.0.0")
    registry = DeviceRegistry.open(db, clock=VirtualClock())
    try:
        registry.apply_heartbeats([Heartbeat(device_id=d, seq=1, uptime_s=1.0, firmware_version=v)
                                   for d, v in versions.items()])
    finally:
        registry.close()


async def tick(db: Path, clock: VirtualClock, port: FakePort) -> None:
    """What the running leader does on its timer tick."""
    store = RolloutStore.open(db, clock=clock)
    try:
        await Orchestrator(store, clock=clock, port=port, kinds=engine_kinds()).tick()
    finally:
        store.close()


async def test_start_status_controls_list(leader: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    db, spec = leader
    clock = VirtualClock()
    port = FakePort(clock, ["a", "b", "c", "d"])
    register(db, ["a", "b", "c", "d"])
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    assert "queued as control" in capsys.readouterr().out
    await tick(db, clock, port)
    assert cli(["rollout", "status", "r1", "--db", str(db), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["state"] == "running" and data["devices"] == 4 and len(data["waves"]) == 3
    assert data["counts"] == {"notified": 1, "queued": 3}

    assert cli(["rollout", "pause", "r1", "--db", str(db), "--no-wait"]) == 0
    await tick(db, clock, port)
    capsys.readouterr()
    assert cli(["rollout", "status", "--db", str(db)]) == 0  # the latest rollout
    screen = capsys.readouterr().out
    assert "r1" in screen and "PAUSED" in screen and "canary" in screen and "notified 1" in screen
    # the "leader" here wrote on a virtual clock long past: to a reader now it has been silent
    assert "STALE: the leader has written nothing since" in screen

    assert cli(["rollout", "resume", "r1", "--db", str(db), "--no-wait"]) == 0
    assert cli(["rollout", "next", "r1", "--db", str(db), "--no-wait"]) == 0
    await tick(db, clock, port)
    assert cli(["rollout", "list", "--db", str(db), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.split("\n", 2)[-1])
    assert listed[0]["id"] == "r1" and listed[0]["state"] == "running" and listed[0]["wave"] == "2/3"

    assert cli(["rollout", "cancel", "r1", "--db", str(db), "--no-wait"]) == 0
    await tick(db, clock, port)
    capsys.readouterr()
    assert cli(["rollout", "status", "r1", "--db", str(db), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["state"] == "canceled"
    # the devices that were updating are told to stop, and the view says who has not confirmed
    updating = sorted(d for d, n in data["counts"].items() if d in ("notified", "downloading"))
    assert updating and data["cancel_pending"] == sum(data["counts"][s] for s in updating)
    assert sorted(rid for _, rid in port.cancels) == ["r1"] * data["cancel_pending"]
    assert cli(["rollout", "status", "r1", "--db", str(db)]) == 0
    assert "still to confirm the cancel" in capsys.readouterr().out
    await tick(db, clock, port)
    assert len(port.cancels) == data["cancel_pending"]  # once each


def test_user_mistakes_exit_2_with_one_line(leader: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    db, spec = leader
    bad = tmp_path / "bad.toml"
    bad.write_text(SPEC.replace("counts = [2]", "counts = [2]\npercents = [100]"))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(SPEC.replace('[rollout]', '[rollout]\nkind = "apps"'))
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(SPEC.replace('[rollout]', '[rollout]\nkind = "config"\ndownload_only = true'))
    cases = [
        (["rollout", "start", str(bad), "--db", str(db)], "waves: give exactly one"),
        (["rollout", "start", str(unknown), "--db", str(db)],
         f"{unknown}: rollout.kind: 'apps' is not a rollout kind: the kinds are app, config, firmware"),
        (["rollout", "start", str(wrong), "--db", str(db)],
         f'{wrong}: rollout.download_only: a config release rollout applies at once (kind = "config")'),
        (["rollout", "start", str(spec)], "--db"),
        (["rollout", "status", "--db", str(tmp_path / "missing.db")], "no leader database"),
        (["rollout", "pause", "nope", "--db", str(db)], "no rollout 'nope'"),
        (["rollout", "status", "--db", str(db)], "no rollouts yet"),
        (["rollout", "start", str(spec), "--db", str(db)], "no device matches"),
    ]
    for argv, message in cases:
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    register(db, ["a", "b", "c"])
    tiny = tmp_path / "tiny.toml"
    tiny.write_text(SPEC.replace("counts = [2]", "percents = [10, 90]"))
    assert cli(["rollout", "start", str(tiny), "--db", str(db)]) == 2
    assert "would hold no device" in capsys.readouterr().err
    (tmp_path / "fw-1.1.0.eafw").write_bytes(b"not an artifact")
    assert cli(["rollout", "start", str(spec), "--db", str(db)]) == 2
    assert "artifact" in capsys.readouterr().err


async def test_controls_that_do_not_apply_are_refused_before_writing(leader: tuple[Path, Path],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    db, spec = leader
    clock = VirtualClock()
    port = FakePort(clock, ["a", "b", "c"])
    register(db, ["a", "b", "c"])
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    await tick(db, clock, port)
    capsys.readouterr()
    assert cli(["rollout", "approve", "r1", "--db", str(db)]) == 2
    assert "not awaiting approval" in capsys.readouterr().err
    assert cli(["rollout", "rollback", "r1", "--db", str(db)]) == 2
    assert "rollback_artifact" in capsys.readouterr().err
    store = RolloutStore.open(db, clock=clock)
    try:
        assert [c.action for c in store.pending_controls()] == []
    finally:
        store.close()


async def test_a_control_the_leader_does_not_apply_says_since_when_it_has_not_run(
        leader: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    db, spec = leader
    clock = VirtualClock()
    register(db, ["a", "b", "c"])
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    await tick(db, clock, FakePort(clock, ["a", "b", "c"]))  # the leader ran once, then stopped
    capsys.readouterr()
    assert cli(["rollout", "pause", "r1", "--db", str(db), "--wait", "0.3"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("edge-agent rollout: not applied yet: the leader has not run since ")
    assert err.endswith(f"(its last write to {db}); it applies control 2 when it starts")
    with pytest.raises(SystemExit) as usage:  # a usage error: argparse's exit 2 with the usage line
        cli(["rollout", "status", "--db", str(db), "--watch", "--interval", "0"])
    assert usage.value.code == 2
    assert "--interval: must be a number of seconds > 0, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("soak", [0.5 * HEARTBEAT_DEFAULT_S, HEARTBEAT_DEFAULT_S, 2 * HEARTBEAT_DEFAULT_S])
def test_start_warns_of_a_soak_shorter_than_the_workers_heartbeat(
    leader: tuple[Path, Path], soak: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """One `warning:` line on stderr naming the spec, and the start goes on; none from one beat."""
    db, spec = leader
    spec.write_text(SPEC + f"soak_s = {soak}\n")  # the [gates] table is the spec's last
    register(db, ["a", "b", "c", "d"])
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    out, err = capsys.readouterr()
    assert "queued as control" in out
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    if soak < HEARTBEAT_DEFAULT_S:
        assert warnings == [f"warning: {spec}: gates.soak_s = {soak:g} is shorter than the workers' heartbeat"
                            f" interval ({HEARTBEAT_DEFAULT_S:g} s): the soak can end before a device's next"
                            f" heartbeat, and the device then counts as failed; make soak_s at least"
                            f" {HEARTBEAT_DEFAULT_S:g}"]
        assert err.count("\n") == 1
    else:
        assert warnings == [] and "soak" not in err


def _fingerprint(path: Path) -> tuple[str, int]:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def test_rollout_commands_on_a_workers_database_refuse_and_leave_it_as_it_was(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.worker.jobs import JobLedger

    worker_db = tmp_path / "worker.db"
    JobLedger.open(worker_db, clock=VirtualClock()).close()
    before = _fingerprint(worker_db)
    for argv in (["rollout", "list", "--db", str(worker_db)], ["rollout", "status", "--db", str(worker_db)],
                 ["rollout", "pause", "r1", "--db", str(worker_db)],
                 ["rollout", "start", str(tmp_path / "spec.toml"), "--db", str(worker_db)]):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(worker_db) in err, err
        assert "has no" in err
    assert _fingerprint(worker_db) == before
    assert not (tmp_path / "worker.db-wal").exists() or (tmp_path / "worker.db-wal").stat().st_size == 0


def test_reading_a_leaders_rollouts_writes_nothing(leader: tuple[Path, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    db, _ = leader
    if not isinstance(db, Path):
        pytest.skip("a file's bytes: PostgreSQL's read-only session is its own guard")
    before = _fingerprint(db)
    assert cli(["rollout", "list", "--db", str(db)]) == 0
    assert capsys.readouterr().out.strip() == "no rollouts"
    assert cli(["rollout", "status", "--db", str(db)]) == 2  # no rollouts yet: a user mistake, still no write
    capsys.readouterr()
    assert _fingerprint(db) == before


def test_start_refuses_an_image_older_than_every_target_unless_signed_as_a_rollback(
        leader: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Every device would refuse it as a downgrade: the rollout could only fail. Signed as a
    rollback, it starts; older than some targets only, it starts with one warning line."""
    db, spec = leader
    register(db, {"a": "1.2.0", "b": "2.0.0", "c": "1.3.1"})
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 2
    err = capsys.readouterr().err
    assert "is version 1.1.0, older than every targeted device (1.2.0, 1.3.1, 2.0.0)" in err
    assert "sign it as a rollback" in err and err.count("\n") == 1
    make_artifact(spec.parent, chunk_size=1024, size=2048, rollback=True)  # the same version, as a rollback
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r2", "--no-wait"]) == 0
    assert "older" not in capsys.readouterr().err


def test_start_warns_when_some_targets_run_a_newer_version(leader: tuple[Path, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    db, spec = leader
    register(db, {"a": "1.0.0", "b": "2.0.0", "c": "1.0.0"})
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: artifact {spec.parent / 'fw-1.1.0.eafw'} is version 1.1.0, older than 1 of the 3"
                        " targeted devices: they will refuse it as a downgrade (failures that count against the"
                        " rollout's gates)"]


def test_a_dry_run_shows_the_plan_device_by_device_and_starts_nothing(leader: tuple[Path, Path], tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Explicit targets (a list and a file of ids), and `--dry-run`: each wave's devices, who is
    left out and why; nothing is written. The real start prints the same plan's summary."""
    db, spec = leader
    register(db, {"a": "1.0.0", "b": "1.0.0", "c": "1.1.0", "d": "1.0.0", "e": "1.0.0"})
    (tmp_path / "bench.txt").write_text("# the bench boards\nb\n\ne  # the spare\nzz\n")
    spec.write_text(SPEC.replace("[waves]", '[targets]\nselect = "devices"\ndevices = ["a", "c"]\n'
                                            'devices_file = "bench.txt"\n\n[waves]').replace("counts = [2]",
                                                                                            "counts = [1]"))
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout r1 (dry run, nothing started)" in out
    waves = [line for line in out.splitlines() if line.startswith("wave ")]
    assert len(waves) == 3 and waves[0].startswith("wave 1 (canary): 1 device: ")
    planned = sorted(w.split(": ", 2)[2] for w in waves)
    assert planned == ["a", "b", "e"]
    assert "  c  already on 1.1.0" in out and "  d  not in the list" in out and "  zz  unknown to the leader" in out
    assert "plan: 3 devices in 3 waves (1, 1, 1); left out 3: " in out
    assert cli(["rollout", "list", "--db", str(db)]) == 0 and "no rollouts" in capsys.readouterr().out
    store = RolloutStore.open(db, clock=VirtualClock())
    try:
        assert store.pending_controls() == []
    finally:
        store.close()
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    assert "plan: 3 devices in 3 waves (1, 1, 1); left out 3: " in capsys.readouterr().out


@pytest.mark.parametrize(("targets", "key", "message"), [
    ('select = "all"\ndevices = ["a"]', "targets.devices", 'applies with select = "devices"'),
    ('select = "devices"', "targets.devices", "needs the devices' ids"),
    ('select = "devices"\ndevices = ["a b"]', "targets.devices", ""),
    ('select = "devices"\ndevices_file = "ids.txt"', "targets.devices_file", "'not an id!' is not a device id"),
    ('select = "devices"\ndevices_file = "missing.txt"', "targets.devices_file", "cannot read the device list"),
])
def test_a_wrong_target_list_is_one_line_naming_the_key(leader: tuple[Path, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], targets: str, key: str,
                                                        message: str) -> None:
    db, spec = leader
    register(db, ["a"])
    (tmp_path / "ids.txt").write_text("a\nnot an id!\n")
    spec.write_text(SPEC.replace("[waves]", f"[targets]\n{targets}\n\n[waves]"))
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert key in err and message in err and len(err.strip().splitlines()) == 1, err
    if "ids.txt" in targets:
        assert "ids.txt:2" in err


def test_a_filter_on_when_devices_were_heard_from_leaves_out_the_silent(leader: tuple[Path, Path],
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The registry here was written on a virtual clock long past: every device is silent."""
    db, spec = leader
    register(db, ["a", "b", "c"])
    spec.write_text(SPEC.replace("[waves]", "[targets]\nseen_within_s = 60\n\n[waves]"))
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--dry-run"]) == 2
    assert "left out: 3 not heard from within 60 s" in capsys.readouterr().err


async def test_a_restarted_leader_says_which_rollouts_it_takes_up(leader: tuple[Path, Path],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    db, spec = leader
    clock = VirtualClock()
    port = FakePort(clock, ["a", "b", "c", "d"])
    register(db, ["a", "b", "c", "d"])
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    await tick(db, clock, port)
    caplog.set_level("INFO", logger="rollout_engine.orchestrator")
    store = RolloutStore.open(db, clock=clock)
    try:
        Orchestrator(store, clock=clock, port=port, kinds=engine_kinds()).log_resumed()
    finally:
        store.close()
    assert "rollout r1 of version 1.1.0 taken up running: wave 1 of 3; devices: queued 3, notified 1" in caplog.text


async def test_rollout_status_is_stale_only_when_the_leader_stopped_marking_itself_alive(
        leader: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Idle devices beat every 5 minutes: an old newest heartbeat or rollout step is no sign of
    a stopped leader; the leader's own alive mark (every 30 s) is."""
    from agent.core.clock import SystemClock

    db, spec = leader
    clock = VirtualClock()  # the heartbeats and the rollout's steps: long past
    register(db, ["a", "b", "c", "d"])
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1", "--no-wait"]) == 0
    await tick(db, clock, FakePort(clock, ["a", "b", "c", "d"]))
    capsys.readouterr()
    assert cli(["rollout", "status", "r1", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stale"] is True
    registry = DeviceRegistry.open(db, clock=SystemClock())
    try:
        registry.mark_alive()  # the running leader, now
    finally:
        registry.close()
    assert cli(["rollout", "status", "r1", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stale"] is False


async def test_piped_screens_keep_whole_lines_and_count_waves_from_one(leader: tuple[Path, Path],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    db, spec = leader
    clock = VirtualClock()
    register(db, ["a", "b", "c", "d"])
    assert cli(["rollout", "start", str(spec), "--db", str(db), "--id", "r1-with-a-name-long-enough-for-a-wide-line",
                "--no-wait"]) == 0
    await tick(db, clock, FakePort(clock, ["a", "b", "c", "d"]))
    capsys.readouterr()
    assert cli(["rollout", "status", "r1-with-a-name-long-enough-for-a-wide-line", "--db", str(db), "--devices"]) == 0
    out = capsys.readouterr().out  # (a pipe here: rich would cut at 80 columns)
    assert max(len(line) for line in out.splitlines()) > 80 and "…" not in out
    assert cli(["status", "--db", str(db), "--device", "a"]) == 0
    shown = capsys.readouterr().out
    assert "r1-with-a-name-long-enough-for-a-wide-line (cli test): 1.0.0 → 1.1.0 [running]: wave " in shown
    assert ": wave 0," not in shown


def test_each_figure_says_what_it_counts_in_a_unit_that_keeps_it_readable() -> None:
    from rich.console import Console

    from agent.commands.rollout import render_status
    from agent.core.sizes import format_bytes

    assert [format_bytes(n) for n in (0, 812, 3300, 16_000_000, 1_288_490_189)] == [
        "0 B", "812 B", "3.2 KiB", "15.3 MiB", "1.20 GiB"]
    wave = {"number": 1, "canary": False, "counts": {"downloading": 1}, "finished": 0, "size": 1, "state": "running",
            "succeeded": 0, "download": {"bytes_total": 16_000_000, "bytes_done": 8_000_000, "bytes_to_fetch": 30_000,
                                          "rate_bytes_per_s": 2048.0}}
    data = {"id": "r1", "name": "camera", "version": "1.2.0", "state": "running", "detail": "", "waves": [wave],
            "counts": {"downloading": 1}, "devices": 1, "offers": 1, "serving": {"chunks": 3, "bytes": 3300},
            "rollback_of": "", "from_versions": {"1.0.0": 1},
            "device_list": [{"device": "pi-1", "wave": 0, "state": "downloading", "attempts": 1,
                             "from_version": "1.0.0", "image_bytes": 16_000_000, "bytes_to_fetch": 30_000,
                             "bytes_fetched": 0, "detail": ""}]}
    console = Console(record=True, width=250)
    console.print(render_status(data))
    text = console.export_text()
    assert "7.6 MiB of 15.3 MiB assembled, 29.3 KiB to fetch (delta), 2.0 KiB/s" in text
    assert "MQTT chunks served 3 (3.2 KiB)" in text
    header = next(line for line in text.splitlines() if line.startswith("device "))
    assert header.split() == ["device", "wave", "versions", "state", "attempts", "fetched", "detail"]
    assert "0 B of 29.3 KiB to fetch (15.3 MiB image)" in text
    assert "1.0.0 → 1.2.0" in text and "(camera)  1.0.0 → 1.2.0" in text
