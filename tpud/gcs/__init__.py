"""The daemon's checkpoint tiers: GCS (tier.py), the uploader that fills it after each local
commit (uploader.py), and a job's tiers together (tiers.py). The worker writes the local tier
itself (engine/checkpoint/).
"""
