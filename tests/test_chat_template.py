"""Chat models read prompts through their own chat template, everywhere the trainer tokenizes a prompt."""

import json

import pytest
import torch

from rlvr.trainer.generation import Sample, sample
from rlvr.trainer.grpo import GRPOConfig, RolloutBatch, behaviour_logprobs, training_rows
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.trainer.prompts import prompt_ids, prompt_text
from rlvr.trainer.tiny_model import VOCAB, build_tiny_tokenizer

# Built from the tiny tokenizer's characters only: "*" opens a system turn, "-" a user turn, "=" the answer.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}*{% else %}-{% endif %}{{ m.content }}"
    "{% endfor %}{% if add_generation_prompt %}={% endif %}"
)
CHAT = json.dumps([{"role": "system", "content": "1"}, {"role": "user", "content": "3+4="}])


def ids(text: str) -> list[int]:
    """The tiny vocabulary's ids of single characters (and the bos token)."""
    return [
        VOCAB.index(token) for token in (["<s>"] if text.startswith("<s>") else []) + list(text.removeprefix("<s>"))
    ]


@pytest.fixture
def chat_policy() -> Policy:
    policy = init_policy(PolicyConfig(), seed=0)
    policy.tokenizer.chat_template = TEMPLATE
    return policy


def test_template_renders_text_and_chat_prompts_with_one_bos(chat_policy):
    tokenizer = chat_policy.tokenizer
    assert prompt_text(tokenizer, "3+4=") == "<s>-3+4=="
    assert prompt_ids(tokenizer, ["3+4=", CHAT]) == [ids("<s>-3+4=="), ids("<s>*1-3+4==")]


def test_without_a_template_text_is_read_as_is_and_a_chat_is_joined():
    tokenizer = build_tiny_tokenizer()
    assert prompt_text(tokenizer, CHAT) == "1\n3+4="
    assert prompt_ids(tokenizer, ["3+4=", CHAT]) == [ids("<s>3+4="), ids("<s>13+4=")]
    assert prompt_ids(tokenizer, ["3+4="]) == [tokenizer("3+4=")["input_ids"]]


def test_a_repeated_prompt_is_tokenized_once_and_each_row_is_its_own_list(monkeypatch):
    tokenizer = build_tiny_tokenizer()
    seen: list[list[str]] = []
    tokenize = type(tokenizer).__call__
    monkeypatch.setattr(
        type(tokenizer), "__call__", lambda self, texts, **kw: seen.append(texts) or tokenize(self, texts, **kw)
    )
    rows = prompt_ids(tokenizer, ["1+1=", "3+4=", "1+1=", "1+1="])
    assert seen == [["1+1=", "3+4="]]
    assert rows == [ids("<s>1+1="), ids("<s>3+4="), ids("<s>1+1="), ids("<s>1+1=")]
    rows[0].append(0)  # a caller may extend a row (padding) without touching the rows that repeat it
    assert rows[2] == ids("<s>1+1=")


def test_rollouts_and_loss_rows_condition_on_the_templated_prompt(chat_policy):
    plain = init_policy(PolicyConfig(), seed=0)  # same weights, no template: given the rendered text itself
    kwargs = dict(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3)
    templated = sample(chat_policy, ["3+4=", "1+1="], [3, 2], **kwargs)
    assert templated == sample(plain, ["-3+4==", "-1+1=="], [3, 2], **kwargs)

    samples = [Sample(0, 0, [VOCAB.index("7")], "7", 1, "length"), Sample(0, 1, [VOCAB.index("8")], "8", 1, "length")]
    batch = RolloutBatch(prompts=[CHAT], samples=samples, rewards=[1.0, 0.0])
    rows = training_rows(chat_policy, batch, torch.tensor([1.0, -1.0]), torch.tensor([0, 0]))
    assert rows is not None
    assert rows.prompt_ids.tolist() == [ids("<s>*1-3+4==")] * 2


def test_an_end_of_turn_token_that_is_also_the_pad_token_is_attended_to_by_the_loss(chat_policy):
    """SmolLM2's template ends every turn with <|im_end|>, which is also its pad token: the loss must read the
    prompt as the sampler did (only the leading pad run is padding), or π_old and π_θ drift from the sampler."""
    chat_policy.tokenizer.chat_template = TEMPLATE.replace("{{ m.content }}", "{{ m.content }}{{ eos_token }}")
    chat_policy.tokenizer.pad_token = chat_policy.tokenizer.eos_token
    chat_policy.model.generation_config.pad_token_id = chat_policy.tokenizer.pad_token_id
    prompts = [CHAT, "1+1="]  # different lengths: the shorter is left-padded with the same id its turns end with
    assert prompt_ids(chat_policy.tokenizer, prompts)[1] == ids("<s>-1+1=") + [VOCAB.index("</s>")] + ids("=")
    samples = sample(
        chat_policy, prompts, [3, 3], max_new_tokens=4, temperature=1.0, top_p=1.0, seed=5, logprob_temperature=1.0
    )
    again = behaviour_logprobs(chat_policy, prompts, samples, GRPOConfig())
    assert again == [pytest.approx(s.logprobs, abs=1e-5) for s in samples]
