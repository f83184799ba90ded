"""Format verifier: rewards the tag structure of a response (e.g. <think>...</think><answer>...</answer>),
not its content; used alone or as the gate of a composite (docs/methods.md#format-reward).

Reference (a dict, its JSON string, or None for the defaults):
  {"tags": ["think", "answer"], "require_order": true, "exactly_once": true}
A tag is well formed when its <tag> and </tag> markers alternate, opening first and closing last (no
nesting of the same tag), and, with exactly_once, occur as exactly one pair. The response is exactly
structured when every tag is well formed, the tag pairs do not overlap or nest in each other, they come
in the order of `tags` (with require_order), and nothing but whitespace lies outside them.

Components: one per tag (1 if well formed), "order" (with require_order: 1 if every tag is well formed
and the pairs come in order), "outside" (1 if only whitespace lies outside the pairs) and "structured".
Value: 1.0 when exactly structured, else 0.5 × the fraction of tags that are well formed, so a partly
formatted response earns something but always less than a clean one.

Statuses: ok when exactly structured; wrong otherwise; unparseable for an empty response; error for a
bad reference or a non-string response.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlvr.verifiers.base import Score, Verifier, non_text_error

DEFAULT_TAGS = ("think", "answer")
PARTIAL_WEIGHT = 0.5
_TAG_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_OPTION_KEYS = {"tags", "require_order", "exactly_once"}

Span = tuple[int, int, int, int]  # start of <tag>, end of <tag>, start of </tag>, end of </tag>


def tag_spans(text: str, tag: str) -> list[Span] | None:
    """The pairs of one tag in order, or None when its markers do not alternate open/close."""
    spans: list[Span] = []
    opened: re.Match[str] | None = None
    for marker in re.finditer(f"<{re.escape(tag)}>|</{re.escape(tag)}>", text):
        closing = marker.group().startswith("</")
        if closing == (opened is None):
            return None
        if closing:
            assert opened is not None
            spans.append((opened.start(), opened.end(), marker.start(), marker.end()))
            opened = None
        else:
            opened = marker
    if opened is not None:
        return None
    return spans


def _options(reference: Any) -> tuple[list[str], bool, bool] | str:
    """(tags, require_order, exactly_once), or a reason the reference cannot be used."""
    if reference is None:
        reference = {}
    if isinstance(reference, str):
        try:
            reference = json.loads(reference) if reference.strip() else {}
        except (ValueError, RecursionError):
            return "format reference is not JSON"
    if not isinstance(reference, dict):
        return 'format reference must be {"tags": [...], "require_order": bool, "exactly_once": bool} or null'
    unknown = set(reference) - _OPTION_KEYS
    if unknown:
        return f"unknown format options {sorted(unknown)}; known: {sorted(_OPTION_KEYS)}"
    tags = reference.get("tags", list(DEFAULT_TAGS))
    if not isinstance(tags, list) or not tags or not all(isinstance(t, str) and _TAG_NAME.fullmatch(t) for t in tags):
        return "format tags must be a non-empty list of tag names"
    if len(set(tags)) != len(tags):
        return "format tags must not repeat"
    require_order = reference.get("require_order", True)
    exactly_once = reference.get("exactly_once", True)
    if not isinstance(require_order, bool) or not isinstance(exactly_once, bool):
        return "require_order and exactly_once must be true or false"
    return tags, require_order, exactly_once


class FormatVerifier(Verifier):
    name = "format"
    domain = "format"
    version = "1"

    def reference_error(self, reference: Any) -> str | None:
        """Only the options need to parse; None and "" are the defaults, not a missing reference."""
        options = _options(reference)
        return options if isinstance(options, str) else None

    def score(self, response: str, reference: Any) -> Score:
        options = _options(reference)
        if isinstance(options, str):
            return Score(0.0, "error", reason=options)
        tags, require_order, exactly_once = options
        if (problem := non_text_error(response)) is not None:
            return problem
        zeros = {tag: 0.0 for tag in tags}
        if require_order:
            zeros["order"] = 0.0
        zeros.update(outside=0.0, structured=0.0)
        if not response.strip():
            return Score(0.0, "unparseable", zeros, reason="empty response")

        components = dict(zeros)
        spans_by_tag: dict[str, list[Span]] = {}
        problems = []
        for tag in tags:
            spans = tag_spans(response, tag)
            if spans is None or not spans:
                problems.append(f"<{tag}> missing or unbalanced")
            elif exactly_once and len(spans) != 1:
                problems.append(f"<{tag}> appears {len(spans)} times")
            else:
                components[tag] = 1.0
            if spans:
                spans_by_tag[tag] = spans

        in_text_order = sorted((span, tags.index(tag)) for tag, spans in spans_by_tag.items() for span in spans)
        overlapping = any(later[0] < earlier[3] for (earlier, _), (later, _) in zip(in_text_order, in_text_order[1:]))
        outside_text, position = [], 0
        for span, _ in in_text_order:
            outside_text.append(response[position : span[0]])
            position = max(position, span[3])
        outside_text.append(response[position:])
        clean_outside = not overlapping and not "".join(outside_text).strip()
        components["outside"] = 1.0 if clean_outside else 0.0
        if overlapping:
            problems.append("tag pairs overlap or nest")
        elif not clean_outside:
            problems.append("text outside the tags")

        all_tags_ok = all(components[tag] == 1.0 for tag in tags)
        if require_order:
            indexes = [index for _, index in in_text_order]
            in_order = all_tags_ok and not overlapping and indexes == sorted(indexes)
            components["order"] = 1.0 if in_order else 0.0
            if all_tags_ok and not in_order and not overlapping:
                problems.append(f"tags not in the order {tags}")
        structured = all_tags_ok and clean_outside and (not require_order or components["order"] == 1.0)
        components["structured"] = 1.0 if structured else 0.0

        last_spans = spans_by_tag.get(tags[-1])
        extracted = response[last_spans[-1][1] : last_spans[-1][2]].strip()[:2000] if last_spans else None
        if structured:
            return Score(1.0, "ok", components, extracted, "exactly structured")
        value = PARTIAL_WEIGHT * sum(components[tag] for tag in tags) / len(tags)
        return Score(value, "wrong", components, extracted, "; ".join(problems))
