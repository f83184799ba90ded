"""RLPR (label.reward=rlpr, docs/rewards.md#rlpr): where a response states its answer, the reward against a hand
computation from the tiny model's logits (the debiasing term, the clip and the format term included), batched
passes equal to one row at a time, the standard-deviation filter's decisions and EMA by hand, and whole tiny runs:
rewards rows from the `rlpr` verifier with their provenance, the debiasing terms computed once per problem and
policy, and a killed run resumed to the uninterrupted one's artifacts."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rlvr.curricula.filtering import (
    DynamicSamplingConfig,
    StdFilterConfig,
    filter_groups,
    group_std,
    std_filter_state,
    step_std_ema,
)
from rlvr.errors import UserError
from rlvr.storage.stage import Inputs, StageContext
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.tasks.filter import build as filter_build
from rlvr.tasks.rlpr import build as rlpr_build
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.trainer.rlpr import reference_probabilities
from rlvr.verifiers.arithmetic import final_number
from rlvr.verifiers.cache import VerifierConfig
from rlvr.verifiers.rlpr import ReferenceText, RLPRConfig, answer_span, rlpr_reward
from tests.fork_server import Forked

# ----- where a response states its answer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "start", "end", "how"),
    [
        ("34 + 6 = 40.", 9, 11, "last_number"),
        ("91-39", 3, 5, "last_number"),  # the minus is the operation's, not the number's
        ("it is -12", 6, 9, "last_number"),  # a sign of its own is the answer's
        ("+5", 1, 2, "last_number"),
        ("that makes 1,234.5 apples", 11, 18, "last_number"),
        ("12*1=12", 5, 7, "last_number"),
        ("so \\boxed{\\frac{1}{2}}, checked 3 times", 10, 21, "boxed"),  # boxed before any later number
        ("\\boxed{} and then 7", 18, 19, "last_number"),  # an empty box is no answer
        ("<think>2+2</think><answer> 4 </answer> 5", 27, 28, "answer_tag"),  # RLPR's own format first
        ("<answer> </answer>\\boxed{x}", 25, 26, "boxed"),
    ],
)
def test_answer_span(response, start, end, how):
    span = answer_span(response)
    assert span is not None
    assert (span.start, span.end, span.how) == (start, end, how)


@pytest.mark.parametrize("response", ["", "no number here", "\\boxed{ }", "<answer></answer>", "+-*="])
def test_no_answer_span(response):
    assert answer_span(response) is None


@pytest.mark.parametrize(
    "response", ["34 + 6 = 40.", "91-39", "7 - -12", "+5", "1,234 and 5,67", "x 12.50 y", "3.", "a1b22c333", "-0"]
)
def test_last_number_span_is_what_final_number_scores(response):
    span = answer_span(response)
    assert span is not None and span.how == "last_number"
    assert response[span.start : span.end].replace(",", "") == final_number(response)


def test_rlpr_reward_clips_and_adds_the_format_term():
    cfg = RLPRConfig()
    assert rlpr_reward(0.9, 0.2, True, cfg) == pytest.approx(0.9 * 0.7 + 0.1)
    assert rlpr_reward(0.3, 0.5, True, cfg) == pytest.approx(0.1)  # below the debiasing term: clipped to 0
    assert rlpr_reward(0.9, 0.2, False, cfg) == pytest.approx(0.63)
    assert rlpr_reward(0.9, 0.2, True, RLPRConfig(format_weight=0.0)) == pytest.approx(0.7)


# ----- the probabilities, by hand -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Policy:
    return init_policy(PolicyConfig(), seed=3)


def by_hand(policy: Policy, prompt: str, before: str, reference: str) -> float:
    """The mean over the reference's characters (one token each, whitespace dropped) of the softmax of the
    logits at the position before each, from one plain forward of the whole sequence, in float64."""
    tokenizer = policy.tokenizer
    prompt_ids = tokenizer(prompt)["input_ids"]
    head = tokenizer(before, add_special_tokens=False)["input_ids"] if before.strip() else []
    tail = tokenizer(reference, add_special_tokens=False)["input_ids"]
    ids = prompt_ids + head + tail
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids])).logits[0].double()
    first = len(prompt_ids) + len(head)
    probabilities = [torch.softmax(logits[k - 1], dim=-1)[ids[k]].item() for k in range(first, len(ids))]
    return sum(probabilities) / len(probabilities)


def test_the_reward_is_the_hand_computation(tiny):
    rollouts = pa.table(
        {
            "rollout_id": ["a", "b", "c", "d"],
            "problem_id": ["p", "p", "p", "q"],
            "prompt": ["12+7=", "12+7=", "12+7=", "5*1="],
            "response": ["1+18=19", "20", "+*=", "=5"],  # the third states no answer
            "finish_reason": ["stop"] * 4,
        }
    )
    problems = pa.table({"problem_id": ["p", "q"], "prompt": ["12+7=", "5*1="], "reference": ["19", "5"]})
    cfg = VerifierConfig(reward="rlpr")
    ctx = StageContext("r", 0, 1, "rlpr", {}, {}, {})
    inputs = Inputs.given(rollouts=rollouts, problems=problems, policy=tiny, debias_policy=tiny)
    built = rlpr_build(inputs, cfg, ctx)
    rows = built["rewards"].table.to_pylist()
    terms = {t["problem_id"]: t for t in built["rlpr_debias"].table.to_pylist()}
    debias = {"p": by_hand(tiny, "12+7=", " ", "19"), "q": by_hand(tiny, "5*1=", " ", "5")}
    assert sorted(terms) == ["p", "q"]
    for pid in "pq":
        assert terms[pid]["probability"] == pytest.approx(debias[pid], abs=1e-6)
        assert terms[pid]["policy_id"] == "given-debias_policy"
    raw = {"a": by_hand(tiny, "12+7=", "1+18=", "19"), "b": by_hand(tiny, "12+7=", "", "19")}
    raw["d"] = by_hand(tiny, "5*1=", "=", "5")
    assert raw["a"] > debias["p"] and raw["d"] < debias["q"]  # both sides of the clip are exercised
    for row in rows:
        rid, pid = row["rollout_id"], row["problem_id"]
        provenance = json.loads(row["provenance"])
        assert (row["verifier"], row["verifier_version"]) == ("rlpr", "2")
        assert provenance["policy"] == "given-policy" and provenance["debias_policy"] == "given-debias_policy"
        assert provenance["debias"] == pytest.approx(debias[pid], abs=1e-6)
        if rid == "c":  # no answer: RLPR's code gives the reward 0 and no format term
            assert (row["score"], row["status"], row["extracted"]) == (0.0, "unparseable", None)
            assert provenance["raw"] == 0.0 and "tokens" not in provenance
            continue
        expected = 0.9 * min(max(raw[rid] - debias[pid], 0.0), 1.0) + 0.1
        assert row["status"] == "ok"
        assert provenance["raw"] == pytest.approx(raw[rid], abs=1e-6)
        assert row["score"] == pytest.approx(expected, abs=1e-6)
        assert json.loads(row["components"])["format"] == 1.0
    assert [r["extracted"] for r in rows] == ["19", "20", None, "5"]
    # "20" replaced by the reference reads "19" right after the prompt, the same text as the debiasing term; "=5"
    # makes the reference less likely than no reasoning: both are clipped to 0 and keep the format term
    assert rows[1]["score"] == pytest.approx(0.1, abs=1e-6) and rows[3]["score"] == pytest.approx(0.1, abs=1e-6)
    assert rows[0]["score"] == pytest.approx(0.9 * (raw["a"] - debias["p"]) + 0.1, abs=1e-6)
    assert json.loads(rows[0]["provenance"])["tokens"] == 2


def test_a_cut_off_response_states_no_answer_unless_score_cut_off(tiny):
    rollouts = pa.table(
        {
            "rollout_id": ["done", "cut"],
            "problem_id": ["p", "p"],
            "prompt": ["12+7=", "12+7="],
            "response": ["1+18=19", "1+18=1+1"],  # the second ran out of tokens in its working
            "finish_reason": ["stop", "length"],
        }
    )
    problems = pa.table({"problem_id": ["p"], "prompt": ["12+7="], "reference": ["19"]})
    ctx = StageContext("r", 0, 1, "rlpr", {}, {}, {})

    def rewards(**rlpr) -> dict[str, dict]:
        inputs = Inputs.given(rollouts=rollouts, problems=problems, policy=tiny, debias_policy=tiny)
        built = rlpr_build(inputs, VerifierConfig(reward="rlpr", rlpr=RLPRConfig(**rlpr)), ctx)
        return {r["rollout_id"]: r for r in built["rewards"].table.to_pylist()}

    strict, lenient = rewards(), rewards(score_cut_off=True)
    assert (strict["cut"]["score"], strict["cut"]["status"], strict["cut"]["extracted"]) == (0.0, "unparseable", None)
    assert strict["cut"]["reason"] == (
        "the response was cut off by max_new_tokens before it ended (label.rlpr.score_cut_off is false)"
    )
    assert json.loads(strict["cut"]["components"])["format"] == 0.0
    # read as before: its last number "1" replaced by the reference, "1+18=1+" then "19"
    debias = by_hand(tiny, "12+7=", " ", "19")
    raw = by_hand(tiny, "12+7=", "1+18=1+", "19")
    assert (lenient["cut"]["status"], lenient["cut"]["extracted"]) == ("ok", "1")
    assert lenient["cut"]["score"] == pytest.approx(0.9 * min(max(raw - debias, 0.0), 1.0) + 0.1, abs=1e-6)
    assert strict["done"]["score"] == lenient["done"]["score"] and strict["done"]["status"] == "ok"


def test_known_terms_are_reused_not_recomputed(tiny):
    rollouts = pa.table(
        {"rollout_id": ["a"], "problem_id": ["p"], "prompt": ["3+4="], "response": ["7"], "finish_reason": ["stop"]}
    )
    problems = pa.table({"problem_id": ["p"], "prompt": ["3+4="], "reference": ["7"]})
    known = pa.table(
        {"problem_id": ["p", "p"], "policy_id": ["other", "given-debias_policy"], "probability": [0.9, 0.0125]}
    )
    inputs = Inputs.given(rollouts=rollouts, problems=problems, policy=tiny, debias_policy=tiny, debias=known)
    built = rlpr_build(inputs, VerifierConfig(reward="rlpr"), StageContext("r", 0, 1, "rlpr", {}, {}, {}))
    assert built["rlpr_debias"].table.num_rows == 0  # the term of this policy was given
    assert json.loads(built["rewards"].table.column("provenance")[0].as_py())["debias"] == 0.0125


def test_batched_equals_one_at_a_time(tiny):
    texts = [
        ReferenceText("12+7=", "1+18=", "19"),
        ReferenceText("5*1=", "", "5"),
        ReferenceText("99+1=", "9*9=81+19=", "100"),
        ReferenceText("3-1=", " ", "2"),
        ReferenceText("8*10=", "8*1=8=", "80"),
    ]
    batched = reference_probabilities(tiny, texts)
    alone = [reference_probabilities(tiny, [text])[0] for text in texts]
    split = reference_probabilities(tiny, texts, micro_batch_tokens=20)  # a few rows a pass
    for together, single, parts in zip(batched, alone, split):
        assert together.tokens == single.tokens == parts.tokens
        assert together.mean == pytest.approx(single.mean, abs=1e-6)
        assert parts.mean == pytest.approx(single.mean, abs=1e-6)
    assert [b.tokens for b in batched] == [2, 1, 3, 1, 2]
    assert reference_probabilities(tiny, texts) == batched  # the same inputs, the same numbers


def by_hand_after(policy: Policy, text: ReferenceText) -> list[float]:
    """The probabilities of the reference's characters and of the one token after them (`after`'s first character,
    or the eos), from one plain forward in float64 (the tiny model's tokens are characters, whitespace dropped)."""
    tokenizer = policy.tokenizer
    prompt_ids = tokenizer(text.prompt)["input_ids"]
    head, tail, after = (
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in (text.before, text.reference, text.after)
    )
    ids = prompt_ids + head + tail + after + [tokenizer.eos_token_id]
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids])).logits[0].double()
    first = len(prompt_ids) + len(head)
    positions = range(first, first + len(tail) + 1)
    return [torch.softmax(logits[k - 1], dim=-1)[ids[k]].item() for k in positions]


