"""The console in a real browser (Debian's Chromium, driven by Selenium): a leader and two workers
run as `edge-agent run` on a real mosquitto (the workers have no [firmware], so the
offers stay unanswered and the rollout stays under way) with a rollout under way; the browser signs in,
opens every page, pauses the rollout and resumes it through the confirmation pages, and the
leader's database says so each time. Screenshots go to test-artifacts/console/ (not in git)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mosquitto import Mosquitto, free_port

from agent.core.clock import SystemClock
from agent.core.errors import StoreError
from agent.leader.readonly import open_leader_db
from firmware_rollout.artifact.fixture import make_artifact
from firmware_rollout.orchestration.store import RolloutStore

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
    port = free_port()
    try:
        wait_for("the workers registered", lambda: online(db) == 2)
        spec = tmp_path / "spec.toml"
        spec.write_text(f'[rollout]\nname = "lab"\nartifact = "{artifact}"\n[waves]\ncanary = 1\ncounts = [1]\n'
                        '[device]\ntimeout_s = 3600\n')
        started = subprocess.run([sys.executable, "-m", "agent.cli", "rollout", "start", str(spec), "--db", str(db),
                                  "--id", "lab-1"], capture_output=True, text=True, env=env, timeout=60)
        assert started.returncode == 0, started.stderr
        procs.append(subprocess.Popen([sys.executable, "-m", "agent.cli", "console", "--db", str(db), "--token-file",
                                       str(token), "--listen", f"127.0.0.1:{port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        base = f"http://127.0.0.1:{port}"
        wait_for("the console listens", lambda: _listening(port))
        wait = WebDriverWait(browser, 60)

        browser.get(base + "/")  # no token yet: the sign-in form
        assert browser.find_element(By.ID, "token")
        browser.find_element(By.ID, "token").send_keys(token.read_text().strip())
        browser.find_element(By.ID, "sign-in").click()
        wait.until(lambda d: d.find_elements(By.ID, "devices"))
        assert "pi-0001" in browser.find_element(By.ID, "devices").text
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
            wait.until(lambda d: "queued as control" in d.page_source)
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


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_an_operator_uploads_starts_watches_and_cancels_a_rollout_in_the_browser(
        tmp_path: Path, mosquitto: Mosquitto, browser) -> None:
    """From artifact to a canceled rollout in the console alone: upload the artifact, start a
    rollout after reading its plan (a canary, then a wave behind an approval), watch the canary
    succeed on a page that updates itself (no reload), cancel at the approval; the numbers on
    screen are `rollout status --json`'s, and the audit names the operator."""
    import json

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    shots = ARTIFACTS / "start-watch-cancel"
    shots.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    url = f"mqtt://127.0.0.1:{mosquitto.port}"
    artifact, public = make_artifact(tmp_path, chunk_size=4096, size=20_000)
    key = f'[firmware]\npublic_key = "{public}"\n'
    names = ("pi-0001", "pi-0002", "pi-0003")
    procs = [subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--config",
                               str(agent_config(tmp_path, n, r, url, key))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
             for n, r in (("gw", "leader"), *((n, "worker") for n in names))]
    db = tmp_path / "gw" / "leader.db"
    token = tmp_path / "console.token"
    token.write_text("a-long-enough-console-token-0123456789\n")
    token.chmod(0o600)
    port = free_port()

    def status_json() -> dict:  # type: ignore[type-arg]
        out = subprocess.run([sys.executable, "-m", "agent.cli", "rollout", "status", "lab-1", "--db", str(db),
                              "--json"], capture_output=True, text=True, env=env, timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    try:
        wait_for("the workers registered", lambda: online(db) == 3)
        wait_for("the workers reported their versions",  # (a presence alone registers a device, version unknown)
                 lambda: query(db, "SELECT COUNT(*) FROM devices WHERE firmware_version = '1.0.0'") == [(3,)])
        procs.append(subprocess.Popen([sys.executable, "-m", "agent.cli", "console", "--db", str(db), "--token-file",
                                       str(token), "--listen", f"127.0.0.1:{port}", "--public-key", str(public)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        base = f"http://127.0.0.1:{port}"
        wait_for("the console listens", lambda: _listening(port))
        wait = WebDriverWait(browser, 90)

        browser.get(base + "/login")
        browser.find_element(By.ID, "token").send_keys(token.read_text().strip())
        browser.find_element(By.ID, "name").send_keys("alice")
        browser.find_element(By.ID, "sign-in").click()
        wait.until(lambda d: d.find_elements(By.ID, "devices"))

        browser.get(base + "/artifacts")  # the store is empty: upload the artifact
        browser.find_element(By.ID, "upload-file").send_keys(str(artifact))
        browser.find_element(By.ID, "upload").click()
        wait.until(lambda d: d.find_element(By.ID, "upload-result").get_attribute("data-outcome")
                   in ("kept", "refused"))
        result = browser.find_element(By.ID, "upload-result").text
        assert "verified and kept as" in result, result
        browser.save_screenshot(str(shots / "1-uploaded.png"))
        wait.until(lambda d: "1.1.0" in d.find_element(By.ID, "artifacts").text)

        browser.find_element(By.ID, "new-rollout-button").click()
        wait.until(lambda d: d.find_elements(By.ID, "new-rollout"))
        assert "fw 1.1.0" in Select(browser.find_element(By.ID, "artifact")).first_selected_option.text
        browser.find_element(By.ID, "name").send_keys("lab")
        browser.find_element(By.ID, "rollout-id").send_keys("lab-1")
        counts = browser.find_element(By.ID, "counts")
        counts.clear()
        counts.send_keys("2")
        browser.find_element(By.ID, "approval").click()
        browser.find_element(By.ID, "preview").click()
        wait.until(lambda d: d.find_elements(By.ID, "plan"))
        plan = browser.find_element(By.ID, "plan").text
        assert "wave 1 (canary): 1 device" in plan and "wave 2: 2 devices" in plan, plan
        browser.save_screenshot(str(shots / "2-plan.png"))
        browser.find_element(By.ID, "start").click()
        wait.until(lambda d: "queued as control" in d.page_source)  # the leader starts it on its next tick
        wait.until(lambda d: d.find_elements(By.ID, "state") and d.find_element(By.ID, "state").text == "running")
        browser.execute_script("window.notReloaded = true;")  # gone if the page reloads
        waves = lambda d: d.find_element(By.ID, "waves").text  # noqa: E731
        wait.until(lambda d: "1 succeeded of 1" in waves(d) and "awaiting_approval" in waves(d))
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-updates"))  # live.js swapped parts
        assert browser.execute_script("return window.notReloaded === true;")  # in place, not by a reload
        browser.save_screenshot(str(shots / "3-canary-succeeded.png"))
        shown = status_json()
        assert shown["state"] == "running" and shown["counts"].get("succeeded") == 1 and shown["devices"] == 3
        assert f"{shown['devices']} devices, {shown['offers']} offers" in browser.find_element(By.ID, "summary").text

        browser.find_element(By.ID, "control-cancel").click()
        wait.until(lambda d: d.find_elements(By.ID, "confirm"))
        browser.find_element(By.ID, "confirm").click()
        wait.until(lambda d: "queued as control" in d.page_source)
        browser.execute_script("window.notReloaded = true;")
        wait.until(lambda d: d.find_element(By.ID, "state").text == "canceled")
        assert browser.execute_script("return window.notReloaded === true;")
        audit = browser.find_element(By.ID, "audit").text
        assert audit.count("alice via the console from 127.0.0.1") == 2 and "cancel" in audit and "start" in audit
        browser.save_screenshot(str(shots / "4-canceled.png"))
        shown = status_json()
        assert shown["state"] == "canceled" and shown["counts"] == {"canceled": 2, "succeeded": 1}
        assert [(c["action"], c["outcome"]) for c in shown["audit"]] == [("start", "applied"), ("cancel", "applied")]

        canary = next(n for n in names if query(db, "SELECT state FROM rollout_devices WHERE device_id = "
                                                    f"'{n}'") == [("succeeded",)])
        browser.get(base + f"/devices/{canary}")
        timeline = browser.find_element(By.ID, "timeline").text
        assert "succeeded" in timeline and "lab-1" in timeline
        # the directory backend's slots a and b: the new one booted and kept (the page follows the heartbeats)
        wait.until(lambda d: d.find_element(By.ID, "slots").text.splitlines()[1:] == ["a 1.0.0 -", "b 1.1.0 yes yes -"])
        browser.save_screenshot(str(shots / "5-device.png"))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
