"""A roofline time estimate of a traced CUDA step: a lower bound, not a measurement.

Each op takes max(FLOPs / peak FLOP/s of its math mode, bytes it reads and writes / memory
bandwidth) (Williams, Waterman & Patterson, "Roofline", CACM 2009), with the card's datasheet
peaks (memplan.gpus.Throughput). Real kernels reach a fraction of both peaks and launches add
microseconds, so the estimate is optimistic in absolute terms; it serves to compare layouts and
batch sizes on one card (recomputation adds FLOPs; small batches re-read the same weights).

Math modes follow torch's defaults: matmuls in fp32 use fp32 CUDA cores
(`torch.backends.cuda.matmul.allow_tf32` is False by default), convolutions in fp32 use TF32
(`torch.backends.cudnn.allow_tf32` is True by default), 16-bit inputs use tensor cores.
"""

from __future__ import annotations

import torch

from memplan.estimator.flops import node_flops
from memplan.estimator.leaves import tensors_in
from memplan.estimator.opgraph import OpGraph, OpNode
from memplan.estimator.traced_step import TracedStep
from memplan.gpus import DEFAULT_GPU, Throughput, gpu_named

aten = torch.ops.aten

CONVOLUTIONS = {aten.convolution.default, aten.convolution_backward.default}


def _is_view(node: OpNode) -> bool:
    """Ops whose outputs alias an input without writing it (views) move no memory."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    infos = [ret.alias_info for ret in schema.returns]
    return all(info is not None and not info.is_write for info in infos)


def _input_values(node: OpNode) -> list[torch.Tensor]:
    values = [arg.meta.get("val") for arg in node.all_input_nodes]
    return [tensor for value in values for tensor in tensors_in(value)]


def _bytes_moved(node: OpNode) -> int:
    if _is_view(node):
        return 0
    tensors = _input_values(node) + tensors_in(node.meta.get("val"))
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _flops_per_second(node: OpNode, throughput: Throughput) -> float:
    inputs = _input_values(node)
    dtype = inputs[0].dtype if inputs else torch.float32
    if dtype == torch.float16:
        return throughput.fp16_flops
    if dtype == torch.bfloat16:
        return throughput.bf16_flops or throughput.fp32_flops
    if node.target in CONVOLUTIONS and throughput.tf32_flops is not None:
        return throughput.tf32_flops
    return throughput.fp32_flops


def node_seconds(node: OpNode, throughput: Throughput) -> float:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0.0  # placeholders, constants, and Python glue such as operator.getitem run no kernel
    flops = node_flops(node)
    compute = flops / _flops_per_second(node, throughput) if flops else 0.0
    return max(compute, _bytes_moved(node) / throughput.memory_bytes_per_s)


def graph_seconds(graph: OpGraph, throughput: Throughput) -> float:
    return sum(node_seconds(node, throughput) for node in graph.nodes)


def step_seconds(traced: TracedStep) -> float | None:
    """The traced step's roofline time on its target card; None on the cpu target."""
    if traced.settings.device != "cuda":
        return None
    return graph_seconds(traced.graph, gpu_named(traced.settings.gpu or DEFAULT_GPU).throughput)
