"""TLS for every channel of a cluster: certificates from files (``--tls-cert/--tls-key/--tls-ca`` or
``HELIX_TLS_CERT`` / ``_KEY`` / ``_CA``), checked up front, or a job's own throwaway CA.

With TLS, services listen on TLS ports and every channel checks its peer against the CA; a client
that has a certificate presents it (mutual TLS). The token still authenticates every call: TLS
keeps it (and the data) off the wire and proves the server is the cluster's. A job's own CA
(``Tls.for_job``) signs one certificate for the name ``helix-cluster``, which every channel checks
instead of the address, so one certificate serves every host of the job; a job on several nodes
derives its CA and certificate on every node from the job's secret (``Tls.from_secret``), so no
private key crosses the network. ``repr`` never shows a private key.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

__all__ = ["ENV", "JOB_SERVER_NAME", "Tls", "write_certificates"]

ENV = {
    "cert": "HELIX_TLS_CERT",
    "key": "HELIX_TLS_KEY",
    "ca": "HELIX_TLS_CA",
    "server_name": "HELIX_TLS_SERVER_NAME",
}  # the last: the name certificates are checked for (optional)
FLAGS = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca"}
JOB_SERVER_NAME = "helix-cluster"


def _read(path: str, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{where}: {path} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True, repr=False)
class Tls:
    """PEM bytes: ``ca`` (required: the peers' CA), ``cert`` + ``key`` (this side's certificate
    chain and key: needed to serve, optional for a client — then it is not mutual). ``names``:
    what to call each field in errors (flags or environment variables). ``server_name``: the name
    peers' certificates must carry instead of the dialled address (a job's own CA)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None
    names: tuple = (FLAGS["cert"], FLAGS["key"], FLAGS["ca"])

    def __post_init__(self):
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        cert_name, key_name, ca_name = self.names
        try:
            cas = x509.load_pem_x509_certificates(self.ca)
        except ValueError as e:
            raise ValueError(f"{ca_name}: not a PEM certificate ({e})") from None
        _check_dates(cas, ca_name)
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"{cert_name} and {key_name} go together: give both or neither")
        if self.cert is None:
            return
        try:
            chain = x509.load_pem_x509_certificates(self.cert)
        except ValueError as e:
            raise ValueError(f"{cert_name}: not a PEM certificate ({e})") from None
        _check_dates(chain, cert_name)
        try:
            key = serialization.load_pem_private_key(self.key, password=None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{key_name}: not an unencrypted PEM private key ({e})") from None
        if key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) != chain[0].public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ):
            raise ValueError(f"{key_name} is not the key of the certificate in {cert_name}")
        if not any(_issued_by(c, ca) for c in chain for ca in cas):
            raise ValueError(
                f"the certificate in {cert_name} is not signed by the CA in {ca_name}: peers would refuse it"
            )

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, ca: str | None, names: dict = FLAGS) -> Tls | None:
        """TLS from PEM files (None when none is given); ``ValueError`` naming the flag at fault."""
        if not (cert or key or ca):
            return None
        if not ca:
            raise ValueError(
                f"{names['ca']} is needed with {names['cert']} / {names['key']} (the CA peers are checked against)"
            )
        return cls(
            _read(ca, names["ca"]),
            _read(cert, names["cert"]) if cert else None,
            _read(key, names["key"]) if key else None,
            names=(names["cert"], names["key"], names["ca"]),
        )

    @classmethod
    def from_env(cls) -> Tls | None:
        """TLS from ``HELIX_TLS_CERT`` / ``HELIX_TLS_KEY`` / ``HELIX_TLS_CA`` (paths), else None;
        ``HELIX_TLS_SERVER_NAME``: the name peers' certificates are checked for, not the address."""
        tls = cls.from_files(*(os.environ.get(ENV[k]) or None for k in ("cert", "key", "ca")), names=ENV)
        name = os.environ.get(ENV["server_name"])
        if tls is not None and name:
            tls = cls(tls.ca, tls.cert, tls.key, server_name=name, names=tls.names)
        return tls

    @classmethod
    def for_job(cls) -> Tls:
        """A throwaway CA and one certificate (for ``JOB_SERVER_NAME``) for the processes of one
        machine (a ``LocalCluster`` and its children)."""
        ca_pem, ca_key, ca_cert = _make_ca()
        cert_pem, key_pem = _make_leaf(ca_key, ca_cert, [JOB_SERVER_NAME, "localhost", "127.0.0.1"])
        return cls(ca_pem, cert_pem, key_pem, server_name=JOB_SERVER_NAME)

    @classmethod
    def from_secret(cls, secret: bytes, label: str) -> Tls:
        """The TLS of a job on several nodes, which every node derives by itself from the job's
        secret (``HELIX_JOB_SECRET``) and ``label`` (its run id and attempt), so no private key is
        ever handed from node to node: the CA's key and the certificate's key follow from the
        secret (HKDF), each node signs its own copy of the CA and of the certificate (for
        ``JOB_SERVER_NAME``), and every copy checks against every other (same key, same name)."""
        ca_key, leaf_key = (_derived_key(secret, f"{label}/{what}") for what in ("ca", "leaf"))
        ca_pem, ca_key, ca_cert = _make_ca(key=ca_key)
        cert_pem, key_pem = _make_leaf(ca_key, ca_cert, [JOB_SERVER_NAME, "localhost", "127.0.0.1"], key=leaf_key)
        return cls(ca_pem, cert_pem, key_pem, server_name=JOB_SERVER_NAME)

    def __repr__(self) -> str:  # never the private key (a log line or a traceback would carry it)
        return (
            f"Tls(ca=<{self.ca.count(b'-----BEGIN ')} certificate(s)>, "
            f"cert={'<certificate>' if self.cert else None}, key={'<redacted>' if self.key else None}, "
            f"server_name={self.server_name!r})"
        )

    # ---- gRPC ---------------------------------------------------------------------------------
    def server_credentials(self):
        import grpc

        if self.cert is None:
            raise ValueError(f"serving with TLS needs {self.names[0]} and {self.names[1]}")
        # mutual: every peer presents a certificate the CA signed (gRPC Python can't make it optional)
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    # ---- handing it to a child process ----------------------------------------------------------
    def environ(self, folder: str) -> dict[str, str]:
        """``HELIX_TLS_*`` for a child process: the PEMs written into ``folder``, and the server name."""
        env = {ENV[k]: path for k, path in self.write(folder).items()}
        if self.server_name:
            env[ENV["server_name"]] = self.server_name
        return env

    def write(self, folder: str) -> dict[str, str]:
        """Write the PEMs into ``folder`` (files 0600); ``{"cert", "key", "ca"}`` → paths."""
        paths = {}
        for name, data in (("ca", self.ca), ("cert", self.cert), ("key", self.key)):
            if data is None:
                continue
            path = paths[name] = os.path.join(folder, f"tls-{name}.pem")
            tmp = f"{path}.{os.getpid()}.tmp"  # a new file of mode 0600, never an old one's mode or a symlink
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return paths


