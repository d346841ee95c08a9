"""The ``Idempotency-Key`` header of the creating calls, as the API declares it (ADR 0037;
the keys themselves: :mod:`trainpod.controller.idempotency`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, Request
from fastapi.responses import JSONResponse

from trainpod.controller.idempotency import HEADER, KEY_MAX, KEY_TTL_S
from trainpod.errors import IdempotencyKeyReused

IdemKey = Annotated[
    str | None,
    Header(
        alias=HEADER,
        description=(
            f"Makes a retried call safe (ADR 0037): the same key with the same body answers "
            f"with the job the first call made (201 again, with `Idempotent-Replayed: true`) "
            f"instead of making another; with another body, 422 naming the key and what "
            f"differs. 1 to {KEY_MAX} visible ASCII characters without spaces, quotes or "
            f"backslashes (else 400), e.g. a UUID; bare or as a quoted string. Keys are the "
            f"caller's own and kept {KEY_TTL_S / 3600:g} h after their first call."
        ),
    ),
]
REPLAYED = "Idempotent-Replayed"
_ERROR_BODY = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "message": {"type": "string"}},
    "required": ["error", "message"],
}
SUBMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    201: {
        "description": "The job made, or with an Idempotency-Key already used with this body, "
        "the job that first call made (its state now)",
        "headers": {
            REPLAYED: {
                "description": "`true` when the job was made by an earlier call with this key",
                "schema": {"type": "string", "enum": ["true"]},
            }
        },
    },
    400: {
        "description": "A bad spec, or an Idempotency-Key too long or with characters a key "
        "may not have",
        "content": {"application/json": {"schema": _ERROR_BODY}},
    },
    422: {
        "description": "The Idempotency-Key was first used with another body (the message "
        "names the key and the fields that differ), or a body that is not a job spec",
        "content": {"application/json": {"schema": {}}},
    },
}


async def key_reused(_: Request, exc: Exception) -> JSONResponse:
    """422, as the IETF draft says for a key sent again with another payload."""
    assert isinstance(exc, IdempotencyKeyReused)
    return JSONResponse({"error": type(exc).__name__, "message": str(exc)}, status_code=422)
