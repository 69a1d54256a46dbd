"""Engram n-gram hashing (reference section 6; deepseek-ai/Engram engram_demo_v1.py).

Per Engram layer: multipliers m_k = 2*r_k + 1 with r = default_rng(seed + 10007*layer)
.integers(0, (2^63-1)//V//2, N) (numpy itself, not a port); for order n in 2..N and head j the
modulus is the next prime not used before, starting after engram_vocab_size[n-2] - 1 (primes
continue across layers). Token t's hash for order n is (XOR_{k<n} tok[t-k]*m_k) mod p; tokens
before the sequence start are pad_id. Row ids add the column's offset in the concatenated table.
Columns are order-major, then head.
"""
import numpy as np


def _is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


class EngramHash:
    def __init__(self, cfg):
        self.layers = list(cfg.engram_layer_ids)
        self.N = cfg.engram_max_ngram_size
        self.H = cfg.engram_n_heads
        self.pad = cfg.engram_pad_token_id
        V = cfg.engram_compressed_vocab_size
        bound = (2**63 - 1) // V // 2
        self.mult, self.primes, self.offsets, self.rows = [], [], [], []
        seen = set()
        for layer in self.layers:
            rng = np.random.default_rng(cfg.engram_seed + 10007 * layer)
            r = rng.integers(0, bound, size=self.N, dtype=np.int64)
            self.mult.append(r * 2 + 1)
            primes = []
            for n in range(2, self.N + 1):
                start = cfg.engram_vocab_size[n - 2] - 1
                for _ in range(self.H):
                    c = start + 1
                    while not _is_prime(c) or c in seen:
                        c += 1
                    seen.add(c)
                    primes.append(c)
                    start = c
            self.primes.append(np.array(primes, dtype=np.int64))
            self.offsets.append(np.concatenate([[0], np.cumsum(primes)[:-1]]).astype(np.int64))
            self.rows.append(int(sum(primes)))

    @property
    def columns(self):
        return (self.N - 1) * self.H

    def row_ids(self, slot, ids):
        """ids: int array [B, T] (sequences starting at position 0) -> row ids [B, T, columns]."""
        ids = np.asarray(ids, dtype=np.int64)
        B, T = ids.shape
        mult, primes = self.mult[slot], self.primes[slot]
        mix = np.zeros((B, T), dtype=np.int64)
        cols = []
        with np.errstate(over="ignore"):
            for k in range(self.N):
                shifted = np.full((B, T), self.pad, dtype=np.int64)
                if k < T:
                    shifted[:, k:] = ids[:, :T - k]
                mix = mix ^ (shifted * mult[k])
                if k == 0:
                    continue
                n = k + 1
                for j in range(self.H):
                    cols.append(np.mod(mix, primes[(n - 2) * self.H + j]))
        return np.stack(cols, axis=-1) + self.offsets[slot]
