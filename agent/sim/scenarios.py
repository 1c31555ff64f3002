"""Named scenarios: option presets for the cases of the seed, each with the claim it demonstrates.

`--scenario NAME` fills every option the user did not give from the preset; the run then checks
the claim against its report (`check`), prints it, and fails (exit 1) when it does not hold.
`wave-rollout` runs the rollout orchestrator's scenario (`agent.sim.rollout`) instead of the
heartbeat/telemetry fleet. The scenarios about faults run their devices at 5 s heartbeats (the
fast pace of an update) so that their faults fall within a few minutes of fleet time; a run without
a scenario uses the shipped idle interval.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.core.errors import ConfigError

Report = dict[str, Any]
Claim = Callable[[Report], list[str]]


@dataclass(frozen=True)
class Scenario:
    name: str
    demonstrates: str
    presets: dict[str, Any] = field(default_factory=dict)
    claim: Claim = lambda _r: []


def _coalescing(r: Report) -> list[str]:
    devices = r["scenario"]["devices"]
    box = r["leader_mailbox"].get("heartbeats", {})
    problems = []
    most = max((p.get("heartbeats_pending", 0) for p in r["timeseries"]), default=0)
    if most > devices:
        problems.append(f"{most} heartbeats pending in outboxes at once for {devices} devices")
    if box.get("high_water", 0) > devices:
        problems.append(f"leader heartbeat mailbox held {box['high_water']} for {devices} devices")
    if r["heartbeats"]["coalesced_in_outboxes"] == 0:
        problems.append("no heartbeat was coalesced in an outbox")
    ratio = r["heartbeats"]["coalescing_ratio"] or 0
    if ratio <= 1:
        problems.append(f"coalescing ratio {ratio}: nothing coalesced at the leader")
    return problems


def _herd(r: Report) -> list[str]:
    problems = [f"mailbox {name}: high-water {b['high_water']} over its capacity {b['capacity']}"
                for name, b in r["leader_mailbox"].items() if b["high_water"] > b["capacity"]]
    if r["leader"]["busy_answers"] == 0:
        problems.append("the leader never answered busy: no herd formed")
    return problems


def _store_and_forward(r: Report) -> list[str]:
    problems = []
    if r["telemetry"]["via_outbox"] == 0:
        problems.append("no telemetry waited in an outbox")
    if r["crashes"] == 0 or r["offline_episodes"] == 0:
        problems.append("no crash or no offline period happened")
    return problems


def _work_pulling(r: Report) -> list[str]:
    j = r["jobs"]
    problems = []
    if j["confirmed"] != j["submitted"]:
        problems.append(f"{j['confirmed']} of {j['submitted']} jobs confirmed")
    if j["confirmed_more_than_once"]:
        problems.append(f"{j['confirmed_more_than_once']} jobs confirmed twice")
    return problems


def _rollout(r: Report) -> list[str]:
    ro = r["rollout"]
    fail_rate = r["fail_rate"]
    problems = []
    if ro["devices_offered_after_abort"]:
        problems.append(f"{ro['devices_offered_after_abort']} devices were offered the image after the abort")
    if ro.get("cancel_at_s") is not None:  # `--cancel-at`: a cancel stops the fleet
        if ro["devices_installed_after_cancel"]:
            problems.append(f"{ro['devices_installed_after_cancel']} devices installed the image after the cancel")
        if ro["cancel_pending"]:
            problems.append(f"{ro['cancel_pending']} devices never confirmed the cancel")
        return problems
    if fail_rate == 0 and ro["state"] != "succeeded":
        problems.append(f"no device fails, yet the rollout ended {ro['state']}")
    if fail_rate >= 0.1 and ro["state"] not in ("aborted", "paused"):
        problems.append(f"{fail_rate:.0%} of devices fail, yet the rollout ended {ro['state']}")
    return problems


def _config_rollout(r: Report) -> list[str]:
    ro, cut, docs = r["rollout"], r["cut"], r["documents"]
    problems = []
    if ro["devices_offered_after_abort"]:
        problems.append(f"{ro['devices_offered_after_abort']} devices were offered the release after the abort")
    if cut["rolled_back"] != cut["offered"]:
        problems.append(f"of {cut['offered']} devices the config cut off, {cut['rolled_back']} reverted by themselves"
                        f" ({cut['other_outcomes']})")
    if not cut["reverted_within_confirm_s"]:
        problems.append(f"a cut-off device reverted {cut['revert_s_max']}s after the apply, over confirm_s")
    if cut["still_cut_off"]:
        problems.append(f"{cut['still_cut_off']} devices are still cut off")
    if docs["other"]:
        problems.append(f"{docs['other']} devices hold neither the old document nor the new one")
    if cut["offered"] and ro["state"] != "aborted":
        problems.append(f"the config cut {cut['offered']} devices off, yet the rollout ended {ro['state']}")
    if not cut["devices"] and ro["state"] != "succeeded":
        problems.append(f"no device is cut off, yet the rollout ended {ro['state']}")
    return problems


def _app_rollout(r: Report) -> list[str]:
    ro, unhealthy, running = r["rollout"], r["unhealthy"], r["running"]
    problems = []
    if ro["devices_offered_after_abort"]:
        problems.append(f"{ro['devices_offered_after_abort']} devices were offered the bundle after the abort")
    if unhealthy["failed"] != unhealthy["offered"]:
        problems.append(f"of {unhealthy['offered']} devices where the new version fails, {unhealthy['failed']} took it"
                        f" back by themselves ({unhealthy['other_outcomes']})")
    others = {v: n for v, n in running.items() if v not in ("1.0.0", "2.0.0")}
    if others or r["on_trial"]:
        problems.append(f"devices run neither the old version nor the new one ({others}), or a trial is left"
                        f" ({r['on_trial']})")
    if not r["leader_knows"]:
        problems.append("the leader's registry does not say what every device runs")
    if unhealthy["offered"] and ro["state"] != "aborted":
        problems.append(f"the new version failed on {unhealthy['offered']} devices, yet the rollout ended"
                        f" {ro['state']}")
    if not unhealthy["devices"] and ro["state"] != "succeeded":
        problems.append(f"no device fails the new version, yet the rollout ended {ro['state']}")
    return problems


def _release_rollout(r: Report) -> list[str]:
    ro, unhealthy = r["rollout"], r["unhealthy"]
    problems = []
    if ro["devices_offered_after_abort"]:
        problems.append(f"{ro['devices_offered_after_abort']} devices were offered the release after the abort")
    if unhealthy["rolled_back"] != unhealthy["offered"]:
        problems.append(f"of {unhealthy['offered']} devices where the application fails, {unhealthy['rolled_back']}"
                        f" returned whole to the previous release ({unhealthy['other_outcomes']})")
    if unhealthy["named_the_part"] != unhealthy["rolled_back"]:
        problems.append(f"of {unhealthy['rolled_back']} devices that returned, {unhealthy['named_the_part']} named the"
                        " part that failed")
    if r["mixed"] or r["held"]:
        problems.append(f"devices run a mix of the two releases ({r['mixed']}), or parts are left held ({r['held']})")
    if unhealthy["offered"] and ro["state"] != "aborted":
        problems.append(f"the release failed on {unhealthy['offered']} devices, yet the rollout ended {ro['state']}")
    if not unhealthy["devices"] and ro["state"] != "succeeded":
        problems.append(f"no device fails the release, yet the rollout ended {ro['state']}")
    return problems


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "heartbeat-coalescing",
            "Devices beat every 5 s; the leader takes them every 30 s, so its mailbox keeps the newest"
            " beat per device (about 6 to 1), and a device offline for minutes holds ONE pending"
            " heartbeat in its outbox (OVERWRITE by key), not one per interval.",
            {"devices": 200, "duration_s": 600.0, "heartbeat_s": 5.0, "offline_rate": 0.25,
             "offline_duration_s": 180.0},
            _coalescing,
        ),
        Scenario(
            "thundering-herd",
            "The broker goes away for a minute; when it returns every device reconnects at once and"
            " its relay drains what it held. The leader's mailboxes stay within their bound (busy"
            " answers instead), and AIMD halves the relays' limits until the herd has passed.",
            {"devices": 200, "duration_s": 240.0, "heartbeat_s": 5.0, "leader_mailbox": 32, "leader_interval_s": 0.5,
             "telemetry_s": 5.0, "broker_outage": (60.0, 60.0)},
            _herd,
        ),
        Scenario(
            "wave-rollout",
            "A signed image goes out in a canary wave and three more behind success gates, downloads"
            " bounded by ConfigServer mailboxes; with --fail-rate 0.2 the failure threshold aborts the"
            " rollout and no further device is offered the image. Every device is a real worker"
            " with the real updater; the fleet's faults (--offline-rate, --crash-rate,"
            " --broker-outage) apply while the rollout runs.",
            {"devices": 200, "heartbeat_s": 30.0, "telemetry_s": 0.0},
            _rollout,
        ),
        Scenario(
            "config-rollout",
            "A signed config release goes out in waves behind success gates to real workers, each"
            " applying it commit-confirmed; it cuts --cut-rate of the devices off the moment it is"
            " applied: each reverts by itself within confirm_s, its link comes back with the old"
            " document, and the failure threshold aborts the rollout. Every device holds the old"
            " document or the new one, never another; nothing is lost.",
            {"devices": 200, "heartbeat_s": 30.0, "telemetry_s": 0.0},
            _config_rollout,
        ),
        Scenario(
            "app-rollout",
            "A signed application bundle (hello 2.0.0, every device running 1.0.0) goes out in waves"
            " behind success gates to real workers, each installing it beside the running version"
            " through its own application helper and checking its health; on --fail-rate of the"
            " devices 2.0.0's process exits: each takes it back and runs 1.0.0 again, and the"
            " failure threshold aborts the rollout. Every device runs 1.0.0 or 2.0.0, none is left on"
            " trial; nothing is lost.",
            {"devices": 200, "heartbeat_s": 30.0, "telemetry_s": 0.0},
            _app_rollout,
        ),
        Scenario(
            "release-rollout",
            "One signed release of the devices' whole state (firmware 1.1.0, config app 1.1.0, hello"
            " 2.0.0; every device on the release before it) goes out in waves to real workers: each"
            " boots the firmware on trial, converges the config and the application on that boot,"
            " and commits every part only when all are healthy. On --fail-rate of the devices hello"
            " 2.0.0's process exits: each returns whole to the previous release, firmware included,"
            " naming the part that failed, and the failure threshold aborts the rollout. Every device"
            " runs one release or the other, never a mix; nothing is lost.",
            {"devices": 100, "heartbeat_s": 30.0, "telemetry_s": 0.0},
            _release_rollout,
        ),
        Scenario(
            "offline-store-and-forward",
            "A third of the devices lose their uplink for 10 minutes, a tenth crash and restart on"
            " their SQLite state, and the broker drops out once: everything they measured is stored"
            " and forwarded, nothing is lost, every outbox drains.",
            {"devices": 100, "duration_s": 1200.0, "heartbeat_s": 5.0, "offline_rate": 0.3, "offline_duration_s": 600.0,
             "crash_rate": 0.1, "crash_downtime_s": 60.0, "telemetry_s": 10.0, "broker_outage": (300.0, 60.0)},
            _store_and_forward,
        ),
        Scenario(
            "work-pulling",
            "The leader holds a queue of jobs; workers pull them within their demand window, run each"
            " once and confirm; a device that crashes mid-job has its job offered again, and every job"
            " is confirmed exactly once.",
            {"devices": 50, "duration_s": 600.0, "heartbeat_s": 5.0, "jobs": 500, "job_window": 2, "crash_rate": 0.1,
             "crash_downtime_s": 30.0},
            _work_pulling,
        ),
    )
}


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ConfigError("simulate", "scenario",
                          f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}") from None


def check(name: str, report: Report) -> list[str]:
    """The ways `report` breaks the scenario's claim (empty: the claim holds)."""
    return get(name).claim(report)


__all__ = ["SCENARIOS", "Scenario", "check", "get"]
