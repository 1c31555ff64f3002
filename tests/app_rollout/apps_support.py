"""Application bundles for the tests: a directory with app.toml, a unit and its files, built and
signed with a fresh fleet key."""

from __future__ import annotations

import os
from pathlib import Path

from rollout_engine.keys import SigningKey

SERVER = """#!/bin/sh
# a test application: answers HTTP on its port, keeps a counter in its data directory
echo started >> "$STATE_DIRECTORY/starts"
exec sleep infinity
"""

UNIT = """[Unit]
Description=hello, a test application
After=network-online.target

[Service]
Type=exec
ExecStart=bin/server --port 8080
Restart=on-failure
RestartSec=1
Environment=GREETING=hi

[Install]
WantedBy=multi-user.target
"""


def app_dir(root: Path, *, name: str = "hello", version: str = "1.0.0", unit: str = UNIT,
            health: str = 'check = "active"\nsettle_s = 1\ntimeout_s = 30',
            files: dict[str, tuple[str, int]] | None = None) -> Path:
    """A directory `edge-agent app build` takes: app.toml, hello.service, files/."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "app.toml").write_text(f'[app]\nname = "{name}"\nversion = "{version}"\nunit = "hello.service"\n'
                                   f'files = "files"\n\n[health]\n{health}\n')
    (root / "hello.service").write_text(unit)
    for path, (content, mode) in (files or {"bin/server": (SERVER, 0o755), "share/greeting.txt": ("hi\n", 0o644)}
                                  ).items():
        target = root / "files" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        os.chmod(target, mode)
    return root


def fleet_key(directory: Path) -> tuple[SigningKey, Path, Path]:
    """A signing key, and its private and public PEM files in `directory`."""
    key = SigningKey.generate()
    directory.mkdir(parents=True, exist_ok=True)
    private, public = directory / "private.pem", directory / "public.pem"
    private.write_bytes(key.to_pem())
    os.chmod(private, 0o600)
    public.write_bytes(key.public.to_pem())
    return key, private, public
