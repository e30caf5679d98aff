"""Config loading, output validation and the config fingerprint, through the CLI where a user sees them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import (
    REPO,
    SCALE_MAPPER,
    assert_same_epoch,
    collect,
    error_line,
    free_port,
    numpy_config,
    read,
    reference,
    run_cli,
    run_server,
    run_worker_host,
    wait_for,
    write_config,
)

import ppclient
from ppserver.config.settings import from_settings, load_config
from ppserver.errors import ConfigError
from ppserver.mappers.apply import MappingError, StreamValidator, apply_map_seq, run_stream, validate

IDENTITY = "dataset = {'class': 'DemoDataset', 'num_seqs': 3}\nmap_seq = lambda s, **k: s\n"


def serve(cfg: str) -> subprocess.CompletedProcess:
    return run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0", "--workers", "0")


def worker(cfg: str) -> subprocess.CompletedProcess:
    # nothing listens there: a config that loads would make it wait for the server until the timeout
    return run_cli("worker", cfg, "--connect", f"tcp://127.0.0.1:{free_port()}", "--procs", "1")


def expect_config_error(key: str, fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert info.value.key == key, str(info.value)
    assert "\n" not in str(info.value)
    return info.value


def settings(**extra):
    return {"dataset": {"class": "DemoDataset"}, "map_seq": lambda s, **k: s, **extra}


def seq_of(**arrays):
    return {**arrays, "seq_tag": "t-1", "seq_idx": 1, "complete_frac": 0.5}


# ---- 11: output keys ------------------------------------------------------------------------


@pytest.mark.unit
def test_non_str_output_key_is_a_mapping_error_with_the_seq_tag():
    templates = {"data": {"shape": [None], "dtype": "float32"}}
    arr = np.zeros(3, np.float32)
    with pytest.raises(MappingError, match="output key 3 is a int") as info:
        validate({**seq_of(data=arr), 3: arr}, templates)
    assert info.value.seq_tag == "t-1"
    with pytest.raises(MappingError, match=r"output key \(1, 2\)") as info:
        apply_map_seq(lambda s, **k: {**s, (1, 2): s["data"]}, seq_of(data=arr), epoch=1, seed=0, templates=templates)
    assert info.value.seq_tag == "t-1"


@pytest.mark.processes
def test_non_str_output_key_reaches_the_client_as_mapper_error(tmp_path):
    cfg = numpy_config(tmp_path, "def map_seq(seq, **kwargs):\n    return {**seq, 3: seq['data']}\n", n=5)
    with run_server(cfg, workers=1) as srv, srv.client(timeout=20) as c:
        with pytest.raises(ppclient.MapperError, match="output key 3") as info:
            collect(c.epoch(1))
        assert info.value.seq_tag == "seq-0"


# ---- 12: map_outputs dtypes -----------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "written, kept",
    [
        ("float32", "float32"),
        ("=f4", "float32"),
        (np.float32, "float32"),
        ("int64", "int64"),
        ("U5", "<U5"),
        ("S3", "|S3"),
        (">f4", ">f4"),
        (">i2", ">i2"),
        ("M8[s]", "datetime64[s]"),
    ],
)
def test_map_outputs_keeps_a_dtype_numpy_reads_back(written, kept):
    cfg = from_settings(settings(map_outputs={"x": {"shape": (None,), "dtype": written}}))
    assert cfg.map_outputs == {"x": {"shape": [None], "dtype": kept}}
    assert np.dtype(kept) == np.dtype(written)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["nonsense", "O", "f4,i4", "2f4", "V4", "U", "S"])
def test_map_outputs_refuses_dtypes_no_seq_can_match(dtype):
    expect_config_error("map_outputs", from_settings, settings(map_outputs={"x": {"shape": (), "dtype": dtype}}))


@pytest.mark.unit
def test_validate_ignores_byte_order_and_names_dtypes_distinctly():
    def check(arr, dtype):
        validate(seq_of(x=arr), {"x": {"shape": [None], "dtype": dtype}})

    check(np.arange(3, dtype=">f4"), "float32")
    check(np.arange(3, dtype="<f4"), ">f4")
    check(np.array(["abcde"], dtype=">U5"), "<U5")
    with pytest.raises(MappingError, match="got float64, expected float32"):
        check(np.arange(3, dtype="f8"), "float32")
    with pytest.raises(MappingError, match="got <U5, expected <U3"):
        check(np.array(["abcde"], dtype="U5"), "<U3")
    with pytest.raises(MappingError, match="got >f8, expected float32"):
        check(np.arange(3, dtype=">f8"), ">f4")


@pytest.mark.unit
def test_outputs_are_converted_to_native_byte_order():
    templates = {"x": {"shape": [None], "dtype": ">f4"}, "u": {"shape": [], "dtype": "U5"}}
    values = np.arange(4, dtype=">f4")

    def map_seq(seq, **kwargs):
        return {"x": values, "u": np.array("abcde", dtype=">U5")}

    out = apply_map_seq(map_seq, seq_of(), epoch=1, seed=0, templates=templates)
    for key, want in (("x", values), ("u", np.array("abcde"))):
        assert out[key].dtype.isnative and out[key].dtype == want.dtype.newbyteorder("=")
        assert np.array_equal(out[key], want)
    assert values.dtype.str == ">f4"  # converted by copy, the mapper's array is untouched

    def stream(seqs, **kwargs):
        for seq in seqs:
            yield {**seq, "x": values}

    outs = list(
        run_stream(stream, iter([seq_of(), seq_of()]), epoch=1, seed=0, partition=0, templates={"x": templates["x"]})
    )
    assert len(outs) == 2 and all(o["x"].dtype.isnative and np.array_equal(o["x"], values) for o in outs)
    assert StreamValidator({"x": templates["x"]})(seq_of(x=values))["x"].dtype.str == "<f4"


@pytest.mark.processes
def test_flexible_and_big_endian_map_outputs_are_served_in_native_order(tmp_path):
    body = """
    def map_seq(seq, **kwargs):
        return {"feat": seq["data"].astype(">f4"), "name": np.array([seq["seq_tag"][:5]], dtype="U5")}
    map_outputs = {"feat": {"shape": (None, 8), "dtype": ">f4"}, "name": {"shape": (1,), "dtype": "U5"}}
    """
    cfg = numpy_config(tmp_path, body, n=6)
    with run_server(cfg, workers=1) as srv, srv.client() as c:
        assert c.info()["data_keys"] == {
            "feat": {"shape": [None, 8], "dtype": ">f4"},
            "name": {"shape": [1], "dtype": "<U5"},
        }
        got = collect(c.epoch(1))
    want = reference(cfg, 1)
    assert len(got) == 6
    for g, w in zip(got, want):
        assert g["feat"].dtype == np.float32 and g["feat"].dtype.isnative
        assert np.array_equal(g["feat"], w["feat"]) and g["name"].tolist() == [w["seq_tag"][:5]]


# ---- 13a: unknown names ---------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "line, key, hint",
    [
        ("numWorkers = 3", "numWorkers", "num_workers"),
        ("bufSize = 2", "bufSize", "buf_size"),
        ("buf_sise = 2", "buf_sise", "buf_size"),
        ("Dataset = {}", "Dataset", "dataset"),
        ("frobnicate = 1", "frobnicate", None),
    ],
)
def test_unknown_name_is_an_error_with_a_suggestion(tmp_path, line, key, hint):
    cfg = write_config(tmp_path, IDENTITY + line + "\n")
    err = expect_config_error(key, load_config, cfg)
    assert "helpers must be UPPER_CASE or start with '_'" in str(err)
    if hint:
        assert f"(did you mean '{hint}'?)" in str(err)
    else:
        assert "did you mean" not in str(err)


@pytest.mark.unit
def test_progress_interval_is_seconds_and_zero_turns_it_off():
    assert from_settings(settings()).progress_interval == 30.0
    assert from_settings(settings(progress_interval=0)).progress_interval == 0.0
    assert from_settings(settings(progress_interval=2.5)).progress_interval == 2.5
    for bad in (-1, "30", True, float("nan")):
        err = expect_config_error("progress_interval", from_settings, settings(progress_interval=bad))
        assert "must be a number >= 0" in str(err)


@pytest.mark.unit
def test_max_request_bytes_is_at_most_the_header_cap():
    assert from_settings(settings()).max_request_bytes == 1 << 20
    assert from_settings(settings(max_request_bytes=4096)).max_request_bytes == 4096
    for bad in (16 << 20, (1 << 20) + 1, 1023, "1M"):
        err = expect_config_error("max_request_bytes", from_settings, settings(max_request_bytes=bad))
        assert f"must be an int from 1024 to {1 << 20}, got {bad!r}" in str(err)


@pytest.mark.unit
def test_helpers_are_ignored(tmp_path):
    cfg = write_config(
        tmp_path,
        """
        from __future__ import annotations
        import numpy as np
        from functools import partial
        from ppserver.mappers.compose import Sequential
        _private = 1
        N_SEQS = 3
        X2 = [1]
        class Helper:
            pass
        def scale(seq, **kwargs):
            return seq
        scaled = partial(scale)
        pipeline = Sequential(scale)
        dataset = {"class": "DemoDataset", "num_seqs": N_SEQS}
        map_seq = pipeline
        num_workers = 2
    """,
    )
    c = load_config(cfg)
    assert c.num_workers == 2 and c.map_seq is not None


@pytest.mark.processes
def test_unknown_camel_case_name_stops_serve(tmp_path):
    line = error_line(serve(write_config(tmp_path, IDENTITY + "numWorkers = 3\n")))
    assert "'numWorkers'" in line and "did you mean 'num_workers'" in line


# ---- 13b: dataset construction --------------------------------------------------------------

BAD_DATASETS = """
import os
from ppserver.datasets.base import Dataset
from ppserver.errors import ConfigError

