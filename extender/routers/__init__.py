"""HTTP routers of the extender: the scheduler verbs and the health/metrics endpoints."""
