"""ibverbs through pyverbs: registered memory, RC queue pairs, one-sided RDMA READ/WRITE.

Neither the reader's nor the owner's Python touches the bytes: the NIC moves them. Queue pairs
are set up once per (reader, owner) pair over the owner's authenticated data-plane socket.

pyverbs must match the system's rdma-core: on Debian/Ubuntu ``apt install python3-pyverbs``
(this module also looks in /usr/lib/python3/dist-packages for it); PyPI's pyverbs only works
against the rdma-core it was built for. Knobs: MONARCH_TORCHX_RDMA_DEVICE (default: the first
device), MONARCH_TORCHX_RDMA_PORT (1), MONARCH_TORCHX_RDMA_GID_INDEX (0; RoCE v2 is often 3).

Not exercised by this project's tests: the machines it is developed on have no RDMA device,
so only device discovery and the "no device" errors run there (see docs/rdma.md).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from typing import Any

from .memory import LocalMemory, RDMAError

DEBIAN_DIST = "/usr/lib/python3/dist-packages"
_cache: dict[str, Any] = {}
_lock = threading.Lock()


def _import_pyverbs() -> Any:
    """pyverbs, from the environment or Debian's package (compiled for this Python minor)."""
    try:
        import pyverbs.device  # noqa: F401
    except ImportError:
        if not os.path.isdir(os.path.join(DEBIAN_DIST, "pyverbs")):
            raise RDMAError(
                "pyverbs is not installed: `apt install python3-pyverbs` (it must match the system's rdma-core)"
            ) from None
        sys.path.append(DEBIAN_DIST)
        try:
            import pyverbs.device  # noqa: F401
        except ImportError as e:
            raise RDMAError(f"Debian's pyverbs does not load in this Python: {e}") from None
        finally:
            sys.path.remove(DEBIAN_DIST)
    import pyverbs.addr
    import pyverbs.cq
    import pyverbs.device
    import pyverbs.enums
    import pyverbs.mr
    import pyverbs.pd
    import pyverbs.qp
    import pyverbs.wr

    return pyverbs


def devices() -> tuple[list, str]:
    """(device names, why none) -- never raises."""
    with _lock:
        if "devices" not in _cache:
            try:
                pv = _import_pyverbs()
                try:
                    found = [
                        d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                        for d in pv.device.get_device_list()
                    ]
                    why = "" if found else "no RDMA devices"
                except Exception as e:  # pyverbs raises rather than returning [] when there are none
                    found, why = [], f"no RDMA device ({type(e).__name__}: {e})"
            except RDMAError as e:
                found, why = [], str(e)
            _cache["devices"] = (found, why)
        return _cache["devices"]


def available() -> bool:
    return bool(devices()[0])


