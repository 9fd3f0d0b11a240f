"""crc32_combine against zlib.crc32 of the whole, on random parts (empty, odd and large lengths)."""

import zlib

import numpy as np

from neorec.utils.crc import crc32_combine


def test_combined_crc_is_the_crc_of_the_concatenation():
    rng = np.random.default_rng(0)
    for length_b in [0, 1, 2, 3, 7, 64, 4095, 100_003, 3 << 20]:
        for length_a in [0, 1, int(rng.integers(2, 50_000))]:
            a, b = rng.bytes(length_a), rng.bytes(length_b)
            assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (
                length_a,
                length_b,
            )


def test_a_file_from_many_parts():
    rng = np.random.default_rng(1)
    parts = [rng.bytes(int(n)) for n in rng.integers(0, 5000, 40)]
    crc = 0
    for part in parts:
        crc = crc32_combine(crc, zlib.crc32(part), len(part))
    assert crc == zlib.crc32(b"".join(parts))
