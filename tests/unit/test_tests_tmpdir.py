"""The tests' temp folder: what they and the processes they start write there stays in one folder of the run."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def test_processes_started_by_tests_make_their_temp_folders_in_the_runs_temp_folder(session_tmpdir,
                                                                                     tmp_path_factory):
    # pytest's base temp, or a fresh system temp folder where that is too long a path for a socket in it
    assert session_tmpdir.is_dir()
    assert (session_tmpdir == tmp_path_factory.getbasetemp() / "tmp"
            or session_tmpdir.name.startswith("pdserve-tests-"))
    assert Path(tempfile.gettempdir()) == session_tmpdir and os.environ["TMPDIR"] == str(session_tmpdir)
    # what kfp.local's step command does: `mktemp -d` in a child shell, which reads TMPDIR
    made = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True, check=True).stdout.strip())
    try:
        assert made.parent == session_tmpdir
    finally:
        made.rmdir()
    with tempfile.NamedTemporaryFile() as f:
        assert Path(f.name).parent == session_tmpdir
