"""Rebuilds one run of GPUMemNet's CNN dataset from its CSV row, for benchmarks/gpumemnet_conv.py.

It follows itu-rad/GPUMemNet at commit f5a3f5d (the commit that adds cnn_data_step1.csv; cnn.py is
unchanged there since c4c6aa8, before the runs):
- cnn.py: the net (ConvBlock, ResidualBlock, DenseBlock, TransitionBlock and CNN's layout rules,
  kept here in the same order so modules, parameters and the forward are the same), trained with
  Adam and CrossEntropyLoss on `torch.randn(channels, size, size)` inputs;
- launcher_cnn.py: the command line, whose values the file name records
  (`input_channels:…_num_classes:…_depth:…_arch:…_base_filters:…_batch:…_input_size:…_act:…
  _dropout:RATE_dropout:USE_batchnorm:USE.out`); it never passes --use_pooling, so only the dense
  layout (its transition blocks) pools;
- data_cleaner_cnn_step1.py: the row; `Activations-Params` lists torchsummary's layers, each
  conv2d/batchnorm2d/linear with its parameter count (PReLU's one parameter is not counted).

cnn.py draws one choice unseeded (`np.random.rand() > 0.5`): a dense net's transition frequency,
5 or ceil(depth / max(1, log2(input_size // 7))). build_cnn takes the one whose conv parameter
counts are the row's (`conv_params(row)`; `net_conv_params(net, field)` and `parameter_count(net)`
give a rebuild's, to check it against the row's columns).
"""

from __future__ import annotations

import ast
import math
import re

import torch
from torch import nn

ACTIVATIONS = {
    "relu": nn.ReLU,
    "leaky_relu": nn.LeakyReLU,
    "prelu": nn.PReLU,
    "elu": nn.ELU,
    "selu": nn.SELU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "swish": nn.SiLU,
    "softplus": nn.Softplus,
    "mish": nn.Mish,
}
MAX_FILTERS = 2048  # cnn.py's cap
GROWTH_RATE = 32  # CNN's default growth_rate, which the launcher never sets
_FILENAME = re.compile(
    r"input_channels:(?P<input_channels>\d+)_num_classes:(?P<num_classes>\d+)_depth:(?P<depth>\d+)"
    r"_arch:(?P<arch>\w+?)_base_filters:(?P<base_filters>\d+)_batch:(?P<batch>\d+)"
    r"_input_size:(?P<input_size>\d+)_act:(?P<act>\w+?)_dropout:(?P<dropout_rate>[\d.e-]+)"
    r"_dropout:(?P<dropout>True|False)_batchnorm:(?P<batchnorm>True|False)"
)


def parse_filename(filename: str) -> dict:
    """The launcher's settings for one run, from its file name."""
    match = _FILENAME.match(filename)
    if match is None:
        raise ValueError(f"not a GPUMemNet CNN run: {filename}")
    field = match.groupdict()
    for key in ("input_channels", "num_classes", "depth", "base_filters", "batch", "input_size"):
        field[key] = int(field[key])
    field["dropout_rate"] = float(field["dropout_rate"])
    field["dropout"] = field["dropout"] == "True"
    field["batchnorm"] = field["batchnorm"] == "True"
    return field


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int = 3, padding: int = 1, bn: bool = False,
                 dropout: float | None = None, act: str = "relu", stride: int = 1) -> None:  # fmt: skip
        super().__init__()
        layers = [nn.Conv2d(cin, cout, kernel, stride, padding)]
        if bn:
            layers.append(nn.BatchNorm2d(cout))
        layers.append(ACTIVATIONS[act]())
        if dropout is not None:
            layers.append(nn.Dropout(dropout))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, bn: bool, dropout: float | None, act: str) -> None:
        super().__init__()
        self.conv1 = ConvBlock(cin, cout, bn=bn, dropout=dropout, act=act, stride=stride)
        self.conv2 = ConvBlock(cout, cout, bn=bn, dropout=dropout, act=act)
        if cin != cout or stride != 1:
            norm = nn.BatchNorm2d(cout) if bn else nn.Identity()
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride), norm)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.shortcut(x)
        return self.conv2(self.conv1(x)) + residual


class DenseBlock(nn.Module):
    def __init__(self, cin: int, layers: int, bn: bool, dropout: float | None, act: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            ConvBlock(cin + i * GROWTH_RATE, GROWTH_RATE, bn=bn, dropout=dropout, act=act) for i in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1)))
        return torch.cat(features, 1)


