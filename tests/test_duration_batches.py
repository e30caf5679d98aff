"""Batches by duration (batching's max_duration, quadratic_duration): the cut against Lhotse's own
counting, and an audio corpus served in such batches through real processes."""

from __future__ import annotations

import json
import random
import warnings
import wave
from typing import List, Optional

import numpy as np
import pytest
from conftest import (
    STREAM_MAPPER,
    assert_same_batches,
    collect,
    numpy_config,
    reference_batches,
    run_cli,
    run_server,
    write_config,
)

import ppclient
from ppclient.batching import Batching
from ppserver.config.settings import from_settings
from ppserver.errors import ConfigError
from ppserver.scheduler.cut import Cutter, counted_seconds, cut_epoch


def padded_seconds(durations: List[float], q: Optional[float]) -> float:
    """A batch as Lhotse's TimeConstraint counts it: seqs x the longest counted duration."""
    return len(durations) * max(counted_seconds(d, q) for d in durations)


# ---- the cut ---------------------------------------------------------------------------------------
@pytest.mark.unit
def test_seconds_cap_the_padded_batch_and_quadratic_duration_counts_long_seqs_more():
    durations = [1.0, 9.5, 2.0, 2.0, 2.0, 3.0, 1.0]
    # 9.5 after 1.0 would be 2 x 9.5 s; a fourth seq of 3 s would be 4 x 3 s
    assert cut_epoch(None, Batching(max_duration=10.0), durations) == [[0], [1], [2, 3, 4], [5, 6]]
    assert cut_epoch(None, Batching(max_duration=10.0), [3.0, 3.0, 3.0]) == [[0, 1, 2]]  # 9 s
    # each counts 3 + 9/15 = 3.6 s: three are 10.8 s
    assert cut_epoch(None, Batching(max_duration=10.0, quadratic_duration=15.0), [3.0] * 3) == [[0, 1], [2]]
    assert cut_epoch(None, Batching(max_duration=10.0), [12.0, 1.0, 1.0]) == [[0], [1, 2]]  # alone over the cap
    # every cap holds: max_seqs, max_frames (lengths) and max_duration, whichever breaks first
    lengths = [10, 10, 10, 40, 10, 10]
    b = Batching(max_seqs=3, max_frames=60, max_duration=5.0)
    assert cut_epoch(lengths, b, [1.0, 1.0, 1.0, 1.0, 2.0, 1.0]) == [[0, 1, 2], [3], [4, 5]]
    assert cut_epoch(lengths, b, [1.0, 1.0, 2.0, 1.0, 1.0, 1.0]) == [[0, 1], [2], [3], [4, 5]]


@pytest.mark.unit
def test_windows_sort_by_duration_and_the_reading_cutter_agrees_with_the_whole_epochs():
    rnd = random.Random(11)
    for _ in range(300):
        n = rnd.randint(0, 60)
        durations = [round(rnd.uniform(0.0, 8.0), rnd.choice([1, 3, 6])) for _ in range(n)]
        lengths = [round(d * 100) for d in durations]
        b = Batching(
            max_seqs=rnd.choice([None, 3, 7]),
            max_frames=rnd.choice([None, 1500]),
            max_duration=rnd.choice([5.0, 12.5, 30.0]),
            quadratic_duration=rnd.choice([None, 15.0, 40.0]),
            bucket_window=rnd.randint(1, 9),
        )
        batches = cut_epoch(lengths, b, durations)
        cutter, streamed = Cutter(b), []
        for pos in range(n):
            got = cutter.add(pos, lengths[pos], durations[pos])
            assert all(p <= pos for batch in got for p in batch)  # only seqs already read
            streamed += got
        assert streamed + cutter.finish() == batches
        w = b.bucket_window
        windows = [sorted(range(s, min(s + w, n)), key=lambda p: durations[p]) for s in range(0, n, w)]
        assert [p for batch in batches for p in batch] == [p for window in windows for p in window]
        for batch, after in zip(batches, batches[1:] + [None]):
            seconds = padded_seconds([durations[p] for p in batch], b.quadratic_duration)
            assert seconds <= b.max_duration or len(batch) == 1
            assert sum(durations[p] for p in batch) <= b.max_duration or len(batch) == 1
            if after is not None:  # full: one more seq would break a cap
                grown = padded_seconds([durations[p] for p in batch + after[:1]], b.quadratic_duration)
                frames = (len(batch) + 1) * max(lengths[p] for p in batch + after[:1])
                assert (
                    len(batch) == b.max_seqs
                    or grown > b.max_duration
                    or (b.max_frames is not None and frames > b.max_frames)
                ), batch


