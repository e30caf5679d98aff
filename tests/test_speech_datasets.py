"""Audio corpora as they are (NeMo manifests, Lhotse cuts, saved Hugging Face datasets) and text keys
of any width: each against its own library's reading of the same corpus, and through a real server."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
from conftest import REPO, collect, run_cli, run_server, write_config

from ppserver.datasets import NumpyDataset, make_dataset, save_npz
from ppserver.datasets.audiofiles import read_audio, region_bytes
from ppserver.errors import ConfigError

sf = pytest.importorskip("soundfile")

RATE = 16000


def tone(seconds: float, freq: float) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def decode(seq: Dict) -> np.ndarray:
    """What a worker's decoder does with a seq: the region of `audio` at `offset` for `duration`."""
    with sf.SoundFile(io.BytesIO(seq["audio"].tobytes())) as f:
        f.seek(int(np.floor(float(seq["offset"]) * f.samplerate + 0.5)))
        return f.read(int(np.floor(float(seq["duration"]) * f.samplerate + 0.5)), dtype="float32")


@pytest.fixture
def corpus(tmp_path) -> Dict[str, np.ndarray]:
    """FLAC and WAV files in tmp_path/audio and their signals, by file name."""
    (tmp_path / "audio").mkdir()
    signals = {}
    for i, seconds in enumerate((0.7, 0.3, 1.1, 0.5)):
        name = f"u{i}.flac"
        signals[name] = tone(seconds, 200 + 90 * i)
        sf.write(tmp_path / "audio" / name, signals[name], RATE, subtype="PCM_16")
    signals["long.wav"] = tone(3.0, 330)
    sf.write(tmp_path / "audio" / "long.wav", signals["long.wav"], RATE, subtype="PCM_16")
    return {k: sf.read(tmp_path / "audio" / k, dtype="float32")[0] for k in signals}  # as 16-bit samples


