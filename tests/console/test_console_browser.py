"""The console in a real browser (Debian's Chromium, driven by Selenium): a leader and two workers
run as `edge-agent run` on a real mosquitto (the workers have no [firmware], so the
offers stay unanswered and the rollout stays under way) with a rollout under way; the browser signs in,
opens every page, pauses the rollout and resumes it through the confirmation pages, and the
leader's database says so each time. Screenshots go to test-artifacts/console/ (not in git)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mosquitto import Mosquitto, free_port
from selenium.common.exceptions import StaleElementReferenceException

from agent.core.clock import SystemClock
from agent.core.errors import StoreError
from agent.leader.readonly import open_leader_db
from firmware_rollout.artifact.fixture import make_artifact
from rollout_engine.store import RolloutStore

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "console"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = [pytest.mark.mqtt, pytest.mark.skipif(
    not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
    reason="Debian's chromium and chromium-driver are not installed (scripts/test.sh installs them)")]


def agent_config(work: Path, name: str, role: str, url: str, extra: str = "") -> Path:
    extra = '[artifacts]\nlisten = "127.0.0.1:0"\n' + extra
    path = work / f"{name}.toml"
    path.write_text(f'[agent]\nrole = "{role}"\ndevice_id = "{name}"\nfleet = "lab"\ndata_dir = "{work / name}"\n'
                    f'firmware_version = "1.0.0"\nuse_uvloop = false\n[mqtt]\nurl = "{url}"\n'
                    '[heartbeat]\ninterval_s = 1.0\n' + extra)
    return path


def online(db: Path) -> int:
    """Devices the leader's registry holds online (0 while it has none yet)."""
    try:
        with open_leader_db(db) as leader:
            return leader.registry.online_count()[1]
    except StoreError:
        return 0


def rollout_state(db: Path, rollout_id: str) -> str | None:
    try:
        with RolloutStore.open_readonly(db, clock=SystemClock()) as store:
            found = store.get(rollout_id)
    except StoreError:
        return None
    return found.state if found is not None else None


def query(db: Path, sql: str) -> list[tuple[object, ...]]:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
        try:
            return conn.execute(sql).fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return []


