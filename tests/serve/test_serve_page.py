"""``GET /`` in a real browser: headless Chromium (Debian's ``chromium`` + ``chromium-driver``), driven by Selenium,
loads the page from a live server on tiny-random, sends one prompt to base and tuned at once, waits until both
answers are complete, and saves a screenshot under the test's tmp dir."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

pytest.importorskip("fastapi")
selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install 'qwenft[test]')")

from tests.serve.conftest import LiveServer, make_adapter, served  # noqa: E402


def chromium():
    """Paths of the browser and its driver, or skip naming what is missing."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium chromium-driver)")
    return browser, driver


@pytest.fixture
def browser(tmp_path, monkeypatch):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium()
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager never downloads a driver or a browser
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,900", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_page_streams_base_and_tuned_side_by_side(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # a model id with markup in it (serve.name is free text): shown as text, never parsed as HTML
    model = dataclasses.replace(served(make_adapter(tmp_path)), tuned='<b id="injected">run</b> & "q"')
    with LiveServer(model) as server:
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".side")) == 2)
        sides = browser.find_elements(By.CSS_SELECTOR, ".side")
        assert [s.get_attribute("data-model") for s in sides] == model.models
        assert browser.find_elements(By.ID, "injected") == []
        assert sides[1].find_element(By.TAG_NAME, "h2").text == f"tuned: {model.tuned}"
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("春天来了, tell me a story")
        for field, value in (("max_tokens", "24"), ("temperature", "0")):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        browser.find_element(By.ID, "colour").click()
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: all(s.get_attribute("data-state") in ("done", "error")
                                 for s in d.find_elements(By.CSS_SELECTOR, ".side")))
        shot = tmp_path / "serve_page.png"
        browser.save_screenshot(str(shot))
        sides = browser.find_elements(By.CSS_SELECTOR, ".side")
        stats = [browser.find_element(By.ID, f"stats-{i}").text for i in range(2)]
        assert [s.get_attribute("data-state") for s in sides] == ["done", "done"], stats
        texts = [browser.find_element(By.ID, f"text-{i}").text for i in range(2)]
        assert all(texts) and texts[0] != texts[1]  # both answered; the adapter changes the answer
        assert all("tokens/s" in s and "mean entropy" in s for s in stats)
        spans = browser.find_elements(By.CSS_SELECTOR, ".text span")
        assert spans and all(s.get_attribute("data-entropy") for s in spans)
        assert any("background" in (s.get_attribute("style") or "") for s in spans)  # coloured by entropy
        assert shot.is_file() and shot.stat().st_size > 5_000 and os.access(shot, os.R_OK)
