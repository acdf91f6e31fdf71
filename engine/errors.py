"""Errors the training core raises on bad input (the worker maps ConfigError to exit 78), and the
exception that ends the training loop with an exit code."""


class WorkerExit(Exception):
    """The worker ends with this exit code (engine/exit_codes.py): raised where the decision is made
    (a stop asked, a bad step that cannot be healed, a replica or straggler named), caught once by
    Trainer.run."""

    def __init__(self, code: int):
        super().__init__(f"exit {code}")
        self.code = code


class GangChanged(Exception):
    """The gang this process trains in changed (a host lost or back): the loop leaves at its boundary
    and the worker forms the next gang in place, keeping the model and optimizer (tpud/gang/)."""


class ConfigError(ValueError):
    """The job spec asks for something this machine or backend cannot do."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
