"""LEAF's datasets from small files in LEAF's exact JSON layout: reading, user merging, LEAF's sampling redone
against a transcription of its scripts with `random.Random`, bad files through the CLI, and a round of each."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from fedsim.data import load_dataset
from fedsim.data.leaf import Steps, _sent140, preprocess
from fedsim.data.letters import LETTERS
from fedsim.errors import ConfigError, DataError


def write(folder: Path, name: str, users: dict[str, tuple[list, list]], counts: list[int] | None = None) -> Path:
    """A LEAF JSON file: users, num_samples, user_data with x and y."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"users": list(users), "num_samples": counts or [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
    (folder / name).write_text(json.dumps(data))
    return folder / name


def pixels(seed: int, n: int) -> list[list[float]]:
    return np.random.default_rng(seed).integers(0, 256, (n, 784)).__truediv__(255).tolist()


def femnist_folder(root: Path) -> Path:
    """Two train files (writer w1 in both) and one test file listing the writers in another order."""
    data = root / "data"
    write(data / "train", "b.json", {"w3": (pixels(3, 2), [61, 0]), "w1": (pixels(4, 1), [7])})
    write(data / "train", "a.json", {"w1": (pixels(1, 3), [0, 5, 9]), "w2": (pixels(2, 2), [10, 35])})
    write(data / "test", "t.json", {"w2": (pixels(5, 1), [36]), "w3": (pixels(6, 1), [1]),
                                   "w1": (pixels(7, 2), [2, 3])})
    return root


def test_femnist_reads_files_in_name_order_and_merges_users(tmp_path: Path) -> None:
    ds = load_dataset("leaf_femnist", femnist_folder(tmp_path))
    raw_train = np.concatenate([pixels(1, 3), pixels(2, 2), pixels(3, 2), pixels(4, 1)]).astype(np.float32)
    raw_test = np.concatenate([pixels(5, 1), pixels(6, 1), pixels(7, 2)]).astype(np.float32)
    assert ds.x_train.shape == (8, 1, 28, 28) and ds.x_test.shape == (4, 1, 28, 28) and ds.num_classes == 62
    assert ds.y_train.tolist() == [0, 5, 9, 10, 35, 61, 0, 7] and ds.y_test.tolist() == [36, 1, 2, 3]
    assert ds.client_names == ("w1", "w2", "w3")  # the sorted training ids, across files
    assert ds.train_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 0] and ds.test_ids.tolist() == [1, 2, 0, 0]
    mean, std = raw_train.mean(), raw_train.std()
    np.testing.assert_allclose([ds.mean[0], ds.std[0]], [mean, std], rtol=1e-5)
    np.testing.assert_allclose(ds.x_train.reshape(8, 784), (raw_train - mean) / std, atol=1e-5)
    np.testing.assert_allclose(ds.x_test.reshape(4, 784), (raw_test - mean) / std, atol=1e-5)


def test_shakespeare_ids_and_its_test_files_shorter_by_the_skipped_windows(tmp_path: Path) -> None:
    text = "To be, or not to be: that is the Question? [Exit] And so: 'farewell' & \"adieu\"!}\n" * 2
    xs = [text[i: i + 80] for i in range(3)]
    ys = [text[i + 80] for i in range(3)]
    write(tmp_path / "data" / "train", "s.json", {"HAMLET": (xs[:2], ys[:2])})
    write(tmp_path / "data" / "test", "s.json", {"HAMLET": (xs[2:], ys[2:])}, counts=[1 + 79])  # as LEAF writes
    ds = load_dataset("leaf_shakespeare", tmp_path)
    assert len(LETTERS) == 80 and ds.num_classes == 80 and ds.x_train.shape == (2, 80)
    assert ds.x_train.dtype == np.int64 and ds.x_train[1].tolist() == [LETTERS.index(c) for c in xs[1]]
    assert ds.y_train.tolist() == [LETTERS.index(c) for c in ys[:2]] and ds.y_test.tolist() == [LETTERS.index(ys[2])]
    assert ds.client_names == ("HAMLET",) and ds.test_ids.tolist() == [0]


