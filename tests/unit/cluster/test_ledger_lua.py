"""cluster.ledger: the one field schema and clamp rule reach every script that moves load,
and cluster.index's tier numbers are kvbm's."""

from __future__ import annotations

from cluster import index, ledger, membership
from kvbm.protocol import G1, G2, G3


def test_every_script_that_moves_load_uses_the_one_rule() -> None:
    for script in (ledger.COMMIT_LUA, ledger.GIVE_BACK_LUA, ledger.RECLAIM_LUA,
                   membership.PRUNE_LUA):  # fmt: skip
        assert ledger.LEDGER_LUA in script
        body = script.replace(ledger.LEDGER_LUA, "")
        # no script clamps on its own: only LEDGER_LUA writes the load hash's counts with
        # HSET (the clamp)
        assert "HSET" not in body, script
    assert ledger.LEDGER_LUA.count("HSET") == 1  # the field's clamp


def test_the_schema_is_generated_from_python() -> None:
    assert "local LOAD_FIELDS = {'reqs', 'prefill', 'blocks'}" in ledger.LEDGER_LUA


def test_tier_numbers_agree_with_kvbm() -> None:
    assert (index.G1, index.G2, index.G3) == (G1, G2, G3)
