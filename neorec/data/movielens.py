"""MovieLens "latest-small" as a CTR source: label = rating >= 4.0, the small real dataset a model must learn.

Reads `ratings.csv` (userId, movieId, rating, timestamp) and `movies.csv` (movieId, title, genres)
once into tensors (100k rows) and builds batches by slicing, so an epoch costs no parsing. Ids must be
integers in [0, 2^63), ratings finite stars in [0.5, 5.0]; anything else is a DataError naming the file,
the line (as an editor numbers it, header included) and the value.

Features, all ids in [0, num_ids):
- "user":   userId -> index in sorted order of the userIds that appear in ratings.csv;
- "movie":  movieId -> index in sorted order of the movieIds of movies.csv (every movie, rated or not);
- "genres": multi-hot bag of the movie's pipe-separated genres, indices in sorted genre-name order;
            "(no genres listed)" gives an empty bag;
- "year":   release year from the title's trailing "(1995)" (or "(2006–2007)" -> 2006), clipped to
            [1900, 2020] -> 1 + (year - 1900); 0 is the dedicated "unknown year" id.
With `history=N` (N > 0), two more, for sequential models (neorec/model/din.py):
- "history":       the movie indices of the same user's last N ratings strictly before this one in
                   (timestamp, movieId) order, oldest first; empty for a user's first rating;
- "history_liked": for each of those, 1 if it was rated >= 4, else 0 (as long as "history").
A rating's history holds earlier ratings only, never the rating itself or later ones. With
`history_from="all"` they come from either side of the split: a held-out rating's history includes
the user's earlier held-out ratings, as a deployed model scoring a movie at that moment would know
everything the user rated before it. With "train" only training ratings enter histories, so a
held-out rating's history stops at the split (docs/sequential.md, "What a history may hold").
Dense features (no label leakage: none is derived from any rating value):
- release year, (year - 1900) / 120, clipped to [0, 1]; unknown -> the mean over movies with a year;
- rating time, the timestamp min-max scaled to [0, 1] over all of ratings.csv;
- movie age when rated, (rating year - release year) / 100, clipped to [0, 1]; unknown year -> 0.

Labels by name (`labels`, for multi-task heads; default: `like` alone, [B]), as [B, T] in the order
given: `like` = rating >= 4 (liked), `love` = rating >= 4.5 (among the favourites: about a fifth of
ratings), `ok` = rating >= 3 (not disliked: about four fifths). Each is a threshold of the same
rating, so the tasks share what the trunk learns and differ in where they cut.

Splits (`split`), each a pure function of the data (and the seed for `random`); both sets are kept
in file order:
- user_time: every user's last fraction of ratings, ordered by (timestamp, movieId), is held out
  (floor(fraction * n + 0.5) of a user's n ratings). Training then never sees a rating a user made
  after one the model is asked to predict for that user, as in serving; the user's earlier taste is
  all the model knows.
- global_time: one cut in time: the last fraction of all ratings by (timestamp, movieId) is held out;
  stricter still (every training rating precedes every held-out one), but users who only rated
  after the cut are unknown to the model.
- random: a seeded permutation (numpy Generator(seed)) puts round(fraction * N) ratings in the
  held-out set. It leaks: a user's later ratings train the model that predicts their earlier ones,
  so its AUC overstates what a deployed model would reach.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.checks import quote
from neorec.data.locations import missing_movielens, movielens_root
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.errors import ConfigError, DataError
from neorec.sparse import SparseBatch

FEATURES = ("user", "movie", "genres", "year")
LABELS = {"like": 4.0, "love": 4.5, "ok": 3.0}  # label name -> the rating threshold it is 1 from
HISTORY_FROM = ("all", "train")
DENSE_NAMES = ["release_year", "rating_time", "age_when_rated"]
NO_GENRES = "(no genres listed)"
YEAR_MIN, YEAR_MAX = 1900, 2020
UNKNOWN_YEAR = 0  # year id of titles without a parsable year
SECONDS_PER_YEAR = 365.2425 * 24 * 3600
RATING_MIN, RATING_MAX = 0.5, 5.0  # the MovieLens scales: half stars (or whole stars) up to 5
_YEAR_RE = re.compile(r"\((\d{4})(?:\s*[-–]\s*\d{4})?\)\s*$")


def parse_year(title: str) -> int | None:
    """Release year from a MovieLens title such as "Toy Story (1995)"; None when it has none."""
    m = _YEAR_RE.search(title)
    return int(m.group(1)) if m else None


def split_ratings(n: int, seed: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, validation rows), each sorted: a seeded permutation of n rows puts the first
    round(val_fraction * n) of it in validation. Depends only on (n, seed, val_fraction)."""
    num_val = round(val_fraction * n)
    order = np.random.default_rng(seed).permutation(n)
    return torch.from_numpy(np.sort(order[num_val:])), torch.from_numpy(np.sort(order[:num_val]))


