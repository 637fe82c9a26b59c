"""The error every configuration check raises; messages name the offending flags and values."""


class ConfigError(ValueError):
    """An inconsistent configuration; the message names the offending flags and values."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)
