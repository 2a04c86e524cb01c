"""The dashboard in a real browser: headless Chromium drives every page of a running app.

Needs Debian's chromium and chromium-driver (.ci/run installs them); screenshots go to
$MOESPEC_SCREENSHOTS (default: the test's temporary folder).
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moe_spec.app.screens import PAGES
from moe_spec.capture import cli as capture_cli
from moe_spec.replay import cli as replay_cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.slow,  # scripts/test.sh --fast leaves it out
              pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                 reason="needs chromium and chromedriver (apt-get install "
                                        "chromium chromium-driver; .ci/run does)")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    assert capture_cli.main(["--limit", "2", "--max-new-tokens", "16", "--out", str(root),
                             "--no-progress", "--run", "eval"]) == 0
    assert capture_cli.main(["--limit", "2", "--offset", "100", "--max-new-tokens", "16",
                             "--out", str(root), "--no-progress", "--run", "cal", "--role",
                             "calibration"]) == 0
    assert replay_cli.main(["--traces", str(root), "--calibration", "cal", "--ranking", "router",
                            "oracle", "sqmass", "coact", "--budget", "sweep",
                            "--no-progress"]) == 0
    assert replay_cli.main(["--traces", str(root), "--mode", "closed", "--ranking", "router",
                            "--coverage", "substitution", "--budget", "sweep",
                            "--no-progress"]) == 0
    # the batch regime: a batched capture, budgets over virtual batches, measured speedups
    assert capture_cli.main(["--limit", "2", "--max-new-tokens", "16", "--out", str(root),
                             "--no-progress", "--run", "eval-b2", "--batch-size", "2"]) == 0
    assert replay_cli.main(["--traces", str(root), "--run", "eval", "--calibration", "cal",
                            "--ranking", "router", "coact", "oracle", "--budget", "8,16,24,32",
                            "--batch-size", "2", "--no-progress"]) == 0
    from moe_spec.profiling import profile_batch
    assert profile_batch.main(["--limit", "4", "--max-new-tokens", "8", "--batch-sizes", "1,2,4",
                               "--budget", "16", "--out", str(root), "--no-progress", "--repeats", "2"]) == 0
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moe_spec.app.launch", "--traces", str(root), "--port",
                             str(port), "--headless"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("the app did not start within 90 s")
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--window-size=1400,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def wait_idle(driver, timeout=60):
    """Until Streamlit has finished running the script: the app reports ``notRunning`` (after
    having run) and shows content, three checks in a row."""
    from selenium.webdriver.common.by import By
    deadline = time.time() + timeout
    calm = 0
    while time.time() < deadline:
        app = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stApp"]')
        state = app[0].get_attribute("data-test-script-state") if app else None
        main = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stMainBlockContainer"]')
        calm = calm + 1 if state == "notRunning" and main and main[0].text.strip() else 0
        if calm >= 3:
            return
        time.sleep(0.25)
    raise AssertionError("page did not finish rendering")


def test_every_page_in_headless_chromium(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    shots = Path(os.environ.get("MOESPEC_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    browser.get(server)
    wait_idle(browser)
    first = time.perf_counter() - start
    print(f"first page rendered in {first:.2f} s")
    for page, (title, _) in PAGES.items():
        # every page has its own URL (the default page lives at the root)
        browser.get(server if page == "overview" else f"{server}/{page.replace('_', '-')}")
        time.sleep(0.5)
        wait_idle(browser)
        errors = browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
        assert not errors, f"{title}: {errors[0].text[:300]}"
        assert "Page not found" not in browser.find_element(By.TAG_NAME, "body").text, title
        headers = [h.text for h in browser.find_elements(
            By.CSS_SELECTOR, '[data-testid="stMainBlockContainer"] h2')]
        assert title in headers, (title, headers)
        # a local analysis tool: Streamlit's Deploy button is hidden (client.toolbarMode viewer)
        assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="stAppDeployButton"]')
        time.sleep(1.0)  # let plotly finish drawing before the screenshot
        browser.save_screenshot(str(shots / f"{page.replace('_', '-')}.png"))
        # and the whole page (the app scrolls inside its own container): a window as tall
        height = browser.execute_script(
            "const m = document.querySelector('[data-testid=\"stMain\"]');"
            "return m ? m.scrollHeight : document.body.scrollHeight;")
        browser.set_window_size(1400, min(int(height) + 150, 8000))
        time.sleep(1.0)
        browser.save_screenshot(str(shots / f"{page.replace('_', '-')}-full.png"))
        browser.set_window_size(1400, 1000)
    assert len(list(shots.glob("*.png"))) >= 2 * len(PAGES)
