"""One job across many hosts, as the daemon sees it: every host's daemon runs the same job file.

- discovery.py (torch-free): this host's index, the host count and the coordinators' addresses,
  from tpud.yaml's `gang:`, the TPU runtime's environment or the TPU VM's metadata.

What runs with torch (the coordinator's TCPStore, the worker's membership) is in tpud/worker/gang/.
"""
