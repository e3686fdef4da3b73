"""The batch_inference trigger form, used the way a person uses it: headless Chromium (Debian's
``chromium`` + ``chromium-driver``) driven by Selenium logs into the Airflow UI of a running
deployment (api-server + scheduler + dag-processor + triggerer), fills the form, triggers, and
watches the run's state badge turn to Success; a real vLLM CPU server answers the requests.

Screenshots stay in the test's tmp_path and are copied to .work/artifacts/ui-trigger/.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from aibrix_operators.local_airflow import AirflowDeployment, start_airflow
from aibrix_operators.localenv import WORK_DIR
from tests.integration.conftest import SERVED_NAME, chat_requests, read_jsonl, write_jsonl

pytestmark = pytest.mark.e2e

ARTIFACTS = WORK_DIR / "artifacts" / "ui-trigger"
UI_WAIT_S = 60  # page loads and form rendering on a busy 2-core machine
RUN_WAIT_S = 300  # the run itself: four tasks scheduled one after another, plus vLLM


@pytest.fixture
def airflow(airflow_session_env, tmp_path_factory) -> Iterator[AirflowDeployment]:
    home = tmp_path_factory.mktemp("airflow-ui")
    deployment = start_airflow({**airflow_session_env, "AIRFLOW_HOME": str(home)}, home)
    try:
        yield deployment
    finally:
        deployment.stop()


def _wait_for_dag(airflow: AirflowDeployment, dag_id: str, timeout_s: float = 120) -> None:
    """The dag-processor parses the DAG folder shortly after start; the UI 404s until then."""
    token = airflow.token()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            airflow.api("GET", f"/api/v2/dags/{dag_id}", token=token)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _value(driver: WebDriver, param: str) -> str:
    return driver.find_element(By.ID, f"element_{param}").get_attribute("value") or ""


def _fill(driver: WebDriver, param: str, value: str) -> None:
    """Replace a form field's value by typing it, one key after the other took effect.

    Airflow 3.3's form keeps every field in sync with its JSON view; keys sent faster than a
    person types lose one now and then (seen: "input.jsonl" became "iput.jsonl", with React's
    "maximum update depth" error in the console), so each key waits for the field to show it.
    """
    field = WebDriverWait(driver, UI_WAIT_S).until(EC.element_to_be_clickable((By.ID, f"element_{param}")))
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE)
    typing = WebDriverWait(driver, 10, ignored_exceptions=(StaleElementReferenceException,))
    typing.until(lambda d: _value(d, param) == "")
    for i, key in enumerate(value, start=1):
        driver.find_element(By.ID, f"element_{param}").send_keys(key)
        typing.until(lambda d, n=i: _value(d, param) == value[:n])


def _run_state(driver: WebDriver) -> str | None:
    """The run page's state badge, once it shows a final state (it re-renders while the page
    refreshes: callers' waits ignore a stale element)."""
    badge = driver.find_element(By.CSS_SELECTOR, "[data-testid=header-card] [data-testid=state-badge]")
    state = badge.text.strip().lower()
    return state if state in ("success", "failed") else None


def _keep(shots: list[Path]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for stale in ARTIFACTS.glob("*.png"):  # only this run's shots: no old failure beside a pass
        stale.unlink()
    for shot in shots:
        shutil.copy2(shot, ARTIFACTS / shot.name)


def test_trigger_form_runs_a_batch(airflow, vllm_chat, browser, tmp_path):
    requests = chat_requests(3)
    input_path = write_jsonl(tmp_path / "input.jsonl", requests)
    out = tmp_path / "out"
    run_id = f"ui_trigger_{secrets.token_hex(4)}"
    _wait_for_dag(airflow, "batch_inference")
    wait = WebDriverWait(browser, UI_WAIT_S, ignored_exceptions=(StaleElementReferenceException,))
    shots: list[Path] = []
    try:
        # Log in through the SimpleAuthManager's form with the generated admin password.
        browser.get(airflow.api_url + "/")
        wait.until(EC.element_to_be_clickable((By.NAME, "username"))).send_keys("admin")
        browser.find_element(By.NAME, "password").send_keys(airflow.admin_password())
        wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "button[type=submit]"))).click()
        wait.until(lambda d: "/auth/login" not in d.current_url)

        browser.get(airflow.api_url + "/dags/batch_inference")
        wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "button[aria-label='Trigger Dag']"))).click()
        # The form is ready once it shows the DAG's default input; typing earlier would be undone.
        wait.until(lambda d: _value(d, "input_uri").endswith("chat_batch.jsonl"))
        fields = {"input_uri": str(input_path), "output_uri": str(out),
                  "endpoint": vllm_chat.base_url, "model": SERVED_NAME}
        for param, value in fields.items():
            _fill(browser, param, value)
        assert {param: _value(browser, param) for param in fields} == fields
        # kubernetes_namespace / kubernetes_service_account stay empty ("the deployment's"): the
        # form must accept that, which it does only because their type admits null.
        submit = browser.find_element(By.CSS_SELECTOR, "[data-testid=trigger-dag-submit]")
        wait.until(lambda _: submit.is_enabled())
        # The screenshot shows the fields just filled, not the end of the long form.
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})",
                               browser.find_element(By.ID, "element_output_uri"))
        shots.append(tmp_path / "ui-trigger-form.png")
        browser.save_screenshot(str(shots[-1]))

        # A known run id (Advanced Options) so the run can be found in the UI and the REST API.
        wait.until(EC.element_to_be_clickable(
            (By.CSS_SELECTOR, "button[id$=':trigger:advancedOptions']"))).click()
        wait.until(EC.element_to_be_clickable((By.NAME, "dagRunId"))).send_keys(run_id)
        wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "[data-testid=trigger-dag-submit]"))).click()

        # The UI opens the new run's page and refreshes it while the run is active.
        wait.until(EC.url_contains(f"/dags/batch_inference/runs/{run_id}"))
        state = WebDriverWait(browser, RUN_WAIT_S, poll_frequency=1,
                              ignored_exceptions=(StaleElementReferenceException,)).until(_run_state)
        assert state == "success", f"the UI shows run {run_id} {state}"
        # Reloaded, the page shows every task's final state too (its table refreshes on a timer).
        browser.refresh()
        state = wait.until(_run_state)
        shots.append(tmp_path / "ui-trigger-run.png")
        browser.save_screenshot(str(shots[-1]))
        assert state == "success", f"the UI shows run {run_id} {state}"
    finally:
        if not shots or shots[-1].name != "ui-trigger-run.png":
            shots.append(tmp_path / "ui-trigger-failure.png")
            browser.save_screenshot(str(shots[-1]))
        _keep(shots)

    # The same run through the REST API: the form's values reached the run's conf, and the
    # batch was answered line for line.
    run = airflow.api("GET", f"/api/v2/dags/batch_inference/dagRuns/{run_id}")
    assert run["state"] == "success" and run["run_type"] == "manual"
    assert run["conf"]["input_uri"] == str(input_path)
    assert run["conf"]["endpoint"] == vllm_chat.base_url
    assert run["conf"]["kubernetes_namespace"] in ("", None)
    output = read_jsonl((out / "output.jsonl").read_text())
    assert [r["custom_id"] for r in output] == [r["custom_id"] for r in requests]
    assert all(r["response"]["status_code"] == 200 for r in output)
    batch = json.loads((out / "batch.json").read_text())
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
