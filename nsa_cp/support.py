"""One verdict type for "can this path serve this call?" (QuACK's ``Support.yes()`` / ``Support.no(reason)``).

Every place that decides whether a backend, engine or kernel applies returns a ``Support``: truthy when
it does, falsy with a sentence saying why not. Callers that must insist call ``verdict.require(name)``,
which raises the ValueError the public functions document; callers that may fall back read ``reason``
for their log line. One type carries both answers, so the yes or no and the sentence saying why cannot
drift apart.
"""

from __future__ import annotations

__all__ = ["Support"]


class Support:
    """A verdict: ``bool(verdict)`` says yes or no, ``verdict.reason`` says why not ("" for yes)."""

    __slots__ = ("ok", "reason")

    def __init__(self, ok: bool, reason: str = ""):
        self.ok = ok
        self.reason = reason

    @classmethod
    def yes(cls) -> "Support":
        return _YES

    @classmethod
    def no(cls, reason: str) -> "Support":
        if not reason:
            raise ValueError("reason: a 'no' verdict must say why, got an empty string")
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.ok

    def require(self, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` (the argument at fault) when the verdict is no."""
        if not self.ok:
            raise ValueError(f"{name}: {self.reason}")

    def __repr__(self) -> str:
        return "Support.yes()" if self.ok else f"Support.no({self.reason!r})"


_YES = Support(True)
