"""The config fingerprint: equal on hosts that map every seq alike, different where they may not.

The server refuses a worker whose fingerprint differs, and clients keep it in resume states.
It hashes what decides a mapped seq (FINGERPRINT_COVERS):
- the config file, the source of its mappers and the local modules its values lead to
  (neither the standard library, nor installed packages, nor ppserver's own; hashed by module
  name, never by path, so copies in other folders agree);
- ppserver's own code that turns a seq into its result (SEMANTIC_MODULES: seeding, meta
  entries and validation, building the mappers, padding a batch, cutting an epoch into
  batches, the wire's dtype rules), the protocol version and ppserver's version.

Python source counts by what it does, not by how it is written: each is hashed as its syntax
tree, without line numbers and without docstrings or other lone string statements. So editing
a comment, a docstring, blank lines or the layout keeps the fingerprint, and an edit of code
changes it. Source that does not parse as Python (a RETURNN config in another syntax, a
lambda's line cut out of an expression) is hashed as its bytes.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
import textwrap
import types
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy

from ppserver.errors import ConfigError

FINGERPRINT_COVERS = "the config file, the local modules it imports, the mapper source and ppserver's mapping code"
# ppserver's modules that decide a mapped seq besides the config
SEMANTIC_MODULES = (
    "ppserver.mappers.apply",  # rng seeding, meta entries, validation
    "ppserver.mappers.api",  # the mappers a worker calls, a stream's rng
    "ppserver.mappers.returnn",  # RETURNN's TensorDicts in and out
    "ppserver.datasets.cut",  # an epoch's batches
    "ppclient.collate",  # padding a batch's seqs into one array per key
    "ppclient.wire",  # which dtypes travel, and how a seq becomes frames
)
_OWN_MAPPERS = "ppserver.mappers."  # hashed whole where a config uses them (their source and helpers)
_OWN_PACKAGES = ("ppserver", "ppclient")  # covered by SEMANTIC_MODULES, wherever they are installed
# RETURNN's view of its loaded config as a module (the functions a RETURNN config defines name it):
# the config file itself is hashed as the source
RETURNN_CONFIG_MODULE = "__returnn_config__"


def fingerprint(source: bytes, mappers: List[Optional[Callable]], roots: Iterable[Any] = (), salt: bytes = b"") -> str:
    """Hash of what decides the mapped seqs (FINGERPRINT_COVERS) for the config file `source`, its
    `mappers` and the local modules reachable from `roots` (the config's values); `salt`: what else
    the config names (the dataset a RETURNN config serves)."""
    h = hashlib.sha256(normalized(source))
    h.update(salt)
    h.update(_semantics())
    seen: set = set()
    for fn in mappers:
        for part in _source_of(fn, seen):
            h.update(normalized(part.encode("utf8", "replace")))
    for name, file in sorted(local_modules(list(roots) + list(mappers)).items()):
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ConfigError("config", f"module {name!r} ({file}) cannot be read: {exc.strerror}") from None
        data = normalized(data) if file.endswith(".py") else data
        h.update(f"\0module {name} {len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def normalized(source: bytes) -> bytes:
    """Python source as its syntax tree without positions, docstrings or comments; other bytes as they are."""
    try:
        tree = ast.parse(textwrap.dedent(source.decode("utf8")))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return source
    out: List[str] = []
    _dump(_Unsaid().visit(tree), out)
    return "".join(out).encode()


class _Unsaid(ast.NodeTransformer):
    """Drops statements that are only a string (docstrings): they do nothing."""

    def visit_Expr(self, node: ast.Expr) -> Optional[ast.Expr]:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None
        return node


def _dump(node: Any, out: List[str]) -> None:
    """Like ast.dump, but fields that are empty (None, []) are left out, so a field a newer Python
    adds to its syntax tree (type_params) does not change the text of code that does not use it."""
    if isinstance(node, ast.AST):
        out.append(f"{type(node).__name__}(")
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            out.append(f"{name}=")
            _dump(value, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for value in node:
            _dump(value, out)
            out.append(",")
        out.append("]")
    else:
        out.append(repr(node))


SEMANTICS_ENV = "PPSERVER_SEMANTICS"  # a process's hash of SEMANTIC_MODULES, for the processes it starts


def _semantics() -> bytes:
    """What decides a mapped seq besides the config: SEMANTIC_MODULES, the protocol, the version.

    Normalizing the modules costs ~30 ms; a process hands its result on to the processes it starts
    (local workers, a test's servers) in the environment, with the files' sizes and times it was
    made from, so that a process whose files are the same takes it instead of making it again."""
    from ppclient import __version__, protocol

    files = []
    for name in SEMANTIC_MODULES:
        spec = importlib.util.find_spec(name)
        files.append((name, spec.origin if spec is not None else None))
    stamp = hashlib.sha256(repr([(name, _stat(origin)) for name, origin in files]).encode()).hexdigest()[:32]
    handed = os.environ.get(SEMANTICS_ENV, "")
    if handed.startswith(stamp + "="):
        return bytes.fromhex(handed[len(stamp) + 1 :])
    parts = [f"{protocol.PROTOCOL}\n{__version__}\n".encode()]
    for name, origin in files:
        try:
            with open(origin or "", "rb") as f:
                parts.append(f"\0{name}\0".encode() + normalized(f.read()))
        except OSError:
            parts.append(f"\0{name} without source\0".encode())
    digest = hashlib.sha256(b"".join(parts)).digest()
    os.environ[SEMANTICS_ENV] = f"{stamp}={digest.hex()}"
    return digest


def _stat(path: Optional[str]) -> Any:
    try:
        st = os.stat(path or "")
    except OSError:
        return None
    return (path, st.st_size, st.st_mtime_ns)


def _source_of(obj: Any, seen: set) -> List[str]:
    if obj is None or id(obj) in seen:
        return []
    seen.add(id(obj))
    parts = []
    target: Any = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
    module = inspect.getmodule(target)
    if module is not None and module.__name__.startswith(_OWN_MAPPERS):
        target = module  # ppserver's own mappers: the helpers of their module decide the seq too
    try:
        parts.append(inspect.getsource(target))
    except (OSError, TypeError):
        parts.append(f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}")
    for inner in getattr(obj, "funcs", ()) or ():  # composed mappers such as Sequential
        parts.extend(_source_of(inner, seen))
    return parts


# ---- local modules ---------------------------------------------------------------------------
def local_modules(roots: Iterable[Any]) -> Dict[str, str]:
    """{name: file} of the modules reachable from `roots` that are neither stdlib, installed nor ppserver's.

    A kept module's globals are followed further (and its parent packages are kept), so a
    helper a helper imports counts too. Only what the config reaches counts, so the result does
    not depend on what else the process imported before.
    """
    installed = _installed_dirs()
    seen: Dict[int, Any] = {}
    checked: Dict[str, bool] = {}
    found: Dict[str, str] = {}
    pending = list(roots)
    while pending:
        for module in _referenced(pending.pop(), seen):
            name = module.__name__
            if name not in checked:
                checked[name] = _is_local(module, installed)
            if name in found or not checked[name]:
                continue
            found[name] = module.__file__ or ""
            pending.extend(list(vars(module).values()))
            parent = name.rpartition(".")[0]
            if parent and parent in sys.modules:
                pending.append(sys.modules[parent])
    return found


def _installed_dirs() -> List[str]:
    """Folders whose modules are the interpreter's or installed packages: the same on hosts that agree."""
    paths = sysconfig.get_paths()
    dirs = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        dirs += list(site.getsitepackages()) + [site.getusersitepackages()]
    except AttributeError:  # site replaced by an old virtualenv
        pass
    return sorted({os.path.realpath(d) for d in dirs if d})


def _is_local(module: types.ModuleType, installed: List[str]) -> bool:
    name = module.__name__
    if name in ("__main__", RETURNN_CONFIG_MODULE) or name.split(".")[0] in _OWN_PACKAGES:
        return False
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not os.path.isfile(file):
        return False  # built-in, frozen or namespace package
    file = os.path.realpath(file)
    parts = file.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not any(file.startswith(d + os.sep) for d in installed)


def _referenced(value: Any, seen: Dict[int, Any]) -> Iterable[types.ModuleType]:
    """Modules a config or module global leads to: its own, its defining module's, and those of what it holds.

    `seen` maps id -> object and keeps the objects alive, so an id is never reused during the walk.
    """
    stack = [value]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, complex, numpy.ndarray)):
            continue
        seen[id(obj)] = obj
        if isinstance(obj, types.ModuleType):
            yield obj
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if not callable(obj):
            continue
        for owner in {getattr(obj, "__module__", None), type(obj).__module__}:
            if isinstance(owner, str) and owner in sys.modules:
                yield sys.modules[owner]
        if inspect.isfunction(obj):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _cell_is_set(c))
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            stack.extend(obj.__dict__.values())  # __wrapped__ of decorated functions
        elif inspect.ismethod(obj):
            stack.extend((obj.__func__, obj.__self__))
        elif not isinstance(obj, type):
            # callable instances: composed mappers (Sequential(...).funcs), functools.partial, ...
            stack.extend((_attr(obj, "__dict__") or {}).values())
            stack.extend(_attr(obj, k) for k in ("func", "args", "keywords", "funcs"))


def _attr(obj: Any, name: str) -> Any:
    """getattr that survives objects whose __getattr__ raises anything."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _cell_is_set(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True
