"""NCCL's own device memory on one rank: modelled, not traced (`--nccl-memory` gives yours).

A data-parallel rank's collectives (DDP's all-reduces, ZeroRedundancyOptimizer's broadcasts, FSDP2's
all-gathers and reduce-scatters) run on one NCCL communicator, the default process group's; its
buffers come from cudaMalloc / cuMemCreate, not from torch's caching allocator, so nvidia-smi shows
them and `max_memory_reserved` does not, and no trace sees them. Their size depends on how many
channels NCCL's topology search picks on the machine and which algorithms the job's messages use,
which only the machine knows: memplan gives a band, and fits and the device figure take its top.

The rules, from NCCL's source (read at 2.28.3; torch 2.7 and later ship NCCL 2.26 or newer):
- Each connection of a channel to a peer holds a receive buffer for each protocol, LL
  (`DEFAULT_LL_BUFFSIZE`, 512 KiB), LL128 (`DEFAULT_LL128_BUFFSIZE`, 4,915,200 B) and Simple
  (`NCCL_BUFFSIZE`, 4 MiB by default, "the buffer used by NCCL when communicating data between
  pairs of GPUs", NCCL's environment documentation), with its header, rounded up to the 2 MiB
  granularity of CUDA IPC memory: 10 MiB; and a send side (`ncclSendMem`) rounded up the same way:
  2 MiB (src/init.cc; src/transport/p2p.cc, `CUDA_IPC_MIN` in src/include/comm.h). All three
  protocols are allocated whichever one runs.
- A ring connects each channel to one peer each way: one connection. A tree connects each channel
  to its parent and children both ways (two `ncclTransportP2pConnect` calls in
  src/transport/generic.cc): inside a node the tree is a chain (a parent and a child, two connections); across
  nodes a node's head also has up to two children in other nodes (NCCL_MAX_TREE_ARITY 3 children
  and a parent, four). Since NCCL 2.22 (`NCCL_RUNTIME_CONNECT`, on by default: "Dynamically connect
  peers during runtime ... instead of init stage") an algorithm's buffers are allocated at its first
  collective, so a job whose collectives all run as rings holds the ring's alone.
- Channels: the ring search finds at least one and at most 32 (`maxChannels = MAXCHANNELS/2`,
  src/init.cc), and NCCL doubles what it found (src/graph/connect.cc: `nChannels*2`): 2 at least.
  At most it is 64 since NCCL 2.25 (`MAXCHANNELS`, src/include/device.h), but published NCCL logs
  of 8-GPU NVLink machines show 8 to 24 collective channels (NVIDIA/nccl#892: 16 on 8 H800s;
  #1259: channels up to 22 and more on 8 H100s; #634: 10 on A100 nodes; #1189: 8 on H20s): the
  band's top takes 32.
- NVLink SHARP (NVLS), on Hopper NVSwitch systems with more than two GPUs in the node
  (src/transport/nvls.cc; `NCCL_NVLS_ENABLE=0` turns it off): 16 channels (`NVLS_NCHANNELS_SM90`)
  x 2 x 1 MiB (`NVLS_CHUNKSIZE` 128 KiB x 8 steps) per GPU of the node, allocated at the first
  collective NVLS runs (2.22 and later; Blackwell uses 24-32 channels, not in memplan's GPU list).
Not modelled: NCCL's device-side structures (work FIFO, channel structs) and kernel images, which
no source sizes; communicators beyond the default group's (HSDP's second group, point-to-point
pairs). The job's `NCCL_BUFFSIZE`, `NCCL_MAX_CTAS` (or `NCCL_MAX_NCHANNELS`) and `NCCL_NVLS_ENABLE`
resize the band (NcclConfig; memplan's options of the same names read them). A check against a
measurement someone published: 688 MB of NCCL memory per process for a four-A100 NVLink group
(NVIDIA/nccl#964; its NCCL version not stated), inside this band's 24 MiB to 1,152 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20

LL_BUFFER_BYTES = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x threads x steps x line bytes: 512 KiB
LL128_BUFFER_BYTES = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x threads x steps x 8 B: 4,915,200 B
SIMPLE_BUFFER_BYTES = 4 * MiB  # NCCL_BUFFSIZE's default
IPC_GRANULARITY_BYTES = 2 * MiB  # CUDA_IPC_MIN: each side of a connection is rounded up to it
SEND_SIDE_BYTES = IPC_GRANULARITY_BYTES  # ncclSendMem (a few KiB) rounded up
MIN_RING_CHANNELS = 2  # the ring search's one channel, doubled
TOP_CHANNELS = 32  # what published logs of NVLink machines stay within (module docstring); NCCL allows 64
RING_CONNECTIONS = 1  # the previous rank and the next
TREE_CONNECTIONS_IN_NODE = 2  # a chain: the parent and one child
TREE_CONNECTIONS_ACROSS_NODES = 4  # NCCL_MAX_TREE_ARITY (3) children and the parent
NVLS_CHANNELS = 16  # NVLS_NCHANNELS_SM90
NVLS_BUFFER_BYTES = 128 * 1024 * 8  # NVLS_CHUNKSIZE x NCCL_STEPS: 1 MiB per channel, per direction, per GPU of the node
NVLS_MIN_GPUS = 3  # NVLS is never used with two GPUs or fewer in the node
NVLS_COMPUTE_CAPABILITY = (9, 0)  # Hopper and later
GPUS_PER_NODE = 8  # an HGX/DGX node: the ranks of one node, where the job is larger


def _rounded_up(num_bytes: int, granularity: int) -> int:
    return -(-num_bytes // granularity) * granularity


@dataclass(frozen=True)
class NcclConfig:
    """The NCCL environment variables that size its buffers, as the job sets them."""

    buffsize_bytes: int = SIMPLE_BUFFER_BYTES  # NCCL_BUFFSIZE: the Simple protocol's buffer
    max_ctas: int | None = None  # NCCL_MAX_CTAS (NCCL_MAX_NCHANNELS before 2.25): caps every channel count
    nvls: bool = True  # NCCL_NVLS_ENABLE=0: no NVLink SHARP buffers


DEFAULT_NCCL = NcclConfig()


def connection_bytes(config: NcclConfig = DEFAULT_NCCL) -> int:
    """One channel's connection to one peer: the receive side's three protocol buffers (and a header of a
    few KiB, inside the rounding) plus the send side, each rounded up to CUDA IPC's granularity."""
    receive = _rounded_up(LL_BUFFER_BYTES + LL128_BUFFER_BYTES + config.buffsize_bytes + 1, IPC_GRANULARITY_BYTES)
    return receive + SEND_SIDE_BYTES