def tweet(text: str, user: str = "u") -> list[str]:
    return ["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user, text, "training"]


def test_sent140_vocabulary_from_training_tweets_or_a_glove_file(tmp_path: Path) -> None:
    write(tmp_path / "data" / "train", "a.json", {"ann": ([tweet("good day, good"), tweet("bad day!")], [1, 0]),
                                                  "bob": ([tweet("Good")], [1])})
    write(tmp_path / "data" / "test", "a.json", {"bob": ([tweet("good " * 30)], [1]),
                                                 "cat": ([tweet("day unseen")], [0])})
    ds = load_dataset("leaf_sent140", tmp_path, vocab_size=4)
    # counts: good 2, day 2, ',' 1, bad 1, '!' 1, Good 1 -> by count, ties in sorted order: day, good, !, ','
    vocab = {"day": 0, "good": 1, "!": 2, ",": 3}
    unk = 4
    assert ds.x_train.shape == (3, 25) and ds.x_train[0, :5].tolist() == [1, 0, 3, 1, unk]
    assert ds.x_train[1, :4].tolist() == [unk, 0, 2, unk] and (ds.x_train[:, 4:] == unk).all()
    assert ds.x_train[2, 0] == unk  # case kept, as LEAF
    assert ds.x_test[0].tolist() == [vocab["good"]] * 25  # the first 25 words
    assert ds.client_names == ("ann", "bob") and ds.test_ids.tolist() == [1, -1]  # cat: test only, central only
    assert ds.extras["vocab_size"] == unk and "embedding" not in ds.extras
    glove = tmp_path / "glove.txt"
    glove.write_text("day 1 2\ngood 3 4\n! 5 6\n")
    ds = load_dataset("leaf_sent140", tmp_path, embedding=str(glove), lowercase=True)
    assert ds.x_train[2, :2].tolist() == [1, 3]  # 'good' is the file's second word; unknown = 3 words
    np.testing.assert_array_equal(ds.extras["embedding"], [[1, 2], [3, 4], [5, 6], [0, 0]])


# ---------------------------------------------------------------- LEAF's preprocessing, transcribed


def leaf_scripts(files: list[tuple[str, dict]], split_names: list[str], *, iid: bool, sf: float, iu: float,
                 k: int, by_user: bool, tf: float, seed1: int, seed2: int) -> tuple[list, list]:
    """sample.py, remove_users.py and split_data.py step by step on lists, as the scripts run on one machine."""
    rng = random.Random(seed1)
    kept, new_count = {}, 0
    for name, data in files:
        total = sum(data["num_samples"])
        want = int(sf * total)
        if iid:
            xs = [x for u in data["user_data"] for x in data["user_data"][u]["x"]]
            ys = [y for u in data["user_data"] for y in data["user_data"][u]["y"]]
            groups = int(round(iu * len(data["users"]))) or 1
            pick = rng.sample([i for i in range(total)], want)
            px, py = [xs[i] for i in pick], [ys[i] for i in pick]
            size = int(len(px) / groups)
            big = len(px) - groups * size
            chunks, at = [], 0
            for g in range(groups):
                step = size + (1 if g >= groups - big else 0)
                chunks.append((px[at: at + step], py[at: at + step]))
                at += step
            users = [str(g + new_count) for g in range(groups)]
            new_count += groups
            out = dict(zip(users, chunks))
        else:
            users = list(data["users"])
            rng.shuffle(users)
            out, have, i = {}, 0, 0
            while have < want:
                u = users[i]
                x, y = data["user_data"][u]["x"], data["user_data"][u]["y"]
                if have + len(y) > want:
                    n = want - have
                    idx = rng.sample([j for j in range(n)], n)
                    x, y = [x[j] for j in idx], [y[j] for j in idx]
                out[u] = (x, y)
                have += len(y)
                i += 1
        kept[name] = [(u, xy) for u, xy in out.items() if len(xy[1]) >= k]
    rng = random.Random(seed2)
    train, test = [], []
    if by_user:
        allu = [ux for name in split_names for ux in kept[name]]
        chosen = rng.sample([i for i in range(len(allu))], int(tf * len(allu)))
        train = [allu[i] for i in range(len(allu)) if i in chosen]
        test = [allu[i] for i in range(len(allu)) if i not in chosen]
        return train, test
    for name in split_names:
        for u, (x, y) in kept[name]:
            n = len(y)
            if n < 2:
                continue
            n_train = 1 if n == 2 else max(1, int(tf * n))
            tr = rng.sample([j for j in range(n)], n_train)
            te = [j for j in range(n) if j not in tr]
            train.append((u, ([x[j] for j in range(n) if j in tr], [y[j] for j in range(n) if j in tr])))
            test.append((u, ([x[j] for j in te], [y[j] for j in te])))
    return train, test


def all_data(root: Path) -> list[tuple[str, dict]]:
    """Two all_data files of tweets (each text names its user and index), 5 and 4 users of 1 to 7 tweets."""
    files = []
    for name, users in (("all_data_1.json", {"a": 4, "b": 7, "c": 1, "d": 5, "e": 3}),
                        ("all_data_10.json", {"f": 6, "g": 2, "h": 5, "i": 4})):
        content = {u: ([tweet(f"{u}{j}", u) for j in range(n)], [(j * 7 + ord(u)) % 2 for j in range(n)])
                   for u, n in users.items()}
        path = write(root / "data" / "all_data", name, content)
        files.append((name, json.loads(path.read_text())))
    return files


def ours(users) -> list[tuple[str, list[str], list[int]]]:
    return [(u, list(x), y.tolist()) for u, x, y in users]


def theirs(users) -> list[tuple[str, list[str], list[int]]]:
    return [(u, [r[4] for r in x], list(y)) for u, (x, y) in users]


@pytest.mark.parametrize("iid, by_user", [(False, False), (True, True)], ids=["niid-sample", "iid-user"])
def test_sampling_removal_and_split_equal_leafs_scripts(tmp_path: Path, iid: bool, by_user: bool) -> None:
    files = all_data(tmp_path)
    # LEAF's split finds all_data_1_niid_7_keep_2.json etc.: '_' sorts after '0', so all_data_10 comes first there
    steps = Steps(sampling="iid" if iid else "niid", sf=0.7, iu=0.5, min_samples=2,
                  split="user" if by_user else "sample", train_fraction=0.6, sample_seed=7, split_seed=11)
    got = preprocess("leaf_sent140", tmp_path / "data" / "all_data", _sent140, steps, time_ordered=False)
    want = leaf_scripts(files, ["all_data_10.json", "all_data_1.json"], iid=iid, sf=0.7, iu=0.5, k=2,
                        by_user=by_user, tf=0.6, seed1=7, seed2=11)
    assert [ours(u) for u in got] == [theirs(u) for u in want]
    assert sum(len(u[2]) for u in ours(got[0])) > 0 and len(got[1]) > 0
    # both samplings keep ⌊0.7·n⌋ samples of each file: 14 of 20 and 11 of 17 (a user split loses none of them)
    whole = Steps(**{**steps.__dict__, "min_samples": None, "split": "user"})
    kept = preprocess("leaf_sent140", tmp_path / "data" / "all_data", _sent140, whole, time_ordered=False)
    assert sum(len(y) for side in kept for _, _, y in side) == 14 + 11
    # the orders: both steps reversed give LEAF's result for that listing
    steps = Steps(**{**steps.__dict__, "sample_order": ["all_data_10.json", "all_data_1.json"],
                     "split_order": ["all_data_1.json", "all_data_10.json"]})
    got = preprocess("leaf_sent140", tmp_path / "data" / "all_data", _sent140, steps, time_ordered=False)
    want = leaf_scripts(files[::-1], ["all_data_1.json", "all_data_10.json"], iid=iid, sf=0.7, iu=0.5, k=2,
                        by_user=by_user, tf=0.6, seed1=7, seed2=11)
    assert [ours(u) for u in got] == [theirs(u) for u in want]


def test_the_options_run_the_steps_into_the_dataset(tmp_path: Path) -> None:
    all_data(tmp_path)
    ds = load_dataset("leaf_sent140", tmp_path, sampling="niid", sf=0.7, min_samples=2, split="sample",
                      train_fraction=0.6, sample_seed=7, split_seed=11)
    steps = Steps(sampling="niid", sf=0.7, min_samples=2, split="sample", train_fraction=0.6, sample_seed=7,
                  split_seed=11)
    train, test = preprocess("leaf_sent140", tmp_path / "data" / "all_data", _sent140, steps, False)
    assert len(ds.y_train) == sum(len(y) for _, _, y in train) and len(ds.y_test) == sum(len(y) for _, _, y in test)
    assert ds.client_names == tuple(sorted(u for u, _, _ in train))  # sample split: every user on both sides
    assert set(ds.test_ids.tolist()) == set(range(len(train)))


def test_shakespeare_split_is_in_time_order_without_overlap(tmp_path: Path) -> None:
    text = "".join(LETTERS[(i * 31) % 80] for i in range(300))
    xs, ys = [text[i: i + 80] for i in range(200)], [text[i + 80] for i in range(200)]
    write(tmp_path / "data" / "all_data", "all_data.json", {"ROMEO": (xs, ys), "JULIET": (xs[:150], ys[:150])})
    ds = load_dataset("leaf_shakespeare", tmp_path, split="sample", train_fraction=0.5)
    # ROMEO: 100 train, test from 100 + 79 on (21); JULIET: 75 train, test would start at 154 > 150: dropped
    assert len(ds.y_train) == 100 and len(ds.y_test) == 200 - 100 - 79 and ds.client_names == ("ROMEO",)
    assert ds.y_test.tolist() == [LETTERS.index(c) for c in ys[179:]]
    assert ds.x_train[99].tolist() == [LETTERS.index(c) for c in xs[99]]


# ---------------------------------------------------------------- bad input: one line, exit 2


def _run_cli(tmp_path: Path, name: str, overrides: list[str], capsys) -> tuple[int, str]:
    from jobs.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"name: bad\nrounds: 1\ndata: {{name: {name}, root: {tmp_path}, num_clients: 2, "
                      f"partition: {{kind: iid}}}}\nmodel: {{name: leaf_cnn}}\nresults: {{root: {tmp_path}/r}}\n")
    code = main(["run", str(config), "--quiet", "--backend", "local", *[a for o in overrides for a in ("-o", o)]])
    return code, capsys.readouterr().err


