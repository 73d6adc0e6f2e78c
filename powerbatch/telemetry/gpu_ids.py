"""GPU identity: an index, or a UUID that names the same GPU to NVML, DCGM and zeusd.

An index names a GPU only to one process: in a container given one GPU, NVML calls it 0, while
dcgm-exporter and zeusd, which see the whole node, call it by its node index. A UUID (`GPU-…`,
as the NVIDIA device plugin puts in NVIDIA_VISIBLE_DEVICES) names it everywhere, so a pod can
find the GPUs it was given:

    NVML    nvmlDeviceGetHandleByUUID (powerbatch.telemetry.nvml)
    DCGM    dcgm-exporter's `UUID` label
    zeusd   its /discover lists no UUID, only each GPU's PCI address: the UUID is matched to one
            through NVML where this process sees the GPU, else through dcgm-exporter's
            `pci_bus_id` label (`zeusd_indices`)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from powerbatch.errors import ConfigError

__all__ = ["GpuId", "is_gpu_uuid", "parse_gpu_ids", "pci_key", "visible_uuids"]

GpuId = int | str
"""An index (int) or a GPU UUID (`GPU-…`)."""

_UUID = re.compile(r"GPU-[0-9A-Fa-f]{8}(-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}")
_PCI = re.compile(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})(\.[0-7])?")


def is_gpu_uuid(value: str) -> bool:
    """`GPU-` and a UUID, as NVML, nvidia-smi and the device plugin write it."""
    return _UUID.fullmatch(value.strip()) is not None


def parse_gpu_ids(values: Sequence[str]) -> list[GpuId]:
    """Indices as ints, UUIDs as they are; all of one kind (a DCGM filter matches one label)."""
    ids: list[GpuId] = []
    for raw in values:
        value = raw.strip()
        if is_gpu_uuid(value):
            ids.append(value)
        elif value.isdecimal():
            ids.append(int(value))
        elif value.upper().startswith("MIG-"):
            raise ConfigError(
                f"gpus: {value} is a MIG instance, which has no power reading or limit of its "
                "own; give the UUID of the GPU it is on (nvidia-smi -L)"
            )
        else:
            raise ConfigError(f"gpus must be GPU indices or UUIDs (GPU-…), got {value!r}")
    if len({isinstance(i, str) for i in ids}) > 1:
        raise ConfigError(f"gpus mixes indices and UUIDs ({','.join(values)}): give one kind")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"gpus names a GPU twice: {','.join(values)}")
    return ids


def visible_uuids(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The GPU UUIDs in NVIDIA_VISIBLE_DEVICES (the device plugin's choice for this container),
    or None where it holds something else: unset, `all`, `none`, `void` or indices, which name
    no GPU a process outside this container could find."""
    raw = environ.get("NVIDIA_VISIBLE_DEVICES", "")
    values = tuple(v.strip() for v in raw.split(",") if v.strip())
    if values and all(is_gpu_uuid(v) for v in values):
        return values
    return None


def pci_key(address: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI address in any of the spellings in use: NVML's and
    dcgm-exporter's `00000000:18:00.0`, zeusd's and lspci's `0000:18:00.0`. None if it is none."""
    match = _PCI.fullmatch(address.strip())
    if match is None:
        return None
    return int(match[1], 16), int(match[2], 16), int(match[3], 16)


def zeusd_indices(
    gpu_ids: Sequence[GpuId], pci_addresses: Mapping[int, str], pci_of_uuid: Mapping[str, str]
) -> list[int]:
    """zeusd's index for each GPU: an index is taken as zeusd's own; a UUID through its PCI
    address (`pci_of_uuid`, from NVML or DCGM) matched to zeusd's /discover (`pci_addresses`).
    ConfigError, naming the fixes, for a UUID that cannot be matched."""
    by_pci = {pci_key(a): i for i, a in pci_addresses.items() if pci_key(a) is not None}
    indices: list[int] = []
    for gpu in gpu_ids:
        if isinstance(gpu, int):
            indices.append(gpu)
            continue
        pci = pci_of_uuid.get(gpu)
        if pci is None:
            raise ConfigError(
                f"cannot find GPU {gpu} among zeusd's GPUs: zeusd lists PCI addresses, not "
                "UUIDs, and neither NVML in this process nor a dcgm-exporter at dcgm_url says "
                "which PCI address it has. Set dcgm_url to the node's dcgm-exporter (its UUID "
                "and pci_bus_id labels map one to the other), run where NVML sees the GPU, or "
                "give gpus as zeusd's indices"
            )
        index = by_pci.get(pci_key(pci))
        if index is None:
            raise ConfigError(
                f"GPU {gpu} is at PCI {pci}, which zeusd does not list "
                f"({', '.join(sorted(pci_addresses.values())) or 'no GPUs'}): another node's?"
            )
        indices.append(index)
    return indices
