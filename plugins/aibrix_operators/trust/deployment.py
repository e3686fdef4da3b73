"""Airflow side of the trust boundaries: the allow-list from Airflow config, keys from connections.

The allow-list is the ``[aibrix_batch]`` section of the Airflow config (so a
deployment sets it in airflow.cfg, or as ``AIRFLOW__AIBRIX_BATCH__ALLOWED_ENDPOINTS``
and friends in the workers' environment); DAG params cannot change it. An unset key
allows nothing: a deployment that sets none refuses every trigger, naming the keys
(fail closed; the package knows no folder of its own to allow). Local development
(``make run``, the tests) sets the local-development list, loopback endpoints and
the checkout's examples/ and .work/, through ``localenv.airflow_env``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aibrix_operators import config_sections
from aibrix_operators.trust.policy import (
    TrustPolicy,
    TrustViolation,
    connection_url,
    endpoint_form_problem,
    origin,
    parse_list,
    under_base,
)

SECTION = config_sections.BATCH
KEYS = ("allowed_endpoints", "allowed_storage", "allowed_aws_conn_ids", "allowed_inference_conn_ids")
# The endpoint used when a trigger names neither an endpoint nor an inference connection.
DEFAULT_ENDPOINT = "http://127.0.0.1:8000"


def load_policy() -> TrustPolicy:
    """The deployment's allow-list, read fresh from the worker's Airflow config."""
    from airflow.sdk import conf

    values = {key: parse_list(conf.get(SECTION, key, fallback=None)) for key in KEYS}
    if all(v is None for v in values.values()):
        return TrustPolicy(endpoints=(), storage=(), aws_conn_ids=(), inference_conn_ids=(),
                           source=f"the deployment (it sets none of [{SECTION}] {', '.join(KEYS)}: "
                                  "nothing is allowed until it does)")
    return TrustPolicy(
        endpoints=values["allowed_endpoints"] or (),
        storage=values["allowed_storage"] or (),
        aws_conn_ids=values["allowed_aws_conn_ids"] or (),
        inference_conn_ids=values["allowed_inference_conn_ids"] or (),
        source=f"the [{SECTION}] section of the Airflow config",
    )


@dataclass(frozen=True)
class InferenceTarget:
    """Where a shard's requests go, and the key for that place only."""

    endpoint: str
    api_key: str | None = field(default=None, repr=False)
    api_key_origin: str | None = None


def resolve_inference(
    policy: TrustPolicy, endpoint: str | None, inference_conn_id: str | None
) -> InferenceTarget:
    """Check the trigger's ``endpoint``/``inference_conn_id`` and return the target.

    With a connection, its host is the endpoint and its password the key (bound
    to that base URL: origin and path); an ``endpoint`` param may then only name
    that base URL or a path below it.
    Without one, the free-form endpoint must be on the allow-list and gets no key.
    """
    if not inference_conn_id:
        target = endpoint or DEFAULT_ENDPOINT
        policy.check_endpoint(target)
        return InferenceTarget(target)
    policy.check_inference_conn(inference_conn_id)
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(inference_conn_id)
    url = connection_url(conn.host, conn.schema, conn.port)
    problem = endpoint_form_problem(endpoint) if endpoint else None
    if problem or (endpoint and not under_base(endpoint, url)):
        raise TrustViolation(
            "inference_conn_id",
            f"endpoint {endpoint!r} is not the base URL of inference connection {inference_conn_id!r} "
            f"({origin(url)}) or a path below it{f' ({problem})' if problem else ''}; "
            "leave endpoint empty to use the connection's URL",
        )
    return InferenceTarget(endpoint or url, conn.password or None, url)
