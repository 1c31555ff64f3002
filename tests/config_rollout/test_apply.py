"""A config release applied to a device's target, commit-confirmed: committed when it validates,
applies and stays healthy; nothing changed when it does not validate; the old documents back
(and applied again) when the health check fails within confirm_s; a local edit seen as drift;
and a real SIGKILL at every step of the apply leaves the old documents or the new ones, byte for
byte, once the next start has resumed."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from holds import Word

from agent.core.config import ConfigTargetSection
from config_rollout.device.apply import ConfigApplier
from config_rollout.release import build_release, parse_release
from rollout_engine.keys import SigningKey

KEY = SigningKey.generate()
REPO = Path(__file__).resolve().parents[2]
OLD = {"app.toml": b"port = 1\n", "limits.conf": b"max = 1\n"}
NEW = {"app.toml": b"port = 2\n", "limits.conf": b"max = 2\n", "extra.conf": b"added\n"}


def release_of(tmp: Path, version: str, docs: dict[str, bytes], name: str = "app") -> bytes:
    folder = tmp / f"src-{version}"
    folder.mkdir(exist_ok=True)
    for n, data in docs.items():
        (folder / n).write_bytes(data)
    return build_release(name, version, [folder / n for n in docs], KEY, created_ms=1)


def target(tmp: Path, **kw: object) -> ConfigTargetSection:
    kw.setdefault("settle_s", 0.0)
    return ConfigTargetSection(directory=str(tmp / "etc" / "app"), **kw)  # type: ignore[arg-type]


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


async def installed(tmp: Path) -> ConfigApplier:
    """A target holding OLD, committed."""
    applier = ConfigApplier("app", target(tmp), tmp / "state")
    assert (await applier.apply(parse_release(release_of(tmp, "1.0.0", OLD), KEY.public))).state == "committed"
    return applier


async def test_a_release_that_validates_applies_and_stays_healthy_is_committed(tmp_path: Path) -> None:
    log = tmp_path / "log"
    sh = lambda text: ("sh", "-c", text)  # noqa: E731
    settings = target(tmp_path, validate_command=sh(f"ls {{staged}} >> {log}; echo validated >> {log}"),
                      apply_command=sh(f"echo applied >> {log}"), health_command=sh(f"echo healthy >> {log}"))
    applier = ConfigApplier("app", settings, tmp_path / "state")
    result = await applier.apply(parse_release(release_of(tmp_path, "1.0.0", OLD), KEY.public))
    assert (result.state, result.version, result.detail) == ("committed", "1.0.0", "confirmed")
    assert contents(tmp_path / "etc" / "app") == OLD
    assert log.read_text().split("\n")[-4:] == ["validated", "applied", "healthy", ""]
    assert "app.toml" in log.read_text()  # the validate command saw the staged documents
    assert not (tmp_path / "state" / "config" / "app" / "staged").exists()
    assert not (tmp_path / "state" / "config" / "app" / "last-good").exists()
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == ["app"]  # nothing beside the target's folder
    again = await applier.apply(parse_release(release_of(tmp_path, "1.0.0", OLD), KEY.public))
    assert again.detail == "already applied"
    st = applier.status()
    assert (st.version, st.state, st.drifted, st.attempt) == ("1.0.0", "committed", (), 1)  # (none begun again)
    (tmp_path / "etc" / "app" / "limits.conf").write_bytes(b"max = 99\n")  # edited on the device
    assert applier.status().drifted == ("limits.conf",)


async def test_a_release_that_does_not_validate_changes_nothing(tmp_path: Path) -> None:
    await installed(tmp_path)
    applier = ConfigApplier("app", target(tmp_path, validate_command=("sh", "-c", "echo port 2 is taken; exit 3")),
                            tmp_path / "state")
    result = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "failed" and result.version == "1.0.0"
    assert result.detail == "validation refused 1.1.0: validate command exited 3: port 2 is taken"
    assert contents(tmp_path / "etc" / "app") == OLD and applier.status().version == "1.0.0"


async def test_a_release_that_is_not_healthy_within_confirm_s_reverts_by_itself(tmp_path: Path) -> None:
    await installed(tmp_path)
    applied = tmp_path / "applied"
    app_toml = tmp_path / "etc" / "app" / "app.toml"
    settings = target(tmp_path, apply_command=("sh", "-c", f"cat {app_toml} >> {applied}"),
                      health_command=("grep", "-q", "port = 1", str(app_toml)), confirm_s=1.5)
    applier = ConfigApplier("app", settings, tmp_path / "state")
    result = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "rolled_back" and result.version == "1.0.0"
    assert result.detail.startswith("1.1.0 reverted: not confirmed within 1.5 s: health command exited 1")
    assert contents(tmp_path / "etc" / "app") == OLD  # extra.conf, which 1.1.0 added, is gone too
    assert applied.read_text() == "port = 2\nport = 1\n"  # applied, then the old content applied again
    assert (applier.status().state, applier.status().attempt) == ("rolled_back", 2)  # (1.0.0 was the first)
    again = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert (again.state, applier.status().attempt) == ("rolled_back", 3)  # each attempt its own number


async def test_the_hosts_check_decides_too_and_a_hanging_command_is_bounded(tmp_path: Path) -> None:
    await installed(tmp_path)

    async def cut_off() -> str:
        return "the leader has not answered since the apply"

    applier = ConfigApplier("app", target(tmp_path, confirm_s=1.0), tmp_path / "state", confirm=cut_off)
    result = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "rolled_back" and "the leader has not answered since the apply" in result.detail
    hanging = ConfigApplier("app", target(tmp_path, validate_command=("sleep", "60"), command_timeout_s=0.5),
                            tmp_path / "state")
    result = await hanging.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "failed" and "validate command did not finish within 0.5 s" in result.detail
    assert contents(tmp_path / "etc" / "app") == OLD


async def test_the_confirm_looks_first_settle_s_after_the_apply(tmp_path: Path) -> None:
    """A change that cuts the device off a moment after its apply command returned (a network
    reload) must not be confirmed before it bites: the host's check is first asked settle_s on."""
    await installed(tmp_path)
    loop = asyncio.get_running_loop()
    applied_at = tmp_path / "applied"
    looks: list[float] = []

    async def look() -> str:
        looks.append(loop.time())
        return ""

    settings = target(tmp_path, apply_command=("touch", str(applied_at)), settle_s=0.4, confirm_s=10)
    applier = ConfigApplier("app", settings, tmp_path / "state", confirm=look,
                            on_step=lambda step: looks.append(loop.time()) if step == "applied" else None)
    result = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "committed" and applied_at.exists()
    assert len(looks) == 2 and looks[1] - looks[0] >= 0.4


