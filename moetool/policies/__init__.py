"""Policies: the registry and every preset (importing this module registers them all)."""

from moetool.policies import baselines, dymoe, dynaexq, fate, smoe  # noqa: F401  (each registers its presets)
from moetool.policies.base import POLICIES, Policy, make_policy, register

__all__ = ["POLICIES", "Policy", "make_policy", "register"]
