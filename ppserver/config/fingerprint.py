"""The config fingerprints: equal where every seq is read and mapped alike, different where it may not be.

Three hashes, each of the one before and what it adds:
- the worker fingerprint (a `hello`'s; the server refuses a worker whose differs) hashes what
  decides how a seq is mapped (WORKER_COVERS): the config file; the source of its mappers;
  the values of the settings that decide outputs (table.py marks them: seed, mapper_api,
  map_outputs, batching, ... as the config evaluates them, so `seed = int(os.environ["SEED"])`
  counts by its value); the local modules the config uses: those its values lead to and those
  any of them, or the config, imports anywhere (at the top or inside a function, followed
  statically, without importing them); and ppserver's own code that turns a seq into its
  result (SEMANTIC_MODULES), the protocol version and ppserver's version. It holds no path,
  so copies of the same files in other folders and on other hosts agree.
- the config fingerprint (Config.fingerprint; what a trainer holding the config can compute)
  adds the dataset dict's value and the local module of a dataset class named
  'module:Name' (with the local modules it imports).
- the served fingerprint (the server's, in resume states and `info`) adds what the dataset
  tells of the data it reads (Dataset.identity(): its files' paths, sizes and mtimes), known
  only where the dataset is open.

A local module is one whose file lies outside the Python installation (its stdlib and
site-packages) and is not ppserver's; installed library code is never covered. Python source
counts by what it does, not by how it is written: each is hashed as its syntax tree, without
line numbers and without docstrings or other lone string statements, so editing a comment, a
docstring, blank lines or the layout keeps the fingerprint, and an edit of code changes it.
Source that does not parse as Python (a RETURNN config in another syntax, a lambda's line cut
out of an expression) is hashed as its bytes. A value that is a function or class counts by
its source where it is the config's or a local module's, by its name where it is installed.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.machinery
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
import textwrap
import types
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy

from ppserver.errors import ConfigError

WORKER_COVERS = "the config file, its output settings' values, the local modules it uses, its mappers and ppserver"
FINGERPRINT_COVERS = WORKER_COVERS + ", the dataset dict"  # the config fingerprint
SERVED_COVERS = FINGERPRINT_COVERS + " and the data files the dataset reads"
# ppserver's modules that decide a mapped seq besides the config
SEMANTIC_MODULES = (
    "ppserver.mappers.apply",  # rng seeding, meta entries, validation
    "ppserver.config.mappers",  # the mappers a worker calls, a stream's rng
    "ppserver.mappers.returnn",  # RETURNN's TensorDicts in and out
    "ppserver.scheduler.cut",  # an epoch's batches
    "ppclient.collate",  # padding a batch's seqs into one array per key
    "ppclient.wire",  # which dtypes travel, and how a seq becomes frames
)
_OWN_MAPPERS = "ppserver.mappers."  # hashed whole where a config uses them (their source and helpers)
_OWN_PACKAGES = ("ppserver", "ppclient")  # covered by SEMANTIC_MODULES, wherever they are installed
# RETURNN's view of its loaded config as a module (the functions a RETURNN config defines name it):
# the config file itself is hashed as the source
RETURNN_CONFIG_MODULE = "__returnn_config__"
CONFIG_MODULE = "__ppserver_config__"  # the __name__ a ppserver config runs under
_CONFIG_MODULES = ("__main__", CONFIG_MODULE, RETURNN_CONFIG_MODULE)


def worker_fingerprint(
    source: bytes,
    mappers: List[Optional[Callable]],
    roots: Iterable[Any] = (),
    salt: bytes = b"",
    values: Optional[Dict[str, Any]] = None,
) -> str:
    """What decides how a seq is mapped (WORKER_COVERS): the config file `source`, its `mappers`,
    the local modules the config uses (reached from `roots`, the config's values, and imported
    by them or by `source`), the output settings' `values`; `salt`: what else the config names
    (the dataset a RETURNN config serves)."""
    h = hashlib.sha256(normalized(source))
    h.update(salt)
    h.update(_semantics())
    seen: set = set()
    for fn in mappers:
        for part in _source_of(fn, seen):
            h.update(normalized(part.encode("utf8", "replace")))
    modules = local_modules(list(roots) + list(mappers), sources=[source])
    h.update(_modules_digest(modules))
    h.update(b"\0values\0" + canonical(values or {}))
    return h.hexdigest()[:16]


def config_fingerprint(worker: str, dataset: Any) -> str:
    """The worker fingerprint with the dataset dict's value and the local modules of the
    dataset classes it names as 'module:Name' (FINGERPRINT_COVERS)."""
    h = hashlib.sha256(f"config\0{worker}\0".encode())
    h.update(canonical(dataset))
    h.update(_modules_digest(_closure({}, dataset_modules(dataset), [])))
    return h.hexdigest()[:16]


def served_fingerprint(config: str, identity: Any) -> str:
    """The config fingerprint with the dataset's identity (its data files' paths, sizes and
    mtimes: Dataset.identity()); the same as the config's where the dataset tells nothing."""
    if not identity:
        return config
    return hashlib.sha256(f"served\0{config}\0".encode() + canonical(identity)).hexdigest()[:16]


