"""``POST /v1/agent/heartbeat`` on a fast path: the call every agent makes once a second.

A thousand agents send ~1,200 beats a second. Through FastAPI each paid for route matching
against every route, the dependency and validation machinery, a Python ``json.loads`` and a
second validation of the decoded body, and a hop through anyio's worker-thread pool: more
than the controller's own work on the beat. :class:`HeartbeatRoute` is a plain ASGI
middleware, inside :class:`~trainpod.api.app.BearerAuth` (so the agents' token is checked
as for every call: only ``/v1/agent/``, 401/403 as before), that answers this one path
itself: the raw body is validated in one step (pydantic's ``model_validate_json``), the beat
is recorded on one dedicated thread, in batches (:class:`BeatRunner`), and the reply is
written as bytes.
Every other request goes on to FastAPI untouched. The FastAPI route stays declared, so the
OpenAPI schema still describes the call, and it runs the same :meth:`BeatRunner.answer`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainpod.api.models import Heartbeat, Orders
from trainpod.bounded import ByteBoundedCache
from trainpod.controller.access import AGENT
from trainpod.controller.core import Controller
from trainpod.errors import (
    Conflict,
    Forbidden,
    NotFound,
    SpecError,
    StoreUnavailable,
    TrainpodError,
)

PATH = "/v1/agent/heartbeat"
_STATUS: dict[type[TrainpodError], int] = {
    SpecError: 400,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    StoreUnavailable: 503,  # locked elsewhere, or the disk full: nothing applied, retry
}


def error_reply(exc: TrainpodError) -> tuple[int, dict[str, str]]:
    """The status and body every route answers a :class:`TrainpodError` with."""
    status = next((s for t, s in _STATUS.items() if isinstance(exc, t)), 500)
    return status, {"error": type(exc).__name__, "message": str(exc)}


class BeatRunner:
    """Records beats and computes orders on one thread of its own, in batches, and holds
    the long poll on the event loop (no thread) until the orders change or ``wait_s`` is up.

    Whatever arrived while the thread was busy is handed to :meth:`Controller.serve` at
    once: one hold of the controller's lock, one hop between threads and one wake-up of the
    event loop for the lot. With a thread per beat instead, each beat queued on the lock on
    its own, behind every pass of the reconcile loop, which re-takes the lock first more
    often than not.

    A long poll is parked here with the orders' hash its agent holds. On a change (the
    controller's :class:`~trainpod.controller.wake.Wake`), the thread looks up the orders
    of every parked node at once and settles only the polls whose orders now differ; the
    others stay parked, costing nothing, until their ``wait_s`` is up. Changes that come
    while a look-up is queued are served by that one look-up.
    """

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started by the first beat
        self._start = threading.Lock()
        self._replies = ReplyCache(reply_bytes_for(len(controller.cfg.nodes)))
        self._parked: dict[int, _Parked] = {}  # id(poll) -> poll
        self._parked_lock = threading.Lock()  # _parked, _recheck_queued
        self._recheck_queued = False
        controller.wake.listen(self._changed)

    async def answer(self, hb: Heartbeat) -> bytes:
        """The reply to ``hb``: its orders (JSON), once they differ from those the agent
        holds or ``hb.wait_s`` has passed."""
        c = self.controller
        orders, version = await self._run(hb)
        if hb.wait_s > 0 and orders.hash == hb.orders_hash:
            orders = await self._park(hb.node, orders, version, hb.wait_s)
        return self._replies.encode(orders, c.clock.now())

    def close(self) -> None:
        """Stop the thread once it has served what it was given."""
        self.controller.wake.unlisten(self._changed)
        self._queue.put(None)

    async def _run(self, work: Heartbeat | str) -> tuple[Orders, int]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[Orders, int]] = loop.create_future()
        self._put((work, loop, done))
        return await done

    def _put(self, item: _Item | None) -> None:
        if self._thread is None:
            self._start_thread()
        self._queue.put(item)

    async def _park(self, node: str, orders: Orders, version: int, wait_s: float) -> Orders:
        """Hold the poll until a look-up finds ``node``'s orders changed (those: returned)
        or ``wait_s`` has passed (``orders``, as the agent holds them)."""
        loop = asyncio.get_running_loop()
        poll = _Parked(node, orders.hash, loop, loop.create_future())
        with self._parked_lock:
            self._parked[id(poll)] = poll
        if self.controller.wake.version != version:
            # Something changed between the look-up and the parking, and its bump may
            # have found this poll not yet parked: look again, with any others.
            self._changed()
        timer = loop.call_later(wait_s, _expire, poll.done)
        try:
            changed = await poll.done
        finally:
            timer.cancel()
            with self._parked_lock:
                self._parked.pop(id(poll), None)
        return orders if changed is None else changed

    def _changed(self) -> None:
        """A change (on whichever thread made it): queue one look-up of the parked polls,
        unless one is queued already (it has not yet read the parked polls' orders)."""
        with self._parked_lock:
            if self._recheck_queued or not self._parked:
                return
            self._recheck_queued = True
        self._put(_RECHECK)

    def _recheck(self) -> None:
        """Settle each parked poll whose node's orders differ from the ones its agent holds."""
        with self._parked_lock:
            self._recheck_queued = False  # a change from now on queues another look-up
            parked = list(self._parked.values())
        nodes = sorted({p.node for p in parked})
        if not nodes:
            return
        try:
            found = self.controller.serve(nodes)
        except Exception:  # the polls stay parked; their deadline answers them
            return
        now = dict(zip(nodes, found, strict=True))
        settled: dict[asyncio.AbstractEventLoop, list[_Reply]] = {}
        for p in parked:
            result = now[p.node]
            if isinstance(result, Exception) or result[0].hash == p.held:
                continue
            settled.setdefault(p.loop, []).append((p.done, result[0]))
        _hand_back(settled)

    def _start_thread(self) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="heartbeats", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                return
            batch: list[_Item] = []
            recheck = first is _RECHECK
            if not recheck:
                batch.append(first)
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                if item is _RECHECK:
                    recheck = True
                else:
                    batch.append(item)
            if batch:
                self._serve_batch(batch)
            if recheck:  # after the beats: the freshest orders
                self._recheck()

    def _serve_batch(self, batch: list[_Item]) -> None:
        results: list[tuple[Orders, int] | Exception]
        try:
            results = self.controller.serve([work for work, _, _ in batch])
        except Exception as exc:  # the batch's commit failed: every call in it did
            results = [exc] * len(batch)
        replies: dict[asyncio.AbstractEventLoop, list[_Reply]] = {}
        for (_, loop, done), result in zip(batch, results, strict=True):
            replies.setdefault(loop, []).append((done, result))
        _hand_back(replies)


@dataclass(frozen=True, eq=False)
class _Parked:
    """A long poll held until its node's orders differ from ``held`` (their hash)."""

    node: str
    held: str
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Orders | None]  # the new orders; None: its wait is up


