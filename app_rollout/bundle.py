"""An application bundle: named, versioned, signed with the fleet's key, holding the files of a
service, its systemd unit and how the device checks it is healthy.

On disk (`.eaapp`), every length big-endian:

    magic "EAAPP\\x01" (6) | manifest length (4) | manifest (JSON) | key id (8) | signature (64)
    | the files, in the manifest's order, each exactly its stated size

The signed head (everything up to the signature) is what a rollout stores and offers; a device
writes the bundle's file from the head on, copying what the version it runs holds and fetching
the rest from a mirror (`app_rollout.device.fetch`), and checks each file against the head's
sha256. A file of at least `CHUNKED_FROM` bytes is listed with its content-defined chunks
(FastCDC, casync's bounds: the firmware's), each its length and sha256, so a new version of a
large file fetches only the chunks that changed.

The signature is ed25519 over the magic and the manifest's bytes. Nothing of a bundle is used
before its signature is checked, and the manifest is bounded everywhere: the number of files,
each file's size, its path (relative, no `..`), its mode (0644 or 0755), its chunks (adding up
to its size), the unit (`app_rollout.unit`), the health check.

A bundle is built from a directory holding `app.toml`:

    [app]
    name = "hello"                # a-z 0-9 -, the unit is edge-app-hello.service
    version = "1.2.0"
    unit = "hello.service"        # the service's unit, beside app.toml; or, for a container:
    # compose = "compose.yaml"    # its one service (`app_rollout.compose`), with
    files = "files"               # every file under it goes in; executable on disk: mode 0755

    # [images]                    # a container's image reference -> its OCI archive among the files
    # "localhost/hello:2" = "images/hello.tar"

    [health]                      # what says the new version works (all within timeout_s)
    check = "http"                # "active": the unit stays active settle_s, not restarted
    url = "http://127.0.0.1:8080/healthz"      # "http": 2xx from a loopback URL
    # command = ["bin/check"]                  # "command": exits 0, run as the application
    # "container": the compose service's healthcheck passes (a container application)
    settle_s = 5
    timeout_s = 60
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from agent.core.files import atomic_write
from app_rollout.container import ContainerSpec, check_container
from app_rollout.errors import AppBundleError, BundleSignature, MalformedBundle
from app_rollout.fields import FilePath, Sha256Hex
from app_rollout.unit import AppUnit, check_unit
from rollout_engine.errors import InvalidVersion, WrongKey
from rollout_engine.keys import KEY_ID_SIZE, SIGNATURE_SIZE, SigningKey, Verifier, signer_of
from rollout_engine.version import parse_version

MAGIC = b"EAAPP\x01"
SUFFIX = ".eaapp"
MANIFEST_MAX = 256 * 1024
FILES_MAX = 1024
FILE_MAX = 256 * 1024 * 1024
BUNDLE_MAX = 1024 * 1024 * 1024
HEAD_MAX = len(MAGIC) + 4 + MANIFEST_MAX + KEY_ID_SIZE + SIGNATURE_SIZE
MODES = (0o644, 0o755)
CHUNK_MIN, CHUNK_AVG, CHUNK_MAX = 16 * 1024, 64 * 1024, 256 * 1024  # FastCDC bounds, as `firmware build`'s
CHUNKED_FROM = 2 * CHUNK_AVG  # a smaller file is fetched whole when it changed

AppName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9-]{0,39}$")]
_LOOPBACK_URL = re.compile(r"^http://(127\.0\.0\.1|localhost|\[::1\]):[0-9]{1,5}(/[\x21-\x7e]{0,200})?$")


Chunk = tuple[Annotated[int, msgspec.Meta(ge=1, le=CHUNK_MAX)], Sha256Hex]  # (length, sha256)


class AppFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    path: FilePath
    size: Annotated[int, msgspec.Meta(ge=0, le=FILE_MAX)]
    mode: Literal[0o644, 0o755]
    sha256: Sha256Hex
    # its content-defined chunks in order (none: fetched whole when it changed)
    chunks: Annotated[tuple[Chunk, ...], msgspec.Meta(max_length=FILE_MAX // CHUNK_MIN + 1)] = ()


class AppHealth(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    check: Literal["active", "http", "command", "container"] = "active"
    settle_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120.0
    url: Annotated[str, msgspec.Meta(max_length=256)] = ""
    command: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=256)], ...], msgspec.Meta(max_length=16)] = ()


class AppManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    format: int = 1
    name: AppName
    version: Annotated[str, msgspec.Meta(max_length=64)]
    # "container": its image an OCI archive of its files, run as `container` says (no unit);
    # "removed": a removal of the application (`build_removal`): no unit, no file
    runtime: Literal["service", "container", "removed"] = "service"
    unit: Annotated[str, msgspec.Meta(max_length=16 * 1024)] = ""
    container: ContainerSpec | None = None
    health: AppHealth = AppHealth()
    files: Annotated[tuple[AppFile, ...], msgspec.Meta(max_length=FILES_MAX)] = ()
    created_ms: Annotated[int, msgspec.Meta(ge=0)] = 0

    @property
    def payload_size(self) -> int:
        return sum(f.size for f in self.files)

    def executables(self) -> frozenset[str]:
        return frozenset(f.path for f in self.files if f.mode == 0o755)


@dataclass(frozen=True)
class SignedApp:
    """A bundle's head, verified: its manifest, its checked unit and the signed bytes."""

    manifest: AppManifest
    unit: AppUnit | None  # (None: a removal, or a container application: its manifest's `container`)
    head: bytes  # magic .. signature: what a rollout stores and offers
    key_id: str

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def size(self) -> int:
        """The whole bundle file's size."""
        return len(self.head) + self.manifest.payload_size


