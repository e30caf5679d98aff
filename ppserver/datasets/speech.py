"""SpeechCorpus: the base of the datasets of audio files and transcripts (NeMo manifests, Lhotse
cuts, Hugging Face audio datasets), with every seq's duration known before anything is read.

The server never decodes: a seq carries the encoded file bytes (`audio`, uint8: the region of a
WAV file, or a whole compressed file, see audiofiles.py), the region's `offset` in them and its
`duration` (float64 scalars, seconds) and its `text` (a str scalar). With ``read_in="workers"``
it carries `audio_path` (a str scalar) instead of `audio`, and the workers read the file.

A seq's length, for the epoch orders and for cutting batches up front, is its duration in 10 ms
frames (FRAMES_PER_SECOND), the frames a filterbank of the workers gives; `seq_durations()` gives
the seconds.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Union

import numpy as np

from ppserver.datasets.audiofiles import is_wav, region_bytes
from ppserver.datasets.base import Dataset
from ppserver.errors import ConfigError
from ppserver.mappers.apply import STRING

log = logging.getLogger("ppserver.dataset")

FRAMES_PER_SECOND = 100  # a seq's length is its duration in 10 ms frames
READ_IN = ("server", "workers")

Source = Union[str, bytes]  # a file's path, or the file's bytes where the corpus holds them


class SpeechCorpus(Dataset):
    """Seqs of audio regions and transcripts, from records a subclass adds with `_add` in its
    constructor (then `_done`). `read_in`: "server" (default: the reader thread reads the bytes,
    workers need no access to the files) or "workers" (seqs carry the path: a filesystem the
    workers share). `ordering`: the options of Dataset."""

    def __init__(self, *, read_in: str = "server", **ordering: Any):
        super().__init__(**ordering)
        if read_in not in READ_IN:
            raise ConfigError("read_in", f"must be one of {', '.join(map(repr, READ_IN))}, got {read_in!r}")
        self.read_in = read_in
        self._sources: List[str] = []
        self._source_index: Dict[str, int] = {}  # a path's index in _sources: a recording's many cuts share it
        self._source_of: List[int] = []
        self._offsets: List[float] = []
        self._durations_list: List[float] = []
        self._texts: List[str] = []
        self._tags: List[str] = []
        self._durations = np.zeros(0)
        self._offsets_arr = np.zeros(0)
        self._source_arr = np.zeros(0, dtype=np.int64)

    # ---- building ----------------------------------------------------------------------------

    def _add(self, tag: str, path: Optional[str], offset: float, duration: float, text: str) -> None:
        """One seq; `path` None: the subclass's `_source` finds its audio when the seq is read."""
        index = -1
        if path is not None:
            index = self._source_index.setdefault(path, len(self._sources))
            if index == len(self._sources):
                self._sources.append(path)
        self._source_of.append(index)
        self._offsets.append(float(offset))
        self._durations_list.append(float(duration))
        self._texts.append(text)
        self._tags.append(tag)

    def _done(self, where: str) -> None:
        """The records are all added: check them once, keep them compactly."""
        if not self._tags:
            raise ConfigError(where, "holds no seqs")
        self._durations = np.asarray(self._durations_list, dtype=np.float64)
        self._durations.flags.writeable = False  # seq_durations() hands it out
        self._offsets_arr = np.asarray(self._offsets, dtype=np.float64)
        self._source_arr = np.asarray(self._source_of, dtype=np.int64)
        self._durations_list, self._offsets, self._source_of = [], [], []
        index: Dict[str, int] = {}
        for i, tag in enumerate(self._tags):
            if index.setdefault(tag, i) != i:
                raise ConfigError(where, f"seq tag {tag!r} occurs twice (seqs {index[tag]} and {i})")
        self._tag_index = index
        self._seq_lens_cache = np.rint(self._durations * FRAMES_PER_SECOND).astype(np.int64)
        if self.read_in == "server":
            self._warn_whole_files()

    def _warn_whole_files(self) -> None:
        """One log line if recordings that several seqs share are not WAV: each of those seqs sends
        the whole file (only the files that are shared are looked at: one open each)."""
        counts = np.bincount(self._source_arr[self._source_arr >= 0])
        shared = [i for i in np.flatnonzero(counts > 1).tolist() if not is_wav(self._sources[i])]
        if shared:
            sends = int(counts[shared].sum())
            log.warning(
                "%d seqs are regions of %d compressed recordings (e.g. %s): each sends its whole file; "
                "read_in='workers' lets the workers read them from a filesystem they share",
                sends,
                len(shared),
                self._sources[shared[0]],
            )

    # ---- hooks -------------------------------------------------------------------------------

    @property
    def audio_key(self) -> str:
        return "audio" if self.read_in == "server" else "audio_path"

    def seq_durations(self) -> np.ndarray:
        """Every corpus seq's duration in seconds (float64), from the manifest."""
        return self._durations

    def _num_corpus_seqs(self) -> int:
        return len(self._tags)

    def _tag(self, corpus_idx: int) -> str:
        return self._tags[corpus_idx]

    def _seq_len(self, corpus_idx: int) -> int:
        return int(self.seq_lens()[corpus_idx])

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        return self.seq_lens() if key == self.audio_key else None

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        audio = {"shape": [None], "dtype": "uint8"} if self.read_in == "server" else {"shape": [], "dtype": STRING}
        return {
            self.audio_key: audio,
            "text": {"shape": [], "dtype": STRING},
            "offset": {"shape": [], "dtype": "float64"},
            "duration": {"shape": [], "dtype": "float64"},
        }

    def _source(self, corpus_idx: int) -> Source:
        """The seq's audio file: its path, or its bytes."""
        return self._sources[int(self._source_arr[corpus_idx])]

    def _load(self, corpus_idx: int) -> Dict[str, np.ndarray]:
        source = self._source(corpus_idx)
        offset, duration = float(self._offsets_arr[corpus_idx]), float(self._durations[corpus_idx])
        if self.read_in == "workers":
            if not isinstance(source, str):
                raise ValueError(f"seq {self._tags[corpus_idx]!r} has its audio in the corpus, not in a file")
            audio = np.array(source)
        else:
            audio, offset = region_bytes(source, offset, duration)
        return {
            self.audio_key: audio,
            "text": np.array(self._texts[corpus_idx]),
            "offset": np.array(offset),
            "duration": np.array(duration),
        }


def resolve(path: str, folder: str) -> str:
    """A path as a manifest writes it: relative ones are relative to the manifest's folder."""
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(folder, path))