async def test_a_release_for_another_target_or_an_undeclared_document_is_refused(tmp_path: Path) -> None:
    await installed(tmp_path)
    strict = ConfigApplier("app", target(tmp_path, documents=("app.toml", "limits.conf")), tmp_path / "state")
    result = await strict.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "failed" and result.detail == "target app takes no document extra.conf"
    other = await strict.apply(parse_release(release_of(tmp_path, "2.0.0", {"a": b"b"}, name="web"), KEY.public))
    assert other.detail == "release web 2.0.0 is not for target app"
    assert contents(tmp_path / "etc" / "app") == OLD


CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys
    from pathlib import Path
    from agent.core.config import ConfigTargetSection
    from config_rollout.device.apply import ConfigApplier
    from config_rollout.release import parse_release
    from rollout_engine.keys import VerifyKey

    tmp, kill_at, healthy = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"

    def step(name: str) -> None:
        print(name, flush=True)
        if name == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    target = ConfigTargetSection(directory=str(tmp / "etc" / "app"), confirm_s=0.5, settle_s=0,
                                 health_command=() if healthy else ("false",))
    release = parse_release((tmp / "new.eacfg").read_bytes(), VerifyKey.from_raw((tmp / "key.raw").read_bytes()))
    print(asyncio.run(ConfigApplier("app", target, tmp / "state", on_step=step).apply(release)).state, flush=True)
