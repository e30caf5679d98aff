"""Speech mappers: encoded audio bytes to samples, speed perturbation, Kaldi log-mel features and
token ids, run in the workers (the server reads bytes and never decodes).

    map_seq = Sequential(decode(), speed_perturb(), fbank(), spec_augment, tokenize(vocab="chars.txt"))

Each is a small object configured once in the config: picklable, its repr shows its settings,
and ``outputs(templates)`` says what it makes of seqs of those templates, so that a config of
these needs no map_outputs. Randomness comes only from the seq's `rng`. soundfile and soxr
(``pip install 'ppserver[speech]'``) and sentencepiece are imported when a mapper first needs
them, never by importing this module; fbank is numpy alone (ppserver.mappers.kaldi_fbank).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ppserver.mappers.apply import STRING
from ppserver.mappers.kaldi_fbank import KaldiFbank

__all__ = ["decode", "speed_perturb", "fbank", "tokenize"]

Seq = Dict[str, Any]
Templates = Dict[str, Dict[str, Any]]

_SPEECH_EXTRA = "pip install 'ppserver[speech]'"
_PIP_NAMES = {"soundfile": "soundfile", "soxr": "soxr"}


def _need(module: str, who: str) -> Any:
    """`module`, imported; ImportError, one line, saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        how = _SPEECH_EXTRA if module in _PIP_NAMES else f"pip install {module}"
        raise ImportError(f"{who} needs {_PIP_NAMES.get(module, module)}: {how} ({exc})") from None


def _check_installed(modules: Sequence[str], who: str) -> None:
    """At start (outputs()), without importing: a missing module is one line naming the extra."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            how = _SPEECH_EXTRA if module in _PIP_NAMES else f"pip install {module}"
            raise ValueError(f"{who} needs {_PIP_NAMES.get(module, module)}, which is not installed: {how}")


def _input(inputs: Templates, key: str, who: str, dtype: str, ndim: int) -> None:
    """Input `key` is there, of `dtype` ("string": a str array of any length) with `ndim` axes;
    else ValueError naming it."""
    if key not in inputs:
        raise ValueError(f"{who}: its seqs have no key {key!r} (they have {', '.join(map(repr, inputs)) or 'none'})")
    tpl = inputs[key]
    if _kind(tpl["dtype"]) != dtype or len(tpl["shape"]) != ndim:
        raise ValueError(
            f"{who}: {key!r} must be {dtype} with {ndim} axes, it is {tpl['dtype']} of shape {tpl['shape']}"
        )


def _kind(dtype: str) -> str:
    """A template's dtype, with every str dtype ('<U12') as "string"."""
    if dtype == STRING:
        return dtype
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        return dtype
    return STRING if parsed.kind == "U" else parsed.name


def _positive(who: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{who}: {name} must be a number > 0, got {value!r}")
    return value


def _randint(rng: Any, high: int) -> int:
    """An int in [0, high) from a RandomState or a Generator."""
    return int(rng.integers(high)) if hasattr(rng, "integers") else int(rng.randint(high))


def _quality(who: str, quality: Any) -> str:
    """soxr's resampling quality, from very high to quick."""
    if quality not in ("VHQ", "HQ", "MQ", "LQ", "QQ"):
        raise ValueError(f"{who}: quality must be one of VHQ, HQ, MQ, LQ, QQ, got {quality!r}")
    return quality


class _Mapper:
    """A mapper is its settings (`_settings`, the arguments of its __init__, which keeps each as
    an attribute of that name): they alone are pickled and shown, what it loads lazily is not."""

    _settings: Tuple[str, ...] = ()

    def __getstate__(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self._settings}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self._settings)})"