SPLITS = ("user_time", "global_time", "random")


def split_by_user_time(
    user: np.ndarray, timestamp: np.ndarray, movie: np.ndarray, val_fraction: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, held-out rows), each sorted: every user's last floor(fraction * n + 0.5) ratings
    by (timestamp, movieId)."""
    order = np.lexsort((movie, timestamp, user))  # by user, then time, then movie
    counts = np.bincount(user)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # where each user's run starts in `order`
    held = np.floor(val_fraction * counts + 0.5).astype(np.int64)
    rank_in_user = np.arange(len(order)) - np.repeat(first, counts)
    is_val = rank_in_user >= np.repeat(counts - held, counts)
    return torch.from_numpy(np.sort(order[~is_val])), torch.from_numpy(np.sort(order[is_val]))


def split_by_global_time(
    timestamp: np.ndarray, movie: np.ndarray, val_fraction: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, held-out rows), each sorted: the last round(fraction * N) ratings of all by
    (timestamp, movieId)."""
    order = np.lexsort((movie, timestamp))
    cut = len(order) - round(val_fraction * len(order))
    return torch.from_numpy(np.sort(order[:cut])), torch.from_numpy(np.sort(order[cut:]))


def rating_histories(
    user: np.ndarray, timestamp: np.ndarray, movie: np.ndarray, length: int, eligible: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pool, start, lengths): rating i's history is pool[start[i] : start[i] + lengths[i]], the rows of
    the same user's last min(length, k) ratings of the k that precede it in (timestamp, movieId)
    order, oldest first. `eligible` (bool per rating, default all): only those ratings enter
    histories; `pool` holds them sorted by (user, timestamp, movieId)."""
    order = np.lexsort((movie, timestamp, user))
    keep = np.ones(len(order), dtype=bool) if eligible is None else eligible[order]
    before = np.cumsum(keep) - keep  # eligible ratings before each sorted position: an index into pool
    counts = np.bincount(user)
    first = np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)  # user's run start, per sorted row
    user_start = before[first]
    sorted_start = np.maximum(user_start, before - length)
    start = np.empty(len(order), dtype=np.int64)
    lengths = np.empty(len(order), dtype=np.int64)
    start[order] = sorted_start
    lengths[order] = before - sorted_start
    return order[keep], start, lengths


def gather_runs(start: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated ranges [start[b], start[b] + lengths[b]) of every b: the positions of jagged rows."""
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # output offset of each run
    return torch.arange(int(lengths.sum())) - first[owner] + start[owner]


def _read_csv(path: Path, columns: list[str]) -> tuple[list[int], list[list[str]]]:
    """(line number of each row, one list of strings per column) of a CSV file with a header that
    holds at least `columns`, in the order of `columns`."""
    if not path.is_file():
        raise DataError(
            f"{path}: no such file; expected the MovieLens latest-small file with header {','.join(columns)}"
        )
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(
                f"{path}: header {','.join(header) or '(empty)'} lacks {missing}; expected {','.join(columns)}"
            )
        where = [header.index(c) for c in columns]
        lines: list[int] = []
        rows: list[list[str]] = []
        for row in reader:
            if len(row) != len(header):
                raise DataError(
                    f"{path}:{reader.line_num}: expected {len(header)} fields ({','.join(header)}), got {len(row)}"
                )
            lines.append(reader.line_num)
            rows.append([row[i] for i in where])
    return lines, [list(col) for col in zip(*rows, strict=True)] if rows else [[] for _ in columns]