@pytest.mark.torch  # lhotse imports torch
@pytest.mark.sockets  # its file backends import urllib3, which opens a socket to probe for IPv6
@pytest.mark.parametrize("quadratic", [None, 15.0, 40.0])
def test_the_cut_counts_seconds_as_lhotses_time_constraint_and_batches_as_its_duration_batcher(quadratic):
    """A greedy cut without buckets, against Lhotse's own code: a seq joins a batch exactly when
    TimeConstraint, given the batch and the seq, is not exceeded; and the batches are
    DurationBatcher's, except where Lhotse's batch goes over the cap by its last seq (a longer one,
    it decides on the longest so far): there that seq starts the next batch."""
    pytest.importorskip("lhotse")
    from lhotse import MonoCut
    from lhotse.dataset.sampling.base import TimeConstraint
    from lhotse.dataset.sampling.dynamic import DurationBatcher

    rnd = random.Random(3)
    max_duration, max_cuts = 60.0, 9
    spans = [(0.3, 4.0), (4.0, 16.0), (16.0, 70.0)]  # short, long and over the cap
    durations = [rnd.uniform(*rnd.choice(spans)) for _ in range(400)]
    cuts = [MonoCut(id=f"c{i}", start=0.0, duration=d, channel=0) for i, d in enumerate(durations)]
    b = Batching(max_seqs=max_cuts, max_duration=max_duration, quadratic_duration=quadratic)
    ours = cut_epoch(None, b, durations)
    assert [p for batch in ours for p in batch] == list(range(len(durations)))

    def constraint(positions: List[int]) -> TimeConstraint:
        tc = TimeConstraint(max_duration=max_duration, max_cuts=max_cuts, quadratic_duration=quadratic)
        for p in positions:
            tc.add(cuts[p])
        return tc

    overshoots = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lhotse warns of a single cut over max_duration: expected here
        for batch, after in zip(ours, ours[1:] + [None]):
            assert not constraint(batch).exceeded() or len(batch) == 1
            if after is not None:
                assert constraint(batch + after[:1]).exceeded()  # the next seq would break a cap
            theirs = [int(c.id[1:]) for c in next(iter(DurationBatcher(cuts[batch[0] :], **_caps(b))))]
            if constraint(theirs).exceeded() and len(theirs) > 1:
                overshoots += 1
                assert batch == theirs[:-1]
            else:
                assert batch == theirs
        # sorted longest first, no batch of Lhotse's goes over: the same batches throughout
        order = sorted(range(len(cuts)), key=lambda p: -durations[p])
        theirs_sorted = [[int(c.id[1:]) for c in cs] for cs in DurationBatcher([cuts[p] for p in order], **_caps(b))]
        ours_sorted = [[order[p] for p in batch] for batch in cut_epoch(None, b, [durations[p] for p in order])]
        assert ours_sorted == theirs_sorted
    assert overshoots > 0 and len(ours) > 40  # the random order did take both branches


def _caps(b: Batching) -> dict:
    return {"max_duration": b.max_duration, "max_cuts": b.max_seqs, "quadratic_duration": b.quadratic_duration}


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, message",
    [
        ({"max_duration": -1.0}, r"\['max_duration'\] must be a finite number of seconds > 0"),
        ({"max_duration": 0}, r"\['max_duration'\] must be a finite number of seconds > 0"),
        ({"max_duration": float("nan")}, r"\['max_duration'\] must be a finite number of seconds > 0 or None, got nan"),
        ({"max_duration": float("inf")}, r"\['max_duration'\] must be a finite number of seconds > 0 or None, got inf"),
        ({"max_duration": True}, r"\['max_duration'\] must be a finite number of seconds > 0 or None, got True"),
        ({"max_duration": "600"}, r"\['max_duration'\] must be a finite number of seconds > 0"),
        ({"max_duration": 10**400}, r"\['max_duration'\] must be a finite number of seconds > 0"),
        ({"max_duration": 600, "quadratic_duration": 0.0}, r"\['quadratic_duration'\] must be a finite number"),
        ({"max_seqs": 8, "quadratic_duration": 30}, r"\['quadratic_duration'\] counts toward max_duration"),
    ],
)
def test_bad_durations_are_one_line_naming_the_key(value, message):
    with pytest.raises(ppclient.UsageError, match=message) as info:
        Batching.from_dict(value)
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_the_canonical_dict_carries_the_durations_only_where_max_duration_is_set():
    plain = Batching.from_dict({"max_seqs": 4})
    assert "max_duration" not in plain.to_dict()  # travels as before
    timed = Batching.from_dict({"max_duration": 600, "quadratic_duration": 30, "bucket_window": 64})
    assert timed.to_dict()["max_duration"] == 600.0 and isinstance(timed.to_dict()["max_duration"], float)
    assert Batching.from_dict(timed.to_dict()) == timed
    assert timed.describe() == "max_duration 600 s, quadratic_duration 30 s, bucket_window 64"


