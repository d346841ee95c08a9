"""The bounds of the numbers a URL carries (ids, offsets, counts), shared by the API and the
dashboard: anything outside them names nothing and is refused (422) before a route runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path as PathParam
from fastapi import Query

ROW_MAX = 2**63 - 1
"""SQLite's largest INTEGER: an id, offset or count beyond it names nothing (and made the
store raise OverflowError, a 500, until the API bounded them: found by the API fuzz; the
dashboard's, once it was fuzzed too)."""
JobId = Annotated[int, PathParam(ge=0, le=ROW_MAX, description="a job's id")]
StepNo = Annotated[int, PathParam(ge=0, le=ROW_MAX, description="a step's number")]
MaybeJob = Annotated[int | None, Query(ge=0, le=ROW_MAX, description="a job's id")]
Count = Annotated[int | None, Query(ge=0, le=ROW_MAX, description="at most this many")]
After = Annotated[
    int | None,
    Query(
        ge=0,
        le=ROW_MAX,
        description="a page: only jobs with a higher id, oldest first; `limit` then keeps the "
        "first of them (without `after`, the newest)",
    ),
]
Rank = Annotated[int, Query(ge=0, le=ROW_MAX, description="a rank of the job")]
Offset = Annotated[int, Query(ge=0, le=ROW_MAX, description="bytes into the log")]
