"""Fixtures for the extender tests (builders and the `env` fixture live in extender.testing)."""

from tests.extender.harness import env

__all__ = ["env"]
