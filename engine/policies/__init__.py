"""γ policies, parsed from strings such as `fixed:4`, `threshold:0.4`, `heuristic`, `rules`."""
from __future__ import annotations

from typing import Callable

from engine.policies.base import K_MAX, BasePolicy, Policy
from engine.policies.fixed import FixedPolicy
from engine.policies.heuristic import HeuristicPolicy
from engine.policies.rules import RulesPolicy
from engine.policies.threshold import ThresholdPolicy


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


# name → (factory taking the text after ':' or None, example shown in help/errors)
_FACTORIES: dict[str, tuple[Callable[[str | None], Policy], str]] = {
    "ar": (lambda a: FixedPolicy(0) if a is None else _no_arg("ar"), "ar"),
    "fixed": (lambda a: FixedPolicy(_int_arg("fixed", a if a is not None else "4")), "fixed:4"),
    "heuristic": (lambda a: HeuristicPolicy(4 if a is None else _int_arg("heuristic", a)), "heuristic"),
    "threshold": (lambda a: ThresholdPolicy(0.4 if a is None else _float_arg("threshold", a)), "threshold:0.4"),
    "rules": (lambda a: RulesPolicy() if a is None else _no_arg("rules"), "rules"),
}

POLICY_EXAMPLES = [example for _, example in _FACTORIES.values()]


def _no_arg(name: str) -> Policy:
    raise ValueError(f"policy {name} takes no ':' argument")


def make_policy(spec: str) -> Policy:
    """A fresh policy from its string form; raises ValueError naming the known ones."""
    name, _, arg = spec.strip().partition(":")
    if name not in _FACTORIES:
        raise ValueError(f"unknown policy {spec!r}; known: {', '.join(POLICY_EXAMPLES)}")
    return _FACTORIES[name][0](arg if arg else None)


__all__ = ["K_MAX", "BasePolicy", "Policy", "make_policy", "POLICY_EXAMPLES"]
