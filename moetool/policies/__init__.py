"""Policies: the registry and every preset's knobs (importing this package registers them, without
torch); `make_policy` imports the presets' engine halves, which take the knobs' places.

    from moetool.policies import POLICIES, make_policy
"""

# In the order the report places the papers' parts.
from moetool.policies import baselines_knobs, fate_knobs, dymoe_knobs, dynaexq_knobs, smoe_knobs  # noqa: F401,I001  (each registers its presets)
from moetool.policies.knobs import POLICIES, Knobs, hooked, register


def __getattr__(name: str):
    """`Policy` and `make_policy`, the engine's half of the contract: torch is imported when they are asked for."""
    if name in ("Policy", "make_policy"):
        from moetool.policies import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Knobs", "POLICIES", "Policy", "hooked", "make_policy", "register"]
