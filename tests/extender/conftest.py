"""Fixtures for the extender tests (builders and the `env` fixture live in extender.testing)."""

from extender.testing import env

__all__ = ["env"]