class decode(_Mapper):
    """Encoded audio (WAV, FLAC, OGG/Vorbis, MP3: what soundfile reads) in ``seq[key]``, a uint8
    array of the file's bytes, to float32 mono samples in [-1, 1] at `sample_rate` in ``seq[out]``.

    Where the seq has `offset_key` and/or `duration_key` (seconds, scalars), only that region is
    read (a seek, then that many frames: the rest of the file is not decoded). Channels are
    averaged; another rate is resampled with soxr (`quality`: "VHQ", "HQ", "MQ", "LQ", "QQ").
    The bytes and the region entries are replaced by the samples.
    """

    _settings = ("sample_rate", "key", "out", "offset_key", "duration_key", "quality")

    def __init__(
        self,
        sample_rate: int = 16000,
        key: str = "audio",
        out: str = "audio",
        offset_key: str = "offset",
        duration_key: str = "duration",
        quality: str = "HQ",
    ):
        self.sample_rate = int(_positive("decode", "sample_rate", sample_rate))
        self.key, self.out = key, out
        self.offset_key, self.duration_key = offset_key, duration_key
        self.quality = _quality("decode", quality)

    def outputs(self, inputs: Templates) -> Templates:
        _check_installed(("soundfile", "soxr"), "decode")
        _input(inputs, self.key, "decode", "uint8", 1)
        out = {k: v for k, v in inputs.items() if k not in (self.key, self.offset_key, self.duration_key)}
        out[self.out] = {"shape": [None], "dtype": "float32"}
        return out

    def __call__(self, seq: Seq, **kwargs: Any) -> Seq:
        sf = _need("soundfile", "decode")
        data = np.asarray(seq[self.key])
        offset = float(seq[self.offset_key]) if self.offset_key in seq else 0.0
        duration = float(seq[self.duration_key]) if self.duration_key in seq else None
        try:
            with sf.SoundFile(io.BytesIO(data.tobytes())) as f:
                rate, total = f.samplerate, f.frames
                start = round(offset * rate)
                if not 0 <= start <= total:
                    raise ValueError(f"decode: offset {offset} s is outside the audio ({total / rate:.3f} s)")
                if duration is not None and duration < 0:
                    raise ValueError(f"decode: duration {duration} s is negative")
                if start:
                    f.seek(start)
                frames = -1 if duration is None else round(duration * rate)
                samples = f.read(frames, dtype="float32", always_2d=True)
        except (RuntimeError, sf.LibsndfileError) as exc:  # a TypeError or ValueError of soundfile passes as it is
            # libsndfile's reason alone: soundfile's text names the in-memory file object (an address)
            reason = getattr(exc, "error_string", None) or str(exc)
            raise ValueError(
                f"decode: seq[{self.key!r}] ({data.nbytes} bytes) is not audio soundfile reads: {reason}"
            ) from None
        mono = samples[:, 0] if samples.shape[1] == 1 else samples.mean(axis=1, dtype=np.float32)
        if rate != self.sample_rate and len(mono):
            mono = _need("soxr", "decode").resample(mono, rate, self.sample_rate, quality=self.quality)
        out = {k: v for k, v in seq.items() if k not in (self.key, self.offset_key, self.duration_key)}
        out[self.out] = np.ascontiguousarray(mono, dtype=np.float32)
        return out


class speed_perturb(_Mapper):
    """Speed perturbation as Kaldi's and Lhotse's: a factor drawn from `factors` with the seq's
    `rng`, then the samples in ``seq[key]`` (at `sample_rate`) taken to be at sample_rate *
    factor and resampled to sample_rate with soxr, so that pitch and tempo change together and
    the length becomes about len / factor. The draw is the same whatever the factor, so the
    output is a pure function of (config, epoch, seed).

    Its outputs change length: a batching whose cut must know it uses ``batch_length``."""

    _settings = ("factors", "sample_rate", "key", "quality")

    def __init__(
        self,
        factors: Sequence[float] = (0.9, 1.0, 1.1),
        sample_rate: int = 16000,
        key: str = "audio",
        quality: str = "HQ",
    ):
        self.factors = tuple(float(_positive("speed_perturb", "a factor", f)) for f in factors)
        if not self.factors:
            raise ValueError("speed_perturb: factors must not be empty")
        self.sample_rate = int(_positive("speed_perturb", "sample_rate", sample_rate))
        self.key, self.quality = key, _quality("speed_perturb", quality)

    def outputs(self, inputs: Templates) -> Templates:
        _check_installed(("soxr",), "speed_perturb")
        _input(inputs, self.key, "speed_perturb", "float32", 1)
        return inputs

    def __call__(self, seq: Seq, *, rng: Any, **kwargs: Any) -> Seq:
        factor = self.factors[_randint(rng, len(self.factors))]
        out = dict(seq)
        x = seq[self.key]
        if factor != 1.0 and len(x):
            soxr = _need("soxr", "speed_perturb")
            y = soxr.resample(x, self.sample_rate * factor, self.sample_rate, quality=self.quality)
            out[self.key] = np.ascontiguousarray(y, dtype=np.float32)
        return out


