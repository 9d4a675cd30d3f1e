"""The order in which the run hands files to its workers (tests/conftest.py): the longest first."""

from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent


def test_the_longest_files_exist_and_are_handed_out_first(pytestconfig):
    # tests/conftest.py as pytest loaded it (the name `conftest` alone may be another folder's conftest.py)
    conftest = next(p for p in pytestconfig.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) == str(ROOT / "tests" / "conftest.py"))
    missing = [name for name in conftest.LONGEST_FIRST if not (ROOT / name).is_file()]
    assert missing == [], f"renamed or removed: {missing} (the list in tests/conftest.py names them)"
    names = ["tests/api/test_api.py::a", "tests/test_determinism.py::b", "tests/api/test_api.py::c",
             "tests/model/test_decode_step.py::d", "tests/web/test_presets.py::e", "tests/test_determinism.py::f"]
    items = [SimpleNamespace(nodeid=name) for name in names]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.nodeid[-1] for item in items] == ["b", "f", "d", "a", "c", "e"]  # listed order, then as collected
    # and pytest-xdist hands out the files in that order (pytest.ini), not those with the most tests first
    assert pytestconfig.option.loadscopereorder is False