class Verbs:
    """One device context of this process: PD, registered buffers and connected QPs."""

    def __init__(self) -> None:
        found, why = devices()
        if not found:
            raise RDMAError(f"ibverbs backend unavailable: {why}")
        pv = self.pv = _import_pyverbs()
        name = os.environ.get("MONARCH_TORCHX_RDMA_DEVICE") or found[0]
        if name not in found:
            raise RDMAError(f"MONARCH_TORCHX_RDMA_DEVICE={name} is not one of {found}")
        self.port = int(os.environ.get("MONARCH_TORCHX_RDMA_PORT", "1"))
        self.gid_index = int(os.environ.get("MONARCH_TORCHX_RDMA_GID_INDEX", "0"))
        self.ctx = pv.device.Context(name=name)
        self.pd = pv.pd.PD(self.ctx)
        port = self.ctx.query_port(self.port)
        self.lid = port.lid
        self.max_msg = int(getattr(port, "max_msg_sz", 1 << 30)) or (1 << 30)
        self.rd_atom = max(1, min(16, int(getattr(self.ctx.query_device(), "max_qp_rd_atom", 16))))
        self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
        e = pv.enums
        self.remote_access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        self.mrs: dict[int, Any] = {}  # owner side: slot -> MR
        self.qps: dict[tuple[str, int], tuple[Any, Any]] = {}  # reader side: owner (host, port) -> (qp, cq)
        self.peer_qps: list = []  # owner side
        self._qps_lock = threading.Lock()  # never held across the network
        self._peer_lock = threading.Lock()
        self._connecting: dict[tuple[str, int], threading.Lock] = {}
        self._poll_lock = threading.Lock()
        self._completions: dict[int, int] = {}  # wr_id -> status, for whoever posted it
        self._wr_ids = itertools.count(1)

    # ------------------------------------------------------------ memory

    def register(self, slot: int, mem: LocalMemory) -> tuple[int, int]:
        mr = self.pv.mr.MR(self.pd, mem.nbytes, self.remote_access, address=mem.address)
        self.mrs[slot] = mr
        return mr.rkey, mem.address

    def deregister(self, slot: int) -> None:
        mr = self.mrs.pop(slot, None)
        if mr is not None:
            mr.close()

    # ------------------------------------------------------------ queue pairs

    def _new_qp(self) -> tuple[Any, Any]:
        pv = self.pv
        cq = pv.cq.CQ(self.ctx, 256)
        cap = pv.qp.QPCap(max_send_wr=128, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = self.remote_access
        return pv.qp.QP(self.pd, init, attr), cq

    def _info(self, qp: Any) -> dict[str, Any]:
        return {"qpn": qp.qp_num, "lid": self.lid, "gid": self.gid, "psn": 0}

    def _connect(self, qp: Any, peer: dict[str, Any]) -> None:
        pv = self.pv
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = self.remote_access
        attr.dest_qp_num = peer["qpn"]
        attr.rq_psn = peer["psn"]
        attr.sq_psn = 0
        attr.path_mtu = pv.enums.IBV_MTU_1024
        attr.max_dest_rd_atomic = self.rd_atom
        attr.max_rd_atomic = self.rd_atom
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(peer["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = pv.addr.AHAttr(dlid=peer["lid"], port_num=self.port, is_global=1, gr=gr)
        qp.to_rts(attr)

    def accept_peer(self, peer: dict[str, Any]) -> dict[str, Any]:
        """Owner side: a QP for a new reader, connected to its QP."""
        qp, cq = self._new_qp()
        try:
            self._connect(qp, peer)
        except BaseException:
            qp.close()
            cq.close()
            raise
        with self._peer_lock:
            self.peer_qps.append((qp, cq))
        return self._info(qp)

    def qp_to(self, owner: tuple[str, int, str], handshake: Any) -> tuple[Any, Any]:
        """Reader side: our QP to ``owner``, created and connected on first use (no lock held
        across the exchange: the owner may be this very process)."""
        key = (owner[0], owner[1])
        with self._qps_lock:
            if key in self.qps:
                return self.qps[key]
            gate = self._connecting.setdefault(key, threading.Lock())
        with gate:
            with self._qps_lock:
                if key in self.qps:
                    return self.qps[key]
            qp, cq = self._new_qp()
            try:
                self._connect(qp, handshake(self._info(qp)))
            except BaseException:
                qp.close()
                cq.close()
                raise
            with self._qps_lock:
                self.qps[key] = (qp, cq)
            return qp, cq

    def _forget_qp(self, owner: tuple[str, int, str]) -> None:
        """An RC QP that saw an error (or a lost completion) is unusable: the next transfer makes a new one."""
        with self._qps_lock:
            pair = self.qps.pop((owner[0], owner[1]), None)
        if pair is not None:
            for obj in pair:
                try:
                    obj.close()
                except Exception:
                    pass

    # ------------------------------------------------------------ one-sided operations

    def transfer(
        self,
        owner: tuple[str, int, str],
        qp_cq: tuple[Any, Any],
        rkey: int,
        remote_addr: int,
        local: LocalMemory,
        offset: int,
        write: bool,
        deadline: float,
    ) -> None:
        pv = self.pv
        qp, cq = qp_cq
        # registered for this transfer only: a cached registration could outlive the memory
        mr = pv.mr.MR(self.pd, local.nbytes, 0 if write else pv.enums.IBV_ACCESS_LOCAL_WRITE, address=local.address)
        try:
            ids = []
            for start in range(0, local.nbytes, self.max_msg):  # a message may not exceed max_msg_sz
                n = min(self.max_msg, local.nbytes - start)
                wr_id = next(self._wr_ids)
                sge = pv.wr.SGE(local.address + start, n, mr.lkey)
                op = pv.enums.IBV_WR_RDMA_WRITE if write else pv.enums.IBV_WR_RDMA_READ
                wr = pv.wr.SendWR(wr_id=wr_id, opcode=op, num_sge=1, sg=[sge], send_flags=pv.enums.IBV_SEND_SIGNALED)
                wr.set_wr_rdma(rkey, remote_addr + offset + start)
                qp.post_send(wr)
                ids.append(wr_id)
            for wr_id in ids:
                status = self._wait(cq, wr_id, deadline)
                if status != pv.enums.IBV_WC_SUCCESS:
                    raise RDMAError(
                        f"RDMA {'WRITE' if write else 'READ'} failed: work completion status {status} "
                        f"(the owner is gone, or the buffer was dropped)"
                    )
        except RDMAError:
            self._forget_qp(owner)  # after a timeout or an error completion the QP cannot be trusted
            raise
        except Exception as e:
            self._forget_qp(owner)
            raise RDMAError(f"RDMA transfer failed: {e}") from None
        finally:
            mr.close()

    def _wait(self, cq: Any, wr_id: int, deadline: float) -> int:
        """Polls the shared CQ; completions are handed to whoever posted them (by wr_id)."""
        while True:
            with self._poll_lock:
                if wr_id in self._completions:
                    return self._completions.pop(wr_id)
                n, wcs = cq.poll(num_entries=16)
                for wc in (wcs or [])[:n]:
                    self._completions[wc.wr_id] = wc.status
                if wr_id in self._completions:
                    return self._completions.pop(wr_id)
            if time.monotonic() > deadline:
                raise RDMAError(
                    "the RDMA transfer timed out"
                )  # the caller forgets the QP: a late completion dies with it
            time.sleep(0.00005)


def verbs() -> Verbs:
    with _lock:
        v = _cache.get("verbs")
        if v is None:
            v = _cache["verbs"] = Verbs()  # once per process, under the lock
        return v
