"""The daemon's child processes as the daemon sees them (torch-free): the primitives of a child
(process.py: its own session, death with its parent, its exit status) and when one that died is
started again (respawn.py). The children are the worker and fork server (tpud/worker/), the gang's
coordinator (tpud/worker/gang/) and the job-file reader (tpud/jobfiles/offloop.py).
"""
