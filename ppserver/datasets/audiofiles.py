"""The bytes of an audio file that a region of it needs, without decoding anything.

A WAV file (RIFF, PCM or float samples) is cut by byte arithmetic: the region's samples under a
header of their own, a WAV file that holds only the region (so a 1-hour recording cut into 1,000
segments is not sent 1,000 times). Any other format (FLAC, MP3, Ogg, ...) is compressed: where a
region starts in it is known only by decoding, so the whole file is sent and the region's offset
within it goes with it; the worker's decoder reads the region.

`read_audio` is the same reading as a mapper, for datasets that hand out paths
(``read_in="workers"``): the workers then read the files on a filesystem they share.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

_WAV_FORMATS = (1, 3, 0xFFFE)  # PCM, IEEE float, WAVE_FORMAT_EXTENSIBLE (their samples are fixed-size frames)
_HEADER_SCAN = 1 << 16  # bytes of a file looked at for its chunks before the samples


class _Wav:
    """Where a WAV file's samples are: the bytes of its fmt chunk, the data's start and size."""

    def __init__(self, fmt: bytes, data_start: int, data_size: int):
        self.fmt = fmt
        self.rate = struct.unpack_from("<I", fmt, 4)[0]
        self.block = struct.unpack_from("<H", fmt, 12)[0]  # bytes per frame (all channels)
        self.data_start = data_start
        self.data_size = data_size - data_size % max(self.block, 1)


def _parse_wav(head: bytes, file_size: int) -> Optional[_Wav]:
    """The chunks of a RIFF/WAVE file's first bytes; None for anything else (RF64, compressed
    formats in a WAV container, a file cut short)."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, fmt = 12, None
    while pos + 8 <= len(head):
        chunk, size = head[pos : pos + 4], struct.unpack_from("<I", head, pos + 4)[0]
        body = pos + 8
        if chunk == b"fmt ":
            fmt = head[body : body + size]
            if len(fmt) < 16 or struct.unpack_from("<H", fmt, 0)[0] not in _WAV_FORMATS:
                return None
        elif chunk == b"data":
            if fmt is None or struct.unpack_from("<H", fmt, 12)[0] == 0:
                return None
            return _Wav(fmt, body, min(size, file_size - body))
        pos = body + size + (size & 1)  # chunks are padded to an even size
    return None


def is_wav(path: str) -> bool:
    """Whether a file is one region_bytes cuts by bytes (False also for one it cannot open)."""
    try:
        with open(path, "rb") as f:
            return _parse_wav(f.read(_HEADER_SCAN), os.fstat(f.fileno()).st_size) is not None
    except OSError:
        return False


def _wav_file(wav: _Wav, samples: bytes) -> bytes:
    """A WAV file of `samples` with the original's format chunk."""
    fmt = wav.fmt + (b"\0" if len(wav.fmt) & 1 else b"")
    riff_size = 4 + 8 + len(fmt) + 8 + len(samples)
    return b"".join(
        (
            struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE"),
            struct.pack("<4sI", b"fmt ", len(wav.fmt)),
            fmt,
            struct.pack("<4sI", b"data", len(samples)),
            samples,
        )
    )


def region_bytes(
    source: Union[str, os.PathLike, bytes], offset: float = 0.0, duration: Optional[float] = None
) -> Tuple[np.ndarray, float]:
    """The bytes (uint8) that hold `duration` seconds (None: to the end) from `offset` of an audio
    file (a path, or its bytes), and the region's offset within them in seconds: a WAV file of
    only the region (offset 0.0), or the whole file of any other format (offset unchanged)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        wav = _parse_wav(data[:_HEADER_SCAN], len(data))
        if wav is None:
            return np.frombuffer(data, dtype=np.uint8), offset
        start, stop = _frames(wav, offset, duration)
        return np.frombuffer(_wav_file(wav, data[start:stop]), dtype=np.uint8), 0.0
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        wav = _parse_wav(f.read(_HEADER_SCAN), size)
        if wav is None:
            f.seek(0)
            return np.frombuffer(f.read(), dtype=np.uint8), offset
        start, stop = _frames(wav, offset, duration)
        f.seek(start)
        return np.frombuffer(_wav_file(wav, f.read(stop - start)), dtype=np.uint8), 0.0


def _frames(wav: _Wav, offset: float, duration: Optional[float]) -> Tuple[int, int]:
    """The byte range of the region's frames, rounded to whole samples as Lhotse rounds them."""
    total = wav.data_size // wav.block
    first = min(_samples(offset, wav.rate), total)
    count = total - first if duration is None else min(_samples(duration, wav.rate), total - first)
    return wav.data_start + first * wav.block, wav.data_start + (first + count) * wav.block


def _samples(seconds: float, rate: int) -> int:
    """Seconds in samples, rounded half up (Lhotse's compute_num_samples)."""
    return math.floor(seconds * rate + 0.5)


def read_audio(seq: Dict[str, Any], **kwargs: Any) -> Dict[str, Any]:
    """A mapper: a seq's `audio_path` (with `offset` and `duration`) becomes `audio`, the bytes
    `region_bytes` gives, with `offset` within them. For ``read_in="workers"``."""
    out = {k: v for k, v in seq.items() if k != "audio_path"}
    offset = float(seq["offset"]) if "offset" in seq else 0.0
    duration = float(seq["duration"]) if "duration" in seq else None
    out["audio"], new_offset = region_bytes(str(seq["audio_path"]), offset, duration)
    out["offset"] = np.array(new_offset)
    return out