""")


def run_child(tmp: Path, kill_at: str, healthy: bool) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp), kill_at, "1" if healthy else "0"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert done.returncode in (0, -9), done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("healthy", [True, False], ids=["healthy", "unhealthy"])
def test_a_sigkill_at_every_step_leaves_the_old_documents_or_the_new(tmp_path: Path, healthy: bool) -> None:
    (tmp_path / "key.raw").write_bytes(KEY.public.raw)
    (tmp_path / "new.eacfg").write_bytes(release_of(tmp_path, "1.1.0", NEW))
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "key.raw").write_bytes(KEY.public.raw)
    (probe / "new.eacfg").write_bytes((tmp_path / "new.eacfg").read_bytes())
    asyncio.run(installed(probe))
    steps = run_child(probe, "", healthy)[:-1]  # every step of an uninterrupted apply, then its outcome
    assert steps[0] == "staged" and steps[-1] == ("committed" if healthy else "reverted")
    assert any(s.startswith("swapped ") for s in steps)
    for n, kill_at in enumerate(steps):
        case = tmp_path / f"kill-{n}"
        case.mkdir()
        (case / "key.raw").write_bytes(KEY.public.raw)
        (case / "new.eacfg").write_bytes((tmp_path / "new.eacfg").read_bytes())
        applier = asyncio.run(installed(case))
        seen = run_child(case, kill_at, healthy)
        assert seen[-1] == kill_at, seen  # it died right there
        asyncio.run(applier.resume())  # the next start
        now = contents(case / "etc" / "app")
        committed = healthy and kill_at == "committed"
        assert now == (NEW if committed else OLD), f"killed at {kill_at}: {now}"
        assert applier.status().version == ("1.1.0" if committed else "1.0.0")
        assert not (case / "state" / "config" / "app" / "staged").exists()


def test_apply_and_status_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main as cli
    from rollout_engine.keys import generate_keypair

    keys = generate_keypair(tmp_path / "keys")
    config = tmp_path / "worker.toml"
    config.write_text(f'[agent]\nrole = "worker"\ndevice_id = "pi-1"\ndata_dir = "{tmp_path / "data"}"\n'
                      f'[firmware]\npublic_key = "{keys.public}"\n'
                      f'[config_targets.app]\ndirectory = "{tmp_path / "etc" / "app"}"\nconfirm_s = 5\nsettle_s = 0\n'
                      'health_command = ["true"]\n')
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "app.toml").write_bytes(b"port = 2\n")
    release = tmp_path / "app-1.1.0.eacfg"
    assert cli(["config", "release", "build", "app", str(docs / "app.toml"), "--version", "1.1.0", "--key",
                str(keys.private), "--out", str(release)]) == 0
    capsys.readouterr()
    assert cli(["config", "apply", str(release), "--config", str(config)]) == 0
    assert capsys.readouterr().out == "app: committed (confirmed); the target holds 1.1.0\n"
    assert (tmp_path / "etc" / "app" / "app.toml").read_bytes() == b"port = 2\n"
    (tmp_path / "etc" / "app" / "app.toml").write_bytes(b"port = 9\n")
    assert cli(["config", "status", "--config", str(config)]) == 0
    assert capsys.readouterr().out == ("app: 1.1.0 (committed: confirmed); DRIFTED: app.toml changed on the device\n")
    (docs / "web.conf").write_bytes(b"x")
    other = tmp_path / "web.eacfg"
    assert cli(["config", "release", "build", "web", str(docs / "web.conf"), "--version", "1.0.0", "--key",
                str(keys.private), "--out", str(other)]) == 0
    assert cli(["config", "apply", str(other), "--config", str(config)]) == 2
    assert "config_targets.web: not declared: this device takes no release 'web'" in capsys.readouterr().err


def test_config_check_names_the_target_key_that_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main as cli
    from rollout_engine.keys import generate_keypair

    keys = generate_keypair(tmp_path / "keys")
    head = f'[agent]\nrole = "worker"\ndevice_id = "pi-1"\ndata_dir = "{tmp_path / "data"}"\n'
    key = f'[firmware]\npublic_key = "{keys.public}"\n'
    cases = [
        (head + key + f'[config_targets.app]\ndirectory = "{tmp_path}/etc/app"\napply_command = ["no-such-tool-x"]\n',
         "config_targets.app.apply_command: 'no-such-tool-x' is not an executable on PATH"),
        (head + key + '[config_targets.app]\ndirectory = "/no/such/place/app"\n',
         "config_targets.app.directory: /no/such/place/app: neither it nor its parent is a folder"),
        (head + f'[config_targets.app]\ndirectory = "{tmp_path}/etc"\n',
         "firmware.public_key: required by [config_targets.app]"),
        (head + key + f'[config_targets.app]\ndirectory = "{tmp_path}"\nconfirm_s = 0\n',
         "config_targets.app.confirm_s"),
        (head + key + f'[config_targets.app]\ndirectory = "{tmp_path}"\nconfirm_s = 3\nsettle_s = 5\n',
         "config_targets.app.settle_s: must be less than confirm_s"),
        (head + key + f'[config_targets.app]\ndirectory = "{tmp_path}"\nowner = "no-such-user-x"\n',
         "config_targets.app.owner: no user 'no-such-user-x' on this system"),
        (head + key + f'[config_targets.App]\ndirectory = "{tmp_path}"\n', "config_targets"),
    ]
    for n, (text, said) in enumerate(cases):
        path = tmp_path / f"c{n}.toml"
        path.write_text(text)
        assert cli(["config", "check", str(path)]) == 2, text
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    (tmp_path / "etc").mkdir()  # the target's folder is made at the first apply; its parent must be there
    good = tmp_path / "good.toml"
    good.write_text(head + key + f'[config_targets.app]\ndirectory = "{tmp_path}/etc/app"\napply_command = ["true"]\n')
    assert cli(["config", "check", str(good)]) == 0


async def test_a_full_disk_is_a_refusal_in_one_line_that_leaves_nothing_behind(tmp_path: Path) -> None:
    """The target's folder and the agent's state on one small file system, filled up: the
    release is refused with the reason, the documents are the old ones byte for byte, and no
    staging folder or half-written file stays behind."""
    sys.path.insert(0, str(REPO / "tests"))
    from disks import Tmpfs

    with Tmpfs(tmp_path / "sd", 1) as disk:
        await installed(disk.at)
        before = contents(disk.at / "etc" / "app")
        filler = disk.fill()
        applier = ConfigApplier("app", target(disk.at), disk.at / "state")
        big = {"app.toml": b"port = 2\n" * 6_000, "limits.conf": b"max = 2\n"}
        result = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", big), KEY.public))
        assert result.state == "failed" and "No space left on device" in result.detail, result
        assert "\n" not in result.detail
        assert contents(disk.at / "etc" / "app") == before
        assert sorted(p.name for p in (disk.at / "etc").iterdir()) == ["app"]  # no staging folder
        assert applier.status().version == "1.0.0"
        filler.unlink()  # room again: the same release applies
        again = ConfigApplier("app", target(disk.at), disk.at / "state")
        result = await again.apply(parse_release(release_of(tmp_path, "1.1.0", big), KEY.public))
        assert result.state == "committed", result


async def test_documents_are_written_with_the_targets_owner_and_group(tmp_path: Path) -> None:
    import grp
    import os
    import pwd

    if os.geteuid() != 0:
        pytest.skip("giving files to another user needs root")
    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    applier = ConfigApplier("app", target(tmp_path, owner="nobody", group=group, mode="0640"), tmp_path / "state")
    assert (await applier.apply(parse_release(release_of(tmp_path, "1.0.0", OLD), KEY.public))).state == "committed"
    for name in OLD:
        st = (tmp_path / "etc" / "app" / name).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (nobody.pw_uid, nobody.pw_gid, 0o640)
    stranger = ConfigApplier("app", target(tmp_path, owner="no-such-user-x"), tmp_path / "state")
    result = await stranger.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "failed" and result.detail == "cannot stage app: no user 'no-such-user-x' on this system"
    assert contents(tmp_path / "etc" / "app") == OLD


async def test_a_link_planted_in_the_targets_folder_is_never_followed(tmp_path: Path) -> None:
    """F5. An application replaces app.toml by a link to the agent's 0600 key: the next apply is
    refused in one line naming it, nothing changes, nothing of the key is kept or shown; drift
    and the application's view do not read through it."""
    applier = await installed(tmp_path)
    secret = tmp_path / "device.key"
    secret.write_bytes(b"-----BEGIN PRIVATE KEY-----\n")
    secret.chmod(0o600)
    planted = tmp_path / "etc" / "app" / "app.toml"
    planted.unlink()
    planted.symlink_to(secret)
    assert applier.status().drifted == ("app.toml",)
    assert "app.toml" not in applier.view()["documents"]
    result = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "failed" and result.version == "1.0.0"
    assert result.detail == f"cannot keep the current documents: {planted} is a symbolic link: refused (a config" \
                            " document is a regular file)"
    assert planted.is_symlink() and (tmp_path / "etc" / "app" / "limits.conf").read_bytes() == OLD["limits.conf"]
    assert secret.stat().st_mode & 0o777 == 0o600
    last_good = tmp_path / "state" / "config" / "app" / "last-good"
    assert not last_good.exists() or b"PRIVATE" not in b"".join(p.read_bytes() for p in last_good.iterdir())


