"""The controller's Prometheus metrics, built from one :class:`Scrape` (pure).

Names follow Prometheus' rules: a ``trainpod_`` prefix, base units (seconds, bytes, joules,
grams, celsius, watts, ratios 0-1), ``_total`` on counters. Labels are bounded: cluster,
node, device, group, state, team, partition, priority_class, fault, tier, cause, reason,
simulated; ``job_id`` only on the ``trainpod_job_*`` series of live jobs, which end with the
job (not ``job``: Prometheus gives every series of a target its scrape job's name
there). What each label can cost is in docs/decisions/0018-metrics-and-cardinality.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from trainpod.api.devices import DeviceSample
from trainpod.model.states import JobState, NodeState
from trainpod.telemetry.exposition import Rows
from trainpod.telemetry.tally import EventTally, Histogram

Family = Metric


@dataclass(frozen=True)
class JobLive:
    """A live job's own series: goodput so far, progress, energy."""

    job_id: int
    team: str
    wall_s: float
    productive_s: float
    lost_s: dict[str, float]
    step: int | None = None
    step_time_s: float | None = None
    tokens: float | None = None
    loss: float | None = None
    energy_j: float = 0.0
    simulated: bool = False


@dataclass
class Sums:
    """Goodput or energy added up over many jobs."""

    wall_s: float = 0.0
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=dict)

    def add(self, wall_s: float, productive_s: float, lost_s: dict[str, float]) -> None:
        self.wall_s += wall_s
        self.productive_s += productive_s
        for cause, s in lost_s.items():
            self.lost_s[cause] = self.lost_s.get(cause, 0.0) + s

    def copy(self) -> Sums:
        return Sums(self.wall_s, self.productive_s, dict(self.lost_s))

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class EnergySum:
    joules: float
    simulated: bool


@dataclass
class Scrape:
    cluster: str
    backend: str
    g_per_kwh: float
    carbon_source: str
    nodes: list[tuple[str, str, NodeState]]  # name, group, state
    jobs: dict[tuple[JobState, str, str, str], int]  # (state, team, class, partition) -> n
    queue: dict[str, tuple[int, float]]  # partition -> (waiting, oldest wait in seconds)
    live: list[JobLive]
    teams: dict[str, Sums]
    cluster_sums: Sums
    devices: dict[str, list[DeviceSample]]
    tally: EventTally
    passes: Histogram
    team_energy: dict[str, EnergySum]
    cluster_energy: EnergySum
    idle_energy: EnergySum
    tally_behind: bool = False
    """The counters have not folded the whole event log yet: their families are left out."""
    goodput_behind: int = 0
    """Ended jobs whose goodput is not in ``teams``/``cluster_sums`` yet: while any is, the
    team and cluster goodput families are left out (a share of the jobs would read short)."""


def _g(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=["cluster", *labels])


def _c(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=["cluster", *labels])


def _h(name: str, doc: str, labels: Iterable[str] = ()) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=["cluster", *labels])


def _sim(flag: bool) -> str:
    return "true" if flag else "false"


def families(s: Scrape) -> list[Family]:
    return [
        *_cluster(s),
        *_jobs(s),
        *([] if s.tally_behind else _events(s)),
        *_goodput(s),
        *_progress(s),
        *_devices(s),
        *_energy(s),
    ]


def _cluster(s: Scrape) -> list[Family]:
    c = s.cluster
    info = _g("trainpod_info", "The cluster and its backend (always 1).", ["backend"])
    info.add_metric([c, s.backend], 1.0)
    by_state = _g("trainpod_nodes", "Nodes by state and group.", ["state", "group"])
    counts: dict[tuple[str, str], int] = {}
    groups = sorted({g for _, g, _ in s.nodes})
    for g in groups:
        for st in NodeState:
            counts[(st.value, g)] = 0
    for _, g, st in s.nodes:
        counts[(st.value, g)] += 1
    for (st_, g), n in sorted(counts.items()):
        by_state.add_metric([c, st_, g], float(n))
    node = Rows(
        "trainpod_node_state",
        "1 for each node's current state.",
        "gauge",
        ["cluster", "node", "group", "state"],
    )
    for name, g, st in s.nodes:
        node.add((c, name, g, st.value), 1.0)
    passes = _h("trainpod_scheduler_pass_seconds", "Time of one scheduler pass (plan + apply).")
    passes.add_metric([c], s.passes.cumulative(), s.passes.total)
    return [info, by_state, node, passes]


def _jobs(s: Scrape) -> list[Family]:
    c = s.cluster
    jobs = _g(
        "trainpod_jobs",
        "Jobs by state, team, priority class and partition (ended jobs included).",
        ["state", "team", "priority_class", "partition"],
    )
    for (st, team, cls, part), n in sorted(s.jobs.items()):
        jobs.add_metric([c, st.value, team, cls, part], float(n))
    length = _g(
        "trainpod_queue_length", "Jobs waiting to be placed (held ones excluded).", ["partition"]
    )
    oldest = _g(
        "trainpod_queue_oldest_wait_seconds",
        "How long the oldest waiting job has waited.",
        ["partition"],
    )
    for part, (n, wait) in sorted(s.queue.items()):
        length.add_metric([c, part], float(n))
        oldest.add_metric([c, part], wait)
    return [jobs, length, oldest]


