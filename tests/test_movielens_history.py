"""MovieLens rating histories: each rating's earlier ratings by the same user, in (timestamp, movieId)
order, the last N, never the rating itself or a later one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.data.movielens import MovieLensSource, rating_histories
from neorec.errors import ConfigError

MOVIES = """movieId,title,genres
10,Ten (1990),Drama
20,Twenty (1991),Comedy
30,Thirty (1992),Drama|Comedy
40,Forty (1993),(no genres listed)
50,Fifty (1994),Action
"""
# user 7: five ratings, two of them at t=100 (ordered by movieId: 20 before 40), written out of order;
# user 3: one rating (an empty history).
RATINGS = """userId,movieId,rating,timestamp
7,50,5.0,300
7,40,2.0,100
3,10,4.0,50
7,10,4.5,200
7,20,3.0,100
7,30,4.0,400
"""


def write_root(tmp_path: Path) -> Path:
    root = tmp_path / "ml"
    root.mkdir()
    (root / "movies.csv").write_text(MOVIES)
    (root / "ratings.csv").write_text(RATINGS)
    return root


def histories(src: MovieLensSource, feature: str) -> list[list[int]]:
    """Every rating's history feature, ratings in file order."""
    values, lengths, _ = src.batch(torch.arange(len(src.labels))).sparse.feature(feature)
    return [v.tolist() for v in values.split(lengths.tolist())]


def movie_ids(src: MovieLensSource, rows: list[list[int]]) -> list[list[int]]:
    return [[int(src.movie_ids[i]) for i in r] for r in rows]


def test_history_is_earlier_ratings_in_time_order_ties_by_movie(tmp_path):
    src = MovieLensSource(write_root(tmp_path), val_fraction=0.2, history=10)
    # user 7 in (timestamp, movieId) order: 20@100, 40@100, 10@200, 50@300, 30@400
    assert movie_ids(src, histories(src, "history")) == [
        [20, 40, 10],  # 50@300
        [20],  # 40@100: 20@100 precedes it (same second, smaller movieId)
        [],  # user 3's only rating
        [20, 40],  # 10@200
        [],  # 20@100: the user's first
        [20, 40, 10, 50],  # 30@400
    ]
    # liked = rating >= 4 of each history entry: 20 -> 3.0, 40 -> 2.0, 10 -> 4.5, 50 -> 5.0
    assert histories(src, "history_liked") == [[0, 0, 1], [0], [], [0, 0], [], [0, 0, 1, 1]]
    names = [f.name for f in src.info.features]
    assert names == ["user", "movie", "genres", "year", "history", "history_liked"]
    assert src.info.features[4].num_ids == 5 and src.info.features[5].num_ids == 2
    src.batch(torch.arange(6)).sparse.validate({f.name: f.num_ids for f in src.info.features})


def test_history_keeps_the_last_n(tmp_path):
    src = MovieLensSource(write_root(tmp_path), val_fraction=0.2, history=2)
    assert movie_ids(src, histories(src, "history")) == [[40, 10], [20], [], [20, 40], [], [10, 50]]


def test_held_out_history_holds_earlier_ratings_only(tmp_path):
    """With user_time, user 7's last rating (30@400) is held out: its history is its four earlier
    ratings; no training rating's history holds a held-out movie."""
    src = MovieLensSource(write_root(tmp_path), val_fraction=0.2, history=10)
    assert src.val_index.tolist() == [5]
    batch = next(src.eval_batches(8))
    values, lengths, _ = batch.sparse.feature("history")
    assert [int(src.movie_ids[i]) for i in values] == [20, 40, 10, 50] and lengths.tolist() == [4]
    for batch in src.train_batches(2):
        assert int(src.movie_ids.tolist().index(30)) not in batch.sparse.feature("history")[0].tolist()


def test_histories_from_training_ratings_stop_at_the_split(tmp_path):
    """history_from=train: user 7's last two ratings (50@300, 30@400) are held out and both see only
    the three training ratings; training ratings' histories are as with history_from=all."""
    root = write_root(tmp_path)
    src = MovieLensSource(root, val_fraction=0.4, history=10, history_from="train")
    every = MovieLensSource(root, val_fraction=0.4, history=10)
    assert src.val_index.tolist() == [0, 5]
    assert movie_ids(src, histories(src, "history")) == [[20, 40, 10], [20], [], [20, 40], [], [20, 40, 10]]
    assert histories(src, "history_liked")[5] == [0, 0, 1]
    assert movie_ids(every, histories(every, "history"))[5] == [20, 40, 10, 50]


def test_the_item_catalog_has_every_feature_of_a_batch_with_empty_user_side_bags(tmp_path):
    """A two-tower model scores the whole item set through the catalog, whose batch must hold every
    feature of the training batches: the user's and the history's empty."""
    src = MovieLensSource(write_root(tmp_path), val_fraction=0.2, history=3)
    catalog = src.item_catalog()
    assert catalog.keys == src.batch(src.val_index[:2]).sparse.keys
    for name in ("user", "history", "history_liked"):
        ids, lengths, _ = catalog.feature(name)
        assert ids.numel() == 0 and lengths.tolist() == [0] * len(src.movie_ids)


def test_no_history_by_default_and_bad_settings_rejected(tmp_path):
    root = write_root(tmp_path)
    assert [f.name for f in MovieLensSource(root).info.features] == ["user", "movie", "genres", "year"]
    with pytest.raises(ConfigError, match="data.movielens.history must be >= 0"):
        MovieLensSource(root, history=-1)
    with pytest.raises(ConfigError, match="data.movielens.history_from must be one of"):
        MovieLensSource(root, history=3, history_from="held_out")


def brute_force(user, t, m, n, eligible):
    """History of every rating by a Python loop over all pairs: the reference."""
    out = []
    for i in range(len(user)):
        earlier = [
            j for j in range(len(user)) if eligible[j] and user[j] == user[i] and (t[j], m[j]) < (t[i], m[i])
        ]
        earlier.sort(key=lambda j: (t[j], m[j]))
        out.append([m[j] for j in earlier][-n:])
    return out


@pytest.mark.parametrize("n", [1, 3, 100])
@pytest.mark.parametrize("some_eligible", [False, True])
def test_rating_histories_match_a_brute_force(n, some_eligible):
    rng = np.random.default_rng(n)
    user = rng.integers(0, 6, 300)
    t = rng.integers(0, 20, 300)  # many ties in time
    m = rng.permutation(300)  # a user rates a movie once, as in MovieLens
    eligible = rng.random(300) < 0.6 if some_eligible else None
    pool, start, lengths = rating_histories(user, t, m, n, eligible)
    got = [m[pool[s : s + k]].tolist() for s, k in zip(start, lengths, strict=True)]
    every = np.ones(300, dtype=bool) if eligible is None else eligible
    assert got == brute_force(user.tolist(), t.tolist(), m.tolist(), n, every.tolist())
