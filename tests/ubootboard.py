"""A file-backed U-Boot board for the installer tests: a libubootenv environment file, two slot
files and a kernel command line. `boot()` does what RAUC's U-Boot script does at power-on: the
first slot in BOOT_ORDER with attempts left, one attempt taken away, `rauc.slot=X` on the
command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from firmware_rollout.device.uboot import UBootInstaller

SLOT_BYTES = 1024 * 1024
ENV_BYTES = 16 * 1024


class Board:
    """A file-backed U-Boot board: its environment, two slot files and the kernel command line."""

    def __init__(self, root: Path, *, provisioned: bool = True) -> None:
        """`provisioned`: the factory saved an environment with the A/B variables (else it is blank)."""
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.env = root / "uboot.env"
        self.env.write_bytes(bytes(ENV_BYTES))
        self.config = root / "fw_env.config"
        self.config.write_text(f"{self.env} 0x0000 0x{ENV_BYTES:x}\n")
        self.slots = {"A": root / "slot-a.img", "B": root / "slot-b.img"}
        for path in self.slots.values():
            path.write_bytes(bytes(SLOT_BYTES))
        self.cmdline = root / "cmdline"
        self.cmdline.write_text("console=ttyS0 root=/dev/mmcblk0p2 rauc.slot=A\n")
        self.boots: list[str] = []
        if provisioned:
            defaults = root / "u-boot-initial-env"
            defaults.write_text("bootcmd=run distro_bootcmd\nBOOT_ORDER=A B\nBOOT_A_LEFT=3\nBOOT_B_LEFT=3\n")
            subprocess.run(["fw_setenv", "-c", str(self.config), "-f", str(defaults), "BOOT_ORDER", "A B"],
                           check=True, capture_output=True)

    def printenv(self) -> dict[str, str]:
        done = subprocess.run(["fw_printenv", "-c", str(self.config)], capture_output=True, text=True, check=False)
        return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def boot(self) -> str:
        """What RAUC's boot script does at power-on."""
        env = self.printenv()
        for slot in env.get("BOOT_ORDER", "A B").split():
            left = int(env.get(f"BOOT_{slot}_LEFT", "3"))
            if left > 0:
                subprocess.run(["fw_setenv", "-c", str(self.config), f"BOOT_{slot}_LEFT", str(left - 1)], check=True,
                               capture_output=True)
                self.cmdline.write_text(f"console=ttyS0 rauc.slot={slot}\n")
                self.boots.append(slot)
                return slot
        raise AssertionError("no slot left to boot")

    def installer(self) -> UBootInstaller:
        return UBootInstaller(fw_env_config=self.config, slot_a=self.slots["A"], slot_b=self.slots["B"],
                              cmdline_path=self.cmdline)

    def toml(self) -> str:
        """The worker's `[firmware.uboot]` table for this board."""
        a, b = self.slots["A"], self.slots["B"]
        return (f'[firmware.uboot]\nfw_env_config = "{self.config}"\nslot_a = "{a}"\nslot_b = "{b}"\n'
                f'cmdline_path = "{self.cmdline}"\n')


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_board import UBootBench  # noqa: E402  (the operator's bench board, scripts/bench_board.py)


class QemuBoard(Board):
    """The bench board: the same files, but every boot is decided by Debian's real U-Boot in
    QEMU running RAUC's boot logic from the environment (`scripts/bench_board.py`)."""

    def __init__(self, root: Path) -> None:  # (not Board's: the environment lives in a flash bank)
        self.bench = UBootBench(root)
        self.bench.make()
        self.root, self.config, self.slots, self.cmdline = root, self.bench.config, self.bench.slots, self.bench.cmdline
        self.boots = self.bench.boots
        self.consoles: list[str] = []  # what U-Boot printed at each boot

    def boot(self) -> str:
        chosen = self.bench.boot()
        self.consoles.append(chosen.console)
        assert chosen.slot is not None, "U-Boot found no slot with attempts left"
        return chosen.slot
