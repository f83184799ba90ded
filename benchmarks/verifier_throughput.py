"""Math labelling throughput: our pool (2 workers), and our store-backed reward cache, vs plain math-verify.

Inputs: mixed answers (`#### n`, boxed fractions, "the answer is" decimals), about 70% right;
`unmarked` is the same answers with no marker (read by math-verify's own extraction, issue 12).
Peer: a single-process loop calling math-verify's parse + verify on the same inputs.
Warm cache: the verdicts are committed to a store as a `reward_cache` artifact; a fresh cache index
then loads them from the store and answers every input (what the label stage does on repeats).

    python benchmarks/verifier_throughput.py [N] [mixed|decimal|unmarked]
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_inputs(n: int, seed: int = 0, marked: bool = True) -> list[tuple[str, str]]:
    """`marked=False`: the same answers with no marker (`So in all: n`, `$\\frac{p}{q}$`, "we get x")."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(2, 60)
        right = rng.random() < 0.7
        if i % 3 == 0:
            answer = a if right else a + 1
            last = f"#### {answer}" if marked else f"So in all: {answer}"
            pairs.append((f"She has {a} apples and buys more.\nSo she has {a} apples.\n{last}", str(a)))
        elif i % 3 == 1:
            num = a if right else a + 1
            fraction = f"\\frac{{{2 * num}}}{{{2 * b}}}"
            shown = f"\\boxed{{{fraction}}}" if marked else fraction
            pairs.append((f"Dividing, the result is ${shown}$.", f"\\frac{{{a}}}{{{b}}}"))
        else:
            shown = a / 4 if right else a / 4 + 0.25
            pairs.append(
                (f"Computing carefully, {'the answer is' if marked else 'we get'} {shown}.", f"\\frac{{{a}}}{{4}}")
            )
    return pairs


def main() -> None:
    import pyarrow as pa
    from math_verify import parse, verify

    from rlvr.storage.store import Store
    from rlvr.verifiers import cache as cache_module
    from rlvr.verifiers.cache import VerifierConfig, score_cached
    from rlvr.verifiers.pool import VerifierPool

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    kind = sys.argv[2] if len(sys.argv) > 2 else "mixed"
    if kind == "decimal":
        pairs = [p for i, p in enumerate(make_inputs(n * 3)) if i % 3 == 2][:n]
    else:
        pairs = make_inputs(n, marked=kind == "mixed")

    started = time.perf_counter()
    plain = [verify(parse(ref), parse(resp)) for resp, ref in pairs]
    t_plain = time.perf_counter() - started

    with VerifierPool("math", workers=2, timeout_s=5) as pool:
        pool.score_many(pairs[:10])  # workers started and warm
        started = time.perf_counter()
        pooled = pool.score_many(pairs)
        t_pool = time.perf_counter() - started

    store = Store.open(tempfile.mkdtemp(prefix="rlvr-bench-cache-"), create=True)
    cfg = VerifierConfig(verifier="math", workers=2)
    _, _, entries = score_cached(store, cfg, pairs)  # cold: fills the cache
    store.write_artifact(
        "reward_cache",
        "bench-reward-cache",
        pa.Table.from_pylist(entries),
        run_id="bench",
        stage="bench",
        parents=[],
        code_version="1",
        config={},
    )
    cache_module._caches.clear()  # a fresh index: verdicts come from the store
    started = time.perf_counter()
    cached, hits, _ = score_cached(store, cfg, pairs)
    t_cache = time.perf_counter() - started

    agree = sum((s.status == "ok") == bool(p) for s, p in zip(pooled, plain))
    same = sum((a.value, a.status) == (b.value, b.status) for a, b in zip(cached, pooled))
    print(
        f"{len(pairs)} {kind} answers; pool verdicts agree with plain math-verify on {agree}; "
        f"cached equal pooled on {same}; cache hits {sum(hits)}"
    )
    print(f"{'method':48}{'labels/s':>10}")
    print(f"{'plain math-verify parse+verify loop (peer)':48}{len(pairs) / t_plain:>10.0f}")
    print(f"{'VerifierPool(math, workers=2)':48}{len(pairs) / t_pool:>10.0f}")
    print(f"{'reward cache, warm (loaded from the store)':48}{len(pairs) / t_cache:>10.0f}")
    print(f"ratio vs plain loop: pool {t_plain / t_pool:.2f}x, warm cache {t_plain / t_cache:.1f}x")


if __name__ == "__main__":
    main()
