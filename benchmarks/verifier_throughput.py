import random, time, sys
from math_verify import parse, verify
from verifiers.pool import VerifierPool
from verifiers.math import MathVerifier

def make_inputs(n, seed=0):
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        kind = i % 3
        a, b = rng.randint(1, 999), rng.randint(2, 60)
        right = rng.random() < 0.7
        if kind == 0:
            ans = a if right else a + 1
            pairs.append((f"She has {a} apples and buys more.\nSo she has {a} apples.\n#### {ans}", str(a)))
        elif kind == 1:
            num = a if right else a + 1
            pairs.append((f"Dividing, the result is $\\boxed{{\\frac{{{2*num}}}{{{2*b}}}}}$.", f"\\frac{{{a}}}{{{b}}}"))
        else:
            x = a / 4
            shown = x if right else x + 0.25
            pairs.append((f"Computing carefully, the answer is {shown}.", f"\\frac{{{a}}}{{4}}"))
    return pairs

def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    only = sys.argv[2] if len(sys.argv) > 2 else "mixed"
    pairs = make_inputs(n)
    if only == "decimal":
        pairs = [p for i, p in enumerate(make_inputs(n * 3)) if i % 3 == 2][:n]
    t = time.perf_counter()
    base = [verify(parse(ref), parse(resp)) for resp, ref in pairs]
    t_base = time.perf_counter() - t
    t = time.perf_counter()
    v = MathVerifier()
    single = [v.score(resp, ref) for resp, ref in pairs]
    t_single = time.perf_counter() - t
    with VerifierPool("math", workers=2, timeout_s=5) as pool:
        pool.score_many(pairs[:10])  # warm: workers started
        t = time.perf_counter()
        scores = pool.score_many(pairs)
        t_pool = time.perf_counter() - t
    agree = sum((s.status == "ok") == b for s, b in zip(scores, base))
    print(f"inputs {len(pairs)} ({only}); statuses: " + ", ".join(f"{k}={sum(s.status==k for s in scores)}" for k in ("ok","wrong","unparseable","timeout","error")))
    print(f"{'math-verify parse+verify loop (1 process)':45s} {len(pairs)/t_base:9.0f} labels/s")
    print(f"{'MathVerifier in-process loop (1 process)':45s} {len(pairs)/t_single:9.0f} labels/s")
    print(f"{'VerifierPool(math, workers=2)':45s} {len(pairs)/t_pool:9.0f} labels/s")
    print(f"verdict agreement with plain math-verify: {agree}/{len(pairs)}")
    print(f"ratio pool / plain loop: {t_base/t_pool:.2f}x")

if __name__ == "__main__":
    main()
