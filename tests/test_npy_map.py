"""map_npy (neorec/data/npy_map.py): .npy files memory-mapped as plain arrays give what np.load gives,
for every dtype, shape and order the reader may meet; damaged files are ValueErrors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib import format as npy_format

from neorec.data.npy_map import map_npy

DTYPES = ["<i4", "<i8", "<u4", ">i4", "<f4", "<f8", "|b1", "|u1", "<f2"]


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=3),
    fortran=st.booleans(),
    version=st.sampled_from([(1, 0), (2, 0), (3, 0)]),
    seed=st.integers(0, 2**31),
)
def test_maps_what_np_load_reads(tmp_path_factory, dtype, shape, fortran, version, seed):
    rng = np.random.default_rng(seed)
    array = (rng.standard_normal(shape) * 100).astype(dtype)
    if fortran:
        array = np.asfortranarray(array)
    path = tmp_path_factory.mktemp("npy") / "a.npy"
    with open(path, "wb") as f:
        npy_format.write_array(f, array, version=version)
    got = map_npy(path)
    assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    assert not got.flags.writeable
    again = map_npy(path)  # the header parsed once: the second reads the same
    assert np.array_equal(again, array)


def test_damaged_files_are_value_errors(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(1000, dtype=np.int32))
    whole = path.read_bytes()
    path.write_bytes(whole[:-8])
    with pytest.raises(ValueError, match="truncated: .* bytes, its header says"):
        map_npy(path)
    path.write_bytes(b"not an array at all")
    with pytest.raises(ValueError, match="not a .npy file"):
        map_npy(path)
    np.save(path, np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="Python objects"):
        map_npy(path)
    with pytest.raises(OSError):
        map_npy(tmp_path / "missing.npy")
