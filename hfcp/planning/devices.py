"""The devices a plan is made for: memory, peak FLOP/s, link bandwidths, and what a GPU process holds beside the
tensors of the step. Every figure is a stated assumption, with its source, and a plan takes a spec of its own
(`device={"memory_gib": 94, ...}`, or `hfcp plan --device-spec FILE.json`) to override any of them.

Sources: NVIDIA's data sheets (dense peak Tensor-Core FLOP/s without sparsity; NVLink bandwidth per direction is
half the quoted bidirectional figure; the network is a 400 Gb/s NIC per GPU for H100/H200, 200 Gb/s for A100);
the memory torch reports (`torch.cuda.get_device_properties(0).total_memory`: 79.1 GiB on an 80 GB H100 or
A100, 139.8 GiB on a 141 GB H200). What a process holds beside the step's tensors (`overhead_gib`): the CUDA
context and loaded kernels (0.5-1 GiB), NCCL's buffers (a few MiB per channel and peer: about 0.5 GiB at 8 ranks),
cuBLAS / flash-attention workspaces: 2 GiB by default. The caching allocator's slack (`slack`): blocks cached but
unused, 5% of the peak by default (PyTorch's documentation of memory_reserved vs memory_allocated; measure yours
with torch.cuda.memory_stats).
"""
from __future__ import annotations

import dataclasses
import os

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes a process can allocate
    flops: dict  # dtype name -> dense peak FLOP/s
    link: float  # bytes/s one GPU sends to a peer in its node (per direction)
    network: float  # bytes/s one GPU sends across nodes
    host_link: float  # bytes/s between the GPU and host memory (per direction): offloads travel here
    per_node: int = 8  # GPUs a node holds: CP groups larger than this cross the network
    overhead: int = 2 * GIB
    slack: float = 0.05

    @property
    def is_cpu(self) -> bool:
        return self.name.split()[0] == "cpu"

    def peak_flops(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops.get("fp32"))


_T = 1e12
DEVICES = {
    "h100-80gb": Device("h100-80gb", int(79.1 * GIB), {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 67 * _T},
                        link=450e9, network=50e9, host_link=55e9),
    "h200-141gb": Device("h200-141gb", int(139.8 * GIB), {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 67 * _T},
                         link=450e9, network=50e9, host_link=55e9),
    "a100-80gb": Device("a100-80gb", int(79.1 * GIB), {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 19.5 * _T},
                        link=300e9, network=25e9, host_link=25e9),
    "a100-40gb": Device("a100-40gb", int(39.4 * GIB), {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 19.5 * _T},
                        link=300e9, network=25e9, host_link=25e9),
}
ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb"}


def host_memory() -> int:
    """This machine's memory (what device="cpu" plans for)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_device() -> Device:
    """The CPU as the device (hfcp's CPU runs, gloo): its memory is the machine's, nothing beside the step's tensors
    is counted (what bench/reach.py measures is the step's RSS growth); the FLOP/s are a nominal 50 GFLOP/s a core."""
    return Device("cpu", host_memory(), {"fp32": 50e9 * (os.cpu_count() or 1)}, link=5e9, network=5e9,
                  host_link=float("inf"), per_node=1 << 30, overhead=0, slack=0.0)


def resolve_device(device) -> Device:
    """A Device from a name ("cpu", "h100-80gb", ...), a Device, or a dict of fields (memory_gib for memory,
    overhead_gib for overhead, tflops for flops; a "base" name for the rest)."""
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        key = device.lower()
        if key == "cpu":
            return cpu_device()
        key = ALIASES.get(key, key)
        if key not in DEVICES:
            raise ValueError(f"device={device!r} is not one hfcp knows ({', '.join(['cpu', *DEVICES])}); pass a "
                             "dict with memory_gib (and tflops, link_gbs, ...) for another")
        return DEVICES[key]
    if isinstance(device, dict):
        spec = dict(device)
        base = resolve_device(spec.pop("base", "h100-80gb"))
        fields = {}
        for key, value in spec.items():
            if key == "memory_gib":
                fields["memory"] = int(value * GIB)
            elif key == "overhead_gib":
                fields["overhead"] = int(value * GIB)
            elif key == "tflops":
                fields["flops"] = {k: float(v) * _T for k, v in value.items()} if isinstance(value, dict) \
                    else {"bf16": float(value) * _T, "fp16": float(value) * _T, "fp32": float(value) * _T}
            elif key in ("link_gbs", "network_gbs", "host_link_gbs"):
                fields[key[:-4]] = float(value) * 1e9
            elif key in ("name", "per_node", "slack"):
                fields[key] = value
            else:
                raise ValueError(f"device spec field {key!r} is not one of base, name, memory_gib, overhead_gib, "
                                 "tflops, link_gbs, network_gbs, host_link_gbs, per_node, slack")
        return dataclasses.replace(base, **{"name": f"{base.name} (custom)", **fields})
    raise TypeError(f"device={device!r}: pass a name, a dict spec or an hfcp.planning.devices.Device")
