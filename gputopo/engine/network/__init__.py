"""What lies between GPUs and between nodes: the communication cost model (`cost`), free GPUs per fabric domain and best
fit above the node (`domains`), rails (`rails`) and the estimates of a placement across nodes (`estimate`). May import
`gputopo.engine.state`.
"""