class Raises(Dataset):
    def __init__(self, *, kind, **kwargs):
        super().__init__(**kwargs)
        if kind == "value":
            raise ValueError("bad corpus\\nsecond line")
        if kind == "missing":
            open(os.path.join(os.path.dirname(__file__), "no_such_corpus.txt"))
        if kind == "config":
            raise ConfigError("num_frames", "must be even,\\nnot odd")
        if kind == "exit":
            raise SystemExit(3)
"""


def dataset_config(tmp_path, kind: str) -> str:
    (tmp_path / "bad_ds_mod.py").write_text(BAD_DATASETS)
    return write_config(
        tmp_path,
        f"""
        import os, sys
        sys.path.insert(0, os.path.dirname(__file__))
        dataset = {{"class": "bad_ds_mod:Raises", "kind": {kind!r}}}
        map_seq = lambda s, **k: s
    """,
    )


@pytest.mark.processes
@pytest.mark.parametrize(
    "kind, key, text",
    [
        ("value", "dataset", "Raises: ValueError: bad corpus second line"),
        ("missing", "dataset", "Raises: FileNotFoundError: [Errno 2] No such file or directory:"),
        ("exit", "dataset", "Raises: SystemExit: 3"),
        ("config", "num_frames", "must be even, not odd"),
    ],
)
def test_failing_dataset_constructor_stops_serve_with_one_line(tmp_path, kind, key, text):
    line = error_line(serve(dataset_config(tmp_path, kind)))
    assert f"'{key}'" in line and text in line
    if kind == "missing":
        assert "no_such_corpus.txt" in line


# ---- 13c, 13d: config files that do not load ------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize(
    "stop, what",
    [
        ("import sys\nsys.exit(0)", "called sys.exit(0)"),
        ("import sys\nsys.exit('bye')", "called sys.exit('bye')"),
        ("raise SystemExit", "called sys.exit()"),
        ("raise KeyboardInterrupt", "raised KeyboardInterrupt"),
    ],
)
def test_config_that_exits_while_loading_is_a_config_error(tmp_path, stop, what):
    cfg = write_config(tmp_path, IDENTITY + stop + "\n", name="stopping_cfg.py")
    for res in (serve(cfg), worker(cfg)):
        line = error_line(res)
        assert "stopping_cfg.py" in line and "stopped while loading" in line and what in line


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["missing", "directory", "syntax"])
def test_unreadable_config_file_is_a_config_error(tmp_path, kind):
    path = str(tmp_path / "the_cfg.py")
    if kind == "directory":
        os.mkdir(path)
    elif kind == "syntax":
        write_config(tmp_path, "dataset = {\n", name="the_cfg.py")
    for res in (serve(path), worker(path)):
        assert "the_cfg.py" in error_line(res)


# ---- 14: fingerprint ------------------------------------------------------------------------

HELPER_CONFIG = """
import os, sys
sys.path.insert(0, os.path.dirname(__file__))
{imports}
_r = np.random.RandomState(7)
SEQS = [{{"data": _r.randn(10, 8).astype("float32")}} for _ in range(12)]
dataset = {{"class": "NumpyDataset", "seqs": SEQS}}
"""

HELPER_FILES = {
    "fp_helper.py": "import fp_deep\n\ndef scale(seq, **kwargs):\n    return fp_deep.scale(seq)\n\nmap_seq = scale\n",
    "fp_deep.py": "def scale(seq):\n    seq['data'] = seq['data'] * 2\n    return seq\n",
    "fp_pkg/__init__.py": "FACTOR = 2\n",
    "fp_pkg/sub.py": "def map_seq(seq, **kwargs):\n    return seq\n",
    "fp_unrelated.py": "X = 1\n",
    "fp_lazy.py": "def map_seq(seq, **kwargs):\n    import fp_deep\n\n    return fp_deep.scale(seq)\n",
}

# How the config reaches a local module, and which file a host may have edited.
REACH = {
    "module": (
        "import numpy as np\nimport fp_helper\ndef map_seq(seq, **kwargs):\n    return fp_helper.scale(seq)",
        "fp_helper.py",
    ),
    "function": ("import numpy as np\nfrom fp_helper import map_seq", "fp_helper.py"),
    "transitive": ("import numpy as np\nfrom fp_helper import map_seq", "fp_deep.py"),
    "sequential": (
        "import numpy as np, importlib\nfrom ppserver.mappers.compose import Sequential\n"
        "map_seq = Sequential(importlib.import_module('fp_helper').scale)",
        "fp_helper.py",
    ),
    "package": ("import numpy as np\nfrom fp_pkg.sub import map_seq", "fp_pkg/__init__.py"),
    # imported only when the mapper runs (in a worker, after the fingerprint is made)
    "lazy": (
        "import numpy as np\ndef map_seq(seq, **kwargs):\n    import fp_deep\n    return fp_deep.scale(seq)",
        "fp_deep.py",
    ),
    "lazy in a helper": (
        "import numpy as np\nimport fp_lazy\nmap_seq = fp_lazy.map_seq",
        "fp_deep.py",
    ),
}


def helper_dir(root, reach: str) -> str:
    """A config folder with local helper modules; returns the config's path."""
    os.makedirs(os.path.join(root, "fp_pkg"), exist_ok=True)
    for name, text in HELPER_FILES.items():
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    with open(os.path.join(root, "config.py"), "w") as f:
        f.write(HELPER_CONFIG.format(imports=REACH[reach][0]))
    return os.path.join(root, "config.py")


