import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.transport import topics
from agent.transport.topics import TopicError


def test_builders_and_parse_round_trip() -> None:
    assert topics.up("f1", "dev-1") == "ea/v1/f1/dev-1/up"
    assert topics.down("f1", "dev-1") == "ea/v1/f1/dev-1/down"
    assert topics.presence("f1", "dev-1") == "ea/v1/f1/dev-1/presence"
    assert topics.reply("f1", "dev-1") == "ea/v1/f1/dev-1/reply/relay"
    assert topics.leaders_up("f1") == "$share/leaders/ea/v1/f1/+/up"
    assert topics.fleet_filter("f1", "presence") == "ea/v1/f1/+/presence"
    parsed = topics.parse(topics.reply("f1", "dev-1", "jobs"))
    assert parsed == topics.ParsedTopic("f1", "dev-1", "reply", "jobs")
    assert topics.device_of("ea/v1/f1/dev-9/up") == "dev-9"


@pytest.mark.parametrize("topic", ["", "ea/v1/f", "ea/v2/f/d/up", "x/v1/f/d/up", "ea/v1/f/d/sideways", "ea/v1//d/up"])
def test_parse_rejects_foreign_topics(topic: str) -> None:
    assert topics.parse(topic) is None
    assert topics.device_of(topic) is None


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "$sys", "a\x00"])
def test_builders_refuse_bad_segments(bad: str) -> None:
    with pytest.raises(TopicError):
        topics.up("fleet", bad)


@pytest.mark.parametrize(
    ("flt", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("#", "a/b", True),
        ("+/b", "a/b", True),
        ("+/+", "a", False),
        ("a/b", "a/c", False),
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("$share/g/ea/v1/f/+/up", "ea/v1/f/d/up", True),
        ("$share/g/ea/v1/f/+/up", "ea/v1/f/d/down", False),
        ("a/+/c", "a//c", True),
    ],
)
def test_matches(flt: str, topic: str, expected: bool) -> None:
    assert topics.matches(flt, topic) is expected


@pytest.mark.parametrize("bad", ["", "a/#/b", "a#", "a/b+", "$share/g", "$share//a", "$share/g+/a"])
def test_validate_filter_refuses(bad: str) -> None:
    with pytest.raises(TopicError):
        topics.validate_filter(bad)


@pytest.mark.parametrize("bad", ["", "a/+", "a/#", "a\x00b"])
def test_validate_topic_refuses(bad: str) -> None:
    with pytest.raises(TopicError):
        topics.validate_topic(bad)


def test_split_shared() -> None:
    assert topics.split_shared("$share/leaders/a/+") == ("leaders", "a/+")
    assert topics.split_shared("a/+") == (None, "a/+")


_level = st.text(alphabet="abc", min_size=0, max_size=2)


@settings(deadline=None, max_examples=200)
@given(st.lists(_level, min_size=1, max_size=4), st.data())
def test_wildcard_filters_built_from_a_topic_match_it(levels: list[str], data: st.DataObject) -> None:
    topic = "/".join(levels)
    flt = [lvl if not data.draw(st.booleans()) else "+" for lvl in levels]
    cut = data.draw(st.integers(min_value=0, max_value=len(flt)))
    if cut < len(flt):
        flt = flt[:cut] + ["#"]
    assert topics.matches("/".join(flt), topic)
    assert topics.matches("/".join(levels) + "/x", topic) is False


def test_a_devices_own_reply_topic_and_its_answer_sub_topic() -> None:
    up = topics.up("f1", "dev-1")
    assert topics.is_own_reply_topic(topics.reply("f1", "dev-1", "relay"), up)
    for other in (topics.reply("f1", "dev-2", "relay"), topics.reply("f2", "dev-1", "relay"),
                  topics.down("f1", "dev-1"), "ea/v1/f1/dev-1/reply/", "rogue/replies"):
        assert not topics.is_own_reply_topic(other, up)
    assert not topics.is_own_reply_topic(topics.reply("f1", "dev-1"), topics.down("f1", "dev-1"))
    assert topics.reply_from(topics.reply("f1", "gw"), "dev-1") == "ea/v1/f1/gw/reply/relay/dev-1"
    with pytest.raises(topics.TopicError):
        topics.reply_from(topics.reply("f1", "gw"), "a/b")
