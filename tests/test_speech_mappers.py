"""The speech mappers (ppserver/mappers/speech.py): decoding each format and region, resampling,
speed perturbation, Kaldi features against Lhotse's, tokens; the outputs they declare; and a
pipeline of them through a real server and workers, batched, against the in-process reference."""

from __future__ import annotations

import functools
import io
import pickle
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import assert_same_batches, collect, reference_batches, run_cli, run_server, write_config

import ppclient
from ppserver.config.mappers import output_templates
from ppserver.config.settings import from_settings
from ppserver.errors import ConfigError
from ppserver.mappers import Sequential, decode, fbank, spec_augment, speed_perturb, tokenize

# A sentence of about 9 s as espeak-ng speaks it (the cost of each mapper is measured on it too).
SENTENCE = (
    "The server reads bytes and never decodes them. Decoding, speed perturbation and the filterbank "
    "features run in the workers, and the trainer gets padded batches."
)


def signal(seconds: float, rate: int, seed: int = 0, channels: int = 1) -> np.ndarray:
    """Speech-like test audio: a few harmonics under a syllable-rate envelope, with noise."""
    r = np.random.RandomState(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voice = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / rate) / k for k in range(1, 6))
    x = 0.2 * voice * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)) + 0.01 * r.randn(len(t))
    x = x.astype(np.float32)
    return np.stack([x, -0.5 * x], axis=1) if channels == 2 else x


def encoded(samples: np.ndarray, rate: int, fmt: str, subtype=None) -> np.ndarray:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return np.frombuffer(buf.getvalue(), dtype=np.uint8).copy()


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    """(float32 samples, rate) of SENTENCE spoken by espeak-ng; a synthesized signal without it."""
    import soundfile as sf

    if shutil.which("espeak-ng") is None:
        return signal(9.0, 22050), 22050
    path = str(tmp_path_factory.mktemp("espeak") / "speech.wav")
    subprocess.run(["espeak-ng", "-w", path, SENTENCE], check=True, timeout=60, capture_output=True)
    samples, rate = sf.read(path, dtype="float32")
    return samples, rate


@pytest.mark.speech
@pytest.mark.processes  # espeak-ng speaks the sentence
def test_fbank_agrees_with_lhotse_kaldi_fbank_on_speech(speech):
    """decode (22.05 kHz WAV to 16 kHz) then fbank, against Lhotse's Kaldi-compatible Fbank on the
    same samples: the defaults, and other frame and mel settings mapped onto FbankConfig's."""
    lhotse = pytest.importorskip("lhotse")
    samples, rate = speech
    seq = {"audio": encoded(samples, rate, "WAV", "FLOAT"), "seq_tag": "s"}
    audio = decode(sample_rate=16000)(seq)["audio"]
    assert audio.dtype == np.float32 and abs(len(audio) - round(len(samples) * 16000 / rate)) <= 1
    for ours, theirs in (
        (fbank(), lhotse.FbankConfig(num_filters=80)),
        (
            fbank(num_mel_bins=40, frame_length_ms=20.0, frame_shift_ms=12.5, low_freq=60.0, high_freq=-200.0),
            lhotse.FbankConfig(num_filters=40, frame_length=0.02, frame_shift=0.0125, low_freq=60.0, high_freq=-200.0),
        ),
    ):
        want = lhotse.Fbank(theirs).extract(audio, 16000)
        got = ours({"audio": audio}, rng=np.random.RandomState(0))["data"]
        assert got.dtype == np.float32 and got.shape == want.shape, (got.shape, want.shape)
        assert np.abs(got - want).max() < 1e-3, np.abs(got - want).max()
    # a signal of another kind (no digital silence), and a clip shorter than one frame
    noisy = signal(1.3, 16000, seed=3)
    want = lhotse.Fbank(lhotse.FbankConfig()).extract(noisy, 16000)
    assert np.abs(fbank().features(noisy) - want).max() < 1e-3
    # frames = round(samples / shift) (snip_edges False): none for 40 samples, one for 100
    assert fbank().features(np.zeros(40, np.float32)).shape == (0, 80)
    assert fbank().features(signal(0.00625, 16000)).shape == (1, 80)


