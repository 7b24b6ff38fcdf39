"""The cluster's control plane: every Redis key, channel and Lua script of the cluster's
state, each written once, with the objects that read and write them. Depends on redis
only (tests/unit/test_layering.py); api, tasks, workers and kvbm build on it.

    keys        the names of the cluster's Redis keys and channels
    lua         the snippets every script shares: Redis's clock, the liveness rule
    queues      kombu's list layout of a Celery queue, and the queues' depths
    ledger      the routers' load ledger: commit, give back, reclaim, the pool's view
    index       the KV-block index: the store (apply, snapshot, stream) and a router's
                local copy of it
    membership  heartbeats (a typed report), liveness, declare-dead, prune
"""
