"""The operator/user page (app/static) in real headless Chromium: Debian's chromium + chromedriver, driven by
selenium, against a live HTTP server of the app, a real worker and the tiny models. It submits a music job from
the form, watches the stages reach done (following the job's server-sent events with EventSource), checks that the <audio> element's source is a playable file, cancels a
running job from its button, and works against a server that requires an API token. It shows an open job's ETA and
a track's restarts, retries a canceled job from its button (and shows the refusal past the retry limit), draws a
finished track's waveform from its decoded audio, and pages and searches the job list (GET /api/v1/jobs's
`offset` and `q`, whose checks are tested here without a browser). Screenshots go to the test's tmp_path and to
test-artifacts/ (git-ignored).
Needs scripts/install_browser.sh (scripts/test.sh runs it): without the browser the tests fail."""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess

import pytest
import requests

from harness.processes import REPO, wait_until
from harness.stack import REFERENCE_ENGINE
from harness.media import face_video, tone

slow = pytest.mark.slow  # chromium drives the page through whole jobs (~50 s here); the listing's checks are fast

ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1000",
    "--autoplay-policy=no-user-gesture-required",
)
PAGE_SIZE = 20  # app/static/app.js
RUNNING_STATES = {"backbone", "superres", "decoding", "exporting"}
TERMINAL_STATES = {"done", "failed", "canceled", "partial"}


@pytest.fixture
def browser(tmp_path):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [
        name
        for name, found in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER), ("selenium", webdriver))
        if not found
    ]
    if missing:  # scripts/test.sh installs them: a missing browser is a broken set-up, never a skip
        pytest.fail(f"{', '.join(missing)} missing: run scripts/install_browser.sh and scripts/setup.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # both paths given: Selenium Manager never tries to download anything
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(
        service=Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log")), options=options
    )
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


# ---- page helpers ---------------------------------------------------------------------------------------------


def click_button(driver, selector: str, label: str) -> bool:
    """Click the button labelled `label`; False when it is not there yet or the page re-rendered it meanwhile
    (the status table is rebuilt on every poll)."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        buttons = [b for b in css(driver, selector) if b.text == label]
        if buttons:
            buttons[0].click()
            return True
    except StaleElementReferenceException:
        pass
    return False


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def job_selector(job_id: str) -> str:
    return f'article[data-job-id="{job_id}"]'


def page_state(driver, job_id: str, what: str = "job") -> str | None:
    """The state the page shows for the job (its article) or its first track."""
    nodes = css(driver, job_selector(job_id) + (" .track" if what == "track" else ""))
    return nodes[0].get_attribute("data-state") if nodes else None


def submit_music(driver, **fields: str) -> str:
    """Fill the music form like a person would, press the button, return the job id the page reports."""
    from selenium.webdriver.support.ui import Select

    form = css(driver, "#music-form")[0]
    Select(css(form, "[name=mode]")[0]).select_by_value(fields.pop("mode"))
    css(form, "summary")[0].click()  # open "Sampling" so the seed field can be typed into
    for name, value in fields.items():
        field = css(form, f"[name={name}]")[0]
        if field.tag_name == "select":
            Select(field).select_by_value(value)
            continue
        field.clear()
        field.send_keys(value)
    css(form, "button[type=submit]")[0].click()

    def reported():
        message = css(driver, "#music-msg")[0]
        if "error" in (message.get_attribute("class") or ""):
            raise AssertionError(f"the page reported an error: {message.text}")
        return message.get_attribute("data-job-id")

    return wait_until(reported, 15, 0.1, "the page to report the submitted job")


def wait_page_state(
    driver, job_id: str, states: set[str], timeout: float, what: str = "job", seen: set[str] | None = None
) -> str:
    def check():
        state = page_state(driver, job_id, what)
        if seen is not None and state:
            seen.add(state)
            seen.update(b.get_attribute("data-status") for b in css(driver, job_selector(job_id) + " .stage"))
        return state if state in states else None

    return wait_until(check, timeout, 0.1, f"the page to show {what} {job_id} in {sorted(states)}")


def media_metadata(driver, element) -> dict:
    """Let Chromium itself load the element's source: duration and error code once metadata is in."""
    return driver.execute_async_script(
        """
        const [media, done] = arguments;
        const report = () => done({duration: media.duration, error: media.error && media.error.code});
        if (media.readyState >= 1 || media.error) report();
        else { media.addEventListener('loadedmetadata', report); media.addEventListener('error', report); }
    """,
        element,
    )


def console_errors(driver, ignore: str | None = None) -> list[str]:
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and not (ignore and ignore in entry["message"])
    ]


