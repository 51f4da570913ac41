"""`pdserve promote` finds the sqlite database of --mlflow-uri the way SQLAlchemy (and so MLflow) does."""

from __future__ import annotations

from urllib.parse import quote

from typer.testing import CliRunner

from runtime.cli import app
from runtime.faces.promote import _sqlite_database

runner = CliRunner()


def test_query_strings_and_percent_escapes_are_read_like_sqlalchemy(tmp_path):
    db = tmp_path / "my db.sqlite"
    assert _sqlite_database(f"sqlite:///{db}?timeout=30") == db
    assert _sqlite_database(f"sqlite:///{quote(str(db))}") == db
    assert _sqlite_database("sqlite:///:memory:") is None and _sqlite_database("http://h:5000") is None


def test_promote_with_a_missing_database_behind_a_query_string_names_the_file(tmp_path):
    db = tmp_path / "absent.db"
    res = runner.invoke(app, ["promote", "m", "--mlflow-uri", f"sqlite:///{db}?timeout=30",
                              "--out", str(tmp_path / "m.yaml")], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "no such database file" in res.output and str(db) in res.output
    assert not db.exists() and not (tmp_path / "m.yaml").exists()


def test_promote_with_an_existing_percent_encoded_database_goes_on_to_mlflow(tmp_path):
    db = tmp_path / "my db.sqlite"
    db.write_bytes(b"")
    res = runner.invoke(app, ["promote", "m", "--mlflow-uri", f"sqlite:///{quote(str(db))}",
                              "--out", str(tmp_path / "m.yaml")], env={"COLUMNS": "300"})
    assert "no such database file" not in res.output


def test_an_empty_expect_version_is_refused_not_read_as_no_guard(tmp_path, monkeypatch):
    """`--expect-version ""` (e.g. an Argo parameter that came out empty) would reach the promote use case as "", which
    means "no guard": whatever alias champion names would be rendered and applied. It is refused before MLflow or
    the cluster is asked."""
    import runtime.usecases.promote

    called = []
    monkeypatch.setattr(runtime.usecases.promote, "promote", lambda *a, **kw: called.append(a))
    db = tmp_path / "m.db"
    db.write_bytes(b"")
    for empty in ("", "  "):
        res = runner.invoke(app, ["promote", "m", "--mlflow-uri", f"sqlite:///{db}", "--expect-version", empty,
                                  "--out", str(tmp_path / "m.yaml")], env={"COLUMNS": "300"})
        assert res.exit_code == 2 and "--expect-version" in res.output, res.output
    assert called == [] and not (tmp_path / "m.yaml").exists()
