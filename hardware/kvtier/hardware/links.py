"""Named hardware: the links KV moves over, with the figure each bandwidth comes from.

The simulator and the router's TTFT estimate charge a copy ``bytes / bandwidth``. Which bandwidth
decides whether loading a prefix from host or storage beats recomputing it, so every number here
names its source: a measurement (where, on what) or a datasheet (what it states). Where a preset
rests on a datasheet alone, its comment says so; measured figures replace them as they come in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LinkPreset:
    """One link, one direction's sustained bandwidth (copies in both directions use the same figure)."""

    name: str  # what it is, e.g. "h100-pcie5"
    gbps: float  # GB/s (1e9 bytes per second) sustained for large transfers
    source: str  # where the figure comes from


#: Host <-> device links (the host tier's copies).
GPU_LINKS: dict[str, LinkPreset] = {
    p.name: p
    for p in (
        # Measured by kvtier on an H100 80GB HBM3 (issue 16): pinned host<->device copies of large
        # buffers, about 54 GB/s each way. PCIe 5.0 x16 is 64 GB/s per direction before protocol overhead.
        LinkPreset("h100-pcie5", 54.0, "measured: H100 80GB HBM3, pinned copies, torch, about 54 GB/s each way"),
        # The H200's host link is also PCIe 5.0 x16 (NVIDIA H200 datasheet: 128 GB/s both directions
        # together); assumed to sustain what the H100 measured. Not measured here.
        LinkPreset("h200", 54.0, "datasheet: PCIe 5.0 x16 (128 GB/s bidirectional); efficiency as measured on H100"),
        # PCIe 4.0 x16 is 32 GB/s per direction; pinned copies commonly sustain about 25 GB/s
        # (the A100 PCIe generation). kvtier's default before named presets.
        LinkPreset("a100-pcie4", 25.0, "PCIe 4.0 x16 (32 GB/s per direction); about 25 GB/s sustained pinned"),
        # GH200: NVLink-C2C, 900 GB/s bidirectional per NVIDIA's datasheet. Not measured here.
        LinkPreset("gh200-c2c", 450.0, "datasheet: NVLink-C2C 900 GB/s bidirectional"),
    )
}

#: Host <-> L3 links (a local disk, or the network to a shared pool).
STORAGE_LINKS: dict[str, LinkPreset] = {
    p.name: p
    for p in (
        # A PCIe 4.0 x4 NVMe drive: Samsung 990 PRO datasheet, 7.45 GB/s sequential read, 6.9 GB/s write;
        # c't measured 7.46 / 6.97 GB/s on the 4 TB model. Reads are what a prefetch waits for.
        LinkPreset("nvme-gen4", 7.45, "datasheet: Samsung 990 PRO, 7.45 GB/s sequential read (6.9 GB/s write)"),
        # A PCIe 5.0 x4 NVMe drive: about 14-15 GB/s sequential read in practice (x4 Gen5 is 16 GB/s raw).
        LinkPreset("nvme-gen5", 14.5, "datasheets of PCIe 5.0 x4 drives: 14-15 GB/s sequential read"),
        # kvtier's default before named presets: a modest local NVMe (or a slow pool) at 5 GB/s.
        LinkPreset("nvme-5gbps", 5.0, "kvtier's former default: a modest local NVMe drive"),
        # One 400 Gb/s RDMA NIC to a shared pool (Mooncake store style): 50 GB/s line rate. Not measured here.
        LinkPreset("rdma-400g", 50.0, "line rate of one 400 Gb/s NIC"),
    )
}

#: Prefill -> decode links (disaggregated serving: a finished prefill's KV moves to its decode worker).
KV_LINKS: dict[str, LinkPreset] = {
    p.name: p
    for p in (
        # Prefill and decode GPUs in one NVLink domain (one HGX H100 node): NVLink 4, 900 GB/s bidirectional per
        # GPU on NVIDIA's H100 datasheet, so 450 GB/s each way. Not measured here.
        LinkPreset("nvlink-h100", 450.0, "datasheet: H100 SXM NVLink 4, 900 GB/s bidirectional"),
        # One 400 Gb/s InfiniBand or RoCE NIC per GPU (ConnectX-7, as in DGX H100 nodes): 50 GB/s line rate, what
        # NIXL or Mooncake's transfer engine move KV over between nodes. Not measured here.
        LinkPreset("rdma-400g", 50.0, "line rate of one 400 Gb/s NIC (ConnectX-7 class)"),
        # One 200 Gb/s NIC per GPU (ConnectX-6 class): 25 GB/s line rate. Not measured here.
        LinkPreset("rdma-200g", 25.0, "line rate of one 200 Gb/s NIC (ConnectX-6 class)"),
        # KV sent over TCP on a 100 Gb/s Ethernet NIC: 12.5 GB/s line rate, an upper bound (TCP sustains less).
        LinkPreset("tcp-100g", 12.5, "line rate of one 100 Gb/s Ethernet NIC; TCP sustains less"),
    )
}

#: A link speed a setting may name, GB/s: 1 MB/s (slower, and one prompt's KV outlasts any run) to 1 PB/s.
GBPS_RANGE = (1e-3, 1e6)

DEFAULT_GPU_LINK = "h100-pcie5"
DEFAULT_STORAGE_LINK = "nvme-gen4"
DEFAULT_KV_LINK = "rdma-400g"

