"""`python -m runtime.server` worker URLs: bad ones are refused at parse time (exit 2, nothing served), a
worker is listed in one pool once, and a URL's user:password@ never reaches the log."""

import logging

import httpx
import pytest

import runtime.server.app as app_mod
from runtime.config import RouterSpec
from runtime.server.__main__ import main, parse_args
from runtime.server.app import build_router_pairing
from runtime.server.planner_loop import read_pool


@pytest.fixture
def served(monkeypatch):
    """Records the call to runtime.server.app.serve (key 'called') instead of starting a server."""
    seen = {}
    monkeypatch.setattr(app_mod, "serve", lambda *a, **kw: seen.update(kw, called=True))
    return seen


@pytest.mark.parametrize("url,why", [
    ("ftp://127.0.0.1:1", "http:// or https://"),
    ("file:///etc/passwd", "http:// or https://"),
    ("127.0.0.1:8000", "http:// or https://"),
    ("not a url", "http:// or https://"),
    ("", "http:// or https://"),
    ("http://", "no host"),
    ("http://127.0.0.1:99999", "valid port"),
    ("http://127.0.0.1:0", "port must be 1-65535"),
    ("http://127.0.0.1:x", "valid port"),
    ("http://admin:s3cr3t@127.0.0.1:1", "user:password@"),
    ("http://127.0.0.1:1/?a=1", "query or fragment"),
    ("http://127.0.0.1:1/#x", "query or fragment"),
])
@pytest.mark.parametrize("flag", ["--decode-url", "--prefill-url"])
def test_bad_worker_urls_are_refused_naming_the_flag(flag, url, why, served, capsys):
    argv = ["--model-name", "m", "--decode-url", "http://127.0.0.1:2", flag, url]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and flag in err and why in err, err
    assert "s3cr3t" not in err
    assert "called" not in served


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://decode-0.svc.cluster.local:8443/",
                                 "http://[::1]:8000", "http://worker/v1"])
def test_good_worker_urls_parse_unchanged(url):
    assert parse_args(["--model-name", "m", "--decode-url", url]).decode_url == [url]


@pytest.mark.parametrize("prefill,decode", [
    (["http://127.0.0.1:1"], ["http://127.0.0.1:1"]),
    (["http://127.0.0.1:1/"], ["http://127.0.0.1:1"]),
    ([], ["http://127.0.0.1:1", "http://127.0.0.1:1"]),
])
def test_a_worker_url_given_twice_is_refused(prefill, decode, served, capsys):
    argv = ["--model-name", "m"] + [a for u in prefill for a in ("--prefill-url", u)] + \
        [a for u in decode for a in ("--decode-url", u)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "given twice" in capsys.readouterr().err
    assert "called" not in served


def test_distinct_worker_urls_reach_serve(served):
    main(["--model-name", "m", "--prefill-url", "http://127.0.0.1:1", "--decode-url", "http://127.0.0.1:2"])
    assert served["prefill_urls"] == ["http://127.0.0.1:1"] and served["decode_urls"] == ["http://127.0.0.1:2"]


def test_router_pool_changes_never_log_a_url_password(caplog):
    url = "http://admin:s3cr3t@127.0.0.1:1"  # refused by the command line; a library caller may still pass one
    pairing = build_router_pairing(RouterSpec(), block_size_tokens=16, prefill_urls=[], decode_urls=[url])
    with caplog.at_level(logging.INFO, logger="runtime.server.routing"):
        pairing.mark_down(url)
        pairing.mark_up(url)
    assert "is down" in caplog.text and "is back" in caplog.text
    assert "s3cr3t" not in caplog.text and "***@127.0.0.1:1" in caplog.text, caplog.text


def test_planner_metrics_warnings_never_log_a_url_password(caplog):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url}", request=request)

    url = "http://admin:s3cr3t@127.0.0.1:1/metrics"
    with httpx.Client(transport=httpx.MockTransport(refuse)) as client, \
            caplog.at_level(logging.WARNING, logger="runtime.server.planner_loop"):
        obs = read_pool(client, [url], deadline_s=5.0)
    assert obs.num_ready == 0 and "unreadable" in caplog.text
    assert "s3cr3t" not in caplog.text and "***@127.0.0.1:1" in caplog.text, caplog.text
