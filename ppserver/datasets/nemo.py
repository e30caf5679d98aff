"""AudioManifest: NeMo's JSON-lines manifests of audio files, durations and transcripts.

Each line is an object with `audio_filepath` (relative paths are relative to the manifest's
folder), `duration` (seconds), `text` and optionally `offset` (seconds into the file) and `id`
or `utt_id` (the seq tag; else the path as written, with "@offset" where an offset is given).
Several manifests are concatenated in the order given.
"""

from __future__ import annotations

import json
import os
from typing import Any, List, Union

from ppserver.datasets.speech import SpeechCorpus, resolve
from ppserver.errors import ConfigError

REQUIRED = ("audio_filepath", "duration", "text")


class AudioManifest(SpeechCorpus):
    """Seqs of one or more NeMo manifests; see SpeechCorpus for the keys, `read_in` and lengths."""

    def __init__(self, *, manifest: Union[str, os.PathLike, List[Union[str, os.PathLike]]], **options: Any):
        super().__init__(**options)
        paths = [manifest] if isinstance(manifest, (str, os.PathLike)) else manifest
        if not isinstance(paths, (list, tuple)) or not paths:
            raise ConfigError("manifest", f"must be a manifest path or a non-empty list of them, got {manifest!r}")
        for path in paths:
            if not isinstance(path, (str, os.PathLike)):
                raise ConfigError("manifest", f"entries must be file paths, got {path!r}")
            self._read(os.fspath(path))
        self._done("manifest")

    def _read(self, path: str) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            f = open(path, encoding="utf-8")
        except OSError as exc:
            raise ConfigError("manifest", f"cannot read {path!r}: {exc.strerror}") from None
        with f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    self._line(path, number, line, folder)

    def _line(self, path: str, number: int, line: str, folder: str) -> None:
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise ConfigError("manifest", f"{where}: not a JSON object: {exc}") from None
        if not isinstance(entry, dict):
            raise ConfigError("manifest", f"{where}: not a JSON object")
        for key in REQUIRED:
            if key not in entry:
                raise ConfigError("manifest", f"{where}: no {key!r}")
        audio, text = entry["audio_filepath"], entry["text"]
        if not isinstance(audio, str) or not audio:
            raise ConfigError("manifest", f"{where}: 'audio_filepath' must be a path, got {audio!r:.80}")
        if not isinstance(text, str):
            raise ConfigError("manifest", f"{where}: 'text' must be a string, got {text!r:.80}")
        duration, offset = _seconds(entry, "duration", where), _seconds(entry, "offset", where)
        tag = entry.get("id", entry.get("utt_id"))
        if tag is None:
            tag = audio if "offset" not in entry else f"{audio}@{offset:g}"
        self._add(str(tag), resolve(audio, folder), offset, duration, text)


def _seconds(entry: dict, key: str, where: str) -> float:
    value = entry.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError("manifest", f"{where}: {key!r} must be a number of seconds >= 0, got {value!r:.80}")
    return float(value)