def test_the_end_token_joins_the_mean_capped(tiny):
    texts = [
        ReferenceText("12+7=", "1+18=", "19", "+5", True),  # the end token is "+"
        ReferenceText("5*1=", "=", "5", "", True),  # it ended after its answer: the eos
        ReferenceText("8*10=", "8*1=", "80", "", False),  # cut off right after it: no end token
    ]
    plain = reference_probabilities(tiny, texts)
    ended = reference_probabilities(tiny, texts, end_cap=1.0)
    capped = reference_probabilities(tiny, texts, end_cap=0.001)
    for k in (0, 1):
        hand = by_hand_after(tiny, texts[k])
        assert plain[k].mean == pytest.approx(sum(hand[:-1]) / len(hand[:-1]), abs=1e-6)
        assert ended[k].end == pytest.approx(hand[-1], abs=1e-6) and ended[k].tokens == len(hand) - 1
        assert ended[k].mean == pytest.approx(sum(hand) / len(hand), abs=1e-6)
        assert hand[-1] > 0.001  # so the cap bites
        assert capped[k].mean == pytest.approx((sum(hand[:-1]) + 0.001) / len(hand), abs=1e-6)
    assert plain[0].end is None and ended[2] == capped[2] == plain[2]  # nothing followed the cut-off answer
    # batched with the end token equals one row at a time
    assert [reference_probabilities(tiny, [t], end_cap=1.0)[0].mean for t in texts] == pytest.approx(
        [e.mean for e in ended], abs=1e-6
    )


