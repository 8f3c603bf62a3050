"""The front ends: the `gputopo` command (simulate, explain, inspect, defrag report, calibrate, demo,
uninstall cleanup). The top room: it may import every layer below, and nothing imports it."""
