"""Errors a user can fix (a bad flag, path, parameter or input), as opposed to bugs.

Every layer raises `UserError` (or a subclass) for bad input, so the CLI can print one clear line and exit 2,
and the server can answer 4xx, instead of either showing a traceback.
"""


class UserError(ValueError):
    """Bad input from the user; the message says what and, where there is one, names the flag or field."""


class ModelLoadError(UserError):
    """A model path that is missing, not a model, corrupt, or of an unsupported architecture."""
