"""Config fuzzing: random values, types, nesting, sizes and encodings for `--set` and for config files,
through `neorec config show` (config reading and validation only: nothing is built or trained). Every
example ends in a config that prints and reads back the same, or in one `neorec: error:` line with exit
2; never a traceback, and never more than a few seconds or a few hundred MB."""

from __future__ import annotations

import contextlib
import io
import resource
import tempfile
import time
from pathlib import Path

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from neorec.cli import main
from neorec.config.load import load_config
from neorec.config.reference import TABLE, config_keys

KEYS = [k.key.replace(TABLE, "C1") for k in config_keys()]
HANG_SECONDS = 60.0  # per example: a guard against a hang or a blow-up (a quadratic error message),
# far above what a refusal takes even on a busy machine; not a speed target
MAX_ERROR_CHARS = 4000  # of an error line
MAX_RSS_GROWTH = 512 << 20  # bytes the process may grow by over all the examples of one test

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([0, 1, -1, 2**63, 2**64, 10**30]),
    st.floats(), st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e300, -1e300, 1e39, 5e-324]),
    st.text(max_size=20), st.sampled_from(["auto", "none", "fp16", "tw", "lru", "../x", "a/b", "", "~", "null"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
keys = st.one_of(st.sampled_from(KEYS), st.lists(st.sampled_from(["data", "model", "x", "C1", "tables", ""]), min_size=1,
                                                 max_size=6).map(".".join))  # fmt: skip
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def nested(depth: int, kind: str) -> str:
    """YAML flow text nested `depth` deep."""
    return "[" * depth + "1" + "]" * depth if kind == "list" else "{a: " * depth + "1" + "}" * depth


def show(argv: list[str]) -> tuple[int, str, str]:
    """`neorec config show argv` in this process: (exit code, stdout, stderr), within HANG_SECONDS."""
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["config", "show", *argv])
    assert time.perf_counter() - start < HANG_SECONDS, argv
    return code, out.getvalue(), err.getvalue()


def valid_or_one_line(argv: list[str], overrides: list[str], config: str = "default") -> None:
    code, out, err = show(argv)
    assert "Traceback" not in err, err
    if code == 0:  # a valid config: what it prints reads back as the same config
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "shown.yaml").write_text(out)
            assert load_config(str(Path(tmp) / "shown.yaml")) == load_config(config, overrides)
        return
    assert code == 2, (code, err)
    one_error_line(err)


def one_error_line(err: str) -> None:
    """stderr of a refused command: one `neorec: error:` line, of bounded length."""
    assert err.startswith("neorec: error: ") and err.count("\n") == 1, err[:2000]
    assert len(err) < MAX_ERROR_CHARS, err[:500]


class Growth:
    """Asserts that the process's peak memory grows by less than MAX_RSS_GROWTH over a test."""

    def __enter__(self) -> Growth:
        self.start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc) -> None:
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start
        assert grown < MAX_RSS_GROWTH, f"peak memory grew by {grown >> 20} MiB"


def set_item(key: str, value) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix('...').strip()}"


@FUZZ
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=4))
def test_set_values_of_any_type(items):
    overrides = [set_item(k, v) for k, v in items]
    with Growth():
        valid_or_one_line([f"--set={o}" for o in overrides], overrides)


@FUZZ
@given(keys, st.text(max_size=60).filter(lambda t: "\0" not in t))
def test_set_values_of_any_text(key, text):
    overrides = [f"{key}={text}"]
    valid_or_one_line([f"--set={o}" for o in overrides], overrides)


@settings(FUZZ, max_examples=25)
@given(keys, st.integers(0, 3000), st.sampled_from(["list", "map"]), st.integers(0, 200_000))
def test_set_nesting_and_sizes(key, depth, kind, size):
    overrides = [
        f"{key}={nested(depth, kind)}",
        f"name={'n' * size}",
        f"data.synthetic.rows=[{', '.join(['7'] * 4)}]",
    ]
    with Growth():
        valid_or_one_line([f"--set={o}" for o in overrides], overrides)


