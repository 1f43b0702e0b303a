"""Policies: the registry and every preset's knobs (importing this package registers them, without
torch); `make_policy` imports the presets' engine halves, which take the knobs' places.

    from moetool.policies import POLICIES, make_policy
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moetool.errors import MoetoolError
# In the order the report places the papers' parts.
from moetool.policies import baselines_knobs, fate_knobs, dymoe_knobs, dynaexq_knobs, smoe_knobs  # noqa: F401,I001  (each registers its presets)
from moetool.policies.knobs import POLICIES, Knobs, hooked, load_user_policies, parse_params, register

if TYPE_CHECKING:
    from moetool.policies.base import EngineContext, Policy


def make_policy(name: str, settings: dict[str, str], ctx: EngineContext,
                fitted: dict[str, Any] | None = None) -> Policy:
    """The policy registered as `name`, its knobs from `settings` over `fitted`, for one engine. The
    presets' engine halves (torch) are imported here, the first time a policy is built, and take
    their knobs' places in the registry."""
    from moetool.policies import baselines, dymoe, dynaexq, fate, smoe  # noqa: F401

    load_user_policies()
    if name not in POLICIES:
        raise MoetoolError(f"unknown policy '{name}' (known: {', '.join(sorted(POLICIES))}).")
    cls = POLICIES[name]
    policy = cls(parse_params(cls, settings, fitted), ctx)
    asked = [k for k in settings if k in policy.clamped]  # a default's value given, clamped as the default is
    if asked:
        raise MoetoolError(policy.clamped[asked[0]])
    return policy


def __getattr__(name: str):
    """`Policy`, the engine's half of the contract: torch is imported when it is asked for."""
    if name == "Policy":
        from moetool.policies import base

        return base.Policy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Knobs", "POLICIES", "Policy", "hooked", "load_user_policies", "make_policy", "register"]
