"""The Python API's own arguments (fedsim.run, load, collect, plot_runs): a wrong type or value is a one-line
FedsimError before anything starts, never a TypeError from deep inside, a hang or a silent default."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

import fedsim
from fedsim.configure import load_config
from fedsim.errors import ConfigError, FedsimError
from fedsim.results.plots import plot_runs


@pytest.fixture
def cfg(tmp_path):
    return load_config(None, ["rounds=1", "runtime.backend=local", f"results.root={tmp_path / 'runs'}"])


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 10**9}, "workers must be an integer from 1 to 4096 (or None), got 1000000000"),
    ({"workers": 0}, "workers must be an integer from 1 to 4096 (or None), got 0"),
    ({"workers": -1}, "workers must be an integer from 1 to 4096 (or None), got -1"),
    ({"workers": "2"}, "workers must be an integer from 1 to 4096 (or None), got '2'"),
    ({"workers": True}, "workers must be an integer from 1 to 4096 (or None), got True"),
    ({"overrides": "rounds=2"}, "overrides: expected a list of 'key=value' strings, got 'rounds=2'"),
    ({"overrides": None}, "overrides: expected a list of 'key=value' strings, got None"),
    ({"overrides": [1]}, "overrides: expected a list of 'key=value' strings, got [1]"),
    ({"callbacks": None}, "callbacks must be a list of Callback objects, got None"),
    ({"backend": 1}, "backend must be 'local', 'ray' or a Backend, got 1"),
])
def test_bad_run_arguments_are_one_line_before_anything_starts(cfg, tmp_path, kwargs, message):
    with pytest.raises(ConfigError) as err:
        fedsim.run(cfg, **kwargs)
    assert str(err.value) == f"fedsim.run: {message}"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c, "rounds", "x"), "rounds: expected an integer, got 'x'"),
    (lambda c: setattr(c, "rounds", -1), "rounds: must be >= 1, got -1"),
    (lambda c: setattr(c.train, "lr", -1.0), "train.lr: must be > 0, got -1.0"),
    (lambda c: setattr(c, "data", None), "data: expected a mapping, got None"),
])
def test_a_run_config_changed_after_loading_is_checked_again(cfg, tmp_path, change, message):
    """A RunConfig's fields are plain attributes: one set in code is checked when the run starts, as a file's is."""
    changed = copy.deepcopy(cfg)
    change(changed)
    with pytest.raises(ConfigError, match=f"^{message}"):
        fedsim.run(changed)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value", [123, None, 1.5, b"/tmp", [1, 2]])
def test_load_collect_plot_and_resume_refuse_what_is_not_a_path(value):
    calls = [fedsim.load, fedsim.collect, plot_runs] + ([] if value is None else [lambda v: fedsim.run(resume=v)])
    for call in calls:  # resume=None is no resume at all
        with pytest.raises(FedsimError, match="expected a path"):
            call(value)


def test_collect_names_the_tables_it_has(tmp_path):
    with pytest.raises(ConfigError, match="^fedsim.collect: table must be 'rounds' or 'clients', got 'bogus'$"):
        fedsim.collect(tmp_path, table="bogus")  # type: ignore[arg-type]


def test_a_path_of_another_library_is_a_path(tmp_path):
    class Elsewhere:  # os.PathLike, as pathlib-like types of other libraries are
        def __fspath__(self) -> str:
            return str(tmp_path / "nothing")

    with pytest.raises(FedsimError, match=f"{tmp_path / 'nothing'}: not a fedsim run folder"):
        fedsim.load(Elsewhere())
    assert isinstance(fedsim.persist.storage.location(Elsewhere()), Path)


def test_a_file_given_as_a_run_folder_is_named_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("not a run\n")
    with pytest.raises(FedsimError, match=r"notes.txt: not a fedsim run folder \(a file, not a folder\)$"):
        fedsim.load(tmp_path / "notes.txt")
    with pytest.raises(FedsimError, match=r"nothing: not a fedsim run folder \(no such folder\)$"):
        fedsim.load(tmp_path / "nothing")