def _numbers(path: Path, lines: list[int], column: str, values: list[str], dtype: type) -> np.ndarray:
    """Parse a column with numpy; on failure name the first bad line (an integer beyond int64 included)."""
    try:
        return np.asarray(values).astype(dtype)
    except (ValueError, OverflowError):
        for line, v in zip(lines, values, strict=True):
            try:
                dtype(v)
            except (ValueError, OverflowError):
                kind = "an integer that fits int64" if dtype is np.int64 else f"a {np.dtype(dtype).name}"
                raise DataError(f"{path}:{line}: {column} = {quote(v)} is not {kind}") from None
        raise


def _check_one_rating_per_pair(
    path: Path,
    lines: list[int],
    users: np.ndarray,
    movies: np.ndarray,
    user_idx: np.ndarray,
    movie_idx: np.ndarray,
) -> None:
    """A user rates a movie once: a second rating of the pair would put the first one's label in the
    second's history (or the pair on both sides of a split)."""
    pair = user_idx.astype(np.int64) * (int(movie_idx.max()) + 1) + movie_idx
    order = np.argsort(pair, kind="stable")
    again = np.flatnonzero(pair[order][1:] == pair[order][:-1])
    if len(again):
        first, second = int(order[again[0]]), int(order[again[0] + 1])  # in file order (a stable sort)
        raise DataError(
            f"{path}:{lines[second]}: userId {users[second]} rates movieId {movies[second]} a second time "
            f"(first at line {lines[first]}): each pair is rated once, else one rating's label is an input "
            "of the other's prediction"
        )


def _ids(path: Path, lines: list[int], column: str, values: list[str]) -> np.ndarray:
    """An id column as int64, every id >= 0."""
    ids = _numbers(path, lines, column, values, np.int64)
    negative = np.flatnonzero(ids < 0)
    if len(negative):
        i = int(negative[0])
        raise DataError(
            f"{path}:{lines[i]}: {column} = {quote(values[i])} is negative; ids must be integers >= 0"
        )
    return ids


def _ratings(path: Path, lines: list[int], values: list[str]) -> np.ndarray:
    """The rating column as float32, every rating finite and within the MovieLens scale: a NaN, inf or
    out-of-scale rating would otherwise become a label silently (NaN is never >= 4: a "dislike")."""
    ratings = _numbers(path, lines, "rating", values, np.float32)
    bad = np.flatnonzero(~((ratings >= RATING_MIN) & (ratings <= RATING_MAX)))  # NaN compares False
    if len(bad):
        i = int(bad[0])
        raise DataError(
            f"{path}:{lines[i]}: rating = {quote(values[i])} is not a number in [{RATING_MIN}, {RATING_MAX}]; "
            "MovieLens ratings are 0.5 to 5 stars: fix the file, or take a fresh copy of it"
        )
    return ratings


