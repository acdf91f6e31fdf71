"""Prometheus: the series (series.py, one table of every one) and the one-thread /metrics
listener that serves their snapshot (listener.py)."""
