"""Container images for the tests, made here with no registry: OCI archives (as `podman save
--format oci-archive` writes them, layers uncompressed) of a static busybox base layer and a
small layer of the application's own, and the container application `web` built from one."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

from tests.identity_broker import cli

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: runs in an image with nothing else
APPLETS = ("sh", "httpd", "wget", "test", "cat", "echo", "sleep", "wc")
REF = "localhost/web"


def _tar(entries: list[tuple[str, bytes | None, int, str]]) -> bytes:
    """A layer: (path, bytes or None for a directory, mode, link target or "")."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, data, mode, link in entries:
            info = tarfile.TarInfo(path)
            info.mtime, info.mode = 0, mode
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def base_layer(padding: int = 0) -> bytes:
    """busybox and its applets, /tmp, /www and /data (`padding` bytes of a file that never
    changes: a larger base, as a real one is)."""
    entries: list[tuple[str, bytes | None, int, str]] = [
        ("bin", None, 0o755, ""), ("bin/busybox", BUSYBOX.read_bytes(), 0o755, ""),
        *((f"bin/{applet}", None, 0o777, "busybox") for applet in APPLETS),
        ("tmp", None, 0o1777, ""), ("www", None, 0o755, ""), ("data", None, 0o777, "")]
    if padding:
        entries.append(("usr", None, 0o755, ""))
        entries.append(("usr/base.bin", hashlib.shake_256(b"base").digest(padding), 0o644, ""))
    return _tar(entries)


def content_layer(files: dict[str, bytes]) -> bytes:
    return _tar([(path, data, 0o644, "") for path, data in sorted(files.items())])


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def oci_archive(out: Path, layers: list[bytes], *, cmd: list[str], ref: str = REF,
                architecture: str = "amd64") -> str:
    """The OCI archive of an image of `layers` at `out`; its ID (the config's sha256)."""
    config = json.dumps({"architecture": architecture, "os": "linux", "config": {"Cmd": cmd},
                         "rootfs": {"type": "layers", "diff_ids": [_digest(layer) for layer in layers]}},
                        sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": _digest(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": _digest(layer),
                    "size": len(layer)} for layer in layers]}, sort_keys=True).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _digest(manifest),
        "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": ref}}]}).encode()
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        add("index.json", index)
        for blob in (config, manifest, *layers):
            add("blobs/sha256/" + _digest(blob)[7:], blob)
    return _digest(config)[7:]


COMPOSE = """\
services:
  web:
    image: {ref}:{version}
    command:
      - /bin/sh
      - -c
      - >-
        echo $APP_VERSION >> /data/starts; echo WEB: $APP_VERSION up starts=$(wc -l < /data/starts);
        trap 'exit 0' TERM; httpd -f -p 8080 -h /www & wait
    network_mode: none
    volumes:
      - data:/data
    environment:
      GREETING: "hello from {version}"
    healthcheck:
      test: ["CMD", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8080/healthz"]
      interval: 10s
      timeout: 5s
      retries: 3
volumes:
  data:
"""


def web_app(tmp: Path, version: str, *, healthy: bool, padding: int = 0, timeout_s: float = 120.0,
            settle_s: float = 3.0) -> Path:
    """The folder of container application `web` at `version`: app.toml, compose.yaml and its
    image (busybox's httpd serving the version; /healthz missing unless `healthy`)."""
    src = tmp / f"web-{version}"
    if src.exists():
        shutil.rmtree(src)
    (src / "files" / "images").mkdir(parents=True)
    www = {"www/index.html": f"web {version}\n".encode()}
    if healthy:
        www["www/healthz"] = b"ok\n"
    oci_archive(src / "files" / "images" / "web.tar", [base_layer(padding), content_layer(www)],
                cmd=["/bin/httpd", "-f", "-p", "8080", "-h", "/www"], ref=f"{REF}:{version}")
    (src / "compose.yaml").write_text(COMPOSE.format(ref=REF, version=version))
    (src / "app.toml").write_text(f'[app]\nname = "web"\nversion = "{version}"\ncompose = "compose.yaml"\n\n'
                                  f'[images]\n"{REF}:{version}" = "images/web.tar"\n\n'
                                  f'[health]\ncheck = "container"\nsettle_s = {settle_s:g}\n'
                                  f'timeout_s = {timeout_s:g}\n')
    return src


def web_bundle(tmp: Path, version: str, private: Path, *, healthy: bool, padding: int = 0,
               timeout_s: float = 120.0) -> Path:
    """web-VERSION.eaapp, built and signed by `edge-agent app build`."""
    src = web_app(tmp, version, healthy=healthy, padding=padding, timeout_s=timeout_s)
    out = tmp / f"web-{version}.eaapp"
    built = cli("app", "build", str(src), "--key", str(private), "--out", str(out))
    assert built.returncode == 0, built.stderr
    return out


__all__ = ["BUSYBOX", "base_layer", "content_layer", "oci_archive", "web_app", "web_bundle"]
