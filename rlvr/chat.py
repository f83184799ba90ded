"""Chat prompts: a problem's prompt is text, or the JSON text of a list of {role, content} messages.

It sits in the package root because a data stage (export) and the trainer (chat templates) both read it.
"""

from __future__ import annotations

import json

from rlvr.errors import UserError


def chat_messages(prompt: str) -> list[dict[str, str]] | None:
    """The messages of a chat prompt (JSON list of {role, content}), or None for a text prompt."""
    if not prompt.lstrip().startswith("["):
        return None
    try:
        parsed = json.loads(prompt)
    except ValueError:
        return None
    if not parsed or not all(isinstance(m, dict) and "role" in m for m in parsed):
        return None
    for position, message in enumerate(parsed):
        if not (isinstance(message["role"], str) and isinstance(message.get("content"), str)):
            raise UserError(f"chat prompt message {position} needs a string role and content: {prompt[:80]!r}")
    return [{"role": m["role"], "content": m["content"]} for m in parsed]


def as_messages(prompt: str) -> list[dict[str, str]]:
    """The prompt as a conversation: its messages, or one user message holding the text."""
    return chat_messages(prompt) or [{"role": "user", "content": prompt}]