def test_the_end_token_changes_no_id_at_its_defaults():
    from rlvr.trainer.rlpr import rlpr_identity

    default = rlpr_identity(VerifierConfig(reward="rlpr"), {})
    assert "end_token" not in default["rlpr"] and "end_token_cap" not in default["rlpr"]
    assert rlpr_identity(VerifierConfig(reward="rlpr", rlpr=RLPRConfig(end_token=True)), {})["rlpr"]["end_token"]
    assert RLPRConfig(end_token=True, end_token_cap=0.5).end_cap() == 0.5 and RLPRConfig().end_cap() is None


def test_an_answer_that_begins_with_the_reference_pays_at_its_end(tiny):
    """The stage reads what followed the answer: with the end token a rollout's row records its probability, and
    the reward is the mean over the reference and that token (the eos for a response that ended there)."""
    rollouts = pa.table(
        {
            "rollout_id": ["dot", "eos"],
            "problem_id": ["p", "p"],
            "prompt": ["3+4=", "3+4="],
            "response": ["1+6=70.", "3+4=8"],
            "finish_reason": ["stop", "stop"],
        }
    )
    problems = pa.table({"problem_id": ["p"], "prompt": ["3+4="], "reference": ["7"]})
    ctx = StageContext("r", 0, 1, "rlpr", {}, {}, {})
    inputs = Inputs.given(rollouts=rollouts, problems=problems, policy=tiny, debias_policy=tiny)
    cfg = VerifierConfig(reward="rlpr", rlpr=RLPRConfig(end_token=True))
    built = rlpr_build(inputs, cfg, ctx)
    rows = {r["rollout_id"]: r for r in built["rewards"].table.to_pylist()}
    debias = by_hand_after(tiny, ReferenceText("3+4=", " ", "7", "", True))
    assert built["rlpr_debias"].table.column("probability")[0].as_py() == pytest.approx(sum(debias) / 2, abs=1e-6)
    for rid, text in (
        ("dot", ReferenceText("3+4=", "1+6=", "7", ".", True)),
        ("eos", ReferenceText("3+4=", "3+4=", "7", "", True)),
    ):
        hand = by_hand_after(tiny, text)
        provenance = json.loads(rows[rid]["provenance"])
        assert provenance["end"] == pytest.approx(hand[-1], abs=1e-6) and provenance["tokens"] == 1
        assert provenance["raw"] == pytest.approx(sum(hand) / 2, abs=1e-6)
        expected = 0.9 * min(max(sum(hand) / 2 - sum(debias) / 2, 0.0), 1.0) + 0.1
        assert rows[rid]["score"] == pytest.approx(expected, abs=1e-6)


