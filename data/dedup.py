"""Duplicate problems in a candidate pool: exact repeats and near repeats (MinHash + LSH through rensa).

Exact: the same normalised prompt and reference. Near: Jaccard similarity of padded word n-gram sets at or
above the threshold with a kept row, with the same reference by default, reached on the whole text and on
its instance (the shingles that are not template wording repeated across the pool), so the siblings of
one generator template are not merged. Rows are judged in input order against kept rows only, and a
dropped row always points at a kept row, so the synthesize stage can quarantine each duplicate with a
reason that names the problem it repeats.

Also owns the text normalisation that deduplication and decontamination share.
"""

from __future__ import annotations

import math
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, compress
from operator import not_
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from rensa import RMinHash, RMinHashLSH

# Fixed so that one pool always gives the same sketches, hence the same duplicates.
MINHASH_SEED = 1234567
# LSH banding is chosen so a pair exactly at the threshold becomes a candidate with at least this
# probability; pairs further above it are found almost surely (0.8 with 128 permutations: 0.95 at 0.8,
# 0.994 at 0.85). Higher recall would need shorter bands, which flood the index with template siblings.
RECALL_AT_THRESHOLD = 0.9
# An LSH candidate gets the exact check when its sketch estimate is at most this many standard errors
# below the threshold: a pair exactly at the threshold passes 98% of the time, one 0.05 above almost
# always, while template siblings well below it are rejected without building their shingle sets.
ESTIMATE_MARGIN_SE = 2.0
_SKETCH_CHUNK = 4096
_SHINGLE_SET_CACHE = 4096


@dataclass(frozen=True)
class Duplicate:
    """A dropped row and the kept row it repeats."""

    index: int
    duplicate_of: int
    similarity: float
    kind: Literal["exact", "near"]


