"""Flower over TLS with SuperNode authentication (issue 39, item 1).

The certificates and keys are checked with the standard library's TLS and with Flower's own
key loaders; a real loopback deployment then runs over TLS with node authentication, with two
intruders beside the registered nodes: one signing with a key nobody registered, one holding a
registered key but not the CA certificate. Neither may join or receive a message, and the run
ends with the simulator's metrics.

Skipped as a whole when Flower is not installed (``pip install 'hyperfed[flower]'``)."""

from __future__ import annotations

import json
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'hyperfed[flower]'")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402

from hyperfed.config import load_config  # noqa: E402
from hyperfed.deploy.launch import LocalDeployment  # noqa: E402
from hyperfed.deploy.secure import make_material, make_node_key  # noqa: E402
from hyperfed.runtime.rundir import read_metrics  # noqa: E402
from hyperfed.runtime.simulate import Simulation  # noqa: E402

# digits, 2 LeNet clients, 1 round of FedPer (the body crosses, the head stays): the smallest
# run in which both directions carry parameters over TLS
SETTINGS = [
    "device=cpu",
    "seed=0",
    "rounds=1",
    "eval_every=1",
    "dataset.name=digits",
    "partition.name=quantity",
    "partition.classes_per_client=3",
    "clients.count=2",
    "clients.models=lenet",
    "algorithm.name=fedper",
    "local.epochs=1",
    "local.batch_size=32",
    "local.lr=0.05",
]


# -- the material ---------------------------------------------------------------------------------


