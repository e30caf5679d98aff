"""OggZipDataset's audio features computed in the workers, not in the server's reader thread.

RETURNN's OggZipDataset reads a zip member's encoded audio and hands it to its
``ExtractAudioFeatures`` (``get_audio_features_from_raw_bytes``): decoding and the features
(log-mel, MFCC, ...) run where the dataset is read, in the server's one reader thread. While
the reader reads (``reading()``), that call returns a *payload* instead: a uint8 array of the
member's encoded bytes with a header naming the extractor's settings (and, with
``random_permute``, the random state RETURNN's extractor would have for this seq). It travels
under the dataset's own key ("data", or the key a MetaDataset maps it to) to a worker, where
``features_of`` builds the same ``ExtractAudioFeatures`` and computes RETURNN's features,
before the mappers see the seq. Everything around it (tags, order, MetaDataset, the
templates the server announces) stays RETURNN's.

Randomness: RETURNN seeds the extractor's RandomState once per epoch and draws from it seq
after seq. ``random_permute`` draws a fixed pattern of uniforms that depends only on the
draws themselves, so the reader replays those draws (no audio work) and ships each seq's
state: the features are RETURNN's, bit for bit. An extractor with a callable (``features``,
``pre_process``, ``post_process`` as functions) is not moved: the reader computes it, as
RETURNN does, and the log says so once.

A DistributeFilesDataset reads its sub-epochs in processes of its own (``use_worker_proc``):
those processes start with ``install(everywhere=True)``, as all they do is read.
"""

from __future__ import annotations

import io
import json
import logging
import struct
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy

log = logging.getLogger("ppserver.dataset")

MAGIC = b"\x00ppserver-audio\x01"
_HEAD = struct.Struct("<I")  # the header's length
_STATE_WORDS = 624  # MT19937's key
_reading = threading.local()
_everywhere = False  # a process that only reads (a DistributeFilesDataset's sub-epoch process)
_installed: Dict[str, Callable] = {}
_refused: set = set()
_moved: List[bool] = []  # logged once: the features are computed by the workers
_extractors: Dict[bytes, Any] = {}  # header -> extractor, in a worker
_MAX_EXTRACTORS = 64


# ---- the server: payloads instead of features ------------------------------------------------


def install(everywhere: bool = False) -> None:
    """Let ExtractAudioFeatures return payloads inside ``reading()`` (once per process; outside it, and
    in other threads, the extractor works as RETURNN's), or in every call with `everywhere`.
    DistributeFilesDataset's sub-epoch processes start so."""
    global _everywhere
    _everywhere = _everywhere or everywhere
    if _installed:
        return
    from returnn.datasets.util.feature_extraction import ExtractAudioFeatures

    _sub_epoch_processes_too()
    original = ExtractAudioFeatures.get_audio_features_from_raw_bytes
    _installed["original"] = original

    def get_audio_features_from_raw_bytes(self: Any, raw_bytes: Any, seq_name: Optional[str] = None) -> Any:
        if _everywhere or getattr(_reading, "on", False):
            payload = payload_of(self, raw_bytes)
            if payload is not None:
                return payload
        return original(self, raw_bytes, seq_name=seq_name)

    ExtractAudioFeatures.get_audio_features_from_raw_bytes = get_audio_features_from_raw_bytes


class _PreInit:
    """A sub-epoch process's start: RETURNN's own, then install(everywhere=True)."""

    def __init__(self, before: Optional[Callable[[], None]]):
        self.before = before

    def __call__(self) -> None:
        if self.before is not None:
            self.before()
        install(everywhere=True)


def _sub_epoch_processes_too() -> None:
    """DistributeFilesDataset's sub-epoch processes started while the reader reads send payloads too."""
    try:
        from returnn.datasets import distrib_files
        from returnn.util.multi_proc_non_daemonic_spawn import NonDaemonicSpawnContext
    except ImportError:
        return
    ctx: Any = getattr(distrib_files, "_mp", None)
    if type(ctx) is not NonDaemonicSpawnContext:
        return  # a RETURNN that starts them otherwise: they compute the features, as RETURNN does

    class ReadingContext(NonDaemonicSpawnContext):
        def Process(self, *args: Any, **kwargs: Any) -> Any:
            proc = super().Process(*args, **kwargs)
            if getattr(_reading, "on", False):
                proc.pre_init_func = _PreInit(self.process_pre_init_func)
            return proc

    distrib_files._mp = ReadingContext(process_pre_init_func=ctx.process_pre_init_func)


@contextmanager
def reading() -> Iterator[None]:
    """The dataset calls inside are the reader's: its audio leaves as payloads."""
    before = getattr(_reading, "on", False)
    _reading.on = True
    try:
        yield
    finally:
        _reading.on = before


def _encode(value: Any) -> Any:
    from returnn.util.basic import CollectionReadCheckCovered

    if isinstance(value, numpy.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, CollectionReadCheckCovered):
        return {"__collection__": value.collection, "truth_value": value.truth_value}
    raise TypeError(f"{type(value).__name__} cannot leave the server")


def _decode(obj: Dict[str, Any]) -> Any:
    if "__ndarray__" in obj:
        return numpy.array(obj["__ndarray__"], dtype=numpy.dtype(obj["dtype"]))
    if "__collection__" in obj:
        from returnn.util.basic import CollectionReadCheckCovered

        return CollectionReadCheckCovered(obj["__collection__"], truth_value=obj["truth_value"])
    return obj


