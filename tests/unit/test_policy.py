"""The recovery ladder as a pure function: (job, fault, cluster snapshot) -> decision."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainpod.controller.policy import (
    Decision,
    Fail,
    Fault,
    FaultKind,
    JobView,
    NodeView,
    Restart,
    Wait,
    crash_signature,
    decide,
    teardown_abort,
)

K = FaultKind


def job(**kw: Any) -> JobView:
    """A 2-node job on workers-0, workers-1 that asked for --auto-resume, no restarts yet."""
    base = JobView(
        id=7,
        auto_resume=True,
        max_restarts=3,
        restarts_used=0,
        nodes=2,
        min_nodes=None,
        groups=frozenset({"workers", "spares"}),
        attempt_nodes=("workers-0", "workers-1"),
    )
    return replace(base, **kw)


def node(
    name: str,
    *,
    group: str | None = None,
    spare: bool = False,
    healthy: bool = True,
    free: bool = False,
) -> NodeView:
    group = group or name.rsplit("-", 1)[0]
    return NodeView(name=name, group=group, spare=spare, healthy=healthy, free=free)


def cluster(*extra: NodeView, bad: tuple[str, ...] = ()) -> list[NodeView]:
    """The job's two nodes (allocated; those in ``bad`` unhealthy) plus ``extra``."""
    return [
        node("workers-0", healthy="workers-0" not in bad),
        node("workers-1", healthy="workers-1" not in bad),
        *extra,
    ]


def case(name: str, view: JobView, fault: Fault, nodes: list[NodeView], expected: Decision) -> Any:
    return pytest.param(view, fault, nodes, expected, id=name)


SPARE = node("spares-0", spare=True, free=True)
IDLE = node("workers-2", free=True)  # a free regular node of the partition

CRASH = Fault(K.CRASH, "rank 3 on workers-1 exited with code 1", ("workers-1",), "code=1 a")
OTHER_CRASH = Fault(K.CRASH, "rank 0 on workers-0 exited with code 2", ("workers-0",), "code=2 b")
HANG = Fault(K.HANG, "rank 2 sent no progress beacon for 130.0s")
GPU = Fault(K.GPU_FAULT, "workers-1: gpu: XID 79", ("workers-1",))
LOST = Fault(K.NODE_LOST, "rank 2 on workers-1 was lost with its node", ("workers-1",))


