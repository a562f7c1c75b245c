"""Errors the plugin raises for a setting that does not fit the model."""


class ConfigurationError(ValueError):
    """A setting that does not fit the model (e.g. an access profile of other tables).

    It is no fault of the run: a restart would fail the same way. ``python -m torchrec_het.launch``
    ends the job on it at once, with its message as the last line, instead of letting torchrun
    restart the workers.
    """


class ProfileNotFoundError(ConfigurationError, FileNotFoundError):
    """An access profile path that names no file; the message says how to make one."""


__all__ = ["ConfigurationError", "ProfileNotFoundError"]
