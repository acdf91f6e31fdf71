"""The chaos campaign (bench/chaos.py): a seeded schedule of faults (schedule.py) struck at a
cluster of daemons on loopback (cluster.py, faults.py) while invariants are checked (invariants.py),
one campaign run from start to end (campaign.py), and the minimiser of a failing schedule
(minimise.py)."""
