from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from agent.core.clock import VirtualClock
from agent.core.codec import decode, encode
from agent.protocol import SystemSample
from agent.telemetry import SystemSampler, pick_temperature

Temp = namedtuple("Temp", "label current high critical")


def test_sample_reads_this_host(tmp_path: Path) -> None:
    sampler = SystemSampler(tmp_path / "not" / "created" / "yet", clock=VirtualClock())
    sample = sampler.sample()
    assert isinstance(sample, SystemSample)
    assert sample.cpu_percent is not None
    assert 0.0 <= sample.cpu_percent <= 100.0 * (psutil.cpu_count() or 1)
    assert sample.mem_total_bytes and sample.mem_total_bytes > 0
    assert sample.mem_available_bytes is not None
    assert 0 < sample.mem_available_bytes <= sample.mem_total_bytes
    assert sample.disk_total_bytes and sample.disk_free_bytes is not None
    assert 0 <= sample.disk_free_bytes <= sample.disk_total_bytes
    assert sample.load_1m is not None and sample.load_1m >= 0.0
    assert decode(encode(sample), SystemSample) == sample


def test_disk_usage_is_of_the_data_dir_filesystem(tmp_path: Path) -> None:
    sample = SystemSampler(tmp_path, clock=VirtualClock()).sample()
    assert sample.disk_total_bytes == psutil.disk_usage(str(tmp_path)).total


def test_uptime_comes_from_the_clock() -> None:
    boot_ms = int(psutil.boot_time() * 1000)
    clock = VirtualClock(start_ms=boot_ms + 90_000)
    sampler = SystemSampler("/", clock=clock)
    assert sampler.sample().uptime_s == pytest.approx(90.0, abs=0.01)


def test_cpu_percent_is_non_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def fake_cpu_percent(interval: object = None) -> float:
        calls.append(interval)
        return 42.0

    monkeypatch.setattr(psutil, "cpu_percent", fake_cpu_percent)
    sample = SystemSampler("/", clock=VirtualClock()).sample()
    assert sample.cpu_percent == 42.0
    assert calls == [None, None]  # primed once, then read; never a blocking interval


def test_temperature_picks_the_cpu_sensor() -> None:
    sensors = {
        "nvme": [Temp("Composite", 61.0, 80.0, 90.0)],
        "cpu_thermal": [Temp("", 47.2, None, None)],
    }
    sampler = SystemSampler("/", clock=VirtualClock(), temperatures=lambda: sensors)
    assert sampler.sample().temperature_c == 47.2
    assert pick_temperature({"acpitz": [Temp("", 30.0, None, None), Temp("", 35.5, None, None)]}) \
        == 35.5


def test_temperature_garbage_and_absence_read_as_none() -> None:
    assert pick_temperature({}) is None
    assert pick_temperature({"x": [Temp("", -273.0, None, None), Temp("", None, None, None)]}) is None
    sampler = SystemSampler("/", clock=VirtualClock(), temperatures=lambda: {})
    assert sampler.sample().temperature_c is None


def test_failing_sources_read_as_none_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise OSError("no /proc here")

    def broken_sensors() -> dict:
        raise psutil.Error("sensor driver gone")

    for name in ("virtual_memory", "disk_usage", "getloadavg", "cpu_percent", "boot_time"):
        monkeypatch.setattr(psutil, name, broken)
    sample = SystemSampler("/", clock=VirtualClock(), temperatures=broken_sensors).sample()
    assert sample == SystemSample()


def test_platform_without_sensors_temperatures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(psutil, "sensors_temperatures", raising=False)
    assert SystemSampler("/", clock=VirtualClock()).sample().temperature_c is None
