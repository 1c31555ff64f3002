"""Progress while a simulation runs: a live rich panel on a terminal, plain lines otherwise.

Two kinds of samples: the fleet simulator's (`agent.sim.runner`) and the wave rollout's
(`agent.sim.rollout`, `kind` = "rollout"), which adds the rollout's state, its current
wave (numbered from 1, the canary being wave 1) and per-state device counts.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO

Sample = dict[str, Any]


def fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h:d}:{m:02d}:{s:02d}"


def fmt_counts(counts: dict[str, int]) -> str:
    """`queued 5, succeeded 3` (states in name order), or `none`."""
    return ", ".join(f"{state} {n}" for state, n in sorted(counts.items())) or "none"


def wave_name(w: Sample) -> str:
    return f"wave {w['number']}" + (" (canary)" if w["canary"] else "")


def _seen(p: Sample) -> str:
    """What the leader sees online; `-` in a shard whose leader runs elsewhere (`--shard`)."""
    seen = p["leader_sees_online"]
    return "-" if seen is None else str(seen)


def _aimd(p: Sample) -> str:
    """The smallest AIMD window of the devices' relays; `unused` while no relay has sent from an
    outbox (every message went direct)."""
    low = p["aimd_limit_min"]
    return "unused" if low is None else str(low)


def plain_line(p: Sample) -> str:
    if p.get("kind") == "rollout":
        return rollout_line(p)
    return (f"t={fmt_time(p['t'])} online={p['online']}/{p['devices']} leader_sees={_seen(p)}"
            f" in_flight={p['in_flight']} outbox_pending={p['outbox_pending']}"
            f" leader_mailbox={p['leader_mailbox']}/{p['leader_mailbox_capacity']} aimd={_aimd(p)}"
            f" jobs_confirmed={p['jobs_confirmed']}/{p['jobs_submitted']}")


def rollout_line(p: Sample) -> str:
    """One plain line of a rollout sample: the fleet, then the current wave and its device states.

        t=0:02:05 online=60/60 leader_sees=60 in_flight=1 outbox_pending=2 downloads=6/6
        rollout=running wave=2/4 wave_state=running wave_devices=17 [downloading 6, queued 11] done=3/60
    """
    head = (f"t={fmt_time(p['t'])} online={p['online']}/{p['devices']} leader_sees={p['leader_sees_online']}"
            f" in_flight={p['in_flight']} outbox_pending={p['outbox_pending']}"
            + (f" downloads={p['downloads']}/{p['download_bound']}" if p["download_bound"] else ""))
    ro = p["rollout"]
    if ro is None:
        return f"{head} rollout=not-started (devices registering)"
    wave = ro["waves"][ro["wave"] - 1]
    return (f"{head} rollout={ro['state']} wave={ro['wave']}/{ro['wave_count']} wave_state={wave['state']}"
            f" wave_devices={wave['size']} [{fmt_counts(wave['counts'])}] done={ro['finished']}/{ro['targeted']}")


class ProgressDisplay:
    """Call with each sample. Use as a context manager (the live panel ends on exit).

    `duration_s` is the fleet time the run aims at (None when it ends on its own, as a rollout
    does: no time bar then). `live` forces the rich panel (True) or plain lines (False); by
    default the panel is used when `stream` is a terminal."""

    def __init__(self, *, duration_s: float | None, stream: TextIO | None = None, live: bool | None = None) -> None:
        self._stream = stream or sys.stdout
        self._duration_s = duration_s
        self._live: Any = None
        want_live = self._stream.isatty() if live is None else live
        if want_live:
            try:
                from rich.console import Console
                from rich.live import Live
            except ImportError:  # the cli extra is not installed: plain lines
                want_live = False
            else:
                self._live = Live(console=Console(file=self._stream), refresh_per_second=4, transient=False)

    @property
    def live(self) -> bool:
        """True when samples update a live panel, False when each one prints a line."""
        return self._live is not None

    def __enter__(self) -> ProgressDisplay:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(et, e, tb)

    def __call__(self, p: Sample) -> None:
        if self._live is None:
            print(plain_line(p), file=self._stream, flush=True)
            return
        self._live.update(self.render(p))

    def render(self, p: Sample) -> Any:
        """The rich renderable of a sample."""
        if p.get("kind") == "rollout":
            return self._render_rollout(p)
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        duration = self._duration_s or 1.0
        bar = ProgressBar(total=max(duration, 1.0), completed=min(p["t"], duration), width=40)
        over = " (draining: every outbox empties)" if p["t"] > duration else ""
        table.add_row("fleet time", f"{fmt_time(p['t'])} / {fmt_time(duration)}{over}")
        table.add_row("", bar)
        table.add_row("devices online", f"{p['online']}/{p['devices']} (leader sees {_seen(p)},"
                                        f" {p['crashed']} crashed)")
        table.add_row("in flight", str(p["in_flight"]))
        table.add_row("outbox depth", f"{p['outbox_pending']} ({p['heartbeats_pending']} heartbeats)")
        table.add_row("leader mailbox", f"{p['leader_mailbox']}/{p['leader_mailbox_capacity']}")
        table.add_row("AIMD limit", f"min {p['aimd_limit_min']}, mean {p['aimd_limit_mean']}")
        table.add_row("jobs confirmed", f"{p['jobs_confirmed']}/{p['jobs_submitted']}")
        return table

    @staticmethod
    def _render_rollout(p: Sample) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        table.add_row("fleet time", fmt_time(p["t"]))
        table.add_row("devices online", f"{p['online']}/{p['devices']} (leader sees {p['leader_sees_online']})")
        table.add_row("in flight", f"{p['in_flight']} reports"
                      + (f", {p['downloads']} downloads (bound {p['download_bound']})" if p["download_bound"] else ""))
        table.add_row("outbox depth", str(p["outbox_pending"]))
        ro = p["rollout"]
        if ro is None:
            table.add_row("rollout", "not started: devices registering")
            return table
        table.add_row("rollout", f"{ro['state']}, wave {ro['wave']} of {ro['wave_count']}")
        if ro["detail"]:
            table.add_row("", ro["detail"])
        table.add_row("devices done", ProgressBar(total=max(1, ro["targeted"]), completed=ro["finished"], width=40))
        table.add_row("", f"{ro['finished']}/{ro['targeted']}  {fmt_counts(ro['counts'])}")
        waves = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for column in ("wave", "size", "state", "states"):
            waves.add_column(column, no_wrap=column != "states")
        for w in ro["waves"]:
            name = f"{w['number']}" + (" canary" if w["canary"] else "")
            style = "bold" if w["number"] == ro["wave"] else ""
            waves.add_row(name, str(w["size"]), w["state"], fmt_counts(w["counts"]) if w["counts"] else "",
                          style=style)
        return Group(table, waves)


__all__ = ["ProgressDisplay", "fmt_counts", "fmt_time", "plain_line", "rollout_line", "wave_name"]
