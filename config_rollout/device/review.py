"""An application's say on a staged config: the applier asks, the local API answers.

A target with `app_validate_s` > 0 holds each release it staged (and that its `validate_command`
passed) for an application's verdict: the application long-polls for it (`GET
/v1/config/NAME/staged`), reads the staged documents, and accepts or vetoes it with a reason
(`POST /v1/config/NAME/verdict`). The first verdict decides; none within `app_validate_s` is a
refusal (the target said an application must look). One review per target at a time: the
applier applies one release at a time.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

REASON_MAX = 500


@dataclass
class Review:
    review_id: str
    version: str
    release_id: str
    documents: dict[str, bytes]
    verdict: asyncio.Future[str] = field(repr=False)  # "" accepted, else the veto's reason

    def view(self) -> dict[str, Any]:
        import base64

        docs: dict[str, dict[str, str]] = {}
        for n, data in sorted(self.documents.items()):
            try:
                docs[n] = {"text": data.decode("utf-8")}
            except UnicodeDecodeError:
                docs[n] = {"base64": base64.b64encode(data).decode()}
        return {"review": self.review_id, "version": self.version, "release_id": self.release_id, "documents": docs}


class ConfigReviews:
    """The worker's open reviews, by target (one event loop: the applier's and the API's)."""

    def __init__(self) -> None:
        self._open: dict[str, Review] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def _event(self, target: str) -> asyncio.Event:
        return self._changed.setdefault(target, asyncio.Event())

    async def ask(self, target: str, version: str, release_id: str, documents: dict[str, bytes],
                  timeout_s: float) -> str:
        """Hold the staged release for a verdict: "" when an application accepted it within
        `timeout_s`, else why not."""
        review = Review(secrets.token_hex(8), version, release_id, dict(documents),
                        asyncio.get_running_loop().create_future())
        self._open[target] = review
        self._event(target).set()
        try:
            return await asyncio.wait_for(asyncio.shield(review.verdict), timeout_s)
        except TimeoutError:
            return f"no application gave a verdict within {timeout_s:g} s"
        finally:
            if self._open.get(target) is review:
                del self._open[target]
            self._event(target).clear()

    def pending(self, target: str) -> Review | None:
        return self._open.get(target)

    async def wait_pending(self, target: str, timeout_s: float) -> Review | None:
        """The open review of `target`, waiting up to `timeout_s` for one."""
        if target in self._open:
            return self._open[target]
        event = self._event(target)
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return None
        return self._open.get(target)

    def answer(self, target: str, review_id: str, *, accept: bool, reason: str) -> bool:
        """Record a verdict; False when `review_id` is not the target's open review (gone: a
        verdict came first, or its time ran out)."""
        review = self._open.get(target)
        if review is None or review.review_id != review_id or review.verdict.done():
            return False
        review.verdict.set_result("" if accept else f"the application vetoed it: {reason[:REASON_MAX] or 'no reason'}")
        return True


__all__ = ["REASON_MAX", "ConfigReviews", "Review"]
