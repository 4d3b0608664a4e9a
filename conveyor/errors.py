"""Errors for people: each says what was wrong, the value seen, and what to do."""


class ConveyorError(Exception):
    """Base class of every error Conveyor raises on purpose."""


class ConfigError(ConveyorError, ValueError):
    """An engine option is invalid or cannot be satisfied on this machine."""


class ModelLoadError(ConveyorError):
    """A model could not be found or loaded (missing file, unknown architecture, ...)."""


class InvalidRequestError(ConveyorError, ValueError):
    """A request (prompt or sampling parameters) is invalid."""
