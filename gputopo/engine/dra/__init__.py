"""gputopo's GPUs under Dynamic Resource Allocation: the devices, attributes and clique encodings a node publishes
(`devices`), the order that makes the allocator's first fit a best fit (`order`) and the ResourceClaimTemplate a request
becomes (`claims`). May import `gputopo.engine.state`.
"""