def _bad_counts(root: Path) -> str:
    write(root / "data" / "train", "a.json", {"w1": (pixels(1, 2), [1, 2])}, counts=[3])
    return "a.json: user 'w1' has num_samples 3 but 2 samples"


def _bad_label(root: Path) -> str:
    write(root / "data" / "train", "a.json", {"w1": (pixels(1, 2), [1, 62])})
    return "a.json: user 'w1': label 62 outside the 62 classes"


def _no_train(root: Path) -> str:
    write(root / "data" / "test", "a.json", {"w1": (pixels(1, 2), [1, 2])})
    return f"folder not found: {root / 'data' / 'train'}"


def _bad_json(root: Path) -> str:
    (root / "data" / "train").mkdir(parents=True)
    (root / "data" / "train" / "a.json").write_text('{"users": ["w1"], "num_samples": [')
    return "a.json: not a readable JSON file"


def _everyone_removed(root: Path) -> str:
    write(root / "data" / "all_data", "all_data_0.json", {"w1": (pixels(1, 3), [1, 2, 3])})
    return "data.options.min_samples: 4 leaves no user"


def _empty_user(root: Path) -> str:
    write(root / "data" / "train", "a.json", {"w1": (pixels(1, 2), [1, 2]), "w2": ([], [])})
    return "a.json: user 'w2' has no samples"


