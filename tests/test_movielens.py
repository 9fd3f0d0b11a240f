"""MovieLens latest-small source: counts, the split, the genre bags, and errors that name the file."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.data.movielens import (
    MovieLensSource,
    parse_year,
    split_by_global_time,
    split_by_user_time,
    split_ratings,
)
from neorec.errors import ConfigError, DataError

ROOT = Path(__file__).parents[2] / "shared" / "data" / "ml-latest-small"
pytestmark = pytest.mark.skipif(
    not (ROOT / "ratings.csv").is_file(), reason=f"shared MovieLens latest-small not found at {ROOT}"
)


@pytest.fixture(scope="module")
def src() -> MovieLensSource:
    return MovieLensSource(ROOT, seed=0, split="random")


def num_rows(source: MovieLensSource) -> dict[str, int]:
    return {f.name: f.num_ids for f in source.info.features}


def test_counts(src):
    assert len(src.train_index) + len(src.val_index) == 100_836
    assert len(src.val_index) == round(0.1 * 100_836)
    rows = num_rows(src)
    assert rows["user"] == 610 and rows["movie"] == 9_742
    assert rows["genres"] == 19  # 20 labels in movies.csv minus "(no genres listed)"
    assert src.info.num_dense == 3 and src.info.num_train_samples == len(src.train_index)
    assert [f.multi_hot for f in src.info.features] == [False, False, True, False]


def test_split_is_deterministic_and_disjoint(src):
    train, val = set(src.train_index.tolist()), set(src.val_index.tolist())
    assert not train & val and len(train | val) == 100_836
    # The split depends only on (number of ratings, seed, val_fraction).
    train, val = split_ratings(100_836, seed=0, val_fraction=0.1)
    assert torch.equal(val, src.val_index) and torch.equal(train, src.train_index)
    assert not torch.equal(split_ratings(100_836, seed=1, val_fraction=0.1)[1], val)


def test_eval_fixed_and_train_shuffled_per_epoch(src):
    e1 = torch.cat([b.labels for b in src.eval_batches(4096)])
    e2 = torch.cat([b.labels for b in src.eval_batches(1000)])
    assert torch.equal(e1, e2) and len(e1) == len(src.val_index)
    first = [next(src.train_batches(64, epoch=e)).sparse.feature("user")[0] for e in (0, 0, 1)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    sizes = [len(b) for b in src.train_batches(10_000)]
    assert sum(sizes) == len(src.train_index) and sizes[-1] == len(src.train_index) % 10_000


def test_batch_validates_and_genres_are_multi_hot(src):
    rows = num_rows(src)
    for batch in src.eval_batches(2048):
        batch.sparse.validate(rows)
        assert batch.dense.shape == (len(batch), 3) and batch.dense.dtype == torch.float32
        assert 0 <= batch.dense.min() and batch.dense.max() <= 1
    # A movie with several genres, and one with none ("(no genres listed)"): its bag is empty.
    toy_story = int((torch.from_numpy(src.movie_ids) == 1).nonzero())
    empty = int((src.movie_genre_lengths == 0).nonzero()[0])
    assert int((src.movie_genre_lengths == 0).sum()) == 34
    rated = [int((src.movie == m).nonzero()[0]) for m in (toy_story, empty)]
    batch = src.batch(torch.tensor(rated))
    values, lengths, _ = batch.sparse.feature("genres")
    assert lengths.tolist() == [5, 0]
    names = [src.genre_names[i] for i in values.tolist()]
    assert names == ["Adventure", "Animation", "Children", "Comedy", "Fantasy"]
    year_ids = batch.sparse.feature("year")[0]
    assert year_ids[0] == 1 + 1995 - 1900


def test_label_rate_plausible(src):
    rate = src.labels.mean().item()
    assert 0.45 < rate < 0.52  # 48.2% of ratings are >= 4.0
    val_rate = torch.cat([b.labels for b in src.eval_batches(8192)]).mean().item()
    assert abs(val_rate - rate) < 0.03


def test_parse_year():
    assert parse_year("Toy Story (1995)") == 1995
    assert parse_year("Runaway Brain (1995) ") == 1995
    assert parse_year("Death Note: Desu nôto (2006–2007)") == 2006
    assert parse_year("Babylon 5") is None


def copy_root(tmp_path: Path) -> Path:
    root = tmp_path / "ml"
    root.mkdir(parents=True)
    lines = (ROOT / "ratings.csv").read_text().splitlines()[:50]
    (root / "ratings.csv").write_text("\n".join(lines) + "\n")
    shutil.copy(ROOT / "movies.csv", root / "movies.csv")
    return root


def test_errors_name_the_file(tmp_path):
    root = copy_root(tmp_path)
    assert len(MovieLensSource(root).labels) == 49
    (root / "movies.csv").unlink()
    with pytest.raises(DataError, match=re.escape(str(root / "movies.csv")) + ": no such file"):
        MovieLensSource(root)
    root = copy_root(tmp_path / "b")
    ratings = root / "ratings.csv"
    ratings.write_text(ratings.read_text().replace("userId,movieId,rating", "user,movieId,rating", 1))
    with pytest.raises(
        DataError, match=re.escape(f"{ratings}: header") + ".*expected userId,movieId,rating,timestamp"
    ):
        MovieLensSource(root)
    lines = ratings.read_text().replace("user,", "userId,", 1).splitlines()
    lines[7] = "1,3,four,964981247"
    ratings.write_text("\n".join(lines))
    with pytest.raises(DataError, match=re.escape(f"{ratings}:8: rating = 'four'")):
        MovieLensSource(root)
    with pytest.raises(ConfigError, match="val_fraction"):
        MovieLensSource(root, val_fraction=1.0)


def test_a_pair_rated_twice_is_refused_naming_both_lines(tmp_path):
    """A second rating of a (user, movie) pair would put the first one's label in its history."""
    root = copy_root(tmp_path)
    ratings = root / "ratings.csv"
    lines = ratings.read_text().splitlines()
    user, movie = lines[3].split(",")[:2]
    ratings.write_text("\n".join([*lines, f"{user},{movie},1.0,1700000000"]) + "\n")
    said = f"{ratings}:51: userId {user} rates movieId {movie} a second time (first at line 4)"
    with pytest.raises(DataError, match=re.escape(said)):
        MovieLensSource(root)