def fresh_fingerprint(cfg: str, pre_import: str = "", which: str = "fingerprint", env=None) -> str:
    """The fingerprint (`which`: or the worker_fingerprint) as a new process computes it (as server and
    worker do), after `pre_import`, with `env` added to the environment."""
    code = (
        f"{pre_import}\nimport sys\nfrom ppserver.config.settings import load_config\n"
        f"print(load_config(sys.argv[1]).{which})"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, cfg],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=None if env is None else {**os.environ, **env},
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.mark.processes
@pytest.mark.parametrize("reach", sorted(REACH))
def test_fingerprint_covers_local_modules_not_paths(tmp_path, reach):
    a = helper_dir(str(tmp_path / "a"), reach)
    b = helper_dir(str(tmp_path / "b"), reach)
    fp = fresh_fingerprint(a)
    assert fresh_fingerprint(b) == fp  # same files in another folder
    with open(os.path.join(tmp_path, "b", REACH[reach][1]), "a") as f:
        f.write("EDITED = 1\n")  # code: a comment would not count (see the test below)
    assert fresh_fingerprint(b) != fp


# Edits that change how a module reads, not what it does (and below, one that changes what it does).
REWORDED_DEEP = '''"""Doubles a seq's data."""


def scale(seq):  # in place
    """The seq, its data doubled."""
    seq["data"] = seq["data"]*2

    return seq
# the end
'''