def _unknown_char(root: Path) -> str:
    write(root / "data" / "train", "s.json", {"R": (["a" * 79 + "~"], ["b"])})
    return "s.json: user 'R': x: row 0 has character '~', which is not in LEAF's 80-symbol table"


BAD = [
    ("leaf_femnist", [], _bad_counts),
    ("leaf_femnist", [], _bad_label),
    ("leaf_femnist", [], _no_train),
    ("leaf_femnist", [], _bad_json),
    ("leaf_femnist", ["data.options={min_samples: 4, split: sample}"], _everyone_removed),
    ("leaf_femnist", [], _empty_user),
    ("leaf_shakespeare", [], _unknown_char),
    ("leaf_femnist", ["data.download=true"],
     lambda root: "data.download: LEAF's data is built by LEAF's own scripts, not fetched by fedsim: git clone"),
    ("leaf_femnist", ["data.options={sampling: niid}"],
     lambda root: "data.options.sampling: LEAF's preprocessing runs from data/all_data only with"),
    ("leaf_femnist", ["data.options={split: sample, sample_order: [x.json]}"],
     lambda root: write(root / "data" / "all_data", "all_data_0.json", {"w": (pixels(1, 3), [1, 2, 3])}) and
     "data.options.sample_order: must list each file of data/all_data once; 'all_data_0.json' is missing"),
]