def ffprobe_duration(data: bytes, path) -> float:
    path.write_bytes(data)
    probe = subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return float(probe.stdout.strip())


WAVEFORM_PIXELS = """
const canvas = arguments[0];
const {width, height} = canvas;
const data = canvas.getContext('2d').getImageData(0, 0, width, height).data;
const heights = [];
let sum = 0, squares = 0;
for (let x = 0; x < width; x++) {
  let painted = 0;
  for (let y = 0; y < height; y++) {
    const alpha = data[(y * width + x) * 4 + 3];
    if (alpha > 0) painted++;
    sum += alpha;
    squares += alpha * alpha;
  }
  heights.push(painted);
}
const mean = sum / (width * height);
return {width, height, heights, variance: squares / (width * height) - mean * mean,
        png_chars: canvas.toDataURL('image/png').length};
"""


def mp3_column_heights(data: bytes, columns: int, height: int) -> list[float]:
    """What a min/max waveform of this MP3 (decoded by ffmpeg), `columns` wide, draws in each column, in pixels."""
    import numpy as np

    decoded = subprocess.run(
        ["ffmpeg", "-v", "error", "-i", "pipe:0", "-f", "s16le", "-acodec", "pcm_s16le", "pipe:1"],
        input=data,
        capture_output=True,
        check=True,
        timeout=30,
    )
    samples = np.frombuffer(decoded.stdout, dtype="<i2") / 32768  # channels interleaved: a column spans them all
    edges = np.floor(np.arange(columns + 1) * len(samples) / columns).astype(int)
    return [
        (min(1.0, max(0.0, chunk.max())) - max(-1.0, min(0.0, chunk.min()))) * height / 2
        for chunk in (samples[start : max(start + 1, end)] for start, end in zip(edges[:-1], edges[1:], strict=True))
    ]


def keep_screenshot(driver, tmp_path, name: str):
    """The page as it is now, in the test's tmp_path and copied to test-artifacts/ (git-ignored) to be kept."""
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)
    return shot


def listed_ids(driver) -> list[str]:
    """The job ids the list shows, top to bottom (read in one go: the list re-renders while it is read)."""
    return driver.execute_script("return [...document.querySelectorAll('#jobs > article')].map(a => a.dataset.jobId)")


def api_ids(stack, **params) -> list[str]:
    reply = stack.client.get("/api/v1/jobs", query_string=params)
    assert reply.status_code == 200, reply.get_json()
    return [job["job_id"] for job in reply.get_json()["jobs"]]


def search_for(driver, text: str) -> None:
    """Replace the search box's text as a person would, and press Enter."""
    from selenium.webdriver.common.keys import Keys

    box = css(driver, "#job-search")[0]
    box.send_keys(Keys.CONTROL + "a", Keys.BACKSPACE)
    box.send_keys(text + Keys.ENTER)


# ---- tests ----------------------------------------------------------------------------------------------------


