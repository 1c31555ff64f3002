"""What the application helper asks of the container runtime (podman), as commands: the helper
runs as root, the runtime's storage is root's (on an A/B device, on the data partition).

The helper itself is sandboxed (a read-only system, no namespaces of its own); podman needs to
write its storage and to enter a container's namespaces for a health check, so each command runs
as a transient unit of its own (`systemd-run --wait --pipe`), beside the helper, not inside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from app_rollout.container import PODMAN, container_name
from app_rollout.device.systemd import run
from app_rollout.errors import AppInstallError

LOAD_TIMEOUT_S = 900.0  # a large image on a slow card
BESIDE = ("systemd-run", "--wait", "--pipe", "--quiet", "--collect", "--service-type=exec", "--")


class Containers:
    """The runtime at `runtime` (podman's command line), each command run after `via` (a
    transient unit beside the helper; () runs it in this process's own context)."""

    def __init__(self, runtime: str = PODMAN, *, via: tuple[str, ...] = BESIDE) -> None:
        self.runtime = runtime
        self.via = via

    @property
    def present(self) -> bool:
        return Path(self.runtime).is_file()

    def _installed(self) -> None:
        if not self.present:
            raise AppInstallError(f"{self.runtime}: not installed: this device runs no container application"
                                  " (install podman)")

    def _run(self, *argv: str, timeout_s: float) -> tuple[int, str]:
        self._installed()
        try:
            done = subprocess.run([*self.via, self.runtime, *argv], stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout_s, check=False)
        except FileNotFoundError as exc:
            raise AppInstallError(f"{exc.filename}: not found") from None
        except subprocess.TimeoutExpired:
            return -1, f"{self.runtime} {argv[0]}: no answer in {timeout_s:g}s"
        return done.returncode, (done.stdout + done.stderr).decode(errors="replace")[-2000:]

    def load(self, archive: Path, image_id: str, *, what: str) -> None:
        """The image of the OCI archive at `archive` loaded, and checked to be `image_id` (the
        config digest the bundle signs); AppInstallError says why not."""
        code, out = self._run("load", "--input", str(archive), timeout_s=LOAD_TIMEOUT_S)
        if code != 0:
            raise AppInstallError(f"{what}: {self.runtime} load: exit {code}: {out.strip()[-300:]}")
        code, out = self._run("image", "inspect", "--format", "{{.Id}}", image_id, timeout_s=120.0)
        if code != 0 or out.strip() != image_id:
            raise AppInstallError(f"{what}: the archive's image is not sha256:{image_id[:12]}... the manifest signs"
                                  f" ({out.strip()[-200:] or 'no such image'})")

    async def healthcheck(self, app: str, *, timeout_s: float) -> tuple[int, str]:
        """The container's own health check run once: 0 healthy."""
        self._installed()
        return await run(*self.via, self.runtime, "healthcheck", "run", container_name(app), timeout_s=timeout_s)

    async def forget(self, image_id: str) -> None:
        """The image removed from the runtime's storage (kept while a container uses it)."""
        if self.present:
            await run(*self.via, self.runtime, "rmi", "--ignore", image_id, timeout_s=120.0)


__all__ = ["Containers"]
