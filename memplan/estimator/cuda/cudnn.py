"""cuDNN convolution workspaces on the cuda target: a band, because cuDNN picks the algorithm at run time.

What PyTorch does (aten/src/ATen/native/cudnn/Conv_v8.cpp, torch 2.11-2.14, cuDNN 9):
- Forward, backward-data and backward-weight convolutions each run one cuDNN execution plan.
  `run_conv_plan` allocates `plan.getWorkspaceSize()` bytes through the caching allocator right
  before the kernel and frees them right after: a transient request per call, counted in
  memory_allocated, that leaves its segment cached (reserved) for later requests.
- With `torch.backends.cudnn.benchmark = False` (the default) the plan is the heuristics' first
  choice (CUDNN_HEUR_MODE_INSTANT); there is no filtering by workspace size. If its workspace
  cannot be allocated (after the allocator has released its cached blocks), `try_configs` catches
  the OutOfMemoryError and tries the next configuration, down to the fallback list. So a large
  workspace does not by itself crash a step that fits without it, but when memory is free it is
  taken, and it shows in max_memory_reserved and nvidia-smi.
- With benchmark = True, `get_plans_from_find` times every candidate on one shared workspace as
  large as the largest candidate's that fits in free memory (halving on OOM), then empties the
  allocator's cache; the fastest plan then runs with its own workspace.
- The plan and its workspace size depend on the GPU, the cuDNN build and the heuristics: they
  cannot be known without the GPU. cuDNN reaches its tensor-core kernels by transforming NCHW
  operands to NHWC ("The cuDNN library may use padding, folding, and NCHW-to-NHWC
  transformations to call the Tensor Core operations", cuDNN docs, Legacy API, "Data and Filter
  Formats"), and TF32 kernels need workspace for the fp32 -> tf32 rounding of their inputs
  (tensorflow/tensorflow#56055, raising TensorFlow's cuDNN workspace limit for Ampere TF32).

So memplan predicts a band per convolution call:
- low: 0 bytes, an implicit-GEMM plan that needs no workspace (also what the OOM fallback finds);
- high: the workspace of the plan cuDNN 9.19's heuristics ran on an H100, call by call (the main
  suite's ResNet traces, docs/validation.md "Workspace sizes on the H100"), where a tensor-core path
  needs a transformation: NCHW operands, and fp32 on TF32 tensor cores (Ampere and later, TF32
  allowed for convolutions by default: torch.backends.cudnn.allow_tf32 = True). A kxk call
  transforms its three operands (input + weight + output forward; grad_output + weight +
  grad_input for backward-data; input + grad_output + grad_weight for backward-weight); a 1x1 call
  only its activations, or none at stride 1 on maps of 14x14 or more, where it is a GEMM on the
  NCHW tensors and its weight gradient is summed from a float32 partial per image; a
  backward-weight adds split-K room, float32 copies of the weight in every dtype (`_split_k_bytes`).
  Transformed operands have their channels padded where tensor cores cannot take them (to multiples
  of 8 in fp16/bf16, 4 in TF32: `_padded_channels`), as the ResNet stems' 3 channels were on the H100.
  16-bit channels-last convolutions run natively: 0.
Depthwise convolutions that PyTorch runs with its own kernel make no cuDNN call
(`_runs_natively_depthwise`). A backward convolution's two calls request and free their workspaces in turn (simulate.py,
`Scratch.sequential`), and the replay skips a workspace the device cannot hold, as try_configs
does (timeline.py). The top of the band is what "fits" and the largest batch use (an estimate that
is too low is worse than none), with the low end where it needs more; both ends are reported.

The user's switches (`CudnnSwitches`, from TrainingSettings):
- `torch.backends.cudnn.allow_tf32 = False`: fp32 convolutions leave tensor cores (Conv_v8.cpp
  drops plans with CUDNN_NUMERICAL_NOTE_TENSOR_CORE for fp32 without TF32): no transformation, no band.
- CUDNN_CONV_WSCAP_DBG=N: a cuDNN library variable, read by cuDNN, not by PyTorch; the PyTorch
  docs call it the cuDNN workspace setting "per allocation" (cuda_environment_variables.rst) and
  public scripts set it in MiB. memplan caps each call's band top at N MiB. NVIDIA documents
  neither its unit nor whether it filters every engine, so this reading is unverified.
- `torch.backends.cudnn.benchmark = True`: the plan cuDNN runs is the fastest one whose workspace
  fit when it was timed, so the band stays as it is. What benchmark mode adds is a one-time search
  at each convolution shape's first call: every candidate is timed on one workspace as large as
  the largest candidate's that fits in free memory (halving on failure), then the allocator's
  cache is emptied (Conv_v8.cpp get_plans_from_find, `_cudnn_get_conv_benchmark_empty_cache`,
  default true). It never makes a step fail, but max_memory_reserved and nvidia-smi over a run can
  show up to the GPU's free memory during the first iteration; memplan says so and does not
  count it in the steady-state peak.
- Deterministic algorithms (`torch.use_deterministic_algorithms(True)`, `cudnn.deterministic`):
  Conv_v8.cpp drops plans with CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC. Deterministic plans still
  transform NCHW operands for tensor cores, so the band is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from memplan.estimator.memory_formats import suggested_memory_format

aten = torch.ops.aten

CONV_FORWARD_OPS = frozenset({aten.convolution.default})
CONV_BACKWARD_OPS = frozenset({aten.convolution_backward.default})
CONV_OPS = CONV_FORWARD_OPS | CONV_BACKWARD_OPS


FORWARD, BACKWARD_DATA, BACKWARD_WEIGHT = "forward", "backward-data", "backward-weight"


@dataclass(frozen=True)
class ConvOperands:
    """One cuDNN convolution call: its direction, the two tensors it reads and the one it writes,
    and the geometry cuDNN's heuristics choose a plan by."""

    read_bytes: tuple[int, int]  # forward: input, weight; backward-data: grad_output, weight;
    written_bytes: int  # backward-weight: input, grad_output (written: output / grad_input / grad_weight)
    dtype: torch.dtype
    channels_last: bool
    direction: str = FORWARD
    pointwise: bool = False  # a 1x1 kernel
    strided: bool = False
    output_pixels: int = 0  # height x width of the forward output (= of grad_output)
    batch: int = 0
    weight_numel: int = 0
    # (input channels, output channels) of the convolution, and its groups: what cuDNN pads for
    # tensor cores where they are not aligned (`_channel_padding`).
    channels: tuple[int, int] = (0, 0)
    groups: int = 1


