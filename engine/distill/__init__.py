"""Knowledge distillation from a frozen teacher (`distill:` in the job file).

    source.py   where the teacher comes from and what its model is (torch-free: the daemon validates)
    teacher.py  the teacher's model, weights, identity and tokenizer check

The loss itself is engine.losses.distill.
"""
