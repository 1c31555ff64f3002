"""Charts drawn by the server as inline SVG (no script, no library, nothing from a CDN): a
rollout's devices by state over time, and the fleet's devices online over time.

A chart is a stack of bands over sampled times: each band a kind (its CSS class picks the
colour: the same classes as the wave bars), its height the devices of that kind at each time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape

from agent.console.times import moment
from rollout_engine.store import IN_PROGRESS

WIDTH, HEIGHT, PAD = 640, 160, 28
SAMPLES = 160  # points across a chart

#: A device state -> the kind its band shows (the wave bar's kinds, and queued).
KIND_OF: dict[str, str] = {"succeeded": "succeeded", "failed": "failed", "rejected": "failed",
                           "timed_out": "failed", "rolled_back": "rolled_back", "canceled": "canceled",
                           **dict.fromkeys(IN_PROGRESS, "in_progress")}
KINDS = ("succeeded", "failed", "rolled_back", "canceled", "in_progress", "queued")


@dataclass(frozen=True, slots=True)
class Series:
    """Counts per kind at sampled times."""

    times_ms: list[int]
    bands: list[tuple[str, list[int]]]  # (kind, count at each time), bottom band first
    top: int  # the y axis' top


def rollout_series(created_ms: int, end_ms: int, devices: int, changes: Iterable[tuple[int, str, str]],
                   *, samples: int = SAMPLES, now: Mapping[str, str] | None = None) -> Series:
    """A rollout's devices by kind from its creation to `end_ms`: every device queued at the
    start, then each change (at_ms, device, new state) in time order. `now`, each device's state
    as the rollout's table has it, is the last point: a state no change recorded (devices never
    offered, canceled with their rollout) shows there as it does in the table."""
    end_ms = max(end_ms, created_ms + 1)
    times = [created_ms + (end_ms - created_ms) * i // (samples - 1) for i in range(samples)]
    kind_of_device: dict[str, str] = {}
    counts = dict.fromkeys(KINDS, 0)
    counts["queued"] = devices
    columns: list[dict[str, int]] = []
    pending = sorted(changes)
    at = 0
    for t in times:
        while at < len(pending) and pending[at][0] <= t:
            _, device, state = pending[at]
            at += 1
            old = kind_of_device.get(device, "queued")
            new = KIND_OF.get(state, "queued")
            if old != new:
                counts[old] = max(0, counts[old] - 1)
                counts[new] += 1
                kind_of_device[device] = new
        columns.append(dict(counts))
    if now is not None and columns:
        last = columns[-1]
        for device, state in now.items():
            old, new = kind_of_device.get(device, "queued"), KIND_OF.get(state, "queued")
            if old != new:
                last[old] = max(0, last[old] - 1)
                last[new] += 1
    return Series(times, [(k, [c[k] for c in columns]) for k in KINDS], max(1, devices))


def online_series(samples: Sequence[tuple[int, int, int]]) -> Series:
    """The fleet's devices online and offline at each sample (at_ms, devices, online)."""
    times = [a for a, _, _ in samples]
    online = [o for _, _, o in samples]
    offline = [max(0, d - o) for _, d, o in samples]
    return Series(times, [("online", online), ("offline", offline)], max([1, *(d for _, d, _ in samples)]))


def _clock(ms: int) -> str:
    return moment(ms)


def svg(series: Series, *, label: str) -> str:
    """The stacked bands as an `<svg>` element (escaped, safe to put in a page as is)."""
    times = series.times_ms
    if len(times) < 2:
        return f'<p class="muted">{escape(label)}: not enough history yet</p>'
    span = max(1, times[-1] - times[0])
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD

    def x(t: int) -> float:
        return PAD + inner_w * (t - times[0]) / span

    def y(n: float) -> float:
        return HEIGHT - PAD - inner_h * n / series.top

    parts = [f'<svg class="chart" role="img" aria-label="{escape(label)}" width="{WIDTH}" height="{HEIGHT}"'
             f' viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg">']
    below = [0] * len(times)
    for kind, values in series.bands:
        above = [b + v for b, v in zip(below, values, strict=True)]
        if any(values):
            upper = " ".join(f"{x(t):.1f},{y(a):.1f}" for t, a in zip(times, above, strict=True))
            lower = " ".join(f"{x(t):.1f},{y(b):.1f}" for t, b in reversed(list(zip(times, below, strict=True))))
            parts.append(f'<polygon class="area {escape(kind)}" points="{upper} {lower}">'
                         f'<title>{escape(kind.replace("_", " "))}: {values[-1]} now</title></polygon>')
        below = above
    parts.append(f'<line class="axis" x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}"/>')
    parts.append(f'<text x="{PAD}" y="{HEIGHT - 8}">{_clock(times[0])}</text>')
    parts.append(f'<text x="{WIDTH - PAD}" y="{HEIGHT - 8}" text-anchor="end">{_clock(times[-1])}</text>')
    parts.append(f'<text x="4" y="{PAD - 6}">{series.top}</text>')
    legend = "  ".join(f"{kind.replace('_', ' ')} {values[-1]}" for kind, values in series.bands if any(values))
    parts.append(f'<text x="{WIDTH - PAD}" y="{PAD - 10}" text-anchor="end">{escape(legend)}</text>')
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["KINDS", "KIND_OF", "Series", "online_series", "rollout_series", "svg"]
