"""Shared pytest configuration: fixtures live in tests/conftest_*.py plug-ins, one per area."""

import importlib.util

pytest_plugins = [
    name
    for name in ("tests.sigterm", "tests.conftest_s3", "tests.conftest_vllm")
    if importlib.util.find_spec(name) is not None
]


import pytest  # noqa: E402

from runtime.procs import temp_folder  # noqa: E402
from tests import tracegen  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory):
    """The temp folder (``TMPDIR``) of the tests and of every process they start, removed at the end
    (runtime.procs.temp_folder): kfp.local's step folders, vLLM's IPC sockets and the scratch files of the servers
    the tests start do not pile up in /tmp. A test that gives a subprocess an environment of its own does not
    pass it on."""
    with temp_folder(tmp_path_factory.getbasetemp() / "tmp", prefix="pdserve-tests-") as tmp:
        yield tmp


# A production-like trace: ~1 h of chat traffic at 5.5 requests/s with heavy-tailed lengths, written once per
# session in both public formats (tests/tracegen.py); tests compare readers against AZURE_ROWS.
AZURE_ROWS = tracegen.poisson_rows(n=20000, seed=2023, rate_per_s=5.5, isl_median=1000, osl_median=200)


@pytest.fixture(scope="session")
def azure_trace(tmp_path_factory):
    """Path of an Azure-format CSV of AZURE_ROWS (7 fractional digits, no zone, like the public trace)."""
    return tracegen.write_azure_csv(tmp_path_factory.mktemp("traces") / "azure_conv.csv", AZURE_ROWS)


@pytest.fixture(scope="session")
def mooncake_trace(tmp_path_factory):
    """Path of a Mooncake JSONL of AZURE_ROWS' lengths and times, with a 2-block shared prefix."""
    return tracegen.write_mooncake_jsonl(tmp_path_factory.mktemp("traces") / "mooncake.jsonl", AZURE_ROWS,
                                         shared_prefix_blocks=2)