def _events(s: Scrape) -> list[Family]:
    c, t = s.cluster, s.tally
    attempts = _c(
        "trainpod_attempts_total", "Attempts created (first runs and restarts).", ["team"]
    )
    for team, n in sorted(t.attempts.items()):
        attempts.add_metric([c, team], float(n))
    restarts = _c("trainpod_restarts_total", "Attempts after the first (restarts).", ["team"])
    for team, n in sorted(t.restarts.items()):
        restarts.add_metric([c, team], float(n))
    faults = _c("trainpod_faults_total", "Faults detected, by class.", ["fault"])
    for fault, n in sorted(t.faults.items()):
        faults.add_metric([c, fault], float(n))
    out: list[Family] = [attempts, restarts, faults]
    for name, doc, table, label in (
        (
            "trainpod_fault_detection_seconds",
            "From a fault to its detection.",
            t.detection,
            "fault",
        ),
        (
            "trainpod_recovery_seconds",
            "From a fault's detection to the next attempt running.",
            t.recovery,
            "fault",
        ),
        (
            "trainpod_queue_wait_seconds",
            "From submission to the first attempt running.",
            t.queue_wait,
            "partition",
        ),
        (
            "trainpod_checkpoint_commit_seconds",
            "Time to commit a checkpoint step in a tier.",
            t.commit,
            "tier",
        ),
    ):
        h = _h(name, doc, [label])
        for key, hist in sorted(table.items()):
            h.add_metric([c, key], hist.cumulative(), hist.total)
        out.append(h)
    stall = _h("trainpod_checkpoint_stall_seconds", "Longest save() stall of a checkpoint step.")
    stall.add_metric([c], t.stall.cumulative(), t.stall.total)
    size = _h("trainpod_checkpoint_size_bytes", "Size of a checkpoint step (memory tier).")
    size.add_metric([c], t.size.cumulative(), t.size.total)
    failures = _c("trainpod_checkpoint_failures_total", "Checkpoint steps that failed.", ["tier"])
    for tier, n in sorted(t.failures.items()):
        failures.add_metric([c, tier], float(n))
    full = _c(
        "trainpod_checkpoint_tier_full_total",
        "Checkpoint steps a tier could not take (full or unwritable): they went to the next.",
        ["tier"],
    )
    for tier, n in sorted(t.full.items()):
        full.add_metric([c, tier], float(n))
    return [*out, stall, size, failures, full]


def _goodput(s: Scrape) -> list[Family]:
    c = s.cluster
    job_ratio = _g(
        "trainpod_job_goodput_ratio",
        "A live job's productive share of its wall clock.",
        ["job_id", "team"],
    )
    job_wall = _g(
        "trainpod_job_wall_seconds", "A live job's wall clock since submission.", ["job_id", "team"]
    )
    job_lost = _g(
        "trainpod_job_lost_seconds",
        "A live job's seconds lost, by cause.",
        ["job_id", "team", "cause"],
    )
    for j in s.live:
        labels = [c, str(j.job_id), j.team]
        job_ratio.add_metric(labels, j.productive_s / j.wall_s if j.wall_s > 0 else 0.0)
        job_wall.add_metric(labels, j.wall_s)
        for cause, sec in sorted(j.lost_s.items()):
            job_lost.add_metric([*labels, cause], sec)
    if s.goodput_behind:
        return [job_ratio, job_wall, job_lost]
    team_ratio = _g(
        "trainpod_team_goodput_ratio", "A team's productive share, every job.", ["team"]
    )
    team_lost = _g(
        "trainpod_team_lost_seconds",
        "A team's seconds lost, every job, by cause.",
        ["team", "cause"],
    )
    for team, sums in sorted(s.teams.items()):
        team_ratio.add_metric([c, team], sums.ratio)
        for cause, sec in sorted(sums.lost_s.items()):
            team_lost.add_metric([c, team, cause], sec)
    ratio = _g("trainpod_cluster_goodput_ratio", "The cluster's productive share, every job.")
    ratio.add_metric([c], s.cluster_sums.ratio)
    lost = _g("trainpod_cluster_lost_seconds", "Seconds lost, every job, by cause.", ["cause"])
    for cause, sec in sorted(s.cluster_sums.lost_s.items()):
        lost.add_metric([c, cause], sec)
    return [job_ratio, job_wall, job_lost, team_ratio, team_lost, ratio, lost]


