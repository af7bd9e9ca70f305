"""memplan.estimator.model_modules: each imported transformers modeling module is read once per finder, and read
again where it is another module under its name, or its namespace or a class it defines holds another object."""

from __future__ import annotations

import sys
from types import ModuleType

from memplan.estimator.model_modules import found_in_model_modules


def test_a_module_is_read_once_and_again_only_where_it_changed(monkeypatch):
    reads: list[str] = []

    def finder(name: str, module: ModuleType) -> list[str]:
        if not name.startswith("transformers.models.memplan_probe"):
            return []  # (the modeling modules this process has imported for real)
        reads.append(name)
        return [f"{name}:{value}" for key, value in vars(module).items() if key.startswith("marked")]

    first = ModuleType("transformers.models.memplan_probe_a")
    first.marked = 1
    monkeypatch.setitem(sys.modules, first.__name__, first)
    assert found_in_model_modules(finder) == [f"{first.__name__}:1"]
    assert found_in_model_modules(finder) == [f"{first.__name__}:1"]
    assert reads == [first.__name__]  # the second call read nothing

    second = ModuleType("transformers.models.memplan_probe_b")  # a family imported between two traces
    second.marked = 2
    monkeypatch.setitem(sys.modules, second.__name__, second)
    assert found_in_model_modules(finder) == [f"{first.__name__}:1", f"{second.__name__}:2"]
    assert reads == [first.__name__, second.__name__]

    first.marked_too = 3  # a name more: read again
    assert f"{first.__name__}:3" in found_in_model_modules(finder)
    reloaded = ModuleType(first.__name__)  # another module object under the name, with as many names
    for key, value in vars(first).items():
        if key.startswith("marked"):
            setattr(reloaded, key, value + 10)
    monkeypatch.setitem(sys.modules, first.__name__, reloaded)
    assert sorted(found_in_model_modules(finder)) == sorted(
        [f"{first.__name__}:11", f"{first.__name__}:13", f"{second.__name__}:2"]
    )
    assert reads == [first.__name__, second.__name__, first.__name__, first.__name__]


def test_a_name_or_a_class_attribute_rebound_after_the_first_read_is_read_again(monkeypatch):
    """The review's case: a library rebinds a class (or a class's static method) in a modeling module after import, the
    module keeping as many names."""
    reads: list[str] = []

    def finder(name: str, module: ModuleType) -> list[object]:
        if not name.startswith("transformers.models.memplan_probe"):
            return []
        reads.append(name)
        return [value.marked for value in vars(module).values() if isinstance(value, type) and hasattr(value, "marked")]

    module = ModuleType("transformers.models.memplan_probe_d")
    embedding = type("Embedding", (), {"marked": staticmethod(len), "__module__": module.__name__})
    module.Embedding = embedding
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert found_in_model_modules(finder) == [len]
    assert found_in_model_modules(finder) == [len]
    assert reads == [module.__name__]

    embedding.marked = staticmethod(abs)  # a class attribute rebound
    assert found_in_model_modules(finder) == [abs]
    assert reads == [module.__name__] * 2

    module.Embedding = type("Embedding", (), {"marked": staticmethod(max), "__module__": module.__name__})  # a name
    assert found_in_model_modules(finder) == [max]
    assert reads == [module.__name__] * 3


def test_a_cache_a_library_puts_on_a_model_class_after_the_first_trace_is_swapped_too(monkeypatch):
    """memplan.estimator.tensor_caches finds a transformers lru cache that a class's static method gets after the
    modules were first read (the review replaced DETR's build_sine_position_embedding so)."""
    from transformers.pytorch_utils import compile_compatible_method_lru_cache

    from memplan.estimator import tensor_caches

    module = ModuleType("transformers.models.memplan_probe_e")
    holder = type("SineEmbedding", (), {"__module__": module.__name__})
    module.SineEmbedding = holder
    monkeypatch.setitem(sys.modules, module.__name__, module)
    before = {id(cell) for cell in tensor_caches._cache_cells()}

    @compile_compatible_method_lru_cache(maxsize=1)
    def build(size: int) -> int:
        return size

    holder.build = staticmethod(build)
    code = build.__code__
    cell = build.__closure__[code.co_freevars.index("func_with_cache")]
    assert id(cell) not in before
    assert id(cell) in {id(found) for found in tensor_caches._cache_cells()}


def test_a_module_gone_from_sys_modules_is_let_go():
    """What was read of a module (the module, its values, what the finder found: a user's lru cache of tensors) is
    not kept once the module has left sys.modules (a notebook's reload, a test's cleanup)."""
    import gc
    import weakref

    def finder(name: str, module: ModuleType) -> list[object]:
        return [module.cache] if name == "transformers.models.memplan_probe_gone" else []

    class Cache:
        pass

    module = ModuleType("transformers.models.memplan_probe_gone")
    module.cache = Cache()
    cache = weakref.ref(module.cache)
    sys.modules[module.__name__] = module  # (not monkeypatch's setitem: its undo would keep the module)
    try:
        assert found_in_model_modules(finder) == [cache()]
    finally:
        del sys.modules[module.__name__]
    del module
    assert found_in_model_modules(finder) == []
    gc.collect()
    assert cache() is None
