"""TFF's HDF5 federated EMNIST / CIFAR-100 and Hugging Face copies (save_to_disk, Hub parquet, the datasets cache,
CSV), written here in their real on-disk layouts: counts, pixels, labels, natural client ids and names, bad files."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py", reason="h5py is in the tff extra")
pa = pytest.importorskip("pyarrow")

import pyarrow.parquet as pq  # noqa: E402
from PIL import Image  # noqa: E402

import fedsim  # noqa: E402
from fedsim.data import load_dataset  # noqa: E402
from fedsim.data.datasets import CIFAR100_STATS  # noqa: E402
from fedsim.data.letters import LETTERS, NUM_LETTERS, letter_ids  # noqa: E402
from jobs.cli import main  # noqa: E402
from tests.conftest import small_config  # noqa: E402

RNG = np.random.default_rng(7)


# ---------------------------------------------------------------- writers of the real formats


def write_h5(file: Path, clients: dict[str, dict[str, np.ndarray]]) -> Path:
    """TFF's HDF5ClientData layout: examples/<client_id>/<feature>, clients inserted in the order given."""
    with h5py.File(file, "w") as h5:
        examples = h5.create_group("examples")
        for client, features in clients.items():
            group = examples.create_group(client)
            for name, value in features.items():
                group[name] = value
    return file


def emnist_clients(sizes: dict[str, int], classes: int = 10) -> dict[str, dict[str, np.ndarray]]:
    return {c: {"pixels": RNG.random((n, 28, 28), dtype=np.float32),
                "label": RNG.integers(0, classes, n).astype(np.int32)} for c, n in sizes.items()}


def cifar_clients(sizes: dict[str, int]) -> dict[str, dict[str, np.ndarray]]:
    return {c: {"image": RNG.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                "label": RNG.integers(0, 100, n).astype(np.int64),
                "coarse_label": RNG.integers(0, 20, n).astype(np.int64)} for c, n in sizes.items()}


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


FEMNIST_INFO = {"features": {"image": {"_type": "Image"}, "writer_id": {"dtype": "string", "_type": "Value"},
                             "hsf_id": {"dtype": "int64", "_type": "Value"},
                             "character": {"names": [str(i) for i in range(62)], "_type": "ClassLabel"}}}


def femnist_table(images: np.ndarray, labels: list[int], writers: list[str]) -> pa.Table:
    """flwrlabs/femnist's columns: image (Image: struct of PNG bytes and path), writer_id, hsf_id, character (a
    ClassLabel of 62 names, stored as int64), with the `huggingface` schema metadata `datasets` writes."""
    image = pa.array([{"bytes": png(x), "path": None} for x in images],
                     type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"image": image, "writer_id": pa.array(writers, pa.string()),
                      "hsf_id": pa.array([0] * len(labels), pa.int64()), "character": pa.array(labels, pa.int64())})
    return table.replace_schema_metadata({"huggingface": json.dumps({"info": FEMNIST_INFO})})


def shakespeare_table(texts: list[str], nexts: list[str], speakers: list[str]) -> pa.Table:
    """flwrlabs/shakespeare's columns: character_id, x (text), y (the next character), all strings."""
    return pa.table({"character_id": speakers, "x": texts, "y": nexts})


