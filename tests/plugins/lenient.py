"""A 'version 2' of the arithmetic verifier that also accepts an answer followed by junk (for relabel tests)."""

from __future__ import annotations

import re
from typing import Any

from rlvr.verifiers.arithmetic import ArithmeticVerifier
from rlvr.verifiers.base import Score


class LenientArithmetic(ArithmeticVerifier):
    name = "arithmetic"
    version = "2-lenient"

    def score(self, response: str, reference: Any) -> Score:
        match = re.match(r"\s*([+-]?\d+)", response or "")
        return super().score(match.group(1) if match else response, reference)
