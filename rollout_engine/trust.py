"""The fleet's trust document: which keys may sign artifacts and config releases, until when,
signed by the fleet's root key, and rotatable.

    doc = make_trust_document(version=2, roots=[root], keys=[(signing.public, expires_ms)], signers=[root])
    trusted = TrustedKeys([root_public], now_ms=clock.now_ms)   # a device pins only the root
    trusted.accept(doc)                       # TrustError unless newer and signed by the root it trusts
    trusted.signer(key_id)                    # the listed, unexpired key; WrongKey saying why not

A document is JSON: `{"body": {...}, "signatures": [{"id", "sig"}]}`; the body's exact bytes are
signed (ed25519, with a domain prefix of their own). The body names its `version` (only ever
increases), the `roots` that sign the next one, and the signing `keys`, each with its expiry.
Accepted only when a root the holder trusts signed it; a document that changes the roots must
also be signed by every new root (so the old and new roots together rotate the root). An
artifact or a release signed by a key the document does not list, or whose expiry passed, is
refused. The same bytes are checked by the leader (before it hands them out with every offer)
and by every device.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from agent.core.durations import utc_iso
from agent.core.files import atomic_write
from rollout_engine.errors import KeyFileError, TrustError, WrongKey
from rollout_engine.keys import KEY_ID_SIZE, SigningKey, Verifier, VerifyKey, load_verify_key

DOMAIN = b"edge-agent trust document v1\n"
log = logging.getLogger(__name__)

STATE_FILE = "trust.json"  # in a holder's state directory: the accepted document and who accepted it
MAX_DOCUMENT_BYTES = 64 * 1024
MAX_KEYS = 32
MAX_ROOTS = 4

B64 = Annotated[str, msgspec.Meta(max_length=128)]
HexId = Annotated[str, msgspec.Meta(min_length=2 * KEY_ID_SIZE, max_length=2 * KEY_ID_SIZE, pattern="^[0-9a-f]+$")]


class TrustedKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: HexId
    key: B64  # raw ed25519 public key, base64
    expires_ms: Annotated[int, msgspec.Meta(gt=0)]


class TrustBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    version: Annotated[int, msgspec.Meta(ge=1)]
    issued_ms: int
    roots: Annotated[list[B64], msgspec.Meta(min_length=1, max_length=MAX_ROOTS)]
    keys: Annotated[list[TrustedKey], msgspec.Meta(max_length=MAX_KEYS)]


class Signature(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: HexId
    sig: Annotated[str, msgspec.Meta(max_length=128)]


class _Signed(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    body: msgspec.Raw
    signatures: Annotated[list[Signature], msgspec.Meta(min_length=1, max_length=MAX_ROOTS * 2)]


class _State(msgspec.Struct, frozen=True):
    verified_by: list[str]
    document: str


class _SignedOut(msgspec.Struct, frozen=True):
    body: msgspec.Raw
    signatures: list[Signature]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _key(text: str, what: str) -> VerifyKey:
    try:
        return VerifyKey.from_raw(base64.b64decode(text, validate=True))
    except (ValueError, KeyFileError) as exc:
        raise TrustError(f"trust document: {what} is not an ed25519 public key ({exc})") from None


def make_trust_document(*, version: int, roots: Sequence[VerifyKey], keys: Sequence[tuple[VerifyKey, int]],
                        signers: Sequence[SigningKey], issued_ms: int) -> bytes:
    """A signed trust document (JSON bytes). `signers`: the current roots' private keys, and
    every new root's when `roots` changes."""
    body = msgspec.json.encode(TrustBody(
        format=1, version=version, issued_ms=issued_ms, roots=[_b64(r.raw) for r in roots],
        keys=[TrustedKey(id=k.key_id_hex, key=_b64(k.raw), expires_ms=expires) for k, expires in keys]))
    signatures = [Signature(id=s.public.key_id_hex, sig=_b64(s.sign(DOMAIN + body))) for s in signers]
    return msgspec.json.encode(_SignedOut(body=msgspec.Raw(body), signatures=signatures))


class TrustDocument:
    """A decoded document, its signatures not yet judged (`TrustedKeys.accept` judges them)."""

    def __init__(self, data: bytes) -> None:
        if len(data) > MAX_DOCUMENT_BYTES:
            raise TrustError(f"trust document of {len(data)} bytes, over {MAX_DOCUMENT_BYTES}")
        try:
            signed = msgspec.json.decode(data, type=_Signed)
            self.body = msgspec.json.decode(bytes(signed.body), type=TrustBody)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TrustError(f"trust document: malformed: {exc}") from None
        if self.body.format != 1:
            raise TrustError(f"trust document: format {self.body.format}, this agent reads format 1")
        self.raw = data
        self.signed_bytes = DOMAIN + bytes(signed.body)
        self.signatures = signed.signatures
        self.roots = [_key(r, "a root") for r in self.body.roots]
        self.keys = {k.id: (_key(k.key, f"key {k.id}"), k.expires_ms) for k in self.body.keys}
        for kid, (key, _) in self.keys.items():
            if key.key_id_hex != kid:
                raise TrustError(f"trust document: key id {kid} does not match its key ({key.key_id_hex})")

    @property
    def version(self) -> int:
        return self.body.version

    def signed_by(self, root: VerifyKey) -> bool:
        for signature in self.signatures:
            if signature.id == root.key_id_hex:
                try:
                    sig = base64.b64decode(signature.sig, validate=True)
                except ValueError:
                    return False
                return root.verify(sig, self.signed_bytes)
        return False


