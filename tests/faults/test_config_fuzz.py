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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neorec.cli import main
from neorec.config.load import load_config
from neorec.config.reference import TABLE, config_keys

KEYS = [k.key.replace(TABLE, "C1") for k in config_keys()]
SECONDS = 5.0  # per example
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
    """`neorec config show argv` in this process: (exit code, stdout, stderr), within SECONDS."""
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["config", "show", *argv])
    assert time.perf_counter() - start < SECONDS, argv
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
    assert err.startswith("neorec: error: ") and err.count("neorec: error:") == 1, err
    assert len(err) < 20_000, err[:500]


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
            assert err.startswith("neorec: error: ") and err.count("neorec: error:") == 1, err
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
        assert code == 0 or err.count("neorec: error:") == 1, err


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
        assert code == 2 and err.count("neorec: error:") == 1 and "Traceback" not in err, err
        assert "alias *a0" in err, err
