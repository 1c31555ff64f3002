"""Progress while a simulation runs: a live rich panel on a terminal, plain lines otherwise."""

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


def plain_line(p: Sample) -> str:
    return (f"t={fmt_time(p['t'])} online={p['online']}/{p['devices']} leader_sees={p['leader_sees_online']}"
            f" in_flight={p['in_flight']} outbox_pending={p['outbox_pending']}"
            f" leader_mailbox={p['leader_mailbox']}/{p['leader_mailbox_capacity']} aimd={p['aimd_limit_min']}"
            f" jobs_confirmed={p['jobs_confirmed']}/{p['jobs_submitted']}")


class ProgressDisplay:
    """Call with each sample. Use as a context manager (the live panel ends on exit)."""

    def __init__(self, *, duration_s: float, stream: TextIO | None = None, live: bool | None = None) -> None:
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
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        bar = ProgressBar(total=max(self._duration_s, 1.0), completed=min(p["t"], self._duration_s), width=40)
        table.add_row("fleet time", f"{fmt_time(p['t'])} / {fmt_time(self._duration_s)}")
        table.add_row("", bar)
        table.add_row("devices online", f"{p['online']}/{p['devices']} (leader sees {p['leader_sees_online']},"
                                        f" {p['crashed']} crashed)")
        table.add_row("in flight", str(p["in_flight"]))
        table.add_row("outbox depth", f"{p['outbox_pending']} ({p['heartbeats_pending']} heartbeats)")
        table.add_row("leader mailbox", f"{p['leader_mailbox']}/{p['leader_mailbox_capacity']}")
        table.add_row("AIMD limit", f"min {p['aimd_limit_min']}, mean {p['aimd_limit_mean']}")
        table.add_row("jobs confirmed", f"{p['jobs_confirmed']}/{p['jobs_submitted']}")
        self._live.update(table)


__all__ = ["ProgressDisplay", "fmt_time", "plain_line"]