def test_smollm2_reads_the_reference_through_its_chat_template(smollm2_tokenizer):
    """A BPE model with a chat template: the reference's tokens are the last ones of the rewritten response (digits
    are tokens of their own in SmolLM2's vocabulary), read after the templated prompt; the numbers are a forward by
    hand, and the reference is likelier after right reasoning than after wrong reasoning or none."""
    from rlvr.trainer.prompts import prompt_ids
    from rlvr.verifiers.rlpr import with_reference, without_reasoning

    policy = init_policy(PolicyConfig(model="smollm2-135m-instruct"), seed=0)
    prompt, reference = "What is 34 + 6?", "40"
    right, wrong = "34 + 6 = 40. The answer is 40.", "34 + 6 = 41. The answer is 41."
    texts = [with_reference(prompt, r, answer_span(r), reference, True) for r in (right, wrong)]  # type: ignore[arg-type]
    texts.append(without_reasoning(prompt, reference, RLPRConfig()))
    found = reference_probabilities(policy, texts)
    assert [f.tokens for f in found] == [2, 2, 2]
    prompt_tokens = prompt_ids(policy.tokenizer, [prompt])[0]
    assert smollm2_tokenizer.decode(prompt_tokens).endswith("<|im_start|>assistant\n")
    for text, term in zip(texts, found):
        tail = policy.tokenizer(text.before + text.reference, add_special_tokens=False)["input_ids"]
        ids = prompt_tokens + tail
        assert smollm2_tokenizer.decode(ids[-2:]) == "40"
        with torch.no_grad():
            logits = policy.model(torch.tensor([ids])).logits[0].double()
        hand = [torch.softmax(logits[k - 1], dim=-1)[ids[k]].item() for k in (len(ids) - 2, len(ids) - 1)]
        assert term.mean == pytest.approx(sum(hand) / 2, abs=1e-5)
    assert found[0].mean > found[1].mean > found[2].mean


