"""Structured logs (key=value, JSON, journald) and private files."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from agent.core.clock import VirtualClock
from agent.core.errors import ConfigError
from agent.service.files import (
    InsecureFile,
    check_private_file,
    ensure_private_dir,
    read_secret,
    restrict_database_files,
    set_service_umask,
    write_private_file,
)
from agent.service.logs import (
    KeyValueFormatter,
    RateLimitedLog,
    fields,
    format_value,
    journal_stream_matches,
    setup_logging,
)


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _record(msg: str, level: int = logging.INFO, **kv) -> logging.LogRecord:
    record = logging.LogRecord("agent.test", level, __file__, 1, msg, None, None)
    record.kv = kv
    return record


def test_key_value_lines_quote_and_escape() -> None:
    line = KeyValueFormatter(timestamps=False).format(
        _record("broker down", device="pi-1", reason='said "no"\nthen closed', n=3)
    )
    assert line == ('level=info logger=agent.test msg="broker down" device=pi-1 '
                    'reason="said \\"no\\"\\nthen closed" n=3')
    assert "\n" not in line
    assert format_value("") == '""'


def test_setup_logging_kv_with_timestamps_outside_journald(restore_root_logger) -> None:
    out = io.StringIO()
    setup_logging("WARNING", stream=out, env={})
    log = logging.getLogger("agent.x")
    log.info("hidden")
    log.warning("disk low", extra=fields(free_mb=12))
    [line] = out.getvalue().splitlines()
    assert line.startswith("ts=") and line.endswith('level=warning logger=agent.x msg="disk low" free_mb=12')


def test_libraries_narrating_each_request_are_quiet_at_info(restore_root_logger) -> None:
    """A download from a mirror makes one HTTP request per chunk: httpx's INFO line for each would
    fill a device's journal; its warnings still show."""
    out = io.StringIO()
    setup_logging("INFO", stream=out, env={})
    for name in ("httpx", "httpcore", "aiomqtt", "paho"):
        logging.getLogger(name).info("HTTP Request: GET /artifacts/x 206")
    logging.getLogger("httpx").warning("connection pool full")
    logging.getLogger("agent.x").info("update u1: downloading")
    lines = out.getvalue().splitlines()
    assert [line.split("msg=", 1)[1] for line in lines] == ['"connection pool full"', '"update u1: downloading"']


