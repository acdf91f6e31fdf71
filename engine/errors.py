"""Errors the training core raises on bad input. The worker maps ConfigError to exit 78."""


class ConfigError(ValueError):
    """The job spec asks for something this machine or backend cannot do."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
