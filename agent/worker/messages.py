"""Device applications' messages: checked against their class, then made durable.

    MessageIntake.submit(Submission)       one message: straight to the leader while it answers
                                           (its `accepted` means leader.db holds it), else into
                                           the outbox (kind "app.CLASS"); returns once either holds it
    MessageIntake.submit_many([...])       a batch: into the outbox in one transaction, all or none

Nothing is acknowledged that is not stored: a refusal is a `Refusal` with the HTTP status the
local API answers (400 a wrong field, 413 too large, 429 the class is full under `reject`,
503 the outbox cannot store), counted per class and reason. Counters per class since start:
accepted, direct, stored, duplicates, refused by reason (`IntakeStats`); what became of the
stored ones is the outbox's per-class flows.

An application may name its message (`app_id`): the same (class, app_id) again is the same
message, answered `duplicate` with the first answer's id and path and never stored twice. Its
envelope id is derived from (device, class, app_id), so every copy carries the same id and the
leader keeps one (its message store's dedup by id, for `[messages] retention_s`); the copy
still pending in the outbox is found by its key; and this process remembers the last
`RECENT_APP_IDS` answers, and waits for a copy still being stored, so a retry racing the first
try gets the first's answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, TypeVar

from agent.core.clock import Clock
from agent.core.config import MessageClassSection
from agent.core.errors import EdgeAgentError, OutboxFull, StoreError, Transient
from agent.core.gate import Gate
from agent.core.ids import IdGenerator
from agent.outbox.reliable import DirectFirst
from agent.outbox.types import ClassStats, EnqueueResult, OutboxMessage
from agent.protocol import ALREADY_STORED, APP_KIND_PREFIX, AppMessage, app_kind, encode_message
from agent.worker.actors import LEADER, envelope_of

log = logging.getLogger(__name__)

RefusalReason = Literal["invalid", "unknown_class", "too_large", "full", "unavailable"]
Path = Literal["direct", "outbox"]
KEY_MAX = 256
APP_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # an application's own id of a message
RECENT_APP_IDS = 10_000
CONTENT_TYPE_MAX = 128
TTL_MAX_S = 365 * 86_400.0
FULL_RETRY_AFTER_S = 5
T = TypeVar("T")


class Refusal(EdgeAgentError):
    """A message not taken, with the local API's answer: `status`, the `field` that is wrong."""

    STATUS: dict[RefusalReason, int] = {
        "invalid": 400, "unknown_class": 400, "too_large": 413, "full": 429, "unavailable": 503}

    def __init__(self, reason: RefusalReason, detail: str, *, field: str | None = None,
                 retry_after_s: int | None = None) -> None:
        self.reason: RefusalReason = reason
        self.status = self.STATUS[reason]
        self.detail = detail
        self.field = field
        self.retry_after_s = retry_after_s
        super().__init__(f"{field}: {detail}" if field else detail)


@dataclass(frozen=True, slots=True)
class Submission:
    """One message from an application. `msg_id`: a source's own stable id (a line re-read
    after a restart carries the same one, so the leader keeps it once)."""

    cls: str
    payload: bytes
    content_type: str = "application/octet-stream"
    key: str | None = None
    ttl_s: float | None = None
    msg_id: str | None = None
    app_id: str | None = None  # the application's own name of the message (see the module's doc)


@dataclass(frozen=True, slots=True)
class Accepted:
    """Where a message went: straight to the leader, or into the outbox; `duplicate`: it was
    taken before (a source's line read again, an application's retry), nothing was stored."""

    msg_id: str
    path: Path
    duplicate: bool = False


@dataclass(slots=True)
class ClassIntake:
    accepted: int = 0
    direct: int = 0
    stored: int = 0
    duplicates: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class Outbox(Protocol):
    async def enqueue(self, msg: OutboxMessage, *, delay_ms: int = 0) -> EnqueueResult: ...

    async def enqueue_many(self, msgs: Sequence[OutboxMessage]) -> list[EnqueueResult]: ...


class Link(Protocol):
    def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0) -> Awaitable[object]: ...


