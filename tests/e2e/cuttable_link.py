"""A TCP link between an agent and its broker that a file cuts: while CUT_FILE exists every
connection through it is closed and a new one is refused at once, as a device whose network
configuration broke would see it. Run as its own process:

    python cuttable_link.py PORT_FILE BROKER_PORT CUT_FILE

It listens on a free loopback port and writes that port to PORT_FILE once it accepts."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

CHECK_S = 0.05


async def main(port_file: Path, broker_port: int, cut: Path) -> None:
    open_links: set[asyncio.StreamWriter] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if cut.exists():
            writer.close()
            return
        try:
            b_reader, b_writer = await asyncio.open_connection("127.0.0.1", broker_port)
        except OSError:
            writer.close()
            return
        open_links.update((writer, b_writer))
        await asyncio.gather(pipe(reader, b_writer), pipe(b_reader, writer))
        open_links.difference_update((writer, b_writer))

    server = await asyncio.start_server(link, "127.0.0.1", 0)
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(server.sockets[0].getsockname()[1]))
    tmp.rename(port_file)
    while True:  # the cut is a file another process makes: looked at every CHECK_S
        if cut.exists():
            for w in list(open_links):
                w.transport.abort()
            open_links.clear()
        await asyncio.sleep(CHECK_S)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])))
