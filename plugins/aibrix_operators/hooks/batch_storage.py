"""Storage for batch files, with S3 credentials from an Airflow connection."""

from __future__ import annotations

from functools import cached_property

from airflow.sdk import BaseHook

from aibrix_operators.storage import Storage, is_s3, storage_for


class BatchStorageHook(BaseHook):
    """Opens local paths and ``s3://`` URIs.

    With ``aws_conn_id`` set, S3 access uses that Airflow connection (keys,
    region, ``endpoint_url`` in its extras); left empty, boto3's own sources
    (environment, instance profile) apply, which is what a driver pod uses.
    """

    conn_name_attr = "aws_conn_id"
    hook_name = "AIBrix batch storage"

    def __init__(self, aws_conn_id: str | None = None) -> None:
        super().__init__()
        self.aws_conn_id = aws_conn_id or None

    def storage_for(self, uri: str) -> Storage:
        if is_s3(uri) and self.aws_conn_id:
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook

            return storage_for(uri, S3Hook(aws_conn_id=self.aws_conn_id).get_conn())
        return storage_for(uri)


class UsesBatchStorage:
    """For operators that read or write batch files: ``self.hook``, built once per task from
    the (rendered) ``aws_conn_id``, the way the providers' operators reach their hooks."""

    aws_conn_id: str | None

    @cached_property
    def hook(self) -> BatchStorageHook:
        return BatchStorageHook(self.aws_conn_id or None)