@pytest.mark.speech
def test_fbank_agrees_with_kaldi_native_fbank_frame_by_frame():
    """The numpy fbank (all frames at once, in blocks) against kaldi-native-fbank's per-frame
    OnlineFbank: lengths around a frame, a block and the mirrored edges, snip_edges both ways,
    other frame and mel settings."""
    knf = pytest.importorskip("kaldi_native_fbank")
    x = signal(3.1, 16000, seed=7)
    for mapper in (
        fbank(),
        fbank(snip_edges=True),
        fbank(num_mel_bins=40, frame_length_ms=20.0, frame_shift_ms=12.5, low_freq=60.0, high_freq=7000.0),
        fbank(num_mel_bins=23, sample_rate=8000, high_freq=0.0),
    ):
        opts = knf.FbankOptions()
        opts.frame_opts.samp_freq = float(mapper.sample_rate)
        opts.frame_opts.frame_length_ms = mapper.frame_length_ms
        opts.frame_opts.frame_shift_ms = mapper.frame_shift_ms
        opts.frame_opts.dither = 0.0
        opts.frame_opts.snip_edges = mapper.snip_edges
        opts.mel_opts.num_bins = mapper.num_mel_bins
        opts.mel_opts.low_freq = mapper.low_freq
        opts.mel_opts.high_freq = mapper.high_freq
        for n in (0, 1, 100, 119, 121, 401, 128 * 160, 128 * 160 + 80, len(x)):
            online = knf.OnlineFbank(opts)
            online.accept_waveform(float(mapper.sample_rate), x[:n])
            online.input_finished()
            want = np.array([online.get_frame(i) for i in range(online.num_frames_ready)], np.float32)
            got = mapper.features(x[:n])
            assert got.dtype == np.float32 and got.shape == (len(want), mapper.num_mel_bins), (n, got.shape)
            if len(want):
                assert np.abs(got - want).max() < 1e-3, (mapper, n, np.abs(got - want).max())
    with pytest.raises(ValueError, match=r"^fbank: low_freq 20.0 and high_freq 9000.0 must lie within 0 to 8000.0 Hz"):
        fbank(high_freq=9000.0).outputs({"audio": {"shape": [None], "dtype": "float32"}})


@pytest.mark.speech
def test_one_fbank_in_several_threads_at_once_gives_each_its_own_features():
    """The block buffers are per thread: a mapper shared by threads mixes nothing up."""
    from concurrent.futures import ThreadPoolExecutor

    mapper = fbank()
    clips = [signal(1.0 + 0.37 * i, 16000, seed=i) for i in range(8)]
    want = [fbank().features(x) for x in clips]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(mapper.features, clips))
            assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.speech
def test_fbank_dither_is_drawn_from_the_seq_rng():
    x = signal(0.5, 16000)
    plain = fbank().features(x)
    dithered = fbank(dither=1e-3)
    a = dithered({"audio": x}, rng=np.random.RandomState(5))["data"]
    b = dithered({"audio": x}, rng=np.random.RandomState(5))["data"]
    c = dithered({"audio": x}, rng=np.random.RandomState(6))["data"]
    assert np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(a, plain)
    assert np.array_equal(fbank()({"audio": x}, rng=np.random.RandomState(5))["data"], plain)
    with pytest.raises(ValueError, match="dither must be a number >= 0"):
        fbank(dither=-1)