@slow
def test_page_submits_music_job_shows_progress_and_plays_it(make_stack, browser, tmp_path):
    stack = make_stack()
    stack.start_worker(0)
    browser.get(stack.base_url + "/")
    wait_until(lambda: css(browser, "#workers tr[data-status=idle]"), 15, 0.1, "the page to list the idle worker")

    tags = 'lo-fi <i>piano</i> & "keys"'  # user text with markup: the page must show it, not parse it
    job_id = submit_music(
        browser,
        mode="vocal",
        tags=tags,
        lyrics="[verse]\nla la la\nna na",
        duration_s="2",
        num_tracks="1",
        seed="5",
        priority="high",
    )
    params = stack.job(job_id)["params"]
    assert (params["tags"], params["duration_s"], params["num_tracks"], params["seed"]) == (tags, 2.0, 1, 5)
    assert params["priority"] == "high"  # the page's priority selector
    assert params["mode"] == "vocal" and "la la la" in params["lyrics"]

    seen: set[str] = set()
    final = wait_page_state(browser, job_id, TERMINAL_STATES, 180, "track", seen)
    assert final == "done", stack.job(job_id)
    # The page showed the job live before it finished: a stage state and a bar that was running.
    assert seen & RUNNING_STATES and "running" in seen, seen
    assert page_state(browser, job_id) == "done"
    # It followed the job's server-sent events (EventSource), and closed the stream at `event: end`.
    article = css(browser, job_selector(job_id))[0]
    wait_until(lambda: article.get_attribute("data-events") == "ended", 15, 0.1, "the page to see the stream end")
    assert int(article.get_attribute("data-event-count")) >= 8  # submit … route, start, report…, finish × 4
    assert browser.execute_script("return streams.size") == 0

    article = css(browser, job_selector(job_id))[0]
    bars = [(b.get_attribute("data-stage"), b.get_attribute("data-status")) for b in css(article, ".stage")]
    assert bars == [("backbone", "done"), ("superres", "done"), ("decode", "done"), ("export", "done")]
    assert tags in css(article, ".summary")[0].text and not css(article, ".summary i")
    assert not css(article, ".cancel")[0].is_displayed()

    audio = wait_until(lambda: css(article, "audio"), 15, 0.1, "the audio player")[0]
    src = audio.get_attribute("src")
    assert src == f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/0.mp3"
    meta = media_metadata(browser, audio)
    assert meta["error"] is None and 1.5 < meta["duration"] < 3.0, meta
    reply = requests.get(src, timeout=10)
    assert reply.status_code == 200 and reply.headers["Content-Type"] == "audio/mpeg"
    assert abs(ffprobe_duration(reply.content, tmp_path / "page.mp3") - 2.0) < 0.3

    links = {a.get_attribute("data-format"): a for a in css(article, ".downloads a")}
    assert set(links) == {"mp3", "wav"}
    assert links["wav"].get_attribute("download").endswith("track0.wav")
    wav = requests.get(links["wav"].get_attribute("href"), timeout=10)
    assert wav.status_code == 200 and wav.content[:4] == b"RIFF"

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "web_page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    assert console_errors(browser) == []


@slow
def test_cancel_button_cancels_a_running_job(make_stack, browser):
    stack = make_stack(**REFERENCE_ENGINE)
    stack.start_worker(0)
    browser.get(stack.base_url + "/")
    job_id = submit_music(browser, mode="instrumental", tags="ambient, drone", duration_s="60", num_tracks="1")
    wait_page_state(browser, job_id, RUNNING_STATES, 90, "track")
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "web_page_running.png"))

    css(browser, job_selector(job_id) + " .cancel")[0].click()
    wait_page_state(browser, job_id, {"canceled"}, 30)
    record = stack.job(job_id)
    assert record["state"] == "canceled" and record["tracks"][0]["state"] == "canceled", record
    article = css(browser, job_selector(job_id))[0]
    assert page_state(browser, job_id, "track") == "canceled"
    head = css(article, ".track-head")[0].text
    assert head.split().count("canceled") == 1, head  # the badge says it; the detail does not say it again
    assert css(article, ".track-head .info")[0].text.split()[0] in ("during", "before"), head  # why, still said
    assert "canceled" in [b.get_attribute("data-status") for b in css(article, ".stage")]
    assert not css(article, ".cancel")[0].is_displayed() and not css(article, "audio")
    # The worker dropped the stage: the page shows it idle again.
    wait_until(lambda: css(browser, "#workers tr[data-status=idle]"), 30, 0.1, "the worker to show idle")

    # Steering: drain the queue from its row, then resume it.
    for action, flag in (("Drain", "1"), ("Resume", "0")):
        wait_until(
            lambda action=action: click_button(browser, '#queues tr[data-queue="gpu0"] button.drain', action),
            30,
            0.1,
            f"a click on {action}",
        )
        wait_until(
            lambda flag=flag: css(browser, f'#queues tr[data-queue="gpu0"][data-draining="{flag}"]'),
            30,
            0.1,
            f"the queue row to show draining={flag}",
        )
        gpu0 = next(q for q in stack.client.get("/api/v1/status").get_json()["queues"] if q["name"] == "gpu0")
        assert gpu0["draining"] is (flag == "1")
    assert console_errors(browser) == []


