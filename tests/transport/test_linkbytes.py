"""The kernel's counters of a broker connection, summed over connections."""

from __future__ import annotations

import socket
import sys

import pytest

from agent.transport.linkbytes import TCP_IP_HEADER_BYTES, LinkCounters, TcpCounters, read_tcp

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO counters are Linux's")


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    return client, peer


def _move(sender: socket.socket, receiver: socket.socket, size: int) -> None:
    sender.sendall(b"x" * size)
    got = 0
    while got < size:
        got += len(receiver.recv(65536))


def test_the_kernel_counts_what_a_connection_moved_each_way() -> None:
    client, peer = _pair()
    with client, peer:
        _move(client, peer, 10_000)
        _move(peer, client, 3_000)
        mine = read_tcp(client)
        assert mine is not None
        assert mine.bytes_sent == 10_000 and mine.bytes_received == 3_000
        assert mine.segs_out >= 2 and mine.segs_in >= 2  # the handshake's and the data's
        assert mine.on_air == 13_000 + TCP_IP_HEADER_BYTES * (mine.segs_out + mine.segs_in)
    assert read_tcp(client) is None  # closed: nothing to read
    assert read_tcp(object()) is None


def test_link_counters_add_up_every_connection_up_to_its_last_reading() -> None:
    link = LinkCounters()
    assert link.total() == TcpCounters()
    first, peer = _pair()
    with peer:
        link.attach(first)
        _move(first, peer, 1_000)
        assert link.total().bytes_sent == 1_000
        _move(first, peer, 500)
        first.close()  # ended before it was read again: its last 500 bytes are not counted
        link.attach(None)
    assert link.total().bytes_sent == 1_000
    second, peer = _pair()
    with second, peer:
        link.attach(second)
        _move(second, peer, 2_000)
        _move(peer, second, 700)
        link.attach(None)  # ended while still open: read once more
        total = link.total()
    assert (total.bytes_sent, total.bytes_received) == (3_000, 700)
