"""Hostile config values and data files: each is one line `fedsim: error: ...` naming the key or file, exit 2,
no traceback, no hang, and no run folder left behind. CLI cases run `python -m jobs.cli run` in a process forked
after the imports (tests/forked.py)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import typing
import zlib
from dataclasses import fields, is_dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedsim.config.schema import RunConfig, parse_override, read_yaml
from fedsim.configure import load_config
from fedsim.errors import ConfigError, DataError
from fedsim.method.contract import algorithm_names, get_algorithm
from tests.forked import run_module

TINY = """\
name: hostile
rounds: 1
data: {name: digits, num_clients: 4}
participation: {clients_per_round: 2}
runtime: {backend: local, num_workers: 1, threads: 1}
"""


def fedsim_run(tmp_path: Path, config: str | Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    """`fedsim run CONFIG` on the local backend with results under tmp_path/results; (process, results root)."""
    root = tmp_path / "results"
    path = config if isinstance(config, Path) else tmp_path / "config.yaml"
    if not isinstance(config, Path):
        path.write_text(config)
    args = ["run", str(path), "--quiet", "-o", "runtime.backend=local", "-o", f"results.root={root}"]
    for o in overrides:
        args += ["-o", o]
    return run_module("jobs.cli", args, timeout=300), root


def assert_one_line_error(proc: subprocess.CompletedProcess, root: Path, *fragments: str) -> str:
    """Exit 2, stderr is exactly one `fedsim: error:` line holding every fragment, and no run folder exists."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedsim: error: "), proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not root.exists() or not any(root.iterdir()), sorted(root.rglob("*"))
    return lines[0]


# ---------------------------------------------------------------- 1. empty and non-mapping files


def test_empty_config_file_is_an_error_naming_it(tmp_path):
    proc, root = fedsim_run(tmp_path, "")
    assert_one_line_error(proc, root, "config.yaml", "empty")


@pytest.mark.parametrize("text, fragment", [("# nothing but a comment\n\n", "empty"), ("null\n", "empty"),
                                            ("~\n", "empty"), ("[rounds, 5]\n", "expected a mapping"),
                                            ("just words\n", "expected a mapping")])
def test_files_without_a_mapping_are_refused(tmp_path, text, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"c\.yaml: .*{fragment}"):
        read_yaml(path)


# ---------------------------------------------------------------- 2. duplicate keys


def test_duplicate_key_in_a_file_names_key_and_line(tmp_path):
    text = TINY + "train:\n  lr: 0.1\n  epochs: 1\n  lr: 0.2\n"
    proc, root = fedsim_run(tmp_path, text)
    line = text.splitlines().index("  lr: 0.2") + 1
    assert_one_line_error(proc, root, "config.yaml", f"line {line}", "duplicate key 'lr'",
                          f"first at line {line - 2}")


def test_duplicate_keys_in_overrides_and_top_level(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'train=\{lr: 1, lr: 2\}': duplicate key 'lr'"):
        load_config(None, ["train={lr: 1, lr: 2}"])
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 3\nseed: 1\nrounds: 4\n")
    with pytest.raises(ConfigError, match=r"c\.yaml line 3: duplicate key 'rounds' \(first at line 1\)"):
        read_yaml(path)
    path.write_text("base: &b {lr: 0.1}\ntrain: {<<: *b, lr: 0.2}\n")  # a merge key overridden is no duplicate
    assert read_yaml(path)["train"] == {"lr": 0.2}


# ---------------------------------------------------------------- 3. floats as people write them


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("5E4", 5e4), (".5", 0.5), ("-.5", -0.5), ("-2e+1", -20.0),
                                         ("1.0e5", 1e5), ("+3.", 3.0), ("12", 12), ("0x10", 16), ("1e", "1e"),
                                         ("'1e-3'", "1e-3"), ("1.2.3", "1.2.3")])
def test_override_values_parse_yaml12_floats(text, value):
    _, parsed = parse_override(f"x={text}")
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text, value", [("1:30", "1:30"), ("1:30.5", "1:30.5"), ("010", 10), ("0o17", 15),
                                         ("0x1F", 31), ("1_000", 1000), ("0x_", "0x_"), ("1_", "1_"), ("1__0", "1__0"),
                                         ("1._5", "1._5"), ("0b101", "0b101"),
                                         ("no", "no"), ("yes", "yes"), ("on", "on"), ("off", "off"),
                                         ("TRUE", True), ("false", False), ("~", None), ("null", None),
                                         ("2026-01-02", "2026-01-02")])
