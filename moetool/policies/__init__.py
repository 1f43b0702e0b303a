"""Policies: the registry and every preset (importing this module registers them all)."""

from moetool.policies import baselines  # noqa: F401  (registers resident, static, lod, lru, eap)
from moetool.policies.base import POLICIES, Policy, make_policy, register

__all__ = ["POLICIES", "Policy", "make_policy", "register"]
