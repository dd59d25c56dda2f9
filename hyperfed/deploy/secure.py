"""TLS certificates and SuperNode keys for a Flower deployment (``--secure``).

:func:`make_material` writes, with the ``cryptography`` library:

- ``ca.crt``: a self-signed certificate authority (ECDSA P-384). Its private key is never
  written: it signs the server certificate and is gone, so nothing else can ever be signed
  with it (to reissue the server certificate, write the material again);
- ``server.pem`` / ``server.key``: the SuperLink's certificate, signed by that CA, valid for
  the host names and IP addresses given (loopback: ``127.0.0.1``, ``localhost``);
- ``nodes/node-<i>`` / ``nodes/node-<i>.pub``: one key pair per SuperNode (ECDSA P-384,
  OpenSSH format, as ``ssh-keygen -t ecdsa -b 384`` writes it): the SuperNode signs its
  requests with the private key (``flower-supernode --auth-supernode-private-key``), and the
  SuperLink (``--enable-supernode-auth``) answers only nodes whose public key was registered
  (``flwr supernode register node-<i>.pub``).

Private keys are written with mode 0600. Every path is absolute (the processes that read the
files run in another working folder). The material is throwaway for a loopback run
(``hyperfed flower local --secure``); ``hyperfed flower app --secure`` writes it for a real
deployment, where each ``node-<i>`` file is copied to client machine ``i`` only.

This module does not import ``flwr``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
_CURVE = ec.SECP384R1  # P-384: a NIST curve, as `flwr supernode register` requires


@dataclass(frozen=True)
class SecureMaterial:
    """Where :func:`make_material` put the files of one deployment."""

    folder: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # private keys, node i at index i; public key: <path>.pub

    def public_key(self, node: int) -> Path:
        return self.node_keys[node].with_name(self.node_keys[node].name + ".pub")

    @classmethod
    def load(cls, folder: str | Path, nodes: int) -> SecureMaterial:
        """The material :func:`make_material` wrote into ``folder`` for ``nodes`` nodes."""
        folder = Path(folder).absolute()  # the SuperLink runs in another working folder
        material = cls(
            folder,
            folder / "ca.crt",
            folder / "server.pem",
            folder / "server.key",
            tuple(folder / "nodes" / f"node-{i}" for i in range(nodes)),
        )
        needed = [material.ca_cert, material.server_cert, material.server_key]
        needed += [p for i in range(nodes) for p in (material.node_keys[i], material.public_key(i))]
        missing = [str(p) for p in needed if not p.exists()]
        if missing:
            raise FileNotFoundError(f"secure material incomplete, missing: {', '.join(missing)}")
        return material


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if private:  # created 0600, never readable by others even for a moment
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hyperfed"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_node_key(path: str | Path) -> Path:
    """One SuperNode key pair: ``path`` (private, OpenSSH, 0600) and ``path.pub``."""
    path = Path(path)
    key = ec.generate_private_key(_CURVE())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(path, private, private=True)
    _write(path.with_name(path.name + ".pub"), public + f" hyperfed-{path.name}\n".encode())
    return path


def make_material(
    folder: str | Path,
    nodes: int,
    hosts: Sequence[str] = LOOPBACK_HOSTS,
    days: int = 365,
) -> SecureMaterial:
    """A throwaway CA, a server certificate for ``hosts`` (IP addresses or DNS names) signed
    by it, and one key pair per node, written into ``folder`` (see the module docstring)."""
    if nodes < 0:
        raise ValueError(f"nodes={nodes}: must be >= 0")
    if not hosts:
        raise ValueError("hosts: name at least one host name or IP address of the SuperLink")
    if days < 1:
        raise ValueError(f"days={days}: must be >= 1")
    # absolute: the SuperLink and SuperNodes that read these files run in another working folder
    folder = Path(folder).absolute()
    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(_CURVE())
    ca_name = _name("hyperfed throwaway CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(_CURVE())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    _write(folder / "ca.crt", ca_cert.public_bytes(pem))
    _write(folder / "server.pem", server_cert.public_bytes(pem))
    _write(
        folder / "server.key",
        server_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        private=True,
    )
    keys = tuple(make_node_key(folder / "nodes" / f"node-{i}") for i in range(nodes))
    return SecureMaterial(
        folder, folder / "ca.crt", folder / "server.pem", folder / "server.key", keys
    )
