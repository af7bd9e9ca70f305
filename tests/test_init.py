"""memplan's public names (memplan/__init__.py): each loads on first use, from the module it names."""

import importlib

import memplan


def test_every_public_name_loads_from_the_module_it_names():
    for name in memplan.__all__:
        value = getattr(memplan, name)  # an export pointing at a module that lacks the name raises here
        if name in memplan._EXPORTS:
            home = memplan._EXPORTS[name]
            assert getattr(importlib.import_module(home), name) is value
