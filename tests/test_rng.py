"""Named random streams: one seed per (run seed, name, round, client, phase), and no other derivation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fedsim import rng
from tests.conftest import ROOT as _ROOT

ROOT = Path(_ROOT)


def test_a_stream_is_its_key_and_every_part_of_the_key_matters() -> None:
    base = rng.seed(7, "client", 3, 4, 1)
    assert base == rng.seed(7, "client", 3, 4, 1)
    others = [rng.seed(8, "client", 3, 4, 1), rng.seed(7, "clients", 3, 4, 1), rng.seed(7, "client", 4, 4, 1),
              rng.seed(7, "client", 3, 5, 1), rng.seed(7, "client", 3, 4, 2), rng.seed(7, "client", 3, 4),
              rng.seed(7, "client", 3, 4, 0)]
    assert len({base, *others}) == 1 + len(others)
    assert all(0 <= s < 2**31 for s in (base, *others))  # a C int (FAISS, scikit-learn), exact as a float metric
    assert max(rng.seed(0, "client", r) for r in range(2000)) > 2**30  # the whole 31-bit range is used
    a = rng.torch_generator(7, "x", 1)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=rng.torch_generator(7, "x", 1)))
    assert (rng.numpy_generator(7, "x").random(3) == rng.numpy_generator(7, "x").random(3)).all()


def test_bad_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="needs a name"):
        rng.seed(1, "")
    with pytest.raises(ValueError, match="must be >= -1"):
        rng.seed(1, "client", -2)


def test_a_round_of_clients_derived_together_matches_one_at_a_time() -> None:
    """`seeds` (SeedSequence's arithmetic over a whole array of clients) gives `seed`'s values, whatever the word
    lengths of the key's parts, and a prefetched row answers `seed` with the same values."""
    import numpy as np

    gen = np.random.default_rng(5)
    cases = [(0, "client", 0, 0), (7, "local/dropout", 3, 1), (2**32 - 1, "x", -1, -1), (2**32, "init/mlp", 2**32, 5),
             (2**64 + 5, "y", 2**32 - 1, 2**32)]
    for run_seed, name, round, phase in cases:
        ids = np.concatenate([[-1, 0, 1, 2**32 - 2, 2**32 - 1, 2**40], gen.integers(0, 10**7, 40)])
        alone = [rng.seed(run_seed, name, round, int(c), phase) for c in ids]
        assert rng.seeds(run_seed, name, round, ids, phase).tolist() == alone
        assert rng.seeds(run_seed, name, round, ids[6:], phase).tolist() == alone[6:]  # the array path only
        rng.prefetch(run_seed, name, round, ids[6:], phase)
        assert [rng.seed(run_seed, name, round, int(c), phase) for c in ids] == alone
    assert rng.seeds(1, "client", 0, [], 0).shape == (0,)
    with pytest.raises(ValueError, match="must be >= -1"):
        rng.seeds(1, "client", 0, [3, -2])
    with pytest.raises(ValueError, match="needs a name"):
        rng.seeds(1, "", 0, [3])


def test_no_other_module_derives_seeds_by_hand() -> None:
    """Methods, the runtime and the mechanism toolkit take every draw from fedsim.rng: no salts, no arithmetic
    on the run seed, no SeedSequence of their own."""
    offenders = []
    files = [*(ROOT / "fedsim" / "algorithms").glob("*.py"), *(ROOT / "fedsim" / "runtime").glob("*.py"),
             *(ROOT / "fedsim" / "method").glob("*.py")]
    assert len(files) > 20 and all(f.is_file() for f in files)  # the scan reads the modules it names
    pattern = re.compile(r"SeedSequence|default_rng\(\[|seed\s*[*+]\s*\d|0x[0-9A-Fa-f]{2,}")
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_the_largest_stream_seed_is_a_valid_faiss_and_sklearn_seed() -> None:
    import numpy as np
    from sklearn.utils import check_random_state

    from fedsim.algorithms._selection import kmeans_distances

    x = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    ids, _, _ = kmeans_distances(x, 4, 5, 2**31 - 1, device="cpu")  # 2**31 itself overflows FAISS's C int
    assert len(ids) == 40
    check_random_state(2**31 - 1)
