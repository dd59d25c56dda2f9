"""The processes of a Flower deployment: a loopback deployment, and the commands of one on
several machines.

:class:`LocalDeployment` writes the Flower app folder (:func:`hyperfed.deploy.appconfig.
write_app`: its run config carries the experiment, so the SuperLink ships it to every node
with the run), starts one
``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1 (free ports, each in
its own process group and ``FLWR_HOME``), submits the app with ``flwr run``, follows the run
with ``flwr list --format json`` (``flwr run`` exits 0 even when the run fails) and stops
every process it started, by process group, also on errors.

This module imports ``flwr`` only to ask a run's status (``LocalDeployment.status``, falling back
to the ``flwr`` CLI); the processes it starts need it installed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperfed.deploy.appconfig import (
    BUILD_LOG_ENV,
    RunSettings,
    format_partition_ids,
    node_groups,
    write_app,
)
from hyperfed.deploy.supernode import POLL_INTERVAL

if TYPE_CHECKING:
    from hyperfed.config import ExperimentConfig
    from hyperfed.deploy.secure import SecureMaterial

CONNECTION = "hyperfed-local"  # the SuperLink connection name written for `flwr run`
# how a SuperNode runs its ClientApp: one long-lived hyperfed.deploy.clientapp process beside
# it (`--isolation process`), or Flower's fresh flwr-clientapp process per message
LONG_LIVED, PER_MESSAGE = "long-lived", "per-message"
CLIENTAPP_MODES = (LONG_LIVED, PER_MESSAGE)

# Flower asks for these to be off on machines without internet access, and the SuperLink would
# otherwise `uv sync` the app's dependencies (pulling a CUDA torch) before every run.
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
}


class DeployError(RuntimeError):
    """A deployment that could not start or did not complete (message says why)."""


def flwr_available() -> bool:
    try:
        import flwr  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    """A Flower executable next to this Python (a venv's bin/) or on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise DeployError(f"{name} not found; install Flower with: pip install 'hyperfed[flower]'")
    return found


def superlink_command(
    port: int,
    host: str = "127.0.0.1",
    simulation: bool = False,
    secure: SecureMaterial | None = None,
) -> list[str]:
    """A SuperLink; ``simulation``: it runs the ClientApps itself on Flower's Simulation
    Engine (Ray) instead of waiting for SuperNodes; ``secure``: TLS with that material's
    server certificate, and SuperNode authentication (only registered keys may connect)."""
    if secure is None:
        security = ["--insecure"]
    else:
        # absolute: the SuperLink runs in the deployment's working folder, not the caller's
        security = [
            "--ssl-ca-certfile",
            str(Path(secure.ca_cert).absolute()),
            "--ssl-certfile",
            str(Path(secure.server_cert).absolute()),
            "--ssl-keyfile",
            str(Path(secure.server_key).absolute()),
            "--enable-supernode-auth",
        ]
    return [
        _bin("flower-superlink"),
        *security,
        "--host",
        host,
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
        *(["--simulation"] if simulation else []),
    ]


def supernode_command(
    superlink: str,
    partition_id: int | Sequence[int],
    num_partitions: int,
    port: int,
    *,
    insecure: bool = True,
    root_certificates: Path | None = None,
    private_key: Path | None = None,
    clientapp: str = LONG_LIVED,
    poll_interval: float = POLL_INTERVAL,
) -> list[str]:
    """A SuperNode serving client ``partition_id`` (a list: those clients, node config
    ``partition-ids``, trained as one engine group), its Runtime API on ``port``.
    ``insecure=False``: TLS, trusting ``root_certificates`` (None: the system's CAs), signing
    its requests with ``private_key`` (SuperNode authentication) when one is given.
    ``clientapp``: ``long-lived`` (``--isolation process``: :func:`clientapp_command` runs
    its ClientApp) or ``per-message`` (Flower starts a ``flwr-clientapp`` per message).
    ``poll_interval``: the longest the node waits between asking for work (Flower's: 3 s)."""
    if clientapp not in CLIENTAPP_MODES:
        raise ValueError(f"clientapp={clientapp!r}: must be one of {', '.join(CLIENTAPP_MODES)}")
    if insecure:
        security = ["--insecure"]
    else:
        security = []
        if root_certificates is not None:  # absolute: the node runs in another working folder
            security += ["--root-certificates", str(Path(root_certificates).absolute())]
        if private_key is not None:
            security += ["--auth-supernode-private-key", str(Path(private_key).absolute())]
    if isinstance(partition_id, int):
        serves = f"partition-id={partition_id}"
    else:
        serves = f'partition-ids="{format_partition_ids(partition_id)}"'
    return [
        # Flower's SuperNode with its 3 s / 0.5 s waits capped (hyperfed.deploy.supernode)
        sys.executable,
        "-m",
        "hyperfed.deploy.supernode",
        "--poll-interval",
        str(poll_interval),
        *security,
        "--superlink",
        superlink,
        "--port",
        str(port),
        "--node-config",
        f"{serves} num-partitions={num_partitions}",
        "--isolation",
        "process" if clientapp == LONG_LIVED else "subprocess",
    ]


def clientapp_command(port: int, parent_pid: int | None = None) -> list[str]:
    """The long-lived ClientApp process of the SuperNode whose Runtime API is on ``port``
    (:mod:`hyperfed.deploy.clientapp`); it stops when ``parent_pid`` is gone."""
    parent = [] if parent_pid is None else ["--parent-pid", str(parent_pid)]
    return [
        sys.executable,
        "-m",
        "hyperfed.deploy.clientapp",
        "--runtime-api-address",
        f"127.0.0.1:{port}",
        *parent,
    ]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    # processes that belong to this one (a SuperNode's long-lived ClientApp, in its own
    # process group): stopped and killed with it
    members: list[Process] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to the process group this process leads (it and the app processes it
        started) and to the groups of the children it detached (a SuperLink's SuperExec),
        SIGKILL after ``grace`` seconds; only groups this module started or their children's."""
        for member in self.members:
            _signal_group(member.pid, signal.SIGTERM)
        for member in self.members:
            member.stop(grace)
        detached = _detached_groups(self.pid)
        if self.popen.returncode is not None and not _group_alive(self.pid):
            _stop_groups(detached, grace)
            return
        _signal_group(self.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=grace)
        deadline = time.monotonic() + grace
        while _group_alive(self.pid) and time.monotonic() < deadline:
            self.popen.poll()
            time.sleep(0.1)
        _signal_group(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=grace)
        deadline = time.monotonic() + 10  # killed members may take a moment to be reaped
        while _group_alive(self.pid) and time.monotonic() < deadline:
            self.popen.poll()
            time.sleep(0.05)
        _stop_groups(detached, grace)

    def kill(self) -> None:
        """SIGKILL the process group at once (a crashed machine, for tests), and the groups
        of the children it detached (a SuperLink's SuperExec and the ServerApp it runs)."""
        for member in self.members:
            member.kill()
        for pgid in _detached_groups(self.pid):
            _signal_group(pgid, signal.SIGKILL)
        _signal_group(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _group_alive(self.pid) and time.monotonic() < deadline:
            self.popen.poll()
            time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _detached_groups(pid: int) -> list[int]:
    """The process groups of ``pid``'s children that left its group: Flower's SuperLink
    starts its SuperExec in a session of its own (``start_new_session``), and the ServerApp
    runs in that one, so signalling the SuperLink's group alone leaves them running. Linux
    (``/proc``); elsewhere none are found."""
    try:
        own = os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return []
    groups: list[int] = []
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid, pgrp = int(fields[1]), int(fields[2])
        if ppid == pid and pgrp != own and pgrp not in groups:
            groups.append(pgrp)
    return groups


def _stop_groups(groups: list[int], grace: float) -> None:
    """SIGTERM to each group, SIGKILL to those alive after ``grace`` seconds."""
    for pgid in groups:
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@dataclass
class Simulated:
    """Flower's Simulation Engine instead of SuperNode processes: ``nodes`` simulated
    SuperNodes run as Ray actors inside the SuperLink's simulation process, each actor
    reserving ``cpus`` CPUs and ``gpus`` GPUs; ``ray_address``: attach to a running Ray
    cluster (``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the
    others) instead of starting a private one."""

    cpus: int = 1
    gpus: float = 0.0
    ray_address: str | None = None

    def federation_config(self, nodes: int) -> str:
        return (
            f"num-supernodes={nodes} client-resources-num-cpus={self.cpus} "
            f"client-resources-num-gpus={self.gpus:g}"
        )


@dataclass
class LocalDeployment:
    """SuperLink + ``nodes`` SuperNodes on 127.0.0.1 for one experiment, as processes (or,
    with ``simulated``, one SuperLink running them on Flower's Simulation Engine).

    Use as a context manager: every process is stopped on exit, also after an error."""

    cfg: ExperimentConfig
    workdir: Path
    run_dir: Path
    nodes: int
    num_partitions: int
    threads: int = 1
    join_timeout: float = 300.0
    round_timeout: float = 600.0
    partition_ids: Sequence[int] | None = None
    simulated: Simulated | None = None
    resume: bool = False
    # TLS + SuperNode authentication (hyperfed.deploy.secure): node i signs with node_keys[i]
    secure: SecureMaterial | None = None
    # long-lived: one ClientApp process per SuperNode for the whole run (built client cached);
    # per-message: Flower's flwr-clientapp process per message (any app; dependency install)
    clientapp: str = LONG_LIVED
    # >1: SuperNode k serves clients k*G .. k*G+G-1 (node_groups), trained as one engine
    # group; ``nodes`` then counts SuperNodes (ceil(num_partitions / G) for every client)
    clients_per_node: int = 1
    processes: list[Process] = field(default_factory=list)
    supernodes: list[Process] = field(default_factory=list)
    node_ids: list[int] = field(default_factory=list)  # secure: the registered nodes' ids
    port: int = 0
    _control: Any = field(default=None, repr=False)  # the Control API client of status()

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()
        self.run_dir = Path(self.run_dir).resolve()
        self.app_dir = self.workdir / "app"
        self.cli_home = self.workdir / "flwr-cli"
        if self.clientapp not in CLIENTAPP_MODES:
            raise DeployError(
                f"clientapp={self.clientapp!r}: must be one of {', '.join(CLIENTAPP_MODES)}"
            )
        if self.clients_per_node < 1:
            raise DeployError(f"clients_per_node={self.clients_per_node}: must be >= 1")

    def served(self) -> Sequence[int | Sequence[int]]:
        """What each SuperNode serves: a partition id, or (clients_per_node > 1) a group."""
        if self.clients_per_node > 1:
            return node_groups(self.num_partitions, self.clients_per_node)[: self.nodes]
        return list(self.partition_ids) if self.partition_ids is not None else [*range(self.nodes)]

    # -- processes --------------------------------------------------------------------------
    def env(self, home: Path) -> dict[str, str]:
        env = {**os.environ, **QUIET_ENV, "FLWR_HOME": str(home)}
        # Flower's SuperLink/SuperNode start flower-superexec by name: find it beside this
        # Python (a venv's bin/) even when that venv is not activated.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["OMP_NUM_THREADS"] = str(self.threads)
        env["MKL_NUM_THREADS"] = str(self.threads)
        # every ClientApp process notes each client it builds (hyperfed.deploy.node)
        env[BUILD_LOG_ENV] = str(self.workdir / "logs" / "builds.jsonl")
        if self.simulated is not None and self.simulated.ray_address:
            env["RAY_ADDRESS"] = self.simulated.ray_address  # ray.init() attaches to it
        return env

    def _spawn(self, name: str, cmd: list[str], owner: Process | None = None) -> Process:
        """Start ``cmd`` (logs/<name>.log) in its own process group; with ``owner``, as a
        member of that process (stopped and killed with it)."""
        home = self.workdir / "homes" / (owner.name if owner is not None else name)
        home.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(home),
                cwd=self.workdir,
                start_new_session=True,  # its own process group: stopped as one
            )
        proc = Process(name, popen, log)
        if owner is None:
            self.processes.append(proc)
        else:
            owner.members.append(proc)
        return proc

    def start(self, ready_timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        simulation = self.simulated is not None
        if simulation and self.secure is not None:
            raise DeployError("secure: a simulation SuperLink has no SuperNodes to authenticate")
        ids = self.served()
        if self.secure is not None and len(self.secure.node_keys) < len(ids):
            raise DeployError(
                f"secure: {len(self.secure.node_keys)} node keys for {len(ids)} SuperNodes"
            )
        cmd = superlink_command(self.port, simulation=simulation, secure=self.secure)
        link = self._spawn("superlink", cmd)
        deadline = time.monotonic() + ready_timeout
        while not _port_open(self.port):
            if not link.alive():
                raise DeployError(f"flower-superlink exited:\n{link.tail()}")
            if time.monotonic() > deadline:
                raise DeployError(f"flower-superlink not listening after {ready_timeout:.0f} s")
            time.sleep(0.2)
        self._write_cli_config()
        if self.secure is not None:  # only these keys may connect: register them first
            self.node_ids = [self.register(self.secure.public_key(k)) for k in range(len(ids))]
        for k, i in enumerate([] if simulation else ids):
            key = None if self.secure is None else self.secure.node_keys[k]
            self.supernodes.append(self.spawn_supernode(i, private_key=key))

    def spawn_supernode(
        self,
        partition_id: int | Sequence[int],
        *,
        name: str | None = None,
        private_key: Path | None = None,
        trust_ca: bool = True,
        superlink: str | None = None,
    ) -> Process:
        """Start one SuperNode serving client ``partition_id`` (a list: those clients;
        logs/<name>.log). In a secure
        deployment it signs with ``private_key`` (None: no key) and trusts the deployment's
        CA (``trust_ca=False``: only the system's CAs, as a machine never given ca.crt);
        ``superlink``: the address it dials (default the SuperLink's; e.g. a proxy)."""
        secure = self.secure is not None
        ca = self.secure.ca_cert if self.secure is not None and trust_ca else None
        runtime_port = free_port()
        cmd = supernode_command(
            superlink or f"127.0.0.1:{self.port}",
            partition_id,
            self.num_partitions,
            runtime_port,
            insecure=not secure,
            root_certificates=ca,
            private_key=private_key if secure else None,
            clientapp=self.clientapp,
        )
        label = (
            partition_id if isinstance(partition_id, int) else format_partition_ids(partition_id)
        )
        name = name or f"supernode-{label}"
        node = self._spawn(name, cmd)
        if self.clientapp == LONG_LIVED:  # its ClientApp process, stopped with it
            app = clientapp_command(runtime_port, parent_pid=node.pid)
            self._spawn(f"{name}.clientapp", app, owner=node)  # logs/supernode-i.clientapp.log
        return node

    def register(self, public_key: Path) -> int:
        """``flwr supernode register``: the SuperLink accepts the node holding this key;
        returns the node id it assigned."""
        res = self.flwr("supernode", "register", str(public_key), CONNECTION, "--format", "json")
        payload = _last_json(res.stdout)
        if res.returncode != 0 or not payload or not payload.get("success"):
            raise DeployError(
                f"flwr supernode register {public_key} failed ({res.returncode}):\n"
                f"{res.stdout}\n{res.stderr}"
            )
        return int(payload["node-id"])

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to every process group started here, SIGKILL to those still alive
        after ``grace`` seconds."""
        every = [p for proc in self.processes for p in (*proc.members, proc)]
        # found before the signals: once a SuperLink exits, its SuperExec is init's child
        detached = [g for proc in every for g in _detached_groups(proc.pid)]
        for proc in every:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_group_alive(p.pid) for p in every):
            for proc in every:
                proc.popen.poll()  # reap, so that a finished leader leaves no zombie
            time.sleep(0.1)
        for proc in self.processes:
            proc.stop(grace=1.0)
        _stop_groups(detached, grace=1.0)
        self._control = None

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the flwr CLI -----------------------------------------------------------------------
    def _write_cli_config(self) -> None:
        self.cli_home.mkdir(parents=True, exist_ok=True)
        if self.secure is None:
            security = "insecure = true"
        else:
            security = f"root-certificates = {json.dumps(str(self.secure.ca_cert.resolve()))}"
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\n{security}\n'
        )

    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [_bin("flwr"), *args],
            capture_output=True,
            text=True,
            env=self.env(self.cli_home),
            cwd=self.workdir,
            timeout=timeout,
        )

    def submit(self) -> int:
        """Write the app and ``flwr run`` it; returns the run id."""
        settings = RunSettings(
            run_dir=str(self.run_dir.resolve()),
            min_nodes=self.nodes,
            join_timeout=self.join_timeout,
            round_timeout=self.round_timeout,
            resume=self.resume,
            clients_per_node=self.clients_per_node,
        )
        write_app(self.app_dir, self.cfg, settings)
        federation = []
        if self.simulated is not None:
            federation = ["--federation-config", self.simulated.federation_config(self.nodes)]
        res = self.flwr("run", str(self.app_dir), CONNECTION, *federation, "--format", "json")
        payload = _last_json(res.stdout)
        if res.returncode != 0 or not payload or not payload.get("success"):
            raise DeployError(f"flwr run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return int(payload["run-id"])

    def status(self, run_id: int) -> str:
        """The run's status as ``flwr list`` reports it, e.g. ``running``,
        ``finished:completed``, ``finished:failed`` (empty if it could not be read). Asked in
        this process, over one Control API connection (:meth:`_control_status`); each
        ``flwr list`` is a Python start and ~1 s of CPU, which polling every 2 s took from a
        deployment's nodes. ``flwr list`` answers when that fails (another flwr)."""
        try:
            return self._control_status(run_id)
        except Exception:  # noqa: BLE001 -- any failure: ask the CLI instead
            self._control = None
        res = self.flwr("list", "--run-id", str(run_id), "--format", "json", timeout=60)
        payload = _last_json(res.stdout)
        for run in (payload or {}).get("runs", []):
            if int(run.get("run-id", -1)) == run_id:
                return str(run.get("status", ""))
        return ""

    def _control_status(self, run_id: int) -> str:
        """``flwr list``'s status of ``run_id``, by Flower's own Control API client and run
        formatting (flwr 1.42's CLI modules), built once from this deployment's CLI config."""
        from flwr.common.serde import run_from_proto
        from flwr.proto.control_pb2 import ListRunsRequest

        if self._control is None:
            from flwr.cli.flower_config import read_superlink_connection
            from flwr.cli.utils import init_http_client_from_connection

            previous = os.environ.get("FLWR_HOME")
            os.environ["FLWR_HOME"] = str(self.cli_home)
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # "Using SuperLink ..."
                    connection = read_superlink_connection(CONNECTION)
                    self._control = init_http_client_from_connection(connection)
            finally:
                if previous is None:
                    os.environ.pop("FLWR_HOME", None)
                else:
                    os.environ["FLWR_HOME"] = previous
        res = self._control.ListRuns(ListRunsRequest(run_id=run_id))
        status = run_from_proto(res.run_dict[run_id]).status
        return f"{status.status}:{status.sub_status}" if status.sub_status else status.status

    def wait(self, run_id: int, timeout: float, poll: float = 2.0) -> str:
        """Poll until the run finishes; returns its final status."""
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            status = self.status(run_id)
            if status.startswith("finished"):
                return status
            if not self.processes[0].alive():
                raise DeployError(f"flower-superlink exited:\n{self.processes[0].tail()}")
            time.sleep(poll)
        self.flwr("stop", str(run_id), timeout=60)
        raise DeployError(f"run {run_id} not finished after {timeout:.0f} s (last: {status})")

    def logs(self, lines: int = 40) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.tail(lines)}" for p in self.processes)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _last_json(text: str) -> dict[str, Any] | None:
    """The JSON object ``flwr ... --format json`` prints (the last one on stdout)."""
    start = text.find("{")
    while start != -1:
        try:
            value = json.loads(text[start:])
            return value if isinstance(value, dict) else None
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return None


def remote_commands(
    app_dir: str | Path,
    nodes: int,
    superlink: str = "SUPERLINK_HOST:8000",
    secure: SecureMaterial | None = None,
    clients_per_node: int = 1,
) -> str:
    """The raw commands of a multi-machine deployment of ``app_dir``: insecure, or with
    ``secure`` (:func:`hyperfed.deploy.secure.make_material`) over TLS with SuperNode
    authentication (each node's public key registered before the node starts).
    ``nodes`` is the number of clients; ``clients_per_node`` > 1: ceil(nodes / G) machines,
    machine ``i`` serving the clients of its ``partition-ids``."""
    num_clients = nodes
    groups = node_groups(num_clients, clients_per_node) if clients_per_node > 1 else None
    if groups is not None:
        nodes = len(groups)
    port = superlink.rsplit(":", 1)[-1] if ":" in superlink else "8000"
    if secure is None:
        link_security = "--insecure"
        node_security = "--insecure"
        cli_security = "insecure = true"
    else:
        s = secure.folder
        link_security = (
            f"--ssl-ca-certfile {s}/ca.crt --ssl-certfile {s}/server.pem "
            f"--ssl-keyfile {s}/server.key --enable-supernode-auth"
        )
        node_security = "--root-certificates ca.crt --auth-supernode-private-key node-$i"
        cli_security = f'root-certificates = "{s.resolve()}/ca.crt"'
    lines = [
        "# on the server machine (Fleet + Control API over HTTP on one port):",
        f"flower-superlink {link_security} --host 0.0.0.0 --port {port} "
        "--disable-runtime-dependency-installation",
        "",
        "# anywhere with the app folder: name the SuperLink once",
        "cat >> ~/.flwr/config.toml <<EOF",
        "[superlink.hyperfed]",
        f'address = "{superlink}"',
        cli_security,
        "EOF",
    ]
    if secure is not None:
        lines += [
            "# register every node's public key (only these nodes may connect):",
            f"for i in $(seq 0 {nodes - 1}); do "
            f"flwr supernode register {secure.folder}/nodes/node-$i.pub hyperfed; done",
        ]
    if groups is None:
        serves = "each serves the config's client i"
        node_config = f'"partition-id=$i num-partitions={num_clients}"'
    else:
        serves = "each serves the clients IDS[i], trained as one engine group"
        node_config = f"\"partition-ids='${{IDS[$i]}}' num-partitions={num_clients}\""
    lines += [
        "",
        f"# on client machine i = 0..{nodes - 1} ({serves})"
        + (
            f", holding ca.crt and its own nodes/node-$i (from {secure.folder}):"
            if secure is not None
            else ":"
        ),
        *([] if groups is None else [f"IDS=({' '.join(map(format_partition_ids, groups))})"]),
        f"flower-supernode {node_security} --superlink {superlink} "
        f"--node-config {node_config} "
        "--isolation process --port 9094 &",
        "# beside it, its long-lived ClientApp process (keeps the built client between rounds;",
        "# for Flower's process per message instead: --isolation subprocess, and no line below)",
        "python -m hyperfed.deploy.clientapp --runtime-api-address 127.0.0.1:9094",
        "",
        "# then start the run",
        f"flwr run {app_dir} hyperfed --stream",
        "flwr list hyperfed --format json   # status: finished:completed when done",
    ]
    return "\n".join(lines)
