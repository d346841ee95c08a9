"""NvmlSource without a GPU: a clear error when NVML is missing, and its logic over a fake.

The fake keeps pynvml's real constants and error classes and replaces only the calls into
the driver library; every function it fakes must exist in pynvml with that name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type hints
import pytest

from trainpod.agent.devices import DeviceTelemetry, NvmlReader
from trainpod.agent.health import GpuCheck, GpuUnavailable, NvmlSource, Status


def test_missing_driver_is_a_clear_error() -> None:
    try:
        source = NvmlSource()
    except GpuUnavailable as exc:
        assert "NVML could not start" in str(exc)
        assert "SimulatedSource" in str(exc)
    else:  # a machine with a working driver: nothing to test here
        source.close()
        pytest.skip("NVML works on this machine")


def test_missing_pynvml_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuUnavailable, match="pip install nvidia-ml-py"):
        NvmlSource()


@dataclass
class Gpu:
    bus: str
    temperature: int = 40
    throttle: int = 0
    ecc: int = 0
    remap: tuple[int, int, int, int] = (0, 0, 0, 0)
    energy_mj: int = 5_000_000  # nvmlDeviceGetTotalEnergyConsumption: mJ since driver load
    error: int | None = None  # every call on this GPU raises this NVML error code
    not_supported: set[str] = field(default_factory=set)


@dataclass
class Event:
    device: Any
    eventType: int
    eventData: int


class FakeNvml:
    """pynvml with the library calls replaced by ``gpus``."""

    def __init__(self, gpus: list[Gpu]) -> None:
        self.gpus = gpus
        self.events: list[Event] = []
        self.calls: list[str] = []
        self.handles = [object() for _ in gpus]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and name[4:5].islower():  # a function we did not fake
            raise AssertionError(f"NvmlSource called unfaked {name}")
        return getattr(pynvml, name)

    def _gpu(self, h: Any, call: str) -> Gpu:
        assert hasattr(pynvml, call), f"pynvml has no {call}"
        self.calls.append(call)
        gpu = self.gpus[self.handles.index(h)]
        if gpu.error is not None:
            raise pynvml.NVMLError(gpu.error)
        if call in gpu.not_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        if i >= len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handles[i]

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        info = pynvml.nvmlPciInfo_t()
        info.busId = self._gpu(h, "nvmlDeviceGetPciInfo").bus.encode()
        return info

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: Any, types: int, es: Any) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError and es == "event-set"

    def nvmlEventSetWait(self, es: Any, timeout_ms: int) -> Event:
        assert timeout_ms == 0
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, es: Any) -> None:
        pass

    def nvmlDeviceGetName(self, h: Any) -> str:
        self._gpu(h, "nvmlDeviceGetName")
        return "NVIDIA H200"

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(h, "nvmlDeviceGetTemperature").temperature

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        self._gpu(h, "nvmlDeviceGetPowerUsage")
        return 612_345  # milliwatts

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").throttle

    def nvmlDeviceGetTotalEccErrors(self, h: Any, kind: int, counter: int) -> int:
        assert kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        return self._gpu(h, "nvmlDeviceGetTotalEccErrors").ecc

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        return self._gpu(h, "nvmlDeviceGetRemappedRows").remap

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any) -> int:
        self._gpu(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        return 0

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        self._gpu(h, "nvmlDeviceGetUtilizationRates")
        util = pynvml.c_nvmlUtilization_t()
        util.gpu, util.memory = 97, 40
        return util

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        self._gpu(h, "nvmlDeviceGetMemoryInfo")
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.used = 141 * 2**30, 2**30
        mem.free = mem.total - mem.used
        return mem


def source(nvml: FakeNvml, kmsg: Path | None = None) -> NvmlSource:
    return NvmlSource(nvml=nvml, kmsg=kmsg)


def test_readings_from_nvml() -> None:
    nvml = FakeNvml([Gpu("00000000:3B:00.0", throttle=0x4 | 0x40), Gpu("00000000:5D:00.0")])
    with source(nvml) as src:
        assert src.count() == 2
        r = src.read(0)
    assert r.name == "NVIDIA H200"
    assert r.temperature_c == 40.0
    assert r.power_w == pytest.approx(612.345)
    assert r.throttle_reasons == ["sw_power_cap", "hw_thermal"]
    assert (r.ecc_uncorrected_volatile, r.remap_pending, r.remap_failure) == (0, False, False)
    assert r.retired_pages_pending is False
    assert r.utilization_pct == 97.0
    assert r.memory_total_mib == 141 * 1024
    assert r.pci_bus_id == "00000000:3B:00.0"
    assert r.lost is False and r.errors == {}
    assert "nvmlShutdown" in nvml.calls


def test_unsupported_fields_are_none_not_errors() -> None:
    nvml = FakeNvml([Gpu("00000000:3B:00.0", not_supported={"nvmlDeviceGetRemappedRows"})])
    with source(nvml) as src:
        r = src.read(0)
    assert r.remap_pending is None and r.remap_failure is None
    assert r.errors == {} and r.lost is False


def test_gpu_is_lost_and_missing_gpus() -> None:
    nvml = FakeNvml([Gpu("00000000:3B:00.0"), Gpu("00000000:5D:00.0")])
    with source(nvml) as src:
        nvml.gpus[1].error = pynvml.NVML_ERROR_GPU_IS_LOST
        assert src.read(1).lost is True
        assert src.read(5).lost is True  # beyond what NVML enumerates
        result = GpuCheck(src, expected_count=3).run()
    assert result.status is Status.FAULT
    assert "expected 3 GPUs, found 2 (1 missing)" in result.reason
    assert "GPU 1 lost" in result.reason and "GPU 2 lost" in result.reason
    assert not result.reason.startswith("simulated")
    assert result.simulated is False


def test_index_selection() -> None:
    nvml = FakeNvml([Gpu(f"00000000:{b:02X}:00.0") for b in (0x10, 0x20, 0x30)])
    with NvmlSource([2], nvml=nvml, kmsg=None) as src:
        assert src.count() == 1
        assert src.read(0).pci_bus_id == "00000000:30:00.0"


def test_xids_from_events_and_kernel_log_are_merged(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,1,-;NVRM: Xid (PCI:0000:3b:00): 48, old history is skipped\n")
    nvml = FakeNvml([Gpu("00000000:3B:00.0"), Gpu("00000000:5D:00.0")])
    with source(nvml, kmsg) as src:
        assert src.new_xids() == []
        nvml.events.append(Event(nvml.handles[1], pynvml.nvmlEventTypeXidCriticalError, 79))
        with kmsg.open("a") as f:
            f.write("4,2,2,-;NVRM: Xid (PCI:0000:5d:00): 79, pid=1, GPU has fallen off the bus.\n")
            f.write(" SUBSYSTEM=pci\n")
            f.write("4,3,3,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, Graphics Exception\n")
            f.write("4,4,4,-;NVRM: Xid (PCI:0000:99:00): 79, a GPU that is not ours\n")
        assert src.new_xids() == [(1, 79), (0, 13)]
        assert src.new_xids() == []


def test_device_telemetry_uses_the_energy_counter_or_integrates_power() -> None:
    nvml = FakeNvml([Gpu("00000000:3B:00.0"), Gpu("00000000:5D:00.0")])
    nvml.gpus[1].not_supported.add("nvmlDeviceGetTotalEnergyConsumption")  # pre-Volta
    now = [100.0]
    with source(nvml) as src:
        tel = DeviceTelemetry(NvmlReader(src), clock=lambda: now[0])
        first = tel.samples(busy=set())
        nvml.gpus[0].energy_mj += 612_345 * 10  # 10 s at 612.345 W
        nvml.events.append(Event(nvml.handles[1], pynvml.nvmlEventTypeXidCriticalError, 79))
        now[0] += 10.0
        a, b = tel.samples(busy=set())
    assert [s.simulated for s in first] == [False, False]
    assert (first[0].energy_source, first[0].energy_j) == ("nvml", 5000.0)
    assert a.energy_j == pytest.approx(5000.0 + 6123.45)
    assert (b.energy_source, first[1].energy_j) == ("integrated", 0.0)
    assert b.energy_j == pytest.approx(6123.45)  # power x time
    assert (a.xid_count, b.xid_count) == (0, 1)
    assert a.utilization_pct == 97.0 and a.power_w == pytest.approx(612.345)
    assert a.memory_total_bytes == 141 * 2**30 and a.name == "NVIDIA H200"
