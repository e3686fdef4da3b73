"""Airflow notifiers the pipeline attaches to a batch's end (docs/operator.md#notifications)."""
