"""The extender's state: the ledger (`ledger`) over each node's engine state (`nodestates`), placed pods by UID and by
controller (`podindex`), group reservations (`reservations`), free GPUs per fabric domain (`domainfree`), placement
mismatches (`mismatch`), the records API objects become (`records`), one request's verdicts by node kind and a pod's
decision (`verdicts`), the lock table (`locks`) and whether this replica's kube-scheduler leads (`leadership`).
Imports only the wire types, settings and the engine.
"""
