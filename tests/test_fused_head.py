"""The fused LM head (trainer/fused_head.py): the numbers and gradients of the logits path, without keeping
vocabulary-sized logits for the backward."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from rlvr.trainer.fused_head import head_parts, use_fused
from rlvr.trainer.logprobs import completion_logprobs, completion_logprobs_and_entropy
from rlvr.trainer.vocab_blocks import block_positions, position_blocks

VOCAB, PAD = 301, 0


def model(tied: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        pad_token_id=PAD,
    )
    return Qwen2ForCausalLM(config).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts [6, 5] and completions [6, 9] (8 x 9 = 54 positions: more than the hidden width)."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, VOCAB, (6, 5), generator=generator)
    prompts[0, :2] = PAD
    prompts[3, :1] = PAD
    completions = torch.randint(1, VOCAB, (6, 9), generator=generator)
    return prompts, completions


def logp_and_grads(m: torch.nn.Module, fused: bool, temperature: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m.zero_grad()
    prompts, completions = batch()
    logp = completion_logprobs(m, prompts, completions, PAD, temperature=temperature, fused=fused)[0]
    weights = torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)
    (logp * weights).sum().backward()
    return logp.detach(), {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_logprobs_and_gradients_as_the_logits_path(tied, temperature) -> None:
    m = model(tied)
    plain, plain_grads = logp_and_grads(m, False, temperature)
    fused, fused_grads = logp_and_grads(m, True, temperature)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert fused_grads.keys() == plain_grads.keys()
    assert "lm_head.weight" in fused_grads or tied
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_autocast_gradients_match_the_logits_path_in_blocks_of_part_rows(temperature, monkeypatch) -> None:
    """The backward's hand-written logit gradient, blocks of 7 positions (pieces of 9-token rows): under bf16
    autocast, the gradients autograd gives the logits path."""
    import rlvr.trainer.fused_head as fused_head

    monkeypatch.setattr(fused_head, "block_positions", lambda vocab, device: 7)
    m = model(tied=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, plain_grads = logp_and_grads(m, False, temperature)
        fused, fused_grads = logp_and_grads(m, True, temperature)
    torch.testing.assert_close(fused, plain, rtol=0, atol=2e-2)
    assert fused_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=2e-2, atol=2e-3, msg=name)


def test_entropy_matches_and_bf16_autocast_stays_close() -> None:
    m = model(tied=True)
    prompts, completions = batch()
    with torch.no_grad():
        plain = completion_logprobs_and_entropy(m, prompts, completions, PAD, 1.0, fused=False)
        fused = completion_logprobs_and_entropy(m, prompts, completions, PAD, 1.0, fused=True)
        for got, want in zip(fused, plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain_bf16 = completion_logprobs(m, prompts, completions, PAD, fused=False)[0]
            fused_bf16 = completion_logprobs(m, prompts, completions, PAD, fused=True)[0]
    assert (plain_bf16 - plain[0]).abs().max() > 1e-4  # autocast really changed the numbers
    torch.testing.assert_close(fused_bf16, plain_bf16, rtol=0, atol=2e-2)


def saved_sizes(m: torch.nn.Module, fused: bool) -> list[int]:
    """The element counts of every tensor autograd saves for the backward of one log-prob pass."""
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    prompts, completions = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        completion_logprobs(m, prompts, completions, PAD, fused=fused)
    return sizes


def test_no_vocabulary_sized_logits_are_kept_for_the_backward() -> None:
    m = model(tied=False)
    logits_numel = batch()[1].numel() * VOCAB  # [R, T, V]
    assert max(saved_sizes(m, fused=False)) >= logits_numel
    assert max(saved_sizes(m, fused=True)) < logits_numel


def test_which_models_fuse() -> None:
    qwen = model(tied=True)
    assert head_parts(qwen) is not None
    assert not use_fused(qwen, None)  # auto: CUDA only, so CPU figures stay exact
    assert use_fused(qwen, True)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2)).eval()
    assert head_parts(gpt2) is None and not use_fused(gpt2, None)
    prompts, completions = batch()
    with pytest.raises(ValueError, match=r"^the fused LM head needs one of \['LlamaForCausalLM', "):
        completion_logprobs(gpt2, prompts, completions, PAD, fused=True)


def test_blocks_are_larger_on_a_gpu_where_each_one_costs_a_pass_over_the_heads_weight() -> None:
    qwen_vocab, micro_batch = 151_936, (32, 256)  # Qwen2.5-0.5B, 32 rows of 256 completion tokens
    assert block_positions(qwen_vocab) == block_positions(qwen_vocab, "cpu") == 55
    assert block_positions(qwen_vocab, torch.device("cuda", 1)) == 441
    assert len(position_blocks(*micro_batch, block_positions(qwen_vocab))) == 32 * 5
    assert len(position_blocks(*micro_batch, block_positions(qwen_vocab, "cuda"))) == 32  # a whole row each
    assert block_positions(10**9, "cuda") == 1


@pytest.mark.parametrize("fused", [False, True])
def test_an_fp32_head_under_bf16_autocast_is_the_float32_head_on_the_bf16_decoders_output(fused) -> None:
    """`fp32_head`: the decoder runs under bf16 autocast, the head's matmul in float32. Its log-probs are exactly the
    float32 head applied by hand to the bf16 decoder's hidden states, on both paths, and nearer the float32 model's
    than the all-bf16 ones. Mutation that fails it: the head's matmul left to autocast (bf16)."""
    from rlvr.trainer.fused_head import completion_hidden

    m = model(tied=False)
    prompts, completions = batch()
    with torch.no_grad():
        exact = completion_logprobs(m, prompts, completions, PAD, fused=False)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = completion_logprobs(m, prompts, completions, PAD, fused=fused)[0]
            head32 = completion_logprobs(m, prompts, completions, PAD, fused=fused, fp32_head=True)[0]
            hidden = completion_hidden(m.model, prompts, completions, PAD)
        logits = hidden.float() @ m.lm_head.weight.float().t()
        by_hand = torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(head32, by_hand, rtol=0, atol=1e-5)
    assert (head32 - exact).abs().mean() < (bf16 - exact).abs().mean()