def _handshake(material, ca: Path | None, host: str) -> str:
    """A TLS handshake with a server holding ``material``'s certificate: "ok" or the error."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(material.server_cert, material.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=None if ca is None else str(ca))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            client_ctx.wrap_socket(raw, server_hostname=host) as tls,
        ):
            tls.sendall(b"x")
        return "ok"
    except ssl.SSLError as e:
        return str(e)
    finally:
        thread.join(timeout=10)
        listener.close()


def test_material_is_a_ca_a_server_certificate_it_signed_and_one_key_pair_per_node(tmp_path):
    m = make_material(tmp_path / "s", 3)
    ca = x509.load_pem_x509_certificate(m.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(m.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]

    # what a client does: trusts the CA file and checks the name; without it, refused
    assert _handshake(m, m.ca_cert, "127.0.0.1") == "ok"
    assert _handshake(m, m.ca_cert, "localhost") == "ok"
    assert "CERTIFICATE_VERIFY_FAILED" in _handshake(m, None, "127.0.0.1")
    assert "CERTIFICATE_VERIFY_FAILED" in _handshake(m, m.ca_cert, "127.0.0.2")  # not its name
    other = make_material(tmp_path / "other", 0)
    assert "CERTIFICATE_VERIFY_FAILED" in _handshake(m, other.ca_cert, "127.0.0.1")

    # node keys: Flower's own loaders accept them (register: public, SuperNode: private)
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    publics = set()
    for i, key in enumerate(m.node_keys):
        private = load_ssh_private_key(key.read_bytes(), password=None)
        public = serialization.load_ssh_public_key(m.public_key(i).read_bytes())
        assert private.public_key().public_numbers() == public.public_numbers()  # a pair
        publics.add(try_load_public_key(m.public_key(i)))
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(m.server_key.stat().st_mode) == 0o600
    assert len(publics) == 3  # one key per node
    # the CA's private key is never written: nothing else can be signed with it
    files = sorted(str(p.relative_to(m.folder)) for p in m.folder.rglob("*") if p.is_file())
    assert files == [
        "ca.crt",
        *[f"nodes/node-{i}{ext}" for i in range(3) for ext in ("", ".pub")],
        "server.key",
        "server.pem",
    ]


def test_flower_app_secure_writes_the_material_for_the_superlink_host_beside_the_app(tmp_path):
    from typer.testing import CliRunner

    from hyperfed.cli import app

    sets = [a for s in SETTINGS for a in ("--set", s)]
    out = tmp_path / "app"
    args = ["flower", "app", *sets, "--out", str(out), "--secure"]
    res = CliRunner().invoke(app, [*args, "--superlink", "fl.example.org:9092"])
    assert res.exit_code == 0, res.output
    folder = tmp_path / "app-secure"  # beside the app: flwr run ships the app folder
    assert not list(out.rglob("node-*")) and not list(out.rglob("*.key"))
    server = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert sorted(p.name for p in (folder / "nodes").iterdir()) == [
        "node-0",
        "node-0.pub",
        "node-1",
        "node-1.pub",
    ]
    text = " ".join(res.output.split())
    assert "--enable-supernode-auth" in text and "--port 9092" in text
    assert "flwr supernode register" in text and "--auth-supernode-private-key" in text
    assert "--insecure" not in text

    res = CliRunner().invoke(app, [*args, "--superlink", "SUPERLINK_HOST:8000"])
    assert res.exit_code != 0 and "name the SuperLink's host" in res.output
    inside = ["--secure-dir", str(out / "keys"), "--superlink", "h:1"]
    res = CliRunner().invoke(app, [*args, *inside])
    assert res.exit_code != 0 and "must not lie inside the app folder" in res.output


def test_flower_local_secure_runs_a_deployment_with_fresh_material_and_deletes_it(
    tmp_path, monkeypatch
):
    """The command's wiring: a fresh CA and one key per node reach the deployment, the keys
    are gone afterwards (the deployment itself is the next test)."""
    from typer.testing import CliRunner

    from hyperfed.cli import app
    from hyperfed.deploy import launch

    seen = {}

    class Fake(LocalDeployment):
        def __enter__(self):
            seen["material"] = self.secure
            if self.secure is not None:
                seen["files"] = sorted(p.name for p in self.secure.folder.rglob("*"))
            return self

        def __exit__(self, *exc):
            pass

        def submit(self):
            return 1

        def wait(self, run_id, timeout, poll=2.0):
            return "finished:completed"

    monkeypatch.setattr(launch, "LocalDeployment", Fake)
    monkeypatch.setattr("hyperfed.deploy.cli.print_final", lambda *a: None)
    out = tmp_path / "run"
    sets = [a for s in SETTINGS for a in ("--set", s)]
    res = CliRunner().invoke(app, ["flower", "local", *sets, "--out", str(out), "--secure"])
    assert res.exit_code == 0, res.output
    material = seen["material"]
    assert material is not None and len(material.node_keys) == 2
    assert {"ca.crt", "server.pem", "server.key", "node-0", "node-1"} <= set(seen["files"])
    assert not material.folder.exists()  # throwaway
    res = CliRunner().invoke(app, ["flower", "local", *sets, "--out", str(tmp_path / "r2")])
    assert res.exit_code == 0, res.output
    assert seen["material"] is None  # no --secure: no material


# -- a real deployment ------------------------------------------------------------------------------


def _public_pem(private_key: Path) -> str:
    """The PEM text the SuperLink logs for a key it does not know."""
    key = serialization.load_ssh_private_key(private_key.read_bytes(), password=None)
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem.decode().replace("\n", "\\n")


@pytest.mark.slow  # ~1 min: CI runs it
def test_secure_loopback_runs_like_the_simulator_and_refuses_intruders(tmp_path, deployments):
    cfg = load_config(None, SETTINGS)
    expected = Simulation(cfg).run()
    material = make_material(tmp_path / "secure", 2, days=1)
    d = LocalDeployment(
        cfg,
        tmp_path / "flower",
        tmp_path / "run",
        nodes=2,
        num_partitions=2,
        threads=1,
        join_timeout=120,
        round_timeout=150,
        secure=material,
    )
    deployments.append(d)
    d.start()
    assert len(d.node_ids) == 2  # the two registered keys
    # intruders: one claims client 0 with a key nobody registered; one has no key and asks
    # to register itself (what every SuperNode without a key does, and is let in when the
    # SuperLink does not authenticate nodes); one holds client 1's registered key but was
    # never given ca.crt
    rogue_key = make_node_key(tmp_path / "rogue")
    rogue = d.spawn_supernode(0, name="rogue", private_key=rogue_key)
    keyless = d.spawn_supernode(0, name="keyless")
    no_ca = d.spawn_supernode(1, name="no-ca", private_key=material.node_keys[1], trust_ca=False)
    # all are refused and give up (were they let in, they would wait for messages instead)
    for intruder in (rogue, keyless, no_ca):
        assert intruder.popen.wait(timeout=120) != 0, d.logs()

    status = d.wait(d.submit(), timeout=900)
    assert status == "finished:completed", d.logs()

    link = (tmp_path / "flower" / "logs" / "superlink.log").read_text()
    assert "No SuperNode found with the given public key" in link
    assert _public_pem(rogue_key) in link  # that key, logged
    assert "Failed to activate SuperNode" in rogue.log.read_text()
    assert "All SuperNodes must be registered via the CLI" in keyless.log.read_text()
    assert "CERTIFICATE_VERIFY_FAILED" in no_ca.log.read_text()
    for intruder in (rogue, keyless, no_ca):  # never got a message
        assert "Receiving" not in intruder.log.read_text()

    run = tmp_path / "run"
    wire = [json.loads(line) for line in (run / "wire.jsonl").read_text().splitlines()]
    assert {w["node"] for w in wire} == set(d.node_ids)  # only the registered nodes
    assert "joined: clients [0, 1] of 2" in (run / "server.log").read_text()
    got = read_metrics(run)
    assert [r["round"] for r in got] == [r["round"] for r in expected] == [1]
    for a, b in zip(expected, got, strict=True):  # every client's accuracy, every byte
        assert b["client_acc"] == pytest.approx(a["client_acc"], abs=1e-4)
        assert b["bytes_up_total"] == a["bytes_up_total"]
        assert b["bytes_down_total"] == a["bytes_down_total"]