class TransitionBlock(nn.Module):
    """cnn.py's: a 1x1 ConvBlock with its defaults (ReLU, no dropout), then 2x2 average pooling."""

    def __init__(self, cin: int, cout: int, bn: bool) -> None:
        super().__init__()
        self.conv = ConvBlock(cin, cout, kernel=1, padding=0, bn=bn)
        self.pool = nn.AvgPool2d(2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return self.pool(x) if x.size(2) > 1 and x.size(3) > 1 else x


def _widths(arch: str, depth: int, base: int) -> list[int]:
    """cnn.py's out_channels for layer i of the plain layouts (use_pooling off: no pooling)."""
    out = []
    for i in range(depth):
        if arch == "pyramid":
            out.append(min(int(base * ((MAX_FILTERS / base) ** (1 / depth)) ** i), MAX_FILTERS))
        elif arch == "bottleneck":
            growth = 2 if depth <= 2 else (MAX_FILTERS / base) ** (1 / (depth - 1))
            out.append(base * 2 if i == 0 else min(int(base * growth ** (i - 1)), MAX_FILTERS))
        elif arch == "gradual":
            out.append(min(int(base * ((MAX_FILTERS / base) ** (1 / (2 * depth))) ** i), MAX_FILTERS))
        elif arch == "hourglass":
            contracting = depth // 2
            if i < contracting:
                out.append(min(int(base * ((MAX_FILTERS / base) ** (1 / contracting)) ** i), MAX_FILTERS))
            else:
                shrink = (MAX_FILTERS / base) ** (1 / (depth - contracting))
                out.append(max(int(base * shrink ** (depth - i - 1)), base))
        elif arch == "uniform":
            out.append(base)
        else:
            raise ValueError(f"unsupported architecture: {arch}")
    return out


def _blocks(field: dict, dense_frequency: int) -> tuple[list[nn.Module], int]:
    arch, depth, base, size = field["arch"], field["depth"], field["base_filters"], field["input_size"]
    bn, act = field["batchnorm"], field["act"]
    dropout = field["dropout_rate"] if field["dropout"] else None
    cin, blocks = field["input_channels"], []
    if arch == "residual":
        growth = (MAX_FILTERS / base) ** (1 / depth)
        for i in range(depth // 2):
            cout = min(int(base * growth**i), MAX_FILTERS)
            stride = 2 if i % 2 == 1 and size > 7 else 1
            blocks.append(ResidualBlock(cin, cout, stride, bn, dropout, act))
            cin, size = cout, size // 2 if stride == 2 else size
            if size <= 7:
                break
    elif arch == "dense":
        count = depth // 4
        for i in range(count):
            blocks.append(DenseBlock(cin, 4, bn, dropout, act))
            cin += GROWTH_RATE * 4
            if i % dense_frequency == 0 and i != count - 1:
                blocks.append(TransitionBlock(cin, cin // 2, bn))
                cin //= 2
    else:
        for cout in _widths(arch, depth, base):
            blocks.append(ConvBlock(cin, cout, bn=bn, dropout=dropout, act=act))
            cin = cout
    return blocks, cin


class CNN(nn.Module):
    def __init__(self, field: dict, dense_frequency: int = 5) -> None:
        super().__init__()
        blocks, channels = _blocks(field, dense_frequency)
        self.blocks = nn.ModuleList(blocks)
        self.global_avg_pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, field["num_classes"])
        self.final_activation = nn.Softmax(dim=1) if field["num_classes"] > 1 else nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final_activation(self.fc(torch.flatten(self.global_avg_pool(x), 1)))


def conv_params(row: dict) -> list[int]:
    """The row's conv2d parameter counts, in torchsummary's (execution) order."""
    return [params for name, _, params in ast.literal_eval(row["Activations-Params"] or "[]") if name == "conv2d"]


def net_conv_params(net: nn.Module, field: dict) -> list[int]:
    """Conv parameter counts in execution order (a residual block runs its shortcut first)."""
    counts: list[int] = []
    hooks = [m.register_forward_hook(lambda m, i, o: counts.append(sum(p.numel() for p in m.parameters())))
             for m in net.modules() if isinstance(m, nn.Conv2d)]  # fmt: skip
    with torch.device("meta"):  # torchsummary's batch of 2
        net(torch.empty(2, field["input_channels"], field["input_size"], field["input_size"]))
    for hook in hooks:
        hook.remove()
    return counts


def parameter_count(net: nn.Module) -> int:
    """What the dataset's `Total Parameters` counts: every parameter but PReLU's."""
    return sum(p.numel() for m in net.modules() if not isinstance(m, nn.PReLU) for p in m.parameters(recurse=False))


def build_cnn(row: dict) -> nn.Module:
    field = parse_filename(row["Filename"])
    if field["arch"] != "dense":
        return CNN(field)
    poolings = max(1, int(math.log2(field["input_size"] // 7)))
    candidates = [max(1, math.ceil(field["depth"] / poolings)), 5]
    nets = {frequency: CNN(field, frequency) for frequency in candidates}
    # a dense net registers its convs in the order it runs them: no forward needed (nor a device)
    counts = {
        frequency: [sum(p.numel() for p in m.parameters()) for m in net.modules() if isinstance(m, nn.Conv2d)]
        for frequency, net in nets.items()
    }
    if len({tuple(c) for c in counts.values()}) == 1:  # the choice changes nothing (fewer than 2 blocks)
        return nets[candidates[0]]
    for frequency in candidates:
        if counts[frequency] == conv_params(row):
            return nets[frequency]
    raise ValueError(f"no transition frequency gives the row's conv layers: {row['Filename']}")


def batch(row: dict, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cnn.py's OnTheFlyDataset batch: randn images and random class labels."""
    field = parse_filename(row["Filename"])
    size = field["input_size"]
    images = torch.randn(batch_size, field["input_channels"], size, size)
    return images, torch.randint(0, field["num_classes"], (batch_size,))
