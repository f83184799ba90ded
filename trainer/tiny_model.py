"""The built-in tiny model: a character-level tokenizer and a small Qwen2 built from a config.

It needs no download, so the whole pipeline (generation, GRPO, checkpoints) runs for real on a CPU
machine with no hub access. Sizes follow what was measured on the project's 2-core CPU machines
(2026-11-22): ~124k parameters, built in about 35 ms, one GRPO step (16 prompts x 8 samples: generate,
loss, backward, AdamW) in 30-90 ms.
"""

from pydantic import BaseModel, ConfigDict
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlvr.trainer.rng import seeded_rng

VOCAB: list[str] = ["<pad>", "<s>", "</s>", "<unk>", *[str(d) for d in range(10)], "+", "-", "*", "="]
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of VOCAB, `<s>` prepended to every text, left padding for generation.

    Whitespace is dropped before the split (so "3 + 4 =" and "3+4=" encode alike); any other
    character outside VOCAB becomes `<unk>`.
    """
    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
    )


class TinyModelConfig(BaseModel):
    """Shape of the built-in model (a Qwen2 decoder); the defaults are the measured CPU setting."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 64


def tiny_config(cfg: TinyModelConfig) -> Qwen2Config:
    """The built-in model's transformers config: a float32 Qwen2 with tied embeddings over VOCAB."""
    return Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=VOCAB.index(PAD),
        bos_token_id=VOCAB.index(BOS),
        eos_token_id=VOCAB.index(EOS),
        dtype="float32",
    )


def build_tiny_model(cfg: TinyModelConfig, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised float32 Qwen2 with tied embeddings over VOCAB (`tiny_config`).

    The initial weights depend only on `seed`; the caller's global RNG state is left as it was.
    """
    config = tiny_config(cfg)
    with seeded_rng(seed):
        model = Qwen2ForCausalLM(config)
    model.float()
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.eval()
    return model