@pytest.mark.unit
def test_a_config_with_max_duration_and_map_seq_stream_or_a_bad_value_is_one_line():
    def stream(seqs, **kwargs):
        return seqs

    dataset = {"class": "DemoDataset", "num_seqs": 4}
    with pytest.raises(ConfigError, match=r"'batching': \['max_duration'\] is for map_seq only") as info:
        from_settings({"dataset": dataset, "map_seq_stream": stream, "batching": {"max_duration": 60.0}})
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="'batch_duration': only with map_seq"):
        from_settings({"dataset": dataset, "map_seq_stream": stream, "batch_duration": lambda seq: 1.0})
    with pytest.raises(ConfigError, match="'batch_duration': must be a function seq -> float"):
        from_settings({"dataset": dataset, "map_seq": lambda seq, **kw: seq, "batch_duration": 3.0})
    for bad in (-600.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match=r"'batching': \['max_duration'\] must be a finite number") as info:
            from_settings({"dataset": dataset, "map_seq": lambda seq, **kw: seq, "batching": {"max_duration": bad}})
        assert "\n" not in str(info.value)


# ---- through real processes ----------------------------------------------------------------------------
RATE = 8000
CAP = {"max_duration": 4.0, "quadratic_duration": 20.0, "bucket_window": 8}


