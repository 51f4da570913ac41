"""runtime/redact.py: every character of a URI's userinfo is hidden, whatever the password contains."""

from __future__ import annotations

import pytest

from runtime.redact import redact_userinfo


@pytest.mark.parametrize("password", ["it's", 'say"hi"', "two words", "tab\there", "a@b'c d", "p@ss"])
def test_passwords_with_quotes_blanks_or_at_signs_are_hidden(password):
    text = f"API request to http://alice:{password}@mlflow.example:5000/api/2.0/x failed"
    out = redact_userinfo(text)
    assert out == "API request to http://***@mlflow.example:5000/api/2.0/x failed"
    assert password not in out


def test_one_uri_per_line_is_redacted_without_swallowing_the_next_line():
    assert redact_userinfo("http://u:p@h1/a\nhttps://v:q w@h2") == "http://***@h1/a\nhttps://***@h2"
