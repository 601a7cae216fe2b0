"""The suite's `--part I/N` option (tests/conftest.py): N fixed parts that
together hold every collected test exactly once."""
import types

import pytest

import conftest


def _run(spec, ids):
  items = [types.SimpleNamespace(nodeid=i) for i in ids]
  dropped = []
  config = types.SimpleNamespace(
      getoption=lambda name: spec,
      hook=types.SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
  conftest._select_part(config, items)
  return [i.nodeid for i in items], [i.nodeid for i in dropped]


def test_parts_cover_every_test_once():
  ids = [f"tests/test_x.py::test_{k}[p{k % 7}]" for k in range(500)]
  parts = [_run(f"{i}/3", ids)[0] for i in range(3)]
  assert sorted(sum(parts, [])) == sorted(ids)
  assert all(len(p) > 100 for p in parts)  # a hash split, not all in one part
  # Fixed: the same part on every call (and so on every xdist worker).
  assert _run("1/3", ids)[0] == parts[1]
  kept, dropped = _run("0/3", ids)
  assert sorted(kept + dropped) == sorted(ids)


def test_no_part_keeps_everything():
  ids = ["a::b", "a::c"]
  assert _run(None, ids) == (ids, [])


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1", "a/b", "0/0"])
def test_bad_part_is_a_usage_error(spec):
  with pytest.raises(pytest.UsageError):
    _run(spec, ["a::b"])