@slow
def test_page_submits_lipsync_uploads_and_plays_the_video(make_stack, browser, tmp_path):
    stack = make_stack()
    stack.start_worker(0)
    video = face_video(tmp_path / "face.mp4", 3.2, 25)
    audio = tone(tmp_path / "speech.wav", 1.0)
    browser.get(stack.base_url + "/")
    form = css(browser, "#lipsync-form")[0]
    css(form, "[name=video]")[0].send_keys(str(video))  # a file input takes a local path: a real upload
    css(form, "[name=audio]")[0].send_keys(str(audio))
    css(form, "summary")[0].click()
    css(form, "[name=fps]")[0].send_keys("10")
    from selenium.webdriver.support.ui import Select

    Select(css(form, "[name=priority]")[0]).select_by_value("low")
    css(form, "button[type=submit]")[0].click()
    job_id = wait_until(
        lambda: css(browser, "#lipsync-msg")[0].get_attribute("data-job-id"),
        30,
        0.1,
        "the page to report the lip-sync job",
    )
    assert stack.job(job_id)["params"]["output_frames"] == 10  # 1 s of audio at the 10 fps typed in
    assert stack.job(job_id)["params"]["priority"] == "low"

    assert wait_page_state(browser, job_id, TERMINAL_STATES, 180, "track") == "done", stack.job(job_id)
    article = css(browser, job_selector(job_id))[0]
    assert [b.get_attribute("data-stage") for b in css(article, ".stage")] == ["prepare", "lipsync", "mux"]
    player = wait_until(lambda: css(article, "video"), 15, 0.1, "the video player")[0]
    assert player.get_attribute("src") == f"{stack.base_url}/api/v1/jobs/{job_id}/video.mp4"
    meta = media_metadata(browser, player)
    assert meta["error"] is None and 0.8 < meta["duration"] < 1.3, meta
    assert [a.get_attribute("data-format") for a in css(article, ".downloads a")] == ["mp4"]
    assert console_errors(browser) == []


@slow
def test_page_with_api_token(make_stack, browser):
    token = "s3cret-page-token"
    stack = make_stack(API_TOKEN=token)
    stack.start_worker(0, wait=False)  # Stack.wait_worker asks /api/v1/status without a token
    auth = {"Authorization": f"Bearer {token}"}

    def worker_idle():
        workers = requests.get(f"{stack.base_url}/api/v1/status", headers=auth, timeout=5).json()["workers"]
        return any(w["status"] == "idle" for w in workers)

    wait_until(worker_idle, 90, 0.2, "worker gpu0 idle")

    browser.get(stack.base_url + "/")
    wait_until(lambda: css(browser, "#token-needed")[0].is_displayed(), 15, 0.1, "the page to ask for a token")
    assert css(browser, "#conn")[0].get_attribute("data-state") == "token"
    assert not css(browser, "#workers tr")[1:]  # header row only: nothing was readable without the token

    css(browser, "#token")[0].send_keys(token)
    css(browser, "#token-form button[type=submit]")[0].click()
    wait_until(lambda: css(browser, "#workers tr[data-status=idle]"), 15, 0.1, "the worker listed with the token")
    assert not css(browser, "#token-needed")[0].is_displayed()
    assert browser.execute_script("return localStorage.getItem('encore.apiToken')") == token

    job_id = submit_music(browser, mode="instrumental", tags="jazz", duration_s="2", num_tracks="1")
    assert wait_page_state(browser, job_id, TERMINAL_STATES, 180, "track") == "done"
    # EventSource cannot send the token: this page followed the job by polling, the fallback.
    assert css(browser, job_selector(job_id))[0].get_attribute("data-events") is None

    # A reload keeps the token; the player gets the file through fetch + Authorization, as a blob: URL.
    browser.refresh()
    article_audio = job_selector(job_id) + " audio"
    audio = wait_until(lambda: css(browser, article_audio), 15, 0.1, "the audio player after a reload")[0]
    assert audio.get_attribute("src").startswith("blob:")
    meta = media_metadata(browser, audio)
    assert meta["error"] is None and 1.5 < meta["duration"] < 3.0, meta
    plain = requests.get(f"{stack.base_url}/api/v1/jobs/{job_id}/tracks/0.mp3", timeout=10)
    assert plain.status_code == 401  # why the page cannot hand the plain URL to <audio>

    # Other formats are fetched with the token only when their link is clicked.
    wav = css(browser, job_selector(job_id) + " .downloads a[data-format=wav]")[0]
    assert wav.get_attribute("href").endswith("/tracks/0.wav")
    wav.click()
    wait_until(lambda: wav.get_attribute("href").startswith("blob:"), 15, 0.1, "the WAV fetched with the token")
    assert console_errors(browser, ignore="401") == []