def wav_corpus(tmp_path, n: int = 40) -> List[float]:
    """n WAV files of 0.2 to 2.5 s (one of 5 s: over the cap alone) and a NeMo manifest of them."""
    rnd = np.random.RandomState(5)
    durations = [round(float(d), 3) for d in rnd.uniform(0.2, 2.5, size=n)]
    durations[7] = 5.0
    (tmp_path / "audio").mkdir()
    lines = []
    for i, seconds in enumerate(durations):
        samples = (rnd.randn(round(seconds * RATE)) * 3000).astype("<i2")
        with wave.open(str(tmp_path / "audio" / f"u{i:02d}.wav"), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(RATE)
            f.writeframes(samples.tobytes())
        lines.append({"audio_filepath": f"audio/u{i:02d}.wav", "duration": seconds, "text": f"utterance {i}"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return durations


SPEECH = """
dataset = {{"class": "AudioManifest", "manifest": {manifest!r}, "seq_ordering": "random"}}
def map_seq(seq, **kwargs):
    return seq
buf_size = 2
"""


@pytest.mark.processes
@pytest.mark.parametrize("workers", [1, 2])
def test_an_audio_manifest_served_in_batches_of_seconds_known_up_front_and_resumed_exactly(tmp_path, workers):
    wav_corpus(tmp_path)
    cfg = write_config(tmp_path, SPEECH.format(manifest=str(tmp_path / "train.jsonl")))
    want = reference_batches(cfg, 2, CAP)
    with run_server(cfg, workers=workers) as srv:
        with srv.client(batching=CAP, job="seconds") as c:
            it = c.epoch(2)
            assert len(it) == len(want)  # the manifest's durations: cut up front
            got = collect(it)
        with srv.client(batching=CAP, job="resumed") as c:
            it = c.epoch(2)
            first = [next(it) for _ in range(3)]
            state = it.state_dict()
        with srv.client(job="resumed") as c:  # the state carries its batching
            rest = c.epoch(state=state)
            assert len(rest) == len(want) - 3
            rest_got = collect(rest)
    assert_same_batches(got, want)  # the same batches for 1 and 2 workers: the reference's
    assert_same_batches(first + rest_got, want)
    assert state["batching"]["max_duration"] == 4.0
    singles = 0
    for batch in got:
        seconds = [float(d) for d in batch["duration"]]
        if len(seconds) == 1:
            singles += seconds[0] > CAP["max_duration"]
            continue
        assert sum(seconds) <= CAP["max_duration"]
        assert padded_seconds(seconds, CAP["quadratic_duration"]) <= CAP["max_duration"]
    assert singles == 1  # the 5 s seq, alone
    assert sorted(t for b in got for t in b["seq_tag"]) == sorted(f"audio/u{i:02d}.wav" for i in range(40))


DURATION_FN = """
def batch_duration(seq):
    return seq["data"].shape[0] / 20  # e.g. 50 ms frames
"""


@pytest.mark.processes
def test_max_duration_without_durations_is_refused_in_one_line_and_batch_duration_gives_them(tmp_path):
    mapper = "def map_seq(seq, **kwargs):\n    return seq\n"
    no_durations = numpy_config(tmp_path, mapper, n=30)
    with run_server(no_durations, workers=1) as srv, srv.client(batching={"max_duration": 10.0}) as c:
        with pytest.raises(ppclient.Error, match=r"max_duration'\] needs the seqs' durations: NumpyDataset") as e:
            c.epoch(1)
        assert "\n" not in str(e.value)
    # the same as the config's default: `ppserver serve` exits 2 with one line
    bad = numpy_config(tmp_path, mapper + "batching = {'max_duration': 10.0}\n", n=30, name="bad.py")
    proc = run_cli("serve", bad, "--bind", "tcp://127.0.0.1:0", "--workers", "0", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "needs the seqs' durations: NumpyDataset" in proc.stderr, proc.stderr
    # with batch_duration(seq) the reader measures each seq as it reads: the cut as the reference's
    timed = numpy_config(tmp_path, mapper + DURATION_FN, n=30, name="timed.py")
    batching = {"max_duration": 8.0, "max_seqs": 6, "bucket_window": 4}
    want = reference_batches(timed, 1, batching)
    with run_server(timed, workers=2) as srv, srv.client(batching=batching) as c:
        it = c.epoch(1)
        with pytest.raises(TypeError, match="not known in advance"):
            len(it)  # cut as read
        got = collect(it)
    assert_same_batches(got, want)
    assert all(len(b["seq_tag"]) * max(b["data:lengths"]) / 20 <= 8.0 or len(b["seq_tag"]) == 1 for b in got)


@pytest.mark.processes
def test_max_duration_with_map_seq_stream_is_refused_in_one_line(tmp_path):
    stream = numpy_config(tmp_path, STREAM_MAPPER.format(delay=0), n=10)
    with run_server(stream, workers=1) as srv, srv.client(batching={"max_duration": 10.0}) as c:
        with pytest.raises(ppclient.Error, match=r"max_duration'\] is for map_seq only") as e:
            c.epoch(1)
        assert "\n" not in str(e.value)


TIMED = """
import numpy as np
from ppserver.datasets import NumpyDataset


class Timed(NumpyDataset):
    def seq_durations(self):
        durations = np.full(self.total_num_seqs, 1.5)
        durations[{bad}] = {value}
        return durations
"""
TIMED_CONFIG = """
import numpy as np
dataset = {{"class": "timed:Timed", "seqs": [{{"data": np.zeros((n + 1, 2), "float32")}} for n in range(12)]}}
def map_seq(seq, **kwargs):
    return seq
{extra}
"""


@pytest.mark.processes
def test_a_bad_duration_fails_the_epoch_naming_where_it_came_from(tmp_path):
    (tmp_path / "timed.py").write_text(TIMED.format(bad=4, value="-1.0"))
    cfg = write_config(tmp_path, TIMED_CONFIG.format(extra=""))
    nan = write_config(
        tmp_path,
        TIMED_CONFIG.format(extra="def batch_duration(seq):\n    return float('nan') if len(seq['data']) == 5 else 1"),
        name="nan.py",
    )
    batching = {"max_duration": 6.0}
    with run_server(cfg, workers=1) as srv, srv.client(batching=batching) as c:
        with pytest.raises(ppclient.DatasetError, match=r"seq_durations\(\) gave -1.0 seconds for the epoch's seq 4"):
            collect(c.epoch(1))
    with run_server(nan, workers=1) as srv, srv.client(batching=batching) as c:
        with pytest.raises(ppclient.DatasetError, match=r"batch_duration\(seq\) must return a finite number of sec"):
            collect(c.epoch(1))
