"""Structured logs to stdout: `key=value` or JSON lines, friendly to journald.

    level=info logger=agent.transport msg="connected" broker=mqtt://10.0.0.2:8883

Fields travel in `extra={"kv": {...}}` (or `extra=fields(...)`). Under systemd, stdout is a
journal stream (`$JOURNAL_STREAM` names its device and inode): then lines carry a `<N>` syslog
priority prefix so `journalctl -p warning` works, and no timestamp, since journald stamps every
line itself. Elsewhere lines start with an ISO-8601 UTC timestamp.

Nothing should log per heartbeat at INFO: periodic events go through `RateLimitedLog`, which
lets one line per key through per interval and reports how many it held back.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal, TextIO

from agent.core.errors import ConfigError
from agent.core.ratelog import RateLimitedLog

LogFormat = Literal["kv", "json"]

# syslog priorities (sd-daemon.h): what journald reads from a `<N>` prefix
_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}

HANDLER_NAME = "edge-agent"
RECENT_NAME = "edge-agent-recent"
RECENT_LINES = 400  # the newest lines the process keeps for a failure's excerpt
RECENT_LINE_MAX = 600


def syslog_priority(levelno: int) -> int:
    for threshold in (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO):
        if levelno >= threshold:
            return _PRIORITY[threshold]
    return 7


def fields(**kv: Any) -> dict[str, Any]:
    """`logger.info("msg", extra=fields(device=d, seq=n))`."""
    return {"kv": kv}


def _needs_quotes(text: str) -> bool:
    return not text or any(c in text for c in ' ="\\') or not text.isprintable()


def format_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if not _needs_quotes(text):
        return text
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    )
    escaped = escaped.replace("\t", "\\t")
    return f'"{escaped}"'


def _timestamp(record: logging.LogRecord) -> str:
    secs = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{secs}.{int(record.msecs):03d}Z"


class _Base(logging.Formatter):
    def __init__(self, *, timestamps: bool = True, syslog_prefix: bool = False) -> None:
        super().__init__()
        self.timestamps = timestamps
        self.syslog_prefix = syslog_prefix

    def _pairs(self, record: logging.LogRecord) -> list[tuple[str, Any]]:
        pairs: list[tuple[str, Any]] = []
        if self.timestamps:
            pairs.append(("ts", _timestamp(record)))
        pairs.append(("level", record.levelname.lower()))
        pairs.append(("logger", record.name))
        pairs.append(("msg", record.getMessage()))
        extra = getattr(record, "kv", None)
        if isinstance(extra, Mapping):
            pairs.extend((str(k), v) for k, v in extra.items())
        if record.exc_info:
            pairs.append(("exc", self.formatException(record.exc_info)))
        elif record.exc_text:
            pairs.append(("exc", record.exc_text))
        return pairs

    def _prefix(self, record: logging.LogRecord) -> str:
        return f"<{syslog_priority(record.levelno)}>" if self.syslog_prefix else ""


class KeyValueFormatter(_Base):
    """One line per record; values with spaces, quotes or newlines are quoted and escaped."""

    def format(self, record: logging.LogRecord) -> str:
        body = " ".join(f"{k}={format_value(v)}" for k, v in self._pairs(record))
        return self._prefix(record) + body


class JsonFormatter(_Base):
    """One JSON object per line (non-JSON values are rendered with `str`)."""

    def format(self, record: logging.LogRecord) -> str:
        body = json.dumps(dict(self._pairs(record)), default=str, ensure_ascii=False)
        return self._prefix(record) + body


def journal_stream_matches(stream: TextIO, env: Mapping[str, str] | None = None) -> bool:
    """True when `stream` is the journal stream systemd connected us to (`$JOURNAL_STREAM` is
    `device:inode` of it). A redirected stdout inside a unit does not count."""
    environ = os.environ if env is None else env
    value = environ.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


class RecentLog(logging.Handler):
    """The process's newest log lines in memory (`RECENT_LINES`, each cut at `RECENT_LINE_MAX`):
    what a failed update's report attaches (`agent.worker.failure_logs`). Lines are formatted
    when logged, so the memory they take is bounded whatever the records held."""

    def __init__(self, maxlen: int = RECENT_LINES) -> None:
        super().__init__(logging.INFO)
        self.set_name(RECENT_NAME)
        self.setFormatter(KeyValueFormatter(timestamps=True))
        self._lines: deque[tuple[int, str]] = deque(maxlen=maxlen)
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)[:RECENT_LINE_MAX]
        except Exception:  # a record that cannot be formatted is not worth a failure here
            return
        with self._guard:
            self._lines.append((int(record.created * 1000), line))

    def since(self, since_ms: int) -> list[str]:
        """The kept lines logged at or after `since_ms` (wall clock), oldest first."""
        with self._guard:
            return [line for at, line in self._lines if at >= since_ms]


def recent_log() -> RecentLog | None:
    """The process's `RecentLog` (None: logging was not set up by `setup_logging`)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RecentLog):
            return handler
    return None


def setup_logging(
    level: str = "INFO",
    *,
    fmt: LogFormat = "kv",
    stream: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    journald: bool | None = None,
    quiet_libraries: bool = True,
) -> logging.Handler:
    """Configure the root logger once (calling again replaces our handler, not others').

    `journald=None` detects it from `$JOURNAL_STREAM`.
    """
    out = sys.stdout if stream is None else stream
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError("logging", "level", f"unknown log level {level!r}")
    under_journal = journal_stream_matches(out, env) if journald is None else journald
    formatter_cls = JsonFormatter if fmt == "json" else KeyValueFormatter
    handler = logging.StreamHandler(out)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(formatter_cls(timestamps=not under_journal, syslog_prefix=under_journal))
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() in (HANDLER_NAME, RECENT_NAME):
            root.removeHandler(old)
    root.addHandler(handler)
    root.addHandler(RecentLog())
    root.setLevel(numeric)
    if quiet_libraries:
        # paho/aiomqtt narrate every packet at DEBUG; asyncio debug is for development; httpx
        # logs every request at INFO (a download from a mirror: one line per chunk)
        for name in ("paho", "aiomqtt", "asyncio", "httpx", "httpcore"):
            logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    return handler


__all__ = [
    "HANDLER_NAME",
    "JsonFormatter",
    "KeyValueFormatter",
    "LogFormat",
    "RECENT_NAME",
    "RateLimitedLog",
    "RecentLog",
    "fields",
    "format_value",
    "journal_stream_matches",
    "recent_log",
    "setup_logging",
    "syslog_priority",
]
