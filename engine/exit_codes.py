"""Worker exit codes (docs/architecture.md, "Exit codes"); the supervisor's restart policy reads them. Torch-free."""

OK = 0               # reached max_steps
STOPPED = 75         # stopped on request (EX_TEMPFAIL: resume when allowed)
NONFINITE_LOSS = 76  # non-finite loss and the job's policy is to stop
GANG_RESTART = 77    # another host's worker failed: every host restarts from the newest global commit
BAD_INPUT = 78       # invalid job spec or data (EX_CONFIG: never retried)
QUARANTINED = 79     # this host's replica of the state differed from the others': never retried here
REFIT = 80           # out of memory in the first steps: a smaller micro-batch is recorded; start again at once
