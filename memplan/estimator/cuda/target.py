"""What runs differently when the step is traced for a CUDA device: the context a trace enters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memplan.estimator.cuda.autocast import cuda_autocast_policy
from memplan.estimator.cuda.kernels import cuda_kernels
from memplan.estimator.rnn_layers import cudnn_rnn_reported
from memplan.finetune.bnb_kernels import int8_matmul_as_on_cuda
from memplan.settings import TrainingSettings


@contextlib.contextmanager
def target_kernels(settings: TrainingSettings) -> Iterator[set[str]]:
    """On a cuda target, CUDA's autocast lists, attention backends and dropout kernel, and
    bitsandbytes' 8-bit matmul as it runs there; recurrent layers, which run cuDNN's RNN there, reported.

    Yields the set of ops that ran whose CUDA behaviour memplan does not know (reported, not guessed).
    """
    if settings.device != "cuda":
        yield set()
        return
    with (
        cuda_autocast_policy() as unknown_autocast_ops,
        cuda_kernels(settings.gpu, settings.deterministic),
        int8_matmul_as_on_cuda(),
        cudnn_rnn_reported(unknown_autocast_ops),
    ):
        yield unknown_autocast_ops
