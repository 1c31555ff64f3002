"""The installer backends table: `[firmware] installer` names a backend, its own table is the
backend's settings, and a mistake in it is one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.core.clock import VirtualClock
from agent.core.config import load_config
from agent.core.errors import ConfigError
from firmware_rollout.device.backends import BACKENDS, InstallerContext, backend_named, configured_backend
from firmware_rollout.device.rauc import RaucSettings
from firmware_rollout.device.slots import DirectoryInstaller
from rollout_engine.keys import generate_keypair

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, firmware: str) -> Path:
    path = tmp_path / "worker.toml"
    path.write_text(f'[agent]\ndevice_id = "pi-1"\n\n[firmware]\n{firmware}\n')
    return path


def test_every_backend_of_the_table_is_its_module_s_entry() -> None:
    for name in BACKENDS:
        backend = backend_named(name, source="t")
        assert backend.name == name


def test_the_named_backend_s_table_is_its_settings(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, 'installer = "rauc"\n[firmware.rauc]\nslot_class = "appfs"'))
    backend = configured_backend(config.firmware, source="worker.toml")
    assert backend.name == "rauc" and backend.settings == RaucSettings(slot_class="appfs")


def test_a_backend_without_a_table_gets_its_defaults_unless_it_needs_one(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, 'installer = "rauc"'))
    assert configured_backend(config.firmware).settings == RaucSettings()
    default = load_config(write(tmp_path, ""))
    assert isinstance(configured_backend(default.firmware).build(InstallerContext(tmp_path, VirtualClock(), None)),
                      DirectoryInstaller)
    needs = load_config(write(tmp_path, 'installer = "uboot"'))
    with pytest.raises(ConfigError) as err:
        configured_backend(needs.firmware, source="worker.toml")
    assert err.value.key == "firmware.uboot" and "needs a [firmware.uboot] table" in err.value.reason


@pytest.mark.parametrize(("firmware", "key", "reason"), [
    ('installer = "uboot"\n[firmware.uboot]\nslot_a = "/dev/a"\nslot_b = "/dev/a"', "firmware.uboot.slot_b",
     "must differ from slot_a"),
    ('installer = "uboot"\n[firmware.uboot]\nslot_a = "/dev/a"', "firmware.uboot.slot_b", "required"),
    ('installer = "uboot"\n[firmware.uboot]\nslot_a = "/a"\nslot_b = "/b"\nboot_attempts = 0',
     "firmware.uboot.boot_attempts", ">= 1"),
    ('installer = "rauc"\n[firmware.rauc]\nslots = 2', "firmware.rauc.slots", "unknown key"),
    ('installer = "tryboot"\n[firmware.tryboot]\nslot_a = { partition = 2, boot = "/dev/p2" }',
     "firmware.tryboot.slot_b", "required"),
    ('installer = "grub"', "firmware.installer", "no installer 'grub'"),
])
def test_a_mistake_in_the_backend_s_table_names_the_key(tmp_path: Path, firmware: str, key: str,
                                                         reason: str) -> None:
    config = load_config(write(tmp_path, firmware))
    with pytest.raises(ConfigError) as err:
        configured_backend(config.firmware, source="worker.toml")
    assert err.value.key == key and reason in err.value.reason and err.value.path == "worker.toml"


def test_another_backend_s_table_is_an_unknown_key_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, 'installer = "rauc"\n[firmware.uboot]\nslot_a = "/dev/a"'))
    assert err.value.key == "firmware.uboot" and err.value.reason == "unknown key"


def test_config_check_names_the_backend_s_key_in_one_line(tmp_path: Path) -> None:
    keys = generate_keypair(tmp_path / "keys")
    path = write(tmp_path, f'public_key = "{keys.public}"\ninstaller = "uboot"\n[firmware.uboot]\nslot_a = "/x"')
    done = subprocess.run([sys.executable, "-m", "agent.cli", "config", "check", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "firmware.uboot.slot_b: required" in done.stderr


def test_the_agent_s_config_module_knows_no_backend() -> None:
    text = (REPO / "agent" / "core" / "config.py").read_text().lower()
    for name in BACKENDS:
        if name != "directory":
            assert name not in text, f"agent/core/config.py names the {name} backend"