@slow
def test_page_follows_a_stream_through_the_redirect_to_the_events_server(make_stack, browser):
    """Behind the events server (ENCORE_EVENTS_URL) the page's EventSource follows the web's 307 to another origin
    (CORS). When that server dies and comes back, Chromium reconnects to the redirected URL (not the web's), with
    Last-Event-ID: its ticket is still good, and nothing is replayed twice."""
    import os
    import signal

    from harness.processes import free_port

    port = free_port()
    events_url = f"http://127.0.0.1:{port}"
    stack = make_stack(ENCORE_EVENTS_URL=events_url, ENCORE_SSE_HEARTBEAT_S="0.5")
    stack.start_events_server(port)
    job_id = stack.submit_music()  # no worker: it waits, open, until it is canceled
    browser.get(stack.base_url + "/")
    article = wait_until(lambda: css(browser, job_selector(job_id)), 15, 0.1, "the page to list the job")[0]
    wait_until(lambda: article.get_attribute("data-events") == "live", 15, 0.1, "the stream to open")
    wait_until(lambda: article.get_attribute("data-event-count") == "2", 15, 0.1, "submit and park")

    tag = "streams.get(arguments[0]).encoreTag"
    browser.execute_script(f"{tag} = 'first'", job_id)  # the same EventSource must come back, not a new one
    first = stack.events_servers[events_url]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    wait_until(lambda: article.get_attribute("data-events") == "reconnecting", 15, 0.1, "the page to see it drop")
    stack.start_events_server(port)
    wait_until(lambda: article.get_attribute("data-events") == "live", 30, 0.1, "the page to reconnect")
    assert browser.execute_script(f"return {tag}", job_id) == "first"
    assert stack.client.delete(f"/api/v1/jobs/{job_id}").status_code == 200
    wait_until(lambda: article.get_attribute("data-events") == "ended", 15, 0.1, "the page to see the stream end")
    assert article.get_attribute("data-event-count") == "3"  # submit, park, then only the cancel: no replay
    assert console_errors(browser, ignore="net::ERR_") == []  # no refusal on the way (a void ticket would be 401)