class fbank(_Mapper):
    """Kaldi-compatible log-mel filterbank features of the samples in ``seq[key]`` (float32 in
    [-1, 1] at `sample_rate`), into ``seq[out]`` (frames, num_mel_bins) float32; the samples are
    replaced by the features. Computed in numpy over all frames at once
    (ppserver.mappers.kaldi_fbank), about 4x faster than kaldi-native-fbank's frame-by-frame API.

    The defaults are Lhotse's ``Fbank(FbankConfig(num_filters=80))``, with which the features agree
    to 1e-3: 25 ms frames (`frame_length_ms`) every 10 ms (`frame_shift_ms`), povey window,
    pre-emphasis 0.97, DC offset removed, mel bins from `low_freq` 20 Hz to `high_freq` -400
    (Nyquist less 400 Hz), snip_edges False (frames = round(samples / shift): the edges are
    mirrored), log floor FLT_EPSILON. Samples are in [-1, 1] as Lhotse has them, not in int16
    units as Kaldi's own tools: the log-mels differ from those by 2 ln 32768.

    `dither` (default 0: none) adds Gaussian noise of that standard deviation to the samples
    before framing (Kaldi's 1.0 in int16 units is about 3e-5 here). It is drawn from the seq's
    `rng`, so that the features stay a pure function of (config, epoch, seed).
    """

    _settings = (
        "num_mel_bins",
        "sample_rate",
        "frame_length_ms",
        "frame_shift_ms",
        "dither",
        "low_freq",
        "high_freq",
        "snip_edges",
        "key",
        "out",
    )

    def __init__(
        self,
        num_mel_bins: int = 80,
        sample_rate: int = 16000,
        frame_length_ms: float = 25.0,
        frame_shift_ms: float = 10.0,
        dither: float = 0.0,
        low_freq: float = 20.0,
        high_freq: float = -400.0,
        snip_edges: bool = False,
        key: str = "audio",
        out: str = "data",
    ):
        if isinstance(num_mel_bins, bool) or not isinstance(num_mel_bins, int) or num_mel_bins < 1:
            raise ValueError(f"fbank: num_mel_bins must be an int >= 1, got {num_mel_bins!r}")
        self.num_mel_bins = num_mel_bins
        self.sample_rate = int(_positive("fbank", "sample_rate", sample_rate))
        self.frame_length_ms = float(_positive("fbank", "frame_length_ms", frame_length_ms))
        self.frame_shift_ms = float(_positive("fbank", "frame_shift_ms", frame_shift_ms))
        if isinstance(dither, bool) or not isinstance(dither, (int, float)) or dither < 0:
            raise ValueError(f"fbank: dither must be a number >= 0, got {dither!r}")
        self.dither = float(dither)
        self.low_freq, self.high_freq = float(low_freq), float(high_freq)
        self.snip_edges = bool(snip_edges)
        self.key, self.out = key, out
        self._computer: Optional[KaldiFbank] = None

    def outputs(self, inputs: Templates) -> Templates:
        _input(inputs, self.key, "fbank", "float32", 1)
        self.computer()  # bad frequencies or frame sizes are named at start
        out = {k: v for k, v in inputs.items() if k != self.key}
        out[self.out] = {"shape": [None, self.num_mel_bins], "dtype": "float32"}
        return out

    def computer(self) -> KaldiFbank:
        """The window, mel matrix and buffers for these settings (made once per process)."""
        if self._computer is None:
            self._computer = KaldiFbank(
                self.num_mel_bins,
                self.sample_rate,
                self.frame_length_ms,
                self.frame_shift_ms,
                self.low_freq,
                self.high_freq,
                self.snip_edges,
            )
        return self._computer

    def __call__(self, seq: Seq, *, rng: Any, **kwargs: Any) -> Seq:
        x = np.asarray(seq[self.key], dtype=np.float32)
        if self.dither:
            x = x + (self.dither * rng.standard_normal(len(x))).astype(np.float32)
        features = self.features(x)
        out = {k: v for k, v in seq.items() if k != self.key}
        out[self.out] = features
        return out

    def features(self, samples: np.ndarray) -> np.ndarray:
        """(frames, num_mel_bins) float32 log-mels of float32 samples (no dither)."""
        return self.computer()(samples)