def _check(manifest: AppManifest, source: str) -> AppUnit | None:
    """What a signed manifest must also be: a version, distinct paths, a unit an application may
    have, a health check it can run; a removal: no unit and no file."""
    if manifest.format != 1:
        raise MalformedBundle(f"{source}: bundle format {manifest.format}, this agent reads format 1")
    try:
        parse_version(manifest.version)
    except InvalidVersion as exc:
        raise MalformedBundle(f"{source}: version: {exc}") from None
    if manifest.runtime == "removed":
        if manifest.unit or manifest.files or manifest.container:
            raise MalformedBundle(f"{source}: a removal of {manifest.name} holds no unit and no file")
        return None
    if (manifest.runtime == "container") != (manifest.container is not None) or (
            manifest.runtime == "container" and manifest.unit):
        raise MalformedBundle(f"{source}: a {manifest.runtime} application has "
                              + ("a container and no unit" if manifest.runtime == "container" else "a unit"))
    paths = [f.path for f in manifest.files]
    if len(set(paths)) != len(paths):
        twice = sorted(p for p in set(paths) if paths.count(p) > 1)[0]
        raise MalformedBundle(f"{source}: a file is listed twice ({twice})")
    for f in manifest.files:
        if f.chunks and sum(length for length, _ in f.chunks) != f.size:
            raise MalformedBundle(f"{source}: {f.path}: its chunks add up to {sum(n for n, _ in f.chunks)} bytes,"
                                  f" not its {f.size}")
    dirs = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
    if dirs & set(paths):
        raise MalformedBundle(f"{source}: {sorted(dirs & set(paths))[0]} is both a file and a directory")
    health = manifest.health
    if manifest.container is not None:
        check_container(manifest.container, frozenset(paths), source=source)
        if health.check == "container" and manifest.container.healthcheck is None:
            raise MalformedBundle(f"{source}: health.check container: the compose service has no healthcheck")
        if health.check == "command":
            raise MalformedBundle(f"{source}: health.check command: a container's own check is its healthcheck"
                                  " (check = \"container\")")
        unit = None
    else:
        if health.check == "container":
            raise MalformedBundle(f"{source}: health.check container: a check of a container application")
        unit = check_unit(manifest.unit, executables=manifest.executables(), source=f"{source}: unit")
    if health.check == "http" and not _LOOPBACK_URL.match(health.url):
        raise MalformedBundle(f"{source}: health.url {health.url!r}: an http check asks a loopback URL"
                              " (http://127.0.0.1:PORT/PATH)")
    if health.check == "command":
        if not health.command:
            raise MalformedBundle(f"{source}: health.command: the command check needs a command")
        first = health.command[0]
        if not (first in manifest.executables() or first.startswith(("/usr/bin/", "/bin/"))):
            raise MalformedBundle(f"{source}: health.command {first!r}: an executable file of the bundle or a"
                                  " program under /usr/bin or /bin")
    return unit


