"""PYTORCH_CUDA_ALLOC_CONF read as torch reads it (c10/core/AllocatorConfig.cpp, torch 2.11-2.14).

The options that shape device memory become an `AllocatorConfig` for the caching-allocator
simulator (memplan.estimator.cuda.allocator); the others are returned by name, to be noted as not
modelled. A value torch's parser would refuse raises ValueError with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer
# Keys CUDAAllocatorConfig::parseArgs accepts (c10/cuda/CUDAAllocatorConfig.cpp, torch 2.11-2.14);
# memplan models expandable_segments and notes the others it does not.
ALLOC_CONF_KEYS = frozenset(
    {
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "backend",
        "graph_capture_record_stream_reuse",
        "per_process_memory_fraction",
        "large_segment_size_mb",
    }
)


ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: one per power of two from 1 MiB to 64 GiB
MIN_LARGE_ALLOC_MB = 10  # kMinLargeAlloc: requests from here on get segments of their own rounded size


@dataclass(frozen=True)
class AllocatorConfig:
    """PYTORCH_CUDA_ALLOC_CONF as far as memplan models it (defaults: the variable unset)."""

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None  # None: no limit (SIZE_MAX)
    max_non_split_rounding_bytes: int = LARGE_SEGMENT_BYTES
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float | None = None
    # torch 2.11+: the allocator's own cap, as torch.cuda.set_per_process_memory_fraction sets it: the
    # DeviceCachingAllocator's constructor calls setMemoryFraction with it, after which a segment past
    # `fraction * totalGlobalMem` is an out-of-memory (CUDACachingAllocator.cpp alloc_block). None: no cap.
    per_process_memory_fraction: float | None = None
    # torch 2.11+'s large_segment_size_mb (AcceleratorAllocatorConfig, kLargeBuffer before): the segment a
    # 1-10 MiB request gets (get_allocation_size), the large pool's expandable page (find_expandable_block),
    # and the floor of max_split_size_mb (parseMaxSplitSize).
    large_segment_bytes: int = LARGE_SEGMENT_BYTES

    def oversize(self, block_bytes: int) -> bool:
        return self.max_split_size_bytes is not None and block_bytes >= self.max_split_size_bytes

    def divisions_for(self, num_bytes: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions: the interval of the power of two
        at or below the size, counted from 1 MiB (anything smaller in the first)."""
        index = min(max(num_bytes.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]


DEFAULT_CONFIG = AllocatorConfig()  # no PYTORCH_CUDA_ALLOC_CONF


def _split_options(text: str) -> list[str]:
    """`key:value` items separated by commas outside brackets (roundup_power2_divisions takes lists)."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    if items and not items[-1].strip():
        items.pop()  # a trailing comma ends the list
    if any(not item.strip() for item in items):  # torch reads the comma as a key: "Unrecognized key ','"
        raise ValueError("an empty option (a comma where a key:value belongs)")
    return [item.strip() for item in items]


# Keys that take True or False (ConfigTokenizer::toBool: "Expected 'True' or 'False'").
_TRUE_OR_FALSE_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_background_threads",
        "graph_capture_record_stream_reuse",
    }
)
# What the native caching allocator's options become under backend:cudaMallocAsync: ignored, as torch ignores
# them there (CUDAAllocatorConfig::parseArgs warns "backend:cudaMallocAsync ignores max_split_size_mb,
# roundup_power2_divisions, and garbage_collect_threshold"; expandable segments are the native allocator's too).
_NATIVE_ONLY_OPTIONS = {
    "expandable_segments": "expandable_segments",
    "max_split_size_bytes": "max_split_size_mb",
    "max_non_split_rounding_bytes": "max_non_split_rounding_mb",
    "roundup_power2_divisions": "roundup_power2_divisions",
    "garbage_collection_threshold": "garbage_collection_threshold",
    "large_segment_bytes": "large_segment_size_mb",
}


def _check_noted_value(key: str, value: str) -> None:
    """The values torch refuses at start-up for the keys memplan notes without modelling."""
    if key in _TRUE_OR_FALSE_KEYS and value not in ("True", "False"):
        raise ValueError(f"{key} takes True or False, got {value!r}")
    if key == "backend" and value not in ("native", "cudaMallocAsync"):
        raise ValueError(f"backend is native or cudaMallocAsync, got {value!r}")
    if key == "pinned_num_register_threads":
        threads = _whole_number(key, value)
        if not power_of_two(threads) or threads > 128:
            raise ValueError(f"pinned_num_register_threads must be a power of 2 up to 128, got {threads}")


def _whole_number(key: str, value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"{key} takes a whole number, got {value!r}")
    return int(value)


def power_of_two(number: int) -> bool:
    return number > 0 and number & (number - 1) == 0


def _roundup_divisions(value: str) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: one number for every interval, or `[MB:divisions,...]` where
    the first entry also fills the intervals below it and `>` every one after the last."""
    if not value.startswith("["):
        divisions = _whole_number("roundup_power2_divisions", value)
        if not power_of_two(divisions):
            raise ValueError(f"roundup_power2_divisions must be a power of 2, got {divisions}")
        return (divisions,) * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise ValueError(f"roundup_power2_divisions list {value!r} has no closing ']'")
    table, first, last_index = [0] * ROUNDUP_INTERVALS, True, 0
    for entry in (part.strip() for part in value[1:-1].split(",")):
        boundary, separator, text = (piece.strip() for piece in entry.partition(":"))
        if not separator:
            raise ValueError(f"roundup_power2_divisions entry {entry!r} is not MB:divisions")
        divisions = _whole_number("roundup_power2_divisions", text)
        if divisions and not power_of_two(divisions):
            raise ValueError(f"roundup_power2_divisions must be a power of 2 or 0, got {divisions}")
        if boundary == ">":
            table[last_index + 1 :] = [divisions] * (ROUNDUP_INTERVALS - last_index - 1)
            continue
        megabytes = _whole_number("roundup_power2_divisions interval", boundary)
        if not power_of_two(megabytes):
            raise ValueError(f"roundup_power2_divisions intervals must be powers of 2 (MB), got {megabytes}")
        index = min(megabytes.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            table[:index] = [divisions] * index
            first = False
        table[index], last_index = divisions, index
    return tuple(table)


def parse_alloc_conf(text: str) -> tuple[AllocatorConfig, tuple[str, ...]]:
    """(what memplan models, the keys given that it does not) from a PYTORCH_CUDA_ALLOC_CONF value.

    Raises ValueError, with the reason, where torch's own parser would refuse the value.
    """
    options: dict[str, object] = {}
    unmodelled = []
    asynchronous = False  # backend:cudaMallocAsync
    for item in _split_options(text):
        key, separator, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not separator or not value:
            raise ValueError(f"{item!r} is not key:value")
        if key not in ALLOC_CONF_KEYS:
            raise ValueError(f"unknown option {key!r}; torch knows {', '.join(sorted(ALLOC_CONF_KEYS))}")
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"expandable_segments takes True or False, got {value!r}")
            options["expandable_segments"] = value == "True"
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            megabytes = _whole_number(key, value)
            field_name = "max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"
            options[field_name] = megabytes << 20
        elif key == "roundup_power2_divisions":
            options["roundup_power2_divisions"] = _roundup_divisions(value)
        elif key == "garbage_collection_threshold":
            try:
                threshold = float(value)
            except ValueError:
                raise ValueError(f"garbage_collection_threshold takes a number, got {value!r}") from None
            if not 0.0 < threshold < 1.0:
                raise ValueError(f"garbage_collection_threshold must be in (0.0, 1.0), got {value}")
            options["garbage_collection_threshold"] = threshold
        elif key == "per_process_memory_fraction":
            try:
                fraction = float(value)
            except ValueError:
                raise ValueError(f"per_process_memory_fraction takes a number, got {value!r}") from None
            if not 0.0 <= fraction <= 1.0:  # CUDAAllocatorConfig's parser: "set it in [0.0, 1.0]"
                raise ValueError(f"per_process_memory_fraction must be in [0.0, 1.0], got {value}")
            options["per_process_memory_fraction"] = fraction
        elif key == "large_segment_size_mb":
            megabytes = _whole_number(key, value)
            if megabytes <= MIN_LARGE_ALLOC_MB:  # parseLargeSegmentSize: "must be > kMinLargeAlloc / kMB"
                raise ValueError(f"large_segment_size_mb must be > {MIN_LARGE_ALLOC_MB} MB, got {megabytes}")
            options["large_segment_bytes"] = megabytes << 20
        else:
            _check_noted_value(key, value)
            if key == "backend":
                asynchronous = value == "cudaMallocAsync"
            if key != "backend" or asynchronous:
                unmodelled.append(key)
    # The split limits' floor is the large segment (parseMaxSplitSize, parseMaxNonSplitRoundingSize), whichever
    # order the keys come in.
    floor_mb = int(options.get("large_segment_bytes", LARGE_SEGMENT_BYTES)) >> 20  # type: ignore[call-overload]
    for key, field_name in (
        ("max_split_size_mb", "max_split_size_bytes"),
        ("max_non_split_rounding_mb", "max_non_split_rounding_bytes"),
    ):
        if field_name in options and int(options[field_name]) >> 20 < floor_mb:  # type: ignore[call-overload]
            raise ValueError(f"{key} too small, must be >= {floor_mb}")
    if asynchronous:
        for field_name, key in _NATIVE_ONLY_OPTIONS.items():
            if options.pop(field_name, None) is not None:
                unmodelled.append(f"{key} (ignored under backend:cudaMallocAsync, as torch ignores it)")
    return AllocatorConfig(**options), tuple(unmodelled)  # type: ignore[arg-type]
