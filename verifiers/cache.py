"""The reward cache: verdicts kept in the store, keyed by (verifier, version, response hash, reference hash).

Labelling the same answer to the same problem again (common in RL: a policy repeats itself) is a
lookup, not a verifier call; after a verifier upgrade the version changes, so only the new version's
verdicts are computed. Cache entries are `reward_cache` artifacts written by the stages that label;
the in-memory index of a process loads each committed cache artifact once.

Finding new cache artifacts must not cost a listing of the store per labelling call (on object storage
a listing of every manifest is many requests, and grows with the run): the first lookup in a process
lists once, later ones read only the store's reward_cache index log from where they stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlvr.errors import UserError
from rlvr.storage.errors import ArtifactNotFound, DamagedArtifact, DamagedFile
from rlvr.storage.ids import canonical_json
from rlvr.storage.store import Store
from rlvr.verifiers.base import Score
from rlvr.verifiers.judge import JudgeConfig, JudgeVerifier, judged_reference
from rlvr.verifiers.reward_model import RewardModelConfig, RewardModelVerifier
from rlvr.verifiers.rlpr import RLPRConfig

log = logging.getLogger(__name__)

CacheKey = tuple[str, str, str, str]
CACHE_KIND = "reward_cache"


def text_hash(text: Any) -> str:
    """Hash of a response (any value; strings hashed as UTF-8, lone surrogates escaped)."""
    raw = text if isinstance(text, str) else canonical_json(text)
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def reference_hash(reference: Any) -> str:
    """Hash of a reference; dicts hash the same whatever their key order."""
    return text_hash(reference if isinstance(reference, str) else canonical_json(reference))


def score_to_entry(key: CacheKey, score: Score) -> dict[str, Any]:
    verifier, version, response_h, reference_h = key
    return {
        "verifier": verifier,
        "verifier_version": version,
        "response_hash": response_h,
        "reference_hash": reference_h,
        "score": score.value,
        "status": score.status,
        "extracted": score.extracted,
        "reason": score.reason,
        "components": json.dumps(score.components, sort_keys=True),
    }


def entry_key(entry: Mapping[str, Any]) -> CacheKey:
    """The key of a cache entry (a row of a `reward_cache` artifact)."""
    return (entry["verifier"], entry["verifier_version"], entry["response_hash"], entry["reference_hash"])


def entry_to_score(entry: dict[str, Any]) -> Score:
    return Score(
        entry["score"], entry["status"], json.loads(entry["components"] or "{}"), entry["extracted"], entry["reason"]
    )


class RewardCache:
    """Verdicts of one store (or of this process only, without a store), indexed in memory by CacheKey."""

    def __init__(self, store: Store | None) -> None:
        self.store = store
        self._index: dict[CacheKey, Score] = {}
        self._stored: set[CacheKey] = set()  # keys read from the store's artifacts (the rest: this process's only)
        self._loaded: set[str] = set()
        self._log_position: int | None = None  # how far the store's reward_cache log has been read

    def refresh(self) -> None:
        """Index the cache artifacts committed since the last refresh (by any process).

        The first refresh notes where the log ends, then lists every committed cache artifact, in that
        order: an artifact committed in between is in the listing or past that position, never lost.
        """
        store = self.store
        if store is None:
            return
        if self._log_position is None:
            self._log_position = store.index_end(CACHE_KIND)
            ids = [m.artifact_id for m in store.manifests(kind=CACHE_KIND)]
        else:
            ids, self._log_position = store.read_index(CACHE_KIND, self._log_position)
        for artifact_id in ids:
            if artifact_id not in self._loaded:
                self._load(store, artifact_id)

    def _load(self, store: Store, artifact_id: str) -> None:
        try:
            entries = store.read_table(artifact_id).to_pylist()
        except ArtifactNotFound:  # deleted since it was logged
            return
        except (DamagedArtifact, DamagedFile) as exc:  # a cache is a hint: its verdicts are scored again
            log.warning("reward cache: skipping %s", exc)
            self._loaded.add(artifact_id)
            return
        self._stored.update(self.add_entries(entries))
        self._loaded.add(artifact_id)

    def add_entries(self, entries: Iterable[dict[str, Any]]) -> list[CacheKey]:
        """Index cache entries (rows of a `reward_cache` artifact, committed or not yet); their keys."""
        keys = []
        for entry in entries:
            key = entry_key(entry)
            self._index[key] = entry_to_score(entry)
            keys.append(key)
        return keys

    def unstored(self, key: CacheKey) -> bool:
        """Whether the verdict of `key` is known to this process only: one a stage of this process found and has not
        committed yet (a difficulty shard's before that stage's `reward_cache` artifact, which follows its last
        shard)."""
        return key in self._index and key not in self._stored

    def lookup(self, keys: Sequence[CacheKey]) -> list[Score | None]:
        self.refresh()
        return [self._index.get(key) for key in keys]

    def remember(self, key: CacheKey, score: Score) -> None:
        """Index a verdict computed by this process (it reaches the store with the stage's artifact)."""
        self._index[key] = score


def cache_key(verifier: str, version: str, response: Any, reference: Any) -> CacheKey:
    return (verifier, version, text_hash(response), reference_hash(reference))


def verdict_keys(
    names: Sequence[str],
    pairs: Sequence[tuple[Any, Any]],
    cfg: VerifierConfig | None = None,
    questions: Sequence[str] | None = None,
) -> list[CacheKey]:
    """The cache key of each pair (response, reference) scored by the verifier `names[i]`; the judge's keys name
    its config's version and hash the question with the reference (`judged_pairs`)."""
    pairs = judged_pairs(names, pairs, questions)
    cfg = cfg or VerifierConfig()
    return [
        cache_key(name, cfg.endpoint_version(name) or version_of(name), response, reference)
        for name, (response, reference) in zip(names, pairs, strict=True)
    ]


def judged_pairs(
    names: Sequence[str], pairs: Sequence[tuple[Any, Any]], questions: Sequence[str] | None
) -> list[tuple[Any, Any]]:
    """The pairs, each a model scores (the judge, a reward model) with its reference replaced by (question,
    reference): what its verdict depends on, hence what its cache key hashes and what the model is asked."""
    if questions is None or not MODEL_VERIFIERS.intersection(names):
        return list(pairs)
    return [
        (response, judged_reference(question, reference)) if name in MODEL_VERIFIERS else (response, reference)
        for name, (response, reference), question in zip(names, pairs, questions, strict=True)
    ]


MODEL_VERIFIERS = frozenset({JudgeVerifier.name, RewardModelVerifier.name})


def stage_entries(
    cache: RewardCache, keys: Sequence[CacheKey], scores: Sequence[Score], hits: Sequence[bool]
) -> list[dict[str, Any]]:
    """The cache entries a stage commits: its fresh verdicts, and its hits on verdicts the store does not hold yet
    (ones a stage of this process has not committed), so that every verdict of a rewards row is in the store for
    `rlvr relabel` and any later process to find."""
    chosen = [i for i, hit in enumerate(hits) if not hit or cache.unstored(keys[i])]
    return cache_entries([keys[i] for i in chosen], [scores[i] for i in chosen])


def cache_entries(keys: Sequence[CacheKey], scores: Sequence[Score]) -> list[dict[str, Any]]:
    """Cache entries of the cacheable verdicts among `scores` (of `keys`), one per key: its first verdict."""
    entries: dict[CacheKey, dict[str, Any]] = {}
    for key, score in zip(keys, scores, strict=True):
        if score.status in CACHEABLE and key not in entries:
            entries[key] = score_to_entry(key, score)
    return list(entries.values())


_caches: dict[str, RewardCache] = {}
_local_cache = RewardCache(None)


def reward_cache(store: Store) -> RewardCache:
    """One cache index per store root and process."""
    if store.root not in _caches:
        _caches[store.root] = RewardCache(store)
    return _caches[store.root]


def cache_for(store: Store | None) -> RewardCache:
    """The store's cache, or without a store (a stage's build tested on its own) a process-local one."""
    return reward_cache(store) if store is not None else _local_cache


# Statuses that depend only on (response, reference, version); timeouts and worker deaths may not
# repeat, so they are never cached.
CACHEABLE = frozenset({"ok", "wrong", "unparseable"})


class VerifierConfig(BaseModel):
    """How answers are scored (the `label` section; difficulty, evaluation and CLPO use it too).

    Every problem names its verifier (the `verifier` column of `problems`); `verifier` here, when set,
    scores every problem with that one instead (e.g. `rlvr relabel --verifier math`). `reward: rlpr` rewards the
    RL steps' rollouts with RLPR instead (the `rlpr` stage); the rest of the run still scores with the verifiers.
    """

    model_config = ConfigDict(extra="forbid")

    verifier: str | None = Field(None, description="None: each problem's own verifier; a name: that one for all")
    workers: int = Field(2, ge=0, description="verifier worker processes; 0 scores in-process, without a timeout")
    timeout_s: float = Field(5.0, gt=0, description="hard wall-clock limit per verdict")
    memory_mb: int = Field(2048, ge=64, description="address-space limit of each worker")
    reward: Literal["verifier", "rlpr"] = Field(
        "verifier",
        exclude_if=lambda value: value == "verifier",  # left out of dumps (so of ids) at its default: runs keep theirs
        description="what rewards a step's rollouts: the verifiers, or RLPR's policy probability (docs/rewards.md)",
    )
    rlpr: RLPRConfig = Field(
        default_factory=RLPRConfig,
        exclude_if=lambda value: value == RLPRConfig(),  # left out of dumps at its defaults
        description="RLPR's reward, with reward=rlpr (verifiers/rlpr.py)",
    )
    judge: JudgeConfig | None = Field(
        None,
        exclude=True,  # the run's reward.judge, given here by the run config: ids see it through verifier_identity
        description="the endpoint of problems whose verifier is the judge (set it as reward.judge)",
    )
    reward_model: RewardModelConfig | None = Field(
        None,
        exclude=True,  # the run's reward.model, as the judge
        description="the servers of problems whose verifier is reward_model (set them as reward.model)",
    )

    def endpoint_version(self, name: str) -> str | None:
        """The version of a verifier that needs an endpoint under this config's endpoint; None for the others."""
        if name == JudgeVerifier.name:
            return JudgeVerifier.version if self.judge is None else self.judge.version()
        if name == RewardModelVerifier.name:
            return RewardModelVerifier.version if self.reward_model is None else self.reward_model.version()
        return None

    def verifier_of(self, problem_verifier: str | None) -> str:
        """The verifier that scores a problem whose own verifier is `problem_verifier`."""
        name = self.verifier or problem_verifier
        if not name:
            raise UserError("a problem names no verifier and label.verifier is not set")
        return name


# Scores the cache misses: (cfg, verifier name of each pair, the pairs) -> one Score per pair, in order.
MissScorer = Callable[[VerifierConfig, list[str], list[tuple[Any, Any]]], list[Score]]


def score_fresh(cfg: VerifierConfig, names: list[str], pairs: list[tuple[Any, Any]]) -> list[Score]:
    """Verdicts of `pairs`, each by its verifier `names[i]`, through one pool per verifier (no cache)."""
    scores: dict[int, Score] = {}
    for name in sorted(set(names)):
        todo = [i for i, each in enumerate(names) if each == name]
        fresh = _score_fresh(cfg, name, [pairs[i] for i in todo])
        _check_count(fresh, len(todo), f"verifier {name!r}")
        scores.update(zip(todo, fresh, strict=True))
    return [scores[i] for i in range(len(pairs))]


def _check_count(scores: Sequence[Score], expected: int, scorer: str) -> None:
    """A scorer (possibly remote) must return one verdict per pair: a short or long answer is a bug, not a zero."""
    if len(scores) != expected:
        raise RuntimeError(f"{scorer} returned {len(scores)} verdicts for {expected} answers; expected one per answer")


def score_cached(
    store: Store | None,
    cfg: VerifierConfig,
    pairs: Sequence[tuple[Any, Any]],
    verifiers: Sequence[str | None] | None = None,
    score_misses: MissScorer = score_fresh,
    questions: Sequence[str] | None = None,
) -> tuple[list[Score], list[bool], list[dict[str, Any]]]:
    """Scores of `pairs` (response, reference), each with the verifier `cfg.verifier_of(verifiers[i])`
    (cache first, then `score_misses`: by default that verifier's pool), whether each was a hit, and the
    new cache entries. Without `verifiers`, `cfg.verifier` scores every pair. Which pairs are hits is
    decided before any miss is scored, so the result does not depend on where `score_misses` runs them.

    `cfg.workers == 0` scores in this process (no timeout: only for verifiers that cannot hang).
    Without a store (a stage's build tested on its own) a process-local cache stands in.
    """
    names = [cfg.verifier_of(name) for name in (verifiers or [None] * len(pairs))]
    keys = verdict_keys(names, pairs, cfg, questions)
    asked = judged_pairs(names, pairs, questions)  # the judge is asked the question too
    cache = cache_for(store)
    cached = cache.lookup(keys)
    misses = [i for i, score in enumerate(cached) if score is None]
    fresh = score_misses(cfg, [names[i] for i in misses], [asked[i] for i in misses])
    _check_count(fresh, len(misses), "scoring the reward-cache misses")
    scored = dict(zip(misses, fresh, strict=True))
    scores = [score if score is not None else scored[i] for i, score in enumerate(cached)]
    hits = [score is not None for score in cached]
    entries = stage_entries(cache, keys, scores, hits)
    cache.add_entries(entries)
    return scores, hits, entries


def _score_fresh(cfg: VerifierConfig, name: str, pairs: list[tuple[Any, Any]]) -> list[Score]:
    """Verdicts of one verifier: in-process with `workers == 0`, else through its shared pool."""
    from rlvr.verifiers.pool import score_safely, shared_pool
    from rlvr.verifiers.registry import get_verifier

    if name == JudgeVerifier.name and cfg.judge is not None:
        return judge_scores(cfg.judge, pairs)
    if name == RewardModelVerifier.name and cfg.reward_model is not None:
        return model_scores(cfg.reward_model, pairs)
    if cfg.workers == 0:
        verifier = get_verifier(name)
        return [score_safely(verifier, response, reference) for response, reference in pairs]
    return shared_pool(name, cfg.workers, cfg.timeout_s, cfg.memory_mb).score_many(pairs)


def judge_scores(judge: JudgeConfig, pairs: list[tuple[Any, Any]]) -> list[Score]:
    """The judge's verdicts on (response, (question, reference)) pairs (`judged_pairs`); a pair without its
    question (a caller that gave none) is an error verdict, not a question-less call."""
    from rlvr.verifiers.judge import JudgeClient

    scores, asked, items = _with_questions(pairs, "the judge")
    for i, verdict in zip(asked, JudgeClient(judge).verdicts(items), strict=True):
        scores[i] = verdict.score
    return scores


def model_scores(model: RewardModelConfig, pairs: list[tuple[Any, Any]]) -> list[Score]:
    """The reward model's verdicts on (response, (question, reference)) pairs, as `judge_scores`."""
    from rlvr.verifiers.reward_model import reward_model_scores

    scores, asked, items = _with_questions(pairs, "the reward model")
    for i, score in zip(asked, reward_model_scores(model, items)[0], strict=True):
        scores[i] = score
    return scores


def _with_questions(pairs: list[tuple[Any, Any]], who: str) -> tuple[list[Score], list[int], list[Any]]:
    """Error verdicts for every pair, the indices of the pairs that carry a question, and those as items."""
    from rlvr.verifiers.judge import JudgeItem

    asked = [i for i, (_, ref) in enumerate(pairs) if isinstance(ref, dict) and "question" in ref]
    scores = [Score(0.0, "error", reason=f"{who} was given no question for this answer")] * len(pairs)
    items = [JudgeItem(str(pairs[i][1]["question"]), pairs[i][1]["reference"], str(pairs[i][0])) for i in asked]
    return scores, asked, items


def version_of(name: str) -> str:
    from rlvr.verifiers.registry import verifier_class

    return verifier_class(name).version


def score_rollouts(
    store: Store | None,
    cfg: VerifierConfig,
    rollouts: Sequence[dict[str, Any]],
    problems: Mapping[str, tuple[str | None, Any]],
    score_misses: MissScorer = score_fresh,
    questions: Sequence[str] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Verdict columns of a `rewards` row for each rollout (cache first, then `score_misses`), and the new
    cache entries. Rollouts need `response` and `problem_id`; `problems` maps problem ids to (verifier,
    reference); `questions`, one a rollout, are what a judge or a reward model is asked with the answer."""
    pairs = [(r["response"], problems[r["problem_id"]][1]) for r in rollouts]
    verifiers = [problems[r["problem_id"]][0] for r in rollouts]
    scores, hits, entries = score_cached(store, cfg, pairs, verifiers, score_misses, questions)
    names = [cfg.verifier_of(name) for name in verifiers]
    verdicts = [
        {
            "verifier": name,
            "verifier_version": version_of(name),
            "score": s.value,
            "status": s.status,
            "extracted": s.extracted,
            "reason": s.reason,
            "components": json.dumps(s.components, sort_keys=True),
            "cache_hit": hit,
        }
        for name, s, hit in zip(names, scores, hits)
    ]
    return verdicts, entries


def problem_references(table: Any) -> dict[str, tuple[str | None, Any]]:
    """problem_id -> (verifier, reference) from a `problems` table with those three columns."""
    columns = table.select(["problem_id", "verifier", "reference"]).to_pydict()
    return {pid: (v, ref) for pid, v, ref in zip(columns["problem_id"], columns["verifier"], columns["reference"])}


def verifier_identity(cfg: VerifierConfig, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What decides a labelling stage's verdicts: the override, if any, the version of every verifier a problem
    may name (not the pool settings), and the judge's identity when the run has one (`cfg.judge`, the run's
    reward.judge). A verifier that needs an endpoint is versioned by its endpoint's identity only, so runs without
    one keep the ids they had before it was registered."""
    from rlvr.verifiers.registry import registered

    versions = {name: cls.version for name, cls in registered().items() if cls.needs == "nothing"}
    identity: dict[str, Any] = {"verifier": cfg.verifier, "versions": versions}
    if cfg.judge is not None:
        identity["judge"] = cfg.judge.identity()
    if cfg.reward_model is not None:
        identity["reward_model"] = cfg.reward_model.identity()
    return identity
