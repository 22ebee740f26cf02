"""The error types every layer raises, defined below them all (the transports and the rank agreement both
raise :class:`LayoutMismatchError`, so it lives under both)."""

__all__ = ["LayoutMismatchError"]


class LayoutMismatchError(ValueError):
    """The ranks of a group called a collective with different layouts (or some rejected their input)."""
