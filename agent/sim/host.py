"""A process running one part of a simulated fleet's devices, in step with the leader's process.

    python -m agent.sim.host FD

Started by `agent.sim.processes.HostLink` with FD, its end of a socket: it reads the run's options
and its part, then serves rounds and calls until told to stop (`PartSimulation.serve`). A failure is sent
back as one line, which the leader's process reports.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path


def main(argv: list[str]) -> int:
    from agent.sim.processes import Channel, PartSimulation

    # as `edge-agent simulate` does: the devices' warnings are part of what is simulated
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    conn = Channel(Connection(int(argv[0])))
    opts, part, workdir = conn.recv()
    try:
        asyncio.run(PartSimulation(opts, workdir=Path(workdir), part=part).serve(conn))
    except (EOFError, OSError):
        return 1  # the leader's process went away: nothing to report to
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the run; the leader's reports it
        return 130
    except Exception as exc:
        last = traceback.format_exc().strip().splitlines()[-3:]
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc} ({' | '.join(line.strip() for line in last)})"))
        except OSError:
            pass
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
