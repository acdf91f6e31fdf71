"""Hugging Face interop: a Llama model directory in (`model.init_from`), one out (`tpud export`).

config.py reads and writes config.json (torch-free: the spec loader uses it); weights.py maps
tensor names and loads safetensors into the engine's Transformer; export.py writes a committed
checkpoint as a Hugging Face model directory.
"""
