"""gputopo-extender: kube-scheduler's HTTP extender protocol over a live cluster cache (docs/extender.md)."""
