"""The batch object's fields beyond OpenAI's (the SDK keeps them in ``batch.model_extra``): named
once, for the API that sets them and the client that reads them. ``metadata`` never carries
them: it stays exactly what the client sent."""

# While in progress: "on track: ..." / "at risk: ..." (batch/window_outlook.py); null otherwise.
STATUS_LINE = "aibrix_status"
# Of request_counts.failed, the requests the cancel or the window's end left unanswered.
UNANSWERED = "aibrix_unanswered"
# While in progress: a file of every finished shard's answers, its content growing as shards
# finish (docs/batch-api.md#partial-results); null before the first shard ends and at the end.
PARTIAL_OUTPUT_FILE_ID = "aibrix_partial_output_file_id"
# While in progress: {"total": shards, "done": shards finished}.
SHARDS = "aibrix_shards"
# Until it ends: when the batch will be done and what that rests on (batch/admission.py): the estimate
# it was admitted with, then, once answers come, its tokens left at the endpoint's measured rate (its
# own rate so far where no rate is measured; batch_api/status.py). Null when nothing says.
ESTIMATE = "aibrix_estimate"
# On a deployment that sets prices ([aibrix_batch] prices): what the batch cost (batch/cost.py), from its
# usage so far while it runs, batch.json's at the end.
COST = "aibrix_cost"
# Once it ended, for a batch that asked for output_expires_after: when its output and error files
# expire (batch.json's, written by merge); the files API shows it as their expires_at too.
OUTPUT_EXPIRES_AT = "aibrix_output_expires_at"
