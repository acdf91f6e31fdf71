"""One job under supervision: its state machine (job.py) and the parts it is made of.

states.py   the states, their groups and the allowed transitions
restarts.py the restart budget and the backoff between restarts
hang.py     when a silent worker counts as hung
standby.py  the warm spare workers
record.py   job.json: what survives a daemon restart
checkpoints.py the newest checkpoint, `tpud checkpoint-now` waiters, failing tiers
goodput.py  the goodput ledger; crashes.py: why a worker died; save_failures.py: failing tiers
"""
