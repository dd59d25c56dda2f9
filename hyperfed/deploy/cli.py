"""``hyperfed flower ...``: deploy an experiment with Flower (a sub-command of ``hyperfed``).

Errors a user can cause (a :class:`~hyperfed.errors.HyperfedError`) propagate to the command
line's one error boundary (``hyperfed.cli``), which prints them and exits 2."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hyperfed.terminal import console, fail, print_final

if TYPE_CHECKING:
    from hyperfed.deploy.launch import Simulated

flower_cli = typer.Typer(
    help="Deploy with Flower: a SuperLink (server) and one SuperNode per client, over the network.",
    no_args_is_help=True,
    add_completion=False,
)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML or YAML experiment file.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a key, e.g. --set rounds=50 (repeatable)."),
]


OutOpt = Annotated[
    Path | None, typer.Option(help="Run directory (default runs/<time>-flower-<algo>).")
]
ResumeOpt = Annotated[
    bool, typer.Option(help="Continue the run directory's last checkpoint (needs --out).")
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        help="Start a new run in a --out that is not empty: replaces an earlier run there and "
        "writes over its config.toml, metrics.jsonl and summary.md."
    ),
]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds to wait for the whole run.")]
RoundTimeoutOpt = Annotated[
    float, typer.Option(help="Seconds the server waits for the replies of one round.")
]
QuietOpt = Annotated[bool, typer.Option(help="No tables.")]
ClientsPerNodeOpt = Annotated[
    int,
    typer.Option(
        help="Clients each SuperNode serves (G): node k serves clients k*G .. k*G+G-1 and "
        "trains them as one engine group; ceil(clients.count / G) nodes."
    ),
]
SecureOpt = Annotated[
    bool,
    typer.Option(
        help="TLS with a throwaway CA and SuperNode authentication: one key pair per node, "
        "registered with the SuperLink (other keys are refused)."
    ),
]


def _need_flower() -> None:
    from hyperfed.deploy.launch import flwr_available

    if not flwr_available():
        fail("Flower is not installed; install it with: pip install 'hyperfed[flower]'")


def _load(config: Path | None, set_: list[str] | None):  # type: ignore[no-untyped-def]
    """The experiment config, refused (a HyperfedError: the CLI's one error boundary, in
    hyperfed.cli, prints it) unless Flower can deploy it."""
    from hyperfed.config import load_config
    from hyperfed.deploy.appconfig import flower_algorithm

    cfg = load_config(config, set_ or [])
    flower_algorithm(cfg)
    return cfg


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@flower_cli.command()
def local(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    nodes: Annotated[
        int | None,
        typer.Option(help="SuperNodes to start (default: ceil(clients.count / clients-per-node))."),
    ] = None,
    clients_per_node: ClientsPerNodeOpt = 1,
    out: OutOpt = None,
    resume: ResumeOpt = False,
    force: ForceOpt = False,
    timeout: TimeoutOpt = 3600.0,
    round_timeout: RoundTimeoutOpt = 600.0,
    threads: Annotated[
        int | None, typer.Option(help="torch threads per client process (default cores/nodes).")
    ] = None,
    quiet: QuietOpt = False,
    secure: SecureOpt = False,
    clientapp: Annotated[
        str,
        typer.Option(
            help="long-lived: one ClientApp process per SuperNode for the whole run "
            "(--isolation process; the client is built once); per-message: Flower's fresh "
            "flwr-clientapp process per message (--isolation subprocess)."
        ),
    ] = "long-lived",
) -> None:
    """Loopback deployment on this machine: one flower-superlink and N flower-supernode
    processes on 127.0.0.1 (each with its long-lived ClientApp process), `flwr run` of the
    app, then every process is stopped. --secure: over TLS, and only the N SuperNodes'
    registered keys may connect."""
    _need_flower()
    cfg = _load(config, set_)
    groups = _groups(cfg, clients_per_node)
    n = groups if nodes is None else nodes
    if not 1 <= n <= groups:
        what = "clients.count" if clients_per_node == 1 else "ceil(clients.count / G)"
        fail(f"--nodes {n}: must be between 1 and {what}={groups}")
    if clientapp not in ("long-lived", "per-message"):
        fail(f"--clientapp {clientapp}: must be long-lived or per-message")
    per_node = max(1, (os.cpu_count() or 1) // n)
    opts = LaunchOptions(
        n=n,
        threads=threads or per_node,
        timeout=timeout,
        round_timeout=round_timeout,
        quiet=quiet,
        resume=resume,
        force=force,
        simulated=None,
        secure=secure,
        clientapp=clientapp,
        clients_per_node=clients_per_node,
    )
    _launch(cfg, out, opts)


def _groups(cfg, clients_per_node: int) -> int:  # type: ignore[no-untyped-def]
    """How many nodes serve every client in groups of ``clients_per_node``."""
    if clients_per_node < 1:
        fail(f"--clients-per-node {clients_per_node}: must be >= 1")
    return -(-cfg.clients.count // clients_per_node)


@flower_cli.command()
def sim(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: OutOpt = None,
    resume: ResumeOpt = False,
    force: ForceOpt = False,
    cpus: Annotated[int, typer.Option(help="CPUs each simulated client (Ray actor) reserves.")] = 1,
    gpus: Annotated[
        float, typer.Option(help="GPUs each simulated client reserves (e.g. 0.25).")
    ] = 0.0,
    ray_address: Annotated[
        str | None, typer.Option(help="Attach to a running Ray cluster (HEAD:6379, or 'auto').")
    ] = None,
    threads: Annotated[int, typer.Option(help="torch threads per simulated client.")] = 1,
    timeout: TimeoutOpt = 3600.0,
    round_timeout: RoundTimeoutOpt = 600.0,
    quiet: QuietOpt = False,
    clients_per_node: ClientsPerNodeOpt = 1,
) -> None:
    """Flower's Simulation Engine (Ray): clients.count simulated SuperNodes (with
    --clients-per-node G: ceil(clients.count / G), each serving G clients as one engine group)
    run the same ClientApp as a deployment, as Ray actors (on this machine or a Ray cluster);
    writes the same run directory as `hyperfed run`. Needs: pip install
    'hyperfed\\[simulation]'."""  # \\[: rich markup in --help would drop "[simulation]"
    from hyperfed.deploy.launch import Simulated

    _need_flower()
    cfg = _load(config, set_)
    if importlib.util.find_spec("ray") is None:
        fail("Ray is not installed; install it with: pip install 'hyperfed[simulation]'")
    if cpus < 1 or gpus < 0:
        fail(f"--cpus {cpus} / --gpus {gpus}: need cpus >= 1 and gpus >= 0")
    simulated = Simulated(cpus, gpus, ray_address)
    n = _groups(cfg, clients_per_node)
    opts = LaunchOptions(
        n=n,
        threads=threads,
        timeout=timeout,
        round_timeout=round_timeout,
        quiet=quiet,
        resume=resume,
        force=force,
        simulated=simulated,
        clients_per_node=clients_per_node,
    )
    _launch(cfg, out, opts)


@dataclass(frozen=True)
class LaunchOptions:
    """What `hyperfed flower local` / `sim` pass on to the deployment: nodes, torch threads per
    client process, timeouts, and the run's switches."""

    n: int
    threads: int
    timeout: float
    round_timeout: float
    quiet: bool
    resume: bool
    force: bool
    simulated: Simulated | None  # Ray's resources for `sim`; None: a loopback deployment
    secure: bool = False
    clientapp: str = "long-lived"
    clients_per_node: int = 1


