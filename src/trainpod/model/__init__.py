"""The leaves of trainpod's domain: states and their transitions, and the event types.

Modules here import nothing of trainpod outside this package, so every layer above
(spec, store, controller, api, cli, telemetry) can depend on them without a cycle.
"""
