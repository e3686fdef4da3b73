"""Batch records, validation, sharding and merging (no Airflow imports)."""