def write_arrow_stream(file: Path, table: pa.Table) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def save_to_disk(folder: Path, splits: dict[str, pa.Table], info: dict | None = None) -> Path:
    """`DatasetDict.save_to_disk`'s layout: dataset_dict.json, and per split state.json, dataset_info.json and
    data-00000-of-00001.arrow (an Arrow IPC stream), as datasets 5.2 writes them."""
    folder.mkdir(parents=True)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for split, table in splits.items():
        write_arrow_stream(folder / split / "data-00000-of-00001.arrow", table)
        (folder / split / "state.json").write_text(json.dumps({
            "_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0", "_format_columns": None,
            "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}))
        (folder / split / "dataset_info.json").write_text(json.dumps(info or {"features": {}}))
    return folder


def run_one_round(tmp_path: Path, *overrides: str) -> Path:
    cfg = small_config(tmp_path, "data.num_clients=3", "data.partition.min_samples=2",
                       "participation.clients_per_round=2", *overrides, rounds=1)
    return fedsim.run(cfg, backend="local")


# ---------------------------------------------------------------- TFF


def test_tff_emnist_clients_in_sorted_order_with_their_own_test_samples(tmp_path: Path) -> None:
    train = emnist_clients({"f0102_33": 4, "f0007_10": 3, "f0050_2": 5})  # not inserted in sorted order
    test = emnist_clients({"f0050_2": 2, "f0007_10": 1, "f0102_33": 1})
    write_h5(tmp_path / "fed_emnist_digitsonly_train.h5", train)
    write_h5(tmp_path / "fed_emnist_digitsonly_test.h5", test)
    ds = load_dataset("tff_emnist", tmp_path)
    order = ["f0007_10", "f0050_2", "f0102_33"]
    assert ds.client_names == tuple(order) and ds.num_classes == 10
    raw = np.concatenate([train[c]["pixels"] for c in order])
    mean, std = raw.mean(), raw.std()
    assert ds.x_train.shape == (12, 1, 28, 28) and ds.x_train.dtype == np.float32
    np.testing.assert_allclose(ds.x_train[:, 0], (raw - mean) / std, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ds.y_train, np.concatenate([train[c]["label"] for c in order]))
    np.testing.assert_array_equal(ds.train_ids, [0] * 3 + [1] * 5 + [2] * 4)
    np.testing.assert_array_equal(ds.test_ids, [0, 1, 1, 2])
    np.testing.assert_array_equal(ds.y_test, np.concatenate([test[c]["label"] for c in order]))
    inverted = load_dataset("tff_emnist", tmp_path, invert=True)  # 1 - x, normalised: the same images negated
    np.testing.assert_allclose(inverted.x_train, -ds.x_train, atol=1e-5)
    assert inverted.mean[0] == pytest.approx(1 - mean, abs=1e-6)


def test_tff_emnist_all_characters_and_a_writer_missing_from_train(tmp_path: Path) -> None:
    write_h5(tmp_path / "fed_emnist_train.h5", emnist_clients({"a": 3, "b": 2}, classes=62))
    test = emnist_clients({"b": 1, "c": 2}, classes=62)
    test["b"]["label"][:] = 61
    write_h5(tmp_path / "fed_emnist_test.h5", test)
    ds = load_dataset("tff_emnist", tmp_path, only_digits=False)
    assert ds.num_classes == 62 and ds.y_test[0] == 61
    np.testing.assert_array_equal(ds.test_ids, [1, -1, -1])  # "c" wrote no training samples: central test only


def test_tff_cifar100_fine_and_coarse_labels_and_test_clients_apart(tmp_path: Path) -> None:
    train = cifar_clients({"2": 3, "10": 2, "0": 2})
    test = cifar_clients({"1": 2, "0": 1})
    write_h5(tmp_path / "fed_cifar100_train.h5", train)
    write_h5(tmp_path / "fed_cifar100_test.h5", test)
    ds = load_dataset("tff_cifar100", tmp_path)
    order = ["0", "10", "2"]  # sorted as strings, as TFF sorts its client ids
    assert ds.client_names == tuple(order) and ds.num_classes == 100
    images = np.concatenate([train[c]["image"] for c in order])
    mean, std = np.asarray(CIFAR100_STATS[0]), np.asarray(CIFAR100_STATS[1])
    expected = (images.transpose(0, 3, 1, 2) / 255.0 - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(ds.x_train, expected, atol=1e-5)
    np.testing.assert_array_equal(ds.y_train, np.concatenate([train[c]["label"] for c in order]))
    np.testing.assert_array_equal(ds.train_ids, [0, 0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(ds.test_ids, [-1, -1, -1])  # test client "0" is not training client "0"
    coarse = load_dataset("tff_cifar100", tmp_path, label="coarse")
    assert coarse.num_classes == 20
    np.testing.assert_array_equal(coarse.y_test, np.concatenate([test[c]["coarse_label"] for c in ["0", "1"]]))


def test_tff_datasets_train_one_round(tmp_path: Path) -> None:
    write_h5(tmp_path / "fed_emnist_digitsonly_train.h5", emnist_clients({f"w{i}": 8 for i in range(4)}))
    write_h5(tmp_path / "fed_emnist_digitsonly_test.h5", emnist_clients({f"w{i}": 2 for i in range(4)}))
    write_h5(tmp_path / "fed_cifar100_train.h5", cifar_clients({str(i): 8 for i in range(4)}))
    write_h5(tmp_path / "fed_cifar100_test.h5", cifar_clients({str(i): 2 for i in range(2)}))
    # each writer (client) one fedsim client; EMNIST's writers are scored on their own test samples
    for name, extra in (("tff_emnist", ["data.client_test=natural", "algorithm.name=fedper"]), ("tff_cifar100", [])):
        run_dir = run_one_round(tmp_path / name, f"data.name={name}", f"data.root={tmp_path}", "data.num_clients=4",
                                "data.partition.kind=natural_id", "data.val_fraction=0", *extra)
        res = fedsim.load(run_dir)
        clients = res["clients"].set_index("client")
        assert list(res["rounds"]["round"]) == [0] and (clients["samples"] == 8).all() and len(clients) == 2
        if name == "tff_emnist":
            assert (clients["test_samples"] == 2).all() and res["rounds"]["personal_accuracy_mean"].notna().all()


def test_hf_integer_client_ids_sort_as_numbers_as_flowers_natural_id_partitioner(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    table = femnist_table(RNG.integers(0, 256, (4, 28, 28), dtype=np.uint8), [1, 2, 3, 4], ["a"] * 4)
    table = table.append_column("wid", pa.array([10, 2, 1, 2], pa.int64()))
    pq.write_table(table, tmp_path / "data" / "train-00000-of-00001.parquet")
    ds = load_dataset("hf", tmp_path, path=str(tmp_path), preset="flwrlabs/femnist", id_column="wid",
                      test_fraction=0.5)
    assert ds.client_names == ("1", "2", "10")  # 10 after 2, not between 1 and 2 as strings would sort
    np.testing.assert_array_equal(np.sort(np.concatenate([ds.train_ids, ds.test_ids[ds.test_ids >= 0]])),
                                  [0, 1, 1, 2])


def test_a_missing_h5py_names_the_extra(monkeypatch) -> None:
    from fedsim.configure import load_config
    from fedsim.errors import MissingExtraError

    monkeypatch.setitem(__import__("sys").modules, "h5py", None)
    with pytest.raises(MissingExtraError, match=r'data.name: tff_emnist needs h5py, which is not installed: '
                                                r'pip install "fedsim-ray\[tff\]"'):
        load_config(None, ["data.name=tff_emnist"])


# ---------------------------------------------------------------- Hugging Face


def test_letters_are_leafs_table() -> None:
    assert NUM_LETTERS == 80 and len(set(LETTERS)) == 80
    assert LETTERS[:4] == "\n !\"" and LETTERS[-1] == "}" and LETTERS.index("a") == 53
    np.testing.assert_array_equal(letter_ids(["aA}", "\n 0"], "t"), [[53, 25, 79], [0, 1, 11]])


def test_hf_femnist_from_hub_parquet_shards_with_a_per_client_holdout(tmp_path: Path) -> None:
    images = RNG.integers(0, 256, (23, 28, 28), dtype=np.uint8)
    writers = ["f2"] * 10 + ["f1"] * 2 + ["f3"] + ["f1"] * 10
    labels = list(RNG.integers(0, 62, 23))
    table = femnist_table(images, labels, writers)
    data = tmp_path / "hub" / "datasets--flwrlabs--femnist" / "snapshots" / "abc" / "data"
    data.mkdir(parents=True)
    pq.write_table(table.slice(0, 12), data / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(12), data / "train-00001-of-00002.parquet")
    ds = load_dataset("hf", tmp_path, path=str(data.parent), preset="flwrlabs/femnist")
    assert ds.client_names == ("f1", "f2", "f3") and ds.num_classes == 62  # the ClassLabel's 62 names
    # LEAF's sizes: f1 has 12 rows -> int(0.9 * 12) = 10 train; f2 10 -> 9; f3's one row stays in train
    counts = {c: (int((ds.train_ids == k).sum()), int((ds.test_ids == k).sum())) for k, c in enumerate(ds.client_names)}
    assert counts == {"f1": (10, 2), "f2": (9, 1), "f3": (1, 0)}
    # each kept row is the image and label of its row in the files, rows in file order
    rows = np.concatenate([np.flatnonzero(np.asarray(writers) == c) for c in ("f1", "f2", "f3")])
    raw = images.astype(np.float32) / 255
    found = _rows_of(ds.x_train, raw, ds)
    np.testing.assert_allclose(ds.x_train[:, 0] * ds.std[0] + ds.mean[0], raw[found], atol=1e-5)  # PNG round trip
    train_rows = np.sort(rows[np.isin(rows, found)])
    np.testing.assert_array_equal(found, train_rows)  # kept in file order
    np.testing.assert_array_equal(ds.y_train, np.asarray(labels)[train_rows])
    np.testing.assert_array_equal(ds.train_ids, [{"f1": 0, "f2": 1, "f3": 2}[writers[r]] for r in train_rows])
    again = load_dataset("hf", tmp_path, path=str(data.parent), preset="flwrlabs/femnist")
    np.testing.assert_array_equal(again.y_test, ds.y_test)  # seeded
    other = load_dataset("hf", tmp_path, path=str(data.parent), preset="flwrlabs/femnist", split_seed=5)
    assert sorted(other.y_test) != sorted(ds.y_test) or not np.array_equal(other.x_test, ds.x_test)


def _rows_of(x: np.ndarray, raw: np.ndarray, ds) -> np.ndarray:
    """Which rows of `raw` (unnormalised) the normalised images `x` are."""
    back = x[:, 0] * ds.std[0] + ds.mean[0]
    return np.asarray([int(np.argmin(np.abs(raw - b).reshape(len(raw), -1).max(1))) for b in back])


def test_hf_save_to_disk_with_a_test_split(tmp_path: Path) -> None:
    text = ["abcde", "bcdef", "ZYX[]", "hello"]
    folder = save_to_disk(tmp_path / "saved", {
        "train": shakespeare_table(text[:3], ["f", "g", "}"], ["B_KING", "A_FOOL", "B_KING"]),
        "test": shakespeare_table(text[3:], ["!"], ["A_FOOL"])})
    ds = load_dataset("hf", tmp_path, path=str(folder), preset="flwrlabs/shakespeare")
    assert ds.x_train.dtype == np.int64 and ds.x_train.shape == (3, 5) and ds.num_classes == 80
    np.testing.assert_array_equal(ds.x_train[2], [LETTERS.index(c) for c in "ZYX[]"])
    np.testing.assert_array_equal(ds.y_train, [LETTERS.index(c) for c in "fg}"])
    np.testing.assert_array_equal(ds.y_test, [LETTERS.index("!")])
    assert ds.client_names == ("A_FOOL", "B_KING")
    np.testing.assert_array_equal(ds.train_ids, [1, 0, 1])
    np.testing.assert_array_equal(ds.test_ids, [0])


def test_hf_datasets_cache_shakespeare_holds_out_each_speakers_last_text(tmp_path: Path) -> None:
    """The `datasets` cache layout; Shakespeare's temporal split: the first n_train windows train, the test starts
    L - 1 windows later (L = 5 here), so no test window shares text with a training one."""
    stream = "".join(LETTERS[i % 60 + 12] for i in range(30))
    texts = [stream[i:i + 5] for i in range(20)]
    nexts = [stream[i + 5] for i in range(20)]
    folder = tmp_path / "flwrlabs___shakespeare" / "default" / "0.0.0" / "f00d"
    write_arrow_stream(folder / "shakespeare-train.arrow", shakespeare_table(texts, nexts, ["X"] * 20))
    (folder / "dataset_info.json").write_text(json.dumps({"splits": {"train": {"num_examples": 20}}}))
    (folder / "cache-1234.arrow").write_bytes(b"not read")  # a map() cache beside it is skipped
    ds = load_dataset("hf", tmp_path, path=str(tmp_path / "flwrlabs___shakespeare"), preset="flwrlabs/shakespeare",
                      test_fraction=0.5)
    n_train = int(0.5 * 20)
    np.testing.assert_array_equal(ds.x_train, letter_ids(texts[:n_train], "t"))
    np.testing.assert_array_equal(ds.x_test, letter_ids(texts[n_train + 4:], "t"))
    np.testing.assert_array_equal(ds.y_test, letter_ids(nexts[n_train + 4:], "t", length=1)[:, 0])


def test_hf_a_csv_without_split_names_is_the_training_split(tmp_path: Path) -> None:
    csv = tmp_path / "shakespeare.csv"
    csv.write_text('character_id,x,y\nA,"a, b\n",1\nA,"c d e",2\nB,"12345",\n')
    with pytest.raises(fedsim.FedsimError, match=r"row 2 is 0 characters"):  # an empty next character is refused
        load_dataset("hf", tmp_path, path=str(tmp_path), preset="flwrlabs/shakespeare")
    csv.write_text('character_id,x,y\nA,"a, b\n",1\nA,"c d e",2\nB,"12345", \nB,"23456",7\n')
    ds = load_dataset("hf", tmp_path, path="shakespeare.csv", preset="flwrlabs/shakespeare", temporal=False)
    assert ds.client_names == ("A", "B") and ds.x_train.shape[1] == 5
    assert sorted(ds.y_train.tolist() + ds.y_test.tolist()) == sorted(LETTERS.index(c) for c in "12 7")
    np.testing.assert_array_equal(letter_ids(["a, b\n"], "t")[0], [53, 8, 1, 54, 0])


def test_hf_datasets_train_one_round(tmp_path: Path) -> None:
    images = RNG.integers(0, 256, (40, 28, 28), dtype=np.uint8)
    table = femnist_table(images, list(RNG.integers(0, 62, 40)), [f"w{i % 4}" for i in range(40)])
    save_to_disk(tmp_path / "femnist", {"train": table}, FEMNIST_INFO)
    run_dir = run_one_round(tmp_path / "a", "data.name=hf", f"data.options.path={tmp_path / 'femnist'}",
                            "data.options.preset=flwrlabs/femnist")
    assert (Path(run_dir) / "meta.json").is_file()
    stream = "".join(LETTERS[(7 * i) % 80] for i in range(60))
    texts, nexts = [stream[i:i + 8] for i in range(50)], [stream[i + 8] for i in range(50)]
    save_to_disk(tmp_path / "shakespeare", {"train": shakespeare_table(texts, nexts, [f"s{i % 3}" for i in range(50)])})
    np.save(tmp_path / "table.npy", RNG.normal(size=(80, 4)).astype(np.float32))
    run_dir = run_one_round(tmp_path / "b", "data.name=hf", f"data.options.path={tmp_path / 'shakespeare'}",
                            "data.options.preset=flwrlabs/shakespeare", "data.options.temporal=false",
                            "model.name=bilstm", f"model.options.embedding={tmp_path / 'table.npy'}",
                            "model.options.hidden=8")
    assert (Path(run_dir) / "meta.json").is_file()


# ---------------------------------------------------------------- bad input, through the CLI


def test_bad_files_are_one_line_naming_the_file_or_key(tmp_path: Path, capsys) -> None:
    def h5(name: str, clients: dict, *, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        write_h5(root / f"{name}_train.h5", clients)
        write_h5(root / f"{name}_test.h5", emnist_clients({"a": 1}))

    def no_examples(root: Path) -> None:
        root.mkdir(parents=True)
        with h5py.File(root / "fed_emnist_digitsonly_train.h5", "w") as f:
            f.create_group("clients")
        write_h5(root / "fed_emnist_digitsonly_test.h5", emnist_clients({"a": 1}))

    def no_clients(root: Path) -> None:
        root.mkdir(parents=True)
        write_h5(root / "fed_emnist_digitsonly_train.h5", emnist_clients({"a": 1}))
        with h5py.File(root / "fed_emnist_digitsonly_test.h5", "w") as f:
            f.create_group("examples")

    def no_label(root: Path) -> None:
        clients = emnist_clients({"a": 2})
        del clients["a"]["label"]
        h5("fed_emnist_digitsonly", clients, root=root)

    def big_label(root: Path) -> None:
        clients = emnist_clients({"a": 2, "b": 2})
        clients["b"]["label"][1] = 10
        h5("fed_emnist_digitsonly", clients, root=root)

    def bad_shape(root: Path) -> None:
        clients = emnist_clients({"a": 2})
        clients["a"]["pixels"] = RNG.random((2, 28, 27), dtype=np.float32)
        h5("fed_emnist_digitsonly", clients, root=root)

    def cifar_pixels(root: Path) -> None:
        clients = cifar_clients({"a": 2})
        clients["a"]["image"] = np.zeros((2, 32, 32), np.uint8)
        root.mkdir(parents=True)
        write_h5(root / "fed_cifar100_train.h5", clients)
        write_h5(root / "fed_cifar100_test.h5", cifar_clients({"a": 1}))

    def not_hdf5(root: Path) -> None:
        root.mkdir(parents=True)
        (root / "fed_emnist_digitsonly_train.h5").write_bytes(b"not hdf5")
        write_h5(root / "fed_emnist_digitsonly_test.h5", emnist_clients({"a": 1}))

    def parquet_missing_column(root: Path) -> None:
        (root / "data").mkdir(parents=True)
        table = femnist_table(RNG.integers(0, 256, (2, 28, 28), dtype=np.uint8), [1, 2], ["w", "w"])
        pq.write_table(table.drop_columns(["writer_id"]), root / "data" / "train-00000-of-00001.parquet")

    def arrow_missing_column(root: Path) -> None:
        save_to_disk(root, {"train": shakespeare_table(["abc"], ["d"], ["A"]).drop_columns(["y"])})

    def hf_empty(root: Path) -> None:
        (root / "data").mkdir(parents=True)
        (root / "data" / "README.md").write_text("no data files")

    def hf_label_range(root: Path) -> None:
        (root / "data").mkdir(parents=True)
        table = femnist_table(RNG.integers(0, 256, (2, 28, 28), dtype=np.uint8), [1, 62], ["w", "w"])
        pq.write_table(table, root / "data" / "train-00000-of-00001.parquet")

    def hf_bad_png(root: Path) -> None:
        (root / "data").mkdir(parents=True)
        table = femnist_table(RNG.integers(0, 256, (2, 28, 28), dtype=np.uint8), [1, 2], ["w", "w"])
        broken = pa.array([{"bytes": b"\x89PNG broken", "path": None}] * 2, type=table.schema.field("image").type)
        pq.write_table(table.set_column(0, "image", broken), root / "data" / "train-00000-of-00001.parquet")

    emnist = ["data.name=tff_emnist"]
    hf = ["data.name=hf", "data.options.preset=flwrlabs/femnist"]
    train_h5 = "fed_emnist_digitsonly_train.h5"
    cases = [  # (name, writer, overrides, what the one line must contain, the file it names)
        ("no examples group", no_examples, emnist, "has no 'examples' group", train_h5),
        ("no client", no_clients, emnist, "its 'examples' group holds no client", "fed_emnist_digitsonly_test.h5"),
        ("no personal test sample", lambda root: h5("fed_cifar100", cifar_clients({"0": 2}), root=root) or
         write_h5(root / "fed_cifar100_test.h5", cifar_clients({"7": 1})),
         ["data.name=tff_cifar100", "data.partition.kind=natural_id", "data.num_clients=1",
          "participation.clients_per_round=1", "data.client_test=natural"],
         "data.client_test: natural, but no test sample of dataset 'tff_cifar100' belongs to a training client", ""),
        ("missing feature", no_label, emnist, "examples/a has no 'label' dataset", train_h5),
        ("label out of range", big_label, emnist, r"examples/b/label: labels outside 0\.\.9", train_h5),
        ("pixel shape", bad_shape, emnist, r"examples/a/pixels: expected N×28×28 float pixels, got float32 of "
                                           r"shape \(2, 28, 27\)", train_h5),
        ("cifar pixels", cifar_pixels, ["data.name=tff_cifar100"], r"examples/a/image: expected N×32×32×3 uint8",
         "fed_cifar100_train.h5"),
        ("not hdf5", not_hdf5, emnist, "could not read", train_h5),
        ("no h5 files", lambda root: root.mkdir(), emnist, "files not found: expected fed_emnist_digitsonly_train",
         ""),
        ("parquet without the id column", parquet_missing_column, hf, "has no column 'writer_id'",
         "train-00000-of-00001.parquet"),
        ("arrow without the label column", arrow_missing_column, ["data.name=hf",
                                                                  "data.options.preset=flwrlabs/shakespeare"],
         "has no column 'y'", "data-00000-of-00001.arrow"),
        ("no data files", hf_empty, hf, "no 'train' split found", ""),
        ("hf labels past the ClassLabel", hf_label_range, hf, r"labels \('character'\) outside 0\.\.61", ""),
        ("hf image not decodable", hf_bad_png, hf, "column 'image': row 0 is not a readable image",
         "train-00000-of-00001.parquet"),
        ("hf without a path", lambda root: root.mkdir(), ["data.name=hf"], "data.options.path: dataset 'hf' needs", ""),
        # no copy yet: fetched from the Hub where huggingface_hub and a network are, else one line saying how
        ("hf download here", lambda root: None, [*hf, "data.download=true"],
         r"(data\.download needs huggingface_hub|download of flwrlabs/femnist failed).*huggingface-cli download "
         r"flwrlabs/femnist --repo-type dataset --local-dir", ""),
    ]
    config = tmp_path / "run.yaml"
    config.write_text(f"rounds: 1\nresults: {{root: {tmp_path / 'results'}}}\nruntime: {{backend: local}}\n")
    for i, (what, write, overrides, message, file) in enumerate(cases):
        root = tmp_path / f"case{i}"
        write(root)
        path = [f"data.options.path={root}"] if "data.name=hf" in overrides and what != "hf without a path" else []
        argv = ["run", str(config), "--quiet", "-o", f"data.root={root}"]
        for o in [*overrides, *path]:
            argv += ["-o", o]
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (what, code, err)
        assert re.search(message, err[0]) and file in err[0], (what, err[0])
