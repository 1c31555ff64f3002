"""Fixtures for the service tests: a real NOTIFY_SOCKET to receive sd_notify datagrams on."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from svc_notify import NotifyListener


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifyListener]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        yield NotifyListener(sock, str(path))
    finally:
        sock.close()


@pytest.fixture
def abstract_notify_socket() -> Iterator[NotifyListener]:
    name = f"edge-agent-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    try:
        yield NotifyListener(sock, "@" + name)
    finally:
        sock.close()