_Item = tuple["Heartbeat | str", asyncio.AbstractEventLoop, "asyncio.Future[tuple[Orders, int]]"]
_RECHECK: Any = object()  # the queue item "look up the parked polls' orders"
_Reply = tuple["asyncio.Future[Any]", Any]
MAX_BATCH = 128  # calls served per hold of the lock, so that one batch never holds it long


def _hand_back(replies: dict[asyncio.AbstractEventLoop, list[_Reply]]) -> None:
    """Settle the futures on their own loops, one wake-up of each loop."""
    for loop, settled in replies.items():
        try:
            loop.call_soon_threadsafe(_settle, settled)
        except RuntimeError:  # that loop has closed: nobody waits for these
            pass


def _expire(done: asyncio.Future[Orders | None]) -> None:
    if not done.done():
        done.set_result(None)


def _settle(replies: list[_Reply]) -> None:
    for done, result in replies:
        if done.done():  # the request went away meanwhile
            continue
        if isinstance(result, Exception):
            done.set_exception(result)
        else:
            done.set_result(result)


REPLY_CACHE_BYTES = 16 << 20
REPLY_BYTES_PER_NODE = 16 << 10
REPLY_BYTES_MIN = 1 << 20


def reply_bytes_for(nodes: int) -> int:
    """The encoded replies' bound for a cluster of ``nodes``: each node's current reply kept,
    from REPLY_BYTES_MIN to REPLY_CACHE_BYTES (1,024 nodes), as the sealed orders' is
    (:func:`trainpod.api.models.sealed_bytes_for`)."""
    return max(REPLY_BYTES_MIN, min(REPLY_CACHE_BYTES, nodes * REPLY_BYTES_PER_NODE))


