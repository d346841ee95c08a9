"""The one exception hierarchy of trainpod.

Every error a user can meet derives from :class:`TrainpodError`. A message says what was
received and what to do about it. ``Retryable`` errors may succeed if tried again later
(a controller that is restarting); ``Fatal`` ones will not (bad input).
"""

from __future__ import annotations


class TrainpodError(Exception):
    """Root of all trainpod errors."""


class Retryable(TrainpodError):
    """The operation may succeed if tried again later."""


class Fatal(TrainpodError):
    """The operation will not succeed without a change by the user."""


class SpecError(Fatal):
    """A cluster or job spec is invalid. The message names the file, key path and fix."""


class NotFound(Fatal):
    """A named cluster, node or job does not exist."""


class Conflict(Fatal):
    """The request conflicts with the current state (a name in use, a job already ended)."""


class Forbidden(Fatal):
    """The caller may not do this (another user's job, an admin's operation)."""


class CertificateRejected(Fatal):
    """The controller's TLS certificate is not vouched for by the CA the client was given."""


class ControllerUnavailable(Retryable):
    """The controller could not be reached."""


class StoreUnavailable(Retryable):
    """The controller's database cannot be written now (locked by another process, its disk
    full): nothing was applied; the API answers 503 and the call may be retried."""


class IdempotencyKeyInvalid(SpecError):
    """An ``Idempotency-Key`` header that is too long or has characters a key may not have
    (the API answers 400, naming the limit)."""


class IdempotencyKeyReused(Conflict):
    """An ``Idempotency-Key`` sent again with another request than the first time (the API
    answers 422, as the IETF draft says; the message names the key and what differs)."""
