"""The doc tests' marker: `full` tests run the documented commands for real (a server, the model) and belong to the
full tier only; everything else here takes seconds."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: runs the documentation's commands for real (the full tier only)")
