"""Hooks that tests and probe scripts use to watch a training run."""

from engine.hooks import Hooks


class StepLosses(Hooks):
    """Collects each step's loss, in step order."""

    def __init__(self):
        self.losses = []

    def emit(self, event, **fields):
        if event == "step":
            self.losses.append(fields["loss"])