def _channels(channels: int, config: NcclConfig) -> int:
    """`channels`, capped by NCCL_MAX_CTAS (src/init.cc: `maxCTAs`; nvls.cc caps NVLS's the same way)."""
    return channels if config.max_ctas is None else min(channels, config.max_ctas)


def nvls_bytes(ranks_on_node: int, compute_capability: tuple[int, int], config: NcclConfig = DEFAULT_NCCL) -> int:
    """NVLink SHARP's buffers on one GPU, where NCCL can use it."""
    if not config.nvls or compute_capability < NVLS_COMPUTE_CAPABILITY or ranks_on_node < NVLS_MIN_GPUS:
        return 0
    return _channels(NVLS_CHANNELS, config) * 2 * NVLS_BUFFER_BYTES * ranks_on_node


def communicator_band(
    world_size: int, compute_capability: tuple[int, int], config: NcclConfig = DEFAULT_NCCL
) -> tuple[int, int]:
    """The least and the most device memory the default group's NCCL communicator holds on one rank
    of `world_size`: rings on the fewest channels, against rings and trees on the band's top channel
    count plus NVLink SHARP. A group of one rank has no peers to connect to."""
    if world_size < 2:
        return 0, 0
    connection = connection_bytes(config)
    low = _channels(MIN_RING_CHANNELS, config) * RING_CONNECTIONS * connection
    ranks_on_node = min(world_size, GPUS_PER_NODE)
    tree = TREE_CONNECTIONS_IN_NODE if world_size <= GPUS_PER_NODE else TREE_CONNECTIONS_ACROSS_NODES
    top = _channels(TOP_CHANNELS, config) * (RING_CONNECTIONS + tree) * connection
    return low, top + nvls_bytes(ranks_on_node, compute_capability, config)
