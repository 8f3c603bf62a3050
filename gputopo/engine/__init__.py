"""The placement engine: pure functions from (cluster snapshot, pod request) to verdicts. No I/O."""
