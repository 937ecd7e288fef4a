"""The refusals the service answers: a user's mistake (HTTP 400, Tinker's ``user`` category) names the field and the fix."""

from __future__ import annotations


class UserError(ValueError):
    """A request the service refuses because of what it asks (an unknown model, a Datum that does not
    fit, a loss input of the wrong shape...); the message names the field, the value and the fix."""


class QueueFull(RuntimeError):
    """The server holds as many requests as ``--max-queue`` allows; the SDK retries (HTTP 429)."""