@pytest.mark.processes
def test_fingerprint_counts_code_not_comments_docstrings_or_layout(tmp_path):
    cfg = helper_dir(str(tmp_path / "a"), "transitive")
    fp = fresh_fingerprint(cfg)
    folder = os.path.dirname(cfg)
    with open(os.path.join(folder, "fp_deep.py"), "w") as f:
        f.write(REWORDED_DEEP)
    with open(cfg, "a") as f:
        f.write('# a comment in the config\n"""and a string that does nothing"""\n')
    assert fresh_fingerprint(cfg) == fp
    with open(os.path.join(folder, "fp_deep.py"), "w") as f:
        f.write(REWORDED_DEEP.replace("*2", "*3"))
    assert fresh_fingerprint(cfg) != fp


@pytest.mark.unit
def test_fingerprint_normalizes_python_and_keeps_other_bytes():
    from ppserver.config.fingerprint import normalized

    assert normalized(b"x = 1  # one\n") == normalized(b'"""doc"""\nx = (1)\n')
    assert normalized(b"x = 1\n") != normalized(b"x = 2\n")
    assert normalized(b"def f():\n    '''doc'''\n    return 1\n") == normalized(b"def f():\n    return 1\n")
    assert normalized(b"    indented = lambda s: s\n") == normalized(b"indented = lambda s: s\n")
    for raw in (b"{'not': python", b"\xff\xfe"):
        assert normalized(raw) == raw