def test_smollm2_reads_an_answer_that_begins_with_the_reference_as_the_reference_unless_the_end_token_is_read(
    smollm2_tokenizer,
):
    """The flaw seen in SmolLM2's RLPR runs (docs/rewards.md#rlpr): "70" for 7 is read as "The answer is 7", whose
    "7" is as likely as the right answer's; its end token (".", where the policy meant "0") is not."""
    from rlvr.verifiers.rlpr import with_reference

    policy = init_policy(PolicyConfig(model="smollm2-135m-instruct"), seed=0)
    prompt = "What is 1 * 7? Show your working, then give the final answer as 'Answer: <number>'."
    responses = ["1 * 7 = 7. The answer is 7.", "1 * 7 = 7 * 10 = 70. The answer is 70.", "1 * 7 = 8. The answer is 8."]
    texts = [with_reference(prompt, r, answer_span(r), "7", True) for r in responses]  # type: ignore[arg-type]
    right, prefix, wrong = reference_probabilities(policy, texts)
    assert abs(right.mean - prefix.mean) < 0.05 and prefix.mean > 0.9 > 0.1 > wrong.mean  # the flaw
    ended = reference_probabilities(policy, texts, end_cap=0.5)
    assert ended[1].end is not None and ended[1].end < 0.05  # "." after "... is 7" where the policy meant 70
    for plain, end in zip((right, prefix, wrong), ended):
        assert end.end is not None and end.mean == pytest.approx((plain.mean + min(end.end, 0.5)) / 2, abs=1e-6)
    assert ended[0].mean > ended[1].mean + 0.2 and ended[1].mean > ended[2].mean


