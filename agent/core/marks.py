"""A store's high-water mark, kept in a small file beside it (`outbox.db.mark`).

A database file can lose committed state without being damaged: a power cut through a disk that
acknowledges writes it never made, a file system repaired by fsck, an old copy restored, the
tables never synced before the cut. SQLite then opens it as sound, and a store would go on with
less than it acknowledged, silently. The mark records, only at moments the store's state is on
the disk (after a synced commit, at a clean close), a counter that only grows (the outbox's
`enqueued`, the job queue's epoch); at the next open a file whose tables are gone, or whose
counter is below the mark, has lost state (`lost_state`). The mark is written atomically (a new
file, fsynced, renamed over the old one); a mark that cannot be written costs the check, never
the store's work.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from agent.core.durations import utc_iso
from agent.core.files import atomic_write
from agent.core.sqlite import aside_name, move_aside

log = logging.getLogger(__name__)


class StoreMark:
    """The mark of the database at `db` (its file: `db` + ".mark")."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.path = db.with_name(db.name + ".mark")

    def read(self) -> dict[str, int] | None:
        """The last mark, or None (no mark yet; an unreadable one is logged and ignored)."""
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable, ignored: %s", self.path, exc)
            return None
        if not isinstance(data, dict) or not all(isinstance(v, int) for v in data.values()):
            log.warning("%s: not a mark, ignored", self.path)
            return None
        return {str(k): int(v) for k, v in data.items()}

    def write(self, counter: str, value: int, *, at_ms: int | None = None) -> bool:
        """Record `counter` = `value` (call only when the store's state is on the disk)."""
        data = {counter: int(value), "at_ms": int(at_ms if at_ms is not None else time.time() * 1000)}
        try:
            atomic_write(self.path, json.dumps(data).encode(), mode=0o600)
        except OSError as exc:
            log.warning("%s: cannot write the mark (%s); the next start cannot check for lost state",
                        self.path, exc.strerror or exc)
            return False
        return True

    def lost_state(self, counter: str, found: int | None) -> str | None:
        """Why the store at `db` lost state, or None: `found` is its `counter` now (None: the
        file or its tables are gone)."""
        mark = self.read()
        if mark is None or counter not in mark:
            return None
        then = utc_iso(mark.get("at_ms", 0))
        if found is None:
            return f"its tables are gone (on {then} it held {counter} {mark[counter]})"
        if found < mark[counter]:
            return f"its {counter} went back to {found} (it was {mark[counter]} on {then})"
        return None

    def move_lost(self, now_ms: int) -> Path:
        """Move the store that lost state (its file, if it is there, with its -wal and -shm) and
        this mark aside as evidence (`NAME.lost-{UTC time}`); where it went."""
        db = self.db
        dest = move_aside(db, now_ms, "lost") if db.exists() else aside_name(db, now_ms, "lost")
        self.set_aside(dest)
        return dest

    def set_aside(self, dest: Path) -> None:
        """Move the mark beside a store moved aside (the evidence keeps its mark)."""
        try:
            os.replace(self.path, dest.with_name(dest.name + ".mark"))
        except OSError:
            pass


__all__ = ["StoreMark"]
