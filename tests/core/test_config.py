import logging
from pathlib import Path

import pytest

from agent.core.config import AgentConfig, load_config
from agent.core.errors import ConfigError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_loads(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, AgentConfig)
    assert config.agent.role in ("worker", "leader")


def test_examples_exist_for_both_roles() -> None:
    assert {p.name for p in CONFIGS} >= {"worker.toml", "leader.toml"}


BAD = [
    ('[agent]\ndevice_id = "d"\n[mqtt]\nport = 3\n', "mqtt.port", "unknown key"),
    ('[agent]\ndevice_id = "d"\nbogus = 1\n', "agent.bogus", "unknown key"),
    ('[agent]\ndevice_id = "d"\n[mailbox]\ncapacity = "big"\n', "mailbox.capacity", "expected int, got str"),
    ('[agent]\ndevice_id = "d"\n[mailbox]\ncapacity = 0\n', "mailbox.capacity", ">= 1"),
    ('[agent]\ndevice_id = "d"\n[mailbox]\npolicy = "drop_all"\n', "mailbox.policy", "invalid enum value"),
    ('[agent]\ndevice_id = "d"\n[relay]\npartitions = 1000\n', "relay.partitions", "<= 256"),
    ('[agent]\ndevice_id = "bad id!"\n', "agent.device_id", "matching regex"),
    ("[mqtt]\n", "agent", "required key is missing"),
    ('[agent]\ndevice_id = "d"\n[relay]\naimd_initial = 99\n', "relay.aimd_initial", "between"),
    ('[agent]\ndevice_id = "d"\n[mqtt]\nurl = "http://x"\n', "mqtt.url", "mqtt://"),
    ('[agent]\ndevice_id = "d"\ntags = [1]\n', "agent.tags.0", "expected str"),
    ('[agent]\ndevice_id = "d"\n[mqtt]\nfast_path = "fast"\n', "mqtt.fast_path", "invalid enum value"),
    ('[agent]\ndevice_id = "d"\n[mqtt]\nkeepalive_s = 70000\n', "mqtt.keepalive_s", "<= 65535"),
    ('[agent]\ndevice_id = "d"\n[artifacts]\nlisten = "8093"\n', "artifacts.listen", "HOST:PORT"),
    ('[agent]\ndevice_id = "d"\n[artifacts]\nurl = "ftp://gw"\n', "artifacts.url", "http://"),
    ('[agent]\ndevice_id = "d"\n[artifacts]\ntls_cert = "/c.pem"\n', "artifacts.tls_key", "go together"),
    ('[agent]\ndevice_id = "d"\n[artifacts]\nmax_downloads = 0\n', "artifacts.max_downloads", ">= 1"),
    ('[agent]\ndevice_id = "d"\n[firmware]\nretry_budget = 0\n', "firmware.retry_budget", ">= 1"),
    ('[agent]\ndevice_id = "d"\n[firmware]\nmax_download_kbps = -1\n', "firmware.max_download_kbps", ">= 0"),
    ('[agent]\ndevice_id = "d"\n[firmware]\nmirror_ca = "ca.pem"\n', "firmware.mirror_ca", "absolute"),
]