_ENTRY_BYTES = 128  # a kept body's own overhead: the bytes object, its key and dict slot


class ReplyCache:
    """Orders as the reply's bytes, encoded once per distinct orders: a thousand idle nodes
    get the same "nothing to do" every second. Only ``controller_time`` differs from one
    reply to the next; it is not part of the orders' hash, so orders of one hash encode
    alike but for it, and it is written after them.

    Used on the event loop only.

    ``max_bytes``: what the kept bodies may take together (the oldest go first)."""

    def __init__(self, max_bytes: int = REPLY_CACHE_BYTES) -> None:
        self._bodies: ByteBoundedCache[str, bytes] = ByteBoundedCache(max_bytes)
        """Orders' hash -> their JSON without the time."""

    def encode(self, orders: Orders, now: float) -> bytes:
        body = self._bodies.get(orders.hash) if orders.hash else None
        if body is None:
            body = orders.model_dump_json(exclude=_STAMP).encode()
            if orders.hash:
                self._bodies.put(orders.hash, body, len(body) + _ENTRY_BYTES)
        return b"%s,%s}" % (body[:-1], _TIME_KEY + json.dumps(now).encode())

    def __len__(self) -> int:
        return len(self._bodies)


_STAMP = {"controller_time"}
_TIME_KEY = b'"controller_time":'


class HeartbeatRoute:
    """Answers ``POST /v1/agent/heartbeat`` (see the module's docstring); passes on the rest.

    Replies as the FastAPI route would: 200 with the orders, 422 with FastAPI's
    ``{"detail": [...]}`` for a body that is not a valid heartbeat, and a
    :class:`TrainpodError` as ``{"error", "message"}`` with its status (404: an unknown node).
    """

    def __init__(self, app: ASGIApp, *, runner: BeatRunner) -> None:
        self.app = app
        self.runner = runner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        await serve_beat(self.runner, receive, send)


async def serve_beat(runner: BeatRunner, receive: Receive, send: Send) -> None:
    """Answer one heartbeat call (its token already accepted)."""
    body = await _body(receive)
    if body is None:
        return  # the agent hung up before it had sent its beat
    try:
        hb = Heartbeat.model_validate_json(body)
    except ValidationError as exc:
        await _reply(send, 422, _json({"detail": _invalid(exc)}))
        return
    try:
        reply = await runner.answer(hb)
    except TrainpodError as exc:
        status, doc = error_reply(exc)
        await _reply(send, status, _json(doc))
        return
    await _reply(send, 200, reply)


class AgentDoor:
    """The heartbeats that carry the agents' token, taken before the rest of the app.

    Outside FastAPI's own stack (its error, telemetry and body-size middleware) and
    :class:`~trainpod.api.app.BearerAuth`, which every other call passes. It takes a call
    only if its bearer token names the agents' principal, as BearerAuth would read it: any
    other call to the path (no token, a user's token, the admin's) goes the usual way, and
    is refused or answered there as before."""

    def __init__(self, runner: BeatRunner, principal: Callable[[bytes], object]) -> None:
        self.runner = runner
        self._principal = principal

    def takes(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            return False
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return header[:7].lower() == b"bearer " and self._principal(header[7:]) is AGENT


async def _body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _invalid(exc: ValidationError) -> list[dict[str, Any]]:
    """pydantic's errors as FastAPI reports a bad request body (``loc`` from ``body``)."""
    # Without the input: a body that is not UTF-8 cannot be put in JSON (and was a 500,
    # found by the API fuzz); the location and the message say what was wrong.
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    return [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]} for e in errors]