def _uses_tensor_cores(dtype: torch.dtype, compute_capability: tuple[int, int]) -> bool:
    """Whether cuDNN's tensor-core kernels apply: fp16 from Volta, bf16 and TF32 (fp32) from Ampere."""
    if dtype == torch.float16:
        return compute_capability >= (7, 0)
    if dtype in (torch.bfloat16, torch.float32):
        return compute_capability >= (8, 0)
    return False


# How the timeline names a convolution's workspace request (the top of the band).
CUDNN_WORKSPACE = "cudnn workspace"


@dataclass(frozen=True)
class CudnnSwitches:
    """How the run configures cuDNN's convolutions (see the module docstring)."""

    allow_tf32: bool = True  # torch.backends.cudnn.allow_tf32
    workspace_cap_bytes: int | None = None  # CUDNN_CONV_WSCAP_DBG, in bytes


# 1x1 stride-1 convolutions with at least this many output pixels (height x width) ran as a GEMM
# straight on the NCHW tensors on the H100 (cuDNN 9.19, heuristic mode): no workspace forward or
# backward-data. With 7x7 maps (ResNet's last stage) they ran through the NHWC transformation
# instead. 14x14 is the smallest map seen as a GEMM; where between 7x7 and 14x14 the heuristics
# switch is not known. Source: docs/validation/h100/conv-workspaces.json.
POINTWISE_GEMM_MIN_PIXELS = 14 * 14
FLOAT32_BYTES = 4
# On the H100 (cuDNN 9.19), a TF32 (fp32) backward-weight call on a transformed path asked for more
# than its three operands: 6.75-8.25 MiB more in every such call, and 14 float32 copies of a weight
# too small to reach that (64x64x3x3: +1.97 MiB; 128x128x3x3: +7.875 MiB): room for the partial sums
# of a reduction split over thread blocks (split-K). memplan adds up to 16 float32 copies of the
# weight, at most the largest extra seen, wherever TF32 runs (Ampere on). Backward-weight's
# workspace then no longer fits in the block backward-data's freed, and opens a segment of its own
# where both are large: on the A100 runs of benchmarks/gpumemnet_conv.py (cuDNN 9.1, fp32) this
# takes the calibration half's median error from -5.0% to -1.1%, and some of those nets 20-30% over
# what they reserved.
# 16-bit backward-weight calls (fp16, bf16: their partial sums accumulate in float32 too) asked for
# k float32 copies of the weight plus a few hundred bytes, k varying with the shape and the plan:
# 13 for 3x3 64->64, 4-6 for 3x3 128->128, 2-3 for 1x1 256<->1024 at 14x14 and the strided 1x1
# 256->512, 0 for 3x3 of 256 channels or more (a plan without split-K). The largest, 13 copies + 679 B,
# is within the fp32 room, so the band's top takes the same room for every dtype: a 16-bit request
# above the top opened a segment memplan did not have (resnet-50 amp-fp16's layer2.0 downsample,
# 3 copies + 559 B more than its operands: a 150 MiB segment, -4.4% reserved). The low end is
# unchanged (a plan without split-K, as the 3x3 256-channel calls ran).
# Source: docs/validation/h100/conv-workspaces.json.
SPLIT_K_WEIGHT_COPIES = 16
SPLIT_K_MAX_BYTES = 8 * 2**20 + 256 * 2**10


