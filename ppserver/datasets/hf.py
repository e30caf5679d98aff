"""HFAudio: a Hugging Face `datasets` dataset saved to disk (``save_to_disk``), its Audio column
read undecoded (``Audio(decode=False)``: the file's bytes, or its path).

The rows stay in the memory-mapped Arrow files: a seq's bytes are read when it is read. The
durations come from `duration_column` where the dataset has one; else each file's header is
read once when the dataset is built (soundfile.info: the header, not the samples). The seq tag
is `id_column`'s value (default: an "id" column where there is one), else "<split>/<row>".
`datasets` is imported only when such a dataset is built (``pip install 'ppserver[hf]'``).
"""

from __future__ import annotations

import io
import os
from typing import Any, Optional, Union

from ppserver.datasets.speech import Source, SpeechCorpus
from ppserver.errors import ConfigError, one_line


def _import(name: str, extra: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError("dataset", f"HFAudio needs {name}: pip install 'ppserver[{extra}]'") from None


class HFAudio(SpeechCorpus):
    """Seqs of a saved Hugging Face dataset (`split` of a DatasetDict); see SpeechCorpus for the keys,
    `read_in` (rows whose audio is bytes need "server") and lengths."""

    def __init__(
        self,
        *,
        path: Union[str, os.PathLike],
        split: Optional[str] = None,
        audio_column: str = "audio",
        text_column: str = "text",
        duration_column: Optional[str] = None,
        id_column: Optional[str] = None,
        **options: Any,
    ):
        super().__init__(**options)
        datasets = _import("datasets", "hf")
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise ConfigError("path", f"must be the folder of a dataset saved with save_to_disk, got {path!r}")
        try:
            loaded = datasets.load_from_disk(os.fspath(path))
        except Exception as exc:
            raise ConfigError("path", f"cannot load {os.fspath(path)!r}: {one_line(exc)}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError("split", f"must be one of {sorted(loaded)}, got {split!r}")
            loaded = loaded[split]
        columns = loaded.column_names
        if id_column is None and "id" in columns:
            id_column = "id"
        for key, column in (
            ("audio_column", audio_column),
            ("text_column", text_column),
            ("duration_column", duration_column),
            ("id_column", id_column),
        ):
            if column is not None and column not in columns:
                raise ConfigError(key, f"{column!r} is not a column of the dataset; it has {columns}")
        self._rows = loaded.cast_column(audio_column, datasets.Audio(decode=False)).select_columns([audio_column])
        self._audio_column = audio_column
        if self.read_in == "workers" and len(self._rows) and self._rows[0][audio_column].get("bytes") is not None:
            raise ConfigError("read_in", "'workers' needs files, and the dataset holds its audio's bytes: use 'server'")
        texts = loaded[text_column]
        durations = loaded[duration_column] if duration_column is not None else None
        tags = loaded[id_column] if id_column is not None else [f"{split or 'rows'}/{i}" for i in range(len(texts))]
        for i, text in enumerate(texts):
            duration = durations[i] if durations is not None else self._measure(i)
            self._add(str(tags[i]), None, 0.0, float(duration), str(text))
        self._done("path")

    def _source(self, corpus_idx: int) -> Source:
        audio = self._rows[corpus_idx][self._audio_column]
        if audio.get("bytes") is not None:
            if self.read_in == "workers":
                raise ValueError(f"row {corpus_idx} holds its audio's bytes, not a file for the workers")
            return bytes(audio["bytes"])
        if not audio.get("path"):
            raise ValueError(f"row {corpus_idx}: its audio has neither bytes nor a path")
        return str(audio["path"])

    def _measure(self, corpus_idx: int) -> float:
        """A row's duration from its file's header."""
        soundfile = _import("soundfile", "hf")
        source = self._source(corpus_idx)
        try:
            info = soundfile.info(io.BytesIO(source) if isinstance(source, bytes) else source)
        except Exception as exc:
            raise ConfigError("duration_column", f"row {corpus_idx}: no duration column and {one_line(exc)}") from None
        return float(info.frames) / float(info.samplerate)