class _TimedLink:
    """The leader link with the intake's own answer limit: no answer in time is a `Transient`
    failure (the message then goes to the outbox)."""

    def __init__(self, link: Link, clock: Clock, timeout_s: float) -> None:
        self._link = link
        self._clock = clock
        self._timeout_s = timeout_s

    async def tell(self, message: object, *, coalesce_key: str | None = None, seq: int = 0) -> object:
        try:
            return await self._clock.wait_for(self._link.tell(message, coalesce_key=coalesce_key, seq=seq),
                                              self._timeout_s)
        except TimeoutError:
            raise Transient(f"the leader did not answer within {self._timeout_s:g}s") from None


class MessageIntake:
    def __init__(self, *, device_id: str, classes: Mapping[str, MessageClassSection], outbox: Outbox, link: Link,
                 connected: Gate, ids: IdGenerator, clock: Clock, seq_base: int = 0,
                 direct_timeout_s: float = 5.0, direct_backoff_s: float = 30.0) -> None:
        self.device_id = device_id
        self.classes = dict(classes)
        self._outbox = outbox
        self._link = link
        self._connected = connected
        self._ids = ids
        self._clock = clock
        self._seq = seq_base
        # straight to the leader with the intake's own (shorter) answer limit; after a failed
        # try, `direct_backoff_s` of outbox only
        self._timed_link = _TimedLink(link, clock, direct_timeout_s)
        self._direct = DirectFirst(clock, backoff_s=direct_backoff_s)
        self.stats: dict[str, ClassIntake] = {name: ClassIntake() for name in self.classes}
        self.refused_unknown = 0  # refusals of a class that does not exist (not counted per name)
        # The outbox's per-class figures when the agent started: the audit counts from there.
        self.baseline: dict[str, ClassStats] = {}
        # (class, app_id) -> the first answer, newest last; and the ones still being stored
        self._recent: OrderedDict[tuple[str, str], Accepted] = OrderedDict()
        self._storing: dict[tuple[str, str], asyncio.Future[Accepted]] = {}

    # -- checks ------------------------------------------------------------------------------
    def _refuse(self, cls: str, refusal: Refusal) -> Refusal:
        counts = self.stats.get(cls)
        if counts is None:
            self.refused_unknown += 1
        else:
            counts.refused[refusal.reason] = counts.refused.get(refusal.reason, 0) + 1
        return refusal

    def message(self, sub: Submission, *, prefix: str = "") -> OutboxMessage:
        """The durable form of `sub`, or a `Refusal` naming the wrong field."""
        spec = self.classes.get(sub.cls)
        if spec is None:
            known = ", ".join(sorted(self.classes)) or "none"
            raise self._refuse(sub.cls, Refusal("unknown_class", f"no class {sub.cls[:64]!r} (the classes are {known})",
                                                field=f"{prefix}class"))
        if len(sub.payload) > spec.max_payload_bytes:
            raise self._refuse(sub.cls, Refusal(
                "too_large", f"{len(sub.payload)} bytes, over the class's max_payload_bytes {spec.max_payload_bytes}",
                field=f"{prefix}payload"))
        ctype = sub.content_type
        if not ctype or len(ctype) > CONTENT_TYPE_MAX or not all("!" <= ch <= "~" for ch in ctype):
            raise self._refuse(sub.cls, Refusal("invalid", f"not a content type: {ctype[:64]!r}",
                                                field=f"{prefix}content_type"))
        key = sub.key
        if key is not None and (not key or len(key) > KEY_MAX):
            raise self._refuse(sub.cls, Refusal("invalid", f"must be 1-{KEY_MAX} characters", field=f"{prefix}key"))
        overwrite = spec.mode == "overwrite"
        if overwrite and key is None:
            raise self._refuse(sub.cls, Refusal("invalid", f"class {sub.cls!r} keeps the newest message per key:"
                                                           " a key is required", field=f"{prefix}key"))
        ttl_ms: int | None = None
        if sub.ttl_s is not None:
            if not 0 < sub.ttl_s <= TTL_MAX_S:
                raise self._refuse(sub.cls, Refusal("invalid", f"must be > 0 and at most {TTL_MAX_S:g} s",
                                                    field=f"{prefix}ttl"))
            ttl_ms = max(1, int(sub.ttl_s * 1000))
        app_id = sub.app_id
        if app_id is not None and not APP_ID.match(app_id):
            raise self._refuse(sub.cls, Refusal("invalid", "must be 1-128 characters of A-Z a-z 0-9 . _ : -",
                                                field=f"{prefix}app_id"))
        self._seq += 1
        msg_id = sub.msg_id or (self._app_msg_id(sub.cls, app_id) if app_id is not None else self._ids.next())
        record = AppMessage(device_id=self.device_id, cls=sub.cls, payload=sub.payload, content_type=ctype,
                            key=key, overwrite=overwrite, seq=self._seq, ts_ms=self._clock.now_ms())
        # an append message's key (or a source's or application's own id) is its idempotency key
        # in the outbox
        outbox_key = key if key is not None else (sub.msg_id or (msg_id if app_id is not None else None))
        return OutboxMessage(msg_id=msg_id, owner=self.device_id, receiver=LEADER, kind=app_kind(sub.cls),
                             payload=encode_message(record), key=outbox_key,
                             conflict="overwrite" if overwrite else "append", seq=self._seq, ttl_ms=ttl_ms)

    def _app_msg_id(self, cls: str, app_id: str) -> str:
        """The envelope id of an application's named message: the same for every copy."""
        digest = hashlib.blake2b(f"{self.device_id}\0{cls}\0{app_id}".encode(), digest_size=16)
        return "a" + digest.hexdigest()

    # -- taking messages -----------------------------------------------------------------------
    async def submit(self, sub: Submission) -> Accepted:
        if sub.app_id is None:
            return await self._submit(self.message(sub))
        named = (sub.cls, sub.app_id)
        while True:
            first = self._first_answer(named)
            if first is not None:
                return first
            storing = self._storing.get(named)
            if storing is None:
                break
            try:
                await asyncio.shield(storing)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this request is cancelled, not the first try
            except Exception:  # the first try failed: this one tries anew
                pass
        msg = self.message(sub)
        storing = self._storing[named] = asyncio.get_running_loop().create_future()
        try:
            done = await self._submit(msg)
        except BaseException as exc:
            storing.set_exception(exc)
            storing.exception()  # retrieved: a failure nobody else waited for is not an error
            raise
        finally:
            del self._storing[named]
        self._remember(named, done)
        storing.set_result(done)
        return done

    def _first_answer(self, named: tuple[str, str]) -> Accepted | None:
        """The answer a named message got before, as a duplicate (counted), or None."""
        first = self._recent.get(named)
        if first is None:
            return None
        self._recent.move_to_end(named)
        self.stats[named[0]].duplicates += 1
        return replace(first, duplicate=True)

    def _remember(self, named: tuple[str, str], done: Accepted) -> None:
        recent = self._recent
        if named not in recent:
            recent[named] = replace(done, duplicate=False)
            if len(recent) > RECENT_APP_IDS:
                recent.popitem(last=False)

    async def _submit(self, msg: OutboxMessage) -> Accepted:
        cls = msg.kind.removeprefix(APP_KIND_PREFIX)
        if not self._connected.is_open:
            return (await self._store(cls, [msg]))[0]
        _, stored, answer = await self._refusing(cls, self._direct.send(
            self._timed_link, envelope_of(msg, self._clock), outbox=self._outbox, msg=msg))
        if stored is None:  # the leader answered
            counts = self.stats[cls]
            if answer == ALREADY_STORED:  # it held this message before: a retry of a named one
                counts.duplicates += 1
                return Accepted(msg.msg_id, "direct", duplicate=True)
            counts.accepted += 1
            counts.direct += 1
            return Accepted(msg.msg_id, "direct")
        return self._accepted([msg], [cls], [stored])[0]

    async def submit_many(self, subs: Sequence[Submission]) -> list[Accepted]:
        """Into the outbox in one transaction, all or none; a named message taken before is
        answered as the duplicate it is, and not stored again."""
        answers: list[Accepted | None] = [None] * len(subs)
        fresh: list[int] = []
        msgs: list[OutboxMessage] = []
        seen: set[tuple[str, str]] = set()
        for i, sub in enumerate(subs):
            msg = self.message(sub, prefix=f"messages.{i}.")
            named = (sub.cls, sub.app_id) if sub.app_id is not None else None
            if named is not None and (named in seen or named in self._storing):
                raise self._refuse(sub.cls, Refusal("invalid", "this app_id is in this batch twice, or being"
                                                    " stored by another request", field=f"messages.{i}.app_id"))
            first = self._first_answer(named) if named is not None else None
            if first is not None:
                answers[i] = first
                continue
            if named is not None:
                seen.add(named)
            fresh.append(i)
            msgs.append(msg)
        if msgs:
            stored = await self._store(subs[fresh[0]].cls, msgs, classes=[subs[i].cls for i in fresh])
            for i, done in zip(fresh, stored, strict=True):
                answers[i] = done
                app_id = subs[i].app_id
                if app_id is not None:
                    self._remember((subs[i].cls, app_id), done)
        return [a for a in answers if a is not None]

    async def _store(self, cls: str, msgs: list[OutboxMessage], *,
                     classes: Sequence[str] | None = None) -> list[Accepted]:
        names = classes if classes is not None else [cls] * len(msgs)
        if len(msgs) == 1:
            results = [await self._refusing(cls, self._outbox.enqueue(msgs[0]))]
        else:
            results = await self._refusing(cls, self._outbox.enqueue_many(msgs))
        return self._accepted(msgs, names, results)

    async def _refusing(self, cls: str, storing: Awaitable[T]) -> T:
        """`storing`, with the outbox's refusals as the local API's (429 full, 503 unavailable)."""
        try:
            return await storing
        except OutboxFull as exc:
            raise self._refuse(cls, Refusal("full", str(exc), retry_after_s=FULL_RETRY_AFTER_S)) from None
        except (StoreError, ValueError) as exc:
            log.warning("%s messages not stored: %s", cls, exc)
            raise self._refuse(cls, Refusal("unavailable", f"the outbox cannot store it: {exc}",
                                            retry_after_s=FULL_RETRY_AFTER_S)) from None

    def _accepted(self, msgs: Sequence[OutboxMessage], names: Sequence[str],
                  results: Sequence[EnqueueResult]) -> list[Accepted]:
        out = []
        for msg, name, result in zip(msgs, names, results, strict=True):
            counts = self.stats[name]
            if result.outcome == "duplicate":
                counts.duplicates += 1
                out.append(Accepted(msg.msg_id, "outbox", duplicate=True))
            else:
                counts.accepted += 1
                counts.stored += 1
                out.append(Accepted(msg.msg_id, "outbox"))
        return out

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {name: {"accepted": c.accepted, "direct": c.direct, "stored": c.stored, "duplicates": c.duplicates,
                       "refused": dict(c.refused)} for name, c in sorted(self.stats.items())}




