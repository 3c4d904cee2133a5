"""GloVe-format embedding tables and the text_tsv / text_npz loaders, on small generated files."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fedsim.data import load_dataset
from fedsim.data.text import encode, load_embedding_table, tokenize
from fedsim.errors import ConfigError, DataError

GLOVE = "4 3\nthe 0.1 0.2 0.3\nmovie 1 0 -1\ngood 0.5 0.5 0.5\nbad -0.5 -0.5 -0.5\n"


@pytest.fixture
def glove(tmp_path):
    path = tmp_path / "glove.txt"
    path.write_text(GLOVE)
    return path


def test_glove_table_rows_follow_the_file_after_pad_and_unk(glove) -> None:
    vocab, table = load_embedding_table(str(glove))
    assert vocab == {"the": 2, "movie": 3, "good": 4, "bad": 5}  # the word2vec header line is skipped
    assert table.shape == (6, 3) and table.dtype == np.float32
    np.testing.assert_array_equal(table[:2], 0)
    np.testing.assert_allclose(table[3], [1, 0, -1])
    vocab2, table2 = load_embedding_table(str(glove), max_vocab=2)
    assert vocab2 == {"the": 2, "movie": 3} and table2.shape == (4, 3)


def test_glove_errors_name_the_file_and_line(tmp_path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("a 1 2\nb 1 2 3\n")
    with pytest.raises(DataError, match=r"bad.txt line 2: 3 numbers, earlier lines have 2"):
        load_embedding_table(str(bad))
    with pytest.raises(DataError, match="not found"):
        load_embedding_table(str(tmp_path / "missing.txt"))
    npy = tmp_path / "t.npy"
    np.save(npy, np.ones((5, 2), np.float32))
    assert load_embedding_table(str(npy), max_vocab=1)[1].shape == (3, 2)


def test_tokenize_and_encode_pad_truncate_and_unknown() -> None:
    assert tokenize("Good movie, DON'T miss!") == ["good", "movie", ",", "don't", "miss", "!"]
    vocab = {"good": 2, "movie": 3}
    assert encode(["good movie", "bad movie good good"], vocab, 3).tolist() == [[2, 3, 0], [1, 3, 2]]


def test_text_tsv_loader(tmp_path, glove) -> None:
    (tmp_path / "train.tsv").write_text("pos\tThe movie, good\nneg\tbad bad movie\n\nneg\tthe end\n")
    (tmp_path / "test.tsv").write_text("pos\tgood\n")
    ds = load_dataset("text_tsv", tmp_path, False, train="train.tsv", test="test.tsv", embedding=str(glove),
                      max_len=4)
    assert ds.x_train.tolist() == [[2, 3, 1, 4], [5, 5, 3, 0], [2, 1, 0, 0]]  # ',' and 'end' are unknown
    assert ds.y_train.tolist() == [1, 0, 0] and ds.y_test.tolist() == [1]  # names numbered in sorted order
    assert ds.num_classes == 2 and ds.input_shape == (4,)
    assert ds.extras["embedding"].shape == (6, 3)
    (tmp_path / "bad.tsv").write_text("no tab here\n")
    with pytest.raises(DataError, match="bad.tsv line 1"):
        load_dataset("text_tsv", tmp_path, False, train="bad.tsv", test="test.tsv", embedding=str(glove))
    with pytest.raises(ConfigError, match="data.options.embedding"):
        load_dataset("text_tsv", tmp_path, False, train="train.tsv", test="test.tsv")


def test_text_npz_loader(tmp_path) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, x_train=np.array([[2, 3], [4, 0]]), y_train=np.array([0, 2]), x_test=np.array([[3, 3]]),
             y_test=np.array([1]), embedding=np.ones((5, 4), np.float32))
    ds = load_dataset("text_npz", tmp_path, False, path=str(path))
    assert ds.num_classes == 3 and ds.x_train.dtype == np.int64 and ds.extras["embedding"].shape == (5, 4)
    np.savez(path, x_train=np.array([[9]]), y_train=np.array([0]), x_test=np.array([[1]]), y_test=np.array([0]),
             embedding=np.ones((5, 4), np.float32))
    with pytest.raises(DataError, match="outside the 5-row embedding"):
        load_dataset("text_npz", tmp_path, False, path=str(path))


def test_text_npz_members_it_does_not_read_are_left_alone(tmp_path) -> None:
    """A vocabulary or notes file packed beside the arrays is not an array: it is not read, so not refused."""
    import zipfile

    path = tmp_path / "t.npz"
    np.savez(path, x_train=np.array([[2, 3], [4, 0]]), y_train=np.array([0, 2]), x_test=np.array([[3, 3]]),
             y_test=np.array([1]), embedding=np.ones((5, 4), np.float32))
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("vocab.txt", "a\nb\n")
    assert load_dataset("text_npz", tmp_path, False, path=str(path)).x_train.shape == (2, 2)


@pytest.mark.parametrize("embedding,problem", [
    (np.array(5.0), r"2-d float table, got float64 \(\)"),
    (np.array([["a"] * 4] * 5), "2-d float table, got <U1"),
    (np.ones(5, np.float32), r"2-d float table, got float32 \(5,\)"),
    (np.full((5, 4), np.nan, np.float32), "NaN or infinite"),
])
def test_text_npz_embedding_must_be_a_finite_float_table(tmp_path, embedding, problem) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, x_train=np.array([[2, 3]]), y_train=np.array([0]), x_test=np.array([[3, 3]]), y_test=np.array([0]),
             embedding=embedding)
    with pytest.raises(DataError, match=f"{re.escape(str(path))}: the embedding .*{problem}"):
        load_dataset("text_npz", tmp_path, False, path=str(path))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e40"])
def test_a_glove_text_line_with_a_value_that_is_not_finite_is_refused(tmp_path, value) -> None:
    glove = tmp_path / "g.txt"
    glove.write_text(f"the 0.1 0.2 0.3\ncat 0.4 {value} 0.6\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(glove))} line 2: NaN or infinite values"):
        load_embedding_table(str(glove))
