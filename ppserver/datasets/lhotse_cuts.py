"""LhotseCuts: a Lhotse CutSet manifest (``cuts.jsonl.gz``), read lazily with Lhotse, one seq per cut.

Each cut's seq: the bytes of its recording's audio source for the cut's region (`offset` is
the cut's start, `duration` its duration; see audiofiles.py: a WAV source sends the region only,
a compressed one the whole file) and the text of its supervisions, joined by spaces. The seq tag
is the cut's id. The manifest is read once, one cut at a time: what is kept per cut is its
source (shared by the cuts of one recording), offset, duration, text and id. Lhotse is imported
only when such a dataset is built (``pip install 'ppserver[lhotse]'``).
"""

from __future__ import annotations

import os
from typing import Any, Union

from ppserver.datasets.speech import SpeechCorpus
from ppserver.errors import ConfigError, one_line


def _import_lhotse() -> Any:
    try:
        import lhotse
    except ImportError:
        raise ConfigError("dataset", "LhotseCuts needs lhotse: pip install 'ppserver[lhotse]'") from None
    return lhotse


class LhotseCuts(SpeechCorpus):
    """Seqs of a Lhotse CutSet; see SpeechCorpus for the keys, `read_in` and lengths. Cuts of a
    one-channel recording in one file (a path as Lhotse reads it: relative to the working
    folder); any other (mixed cuts, several channels, URLs, commands, recordings with
    transforms) is refused in one line naming the cut."""

    def __init__(self, *, cuts: Union[str, os.PathLike], **options: Any):
        super().__init__(**options)
        lhotse = _import_lhotse()
        if not isinstance(cuts, (str, os.PathLike)):
            raise ConfigError("cuts", f"must be the path of a CutSet manifest, got {cuts!r}")
        path = os.fspath(cuts)
        if not os.path.isfile(path):
            raise ConfigError("cuts", f"no such file: {path!r}")
        try:
            cutset = lhotse.CutSet.from_jsonl_lazy(path)
            for cut in cutset:
                self._cut(cut)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError("cuts", f"cannot read {path!r}: {one_line(exc)}") from None
        self._done("cuts")

    def _cut(self, cut: Any) -> None:
        recording = getattr(cut, "recording", None)
        if recording is None or not hasattr(cut, "start"):
            raise ConfigError("cuts", f"cut {cut.id!r} is a {type(cut).__name__} without one recording")
        if recording.transforms:
            raise ConfigError("cuts", f"cut {cut.id!r}: its recording has transforms (speed, volume, ...)")
        if recording.num_channels != 1:  # the seq could not say which channel the cut means
            raise ConfigError("cuts", f"cut {cut.id!r}: its recording has {recording.num_channels} channels, not 1")
        if len(recording.sources) != 1:
            raise ConfigError("cuts", f"cut {cut.id!r}: its recording has {len(recording.sources)} audio sources")
        source = recording.sources[0]
        if source.type != "file":
            raise ConfigError("cuts", f"cut {cut.id!r}: audio source of type {source.type!r} (only 'file')")
        text = " ".join(s.text for s in cut.supervisions if s.text)
        self._add(cut.id, source.source, cut.start, cut.duration, text)
