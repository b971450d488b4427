"""The run viewer in a real browser: Debian's chromium, headless, driven by selenium through chromium-driver
(nothing downloads a browser; .ci/run installs both). ``flowrt ui`` runs as its own process over a checkpoint
database holding a run of stories260K that waits for an answer: the run list loads, the run opens, it is answered
from the page, the page shows it finish, and a fork of it at its last step runs to the end too. A screenshot of
each page is kept in out/ui-screenshots/ (ignored by git) and beside the test's tmp dir."""

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from support import ROOT, STORIES

pytestmark = pytest.mark.slow   # starts a server process and a browser

WORKFLOW = textwrap.dedent('''
    import flowrt as fr

    wf = fr.Workflow("story-review")

    @wf.step
    async def draft(start: str, llm: fr.Model) -> str:
        return await llm.thread(start).gen(max_tokens=12, temperature=0)

    @wf.step
    async def variants(draft: str, llm: fr.Model) -> list[str]:
        t = llm.thread("Once upon a time" + draft)
        return await fr.gather(*(b.gen(max_tokens=8, temperature=0.8, seed=i) for i, b in enumerate(t.fork(2))))

    @wf.step
    async def review(draft: str, variants: list[str]) -> str:
        return await fr.interrupt({"question": "Which variant goes on?", "variants": variants})

    @wf.step
    async def ending(review: str, variants: list[str], llm: fr.Model) -> str:
        return await llm.thread(variants[int(review)]).gen(max_tokens=8, temperature=0)
''')

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)


def _browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them: "
                    "apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=Service(DRIVER))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _waiting_run(tmp_path: Path) -> str:
    import flowrt as fr
    from flowrt.graph.loader import load_workflow

    f = tmp_path / "story_review.py"
    f.write_text(WORKFLOW)
    wf = load_workflow(str(f), "story-review")

    async def go():
        with fr.Runtime(model=str(STORIES), checkpoint=str(tmp_path / "runs.db"), dtype="float32", seed=0) as rt:
            return await rt.run(wf, start="Lily")

    result = asyncio.run(go())
    assert result.status == "interrupted"
    return result.run_id


@pytest.fixture
def ui(tmp_path):
    """``flowrt ui`` over a database with one run waiting for an answer: (base URL, run id)."""
    run_id = _waiting_run(tmp_path)
    port = _free_port()
    log = open(tmp_path / "ui.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "flowrt.cli", "ui", "--checkpoint", str(tmp_path / "runs.db"),
                          "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert p.poll() is None, (tmp_path / "ui.log").read_text()
            try:
                if httpx.get(url + "/ui").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "flowrt ui did not start"
            time.sleep(0.2)
        yield url, run_id
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


def test_answer_a_waiting_run_in_the_browser_and_see_it_finish(ui, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    url, run_id = ui
    shots = [ROOT / "out" / "ui-screenshots", tmp_path / "screenshots"]
    for d in shots:
        d.mkdir(parents=True, exist_ok=True)

    def shot(name: str) -> None:
        driver.execute_script("window.scrollTo({top: 0, behavior: 'instant'})")
        for d in shots:
            assert driver.save_screenshot(str(d / name))

    driver = _browser()
    try:
        wait = WebDriverWait(driver, 120)
        # the run list
        driver.get(url + "/ui")
        row = wait.until(EC.presence_of_element_located((By.ID, f"run-{run_id}")))
        assert row.get_attribute("data-status") == "interrupted"
        assert "story-review" in row.text and "waiting" in row.text
        shot("1-run-list.png")
        # the run, waiting for an answer: its graph, steps and fork tree
        row.click()
        wait.until(EC.url_contains(f"/ui/runs/{run_id}"))
        box = wait.until(EC.visibility_of_element_located((By.ID, "answer-input")))
        assert "Which variant goes on?" in driver.find_element(By.ID, "interrupts").text
        state = {n.get_attribute("data-step"): n.get_attribute("data-state")
                 for n in driver.find_elements(By.CSS_SELECTOR, "#graph .node.step")}
        assert state == {"draft": "done", "variants": "done", "review": "waiting", "ending": "pending"}
        assert "shares" in driver.find_element(By.ID, "forks").text   # the fork of `variants`
        driver.find_element(By.CSS_SELECTOR, '#graph .node[data-step="variants"]').click()
        wait.until(lambda d: "LLM call" in d.find_element(By.ID, "step-variants").text)
        assert "cached" in driver.find_element(By.ID, "step-variants").text
        shot("2-run-waiting.png")
        # answered from the page: the run goes on here and the page follows it to the end
        box.send_keys("1")
        driver.find_element(By.ID, "answer-submit").click()
        wait.until(lambda d: d.find_element(By.ID, "run-status").get_attribute("data-status") == "done")
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, '#graph .node[data-step="ending"]')
                   .get_attribute("data-state") == "done")
        assert not driver.find_elements(By.ID, "answer-input")
        driver.find_element(By.CSS_SELECTOR, '#graph .node[data-step="ending"]').click()
        wait.until(lambda d: "result" in d.find_element(By.ID, "step-ending").text)
        shot("3-run-done.png")
        # time travel: fork the finished run at `ending` (same inputs), and the page opens the new run
        fork = next(b for b in driver.find_elements(By.CSS_SELECTOR, "#history button.fork")
                    if b.text == "fork at ending")
        driver.execute_script("arguments[0].scrollIntoView()", fork)
        fork.click()
        wait.until(EC.alert_is_present()).accept()
        wait.until(lambda d: f"/ui/runs/{run_id}" not in d.current_url)
        forked = driver.current_url.rsplit("/", 1)[1]
        wait.until(lambda d: d.find_element(By.ID, "run-status").get_attribute("data-status") == "done")
        assert f"forked from {run_id} at ending" in driver.find_element(By.ID, "run-meta").text
        shot("4-forked-run.png")
    finally:
        driver.quit()
    detail = httpx.get(f"{url}/ui/api/runs/{run_id}").json()
    assert detail["run"]["status"] == "done"
    assert {s["step"]: s["state"] for s in detail["steps"]} == {
        "draft": "done", "variants": "done", "review": "done", "ending": "done"}
    assert next(s for s in detail["steps"] if s["step"] == "review")["result"] == 1
    again = httpx.get(f"{url}/ui/api/runs/{forked}").json()
    assert again["run"]["forked_from"]["run_id"] == run_id
    kept = {s["step"]: s.get("result") for s in again["steps"]}
    first = {s["step"]: s.get("result") for s in detail["steps"]}
    assert kept["review"] == 1 and kept["variants"] == first["variants"]   # kept, not run again
