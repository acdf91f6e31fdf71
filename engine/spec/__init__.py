"""Job specs: the schema of a job file (schema.py), its bounded YAML loader (loader.py), and its
fingerprint (fingerprint.py), what a gang's hosts and a multi-host job's resume compare.

Torch-free: the daemon validates job files with these modules alone.
"""
