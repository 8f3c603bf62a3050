"""The `gputopo` command: one subcommand per module.

A subcommand module exposes `add_parser(subparsers) -> argparse.ArgumentParser` (it adds its own
subparser and returns it) and `run(args) -> int` (the exit status). Add a module to COMMANDS to
register it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

COMMANDS: tuple[str, ...] = (
    "gputopo.sim.cli",
    "gputopo.console.demo",
    "gputopo.console.inspect",
    "gputopo.console.calibrate",
    "gputopo.console.defrag",
    "gputopo.console.uninstall",
)


def build_parser(modules: Sequence[ModuleType] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gputopo",
        description="Topology-aware GPU placement for Kubernetes: simulate, inspect and explain placements.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in modules if modules is not None else [importlib.import_module(m) for m in COMMANDS]:
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "_run", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        status: int = handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return status


if __name__ == "__main__":
    sys.exit(main())
