"""The chat page at GET /: served, self-contained, and driven in headless Chromium against a real server.

The page test always runs. The browser tests (marked ``browser``) need selenium, chromium and
chromedriver, and are skipped with the reason when one is missing:

    apt-get install -y chromium chromium-driver && pip install selenium
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import wave
from html.parser import HTMLParser

import httpx
import pytest

from serving_fixtures import ScriptedEngine, running_server
from torchgemma.llm import LLM
from torchgemma.serving.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-gemma"
KEY = "page-secret"
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1000,800",
)


@pytest.fixture(scope="module")
def llm(llm_checkpoint) -> LLM:  # noqa: F811
    return LLM(llm_checkpoint)


@pytest.fixture(scope="module")
def served(llm):
    """The tiny random model behind a real server; yields (base URL, app)."""
    app = create_app(llm, model_name=MODEL, max_batch_size=2, max_len=1024)
    with running_server(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def scripted(llm):
    """A server with an API key whose model says what the test scripts; yields (base URL, engine)."""
    engine = ScriptedEngine(llm.tokenizer, [], stop_id=llm.tokenizer.turn_end_id, max_len=512)
    with running_server(create_app(llm, model_name=MODEL, engine=engine, api_key=KEY)) as url:
        yield url, engine


# ── the page itself ─────────────────────────────────────────────────────────────────────────


class _Elements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_page_is_served_and_self_contained(served):
    url, _ = served
    response = httpx.get(f"{url}/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    parser = _Elements()
    parser.feed(page)
    by_id = {attrs["id"]: tag for tag, attrs in parser.tags if attrs.get("id")}
    assert by_id["prompt"] == "textarea"
    assert by_id["send"] == by_id["stop"] == "button"
    assert {"messages", "think", "max-tokens", "temperature", "api-key", "new-chat", "file"} <= by_id.keys()

    # Nothing loaded from elsewhere: no external src/href, no external script or stylesheet, no URL at all.
    for tag, attrs in parser.tags:
        for name in ("src", "href", "action", "poster", "srcset", "data"):
            value = (attrs.get(name) or "").strip().lower()
            assert not re.match(r"(https?:)?//", value), (
                f"<{tag} {name}={value!r}> loads an external resource"
            )
        assert not (tag == "script" and attrs.get("src")), "scripts are inline"
        if tag == "link":  # only the inline favicon, which saves a request for /favicon.ico
            assert (attrs.get("href") or "").startswith("data:"), "styles are inline"
    assert not re.search(r"https?://", page, re.IGNORECASE)
    assert "@import" not in page
    # Model text goes in with textContent only.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
        assert sink not in page


# ── in a browser ────────────────────────────────────────────────────────────────────────────


def _missing_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "no chromium binary on PATH (apt-get install -y chromium chromium-driver)"
    if not shutil.which("chromedriver"):
        return "no chromedriver binary on PATH (apt-get install -y chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser():
    reason = _missing_browser()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="chat-page-profile-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(
            options=options, service=Service(executable_path=shutil.which("chromedriver"))
        )
        driver.set_page_load_timeout(30)
        try:
            yield driver
        finally:
            driver.quit()


# The last assistant turn as the page shows it (None before the first).
LAST_REPLY = """
const turns = document.querySelectorAll("#messages .assistant");
const turn = turns[turns.length - 1];
if (!turn) return null;
const thinking = turn.querySelector("details.thinking");
const error = turn.querySelector(".error");
return {
  count: turns.length,
  state: turn.dataset.state,
  answer: turn.querySelector(".answer").textContent,
  stats: turn.querySelector(".stats").textContent,
  thinking: thinking ? thinking.querySelector(".reasoning").textContent : null,
  thinking_open: thinking ? thinking.open : null,
  error: error ? error.textContent : null,
};
"""


def wait_for(driver, condition, timeout: float = 20, what: str = "the page"):
    """Poll ``condition(driver)`` until it is truthy; its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, f"waiting for {what}")


def last_reply(driver) -> dict | None:
    return driver.execute_script(LAST_REPLY)


