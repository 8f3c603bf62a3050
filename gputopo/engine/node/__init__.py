"""One pod on one node: the per-node verdict with its GPUs and score (`placement`), the GPU-set search behind it
(`gpusets`, whose package is its only public face) and go-gpuallocator's policy for comparison (`besteffort`). May
import `gputopo.engine.network` and `gputopo.engine.state`.
"""
