"""A U-Boot A/B bench board on this machine: Debian's real U-Boot for QEMU decides every boot.

The board is a folder: a 64 MiB flash bank holding U-Boot's environment (where U-Boot for QEMU's
`virt` machine keeps it, read and written by libubootenv's `fw_setenv` with the config line
`FLASH 0x0 0x40000 0x40000`), two slot files, and the kernel command line the agent reads
(`rauc.slot=X`). The environment's `bootcmd` is RAUC's U-Boot logic: the first slot in
`BOOT_ORDER` with attempts left (`BOOT_x_LEFT`) is chosen and one attempt is spent; no slot left
resets the attempts, as RAUC's script does. A power-cycle runs that U-Boot in QEMU (about half a
second, no KVM, no network), reads its choice from the serial console, and then writes the
attempt it spent back with `fw_setenv`: the one step this QEMU cannot do itself (`saveenv` times
out on its emulated flash and leaves the bank erased).

    scripts/bench-board.sh DIR                   make the board; print the worker's [firmware] lines
    scripts/bench-board.sh DIR boot              power-cycle once: U-Boot's choice and what it printed
    scripts/bench-board.sh DIR run CONFIG        run `edge-agent run --config CONFIG` on the board:
                                                 whenever the agent ends (its reboot_command ends it,
                                                 as a reboot takes the power), power-cycle through
                                                 U-Boot and start it again, until Ctrl-C
    scripts/bench-board.sh DIR env               the environment, as fw_printenv prints it

Needs `qemu-system-aarch64` and `/usr/lib/u-boot/qemu_arm64/u-boot.bin` (Debian's
qemu-system-arm and u-boot-qemu) and `fw_setenv` (libubootenv-tool). Standard library only.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

UBOOT_BIN = Path("/usr/lib/u-boot/qemu_arm64/u-boot.bin")
QEMU = "qemu-system-aarch64"
FLASH_BYTES = 64 * 1024 * 1024
ENV_OFFSET, ENV_BYTES = 0x0, 0x40000  # U-Boot for QEMU virt: the environment at the start of the second bank
SLOT_BYTES = 4 * 1024 * 1024
ATTEMPTS = 3

# RAUC's U-Boot boot logic (rauc docs, "U-Boot": BOOT_ORDER, BOOT_x_LEFT), as one hush line: the
# first slot with attempts left is chosen and one attempt spent; none left resets the attempts.
# It prints its choice and powers off instead of loading a kernel (the bench has none).
BOOT_SCRIPT = (
    "setenv ea_slot; "
    "for s in ${BOOT_ORDER}; do if test -z \"${ea_slot}\"; then "
    "if test \"${s}\" = \"A\" && test ${BOOT_A_LEFT} -gt 0; then setexpr BOOT_A_LEFT ${BOOT_A_LEFT} - 1; "
    "setenv ea_slot A; setenv ea_left ${BOOT_A_LEFT}; fi; "
    "if test \"${s}\" = \"B\" && test ${BOOT_B_LEFT} -gt 0; then setexpr BOOT_B_LEFT ${BOOT_B_LEFT} - 1; "
    "setenv ea_slot B; setenv ea_left ${BOOT_B_LEFT}; fi; "
    "fi; done; "
    "if test -n \"${ea_slot}\"; then echo \"EA-BOOT slot=${ea_slot} left=${ea_left}\"; "
    f"else echo \"EA-BOOT none\"; setenv BOOT_A_LEFT {ATTEMPTS}; setenv BOOT_B_LEFT {ATTEMPTS}; fi; "
    "poweroff"
)
CHOICE = re.compile(r"EA-BOOT (?:slot=(?P<slot>[AB]) left=(?P<left>[0-9a-f]+)|(?P<none>none))")


class BenchError(Exception):
    """The bench cannot do what was asked; the message says why, in one line."""


@dataclass(frozen=True)
class Boot:
    slot: str | None  # the slot U-Boot chose (None: none had attempts left; they were reset)
    left: int  # the chosen slot's attempts after this boot
    console: str  # what U-Boot printed on its serial console


class UBootBench:
    """The board in `root`; `make()` creates it (a blank, provisioned environment)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.flash = root / "flash1.img"
        self.config = root / "fw_env.config"
        self.slots = {"A": root / "slot-a.img", "B": root / "slot-b.img"}
        self.cmdline = root / "cmdline"
        self.boots: list[str] = []

    @staticmethod
    def missing() -> str:
        """What this machine lacks for the bench ("" when nothing)."""
        lacking = [name for name, ok in ((QEMU, shutil.which(QEMU)), (str(UBOOT_BIN), UBOOT_BIN.is_file()),
                                         ("fw_setenv", shutil.which("fw_setenv"))) if not ok]
        return ", ".join(lacking)

    def make(self, *, order: str = "A B") -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with self.flash.open("wb") as f:  # an erased bank reads as zeros here; U-Boot checks the CRC
            f.truncate(FLASH_BYTES)
        self.config.write_text(f"{self.flash} 0x{ENV_OFFSET:x} 0x{ENV_BYTES:x} 0x{ENV_BYTES:x}\n")
        for path in self.slots.values():
            with path.open("wb") as f:
                f.truncate(SLOT_BYTES)
        defaults = self.root / "u-boot-initial-env"
        defaults.write_text(f"bootdelay=0\nBOOT_ORDER={order}\nBOOT_A_LEFT={ATTEMPTS}\nBOOT_B_LEFT={ATTEMPTS}\n"
                            f"bootcmd={BOOT_SCRIPT}\n")
        self._fw_setenv(["-f", str(defaults), "BOOT_ORDER", order])
        self.cmdline.write_text(f"console=ttyAMA0 rauc.slot={order.split()[0]}\n")

    def printenv(self) -> dict[str, str]:
        done = subprocess.run(["fw_printenv", "-c", str(self.config)], capture_output=True, text=True, check=False)
        return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def boot(self, *, timeout_s: float = 120.0) -> Boot:
        """Power-cycle: U-Boot in QEMU reads the environment, chooses, powers off; the attempt it
        spent is written back and the command line says which slot runs."""
        if not self.flash.is_file():
            raise BenchError(f"{self.root}: no board here (make it first)")
        argv = [QEMU, "-M", "virt", "-cpu", "cortex-a57", "-m", "256", "-nographic", "-nic", "none",
                "-bios", str(UBOOT_BIN), "-drive", f"if=pflash,format=raw,index=1,file={self.flash}", "-no-reboot"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise BenchError(f"U-Boot did not power off within {timeout_s:.0f} s") from None
        console = done.stdout + done.stderr
        if "Loading Environment from Flash... OK" not in console:
            raise BenchError("U-Boot did not load the board's environment (see its console): " + _tail(console))
        found = CHOICE.search(console)
        if found is None:
            raise BenchError("U-Boot ran no boot script of the bench: " + _tail(console))
        if found["none"]:
            self._fw_setenv(["BOOT_A_LEFT", str(ATTEMPTS)])
            self._fw_setenv(["BOOT_B_LEFT", str(ATTEMPTS)])
            return Boot(None, ATTEMPTS, console)
        slot, left = found["slot"], int(found["left"], 16)  # setexpr prints hex
        self._fw_setenv([f"BOOT_{slot}_LEFT", str(left)])  # what saveenv would have written
        self.cmdline.write_text(f"console=ttyAMA0 rauc.slot={slot}\n")
        self.boots.append(slot)
        return Boot(slot, left, console)

    def worker_toml(self) -> str:
        """The worker's lines for this board."""
        return (f'[firmware]\ninstaller = "uboot"\n\n[firmware.uboot]\nfw_env_config = "{self.config}"\n'
                f'slot_a = "{self.slots["A"]}"\nslot_b = "{self.slots["B"]}"\ncmdline_path = "{self.cmdline}"\n')

    def _fw_setenv(self, args: list[str]) -> None:
        done = subprocess.run(["fw_setenv", "-c", str(self.config), *args], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise BenchError(f"fw_setenv {' '.join(args[:2])}: {(done.stderr or done.stdout).strip()}")


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def _run_agent(bench: UBootBench, config: str) -> int:
    """Run the agent on the board; each time it ends, power-cycle and start it again."""
    cycles = 0
    try:
        while True:
            chosen = bench.boot()
            cycles += 1
            print(f"power-cycle {cycles}: U-Boot chose slot {chosen.slot} ({chosen.left} attempts left)", flush=True)
            agent = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--config", config], check=False)
            print(f"the agent ended (exit {agent.returncode}): power-cycling", flush=True)
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-board.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the board's folder")
    parser.add_argument("action", nargs="?", default="make", choices=("make", "boot", "run", "env"))
    parser.add_argument("config", nargs="?", help="run: the worker's config (with the lines `make` printed)")
    args = parser.parse_args(argv)
    missing = UBootBench.missing()
    if missing:
        print(f"bench-board: missing {missing} (apt-get install qemu-system-arm u-boot-qemu libubootenv-tool)",
              file=sys.stderr)
        return 2
    bench = UBootBench(args.dir.resolve())
    try:
        if args.action == "make":
            bench.make()
            print(f"# a U-Boot A/B board in {bench.root}; add to the worker's config:\n{bench.worker_toml()}"
                  '# and make its reboot end the agent (the supervisor power-cycles the board):\n'
                  '# reboot_command = ["sh", "-c", "kill -KILL $PPID"]   (under [firmware])')
        elif args.action == "boot":
            chosen = bench.boot()
            print(f"U-Boot chose slot {chosen.slot} ({chosen.left} attempts left)" if chosen.slot
                  else "U-Boot found no slot with attempts left: reset them")
        elif args.action == "env":
            for key, value in sorted(bench.printenv().items()):
                if key != "bootcmd":
                    print(f"{key}={value}")
        else:
            if not args.config:
                parser.error("run needs the worker's config")
            return _run_agent(bench, args.config)
    except BenchError as exc:
        print(f"bench-board: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
