"""crc32 of a concatenation from the crc32s of its parts (zlib's crc32_combine, which Python's zlib does
not expose): crc32(a + b) == crc32_combine(crc32(a), crc32(b), len(b)).

Polynomials over GF(2) are held reflected, as zlib's crc32 holds them: bit 31 is x^0. Combining shifts
the first crc by len(b) bytes of zeros, a multiplication by x^(8 len(b)) modulo the CRC-32 polynomial.
"""

from __future__ import annotations

from functools import lru_cache

_POLY = 0xEDB88320  # the CRC-32 polynomial, reflected
_ONE = 1 << 31  # x^0


def _multiply(a: int, b: int) -> int:
    """a(x) * b(x) modulo the polynomial."""
    product, bit = 0, _ONE
    while bit:
        if a & bit:
            product ^= b
            if not a & (bit - 1):
                break
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    powers = [_ONE >> 1]  # x^1
    for _ in range(31):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_TO_2_TO_K = _powers()


@lru_cache(maxsize=4096)
def _shift(num_bytes: int) -> int:
    """x^(8 num_bytes) modulo the polynomial."""
    power, k, n = _ONE, 3, num_bytes
    while n:
        if n & 1:
            power = _multiply(_X_TO_2_TO_K[k & 31], power)
        n >>= 1
        k += 1
    return power


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of a + b, from crc1 = crc32(a), crc2 = crc32(b) and len2 = len(b)."""
    if len2 <= 0:
        return crc1
    return _multiply(_shift(len2), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)
