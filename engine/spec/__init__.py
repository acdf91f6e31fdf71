"""Job specs: the schema of a job file (schema.py) and its bounded YAML loader (loader.py).

Torch-free: the daemon validates job files with these two modules alone.
"""
