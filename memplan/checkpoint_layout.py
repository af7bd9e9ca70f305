"""Which modules a training run checkpoints: segments of sibling blocks, each with its policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memplan.choices import check_choice
from memplan.errors import SettingsError

# How a checkpoint treats what its segment computes (memplan.estimator.checkpointing):
# "full" recomputes all of it in the backward; "selective" keeps the outputs of matmuls,
# convolutions and attention and recomputes the rest (torch's selective activation checkpointing).
CHECKPOINT_POLICIES = ("full", "selective")


@dataclass(frozen=True)
class CheckpointLayout:
    """Which modules a training run checkpoints (non-reentrant `torch.utils.checkpoint`).

    Each segment is a run of consecutive sibling modules (blocks of one `nn.ModuleList`) wrapped
    in one checkpoint, which keeps only the first block's inputs; a segment of one module is
    ordinary per-module checkpointing. `policies` gives each segment's CHECKPOINT_POLICIES entry
    (all "full" when left empty).
    """

    segments: tuple[tuple[str, ...], ...] = ()
    policies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        segments, policies = self.segments, self.policies
        if not _sequence_of(segments, tuple | list) or not all(_sequence_of(segment, str) for segment in segments):
            raise SettingsError(
                "a checkpoint layout's segments are lists of module names, e.g. "
                f"(('transformer.h.0', 'transformer.h.1'),); got {segments!r}"
            )
        if not _sequence_of(policies, str):
            raise SettingsError(
                f"a checkpoint layout's policies are a list, one of {', '.join(CHECKPOINT_POLICIES)} per segment; "
                f"got {policies!r}"
            )
        object.__setattr__(self, "segments", tuple(tuple(segment) for segment in segments))
        object.__setattr__(self, "policies", tuple(policies))
        if not self.policies:
            object.__setattr__(self, "policies", ("full",) * len(self.segments))
        if len(self.policies) != len(self.segments):
            raise SettingsError(
                f"a checkpoint layout needs one policy per segment: {len(self.segments)} segment(s), "
                f"{len(self.policies)} policies"
            )
        for policy in self.policies:
            check_choice("checkpoint policy", policy, CHECKPOINT_POLICIES)
        names = list(self.modules)
        if any(not segment for segment in self.segments):
            raise SettingsError("a checkpoint segment must name at least one module")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise SettingsError(f"modules checkpointed twice in one layout: {', '.join(repeated)}")
        listed = set(names)
        nested = [
            (outer, name)
            for name in names
            for outer in (".".join(name.split(".")[:depth]) for depth in range(1, name.count(".") + 1))
            if outer in listed
        ]
        if nested:  # a checkpoint inside another recomputes twice over, and memplan's planner never makes one
            outer, inner = nested[0]
            raise SettingsError(
                f"a checkpoint layout checkpoints {inner} inside {outer}, which it also checkpoints: list one of them"
            )

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(name for segment in self.segments for name in segment)

    def describe(self) -> str:
        selective = self.policies.count("selective")
        policy = f" ({selective} selective)" if selective else ""
        if selective and selective == len(self.segments):
            policy = " (selective)"
        return f"{len(self.segments)} checkpoint(s) over {len(self.modules)} module(s){policy}"

    def to_dict(self) -> dict[str, list]:
        return {"segments": [list(segment) for segment in self.segments], "policies": list(self.policies)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointLayout:
        if not isinstance(data, dict):
            raise SettingsError(f"a checkpoint layout is an object with 'segments' and 'policies'; got {data!r}")
        return cls(segments=data.get("segments", ()), policies=data.get("policies", ()))


def _sequence_of(value: Any, kind: Any) -> bool:
    """A list or tuple (not a string, which iterates as its letters) of `kind`."""
    return isinstance(value, tuple | list) and all(isinstance(item, kind) for item in value)