class NearDuplicateConfig(BaseModel):
    """Near-duplicate detection: Jaccard similarity of word n-gram sets, found through MinHash LSH."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    threshold: float = Field(0.8, gt=0.0, le=1.0, description="Jaccard similarity at which a row is a repeat")
    num_perm: int = Field(128, ge=8, le=1024, description="MinHash permutations")
    ngram: int = Field(3, ge=1, le=16, description="words per shingle")
    same_reference: bool = Field(
        True, description="a near repeat must also have the same reference (keeps template siblings apart)"
    )
    common_shingle_count: int | None = Field(
        50,
        ge=2,
        description="shingles seen this many times in the pool are template wording; a near repeat must also "
        "reach the threshold on the shingles outside them (None: no such check)",
    )


def normalise_text(text: str) -> str:
    """NFKC, casefolded, whitespace runs collapsed to one space and stripped.

    Spacing inside a token is kept: "12 + 34 =" and "12+34=" stay different texts, since telling
    formulas apart would need parsing them.
    """
    if text.isascii():  # NFKC leaves ASCII alone and casefold equals lower there: the common fast path
        return " ".join(text.lower().split())
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def word_shingles(normalised: str, n: int) -> list[str]:
    """The word n-grams of a normalised text, padded with n-1 empty words at each end.

    Padding puts every word, the first and last included, into exactly n shingles, so changing the
    final number of "Find the LCM of these numbers: 10, 38" costs as much similarity as changing a
    middle word (unpadded, that pair scores 0.8 and two different problems would merge). An empty word
    never comes out of split(), so padded shingles cannot collide with real ones, and a one-word prompt
    such as "12+34=" shares no shingle with "12+35=".
    """
    words = normalised.split()
    if not words:
        return []
    edge = [""] * (n - 1)
    padded = edge + words + edge
    return list(map(" ".join, zip(*(padded[k:] for k in range(n)))))


def jaccard(a: set[str], b: set[str]) -> float:
    """Exact Jaccard similarity of two shingle sets."""
    common = len(a & b)
    return common / (len(a) + len(b) - common)


def band_count(num_perm: int, threshold: float) -> int:
    """The fewest LSH bands (longest rows) that still reach RECALL_AT_THRESHOLD at the threshold.

    Bands must divide num_perm. Longer rows mean fewer false candidates to check.
    """
    for rows in sorted((r for r in range(1, num_perm + 1) if num_perm % r == 0), reverse=True):
        bands = num_perm // rows
        if 1.0 - (1.0 - threshold**rows) ** bands >= RECALL_AT_THRESHOLD:
            return bands
    return num_perm


def estimate_floor(num_perm: int, threshold: float) -> float:
    """The lowest sketch estimate worth an exact check (threshold less ESTIMATE_MARGIN_SE standard errors)."""
    return threshold - ESTIMATE_MARGIN_SE * math.sqrt(threshold * (1.0 - threshold) / num_perm)


def find_duplicates(prompts: Sequence[str], references: Sequence[str], near: NearDuplicateConfig) -> list[Duplicate]:
    """Every row that repeats an earlier kept row, in input order (see the module docstring for the rules).

    A near repeat points at the earliest kept row it matches; similarity is the exact Jaccard of the
    whole texts' shingle sets (1.0 for exact repeats).
    """
    if len(prompts) != len(references):
        raise ValueError(f"{len(prompts)} prompts but {len(references)} references")
    texts = [normalise_text(p) for p in prompts]
    refs = [normalise_text(r) for r in references]
    first_of = _first_occurrences(texts, refs)
    firsts = [i for i, f in enumerate(first_of) if f == i]
    near_found = _NearMatcher(texts, near).find(firsts, refs) if near.enabled else {}
    return _resolve(first_of, near_found)


def _first_occurrences(texts: list[str], refs: list[str]) -> list[int]:
    """For each row, the first row with the same (normalised prompt, normalised reference) key.

    The key is the pair itself in a dict: hashed for speed, compared in full, so no collision merges rows.
    """
    first: dict[tuple[str, str], int] = {}
    return [first.setdefault(key, i) for i, key in enumerate(zip(texts, refs))]


def _resolve(first_of: list[int], near_found: dict[int, Duplicate]) -> list[Duplicate]:
    """Exact copies point where their first occurrence went: to it if kept, else to the row it repeats."""
    found = []
    for i, f in enumerate(first_of):
        if f == i:
            if i in near_found:
                found.append(near_found[i])
        elif f in near_found:
            via = near_found[f]
            found.append(Duplicate(i, via.duplicate_of, via.similarity, via.kind))
        else:
            found.append(Duplicate(i, f, 1.0, "exact"))
    return found


class _NearMatcher:
    """MinHash sketches of the rows that may repeat, and the LSH search among the kept ones.

    Sketches cover a row's instance shingles: those seen fewer than common_shingle_count times in the
    pool. A generator repeats its template around every instance; with a long template and a short
    instance (two random strings, a True/False answer) every sibling would score above the threshold on
    the whole text and merge into the first row with its answer, while on the instance it scores near 0.
    A match must reach the threshold on both the instance and the whole text (one letter changed in
    'How many times does the letter "h" appear in <text>' leaves the instance equal).
    """

    def __init__(self, texts: list[str], near: NearDuplicateConfig) -> None:
        self.texts = texts
        self.near = near
        self.bands = band_count(near.num_perm, near.threshold)
        self.floor = estimate_floor(near.num_perm, near.threshold)
        self.common: set[int] = set()
        self.sketches: dict[int, RMinHash] = {}
        self._shingle_sets: dict[int, tuple[set[str], set[str]]] = {}

    def find(self, rows: list[int], refs: list[str]) -> dict[int, Duplicate]:
        """Near duplicates among rows, each taken in order against the rows kept before it in its group."""
        rows = [i for i in rows if self.texts[i]]
        self.common = self._common_shingles(rows)
        groups = self._groups(rows, refs)
        self._sketch([i for g in groups for i in g])
        found: dict[int, Duplicate] = {}
        for group in groups:
            found.update(self._find_in_group([i for i in group if i in self.sketches]))
        return found

    def _common_shingles(self, rows: list[int]) -> set[int]:
        """Hashes of the shingles seen at least common_shingle_count times among rows: template wording.

        Python's salted hash names shingles only within this call, so no result depends on it.
        """
        limit, n = self.near.common_shingle_count, self.near.ngram
        if limit is None:
            return set()
        counts = Counter(chain.from_iterable(map(hash, word_shingles(self.texts[i], n)) for i in rows))
        return {key for key, count in counts.items() if count >= limit}

    def _groups(self, rows: list[int], refs: list[str]) -> list[list[int]]:
        """Rows that may repeat each other: one group per reference (or one in all), singletons left out."""
        groups: dict[str, list[int]] = {}
        for i in rows:
            groups.setdefault(refs[i] if self.near.same_reference else "", []).append(i)
        return [g for g in groups.values() if len(g) > 1]

    def _instance(self, shingles: list[str]) -> list[str]:
        """The shingles that are not template wording (all of them when nothing in the pool is common)."""
        if not self.common:
            return shingles
        return list(compress(shingles, map(not_, map(self.common.__contains__, map(hash, shingles)))))

    def _sketch(self, rows: list[int]) -> None:
        """Sketch each row's instance through rensa's batch API, in chunks so shingle lists never all sit in memory.

        A row that is template wording throughout gets no sketch: it can only repeat exactly.
        """
        n = self.near.ngram
        for start in range(0, len(rows), _SKETCH_CHUNK):
            chunk = [(i, self._instance(word_shingles(self.texts[i], n))) for i in rows[start : start + _SKETCH_CHUNK]]
            chunk = [(i, shingles) for i, shingles in chunk if shingles]
            sketches = RMinHash.from_token_sets([s for _, s in chunk], self.near.num_perm, MINHASH_SEED)
            self.sketches.update(zip([i for i, _ in chunk], sketches))

    def _find_in_group(self, group: list[int]) -> dict[int, Duplicate]:
        """Rows in order: each is matched against the index of kept rows, and joins it when it matches none."""
        self._shingle_sets.clear()
        index = RMinHashLSH(self.near.threshold, self.near.num_perm, self.bands)
        found: dict[int, Duplicate] = {}
        for i in group:
            match = self._match(i, index.query(self.sketches[i]))
            if match is None:
                index.insert(i, self.sketches[i])
            else:
                found[i] = Duplicate(i, match[0], match[1], "near")
        return found

    def _match(self, row: int, candidates: list[int]) -> tuple[int, float] | None:
        """The earliest candidate reaching the threshold on the instance and on the whole text (the similarity).

        Both are exact Jaccard values; sketch estimates below the floor are pruned before computing them.
        """
        if not candidates:
            return None
        sketch, threshold = self.sketches[row], self.near.threshold
        estimates = map(sketch.jaccard, map(self.sketches.__getitem__, candidates))
        for j in sorted(compress(candidates, map(self.floor.__le__, estimates))):
            (whole, instance), (their_whole, their_instance) = self._shingle_sets_of(row), self._shingle_sets_of(j)
            if (
                jaccard(instance, their_instance) >= threshold
                and (similarity := jaccard(whole, their_whole)) >= threshold
            ):
                return j, similarity
        return None

    def _shingle_sets_of(self, row: int) -> tuple[set[str], set[str]]:
        """A row's whole and instance shingle sets, cached (kept rows meet many candidates) and bounded."""
        cached = self._shingle_sets.get(row)
        if cached is None:
            if len(self._shingle_sets) >= _SHINGLE_SET_CACHE:
                self._shingle_sets.clear()
            shingles = word_shingles(self.texts[row], self.near.ngram)
            cached = self._shingle_sets[row] = (set(shingles), set(self._instance(shingles)))
        return cached
