"""γ policies, parsed from strings such as `fixed:4`, `threshold:0.4`, `heuristic`, `rules`,
`speckv`, `rakv`. The learned and cost-aware ones need a `PolicyContext` (a cost table, stored
controllers); the CLI, the app and the benchmarks build it from the store."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.predictor import Predictor
from engine.costs import CostTable

from engine.policies.base import BasePolicy, Policy
from engine.policies.fixed import FixedPolicy
from engine.policies.heuristic import HeuristicPolicy
from engine.policies.rakv import ALPHA0 as RAKV_ALPHA0, RakvPolicy
from engine.policies.rules import RulesPolicy
from engine.policies.speckv import SpeckvPolicy
from engine.policies.threshold import ThresholdPolicy
from engine.records import K_MAX


@dataclass
class PolicyContext:
    costs: CostTable | None = None  # measured for the pair and tier the policy will run on
    controller: Callable[[str, int | None], Predictor] | None = None  # (name, version or None = active)
    alpha0: float | None = None  # the pair's per-token acceptance measured by stored runs: rakv's prior

    def need_costs(self, policy: str) -> CostTable:
        if self.costs is None:
            raise ValueError(f"policy {policy} needs a cost table: run `python -m engine costs` for this pair and tier")
        return self.costs

    def need_controller(self, name: str, version: int | None) -> Predictor:
        if self.controller is None:
            raise ValueError(f"policy {name} needs a trained controller: run `python -m engine retrain` (and pass --db)")
        return self.controller(name, version)


def _int_arg(name: str, arg: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise ValueError(f"policy {name}: expected an integer after ':', got {arg!r}") from None


def _float_arg(name: str, arg: str) -> float:
    try:
        return float(arg)
    except ValueError:
        raise ValueError(f"policy {name}: expected a number after ':', got {arg!r}") from None


def _version(name: str, a: str | None) -> int | None:
    return None if a is None else _int_arg(name, a)


# name → (factory taking the text after ':' (or None) and the context, example shown in help/errors)
_FACTORIES: dict[str, tuple[Callable[[str | None, PolicyContext], Policy], str]] = {
    "ar": (lambda a, c: FixedPolicy(0) if a is None else _no_arg("ar"), "ar"),
    "fixed": (lambda a, c: FixedPolicy(_int_arg("fixed", a if a is not None else "4")), "fixed:4"),
    "heuristic": (lambda a, c: HeuristicPolicy(4 if a is None else _int_arg("heuristic", a)), "heuristic"),
    "threshold": (lambda a, c: ThresholdPolicy(0.4 if a is None else _float_arg("threshold", a)), "threshold:0.4"),
    "rules": (lambda a, c: RulesPolicy() if a is None else _no_arg("rules"), "rules"),
    "speckv": (lambda a, c: SpeckvPolicy(c.need_controller("speckv", _version("speckv", a)),
                                         c.need_costs("speckv")), "speckv"),
    "speckv-rf": (lambda a, c: SpeckvPolicy(c.need_controller("speckv-rf", _version("speckv-rf", a)),
                                            c.need_costs("speckv-rf"), name="speckv-rf"), "speckv-rf"),
    "speckv-paper": (lambda a, c: SpeckvPolicy(c.need_controller("speckv", _version("speckv-paper", a)), c.costs,
                                               objective="paper", name="speckv-paper"), "speckv-paper"),
    "rakv": (lambda a, c: RakvPolicy(c.need_costs("rakv"), _float_arg("rakv", a)) if a is not None
             else RakvPolicy(c.need_costs("rakv"), RAKV_ALPHA0 if c.alpha0 is None else min(c.alpha0, 0.99), "rakv"),
             "rakv"),
    # RAKV-ASD's baselines, named as in its table: every policy takes the prefix cache's offer
    # when the run has reuse on (--no-reuse: "no reuse").
    "reuse-only": (lambda a, c: FixedPolicy(0, "reuse-only") if a is None else _no_arg("reuse-only"), "reuse-only"),
    "joint": (lambda a, c: FixedPolicy(_int_arg("joint", a or "4"), f"joint:{a or 4}"), "joint:4"),
}
NEEDS_CONTEXT = ("speckv", "speckv-rf", "speckv-paper", "rakv")

POLICY_EXAMPLES = [example for _, example in _FACTORIES.values()]
# What a newcomer meets (the Live decode page, `generate`): cost-aware, it drafts only where the
# measured costs and the acceptance so far say drafting pays, and plain-decodes otherwise.
DEFAULT_POLICY = "rakv"


def _no_arg(name: str) -> Policy:
    raise ValueError(f"policy {name} takes no ':' argument")


def parse_policy(spec: str) -> tuple[str, str | None]:
    """(name, argument) of a policy string; raises ValueError naming the known ones."""
    name, _, arg = spec.strip().partition(":")
    if name not in _FACTORIES:
        raise ValueError(f"unknown policy {spec!r}; known: {', '.join(POLICY_EXAMPLES)}")
    return name, arg or None


def make_policy(spec: str, context: PolicyContext | None = None) -> Policy:
    """A fresh policy from its string form; raises ValueError naming the known ones."""
    name, arg = parse_policy(spec)
    return _FACTORIES[name][0](arg, context or PolicyContext())


__all__ = ["K_MAX", "BasePolicy", "Policy", "PolicyContext", "make_policy", "parse_policy", "POLICY_EXAMPLES",
           "NEEDS_CONTEXT"]