# ----- the standard-deviation filter ----------------------------------------------------------------------------


def test_group_std_is_the_sample_std():
    assert group_std([0.0, 1.0]) == pytest.approx(math.sqrt(0.5))
    assert group_std([0.2, 0.4, 0.9]) == pytest.approx(statistics.stdev([0.2, 0.4, 0.9]))
    assert group_std([0.5]) is None


def test_std_ema_by_hand():
    cfg = StdFilterConfig(beta=0.5, decay=0.9, skip_steps=1, warmup_steps=2)
    assert cfg.first_filtered_step() == 4
    state = None
    seen = []
    for step, stds in enumerate([[9.0], [0.2, 0.4], [0.6], [0.1, 0.3], [0.5]], start=1):
        ema = step_std_ema(state, step, cfg)
        state = std_filter_state(state, step, ema, stds, cfg)
        seen.append((ema, state["mean"], list(state["warmup"])))
    # step 1 skipped (its 9.0 never counts); steps 2 and 3 warm up; step 4 starts at their means' mean (0.3 and
    # 0.6 -> 0.45); step 5: 0.9 * 0.45 + 0.1 * step 4's mean 0.2
    assert [s[0] for s in seen] == [None, None, None, pytest.approx(0.45), pytest.approx(0.9 * 0.45 + 0.1 * 0.2)]
    assert seen[2][2] == [pytest.approx(0.3), pytest.approx(0.6)]
    assert seen[4][2] == seen[2][2]  # no more warm-up means once filtering


def test_std_floor_decides_keep_and_drop():
    cfg = DynamicSamplingConfig(enabled=True, std=StdFilterConfig(), max_refills=1)
    groups = [[0.1, 0.1], [0.1, 0.3], [0.0, 0.5], [0.2, 0.25], [0.1, 0.9]]  # stds 0, .141, .354, .035, .566
    decision = filter_groups(groups, 2, 0, cfg, groups, std_floor=0.2)
    assert decision.zero_variance == (0,)
    assert decision.low_std == (1, 3)
    assert decision.keep == (2, 4)
    assert filter_groups(groups, 3, 0, cfg, groups, std_floor=0.2).refill_prompts == 2  # ceil(1.5 x 1)
    assert filter_groups(groups, 4, 0, cfg, groups).keep == (1, 2, 3, 4)  # no floor yet: variance is enough


def test_the_filter_stage_carries_the_std_state():
    cfg = DynamicSamplingConfig(enabled=True, std=StdFilterConfig(beta=1.0, skip_steps=0, warmup_steps=1))
    rollouts = pa.table(
        {
            "rollout_id": [f"r{i}" for i in range(6)],
            "slot": [0, 0, 1, 1, 2, 2],
            "sample_index": [0, 1] * 3,
            "problem_id": ["a", "a", "b", "b", "c", "c"],
        }
    )
    rewards = pa.table(
        {
            "rollout_id": [f"r{i}" for i in range(6)],
            "status": ["ok"] * 6,  # RLPR's rows: their variance is their scores'
            "score": [0.1, 0.3, 0.0, 0.8, 0.4, 0.4],
            "verifier": ["rlpr"] * 6,
        }
    )
    params = {"batch_size": 2, "refills_done": 1, "first_slot": 0}
    inputs = Inputs.given(rollouts=rollouts, rewards=rewards)
    first = filter_build(inputs, cfg, StageContext("r", 0, 1, "filter", {}, {}, params))
    mean = (math.sqrt(0.02) + math.sqrt(0.32) + 0.0) / 3  # the three groups' stds, kept or not
    assert first.state == {"ema": None, "mean": pytest.approx(mean), "warmup": [pytest.approx(mean)]}
    assert [r["reason"] for r in first.table.to_pylist()] == ["kept", "kept", "zero variance"]  # step 1: no floor
    second = filter_build(inputs, cfg, StageContext("r", 0, 2, "filter", {}, {}, params, first.state))
    floor = mean  # beta 1 x the EMA, which starts at the warm-up step's mean
    assert second.extra["std_floor"] == pytest.approx(floor)
    assert [r["reason"] for r in second.table.to_pylist()] == ["low std", "kept", "zero variance"]
    assert second.state["ema"] == pytest.approx(floor)


