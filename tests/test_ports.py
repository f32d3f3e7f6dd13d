"""tests/ports.py: a listener's port outside the kernel's ephemeral range, never one in use,
never the same twice in a process."""
import random
import socket

import ports


def test_ports_lie_below_the_ephemeral_range_and_are_never_given_twice():
    low = ports.ephemeral_low()
    given = [ports.free_port() for _ in range(50)]
    assert len(set(given)) == 50
    assert all(p < low for p in given)


def test_a_port_something_listens_on_is_skipped(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("", 0))  # any port, then make the picker draw it first
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65535)  # the taken port lies in the range
        draws = iter([taken, taken, 40001])

        class Rng(random.Random):
            def randint(self, a, b):
                return next(draws)

        assert ports.free_port(Rng()) == 40001


def test_the_range_is_read_from_the_kernel_and_defaults_sanely(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ports.ephemeral_low(str(f)) == 40000
    assert ports.ephemeral_low(str(tmp_path / "missing")) == 32768