def wait_for(what: str, condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.1)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def test_an_operator_watches_and_controls_a_rollout_in_the_browser(tmp_path: Path, mosquitto: Mosquitto,
                                                                  browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    artifact, public = make_artifact(tmp_path, chunk_size=4096, size=20_000)
    leader_key = f'[firmware]\npublic_key = "{public}"\n'  # the leader checks what it rolls out
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config",
                               str(agent_config(tmp_path, n, r, url, leader_key if r == "leader" else ""))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
             for n, r in (("gw", "leader"), ("pi-0001", "worker"), ("pi-0002", "worker"))]
    db = tmp_path / "gw" / "leader.db"
    token = tmp_path / "console.token"
    token.write_text("a-long-enough-console-token-0123456789\n")
    token.chmod(0o600)
    try:
        wait_for("the workers registered", lambda: online(db) == 2)
        spec = tmp_path / "spec.toml"
        spec.write_text(f'[rollout]\nname = "lab"\nartifact = "{artifact}"\n[waves]\ncanary = 1\ncounts = [1]\n'
                        '[device]\ntimeout_s = 3600\n')
        started = subprocess.run([sys.executable, "-m", "agent.cli", "rollout", "start", str(spec), "--db", str(db),
                                  "--id", "lab-1"], capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0, started.stderr
        base = start_console(["--db", str(db), "--token-file", str(token)], env, procs)
        wait = WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,))

        browser.get(base + "/")  # no token yet: the sign-in form
        assert browser.find_element(By.ID, "token")
        browser.find_element(By.ID, "token").send_keys(token.read_text().strip())
        browser.find_element(By.ID, "sign-in").click()
        wait.until(lambda d: d.find_elements(By.ID, "devices"))
        assert "pi-0001" in live_text(browser, "devices")
        browser.save_screenshot(str(ARTIFACTS / "fleet.png"))

        browser.get(base + "/devices/pi-0001")
        wait.until(lambda d: "lab-1" in d.page_source)
        browser.save_screenshot(str(ARTIFACTS / "device.png"))
        for page in ("/dead-letters", "/rejects", "/rollouts"):
            browser.get(base + page)
            assert browser.title.endswith("· edge-agent") and "Not found" not in browser.page_source
            browser.save_screenshot(str(ARTIFACTS / f"{page.strip('/')}.png"))

        browser.find_element(By.LINK_TEXT, "lab-1").click()
        wait.until(lambda d: d.find_elements(By.ID, "control-pause"))
        browser.save_screenshot(str(ARTIFACTS / "rollout-running.png"))
        for action, state in (("pause", "paused"), ("resume", "running")):
            browser.find_element(By.ID, f"control-{action}").click()
            wait.until(lambda d: d.find_elements(By.ID, "confirm"))
            browser.find_element(By.ID, "confirm").click()
            # the banner while the control waits (a leader quicker than the redirect: the audit has it)
            wait.until(lambda d, a=action: "queued as control" in d.page_source or a in live_text(d, "audit"))
            wait_for(f"the leader applied {action}",
                     lambda s=state: rollout_state(db, "lab-1") == s)
            browser.refresh()
            wait.until(lambda d, s=state: d.find_element(By.ID, "state").text == s)
            browser.save_screenshot(str(ARTIFACTS / f"rollout-{state}.png"))
        controls = query(db, "SELECT action, result, outcome FROM rollout_controls ORDER BY id")
        assert [a for a, _, _ in controls] == ["start", "pause", "resume"]  # `rollout start`'s, then the browser's
        assert all(result and outcome == "applied" for _, result, outcome in controls)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_console(args: list[str], env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> str:
    """`edge-agent console ARGS --listen 127.0.0.1:PORT` on a free port, appended to `procs`; its
    base URL once it listens. A port taken meanwhile by another test (the console exits saying
    so) is tried again with another."""
    import tempfile

    for _ in range(5):
        port = free_port()
        with tempfile.TemporaryFile() as said:  # (a file, not a pipe: a console that logs never blocks on it)
            proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "console", *args, "--listen",
                                     f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=said, env=env)
            procs.append(proc)
            wait_for("the console listens or ends", lambda p=port, c=proc: _listening(p) or c.poll() is not None, 180)
            if proc.poll() is None:
                return f"http://127.0.0.1:{port}"
            said.seek(0)
            error = said.read().decode()
        assert "cannot listen" in error, error  # only a lost port race is tried again
    raise AssertionError("no free port for the console in 5 tries")


