"""Which addresses a device forwards to (`remote.forward`), and the CLI's ssh -L spec: one line
naming what is wrong."""

from __future__ import annotations

import pytest

from agent.commands.remote import forward_spec
from agent.core.errors import ConfigError
from agent.worker.remote import allowed

RULES = ("127.0.0.1:8080", "localhost:*", "[::1]:22")


@pytest.mark.parametrize(("host", "port", "ok"), [
    ("127.0.0.1", 8080, True), ("127.0.0.1", 8081, False), ("localhost", 5432, True),
    ("::1", 22, True), ("10.0.0.1", 8080, False), ("127.0.0.10", 8080, False),
])
def test_only_the_listed_addresses_are_forwarded_to(host: str, port: int, ok: bool) -> None:
    assert allowed(RULES, host, port) is ok


def test_the_spec_is_ssh_ls_shape() -> None:
    assert forward_spec("8080:127.0.0.1:80") == ("127.0.0.1", 8080, "127.0.0.1", 80)
    assert forward_spec("0.0.0.0:0:db:5432") == ("0.0.0.0", 0, "db", 5432)
    for bad in ("8080", "x:127.0.0.1:80", "8080:127.0.0.1:0", "8080::80", "99999:h:80"):
        with pytest.raises(ConfigError, match="forward"):
            forward_spec(bad)