# Channel padding for tensor cores. NVIDIA's Convolutional Layers User's Guide (Deep Learning
# Performance docs, "Channels In And Out"): tensor cores want input and output channels divisible by
# 8 in fp16 (and bf16) and by 4 in TF32; "for the first convolutional layer in most CNNs where the
# input tensor consists of 3-channel images, padding to 4 channels is sufficient if a stride of 2 is
# used". cuDNN pads packed NCHW operands itself to reach those kernels (cuDNN docs, Legacy API, "Data
# and Filter Formats": "may use padding, folding, and NCHW-to-NHWC transformations"; NVIDIA's blog
# "Tensor Ops Made Easier in cuDNN", cuDNN 7.2): the transformed copies then have the padded channel
# counts. On the H100 (cuDNN 9.19) the 7x7 stride-2 stem of 3 channels was padded to 4 in fp16 (forward:
# the padded input + padded weight + output + 16 B, to the byte) and to 8 in bf16 (the same, to the
# byte), and its fp32 backward-weight to 4 (its input one channel wider: 6,422,528 B more at batch 64
# than at 32 beyond the operands' own growth); its fp32 forward ran on the unpadded operands, under
# the top. Grouped convolutions are left as they are (no evidence how cuDNN pads a group).
TENSOR_CORE_CHANNEL_ALIGNMENT = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
FP16_STRIDED_FIRST_LAYER_ALIGNMENT = 4


