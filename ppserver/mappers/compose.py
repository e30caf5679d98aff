"""Composable postprocessing on seq dicts, mirroring RETURNN's ``Sequential`` and ``LaplaceOrdering``.

Two styles exist: ``map_seq`` functions take and return one seq, ``map_seq_stream``
functions take and return an iterator of seqs. ``Sequential`` composes either style
(do not mix them in one ``Sequential``).
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Dict, Iterable, Iterator, List

from ppserver.mappers.outputs import Templates, Undeclared, declared_outputs, mapper_name

__all__ = ["Sequential", "LaplaceOrdering"]

Seq = Dict[str, Any]
_MISSING = object()


class Sequential:
    """``Sequential(f, g)(x, **kw) == g(f(x, **kw), **kw)``.

    Its outputs are those its functions declare, one after the other (nested Sequentials
    included); a function that declares none is taken to keep the templates it gets, unless one
    before it changed them (Undeclared: the config then needs map_outputs)."""

    def __init__(self, *funcs: Callable):
        for f in funcs:
            if not callable(f):
                raise TypeError(f"Sequential expects callables, got {f!r}")
        self.funcs = funcs

    def __call__(self, arg: Any, **kwargs) -> Any:
        for func in self.funcs:
            arg = func(arg, **kwargs)
        return arg

    @property
    def preserves_num_seqs(self) -> bool:
        """True only if every composed function declares it keeps the number of seqs."""
        return all(getattr(f, "preserves_num_seqs", False) for f in self.funcs)

    def outputs(self, inputs: Templates) -> Templates:
        templates, changed = inputs, None
        for func in self._flat():
            out = declared_outputs(func, templates)
            if out is None:
                if changed is not None:
                    raise Undeclared(func, changed)
                continue
            if out != templates:
                changed = func
            templates = out
        return templates

    def _flat(self) -> Iterator[Callable]:
        for func in self.funcs:
            if isinstance(func, Sequential):
                yield from func._flat()
            else:
                yield func

    def __repr__(self) -> str:
        return f"Sequential({', '.join(map(mapper_name, self.funcs))})"


class LaplaceOrdering:
    """``map_seq_stream``: groups seqs into bins of ``num_seqs_per_bin`` and sorts each bin by length,
    alternating ascending and descending, so neighbouring seqs have similar lengths (less padding).

    ``complete_frac`` values stay at their stream positions so they remain monotonic for the trainer.
    """

    preserves_num_seqs = True

    def __init__(self, num_seqs_per_bin: int, length_key: str = "data"):
        if isinstance(num_seqs_per_bin, bool) or not isinstance(num_seqs_per_bin, int) or num_seqs_per_bin < 1:
            raise ValueError(f"num_seqs_per_bin must be a positive integer, got {num_seqs_per_bin!r}")
        self.num_seqs_per_bin = num_seqs_per_bin
        self.length_key = length_key

    def __call__(self, iterator: Iterable[Seq], **kwargs) -> Iterator[Seq]:
        iterator = iter(iterator)
        descending = False
        buffer = list(islice(iterator, self.num_seqs_per_bin))
        exhausted = False
        while True:
            fracs = [seq.get("complete_frac", _MISSING) for seq in buffer]
            buffer.sort(key=self._seq_len, reverse=descending)
            next_buffer: List[Seq] = []
            # Pull the next bin one item per yielded item, spreading upstream work evenly.
            for seq, frac in zip(buffer, fracs):
                yield self._with_frac(seq, frac)
                if not exhausted:
                    try:
                        next_buffer.append(next(iterator))
                    except StopIteration:
                        exhausted = True
            if len(buffer) < self.num_seqs_per_bin:
                break
            descending = not descending
            buffer = next_buffer

    def outputs(self, inputs: Templates) -> Templates:
        """It reorders seqs and keeps them as they are."""
        return inputs

    def _seq_len(self, seq: Seq) -> int:
        return seq[self.length_key].shape[0]

    @staticmethod
    def _with_frac(seq: Seq, frac: Any) -> Seq:
        if seq.get("complete_frac", _MISSING) is frac:
            return seq
        out = dict(seq)  # a new dict so the caller's seq objects are left untouched
        if frac is _MISSING:
            del out["complete_frac"]
        else:
            out["complete_frac"] = frac
        return out

    def __repr__(self) -> str:
        return f"LaplaceOrdering({self.num_seqs_per_bin}, length_key={self.length_key!r})"
