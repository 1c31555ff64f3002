import os
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from agent.core.clock import VirtualClock
from agent.core.codec import decode, encode
from agent.protocol import SystemSample
from agent.telemetry import Host, LinuxHost, PsutilHost, Reading, SystemSampler, pick_temperature

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


def _proc(root: Path, stat: str, meminfo: str) -> Path:
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc" / "stat").write_text(stat)
    (root / "proc" / "meminfo").write_text(meminfo)
    return root / "proc"


def test_cpu_percent_is_the_busy_share_since_the_last_sample(tmp_path: Path) -> None:
    meminfo = "MemTotal:        1000 kB\nMemFree:  10 kB\nMemAvailable:     250 kB\n"
    # user nice system idle iowait irq softirq steal guest guest_nice
    proc = _proc(tmp_path, "cpu  100 0 100 700 100 0 0 0 50 0\nbtime 1700000000\n", meminfo)
    sampler = SystemSampler("/", clock=VirtualClock(), host=LinuxHost(proc, tmp_path / "sys"))
    (proc / "stat").write_text("cpu  130 0 120 740 110 0 0 0 80 0\nbtime 1700000000\n")  # +50 busy of +100
    sample = sampler.sample()
    assert sample.cpu_percent == 50.0  # never a blocking interval: the share since construction
    assert sample.mem_total_bytes == 1_024_000 and sample.mem_available_bytes == 256_000
    assert sample.mem_percent == 75.0
    assert sampler.sample().cpu_percent == 0.0  # nothing moved since


def test_linux_readings_agree_with_psutil() -> None:
    host = LinuxHost()
    total, available = host.memory()
    assert total == psutil.virtual_memory().total
    assert 0 < available <= total
    assert host.boot_time() == pytest.approx(psutil.boot_time(), abs=1.0)
    assert PsutilHost().memory()[0] == total


def test_an_unreadable_host_reads_as_none(tmp_path: Path) -> None:
    sampler = SystemSampler("/", clock=VirtualClock(), host=LinuxHost(tmp_path / "none", tmp_path / "none"))
    sample = sampler.sample()
    assert sample.cpu_percent is None and sample.mem_total_bytes is None and sample.uptime_s is None
    assert sample.temperature_c is None
    assert sample.disk_total_bytes  # statvfs of / still answers


def test_thermal_zones_and_hwmon_are_read(tmp_path: Path) -> None:
    zone = tmp_path / "sys" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("cpu-thermal\n")
    (zone / "temp").write_text("47250\n")
    hwmon = tmp_path / "sys" / "hwmon" / "hwmon1"
    hwmon.mkdir(parents=True)
    (hwmon / "name").write_text("nvme\n")
    (hwmon / "temp1_input").write_text("61000\n")
    readings = LinuxHost(tmp_path / "proc", tmp_path / "sys").temperatures()
    assert readings == {"cpu-thermal": [Reading("", 47.25)], "nvme": [Reading("", 61.0)]}
    assert pick_temperature(readings) == 47.25


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


class BrokenHost(Host):
    def cpu_times(self) -> tuple[float, float]:
        raise OSError("no /proc here")

    def memory(self) -> tuple[int, int]:
        raise ValueError("no MemAvailable")

    def boot_time(self) -> float:
        raise OSError("no btime")

    def temperatures(self) -> dict:
        raise OSError("sensor driver gone")


def test_failing_sources_read_as_none_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise OSError("gone")

    monkeypatch.setattr(os, "statvfs", broken)
    monkeypatch.setattr(os, "getloadavg", broken)
    sample = SystemSampler("/", clock=VirtualClock(), host=BrokenHost()).sample()
    assert sample == SystemSample()


def test_psutil_errors_read_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> object:
        raise psutil.Error("sensor driver gone")

    for name in ("virtual_memory", "cpu_times", "boot_time", "sensors_temperatures"):
        monkeypatch.setattr(psutil, name, broken)
    sample = SystemSampler("/", clock=VirtualClock(), host=PsutilHost()).sample()
    assert sample.cpu_percent is None and sample.mem_total_bytes is None and sample.temperature_c is None


def test_platform_without_sensors_temperatures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(psutil, "sensors_temperatures", raising=False)
    assert SystemSampler("/", clock=VirtualClock(), host=PsutilHost()).sample().temperature_c is None