@pytest.mark.parametrize(
    ("view", "fault", "nodes", "expected"),
    [
        case(
            "a crash restarts on the same nodes and counts",
            job(),
            CRASH,
            cluster(SPARE),
            Restart(("workers-0", "workers-1"), {}, True, "restart after crash"),
        ),
        case(
            "a hang restarts on the same nodes and counts",
            job(restarts_used=2),
            HANG,
            cluster(SPARE),
            Restart(("workers-0", "workers-1"), {}, True, "restart after hang"),
        ),
        case(
            "a different crash after a crash is retried",
            job(restarts_used=1, previous=CRASH),
            OTHER_CRASH,
            cluster(),
            Restart(("workers-0", "workers-1"), {}, True, "restart after crash"),
        ),
        case(
            "a crash after a node fault is retried, even with the old signature",
            job(restarts_used=1, previous=GPU),
            CRASH,
            cluster(),
            Restart(("workers-0", "workers-1"), {}, True, "restart after crash"),
        ),
        case(
            "a GPU fault takes the spare in the bad node's position, before an idle node",
            job(),
            GPU,
            cluster(IDLE, SPARE, bad=("workers-1",)),
            Restart(
                ("workers-0", "spares-0"),
                {"workers-1": "spares-0"},
                False,
                "replaced workers-1 -> spares-0 after gpu_fault",
            ),
        ),
        case(
            "a bad first node is replaced in first position",
            job(),
            Fault(K.GPU_FAULT, "workers-0: gpu: ECC", ("workers-0",)),
            cluster(SPARE, bad=("workers-0",)),
            Restart(
                ("spares-0", "workers-1"),
                {"workers-0": "spares-0"},
                False,
                "replaced workers-0 -> spares-0 after gpu_fault",
            ),
        ),
        case(
            "a lost node is replaced like a GPU fault",
            job(),
            LOST,
            cluster(SPARE, bad=("workers-1",)),
            Restart(
                ("workers-0", "spares-0"),
                {"workers-1": "spares-0"},
                False,
                "replaced workers-1 -> spares-0 after node_lost",
            ),
        ),
        case(
            "with no spare a free regular node of the partition is used",
            job(),
            GPU,
            cluster(IDLE, bad=("workers-1",)),
            Restart(
                ("workers-0", "workers-2"),
                {"workers-1": "workers-2"},
                False,
                "replaced workers-1 -> workers-2 after gpu_fault",
            ),
        ),
        case(
            "node faults do not count against max_restarts",
            job(restarts_used=3),
            GPU,
            cluster(SPARE, bad=("workers-1",)),
            Restart(
                ("workers-0", "spares-0"),
                {"workers-1": "spares-0"},
                False,
                "replaced workers-1 -> spares-0 after gpu_fault",
            ),
        ),
        case(
            "a node named by a node fault is replaced even if it still looks healthy",
            job(),
            Fault(K.STRAGGLER, "rank 3 is slow", ("workers-1",)),
            cluster(SPARE),
            Restart(
                ("workers-0", "spares-0"),
                {"workers-1": "spares-0"},
                False,
                "replaced workers-1 -> spares-0 after straggler",
            ),
        ),
        case(
            "a node at fault that is back in the pool (repaired, free) is taken back",
            job(),
            GPU,
            [node("workers-0"), node("workers-1", free=True), SPARE],
            Restart(("workers-0", "workers-1"), {}, False, "restart after gpu_fault"),
        ),
        case(
            "a node at fault still held by the job is replaced, however healthy it looks",
            job(),
            GPU,
            cluster(SPARE),
            Restart(
                ("workers-0", "spares-0"),
                {"workers-1": "spares-0"},
                False,
                "replaced workers-1 -> spares-0 after gpu_fault",
            ),
        ),
        case(
            "an unhealthy node of the attempt is replaced even on a crash (which counts)",
            job(),
            CRASH,
            cluster(SPARE, bad=("workers-0",)),
            Restart(
                ("spares-0", "workers-1"),
                {"workers-0": "spares-0"},
                True,
                "replaced workers-0 -> spares-0 after crash",
            ),
        ),
        case(
            "a node gone from the snapshot counts as unhealthy",
            job(),
            HANG,
            [node("workers-0"), SPARE],
            Restart(
                ("workers-0", "spares-0"),
                {"workers-1": "spares-0"},
                True,
                "replaced workers-1 -> spares-0 after hang",
            ),
        ),
        case(
            "busy, drained or unhealthy spares are not used: wait, holding the healthy node",
            job(),
            GPU,
            cluster(
                node("spares-0", spare=True, free=False),
                node("spares-1", spare=True, free=True, healthy=False),
                bad=("workers-1",),
            ),
            Wait("waiting for a healthy node to replace workers-1 (gpu_fault)", ("workers-0",)),
        ),
        case(
            "spares outside the job's partition are not used",
            job(groups=frozenset({"workers"})),
            GPU,
            cluster(SPARE, node("other-0", free=True), bad=("workers-1",)),
            Wait("waiting for a healthy node to replace workers-1 (gpu_fault)", ("workers-0",)),
        ),
        case(
            "two bad nodes and one spare: wait, holding nothing",
            job(),
            Fault(K.NODE_LOST, "both lost", ("workers-0", "workers-1")),
            cluster(SPARE, bad=("workers-0", "workers-1")),
            Wait(
                "waiting for a healthy node to replace workers-0, workers-1 (node_lost)",
                (),
            ),
        ),
        case(
            "two of three bad and one spare: wait, keeping the healthy node",
            job(nodes=3, attempt_nodes=("workers-0", "workers-1", "workers-2")),
            Fault(K.GPU_FAULT, "two GPUs", ("workers-1", "workers-2")),
            [node("workers-0"), node("workers-1"), node("workers-2"), SPARE],
            Wait(
                "waiting for a healthy node to replace workers-1, workers-2 (gpu_fault)",
                ("workers-0",),
            ),
        ),
        case(
            "two of three bad, one spare, min_nodes 2: shrink onto the spare",
            job(nodes=3, min_nodes=2, attempt_nodes=("workers-0", "workers-1", "workers-2")),
            Fault(K.GPU_FAULT, "two GPUs", ("workers-1", "workers-2")),
            [node("workers-0"), node("workers-1"), node("workers-2"), SPARE],
            Restart(
                ("workers-0", "spares-0"),
                {"workers-1": "spares-0"},
                False,
                "continuing on 2 of 3 nodes (min_nodes 2) after gpu_fault",
                shrunk=True,
            ),
        ),
        case(
            "no spare, min_nodes 1: continue on the healthy node alone",
            job(min_nodes=1),
            GPU,
            cluster(bad=("workers-1",)),
            Restart(
                ("workers-0",),
                {},
                False,
                "continuing on 1 of 2 nodes (min_nodes 1) after gpu_fault",
                shrunk=True,
            ),
        ),
        case(
            "min_nodes larger than what is left: wait",
            job(min_nodes=2),
            GPU,
            cluster(bad=("workers-1",)),
            Wait("waiting for a healthy node to replace workers-1 (gpu_fault)", ("workers-0",)),
        ),
    ],
)
def test_decide(view: JobView, fault: Fault, nodes: list[NodeView], expected: Decision) -> None:
    assert decide(view, fault, nodes) == expected


