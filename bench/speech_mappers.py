#!/usr/bin/env python3
"""Cost per utterance of each speech mapper (ppserver/mappers/speech.py), by timeit, in one process.

The utterance is a WAV file (default: a sentence of about 9 s that espeak-ng speaks), encoded
again as WAV, FLAC, OGG/Vorbis and MP3 for `decode` (read at its own rate and resampled to
16 kHz); `speed_perturb`, `fbank`, `spec_augment` and `tokenize` run on what the ones before
make. Each figure is the best of timeit's autorange, in ms per call.

Usage:  python3 bench/speech_mappers.py [WAV]      (needs 'ppserver[speech]'; espeak-ng without WAV)
"""

from __future__ import annotations

import io
import os

for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_name] = "1"  # one core: what a worker gets with worker_threads = 1

import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import timeit  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from ppserver.mappers import decode, fbank, spec_augment, speed_perturb, tokenize  # noqa: E402

SENTENCE = (
    "The server reads bytes and never decodes them. Decoding, speed perturbation and the filterbank "
    "features run in the workers, and the trainer gets padded batches."
)


def ms(fn: Callable[[], Any]) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return 1e3 * min(timer.repeat(3, number)) / number


def kaldi_native_fbank_frames(audio: np.ndarray) -> Any:
    """kaldi-native-fbank's OnlineFbank with fbank()'s defaults, frame by frame; None where it is
    not installed."""
    try:
        import kaldi_native_fbank as knf
    except ImportError:
        return None
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.frame_opts.snip_edges = False
    opts.mel_opts.num_bins = 80
    opts.mel_opts.high_freq = -400.0

    def run() -> np.ndarray:
        online = knf.OnlineFbank(opts)
        online.accept_waveform(16000.0, audio)
        online.input_finished()
        return np.array([online.get_frame(i) for i in range(online.num_frames_ready)], np.float32)

    return run


def main() -> None:
    import soundfile as sf

    if len(sys.argv) > 1:
        samples, rate = sf.read(sys.argv[1], dtype="float32")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "utterance.wav")
            subprocess.run(["espeak-ng", "-w", path, SENTENCE], check=True, timeout=60)
            samples, rate = sf.read(path, dtype="float32")
    print(f"utterance: {len(samples) / rate:.2f} s at {rate} Hz")
    rng = np.random.RandomState(0)
    for fmt, subtype in (("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"), ("MP3", None)):
        buf = io.BytesIO()
        sf.write(buf, samples, rate, format=fmt, subtype=subtype)
        seq = {"audio": np.frombuffer(buf.getvalue(), np.uint8)}
        same = ms(lambda m=decode(sample_rate=rate), s=seq: m(s))
        to16 = ms(lambda m=decode(sample_rate=16000), s=seq: m(s))
        print(f"decode {fmt:4}  same rate {same:6.2f} ms   to 16 kHz {to16:6.2f} ms")
    audio = decode(sample_rate=16000)(seq)["audio"]
    for name, mapper in (
        ("speed_perturb 0.9", speed_perturb(factors=(0.9,))),
        ("speed_perturb 1.1", speed_perturb(factors=(1.1,))),
        ("fbank 80 bins", fbank()),
        ("fbank 80 bins, dither", fbank(dither=3e-5)),
    ):
        print(f"{name:22} {ms(lambda m=mapper: m({'audio': audio}, rng=rng)):7.2f} ms")
    reference = kaldi_native_fbank_frames(audio)
    if reference is not None:
        print(f"{'kaldi-native-fbank':22} {ms(reference):7.2f} ms  (per frame: the tests' reference)")
    features = fbank()({"audio": audio}, rng=rng)
    print(
        f"{'spec_augment':22} {ms(lambda: spec_augment(features, rng=rng)):7.3f} ms  ({len(features['data'])} frames)"
    )
    tok = tokenize(vocab=list(" abcdefghijklmnopqrstuvwxyz"), unknown="drop")
    text = {"text": np.array(SENTENCE.lower())}
    print(f"{'tokenize characters':22} {ms(lambda: tok(text)):7.3f} ms  ({len(SENTENCE)} characters)")


if __name__ == "__main__":
    main()
