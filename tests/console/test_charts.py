"""The server-drawn charts: every device is in exactly one band at every sampled time, the last
column is where each device ended, and the SVG carries no text of a device's unescaped."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.console.charts import KIND_OF, KINDS, online_series, rollout_series, svg
from rollout_engine.store import DEVICE_STATES

DEVICES = [f"d{i}" for i in range(6)]
changes = st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(DEVICES), st.sampled_from(DEVICE_STATES)),
                   max_size=60)


@given(changes)
def test_every_device_is_in_one_band_at_every_time(events: list[tuple[int, str, str]]) -> None:
    series = rollout_series(0, 10_000, len(DEVICES), events, samples=40)
    assert [k for k, _ in series.bands] == list(KINDS)
    for column in zip(*(values for _, values in series.bands), strict=True):
        assert sum(column) == len(DEVICES) and min(column) >= 0
    last: dict[str, str] = {}
    for _, device, state in sorted(events):
        last[device] = KIND_OF.get(state, "queued")
    ended = {kind: values[-1] for kind, values in series.bands}
    for kind in KINDS:
        expected = sum(1 for d in DEVICES if last.get(d, "queued") == kind)
        assert ended[kind] == expected, kind


def test_the_fleet_chart_stacks_online_over_offline_and_escapes_its_label() -> None:
    series = online_series([(0, 3, 1), (30_000, 4, 4), (60_000, 4, 2)])
    assert series.bands == [("online", [1, 4, 2]), ("offline", [2, 0, 2])] and series.top == 4
    drawn = svg(series, label="<script>x</script>")
    assert drawn.startswith('<svg class="chart"') and "<script>" not in drawn and "&lt;script&gt;" in drawn
    assert drawn.count("<polygon") == 2 and "online 2  offline 2" in drawn
    assert "not enough history yet" in svg(online_series([(0, 1, 1)]), label="one sample")


@given(changes, st.dictionaries(st.sampled_from(DEVICES), st.sampled_from(DEVICE_STATES)))
def test_the_last_column_is_the_table_whatever_the_changes_recorded(events: list[tuple[int, str, str]],
                                                                   table: dict[str, str]) -> None:
    """A rollout canceled with devices never offered has no change for them: the chart's last
    column (its legend) still counts each device in its state now, as the table does."""
    now = {d: table.get(d, "queued") for d in DEVICES}
    series = rollout_series(0, 10_000, len(DEVICES), events, samples=40, now=now)
    ended = {kind: values[-1] for kind, values in series.bands}
    for kind in KINDS:
        assert ended[kind] == sum(1 for d in DEVICES if KIND_OF.get(now[d], "queued") == kind), kind
    for column in zip(*(values for _, values in series.bands), strict=True):
        assert sum(column) == len(DEVICES)


def test_a_short_span_has_two_different_axis_labels_to_the_second() -> None:
    drawn = svg(online_series([(1_700_000_000_000, 5, 0), (1_700_000_030_000, 5, 5)]), label="online")
    labels = [part.split(">", 1)[1].split("<", 1)[0] for part in drawn.split("<text")[1:3]]
    assert labels[0] != labels[1] and all(len(label) == len("2023-11-14 22:13:20") for label in labels), labels