@pytest.mark.processes
def test_fingerprint_does_not_depend_on_earlier_imports(tmp_path):
    cfg = helper_dir(str(tmp_path / "a"), "module")
    fp = fresh_fingerprint(cfg)
    folder = os.path.dirname(cfg)
    for pre in (
        "import fp_unrelated",
        "import fp_helper",
        "import fp_deep, fp_unrelated, fp_pkg.sub",
        "import json, ppserver.server.loop, ppserver.worker.main",
    ):
        assert fresh_fingerprint(cfg, f"import sys\nsys.path.insert(0, {folder!r})\n{pre}") == fp, pre


@pytest.mark.processes
def test_remote_worker_with_an_edited_helper_module_is_refused(tmp_path):
    cfg = helper_dir(str(tmp_path / "server"), "module")
    other = os.path.join(tmp_path, "host2")
    shutil.copytree(os.path.dirname(cfg), other)
    with open(os.path.join(other, "fp_helper.py"), "a") as f:
        f.write("EDITED_ON_THIS_HOST = True\n")
    slog, wlog = str(tmp_path / "server.log"), str(tmp_path / "worker.log")
    with run_server(cfg, workers=1, log_path=slog) as srv:
        with run_worker_host(os.path.join(other, "config.py"), srv.address, procs=1, log_path=wlog) as host:
            assert host.wait(timeout=30) == 2
        assert "refused worker" in read(slog) and "config fingerprint mismatch" in read(slog)
        # an unedited copy in another folder is accepted and serves
        same = os.path.join(tmp_path, "host3")
        shutil.copytree(os.path.dirname(cfg), same)
        with run_worker_host(os.path.join(same, "config.py"), srv.address, procs=1) as host:
            srv.wait_workers(2)
            assert host.poll() is None
            with srv.client() as c:
                assert len(collect(c.epoch(1))) == 12


@pytest.mark.processes
def test_fingerprint_covers_names_only_through_the_config(tmp_path):
    """A local module next to the config that the config does not use does not count."""
    cfg = helper_dir(str(tmp_path / "a"), "function")
    fp = fresh_fingerprint(cfg)
    with open(os.path.join(tmp_path, "a", "fp_unrelated.py"), "a") as f:
        f.write("X = 2\n")
    assert fresh_fingerprint(cfg) == fp


