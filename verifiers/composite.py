"""Composite verifiers: one reward made of other verifiers' scores, each kept as its own components so the
trainer can normalise them separately (GDPO, docs/methods.md#gdpo) or gate one on another
(docs/methods.md#composites-and-gating).

Spec (`CompositeVerifier.from_spec(spec, verifier_class)`, given the registry's lookup of a name's class):
  {"name": "math+format", "version": "1",
   "components": [{"verifier": "math", "weight": 0.9},
                  {"verifier": "format", "weight": 0.1, "gate": false}]}
`verifier` is any registered name; `weight` defaults to 1.0; a component with `"gate": true` has no
weight and multiplies the reward by 1[its status is ok] instead (the recommended form of a format
reward: r = 1[format_ok] · r_task). The first component is the primary one and must not be a gate.

  value      = Σ over weighted components of weight · value, times Π over gates of 1[gate status ok]
  components = "<verifier>.value" and "<verifier>.<component>" for each part ("math.correct",
               "format.think", ...)
  status     = the primary component's status, except that a closed gate turns "ok" into "wrong":
               the pipeline counts status ok as a success (pass rates, evaluation), and a response
               whose reward is gated to 0 must not count as one
  extracted  = the primary component's extracted answer

Reference: a dict keyed by component verifier name, `{"math": "42", "format": {"tags": [...]}}`, or its
JSON string; a part with no entry gets None (the format verifier's defaults). Any other reference (a
dict with other keys, a plain string) goes whole to the primary component, the others get None, so
`"42"` works for math_format.

Version: "<spec version>+<verifier>.<version>+..." so that upgrading a part changes the composite's
version (and invalidates cached rewards); change the spec's own "version" when weights or gates change.
Domain: the primary component's domain. A composite made by `from_spec` is a class created at run time,
so a worker pool cannot import it by path: register a subclass (like `MathFormatVerifier`, which names its
parts' classes in `part_classes`) to run one in the pool. This module does not import the registry (which
imports it): a composite is given its parts' classes, so the two never import each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from rlvr.errors import UserError
from rlvr.verifiers.base import Score, Verifier, one_line
from rlvr.verifiers.format import FormatVerifier
from rlvr.verifiers.math import MathVerifier

_SPEC_KEYS = {"name", "version", "components"}
_COMPONENT_KEYS = {"verifier", "weight", "gate"}


def check_spec(spec: Any) -> dict[str, Any]:
    """The spec with defaults filled in; raises UserError saying what is wrong."""
    if not isinstance(spec, dict):
        raise UserError("a composite spec must be a dict with a name and components")
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise UserError(f"unknown composite spec keys {sorted(unknown)}; known: {sorted(_SPEC_KEYS)}")
    name, version, components = spec.get("name"), spec.get("version", "1"), spec.get("components")
    if not isinstance(name, str) or not name:
        raise UserError("a composite spec needs a non-empty name")
    if not isinstance(version, str) or not version:
        raise UserError("a composite spec version must be a non-empty string")
    if not isinstance(components, list) or not components:
        raise UserError(f"composite {name!r} needs a non-empty list of components")
    checked = []
    for component in components:
        if not isinstance(component, dict) or not isinstance(component.get("verifier"), str):
            raise UserError(f'composite {name!r}: each component needs "verifier": NAME')
        unknown = set(component) - _COMPONENT_KEYS
        if unknown:
            raise UserError(
                f"composite {name!r}: unknown component keys {sorted(unknown)}; known: {sorted(_COMPONENT_KEYS)}"
            )
        gate = component.get("gate", False)
        if not isinstance(gate, bool):
            raise UserError(f"composite {name!r}: gate must be true or false")
        if gate and "weight" in component:
            raise UserError(
                f"composite {name!r}: gate {component['verifier']!r} has no weight (it multiplies the reward by 0 or 1)"
            )
        weight = component.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise UserError(f"composite {name!r}: weight of {component['verifier']!r} must be a number")
        checked.append({"verifier": component["verifier"], "weight": None if gate else float(weight), "gate": gate})
    verifiers = [component["verifier"] for component in checked]
    if len(set(verifiers)) != len(verifiers):
        raise UserError(f"composite {name!r}: each verifier may appear once, got {verifiers}")
    if checked[0]["gate"]:
        raise UserError(f"composite {name!r}: the first (primary) component must not be a gate")
    return {"name": name, "version": version, "components": checked}


def composite_version(spec: dict[str, Any], classes: dict[str, type[Verifier]]) -> str:
    return "+".join(
        [spec["version"]] + [f"{part['verifier']}.{classes[part['verifier']].version}" for part in spec["components"]]
    )


class CompositeVerifier(Verifier):
    """Subclasses set `spec` (a checked spec), `part_classes` (each part's verifier name -> class), `name`,
    `domain` and `version`; see the module docstring."""

    spec: ClassVar[dict[str, Any]]
    part_classes: ClassVar[dict[str, type[Verifier]]]

    def __init__(self) -> None:
        self.parts = [
            (part["verifier"], self.part_classes[part["verifier"]](), part["weight"], part["gate"])
            for part in self.spec["components"]
        ]

    @classmethod
    def from_spec(cls, spec: dict[str, Any], lookup: Callable[[str], type[Verifier]]) -> CompositeVerifier:
        """A ready-to-use composite verifier (an instance of a class made for this spec); `lookup` gives the
        class of a part's verifier name (the registry's `verifier_class`) and raises UserError for an unknown
        one."""
        checked = check_spec(spec)
        classes = {part["verifier"]: lookup(part["verifier"]) for part in checked["components"]}
        attributes = {
            "name": checked["name"],
            "domain": classes[checked["components"][0]["verifier"]].domain,
            "version": composite_version(checked, classes),
            "spec": checked,
            "part_classes": classes,
            "__module__": __name__,
        }
        composite_class = type(f"CompositeVerifier[{checked['name']}]", (CompositeVerifier,), attributes)
        return composite_class()

    def _references(self, reference: Any) -> dict[str, Any]:
        names = [name for name, _, _, _ in self.parts]
        keyed = reference
        if isinstance(reference, str):
            try:
                keyed = json.loads(reference)
            except (ValueError, RecursionError):
                keyed = None
        if isinstance(keyed, dict) and keyed and set(keyed) <= set(names):
            return {name: keyed.get(name) for name in names}
        return {name: (reference if index == 0 else None) for index, name in enumerate(names)}

    def reference_error(self, reference: Any) -> str | None:
        """Each part checks its own share of the reference; the first problem is named with its part."""
        references = self._references(reference)
        for name, verifier, _, _ in self.parts:
            try:
                problem = verifier.reference_error(references[name])
            except Exception as exc:
                problem = f"checking the reference raised {type(exc).__name__}: {exc}"
            if problem is not None:
                return one_line(f"{name}: {problem}")
        return None

    def score(self, response: str, reference: Any) -> Score:
        references = self._references(reference)
        weighted_sum = 0.0
        gates_open = True
        components: dict[str, float] = {}
        reasons = []
        primary: Score | None = None
        for name, verifier, weight, gate in self.parts:
            try:
                part = verifier.score(response, references[name])
            except Exception as exc:
                part = Score(0.0, "error", reason=f"{type(exc).__name__}: {exc}"[:300])
            if primary is None:
                primary = part
            components[f"{name}.value"] = part.value
            for key, value in part.components.items():
                components[f"{name}.{key}"] = value
            reasons.append(f"{name} {part.status}" + (f": {part.reason}" if part.reason else ""))
            if gate:
                if part.status != "ok":
                    gates_open = False
                    reasons.append(f"gated to 0 by {name} ({part.status})")
            else:
                weighted_sum += weight * part.value
        assert primary is not None
        value = weighted_sum if gates_open else 0.0
        status = "wrong" if primary.status == "ok" and not gates_open else primary.status
        return Score(value, status, components, primary.extracted, "; ".join(reasons)[:1000])


class MathFormatVerifier(CompositeVerifier):
    """The math reward gated by the think/answer format: 1 only for a correct answer in a clean format."""

    spec = check_spec(
        {
            "name": "math_format",
            "components": [{"verifier": "math", "weight": 1.0}, {"verifier": "format", "gate": True}],
        }
    )
    part_classes: ClassVar[dict[str, type[Verifier]]] = {"math": MathVerifier, "format": FormatVerifier}
    name = "math_format"
    domain = "math"
    version = composite_version(spec, part_classes)
