"""The extender harness's `env` fixture (tests/extender/harness.py), for the cases that go through the door."""

from tests.extender.harness import env

__all__ = ["env"]
