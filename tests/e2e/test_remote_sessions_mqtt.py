"""Remote sessions end to end: a leader and two workers as `edge-agent run` processes over a real
mosquitto, the operator's `edge-agent devices shell|forward|sessions` as processes on the leader's
operator socket.

- A command runs on pi-1 and comes back with its stdout, its stderr and its exit code; stdin
  reaches it.
- pi-2's config turns remote sessions off: refused, with the reason. A forward to an address
  pi-1's config does not list: refused. A forward by an operator without the right: refused.
- With the right (the leader restarted on its new config), a 50 MB HTTP download through
  `devices forward` arrives whole.
- The leader's record (`devices sessions --json`) and pi-1's own audit file hold every session,
  refused ones too, with the bytes each way and the exit code.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import http.server
import json
import os
import pwd
import select
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from agent_support import db_query
from mosquitto import Mosquitto
from test_rollout_mqtt import agent_config, registered, stop

from agent.leader.readonly import open_leader_db

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mqtt, pytest.mark.slow, pytest.mark.timeout(600)]
BIG = 50 * 1024 * 1024


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        return None


def serve_directory(directory: Path) -> http.server.ThreadingHTTPServer:
    """An HTTP server on the device's loopback (a service of the device's own)."""
    handler = lambda *a: _Quiet(*a, directory=str(directory))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_shell_and_a_forward_through_the_broker_refused_where_not_allowed_and_audited(
        tmp_path: Path, mosquitto: Mosquitto) -> None:
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    me = pwd.getpwuid(os.geteuid()).pw_name
    site = tmp_path / "site"
    site.mkdir()
    payload = os.urandom(1024 * 1024) * (BIG // (1024 * 1024))
    (site / "big.bin").write_bytes(payload)
    web = serve_directory(site)
    web_port = web.server_address[1]
    allow_root = "allow_root = true\n" if os.geteuid() == 0 else ""

    def leader_config(forward_ok: bool) -> Path:
        return agent_config(tmp_path, "gw", "leader", url, f'[remote]\nshell_operators = ["{me}"]\n'
                            f'forward_operators = {json.dumps([me] if forward_ok else ["someone-else"])}\n'
                            f'logs_operators = ["{me}"]\nrecord_input = {"true" if forward_ok else "false"}\n')

    gw = leader_config(False)
    workers = [agent_config(tmp_path, "pi-1", "worker", url, f'[remote]\nshell = true\n{allow_root}'
                            f'forward = ["127.0.0.1:{web_port}"]\nlogs = true\n'),
               agent_config(tmp_path, "pi-2", "worker", url)]
    logs = {c: c.with_suffix(".log").open("wb") for c in [gw, *workers]}

    def start(config: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
                                stdout=logs[config], stderr=subprocess.STDOUT, env=env)

    procs = [start(gw), *(start(w) for w in workers)]
    db = tmp_path / "gw" / "leader.db"
    cli = [sys.executable, "-m", "agent.cli", "devices"]

    def devices(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*cli, argv[0], "--config", str(gw), *argv[1:]], input=stdin, capture_output=True,
                              env=env, timeout=120)

    def online(n: int) -> None:
        """The workers registered, each with the facts of a full heartbeat (what it takes), and the
        leader's socket listening."""
        deadline = time.monotonic() + 60
        while registered(db) < n or not (tmp_path / "gw" / "operator.sock").exists() or db_query(
                db, "SELECT count(*) FROM devices WHERE facts IS NOT NULL")[0][0] < n:
            assert time.monotonic() < deadline, "the workers never registered with the leader"
            time.sleep(0.3)

    try:
        online(2)
        done = devices("shell", "pi-1", "--", "echo out; echo err >&2; exit 7")
        assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n"), done
        done = devices("shell", "pi-1", "--", "tr a-z A-Z", stdin=b"hello through the broker\n")
        assert (done.returncode, done.stdout) == (0, b"HELLO THROUGH THE BROKER\n"), done

        # a login shell on a terminal: the operator's terminal in raw mode, the device's a pty of its own
        master, slave = os.openpty()
        term = subprocess.Popen([*cli, "shell", "--config", str(gw), "pi-1"], stdin=slave, stdout=slave,
                                stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        seen, typed = b"", False
        deadline = time.monotonic() + 60
        while term.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                with contextlib.suppress(OSError):
                    seen += os.read(master, 4096)
            if not typed and (b"#" in seen or b"$" in seen):  # the device's shell prompts: type
                os.write(master, b"echo answer=$((6*7)); tty; exit 3\n")
                typed = True
        os.close(master)
        assert term.wait(timeout=30) == 3, seen
        assert b"answer=42" in seen and b"/dev/pts/" in seen, seen

        # a log bundle, its download cut and resumed: the agent's lines, the secret a command named redacted
        done = devices("shell", "pi-1", "--", "true password=hunter2-in-a-command")
        assert done.returncode == 0, done
        bundle = tmp_path / "pi-1-logs.txt.gz"
        done = devices("logs", "pi-1", "--since", "10m", "--out", str(bundle))
        said = done.stdout.decode()
        assert done.returncode == 0 and said.startswith("pi-1: bundle ") and "bytes compressed" in said, done
        whole = bundle.read_bytes()
        # a download cut at byte 300 goes on from there: the device keeps the bundle it made
        cut = tmp_path / "cut.txt.gz"
        cut.write_bytes(whole[:300])
        (tmp_path / "cut.txt.gz.part").write_text(json.dumps({"device": "pi-1", "bundle": said.split()[2][:-1]}))
        done = devices("logs", "pi-1", "--out", str(cut))
        assert done.returncode == 0 and b"going on from byte 300" in done.stdout, done
        assert cut.read_bytes() == whole and not (tmp_path / "cut.txt.gz.part").exists()
        text = gzip.decompress(bundle.read_bytes()).decode()
        assert text.startswith("# edge-agent log bundle of pi-1") and "-- edge-agent" in text, text[:500]
        assert "password=[redacted]" in text and "hunter2-in-a-command" not in text
        assert not (tmp_path / "pi-1-logs.txt.gz.part").exists()
        # the console's "Fetch its logs", as the console's user on the leader's socket
        from agent.console.server import Console, ConsoleConfig, ConsoleServer

        token = "0123456789abcdef0123456789abcdef"
        console = ConsoleServer(("127.0.0.1", 0), Console(ConsoleConfig(
            db=db, outbox=db.with_name("outbox.db"), token=token, operator_socket=tmp_path / "gw" / "operator.sock")))
        console.serve_in_thread()
        try:
            conn = http.client.HTTPConnection(*console.server_address[:2], timeout=60)
            try:
                conn.request("GET", "/devices/pi-1", headers={"Authorization": f"Bearer {token}"})
                assert "Fetch its logs" in conn.getresponse().read().decode()
                conn.request("POST", "/devices/pi-1/logs", body="since=1h",
                             headers={"Authorization": f"Bearer {token}",
                                      "Content-Type": "application/x-www-form-urlencoded"})
                response = conn.getresponse()
                body = response.read()
            finally:
                conn.close()
        finally:
            console.shutdown()
            console.server_close()
        assert response.status == 200 and response.getheader("Content-Type") == "application/gzip", body[:300]
        assert 'filename="pi-1-logs.txt.gz"' in (response.getheader("Content-Disposition") or "")
        assert gzip.decompress(body).decode().startswith("# edge-agent log bundle of pi-1")
        done = devices("logs", "pi-2")
        assert done.returncode == 1 and b"pi-2 takes no remote sessions" in done.stderr, done

        done = devices("shell", "pi-2", "--", "true")
        assert done.returncode == 255 and b"pi-2 takes no remote sessions: its config's [remote] turns none on" in (
            done.stderr), done
        done = devices("shell", "pi-9", "--", "true")
        assert done.returncode == 255 and b"no device pi-9 in this fleet" in done.stderr, done

        def forward(spec: str) -> tuple[subprocess.Popen[bytes], int]:
            proc = subprocess.Popen([*cli, "forward", "pi-1", spec, "--config", str(gw)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env)
            assert proc.stdout is not None
            line = proc.stdout.readline().decode()
            assert line.startswith("forwarding 127.0.0.1:"), line
            return proc, int(line.split()[1].rsplit(":", 1)[1])

        def fetch(port: int, path: str) -> bytes:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}", timeout=120) as response:
                return bytes(response.read())

        refused, port = forward(f"0:127.0.0.1:{web_port}")  # (no right to forward on this leader yet)
        with pytest.raises(OSError):
            fetch(port, "big.bin")
        refused.terminate()
        _, err = refused.communicate(timeout=30)
        assert f"operator {me} has no right to forward".encode() in err, err

        stop(procs[:1])  # the leader again, its config giving this operator the right to forward
        assert not (tmp_path / "gw" / "operator.sock").exists()
        gw = leader_config(True)
        procs[0] = start(gw)
        online(2)
        # this leader keeps what operators type into shells (record_input)
        done = devices("shell", "pi-1", "--", "cat > /dev/null", stdin=b"typed by the operator\n")
        assert done.returncode == 0, done
        elsewhere, port = forward("0:127.0.0.1:22")
        with pytest.raises(OSError):
            fetch(port, "big.bin")
        elsewhere.terminate()
        _, err = elsewhere.communicate(timeout=30)
        assert b"127.0.0.1:22 is not among the addresses this device forwards to" in err, err

        carrying, port = forward(f"0:127.0.0.1:{web_port}")
        try:
            got = fetch(port, "big.bin")
        finally:
            carrying.terminate()
            carrying.communicate(timeout=30)
        assert len(got) == BIG and hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()

        deadline = time.monotonic() + 60
        while True:  # (the forward's close reaches the record once the device says it ended)
            out = devices("sessions", "--json")
            assert out.returncode == 0, out.stderr
            record = [json.loads(line) for line in out.stdout.decode().splitlines()]
            if all(r["state"] in ("closed", "refused") for r in record):
                break
            assert time.monotonic() < deadline, record
            time.sleep(0.3)
        by = {(r["op"], r["device"], r["state"], r["target"]): r for r in record}
        ran = by[("shell", "pi-1", "closed", "echo out; echo err >&2; exit 7")]
        assert ran["exit_code"] == 7 and ran["operator"] == me and ran["bytes_from_device"] == 8, ran
        assert by[("shell", "pi-2", "refused", "true")]["reason"].startswith("pi-2 takes no remote sessions")
        assert "no right to forward" in by[("forward", "pi-1", "refused", f"127.0.0.1:{web_port}")]["reason"]
        assert any(r["op"] == "logs" and r["operator"] == f"{me} for the console's API (Bearer token) from 127.0.0.1"
                   for r in record), record
        carried = [r for r in record if r["op"] == "forward" and r["state"] == "closed"]
        assert any(r["bytes_from_device"] >= BIG for r in carried), carried
        with open_leader_db(db) as view:  # the input kept where the leader's config asked, and only there
            assert view.sessions.input_of(by[("shell", "pi-1", "closed", "cat > /dev/null")]["sid"]) == (
                b"typed by the operator\n")
            assert view.sessions.input_of(by[("shell", "pi-1", "closed", "tr a-z A-Z")]["sid"]) == b""
        audit = [json.loads(line) for line in (tmp_path / "pi-1" / "remote-audit.jsonl").read_text().splitlines()]
        assert {(a["event"], a["op"]) for a in audit} >= {("opened", "shell"), ("closed", "shell"),
                                                          ("refused", "forward"), ("closed", "forward")}
        assert any(a["event"] == "closed" and a.get("exit") == 7 and a["operator"] == me for a in audit), audit
    finally:
        stop(procs)
        web.shutdown()
        web.server_close()
        for log in logs.values():
            log.close()