def test_a_rating_of_a_movie_missing_from_movies_csv_is_refused(tmp_path):
    """Not looked up as the movie next to it in movies.csv's order."""
    root = copy_root(tmp_path)
    ratings = root / "ratings.csv"
    lines = ratings.read_text().splitlines()
    known = sorted(int(x.split(",", 1)[0]) for x in (root / "movies.csv").read_text().splitlines()[1:])
    between = next(a + 1 for a, b in zip(known, known[1:], strict=False) if b > a + 1)
    for movie in (between, known[-1] + 1):
        ratings.write_text("\n".join([*lines, f"1,{movie},4.0,964982703"]) + "\n")
        with pytest.raises(DataError, match=re.escape(f"{ratings}:51: movieId {movie} is not in movies.csv")):
            MovieLensSource(root)


def test_user_time_split_holds_out_each_users_latest_ratings():
    """Every user's held-out ratings come after all of their training ratings in (timestamp, movieId)
    order, and they are floor(0.2 n + 0.5) of the user's n; the split ignores the seed."""
    src = MovieLensSource(ROOT, seed=0, val_fraction=0.2, split="user_time")
    other = MovieLensSource(ROOT, seed=5, val_fraction=0.2, split="user_time")
    assert torch.equal(src.val_index, other.val_index)
    user, t, m = src.user.numpy(), src.timestamp.numpy(), src.movie.numpy()
    key = t.astype(np.float64) * 1e6 + m  # (timestamp, movieId) as one sortable number
    train, val = src.train_index.numpy(), src.val_index.numpy()
    for u in np.unique(user):
        tr, va = train[user[train] == u], val[user[val] == u]
        n = len(tr) + len(va)
        assert len(va) == int(np.floor(0.2 * n + 0.5))
        assert key[tr].max() <= key[va].min()
    assert len(train) + len(val) == 100_836


def test_global_time_split_is_one_cut_in_time():
    user = np.array([0, 0, 1, 1, 1])
    t = np.array([5, 1, 3, 3, 9])
    m = np.array([1, 1, 7, 2, 1])
    train, val = split_by_global_time(t, m, 0.4)
    assert train.tolist() == [1, 2, 3] and val.tolist() == [0, 4]  # (3, 7) precedes (5, 1)
    train, val = split_by_user_time(user, t, m, 0.4)
    assert val.tolist() == [0, 4] and train.tolist() == [1, 2, 3]  # user 0: 1 of 2, user 1: 1 of 3 held out


def test_ratings_of_one_user_at_one_time_split_by_movie_id():
    """Ties in time go by movieId (the documented (timestamp, movieId) order), not by file order."""
    from neorec.data.movielens import split_by_user_time

    train, held_out = split_by_user_time(np.array([0, 0]), np.array([5, 5]), np.array([9, 1]), 0.5)
    assert held_out.tolist() == [0] and train.tolist() == [1]