@pytest.mark.processes
def test_a_local_worker_respawned_after_the_config_was_edited_runs_the_servers_config(tmp_path):
    """The next experiment's config is written over the file while the server runs; a local worker
    that dies is started again with the config the server loaded (not refused for the edited one)."""
    cfg = numpy_config(tmp_path, SCALE_MAPPER, n=20, extra="heartbeat_interval = 0.2\nheartbeat_timeout = 1.0\n")
    want = reference(cfg, 1)
    with run_server(cfg, workers=1) as srv:
        with open(cfg) as f:
            text = f.read()
        with open(cfg, "w") as f:
            f.write(text.replace('seq["data"] * rng.uniform(0.5, 1.5)', 'seq["data"] * 100'))
        (old,) = srv.worker_pids()
        os.kill(old, signal.SIGKILL)
        with srv.client() as c:
            wait_for(
                lambda: c.status()["local_worker_respawns"] >= 1 and c.status()["workers_alive"] == 1,
                30,
                "the local worker to be respawned and join",
            )
            assert srv.worker_pids() != [old]
            got = collect(c.epoch(1))
    assert_same_epoch(got, want)


DATASET_MODULE = """
import numpy as np
from ppserver.datasets.arrays import NumpyDataset


class Data(NumpyDataset):
    def __init__(self, **kwargs):
        r = np.random.RandomState(3)
        super().__init__(seqs=[{"data": r.randn(6, 2).astype("float32") * SCALE} for _ in range(8)], **kwargs)


SCALE = 1
"""


@pytest.mark.processes
def test_the_config_fingerprint_covers_a_dataset_module_named_in_the_dict(tmp_path):
    """'module:Name': the module is imported by the server only, after the fingerprint is made; the
    workers never import it, so it counts in the config fingerprint and not in the workers'."""
    (tmp_path / "fp_data.py").write_text(DATASET_MODULE)
    cfg = write_config(
        tmp_path,
        "import os, sys\nsys.path.insert(0, os.path.dirname(__file__))\n"
        "dataset = {'class': 'fp_data:Data'}\ndef map_seq(seq, **kwargs):\n    return seq\n",
    )
    fp, worker = fresh_fingerprint(cfg), fresh_fingerprint(cfg, which="worker_fingerprint")
    (tmp_path / "fp_data.py").write_text(DATASET_MODULE.replace("SCALE = 1", "SCALE = 2"))
    assert fresh_fingerprint(cfg) != fp
    assert fresh_fingerprint(cfg, which="worker_fingerprint") == worker


ENV_CONFIG = """
import os
dataset = {"class": "DemoDataset", "num_seqs": int(os.environ.get("PP_SEQS", "10"))}
seed = int(os.environ.get("PP_SEED", "0"))
num_workers = int(os.environ.get("PP_WORKERS", "1"))
def map_seq(seq, **kwargs):
    return seq
"""


@pytest.mark.processes
def test_fingerprints_cover_what_the_config_evaluates_to(tmp_path):
    """One source, values from the environment: the seed counts for the workers, the dataset dict
    for the config, the number of local workers (a resource) for neither."""
    cfg = write_config(tmp_path, ENV_CONFIG)

    def both(**env) -> tuple:
        return fresh_fingerprint(cfg, env=env), fresh_fingerprint(cfg, which="worker_fingerprint", env=env)

    fp, worker = both()
    assert both(PP_SEED="0") == (fp, worker)
    seeded = both(PP_SEED="5")
    assert seeded[0] != fp and seeded[1] != worker
    more = both(PP_SEQS="11")
    assert more[0] != fp and more[1] == worker
    assert both(PP_WORKERS="3") == (fp, worker)


@pytest.mark.unit
def test_canonical_values_are_equal_where_the_values_are():
    from ppserver.config.fingerprint import canonical

    class Holder:  # its default repr has a memory address: never hashed
        def __init__(self, x):
            self.x = x

    same = [
        ({"a": 1, "b": [1.5, "x"]}, {"b": [1.5, "x"], "a": 1}),
        (np.arange(6, dtype="int32").reshape(2, 3), np.arange(6, dtype="int32").reshape(2, 3)),
        (Holder(3), Holder(3)),
        ({1, 2, 3}, {3, 2, 1}),
        (os.path.join, os.path.join),
    ]
    for a, b in same:
        assert canonical(a) == canonical(b), a
    differ = [
        (1, 1.0),
        (1, True),
        ("1", 1),
        ([1, 2], (1, 2)),
        (np.arange(6, dtype="int32"), np.arange(6, dtype="int64")),
        (np.zeros(3), np.ones(3)),
        (Holder(3), Holder(4)),
        (os.path.join, os.path.split),
        ({"a": 1}, {"a": 2}),
    ]
    for a, b in differ:
        assert canonical(a) != canonical(b), (a, b)
    cycle: list = []
    cycle.append(cycle)
    assert canonical(cycle) == canonical(cycle)
    deep: list = []
    for _ in range(5000):  # deeper than the interpreter's recursion limit
        deep = [deep]
    assert canonical(deep) == canonical(deep)

    def scaled(factor):
        def map_seq(seq, **kwargs):
            return seq * factor

        return map_seq

    assert canonical(scaled(2)) == canonical(scaled(2)) != canonical(scaled(3))  # closures count