@slow
def test_page_shows_eta_and_restarts_and_retries_a_canceled_job(make_stack, browser, tmp_path):
    """An open job shows its ETA as a number; a worker killed mid-stage (the lease expires, the track starts again)
    shows "restarted 1×" on the track; canceled from the page, the job offers Retry, which queues it again (the API
    says so); past the retry limit the page shows the server's 403 message."""
    stack = make_stack(ENCORE_LEASE_S="4", ENCORE_PRELOAD="1", ENCORE_MAX_RETRIES="1", **REFERENCE_ENGINE)
    stack.start_worker(0)
    job_id = stack.submit_music(duration_s=30.0)
    browser.get(stack.base_url + "/")
    article = job_selector(job_id)
    wait_page_state(browser, job_id, RUNNING_STATES, 90, "track")

    eta = css(browser, article + " .eta")[0]
    wait_until(lambda: (eta.get_attribute("data-eta") or "").isdigit(), 15, 0.1, "the page to show a numeric ETA")
    assert re.fullmatch(r"ETA \d+ (s|min|h)", eta.text), eta.text
    assert stack.job(job_id)["eta_s"] is not None  # what the page shows it from
    assert css(browser, article + " .restarts")[0].get_attribute("data-restarts") == "0"
    assert css(browser, article + " .restarts")[0].text == ""

    stack.stop_worker(0)  # kill -9 mid-stage: the restarted worker's reaper starts the track again
    # With no worker left the record says so (`worker_offline`), and so does the page, with no ETA (item 3).
    root = css(browser, article)[0]
    wait_until(lambda: root.get_attribute("data-worker-offline") == "1", 30, 0.1, "the page to say no worker runs")
    assert stack.job(job_id)["worker_offline"] is True
    notice = css(browser, article + " .offline")[0]
    assert notice.is_displayed() and notice.text == "no worker online · resumes when one is back"
    wait_until(lambda: eta.text == "ETA unknown", 15, 0.1, "no ETA while no worker runs it")
    keep_screenshot(browser, tmp_path, "web_page_worker_offline.png")
    stack.start_worker(0)
    wait_until(lambda: root.get_attribute("data-worker-offline") == "0", 60, 0.1, "the notice to go")
    assert not notice.is_displayed()
    restarts = css(browser, article + " .restarts")[0]
    wait_until(
        lambda: restarts.get_attribute("data-restarts") not in ("0", None), 90, 0.1, "the page to show a restart"
    )
    assert re.fullmatch(r"restarted [1-9]×", restarts.text), restarts.text
    assert stack.job(job_id)["tracks"][0]["restarts"] == int(restarts.get_attribute("data-restarts"))
    wait_page_state(browser, job_id, RUNNING_STATES, 90, "track")
    keep_screenshot(browser, tmp_path, "web_page_eta_restarts.png")

    retry = css(browser, article + " .retry")[0]
    assert not retry.is_displayed()  # an open job has Cancel, not Retry
    css(browser, article + " .cancel")[0].click()
    wait_page_state(browser, job_id, {"canceled"}, 30)
    wait_until(retry.is_displayed, 15, 0.1, "the Retry button")
    assert retry.text == "Retry" and not css(browser, article + " .cancel")[0].is_displayed()
    assert eta.text == ""  # no ETA for an ended job
    keep_screenshot(browser, tmp_path, "web_page_retry.png")

    retry.click()
    record = stack.wait_job(job_id, states=("queued", "running"), timeout=15)
    assert record["tracks"][0]["retries"] == 1 and not record["cancel_requested"], record
    wait_page_state(browser, job_id, {"queued", "running"}, 15)
    wait_until(lambda: not retry.is_displayed(), 15, 0.1, "Retry to go once the job is open again")

    # ENCORE_MAX_RETRIES=1: a second retry is refused (403 naming `retries`), and the page says why.
    assert stack.client.delete(f"/api/v1/jobs/{job_id}").status_code == 200
    wait_page_state(browser, job_id, {"canceled"}, 30)
    wait_until(retry.is_displayed, 15, 0.1, "the Retry button again")
    retry.click()
    message = css(browser, article + " > p.error")[0]
    wait_until(lambda: message.text, 15, 0.1, "the page to show the refusal")
    assert message.text.startswith("retry refused: retries:"), message.text
    assert stack.job(job_id)["state"] == "canceled"
    keep_screenshot(browser, tmp_path, "web_page_retry_refused.png")
    assert console_errors(browser, ignore="403") == []  # Chromium logs the refused POST itself


