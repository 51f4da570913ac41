"""Shared pytest configuration: fixtures live in tests/conftest_*.py plug-ins, one per area."""

import importlib.util

pytest_plugins = [
    name
    for name in ("tests.conftest_s3", "tests.conftest_vllm")
    if importlib.util.find_spec(name) is not None
]