def config_text(mapping: dict) -> str:
    return yaml.safe_dump(mapping, sort_keys=False, allow_unicode=True)


sections = st.dictionaries(st.sampled_from(KEYS + ["base", "x"]), values, max_size=6).map(
    lambda flat: {k.split(".")[0]: ({k.split(".", 1)[1]: v} if "." in k else v) for k, v in flat.items()}
)


@FUZZ
@given(sections, st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-32", "latin-1"]), st.booleans())
def test_config_files_of_any_content_and_encoding(mapping, encoding, duplicate):
    text = config_text(mapping) + ("name: again\nname: twice\n" if duplicate else "")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        try:
            path.write_bytes(text.encode(encoding))
        except UnicodeEncodeError:
            path.write_bytes(text.encode("utf-8", "replace"))
        code, out, err = show(["--config", str(path)])
        assert "Traceback" not in err, err
        assert code in (0, 2), (code, err)
        if code == 2:
            one_error_line(err)
        else:
            (Path(tmp) / "shown.yaml").write_text(out)
            assert load_config(str(Path(tmp) / "shown.yaml")) == load_config(str(path))


@FUZZ
@given(st.binary(max_size=2000))
def test_config_files_of_random_bytes(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bytes.yaml"
        path.write_bytes(data)
        code, _, err = show(["--config", str(path)])
        assert code in (0, 2) and "Traceback" not in err, err
        if code == 2:
            one_error_line(err)


@FUZZ
@given(st.integers(1, 12), st.integers(2, 12), st.integers(0, 30))
def test_config_files_with_aliases_anchors_and_deep_nesting(levels, fan_out, depth):
    """An alias bomb of `levels` x `fan_out`, and block mappings `depth` deep: refused at once."""
    lines = ["a0: &a0 [lol, lol]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan_out)}]")
    lines.append("train:" + "".join(f"\n{'  ' * (d + 1)}k{d}:" for d in range(depth)) + " 1")
    with tempfile.TemporaryDirectory() as tmp, Growth():
        path = Path(tmp) / "bomb.yaml"
        path.write_text("\n".join(lines) + "\n")
        code, _, err = show(["--config", str(path)])
        assert code == 2 and "Traceback" not in err, err
        one_error_line(err)
        assert "alias *a0" in err, err


@settings(FUZZ, max_examples=10)
@given(st.integers(0, 20_000), st.integers(1, 3000), st.sampled_from(["train", "x", "model"]))
def test_config_files_with_many_or_long_keys(num_keys, key_length, section):
    """Thousands of unknown keys, or keys of thousands of characters: one error line, its length bounded."""
    text = f"{section}:\n" + "".join(f"  k{i}: 1\n" for i in range(num_keys)) + f"  {'k' * key_length}: 1\n"
    with tempfile.TemporaryDirectory() as tmp, Growth():
        path = Path(tmp) / "keys.yaml"
        path.write_text(text)
        code, _, err = show(["--config", str(path)])
        assert code == 2 and "Traceback" not in err, err[:2000]
        one_error_line(err)


# ---- numeric flags of the commands that build things: past argparse and the config, up to the first
# check that touches nothing (an output folder that is a file), or through a run that is cheap -----------
flag_text = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.integers(0, 10_000).map(str),
    st.floats().map(repr),  # nan, inf, 1e+300, -0.0
    st.sampled_from(
        ["nan", "inf", "-inf", "1e9", "-0", "0x10", "1_000", "", " 7 ", "9" * 5000, "\u0663", "1.5"]
    ),
    st.text(max_size=30),
).filter(lambda t: "\0" not in t)
sizes = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(2**16, 2**45),
    st.floats(),
    st.lists(st.integers(1, 2**40), max_size=5),
    st.text(max_size=10),
)


def command(argv: list[str]) -> tuple[int, str]:
    """`neorec argv` in this process, within HANG_SECONDS: (exit code, stderr); argparse's refusals exit
    through SystemExit."""
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    assert time.perf_counter() - start < HANG_SECONDS, argv[:12]
    return code, err.getvalue()


