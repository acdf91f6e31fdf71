"""How the supervisor judges a job's worker, and what a failure costs it.

crashes.py   why a worker died (exit status and output: OOM, exception, signal, ...)
hang.py      when a silent worker counts as hung
restarts.py  the restart budget and the backoff between restarts
"""
