"""KV-cache offload tiers: which tier holds a worker's blocks beyond its GPU prefix, and what loading them
costs (pure).

vLLM 0.28's offloading connectors (``OffloadingConnector``; with ``TieringOffloadingSpec`` a CPU primary
tier plus secondary tiers such as a filesystem) publish the blocks they hold as ordinary KV events whose
``medium`` is ``"CPU"`` or ``"STORAGE"`` (``vllm/distributed/kv_events.py`` ``MEDIUM_CPU`` /
``MEDIUM_STORAGE``; ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``), under the same
engine block hashes as the GPU copies. The router keeps one :class:`~runtime.kv.index.PrefixIndex` per
offload medium beside its GPU index (runtime/kv/apply.py routes each event by its medium).

What a worker can reuse for a prompt (vLLM's scheduler asks the connector only *after* its own prefix
cache): the GPU prefix ``g`` blocks long, then the blocks ``g, g+1, ...`` for as long as some offload tier
holds each of them; :func:`offload_hits` counts those per medium, each block charged to the fastest medium
holding it (:data:`OFFLOAD_MEDIA` order). Loading costs ``tokens × seconds per token`` of that medium
(:func:`load_s_per_token`); a hit in a tier is therefore neither a free device hit nor a full prefill.

Load bandwidths (:data:`TIER_BANDWIDTH_BYTES_PER_S`) are the raw link rates from the PCIe base
specification (a transfer cannot be faster, so the modelled load time is a lower bound until measured;
bench/gpu_kv_tiers.py measures it on a GPU):

* ``CPU``: host memory → GPU over PCIe Gen5 x16: 16 lanes × 32 GT/s × 128/130 (encoding) / 8 bit =
  63.0 GB/s per direction (H100/H200/B200 hosts; the same 64 GB/s-class figure as the PCIe note in
  runtime/perf/gpus.py).
* ``STORAGE``: a local NVMe drive on PCIe Gen4 x4: 4 × 16 GT/s × 128/130 / 8 = 7.88 GB/s; one drive per
  GPU rank (AWS p4d/p5 nodes carry 8 local NVMe drives for 8 GPUs). The filesystem tier reads through the
  CPU tier, whose link is 8× faster, so the drive is the bound.

Each tensor-parallel rank loads its own shard over its own link, so a worker's load time per token is
``kv_bytes_per_token_rank(tp) / bandwidth`` (runtime/perf/model.py ``PerfModel.kv_bytes_per_token_rank``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from runtime.kv.events import CPU_MEDIUM, OFFLOAD_MEDIA, STORAGE_MEDIUM
from runtime.kv.index import PrefixIndex

__all__ = ["OFFLOAD_MEDIA", "TIER_BANDWIDTH_BYTES_PER_S", "load_s_per_token", "offload_hits"]

_PCIE_ENCODING = 128 / 130  # PCIe Gen3+ 128b/130b line code
#: PCIe Gen5 x16 per direction, bytes/s (host memory → GPU).
PCIE_GEN5_X16_BYTES_PER_S = 16 * 32e9 * _PCIE_ENCODING / 8
#: PCIe Gen4 x4 per direction, bytes/s (one NVMe drive).
PCIE_GEN4_X4_BYTES_PER_S = 4 * 16e9 * _PCIE_ENCODING / 8
#: Modelled load bandwidth per offload medium and GPU rank, bytes/s (module docstring: sources).
TIER_BANDWIDTH_BYTES_PER_S: dict[str, float] = {
    CPU_MEDIUM: PCIE_GEN5_X16_BYTES_PER_S,
    STORAGE_MEDIUM: PCIE_GEN4_X4_BYTES_PER_S,
}


def load_s_per_token(kv_bytes_per_token_rank: float,
                     bandwidth_bytes_per_s: Mapping[str, float] | None = None) -> dict[str, float]:
    """Seconds to load one token's KV from each offload medium onto a worker.

    Args:
        kv_bytes_per_token_rank: KV bytes of one token on one rank (every rank loads its shard in parallel
            over its own link), e.g. ``PerfModel.kv_bytes_per_token_rank(tp)``; > 0.
        bandwidth_bytes_per_s: per-medium bandwidth, bytes/s; default :data:`TIER_BANDWIDTH_BYTES_PER_S`
            (a measured figure replaces the modelled one).

    Returns:
        ``{medium: seconds per token}``.

    Raises:
        ValueError: a non-positive byte count or bandwidth.
    """
    if not kv_bytes_per_token_rank > 0:
        raise ValueError(f"kv_bytes_per_token_rank must be > 0, got {kv_bytes_per_token_rank}")
    bws = TIER_BANDWIDTH_BYTES_PER_S if bandwidth_bytes_per_s is None else bandwidth_bytes_per_s
    out = {}
    for medium, bw in bws.items():
        if not bw > 0:
            raise ValueError(f"bandwidth of medium {medium!r} must be > 0 bytes/s, got {bw}")
        out[medium] = kv_bytes_per_token_rank / bw
    return out


def offload_hits(tiers: Mapping[str, PrefixIndex], hashes: Sequence[Hashable],
                 device_overlaps: Mapping[str, int], workers: Iterable[str]) -> dict[str, dict[str, int]]:
    """Blocks each worker would load from its offload tiers for a prompt.

    Args:
        tiers: ``{medium: index}`` of the offload media (fastest first in iteration order; a block held by
            several media is counted in the first).
        hashes: the prompt's chained block hashes.
        device_overlaps: ``{worker: GPU prefix blocks}`` (``PrefixIndex.match`` of the GPU index).
        workers: the candidate workers (each must be registered in every tier index).

    Returns:
        ``{worker: {medium: blocks}}`` for workers with at least one offload hit: the run of blocks right
        after the GPU prefix that some tier holds (vLLM loads only a contiguous continuation of the prefix).

    Raises:
        runtime.kv.index.UnknownWorkerError: a worker missing from a tier index.

    Cost: one dict look-up per tier and continued block, only for workers holding offloaded blocks.
    """
    out: dict[str, dict[str, int]] = {}
    media = [(m, idx) for m, idx in tiers.items()]
    n = len(hashes)
    for w in workers:
        held = [(m, idx) for m, idx in media if idx.num_blocks(w)]
        if not held:
            continue
        i = device_overlaps.get(w, 0)
        counts: dict[str, int] = {}
        while i < n:
            h = hashes[i]
            for m, idx in held:
                if idx.holds(w, h):
                    counts[m] = counts.get(m, 0) + 1
                    break
            else:
                break
            i += 1
        if counts:
            out[w] = counts
    return out
