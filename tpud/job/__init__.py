"""One job under supervision: its state machine (job.py) and the parts it is made of.

states.py        the states, their groups and the allowed transitions
routing.py       which parts of the job each worker event goes to
report.py        what the workers last reported: step, validation loss, a non-finite loss
health/          why a worker died, when it counts as hung, the restart budget and backoff
current.py       the current worker: its process, channel and output, the kill and hang signals
inputs.py        what a start fetches from GCS: the newest checkpoint, datasets, the model
output.py        the worker's output: relayed, its tail kept for crash reports
gang.py          a job on several hosts: the gang as this host's worker sees it
record.py        job.json: what survives a daemon restart
checkpoints.py   the newest checkpoint, `tpud checkpoint-now` waiters, failing tiers
save_failures.py checkpoint saves that keep failing, per tier
goodput.py       the goodput ledger
"""