@pytest.mark.unit
def test_worker_and_config_fingerprints_cover_output_settings_not_resources():
    base = from_settings(settings())
    again = from_settings(settings())
    assert (again.fingerprint, again.worker_fingerprint) == (base.fingerprint, base.worker_fingerprint)
    for key, value in (("seed", 3), ("mapper_api", "dict"), ("batching", {"max_seqs": 2})):
        cfg = from_settings(settings(**{key: value}))
        if key == "mapper_api":  # its default: the same value
            assert cfg.worker_fingerprint == base.worker_fingerprint
            continue
        assert cfg.worker_fingerprint != base.worker_fingerprint and cfg.fingerprint != base.fingerprint, key
    for key, value in (("buf_size", 4), ("num_workers", 7), ("heartbeat_timeout", 9.0), ("worker_threads", 2)):
        cfg = from_settings(settings(**{key: value}))
        assert (cfg.fingerprint, cfg.worker_fingerprint) == (base.fingerprint, base.worker_fingerprint), key
    other = from_settings(settings(dataset={"class": "DemoDataset", "num_seqs": 3}))
    assert other.worker_fingerprint == base.worker_fingerprint and other.fingerprint != base.fingerprint


@pytest.mark.unit
def test_imports_are_found_statically_wherever_they_are_written():
    from ppserver.config.fingerprint import _imports, _parse

    source = b"""
import a.b as ab
def f():
    import lazy
    from pkg import mod, name
    from . import sibling
    from ..up import thing
"""
    names = _imports(_parse(source), "top.inner")
    for name in ("a.b", "lazy", "pkg", "pkg.mod", "pkg.name", "top.inner.sibling", "top.up", "top.up.thing"):
        assert name in names, name


@pytest.mark.unit
def test_the_served_fingerprint_covers_the_data_files(tmp_path):
    from ppserver.config.fingerprint import served_fingerprint
    from ppserver.datasets.arrays import NumpyDataset, save_npz

    path = str(tmp_path / "data.npz")
    save_npz(path, [{"data": np.zeros((3, 2), "float32")}])
    ds = NumpyDataset(path=path)
    assert ds.data_files() == [path]
    first = served_fingerprint("cfg", ds.identity())
    assert served_fingerprint("cfg", NumpyDataset(path=path).identity()) == first
    save_npz(path, [{"data": np.ones((3, 2), "float32")}, {"data": np.ones((2, 2), "float32")}])
    assert served_fingerprint("cfg", NumpyDataset(path=path).identity()) != first
    inline = NumpyDataset(seqs=[{"data": np.zeros((3, 2), "float32")}])
    assert inline.identity() == [] and served_fingerprint("cfg", inline.identity()) == "cfg"


# ---- the settings table ---------------------------------------------------------------------


def docs_settings_table() -> dict:
    """{key: default} of the table under docs/config.md's "## Settings"."""
    text = read(os.path.join(REPO, "docs", "config.md"))
    section = text.split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return {key.strip("`"): default.strip("`") for key, default, *_ in cells}


@pytest.mark.unit
def test_docs_list_exactly_the_declared_settings_with_their_defaults():
    from ppserver.config.table import SETTINGS

    assert docs_settings_table() == {s.key: s.shown for s in SETTINGS}


