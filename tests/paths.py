"""Where the repository lies, for tests that read its docs, examples and chart: one constant, so a test
file keeps working wherever in tests/ it sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
