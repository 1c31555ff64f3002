"""A psutil reading of the device, cheap enough to take every few seconds on a Raspberry Pi.

`SystemSampler.sample()` never blocks and never raises: CPU percent is psutil's non-blocking
`cpu_percent(interval=None)` (the share since the previous call; the sampler primes it once at
construction), memory and disk are single syscalls, and the temperature sensors are read only
where psutil supports them. Anything the platform cannot tell, or that fails, reads as None.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from agent.core.clock import Clock
from agent.protocol import SystemSample

# Sensor names that mean "the SoC / CPU" on a Pi, x86 and common ARM boards, in that order.
_PREFERRED_SENSORS = ("cpu_thermal", "cpu-thermal", "coretemp", "k10temp", "soc_thermal", "acpitz")

_ERRORS = (
    OSError, psutil.Error, RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError
)


def _existing_dir(path: Path) -> Path:
    """The nearest existing ancestor of `path` (the data dir may not exist yet)."""
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path(os.sep)


def pick_temperature(sensors: Mapping[str, Sequence[Any]]) -> float | None:
    """The CPU temperature from psutil's `sensors_temperatures()` output, in degrees C."""
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
    ) -> None:
        self._clock = clock
        self._disk_path = str(_existing_dir(Path(data_dir)))
        if temperatures is None:
            temperatures = getattr(psutil, "sensors_temperatures", None)
        self._temperatures = temperatures
        self._boot_time_s: float | None = None
        with contextlib.suppress(*_ERRORS):
            self._boot_time_s = float(psutil.boot_time())
        with contextlib.suppress(*_ERRORS):
            psutil.cpu_percent(interval=None)  # prime: the first non-blocking call returns 0.0

    def sample(self) -> SystemSample:
        cpu = mem_total = mem_avail = mem_pct = None
        disk_total = disk_free = disk_pct = None
        load: tuple[float | None, float | None, float | None] = (None, None, None)
        with contextlib.suppress(*_ERRORS):
            cpu = float(psutil.cpu_percent(interval=None))
        with contextlib.suppress(*_ERRORS):
            vm = psutil.virtual_memory()
            mem_total, mem_avail, mem_pct = int(vm.total), int(vm.available), float(vm.percent)
        with contextlib.suppress(*_ERRORS):
            du = psutil.disk_usage(self._disk_path)
            disk_total, disk_free, disk_pct = int(du.total), int(du.free), float(du.percent)
        with contextlib.suppress(*_ERRORS):
            one, five, fifteen = psutil.getloadavg()
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


__all__ = ["SystemSampler", "pick_temperature"]