class TrustedKeys:
    """What a holder trusts: its pinned root(s) and, once accepted, the newest document. The
    signing keys of artifacts and releases are looked up here (`signer`), so an accepted newer
    document takes effect at once everywhere this object is held."""

    def __init__(self, roots: Sequence[VerifyKey], *, now_ms: Callable[[], int],
                 document: TrustDocument | None = None, state_dir: Path | None = None) -> None:
        if not roots:
            raise TrustError("no trust root")
        self.roots = list(roots)
        self._now_ms = now_ms
        self.state_dir = state_dir  # where an accepted document is kept (and found at the next start)
        self.document: TrustDocument | None = None
        if document is not None:
            self._check(document)
            self._take(document)

    @property
    def version(self) -> int:
        return self.document.version if self.document is not None else 0

    def _check(self, doc: TrustDocument) -> None:
        if not any(doc.signed_by(root) for root in self.roots):
            raise TrustError(f"trust document v{doc.version}: not signed by a trusted root "
                             f"({', '.join(r.key_id_hex for r in self.roots)})")
        trusted = {r.key_id for r in self.roots}
        for new_root in doc.roots:
            if new_root.key_id not in trusted and not doc.signed_by(new_root):
                raise TrustError(f"trust document v{doc.version}: a new root {new_root.key_id_hex} must sign the"
                                 " document that names it")

    def _take(self, doc: TrustDocument) -> None:
        self.document = doc
        self.roots = list(doc.roots)

    def accept(self, data: bytes) -> bool:
        """Take a newer document; False when it is the one held already. `TrustError` says why
        a document is refused (a lower version, a bad signature, ...), and nothing changes."""
        doc = TrustDocument(data)
        if self.document is not None:
            if doc.version == self.document.version and data == self.document.raw:
                return False
            if doc.version <= self.document.version:
                raise TrustError(f"trust document v{doc.version} is not newer than the one held (v{self.version})")
        verified_by = list(self.roots)
        self._check(doc)
        self._take(doc)
        if self.state_dir is not None:
            self._save(doc, verified_by)
        return True

    def _save(self, doc: TrustDocument, verified_by: Sequence[VerifyKey]) -> None:
        state = _State(verified_by=[_b64(r.raw) for r in verified_by], document=doc.raw.decode("utf-8"))
        assert self.state_dir is not None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.state_dir / STATE_FILE, msgspec.json.encode(state))

    def restore(self) -> None:
        """Take the document accepted before (kept in `state_dir`), checked again against the
        roots that accepted it; a file that does not check is left alone and said."""
        if self.state_dir is None:
            return
        path = self.state_dir / STATE_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TrustError(f"{path}: cannot read: {exc.strerror or exc}") from None
        try:
            state = msgspec.json.decode(data, type=_State)
            roots = [_key(r, "a root") for r in state.verified_by]
            doc = TrustDocument(state.document.encode("utf-8"))
            TrustedKeys(roots, now_ms=self._now_ms, document=doc)
        except (msgspec.DecodeError, msgspec.ValidationError, TrustError) as exc:
            raise TrustError(f"{path}: the trust document kept here does not check ({exc}): move it aside") from None
        if doc.version > self.version:
            self._take(doc)

    @property
    def document_bytes(self) -> bytes:
        """The document held, as it was signed (b"" before the first)."""
        return self.document.raw if self.document is not None else b""

    def signer(self, key_id: bytes) -> VerifyKey:
        """The key `key_id` names, listed and unexpired; `WrongKey` saying why not."""
        if self.document is None:
            raise WrongKey(f"signed by key {key_id.hex()}, and no trust document is held yet")
        found = self.document.keys.get(key_id.hex())
        if found is None:
            raise WrongKey(f"signed by key {key_id.hex()}, which trust document v{self.version} does not list")
        key, expires_ms = found
        if self._now_ms() >= expires_ms:
            raise WrongKey(f"signed by key {key_id.hex()}, which expired at {utc_iso(expires_ms)}"
                           f" (trust document v{self.version})")
        return key


def take_trust_document(keys: Verifier, data: bytes, *, came_with: str) -> None:
    """Take a trust document that came with an offer or an install request: nothing without one,
    or for a holder that pins one key; `TrustError` (and nothing changed) when it is refused."""
    if data and isinstance(keys, TrustedKeys) and keys.accept(data):
        log.info("took trust document v%d with %s", keys.version, came_with)


def read_trust_document(path: str | Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise TrustError(f"{path}: cannot read the trust document: {exc.strerror or exc}") from None


def load_fleet_keys(*, public_key: str, trust_root: str, trust_document: str, state_dir: Path | None,
                    now_ms: Callable[[], int]) -> Verifier | None:
    """What checks the fleet's artifacts and releases, as `[firmware]` says: the trust root with
    the newest document held (`state_dir`) or named (`trust_document`, taken when newer), or the
    one pinned `public_key`; None when neither is set. `TrustError`/`KeyFileError` say why not."""
    if trust_root:
        keys = TrustedKeys([load_verify_key(trust_root)], now_ms=now_ms, state_dir=state_dir)
        keys.restore()
        if trust_document:
            data = read_trust_document(trust_document)
            doc = TrustDocument(data)
            if keys.document is not None and doc.version < keys.version:
                raise TrustError(f"{trust_document}: trust document v{doc.version} is older than v{keys.version},"
                                 " the one held")
            keys.accept(data)
        return keys
    if public_key:
        return load_verify_key(public_key)
    return None


__all__ = ["MAX_DOCUMENT_BYTES", "STATE_FILE", "TrustDocument", "TrustedKeys", "load_fleet_keys", "make_trust_document",
           "read_trust_document", "take_trust_document"]
