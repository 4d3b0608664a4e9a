"""Errors for people: each says what was wrong, the value seen, and what to do."""


class ConveyorError(Exception):
    """Base class of every error Conveyor raises on purpose."""


class ConfigError(ConveyorError, ValueError):
    """An engine option is invalid or cannot be satisfied on this machine."""


class ModelLoadError(ConveyorError):
    """A model could not be found or loaded (missing file, unknown architecture, ...)."""


class InvalidRequestError(ConveyorError, ValueError):
    """A request (prompt or sampling parameters) is invalid."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The field at fault (a SamplingParams field name), which the API reports as `param`; None when no
        single field is (a bad prompt, a chat template that refused the conversation)."""
