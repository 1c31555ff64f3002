"""A/B slots switched through the U-Boot environment, the way RAUC's U-Boot integration does it.

The boot script (RAUC's example script, unchanged) reads `BOOT_ORDER` ("A B": try A first) and
`BOOT_A_LEFT` / `BOOT_B_LEFT` (boot attempts left): it boots the first slot in the order with
attempts left, takes one attempt away, and passes `rauc.slot=A|B` on the kernel command line.
So:

    arm a trial   the new slot first, its attempts set to `boot_attempts`
    commit        the new slot first, its attempts reset (a healthy start does the same, as
                  RAUC's mark-good does at boot)
    revert        the old slot first with its attempts reset, the failed slot's attempts 0

`EA_TRIAL` names an armed, uncommitted slot (the script ignores it). The booted slot is read from
the kernel command line, never from our own bookkeeping; a trial slot whose attempts ran out
while the old slot booted is a fallback by the bootloader. The environment is read and written
with libubootenv's `fw_printenv` / `fw_setenv -s` (all variables of one step in one write, which
libubootenv makes atomic with a redundant environment), and read back after every write.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated

import msgspec

from agent.core.clock import Clock, SystemClock
from agent.core.tasks import in_thread
from firmware_rollout.device.backends import Backend, BackendSettings, Fail, InstallerContext
from firmware_rollout.device.slot_images import SlotImages
from firmware_rollout.device.slots import SlotView, StreamingInstaller
from firmware_rollout.errors import InstallError
from rollout_engine.keys import Verifier

UBOOT_SLOTS = ("A", "B")
TRIAL_VAR = "EA_TRIAL"
DEFAULT_ENV_FILES = ("/etc/u-boot-initial-env",)  # Debian's u-boot-tools default environment
TOOL_TIMEOUT_S = 30.0
_SLOT_ARG = re.compile(r"(?:^|\s)rauc\.slot=(\S+)")
log = logging.getLogger(__name__)


def booted_from_cmdline(path: Path) -> str:
    """The slot the bootloader named on the kernel command line (`rauc.slot=A`)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InstallError(f"cannot read the kernel command line {path}: {exc.strerror or exc}") from exc
    found = _SLOT_ARG.search(text)
    if found is None or found.group(1) not in UBOOT_SLOTS:
        raise InstallError(f"{path} names no slot (rauc.slot=A or rauc.slot=B): the boot script must pass it")
    return found.group(1)


class UBootInstaller(StreamingInstaller):
    def __init__(self, *, fw_env_config: str | Path, slot_a: str | Path, slot_b: str | Path,
                 cmdline_path: str | Path = "/proc/cmdline", fw_env_defaults: str | Path = "",
                 boot_attempts: int = 3, fw_printenv: str = "fw_printenv", fw_setenv: str = "fw_setenv",
                 clock: Clock | None = None, verify_key: Verifier | None = None) -> None:
        if not 1 <= boot_attempts <= 9:
            raise InstallError(f"boot_attempts must be 1 to 9, not {boot_attempts}")
        self._config = str(fw_env_config)
        self._defaults = str(fw_env_defaults) or next((f for f in DEFAULT_ENV_FILES if Path(f).exists()), "")
        self._attempts = boot_attempts
        self._printenv = fw_printenv
        self._setenv = fw_setenv
        self._clock = clock or SystemClock()
        self._cmdline = Path(cmdline_path)
        self._booted = booted_from_cmdline(self._cmdline)
        self._images = SlotImages({"A": Path(slot_a), "B": Path(slot_b)}, verify_key=verify_key)
        self._env = self._read_env()

    # -- the environment ---------------------------------------------------------------------
    def _run(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                                  check=False)
        except FileNotFoundError:
            raise InstallError(f"{argv[0]} not found: install libubootenv-tool") from None
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InstallError(f"{argv[0]} did not run: {exc}") from exc

    def _read_env(self) -> dict[str, str]:
        done = self._run([self._printenv, "-c", self._config])
        if done.returncode != 0:
            if "Cannot read environment" in done.stderr:
                return {}  # blank: U-Boot runs on its default environment
            raise InstallError(f"{self._printenv} -c {self._config} exited {done.returncode}: "
                               f"{done.stderr.strip()[:200]}")
        env: dict[str, str] = {}
        for line in done.stdout.splitlines():
            name, sep, value = line.partition("=")
            if sep:
                env[name] = value
        return env

    def _write_env(self, changes: dict[str, str]) -> None:
        wanted = {k: v for k, v in changes.items() if self._env.get(k, "") != v}
        if not wanted:
            return
        argv = [self._setenv, "-c", self._config]
        script = "".join(f"{name}={value}\n" for name, value in sorted(wanted.items()))
        with tempfile.TemporaryDirectory(prefix="edge-agent-uboot-") as tmp:
            if not self._env:  # a blank environment: libubootenv starts from a default one
                defaults = self._defaults
                if not defaults:
                    log.warning("the U-Boot environment of %s is blank and no default environment is configured "
                                "([firmware.uboot] fw_env_defaults): it gets only the A/B variables", self._config)
                    defaults = str(Path(tmp) / "defaults")
                    Path(defaults).write_text("".join(f"{k}={v}\n" for k, v in sorted(self._initial().items())))
                argv += ["-f", defaults]
            done = self._run([*argv, "-s", "/dev/stdin"], stdin=script)
        if done.returncode != 0:
            raise InstallError(f"{self._setenv} exited {done.returncode}: {done.stderr.strip()[:200]}")
        self._env = self._read_env()
        wrong = [k for k, v in wanted.items() if self._env.get(k, "") != v]
        if wrong:
            raise InstallError(f"the U-Boot environment did not take {', '.join(sorted(wrong))}")

    def _initial(self) -> dict[str, str]:
        return {"BOOT_ORDER": " ".join(UBOOT_SLOTS), **{f"BOOT_{s}_LEFT": str(self._attempts) for s in UBOOT_SLOTS}}

    async def _set(self, changes: dict[str, str]) -> None:
        await in_thread(self._clock, self._write_env, changes)

    def attempts_left(self, slot: str) -> int | None:
        try:
            return int(self._env[f"BOOT_{slot}_LEFT"])
        except (KeyError, ValueError):
            return None

    # -- the Installer protocol --------------------------------------------------------------
    @property
    def name(self) -> str:
        return "uboot"

    @property
    def slots(self) -> tuple[str, str]:
        return UBOOT_SLOTS

    def booted_slot(self) -> str:
        return self._booted

    def _order(self) -> list[str]:
        order = [s for s in self._env.get("BOOT_ORDER", "").split() if s in UBOOT_SLOTS]
        return order or list(UBOOT_SLOTS)

    def default_slot(self) -> str:
        return self._order()[0]

    def trial_slot(self) -> str | None:
        trial = self._env.get(TRIAL_VAR, "")
        return trial if trial in UBOOT_SLOTS else None

    def fell_back(self) -> bool:
        trial = self.trial_slot()
        return trial is not None and trial != self._booted and self.attempts_left(trial) == 0

    async def mark_trial(self, slot: str) -> None:
        other = self.other(slot)
        self._require_checked(slot)
        await self._set({"BOOT_ORDER": f"{slot} {other}", f"BOOT_{slot}_LEFT": str(self._attempts),
                         TRIAL_VAR: slot})

    async def commit(self, slot: str) -> None:
        other = self.other(slot)
        await self._set({"BOOT_ORDER": f"{slot} {other}", f"BOOT_{slot}_LEFT": str(self._attempts), TRIAL_VAR: ""})

    async def revert(self, slot: str) -> None:
        other = self.other(slot)
        changes = {"BOOT_ORDER": f"{slot} {other}", f"BOOT_{slot}_LEFT": str(self._attempts), TRIAL_VAR: ""}
        if self.trial_slot() == other:  # the failed trial: what RAUC's mark-bad does
            changes[f"BOOT_{other}_LEFT"] = "0"  # (a committed slot keeps its attempts: it may be the good one)
        await self._set(changes)

    def describe(self) -> SlotView:
        return {"fw_env_config": self._config, "boot_order": " ".join(self._order()),
                "attempts_left": {s: self.attempts_left(s) for s in UBOOT_SLOTS},
                "slot_targets": {s: str(self._images.target(s)) for s in UBOOT_SLOTS},
                "cmdline": str(self._cmdline)}


