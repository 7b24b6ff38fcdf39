"""RESP encoding cost on the two hot paths (cluster.resp): a request's commands on the API
(the routing pick's EVALSHA, the Celery message's LPUSH, the task-sent PUBLISH) and one
token frame's PUBLISH in the engine. Best of 40 interleaved rounds, one process.

    python bench/resp_encode.py
"""

from __future__ import annotations

import json
import timeit

from cluster.resp import _encode_py, bulk, command_head, encode

MSG = json.dumps({"body": "x" * 1500, "headers": {"id": "abc" * 10}}).encode()
REQUEST = [
    ("EVALSHA", "a" * 40, 3, "load:generate", "idx:generate", "x", "worker-1", 17, 0.5, "abc"),
    ("LPUSH", "generate", MSG),
    ("PUBLISH", "celeryev.task", MSG[:600]),
]
FRAME = b'{"s":3,"t":[123],"x":"hello"}'
CHANNEL = "tokens:chatcmpl-6dbfcc9472bd467fa809fe372b34ec29"
HEAD = command_head(3, "PUBLISH", CHANNEL)


def main() -> None:
    assert encode(REQUEST) == _encode_py(REQUEST)
    assert HEAD + bulk(FRAME) == encode([("PUBLISH", CHANNEL, FRAME)])
    cases = {
        ("request (3 commands)", "hiredis.pack_command"): lambda: encode(REQUEST),
        ("request (3 commands)", "Python fallback"): lambda: _encode_py(REQUEST),
        ("frame PUBLISH", "cached head + bulk"): lambda: HEAD + bulk(FRAME),
        ("frame PUBLISH", "hiredis.pack_command"): lambda: encode([("PUBLISH", CHANNEL, FRAME)]),
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(40):
        for k, fn in cases.items():
            best[k] = min(best[k], timeit.timeit(fn, number=20000) / 20000)
    print(f"{'path':<22} {'encoder':<22} {'ns':>7}")
    for (path, how), t in best.items():
        print(f"{path:<22} {how:<22} {t * 1e9:>7.0f}")


if __name__ == "__main__":
    main()
