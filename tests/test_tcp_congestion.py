"""PYCOLL_TCP_CC: the congestion control of tcp bulk streams to other hosts (apply_congestion), on
real loopback sockets here; the emulated cluster (test_emulated_cluster.py) checks the streams a job
opens between its hosts."""
import os
import pwd
import socket

import pytest

from pycoll import config
from pycoll.errors import EnvError
from pycoll.transports.bulk import apply_congestion, congestion_of


def _proc(name: str) -> str:
    with open(f"/proc/sys/net/ipv4/{name}") as fh:
        return fh.read().strip()


def expected_auto(privileged: bool) -> str:
    """What `auto` gives: the default, unless it is bbr; then cubic or reno, if this user may set them."""
    default = _proc("tcp_congestion_control")
    permitted = set((_proc("tcp_available_congestion_control") if privileged
                     else _proc("tcp_allowed_congestion_control")).split())
    if default != "bbr":
        return default
    return next((cc for cc in ("cubic", "reno") if cc in permitted), default)


@pytest.fixture
def stream():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
        yield client
        client.close()
        peer.close()


def test_system_auto_and_a_name(stream):
    default = _proc("tcp_congestion_control")
    assert apply_congestion(stream, "system") == default == congestion_of(stream)
    assert apply_congestion(stream, "auto") == expected_auto(os.geteuid() == 0) == congestion_of(stream)
    assert apply_congestion(stream, "reno") == "reno" == congestion_of(stream)
    assert apply_congestion(stream, "auto") == "reno"  # not bbr: left alone


def test_a_name_the_kernel_refuses_is_an_error_naming_the_variable(stream):
    with pytest.raises(EnvError, match=r"PYCOLL_TCP_CC=nosuchcc: the kernel refused it .*tcp_available"):
        apply_congestion(stream, "nosuchcc")


def test_the_variable_takes_auto_system_or_a_name():
    assert config.get("PYCOLL_TCP_CC", {}) == "auto"
    assert config.get("PYCOLL_TCP_CC", {"PYCOLL_TCP_CC": " Cubic "}) == "cubic"
    with pytest.raises(EnvError, match="PYCOLL_TCP_CC"):
        config.get("PYCOLL_TCP_CC", {"PYCOLL_TCP_CC": "cubic; rm"})


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_auto_for_a_user_who_may_not_set_cubic():
    """Without CAP_NET_ADMIN only tcp_allowed_congestion_control may be set: auto takes what it can
    (a forked child that became `nobody` opens the stream)."""
    user = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname()) as c:
                os.write(w, apply_congestion(c, "auto").encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        got = fh.read()
    os.waitpid(pid, 0)
    assert got == expected_auto(privileged=False)
