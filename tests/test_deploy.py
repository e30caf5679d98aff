"""Checks for the deployment files under deploy/.

Static checks (YAML structure, systemd unit layout) are `unit` tests; the Slurm script's
behaviour with a fake ``srun`` and ``systemd-analyze`` run processes. Every ``ppserver`` command
line found in deploy/ is also checked against the real CLI: the subcommand must exist and each
``--flag`` must appear in ``ppserver SUBCOMMAND --help``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from conftest import run_cli

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
SBATCH = DEPLOY / "slurm" / "workers.sbatch"
AUTOSCALE = DEPLOY / "slurm" / "autoscale.sh"
K8S = DEPLOY / "k8s"
DOCKERFILE = K8S / "Dockerfile"

SUBCOMMANDS = {"serve", "worker", "status", "keygen", "demo"}
SERVER_UNIT = SYSTEMD / "ppserver.service"
WORKER_UNIT = SYSTEMD / "ppserver-worker@.service"
CONFIG = "/etc/ppserver/config.py"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def yaml_files() -> List[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def unit_files() -> List[Path]:
    return sorted(SYSTEMD.glob("*.service"))


# --------------------------------------------------------------------------
# Finding ppserver invocations


@dataclass
class Invocation:
    source: str
    argv: List[str]  # argv[0] is the program (basename "ppserver")

    @property
    def subcommand(self) -> Optional[str]:
        if len(self.argv) > 1 and not self.argv[1].startswith("-"):
            return self.argv[1]
        return None

    @property
    def flags(self) -> List[str]:
        rest = self.argv[2:] if self.subcommand else self.argv[1:]
        return [a.split("=", 1)[0] for a in rest if a.startswith("--")]

    def __str__(self) -> str:
        return f"{self.source}: {shlex.join(self.argv)}"


def is_ppserver(token: str) -> bool:
    return os.path.basename(token) == "ppserver"


def from_ppserver(tokens: List[str]) -> Optional[List[str]]:
    for i, tok in enumerate(tokens):
        if is_ppserver(tok):
            return tokens[i:]
    return None


def join_continuations(text: str) -> List[str]:
    """Physical lines with trailing-backslash continuations joined."""
    out: List[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def exec_argv(value: str) -> List[str]:
    """argv of a systemd ExecStart= value, without the special prefixes."""
    return shlex.split(value.lstrip("-@:+!|"))


def parse_unit(text: str) -> Dict[str, List[Tuple[str, str]]]:
    """systemd unit file -> {section: [(key, value), ...]} (keys may repeat)."""
    sections: Dict[str, List[Tuple[str, str]]] = {}
    current: Optional[str] = None
    for n, line in enumerate(join_continuations(text), 1):
        s = line.strip()
        if not s or s[0] in "#;":
            continue
        m = re.fullmatch(r"\[([^\]]+)\]", s)
        if m:
            current = m.group(1)
            assert current not in sections, f"section [{current}] appears twice"
            sections[current] = []
            continue
        assert current is not None, f"line {n}: setting before any section: {s!r}"
        assert "=" in s, f"line {n}: not KEY=VALUE: {s!r}"
        key, value = s.split("=", 1)
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"line {n}: bad key {key!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def unit_values(unit: dict, section: str, key: str) -> List[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def unit_value(unit: dict, section: str, key: str) -> str:
    values = unit_values(unit, section, key)
    assert values, f"[{section}] {key}= missing"
    return values[-1]


def dockerfile_instructions(path: Path = DOCKERFILE) -> List[Tuple[str, str]]:
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    out = []
    for line in join_continuations("\n".join(lines)):
        s = line.strip()
        if s:
            word, _, rest = s.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_json(instruction: str) -> Optional[List[str]]:
    values = [v for k, v in dockerfile_instructions() if k == instruction]
    if not values:
        return None
    argv = json.loads(values[-1])  # exec form only
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def entrypoint() -> List[str]:
    argv = dockerfile_json("ENTRYPOINT")
    assert argv, "Dockerfile has no ENTRYPOINT"
    return argv


def pod_specs(doc):
    """Every dict under doc that has a 'containers' list (pod specs)."""
    if isinstance(doc, dict):
        if isinstance(doc.get("containers"), list):
            yield doc
        for v in doc.values():
            yield from pod_specs(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from pod_specs(v)


def yaml_docs(path: Path) -> List[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def container_argv(container: dict) -> List[str]:
    command = container.get("command") or entrypoint()
    return [str(a) for a in command] + [str(a) for a in container.get("args", [])]


def markdown_invocations(path: Path) -> List[Invocation]:
    found = []
    in_code = False
    block: List[str] = []
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            if in_code:
                for cmd in join_continuations("\n".join(block)):
                    cmd = cmd.strip().removeprefix("$ ")
                    if cmd.startswith("ExecStart="):
                        cmd = cmd[len("ExecStart=") :]
                        if not cmd:
                            continue
                    try:
                        tokens = shlex.split(cmd, comments=True)
                    except ValueError:
                        continue
                    if tokens and is_ppserver(tokens[0]):
                        found.append(Invocation(rel(path), tokens))
                block = []
            in_code = not in_code
        elif in_code:
            block.append(line)
    return found


# --------------------------------------------------------------------------
# Running the Slurm script with a fake srun


FAKE_SRUN = """#!/bin/sh
: > "$FAKE_SRUN_LOG"
for a in "$@"; do printf '%s\\0' "$a" >> "$FAKE_SRUN_LOG"; done
exit 0
"""


@dataclass
class SbatchRun:
    proc: subprocess.CompletedProcess
    srun_args: Optional[List[str]]  # None when srun was not called


def run_sbatch(tmp: Path, *args: str, **env_extra: str) -> SbatchRun:
    bindir = tmp / "fakebin"
    bindir.mkdir(exist_ok=True)
    for name, body in (("srun", FAKE_SRUN), ("ppserver", "#!/bin/sh\nexit 0\n")):
        p = bindir / name
        p.write_text(body)
        p.chmod(0o755)
    log = tmp / "srun.args"
    if log.exists():
        log.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PPSERVER_", "SLURM_"))}
    env.update(
        PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        FAKE_SRUN_LOG=str(log),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="3",
        SLURM_NNODES="3",
        SLURM_CPUS_ON_NODE="6",
        SLURM_SUBMIT_DIR=str(tmp),
    )
    env.update(env_extra)
    proc = subprocess.run(
        ["bash", str(SBATCH), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp,
    )
    srun_args = log.read_text().split("\0")[:-1] if log.exists() else None
    return SbatchRun(proc, srun_args)


def sbatch_invocation(tmp: Path) -> Invocation:
    config = tmp / "config.py"
    config.write_text("# test config\n")
    keys = tmp / "keys"
    keys.mkdir(exist_ok=True)
    run = run_sbatch(
        tmp,
        PPSERVER_ADDRESS="tcp://server.example.org:5555",
        PPSERVER_CONFIG=str(config),
        PPSERVER_KEYS=str(keys),
    )
    assert run.proc.returncode == 0, run.proc.stderr
    assert run.srun_args is not None, "srun was not called"
    argv = from_ppserver(run.srun_args)
    assert argv, f"srun does not run ppserver: {run.srun_args}"
    return Invocation(rel(SBATCH), argv)


# --------------------------------------------------------------------------
# Checking invocations against the real CLI


@functools.cache
def cli_help(sub: Optional[str]) -> subprocess.CompletedProcess:
    return run_cli(*([sub] if sub else []), "--help")


def cli_problems(inv: Invocation) -> List[str]:
    sub = inv.subcommand
    shown = f"ppserver {sub} --help" if sub else "ppserver --help"
    res = cli_help(sub)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return [f"{inv}\n    `{shown}` exited {res.returncode}: {' | '.join(tail)}"]
    problems = []
    for flag in inv.flags:
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", res.stdout):
            problems.append(f"{inv}\n    {flag} is not in `{shown}`")
    return problems


def invocations_in(path: Path, tmp: Path) -> List[Invocation]:
    name = path.name
    if path.suffix == ".service":
        unit = parse_unit(path.read_text())
        return [
            Invocation(rel(path), argv)
            for value in unit_values(unit, "Service", "ExecStart")
            if (argv := from_ppserver(exec_argv(value)))
        ]
    if path == SBATCH:
        return [sbatch_invocation(tmp)]
    if path.suffix in (".yaml", ".yml"):
        return [
            Invocation(rel(path), argv)
            for doc in yaml_docs(path)
            for spec in pod_specs(doc)
            for c in spec["containers"]
            if (argv := from_ppserver(container_argv(c)))
        ]
    if name == "Dockerfile":
        cmd = dockerfile_json("CMD") or []
        return [Invocation(rel(path), entrypoint() + cmd)]
    if path.suffix == ".md":
        return markdown_invocations(path)
    raise AssertionError(f"no reader for {path}")


INVOCATION_SOURCES = sorted(
    p
    for p in DEPLOY.rglob("*")
    if p.is_file() and (p.suffix in (".service", ".yaml", ".yml", ".md") or p == SBATCH or p.name == "Dockerfile")
)


@pytest.mark.unit
def test_deploy_files_exist():
    for p in (
        SERVER_UNIT,
        WORKER_UNIT,
        SYSTEMD / "README.md",
        SBATCH,
        K8S / "server.yaml",
        K8S / "workers.yaml",
        K8S / "autoscale.yaml",
        AUTOSCALE,
        DOCKERFILE,
        DEPLOY / "README.md",
    ):
        assert p.is_file(), f"missing {rel(p)}"


@pytest.mark.processes
@pytest.mark.parametrize("path", INVOCATION_SOURCES, ids=rel)
def test_invocations_match_cli(path: Path, tmp_path: Path):
    invocations = invocations_in(path, tmp_path)
    runs_nothing = path.suffix in (".yaml", ".yml") and not any(next(pod_specs(d), None) for d in yaml_docs(path))
    if path.suffix == ".md" or runs_nothing:  # (a KEDA ScaledObject starts no container)
        if not invocations:
            pytest.skip(f"{rel(path)} shows no ppserver command line")
    else:
        assert invocations, f"no ppserver invocation found in {rel(path)}"
    problems = [p for inv in invocations for p in cli_problems(inv)]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# Kubernetes


@pytest.mark.unit
@pytest.mark.parametrize("path", yaml_files(), ids=rel)
def test_yaml_documents(path: Path):
    docs = list(yaml.safe_load_all(path.read_text()))
    docs = [d for d in docs if d is not None]
    assert docs, f"{rel(path)} has no documents"
    for d in docs:
        assert isinstance(d, dict), f"{rel(path)}: document is not a mapping"
        for key in ("apiVersion", "kind", "metadata"):
            assert key in d, f"{rel(path)}: a {d.get('kind', '?')} document lacks {key}"
        assert d["metadata"].get("name"), f"{rel(path)}: {d['kind']} without metadata.name"


def k8s_objects() -> Dict[Tuple[str, str], dict]:
    objs = {}
    for path in sorted(K8S.glob("*.y*ml")):
        for d in yaml_docs(path):
            objs[(d["kind"], d["metadata"]["name"])] = d
    return objs


def deployments() -> List[dict]:
    return [d for (kind, _), d in k8s_objects().items() if kind == "Deployment"]


def only_container(deploy: dict) -> dict:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{deploy['metadata']['name']}: expected one container"
    return containers[0]


def deployment_running(sub: str) -> dict:
    found = [d for d in deployments() if container_argv(only_container(d))[1:2] == [sub]]
    assert len(found) == 1, f"expected one Deployment running `ppserver {sub}`, found {len(found)}"
    return found[0]


def option(argv: List[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    i = argv.index(flag)
    assert i + 1 < len(argv), f"{flag} has no value in {argv}"
    return argv[i + 1]


def cpu_quantity(q) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def mounts(deploy: dict) -> Dict[str, dict]:
    """mountPath -> volume source for the deployment's container."""
    spec = deploy["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    out = {}
    for m in only_container(deploy).get("volumeMounts", []):
        assert m["name"] in volumes, f"volumeMount {m['name']} has no volume"
        out[m["mountPath"]] = volumes[m["name"]]
    return out


@pytest.mark.unit
def test_k8s_containers_run_ppserver_subcommands():
    seen = 0
    for path in sorted(K8S.glob("*.y*ml")):
        for doc in yaml_docs(path):
            for spec in pod_specs(doc):
                for c in spec["containers"]:
                    argv = container_argv(c)
                    seen += 1
                    assert is_ppserver(argv[0]), f"{rel(path)}: {c['name']} does not run ppserver: {argv}"
                    assert len(argv) > 1 and argv[1] in SUBCOMMANDS, (
                        f"{rel(path)}: {c['name']}: {argv[1:2]} is not a ppserver subcommand"
                    )
                    assert any(a.startswith("--") for a in argv[2:]), f"{rel(path)}: {c['name']}: no flags"
    assert seen >= 2


@pytest.mark.unit
def test_k8s_deployments_select_their_pods():
    for d in deployments():
        labels = d["spec"]["template"]["metadata"]["labels"]
        selector = d["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), d["metadata"]["name"]
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 10
        sc = d["spec"]["template"]["spec"].get("securityContext", {})
        assert sc.get("runAsNonRoot") is True, f"{d['metadata']['name']}: runAsNonRoot"
    assert len(deployments()) == 2


@pytest.mark.unit
def test_k8s_server():
    server = deployment_running("serve")
    assert server["spec"]["replicas"] == 1
    c = only_container(server)
    argv = container_argv(c)
    assert argv[2] == CONFIG
    assert option(argv, "--bind") == "tcp://0.0.0.0:5555"
    assert option(argv, "--worker-bind") == "tcp://0.0.0.0:5556"
    assert option(argv, "--keys") == "/keys"

    ports = {p["containerPort"]: p for p in c["ports"]}
    assert set(ports) == {5555, 5556, 9100}
    assert option(argv, "--metrics") == ":9100"
    probe = c["readinessProbe"]["tcpSocket"]["port"]
    by_name = {p.get("name"): p["containerPort"] for p in c["ports"]}
    assert by_name.get(probe, probe) == 5555, f"readiness probe port {probe}"

    m = mounts(server)
    assert "configMap" in m["/etc/ppserver"]
    assert "secret" in m["/keys"]

    services = [d for (kind, _), d in k8s_objects().items() if kind == "Service"]
    assert len(services) == 1
    svc = services[0]
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["port"] for p in svc["spec"]["ports"]} == {5555, 5556}
    for p in svc["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        assert by_name.get(target, target) == p["port"], f"service port {p['port']} -> {target}"


@pytest.mark.unit
def test_k8s_workers():
    workers = deployment_running("worker")
    server = deployment_running("serve")
    svc_name = next(n for (kind, n) in k8s_objects() if kind == "Service")
    assert isinstance(workers["spec"]["replicas"], int) and workers["spec"]["replicas"] >= 1
    c = only_container(workers)
    argv = container_argv(c)
    assert argv[2] == CONFIG
    assert option(argv, "--connect") == f"tcp://{svc_name}:5555"
    assert option(argv, "--keys") == "/keys"
    procs = option(argv, "--procs")
    request = cpu_quantity(c["resources"]["requests"]["cpu"])
    if procs == "auto":  # as many as the server wants, up to the CPU limit: the request is that
        assert cpu_quantity(c["resources"]["limits"]["cpu"]) == request, "--procs auto: CPU limit = request"
    else:
        assert int(procs) >= 1
        assert request == int(procs), "CPU request must equal --procs"

    m = mounts(workers)
    assert "secret" in m["/keys"]
    # Both sides must read the same config bytes: the same ConfigMap.
    assert m["/etc/ppserver"]["configMap"]["name"] == mounts(server)["/etc/ppserver"]["configMap"]["name"]


@pytest.mark.unit
def test_k8s_autoscale():
    """KEDA scales the worker Deployment on the server's ppserver_workers_wanted: the metric the
    server serves (--metrics), divided by what one pod runs (its CPU limit, with --procs auto)."""
    objs = k8s_objects()
    scaled = [d for (kind, _), d in objs.items() if kind == "ScaledObject"]
    assert len(scaled) == 1
    so = scaled[0]
    assert so["apiVersion"].startswith("keda.sh/")
    workers = deployment_running("worker")
    target = so["spec"]["scaleTargetRef"]
    assert target["name"] == workers["metadata"]["name"] and target.get("kind", "Deployment") == "Deployment"
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert "ppserver_workers_wanted" in trigger["metadata"]["query"]
    c = only_container(workers)
    assert option(container_argv(c), "--procs") == "auto"
    assert float(trigger["metadata"]["threshold"]) == cpu_quantity(c["resources"]["limits"]["cpu"])
    server = only_container(deployment_running("serve"))
    port = int(option(container_argv(server), "--metrics").rpartition(":")[2])
    assert port in {p["containerPort"] for p in server["ports"]}
    annotations = deployment_running("serve")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


@pytest.mark.unit
def test_dockerfile():
    ins = dockerfile_instructions()
    froms = [v.split()[0] for k, v in ins if k == "FROM"]
    assert froms and all(f == "python:3.11-slim" for f in froms), froms
    runs = " ".join(v for k, v in ins if k == "RUN")
    assert re.search(r"pip install\b[^&;]*\s\.(\s|$)", runs), "no `pip install .` of the build context"
    assert any(k == "COPY" and v.split()[0] == "." for k, v in ins), "build context not copied"
    users = [v for k, v in ins if k == "USER"]
    assert users, "no USER"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    assert entrypoint() == ["ppserver"]


# --------------------------------------------------------------------------
# systemd


@pytest.mark.unit
@pytest.mark.parametrize("path", unit_files(), ids=rel)
def test_unit_structure(path: Path):
    unit = parse_unit(path.read_text())
    for section in ("Unit", "Service", "Install"):
        assert section in unit, f"[{section}] missing"
    execs = unit_values(unit, "Service", "ExecStart")
    assert len(execs) == 1, "exactly one ExecStart="
    argv = exec_argv(execs[0])
    assert argv[0] == "/opt/ppserver/bin/ppserver"
    user = unit_value(unit, "Service", "User")
    assert user and user not in ("root", "0")
    assert unit_value(unit, "Service", "KillSignal") == "SIGTERM"
    assert unit_value(unit, "Service", "TimeoutStopSec") == "10"
    assert unit_value(unit, "Service", "NoNewPrivileges") == "yes"
    assert unit_values(unit, "Install", "WantedBy")


@pytest.mark.unit
def test_server_unit():
    unit = parse_unit(SERVER_UNIT.read_text())
    argv = exec_argv(unit_value(unit, "Service", "ExecStart"))
    assert argv[1:3] == ["serve", CONFIG]
    assert option(argv, "--bind") == "tcp://0.0.0.0:5555"
    assert option(argv, "--keys") == "/etc/ppserver/keys"
    assert unit_value(unit, "Service", "Restart") == "on-failure"


@pytest.mark.unit
def test_worker_unit():
    unit = parse_unit(WORKER_UNIT.read_text())
    argv = exec_argv(unit_value(unit, "Service", "ExecStart"))
    assert argv[1:3] == ["worker", CONFIG]
    assert option(argv, "--connect") == "tcp://%i:5555"
    assert option(argv, "--keys") == "/etc/ppserver/keys"
    assert unit_value(unit, "Service", "Restart") == "always"
    assert unit_value(unit, "Service", "RestartSec")


def _verify(analyze: str, *units: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [analyze, "verify", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.processes
def test_systemd_analyze_verify(tmp_path: Path):
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        pytest.skip("systemd-analyze is not installed; unit files were only parsed")
    binary = shutil.which("true") or sys.executable

    probe = tmp_path / "ppserver-probe.service"
    probe.write_text(f"[Unit]\nDescription=probe\n[Service]\nExecStart={binary}\n")
    res = _verify(analyze, probe)
    if res.returncode != 0:
        pytest.skip(
            "systemd-analyze verify cannot run here (a trivial unit fails): " + (res.stderr or res.stdout).strip()[:300]
        )

    targets = []
    for src in unit_files():
        dst = tmp_path / src.name
        dst.write_text(src.read_text().replace("/opt/ppserver/bin/ppserver", binary))
        name = src.name.replace("@.service", "@server.example.org.service")
        targets.append(tmp_path / name)
    res = _verify(analyze, *targets)
    output = (res.stdout + res.stderr).strip()
    complaints = [ln for ln in output.splitlines() if str(tmp_path) in ln or "ppserver" in ln]
    assert res.returncode == 0 and not complaints, output


# --------------------------------------------------------------------------
# Slurm


def script_lines() -> List[str]:
    return SBATCH.read_text().splitlines()


@pytest.mark.processes
def test_sbatch_syntax():
    bash = shutil.which("bash")
    if not bash:
        pytest.skip("bash is not installed")
    res = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert script_lines()[0].startswith("#!") and "bash" in script_lines()[0]


@pytest.mark.unit
def test_sbatch_directives():
    directives = [ln.split(None, 1)[1] for ln in script_lines() if ln.startswith("#SBATCH ")]
    assert directives, "no #SBATCH lines"
    assert "--ntasks-per-node=1" in directives
    signal = [d for d in directives if d.startswith("--signal=")]
    assert signal and "TERM" in signal[0], "needs --signal=...TERM@SECONDS"
    code = [ln for ln in join_continuations(SBATCH.read_text()) if not ln.lstrip().startswith("#")]
    assert any(re.match(r"\s*exec\s+srun\b", ln) for ln in code), "srun must be exec'd to get the signal"


@pytest.mark.processes
def test_sbatch_requires_address(tmp_path: Path):
    (tmp_path / "config.py").write_text("")
    run = run_sbatch(tmp_path)
    assert run.proc.returncode != 0
    assert "PPSERVER_ADDRESS" in run.proc.stderr
    assert run.srun_args is None, "srun must not be called without an address"


@pytest.mark.processes
def test_sbatch_requires_config(tmp_path: Path):
    run = run_sbatch(tmp_path, PPSERVER_ADDRESS="tcp://server:5555", PPSERVER_CONFIG=str(tmp_path / "missing.py"))
    assert run.proc.returncode != 0
    assert "missing.py" in run.proc.stderr
    assert run.srun_args is None


def check_srun_args(args: List[str], address: str, config: str) -> List[str]:
    argv = from_ppserver(args)
    assert argv, f"no ppserver in srun args: {args}"
    srun_opts = args[: len(args) - len(argv)]
    assert "--ntasks-per-node=1" in srun_opts
    assert "--cpus-per-task=6" in srun_opts
    assert " ".join(args).count("ppserver worker") == 1
    assert argv[1:3] == ["worker", config]
    assert option(argv, "--connect") == address
    assert option(argv, "--procs") == "6"  # SLURM_CPUS_ON_NODE
    return argv


@pytest.mark.processes
def test_sbatch_address_from_env(tmp_path: Path):
    (tmp_path / "config.py").write_text("")
    run = run_sbatch(tmp_path, PPSERVER_ADDRESS="tcp://server:5555")
    assert run.proc.returncode == 0, run.proc.stderr
    assert run.srun_args is not None, "srun was not called"
    # Default config: config.py in the submit directory.
    argv = check_srun_args(run.srun_args, "tcp://server:5555", str(tmp_path / "config.py"))
    assert "--keys" not in argv


@pytest.mark.processes
def test_sbatch_address_from_argument(tmp_path: Path):
    config = tmp_path / "exp.py"
    config.write_text("")
    keys = tmp_path / "keys"
    keys.mkdir()
    run = run_sbatch(tmp_path, "tcp://10.0.0.7:5555", PPSERVER_CONFIG=str(config), PPSERVER_KEYS=str(keys))
    assert run.proc.returncode == 0, run.proc.stderr
    assert run.srun_args is not None, "srun was not called"
    argv = check_srun_args(run.srun_args, "tcp://10.0.0.7:5555", str(config))
    assert option(argv, "--keys") == str(keys)


@pytest.mark.processes
def test_sbatch_procs_auto(tmp_path: Path):
    (tmp_path / "config.py").write_text("")
    run = run_sbatch(tmp_path, PPSERVER_ADDRESS="tcp://server:5555", PPSERVER_PROCS="auto")
    assert run.proc.returncode == 0, run.proc.stderr
    assert run.srun_args is not None
    assert option(from_ppserver(run.srun_args) or [], "--procs") == "auto"
    bad = run_sbatch(tmp_path, PPSERVER_ADDRESS="tcp://server:5555", PPSERVER_PROCS="0")
    assert bad.proc.returncode != 0 and "PPSERVER_PROCS" in bad.proc.stderr


FAKE_STATUS = """#!/bin/sh
# ppserver status ADDRESS --json ...: the pool the test wrote
cat "$FAKE_POOL"
"""
FAKE_SBATCH = """#!/bin/sh
echo "$PPSERVER_PROCS $*" >> "$FAKE_SBATCH_LOG"
echo 1 >> "$FAKE_JOBS"
"""
FAKE_SQUEUE = """#!/bin/sh
cat "$FAKE_JOBS" 2>/dev/null || true
"""


@pytest.mark.processes
def test_slurm_autoscale_submits_worker_jobs_while_the_server_wants_more(tmp_path: Path):
    """The script polls `ppserver status --json`; after PATIENCE polls wanting more than it has, it
    submits a one-node workers.sbatch job with PPSERVER_PROCS=auto, at most MAX_JOBS of them."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    for name, body in (("ppserver", FAKE_STATUS), ("sbatch", FAKE_SBATCH), ("squeue", FAKE_SQUEUE)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    pool, log = tmp_path / "pool.json", tmp_path / "sbatch.log"
    pool.write_text('{"pool": {"wanted": 5, "current": 4}}')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PPSERVER_", "SLURM_"))}
    env.update(
        PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
        PPSERVER_ADDRESS="tcp://server:5555",
        FAKE_POOL=str(pool),
        FAKE_SBATCH_LOG=str(log),
        FAKE_JOBS=str(tmp_path / "jobs"),
        INTERVAL="0.1",
        PATIENCE="2",
        MAX_JOBS="2",
        USER="tester",
    )
    proc = subprocess.Popen(["bash", str(AUTOSCALE)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 2):
            time.sleep(0.05)
        time.sleep(1.0)  # polls go on: no third job past MAX_JOBS
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    jobs = log.read_text().splitlines()
    assert len(jobs) == 2, jobs
    for job in jobs:
        procs, *args = job.split()
        assert procs == "auto" and "--nodes=1" in args
        assert args[-2:] == [str(SBATCH), "tcp://server:5555"]


@pytest.mark.processes
def test_sbatch_rejects_bad_address(tmp_path: Path):
    (tmp_path / "config.py").write_text("")
    run = run_sbatch(tmp_path, PPSERVER_ADDRESS="server:5555")
    assert run.proc.returncode != 0
    assert "tcp://HOST:PORT" in run.proc.stderr
    assert run.srun_args is None
