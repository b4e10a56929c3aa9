"""Receivers: what a relay applies payloads to, transactionally, as their bytes arrive."""
