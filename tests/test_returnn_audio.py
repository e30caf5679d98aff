"""An OggZipDataset's audio features computed in the workers: the server's reader sends the zip
members' encoded bytes, the workers compute RETURNN's features from them, and the seqs equal
those of RETURNN's own OggZipDataset reading the same zip (bit for bit)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
from conftest import collect, run_server
from returnn.datasets.basic import init_dataset

from ppserver.datasets import returnn_audio
from ppserver.datasets.returnn import ReturnnDataset

pytestmark = [
    pytest.mark.returnn,
    pytest.mark.processes,
    pytest.mark.usefixtures("in_temporary_cwd"),
]  # espeak-ng, servers

try:
    import librosa  # noqa: F401  (RETURNN's log-mel features need it; no extra installs it)

    HAVE_LIBROSA = True
except ImportError:
    HAVE_LIBROSA = False

RAW = {"features": "raw", "num_feature_filters": 1, "sample_rate": 16000, "join_frames": 160,
       "norm_mean": "per_seq", "norm_std_dev": "per_seq"}  # fmt: skip
LOG_MEL = {"features": "log_mel_filterbank", "num_feature_filters": 80, "window_len": 0.025, "step_len": 0.010,
           "norm_mean": 0.5, "norm_std_dev": 2.0}  # fmt: skip
PERMUTED = {**LOG_MEL, "random_permute": {"rnd_scale_lower": 0.5, "rnd_zoom_switch": 0.5,
                                          "rnd_stretch_switch": 0.0, "rnd_pitch_switch": 0.0}}  # fmt: skip
needs_librosa = pytest.mark.skipif(not HAVE_LIBROSA, reason="RETURNN's log-mel features need librosa")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Zips as OggZipDataset reads them (corpus.zip, and extra.zip for DistributeFilesDataset):
    speech from espeak-ng where it is installed, chirps and noise otherwise, as Ogg and FLAC
    members; each zip's .txt lists them. Its folder holds dfd.py, with a get_sub_epoch_dataset."""
    root = tmp_path_factory.mktemp("audio")
    rng = np.random.RandomState(3)
    _zip(root, "corpus", range(7), rng)
    _zip(root, "extra", range(7, 10), rng)
    (root / "dfd.py").write_text(DFD)
    sys.path.insert(0, str(root))
    yield str(root / "corpus.zip")
    sys.path.remove(str(root))


DFD = """
def oggzips(audio):
    def get_sub_epoch_dataset(files):
        zips = {"class": "OggZipDataset", "path": files, "audio": audio, "targets": None, "seq_ordering": "random"}
        return {"class": "MetaDataset", "datasets": {"zip": zips}, "data_map": {"data": ("zip", "data")},
                "seq_order_control_dataset": "zip"}
    return get_sub_epoch_dataset
"""


def _zip(root, name, indices, rng):
    import soundfile

    entries = []
    with zipfile.ZipFile(root / f"{name}.zip", "w") as z:
        for i in indices:
            signal = _speech(root, i) if i < 2 else None
            if signal is None:
                n = int(16000 * rng.uniform(0.3, 0.9))
                t = np.arange(n) / 16000
                signal = 0.4 * np.sin(2 * np.pi * (200 + 900 * t) * t) + 0.05 * rng.randn(n)
            fmt = "OGG" if i % 2 == 0 else "FLAC"
            buf = io.BytesIO()
            soundfile.write(buf, signal.astype("float32"), 16000, format=fmt)
            member = f"utt{i}.{fmt.lower()}"
            z.writestr(f"{name}/{member}", buf.getvalue())
            entries.append({"text": f"utterance {i}", "duration": len(signal) / 16000, "file": member,
                            "seq_name": f"{name}/utt{i}"})  # fmt: skip
        z.writestr(f"{name}.txt", repr(entries))


def _speech(root, i):
    import soundfile

    if shutil.which("espeak-ng") is None:
        return None
    wav = root / f"say{i}.wav"
    text = ["the quick brown fox", "jumps over the lazy dog"][i]
    if subprocess.run(["espeak-ng", "-w", str(wav), text], capture_output=True, timeout=30).returncode != 0:
        return None
    audio, rate = soundfile.read(str(wav))
    if rate != 16000:  # espeak-ng speaks at 22050 Hz: take every n-th sample, pitch does not matter here
        audio = audio[:: max(1, round(rate / 16000))][: int(len(audio) * 16000 / rate)]
    return audio


def oggzip(corpus, audio, ordering="random"):
    return {"class": "OggZipDataset", "path": corpus, "audio": audio, "targets": None, "seq_ordering": ordering}


def meta(corpus, audio):
    return {
        "class": "MetaDataset",
        "datasets": {"zip": oggzip(corpus, audio, "laplace:3")},
        "data_map": {"features": ("zip", "data"), "orth": ("zip", "orth")},
        "seq_order_control_dataset": "zip",
    }


def dfd(corpus, audio):
    """A DistributeFilesDataset over both zips, its sub-epochs read in processes of its own."""
    folder = os.path.dirname(corpus)
    return {
        "class": "DistributeFilesDataset",
        "files": [corpus, os.path.join(folder, "extra.zip")],
        "get_sub_epoch_dataset": f"dfd.oggzips({audio!r})",  # an expression: the config file evaluates it
        "partition_epoch": 1,
        "seq_ordering": "random",
    }


def _resolved(spec):
    """The spec as this process's RETURNN takes it (the function a config file makes of the expression)."""
    if isinstance(spec.get("get_sub_epoch_dataset"), str):
        import dfd as module

        return {**spec, "get_sub_epoch_dataset": eval(spec["get_sub_epoch_dataset"], {"dfd": module})}
    return spec


