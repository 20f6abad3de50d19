"""A job's commitment: for every generated token, the TOP_K largest-magnitude entries of the final-norm hidden
state that produced it, as (index, float16 bits); per chunk of CHUNK tokens the CHUNK * TOP_K points
(position * hidden_size + index, bits) become one polynomial (`field`), sent as its coefficients.

Per token, not over the flattened chunk as TOPLOC does: every token is covered alike, so a splice or an edit
shows at the chunk it touches. Float16 rather than the model's bfloat16: three more mantissa bits, so the
tolerances can be tight where decode and prefill agree closely (CPU: exactly). Size: 2 + 2 * CHUNK * TOP_K
bytes per chunk, 8.06 bytes a token, and a 4-byte header.

    header: b"C" version(1) TOP_K CHUNK; then per chunk: u16 modulus, u16 coefficients (big-endian)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .field import PRIME, evaluate, injective_modulus, interpolate

VERSION = 1
TOP_K = 4
CHUNK = 32
HEADER = bytes([ord("C"), VERSION, TOP_K, CHUNK])


class CommitmentError(ValueError):
    """The bytes are not a commitment of this format, or not of this many tokens."""


def _points(indices: np.ndarray, bits: np.ndarray, hidden_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-token entries [n, TOP_K] -> the chunk's points: x = position * hidden_size + index, y = bits
    (finite float16 bits are below PRIME; NaN's are not and are folded to PRIME - 1)."""
    n = indices.shape[0]
    xs = (np.arange(n, dtype=np.int64)[:, None] * hidden_size + indices.astype(np.int64)).reshape(-1)
    ys = np.minimum(bits.astype(np.int64).reshape(-1), PRIME - 1)
    return xs, ys


def encode_chunk(indices: np.ndarray, bits: np.ndarray, hidden_size: int) -> bytes:
    xs, ys = _points(indices, bits, hidden_size)
    m = injective_modulus(xs)
    coeffs = interpolate(xs % m, ys)
    return m.to_bytes(2, "big") + coeffs.astype(">u2").tobytes()


def chunk_sizes(tokens: int) -> list[int]:
    return [min(CHUNK, tokens - i) for i in range(0, tokens, CHUNK)]


def decode(data: bytes, tokens: int) -> list[tuple[int, np.ndarray]]:
    """Each chunk's (modulus, coefficients) of a commitment to `tokens` tokens; CommitmentError if the bytes
    are anything else."""
    if data[:4] != HEADER:
        raise CommitmentError("not a commitment of this version")
    sizes = chunk_sizes(tokens)
    if len(data) != len(HEADER) + sum(2 + 2 * TOP_K * s for s in sizes):
        raise CommitmentError(f"{len(data)} bytes is not a commitment to {tokens} tokens")
    out, at = [], len(HEADER)
    for s in sizes:
        m = int.from_bytes(data[at:at + 2], "big")
        coeffs = np.frombuffer(data[at + 2:at + 2 + 2 * TOP_K * s], dtype=">u2").astype(np.int64)
        if not TOP_K * s <= m <= PRIME or (coeffs >= PRIME).any():
            raise CommitmentError("a chunk's modulus or coefficients are outside the field")
        out.append((m, coeffs))
        at += 2 + 2 * TOP_K * s
    return out


class CommitmentBuilder:
    """A job's entries as its tokens are made, one row per produced token, encoded a chunk at a time as chunks
    fill. A row may come for a token never emitted (the last, read ahead, or an end token): `finish(n)` keeps
    the first n, re-encoding a last chunk that held more."""

    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size
        self._indices: list[np.ndarray] = []
        self._bits: list[np.ndarray] = []
        self._chunks: list[bytes] = []

    def __len__(self) -> int:
        return len(self._indices)

    def add(self, indices: np.ndarray, bits: np.ndarray) -> None:
        """Rows [n, TOP_K] of entries of the next n tokens."""
        self._indices.extend(indices)
        self._bits.extend(bits)
        while len(self._chunks) * CHUNK + CHUNK + 1 <= len(self._indices):  # a full chunk, and it is not the end
            self._chunks.append(self._encode(len(self._chunks) * CHUNK, CHUNK))

    def _encode(self, start: int, size: int) -> bytes:
        return encode_chunk(np.stack(self._indices[start:start + size]), np.stack(self._bits[start:start + size]),
                            self.hidden_size)

    def finish(self, tokens: int) -> bytes | None:
        """The commitment to the first `tokens` tokens; None if fewer rows came (the job's entries are missing)."""
        if len(self._indices) < tokens:
            return None
        full = tokens // CHUNK
        chunks = self._chunks[:full]
        chunks += [self._encode(i * CHUNK, CHUNK) for i in range(len(chunks), full)]
        if tokens % CHUNK:
            chunks.append(self._encode(full * CHUNK, tokens % CHUNK))
        return HEADER + b"".join(chunks)


@dataclass(frozen=True)
class ChunkMatch:
    """How one chunk's commitment meets the verifier's own entries: of its points, how many the polynomial
    gives back within `rel_tol` of the verifier's value (an index the prover did not commit to gives noise),
    and over those, the largest and mean relative error."""

    start: int  # its first token's output position
    points: int
    matched: int
    max_rel_err: float
    mean_rel_err: float

    @property
    def overlap(self) -> float:
        return self.matched / self.points if self.points else 1.0


def match_chunk(start: int, modulus: int, coeffs: np.ndarray, indices: np.ndarray, bits: np.ndarray,
                hidden_size: int, rel_tol: float) -> ChunkMatch:
    """The verifier's entries [n, TOP_K] of a chunk against the prover's polynomial."""
    xs, ys = _points(indices, bits, hidden_size)
    claimed = evaluate(coeffs, xs % modulus).astype(np.uint16).view(np.float16).astype(np.float64)
    own = ys.astype(np.uint16).view(np.float16).astype(np.float64)
    with np.errstate(all="ignore"):
        rel = np.abs(claimed - own) / np.maximum(np.abs(own), 1e-3)
    ok = np.isfinite(rel) & (rel <= rel_tol)
    errs = rel[ok]
    return ChunkMatch(start, len(xs), int(ok.sum()), float(errs.max()) if len(errs) else 0.0,
                      float(errs.mean()) if len(errs) else 0.0)
