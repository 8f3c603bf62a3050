"""HTTP routers of the extender, one set per listener: scheduler verbs, mutate (webhook), metrics; health on all."""
