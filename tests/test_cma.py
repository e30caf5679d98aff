"""Workers on the server's host read their inputs in the server's memory (process_vm_readv):
the reader itself, then the whole path through real processes, its fallback and its failure."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import (
    REPO,
    SCALE_MAPPER,
    assert_same_epoch,
    collect,
    numpy_config,
    read,
    reference,
    run_server,
    sitecustomize_env,
)

from ppclient import protocol
from ppserver.transport import cma

pytestmark = pytest.mark.skipif(cma.available() is not None, reason=str(cma.available()))

MAPPER = SCALE_MAPPER


@pytest.mark.unit
def test_a_reader_copies_spans_of_a_process_into_new_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int64)
    spans = [(x.ctypes.data, x.nbytes) for x in (a, b)]
    got = cma.Reader(os.getpid()).read(spans, [a.dtype, b.dtype], [a.shape, b.shape])
    assert [g.tolist() for g in got] == [a.tolist(), b.tolist()]
    assert all(g.flags.writeable and g.ctypes.data not in (a.ctypes.data, b.ctypes.data) for g in got)
    with pytest.raises(OSError, match="Bad address"):
        cma.Reader(os.getpid()).read([(8, 40)], [np.uint8], [(40,)])
    with pytest.raises(ValueError, match="span"):
        cma.Reader(os.getpid()).read([(a.ctypes.data, 4)], [a.dtype], [a.shape])


@pytest.mark.processes
def test_another_process_reads_the_token_of_an_offer():
    """The check a worker makes: its parent's token read back; a wrong token or pid is a reason."""
    token = np.frombuffer(os.urandom(32), np.uint8).copy()
    offer = cma.offer(token)
    code = (
        "import json, sys; from ppserver.transport import cma; "
        "print(cma.check_offer(json.loads(sys.argv[1]))[1] or None)"
    )
    import json

    def check(o) -> str:
        argv = [sys.executable, "-c", code, json.dumps(o)]
        out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
        return out.stdout.strip() or out.stderr

    assert check(offer) == "None"
    assert "other bytes" in check({**offer, "token": bytes(32).hex()})
    assert "No such process" in check({**offer, "pid": 2**22 + 17})
    assert "malformed" in check({"pid": 1})


@pytest.mark.unit
def test_items_by_address_check_and_resolve():
    """An item naming its arrays by address: checked like any item, then read into arrays."""
    seq = {"data": np.arange(6, dtype=np.float32).reshape(2, 3), "seq_tag": "s0", "seq_idx": 0}
    item = protocol.seq_to_item(seq, 0)
    (by_address,) = protocol.to_spans([item])
    frames = protocol.encode(protocol.Tasks(run=1), [by_address])
    assert len(frames) == 1  # the header only
    decoded = protocol.decode(frames, protocol.Peer.WORKER, (protocol.Channel.WORKER,))
    assert decoded.bad == [] and decoded.items[0].spans == by_address.spans
    assert cma.resolve_spans(decoded.items, cma.Reader(os.getpid())) == []
    assert protocol.item_to_seq(decoded.items[0])["data"].tolist() == seq["data"].tolist()
    # a span of the wrong size, spans beside frames, no reader: bad items, never arrays
    header = protocol.wire.unpack(frames[0])
    header["items"][0]["m"][0][1] = 8
    bad = protocol.decode([protocol.wire.pack(header)], protocol.Peer.WORKER, (protocol.Channel.WORKER,))
    assert bad.items == [] and "spans 8 bytes" in bad.bad[0].reason
    header["items"][0]["m"][0][1] = 24
    both = protocol.decode([protocol.wire.pack(header), b"x" * 24], protocol.Peer.WORKER, (protocol.Channel.WORKER,))
    assert both.items == [] and both.bad
    decoded = protocol.decode(frames, protocol.Peer.WORKER, (protocol.Channel.WORKER,))
    lost = cma.resolve_spans(decoded.items, None)
    assert decoded.items == [] and [b.pos for b in lost] == [0]
    assert protocol.to_spans([protocol.seq_to_item({"x": np.arange(4)[::2]}, 0)]) is not None  # made contiguous


@pytest.mark.processes
def test_local_workers_read_their_inputs_in_the_servers_memory(tmp_path):
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, MAPPER, n=80, extra="buf_size = 4\n")
    with run_server(cfg, workers=2, log_path=log_path) as srv, srv.client() as c:
        got = [collect(c.epoch(e)) for e in (1, 2)]
        status = c.status()
    for e in (1, 2):
        assert_same_epoch(got[e - 1], reference(cfg, e))
    log = read(log_path)
    assert log.count("reads its inputs in the server's memory") == 2
    assert status["lost_inputs"] == 0


@pytest.mark.processes
def test_where_memory_cannot_be_read_inputs_come_through_the_segment(tmp_path):
    """A worker whose check fails (as under a ptrace restriction) says why and uses its segment."""
    env = sitecustomize_env(
        tmp_path,
        """
        import ppserver.transport.cma
        ppserver.transport.cma.check_offer = lambda offer: (None, "not permitted here (test)")
        """,
    )
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, MAPPER, n=60, extra="buf_size = 4\n")
    with run_server(cfg, workers=2, log_path=log_path, env=env) as srv, srv.client() as c:
        got = collect(c.epoch(1))
    assert_same_epoch(got, reference(cfg, 1))
    log = read(log_path)
    assert "reads its inputs in the server's memory" not in log
    assert log.count("inputs come through the server's shared memory (reading its memory: not permitted") == 2


@pytest.mark.processes
def test_inputs_that_cannot_be_read_are_redone_and_travel_in_messages_after(tmp_path):
    """Reads that fail mid-epoch (the server's memory gone from under a worker): the worker
    reports the tasks, the server redoes them, and that worker gets its inputs in the messages
    from then on. The epoch is exact."""
    env = sitecustomize_env(
        tmp_path,
        """
        import ppserver.transport.cma
        _read = ppserver.transport.cma.Reader.read
        _calls = [0]
        def read(self, spans, dtypes, shapes):
            _calls[0] += 1
            if _calls[0] == 4:
                raise OSError(14, "Bad address (test)")
            return _read(self, spans, dtypes, shapes)
        ppserver.transport.cma.Reader.read = read
        """,
    )
    log_path = str(tmp_path / "server.log")
    cfg = numpy_config(tmp_path, MAPPER, n=80, extra="buf_size = 4\n")
    with run_server(cfg, workers=2, log_path=log_path, env=env) as srv, srv.client() as c:
        got = collect(c.epoch(1))
        status = c.status()
    assert_same_epoch(got, reference(cfg, 1))
    assert status["lost_inputs"] >= 1
    log = read(log_path)
    assert "could not read" in log and "Bad address (test)" in log
    assert "gets its inputs over the socket from now on" in log
