"""Errors the training core raises on bad input. The worker maps ConfigError to exit 78."""


class GangChanged(Exception):
    """The gang this process trains in changed (a host lost or back): the loop leaves at its boundary
    and the worker forms the next gang in place, keeping the model and optimizer (tpud/gang/)."""


class ConfigError(ValueError):
    """The job spec asks for something this machine or backend cannot do."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