@pytest.mark.parametrize("fault", [CRASH, HANG, GPU, LOST], ids=lambda f: f.kind.value)
def test_without_auto_resume_every_fault_fails_naming_the_flag(fault: Fault) -> None:
    decision = decide(job(auto_resume=False), fault, cluster(SPARE, IDLE))
    assert isinstance(decision, Fail)
    assert decision.reason.startswith(fault.reason)
    assert "--auto-resume" in decision.reason


@pytest.mark.parametrize("fault", [CRASH, HANG], ids=lambda f: f.kind.value)
@pytest.mark.parametrize(("used", "limit"), [(3, 3), (1, 1), (0, 0), (5, 3)])
def test_crash_and_hang_restarts_stop_at_max_restarts(fault: Fault, used: int, limit: int) -> None:
    decision = decide(job(restarts_used=used, max_restarts=limit), fault, cluster(SPARE))
    assert decision == Fail(f"{fault.reason}; gave up after {used} restarts (max_restarts)")


def test_one_restart_left_is_used() -> None:
    decision = decide(job(restarts_used=2, max_restarts=3), CRASH, cluster())
    assert isinstance(decision, Restart) and decision.counts


@pytest.mark.parametrize("kind", [k for k in FaultKind if k.node_fault], ids=lambda k: k.value)
def test_node_faults_never_count(kind: FaultKind) -> None:
    fault = Fault(kind, "bad node", ("workers-1",))
    decision = decide(job(restarts_used=99, max_restarts=0), fault, cluster(SPARE))
    assert isinstance(decision, Restart)
    assert decision.counts is False
    assert decision.replaced == {"workers-1": "spares-0"}


def test_the_same_crash_twice_is_a_user_error() -> None:
    decision = decide(job(restarts_used=1, previous=CRASH), CRASH, cluster(SPARE))
    assert isinstance(decision, Fail)
    assert decision.reason.startswith("user error")
    assert CRASH.reason in decision.reason


def test_a_crash_without_signature_is_never_the_same_twice() -> None:
    blank = replace(CRASH, signature="")
    decision = decide(job(restarts_used=1, previous=blank), blank, cluster())
    assert isinstance(decision, Restart)


def test_a_hang_after_a_hang_is_not_a_user_error() -> None:
    assert isinstance(decide(job(restarts_used=1, previous=HANG), HANG, cluster()), Restart)


def test_spares_are_taken_in_name_order_and_keep_positions() -> None:
    view = job(nodes=3, attempt_nodes=("workers-0", "workers-1", "workers-2"))
    fault = Fault(K.NODE_LOST, "two lost", ("workers-0", "workers-2"))
    nodes = [
        node("workers-0"),
        node("workers-1"),
        node("workers-2"),
        node("workers-3", free=True),
        node("spares-1", spare=True, free=True),
        node("spares-0", spare=True, free=True),
    ]
    decision = decide(view, fault, nodes)
    assert isinstance(decision, Restart)
    assert decision.nodes == ("spares-0", "workers-1", "spares-1")
    assert decision.replaced == {"workers-0": "spares-0", "workers-2": "spares-1"}
    assert not decision.shrunk