def sign_manifest(manifest: AppManifest, key: SigningKey) -> bytes:
    """The signed head of a bundle of `manifest` (its files follow it in the bundle)."""
    body = msgspec.json.encode(manifest)
    if len(body) > MANIFEST_MAX:
        raise AppBundleError(f"application {manifest.name}: the manifest is over {MANIFEST_MAX} bytes")
    return b"".join([MAGIC, struct.pack(">I", len(body)), body, key.key_id, key.sign(MAGIC + body)])


def head_length(data: bytes) -> int:
    """The length of the signed head `data` starts with (enough of it: 10 bytes); MalformedBundle
    when it is not one."""
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise MalformedBundle("not an application bundle (bad magic)")
    (length,) = struct.unpack(">I", data[len(MAGIC):len(MAGIC) + 4])
    if length > MANIFEST_MAX:
        raise MalformedBundle(f"a manifest of {length} bytes, over {MANIFEST_MAX}")
    return len(MAGIC) + 4 + length + KEY_ID_SIZE + SIGNATURE_SIZE


def verify_head(data: bytes, key: Verifier, *, source: str) -> SignedApp:
    """The signed head at the start of `data`, verified with `key` (the signature before anything
    is parsed), then checked (`_check`). An `AppBundleError` names `source` and says why."""
    try:
        end = head_length(data)
    except MalformedBundle as exc:
        raise MalformedBundle(f"{source}: {exc}") from None
    if len(data) < end:
        raise MalformedBundle(f"{source}: truncated ({len(data)} bytes)")
    at = len(MAGIC) + 4
    body = data[at:end - KEY_ID_SIZE - SIGNATURE_SIZE]
    key_id = data[end - KEY_ID_SIZE - SIGNATURE_SIZE:end - SIGNATURE_SIZE]
    signature = data[end - SIGNATURE_SIZE:end]
    if key_id == bytes(KEY_ID_SIZE) and signature == bytes(SIGNATURE_SIZE):
        raise BundleSignature(f"{source}: unsigned (build it with the fleet's key: edge-agent app build --key)")
    try:
        signer = signer_of(key, key_id)
    except WrongKey as exc:
        raise BundleSignature(f"{source}: {exc}") from None
    if not signer.verify(signature, MAGIC + body):
        raise BundleSignature(f"{source}: the signature does not verify (the bundle was changed after signing)")
    try:
        manifest = msgspec.json.decode(body, type=AppManifest)
    except msgspec.DecodeError as exc:
        raise MalformedBundle(f"{source}: manifest: {exc}") from None
    return SignedApp(manifest, _check(manifest, source), bytes(data[:end]), key_id.hex())


def peek_head(data: bytes) -> AppManifest:
    """The manifest of a head, NOT verified: only to name a bundle in a plan or a refusal."""
    end = head_length(data)
    if len(data) < end:
        raise MalformedBundle("an application bundle cut short")
    try:
        return msgspec.json.decode(data[len(MAGIC) + 4:end - KEY_ID_SIZE - SIGNATURE_SIZE], type=AppManifest)
    except msgspec.DecodeError as exc:
        raise MalformedBundle(f"manifest: {exc}") from None


def read_head(path: str | Path) -> bytes:
    """The signed head of the bundle file at `path` (not verified), read within its cap."""
    try:
        with open(path, "rb") as f:
            start = f.read(len(MAGIC) + 4)
            end = head_length(start)
            return start + f.read(end - len(start))
    except OSError as exc:
        raise AppBundleError(f"{path}: {exc.strerror or exc}") from None
    except MalformedBundle as exc:
        raise MalformedBundle(f"{path}: {exc}") from None


def read_bundle(path: str | Path, key: Verifier) -> SignedApp:
    """The bundle at `path` verified whole: its head, then every file's size and sha256."""
    head = read_head(path)
    app = verify_head(head, key, source=str(path))
    try:
        size = os.path.getsize(path)
        if size != app.size:
            raise MalformedBundle(f"{path}: {size} bytes, the manifest says {app.size}")
        with open(path, "rb") as f:
            f.seek(len(head))
            for _entry, _blocks in iter_files(f, app.manifest, source=str(path)):
                pass  # (each file's blocks are read and checked as the next one is asked for)
    except OSError as exc:
        raise AppBundleError(f"{path}: {exc.strerror or exc}") from None
    return app


BLOCK = 1024 * 1024


