"""The control plane: job records and their state machine (lifecycle), routing, ETAs, recovery, quotas,
idempotency, the worker registry, broker reads, snapshots and readiness. Used by the HTTP layer and the workers."""
