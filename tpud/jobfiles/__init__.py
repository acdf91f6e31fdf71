"""Job files: noticing changes in jobs.d/ (watcher.py), reading and validating them (reading.py),
and doing the reading in a helper process, off the daemon's loop (offloop.py).
"""
