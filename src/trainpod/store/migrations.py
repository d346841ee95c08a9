"""Versioned schema migrations for the controller's SQLite store.

Each entry of :data:`MIGRATIONS` moves the schema from version ``i`` to ``i + 1``; the
current version lives in ``PRAGMA user_version``. Migrations only ever append: an
existing entry is never edited once released.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: nodes, jobs, attempts, ranks and the append-only event log
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY,
        grp TEXT NOT NULL,
        role TEXT NOT NULL,
        spare INTEGER NOT NULL,
        devices INTEGER NOT NULL,
        state TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        job_id INTEGER,
        address TEXT,
        agent_id TEXT,
        agent_pid INTEGER,
        last_heartbeat REAL,
        facts TEXT NOT NULL DEFAULT '{}',
        updated_at REAL NOT NULL
    );
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        submitted_at REAL NOT NULL,
        started_at REAL,
        ended_at REAL,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        updated_at REAL NOT NULL
    );
    CREATE INDEX jobs_state ON jobs(state);
    CREATE TABLE attempts (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        number INTEGER NOT NULL,
        state TEXT NOT NULL,
        nodes TEXT NOT NULL,
        master_addr TEXT NOT NULL,
        master_port INTEGER NOT NULL,
        created_at REAL NOT NULL,
        started_at REAL,
        ended_at REAL,
        cause TEXT NOT NULL DEFAULT '',
        failure TEXT NOT NULL DEFAULT '{}',
        UNIQUE (job_id, number)
    );
    CREATE TABLE ranks (
        attempt_id INTEGER NOT NULL REFERENCES attempts(id),
        rank INTEGER NOT NULL,
        node TEXT NOT NULL,
        local_rank INTEGER NOT NULL,
        state TEXT NOT NULL,
        pid INTEGER,
        exit_code INTEGER,
        signal INTEGER,
        started_at REAL,
        ended_at REAL,
        PRIMARY KEY (attempt_id, rank)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        node TEXT,
        job_id INTEGER,
        attempt INTEGER,
        data TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX events_job ON events(job_id);
    CREATE TRIGGER events_no_update BEFORE UPDATE ON events
        BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
    CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
    """,
    # 2: node repair bookkeeping and operator drains
    """
    ALTER TABLE nodes ADD COLUMN drained INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE nodes ADD COLUMN repairs INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE nodes ADD COLUMN repair TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE attempts ADD COLUMN restart_reason TEXT NOT NULL DEFAULT '';
    """,
    # 3: external schedulers (Slurm): a job's id there; the job whose allocation holds a node
    """
    ALTER TABLE jobs ADD COLUMN external TEXT NOT NULL DEFAULT '';
    ALTER TABLE nodes ADD COLUMN allocation INTEGER;
    """,
    # 4: the event log indexed for what it is queried by (kind, node, time, a job's kinds),
    # and a retention: Store.prune_events may delete old events, never a live job's. A
    # delete is refused unless the meta row prune_before (set only inside prune_events'
    # transaction) is there; while it is, an event that is not older than it, or that
    # belongs to a job that has not ended, is kept (skipped) whatever the DELETE says.
    """
    CREATE INDEX events_kind ON events(kind, ts);
    CREATE INDEX events_node ON events(node);
    CREATE INDEX events_ts ON events(ts);
    CREATE INDEX events_job_kind ON events(job_id, kind);
    DROP TRIGGER events_no_delete;
    CREATE TRIGGER events_no_delete BEFORE DELETE ON events
        WHEN (SELECT value FROM meta WHERE key = 'prune_before') IS NULL
        BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
    CREATE TRIGGER events_retention BEFORE DELETE ON events
        WHEN (SELECT value FROM meta WHERE key = 'prune_before') IS NOT NULL AND NOT (
            OLD.ts < (SELECT CAST(value AS REAL) FROM meta WHERE key = 'prune_before')
            AND NOT EXISTS (
                SELECT 1 FROM jobs WHERE id = OLD.job_id
                AND state NOT IN ('completed', 'failed', 'cancelled')
            )
        )
        BEGIN SELECT RAISE(IGNORE); END;
    """,
    # 5: users and their bearer tokens (only a token's SHA-256 is kept; the token is shown
    # once, when it is issued). Users come from the spec (source 'spec') or `users add`.
    """
    CREATE TABLE users (
        name TEXT PRIMARY KEY,
        team TEXT,
        role TEXT NOT NULL,
        account TEXT,
        source TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE tokens (
        id TEXT PRIMARY KEY,
        user TEXT NOT NULL REFERENCES users(name),
        hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        revoked_at REAL
    );
    CREATE INDEX tokens_user ON tokens(user);
    """,
    # 6: a job held in the queue (`trainpod hold`): who holds it; empty: not held
    """
    ALTER TABLE jobs ADD COLUMN held_by TEXT NOT NULL DEFAULT '';
    """,
    # 7: energy used per job attempt and node (device energy-counter deltas, joules),
    # accumulated by the controller and written every few seconds (store/energy.py). Job 0:
    # devices no job held. ``simulated``: the figures come from simulated devices.
    """
    CREATE TABLE energy (
        job_id INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        node TEXT NOT NULL,
        joules REAL NOT NULL,
        simulated INTEGER NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (job_id, attempt, node)
    );
    """,
    # 8: an attempt's in-process recovery (ADR 0026): its newest generation, that group's
    # port, the ranks started again, the deadline, whether it is still being formed
    """
    ALTER TABLE attempts ADD COLUMN in_process TEXT NOT NULL DEFAULT '{}';
    """,
    # 9: a job's secret env values (`submit --secret-env`, ADR 0032), apart from its spec
    # (which keeps the names, masked): read only to build the job's launch orders
    """
    CREATE TABLE job_secrets (
        job_id INTEGER PRIMARY KEY,
        env TEXT NOT NULL
    );
    """,
    # 10: the Idempotency-Key of a creating call (ADR 0037), per caller: what it made, the
    # request as received (secret values masked, to name what a reuse changed) and a salted
    # SHA-256 of the whole request; kept 24 h from the first call (pruned by later ones)
    """
    CREATE TABLE idempotency_keys (
        owner TEXT NOT NULL,
        key TEXT NOT NULL,
        operation TEXT NOT NULL,
        made INTEGER NOT NULL,
        request TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (owner, key)
    );
    CREATE INDEX idempotency_keys_age ON idempotency_keys(created_at);
    """,
    # 11: ended jobs' goodput, computed once (ADR 0043): /metrics sums it in SQL instead of
    # keeping every job in memory, and a restarted controller does not compute it again.
    # The labels of the jobs gauge are counted from an index, not from every spec.
    """
    CREATE TABLE goodput_ended (
        job_id INTEGER PRIMARY KEY,
        team TEXT NOT NULL,
        wall_s REAL NOT NULL,
        productive_s REAL NOT NULL,
        lost TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX jobs_ended_at ON jobs(ended_at);
    CREATE INDEX jobs_labels ON jobs(
        state,
        json_extract(spec, '$.team'),
        json_extract(spec, '$.priority_class'),
        json_extract(spec, '$.partition')
    );
    """,
    # 12: what every scheduling pass reads, under the controller's lock, found by index
    # rather than by a scan of every attempt the cluster ever ran: the live attempts (by
    # state) and the attempts that held nodes lately (by end, or none yet: fair share).
    # At 100,000 attempts the two scans cost ~27 ms a pass.
    """
    CREATE INDEX attempts_state ON attempts(state);
    CREATE INDEX attempts_ended_at ON attempts(ended_at);
    """,
    # 13: the waiting jobs whose reserved nodes an attempt was started on (backfill past a
    # reservation, ADR 0050): each may preempt it, whatever the priorities.
    """
    ALTER TABLE attempts ADD COLUMN lent_by TEXT NOT NULL DEFAULT '[]';
    """,
]
