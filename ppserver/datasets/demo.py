"""DemoDataset: a synthetic speech-like corpus, each seq made on demand from (seed, index), for the
demo, the tests and the benchmarks."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ppserver.datasets.base import Dataset, is_int
from ppserver.errors import ConfigError

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised integer hash: lengths for any number of seqs without one RNG per seq."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


class DemoDataset(Dataset):
    """Synthetic speech-like corpus, each seq generated on demand from (seed, index).

    "data": float32 (T, num_features) log-mel-like values in [-10, 5];
    "classes": int32 (max(1, T // 8),) labels in [0, num_classes). Tags are "demo-<i>".
    `ordering`: the options of Dataset (seq_ordering, order_seed, partition_epoch, fixed_random_seed).
    """

    def __init__(
        self,
        *,
        num_seqs: int = 200,
        seed: int = 0,
        min_frames: int = 50,
        max_frames: int = 400,
        num_features: int = 80,
        num_classes: int = 40,
        **ordering: Any,
    ):
        super().__init__(**ordering)
        for key, value, low in (
            ("num_seqs", num_seqs, 1),
            ("seed", seed, 0),
            ("min_frames", min_frames, 1),
            ("max_frames", max_frames, 1),
            ("num_features", num_features, 1),
            ("num_classes", num_classes, 1),
        ):
            if not is_int(value) or value < low:
                raise ConfigError(key, f"must be an integer >= {low}, got {value!r}")
        if seed >= 2**63:
            raise ConfigError("seed", f"must be < 2**63, got {seed!r}")
        if max_frames < min_frames:
            raise ConfigError("max_frames", f"must be >= min_frames ({min_frames}), got {max_frames}")
        self.num_seqs_total = int(num_seqs)
        self.seed = int(seed)
        self.min_frames = int(min_frames)
        self.max_frames = int(max_frames)
        self.num_features = int(num_features)
        self.num_classes = int(num_classes)

    def seq_lens(self) -> np.ndarray:
        if self._seq_lens_cache is None:
            idx = np.arange(self.num_seqs_total, dtype=np.uint64)
            h = _splitmix64(_splitmix64(np.full_like(idx, self.seed)) ^ idx)
            span = np.uint64(self.max_frames - self.min_frames + 1)
            self._seq_lens_cache = (h % span).astype(np.int64) + self.min_frames
        return self._seq_lens_cache

    def _num_corpus_seqs(self) -> int:
        return self.num_seqs_total

    def _seq_len(self, corpus_idx: int) -> int:
        return int(self.seq_lens()[corpus_idx])

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        if key == "data":
            return self.seq_lens()
        return _label_lens(self.seq_lens()) if key == "classes" else None

    def _tag(self, corpus_idx: int) -> str:
        return f"demo-{corpus_idx}"

    def _corpus_idx_for_tag(self, tag: str) -> Optional[int]:
        num = tag[len("demo-") :] if tag.startswith("demo-") else ""
        if num.isdigit() and str(int(num)) == num and int(num) < self.num_seqs_total:
            return int(num)
        return None

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        lens = self.seq_lens()
        labels = _label_lens(lens)
        t_dim = int(lens[0]) if lens.min() == lens.max() else None
        l_dim = int(labels[0]) if labels.min() == labels.max() else None
        return {
            "data": {"shape": [t_dim, self.num_features], "dtype": "float32"},
            "classes": {"shape": [l_dim], "dtype": "int32"},
        }

    def _load(self, corpus_idx: int) -> Dict[str, np.ndarray]:
        num_frames = self._seq_len(corpus_idx)
        rng = np.random.default_rng([self.seed, corpus_idx])
        freqs = np.linspace(0.0, 1.0, self.num_features)[None, :]
        times = np.linspace(0.0, 1.0, num_frames)[:, None]
        # Spectral tilt: loud low frequencies, quiet high ones.
        spec = rng.uniform(1.0, 3.0) - rng.uniform(5.0, 8.0) * freqs
        # A few formant-like bumps whose centres drift slowly over time.
        for _ in range(3):
            centre = rng.uniform(0.05, 0.7) + rng.uniform(0.02, 0.1) * np.sin(
                2 * np.pi * rng.uniform(0.5, 4.0) * times + rng.uniform(0, 2 * np.pi)
            )
            width = rng.uniform(0.02, 0.08)
            spec = spec + rng.uniform(1.0, 3.0) * np.exp(-0.5 * ((freqs - centre) / width) ** 2)
        # Smooth loudness contour with quieter edges, like leading/trailing silence.
        energy = sum(
            rng.uniform(0.3, 1.0) * np.sin(2 * np.pi * rng.uniform(1.0, 8.0) * times + rng.uniform(0, 2 * np.pi))
            for _ in range(3)
        )
        energy = energy - 4.0 * (1.0 - np.sin(np.pi * times) ** 0.5)
        spec = spec + energy + rng.normal(0.0, 0.5, size=(num_frames, self.num_features))
        data = np.clip(spec, -10.0, 5.0).astype(np.float32)
        classes = rng.integers(0, self.num_classes, size=int(_label_lens(num_frames)), dtype=np.int32)
        return {"data": data, "classes": classes}


def _label_lens(frames: Any) -> Any:
    """A seq's number of labels (`classes`) for its frames (an int, or an array of them)."""
    return np.maximum(frames // 8, 1)