@pytest.mark.parametrize(("text", "key", "reason"), BAD)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, key: str, reason: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert reason in info.value.reason
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[agent\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.toml")


def test_defaults_fill_missing_sections(tmp_path: Path) -> None:
    path = tmp_path / "min.toml"
    path.write_text('[agent]\ndevice_id = "pi-7"\n')
    config = load_config(path)
    assert config.mailbox.capacity == 256
    assert config.outbox.durability == "power"  # an acknowledgement survives a power cut
    assert config.relay.aimd_max == 50


def test_housekeeping_defaults_cover_the_outbox_horizons(tmp_path: Path) -> None:
    path = tmp_path / "min.toml"
    path.write_text('[agent]\ndevice_id = "pi-7"\n')
    hk = load_config(path).housekeeping
    assert hk.interval_s == 600.0 and hk.batch_rows == 1000
    assert hk.processed_retention_s == hk.jobs_retention_s == hk.ledger_retention_s == 14 * 86_400.0
    assert hk.rollouts_retention_s == 90 * 86_400.0
    worker = load_config(CONFIGS[0].parent / "worker.toml")
    longest_ttl = max(c.ttl_s for c in worker.outbox.classes.values())
    assert worker.housekeeping.processed_retention_s >= 2 * longest_ttl


HOUSEKEEPING_BAD = [
    ("interval_s = 0", "housekeeping.interval_s", "> 0"),
    ('interval_s = "10m"', "housekeeping.interval_s", "expected float"),
    ("batch_rows = 0", "housekeeping.batch_rows", ">= 1"),
    ("batch_rows = 1.5", "housekeeping.batch_rows", "expected int"),
    ("processed_retention_s = -1.0", "housekeeping.processed_retention_s", "> 0"),
    ("keep_forever = true", "housekeeping.keep_forever", "unknown key"),
    # shorter than 20 attempts x 300 s of retries: a redelivery could be applied twice
    ("processed_retention_s = 3600.0", "housekeeping.processed_retention_s", "at least 6000"),
    ("jobs_retention_s = 60.0", "housekeeping.jobs_retention_s", "at least"),
    ("ledger_retention_s = 100.0", "housekeeping.ledger_retention_s", "at least"),
    ("rollouts_retention_s = 0", "housekeeping.rollouts_retention_s", "> 0"),
    ('rollouts_retention_s = "90d"', "housekeeping.rollouts_retention_s", "expected float"),
    ("rollouts_retention_s = 600.0", "housekeeping.rollouts_retention_s", "at least"),
]


@pytest.mark.parametrize(("line", "key", "reason"), HOUSEKEEPING_BAD)
def test_bad_housekeeping_names_the_key(tmp_path: Path, line: str, key: str, reason: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\ndevice_id = "d"\n[housekeeping]\n{line}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert reason in info.value.reason


def test_retention_must_cover_the_longest_outbox_ttl(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('[agent]\ndevice_id = "d"\n[outbox.classes.telemetry]\nttl_s = 2592000.0\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "housekeeping.processed_retention_s"
    path.write_text(path.read_text() + "[housekeeping]\nprocessed_retention_s = 2592000.0\n"
                    "jobs_retention_s = 2592000.0\nledger_retention_s = 2592000.0\n")
    assert load_config(path).housekeeping.ledger_retention_s == 2592000.0


@pytest.mark.parametrize("name", ["leader.toml", "worker.toml"])
def test_commented_housekeeping_keys_show_the_defaults(tmp_path: Path, name: str) -> None:
    text = (CONFIGS[0].parent / name).read_text()
    section = text.split("[housekeeping]\n", 1)[1]
    shown = [line[2:].split("#", 1)[0] for line in section.splitlines() if line.startswith("# ") and "=" in line]
    assert len(shown) == {"leader.toml": 6, "worker.toml": 5}[name]  # rollouts_retention_s: leader only
    path = tmp_path / name
    path.write_text(text.replace(section, "\n".join(shown) + "\n"))
    assert load_config(path).housekeeping == load_config(CONFIGS[0].parent / name).housekeeping


@pytest.mark.parametrize(("given", "read_as"), [("FULL", "power"), ("NORMAL", "crash")])
def test_the_deprecated_synchronous_key_is_read_as_durability_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, given: str, read_as: str) -> None:
    path = tmp_path / "old.toml"
    path.write_text(f'[agent]\ndevice_id = "pi-7"\n[outbox]\nsynchronous = "{given}"\n')
    with caplog.at_level(logging.WARNING, logger="agent.config"):
        config = load_config(path)
    assert config.outbox.durability == read_as
    assert config.outbox.synchronous is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: outbox.synchronous is deprecated: write durability = {read_as!r} instead"
        f" (read as durability = {read_as!r})"]


def test_durability_given_wins_over_the_deprecated_key(tmp_path: Path) -> None:
    path = tmp_path / "both.toml"
    path.write_text('[agent]\ndevice_id = "pi-7"\n[outbox]\nsynchronous = "NORMAL"\ndurability = "power"\n')
    assert load_config(path).outbox.durability == "power"


def test_a_class_durability_is_checked_and_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[agent]\ndevice_id = "pi-7"\n[classes.readings]\ndurability = "battery"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: classes.readings.durability: invalid enum value 'battery'")
