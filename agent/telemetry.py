"""A reading of the device, cheap enough to take every few seconds on a Raspberry Pi.

`SystemSampler.sample()` never blocks and never raises. On Linux it reads `/proc` and `/sys`
itself, the way psutil does, so an idle worker does not carry psutil (2.6 MB of its resident
memory): CPU percent is the share of busy time in `/proc/stat` since the previous sample (primed
once at construction), memory is `/proc/meminfo`'s MemAvailable, disk is one `statvfs`, and the
temperature is the hottest CPU thermal zone or hwmon sensor. Elsewhere (a laptop running the
simulator) psutil answers, loaded at the first sample. Anything the platform cannot tell, or
that fails, reads as None.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from agent.core.clock import Clock
from agent.protocol import SystemSample

# Sensor names that mean "the SoC / CPU" on a Pi, x86 and common ARM boards, in that order.
_PREFERRED_SENSORS = ("cpu_thermal", "cpu-thermal", "coretemp", "k10temp", "soc_thermal", "acpitz")

_ERRORS = (OSError, RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError, IndexError)
PROC = Path("/proc")
SYS_CLASS = Path("/sys/class")


class Reading(NamedTuple):
    """One temperature sensor's reading, in psutil's shape (`sensors_temperatures()`)."""

    label: str
    current: float | None
    high: float | None = None
    critical: float | None = None


class Host:
    """What the sampler reads of the host; `LinuxHost` from /proc, `PsutilHost` elsewhere."""

    def cpu_times(self) -> tuple[float, float]:
        """(busy, total) seconds of all CPUs since boot."""
        raise NotImplementedError

    def memory(self) -> tuple[int, int]:
        """(total, available) bytes."""
        raise NotImplementedError

    def boot_time(self) -> float:
        raise NotImplementedError

    def temperatures(self) -> Mapping[str, Sequence[Any]]:
        raise NotImplementedError


class LinuxHost(Host):
    """The kernel's own files, read as psutil reads them."""

    def __init__(self, proc: Path = PROC, sys_class: Path = SYS_CLASS) -> None:
        self.proc = proc
        self.sys_class = sys_class

    def cpu_times(self) -> tuple[float, float]:
        with open(self.proc / "stat", "rb") as handle:
            fields = [int(v) for v in handle.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal guest guest_nice: guest time is counted
        # in user already, so total leaves it out; idle and iowait are not busy
        total = sum(fields[:8])
        busy = total - fields[3] - (fields[4] if len(fields) > 4 else 0)
        return float(busy), float(total)

    def memory(self) -> tuple[int, int]:
        values: dict[bytes, int] = {}
        with open(self.proc / "meminfo", "rb") as handle:
            for line in handle:
                name, _, rest = line.partition(b":")
                if name in (b"MemTotal", b"MemAvailable"):
                    values[name] = int(rest.split()[0]) * 1024
        return values[b"MemTotal"], values[b"MemAvailable"]

    def boot_time(self) -> float:
        with open(self.proc / "stat", "rb") as handle:
            for line in handle:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
        raise ValueError("no btime in /proc/stat")

    def temperatures(self) -> Mapping[str, Sequence[Any]]:
        found: dict[str, list[Reading]] = {}
        for zone in sorted(self.sys_class.glob("thermal/thermal_zone*")):
            with contextlib.suppress(*_ERRORS):
                name = (zone / "type").read_text().strip()
                found.setdefault(name, []).append(Reading("", int((zone / "temp").read_text()) / 1000.0))
        for hwmon in sorted(self.sys_class.glob("hwmon/hwmon*")):
            with contextlib.suppress(*_ERRORS):
                name = (hwmon / "name").read_text().strip()
                for sensor in sorted(hwmon.glob("temp*_input")):
                    with contextlib.suppress(*_ERRORS):
                        found.setdefault(name, []).append(Reading("", int(sensor.read_text()) / 1000.0))
        return found


class PsutilHost(Host):
    """psutil's answers, for hosts without Linux's /proc (its errors read as OSError)."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil

    def _ask(self, name: str) -> Any:
        try:
            return getattr(self.psutil, name)()
        except self.psutil.Error as exc:
            raise OSError(str(exc)) from exc

    def cpu_times(self) -> tuple[float, float]:
        t = self._ask("cpu_times")
        idle = float(t.idle) + float(getattr(t, "iowait", 0.0))
        total = sum(float(v) for k, v in t._asdict().items() if k not in ("guest", "guest_nice"))
        return total - idle, total

    def memory(self) -> tuple[int, int]:
        vm = self._ask("virtual_memory")
        return int(vm.total), int(vm.available)

    def boot_time(self) -> float:
        return float(self._ask("boot_time"))

    def temperatures(self) -> Mapping[str, Sequence[Any]]:
        if not hasattr(self.psutil, "sensors_temperatures"):
            return {}
        return dict(self._ask("sensors_temperatures"))


def this_host() -> Host:
    return LinuxHost() if (PROC / "stat").is_file() and (PROC / "meminfo").is_file() else PsutilHost()


def _existing_dir(path: Path) -> Path:
    """The nearest existing ancestor of `path` (the data dir may not exist yet)."""
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path(os.sep)


def pick_temperature(sensors: Mapping[str, Sequence[Any]]) -> float | None:
    """The CPU temperature from readings in psutil's `sensors_temperatures()` shape, in degrees C."""
    if not sensors:
        return None
    names = [n for n in _PREFERRED_SENSORS if n in sensors] + sorted(
        n for n in sensors if n not in _PREFERRED_SENSORS
    )
    for name in names:
        readings = [float(r.current) for r in sensors[name] if r.current is not None]
        readings = [r for r in readings if -60.0 < r < 200.0]  # drop sensor garbage
        if readings:
            return max(readings)
    return None


class SystemSampler:
    """Takes `SystemSample`s of this host. Not thread-safe; one per agent."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        clock: Clock,
        temperatures: Callable[[], Mapping[str, Sequence[Any]]] | None = None,
        host: Host | None = None,
    ) -> None:
        self._clock = clock
        self._disk_path = str(_existing_dir(Path(data_dir)))
        self._host = host or this_host()
        self._temperatures = temperatures or self._host.temperatures
        self._boot_time_s: float | None = None
        self._cpu: tuple[float, float] | None = None
        with contextlib.suppress(*_ERRORS):
            self._boot_time_s = self._host.boot_time()
        with contextlib.suppress(*_ERRORS):
            self._cpu = self._host.cpu_times()  # prime: the first sample's share runs from here

    def _cpu_percent(self) -> float | None:
        busy, total = self._host.cpu_times()
        before, self._cpu = self._cpu, (busy, total)
        if before is None or total <= before[1]:
            return None if before is None else 0.0
        return max(0.0, min(100.0, 100.0 * (busy - before[0]) / (total - before[1])))

    def sample(self) -> SystemSample:
        cpu = mem_total = mem_avail = mem_pct = None
        disk_total = disk_free = disk_pct = None
        load: tuple[float | None, float | None, float | None] = (None, None, None)
        with contextlib.suppress(*_ERRORS):
            cpu = self._cpu_percent()
        with contextlib.suppress(*_ERRORS):
            mem_total, mem_avail = self._host.memory()
            mem_pct = round(100.0 * (mem_total - mem_avail) / mem_total, 1)
        with contextlib.suppress(*_ERRORS):
            st = os.statvfs(self._disk_path)
            disk_total, disk_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            disk_pct = round(100.0 * used / (used + disk_free), 1) if used + disk_free else 0.0
        with contextlib.suppress(*_ERRORS):
            one, five, fifteen = os.getloadavg()
            load = (float(one), float(five), float(fifteen))
        return SystemSample(
            cpu_percent=cpu,
            mem_total_bytes=mem_total,
            mem_available_bytes=mem_avail,
            mem_percent=mem_pct,
            disk_total_bytes=disk_total,
            disk_free_bytes=disk_free,
            disk_percent=disk_pct,
            load_1m=load[0],
            load_5m=load[1],
            load_15m=load[2],
            temperature_c=self._temperature(),
            uptime_s=self._uptime_s(),
        )

    def _temperature(self) -> float | None:
        if self._temperatures is None:
            return None
        try:
            return pick_temperature(self._temperatures())
        except _ERRORS:
            return None

    def _uptime_s(self) -> float | None:
        if self._boot_time_s is None:
            return None
        return max(0.0, self._clock.now_ms() / 1000.0 - self._boot_time_s)


__all__ = ["Host", "LinuxHost", "PsutilHost", "Reading", "SystemSampler", "pick_temperature", "this_host"]