@pytest.mark.speech
@pytest.mark.parametrize(
    "fmt, subtype, lossless",
    [("WAV", "PCM_16", True), ("FLAC", None, True), ("OGG", "VORBIS", False), ("MP3", None, False)],
)
def test_decode_reads_each_format_mono_at_the_target_rate(fmt, subtype, lossless):
    import soundfile as sf
    import soxr

    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile does not write {fmt}")
    stereo = signal(1.0, 22050, channels=2)
    data = encoded(stereo, 22050, fmt, subtype)
    seq = {"audio": data, "text": np.array("hi"), "seq_tag": "t", "seq_idx": 3}
    out = decode(sample_rate=16000)(seq)
    assert set(out) == {"audio", "text", "seq_tag", "seq_idx"} and out["text"] == "hi"
    audio = out["audio"]
    assert audio.dtype == np.float32 and audio.ndim == 1 and audio.flags.c_contiguous
    read, rate = sf.read(io.BytesIO(data.tobytes()), dtype="float32", always_2d=True)
    want = soxr.resample(read.mean(axis=1, dtype=np.float32), rate, 16000)
    assert abs(len(audio) - 16000) <= 1
    if lossless:
        assert np.array_equal(audio, want)
    else:  # the same wave, within the codec's loss (libsndfile reads MP3 and Vorbis without their delay)
        mono = soxr.resample(stereo.mean(axis=1), 22050, 16000)
        assert np.corrcoef(audio[:15000], mono[:15000])[0, 1] > 0.95
    # the same rate: no resampling (MP3 decodes to other last bits when read in other chunks)
    assert not lossless or np.array_equal(decode(sample_rate=rate)(seq)["audio"], read.mean(axis=1, dtype=np.float32))


