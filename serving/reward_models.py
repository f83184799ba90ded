"""The model behind a reward server (`rlvr serve-rm`, serving/server.py): a local Hugging Face model loaded
for scoring, and what a reward server asks of it.

- A sequence-classification model (its config.json names a `*ForSequenceClassification` architecture: what TRL's
  RewardTrainer and OpenRLHF train as reward models) scores a text with its logits, pooled by the model itself at
  the last token that is not padding, as it was trained. With one label that logit is the reward (OpenRLHF's
  server returns the same, before its optional normalisation); `/classify` gives the labels' probabilities.
- A causal LM scores as a generative judge: the reward is the probability that its next token after a fixed
  question ("is this response correct? Answer Yes or No") is "Yes" rather than "No", sigmoid(logit_Yes - logit_No):
  GenRM's P(Yes) (Zhang et al. 2024, "Generative Verifiers: Reward Modeling as Next-Token Prediction"),
  normalised over the two answers so that mass on other tokens does not lower it. It also completes chats, so it
  can serve as an LLM judge behind an OpenAI-compatible endpoint.

A batch is scored in padded forwards of `batch_size` rows under `torch.no_grad`, each row at the positions it has
alone, so a row's score does not depend on the rows beside it. A text longer than the model's context is refused
(`ScoringError`), never cut: a cut text would get a reward for something it does not say.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from rlvr.errors import UserError
from rlvr.trainer.devices import DEVICE_FORMS, check_device_name, resolve_device
from rlvr.trainer.generation import POLICY_ONLY
from rlvr.trainer.gguf_models import gguf_file
from rlvr.trainer.policy import (
    MODEL_BUILD_LOCK,
    PolicyConfig,
    check_policy_source,
    init_policy,
    load_tokenizer,
    set_threads,
)
from rlvr.trainer.prompts import padded_positions, prompt_ids
from rlvr.trainer.rng import seeded_rng

Kind = Literal["classifier", "causal_lm"]

JUDGE_QUESTION = (
    "Here is a conversation: a prompt and a model's response to it.\n\n{query}\n\n{reference}"
    "Is the response correct? Answer Yes or No."
)
JUDGE_REFERENCE = "The reference answer is: {label}\n\n"
JUDGE_ANSWERS = ("Yes", "No")
KNOWN_NAMES = "'tiny', 'smollm2-135m-instruct'"


class ScoringError(ValueError):
    """A request this model cannot score (a text too long, an endpoint its kind does not serve): the server's 400."""


@dataclass
class ServedModel:
    """A loaded model, what kind it is, and the lock that lets one request at a time use it (torch's RNG, which
    seeded sampling reseeds, is process-wide). `judge_tokens`: a causal LM's ids of "Yes" and "No", None when its
    tokenizer cannot tell them apart (the tiny built-in one spells both as unknown characters)."""

    name: str
    kind: Kind
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    batch_size: int = 16
    judge_tokens: tuple[int, int] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def context(self) -> int | None:
        """The most tokens the model reads (its `max_position_embeddings`), None when its config does not say."""
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if isinstance(value, int) else None

    @property
    def labels(self) -> list[str]:
        """A classifier's label names, in logit order (the config's id2label)."""
        names = getattr(self.model.config, "id2label", None) or {}
        return [str(names.get(i, f"LABEL_{i}")) for i in range(self.model.config.num_labels or 0)]


def load_served_model(
    name: str, *, device: str = "cpu", threads: int = 1, seed: int = 0, batch_size: int = 16
) -> ServedModel:
    """Load `name` for serving: a Hugging Face model directory (or a hub id already in the local cache), "tiny" (the
    built-in model, its weights drawn from `seed`) or a packaged GGUF model's name. Expected failures are one-line
    UserErrors that speak of `--model` and `--device`, the options of `rlvr serve-rm`."""
    target = _device(device)
    source = check_model_source(name)
    set_threads(threads)
    if source != "tiny" and gguf_file(name) is None and _is_classifier(source):
        return _load_classifier(name, source, target, batch_size)
    policy = init_policy(PolicyConfig(model=name, device=device, threads=threads), seed)
    served = ServedModel(name, "causal_lm", policy.model, policy.tokenizer, batch_size)
    served.judge_tokens = judge_tokens(policy.tokenizer)
    return served