def test_std_filter_needs_dynamic_sampling():
    with pytest.raises(ValueError, match="filter.enabled=true"):
        DynamicSamplingConfig(std=StdFilterConfig())


# ----- config ----------------------------------------------------------------------------------------------------


def test_defaults_stay_out_of_dumps():
    assert "reward" not in VerifierConfig().model_dump() and "rlpr" not in VerifierConfig().model_dump()
    assert "std" not in DynamicSamplingConfig().model_dump()
    dumped = VerifierConfig(reward="rlpr", rlpr=RLPRConfig(format_weight=0.2)).model_dump()
    assert dumped["reward"] == "rlpr" and dumped["rlpr"]["format_weight"] == 0.2


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("env.type=retry", "scores its episodes itself"),
        ("restructure.enabled=true", "CLPO"),
        ("select.hints.enabled=true", "GHPO"),
    ],
)
def test_what_rlpr_refuses(tiny_config, override, words):
    with pytest.raises(UserError, match=words) as refused:  # when the config is loaded (flows/compatibility.py)
        tiny_config("x", "label.reward=rlpr", override)
    assert "\n" not in str(refused.value)
    if "hints" in override:  # a template the tiny model reads (flows/compatibility.py)
        override = f"{override} select.hints.template={{prompt}}{{hint}}"
    tiny_config("x", *override.split())  # without RLPR: nothing to refuse here


# ----- whole runs -----------------------------------------------------------------------------------------------


def rlpr_run(root: Path, tiny_config, *extra: str) -> Store:
    from rlvr.flows.runs import execute

    execute(str(root), tiny_config("rlpr", "train.steps=3", "label.reward=rlpr", *extra))
    return Store.open(str(root))


@pytest.mark.slow
def test_a_run_rewarded_by_rlpr(tmp_path, prefect_api, tiny_config):
    store = rlpr_run(
        tmp_path, tiny_config, "filter.enabled=true", "filter.std.skip_steps=0", "filter.std.warmup_steps=1"
    )
    rewards = query(store, "SELECT verifier, status, score, provenance, rollout_id FROM rewards").to_pylist()
    rollouts = {r["rollout_id"]: r for r in query(store, "SELECT rollout_id, policy_id FROM rollouts").to_pylist()}
    assert len(rewards) == len(rollouts) > 0
    assert {r["verifier"] for r in rewards} == {"rlpr"}
    start = query(store, "SELECT DISTINCT policy_id FROM rollouts WHERE step = 1").to_pylist()[0]["policy_id"]
    for row in rewards:
        provenance = json.loads(row["provenance"])
        assert provenance["policy"] == rollouts[row["rollout_id"]]["policy_id"]  # the policy that sampled it
        assert provenance["debias_policy"] == start  # debias_with=start
        assert 0.0 <= row["score"] <= 1.0
    # the debiasing terms: once per problem of the pool, with the starting policy, in one artifact
    terms = query(store, "SELECT problem_id, policy_id, step FROM rlpr_debias").to_pylist()
    pool = query(store, "SELECT count(*) AS n FROM problems WHERE split IN ('train', 'warmup')").to_pylist()[0]["n"]
    assert len(terms) == len({t["problem_id"] for t in terms}) == pool
    assert {t["policy_id"] for t in terms} == {start} and {t["step"] for t in terms} == {None}
    # the held-out evaluation still scores with the problems' verifier
    assert query(store, "SELECT count(*) AS n FROM evals WHERE phase = 'rl'").to_pylist()[0]["n"] == 1
    # the std filter ran with its carried EMA: filtering from step 2 on, on the rewards' own std
    floors = {m.step: m.extra["std_floor"] for m in store.manifests(kind="filtered_groups")}
    assert floors[1] is None and floors[2] is not None and floors[3] is not None