async def test_a_revert_writes_each_document_back_with_the_mode_it_had(tmp_path: Path) -> None:
    await installed(tmp_path)
    limits = tmp_path / "etc" / "app" / "limits.conf"
    limits.chmod(0o600)  # an operator tightened it on the device
    applier = ConfigApplier("app", target(tmp_path, health_command=("false",), confirm_s=0.5), tmp_path / "state")
    result = await applier.apply(parse_release(release_of(tmp_path, "1.1.0", NEW), KEY.public))
    assert result.state == "rolled_back"
    assert limits.read_bytes() == OLD["limits.conf"] and limits.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "etc" / "app" / "app.toml").stat().st_mode & 0o777 == 0o644


async def test_a_held_configuration_is_left_by_a_start_and_settled_by_its_release(tmp_path: Path) -> None:
    await installed(tmp_path)
    etc = tmp_path / "etc" / "app"
    for commit in (False, True):
        hold = Word()
        applier = ConfigApplier("app", target(tmp_path), tmp_path / "state")
        applying = asyncio.ensure_future(applier.apply(parse_release(release_of(tmp_path, "2.0.0", NEW), KEY.public),
                                                       hold=hold))
        await hold.asked.wait()
        assert contents(etc) == NEW and applier.held()
        started = ConfigApplier("app", target(tmp_path), tmp_path / "state")  # the agent's next start
        assert await started.resume() is None and started.held() and contents(etc) == NEW
        result = await started.settle_held(commit=commit, reason="app:hello failed: unhealthy")
        if commit:
            assert result is not None and (result.state, result.version) == ("committed", "2.0.0")
            assert contents(etc) == NEW and started.status().state == "committed"
        else:
            assert result is not None and result.state == "rolled_back"
            assert result.detail == "2.0.0 taken back: app:hello failed: unhealthy"
            assert contents(etc) == OLD and started.status().version == "1.0.0"
        assert not started.held() and await started.settle_held(commit=True) is None  # settled once
        applying.cancel()  # (the apply of the process that stopped)
        if commit:
            break
        shutil.rmtree(tmp_path / "src-2.0.0")


async def test_a_held_configuration_that_its_release_takes_back_reverts_in_the_apply(tmp_path: Path) -> None:
    await installed(tmp_path)
    hold = Word()
    applier = ConfigApplier("app", target(tmp_path), tmp_path / "state")
    applying = asyncio.ensure_future(applier.apply(parse_release(release_of(tmp_path, "2.0.0", NEW), KEY.public),
                                                   hold=hold))
    await hold.asked.wait()
    hold.word.set_result("firmware 1.1.0: health check failed")
    result = await applying
    assert (result.state, result.detail) == ("rolled_back", "2.0.0 taken back: firmware 1.1.0: health check failed")
    assert contents(tmp_path / "etc" / "app") == OLD
