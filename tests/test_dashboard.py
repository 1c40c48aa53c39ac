"""Issue 41: `monarch-torchx dashboard` in a real headless Chromium (Debian's package) driven by
Selenium: the page loads with the URL's token, shows the pool's hosts and the running app, a log
line printed after the page opened appears without a reload, a replica's stacks show on click, a
screenshot is saved; a wrong or missing token is 403; a pool stopped under the page is said."""

from __future__ import annotations

import shutil
import signal
import subprocess
import textwrap
import urllib.error
import urllib.request

import pytest

from .conftest import BIN, cli_env, torchx, wait_for

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
APP = textwrap.dedent(
    """\
    import os, sys, time
    print("early line", flush=True)
    def hold(path):
        while not os.path.exists(path):
            time.sleep(0.1)
    hold(sys.argv[1])
    print("late line after the page opened", flush=True)
    time.sleep(300)
    """
)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no Chromium here: `apt install chromium chromium-driver` (scripts/setup.sh does, as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1400"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def test_the_dashboard_shows_a_live_pool_in_a_real_browser(home, pool_name, tmp_path, browser):
    from selenium.webdriver.common.by import By

    (tmp_path / "app.py").write_text(APP)
    go = tmp_path / "go"
    cfg = f"pool={pool_name},hosts=2,preload=none"
    res = torchx(
        home, "run", "-s", "monarch_local", "-cfg", cfg, "utils.python", "--script", "app.py", str(go), cwd=tmp_path
    )
    app = res.stdout.strip().splitlines()[-1].rsplit(":", 1)[-1]
    err = tmp_path / "dashboard.err"  # (a file, not a pipe no one reads while it serves)
    dash = subprocess.Popen(
        [str(BIN / "monarch-torchx"), "dashboard", "--pool", pool_name],
        env=cli_env(home),
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        text=True,
        # (a suite started in the background of a script inherits SIGINT ignored, and so would the dashboard)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert dash.stdout is not None
        url = dash.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and "?token=" in url, url
        base = url.split("?")[0]
        assert _status(base) == 403 and _status(base + "?token=wrong") == 403
        assert _status(base + f"api/pools?token={url.split('token=')[1]}") == 200

        browser.get(url)
        text = lambda el: browser.find_element(By.ID, el).text  # noqa: E731
        wait_for(lambda: app in text("replicas") and "RUNNING" in text("replicas"), timeout=60, what="the app's row")
        hosts = text("hosts")
        assert hosts.count(" ok ") == 2, hosts
        wait_for(lambda: "early line" in text("logs"), timeout=60, what="the first log line")
        assert "late line" not in text("logs")
        go.touch()  # the app prints its next line now, after the page opened: it must appear without a reload
        wait_for(lambda: "late line after the page opened" in text("logs"), timeout=60, what="the late line")
        browser.find_element(By.CSS_SELECTOR, "tr.replica").click()
        wait_for(lambda: "time.sleep" in text("stacks") or "<module>" in text("stacks"), timeout=60, what="stacks")
        assert "host 0 pid" in text("stacks")
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

        assert torchx(home, "pool", "stop", pool_name).returncode == 0
        wait_for(lambda: f"pool {pool_name} was stopped" in text("banner"), timeout=30, what="the stopped banner")
    finally:
        dash.send_signal(signal.SIGINT)
        try:
            dash.wait(timeout=15)
        except subprocess.TimeoutExpired:
            dash.kill()
    assert dash.returncode in (130, 0, -signal.SIGINT), err.read_text()[-3000:]
