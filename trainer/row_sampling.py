"""Row-seeded sampling: each row's draw a pure function of (seed, its prompt's key, its sample index, the token's
position), whatever batch it sits in, whatever row it is, on any device, without torch's RNG.

Why: data-parallel ranks each sample a share of a step's prompts. With one RNG stream a call
(`generation.sample`'s default, `rollout.seeding: batch`), a row's tokens depend on which rows share its batch, so
the rank count would change what is sampled. Here no row reads another's randomness: given the same logits,
splitting a batch changes no token.

The draw is Gumbel-max: the logits warped as transformers' sampling warpers warp them (temperature, then top-p),
plus one Gumbel(0, 1) variate each, and the argmax, which is distributed as softmax(warped) exactly; a top-p-filtered
-inf logit stays -inf and never wins. Done over the whole vocabulary that is a hash, two logs and an add on every
one of B x V entries, about 20 passes over a [B, V] int64 or float64 tensor (25 GB of memory traffic a token step
at 512 rows of Qwen's 151,936 tokens: more than the forward pass it follows). So it is done in two stages, each
exact: a block of `BLOCK` consecutive tokens is drawn in proportion to its probability mass (Gumbel-max over the
blocks' log-masses), then a token within it in proportion to its probability (Gumbel-max over that block's warped
logits). P(token) = P(its block) P(token | block) = softmax(warped)[token]. The masses are exp(warped - row max)
summed by halving (x[:h] + x[h:], ...): elementwise adds in a fixed order, so a row's masses are the same bits
whatever the batch, where a reduction kernel's order may depend on the tensor's shape. What touches all B x V
entries is the warpers, a max, an exp and the sums, about 4 float32 passes; the hashing covers B x (V / BLOCK
+ BLOCK) entries.

The Gumbel variates are -log(-log(U)) of U from a counter-based hash, SplitMix64: the row key and the position
(and which stage) mixed into a stream seed, and entry n of the stage (block n, or token n) takes the stream's
output number n + 1, SplitMix64's own sequence mix64(seed + (n + 1) * golden gamma). Its top 53 bits make a float64
uniform in (0, 1), exclusive at both ends; with a float32's 24 bits ties in the top value would occur about once in
V / 2**24 draws over a whole vocabulary (1% at 151,936 tokens), each won by the lower token id. The hash is int64
arithmetic on tensors (torch's int64 multiplication and addition wrap, as it needs; torch's right shift is
arithmetic, so each is masked into a logical one).
"""

from collections.abc import Sequence

import torch
import transformers
from torch import Tensor

