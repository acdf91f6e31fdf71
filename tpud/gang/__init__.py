"""One job across many hosts: every host's daemon runs the same job file, and the workers form a gang.

- discovery.py (torch-free): this host's index, the host count and the coordinator's address,
  from tpud.yaml's `gang:`, the TPU runtime's environment or the TPU VM's metadata.
- coordinator.py: a child of host 0's daemon holding torch.distributed's TCPStore, which outlives
  the workers so that their restarts meet in it (the daemon itself stays torch-free).
- member.py (the worker's side): join a generation, wait for every host, watch the others, and
  leave with exit 77 when any of them fails, so that the whole gang restarts together.
"""