class MovieLensSource:
    """DataSource over MovieLens latest-small (see the module docstring for features and split). `root`:
    the folder of ratings.csv and movies.csv; None: the default location (neorec/data/locations.py),
    where `neorec data download movielens` puts it."""

    def __init__(
        self,
        root: str | Path | None = None,
        seed: int = 0,
        val_fraction: float = 0.1,
        split: str = "user_time",
        labels: list[str] | None = None,
        history: int = 0,
        history_from: str = "all",
    ) -> None:
        unknown = [name for name in labels or () if name not in LABELS]
        if unknown:
            raise ConfigError(f"model.tasks names labels {unknown} that MovieLens does not make; it has {list(LABELS)}")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if split not in SPLITS:
            raise ConfigError(f"data.movielens.split must be one of {SPLITS}, got {split!r}")
        if history < 0:
            raise ConfigError(f"data.movielens.history must be >= 0 (0: no history features), got {history}")
        if history_from not in HISTORY_FROM:
            raise ConfigError(f"data.movielens.history_from must be one of {HISTORY_FROM}, got {history_from!r}")
        self.root = movielens_root(root)
        if not self.root.is_dir():
            raise DataError(missing_movielens(self.root, named=root is not None))
        self.seed = seed
        self.val_fraction = val_fraction
        self._load_movies(self.root / "movies.csv")
        self._load_ratings(self.root / "ratings.csv", labels)

        self.split = split
        if split == "user_time":
            self.train_index, self.val_index = split_by_user_time(
                self.user.numpy(), self.timestamp.numpy(), self.movie.numpy(), val_fraction
            )
        elif split == "global_time":
            self.train_index, self.val_index = split_by_global_time(
                self.timestamp.numpy(), self.movie.numpy(), val_fraction
            )
        else:
            self.train_index, self.val_index = split_ratings(len(self.rating), seed, val_fraction)

        self.history = history
        self.history_from = history_from
        if history:
            eligible = None
            if history_from == "train":
                eligible = np.zeros(len(self.rating), dtype=bool)
                eligible[self.train_index.numpy()] = True
            pool, start, lengths = rating_histories(
                self.user.numpy(), self.timestamp.numpy(), self.movie.numpy(), history, eligible
            )
            self.history_movie = self.movie[torch.from_numpy(pool)]
            self.history_liked = (self.rating[torch.from_numpy(pool)] >= LABELS["like"]).to(torch.int64)
            self.history_start = torch.from_numpy(start)
            self.history_lengths = torch.from_numpy(lengths)

        features = [
            FeatureSpec("user", len(self.user_ids)),
            FeatureSpec("movie", len(self.movie_ids)),
            FeatureSpec("genres", len(self.genre_names), multi_hot=True),
            FeatureSpec("year", YEAR_MAX - YEAR_MIN + 2),
        ]
        if history:
            features += [FeatureSpec("history", len(self.movie_ids), multi_hot=True),
                         FeatureSpec("history_liked", 2, multi_hot=True)]  # fmt: skip
        self.info = SourceInfo(
            num_dense=len(DENSE_NAMES),
            features=features,
            num_train_samples=len(self.train_index),
            notes={"dense": DENSE_NAMES, "num_train": len(self.train_index), "num_val": len(self.val_index)},
        )

    # ---- loading --------------------------------------------------------------------------------
    def _load_movies(self, path: Path) -> None:
        lines, (ids, titles, genre_fields) = _read_csv(path, ["movieId", "title", "genres"])
        movie_ids = _ids(path, lines, "movieId", ids)
        if len(movie_ids) == 0:
            raise DataError(f"{path}: no movies")
        if len(np.unique(movie_ids)) != len(movie_ids):
            raise DataError(f"{path}: movieId values are not unique")
        years = [parse_year(t) for t in titles]
        genre_lists = [[] if g.strip() in ("", NO_GENRES) else g.strip().split("|") for g in genre_fields]

        order = np.argsort(movie_ids, kind="stable")
        self.movie_ids = movie_ids[order]  # index -> movieId
        years = [years[i] for i in order]
        genre_lists = [genre_lists[i] for i in order]
        self.genre_names = sorted({g for gs in genre_lists for g in gs})
        genre_index = {g: i for i, g in enumerate(self.genre_names)}

        # Per movie: genre bag as CSR (offsets into values), year id and release year.
        lengths = torch.tensor([len(gs) for gs in genre_lists], dtype=torch.int64)
        self.movie_genre_lengths = lengths
        self.movie_genre_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.movie_genre_values = torch.tensor(
            [genre_index[g] for gs in genre_lists for g in gs], dtype=torch.int64
        )
        known = [y for y in years if y is not None]
        mean_year = float(np.mean(known)) if known else (YEAR_MIN + YEAR_MAX) / 2
        self.movie_year_id = torch.tensor(
            [UNKNOWN_YEAR if y is None else 1 + min(max(y, YEAR_MIN), YEAR_MAX) - YEAR_MIN for y in years]
        )
        self.movie_year_known = torch.tensor([y is not None for y in years], dtype=torch.bool)
        self.movie_year = torch.tensor([mean_year if y is None else y for y in years], dtype=torch.float64)

    def _load_ratings(self, path: Path, labels: list[str] | None) -> None:
        columns = ["userId", "movieId", "rating", "timestamp"]
        lines, (users, movies, ratings, times) = _read_csv(path, columns)
        if not lines:
            raise DataError(f"{path}: no ratings")
        users = _ids(path, lines, "userId", users)
        movies = _ids(path, lines, "movieId", movies)
        ratings = _ratings(path, lines, ratings)
        times = _numbers(path, lines, "timestamp", times, np.int64)

        movie_idx = np.minimum(np.searchsorted(self.movie_ids, movies), len(self.movie_ids) - 1)
        unknown = np.flatnonzero(self.movie_ids[movie_idx] != movies)
        if len(unknown):
            i = int(unknown[0])
            raise DataError(f"{path}:{lines[i]}: movieId {movies[i]} is not in movies.csv")
        self.user_ids, user_idx = np.unique(users, return_inverse=True)
        _check_one_rating_per_pair(path, lines, users, movies, user_idx, movie_idx)

        self.user = torch.from_numpy(user_idx.astype(np.int64))
        self.movie = torch.from_numpy(movie_idx.astype(np.int64))
        self.rating = torch.from_numpy(ratings)
        self.timestamp = torch.from_numpy(times)
        self.labels = (self.rating >= 4.0).to(torch.float32)
        if labels is not None:
            self.labels = torch.stack([(self.rating >= LABELS[name]).to(torch.float32) for name in labels], dim=1)

        t = torch.from_numpy(times).to(torch.float64)
        rating_time = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
        year = self.movie_year[self.movie]
        release = ((year - YEAR_MIN) / (YEAR_MAX - YEAR_MIN)).clamp(0, 1)
        rated_year = 1970 + t / SECONDS_PER_YEAR
        age = torch.where(self.movie_year_known[self.movie], (rated_year - year) / 100, 0.0).clamp(0, 1)
        self.dense = torch.stack([release, rating_time, age], dim=1).to(torch.float32)

    # ---- batches --------------------------------------------------------------------------------
    def training_file_bytes(self) -> list[int]:
        """The sizes of movies.csv and ratings.csv: saved with a checkpoint, so that a resume over
        files written again since is refused (the split and the features come from them)."""
        return [(self.root / name).stat().st_size for name in ("movies.csv", "ratings.csv")]

    def train_batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        """The training ratings in an order shuffled by (seed, epoch); the last batch may be smaller."""
        perm = torch.from_numpy(np.random.default_rng([self.seed, epoch]).permutation(len(self.train_index)))
        yield from self._batches(self.train_index[perm], batch_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """The validation ratings in file order."""
        yield from self._batches(self.val_index, batch_size)

    def _batches(self, index: torch.Tensor, batch_size: int) -> Iterator[Batch]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, len(index), batch_size):
            yield self.batch(index[start : start + batch_size])

    def batch(self, rows: torch.Tensor) -> Batch:
        """The Batch of the given rating rows (indices into ratings.csv order)."""
        ones = torch.ones(len(rows), dtype=torch.int64)
        features = self._features(self.user[rows], ones, self.movie[rows])
        if self.history:
            lengths = self.history_lengths[rows]
            pos = gather_runs(self.history_start[rows], lengths)
            features["history"] = (self.history_movie[pos], lengths)
            features["history_liked"] = (self.history_liked[pos], lengths)
        return Batch(self.dense[rows], SparseBatch.from_features(features), self.labels[rows])

    def item_catalog(self) -> SparseBatch:
        """Every movie once, in movie index order: its movie, genres and year, and empty user-side bags
        (user, and the history when there is one: what a two-tower model's item tower reads to score
        the whole item set)."""
        movie = torch.arange(len(self.movie_ids))
        empty, none = torch.zeros(0, dtype=torch.int64), torch.zeros(len(movie), dtype=torch.int64)
        features = self._features(empty, none, movie)
        if self.history:
            features.update(history=(empty, none), history_liked=(empty, none))
        return SparseBatch.from_features(features)

    def _features(
        self, users: torch.Tensor, user_lengths: torch.Tensor, movie: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{feature: (ids, lengths)} of the user and movie features (SparseBatch.from_features' input)."""
        ones = torch.ones(len(movie), dtype=torch.int64)
        lengths = self.movie_genre_lengths[movie]
        pos = gather_runs(self.movie_genre_offsets[movie], lengths)  # each movie's genre bag
        return {
            "user": (users, user_lengths),
            "movie": (movie, ones),
            "genres": (self.movie_genre_values[pos], lengths),
            "year": (self.movie_year_id[movie], ones),
        }
