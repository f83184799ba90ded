"""How often an LLM judge agrees with the `final_number` verifier on SmolLM2-135M-Instruct's own answers.

    python benchmarks/judge_agreement.py [--answers 500] [--judge smollm2-135m-instruct] [--parser yes_no]
        [--threads 2] [--seed 0]

The answers: SmolLM2-135M-Instruct (`make smollm2`) answers arithmetic questions in words (the arithmetic
example's source: one-digit sums and differences and two-digit sums, which it sometimes gets right, and 3-digit
by 2-digit products, which it rarely does; a third each), one sampled answer each at temperature 0.7, at most 24
new tokens.
The verifier: `final_number` (the answer's last number equals the reference). The judge: `--judge` served by
`rlvr serve-rm`'s app (serving/server.py) in this process, asked by the judge client the run uses
(verifiers/judge.py) with the default grading template and parser: the same path as `reward.judge` in a run.

Printed: the verifier's and the judge's accept rates, agreement (the share where both say the same), Cohen's kappa
(agreement beyond what the two rates give by chance), the confusion counts, the judge's failed verdicts (left out
of the agreement) and the seconds each side took. A JSON line with the same figures goes to
benchmarks/out/judge_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from rlvr.data.sources import ArithmeticSource, ArithmeticSourceConfig
from rlvr.serving.reward_models import load_served_model
from rlvr.serving.server import reward_app, serving_in_thread
from rlvr.trainer.generation import sample
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.verifiers.arithmetic import FinalNumberVerifier
from rlvr.verifiers.judge import JudgeClient, JudgeConfig, JudgeItem

OUT = Path(__file__).resolve().parent / "out"


def questions(n: int, seed: int) -> list[dict[str, str]]:
    """n questions in words: a third one-digit sums and differences, a third two-digit sums, the rest 3-digit by
    2-digit products."""
    kinds = [
        ArithmeticSourceConfig(style="question", ops="+-", digits=1, count=200),
        ArithmeticSourceConfig(style="question", ops="+", digits=2, count=max(n, 1)),
        ArithmeticSourceConfig(style="question", ops="*", operand_digits=[3, 2], count=max(n, 1)),
    ]
    shares = [n // 3, n // 3, n - 2 * (n // 3)]
    rows = [row for kind, share in zip(kinds, shares) for row in [*ArithmeticSource(kind).rows(seed)][:share]]
    return [{"prompt": r["prompt"], "reference": r["answer"]} for r in rows]


def answers(policy: Policy, problems: list[dict[str, str]], seed: int) -> list[str]:
    drawn = sample(
        policy, [p["prompt"] for p in problems], [1] * len(problems), max_new_tokens=24, temperature=0.7,
        top_p=1.0, seed=seed,
    )  # fmt: skip
    return [s.text for s in drawn]


def kappa(both_yes: int, both_no: int, only_verifier: int, only_judge: int) -> float:
    """Cohen's kappa of two yes/no raters from their confusion counts."""
    n = both_yes + both_no + only_verifier + only_judge
    observed = (both_yes + both_no) / n
    verifier_yes, judge_yes = (both_yes + only_verifier) / n, (both_yes + only_judge) / n
    chance = verifier_yes * judge_yes + (1 - verifier_yes) * (1 - judge_yes)
    return (observed - chance) / (1 - chance) if chance < 1 else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=500)
    parser.add_argument("--judge", default="smollm2-135m-instruct")
    parser.add_argument("--parser", default="yes_no", choices=["yes_no", "score_10", "json"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    problems = questions(args.answers, args.seed)
    started = time.monotonic()
    policy = init_policy(PolicyConfig(model="smollm2-135m-instruct", threads=args.threads), seed=args.seed)
    responses = answers(policy, problems, args.seed)
    answering = time.monotonic() - started
    del policy
    verifier = FinalNumberVerifier()
    accepted = [verifier.score(r, p["reference"]).status == "ok" for r, p in zip(responses, problems)]

    started = time.monotonic()
    served = load_served_model(args.judge, threads=args.threads)
    with serving_in_thread(reward_app(served)) as url:
        judge = JudgeConfig(base_url=f"{url}/v1", model=args.judge, parser=args.parser, max_tokens=8, concurrency=2)
        items = [JudgeItem(p["prompt"], p["reference"], r) for p, r in zip(problems, responses)]
        verdicts = JudgeClient(judge).verdicts(items)
    judging = time.monotonic() - started

    counted = [(a, v.score.status == "ok") for a, v in zip(accepted, verdicts) if v.score.status != "error"]
    both_yes = sum(a and j for a, j in counted)
    both_no = sum(not a and not j for a, j in counted)
    only_verifier = sum(a and not j for a, j in counted)
    only_judge = sum(j and not a for a, j in counted)
    n = len(counted)
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "answers": len(problems),
        "judge": args.judge,
        "parser": args.parser,
        "judge_errors": len(verdicts) - n,
        "verifier_accepts": sum(accepted) / len(accepted),
        "judge_accepts": (both_yes + only_judge) / n if n else None,
        "agreement": (both_yes + both_no) / n if n else None,
        "kappa": kappa(both_yes, both_no, only_verifier, only_judge) if n else None,
        "confusion": {
            "both_yes": both_yes,
            "both_no": both_no,
            "only_verifier": only_verifier,
            "only_judge": only_judge,
        },
        "seconds": {"answering": round(answering, 1), "judging": round(judging, 1)},
        "example_replies": [v.raw for v in verdicts[:5]],
    }
    for key in ("verifier_accepts", "judge_accepts", "agreement", "kappa"):
        value = result[key]
        print(f"{key:>17}: {value:.3f}" if value is not None else f"{key:>17}: -")
    print(f"{'confusion':>17}: {result['confusion']}")
    print(f"{'judge errors':>17}: {result['judge_errors']} of {len(verdicts)}")
    print(f"{'seconds':>17}: {result['seconds']}")
    OUT.mkdir(exist_ok=True)
    with (OUT / "judge_agreement.json").open("a") as out:
        out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    sys.exit(main())
