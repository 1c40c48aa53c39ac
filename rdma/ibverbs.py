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

import os
import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple

from .memory import LocalMemory, RDMAError

DEBIAN_DIST = "/usr/lib/python3/dist-packages"
_cache: Dict[str, Any] = {}
_lock = threading.Lock()


def _import_pyverbs() -> Any:
    """pyverbs, from the environment or Debian's package (compiled for this Python minor)."""
    try:
        import pyverbs.device  # noqa: F401
    except ImportError:
        if not os.path.isdir(os.path.join(DEBIAN_DIST, "pyverbs")):
            raise RDMAError("pyverbs is not installed: `apt install python3-pyverbs` (it must match the "
                            "system's rdma-core)") from None
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


def devices() -> Tuple[list, str]:
    """(device names, why none) -- never raises."""
    with _lock:
        if "devices" not in _cache:
            try:
                pv = _import_pyverbs()
                try:
                    found = [d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                             for d in pv.device.get_device_list()]
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
    """One device context of this process: PD, CQ, registered buffers and connected QPs."""

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
        self.lid = self.ctx.query_port(self.port).lid
        self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
        e = pv.enums
        self.access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE)
        self.mrs: Dict[int, Any] = {}  # owner side: slot -> MR
        self.local_mrs: Dict[Tuple[int, int], Any] = {}  # reader side: (addr, len) -> MR
        self.qps: Dict[Tuple[str, int], Tuple[Any, Any]] = {}  # owner (host, port) -> (qp, cq)
        self.peer_qps: list = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------ memory

    def register(self, slot: int, mem: LocalMemory) -> Tuple[int, int]:
        mr = self.pv.mr.MR(self.pd, mem.nbytes, self.access, address=mem.address)
        self.mrs[slot] = mr
        return mr.rkey, mem.address

    def deregister(self, slot: int) -> None:
        mr = self.mrs.pop(slot, None)
        if mr is not None:
            mr.close()

    def _local_mr(self, address: int, n: int) -> Any:
        key = (address, n)
        mr = self.local_mrs.get(key)
        if mr is None:
            mr = self.local_mrs[key] = self.pv.mr.MR(self.pd, n, self.access, address=address)
        return mr

    # ------------------------------------------------------------ queue pairs

    def _new_qp(self) -> Tuple[Any, Any]:
        pv = self.pv
        cq = pv.cq.CQ(self.ctx, 256)
        cap = pv.qp.QPCap(max_send_wr=128, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = self.access
        return pv.qp.QP(self.pd, init, attr), cq

    def _info(self, qp: Any) -> Dict[str, Any]:
        return {"qpn": qp.qp_num, "lid": self.lid, "gid": self.gid, "psn": 0}

    def _connect(self, qp: Any, peer: Dict[str, Any]) -> None:
        pv = self.pv
        attr = pv.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = self.access
        attr.dest_qp_num = peer["qpn"]
        attr.rq_psn = peer["psn"]
        attr.sq_psn = 0
        attr.path_mtu = pv.enums.IBV_MTU_1024
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(peer["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = pv.addr.AHAttr(dlid=peer["lid"], port_num=self.port, is_global=1, gr=gr)
        qp.to_rts(attr)

    def accept_peer(self, peer: Dict[str, Any]) -> Dict[str, Any]:
        """Owner side: a QP for a new reader, connected to its QP."""
        qp, cq = self._new_qp()
        self._connect(qp, peer)
        with self._lock:
            self.peer_qps.append((qp, cq))
        return self._info(qp)

    def qp_to(self, owner: Tuple[str, int, str], handshake: Any) -> Tuple[Any, Any]:
        """Reader side: our QP to ``owner``, created and connected on first use."""
        key = (owner[0], owner[1])
        with self._lock:
            if key in self.qps:
                return self.qps[key]
            qp, cq = self._new_qp()
            self._connect(qp, handshake(self._info(qp)))
            self.qps[key] = (qp, cq)
            return qp, cq

    # ------------------------------------------------------------ one-sided operations

    def transfer(self, qp_cq: Tuple[Any, Any], rkey: int, remote_addr: int, local: LocalMemory, offset: int,
                 write: bool, timeout: float) -> None:
        pv = self.pv
        qp, cq = qp_cq
        mr = self._local_mr(local.address, local.nbytes)
        sge = pv.wr.SGE(local.address, local.nbytes, mr.lkey)
        op = pv.enums.IBV_WR_RDMA_WRITE if write else pv.enums.IBV_WR_RDMA_READ
        wr = pv.wr.SendWR(wr_id=1, opcode=op, num_sge=1, sg=[sge], send_flags=pv.enums.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, remote_addr + offset)
        qp.post_send(wr)
        deadline = time.monotonic() + timeout
        while True:
            n, wcs = cq.poll()
            if n:
                wc = wcs[0]
                if wc.status != pv.enums.IBV_WC_SUCCESS:
                    raise RDMAError(f"RDMA {'WRITE' if write else 'READ'} failed: work completion status "
                                    f"{wc.status} (owner gone, or the buffer deregistered)")
                return
            if time.monotonic() > deadline:
                raise RDMAError("the RDMA transfer timed out")


_verbs: Dict[str, Optional[Verbs]] = {}


def verbs() -> Verbs:
    with _lock:
        v = _verbs.get("v")
    if v is None:
        v = Verbs()
        with _lock:
            _verbs["v"] = v
    return v