def test_journald_gets_priorities_and_no_timestamps(tmp_path: Path, restore_root_logger) -> None:
    with open(tmp_path / "journal", "w+") as stream:
        st = os.fstat(stream.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert journal_stream_matches(stream, env)
        setup_logging("DEBUG", fmt="json", stream=stream, env=env)
        setup_logging("DEBUG", fmt="json", stream=stream, env=env)  # again: one handler only
        log = logging.getLogger("agent.y")
        log.error("boom", extra=fields(code=7))
        log.debug("detail")
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("caught")
        stream.seek(0)
        lines = stream.read().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("<3>") and lines[1].startswith("<7>") and lines[2].startswith("<3>")
    first = json.loads(lines[0][3:])
    assert first == {"level": "error", "logger": "agent.y", "msg": "boom", "code": 7}
    assert "ValueError: bad" in json.loads(lines[2][3:])["exc"]


def test_a_redirected_stdout_is_not_the_journal(tmp_path: Path) -> None:
    with open(tmp_path / "a", "w") as a, open(tmp_path / "b", "w") as b:
        st = os.fstat(a.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert not journal_stream_matches(b, env)
        assert not journal_stream_matches(a, {"JOURNAL_STREAM": "garbage"})


def test_unknown_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        setup_logging("CHATTY", stream=io.StringIO())


async def test_rate_limited_log_lets_one_line_per_interval_through(caplog) -> None:
    clock = VirtualClock()
    logger = logging.getLogger("agent.heartbeat")
    limited = RateLimitedLog(logger, clock, interval_s=60.0)
    caplog.set_level(logging.INFO, logger="agent.heartbeat")
    emitted = []
    for _ in range(120):  # a heartbeat every 5 s for 10 minutes
        emitted.append(limited.info("hb", "heartbeat sent", seq=len(emitted)))
        await clock.advance(5.0)
    assert sum(emitted) == 10
    records = [r for r in caplog.records if r.name == "agent.heartbeat"]
    assert len(records) == 10
    assert records[1].kv == {"seq": 12, "suppressed": 11}
    assert limited.info("other", "independent key")


def test_private_dir_is_created_0750_and_tightened(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        made = ensure_private_dir(tmp_path / "state" / "edge-agent")
        assert stat.S_IMODE(made.stat().st_mode) == 0o750
        loose = tmp_path / "loose"
        loose.mkdir(mode=0o777)
        ensure_private_dir(loose)
        assert stat.S_IMODE(loose.stat().st_mode) == 0o750
    finally:
        os.umask(old)


def test_private_file_is_0600_atomic_and_replaces(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        target = tmp_path / "device.key"
        write_private_file(target, b"first")
        write_private_file(target, "second")
        assert target.read_text() == "second"
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        assert sorted(p.name for p in tmp_path.iterdir()) == ["device.key"]  # no temp left
    finally:
        os.umask(old)


def test_database_files_are_restricted(tmp_path: Path) -> None:
    db = tmp_path / "outbox.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").write_bytes(b"")
        os.chmod(f"{db}{suffix}", 0o644)
    restrict_database_files(db)
    assert {stat.S_IMODE(Path(f"{db}{s}").stat().st_mode) for s in ("", "-wal", "-shm")} == {0o600}


def test_service_umask() -> None:
    old = set_service_umask()
    try:
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602])
def test_credentials_readable_or_writable_by_others_are_refused(tmp_path: Path, mode: int) -> None:
    secret = tmp_path / "mqtt-password"
    secret.write_text("hunter2\n")
    os.chmod(secret, mode)
    with pytest.raises(InsecureFile, match=f"mode {mode:04o}.*chmod 600"):
        check_private_file(secret)
    with pytest.raises(ConfigError):
        read_secret(secret)


def test_private_credentials_are_read(tmp_path: Path) -> None:
    secret = tmp_path / "mqtt-password"
    secret.write_text("hunter2\nignored second line\n")
    os.chmod(secret, 0o600)
    assert read_secret(secret) == "hunter2"
    os.chmod(secret, 0o400)
    assert read_secret(secret) == "hunter2"


def test_bad_credentials_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        read_secret(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("")
    os.chmod(empty, 0o600)
    with pytest.raises(ConfigError, match="empty"):
        read_secret(empty)
    with pytest.raises(InsecureFile, match="not a regular file"):
        check_private_file(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_credentials_owned_by_another_user_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "mqtt-password"
    secret.write_text("x")
    os.chmod(secret, 0o600)
    os.chown(secret, 12345, 12345)
    with pytest.raises(InsecureFile, match="owned by uid 12345"):
        check_private_file(secret)


def test_mqtt_credentials_are_checked_before_connecting(tmp_path: Path) -> None:
    from agent.core.config import MqttSection
    from agent.service.files import check_mqtt_credentials

    password = tmp_path / "mqtt-password"
    password.write_text("secret\n")
    key = tmp_path / "client.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    for path in (password, key):
        path.chmod(0o600)
    check_mqtt_credentials(MqttSection(password_file=str(password), tls_key=str(key)))
    check_mqtt_credentials(MqttSection())  # nothing configured, nothing to check
    key.chmod(0o644)
    with pytest.raises(InsecureFile, match="mqtt.tls_key"):
        check_mqtt_credentials(MqttSection(password_file=str(password), tls_key=str(key)))
    with pytest.raises(ConfigError, match="mqtt.password_file not found"):
        check_mqtt_credentials(MqttSection(password_file=str(tmp_path / "missing")))


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files of other owners")
def test_unreadable_by_says_which_folder_or_file_keeps_a_user_out() -> None:
    """What doctor tells of the broker's CRL: a 0700 folder on the way, then a 0600 file, then fine."""
    import pwd
    import shutil
    import tempfile


    user = next((u.pw_name for u in pwd.getpwall() if u.pw_name in ("mosquitto", "nobody")), None)
    if user is None:
        pytest.skip("no unprivileged system user here")
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # (pytest's own tmp folders are 0700)
    try:
        base.chmod(0o755)
        _folder_then_file_then_fine(base, user)
    finally:
        shutil.rmtree(base)


def _folder_then_file_then_fine(base: Path, user: str) -> None:
    from agent.service.files import unreadable_by

    folder = base / "identity"
    folder.mkdir(mode=0o700)
    crl = folder / "crl.pem"
    crl.write_text("x")
    crl.chmod(0o600)
    assert f"{folder} is 0700" in unreadable_by(crl, user) and "cannot enter it" in unreadable_by(crl, user)
    folder.chmod(0o755)
    assert f"{crl} is 0600" in unreadable_by(crl, user)
    crl.chmod(0o644)
    assert unreadable_by(crl, user) == ""
    assert unreadable_by(crl, "no-such-user-here") == ""
