"""The one transport both runtimes stand on: frames and wire errors (``frames``), the handshake
(``handshake``), the blocking dialer, acceptor and client (``blocking``), the asyncio acceptor and
request server (``aio``), and the client's fan-out through the pool (``fanout``).

This package imports only ``credentials`` and ``errors`` of the rest of the project (a test holds
it to that). Its names below are the blocking side, importable without asyncio (the torchx CLI's
path); ``net.aio`` is imported by what serves.
"""

from __future__ import annotations

from .blocking import Client, FrameReader, ThreadedAcceptor, dial, more_buffered, send_msg, send_region
from .frames import (
    MAX_BODY,
    UNIX,
    AsyncFrameSink,
    ConnectFailed,
    FileRegion,
    FileRegionError,
    FrameParser,
    FrameSink,
    Gathered,
    HandshakeRefused,
    MalformedFrame,
    PeerClosed,
    PeerTimeout,
    ProofRejected,
    RemoteError,
    UnknownOperation,
    WireError,
    decode,
    encode,
    remote_error,
)
from .handshake import HANDSHAKE_TIMEOUT_S, MAX_HANDSHAKES, HandshakeGate, accept_handshake

__all__ = [
    "AsyncFrameSink",
    "FrameSink",
    "HANDSHAKE_TIMEOUT_S",
    "MAX_BODY",
    "MAX_HANDSHAKES",
    "UNIX",
    "Client",
    "ConnectFailed",
    "FileRegion",
    "FileRegionError",
    "FrameParser",
    "FrameReader",
    "Gathered",
    "HandshakeGate",
    "HandshakeRefused",
    "MalformedFrame",
    "PeerClosed",
    "PeerTimeout",
    "ProofRejected",
    "RemoteError",
    "ThreadedAcceptor",
    "UnknownOperation",
    "WireError",
    "accept_handshake",
    "decode",
    "dial",
    "encode",
    "remote_error",
    "more_buffered",
    "send_msg",
    "send_region",
]