def iter_files(f: object, manifest: AppManifest, *, source: str) -> Iterator[tuple[AppFile, Iterator[bytes]]]:
    """Each file of the bundle read from `f` (at the first file's offset) as blocks; a file whose
    bytes differ from the manifest raises MalformedBundle once its blocks are read."""
    read = f.read  # type: ignore[attr-defined]
    for entry in manifest.files:
        def blocks(entry: AppFile = entry) -> Iterator[bytes]:
            digest = hashlib.sha256()
            left = entry.size
            while left:
                block = read(min(BLOCK, left))
                if not block:
                    raise MalformedBundle(f"{source}: truncated in {entry.path}")
                digest.update(block)
                left -= len(block)
                yield block
            if digest.hexdigest() != entry.sha256:
                raise MalformedBundle(f"{source}: {entry.path}: its sha256 differs from the signed manifest")
        it = blocks()
        yield entry, it
        for _ in it:  # a caller that did not read it all: read the rest, so the hash is checked
            pass


# -- building ---------------------------------------------------------------------------------------
class _AppSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    version: str
    unit: str = ""  # a service's unit, or
    compose: str = ""  # a container application's compose file
    files: str = "files"


class _AppToml(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    app: _AppSection
    health: AppHealth = AppHealth()
    images: dict[str, str] = {}  # a compose image reference -> its OCI archive among the files


def build_removal(name: str, version: str, key: SigningKey, out: str | Path, *, created_ms: int = 0,
                  force: bool = False) -> SignedApp:
    """A signed removal of application `name` at `version` (above the version devices run),
    written to `out`: rolled out like a bundle, it stops the application and removes its versions
    (its data kept). An `AppBundleError` says what is wrong."""
    try:
        manifest = msgspec.convert({"name": name, "version": version, "runtime": "removed",
                                    "created_ms": created_ms}, type=AppManifest)
    except msgspec.ValidationError as exc:
        raise AppBundleError(f"application {name!r}: {exc}") from None
    _check(manifest, f"the removal of {name}")
    head = sign_manifest(manifest, key)
    target = Path(out)
    if target.exists() and not force:
        raise AppBundleError(f"{target}: exists already (give --force to replace it)")
    try:
        atomic_write(target, head, mode=0o644)
    except OSError as exc:
        raise AppBundleError(f"{target}: {exc.strerror or exc}") from None
    return SignedApp(manifest, None, head, key.key_id.hex())


def file_chunks(path: Path, size: int) -> list[tuple[int, str]]:
    """The content-defined chunks of the file at `path` (`size` bytes): (length, sha256 hex)."""
    try:
        from fastcdc import fastcdc  # only `app build` needs it: kept off every other import path
    except ImportError:
        raise AppBundleError("content-defined chunks need the fastcdc package: pip install 'edge-agent[cli]'"
                             " (or build with --whole-files)") from None
    import mmap

    chunks: list[tuple[int, str]] = []
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for chunk in fastcdc(view, min_size=CHUNK_MIN, avg_size=CHUNK_AVG, max_size=CHUNK_MAX):
                data = view[chunk.offset:chunk.offset + chunk.length]
                chunks.append((chunk.length, hashlib.sha256(data).hexdigest()))
                del data
        finally:
            view.release()
    if sum(length for length, _ in chunks) != size:
        raise AppBundleError(f"{path}: changed while it was read")
    return chunks


def _fitting(files: list[dict[str, object]]) -> list[dict[str, object]]:
    """`files` with the chunk lists of the largest files dropped until the manifest fits its cap
    (each chunk costs about 75 bytes of it; such a file is fetched whole when it changed)."""
    budget = MANIFEST_MAX - 16 * 1024 - sum(200 + len(str(f["path"])) for f in files)
    costs = sorted(((len(f.get("chunks", ())) * 76, i) for i, f in enumerate(files)), reverse=True)  # type: ignore[arg-type]
    total = sum(cost for cost, _ in costs)
    for cost, i in costs:
        if total <= budget:
            break
        files[i] = {k: v for k, v in files[i].items() if k != "chunks"}
        total -= cost
    return files


def build_bundle(directory: str | Path, key: SigningKey, out: str | Path, *, created_ms: int = 0,
                 force: bool = False, chunks: bool = True) -> SignedApp:
    """Build and sign the bundle of `directory/app.toml`, written to `out` (replaced only with
    `force`); files of `CHUNKED_FROM` bytes or more listed with their chunks unless not `chunks`.
    An `AppBundleError` names the file and the key that is wrong."""
    root = Path(directory)
    toml_path = root / "app.toml"
    try:
        raw = tomllib.loads(toml_path.read_text())
        spec = msgspec.convert(raw, type=_AppToml)
    except OSError as exc:
        raise AppBundleError(f"{toml_path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise AppBundleError(f"{toml_path}: not TOML ({exc})") from None
    except msgspec.ValidationError as exc:
        raise AppBundleError(f"{toml_path}: {exc}") from None
    if bool(spec.app.unit) == bool(spec.app.compose):
        raise AppBundleError(f"{toml_path}: app: a service names its unit, a container application its compose file"
                             " (one of unit, compose)")
    if spec.images and not spec.app.compose:
        raise AppBundleError(f"{toml_path}: images: only a container application (app.compose) has images")
    unit_path = root / (spec.app.unit or spec.app.compose)
    unit = ""
    if spec.app.unit:
        try:
            unit = unit_path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise AppBundleError(f"{toml_path}: app.unit: {unit_path}: {why}") from None
    files_root = root / spec.app.files
    if not files_root.is_dir():
        raise AppBundleError(f"{toml_path}: app.files: {files_root} is not a directory")
    container = None
    if spec.app.compose:
        from app_rollout.compose import container_spec  # (PyYAML: only a container application's build)

        for reference, archive in spec.images.items():
            if not (files_root / archive).is_file():
                raise AppBundleError(f"{toml_path}: images.{reference!r}: {archive}: not a file under {files_root}")
        container = msgspec.to_builtins(container_spec(unit_path, spec.images, files_root))
    entries: list[tuple[dict[str, object], Path]] = []
    for path in sorted(files_root.rglob("*")):
        relative = path.relative_to(files_root).as_posix()
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode):
            continue
        if not stat.S_ISREG(info.st_mode):
            raise AppBundleError(f"{path}: only regular files go into a bundle (not a link or a device)")
        mode = 0o755 if info.st_mode & stat.S_IXUSR else 0o644
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda f=f: f.read(BLOCK), b""):  # type: ignore[misc]
                digest.update(block)
        entry: dict[str, object] = {"path": relative, "size": info.st_size, "mode": mode,
                                    "sha256": digest.hexdigest()}
        try:
            msgspec.convert(entry, type=AppFile)
        except msgspec.ValidationError as exc:
            raise AppBundleError(f"{path}: {exc} (a path of at most 8 parts of A-Z a-z 0-9 _ . + -, a file of at"
                                 f" most {FILE_MAX} bytes)") from None
        if chunks and info.st_size >= CHUNKED_FROM:
            entry["chunks"] = file_chunks(path, info.st_size)
        entries.append((entry, path))
    try:
        manifest = msgspec.convert({"name": spec.app.name, "version": spec.app.version, "unit": unit,
                                    "runtime": "container" if container else "service", "container": container,
                                    "health": msgspec.to_builtins(spec.health), "created_ms": created_ms,
                                    "files": _fitting([e for e, _ in entries])}, type=AppManifest)
    except msgspec.ValidationError as exc:
        raise AppBundleError(f"{toml_path}: {exc}") from None
    _check(manifest, str(toml_path))
    head = sign_manifest(manifest, key)
    target = Path(out)
    if target.exists() and not force:
        raise AppBundleError(f"{target}: exists already (give --force to replace it)")
    if len(head) + manifest.payload_size > BUNDLE_MAX:
        raise AppBundleError(f"{toml_path}: the bundle would be over {BUNDLE_MAX} bytes")
    partial = target.with_name(target.name + ".partial")
    try:
        with partial.open("wb") as f:
            f.write(head)
            for _entry, path in entries:
                with path.open("rb") as src:
                    for block in iter(lambda src=src: src.read(BLOCK), b""):  # type: ignore[misc]
                        f.write(block)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise AppBundleError(f"{target}: {exc.strerror or exc}") from None
    return SignedApp(manifest, None if container else check_unit(manifest.unit, executables=manifest.executables(),
                                                                 source=str(unit_path)), head, key.key_id.hex())


__all__ = ["CHUNKED_FROM", "MAGIC", "SUFFIX", "AppFile", "AppHealth", "AppManifest", "SignedApp", "build_bundle",
           "build_removal", "file_chunks", "head_length", "iter_files", "peek_head", "read_bundle", "read_head",
           "sign_manifest", "verify_head"]