def test_yaml11_quirks_do_not_change_what_a_value_means(tmp_path, text, value):
    """YAML 1.1 reads `1:30` as 90, `010` as 8, `no` as False and `2026-01-02` as a date: values the writer did not
    mean. They resolve as in YAML 1.2's core schema instead, in overrides and in files alike."""
    _, parsed = parse_override(f"x={text}")
    path = tmp_path / "c.yaml"
    path.write_text(f"x: {text}\n")
    assert parsed == value and type(parsed) is type(value)
    assert read_yaml(path)["x"] == value and type(read_yaml(path)["x"]) is type(value)


@pytest.mark.parametrize("text", ["09", "0819", "+09", "0o17", "0x1F", "1_000", "yes", "no", "on", "1:30", "1e-3",
                                  "2026-01-02", "null", "~", "true", ".inf", "plain"])
def test_a_saved_config_reads_back_the_same_under_either_yaml_rules(tmp_path, text):
    """A run's config.yaml is read again on --resume (YAML 1.2 rules) and by other tools (PyYAML's 1.1): text that
    either would take for a number, a boolean or null is written quoted."""
    from fedsim.configure import save_config

    cfg = load_config(None, [f"name={json.dumps(text)}", f"results.run_id={json.dumps(text)}"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert (again.name, again.results.run_id) == (text, text)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["name"] == text


def test_a_base60_looking_round_count_is_refused_not_read_as_90(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 1:30\n")
    for config, overrides in ((None, ["rounds=1:30"]), (path, [])):
        with pytest.raises(ConfigError, match=r"rounds: expected an integer, got '1:30'"):
            load_config(config, overrides)


@pytest.mark.parametrize("override, message", [
    ("rounds=" + "9" * 5000, r"^override 'rounds=9{49}\.\.\.: a number of 5,000 digits$"),
    ("rounds=0x" + "f" * 5000, r"^rounds: must be <= 1000000, got an integer of 20,000 bits$"),
    ("x" * 5000 + "=1", r"^x{97}\.\.\.: unknown key; valid keys are \["),
])
def test_absurdly_long_overrides_are_one_short_line(override, message):
    """Python refuses to print integers past 4,300 digits, and a message echoing a 5,000-character key is no
    longer a line anyone reads."""
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [override])
    assert len(str(info.value)) < 400


def test_a_50_mb_config_is_refused_at_once_naming_the_size_limit(tmp_path):
    """One long list used to be built for 4 minutes and 4.8 GB, then refused for its "aliases"."""
    import time

    path = tmp_path / "huge.yaml"
    with path.open("w") as fh:
        fh.write(TINY + "model:\n  options:\n    widths: [")
        fh.write("1, " * (50 * 2**20 // 3))
        fh.write("1]\n")
    assert path.stat().st_size > 50 * 2**20
    t0 = time.perf_counter()
    proc, root = fedsim_run(tmp_path, path)  # forked after the imports: the time is the refusal's own
    took = time.perf_counter() - t0
    assert_one_line_error(proc, root, f"{path}: larger than 1 MiB, the most a config file may hold "
                                      "(fedsim.config.limits.MAX_CONFIG_BYTES)")
    assert took < 10, took  # 0.2 s here: the file is never read past its first MiB


ALIASES = "".join(f"{a}: &{a} [{', '.join([f'*{b}'] * 10)}]\n" for a, b in zip("bcdef", "abcde"))
VALUES = ("more than 20,000 values, aliases expanded (fedsim.config.limits.MAX_CONFIG_VALUES); a config holds a few "
          "hundred")


@pytest.mark.parametrize("text, line, message", [
    ("x: [" + "1, " * 30_000 + "1]\n", 1, VALUES),
    ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + ALIASES, 5, VALUES),  # 10^5 values at e, from 38 bytes
    ("x: " + "[" * 101 + "]" * 101 + "\n", 1,
     "nested more than 100 levels deep (fedsim.config.limits.MAX_CONFIG_DEPTH)"),
])
def test_a_config_too_large_once_parsed_is_refused_before_anything_is_built(tmp_path, monkeypatch, text, line,
                                                                            message):
    """Counted from the parser's events: no value is constructed (the long list took 29 s at 10 MB)."""
    import fedsim.config.yaml_dialect

    path = tmp_path / "c.yaml"
    path.write_text(text)
    monkeypatch.setattr(fedsim.config.yaml_dialect.StrictLoader, "construct_document", lambda *a: pytest.fail("built"))
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert str(err.value) == f"{path} line {line}: {message}"
    if text.startswith("x: "):  # the same value as an override
        with pytest.raises(ConfigError) as err:
            load_config(None, ["model.options.widths=" + text[3:].strip()])
        assert str(err.value).startswith("override 'model.options.widths=") and str(err.value).endswith(message)


def test_exponent_floats_work_in_files_overrides_and_int_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n  weight_decay: 5E-4\n  epochs: 2e1\nalgorithm: {name: fedprox, mu: .5}\n")
    cfg = load_config(path, ["train.momentum=5e-1", "eval.batch_size=1e2"])
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.momentum) == (1e-3, 5e-4, 0.5)
    assert cfg.algorithm.params.mu == 0.5
    assert cfg.train.epochs == 20 and type(cfg.train.epochs) is int
    assert cfg.eval.batch_size == 100 and type(cfg.eval.batch_size) is int
    with pytest.raises(ConfigError, match=r"train.epochs: expected an integer, got 2.5"):
        load_config(None, ["train.epochs=2.5e0"])


@pytest.mark.slow
def test_a_run_with_exponent_floats_records_them_as_numbers(tmp_path):
    proc, root = fedsim_run(tmp_path, TINY + "train: {lr: 1e-3, epochs: 1e0}\n", "train.weight_decay=1E-4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = root.iterdir()
    train = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (train["lr"], train["weight_decay"], train["epochs"]) == (1e-3, 1e-4, 1)


# ---------------------------------------------------------------- 4. ranges: bounds and finiteness


def _knobs(cls: type, prefix: str) -> list[tuple[str, typing.Any, dict]]:
    """(dotted key, type, metadata) of every leaf knob of a config dataclass."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if not f.init or f.name == "params":
            continue
        key, tp = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
        out += _knobs(tp, key) if is_dataclass(tp) else [(key, tp, dict(f.metadata))]
    return out


def _all_knobs() -> list[tuple[str, str, typing.Any, dict]]:
    """(algorithm, key, type, metadata) for RunConfig and every algorithm's parameters."""
    rows = [("fedavg", k, t, m) for k, t, m in _knobs(RunConfig, "")]
    for name in algorithm_names():
        rows += [(name, k, t, m) for k, t, m in _knobs(get_algorithm(name).Params, "algorithm")]
    return rows


def _is(tp: typing.Any, base: type) -> bool:
    return tp is base or base in typing.get_args(tp) or any(_is(a, base) for a in typing.get_args(tp))


def test_every_int_knob_has_an_upper_bound_in_its_doc():
    from fedsim.config.knobs import describe
    from fedsim.method.contract import get_algorithm

    unbounded = [(a, k) for a, k, tp, m in _all_knobs()
                 if _is(tp, int) and m.get("le") is None and m.get("lt") is None]
    assert unbounded == []
    docs = {k: doc for k, _, _, doc in describe(RunConfig)}
    assert "<= 10000" in docs["train.epochs"] and "<= 1000000" in docs["rounds"]
    assert "<= 100000000" in docs["data.num_clients"]
    dosfl = {k: doc for k, _, _, doc in describe(get_algorithm("dosfl").Params, "algorithm")}
    assert "<= 10000" in dosfl["algorithm.distill_steps"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_every_float_knob_refuses_non_finite_values(value):
    floats = [(a, k) for a, k, tp, m in _all_knobs()
              if _is(tp, float) and typing.get_origin(tp) is not list and not m.get("nonfinite")]
    assert len(floats) > 60
    for algo, key in floats:
        with pytest.raises(ConfigError, match=rf"{key}: must be a finite number"):
            load_config(None, [f"algorithm.name={algo}", f"{key}={value}"])


@pytest.mark.parametrize("override, fragment", [
    ("train.epochs=1e12", "train.epochs: must be <= 10000"),
    ("rounds=1e12", "rounds: must be <= 1000000"),
    ("data.num_clients=1e12", "data.num_clients: must be <= 100000000"),
    ("train.steps=1e12", "train.steps: must be <= 1000000"),
    ("train.batch_size=1e12", "train.batch_size: must be <= 1000000"),
    ("runtime.num_workers=0", "runtime.num_workers: must be >= 1"),
    ("runtime.threads=1e12", "runtime.threads: must be <= 1024"),
    ("eval.every=1e12", "eval.every: must be <= 1000000"),
    ("results.checkpoint_every=1e12", "results.checkpoint_every: must be <= 1000000"),
    ("seed=1e12", "seed: must be <= 4294967295"),
    ("stragglers.speed.mean=0", "stragglers.speed.mean: must be > 0"),
    ("stragglers.bandwidth_mbps.mean=-1", "stragglers.bandwidth_mbps.mean: must be > 0"),
    ("participation.availability=5", "participation.availability: must be <= 1"),
    ("stragglers.deadline_value=5", "stragglers.deadline_value: with deadline: quantile it is a quantile in (0, 1]"),
    ("train.lr=1" + "0" * 400, "train.lr: 1000"),
])
def test_out_of_range_values_name_the_key_and_range(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("algo, override, fragment", [
    ("dosfl", "algorithm.distill_steps=1e12", "algorithm.distill_steps: must be <= 10000"),
    ("single_image", "algorithm.pool_size=1e12", "algorithm.pool_size: must be <= 10000000"),
    ("feddf", "algorithm.distill.steps=1e12", "algorithm.distill.steps: must be <= 1000000"),
    ("fedgdkd", "algorithm.kd_size=1e12", "algorithm.kd_size: must be <= 10000000"),
    ("fd_faug", "algorithm.disc_widths=[8, 1e12]", "algorithm.disc_widths[1]: must be <= 4096"),
    ("fd_faug", "algorithm.gen_betas=[0.5, .nan]", "algorithm.gen_betas[1]: must be a finite number"),
    ("dafkd", "algorithm.noise_dim=1e12", "algorithm.noise_dim: must be <= 65536"),
])
def test_method_knobs_are_bounded(algo, override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [f"algorithm.name={algo}", override])


def test_only_quantile_deadlines_are_limited_to_one():
    assert load_config(None, ["stragglers.deadline=fixed", "stragglers.deadline_value=30"]).stragglers.deadline_value \
        == 30.0
    assert load_config(None, ["stragglers.deadline_value=1"]).stragglers.deadline_value == 1.0


def test_an_epoch_count_that_would_run_forever_through_the_cli(tmp_path):
    proc, root = fedsim_run(tmp_path, TINY, "train.epochs=1e12")
    assert_one_line_error(proc, root, "train.epochs: must be <= 10000, got 1000000000000")


# ---------------------------------------------------------------- 5. loader and builder options


def test_data_option_of_the_wrong_type_through_the_cli(tmp_path):
    proc, root = fedsim_run(tmp_path, TINY, "data.options.size=abc")
    assert_one_line_error(proc, root, "data.options.size", "expected an integer", "'abc'")


@pytest.mark.parametrize("overrides, fragment", [
    (["data.options.sise=8"], "data.options.sise: not an option of dataset 'digits'; its options are ['size']"),
    (["data.options.size=1e12"], "data.options.size: must be <= 256"),
    (["data.options=[1]"], "data.options: expected a mapping"),
    (["data.name=synthetic", "data.options.n_train=1e12"], "data.options.n_train: must be <="),
    (["data.name=synthetic", "data.options.amp=.inf"], "data.options.amp: must be a finite number"),
    (["data.name=npz", "data.options.num_classes=abc"], "data.options.num_classes: expected an integer"),
    (["data.name=subsample", "data.options={of: digits, options: {size: x}}"], "data.options.options.size"),
    (["data.name=nope"], "data.name: unknown dataset 'nope'"),
    (["model.options.widht=3"], "model.options.widht: not an option of model 'cnn'; its options are []"),
    (["model.name=mlp", "model.options.hidden=abc"], "model.options.hidden: expected an integer"),
    (["model.name=wrn16_4", "model.options.dropout=.nan"], "model.options.dropout: must be a finite number"),
    (["model.name=resnet9"], "model.name: unknown architecture 'resnet9'"),
    (["data.num_clients=4", "model.mix={cnn: 2, mpl: 2}"], "model.mix: unknown architecture 'mpl'"),
])
def test_loader_and_builder_options_are_checked_against_their_signatures(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert fragment in str(info.value)


def test_options_are_converted_to_their_declared_types():
    cfg = load_config(None, ["data.options.size=1.6e1", "model.name=mlp", "model.options={hidden: 1e2, layers: 3}"])
    assert cfg.data.options == {"size": 16} and type(cfg.data.options["size"]) is int
    assert cfg.model.options == {"hidden": 100, "layers": 3}


# ---------------------------------------------------------------- 6. npz arrays


def _npz(path: Path, **changes: np.ndarray) -> Path:
    x, y = np.random.default_rng(0).random((40, 8, 8), dtype=np.float32), np.arange(40) % 4
    arrays = {"x_train": x, "y_train": y, "x_test": x[:10], "y_test": y[:10], **changes}
    np.savez(path, **arrays)
    return path


def test_a_huge_label_in_an_npz_file_through_the_cli(tmp_path):
    y = np.arange(40) % 4
    y[7] = 10**9
    file = _npz(tmp_path / "big_label.npz", y_train=y)
    proc, root = fedsim_run(tmp_path, TINY, "data.name=npz", f"data.options.path={file}")
    assert_one_line_error(proc, root, str(file), "y_train", "1000000000", "below 100,000")


@pytest.mark.parametrize("change, fragment", [
    ({"y_train": -(np.arange(40) % 4)}, "y_train has a negative class id"),
    ({"y_test": np.full(10, 0.5)}, "y_test must hold whole-number class ids; entry 0 is 0.5"),
    ({"y_train": np.r_[np.zeros(39), np.nan]}, "y_train must hold whole-number class ids; entry 39 is nan"),
    ({"y_train": np.r_[np.zeros(39), 99]}, "y_train has class id 99, but there are only 50 samples"),
    ({"y_train": np.array(["a"] * 40)}, "y_train must hold integer class ids"),
    ({"y_train": np.zeros((40, 2))}, "y_train must be 1-d class ids"),
    ({"y_test": np.zeros(9, int)}, "x_test has 10 samples but y_test has 9"),
    ({"x_train": np.zeros((40, 64))}, "x_train must be real numbers N×H×W or N×H×W×C"),
    ({"x_train": np.full((40, 8, 8), np.nan)}, "x_train contains NaN or infinite values"),
    ({"x_train": np.full((40, 8, 8), "a")}, "x_train must be real numbers"),
    ({"x_train": np.zeros((40, 8, 8), complex)}, "x_train must be real numbers"),
    ({"x_test": np.array([{"pickled": 1}] * 10, dtype=object)},  # was "could not read ... allow_pickle=False"
     "x_test holds Python objects (dtype object), not numbers: fedsim reads numeric arrays only"),
    ({"x_test": np.zeros((0, 8, 8), np.float32), "y_test": np.zeros(0, int)},  # named neither the file nor x_test
     "x_test holds no samples (shape (0, 8, 8))"),
])
def test_npz_arrays_are_checked(tmp_path, change, fragment):
    from fedsim.data import load_dataset

    file = _npz(tmp_path / "d.npz", **change)
    with pytest.raises(DataError) as info:
        load_dataset("npz", tmp_path, path=str(file))
    assert fragment in str(info.value) and str(file) in str(info.value)


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.write_bytes(bytes(range(256)) * 16), "not an .npz archive (a zip of .npy arrays"),  # numpy's advice
    (lambda p: p.mkdir(), "a folder, not a file (data.options.path)"),  # was "file not found"
])
def test_a_path_that_is_no_npz_file_is_named_without_unsafe_advice(tmp_path, make, fragment):
    """numpy takes a file that is no zip for a pickle, and its error advised loading it with allow_pickle."""
    from fedsim.data import load_dataset

    file = tmp_path / "d.npz"
    make(file)
    for name in ("npz", "text_npz"):
        with pytest.raises(DataError) as info:
            load_dataset(name, tmp_path, path=str(file))
        assert str(info.value).startswith(f"{name}: {file}: ") and fragment.split(" (data")[0] in str(info.value)
        assert "pickle" not in str(info.value)
    with pytest.raises(DataError, match=f"^npz: {file}: {re.escape(fragment)}"):
        load_dataset("npz", tmp_path, path=str(file))


# ---------------------------------------------------------------- 7. the single image


def _png(path: Path, width: int, height: int) -> Path:
    """A black 1-bit PNG written by hand: a 14000×14000 one is 24 KB on disk."""
    row = b"\x00" * (1 + (width + 7) // 8)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(row * height, 9))
                     + chunk(b"IEND", b""))
    return path


def test_a_decompression_bomb_image_through_the_cli(tmp_path):
    image = _png(tmp_path / "big.png", 14000, 14000)
    assert image.stat().st_size < 100_000
    proc, root = fedsim_run(tmp_path, TINY, "algorithm.name=single_image", f"algorithm.image={image}",
                            "algorithm.pool_size=100")
    assert_one_line_error(proc, root, str(image), "196.0 megapixels", "the limit is 100 megapixels")


def test_corrupt_and_oversized_images_are_data_errors(tmp_path):
    from PIL import Image

    from fedsim.data.single_image import load_image

    assert load_image(str(_png(tmp_path / "small.png", 20, 10))).shape == (10, 20, 3)
    with pytest.raises(DataError, match=r"11000×10000 pixels \(110.0 megapixels\) is too large; the limit is 100"):
        load_image(str(_png(tmp_path / "wide.png", 11000, 10000)))  # under PIL's own limit: fedsim's fires
    Image.new("RGB", (64, 64), (10, 200, 30)).save(tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"junk" * 40)
    (tmp_path / "text.png").write_text("not an image")
    for name in ("cut.png", "junk.png", "text.png"):
        with pytest.raises(DataError, match=rf"{name}'.*cannot be read as an image"):
            load_image(str(tmp_path / name))


# ---------------------------------------------------------------- 8. device traces


def test_text_in_a_trace_speed_column_through_the_cli(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth_mbps\n0,1,10\n1,fast,10\n2,1,10\n3,1,10\n")
    proc, root = fedsim_run(tmp_path, TINY, f"stragglers.trace={trace}", "stragglers.enabled=true")
    assert_one_line_error(proc, root, str(trace), "column speed, row 2", "'fast'")


@pytest.mark.parametrize("rows, fragment", [
    ("0,1,10\n1,1,10\n1,2,10\n2,1,10\n", "column client, row 3: client 1 appears more than once"),
    ("0,1,10\n2,1,10\n", "column client: no row for client 1"),
    ("0,1,10\n1.5,1,10\n2,1,10\n", "column client, row 2: '1.5' is not a client id"),
    ("0,1,10\n1,nan,10\n2,1,10\n", "column speed, row 2: 'nan' is not a number in [1e-06, 1e+06]"),
    ("0,1,10\n1,,10\n2,1,10\n", "column speed, row 2: '' is not a number in [1e-06, 1e+06]"),
    ("0,1,10\n1,0,10\n2,1,10\n", "column speed, row 2: '0' is not a number in [1e-06, 1e+06]"),
    ("0,1,10\n1,1e-308,10\n2,1,10\n", "column speed, row 2: '1e-308' is not a number in [1e-06, 1e+06]"),
    ("0,1e308,10\n1,1,10\n2,1,10\n", "column speed, row 1: '1e308' is not a number in [1e-06, 1e+06]"),
    ("0,1,1e-308\n1,1,10\n2,1,10\n", "column bandwidth_mbps, row 1: '1e-308' is not a number in [1e-06, 1e+09]"),
    ("0,1,10\n1,1,-3\n2,1,10\n", "column bandwidth_mbps, row 2: '-3' is not a number in [1e-06, 1e+09]"),
    ("0,1,10\n1,1,inf\n2,1,10\n", "column bandwidth_mbps, row 2: 'inf' is not a number in [1e-06, 1e+09]"),
    ("0,1,10,1\n1,1,10,5\n2,1,10,1\n", "column availability, row 2: '5' is not a number in (0, 1]"),
    ("0,1,10,0\n1,1,10,1\n2,1,10,1\n", "column availability, row 1: '0' is not a number in (0, 1]"),
    ("0,1,10\n1,1,10,4,4\n2,1,10\n", "cannot read"),
])
def test_trace_rows_are_checked(tmp_path, make_config, rows, fragment):
    from fedsim.runtime.clock import make_profiles

    trace = tmp_path / "trace.csv"
    header = "client,speed,bandwidth_mbps" + (",availability" if rows.split("\n")[0].count(",") == 3 else "")
    trace.write_text(header + "\n" + rows)
    with pytest.raises(DataError) as info:
        make_profiles(make_config(f"stragglers.trace={trace}", "data.num_clients=3",
                                  "participation.clients_per_round=2"))
    assert fragment in str(info.value) and str(trace) in str(info.value) and "\n" not in str(info.value)


def _two_clients(tmp_path, make_config, text: str):
    """The profiles of two clients from a trace file holding `text`, and the file."""
    from fedsim.runtime.clock import make_profiles

    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    return make_profiles(make_config(f"stragglers.trace={trace}", "data.num_clients=2",
                                     "participation.clients_per_round=2")), trace


def test_a_trace_with_a_column_twice_is_refused(tmp_path, make_config):
    """pandas would read the first `speed` and rename the second: the run would use one the writer may not mean."""
    with pytest.raises(DataError, match=f"^stragglers.trace: {tmp_path / 'trace.csv'} has the column 'speed' twice$"):
        _two_clients(tmp_path, make_config, "client,speed,bandwidth_mbps, speed\n0,1,10,0.001\n1,1,10,0.001\n")


def test_a_good_trace_ignores_rows_of_other_clients(tmp_path, make_config):
    prof, _ = _two_clients(tmp_path, make_config,
                           "client,speed,bandwidth_mbps,availability\n1, 2.5 ,8,0.5\n0,1e-1,16,1\n9,-1,0,7\n")
    np.testing.assert_allclose(prof.speed, [0.1, 2.5])
    np.testing.assert_allclose(prof.bandwidth, [2e6, 1e6])
    np.testing.assert_allclose(prof.availability, [1.0, 0.5])


def test_a_trace_may_repeat_the_columns_it_does_not_read(tmp_path, make_config):
    """A spreadsheet's export ends its header with empty columns, and notes may repeat: fedsim reads neither."""
    prof, _ = _two_clients(tmp_path, make_config,
                           "client,speed,bandwidth_mbps,note,note,,\n0,1,8,a,b,,\n1,2,16,c,d,,\n")
    np.testing.assert_allclose(prof.speed, [1.0, 2.0])


# ---------------------------------------------------------------- 9. run folder names


def test_run_id_cannot_leave_the_results_folder(tmp_path):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    proc, root = fedsim_run(work, TINY, "results.run_id=../../escaped")
    assert_one_line_error(proc, root, "results.run_id", "'../../escaped'", "path separator")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "config.yaml"]


@pytest.mark.parametrize("override, fragment", [
    ("results.run_id=.", "results.run_id: '.' is not a folder name"),
    ("results.run_id=..", "results.run_id: '..' is not a folder name"),
    ("results.run_id=''", "results.run_id: '' is empty"),
    ("results.run_id=/tmp/elsewhere", "results.run_id: '/tmp/elsewhere' contains a path separator"),
    ("results.run_id=a\\b", "contains a path separator"),
    ("results.run_id=" + "x" * 300, "results.run_id: 'xxx"),
    ("name=../up", "name: '../up' contains a path separator"),
    ("name=' '", "name: ' ' is empty"),
    ('name="tab\\there"', "must be printable text"),
])
def test_folder_names_are_checked(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert fragment in str(info.value)
    assert load_config(None, ["results.run_id=my-run_01", "name=exp 1"]).results.run_id == "my-run_01"


def test_an_explicit_int_tag_on_text_names_the_text():
    with pytest.raises(ConfigError, match=r"^override 'rounds=!!int abc': 'abc' is not an integer$"):
        load_config(None, ["rounds=!!int abc"])


# ---------------------------------------------------------------- 10. memory: estimated before it is allocated


class _TwentyGB(torch.nn.Module):
    """A plugin's model with one 20 GB layer (5·10^9 float32 weights)."""

    def __init__(self, **kw) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(100_000, 50_000)


@pytest.mark.parametrize("overrides, shape, message", [
    (["model.name=mlp", "model.options.hidden=65536"], (1, 8, 8),
     "model.options {'hidden': 65536}: model 'mlp' for inputs 1×8×8 has 4,299,948,042 parameters (17.2 GB); a run "
     "holds about 4 copies (68.8 GB), more than the 16.0 GB of memory available here"),
    (["model.name=cnn"], (1, 14000, 14000),  # a 14000×14000-image npz: the head sees 64·6998² inputs
     "model.name: model 'cnn' for inputs 1×14000×14000 has 401,178,677,002 parameters (1.6 TB); a run holds about "
     "4 copies (6.4 TB)"),
    (["model.name=twenty_gb"], (3, 32, 32), "model 'twenty_gb' for inputs 3×32×32 has 5,000,050,000 parameters "
                                            "(20.0 GB)"),
])
def test_a_model_this_machine_cannot_hold_is_refused_before_it_is_built(isolated, monkeypatch, overrides, shape,
                                                                        message):
    """Estimated on the meta device, which allocates nothing; these printed 34-47-line allocator tracebacks."""
    import fedsim.memory
    import fedsim.models.size
    from fedsim.models.registry import register_model

    register_model("twenty_gb")(lambda **kw: _TwentyGB())
    monkeypatch.setattr(fedsim.memory, "available_bytes", lambda: 16 * 10**9)
    with pytest.raises(ConfigError) as err:
        fedsim.models.size.check_models(load_config(None, overrides), shape, 10, trains_here=True)
    assert message in str(err.value)
    fedsim.models.size.check_models(load_config(None, ["model.name=cnn"]), (1, 8, 8), 10, trains_here=True)  # fits


def test_a_run_whose_model_does_not_fit_stops_before_the_folder_is_written(tmp_path, monkeypatch, capsys):
    import fedsim.memory
    from jobs.cli import main

    monkeypatch.setattr(fedsim.memory, "available_bytes", lambda: 100 * 10**6)
    (tmp_path / "c.yaml").write_text(TINY + "model: {name: mlp, options: {hidden: 4096}}\n")
    assert main(["run", str(tmp_path / "c.yaml"), "--quiet", "-o", f"results.root={tmp_path / 'results'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim: error: model.options {'hidden': 4096}: model 'mlp' for "
                                                   "inputs 1×8×8 has 17,088,522 parameters (68.4 MB); a run holds "
                                                   "about 4 copies (273.4 MB), more than the 100.0 MB"), err
    assert not (tmp_path / "results").exists()


def _big_images_npz(path: Path, side: int) -> Path:
    """An npz of one train and one test uint8 image side×side, compressed (the zeros take kilobytes), written without
    ever holding an image in memory."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for key in ("x_train", "x_test"):
            with z.open(f"{key}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False,
                                                         "shape": (1, side, side)})
                row = bytes(side)
                for _ in range(side):
                    f.write(row)
        for key in ("y_train", "y_test"):
            with z.open(f"{key}.npy", "w") as f:
                np.lib.format.write_array(f, np.zeros(1, np.int64))
    return path


def test_an_npz_of_huge_images_is_one_line_through_the_cli(tmp_path):
    """4000×4000 images (the issue's 14000² ones take longer to write): the CNN's head would hold 131 GB, which
    torch tried to allocate."""
    file = _big_images_npz(tmp_path / "big.npz", 4000)
    assert file.stat().st_size < 1_000_000
    proc, root = fedsim_run(tmp_path, TINY, "data.name=npz", f"data.options.path={file}")
    assert_one_line_error(proc, root, "model.name: model 'cnn' for inputs 1×4000×4000 has 32,702,515,841 parameters "
                                      "(130.8 GB)")


def test_an_npz_whose_arrays_would_not_fit_is_refused_from_its_headers(tmp_path, monkeypatch):
    import fedsim.memory
    from fedsim.data import load_dataset

    file = _big_images_npz(tmp_path / "big.npz", 2000)
    monkeypatch.setattr(fedsim.memory, "available_bytes", lambda: 10 * 10**6)
    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", lambda *a: pytest.fail("decoded"))
    with pytest.raises(DataError) as err:
        load_dataset("npz", tmp_path, path=str(file))
    assert str(err.value) == (f"npz: {file}: its arrays take about 40.0 MB once decoded (x_train 1×2000×2000 uint8, "
                              "x_test 1×2000×2000 uint8, as float32 images), more than the 10.0 MB of memory "
                              "available here (data.options.path)")