def _aligned(channels: int, alignment: int) -> int:
    return -(-channels // alignment) * alignment


def _padded_channels(call: ConvOperands) -> tuple[int, int] | None:
    """(input channels, output channels) as cuDNN pads them for tensor cores, or None where both are
    aligned already (or the call is grouped, or its channels unknown)."""
    alignment = TENSOR_CORE_CHANNEL_ALIGNMENT.get(call.dtype)
    in_channels, out_channels = call.channels
    if alignment is None or call.groups != 1 or in_channels <= 0 or out_channels <= 0:
        return None
    in_alignment = alignment
    if call.dtype == torch.float16 and call.strided and in_channels <= FP16_STRIDED_FIRST_LAYER_ALIGNMENT:
        in_alignment = FP16_STRIDED_FIRST_LAYER_ALIGNMENT
    padded = (_aligned(in_channels, in_alignment), _aligned(out_channels, alignment))
    return None if padded == call.channels else padded


def _padded_operands(call: ConvOperands, padded: tuple[int, int]) -> ConvOperands:
    """The call with its operands' bytes as cuDNN's transformed copies hold them: the input-side
    tensor (input, grad_input) grown by the padded input channels, the output-side one (output,
    grad_output) by the padded output channels, the weight by both."""
    (in_channels, out_channels), (in_padded, out_padded) = call.channels, padded

    def input_side(size: int) -> int:
        return size * in_padded // in_channels

    def output_side(size: int) -> int:
        return size * out_padded // out_channels

    first, second = call.read_bytes
    if call.direction == FORWARD:  # input, weight -> output
        sizes = (input_side(first), output_side(input_side(second)), output_side(call.written_bytes))
    elif call.direction == BACKWARD_DATA:  # grad_output, weight -> grad_input
        sizes = (output_side(first), output_side(input_side(second)), input_side(call.written_bytes))
    else:  # input, grad_output -> grad_weight
        sizes = (input_side(first), output_side(second), output_side(input_side(call.written_bytes)))
    return replace(call, read_bytes=sizes[:2], written_bytes=sizes[2])


def _split_k_bytes(call: ConvOperands) -> int:
    if call.direction != BACKWARD_WEIGHT:
        return 0
    if _padded_channels(call) is not None:
        # A call with padded channels took more than 16 copies: the H100's fp32 and bf16 stems asked
        # 6,021,264 B beyond their padded operands at batch 32, 50 and 64 alike (120 float32 copies of
        # the 4-channel weight, 60 of the 8-channel one), fp16's 401,408 + 623 B (8 copies). The cap,
        # the most any call took, is the top's room for them.
        return SPLIT_K_MAX_BYTES
    return min(SPLIT_K_WEIGHT_COPIES * call.weight_numel * FLOAT32_BYTES, SPLIT_K_MAX_BYTES)


def _plan_workspace_bytes(call: ConvOperands) -> int:
    """The workspace of the plan cuDNN's heuristics run first, for a call that takes a tensor-core
    path through transformed operands (see the module docstring and
    docs/validation.md "Workspace sizes on the H100")."""
    padded = _padded_channels(call)
    if padded is not None:
        call = _padded_operands(call, padded)
    first, second = call.read_bytes
    if not call.pointwise:
        # A kxk kernel: every operand transformed once (41 of 51 fp32 forward calls to the byte).
        return first + second + call.written_bytes + _split_k_bytes(call)
    # A 1x1 kernel transforms the activations it reads and writes, not the weight: input + output
    # forward, grad_output + grad_input for backward-data, input + grad_output for backward-weight
    # (strided 1x1 shortcuts, and 7x7 maps, on the H100).
    transformed = first + second if call.direction == BACKWARD_WEIGHT else first + call.written_bytes
    transformed += _split_k_bytes(call)
    if call.strided or call.output_pixels < POINTWISE_GEMM_MIN_PIXELS:
        return transformed
    # Otherwise a GEMM straight on the NCHW tensors: nothing to transform forward or backward-data.
    # The weight gradient is summed from one float32 partial result per image (batch x weight
    # elements x 4 bytes, in every dtype: 4.0 MiB for a 256x64 weight at batch 64, fp32 and fp16
    # alike; 3.125 MiB at batch 50) unless that is more than the transformed path, which cuDNN then
    # ran (a 512x1024 weight at batch 64: 81.5 MiB, not 128).
    if call.direction != BACKWARD_WEIGHT:
        return 0
    return min(call.batch * call.weight_numel * FLOAT32_BYTES, transformed)


def workspace_band_bytes(
    call: ConvOperands, compute_capability: tuple[int, int], switches: CudnnSwitches = CudnnSwitches()
) -> tuple[int, int]:
    """(low, high) bytes of the workspace one convolution call may request (see the module docstring)."""
    if call.dtype == torch.float32 and not switches.allow_tf32:
        return 0, 0
    if not _uses_tensor_cores(call.dtype, compute_capability):
        return 0, 0
    native = call.channels_last and call.dtype != torch.float32  # 16-bit NHWC: no transformation
    if native:
        return 0, 0
    high = _plan_workspace_bytes(call)
    if switches.workspace_cap_bytes is not None:
        high = min(high, switches.workspace_cap_bytes)
    return 0, high


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _channels_last(tensor: torch.Tensor) -> bool:
    """cudnn_conv_suggest_memory_format (ConvUtils.h): channels-last (channels-last-3d for 5-d) when
    input or weight is (a tensor contiguous both ways counts as contiguous)."""
    return suggested_memory_format(tensor) != torch.contiguous_format


def _runs_natively_depthwise(
    x: torch.Tensor, weight: torch.Tensor, stride: list, dilation: list, transposed: bool, groups: int
) -> bool:
    """Whether PyTorch runs a convolution with its own depthwise kernel, not cuDNN's: no workspace.
    Convolution.cpp `_select_conv_backend`: a depthwise convolution (`is_depthwise`: not transposed,
    4-d or 5-d, groups == input channels > 1, output channels a multiple of them) goes to
    CudaDepthwise2d/3d unless `use_cudnn_depthwise`: channels-last, or fp16 4-d without dilation, with
    a square stride and at least 32 channels, where `check_cudnn_depthwise_workload_with_filter`
    chooses by shape (memplan keeps cuDNN's band there, the safe side)."""
    channels = x.shape[1]
    # A 1-d convolution reaches the backend choice as a 2-d one of height 1 (`view1d_as_2d`).
    dims, height = (4, 1) if x.dim() == 3 else (x.dim(), x.shape[2] if x.dim() > 2 else 1)
    if x.dim() == 3:
        stride, dilation = [1, *stride], [1, *dilation]
    depthwise = not transposed and dims in (4, 5) and groups == channels > 1 and weight.shape[0] % channels == 0
    if not depthwise or _channels_last(x) or _channels_last(weight):
        return False
    may_take_cudnn = (
        x.dtype == weight.dtype == torch.float16
        and dims == 4
        and all(step == 1 for step in dilation)
        and (stride[0] == stride[1] or height == 1)
        and channels >= 32
    )
    return not may_take_cudnn


def conv_calls(target: object, args: tuple, output: object) -> list[ConvOperands]:
    """The cuDNN calls one traced convolution op makes: one forward, or backward-data then backward-weight
    (none where PyTorch's own depthwise kernel runs it)."""
    if target in CONV_FORWARD_OPS:  # (input, weight, bias, stride, padding, dilation, transposed, _, groups)
        x, weight, stride, dilation, transposed, groups = args[0], args[1], args[3], args[5], args[6], args[8]
        grad_output = output
    elif target in CONV_BACKWARD_OPS:
        grad_output, x, weight, stride = args[0], args[1], args[2], args[4]
        dilation, transposed, groups = args[6], args[7], args[9]
    else:
        return []
    if _runs_natively_depthwise(x, weight, list(stride), list(dilation), bool(transposed), int(groups)):
        return []
    geometry = {
        "pointwise": all(size == 1 for size in weight.shape[2:]),
        "strided": any(step != 1 for step in stride),
        "output_pixels": math.prod(grad_output.shape[2:]),
        "batch": x.shape[0],
        "weight_numel": weight.numel(),
        # The input's and the output's channels (a transposed weight lists them the other way round).
        "channels": (x.shape[1], grad_output.shape[1]) if x.dim() > 1 and grad_output.dim() > 1 else (0, 0),
        "groups": int(groups),
    }
    layout = _channels_last(x) or _channels_last(weight)
    if target in CONV_FORWARD_OPS:
        return [ConvOperands((_nbytes(x), _nbytes(weight)), _nbytes(output), x.dtype, layout, FORWARD, **geometry)]
    output_mask = args[10]
    calls = []
    if output_mask[0]:
        operands = ((_nbytes(grad_output), _nbytes(weight)), _nbytes(x))
        calls.append(ConvOperands(*operands, x.dtype, layout, BACKWARD_DATA, **geometry))
    if output_mask[1]:
        operands = ((_nbytes(x), _nbytes(grad_output)), _nbytes(weight))
        calls.append(ConvOperands(*operands, x.dtype, layout, BACKWARD_WEIGHT, **geometry))
    return calls