def dataset_modules(dataset: Any) -> List[str]:
    """The modules of the dataset classes named 'module:Name' anywhere in a dataset dict."""
    out: List[str] = []
    stack = [dataset]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            cls = value.get("class")
            if isinstance(cls, str) and ":" in cls:
                out.append(cls.partition(":")[0])
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return sorted(set(out))


def normalized(source: bytes) -> bytes:
    """Python source as its syntax tree without positions, docstrings or comments; other bytes as they are."""
    tree = _parse(source)
    return source if tree is None else _tree_text(tree)


def _parse(source: bytes) -> Optional[ast.Module]:
    try:
        return ast.parse(textwrap.dedent(source.decode("utf8")))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _tree_text(tree: ast.AST) -> bytes:
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


def _module_file(name: str) -> Optional[str]:
    """The file of module `name` (None: not found), without importing it or its packages:
    find_spec imports a submodule's packages, and a worker would load the scheduler to hash
    scheduler/cut.py."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec.origin if spec is not None else None
    for folder in spec.submodule_search_locations or ():
        path = os.path.join(folder, *rest) + ".py"
        if os.path.isfile(path):
            return path
    return None


def _semantics() -> bytes:
    """What decides a mapped seq besides the config: SEMANTIC_MODULES, the protocol, the version.

    Normalizing the modules costs ~30 ms; a process hands its result on to the processes it starts
    (local workers, a test's servers) in the environment, with the files' sizes and times it was
    made from, so that a process whose files are the same takes it instead of making it again."""
    from ppclient import __version__, protocol

    files = [(name, _module_file(name)) for name in SEMANTIC_MODULES]
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


# ---- values ----------------------------------------------------------------------------------
def canonical(value: Any) -> bytes:
    """A config value as bytes that are equal in every process where the value is: plain values by
    type and repr, arrays by dtype, shape and content, containers item by item (dicts and sets in
    sorted order), functions and classes by their source (by their name where installed), other
    objects by their class and attributes. Never an id or a memory address."""
    out: List[bytes] = []
    _canonical(value, out, set(), _installed_dirs())
    return b"".join(out)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, numpy.generic)
_MAX_DEPTH = 64  # object graphs nested deeper are cut there (a value is a setting, not a data structure)


def _canonical(value: Any, out: List[bytes], active: Set[int], installed: List[str]) -> None:
    if isinstance(value, _PLAIN):
        out.append(f"{type(value).__name__}:{value!r};".encode())
        return
    if id(value) in active:
        out.append(b"<cycle>;")
        return
    if len(active) >= _MAX_DEPTH:  # `active` is the path down to here
        out.append(f"<deep {type(value).__name__}>;".encode())
        return
    active.add(id(value))
    try:
        _compound(value, out, active, installed)
    finally:
        active.discard(id(value))


def _compound(value: Any, out: List[bytes], active: Set[int], installed: List[str]) -> None:
    if isinstance(value, numpy.ndarray):
        out.append(f"ndarray:{value.dtype.str}:{value.shape}:".encode())
        if value.dtype.hasobject:
            _compound(value.tolist(), out, active, installed)
        else:
            out.append(hashlib.sha256(numpy.ascontiguousarray(value).tobytes()).digest())
        return
    if isinstance(value, (list, tuple)):
        out.append(f"{type(value).__name__}[".encode())
        for item in value:
            _canonical(item, out, active, installed)
        out.append(b"];")
        return
    if isinstance(value, (dict, set, frozenset, types.MappingProxyType)):
        pairs = value.items() if not isinstance(value, (set, frozenset)) else ((v, None) for v in value)
        items = []
        for k, v in pairs:
            kb: List[bytes] = []
            _canonical(k, kb, active, installed)
            vb: List[bytes] = []
            _canonical(v, vb, active, installed)
            items.append(b"".join(kb) + b"=" + b"".join(vb))
        out.append(f"{type(value).__name__}{{".encode() + b",".join(sorted(items)) + b"};")
        return
    if isinstance(value, types.ModuleType):
        out.append(f"module:{value.__name__};".encode())
        return
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
        code, local = _code_of(value, installed)
        out.append(code)
        if local and inspect.isfunction(value):  # what its source does not say: bound defaults, closures
            cells = [c.cell_contents if _cell_is_set(c) else None for c in value.__closure__ or ()]
            _canonical([value.__defaults__, value.__kwdefaults__, cells], out, active, installed)
        return
    if inspect.ismethod(value):
        _compound(value.__func__, out, active, installed)
        _canonical(value.__self__, out, active, installed)
        return
    # another object: its class, and what it holds
    out.append(_code_of(type(value), installed)[0])
    state = _state_of(value)
    if state is not None:
        _canonical(state, out, active, installed)
        return
    text = repr(value)
    out.append(b"?;" if " at 0x" in text else text.encode("utf8", "replace") + b";")


def _state_of(value: Any) -> Optional[Dict[str, Any]]:
    """An object's attributes: a dataclass's fields, else its __dict__ and __slots__; with
    functools.partial's func, args and keywords."""
    state: Dict[str, Any] = {}
    if dataclasses.is_dataclass(value):
        state = {f.name: _attr(value, f.name) for f in dataclasses.fields(value)}
    else:
        state = dict(_attr(value, "__dict__") or {})
        for cls in type(value).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                state.setdefault(slot, _attr(value, slot))
    for name in ("func", "args", "keywords"):
        if name not in state and _attr(value, name) is not None:
            state[name] = _attr(value, name)
    return state or None


def _code_of(obj: Any, installed: List[str]) -> Tuple[bytes, bool]:
    """A function or class: its source where it is the config's or a local module's (and True),
    else its name (and False: installed code counts by its name)."""
    module_name = getattr(obj, "__module__", None)
    name = f"{module_name}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"
    module = sys.modules.get(module_name) if isinstance(module_name, str) else None
    if module_name not in _CONFIG_MODULES and (module is None or not _is_local(module, installed)):
        return f"code:{name};".encode(), False
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return f"code:{name};".encode(), True
    digest = hashlib.sha256(normalized(source.encode("utf8", "replace"))).digest()
    return f"code:{name}:".encode() + digest + b";", True


# ---- local modules ---------------------------------------------------------------------------
def local_modules(roots: Iterable[Any], sources: Iterable[bytes] = ()) -> Dict[str, str]:
    """{name: file} of the local modules the config uses: those reachable from `roots` and those
    that they, or the Python `sources`, import (anywhere in their code, found statically).

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
    names = [n for source in sources for n in _imports(_parse(source), "")]
    return _closure(found, names, installed)


def _closure(found: Dict[str, str], names: List[str], installed: List[str]) -> Dict[str, str]:
    """`found` with the local modules named in `names` and those they import, transitively
    (resolved without importing them, as the import system would find them now)."""
    installed = installed or _installed_dirs()
    found = dict(found)
    pending = list(names)
    for name, file in found.items():
        pending.extend(_imports(_parse_file(file), _package_of(name, file)))
    looked: Set[str] = set()
    while pending:
        name = pending.pop()
        if name in looked or name in found or not name:
            continue
        looked.add(name)
        if name.split(".")[0] in _OWN_PACKAGES:
            continue
        origin = _find(name)
        if origin is None or not _is_local_file(origin, installed):
            continue
        found[name] = origin
        parent = name.rpartition(".")[0]
        if parent:
            pending.append(parent)
        pending.extend(_imports(_parse_file(origin), _package_of(name, origin)))
    return found


def _modules_digest(modules: Dict[str, str]) -> bytes:
    h = hashlib.sha256()
    for name, file in sorted(modules.items()):
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ConfigError("config", f"module {name!r} ({file}) cannot be read: {exc.strerror}") from None
        data = normalized(data) if file.endswith(".py") else data
        h.update(f"\0module {name} {len(data)}\0".encode())
        h.update(data)
    return h.digest()


def _parse_file(file: str) -> Optional[ast.Module]:
    if not file.endswith(".py"):
        return None
    try:
        with open(file, "rb") as f:
            return _parse(f.read())
    except OSError:
        return None


def _package_of(name: str, file: str) -> str:
    """The package a module's relative imports start from."""
    return name if os.path.basename(file) == "__init__.py" else name.rpartition(".")[0]


def _imports(tree: Optional[ast.AST], package: str) -> List[str]:
    """The absolute names of the modules an import statement anywhere in `tree` may load (for
    `from a import b`: a, and a.b in case b is a module)."""
    names: List[str] = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                head = ".".join(parts[: len(parts) - (node.level - 1)])
                base = ".".join(p for p in (head, base) if p)
            if not base:
                continue
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _find(name: str) -> Optional[str]:
    """The file module `name` is (or would be) loaded from, found without importing anything."""
    module = sys.modules.get(name)
    if module is not None:
        file = getattr(module, "__file__", None)
        return file if isinstance(file, str) else None
    parent, _, _ = name.rpartition(".")
    path: Optional[List[str]] = None
    if parent:
        path = _search_path(parent)
        if not path:
            return None
    try:
        spec = importlib.machinery.PathFinder.find_spec(name, path)
    except (ImportError, ValueError, OSError):
        return None
    if spec is None or not spec.has_location or not isinstance(spec.origin, str):
        return None
    return spec.origin


def _search_path(package: str) -> Optional[List[str]]:
    module = sys.modules.get(package)
    if module is not None:
        return list(getattr(module, "__path__", None) or []) or None
    parent = package.rpartition(".")[0]
    path = _search_path(parent) if parent else None
    if parent and not path:
        return None
    try:
        spec = importlib.machinery.PathFinder.find_spec(package, path)
    except (ImportError, ValueError, OSError):
        return None
    return list(spec.submodule_search_locations or []) or None if spec is not None else None


@functools.lru_cache(maxsize=1)
def _installed_dirs() -> List[str]:
    """Folders whose modules are the interpreter's or installed packages: the same on hosts that agree
    (asked once per process: sysconfig and realpath take milliseconds)."""
    paths = sysconfig.get_paths()
    dirs = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        dirs += list(site.getsitepackages()) + [site.getusersitepackages()]
    except AttributeError:  # site replaced by an old virtualenv
        pass
    return sorted({os.path.realpath(d) for d in dirs if d})


def _is_local(module: types.ModuleType, installed: List[str]) -> bool:
    name = module.__name__
    if name in _CONFIG_MODULES or name.split(".")[0] in _OWN_PACKAGES:
        return False
    file = getattr(module, "__file__", None)
    return isinstance(file, str) and _is_local_file(file, installed)


def _is_local_file(file: str, installed: List[str]) -> bool:
    """A file of a module that is neither the interpreter's nor an installed package's."""
    if not os.path.isfile(file):
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
