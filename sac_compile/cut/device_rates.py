"""The device a split runs on, as rates: FLOP/s, memory bytes/s, and the host link's bytes/s
(issue 27, item 4: keep / recompute / offload chosen by a time model of the device).

The cut's objective (:mod:`.network`) prices a recompute at ``FLOPs / flops_per_byte +
traffic`` bytes of device-memory time and an offload at ``bytes * device_bw / host_bw``:
both are seconds on a device, in units of a byte of memory traffic. :class:`DeviceRates`
gives those ratios for a named device (:data:`PRESETS`, public spec sheets: dense bf16
tensor-core FLOP/s, HBM bandwidth, an effective PCIe rate per direction) and an op's time
on the roofline (:meth:`DeviceRates.seconds`).

What offload can move while the step computes needs no separate bound under this
objective: a value is offloaded only where its transfer costs less than its recompute, and
its recompute is part of the forward's time, so the transfers the cut chooses sum to less
than the forward's compute of those values (torchtitan's planner bounds its offload by the
link explicitly because it prices them otherwise). The exceptions are values that cannot
be recomputed (an effectful op, a random one without RNG replay) which a budget can only
move off the device: their transfer time is not hidden.

``CostModel.for_device("h100")`` (or :func:`rates_for` of a ``torch.device``) is opt-in: the
default ``CostModel()`` keeps its ratios (8 FLOPs per byte, 2 TB/s, 25 GB/s), which every
snapshot in the test suite is written against.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DeviceRates", "PRESETS", "rates_for"]


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """A device's rates; frozen, hashable (part of a ``CostModel``, hence of the cache key)."""

    name: str
    flops: float             # FLOP/s at the training dtype (dense bf16 on GPUs)
    memory_bandwidth: float  # device memory bytes/s
    host_link: float         # bytes/s to and from host memory, each way, effective

    @property
    def flops_per_byte(self) -> float:
        """FLOPs that take as long as one byte of memory traffic (the roofline's ridge)."""
        return self.flops / self.memory_bandwidth

    def seconds(self, flops: float, traffic: float) -> float:
        """An op's time on the roofline: compute-bound or memory-bound, the larger."""
        return max(flops / self.flops, traffic / self.memory_bandwidth)



#: Spec-sheet rates. GPUs: dense bf16 tensor-core FLOP/s, HBM bandwidth, PCIe effective
#: (about 80% of the link's rate). The CPU: a few AVX-512 cores and DDR5, whose "host
#: link" is a memory copy.
PRESETS: dict[str, DeviceRates] = {
    "h100": DeviceRates("h100", 989e12, 3.35e12, 50e9),    # SXM5, PCIe 5.0 x16
    "h200": DeviceRates("h200", 989e12, 4.8e12, 50e9),     # SXM5, PCIe 5.0 x16
    "a100": DeviceRates("a100", 312e12, 2.039e12, 25e9),   # SXM4 80GB, PCIe 4.0 x16
    "l4": DeviceRates("l4", 121e12, 0.3e12, 25e9),         # PCIe 4.0 x16
    "cpu": DeviceRates("cpu", 2e12, 100e9, 100e9),
}

_NAMES = {"H100": "h100", "H200": "h200", "A100": "a100", "L4": "l4"}


def rates_for(device: Any) -> DeviceRates | None:
    """The preset for a ``torch.device`` (or a name): a CUDA device by its product name,
    the CPU; None for a device without one (the default ``CostModel`` applies)."""
    import torch
    if isinstance(device, str) and device.lower() in PRESETS:
        return PRESETS[device.lower()]
    device = torch.device(device)
    if device.type == "cpu":
        return PRESETS["cpu"]
    if device.type == "cuda" and torch.cuda.is_available():
        product = torch.cuda.get_device_name(device)
        for key, name in _NAMES.items():
            if key in product:
                return PRESETS[name]
    return None
