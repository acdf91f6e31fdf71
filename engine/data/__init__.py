"""The training reader of prepared datasets, and the format it shares with `tpud prepare`
(engine/prepare/, which writes it).

The format:
    manifest.py  manifest.json, written last         shards.py  .npy token shards, written/mapped
    order.py     permutations, blends, the validation split     remote.py  gs:// datasets and the host's cache

Training on it:
    dataset.py   sample index -> window (shuffled, in order, mixed)
    loader.py    batches as a pure function of (seed, step, micro-step, rank)
    batch.py     a micro-batch's tensors      prefetch.py  the next batches, made on a thread
    skips.py     ranges of samples left out   corpus.py    the built-in demo corpus
"""