@pytest.mark.unit
def test_every_setting_has_a_doc_and_its_default_passes_its_check():
    from ppserver.config.table import SETTINGS

    cfg = from_settings(settings())
    for s in SETTINGS:
        assert s.doc and "\n" not in s.doc, s.key
        if s.key not in ("dataset", "map_seq"):  # given by settings()
            assert getattr(cfg, s.name) == s.default, s.key


@pytest.mark.unit
@pytest.mark.parametrize(
    "key, value, error",
    [
        ("buf_size", 0, "config key 'buf_size': must be an int >= 1, got 0"),
        ("shm_mb", 5000, "config key 'shm_mb': must be an int from 0 to 4096, got 5000"),
        ("direct_results", 1, "config key 'direct_results': must be True or False, got 1"),
        ("heartbeat_interval", 0, "config key 'heartbeat_interval': must be a number > 0, got 0"),
        ("heartbeat_timeout", 0.5, "config key 'heartbeat_timeout': must be larger than heartbeat_interval"),
        ("mapper_api", "torch", "config key 'mapper_api': must be one of 'dict', 'returnn', got 'torch'"),
        ("stream_partitions", 2, "config key 'stream_partitions': only allowed with map_seq_stream"),
        ("batch_length", 3, "config key 'batch_length': must be a function seq -> int, got int"),
        ("dataset", [], "config key 'dataset': must be a dict with a 'class' entry"),
        ("num_workers", "many", "config key 'num_workers': must be an int >= 1 or 'auto', got 'many'"),
        ("num_workers", 0, "config key 'num_workers': must be an int >= 1 or 'auto', got 0"),
        ("max_workers", -1, "config key 'max_workers': must be an int >= 0, got -1"),
        ("elastic_window", 0, "config key 'elastic_window': must be a number > 0, got 0"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_key(key, value, error):
    assert str(expect_config_error(key, from_settings, settings(**{key: value}))) == error


@pytest.mark.unit
def test_auto_workers_keep_a_streams_partitions_a_function_of_the_config():
    """With num_workers = 'auto' a stream's partitions are max_workers (given), never the host's."""
    stream = {"map_seq": None, "map_seq_stream": lambda seqs, **k: seqs}
    cfg = from_settings(settings(num_workers="auto", max_workers=6, **stream))
    assert cfg.auto_workers and cfg.partitions == 6
    assert from_settings(settings(num_workers="auto", stream_partitions=3, **stream)).partitions == 3
    err = expect_config_error("stream_partitions", from_settings, settings(num_workers="auto", **stream))
    assert "max_workers" in str(err)
    assert from_settings(settings(num_workers="auto")).partitions == 1  # map_seq: none needed


@pytest.mark.processes
@pytest.mark.parametrize(
    "command, argv, key",
    [("serve", ["--workers", "some"], "--workers"), ("worker", ["--procs", "0"], "--procs")],
)
def test_bad_worker_counts_on_the_command_line_are_one_line(tmp_path, command, argv, key):
    cfg = write_config(tmp_path, IDENTITY)
    if command == "serve":
        res = run_cli("serve", cfg, "--bind", "tcp://127.0.0.1:0", *argv)
    else:
        res = run_cli("worker", cfg, "--connect", f"tcp://127.0.0.1:{free_port()}", *argv)
    assert res.returncode == 2 and f"'{key}'" in res.stderr.strip().splitlines()[-1], res.stderr


@pytest.mark.unit
def test_the_scheduler_defaults_are_the_config_defaults():
    from ppserver.scheduler import Settings

    cfg = from_settings(settings())
    for name in ("buf_size", "max_seq_retries", "heartbeat_interval", "heartbeat_timeout"):
        assert getattr(Settings(), name) == getattr(cfg, name), name


@pytest.mark.processes  # importing the server loop loads cma.py, which runs ldconfig to find libc
def test_the_server_builds_the_scheduler_settings_from_the_config():
    from ppserver.server.loop import scheduler_settings

    b = scheduler_settings(from_settings(settings(buf_size=4, max_seq_retries=2, heartbeat_timeout=9)))
    assert (b.buf_size, b.max_seq_retries, b.heartbeat_interval, b.heartbeat_timeout) == (4, 2, 1.0, 9.0)
    assert b.fingerprint and b.instance and b.direct and not b.stream