_FLOWS = ("enqueued", "dead_lettered", "expired", "dropped", "overwritten", "replayed")


def class_audit(intake: MessageIntake, by_class: Mapping[str, ClassStats]) -> dict[str, dict[str, object]]:
    """Per application class, what the device took since this start and what became of it:
    the intake's counters beside the outbox's flows for the class (kind "app.CLASS") since the
    baseline taken at start (`MessageIntake.baseline`).

    accepted = direct + stored; delivered = direct + delivered_from_outbox; and the outbox's law:
    enqueued = delivered_from_outbox + dead_lettered + expired + dropped + overwritten
               + (pending - pending at start) - replayed."""
    out: dict[str, dict[str, object]] = {}
    for name, counts in sorted(intake.stats.items()):
        kind = app_kind(name)
        now = by_class.get(kind) or ClassStats()
        then = intake.baseline.get(kind) or ClassStats()
        from_outbox = now.delivered - then.delivered
        entry: dict[str, object] = {
            "accepted": counts.accepted, "direct": counts.direct, "stored": counts.stored,
            "duplicates": counts.duplicates, "refused": dict(counts.refused),
            "delivered": counts.direct + from_outbox, "delivered_from_outbox": from_outbox,
        }
        for flow in _FLOWS:
            entry[flow] = getattr(now, flow) - getattr(then, flow)
        entry.update(pending=now.pending, pending_at_start=then.pending, pending_bytes=now.pending_bytes,
                     dead=now.dead)
        out[name] = entry
    return out


__all__ = ["Accepted", "ClassIntake", "MessageIntake", "Refusal", "RefusalReason", "Submission", "class_audit"]