def settings_of(extractor: Any) -> Optional[bytes]:
    """The extractor's settings as a worker rebuilds them (JSON), or None if it cannot be moved."""
    cached = extractor.__dict__.get("_ppserver_settings")
    if cached is not None or "_ppserver_settings" in extractor.__dict__:
        return cached
    attrs = {k: v for k, v in vars(extractor).items() if k not in ("random_state", "_ppserver_settings")}
    text: Optional[bytes] = None
    why = ""
    if attrs.get("features") == "raw_ogg":
        why = "raw_ogg features parse the Ogg stream themselves"
    else:
        try:
            text = json.dumps(attrs, default=_encode, sort_keys=True, allow_nan=True).encode()
        except (TypeError, ValueError) as exc:
            why = f"its settings hold a callable or another object ({exc})"
    if text is None and why not in _refused:
        _refused.add(why)
        log.warning("OggZipDataset's audio features stay in the reader thread: %s", why)
    extractor.__dict__["_ppserver_settings"] = text
    return text


def _replay_random_permute(rs: numpy.random.RandomState, opts: Any) -> None:
    """Draw what RETURNN's _get_random_permuted_audio draws, without the audio."""
    get = opts.collection.get
    rs.uniform(get("rnd_scale_lower", 0.8), get("rnd_scale_upper", 1.0))
    for name in ("zoom", "stretch", "pitch"):
        if rs.uniform(0.0, 1.0) < get(f"rnd_{name}_switch", 0.2):
            rs.uniform(0.0, 1.0)  # the factor: one double, whatever its bounds


def payload_of(extractor: Any, raw_bytes: Any) -> Optional[numpy.ndarray]:
    """The seq's encoded audio with the header a worker needs; None if the extractor stays here."""
    settings = settings_of(extractor)
    if settings is None:
        return None
    header: Dict[str, Any] = {"settings": settings.decode()}
    state = b""
    opts = extractor.random_permute_opts
    if opts and opts.truth_value:
        rs = extractor.random_state
        _, keys, pos, has_gauss, gauss = rs.get_state()
        header["state"] = [int(pos), int(has_gauss), float(gauss)]
        state = numpy.asarray(keys, dtype="<u4").tobytes()
        _replay_random_permute(rs, opts)
    if not _moved:
        _moved.append(True)
        log.info(
            "OggZipDataset's audio leaves the reader encoded: its %r features are computed by the workers",
            extractor.features,
        )
    head = json.dumps(header).encode()
    data = raw_bytes.getvalue() if hasattr(raw_bytes, "getvalue") else bytes(raw_bytes.read())
    return numpy.frombuffer(b"".join((MAGIC, _HEAD.pack(len(head)), head, state, data)), numpy.uint8)


# ---- the worker: the features from a payload -------------------------------------------------


def is_payload(value: Any) -> bool:
    return (
        isinstance(value, numpy.ndarray)
        and value.dtype == numpy.uint8
        and value.ndim == 1
        and value.shape[0] >= len(MAGIC) + _HEAD.size
        and value[: len(MAGIC)].tobytes() == MAGIC
    )


def _extractor(settings: bytes) -> Any:
    ex = _extractors.get(settings)
    if ex is None:
        from returnn.datasets.util.feature_extraction import ExtractAudioFeatures

        ex = ExtractAudioFeatures.__new__(ExtractAudioFeatures)  # the server's attributes, as they are
        ex.__dict__.update(json.loads(settings, object_hook=_decode))
        ex.random_state = numpy.random.RandomState(1)
        if len(_extractors) >= _MAX_EXTRACTORS:
            _extractors.clear()
        _extractors[settings] = ex
    return ex


def features_of(payload: numpy.ndarray, seq_name: Optional[str] = None) -> numpy.ndarray:
    """RETURNN's features of a payload: what get_audio_features_from_raw_bytes computes in RETURNN."""
    import soundfile

    raw = payload.tobytes()
    start = len(MAGIC) + _HEAD.size
    (size,) = _HEAD.unpack_from(raw, len(MAGIC))
    header = json.loads(raw[start : start + size])
    start += size
    ex = _extractor(header["settings"].encode())
    if "state" in header:
        keys = numpy.frombuffer(raw, "<u4", _STATE_WORDS, start).astype(numpy.uint32)
        start += _STATE_WORDS * 4
        pos, has_gauss, gauss = header["state"]
        ex.random_state.set_state(("MT19937", keys, pos, has_gauss, gauss))
    if ex.random_permute_opts:
        ex.random_permute_opts.got_items = set()
    audio, sample_rate = soundfile.read(io.BytesIO(raw[start:]))
    return ex.get_audio_features(audio=audio, sample_rate=sample_rate, seq_name=seq_name)


def with_features(seq: Dict[str, Any]) -> Dict[str, Any]:
    """The seq with every payload replaced by its features (the seq itself if it has none)."""
    keys = [k for k, v in seq.items() if is_payload(v)]
    if not keys:
        return seq
    out = dict(seq)
    tag = seq.get("seq_tag")
    for key in keys:
        out[key] = features_of(seq[key], None if tag is None else str(tag))
    return out
