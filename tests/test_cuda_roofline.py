"""The roofline estimate against hand-computed times for single ops on an H100's datasheet peaks."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.estimator.cuda.roofline import graph_seconds
from memplan.estimator.recorder import record_graph
from memplan.gpus import gpu_named

H100 = gpu_named("H100-80GB").throughput


def traced(function, *shapes_and_dtypes):
    with FakeTensorMode():
        args = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes]
        return record_graph(function, *args)


@pytest.mark.parametrize(("dtype", "rate"), [(torch.bfloat16, H100.bf16_flops), (torch.float32, H100.fp32_flops)])
def test_a_large_matmul_is_compute_bound_at_its_math_mode(dtype, rate):
    m, k, n = 4096, 4096, 4096
    graph = traced(torch.mm, ((m, k), dtype), ((k, n), dtype))
    size = torch.empty((), dtype=dtype).element_size()
    compute, memory = 2 * m * k * n / rate, (m * k + k * n + m * n) * size / H100.memory_bytes_per_s
    assert compute > memory
    assert graph_seconds(graph, H100) == pytest.approx(compute, rel=1e-12)


def test_a_pointwise_add_is_memory_bound_and_a_view_is_free():
    graph = traced(lambda a, b: (a + b).view(-1), ((1024, 1024), torch.float32), ((1024, 1024), torch.float32))
    three_tensors = 3 * 1024 * 1024 * 4
    assert graph_seconds(graph, H100) == pytest.approx(three_tensors / H100.memory_bytes_per_s, rel=1e-12)


def test_fp32_convolutions_use_tf32_like_cudnn_by_default():
    def conv(x, w):
        return torch.nn.functional.conv2d(x, w, padding=1)

    graph = traced(conv, ((64, 256, 56, 56), torch.float32), ((256, 256, 3, 3), torch.float32))
    flops = 2 * 64 * 256 * 56 * 56 * 256 * 3 * 3
    assert graph_seconds(graph, H100) == pytest.approx(flops / H100.tf32_flops, rel=1e-12)


def test_picking_outputs_of_a_multi_output_op_costs_nothing():
    """native_layer_norm returns (out, mean, rstd); the getitem nodes that pick them run no kernel."""

    def layer_norm(x, w, b):
        return torch.nn.functional.layer_norm(x, (1024,), w, b)

    graph = traced(layer_norm, ((4096, 1024), torch.float32), ((1024,), torch.float32), ((1024,), torch.float32))
    assert any(node.target.__name__ == "getitem" for node in graph.nodes if node.op == "call_function")
    moved = (2 * 4096 * 1024 + 2 * 1024 + 2 * 4096) * 4  # x and out; weight and bias; mean and rstd
    assert graph_seconds(graph, H100) == pytest.approx(moved / H100.memory_bytes_per_s, rel=1e-12)
