"""A client used wrongly gets one clear UsageError at once, against a real server: a resume state
with another seq selection or of another config, numbers a message cannot carry, a client
inherited through fork()."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from conftest import (
    FINGERPRINT_CHANGES,
    SLOW_MAPPER,
    assert_same_epoch,
    change_fingerprint,
    changing_config,
    collect,
    free_port,
    numpy_config,
    reference,
    run_server,
    wait_child,
)

import ppclient
from ppclient import UsageError
from ppclient.client import JOB_REFUSAL_GRACE_S

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = numpy_config(tmp_path_factory.mktemp("misuse"), SLOW_MAPPER.format(delay=0), n=50)
    with run_server(cfg, workers=1) as srv:
        yield srv, cfg


TAGS = ["seq-3", "seq-9", "seq-1", "seq-30", "seq-12", "seq-7", "seq-44"]


@pytest.mark.parametrize("selection", ["seq_list", "seq_order"])
def test_a_resume_state_keeps_its_seq_selection(server, selection):
    srv, cfg = server
    chosen = {"seq_list": TAGS} if selection == "seq_list" else {"seq_order": [3, 9, 1, 30, 12, 7, 44]}
    want = reference(cfg, 1, **chosen)
    assert len(want) == 7
    with srv.client() as c:
        it = c.epoch(1, **chosen)
        first = [next(it) for _ in range(3)]
        state = it.state_dict()
        assert state["seq_selection"].startswith(f"{selection} of 7 entries")
        with pytest.raises(UsageError, match=f"the state was taken of {selection} of 7 entries.*the whole epoch"):
            c.epoch(state=state)  # without its selection: the whole corpus from its 3rd seq, before
        other = {"seq_list": TAGS[::-1]} if selection == "seq_list" else {"seq_order": [44, 7]}
        with pytest.raises(UsageError, match="the state was taken of"):
            c.epoch(state=state, **other)
        rest = collect(c.epoch(state=state, **chosen))
    assert len(rest) == 4
    assert_same_epoch(first + rest, want)


@pytest.mark.parametrize("change", (None, *FINGERPRINT_CHANGES))
def test_a_resume_state_is_refused_by_a_server_whose_values_code_or_data_changed(tmp_path, change):
    """A state taken from one server, resumed at another started from the same config file: where
    the seed from the environment, a module the config uses or the data file changed meanwhile the
    state is refused, naming its fingerprint; where nothing did, the rest of the epoch follows."""
    cfg = changing_config(tmp_path, n=12)
    want = reference(cfg, 1)
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        it = c.epoch(1)
        first = [next(it) for _ in range(3)]
        state = it.state_dict()
    env = change_fingerprint(tmp_path, change, n=12) if change else {}
    with run_server(cfg, workers=1, env=env) as srv, srv.client() as c:
        if change is None:
            assert_same_epoch(first + collect(c.epoch(state=state)), want)
            return
        with pytest.raises(
            ppclient.Error, match=f"the resume state was made with config fingerprint '{state['fingerprint']}'"
        ):
            c.epoch(state=state)


def test_a_whole_epochs_state_is_refused_with_a_seq_list(server):
    srv, _ = server
    with srv.client() as c:
        it = c.epoch(1)
        next(it)
        with pytest.raises(UsageError, match="taken of the whole epoch, this request asks for seq_list of 7"):
            c.epoch(state=it.state_dict(), seq_list=TAGS)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 1e300, -1.0, 0])
def test_a_timeout_a_message_cannot_carry_is_refused(server, timeout):
    srv, _ = server
    with pytest.raises(UsageError, match="timeout must be a number of seconds > 0 and at most"):
        ppclient.Client(srv.address, timeout=timeout)


@pytest.mark.parametrize(
    "where, name",
    [
        ("epoch", "epoch"),
        ("start", "start"),
        ("client", "window"),
        ("client", "world_size"),
        ("order", "seq_order entry"),
    ],
)
def test_ints_beyond_64_bits_are_usage_errors_and_the_client_goes_on(server, where, name):
    srv, cfg = server
    huge = 2**64
    kwargs = {"window": huge} if name == "window" else {"world_size": huge}
    began = time.monotonic()
    with srv.client(timeout=5) as c:
        with pytest.raises(UsageError, match=f"{name} must be an int from 0|{name} must be an int from 1"):
            if where == "client":
                ppclient.Client(srv.address, **kwargs)
            elif where == "epoch":
                c.epoch(huge)
            elif where == "start":
                c.epoch(1, start=huge)
            else:
                c.epoch(1, seq_order=[1, huge])
        assert time.monotonic() - began < 5  # at once, not after a timeout
        assert_same_epoch(collect(c.epoch(2)), reference(cfg, 2))


def test_an_epoch_holds_its_session_not_its_client(server):
    """What an epoch needs of its client comes in one Session (ppclient/epoch.py), so an iterator
    reaches no further into the client than that; its state names the client's reader."""
    srv, _ = server
    with srv.client(rank=0, world_size=1) as c:
        it = c.epoch(1)
        assert not any(isinstance(v, ppclient.Client) for v in vars(it).values())
        session = it._session
        assert (session.address, session.timeout, session.inbox) == (c.address, c.timeout, c._inbox)
        state = it.state_dict()
        assert (state["job"], state["rank"], state["world_size"], state["subshard"]) == (c.job, 0, 1, [0, 1])
        assert len(collect(it)) == 50


