"""What a mapper declares it returns, as templates (the config's `map_outputs`, if set, comes
first: config/mappers.py).

A mapper declares its outputs with a method (or, for a function, an attribute)
``outputs(inputs) -> templates``: given the templates of the seqs it gets, those of the seqs it
returns (raising ValueError or KeyError, one line, where the inputs lack what it needs). A
``functools.partial`` of such a function passes its keywords on: ``outputs(inputs, **keywords)``.
A mapper that declares nothing is taken to keep the templates it gets (the default since before
mappers declared anything: outputs are checked against the dataset's keys), which is only
believable where nothing before it changed them: there `map_outputs` is required, and the
server refuses to start without it rather than fail at the first seq.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional

Templates = Dict[str, Dict[str, Any]]


class Undeclared(Exception):
    """A mapper that declares no outputs follows mappers that changed the templates (`changed`)."""

    def __init__(self, mapper: Any, changed: Any):
        super().__init__(
            f"{mapper_name(mapper)} declares no outputs and follows {mapper_name(changed)}, which changes the keys"
        )
        self.mapper = mapper
        self.changed = changed


def mapper_name(func: Any) -> str:
    """A function by its name (its repr holds an address, which differs in every process)."""
    if isinstance(func, functools.partial):
        args = [mapper_name(func.func), *map(repr, func.args), *(f"{k}={v!r}" for k, v in func.keywords.items())]
        return f"functools.partial({', '.join(args)})"
    if inspect.isfunction(func) or inspect.isbuiltin(func):
        return f"{func.__module__}.{func.__qualname__}"
    return repr(func)


def declared_outputs(mapper: Any, inputs: Templates) -> Optional[Templates]:
    """The templates of what `mapper` returns for seqs of `inputs`, as it declares them (None: it
    declares nothing)."""
    keywords: Dict[str, Any] = {}
    if isinstance(mapper, functools.partial):
        keywords = dict(mapper.keywords)
        mapper = mapper.func
    declare: Optional[Callable[..., Templates]] = getattr(mapper, "outputs", None)
    if not callable(declare):
        return None
    return declare(inputs, **keywords)
