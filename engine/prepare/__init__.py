"""`tpud prepare`: a dataset made once, off the accelerator hosts, torch-free.

    command.py   the command line                  pipeline.py  reading -> tokenizing -> writing
    options.py   a run's options, validated        packing.py   chat conversations packed into windows
    sources.py   input files and their formats     tokenizer.py tokenizer.json, train:N, bytes
    chat.py      chat templates and the spans trained on

It writes the format engine/data reads (manifest.py, shards.py, order.py's validation split,
remote.py's gs:// paths), and shares nothing else with the training reader.
"""
