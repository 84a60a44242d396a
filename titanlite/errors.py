"""Errors a user can fix by changing their input; the entry points turn them into exit status 2."""


class ConfigError(ValueError):
    """A bad config value, an impossible layout, or unusable input data; the message names the knob."""
