"""LocalTier.agreed_step on a faked 3-process table: with 2 processes the neighbour before and after
a process are the same one, so only 3 or more tell which copy holds whose shards."""

import numpy as np

from zaya_jax.parallel import distributed
from zaya_jax.train import local_tier
from zaya_jax.train.local_tier import Agreed, LocalTier


def agreed(monkeypatch, owns: list[list[int]], peers: list[list[int]], newer_than: int = -1) -> Agreed | None:
    """agreed_step when process p's own copy holds steps owns[p] and its peer copy (process p+1's
    shards, module docstring) steps peers[p]."""
    pad = lambda steps: steps + [-1] * (local_tier.MAX_LISTED - len(steps))  # noqa: E731
    table = np.asarray([pad(own) + pad(peer) for own, peer in zip(owns, peers)], np.int64)
    monkeypatch.setattr(distributed, "gather_ints", lambda values: table)
    tier = object.__new__(LocalTier)
    tier.index, tier.count, tier.own, tier.peer = 0, len(owns), "own", "peer"
    tier.wait = lambda: None
    tier._whole = lambda directory, log: owns[0] if directory == "own" else peers[0]
    return tier.agreed_step(newer_than, print)


def test_a_lost_own_copy_is_restored_from_the_process_before_it(monkeypatch):
    # process 1 lost its own step 20; process 0's peer copy holds it (process 2's does not: it holds
    # process 0's shards, and lost step 20)
    owns = [[20, 10], [10], [20, 10]]
    peers = [[20, 10], [20, 10], [10]]
    assert agreed(monkeypatch, owns, peers) == Agreed(20, from_peer=[1], held_once=[0, 1])


def test_a_step_only_the_process_after_holds_is_not_restorable(monkeypatch):
    # process 1's step 20 is in process 2's peer copy only, which holds process 0's shards, not 1's
    owns = [[20, 10], [10], [20, 10]]
    peers = [[10], [20, 10], [20, 10]]
    assert agreed(monkeypatch, owns, peers) == Agreed(10, from_peer=[], held_once=[])
    assert agreed(monkeypatch, owns, peers, newer_than=10) is None


def test_every_process_holding_both_copies_holds_nothing_once(monkeypatch):
    both = [[30, 20], [30, 20], [30, 20]]
    assert agreed(monkeypatch, both, both) == Agreed(30, from_peer=[], held_once=[])
