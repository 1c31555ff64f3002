"""`simulate --plot out.png`: the run's time series drawn with matplotlib (the optional `sim`
extra: `pip install edge-agent[sim]`). matplotlib is imported only here, only for --plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.core.errors import ConfigError

Report = dict[str, Any]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("simulate", "plot",
                          "--plot needs matplotlib: pip install 'edge-agent[sim]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(report: Report, path: str | Path) -> Path:
    """Draw outbox depth, online devices, the AIMD limit and progress (jobs or rollout waves)."""
    plt = _pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex="rollout" not in report)
    series = report.get("timeseries") or []
    if "rollout" in report:
        _rollout(axes, report)
    else:
        t = [p["t"] / 60.0 for p in series]
        axes[0].plot(t, [p["outbox_pending"] for p in series], label="outbox pending")
        axes[0].plot(t, [p["heartbeats_pending"] for p in series], label="heartbeats pending")
        axes[0].set_ylabel("rows")
        axes[1].plot(t, [p["online"] for p in series], label="connected")
        axes[1].plot(t, [p["leader_sees_online"] if p["leader_sees_online"] is not None else float("nan")
                         for p in series], label="online at the leader")
        axes[1].set_ylabel("devices")
        axes[2].step(t, [p["aimd_limit_min"] or 0 for p in series], where="post", label="AIMD limit (min)")
        axes[2].plot(t, [p["aimd_limit_mean"] or 0 for p in series], label="AIMD limit (mean)")
        axes[2].set_ylabel("in flight allowed")
        axes[3].plot(t, [p["jobs_confirmed"] for p in series], label="jobs confirmed")
        axes[3].plot(t, [p["leader_mailbox"] for p in series], label="leader mailbox depth")
        axes[3].set_xlabel("fleet time (min)")
        s = report["scenario"]
        fig.suptitle(f"{s['devices']} devices, seed {s['seed']}: lost {report['lost']}")
    for ax in axes:
        if ax.get_legend_handles_labels()[1]:
            ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _rollout(axes: Any, report: Report) -> None:
    """Devices per wave and state; the rollout over fleet time (devices per state, downloads)."""
    ro = report["rollout"]
    waves = ro["waves"]
    states = sorted({k for w in waves for k in w["counts"]})
    # waves numbered from 1 as everywhere users read them (the canary is wave 1)
    idx = [w.get("number", w["index"] + 1) for w in waves]
    bottom = [0] * len(waves)
    for state in states:
        values = [w["counts"].get(state, 0) for w in waves]
        axes[0].bar(idx, values, bottom=bottom, label=state)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    axes[0].set_xticks(idx, [f"{n}\ncanary" if w.get("canary") else str(n) for n, w in zip(idx, waves, strict=True)])
    axes[0].set_ylabel("devices per wave")
    axes[0].set_xlabel("wave")
    series = report.get("timeseries") or []
    if series:
        t = [p["t"] / 60.0 for p in series]
        started = [p for p in series if p["wave"]]
        ts = [p["t"] / 60.0 for p in started]
        for state in sorted({k for p in started for k in p["counts"]}):
            axes[1].step(ts, [p["counts"].get(state, 0) for p in started], where="post", label=state)
        axes[1].set_ylabel("devices")
        axes[1].set_xlabel("fleet time (min)")
        starts = [(p["t"] / 60.0, p["wave"]) for i, p in enumerate(series)
                  if p["wave"] and (i == 0 or p["wave"] != series[i - 1]["wave"])]
        for x, n in starts:
            axes[1].axvline(x, color="grey", alpha=0.4, linestyle=":")
            axes[1].annotate(f"wave {n}", (x, 1.0), xycoords=("data", "axes fraction"), fontsize="small",
                             va="top", ha="left")
        axes[2].step(t, [p["downloads"] for p in series], where="post", label="downloads in flight")
        axes[2].axhline(report["downloads"]["bound"], color="red", alpha=0.5, linestyle="--", label="bound")
        axes[2].plot(t, [p["outbox_pending"] for p in series], label="reports in outboxes")
        axes[2].set_xlabel("fleet time (min)")
    else:
        outcomes = report["outcomes"]
        axes[1].barh(list(outcomes), list(outcomes.values()))
        axes[1].set_xlabel("devices by final state")
        d = report["downloads"]
        axes[2].bar(["bound", "max concurrent", "mailbox high-water"],
                    [d["bound"], d["max_concurrent"], d["mailbox_high_water"]])
    axes[2].set_ylabel("downloads")
    axes[3].axis("off")
    axes[3].text(0, 0.5, f"rollout {ro['state']} after {ro['duration_s']:.0f}s: {ro['detail']}", fontsize=10)


__all__ = ["plot"]
