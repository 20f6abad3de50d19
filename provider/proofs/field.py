"""Polynomials over the prime field GF(65497), as TOPLOC encodes a chunk's top entries (arXiv 2501.16007):
the points (position-and-index, value) are interpolated and only the coefficients are sent, so the indices
travel for free. A verifier evaluates the polynomial at its own indices; where the index is one the prover
committed to it reads the prover's value back, elsewhere noise."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

PRIME = 65497  # the largest prime below 2**16: every coefficient fits in two bytes


@lru_cache(maxsize=1)
def _inverses() -> np.ndarray:
    """x**-1 mod PRIME for every x (index 0 unused), by Fermat: x**(p-2)."""
    base = np.arange(PRIME, dtype=np.int64)
    out = np.ones(PRIME, dtype=np.int64)
    e = PRIME - 2
    while e:
        if e & 1:
            out = out * base % PRIME
        base = base * base % PRIME
        e >>= 1
    return out


def injective_modulus(xs: np.ndarray) -> int:
    """The largest m <= PRIME under which `xs` (distinct non-negative integers) stay distinct (TOPLOC's rule):
    the points must be distinct field elements."""
    for m in range(PRIME, len(xs) - 1, -1):
        if len(np.unique(xs % m)) == len(xs):
            return m
    raise ValueError("no modulus keeps these points distinct")


def interpolate(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Coefficients c (lowest degree first) of the polynomial through (xs, ys) mod PRIME; xs distinct in
    [0, PRIME). Newton's divided differences, then expanded: O(n^2) in numpy rows."""
    x = np.asarray(xs, dtype=np.int64) % PRIME
    c = np.asarray(ys, dtype=np.int64) % PRIME
    n = len(x)
    inv = _inverses()
    for j in range(1, n):
        c[j:] = (c[j:] - c[j - 1:n - 1]) % PRIME * inv[(x[j:] - x[:n - j]) % PRIME] % PRIME
    poly = np.array([c[n - 1]], dtype=np.int64)
    for j in range(n - 2, -1, -1):  # poly <- poly * (X - x_j) + c_j
        nxt = np.zeros(len(poly) + 1, dtype=np.int64)
        nxt[1:] = poly
        nxt[:-1] -= x[j] * poly % PRIME
        nxt[0] += c[j]
        poly = nxt % PRIME
    return poly


def evaluate(coeffs: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """The polynomial (lowest degree first) at each of `xs`, mod PRIME (Horner)."""
    x = np.asarray(xs, dtype=np.int64) % PRIME
    out = np.zeros(len(x), dtype=np.int64)
    for c in np.asarray(coeffs, dtype=np.int64)[::-1]:
        out = (out * x + c) % PRIME
    return out
