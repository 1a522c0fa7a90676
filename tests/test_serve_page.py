"""The web page of serve.py in a real headless chromium: type a sentence, click Translate, the
translation and its alternatives appear, and the cross-attention heatmap of the chosen one is drawn.

Needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver; .ci/run installs
them) and selenium (the dev extra). Without them the test is skipped here, and fails in CI (CI=true).
The page as the test leaves it is saved as serve-page.png in the test's tmp_path, or at the path in
the environment variable SERVE_PAGE_SCREENSHOT."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from .servers import QUICK, Server, build_checkpoint, corpus_lines

pytestmark = pytest.mark.e2e  # serve.py and a headless browser

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser_or_skip():
    """A headless chromium driven by selenium, or a skip (a failure in CI) saying what is missing."""
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [what for what, found in (("chromium", browser), ("chromedriver", driver), ("selenium", webdriver)) if not found]  # fmt: skip
    if missing:
        reason = f"no {' or '.join(missing)} installed (apt-get install chromium chromium-driver; pip install selenium)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the browser test, but there is {reason}")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)  # --no-sandbox: CI runs as root
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture
def browser():
    driver = browser_or_skip()
    yield driver
    driver.quit()


def test_type_translate_and_see_the_translation_and_its_heatmap(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    sentence = corpus_lines("de", 1, "val")[0]
    model = build_checkpoint(tmp_path / "model.pt")
    with Server(f"checkpoint={model}", *QUICK) as server:
        expected = httpx.post(server.url + "/v1/translate", json={"text": [sentence], "beam_size": 4}).json()
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(ready.text_to_be_present_in_element((By.ID, "model"), "de->en"))
        browser.find_element(By.ID, "source").send_keys(sentence)
        browser.find_element(By.ID, "translate").click()
        best = wait.until(ready.visibility_of_element_located((By.CSS_SELECTOR, "#translations > li > .choice")))
        assert best.text == expected["translations"][0]
        alternatives = browser.find_elements(By.CSS_SELECTOR, "#translations .alternatives li")
        assert len(alternatives) == 3  # the page asks for 3 by default

        wait.until(ready.visibility_of_element_located((By.ID, "heatmap")))
        rows = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#heatmap tbody tr"))
        target_tokens = [row.find_element(By.TAG_NAME, "th").text for row in rows]
        assert target_tokens[-1] == "</s>" and len(rows) > 1
        source_tokens = browser.find_elements(By.CSS_SELECTOR, "#heatmap thead th")[1:]
        cells = rows[0].find_elements(By.TAG_NAME, "td")
        assert len(cells) == len(source_tokens) > 1
        assert all("rgba" in cell.get_attribute("style") for cell in cells)
        assert not browser.find_element(By.ID, "status").get_attribute("class")  # no error shown
        browser.save_screenshot(os.environ.get("SERVE_PAGE_SCREENSHOT") or str(tmp_path / "serve-page.png"))


def test_a_many_to_many_model_offers_its_target_languages(browser, tmp_path):
    """The page lists the model's target languages and sends the chosen one: without it the
    server would answer 422, and the translation and heatmap are those of target_lang=fr."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import Select, WebDriverWait

    sentence = corpus_lines("de", 1, "val")[0]
    model = build_checkpoint(tmp_path / "many.pt", directions=("de-en", "de-fr"))
    with Server(f"checkpoint={model}", *QUICK) as server:
        expected = httpx.post(server.url + "/v1/translate", json={"text": [sentence], "beam_size": 4, "target_lang": "fr"}).json()  # fmt: skip
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(ready.text_to_be_present_in_element((By.ID, "model"), "into en, fr"))
        choice = Select(browser.find_element(By.ID, "target_lang"))
        assert [option.text for option in choice.options] == ["en", "fr"]
        choice.select_by_visible_text("fr")
        browser.find_element(By.ID, "source").send_keys(sentence)
        browser.find_element(By.ID, "translate").click()
        best = wait.until(ready.visibility_of_element_located((By.CSS_SELECTOR, "#translations > li > .choice")))
        assert best.text == expected["translations"][0]
        rows = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#heatmap tbody tr"))
        assert rows and browser.find_elements(By.CSS_SELECTOR, "#heatmap thead th")[1].text == "<2fr>"
        assert not browser.find_element(By.ID, "status").get_attribute("class")  # no error shown
