"""runtime.ports: ports for local servers come from below the ephemeral range, are bindable and never repeat
unless given back with release_ports."""

from __future__ import annotations

import random
import socket

import pytest

from runtime import ports
from runtime.engines.vllm_worker import free_port as worker_free_port


def test_ports_lie_below_the_ephemeral_range_and_bind():
    low, _ = ports.ephemeral_range()
    got = ports.free_ports(5)
    assert len(set(got)) == 5
    for p in got:
        assert ports.LOWEST_PORT <= p < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))  # raises if taken


def test_a_port_is_never_handed_out_twice_in_one_process():
    seen = [ports.free_port() for _ in range(200)] + ports.free_ports(50) + [worker_free_port() for _ in range(50)]
    assert len(seen) == len(set(seen))


def test_a_port_in_use_is_skipped():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        low, _ = ports.ephemeral_range()
        # an ephemeral range that starts just above the busy port makes it a candidate; the random source
        # offers it first, then a free one
        taken = busy.getsockname()[1]
        busy.listen()

        class Scripted(random.Random):
            def __init__(self, first: int):
                super().__init__(0)
                self.first = first

            def randint(self, a, b):
                if self.first is not None:
                    p, self.first = self.first, None
                    assert a <= p <= b
                    return p
                return super().randint(a, b)

        eph = (max(taken + 1, ports.LOWEST_PORT + ports.MIN_POOL), 65535)
        if taken < ports.LOWEST_PORT:
            pytest.skip(f"the kernel gave port {taken}, below LOWEST_PORT")
        got = ports.free_ports(1, rng=Scripted(taken), ephemeral=eph)
        assert got != [taken]


def test_too_narrow_a_range_falls_back_to_kernel_ports():
    got = ports.free_ports(2, ephemeral=(ports.LOWEST_PORT + 10, 65535))
    assert len(set(got)) == 2 and all(p > 0 for p in got)


def test_running_out_of_candidates_is_an_error_naming_the_range():
    class Always(random.Random):
        def randint(self, a, b):
            return self.port

    r = Always()
    r.port = ports.free_port()  # already handed out: every try is skipped
    with pytest.raises(OSError, match="found only 0 of 1 free ports"):
        ports.free_ports(1, rng=r)


def test_bad_count_and_unreadable_range_file(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        ports.free_ports(0)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL_RANGE
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)


def test_released_ports_may_be_handed_out_again_and_unknown_ones_are_ignored():
    got = ports.free_ports(3)
    assert all(("127.0.0.1", p) in ports._given for p in got)
    ports.release_ports(got + [1])  # 1 was never handed out: ignored
    assert not any(("127.0.0.1", p) in ports._given for p in got)

    class Scripted(random.Random):  # offers the released port first
        def randint(self, a, b):
            return got[0]

    assert ports.free_ports(1, rng=Scripted()) == [got[0]]
