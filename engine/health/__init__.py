"""What the worker does about bad steps (docs/architecture.md, "Healing").

    guard.py     no bad step (non-finite, or a spike) is trained past or saved
    spikes.py    the loss-spike detector: a robust running statistic
    healing.py   a bad step rolled back in place: restore, replay, skip
    ledger.py    the skip ledger: every range of data left out, and why (torch-free)
    replicas.py  the data-parallel replicas' fingerprints: silent data corruption
    faults.py    injected faults, for tests and drills
"""
