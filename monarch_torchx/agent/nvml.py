"""The host's GPUs through NVML (``libnvidia-ml.so.1``, the driver's management library), by ctypes.

NVML is not CUDA: reading it never creates a CUDA context, so the agent (whose fork servers
must stay free of CUDA) may ask it. Every call runs in a worker thread of the agent (a driver
call can block). Without the library (no NVIDIA driver: these build machines) ``open_nvml``
says why, and the host has no GPUs but those declared.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

NVML_SUCCESS = 0
_TEMPERATURE_GPU = 0
_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_VOLATILE_ECC = 0
_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT = 1


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this host (no library, or it would not initialise)."""


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    mem_total_mb: int


@dataclass
class GpuSample:
    """One device at one moment (the ``gpus`` telemetry table's columns)."""

    index: int
    uuid: str
    ts: float
    util_pct: float | None
    mem_used_mb: float | None
    mem_total_mb: float | None
    temp_c: float | None
    power_w: float | None
    ecc_uncorrected: int | None  # volatile, since the driver loaded
    retired_pending: bool | None  # pages waiting to be retired: the device needs a reset
    problem: str  # "" when healthy; else why it is out of placement


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class Nvml:
    """An initialised NVML library (one per agent); every method is blocking."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self._lock = threading.Lock()  # NVML is thread safe, but one caller at a time keeps it simple

    def _call(self, fn: str, *args: object) -> int:
        return int(getattr(self._lib, fn)(*args))

    def _handle(self, index: int) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        rc = self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        if rc != NVML_SUCCESS:
            raise NvmlUnavailable(f"NVML could not open GPU {index} (error {rc})")
        return handle

    def devices(self) -> list[GpuInfo]:
        with self._lock:
            count = ctypes.c_uint()
            rc = self._call("nvmlDeviceGetCount_v2", ctypes.byref(count))
            if rc != NVML_SUCCESS:
                raise NvmlUnavailable(f"NVML could not count the GPUs (error {rc})")
            out = []
            for i in range(count.value):
                h = self._handle(i)
                uuid = ctypes.create_string_buffer(96)
                name = ctypes.create_string_buffer(96)
                self._call("nvmlDeviceGetUUID", h, uuid, ctypes.c_uint(96))
                self._call("nvmlDeviceGetName", h, name, ctypes.c_uint(96))
                mem = _Memory()
                self._call("nvmlDeviceGetMemoryInfo", h, ctypes.byref(mem))
                out.append(GpuInfo(i, uuid.value.decode(), name.value.decode(), mem.total >> 20))
            return out

    def sample(self, index: int, uuid: str) -> GpuSample:
        """The device's gauges now; a gauge the device does not report is None."""
        with self._lock:
            h = self._handle(index)
            util, mem = _Utilization(), _Memory()
            temp, power = ctypes.c_uint(), ctypes.c_uint()
            ecc = ctypes.c_ulonglong()
            pending = ctypes.c_int()
            ok_util = self._call("nvmlDeviceGetUtilizationRates", h, ctypes.byref(util)) == NVML_SUCCESS
            ok_mem = self._call("nvmlDeviceGetMemoryInfo", h, ctypes.byref(mem)) == NVML_SUCCESS
            ok_temp = (
                self._call("nvmlDeviceGetTemperature", h, ctypes.c_int(_TEMPERATURE_GPU), ctypes.byref(temp))
                == NVML_SUCCESS
            )
            ok_power = self._call("nvmlDeviceGetPowerUsage", h, ctypes.byref(power)) == NVML_SUCCESS
            ok_ecc = (
                self._call(
                    "nvmlDeviceGetTotalEccErrors",
                    h,
                    ctypes.c_int(_MEMORY_ERROR_TYPE_UNCORRECTED),
                    ctypes.c_int(_VOLATILE_ECC),
                    ctypes.byref(ecc),
                )
                == NVML_SUCCESS
            )
            ok_pending = self._call("nvmlDeviceGetRetiredPagesPendingStatus", h, ctypes.byref(pending)) == NVML_SUCCESS
        problem = []
        if ok_ecc and ecc.value:
            problem.append(f"{ecc.value} uncorrectable ECC error(s)")
        if ok_pending and pending.value:
            problem.append("retired pages pending (the device needs a reset)")
        return GpuSample(
            index=index,
            uuid=uuid,
            ts=time.time(),
            util_pct=float(util.gpu) if ok_util else None,
            mem_used_mb=mem.used / 2**20 if ok_mem else None,
            mem_total_mb=mem.total / 2**20 if ok_mem else None,
            temp_c=float(temp.value) if ok_temp else None,
            power_w=power.value / 1000.0 if ok_power else None,
            ecc_uncorrected=int(ecc.value) if ok_ecc else None,
            retired_pending=bool(pending.value) if ok_pending else None,
            problem="; ".join(problem),
        )


def open_nvml(library: str = "libnvidia-ml.so.1") -> Nvml:
    """The host's NVML, initialised; ``NvmlUnavailable`` saying why not."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as e:
        raise NvmlUnavailable(f"no NVML on this host ({library}: {e})") from None
    try:
        rc = int(lib.nvmlInit_v2())
    except AttributeError:
        raise NvmlUnavailable(f"{library} has no nvmlInit_v2") from None
    if rc != NVML_SUCCESS:
        raise NvmlUnavailable(f"NVML would not initialise (error {rc}: is the NVIDIA driver loaded?)")
    return Nvml(lib)