def wait_reply(driver, done, timeout: float = 20) -> dict:
    return wait_for(
        driver, lambda d: (r := last_reply(d)) is not None and done(r) and r, timeout, "the reply"
    )


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def open_page(driver, url: str, model_label: str = MODEL) -> None:
    """A fresh page (nothing stored from an earlier test), once it has asked the server for its model."""
    driver.get(f"{url}/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    wait_for(driver, lambda d: text_of(d, "model") == model_label, 10, f"the model label {model_label!r}")


def set_settings(driver, **values) -> None:
    """Open Settings, type the values (field id with _ for -), close it."""
    from selenium.webdriver.common.by import By

    summary = driver.find_element(By.CSS_SELECTOR, "#settings > summary")
    summary.click()
    for name, value in values.items():
        field = driver.find_element(By.ID, name.replace("_", "-"))
        field.clear()
        field.send_keys(str(value))
    summary.click()


def send(driver, text: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def chat_api(url: str, text: str, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.browser
def test_streamed_reply_equals_the_api(browser, served):
    url, _ = served
    open_page(browser, url)
    set_settings(browser, max_tokens=12, temperature=0)
    send(browser, "Tell me about the sea.")
    reply = wait_reply(browser, lambda r: r["answer"] and "tok/s" in r["stats"])

    expected = chat_api(
        url,
        "Tell me about the sea.",
        max_tokens=12,
        temperature=0,
        chat_template_kwargs={"enable_thinking": False},
    )["choices"][0]
    assert reply["answer"] == expected["message"]["content"]
    assert reply["thinking"] == expected["message"].get("reasoning_content")
    assert reply["state"] == "done" and reply["error"] is None
    rate = re.search(r"12 tokens · ([0-9.]+) tok/s", reply["stats"])
    assert rate and float(rate.group(1)) > 0, reply["stats"]
    assert f"finish: {expected['finish_reason']}" in reply["stats"]


@pytest.mark.browser
def test_stop_aborts_the_reply_and_frees_the_slot(browser, served):
    from selenium.webdriver.common.by import By

    url, app = served
    runner = app.state.runner
    open_page(browser, url)
    set_settings(browser, max_tokens=900, temperature=0)  # ~8 s of tokens on this machine
    send(browser, "Hi")
    wait_reply(browser, lambda r: r["answer"] and r["state"] == "streaming")
    assert runner.running == 1
    browser.find_element(By.ID, "stop").click()

    reply = wait_reply(browser, lambda r: r["state"] != "streaming", timeout=5)
    assert reply["state"] == "stopped" and "Stopped" in reply["stats"] and reply["error"] is None
    assert "tok/s" not in reply["stats"]
    assert not browser.find_element(By.ID, "stop").is_enabled()
    assert browser.find_element(By.ID, "send").is_enabled()
    deadline = time.monotonic() + 5
    while runner.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.running == 0
    assert not any(runner.engine.cache.lengths)


@pytest.mark.browser
def test_thinking_history_and_new_chat(browser, scripted, llm):
    """Thinking folds when done; the next turn sends the answer back as text (Enter sends,
    Shift+Enter is a new line); New chat forgets the conversation."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, engine = scripted
    open_page(browser, url, "API key needed (Settings)")
    set_settings(browser, api_key=KEY)
    wait_for(browser, lambda d: text_of(d, "model") == MODEL, 10, "the model once the key is set")
    browser.find_element(By.ID, "think").click()

    engine.replies.extend(["<|channel>thought\nPlan the answer.<channel|>Hello there!", "The end."])
    send(browser, "Greetings, model.")
    reply = wait_reply(browser, lambda r: "tok/s" in r["stats"])
    assert (reply["thinking"], reply["thinking_open"]) == ("Plan the answer.", False)
    assert reply["answer"] == "Hello there!" and "finish: stop" in reply["stats"]
    assert "<|think|>" in llm.tokenizer.decode(engine.prompts[-1])

    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("And then?")
    ActionChains(browser).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    prompt.send_keys("Go on.")
    assert prompt.get_property("value") == "And then?\nGo on."
    prompt.send_keys(Keys.ENTER)
    reply = wait_reply(browser, lambda r: r["count"] == 2 and "tok/s" in r["stats"])
    assert reply["answer"] == "The end."
    rendered = llm.tokenizer.decode(engine.prompts[-1])
    assert rendered.count("Greetings, model.") == rendered.count("Hello there!") == 1
    assert "Go on." in rendered and "Plan the answer." not in rendered

    browser.find_element(By.ID, "new-chat").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#messages .turn") == []
    engine.replies.append("Ok.")
    send(browser, "Fresh start.")
    assert wait_reply(browser, lambda r: "tok/s" in r["stats"])["answer"] == "Ok."
    assert "Greetings" not in llm.tokenizer.decode(engine.prompts[-1])

    browser.refresh()  # the key is kept in this browser
    wait_for(browser, lambda d: text_of(d, "model") == MODEL, 10, "the model with the stored key")
    assert browser.find_element(By.ID, "api-key").get_property("value") == KEY


@pytest.mark.browser
def test_errors_and_attachments(browser, scripted, tmp_path):
    """A refused request shows the status and the server's message inline and puts the message
    back; images and WAV audio reach the server in its formats; other audio is refused."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    url, engine = scripted
    prompts = len(engine.prompts)
    open_page(browser, url, "API key needed (Settings)")
    send(browser, "Anyone there?")
    reply = wait_reply(browser, lambda r: r["state"] != "streaming")
    assert reply["state"] == "failed"
    assert "HTTP 401" in reply["error"] and "missing or wrong API key" in reply["error"]
    assert browser.find_element(By.CSS_SELECTOR, "#messages .user").get_attribute("class").endswith("unsent")
    assert browser.find_element(By.ID, "prompt").get_property("value") == "Anyone there?"

    Image.new("RGB", (8, 8), "red").save(tmp_path / "red.png")
    with wave.open(str(tmp_path / "beep.wav"), "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(16000)
        clip.writeframes(b"\x00\x10" * 1600)
    (tmp_path / "song.mp3").write_bytes(b"ID3" + bytes(64))
    files = browser.find_element(By.ID, "file")
    files.send_keys(str(tmp_path / "song.mp3"))
    wait_for(browser, lambda d: "only WAV audio" in text_of(d, "attach-error"), 5, "the refusal")
    assert browser.find_element(By.ID, "attach-error").is_displayed()
    files.send_keys("\n".join(str(tmp_path / name) for name in ("red.png", "beep.wav")))
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments .chip")) == 2, 5, "chips")
    assert browser.find_elements(By.CSS_SELECTOR, "#attachments .chip img")
    assert not browser.find_element(By.ID, "attach-error").is_displayed()

    set_settings(browser, api_key=KEY)
    browser.find_element(By.ID, "send").click()
    reply = wait_reply(browser, lambda r: r["count"] == 2 and r["state"] != "streaming")
    # The media were decoded (a bad data URL or WAV is "cannot read ..."); this text-only
    # checkpoint then refuses them.
    assert "HTTP 400" in reply["error"] and "tower" in reply["error"], reply["error"]
    assert "cannot read" not in reply["error"]
    chips = browser.find_elements(By.CSS_SELECTOR, "#attachments .chip")
    assert len(chips) == 2  # back in the composer, with the text
    chips[0].find_element(By.CSS_SELECTOR, "button").click()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attachments .chip")) == 1
    assert len(engine.prompts) == prompts  # neither request reached the model
