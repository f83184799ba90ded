"""CLPO's policy rewriter: the policy itself rewrites a problem through the prompt templates registered
beside the domain's verifier (`Verifier.rewrite_templates`), as the paper does for language-model policies.

A template has `{question}` and `{answer}` fields (the reference is shown so the rewrite can keep it, and
the stage rejects a rewrite that reveals it); the policy's greedy completion is the new problem, from the
run's rollout engine when the stage gives one (`complete`), else from transformers on the policy. A chat
model reads the filled template through its own chat template, as it reads every prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rlvr.curricula.clpo import Rewrite, Rewriter, RewriteRequest
from rlvr.trainer.generation import greedy
from rlvr.trainer.policy import Policy
from rlvr.trainer.prompts import prompt_ids


class PolicyRewriter(Rewriter):
    """Rewrites with the policy's greedy completion of the domain's template; None where the domain has
    no template for the mode, the prompt would not fit the model's context, or the completion is empty."""

    name = "policy"

    def __init__(
        self,
        policy: Policy,
        templates_of: Callable[[str], Mapping[str, str]],
        max_new_tokens: int,
        complete: Callable[[list[str], int], list[str]] | None = None,
    ) -> None:
        """`complete(prompts, max_new_tokens)`: greedy completions (an engine's `greedy`); default: transformers
        on `policy`."""
        self.policy = policy
        self.templates_of = templates_of
        self.max_new_tokens = max_new_tokens
        self.complete = complete or (lambda prompts, limit: greedy(policy, prompts, max_new_tokens=limit))

    def rewrite(self, requests: Sequence[RewriteRequest]) -> list[Rewrite | None]:
        prompts: dict[int, str] = {}
        for i, request in enumerate(requests):
            template = self.templates_of(request.domain).get(request.mode)
            if template is not None:
                prompt = template.format(question=request.prompt, answer=request.answer)
                if self._fits(prompt):
                    prompts[i] = prompt
        texts = self.complete(list(prompts.values()), self.max_new_tokens) if prompts else []
        completions = dict(zip(prompts, texts, strict=True))
        results: list[Rewrite | None] = []
        for i, request in enumerate(requests):
            text = completions.get(i, "").strip()
            results.append(Rewrite(text, request.answer) if text else None)
        return results

    def _fits(self, prompt: str) -> bool:
        """Whether prompt + completion stay within the model's positions (a small model's may be short)."""
        limit = getattr(self.policy.model.config, "max_position_embeddings", None)
        length = len(prompt_ids(self.policy.tokenizer, [prompt])[0])
        return limit is None or length + self.max_new_tokens <= limit