class UBootSettings(BackendSettings, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`[firmware.uboot]`: A/B slots switched through the U-Boot environment (RAUC's variables)."""

    fw_env_config: str = "/etc/fw_env.config"  # libubootenv's config: where the environment lives
    # a default environment for a blank one (empty: /etc/u-boot-initial-env when it exists)
    fw_env_defaults: str = ""
    slot_a: str = ""  # the block device (or file) of slot A, e.g. /dev/mmcblk0p2
    slot_b: str = ""
    cmdline_path: str = "/proc/cmdline"  # where the boot script's rauc.slot=A|B is read
    boot_attempts: Annotated[int, msgspec.Meta(ge=1, le=9)] = 3
    fw_printenv: str = "fw_printenv"
    fw_setenv: str = "fw_setenv"


def _check(u: UBootSettings, fail: Fail) -> None:
    for key in ("slot_a", "slot_b"):
        if not getattr(u, key):
            fail(key, "required: the block device or file of the slot")
    if u.slot_a == u.slot_b:
        fail("slot_b", "must differ from slot_a")


def _preflight(u: UBootSettings, fail: Fail) -> None:
    for key, tool in (("fw_printenv", u.fw_printenv), ("fw_setenv", u.fw_setenv)):
        if shutil.which(tool) is None:
            fail(key, f"{tool!r} is not an executable on PATH (Debian: apt install libubootenv-tool)")
    for key, file in (("fw_env_config", u.fw_env_config), ("slot_a", u.slot_a), ("slot_b", u.slot_b),
                      ("cmdline_path", u.cmdline_path), ("fw_env_defaults", u.fw_env_defaults)):
        if file and not Path(file).exists():
            fail(key, f"{file}: not found")
    try:
        booted_from_cmdline(Path(u.cmdline_path))
    except InstallError as exc:
        fail("cmdline_path", str(exc))


def _build(u: UBootSettings, context: InstallerContext) -> UBootInstaller:
    return UBootInstaller(fw_env_config=u.fw_env_config, fw_env_defaults=u.fw_env_defaults, slot_a=u.slot_a,
                          slot_b=u.slot_b, cmdline_path=u.cmdline_path, boot_attempts=u.boot_attempts,
                          fw_printenv=u.fw_printenv, fw_setenv=u.fw_setenv, clock=context.clock,
                          verify_key=context.verify_key)


BACKEND = Backend(name="uboot", settings=UBootSettings, build=_build, table_required=True, check=_check,
                  preflight=_preflight)


__all__ = ["BACKEND", "UBOOT_SLOTS", "UBootInstaller", "UBootSettings", "booted_from_cmdline"]
