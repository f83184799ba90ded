"""Verifiers used only by the tests (loaded by import path, e.g. `tests.plugins.lenient:LenientArithmetic`)."""