def _device(name: str) -> torch.device:
    try:
        check_device_name(name)
    except ValueError:
        raise UserError(f"--device {name!r} is not one of {DEVICE_FORMS}") from None
    if name != "cpu" and name != "auto" and not torch.cuda.is_available():
        raise UserError(f"--device {name} asks for a GPU, but this machine has no usable CUDA device; use --device cpu")
    return resolve_device(name)


def check_model_source(name: str) -> str:
    """Where `--model` points ("tiny", a GGUF file, a model directory or a cached hub id), checked without loading."""
    path = Path(name).expanduser()
    if name != "tiny" and gguf_file(name) is None:
        if path.is_dir() and not (path / "config.json").is_file():
            raise UserError(f"--model {name!r} has no config.json; give a Hugging Face model directory")
        if path.is_file():
            raise UserError(f"--model {name!r} is a file, not a model directory; give a Hugging Face model directory")
        if not path.exists():
            try:
                return check_policy_source(PolicyConfig(model=name))  # a hub id in the local cache
            except UserError:
                raise UserError(
                    f"--model {name!r} is neither a model directory nor a model in the local Hugging Face cache; "
                    f"give a Hugging Face model directory, or one of {KNOWN_NAMES}"
                ) from None
    return check_policy_source(PolicyConfig(model=name))


def _is_classifier(source: str) -> bool:
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    return any(str(a).endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or [])


def _load_classifier(name: str, source: str, device: torch.device, batch_size: int) -> ServedModel:
    """A sequence-classification model in float32 with a pad token (the model finds each row's last token by it)."""
    with MODEL_BUILD_LOCK:
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=torch.float32, local_files_only=True)
        tokenizer = load_tokenizer(source)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"--model {name!r}: its tokenizer has neither a pad nor an eos token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    torch.nn.Module.to(model, device)  # transformers' decorated .to is opaque to mypy
    return ServedModel(name, "classifier", model, tokenizer, batch_size)


def judge_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int] | None:
    """The first token ids of "Yes" and "No", or None when they are one token or an unknown one."""
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in JUDGE_ANSWERS]
    if not all(ids) or ids[0][0] == ids[1][0] or tokenizer.unk_token_id in (ids[0][0], ids[1][0]):
        return None
    return ids[0][0], ids[1][0]


# --- scoring ------------------------------------------------------------------------------------------------


def rewards(served: ServedModel, queries: Sequence[str], labels: Sequence[str | None] | None = None) -> list[float]:
    """One reward per query (OpenRLHF's `query`: the prompt and the response as one text, special tokens written
    out, so nothing is added): a one-label classifier's logit, or a causal LM's P(Yes) as a judge that is given
    the query and, when there is one, its label as the reference answer."""
    if served.kind == "classifier":
        if served.model.config.num_labels != 1:
            raise ScoringError(
                f"{served.name} has {served.model.config.num_labels} labels; a reward model has one (use /classify)"
            )
        rows = _encode(served, list(queries), add_special_tokens=False)
        return [float(logits[0]) for logits in _classifier_logits(served, rows)]
    if served.judge_tokens is None:
        raise ScoringError(
            f"{served.name} cannot judge: its tokenizer has no distinct 'Yes' and 'No' tokens; "
            "serve a sequence-classification reward model or an instruct model"
        )
    given = list(labels) if labels is not None else [None] * len(queries)
    questions = [judge_question(query, label) for query, label in zip(queries, given)]
    rows = _check_lengths(served, prompt_ids(served.tokenizer, questions))
    yes, no = served.judge_tokens
    return [float(torch.sigmoid(last[yes] - last[no])) for last in _last_logits(served, rows)]


def judge_question(query: str, label: str | None) -> str:
    """The judge's prompt for one query, as a one-message chat (what `prompt_ids` reads through the chat template)."""
    reference = "" if label is None else JUDGE_REFERENCE.format(label=label)
    text = JUDGE_QUESTION.format(query=query, reference=reference)
    return json.dumps([{"role": "user", "content": text}])


