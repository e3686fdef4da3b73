"""The trust room: what whoever triggers a run or calls an API may make a worker reach or see.

* ``policy.py``: the allow-lists (endpoints, storage prefixes, connections) and the checks
  that refuse a trigger naming anything outside them; imports no Airflow.
* ``deployment.py``: the deployment's policy, read from Airflow's config and connections
  (none set, nothing allowed), and where an inference key comes from.
* ``redact.py``: addresses scrubbed from what tenants and submitters are shown.

docs/trust.md has the rules and the test of each.
"""