@pytest.mark.parametrize("name, overrides, make", BAD, ids=lambda v: getattr(v, "__name__", None))
def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys, name: str, overrides: list[str], make) -> None:
    root = tmp_path / "leaf"
    root.mkdir()
    fragment = make(root)
    code, err = _run_cli(root, name, overrides, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err


def test_a_test_user_absent_from_train_is_allowed(tmp_path: Path) -> None:
    femnist_folder(tmp_path)
    write(tmp_path / "data" / "test", "u.json", {"w9": (pixels(9, 1), [4])})
    ds = load_dataset("leaf_femnist", tmp_path)
    assert "w9" not in ds.client_names and ds.test_ids[-1] == -1  # no training samples: the central test set only


def test_config_errors_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.options.split: must be one of"):
        load_dataset("leaf_femnist", tmp_path, split="writer")
    with pytest.raises(ConfigError, match="data.options.train_fraction"):
        load_dataset("leaf_femnist", tmp_path, split="sample", train_fraction=1.0)
    with pytest.raises(DataError, match="no .json files in"):
        (tmp_path / "data" / "train").mkdir(parents=True)
        load_dataset("leaf_femnist", tmp_path)


# ---------------------------------------------------------------- a round of each, with its model


@pytest.mark.parametrize("name, model", [("leaf_femnist", "leaf_cnn"), ("leaf_shakespeare", "leaf_lstm"),
                                         ("leaf_sent140", "leaf_sent140")])
def test_one_round_of_each_with_its_model(tmp_path: Path, name: str, model: str, one_thread) -> None:
    import fedsim
    from fedsim.results import load

    if name == "leaf_femnist":
        femnist_folder(tmp_path)
        options = "{}"
    elif name == "leaf_shakespeare":
        text = "".join(LETTERS[(i * 7) % 80] for i in range(120))
        write(tmp_path / "data" / "train", "s.json", {
            "A": ([text[i: i + 80] for i in range(4)], [text[i + 80] for i in range(4)]),
            "B": ([text[i: i + 80] for i in range(5, 9)], [text[i + 80] for i in range(5, 9)])})
        write(tmp_path / "data" / "test", "s.json", {"A": ([text[20: 100]], [text[100]])})
        options = "{}"
    else:
        write(tmp_path / "data" / "train", "a.json", {"a": ([tweet("good day")] * 3, [1, 1, 1]),
                                                      "b": ([tweet("bad day")] * 3, [0, 0, 0])})
        write(tmp_path / "data" / "test", "a.json", {"a": ([tweet("good")], [1])})
        options = "{vocab_size: 20}"
    data_options = options if name == "leaf_sent140" else "{}"  # the model's vocabulary is the data's
    # FEMNIST: each writer one client, scored on its own test samples by a personal method
    split = ["data.num_clients=3", "data.partition.kind=natural_id", "data.client_test=natural",
             "algorithm.name=fedper", "participation.clients_per_round=3"] if name == "leaf_femnist" else \
        ["data.num_clients=2", "data.partition.kind=iid", "participation.clients_per_round=2"]
    run = fedsim.run(None, ["rounds=1", "name=leaf", f"data.name={name}", f"data.root={tmp_path}", *split,
                            "data.val_fraction=0", f"data.options={data_options}",
                            f"model.name={model}", f"model.options={options}",
                            "train.epochs=1", "train.batch_size=4", "train.lr=0.01", "runtime.backend=local",
                            f"results.root={tmp_path / 'results'}"], backend="local")
    res = load(run)
    rounds = res["rounds"]
    if name == "leaf_femnist":  # w1, w2, w3: 4, 2, 2 training and 2, 1, 1 test samples (femnist_folder)
        clients = res["clients"].set_index("client").sort_index()
        assert clients["samples"].tolist() == [4, 2, 2] and clients["test_samples"].tolist() == [2, 1, 1]
        assert rounds["personal_accuracy_mean"].notna().all() and (rounds["personal_trained"] == 3).all()
    else:
        assert len(rounds) >= 1 and np.isfinite(rounds["loss"].to_numpy(dtype=float)[-1])


@pytest.mark.parametrize("name", ["femnist", "shakespeare", "sent140"])
def test_the_baseline_configs_load(name: str) -> None:
    from fedsim.configure import load_config
    from tests.conftest import ROOT

    cfg = load_config(Path(ROOT) / "configs" / "leaf" / f"{name}.yaml")
    assert cfg.data.name == f"leaf_{name}" and cfg.data.options["split"] == "sample"
    assert cfg.train.batch_size == 10 and cfg.train.momentum == 0.0
