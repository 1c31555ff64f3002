"""The log lines a failed update's report carries, so the operator sees why without asking.

    a report `failed` or `rolled_back`
        └─► FailureLogs(units, since_ms)
              the agent's own log since the update began (`agent.service.logs.RecentLog`)
            + the journal of the units the update touched (`agent.service.journal`)
            ─► every line redacted (`agent.core.redact`: secrets by shape, and the device's own
               secrets by value: its broker password, claim credential, enrolment token)
            ─► the newest lines that fit: `EXCERPT_LINES_MAX` lines, `EXCERPT_LINE_MAX`
               characters each, `EXCERPT_BYTES_MAX` in all (a metered link pays for every byte)

It reads the journal only on a failure, once per report, within `journal.JOURNAL_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from agent.core.config import AgentConfig
from agent.core.redact import redact, redact_lines
from agent.service.journal import journal_lines
from agent.service.logs import recent_log

log = logging.getLogger(__name__)

EXCERPT_BYTES_MAX = 12 * 1024
JOURNAL_LINES = 40  # of the units involved; the rest of the budget is the agent's own lines
LEAD_MS = 60_000  # lines from this long before the update began: what led up to it


def secret_literals(config: AgentConfig) -> list[str]:
    """The device's own secrets, as text: the files its config names for them."""
    found: list[str] = []
    identity = config.identity
    paths = [config.mqtt.password_file]
    if identity is not None:
        paths += [identity.claim_password_file, identity.token_file]
    for path in paths:
        if not path:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            continue
        if text:
            found.append(text[:4096])
    return found


def fit(lines: list[str], *, max_lines: int, line_max: int, max_bytes: int) -> tuple[str, ...]:
    """The newest of `lines` that fit: `max_lines` lines of at most `line_max` characters (cut
    longer), `max_bytes` in all."""
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        cut = line if len(line) <= line_max else line[:line_max - 1] + "…"
        size += len(cut.encode()) + 1
        if len(kept) >= max_lines or size > max_bytes:
            break
        kept.append(cut)
    return tuple(reversed(kept))


class FailureLogs:
    """An `ExcerptSource` over this process's log and the journal."""

    def __init__(self, config: AgentConfig, *, journal: bool = True) -> None:
        self._config = config
        self._journal = journal

    def redact(self, text: str) -> str:
        return redact(text, self._literals())

    def _literals(self) -> list[str]:
        try:
            return secret_literals(self._config)
        except Exception as exc:  # never a lost report for want of an excerpt
            log.warning("the device's secrets could not be read for redaction: %s", exc)
            return []

    async def explain(self, detail: str, units: tuple[str, ...], since_ms: int) -> tuple[str, tuple[str, ...]]:
        """`detail` redacted and the excerpt, the device's secrets read once for both."""
        literals = self._literals()
        return redact(detail, literals), await self.excerpt(units, since_ms, literals)

    async def excerpt(self, units: tuple[str, ...], since_ms: int,
                      literals: list[str] | None = None) -> tuple[str, ...]:
        """The lines that explain a failure: the agent's and `units`' since `since_ms`, redacted
        (`literals`: the device's secrets, when the caller has read them), bounded."""
        from rollout_engine.messages import EXCERPT_LINE_MAX, EXCERPT_LINES_MAX  # (on a failure only)

        since = max(0, since_ms - LEAD_MS)
        ring = recent_log()
        own = ring.since(since) if ring is not None else []
        journal = await journal_lines(units, since_ms=since, max_lines=JOURNAL_LINES) if self._journal else []
        if literals is None:
            literals = self._literals()
        head: tuple[str, ...] = ()
        if journal:
            head = (f"-- journal: {', '.join(units)} --"[:EXCERPT_LINE_MAX],
                    *fit(redact_lines(journal, literals), max_lines=JOURNAL_LINES, line_max=EXCERPT_LINE_MAX,
                         max_bytes=EXCERPT_BYTES_MAX // 2))
        used = sum(len(line.encode()) + 1 for line in head)
        tail: tuple[str, ...] = ()
        if own:
            tail = ("-- edge-agent --", *fit(redact_lines(own, literals), max_lines=EXCERPT_LINES_MAX - len(head) - 1,
                                              line_max=EXCERPT_LINE_MAX, max_bytes=EXCERPT_BYTES_MAX - used - 17))
        return head + tail


__all__ = ["EXCERPT_BYTES_MAX", "FailureLogs", "fit", "secret_literals"]
