"""A remote session's window and frames (`agent.remote.flow`, `agent.remote.frames`): whatever the
sizes written and however late the receiver delivers, the bytes arrive whole and in order and
never more than the window is in flight (a property); a lost frame, an acknowledgement of bytes
never sent and a sender past the window end the session; every frame field is bounded."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.remote.flow import FlowError, Receiver, RelayWindow, Sender
from agent.remote.frames import (
    FRAME_DATA_MAX,
    FRAME_MAX,
    WINDOW_BYTES,
    Ack,
    Data,
    FrameError,
    Open,
    decode,
    encode,
)


@settings(max_examples=60, deadline=None)
@given(writes=st.lists(st.integers(0, 3 * FRAME_DATA_MAX), min_size=1, max_size=40),
       delays=st.lists(st.integers(0, 3), min_size=1, max_size=20))
def test_bytes_arrive_whole_in_order_and_never_beyond_the_window(writes: list[int], delays: list[int]) -> None:
    async def run() -> None:
        wire: asyncio.Queue[Data] = asyncio.Queue()
        receiver = Receiver("s")
        got = bytearray()
        flight = 0

        async def send(frame: Data) -> None:
            nonlocal flight
            await wire.put(frame)
            flight = max(flight, sender.sent - sender.acked)

        sender = Sender("s", send)
        sent = b"".join(bytes([n % 251]) * n for n in writes)

        async def write() -> None:
            for n in writes:
                await sender.send(bytes([n % 251]) * n)

        async def deliver() -> None:
            turn = 0
            while len(got) < len(sent):
                frame = await wire.get()
                receiver.take(frame)
                for _ in range(delays[turn % len(delays)]):  # a slow sink
                    await asyncio.sleep(0)
                turn += 1
                got.extend(frame.data)
                ack = receiver.delivered(len(frame.data))
                if ack is not None:
                    sender.ack(ack)

        await asyncio.wait_for(asyncio.gather(write(), deliver()), 30)
        assert bytes(got) == sent
        assert flight <= WINDOW_BYTES

    asyncio.run(run())


def test_a_lost_frame_an_ack_of_nothing_and_a_sender_past_the_window_end_it() -> None:
    receiver = Receiver("s")
    receiver.take(Data(sid="s", seq=1, data=b"a"))
    with pytest.raises(FlowError, match="a frame was lost"):
        receiver.take(Data(sid="s", seq=3, data=b"c"))

    async def nowhere(frame: Data) -> None:
        return None

    sender = Sender("s", nowhere)
    with pytest.raises(FlowError, match="when 0 were sent"):
        sender.ack(Ack(sid="s", upto=10))
    flooded = Receiver("s")
    with pytest.raises(FlowError, match="more than the window"):
        for seq in range(1, WINDOW_BYTES // FRAME_DATA_MAX + 2):
            flooded.take(Data(sid="s", seq=seq, data=b"x" * FRAME_DATA_MAX))


@pytest.mark.parametrize("frame", [
    b"\xc1",
    b"\x00" * (FRAME_MAX + 1),
    encode(Data(sid="s", seq=1, data=b"")).replace(b"data", b"dat\xa1"),
    b"\x82\xa1t\xa4open\xa6device" + b"\xda\x01\x00" + b"x" * 256,  # a device name beyond 128
])
def test_frames_that_are_not_ones_are_refused(frame: bytes) -> None:
    with pytest.raises(FrameError):
        decode(frame)


def test_every_field_is_bounded() -> None:
    with pytest.raises(FrameError):
        decode(encode(Open(device="pi-1", op="shell", argv=("x" * 5000,))))
    with pytest.raises(FrameError):
        decode(encode(Data(sid="../../etc", seq=1, data=b"")))
    assert decode(encode(Open(device="pi-1", op="forward", host="127.0.0.1", port=80))) == Open(
        device="pi-1", op="forward", host="127.0.0.1", port=80)


def test_a_relay_passes_a_window_on_and_refuses_a_sender_past_it_or_an_ack_of_bytes_never_sent() -> None:
    window = RelayWindow()
    frame = Data(sid="s", seq=1, data=b"x" * FRAME_DATA_MAX)
    for _ in range(WINDOW_BYTES // FRAME_DATA_MAX + 1):  # the window, and the frame under way
        window.pass_on(frame)
    window.ack(Ack(sid="s", upto=FRAME_DATA_MAX))
    window.pass_on(frame)  # room again
    with pytest.raises(FlowError, match="more than the window"):
        window.pass_on(frame)
    with pytest.raises(FlowError, match="never sent"):
        window.ack(Ack(sid="s", upto=window.passed + 1))
    window.ack(Ack(sid="s", upto=FRAME_DATA_MAX - 1))  # an older ack changes nothing
    assert window.acked == FRAME_DATA_MAX