def _check_dates(certs, where: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    for c in certs:
        if not c.not_valid_before_utc <= now <= c.not_valid_after_utc:
            raise ValueError(
                f"{where}: the certificate for {c.subject.rfc4514_string()} is valid only from "
                f"{c.not_valid_before_utc:%Y-%m-%d} to {c.not_valid_after_utc:%Y-%m-%d}"
            )


def _issued_by(cert, ca) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except Exception:  # noqa: BLE001 - ValueError, TypeError, InvalidSignature: not this CA
        return False


def _name(common: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _derived_key(secret: bytes, label: str):
    """A P-256 private key that follows from ``secret`` and ``label`` alone (HKDF-SHA256)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # of SECP256R1
    raw = HKDF(hashes.SHA256(), 48, salt=b"helix-job-tls", info=label.encode()).derive(secret)
    return ec.derive_private_key(int.from_bytes(raw, "big") % (order - 1) + 1, ec.SECP256R1())


def _make_ca(days: int = 30, key=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = key or ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("helix job CA"))
        .issuer_name(_name("helix job CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), key, cert


def _san(names: list[str]):
    from cryptography import x509

    out = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def write_certificates(folder: str, names: list[str], days: int = 365) -> dict[str, str]:
    """A new CA and one certificate for ``names`` (host names and IP addresses the services are
    dialled by), written into ``folder`` as ``tls-ca.pem``, ``tls-cert.pem``, ``tls-key.pem``
    (0600), valid for ``days``; returns ``{"ca", "cert", "key"}`` → paths. Copy all three to every
    host (the key stays private to the cluster's machines)."""
    if not names:
        raise ValueError("--names: name at least one host name or address")
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= 3650:
        raise ValueError(f"--days must be an int in [1, 3650], got {days!r}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    ca_pem, ca_key, ca_cert = _make_ca(days)
    cert_pem, key_pem = _make_leaf(ca_key, ca_cert, list(names), days)
    return Tls(ca_pem, cert_pem, key_pem).write(folder)


def _make_leaf(ca_key, ca_cert, names: list[str], days: int = 30, key=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = key or ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    san = _san(names)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