@slow
def test_page_draws_the_waveform_and_pages_and_searches_the_job_list(make_stack, browser, tmp_path):
    """A finished track's waveform is drawn from its decoded audio (the canvas read back: columns of different
    heights, as long as the audio); 25 jobs are shown 20 then 5, as the API pages them; the search box narrows the
    list by tag, id prefix, state and kind."""
    stack = make_stack()
    stack.start_worker(0)
    done_id = stack.submit_music(tags="waveform, tone")
    assert stack.wait_job(done_id, timeout=180)["state"] == "done"
    browser.get(stack.base_url + "/")
    drawn = job_selector(done_id) + " canvas.waveform[data-drawn]"
    canvas = wait_until(lambda: css(browser, drawn), 30, 0.1, "the waveform")[0]
    pixels = browser.execute_script(WAVEFORM_PIXELS, canvas)
    width, height, heights = pixels["width"], pixels["height"], pixels["heights"]
    assert width >= 200 and height >= 40, pixels
    assert 0.02 < sum(heights) / (width * height) < 0.95 and pixels["variance"] > 100, pixels
    assert min(heights) >= 1 and len(set(heights)) >= 4, heights  # every column drawn, shaped by the audio
    # The columns are as tall as the peaks of the track's MP3 (what the page decodes), read here with ffmpeg.
    mp3 = requests.get(f"{stack.base_url}/api/v1/jobs/{done_id}/tracks/0.mp3", timeout=10)
    expected = statistics.median(mp3_column_heights(mp3.content, width, height))
    assert abs(statistics.median(heights) - expected) <= max(2, 0.15 * expected), (heights, expected)
    assert pixels["png_chars"] > 1000  # toDataURL: the drawing can be exported, not a tainted canvas
    assert abs(float(canvas.get_attribute("data-duration")) - 2.0) < 0.3  # the track's own audio, decoded
    keep_screenshot(browser, tmp_path, "web_page_waveform.png")

    stack.stop_worker(0)  # the jobs below stay open in the list
    needles = []
    for i in range(24):
        job_id = stack.submit_music(tags="needle, haystack" if i % 6 == 0 else f"lo-fi, take {i}")
        if i % 6 == 0:
            needles.insert(0, job_id)  # newest first, as listed

    newest = api_ids(stack, limit=PAGE_SIZE)
    wait_until(lambda: listed_ids(browser) == newest, 30, 0.1, "the first page")
    pager = css(browser, "#jobs-pager")[0]
    assert pager.is_displayed() and pager.get_attribute("data-has-more") == "1"
    assert css(browser, "#jobs-page")[0].text == "page 1 · jobs 1–20"
    assert browser.execute_script("return streams.size") <= 4  # connections left for the API calls

    css(browser, "#jobs-next")[0].click()
    older = api_ids(stack, limit=PAGE_SIZE, offset=PAGE_SIZE)
    assert len(older) == 5 and older[-1] == done_id and not set(older) & set(newest)
    wait_until(lambda: listed_ids(browser) == older, 30, 0.1, "the second page")
    assert (pager.get_attribute("data-page"), pager.get_attribute("data-has-more")) == ("2", "0")
    assert css(browser, "#jobs-page")[0].text == "page 2 · jobs 21–25"
    assert not css(browser, "#jobs-next")[0].is_enabled() and css(browser, "#jobs-prev")[0].is_enabled()
    wait_until(lambda: css(browser, drawn), 30, 0.1, "the waveform drawn again on page 2")
    keep_screenshot(browser, tmp_path, "web_page_paged.png")
    css(browser, "#jobs-prev")[0].click()
    wait_until(lambda: listed_ids(browser) == newest, 30, 0.1, "the first page again")

    search_for(browser, "needle")
    wait_until(lambda: listed_ids(browser) == needles, 30, 0.1, "the jobs tagged needle")
    assert not pager.is_displayed()  # they fit on one page
    keep_screenshot(browser, tmp_path, "web_page_search.png")
    for text, expected in ((done_id[:8], [done_id]), ("DONE music", [done_id]), ("haystack queued", needles)):
        search_for(browser, text)
        wait_until(lambda expected=expected: listed_ids(browser) == expected, 30, 0.1, f"the jobs matching {text!r}")
    search_for(browser, "lipsync")
    wait_until(lambda: listed_ids(browser) == [], 30, 0.1, "no job listed")
    empty = css(browser, "#jobs-empty")[0]
    assert empty.is_displayed() and empty.text == "No job matches “lipsync”."
    search_for(browser, "")
    wait_until(lambda: listed_ids(browser) == newest, 30, 0.1, "every job again")
    assert console_errors(browser) == []


# ---- GET /api/v1/jobs's paging and search, which the page uses (no browser) -------------------------------------


def test_the_job_list_pages_and_searches(make_stack):
    stack = make_stack()
    tags = ["lo-fi, piano", "jazz", "Piano Ballad", "jazz, piano", "ambient"]
    ids = [stack.submit_music(tags=t) for t in tags]
    assert stack.client.delete(f"/api/v1/jobs/{ids[3]}").status_code == 200
    stack.wait_job(ids[3], states=("canceled",), timeout=15)
    newest = ids[::-1]
    assert api_ids(stack) == newest
    assert [api_ids(stack, limit=2, offset=o) for o in (0, 2, 4, 5)] == [newest[:2], newest[2:4], newest[4:], []]
    assert api_ids(stack, q="piano") == [ids[3], ids[2], ids[0]]  # a part of the tags, any case
    assert api_ids(stack, q="PIANO canceled") == [ids[3]]  # every word must match
    assert api_ids(stack, q=ids[1][:6]) == [ids[1]]  # the start of an id
    assert api_ids(stack, q=ids[1][2:10]) == []  # not the middle of one
    assert api_ids(stack, q="music instrumental queued") == [ids[4], ids[2], ids[1], ids[0]]  # kind, mode, state
    assert api_ids(stack, q="lipsync") == []
    assert api_ids(stack, q="piano", limit=1, offset=1) == [ids[2]]  # the offset counts matches
    assert api_ids(stack, q="  ") == newest  # no word: no search
    assert all(job["eta_s"] is None for job in stack.client.get("/api/v1/jobs?q=queued").get_json()["jobs"])