def returnn_epoch(spec, epoch):
    """RETURNN's own dataset read directly: [(tag, {key: array})]."""
    ds = init_dataset(_resolved(spec))
    ds.init_seq_order(epoch=epoch)
    out, i = [], 0
    while ds.is_less_than_num_seqs(i):
        ds.load_seqs(i, i + 1)
        out.append((ds.get_tag(i), {k: np.array(ds.get_data(i, k)) for k in ds.get_data_keys()}))
        i += 1
    ds.finish_epoch(free_resources=True)
    return out


MAP_SEQ = """
def map_seq(tdict, **kwargs):
    return tdict
"""
MAP_SEQ_STREAM = """
def map_seq_stream(tdicts, **kwargs):
    return tdicts
map_seq_stream_preserves_num_seqs = True
"""


def _config(corpus, spec, mapper=MAP_SEQ):
    path = os.path.join(os.path.dirname(corpus), "serve.py")  # next to dfd.py
    dataset = repr(spec)
    if isinstance(spec.get("get_sub_epoch_dataset"), str):
        dataset = dataset.replace(repr(spec["get_sub_epoch_dataset"]), spec["get_sub_epoch_dataset"])
    with open(path, "w") as f:
        f.write(
            textwrap.dedent(
                f"""
            import dfd
            mapper_api = "returnn"
            dataset = {{"class": "returnn", "dataset": {dataset}}}
            """
            )
            + mapper
        )
    return path


CASES = [
    pytest.param("oggzip", RAW, id="oggzip-raw"),
    pytest.param("meta", RAW, id="meta-raw"),
    pytest.param("dfd", RAW, id="distributed-files-raw"),
    pytest.param("stream", RAW, id="oggzip-raw-map-seq-stream"),
    pytest.param("oggzip", LOG_MEL, id="oggzip-log-mel", marks=needs_librosa),
    pytest.param("meta", PERMUTED, id="meta-log-mel-random-permute", marks=needs_librosa),
]


@pytest.mark.parametrize("kind, audio", CASES)
def test_features_computed_by_the_workers_equal_returnn_oggzip(corpus, tmp_path, kind, audio):
    spec = {"meta": meta, "dfd": dfd}.get(kind, oggzip)(corpus, audio)
    mapper = MAP_SEQ_STREAM if kind == "stream" else MAP_SEQ
    want = {epoch: returnn_epoch(spec, epoch) for epoch in (1, 2)}
    key = "features" if kind == "meta" else "data"
    for workers in (1, 2):
        with run_server(_config(corpus, spec, mapper), workers=workers, log_path=str(tmp_path / "server.log")) as srv:
            with srv.client() as c:
                info = c.info()
                got = {epoch: collect(c.epoch(epoch)) for epoch in want}
        dim = 160 if audio is RAW else 80
        assert info["data_keys"][key] == {"shape": [None, dim], "dtype": "float32"}  # RETURNN's template
        for epoch, seqs in got.items():
            assert [s["seq_tag"] for s in seqs] == [tag for tag, _ in want[epoch]]
            for seq, (tag, arrays) in zip(seqs, want[epoch]):
                for k, arr in arrays.items():
                    assert seq[k].dtype == arr.dtype, (tag, k)
                    np.testing.assert_array_equal(seq[k], arr, err_msg=f"epoch {epoch} {tag} {k} ({workers} workers)")


@pytest.mark.parametrize("kind", ["oggzip", "meta", "dfd", "dfd-in-process"])
def test_the_reader_sends_the_zip_members_encoded_bytes(corpus, kind):
    """The served dataset's seqs carry the members' bytes (no decoding, no features in the reader,
    nor in a DistributeFilesDataset's sub-epoch processes); RETURNN's own dataset in the same
    process still computes its features."""
    spec = {"oggzip": oggzip, "meta": meta}.get(kind, dfd)(corpus, RAW)
    if kind == "dfd-in-process":
        spec["use_worker_proc"] = False
    key = "features" if kind == "meta" else "data"
    ds = ReturnnDataset(dataset=_resolved(spec))
    assert ds.data_keys()[key] == {"shape": [None, 160], "dtype": "float32"}
    ds.init_seq_order(1)
    members = {}
    for name in ("corpus", "extra"):
        with zipfile.ZipFile(os.path.join(os.path.dirname(corpus), f"{name}.zip")) as z:
            for member in z.namelist():
                if not member.endswith(".txt"):
                    members[f"{name}/" + os.path.splitext(os.path.basename(member))[0]] = z.read(member)
    want = dict(returnn_epoch(spec, 1))
    assert ds.num_seqs is None or ds.num_seqs == len(want)
    for pos in range(len(want)):
        seq = ds.get_seq(pos)
        payload = seq[key]
        assert returnn_audio.is_payload(payload)
        assert payload.tobytes().endswith(members[seq["seq_tag"]])
        np.testing.assert_array_equal(returnn_audio.features_of(payload), want[seq["seq_tag"]][key])
    if kind.startswith("dfd"):
        ds.ds.finish_epoch(free_resources=True)  # its sub-epoch processes


def test_audio_in_workers_off_reads_features_in_the_reader(corpus):
    ds = ReturnnDataset(dataset=oggzip(corpus, RAW), audio_in_workers=False)
    ds.init_seq_order(1)
    seq = ds.get_seq(0)
    assert seq["data"].dtype == np.float32 and seq["data"].shape[1] == 160
