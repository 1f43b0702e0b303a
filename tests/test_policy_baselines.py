"""The baselines' rules on hand-made routing traces."""

from moetool.policies import make_policy
from moetool.policies.base import Fetch

from policy_fakes import FakeCache, make_ctx, make_view


def test_eap_counts_co_activations_of_routed_experts_only():
    """EAP's table counts, for each expert of layer i, the experts of layer i+1 the same token ran. A
    slot the router dropped (-1, or E) runs no expert; it was counted as expert 0 (or E-1), so a later
    token that did run expert 0 prefetched layer 1's experts on the strength of slots that ran nothing."""
    ctx = make_ctx(layers=(0, 1), E=8, k=2)
    pol = make_policy("eap", {}, ctx)
    cache = FakeCache(pol.pools())
    pol.prefetch(make_view([[-1, 8], [2, 5]], cache, pos=0))  # token 0 dropped both slots
    pol.prefetch(make_view([[3, 4], [6, 6]], cache, pos=1))
    table = pol.counts[0]
    assert table[2].tolist() == table[5].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    assert table.sum() == 2  # experts 2 and 5 -> 6, once each (a repeated slot is one use)
    assert pol.prefetch(make_view([[0, 7]], cache, pos=0)) == []  # 0 and 7 never ran: nothing predicted
    assert pol.prefetch(make_view([[2, 7]], cache, pos=0)) == [Fetch(1, 6, pol.params.bits)]
