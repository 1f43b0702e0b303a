"""The baselines' knobs (resident, static, lod, lru, eap); their engine halves are in `baselines.py`.

    parse_params(POLICIES["static"], {"bits": "2"})    # StaticKnobs.Params(bits=2)
"""

from __future__ import annotations

from dataclasses import dataclass

from moetool.policies.knobs import Knobs, Params, register


@register("resident")
class ResidentKnobs(Knobs):
    @dataclass(frozen=True)
    class Params(Params):
        bits: int = 16


@register("static")
class StaticKnobs(ResidentKnobs):
    @dataclass(frozen=True)
    class Params(Params):
        bits: int = 4


@register("lod")
class LoadOnDemandKnobs(Knobs):
    @dataclass(frozen=True)
    class Params(Params):
        bits: int = 16


@register("lru")
class LRUCacheKnobs(Knobs):
    @dataclass(frozen=True)
    class Params(Params):
        bits: int = 16
        eviction: str = "lru"


@register("eap")
class ActivationPathPrefetchKnobs(LRUCacheKnobs):
    @dataclass(frozen=True)
    class Params(Params):
        bits: int = 16
        eviction: str = "lru"
        k: int = 0  # experts to prefetch per layer; 0 = the model's top-k