def live_text(browser, element_id: str) -> str:  # type: ignore[no-untyped-def]
    """An element's text on a live page: read again when live.js swapped it in between."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(50):
        try:
            return str(browser.find_element(By.ID, element_id).text)
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"#{element_id} kept changing")


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class ConsoleFleet:
    """A leader and three workers with `[firmware]` as `edge-agent run` processes on mosquitto,
    the console beside them (with the fleet's key: it takes uploads), and a browser signed in."""

    names = ("pi-0001", "pi-0002", "pi-0003")

    def __init__(self, tmp_path: Path, mosquitto: Mosquitto, browser) -> None:  # type: ignore[no-untyped-def]
        from selenium.webdriver.support.ui import WebDriverWait

        self.tmp, self.browser = tmp_path, browser
        self.env = dict(os.environ, PYTHONPATH=str(REPO))
        url = f"mqtt://127.0.0.1:{mosquitto.port}"
        self.artifact, self.public = make_artifact(tmp_path, chunk_size=4096, size=20_000)
        key = f'[firmware]\npublic_key = "{self.public}"\n'
        self.procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config",
                                        str(agent_config(tmp_path, n, r, url, key))],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
                      for n, r in (("gw", "leader"), *((n, "worker") for n in self.names))]
        self.db = tmp_path / "gw" / "leader.db"
        self.token = tmp_path / "console.token"
        self.token.write_text("a-long-enough-console-token-0123456789\n")
        self.token.chmod(0o600)
        self.base = ""
        self.wait = WebDriverWait(browser, 90, ignored_exceptions=(StaleElementReferenceException,))

    def __enter__(self) -> ConsoleFleet:
        from selenium.webdriver.common.by import By

        wait_for("the workers registered", lambda: online(self.db) == 3)
        wait_for("the workers reported their versions",  # (a presence alone registers a device, version unknown)
                 lambda: query(self.db, "SELECT COUNT(*) FROM devices WHERE firmware_version = '1.0.0'") == [(3,)])
        self.base = start_console(["--db", str(self.db), "--token-file", str(self.token), "--public-key",
                                   str(self.public)], self.env, self.procs)
        self.browser.get(self.base + "/login")
        self.browser.find_element(By.ID, "token").send_keys(self.token.read_text().strip())
        self.browser.find_element(By.ID, "name").send_keys("alice")
        self.browser.find_element(By.ID, "sign-in").click()
        self.wait.until(lambda d: d.find_elements(By.ID, "devices"))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def status(self, rollout_id: str) -> dict:  # type: ignore[type-arg]
        """`rollout status ID --json`, as the CLI prints it ({} while there is no such rollout)."""
        import json

        out = subprocess.run([sys.executable, "-m", "agent.cli", "rollout", "status", rollout_id, "--db",
                              str(self.db), "--json"], capture_output=True, text=True, env=self.env, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def upload(self, artifact: Path) -> str:
        """Upload on the artifacts page as an operator does; the console's answer."""
        from selenium.webdriver.common.by import By

        self.browser.get(self.base + "/artifacts")
        self.browser.execute_script("window.notReloaded = true;")  # gone if the page reloads
        self.browser.find_element(By.ID, "upload-file").send_keys(str(artifact))
        self.browser.find_element(By.ID, "upload").click()
        self.wait.until(lambda d: d.find_element(By.ID, "upload-result").get_attribute("data-outcome")
                        in ("kept", "refused"))
        said = str(self.browser.find_element(By.ID, "upload-result").text)
        if self.browser.find_element(By.ID, "upload-result").get_attribute("data-outcome") == "kept":
            # listed in place, the answer still on screen
            self.wait.until(lambda d: d.find_element(By.ID, "upload-result").get_attribute("data-listed") == "yes")
            assert self.browser.execute_script("return window.notReloaded === true;")
        return said

    def start(self, rollout_id: str, *, counts: str, approval: bool, extra: dict[str, str] | None = None,
              choices: dict[str, str] | None = None) -> str:
        """Fill in the new-rollout form (`extra`: text fields by id; `choices`: a select's option
        by id, by the option's value), show the plan; the plan shown."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select

        browser = self.browser
        browser.get(self.base + "/rollouts/new")
        self.wait.until(lambda d: d.find_elements(By.ID, "new-rollout"))
        Select(browser.find_element(By.ID, "artifact")).select_by_index(0)  # newest version first
        browser.find_element(By.ID, "name").send_keys("lab")
        browser.find_element(By.ID, "rollout-id").send_keys(rollout_id)
        field = browser.find_element(By.ID, "counts")
        field.clear()
        field.send_keys(counts)
        if approval:
            browser.find_element(By.ID, "approval").click()
        for field_id, text in (extra or {}).items():
            browser.find_element(By.ID, field_id).send_keys(text)
        for field_id, value in (choices or {}).items():
            Select(browser.find_element(By.ID, field_id)).select_by_value(value)
        browser.find_element(By.ID, "preview").click()
        self.wait.until(lambda d: d.find_elements(By.ID, "plan"))
        return str(browser.find_element(By.ID, "plan").text)

    def control(self, action: str, *, choose: str = "") -> None:
        """Click a control on the rollout page open now and confirm it (`choose`: the option of
        the confirmation page's artifact list whose text holds it)."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select

        self.browser.find_element(By.ID, f"control-{action}").click()
        self.wait.until(lambda d: d.find_elements(By.ID, "confirm"))
        if choose:
            picker = Select(self.browser.find_element(By.ID, "artifact"))
            picker.select_by_visible_text(next(o.text for o in picker.options if choose in o.text))
        self.browser.find_element(By.ID, "confirm").click()
        self.wait.until(lambda d: "queued as control" in d.page_source or action in live_text(d, "audit"))


def test_an_operator_uploads_starts_watches_and_cancels_a_rollout_in_the_browser(
        tmp_path: Path, mosquitto: Mosquitto, browser) -> None:
    """From artifact to a canceled rollout in the console alone: upload the artifact, start a
    rollout after reading its plan (a canary, then a wave behind an approval), watch the canary
    succeed on a page that updates itself (no reload), cancel at the approval; the numbers on
    screen are `rollout status --json`'s, and the audit names the operator."""
    from selenium.webdriver.common.by import By

    shots = ARTIFACTS / "start-watch-cancel"
    shots.mkdir(parents=True, exist_ok=True)
    with ConsoleFleet(tmp_path, mosquitto, browser) as fleet:
        wait, db = fleet.wait, fleet.db
        result = fleet.upload(fleet.artifact)  # the leader's store is empty
        assert "verified and kept as" in result, result
        browser.save_screenshot(str(shots / "1-uploaded.png"))
        wait.until(lambda d: "1.1.0" in d.find_element(By.ID, "artifacts").text)

        # the form carries the spec's fields: thresholds, the device's timeout, retries and
        # windows, the schedule and its pace
        plan = fleet.start("lab-1", counts="2", approval=True, choices={"failure_action": "pause"},
                           extra={"success_threshold_pct": "90", "failure_threshold_pct": "50", "timeout_s": "600",
                                  "retries": "1", "windows": "00:00-12:00, 12:00-00:00",
                                  "devices_per_minute": "60"})
        assert "wave 1 (canary): 1 device" in plan and "wave 2: 2 devices" in plan, plan
        browser.save_screenshot(str(shots / "2-plan.png"))
        browser.find_element(By.ID, "start").click()
        wait.until(lambda d: "queued as control" in d.page_source or d.find_elements(By.ID, "state"))  # (its next tick)
        wait.until(lambda d: d.find_elements(By.ID, "state") and d.find_element(By.ID, "state").text == "running")
        # the banner is gone once the leader applied the start: it does not outlive the control
        wait.until(lambda d: not d.find_element(By.ID, "message").text)
        spec = json.loads(query(db, "SELECT spec FROM rollouts WHERE id = 'lab-1'")[0][0])
        assert spec["gates"]["success_threshold_pct"] == 90 and spec["gates"]["failure_threshold_pct"] == 50
        assert spec["gates"]["failure_action"] == "pause" and spec["schedule"]["devices_per_minute"] == 60
        assert spec["device"]["timeout_s"] == 600 and spec["device"]["retries"] == 1
        assert spec["device"]["maintenance_windows"] == ["00:00-12:00", "12:00-00:00"]
        browser.execute_script("window.notReloaded = true;")  # gone if the page reloads
        waves = lambda d: d.find_element(By.ID, "waves").text  # noqa: E731
        wait.until(lambda d: "1 succeeded of 1" in waves(d) and "awaiting_approval" in waves(d))
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-updates"))  # live.js swapped parts
        assert browser.execute_script("return window.notReloaded === true;")  # in place, not by a reload
        browser.save_screenshot(str(shots / "3-canary-succeeded.png"))
        shown = fleet.status("lab-1")
        assert shown["state"] == "running" and shown["counts"].get("succeeded") == 1 and shown["devices"] == 3
        assert f"{shown['devices']} devices, {shown['offers']} offers" in live_text(browser, "summary")
        # above the approve button the page names the button, not the CLI's command
        summary = live_text(browser, "summary")
        assert "rollout approve" not in summary and "the approve button" in summary, summary
        assert browser.find_elements(By.ID, "control-approve")

        fleet.control("cancel")
        browser.execute_script("window.notReloaded = true;")
        wait.until(lambda d: d.find_element(By.ID, "state").text == "canceled")
        assert browser.execute_script("return window.notReloaded === true;")
        audit = live_text(browser, "audit")
        assert audit.count("alice via the console from 127.0.0.1") == 2 and "cancel" in audit and "start" in audit
        browser.save_screenshot(str(shots / "4-canceled.png"))
        shown = fleet.status("lab-1")
        assert shown["state"] == "canceled" and shown["counts"] == {"canceled": 2, "succeeded": 1}
        # the chart's legend is the table's: the two devices never offered are canceled, not queued
        wait.until(lambda d: "canceled 2" in d.find_element(By.CSS_SELECTOR, "svg.chart").get_attribute("textContent"))
        legend = browser.find_element(By.CSS_SELECTOR, "svg.chart").get_attribute("textContent")
        assert "succeeded 1" in legend and "queued 0" in legend and "in progress 0" in legend, legend
        # one way to write a moment: 24-hour to the second, in the zone the header states
        moments = re.findall(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\b", browser.find_element(By.TAG_NAME, "body").text)
        assert moments and not re.search(r"\b(AM|PM)\b", browser.find_element(By.TAG_NAME, "body").text)
        assert live_text(browser, "zone").startswith("times in UTC")
        # a rollout the console started names no rollback artifact, and the store holds none: no
        # rollback button that could only fail (the canary's device took 1.1.0)
        assert not browser.find_elements(By.ID, "control-rollback")
        wait.until(lambda d: re.fullmatch(r"updated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d",
                                          d.find_element(By.ID, "updated").text))
        assert [(c["action"], c["outcome"]) for c in shown["audit"]] == [("start", "applied"), ("cancel", "applied")]

        canary = next(n for n in fleet.names if query(db, "SELECT state FROM rollout_devices WHERE device_id = "
                                                          f"'{n}'") == [("succeeded",)])
        browser.get(fleet.base + f"/devices/{canary}")
        timeline = live_text(browser, "timeline")
        assert "succeeded" in timeline and "lab-1" in timeline
        # the directory backend's slots a and b: the new one booted and kept (the page follows the heartbeats)
        wait.until(lambda d: d.find_element(By.ID, "slots").text.splitlines()[1:] == ["a 1.0.0 -", "b 1.1.0 yes yes -"])
        browser.save_screenshot(str(shots / "5-device.png"))


def test_an_operator_takes_the_fleet_to_a_new_version_and_back_in_the_browser(
        tmp_path: Path, mosquitto: Mosquitto, browser) -> None:
    """The whole way in the console: upload the update and its signed rollback, roll the update
    out to every device until the rollout succeeds, roll it back with the uploaded rollback, and
    the fleet page shows every device on the old version again, as `rollout status --json` says."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    shots = ARTIFACTS / "there-and-back"
    shots.mkdir(parents=True, exist_ok=True)
    with ConsoleFleet(tmp_path, mosquitto, browser) as fleet:
        wait = fleet.wait
        back, _ = make_artifact(tmp_path, version="1.0.0", chunk_size=4096, size=20_000, seed=1, rollback=True,
                                rollback_from=("1.1.0",))
        assert "verified and kept" in fleet.upload(fleet.artifact)
        assert "fw 1.0.0" in fleet.upload(back)
        plan = fleet.start("lab-2", counts="3", approval=False)
        assert "wave 1 (canary): 1 device" in plan and "wave 2: 2 devices" in plan, plan
        browser.find_element(By.ID, "start").click()
        wait.until(lambda d: d.find_elements(By.ID, "state") and d.find_element(By.ID, "state").text == "succeeded")
        shown = fleet.status("lab-2")
        assert shown["counts"] == {"succeeded": 3}
        waves = live_text(browser, "waves")
        assert "1 succeeded of 1" in waves and "2 succeeded of 2" in waves  # what status --json counts per wave
        assert [w["succeeded"] for w in shown["waves"]] == [1, 2]
        browser.save_screenshot(str(shots / "1-succeeded.png"))

        # the dialog offers what works: the uploaded rollback, chosen; no spec's artifact (it has none)
        browser.find_element(By.ID, "control-rollback").click()
        wait.until(lambda d: d.find_elements(By.ID, "confirm"))
        offered = [o.text for o in Select(browser.find_element(By.ID, "artifact")).options]
        assert len(offered) == 1 and "fw 1.0.0 (replaces 1.1.0)" in offered[0], offered
        assert Select(browser.find_element(By.ID, "artifact")).first_selected_option.text == offered[0]
        browser.back()
        wait.until(lambda d: d.find_elements(By.ID, "control-rollback"))
        fleet.control("rollback", choose="fw 1.0.0 (replaces 1.1.0)")
        wait_for("the rollback rollout exists", lambda: fleet.status("lab-2-rollback") != {})
        browser.get(fleet.base + "/rollouts/lab-2-rollback")
        wait.until(lambda d: d.find_element(By.ID, "state").text == "succeeded")
        back_status = fleet.status("lab-2-rollback")
        assert back_status["counts"] == {"succeeded": 3} and back_status["version"] == "1.0.0"
        assert back_status["from_versions"] == {"1.1.0": 3}
        assert "1.1.0 → 1.0.0" in live_text(browser, "summary")
        browser.save_screenshot(str(shots / "2-rolled-back.png"))
        browser.get(fleet.base + "/?version=1.0.0")
        wait.until(lambda d: "devices 1-3 of 3" in d.page_source)
        audit = fleet.status("lab-2")["audit"]
        assert [(c["action"], c["outcome"]) for c in audit] == [("start", "applied"), ("rollback", "applied")]
        assert all(c["actor"] == "alice via the console from 127.0.0.1" for c in audit)


async def test_an_operator_acknowledges_a_reverted_attempt_in_the_browser(tmp_path: Path, browser) -> None:
    """A device whose newest config apply was rolled back is in sync, its attempt counted beside;
    the operator presses the device page's "acknowledge" and every page stops counting it, and
    says who saw it; a second device's failure goes with the fleet table's button."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    from test_console_http import TOKEN, serving

    sys.path.insert(0, str(REPO / "tests"))
    from e2e.agent_support import leader

    from agent.core.clock import VirtualClock
    from agent.protocol import ConfigState, Heartbeat

    shots = ARTIFACTS / "acknowledge"
    shots.mkdir(parents=True, exist_ok=True)
    gw = await leader(VirtualClock(), tmp_path)
    db = Path(gw.registry.path)
    try:
        gw.registry.apply_heartbeats([
            Heartbeat(device_id="pi-1", seq=1, uptime_s=1.0,
                      configs={"app": ConfigState(version="1.0.0", state="rolled_back", attempt=2)}),
            Heartbeat(device_id="pi-2", seq=1, uptime_s=1.0,
                      configs={"app": ConfigState(version="1.0.0", state="failed", attempt=3)})])
    finally:
        await gw.stop()

    def steady(read):  # type: ignore[no-untyped-def]
        """`read()` again when live.js swapped the element in between."""
        for _ in range(50):
            try:
                return read()
            except StaleElementReferenceException:
                continue
        raise AssertionError("the page kept changing")

    def last_attempt_cell() -> str:
        row = browser.find_element(By.ID, "fleet-config").find_elements(By.TAG_NAME, "tr")[1]
        return str(row.find_elements(By.TAG_NAME, "td")[-1].text.split()[0])

    def attempt_cell():  # type: ignore[no-untyped-def]
        return browser.find_element(By.ID, "configs").find_elements(By.TAG_NAME, "td")[3]

    with serving(db) as (host, port):
        base = f"http://{host}:{port}"
        wait = WebDriverWait(browser, 30)
        browser.get(base + "/login")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "name").send_keys("alice")
        browser.find_element(By.ID, "sign-in").click()
        wait.until(lambda d: d.find_elements(By.ID, "fleet-config"))
        assert steady(last_attempt_cell) == "2"

        browser.get(base + "/devices/pi-1")
        assert steady(lambda: attempt_cell().text).startswith("rolled back")
        steady(lambda: attempt_cell().find_element(By.CLASS_NAME, "acknowledge").click())
        wait.until(lambda d: "acknowledged: no longer counted as failed" in live_text(d, "message"))
        said = steady(lambda: attempt_cell().text)
        assert said == "rolled back, acknowledged by alice via the console from 127.0.0.1", said
        assert not steady(lambda: attempt_cell().find_elements(By.CLASS_NAME, "acknowledge"))
        browser.save_screenshot(str(shots / "1-device.png"))

        browser.get(base + "/")
        assert steady(last_attempt_cell) == "1"  # pi-2's failure, still open
        steady(lambda: browser.find_element(By.ID, "fleet-config").find_element(By.CLASS_NAME, "acknowledge").click())
        wait.until(lambda d: "acknowledged 1 attempt" in live_text(d, "message"))
        assert steady(last_attempt_cell) == "0"
        assert not steady(lambda: browser.find_element(By.ID, "fleet-config").find_elements(By.CLASS_NAME,
                                                                                             "acknowledge"))
        browser.save_screenshot(str(shots / "2-fleet.png"))
    with open_leader_db(db) as read:
        acks = read.attempt_acks.newest()
    assert {(k, a.attempt, a.by) for k, a in acks.items()} == {
        (("pi-1", "app"), 2, "alice via the console from 127.0.0.1"),
        (("pi-2", "app"), 3, "alice via the console from 127.0.0.1")}