def write_manifest(path, lines: List[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def nemo_corpus(tmp_path) -> List[str]:
    """Two manifests in different folders, paths relative to each, regions of one long WAV."""
    first = write_manifest(
        tmp_path / "m1.jsonl",
        [
            {"audio_filepath": "audio/u0.flac", "duration": 0.7, "text": "the first one"},
            {"audio_filepath": "audio/u1.flac", "duration": 0.3, "text": "short"},
            {"audio_filepath": "audio/long.wav", "offset": 0.5, "duration": 1.25, "text": "a region"},
        ],
    )
    second = write_manifest(
        tmp_path / "sub" / "m2.jsonl",
        [
            {"audio_filepath": "../audio/u2.flac", "duration": 1.1, "text": "the longest text of them all", "id": "x2"},
            {"audio_filepath": "../audio/long.wav", "offset": 2.0, "duration": 0.9, "text": "b"},
            {"audio_filepath": str(tmp_path / "audio" / "u3.flac"), "duration": 0.5, "text": "absolute"},
        ],
    )
    return [first, second]


WANT = [  # (tag, file, offset, duration, text) of nemo_corpus, in corpus order
    ("audio/u0.flac", "u0.flac", 0.0, 0.7, "the first one"),
    ("audio/u1.flac", "u1.flac", 0.0, 0.3, "short"),
    ("audio/long.wav@0.5", "long.wav", 0.5, 1.25, "a region"),
    ("x2", "u2.flac", 0.0, 1.1, "the longest text of them all"),
    ("../audio/long.wav@2", "long.wav", 2.0, 0.9, "b"),
]


def region(signal: np.ndarray, offset: float, duration: float) -> np.ndarray:
    start = int(np.floor(offset * RATE + 0.5))
    return signal[start : start + int(np.floor(duration * RATE + 0.5))]


@pytest.mark.unit
def test_nemo_manifests_relative_paths_offsets_and_several_files(tmp_path, corpus):
    ds = make_dataset({"class": "AudioManifest", "manifest": nemo_corpus(tmp_path)})
    assert ds.total_num_seqs == 6
    assert ds.data_keys() == {
        "audio": {"shape": [None], "dtype": "uint8"},
        "text": {"shape": [], "dtype": "string"},
        "offset": {"shape": [], "dtype": "float64"},
        "duration": {"shape": [], "dtype": "float64"},
    }
    np.testing.assert_array_equal(ds.seq_durations(), [0.7, 0.3, 1.25, 1.1, 0.9, 0.5])
    np.testing.assert_array_equal(ds.seq_lens(), [70, 30, 125, 110, 90, 50])  # 10 ms frames
    ds.init_seq_order(1)
    for pos, (tag, name, offset, duration, text) in enumerate(WANT):
        seq = ds.get_seq(pos)
        assert (seq["seq_tag"], str(seq["text"]), float(seq["duration"])) == (tag, text, duration)
        assert seq["audio"].dtype == np.uint8 and seq["audio"].ndim == 1
        np.testing.assert_array_equal(decode(seq), region(corpus[name], offset, duration))
    whole = (tmp_path / "audio" / "long.wav").stat().st_size
    assert ds.get_seq(2)["audio"].size < whole / 2  # a WAV region travels alone, with its offset 0
    assert float(ds.get_seq(2)["offset"]) == 0.0
    assert ds.get_seq(0)["audio"].tobytes() == (tmp_path / "audio" / "u0.flac").read_bytes()  # FLAC: whole
    assert ds.get_seq(5)["seq_tag"].endswith("audio/u3.flac")


@pytest.mark.unit
def test_orders_and_up_front_lengths_follow_the_durations_not_the_text(tmp_path, corpus):
    ds = make_dataset({"class": "AudioManifest", "manifest": nemo_corpus(tmp_path), "seq_ordering": "sorted"})
    ds.init_seq_order(1)
    durations = [float(ds.get_seq(p)["duration"]) for p in range(ds.num_seqs)]
    assert durations == sorted(durations) and durations != sorted(durations, key=lambda d: -d)
    np.testing.assert_array_equal(ds.epoch_lengths("audio"), [30, 50, 70, 90, 110, 125])
    assert ds.epoch_lengths("text") is None
    laplace = make_dataset({"class": "AudioManifest", "manifest": nemo_corpus(tmp_path), "seq_ordering": "laplace:2"})
    laplace.init_seq_order(1)
    lens = laplace.seq_lens()[laplace.order]
    assert list(lens[:3]) == sorted(lens[:3]) and list(lens[3:]) == sorted(lens[3:], reverse=True)


@pytest.mark.unit
def test_a_bad_manifest_line_is_one_line_naming_file_line_and_key(tmp_path):
    good = {"audio_filepath": "a.flac", "duration": 1.0, "text": "x"}
    for line, message in (
        ({"audio_filepath": "a.flac", "text": "x"}, "m.jsonl:2: no 'duration'"),
        ({"duration": 1.0, "text": "x"}, "m.jsonl:2: no 'audio_filepath'"),
        ({**good, "duration": "long"}, "m.jsonl:2: 'duration' must be a number of seconds"),
        ({**good, "offset": -1}, "m.jsonl:2: 'offset' must be a number of seconds"),
        ({**good, "text": 3}, "m.jsonl:2: 'text' must be a string"),
    ):
        path = write_manifest(tmp_path / "m.jsonl", [good, line])
        with pytest.raises(ConfigError, match="config key 'manifest'") as err:
            make_dataset({"class": "AudioManifest", "manifest": path})
        assert message in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "m.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"m\.jsonl:2: not a JSON object"):
        make_dataset({"class": "AudioManifest", "manifest": str(tmp_path / "m.jsonl")})
    write_manifest(tmp_path / "m.jsonl", [good, good])
    with pytest.raises(ConfigError, match=r"seq tag 'a\.flac' occurs twice"):
        make_dataset({"class": "AudioManifest", "manifest": str(tmp_path / "m.jsonl")})
    with pytest.raises(ConfigError, match="cannot read"):
        make_dataset({"class": "AudioManifest", "manifest": str(tmp_path / "none.jsonl")})
    with pytest.raises(ConfigError, match="config key 'read_in'"):
        make_dataset({"class": "AudioManifest", "manifest": str(tmp_path / "m.jsonl"), "read_in": "client"})


@pytest.mark.unit
def test_wav_regions_are_cut_by_bytes_and_read_in_workers_gives_the_same(tmp_path, corpus):
    path = str(tmp_path / "audio" / "long.wav")
    for offset, duration in ((0.0, 0.5), (1.2345, 0.77), (2.5, 5.0)):  # the last one runs past the end
        data, new_offset = region_bytes(path, offset, duration)
        assert new_offset == 0.0
        got, rate = sf.read(io.BytesIO(data.tobytes()), dtype="float32")
        assert rate == RATE
        np.testing.assert_array_equal(got, region(corpus["long.wav"], offset, duration))
        from_bytes, _ = region_bytes((tmp_path / "audio" / "long.wav").read_bytes(), offset, duration)
        np.testing.assert_array_equal(from_bytes, data)
    ds = make_dataset({"class": "AudioManifest", "manifest": nemo_corpus(tmp_path), "read_in": "workers"})
    assert ds.data_keys()["audio_path"] == {"shape": [], "dtype": "string"}
    ds.init_seq_order(1)
    for pos, (_, name, offset, duration, _) in enumerate(WANT):
        seq = ds.get_seq(pos)
        assert "audio" not in seq and os.path.samefile(str(seq["audio_path"]), tmp_path / "audio" / name)
        np.testing.assert_array_equal(decode(read_audio(seq)), region(corpus[name], offset, duration))
    np.testing.assert_array_equal(ds.epoch_lengths("audio_path"), ds.seq_lens())


@pytest.mark.unit
def test_text_keys_of_any_width_in_any_position():
    seqs = [
        {"text": np.array("a" * 39), "data": np.zeros((3, 2), np.float32)},
        {"text": np.array("b" * 33), "data": np.zeros((5, 2), np.float32)},
    ]
    ds = NumpyDataset(seqs=seqs, seq_ordering="sorted_reverse")
    assert ds.data_keys()["text"] == {"shape": [], "dtype": "string"}
    np.testing.assert_array_equal(ds.seq_lens(), [3, 5])  # "data", not the text
    words = [{"words": np.array(["x" * (i + 1)] * (i + 2)), "audio": np.zeros(10 - i, np.uint8)} for i in range(3)]
    ds = NumpyDataset(seqs=words)  # text first, no "data": the first key that is not text measures
    np.testing.assert_array_equal(ds.seq_lens(), [10, 9, 8])
    ds.init_seq_order(1)
    np.testing.assert_array_equal(ds.epoch_lengths("audio"), [10, 9, 8])
    assert ds.data_keys()["words"] == {"shape": [None], "dtype": "string"}
    with pytest.raises(ConfigError, match="seq 1 key 'words': dtype int64 ndim 1, expected dtype <U1"):
        NumpyDataset(seqs=[words[0], {"words": np.arange(3), "audio": np.zeros(3, np.uint8)}])


@pytest.mark.processes
def test_text_keys_of_differing_widths_through_a_real_server(tmp_path):
    seqs = [
        {
            "text": np.array("word " * (i + 1)),
            "data": np.full((i + 2, 3), i, np.float32),
            "names": np.array(["n"] * i, dtype=str),
        }
        for i in range(5)
    ]
    npz = str(tmp_path / "strings.npz")
    save_npz(npz, seqs)
    cfg = write_config(
        tmp_path,
        f"""
        import numpy as np
        dataset = {{"class": "NumpyDataset", "path": {npz!r}, "seq_ordering": "sorted_reverse"}}
        map_seq = lambda seq, **kwargs: {{**seq, "text": np.array(str(seq["text"]) + "!")}}
        """,
    )
    with run_server(cfg, workers=2) as srv:
        with srv.client() as c:
            assert c.info()["data_keys"]["text"] == {"shape": [], "dtype": "string"}
            got = collect(c.epoch(1))
        with srv.client(batching={"max_seqs": 2}, job="batched") as c:
            it = c.epoch(1)
            assert len(it) == 3
            batches = collect(it)
    assert [str(s["text"]) for s in got] == ["word " * (i + 1) + "!" for i in range(4, -1, -1)]
    assert [s["names"].tolist() for s in got] == [["n"] * i for i in range(4, -1, -1)]
    assert [b["text"] for b in batches] == [  # string keys: a list, one str per seq
        ["word " * 5 + "!", "word " * 4 + "!"],
        ["word " * 3 + "!", "word " * 2 + "!"],
        ["word !"],
    ]


@pytest.mark.processes
def test_an_audio_manifest_through_a_real_server(tmp_path, corpus):
    manifests = nemo_corpus(tmp_path)
    cfg = write_config(
        tmp_path,
        f"""
        dataset = {{"class": "AudioManifest", "manifest": {manifests!r}, "seq_ordering": "sorted"}}
        map_seq = lambda seq, **kwargs: seq
        """,
    )
    by_tag = {tag: (name, offset, duration) for tag, name, offset, duration, _ in WANT}
    batching = {"max_frames": 200}  # 2 s of padded audio per batch
    with run_server(cfg, workers=2) as srv:
        with srv.client() as c:
            assert c.info()["num_seqs"] == 6
            it = c.epoch(1)
            assert len(it) == 6
            got = collect(it)
        with srv.client(batching=batching, job="batched") as c:
            it = c.epoch(1)
            assert len(it) == 4  # known up front: [30, 50], [70, 90], [110], [125]
            batches = collect(it)
            status = c.status()
    durations = [float(s["duration"]) for s in got]
    assert durations == sorted(durations) == [0.3, 0.5, 0.7, 0.9, 1.1, 1.25]
    for seq in got:
        if seq["seq_tag"] in by_tag:
            name, offset, duration = by_tag[seq["seq_tag"]]
            np.testing.assert_array_equal(decode(seq), region(corpus[name], offset, duration))
    assert [b["duration"].tolist() for b in batches] == [[0.3, 0.5], [0.7, 0.9], [1.1], [1.25]]
    assert [b["seq_tag"] for b in batches] == [
        [s["seq_tag"] for s in got][i:j] for i, j in ((0, 2), (2, 4), (4, 5), (5, 6))
    ]
    assert (status["num_seqs"], status["seqs_delivered"]) == (4, 4)  # `ppserver status`: "4/4", not "1/?"


@pytest.mark.torch  # lhotse imports torch
@pytest.mark.sockets  # its file backends import urllib3, which opens a socket to probe for IPv6
def test_lhotse_cuts_against_lhotse(tmp_path, corpus):
    """Lhotse's own load_audio() of each cut against decoding the bytes the dataset sends."""
    lhotse = pytest.importorskip("lhotse")
    long = lhotse.Recording.from_file(str(tmp_path / "audio" / "long.wav"))
    flac = lhotse.Recording.from_file(str(tmp_path / "audio" / "u2.flac"), recording_id="u2")
    cuts = []
    for i in range(10):  # a long WAV recording cut into many regions: each travels alone
        start, duration = 0.29 * i, 0.2 + 0.01 * i
        cuts.append(cut(lhotse, f"long-{i}", long, start, duration, [f"word{i}", "more"]))
    for i, (start, duration) in enumerate(((0.0, 0.4), (0.35, 0.5), (0.9, 0.2))):
        cuts.append(cut(lhotse, f"flac-{i}", flac, start, duration, [f"f{i}"]))
    path = tmp_path / "cuts.jsonl.gz"
    lhotse.CutSet.from_cuts(cuts).to_file(path)

    ds = make_dataset({"class": "LhotseCuts", "cuts": str(path)})
    theirs = lhotse.load_manifest_lazy(path)
    ds.init_seq_order(1)
    assert ds.num_seqs == len(cuts)
    np.testing.assert_allclose(ds.seq_durations(), [c.duration for c in cuts])
    whole = (tmp_path / "audio" / "long.wav").stat().st_size
    for pos, ref in enumerate(theirs):
        seq = ds.get_seq(pos)
        assert seq["seq_tag"] == ref.id
        assert str(seq["text"]) == " ".join(s.text for s in ref.supervisions)
        np.testing.assert_array_equal(decode(seq)[None, :], ref.load_audio())
        if ref.id.startswith("long"):
            assert seq["audio"].size < whole / 5
    workers = make_dataset({"class": "LhotseCuts", "cuts": str(path), "read_in": "workers"})
    workers.init_seq_order(1)
    for pos, ref in enumerate(theirs):
        seq = workers.get_seq(pos)
        assert "audio" not in seq and seq["audio_path"].dtype.kind == "U"
        np.testing.assert_array_equal(decode(read_audio(seq))[None, :], ref.load_audio())
    lhotse.CutSet.from_cuts([cuts[0], cuts[1].perturb_speed(1.1)]).to_file(tmp_path / "fast.jsonl.gz")
    with pytest.raises(ConfigError, match=r"config key 'cuts': cut '.*long-1.*': its recording has transforms"):
        make_dataset({"class": "LhotseCuts", "cuts": str(tmp_path / "fast.jsonl.gz")})
    sf.write(tmp_path / "stereo.wav", np.stack([corpus["u1.flac"]] * 2, axis=1), RATE)
    stereo = lhotse.Recording.from_file(str(tmp_path / "stereo.wav"))
    lhotse.CutSet.from_cuts([cut(lhotse, "st", stereo, 0.0, 0.2, ["x"])]).to_file(tmp_path / "stereo.jsonl.gz")
    with pytest.raises(ConfigError, match="config key 'cuts': cut 'st': its recording has 2 channels, not 1"):
        make_dataset({"class": "LhotseCuts", "cuts": str(tmp_path / "stereo.jsonl.gz")})
    with pytest.raises(ConfigError, match="config key 'cuts': no such file"):
        make_dataset({"class": "LhotseCuts", "cuts": str(tmp_path / "none.jsonl.gz")})


def cut(lhotse, cut_id: str, recording, start: float, duration: float, words: List[str]):
    sups = [
        lhotse.SupervisionSegment(id=f"{cut_id}-{j}", recording_id=recording.id, start=start, duration=duration, text=w)
        for j, w in enumerate(words)
    ]
    return lhotse.MonoCut(id=cut_id, start=start, duration=duration, channel=0, recording=recording, supervisions=sups)


@pytest.mark.torch  # datasets imports torch where it is installed
def test_hugging_face_audio_against_datasets(tmp_path, corpus):
    """datasets' own reading of its undecoded rows against the bytes the dataset sends (datasets
    decodes through torchcodec, not installed here: both are decoded with soundfile), and both
    against the signals written."""
    datasets = pytest.importorskip("datasets")
    names = ["u0.flac", "u1.flac", "u2.flac", "long.wav"]
    rows = {
        "audio": [str(tmp_path / "audio" / n) for n in names],
        "transcript": [f"text {n}" for n in names],
        "id": [f"utt-{i}" for i in range(len(names))],
        "seconds": [1.5, 2.5, 0.25, 3.0],
    }
    table = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio())
    datasets.DatasetDict({"train": table, "dev": table.select([1])}).save_to_disk(str(tmp_path / "hf"))

    ds = make_dataset({"class": "HFAudio", "path": str(tmp_path / "hf"), "split": "train", "text_column": "transcript"})
    np.testing.assert_allclose(ds.seq_durations(), [len(corpus[n]) / RATE for n in names])  # from the headers
    theirs = datasets.load_from_disk(str(tmp_path / "hf"))["train"].cast_column("audio", datasets.Audio(decode=False))
    ds.init_seq_order(1)
    for pos, name in enumerate(names):
        seq, row = ds.get_seq(pos), theirs[pos]
        assert (seq["seq_tag"], str(seq["text"])) == (row["id"], row["transcript"])
        ref, _ = sf.read(io.BytesIO(row["audio"]["bytes"]), dtype="float32")
        np.testing.assert_array_equal(decode(seq), ref)
        np.testing.assert_array_equal(ref, corpus[name])
    dev = make_dataset({"class": "HFAudio", "path": str(tmp_path / "hf"), "split": "dev", "text_column": "transcript"})
    assert dev.total_num_seqs == 1 and dev.data_keys()["audio"]["dtype"] == "uint8"
    spec = {"class": "HFAudio", "path": str(tmp_path / "hf"), "split": "train", "text_column": "transcript"}
    told = make_dataset({**spec, "duration_column": "seconds", "seq_ordering": "sorted"})
    np.testing.assert_array_equal(told.seq_durations(), [1.5, 2.5, 0.25, 3.0])  # the column's, not the headers'
    told.init_seq_order(1)
    assert [told.get_seq(p)["seq_tag"] for p in range(4)] == ["utt-2", "utt-0", "utt-1", "utt-3"]
    with pytest.raises(ConfigError, match="config key 'split': must be one of \\['dev', 'train'\\]"):
        make_dataset({"class": "HFAudio", "path": str(tmp_path / "hf"), "split": "test"})
    with pytest.raises(ConfigError, match="config key 'text_column': 'text' is not a column"):
        make_dataset({"class": "HFAudio", "path": str(tmp_path / "hf"), "split": "train"})
    with pytest.raises(ConfigError, match="config key 'read_in': 'workers' needs files"):
        make_dataset(
            {
                "class": "HFAudio",
                "path": str(tmp_path / "hf"),
                "split": "dev",
                "text_column": "transcript",
                "read_in": "workers",
            }
        )


@pytest.mark.unit
def test_compressed_recordings_shared_by_seqs_are_named_once_and_missing_libraries_in_one_line(
    tmp_path, corpus, caplog, monkeypatch
):
    lines = [{"audio_filepath": "audio/u2.flac", "offset": o, "duration": 0.2, "text": "x"} for o in (0, 0.3, 0.6)]
    lines += [{"audio_filepath": "audio/long.wav", "offset": o, "duration": 0.2, "text": "y"} for o in (0, 1)]
    path = write_manifest(tmp_path / "m.jsonl", lines)
    with caplog.at_level("WARNING", logger="ppserver.dataset"):
        make_dataset({"class": "AudioManifest", "manifest": path})
        make_dataset({"class": "AudioManifest", "manifest": path, "read_in": "workers"})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("3 seqs are regions of 1 compressed recordings (e.g. /")
    assert "u2.flac" in warnings[0] and "long.wav" not in warnings[0]
    for name, spec, extra in (
        ("lhotse", {"class": "LhotseCuts", "cuts": path}, "lhotse"),
        ("datasets", {"class": "HFAudio", "path": str(tmp_path)}, "hf"),
    ):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
        with pytest.raises(ConfigError, match=rf"needs {name}: pip install 'ppserver\[{extra}\]'"):
            make_dataset(spec)


@pytest.mark.unit
def test_the_worked_example_of_docs_datasets_md(tmp_path, monkeypatch):
    text = (Path(REPO) / "docs" / "datasets.md").read_text()
    example = re.search(r"## A worked example.*?```python\n(.*?)```", text, re.S)
    assert example is not None
    (tmp_path / "mycorpus.py").write_text(example.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    frames = [7, 3, 5]
    for i, n in enumerate(frames):
        np.save(tmp_path / f"f{i}.npy", np.full((n, 4), i, np.float32))
    (tmp_path / "train.lst").write_text("".join(f"utt{i} {tmp_path / f'f{i}.npy'}\n" for i in range(3)))
    ds = make_dataset({"class": "mycorpus:NpyList", "listing": str(tmp_path / "train.lst"), "seq_ordering": "sorted"})
    assert ds.data_keys() == {"data": {"shape": [None, 4], "dtype": "float32"}}
    ds.init_seq_order(1)
    assert [ds.get_seq(p)["seq_tag"] for p in range(3)] == ["utt1", "utt2", "utt0"]
    np.testing.assert_array_equal(ds.epoch_lengths("data"), [3, 5, 7])
    np.testing.assert_array_equal(ds.get_seq(2)["data"], np.zeros((7, 4), np.float32))
    with pytest.raises(ConfigError, match="config key 'listing': cannot read"):
        make_dataset({"class": "mycorpus:NpyList", "listing": str(tmp_path / "none.lst")})


@pytest.mark.processes
def test_ppserver_serve_with_a_bad_manifest_line_exits_2_with_one_line(tmp_path):
    good = {"audio_filepath": "a.flac", "duration": 1.0, "text": "x"}
    manifest = write_manifest(tmp_path / "train.jsonl", [good, {"audio_filepath": "b.flac", "text": "y"}])
    cfg = write_config(
        tmp_path, f'dataset = {{"class": "AudioManifest", "manifest": {manifest!r}}}\nmap_seq = lambda seq, **kw: seq\n'
    )
    res = run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0", timeout=60)
    lines = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "config key 'manifest'" in lines[0] and "train.jsonl:2: no 'duration'" in lines[0]
