"""Decontamination: training problems that overlap an evaluation set.

A text of at least n words is contaminated when it shares one word n-gram with an eval text (the
13-gram test of the GPT-3 and Llama reports), after the dedup normalisation with punctuation turned
into spaces, so reformatting a sentence does not hide it.

That test cannot see a text shorter than n words, which is most of an arithmetic eval. Such a text is
contaminated when its whole token sequence equals an eval text's, with each symbol kept as a token of
its own: "12+34=" and "12 + 34 =" are the same problem, "12*34=" is not (stripping punctuation would
merge all three). A short text that only occurs inside a longer one is not flagged either way: that
rule would flag every training text that contains a common short phrase.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rlvr.data.dedup import normalise_text

_WORD = re.compile(r"\w+")
_TOKEN = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class ContaminationHit:
    """Which eval text a training text overlaps, and the overlap as normalised words."""

    eval_index: int
    ngram: str


def _ngrams(words: Sequence[str], n: int) -> Iterator[tuple[str, ...]]:
    return zip(*(words[k:] for k in range(n)))


class Decontaminator:
    """An index of an eval set's n-grams (hashed, in a dict) and of its short texts."""

    def __init__(self, eval_texts: Sequence[str], n: int = 13) -> None:
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        self.n = n
        self._eval_words: list[tuple[str, ...]] = []
        self._ngram_owner: dict[int, int] = {}  # hash of an n-gram -> first eval text holding it
        self._short_owner: dict[tuple[str, ...], int] = {}
        for index, text in enumerate(eval_texts):
            self._add(index, normalise_text(text))

    def _add(self, index: int, normalised: str) -> None:
        words = tuple(_WORD.findall(normalised))
        self._eval_words.append(words)
        if len(words) >= self.n:
            for key in map(hash, _ngrams(words, self.n)):
                self._ngram_owner.setdefault(key, index)
        elif words:
            self._short_owner.setdefault(tuple(_TOKEN.findall(normalised)), index)

    def match(self, text: str) -> ContaminationHit | None:
        """The first overlap of text with the eval set (earliest n-gram in text), or None."""
        normalised = normalise_text(text)
        words = _WORD.findall(normalised)
        if len(words) < self.n:
            return self._match_short(normalised) if words else None
        grams = list(_ngrams(words, self.n))
        keys = list(map(hash, grams))
        if self._ngram_owner.keys().isdisjoint(keys):  # the common case, decided without a Python loop
            return None
        for gram, key in zip(grams, keys):
            owner = self._ngram_owner.get(key)
            # Python's hash is salted per process: the check makes a collision harmless, so the answer
            # never depends on the salt.
            if owner is not None and gram in _ngrams(self._eval_words[owner], self.n):
                return ContaminationHit(owner, " ".join(gram))
        return None

    def _match_short(self, normalised: str) -> ContaminationHit | None:
        tokens = tuple(_TOKEN.findall(normalised))
        owner = self._short_owner.get(tokens)
        return None if owner is None else ContaminationHit(owner, " ".join(tokens))
