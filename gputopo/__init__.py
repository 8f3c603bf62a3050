"""gputopo: topology-aware placement of GPU pods. This package holds the shared topology model and the
pure placement engine; `extender` and `agent` are the adapters at the edges."""

__version__ = "0.1.0"
