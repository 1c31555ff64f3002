"""The device's own count of how its agent runs on its firmware: the seconds it ran and its
unexpected restarts there (`DeviceHealth` in its heartbeats; the fleet's healthy hours per release
are made of them).

    open ─► the record says the run before did not stop (`running`): one unexpected restart of
    │       the firmware it ran (a crash, a kill, a power cut, a watchdog) ─► `running` written
    ├─► stated(firmware) ─► the seconds since the last count added; a firmware other than the
    │       record's starts the count again at zero (what a release is judged by is its own), and
    │       is written at once (a crash from then on is charged to it)
    └─► close (a clean stop: systemd's, an update's reboot) ─► counted, `running` cleared

`health.json` in the data directory, one typed document written atomically: at the open, at most
every `FLUSH_S` while it runs, and at the close, so a card is not worn by it and a power cut
loses at most `FLUSH_S` of counted time (never the restart: `running` was written at the open).
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from agent.core.clock import Clock
from agent.core.files import atomic_write
from agent.protocol import DeviceHealth

log = logging.getLogger(__name__)

FILE = "health.json"
FLUSH_S = 3600.0  # the longest a running count goes unwritten (one small write an hour)


class _Record(msgspec.Struct, frozen=True):
    firmware: str = ""
    operating_s: float = 0.0
    unexpected_restarts: int = 0
    running: bool = False  # written at the open, cleared at a clean close


class HealthLedger:
    """The count of one agent process, over the record its earlier runs left."""

    def __init__(self, data_dir: Path, clock: Clock) -> None:
        self.path = data_dir / FILE
        self.clock = clock
        self._record = _Record()
        self._mark = clock.monotonic()  # counted up to here
        self._flushed = self._mark
        self.restarted_unexpectedly = False  # this start found the run before not stopped

    def open(self) -> None:
        record = self._read()
        if record.running:
            self.restarted_unexpectedly = True
            record = msgspec.structs.replace(record, unexpected_restarts=record.unexpected_restarts + 1)
            log.warning("the agent's previous run on firmware %s did not stop cleanly (a crash, a kill or a power"
                        " cut): %d unexpected restarts on it", record.firmware or "(not known)",
                        record.unexpected_restarts)
        self._record = msgspec.structs.replace(record, running=True)
        self._mark = self._flushed = self.clock.monotonic()
        self._write()

    def stated(self, firmware: str) -> DeviceHealth | None:
        """The count for `firmware` up to now (None: the firmware is not known yet)."""
        if not firmware:
            return None
        named = firmware == self._record.firmware
        self._count(firmware)
        if not named or self.clock.monotonic() - self._flushed >= FLUSH_S:  # (a crash is charged to it now)
            self._write()
        r = self._record
        return DeviceHealth(firmware=r.firmware, operating_s=round(r.operating_s, 1),
                            unexpected_restarts=r.unexpected_restarts)

    def close(self) -> None:
        """A clean stop: what ran is counted and the record no longer says running."""
        if self._record.firmware:
            self._count(self._record.firmware)
        self._record = msgspec.structs.replace(self._record, running=False)
        self._write()

    def _count(self, firmware: str) -> None:
        now = self.clock.monotonic()
        ran, self._mark = max(0.0, now - self._mark), now
        r = self._record
        if not r.firmware:  # the first firmware known: the count so far is its (a crash before it too)
            r = msgspec.structs.replace(r, firmware=firmware)
        elif firmware != r.firmware:  # a new firmware: its own count, from this run on
            r = _Record(firmware=firmware, running=r.running)
        self._record = msgspec.structs.replace(r, operating_s=r.operating_s + ran)

    def _read(self) -> _Record:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=_Record)
        except FileNotFoundError:
            return _Record()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: unreadable (%s): the count starts again", self.path, exc)
            return _Record()

    def _write(self) -> None:
        try:
            atomic_write(self.path, msgspec.json.encode(self._record), mode=0o600)
        except OSError as exc:  # a full disk: the heartbeat goes on, the count is written later
            log.warning("%s: not written: %s", self.path, exc)
        self._flushed = self.clock.monotonic()


__all__ = ["FILE", "FLUSH_S", "HealthLedger"]
