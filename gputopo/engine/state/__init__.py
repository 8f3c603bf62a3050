"""The engine's vocabulary and its view of the cluster: verdict codes and reason categories (`reasons`), score
components and weights (`scoring`), NVLink clique search over GPU bitmasks (`cliques`) and the immutable per-node states
every decision reads (`snapshot`). Imports nothing else of the engine.
"""