def test_an_iterator_used_in_a_forked_child_is_a_usage_error_and_the_parent_goes_on(server):
    srv, cfg = server
    want = reference(cfg, 1)
    with srv.client() as c:
        it = c.epoch(1)
        got = [next(it) for _ in range(5)]
        pid = os.fork()
        if pid == 0:  # the child: it must not block in the parent's sockets, nor close them
            code = 1
            try:
                next(it)
            except UsageError as exc:
                code = 3 if "make a new Client in the child" in str(exc) else 4
            except BaseException:
                code = 5
            try:
                c.close()
                c.info()
            except UsageError:
                pass
            except BaseException:
                code = 6
            os._exit(code)
        assert wait_child(pid, 20) == 3
        got += collect(it)
        assert c.info()["num_seqs"] == 50
    assert_same_epoch(got, want)


def test_an_address_where_nothing_answers_says_why(tmp_path):
    """ZeroMQ connects in the background and never says why nothing answers: the error does."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    cases = [
        (f"tcp://127.0.0.1:{free_port()}", "nothing listens on 127.0.0.1:"),
        (f"ipc://{tmp_path}/gone.sock", f"no socket file at {tmp_path}/gone.sock"),
        (f"tcp://127.0.0.1:{listening.getsockname()[1]}", "takes connections but did not answer as a ppserver"),
    ]
    try:
        for address, why in cases:
            with ppclient.Client(address, timeout=0.5) as c:
                with pytest.raises(ppclient.ServerUnavailable, match="no answer from") as info:
                    c.info()
            assert why in str(info.value), address
    finally:
        listening.close()


def test_a_request_refused_for_clients_that_close_meanwhile_goes_through_and_a_real_conflict_still_fails(server):
    """A client's close comes over its own connection, which the server may read after another
    client's request: such a request is refused for a client that is already gone. The client asks
    again for JOB_REFUSAL_GRACE_S, so a script that closes one job and starts another goes on; a
    job whose client stays is refused all the same, once the grace has passed."""
    srv, _ = server
    first = ppclient.Client(srv.address, job="first", timeout=30)
    try:
        it = first.epoch(1)
        next(it)  # job "first" has a live client
        with ppclient.Client(srv.address, job="second", timeout=30) as other:
            began = time.monotonic()
            with pytest.raises(ppclient.Error, match="job 'first' is running with 1 live client"):
                other.epoch(1)
            assert time.monotonic() - began >= JOB_REFUSAL_GRACE_S  # asked again until the grace ended
        closing = threading.Timer(0.1, first.close)  # the first job ends while the next one asks
        closing.start()
        with ppclient.Client(srv.address, job="second", timeout=30) as other:
            got = collect(other.epoch(1))
        closing.join(timeout=10)
        assert [s["seq_tag"] for s in got] == [f"seq-{i}" for i in range(50)]
    finally:
        first.close()
