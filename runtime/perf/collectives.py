"""Cost of one all-reduce as NCCL itself estimates it: protocol latencies and bandwidth factors.

NCCL picks, per collective, the algorithm/protocol with the lowest ``latency + bytes / bandwidth``
(NVIDIA/nccl ``src/graph/tuning.cc``, ``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime``). For a ring all-reduce
inside one node the two protocols that matter are LL (low latency; 8-byte lines of 4 data + 4 flag bytes, so
NCCL rates its all-reduce bandwidth at 1/4) and Simple (full bandwidth, higher latency). Latencies are
``baseLat + 2 (n-1) * hwLat`` with the constants below (microseconds).

Pure functions, no I/O.
"""

from __future__ import annotations

# NCCL cost model (NVIDIA/nccl src/graph/tuning.cc, ``baseLat`` / ``hwLat``), microseconds: ring all-reduce
# latency = base + 2 (n-1) * per-hop, protocols LL and Simple, NVLink vs PCIe hops.
_NCCL_BASE_LAT_US = {"ll": 3.6, "simple": 8.4}
_NCCL_HOP_LAT_US = {(True, "ll"): 0.47, (True, "simple"): 3.4, (False, "ll"): 1.0, (False, "simple"): 5.7}
NCCL_LL_BW_FACTOR = 4.0  # ring LL all-reduce bandwidth = bus bandwidth / 4 (tuning.cc)


def nccl_latencies(tp: int, nvlink: bool) -> tuple[float, float]:
    """(LL, Simple) latency of one ring all-reduce over ``tp`` GPUs, seconds (NCCL ``tuning.cc``:
    ``baseLat + 2 (tp-1) * hwLat``; e.g. 8 NVLink GPUs: LL 3.6 + 14 * 0.47 = 10.18 us, Simple 8.4 + 14 * 3.4
    = 56.0 us)."""
    steps = 2 * (tp - 1)
    return tuple((_NCCL_BASE_LAT_US[p] + steps * _NCCL_HOP_LAT_US[(nvlink, p)]) * 1e-6 for p in ("ll", "simple"))


def nccl_allreduce_s(bus_s: float, lat_ll_s: float, lat_simple_s: float) -> float:
    """Time of one all-reduce whose bytes take ``bus_s`` at full bus bandwidth: the faster of the LL protocol
    (``lat_ll_s + 4 bus_s``) and the Simple protocol (``lat_simple_s + bus_s``), as NCCL chooses."""
    return min(lat_ll_s + NCCL_LL_BW_FACTOR * bus_s, lat_simple_s + bus_s)
