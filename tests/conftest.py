from __future__ import annotations

import warnings

import pytest

from opttree import testing


@pytest.fixture(scope="session", autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", module="megatron")


@pytest.fixture(scope="session")
def process_group() -> None:
    """Megatron wrappers want a process group even on one rank."""
    testing.ensure_process_group()
