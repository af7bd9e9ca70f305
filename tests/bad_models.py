"""Tiny custom models, inputs and losses that get something wrong, for tests/test_bad_inputs.py."""

import sys

import torch
from torch import nn

FEATURES = 8
NOT_CALLABLE = 42


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(), nn.Linear(FEATURES, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).pow(2).mean()


class NoParameters(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum()


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).mean()


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> None:
        self.linear(x)


class ReturnsVector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class RaisesInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the user's forward is broken")


class NoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.linear(x).mean()


class MaskFilledWithAParameter(Mlp):
    """Rows picked by a boolean mask set to a parameter: the parameter's gradient indexes by the mask in the backward
    (nonzero, a shape that depends on values)."""

    def __init__(self) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[torch.ones(x.shape[0], dtype=torch.bool)] = self.fill
        return super().forward(x)


class MaskedRowsLoss(Mlp):
    """The loss of the rows a value-dependent mask keeps: `y[mask]` is aten.nonzero, sized by the count of trues."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        return y[x[:, 0] > 0].pow(2).mean()


def masked_rows_loss() -> nn.Module:
    return MaskedRowsLoss()


class RepeatedRows(Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.repeat_interleave((x[:, 0] > 0).long() + 1, dim=0)).pow(2).mean()


def repeated_rows() -> nn.Module:
    return RepeatedRows()


def mask_filled_with_a_parameter() -> nn.Module:
    return MaskFilledWithAParameter()


def mlp() -> nn.Module:
    return Mlp()


def no_parameters() -> nn.Module:
    return NoParameters()


def returns_none() -> nn.Module:
    return ReturnsNone()


def returns_vector() -> nn.Module:
    return ReturnsVector()


def raises_in_forward() -> nn.Module:
    return RaisesInForward()


def no_grad() -> nn.Module:
    return NoGrad()


def all_frozen() -> nn.Module:
    model = Mlp()
    model.requires_grad_(False)
    return model


def not_a_module() -> str:
    return "a model"


def returns_class() -> type:
    return Mlp


def factory_needs_argument(width: int) -> nn.Module:
    return Mlp()


def factory_raises() -> nn.Module:
    raise ValueError("the factory is broken")


def factory_exits() -> nn.Module:
    sys.exit(3)


def jit_traced() -> nn.Module:
    # torch.jit.trace's check_trace compares outputs by value, which fake tensors have not: torch's bare "Comparing"
    return torch.jit.trace(Mlp(), torch.randn(2, FEATURES))


class ExitsInForward(Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sys.exit()


def exits_in_forward() -> nn.Module:
    return ExitsInForward()


def inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, FEATURES)


def wrong_shape_inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, FEATURES + 3)


def integer_inputs(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 5, (batch_size, FEATURES))


def keyword_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"y": torch.randn(batch_size, FEATURES)}


def too_many_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, FEATURES), torch.randn(batch_size, FEATURES)


def list_inputs(batch_size: int) -> list[torch.Tensor]:
    return [torch.randn(batch_size, FEATURES)]


def none_inputs(batch_size: int) -> None:
    return None


def numpy_like_inputs(batch_size: int) -> list[list[float]]:
    return [[0.0] * FEATURES for _ in range(batch_size)]


def inputs_raise(batch_size: int) -> torch.Tensor:
    raise RuntimeError("the inputs function is broken")


def inputs_two_arguments(batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randn(batch_size, FEATURES)


def loss_not_scalar(output, batch) -> torch.Tensor:
    return torch.ones(3, requires_grad=True) * output


def loss_float(output, batch) -> float:
    return 1.0


def loss_raises(output, batch) -> torch.Tensor:
    raise KeyError("logits")


def loss_reading_values(output, batch) -> torch.Tensor:
    """Fine on real tensors; under fake ones `.numpy()` fails in torch, which is memplan's limit, not the loss's bug."""
    return output.sum() * float(output.detach().numpy().mean())


def loss_one_argument(output) -> torch.Tensor:
    return output


def step_without_optimizer(model, batch) -> None:
    """A --step that cannot take the optimizer memplan passes it."""
    model(batch).sum().backward()
