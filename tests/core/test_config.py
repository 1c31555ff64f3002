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
    assert config.outbox.synchronous == "NORMAL"
    assert config.relay.aimd_max == 50
