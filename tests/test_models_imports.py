"""memplan.models.imports: a `package.module:name` that cannot be imported says what to fix."""

from __future__ import annotations

import sys

import pytest

from memplan.errors import ImportPathError
from memplan.models.imports import import_object


@pytest.mark.parametrize(
    ("source", "fix"),
    [
        (None, "check the name and PYTHONPATH"),  # no such module
        ("def step(model, batch optimizer):\n    pass\n", "at line 1"),
        ("import memplan_no_such_dependency\n", "it imports 'memplan_no_such_dependency', which is not installed here"),
        ("raise RuntimeError('configuration missing')\n", "the module raised this as it was imported: fix it there"),
    ],
)
def test_a_module_that_cannot_be_imported_says_what_to_fix(tmp_path, monkeypatch, source, fix):
    name = f"memplan_user_module_{abs(hash(source))}"
    if source is not None:
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)  # import_object searches the working directory first, as `python -m` does
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ImportPathError) as refused:
        import_object(f"{name}:step", "--step")
    message = str(refused.value)
    assert message.startswith(f"cannot import module {name!r} for --step '{name}:step'")
    assert fix in message and "PYTHONPATH" not in message.replace(fix, "")
    sys.modules.pop(name, None)
