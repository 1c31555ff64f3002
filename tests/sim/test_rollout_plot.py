"""The wave rollout's time series (the report's `timeseries`) and `--plot` of a rollout."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import main as cli_main
from agent.sim import SimOptions
from agent.sim.rollout import run_rollout


async def test_the_report_has_the_rollout_over_fleet_time(tmp_path: Path) -> None:
    report = await run_rollout(SimOptions(devices=20, seed=3, heartbeat_s=5.0, progress=False), workdir=tmp_path)
    series = report["timeseries"]
    assert series[0]["state"] == "not-started" and series[0]["wave"] == 0
    assert [p["t"] for p in series] == sorted(p["t"] for p in series)
    # every wave shows up running, numbered from 1, and the last point is the end
    assert {(p["wave"], p["wave_state"]) for p in series} >= {(n, "running") for n in (1, 2, 3, 4)}
    assert series[-1]["state"] == "succeeded" and series[-1]["counts"] == {"succeeded": 20}
    # between two points at most 30 s of fleet time pass
    assert max(b["t"] - a["t"] for a, b in zip(series, series[1:], strict=False)) <= 30.0
    assert all(sum(p["counts"].values()) == 20 for p in series if p["wave"])


def test_plot_of_a_rollout(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "rollout.png"
    assert cli_main(["simulate", "--scenario", "wave-rollout", "--devices", "20", "--seed", "3", "--fail-rate",
                     "0.2", "--quiet", "--plot", str(out)]) == 0  # warnings are errors: no empty legends
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
