"""γ policies, parsed from strings such as `fixed:4`, `threshold:0.4`, `heuristic`, `rules`,
`speckv`, `rakv`, each optionally followed by the proposers it may draft with and their options:
`<policy>[@<proposer>[:key=value,...][+<proposer>...]]`, e.g. `fixed:4@ngram`,
`fixed:3@ngram:max=3,min=2`, `rakv@draft+ngram` (without `@`: `rakv` and `speckv` choose among
every proposer the pair has, the others draft with the draft model). The learned and cost-aware
ones need a `PolicyContext` (a cost table, stored controllers); the CLI, the app and the
benchmarks build it from the store.

May import: engine.base, engine.decode (records, costs, acceptance)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.decode.acceptance import Predictor
from engine.decode.costs import CostTable
from engine.decode.policies.base import BasePolicy, Policy
from engine.decode.policies.fixed import FixedPolicy, parse_tree
from engine.decode.policies.heuristic import HeuristicPolicy
from engine.decode.policies.learned import SpeckvPolicy
from engine.decode.policies.rakv import ALPHA0 as RAKV_ALPHA0
from engine.decode.policies.rakv import RakvPolicy
from engine.decode.policies.signal_rules import RulesPolicy
from engine.decode.policies.threshold import ThresholdPolicy
from engine.decode.records import K_MAX, PROPOSER_NAMES, PROPOSER_OPTIONS, Positive


@dataclass
class PolicyContext:
    costs: CostTable | None = None  # measured for the pair and tier the policy will run on
    controller: Callable[[str, int | None], Predictor] | None = None  # (name, version or None = active)
    alpha0: float | None = None  # the pair's per-token acceptance measured by stored runs: rakv's prior
    priors: dict[str, float] = field(default_factory=dict)  # the same per proposer, where stored runs measured it

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
    # speckv weighs the proposers other than the draft (and the draft's measured acceptance, see
    # speckv.py) from the pair's priors as rakv does: without them a head right one time in ten
    # started at 0.6 and won steps from the draft.
    "speckv": (lambda a, c: SpeckvPolicy(c.need_controller("speckv", _version("speckv", a)),
                                         c.need_costs("speckv"), priors=c.priors), "speckv"),
    "speckv-rf": (lambda a, c: SpeckvPolicy(c.need_controller("speckv-rf", _version("speckv-rf", a)),
                                            c.need_costs("speckv-rf"), name="speckv-rf", priors=c.priors), "speckv-rf"),
    "speckv-paper": (lambda a, c: SpeckvPolicy(c.need_controller("speckv", _version("speckv-paper", a)), c.costs,
                                               objective="paper", name="speckv-paper"), "speckv-paper"),
    "rakv": (lambda a, c: RakvPolicy(c.need_costs("rakv"), _float_arg("rakv", a), priors=c.priors) if a is not None
             else RakvPolicy(c.need_costs("rakv"), RAKV_ALPHA0 if c.alpha0 is None else min(c.alpha0, 0.99), "rakv",
                             priors=c.priors),
             "rakv"),
    # RAKV-ASD's baselines, named as in its table: every policy takes the prefix cache's offer
    # when the run has reuse on (--no-reuse: "no reuse").
    "reuse-only": (lambda a, c: FixedPolicy(0, "reuse-only") if a is None else _no_arg("reuse-only"), "reuse-only"),
    "joint": (lambda a, c: FixedPolicy(_int_arg("joint", a or "4"), f"joint:{a or 4}"), "joint:4"),
    # a token tree every step (engine/decode/tree.py): N nodes at most, W children a node at most
    "tree": (lambda a, c: parse_tree(a), "tree:8x3"),
}
NEEDS_CONTEXT = ("speckv", "speckv-rf", "speckv-paper", "rakv")
CHOOSERS = NEEDS_CONTEXT  # the policies that choose a proposer per step; the others draft with one

POLICY_EXAMPLES = [example for _, example in _FACTORIES.values()]
# What a newcomer meets (the Live decode page, `generate`): cost-aware, it drafts only where the
# measured costs and the acceptance so far say drafting pays, and plain-decodes otherwise.
DEFAULT_POLICY = "rakv"


def _no_arg(name: str) -> Policy:
    raise ValueError(f"policy {name} takes no ':' argument")


def parse_proposers(text: str) -> tuple[tuple[str, ...], dict[str, dict[str, str]]]:
    """The part of a policy spec after '@' (`ngram:max=3,min=2`, `draft+ngram`): the proposers in
    the spec's order and each one's options as written; raises ValueError naming what is known."""
    names: list[str] = []
    options: dict[str, dict[str, str]] = {}
    for part in text.split("+"):
        name, _, opts = part.strip().partition(":")
        if name not in PROPOSER_OPTIONS:
            raise ValueError(f"unknown proposer {name!r} after '@'; known: {', '.join(PROPOSER_NAMES)}")
        if name in options:
            raise ValueError(f"proposer {name} is named twice after '@'")
        names.append(name)
        options[name] = _options(name, opts)
    return tuple(names), options


# How an option's type reads in an error.
_KINDS = {int: "an integer", float: "a number", Positive: "a positive integer"}


def _options(name: str, text: str) -> dict[str, str]:
    known = PROPOSER_OPTIONS[name]
    out: dict[str, str] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, eq, value = (x.strip() for x in item.partition("="))
        if key not in known:
            raise ValueError(f"unknown option {key!r} for proposer {name}; known: {', '.join(known) or 'none'}")
        if not eq or not value:
            raise ValueError(f"proposer {name}: option {key} needs a value, as in {key}=3")
        if key in out:
            raise ValueError(f"proposer {name}: option {key} is given twice")
        try:
            known[key](value)
        except ValueError:
            raise ValueError(f"proposer {name}: option {key} must be {_KINDS[known[key]]}, got {value!r}") from None
        out[key] = value
    return out


def split_policies(text: str) -> list[str]:
    """A comma-separated list of policy specs, where a spec's own options also hold commas
    (`fixed:2,fixed:3@ngram:max=3,min=2,rakv` is three specs): an item `key=value` belongs to
    the spec before it."""
    specs: list[str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, eq, _ = item.partition("=")
        if eq and specs and "@" in specs[-1] and key.isidentifier():
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def split_spec(spec: str) -> tuple[str, tuple[str, ...] | None, dict[str, dict[str, str]]]:
    """(the policy part, the proposers after '@' or None, their options) of a policy spec."""
    text, at, rest = spec.strip().partition("@")
    if not at:
        return text, None, {}
    names, options = parse_proposers(rest)
    return text.strip(), names, options


def proposer_text(names: tuple[str, ...], options: dict[str, dict[str, str]]) -> str:
    """The '@' part of a spec, written back: `ngram:max=3,min=2`, `draft+ngram`."""
    return "+".join(n + (":" + ",".join(f"{k}={v}" for k, v in options[n].items()) if options.get(n) else "")
                    for n in names)


def parse_policy(spec: str) -> tuple[str, str | None]:
    """(name, argument) of a policy string (its '@' part checked too); raises ValueError naming
    the known ones."""
    text, names, _ = split_spec(spec)
    name, _, arg = text.partition(":")
    if name not in _FACTORIES:
        raise ValueError(f"unknown policy {spec!r}; known: {', '.join(POLICY_EXAMPLES)}")
    if names is not None and len(names) > 1 and name not in CHOOSERS:
        raise ValueError(f"policy {name} drafts with one proposer, not {'+'.join(names)}: name one after '@'")
    return name, arg or None


def make_policy(spec: str, context: PolicyContext | None = None) -> Policy:
    """A fresh policy from its string form; raises ValueError naming the known ones. With an
    '@' part the policy gets those `proposers` (and `proposer_options`), and its name the part."""
    name, arg = parse_policy(spec)
    policy = _FACTORIES[name][0](arg, context or PolicyContext())
    _, names, options = split_spec(spec)
    if names is not None:
        policy.proposers, policy.proposer_options = names, options
        policy.name = f"{policy.name}@{proposer_text(names, options)}"
    return policy


__all__ = ["K_MAX", "BasePolicy", "Policy", "PolicyContext", "make_policy", "parse_policy", "parse_proposers",
           "split_spec", "split_policies", "proposer_text", "POLICY_EXAMPLES", "NEEDS_CONTEXT", "CHOOSERS"]
