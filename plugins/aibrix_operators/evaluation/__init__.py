"""Nightly model evaluation, no Airflow: suites, scorers, statistics, history and the report."""