def test_one_spare_and_an_idle_node_replace_two_bad_nodes() -> None:
    fault = Fault(K.NODE_LOST, "both lost", ("workers-0", "workers-1"))
    decision = decide(job(), fault, cluster(IDLE, SPARE, bad=("workers-0", "workers-1")))
    assert isinstance(decision, Restart)
    assert decision.replaced == {"workers-0": "spares-0", "workers-1": "workers-2"}


@pytest.mark.parametrize(
    ("code", "signal", "tail", "expected"),
    [
        (1, None, "step 3\nValueError: bad\n\n", "code=1 signal=None last=ValueError: bad"),
        (None, 9, "", ""),  # killed without a word: never "the same" as anything
        (None, 9, "Killed", ""),
        (3, None, "", ""),
        (2, None, "  only line  ", "code=2 signal=None last=only line"),
    ],
)
def test_crash_signature(code: int | None, signal: int | None, tail: str, expected: str) -> None:
    assert crash_signature(code, signal, tail) == expected


TRACEBACK = (
    "step 2 loss 0.5\n"
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "train.py", line 9, in <module>\n'
    "[rank0]:     main()\n"
    "[rank0]:     ^^^^^^\n"
    "[rank0]: RuntimeError: bad batch at step 3\n"
)


def test_a_script_that_raised_is_known_by_its_exception_however_its_process_ended() -> None:
    raised = "raised RuntimeError: bad batch at step 3"
    assert crash_signature(1, None, TRACEBACK) == raised
    # torch#179291: without destroy_process_group, Gloo may abort the interpreter's teardown
    aborted = TRACEBACK + "terminate called without an active exception\n"
    assert crash_signature(None, 6, aborted) == raised
    segv = TRACEBACK + "Fatal Python error: Segmentation fault\n"
    assert crash_signature(None, 11, segv) == raised
    # the rank prefix is torch's, not the failure's: rank 1 failing first is the same failure
    assert crash_signature(1, None, TRACEBACK.replace("[rank0]", "[rank1]")) == raised


def test_a_teardown_abort_is_sigabrt_with_libstdcxx_s_last_words_and_no_traceback() -> None:
    done = "step 30 loss 4.70\nfinal {}\n[rank1]: terminate called without an active exception\n"
    assert teardown_abort(6, done)
    assert teardown_abort(6, done + "\n\n")  # blank lines after it do not count
    assert not teardown_abort(9, done)  # a kill from outside
    assert not teardown_abort(None, done)
    assert not teardown_abort(6, "step 30 loss 4.70\n")  # aborted with nothing said
    assert not teardown_abort(6, done + "Fatal Python error: Aborted\n")  # said more after
    # a script that raised and then aborted in its teardown raised: a failure, whatever ends it
    assert not teardown_abort(6, TRACEBACK + "terminate called without an active exception\n")


def test_the_last_traceback_is_the_one_that_ended_the_script() -> None:
    chained = (
        TRACEBACK
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + "Traceback (most recent call last):\n"
        + '  File "train.py", line 12, in <module>\n'
        + "ValueError: cleanup failed\n"
        + "extra output after it\n"
    )
    assert crash_signature(1, None, chained) == "raised ValueError: cleanup failed"


@pytest.mark.parametrize("sig", [9, 15, 2])
def test_a_kill_from_outside_is_never_the_same_even_after_a_traceback(sig: int) -> None:
    assert crash_signature(None, sig, TRACEBACK) == ""


def test_an_abort_without_a_traceback_is_not_evidence_of_a_bug() -> None:
    assert crash_signature(None, 6, "terminate called after throwing\n") == ""
    cut = '  File "train.py", line 9, in <module>\nRuntimeError: x\n'  # its header cut off
    assert crash_signature(None, 6, cut) == ""
    assert crash_signature(1, None, cut) == "code=1 signal=None last=RuntimeError: x"


def test_crash_signature_tells_different_endings_apart() -> None:
    assert crash_signature(1, None, "a\nb") != crash_signature(1, None, "a\nc")
    assert crash_signature(1, None, "x") != crash_signature(2, None, "x")
    assert crash_signature(1, None, "earlier\nx") == crash_signature(1, None, "other\nx")
