"""The worker's checkpoint tiers: the local disk's and host shared memory's.

checkpointer.py  the Checkpointer the loop uses: save, restore, when a save is due
state.py         the training state as a tree of state dicts: gathered, templated, applied
schedule.py      when a disk or memory save is due
policy.py        the auto interval: Young's, from a save's cost and the disruption rate (torch-free)
writer.py        the DCP write, manifest and rename on the writer thread; the global commit
retention.py     what the local tier keeps: retention, room for the next save, leftovers
promotion.py     the memory tier in front of the disk: disk writes from its copy, promotion
restore.py       the newest valid state of both tiers; the hosts' agreement
memory.py        the memory tier itself (two slots in host shared memory)
manifest.py      manifest.json: the commit protocol's last word, sizes and CRC32C (torch-free)
hosts.py         a job on several hosts: the global commit and the restore agreement
errors.py        a failure's cause in one line
"""
