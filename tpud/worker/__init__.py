"""The training worker: its entry point (entry.py, `python -m tpud.worker`), the process as
the daemon sees it (process.py) and the channel between the two (channel.py).

Only entry.py's main() imports torch, after its arguments are checked.
"""