def _progress(s: Scrape) -> list[Family]:
    c = s.cluster
    step = _g(
        "trainpod_job_step", "The last step every rank of a live job finished.", ["job_id", "team"]
    )
    rate = _g(
        "trainpod_job_steps_per_second", "A live job's step rate (median rank).", ["job_id", "team"]
    )
    tokens = _c(
        "trainpod_job_tokens_total",
        "Tokens a live job's current attempt processed.",
        ["job_id", "team"],
    )
    loss = _g(
        "trainpod_job_loss", "The loss a live job's rank 0 last reported.", ["job_id", "team"]
    )
    for j in s.live:
        labels = [c, str(j.job_id), j.team]
        if j.step is not None:
            step.add_metric(labels, float(j.step))
        if j.step_time_s:
            rate.add_metric(labels, 1.0 / j.step_time_s)
        if j.tokens is not None:
            tokens.add_metric(labels, j.tokens)
        if j.loss is not None:
            loss.add_metric(labels, j.loss)
    return [step, rate, tokens, loss]


def _devices(s: Scrape) -> list[Family]:
    """Seven samples per device: :class:`Rows`, each device's label text written once."""
    labels = ["cluster", "node", "device", "simulated"]
    util = Rows(
        "trainpod_device_utilization_ratio", "Share of time a kernel ran (NVML).", "gauge", labels
    )
    used = Rows("trainpod_device_memory_used_bytes", "Device memory in use.", "gauge", labels)
    total = Rows("trainpod_device_memory_total_bytes", "Device memory in all.", "gauge", labels)
    power = Rows("trainpod_device_power_watts", "Power draw.", "gauge", labels)
    temp = Rows("trainpod_device_temperature_celsius", "Temperature.", "gauge", labels)
    energy = Rows(
        "trainpod_device_energy_joules",
        "Energy since the agent's source began counting.",
        "counter",
        labels,
    )
    xids = Rows(
        "trainpod_device_xid_errors", "XID errors since the agent started.", "counter", labels
    )
    throttle = Rows(
        "trainpod_device_throttled",
        "1 for each active throttle reason.",
        "gauge",
        [*labels, "reason"],
    )
    c = s.cluster
    for node, samples in sorted(s.devices.items()):
        for d in samples:
            lv = (c, node, str(d.index), _sim(d.simulated))
            if d.utilization_pct is not None:
                util.add(lv, d.utilization_pct / 100.0)
            if d.memory_used_bytes is not None:
                used.add(lv, float(d.memory_used_bytes))
            if d.memory_total_bytes is not None:
                total.add(lv, float(d.memory_total_bytes))
            if d.power_w is not None:
                power.add(lv, float(d.power_w))
            if d.temperature_c is not None:
                temp.add(lv, float(d.temperature_c))
            if d.energy_j is not None:
                energy.add(lv, float(d.energy_j))
            xids.add(lv, float(d.xid_count))
            for reason in d.throttle_reasons:
                throttle.add((*lv, reason), 1.0)
    return [util, used, total, power, temp, energy, xids, throttle]


def _energy(s: Scrape) -> list[Family]:
    c = s.cluster
    per_g = s.g_per_kwh / 3.6e6
    intensity = _g(
        "trainpod_carbon_intensity_grams_per_joule",
        f"The grid's carbon intensity ({s.g_per_kwh:g} g/kWh; {s.carbon_source}).",
    )
    intensity.add_metric([c], per_g)
    job_e = _g(
        "trainpod_job_energy_joules",
        "A live job's energy, every attempt.",
        ["job_id", "team", "simulated"],
    )
    job_co2 = _g(
        "trainpod_job_co2e_grams",
        "A live job's CO2e (energy x intensity).",
        ["job_id", "team", "simulated"],
    )
    for j in s.live:
        lv = [c, str(j.job_id), j.team, _sim(j.simulated)]
        job_e.add_metric(lv, j.energy_j)
        job_co2.add_metric(lv, j.energy_j * per_g)
    team_e = _c(
        "trainpod_team_energy_joules_total", "A team's energy, every job.", ["team", "simulated"]
    )
    team_co2 = _c(
        "trainpod_team_co2e_grams_total", "A team's CO2e, every job.", ["team", "simulated"]
    )
    for team, e in sorted(s.team_energy.items()):
        team_e.add_metric([c, team, _sim(e.simulated)], e.joules)
        team_co2.add_metric([c, team, _sim(e.simulated)], e.joules * per_g)
    cl_e = _c(
        "trainpod_cluster_energy_joules_total",
        "The cluster's device energy (jobs and idle).",
        ["simulated"],
    )
    cl_co2 = _c(
        "trainpod_cluster_co2e_grams_total", "The cluster's CO2e (jobs and idle).", ["simulated"]
    )
    idle = _c(
        "trainpod_cluster_idle_energy_joules_total",
        "Device energy while no job held the node.",
        ["simulated"],
    )
    cl_e.add_metric([c, _sim(s.cluster_energy.simulated)], s.cluster_energy.joules)
    cl_co2.add_metric([c, _sim(s.cluster_energy.simulated)], s.cluster_energy.joules * per_g)
    idle.add_metric([c, _sim(s.idle_energy.simulated)], s.idle_energy.joules)
    return [intensity, job_e, job_co2, team_e, team_co2, cl_e, cl_co2, idle]
