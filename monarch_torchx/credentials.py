"""What proves that a process belongs to one pool: the HMAC secret, and the pool's TLS
certificate when its traffic leaves the machine.

Both are made by the client when the pool is created and kept in the pool's private state dir
(``token``, ``tls.pem``: 0600 under 0700), where every agent, proc and controller reads them.
The certificate is self-signed and shared by every member, like the secret: a peer is one of
ours when it presents exactly this certificate and proves it holds its key, which is what the
secret proves again inside the TLS session (it also binds the agent the client meant to reach).
A pool on loopback has no ``tls.pem`` and sends plaintext frames: nothing leaves the machine.
"""

from __future__ import annotations

import datetime
import functools
import ssl
from dataclasses import dataclass
from pathlib import Path

from .private import write_private_bytes

TOKEN_FILE = "token"
TLS_FILE = "tls.pem"
_CERT_END = "-----END CERTIFICATE-----"


def new_tls_pem(pool: str) -> str:
    """A fresh self-signed Ed25519 certificate and its key, as one PEM text (certificate first)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"monarch-torchx pool {pool}"[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, None)
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM).decode()
        + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
    )


def check_tls_pem(text: str) -> None:
    """Raises ValueError unless ``text`` holds a certificate followed by its private key."""
    if _CERT_END not in text or "PRIVATE KEY-----" not in text.split(_CERT_END, 1)[1]:
        raise ValueError("not a pool certificate (expected a PEM certificate followed by its key)")


@dataclass(frozen=True)
class PoolCredentials:
    """One pool's secret and, where its traffic is encrypted, its certificate file."""

    key: bytes
    tls_file: str | None = None  # cert + key PEM (0600); None: plaintext frames (loopback pools)

    @property
    def tls(self) -> bool:
        return self.tls_file is not None

    @classmethod
    def load(cls, state_dir: Path) -> PoolCredentials:
        """The credentials a pool's state dir holds (token always, tls.pem when the pool uses TLS)."""
        state_dir = Path(state_dir)
        key = bytes.fromhex((state_dir / TOKEN_FILE).read_text().strip())
        tls = state_dir / TLS_FILE
        return cls(key, str(tls) if tls.exists() else None)

    @staticmethod
    def install(state_dir: Path, token: str, tls_pem: str = "") -> None:
        """Writes a pool's credentials into a (private, already checked) state dir."""
        bytes.fromhex(token)  # a malformed secret fails here, with the files untouched
        if tls_pem:
            check_tls_pem(tls_pem)
            write_private_bytes(Path(state_dir) / TLS_FILE, tls_pem.encode())
        write_private_bytes(Path(state_dir) / TOKEN_FILE, token.encode())

    # SSLContexts are built once per credentials object (about a millisecond each) and shared by
    # every connection of the process that holds it.

    @functools.cached_property
    def client_context(self) -> ssl.SSLContext | None:
        return self._context(server=False) if self.tls else None

    @functools.cached_property
    def server_context(self) -> ssl.SSLContext | None:
        return self._context(server=True) if self.tls else None

    def _context(self, server: bool) -> ssl.SSLContext:
        assert self.tls_file is not None
        text = Path(self.tls_file).read_text()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        # peers are verified by certificate, not by name: every member holds the same one, and
        # the handshake inside the session names the agent meant
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        if server:
            ctx.num_tickets = 0  # no resumption: a ticket would be one more record for each new client to read
        ctx.load_cert_chain(self.tls_file)
        ctx.load_verify_locations(cadata=text.split(_CERT_END, 1)[0] + _CERT_END + "\n")
        return ctx


def new_monarch_tls(job: str, names: list[str]) -> str:
    """A CA and one certificate it signed, for every process of one real-Monarch job, with the key:
    one PEM text (CA certificate, certificate, key). Monarch's TLS (rustls) wants a CA apart from
    the certificate it checks, and the addresses its peers dial (``names``: IPs and host names) in
    the certificate; each peer presents this certificate and accepts only peers signed by the CA."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject: str, issuer: x509.Name | None, signer: ec.EllipticCurvePrivateKey | None, ca: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject[:64])])
        b = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer or name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        )
        if not ca:
            alt: list[x509.GeneralName] = []
            for n in dict.fromkeys(names):
                try:
                    alt.append(x509.IPAddress(ipaddress.ip_address(n)))
                except ValueError:
                    alt.append(x509.DNSName(n))
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return key, b.sign(signer or key, hashes.SHA256())

    ca_key, ca_cert = build(f"monarch-torchx job {job} CA", None, None, True)
    key, cert = build(f"monarch-torchx job {job}", ca_cert.subject, ca_key, False)
    pem = serialization.Encoding.PEM
    return (
        ca_cert.public_bytes(pem).decode()
        + cert.public_bytes(pem).decode()
        + key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    )