def class_probabilities(served: ServedModel, texts: Sequence[str]) -> list[list[float]]:
    """A classifier's probabilities per text, as vLLM's /classify computes them from the pooled logits: the
    logits themselves for `problem_type: regression`, sigmoid for one label or multi-label, softmax otherwise.
    The texts get the tokenizer's special tokens (vLLM's default, `add_special_tokens: true`)."""
    if served.kind != "classifier":
        raise ScoringError(f"{served.name} is a causal LM, not a classification model: it does not serve /classify")
    if not texts:
        return []
    logits = torch.stack(_classifier_logits(served, _encode(served, list(texts), add_special_tokens=True)))
    problem = getattr(served.model.config, "problem_type", None)
    if problem == "regression":
        probs = logits
    elif problem == "multi_label_classification" or logits.shape[-1] < 2:
        probs = torch.sigmoid(logits)
    else:
        probs = torch.softmax(logits, dim=-1)
    return [[float(p) for p in row] for row in probs]


def _encode(served: ServedModel, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    encoded = served.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return _check_lengths(served, [list(ids) for ids in encoded])


def _check_lengths(served: ServedModel, rows: list[list[int]], extra: int = 0) -> list[list[int]]:
    """`rows` when each has a token and fits the model's context with `extra` more; a ScoringError otherwise."""
    context = served.context
    for index, ids in enumerate(rows):
        if not ids:
            raise ScoringError(f"text {index} is empty: it has no tokens to score")
        if context is not None and len(ids) + extra > context:
            needs = f"{len(ids)} tokens" + (f" + {extra} to generate" if extra else "")
            raise ScoringError(f"text {index} needs {needs}; {served.name} reads at most {context}")
    return rows


def _batches(served: ServedModel, rows: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Left-padded batches of `batch_size` rows, with each row's own positions (from 0 at its first token)."""
    batches = []
    for start in range(0, len(rows), served.batch_size):
        encoded = served.tokenizer.pad({"input_ids": rows[start : start + served.batch_size]}, return_tensors="pt")
        mask = encoded["attention_mask"]
        batch = {"input_ids": encoded["input_ids"], "attention_mask": mask, "position_ids": padded_positions(mask)}
        batches.append({key: value.to(served.model.device) for key, value in batch.items()})
    return batches


def _classifier_logits(served: ServedModel, rows: list[list[int]]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    with served.lock, torch.no_grad():
        for batch in _batches(served, rows):
            out.extend(served.model(**batch).logits.float().cpu())
    return out


def _last_logits(served: ServedModel, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row's next-token logits after its last token (left padding puts every row's last token at the end)."""
    out: list[torch.Tensor] = []
    with served.lock, torch.no_grad():
        for batch in _batches(served, rows):
            out.extend(served.model(**batch, logits_to_keep=1).logits[:, -1].float().cpu())
    return out


# --- chat ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """One chat completion: its text (special tokens dropped), token counts, and why it ended ("stop": an eos,
    "length": `max_tokens` ran out)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length"]


def complete_chat(
    served: ServedModel,
    messages: list[dict[str, str]],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> Completion:
    """The assistant's next message: the conversation through the model's chat template (a model without one reads
    the messages' contents joined by newlines, trainer/prompts.py), then greedy decoding at temperature 0, else
    sampling at `temperature` and `top_p` (seeded when `seed` is given). The model's own generation_config
    settings that change a draw (repetition penalty, top-k) are neutralised, so temperature 0 is the argmax."""
    if served.kind != "causal_lm":
        raise ScoringError(f"{served.name} is a classification model: it does not serve chat completions")
    (ids,) = _check_lengths(served, prompt_ids(served.tokenizer, [json.dumps(messages)]), extra=max_tokens)
    input_ids = torch.tensor([ids], device=served.model.device)
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    eos = _eos_ids(served)
    seeded = seeded_rng(seed, served.model.device) if seed is not None else nullcontext()
    with served.lock, torch.no_grad(), seeded:
        output = served.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            pad_token_id=served.tokenizer.pad_token_id,
            eos_token_id=sorted(eos),
            **{**POLICY_ONLY, **sampling},
        )
    new = output[0, len(ids) :].tolist()
    end = next((i + 1 for i, token in enumerate(new) if token in eos), None)
    kept = new if end is None else new[:end]
    text = str(served.tokenizer.decode(kept, skip_special_tokens=True))
    return Completion(text, len(ids), len(kept), "length" if end is None else "stop")


def _eos_ids(served: ServedModel) -> set[int]:
    eos = served.model.generation_config.eos_token_id
    if eos is None:
        eos = served.tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else {int(eos)}
