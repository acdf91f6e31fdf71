"""The gang in torch's processes.

- coordinator.py: a child of the daemon holding torch.distributed's TCPStore, which outlives
  the workers so that their restarts meet in it (the daemon only starts it: it stays torch-free).
- member.py (the worker's side): join a generation, watch the others, and leave or regroup in
  place when one fails; seating.py: take a seat and wait for the hosts (or go on without lost
  ones, formation.py's rule), then form the gang; stores.py: which coordinator the workers meet in.
"""