def _launch(cfg: Any, out: Path | None, opts: LaunchOptions) -> None:
    from hyperfed.runtime.rundir import RunDir

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = "flower" if opts.simulated is None else "flower-sim"
    # absolute: the SuperLink and the nodes run in another working folder (workdir)
    run_dir = (out or Path("runs") / f"{stamp}-{kind}-{cfg.algorithm.name}").absolute()
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"--out {out} is a file; choose a folder")
    # held by this process for the whole deployment: a second run on it is refused
    with RunDir(run_dir).locked():
        _deploy(cfg, run_dir, opts)


def _deploy(cfg: Any, run_dir: Path, opts: LaunchOptions) -> None:
    from hyperfed.deploy.launch import DeployError, LocalDeployment
    from hyperfed.runtime.rundir import CHECKPOINT, check_new_run

    n, quiet, secure, simulated = opts.n, opts.quiet, opts.secure, opts.simulated
    clients_per_node = opts.clients_per_node

    if opts.resume:
        if not (run_dir / CHECKPOINT).exists():  # the file the server writes (rundir.py)
            fail(
                f"--resume: {run_dir} holds no checkpoint ({CHECKPOINT}); set checkpoint_every "
                "and --out"
            )
    else:
        check_new_run(run_dir, opts.force, resume=f"--out {run_dir} --resume")
    workdir = run_dir / "flower"
    secure_dir = workdir / "secure"
    t0 = time.perf_counter()
    # SIGTERM stops the SuperLink and SuperNodes as Ctrl-C does (the context manager's exit)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        material = None
        if secure:  # throwaway: a fresh CA and node keys for this run, deleted after it
            from hyperfed.deploy.secure import make_material

            material = make_material(secure_dir, n, days=1)
        deployment = LocalDeployment(
            cfg,
            workdir,
            run_dir,
            nodes=n,
            num_partitions=cfg.clients.count,
            threads=opts.threads,
            round_timeout=opts.round_timeout,
            simulated=simulated,
            resume=opts.resume,
            secure=material,
            clientapp=opts.clientapp,
            clients_per_node=clients_per_node,
        )
        with deployment:
            if not quiet:
                how = "SuperNodes" if simulated is None else "simulated SuperNodes (Ray)"
                if clients_per_node > 1:
                    how += f" of {clients_per_node} clients each"
                if secure:
                    how += " (TLS, SuperNode authentication)"
                console.print(
                    f"[bold]{cfg.algorithm.name}[/] on Flower: SuperLink 127.0.0.1:"
                    f"{deployment.port}, {n} {how}, {cfg.rounds} rounds; logs in "
                    f"{workdir}/logs"
                )
            run_id = deployment.submit()
            status = deployment.wait(run_id, opts.timeout)
            if status != "finished:completed":
                fail(f"Flower run {run_id} ended {status}:\n{deployment.logs()}", code=1)
    except DeployError as e:
        fail(str(e), code=1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        # the throwaway keys (private ones among them), on every way out: success, failure,
        # Ctrl-C, SIGTERM
        shutil.rmtree(secure_dir, ignore_errors=True)
    shutil.rmtree(workdir / "homes", ignore_errors=True)  # installed app copies
    if not quiet:
        print_final(run_dir, time.perf_counter() - t0)


@flower_cli.command("app")
def app_(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: Annotated[Path, typer.Option(help="Folder for the Flower app.")] = Path("flower-app"),
    run_dir: Annotated[
        str | None, typer.Option(help="Run directory on the SuperLink's machine.")
    ] = None,
    min_nodes: Annotated[
        int, typer.Option(help="SuperNodes the server waits for (0: clients.count).")
    ] = 0,
    join_timeout: Annotated[float, typer.Option(help="Seconds the server waits for them.")] = 300.0,
    round_timeout: Annotated[
        float, typer.Option(help="Seconds the server waits for one round's replies.")
    ] = 600.0,
    superlink: Annotated[
        str, typer.Option(help="SuperLink address for the printed commands.")
    ] = "SUPERLINK_HOST:8000",
    secure: Annotated[
        bool,
        typer.Option(
            help="Also write a CA, a server certificate for the --superlink host and one "
            "key pair per node (TLS + SuperNode authentication) into --secure-dir."
        ),
    ] = False,
    secure_dir: Annotated[
        Path | None,
        typer.Option(help="Folder for --secure's files (default: <out>-secure, never in the app)."),
    ] = None,
    clients_per_node: ClientsPerNodeOpt = 1,
) -> None:
    """Write the Flower app folder for a real multi-machine deployment and print the
    flower-superlink / flower-supernode / flwr run commands."""
    from hyperfed.deploy.appconfig import RunSettings, write_app
    from hyperfed.deploy.launch import remote_commands

    cfg = _load(config, set_)
    groups = _groups(cfg, clients_per_node)
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file; choose a folder for the Flower app")
    material = None
    if secure:
        from hyperfed.deploy.secure import make_material

        host = superlink.rsplit(":", 1)[0].strip("[]")
        if not host or host == "SUPERLINK_HOST":
            fail("--secure: name the SuperLink's host, e.g. --superlink server.example.org:8000")
        folder = secure_dir or out.with_name(out.name + "-secure")
        if folder.resolve().is_relative_to(out.resolve()):
            # flwr run ships the app folder to the SuperLink and every node
            fail(f"--secure-dir {folder}: must not lie inside the app folder {out}")
        if folder.exists() and not folder.is_dir():
            fail(f"--secure-dir {folder} is a file; choose a folder")
        try:
            material = make_material(folder, groups, hosts=[host])
        except OSError as e:
            fail(f"--secure-dir {folder}: cannot write there ({e.strerror or e})")
    try:
        settings = RunSettings(
            run_dir=run_dir or "",
            min_nodes=min_nodes,
            join_timeout=join_timeout,
            round_timeout=round_timeout,
            clients_per_node=clients_per_node,
        )
        path = write_app(out, cfg, settings)
    except OSError as e:
        fail(f"--out {out}: cannot write the Flower app there ({e.strerror or e})")
    console.print(f"wrote {path / 'pyproject.toml'}", highlight=False)
    if material is not None:
        console.print(
            f"wrote {material.folder}: ca.crt, server.pem, server.key (server machine only), "
            f"nodes/node-<i> (client machine i only) and nodes/node-<i>.pub",
            highlight=False,
        )
    console.print()
    console.print(
        remote_commands(path, cfg.clients.count, superlink, material, clients_per_node),
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