BLOCK = 512  # tokens a block (a power of two, for the halving sums); a vocabulary of at most BLOCK is one block
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / the golden ratio, odd)
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finaliser (Stafford's variant 13)
# Which stage a stream serves, mixed in with the position: tokens and blocks draw independent variates.
TOKENS, BLOCKS = 0x243F6A8885A308D3, 0x13198A2E03707344  # pi's fraction, its first two 64-bit words
_BITS = 53  # of each uniform: a float64's significand


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(value: int) -> int:
    """SplitMix64's finaliser on a Python int (taken mod 2**64), as an unsigned 64-bit int: the reference that
    `mix64_tensor` computes on tensors."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _xorshift_right(z: Tensor, shift: int) -> Tensor:
    """z ^ (z >>> shift) in place, the logical shift made from torch's arithmetic one by masking the sign copies."""
    shifted = z >> shift
    shifted &= (1 << (64 - shift)) - 1
    return z.bitwise_xor_(shifted)


def mix64_tensor(z: Tensor) -> Tensor:
    """`mix64` on every element of an int64 tensor, in place (the bit patterns of the unsigned results)."""
    _xorshift_right(z, 30)
    z *= _signed(_MUL1)
    _xorshift_right(z, 27)
    z *= _signed(_MUL2)
    return _xorshift_right(z, 31)


def row_key(seed: int, prompt_key: int, sample_index: int) -> int:
    """The key of one row, as an int64: distinct for distinct (prompt key, sample index) under one seed (each
    mixing step is a bijection of 64 bits; only the last XOR can collide, with probability about 2**-64 a pair),
    and the same in every process."""
    key = mix64(seed)
    key = mix64(key ^ (prompt_key & _MASK64))
    return _signed(mix64(key ^ (sample_index & _MASK64)))


def uniforms(keys: Tensor, position: int, entries: Tensor, stage: int = TOKENS) -> Tensor:
    """U in (0, 1), float64, of the shape of `entries` ([B, N] entry numbers, or [N] for every row): U[b, n]
    depends on keys[b] (int64 row keys), `position`, `stage` and entries[b, n] alone."""
    streams = mix64_tensor(keys ^ _signed(mix64(position + stage)))  # [B]: one stream a (row, position, stage)
    bits = mix64_tensor(streams[:, None] + (entries + 1) * _signed(_GAMMA))  # the stream's output number n + 1
    bits >>= 64 - _BITS
    bits &= (1 << _BITS) - 1
    return bits.double().add_(0.5).mul_(2.0**-_BITS)  # (k + 1/2) / 2**53, exact in float64


def gumbel(keys: Tensor, position: int, entries: Tensor, stage: int = TOKENS) -> Tensor:
    """Gumbel(0, 1) variates, float64: -log(-log(U)) of `uniforms`."""
    return uniforms(keys, position, entries, stage).log_().neg_().log_().neg_()


def block_masses(warped: Tensor, width: int) -> Tensor:
    """[B, ceil(V / width)] each block's sum of exp(warped - the row's max), float32, summed by halving (`width`
    a power of two): the same bits for a row whatever else is in the batch."""
    rows, vocab_size = warped.shape
    blocks = -(-vocab_size // width)
    weights = warped.new_empty(rows, blocks * width)
    weights[:, vocab_size:] = 0.0
    torch.sub(warped, warped.amax(dim=-1, keepdim=True), out=weights[:, :vocab_size]).exp_()
    halves = weights.view(rows, blocks, width)
    while halves.shape[-1] > 1:
        half = halves.shape[-1] // 2
        halves = halves[..., :half] + halves[..., half:]
    return halves[..., 0]


class RowSampler:
    """The token draw of sampling at `temperature` and `top_p`, row-seeded: row b of every call draws with key
    `keys[b]` (see `row_key`) at the position it is given, the new token's index among the generated ones.

    The warpers are transformers' own objects, in `generate`'s order, so what is drawn from is exactly what
    `generate` draws from at these settings (`graph_decoding.sampler`); only the randomness differs.
    """

    def __init__(self, temperature: float, top_p: float, keys: Sequence[int]) -> None:
        self.warpers = transformers.LogitsProcessorList()
        if temperature != 1.0:
            self.warpers.append(transformers.TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            self.warpers.append(transformers.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        self.keys = [_signed(key) for key in keys]
        self._keys_on: dict[torch.device, Tensor] = {}

    def __call__(self, scores: Tensor, position: int) -> Tensor:
        """The chosen tokens [B] given the next-token scores [B, V] (float32 logits, after any eos bar)."""
        rows, vocab_size = scores.shape
        if rows != len(self.keys):
            raise ValueError(f"{rows} rows of scores but {len(self.keys)} row keys")
        if scores.device not in self._keys_on:
            self._keys_on[scores.device] = torch.tensor(self.keys, dtype=torch.int64, device=scores.device)
        keys = self._keys_on[scores.device]
        warped = self.warpers(None, scores)
        if vocab_size <= BLOCK:  # one block: its draw alone (the same draw, without the block stage's work)
            return gumbel(keys, position, torch.arange(vocab_size, device=scores.device)).add_(warped).argmax(dim=-1)
        masses = block_masses(warped, BLOCK)
        blocks = torch.arange(masses.shape[1], device=scores.device)
        block = gumbel(keys, position, blocks, BLOCKS).add_(masses.double().log_()).argmax(dim=-1)
        tokens = block[:, None] * BLOCK + torch.arange(BLOCK, device=scores.device)  # [B, BLOCK]: the block's
        inside = warped.gather(1, tokens.clamp(max=vocab_size - 1)).double()
        inside.masked_fill_(tokens >= vocab_size, float("-inf"))  # the last block's padding
        return tokens.gather(1, gumbel(keys, position, tokens).add_(inside).argmax(dim=-1, keepdim=True))[:, 0]