@pytest.mark.speech
@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_decode_reads_only_the_region_of_offset_and_duration(fmt):
    x = signal(2.0, 16000, seed=1)
    data = encoded(x, 16000, fmt, "PCM_24")
    whole = decode()({"audio": data})["audio"]
    seq = {"audio": data, "offset": np.array(0.25), "duration": np.array(0.5), "seq_tag": "r"}
    out = decode()(seq)
    assert set(out) == {"audio", "seq_tag"}  # the region's entries went with the bytes
    assert np.array_equal(out["audio"], whole[4000:12000])
    assert np.array_equal(decode()({"audio": data, "offset": np.array(1.5)})["audio"], whole[24000:])
    assert np.array_equal(decode()({"audio": data, "duration": np.array(0.1)})["audio"], whole[:1600])
    # read at 16 kHz, the region of a file at 8 kHz resampled
    low = decode(sample_rate=16000)({"audio": encoded(x[::2], 8000, fmt, "PCM_24"), "duration": np.array(0.5)})
    assert abs(len(low["audio"]) - 8000) <= 1
    with pytest.raises(ValueError, match=r"^decode: offset 3\.0 s is outside the audio \(2\.000 s\)$"):
        decode()({"audio": data, "offset": np.array(3.0)})
    with pytest.raises(ValueError, match=r"^decode: duration -1\.0 s is negative$"):
        decode()({"audio": data, "duration": np.array(-1.0)})
    with pytest.raises(ValueError) as bad:
        decode()({"audio": np.frombuffer(b"not audio at all" * 8, np.uint8)})
    # one line with libsndfile's reason, not the repr of the in-memory file soundfile names
    assert re.fullmatch(
        r"decode: seq\['audio'\] \(128 bytes\) is not audio soundfile reads: Format not recognised\.?", str(bad.value)
    )
    if fmt == "FLAC":  # a file cut short (a WAV one gives the samples it has)
        with pytest.raises(
            ValueError, match=r"^decode: seq\['audio'\] \(\d+ bytes\) is not audio soundfile reads: [^<]+$"
        ):
            decode()({"audio": data[: len(data) // 50]})


@pytest.mark.speech
def test_speed_perturb_draws_its_factor_from_the_rng_and_resamples_by_it():
    x = signal(1.0, 16000)
    perturb = speed_perturb(factors=(0.9, 1.1))
    seen = set()
    for seed in range(8):
        factor = (0.9, 1.1)[np.random.RandomState(seed).randint(2)]
        a = perturb({"audio": x, "seq_tag": "a"}, rng=np.random.RandomState(seed))
        b = perturb({"audio": x, "seq_tag": "a"}, rng=np.random.RandomState(seed))
        assert np.array_equal(a["audio"], b["audio"]) and a["audio"].dtype == np.float32
        assert abs(len(a["audio"]) - len(x) / factor) <= 1, (factor, len(a["audio"]))
        seen.add(len(a["audio"]))
    assert len(seen) == 2  # both factors were drawn
    # the rng is left the same whichever factor is drawn (1.0 for seed 0, 1.1 for seed 1)
    for seed, factor in ((0, 1.0), (1, 1.1)):
        rng, ref = np.random.RandomState(seed), np.random.RandomState(seed)
        out = speed_perturb(factors=(1.0, 1.1))({"audio": x}, rng=rng)["audio"]
        assert (out is x) == (factor == 1.0) and (1.0, 1.1)[ref.randint(2)] == factor
        assert rng.randint(1 << 30) == ref.randint(1 << 30)
    with pytest.raises(ValueError, match="a factor must be a number > 0"):
        speed_perturb(factors=(0.9, 0))


@pytest.mark.unit
def test_tokenize_maps_characters_of_a_vocab_list_or_file(tmp_path):
    chars = tokenize(vocab=["<blank>", " ", "a", "b", "c"])
    out = chars({"text": np.array("ab ca"), "seq_tag": "t"})
    assert out["classes"].dtype == np.int32 and out["classes"].tolist() == [2, 3, 1, 4, 2]
    assert out["text"] == "ab ca" and out["seq_tag"] == "t"
    with pytest.raises(ValueError, match=r"tokenize: 'x' is not in the vocab \(5 symbols\)"):
        chars({"text": np.array("ax")})
    assert tokenize(vocab=list("ab"), unknown="drop")({"text": np.array("axb")})["classes"].tolist() == [0, 1]
    (tmp_path / "vocab.txt").write_text("<unk>\na\n \nb\n")
    from_file = tokenize(vocab=tmp_path / "vocab.txt", unknown="<unk>", out="labels")
    assert from_file({"text": np.array("ab x")})["labels"].tolist() == [1, 3, 2, 0]
    want = {"shape": [None], "dtype": "int32", "sparse_dim": 4, "labels": ["<unk>", "a", " ", "b"]}
    assert from_file.outputs({"text": {"shape": [], "dtype": "<U20"}}) == {
        "text": {"shape": [], "dtype": "<U20"},
        "labels": want,
    }
    with pytest.raises(ValueError, match="unknown must be 'error', 'drop' or a symbol of the vocab, got '<oov>'"):
        tokenize(vocab=list("ab"), unknown="<oov>").outputs({"text": {"shape": [], "dtype": "string"}})
    with pytest.raises(ValueError, match=r"tokenize: its seqs have no key 'text' \(they have 'audio'\)"):
        chars.outputs({"audio": {"shape": [None], "dtype": "uint8"}})
    assert repr(pickle.loads(pickle.dumps(from_file))) == repr(from_file)


@pytest.mark.speech
def test_tokenize_with_a_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the server reads bytes", "the workers decode audio", "features and tokens"] * 20))
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=prefix, vocab_size=30, model_type="unigram", num_threads=1, minloglevel=2
    )
    processor = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tok = tokenize(vocab=prefix + ".model")
    out = tok({"text": np.array("the workers read tokens")})
    assert out["classes"].dtype == np.int32
    assert out["classes"].tolist() == processor.encode("the workers read tokens")
    template = tok.outputs({"text": {"shape": [], "dtype": "string"}})["classes"]
    assert template["sparse_dim"] == processor.get_piece_size() == 30
    assert template["labels"][:3] == [processor.id_to_piece(i) for i in range(3)]
    again = pickle.loads(pickle.dumps(tok))  # the loaded model is not pickled, it is loaded again
    assert again({"text": np.array("the server")})["classes"].tolist() == processor.encode("the server")


@pytest.mark.unit
def test_a_missing_speech_package_is_one_line_naming_the_extra(monkeypatch):
    """At start (the declared outputs) and when a mapper first runs, without importing it before."""
    monkeypatch.setitem(sys.modules, "soxr", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(
        ValueError, match=r"^speed_perturb needs soxr, which is not installed: pip install 'ppserver\[speech\]'$"
    ):
        speed_perturb().outputs({"audio": {"shape": [None], "dtype": "float32"}})
    with pytest.raises(ImportError, match=r"^speed_perturb needs soxr: pip install 'ppserver\[speech\]' \("):
        speed_perturb(factors=(1.1,))({"audio": np.zeros(100, np.float32)}, rng=np.random.RandomState(0))


SPEECH_INPUTS = {
    "audio": {"shape": [None], "dtype": "uint8"},
    "text": {"shape": [], "dtype": "string"},
    "offset": {"shape": [], "dtype": "float64"},
    "duration": {"shape": [], "dtype": "float64"},
}


def _keeps(seq, **kwargs):
    return seq


@pytest.mark.speech
def test_the_speech_mappers_declare_their_outputs_and_sequential_combines_them():
    pipeline = Sequential(
        decode(), Sequential(speed_perturb(), fbank(num_mel_bins=40)), spec_augment, tokenize(vocab=list("abc "))
    )
    cfg = from_settings({"dataset": {"class": "DemoDataset"}, "map_seq": pipeline})
    assert output_templates(cfg, SPEECH_INPUTS) == {
        "text": {"shape": [], "dtype": "string"},
        "data": {"shape": [None, 40], "dtype": "float32"},
        "classes": {"shape": [None], "dtype": "int32", "sparse_dim": 4, "labels": ["a", "b", "c", " "]},
    }
    assert "0x" not in repr(pipeline) and "ppserver.mappers.builtin.spec_augment" in repr(pipeline)
    # an undeclared mapper before the ones that change the keys is taken to keep them
    cfg = from_settings({"dataset": {"class": "DemoDataset"}, "map_seq": Sequential(_keeps, decode(), fbank())})
    assert set(output_templates(cfg, SPEECH_INPUTS)) == {"text", "data"}
    # after them, it needs map_outputs: refused at start, naming it
    cfg = from_settings({"dataset": {"class": "DemoDataset"}, "map_seq": Sequential(decode(), Sequential(_keeps))})
    with pytest.raises(ConfigError, match=r"^config key 'map_outputs': needed: test_speech_mappers._keeps declares"):
        output_templates(cfg, SPEECH_INPUTS)
    given = {"audio": {"shape": [None], "dtype": "float32"}}
    cfg = from_settings(
        {"dataset": {"class": "DemoDataset"}, "map_seq": Sequential(decode(), _keeps), "map_outputs": given}
    )
    assert output_templates(cfg, SPEECH_INPUTS) == given
    # a mapper whose inputs are not there, or not of its kind, names itself and the key
    for mapper, match in (
        (decode(key="wav"), r"^config key 'map_seq': decode: its seqs have no key 'wav'"),
        (fbank(), r"fbank: 'audio' must be float32 with 1 axes, it is uint8 of shape \[None\]"),
        (
            functools.partial(spec_augment, key="text"),
            r"spec_augment: 'text' must have shape \(time, \.\.\., features\)",
        ),
    ):
        cfg = from_settings({"dataset": {"class": "DemoDataset"}, "map_seq": mapper})
        with pytest.raises(ConfigError, match=match):
            output_templates(cfg, SPEECH_INPUTS)


SPEECH_CONFIG = """
from ppserver.mappers import Sequential, decode, fbank, spec_augment, speed_perturb, tokenize

dataset = {{"class": "NumpyDataset", "path": {path!r}, "seq_ordering": "random"}}
map_seq = Sequential(
    decode(sample_rate=16000),
    speed_perturb(factors=(0.9, 1.0, 1.1)),
    fbank(num_mel_bins=40, dither=1e-4),
    spec_augment,
    tokenize(vocab=list(" abcdefghijklmnopqrstuvwxyz")),
)
batching = {{"max_seqs": 3, "pad": {{"classes": -1}}}}
seed = 11
"""


def speech_corpus(path: str, n: int = 10) -> None:
    """Seqs as a speech corpus has them: encoded bytes (WAV, FLAC and OGG, at 16 and 22.05 kHz),
    a transcript, and the region of the file to read."""
    from ppserver.datasets import save_npz

    seqs = []
    for i in range(n):
        rate = (16000, 22050)[i % 2]
        fmt, subtype = (("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"))[i % 3]
        seconds = 0.4 + 0.1 * i
        offset = 0.1 * (i % 3)
        seqs.append(
            {
                "audio": encoded(signal(seconds + offset, rate, seed=i), rate, fmt, subtype),
                "text": np.array(f"seq {'abcdefghij'[: i + 1]}", dtype="<U32"),
                "offset": np.array(offset),
                "duration": np.array(seconds),
            }
        )
    save_npz(path, seqs)


@pytest.mark.speech
@pytest.mark.processes
def test_a_speech_pipeline_through_server_and_workers_gives_the_reference_batches(tmp_path):
    """Encoded audio in, padded features and tokens out of two workers: the batches equal those the
    in-process reference makes, with no map_outputs (the mappers declare their outputs)."""
    speech_corpus(str(tmp_path / "corpus.npz"))
    cfg = write_config(tmp_path, SPEECH_CONFIG.format(path=str(tmp_path / "corpus.npz")))
    batching = {"max_seqs": 3, "pad": {"classes": -1}}
    want = reference_batches(cfg, 2, batching)
    with run_server(cfg, workers=2) as srv, srv.client() as c:
        keys = c.info()["data_keys"]
        assert keys["data"] == {"shape": [None, 40], "dtype": "float32"}
        assert keys["classes"]["sparse_dim"] == 27 and set(keys) == {"data", "classes", "text"}
        got = collect(c.epoch(2))
    assert_same_batches(got, want)
    assert [len(b["seq_tag"]) for b in got] == [3, 3, 3, 1]
    first = got[0]
    assert first["data"].shape[0] == 3 and first["data"].shape[2] == 40
    assert (first["classes"] == -1).any() or len(set(first["classes:lengths"].tolist())) == 1


USER_MAPPER = """
from ppserver.mappers import Sequential, decode, fbank

dataset = {{"class": "NumpyDataset", "path": {path!r}}}
def _to_frames(seq, **kwargs):
    return {{"frames": seq["audio"][: len(seq["audio"]) // 160 * 160].reshape(-1, 160)}}
map_seq = {mapper}
"""


@pytest.mark.speech
@pytest.mark.processes
def test_a_mapper_that_changes_keys_without_map_outputs_is_named_at_start_or_at_its_first_batch(tmp_path):
    speech_corpus(str(tmp_path / "corpus.npz"), n=4)
    path = str(tmp_path / "corpus.npz")
    # after the speech mappers, an undeclared mapper: the server refuses to start, one line naming map_outputs
    cfg = write_config(tmp_path, USER_MAPPER.format(path=path, mapper="Sequential(decode(), _to_frames)"), "a.py")
    res = run_cli("serve", cfg, "--workers", "0")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "config key 'map_outputs': needed: " in lines[0] and "_to_frames declares no outputs" in lines[0]
    # alone it cannot be told at start: its first batch fails, and the error names map_outputs
    cfg = write_config(tmp_path, USER_MAPPER.format(path=path, mapper="Sequential(_to_frames)"), "b.py")
    with run_server(cfg, workers=1) as srv, srv.client(batching={"max_seqs": 2}) as c:
        with pytest.raises(ppclient.MapperError, match=r"missing key 'audio'.*map_outputs is not set"):
            collect(c.epoch(1))


@pytest.mark.unit
def test_the_fingerprint_of_a_builtin_mapper_covers_the_helpers_of_its_module():
    """speed_perturb's draw is a helper of its module (_randint): the fingerprint hashes the module,
    not only the class, so a change of the helper changes it too."""
    from ppserver.config.fingerprint import _source_of

    for mapper, helper in ((speed_perturb(), "def _randint("), (spec_augment, "def _check_count(")):
        assert helper in "".join(_source_of(mapper, set()))
    assert "def _randint(" not in "".join(_source_of(_keeps, set()))