@pytest.mark.parametrize(
    "params, field",
    [
        ({"offset": "-1"}, "offset"),
        ({"offset": "1.5"}, "offset"),
        ({"offset": "abc"}, "offset"),
        ({"offset": "10001"}, "offset"),
        ({"offset": ""}, "offset"),
        ({"q": "x" * 101}, "q"),
        ({"limit": "0", "offset": "0"}, "limit"),
    ],
)
def test_a_bad_listing_parameter_is_400_naming_it(make_stack, params, field):
    stack = make_stack()
    reply = stack.client.get("/api/v1/jobs", query_string=params)
    body = reply.get_json()
    assert reply.status_code == 400 and body["field"] == field and body["error"].startswith(f"{field}:"), body


def test_the_listing_parameters_edges_are_accepted_and_documented(make_stack):
    stack = make_stack()
    for params in ({"offset": "10000"}, {"offset": "0"}, {"q": "x" * 100}, {"q": ""}):
        reply = stack.client.get("/api/v1/jobs", query_string=params)
        assert reply.status_code == 200 and reply.get_json() == {"jobs": []}, (params, reply.get_json())
    document = stack.client.get("/api/v1/openapi.json").get_json()
    schemas = {p["name"]: p["schema"] for p in document["paths"]["/api/v1/jobs"]["get"]["parameters"]}
    assert (schemas["offset"]["minimum"], schemas["offset"]["maximum"], schemas["q"]["maxLength"]) == (0, 10_000, 100)


STREAM_COUNTER = """
// Counts the EventSource objects the page makes, per URL, and the most open at once (reconnects reuse one).
window.__streams = {made: {}, most: {}};
const Native = window.EventSource;
window.EventSource = class extends Native {
  constructor(url, options) {
    super(url, options);
    const made = window.__streams.made, most = window.__streams.most;
    (made[url] = made[url] || []).push(this);
    const open = made[url].filter((s) => s.readyState !== Native.CLOSED).length;
    most[url] = Math.max(most[url] || 0, open);
  }
};
"""


def stream_counts(driver, job_id: str) -> tuple[int, int]:
    """(streams made, most open at once) for the job's events URL."""
    return tuple(
        driver.execute_script(
            "const u = arguments[0]; const s = window.__streams;return [(s.made[u] || []).length, s.most[u] || 0];",
            f"/api/v1/jobs/{job_id}/events",
        )
    )


@slow
def test_the_page_follows_a_retried_job_with_one_stream_until_its_new_run_ends(make_stack, browser):
    """Issue 24, item 1: canceled and then retried from the page, a job is followed by one stream for its first
    run and one for the retry, never two at once: the retry's stream does not end at once on the old run's
    `canceled` (the page would reopen one after another), and ends only when the new run is done."""
    stack = make_stack(**REFERENCE_ENGINE)
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": STREAM_COUNTER})
    browser.get(stack.base_url + "/")
    # No worker yet: the first run waits queued until the cancel, so the page follows it however fast this machine
    # would have run it (a quiet machine once finished the song before the page's first look, and no stream opened).
    job_id = stack.submit_music(duration_s=8.0)
    article = wait_until(lambda: css(browser, job_selector(job_id)), 30, 0.1, "the job listed")[0]
    wait_until(lambda: article.get_attribute("data-events") == "live", 30, 0.1, "the page to follow the job")
    assert stream_counts(browser, job_id) == (1, 1)

    assert stack.client.delete(f"/api/v1/jobs/{job_id}").status_code == 200
    wait_page_state(browser, job_id, {"canceled"}, 60)
    wait_until(lambda: article.get_attribute("data-events") == "ended", 30, 0.1, "the first stream to end")
    retry = css(browser, job_selector(job_id) + " .retry")[0]
    wait_until(retry.is_displayed, 15, 0.1, "the Retry button")
    stack.start_worker(0)
    retry.click()
    seen: set[str] = set()
    wait_page_state(browser, job_id, {"done"}, 180, seen=seen)
    assert stack.job(job_id)["state"] == "done"
    assert "running" in seen, seen  # the page saw the new run at work, not only its end
    wait_until(lambda: article.get_attribute("data-events") == "ended", 30, 0.1, "the retry's stream to end")
    assert stream_counts(browser, job_id) == (2, 1)  # one per run, never two at once
    assert int(article.get_attribute("data-event-count")) >= 4  # the new run's stages came over the stream
    assert console_errors(browser) == []
