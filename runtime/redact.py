"""Credentials out of what is printed: the userinfo (`user:password@`) of every URI in a text (pure).

Tracking URIs such as `http://user:password@mlflow.example:5000` carry basic-auth credentials (MLflow
supports them, mlflow.org/docs/latest/self-hosting/security/basic-http-auth), and MLflow's own error
messages repeat the full request URL. Anything the CLI or a pipeline step echoes goes through here.
Userinfo syntax: RFC 3986 §3.2.1 (everything between `scheme://` and the last `@` of the authority).
"""

from __future__ import annotations

import re

REDACTED = "***"
# scheme://  userinfo  '@': everything up to the LAST '@' before the path ('/', '?', '#') on the same line,
# quotes and blanks included, so a password with an unencoded '@', quote or space is covered whole. A text
# such as "http://h:1 or me@x" is over-redacted ("http://***@x"): losing a host beats leaking a password.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\r\n]*@")


def redact_userinfo(text: str) -> str:
    """`text` with the userinfo of every `scheme://userinfo@host` replaced by `***` (host, path kept)."""
    return _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
