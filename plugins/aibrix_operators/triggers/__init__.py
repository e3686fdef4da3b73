"""Deferrable waits (run in the triggerer, no worker slot held)."""
