"""A DAG run with ``dry_run``: validate and estimate, then end with nothing split or sent.

The answer is the Batch API's dry run's (``POST /v1/batches/estimate``, batch/dry_run.py): the
work validation counted (its input tokens with the model's tokenizer where the deployment names one,
batch/prompt_tokens.py), the estimate at the deployment's measured rate and its cost. It goes to
``<output_uri>/estimate.json``, the validate task's XCom ``dry_run`` and its log; the task then
ends *skipped*, and so does every step after it (they wait on its success), so the run succeeds
with nothing sent.
"""

from __future__ import annotations

import json
import logging
from typing import Any, NoReturn

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowSkipException

from aibrix_operators.batch.admission import Estimate
from aibrix_operators.batch.dry_run import dry_run_answer
from aibrix_operators.batch.job import ValidatedBatch
from aibrix_operators.batch.prompt_tokens import PromptCounter
from aibrix_operators.batch.validation import ValidationReport
from aibrix_operators.settings.prices import load_prices
from aibrix_operators.settings.tokenizers import TokenizerSettingError, load_tokenizer_dirs
from aibrix_operators.storage import Storage, join_uri

log = logging.getLogger(__name__)

ESTIMATE_FILE = "estimate.json"
XCOM_KEY = "dry_run"


def prompt_counter(adapters: dict[str, str]) -> PromptCounter:
    """The deployment's tokenizers (``[aibrix_batch] tokenizers``); a bad setting counts nothing and
    the answer says why."""
    try:
        return PromptCounter(load_tokenizer_dirs(), adapters)
    except TokenizerSettingError as exc:
        return PromptCounter({}, problem=str(exc))


def end_dry_run(context: Context, report: ValidationReport, batch: ValidatedBatch, endpoint: str,
                storage: Storage, tokens_basis: str) -> NoReturn:
    """Publish the dry run's answer for a valid batch, then skip the rest of the run."""
    work = report.work()
    judged = Estimate(**batch.estimate) if batch.estimate is not None else None
    answer: dict[str, Any] = dry_run_answer(batch.model, endpoint, batch.completion_window, work, judged,
                                            load_prices(), tokens_basis)  # fmt: skip
    uri = join_uri(batch.output_uri, ESTIMATE_FILE)
    storage.write_bytes(uri, json.dumps(answer, indent=2).encode() + b"\n")
    context["ti"].xcom_push(key=XCOM_KEY, value=answer)
    log.info("dry run: %s", json.dumps(answer))
    estimate = answer["estimate"]
    when = (f"done in about {estimate['seconds']:.0f} s, {'within' if estimate['feasible'] else 'past'} "
            f"its {batch.completion_window} window" if estimate.get("seconds") is not None
            else estimate["basis"])  # fmt: skip
    raise AirflowSkipException(f"dry run: {work.requests} requests valid, {when}; nothing split or sent; "
                               f"the estimate is in {uri}")  # fmt: skip
