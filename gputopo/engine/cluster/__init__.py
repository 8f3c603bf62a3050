"""Decisions over the whole cluster: which victims to preempt (`preempt`), fragmentation of free GPUs (`fragmentation`),
the fewest moves that undo it (`defrag`) and the sentence that explains each decision (`explain`). The top of the
engine: may import every other engine layer.
"""
