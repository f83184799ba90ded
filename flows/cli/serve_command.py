"""`rlvr serve-rm`: a local model as a reward server (serving/server.py; usage: docs/rewards.md)."""

from __future__ import annotations

import os

import typer
from rich.console import Console

from rlvr.errors import UserError

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def serve_rm(
    model: str = typer.Option(
        ...,
        "--model",
        help="a Hugging Face model directory (a sequence-classification reward model or a causal LM), "
        "'tiny' or 'smollm2-135m-instruct'",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="interface to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="port to listen on (0: any free port)"),
    device: str = typer.Option("cpu", "--device", help="auto, cpu, cuda or cuda:N"),
    threads: int = typer.Option(1, "--threads", min=1, help="torch CPU threads (fixed: rewards stay bit-identical)"),
    batch_size: int = typer.Option(16, "--batch-size", min=1, help="rows in one forward pass"),
    seed: int = typer.Option(0, "--seed", help="draws the weights of 'tiny' (other models load theirs)"),
    api_key_env: str | None = typer.Option(
        None,
        "--api-key-env",
        help="environment variable holding an API key: every request without 'Authorization: Bearer KEY' gets 401",
    ),
) -> None:
    """Serve a local model for rewards: OpenRLHF's /get_reward, vLLM's /classify, OpenAI's /v1/chat/completions.

    Runs until Ctrl-C. A sequence-classification model's reward is its logit; a causal LM's is its P(Yes) as a judge.
    """
    key = os.environ.get(api_key_env) if api_key_env is not None else None
    if api_key_env is not None and not key:  # said before the model's modules (torch) are imported: ~5 CPU-s
        raise UserError(f"--api-key-env names {api_key_env!r}, but that environment variable is not set")
    from rlvr.serving.reward_models import load_served_model
    from rlvr.serving.server import listening_socket, loopback, reward_app, serve, url_of

    served = load_served_model(model, device=device, threads=threads, seed=seed, batch_size=batch_size)
    sock = listening_socket(host, port)  # listening before the URL is printed: a client may connect at once
    url = url_of(sock)
    if key is None and not loopback(host):
        err.print(
            f"warning: serving on {host} without --api-key-env: anyone who can reach {url} can use the model",
            markup=False,
            highlight=False,
        )
    say(f"serving {served.name} ({served.kind}) on {url}")
    say(f"  POST {url}/get_reward  {url}/classify  {url}/v1/chat/completions   GET {url}/health")
    if key:
        say(f"  every request needs the header Authorization: Bearer KEY, with the key in ${api_key_env}")
    say("press Ctrl-C to stop it")
    try:
        serve(reward_app(served, api_key=key), sock)
    except KeyboardInterrupt:
        pass
    say("stopped")


def say(text: str) -> None:
    out.print(text, markup=False, highlight=False)
