"""Same-host transfers with cross-memory attach: one kernel copy, no help from the owner.

``process_vm_readv``/``writev`` need ptrace-style access to the owner (same user, and Yama's
ptrace_scope allowing it); where that is refused the caller falls back to tcp.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket

from .memory import RDMAError


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
for _fn in (_libc.process_vm_readv, _libc.process_vm_writev):
    _fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _fn.restype = ctypes.c_ssize_t
CHUNK = 1 << 30


class CMAPermissionError(RDMAError):
    """The kernel refused cross-memory attach to the owner (ptrace rules)."""


_host_key: list = []


def host_key() -> str:
    """Same key = same kernel, same PID namespace, same host name: cma can reach the owner."""
    if _host_key and _host_key[0][0] == os.getpid():
        return _host_key[0][1]
    key = _read_host_key()
    _host_key[:] = [(os.getpid(), key)]
    return key


def _read_host_key() -> str:
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{pidns}/{socket.gethostname()}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks: tells a live owner from a reused pid (None: gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def transfer(pid: int, local_addr: int, remote_addr: int, n: int, write: bool) -> None:
    """Copies n bytes between our memory and the owner's (remote = the owner's address)."""
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    done = 0
    while done < n:
        k = min(CHUNK, n - done)
        local = _IOVec(local_addr + done, k)
        remote = _IOVec(remote_addr + done, k)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EPERM:
                raise CMAPermissionError(f"cross-memory attach to pid {pid} refused (ptrace rules)")
            if err == errno.ESRCH:
                raise RDMAError(f"the buffer's owner (pid {pid}) has exited")
            raise RDMAError(f"process_vm_{'writev' if write else 'readv'} failed: {os.strerror(err)}")
        if got == 0:
            raise RDMAError("cross-memory copy made no progress (the owner's memory is gone?)")
        done += got


def generation(pid: int, table_address: int, slot: int) -> int:
    """Reads the owner's generation word for ``slot`` (0: dropped)."""
    word = ctypes.c_uint32(0)
    transfer(pid, ctypes.addressof(word), table_address + 4 * slot, 4, False)
    return word.value