def refused_in_one_line(argv: list[str], may_succeed: bool = False) -> None:
    code, err = command(argv)
    assert "Traceback" not in err, err[-3000:]
    if code == 0 and may_succeed:
        return
    assert code in (1, 2), (code, err[-2000:])
    lines = [line for line in err.splitlines() if line.startswith("neorec: error:")]
    assert len(lines) == 1 and err.endswith(lines[0] + "\n") and len(lines[0]) < MAX_ERROR_CHARS, err[-2000:]


TINY_SETS = [x for kv in [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 100]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=1000", "data.synthetic.eval_samples=500", "data.batch_size=250",
    "train.max_steps=2", "train.progress=false", "logging.plot=false", "logging.tensorboard=false",
] for x in ("--set", kv)]  # fmt: skip


@settings(FUZZ, max_examples=40)
@given(
    st.lists(st.tuples(st.sampled_from(["--nproc", "--ranks-per-node", "--batches", "--time-budget", "--threads"]),
                       flag_text), min_size=1, max_size=3),
    st.booleans(), st.sampled_from(["this", "a100-node", "paper"]),
)  # fmt: skip
def test_plan_flags_of_any_value(items, calibrate, cluster):
    """The output folder is a file: a value that passes every check is refused there, before any plan."""
    with tempfile.TemporaryDirectory() as tmp, Growth():
        taken = Path(tmp) / "taken"
        taken.write_text("")
        flags = [f"{flag}={value}" for flag, value in items] + (["--calibrate"] if calibrate else [])
        refused_in_one_line(["plan", *TINY_SETS, "--cluster", cluster, "--output-dir", str(taken), *flags])
        assert [p.name for p in Path(tmp).iterdir()] == ["taken"]


@settings(FUZZ, max_examples=40)
@given(st.lists(st.tuples(st.sampled_from(["data.synthetic.rows", "embedding.dim", "data.batch_size",
                                           "data.eval_batch_size", "model.top_mlp", "data.synthetic.latent_dim",
                                           "train.threads", "data.synthetic.num_sparse", "seed"]), sizes),
                max_size=3), flag_text)  # fmt: skip
def test_train_sizes_and_processes_of_any_value(items, nproc):
    """Sizes up to 2^70 reach the memory estimate; the output folder is a file, so a config that passes
    it is refused there, before anything is built."""
    overrides = [x for key, value in items for x in ("--set", set_item(key, value))]
    with tempfile.TemporaryDirectory() as tmp, Growth():
        taken = Path(tmp) / "taken"
        taken.write_text("")
        refused_in_one_line(["train", *TINY_SETS, *overrides, f"--nproc={nproc}", "--output-dir", str(taken)])
        assert [p.name for p in Path(tmp).iterdir()] == ["taken"]


FIXTURE_TSV = Path(__file__).parents[1] / "fixtures" / "criteo_20.tsv"
PREPROCESS_FLAGS = [
    "--eval-every",
    "--vocab-threshold",
    "--max-line-bytes",
    "--shard-lines",
    "--workers",
    "--table-rows",
]


def _more_than_one_worker(flag: str, value: str) -> bool:
    try:
        return flag == "--workers" and int(value) > 1
    except ValueError:
        return False


@settings(FUZZ, max_examples=30)
@given(st.lists(st.tuples(st.sampled_from(PREPROCESS_FLAGS),
                          st.one_of(flag_text, st.lists(st.integers(-5, 2**41), max_size=30).map(
                              lambda rows: ",".join(map(str, rows))))), min_size=1, max_size=3))  # fmt: skip
def test_preprocess_flags_of_any_value(items):
    """Criteo TSV preprocessing of a 20-line file: done, or refused in one line (workers stay 1: a
    valid count starts processes)."""
    assume(not any(_more_than_one_worker(flag, value) for flag, value in items))
    with tempfile.TemporaryDirectory() as tmp, Growth():
        flags = [f"{flag}={value}" for flag, value in items]
        argv = [
            "data",
            "preprocess",
            str(FIXTURE_TSV),
            "--out",
            str(Path(tmp) / "out"),
            "--no-progress",
            *flags,
        ]
        refused_in_one_line(argv, may_succeed=True)