@pytest.mark.slow
def test_sampler_debiasing_is_once_per_problem_and_policy(tmp_path, prefect_api, tiny_config):
    store = rlpr_run(tmp_path, tiny_config, "label.rlpr.debias_with=sampler", "filter.enabled=true")
    terms = query(store, "SELECT problem_id, policy_id, step FROM rlpr_debias").to_pylist()
    pairs = {(t["problem_id"], t["policy_id"]) for t in terms}
    assert len(terms) == len(pairs)  # refill rounds reuse the step's earlier terms
    sampled = query(store, "SELECT DISTINCT problem_id, policy_id FROM rollouts").to_pylist()
    assert pairs == {(r["problem_id"], r["policy_id"]) for r in sampled}
    assert len({t["policy_id"] for t in terms}) == 3  # a policy a step


@pytest.mark.slow
def test_killed_rlpr_run_resumes_to_the_uninterrupted_one(tmp_path, rlvr_forks):
    """A two-rank RLPR run killed three times: its rank 0 once the debiasing terms of two steps are committed, rank 1
    inside the ranks' scoring pass (the `rlpr` operation, placed by tests/test_rank_faults.py's hook), rank 0 again
    once three steps' filtered groups are: resumed, it equals the uninterrupted run (ids, weights, rewards)."""
    from tests.cli_helpers import committed
    from tests.test_kill_resume import final_weights, kill_when

    overrides = [
        "train.data_parallel=2",
        "train.steps=4",
        "select.batch_size=4",
        "allocate.n=4",
        "warmstart.steps=10",
        "difficulty.k=2",
        "evaluate.every=4",
        "checkpoint.every=4",
        "synthesize.source.per_category=10",
        "label.reward=rlpr",
        "label.rlpr.debias_with=sampler",
        "filter.enabled=true",
        "filter.std.skip_steps=0",
        "filter.std.warmup_steps=1",
    ]

    def start(command: str, store: Path, **hook: object) -> Forked:
        if command == "run":
            args = ["run", "--store", str(store), "--run-id", "k", *[a for o in overrides for a in ("--set", o)]]
        else:
            args = ["resume", "k", "--store", str(store)]
        return rlvr_forks.start(args, **hook)  # a process of its own, forked by the worker's ForkServer

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    # the uninterrupted run in this process (`execute`, what `rlvr run` calls): a third interpreter's imports spared
    from rlvr.flows.config import load_config
    from rlvr.flows.runs import execute

    execute(str(reference), load_config(None, ["run_id=k", *overrides]))
    proc = start("run", killed)
    assert kill_when(proc, lambda: committed(killed, "rlpr_debias") >= 2, killed), proc.stderr_text()[-1000:]
    hook = {"hook": "tests.test_rank_faults:kill_rank_1_in_op", "kill_op": "rlpr", "kill_nth": 1}
    proc = start("resume", killed, **hook)
    assert proc.wait(timeout=600) != 0
    assert "data-parallel rank 1 (pid" in proc.stderr_text()
    assert "was killed by SIGKILL during operation 'rlpr'" in proc.stderr_text()
    proc = start("resume", killed)
    assert kill_when(proc, lambda: committed(killed, "filtered_groups") >= 3, killed), proc.stderr_text()[-1000:]
    proc = start("resume", killed)
    assert proc.wait(timeout=600) == 0, proc.stderr_text()

    ids = lambda root: sorted(m.artifact_id for m in Store.open(str(root)).manifests())  # noqa: E731
    assert ids(killed) == ids(reference)
    assert final_weights(killed) == final_weights(reference)
    sql = "SELECT rollout_id, score, status, provenance FROM rewards ORDER BY rollout_id"
    rows = lambda root: query(Store.open(str(root)), sql).to_pylist()  # noqa: E731
    assert rows(killed) == rows(reference)