class tokenize(_Mapper):
    """The transcript in ``seq[key]`` (a str array) to int32 class indices in ``seq[out]``; the
    transcript stays (it is small, and the trainer may log it).

    `vocab`: a list of symbols (characters, each its index; entries longer than one character,
    such as "<blank>", take an index and never match), a text file of them (one per line), or a
    sentencepiece model (a path ending in ``.model``: its pieces). `unknown`, for a character
    that is not in a character vocabulary: "error" (the seq fails, naming it), "drop", or a
    symbol of the vocabulary that stands for it (e.g. "<unk>"). The output template has the
    vocabulary's size as its sparse_dim and its symbols as labels.
    """

    _settings = ("vocab", "key", "out", "unknown")

    def __init__(
        self,
        vocab: Union[str, os.PathLike, Sequence[str]],
        key: str = "text",
        out: str = "classes",
        unknown: str = "error",
    ):
        self.vocab: Union[str, List[str]]
        if isinstance(vocab, (str, os.PathLike)):
            self.vocab = str(os.fspath(vocab))
        else:
            self.vocab = list(vocab)
            if not self.vocab or not all(isinstance(s, str) and s for s in self.vocab):
                raise ValueError("tokenize: vocab must be a non-empty list of non-empty str, or a path")
        self.key, self.out, self.unknown = key, out, unknown
        self._symbols: Optional[List[str]] = None
        self._index: Optional[Dict[str, int]] = None
        self._spm: Any = None

    @property
    def is_sentencepiece(self) -> bool:
        return isinstance(self.vocab, str) and self.vocab.endswith(".model")

    def symbols(self) -> List[str]:
        """The vocabulary, index by index (loaded once)."""
        if self._symbols is None:
            if self.is_sentencepiece:
                spm = self._processor()
                self._symbols = [spm.id_to_piece(i) for i in range(spm.get_piece_size())]
            else:
                self._symbols = self._read_vocab() if isinstance(self.vocab, str) else list(self.vocab)
                index: Dict[str, int] = {}
                for i, symbol in enumerate(self._symbols):
                    index.setdefault(symbol, i)
                self._index = index
                if self.unknown not in ("error", "drop") and self.unknown not in index:
                    raise ValueError(
                        f"tokenize: unknown must be 'error', 'drop' or a symbol of the vocab, got {self.unknown!r}"
                    )
        return self._symbols

    def _read_vocab(self) -> List[str]:
        assert isinstance(self.vocab, str)
        try:
            with open(self.vocab, encoding="utf8") as f:
                symbols = [line.rstrip("\r\n") for line in f]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"tokenize: vocab file {self.vocab!r} cannot be read: {exc}") from None
        while symbols and symbols[-1] == "":
            symbols.pop()  # a final newline
        if not symbols or "" in symbols:
            raise ValueError(f"tokenize: vocab file {self.vocab!r} must have one non-empty symbol per line")
        return symbols

    def _processor(self) -> Any:
        if self._spm is None:
            spm = _need("sentencepiece", "tokenize")
            processor = spm.SentencePieceProcessor()
            try:
                processor.load(self.vocab)
            except (OSError, RuntimeError) as exc:
                raise ValueError(f"tokenize: {self.vocab!r} is not a sentencepiece model: {exc}") from None
            self._spm = processor
        return self._spm

    def outputs(self, inputs: Templates) -> Templates:
        _input(inputs, self.key, "tokenize", STRING, 0)
        symbols = self.symbols()
        out = dict(inputs)
        out[self.out] = {"shape": [None], "dtype": "int32", "sparse_dim": len(symbols), "labels": list(symbols)}
        return out

    def __call__(self, seq: Seq, **kwargs: Any) -> Seq:
        text = str(np.asarray(seq[self.key]).item())
        out = dict(seq)
        out[self.out] = self.encode(text)
        return out

    def encode(self, text: str) -> np.ndarray:
        """int32 class indices of `text`."""
        symbols = self.symbols()
        if self.is_sentencepiece:
            return np.asarray(self._processor().encode(text, out_type=int), dtype=np.int32)
        index = self._index
        assert index is not None
        ids = []
        for char in text:
            i = index.get(char)
            if i is None:
                if self.unknown == "error":
                    raise ValueError(f"tokenize: {char!r} is not in the vocab ({len(symbols)} symbols)")
                if self.unknown == "drop":
                    continue
                i = index[self.unknown]
            ids.append(i)
        return np.asarray(ids, dtype=np.int32)
