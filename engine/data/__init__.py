"""The data pipeline.

Preparing, once, off the accelerator hosts (`tpud prepare`, torch-free):
    prepare.py   the command line                  pipeline.py  reading -> tokenizing -> writing
    options.py   a run's options, validated
    sources.py   input files and their formats     tokenizer.py tokenizer.json, train:N, bytes
    shards.py    .npy token shards, written/mapped manifest.py  manifest.json, written last
    remote.py    gs:// inputs, outputs and the host's dataset cache

Training on it:
    dataset.py   sample index -> window (shuffled, in order, mixed)   order.py  permutations, blends
    loader.py    batches as a pure function of (seed, step, micro-step, rank)
    corpus.py    the built-in demo corpus
"""
