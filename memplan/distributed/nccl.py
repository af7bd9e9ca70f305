"""NCCL's own device memory on one rank: modelled, not traced (`--nccl-memory` gives yours).

A data-parallel rank's collectives (DDP's all-reduces, ZeroRedundancyOptimizer's broadcasts, FSDP2's
all-gathers and reduce-scatters) run on one NCCL communicator, the default process group's; its
buffers come from cudaMalloc / cuMemCreate, not from torch's caching allocator, so nvidia-smi shows
them and `max_memory_reserved` does not, and no trace sees them. Their size depends on how many
channels NCCL's topology search picks on the machine and which algorithms the job's messages use,
which only the machine knows: memplan gives a band, and fits and the device figure take its top.

The rules, from NCCL's source (2.21-2.27; torch 2.7 and later ship NCCL 2.26 or newer):
- Each connection of a channel to a peer holds a receive buffer for each protocol, LL
  (`DEFAULT_LL_BUFFSIZE`, 512 KiB), LL128 (`DEFAULT_LL128_BUFFSIZE`, 4,915,200 B) and Simple
  (`NCCL_BUFFSIZE`, 4 MiB by default, "the buffer used by NCCL when communicating data between
  pairs of GPUs", NCCL's environment documentation), with its header, rounded up to the 2 MiB
  granularity of CUDA IPC memory: 10 MiB; and a send side (`ncclSendMem`) rounded up the same way:
  2 MiB (src/init.cc; src/transport/p2p.cc, `CUDA_IPC_MIN` in src/include/comm.h). All three
  protocols are allocated whichever one runs.
- A ring connects each channel to one peer each way; a tree adds its own connections. Since NCCL
  2.22 (`NCCL_RUNTIME_CONNECT`, on by default: "Dynamically connect peers during runtime ...
  instead of init stage") an algorithm's buffers are allocated at its first collective, so a job
  whose collectives all run as rings holds the ring's alone.
- Channels: at most 32 per communicator (`MAXCHANNELS`) by default; NCCL picks as many as the
  links' bandwidth calls for, from two on a PCIe box to tens on NVLink/NVSwitch machines.
- NVLink SHARP (NVLS), on Hopper and later NVSwitch systems with more than two GPUs in the node
  (src/transport/nvls.cc; `NCCL_NVLS_ENABLE=0` turns it off): 16 channels x 2 x 1 MiB per GPU of
  the node, allocated at the first collective NVLS runs (2.22 and later).
Not modelled: NCCL's device-side structures (work FIFO, channel structs) and kernel images, which
no source sizes; communicators beyond the default group's (HSDP's second group, point-to-point
pairs). A check against a measurement someone published: 688 MB of NCCL memory per process for a
four-A100 NVLink group (NVIDIA/nccl#964), inside this band's 24 MiB to 768 MiB.
"""

from __future__ import annotations

MiB = 1 << 20

LL_BUFFER_BYTES = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x threads x steps x line bytes: 512 KiB
LL128_BUFFER_BYTES = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x threads x steps x 8 B: 4,915,200 B
SIMPLE_BUFFER_BYTES = 4 * MiB  # NCCL_BUFFSIZE's default
IPC_GRANULARITY_BYTES = 2 * MiB  # CUDA_IPC_MIN: each side of a connection is rounded up to it
SEND_SIDE_BYTES = IPC_GRANULARITY_BYTES  # ncclSendMem (a few KiB) rounded up
MIN_RING_CHANNELS = 2  # the fewest a ring runs on
MAX_CHANNELS = 32  # MAXCHANNELS, the default cap (NCCL_MAX_CTAS raises or lowers it)
ALGORITHMS_WITH_CONNECTIONS = 2  # ring and tree: each connects every channel once
NVLS_CHANNELS = 16
NVLS_BUFFER_BYTES = 1 * MiB  # per channel, per direction, per GPU of the node (2.22 and later)
NVLS_MIN_GPUS = 3  # NVLS is never used with two GPUs or fewer in the node
NVLS_COMPUTE_CAPABILITY = (9, 0)  # Hopper and later
GPUS_PER_NODE = 8  # an HGX/DGX node: the ranks of one node, where the job is larger


def _rounded_up(num_bytes: int, granularity: int) -> int:
    return -(-num_bytes // granularity) * granularity


def connection_bytes() -> int:
    """One channel's connection to one peer: the receive side's three protocol buffers (and a header of a
    few KiB, inside the rounding) plus the send side, each rounded up to CUDA IPC's granularity."""
    receive = _rounded_up(LL_BUFFER_BYTES + LL128_BUFFER_BYTES + SIMPLE_BUFFER_BYTES + 1, IPC_GRANULARITY_BYTES)
    return receive + SEND_SIDE_BYTES


def nvls_bytes(ranks_on_node: int, compute_capability: tuple[int, int]) -> int:
    """NVLink SHARP's buffers on one GPU, where NCCL can use it."""
    if compute_capability < NVLS_COMPUTE_CAPABILITY or ranks_on_node < NVLS_MIN_GPUS:
        return 0
    return NVLS_CHANNELS * 2 * NVLS_BUFFER_BYTES * ranks_on_node


def communicator_band(world_size: int, compute_capability: tuple[int, int]) -> tuple[int, int]:
    """The least and the most device memory the default group's NCCL communicator holds on one rank
    of `world_size`: rings on the fewest channels, against rings and trees on every channel plus
    NVLink SHARP. A group of one rank has no peers to connect to."""
    if world_size < 2:
        return 0, 0
    connection = connection_bytes()
    low = MIN_RING_CHANNELS * connection
    ranks_on_node = min(world_size, GPUS_PER_NODE)
    high = MAX_CHANNELS * ALGORITHMS_WITH_CONNECTIONS * connection + nvls_bytes(ranks_on_node, compute_capability)
    return low, high
