"""What every part of the configuration shares: the one-line ``ConfigError`` and the strict model bases.

Every model forbids unknown fields so a typo (``micro_bach``) is an error instead of a silently ignored
setting.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A topology the user got wrong; ``str()`` is one line naming the field and the problem."""

    def __init__(self, message: str) -> None:
        # One line, whatever a library's message looked like: CLIs print it as-is on stderr.
        super().__init__(" ".join(str(message).split()))


class StrictModel(BaseModel):
    """A frozen model that refuses unknown fields; field docstrings are its documentation."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class UserModel(StrictModel):
    """A model of what a user types."""

    # What a user types gets strict types: `steps: true` or `pipeline_port: "5555"` is a mistake,
    # not something to coerce to 1 or 5555.  (ints are still accepted where floats are expected.)
    model_config = ConfigDict(strict=True)
