"""Kaldi's log-mel filterbank (compute-fbank) in numpy, all frames at once.

The same computation as Kaldi's and kaldi-native-fbank's, frame by frame: frames of
`frame_length` samples every `frame_shift` (snip_edges False: round(samples / shift) frames,
the edges mirrored), DC offset removed, pre-emphasis, povey window, zero-padded to a power of
two, power spectrum, triangular mel bins, log floored at FLT_EPSILON. Here each step is one
array operation over a block of frames (one rfft, one matmul), which is what makes it cheap in
Python: per-frame calls cost some 20 us each, 20-40 ms per 9 s utterance.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Optional, Tuple, Union

import numpy as np

FLT_EPSILON = float(np.finfo(np.float32).eps)
BLOCK = 128  # frames computed at a time (buffers of some 2 MB per thread)


class KaldiFbank:
    """The fixed parts (window, mel matrix) for one set of options, made once; `__call__` maps
    float32 samples to (frames, num_mel_bins) float32 log-mels."""

    def __init__(
        self,
        num_mel_bins: int,
        sample_rate: float,
        frame_length_ms: float,
        frame_shift_ms: float,
        low_freq: float,
        high_freq: float,
        snip_edges: bool,
        preemph_coeff: float = 0.97,
    ):
        self.length = int(sample_rate * 0.001 * frame_length_ms)
        self.shift = int(sample_rate * 0.001 * frame_shift_ms)
        if self.length < 1 or self.shift < 1:
            raise ValueError(
                f"fbank: frames of {frame_length_ms} ms every {frame_shift_ms} ms at {sample_rate} Hz have no samples"
            )
        self.snip_edges = snip_edges
        self.preemph = float(preemph_coeff)
        self.fft = 1 << (self.length - 1).bit_length()  # the next power of two
        n = np.arange(self.length, dtype=np.float64)
        hann = 0.5 - 0.5 * np.cos(2 * math.pi * n / (self.length - 1)) if self.length > 1 else np.ones(1)
        self.window = hann**0.85  # povey
        self.mel = mel_matrix(num_mel_bins, self.fft, sample_rate, low_freq, high_freq)
        self.num_mel_bins = num_mel_bins
        self._local = threading.local()  # each thread's buffers: a mapper may run in several threads

    def num_frames(self, samples: int) -> int:
        if self.snip_edges:
            return 0 if samples < self.length else 1 + (samples - self.length) // self.shift
        return (samples + self.shift // 2) // self.shift

    def padded(self, x: np.ndarray) -> Tuple[np.ndarray, int]:
        """The samples with the edges mirrored as Kaldi mirrors them, and the number of frames."""
        n = self.num_frames(len(x))
        if n <= 0 or not len(x):
            return x, 0
        left = 0 if self.snip_edges else (self.length - self.shift) // 2  # frame 0 starts shift/2 - length/2 early
        right = max((n - 1) * self.shift + self.length - left - len(x), 0)
        if left or right:
            # "symmetric": x[-1] = x[0], x[N] = x[N-1], repeated for pads longer than x (Kaldi's loop)
            x = np.pad(x, (left, right), mode="symmetric")
        return x, n

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        x, n = self.padded(np.ascontiguousarray(samples, dtype=np.float32))
        out = np.empty((n, self.num_mel_bins), dtype=np.float32)
        if not n:
            return out
        frames = np.lib.stride_tricks.as_strided(
            x, shape=(n, self.length), strides=(self.shift * x.strides[0], x.strides[0]), writeable=False
        )
        for start in range(0, n, BLOCK):
            stop = min(start + BLOCK, n)
            self._block(frames[start:stop], out[start:stop])
        np.maximum(out, FLT_EPSILON, out=out)
        return np.log(out, out=out)

    def _block(self, frames: np.ndarray, out: np.ndarray) -> None:
        """Mel energies (not yet logged) of up to BLOCK frames into `out`. Every step writes into
        buffers kept between calls: fresh arrays of this size would be fresh pages from the
        kernel each time (some 2,500 page faults per 9 s utterance, more than the arithmetic)."""
        buffers: Optional[Tuple[Any, ...]] = getattr(self._local, "buffers", None)  # arrays of several dtypes
        if buffers is None:
            buffers = self._local.buffers = (
                np.zeros((BLOCK, self.fft)),  # frames, zero-padded to the FFT's size
                np.empty((BLOCK, self.length - 1)),
                np.empty((BLOCK, self.fft // 2 + 1), dtype=np.complex128),
                np.empty((BLOCK, self.fft // 2)),
                np.empty((BLOCK, self.fft // 2), dtype=np.float32),
            )
        m = len(frames)
        padded, tmp, spectrum, part, power = (b[:m] for b in buffers)
        w = padded[:, : self.length]
        np.copyto(w, frames)  # float64 from here: numpy's float64 FFT is faster than its float32 one
        w -= w.mean(axis=1, keepdims=True)  # DC offset
        np.multiply(w[:, :-1], self.preemph, out=tmp)  # pre-emphasis, x[-1] taken as x[0]
        w[:, 1:] -= tmp
        w[:, 0] *= 1.0 - self.preemph
        w *= self.window
        np.fft.rfft(padded, axis=1, out=spectrum)
        half = spectrum[:, : self.fft // 2]  # the Nyquist bin has no weight
        np.square(half.real, out=part)
        np.square(half.imag, out=power, casting="same_kind")
        np.add(power, part, out=power, casting="same_kind")
        np.matmul(power, self.mel, out=out)


def mel_matrix(num_bins: int, fft: int, sample_rate: float, low_freq: float, high_freq: float) -> np.ndarray:
    """(fft / 2, num_bins) float32 triangular mel weights, as Kaldi's MelBanks: bins evenly spaced
    on the mel scale from low_freq to high_freq (<= 0: that far below Nyquist)."""
    nyquist = 0.5 * sample_rate
    high = high_freq + nyquist if high_freq <= 0 else high_freq
    if not (0 <= low_freq < nyquist and 0 < high <= nyquist and low_freq < high):
        raise ValueError(f"fbank: low_freq {low_freq} and high_freq {high_freq} must lie within 0 to {nyquist} Hz")
    mel_low, mel_high = _mel(low_freq), _mel(high)
    delta = (mel_high - mel_low) / (num_bins + 1)
    k = np.arange(num_bins, dtype=np.float64)[None, :]
    left, center, right = mel_low + k * delta, mel_low + (k + 1) * delta, mel_low + (k + 2) * delta
    mel = _mel(sample_rate / fft * np.arange(fft // 2, dtype=np.float64))[:, None]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    weights = np.where(mel <= center, up, down)
    weights[(mel <= left) | (mel >= right)] = 0.0
    return weights.astype(np.float32)


def _mel(freq: Union[np.ndarray, float]) -> np.ndarray:
    return 1127.0 * np.log(1.0 + np.asarray(freq) / 700.0)
